"""An HTTP worker's view of the engine process (engine_server.py): the backend and the batcher the app
uses (app.create_app), with the tower in the other process. Images are decoded here, sent as decoded
pixels (the engine uploads and resizes them exactly as it does its own), and their embeddings come back
into this process's memory. The queue's room (--max-queue) is this worker's own; the engine's Batcher
takes requests from every worker in turn."""

from __future__ import annotations

import asyncio
import functools
import itertools

from . import wire
from .batcher import QueueFull
from .requests import Refused


class EngineGone(Refused):
    def __init__(self, why: str):
        super().__init__(503, f"the engine process stopped ({why}): retry on a running server")


class EngineFailed(RuntimeError):
    """The engine process could not load the tower (it logs why)."""


class RemoteEngine:
    """The backend (geometry, name, resize, patching, ahead) and the batcher (reserve, submit, submit_videos,
    expedite, depth, busy, stop) in one: `batcher` is itself. Used from the event loop only."""

    def __init__(self, link: wire.Link, about: dict, max_queue: int):
        self.link, self.max_queue = link, max_queue
        self.geometry = about["geometry"]
        self.name, self.resize, self.lanes = about["name"], about["resize"], about["lanes"]
        self.shares_passes, self.fingerprint = about["shares_passes"], about["fingerprint"]
        self.batcher = self
        self.on_gone = None  # called once the engine's link has ended
        self.on_release = None  # called when the engine process says every worker has drained
        self._ids = itertools.count()
        self._pending: dict = {}  # (request id, index) -> future
        self._keys: dict = {}     # future -> (request id, index)
        self._reserved, self._stopping = 0, False
        self._gone: str | None = None  # why the link ended
        self._reading = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, sock, first: tuple, max_queue: int) -> "RemoteEngine":
        """The engine on `sock` (a connected Unix socket, hello sent), whose first answer was `first`: once it
        has loaded the tower (waiting for its "ready" after a "loading"); its load error raised."""
        _, link = await asyncio.get_running_loop().create_unix_connection(wire.Link, sock=sock)
        frame = first if first[0] != "loading" else await link.read()
        if frame is None:
            link.close()
            raise RuntimeError("the engine process closed the connection before the tower was loaded")
        kind, fields, _ = frame
        if kind != "ready":
            link.close()
            raise EngineFailed(fields[0])
        return cls(link, fields[0], max_queue)

    # -- the backend ---------------------------------------------------------------------------------------

    def patching(self):
        from ..preprocessing.image import Patching

        return Patching.of(self.geometry)

    def ahead(self, item: tuple) -> tuple:
        return item  # the engine uploads it on arrival

    # -- the batcher -----------------------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return self._reserved + len(self._pending)

    busy = False  # the passes are the engine process's: it says when it finishes them

    def reserve(self, n: int, what: str = "images") -> None:
        self._check(n, what)
        self._reserved += n

    def unreserve(self, n: int) -> None:
        self._reserved -= n

    def _check(self, n: int, what: str) -> None:
        if self._stopping:
            raise QueueFull("the server is shutting down")
        if self._gone is not None:
            raise EngineGone(self._gone)
        if n > self.max_queue:
            raise QueueFull(f"this request has {n} {what}, more than the queue ever holds "
                            f"({self.max_queue}, --max-queue): send them in smaller requests", ever=True)
        if self.depth + n > self.max_queue:
            raise QueueFull(f"{self.depth} images or tasks are waiting and this request brings {n}; the queue "
                            f"holds {self.max_queue} (--max-queue): retry later")

    def _room(self, n: int, what: str, reserved: bool) -> None:
        if reserved:  # refused, the room stays reserved: the caller gives it back (unreserve)
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self._gone is not None:
                raise EngineGone(self._gone)
            self._reserved -= n
        else:
            self._check(n, what)

    def submit(self, items: list, reserved: bool = False) -> list[asyncio.Future]:
        self._room(len(items), "images", reserved)
        rid = next(self._ids)
        self.link.send("images", (rid, [(grid, info) for _, grid, info in items]),
                   [image for image, _, _ in items])
        return [self._expect((rid, i), False) for i in range(len(items))]

    def submit_videos(self, planned: list, reserved: bool = False) -> asyncio.Future:
        self._room(1, "tasks", reserved)
        rid = next(self._ids)
        self.link.send("videos", (rid, planned))
        return self._expect((rid, 0), True)

    def _expect(self, key: tuple, videos: bool) -> asyncio.Future:
        """A future for the answer to `key`: an embedding, or for videos a list of them."""
        future = asyncio.get_running_loop().create_future()
        self._pending[key], self._keys[future] = (future, videos), key
        future.add_done_callback(functools.partial(self._settled, key))
        return future

    def _settled(self, key: tuple, future: asyncio.Future) -> None:
        self._pending.pop(key, None)
        self._keys.pop(future, None)
        if future.cancelled() and self._gone is None and not self.link.is_closing():
            self.link.send("cancel", (key,))  # nobody waits for it: dropped before its pass

    def drop(self, future: asyncio.Future) -> bool:
        """Batcher.drop across the link: the engine drops the work unless it is in a pass already launched,
        and says which ("dropped", or its value as for any work); the future stays pending until then, so
        False here: the caller keeps whatever value comes."""
        key = self._keys.get(future)
        if key is None or self._gone is not None or self.link.is_closing():
            future.cancel()
            return True
        self.link.send("drop", (key,))
        return False

    def expedite(self, future: asyncio.Future) -> None:
        key = self._keys.get(future)
        if key is not None and self._gone is None:
            self.link.send("expedite", key)

    def drained(self) -> None:
        """Tell the engine process this worker has answered everything it held (a drain)."""
        if self._gone is None and not self.link.is_closing():
            self.link.send("drained")

    def stop(self, timeout: float | None = None) -> None:
        """No more work taken (the engine process finishes the passes and stops with the server)."""
        self._stopping = True

    async def _read(self) -> None:
        why = "its connection closed"
        try:
            while True:
                frame = await self.link.read()
                if frame is None:
                    break
                kind, fields, arrays = frame
                if kind == "done":
                    future, videos = self._pending.get(fields, (None, False))
                    if future is not None and not future.done():
                        if videos or len(arrays) == 1:
                            future.set_result(arrays if videos else arrays[0])
                        else:
                            future.set_exception(RuntimeError(f"the engine sent {len(arrays)} embeddings for "
                                                              "one image"))
                elif kind == "dropped":  # dropped before its pass, as drop() asked
                    future, _ = self._pending.get(fields, (None, False))
                    if future is not None and not future.done():
                        future.cancel()
                elif kind == "release" and self.on_release is not None:
                    self.on_release()
                elif kind == "error":
                    future, _ = self._pending.get(tuple(fields[:2]), (None, False))
                    if future is not None and not future.done():
                        future.set_exception(wire.error_from(fields[2]))
        except Exception as e:  # noqa: BLE001 - a frame this worker cannot read: the link is unusable
            why = f"{type(e).__name__}: {e}"
        self._gone = why
        if self.on_gone is not None:
            self.on_gone()
        for future, _ in list(self._pending.values()):
            if not future.done():
                future.set_exception(EngineGone(why))  # each its own: a shared one would keep every traceback
        self.link.close()
