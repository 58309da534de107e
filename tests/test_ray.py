"""Ray Data pipeline on a local Ray (CPU CI, the `ray` extra): the golden tower with cpu=True over a
folder with a broken file and a text file named .jpg; outputs equal the reference bit for bit,
failures are recorded per row, other columns pass through, and the example resumes."""

import os
import re
import sys

import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray", reason="the ray extra (ray[data]) is not installed")
pytest.importorskip("ray.data", reason="the ray extra (ray[data]) is not installed")

import ml_dtypes  # noqa: E402

from tests.golden import cases  # noqa: E402

from glmvit_cupy import reference  # noqa: E402
from glmvit_cupy.preprocessing.image import normalise_patchify, prepare_canvas  # noqa: E402

TOWER = str(cases.TOWER_DIR)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("imgs")
    for i, (h, w) in enumerate([(100, 150), (64, 64), (140, 90), (90, 200)]):
        Image.fromarray(cases._smooth(h, w, 200 + i)).save(d / f"img{i}.png")
    (d / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    (d / "notes.jpg").write_text("a text file with an image's name")
    return d


def reference_bf16(path):
    canvas, grid, _ = prepare_canvas(str(path))
    tower = reference.Tower(reference.bind_tower(TOWER))
    return reference.encode_pixels(tower, normalise_patchify(canvas), [grid]).astype(ml_dtypes.bfloat16)


def test_encode_dataset_matches_reference_and_records_failures(local_ray, folder):
    import glmvit_cupy.ray as gvr

    files = sorted(str(p) for p in folder.iterdir())
    ds = ray.data.read_binary_files(files, include_paths=True)
    ds = ds.map(lambda r: dict(r, label=os.path.basename(r["path"]).upper()))  # a passthrough column
    rows = {r["path"]: r for r in gvr.encode_dataset(ds, TOWER, cpu=True, batch_size=3).take_all()}
    assert set(rows) == set(files)
    for path, r in rows.items():
        assert "bytes" not in r and r["label"] == os.path.basename(path).upper()
        if os.path.basename(path) in ("broken.png", "notes.jpg"):
            assert r["embedding"].shape == (0, 256) and path in r["error"] and "cannot decode" in r["error"]
            continue
        assert r["error"] is None
        ref = reference_bf16(path)
        emb = r["embedding"]
        assert emb.dtype == np.float32 and emb.shape == (r["tokens"], 256) and list(r["grid_thw"])[0] == 1
        assert np.array_equal(emb.astype(ml_dtypes.bfloat16).view(np.uint16), ref.view(np.uint16))


def test_a_tower_of_another_merge_size_is_prepared_with_its_own_patching(local_ray, folder, tmp_path):
    """A 3 x 3-merge tower of 16-pixel single-frame patches: the pipeline's CPU stage makes that tower's
    canvases, and each row's embedding is the reference's of them, bit for bit."""
    import dataclasses

    import glmvit_cupy.ray as gvr
    from glmvit_cupy.checkpoint.synthetic import write_checkpoint
    from glmvit_cupy.preprocessing.image import Patching

    geo = dataclasses.replace(cases.GEOMETRY, spatial_merge_size=3, patch_size=16, temporal_patch_size=1, depth=1)
    ckpt = write_checkpoint(tmp_path / "m3", geo, seed=8)
    files = sorted(str(p) for p in folder.glob("img*.png"))[:2]
    rows = gvr.encode_dataset(ray.data.read_binary_files(files, include_paths=True), ckpt, cpu=True).take_all()
    tower = reference.Tower(reference.bind_tower(ckpt))
    for r in rows:
        canvas, grid, info = prepare_canvas(r["path"], patching=Patching.of(geo))
        ref = reference.encode_pixels(tower, normalise_patchify(canvas, Patching.of(geo)), [grid])
        assert r["error"] is None and list(r["grid_thw"]) == list(grid) and r["tokens"] == info["tokens"]
        assert np.array_equal(r["embedding"].astype(ml_dtypes.bfloat16).view(np.uint16),
                              ref.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_rows_without_a_path_are_named_by_their_place_in_their_batch(local_ray):
    """Ray Data gives a batch no row numbers of the whole dataset: a failed row without a "path" column is
    named by its place in its batch, saying so, not as if that were its place in the dataset."""
    import io

    import glmvit_cupy.ray as gvr

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 90)).save(buf, "PNG")
    items = [{"bytes": buf.getvalue()} for _ in range(5)]
    items[3] = {"bytes": b"junk"}
    rows = gvr.encode_dataset(ray.data.from_items(items), TOWER, cpu=True, batch_size=2).take_all()
    errors = [r["error"] for r in rows if r["error"] is not None]
    assert len(errors) == 1 and errors[0].startswith("row 1 of its batch (no 'path' column to name it)"), errors


def test_encode_dataset_checks_its_arguments(local_ray, tmp_path):
    import glmvit_cupy.ray as gvr
    from glmvit_cupy import CheckpointError

    ds = ray.data.from_items([{"data": b"x"}])
    with pytest.raises(ValueError, match="no column 'bytes'"):
        gvr.encode_dataset(ds, TOWER, cpu=True)
    with pytest.raises(CheckpointError):
        gvr.encode_dataset(ds, "/nonexistent/ckpt", cpu=True, bytes_column="data")
    with pytest.raises(ValueError, match="has 0 GPUs.*cpu=True"):  # this local Ray has none
        gvr.encode_dataset(ds, TOWER, bytes_column="data")
    with pytest.raises(ValueError, match=r"num_gpus=1 with cpu=True.*drop num_gpus"):  # not ignored
        gvr.encode_dataset(ds, TOWER, cpu=True, num_gpus=1, bytes_column="data")
    for bad in (0, -1, float("nan"), float("inf"), "1", True):  # 0 divided the cluster's GPUs by zero
        with pytest.raises(ValueError, match="must be a number above 0"):
            gvr.encode_dataset(ds, TOWER, num_gpus=bad, bytes_column="data")
    with pytest.raises(ValueError, match=r"max_pixels=-1 must be a positive integer"):  # on the driver
        gvr.encode_dataset(ds, TOWER, cpu=True, bytes_column="data", max_pixels=-1)
    with pytest.raises(ValueError, match="capacity_tokens"):
        gvr.encode_dataset(ds, TOWER, cpu=True, bytes_column="data", capacity_tokens=None)
    # max_image_tokens left out is 8000 lowered to the capacity; given above it, refused on the driver
    gvr.encode_dataset(ds, TOWER, cpu=True, bytes_column="data", capacity_tokens=4000)
    with pytest.raises(ValueError, match="max_image_tokens=8000 exceeds this model's capacity of 4000"):
        gvr.encode_dataset(ds, TOWER, cpu=True, bytes_column="data", capacity_tokens=4000, max_image_tokens=8000)
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import write_checkpoint

    grey = write_checkpoint(tmp_path / "grey", dataclasses.replace(cases.GEOMETRY, in_channels=1, depth=1))
    with pytest.raises(ValueError, match="in_channels = 1; use encode_pixels"):  # on the driver, not in the actors
        gvr.encode_dataset(ds, grey, cpu=True, bytes_column="data")


def test_example_refuses_num_gpus_with_cpu(capsys):
    import ray_encode

    for argv, says in ((["--cpu", "--num-gpus", "1"], "--num-gpus with --cpu"), (["--num-gpus", "0"], "above 0"),
                       (["--max-pixels", "0"], "--max-pixels 0: give a positive number of pixels")):
        with pytest.raises(SystemExit) as e:
            ray_encode.main(["imgs", "--checkpoint", TOWER, "--out", "out"] + argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.fixture
def no_ray_start(monkeypatch):
    """Ray taken as not started, and starting it an error: what runs before ray.init is all that runs."""
    def start(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", start)
    monkeypatch.setattr(ray, "cluster_resources", start)


@pytest.mark.parametrize("argv, says", [
    (["--concurrency", "0"], "--concurrency 0: give a positive number of encoder actors, or leave it out"),
    (["--capacity-tokens", "8"], "--capacity-tokens 8: give at least 16"),
    (["--max-image-tokens", "9000"], "--max-image-tokens 9000: give from 16 (the fewest tokens an image is resized "
                                     "to) up to --capacity-tokens (8000"),
    (["--max-image-tokens", "8"], "--max-image-tokens 8: give from 16"),
])
def test_example_refuses_a_bad_flag_before_out_is_made_and_ray_starts(no_ray_start, folder, tmp_path, capsys, argv,
                                                                        says):
    """--concurrency 0 was refused only once Ray had started (seconds, and its processes), by encode_dataset;
    bad token limits once --out and its lock were made. Each is refused at once, naming the flag and what
    it takes, leaving nothing behind."""
    import ray_encode

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out)] + argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not out.exists()


def test_example_with_no_images_makes_no_out_and_starts_no_ray(no_ray_start, tmp_path, capsys):
    import ray_encode

    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    (empty / "notes.txt").write_text("not an image")
    assert ray_encode.main([str(empty), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 2
    assert f"no images found in {empty} (a folder is walked for .jpg" in capsys.readouterr().err
    assert not out.exists()


def test_encode_dataset_checks_its_own_arguments_before_the_dataset_and_the_cluster(no_ray_start):
    """An argument wrong in itself is refused before the dataset is asked for its columns (which may read
    its first files) and before the cluster is asked for its GPUs."""
    import glmvit_cupy.ray as gvr

    class Unread:
        def columns(self):
            raise AssertionError("the dataset was read")

    for kwargs, says in (({"concurrency": 0}, r"concurrency=0 must be a positive integer \(encoder actors\)"),
                         ({"batch_size": 0}, "batch_size=0 must be a positive integer"),
                         ({"num_gpus": 0}, "num_gpus=0: GPUs per encoder actor must be a number above 0"),
                         ({"cpu": True, "num_gpus": 1}, "num_gpus=1 with cpu=True")):
        for encode in (gvr.encode_dataset, gvr.encode_video_dataset):
            with pytest.raises(ValueError, match=says):
                encode(Unread(), TOWER, **kwargs)


def test_example_passes_max_pixels_to_the_pipeline(local_ray, folder, tmp_path):
    """--max-pixels is the pipeline's decompression-bomb limit, which its refusals name: a 64 x 64 image (4,096
    pixels) passes 5,000, the 100 x 150 one (15,000) is a failed row saying why."""
    import pyarrow.parquet as pq
    import ray_encode

    out = tmp_path / "out"
    assert ray_encode.main([str(folder / "img[01].png"), "--checkpoint", TOWER, "--out", str(out), "--cpu",
                            "--max-pixels", "5000"]) == 0
    rows = {os.path.basename(r["path"]): r["error"] for r in pq.read_table(out, columns=["path", "error"]).to_pylist()}
    assert rows["img1.png"] is None and "over the limit of 5,000 pixels" in rows["img0.png"], rows


def test_example_writes_parquet_and_resumes(local_ray, folder, tmp_path, capsys):
    import pyarrow.parquet as pq
    import ray_encode

    out = tmp_path / "out"
    assert ray_encode.main([str(folder / "img[01].png"), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert "2 were already done" in capsys.readouterr().out
    table = [r for f in out.glob("*.parquet") for r in pq.read_table(f).to_pylist()]
    paths = sorted(r["path"] for r in table)
    assert paths == sorted(str(p) for p in folder.iterdir())  # every file once: the first two not again
    assert sum(r["error"] is not None for r in table) == 2, [(r["path"], r["error"]) for r in table]
    good = next(r for r in table if r["path"].endswith("img1.png"))
    emb = np.frombuffer(good["embedding_bf16"], ml_dtypes.bfloat16).reshape(good["tokens"], -1)
    assert np.array_equal(emb.view(np.uint16), reference_bf16(folder / "img1.png").view(np.uint16))
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert "already in" in capsys.readouterr().out
    spelled = os.path.join(os.path.relpath(folder.parent), ".", folder.name)  # the same files, spelled otherwise
    assert ray_encode.main([spelled, "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert "already in" in capsys.readouterr().out
    first = sorted(out.glob("*.parquet"))[0]  # cut short, as a run killed while Ray wrote it leaves it
    lost = len(pq.read_table(first))
    first.write_bytes(first.read_bytes()[:100])
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    said = capsys.readouterr().out
    assert f"{first} cannot be read (" in said and f"moved aside as .{first.name}.unreadable" in said
    assert sorted(r["path"] for f in out.glob("*.parquet") for r in pq.read_table(f).to_pylist()) == paths
    assert lost and (out / f".{first.name}.unreadable").exists() and len(pq.read_table(out)) == len(paths)
    import pyarrow as pa

    pq.write_table(pa.table({"x": [1, 2]}), out / "theirs.parquet")  # not one of ours: left where it is
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert "theirs.parquet has no path column" in capsys.readouterr().out and (out / "theirs.parquet").exists()
    # Paths that are not text: not ours either. A new image is encoded and summed up, from our files alone.
    pq.write_table(pa.table({"path": [1, 2]}), out / "ints.parquet")
    (tmp_path / "more").mkdir()
    Image.fromarray(cases._smooth(64, 96, 299)).save(tmp_path / "more" / "new.png")
    assert ray_encode.main([str(tmp_path / "more"), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    said = capsys.readouterr().out
    assert "ints.parquet has no path column of text (int64)" in said and "ray_encode: 1 image in" in said, said
    # A file whose footer reads but whose pages do not: moved aside, naming it; its rows are encoded again.
    ours = next(f for f in out.glob("*.parquet") if f.name not in ("theirs.parquet", "ints.parquet")
                and "new.png" in str(pq.read_table(f, columns=["path"])))
    data = bytearray(ours.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    data[4:len(data) - 8 - footer] = b"\xff" * (len(data) - 12 - footer)
    ours.write_bytes(bytes(data))
    assert ray_encode.main([str(tmp_path / "more"), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    said = capsys.readouterr().out
    assert f"{ours} cannot be read (" in said and "ray_encode: 1 image in" in said, said


def test_prepare_hands_contiguous_decoded_images_for_the_gpu(folder):
    """With resize "gpu" the CPU stage hands on the decoded image (the actor's GPU resizes it): contiguous
    uint8 [H, W, 3] (Arrow takes the rows as they are), equal to the decoded file, with its content size."""
    import pandas as pd

    from glmvit_cupy.ray import Prepare

    paths = sorted(str(p) for p in folder.glob("img*.png"))
    batch = pd.DataFrame({"bytes": [open(p, "rb").read() for p in paths], "path": paths})
    out = Prepare("bytes", 16, 64, resize="gpu")(batch)
    for p, canvas, content in zip(paths, out["canvas"], out["content_hw"]):
        want = np.asarray(Image.open(p).convert("RGB"))
        assert canvas.flags.c_contiguous and np.array_equal(canvas, want)
        assert tuple(content) == prepare_canvas(p, max_image_tokens=64)[2]["content"]


def test_encode_video_dataset_matches_reference_and_records_failures(local_ray, tmp_path):
    """Video files through Ray (cpu=True, one video an actor call): each row's embedding is the reference's of
    preprocess_video(path) bit for bit, with its grid, sampled frames, timestamps and fps; a file that is not a
    video, and one whose frame group is over the capacity, fail their rows by name."""
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    import shutil

    from tests.test_cli_videos import write_clip

    import glmvit_cupy.ray as gvr
    from glmvit_cupy.preprocessing.video import preprocess_video

    golden = os.path.join(os.path.dirname(__file__), "golden", "video_files")
    for name in ("h264_10bit_rot90.mp4", "h264_offset.mp4"):
        shutil.copy(os.path.join(golden, name), tmp_path / name)
    write_clip(tmp_path / "pan.mkv", n=12, h=40, w=60, fps=4)
    write_clip(tmp_path / "large.mkv", n=4, h=196, w=280, fps=4)  # a 70-token group: over capacity 60
    (tmp_path / "notes.mp4").write_text("not a video")
    files = sorted(str(p) for p in tmp_path.iterdir())
    ds = ray.data.read_binary_files(files, include_paths=True)
    rows = {r["path"]: r for r in gvr.encode_video_dataset(ds, TOWER, cpu=True, capacity_tokens=60,
                                                           max_video_tokens=400, batch_size=1).take_all()}
    assert set(rows) == set(files)
    tower = reference.Tower(reference.bind_tower(TOWER))
    for path, r in rows.items():
        assert "bytes" not in r and "frames" not in r
        if path.endswith(("notes.mp4", "large.mkv")):
            assert r["embedding"].shape == (0, 256) and path in r["error"]
            assert ("cannot open" if "notes" in path else "more than this model's capacity of 60") in r["error"]
            continue
        pv, grid, info = preprocess_video(path, max_image_tokens=400)
        ref = reference.encode_pixels(tower, pv, grid).astype(ml_dtypes.bfloat16)
        assert r["error"] is None and list(r["grid_thw"]) == grid[0].tolist() and r["tokens"] == info[0]["tokens"]
        assert list(r["frames_indices"]) == info[0]["frames_indices"] and r["fps"] == info[0]["fps"]
        assert list(r["timestamps"]) == info[0]["timestamps"]
        assert np.array_equal(r["embedding"].astype(ml_dtypes.bfloat16).view(np.uint16), ref.view(np.uint16))
    assert rows[str(tmp_path / "pan.mkv")]["grid_thw"][0] >= 2  # several frame groups


def test_encode_video_dataset_checks_its_arguments(local_ray):
    import glmvit_cupy.ray as gvr

    ds = ray.data.from_items([{"bytes": b"x"}])
    for kwargs, says in (({"target_fps": 0}, "target_fps=0 must be a positive number"),
                         ({"max_frames": 0}, "max_frames=0 must be a positive integer"),
                         ({"min_video_tokens": 50, "max_video_tokens": 40}, "min_video_tokens=50 is above"),
                         ({"capacity_tokens": 0}, "capacity_tokens=0"), ({}, "has 0 GPUs.*cpu=True"),
                         ({"max_video_pixels": 0}, "max_video_pixels=0 must be a positive integer"),
                         ({"max_video_pixels": -1}, "max_video_pixels=-1 must be a positive integer"),
                         ({"concurrency": 0}, r"concurrency=0 must be a positive integer \(encoder actors\)")):
        with pytest.raises(ValueError, match=says):
            gvr.encode_video_dataset(ds, TOWER, cpu="GPUs" not in says, **kwargs)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_an_embedding_that_overflows_is_a_failed_row(folder, tmp_path):
    """Weights that overflow the forward (cases.overflowing_tower): the actor's rows get an error naming the
    file and no embedding; a row that failed before keeps its own error."""
    import pandas as pd

    from glmvit_cupy.ray import Encode, Prepare

    paths = sorted(str(p) for p in folder.glob("img*.png"))[:2] + [str(folder / "broken.png")]
    batch = Prepare("bytes", 16, 64)(pd.DataFrame({"bytes": [open(p, "rb").read() for p in paths], "path": paths}))
    out = Encode(cases.overflowing_tower(tmp_path / "bad"), cpu=True, capacity_tokens=8000)(batch)
    for p, emb, error in zip(paths[:2], out["embedding"], out["error"]):
        assert emb.shape == (0, cases.GEOMETRY.out_hidden_size) and error.startswith(f"{p}: the tower's output holds ")
    assert "NaN or infinite" not in out["error"].iloc[2]


def test_a_row_without_file_bytes_fails_alone(folder):
    """A null, a string or a number where a row's file bytes belong: that row fails naming what it holds, the
    others are prepared (not a failed job)."""
    import pandas as pd

    from glmvit_cupy.ray import Prepare

    good = str(sorted(folder.glob("img*.png"))[0])
    batch = pd.DataFrame({"bytes": [open(good, "rb").read(), None, "a string", float("nan")],
                          "path": [good, "b", "c", "d"]})
    out = Prepare("bytes", 16, 64)(batch)
    assert pd.isna(out["error"].iloc[0]) and out["tokens"].iloc[0] > 0
    for i, held in ((1, "NoneType None"), (2, "str 'a string'"), (3, "float nan")):
        assert out["error"].iloc[i] == f"{'bcd'[i - 1]}: the bytes column holds {held}, not a file's bytes", \
            out["error"].iloc[i]


def test_a_video_too_short_to_sample_says_what_encode_video_dataset_offers(tmp_path):
    """A clip too short for target_fps fails its row with the pipeline's own setting to change (target_fps), not
    preprocess_video's sample=False, which encode_video_dataset has no way to pass."""
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    import pandas as pd

    from tests.test_cli_videos import write_clip

    from glmvit_cupy.preprocessing.image import REFERENCE
    from glmvit_cupy.ray import PrepareVideo

    path = write_clip(tmp_path / "short.mkv", n=2, h=40, w=60, fps=10)
    settings = {"target_fps": 2.0, "max_frames": 2048, "min_image_tokens": 16, "max_image_tokens": 400}
    out = PrepareVideo("bytes", settings, None, REFERENCE, 8000)(
        pd.DataFrame({"bytes": [open(path, "rb").read()], "path": ["short.mkv"]}))
    error = out["error"].iloc[0]
    assert error.startswith("short.mkv: sample_frames: a 2-frame video at 10.0 fps lasts 0.2 s") and out["tokens"][0] == 0
    assert error.endswith("; raise encode_video_dataset's target_fps to sample it") and "sample=False" not in error


def test_example_passes_over_entries_that_are_not_readable_files(local_ray, folder, tmp_path, capsys):
    """A broken symbolic link or a FIFO among the images: Ray fails the whole job on one (FileNotFoundError
    naming the path, nothing encoded); the example passes over them, saying so, and encodes the rest."""
    import pyarrow.parquet as pq
    import ray_encode

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    good = sorted(folder.glob("img*.png"))[0]
    (mixed / "good.png").write_bytes(good.read_bytes())
    (mixed / "gone.png").symlink_to(tmp_path / "no-such-file.png")
    os.mkfifo(mixed / "pipe.jpg")
    for spec in (str(mixed), str(mixed / "*")):
        out = tmp_path / f"out{len(spec)}"
        assert ray_encode.main([spec, "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
        said = capsys.readouterr().out
        assert "passed over 2 of the inputs that are not regular files this user can read" in said, said
        assert f"e.g. {mixed / 'gone.png'}" in said and "ray_encode: 1 image in" in said
        rows = [r for f in out.glob("*.parquet") for r in pq.read_table(f, columns=["path", "error"]).to_pylist()]
        assert rows == [{"path": str(mixed / "good.png"), "error": None}]


def test_a_video_whose_packets_span_no_time_says_what_the_pipeline_can_do(tmp_path):
    """Every packet at pts 0: the row fails with what encode_video_dataset can do (target_fps is the rate
    sampled, so not it: give the file timestamps, or encode it with an fps in Python), not preprocess_video's
    fps= / duration=, which the pipeline has no way to pass."""
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    import fractions

    import pandas as pd

    from tests.test_cli_videos import write_clip

    from glmvit_cupy.preprocessing.image import REFERENCE
    from glmvit_cupy.ray import PrepareVideo

    path = write_clip(tmp_path / "still.mkv", n=12, h=40, w=60, fps=fractions.Fraction(10**9, 1))  # all at pts 0
    settings = {"target_fps": 2.0, "max_frames": 2048, "min_image_tokens": 16, "max_image_tokens": 400}
    out = PrepareVideo("bytes", settings, None, REFERENCE, 8000)(
        pd.DataFrame({"bytes": [open(path, "rb").read()], "path": ["still.mkv"]}))
    error = out["error"].iloc[0]
    assert error.startswith("still.mkv: the video file of ") and out["tokens"][0] == 0, error
    assert "holds 12 video frames over 0 s; cannot sample it; encode_video_dataset takes no video's own fps " \
           "(target_fps is the rate it samples at): give the file timestamps" in error, error
    assert "-bsf:v 'setts=ts=N/(FPS*TB):duration=1/(FPS*TB)'" in error and "(fps= or duration=)" not in error, error
    assert error.endswith("or encode it with GlmVit.encode_video(path, fps=FPS)"), error


def test_example_refuses_a_second_run_into_the_same_out(folder, tmp_path, capsys):
    """Two runs into one --out at once would each encode every file the other had not finished: the second
    is refused before Ray starts, naming the pid that holds the folder; once the first ends, it runs."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray_encode

    out = tmp_path / "out"
    out.mkdir()
    paths = sorted(str(p) for p in folder.iterdir())
    pq.write_table(pa.table({"path": paths, "error": [None] * len(paths)}), out / "done.parquet")
    held = ray_encode.lock_out(str(out))
    try:
        assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is being written by another ray_encode run (pid {os.getpid()})" in err, err
    finally:
        held.close()
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert "already in" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [".ray_encode.lock", "done.parquet"]
    assert len(pq.read_table(out)) == len(paths)  # the lock file is hidden from Parquet readers


def test_example_lock_is_never_a_link_a_fifo_or_a_folder(tmp_path):
    """The lock file is opened without following a link (it would truncate the file it points to and write a
    pid there) and without waiting on a FIFO for a writer: each planted under its name is refused, saying
    what it is, and what it points to keeps its bytes."""
    import ray_encode

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    for plant, says in (("link", "is a symbolic link"), ("fifo", "is not a regular file"), ("folder", "is a folder")):
        out = tmp_path / plant
        out.mkdir()
        lock = out / ray_encode.LOCK
        if plant == "link":
            lock.symlink_to(victim)
        elif plant == "fifo":
            os.mkfifo(lock)
        else:
            lock.mkdir()
        with pytest.raises(ValueError, match=re.escape(f"{lock} {says}")):
            ray_encode.lock_out(str(out))
    assert victim.read_text() == "keep me\n"
    held = ray_encode.lock_out(str(tmp_path))  # a plain folder: locked, the pid written
    try:
        assert (tmp_path / ray_encode.LOCK).read_text() == f"{os.getpid()}\n"
    finally:
        held.close()


def test_example_says_when_a_path_is_held_by_several_rows(tmp_path, capsys):
    """Two runs at once into a folder that cannot be locked write a path twice: the next run counts the
    repeated rows and says how to read past them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray_encode

    pq.write_table(pa.table({"path": ["/x/a.png", "/x/b.png"]}), tmp_path / "one.parquet")
    pq.write_table(pa.table({"path": ["/x/b.png", None]}), tmp_path / "two.parquet")
    held = ray_encode.done_paths(str(tmp_path))
    assert held.paths == {"/x/a.png", "/x/b.png"} and not held.foreign and not held.failed
    said = capsys.readouterr().out
    assert f"1 row of {tmp_path} repeats a path" in said and "drop_duplicates('path')" in said, said
