"""glmvit-encode with video files, on the CPU backend (the float32 reference) with the golden tower: a folder
of images and videos, each video's entry and embedding against the reference of preprocess_video(path),
resume (also of a folder written before videos), a bad video skipped by name, --no-videos, a frame group
over the capacity, the vLLM files under glmvit-serve's key, and PyAV missing."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from tests.golden import cases

from glmvit_cupy import reference
from glmvit_cupy.cli import main as cli
from glmvit_cupy.output import read_embeddings
from glmvit_cupy.preprocessing.video import preprocess_video
from glmvit_cupy import vllm_ec
from glmvit_cupy.serving.requests import parse_videos

av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
CLIP = Path(__file__).parent / "golden" / "video_files" / "h264_offset.mp4"  # 15 frames, 48 x 32, from 1.3 s
LIMITS = ["--max-video-tokens", "40", "--video-fps", "4"]


def write_clip(path, n=9, h=30, w=44, fps=6, seed=0):
    """A lossless ffv1 clip of smooth random frames (never zeros)."""
    from tests.test_video_files import write

    return write(path, np.stack([cases._smooth(h, w, seed + i) for i in range(n)]), fps=fps)


@pytest.fixture
def media(tmp_path):
    folder = tmp_path / "media"
    (folder / "sub").mkdir(parents=True)
    Image.fromarray(cases._smooth(60, 80, 1)).save(folder / "a.png")
    write_clip(folder / "sub" / "pan.mkv")
    shutil.copy(CLIP, folder / "offset.mp4")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    return folder


def run(*args):
    return cli.main([str(a) for a in args])


def reference_of(path, tower, **settings):
    pv, grid, info = preprocess_video(str(path), **settings)
    return reference.encode_pixels(tower, pv, grid), grid[0].tolist(), info[0]


def test_a_folder_of_images_and_videos(media, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(media, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == 1  # broken.mp4 failed
    manifest, embs = read_embeddings(out)
    real = {name: os.path.realpath(media / name) for name in ("a.png", "sub/pan.mkv", "offset.mp4", "broken.mp4")}
    assert sorted(manifest["images"]) == sorted(real[n] for n in ("a.png", "sub/pan.mkv", "offset.mp4"))
    (why,) = manifest["failed"].values()
    assert list(manifest["failed"]) == [real["broken.mp4"]] and "cannot open" in why and "broken.mp4" in why
    assert "kind" not in manifest["images"][real["a.png"]]
    tower = reference.Tower(reference.bind_tower(cases.TOWER_DIR))
    for name in ("sub/pan.mkv", "offset.mp4"):
        entry, emb = manifest["images"][real[name]], embs[real[name]]
        want, grid, info = reference_of(real[name], tower, max_image_tokens=40, target_fps=4)
        assert entry["kind"] == "video" and entry["grid_thw"] == grid and entry["tokens"] == info["tokens"]
        assert entry["frames_indices"] == info["frames_indices"] and entry["timestamps"] == info["timestamps"]
        assert entry["fps"] == info["fps"] and entry["total_frames"] == info["total_frames"] > 0
        assert grid[0] >= 2 or name == "offset.mp4"  # the pan is several frame groups
        assert emb.dtype == ml_dtypes.bfloat16 and emb.shape == (info["tokens"], 256)
        assert np.array_equal(emb, want.astype(ml_dtypes.bfloat16))  # the reference computes each video alone
    # The offset clip lasts 2.8 - 1.3 = 1.4999999999999998 s, as the reference processor's decoder says.
    assert manifest["images"][real["offset.mp4"]]["duration"] == 2.8 - 1.3
    assert manifest["header"]["video"] == {"sample": True, "target_fps": 4.0, "max_frames": 2048, "max_duration": 0,
                                           "min_image_tokens": 16, "max_image_tokens": 40}
    printed = capsys.readouterr()
    assert "2 videos" in printed.out and "1 failed" in printed.out and "skipped" in printed.out

    # Resumed: nothing is encoded again; the broken video is tried again and fails again.
    assert run(media, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == 1
    assert "3 of 4 files already" in capsys.readouterr().out
    # Other video settings: another folder.
    assert run(media, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--max-video-tokens", "50") == 2
    # named by the part that differs and the flag that gives it, not the whole of the video settings
    assert "video.max_image_tokens = 40, this run asks for 50 (--max-video-tokens)" in capsys.readouterr().err


def test_a_folder_written_before_videos_resumes_with_them(media, tmp_path, capsys):
    """A manifest whose header has no "video" setting (written before glmvit-encode took videos, so it holds
    none) resumes: its images are kept, the videos are added, the header gains the setting."""
    out = tmp_path / "out"
    assert run(media / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu") == 0
    path = out / "manifest.json"
    old = json.loads(path.read_text())
    del old["header"]["video"]
    path.write_text(json.dumps(old))
    for shard in out.glob("*.safetensors"):  # the shard's own header, as that version wrote it
        from safetensors import safe_open
        from safetensors.numpy import load_file, save_file

        with safe_open(str(shard), "numpy") as f:
            meta = json.loads(f.metadata()["glmvit"])
        del meta["header"]["video"]
        save_file(load_file(str(shard)), str(shard), metadata={"glmvit": json.dumps(meta)})
    assert run(media / "a.png", media / "sub", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == 0
    assert "1 of 2 files already" in capsys.readouterr().out
    manifest, embs = read_embeddings(out)
    assert len(embs) == 2 and manifest["header"]["video"]["max_image_tokens"] == 40


def test_no_videos_and_pyav_missing(media, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert run(media, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--no-videos") == 0
    manifest, _ = read_embeddings(out)
    assert [os.path.basename(k) for k in manifest["images"]] == ["a.png"] and not manifest["failed"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a))
    assert run(media, "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "o2", "--cpu") == 2
    err = capsys.readouterr().err
    assert "3 video files among the inputs" in err and "pip install -e '.[video]' in the glmvit-cupy checkout" in err
    assert "--no-videos" in err and not (tmp_path / "o2").exists()
    assert run(media / "a.png", "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "o3", "--cpu") == 0  # no video


@pytest.mark.parametrize("flags,why", [(["--video-fps", "0"], "--video-fps 0 must be a positive number"),
                                       (["--video-fps", "1e308"], "--video-fps 1e+308 must be a positive number of "
                                                                  "frames a second, at most 10,000"),
                                       (["--video-fps", "nan"], "--video-fps nan must be a positive number"),
                                       (["--vllm-ec-dir", ""], "--vllm-ec-dir is empty (an unset variable?)"),
                                       (["--max-frames", "0"], "--max-frames 0 must be at least 1"),
                                       (["--max-video-tokens", "99999999999"],
                                        "--max-video-tokens 99999999999 must be at most 2,147,483,647"),
                                       (["--min-video-tokens", "50", "--max-video-tokens", "40"],
                                        "--min-video-tokens 50 is above --max-video-tokens 40")])
def test_bad_video_flags_refuse_the_run(media, tmp_path, capsys, flags, why):
    assert run(media, "--checkpoint", cases.TOWER_DIR, "--out", tmp_path / "out", "--cpu", *flags) == 2
    assert why in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_frame_group_over_the_capacity_and_the_vllm_files(media, tmp_path, capsys):
    """A pass of 24 tokens cannot hold a 196 x 280 clip's 70-token frame groups: that video is recorded as
    failed, by name; the offset clip (one group of at most 24 tokens) is written, and its vLLM file is under
    the key glmvit-serve gives the same file with the same settings."""
    out, ec = tmp_path / "out", tmp_path / "ec"
    files = [write_clip(tmp_path / "large.mkv", n=6, h=196, w=280, fps=4), media / "offset.mp4"]
    assert run(*files, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--capacity-tokens", "24",
               "--max-image-tokens", "24", "--max-video-tokens", "400", "--vllm-ec-dir", ec,
               "--video-fps", "2") == 1  # 2.0 here, the server's default 2: one key
    manifest, embs = read_embeddings(out)
    (why,) = manifest["failed"].values()
    assert "large.mkv: one frame group of 14x20 patches is 70 tokens, more than this model's capacity of 24" in why
    entry = manifest["images"][os.path.realpath(files[1])]
    assert entry["frame_tokens"] <= 24
    _, common = parse_videos(json.dumps({"videos": [{"file": "AA=="}], "max_image_tokens": 400}).encode())
    assert entry["key"] == vllm_ec.video_key_of([files[1].read_bytes()], None, None, common, kind="file")
    assert vllm_ec.video_key_of([b"x"], 30.0, None, dict(common, target_fps=2.0), kind="file") == \
        vllm_ec.video_key_of([b"x"], 30, None, dict(common, target_fps=2), kind="file")  # --video-fps 2: the server's 2
    assert entry["sha256"] == vllm_ec.key_of(files[1].read_bytes())
    from safetensors.numpy import load_file

    handed = load_file(str(ec / entry["key"] / "encoder_cache.safetensors"))["ec_cache"]
    assert np.array_equal(handed, embs[os.path.realpath(files[1])])


def test_an_interrupted_run_keeps_the_videos_it_finished(media, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the second video encodes: the first is written (it finished), the run says so and exits
    130, and the same command then encodes only what is missing."""
    from glmvit_cupy.backend import Backend

    real, calls = Backend.launch_video_on, []

    def second_interrupts(self, lane, planned, resize=None):
        calls.append(planned[0][2]["source"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, lane, planned, resize)

    monkeypatch.setattr(Backend, "launch_video_on", second_interrupts)
    out, videos = tmp_path / "out", [media / "sub" / "pan.mkv", media / "offset.mp4"]
    assert run(*videos, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == 130
    assert "interrupted; 1 file saved this run (1 in" in capsys.readouterr().err
    manifest, embs = read_embeddings(out)
    assert list(embs) == [os.path.realpath(calls[0])]
    monkeypatch.setattr(Backend, "launch_video_on", real)
    assert run(*videos, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == 0
    assert "1 of 2 files already" in capsys.readouterr().out and len(read_embeddings(out)[1]) == 2


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_videos_whose_embedding_overflows_are_failed_not_saved(media, tmp_path, capsys):
    """Weights that overflow the forward (cases.overflowing_tower): every video (and the image) is failed
    saying so and nothing is saved; the summary counts none encoded."""
    bad = cases.overflowing_tower(tmp_path / "bad")
    out = tmp_path / "out"
    assert run(media, "--checkpoint", bad, "--out", out, "--cpu", *LIMITS) == cli.FAILED
    said = capsys.readouterr().out
    assert "0 videos, 0 tokens" in said and "3 failed" in said, said  # two videos and broken.mp4
    manifest, embs = read_embeddings(out)
    assert not embs and not manifest["images"] and not manifest.get("videos")
    overflowed = [k for k, why in manifest["failed"].items() if "NaN or infinite values" in why]
    assert sorted(os.path.basename(k) for k in overflowed) == ["a.png", "offset.mp4", "pan.mkv"], manifest["failed"]


def test_max_pixels_guards_video_frames_as_images(media, tmp_path, capsys):
    """--max-pixels is one frame's limit too: a video of larger frames fails naming it (and the flag), as an
    image does; raised past them, a re-run into the same folder encodes it."""
    out = tmp_path / "out"
    assert run(media / "sub", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--max-pixels", 1000,
               *LIMITS) == cli.FAILED
    (why,) = read_embeddings_manifest_failed(out)
    assert "has 44x30 frames, over the 1,000 pixels" in why and "--max-pixels raises it" in why, why
    assert run(media / "sub", "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu",
               "--max-pixels", 44 * 30, *LIMITS) == cli.DONE  # the limit shapes no embedding: same folder
    assert read_embeddings_manifest_failed(out) == []


def read_embeddings_manifest_failed(out) -> list:
    return list(json.loads((out / "manifest.json").read_text())["failed"].values())


def test_a_clip_too_short_to_sample_names_the_flag_that_helps(tmp_path):
    """Two frames at 6 fps at --video-fps 0.5: no whole frame to sample. The video fails, and the advice names
    this command's flag, not the Python API's arguments."""
    clip = write_clip(tmp_path / "short.mkv", n=2)
    out = tmp_path / "out"
    assert run(clip, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--video-fps", 0.5) == cli.FAILED
    (why,) = read_embeddings_manifest_failed(out)
    assert "raise --video-fps" in why and "sample=False" not in why, why


def test_a_video_token_budget_too_small_names_the_flag(tmp_path, capsys):
    """--max-video-tokens below what one aligned patch of each frame takes: the video fails naming this
    command's flag, not the Python API's max_image_tokens=."""
    clip = write_clip(tmp_path / "clip.mkv", n=40, seed=int(np.random.default_rng().integers(1000)))  # 14 frames sampled
    out = tmp_path / "out"
    assert run(clip, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", "--min-video-tokens", 0,
               "--max-video-tokens", 1) == cli.FAILED
    (why,) = read_embeddings_manifest_failed(out)
    assert "--max-video-tokens 1 is too small" in why and "max_image_tokens" not in why, why
    assert "--max-video-tokens 1 is too small" in capsys.readouterr().out


def test_a_video_replaced_while_it_is_read_is_failed_not_misfiled(tmp_path, capsys, monkeypatch):
    """A video is hashed through one open and decoded through another: one renamed over in between is failed,
    naming it, not saved under the hash and stamp of the file it replaced; a run after encodes the new one."""
    from glmvit_cupy.cli import videos

    folder = tmp_path / "in"
    folder.mkdir()
    write_clip(folder / "a.mkv", seed=10)
    write_clip(tmp_path / "other.mkv", n=11, seed=20)
    hashed = videos._hashed

    def then_replaced(path, max_bytes):
        got = hashed(path, max_bytes)
        if os.path.exists(tmp_path / "other.mkv"):
            os.replace(tmp_path / "other.mkv", path)
        return got

    monkeypatch.setattr(videos, "_hashed", then_replaced)
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == 1
    assert "a.mkv: the file changed while it was read (replaced or rewritten)" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["images"] and list(manifest["failed"]) == [str(folder / "a.mkv")]
    assert run(folder, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == 0  # the new file, whole
    manifest, embs = read_embeddings(out)
    (key,) = manifest["images"]
    tower = reference.Tower(reference.bind_tower(cases.TOWER_DIR))
    want, grid, info = reference_of(folder / "a.mkv", tower, max_image_tokens=40, target_fps=4)
    assert manifest["images"][key]["grid_thw"] == grid and manifest["images"][key]["tokens"] == info["tokens"]
    assert np.array_equal(embs[key], want.astype(ml_dtypes.bfloat16))  # the new file's (11 frames), not the old's


def test_a_file_whose_packets_span_no_time_says_what_this_command_can_do(tmp_path):
    """Every packet at pts 0: the reader's advice (a video's fps=, duration=) is none this command takes. The
    video fails saying so, that --video-fps is the rate sampled, how to give the file timestamps (ffmpeg's
    setts, its frames copied), and the Python call that takes an fps."""
    import fractions

    clip = write_clip(tmp_path / "still.mkv", n=12, fps=fractions.Fraction(10**9, 1))  # Matroska's ms: all at 0
    out = tmp_path / "out"
    assert run(clip, "--checkpoint", cases.TOWER_DIR, "--out", out, "--cpu", *LIMITS) == cli.FAILED
    (why,) = read_embeddings_manifest_failed(out)
    assert why.startswith(f"{clip}: '{clip}' holds 12 video frames over 0 s; cannot sample it; glmvit-encode takes "
                          "no video's own fps (--video-fps is the rate it samples at): give the file timestamps"), why
    assert "ffmpeg -i IN -c copy -bsf:v 'setts=ts=N/(FPS*TB):duration=1/(FPS*TB)' OUT.mkv" in why, why
    assert why.endswith("GlmVit.encode_video(path, fps=FPS)") and "(fps= or duration=)" not in why, why
