"""One typed launcher per kernel entry: grid, block and argument order written once (here; gemm_sm90.cu's
two kernels in gemm_sm90.py, which also picks between them).

The engine's layers, the GPU tests, the benchmarks and the profiler call these. Every launch runs on
the current CuPy stream (GEMMs on their handle's stream, which the engine makes current). Shapes are
read from the arrays; the caller owns the buffers. launch.py's `traced` lets a profiler see every
launch without touching the engine.
"""

from __future__ import annotations

import math

import numpy as np

from . import gemm as _gemm
from .attention import KEYS_PER_TILE_SM90, Variant
from .kernels import kernel
from .launch import THREADS, cdiv, grid_1d, launch, ptr_or_null, with_shared_memory
from .tensor_maps import tensor_map

RMS_WARP_VEC = 8  # norms.cu: rmsnorm_residual_warp holds a row of up to 32 x 4 x 8 floats


# -- GEMMs (cuBLAS) ------------------------------------------------------------------------------

def linear(a, w, out, *, accumulate=False, handle=None, name="linear"):
    """out (+)= a @ w.T: a [M, K] bf16, w [N, K] bf16, out [M, N] bf16 or float32 (accumulate: fp32
    out += the product, how sub-layers add into the residual stream)."""
    launch(name, 2 * a.shape[0] * w.shape[0] * w.shape[1],
           lambda: _gemm.gemm(a, w, out, 1.0 if accumulate else 0.0, handle=handle))


# -- cuda/finite.cu ---------------------------------------------------------------------------------

def count_nonfinite(x, counts, slot: int):
    """counts[slot] += the NaN and infinite values of x (bf16, contiguous); counts: uint64 on the device."""
    if x.dtype.itemsize != 2 or not x.flags.c_contiguous or counts.dtype != np.uint64 or not 0 <= slot < counts.size:
        raise ValueError(f"count_nonfinite: contiguous bf16 x and a uint64 counts with slot {slot} expected, got "
                         f"{x.dtype} {x.shape} and {counts.dtype} [{counts.size}]")
    if x.size:
        launch("nonfinite count", 0, lambda: kernel("finite", "count_nonfinite_bf16")(
            grid_1d(cdiv(x.size, 8)), (THREADS,), (x, np.int64(x.size), counts, np.int32(slot))))


# -- cuda/norms.cu ---------------------------------------------------------------------------------

def _offset(offset, cols):
    """The norms' fp32 offset row (None: none), checked: the kernels read it as float4s of cols floats."""
    if offset is not None and (offset.dtype != np.float32 or offset.shape != (cols,)):
        raise ValueError(f"rmsnorm offset: float32 [{cols}] expected, got {offset.dtype} {list(offset.shape)}")
    return ptr_or_null(offset)


def rmsnorm_residual(x, offset, weight, out, eps):
    """out = bf16(rmsnorm(x + offset) * weight): x [rows, cols] fp32, only read; offset fp32 [cols] (the
    biases not yet in x; None: nothing added)."""
    rows, cols = x.shape
    args = (x, _offset(offset, cols), weight, out, np.int32(rows), np.int32(cols), np.float32(eps))
    if cols % 4 == 0 and cols <= 32 * 4 * RMS_WARP_VEC:  # a warp a row (norms.cu); else a block a row
        launch("rmsnorm (+bias offset)", 0, lambda: kernel("norms", "rmsnorm_residual_warp")(
            (cdiv(rows, THREADS // 32),), (THREADS,), args))
    else:
        launch("rmsnorm (+bias offset)", 0, lambda: kernel("norms", "rmsnorm_residual")((rows,), (THREADS,), args))


def rmsnorm_im2col(x, offset, weight, out, eps):
    """As rmsnorm_residual, written as the m x m downsample's im2col: out [rows / m^2, cols * m^2], each
    m^2 consecutive rows one merged row (m^2 is read from out's shape)."""
    rows, cols = x.shape
    group = out.shape[1] // cols if out.ndim == 2 and cols else 0
    if group < 1 or out.shape != (rows // group, cols * group) or rows % group or not out.flags.c_contiguous:
        raise ValueError(f"rmsnorm_im2col: out must be a contiguous [rows / m^2, cols * m^2] for x {list(x.shape)}, "
                         f"got {list(out.shape)}")
    launch("rmsnorm + im2col", 0, lambda: kernel("norms", "rmsnorm_im2col")(
        (rows,), (THREADS,), (x, _offset(offset, cols), weight, out, np.int32(rows), np.int32(cols), np.float32(eps),
                              np.int32(group))))


def layernorm_gelu(y, weight, bias, out, eps):
    """out = bf16(gelu_erf(layernorm(y) * weight + bias)), y [rows, cols] fp32."""
    rows, cols = y.shape
    launch("layernorm + gelu", 0, lambda: kernel("norms", "layernorm_gelu")(
        (rows,), (THREADS,), (y, weight, bias, out, np.int32(rows), np.int32(cols), np.float32(eps))))


# -- cuda/rotary.cu --------------------------------------------------------------------------------

def rope_table(positions, inv_freq, out):
    """out [rows, D] float32 = (cos a_d, sin a_d) at columns 2d, 2d + 1 of each rotation pair d < D/2 of the
    axial RoPE at positions [>= rows, 2] (int32 (h, w) a row), inv_freq float32 [D/4]: computed once a
    forward, read by every block's qk_norm_rope."""
    rows, d = out.shape
    if out.dtype != np.float32 or not out.flags.c_contiguous or d % 4 or inv_freq.shape != (d // 4,) \
            or inv_freq.dtype != np.float32:  # D % 4: the axial RoPE's two halves of whole pairs (config.py)
        raise ValueError(f"rope_table: out must be contiguous float32 [rows, D] with D % 4 == 0 and inv_freq "
                         f"float32 [D / 4] (out {out.dtype} {out.shape}, inv_freq {inv_freq.dtype} {inv_freq.shape})")
    if positions.dtype != np.int32 or positions.ndim != 2 or positions.shape[0] < rows or positions.shape[1] != 2 \
            or not positions.flags.c_contiguous:
        raise ValueError(f"rope_table: positions must be contiguous int32 [>= {rows}, 2], got {positions.dtype} "
                         f"{positions.shape}")
    launch("rope table", 0, lambda: kernel("rotary", "rope_table")(
        grid_1d(rows * d // 2), (THREADS,), (positions, inv_freq, out, np.int32(rows), np.int32(d))))


ROPE_VECTOR_HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # rotary.cu's qk_norm_rope_bf16: d / 8 a power of two <= 32


def qk_norm_rope(qkv, qkv_bias, q_norm, k_norm, rope, heads, eps):
    """In place on qkv [rows, 3 * heads * D] bf16: its q and k columns get their bias, the per-head RMSNorm
    and the axial RoPE whose cos and sin `rope` holds (rope_table's [>= rows, D] float32, row r for row r);
    its v columns are left as they are (v's bias is folded past attention into the residual offsets:
    params.py)."""
    rows, d = qkv.shape[0], q_norm.shape[0]
    if not qkv.flags.c_contiguous or qkv.shape[1] != 3 * heads * d:
        raise ValueError(f"qk_norm_rope: qkv must be contiguous [rows, 3 x {heads} x {d}], got {qkv.shape} "
                         f"with strides {qkv.strides}")
    if rope.dtype != np.float32 or rope.ndim != 2 or rope.shape[0] < rows or rope.shape[1] != d \
            or not rope.flags.c_contiguous:
        raise ValueError(f"qk_norm_rope: rope must be rope_table's contiguous float32 [>= {rows}, {d}], got "
                         f"{rope.dtype} {rope.shape}")
    args = (qkv, qkv_bias, q_norm, k_norm, rope, np.int32(rows), np.int32(heads), np.int32(d), np.float32(eps))
    if d in ROPE_VECTOR_HEAD_DIMS:  # a thread per (row, head, 4 rotation pairs), a head's threads in one warp
        launch("qk norm + rope", 0, lambda: kernel("rotary", "qk_norm_rope_bf16")(
            grid_1d(rows * heads * d // 8), (THREADS,), args))
    else:  # a warp per (row, head)
        launch("qk norm + rope", 0, lambda: kernel("rotary", "qk_norm_rope_any_bf16")(
            grid_1d(rows * heads * 32), (THREADS,), args))


# -- cuda/activations.cu ---------------------------------------------------------------------------

def swiglu_clamp(gate_up, gate_bias, up_bias, out, limit, *, grid=None):
    """out [rows, I] = bf16(silu(min(g, L)) * clamp(u, -L, L)) with [g | u] = gate_up [rows, 2I] + biases
    (None: no bias). Any grid is correct (the kernel's loops stride over columns and rows); tests pass a
    small one to make both loops turn."""
    rows, inter = out.shape
    grid = grid or (cdiv(cdiv(inter, 8), THREADS), int(min(cdiv(rows, 4), 65535)))  # x: 8 columns a thread; y: 4 rows
    launch("swiglu clamp", 0, lambda: kernel("activations", "swiglu_clamp_bf16")(
        grid, (THREADS,), (gate_up, ptr_or_null(gate_bias), ptr_or_null(up_bias), out, np.int64(rows),
                          np.int32(inter), np.float32(limit))))


def add_bias_to_bf16(y, bias, out):
    """out = bf16(y + bias), y [rows, cols] fp32."""
    rows, cols = y.shape
    launch("bias -> bf16", 0, lambda: kernel("activations", "bias_to_bf16")(
        grid_1d(cdiv(rows * cols, 4)), (THREADS,), (y, bias, out, np.int64(rows), np.int32(cols))))


def cast_pixels(cast, rows, x, out):
    """out[:rows] = bf16(x[:rows]) if cast[0] != 0, else nothing: x [budget, cols] float32, out alike bf16;
    cast and rows int32 on the device (read there, so one CUDA graph serves every call of a budget)."""
    contiguous = x.flags.c_contiguous and out.flags.c_contiguous
    if x.shape != out.shape or x.dtype != np.float32 or x.ndim != 2 or not contiguous:
        raise ValueError(f"cast_pixels: contiguous float32 x and bf16 out of one 2-D shape expected, got {x.dtype} "
                         f"{x.shape} and {out.dtype} {out.shape}")
    launch("pixels f32 -> bf16", 0, lambda: kernel("activations", "pixels_to_bf16")(
        grid_1d(cdiv(x.size, 4)), (THREADS,), (cast, rows, x, out, np.int64(x.shape[1]))))


# -- cuda/pixels.cu --------------------------------------------------------------------------------

def _check_canvas(h, w, patch, merge, out, temporal, slot):
    """The patchify kernels' shapes: a canvas of whole merge x merge blocks of patches, out one row a patch,
    slot -1 or a frame of the row."""
    rows, width = (h // patch) * (w // patch), 3 * temporal * patch * patch
    if h % (patch * merge) or w % (patch * merge) or out.shape != (rows, width) or not out.flags.c_contiguous:
        raise ValueError(f"patchify: a {h}x{w} canvas in {patch}-pixel patches merged {merge}x{merge} fills a "
                         f"contiguous [{rows}, {width}] output; got {list(out.shape)}")
    if not -1 <= slot < temporal:
        raise ValueError(f"patchify: slot {slot} is not -1 (every frame) or a frame 0..{temporal - 1} of a row")


def patchify(canvas, value_table, out, temporal, patch, merge, slot=-1):
    """uint8 canvas [H, W, 3] -> out bf16 [H/patch * W/patch, 3 * temporal * patch^2], normalised by
    the table [3, 256] and laid out as the reference's pixel_values (merge x merge blocks); slot -1: the
    image in every frame of a row, slot t: frame t of a video's temporal group only."""
    h, w = canvas.shape[:2]
    _check_canvas(h, w, patch, merge, out, temporal, slot)
    launch("patchify", 0, lambda: kernel("pixels", "patchify_u8")(
        grid_1d((h // patch) * (w // patch) * 3 * patch * patch), (THREADS,),
        (canvas, value_table, out, np.int32(h), np.int32(w), np.int32(temporal), np.int32(patch), np.int32(merge),
         np.int32(slot))))


def _taps(tables, precision):
    """(first, count, weights) device int32 tables of a resample.Axis and its fractional bits -> the kernels'
    (first, count, weights, taps, precision) arguments (null tables: none)."""
    if not 1 <= precision <= 22:
        raise ValueError(f"resample: weights with {precision} fractional bits; Pillow's and ATen's have 1..22")
    first, count, weights = tables if tables is not None else (None, None, None)
    return (ptr_or_null(first), ptr_or_null(count), ptr_or_null(weights),
            np.int32(0 if weights is None else weights.shape[1]), np.int32(precision))


def resample_pass(src, tables, dst, along, precision=22):
    """One 8-bit BICUBIC pass: src uint8 [rows_in, W_in, 3] -> dst uint8 [rows, cols, 3] along columns (along
    1) or rows (along 0); tables = (first, count, weights) device int32 from resample.axis (Pillow's, 22
    fractional bits) or resample.aten_axis (ATen's: `precision` is its Axis's)."""
    rows, cols = dst.shape[:2]
    launch("resample pass", 0, lambda: kernel("pixels", "resample_pass_u8")(
        grid_1d(dst.size), (THREADS,), (src, dst, *_taps(tables, precision), np.int32(along),
                                        np.int32(src.shape[1]), np.int32(rows), np.int32(cols))))


def resample_patchify(src, tables, along, content, value_table, out, canvas, temporal, patch, merge, precision=22,
                      slot=-1):
    """The last resize pass (along 0 / 1; -1: src is already the content) fused with the zero pad to the
    canvas (H, W), the normalise and the patchify: out as patchify's for that canvas (slot too)."""
    h, w = canvas
    _check_canvas(h, w, patch, merge, out, temporal, slot)
    launch("resample + patchify", 0, lambda: kernel("pixels", "resample_patchify_u8")(
        grid_1d((h // patch) * (w // patch) * 3 * patch * patch), (THREADS,),
        (src, *_taps(tables, precision), np.int32(along), np.int32(src.shape[1]), np.int32(content[0]),
         np.int32(content[1]), value_table, out, np.int32(h), np.int32(w), np.int32(temporal), np.int32(patch),
         np.int32(merge), np.int32(slot))))


# -- cuda/attention_sm90.cu, attention_sm80.cu -----------------------------------------------------

def attention_kernel(variant: Variant):
    """The variant's compiled kernel on the current device, its shared-memory limit raised once."""
    return with_shared_memory(variant.module, variant.entry, variant.shared_bytes)


def flash_attention(variant: Variant, q, k, v, o, cu_seqlens, tile_seg, tile_q0, heads, flop=0):
    """o = softmax(q k^T / sqrt(D)) v within each segment of cu_seqlens [S + 1]; q, k, v bf16 [N, heads * D]
    with one row stride (a 16-byte multiple, 8 for sm80 at a D that 8 does not divide: the engine's are
    column blocks of the QKV GEMM's output), o contiguous bf16 [N, heads * D]; one CTA per (query tile,
    head), tiles from attention.tiles(cu, variant.rows)."""
    shape, ld = o.shape, q.strides[0]
    align = 8 if variant.arch == "sm80" and variant.head_dim % 8 else 16  # bytes a copy moves (sm80: 8 or 16)
    if (any(a.shape != shape or a.strides != (ld, 2) or a.dtype != o.dtype or a.data.ptr % align for a in (q, k, v))
            or ld % align or not o.flags.c_contiguous or shape[1] != heads * variant.head_dim):
        raise ValueError(f"flash_attention: q, k, v must share one shape and row stride and start {align}-byte "
                         f"aligned (the stride a multiple of {align} bytes), and o be contiguous, all "
                         f"[N, {heads} x {variant.head_dim}]: q{q.shape} strides {q.strides}, "
                         f"k{k.shape} {k.strides}, v{v.shape} {v.strides}, o{o.shape} {o.strides}")
    if len(tile_q0) == 0:
        return o
    scale_log2 = np.float32(math.log2(math.e) / math.sqrt(variant.head_dim))
    fn = attention_kernel(variant)
    args = (q, k, v, o, cu_seqlens, tile_seg, tile_q0, np.int32(heads), np.int32(ld // 2), scale_log2)
    if variant.arch == "sm90":  # its TMA producer reads Q, K and V through tensor maps
        args += (tensor_map(q, variant.rows), tensor_map(k, KEYS_PER_TILE_SM90), tensor_map(v, KEYS_PER_TILE_SM90))
    launch(f"flash attention ({variant.name})", flop, lambda: fn(
        (len(tile_q0), heads), (variant.threads,), args, shared_mem=variant.shared_bytes))
