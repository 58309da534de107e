"""Seeded random videos and video-processor settings, each rebuilt alike from its number: tools/fuzz_video.py
runs them through HF's Glm5NextVideoProcessor and ours (and writes tests/golden/video_hf.json from HF's
output); tests/test_video.py checks ours against that file on any machine."""

import hashlib

import numpy as np

FPS = (24, 25, 30, 29.97, 10, 5, 1.5, 60)


def case(i: int):
    """(frames uint8 [T, H, W, 3], settings for preprocess_video) of case i."""
    rng = np.random.default_rng(7000 + i)
    t = int(rng.integers(1, 41)) if rng.random() < 0.6 else int(rng.integers(41, 151))
    top = 900 if t <= 40 else 260  # long videos small, to keep a case quick
    side = lambda: int(np.exp(rng.uniform(0, np.log(top))))  # noqa: E731
    h, w = side(), side()
    if rng.random() < 0.1:
        h = int(rng.integers(1, 4))
    if rng.random() < 0.5:  # noise with hard edges: the bicubic lobes overshoot and clip
        frames = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
        frames[:, ::3] = 255 * (frames[:, ::3] > 127)
    else:  # smooth content that moves from frame to frame
        yy, xx = np.mgrid[0:h, 0:w]
        frames = np.stack([((np.sin(xx / (w / 7 + 1) + k)[..., None] * 100 + 127 + (yy[..., None] + 3 * k) % 50)
                            % 256).astype(np.uint8).repeat(3, 2) for k in range(t)])
        frames[..., 1] = 255 - frames[..., 1]
    fps = float(FPS[rng.integers(len(FPS))])
    settings = {"fps": fps,
                "duration": None if rng.random() < 0.6 else round(t / fps * float(rng.uniform(0.8, 1.3)), 3),
                "sample": bool(rng.random() < 0.8),
                "target_fps": float((2, 2, 1, 4, 0.5)[rng.integers(5)]),
                "min_image_tokens": int((16, 16, 0, 64, 300)[rng.integers(5)]),
                "max_image_tokens": int((240000, 2000, 500, 100, 30000, 8)[rng.integers(6)])}
    return frames, settings


def digest(pixel_values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(pixel_values, dtype=np.float32).tobytes()).hexdigest()
