"""Every check of what a caller passes in, in one place: counts, limits, devices, settings, and the
pixel rows and grids of encode_pixels. Each returns the value as the library uses it, or raises
ValueError (argparse.ArgumentTypeError for a command-line value) saying what was wrong and what would
be right. Plain Python and NumPy: the GPU engine, the float32 reference, the commands and the service
check alike. One check is of what comes back: embedding_problem, which the commands and the service run
on every embedding before they keep or send it.

Two limits, two words: `capacity_tokens` is what one forward pass holds (a model's scratch is sized
from it); `max_image_tokens` is the per-image resize limit of the reference processor.
"""

from __future__ import annotations

import argparse
import re

import numpy as np

from .config import VisionGeometry
from .errors import quoted


def is_integer(v) -> bool:
    """An int or a NumPy integer, and not a bool (which Python counts as an int): what every count the
    library takes must be."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


TOKEN_LIMIT = 2**31 - 1  # past any image or video: a larger limit would only overflow the resize's float math

RESIZE = ("host", "gpu")  # who resizes: Pillow here, or the GPU bit for bit alike

# The head dims the GPU engine's attention kernels take (engine.attention's SM80_HEAD_DIMS, the Hopper variants'
# 64 among them): here, so the host half says which towers the GPU would refuse (--inspect) without the engine.
# attention_sm80.cu takes any multiple of 4 (the axial RoPE's own condition) up to 256 (its registers and shared
# memory: 169 KB at 256).
GPU_HEAD_DIMS = range(4, 257, 4)


def in_flags(message: str, flags: dict) -> str:
    """A library message that names its arguments (max_image_tokens=5) said with a command's flags for them
    instead (--max-video-tokens 5), for the commands and scripts that take those arguments as flags."""
    return re.sub(r"\b(" + "|".join(map(re.escape, flags)) + r")=", lambda m: flags[m[1]] + " ", message)


def check_resize(resize) -> str:
    if resize not in RESIZE:
        raise ValueError(f"resize={resize!r}: choose one of {', '.join(map(repr, RESIZE))}")
    return resize


def check_max_pixels(max_pixels):
    """The decompression-bomb limit as given: None (Pillow's own) or a positive integer of pixels."""
    if max_pixels is not None and (not is_integer(max_pixels) or max_pixels < 1):
        raise ValueError(f"max_pixels={max_pixels!r} must be a positive integer (pixels an encoded image may have "
                         "before it is refused as a decompression bomb) or None for Pillow's own limit")
    return None if max_pixels is None else int(max_pixels)


def check_token_limits(min_image_tokens, max_image_tokens, what: str = "image", ordered: bool = True,
                       notes: tuple[str, str] = ("", "")) -> tuple[int, int]:
    """The per-image token limits as given, returned as ints: the minimum an integer >= 0 (0: no
    minimum, as the reference allows), the maximum a positive integer, the minimum not above the
    maximum (ordered; the video processor's per-frame limits are not: its smart_resize applies the maximum
    first, as the reference's does, and its default minimum of 16 meets small maxima); a bool is neither.
    notes: what the ordering's message adds after each value (a caller's word that it is a default)."""
    lo, hi = f"min_{what}_tokens", f"max_{what}_tokens"
    for name, v, low in ((lo, min_image_tokens, 0), (hi, max_image_tokens, 1)):
        if not is_integer(v) or not low <= v <= TOKEN_LIMIT:
            raise ValueError(f"{name}={quoted(v)} must be an integer from {low} to {TOKEN_LIMIT:,}")
    if ordered and min_image_tokens > max_image_tokens:
        article = "an" if what[0] in "aeiou" else "a"
        raise ValueError(f"{lo}={min_image_tokens}{notes[0]} is above {hi}={max_image_tokens}{notes[1]}: {article} "
                         f"{what} is resized to between the two, so the minimum must not exceed the maximum")
    return int(min_image_tokens), int(max_image_tokens)


DEFAULT_MAX_IMAGE_TOKENS = 8000  # the reference processor's default per-image limit


DECODE = ("cpu", "gpu")  # who decodes JPEGs: Pillow, or nvImageCodec (the gpu-decode extra)


def check_positive(name: str, value, why: str = "") -> int:
    """value as an int, or ValueError: "{name}={value} must be a positive integer{why}"."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name}={quoted(value)} must be a positive integer{why}")
    return int(value)


def check_capacity(capacity_tokens) -> int:
    """capacity_tokens as an int, or ValueError saying what it must be."""
    return check_positive("capacity_tokens", capacity_tokens,
                          ": the tokens one forward pass holds (the scratch is sized from it)")


def image_limits(capacity_tokens: int, min_image_tokens, max_image_tokens) -> tuple[int, int]:
    """The per-image token limits of an encode(images) call: max_image_tokens=None means the
    reference default (8000), lowered to the model's capacity so that every image fits a pass."""
    notes = ("", "")
    if max_image_tokens is None:
        max_image_tokens = min(DEFAULT_MAX_IMAGE_TOKENS, capacity_tokens)
        notes = ("", f" (the default: {DEFAULT_MAX_IMAGE_TOKENS:,}, lowered to this model's capacity_tokens="
                     f"{capacity_tokens}; lower min_image_tokens or raise capacity_tokens)"
                 if capacity_tokens < DEFAULT_MAX_IMAGE_TOKENS else " (the default)")
    min_image_tokens, max_image_tokens = check_token_limits(min_image_tokens, max_image_tokens, notes=notes)
    if max_image_tokens > capacity_tokens:
        raise ValueError(f"max_image_tokens={max_image_tokens} exceeds this model's capacity of {capacity_tokens} "
                         f"tokens per forward pass; pass max_image_tokens <= {capacity_tokens} or build the model "
                         f"with capacity_tokens >= {max_image_tokens}")
    return min_image_tokens, max_image_tokens


def check_grid(grid_thw, merge: int) -> np.ndarray:
    """A batch's grid_thw (host array-like, one (frames, patch rows, patch columns) per image) as int64
    [images, 3], or ValueError naming what is wrong: the GPU encoder and its replicas check alike.
    merge: the tower's spatial_merge_size (patches merge in merge x merge blocks)."""
    try:
        grid = np.asarray(grid_thw)
    except (ValueError, TypeError) as e:  # a ragged list: NumPy's message names no argument
        raise ValueError(f"grid_thw must be an integer array of shape [images, 3]; {quoted(grid_thw, 60)} is not "
                         f"one ({e})") from None
    if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"grid_thw must be an integer array of shape [images, 3], got {grid.dtype} {grid.shape}")
    if grid.shape[0] == 0:
        raise ValueError("grid_thw holds no image (shape (0, 3)); a batch has at least one: preprocess gives the "
                         "rows and grid_thw of one or more images")
    for i, (t, h, w) in enumerate(grid.tolist()):  # Python ints as given: a uint64 past int64 stays positive
        if max(abs(t), abs(h), abs(w)) >= 2**31:
            raise ValueError(f"grid_thw[{i}] = ({t}, {h}, {w}): a value of magnitude 2**31 or more; no image or "
                             "video has that many frame groups or patches in a dimension")
        if t < 1 or h < merge or w < merge or h % merge or w % merge:
            what = "even" if merge == 2 else f"multiples of {merge}"
            raise ValueError(f"grid_thw[{i}] = ({t}, {h}, {w}): t must be >= 1 and h, w positive and {what} "
                             f"(patches merge in {merge}x{merge} blocks)")
    return grid.astype(np.int64)


def check_pixels(geo: VisionGeometry, pixel_values, grid_thw, capacity_tokens: int | None = None
                 ) -> tuple[np.ndarray, int]:
    """(grid as int64 [images, 3], patch count) for an encode_pixels call (the GPU's, or the reference's
    with no capacity), or ValueError naming what is wrong with pixel_values or grid_thw."""
    grid = check_grid(grid_thw, geo.spatial_merge_size)
    n = sum(t * h * w for t, h, w in grid.tolist())  # plain ints: a small call's host time is the GPU's idle time
    shape = tuple(getattr(pixel_values, "shape", ()))
    if len(shape) != 2 or shape[1] != geo.patch_dim:
        raise ValueError(f"pixel_values has shape {shape}; each row must be one patch of {geo.patch_dim} values "
                         f"(channel {geo.in_channels} x temporal {geo.temporal_patch_size} x {geo.patch_size} x "
                         f"{geo.patch_size})")
    if shape[0] != n:
        raise ValueError(f"pixel_values has {shape[0]} rows but grid_thw describes {n} patches")
    dtype = getattr(pixel_values, "dtype", None)
    if dtype is None or not (dtype.kind in "fiu" or dtype.name == "bfloat16"):  # complex would lose its imaginary part
        raise ValueError(f"pixel_values has dtype {dtype}; it must hold real numbers (float32 as preprocess gives "
                         "them, or bf16, another float or an integer type)")
    mm = geo.merge_patches
    if capacity_tokens is not None and n > capacity_tokens * mm:
        raise ValueError(f"{n} patches ({n // mm} tokens) exceed this model's capacity of {capacity_tokens} tokens "
                         f"({capacity_tokens * mm} patches); split the batch or build the model with a "
                         "larger capacity_tokens")
    return grid, n


def check_frame_group(name: str, h: int, w: int, merge: int, capacity_tokens: int) -> int:
    """The tokens of one temporal group of h x w patches, or ValueError naming the video when one forward
    pass cannot hold it (a group is the tower's unit: its frames attend to each other)."""
    per_group = h * w // merge ** 2
    if per_group > capacity_tokens:
        raise ValueError(f"{name}: one frame group of {h}x{w} patches is {per_group} tokens, more than this "
                         f"model's capacity of {capacity_tokens} per forward pass; lower the video's per-frame "
                         "token limit (preprocess_video's max_image_tokens, glmvit-encode --max-video-tokens, the "
                         "Ray pipeline's max_video_tokens) or raise capacity_tokens (--capacity-tokens)")
    return per_group


def check_planned_videos(planned: list, merge: int, capacity_tokens: int) -> None:
    """check_frame_group for each of video.plan_videos' (frames, grid, info), named by its info's source."""
    for _, (_, h, w), info in planned:
        check_frame_group(info["source"], h, w, merge, capacity_tokens)


def check_device(d, count: int, where: str, hint: str = "") -> int:
    """d as an int if it is a CUDA device ordinal of a machine with `count` of them, or ValueError:
    "{where}{d!r} is not a CUDA device of this machine (it has ...){hint}"."""
    if not is_integer(d) or not 0 <= d < count:
        raise ValueError(f"{where}{d!r} is not a CUDA device of this machine (it has {count}: ordinals "
                         f"0..{count - 1}){hint}")
    return int(d)


def check_devices(devices, count: int) -> list[int]:
    """The device list as ints, or ValueError saying what is wrong with it."""
    if isinstance(devices, (int, str)) or not hasattr(devices, "__iter__"):
        raise ValueError(f"devices={devices!r}: give a list of CUDA device ordinals, e.g. [0, 1]")
    out = list(devices)
    if not out:
        raise ValueError("devices=[]: give at least one CUDA device ordinal")
    return [check_device(d, count, f"devices={out!r}: ") for d in out]


def device_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give CUDA device ordinals separated by commas, e.g. 0,1")
    return out


def nonfinite(embedding: np.ndarray) -> int:
    """How many of an embedding's values are NaN or infinite: a bf16 one (ml_dtypes) by its exponent bits,
    two reductions over a view when there are none (0.04 ms a 192-token embedding on one core); any other float
    array by value."""
    if embedding.dtype.name == "bfloat16":
        bits = np.ascontiguousarray(embedding).view(np.uint16)
        # NaN and infinity are the bit patterns 0x7F80-0x7FFF and 0xFF80-0xFFFF: the largest of the bits read
        # as int16 and as uint16 tell whether there are any, with no temporary array.
        if bits.size == 0 or (bits.view(np.int16).max() < 0x7F80 and bits.max() < 0xFF80):
            return 0
        return int(np.count_nonzero((bits & 0x7F80) == 0x7F80))
    return int(embedding.size - np.count_nonzero(np.isfinite(embedding)))


def embedding_problem(embedding: np.ndarray, where: str) -> str | None:
    """None for an embedding of finite values; else what is wrong with it, naming `where` (the image or
    video): finite weights large enough to overflow the forward's arithmetic give NaN or infinity, and
    such an embedding is never kept or sent."""
    bad = nonfinite(embedding)
    if not bad:
        return None
    return (f"{where}: the tower's output holds {bad:,} NaN or infinite values of {embedding.size:,}: the "
            "checkpoint's weights make the forward overflow for this input (weights too large for float "
            "arithmetic); nothing was kept for it: check the checkpoint")
