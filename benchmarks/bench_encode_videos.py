"""glmvit-encode over a folder of video files on the GPU, random official-geometry weights: videos/s and
tokens/s end to end (decode on threads, GPU resize and encode, shards written), beside the same clips'
decoding alone (the sampled frames only, as glmvit-encode reads them, on the same threads).

    python benchmarks/bench_encode_videos.py [--clips 12] [--seconds 10]

Clips: seeded synthetic 1280 x 720 pans at 30 fps with sensor-like noise, written with PyAV's MPEG-4 Part 2
encoder (in every PyAV wheel) into .mp4; 2 fps sampled, so a 10 s clip is 20 frames, 10 groups, ~13k tokens.
"""

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_video import clip  # noqa: E402
from benchmarks.common import official_checkpoint, table  # noqa: E402


def write_mp4(path, frames, fps=30):
    import av

    with av.open(path, "w") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt, s.bit_rate = frames.shape[2], frames.shape[1], "yuv420p", 8_000_000
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)


def main():
    from glmvit_cupy.cli import main as cli
    from glmvit_cupy.output import read_embeddings
    from glmvit_cupy.preprocessing.video import plan_video

    n = int(sys.argv[sys.argv.index("--clips") + 1]) if "--clips" in sys.argv else 12
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 10
    ckpt = official_checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "clips")
        os.makedirs(folder)
        frames = clip(720, 1280, int(30 * seconds), 0)
        paths = []
        for i in range(n):  # each clip its own: the pan read from another start
            path = os.path.join(folder, f"clip{i:03d}.mp4")
            write_mp4(path, np.roll(frames, 37 * i, axis=2))
            paths.append(path)
        t = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:  # glmvit-encode's video threads
            plans = list(pool.map(lambda p: plan_video(p), paths))
        decode_s = time.perf_counter() - t
        tokens = sum(info["tokens"] for _, _, info in plans)
        rows = [["decode + sample only (4 threads)", f"{decode_s:.2f}", f"{n / decode_s:.2f}",
                 f"{tokens / decode_s:,.0f}"]]
        out = os.path.join(tmp, "out")
        t = time.perf_counter()
        rc = cli.main([folder, "--checkpoint", ckpt, "--out", out])  # prints its own videos/s, load excluded
        dt = time.perf_counter() - t
        manifest, embs = read_embeddings(out)
        assert rc == 0 and len(embs) == n, (rc, manifest["failed"])
        rows.append(["glmvit-encode, the whole command (model load and graph capture too)", f"{dt:.2f}",
                     f"{n / dt:.2f}", f"{tokens / dt:,.0f}"])
        print(f"{n} clips of {seconds:g} s 1280x720 at 30 fps (mpeg4), {tokens:,} tokens in all")
        table(["run", "s", "videos/s", "tokens/s"], rows)


if __name__ == "__main__":
    main()
