"""Where encode_video's time goes on the GPU path, for benchmarks/bench_video.py's clips: planning (sampling,
canvas), the frame groups' staging (uploads + resize + patchify; host time of Stager.images, then the GPU's
until it is done), and the forward passes, each timed with the GPU synchronised around it; then the
whole call as the library runs it (its staging overlaps the previous pass). Wall ms, median of 3.

    python tools/video_share.py
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from benchmarks.bench_video import CLIPS, clip  # noqa: E402
from benchmarks.common import official_checkpoint, table  # noqa: E402


def main():
    import cupy

    from glmvit_cupy import GlmVit
    from glmvit_cupy.scheduling import batching
    from glmvit_cupy.preprocessing.video import frame_groups, plan_videos

    model = GlmVit.from_checkpoint(official_checkpoint(), capacity_tokens=8000)
    sync = cupy.cuda.get_current_stream().synchronize
    rows = []
    for k, (name, h, w, n, fps) in enumerate(CLIPS):
        frames = clip(h, w, n, k)
        model.encode_video(frames, fps=fps)  # warm-up: graphs, pinned blocks, scratch
        steps = {"plan_videos": [], "stage (host)": [], "stage (GPU after host)": [], "forwards": [], "call": []}
        for _ in range(3):
            t = time.perf_counter()
            planned = plan_videos(frames, fps=fps)
            items = frame_groups(*planned[0], model.geometry.temporal_patch_size)
            steps["plan_videos"].append(time.perf_counter() - t)
            batches = list(batching.pack(items, model.capacity_tokens, lambda it: it[2]["tokens"]))
            host = gpu = fwd = 0.0
            for batch in batches:
                pixels = model.runner.arena()["pixels"]
                sync()
                t = time.perf_counter()
                with model.device, model.runner.stream:
                    model.runner.stager.images(batch, pixels)
                    t1 = time.perf_counter()
                    model.runner.stream.synchronize()
                t2 = time.perf_counter()
                host, gpu = host + t1 - t, gpu + t2 - t1
                t = time.perf_counter()
                model.encode_prepared(batch)
                sync()
                model.runner.stream.synchronize()
                fwd += time.perf_counter() - t  # stages again: the forward's share is this minus the staging
            steps["stage (host)"].append(host)
            steps["stage (GPU after host)"].append(gpu)
            steps["forwards"].append(fwd - host - gpu)
            t = time.perf_counter()
            model.encode_video(frames, fps=fps)
            sync()
            steps["call"].append(time.perf_counter() - t)
        label = f"{name}: {len(planned[0][0])} frames, {len(items)} groups, {len(batches)} passes"
        rows += [[label, s, f"{1e3 * np.median(v):.1f}"] for s, v in steps.items()]
    table(["clip", "step", "wall ms"], rows)


if __name__ == "__main__":
    main()
