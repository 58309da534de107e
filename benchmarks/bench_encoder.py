"""Encoder benchmark on the speed issue's cases: ours (CUDA graphs, and eager for the per-stage
split) vs HF transformers 5.23.0 Glm5NextVisionModel (bf16, SDPA) eager and under
torch.compile(mode="reduce-overhead"), all on the same random official-geometry weights.
Median ms after warm-up, TFLOP/s, % of the GEMM ceiling, ratios, peak GPU memory (our pool holds a
second model: the same weights with the online-softmax attention forced, its ms beside ours); then end to end
with host preprocessing of a real photo, from_checkpoint time, and the serving mix (40 images of
seeded sizes, one call each, first pass and repeat) beside HF eager.

    python benchmarks/bench_encoder.py [--no-hf] [--no-compiled] [--no-tune]

--no-tune: every GEMM on cuBLAS's default pick (the model's tune_gemms=False), for a same-run comparison.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.common import (  # noqa: E402
    GEMM_CEIL, ClockSampler, forward_flop, hf_model_or_none, official_checkpoint, table, time_ms, torch_ms)

CASES = {
    "1 x 448x448": [(1, 32, 32)],
    "1 x 896x896": [(1, 64, 64)],
    "1 x 1792x1792": [(1, 128, 128)],
    "1 x 8000 tokens (160x200)": [(1, 160, 200)],
    "16 x 448x448": [(1, 32, 32)] * 16,
}
TARGET_MS = {"1 x 448x448": 2.5, "1 x 896x896": 10, "1 x 1792x1792": 75, "1 x 8000 tokens (160x200)": 240,
             "16 x 448x448": 30}
IDLE_S = 2.0  # seconds idle before a "from idle" call: the clock is back at its maximum by then (measured)
PHOTO = os.path.join(os.path.dirname(__file__), "..", "examples", "grace_hopper.jpg")


def main():
    import cupy

    from glmvit_cupy import GlmVit
    from glmvit_cupy import preprocess

    use_hf, use_compiled = "--no-hf" not in sys.argv, "--no-compiled" not in sys.argv
    path = official_checkpoint()
    t0 = time.perf_counter()
    model = GlmVit.from_checkpoint(path, capacity_tokens=8000, tune_gemms="--no-tune" not in sys.argv)
    load_s = time.perf_counter() - t0
    # The same forward with the online-softmax attention forced: the speed any checkpoint gets, whatever
    # its q_norm / k_norm weights (the default runs the fixed-offset kernels where they bound the scores).
    try:
        online = GlmVit.from_checkpoint(path, capacity_tokens=8000, attention_variant="sm90_4wg",
                                        tune_gemms="--no-tune" not in sys.argv)
    except ValueError as e:  # not a Hopper GPU: no such variant here
        print(f"online-softmax row left out: {e}")
        online = None
    if model.gemm_tuning:
        table(["GEMM tuned at load", "rows", "n", "k", "same-bits algorithms", "cublasGemmEx us", "best us", "kept"],
              [[r["gemm"], r["rows"], r["n"], r["k"], r["same_bits"], f"{r['gemm_ex_us']:.1f}", f"{r['best_us']:.1f}",
                "cublasLt" if r["chosen"] is not None else "GemmEx"] for r in model.gemm_tuning])
        print()
    geo = model.geometry
    rng = np.random.default_rng(0)
    hf = compiled = None
    if use_hf:
        hf = hf_model_or_none(path)
        if hf is not None and use_compiled:
            import torch

            compiled = torch.compile(hf, mode="reduce-overhead", dynamic=False)
    rows, stages, power = [], [], []
    pool = cupy.get_default_memory_pool()
    for name, grids in CASES.items():
        n = sum(t * h * w for t, h, w in grids)
        pv = rng.standard_normal((n, geo.patch_dim), dtype=np.float32)
        grid = np.array(grids, np.int64)
        pv_d = cupy.asarray(pv)
        flop = forward_flop(geo, grids)
        model.graphs = False
        eager_ms = time_ms(lambda: model.encode_pixels(pv_d, grid))
        stages.append([name] + [f"{model.last_timing.get(k, 0):.2f}" for k in ("patch_embed", "blocks", "merger")]
                      + [f"{eager_ms:.2f}"])
        model.graphs = True
        with ClockSampler() as clocks:
            ms = time_ms(lambda: model.encode_pixels(pv_d, grid))
        cool_ms = time_ms(lambda: model.encode_pixels(pv_d, grid), warmup=1, repeat=3, idle_s=IDLE_S)
        power.append([name, f"{ms:.2f}", str(clocks), clocks.joules(ms), f"{cool_ms:.2f}"])
        tflops = flop / ms / 1e9
        row = [name, n, f"{flop / 1e12:.2f}", f"{ms:.2f}", TARGET_MS[name], f"{tflops:.0f}",
               f"{100 * tflops / (GEMM_CEIL / 1e12):.0f}%", f"{pool.total_bytes() / 2**30:.2f}"]
        if online is not None:
            row.append(f"{time_ms(lambda: online.encode_pixels(pv_d, grid)):.2f}")
        if hf is not None:
            import torch

            tpv, tgrid = torch.from_numpy(pv).cuda().to(torch.bfloat16), torch.from_numpy(grid).cuda()

            def run(m):
                with torch.no_grad():
                    return m(hidden_states=tpv, grid_thw=tgrid).pooler_output

            torch.cuda.reset_peak_memory_stats()
            hf_ms = torch_ms(lambda: run(hf))
            row += [f"{hf_ms:.1f}", f"{hf_ms / ms:.1f}x", f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"]
            if compiled is not None:
                t = time.perf_counter()
                try:
                    for _ in range(3):  # compile, record the graph, replay
                        run(compiled)
                    torch.cuda.synchronize()
                    with ClockSampler() as c_clocks:
                        c_ms = torch_ms(lambda: run(compiled))
                    c_cool = torch_ms(lambda: run(compiled), warmup=1, repeat=3, idle_s=IDLE_S)
                    row += [f"{c_ms:.1f}", f"{c_ms / ms:.2f}x", f"{time.perf_counter() - t:.0f}"]
                    power[-1] += [f"{c_ms:.1f}", str(c_clocks), c_clocks.joules(c_ms), f"{c_cool:.1f}",
                                  f"{c_ms / ms:.2f}x", f"{c_cool / cool_ms:.2f}x"]
                except Exception as e:  # report, keep benchmarking
                    row += [f"failed: {type(e).__name__}", "", ""]
                    power[-1] += [f"failed: {type(e).__name__}", "", "", "", "", ""]
        rows.append(row)
    header = ["case", "patches", "TFLOP", "ours ms", "target ms", "TFLOP/s", "% of GEMM ceiling", "ours pool GiB"]
    if online is not None:
        header.append("ours, online softmax forced, ms")
    if hf is not None:
        header += ["HF eager ms", "vs eager", "HF peak GiB"]
        if compiled is not None:
            header += ["HF compiled ms", "vs compiled", "compile s"]
    table(header, rows)
    print(f"\nClock and power: each case's timed calls back to back (as above) with the median SM clock, the median "
          f"and highest board power (instant) sampled over them, and the clock event reasons the driver reported "
          f"(share of samples), and the energy of a call at that median power; then the same calls each started after "
          f"{IDLE_S} s idle (the GPU cool, at full clock)")
    p_header = ["case", "ours ms", "ours clock, power, reasons", "ours J a call", "ours ms from idle"]
    if compiled is not None:
        p_header += ["HF compiled ms", "compiled clock, power, reasons", "compiled J a call", "compiled ms from idle",
                     "vs compiled", "vs compiled from idle"]
    table(p_header, power)
    lt, shapes = model.runner.blas.lt_usage()
    print(f"\nGEMM shapes these forwards ran on a tuned cublasLt algorithm: {lt} of {shapes}")
    print()
    table(["case (eager, per stage)", "patch embed ms", "blocks ms", "merger ms", "eager total ms"], stages)

    # End to end: a real photo from its JPEG file, host preprocessing included, output on the host.
    print()
    e2e = []
    for max_tokens in (1024, 8000):
        def once():
            return [o.get() for o in model.encode([PHOTO], max_image_tokens=max_tokens)]

        for _ in range(3):
            once()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            once()
            ts.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        pv, grid = preprocess([PHOTO], max_image_tokens=max_tokens)
        pre = 1e3 * (time.perf_counter() - t)
        e2e.append([f"photo, max_image_tokens {max_tokens}", int(grid[0, 1] * grid[0, 2] // 4), f"{pre:.1f}",
                    f"{np.median(ts):.1f}"])
    table(["end to end (JPEG file -> host embeddings)", "tokens", "preprocess ms", "total ms"], e2e)
    print(f"\nfrom_checkpoint (official geometry, {model.weight_bytes / 2**30:.2f} GiB): {load_s:.2f} s")
    print()
    serving_mix(path, hf)


def serving_mix(path, hf, n=40, seed=1):
    """A server's traffic: n images of seeded sizes (150-2,500 tokens, aspect 1:2 to 2:1), one call each
    (pixels from the host, embeddings back to it), through a fresh model (no graph captured yet): the
    first pass, then the same images again; HF eager beside it, one call each as well."""
    from glmvit_cupy import GlmVit

    rng = np.random.default_rng(seed)
    model = GlmVit.from_checkpoint(path, capacity_tokens=8000, tune_gemms="--no-tune" not in sys.argv)
    inputs = []
    for _ in range(n):
        tokens, aspect = int(rng.integers(150, 2501)), float(rng.uniform(0.5, 2.0))
        h = max(1, round((tokens * aspect) ** 0.5))
        w = max(1, round(tokens / h))
        grid = np.array([[1, 2 * h, 2 * w]], np.int64)
        inputs.append((rng.standard_normal((4 * h * w, model.geometry.patch_dim), dtype=np.float32), grid))

    def one_pass(call):
        ts = []
        for pv, grid in inputs:
            t = time.perf_counter()
            call(pv, grid)
            ts.append(1e3 * (time.perf_counter() - t))
        return sum(ts), float(np.median(ts))

    ours = [one_pass(lambda pv, g: model.encode_pixels(pv, g).get()) for _ in range(2)]
    rows = [[f"ours, {label}", f"{total:.0f}", f"{med:.1f}"] for label, (total, med) in zip(("first pass", "repeat"), ours)]
    if hf is not None:
        import torch

        def hf_call(pv, grid):
            with torch.no_grad():
                return hf(hidden_states=torch.from_numpy(pv).cuda().to(torch.bfloat16),
                          grid_thw=torch.from_numpy(grid).cuda()).pooler_output.float().cpu()

        hf_runs = [one_pass(hf_call) for _ in range(2)]
        for row, (total, med), o in zip(rows, hf_runs, ours):
            row += [f"{total:.0f}", f"{med:.1f}", f"{total / o[0]:.2f}x"]
    tokens = sum(int(g[0, 1] * g[0, 2]) // 4 for _, g in inputs)
    header = [f"serving mix: {n} images, {tokens} tokens, one call each", "ours total ms", "ours median ms"]
    if hf is not None:
        header += ["HF eager total ms", "HF median ms", "vs HF eager"]
    table(header, rows)
    print(f"graphs captured: {sum(p.graph is not None for p in model.runner.plans._plans.values())} "
          f"(budgets {sorted({p.patches for p in model.runner.plans._plans.values()})})")


if __name__ == "__main__":
    main()
