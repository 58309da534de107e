"""The same content in flight is encoded once: a request that finds an image (or video) another request is
encoding waits for that result instead of encoding it again, and queued work whose every request went
away is dropped before its pass. Used from the event loop only."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class Orphaned(Exception):
    """The request that was to encode this content stopped before queueing it (refused, or its client went
    away); a request waiting for it encodes it itself."""


@dataclass(eq=False)
class Flight:
    """Content being encoded for one or more requests: `result` is (embedding, about) once its pass is done."""
    key: tuple
    result: asyncio.Future
    refs: int = 1                       # requests waiting for it
    group: list | None = None           # the flights its queued job settles (an image: itself; a request's videos)
    job: asyncio.Future | None = None   # the batcher's future, once queued


class Flights:
    """Content being encoded now, by key (a Flight each); `cache` keeps what their passes give and answers
    first; batcher() is the service's Batcher, once loaded."""

    def __init__(self, cache, batcher):
        self.cache, self._batcher = cache, batcher
        self._by_key: dict = {}

    def start(self, key) -> Flight:
        f = Flight(key, asyncio.get_running_loop().create_future())
        f.result.add_done_callback(_retrieved)
        self._by_key[key] = f
        return f

    def join(self, key) -> Flight | None:
        """The flight encoding this content for another request, now shared with this one: its queued job
        then waits in the line as a request of its own (Batcher.expedite), not in the other's turns."""
        f = self._by_key.get(key)
        if f is not None:
            f.refs += 1
            if f.job is not None and not f.job.done():
                self._batcher().expedite(f.job)
        return f

    def abandon(self, f: Flight) -> None:
        """f's owner stops before queueing it: those waiting for it encode it themselves."""
        if self._by_key.get(f.key) is f:
            del self._by_key[f.key]
        if not f.result.done():
            f.result.set_exception(Orphaned())

    def leave(self, f: Flight) -> None:
        """A request is done with f (answered, refused or gone); queued work nobody waits for is dropped, and
        its flights are no longer found (a request for the same content starts its own). Work in a pass that
        has begun runs on: its embedding is cached and counted when it comes, and a request for the same
        content meanwhile joins it."""
        f.refs -= 1
        if f.job is not None and not f.job.done() and all(g.refs <= 0 for g in f.group):
            if not self._batcher().drop(f.job):
                return
            for g in f.group:
                if self._by_key.get(g.key) is g:
                    del self._by_key[g.key]

    def queued_as(self, group: list, job: asyncio.Future, unpack, on_encoded) -> None:
        """group's flights settled by the batcher's `job`: unpack(its value) -> [(embedding, about)] in the
        group's order, each cached and counted by on_encoded(flight, embedding)."""
        for f in group:
            f.group, f.job = group, job
        if any(f.refs > 1 for f in group):  # joined while it was decoded
            self._batcher().expedite(job)

        def settle(job):
            for f in group:
                if self._by_key.get(f.key) is f:
                    del self._by_key[f.key]
            if job.cancelled():  # dropped, or the server stopped: whoever still waits encodes it again
                for f in group:
                    if not f.result.done():
                        f.result.set_exception(Orphaned())
                return
            if job.exception() is not None:
                for f in group:
                    if not f.result.done():
                        f.result.set_exception(job.exception())
                return
            for f, (emb, about) in zip(group, unpack(job.result())):
                self.cache.put(f.key, emb, about)
                on_encoded(f, emb)
                if not f.result.done():
                    f.result.set_result((emb, about))

        job.add_done_callback(settle)

    async def gather(self, keys: list, queue_own) -> tuple[dict, dict]:
        """{key: (embedding, about)} and {key: "cached" | "encoded" | "shared"} for the distinct keys, in
        rounds: each from the cache, or from the flight already encoding it, or encoded by this request
        (queue_own(own keys, their flights) decodes and queues them); a flight orphaned by its owner is
        taken up in the next round."""
        got, how, held = {}, {}, {}
        try:
            pending = list(keys)
            while pending:
                own = []
                for k in pending:
                    hit = self.cache.get(k)
                    if hit is not None:
                        got[k], how[k] = hit, "cached"
                        continue
                    held[k] = self.join(k)
                    if held[k] is None:
                        held[k] = self.start(k)
                        own.append(k)
                if own:
                    try:
                        await queue_own(own, held)
                    except BaseException:
                        for k in own:
                            self.abandon(held[k])
                        raise
                retry = []
                for k in pending:
                    if k in got:
                        continue
                    try:
                        got[k] = await asyncio.shield(held[k].result)
                        how[k] = "encoded" if k in own else "shared"
                    except Orphaned:
                        retry.append(k)
                    self.leave(held.pop(k))
                pending = retry
        finally:
            for f in held.values():
                self.leave(f)
        return got, how


def _retrieved(future: asyncio.Future) -> None:
    """A flight's result read even where nobody waits for it any more (no 'exception never retrieved')."""
    if not future.cancelled():
        future.exception()
