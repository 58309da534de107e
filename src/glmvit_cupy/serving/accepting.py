"""Which HTTP worker of glmvit-serve --workers N takes a new connection: one holding the fewest.

The workers accept from the one listening socket they share. Left to the event loop, the worker that a
burst of new connections wakes accepts every one queued (asyncio up to its backlog, uvloop until none is
left): 16 clients connecting at once landed 471, 357, 272, 145, 102, 93, 0 and 0 of 1,440 requests on
the 8 workers (`benchmarks/bench_serve.py --small`, H100), and a burst past one worker's
--max-connections is refused there while the others have room. Here each worker writes how many
connections it holds into a table the server process shares out (Share: an int a worker), accepts one
connection at a time, and takes a new one at once only while no other worker holds fewer; otherwise it
waits HOLD first (FULL where it holds its --max-connections and another does not), and takes the
connection only if it is still there (the worker holding fewer is busy or stopped). A worker not
accepting (starting, stopping, gone) counts IDLE, so no other waits for it. Spreading the connections
leaves the service's small-image rate where it was (678.7 against 673.8 images/s, three runs each in one
call): the engine process bounds it, not the workers."""

from __future__ import annotations

import asyncio
import errno
import socket

HOLD = 0.005  # seconds a worker holding more than another leaves a new connection to the others
FULL = 0.05   # ... and one holding its --max-connections, which would refuse it, while another has room
RETRY = 1.0   # seconds accepting pauses when the process is out of descriptors or memory (asyncio's own delay)
IDLE = 2**31 - 1  # the count of a worker not accepting (starting, stopped or gone): none waits for it


class Share:
    """The connections each worker holds: `counts`, a shared int a worker (multiprocessing's RawArray,
    made by the server process before it starts them, IDLE each); `slot`, this worker's; `cap`, the
    connections a worker serves (--max-connections: one over it is refused)."""

    def __init__(self, counts, slot: int, cap: int):
        self.counts, self.slot, self.cap = counts, slot, cap
        self.accepting = False

    def held(self, n: int) -> None:
        self.counts[self.slot] = n if self.accepting else IDLE

    def hold(self) -> float:
        """Seconds to leave a new connection to the other workers first: 0 while none holds fewer."""
        mine = self.counts[self.slot]
        others = [n for i, n in enumerate(self.counts) if i != self.slot]
        if mine >= self.cap and any(n < self.cap for n in others):
            return FULL
        return HOLD if any(n < mine for n in others) else 0.0


async def serve(sock: socket.socket, backlog: int, factory, share: Share, held, log) -> None:
    """Listen on the bound `sock` (the workers share it) and accept connections from it until cancelled,
    each served by a protocol from factory(); held(): the connections this worker holds now (its protocols'
    count, which they also publish as they close)."""
    loop = asyncio.get_running_loop()
    sock.listen(backlog)
    sock.setblocking(False)
    share.accepting = True
    share.held(held())
    try:
        await _accept(loop, sock, factory, share, held, log)
    finally:
        share.accepting = False
        share.held(0)  # IDLE: it takes no more


async def _accept(loop, sock: socket.socket, factory, share: Share, held, log) -> None:
    while True:
        try:
            await _readable(loop, sock)
            hold = share.hold()
            if hold:
                await asyncio.sleep(hold)
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue  # another worker took it, or its client left first
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                log(f"cannot accept a connection ({e.strerror}): accepting again in {RETRY:g} s")
                await asyncio.sleep(RETRY)
                continue
            share.held(held() + 1)  # counted before the others look again; the protocol then counts it exactly
            try:
                conn.setblocking(False)
                await loop.connect_accepted_socket(factory, conn)
            except OSError:  # the client reset it meanwhile
                conn.close()
            share.held(held())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never stop accepting: a worker that did would serve nobody
            log(f"accepting a connection failed ({type(e).__name__}: {e}); accepting again in {RETRY:g} s")
            await asyncio.sleep(RETRY)


async def _readable(loop, sock: socket.socket) -> None:
    """Once a connection waits to be accepted (every worker is woken; one takes it)."""
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())
