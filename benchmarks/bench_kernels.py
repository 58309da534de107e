"""Micro-benchmarks for every kernel family in cuda/ and the cuBLAS GEMMs, at the tower's shapes
(32,000 patches unless said): achieved GB/s against the H200's 4.8 TB/s, TFLOP/s against the
measured 756 TFLOP/s GEMM ceiling, and flash attention beside torch SDPA when torch is present."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.common import GEMM_CEIL, PEAK_BW, table, time_ms, torch_ms  # noqa: E402


def main():
    import cupy
    import ml_dtypes

    from glmvit_cupy.gemm import gemm
    from glmvit_cupy.kernels import kernel

    BF = ml_dtypes.bfloat16
    rng = cupy.random.default_rng(0)
    N, H, I, O, P = 32000, 1024, 4096, 4096, 10240

    def rnd(shape, dtype=np.float32):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    rows = []
    attention_only = "--attention-only" in sys.argv

    def bw(name, fn, nbytes):
        ms = time_ms(fn)
        rows.append([name, f"{ms * 1e3:.0f}", f"{nbytes / ms / 1e6:.0f}", f"{100 * nbytes / (ms / 1e3) / PEAK_BW:.0f}%"])

    if attention_only:
        return bench_attention(rnd, time_ms, BF, H)
    x, w, b = rnd((N, H)), rnd((H,), BF), rnd((H,), BF)
    nb = cupy.empty((N, H), BF)
    eps = np.float32(1e-5)
    bw("norms.rmsnorm_residual [32000x1024]", lambda: kernel("norms", "rmsnorm_residual")(
        (N,), (256,), (x, b, w, nb, np.int32(N), np.int32(H), eps)), N * H * (4 + 4 + 2))
    cols = cupy.empty((N // 4, 4 * H), BF)
    bw("norms.rmsnorm_im2col [32000x1024]", lambda: kernel("norms", "rmsnorm_im2col")(
        (N,), (256,), (x, b, w, cols, np.int32(N), np.int32(H), eps)), N * H * (4 + 4 + 2))
    y, wo, bo, yb = rnd((N // 4, O)), rnd((O,), BF), rnd((O,), BF), cupy.empty((N // 4, O), BF)
    bw("norms.layernorm_gelu [8000x4096]", lambda: kernel("norms", "layernorm_gelu")(
        (N // 4,), (256,), (y, wo, bo, yb, np.int32(N // 4), np.int32(O), eps)), N // 4 * O * (4 + 2))
    ch = 4096
    qkv16, bq, qn = rnd((ch, 3 * H), BF), rnd((3 * H,), BF), rnd((64,), BF)
    pos = cupy.asarray(np.random.default_rng(0).integers(0, 200, (N, 2)).astype(np.int32))
    invf = cupy.asarray((1 / 10000 ** (np.arange(0, 32, 2) / 32)).astype(np.float32))
    q, k, v = (cupy.empty((N, H), BF) for _ in range(3))
    bw("rotary.qk_norm_rope_bf16 [4096 rows x 16 heads]", lambda: kernel("rotary", "qk_norm_rope_bf16")(
        (ch * 16 * 64 // 8 // 256,), (256,), (qkv16, bq, qn, qn, pos, invf, q, k, v, np.int32(ch), np.int32(0),
                                             np.int32(16), np.int32(64), eps)), ch * 3 * H * (2 + 2))
    gu16, act = rnd((ch, 2 * I), BF), cupy.empty((ch, I), BF)
    bg = rnd((I,), BF)
    bw("activations.swiglu_clamp_bf16 [4096x4096]", lambda: kernel("activations", "swiglu_clamp_bf16")(
        (-(-I // 8 // 256), ch), (256,), (gu16, bg, bg, act, np.int64(ch), np.int32(I), np.float32(10))), ch * I * (4 + 2))
    canvas = cupy.asarray(np.random.default_rng(1).integers(0, 256, (2240, 2800, 3), dtype=np.uint8))
    values, pix = cupy.asarray(np.random.default_rng(2).random((3, 256), dtype=np.float32)), cupy.empty((N, 1176), BF)
    bw("pixels.patchify_u8 [2240x2800 canvas]", lambda: kernel("pixels", "patchify_u8")(
        (4096,), (256,), (canvas, values, pix, np.int32(2240), np.int32(2800), np.int32(2), np.int32(14))),
       canvas.size + N * 1176 * 2)
    bw("activations.bias_to_bf16 [8000x4096]", lambda: kernel("activations", "bias_to_bf16")(
        (4096,), (256,), (y, bo, yb, np.int64(N // 4), np.int32(O))), N // 4 * O * 6)
    pf, pb = rnd((N, 1176)), cupy.empty((N, 1176), BF)
    bw("activations.f32_to_bf16 [32000x1176]", lambda: kernel("activations", "f32_to_bf16")(
        (4096,), (256,), (pf, pb, np.int64(N * 1176))), N * 1176 * 6)
    table(["kernel", "us", "GB/s", "% of 4.8 TB/s"], rows)

    print()
    grows = []
    for name, m, n, kk, odt in [("qkv 4096x3072x1024 f32", 4096, 3 * H, H, np.float32),
                                ("proj 32000x1024x1024 f32 (+=)", N, H, H, np.float32),
                                ("gate_up 4096x8192x1024 f32", 4096, 2 * I, H, np.float32),
                                ("down 4096x1024x4096 f32 (+=)", 4096, H, I, np.float32),
                                ("patch 32000x1024x1176 f32", N, H, 1176, np.float32),
                                ("merger gate_up 2048x20480x4096 f32", 2048, 2 * P, O, np.float32),
                                ("merger down 2048x4096x10240 bf16", 2048, O, P, BF),
                                ("square 8192^3 bf16", 8192, 8192, 8192, BF)]:
        a, wt, out = rnd((m, kk), BF), rnd((n, kk), BF), cupy.empty((m, n), odt)
        ms = time_ms(lambda: gemm(a, wt, out))
        fl = 2 * m * n * kk
        grows.append([name, f"{ms:.3f}", f"{fl / ms / 1e9:.0f}", f"{100 * fl / ms / 1e9 / (GEMM_CEIL / 1e12):.0f}%"])
    table(["cuBLAS GEMM", "ms", "TFLOP/s", "% of 756"], grows)

    print()
    bench_attention(rnd, time_ms, BF, H)


def bench_attention(rnd, time_ms, BF, H):
    import cupy

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    from glmvit_cupy.attention import VARIANTS, FlashAttention

    arows = []
    sdpa = {}
    sm90 = cupy.cuda.Device().compute_capability == "90"
    for variant in [v for v in VARIANTS if ("d64" in v or v.startswith("sm90")) and (sm90 or "sm80" in v)]:
        attn = FlashAttention(64, variant)
        for n in (1024, 4096, 16384, 32000):
            q, k, v, o = (rnd((n, H), BF) for _ in range(4))
            cu_h = np.array([0, n], np.int32)
            ts, tq = (cupy.asarray(a) for a in attn.tiles(cu_h))
            cu = cupy.asarray(cu_h)
            ms = time_ms(lambda: attn(q, k, v, o, cu, ts, tq, 16))
            fl = 4 * n * n * H
            row = [variant, n, f"{ms:.3f}", f"{fl / ms / 1e9:.0f}"]
            if torch is not None:
                if n not in sdpa:
                    tq_, tk, tv = (torch.randn(1, 16, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                    sdpa[n] = torch_ms(lambda: F.scaled_dot_product_attention(tq_, tk, tv))
                sms = sdpa[n]
                row += [f"{sms:.3f}", f"{fl / sms / 1e9:.0f}", f"{sms / ms:.2f}x"]
            arows.append(row)
    table(["flash attention (16 heads x 64)", "tokens", "ms", "TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "SDPA / ours"],
          arows)


if __name__ == "__main__":
    main()
