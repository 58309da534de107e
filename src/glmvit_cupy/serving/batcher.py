"""Images from concurrent requests packed into shared forward passes, off the event loop, and what bounds the
work before them: the queue's room, the pixels in flight, and the decoding threads shared fairly.

Requests put prepared images (uint8 canvas, grid, info) into one bounded queue and await a future per
image. One worker thread per replica takes the oldest image, waits at most `max_wait` for company,
packs images in arrival order up to the capacity, runs the pass and resolves the futures on the event
loop. A task (a request's videos: task(lane) runs their passes) queues alike and runs on its own. A
future cancelled before its pass starts (nobody waits for it any more: its clients went away) is dropped:
it leaves the queue at once, or the batch being gathered, and never reaches a pass; the pass and the
other images in it go on. The queue is bounded: a request reserves its room before its images are decoded
(reserve), so one that would overflow it is refused whole before any work is done.

PixelBudget counts the pixels of images admitted and not yet through their passes, server-wide. Decoders
runs decoding jobs on a thread pool, taking requests in turn, and keeps one thread free of large images,
so one request never holds every thread while others wait.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable


class QueueFull(Exception):
    """More images are waiting than the server was configured to hold; `ever`: the request alone is more
    than the queue holds (it can never fit), else: retry later."""

    def __init__(self, message: str, ever: bool = False):
        super().__init__(message)
        self.ever = ever


@dataclass(eq=False)
class Job:
    item: tuple | None          # (uint8 canvas, grid, info), or None for a task
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued: float = field(default_factory=time.perf_counter)
    task: Callable[[int], object] | None = None  # run alone on a lane: task(lane) is the future's value
    dropped: bool = False       # cancelled after a worker took it, before its pass (set under the lock)

    @property
    def tokens(self) -> int:
        return self.item[2]["tokens"]


class Batcher:
    def __init__(self, backend, *, capacity_tokens: int, max_wait_s: float, max_queue: int, on_pass=None,
                 on_drop=None):
        self.backend, self.capacity, self.max_wait, self.max_queue = backend, capacity_tokens, max_wait_s, max_queue
        self.on_pass = on_pass or (lambda images, tokens, seconds: None)
        self.on_drop = on_drop or (lambda job: None)  # a job dropped before its pass (from any thread)
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._waiting = 0   # images queued or collected into a batch that has not started
        self._reserved = 0  # room held for images being decoded (reserve), not yet queued
        self._threads = [threading.Thread(target=self._work, args=(lane,), name=f"glmvit-batch-{lane}", daemon=True)
                         for lane in range(backend.lanes)]
        for t in self._threads:
            t.start()

    @property
    def depth(self) -> int:
        """Images and tasks admitted and not yet in a pass: queued, or reserved while they are decoded."""
        return self._waiting + self._reserved

    def reserve(self, n: int, what: str = "images") -> None:
        """Hold room for n images (or tasks) of a request before they are decoded; QueueFull when the queue
        could never hold them (ever) or has no room now. submit(..., reserved=True) takes the room, or
        unreserve(n) gives it back."""
        with self._cv:
            self._check_room(n, what)
            self._reserved += n

    def unreserve(self, n: int) -> None:
        with self._cv:
            self._reserved -= n

    def _check_room(self, n: int, what: str) -> None:
        if self._stopping:
            raise QueueFull("the server is shutting down")
        if n > self.max_queue:
            raise QueueFull(f"this request has {n} {what}, more than the queue ever holds "
                            f"({self.max_queue}, --max-queue): send them in smaller requests", ever=True)
        if self._waiting + self._reserved + n > self.max_queue:
            raise QueueFull(f"{self._waiting + self._reserved} images or tasks are waiting and this request brings "
                            f"{n}; the queue holds {self.max_queue} (--max-queue): retry later")

    def submit(self, items: list, reserved: bool = False) -> list[asyncio.Future]:
        """Queue a request's images (all or none); a future per image, resolved on the calling loop.
        reserved: their room was held by reserve(len(items))."""
        return self._queue([(item, None) for item in items], "images", reserved)

    def submit_task(self, task: Callable[[int], object], reserved: bool = False) -> asyncio.Future:
        """Queue task(lane), to run on a lane's thread between passes (a request's videos); its future."""
        return self._queue([(None, task)], "tasks", reserved)[0]

    def _queue(self, work: list, what: str, reserved: bool) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        with self._cv:
            if reserved:
                if self._stopping:
                    raise QueueFull("the server is shutting down")
                self._reserved -= len(work)
            else:
                self._check_room(len(work), what)
            jobs = [Job(item, loop.create_future(), loop, task=task) for item, task in work]
            self._jobs.extend(jobs)
            self._waiting += len(jobs)
            self._cv.notify_all()
        for job in jobs:
            job.future.add_done_callback(functools.partial(self._cancelled, job))
        return [j.future for j in jobs]

    def _cancelled(self, job: Job, future: asyncio.Future) -> None:
        """A job's future is done (on its loop): cancelled, the job leaves the queue, or is marked so that the
        worker that took it leaves it out of the pass."""
        if not future.cancelled():
            return
        with self._cv:
            try:
                self._jobs.remove(job)
            except ValueError:  # taken by a worker: dropped there unless its pass has started
                job.dropped = True
                return
            self._waiting -= 1
        self.on_drop(job)

    def _take_batch(self) -> list[Job] | None:
        with self._cv:
            while not self._jobs and not self._stopping:
                self._cv.wait()
            if not self._jobs:
                return None  # stopping, nothing left
            batch = [self._jobs.popleft()]
            if batch[0].task is not None:
                return batch  # a task runs on its own
            used = batch[0].tokens
            deadline = time.perf_counter() + self.max_wait
            while used < self.capacity:
                if self._jobs:
                    if self._jobs[0].task is not None or used + self._jobs[0].tokens > self.capacity:
                        break  # the next image (or task) opens the next pass
                    job = self._jobs.popleft()
                    batch.append(job)
                    used += job.tokens
                    continue
                left = deadline - time.perf_counter()
                if left <= 0 or self._stopping:
                    break
                self._cv.wait(left)
            return batch

    def _work(self, lane: int):
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            with self._cv:  # jobs cancelled while the batch gathered never reach the pass
                gone = [j for j in batch if j.dropped]
                batch = [j for j in batch if not j.dropped]
                self._waiting -= len(gone)
            for job in gone:
                self.on_drop(job)
            if not batch:
                continue
            t0 = time.perf_counter()
            task = batch[0].task
            try:
                outs, error = ([task(lane)] if task is not None else
                               self.backend.encode_on(lane, [j.item for j in batch])), None
            except Exception as e:  # the pass failed: every image in it gets the error
                outs, error = None, e
            with self._cv:
                self._waiting -= len(batch)
            if task is None:
                self.on_pass(len(batch), sum(j.tokens for j in batch), time.perf_counter() - t0)
            for i, job in enumerate(batch):
                value = error if error is not None else outs[i]
                try:
                    job.loop.call_soon_threadsafe(_resolve, job.future, value)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass

    def stop(self, timeout: float = 30.0):
        """Finish what is queued (dropped work is skipped), then stop the workers; each is waited for at
        most `timeout` seconds."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)


def _resolve(future: asyncio.Future, value):
    if future.done():  # cancelled: the request went away
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


class PixelBudget:
    """Pixels of images admitted and not yet through their passes, server-wide, within `total`. Used from the
    event loop only."""

    def __init__(self, total: int):
        self.total, self.used = total, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass(eq=False)
class _Decode:
    fn: Callable[[], object]
    large: bool
    result: asyncio.Future          # the job's value for the request (cancelled with it)
    ended: asyncio.Future | None = None  # set when its thread is done with it, whatever became of the request


class Decoders:
    """Decoding jobs on `workers` threads. Requests are served in turn (one job of each waiting request
    before a second of any), and large jobs (an image over LARGE pixels, a video) hold at most workers - 1
    threads, so a small image is decoded at once beside them. Used from the event loop."""

    def __init__(self, workers: int):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="glmvit-decode")
        self.workers, self.large_slots = workers, max(1, workers - 1)
        self.busy = self.busy_large = 0
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # request -> deque of its jobs

    async def run(self, calls: list[tuple[Callable[[], object], bool]]) -> list:
        """[(fn, large), ...] of one request -> their values or exceptions, in order. Cancelled, the jobs not
        started are dropped and those running are waited for (their threads hold memory until they end)."""
        loop = asyncio.get_running_loop()
        jobs = [_Decode(fn, large, loop.create_future()) for fn, large in calls]
        token = object()
        self._waiting[token] = collections.deque(jobs)
        self._dispatch(loop)
        try:
            return await asyncio.gather(*[j.result for j in jobs], return_exceptions=True)
        except asyncio.CancelledError:
            self._waiting.pop(token, None)
            running = [j.ended for j in jobs if j.ended is not None and not j.ended.done()]
            if running:
                await asyncio.wait(running)
            raise

    def _dispatch(self, loop) -> None:
        while self.busy < self.workers and self._waiting:
            for token, queue in self._waiting.items():  # in turn
                if not queue[0].large or self.busy_large < self.large_slots:
                    break
            else:
                return  # only large jobs wait, and the threads they may hold are busy
            job = queue.popleft()
            if queue:
                self._waiting.move_to_end(token)
            else:
                del self._waiting[token]
            if job.result.done():  # its request went away
                continue
            try:
                cf = self.pool.submit(job.fn)
            except RuntimeError as e:  # the pool has shut down: the server is stopping
                job.result.set_exception(e)
                continue
            self.busy += 1
            self.busy_large += job.large
            job.ended = loop.create_future()
            cf.add_done_callback(functools.partial(self._ended_soon, loop, job))

    def _ended_soon(self, loop, job: _Decode, cf) -> None:  # on the decoding thread
        try:
            loop.call_soon_threadsafe(self._ended, loop, job, cf)
        except RuntimeError:  # the loop is closed: the server has stopped
            pass

    def _ended(self, loop, job: _Decode, cf) -> None:
        self.busy -= 1
        self.busy_large -= job.large
        job.ended.set_result(None)
        if cf.cancelled():  # the pool shut down before it ran
            job.result.cancel()
        elif not job.result.done():
            e = cf.exception()
            if e is None:
                job.result.set_result(cf.result())
            else:
                job.result.set_exception(e)
        self._dispatch(loop)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
