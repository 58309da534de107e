"""Images from concurrent requests packed into shared forward passes, off the event loop, and what bounds the
work before them: the queue's room, the pixels in flight, and the decoding threads shared fairly.

Requests put prepared images (image, grid, info) into one bounded queue and await a future per image. Each
replica (lane) has two threads. Its engine thread only packs and launches: it takes images from the
waiting requests in turn (round robin: the request served goes to the back of the line, where new
requests join it, so a one-image request waits for at most one image of each request ahead of it, and a
long request still moves an image a round however many short ones arrive), waits at most `max_wait` from the oldest image's
arrival for company while the pass has room (while the lane's GPU runs a pass, until about a launch
before it should end: Pace), and hands the launched pass (backend.launch_on) to the lane's completion
thread, which waits for the GPU, copies the embeddings back (pending.fetch) and
resolves the futures on the event loop. At most `ahead` passes of a lane are launched and not yet copied
back: the GPU always has the next pass queued behind the one it runs, and the outputs on it stay bounded.
A backend whose passes do not share work (`shares_passes` False: the CPU reference computes each image
alone) gets one image a pass, so a small request waits for at most one image before its own.

A task (up to a pass of a request's videos: task(lane) runs their passes and returns host arrays) queues
alike and runs on the engine thread on its own. A future cancelled before its pass starts (nobody waits for it any more:
its clients went away) is dropped: it leaves the queue at once, or the batch being gathered, and never
reaches a pass; the pass and the other images in it go on. The queue is bounded: a request reserves its
room before its images are decoded (reserve), so one that would overflow it is refused whole before any
work is done. Each pass's time by part (PassTimes) goes to on_pass, what an operator reads in /metrics,
before the pass's results go back: a client that has its answer finds its pass counted.

Budget counts an amount held server-wide (the pixels of images admitted and not yet through their passes,
the bytes of request bodies held). Decoders
runs decoding jobs on a thread pool, taking requests in turn, and keeps one thread free of large images,
so one request never holds every thread while others wait.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ..scheduling import batching

log = logging.getLogger("glmvit_cupy")


class QueueFull(Exception):
    """More images are waiting than the server was configured to hold; `ever`: the request alone is more
    than the queue holds (it can never fit), else: retry later."""

    def __init__(self, message: str, ever: bool = False):
        super().__init__(message)
        self.ever = ever


@dataclass(eq=False)
class Job:
    item: tuple | None          # (image, grid, info), or None for a task
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    request: object = None      # the submit() it came with: requests are served in turn
    queued: float = field(default_factory=time.perf_counter)
    task: Callable[[int], object] | None = None  # run alone on a lane: task(lane) is the future's value

    @property
    def tokens(self) -> int:
        return self.item[2]["tokens"]


@dataclass
class PassTimes:
    """One forward pass, in seconds by part: queued (its oldest image's wait before the launch), launch
    (the engine thread packing, staging and launching it: the only part on that thread), gpu (the
    completion thread waiting for the GPU after the launch), fetch (copying the embeddings back),
    resolve (readying them for their requests: each one's value, by event loop; the hand-off itself, one
    call a loop, follows on_pass, so that the pass is counted before any request has its result).
    launch_cpu and fetch_cpu: the CPU time its thread spent in launch and fetch; the rest of those parts'
    wall time the thread waited (for the GIL, the driver).
    """
    lane: int
    images: int
    tokens: int
    queued: float = 0.0
    launch: float = 0.0
    gpu: float = 0.0
    fetch: float = 0.0
    resolve: float = 0.0
    launch_cpu: float = 0.0
    fetch_cpu: float = 0.0

    PARTS = ("queued", "launch", "gpu", "fetch", "resolve")
    CPU_PARTS = ("launch", "fetch")  # the parts whose thread CPU time is measured too (`<part>_cpu`)


class Pace:
    """A lane's GPU pace, learned from its passes: when the passes launched on it should end, and how long
    a launch takes. The engine thread launches the next pass that long before the GPU runs out of work, so
    that its launch (staging, the graph's launch: 1.8 ms a pass of small images on an H100, the launch
    part of `benchmarks/bench_serve.py --small`) overlaps the running pass's end instead of following it
    with the GPU idle. A pass's GPU time is a fixed part plus a part per token: a line fitted to the
    recent passes (running averages). All under the batcher's lock."""

    SMOOTH = 0.2  # weight of the newest pass in each running average

    def __init__(self):
        self.fit: list | None = None  # running averages of tokens, seconds, tokens^2, tokens x seconds
        self.launch = 0.0       # seconds a launch takes
        self.ends = 0.0         # perf_counter() time the launched passes should end by
        self.last_end = 0.0     # when the last pass ended
        self.out: collections.deque = collections.deque()  # (tokens, launched at) of the passes launched, not ended

    def seconds(self, tokens: int) -> float:
        """The GPU time a pass of `tokens` should take (a fitted line; near one size, in proportion)."""
        t, d, tt, td = self.fit
        var = tt - t * t
        slope = max(0.0, (td - t * d) / var) if var > (0.1 * t) ** 2 else d / max(t, 1e-9)
        return max(0.0, d + slope * (tokens - t))

    def launched(self, tokens: int, start: float, end: float) -> None:
        self.launch = end - start if not self.launch else (1 - self.SMOOTH) * self.launch + self.SMOOTH * (end - start)
        self.out.append((tokens, end))
        if self.fit is not None:
            self.ends = max(end, self.ends) + self.seconds(tokens)

    def ended(self, at: float) -> None:
        """The oldest launched pass ended (the GPU was seen done with it) at `at`."""
        tokens, launched = self.out.popleft()
        ran = at - max(launched, self.last_end)  # it started once launched and once the pass before it ended
        self.last_end = at
        if tokens > 0:
            new = [tokens, ran, tokens * tokens, tokens * ran]
            self.fit = new if self.fit is None else [(1 - self.SMOOTH) * a + self.SMOOTH * b
                                                     for a, b in zip(self.fit, new)]
        if self.fit is not None:
            self.ends = at + sum(self.seconds(t) for t, _ in self.out)

    def launch_at(self) -> float | None:
        """When to launch the next pass (perf_counter time) while passes run: a launch and a half before they
        should end; None until a pass has ended (no pace known: launch once they end)."""
        return None if self.fit is None else self.ends - 1.5 * self.launch


class _Done:
    """A pass whose values are known at launch (a task's, or a backend that computes while launching)."""

    def __init__(self, values):
        self.values = values

    def wait(self) -> None:
        pass

    def fetch(self) -> list:
        return self.values


class Batcher:
    def __init__(self, backend, *, capacity_tokens: int, max_wait_s: float, max_queue: int, on_pass=None,
                 on_drop=None, on_busy=None, ahead: int = 2):
        self.backend, self.capacity, self.max_wait, self.max_queue = backend, capacity_tokens, max_wait_s, max_queue
        self.shares_passes = getattr(backend, "shares_passes", True)
        self.on_pass = on_pass or (lambda times: None)            # PassTimes of each image pass (completion thread)
        self.on_drop = on_drop or (lambda job: None)              # a job dropped before its pass (from any thread)
        self.on_busy = on_busy or (lambda lane, seconds: None)    # an engine thread's work: a launch, a task
        self._requests: collections.OrderedDict = collections.OrderedDict()  # request -> its jobs not yet taken, in line
        self._cv = threading.Condition()
        self._stopping = False
        self._waiting = 0   # images queued or collected into a batch that has not launched
        self._reserved = 0  # room held for images being decoded (reserve), not yet queued
        self._slots = [threading.Semaphore(ahead) for _ in range(backend.lanes)]
        self._running = [0] * backend.lanes  # image passes launched that the GPU has not ended (under the lock)
        self._pace = [Pace() for _ in range(backend.lanes)]
        self._taken = 0  # batches taken from the queue and not yet handed back (under the lock)
        self._in_pass: set = set()  # futures of the jobs in a launched pass, until resolved (under the lock)
        self._video_parts: dict = {}  # a video request's future -> its parts' futures, until it is done
        self._done = [queue.SimpleQueue() for _ in range(backend.lanes)]
        self._threads = [threading.Thread(target=fn, args=(lane,), name=f"glmvit-{what}-{lane}", daemon=True)
                         for lane in range(backend.lanes)
                         for fn, what in ((self._engine, "engine"), (self._complete, "done"))]
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
        """Queue task(lane), to run on a lane's engine thread between passes (a request's videos); its future."""
        return self._queue([(None, task)], "tasks", reserved)[0]

    def submit_videos(self, planned: list, reserved: bool = False) -> asyncio.Future:
        """Queue a request's planned videos (video.plan_video's) as tasks of at most a pass's tokens each (a
        longer video: a task of its own), served in turn with other requests' work, so that a request of
        thousands of small videos holds the engine thread a pass at a time, not for all of them; its future:
        an embedding each, in order. A request's videos take one place in the queue's room, held by reserve(1)
        where `reserved`, else checked here; once queued, each part waiting counts."""
        chunks = batching.pack(planned, self.capacity, lambda video: min(video[2]["tokens"], self.capacity))

        def task_of(chunk):
            def task(lane):
                return self.backend.encode_video_on(lane, chunk)

            task.videos = len(chunk)
            return task

        parts = self._queue([(None, task_of(c)) for c in chunks], "tasks", reserved, held=1)
        loop = asyncio.get_running_loop()
        out = loop.create_future()
        left = [len(parts)]  # parts not yet done

        def part_done(part: asyncio.Future) -> None:
            if out.done():
                return
            left[0] -= 1
            if part.cancelled() or part.exception() is not None:  # the rest is of no use: dropped if still queued
                for other in parts:
                    other.cancel()
                out.cancel() if part.cancelled() else out.set_exception(part.exception())
            elif not left[0]:
                out.set_result([emb for p in parts for emb in p.result()])

        def out_done(f: asyncio.Future) -> None:
            with self._cv:
                self._video_parts.pop(f, None)
            if f.cancelled():  # nobody waits for the request any more
                for part in parts:
                    part.cancel()

        for part in parts:
            part.add_done_callback(part_done)
        with self._cv:
            self._video_parts[out] = parts
        out.add_done_callback(out_done)
        return out

    def _queue(self, work: list, what: str, reserved: bool, held: int | None = None) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        request = object()
        room = len(work) if held is None else held  # the queue's places the work takes: `held`, one request's own
        with self._cv:
            if reserved:
                if self._stopping:
                    raise QueueFull("the server is shutting down")
                self._reserved -= room
            else:
                self._check_room(room, what)
            jobs = [Job(item, loop.create_future(), loop, request, task=task) for item, task in work]
            self._requests[request] = collections.deque(jobs)
            self._waiting += len(jobs)
            self._cv.notify_all()
        for job in jobs:
            job.future.add_done_callback(functools.partial(self._cancelled, job))
        return [j.future for j in jobs]

    def _cancelled(self, job: Job, future: asyncio.Future) -> None:
        """A job's future is done (on its loop): cancelled, the job leaves the queue (one an engine thread took
        already is left out of its pass there, unless launched)."""
        if not future.cancelled():
            return
        with self._cv:
            jobs = self._requests.get(job.request)
            if jobs is None or job not in jobs:
                return
            jobs.remove(job)
            if not jobs:
                del self._requests[job.request]
            self._waiting -= 1
        self.on_drop(job)

    def _pop(self, room: float | None) -> Job | None:
        """The head job of the first request in line (room None), or of the first whose head is an image of at
        most `room` tokens; that request goes to the back of the line, where requests that arrive join it.
        So every request waiting gets a job before any gets a second: a new request waits for at most one
        job of each request ahead of it, and a long one moves a job a round however many arrive. Under the
        lock."""
        for request, jobs in self._requests.items():
            head = jobs[0]
            if room is not None and (head.task is not None or head.tokens > room):
                continue
            jobs.popleft()
            if jobs:
                self._requests.move_to_end(request)
            else:
                del self._requests[request]
            return head
        return None

    def drop(self, future: asyncio.Future) -> bool:
        """Work nobody waits for any more: cancelled (dropped before its pass) and True, unless it runs
        already and nothing of it waits in the queue (an image in a launched pass; a video request whose
        parts left are all running), which ends all the same: then False, and its future gets its value,
        which the caller keeps (cached and counted, not thrown away). On the event loop."""
        with self._cv:
            parts = self._video_parts.get(future, [future])
            left = [p for p in parts if not p.done()]
            if left and all(p in self._in_pass for p in left):
                return False
            # Its queued parts are cancelled here, under the lock the engine thread takes them by: left to the
            # request future's callback (later, on the loop), the next part could start in between.
            for part in left:
                if part is not future and part not in self._in_pass:
                    part.cancel()
            future.cancel()  # its callbacks run later, on the loop; the engine thread checks cancelled() too
        return True

    def expedite(self, future: asyncio.Future) -> None:
        """Another request waits for this queued job's value too (the same image): unless it is next of its
        request, the job leaves that request and queues at the back of the line as a request of its own, so
        the newcomer waits for it as for a new request, not for every job ahead of it in a long request.
        Nothing if it is already taken."""
        with self._cv:
            for jobs in self._requests.values():
                job = next((j for j in jobs if j.future is future), None)
                if job is None:
                    continue
                if job is jobs[0]:
                    return  # its request's next: no later than a request of its own would be
                jobs.remove(job)
                job.request = object()
                self._requests[job.request] = collections.deque([job])
                return

    def _take_batch(self, lane: int) -> list[Job] | None:
        """The next pass of `lane`: images in turn up to the capacity. With the lane's GPU idle it waits at most
        max_wait from the oldest image's arrival for more; while the GPU still runs the lane's last pass, it
        gathers until just before that pass should end (Pace: a pass launched sooner would only queue behind
        it, with fewer images; large images lost a fifth of their rate so), then launches, its launch
        overlapping the GPU's last work; the running pass was its wait for company."""
        with self._cv:
            while not self._requests and not self._stopping:
                self._cv.wait()
            if not self._requests:
                return None  # stopping, nothing left
            batch = [self._pop(None)]
            if batch[0].task is not None or not self.shares_passes:
                return batch  # a task runs on its own; so does an image where passes share nothing
            used = batch[0].tokens
            deadline = batch[0].queued + self.max_wait  # the oldest image waits at most max_wait in all
            gathered = False  # while the lane's GPU ran a pass
            while used < self.capacity:
                job = self._pop(self.capacity - used)
                if job is not None:
                    batch.append(job)
                    used += job.tokens
                    continue
                if self._requests or self._stopping:
                    break  # what waits does not fit: it opens the next pass
                if self._running[lane]:
                    at = self._pace[lane].launch_at()
                    if at is not None and time.perf_counter() >= at:
                        break
                    # Woken by a new image or the GPU's end of a pass, or when the pace says to launch.
                    self._cv.wait(None if at is None else at - time.perf_counter())
                    gathered = True
                    continue
                if gathered:
                    break
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cv.wait(left)
            return batch

    def _engine(self, lane: int):
        """A lane's engine thread: takes a batch once fewer than `ahead` of its passes are out, launches it
        and hands it to the completion thread; it never waits for the GPU."""
        slots, done = self._slots[lane], self._done[lane]
        while True:
            slots.acquire()  # images arriving meanwhile join the next batch
            batch = self._take_batch(lane)
            if batch is None:
                done.put(None)
                return
            with self._cv:  # jobs cancelled while the batch gathered never reach the pass
                gone = [j for j in batch if j.future.cancelled()]
                batch = [j for j in batch if not j.future.cancelled()]
                self._waiting -= len(gone) + len(batch)
                self._taken += bool(batch)
                self._in_pass.update(j.future for j in batch)
            for job in gone:
                self.on_drop(job)
            if not batch:
                slots.release()
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            task = batch[0].task
            times = None if task is not None else PassTimes(lane, len(batch), sum(j.tokens for j in batch),
                                                            queued=t0 - min(j.queued for j in batch))
            try:
                pending, error = (_Done([task(lane)]) if task is not None else
                                  self.backend.launch_on(lane, [j.item for j in batch])), None
            except Exception as e:  # the pass failed: every image in it gets the error
                pending, error = None, e
            t1 = time.perf_counter()
            if times is not None:
                times.launch, times.launch_cpu = t1 - t0, time.thread_time() - c0
            self.on_busy(lane, t1 - t0)
            if pending is not None and times is not None:  # an image pass the GPU runs (a task has run)
                with self._cv:
                    self._running[lane] += 1
                    self._pace[lane].launched(times.tokens, t0, t1)
            done.put((batch, pending, error, times))

    def _complete(self, lane: int):
        """A lane's completion thread: waits for each launched pass, copies its embeddings back and resolves
        its futures, in launch order."""
        slots, done = self._slots[lane], self._done[lane]
        while True:
            entry = done.get()
            if entry is None:
                return
            batch, pending, error, times = entry
            outs = None
            try:
                if pending is not None:
                    t0 = time.perf_counter()
                    try:
                        pending.wait()
                    finally:
                        with self._cv:  # the GPU has ended it: the engine thread launches the next now
                            if times is not None:
                                self._running[lane] -= 1
                                self._pace[lane].ended(time.perf_counter())
                            self._cv.notify_all()
                    t1, c1 = time.perf_counter(), time.thread_time()
                    outs = pending.fetch()
                    if times is not None:
                        times.gpu, times.fetch = t1 - t0, time.perf_counter() - t1
                        times.fetch_cpu = time.thread_time() - c1
            except Exception as e:
                error = e
            finally:
                del pending  # the pass's device outputs go before the next pass is taken
                slots.release()
            t0 = time.perf_counter()
            by_loop: dict = {}  # each job's value, by the event loop its future resolves on
            for i, job in enumerate(batch):
                by_loop.setdefault(job.loop, []).append((job, error if error is not None else outs[i]))
            if times is not None:
                # Counted before any result is handed back: a client that reads /metrics once it has its
                # answer finds its pass there. A failing hook costs the pass's metrics, never its results.
                times.resolve = time.perf_counter() - t0
                try:
                    self.on_pass(times)
                except Exception:
                    log.exception("on_pass (the metrics of a pass of %d images on lane %d) failed; its results "
                                  "are handed back all the same", times.images, lane)
            for loop, values in by_loop.items():
                try:
                    loop.call_soon_threadsafe(self._resolve_all, values)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    with self._cv:
                        self._in_pass.difference_update(job.future for job, _ in values)
            with self._cv:
                self._taken -= 1

    @property
    def busy(self) -> bool:
        """Work queued, or a pass (or task) being launched, run or handed back."""
        with self._cv:
            return bool(self._waiting or self._taken)

    def stop(self, timeout: float | None = None):
        """Finish what is queued (dropped work is skipped), then stop the threads; each is waited for at
        most `timeout` seconds (None: until it ends)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _resolve_all(self, values: list) -> None:
        """A pass's (job, value) pairs of one loop, each to its future (_resolve), on that loop. A failing
        on_drop hook costs that drop's count, never the other jobs' results."""
        for job, value in values:
            try:
                self._resolve(job, value)
            except Exception:
                log.exception("handing a pass's result to its request failed (the on_drop hook); the pass's "
                              "other results are handed back all the same")

    def _resolve(self, job: Job, value) -> None:
        """A job's value (or error) to its future, on its loop, where drop() runs too: a job stays in_pass until
        its value is there, so drop() never cancels a finished one. A future cancelled meanwhile (the request
        went away, its work ran all the same) counts as dropped."""
        with self._cv:
            self._in_pass.discard(job.future)
        if job.future.done():
            if job.future.cancelled() and not isinstance(value, BaseException):
                self.on_drop(job)
            return
        if isinstance(value, BaseException):
            job.future.set_exception(value)
        else:
            job.future.set_result(value)


class Budget:
    """An amount held server-wide (pixels in flight, bytes of request bodies) within `total`. Used from the
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

    @property
    def own(self) -> int:  # what this process holds: all of it (shares.SharedBudget's differs)
        return self.used


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

    async def run(self, calls: list[tuple[Callable[[], object], bool]], on_cancel=None) -> list:
        """[(fn, large), ...] of one request -> their values or exceptions, in order. Cancelled, the jobs not
        started are dropped and those running are waited for (their threads hold memory until they end), once
        on_cancel() has told them to stop where they can."""
        loop = asyncio.get_running_loop()
        jobs = [_Decode(fn, large, loop.create_future()) for fn, large in calls]
        token = object()
        self._waiting[token] = collections.deque(jobs)
        self._dispatch(loop)
        try:
            return await asyncio.gather(*[j.result for j in jobs], return_exceptions=True)
        except asyncio.CancelledError:
            self._waiting.pop(token, None)
            if on_cancel is not None:
                on_cancel()
            running = [j.ended for j in jobs if j.ended is not None and not j.ended.done()]
            if running:
                await asyncio.wait(running)
            raise

    def _dispatch(self, loop) -> None:
        while self.busy < self.workers and self._waiting:
            for token, jobs in self._waiting.items():  # in turn
                if not jobs[0].large or self.busy_large < self.large_slots:
                    break
            else:
                return  # only large jobs wait, and the threads they may hold are busy
            job = jobs.popleft()
            if jobs:
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
