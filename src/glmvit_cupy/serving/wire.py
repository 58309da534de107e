"""Frames between glmvit-serve's HTTP workers and its engine process, over a Unix socket in a folder only
the server's user can open: a pickled header, and the arrays' bytes beside it, so that pixels and
embeddings cross without being pickled (a 1.5 MB embedding is one copy into the socket and one out).

    frame   = <header bytes: u64> <payload bytes: u64> header payload
    header  = pickle((kind, fields, [(shape, dtype name), ...]))   the arrays, in the payload's order
    payload = the arrays' bytes, back to back (C order)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import pickle
import socket
import struct

import ml_dtypes  # noqa: F401 - registers bfloat16, the embeddings' type, with NumPy
import numpy as np

HEAD = struct.Struct("<QQ")


def pack(kind: str, fields: tuple = (), arrays=()) -> list:
    """One frame as buffers to write in order (the arrays' own memory, not copied)."""
    shapes = [np.shape(a) for a in arrays]
    # C order and this machine's byte order, flat (a 0-d array keeps its shape in the header)
    flat = [np.ascontiguousarray(a, dtype=np.asarray(a).dtype.newbyteorder("=")).reshape(-1) for a in arrays]
    header = pickle.dumps((kind, fields, [(shape, a.dtype.name) for shape, a in zip(shapes, flat)]), protocol=5)
    return [HEAD.pack(len(header), sum(a.nbytes for a in flat)), header,
            *(memoryview(a.view(np.uint8)) for a in flat if a.nbytes)]


class Link(asyncio.BufferedProtocol):
    """One end of a frame stream, used from its event loop: send() queues a frame, `await read()` gives the
    next. Bytes arrive into a scratch buffer, whole frames are cut from it, and a header or payload larger
    than what the scratch holds is received straight into its own buffer: a 1 MB embedding is one copy out
    of the kernel, where asyncio's StreamReader makes three (0.33 CPU ms a frame against 0.13,
    tools/wire_bench.py).
    Each end asks the kernel for SOCKET_BYTES of room each way (capped by net.core.wmem_max / rmem_max), so a
    1.5 MB embedding is one send, not a turn of both event loops per 200 KB: the engine process's CPU 0.95 against
    1.4 ms an image on a 2-core host (`benchmarks/bench_serve.py --host-only --small --workers 2`).
    Reading pauses while more than PAUSE_BYTES of frames wait to be read."""

    SCRATCH = 1 << 18
    SOCKET_BYTES = 1 << 23
    PAUSE_BYTES = 1 << 26

    def __init__(self, on_connect=None):
        self.on_connect = on_connect  # on_connect(link) runs as a task once the connection is made
        self.transport, self.task = None, None
        self._scratch, self._have = bytearray(self.SCRATCH), 0
        # A frame's part read into its own buffer: [header (None while it is the part being read), the buffer,
        # bytes of it received, the payload's length]
        self._big: list | None = None
        self._frames: collections.deque = collections.deque()  # (header, payload) of the frames not yet read
        self._waiting_bytes, self._paused, self._ended = 0, False, False
        self._waiter: asyncio.Future | None = None

    # -- asyncio's side --------------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # the system's cap (net.core.wmem_max / rmem_max) applies
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.SOCKET_BYTES)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.SOCKET_BYTES)
        if self.on_connect is not None:
            self.task = asyncio.ensure_future(self.on_connect(self))  # held: a task only weakly held may go

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            _, buf, got, _ = self._big
            return memoryview(buf)[got:]
        return memoryview(self._scratch)[self._have:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is None:
            self._have += nbytes
            self._cut()
            return
        big = self._big
        big[2] += nbytes
        if big[2] < len(big[1]):
            return
        header, buf, _, length = big
        if header is not None:  # the payload, whole
            self._big = None
            self._deliver(header, buf)
        elif length:  # the header, whole: the payload next, into its own buffer
            self._big = [bytes(buf), bytearray(length), 0, length]
        else:
            self._big = None
            self._deliver(bytes(buf), bytearray())

    def eof_received(self) -> bool:
        self._end()
        return False  # the transport closes itself

    def connection_lost(self, exc) -> None:
        self._end()

    # -- frames --------------------------------------------------------------------------------------------

    def _cut(self) -> None:
        """Whole frames out of the scratch buffer; a header or payload that does not fit it goes on in its own
        buffer."""
        buf, at, have = self._scratch, 0, self._have
        while have - at >= HEAD.size:
            size, length = HEAD.unpack_from(buf, at)
            start = at + HEAD.size + size
            if start > have:  # the header is not all here yet
                if HEAD.size + size > len(buf):  # nor would it fit: it goes on in its own buffer
                    header = bytearray(size)
                    header[:have - at - HEAD.size] = buf[at + HEAD.size:have]
                    self._big, at = [None, header, have - at - HEAD.size, length], have
                break
            header = bytes(memoryview(buf)[at + HEAD.size:start])
            if have - start >= length:
                self._deliver(header, buf[start:start + length])  # a copy: the scratch is reused
                at = start + length
                continue
            payload = bytearray(length)
            payload[:have - start] = buf[start:have]
            self._big, at = [header, payload, have - start, length], have
            break
        if at:
            buf[:have - at] = buf[at:have]
            self._have = have - at

    def _deliver(self, header: bytes, payload: bytearray) -> None:
        self._frames.append((header, payload))
        self._waiting_bytes += len(header) + len(payload)
        if self._waiting_bytes > self.PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self):
        """The next frame as (kind, fields, arrays), the arrays read-only views of its payload; None at the end
        of the stream (the other process closed it, or ended)."""
        while not self._frames:
            if self._ended:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        header, payload = self._frames.popleft()
        self._waiting_bytes -= len(header) + len(payload)
        if self._paused and self._waiting_bytes <= self.PAUSE_BYTES // 2:
            self._paused = False
            self.transport.resume_reading()
        return _frame(header, payload)

    def send(self, kind: str, fields: tuple = (), arrays=()) -> None:
        """Queue one frame (the transport sends what it can at once, and buffers the rest). Part by part:
        writelines() joins the parts into one copy on Python 3.11."""
        for part in pack(kind, fields, arrays):
            self.transport.write(part)

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def read_blocking(sock) -> tuple | None:
    """read() on a blocking socket (a worker's first answer from the engine, before its event loop runs)."""
    def exactly(n: int) -> bytes | None:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                return None
            got += k
        return bytes(buf)

    head = exactly(HEAD.size)
    if head is None:
        return None
    size, length = HEAD.unpack(head)
    header, payload = exactly(size), exactly(length) if length else b""
    return None if header is None or payload is None else _frame(header, payload)


def write_blocking(sock, kind: str, fields: tuple = (), arrays=()) -> None:
    for part in pack(kind, fields, arrays):
        sock.sendall(part)


def _frame(header: bytes, payload: bytes) -> tuple:
    kind, fields, specs = pickle.loads(header)
    arrays, at = [], 0
    for shape, name in specs:
        dtype = np.dtype(name)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(payload, dtype, count, at).reshape(shape)
        array.flags.writeable = False
        arrays.append(array)
        at += count * dtype.itemsize
    return kind, fields, arrays


def error_fields(e: BaseException) -> bytes:
    """An exception to send: pickled as it is, or, where it cannot be, a RuntimeError with its type and text."""
    try:
        blob = pickle.dumps(e, protocol=5)
        pickle.loads(blob)  # an exception whose __init__ does not take its args pickles, but does not unpickle
        return blob
    except Exception:  # noqa: BLE001 - any object may refuse to be pickled
        return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"), protocol=5)


def error_from(blob: bytes) -> BaseException:
    try:
        e = pickle.loads(blob)
    except Exception as failed:  # noqa: BLE001 - a class the worker cannot rebuild
        return RuntimeError(f"the engine failed, and its error could not be read ({failed})")
    return e if isinstance(e, BaseException) else RuntimeError(repr(e))
