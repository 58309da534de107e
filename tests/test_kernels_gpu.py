"""Each kernel in cuda/ against a NumPy float32 reference, with poisoned outputs and fresh random inputs."""

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

from tests.conftest import gpu_or_skip, module_rng

pytestmark = pytest.mark.gpu
cupy = gpu_or_skip()

from glmvit_cupy import KernelError  # noqa: E402
from glmvit_cupy.engine import gemm_sm90, ops  # noqa: E402
from glmvit_cupy.engine.attention import FIXED_OFFSET_LIMIT, VARIANTS, default_variants, tiles  # noqa: E402
from glmvit_cupy.engine.gemm import gemm  # noqa: E402
from glmvit_cupy.engine.kernels import kernel  # noqa: E402

BF = ml_dtypes.bfloat16
rng = module_rng(__name__)  # fresh inputs every run, seeded per test (conftest)
SM90 = cupy.cuda.Device().compute_capability == "90"


def bf(a):
    return np.asarray(a, np.float32).astype(BF)


def dev(a):
    return cupy.asarray(a)


def poison(shape, dtype=BF):
    return cupy.full(shape, np.nan, dtype=dtype)


def host(a):
    return cupy.asnumpy(a).astype(np.float32)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_registry_names_what_exists():
    with pytest.raises(KernelError, match="modules: .*norms"):
        kernel("nope", "x")
    with pytest.raises(KernelError, match="rmsnorm_residual"):
        kernel("norms", "nope")
    with pytest.raises(KernelError, match="template kernel is named with its arguments"):
        kernel("attention_sm80", "flash_fwd_sm80")  # a template without its arguments
    with pytest.raises(KernelError, match="compile failed"):
        kernel("attention_sm80", "flash_fwd_sm80<64, 3, 9>")  # arguments the template does not take


# 1024, 128 and 1000: a warp a row (cols % 4 == 0, <= 1,024; 1000 leaves lanes idle in the last float4
# column, and 1037 rows a block of 8 warps partly empty); 2048: a block a row, the row in registers
# (<= 16 x 256); 1022 and 5000: the block's scalar loop.
@pytest.mark.parametrize("rows,cols,with_offset", [(1037, 1024, True), (5, 128, False), (7, 1000, True),
                                                   (9, 2048, True), (3, 1022, True), (2, 5000, True)])
def test_rmsnorm_residual(rows, cols, with_offset):
    """out = rmsnorm(x + offset) * w, the offset (the biases not yet in x) large beside x so a missing or
    doubled one fails; x is only read."""
    x = rng.standard_normal((rows, cols), dtype=np.float32) * 3
    b, w = rng.standard_normal(cols).astype(np.float32) * 3, bf(1 + 0.1 * rng.standard_normal(cols))
    xd, out = dev(x), poison((rows, cols))
    ops.rmsnorm_residual(xd, dev(b) if with_offset else None, dev(w), out, 1e-5)
    xr = x + (b if with_offset else 0)
    ref = xr / np.sqrt((xr * xr).mean(1, keepdims=True) + 1e-5) * w.astype(np.float32)
    assert np.array_equal(host(xd), x)  # the residual stream is untouched
    assert rel(host(out), ref) < 5e-3


def test_rmsnorm_offset_must_be_float32_of_the_row_width():
    x, w, out = dev(rng.standard_normal((4, 64), dtype=np.float32)), dev(bf(np.ones(64))), poison((4, 64))
    for offset in (dev(bf(np.ones(64))), dev(np.ones(32, np.float32))):
        with pytest.raises(ValueError, match=r"offset: float32 \[64\] expected"):
            ops.rmsnorm_residual(x, offset, w, out, 1e-5)


@pytest.mark.parametrize("group,cols", [(4, 256), (9, 100), (1, 64), (16, 36)])  # merge 2, 3, 1, 4
def test_rmsnorm_im2col_layout(group, cols):
    rows = group * 37
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    b, w = rng.standard_normal(cols).astype(np.float32) * 3, bf(1 + 0.1 * rng.standard_normal(cols))
    xd, out = dev(x), poison((rows // group, cols * group))
    ops.rmsnorm_im2col(xd, dev(b), dev(w), out, 1e-5)
    xr = x + b
    n = xr / np.sqrt((xr * xr).mean(1, keepdims=True) + 1e-5) * w.astype(np.float32)
    # merged row m, column c * group + j  <-  patch row group * m + j, channel c
    ref = n.reshape(-1, group, cols).transpose(0, 2, 1).reshape(-1, group * cols)
    assert np.array_equal(host(xd), x)
    assert rel(host(out), ref) < 5e-3


def test_rmsnorm_im2col_refuses_an_output_of_another_shape():
    x, w = dev(rng.standard_normal((36, 64), dtype=np.float32)), dev(bf(np.ones(64)))
    for shape in ((9, 64 * 3), (5, 64 * 9), (7, 64 * 5), (36, 63)):  # rows / group wrong twice, 36 % 5, no group
        with pytest.raises(ValueError, match=r"rmsnorm_im2col: out must be a contiguous \[rows / m\^2"):
            ops.rmsnorm_im2col(x, None, w, poison(shape), 1e-5)


# 4096 and 1000: the row in registers (four and one float4 a thread, 1000 leaving threads idle); 4100
# (past 16 x 256) and 1022 (not a multiple of 4): the scalar loop; (4096, 1): y one float off 16 bytes.
@pytest.mark.parametrize("rows,cols,shift", [(301, 4096, 0), (7, 1000, 0), (5, 4100, 0), (3, 1022, 0), (4, 4096, 1)])
def test_layernorm_gelu(rows, cols, shift):
    y = rng.standard_normal((rows, cols), dtype=np.float32) * 2 + 0.5
    w, b = bf(1 + 0.1 * rng.standard_normal(cols)), bf(0.3 * rng.standard_normal(cols))
    out = poison((rows, cols))
    yd = dev(np.concatenate([np.zeros(shift, np.float32), y.ravel()]))[shift:].reshape(rows, cols)
    ops.layernorm_gelu(yd, dev(w), dev(b), out, 1e-5)
    mu = y.mean(1, keepdims=True)
    v = (y - mu) / np.sqrt(((y - mu) ** 2).mean(1, keepdims=True) + 1e-5) * w.astype(np.float32) + b.astype(np.float32)
    erf = np.vectorize(math.erf)
    ref = 0.5 * v * (1 + erf(v / math.sqrt(2)))
    assert rel(host(out), ref) < 5e-3


def rope_angles(pos, inv_freq):
    """float64 angles [rows, D/2] of the axial RoPE: pairs d < D/4 turn with h, the rest with w."""
    p, f = pos.astype(np.float64), inv_freq.astype(np.float64)
    return np.concatenate([p[:, :1] * f, p[:, 1:] * f], axis=1)


@pytest.mark.parametrize("d", [64, 32, 128, 36, 4])
def test_rope_table(d):
    """cos and sin of every rotation pair's angle, interleaved, against float64; rows past the count stay
    poisoned; too few positions are refused before any launch."""
    total, rows = 300, 257  # 257 rows x d/2 pairs: the last block partial
    pos = rng.integers(0, 230, (total, 2)).astype(np.int32)
    spatial = d // 2
    inv_freq = (np.float32(1) / np.power(np.float32(10000), np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    buf = cupy.full((rows + 2, d), np.nan, np.float32)
    ops.rope_table(dev(pos), dev(inv_freq), buf[:rows])
    got = cupy.asnumpy(buf)
    assert np.isnan(got[rows:]).all() and not np.isnan(got[:rows]).any()
    ang = rope_angles(pos[:rows], inv_freq)
    assert np.abs(got[:rows, 0::2] - np.cos(ang)).max() < 1e-4 and np.abs(got[:rows, 1::2] - np.sin(ang)).max() < 1e-4
    assert np.abs(ang).max() > 100  # large angles: the range reduction matters
    with pytest.raises(ValueError, match=r"positions must be contiguous int32 \[>= 257, 2\]"):
        ops.rope_table(dev(pos[:rows - 1]), dev(inv_freq), buf[:rows])


@pytest.mark.parametrize("heads,d", [(16, 64), (2, 64), (3, 64), (4, 32), (8, 128), (2, 8),  # 3 x 64 / 8 = 24 threads a row
                                     (3, 36), (2, 48), (5, 4), (2, 80), (1, 12), (1, 264)])  # qk_norm_rope_any_bf16
def test_qk_norm_rope(heads, d):
    """In place on the QKV rows: q and k columns become their biased, normed, rotated selves (against a
    float64 reference), v's columns keep their bits, and rows around the chunk stay poisoned. Head dims
    whose d / 8 is not a power of two up to 32 take the warp-per-head kernel (past 32 pairs a lane turns
    its loop more than once at 264)."""
    total, row0, rows = 700, 123, 401  # 401 rows: the last block is partial for every head count here; their
    # angles come from the positions starting at row0 of a longer array (the rows' own, sliced on the host)
    hd = heads * d
    qkv = bf(rng.standard_normal((rows, 3 * hd), dtype=np.float32))
    bias = bf(0.5 * rng.standard_normal(3 * hd))
    qn, kn = bf(1 + 0.2 * rng.standard_normal(d)), bf(1 + 0.2 * rng.standard_normal(d))
    pos = rng.integers(0, 230, (total, 2)).astype(np.int32)
    spatial = d // 2
    inv_freq = (np.float32(1) / np.power(np.float32(10000), np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    rope = cupy.empty((rows, d), np.float32)
    ops.rope_table(dev(pos[row0:]), dev(inv_freq), rope)
    buf = poison((rows + 6, 3 * hd))  # three poisoned rows either side: the kernel may not touch them
    buf[3:3 + rows] = dev(qkv)
    ops.qk_norm_rope(buf[3:3 + rows], dev(bias), dev(qn), dev(kn), rope, heads, 1e-5)
    assert np.isnan(host(buf[:3])).all() and np.isnan(host(buf[3 + rows:])).all()
    got = host(buf[3:3 + rows])
    t = (qkv.astype(np.float32) + bias.astype(np.float32)).reshape(rows, 3, heads, d)
    ang = rope_angles(pos[row0:row0 + rows], inv_freq)
    ang = np.concatenate([ang, ang], axis=1)[:, None, :]
    for part, nw in enumerate([qn, kn]):
        x = t[:, part].astype(np.float64)
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * nw.astype(np.float64)
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        ref = (x * np.cos(ang) + rot * np.sin(ang)).reshape(rows, hd)
        assert rel(got[:, part * hd:(part + 1) * hd], ref) < 5e-3
    v_bits = cupy.asnumpy(buf[3:3 + rows, 2 * hd:]).view(np.uint16)
    assert np.array_equal(v_bits, qkv[:, 2 * hd:].view(np.uint16))  # v: as the GEMM wrote it (its bias folded later)
    with pytest.raises(ValueError, match=r"rope must be rope_table's contiguous float32 \[>= 401, "):
        ops.qk_norm_rope(buf[3:3 + rows], dev(bias), dev(qn), dev(kn), rope[:rows - 1], heads, 1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("inter", [4096, 1020])  # eight columns a thread; the one-column path (1020 % 8 = 4)
# grid (1, 100): both strided loops turn (a block covers 8 x 256 = 2,048 < 4,096 columns, or 256 < 1,020;
# 100 < 333 rows); None: ops.swiglu_clamp, the model's launch (ceil(4096 / 8 / 256) = 2 blocks a row)
@pytest.mark.parametrize("grid", [(1, 100), None])
# misaligned: the output 8 bytes past a 16-byte boundary, so eight-column rows fall back to one column a thread
@pytest.mark.parametrize("misaligned", [False, True])
def test_swiglu_clamp_fires(with_bias, inter, grid, misaligned):
    rows, limit = 333, 10.0  # 333 = 4 x 83 + 1: the last group of four rows is partly past the end
    gu = bf(rng.standard_normal((rows, 2 * inter), dtype=np.float32) * 6).astype(np.float32)  # what the kernel reads
    bg, bu = bf(rng.standard_normal(inter)), bf(rng.standard_normal(inter))
    out = poison((rows * inter + 4,))[4:].reshape(rows, inter) if misaligned else poison((rows, inter))
    assert (out.data.ptr % 16 == 8) == misaligned
    ops.swiglu_clamp(dev(bf(gu)), dev(bg) if with_bias else None, dev(bu) if with_bias else None, out, limit, grid=grid)
    g, u = gu[:, :inter], gu[:, inter:]
    if with_bias:
        g, u = g + bg.astype(np.float32), u + bu.astype(np.float32)
    assert (g > limit).sum() > 0 and (np.abs(u) > limit).sum() > 0  # the clamp must matter here
    assert rel(host(out), clamped_swiglu(g, u, limit)) < 5e-3
    unclamped = g / (1 + np.exp(-g)) * u
    assert rel(host(out), unclamped) > 1e-2


def clamped_swiglu(g, u, limit):
    """silu(min(g, L)) * clamp(u, -L, L): the reference's activation, in the inputs' precision."""
    gc = np.minimum(g, limit)
    return gc / (1 + np.exp(-gc)) * np.clip(u, -limit, limit)


def swiglu_ref(a, w, bg, bu, limit):
    """float64 clamped SwiGLU of [g | u] = a @ w.T + biases (bf16 inputs as stored)."""
    gu = a.astype(np.float64) @ w.astype(np.float64).T
    inter = w.shape[0] // 2
    g, u = gu[:, :inter], gu[:, inter:]
    if bg is not None:
        g, u = g + bg.astype(np.float64), u + bu.astype(np.float64)
    return g, u, clamped_swiglu(g, u, limit)


# (333, 1024, 256): the model's K, a last row tile partly past M (333 = 2 x 128 + 77: the TMA's zero
# rows), one CTA a tile; (700, 192, 384) on 3 CTAs: K in 3 slices (fewer than the 4 slots), 18 tiles
# walked 6 a CTA, so the slots' phases wrap inside and across tiles, and A's rows 64 columns wider than
# K (a strided view, as the tensor map must describe); (64, 128, 128) on 1 CTA: one tile, 64 real rows.
# Both kernels: the ping-pong one's tiles are 64 columns wide (twice as many, 12 a CTA on 3 CTAs, its two
# warpgroups taking turns) and its ring 6 slots; on 1 CTA (64, 128, 128) is one tile each warpgroup.
@pytest.mark.skipif(not SM90, reason="GPU test: gemm_sm90.cu is sm_90a (Hopper) only")
@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "pingpong"])
@pytest.mark.parametrize("m,k,inter,with_bias,ctas", [(333, 1024, 256, True, None), (700, 192, 384, False, 3),
                                                     (64, 128, 128, True, 1)])
def test_gate_up_swiglu_fused(m, k, inter, with_bias, ctas, pingpong):
    limit = 10.0
    a_rows = bf(rng.standard_normal((m, k + (64 if ctas == 3 else 0)), dtype=np.float32))
    a = a_rows[:, :k]
    w = bf(rng.standard_normal((2 * inter, k), dtype=np.float32) * (6 / math.sqrt(k)))
    bg, bu = (bf(rng.standard_normal(inter)), bf(rng.standard_normal(inter))) if with_bias else (None, None)
    g, u, ref = swiglu_ref(a, w, bg, bu, limit)
    assert (g > limit).sum() > 0 and (np.abs(u) > limit).sum() > 0  # the clamp must matter here
    buf = poison((m + 3, inter))  # three poisoned rows past M: nothing may be written there
    out = buf[:m]
    a_dev, w_dev = dev(a_rows)[:, :k], dev(w)
    bg_dev, bu_dev = (None, None) if bg is None else (dev(bg), dev(bu))
    gemm_sm90.gate_up_swiglu(a_dev, w_dev, bg_dev, bu_dev, out, limit, ctas=ctas, pingpong=pingpong)
    got = host(buf)
    assert not np.isnan(got[:m]).any() and np.isnan(got[m:]).all()
    assert rel(got[:m], ref) < 4e-3  # the output's bf16 rounding (fp32 accumulation, one rounding)
    assert rel(got[:m], g / (1 + np.exp(-g)) * u) > 1e-2  # and the unclamped SwiGLU is far from it

    # Batch invariance: rows alone, or starting mid-tile, give the bits they had among the others.
    for r0, r1 in ((0, min(m, 50)), (m // 2 + 5, m)):
        part = poison((r1 - r0, inter))
        gemm_sm90.gate_up_swiglu(a_dev[r0:r1], w_dev, bg_dev, bu_dev, part, limit, ctas=ctas, pingpong=pingpong)
        assert np.array_equal(cupy.asnumpy(part).view(np.uint16), cupy.asnumpy(out[r0:r1]).view(np.uint16))
    # Either tile order (the launcher picks by operand size), and the other kernel (it picks by K and by
    # the waves its tiles fill, so by the rows launched), give the same bits.
    for order, pp in ((0, pingpong), (1, pingpong), (None, not pingpong)):
        again = poison((m, inter))
        gemm_sm90.gate_up_swiglu(a_dev, w_dev, bg_dev, bu_dev, again, limit, ctas=ctas, columns_fastest=order, pingpong=pp)
        assert np.array_equal(cupy.asnumpy(again).view(np.uint16), cupy.asnumpy(out).view(np.uint16))


@pytest.mark.skipif(not SM90, reason="GPU test: gemm_sm90.cu is sm_90a (Hopper) only")
def test_gate_up_swiglu_refuses_what_it_cannot_tile():
    a, out = cupy.zeros((8, 96), BF), cupy.zeros((8, 128), BF)
    with pytest.raises(ValueError, match="K = 96 must be a multiple of 64"):
        gemm_sm90.gate_up_swiglu(a, cupy.zeros((256, 96), BF), None, None, out, 10.0)
    with pytest.raises(ValueError, match=r"w must be \[2I, K\]"):
        gemm_sm90.gate_up_swiglu(cupy.zeros((8, 128), BF), cupy.zeros((200, 128), BF), None, None, out, 10.0)
    with pytest.raises(ValueError, match="16-byte boundaries"):
        gemm_sm90.gate_up_swiglu(cupy.zeros((8, 132), BF)[:, 4:], cupy.zeros((256, 128), BF), None, None, out, 10.0)


# (patch, merge, frames): the reference processor's, then other towers' (3 x 3 merges, none, 4 x 4)
PATCHINGS = [(14, 2, 2), (16, 3, 1), (8, 1, 3), (6, 4, 2)]


@pytest.mark.parametrize("patching", PATCHINGS)
@pytest.mark.parametrize("tokens_h,tokens_w", [(1, 1), (2, 3), (22, 19)])
def test_patchify_u8_is_bit_identical_to_the_host(patching, tokens_h, tokens_w):
    """The GPU's normalise + patchify of a uint8 canvas equals bf16 of the host's float32 patches."""
    import importlib

    pre = importlib.import_module("glmvit_cupy.preprocessing.image")
    pt = pre.Patching(*patching)
    canvas = rng.integers(0, 256, (tokens_h * pt.factor, tokens_w * pt.factor, 3), dtype=np.uint8)
    want = pre.normalise_patchify(canvas, pt).astype(BF)
    out = poison(want.shape)
    ops.patchify(dev(canvas), dev(pre.value_table()), out, pt.temporal_patch_size, pt.patch_size, pt.merge_size)
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), want.view(np.uint16))
    with pytest.raises(ValueError, match="patchify: a"):  # a canvas that is not whole tokens
        ops.patchify(dev(canvas[:-1]), dev(pre.value_table()), out, pt.temporal_patch_size, pt.patch_size,
                     pt.merge_size)


# 4096 columns, aligned: four elements a thread; 1022 columns, or arrays one element off their alignment,
# or a size not a multiple of 4: one a thread (and the cast's tail). Exact: the same single rounding.
@pytest.mark.parametrize("rows,cols,shift", [(129, 4096, 0), (7, 1022, 0), (5, 4096, 1), (3, 1177, 0)])
def test_bias_and_cast(rows, cols, shift):
    y = rng.standard_normal((rows, cols), dtype=np.float32)
    b = bf(rng.standard_normal(cols))
    yd = dev(np.concatenate([np.zeros(shift, np.float32), y.ravel()]))[shift:].reshape(rows, cols)
    out = poison(rows * cols + shift)[shift:].reshape(rows, cols)
    ops.add_bias_to_bf16(yd, dev(b), out)
    assert np.array_equal(cupy.asnumpy(out), (y + b.astype(np.float32)).astype(BF))


# The forward's pixel cast reads its flag and its row count on the device: cast set, all rows or the
# first few (the rows past them keep their poison); cast clear, nothing written. Aligned (four elements a
# thread) and shifted or odd-sized (one a thread) as above.
@pytest.mark.parametrize("rows,cols,shift", [(129, 1176, 0), (7, 1022, 0), (5, 1176, 1), (3, 1177, 0)])
def test_pixel_cast_reads_its_flag_and_row_count(rows, cols, shift):
    y = rng.standard_normal((rows, cols), dtype=np.float32)
    yd = dev(np.concatenate([np.zeros(shift, np.float32), y.ravel()]))[shift:].reshape(rows, cols)
    for cast, real in ((1, rows), (7, rows - 2), (1, 1), (0, rows)):
        out = poison(rows * cols + shift)[shift:].reshape(rows, cols)
        ops.cast_pixels(dev(np.array([cast], np.int32)), dev(np.array([real], np.int32)), yd, out)
        got = cupy.asnumpy(out)
        written = real if cast else 0
        assert np.array_equal(got[:written], y[:written].astype(BF)), (cast, real)
        assert np.isnan(got[written:].astype(np.float32)).all(), (cast, real)
    with pytest.raises(ValueError, match="cast_pixels"):
        ops.cast_pixels(dev(np.array([1], np.int32)), dev(np.array([rows], np.int32)), yd, poison((rows, cols + 1)))


# -- attention --------------------------------------------------------------------------------

def attention_ref(q, k, v, cu, rows):
    """float64 softmax(q k^T / sqrt(d)) v for the given query rows, inside their segments."""
    n, heads, d = q.shape
    out = np.zeros((len(rows), heads, d))
    seg = np.searchsorted(cu, rows, side="right") - 1
    for i, (r, s) in enumerate(zip(rows, seg)):
        a, b = cu[s], cu[s + 1]
        sc = np.einsum("hd,nhd->hn", q[r], k[a:b]) / math.sqrt(d)
        p = np.exp(sc - sc.max(1, keepdims=True))
        out[i] = np.einsum("hn,nhd->hd", p / p.sum(1, keepdims=True), v[a:b])
    return out


def run_attention(lengths, heads=16, d=64, variant=None, sample=None, packed=True):
    """packed: q, k and v are column blocks of one [N, 3 x heads x d] array (the QKV GEMM's output, as the
    engine passes them); else three contiguous arrays."""
    v = VARIANTS[variant or default_variants(d, cupy.cuda.Device().compute_capability)[0]]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(cu[-1])
    tile_seg, tile_q0 = tiles(cu, v.rows)
    q, k, val = (rng.standard_normal((n, heads, d), dtype=np.float32).astype(BF) for _ in range(3))
    q = (q.astype(np.float32) * 2).astype(BF)  # peakier softmax than unit scores
    o = poison((n, heads * d))
    hd = heads * d
    if packed:
        qkv = dev(np.concatenate([a.reshape(n, hd) for a in (q, k, val)], axis=1))
        args = qkv[:, :hd], qkv[:, hd:2 * hd], qkv[:, 2 * hd:]
    else:
        args = (dev(a.reshape(n, hd)) for a in (q, k, val))
    ops.flash_attention(v, *args, o, dev(cu), dev(tile_seg), dev(tile_q0), heads)
    got = cupy.asnumpy(o).astype(np.float32).reshape(n, heads, d)
    assert not np.isnan(got).any(), "some output element was never written"
    rows = np.arange(n) if sample is None or n <= sample else np.unique(
        np.concatenate([rng.choice(n, sample, replace=False), cu[:-1], cu[1:] - 1]))
    ref = attention_ref(*(a.astype(np.float64) for a in (q, k, val)), cu, rows)
    return rel(got[rows], ref)


D64 = [name for name, v in VARIANTS.items() if v.head_dim == 64 and (SM90 or v.arch != "sm90")]
# The measured error of every variant against float64: 2.3e-3 to 2.5e-3 on the Hopper kernels (bf16
# output rounding is most of it; a row's largest P is not exactly 1 in bf16, as the lazy running max
# and the fixed offset leave it), 1.9e-3 to 2.0e-3 on attention_sm80.cu's exact running max; the bar
# sits just above, so a real regression fails.
ATTN_TOL = 3e-3


@pytest.mark.parametrize("variant", D64)
@pytest.mark.parametrize("lengths", [[1], [7], [63], [64], [65], [1000], [1, 7, 63, 64, 65, 1000]])
def test_attention_small_segments(lengths, variant):
    assert run_attention(lengths, variant=variant) <= ATTN_TOL


@pytest.mark.parametrize("variant", D64)
def test_attention_separate_qkv_arrays(variant):
    """q, k, v as three contiguous arrays (row stride heads x d, not the QKV output's 3 x heads x d)."""
    assert run_attention([1, 63, 65, 1000], variant=variant, packed=False) <= ATTN_TOL


def test_attention_refuses_mismatched_layouts():
    v = VARIANTS[default_variants(64, cupy.cuda.Device().compute_capability)[0]]
    cu, seg, q0 = (cupy.zeros(2, np.int32) for _ in range(3))
    qkv, o = cupy.zeros((8, 3 * 1024), BF), cupy.zeros((8, 1024), BF)
    with pytest.raises(ValueError, match="share one shape and row stride"):
        ops.flash_attention(v, qkv[:, :1024], cupy.zeros((8, 1024), BF), qkv[:, 2048:], o, cu, seg, q0, 16)
    with pytest.raises(ValueError, match=r"o be contiguous, all \[N, 16 x 64\]"):
        ops.flash_attention(v, qkv[:, :1024], qkv[:, 1024:2048], qkv[:, 2048:], qkv[:, :1024], cu, seg, q0, 16)


@pytest.mark.parametrize("d", [4, 12, 36, 48, 80, 96, 256])
def test_attention_any_head_dim(d):
    """attention_sm80.cu at head dims other than 32 / 64 / 128: its MMAs run over d rounded up to 16 with
    zero columns past d (8-byte copies where 8 does not divide d), and only d columns are stored (the
    poisoned output's other heads' columns would show NaN otherwise), packed and separate q, k, v."""
    lengths = [1, 63, 65, 300]
    for packed in (True, False):
        assert run_attention(lengths, heads=3, d=d, packed=packed) <= ATTN_TOL, (d, packed)
    v = VARIANTS[f"sm80_d{d}"]
    cu, seg, q0 = (cupy.zeros(2, np.int32) for _ in range(3))
    qkv, o = cupy.zeros((8, 3 * 3 * d + 1), BF), cupy.zeros((8, 3 * d), BF)
    with pytest.raises(ValueError, match=rf"start {8 if d % 8 else 16}-byte aligned"):  # a row stride of odd bytes
        ops.flash_attention(v, qkv[:, :3 * d], qkv[:, 3 * d:6 * d], qkv[:, 6 * d:9 * d], o, cu, seg, q0, 3)


@pytest.mark.parametrize("variant", D64)
def test_attention_16_segments_one_launch(variant):
    lengths = rng.integers(1, 700, 16).tolist()
    assert run_attention(lengths, sample=800, variant=variant) <= ATTN_TOL


@pytest.mark.parametrize("variant", D64)
@pytest.mark.parametrize("n", [4096, 32000])
def test_attention_long(n, variant):
    assert run_attention([n], heads=2 if n > 4096 else 16, sample=256, variant=variant) <= ATTN_TOL


@pytest.mark.parametrize("variant", D64)
def test_attention_idle_tiles_write_nothing(variant):
    """A token budget's graph launches more query tiles than a batch has: the surplus ones (segment -1)
    must return at once, write nothing (rows past the batch stay poisoned) and change no real bit."""
    v, heads = VARIANTS[variant], 4
    cu = np.array([0, 300, 317, 767], np.int32)
    q, k, val = (dev(rng.standard_normal((1024, heads * 64), dtype=np.float32).astype(BF) * 2) for _ in range(3))
    seg, q0 = tiles(cu, v.rows)
    outs = []
    for pad in (0, 29):
        o = poison((1024, heads * 64))
        ops.flash_attention(v, q, k, val, o, dev(cu), dev(np.concatenate([seg, np.full(pad, -1, np.int32)])),
                            dev(np.concatenate([q0, np.zeros(pad, np.int32)])), heads)
        outs.append(cupy.asnumpy(o).view(np.uint16))
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[1][767:], cupy.asnumpy(poison((257, heads * 64))).view(np.uint16))
    assert not np.isnan(outs[1][:767].view(BF).astype(np.float32)).any()


@pytest.mark.parametrize("variant", [name for name in D64 if not VARIANTS[name].online])
def test_attention_fixed_offset_at_its_limit(variant):
    """The variants without a running max at the edge of what a model may give them: scores 0.99 x
    FIXED_OFFSET_LIMIT (log2 units) above 0 (keys along q) and below (keys against it) among random
    ones, and a segment whose every score is that far below (every P ~2^-63: a row sum far below 1).
    No overflow, no underflow to 0 / 0, and within the usual bar of float64."""
    v, heads, d, lengths = VARIANTS[variant], 4, 64, [300, 130]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(cu[-1])
    u = rng.standard_normal((heads, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    alpha = 0.99 * FIXED_OFFSET_LIMIT / math.log2(math.e)  # q . (8 u) * log2(e) / 8 = +-0.99 x the limit
    q = np.broadcast_to(alpha * u, (n, heads, d)) * rng.uniform(0.5, 1.0, (n, 1, 1))
    k = rng.standard_normal((n, heads, d))
    k[rng.choice(300, 20, replace=False)] = 8 * u  # along q
    k[rng.choice(300, 20, replace=False)] = -8 * u  # against it
    k[300:] = -8 * u  # segment 2: every score at the bottom
    q, k, val = q.astype(BF), k.astype(BF), rng.standard_normal((n, heads, d)).astype(BF)
    s_log2 = np.einsum("nhd,mhd->hnm", q[:300].astype(np.float64), k[:300].astype(np.float64)) * math.log2(math.e) / 8
    assert 0.95 * FIXED_OFFSET_LIMIT < np.abs(s_log2).max() <= FIXED_OFFSET_LIMIT  # the edge is reached
    tile_seg, tile_q0 = tiles(cu, v.rows)
    o = poison((n, heads * d))
    ops.flash_attention(v, dev(q.reshape(n, -1)), dev(k.reshape(n, -1)), dev(val.reshape(n, -1)), o, dev(cu),
                        dev(tile_seg), dev(tile_q0), heads)
    got = cupy.asnumpy(o).astype(np.float32).reshape(n, heads, d)
    assert np.isfinite(got).all()
    ref = attention_ref(*(a.astype(np.float64) for a in (q, k, val)), cu, np.arange(n))
    assert rel(got, ref) <= ATTN_TOL


@pytest.mark.parametrize("variant", D64)
def test_attention_reads_nothing_past_its_segment(variant):
    """Tiles that straddle a segment's end see other rows: the next segment's, or a token budget's stale
    padding, which may hold anything. NaN there (q, k and v) must change no bit of any real row: keys
    past the end are masked, and V past it must come as zeros (0 * NaN is NaN). 300 and 317 end
    segments mid-tile for 64-key tiles and for every query-tile height."""
    v, heads, n = VARIANTS[variant], 4, 1024
    cu = np.array([0, 300, 317, 767], np.int32)
    seg, q0 = tiles(cu, v.rows)
    base = [rng.standard_normal((n, heads * 64), dtype=np.float32).astype(BF) * 2 for _ in range(3)]
    outs = []
    for poisoned in (None, slice(767, n), slice(300, 317)):
        arrays = [a.copy() for a in base]
        if poisoned is not None:
            for a in arrays:
                a[poisoned] = np.nan
        o = poison((n, heads * 64))
        ops.flash_attention(v, *(dev(a) for a in arrays), o, dev(cu), dev(seg), dev(q0), heads)
        outs.append(cupy.asnumpy(o).view(np.uint16))
    keep = np.r_[0:300, 317:767]  # the rows whose segments hold no NaN
    assert np.array_equal(outs[0][:767], outs[1][:767])
    assert np.array_equal(outs[0][keep], outs[2][keep])
    assert not np.isnan(outs[0][:767].view(BF).astype(np.float32)).any()


def growing_scores(n, heads, jumps, d=64):
    """q, k, v (bf16, [n, heads, d]) whose scores grow along the keys: every query row is a_row x 8 u (u a
    unit vector per head, a_row in [0.5, 1]), keys are random (scores within a few log2 units of 0) but
    for 8 keys in each 64-key tile named in `jumps` ({tile: log2 units}), which lie along u, so a row's
    scores there reach a_row x that many log2 units above the rest."""
    u = rng.standard_normal((heads, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    q = 8 * u * rng.uniform(0.5, 1.0, (n, 1, 1))
    k = rng.standard_normal((n, heads, d))
    for tile, log2_units in jumps.items():
        keys = tile * 64 + rng.choice(64, 8, replace=False)
        k[keys[keys < n]] = log2_units / math.log2(math.e) * u  # q . k * log2(e) / 8 = a_row x log2_units
    return q.astype(BF), k.astype(BF), rng.standard_normal((n, heads, d)).astype(BF)


def attend(name, q, k, val, cu, heads):
    v = VARIANTS[name] if isinstance(name, str) else name
    n = q.shape[0]
    tile_seg, tile_q0 = tiles(cu, v.rows)
    o = poison((n, heads * q.shape[2]))
    ops.flash_attention(v, *(dev(a.reshape(n, -1)) for a in (q, k, val)), o, dev(cu), dev(tile_seg),
                        dev(tile_q0), heads)
    return cupy.asnumpy(o)


@pytest.mark.parametrize("variant", [name for name in D64 if VARIANTS[name].online])
def test_attention_online_follows_scores_that_grow(variant):
    """The running max as the Hopper kernels keep it (softmax.cuh softmax_tile_lazy): offsets stay put
    until a row's scores grow past them by 16 log2 units; then the warp's exact step moves them. Scores
    that jump 20, 45 and 30 log2 units in later tiles (the offsets lifted from P, lift_offsets) and 300
    (P = inf: the warp's S again by mma.sync, warp_qk; a tile left lazy would give rows of NaN), in a
    segment and in one that starts mid-warpgroup; against float64."""
    heads, lengths = 4, [1300, 450]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, val = growing_scores(int(cu[-1]), heads, {3: 20.0, 9: 45.0, 17: 300.0, 23: 30.0, 26: 300.0})
    got = attend(variant, q, k, val, cu, heads).astype(np.float32).reshape(q.shape)
    assert np.isfinite(got).all()
    ref = attention_ref(*(a.astype(np.float64) for a in (q, k, val)), cu, np.arange(int(cu[-1])))
    assert rel(got, ref) <= ATTN_TOL


@pytest.mark.skipif(not SM90, reason="GPU test: the lazy softmax is the sm_90a kernels'")
@pytest.mark.parametrize("variant", [name for name in D64 if VARIANTS[name].arch == "sm90" and VARIANTS[name].online])
def test_attention_online_tiles_past_the_first_are_lazy(variant):
    """Shows the lazy step runs: where every score of a segment's first tile is 0 (its keys are 0),
    the running max starts at 0, and while later scores stay within 16 log2 units a lazy tile computes
    exactly what the kernel without a running max does, bit for bit. An exact step on any later tile
    would move the offset to that tile's positive max and change the bits."""
    heads, lengths = 4, [700, 1300]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(cu[-1])
    q, k, val = (rng.standard_normal((n, heads, 64)) for _ in range(3))
    for s0 in cu[:-1]:
        k[s0:s0 + 64] = 0.0
    q, k, val = (0.7 * q).astype(BF), k.astype(BF), val.astype(BF)
    s_log2 = np.einsum("nhd,mhd->hnm", q[:700].astype(np.float64), k[:700].astype(np.float64)) * math.log2(math.e) / 8
    assert 2.0 < s_log2.max() < 12.0  # later tiles rise above the first's 0, within the lazy limit
    lazy = attend(variant, q, k, val, cu, heads)
    assert not np.isnan(lazy.astype(np.float32)).any()
    assert np.array_equal(lazy.view(np.uint16), attend(variant + "_fixed", q, k, val, cu, heads).view(np.uint16))


@pytest.mark.skipif(not SM90, reason="GPU test: the lazy softmax is the sm_90a kernels'")
@pytest.mark.parametrize("variant", [name for name in D64 if VARIANTS[name].arch == "sm90" and VARIANTS[name].online])
def test_attention_online_votes_per_warp(variant):
    """Each warp votes on its own 16 rows: where one warp of every warpgroup must take the exact step
    and the other three need not, those three stay lazy. As in the test above, the segments' first
    tiles have zero keys, so a lazy row equals the kernel without a running max bit for bit; the warp
    whose q is large (scores 20+ log2 units above the first tile's) moves its offsets and matches
    float64. A vote per warpgroup would drag the lazy rows into the exact step and change their bits."""
    heads, lengths = 4, [700, 1300]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(cu[-1])
    q, k, val = (rng.standard_normal((n, heads, 64)) for _ in range(3))
    rows = np.arange(n) - np.repeat(cu[:-1], lengths)  # a row's place in its segment
    sharp = (rows // 16) % 4 == 1                      # the second warp of every warpgroup
    for s0 in cu[:-1]:
        k[s0:s0 + 64] = 0.0
    q = np.where(sharp[:, None, None], 6.0, 0.7) * q
    q, k, val = q.astype(BF), k.astype(BF), val.astype(BF)
    s_log2 = np.einsum("nhd,mhd->hnm", q[:700].astype(np.float64), k[:700].astype(np.float64)) * math.log2(math.e) / 8
    assert 2.0 < s_log2[:, ~sharp[:700]].max() < 12.0 and s_log2[:, sharp[:700]].max() > 20.0
    got = attend(variant, q, k, val, cu, heads)
    assert np.isfinite(got.astype(np.float32)).all()
    fixed = attend(variant + "_fixed", q, k, val, cu, heads)
    assert np.array_equal(got[~sharp].view(np.uint16), fixed[~sharp].view(np.uint16))
    ref = attention_ref(*(a.astype(np.float64) for a in (q, k, val)), cu, np.flatnonzero(sharp))
    assert rel(got.astype(np.float32).reshape(q.shape)[sharp], ref) <= ATTN_TOL


@pytest.mark.parametrize("log2_units,low", [(100.0, 0.5), (300.0, 0.2)])
@pytest.mark.parametrize("variant", [name for name in D64 if VARIANTS[name].online])
def test_attention_one_dominant_key_gives_its_v_exactly(variant, log2_units, low):
    """A row that one key dominates by 40+ log2 units must come out as that key's v, bit for bit: the
    exact step moves the row's offset to the key's score, so its P is 1, which bf16 holds exactly (an
    offset moved by a power of two would leave that P in [1, 2), which bf16 rounds up to 2^-9 off). The
    key lies in a later, full tile of a 700-row segment and in the last, partial tile of a 200-row one,
    with NaN in every row past that segment. Its score is `log2_units` above 0 for even rows and `low`
    of that for odd ones, so every warp mixes both: 100 / 50 lifts the offsets from P (lift_offsets);
    300 / 60 runs the warp's S again (warp_qk) for all its rows."""
    heads, lengths, n = 4, [700, 200], 960
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    keys = [5 * 64 + 17, 700 + 3 * 64 + 3]  # tile 5 of the first segment; the second's last, 8-key tile
    u = rng.standard_normal((heads, 64))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    q = 8 * u * np.where(np.arange(n) % 2, low, 1.0)[:, None, None]
    k, val = rng.standard_normal((n, heads, 64)), rng.standard_normal((n, heads, 64))
    k[keys] = log2_units / math.log2(math.e) * u  # q . k * log2(e) / 8 = log2_units for an even row
    q, k, val = (a.astype(BF) for a in (q, k, val))
    for a in (q, k, val):
        a[cu[-1]:] = np.nan
    got = attend(variant, q, k, val, cu, heads).view(np.uint16).reshape(n, heads, 64)
    for a, b, key in zip(cu[:-1], cu[1:], keys):
        assert np.array_equal(got[a:b], np.broadcast_to(val[key].view(np.uint16), (b - a, heads, 64))), (a, b)


@pytest.mark.skipif(not SM90, reason="GPU test: the per-shape choice is between sm_90a kernels")
def test_default_variants_agree_bit_for_bit():
    """The model picks a variant per input shape, so an image batched with others may run on a
    different kernel than alone: the defaults must give the same bits, or batching would change an
    embedding. Segments of 700 and 1,300 rows: partial last query tiles of 256 and of 128 rows, and a
    partial last 64-key tile in each."""
    n, heads = 2000, 16
    cu = np.array([0, 700, n], np.int32)
    random = tuple(rng.standard_normal((n, heads, 64), dtype=np.float32).astype(BF) * 2 for _ in range(3))
    growing = growing_scores(n, heads, {2: 20.0, 7: 40.0, 14: 300.0, 25: 25.0})  # the lazy softmax's exact steps
    for names in (default_variants(64, "90"), default_variants(64, "90", 0.0, 0.0)):  # online; no running max
        assert len(names) > 1
        for qkv in (random, growing) if VARIANTS[names[0]].online else (random,):
            outs = [attend(name, *qkv, cu, heads).view(np.uint16) for name in names]
            assert all(np.array_equal(outs[0], x) for x in outs[1:]), names


@pytest.mark.skipif(not SM90, reason="GPU test: the intra-warpgroup overlap is the sm_90a kernels'")
@pytest.mark.parametrize("variant", [name for name, v in VARIANTS.items() if v.overlap])
def test_attention_overlap_keeps_every_bit(variant):
    """The overlapped kernels (a tile's softmax beside the last tile's P V) run every row's operations in
    the order the plain template does, so they give its bits: on segments of one tile (1, 64 rows), a
    partial second tile (65), partial query tiles (700, 1,300), and for the running max on scores whose
    exact steps fire."""
    v, heads = VARIANTS[variant], 16
    plain = dataclasses.replace(v, overlap=False)
    assert plain.entry != v.entry
    cu = np.concatenate([[0], np.cumsum([1, 64, 65, 700, 1300])]).astype(np.int32)
    n = int(cu[-1])
    random = tuple(rng.standard_normal((n, heads, 64), dtype=np.float32).astype(BF) * 2 for _ in range(3))
    growing = growing_scores(n, heads, {2: 20.0, 9: 45.0, 14: 300.0, 25: 25.0})
    for qkv in (random, growing) if v.online else (random,):
        got, want = (attend(x, *qkv, cu, heads) for x in (v, plain))
        assert np.isfinite(got.astype(np.float32)).all()
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("d", [32, 128])
def test_attention_other_head_dims(d):
    assert run_attention([5, 130, 64, 300], heads=4, d=d) <= ATTN_TOL


# -- GEMM ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 7, 1003, 4097])
@pytest.mark.parametrize("n,k", [(3072, 1024), (1024, 4096), (20480, 4096), (1024, 1176)])
def test_gemm_against_numpy(m, n, k):
    if m * n * k > 2e10:
        m = 1003
    a, w = bf(rng.standard_normal((m, k))), bf(rng.standard_normal((n, k)) / math.sqrt(k))
    ref = a.astype(np.float32) @ w.astype(np.float32).T
    out32 = cupy.full((m, n), np.nan, np.float32)
    gemm(dev(a), dev(w), out32)
    assert rel(cupy.asnumpy(out32), ref) < 1e-5
    out16 = poison((m, n))
    gemm(dev(a), dev(w), out16)
    assert rel(host(out16), ref) < 5e-3
    # beta = 1 accumulates into a float32 output: the residual-stream path.
    base = rng.standard_normal((m, n), dtype=np.float32)
    acc = dev(base)
    gemm(dev(a), dev(w), acc, beta=1.0)
    assert rel(cupy.asnumpy(acc), base + ref) < 1e-5


def test_gemm_on_own_handle_is_capturable_and_equal():
    """The model's path: a cuBLAS handle bound to its own stream, called through ctypes (so a CUDA
    graph can capture it), gives the bits CuPy's handle gives; a captured GEMM replays with new data."""
    from glmvit_cupy.engine.gemm import Handle

    m, n, k = 1003, 3072, 1024
    stream = cupy.cuda.Stream(non_blocking=True)
    h = Handle(stream)
    assert h.capturable, "cublasGemmEx was not found in the loaded libcublas"
    a, w = dev(bf(rng.standard_normal((m, k)))), dev(bf(rng.standard_normal((n, k)) / math.sqrt(k)))
    want = cupy.full((m, n), np.nan, np.float32)
    gemm(a, w, want)
    with stream:
        got = cupy.full((m, n), np.nan, np.float32)
        gemm(a, w, got, handle=h)
        stream.synchronize()
        assert cupy.array_equal(got, want)
        stream.begin_capture()
        gemm(a, w, got, beta=1.0, handle=h)
        graph = stream.end_capture()
        a[...] = dev(bf(rng.standard_normal((m, k))))  # new data after capture: the replay must read it
        ref = cupy.asnumpy(got) + cupy.asnumpy(a).astype(np.float32) @ cupy.asnumpy(w).astype(np.float32).T
        graph.launch(stream)
        stream.synchronize()
    assert rel(cupy.asnumpy(got), ref) < 1e-5


def test_the_tuning_probe_tells_another_summation_order_apart():
    """A candidate that sums K in another order must fail gemm_tune's bit check. On random inputs a small
    bf16 GEMM summed in two groups (K's first third, then the rest: another grouping of the same products)
    often gives the one-shot sum's bits exactly; on gemm_tune.cancelling's inputs most outputs differ. The
    groups' sum goes through float32, so it is the grouping that differs, not the rounding."""
    from glmvit_cupy.engine import gemm_tune

    m, n, k = 96, 100, 96  # the merger's down_proj of a test tower: 9,600 bf16 outputs

    def differ(a, w):
        one = poison((m, n))
        gemm(a, w, one)
        groups = cupy.zeros((m, n), np.float32)
        gemm(a[:, : k // 3], w[:, : k // 3], groups, 1.0)
        gemm(a[:, k // 3:], w[:, k // 3:], groups, 1.0)
        return int((one.view(np.uint16) != groups.astype(BF).view(np.uint16)).sum())

    a, w = dev(bf(rng.standard_normal((m, k)))), dev(bf(rng.standard_normal((n, k)) / math.sqrt(k)))
    ca, cw = gemm_tune.cancelling(a, w)
    assert host(ca)[0, 0] == host(ca)[0, k - 1] == 4096 and host(cw)[0, k - 1] == -4096
    on_random, on_cancelling = differ(a, w), differ(ca, cw)
    print(f"outputs that differ with K summed in two groups: random {on_random}, cancelling {on_cancelling} "
          f"of {m * n}")
    assert on_cancelling > m * n // 4 and on_cancelling > 20 * max(on_random, 1)


def test_tuned_cublaslt_gemms_give_the_default_bits_at_every_row_count():
    """gemm_tune keeps only cublasLt algorithms with the bits of cublasGemmEx's default pick, and a row count
    between the tuned ones runs the nearest one's algorithm: so at row counts that were not tuned, with
    fresh inputs, the tuned handle must still give GemmEx's bits (else an image's embedding would depend
    on the budget it lands in). min_gain=-inf keeps a candidate even where it is slower, so the Lt path
    runs whatever the timings; a captured call replays it; a misaligned output falls back to GemmEx."""
    from glmvit_cupy.engine import gemm_tune
    from glmvit_cupy.engine.gemm import Handle

    stream = cupy.cuda.Stream(non_blocking=True)
    plain, tuned = Handle(stream), Handle(stream)
    shapes = [("attn.proj", 1024, 1024, np.float32, True, 4096), ("attn.qkv", 3072, 1024, BF, False, 4096),
              ("mlp.down_proj", 1024, 4096, np.float32, True, 4096)]
    report = gemm_tune.tune(tuned, shapes, min_gain=-math.inf, rounds=1, reps=2)
    assert [(r["gemm"], r["rows"]) for r in report] == [(s[0], m) for s in shapes for m in (256, 1024, 4096)]
    assert all(r["same_bits"] > 0 and r["chosen"] is not None for r in report), report
    fell_back = []
    for m in (1, 256, 700, 1024, 2500, 2560, 4096, 9000):
        for _, n, k, dtype, acc, _ in shapes:
            if not tuned.lt_choice(m, n, k, k, k, n, np.dtype(dtype), 1.0 if acc else 0.0):
                fell_back.append((m, n, k))  # the heuristic offers no tuned algorithm here: GemmEx runs it
            a, w = dev(bf(rng.standard_normal((m, k)))), dev(bf(rng.standard_normal((n, k)) / math.sqrt(k)))
            base = dev(rng.standard_normal((m, n), dtype=np.float32).astype(dtype)) if acc else poison((m, n), dtype)
            want, got = base.copy(), base.copy()
            # The copies run on the default stream, which a non-blocking stream does not wait for: GEMMs launched
            # on it at once read C before the copy of 9000 rows had written it (alone, on an H100, every run).
            cupy.cuda.get_current_stream().synchronize()
            with stream:
                gemm(a, w, want, 1.0 if acc else 0.0, handle=plain)
                gemm(a, w, got, 1.0 if acc else 0.0, handle=tuned)
                stream.synchronize()
            assert cupy.array_equal(got.view(np.uint8), want.view(np.uint8)), (m, n, k)
            ref = host(a) @ host(w).T + (host(base) if acc else 0)
            assert rel(host(got), ref) < (1e-5 if dtype == np.float32 else 5e-3)
    print("GemmEx instead of the tuned algorithm at", fell_back)
    assert not [f for f in fell_back if f[0] in (256, 1024, 4096)]  # the tuned row counts run what was tuned
    m, n, k = 4096, 1024, 1024  # a tuned row count: the Lt path, captured and replayed
    assert tuned.lt_choice(m, n, k, k, k, n, np.dtype(np.float32), 1.0)
    a, w = dev(bf(rng.standard_normal((m, k)))), dev(bf(rng.standard_normal((n, k)) / math.sqrt(k)))
    got = dev(rng.standard_normal((m, n), dtype=np.float32))
    ref = host(got) + host(a) @ host(w).T
    with stream:
        stream.begin_capture()
        gemm(a, w, got, 1.0, handle=tuned)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert rel(cupy.asnumpy(got), ref) < 1e-5
    buf = cupy.empty(m * n + 16, np.float32)  # 64 bytes past a 256-byte boundary: GemmEx's path instead
    odd = cupy.ndarray((m, n), np.float32, memptr=buf.data + 64)
    odd[...] = dev(rng.standard_normal((m, n), dtype=np.float32))
    want = odd.copy()
    with stream:
        gemm(a, w, odd, 1.0, handle=tuned)
        gemm(a, w, want, 1.0, handle=plain)
        stream.synchronize()
    assert cupy.array_equal(odd, want)


def test_gemm_rejects_bad_arguments():
    a = cupy.zeros((4, 8), BF)
    with pytest.raises(ValueError, match="do not agree"):
        gemm(a, cupy.zeros((3, 9), BF), cupy.zeros((4, 3), np.float32))
    with pytest.raises(TypeError, match="bfloat16"):
        gemm(a.astype(np.float32), cupy.zeros((3, 8), BF), cupy.zeros((4, 3), np.float32))


@pytest.mark.parametrize("patching,pairs", [(PATCHINGS[0], 300)] + [(p, 40) for p in PATCHINGS[1:]])
def test_resize_on_the_gpu_equals_pillow_bit_for_bit(patching, pairs):
    """The Stager's GPU resize (both passes, either order, pad, normalise, patchify) against Pillow's
    BICUBIC + the host's patchify, on random size pairs (300 for the reference patching, 40 for others):
    bf16 bits equal, outputs poisoned first."""
    import importlib

    pre = importlib.import_module("glmvit_cupy.preprocessing.image")
    staging = importlib.import_module("glmvit_cupy.engine.staging")
    from PIL import Image

    pt = pre.Patching(*patching)
    kw = dict(factor=pt.factor, temporal_factor=pt.temporal_patch_size)
    stager = staging.Stager(dev(pre.value_table()), pt.temporal_patch_size, pt.patch_size, pt.merge_size)
    orders = set()
    for i in range(pairs):
        h, w = (int(v) for v in rng.integers(1, 400, 2))
        if i % 5 == 0:
            h, w = int(rng.integers(600, 2000)), int(rng.integers(1, 40))  # extreme aspect
        if i % 7 == 0:
            h = 1
        canvas = pre.smart_resize(h, w, max_image_tokens=int(rng.integers(4, 300)), **kw)
        content = pre.content_size(h, w, canvas, **kw)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        img[::2] = np.where(img[::2] > 127, 255, 0)
        resized = np.asarray(Image.fromarray(img).resize(content[::-1], resample=Image.Resampling.BICUBIC)) \
            if content != (h, w) else img
        padded = np.zeros((*canvas, 3), np.uint8)
        padded[:content[0], :content[1]] = resized
        want = pre.normalise_patchify(padded, pt).astype(BF)
        out = poison(want.shape)
        grid = (1, canvas[0] // pt.patch_size, canvas[1] // pt.patch_size)
        stager.images([(img, grid, {"content": content})], out)
        got = cupy.asnumpy(out)
        bad = int((got.view(np.uint16) != want.view(np.uint16)).sum())
        assert bad == 0, f"{h}x{w} -> content {content}, canvas {canvas}: {bad} of {got.size} values differ"
        if content != (h, w):
            from glmvit_cupy.preprocessing import resample
            p = resample.pillow_tables(h, w, *content)
            orders.add((p.vertical_first, p.horizontal is not None, p.vertical is not None))
    assert len(orders) >= (3 if pairs >= 300 else 2)  # horizontal only, vertical only and both passes ran


@pytest.mark.parametrize("patching,videos", [(PATCHINGS[0], 60)] + [(p, 12) for p in PATCHINGS[1:]])
def test_video_frames_on_the_gpu_equal_the_host_bit_for_bit(patching, videos):
    """The Stager's frame groups (video.frame_groups: ATen's resize on the GPU, pad, the video table, each
    frame into its own slot, the last frame repeated) against the host's video_canvases + normalise_patchify:
    bf16 bits equal, outputs poisoned first; no resize, either pass alone and both ran."""
    import importlib

    video = importlib.import_module("glmvit_cupy.preprocessing.video")
    pre = importlib.import_module("glmvit_cupy.preprocessing.image")
    staging = importlib.import_module("glmvit_cupy.engine.staging")
    from glmvit_cupy.preprocessing import resample

    pt = pre.Patching(*patching)
    T, f = pt.temporal_patch_size, pt.factor
    stager = staging.Stager(dev(pre.value_table()), T, pt.patch_size, pt.merge_size, dev(video.value_table()))
    kinds = set()
    for i in range(videos):
        h, w = (int(v) for v in rng.integers(1, 300, 2))
        if i % 4 == 1:  # a 1-pixel side keeps its size as the other scales: one pass only
            h, w = 1, int(rng.integers(30, 3000))
        if i % 4 == 2:
            h, w = int(rng.integers(30, 3000)), 1
        limit = int(rng.integers(8, 900))
        if i % 8 == 3:  # no resize at all: whole tokens, within the limits
            h, w, limit = f * int(rng.integers(4, 8)), f * int(rng.integers(4, 8)), 900
        n = int(rng.integers(1, 6))
        frames = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
        frames[:, ::2] = np.where(frames[:, ::2] > 127, 255, 0)  # hard edges: the lobes overshoot and clip
        planned = video.plan_video(frames, i, sample=False, patching=pt, max_image_tokens=limit)
        want = video.video_pixels([planned], pt)[0].astype(BF)
        out = poison(want.shape)
        stager.images(video.frame_groups(*planned, T), out)
        got = cupy.asnumpy(out)
        bad = int((got.view(np.uint16) != want.view(np.uint16)).sum())
        content = planned[2]["content"]
        assert bad == 0, f"{n} frames of {h}x{w} -> content {content}, canvas {planned[2]['canvas']}: {bad} differ"
        p = resample.aten_tables(h, w, *content)
        kinds.add((p.horizontal is not None, p.vertical is not None))
    assert len(kinds) == 4 if videos >= 60 else len(kinds) >= 2, kinds
    with pytest.raises(ValueError, match=r"video 0 frames 0\.\.\d+: a frame group is \d+ uint8 HxWx3 frames"):
        one = video.frame_groups(*video.plan_video(frames, sample=False, patching=pt), T)[0]
        stager.images([(video.FrameGroup(one[0] + one[0]), one[1], one[2])], poison(want.shape))  # 2T frames
    with pytest.raises(ValueError, match=f"patchify: slot {T} is not -1 \\(every frame\\) or a frame 0..{T - 1}"):
        canvas = dev(np.zeros((f, f, 3), np.uint8))
        ops.patchify(canvas, dev(video.value_table()), poison((pt.merge_size ** 2, 3 * T * pt.patch_size ** 2)), T,
                     pt.patch_size, pt.merge_size, slot=T)
    with pytest.raises(ValueError, match="resample: weights with 0 fractional bits"):
        ops.resample_pass(canvas, None, canvas, 1, precision=0)
    bare = staging.Stager(dev(pre.value_table()), T, pt.patch_size, pt.merge_size)
    with pytest.raises(ValueError, match="without the video processor's value table"):
        bare.images(video.frame_groups(*planned, T), poison(want.shape))


# 16-byte aligned starts (eight values a thread a step) and shifted ones (one a step); lengths with
# and without a tail of n % 8; every kind of non-finite bf16 and the finite values nearest them.
@pytest.mark.parametrize("n,shift", [(1, 0), (7, 0), (8, 0), (4099, 0), (1 << 20, 0), (1 << 20, 1), (1001, 3)])
def test_count_nonfinite_bf16(n, shift):
    base = rng.standard_normal(n + shift, dtype=np.float32).astype(BF).view(np.uint16)
    specials = np.array([0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81], np.uint16)  # +-inf, NaNs
    edges = np.array([0x7F7F, 0xFF7F, 0x0001, 0x8000, 0x0080], np.uint16)     # max, -max, subnormal, -0, min normal
    k = int(rng.integers(1, min(n, 40) + 1))
    spots = rng.choice(n, size=min(n, 2 * k), replace=False) + shift
    base[spots[:k]] = rng.choice(specials, k)
    base[spots[k:]] = rng.choice(edges, len(spots) - k)
    want = int(np.count_nonzero((base[shift:] & 0x7F80) == 0x7F80))
    counts = dev(np.array([11, 22, 33], np.uint64))  # += into one slot; the others untouched
    x = dev(base)[shift:]  # bf16 bits as uint16: the launcher takes any 2-byte dtype
    ops.count_nonfinite(x, counts, 1)
    assert want >= k and cupy.asnumpy(counts).tolist() == [11, 22 + want, 33]
