"""Per kernel inside a replayed CUDA graph: one encode_pixels call of a bench_encoder case under Nsight Compute
(`--graph-profiling node`: every node timed alone, caches as the previous node left them, the clock free),
kernels grouped by name and grid, with their count, median and sum. A small forward's time is the sum of
these fixed costs, which no per-launch trace sees inside a graph.

    python tools/ncu_graph.py ["1 x 448x448"]      (needs ncu on PATH and access to the GPU's counters)
"""

import csv
import io
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout


def child(case: str) -> None:
    import cupy
    import cupyx.profiler
    import numpy as np

    from benchmarks.bench_encoder import CASES
    from benchmarks.common import official_checkpoint
    from glmvit_cupy import GlmVit

    model = GlmVit.from_checkpoint(official_checkpoint(), capacity_tokens=8000)
    grid = np.array(CASES[case], np.int64)
    pv = cupy.asarray(np.random.default_rng(0).standard_normal((int(grid.prod(1).sum()), model.geometry.patch_dim),
                                                               dtype=np.float32))
    for _ in range(3):  # compile, plan, capture the graph
        model.encode_pixels(pv, grid)
    cupy.cuda.runtime.deviceSynchronize()
    with cupyx.profiler.profile():  # ncu --profile-from-start off: only this call
        model.encode_pixels(pv, grid)
        cupy.cuda.runtime.deviceSynchronize()


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2])
    from benchmarks.bench_encoder import CASES

    case = sys.argv[1] if len(sys.argv) > 1 else "1 x 448x448"
    if case not in CASES:
        sys.exit(f"no bench_encoder case {case!r}; the cases: {', '.join(map(repr, CASES))}")
    cmd = ["ncu", "--profile-from-start", "off", "--graph-profiling", "node", "--cache-control", "none",
           "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--print-units", "base", "--csv",
           sys.executable, os.path.abspath(__file__), "--child", case]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit("ncu (Nsight Compute) is not on PATH: install it with the CUDA toolkit, or add its folder to PATH")
    start = run.stdout.find('"ID"')
    if run.returncode != 0 or start < 0:
        sys.exit(f"ncu failed (rc {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    groups: dict = {}
    for r in csv.DictReader(io.StringIO(run.stdout[start:])):
        if r["Metric Name"] == "gpu__time_duration.sum":
            key = (r["Kernel Name"][:60], r["Grid Size"])
            groups.setdefault(key, []).append(float(r["Metric Value"].replace(",", "")) / 1e3)  # ns -> us
    total = sum(sum(v) for v in groups.values())
    print(f"{case}: {sum(len(v) for v in groups.values())} kernels, {total / 1e3:.3f} ms in all (each node alone)\n")
    print("| kernel | grid | count | median us | sum us | share |\n|---|---|---|---|---|---|")
    for (name, grid), v in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        share = 100 * sum(v) / total
        print(f"| {name} | {grid} | {len(v)} | {statistics.median(v):.1f} | {sum(v):.0f} | {share:.1f}% |")


if __name__ == "__main__":
    main()
