"""Fixed cost against per-tile cost of the Hopper attention kernels on one short segment, beside torch SDPA
(cuDNN): one segment of L = 128-1,024 keys (16 heads x 64, at most 128 CTAs: one partial wave), every
kernel timed back to back (common.kernel_ms), and time = a + b x (L / 64) fitted over L >= 512 per kernel:
a is what a launch costs whatever its keys (scheduling, the first loads, the pipeline's fill and the
epilogue), b what each 64-key tile adds. An empty kernel back to back gives the launch gap alone.
On an H100, sm90_2wg_fixed takes 8.9 us at 512 keys and 14.1 at 1,024 (b = 0.65 us), SDPA 9.5 and 14.2 (0.59).

    python benchmarks/bench_short_segments.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import kernel_ms  # noqa: E402
from glmvit_cupy.engine import ops  # noqa: E402
from glmvit_cupy.engine.attention import VARIANTS, tiles  # noqa: E402

BF, H = ml_dtypes.bfloat16, 1024  # 16 heads x 64
KEYS = (128, 256, 384, 512, 768, 1024)


def main():
    rng = cupy.random.default_rng(0)
    empty = cupy.RawKernel('extern "C" __global__ void e(){}', "e")
    print(f"empty kernel back to back: {kernel_ms(lambda: empty((1,), (32,), ())) * 1e3:.2f} us")
    print(f"empty kernel 128 CTAs x 384: {kernel_ms(lambda: empty((128,), (384,), ())) * 1e3:.2f} us")
    res = {}
    for name in ("sm90_2wg_fixed", "sm90_2wg", "sm90_4wg_fixed", "sm90_4wg"):
        v, us = VARIANTS[name], []
        for L in KEYS:
            qkv = rng.standard_normal((L, 3 * H), dtype=np.float32).astype(BF)  # q, k, v independent
            o = cupy.empty((L, H), BF)
            cu_h = np.array([0, L], np.int32)
            a, b = (cupy.asarray(x) for x in tiles(cu_h, v.rows))
            cu = cupy.asarray(cu_h)
            us.append(kernel_ms(lambda: ops.flash_attention(v, qkv[:, :H], qkv[:, H:2 * H], qkv[:, 2 * H:], o, cu,
                                                            a, b, 16)) * 1e3)
        res[name] = us
    us = []
    for L in KEYS:
        q, k, vv = (torch.randn(1, 16, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        us.append(kernel_ms(lambda: F.scaled_dot_product_attention(q, k, vv),
                            stream_ptr=torch.cuda.current_stream().cuda_stream) * 1e3)
    res["SDPA"] = us
    print("| kernel | " + " | ".join(f"{L} keys: us (TFLOP/s)" for L in KEYS) + " | a us | b us a 64-key tile |")
    print("|---" * (len(KEYS) + 3) + "|")
    for name, t in res.items():
        cells = [f"{x:.2f} ({4 * L * L * H / (x * 1e-6) / 1e12:.0f})" for x, L in zip(t, KEYS)]
        b, a = np.polyfit(np.array(KEYS[3:]) / 64, t[3:], 1)
        print(f"| {name} | " + " | ".join(cells) + f" | {a:.2f} | {b:.3f} |")


if __name__ == "__main__":
    main()
