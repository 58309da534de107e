"""Inputs into the arena's pixel rows, on the model's stream and outside any CUDA graph (they differ per
call): HF-layout pixel_values (float32 rows the forward casts, or bf16 rows), or prepared images and
video frame groups whose resize, pad, normalise and patchify run on the GPU (bf16 rows): images as the
image processor (Pillow's resize, its value table), frames as the video processor (ATen's resize, its
table), each frame of a group into its own slot of the rows.

An image travels once over PCIe, as uint8 bytes (4 a pixel, as Pillow decodes them; the GPU drops the
fourth). With one GPU the prepare threads upload their images themselves (uploads.py): this thread only
orders its stream after their copies. Otherwise the image comes from a page-locked block lent by
pools.HOST to the thread that decoded it, or is copied through one; either way the copy is asynchronous
and the host goes on preparing the next batch while this one uploads and runs.
"""

from __future__ import annotations

import cupy
import numpy as np

from ..preprocessing import resample
from ..preprocessing.decode import four_channels
from .gemm import BF16
from .ops import patchify, resample_pass, resample_patchify
from .pools import HOST
from .uploads import Uploaded

ALIGN = 256


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Stager:
    """Prepared images -> bf16 pixel rows. Device scratch for the raw images grows to the largest seen."""

    def __init__(self, value_table, temporal: int, patch: int, merge: int, video_table=None):
        self.value_table, self.temporal, self.patch, self.merge = value_table, temporal, patch, merge
        self.video_table = video_table  # [3, 256] float32 of the video processor (None: no videos)
        self.pinned = HOST
        self._buffers: dict = {}
        self._last_tables = (None, [])  # (plan, its device tables in the "tables" scratch)

    @property
    def scratch_bytes(self) -> int:
        """Device bytes the scratch buffers hold."""
        return sum(b.nbytes for b in self._buffers.values())

    def _scratch(self, name: str, shape) -> cupy.ndarray:
        """A uint8 device array of this shape in the scratch `name` (grown when too small)."""
        nbytes = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[name] = cupy.empty(max(nbytes, 1 << 20), dtype=cupy.uint8)
        return buf[:nbytes].reshape(shape)

    def images(self, items, pixels) -> None:
        """(uint8 image, grid, info) items -> pixels rows, in order. The image is the canvas (host resize: its
        shape is the grid's, times the patch) or the decoded image to resize to info["content"] and pad; or a
        video's frame group (video.FrameGroup: `temporal` HxWx3 uint8 frames, from video.frame_groups). An
        image is a host array or Uploaded (on this device)."""
        row, uploaded = 0, []
        try:
            for image, grid, info in items:
                canvas = (int(grid[1]) * self.patch, int(grid[2]) * self.patch)
                rows = int(grid[1]) * int(grid[2])
                frames = len(image.shape) == 4
                size = tuple(image.shape[1:3] if frames else image.shape[:2])
                if size != canvas and "content" not in info:
                    raise ValueError(f"{info.get('source', 'an image')}: a decoded {size[0]}x{size[1]} "
                                     f"image for a {canvas[0]}x{canvas[1]} canvas needs info['content'], the size to "
                                     "resize it to (prepare_canvas gives it)")
                if isinstance(image, Uploaded):
                    if image.device != cupy.cuda.Device().id:
                        raise ValueError(f"{info.get('source', 'an image')}: uploaded to GPU {image.device}, staged "
                                         f"on GPU {cupy.cuda.Device().id}; prepare it for the model that encodes it")
                    uploaded.append(image)
                content, out = tuple(info.get("content", canvas)), pixels[row:row + rows]
                if frames:
                    self._frames(image, grid, info, canvas, content, out)
                else:
                    self._one(image, canvas, content, out)
                row += rows
        finally:  # an uploaded block is reused once what this stream queued reading it has run
            if uploaded:
                done = cupy.cuda.get_current_stream().record()
                for image in uploaded:
                    image.block.event = done

    def _frames(self, frames, grid, info, canvas, content, out) -> None:
        where = info.get("source", "a video")
        if self.video_table is None:
            raise ValueError(f"{where}: this Stager was made without the video processor's value table")
        if int(grid[0]) != 1 or len(frames) != self.temporal or not all(
                isinstance(f, np.ndarray) and f.dtype == np.uint8 and f.shape == frames[0].shape and f.shape[2:] == (3,)
                for f in frames):
            raise ValueError(f"{where}: a frame group is {self.temporal} uint8 HxWx3 frames of one size with grid "
                             f"(1, h, w); got {[getattr(f, 'shape', type(f).__name__) for f in frames]} with grid "
                             f"{tuple(int(g) for g in grid)}")
        for t in range(self.temporal):
            self._one(frames[t], canvas, content, out, slot=t)

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
        """A resize plan's int32 tables (first, count, weights per pass), uploaded in one copy; the last plan's
        are kept (a video's frames share one)."""
        if self._last_tables[0] is p:
            return self._last_tables[1]
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
        views = [dev[o:o + t.nbytes].view(cupy.int32).reshape(t.shape) for o, t in zip(offsets, tables)]
        self._last_tables = (p, views)
        return views

    def _one(self, image, canvas, content, out, slot: int = -1) -> None:
        """An image into out's rows (slot -1: every frame of a row), or frame `slot` of a video's group."""
        h, w = image.shape[:2]
        src = self._upload(image)
        table = self.value_table if slot < 0 else self.video_table
        args = (self.temporal, self.patch, self.merge)
        if (h, w) == canvas:
            patchify(src, table, out, *args, slot=slot)
            return
        p = resample.pillow_tables(h, w, *content) if slot < 0 else resample.aten_tables(h, w, *content)
        views = self._tables(p)
        horizontal = tuple(views[:3]) if p.horizontal is not None else None
        vertical = tuple(views[-3:]) if p.vertical is not None else None
        if p.vertical_first:  # vertical over every column, then horizontal fused with the patchify
            tmp = self._scratch("between", (content[0], w, 3))
            resample_pass(src, vertical, tmp, 0, p.vertical.precision)
            last, tab, ax, along = tmp, horizontal, p.horizontal, 1
        elif horizontal is not None and vertical is not None:  # horizontal over the rows the vertical reads
            tmp = self._scratch("between", (p.rows, content[1], 3))
            resample_pass(src[p.row0:p.row0 + p.rows], horizontal, tmp, 1, p.horizontal.precision)
            last, tab, ax, along = tmp, vertical, p.vertical, 0
        elif horizontal is not None:
            last, tab, ax, along = src, horizontal, p.horizontal, 1
        elif vertical is not None:
            last, tab, ax, along = src, vertical, p.vertical, 0
        else:
            last, tab, ax, along = src, None, None, -1
        resample_patchify(last, tab, along, content, table, out, canvas, *args,
                          precision=resample.PRECISION_BITS if ax is None else ax.precision, slot=slot)


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
