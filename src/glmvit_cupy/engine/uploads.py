"""Images uploaded by the threads that decode them, for a model on one GPU.

Each prepare thread decodes into a host buffer of its own (ordinary memory, reused image after image) and
copies the image to a device block on a stream of its own; the thread that drives the GPU receives the
block and the event of its copy, and only waits for that event on its stream. Why not page-locked
memory: page-locking costs ~1 ms per MiB (50 ms for 48 MiB on the H200 machine) and, while it runs, every
thread that touches a new page waits (pinning glmvit-encode's blocks makes its first pass decode ten
times slower); a stream of photos keeps about a gigabyte of images in flight. A copy from ordinary
memory is staged by the driver (~7 GiB/s over all threads, without the GIL): ~7 ms of a decoding thread
for a 12-megapixel photo, and nothing is pinned.

The device bytes of images uploaded ahead are bounded, not their count: an upload that would take the
uploader's blocks past `max_bytes` waits until the GPU's passes let earlier images go. The image a consumer
waits for (Wants.feeding tells which, per call) is held back only by the GPU, never by images it has not
taken yet, so nothing deadlocks; where no consumer says so, a held-back upload goes ahead after
`patience`. CuPy is imported only to upload, so
the bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ..preprocessing.decode import four_channels
from .pools import BlockPool, DeviceBlock

MAX_BYTES = 128 << 20  # device bytes of uploaded images, lent or cached: two decoded 5000 x 3000 images


class Uploaded:
    """A decoded uint8 image on a GPU: `array` is [H, W, 4] (the RGB is its first three channels, as Pillow
    decodes) or [H, W, 3], in a device block; usable on a stream once that stream waits for `event`."""

    __slots__ = ("array", "event", "block", "device", "__weakref__")

    def __init__(self, array, event, block, device: int):
        self.array, self.event, self.block, self.device = array, event, block, device

    @property
    def shape(self) -> tuple:
        return (*self.array.shape[:2], 3)


class Wants:
    """What one consumer of uploaded images waits for, told to the uploads of its images (feeding): the
    next index (images taken in order, feed.in_order's) or any one (as they finish, feed.as_done's). The
    image it waits for never waits for the byte limit; with `ordered=False` each wait lets one upload go."""

    def __init__(self, ordered: bool = True):
        self.ordered = ordered
        self.active = False  # a consumer is taking the images (until then, uploads use `patience`)
        self._next = -1
        self._hungry = False
        self._claim = threading.Lock()

    def feeding(self, items):
        """The items, passed through while saying what the consumer waits for; once it stops (the end, an
        error, or it drops the stream), nothing of its images waits any more."""
        it = iter(items)
        self.active = True
        try:
            k = 0
            while True:
                if self.ordered:
                    self._next = k
                else:
                    self._hungry = True
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    self._hungry = False
                yield item
                k += 1
        finally:
            self._next = float("inf")  # its remaining uploads go (and are let go with the stream)
            self.ordered = True

    def exempt(self, index: int | None) -> bool:
        """Whether the upload of image `index` may go past the byte limit now."""
        if self.ordered:
            return index is not None and index <= self._next
        with self._claim:  # one held-back upload per wait of an unordered consumer
            if self._hungry:
                self._hungry = False
                return True
        return False


class _Unbounded:
    """A consumer that never holds its uploads back (the service: its pixels in flight bound them)."""
    active = True

    @staticmethod
    def exempt(index) -> bool:
        return True


UNBOUNDED = _Unbounded()


class Uploader:
    """Called on a prepare thread with a decoded image (uint8 [H, W, 3], in `buffer` memory or any host
    array): returns it as Uploaded on `device`. Its device blocks, lent to images in flight or cached idle,
    stay within `max_bytes` bytes (the image a consumer waits for may go past it)."""

    def __init__(self, device, max_bytes: int = MAX_BYTES, patience: float = 0.25):
        self.device = device
        self.max_bytes, self.patience = max_bytes, patience
        self.pool = BlockPool(max_bytes, alloc=DeviceBlock)
        self._local = threading.local()

    def buffer(self, shape) -> np.ndarray:
        """This thread's host buffer as a uint8 array of `shape` (grown when too small; valid until the
        thread's next call): where the thread decodes its next image."""
        n = int(np.prod(shape))
        host = getattr(self._local, "host", None)
        if host is None or host.size < n:
            host = self._local.host = np.empty(n, np.uint8)
        return host[:n].reshape(shape)

    def uploading(self, one, wants: Wants | None = None):
        """A host preparer's function (scheduling.batching.preparer's one(i, image, name=None, host_buffer=None))
        made to decode into this thread's buffer and hand on the image uploaded to this GPU; `wants`: what
        the consumer of these images waits for (its feeding() passes them on)."""
        def prepared(i, image, name=None):
            out, grid, info = one(i, image, name=name, host_buffer=self.buffer)
            return self(out, index=i, wants=wants), grid, info

        return prepared

    def __call__(self, image: np.ndarray, index: int | None = None, wants: Wants | None = None):
        """The image on the device (its copy in flight on this thread's stream), or, if the device has no
        memory left for it, a copy in ordinary memory (the GPU's thread then uploads it). index: the
        image's place in its call's order; wants: what that call's consumer waits for."""
        import cupy

        four = four_channels(image)  # an [H, W, 4] decode (in our buffer): all four bytes travel, one copy
        src = four if four is not None else np.ascontiguousarray(image)
        ptr, shape, nbytes = src.ctypes.data, src.shape, src.nbytes
        with self.device:
            try:
                block = self._take(nbytes, index, wants)
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
        self.pool.lend(out, block)  # back to the pool when the batch holding it is done with it
        return out

    def _take(self, nbytes: int, index: int | None, wants: Wants | None):
        """A device block for nbytes within max_bytes, waiting while it is full unless the consumer waits
        for this image; where no consumer says what it waits for, until `patience` seconds have passed."""
        deadline = time.monotonic() + self.patience
        claimed = False  # once exempt, this take stays so: an unordered consumer's claim is used up by asking

        def exempt():
            nonlocal claimed
            if not claimed:
                claimed = wants.exempt(index) if wants is not None and wants.active else time.monotonic() >= deadline
            return claimed

        return self.pool.take_within(nbytes, self.max_bytes, exempt)
