"""Hub ids fetch config.json, the index, and only the shards that hold vision tensors.
Offline: huggingface_hub.hf_hub_download is replaced by a fake serving a local repository."""

import json
import os
import shutil

import pytest

from tests.golden import cases

from glmvit_cupy import CheckpointError, inspect_checkpoint
from glmvit_cupy.checkpoint.hub import is_hub_id
from glmvit_cupy.checkpoint.synthetic import random_tower, write_checkpoint

hub = pytest.importorskip("huggingface_hub", reason="the hub extra (huggingface_hub) is not installed")
from huggingface_hub.errors import EntryNotFoundError  # noqa: E402


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A local 'repository' of 4 shards: text-only shards first and last, the tower in the middle two."""
    repo = tmp_path / "repo"
    write_checkpoint(repo, cases.GEOMETRY, tensors=random_tower(cases.GEOMETRY, 9), shards=2, with_text=False)
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    from safetensors.numpy import save_file

    from glmvit_cupy.checkpoint.synthetic import text_tensors

    text = text_tensors(2)
    names = list(text)
    save_file({n: text[n] for n in names[:2]}, str(repo / "text-00001.safetensors"))
    save_file({n: text[n] for n in names[2:]}, str(repo / "text-00002.safetensors"))
    index["weight_map"].update({n: "text-00001.safetensors" for n in names[:2]})
    index["weight_map"].update({n: "text-00002.safetensors" for n in names[2:]})
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    snapshot = tmp_path / "cache" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    requested = []

    def download(repo_id, filename, *, revision=None, cache_dir=None, **kw):
        assert repo_id == "zai-org/GLM-5.3-Flash-test"
        requested.append(filename)
        src = repo / filename
        if not src.exists():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        shutil.copy(src, snapshot / filename)
        return str(snapshot / filename)

    monkeypatch.setattr(hub, "hf_hub_download", download)
    return requested


def test_hub_id_fetches_only_vision_shards(fake_hub):
    s = inspect_checkpoint("zai-org/GLM-5.3-Flash-test")
    assert s["tensors"] == 2 * 14 + 11
    assert fake_hub[:2] == ["config.json", "model.safetensors.index.json"]
    assert sorted(fake_hub[2:]) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not [f for f in fake_hub if f.startswith("text-")]


def test_a_tower_under_another_prefix_is_named_from_the_index_alone(fake_hub, tmp_path):
    """No shard of it is fetched (the download takes `*visual.*` shards): the index's names say where it is."""
    shutil.rmtree(tmp_path / "repo")
    write_checkpoint(tmp_path / "repo", cases.GEOMETRY, tensors=random_tower(cases.GEOMETRY, 9), prefix="vision_model.")
    with pytest.raises(CheckpointError, match=r"holds the vision tower's 39 tensors under 'vision_model\.'"):
        inspect_checkpoint("zai-org/GLM-5.3-Flash-test")
    assert fake_hub == ["config.json", "model.safetensors.index.json"]


def test_the_hubs_index_is_read_bounded_before_any_shard_is_fetched(fake_hub, tmp_path):
    """The Hub's index was parsed whole, of any size, with a tensor given twice taken as its last: it is read as
    the binder reads it, and refused before a shard is downloaded."""
    index = tmp_path / "repo" / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-1] + ', "junk": [' + "0," * 1_000_000 + "0]}")
    with pytest.raises(CheckpointError, match=r"^zai-org/GLM-5.3-Flash-test: model.safetensors.index.json has no usable "
                                              r"weight_map \(.*index.json: the index holds up to 1,000,\d+ JSON values"):
        inspect_checkpoint("zai-org/GLM-5.3-Flash-test")
    assert fake_hub == ["config.json", "model.safetensors.index.json"]


def test_hub_errors_are_checkpoint_errors(fake_hub, monkeypatch):
    def broken(*a, **kw):
        raise OSError("connection refused")

    monkeypatch.setattr(hub, "hf_hub_download", broken)
    with pytest.raises(CheckpointError, match="cannot download config.json .*nor is zai-org/GLM-5.3-Flash-test a "
                                              "local folder or file"):
        inspect_checkpoint("zai-org/GLM-5.3-Flash-test")


def test_offline_and_not_cached_says_so(fake_hub, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*a, **kw):
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")

    monkeypatch.setattr(hub, "hf_hub_download", offline)
    # Also what a mistyped relative folder ('golden/tower' from the wrong place) reads as: the message says so.
    with pytest.raises(CheckpointError, match="Hub cannot be reached .* config.json is not in the local Hugging Face "
                                              "cache; nor is zai-org/GLM-5.3-Flash-test a local folder or file"):
        inspect_checkpoint("zai-org/GLM-5.3-Flash-test")


def test_local_paths_are_not_hub_ids(tmp_path, monkeypatch):
    assert is_hub_id("org/name")
    assert not is_hub_id(str(tmp_path))
    assert not is_hub_id("a/b/c") and not is_hub_id("/abs/path")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_id("org/name")  # an existing local folder wins
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert not is_hub_id("link") and not is_hub_id("link/x")
    assert is_hub_id("org/other")  # a folder named like the org (a download of another model) leaves ids alone
    os.symlink(tmp_path / "nowhere", tmp_path / "org" / "gone")
    assert not is_hub_id("org/gone") and not is_hub_id("loop/x")  # a broken or looping link: local, never fetched


@pytest.mark.parametrize("name,says", [("config.json", "config.json is not valid JSON"),
                                       ("model.safetensors.index.json", "has no usable weight_map")])
def test_hub_json_nested_past_the_parsers_depth(fake_hub, tmp_path, name, says):
    """A repository's JSON nested past Python's parser depth (RecursionError) is a CheckpointError too."""
    (tmp_path / "repo" / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=says):
        inspect_checkpoint("zai-org/GLM-5.3-Flash-test")


@pytest.mark.parametrize("endpoint", ["closed", "silent"])
def test_unreachable_hub_answers_within_seconds(tmp_path, endpoint):
    """With the Hub unreachable (its endpoint a closed local port, or a server that accepts connections and
    never answers) and nothing cached, the answer is the clear offline message within seconds, not after
    huggingface_hub's retries (25 s for a closed port, minutes for a silent one)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    if endpoint == "silent":
        server.listen(64)  # the kernel accepts the connections; nothing ever reads or answers them
    else:
        server.close()  # nothing listens there now
    code = ("from glmvit_cupy import CheckpointError, inspect_checkpoint\n"
            "try:\n    inspect_checkpoint('zai-org/GLM-5.3-Flash')\nexcept CheckpointError as e:\n    print(e)\n")
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE", None)
    try:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        took = time.perf_counter() - t0
    finally:
        server.close()
    assert "the Hub cannot be reached" in r.stdout and "config.json is not in the local" in r.stdout, r.stdout + r.stderr
    assert took < 15, f"{took:.1f} s"  # about 2-3 s: the interpreter's start, the 1.5 s probe, the cache lookup


@pytest.mark.parametrize("shard", ["../model-00001-of-00002.safetensors", "sub/model-00001-of-00002.safetensors",
                                   "/abs/model-00001-of-00002.safetensors", ".."])
def test_an_index_naming_a_shard_outside_the_repository_folder_is_refused_before_any_shard_is_fetched(
        fake_hub, tmp_path, shard):
    """The binder refuses an index whose shard names are paths, not file names in the checkpoint's folder; the Hub
    download fetched such shards first (from another folder of the repository, or into one beside the snapshot),
    to have them refused after."""
    index = tmp_path / "repo" / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    listed["weight_map"]["model.visual.blocks.0.norm1.weight"] = shard
    index.write_text(json.dumps(listed))
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint("zai-org/GLM-5.3-Flash-test")
    assert "tensor 'model.visual.blocks.0.norm1.weight' maps to" in str(e.value), str(e.value)
    assert "which is not a file name inside the checkpoint directory" in str(e.value), str(e.value)
    assert fake_hub == ["config.json", "model.safetensors.index.json"]


def test_an_unsharded_checkpoint_in_the_cache_loads_offline(tmp_path, monkeypatch):
    """Offline, huggingface_hub raises LocalEntryNotFoundError for any file not in the cache, the absent index
    of an unsharded repository included: a cached config.json and model.safetensors were refused as 'not in the
    local Hugging Face cache', naming the index the repository never had."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    cached = tmp_path / "cache" / "snapshots" / "abc"
    write_checkpoint(cached, cases.GEOMETRY, tensors=random_tower(cases.GEOMETRY, 9), shards=1)
    (cached / "model.safetensors.index.json").unlink()
    (cached / "model-00001-of-00001.safetensors").rename(cached / "model.safetensors")

    def offline(repo_id, filename, **kw):
        if not (cached / filename).exists():
            raise LocalEntryNotFoundError(f"{filename} is not cached and local_files_only=True")
        return str(cached / filename)

    monkeypatch.setattr(hub, "hf_hub_download", offline)
    monkeypatch.setattr("glmvit_cupy.checkpoint.hub.reachable", lambda *a, **kw: False)
    assert inspect_checkpoint("zai-org/GLM-5.3-Flash-test")["tensors"] == 2 * 14 + 11
    (cached / "model.safetensors").unlink()  # nothing of the weights cached: said of both files
    with pytest.raises(CheckpointError, match="Hub cannot be reached .*neither model.safetensors.index.json nor "
                                              "model.safetensors is in the local Hugging Face cache"):
        inspect_checkpoint("zai-org/GLM-5.3-Flash-test")
