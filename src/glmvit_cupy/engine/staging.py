"""Inputs into the arena's pixel rows, on the model's stream and outside any CUDA graph (they differ per
call): HF-layout pixel_values (float32 rows the forward casts, or bf16 rows), or prepared images whose
resize, pad, normalise and patchify run on the GPU (bf16 rows).

An image travels once over PCIe, as uint8 bytes (4 a pixel, as Pillow decodes them; the GPU drops the
fourth). With one GPU the prepare threads upload their images themselves (uploads.py): this thread only
orders its stream after their copies. Otherwise the image comes from a page-locked block lent by
blocks.HOST to the thread that decoded it, or is copied through one; either way the copy is asynchronous
and the host goes on preparing the next batch while this one uploads and runs.
"""

from __future__ import annotations

import cupy
import numpy as np

from .. import resample
from ..images import four_channels
from .blocks import HOST
from .gemm import BF16
from .ops import patchify, resample_pass, resample_patchify
from .uploads import Uploaded

ALIGN = 256


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Stager:
    """Prepared images -> bf16 pixel rows. Device scratch for the raw images grows to the largest seen."""

    def __init__(self, value_table, temporal: int, patch: int, merge: int):
        self.value_table, self.temporal, self.patch, self.merge = value_table, temporal, patch, merge
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
        shape is the grid's, times the patch) or the decoded image to resize to info["content"] and pad.
        An image is a host array or Uploaded (on this device)."""
        row, uploaded = 0, []
        try:
            for image, grid, info in items:
                canvas = (int(grid[1]) * self.patch, int(grid[2]) * self.patch)
                rows = int(grid[1]) * int(grid[2])
                if tuple(image.shape[:2]) != canvas and "content" not in info:
                    raise ValueError(f"{info.get('source', 'an image')}: a decoded {image.shape[0]}x{image.shape[1]} "
                                     f"image for a {canvas[0]}x{canvas[1]} canvas needs info['content'], the size to "
                                     "resize it to (prepare_canvas gives it)")
                if isinstance(image, Uploaded):
                    if image.device != cupy.cuda.Device().id:
                        raise ValueError(f"{info.get('source', 'an image')}: uploaded to GPU {image.device}, staged "
                                         f"on GPU {cupy.cuda.Device().id}; prepare it for the model that encodes it")
                    uploaded.append(image)
                self._one(image, canvas, tuple(info.get("content", canvas)), pixels[row:row + rows])
                row += rows
        finally:  # an uploaded block is reused once what this stream queued reading it has run
            if uploaded:
                done = cupy.cuda.get_current_stream().record()
                for image in uploaded:
                    image.block.event = done

    def _upload(self, image) -> cupy.ndarray:
        """An image (host uint8 [H, W, 3], or Uploaded) -> [H, W, 3] on this device, in order on the current
        stream. An uploaded image is waited for; a host image in a lent page-locked block is copied from
        there, another through a block of the pool. The first three channels of an [H, W, 4] array travel
        as all four (a memcpy, no gather) and are packed here."""
        h, w = image.shape[:2]
        if isinstance(image, Uploaded):
            cupy.cuda.get_current_stream().wait_event(image.event)
            four = image.array
            if four.shape[2] == 3:
                return four
        elif (block := self.pinned.lent(image)) is not None:  # 4 bytes a pixel, already page-locked
            four = self._scratch("upload4", (h, w, 4))
            stream = cupy.cuda.get_current_stream()
            cupy.cuda.runtime.memcpyAsync(four.data.ptr, block.mem.ptr, four.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            block.event = stream.record()  # the block is reused only once this upload has run
        elif (host := four_channels(image)) is not None:
            four = self._scratch("upload4", (h, w, 4))
            self.pinned.upload(host, four.data.ptr)
        else:
            dev = self._scratch("upload3", (h, w, 3))
            self.pinned.upload(image, dev.data.ptr)
            return dev
        out = self._scratch("upload3", (h, w, 3))
        out[...] = four[..., :3]
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
        host = np.zeros(total, np.uint8)
        for off, t in zip(offsets, tables):
            host[off:off + t.nbytes] = t.reshape(-1).view(np.uint8)
        dev = self._scratch("tables", (total,))
        self.pinned.upload(host, dev.data.ptr)
        return [dev[o:o + t.nbytes].view(cupy.int32).reshape(t.shape) for o, t in zip(offsets, tables)]

    def _one(self, image, canvas, content, out) -> None:
        h, w = image.shape[:2]
        src = self._upload(image)
        if (h, w) == canvas:
            patchify(src, self.value_table, out, self.temporal, self.patch, self.merge)
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
        resample_patchify(last, tab, along, content, self.value_table, out, canvas, self.temporal, self.patch,
                          self.merge)


def stage_pixels(pixels_f32, pixels, pixel_values) -> bool:
    """pixel_values (NumPy or this device's CuPy, float, integer or bf16; n rows) -> the first n rows of the
    arena's slots: float32 ones into `pixels_f32` for the forward's first kernel to cast (True), or bf16
    ones straight into `pixels` (False). A contiguous CuPy float32 or bf16 array travels by one memcpy:
    a kernel launched here would keep the GPU idle for the host's ~50 us it takes (tools/host_share.py)."""
    n = len(pixel_values)
    if isinstance(pixel_values, cupy.ndarray):
        is_bf16 = pixel_values.dtype == BF16
        dst = pixels if is_bf16 else pixels_f32
        if pixel_values.flags.c_contiguous and pixel_values.dtype == dst.dtype:
            stream = cupy.cuda.get_current_stream()
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, pixel_values.data.ptr, pixel_values.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        else:
            dst[:n] = pixel_values  # CuPy casts and gathers on the current stream
        return not is_bf16
    pixels_f32[:n].set(np.ascontiguousarray(pixel_values, dtype=np.float32))
    return True
