"""Keeping the GPU fed: images decoded and prepared on a thread pool, handed on in input order
(`in_order`: encode(images) returns its outputs in order) or as they finish (`as_done`: glmvit-encode,
whose outputs are keyed by path, so that a large photo holds up no pass).

Pillow releases the GIL while it decodes (and NumPy while it copies), so threads prepare images side by
side while the caller's thread packs batches and launches them on the GPU. Used by encode(images),
Replicas.encode and glmvit-encode; plain Python, tested without a GPU.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Iterator


def default_workers() -> int:
    """Threads for host preparation: the machine's cores, at most 16 (past that the GPU is the limit)."""
    return max(1, min(16, os.cpu_count() or 1))


def in_order(fn: Callable, items: Iterable, workers: int, ahead: int | None = None) -> Iterator:
    """fn(index, item) for each item, yielded in input order; with workers > 1, up to `ahead` (default
    2 x workers + 2) calls run ahead on threads. An exception a call raises is raised when its turn
    comes (the ones before it are yielded first); closing the generator early cancels what has not
    started and waits for what has."""
    return _feed(fn, items, workers, ahead, ordered=True)


def as_done(fn: Callable, items: Iterable, workers: int, ahead: int | None = None) -> Iterator:
    """As in_order, but yielded as the calls finish (those finishing together in input order), so a slow
    item holds up only itself. An exception a call raises is raised when that call is yielded (which
    ends the stream)."""
    return _feed(fn, items, workers, ahead, ordered=False)


def _feed(fn, items, workers, ahead, ordered):
    if hasattr(items, "__len__"):
        workers = min(workers, len(items))  # no pool of 16 threads for one image
    if workers <= 1:
        for i, item in enumerate(items):
            yield fn(i, item)
        return
    ahead = max(1, ahead if ahead is not None else 2 * workers + 2)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="glmvit-prepare")
    try:
        todo, window = enumerate(items), {}  # future -> its index, in the order submitted
        for i, item in itertools.islice(todo, ahead):
            window[pool.submit(fn, i, item)] = i
        while window:
            if ordered:
                done = [next(iter(window))]  # the oldest: its result() below waits for it
            else:
                done = sorted(wait(window, return_when=FIRST_COMPLETED)[0], key=window.get)
            for fut in done:
                del window[fut]
                nxt = next(todo, None)
                if nxt is not None:
                    window[pool.submit(fn, *nxt)] = nxt[0]
                yield fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
