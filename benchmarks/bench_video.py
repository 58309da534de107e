"""Decoded video frames -> embeddings on the GPU: the frames resized on the host (NumPy, ATen's bytes) against
on the GPU (the default), beside HF transformers 5.23.0's Glm5NextVideoProcessor on the same frames (its
torchvision backend on the CPU, and on CUDA where it takes device="cuda"), in the same run, on the same
random official-geometry weights.

    python benchmarks/bench_video.py [--repeat 3]

Rows per clip (seeded synthetic frames: a smooth field panning with sensor-like noise, never zeros), wall
milliseconds, median of --repeat after a warm-up: HF's processor alone (pixels only, no tower); ours
preprocess_video alone (host); ours host preprocess + encode_video_pixels; ours encode_video (frames
uploaded as sampled, resized and normalised on the GPU, then encoded). Also checks the GPU path's
embeddings equal the host path's bit for bit.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import official_checkpoint, table  # noqa: E402

# (name, height, width, frames, fps): 10 s clips at 30 fps, 2 fps sampled (20 frames, 10 groups), and a short one
CLIPS = [("360p 10 s", 360, 640, 300, 30.0), ("720p 10 s", 720, 1280, 300, 30.0),
         ("1080p 10 s", 1080, 1920, 300, 30.0), ("1080p portrait 4 s", 1920, 1080, 120, 30.0)]


def clip(h, w, n, seed):
    """n frames [n, h, w, 3] uint8: a smooth random field, shifted 6 px a frame, plus per-column noise."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 24 + 2, (w + 6 * n) // 24 + 2, 3), dtype=np.uint8)
    field = np.repeat(np.repeat(small, 24, 0), 24, 1)[:h, :w + 6 * n]
    noise = rng.integers(-8, 9, (h, w + 6 * n, 3), dtype=np.int16)
    field = np.clip(field.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return np.stack([field[:, 6 * k:6 * k + w] for k in range(n)])


def wall_ms(fn, repeat):
    fn()  # warm-up: kernels compile, graphs capture
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return float(np.median(times))


def hf_processor():
    try:
        from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

        return Glm5NextVideoProcessor()
    except Exception as e:  # noqa: BLE001 - the rows say why they are missing
        print("HF rows skipped:", repr(e)[:200])
        return None


def main():
    import cupy

    from glmvit_cupy import GlmVit, preprocess_video

    repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 3
    model = GlmVit.from_checkpoint(official_checkpoint(), capacity_tokens=8000)
    proc = hf_processor()
    rows = []
    for k, (name, h, w, n, fps) in enumerate(CLIPS):
        frames = clip(h, w, n, k)
        pv, grid, (info,) = preprocess_video(frames, fps=fps)
        label = f"{name}: {n} frames {w}x{h} -> {len(info['frames_indices'])} -> {info['canvas'][1]}x" \
                f"{info['canvas'][0]}, {info['tokens']} tokens"

        def host_only():
            preprocess_video(frames, fps=fps)

        def host_path():
            p, g, _ = preprocess_video(frames, fps=fps)
            out = model.encode_video_pixels(p, g)
            cupy.cuda.get_current_stream().synchronize()
            return out

        def gpu_path():
            out = model.encode_video(frames, fps=fps)
            cupy.cuda.get_current_stream().synchronize()
            return out

        same = all(np.array_equal(cupy.asnumpy(a).view(np.uint16), cupy.asnumpy(b).view(np.uint16))
                   for a, b in zip(host_path(), gpu_path()))
        if proc is not None:
            meta = [{"total_num_frames": n, "fps": fps, "duration": n / fps}]
            for device in ("cpu", "cuda"):
                try:
                    ms = wall_ms(lambda: proc(videos=[frames], video_metadata=meta, input_data_format="channels_last",
                                              device=device, return_tensors="pt"), repeat)
                    rows.append([label, f"HF processor only ({device})", f"{ms:.1f}"])
                except Exception as e:  # noqa: BLE001
                    rows.append([label, f"HF processor only ({device})", f"failed: {repr(e)[:80]}"])
        rows.append([label, "ours preprocess_video only (host)", f"{wall_ms(host_only, repeat):.1f}"])
        rows.append([label, "ours host preprocess + encode", f"{wall_ms(host_path, repeat):.1f}"])
        rows.append([label, "ours encode_video (GPU resize)", f"{wall_ms(gpu_path, repeat):.1f}"])
        rows.append([label, "GPU resize bit-equal to host", str(same)])
    print(f"host cores: {os.cpu_count()}")
    table(["clip", "row", "wall ms"], rows)


if __name__ == "__main__":
    main()
