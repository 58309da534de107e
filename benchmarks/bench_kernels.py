"""Micro-benchmarks for every kernel entry in cuda/ and the cuBLAS GEMMs, at the tower's shapes (32,000
patches unless said), through the same launchers the engine uses (glmvit_cupy.engine.ops): achieved
GB/s against the H200's 4.8 TB/s, TFLOP/s against the measured 756 TFLOP/s GEMM ceiling, and flash
attention beside torch SDPA (cuDNN) when torch is present, on one segment of 1k-32k keys and on 16
segments of 1,024 (SDPA's batch of 16), with each one's error against float64 at 4,096 keys (the same
independent normal inputs, and q doubled; 256 sampled query rows). Every kernel is timed back to back
behind a kernel that holds the stream (common.kernel_ms): its throughput as a replayed CUDA graph runs
it, without the host's launch time, which a single timed call of a 0.1-0.2 ms kernel would count
(torch's and ours alike).

    python benchmarks/bench_kernels.py [--attention-only | --gate-up-only]
"""

import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.common import GEMM_CEIL, PEAK_BW, kernel_ms, table  # noqa: E402

N, H, I, O, P = 32000, 1024, 4096, 4096, 10240  # patches, hidden, MLP, out_hidden, merger MLP
CHUNK = 4096  # the MLP's row chunk off Hopper (QKV, and on Hopper the MLP, run over all rows at once)


@functools.cache
def _generator():
    import cupy

    return cupy.random.default_rng(0)


def rnd(shape, dtype=np.float32):
    """Fresh standard normal values: each call draws new ones from one seeded stream, so attention's q, k
    and v are independent (a generator seeded per call would make them one array, every query its own
    key's best match)."""
    return _generator().standard_normal(shape, dtype=np.float32).astype(dtype)


def main():
    import cupy
    import ml_dtypes

    from glmvit_cupy.engine import ops

    if "--attention-only" in sys.argv:
        return bench_attention()
    if "--gate-up-only" in sys.argv:
        return bench_gate_up()
    BF = ml_dtypes.bfloat16
    eps, rows = 1e-5, []

    def bw(name, fn, nbytes):
        ms = kernel_ms(fn)
        rows.append([name, f"{ms * 1e3:.0f}", f"{nbytes / ms / 1e6:.0f}", f"{100 * nbytes / (ms / 1e3) / PEAK_BW:.0f}%"])

    x, w, off, normed = rnd((N, H)), rnd((H,), BF), rnd((H,)), cupy.empty((N, H), BF)
    bw("norms.rmsnorm_residual [32000x1024]", lambda: ops.rmsnorm_residual(x, off, w, normed, eps), N * H * (4 + 2))
    cols = cupy.empty((N // 4, 4 * H), BF)
    bw("norms.rmsnorm_im2col [32000x1024]", lambda: ops.rmsnorm_im2col(x, off, w, cols, eps), N * H * (4 + 2))
    y, wo, bo, yb = rnd((N // 4, O)), rnd((O,), BF), rnd((O,), BF), cupy.empty((N // 4, O), BF)
    bw("norms.layernorm_gelu [8000x4096]", lambda: ops.layernorm_gelu(y, wo, bo, yb, eps), N // 4 * O * (4 + 2))
    qkv, bq, qn = rnd((N, 3 * H), BF), rnd((3 * H,), BF), rnd((64,), BF)
    pos = cupy.asarray(np.random.default_rng(0).integers(0, 200, (N, 2)).astype(np.int32))
    invf = cupy.asarray((1 / 10000 ** (np.arange(0, 32, 2) / 32)).astype(np.float32))
    rope = cupy.empty((N, 64), np.float32)
    bw("rotary.rope_table [32000 rows x 32 pairs], once a forward", lambda: ops.rope_table(pos, invf, rope), N * 64 * 4)
    bw("rotary.qk_norm_rope_bf16 [32000 rows x 16 heads, in place]",  # q and k read and written; v untouched
       lambda: ops.qk_norm_rope(qkv, bq, qn, qn, rope, 16, eps), N * 2 * H * (2 + 2))
    gate_up, act, bg = rnd((CHUNK, 2 * I), BF), cupy.empty((CHUNK, I), BF), rnd((I,), BF)
    bw("activations.swiglu_clamp_bf16 [4096x4096]", lambda: ops.swiglu_clamp(gate_up, bg, bg, act, 10.0),
       CHUNK * I * (4 + 2))
    bw("activations.bias_to_bf16 [8000x4096]", lambda: ops.add_bias_to_bf16(y, bo, yb), N // 4 * O * 6)
    pf, pb = rnd((N, 1176)), cupy.empty((N, 1176), BF)
    on, real = cupy.ones(1, np.int32), cupy.full(1, N, np.int32)
    bw("activations.pixels_to_bf16 [32000x1176]", lambda: ops.cast_pixels(on, real, pf, pb), N * 1176 * 6)
    canvas = cupy.asarray(np.random.default_rng(1).integers(0, 256, (2240, 2800, 3), dtype=np.uint8))
    values = cupy.asarray(np.random.default_rng(2).random((3, 256), dtype=np.float32))
    bw("pixels.patchify_u8 [2240x2800 canvas]", lambda: ops.patchify(canvas, values, pb, 2, 14, 2),
       canvas.size + N * 1176 * 2)
    table(["kernel", "us", "GB/s", "% of 4.8 TB/s"], rows)

    # The GEMMs as the engine runs them (layers.py): output dtype, and accumulate into the fp32 stream.
    print()
    grows = []
    f32 = np.float32
    for name, m, n, kk, odt, acc in [("attn.qkv 4096x3072x1024 -> bf16", CHUNK, 3 * H, H, BF, False),
                                     ("attn.proj 32000x1024x1024 fp32 +=", N, H, H, f32, True),
                                     ("mlp.gate_up 4096x8192x1024 -> bf16", CHUNK, 2 * I, H, BF, False),
                                     ("mlp.down_proj 4096x1024x4096 fp32 +=", CHUNK, H, I, f32, True),
                                     ("patch_embed 32000x1024x1176 -> fp32", N, H, 1176, f32, False),
                                     ("merger downsample 2048x4096x4096 -> fp32", 2048, O, 4 * H, f32, False),
                                     ("merger gate_up 2048x20480x4096 -> bf16", 2048, 2 * P, O, BF, False),
                                     ("merger down 2048x4096x10240 -> bf16", 2048, O, P, BF, False),
                                     ("square 8192^3 -> bf16 (the ceiling)", 8192, 8192, 8192, BF, False)]:
        a, wt, out = rnd((m, kk), BF), rnd((n, kk), BF), rnd((m, n), odt)
        ms = kernel_ms(lambda: ops.linear(a, wt, out, accumulate=acc))
        fl = 2 * m * n * kk
        grows.append([name, f"{ms:.3f}", f"{fl / ms / 1e9:.0f}", f"{100 * fl / ms / 1e9 / (GEMM_CEIL / 1e12):.0f}%"])
    table(["cuBLAS GEMM", "ms", "TFLOP/s", "% of 756"], grows)
    print()
    bench_gate_up()
    print()
    bench_attention()


def bench_gate_up():
    """The MLP's gate/up GEMM and clamped SwiGLU: cuBLAS + the activations pass (layers.py's path with
    fused_swiglu=False) against gemm_sm90.cu's fused kernels (cooperative, ping-pong), at the block MLP's chunk
    and whole-pass rows and the merger's shape."""
    import cupy
    import ml_dtypes

    from glmvit_cupy.engine import gemm_sm90, ops

    if cupy.cuda.Device().compute_capability != "90":
        print("gate/up + swiglu: the fused kernel is sm_90a only; skipped on this GPU")
        return
    BF, rows = ml_dtypes.bfloat16, []
    for name, m, k, inter, bias in [("block MLP, 1,024 rows (448²)", 1024, H, I, True),
                                    ("block MLP, one chunk", CHUNK, H, I, True), ("block MLP, 16,384 rows", 16384, H, I, True),
                                    ("block MLP, 32,000 rows", N, H, I, True), ("merger, 2,048 rows", 2048, O, P, False),
                                    ("merger, 256 rows (448²)", 256, O, P, False), ("merger, 1,024 rows (896²)", 1024, O, P, False)]:
        a, w, gu, out = rnd((m, k), BF), rnd((2 * inter, k), BF), cupy.empty((m, 2 * inter), BF), cupy.empty((m, inter), BF)
        bg, bu = (rnd((inter,), BF), rnd((inter,), BF)) if bias else (None, None)

        def unfused():
            ops.linear(a, w, gu)
            ops.swiglu_clamp(gu, bg, bu, out, 10.0)

        ms_u = kernel_ms(unfused)
        # The cooperative kernel in either tile order, the ping-pong one, and what the launcher picks.
        ms_r, ms_c = (kernel_ms(lambda: gemm_sm90.gate_up_swiglu(a, w, bg, bu, out, 10.0, columns_fastest=c, pingpong=False))
                      for c in (0, 1))
        ms_p = kernel_ms(lambda: gemm_sm90.gate_up_swiglu(a, w, bg, bu, out, 10.0, pingpong=True))
        ms_f = kernel_ms(lambda: gemm_sm90.gate_up_swiglu(a, w, bg, bu, out, 10.0))  # the launcher's own choice
        ms_g = kernel_ms(lambda: ops.linear(a, w, gu))
        fl = 2 * m * k * 2 * inter
        rows.append([f"{name} ({m}x{2 * inter}x{k})", f"{ms_u:.3f}", f"{fl / ms_u / 1e9:.0f}", f"{fl / ms_g / 1e9:.0f}",
                     f"{fl / ms_r / 1e9:.0f} / {fl / ms_c / 1e9:.0f}", f"{fl / ms_p / 1e9:.0f}", f"{ms_f:.3f}",
                     f"{fl / ms_f / 1e9:.0f}", f"{ms_u / ms_f:.2f}x"])
    table(["gate/up + swiglu", "cuBLAS + pass ms", "TFLOP/s", "cuBLAS GEMM alone TFLOP/s",
           "cooperative TFLOP/s rows / columns fastest", "ping-pong TFLOP/s", "fused (launcher's pick) ms", "TFLOP/s",
           "fused speed-up"], rows)


def attention_error(q, k, v, out, heads=16, sample=256):
    """Relative L2 error of one segment's attention output `out` (rows x heads*64, any array with
    .astype) against float64 on `sample` query rows, from the same bf16 inputs."""
    import cupy

    f64 = [cupy.asnumpy(a).astype(np.float64).reshape(len(a), heads, -1) for a in (q, k, v)]
    rows = np.random.default_rng(3).choice(len(f64[0]), sample, replace=False)
    s = np.einsum("rhd,nhd->hrn", f64[0][rows], f64[1]) / np.sqrt(f64[0].shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hrn,nhd->rhd", p / p.sum(-1, keepdims=True), f64[2])
    got = np.asarray(out, dtype=np.float64).reshape(len(f64[0]), heads, -1)[rows]
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def bench_attention():
    import cupy
    import ml_dtypes

    from glmvit_cupy.engine import ops
    from glmvit_cupy.engine.attention import VARIANTS, tiles

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    BF, arows, sdpa, errs = ml_dtypes.bfloat16, [], {}, {}
    sm90 = cupy.cuda.Device().compute_capability == "90"
    cases = [(n,) for n in (1024, 4096, 16384, 32000)] + [(1024,) * 16]
    for v in [v for v in VARIANTS.values() if v.head_dim == 64 and (sm90 or v.arch != "sm90")]:
        for lens in cases:
            n = sum(lens)
            qkv, o = rnd((n, 3 * H), BF), rnd((n, H), BF)  # q, k, v where the engine has them: the QKV output
            q, k, val = qkv[:, :H], qkv[:, H:2 * H], qkv[:, 2 * H:]
            cu_h = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            ts, tq = (cupy.asarray(a) for a in tiles(cu_h, v.rows))
            cu = cupy.asarray(cu_h)
            ms = kernel_ms(lambda: ops.flash_attention(v, q, k, val, o, cu, ts, tq, 16))
            fl = 4 * sum(x * x for x in lens) * H
            row = [v.name, f"{len(lens)} x {lens[0]}" if len(lens) > 1 else n, f"{ms:.3f}", f"{fl / ms / 1e9:.0f}"]
            if lens == (4096,):  # as drawn, and with q doubled (sharper rows, as the kernel tests use)
                sharp_qkv = qkv.copy()
                sharp_qkv[:, :H] = (q.astype(np.float32) * 2).astype(BF)
                for sharp, qe, ke, ve in (("", q, k, val), (", q x 2", *(sharp_qkv[:, i * H:(i + 1) * H] for i in range(3)))):
                    ops.flash_attention(v, qe, ke, ve, o, cu, ts, tq, 16)
                    errs[v.name + sharp] = attention_error(qe, k, val, cupy.asnumpy(o).astype(np.float32))
                    if torch is not None and "SDPA" + sharp not in errs:
                        tq_, tk, tv = (torch.from_dlpack(a).view(n, 16, 64).transpose(0, 1)[None] for a in (qe, k, val))
                        so = F.scaled_dot_product_attention(tq_, tk, tv)[0].transpose(0, 1).float().cpu().numpy()
                        errs["SDPA" + sharp] = attention_error(qe, k, val, so)
            if torch is not None:
                if lens not in sdpa:  # equal segments: SDPA's batch dimension
                    tq_, tk, tv = (torch.randn(len(lens), 16, lens[0], 64, device="cuda", dtype=torch.bfloat16)
                                   for _ in range(3))
                    sdpa[lens] = kernel_ms(lambda: F.scaled_dot_product_attention(tq_, tk, tv),
                                           stream_ptr=torch.cuda.current_stream().cuda_stream)
                sms = sdpa[lens]
                row += [f"{sms:.3f}", f"{fl / sms / 1e9:.0f}", f"{sms / ms:.2f}x"]
            arows.append(row)
    table(["flash attention (16 heads x 64)", "tokens", "ms", "TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "SDPA / ours"],
          arows)
    table(["attention at 4,096 keys", "rel L2 error vs float64"], [[name, f"{e:.2e}"] for name, e in errs.items()])


if __name__ == "__main__":
    main()
