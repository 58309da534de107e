"""Flash attention's configurations, in one table, and the heuristics that pick one.

Every kernel a code path can select is a row of VARIANTS; its kernel instance name, block size and
shared-memory bytes are derived from the row, so the CUDA sources hold templates only. The launch
itself is ops.flash_attention. Pure Python: the choice is tested without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..checks import GPU_HEAD_DIMS

KEYS_PER_TILE_SM90 = 64   # K/V tile rows of attention_sm90.cu (its BNW)
KEYS_PER_TILE_SM80 = 64   # and of attention_sm80.cu (its BN)


@dataclass(frozen=True)
class Variant:
    """One attention kernel configuration.

    sm90 (attention_sm90.cu, Hopper only, head dim 64): `warpgroups` consumer warpgroups of 64 query
    rows plus one producer, `stages` K/V slots, `overlap`: a warpgroup's softmax of one tile runs beside
    its P V of the last (FlashAttention-3's intra-warpgroup overlap; the same bits). sm80
    (attention_sm80.cu, any sm_80+): `warps` warps of 16 query rows. `speed`: TFLOP/s at 16,384 keys,
    all four measured in one run on an H100, which the per-shape choice weighs within a pair."""

    name: str
    arch: str                 # "sm90" or "sm80"
    head_dim: int
    warpgroups: int = 0
    stages: int = 0
    warps: int = 0
    speed: float = 1.0
    online: bool = True       # sm90: False, P = exp2(S * scale) with no running max (score_bound_log2)
    overlap: bool = False     # sm90: a turn issues this tile's Q K^T, then the last tile's P V

    @property
    def module(self) -> str:
        return f"attention_{self.arch}"

    @property
    def entry(self) -> str:
        if self.arch == "sm90":
            flags = (["true" if self.online else "false"] if self.overlap or not self.online else []) + \
                (["true"] if self.overlap else [])
            return f"flash_fwd_sm90<{', '.join(map(str, [self.warpgroups, self.stages] + flags))}>"
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
        return (self.rows + 4 * KEYS_PER_TILE_SM80) * (padded_head_dim(self.head_dim) + 8) * 2


def padded_head_dim(d: int) -> int:
    """The columns attention_sm80.cu's MMAs run over for head dim d: d rounded up to 16 (HeadCols::DP)."""
    return -(-d // 16) * 16


# attention_sm80.cu takes any head dim that is a multiple of 4 (the axial RoPE's own condition) up to
# 256 (its registers and shared memory: 169 KB at 256): checks.GPU_HEAD_DIMS, which the host half reads too.
SM80_HEAD_DIMS = GPU_HEAD_DIMS


# The measured choices (docs/PERFORMANCE.md): four consumer warpgroups are fastest on long segments
# and on batches of short ones; two on a lone short segment, where 256-row tiles leave SMs idle. Both
# run the same operations on each row, so they give the same bits (tested): batching images never
# changes an embedding. The _fixed pair drops the softmax's running max: 1.07x faster than the online
# pair, which keeps it lazily (softmax.cuh; 16k keys on an H100: 648 against 608 TFLOP/s, timed as `python
# benchmarks/bench_kernels.py --attention-only` times them), at the same error against float64 (2.3e-3); a model
# uses them where its norm weights bound every score (score_bound_log2 within FIXED_OFFSET_LIMIT). All
# four overlap a tile's softmax with the last tile's P V: at 16k keys +4% / +7% for the four-warpgroup
# fixed / online kernels, +7-11% for the two-warpgroup ones.
VARIANTS = {v.name: v for v in (
    Variant("sm90_4wg", "sm90", 64, warpgroups=4, stages=4, speed=608.0, overlap=True),
    Variant("sm90_2wg", "sm90", 64, warpgroups=2, stages=4, speed=452.0, overlap=True),
    Variant("sm90_4wg_fixed", "sm90", 64, warpgroups=4, stages=4, speed=648.0, online=False, overlap=True),
    Variant("sm90_2wg_fixed", "sm90", 64, warpgroups=2, stages=4, speed=491.0, online=False, overlap=True),
)} | {f"sm80_d{d}": Variant(f"sm80_d{d}", "sm80", d, warps=4) for d in SM80_HEAD_DIMS}
CHOICES = ", ".join(k for k, v in VARIANTS.items() if v.arch == "sm90") + \
    f", sm80_d<head dim> (a multiple of 4 up to {SM80_HEAD_DIMS[-1]})"  # what errors list


# How far from 0 (log2 units) every score may be for the variants without a running max: P <= 2^64,
# so a row sum of up to 2^15 keys stays below 2^79 and O below 2^79 x max|v|, far from float's 2^128;
# and a row whose largest P is 2^-64 still sums to a normal float (and a normal bf16: the same exponent).
FIXED_OFFSET_LIMIT = 64.0
# And the output's side: O sums up to `keys` values of P x v, each at most 2^score_bound x max|v|, in
# float32 (2^128): the variants without a running max need log2(keys) + score_bound + log2 max|v|
# below this (the online ones' P <= 2^16, LAZY_SUM_LIMIT in softmax.cuh, leaves them 2^97 for max|v| at
# 2^15 keys; past 2^64 the next RMSNorm's float32 sum of squares overflows first).
FIXED_OUTPUT_LIMIT = 126.0


def score_bound_log2(q_norm_max: float, k_norm_max: float, head_dim: int) -> float:
    """An upper bound on |q . k| * log2(e) / sqrt(head_dim) for this tower's attention, from its weights
    alone: q and k are per-head RMSNorms (sum of squares of the normalised vector <= head_dim, times the
    weight), scaled by their norm weights (|w| <= the max), RoPE rotates pairs (norm kept), so by
    Cauchy-Schwarz |q . k| <= head_dim * max|w_q| * max|w_k|. A 1% margin covers bf16's rounding of q
    and k (2^-9 each) with room."""
    return 1.01 * head_dim * q_norm_max * k_norm_max * 1.4426950408889634 / head_dim ** 0.5


def value_bound_log2(norm1_weight, v_weight, v_bias) -> float:
    """log2 of an upper bound on |v| for one block's attention, from its weights alone: v = norm1(x) @
    W_v.T + b_v, and norm1's output is an RMSNorm (L2 norm <= sqrt(H)) times its weight, so by
    Cauchy-Schwarz |v_k| <= sqrt(H) ||w_norm1 * W_v[k]||_2 + |b_v[k]|. A 2% margin covers bf16's
    rounding of the normed rows and of v. inf if a weight is NaN or inf (no bound), -inf if v is 0."""
    w = np.asarray(norm1_weight, np.float64)
    rows = np.asarray(v_weight, np.float64) * w
    bound = 1.02 * float((math.sqrt(w.size) * np.sqrt((rows * rows).sum(1))
                          + np.abs(np.asarray(v_bias, np.float64))).max())
    if not math.isfinite(bound):
        return math.inf
    return math.log2(bound) if bound > 0 else -math.inf


def fixed_offset_fits(score_bound: float, value_bound: float, max_keys: int) -> bool:
    """Whether the variants without a running max are safe for these bounds (score_bound_log2,
    value_bound_log2) on segments of up to max_keys keys. NaN (no bound) is not."""
    return score_bound <= FIXED_OFFSET_LIMIT and \
        score_bound + value_bound + math.log2(max(max_keys, 1)) < FIXED_OUTPUT_LIMIT


def default_variants(head_dim: int, compute_capability: str, score_bound: float = math.inf,
                     value_bound: float = math.inf, max_keys: int = 1) -> tuple[str, ...]:
    """The variants a model on this GPU picks from, per input shape. `score_bound` / `value_bound`:
    score_bound_log2 and value_bound_log2 of its weights (none known by default); where they fit
    (fixed_offset_fits, segments of up to max_keys), the Hopper variants without a running max."""
    if head_dim == 64 and compute_capability == "90":
        fixed = fixed_offset_fits(score_bound, value_bound, max_keys)
        return tuple(v.name for v in VARIANTS.values() if v.arch == "sm90" and v.online != fixed)
    if head_dim not in SM80_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: the attention kernels take head dims that are multiples of 4 up to "
                         f"{SM80_HEAD_DIMS[-1]}; the float32 reference (glmvit_cupy.reference, glmvit-encode --cpu) "
                         "runs any")
    return (f"sm80_d{head_dim}",)


def check_variant(name, head_dim: int, compute_capability: str, score_bound: float = math.inf,
                  value_bound: float = math.inf, max_keys: int = 1) -> Variant:
    """The variant `name`, or ValueError if it is unknown or cannot run here (refused before any
    launch: a Hopper kernel on another GPU would not compile, a wrong head dim would misread q, and a
    variant without a running max would overflow on scores past FIXED_OFFSET_LIMIT or an output past
    FIXED_OUTPUT_LIMIT; `score_bound` / `value_bound`: the model's score_bound_log2 and
    value_bound_log2, none known by default: those variants are then refused)."""
    v = VARIANTS.get(name)
    if v is None:
        raise ValueError(f"attention_variant={name!r} is unknown; choices: {CHOICES}")
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
    if not v.online and not fixed_offset_fits(score_bound, value_bound, max_keys):
        raise ValueError(f"attention_variant={name!r} drops the softmax's running max, so its output sums up to "
                         f"{max_keys} values of 2^{score_bound:.1f} x |v| in float32; this checkpoint's norm1 and "
                         f"attn.qkv weights bound |v| by 2^{value_bound:.1f}, past 2^{FIXED_OUTPUT_LIMIT:g} in all: "
                         f"use {name.removesuffix('_fixed')}")
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
