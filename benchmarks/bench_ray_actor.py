"""The Ray pipeline's GPU stage without Ray (Ray's wheel does not travel to the GPU machine): batches
built by the CPU stage (glmvit_cupy.ray.Prepare) from JPEG bytes, fed to one encoder actor's
__call__ (glmvit_cupy.ray.Encode) as Ray Data would; images/s, GPU busy time, and a bit-for-bit check
of every embedding against GlmVit.encode of the same image alone.

    python benchmarks/bench_ray_actor.py [--images 240] [--batch-size 16]
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.bench_serve import SIZES, jpegs  # noqa: E402
from benchmarks.common import official_checkpoint, table  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=240, help="images in all (default 240)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows a batch, as map_batches' (default 16)")
    args = ap.parse_args()
    import glmvit_cupy.ray as gvr
    from glmvit_cupy import GlmVit

    import pandas as pd  # what Ray Data hands the stages (batch_format="pandas")
    ckpt = official_checkpoint()
    images = jpegs(40, SIZES)
    data = [images[i % len(images)] for i in range(args.images)]
    prepare = gvr.Prepare("bytes", 16, 8000)
    t0 = time.perf_counter()
    batches = [prepare(pd.DataFrame({"bytes": data[i:i + args.batch_size],
                                     "path": [f"img{j}.jpg" for j in range(i, min(i + args.batch_size, len(data)))]}))
               for i in range(0, len(data), args.batch_size)]
    cpu_s = time.perf_counter() - t0
    actor = gvr.Encode(ckpt, False, 8000)
    actor(batches[0].head(2).copy())  # warm: compile
    runner, busy = actor.backend._engine.models[0].runner, [0.0]
    run = runner._run

    def timed_run(*a, **k):  # GPU busy time: the forward passes' own CUDA-event time
        out = run(*a, **k)
        busy[0] += sum(runner.last_timing.values()) / 1e3
        return out

    runner._run = timed_run
    outs = []
    t0 = time.perf_counter()
    for b in batches:
        outs.append(actor(b.copy()))
    gpu_wall = time.perf_counter() - t0
    busy = busy[0]
    model = GlmVit.from_checkpoint(ckpt)
    alone = {d: model.encode([d])[0].get() for d in images}
    import ml_dtypes

    embs = [e for o in outs for e in o["embedding"]]
    equal = sum(np.array_equal(e.astype(ml_dtypes.bfloat16).view(np.uint16), alone[d].view(np.uint16))
                for e, d in zip(embs, data))
    tokens = sum(e.shape[0] for e in embs)
    table(["stage", "images", "seconds", "images/s", "tokens/s", "GPU busy"],
          [["Prepare (decode + resize, one CPU process)", len(data), f"{cpu_s:.2f}", f"{len(data) / cpu_s:.1f}", "", ""],
           [f"Encode.__call__ (one H200 actor, batches of {args.batch_size})", len(data), f"{gpu_wall:.2f}",
            f"{len(data) / gpu_wall:.1f}", f"{tokens / gpu_wall:.0f}", f"{100 * busy / gpu_wall:.0f}%"]])
    print(f"\nembeddings bit-equal to GlmVit.encode alone: {equal} of {len(data)}")
    return 0 if equal == len(data) else 1


if __name__ == "__main__":
    sys.exit(main())
