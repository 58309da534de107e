"""Launchers of cuda/gemm_sm90.cu, our own Hopper GEMMs (TMA producer, wgmma consumers, persistent)
with the MLPs' clamped SwiGLU in their epilogue, and the choice between its two kernels: cooperative
consumers (both warpgroups on one 128 x 256 tile) or ping-pong ones (each on its own 128 x 128 tile,
one's epilogue under the other's MMAs). Checked before any launch, as ops.py's launchers are (launch.py
holds what both share)."""

from __future__ import annotations

import numpy as np

from . import gemm as _gemm
from .launch import cdiv, launch, ptr_or_null, sm_count, with_shared_memory
from .tensor_maps import tensor_map

GATE_UP_STAGES = 4        # gemm_sm90.cu's cooperative kernel's K slots (4 x 48 KB of shared memory)
GATE_UP_TILE = (128, 128)  # its output tile: rows, columns (of I; 256 of W)
PINGPONG_COLS, PINGPONG_STAGES = 64, 6  # the ping-pong kernel's output columns a tile (128 of W), its K slots
# Ping-pong where K is at most this: its epilogue overlap pays where the epilogue is a large share of a
# short K loop; the cooperative kernel's larger tile (less L2 traffic a FLOP) pays on long ones. Measured
# (H200, TFLOP/s): K = 1,024 708 against 667 at 16,384 rows; K = 4,096 (the merger) 740 against 771.
PINGPONG_MAX_K = 2048
# And where the cooperative kernel's tiles fill under this many waves of the SMs: the merger at 448²
# (256 rows: 160 tiles, 1.2 waves; ping-pong's half-width tiles 2.4) ran 570-572 TFLOP/s ping-pong
# against 458-460 cooperative (0.075 against 0.094 ms); at 896² (1,024 rows, 4.8 waves) cooperative
# stays ahead, 750-754 against 723-725.
PINGPONG_BELOW_WAVES = 2.0


def gate_up_swiglu_fits(k: int, inter: int) -> bool:
    """Whether gemm_sm90.cu's fused gate/up GEMM + SwiGLU (on a Hopper GPU) can run an MLP of width K
    and intermediate I: K a multiple of its 64-wide slices, I of its 128-column tiles."""
    return k % 64 == 0 and inter % GATE_UP_TILE[1] == 0


def uses_pingpong(m: int, k: int, inter: int, ctas: int | None = None) -> bool:
    """The launcher's choice of kernel for an [m, k] x [2 inter, k] gate/up GEMM on `ctas` CTAs (default:
    one per SM): ping-pong for short K loops or where the cooperative tiles fill under two waves."""
    waves = cdiv(m, GATE_UP_TILE[0]) * (inter // GATE_UP_TILE[1]) / (ctas or sm_count())
    return k <= PINGPONG_MAX_K or waves < PINGPONG_BELOW_WAVES


def gate_up_swiglu(a, w, gate_bias, up_bias, out, limit, *, ctas=None, columns_fastest=None,
                   pingpong=None, name="GEMM gate_up + swiglu"):
    """out [M, I] = bf16(silu(min(g, L)) * clamp(u, -L, L)) with [g | u] = a @ w.T + biases in fp32: a [M, K]
    bf16 (rows any 16-byte multiple apart), w = [gate; up] bf16 [2I, K], biases bf16 [I] or None. One
    CTA per SM walks the output tiles (`ctas`: fewer, as tests do, to make each walk several), columns
    fastest when a is larger than w (`columns_fastest` forces either order); ping-pong consumers as
    uses_pingpong says (`pingpong` forces either kernel). Either way each output is one K loop in fp32
    and one rounding: a row's bits do not depend on the rows launched with it."""
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
    if pingpong is None:
        pingpong = uses_pingpong(m, k, inter, ctas)
    if pingpong:
        cols, smem = PINGPONG_COLS, PINGPONG_STAGES * (rows + 2 * PINGPONG_COLS) * 128 + 1024
        fn = with_shared_memory("gemm_sm90", f"gemm_swiglu_pingpong_sm90<{PINGPONG_STAGES}>", smem)
    else:
        smem = GATE_UP_STAGES * (rows + 2 * cols) * 128 + 1024
        fn = with_shared_memory("gemm_sm90", f"gemm_swiglu_sm90<{GATE_UP_STAGES}>", smem)
    ta, tw = tensor_map(a, rows), tensor_map(w, cols)  # boxes: A's tile rows; W's gate (or up) rows
    tiles = cdiv(m, rows) * (inter // cols)
    grid = (int(min(tiles, ctas or sm_count())),)
    launch(name, 2 * m * k * n2, lambda: fn(
        grid, (384,), (ta, tw, ptr_or_null(gate_bias), ptr_or_null(up_bias), out, np.int32(m), np.int32(k),
                       np.int32(inter), np.float32(limit),
                       np.int32(m > n2 if columns_fastest is None else columns_fastest)), shared_mem=smem))
    return out

