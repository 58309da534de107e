"""The engine process of glmvit-serve --workers N: the tower and its Batcher, fed by the HTTP workers over
a Unix socket (wire.py). A worker does a request's host work (HTTP, hashing, decoding, the cache, the
reply); this process only uploads what the workers decoded, packs passes, launches them and sends the
embeddings back, so the interpreter lock that bounds one process serving HTTP does not sit between
the requests and the GPU.

Frames a worker sends: ("hello", (its process id,)) first, then ("images", (request id, [(grid, info),
...]), [decoded image, ...]), ("videos", (request id, planned videos)), ("cancel", ((request id, index),
...)), ("drop", ((request id, index), ...)) (cancel unless in a pass already launched), ("expedite",
(request id, index)), ("drained",) once it has answered everything in a drain. This process answers
("loading",) while it loads the tower, ("ready", (about,)) once it has (or ("failed", (why,))), then
("done", (request id, index), [embedding, ...]) or ("error", (request id, index, pickled exception)) for
each image or video request as its pass ends, ("dropped", (request id, index)) for work dropped before
its value came, and ("release",) once every worker has drained.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading

from . import wire
from .batcher import Batcher


class EngineServer:
    """load_backend() (on a thread) gives the Backend; workers connect to `path` and are served in turn by
    one Batcher. state: "loading", "ok" or "failed" (error: why); ready: set once it is known which."""

    # A request's decoded images up to this are uploaded on the event loop itself: a copy of ~0.1 ms costs less than
    # a crossing to an upload thread and back (small images 743-758 images/s against 622-749 with every upload on
    # a thread, H100, `benchmarks/bench_serve.py --small --requests 1440`).
    INLINE_BYTES = 1 << 20

    def __init__(self, load_backend, *, capacity_tokens: int, max_wait_ms: float, max_queue: int, metrics,
                 fingerprint=lambda: None, log=print):
        self.load_backend, self.metrics, self.fingerprint, self.log = load_backend, metrics, fingerprint, log
        self.capacity_tokens, self.max_wait_ms, self.max_queue = capacity_tokens, max_wait_ms, max_queue
        self.state, self.error, self.backend, self.batcher = "loading", None, None, None
        self.ready = asyncio.Event()
        self.workers = 0  # connected and told the tower is ready
        self.started: set = set()  # the process ids of the workers that reached the engine
        self.links: dict = {}      # a connected worker's process id -> its stream
        self.drained: set = set()  # the workers that have answered everything they held, in a drain
        # Uploads of a request's decoded images over INLINE_BYTES (Backend.ahead): off the event loop, which reads
        # and writes frames meanwhile.
        self._uploads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="glmvit-upload")

    def start_loading(self) -> None:
        loop = asyncio.get_running_loop()

        def load():
            try:
                backend = self.load_backend()
                batcher = Batcher(backend, capacity_tokens=self.capacity_tokens, max_wait_s=self.max_wait_ms / 1e3,
                                  max_queue=self.max_queue,
                                  on_pass=lambda times: self.metrics.record_pass(times, self.capacity_tokens),
                                  on_drop=self.metrics.record_drop,
                                  on_busy=lambda lane, seconds: self.metrics.engine_busy.inc(seconds))
                done = functools.partial(self._loaded, backend, batcher, None)
            except Exception as e:  # noqa: BLE001 - told to every worker, logged by the server
                done = functools.partial(self._loaded, None, None, f"{type(e).__name__}: {e}")
            try:
                loop.call_soon_threadsafe(done)
            except RuntimeError:  # the server stopped while it loaded
                pass

        threading.Thread(target=load, name="glmvit-load", daemon=True).start()

    def _loaded(self, backend, batcher, error) -> None:
        self.backend, self.batcher, self.error = backend, batcher, error
        self.state = "failed" if error else "ok"
        self.ready.set()

    def about(self) -> dict:
        """What a worker needs to know of the tower (remote.RemoteEngine)."""
        b = self.backend
        return {"geometry": b.geometry, "name": b.name, "resize": b.resize,
                "shares_passes": b.shares_passes, "lanes": b.lanes, "fingerprint": self.fingerprint()}

    async def worker(self, link: wire.Link) -> None:
        """One worker's connection, until it closes: its requests' jobs queued, their results sent back. A
        worker gone (exited, killed) takes its queued jobs with it: they are dropped before their passes."""
        jobs: dict = {}  # (request id, index) -> the Batcher's future
        pid = None
        try:
            hello = await link.read()
            if hello is None or hello[0] != "hello":
                return
            pid = hello[1][0]
            self.started.add(pid)
            self.links[pid] = link
            if not self.ready.is_set():  # the worker answers 503 meanwhile
                link.send("loading")
                await self.ready.wait()
            if self.state != "ok":
                link.send("failed", (self.error,))
                return
            link.send("ready", (self.about(),))
            self.workers += 1
            while True:
                frame = await link.read()
                if frame is None:
                    return
                kind, fields, arrays = frame
                if kind in ("images", "videos"):
                    rid = fields[0]
                    try:
                        futures = await self._queue(kind, fields, arrays)
                    except Exception as e:  # noqa: BLE001 - that request's failure alone (an upload out of memory)
                        for i in range(len(fields[1]) if kind == "images" else 1):
                            link.send("error", (rid, i, wire.error_fields(e)))
                        continue
                elif kind == "cancel":
                    for key in fields:
                        if key in jobs:
                            jobs[key].cancel()
                    continue
                elif kind == "drop":  # dropped unless in a pass already launched; the worker is told which
                    for key in fields:
                        if key in jobs:
                            self.batcher.drop(jobs[key])
                    continue
                elif kind == "drained":
                    self.drained.add(pid)
                    continue
                elif kind == "expedite":
                    if fields in jobs:
                        self.batcher.expedite(jobs[fields])
                    continue
                else:
                    self.log(f"an HTTP worker sent a frame of unknown kind {kind!r}: left alone")
                    continue
                for i, future in enumerate(futures):
                    jobs[(rid, i)] = future
                    future.add_done_callback(functools.partial(self._answer, link, jobs, (rid, i), kind))
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception as e:  # noqa: BLE001 - a frame this process cannot take: that worker's link ends
            self.log(f"an HTTP worker's link to the engine failed ({type(e).__name__}: {e}); its requests get 503")
        finally:
            if pid is not None and self.links.get(pid) is link:
                del self.links[pid]
            for future in list(jobs.values()):
                future.cancel()  # nobody waits for them: dropped before their passes
            link.close()

    def everyone_drained(self, alive: set) -> bool:
        """Every live worker linked to the engine has drained (one not linked holds nothing: it stops alone)."""
        linked = alive & set(self.links)
        return bool(linked) and linked <= self.drained

    def release(self) -> None:
        """Tell every drained worker to stop: the drain is over for all of them."""
        for pid in list(self.drained):
            link = self.links.get(pid)
            if link is not None and not link.is_closing():
                link.send("release")
        self.drained.clear()

    async def _queue(self, kind: str, fields: tuple, arrays: list) -> list:
        """A worker's images (uploaded first: on the loop up to INLINE_BYTES, else on an upload thread) or videos
        queued: their futures."""
        if kind == "images":
            items = [(image, grid, info) for image, (grid, info) in zip(arrays, fields[1])]
            if sum(image.nbytes for image in arrays) <= self.INLINE_BYTES:
                items = self._ahead(items)
            else:
                items = await asyncio.get_running_loop().run_in_executor(self._uploads, self._ahead, items)
            return self.batcher.submit(items)
        return [self.batcher.submit_videos(fields[1])]

    def _ahead(self, items: list) -> list:
        return [self.backend.ahead(item) for item in items]

    @staticmethod
    def _answer(link: wire.Link, jobs: dict, key: tuple, kind: str, future: asyncio.Future) -> None:
        jobs.pop(key, None)
        if link.is_closing():
            return
        if future.cancelled():  # dropped (a worker's "drop", or "cancel": then it no longer waits to hear)
            link.send("dropped", key)
            return
        e = future.exception()
        if e is not None:
            link.send("error", (*key, wire.error_fields(e)))
            return
        value = future.result()
        link.send("done", key, value if kind == "videos" else [value])

    def stop(self) -> None:
        """The queued passes finished (workers have drained first), then the engine's threads ended."""
        if self.batcher is not None:
            self.batcher.stop()
        self._uploads.shutdown(wait=False)
