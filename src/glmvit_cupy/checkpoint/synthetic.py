"""Random-weight checkpoints in GLM-5.3's exact on-disk layout, for tests, benchmarks and trying things.

    python -m glmvit_cupy.checkpoint.synthetic DIR [--seed N]   # the official geometry, random weights

The weights are scaled so the tower's activations stay in a realistic range while
the SwiGLU clamp (swiglu_limit) fires in every block and in the merger: a test run
on these weights fails if the clamp is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from ..config import VisionGeometry
from ..errors import CheckpointError
from ..files import read_json_file
from .names import module_shapes, tower_layout

BF16 = ml_dtypes.bfloat16


def _scale(suffix: str, geo: VisionGeometry) -> tuple[float, float]:
    """(std, mean) of a tensor's random values, chosen per role."""
    h, i, out, merger_inter = geo.hidden_size, geo.intermediate_size, geo.out_hidden_size, geo.projection_intermediate_size
    if suffix.endswith("norm1.weight") or suffix.endswith("norm2.weight") or "q_norm" in suffix \
            or "k_norm" in suffix or suffix == "post_layernorm.weight" \
            or suffix == "merger.post_projection_norm.weight":
        return 0.1, 1.0
    if suffix.endswith(".bias"):
        return (0.3 if "gate_proj" in suffix or "up_proj" in suffix else 0.05), 0.0
    fan_in = {"patch_embed.proj.weight": geo.patch_dim, "downsample.weight": geo.merge_dim}.get(suffix)
    if fan_in is None:
        fan_in = i if "mlp.down_proj" in suffix else merger_inter if suffix == "merger.down_proj.weight" \
            else out if suffix.startswith("merger.") else h
    gain = {"mlp.gate_proj": 3.5, "mlp.up_proj": 3.5, "merger.gate_proj": 7.0, "merger.up_proj": 7.0,
            "mlp.down_proj": 0.1, "merger.down_proj": 0.5, "attn.proj": 0.5}
    g = next((v for k, v in gain.items() if k in suffix), 1.0)
    return g / np.sqrt(fan_in), 0.0


def random_tower(geo: VisionGeometry, seed: int = 0) -> dict[str, np.ndarray]:
    """{suffix: bf16 array in its on-disk shape} for every tower tensor."""
    rng = np.random.default_rng(seed)
    disk_shape = module_shapes(geo)
    tensors = {}
    for suffix, flat in tower_layout(geo).items():
        std, mean = _scale(suffix, geo)
        shape = disk_shape.get(suffix, flat)
        v = rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * np.float32(std) + np.float32(mean)
        tensors[suffix] = v.astype(BF16).reshape(shape)
    return tensors


def text_tensors(seed: int = 1) -> dict[str, np.ndarray]:
    """A few stand-ins for the quantised text stack: FP8 weights, packed U8, F32 scales."""
    rng = np.random.default_rng(seed)
    return {
        "model.language_model.layers.0.mlp.experts.0.gate_proj.weight":
            rng.standard_normal((64, 32), dtype=np.float32).astype(ml_dtypes.float8_e4m3fn),
        "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_packed":
            rng.integers(0, 256, (64, 16), dtype=np.uint8),
        "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_scale":
            rng.random((64, 1), dtype=np.float32),
        "model.language_model.embed_tokens.weight":
            rng.standard_normal((16, 32), dtype=np.float32).astype(BF16),
    }


def config_dict(geo: VisionGeometry, text_hidden_size: int | None = None) -> dict:
    """A multimodal glm5_next config.json with this vision_config."""
    vision = dataclasses.asdict(geo)
    theta = vision.pop("rope_theta")
    vision.update(model_type="glm5_next_vision", hidden_act="silu", attention_bias=True,
                  rope_parameters={"rope_type": "axial", "rope_theta": theta})
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": {"model_type": "glm5_next_text",
                        "hidden_size": text_hidden_size or geo.out_hidden_size},
        "vision_config": vision,
    }


def write_checkpoint(path, geo: VisionGeometry, *, seed: int = 0, prefix: str = "model.visual.",
                     shards: int = 2, with_text: bool = True, tensors: dict | None = None) -> str:
    """Write config.json, `shards` safetensors shards and the index, in GLM-5.3's layout.

    Vision tensors are spread over the shards in checkpoint order, with the text
    stand-ins in the first and last shard. Returns the directory.
    """
    os.makedirs(path, exist_ok=True)
    tensors = tensors if tensors is not None else random_tower(geo, seed)
    named = {prefix + s: np.ascontiguousarray(v) for s, v in tensors.items()}
    extra = text_tensors(seed + 1) if with_text else {}
    names = list(named)
    per = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        part = {n: named[n] for n in names[k * per:(k + 1) * per]}
        if extra and k in (0, shards - 1):
            part.update(dict(list(extra.items())[: 2] if k == 0 else list(extra.items())[2:]))
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, os.path.join(path, fname), metadata={"format": "pt", "glmvit_random_seed": str(seed)})
        weight_map.update({n: fname for n in part})
    total = sum(v.nbytes for v in named.values()) + sum(v.nbytes for v in extra.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_dict(geo), f, indent=1)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(path):  # safetensors creates its files 0600; readable as the umask allows
        os.chmod(os.path.join(path, name), 0o666 & ~umask)
    return os.fspath(path)


def writable_target(path: str) -> str:
    """Where a new checkpoint at `path` is written first (path + ".tmp"); OSError, saying what is in the way,
    for a `path` that is neither absent nor an empty folder."""
    if os.path.lexists(path) and not os.path.exists(path):
        raise OSError(f"{path} is a symbolic link to {os.readlink(path)}, which leads nowhere; remove the link or "
                      "give another folder")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise OSError(f"{path} exists and is not an empty folder, nor a checkpoint (no config.json); move it away "
                      "or give a new folder")
    tmp = path + ".tmp"
    if os.path.lexists(tmp) and not os.path.isdir(tmp):
        raise OSError(f"{tmp} (where the checkpoint is written first) is in the way and is not a folder; remove it")
    return tmp


def written_seed(path: str) -> int | None:
    """The seed of the random weights this module wrote at `path` (its shards' metadata), else None."""
    from .shards import read_metadata

    try:
        index = read_json_file(os.path.join(path, "model.safetensors.index.json"), "the index")  # bounded, any JSON
        first = sorted(set(index["weight_map"].values()))[0]
        if os.path.basename(first) != first:
            return None
        return int(read_metadata(os.path.join(path, first))["glmvit_random_seed"])
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, CheckpointError):
        return None  # not one this module wrote: what reads it next (read_config, the binder) says what is wrong


def cached_checkpoint(path, geo: VisionGeometry, *, seed: int = 0) -> str:
    """write_checkpoint once: reuse `path` if a checkpoint of this geometry (and seed, where it records one)
    is there (ValueError for another), else write it under a temporary name
    and rename it onto `path` (absent, or an empty folder), so an interrupted write is never mistaken for a
    finished one; what an interrupted or failed write left is removed. OSError, saying what is in the way,
    for a `path` that is something else (checked before anything is written)."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "config.json")):
        there = written_seed(path)
        if there is not None and there != seed:
            raise ValueError(f"{path} holds random weights of seed {there}, not seed {seed}: give a new folder")
        from ..config import read_config

        if read_config(path) != geo:
            raise ValueError(f"{path} holds a checkpoint of another geometry than the one asked for: give a new "
                             "folder")
        return path
    tmp = writable_target(path)
    try:
        write_checkpoint(tmp, geo, seed=seed)
        os.replace(tmp, path)  # onto an empty folder too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a gigabyte nobody can use
        raise
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m glmvit_cupy.checkpoint.synthetic",
        description="Write a checkpoint of GLM-5.3-Flash's vision tower with the official geometry and RANDOM "
                    "weights (about 1 GiB of BF16, in the real layout and naming), for trying glmvit-encode, "
                    "glmvit-serve and the Python API without downloading the model. Its embeddings mean nothing.")
    ap.add_argument("dir", help="the folder to write: new or empty (one that already holds a checkpoint is left as "
                                "it is)")
    ap.add_argument("--seed", type=int, default=None, help="the weights' random seed (default 0)")
    args = ap.parse_args(argv)
    if args.seed is not None and args.seed < 0:  # NumPy's generators take non-negative seeds only
        ap.error(f"--seed {args.seed}: a seed is a non-negative integer (0, 1, 2, ...)")
    path = os.path.abspath(args.dir)
    seed = 0 if args.seed is None else args.seed
    if os.path.exists(os.path.join(path, "config.json")):
        from .bind import bind_tower

        try:
            bind_tower(path)
        except ValueError as e:  # CheckpointError and its kin: a config.json, but no tower that reads
            print(f"{path} holds a config.json but no checkpoint this package reads ({e}); give a new folder",
                  file=sys.stderr)
            return 2
        there = written_seed(path)
        if args.seed is not None and there != args.seed:
            held = f"random weights of seed {there}" if there is not None else "a checkpoint not written by this command"
            print(f"{path} already holds {held}, not seed {args.seed}: give a new folder for those", file=sys.stderr)
            return 2
        print(f"{path} already holds a checkpoint" + (f" (random weights, seed {there})" if there is not None else "")
              + "; nothing written", file=sys.stderr)
        return 0
    try:
        writable_target(path)
    except OSError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"!! RANDOM WEIGHTS: writing a checkpoint with the official geometry and random weights (seed "
          f"{seed}) to {path}; its embeddings are not GLM-5.3-Flash's !!", file=sys.stderr)
    try:
        cached_checkpoint(path, VisionGeometry.official(), seed=seed)
    except OSError as e:
        print(f"cannot write {path}: {e.strerror} ({e.filename})" if e.strerror and e.filename else str(e),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: nothing written to {path}; run the same command again", file=sys.stderr)
        return 130
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"wrote {path} ({size / 2**30:.2f} GiB): use it as --checkpoint {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
