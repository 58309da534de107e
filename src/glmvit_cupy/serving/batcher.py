"""Images from concurrent requests packed into shared forward passes, off the event loop.

Requests put prepared images (uint8 canvas, grid, info) into one bounded queue and await a future per
image. One worker thread per replica takes the oldest image, waits at most `max_wait` for company,
packs images in arrival order up to the capacity, runs the pass and resolves the futures on the event
loop. A task (a request's videos: task(lane) runs their passes) queues alike and runs on its own. A
future whose request went away (the client disconnected) is simply dropped: the pass and the other
requests in it go on. The queue is bounded: a request that would overflow it is refused whole.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


class QueueFull(Exception):
    """More images are waiting than the server was configured to hold."""


@dataclass
class Job:
    item: tuple | None          # (uint8 canvas, grid, info), or None for a task
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued: float = field(default_factory=time.perf_counter)
    task: Callable[[int], object] | None = None  # run alone on a lane: task(lane) is the future's value

    @property
    def tokens(self) -> int:
        return self.item[2]["tokens"]


class Batcher:
    def __init__(self, backend, *, capacity_tokens: int, max_wait_s: float, max_queue: int, on_pass=None):
        self.backend, self.capacity, self.max_wait, self.max_queue = backend, capacity_tokens, max_wait_s, max_queue
        self.on_pass = on_pass or (lambda images, tokens, seconds: None)
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._waiting = 0  # images queued or collected into a batch that has not started
        self._threads = [threading.Thread(target=self._work, args=(lane,), name=f"glmvit-batch-{lane}", daemon=True)
                         for lane in range(backend.lanes)]
        for t in self._threads:
            t.start()

    @property
    def depth(self) -> int:
        return self._waiting

    def submit(self, items: list) -> list[asyncio.Future]:
        """Queue a request's images (all or none); a future per image, resolved on the calling loop."""
        return self._queue([(item, None) for item in items], "images")

    def submit_task(self, task: Callable[[int], object]) -> asyncio.Future:
        """Queue task(lane), to run on a lane's thread between passes (a request's videos); its future."""
        return self._queue([(None, task)], "tasks")[0]

    def _queue(self, work: list, what: str) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        with self._cv:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(work) > self.max_queue:
                raise QueueFull(f"this request has {len(work)} {what}, more than the queue ever holds "
                                f"({self.max_queue}, --max-queue): send them in smaller requests")
            if self._waiting + len(work) > self.max_queue:
                raise QueueFull(f"{self._waiting} images or tasks are waiting and this request brings {len(work)}; "
                                f"the queue holds {self.max_queue} (--max-queue): retry later")
            jobs = [Job(item, loop.create_future(), loop, task=task) for item, task in work]
            self._jobs.extend(jobs)
            self._waiting += len(jobs)
            self._cv.notify_all()
        return [j.future for j in jobs]

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
        """Finish what is queued, then stop the workers."""
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
