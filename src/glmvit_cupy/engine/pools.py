"""Pools of memory blocks reused once idle: page-locked host blocks (the uploads of the thread that drives
a GPU, the embeddings copied back to the host, and decoded images lent to prepare threads when several
GPUs share them) and device blocks (images the prepare threads upload themselves, uploads.py). CuPy is
imported only to allocate one, so the pools' bookkeeping is tested without a GPU (with a stand-in
allocator).

A lent block comes back when the object it was lent with (and every view of it) is garbage. That can
happen in any thread, inside a garbage collection that starts in the middle of this pool's own locked
code, so the finalizer takes no lock: it hands the block over through a deque that the locked code drains.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque

import numpy as np

GRAIN = 2 << 20  # block sizes are multiples of this: page-locking costs ~1 ms per MiB, so pin little
PORTABLE = 1  # cudaHostAllocPortable: page-locked for every device's context (replicas share the blocks)


def block_size(nbytes: int) -> int:
    """A new block's size: the least of GRAIN x {1, 2, 3, 4, 6, 8, 12, ...} that holds nbytes. Few sizes, so
    images of many sizes reuse each other's blocks; at most a third is slack."""
    grains, p = -(-max(nbytes, 1) // GRAIN), 1
    while p < grains and p + p // 2 < grains:
        p *= 2
    return (p if p >= grains else p + p // 2) * GRAIN


class PinnedBlock:
    """A page-locked block and the event of the last upload that read it (None: not uploaded)."""

    __slots__ = ("mem", "size", "event")

    def __init__(self, size: int):
        import cupy

        try:
            self.mem = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(size, PORTABLE), 0)
        except cupy.cuda.runtime.CUDARuntimeError as e:  # cudaErrorMemoryAllocation: the host's limit
            raise MemoryError(f"cannot page-lock {size:,} bytes of host memory ({e})") from None
        self.size, self.event = size, None

    @property
    def idle(self) -> bool:
        return self.event is None or self.event.done


class DeviceBlock(PinnedBlock):
    """A block of the current device's memory (CuPy's pool) and the event of the last work that used it."""

    __slots__ = ()

    def __init__(self, size: int):
        import cupy

        try:
            self.mem = cupy.cuda.alloc(size)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(f"cannot allocate {size:,} bytes on GPU {cupy.cuda.Device().id} ({e})") from None
        self.size, self.event = size, None


class BlockPool:
    """Blocks (multiples of 2 MiB), reused once idle (the smallest that fits); at most `keep` bytes of free
    blocks stay cached (more are freed). Thread-safe. `alloc(size)` makes a block (a PinnedBlock: page-locked
    memory; a DeviceBlock: the current GPU's). `owned`: the bytes of every block this pool made and has not
    freed, lent or free; `peak`: the most it has owned at once."""

    def __init__(self, keep: int = 2 << 30, alloc=PinnedBlock):
        self.keep, self.alloc = keep, alloc
        self.owned = self.peak = 0
        self._free: list = []
        self._returned: deque = deque()  # lent blocks whose owners died, for the locked code to take in
        self._lock = threading.Lock()

    def _take_in(self) -> None:  # under the lock
        while self._returned:
            self._free.append(self._returned.popleft())
        self._trim(self.keep)

    def _trim(self, keep: int) -> None:  # under the lock: free idle free blocks, smallest first, down to keep
        total = sum(b.size for b in self._free)
        for b in sorted((b for b in self._free if b.idle), key=lambda b: b.size):
            if total <= keep:
                break
            self._free.remove(b)
            total -= b.size
            self.owned -= b.size

    def take(self, nbytes: int, limit: int | None = None, exempt: bool = False):
        """The smallest idle free block that holds nbytes, or a new one. With `limit`, a new block is made
        only while `owned` stays within it (idle free blocks are freed first to make room); else None. An
        `exempt` take goes past the limit once no free block is still in use by the GPU (then only lent
        blocks hold the pool, which only their owners can give back)."""
        with self._lock:
            self._take_in()
            # Past the limit (exempt takes went over it) a block that comes back is for an exempt take, or
            # freed: were a held-back take to reuse it, the exempt one would make yet another, for good.
            over = limit is not None and not exempt and self.owned > limit
            fits = [] if over else [b for b in self._free if b.size >= nbytes and b.idle]
            if fits:
                block = min(fits, key=lambda b: b.size)
                self._free.remove(block)
                return block
            size = block_size(nbytes)
            if limit is not None:
                self._trim(max(0, limit - size - (self.owned - sum(b.size for b in self._free))))
                if self.owned + size > limit and not (exempt and all(b.idle for b in self._free)):
                    return None
            self.owned += size  # counted before the allocation, which runs outside the lock
            self.peak = max(self.peak, self.owned)
        try:
            return self.alloc(size)
        except BaseException:
            with self._lock:
                self.owned -= size
            raise

    def take_within(self, nbytes: int, limit: int, exempt):
        """take(nbytes, limit), waiting while the pool is full (polling: blocks come back from garbage
        collection and from the GPU, neither of which can signal) until a block fits, or until exempt()
        says this take may go past the limit and nothing but lent blocks holds the pool: waiting on the
        GPU is always safe, waiting on a lent block may not be."""
        while True:
            block = self.take(nbytes, limit, exempt())
            if block is not None:
                return block
            time.sleep(0.002)

    def lend(self, owner, block) -> None:
        """`block` comes back to the free list when `owner` is garbage (no lock: see the module's docstring)."""
        weakref.finalize(owner, self._returned.append, block)

    def give(self, block) -> None:
        with self._lock:
            self._take_in()
            self._free.append(block)
            self._trim(self.keep)


class PinnedPool(BlockPool):
    """Page-locked host blocks: the GPU's thread copies small host arrays through them (upload), and prepare
    threads may decode images straight into them (array)."""

    def __init__(self, keep: int = 2 << 30, alloc=PinnedBlock):
        super().__init__(keep, alloc)
        self._lent: dict = {}  # data address of a lent array -> its block

    def upload(self, src: np.ndarray, dst_ptr: int) -> None:
        """Copy the host array `src` to device memory at dst_ptr, asynchronously on the current stream,
        through a block of this pool (reused once the copy has run)."""
        import cupy

        block = self.take(src.nbytes)
        np.copyto(np.frombuffer(block.mem, src.dtype, src.size).reshape(src.shape), src)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(dst_ptr, block.mem.ptr, src.nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        block.event = stream.record()
        self.give(block)

    def download(self, arrays: list) -> list[np.ndarray]:
        """Copies in ordinary memory of C-contiguous device arrays (all on the current device, computed or
        ordered before the current stream), through one block of this pool. Why not `get()`: a copy into
        ordinary memory is staged by the driver, which holds up the CUDA calls of every other thread while
        it runs (glmvit-encode's GPU thread lost 50-190 ms every other pass behind the writer's copies, and
        the decoding threads' uploads slowed alike); into page-locked memory the copy engine does it alone."""
        with self.downloaded(arrays) as views:
            return [v.copy() for v in views]

    @contextlib.contextmanager
    def downloaded(self, arrays: list):
        """As download, but yields the arrays as views of the page-locked block, valid only inside the
        `with` (the block then goes back): for a caller that only writes them out, no copy into ordinary
        memory (glmvit-encode's writer: ~10-100 ms a 58 MB pass while threads decode, faulting in fresh
        pages). Copies in ordinary memory where nothing more can be page-locked."""
        import cupy

        offsets, total = [], 0
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError(f"download needs C-contiguous arrays, got one of shape {a.shape} strides {a.strides}")
            offsets.append(total)
            total += -(-a.nbytes // 256) * 256
        try:
            block = self.take(total)
        except MemoryError:  # nothing more can be page-locked: the driver stages the copies
            yield [a.get() for a in arrays]
            return
        try:
            stream = cupy.cuda.get_current_stream()
            try:
                for a, off in zip(arrays, offsets):
                    cupy.cuda.runtime.memcpyAsync(block.mem.ptr + off, a.data.ptr, a.nbytes,
                                                  cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            finally:  # the block is reused only once every copy queued into it has run
                block.event = stream.record()
            block.event.synchronize()
            yield [np.frombuffer(block.mem, a.dtype, a.size, off).reshape(a.shape) for a, off in zip(arrays, offsets)]
        finally:
            self.give(block)

    def array(self, shape) -> np.ndarray:
        """A uint8 array of this shape in a page-locked block, which returns to the free list when the
        array (and every view of it) is garbage; in ordinary memory if no more can be page-locked."""
        nbytes = int(np.prod(shape))
        try:
            block = self.take(nbytes)
        except MemoryError:  # no more page-locked memory
            return np.empty(shape, np.uint8)  # the GPU's thread copies it into a block of its own
        flat = np.frombuffer(block.mem, np.uint8, nbytes)
        address = flat.__array_interface__["data"][0]
        self._lent[address] = block  # one dict operation: atomic under the GIL
        # On the flat array: NumPy makes it the base of every view (reshaped or sliced), so it dies last.
        weakref.finalize(flat, self._back, address)
        return flat.reshape(shape)

    def _back(self, address: int) -> None:
        """The finalizer: no lock (see the module's docstring)."""
        block = self._lent.pop(address, None)
        if block is not None:
            self._returned.append(block)

    def lent(self, image: np.ndarray):
        """The block under `image` when it is an [H, W, :3] view of an [H, W, 4] array from `array`."""
        if image.ndim != 3 or image.shape[2] != 3 or image.strides != (image.shape[1] * 4, 4, 1):
            return None
        block = self._lent.get(image.__array_interface__["data"][0])
        return block if block is not None and block.size >= image.shape[0] * image.shape[1] * 4 else None


HOST = PinnedPool()  # shared by every model of the process: prepare threads do not know the device
