"""Inputs into the arena's bf16 pixel rows, on the model's stream and outside any CUDA graph (they
differ per call): HF-layout pixel_values, or prepared images whose resize, pad, normalise and patchify
run on the GPU.

An image travels once over PCIe, as uint8 bytes from page-locked memory, so the copy is asynchronous
and the host goes on preparing the next batch while this one uploads and runs. The prepare threads
write decoded images straight into page-locked blocks lent by HOST (4 bytes a pixel, as Pillow keeps
them; the GPU drops the fourth), so the thread that drives the GPU copies nothing. A block goes back
for reuse once its array is garbage and the upload that last read it has completed.
"""

from __future__ import annotations

import threading
import weakref

import cupy
import numpy as np

from .. import resample
from .gemm import BF16
from .ops import patchify, resample_pass, resample_patchify, to_bf16

ALIGN = 256
PORTABLE = 1  # cudaHostAllocPortable: page-locked for every device's context (replicas share the blocks)


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Block:
    """A page-locked block and the event of the last upload that read it (None: not uploaded)."""

    __slots__ = ("mem", "size", "event")

    def __init__(self, size: int):
        self.mem = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(size, PORTABLE), 0)
        self.size, self.event = size, None

    @property
    def idle(self) -> bool:
        return self.event is None or self.event.done


class PinnedBlocks:
    """Page-locked host blocks in power-of-two sizes (at least 1 MiB), reused once idle; at most `keep`
    bytes of free blocks stay cached (more are freed). Thread-safe: prepare threads take blocks for the
    images they decode (array), the GPU's thread for its resize tables (take, give)."""

    def __init__(self, keep: int = 2 << 30):
        self.keep = keep
        self._free: list[_Block] = []
        self._lent: dict[int, _Block] = {}  # data address of a lent array -> its block
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> _Block:
        """The smallest idle free block that holds nbytes, or a new one."""
        with self._lock:
            fits = [b for b in self._free if b.size >= nbytes and b.idle]
            if fits:
                block = min(fits, key=lambda b: b.size)
                self._free.remove(block)
                return block
        return _Block(max(1 << 20, 1 << (nbytes - 1).bit_length()))

    def give(self, block: _Block) -> None:
        with self._lock:
            self._free.append(block)
            total = sum(b.size for b in self._free)
            for b in sorted((b for b in self._free if b.idle), key=lambda b: b.size):
                if total <= self.keep:
                    break
                self._free.remove(b)
                total -= b.size

    def array(self, shape) -> np.ndarray:
        """A uint8 array of this shape in a page-locked block, which returns to the free list when the
        array (and every view of it) is garbage; in ordinary memory if no more can be page-locked."""
        nbytes = int(np.prod(shape))
        try:
            block = self.take(nbytes)
        except (cupy.cuda.runtime.CUDARuntimeError, MemoryError):
            return np.empty(shape, np.uint8)  # the GPU's thread copies it into a block of its own
        out = np.frombuffer(block.mem, np.uint8, nbytes).reshape(shape)
        address = out.__array_interface__["data"][0]
        with self._lock:
            self._lent[address] = block
        weakref.finalize(out, self._back, address)
        return out

    def _back(self, address: int) -> None:
        with self._lock:
            block = self._lent.pop(address)
        self.give(block)

    def lent(self, image: np.ndarray) -> _Block | None:
        """The block under `image` when it is an [H, W, :3] view of an [H, W, 4] array from `array`."""
        h, w = image.shape[:2]
        if image.strides != (w * 4, 4, 1):
            return None
        with self._lock:
            block = self._lent.get(image.__array_interface__["data"][0])
        return block if block is not None and block.size >= h * w * 4 else None


HOST = PinnedBlocks()  # shared by every model of the process: prepare threads do not know the device


class Stager:
    """Prepared images -> bf16 pixel rows. Device scratch for the raw images grows to the largest seen."""

    def __init__(self, value_table, temporal: int, patch: int):
        self.value_table, self.temporal, self.patch = value_table, temporal, patch
        self.pinned = HOST
        self._buffers: dict = {}

    def _scratch(self, name: str, shape) -> cupy.ndarray:
        """A uint8 device array of this shape in the scratch `name` (grown when too small)."""
        nbytes = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[name] = cupy.empty(max(nbytes, 1 << 20), dtype=cupy.uint8)
        return buf[:nbytes].reshape(shape)

    def images(self, items, pixels) -> None:
        """(uint8 image, grid, info) items -> pixels rows, in order. The image is the canvas (host resize: its
        shape is the grid's, times the patch) or the decoded image to resize to info["content"] and pad."""
        row = 0
        for image, grid, info in items:
            canvas = (int(grid[1]) * self.patch, int(grid[2]) * self.patch)
            rows = int(grid[1]) * int(grid[2])
            if tuple(image.shape[:2]) != canvas and "content" not in info:
                raise ValueError(f"{info.get('source', 'an image')}: a decoded {image.shape[0]}x{image.shape[1]} image "
                                 f"for a {canvas[0]}x{canvas[1]} canvas needs info['content'], the size to resize it "
                                 "to (prepare_canvas gives it)")
            self._one(image, canvas, tuple(info.get("content", canvas)), pixels[row:row + rows])
            row += rows

    def _upload(self, image) -> cupy.ndarray:
        """A host uint8 [H, W, 3] image -> the same on this device, asynchronously on the current stream. An
        image in a lent page-locked block is copied from there (4 bytes a pixel) and packed on the GPU;
        another is first copied into a page-locked block here."""
        h, w = image.shape[:2]
        stream = cupy.cuda.get_current_stream()
        block = self.pinned.lent(image)
        if block is not None:
            four = self._scratch("upload4", (h, w, 4))
            cupy.cuda.runtime.memcpyAsync(four.data.ptr, block.mem.ptr, four.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            block.event = stream.record()  # the block is reused only once this upload has run
            out = self._scratch("upload", (h, w, 3))
            out[...] = four[..., :3]
            return out
        block = self.pinned.take(image.size)
        np.copyto(np.frombuffer(block.mem, np.uint8, image.size).reshape(h, w, 3), image)
        out = self._scratch("upload", (h, w, 3))
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, block.mem.ptr, out.nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        block.event = stream.record()
        self.pinned.give(block)
        return out

    def _tables(self, p) -> list[cupy.ndarray]:
        """A resize plan's int32 tables (first, count, weights per pass), uploaded in one copy."""
        tables = [a for ax in (p.horizontal, p.vertical) if ax is not None for a in (ax.first, ax.count, ax.weights)]
        if not tables:
            return []
        offsets, total = [], 0
        for t in tables:
            offsets.append(total)
            total += _round(t.nbytes)
        block = self.pinned.take(total)
        host = np.frombuffer(block.mem, np.uint8, total)
        for off, t in zip(offsets, tables):
            host[off:off + t.nbytes] = t.reshape(-1).view(np.uint8)
        dev = self._scratch("tables", (total,))
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(dev.data.ptr, block.mem.ptr, total, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        block.event = stream.record()
        self.pinned.give(block)
        return [dev[o:o + t.nbytes].view(cupy.int32).reshape(t.shape) for o, t in zip(offsets, tables)]

    def _one(self, image, canvas, content, out) -> None:
        h, w = image.shape[:2]
        src = self._upload(image)
        if (h, w) == canvas:
            patchify(src, self.value_table, out, self.temporal, self.patch)
            return
        p = resample.plan(h, w, *content)
        views = self._tables(p)
        horizontal = tuple(views[:3]) if p.horizontal is not None else None
        vertical = tuple(views[-3:]) if p.vertical is not None else None
        if p.vertical_first:  # vertical over every column, then horizontal fused with the patchify
            tmp = self._scratch("between", (content[0], w, 3))
            resample_pass(src, vertical, tmp, 0)
            last, tab, along = tmp, horizontal, 1
        elif horizontal is not None and vertical is not None:  # horizontal over the rows the vertical reads
            tmp = self._scratch("between", (p.rows, content[1], 3))
            resample_pass(src[p.row0:p.row0 + p.rows], horizontal, tmp, 1)
            last, tab, along = tmp, vertical, 0
        elif horizontal is not None:
            last, tab, along = src, horizontal, 1
        elif vertical is not None:
            last, tab, along = src, vertical, 0
        else:
            last, tab, along = src, None, -1
        resample_patchify(last, tab, along, content, self.value_table, out, canvas, self.temporal, self.patch)


def stage_pixels(pixels_f32, pixels, pixel_values):
    """pixel_values (NumPy or this device's CuPy, float or bf16) -> the bf16 rows `pixels`; the float32
    slot `pixels_f32` carries a NumPy upload before the cast on the GPU."""
    if isinstance(pixel_values, cupy.ndarray) and pixel_values.dtype == BF16:
        pixels[...] = pixel_values
        return
    if isinstance(pixel_values, cupy.ndarray):
        src = cupy.ascontiguousarray(pixel_values, dtype=np.float32)
    else:
        src = pixels_f32
        src.set(np.ascontiguousarray(pixel_values, dtype=np.float32))
    to_bf16(src, pixels)
