"""Flash attention launcher: picks the kernel variant for the device and head size, builds the
per-call tile table, launches. q, k, v, o are bf16 [N, heads * head_dim]; segments come from
cu_seqlens and never attend to each other."""

from __future__ import annotations

import math

import numpy as np

from .kernels import kernel

# name -> (kernel, query rows per CTA, dynamic shared memory bytes, threads); see cuda/attention.cu.
_KV = 2 * 128 * 128  # one K and one V tile of 128 keys x 64 bf16
VARIANTS = {
    "sm90_g1_n64": ("flash90_attn_d64_g1_n64", 64, 64 * 128 + 4 * 64 * 128 + 1024, 128),
    "sm90_g2_n64": ("flash90_attn_d64_g2_n64", 128, 128 * 128 + 4 * 64 * 128 + 1024, 256),
    "sm90_g1_n128": ("flash90_attn_d64_g1_n128", 64, 64 * 128 + 2 * _KV + 1024, 128),
    "sm90_g3_n128": ("flash90_attn_d64_g3_n128", 192, 192 * 128 + 2 * _KV + 1024, 384),
    "sm90_g1_n128_pipe": ("flash90_attn_d64_g1_n128_p", 64, 64 * 128 + 3 * _KV + 1024, 128),
    "sm90_g3_n128_pipe": ("flash90_attn_d64_g3_n128_p", 192, 192 * 128 + 3 * _KV + 1024, 384),
}
# Warp-specialised: NC consumer warpgroups (64 query rows each) + one producer warpgroup, S K/V slots;
# "_fN": one exp in N on the FMA pipe instead of the special-function unit (cuda/attention.cu ex2_fma).
for _nc, _st, _f in ((2, 2, ""), (2, 3, ""), (3, 2, ""), (3, 3, ""), (2, 3, "_f16"), (3, 3, "_f16"), (3, 3, "_f32")):
    VARIANTS[f"sm90_ws{_nc}_s{_st}{_f}"] = (f"flash90_attn_d64_ws{_nc}_s{_st}{_f}", 64 * _nc,
                                           64 * _nc * 128 + _st * _KV + 1024, 128 * (_nc + 1))
for _d in (32, 64, 128):
    VARIANTS[f"sm80_d{_d}_w4"] = (f"flash_attn_d{_d}_w4", 64, (64 + 4 * 64) * (_d + 8) * 2, 128)
VARIANTS["sm80_d64_w8"] = ("flash_attn_d64_w8", 128, (128 + 4 * 64) * 72 * 2, 256)

# On the H200 (tools/attn_trial.py, docs/PERFORMANCE.md): three consumer warpgroups with one exp in
# 16 on the FMA pipe are the fastest on long segments, two warpgroups on short ones, where 192-row
# tiles leave SMs idle. Both take the same exps on the same pipes, so they give the same bits (tested):
# batching images never changes an embedding. Each entry: the TFLOP/s its CTAs reach on long
# segments, which pick_variant weighs.
SM90_DEFAULTS = {"sm90_ws3_s3_f16": 424.0, "sm90_ws2_s3_f16": 360.0}


def default_variants(head_dim: int, compute_capability: str) -> tuple[str, ...]:
    if head_dim == 64 and compute_capability == "90":
        return tuple(SM90_DEFAULTS)  # wgmma; sm_90a code runs on compute capability 9.0 only
    if head_dim not in (32, 64, 128):
        raise ValueError(f"head_dim {head_dim}: the attention kernels are built for 32, 64 and 128")
    return (f"sm80_d{head_dim}_w4",)


def pick_variant(variants, seq_lens, heads: int, sms: int) -> str:
    """The variant with the least estimated time on these segments: waves of CTAs (one CTA per SM,
    as their shared memory allows) times the mean CTA's work (its padded query rows x its keys) over
    the variant's speed. 1,024 keys x 16 heads: 96 CTAs of 192 rows (one partial wave) against 128 of
    128 rows, so two warpgroups win; at 32,000 keys three do."""
    def cost(v):
        rows = VARIANTS[v][1]
        tiles = [-(-int(n) // rows) for n in seq_lens]
        ctas = sum(tiles) * heads
        work = sum(t * rows * int(n) for t, n in zip(tiles, seq_lens)) * heads
        return -(-ctas // sms) * (work / ctas) / SM90_DEFAULTS.get(v, 1.0)
    return min(variants, key=cost)


class FlashAttention:
    def __init__(self, head_dim: int, variant: str | None = None):
        import cupy

        cc = cupy.cuda.Device().compute_capability
        self.variant = variant or default_variants(head_dim, cc)[0]
        name, self.rows, self.smem, self.threads = VARIANTS[self.variant]
        self.head_dim = head_dim
        self.kernel = kernel("attention", name)
        self.kernel.max_dynamic_shared_size_bytes = self.smem
        self.scale_log2 = np.float32(math.log2(math.e) / math.sqrt(head_dim))

    def tiles(self, cu_seqlens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment, first query row) of every CTA's query tile."""
        seg, q0 = [], []
        for s in range(len(cu_seqlens) - 1):
            starts = range(int(cu_seqlens[s]), int(cu_seqlens[s + 1]), self.rows)
            seg.extend([s] * len(starts))
            q0.extend(starts)
        return np.array(seg, np.int32), np.array(q0, np.int32)

    def __call__(self, q, k, v, o, cu, tile_seg, tile_q0, heads: int):
        self.kernel((len(tile_q0), heads), (self.threads,),
                    (q, k, v, o, cu, tile_seg, tile_q0, np.int32(heads), self.scale_log2), shared_mem=self.smem)
