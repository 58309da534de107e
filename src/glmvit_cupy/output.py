"""The output folder of glmvit-encode, written and read back.

    embeddings-NNNNN.safetensors   one bf16 tensor [tokens, out_hidden] per image, named by its key
    manifest.json                  {"header": settings, "images": {key: entry}, "failed": {key: why}}

An image's key is its file's resolved absolute path (os.path.realpath), so the same file reached
through another relative path, a "." or a symlink is the same image. Every shard is written to a
temporary name and renamed, then the manifest likewise: an interrupted run loses nothing it
finished, and a re-run with the same settings skips what the manifest holds. Files get the usual
mode for new files (0666 less the umask).

Reading the output: `read_embeddings(folder)` (NumPy bf16 arrays, as ml_dtypes.bfloat16), or
`safetensors.numpy.load_file(shard)` after `import ml_dtypes` (which teaches NumPy bf16), or
`safetensors.torch.load_file(shard)` for torch.bfloat16 tensors.
"""

from __future__ import annotations

import json
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy: safetensors.numpy needs it to read the shards)
import numpy as np

from .errors import OutputError

MANIFEST = "manifest.json"
KEY = "the image file's resolved absolute path (os.path.realpath)"


def image_key(path) -> str:
    return os.path.realpath(path)


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


class Output:
    """The output folder: shards written atomically, the manifest rewritten atomically after each.

    `settings` (checkpoint, geometry, the per-image limits) must equal those a resumed folder was
    written with: one folder never mixes resolutions or checkpoints."""

    def __init__(self, folder: str, settings: dict):
        self.folder = folder
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise OutputError(f"--out {folder} is a file, not a folder; give a folder (it is created if absent)")
        path = os.path.join(folder, MANIFEST)
        self.manifest = {"header": dict(settings, key=KEY), "images": {}, "failed": {}}
        if os.path.exists(path):
            self._resume(path, settings)
        os.makedirs(folder, exist_ok=True)
        taken = [int(f[11:16]) for f in os.listdir(folder) if f.startswith("embeddings-") and f[11:16].isdigit()]
        self.next_shard = max(taken, default=0) + 1
        self.mode = _umask_mode()

    def _resume(self, path, settings):
        try:
            with open(path) as f:
                old = json.load(f)
            header, images = old["header"], old["images"]
            assert isinstance(header, dict) and isinstance(images, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            raise OutputError(f"{path} is unreadable or truncated ({type(e).__name__}: {e}); it cannot say what is "
                              "done. Move it away to encode everything again into this folder, or use another "
                              "--out") from None
        for name, value in settings.items():
            if header.get(name) != value:
                raise OutputError(f"{self.folder} was written with {name} = {header.get(name)!r}, this run asks for "
                                  f"{value!r}; one folder holds one setting (use another --out, or the same "
                                  "settings to resume)")
        # Keep only entries whose shard exists: a shard lost since is encoded again.
        self.manifest["images"] = {k: v for k, v in images.items()
                                   if os.path.exists(os.path.join(self.folder, v.get("shard", "")))}

    def done(self, key) -> bool:
        return key in self.manifest["images"]

    def __len__(self):
        return len(self.manifest["images"])

    def _write_json(self):
        path = os.path.join(self.folder, MANIFEST)
        with open(path + ".tmp", "w") as f:
            json.dump(self.manifest, f)  # no indent: json's C encoder (rewritten after every batch)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(path + ".tmp", self.mode)
        os.replace(path + ".tmp", path)

    def add_batch(self, entries: list[tuple[str, dict, np.ndarray]]):
        from safetensors.numpy import save_file

        name = f"embeddings-{self.next_shard:05d}.safetensors"
        self.next_shard += 1
        tmp = os.path.join(self.folder, name + ".tmp")
        save_file({key: np.ascontiguousarray(emb) for key, _, emb in entries}, tmp)
        os.chmod(tmp, self.mode)
        os.replace(tmp, os.path.join(self.folder, name))
        for key, info, _ in entries:
            self.manifest["images"][key] = dict(info, shard=name)
            self.manifest["failed"].pop(key, None)
        self._write_json()

    def fail(self, key, why):
        self.manifest["failed"][key] = why
        self._write_json()


def read_embeddings(folder) -> tuple[dict, dict]:
    """(manifest, {key: bf16 NumPy array [tokens, out_hidden]}) of a glmvit-encode output folder."""
    from safetensors.numpy import load_file

    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    arrays = {}
    for shard in sorted({e["shard"] for e in manifest["images"].values()}):
        arrays.update(load_file(os.path.join(folder, shard)))
    return manifest, {k: arrays[k] for k in manifest["images"]}
