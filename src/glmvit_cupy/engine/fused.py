"""Launchers of cuda/gemm_sm90.cu, our own Hopper GEMMs (TMA producer, wgmma consumers, persistent),
with what consumes their output in the epilogue: the MLPs' gate/up GEMM with the clamped SwiGLU, and
(TRIAL) a GEMM that accumulates into a float32 C (the residual stream). Checked before any launch, as
ops.py's launchers are."""

from __future__ import annotations

import numpy as np

from . import gemm as _gemm
from .ops import _cdiv, _launch, _ptr_or_null, _sm_count, _with_shared_memory
from .tensor_maps import tensor_map

GATE_UP_STAGES = 4        # gemm_sm90.cu's K slots (4 x 48 KB of shared memory)
GATE_UP_TILE = (128, 128)  # its output tile: rows, columns (of I; 256 of W)


def gate_up_swiglu_fits(k: int, inter: int) -> bool:
    """Whether gemm_sm90.cu's fused gate/up GEMM + SwiGLU (on a Hopper GPU) can run an MLP of width K
    and intermediate I: K a multiple of its 64-wide slices, I of its 128-column tiles."""
    return k % 64 == 0 and inter % GATE_UP_TILE[1] == 0


def gate_up_swiglu(a, w, gate_bias, up_bias, out, limit, *, ctas=None, columns_fastest=None,
                   name="GEMM gate_up + swiglu", stages=GATE_UP_STAGES, store=True, pingpong=False):
    """out [M, I] = bf16(silu(min(g, L)) * clamp(u, -L, L)) with [g | u] = a @ w.T + biases in fp32: a [M, K]
    bf16 (rows any 16-byte multiple apart), w = [gate; up] bf16 [2I, K], biases bf16 [I] or None. One
    CTA per SM walks the output tiles (`ctas`: fewer, as tests do, to make each walk several), columns
    fastest when a is larger than w (`columns_fastest` forces either order)."""
    m, k = a.shape
    n2, k2 = w.shape
    inter = n2 // 2
    for what, arr in (("a", a), ("w", w), ("out", out), ("gate_bias", gate_bias), ("up_bias", up_bias)):
        if arr is not None and arr.dtype != _gemm.BF16:
            raise TypeError(f"gate_up_swiglu: {what} must be bfloat16, got {arr.dtype}")
    if k2 != k or n2 != 2 * inter or out.shape != (m, inter):
        raise ValueError(f"gate_up_swiglu: a{a.shape} @ w{w.shape}.T -> out{out.shape}: w must be [2I, K] "
                         f"= [2 x {out.shape[1]}, {k}] and out [M, I]")
    if not gate_up_swiglu_fits(k, inter):
        raise ValueError(f"gate_up_swiglu: K = {k} must be a multiple of 64 and I = {inter} of {GATE_UP_TILE[1]} "
                         "(use linear + swiglu_clamp otherwise)")
    if (a.strides[1] != 2 or a.strides[0] % 16 or not w.flags.c_contiguous or not out.flags.c_contiguous
            or any(x.data.ptr % 16 for x in (a, w, out))
            or any(b is not None and (not b.flags.c_contiguous or b.shape != (inter,) or b.data.ptr % 4)
                   for b in (gate_bias, up_bias))):
        raise ValueError("gate_up_swiglu: a's rows, w and out must be contiguous rows starting at 16-byte "
                         f"boundaries and the biases [I] contiguous (a strides {a.strides}, w {w.strides}, "
                         f"out {out.strides})")
    if m == 0:
        return out
    rows, cols = GATE_UP_TILE
    if pingpong:  # TRIAL: gemm_swiglu_pingpong_sm90, tiles of 128 rows x 64 columns, one per warpgroup
        if inter % PINGPONG_COLS:
            raise ValueError(f"gate_up_swiglu: the ping-pong kernel needs I = {inter} a multiple of {PINGPONG_COLS}")
        cols, smem = PINGPONG_COLS, PINGPONG_STAGES * (rows + 2 * PINGPONG_COLS) * 128 + 1024
        fn = _with_shared_memory("gemm_sm90", f"gemm_swiglu_pingpong_sm90<{PINGPONG_STAGES}>", smem)
    else:  # TRIAL: stages and store (False: no epilogue) for bench_kernels
        fn, smem = _gate_up_kernel(stages, store)
    ta, tw = tensor_map(a, rows), tensor_map(w, cols)  # boxes: A's tile rows; W's gate (or up) rows
    tiles = _cdiv(m, rows) * (inter // cols)
    grid = (int(min(tiles, ctas or _sm_count())),)
    _launch(name, 2 * m * k * n2, lambda: fn(
        grid, (384,), (ta, tw, _ptr_or_null(gate_bias), _ptr_or_null(up_bias), out, np.int32(m), np.int32(k),
                       np.int32(inter), np.float32(limit),
                       np.int32(m > n2 if columns_fastest is None else columns_fastest)), shared_mem=smem))
    return out


PINGPONG_COLS, PINGPONG_STAGES = 64, 6  # TRIAL: the ping-pong kernel's output columns a tile, its K slots


def _gate_up_kernel(stages=GATE_UP_STAGES, store=True):
    smem = stages * (GATE_UP_TILE[0] + 2 * GATE_UP_TILE[1]) * 128 + 1024
    return _with_shared_memory("gemm_sm90", f"gemm_swiglu_sm90<{stages}, {'true' if store else 'false'}>", smem), smem


ACCUMULATE_COLS = 128  # TRIAL: gemm_accumulate_pingpong_sm90's output columns a tile


def gemm_accumulate(a, w, c, *, ctas=None, columns_fastest=None, name="GEMM (+= fp32, ping-pong)"):
    """TRIAL: c [M, N] float32 += a [M, K] @ w [N, K].T (bf16), as ops.linear(a, w, c, accumulate=True)
    does with cuBLAS, by gemm_sm90.cu's ping-pong kernel (c's read and write under the MMAs); K a
    multiple of 64, N of 128. No split K: a row's bits do not depend on the others."""
    (m, k), (n, k2) = a.shape, w.shape
    if a.dtype != _gemm.BF16 or w.dtype != _gemm.BF16 or c.dtype != np.float32:
        raise TypeError(f"gemm_accumulate: a and w must be bfloat16 and c float32, got {a.dtype}, {w.dtype}, {c.dtype}")
    if k2 != k or c.shape != (m, n) or k % 64 or n % ACCUMULATE_COLS:
        raise ValueError(f"gemm_accumulate: a{a.shape} @ w{w.shape}.T into c{c.shape}: w must be [N, K] and c [M, N] "
                         f"with K a multiple of 64 and N of {ACCUMULATE_COLS}")
    if (a.strides[1] != 2 or a.strides[0] % 16 or not w.flags.c_contiguous or not c.flags.c_contiguous
            or any(x.data.ptr % 16 for x in (a, w, c))):
        raise ValueError(f"gemm_accumulate: a's rows, w and c must be contiguous rows starting at 16-byte boundaries "
                         f"(a strides {a.strides}, w {w.strides}, c {c.strides})")
    if m == 0:
        return c
    smem = PINGPONG_STAGES * 2 * 128 * 128 + 1024
    fn = _with_shared_memory("gemm_sm90", f"gemm_accumulate_pingpong_sm90<{PINGPONG_STAGES}>", smem)
    tiles = _cdiv(m, GATE_UP_TILE[0]) * (n // ACCUMULATE_COLS)
    grid = (int(min(tiles, ctas or _sm_count())),)
    ta, tw = tensor_map(a, GATE_UP_TILE[0]), tensor_map(w, 64)
    _launch(name, 2 * m * k * n, lambda: fn(grid, (384,), (
        ta, tw, c, np.int32(m), np.int32(k), np.int32(n), np.int32(m > n if columns_fastest is None else columns_fastest)),
        shared_mem=smem))
    return c
