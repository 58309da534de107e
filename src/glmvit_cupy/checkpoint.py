"""Bind the vision tower's tensors in a checkpoint, CPU side only.

The binder checks everything the encoder will rely on — config geometry, the
prefix, every tensor's presence, dtype and flattened shape — and hands back
names. It never uploads, and never imports the model: the loader only binds.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from .config import NoVisionConfig, VisionGeometry, read_config
from .errors import CheckpointError
from .hub import VISION_PREFIXES, is_vision_name, resolve
from .weights import WeightStore

log = logging.getLogger("glmvit_cupy")

# The flat layout, the nested one a re-quantisation through AutoModelForImageTextToText
# leaves, and a bare tower export.
PREFIXES = VISION_PREFIXES


class AbsentTower(CheckpointError):
    """config.json declares a vision tower but the shards hold none of it."""


def tower_layout(geo: VisionGeometry) -> dict[str, tuple]:
    """Every tensor the encoder reads, under the prefix, with the shape it is read as.

    2-D entries are (rows, cols) GEMM views: a stored tensor matches when its first
    dimension is `rows` and the product of the rest is `cols` — the 5-D patch-embed
    Conv3d is read as [1024, 1176] and the 4-D downsample Conv2d as [4096, 4096]
    over the same bytes. 1-D entries must match exactly.
    """
    h, i, hd = geo.hidden_size, geo.intermediate_size, geo.head_dim
    out, pi = geo.out_hidden_size, geo.projection_intermediate_size
    t = {
        "patch_embed.proj.weight": (h, geo.patch_dim),
        "patch_embed.proj.bias": (h,),
    }
    for b in range(geo.depth):
        p = f"blocks.{b}."
        t.update({
            p + "norm1.weight": (h,),
            p + "norm2.weight": (h,),
            p + "attn.qkv.weight": (3 * h, h),
            p + "attn.qkv.bias": (3 * h,),
            p + "attn.q_norm.weight": (hd,),
            p + "attn.k_norm.weight": (hd,),
            p + "attn.proj.weight": (h, h),
            p + "attn.proj.bias": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.gate_proj.bias": (i,),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.up_proj.bias": (i,),
            p + "mlp.down_proj.weight": (h, i),
            p + "mlp.down_proj.bias": (h,),
        })
    t.update({
        "post_layernorm.weight": (h,),
        "downsample.weight": (out, geo.merge_dim),
        "downsample.bias": (out,),
        "merger.proj.weight": (out, out),
        "merger.post_projection_norm.weight": (out,),
        # The bias is what tells the merger's LayerNorm from the tower's RMSNorms:
        # a checkpoint without it must fail here, not run an RMSNorm in its place.
        "merger.post_projection_norm.bias": (out,),
        "merger.gate_proj.weight": (pi, out),
        "merger.up_proj.weight": (pi, out),
        "merger.down_proj.weight": (out, pi),
    })
    assert len(t) == geo.tensor_count  # 14 per block + 11
    return t


@dataclass
class TowerBinding:
    """A checked tower: where its tensors are, under which prefix, with which geometry."""

    path: str
    prefix: str
    geometry: VisionGeometry
    store: WeightStore
    layout: dict = field(repr=False)

    def name(self, suffix: str) -> str:
        return self.prefix + suffix

    @property
    def nbytes(self) -> int:
        return sum(self.store.info(self.prefix + s).nbytes for s in self.layout)

    def host(self, suffix: str):
        """Zero-copy bf16 NumPy view of one tower tensor, flattened to the shape it is read as."""
        return self.store.get(self.prefix + suffix).reshape(self.layout[suffix])

    def summary(self) -> dict:
        g = self.geometry
        return {
            "path": self.path,
            "prefix": self.prefix,
            "geometry": g,
            "tensors": len(self.layout),
            "bytes": self.nbytes,
            "parameters": self.nbytes // 2,
            "shards": [os.path.basename(f) for f in
                       sorted({self.store.info(self.prefix + s).file for s in self.layout})],
        }


def _check_shape(store: WeightStore, name: str, want: tuple):
    info = store.info(name)
    shape = info.shape
    if len(want) == 1:
        ok = shape == want
    else:
        cols = 1
        for d in shape[1:]:
            cols *= d
        ok = len(shape) >= 2 and shape[0] == want[0] and cols == want[1]
    if not ok:
        flat = f" (flattens to [{shape[0] if shape else 0}, {cols}])" if len(want) == 2 and shape else ""
        raise CheckpointError(
            f"{info.file}: tensor {name!r} has shape {tuple(shape)}{flat}, but vision_config makes the encoder "
            f"read it as {list(want)}; the checkpoint's tower geometry does not match its config")


def bind_tower(path: str | os.PathLike) -> TowerBinding:
    """Validate a checkpoint's vision tower without a GPU.

    `path` is a directory, a shard or index file, or a Hub id ('org/name': only config.json,
    the index and the shards holding vision tensors are downloaded; needs the `hub` extra).
    Raises NoVisionConfig for a text-only checkpoint, AbsentTower when the config
    declares a tower the shards do not hold, and CheckpointError for anything else.
    """
    path = resolve(path)
    if os.path.isdir(path):
        if not os.listdir(path):
            raise CheckpointError(f"{path}: empty directory; expected config.json and *.safetensors shards")
        geo = read_config(path)
        source = path
    elif os.path.isfile(path):
        # A bare shard or index: the config sits beside it.
        geo = read_config(os.path.dirname(path) or ".")
        source = path
    else:
        raise CheckpointError(f"{path}: no such file or directory")
    store = WeightStore.open(source, only=is_vision_name)
    prefix = next((p for p in PREFIXES if p + "patch_embed.proj.weight" in store), None)
    if prefix is None:
        raise AbsentTower(
            f"{path}: config.json declares a vision tower, but no '*visual.patch_embed.proj.weight' is in the "
            f"checkpoint (looked under {', '.join(PREFIXES)}); the shards hold no tower to load")
    layout = tower_layout(geo)
    for suffix, want in layout.items():
        name = prefix + suffix
        if name not in store:
            raise CheckpointError(f"{store.display}: missing tensor {name!r}, which the encoder needs "
                                  f"(shape {list(want)})")
        store.require_bf16(name)
        _check_shape(store, name, want)
    return TowerBinding(path=path, prefix=prefix, geometry=geo, store=store, layout=layout)


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    """Run every load-time check without a GPU and summarise the tower. Raises CheckpointError."""
    return bind_tower(path).summary()


def probe_tower(path: str | os.PathLike) -> TowerBinding | None:
    """bind_tower for serving engines: None (with a warning for the second) when there is no tower.

    A text-only checkpoint returns None quietly. A declared-but-absent tower also returns
    None, but warns: image requests will be refused later and the operator should hear
    it at load, not at the first request.
    """
    try:
        return bind_tower(path)
    except NoVisionConfig:
        return None
    except AbsentTower as e:
        log.warning("%s; serving text-only (image input will be refused)", e)
        return None
