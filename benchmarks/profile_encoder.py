"""Where a forward's time goes: every launch of one eager forward bracketed by CUDA events on the
model's stream, summed per kernel family, with TFLOP/s for the GEMMs and attention and GB/s for the
memory-bound kernels. Cases: the speed issue's table (official geometry, random weights).

    python benchmarks/profile_encoder.py
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

    model = GlmVit.from_checkpoint(official_checkpoint(), max_image_tokens=8000, graphs=False)
    geo, stream = model.geometry, model._stream
    names = {(3 * geo.hidden_size, geo.hidden_size): "GEMM qkv", (geo.hidden_size, geo.hidden_size): "GEMM proj",
             (2 * geo.intermediate_size, geo.hidden_size): "GEMM gate_up",
             (geo.hidden_size, geo.intermediate_size): "GEMM down", (geo.hidden_size, geo.patch_dim): "GEMM patch"}
    log = []

    def timed(name_of, fn, flop_of=lambda *a: 0):
        def inner(*a, **k):
            e0 = stream.record()
            r = fn(*a, **k)
            log.append((name_of(*a), e0, stream.record(), flop_of(*a)))
            return r
        return inner

    model._gemm = timed(lambda a, w, *_: names.get(tuple(w.shape), "GEMM merger"), model._gemm,
                        lambda a, w, *_: 2 * a.shape[0] * w.shape[0] * w.shape[1])
    for attr, name in (("k_rms", "rmsnorm (+bias, residual)"), ("k_rms_im2col", "rmsnorm + im2col"),
                       ("k_ln_gelu", "layernorm + gelu"), ("k_rope", "qk norm + rope"), ("k_swiglu", "swiglu clamp"),
                       ("k_bias", "bias -> bf16"), ("k_cast", "f32 -> bf16")):
        setattr(model, attr, timed(lambda *a, n=name: n, getattr(model, attr)))
    cu_now = {}

    class TimedAttention:  # keeps .tiles for the planner; one per variant the model may pick
        def __init__(self, attn):
            self.tiles = attn.tiles
            self.run = timed(lambda *a: f"flash attention ({attn.variant})", attn,
                             lambda q, k, v, o, cu, ts, tq, heads: 4 * cu_now["sq"] * q.shape[1])

        def __call__(self, *a):
            return self.run(*a)

    model.attns = {v: TimedAttention(a) for v, a in model.attns.items()}
    rng = np.random.default_rng(0)
    for case, grids in CASES.items():
        n = sum(t * h * w for t, h, w in grids)
        pv = cupy.asarray(rng.standard_normal((n, geo.patch_dim), dtype=np.float32))
        grid = np.array(grids, np.int64)
        cu_now["sq"] = sum(t * (h * w) ** 2 for t, h, w in grids)
        for _ in range(2):
            log.clear()
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
