"""Encoder benchmark on the SPEC's cases: ours vs HF transformers 5.23.0 (bf16, SDPA, eager) on the
same random official-geometry weights. Median ms after warm-up, TFLOP/s, peak GPU memory, time
per stage, and from_checkpoint time.

    python benchmarks/bench_encoder.py [--no-hf]
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.common import GEMM_CEIL, forward_flop, official_checkpoint, table, time_ms  # noqa: E402

CASES = {
    "1 x 448x448": [(1, 32, 32)],
    "1 x 896x896": [(1, 64, 64)],
    "1 x 1792x1792": [(1, 128, 128)],
    "1 x 8000 tokens (160x200)": [(1, 160, 200)],
    "16 x 448x448": [(1, 32, 32)] * 16,
}


def main():
    import cupy

    from glmvit_cupy import GlmVit
    from glmvit_cupy.checkpoint import bind_tower

    use_hf = "--no-hf" not in sys.argv
    path = official_checkpoint()
    t0 = time.perf_counter()
    model = GlmVit.from_checkpoint(path, max_image_tokens=8000)
    load_s = time.perf_counter() - t0
    geo = model.geometry
    rng = np.random.default_rng(0)
    hf = None
    if use_hf:
        from tests import hf_bar

        why = hf_bar.available()
        if why:
            print("HF columns skipped:", why)
        else:
            import torch

            hf = hf_bar.hf_model(bind_tower(path))
    rows, stages = [], []
    pool = cupy.get_default_memory_pool()
    for name, grids in CASES.items():
        n = sum(t * h * w for t, h, w in grids)
        pv = rng.standard_normal((n, geo.patch_dim), dtype=np.float32)
        grid = np.array(grids, np.int64)
        pv_d = cupy.asarray(pv)
        flop = forward_flop(geo, grids)
        ms = time_ms(lambda: model.encode_pixels(pv_d, grid))
        peak = (pool.total_bytes()) / 2**30
        stages.append([name] + [f"{model.last_timing.get(k, 0):.2f}" for k in ("patch_embed", "blocks", "merger")])
        row = [name, n, f"{flop / 1e12:.2f}", f"{ms:.2f}", f"{flop / ms / 1e9:.0f}",
               f"{100 * flop / ms / 1e9 / (GEMM_CEIL / 1e12):.0f}%", f"{peak:.2f}"]
        if hf is not None:
            tpv, tgrid = torch.from_numpy(pv).cuda().to(torch.bfloat16), torch.from_numpy(grid).cuda()

            def run_hf():
                with torch.no_grad():
                    hf(hidden_states=tpv, grid_thw=tgrid)

            for _ in range(2):
                run_hf()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run_hf()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            hf_ms = float(np.median(ts))
            row += [f"{hf_ms:.1f}", f"{hf_ms / ms:.2f}x"]
        rows.append(row)
    header = ["case", "patches", "TFLOP", "ours ms", "TFLOP/s", "% of GEMM ceiling", "pool GiB"]
    if hf is not None:
        header += ["HF eager bf16 ms", "speed-up"]
    table(header, rows)
    print()
    table(["case", "patch embed ms", "blocks ms", "merger ms"], stages)
    print(f"\nfrom_checkpoint (official geometry, {model.weight_bytes / 2**30:.2f} GiB): {load_s:.2f} s")


if __name__ == "__main__":
    main()
