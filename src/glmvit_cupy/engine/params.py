"""The tower's weights on one GPU: uploaded once from a checked binding, named after the checkpoint.

`blocks.{i}.attn.qkv.weight` is `weights.blocks[i].qkv_weight`, and so on. The one change of form:
each MLP's gate_proj and up_proj weights are stacked into one [gate; up] matrix at upload, so one
GEMM computes both. And one thing derived, in place of the patch_embed, attn.proj and mlp.down_proj
biases: the residual offsets. The GEMMs that add into the float32 residual stream x (cuBLAS with
beta = 1) cannot add their biases, and a bias is the same for every row, so x is kept without them
and each norm adds the running sum of all the biases so far as it reads x (`norm1_offset`,
`norm2_offset`, `post_layernorm_offset`: summed in float64, rounded once to float32). No pass
writes x + bias back. attn.qkv's V bias joins them too: softmax rows sum to one, so attention passes
a constant added to v through unchanged, and attn.proj maps it to attn.proj.weight @ b_v, a constant
added into x like proj's own bias (the rope pass then leaves v where the QKV GEMM wrote it).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from ..checkpoint.bind import TowerBinding
from . import ops
from .gemm import BF16


@dataclass
class Block:
    norm1: cupy.ndarray
    qkv_weight: cupy.ndarray
    qkv_bias: cupy.ndarray
    q_norm: cupy.ndarray
    k_norm: cupy.ndarray
    proj_weight: cupy.ndarray
    norm2: cupy.ndarray
    gate_up_weight: cupy.ndarray  # mlp.gate_proj.weight stacked over mlp.up_proj.weight
    gate_bias: cupy.ndarray
    up_bias: cupy.ndarray
    down_weight: cupy.ndarray
    norm1_offset: cupy.ndarray  # float32: patch_embed's bias + every earlier block's proj and down biases
    norm2_offset: cupy.ndarray  # float32: norm1_offset + this block's attn.proj bias + attn.proj.weight @ V's bias


@dataclass
class Merger:
    post_layernorm: cupy.ndarray
    post_layernorm_offset: cupy.ndarray  # float32: every bias added into x (patch_embed, all blocks)
    downsample_weight: cupy.ndarray  # the m x m Conv2d as [out, hidden * m^2], (channel, kh, kw) columns
    downsample_bias: cupy.ndarray
    proj_weight: cupy.ndarray
    post_projection_norm_weight: cupy.ndarray
    post_projection_norm_bias: cupy.ndarray
    gate_up_weight: cupy.ndarray
    down_weight: cupy.ndarray


@dataclass
class Weights:
    patch_embed_weight: cupy.ndarray  # the Conv3d as [hidden, patch_dim]
    blocks: list
    merger: Merger
    inv_freq: cupy.ndarray  # float32 [head_dim / 4]: the axial RoPE's frequencies

    @property
    def nbytes(self) -> int:
        arrays = [self.patch_embed_weight, self.inv_freq]
        arrays += [a for b in self.blocks for a in vars(b).values()] + list(vars(self.merger).values())
        return sum(a.nbytes for a in arrays)


class _Uploads:
    """Uploads tower tensors and counts, on the device, the NaN and infinite values of each (cuda/finite.cu):
    `check()` then refuses the checkpoint naming every tensor that holds any, with one wait for the GPU."""

    def __init__(self, binding: TowerBinding):
        self.binding, self.suffixes = binding, []
        self.counts = cupy.zeros(len(binding.layout), np.uint64)

    def __call__(self, *suffixes) -> cupy.ndarray:
        """One tensor, or several stacked along rows, as bf16 on the current device."""
        hosts = [self.binding.host(s) for s in suffixes]
        out = cupy.empty((sum(h.shape[0] for h in hosts),) + hosts[0].shape[1:], dtype=BF16)
        row = 0
        for suffix, h in zip(suffixes, hosts):
            part = out[row:row + h.shape[0]]
            part.set(np.ascontiguousarray(h))
            ops.count_nonfinite(part, self.counts, len(self.suffixes))
            self.suffixes.append(suffix)
            row += h.shape[0]
        return out

    def check(self):
        """Raise for any NaN or inf: the uploaded tensors' counts, and on the host the biases folded into
        the residual offsets instead of uploaded (a few hidden-size vectors)."""
        counts = self.counts.get()
        bad = {s: int(c) for s, c in zip(self.suffixes, counts) if c}
        for s in self.binding.layout.keys() - set(self.suffixes):
            bits = self.binding.host(s).view(np.uint16)
            if c := int(np.count_nonzero((bits & 0x7F80) == 0x7F80)):
                bad[s] = c
        if bad:
            raise self.binding.nonfinite_error(bad)


def _f32(x: np.ndarray) -> cupy.ndarray:
    return cupy.asarray(x.astype(np.float32))


def residual_offsets(binding: TowerBinding) -> tuple[list, np.ndarray]:
    """The float64 running sums of the biases added into x: (norm1, norm2) of each block, and the
    post_layernorm's (see the module docstring)."""
    h = binding.geometry.hidden_size
    run = binding.host("patch_embed.proj.bias").astype(np.float64)
    per_block = []
    for i in range(binding.geometry.depth):
        n1 = run
        v_bias = binding.host(f"blocks.{i}.attn.qkv.bias")[2 * h:].astype(np.float64)
        proj = binding.host(f"blocks.{i}.attn.proj.weight").astype(np.float64)
        run = n1 + binding.host(f"blocks.{i}.attn.proj.bias").astype(np.float64) + proj @ v_bias
        per_block.append((n1, run))
        run = run + binding.host(f"blocks.{i}.mlp.down_proj.bias").astype(np.float64)
    return per_block, run


def _block(put: _Uploads, i: int, offsets) -> Block:
    p = f"blocks.{i}."
    return Block(
        norm1=put(p + "norm1.weight"),
        qkv_weight=put(p + "attn.qkv.weight"),
        qkv_bias=put(p + "attn.qkv.bias"),
        q_norm=put(p + "attn.q_norm.weight"),
        k_norm=put(p + "attn.k_norm.weight"),
        proj_weight=put(p + "attn.proj.weight"),
        norm2=put(p + "norm2.weight"),
        gate_up_weight=put(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        gate_bias=put(p + "mlp.gate_proj.bias"),
        up_bias=put(p + "mlp.up_proj.bias"),
        down_weight=put(p + "mlp.down_proj.weight"),
        norm1_offset=_f32(offsets[0]),
        norm2_offset=_f32(offsets[1]),
    )


def upload(binding: TowerBinding) -> Weights:
    """Every tower tensor on the current device (only the vision bytes of the checkpoint are read). A
    tensor holding NaN or infinite values is a CheckpointError naming it (binding.nonfinite_error)."""
    g = binding.geometry
    put = _Uploads(binding)
    spatial = g.head_dim // 2
    # As the reference computes it, in float32: 1 / theta^(arange(0, spatial, 2) / spatial).
    exps = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
    per_block, final = residual_offsets(binding)
    weights = Weights(
        patch_embed_weight=put("patch_embed.proj.weight"),
        blocks=[_block(put, i, per_block[i]) for i in range(g.depth)],
        merger=Merger(
            post_layernorm=put("post_layernorm.weight"),
            post_layernorm_offset=_f32(final),
            downsample_weight=put("downsample.weight"),
            downsample_bias=put("downsample.bias"),
            proj_weight=put("merger.proj.weight"),
            post_projection_norm_weight=put("merger.post_projection_norm.weight"),
            post_projection_norm_bias=put("merger.post_projection_norm.bias"),
            gate_up_weight=put("merger.gate_proj.weight", "merger.up_proj.weight"),
            down_weight=put("merger.down_proj.weight"),
        ),
        inv_freq=cupy.asarray(np.float32(1.0) / np.power(np.float32(g.rope_theta), exps)),
    )
    put.check()
    return weights
