"""The two 8-bit BICUBIC resizes of the reference processors, as integer tables: Pillow's (images) and
ATen's antialiased uint8 path (videos, which the reference resizes with torchvision).

The reference processor resizes with Pillow (Image.resize(..., BICUBIC), src/libImaging/Resample.c),
whose 8-bit path is integer arithmetic once its coefficients are made: per output column (or row),
double-precision bicubic weights (a = -0.5) over a support stretched by the scale when shrinking,
normalised to sum 1, then rounded half away from zero to fixed point with 22 fractional bits. Each
pass adds 2^21 to the sum of byte x coefficient and keeps bits 22.. clipped to 0..255; a horizontal
pass over the rows the vertical pass needs, then the vertical pass, each skipped when its side keeps
its size. `tables` computes those coefficients with the same double operations in the same order
(so the integers are Pillow's); `resize` applies them with NumPy integers (the check the GPU kernels
and the tests compare against; Pillow itself stays the host path's resizer).

Exactness assumes Pillow built without fused multiply-add in these few lines (x86-64 wheels: SSE2,
no FMA); tests/test_resample.py compares against the installed Pillow on hundreds of size pairs.

The reference video processor resizes uint8 frames with torchvision's resize (BICUBIC, antialias), which on
the CPU runs ATen's uint8 path (aten/src/ATen/native/cpu/UpSampleKernel.cpp and its AVX2 twin, both
integer): the same support, centres and normalisation as Pillow, but the far lobe written as
((a x - 5a) x + 8a) x - 4a, the weights rounded to int16 with as many fractional bits as the largest
weight of the side allows (at most 22), and always the horizontal pass first. `aten_axis`, `aten_tables` and
`aten_resize` are that path (the GPU runs the same tables: engine/staging.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache, wraps

import numpy as np

PRECISION_BITS = 22  # 32 - 8 bits of result - 2 bits of headroom for the filter's negative lobes
SUPPORT = 2.0  # bicubic
CHUNK = 1 << 20  # weights made at a time (8 MiB of float64 an array)
CACHE_BYTES = 256 << 20  # resize tables kept for their sizes' next images


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's bicubic_filter (a = -0.5), elementwise, with its operations in its order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@dataclass(frozen=True)
class Axis:
    """One pass's tables: output position i reads `count[i]` inputs from `first[i]` on, weighted by
    `weights[i, :count[i]]` (int32 fixed point with `precision` fractional bits; zero beyond count)."""
    first: np.ndarray    # int32 [out]
    count: np.ndarray    # int32 [out]
    weights: np.ndarray  # int32 [out, taps]
    precision: int = PRECISION_BITS  # fractional bits of the weights (Pillow: 22; ATen: per side)

    @property
    def taps(self) -> int:
        return self.weights.shape[1]

    @property
    def nbytes(self) -> int:
        return self.first.nbytes + self.count.nbytes + self.weights.nbytes


def _aten_bicubic(x: np.ndarray) -> np.ndarray:
    """ATen's HelperInterpCubic::aa_filter (a = -0.5: antialias), elementwise, with its operations in its order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _weights(in_size: int, out_size: int, scale: float, kernel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, count, float64 weights [out, taps]) of an antialiased bicubic side: Pillow's precompute_coeffs,
    which ATen's _compute_indices_min_size_weights_aa repeats (the kernel aside). Rows of positions at a time,
    so that what is made beside the table stays bounded (a 1 x 20,000,000 image's side has 224,000 x 359 taps)."""
    if in_size < 1 or out_size < 1:
        raise ValueError(f"resize from {in_size} to {out_size} pixels: both sides must be at least 1")
    filterscale = max(scale, 1.0)
    support = SUPPORT * filterscale
    taps = int(np.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    ss = 1.0 / filterscale
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)   # C's (int) truncates
    last = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64)
    count = np.clip(last - first, 0, taps)  # ATen clips; Pillow's count never exceeds taps either
    w = np.empty((out_size, taps), dtype=np.float64)
    x = np.arange(taps, dtype=np.int64)
    step = max(1, CHUNK // taps)
    for a in range(0, out_size, step):
        b = min(out_size, a + step)
        live = x < count[a:b, None]
        wx = np.where(live, kernel(((x + first[a:b, None]).astype(np.float64) - center[a:b, None] + 0.5) * ss), 0.0)
        # The running sum adds in Pillow's order: cumsum is sequential, and the zeros past `count` add nothing.
        total = np.cumsum(wx, axis=1)[:, -1]
        w[a:b] = np.where((total != 0.0)[:, None], wx / np.where(total != 0.0, total, 1.0)[:, None], wx)
    return first, count, w


def _fixed(w: np.ndarray, bits: int) -> np.ndarray:
    """Weights to fixed point with `bits` fractional bits, rounded half away from zero as C's (int)(v +- 0.5)."""
    out = np.empty(w.shape, dtype=np.int32)
    step = max(1, CHUNK // w.shape[1])  # w has at least one tap
    for a in range(0, len(w), step):
        v = w[a:a + step] * float(1 << bits)
        out[a:a + step] = np.where(v < 0, np.trunc(-0.5 + v), np.trunc(0.5 + v))
    return out


def _pillow_taps(in_size: int, out_size: int) -> int:
    """The taps of a side axis() makes: Pillow's ksize, from its scale (double)(float in) / out."""
    return int(np.ceil(SUPPORT * max(float(np.float32(in_size)) / out_size, 1.0))) * 2 + 1


def table_bytes(in_size: int, out_size: int) -> int:
    """The bytes of one side's tables (Axis.nbytes), 0 where the side keeps its size: what resizing holds beside
    the image (1 x 20,000,000 pixels to its 8,000-token canvas: 323 MB)."""
    if in_size == out_size or in_size < 1 or out_size < 1:
        return 0
    return out_size * (_pillow_taps(in_size, out_size) + 2) * 4


def pillow_refuses(in_size: int, out_size: int) -> bool:
    """Whether Pillow's precompute_coeffs refuses this side (MemoryError) before resizing: its double weights,
    out_size x taps, would pass INT_MAX bytes (a 68,000,000 x 1 image to 28 x 28 is; 66,000,000 x 1 is not)."""
    if in_size == out_size or in_size < 1 or out_size < 1:
        return False
    return out_size > (2**31 - 1) // (_pillow_taps(in_size, out_size) * 8)


def axis(in_size: int, out_size: int) -> Axis:
    """Pillow's precompute_coeffs + normalize_coeffs_8bpc for a whole side (box 0..in_size) read
    as out_size positions."""
    scale = float(np.float32(in_size)) / out_size if in_size >= 1 and out_size >= 1 else 0.0
    first, count, w = _weights(in_size, out_size, scale, _bicubic)  # Pillow: (double)(float in) / outSize
    return Axis(first.astype(np.int32), count.astype(np.int32), _fixed(w, PRECISION_BITS))


def aten_axis(in_size: int, out_size: int) -> Axis:
    """ATen's uint8 antialiased bicubic weights for a side (_compute_index_ranges_int16_weights): the
    fractional bits are the first count p for which round(max weight * 2^(p + 1)) reaches 2^15 (so every
    weight fits an int16), at most 22."""
    scale = in_size / out_size if in_size >= 1 and out_size >= 1 else 0.0
    first, count, w = _weights(in_size, out_size, scale, _aten_bicubic)
    wt_max = max(0.0, float(w.max()))
    bits = 0
    while bits < 22 and int(0.5 + wt_max * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    return Axis(first.astype(np.int32), count.astype(np.int32), _fixed(w, bits), bits)


# Which pass Pillow runs first. The order changes the 8-bit intermediate, so it changes output bits, and
# Pillow has changed it: up to 12.2 always horizontal first; 12.3's Image.resize runs the vertical pass
# first for images taller than 100x their width whose height shrinks; 13.0 (its pull request 9549, in C)
# runs the vertical pass first when the height shrinks by more than twice as many pixels as the width
# (checked against Pillow 13.0 on 1,482 size pairs where the order matters: all agree). `pass_order()`
# finds the rule the installed Pillow follows by probing it; the GPU resizes only when one reproduces it.
ORDERS = {
    "horizontal first": lambda h, w, oh, ow: False,
    "vertical first for images over 100x taller than wide (Pillow 12.3)": lambda h, w, oh, ow: h > w * 100 and oh < h,
    "vertical first when the height shrinks more than twice the width (Pillow 13)":
        lambda h, w, oh, ow: h > oh and h - oh > 2 * (w - ow),
}
# Size pairs (h, w, out_h, out_w) on which the rules differ, either side of their boundaries, with both
# passes needed: a probe each.
_PROBES = ((40, 10, 10, 9), (37, 20, 20, 12), (31, 30, 12, 20), (12, 40, 20, 9), (30, 24, 20, 19), (30, 24, 20, 20),
           (29, 24, 20, 20), (60, 61, 7, 35), (9, 50, 4, 60), (250, 2, 40, 1), (303, 3, 100, 2), (1000, 9, 999, 1),
           (700, 7, 690, 3), (200, 2, 150, 1))


@lru_cache(maxsize=1)
def pass_order() -> str | None:
    """The name of the ORDERS rule the installed Pillow's BICUBIC follows, or None when none reproduces
    it bit for bit on the probes (random bytes, so the clamp and every tap count)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    cases = []
    for h, w, oh, ow in _PROBES:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        img[::3] = 255 * (img[::3] > 127)  # hard edges: the filter's lobes overshoot and clip
        want = np.asarray(Image.fromarray(img).resize((ow, oh), resample=Image.Resampling.BICUBIC))
        cases.append((img, oh, ow, want))
    for name, rule in ORDERS.items():
        if all(np.array_equal(resize(img, oh, ow, rule), want) for img, oh, ow, want in cases):
            return name
    import warnings

    warnings.warn(f"Pillow {Image.__version__}: its BICUBIC pass order is none this version of glmvit-cupy knows; "
                  "images are resized on the host by Pillow itself (resize='gpu' falls back)", RuntimeWarning)
    return None


@dataclass(frozen=True)
class ResizeTables:
    """Resizing an (height, width) image to (out_h, out_w) as Pillow (or ATen) does, as two passes or fewer.

    Horizontal first: the horizontal pass over input rows row0..row0 + rows (those the vertical pass
    reads; its `first` indices count from row0), then the vertical pass. Vertical first: the vertical
    pass over all columns, then the horizontal pass. A pass is None where its side keeps its size."""
    size: tuple[int, int]
    out: tuple[int, int]
    horizontal: Axis | None
    vertical: Axis | None
    vertical_first: bool
    row0: int
    rows: int


def _cached(make):
    """make(*args), kept for the next call with those arguments: the last 256 tables made, at most CACHE_BYTES of
    them (photos repeat their sizes; an image far from square has tables of hundreds of MB, made again rather than
    kept). Safe across threads: the decoding threads make tables, the thread that drives the GPU looks them up."""
    kept: OrderedDict = OrderedDict()  # args -> (tables, their bytes)
    held = [0]  # bytes kept
    lock = threading.Lock()

    @wraps(make)
    def cached(*args):
        with lock:
            if args in kept:
                kept.move_to_end(args)
                return kept[args][0]
        tables = make(*args)
        size = sum(a.nbytes for a in (tables.horizontal, tables.vertical) if a is not None)
        with lock:
            if size <= CACHE_BYTES and args not in kept:
                kept[args] = (tables, size)
                held[0] += size
                while len(kept) > 256 or held[0] > CACHE_BYTES:
                    held[0] -= kept.popitem(last=False)[1][1]
        return tables

    def cache_clear():
        with lock:
            kept.clear()
            held[0] = 0

    cached.cache_clear = cache_clear
    return cached


@_cached
def pillow_tables(height: int, width: int, out_h: int, out_w: int, vertical_first=None) -> ResizeTables:
    """vertical_first: a rule from ORDERS (default: the installed Pillow's, pass_order()). Cached: the
    decoding threads make the tables, the thread that drives the GPU looks them up."""
    if vertical_first is None:
        vertical_first = ORDERS[pass_order() or "horizontal first"]
    horizontal = axis(width, out_w) if out_w != width else None
    vertical = axis(height, out_h) if out_h != height else None
    both = horizontal is not None and vertical is not None
    return _tables((height, width), (out_h, out_w), horizontal, vertical, both and vertical_first(height, width, out_h,
                                                                                               out_w))


@_cached
def aten_tables(height: int, width: int, out_h: int, out_w: int) -> ResizeTables:
    """ATen's uint8 antialiased BICUBIC as ResizeTables: its weights, the horizontal pass first. Cached: a video's
    frames share one."""
    horizontal = aten_axis(width, out_w) if out_w != width else None
    vertical = aten_axis(height, out_h) if out_h != height else None
    return _tables((height, width), (out_h, out_w), horizontal, vertical, False)


def _tables(size, out, horizontal, vertical, vertical_first: bool) -> ResizeTables:
    """The ResizeTables of these passes; horizontal first, the horizontal pass covers only the rows the vertical
    pass reads (the others cannot change a byte of the output)."""
    if vertical_first or horizontal is None or vertical is None:
        return ResizeTables(size, out, horizontal, vertical, vertical_first, 0, size[0])
    row0 = int(vertical.first[0])
    rows = int(vertical.first[-1] + vertical.count[-1]) - row0
    if row0:
        vertical = replace(vertical, first=vertical.first - np.int32(row0))
    return ResizeTables(size, out, horizontal, vertical, False, row0, rows)


def _apply(src: np.ndarray, ax: Axis, along: int) -> np.ndarray:
    """One pass over uint8 src [H, W, C] along axis `along` (1: columns, 0: rows) -> uint8: tap by tap, each
    output position adds byte x weight in int32, as the C does (the sums fit: bytes < 2^8, and a position's
    weights add up to at most ~1.3 x 2^22 in absolute value)."""
    idx = np.minimum(ax.first[:, None].astype(np.int64) + np.arange(ax.taps), src.shape[along] - 1)  # weight 0
    shape = [1, 1, 1]
    shape[along] = len(ax.first)
    acc = np.full([len(ax.first) if a == along else n for a, n in enumerate(src.shape)], 1 << (ax.precision - 1),
                  dtype=np.int32)
    for t in range(ax.taps):
        k = ax.weights[:, t].reshape(shape)
        if np.any(k):
            acc += np.take(src, idx[:, t], axis=along).astype(np.int32) * k
    return np.clip(acc >> ax.precision, 0, 255).astype(np.uint8)


def _run(rgb: np.ndarray, p: ResizeTables) -> np.ndarray:
    x = rgb
    if p.vertical_first:
        x = _apply(_apply(rgb, p.vertical, 0), p.horizontal, 1)
    else:
        if p.horizontal is not None:
            x = _apply(rgb[p.row0:p.row0 + p.rows], p.horizontal, 1)
        if p.vertical is not None:
            x = _apply(x, p.vertical, 0)
    return np.ascontiguousarray(x)


def resize(rgb: np.ndarray, out_h: int, out_w: int, vertical_first=None) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [out_h, out_w, C], equal to Pillow's BICUBIC resize, in NumPy integers
    (vertical_first: as for pillow_tables)."""
    return _run(rgb, pillow_tables(rgb.shape[0], rgb.shape[1], out_h, out_w, vertical_first))


def aten_resize(rgb: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [out_h, out_w, C] as ATen's uint8 BICUBIC antialias resize (torchvision's
    resize of a uint8 tensor on the CPU): the horizontal pass first, each pass skipped where its side keeps
    its size, an 8-bit result after each."""
    return _run(rgb, aten_tables(rgb.shape[0], rgb.shape[1], out_h, out_w))
