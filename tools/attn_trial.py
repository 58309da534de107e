"""Try attention variants one subprocess each (a hung or faulting kernel costs one line, not the run):
correctness on the issue's segment mixes, then TFLOP/s at 16 heads x 64 on one segment of 1,024 /
4,096 / 16,384 / 32,000 keys, on 16 segments of 1,024 and on 12 of 150-2,500 (seeded) (bench_kernels.py has torch SDPA beside):
back to back (common.kernel_ms, the kernel's throughput) and, on a second line, one call timed alone
(which also counts the host's launch time).

    python tools/attn_trial.py sm90_4wg ...      (default: every sm90 variant)

To trial a new configuration, add its row to engine/attention.py's VARIANTS (the kernel is a template).
"""

import os
import subprocess
import sys

CHILD = r"""
import sys, numpy as np, cupy
sys.path[:0] = ["src", "."]
from tests.test_kernels_gpu import run_attention
import ml_dtypes
from benchmarks.common import time_ms, kernel_ms
BF, H = ml_dtypes.bfloat16, 1024
rng = cupy.random.default_rng(0)
def rnd(shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
from glmvit_cupy.engine import ops
from glmvit_cupy.engine.attention import VARIANTS, tiles
v = sys.argv[1]
errs = [run_attention(l, variant=v) for l in ([1], [7], [63, 64, 65], [1000])]
errs.append(run_attention(list(np.random.default_rng(1).integers(1, 700, 16)), sample=800, variant=v))
errs.append(run_attention([32000], heads=2, sample=256, variant=v))
variant = VARIANTS[v]
perf, perf1 = [], []
for lens in ([1024], [1024] * 16, [4096], [16384], [32000], [int(x) for x in np.random.default_rng(2).integers(150, 2500, 12)]):
    n = sum(lens)
    q, k, vv, o = (rnd((n, H), BF) for _ in range(4))
    cu_h = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ts, tq = (cupy.asarray(a) for a in tiles(cu_h, variant.rows))
    cu = cupy.asarray(cu_h)
    fn = lambda: ops.flash_attention(variant, q, k, vv, o, cu, ts, tq, 16)
    fl = 4 * sum(x * x for x in lens) * H
    perf.append(fl / kernel_ms(fn) / 1e9)
    perf1.append(fl / time_ms(fn) / 1e9)
print(f"| {v} | {max(errs):.2e} | " + " | ".join(f"{p:.0f}" for p in perf) + " |")
print(f"| {v} (one call timed) | | " + " | ".join(f"{p:.0f}" for p in perf1) + " |")
"""


def main():
    sys.path[:0] = ["src"]
    from glmvit_cupy.engine.attention import VARIANTS

    names = sys.argv[1:] or [v for v in VARIANTS if v.startswith("sm90")]
    print("| variant | max rel L2 | TFLOP/s 1024 | 16 x 1024 | 4096 | 16384 | 32000 | 12 mixed, 150-2,500 |\n|---|---|---|---|---|---|---|---|")
    sys.stdout.flush()
    for v in names:
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, v], capture_output=True, text=True, timeout=90,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(["src", ".", os.environ.get("PYTHONPATH", "")])))
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
            print("\n".join(line) if line and r.returncode == 0 else f"| {v} | FAILED rc={r.returncode}: "
                  f"{(r.stderr.strip().splitlines() or ['?'])[-1][:200]} | | | |")
        except subprocess.TimeoutExpired:
            print(f"| {v} | HUNG (killed after 90 s) | | | |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
