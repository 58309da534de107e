"""Regenerate the golden files from HF transformers 5.23.0 (needs torch==2.13.0 CPU; CI does not).

    python tests/golden/make_golden.py

Writes tests/golden/tower/ (a small random tower in GLM-5.3's exact checkpoint
layout, text tensors included), hf_outputs.npz (HF's float32 and bf16 outputs for
three images, one batch and one two-frame video) and hf_preprocess.json (sha256 of
HF's pixel_values for every image in cases.images()).
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.golden import cases  # noqa: E402

from glmvit_cupy import reference  # noqa: E402
from glmvit_cupy.checkpoint.synthetic import random_tower, write_checkpoint  # noqa: E402

assert transformers.__version__ == "5.23.0", transformers.__version__


def hf_model(geo, tensors, dtype):
    cfg = Glm5NextVisionConfig(depth=geo.depth, hidden_size=geo.hidden_size, num_heads=geo.num_heads,
                               intermediate_size=geo.intermediate_size, out_hidden_size=geo.out_hidden_size,
                               projection_intermediate_size=geo.projection_intermediate_size,
                               swiglu_limit=geo.swiglu_limit, rms_norm_eps=geo.rms_norm_eps)
    cfg._attn_implementation = "sdpa"
    model = Glm5NextVisionModel(cfg).eval()
    state = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "inv_freq" not in m], (missing, unexpected)
    return model.to(dtype)


def run(model, pv, grid, dtype):
    with torch.no_grad():
        out = model(hidden_states=torch.from_numpy(pv).to(dtype), grid_thw=torch.from_numpy(grid))
    return out.pooler_output.float().numpy()


def main():
    geo = cases.GEOMETRY
    tensors = random_tower(geo, cases.SEED)
    shutil.rmtree(cases.TOWER_DIR, ignore_errors=True)
    write_checkpoint(cases.TOWER_DIR, geo, seed=cases.SEED, tensors=tensors)
    proc = Glm5NextImageProcessorPil()
    m32, m16 = hf_model(geo, tensors, torch.float32), hf_model(geo, tensors, torch.bfloat16)
    arrays = {}
    for name, imgs in cases.tower_cases().items():
        feat = proc(images=imgs, return_tensors="np")
        pv, grid = feat["pixel_values"].astype(np.float32), feat["image_grid_thw"].astype(np.int64)
        arrays[f"{name}/pixel_values"], arrays[f"{name}/grid_thw"] = pv, grid
        arrays[f"{name}/hf_fp32"], arrays[f"{name}/hf_bf16"] = run(m32, pv, grid, torch.float32), \
            run(m16, pv, grid, torch.bfloat16)
    # A two-frame "video": each frame attends only to itself.
    rng = np.random.default_rng(7)
    pv = rng.standard_normal((2 * 8 * 6, geo.patch_dim), dtype=np.float32)
    grid = np.array([[2, 8, 6]], dtype=np.int64)
    arrays["video_2x8x6/pixel_values"], arrays["video_2x8x6/grid_thw"] = pv, grid
    arrays["video_2x8x6/hf_fp32"], arrays["video_2x8x6/hf_bf16"] = run(m32, pv, grid, torch.float32), \
        run(m16, pv, grid, torch.bfloat16)
    np.savez_compressed(cases.OUTPUTS, **arrays)
    stats = {}
    ours = reference.encode_pixels(cases.TOWER_DIR, arrays["batch_abc/pixel_values"], arrays["batch_abc/grid_thw"],
                                   stats=stats)
    ref = arrays["batch_abc/hf_fp32"]
    print("reference vs HF fp32, batch:", np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    print("clamp counts:", stats)

    pre = {"transformers": transformers.__version__, "pillow": __import__("PIL").__version__, "images": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, item in cases.images(tmp).items():
            img, kw = item if isinstance(item, tuple) else (item, {})
            try:
                feat = proc(images=[img], return_tensors="np", **kw)
            except Exception as e:  # the reference refusing an image is a golden fact too
                pre["images"][name] = {"error": f"{type(e).__name__}: {e}"}
                print(name, "HF error", e)
                continue
            pv = np.ascontiguousarray(feat["pixel_values"], dtype=np.float32)
            pre["images"][name] = {"kwargs": kw, "shape": list(pv.shape),
                                   "grid_thw": feat["image_grid_thw"].tolist(),
                                   "sha256": hashlib.sha256(pv.tobytes()).hexdigest(),
                                   "sum": float(pv.astype(np.float64).sum())}
            print(name, pv.shape, feat["image_grid_thw"].tolist())
    with open(cases.PREPROCESS, "w") as f:
        json.dump(pre, f, indent=1)


if __name__ == "__main__":
    main()
