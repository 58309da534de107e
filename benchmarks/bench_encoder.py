"""Encoder benchmark on the speed issue's cases: ours (CUDA graphs, and eager for the per-stage
split) vs HF transformers 5.23.0 Glm5NextVisionModel (bf16, SDPA) eager and under
torch.compile(mode="reduce-overhead"), all on the same random official-geometry weights.
Median ms after warm-up, TFLOP/s, % of the GEMM ceiling, ratios, peak GPU memory; then end to end
with host preprocessing of a real photo, and from_checkpoint time.

    python benchmarks/bench_encoder.py [--no-hf] [--no-compiled]
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.common import (  # noqa: E402
    GEMM_CEIL, forward_flop, hf_model_or_none, official_checkpoint, table, time_ms, torch_ms)

CASES = {
    "1 x 448x448": [(1, 32, 32)],
    "1 x 896x896": [(1, 64, 64)],
    "1 x 1792x1792": [(1, 128, 128)],
    "1 x 8000 tokens (160x200)": [(1, 160, 200)],
    "16 x 448x448": [(1, 32, 32)] * 16,
}
TARGET_MS = {"1 x 448x448": 2.5, "1 x 896x896": 10, "1 x 1792x1792": 75, "1 x 8000 tokens (160x200)": 240,
             "16 x 448x448": 30}
PHOTO = os.path.join(os.path.dirname(__file__), "..", "examples", "grace_hopper.jpg")


def main():
    import cupy

    from glmvit_cupy import GlmVit, preprocess

    use_hf, use_compiled = "--no-hf" not in sys.argv, "--no-compiled" not in sys.argv
    path = official_checkpoint()
    t0 = time.perf_counter()
    model = GlmVit.from_checkpoint(path, capacity_tokens=8000)
    load_s = time.perf_counter() - t0
    geo = model.geometry
    rng = np.random.default_rng(0)
    hf = compiled = None
    if use_hf:
        hf = hf_model_or_none(path)
        if hf is not None and use_compiled:
            import torch

            compiled = torch.compile(hf, mode="reduce-overhead", dynamic=False)
    rows, stages = [], []
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
        ms = time_ms(lambda: model.encode_pixels(pv_d, grid))
        tflops = flop / ms / 1e9
        row = [name, n, f"{flop / 1e12:.2f}", f"{ms:.2f}", TARGET_MS[name], f"{tflops:.0f}",
               f"{100 * tflops / (GEMM_CEIL / 1e12):.0f}%", f"{pool.total_bytes() / 2**30:.2f}"]
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
                    c_ms = torch_ms(lambda: run(compiled))
                    row += [f"{c_ms:.1f}", f"{c_ms / ms:.1f}x", f"{time.perf_counter() - t:.0f}"]
                except Exception as e:  # report, keep benchmarking
                    row += [f"failed: {type(e).__name__}", "", ""]
        rows.append(row)
    header = ["case", "patches", "TFLOP", "ours ms", "target ms", "TFLOP/s", "% of GEMM ceiling", "ours pool GiB"]
    if hf is not None:
        header += ["HF eager ms", "vs eager", "HF peak GiB"]
        if compiled is not None:
            header += ["HF compiled ms", "vs compiled", "compile s"]
    table(header, rows)
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


if __name__ == "__main__":
    main()
