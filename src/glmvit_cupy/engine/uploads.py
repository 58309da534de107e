"""Images uploaded by the threads that decode them, for a model on one GPU.

Each prepare thread decodes into a host buffer of its own (ordinary memory, reused image after image) and
copies the image to a device block on a stream of its own; the thread that drives the GPU receives the
block and the event of its copy, and only waits for that event on its stream. Why not page-locked
memory: page-locking costs ~1 ms per MiB (50 ms for 48 MiB on the H200 machine) and, while it runs, every
thread that touches a new page waits (glmvit-encode's first pass decoded ten times slower while its
blocks were pinned); a stream of photos keeps about a gigabyte of images in flight. A copy from ordinary
memory is staged by the driver (~7 GiB/s over all threads, without the GIL): ~7 ms of a decoding thread
for a 12-megapixel photo, and nothing is pinned.
"""

from __future__ import annotations

import threading

import cupy
import numpy as np

from ..preprocessing.decode import four_channels
from .pools import Blocks, DeviceBlock


class Uploaded:
    """A decoded uint8 image on a GPU: `array` is [H, W, 4] (the RGB is its first three channels, as Pillow
    decodes) or [H, W, 3], in a device block; usable on a stream once that stream waits for `event`."""

    __slots__ = ("array", "event", "block", "device", "__weakref__")

    def __init__(self, array, event, block, device: int):
        self.array, self.event, self.block, self.device = array, event, block, device

    @property
    def shape(self) -> tuple:
        return (*self.array.shape[:2], 3)


class Uploader:
    """Called on a prepare thread with a decoded image (uint8 [H, W, 3], in `buffer` memory or any host
    array): returns it as Uploaded on `device`. At most `keep` bytes of idle device blocks stay cached."""

    def __init__(self, device: cupy.cuda.Device, keep: int = 2 << 30):
        self.device = device
        self.blocks = Blocks(keep, alloc=DeviceBlock)
        self._local = threading.local()

    def buffer(self, shape) -> np.ndarray:
        """This thread's host buffer as a uint8 array of `shape` (grown when too small; valid until the
        thread's next call): where the thread decodes its next image."""
        n = int(np.prod(shape))
        host = getattr(self._local, "host", None)
        if host is None or host.size < n:
            host = self._local.host = np.empty(n, np.uint8)
        return host[:n].reshape(shape)

    def uploading(self, one):
        """A host preparer's function (scheduling.batching.preparer's one(i, image, name=None, host_buffer=None))
        made to decode into this thread's buffer and hand on the image uploaded to this GPU."""
        def prepared(i, image, name=None):
            out, grid, info = one(i, image, name=name, host_buffer=self.buffer)
            return self(out), grid, info

        return prepared

    def __call__(self, image: np.ndarray):
        """The image on the device (its copy in flight on this thread's stream), or, if the device has no
        memory left for it, a copy in ordinary memory (the GPU's thread then uploads it)."""
        four = four_channels(image)  # an [H, W, 4] decode (in our buffer): all four bytes travel, one copy
        src = four if four is not None else np.ascontiguousarray(image)
        ptr, shape, nbytes = src.ctypes.data, src.shape, src.nbytes
        with self.device:
            try:
                block = self.blocks.take(nbytes)
            except MemoryError:
                return np.array(image)  # out of our buffer, which this thread reuses next
            stream = getattr(self._local, "stream", None)
            if stream is None:
                stream = self._local.stream = cupy.cuda.Stream(non_blocking=True)
            # From ordinary memory this returns once the driver has staged the bytes: the buffer is free again.
            cupy.cuda.runtime.memcpyAsync(block.mem.ptr, ptr, nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                          stream.ptr)
            block.event = stream.record()
            array = cupy.ndarray(shape, cupy.uint8, memptr=block.mem)
        out = Uploaded(array, block.event, block, self.device.id)
        self.blocks.lend(out, block)  # back to the pool when the batch holding it is done with it
        return out
