"""The Ray pipeline and examples/ray_encode.py at their edges: columns the pipeline would overwrite, empty
datasets and bad batch sizes; resumes with other settings or into a URI, files too large, renamed, vanished
or named as Ray cannot open them, and output that readers see only whole."""

import os

import pytest
from PIL import Image

ray = pytest.importorskip("ray", reason="the ray extra (ray[data]) is not installed")
pytest.importorskip("ray.data", reason="the ray extra (ray[data]) is not installed")

from tests.golden import cases  # noqa: E402
from tests.test_ray import TOWER  # noqa: E402 - examples/ on sys.path too


def images(folder, n=3):
    folder.mkdir(exist_ok=True)
    for i in range(n):
        Image.fromarray(cases._smooth(100 + 14 * i, 150, 300 + i)).save(folder / f"img{i}.png")
    return folder


def out_paths(out):
    import pyarrow.parquet as pq

    return sorted(r["path"] for r in pq.read_table(out, columns=["path"]).to_pylist())


def test_example_refuses_to_resume_with_settings_that_change_embeddings(local_ray, tmp_path, capsys):
    """A re-run with another --max-image-tokens (or checkpoint, or --cpu) would add rows of other
    settings beside the first run's: refused (as glmvit-encode refuses), nothing added."""
    import ray_encode

    folder, out = images(tmp_path / "imgs"), tmp_path / "out"
    assert ray_encode.main([str(folder / "img0.png"), "--checkpoint", TOWER, "--out", str(out), "--cpu",
                            "--max-image-tokens", "16"]) == 0
    capsys.readouterr()
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 2
    assert "max_image_tokens" in capsys.readouterr().err.replace("-", "_")
    assert out_paths(out) == [str(folder / "img0.png")]


def test_example_a_first_run_that_wrote_nothing_binds_no_settings(local_ray, tmp_path, capsys, monkeypatch):
    """A first run that stopped before its first write (without --cpu on a cluster without GPUs, which
    says to pass --cpu) recorded its settings all the same: the run with --cpu it suggests was refused as
    "holds embeddings of other settings" in a folder that held none. Its settings now replace them; once
    a row is written, they bind (the refusal above)."""
    import ray_encode

    import glmvit_cupy.ray as gvr

    folder, out = images(tmp_path / "imgs", 2), tmp_path / "out"

    def no_gpus(*args, **kwargs):
        raise ValueError("the Ray cluster has 0 GPUs (stand-in)")

    with monkeypatch.context() as m:
        m.setattr(gvr, "encode_dataset", no_gpus)
        assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out)]) == 2
    assert (out / ray_encode.SETTINGS).exists() and not list(out.glob("*.parquet"))
    capsys.readouterr()
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert "ray_encode: 2 images in" in capsys.readouterr().out
    assert out_paths(out) == sorted(str(p) for p in folder.iterdir())
    images(folder, 3)  # one more to encode
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out)]) == 2  # rows now: bound
    assert "cpu True there, False now" in capsys.readouterr().err


def test_example_resumes_into_an_out_given_as_a_uri(local_ray, tmp_path, capsys):
    """--out as a URI (file:// here; s3://, gs:// alike): a re-run skips what is there, as for a folder,
    and the summary counts this run's images."""
    import ray_encode

    folder, out = images(tmp_path / "imgs", 2), tmp_path / "out"
    argv = [str(folder), "--checkpoint", TOWER, "--out", "file://" + str(out), "--cpu"]
    assert ray_encode.main(argv) == 0
    assert "ray_encode: 2 images in" in capsys.readouterr().out
    assert ray_encode.main(argv) == 0
    assert "already in" in capsys.readouterr().out
    assert out_paths(out) == sorted(str(p) for p in folder.iterdir())  # each once


@pytest.mark.parametrize("name", ["a\nb.png", "tab\there.png", "cr\rhere.png", os.fsdecode(b"caf\xe9.png")])
def test_example_a_name_ray_cannot_open_never_fails_the_job(local_ray, tmp_path, capsys, name):
    """Ray's path parsing drops tabs and line breaks from a path (and cannot open a name that is not UTF-8):
    one such file among the images made the whole job fail, every run, with nothing written. The example
    reads the files itself: the others are encoded whatever becomes of it."""
    import ray_encode

    folder, out = images(tmp_path / "imgs", 2), tmp_path / "out"
    Image.fromarray(cases._smooth(64, 64, 7)).save(os.path.join(str(folder), name), "PNG")
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert {str(folder / "img0.png"), str(folder / "img1.png")} <= set(out_paths(out))


def test_example_a_file_that_vanishes_after_listing_fails_alone(local_ray, tmp_path, monkeypatch):
    """A file deleted between the listing and Ray's read (a long run over a live folder): one row, not the
    job (Ray's FileNotFoundError failed it, leaving nothing but the path as the message)."""
    import ray_encode

    folder, out = images(tmp_path / "imgs", 3), tmp_path / "out"
    listed = ray_encode.local_files

    def vanishing(spec):
        files = listed(spec)
        os.remove(files[0])
        return files

    monkeypatch.setattr(ray_encode, "local_files", vanishing)
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert {str(folder / "img1.png"), str(folder / "img2.png")} <= set(out_paths(out))


def test_example_a_file_too_large_to_read_fails_alone(local_ray, tmp_path):
    """Ray reads each file whole: one huge file among the images (a 64 GiB disk image named .jpg) had the
    reading worker killed for memory and retried without end, nothing written. A file over --max-image-mib
    (as glmvit-encode's) fails its row by its size, unread. Sparse: no disk used."""
    import pyarrow.parquet as pq
    import ray_encode

    folder, out = images(tmp_path / "imgs", 2), tmp_path / "out"
    with open(folder / "huge.jpg", "wb") as f:
        f.truncate(8 << 20)  # 8 MiB here, over the 1 MiB limit given
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu",
                            "--max-image-mib", "1"]) == 0
    rows = {r["path"]: r["error"] for r in pq.read_table(out, columns=["path", "error"]).to_pylist()}
    assert rows[str(folder / "img0.png")] is None and rows[str(folder / "img1.png")] is None
    assert "over --max-image-mib 1" in rows[str(folder / "huge.jpg")], rows


def test_example_summary_survives_a_parquet_with_only_a_path_column(local_ray, tmp_path, capsys):
    """A Parquet file in --out with a text path column and no error column (taken as ours by the resume):
    the run wrote its rows, then failed its summary (exit 2, "No match for FieldRef.Name(error)")."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray_encode

    folder, out = images(tmp_path / "imgs", 1), tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"path": ["/elsewhere/x.png"]}), out / "index.parquet")
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert "ray_encode: 1 image in" in capsys.readouterr().out


def test_encode_dataset_of_no_rows(local_ray):
    """An empty dataset (no rows, so no schema): no rows back, or a ValueError saying so, not TypeError
    "argument of type 'NoneType' is not iterable"."""
    import glmvit_cupy.ray as gvr

    try:
        rows = gvr.encode_dataset(ray.data.from_items([]), TOWER, cpu=True).take_all()
    except ValueError as e:
        assert "no rows" in str(e) or "no columns" in str(e), e
    else:
        assert rows == []


def test_encode_dataset_refuses_input_columns_it_would_overwrite(local_ray):
    """"Every input column but the bytes is kept": an input column named like one the pipeline adds
    (error, tokens, embedding, canvas, content_hw, ...) was silently overwritten or dropped."""
    import io

    import glmvit_cupy.ray as gvr

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 90)).save(buf, "PNG")
    for column in ("error", "tokens", "canvas", "content_hw"):
        ds = ray.data.from_items([{"bytes": buf.getvalue(), "path": "a.png", column: "the user's"}])
        with pytest.raises(ValueError, match=column):
            gvr.encode_dataset(ds, TOWER, cpu=True)


def test_encode_dataset_checks_batch_size(local_ray):
    import glmvit_cupy.ray as gvr

    ds = ray.data.from_items([{"bytes": b"x"}])
    for bad in ("16", True, 2.5, 0, -1):
        with pytest.raises(ValueError, match=r"batch_size=.* must be a positive integer"):
            gvr.encode_dataset(ds, TOWER, cpu=True, batch_size=bad)
        with pytest.raises(ValueError, match=r"batch_size=.* must be a positive integer"):
            gvr.encode_video_dataset(ds, TOWER, cpu=True, batch_size=bad)


def test_example_retry_failed_encodes_failed_images_again_and_replaces_their_rows(local_ray, tmp_path, capsys):
    """A re-run skips the images whose rows failed (their errors are recorded) and says how to try them again:
    with --retry-failed it encodes them again, and each one's new row replaces its failed one (one row a path;
    the file holding it is written again). A failed row of a path another row holds encoded (a retry stopped
    before it removed it) is removed by the next run, as is the hidden file such a retry was writing."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray_encode

    folder, out = images(tmp_path / "imgs", 2), tmp_path / "out"
    (folder / "bad.png").write_bytes(b"not an image")
    args = [str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]
    assert ray_encode.main(args) == 0
    rows = pq.read_table(out, columns=["path", "error"]).to_pylist()
    assert sorted((os.path.basename(r["path"]), r["error"] is None) for r in rows) == \
        [("bad.png", False), ("img0.png", True), ("img1.png", True)], rows
    capsys.readouterr()
    assert ray_encode.main(args) == 0
    said = capsys.readouterr().out
    assert "already in" in said and "(1 failed: its error is recorded there; --retry-failed encodes it" in said, said
    Image.fromarray(cases._smooth(90, 120, 7)).save(folder / "bad.png", format="PNG")  # mended
    assert ray_encode.main(args + ["--retry-failed"]) == 0
    said = capsys.readouterr().out
    assert "ray_encode: 1 image in" in said and "0 failed; 2 were already done" in said, said
    rows = pq.read_table(out, columns=["path", "error"]).to_pylist()
    assert sorted(r["path"] for r in rows) == sorted(str(p) for p in folder.iterdir()), rows  # one row a path
    assert all(r["error"] is None for r in rows), rows
    encoded = str(folder / "img0.png")  # as a retry stopped before removing the failed row it replaced leaves it
    pq.write_table(pa.table({"path": [encoded], "error": ["img0.png: cannot decode image"]}), out / "stale.parquet")
    (out / ".part-1.parquet.rewrite").write_bytes(b"PAR1 half written")
    assert ray_encode.main(args) == 0
    assert "already in" in capsys.readouterr().out
    assert not (out / "stale.parquet").exists() and not (out / ".part-1.parquet.rewrite").exists()
    assert sorted(r["path"] for r in pq.read_table(out, columns=["path"]).to_pylist()) == \
        sorted(str(p) for p in folder.iterdir())


def test_example_output_is_whole_where_readers_look_and_a_stopped_runs_staged_files_are_kept(local_ray, tmp_path,
                                                                                            capsys):
    """Ray writes each Parquet file under its final name, so a reader of --out (pq.read_table(out)) saw files
    half-written while a run wrote them, and a killed run left one cut short there. Runs stage their files in
    a hidden folder and move each up whole; a resume moves up what a stopped run staged whole (its rows are
    not encoded again) and moves aside what it left cut short (those are)."""
    import shutil

    import pyarrow.parquet as pq
    import ray_encode

    folder, out = images(tmp_path / "imgs", 3), tmp_path / "out"
    assert ray_encode.main([str(folder / "img[01].png"), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    assert [p.name for p in out.iterdir() if p.name.startswith(".staging-")] == []  # nothing left staged
    whole = sorted(out.glob("*.parquet"))
    stage = out / ".staging-stopped"  # as a run stopped after writing these leaves them
    stage.mkdir()
    shutil.move(whole[0], stage / whole[0].name)
    (stage / "cut.parquet").write_bytes(b"PAR1" + b"\0" * 50)
    assert ray_encode.main([str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 0
    said = capsys.readouterr().out
    assert "ray_encode: 1 image in" in said and "cut.parquet cannot be read" in said, said
    assert not stage.exists() and (out / ".cut.parquet.unreadable").exists()
    assert sorted(r["path"] for r in pq.read_table(out, columns=["path"]).to_pylist()) == \
        sorted(str(p) for p in folder.iterdir())
