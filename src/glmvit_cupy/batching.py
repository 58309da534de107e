"""The host side of an encode call, shared by the GPU engine, its replicas and the CLI: input checks,
images prepared against a capacity, the one packer that groups images into forward passes, and the
spreading of work over several GPUs. Plain NumPy: tested without a GPU.

Two limits, two words: `capacity_tokens` is what one forward pass holds (a model's scratch is sized
from it); `max_image_tokens` is the per-image resize limit of the reference processor.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, NamedTuple, TypeVar

import numpy as np

from . import feed
from .config import VisionGeometry
from .preprocess import Patching, check_max_pixels, check_resize, check_token_limits, is_integer, prepare_canvas

DEFAULT_MAX_IMAGE_TOKENS = 8000  # the reference processor's default per-image limit
DECODE = ("cpu", "gpu")  # who decodes JPEGs: Pillow, or nvImageCodec (the gpu-decode extra)
T = TypeVar("T")


def check_positive(name: str, value, why: str = "") -> int:
    """value as an int, or ValueError: "{name}={value!r} must be a positive integer{why}"."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer{why}")
    return int(value)


def check_capacity(capacity_tokens) -> int:
    """capacity_tokens as an int, or ValueError saying what it must be."""
    return check_positive("capacity_tokens", capacity_tokens,
                          ": the tokens one forward pass holds (the scratch is sized from it)")


def check_grid(grid_thw, merge: int) -> np.ndarray:
    """A batch's grid_thw (host array-like, one (frames, patch rows, patch columns) per image) as int64
    [images, 3], or ValueError naming what is wrong: the GPU encoder and its replicas check alike.
    merge: the tower's spatial_merge_size (patches merge in merge x merge blocks)."""
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"grid_thw must be an integer array of shape [images, 3], got {grid.dtype} {grid.shape}")
    grid = grid.astype(np.int64)
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t < 1 or h < merge or w < merge or h % merge or w % merge:
            what = "even" if merge == 2 else f"multiples of {merge}"
            raise ValueError(f"grid_thw[{i}] = ({t}, {h}, {w}): t must be >= 1 and h, w positive and {what} "
                             f"(patches merge in {merge}x{merge} blocks)")
    return grid


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


def image_limits(capacity_tokens: int, min_image_tokens, max_image_tokens) -> tuple[int, int]:
    """The per-image token limits of an encode(images) call: max_image_tokens=None means the
    reference default (8000), lowered to the model's capacity so that every image fits a pass."""
    if max_image_tokens is None:
        max_image_tokens = min(DEFAULT_MAX_IMAGE_TOKENS, capacity_tokens)
    min_image_tokens, max_image_tokens = check_token_limits(min_image_tokens, max_image_tokens)
    if max_image_tokens > capacity_tokens:
        raise ValueError(f"max_image_tokens={max_image_tokens} exceeds this model's capacity of {capacity_tokens} "
                         f"tokens per forward pass; pass max_image_tokens <= {capacity_tokens} or build the model "
                         f"with capacity_tokens >= {max_image_tokens}")
    return min_image_tokens, max_image_tokens


def preparer(geo: VisionGeometry, capacity_tokens: int, min_image_tokens=16, max_image_tokens=None,
             max_pixels=None, *, resize: str = "host", decode: str = "cpu", host_buffer=None,
             upload=None) -> Callable:
    """one(index, image, name=None) -> (uint8 image, grid, info): an image prepared as the reference processor
    does with these limits (resize "host": Pillow makes the canvas; "gpu": the decoded image, for the GPU to
    resize bit for bit alike, its pixels in host_buffer memory, see preprocess.rgb_pixels). Safe to call from
    several threads. Everything about the settings is checked here, before any image is read. decode "gpu":
    JPEGs decoded by nvImageCodec (gpu_decode), others by Pillow. upload: called with each prepared image on
    the preparing thread, its result handed on instead (uploads.Uploader: the image copied to the GPU there).
    The tower's patch geometry decides the canvas and the rows (preprocess.Patching.of)."""
    patching = Patching.of(geo)
    lo, hi = image_limits(capacity_tokens, min_image_tokens, max_image_tokens)
    check_resize(resize)
    check_max_pixels(max_pixels)
    if decode not in DECODE:
        raise ValueError(f"decode={decode!r}: choose one of {', '.join(map(repr, DECODE))}")
    decoder = None
    if decode == "gpu":
        from .gpu_decode import Decoder

        decoder = Decoder(max_pixels)

    def one(i, image, name=None):
        decoded = decoder.decode(image, i) if decoder is not None else None
        out, grid, info = prepare_canvas(image, i, min_image_tokens=lo, max_image_tokens=hi, max_pixels=max_pixels,
                                         resize=resize, decoded=decoded, host_buffer=host_buffer, name=name,
                                         patching=patching)
        return (out if upload is None else upload(out)), grid, info

    return one


def prepare_images(geo: VisionGeometry, capacity_tokens: int, images, min_image_tokens=16,
                   max_image_tokens=None, max_pixels=None, *, resize: str = "host", decode: str = "cpu",
                   workers: int | None = None, host_buffer=None, upload=None) -> Iterator:
    """Images -> one (uint8 image, grid, info) per image, in order (see preparer). Lazy: `workers` threads
    (default feed.default_workers()) prepare ahead. Raises ImageError naming the first image that cannot be
    used, when its turn comes."""
    one = preparer(geo, capacity_tokens, min_image_tokens, max_image_tokens, max_pixels, resize=resize,
                   decode=decode, host_buffer=host_buffer, upload=upload)
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


def check_frame_group(name: str, h: int, w: int, merge: int, capacity_tokens: int) -> int:
    """The tokens of one temporal group of h x w patches, or ValueError naming the video when one forward
    pass cannot hold it (a group is the tower's unit: its frames attend to each other)."""
    per_group = h * w // merge ** 2
    if per_group > capacity_tokens:
        raise ValueError(f"{name}: one frame group of {h}x{w} patches is {per_group} tokens, more than this "
                         f"model's capacity of {capacity_tokens} per forward pass; preprocess it with a lower "
                         "max_image_tokens or build the model with a larger capacity_tokens")
    return per_group


def check_planned_videos(planned: list, merge: int, capacity_tokens: int) -> None:
    """check_frame_group for each of video.plan_videos' (frames, grid, info), named by its info's source."""
    for _, (_, h, w), info in planned:
        check_frame_group(info["source"], h, w, merge, capacity_tokens)


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
