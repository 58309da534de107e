"""Where a forward's time goes: every launch of one eager forward bracketed by CUDA events (launch.py's
`traced` hook), summed per kernel family, with TFLOP/s for the GEMMs and attention. Cases:
the speed table's (official geometry, random weights), and a full pass of ~1,000-token images (what
glmvit-encode --max-image-tokens 1024 runs).

    python benchmarks/profile_encoder.py [--no-fused-swiglu]   (the cuBLAS gate/up + separate SwiGLU pass)
"""

import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.bench_encoder import CASES  # noqa: E402
from benchmarks.common import official_checkpoint, table  # noqa: E402


def main():
    import cupy

    from glmvit_cupy import GlmVit
    from glmvit_cupy.engine import launch

    model = GlmVit.from_checkpoint(official_checkpoint(), capacity_tokens=8000, graphs=False,
                                   fused_swiglu=False if "--no-fused-swiglu" in sys.argv else None)
    geo, log = model.geometry, []
    rng = np.random.default_rng(0)
    cases = dict(CASES)
    cases["8 images of ~1,000 tokens (one pass at --max-image-tokens 1024)"] = [(1, 64, 64)] * 7 + [(1, 48, 64)]
    for case, grids in cases.items():
        n = sum(t * h * w for t, h, w in grids)
        pv = cupy.asarray(rng.standard_normal((n, geo.patch_dim), dtype=np.float32))
        grid = np.array(grids, np.int64)
        model.encode_pixels(pv, grid)  # warm: compile, plan
        log.clear()
        with launch.traced(lambda *rec: log.append(rec)):
            model.encode_pixels(pv, grid)
        total = model.last_timing
        fam, flop, calls = defaultdict(float), defaultdict(float), defaultdict(int)
        for name, e0, e1, fl in log:
            e1.synchronize()
            fam[name] += cupy.cuda.get_elapsed_time(e0, e1)
            flop[name] += fl
            calls[name] += 1
        fwd = sum(total[k] for k in ("patch_embed", "blocks", "merger"))
        rows = [[name, calls[name], f"{ms:.2f}", f"{100 * ms / fwd:.0f}%",
                 f"{flop[name] / ms / 1e9:.0f}" if flop[name] else ""]
                for name, ms in sorted(fam.items(), key=lambda kv: -kv[1])]
        rows.append(["(between launches)", "", f"{fwd - sum(fam.values()):.2f}",
                     f"{100 * (fwd - sum(fam.values())) / fwd:.0f}%", ""])
        print(f"\n{case}: eager forward {fwd:.2f} ms on the GPU")
        table(["kernel family", "launches", "ms", "share", "TFLOP/s"], rows)


if __name__ == "__main__":
    main()
