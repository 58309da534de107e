"""CPU time a frame costs the process that reads it (serving/wire.py's Link) beside asyncio's StreamReader
reading the same frames with readexactly(), on asyncio's loop and on uvloop's where it is installed (uvicorn
uses it). A thread of this process sends the frames over a Unix socket pair; the reader's thread CPU time
is what a worker or the engine spends taking embeddings or images off the socket.

    python tools/wire_bench.py [--frames 2000] [--tokens 128]

Napkin math: a 128-token embedding is 128 x 4096 x 2 = 1.05 MB; one copy out of the kernel at ~10 GB/s is
~0.1 ms. StreamReader copies it three times (into its buffer, out as bytes, and the buffer's front deleted).
"""

import argparse
import asyncio
import os
import socket
import sys
import threading
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from benchmarks.common import table  # noqa: E402
from glmvit_cupy.serving import wire  # noqa: E402


async def stream_read(reader: asyncio.StreamReader):
    try:
        size, length = wire.HEAD.unpack(await reader.readexactly(wire.HEAD.size))
        header = await reader.readexactly(size)
        payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        return None
    return wire._frame(header, payload)


async def measure(how: str, frames: int, emb) -> tuple[float, float]:
    """(reader's CPU ms a frame, wall ms a frame)."""
    a, b = socket.socketpair(socket.AF_UNIX)

    def send():
        for i in range(frames):
            wire.write_blocking(a, "done", (i, 0), [emb])
        a.close()

    if how == "Link":
        _, link = await asyncio.get_running_loop().create_unix_connection(wire.Link, sock=b)
        read = link.read
    else:
        reader, _ = await asyncio.open_unix_connection(sock=b, limit=1 << 24)
        read = lambda: stream_read(reader)  # noqa: E731
    sender = threading.Thread(target=send)
    c0, t0 = time.thread_time(), time.perf_counter()
    sender.start()
    n = 0
    while await read() is not None:
        n += 1
    c1, t1 = time.thread_time(), time.perf_counter()
    sender.join()
    b.close()
    assert n == frames
    return 1e3 * (c1 - c0) / n, 1e3 * (t1 - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=128, help="rows of 4096 bf16 a frame (default 128: 1.05 MB)")
    args = ap.parse_args()
    emb = np.random.default_rng(0).standard_normal((args.tokens, 4096)).astype(ml_dtypes.bfloat16)
    loops = [("asyncio", asyncio.new_event_loop)]
    try:
        import uvloop

        loops.append(("uvloop", uvloop.new_event_loop))
    except ImportError:
        pass
    rows = []
    for name, new_loop in loops:
        for how in ("StreamReader", "Link"):
            loop = new_loop()
            try:
                cpu, wall = loop.run_until_complete(measure(how, args.frames, emb))
            finally:
                loop.close()
            rows.append([name, how, f"{emb.nbytes / 1e6:.2f}", f"{cpu:.3f}", f"{wall:.3f}"])
    table(["loop", "reader", "MB a frame", "reader CPU ms a frame", "wall ms a frame"], rows)


if __name__ == "__main__":
    main()
