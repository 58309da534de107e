"""Parity against HF transformers 5.23.0 on the GPU.

Golden tower: ours vs HF float32 (golden file), beside HF bf16 on this GPU vs the same.
Official geometry, random weights: ours and HF bf16 vs HF float32 on this GPU (TF32 off),
for the speed table's image sizes, including a 32,000-patch image.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.common import official_checkpoint, table  # noqa: E402
from glmvit_cupy import GlmVit, preprocess  # noqa: E402
from glmvit_cupy.checkpoint import bind_tower  # noqa: E402
from tests import hf_bar  # noqa: E402
from tests.golden import cases  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    import cupy
    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    why = hf_bar.available()
    if why:
        print("parity needs HF on the GPU:", why)
        return 1
    rows = []
    g = np.load(cases.OUTPUTS)
    small = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=600)
    sb = bind_tower(cases.TOWER_DIR)
    for name in sorted({k.split("/")[0] for k in g.files}):
        pv, grid, want = g[f"{name}/pixel_values"], g[f"{name}/grid_thw"], g[f"{name}/hf_fp32"]
        ours = rel(cupy.asnumpy(small.encode_pixels(pv, grid)).astype(np.float32), want)
        hf = rel(hf_bar.hf_forward(sb, pv, grid), want)
        rows.append([f"golden {name}", grid.tolist(), f"{ours:.3e}", f"{hf:.3e}", f"{hf / ours:.1f}x",
                     "ok" if ours <= hf else "WORSE"])
    path = official_checkpoint()
    ob = bind_tower(path)
    model = GlmVit(ob, capacity_tokens=8000)
    photo = os.path.join(os.path.dirname(__file__), "..", "examples", "grace_hopper.jpg")
    imgs = {"448x448": [cases._smooth(448, 448, 40)], "896x672": [cases._smooth(896, 672, 41)],
            "three images": [cases._smooth(448, 448, 40), cases._smooth(896, 672, 41), cases._smooth(300, 500, 42)],
            "photo": [photo], "1792x1792": [cases._smooth(1792, 1792, 43)],
            "8000 tokens 2240x2800": [cases._smooth(2240, 2800, 44)]}
    for name, im in imgs.items():
        pv, grid = preprocess(im)
        ref = hf_bar.hf_forward(ob, pv, grid, "float32")
        ours = rel(cupy.asnumpy(model.encode_pixels(pv, grid)).astype(np.float32), ref)
        hf = rel(hf_bar.hf_forward(ob, pv, grid), ref)
        rows.append([f"official {name}", grid.tolist() if len(grid) == 1 else f"{len(grid)} images, "
                     f"{int(np.prod(grid, 1).sum())} patches", f"{ours:.3e}", f"{hf:.3e}", f"{hf / ours:.1f}x",
                     "ok" if ours <= hf else "WORSE"])
        torch.cuda.empty_cache()
    table(["case (vs HF float32)", "grid", "ours rel L2", "HF bf16 rel L2", "ours better by", "bar"], rows)
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
