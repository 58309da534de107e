"""TRIAL (trial/gemm-anatomy): the forward with cuBLAS's residual GEMMs against gemm_sm90.cu's ping-pong
kernel (layers.RESIDUAL_PINGPONG), graphs, each case timed as bench_encoder does, alternating twice; and
the two models' outputs compared (rel L2 and whether bit-equal: they need not be, different GEMMs)."""
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from benchmarks.bench_encoder import CASES  # noqa: E402
from benchmarks.common import official_checkpoint, time_ms  # noqa: E402
from glmvit_cupy import GlmVit  # noqa: E402
from glmvit_cupy.engine import layers  # noqa: E402

path, rng = official_checkpoint(), np.random.default_rng(0)
inputs = {name: (cupy.asarray(rng.standard_normal((sum(t * h * w for t, h, w in g), 1176), dtype=np.float32)),
                 np.array(g, np.int64)) for name, g in CASES.items()}
models = {}
for flag in (False, True):
    layers.RESIDUAL_PINGPONG = flag  # read at each forward, and captured into that model's graphs
    models[flag] = GlmVit.from_checkpoint(path, capacity_tokens=8000)
    for pv, grid in inputs.values():  # capture every budget with this setting
        for _ in range(3):
            models[flag].encode_pixels(pv, grid)
print("| case | cuBLAS ms | ping-pong ms | cuBLAS ms | ping-pong ms | out rel L2 |")
print("|---|---|---|---|---|---|")
for name, (pv, grid) in inputs.items():
    row = []
    for _ in range(2):
        for flag in (False, True):
            layers.RESIDUAL_PINGPONG = flag  # graphs replay what they captured; eager first calls read it
            row.append(time_ms(lambda: models[flag].encode_pixels(pv, grid)))
    a, b = (models[f].encode_pixels(pv, grid).astype(np.float32) for f in (False, True))
    err = float(cupy.linalg.norm(a - b) / cupy.linalg.norm(a))
    print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in row) + f" | {err:.2e} |", flush=True)
