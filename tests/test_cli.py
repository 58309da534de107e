"""glmvit-encode on the CPU backend (the float32 reference) with the golden tower: outputs, manifest,
skipped bad images, resume, an interrupted run, batching by tokens, --inspect."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from tests.golden import cases

from glmvit_cupy import reference
from glmvit_cupy.checkpoint.bind import bind_tower
from glmvit_cupy.cli import main as cli
from glmvit_cupy.errors import ImageError
from glmvit_cupy.output import LOCK
from glmvit_cupy import preprocess
from glmvit_cupy.scheduling import batching


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "imgs"
    (folder / "sub").mkdir(parents=True)
    Image.fromarray(cases._smooth(100, 150, 1)).save(folder / "a.png")
    Image.fromarray(cases._smooth(64, 64, 2)).save(folder / "sub" / "b.png")
    Image.fromarray(cases._smooth(140, 90, 3)).save(folder / "c.jpg")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (folder / "notes.txt").write_text("not an image")
    return folder


def run(args):
    return cli.main([str(a) for a in args])


def load_all(out):
    manifest = json.loads((out / "manifest.json").read_text())
    tensors = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(str(out / f)))
    return manifest, tensors


def test_encode_folder_skips_bad_image_and_matches_reference(images, tmp_path, capsys):
    out = tmp_path / "out"
    rc = run([images, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"])
    assert rc == 1  # one image failed
    manifest, tensors = load_all(out)
    keys = sorted(manifest["images"])
    assert sorted(os.path.basename(k) for k in keys) == ["a.png", "b.png", "c.jpg"]  # notes.txt: not an image
    assert list(manifest["failed"]) == [os.path.realpath(os.path.join(str(images), "broken.png"))]
    tower = reference.Tower(reference.bind_tower(cases.TOWER_DIR))
    for key in keys:
        entry = manifest["images"][key]
        pv, grid = preprocess([key])
        assert entry["grid_thw"] == grid[0].tolist() and entry["tokens"] == grid[0, 1] * grid[0, 2] // 4
        assert tensors[key].dtype == ml_dtypes.bfloat16 and tensors[key].shape == (entry["tokens"], 256)
        # bf16 storage of the float32 reference; BLAS may round the last float32 bits differently.
        ref = reference.encode_pixels(tower, pv, grid)
        got = tensors[key].astype(np.float32)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 4e-3  # bf16 storage: 2^-8 at worst
    captured = capsys.readouterr()
    assert "skipped" in captured.out and "broken.png" in captured.out and "1 failed" in captured.out


def test_the_bar_counts_no_failure_before_it_counts_its_image(tmp_path, monkeypatch):
    """The bar's failed= counted a failure when the image was prepared, its position only when the writer's
    thread recorded it: "25% 1/4 ... failed=3". A slow writer (each write 0.1 s later) shows every postfix
    the bar draws: its failures never outnumber the images it has counted."""
    import time

    import tqdm

    from glmvit_cupy import output

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(cases._smooth(64, 64, 2)).save(folder / "a.png")
    for i in range(3):
        (folder / f"bad{i}.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    seen = []

    class Bar(tqdm.tqdm):
        def set_postfix(self, *args, **kwargs):
            seen.append((self.n, kwargs["failed"]))
            return super().set_postfix(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    slow = output.Writer._run
    monkeypatch.setattr(output.Writer, "_run", lambda self, fn, a: (time.sleep(0.1), slow(self, fn, a))[1])
    assert run([folder, "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "out", "--cpu"]) == 1
    assert seen and all(failed <= n for n, failed in seen), seen
    assert seen[-1] == (4, 3), seen


def test_a_tower_of_other_patches_and_merges_is_encoded_with_its_own_patching(images, tmp_path):
    """A 3 x 3-merge tower of 16-pixel single-frame patches: the command's canvases, grids and tokens are the
    tower's (48-pixel tokens, 768 values a row), and each embedding is the reference's of those pixels."""
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import write_checkpoint
    from glmvit_cupy.preprocessing.image import Patching

    geo = dataclasses.replace(cases.GEOMETRY, spatial_merge_size=3, patch_size=16, temporal_patch_size=1, depth=1)
    ckpt = write_checkpoint(tmp_path / "m3", geo, seed=5)
    out = tmp_path / "out"
    assert run([images / "a.png", images / "c.jpg", "--checkpoint", ckpt, "--out", out, "--cpu"]) == 0
    manifest, tensors = load_all(out)
    tower = reference.Tower(reference.bind_tower(ckpt))
    for key, entry in manifest["images"].items():
        pv, grid = preprocess([key], patching=Patching.of(geo))
        assert pv.shape[1] == 768 and entry["grid_thw"] == grid[0].tolist() and grid[0, 1] % 3 == 0
        assert entry["tokens"] == grid[0, 1] * grid[0, 2] // 9 == tensors[key].shape[0]
        ref = reference.encode_pixels(tower, pv, grid)
        got = tensors[key].astype(np.float32)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 4e-3


def test_a_tower_whose_patches_are_not_rgb_is_refused_before_any_output(images, tmp_path, capsys):
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "grey", dataclasses.replace(cases.GEOMETRY, in_channels=1, depth=1))
    assert run([images / "a.png", "--checkpoint", ckpt, "--out", tmp_path / "out", "--cpu"]) == 2
    assert "in_channels = 1; use encode_pixels" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_broken_link_is_reported_as_one(images, tmp_path, capsys):
    (images / "gone.png").symlink_to(tmp_path / "moved-away.png")  # found by walking the folder
    out = tmp_path / "out"
    assert run([images, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"]) == 1
    manifest, _ = load_all(out)
    assert sorted(os.path.basename(k) for k in manifest["images"]) == ["a.png", "b.png", "c.jpg"]
    (why,) = [w for w in manifest["failed"].values() if "gone.png" in w]
    assert "gone.png: a broken symbolic link (to " in why and "moved-away.png" in why
    (images / "gone.png").unlink()
    (images / "loop1.png").symlink_to(images / "loop2.png")
    (images / "loop2.png").symlink_to(images / "loop1.png")
    assert run([images / "loop1.png", "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "out2", "--cpu"]) == 1
    manifest, _ = load_all(tmp_path / "out2")
    (why,) = manifest["failed"].values()
    assert "loop1.png: a symbolic link loop (to " in why, why


def test_resume_skips_finished_images(images, tmp_path, capsys):
    out = tmp_path / "out"
    run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"])
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    rc = run([images / "a.png", images / "c.jpg", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"])
    assert rc == 0
    assert "1 of 2 files already" in capsys.readouterr().out
    manifest, tensors = load_all(out)
    assert len(manifest["images"]) == 2 and len(tensors) == 2
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))[: len(shards)] == shards


def interrupt_the_second_launch(monkeypatch):
    """Backends whose second launch raises KeyboardInterrupt (Ctrl-C as a batch goes to the GPU); returns the
    real Backend.__init__, to put back."""
    real, calls = cli.Backend.__init__, {"n": 0}

    def init(self, *a, **kw):
        real(self, *a, **kw)
        inner = self.launch

        def launch_once(batches):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return inner(batches)

        self.launch = launch_once

    monkeypatch.setattr(cli.Backend, "__init__", init)
    return real


def test_interrupted_run_keeps_finished_batches(images, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real = interrupt_the_second_launch(monkeypatch)  # the first batch is on the "GPU" then
    # 16-token minimum images: a.png has 8x12 patches = 24 tokens; one image per batch at 30 tokens.
    args = [images / "a.png", images / "c.jpg", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu",
            "--capacity-tokens", 30, "--max-image-tokens", 30]
    assert run(args) == 130  # Ctrl-C: a sentence, not a traceback
    assert "interrupted; 1 file saved this run (1 in" in capsys.readouterr().err
    manifest, tensors = load_all(out)
    # the first batch is whichever image was prepared first (cli.prepared hands them on as they finish)
    saved = list(manifest["images"])
    assert len(saved) == 1 and saved[0] in {os.path.realpath(str(images / n)) for n in ("a.png", "c.jpg")}
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    monkeypatch.setattr(cli.Backend, "__init__", real)
    assert run(args) == 0
    manifest, tensors = load_all(out)
    assert len(manifest["images"]) == 2 and len(tensors) == 2


def test_ctrl_c_leaves_the_interruption_as_the_last_line_not_the_progress_bar(tmp_path, monkeypatch, capsys):
    """The progress bar is closed when the run stops, not left for Python to print at exit (or whenever it is
    collected): there it came after the line saying the run was interrupted and how to resume."""
    import gc

    rng = np.random.default_rng()
    files = []
    for i in range(2):
        files.append(tmp_path / f"r{i}.png")
        Image.fromarray(rng.integers(0, 256, (int(rng.integers(40, 90)), int(rng.integers(40, 90)), 3),
                                     dtype=np.uint8)).save(files[-1])
    interrupt_the_second_launch(monkeypatch)
    assert run([*files, "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "out", "--cpu"]) == 130
    gc.collect()  # a bar left open prints itself once collected
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1].startswith("glmvit-encode: interrupted; 1 file saved this run"), err[-300:]


def test_ctrl_c_just_after_a_batch_is_handed_to_the_writer_saves_it_once(images, tmp_path, monkeypatch, capsys):
    """Ctrl-C between the hand-over of a computed batch to the writer and the note that it was handed over:
    the interrupted run's cleanup hands the same batch over again, and it must be written once (the same
    image in two shards counted twice, or on a GPU, a second read of freed embeddings)."""
    from glmvit_cupy import output

    out, handed = tmp_path / "out", {"n": 0}
    real = output.Writer.submit

    def submit(self, fn, *a, **kw):
        real(self, fn, *a, **kw)
        if getattr(fn, "__name__", "") == "write":
            handed["n"] += 1
            if handed["n"] == 1:
                raise KeyboardInterrupt  # after the first batch is handed over, before collect returns

    monkeypatch.setattr(output.Writer, "submit", submit)
    args = [images / "a.png", images / "c.jpg", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu",
            "--capacity-tokens", 30, "--max-image-tokens", 30]
    assert run(args) == 130
    assert "interrupted; 1 file saved this run (1 in" in capsys.readouterr().err
    assert handed["n"] == 2  # handed over again by the cleanup, written once
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    manifest, tensors = load_all(out)
    assert len(shards) == 1 and len(manifest["images"]) == 1 and len(tensors) == 1


def test_the_reader_takes_a_fixed_files_new_embedding_but_never_a_changed_files_old_one(tmp_path):
    """A file failed, was fixed and encoded, and the run stopped before its manifest said so (the manifest
    still lists it as failed): read_embeddings gives its new embedding, as a resume keeps it. A file encoded,
    then changed into one that fails: its old embedding, in a shard the manifest no longer lists, is not
    given."""
    from glmvit_cupy.output import read_embeddings

    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (60, 80, 3), np.uint8)).save(src / "a.png")
    (src / "b.png").write_bytes(b"not an image")
    args = [src, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"]
    assert run(args) == cli.FAILED
    failed_manifest = (out / "manifest.json").read_text()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (50, 70, 3), np.uint8)).save(src / "b.png")
    assert run(args) == cli.DONE
    (out / "manifest.json").write_text(failed_manifest)  # as if the run died before its manifest caught up
    manifest, embs = read_embeddings(out)
    b = os.path.realpath(src / "b.png")
    assert sorted(embs) == sorted([os.path.realpath(src / "a.png"), b]) and b not in manifest["failed"]
    assert any(f.endswith("00002.safetensors") for f in os.listdir(out))  # b's embedding, the fixed picture
    (src / "b.png").write_bytes(b"broken again")  # changed, and fails: its shard's embedding is the old picture
    assert run(args) == cli.FAILED
    manifest, embs = read_embeddings(out)
    assert b not in embs and b in manifest["failed"]  # though shard 2 still holds b's older embedding


def test_a_fixed_file_a_stopped_run_encoded_is_taken_by_the_next_and_by_the_reader(tmp_path, capsys):
    """A file failed, was replaced by a good one, and a run encoded it but stopped before its manifest caught
    up: the next run, with nothing left to encode, still writes the manifest, so the file is listed, no longer
    failed, and read_embeddings gives it."""
    from glmvit_cupy.output import read_embeddings

    img, out = tmp_path / "a.png", tmp_path / "out"
    img.write_bytes(b"not an image")
    args = [img, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"]
    assert run(args) == 1
    stale = (out / "manifest.json").read_bytes()  # what the manifest said before the run that encoded it
    Image.new("RGB", (60, 40), (10, 200, 30)).save(img)
    assert run(args) == 0
    (out / "manifest.json").write_bytes(stale)  # that run stopped before its manifest was written
    capsys.readouterr()
    assert run(args) == 0 and "1 of 1 file already in" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    key = os.path.realpath(img)
    assert key in manifest["images"] and key not in manifest["failed"]
    assert key in read_embeddings(str(out))[1]


def test_a_resume_with_other_settings_names_each_setting_and_its_flag(images, tmp_path, capsys):
    """A folder resumed with other settings is refused naming the setting and the flag that gives it: of the video
    settings, only the parts that differ (not the whole dict), and for max_image_tokens that --capacity-tokens
    lowers its default."""
    out = tmp_path / "out"
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"]) == 0
    capsys.readouterr()
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--video-fps", "4",
                "--max-frames", "9"]) == 2
    err = capsys.readouterr().err
    assert ("was written with video.max_frames = 2048, this run asks for 9 (--max-frames); video.target_fps = 2, "
            "this run asks for 4.0 (--video-fps) (the settings are recorded in manifest.json)") in err
    assert "'sample'" not in err and len(err.strip().splitlines()) == 1
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--capacity-tokens",
                "1000"]) == 2
    assert ("was written with max_image_tokens = 8000, this run asks for 1000 (--max-image-tokens; its default is "
            "8000, or --capacity-tokens if lower) (the setting is recorded") in capsys.readouterr().err
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--min-image-tokens",
                "4"]) == 2
    assert "min_image_tokens = 16, this run asks for 4 (--min-image-tokens)" in capsys.readouterr().err


def test_batches_respect_the_token_budget(images, tmp_path):
    out = tmp_path / "out"
    run([images / "a.png", images / "c.jpg", images / "sub", "--checkpoint", cases.TOWER_DIR, "--out", out,
         "--cpu", "--capacity-tokens", 40, "--max-image-tokens", 40])
    manifest, _ = load_all(out)
    per_shard = {}
    for entry in manifest["images"].values():
        per_shard[entry["shard"]] = per_shard.get(entry["shard"], 0) + entry["tokens"]
    assert len(per_shard) >= 2 and max(per_shard.values()) <= 40


def test_a_folder_holds_one_towers_embeddings_wherever_the_checkpoint_lies(images, tmp_path, capsys):
    """The weights' fingerprint says which tower wrote a folder: the same checkpoint moved, or named through
    a link, resumes; the checkpoint rewritten in place with other weights is refused, as is another path
    for a folder that recorded no fingerprint (written by 0.1.0)."""
    import shutil

    tower, out = tmp_path / "tower", tmp_path / "out"
    shutil.copytree(cases.TOWER_DIR, tower)
    assert run([images / "a.png", "--checkpoint", tower, "--out", out, "--cpu"]) == 0
    (tmp_path / "link").symlink_to(tower)
    assert run([images / "sub" / "b.png", "--checkpoint", tmp_path / "link", "--out", out, "--cpu"]) == 0
    shutil.move(tower, tmp_path / "moved")
    assert run([images / "c.jpg", "--checkpoint", tmp_path / "moved", "--out", out, "--cpu"]) == 0
    assert len(load_all(out)[0]["images"]) == 3
    import struct

    for shard in (tmp_path / "moved").glob("*.safetensors"):  # one tower weight's last bit flipped in place
        raw = bytearray(shard.read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        name = next((k for k in json.loads(raw[8:8 + n]) if k.endswith("blocks.0.norm1.weight")), None)
        if name:
            raw[8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]] ^= 1
            shard.write_bytes(bytes(raw))
    capsys.readouterr()
    assert run([images / "a.png", "--checkpoint", tmp_path / "moved", "--out", out, "--cpu"]) == 2
    assert "was written by a tower of other weights (fingerprint " in capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["header"]["weights"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu"]) == 2
    assert "written with checkpoint = '" in capsys.readouterr().err


@pytest.mark.parametrize("prefix,shows", [("x\ud800.visual.", "x\\ud800.visual."),
                                          ("x\n\x1b[31mRED.visual.", "x\\x0a\\x1b[31mRED.visual.")])
def test_inspect_prints_a_hostile_prefix_escaped(capsys, tmp_path, prefix, shows):
    """A tower prefix holding a lone surrogate (a JSON escape in the headers) crashed --inspect's summary with a
    UnicodeEncodeError after every check passed; one holding a newline or a terminal escape was printed raw."""
    import shutil
    import struct

    folder = tmp_path / "t"
    shutil.copytree(cases.TOWER_DIR, folder)
    for shard in folder.glob("*.safetensors"):
        raw = shard.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = {k.replace("model.visual.", prefix, 1): v for k, v in json.loads(raw[8:8 + n]).items()}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k.replace("model.visual.", prefix, 1): v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert run(["--inspect", folder]) == 0
    out = capsys.readouterr().out
    assert f"prefix      {shows}\n" in out and "\x1b" not in out
    out.encode("utf-8")  # strictly: no lone surrogate reached the output


def test_inspect_shows_the_merge_and_what_a_later_step_refuses(capsys, tmp_path):
    """--inspect printed no spatial_merge_size, and passed silently over a tower glmvit-encode refuses once it
    runs (in_channels other than 3) or that the GPU engine refuses (head_dim past its kernels' 256): it shows
    the merge and channels, and a `refused` line for each, saying what still runs the tower."""
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import write_checkpoint

    assert run(["--inspect", cases.TOWER_DIR]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == ("geometry    depth 2, hidden 128, heads 2, mlp 256, out 256, merger 512, "
                                    "patch 14x2, merge 2x2, channels 3") and "refused" not in out, out
    geo = dataclasses.replace(cases.GEOMETRY, depth=1, hidden_size=512, num_heads=1, intermediate_size=64,
                              in_channels=1, spatial_merge_size=3)
    assert run(["--inspect", write_checkpoint(tmp_path / "odd", geo, seed=2)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].endswith("patch 14x2, merge 3x3, channels 1"), lines
    assert lines[-2] == ("refused     images and videos: in_channels = 1, but images and video frames are RGB (3 "
                         "channels), so glmvit-encode, glmvit-serve and encode(images) refuse this tower; only "
                         "encode_pixels, given pixel_values of that many channels, runs it")
    assert lines[-1] == ("refused     the GPU: head_dim = 512 / 1 = 512, but the GPU engine's attention kernels take "
                         "head dims that are multiples of 4 up to 256; only the float32 reference runs this tower "
                         "(glmvit-encode --cpu)")


def test_inspect_and_usage(capsys, tmp_path):
    assert run(["--inspect", cases.TOWER_DIR]) == 0
    text = capsys.readouterr().out
    assert "model.visual." in text and "39 (1.1 M parameters, 2.0 MiB BF16)" in text
    assert run(["--inspect", tmp_path]) == 2
    assert "empty directory" in capsys.readouterr().err
    assert run(["--inspect", cases.TOWER_DIR, str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "--inspect CHECKPOINT runs alone: leave out images or videos and --out" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # An empty one (--inspect "$UNSET") is the checkpoint path said empty, not images, --checkpoint and --out missing.
    assert run(["--inspect", ""]) == 2
    err = capsys.readouterr().err
    assert "the checkpoint path is empty" in err and "missing" not in err, err
    assert run(["--inspect", os.path.join(cases.TOWER_DIR, "config.json")]) == 2
    assert f"is the model's config; give its folder ({cases.TOWER_DIR})" in capsys.readouterr().err
    # --inspect runs every load-time check, the weights' values too: a NaN in a norm weight is refused.
    import shutil
    import struct

    bad = tmp_path / "nan"
    shutil.copytree(cases.TOWER_DIR, bad)
    for shard in sorted(bad.glob("*.safetensors")):  # the first value of blocks.0.norm1.weight made a bf16 NaN
        raw = bytearray(shard.read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        name = next((k for k in header if k.endswith("blocks.0.norm1.weight")), None)
        if name:
            at = 8 + n + header[name]["data_offsets"][0]
            raw[at:at + 2] = struct.pack("<H", 0x7FC0)
            shard.write_bytes(bytes(raw))
            break
    assert run(["--inspect", bad]) == 2
    assert "blocks.0.norm1.weight" in capsys.readouterr().err
    # Found only as the engine loads the weights: still exit 2, and the --out folder the run made is gone again.
    from PIL import Image

    Image.new("RGB", (40, 30), (9, 80, 200)).save(tmp_path / "one.png")
    assert run([tmp_path / "one.png", "--checkpoint", bad, "--out", tmp_path / "new", "--cpu"]) == 2
    assert "blocks.0.norm1.weight" in capsys.readouterr().err and not (tmp_path / "new").exists()
    for flag in ("--max-image-mib", "--max-video-mib"):  # past any file: refused before anything is read
        assert run([tmp_path / "nope.png", "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "o", "--cpu",
                    flag, "1e308"]) == 2
        assert f"{flag} 1e+308 must be a number of MiB from one byte (9.54e-07) to 1,099,511,627,776" in \
            capsys.readouterr().err
    assert run([]) == 2
    assert "missing images or videos and --checkpoint and --out" in capsys.readouterr().err
    assert run([tmp_path / "nope.png", "--checkpoint", cases.TOWER_DIR]) == 2
    assert "missing --out: an encode needs" in capsys.readouterr().err
    assert run([tmp_path / "nope.png", "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "o", "--cpu"]) == 2
    assert "no such file, folder or matching glob: " in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags,named", [(["--devices", "0"], "--devices"), (["--decode", "gpu"], "--decode gpu"),
                                         (["--resize", "gpu"], "--resize gpu"),
                                         (["--devices", "1", "--decode", "gpu"], "--devices and --decode gpu")])
def test_gpu_flags_with_cpu_are_refused_not_ignored(images, tmp_path, capsys, flags, named):
    out = tmp_path / "out"
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *flags]) == 2
    assert f"--cpu encodes on the host, without a GPU: leave out {named}" in capsys.readouterr().err
    assert not out.exists()  # refused before the output folder is made


def test_backend_refuses_devices_with_cpu():
    from glmvit_cupy.backend import Backend
    with pytest.raises(ValueError, match=r"cpu=True runs the float32 reference on the host, devices=\[0\] chooses"):
        Backend(bind_tower(cases.TOWER_DIR), cpu=True, devices=[0])


def test_backend_checks_its_limits_before_loading():
    """Either path refuses a bad capacity (0, -5, 1.5, "8000") or image_tokens before anything is loaded."""
    from glmvit_cupy.backend import Backend
    binding = bind_tower(cases.TOWER_DIR)
    for cpu in (True, False):
        for bad in (0, -5, 1.5, True, "8000"):
            with pytest.raises(ValueError, match=rf"capacity_tokens={bad!r} must be a positive integer"):
                Backend(binding, cpu=cpu, capacity_tokens=bad)
        for bad in (0, 2.0, False, "64"):
            with pytest.raises(ValueError, match=rf"max_image_tokens={bad!r} must be a positive integer"):
                Backend(binding, cpu=cpu, max_image_tokens=bad)
    assert Backend(binding, cpu=True, capacity_tokens=np.int64(64), max_image_tokens=16).capacity_tokens == 64


def test_min_image_tokens_zero_is_no_minimum(images, tmp_path, capsys, rng):
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "o", "--cpu",
                "--min-image-tokens", -1]) == 2
    assert "--min-image-tokens -1 must be at least 0" in capsys.readouterr().err
    small = tmp_path / "small.png"
    Image.fromarray(rng.integers(0, 256, (20, 30, 3), np.uint8)).save(small)
    for lo, tokens in ((0, 2), (16, 20)):  # 16 scales a 20 x 30 image up to the minimum
        out = tmp_path / f"o{lo}"
        assert run([small, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--min-image-tokens", lo]) == 0
        manifest, _ = load_all(out)
        (entry,) = manifest["images"].values()
        assert entry["tokens"] == tokens


def test_a_capacity_below_the_default_image_limit_is_said_to_lower_it(images, tmp_path, capsys):
    """--capacity-tokens below 8000 lowers --max-image-tokens' default, which changes the embeddings of larger
    images: said on stderr, naming both flags; not said where --max-image-tokens is given or not lowered."""
    said = "images of over 100 tokens are resized down to fit one pass (--max-image-tokens defaults to " \
           "--capacity-tokens 100 where that is below 8000); give --max-image-tokens to set it"
    assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "a", "--cpu",
                "--capacity-tokens", 100]) == 0
    assert said in capsys.readouterr().err
    for more in (["--max-image-tokens", 100], []):
        assert run([images / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / f"b{len(more)}", "--cpu",
                    "--capacity-tokens", 100 if more else 8000, *more]) == 0
        assert "resized down to fit one pass" not in capsys.readouterr().err


def test_both_commands_say_their_version(capsys):
    from glmvit_cupy import __version__
    from glmvit_cupy.serving.main import parser as serve_parser

    for parse, prog in ((cli.parse, "glmvit-encode"), (serve_parser().parse_args, "glmvit-serve")):
        with pytest.raises(SystemExit) as done:
            parse(["--version"])
        assert done.value.code == 0 and capsys.readouterr().out == f"{prog} {__version__}\n"


def test_devices_flag_parses_ordinals():
    assert cli.parse(["--devices", "0,1"]).devices == [0, 1]
    assert cli.parse(["--devices", "3"]).devices == [3]
    for bad in ("", "a,b", "-1", "0;1"):
        with pytest.raises(SystemExit):
            cli.parse(["--devices", bad])


def test_inputs_may_stand_before_between_and_after_the_options():
    args = cli.parse(["a.jpg", "--cpu", "--out", "o", "b.png", "--max-frames", "4", "c/"])
    assert args.inputs == ["a.jpg", "b.png", "c/"] and args.cpu and args.out == "o" and args.max_frames == 4


def _preparer(resize="host"):
    return batching.preparer(bind_tower(cases.TOWER_DIR).geometry, 100, max_image_tokens=100, resize=resize)


def test_preparing_threads_give_every_image_and_error_once(images, tmp_path):
    """Twelve files (copies, each its own name) through 4 threads and a window of 10: each comes out once,
    in any order, exactly as one thread prepares it; an error is handed on as the image's result."""
    import shutil

    paths = []
    for k in range(3):
        for p in (images / "a.png", images / "broken.png", images / "c.jpg", images / "sub" / "b.png"):
            paths.append(str(tmp_path / f"{k}_{p.name}"))
            shutil.copy(p, paths[-1])
    one = list(cli.prepared(paths, 1, _preparer()))
    many = list(cli.prepared(paths, 4, _preparer()))
    assert [p for p, _ in one] == paths and sorted(p for p, _ in many) == sorted(paths)
    many_by_path = dict(many)
    for p, a in one:  # each image alike whichever thread prepared it, errors included
        b = many_by_path[p]
        if isinstance(a, Exception):
            assert type(b) is type(a) and str(b) == str(a)
        else:
            (ia, ga, fa), sha_a, stamp_a = a
            (ib, gb, fb), sha_b, stamp_b = b
            assert np.array_equal(ia, ib) and ga == gb and fa == fb and sha_a == sha_b and stamp_a == stamp_b
            assert stamp_a == [os.stat(p).st_size, os.stat(p).st_mtime_ns]
    for resize in ("host", "gpu"):  # the GPU's input is the decoded image, the host's the canvas
        (_, ((img, grid, info), _, _)), = cli.prepared(paths[:1], 2, _preparer(resize))
        assert info["resize"] == resize and img.shape[:2] == (tuple(info["canvas"]) if resize == "host"
                                                              else tuple(info["size"]))
        assert info["source"] == paths[0]  # the file is read once, as bytes, and still named by its path
    with pytest.raises(ImageError, match="broken.png: cannot decode"):
        raise dict(many)[paths[1]]
    gen = cli.prepared(paths, 4, _preparer())
    next(gen)
    gen.close()  # stopping early shuts the threads down without waiting for the rest


def test_workers_do_not_change_the_output(images, tmp_path):
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"out{workers}"
        assert run([images, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--workers", workers]) == 1
        manifest, tensors = load_all(out)
        outs.append((manifest, tensors))
    (m1, t1), (m3, t3) = outs
    assert {k: dict(v, shard=None) for k, v in m1["images"].items()} == \
        {k: dict(v, shard=None) for k, v in m3["images"].items()}
    assert m1["failed"] == m3["failed"]
    assert t1.keys() == t3.keys() and all(np.array_equal(t1[k].view(np.uint16), t3[k].view(np.uint16)) for k in t1)
    assert run([images, "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "o0", "--cpu", "--workers", 0]) == 2


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="no FIFOs or /dev/zero here")
def test_a_fifo_or_device_in_a_folder_is_skipped_not_read(images, tmp_path):
    """A FIFO named like an image made glmvit-encode wait forever for a writer, and a link to /dev/zero read
    until memory ran out: each is skipped saying what it is, and the rest of the folder is encoded. Named on
    the command line, a FIFO and a broken link are reported alike (not as "no such file"). In a subprocess
    with a time and address-space limit, so a regression fails instead of hanging or eating RAM."""
    import resource
    import subprocess
    import sys

    os.mkfifo(images / "pipe.png")
    (images / "zero.jpg").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "named.png")
    (tmp_path / "moved.png").symlink_to(tmp_path / "nowhere.png")
    out = tmp_path / "out"

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    src = os.path.join(os.path.dirname(__file__), "..", "src")
    r = subprocess.run([sys.executable, "-m", "glmvit_cupy.cli.main", str(images), str(tmp_path / "named.png"),
                        str(tmp_path / "moved.png"), "--checkpoint", cases.TOWER_DIR,
                        "--out", str(out), "--cpu", "--workers", "2"], capture_output=True, text=True, timeout=120,
                       preexec_fn=cap, env=dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 1, r.stderr[-2000:]  # some images failed
    said = r.stdout + r.stderr
    assert f"{images / 'pipe.png'}: the image is a FIFO (named pipe), not a regular file" in said, said
    assert f"{images / 'zero.jpg'}: the image is a character device, not a regular file" in said, said
    assert f"{tmp_path / 'named.png'}: the image is a FIFO (named pipe), not a regular file" in said, said
    assert f"{tmp_path / 'moved.png'}: a broken symbolic link (to " in said, said
    manifest, tensors = load_all(out)
    assert len(tensors) == 3  # a.png, sub/b.png, c.jpg


def test_a_slow_disk_holds_the_encoder_back(tmp_path, monkeypatch):
    """Each write waiting for glmvit-encode's writer holds its embeddings (on the GPU, until the writer copies
    them out), so a disk slower than the encoder must make it wait, not let writes pile up: with every shard
    write slowed down, at most output.PENDING_WRITES writes ever wait, and every image is still written."""
    import threading
    import time

    from glmvit_cupy import output

    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(14):
        Image.fromarray(cases._smooth(28, 42, i)).save(folder / f"{i:02d}.png")  # 2 tokens each
    real_add, waiting, most, lock = output.Output.add_batch, [0], [0], threading.Lock()

    def slow_add(self, entries):
        time.sleep(0.05)
        real_add(self, entries)

    real_submit = output.Writer.submit

    def counting_submit(self, fn, *a, nbytes=0):
        real_submit(self, fn, *a, nbytes=nbytes)
        with lock:
            waiting[0] = sum(not w.done() for w, _ in self._writes)
            most[0] = max(most[0], waiting[0])

    monkeypatch.setattr(output.Output, "add_batch", slow_add)
    monkeypatch.setattr(output.Writer, "submit", counting_submit)
    out = tmp_path / "out"
    assert run([folder, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--capacity-tokens", 2,
                "--max-image-tokens", 2, "--min-image-tokens", 0]) == 0
    manifest, tensors = load_all(out)
    assert len(manifest["images"]) == len(tensors) == 14
    assert 1 <= most[0] <= output.PENDING_WRITES  # one image a pass: 14 writes, never more than 4 waiting


@pytest.mark.parametrize("error", ["safetensors", "os"])
def test_a_full_disk_stops_the_run_in_one_line_and_the_same_command_resumes(tmp_path, monkeypatch, capsys, error):
    """A shard write that fails (here: ENOSPC on the third, as safetensors says it, a SafetensorError, and as an
    OSError) stops the run with exit status 3 and one line that names the shard, says why and how to resume,
    not a traceback; what was written stays (no .tmp left), and the same command then encodes what is missing."""
    import errno

    import safetensors.numpy
    from safetensors import SafetensorError

    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(6):
        Image.fromarray(cases._smooth(28, 42, 10 + i)).save(folder / f"{i}.png")
    real_save, calls = safetensors.numpy.save_file, []

    def full_disk(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:  # one image a pass: the third image's shard
            open(path, "wb").close()  # the part written before the disk filled
            if error == "os":
                raise OSError(errno.ENOSPC, "No space left on device", path)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    out = tmp_path / "out"
    args = [folder, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--capacity-tokens", 2,
            "--max-image-tokens", 2, "--min-image-tokens", 0]
    assert run(args) == 3
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("glmvit-encode: cannot")]
    assert f"cannot write {out / 'embeddings-00003.safetensors'}: " in line and "No space left on device" in line
    assert "the run stopped with 2 files saved" in line and "re-run the same command to resume" in line
    assert "Traceback" not in err
    assert sorted(os.listdir(out)) == [LOCK, "embeddings-00001.safetensors", "embeddings-00002.safetensors",
                                       "manifest.json"]
    monkeypatch.setattr(safetensors.numpy, "save_file", real_save)
    assert run(args) == 0
    manifest, tensors = load_all(out)
    assert len(manifest["images"]) == len(tensors) == 6


def test_a_shard_changed_after_binding_is_refused_by_name(tmp_path, images, monkeypatch, capsys):
    """A shard that changes between its header being read and the tower's fingerprint (a copy or download still
    writing it) is one line naming the shard and exit status 2, not a traceback; nothing is created."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(cases.TOWER_DIR, ckpt)
    shard = ckpt / "model-00002-of-00002.safetensors"

    def bind_then_grow(path):
        binding = bind_tower(path)
        with open(shard, "ab") as f:
            f.write(b"\0" * 16)
        return binding

    monkeypatch.setattr(cli, "bind_tower", bind_then_grow)
    assert run([images, "--checkpoint", ckpt, "--out", tmp_path / "out", "--cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: the shard changed since its header was read (its size went from" in err, err
    assert not (tmp_path / "out").exists()


def test_a_warning_about_a_hostile_checkpoint_path_is_printed_escaped(capsys, tmp_path, monkeypatch):
    """The bind's warnings (here: tensors a shallower config leaves unread) name the checkpoint's path; the
    handler glmvit-encode installs printed it raw, so a newline or terminal escape in a folder name forged a
    line of output, as fail() and the summary no longer do."""
    import logging
    import shutil

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # logging left unset, as in a shell: the CLI's handler

    folder = tmp_path / "t\nglmvit-encode: \x1b[31mFORGED"
    shutil.copytree(cases.TOWER_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["depth"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    assert run(["--inspect", folder]) == 0
    err = capsys.readouterr().err
    assert "tower tensors are not read" in err and "\x1b" not in err and "\nglmvit-encode: \\x1b" not in err, err
    assert "t\\x0aglmvit-encode: \\x1b[31mFORGED" in err, err
