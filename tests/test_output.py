"""glmvit-encode's output folder: shards that name their own images, a manifest rewritten at most every few
seconds, and nothing finished lost when a run stops before its manifest caught up."""

import errno
import json
import logging
import os
import re
import shutil

import ml_dtypes
import numpy as np
import pytest

from glmvit_cupy.errors import OutputError
from glmvit_cupy.output import LOCK, LOST, MANIFEST, Output, file_stamp, read_embeddings
from tests.conftest import module_rng, said_within

SETTINGS = {"checkpoint": "/models/x", "min_image_tokens": 16, "max_image_tokens": 1024}
rng = module_rng(__name__)  # fresh inputs every run, seeded per test (conftest)


def batch(keys):
    return [(k, {"tokens": 3, "grid_thw": [1, 2, 6]}, rng.standard_normal((3, 8)).astype(ml_dtypes.bfloat16))
            for k in keys]


def test_the_manifest_is_rewritten_at_most_every_few_seconds(tmp_path, monkeypatch):
    out = Output(str(tmp_path / "o"), SETTINGS, flush_seconds=3600)
    writes = []
    real = out._write_json
    monkeypatch.setattr(out, "_write_json", lambda: (writes.append(1), real()))
    for i in range(20):
        out.add_batch(batch([f"/img/{i}a", f"/img/{i}b"]))
    out.fail("/img/bad", "cannot decode")
    assert writes == [] and not (tmp_path / "o" / MANIFEST).exists()
    out.flush()
    out.flush()  # nothing changed since: not written again
    assert writes == [1]
    manifest = json.loads((tmp_path / "o" / MANIFEST).read_text())
    assert len(manifest["images"]) == 40 and manifest["failed"] == {"/img/bad": "cannot decode"}
    out.flush_seconds = 0
    out.add_batch(batch(["/img/last"]))
    assert writes == [1, 1]


@pytest.mark.parametrize("manifest", [True, False])
def test_a_shard_of_another_folder_copied_in_is_refused_by_the_reader(tmp_path, manifest):
    """A shard another tower (or other limits) wrote, copied into a folder under a later number, must not
    mix its embeddings in: read_embeddings names it and the setting, as a resume does; with or without
    the manifest."""
    import shutil

    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    out = Output(mine, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a", "/img/b"]))
    other = Output(theirs, dict(SETTINGS, max_image_tokens=64), flush_seconds=0)
    other.add_batch(batch(["/img/a"]))
    shutil.copy(os.path.join(theirs, "embeddings-00001.safetensors"), os.path.join(mine, "embeddings-00099.safetensors"))
    if not manifest:
        os.remove(os.path.join(mine, MANIFEST))
    where = r"the manifest \(manifest.json\)" if manifest else "embeddings-00001.safetensors"
    with pytest.raises(OutputError, match=r"embeddings-00099.safetensors was written with other settings than "
                                          + where + r" in .*: max_image_tokens = 64 \(there: 1024\); .*move away"):
        read_embeddings(mine)
    with pytest.raises(OutputError, match="max_image_tokens"):
        Output(mine, SETTINGS)  # as the command's resume says
    os.remove(os.path.join(mine, "embeddings-00099.safetensors"))
    assert sorted(read_embeddings(mine)[1]) == ["/img/a", "/img/b"]


def _foreign_copy(tmp_path, theirs_settings, sha="theirs"):
    """(mine, its first batch): a folder whose shard 1 was replaced by another folder's shard 1, which holds the same
    keys encoded from other files (`sha`) or under other settings."""
    import shutil

    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    first = [(k, dict(info, sha256="mine"), emb) for k, info, emb in batch(["/img/a", "/img/b"])]
    out = Output(mine, SETTINGS, flush_seconds=0)
    out.add_batch(first)
    out._lock.close()
    other = Output(theirs, theirs_settings, flush_seconds=0)
    other.add_batch([(k, dict(info, sha256=sha), emb) for k, info, emb in batch(["/img/a", "/img/b"])])
    other._lock.close()
    shutil.copy(os.path.join(theirs, "embeddings-00001.safetensors"), os.path.join(mine, "embeddings-00001.safetensors"))
    return mine, first


def test_a_shard_of_another_folder_under_a_listed_name_is_named_and_never_mixed_in(tmp_path, caplog):
    """Another folder's shard 1 (same settings, the same keys from other files) copied over this folder's shard 1:
    read_embeddings returned its embeddings as this folder's, and a resume counted them done. The reader now
    names the shard, the key and what its own metadata records otherwise; a resume encodes those images again
    (saying why), never takes the shard's embeddings for them, and deletes nothing."""
    import logging

    mine, first = _foreign_copy(tmp_path, SETTINGS)
    shard = os.path.join(mine, "embeddings-00001.safetensors")
    with pytest.raises(OutputError, match=re.escape(shard) + r" is not the shard manifest.json in .* lists under that "
                       r"name \(copied in from another folder\?\): its own metadata records /img/a otherwise: "
                       r"sha256 = 'theirs' \(the manifest: 'mine'\); put back"):
        read_embeddings(mine)
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        again = Output(mine, SETTINGS, flush_seconds=0)
    assert not again.done("/img/a") and not again.done("/img/b")
    assert "not the shard manifest.json lists under that name" in caplog.text and "its 2 images" in caplog.text
    assert "sha256 = 'theirs' (the manifest: 'mine')" in again.manifest["failed"]["/img/a"]
    again.flush()
    assert read_embeddings(mine)[1] == {}  # failed, and the shard's embeddings not taken for them
    again.add_batch(first)  # the run given the files encodes them again, into shard 2
    again.flush()
    again._lock.close()
    manifest, embs = read_embeddings(mine)
    assert os.path.exists(shard) and manifest["failed"] == {} and sorted(embs) == ["/img/a", "/img/b"]
    for key, _, emb in first:
        assert np.array_equal(embs[key].view(np.uint16), emb.view(np.uint16))
    assert all(Output(mine, SETTINGS).done(k) for k in ("/img/a", "/img/b"))


def test_a_shard_of_other_settings_under_a_listed_name_is_refused_by_name(tmp_path):
    """Another tower's shard (other settings) copied over a shard the manifest lists: the reader and a resume
    refuse, naming the shard and the setting, as for an unlisted one; moved away, its images are encoded again."""
    mine, _ = _foreign_copy(tmp_path, dict(SETTINGS, max_image_tokens=64), sha="mine")
    shard = os.path.join(mine, "embeddings-00001.safetensors")
    says = (re.escape(shard) + r" was written with other settings than the manifest \(manifest.json\) in .*: "
            r"max_image_tokens = 64 \(there: 1024\); the manifest lists 2 images in it.*move it away")
    with pytest.raises(OutputError, match=says):
        read_embeddings(mine)
    with pytest.raises(OutputError, match=says):
        Output(mine, SETTINGS)
    os.rename(shard, str(tmp_path / "away.safetensors"))
    again = Output(mine, SETTINGS)
    assert not again.done("/img/a") and again.manifest["failed"]["/img/a"] == LOST


def test_a_lost_shard_keeps_its_name_while_the_manifest_lists_it(tmp_path, caplog):
    """The last shard lost (moved away), its file changed and encoded again by a run stopped before its manifest
    caught up: that run took the lost shard's number, so the manifest on disk listed the file's old entry under the
    name of a shard holding its new one, and read_embeddings and the next resume took this folder's own shard for
    another folder's ('copied in from another folder?'). A new shard now takes a number past every one the
    manifest names; the resume takes it, quietly, and encodes nothing again."""
    import logging

    from glmvit_cupy.output import file_stamp

    folder = str(tmp_path / "o")
    files = {n: tmp_path / f"{n}.png" for n in "ab"}
    for n, path in files.items():
        path.write_bytes(n.encode())

    def entry(n, sha):
        (key, info, emb), = batch([str(files[n])])
        return key, dict(info, sha256=sha, file=file_stamp(os.stat(files[n]))), emb

    first = Output(folder, SETTINGS, flush_seconds=0)
    first.add_batch([entry("b", "b1")])
    first.add_batch([entry("a", "a1")])
    first._lock.close()
    os.rename(os.path.join(folder, "embeddings-00002.safetensors"), str(tmp_path / "lost.safetensors"))
    files["a"].write_bytes(b"a, changed")
    stopped = Output(folder, SETTINGS, flush_seconds=3600)
    again = entry("a", "a2")
    stopped.add_batch([again])  # never flushed: the run is killed here
    stopped._lock.close()
    with pytest.raises(OutputError) as e:
        read_embeddings(folder)  # the manifest lists a shard lost since: said so, not taken for another folder's
    assert "copied in" not in str(e.value) and "names no shard of this folder" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        resumed = Output(folder, SETTINGS, flush_seconds=0)
    assert "copied in" not in caplog.text
    assert resumed.done(again[0], file_stamp(os.stat(files["a"]))) and resumed.manifest["failed"] == {}
    resumed.flush()
    resumed._lock.close()
    manifest, embs = read_embeddings(folder)
    assert manifest["images"][again[0]]["shard"] == "embeddings-00003.safetensors"  # past the lost shard's number
    assert np.array_equal(embs[again[0]].view(np.uint16), again[2].view(np.uint16))


def test_a_listed_shard_of_an_earlier_version_resumes_from_a_moved_checkpoint(tmp_path):
    """A shard written before the folder recorded the weights' fingerprint names the checkpoint's path alone; once
    the folder records the fingerprint, the same weights moved elsewhere resume it (its shards are its own)."""
    folder = str(tmp_path / "o")
    old = Output(folder, SETTINGS, flush_seconds=0)
    old.add_batch(batch(["/img/a"]))
    old._lock.close()
    newer = Output(folder, dict(SETTINGS, weights="f" * 64), flush_seconds=0)
    newer.add_batch(batch(["/img/b"]))
    newer._lock.close()
    moved = Output(folder, dict(SETTINGS, checkpoint="/elsewhere/x", weights="f" * 64), flush_seconds=0)
    assert moved.done("/img/a") and moved.done("/img/b")
    moved.add_batch(batch(["/img/c"]))
    moved._lock.close()
    assert sorted(read_embeddings(folder)[1]) == ["/img/a", "/img/b", "/img/c"]


def test_the_reader_names_what_differs_inside_a_setting_and_ignores_the_key_wording(tmp_path):
    """A shard whose video settings differ in one field is named with that field; a shard written under
    another wording of `key` (an earlier version's manifest, resumed) is the folder's own, as a resume says."""
    import shutil

    video = {"sample": True, "target_fps": 2.0, "max_frames": 2048, "min_image_tokens": 16, "max_image_tokens": 1024}
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    Output(mine, dict(SETTINGS, video=video), flush_seconds=0).add_batch(batch(["/img/a"]))
    Output(theirs, dict(SETTINGS, video=dict(video, max_image_tokens=2048)), flush_seconds=0).add_batch(batch(["/img/b"]))
    shutil.copy(os.path.join(theirs, "embeddings-00001.safetensors"), os.path.join(mine, "embeddings-00002.safetensors"))
    with pytest.raises(OutputError, match=r"video.max_image_tokens = 2048 \(there: 1024\)"):
        read_embeddings(mine)
    os.remove(os.path.join(mine, "embeddings-00002.safetensors"))
    path = os.path.join(mine, MANIFEST)
    old = json.loads(open(path).read())
    old["header"]["key"] = "an earlier version's wording"
    with open(path, "w") as f:
        json.dump(old, f)
    Output(mine, dict(SETTINGS, video=video), flush_seconds=3600).add_batch(batch(["/img/c"]))  # resumed, unlisted
    assert sorted(read_embeddings(mine)[1]) == ["/img/a", "/img/c"]


def test_a_batch_of_nothing_writes_no_shard(tmp_path):
    """Every embedding of a batch unusable (weights that overflow): the batch adds nothing, not an empty shard."""
    out = Output(str(tmp_path / "o"), SETTINGS)
    out.add_batch([])
    out.add_batch(batch(["/img/a"]))
    assert sorted(f for f in os.listdir(tmp_path / "o") if f.endswith(".safetensors")) == ["embeddings-00001.safetensors"]


def test_a_run_stopped_before_its_manifest_loses_nothing(tmp_path):
    """Shards written, manifest stale (one batch behind) or absent: resuming and reading find every image,
    with its embedding's bits; the next shard number follows the last."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=3600)
    first, second = batch(["/img/a", "/img/b"]), batch(["/img/c"])
    out.add_batch(first)
    out.flush()
    out.add_batch(second)  # not in manifest.json: the run "died" here
    assert len(json.loads((tmp_path / "o" / MANIFEST).read_text())["images"]) == 2
    again = Output(folder, SETTINGS)
    assert all(again.done(k) for k in ("/img/a", "/img/b", "/img/c")) and again.next_shard == 3
    manifest, arrays = read_embeddings(folder)
    assert set(arrays) == {"/img/a", "/img/b", "/img/c"} and manifest["images"]["/img/c"]["shard"].endswith("02.safetensors")
    for key, _, emb in first + second:
        assert np.array_equal(arrays[key].view(np.uint16), emb.view(np.uint16))
    os.remove(os.path.join(folder, MANIFEST))  # died before the first manifest
    resumed = Output(folder, SETTINGS)
    assert len(resumed) == 3 and len(read_embeddings(folder)[1]) == 3

    resumed.flush()  # what it recovered is written down at its first flush
    assert len(json.loads((tmp_path / "o" / MANIFEST).read_text())["images"]) == 3


def test_shard_numbers_past_99999_are_read_and_never_reused(tmp_path):
    """A long run's shard names grow past five digits (embeddings-100000...): a run stopped before its
    manifest caught up still has those shards' images found, the next run numbers on after the largest
    (a stopped run's leftover .tmp counts too), and no shard is overwritten."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=3600)
    out.next_shard = 99_999
    batches = [batch([f"/img/{i}"]) for i in range(3)]
    for b in batches:
        out.add_batch(b)  # 99999, 100000, 100001; the manifest never written: the run "died"
    names = sorted(os.listdir(folder))
    assert names == [LOCK, "embeddings-100000.safetensors", "embeddings-100001.safetensors", "embeddings-99999.safetensors"]
    open(os.path.join(folder, "embeddings-100002.safetensors.tmp"), "wb").close()  # a write cut short
    again = Output(folder, SETTINGS)
    assert len(again) == 3 and again.next_shard == 100_003
    again.add_batch(batch(["/img/new"]))
    manifest, arrays = read_embeddings(folder)
    assert len(arrays) == 4 and manifest["images"]["/img/new"]["shard"] == "embeddings-100003.safetensors"
    for b in batches:
        ((key, _, emb),) = b
        assert np.array_equal(arrays[key].view(np.uint16), emb.view(np.uint16))


def test_shards_of_other_settings_are_refused_even_without_a_manifest(tmp_path):
    folder = str(tmp_path / "o")
    Output(folder, SETTINGS, flush_seconds=3600).add_batch(batch(["/img/a"]))
    with pytest.raises(OutputError, match="max_image_tokens = 1024, this run asks for 8000 .*embeddings-00001"):
        Output(folder, dict(SETTINGS, max_image_tokens=8000))


def test_a_lost_or_unreadable_shard_is_encoded_again(tmp_path):
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    out.add_batch(batch(["/img/b"]))
    with open(os.path.join(folder, "embeddings-00002.safetensors"), "r+b") as f:
        f.truncate(10)  # damaged after the run
    os.remove(os.path.join(folder, MANIFEST))
    again = Output(folder, SETTINGS)
    assert again.done("/img/a") and not again.done("/img/b") and again.next_shard == 3


@pytest.mark.parametrize("edit,says", [
    (lambda m: m.update(failed=None), "a 'failed' object"), (lambda m: m.update(failed=5), "a 'failed' object"),
    (lambda m: m["images"]["/img/b"].update(tokens=1), r"the tensor of /img/b is BF16 \[3, 8\], not the BF16 \[1, out_hidden_size\]"),
    (lambda m: m["images"]["/img/b"].update(tokens="3"), "the entry of /img/b gives '3' tokens, not a positive count"),
])
def test_a_hand_edited_manifest_is_an_output_error_naming_it(tmp_path, edit, says):
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS)
    out.add_batch(batch(["/img/b"]))
    out.flush()
    manifest = json.loads((tmp_path / "o" / MANIFEST).read_text())
    edit(manifest)
    (tmp_path / "o" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OutputError, match=re.escape(MANIFEST) + ".*" + says):
        read_embeddings(folder)


@pytest.mark.parametrize("manifest", [
    "[" * 100_000 + "]" * 100_000,                                  # past the JSON parser's depth
    "[]",
    '{"header": {}, "images": {"/img/a": {"shard": "../elsewhere/embeddings-00001.safetensors"}}}',
    '{"header": {}, "images": {"/img/a": {"shard": 5}}}',
    '{"header": {}, "images": {"/img/a": "embeddings-00001.safetensors"}}',
    '{"header": {}, "images": {"/img/a": {"shard": "embeddings-00001.safetensors\\n"}}}',
])
def test_a_hostile_manifest_is_refused_by_the_reader_and_dropped_by_a_resume(tmp_path, manifest):
    """read_embeddings refuses a manifest it cannot trust (saying which file), never reading a shard outside
    the folder; a resumed run keeps only entries that name one of its own shards, and encodes the rest again."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS)
    out.add_batch(batch(["/img/b"]))
    out.flush()
    text = manifest
    if text.startswith("{"):
        good = json.loads((tmp_path / "o" / MANIFEST).read_text())
        bad = json.loads(text)
        text = json.dumps({"header": good["header"], "images": {**good["images"], **bad["images"]}, "failed": {}})
    (tmp_path / "o" / MANIFEST).write_text(text)
    with pytest.raises(OutputError, match=MANIFEST):
        read_embeddings(folder)
    if text.startswith("{"):
        resumed = Output(folder, SETTINGS)
        assert resumed.done("/img/b") and not resumed.done("/img/a")


def test_a_run_killed_mid_write_leaves_no_temporary_behind_its_resume(tmp_path):
    """safetensors' save_file writes through a hidden temporary of its own (.tmpXXXXXX) beside its target, which
    a process killed mid-write left in --out for good. Shards are written in a staging folder of their own,
    which the next run into the folder empties and removes; other files are left alone."""
    from glmvit_cupy.output import STAGING

    folder = tmp_path / "o"
    out = Output(str(folder), SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    out.flush()
    out._lock.close()
    assert not (folder / STAGING).exists()  # empty again after each shard
    (folder / STAGING).mkdir()
    for name in (".tmpAb3dE9", "embeddings-00002.safetensors"):
        (folder / STAGING / name).write_bytes(b"cut short")
    (folder / "embeddings-00003.safetensors.tmp").write_bytes(b"a stranger's")
    again = Output(str(folder), SETTINGS)
    assert not (folder / STAGING).exists() and (folder / "embeddings-00003.safetensors.tmp").read_bytes() == b"a stranger's"
    again.add_batch(batch(["/img/b"]))
    again.flush()
    assert set(read_embeddings(str(folder))[1]) == {"/img/a", "/img/b"}


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_manifest_that_is_not_a_file_is_refused_not_read(tmp_path, kind):
    """A FIFO named manifest.json made a resume wait forever, a link to /dev/zero read without end: refused at
    once, saying what it is."""
    folder = tmp_path / "o"
    out = Output(str(folder), SETTINGS)
    out.add_batch(batch(["/img/b"]))
    out.flush()
    (folder / MANIFEST).unlink()
    if kind == "fifo":
        os.mkfifo(folder / MANIFEST)
    else:
        os.symlink("/dev/zero", folder / MANIFEST)
    said = said_within(lambda: read_embeddings(str(folder)), OutputError)
    assert "the manifest is a" in said and "not a regular file" in said, said
    said = said_within(lambda: Output(str(folder), SETTINGS), OutputError)  # a resume alike
    assert said.startswith(f"{folder / MANIFEST} is unreadable") and "not a regular file" in said, said


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "odd_metadata"])
def test_a_shard_name_on_something_else_is_never_opened_nor_taken_as_done(tmp_path, kind):
    """A FIFO, a link to /dev/zero, or a safetensors file whose glmvit metadata is not ours, under a shard's
    name in the folder: a resume and the reader pass it over (never blocking on it), and the run's own
    shards take other numbers."""
    from safetensors.numpy import save_file

    folder = tmp_path / "o"
    folder.mkdir()
    odd = folder / "embeddings-00001.safetensors"
    if kind == "fifo":
        os.mkfifo(odd)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", odd)
    else:
        save_file({"k": np.zeros(2, np.float32)}, str(odd),
                  metadata={"glmvit": json.dumps({"header": {}, "images": {"k": 5}})})

    def run():
        out = Output(str(folder), SETTINGS)
        out.add_batch(batch(["/img/a"]))
        out.flush()
        return out

    assert said_within(run, Exception) == "returned"
    got = []
    assert said_within(lambda: got.append(read_embeddings(str(folder))), Exception) == "returned"
    manifest, embs = got[0]
    assert list(embs) == ["/img/a"] and manifest["images"]["/img/a"]["shard"] == "embeddings-00002.safetensors"


@pytest.mark.parametrize("cut", [10, -10])  # the header cut, or the last bytes of the data
def test_a_damaged_shard_the_manifest_lists_is_encoded_again(tmp_path, cut, caplog):
    """The manifest lists a shard that was damaged after the run (copied in part, a disk error): a resume
    counts its images as not done (saying which shard), though the file exists, and read_embeddings refuses
    the manifest by name instead of failing inside safetensors."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    out.add_batch(batch(["/img/b", "/img/c"]))
    out.flush()
    path = os.path.join(folder, "embeddings-00002.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(cut if cut > 0 else size + cut)
    with pytest.raises(OutputError, match="names no shard of this folder that reads whole"):
        read_embeddings(folder)
    again = Output(folder, SETTINGS)
    assert again.done("/img/a") and not again.done("/img/b") and not again.done("/img/c")
    assert "embeddings-00002.safetensors: cannot be read whole" in caplog.text


@pytest.mark.parametrize("damage, state", [
    ("truncate", "embeddings-00002.safetensors cannot be read whole (truncated or damaged)"),
    ("remove", "embeddings-00002.safetensors is missing"),
    ("folder", "embeddings-00002.safetensors is a folder, not a file"),
])
def test_read_embeddings_blames_a_damaged_shard_not_the_manifest(tmp_path, damage, state):
    """A listed shard lost or damaged since: read_embeddings names the shard and what is wrong with it, and says
    that a re-run encodes its files again; it does not call the manifest unreadable (it reads)."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    out.add_batch(batch(["/img/b"]))
    out.flush()
    out._lock.close()
    path = os.path.join(folder, "embeddings-00002.safetensors")
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(10)
    else:
        os.remove(path)
        if damage == "folder":
            os.mkdir(path)
    with pytest.raises(OutputError) as e:
        read_embeddings(folder)
    said = str(e.value)
    assert "'/img/b' names no shard of this folder that reads whole" in said and f"({state})" in said
    assert "unreadable or not a glmvit-encode manifest" not in said and "re-run glmvit-encode into" in said


def test_an_entry_its_shard_does_not_hold_is_not_done(tmp_path):
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    manifest = json.loads((tmp_path / "o" / MANIFEST).read_text())
    manifest["images"]["/img/z"] = dict(manifest["images"]["/img/a"])  # hand-edited: the shard lacks it
    (tmp_path / "o" / MANIFEST).write_text(json.dumps(manifest))
    again = Output(folder, SETTINGS)
    assert again.done("/img/a") and not again.done("/img/z")
    with pytest.raises(OutputError, match="'/img/z' names no shard"):
        read_embeddings(folder)


def test_the_writer_bounds_what_waits_by_count_and_by_bytes(tmp_path):
    """Writer: submit waits for the oldest write while more than `pending` writes, or more than `pending_bytes`
    of their nbytes, are waiting (one write always may, whatever its size); writes run in the order submitted
    and a failed one raises from check()."""
    import threading

    from glmvit_cupy.output import Writer

    out = Output(str(tmp_path / "o"), SETTINGS)
    gate, order = threading.Event(), []
    writer = Writer(out, pending=4, pending_bytes=10)
    writer.submit(lambda: (gate.wait(30), order.append(0)), nbytes=100)  # over the bound alone: accepted
    blocked = threading.Thread(target=writer.submit, args=(order.append, 1), kwargs={"nbytes": 1})
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive() and order == []  # 101 bytes waiting: the second submit waits for the first
    gate.set()
    blocked.join(30)
    assert not blocked.is_alive()
    for i in range(2, 8):  # small writes: the count bound alone applies
        writer.submit(order.append, i, nbytes=1)
    writer.submit(lambda: 1 / 0)
    writer.close()
    assert order == list(range(8))
    with pytest.raises(ZeroDivisionError):
        writer.check()


def test_keys_of_names_that_are_not_utf8_are_storable_unambiguous_and_lead_back(tmp_path):
    """A file name may hold any bytes but "/" and NUL; safetensors keys and JSON text are UTF-8. A path that
    is not UTF-8 is keyed by the repr() of its bytes: it never equals a resolved path's key (those start with
    "/"), not even that of a file whose name spells the escape out, and key_path inverts it."""
    from glmvit_cupy.output import image_key, key_path

    names = [b"caf\xe9.png", b"it's \"q\" \\ \xff\xfe.png", b"\xe9t\xe9 \xc3\xa9.jpg", b"plain.png",
             "caf\\xe9.png".encode(), b"b'x'.png"]
    keys = []
    for name in names:
        path = os.fsencode(str(tmp_path)) + b"/" + name
        open(path, "wb").close()
        key = image_key(os.fsdecode(path))
        key.encode("utf-8")  # storable
        assert os.fsencode(key_path(key)) == os.path.realpath(path)
        keys.append(key)
    assert len(set(keys)) == len(names)
    assert keys[3] == os.path.realpath(str(tmp_path / "plain.png")) and keys[0].startswith("b'")
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(keys))
    out.fail(image_key(os.fsdecode(os.fsencode(str(tmp_path)) + b"/gone\xff.png")), "gone\udcff.png: missing")
    manifest, arrays = read_embeddings(folder)
    assert set(arrays) == set(keys) and Output(folder, SETTINGS).done(keys[1])
    assert bytes.fromhex(manifest["images"][keys[1]]["path_bytes"]) == os.fsencode(key_path(keys[1]))
    assert "path_bytes" not in manifest["images"][keys[3]]
    assert list(manifest["failed"].values()) == ["gone\\xff.png: missing"]


@pytest.mark.parametrize("error", ["safetensors", "os"])
def test_a_shard_that_cannot_be_written_is_an_output_error_naming_it(tmp_path, monkeypatch, error):
    """safetensors says a full disk as a SafetensorError, not an OSError: either is an OutputError naming the
    shard; its temporary file is removed, and the shards before it stay."""
    import errno

    import safetensors.numpy
    from safetensors import SafetensorError

    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))

    def full(tensors, path, metadata=None):
        open(path, "wb").close()
        if error == "os":
            raise OSError(errno.EFBIG, "File too large")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    why = "File too large" if error == "os" else "No space left on device"
    with pytest.raises(OutputError, match=f"cannot write {folder}/embeddings-00002.safetensors: .*{why}"):
        out.add_batch(batch(["/img/b"]))
    assert sorted(os.listdir(folder)) == [LOCK, "embeddings-00001.safetensors", MANIFEST]
    assert set(read_embeddings(folder)[1]) == {"/img/a"}


def test_after_a_failed_write_the_writer_runs_no_more(tmp_path):
    from glmvit_cupy.output import Writer

    out = Output(str(tmp_path / "o"), SETTINGS)
    ran = []
    writer = Writer(out, pending=None)
    writer.submit(ran.append, 1)
    writer.submit(lambda: 1 / 0)
    writer.submit(ran.append, 3)  # queued behind the failure: not run (the run stops; a re-run does it)
    writer.close()
    assert ran == [1]
    with pytest.raises(ZeroDivisionError):
        writer.check()


def test_earlier_failures_stay_in_the_manifest_until_encoded(tmp_path):
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    out.fail("/img/bad", "cannot decode")
    out.fail("/img/later", "cannot read")
    again = Output(folder, SETTINGS)
    assert again.manifest["failed"] == {"/img/bad": "cannot decode", "/img/later": "cannot read"}
    again.add_batch(batch(["/img/later"]))
    again.flush()
    assert json.loads((tmp_path / "o" / MANIFEST).read_text())["failed"] == {"/img/bad": "cannot decode"}


def test_an_older_shard_never_brings_back_an_entry_dropped_or_failed(tmp_path):
    """/img/a encoded, encoded again (changed) into a later shard, and that shard lost: the resume drops its entry.
    /img/c encoded, then failed (changed into a bad file). Either key's older shard, no longer listed, still
    holds the embedding from before the file changed; with the file gone (no stamp to compare), the resume took
    it back as current, and erased /img/c's failure; the reader took /img/a's as well, once the manifest dropped
    it. The dropped entry is failed now, saying why."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    for keys in (["/img/a"], ["/img/a"], ["/img/c"], ["/img/b"]):  # shards 1 to 4
        out.add_batch(batch(keys))
    out.fail("/img/c", "cannot decode")
    out.flush()
    out._lock.close()
    os.remove(os.path.join(folder, "embeddings-00002.safetensors"))
    again = Output(folder, SETTINGS)
    again.flush()
    assert again.done("/img/b") and not again.done("/img/a") and not again.done("/img/c")
    manifest, embs = read_embeddings(folder)
    assert list(embs) == ["/img/b"] and manifest["failed"] == {"/img/a": LOST, "/img/c": "cannot decode"}


def test_two_processes_never_write_one_folder(tmp_path):
    """Two glmvit-encode runs into one --out overwrote each other's shards (both numbered from the same
    folder), each exiting 0: the second is refused while the first holds the folder, and the folder is free
    again once it ends, however it ends."""
    import subprocess
    import sys

    folder = str(tmp_path / "o")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import json, sys, time; from glmvit_cupy.output import Output; "
         "o = Output(sys.argv[1], json.loads(sys.argv[2])); print('held', flush=True); time.sleep(60)",
         folder, json.dumps(SETTINGS)], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputError, match="another process is writing to this output folder"):
            Output(folder, SETTINGS)
    finally:
        holder.kill()
        holder.wait()
    Output(folder, SETTINGS).add_batch(batch(["/img/a"]))  # the kill let it go


def test_a_run_that_ends_as_another_starts_is_never_undone_by_it(tmp_path, monkeypatch):
    """A run read the manifest before it took the folder's lock: a run writing the folder that ended between the two
    (failing /img/a, changed into a bad file) left a manifest the second run never read, and the second took
    /img/a's older embedding as done and wrote it back as its entry. The folder is locked before its manifest is
    read."""
    import glmvit_cupy.output as output

    folder = str(tmp_path / "o")
    first = Output(folder, SETTINGS, flush_seconds=0)
    first.add_batch(batch(["/img/a"]))
    real = output._lock_folder

    def the_first_ends_meanwhile(where, *made):
        if first._lock is not None:
            first.fail("/img/a", "cannot decode")
            first.flush()
            first._lock.close()
            first._lock = None
        return real(where, *made)

    monkeypatch.setattr(output, "_lock_folder", the_first_ends_meanwhile)
    second = Output(folder, SETTINGS)
    second.add_batch(batch(["/img/b"]))
    second.flush()
    assert not second.done("/img/a") and second.manifest["failed"] == {"/img/a": "cannot decode"}
    manifest, embs = read_embeddings(folder)
    assert list(embs) == ["/img/b"] and manifest["failed"] == {"/img/a": "cannot decode"}


def test_a_lock_file_that_is_not_a_file_is_named_never_waited_on(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this OS")
    folder = tmp_path / "o"
    folder.mkdir()
    os.mkfifo(folder / ".glmvit-encode.lock")
    with pytest.raises(OutputError, match=r"\.glmvit-encode\.lock is a FIFO \(named pipe\), not the lock file "
                                          "glmvit-encode makes: remove it"):
        Output(str(folder), SETTINGS)
    os.unlink(folder / ".glmvit-encode.lock")
    (folder / ".glmvit-encode.lock").mkdir()
    with pytest.raises(OutputError, match=r"\.glmvit-encode\.lock is a folder, not the lock file"):
        Output(str(folder), SETTINGS)


def test_a_lock_file_that_is_a_link_is_named_never_followed(tmp_path):
    """A symbolic link planted as the lock file was opened with O_CREAT, which made (and locked) an empty file
    wherever it pointed, outside the folder: a link there is refused, naming it, and nothing is made."""
    folder = tmp_path / "o"
    folder.mkdir()
    (folder / LOCK).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OutputError, match=r"\.glmvit-encode\.lock is a symbolic link \(to .*elsewhere\), not the lock "
                                          r"file glmvit-encode makes: remove it"):
        Output(str(folder), SETTINGS)
    assert not (tmp_path / "elsewhere").exists()
    (folder / LOCK).unlink()
    Output(str(folder), SETTINGS).add_batch(batch(["/img/a"]))


@pytest.mark.parametrize("name, make, there", [
    (".glmvit-encode.tmp", lambda p: p.touch(), "a file"),
    (".glmvit-encode.tmp", lambda p: p.symlink_to(p.parent.parent / "nowhere"), "a symbolic link"),
    (".glmvit-encode.tmp", os.mkfifo, "a FIFO"),
    ("manifest.json.tmp", lambda p: p.mkdir(), "a folder")])
def test_a_temporary_name_taken_by_something_else_is_named_at_the_start(tmp_path, name, make, there):
    """Something else under the name a shard is written in (a file, a link) or the manifest's temporary (a folder)
    failed every write, said as 'cannot write embeddings-00001.safetensors: File exists' (or 'manifest.json: Is a
    directory') with the advice to free space, and a re-run failed the same way. The start refuses, naming it."""
    folder = tmp_path / "o"
    folder.mkdir()
    make(folder / name)
    with pytest.raises(OutputError, match=rf"{re.escape(name)} is {there}.*, where glmvit-encode makes .*: remove it"):
        Output(str(folder), SETTINGS)
    (os.rmdir if there == "a folder" else os.unlink)(folder / name)
    out = Output(str(folder), SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    assert list(read_embeddings(str(folder))[1]) == ["/img/a"]


def test_the_manifest_is_never_written_through_a_link_under_its_temporary_name(tmp_path):
    """A symbolic link planted as manifest.json.tmp had the manifest written into its target, outside the
    folder, and manifest.json became a link to it."""
    folder, victim = tmp_path / "o", tmp_path / "victim"
    folder.mkdir()
    victim.write_text("keep")
    (folder / "manifest.json.tmp").symlink_to(victim)
    out = Output(str(folder), SETTINGS)
    out.add_batch(batch(["/img/a"]))
    out.flush()
    assert victim.read_text() == "keep"
    assert not (folder / "manifest.json").is_symlink() and "/img/a" in (folder / "manifest.json").read_text()


def _lock_open_fails(monkeypatch, error: OSError, when=lambda path: True):
    """os.open of the lock file raises `error` (with the path) where when(path): as for a user, or on a read-only
    mount; every other open is the real one."""
    real_open = os.open

    def failing(path, flags, *a):
        if str(path).endswith(".glmvit-encode.lock") and when(path):
            raise type(error)(error.errno, error.strerror, str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", failing)


def test_a_read_only_lock_file_says_to_make_it_writable(tmp_path, monkeypatch):
    """Opening a read-only file for writing is EACCES, except for root: os.open is made to answer as for a user."""
    folder = tmp_path / "o"
    folder.mkdir()
    (folder / ".glmvit-encode.lock").touch(mode=0o444)
    _lock_open_fails(monkeypatch, PermissionError(13, "Permission denied"), lambda p: not os.stat(p).st_mode & 0o200)
    with pytest.raises(OutputError, match=r"\.glmvit-encode\.lock cannot be opened for writing \(Permission denied\); "
                                          r"glmvit-encode locks that file .*make it writable \(chmod u\+w\) or remove it"):
        Output(str(folder), SETTINGS)
    os.chmod(folder / ".glmvit-encode.lock", 0o644)
    Output(str(folder), SETTINGS).add_batch(batch(["/img/a"]))


def test_a_folder_that_cannot_be_written_says_out_must_be_writable(tmp_path, monkeypatch):
    """A read-only mount (EROFS; root too) refuses the lock file: the error says --out must be writable, and how
    to read such a folder."""
    folder = tmp_path / "o"
    folder.mkdir()
    _lock_open_fails(monkeypatch, OSError(30, "Read-only file system"))
    with pytest.raises(OutputError, match=r"\.glmvit-encode\.lock: Read-only file system; glmvit-encode locks the "
                                          r"folder it writes, so --out must be a folder it can write in"):
        Output(str(folder), SETTINGS)


@pytest.mark.parametrize("bad", ["relative/a.png", "", "b'a' b'c'", "b'/x' # c", "b'rel'", None, b"/x",
                                 "b''+" + "-" * 200_000 + "1", "/x\0y", repr(b"/x\0y")])
def test_key_path_refuses_what_image_key_never_gives(bad):
    from glmvit_cupy.output import key_path

    with pytest.raises(ValueError, match="is not a key glmvit-encode writes"):
        key_path(bad)


def test_image_key_of_a_bytes_path_and_back(tmp_path):
    from glmvit_cupy.output import image_key, key_path

    raw = os.fsencode(str(tmp_path)) + b"/caf\xe9.png"
    key = image_key(raw)
    assert key == repr(os.path.realpath(raw)) and os.fsencode(key_path(key)) == os.path.realpath(raw)
    assert key_path(image_key(str(tmp_path / "a.png"))) == str(tmp_path / "a.png")


def test_read_embeddings_of_no_folder_is_an_output_error(tmp_path):
    with pytest.raises(OutputError, match="no such folder; give the folder glmvit-encode wrote"):
        read_embeddings(str(tmp_path / "none"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is not a folder"):
        read_embeddings(str(tmp_path / "f"))
    with pytest.raises(TypeError, match="folder is a NoneType, not a path"):
        read_embeddings(None)


def test_read_embeddings_takes_a_folder_as_str_bytes_or_path(tmp_path):
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a", "/img/b"]))
    out.flush()
    manifest, embs = read_embeddings(folder)
    assert sorted(embs) == ["/img/a", "/img/b"]
    for same in (os.fsencode(folder), tmp_path / "o"):
        m, e = read_embeddings(same)
        assert m == manifest and all(np.array_equal(e[k].view(np.uint16), embs[k].view(np.uint16)) for k in embs)


@pytest.mark.parametrize("tensor", [np.array(1.0, np.float32), np.zeros((3, 7), ml_dtypes.bfloat16),
                                    np.zeros((3, 8), np.float32), np.zeros((3, 8, 1), ml_dtypes.bfloat16)])
def test_a_shard_tensor_unlike_its_entry_is_refused_by_the_reader_and_encoded_again(tmp_path, tensor):
    """A shard's tensor replaced (same metadata) by a scalar, another width, dtype or rank: read_embeddings once
    crashed on the scalar (IndexError) and returned the others as embeddings; a resume counted them done."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    folder, settings = str(tmp_path / "o"), dict(SETTINGS, geometry={"out_hidden_size": 8})
    out = Output(folder, settings, flush_seconds=0)
    out.add_batch(batch(["/img/a", "/img/b"]))
    out.flush()
    out._lock.close()
    shard = os.path.join(folder, "embeddings-00001.safetensors")
    with safe_open(shard, "numpy") as f:
        meta, held = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(dict(held, **{"/img/b": tensor}), shard, metadata=meta)
    with pytest.raises(OutputError, match=re.escape(MANIFEST) + ".*the tensor of /img/b is .* not the BF16 \\[3, 8\\]"):
        read_embeddings(folder)
    os.remove(os.path.join(folder, MANIFEST))  # the shard alone: its metadata's entry is not taken either
    assert list(read_embeddings(folder)[1]) == ["/img/a"]
    again = Output(folder, settings)
    assert again.done("/img/a") and not again.done("/img/b")


@pytest.mark.parametrize("edit,kept", [(lambda m: m.update(failed=[1]), {"/img/a", "/img/b"}),
                                       (lambda m: m["images"]["/img/b"].update(tokens="3"), {"/img/a"})])
def test_a_resume_rewrites_a_manifest_the_reader_refuses(tmp_path, edit, kept):
    """A resume with nothing to encode left a hand-edited manifest as it was, which read_embeddings refuses:
    the run dropped what it could not trust, so it writes the manifest again (and encodes a dropped entry)."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a", "/img/b"]))
    out.flush()
    out._lock.close()
    manifest = json.loads((tmp_path / "o" / MANIFEST).read_text())
    edit(manifest)
    (tmp_path / "o" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OutputError):
        read_embeddings(folder)
    again = Output(folder, SETTINGS)
    again.flush()
    assert set(read_embeddings(folder)[1]) == kept == {k for k in ("/img/a", "/img/b") if again.done(k)}


def test_a_stray_file_of_a_long_shard_number_is_not_a_shard(tmp_path):
    """embeddings-<228 digits>.safetensors made every later run fail writing shard <that + 1> (name too long)."""
    folder = tmp_path / "o"
    folder.mkdir()
    (folder / ("embeddings-" + "9" * 228 + ".safetensors")).write_bytes(b"")
    out = Output(str(folder), SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    assert out.manifest["images"]["/img/a"]["shard"] == "embeddings-00001.safetensors"
    out._lock.close()
    os.rename(folder / "embeddings-00001.safetensors", folder / "embeddings-999999999.safetensors")
    os.remove(folder / MANIFEST)
    with pytest.raises(OutputError, match="holds shard 999,999,999, the last number a shard may have"):
        Output(str(folder), SETTINGS)


@pytest.mark.parametrize("grid", [[1, 2, 2], [1, "a", 3], [1, 2, 6, 1], "1x2x6", [1, 2, 6.0], [0, 2, 6]])
def test_an_entry_whose_grid_contradicts_its_tokens_is_refused_and_encoded_again(tmp_path, grid):
    """An entry's grid_thw edited so that it no longer makes its tokens (t x h x w / merge^2): read_embeddings
    returned it beside the embedding, and a resume counted it done."""
    folder = str(tmp_path / "o")
    settings = dict(SETTINGS, geometry={"out_hidden_size": 8, "spatial_merge_size": 2})
    out = Output(folder, settings, flush_seconds=0)
    out.add_batch(batch(["/img/a", "/img/b"]))
    out.flush()
    out._lock.close()
    assert set(read_embeddings(folder)[1]) == {"/img/a", "/img/b"}  # [1, 2, 6] makes 3 tokens: consistent
    manifest = json.loads((tmp_path / "o" / MANIFEST).read_text())
    manifest["images"]["/img/b"]["grid_thw"] = grid
    (tmp_path / "o" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OutputError, match=re.escape(MANIFEST) + ".*the entry of /img/b gives grid_thw .* 3 tokens"):
        read_embeddings(folder)
    again = Output(folder, settings)
    assert again.done("/img/a") and not again.done("/img/b")


def _folder_id_of(path) -> str | None:
    """The folder id a manifest (a path ending in manifest.json) or a shard records."""
    from safetensors import safe_open

    if str(path).endswith(MANIFEST):
        return json.loads(open(path).read())["header"].get("folder_id")
    with safe_open(str(path), "numpy") as f:
        return json.loads(f.metadata()["glmvit"])["header"].get("folder_id")


def _as_an_earlier_version_wrote(folder):
    """The folder's manifest and shards without the folder id, as a version that recorded none wrote them."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, MANIFEST)
    if os.path.exists(path):
        manifest = json.loads(open(path).read())
        del manifest["header"]["folder_id"]
        with open(path, "w") as f:
            json.dump(manifest, f)
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            shard = os.path.join(folder, name)
            with safe_open(shard, "numpy") as f:
                meta = json.loads(f.metadata()["glmvit"])
            del meta["header"]["folder_id"]
            save_file(load_file(shard), shard, metadata={"glmvit": json.dumps(meta)})


def _same_bits(embs, written):
    for key, _, emb in written:
        assert np.array_equal(embs[key].view(np.uint16), emb.view(np.uint16)), key


def test_another_folders_shard_of_the_same_settings_under_a_new_number_is_passed_over(tmp_path, caplog):
    """Another folder's shard (the same settings; one key this folder holds, encoded from another file, and one it
    lacks) copied in under a number the manifest does not list was taken as a newer encode: read_embeddings
    replaced this folder's embedding with it, and a resume counted its images done. Each folder now records an id,
    in its manifest and its shards: the shard is passed over by both, named with both ids."""
    import logging
    import shutil

    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    first = batch(["/img/a"])
    out = Output(mine, SETTINGS, flush_seconds=0)
    out.add_batch(first)
    out._lock.close()
    other = Output(theirs, SETTINGS, flush_seconds=0)
    other.add_batch(batch(["/img/a", "/img/z"]))
    other._lock.close()
    ids = _folder_id_of(os.path.join(mine, MANIFEST)), _folder_id_of(os.path.join(theirs, MANIFEST))
    assert re.fullmatch("[0-9a-f]{32}", ids[0]) and ids[0] != ids[1]
    assert _folder_id_of(os.path.join(mine, "embeddings-00001.safetensors")) == ids[0]
    copied = os.path.join(mine, "embeddings-00007.safetensors")
    shutil.copy(os.path.join(theirs, "embeddings-00001.safetensors"), copied)
    says = (f"{copied}: written into another output folder (its folder_id is {ids[1]}; this folder's is {ids[0]}, "
            "recorded in manifest.json) and not listed in manifest.json (copied in from another folder?): passed "
            "over, its 2 images not taken for this folder's; move it out of the folder")
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        manifest, embs = read_embeddings(mine)
    assert says in caplog.text and sorted(embs) == ["/img/a"]
    assert manifest["images"]["/img/a"]["shard"] == "embeddings-00001.safetensors"
    _same_bits(embs, first)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        again = Output(mine, SETTINGS, flush_seconds=0)
    assert says in caplog.text
    assert again.done("/img/a") and not again.done("/img/z") and again.next_shard == 8  # its number stays taken
    assert again.manifest["images"]["/img/a"]["shard"] == "embeddings-00001.safetensors"
    assert again.manifest["header"]["folder_id"] == ids[0]


def test_an_earlier_versions_folder_resumes_whole_and_records_an_id_before_any_shard(tmp_path, caplog):
    """A folder an earlier version wrote (no id in its manifest nor its shards; one shard its manifest does not
    list, from a stopped run) resumes as before, its old shards all its own; the resume records an id in the
    manifest before it writes a shard, so a shard of that id its next stop leaves unlisted is its own, while one
    recording another id (copied in) is not."""
    import logging
    import shutil

    folder = str(tmp_path / "o")
    old = Output(folder, SETTINGS, flush_seconds=3600)
    written = batch(["/img/a"])
    old.add_batch(written)
    old.flush()
    written += batch(["/img/b"])
    old.add_batch(written[1:])  # unlisted: the run stopped before its manifest caught up
    old._lock.close()
    _as_an_earlier_version_wrote(folder)
    other = Output(str(tmp_path / "theirs"), SETTINGS, flush_seconds=0)
    other.add_batch(batch(["/img/z"]))
    other._lock.close()
    shutil.copy(str(tmp_path / "theirs" / "embeddings-00001.safetensors"),
                os.path.join(folder, "embeddings-00003.safetensors"))
    assert sorted(read_embeddings(folder)[1]) == ["/img/a", "/img/b"]  # the manifest records no id: none is this's
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        resumed = Output(folder, SETTINGS, flush_seconds=3600)
    assert "embeddings-00003.safetensors: written into another output folder" in caplog.text
    assert "earlier version wrote records none" in caplog.text
    assert resumed.done("/img/a") and resumed.done("/img/b") and not resumed.done("/img/z")
    own = _folder_id_of(os.path.join(folder, MANIFEST))  # written at the start, before any shard
    assert own is not None and own == resumed.manifest["header"]["folder_id"]
    written += batch(["/img/c"])
    resumed.add_batch(written[2:])  # shard 4, never listed: killed here
    resumed._lock.close()
    assert _folder_id_of(os.path.join(folder, "embeddings-00004.safetensors")) == own
    again = Output(folder, SETTINGS, flush_seconds=0)  # the old shards, listed, are not refused for lacking the id
    assert all(again.done(k) for k in ("/img/a", "/img/b", "/img/c")) and not again.done("/img/z")
    again.flush()
    again._lock.close()
    manifest, embs = read_embeddings(folder)
    assert sorted(embs) == ["/img/a", "/img/b", "/img/c"] and manifest["header"]["folder_id"] == own
    _same_bits(embs, written)
    assert Output(folder, SETTINGS).manifest["header"]["folder_id"] == own


@pytest.mark.parametrize("manifest", ["deleted", "unreadable"])
def test_a_folder_without_its_manifest_takes_the_id_its_shards_record(tmp_path, caplog, manifest):
    """No manifest (deleted, or unreadable and moved away as the refusal says): the folder's id is the one its
    shards record (shards of an earlier version, recording none, are taken too), and every shard is taken. Shards
    recording two ids are refused by both the reader and a resume, naming each id and its shards: nothing tells
    which are this folder's."""
    import shutil

    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    written = batch(["/img/a"])
    out.add_batch(written)
    out._lock.close()
    _as_an_earlier_version_wrote(folder)  # shard 1: an earlier version's
    out = Output(folder, SETTINGS, flush_seconds=3600)
    own = out.manifest["header"]["folder_id"]
    written += batch(["/img/b"]) + batch(["/img/c"])
    out.add_batch(written[1:2])
    out.flush()
    out.add_batch(written[2:])
    out._lock.close()
    path = os.path.join(folder, MANIFEST)
    if manifest == "deleted":
        os.remove(path)
    else:
        with open(path, "r+") as f:
            f.truncate(20)
        with pytest.raises(OutputError, match="unreadable"):
            Output(folder, SETTINGS)
        os.rename(path, str(tmp_path / "manifest.away"))
    manifest_read, embs = read_embeddings(folder)
    assert sorted(embs) == ["/img/a", "/img/b", "/img/c"] and manifest_read["header"]["folder_id"] == own
    _same_bits(embs, written)
    other = Output(str(tmp_path / "theirs"), SETTINGS, flush_seconds=0)
    other.add_batch(batch(["/img/z"]))
    other._lock.close()
    theirs = other.manifest["header"]["folder_id"]
    copied = os.path.join(folder, "embeddings-00009.safetensors")
    shutil.copy(str(tmp_path / "theirs" / "embeddings-00001.safetensors"), copied)
    says = (re.escape(folder) + r" has no manifest.json, and its shards were written into 2 output folders \(folder_id "
            f"{own}: embeddings-00002.safetensors, embeddings-00003.safetensors \\(2 shards\\); folder_id {theirs}: "
            r"embeddings-00009.safetensors \(1 shard\)\).*Move the shards copied in from another folder out of it")
    with pytest.raises(OutputError, match=says):
        read_embeddings(folder)
    with pytest.raises(OutputError, match=says):
        Output(folder, SETTINGS)
    os.remove(copied)
    resumed = Output(folder, SETTINGS, flush_seconds=0)
    assert resumed.manifest["header"]["folder_id"] == own and len(resumed) == 3
    resumed.flush()
    assert _folder_id_of(path) == own


def test_a_folder_copied_whole_is_its_own_and_resumes(tmp_path):
    """A folder copied whole elsewhere keeps its id: the copy's unlisted shards (a stopped run's) are its own."""
    import shutil

    folder, copy = str(tmp_path / "o"), str(tmp_path / "copy")
    out = Output(folder, SETTINGS, flush_seconds=3600)
    written = batch(["/img/a"])
    out.add_batch(written)
    out.flush()
    written += batch(["/img/b"])
    out.add_batch(written[1:])  # unlisted
    out._lock.close()
    shutil.copytree(folder, copy)
    manifest, embs = read_embeddings(copy)
    assert sorted(embs) == ["/img/a", "/img/b"]
    _same_bits(embs, written)
    resumed = Output(copy, SETTINGS)
    assert resumed.done("/img/a") and resumed.done("/img/b")
    assert resumed.manifest["header"]["folder_id"] == manifest["header"]["folder_id"]


# -- unlucky folders: a shard that cannot be opened for now, a folder that cannot be listed, a stale sibling --

def _embedding(seed):
    return np.random.default_rng(seed).standard_normal((3, 8)).astype(ml_dtypes.bfloat16)


def _stamped_entry(stamp):
    return {"tokens": 3, "grid_thw": [1, 2, 6], "file": stamp}


@pytest.mark.parametrize("listed", [True, False])
def test_a_shard_that_cannot_be_opened_for_a_moment_is_not_dropped_for_good(tmp_path, monkeypatch, listed):
    """A whole shard that a resume cannot open for now (EACCES: shards another user wrote under umask 077; EIO on
    a network mount) stops the run with an OutputError naming it, listed in the manifest or not yet (the run
    stopped before its manifest caught up); its entries are never dropped as lost, which, once the shard read
    again, would leave its images out of read_embeddings and the resume for good wherever their input files are
    no longer reachable."""
    import safetensors

    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0 if listed else 3600)
    out.add_batch(batch(["/img/a"]))
    out.flush()
    out.add_batch(batch(["/img/b"]))  # shard 2: listed at once, or left for a flush that never comes
    out._lock.close()
    real = safetensors.safe_open

    def denied(path, *a, **k):
        if str(path).endswith("embeddings-00002.safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", denied)
    for call in (lambda: Output(folder, SETTINGS, flush_seconds=0), lambda: read_embeddings(folder)):
        with pytest.raises(OutputError) as refused:
            call()
        said = str(refused.value)
        assert said.startswith("cannot open ") and "embeddings-00002.safetensors" in said, said
        assert "Permission denied" in said and "make it readable" in said, said
    monkeypatch.setattr(safetensors, "safe_open", real)  # the shard reads again
    assert {"/img/a", "/img/b"} <= set(read_embeddings(folder)[1])
    again = Output(folder, SETTINGS)
    assert again.done("/img/a") and again.done("/img/b")


@pytest.mark.parametrize("how", ["restored", "sibling"])
def test_the_reader_never_gives_an_embedding_the_resume_rejects_as_another_files(tmp_path, how):
    """An unlisted shard holding a key's embedding of another version of the file than the one there now (its
    recorded stamp differs) is passed over by read_embeddings as by a resume, which keep the manifest's:
    `restored` - the file was changed, encoded again by a run stopped before its manifest caught up, then restored
    from a backup with its time kept (cp -p, rsync -a); `sibling` - a whole copy of the folder (the same folder_id)
    encoded its own, different file at that path, and its shard was copied in under a new number. Taking it would
    give the embedding of content the file no longer (or never) had, against the manifest on disk."""
    img = tmp_path / "a.jpg"
    img.write_bytes(b"version 1")
    st = os.stat(img)
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=3600)
    mine = _embedding(1)
    out.add_batch([(str(img), _stamped_entry(file_stamp(st)), mine)])
    out.flush()
    other = [len(b"another version"), st.st_mtime_ns + 10**9]
    if how == "restored":
        out.add_batch([(str(img), _stamped_entry(other), _embedding(2))])  # shard 2, unlisted: the run stopped here
        out._lock.close()
    else:
        out._lock.close()
        copy = str(tmp_path / "copy")
        shutil.copytree(folder, copy)
        theirs = Output(copy, SETTINGS, flush_seconds=0)
        theirs.add_batch([(str(img), _stamped_entry(other), _embedding(2))])  # the copy's own file at that path
        theirs._lock.close()
        shutil.copy(os.path.join(copy, "embeddings-00002.safetensors"),
                    os.path.join(folder, "embeddings-00007.safetensors"))
    assert file_stamp(os.stat(img)) == file_stamp(st)  # the file there is the one shard 1 encoded
    resumed = Output(folder, SETTINGS, flush_seconds=0)
    assert resumed.done(str(img), file_stamp(os.stat(img)))
    assert resumed.manifest["images"][str(img)]["shard"] == "embeddings-00001.safetensors"
    resumed.flush()
    resumed._lock.close()
    manifest, embs = read_embeddings(folder)
    assert manifest["images"][str(img)]["shard"] == "embeddings-00001.safetensors"
    assert np.array_equal(embs[str(img)].view(np.uint16), mine.view(np.uint16))


@pytest.mark.parametrize("manifest", [True, False])
def test_the_reader_names_an_unlisted_shard_it_cannot_read(tmp_path, caplog, manifest):
    """An unlisted shard (a stopped run's; or every shard, with the manifest moved away as the reader's own message
    advises) that is damaged is named, in a warning or an OutputError: a caller told nothing would take fewer
    embeddings than the folder holds for all of them."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=3600)
    out.add_batch(batch(["/img/a"]))
    out.flush()
    out.add_batch(batch(["/img/b", "/img/c"]))  # unlisted: the run stopped before its manifest caught up
    out._lock.close()
    if not manifest:
        os.remove(os.path.join(folder, MANIFEST))
    shard = os.path.join(folder, "embeddings-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1)
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        try:
            read_embeddings(folder)
        except OutputError as e:
            assert "embeddings-00002.safetensors" in str(e)
            return
    assert "embeddings-00002.safetensors" in caplog.text, "two images left out without a word"


@pytest.mark.parametrize("call", ["read_embeddings", "Output"])
def test_a_folder_that_cannot_be_listed_is_an_output_error(tmp_path, monkeypatch, call):
    """--out (or the folder read) that can be entered but not listed (chmod a-r, as a non-root user; or EIO) is an
    OutputError naming it, which glmvit-encode reports in one line, not a PermissionError's traceback."""
    folder = str(tmp_path / "o")
    out = Output(folder, SETTINGS, flush_seconds=0)
    out.add_batch(batch(["/img/a"]))
    out._lock.close()
    real = os.listdir

    def listdir(path="."):
        if os.path.abspath(path) == folder:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    with pytest.raises(OutputError):
        read_embeddings(folder) if call == "read_embeddings" else Output(folder, SETTINGS)


def test_a_refused_run_unlinks_the_lock_file_it_made_while_it_holds_it(tmp_path, monkeypatch):
    """A run refused after locking a folder that had no lock file (one the user made) removes the file it made,
    and does so while it still holds the lock. Closed first, a run that took the lock between the close and the
    unlink would hold it on an unlinked file; a third run would make a new lock file, lock it and write the folder
    beside the second: both writing shard 2, the last manifest written winning. discard() likewise."""
    import glmvit_cupy.output as output

    folder = str(tmp_path / "o")
    first = Output(folder, SETTINGS, flush_seconds=0)
    first.add_batch(batch(["/img/a"]))
    first._lock.close()
    os.remove(os.path.join(folder, LOCK))
    events = []
    real_lock, real_unlink = output._lock_folder, os.unlink

    def lock_folder(path, *made):
        f = real_lock(path, *made)
        close = f.close
        f.close = lambda: (events.append("close"), close())
        return f

    def unlink(path, *a, **k):
        if str(path).endswith(LOCK):
            events.append("unlink")
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(output, "_lock_folder", lock_folder)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OutputError, match="max_image_tokens"):
        Output(folder, dict(SETTINGS, max_image_tokens=64))
    assert events == ["unlink", "close"] and not os.path.lexists(os.path.join(folder, LOCK))
    events.clear()
    Output(str(tmp_path / "new"), SETTINGS).discard()
    assert events == ["unlink", "close"] and not os.path.exists(tmp_path / "new")


def test_the_manifest_is_written_by_jsons_c_encoder(tmp_path, monkeypatch):
    """_write_json says "no indent: json's C encoder", but json.dump (to a file) never uses the C encoder: it runs
    json's pure-Python iterencode, 3-4x slower (1M entries: ~20 s against ~5 s a rewrite), and the writer thread,
    which also writes the shards, rewrites a large folder's manifest every 5 s."""
    import json.encoder

    def python_encoder(*a, **k):
        raise AssertionError("json's pure-Python encoder")

    out = Output(str(tmp_path / "o"), SETTINGS, flush_seconds=3600)
    out.add_batch(batch(["/img/a", "/img/b"]))
    monkeypatch.setattr(json.encoder, "_make_iterencode", python_encoder)
    out.flush()
    assert sorted(read_embeddings(tmp_path / "o")[1]) == ["/img/a", "/img/b"]
