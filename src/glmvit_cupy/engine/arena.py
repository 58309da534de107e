"""Scratch: one device allocation, sized once from the model's capacity, carved into named slots.

Phases that never overlap in time (input staging, the blocks, the merger) share the same bytes; the
residual stream is kept across them. Allocated on the first encode, never grown.
"""

from __future__ import annotations

import cupy
import numpy as np

from ..config import VisionGeometry
from .gemm import BF16

ROW_CHUNK = 4096     # rows per MLP chunk where cuBLAS runs gate/up: bounds the gate|up intermediate
MERGER_CHUNK = 2048  # merged rows per merger chunk


def _cdiv(a, b):
    return -(-a // b)


def _slot_bytes(shape, dtype) -> int:
    """Bytes a slot takes: every slot starts 256-byte aligned."""
    return _cdiv(int(np.prod(shape)) * np.dtype(dtype).itemsize, 256) * 256


def slots(g: VisionGeometry, patches: int, fused_swiglu: bool = False) -> dict:
    """{phase: {slot: (shape, dtype)}} for forwards of up to `patches` patches; phase "keep" is never
    shared, the others overlap. The attention's QKV GEMM runs over all rows at once. fused_swiglu: the
    MLPs' gate/up GEMMs write the activation themselves, so there are no gate/up slots, and an MLP runs
    over all rows at once too: its activation [patches, I] takes the attention phase's bytes (norm2's
    output is kept)."""
    p, h, i, pi = patches, g.hidden_size, g.intermediate_size, g.projection_intermediate_size
    tokens = p // g.merge_patches
    rows, merged = min(p, ROW_CHUNK), min(tokens, MERGER_CHUNK)
    f32, bf = np.float32, BF16
    keep = {"residual": ((p, h), f32),        # the float32 residual stream x
            "rope": ((p, g.head_dim), f32),   # the batch's RoPE cos and sin (ops.rope_table)
            "pixels_cast": ((1,), np.int32)}  # != 0: the forward casts pixels_f32 into pixels first
    normed = {"normed": ((p, h), bf)}         # a norm's output, the next GEMM's input
    attn = {"qkv": ((p, 3 * h), bf),          # the attn.qkv GEMM's output: q and k roped in place, attention's input
            "attn_out": ((p, h), bf)}         # attention's output, attn.proj's input
    if fused_swiglu:
        keep.update(normed)
        blocks = {"attn": attn, "mlp": {"mlp_act": ((p, i), bf)}}  # the whole MLP's activation
        merger_gate_up = {}
    else:
        blocks = {"blocks": {**normed, **attn,
                             "gate_up": ((rows, 2 * i), bf),   # one row chunk of mlp gate|up
                             "mlp_act": ((rows, i), bf)}}      # its clamped SwiGLU
        merger_gate_up = {"merger_gate_up": ((merged, 2 * pi), bf)}
    return {
        "keep": keep,
        "input": {"pixels_f32": ((p, g.patch_dim), f32),  # float32 pixels as uploaded, before the cast
                  "pixels": ((p, g.patch_dim), bf)},      # bf16 pixel_values the patch embed reads
        **blocks,
        # "embeddings" lives in the merger phase, smaller than the blocks phase: it costs no bytes.
        "merger": {"embeddings": ((tokens, g.out_hidden_size), bf),    # the tower's output rows
                   "im2col": ((tokens, g.merge_dim), bf),              # post_layernorm as merge x merge im2col
                   "merger_f32": ((merged, g.out_hidden_size), f32),   # downsample / proj outputs
                   "merger_bf16": ((merged, g.out_hidden_size), bf),   # their bf16 inputs to the next
                   **merger_gate_up,
                   "merger_act": ((merged, pi), bf)},
    }


class Arena:
    """Named views into one allocation: arena["qkv"] is a CuPy array."""

    def __init__(self, spec: dict):
        def size(slots):
            return sum(_slot_bytes(*s) for s in slots.values())

        keep = size(spec.get("keep", {}))
        shared = max((size(v) for k, v in spec.items() if k != "keep"), default=0)
        self.nbytes = keep + shared
        self.base = cupy.empty(self.nbytes, dtype=cupy.uint8)
        self.views = {}
        for phase, slots in spec.items():
            off = 0 if phase == "keep" else keep
            for name, (shape, dtype) in slots.items():
                self.views[name] = cupy.ndarray(shape, dtype=np.dtype(dtype), memptr=self.base.data + off)
                off += _slot_bytes(shape, dtype)

    def __getitem__(self, name):
        return self.views[name]
