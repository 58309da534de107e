"""The host side of an encode call, shared by the GPU engine, its replicas, the commands and the service:
images prepared against a capacity, the one packer that groups images into forward passes, a video's
frame groups cut into passes, and work spread over several GPUs. Plain NumPy: tested without a GPU;
it knows nothing of the engine (the engine wraps `preparer`'s function to upload what it makes).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, NamedTuple, TypeVar

import numpy as np

from ..checks import DECODE, check_frame_group, check_max_pixels, check_resize, image_limits
from ..config import VisionGeometry
from ..preprocessing.image import Patching, prepare_canvas
from . import feed

T = TypeVar("T")


def preparer(geo: VisionGeometry, capacity_tokens: int, min_image_tokens=16, max_image_tokens=None,
             max_pixels=None, *, resize: str = "host", decode: str = "cpu") -> Callable:
    """one(index, image, name=None, host_buffer=None) -> (uint8 image, grid, info): an image prepared as the
    reference processor does with these limits (resize "host": Pillow makes the canvas; "gpu": the decoded
    image, for the GPU to resize bit for bit alike; host_buffer(shape), if given, is where it is decoded,
    see preprocessing.decode.rgb_pixels). Safe to call from several threads. Everything about the settings
    is checked here, before any image is read. decode "gpu": JPEGs decoded by nvImageCodec (gpu_decode),
    others by Pillow. The tower's patch geometry decides the canvas and the rows (Patching.of)."""
    patching = Patching.of(geo)
    lo, hi = image_limits(capacity_tokens, min_image_tokens, max_image_tokens)
    check_resize(resize)
    check_max_pixels(max_pixels)
    if decode not in DECODE:
        raise ValueError(f"decode={decode!r}: choose one of {', '.join(map(repr, DECODE))}")
    decoder = None
    if decode == "gpu":
        from ..preprocessing.gpu_decode import Decoder

        decoder = Decoder(max_pixels)

    def one(i, image, name=None, host_buffer=None):
        decoded = decoder.decode(image, i) if decoder is not None else None
        return prepare_canvas(image, i, min_image_tokens=lo, max_image_tokens=hi, max_pixels=max_pixels,
                              resize=resize, decoded=decoded, host_buffer=host_buffer, name=name, patching=patching)

    return one


def prepare_images(geo: VisionGeometry, capacity_tokens: int, images, min_image_tokens=16,
                   max_image_tokens=None, max_pixels=None, *, resize: str = "host", decode: str = "cpu",
                   workers: int | None = None) -> Iterator:
    """Images -> one (uint8 image, grid, info) per image, in order (see preparer), in host memory. Lazy:
    `workers` threads (default feed.default_workers()) prepare ahead. Raises ImageError naming the first
    image that cannot be used, when its turn comes."""
    one = preparer(geo, capacity_tokens, min_image_tokens, max_image_tokens, max_pixels, resize=resize, decode=decode)
    return feed.in_order(one, images, feed.default_workers() if workers is None else workers)


def pack(items: Iterable[T], capacity: int, cost: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive items grouped into batches of total cost <= capacity, in order: a batch closes when
    the next item would not fit. Lazy, so a stream of images can be packed as it arrives. An item
    costing more than the capacity is a ValueError (callers size their limits so none does)."""
    batch, used = [], 0
    for item in items:
        c = cost(item)
        if c > capacity:
            raise ValueError(f"an item of {c} exceeds the capacity of {capacity}")
        if batch and used + c > capacity:
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += c
    if batch:
        yield batch


class Piece(NamedTuple):
    """Whole temporal groups of one video that one forward pass can hold: rows start..start + rows of the
    video rows, grid (groups, h, w), `tokens` output rows."""
    video: int
    start: int
    rows: int
    grid: tuple[int, int, int]
    tokens: int


def frame_pieces(grid: np.ndarray, capacity_tokens: int, merge: int) -> list[Piece]:
    """Videos (a checked grid_thw, one (groups, h, w) each, rows in order) cut into pieces of whole temporal
    groups of at most capacity_tokens tokens, in row order. The tower attends within a group only (each is
    an image of its own to it), so encoding the pieces gives a video's bits. ValueError naming the video
    whose one group exceeds the capacity."""
    pieces, row = [], 0
    for i, (t, h, w) in enumerate(grid.tolist()):
        per_group = check_frame_group(f"video {i}", h, w, merge, capacity_tokens)
        step = capacity_tokens // per_group
        for g in range(0, t, step):
            k = min(step, t - g)
            pieces.append(Piece(i, row, k * h * w, (k, h, w), k * per_group))
            row += k * h * w
    return pieces


def spread(costs, bins: int) -> list[list[int]]:
    """Indices of `costs` split into `bins` groups of near-equal total cost (longest first to the
    least-loaded group); each group keeps its indices in ascending order."""
    if bins < 1:
        raise ValueError(f"bins={bins}: need at least one")
    groups, load = [[] for _ in range(bins)], [0] * bins
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min(range(bins), key=lambda b: (load[b], b))
        groups[b].append(i)
        load[b] += costs[i]
    return [sorted(g) for g in groups]


