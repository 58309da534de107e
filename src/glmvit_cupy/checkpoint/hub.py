"""Fetch only the vision part of a checkpoint from the Hugging Face Hub.

A GLM-5.3 repository holds hundreds of GB of text weights; the tower is 1.05 GiB in a few of
its shards. config.json and the shard index come first, then only the shards that hold a
`*visual.*` tensor. Needs the `hub` extra (huggingface_hub).
"""

from __future__ import annotations

import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request

from ..errors import CheckpointError
from ..files import read_json_file
from .names import is_vision_name
from .shards import INDEX_NAME, checked_weight_map

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path) -> bool:
    """'org/name' that is not a local path: nothing on disk has that name (a broken or looping symbolic link
    included), nor is its first part a link that cannot be followed: a local path is never fetched from the
    Hub. A folder named like the org alone (a download of another of its models) leaves Hub ids as they are."""
    if not (isinstance(path, str) and _HUB_ID.match(path) is not None) or os.path.lexists(path):
        return False
    org = path.split("/")[0]
    return not (os.path.lexists(org) and not os.path.exists(org))


def vision_shards(weight_map: dict) -> list[str]:
    return sorted({f for n, f in weight_map.items() if is_vision_name(n)})


def fetch_vision_checkpoint(repo_id: str, *, revision: str | None = None, cache_dir=None) -> str:
    """Download config.json, the index and the shards holding vision tensors; return the local folder."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"{repo_id}: looks like a Hub id, but huggingface_hub is not installed (pip install "
                              "-e '.[hub]' in the glmvit-cupy checkout), and no local path of that name exists") from None
    from huggingface_hub import constants

    # Unreachable or silent, huggingface_hub retries each file for 25 s to minutes before it says so; a
    # 1.5 s probe first sends an offline machine straight to the local cache.
    offline = constants.HF_HUB_OFFLINE or not reachable(constants.ENDPOINT)
    # 'org/name' is also how a mistyped relative folder reads: say that no local one exists.
    local = f"; nor is {repo_id} a local folder or file (looked from {os.getcwd()})"

    def not_cached(absent):
        return CheckpointError(f"{repo_id}: the Hub cannot be reached (offline, not answering {constants.ENDPOINT} "
                               f"within 1.5 s, or HF_HUB_OFFLINE is set) and {absent} in the local Hugging Face "
                               f"cache{local}; connect once, or give a local checkpoint folder")

    uncached = []  # files looked for that neither the cache held nor the Hub could be asked for

    def get(name, cached_only_ok=False):
        try:
            return hf_hub_download(repo_id, name, revision=revision, cache_dir=cache_dir, local_files_only=offline)
        except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: test it first
            if cached_only_ok:  # offline, a file the repository may not have: absent from the cache, as from it
                uncached.append(name)
                raise EntryNotFoundError(name) from None
            raise not_cached(f"{name} is not") from None
        except EntryNotFoundError:
            raise
        except Exception as e:  # network, auth, missing repo: say which file of which repo
            raise CheckpointError(f"{repo_id}: cannot download {name} from the Hub ({type(e).__name__}: {e}){local}") \
                from None

    try:
        config = get("config.json")
    except EntryNotFoundError:
        raise CheckpointError(f"{repo_id}: the repository has no config.json{local}") from None
    folder = os.path.dirname(config)
    cfg = read_json_file(config, "config.json", 16 << 20)  # as read_config reads it
    if isinstance(cfg, dict) and cfg.get("vision_config") is None and "vision" not in str(cfg.get("model_type")):
        return folder  # text-only: nothing to fetch; bind_tower says so
    try:  # offline, an unsharded checkpoint's index is not in the cache either: model.safetensors is looked for
        index = get(INDEX_NAME, cached_only_ok=True)
    except EntryNotFoundError:
        try:
            get("model.safetensors", cached_only_ok=True)  # an unsharded checkpoint
        except EntryNotFoundError:
            if uncached:
                raise not_cached(f"neither {INDEX_NAME} nor model.safetensors is") from None
            raise CheckpointError(f"{repo_id}: neither {INDEX_NAME} nor model.safetensors is in the repository") \
                from None
        return folder
    try:  # read and checked as the binder reads it (bounded, a regular file, no key given twice, shard names in
        # its folder), before any shard is fetched: a path there would fetch a file the binder then refuses
        shards = vision_shards(checked_weight_map(read_json_file(index, "the index"), index))
    except CheckpointError as e:
        raise CheckpointError(f"{repo_id}: {INDEX_NAME} has no usable weight_map ({e})") from None
    for shard in shards:
        try:
            get(shard)
        except EntryNotFoundError:
            raise CheckpointError(f"{repo_id}: the index names shard {shard!r}, which the repository lacks") from None
    return folder


def reachable(endpoint: str, timeout: float = 1.5) -> bool:
    """Whether the Hub's endpoint answers an HTTP request (any status) within `timeout` seconds. A closed
    port, a failed name lookup, or a server that accepts and never answers all count as unreachable; the
    lookup has no timeout of its own, so the request runs on a thread that is left behind if it hangs.
    urllib goes through HTTPS_PROXY and the like as huggingface_hub does."""
    if not urllib.parse.urlparse(endpoint).hostname:
        return True
    ok = []

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            ok.append(True)
        except urllib.error.HTTPError:  # an answer, whatever its status
            ok.append(True)
        except (OSError, ValueError):
            pass

    t = threading.Thread(target=probe, daemon=True, name="glmvit-hub-probe")
    t.start()
    t.join(timeout + 0.2)
    return bool(ok)


def resolve(path) -> str:
    """A local path as a str (bytes decoded as the OS does); a Hub id fetched (vision shards only) to the local
    cache. CheckpointError for an empty path."""
    if is_hub_id(path):
        return fetch_vision_checkpoint(path)
    path = os.fsdecode(path)
    if not path:
        raise CheckpointError("the checkpoint path is empty: give a checkpoint folder, one of its .safetensors "
                              "shards, its index .json, or a Hub id 'org/name'")
    return path
