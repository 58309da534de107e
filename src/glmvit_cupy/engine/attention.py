"""Flash attention's configurations, in one table, and the heuristics that pick one.

Every kernel a code path can select is a row of VARIANTS; its kernel instance name, block size and
shared-memory bytes are derived from the row, so the CUDA sources hold templates only. The launch
itself is ops.flash_attention. Pure Python: the choice is tested without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KEYS_PER_TILE_SM90 = 64   # K/V tile rows of attention_sm90.cu (its BNW)
KEYS_PER_TILE_SM80 = 64   # and of attention_sm80.cu (its BN)


@dataclass(frozen=True)
class Variant:
    """One attention kernel configuration.

    sm90 (attention_sm90.cu, Hopper only, head dim 64): `warpgroups` consumer warpgroups of 64 query
    rows plus one producer, `stages` K/V slots. sm80 (attention_sm80.cu, any sm_80+): `warps` warps
    of 16 query rows. `speed`: TFLOP/s on long segments, measured on the H200, which the per-shape
    choice weighs."""

    name: str
    arch: str                 # "sm90" or "sm80"
    head_dim: int
    warpgroups: int = 0
    stages: int = 0
    warps: int = 0
    speed: float = 1.0
    online: bool = True       # sm90: False, P = exp2(S * scale) with no running max (score_bound_log2)

    @property
    def module(self) -> str:
        return f"attention_{self.arch}"

    @property
    def entry(self) -> str:
        if self.arch == "sm90":
            return f"flash_fwd_sm90<{self.warpgroups}, {self.stages}" + (">" if self.online else ", false>")
        return f"flash_fwd_sm80<{self.head_dim}, {self.warps}>"

    @property
    def rows(self) -> int:
        """Query rows per CTA."""
        return 64 * self.warpgroups if self.arch == "sm90" else 16 * self.warps

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + 1) if self.arch == "sm90" else 32 * self.warps

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: sm90, the Q tile and `stages` K and V tiles of 64-key rows of 128 bytes,
        128B-swizzled from a 1024-byte boundary (+1024 to align); sm80, Q and two K and V tiles in rows padded
        by 8 bf16 (ldmatrix's banks)."""
        if self.arch == "sm90":
            return self.rows * 128 + self.stages * 2 * KEYS_PER_TILE_SM90 * 128 + 1024
        return (self.rows + 4 * KEYS_PER_TILE_SM80) * (self.head_dim + 8) * 2


# The H200's measured choices (docs/PERFORMANCE.md): four consumer warpgroups are fastest on long
# segments and on batches of short ones; two on a lone short segment, where 256-row tiles leave SMs
# idle. Both run the same operations on each row, so they give the same bits (tested): batching
# images never changes an embedding. The _fixed pair drops the softmax's running max: 1.2-1.3x faster
# (16k keys: 611 against 488 TFLOP/s), error against float64 2.4e-3 against 2.0e-3; a model uses them
# where its norm weights bound every score (score_bound_log2 within FIXED_OFFSET_LIMIT).
VARIANTS = {v.name: v for v in (
    Variant("sm90_4wg", "sm90", 64, warpgroups=4, stages=4, speed=460.0),
    Variant("sm90_2wg", "sm90", 64, warpgroups=2, stages=4, speed=345.0),
    Variant("sm90_4wg_fixed", "sm90", 64, warpgroups=4, stages=4, speed=590.0, online=False),
    Variant("sm90_2wg_fixed", "sm90", 64, warpgroups=2, stages=4, speed=445.0, online=False),
    Variant("sm80_d32", "sm80", 32, warps=4),
    Variant("sm80_d64", "sm80", 64, warps=4),
    Variant("sm80_d128", "sm80", 128, warps=4),
)}


# How far from 0 (log2 units) every score may be for the variants without a running max: P <= 2^64,
# so a row sum of up to 2^15 keys stays below 2^79 and O below 2^79 x max|v|, far from float's 2^128;
# and a row whose largest P is 2^-64 still sums to a normal float (and a normal bf16: the same exponent).
FIXED_OFFSET_LIMIT = 64.0


def score_bound_log2(q_norm_max: float, k_norm_max: float, head_dim: int) -> float:
    """An upper bound on |q . k| * log2(e) / sqrt(head_dim) for this tower's attention, from its weights
    alone: q and k are per-head RMSNorms (sum of squares of the normalised vector <= head_dim, times the
    weight), scaled by their norm weights (|w| <= the max), RoPE rotates pairs (norm kept), so by
    Cauchy-Schwarz |q . k| <= head_dim * max|w_q| * max|w_k|. A 1% margin covers bf16's rounding of q
    and k (2^-9 each) with room."""
    return 1.01 * head_dim * q_norm_max * k_norm_max * 1.4426950408889634 / head_dim ** 0.5


def default_variants(head_dim: int, compute_capability: str, score_bound: float = math.inf) -> tuple[str, ...]:
    """The variants a model on this GPU picks from, per input shape. `score_bound`: score_bound_log2 of
    its weights; within FIXED_OFFSET_LIMIT, the Hopper variants without a running max."""
    if head_dim == 64 and compute_capability == "90":
        fixed = score_bound <= FIXED_OFFSET_LIMIT
        return tuple(v.name for v in VARIANTS.values() if v.arch == "sm90" and v.online != fixed)
    if head_dim not in (32, 64, 128):
        raise ValueError(f"head_dim {head_dim}: the attention kernels are built for head dims 32, 64 and 128")
    return (f"sm80_d{head_dim}",)


def check_variant(name, head_dim: int, compute_capability: str, score_bound: float = math.inf) -> Variant:
    """The variant `name`, or ValueError if it is unknown or cannot run here (refused before any
    launch: a Hopper kernel on another GPU would not compile, a wrong head dim would misread q, and a
    variant without a running max would overflow on scores past FIXED_OFFSET_LIMIT; `score_bound`:
    score_bound_log2 of the model's weights, none known by default: those variants are then refused)."""
    v = VARIANTS.get(name)
    if v is None:
        raise ValueError(f"attention_variant={name!r} is unknown; choices: {', '.join(VARIANTS)}")
    if v.head_dim != head_dim:
        raise ValueError(f"attention_variant={name!r} is built for head dim {v.head_dim}, this tower's is "
                         f"{head_dim}; choices for it: {', '.join(k for k, x in VARIANTS.items() if x.head_dim == head_dim)}")
    if v.arch == "sm90" and compute_capability != "90":
        raise ValueError(f"attention_variant={name!r} needs a Hopper GPU (compute capability 9.0, sm_90a's wgmma); "
                         f"this GPU is {compute_capability[:-1]}.{compute_capability[-1]}: use sm80_d{head_dim}")
    if not v.online and not score_bound <= FIXED_OFFSET_LIMIT:  # NaN: no bound either
        raise ValueError(f"attention_variant={name!r} drops the softmax's running max, which is safe only when every "
                         f"score is within {FIXED_OFFSET_LIMIT:g} (log2 units) of 0; this checkpoint's q_norm / k_norm "
                         f"weights allow {score_bound:.1f}: use {name.removesuffix('_fixed')}")
    return v


def pick_variant(names, seq_lens, heads: int, sms: int) -> str:
    """The variant with the least estimated time on these segments: waves of CTAs (one CTA per SM,
    as their shared memory allows) times the mean CTA's work (its padded query rows x its keys) over
    the variant's speed. 1,024 keys x 16 heads: 64 CTAs of 256 rows (half a wave) against 128 of
    128 rows, so two warpgroups win; at 4,096 keys and past, or 16 segments of 1,024, four do."""
    def cost(name):
        v = VARIANTS[name]
        tiles = [-(-int(n) // v.rows) for n in seq_lens]
        ctas = sum(tiles) * heads
        work = sum(t * v.rows * int(n) for t, n in zip(tiles, seq_lens)) * heads
        return -(-ctas // sms) * (work / ctas) / v.speed
    return min(names, key=cost)


def tiles(cu_seqlens: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment, first query row) of every CTA's query tile of `rows` rows: what the kernels'
    scheduler (cuda/attention_scheduler.cuh) reads."""
    seg, q0 = [], []
    for s in range(len(cu_seqlens) - 1):
        starts = range(int(cu_seqlens[s]), int(cu_seqlens[s + 1]), rows)
        seg.extend([s] * len(starts))
        q0.extend(starts)
    return np.array(seg, np.int32), np.array(q0, np.int32)
