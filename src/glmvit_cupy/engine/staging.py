"""Inputs into the arena's bf16 pixel rows, on the model's stream and outside any CUDA graph (they
differ per call): HF-layout pixel_values, or prepared images whose resize, pad, normalise and patchify
run on the GPU.

An image travels once over PCIe, as uint8 bytes from a page-locked block (so the copy is asynchronous
and the host goes on preparing the next batch while this one uploads and runs), with its resize tables
in the same block. A block is reused only once the event recorded after its upload has completed.
"""

from __future__ import annotations

import cupy
import numpy as np

from .. import resample
from .gemm import BF16
from .ops import patchify, resample_pass, resample_patchify, to_bf16

ALIGN = 256


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PinnedBlocks:
    """Page-locked host blocks in power-of-two sizes (at least 1 MiB), reused once their upload is done;
    at most `keep` bytes stay cached (more are freed)."""

    def __init__(self, keep: int = 1 << 30):
        self.keep = keep
        self._free: list = []  # (size, memory, event of the upload that last read it)

    def take(self, nbytes: int):
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())
        for i, (n, mem, event) in enumerate(self._free):
            if n == size and event.done:
                del self._free[i]
                return mem, size
        return cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(size), 0), size

    def give(self, mem, size: int, event) -> None:
        self._free.append((size, mem, event))
        while sum(n for n, _, _ in self._free) > self.keep:
            done = [i for i, (_, _, e) in enumerate(self._free) if e.done]
            if not done:
                break
            del self._free[done[0]]


class Stager:
    """Prepared images -> bf16 pixel rows. Device scratch for the raw images grows to the largest seen."""

    def __init__(self, value_table, temporal: int, patch: int):
        self.value_table, self.temporal, self.patch = value_table, temporal, patch
        self.pinned = PinnedBlocks()
        self._buffers: dict = {}

    def _device(self, name: str, nbytes: int):
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[name] = cupy.empty(max(nbytes, 1 << 20), dtype=cupy.uint8)
        return buf

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

    def _one(self, image, canvas, content, out) -> None:
        h, w = image.shape[:2]
        is_canvas = (h, w) == canvas
        p = None if is_canvas else resample.plan(h, w, *content)
        tables = [] if p is None else [a for ax in (p.horizontal, p.vertical) if ax is not None
                                       for a in (ax.first, ax.count, ax.weights)]
        offsets, total = [], _round(image.size)
        for t in tables:
            offsets.append(total)
            total += _round(t.nbytes)
        mem, size = self.pinned.take(total)
        host = np.frombuffer(mem, np.uint8, total)
        np.copyto(host[:image.size].reshape(h, w, 3), image)
        for off, t in zip(offsets, tables):
            host[off:off + t.nbytes] = t.reshape(-1).view(np.uint8)
        stream = cupy.cuda.get_current_stream()
        dev = self._device("upload", total)
        cupy.cuda.runtime.memcpyAsync(dev.data.ptr, mem.ptr, total, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self.pinned.give(mem, size, stream.record())  # reusable once this upload has run
        src = dev[:image.size].reshape(h, w, 3)
        if p is None:
            patchify(src, self.value_table, out, self.temporal, self.patch)
            return
        views = [dev[o:o + t.nbytes].view(cupy.int32).reshape(t.shape) for o, t in zip(offsets, tables)]
        horizontal = tuple(views[:3]) if p.horizontal is not None else None
        vertical = tuple(views[-3:]) if p.vertical is not None else None
        if p.vertical_first:  # vertical over every column, then horizontal fused with the patchify
            tmp = self._device("between", content[0] * w * 3)[:content[0] * w * 3].reshape(content[0], w, 3)
            resample_pass(src, vertical, tmp, 0)
            last, tab, along = tmp, horizontal, 1
        elif horizontal is not None and vertical is not None:  # horizontal over the rows the vertical reads
            tmp = self._device("between", p.rows * content[1] * 3)[:p.rows * content[1] * 3].reshape(
                p.rows, content[1], 3)
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
