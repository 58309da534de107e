"""Hand-off to vLLM: embeddings written where vLLM's shared-storage encoder-cache connector reads them.

vLLM (ECExampleConnector, formerly ECSharedStorageConnector) looks for
`<shared_storage_path>/<mm_hash>/encoder_cache.safetensors` holding one tensor named "ec_cache",
[tokens, hidden]; a file that exists is ready. We key an image by the sha256 hex of its file's bytes, a
video by video_key_of (its frame files and the settings that shape its embedding), and write under a
temporary name, then rename, so vLLM never reads half a file. The language-only vLLM is
started with --ec-transfer-config '{"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
"ec_connector_extra_config": {"shared_storage_path": DIR}}' and each request passes that key as the
image's uuid (README: "Handing embeddings to vLLM").
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

FILE = "encoder_cache.safetensors"
TENSOR = "ec_cache"


def key_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def video_key_of(frames: list[bytes], fps, duration, settings: dict) -> str:
    """A video's key: the sha256 hex of a canonical JSON of its frame files' sha256s (or its video file's),
    its fps and duration and the preprocess_video settings (sampling, token limits) that decide which frames
    count and their size. The same frames with other settings give another embedding, so another key."""
    return video_key_of_shas([key_of(f) for f in frames], fps, duration, settings)


def video_key_of_shas(shas: list[str], fps, duration, settings: dict) -> str:
    """video_key_of from the files' sha256 hex digests (a video file hashed in pieces, not held in memory).
    Whole-number floats count as ints (target_fps 2.0 is 2): one setting, one key, however it was typed."""
    def number(v):
        return int(v) if isinstance(v, float) and v.is_integer() else v

    doc = {"frames": list(shas), "fps": number(fps), "duration": number(duration),
           "settings": {k: number(settings[k]) for k in sorted(settings)}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def write(folder: str, key: str, embedding: np.ndarray) -> str:
    """DIR/<key>/encoder_cache.safetensors with the bf16 [tokens, hidden] embedding; returns its path.
    An existing file for the key is left as it is (the same key gives the same embedding)."""
    from safetensors.numpy import save_file

    target = os.path.join(folder, key, FILE)
    if os.path.exists(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.{id(embedding)}.tmp"
    save_file({TENSOR: np.ascontiguousarray(embedding)}, tmp)
    os.replace(tmp, target)
    return target
