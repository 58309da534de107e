"""The page-locked block pool's bookkeeping, without a GPU: a stand-in allocator gives ordinary memory in
place of page-locked memory, and events are flags. (tests/test_model_gpu.py runs the real thing.)"""

import gc
import threading

import numpy as np

from glmvit_cupy.engine.pools import GRAIN, BlockPool, PinnedBlock, PinnedPool


class Event:
    def __init__(self, done):
        self.done = done


class Mem(bytearray):
    ptr = 0xB10C


class Fake(PinnedBlock):
    __slots__ = ()

    def __init__(self, size):
        self.mem, self.size, self.event = Mem(size), size, None


def test_a_lent_block_comes_back_when_its_views_are_garbage_and_is_reused_once_idle():
    pool = PinnedPool(alloc=Fake)
    a = pool.array((300, 500, 4))
    view = a[..., :3]
    block = pool.lent(view)
    assert isinstance(block, Fake) and block.size % GRAIN == 0 and block.size >= a.nbytes
    assert pool.lent(a) is None and pool.lent(view[1:]) is None and pool.lent(np.empty((300, 500, 3), np.uint8)) is None
    del a  # the view still holds the block
    gc.collect()
    assert pool.lent(view) is block
    block.event = Event(done=False)  # an upload still reading it
    del view
    gc.collect()
    assert pool.take(block.size) is not block  # back, but busy
    block.event.done = True
    assert pool.take(block.size) is block


def test_smallest_idle_fit_and_the_cache_limit():
    pool = PinnedPool(keep=3 * GRAIN, alloc=Fake)
    blocks = [Fake(n * GRAIN) for n in (1, 2, 3)]
    for b in blocks:
        pool.give(b)
    assert sum(b.size for b in pool._free) <= 3 * GRAIN  # the smallest idle ones were freed first
    pool = PinnedPool(alloc=Fake)
    for b in blocks:
        pool.give(b)
    assert pool.take(GRAIN + 1) is blocks[1] and pool.take(1) is blocks[0] and pool.take(GRAIN) is blocks[2]
    assert pool.take(5 * GRAIN + 7).size == 6 * GRAIN  # new: rounded up to the grain


def test_a_finalizer_inside_the_pools_own_lock_does_not_deadlock():
    """An array can die in a garbage collection that starts while a thread holds the pool's lock (say a
    failed decode's traceback cycle): the finalizer must not wait for that lock."""
    pool = PinnedPool(alloc=Fake)
    held = [pool.array((64, 64, 4))]
    block = pool.lent(held[0][..., :3])

    def collect_under_the_lock():
        with pool._lock:
            held.clear()
            gc.collect()

    t = threading.Thread(target=collect_under_the_lock, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "the finalizer deadlocked on the pool's lock"
    assert pool.take(block.size) is block


def test_no_page_locked_memory_left_gives_ordinary_memory():
    def refuse(size):
        raise MemoryError("cannot page-lock")

    pool = PinnedPool(alloc=refuse)
    a = pool.array((10, 20, 4))
    assert a.shape == (10, 20, 4) and pool.lent(a[..., :3]) is None


def test_upload_goes_through_a_block_and_keeps_it_until_the_copy_has_run(monkeypatch, rng):
    """upload(src, dst): src copied into a pool block (a strided source gathered), one asynchronous copy of
    its bytes to dst on the current stream, and the block back in the pool, busy until that copy's event."""
    import sys
    import types

    copies = []
    stream = types.SimpleNamespace(ptr=7, record=lambda: Event(done=False))
    runtime = types.SimpleNamespace(memcpyHostToDevice=1, memcpyAsync=lambda *a: copies.append(a))
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream, runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    pool = PinnedPool(alloc=Fake)
    src = rng.integers(-2**31, 2**31, (50, 6), dtype=np.int64).astype(np.int32)[:, ::2]
    pool.upload(src, 0xD57)
    assert copies == [(0xD57, Mem.ptr, src.nbytes, 1, 7)]
    (block,) = pool._free
    assert not block.idle
    assert np.array_equal(np.frombuffer(block.mem, np.int32, src.size).reshape(src.shape), src)
    assert pool.take(src.nbytes) is not block  # busy until the copy has run


def test_a_block_lent_with_an_object_comes_back_when_it_is_garbage_and_idle():
    """BlockPool.lend (the device uploads' pool): the block returns when its owner dies, busy until its event."""

    class Owner:
        pass

    pool = BlockPool(alloc=Fake)
    block, owner = pool.take(GRAIN), Owner()
    pool.lend(owner, block)
    assert pool.take(GRAIN) is not block  # still lent
    block.event = Event(done=False)
    del owner
    gc.collect()
    assert pool.take(GRAIN) is not block  # back, but busy
    block.event.done = True
    assert pool.take(GRAIN) is block


def test_download_copies_through_one_block_and_returns_ordinary_arrays(monkeypatch, rng):
    """download(arrays): one asynchronous device-to-host copy per array into a pool block (offsets aligned to
    256 bytes), one wait, then copies in ordinary memory (not views of the block, which goes back to the pool
    and is reused); downloaded(arrays): views of the block instead, which comes back when the `with` ends,
    also when its body raises; a strided array is refused; a failed copy leaves the block busy behind the copies queued
    before it; with nothing left to page-lock, each array's own get()."""
    import sys
    import types

    import ml_dtypes
    import pytest

    device = {0x1000: rng.standard_normal((7, 33)).astype(ml_dtypes.bfloat16),
              0x2000: rng.standard_normal(5).astype(np.float32)}
    made, copies, waits = [], [], []

    class Dev:  # a device array: its bytes live in `device`
        def __init__(self, ptr, contiguous=True):
            host = device[ptr]
            self.data, self.shape, self.dtype = types.SimpleNamespace(ptr=ptr), host.shape, host.dtype
            self.size, self.nbytes = host.size, host.nbytes
            self.flags = types.SimpleNamespace(c_contiguous=contiguous)
            self.strides = host.strides

        def get(self):
            return device[self.data.ptr].copy()

    class Blk(Fake):
        __slots__ = ()

        def __init__(self, size):
            super().__init__(size)
            self.mem = Mem(b"\xff" * size)  # poison: every byte the copies do not write stays 0xFF
            made.append(self)

    def memcpy(dst, src, n, kind, stream):
        copies.append((dst - Mem.ptr, n, kind, stream))
        made[-1].mem[dst - Mem.ptr:dst - Mem.ptr + n] = device[src].tobytes()

    class Ev:
        done = False

        def synchronize(self):
            waits.append(len(copies))
            self.done = True

    stream = types.SimpleNamespace(ptr=9, record=Ev)
    runtime = types.SimpleNamespace(memcpyDeviceToHost=2, memcpyAsync=memcpy)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: stream, runtime=runtime)))
    pool = PinnedPool(alloc=Blk)
    out = pool.download([Dev(0x1000), Dev(0x2000)])
    assert copies == [(0, 7 * 33 * 2, 2, 9), (512, 20, 2, 9)] and waits == [2]
    for o, ptr in zip(out, (0x1000, 0x2000)):
        assert o.dtype == device[ptr].dtype and np.array_equal(o.view(np.uint8), device[ptr].view(np.uint8))
        assert not np.shares_memory(o, np.frombuffer(made[0].mem, np.uint8))
    (block,) = pool._free
    assert block.idle and pool.take(10) is block  # back, reused
    pool.give(block)
    with pool.downloaded([Dev(0x1000), Dev(0x2000)]) as views:  # views of the block, lent to the `with`
        assert pool._free == [] and len(made) == 1 and waits == [2, 4]
        for v, ptr in zip(views, (0x1000, 0x2000)):
            assert v.dtype == device[ptr].dtype and v.shape == device[ptr].shape
            assert np.array_equal(v.view(np.uint8), device[ptr].view(np.uint8))
            assert np.shares_memory(v, np.frombuffer(block.mem, np.uint8))
    assert pool._free == [block] and block.idle
    with pytest.raises(KeyError):
        with pool.downloaded([Dev(0x2000)]):
            raise KeyError("the writer failed")
    assert pool._free == [block] and len(made) == 1  # back again, whatever the body did
    with pytest.raises(ValueError, match="C-contiguous"):
        pool.download([Dev(0x1000, contiguous=False)])

    def second_fails(dst, src, n, kind, stream):
        if copies:
            raise RuntimeError("cudaErrorInvalidValue")
        memcpy(dst, src, n, kind, stream)

    copies.clear()
    runtime.memcpyAsync = second_fails
    with pytest.raises(RuntimeError, match="InvalidValue"):
        pool.download([Dev(0x1000), Dev(0x2000)])
    (block,) = pool._free  # back in the pool, but busy until the copy queued before the failure has run
    assert not block.idle and pool.take(10) is not block

    def refuse(size):
        raise MemoryError("cannot page-lock")

    pool = PinnedPool(alloc=refuse)
    (o,) = pool.download([Dev(0x2000)])
    assert np.array_equal(o, device[0x2000])
    with pool.downloaded([Dev(0x2000)]) as (o,):  # the views variant falls back alike
        assert np.array_equal(o, device[0x2000])



def test_returned_blocks_past_the_cache_limit_are_freed():
    """Blocks lent out and come back (their owners garbage) are cached only up to `keep`: the device
    pool of a burst of large images does not keep them all."""
    pool = BlockPool(keep=4 * GRAIN, alloc=Fake)

    class Owner:
        pass

    owners = [Owner() for _ in range(5)]
    for o in owners:
        pool.lend(o, pool.take(2 * GRAIN))
    assert pool.owned == 10 * GRAIN
    del o, owners
    gc.collect()
    pool.take(1).size  # any call takes the returned blocks in
    assert sum(b.size for b in pool._free) <= 4 * GRAIN and pool.owned <= 6 * GRAIN
    assert pool.peak == 10 * GRAIN  # the most it owned at once, which freeing does not lower


def test_a_limit_frees_idle_blocks_to_make_room_or_refuses():
    pool = BlockPool(keep=16 * GRAIN, alloc=Fake)
    a, _ = pool.take(2 * GRAIN), pool.take(2 * GRAIN)
    pool.give(a)
    assert pool.owned == 4 * GRAIN
    c = pool.take(4 * GRAIN, limit=6 * GRAIN)  # a (idle, free) is freed to make room for c
    assert c is not None and c.size == 4 * GRAIN and pool.owned == 6 * GRAIN and not pool._free
    assert pool.take(2 * GRAIN, limit=6 * GRAIN) is None  # b and c are in use: no room
    assert pool.take(2 * GRAIN).size == 2 * GRAIN and pool.owned == 8 * GRAIN  # no limit: made


def test_take_within_waits_for_room_unless_exempt_or_past_patience():
    """Past its limit a take waits for room; one exempt (the image the consumer waits for: uploads.py)
    goes at once. Blocks that come back make room for a waiting one."""
    import time

    pool = BlockPool(keep=4 * GRAIN, alloc=Fake)

    class Owner:
        pass

    owner = Owner()
    pool.lend(owner, pool.take_within(2 * GRAIN, 4 * GRAIN, lambda: False))
    held = pool.take_within(2 * GRAIN, 4 * GRAIN, lambda: False)  # the limit is reached
    t0 = time.monotonic()
    assert pool.take_within(2 * GRAIN, 4 * GRAIN, lambda: True).size == 2 * GRAIN  # exempt: at once
    assert time.monotonic() - t0 < 1 and pool.owned == 6 * GRAIN
    got, wanted = [], []
    waiter = threading.Thread(target=lambda: got.append(pool.take_within(4 * GRAIN, 6 * GRAIN, lambda: bool(wanted))))
    waiter.start()
    time.sleep(0.1)
    assert not got  # no room, not exempt: it waits
    del owner  # the first block comes back; freed to make room for the waiting 4-grain one
    gc.collect()
    waiter.join(0.5)
    assert not got  # 2 (held) + 2 (exempt one) + 4 > 6: still no room
    wanted.append(True)
    waiter.join(5)
    assert got and got[0].size == 4 * GRAIN
    del held


def test_wants_tells_the_uploads_what_the_consumer_waits_for():
    """Ordered: the index being waited for is exempt from the budget. Unordered: each wait of the
    consumer exempts exactly one upload. A consumer that stops exempts all of its remaining uploads."""
    from glmvit_cupy.engine.uploads import Wants

    wants, seen = Wants(), []

    def items():
        for k in range(3):
            seen.append((wants.exempt(k), wants.exempt(k + 1)))
            yield k

    assert list(wants.feeding(items())) == [0, 1, 2] and seen == [(True, False)] * 3
    assert wants.exempt(10**9)  # done: nothing of it waits any more
    wants, seen = Wants(ordered=False), []

    def any_items():
        for k in range(2):
            seen.append((wants.exempt(None), wants.exempt(None)))  # the first claim wins, the second waits
            yield k

    stream = wants.feeding(any_items())
    assert next(stream) == 0 and seen == [(True, False)]
    assert not wants.exempt(None)  # between waits, nothing is exempt
    stream.close()  # the consumer drops the stream
    assert wants.exempt(5)


def test_two_consumers_share_one_budget_without_deadlock():
    """Two calls on one uploader at once (a stand-in GPU marks each pass's blocks done after a delay):
    both finish, in order, and the blocks stay near the budget, though each call's consumer waits for
    images the other call's uploads hold back."""
    import time

    from glmvit_cupy.engine.uploads import Uploader, Wants

    up = Uploader.__new__(Uploader)
    up.max_bytes, up.patience = 6 * GRAIN, 0.05
    up.pool = BlockPool(up.max_bytes, alloc=Fake)
    gpu, peak, results = [], [0], {}

    class Image:
        pass

    def one(i, _):
        block = up._take(2 * GRAIN, i, wants_of[threading.current_thread().name.split("_")[0]])
        img = Image()
        up.pool.lend(img, block)
        img.block = block
        peak[0] = max(peak[0], up.pool.owned)
        return i, img

    def run_gpu():
        while not results.get("stop"):
            if gpu:
                time.sleep(0.003)
                gpu.pop(0).done = True
            else:
                time.sleep(0.001)

    def consumer(name):
        wants = wants_of[name]
        order, batch = [], []
        for i, img in wants.feeding(_named_in_order(one, range(24), 4, name)):
            batch.append(img)
            order.append(i)
            if len(batch) == 2:  # a pass: the GPU reads its images, then they are let go
                for im in batch:
                    im.block.event = Event(done=False)
                    gpu.append(im.block.event)
                batch = []
        results[name] = order

    wants_of = {"a": Wants(), "b": Wants()}
    g = threading.Thread(target=run_gpu, daemon=True)
    g.start()
    threads = [threading.Thread(target=consumer, args=(n,), daemon=True) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    results["stop"] = True
    assert results.get("a") == list(range(24)) and results.get("b") == list(range(24)), results
    # Bounded by the budget and what the two consumers hold (a pass being packed, the image in hand, the
    # one they wait for), not by the 48 images: without the budget every image takes a block of its own.
    assert peak[0] <= up.max_bytes + 2 * 6 * (2 * GRAIN) < 48 * (2 * GRAIN)


def _named_in_order(fn, items, workers, name):
    """feed.in_order's behaviour with its worker threads named after the consumer (the test's one()
    finds its consumer by thread name)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, i, x) for i, x in enumerate(items)]
        while futures:  # each result let go once taken, as feed.in_order does
            yield futures.pop(0).result()


def test_an_exempt_take_waits_for_the_gpu_but_not_for_lent_blocks():
    """The image a consumer waits for may go past the limit only once no free block is still being read
    by the GPU: a consumer that queues passes faster than the GPU runs them is held to the budget."""
    import time

    pool = BlockPool(keep=4 * GRAIN, alloc=Fake)
    lent = pool.take(2 * GRAIN)
    busy = pool.take(2 * GRAIN)
    busy.event = Event(done=False)  # a queued pass still reads it
    pool.give(busy)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.take_within(4 * GRAIN, 4 * GRAIN, lambda: True)))
    t.start()
    time.sleep(0.1)
    assert not got and pool.owned == 4 * GRAIN  # waits for the GPU, though exempt
    busy.event.done = True  # the pass ran: the busy block is freed to make room
    t.join(5)
    assert got and got[0].size == 4 * GRAIN and pool.owned == 6 * GRAIN  # past the limit: only `lent` holds it
    del lent


def test_patience_only_where_no_consumer_says_what_it_waits_for():
    """An upload held back by the budget goes ahead after `patience` only while no consumer is feeding:
    a consumer that says what it waits for is never outrun by uploads past the budget."""
    import time

    from glmvit_cupy.engine import uploads as up_mod

    up = up_mod.Uploader.__new__(up_mod.Uploader)
    up.max_bytes, up.patience = 2 * GRAIN, 0.1
    up.pool = BlockPool(2 * GRAIN, alloc=Fake)
    held = up._take(2 * GRAIN, 0, None)  # lent: the budget is full
    t0 = time.monotonic()
    assert up._take(2 * GRAIN, 7, None).size == 2 * GRAIN and 0.05 < time.monotonic() - t0 < 5  # patience
    wants = up_mod.Wants()
    stream = wants.feeding(iter(range(100)))
    assert next(stream) == 0  # a consumer is feeding and waits for image 1
    got = []
    t = threading.Thread(target=lambda: got.append(up._take(2 * GRAIN, 9, wants)), daemon=True)
    t.start()
    t.join(0.5)
    assert not got  # image 9 is not the one waited for: it waits for room, past any patience
    stream.close()  # the consumer stops: its remaining uploads go
    t.join(5)
    assert got
    del held


def test_past_the_limit_a_block_that_comes_back_is_not_reused_by_a_held_back_take():
    """Over the limit (an exempt take went past it), an idle free block is left for an exempt take (or freed),
    not reused by a take the budget holds back: else the exempt take makes yet another block, for good."""
    pool = BlockPool(keep=8 * GRAIN, alloc=Fake)
    lent = [pool.take(2 * GRAIN, 4 * GRAIN), pool.take(2 * GRAIN, 4 * GRAIN)]
    back = pool.take(2 * GRAIN, 4 * GRAIN, exempt=True)  # the image being waited for: past the limit
    pool.give(back)  # its pass ran
    assert pool.owned == 6 * GRAIN
    assert pool.take(2 * GRAIN, 4 * GRAIN) is None and pool.owned == 4 * GRAIN  # freed, not reused
    assert pool.take(2 * GRAIN, 4 * GRAIN, exempt=True).size == 2 * GRAIN
    del lent


def test_an_unordered_claim_is_kept_while_its_take_waits_for_the_gpu():
    """The one upload an unordered consumer's wait lets go keeps that leave while it waits for a block the
    GPU still reads; losing it on its next poll would leave every upload held back and the consumer waiting."""
    from glmvit_cupy.engine.uploads import Uploader, Wants

    up = Uploader.__new__(Uploader)
    up.max_bytes, up.patience = 4 * GRAIN, 0.25
    up.pool = BlockPool(up.max_bytes, alloc=Fake)
    held = [up.pool.take(2 * GRAIN), up.pool.take(2 * GRAIN)]  # lent to the consumer's running pass
    busy = up.pool.take(1)
    busy.event = Event(done=False)  # a queued pass still reads it
    up.pool.give(busy)
    wants = Wants(ordered=False)
    wants.active = wants._hungry = True  # the consumer waits for any image (as feeding says)
    got = []
    t = threading.Thread(target=lambda: got.append(up._take(2 * GRAIN, 0, wants)), daemon=True)
    t.start()
    t.join(0.1)
    busy.event.done = True  # the pass ran
    t.join(5)
    assert got and got[0].size == 2 * GRAIN
    del held
