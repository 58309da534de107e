"""Seeded random videos through HF transformers' Glm5NextVideoProcessor (torchvision backend, CPU) and ours:
pixel_values_videos bit-equal, grids and sampled frames equal, refusals alike. Prints each mismatch and a
count. Needs torch, torchvision and transformers 5.23.0 (the GPU machine has torch; carry torchvision's
wheel); no GPU.

    python tools/fuzz_video.py [first] [count] [--golden tests/golden/video_hf.json]

Cases are tests/video_cases.case(i) for i in first..first+count. --golden writes HF's results (digests of
pixel_values_videos, grids, frame indices, or the refusal) for tests/test_video.py to check ours against
on machines without torch."""
import json, sys, time
import numpy as np
sys.path[:0] = ["src", "."]
import torch
from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
from glmvit_cupy.preprocessing.video import preprocess_video
from tests.video_cases import case, digest

args = [a for a in sys.argv[1:] if not a.startswith("--")]
first = int(args[0]) if args else 0
count = int(args[1]) if len(args) > 1 else 60
golden = sys.argv[sys.argv.index("--golden") + 1] if "--golden" in sys.argv else None
proc = Glm5NextVideoProcessor()
print("torch", torch.__version__, "cpu capability", torch.backends.cpu.get_cpu_capability())


def hf(frames, s):
    meta = {"total_num_frames": len(frames), "fps": s["fps"], "duration": s["duration"]}
    out = proc(videos=[frames], video_metadata=[meta], do_sample_frames=s["sample"], fps=s["target_fps"],
               min_image_tokens=s["min_image_tokens"], max_image_tokens=s["max_image_tokens"], return_metadata=True,
               input_data_format="channels_last")  # else HF guesses, and reads frames 1 or 3 pixels tall as CHW
    pv = out["pixel_values_videos"]
    pv = pv.numpy() if hasattr(pv, "numpy") else np.asarray(pv)
    md = out["video_metadata"][0]
    idx = list(md.frames_indices) if s["sample"] else list(range(len(frames)))
    return pv, np.asarray(out["video_grid_thw"]).tolist(), [int(i) for i in idx]


stats = {"equal": 0, "both refused": 0, "HF empty, ours refused": 0, "MISMATCH": 0}
records = {}
t0 = time.time()
for i in range(first, first + count):
    frames, s = case(i)
    try:
        want = hf(frames, s)
    except Exception as e:  # noqa: BLE001
        want = e
    try:
        pv, grid, info = preprocess_video(frames, fps=s["fps"], duration=s["duration"], sample=s["sample"],
                                          target_fps=s["target_fps"], min_image_tokens=s["min_image_tokens"],
                                          max_image_tokens=s["max_image_tokens"])
        got = (pv, grid.tolist(), info[0]["frames_indices"])
    except Exception as e:  # noqa: BLE001
        got = e
    label = f"case {i}: {frames.shape} {s}"
    if isinstance(want, Exception) or isinstance(got, Exception):
        if isinstance(want, Exception) and isinstance(got, Exception):
            stats["both refused"] += 1
            records[i] = {"refused": True}
        elif isinstance(got, Exception) and want[1][0][0] == 0 and "gives no frame" in str(got):
            stats["HF empty, ours refused"] += 1  # HF returns grid t = 0 (no tokens); we say why instead
            records[i] = {"refused": True, "hf_empty": True}
        else:
            stats["MISMATCH"] += 1
            print("MISMATCH", label, "HF:", repr(want)[:300] if isinstance(want, Exception) else "ok",
                  "ours:", repr(got)[:300] if isinstance(got, Exception) else "ok")
        continue
    same = want[1] == got[1] and want[2] == got[2] and want[0].shape == got[0].shape and \
        np.array_equal(want[0].view(np.uint32), got[0].view(np.uint32))
    if same:
        stats["equal"] += 1
        records[i] = {"grid": want[1], "frames_indices": want[2], "sha256": digest(want[0])}
    else:
        stats["MISMATCH"] += 1
        diff = (np.abs(want[0] - got[0]).max() if want[0].shape == got[0].shape else "shape")
        print("MISMATCH", label, "grid", want[1], got[1], "frames", want[2], got[2], "max diff", diff)
print(f"| video processor vs HF | cases {first}..{first + count - 1} | " +
      " | ".join(f"{k} {v}" for k, v in stats.items()) + f" | {time.time() - t0:.1f} s |")
if golden:
    with open(golden, "w") as f:
        json.dump({"transformers": "5.23.0", "torch": torch.__version__, "cases": records}, f, indent=0)
    print("wrote", golden, len(records), "cases")
sys.exit(1 if stats["MISMATCH"] else 0)
