"""Host preprocessor: images -> (pixel_values [N, 1176] float32, grid_thw [n, 3] int64).

Bit-identical to transformers' Glm5NextImageProcessorPil: the same PIL decode and
RGB conversion, the same canvas (smart_resize), BICUBIC content resize, zero pad
bottom/right, rescale in float64 then float32, normalise in float32, and patches in
2x2 merge-block order with the frame repeated along the temporal axis. The patch
geometry (14-pixel patches, 2 x 2 merges, 2 frames) is the processor's default; a
tower whose config.json declares another is preprocessed with its own (`Patching`),
as the processor is with its patch_size, merge_size and temporal_patch_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..checks import check_max_pixels, check_resize, check_token_limits, is_integer
from ..errors import ImageError, quoted
from . import resample
from .decode import load, name_of, rgb_pixels

PATCH = 14
MERGE = 2
TEMPORAL = 2
FACTOR = PATCH * MERGE  # 28: one merged token is a 28 x 28 pixel square
# The most pixel values (temporal x H x W x 3) one image or frame group becomes: 2**31 - 1, the most an int32
# index reaches (456,000 tokens of the reference's patching, far past a forward pass). Only token limits or a
# Patching of that order ask for more, and such a canvas would not fit in memory.
PIXEL_VALUE_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class Patching:
    """How a canvas becomes pixel rows: patch_size-pixel square patches, merged merge_size x merge_size into
    a token, the still frame repeated temporal_patch_size times. The defaults are the reference processor's."""

    patch_size: int = PATCH
    merge_size: int = MERGE
    temporal_patch_size: int = TEMPORAL

    def __post_init__(self):
        for field in ("patch_size", "merge_size", "temporal_patch_size"):
            v = getattr(self, field)
            if not is_integer(v) or v < 1:
                raise ValueError(f"Patching: {field}={v!r} must be a positive integer")
            object.__setattr__(self, field, int(v))  # a NumPy integer would wrap in the canvas arithmetic

    @property
    def factor(self) -> int:
        """The side of one token's pixel square (28): canvases are multiples of it."""
        return self.patch_size * self.merge_size

    @classmethod
    def of(cls, geo) -> "Patching":
        """A tower geometry's patching, or ValueError if its patches are not RGB (images have 3 channels)."""
        if geo.in_channels != 3:
            raise ValueError(f"encode(images) makes RGB patches, but this tower's in_channels = {geo.in_channels}; "
                             "use encode_pixels with pixel_values of that many channels")
        return cls(geo.patch_size, geo.spatial_merge_size, geo.temporal_patch_size)


REFERENCE = Patching()


def check_patching(patching) -> Patching:
    if not isinstance(patching, Patching):
        raise TypeError(f"patching={patching!r}: give a glmvit_cupy.Patching, e.g. Patching.of(model.geometry)")
    return patching
MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP
STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, *, min_image_tokens: int = 16, max_image_tokens: int = 8000,
                 factor: int = FACTOR, temporal_factor: int = TEMPORAL, num_frames: int | None = None
                 ) -> tuple[int, int]:
    """The canvas (H, W), multiples of `factor`, for an image (or num_frames video frames) of height x width
    pixels.

    Follows the reference's rules, edge cases included: align up; scale up when under
    the token minimum; when over the maximum, binary-search the largest content
    height (1..height) whose aligned canvas fits, keeping the width proportional.
    """
    check_token_limits(min_image_tokens, max_image_tokens, ordered=False)  # past 2**31 the float math overflows
    if not (is_integer(height) and is_integer(width) and height > 0 and width > 0):
        raise ValueError(f"an image of {height!r} x {width!r} pixels: a size to resize needs both sides positive "
                         "integers (a video stream that declares 0 x 0 has no frame size)")
    # Python ints from here on: NumPy's fixed-width ones would wrap in the products and the binary search.
    height, width, factor, temporal_factor = int(height), int(width), int(factor), int(temporal_factor)
    min_image_tokens, max_image_tokens = int(min_image_tokens), int(max_image_tokens)
    num_frames = None if num_frames is None else int(num_frames)
    for name, v in (("factor", factor), ("temporal_factor", temporal_factor), ("num_frames", num_frames)):
        if v is not None and v < 1:
            raise ValueError(f"smart_resize({name}={v}): {name} must be a positive integer")
    what = "image" if num_frames is None else "video's frames"
    if num_frames is None:
        num_frames = temporal_factor  # a still image is treated as `temporal_factor` frames
    per_token = temporal_factor * factor * factor
    min_px = min_image_tokens * per_token
    max_px = max_image_tokens * per_token
    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)

    def up(v):
        return math.ceil(v / factor) * factor

    def past_limit(h, w):
        values = temporal_factor * h * w * 3
        if values > PIXEL_VALUE_LIMIT:
            said = f"{values:.3g}" if values < 1e300 else quoted(values)  # an int past float range: no .3g
            raise ValueError(f"a {height}x{width} {what} would become a {quoted(h)}x{quoted(w)} canvas of "
                             f"{temporal_factor} frames, {said} pixel values, past the {PIXEL_VALUE_LIMIT:,} one "
                             f"image or frame group may have (min_image_tokens={min_image_tokens}, max_image_tokens="
                             f"{max_image_tokens}, a {quoted(factor)}-pixel token side, {quoted(temporal_factor)} "
                             "frames a patch): lower max_image_tokens, or min_image_tokens where it scaled the image "
                             "up, or the patching's sizes")

    if per_token * 3 > PIXEL_VALUE_LIMIT:  # every canvas holds a token: said before the float math can overflow
        past_limit(up(height), up(width))

    h, w = up(height), up(width)
    if frames * h * w < min_px:
        s = math.sqrt(min_px / (num_frames * height * width))
        h = up(max(1, math.ceil(height * s)))
        w = up(max(1, math.ceil(width * s)))
    if frames * h * w > max_px:
        if max_px < frames * factor * factor:
            raise ValueError(f"max_image_tokens={max_image_tokens} is too small: one aligned "
                             f"{factor}x{factor} patch needs {frames * factor * factor} pixels of budget")
        lo, hi = 1, height
        h, w = factor, factor
        while lo <= hi:
            ch = (lo + hi) // 2
            cw = max(1, math.floor(width * ch / height))
            th, tw = up(ch), up(cw)
            if frames * th * tw <= max_px:
                h, w = th, tw
                lo = ch + 1
            else:
                hi = ch - 1
    past_limit(h, w)
    return h, w


def content_size(height: int, width: int, canvas: tuple[int, int], *, min_image_tokens: int = 16,
                 factor: int = FACTOR, temporal_factor: int = TEMPORAL, num_frames: int | None = None
                 ) -> tuple[int, int]:
    """Size the image (or each of num_frames video frames) is resized to before padding to the canvas:
    aspect kept, never upscaled once it already meets the token minimum."""
    ch_, cw_ = canvas
    scale = min(ch_ / height, cw_ / width)
    frames = temporal_factor if num_frames is None else num_frames
    if frames * height * width >= temporal_factor * factor * factor * min_image_tokens:
        scale = min(1.0, scale)
    return (max(1, min(ch_, math.floor(height * scale))), max(1, min(cw_, math.floor(width * scale))))


def _value_table() -> np.ndarray:
    """float32 [3, 256]: what rescale-then-normalise makes of each uint8 value, per channel.

    Computed with the reference's own operations (x * (1/255) in float64, cast to float32, then
    (x - mean) / std in float32), so looking values up is bit-identical to computing them (the GPU
    patchify looks them up; normalise_patchify computes them)."""
    x = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return (x[None, :] - _MEAN[:, None]) / _STD[:, None]


_MEAN, _STD = np.array(MEAN, dtype=np.float32), np.array(STD, dtype=np.float32)
_TABLE = _value_table()


def value_table() -> np.ndarray:
    """A copy of the float32 [3, 256] uint8 -> normalised-value table (the GPU patchify reads it)."""
    return _TABLE.copy()


def rows_out(out: np.ndarray | None, shape: tuple) -> np.ndarray:
    """normalise_patchify's output: a new float32 array of `shape`, or `out` if it is exactly that."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"normalise_patchify: out must be a C-contiguous float32 {shape}, got {out.dtype} {out.shape}")
    return out


def rows_in_turn(grids: np.ndarray, width: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """One float32 [patches, width] array for these (t, h, w) grids' rows and each grid's slice of it, in order:
    what normalise_patchify(..., out=) fills, image by image, with no concatenation after."""
    sizes = np.prod(grids, axis=1)
    ends = np.cumsum(sizes)
    pixels = np.empty((int(ends[-1]) if len(ends) else 0, width), np.float32)
    return pixels, [pixels[end - n:end] for end, n in zip(ends, sizes)]


def normalise_patchify(canvas_u8: np.ndarray, patching: Patching = REFERENCE,
                       out: np.ndarray | None = None) -> np.ndarray:
    """HxWx3 uint8 canvas -> [H/14 * W/14, 1176] float32 in merge-block patch order (14, 2, 1176: the
    reference patching's; others alike); into `out` when given (a C-contiguous float32 array of that shape:
    preprocess writes each image's rows into its slice of one array)."""
    P, M, T = check_patching(patching).patch_size, patching.merge_size, patching.temporal_patch_size
    hh, ww, c = canvas_u8.shape
    if hh % patching.factor or ww % patching.factor:
        raise ValueError(f"normalise_patchify: a {hh}x{ww} canvas is not made of {patching.factor}-pixel tokens")
    gh, gw = hh // P, ww // P
    # Reorder the bytes first (a quarter of the float traffic): (bh, bw, r, c, channel, py, px).
    p = canvas_u8.reshape(gh // M, M, P, gw // M, M, P, c)
    p = np.ascontiguousarray(p.transpose(0, 3, 1, 4, 6, 2, 5)).reshape(gh * gw, c, P * P)
    # The table's own steps on the rows (x * (1/255) in float64, then float32): its bits, 1.4x faster than
    # looking each value up (the gather cost ~20 ns a value; 188 against 128 ms for a 10k-token canvas).
    vals = np.multiply(p, 1 / 255, dtype=np.float64).astype(np.float32)  # [N, channel, py*px]
    vals -= _MEAN[:c, None]
    vals /= _STD[:c, None]
    out = rows_out(out, (gh * gw, c * T * P * P))
    out.reshape(gh * gw, c, T, P * P)[...] = vals[:, :, None, :]  # the still frame repeated along the temporal axis
    return out


def prepare(image, index: int = 0, *, min_image_tokens: int = 16, max_image_tokens: int = 8000,
            max_pixels: int | None = None, patching: Patching = REFERENCE):
    """One image -> (patches [h*w, 1176] float32, (1, h, w), info dict)."""
    canvas, grid, info = prepare_canvas(image, index, min_image_tokens=min_image_tokens,
                                        max_image_tokens=max_image_tokens, max_pixels=max_pixels, patching=patching)
    return normalise_patchify(canvas, patching), grid, info


def prepare_canvas(image, index: int = 0, *, min_image_tokens: int = 16, max_image_tokens: int = 8000,
                   max_pixels: int | None = None, resize: str = "host", decoded=None, host_buffer=None,
                   name: str | None = None, patching: Patching = REFERENCE):
    """One image -> (uint8 image, (1, H/14, W/14), info dict): everything but the normalise and patchify,
    which the GPU does from these 8x fewer bytes. resize "host": the image is the resized, zero-padded
    canvas [H, W, 3] (Pillow resizes); "gpu": it is the decoded image, which the GPU resizes to
    info["content"] bit for bit as Pillow would and pads to info["canvas"]. `decoded`: the image already
    decoded (an RGB PIL image or HxWx3 uint8 array), e.g. by a GPU decoder. host_buffer: where "gpu" puts
    the decoded pixels (see rgb_pixels). name: what errors and info["source"] call the image (default: its
    path, or its index). patching: the tower's patch geometry (default: the reference processor's)."""
    check_resize(resize)
    check_max_pixels(max_pixels)
    check_patching(patching)
    name = name_of(image, index) if name is None else name
    if resize == "gpu" and resample.pass_order() is None:
        resize = "host"  # an unknown Pillow: its bytes come from Pillow itself (warned once)
    img = load(image, name, max_pixels, host_buffer if resize == "gpu" else None) if decoded is None else decoded
    width, height = img.size if isinstance(img, Image.Image) else (img.shape[1], img.shape[0])
    factor, frames = patching.factor, patching.temporal_patch_size
    canvas = smart_resize(height, width, min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens,
                          factor=factor, temporal_factor=frames)
    ch, cw = content_size(height, width, canvas, min_image_tokens=min_image_tokens, factor=factor,
                          temporal_factor=frames)
    grid = (1, canvas[0] // patching.patch_size, canvas[1] // patching.patch_size)
    info = {"source": name, "size": (height, width), "canvas": canvas, "content": (ch, cw),
            "grid": grid, "tokens": grid[1] * grid[2] // patching.merge_size**2, "resize": resize}
    if resample.pillow_refuses(width, cw) or resample.pillow_refuses(height, ch):
        raise ImageError(f"{name}: resizing its {width} x {height} pixels to {cw} x {ch} needs filter tables of over "
                         "2 GiB, which Pillow (the reference's resizer) refuses; an image this far from square "
                         "cannot be encoded")
    if resize == "gpu":
        if (ch, cw) != (height, width):
            resample.pillow_tables(height, width, ch, cw)  # made here, on a decoding thread; the GPU's thread looks it up
        return rgb_pixels(img, host_buffer), grid, info
    if (ch, cw) != (height, width):
        pil = img if isinstance(img, Image.Image) else Image.fromarray(img)
        img = pil.resize((cw, ch), resample=Image.Resampling.BICUBIC)
    rgb = np.asarray(img)
    if (ch, cw) == tuple(canvas):
        return rgb, grid, info
    padded = np.zeros((canvas[0], canvas[1], 3), dtype=np.uint8)
    padded[:ch, :cw] = rgb
    return padded, grid, info


def preprocess(images, *, min_image_tokens: int = 16, max_image_tokens: int = 8000,
               max_pixels: int | None = None, patching: Patching = REFERENCE) -> tuple[np.ndarray, np.ndarray]:
    """Images -> (pixel_values float32 [N, 1176], grid_thw int64 [n, 3]), as the reference processor.

    `images` is one image or a list of them: paths, file objects, bytes, PIL images, or
    HxWx3 uint8 arrays. Raises ImageError naming the first image that cannot be used. `max_pixels`
    raises (or lowers) the decompression-bomb guard for encoded images (default: Pillow's, 89.5 MP).
    `patching`: another tower's patch geometry, e.g. Patching.of(model.geometry) (rows of
    3 x temporal x patch x patch values, merge x merge blocks); default the reference processor's.
    """
    min_image_tokens, max_image_tokens = check_token_limits(min_image_tokens, max_image_tokens)
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ImageError("preprocess: no images given")
    canvases = [prepare_canvas(image, i, min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens,
                               max_pixels=max_pixels, patching=patching)[:2] for i, image in enumerate(images)]
    grids = np.array([grid for _, grid in canvases], dtype=np.int64)
    width = canvases[0][0].shape[2] * patching.temporal_patch_size * patching.patch_size ** 2  # RGB: 3 x T x P^2
    pixels, parts = rows_in_turn(grids, width)
    for (canvas, _), part in zip(canvases, parts):
        normalise_patchify(canvas, patching, out=part)
    return pixels, grids
