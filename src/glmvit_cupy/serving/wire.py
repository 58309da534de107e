"""Frames between glmvit-serve's HTTP workers and its engine process, over a Unix socket in a folder only
the server's user can open: a pickled header, and the arrays' bytes beside it, so that pixels and
embeddings cross without being pickled (a 1.5 MB embedding is one copy into the socket and one out).

    frame   = <header bytes: u64> <payload bytes: u64> header payload
    header  = pickle((kind, fields, [(shape, dtype name), ...]))   the arrays, in the payload's order
    payload = the arrays' bytes, back to back (C order)
"""

from __future__ import annotations

import asyncio
import pickle
import struct

import ml_dtypes  # noqa: F401 - registers bfloat16, the embeddings' type, with NumPy
import numpy as np

HEAD = struct.Struct("<QQ")
STREAM_LIMIT = 1 << 24  # asyncio's read buffer: a frame of embeddings arrives without pausing the socket


def pack(kind: str, fields: tuple = (), arrays=()) -> list:
    """One frame as buffers to write in order (the arrays' own memory, not copied)."""
    shapes = [np.shape(a) for a in arrays]
    # C order and this machine's byte order, flat (a 0-d array keeps its shape in the header)
    flat = [np.ascontiguousarray(a, dtype=np.asarray(a).dtype.newbyteorder("=")).reshape(-1) for a in arrays]
    header = pickle.dumps((kind, fields, [(shape, a.dtype.name) for shape, a in zip(shapes, flat)]), protocol=5)
    return [HEAD.pack(len(header), sum(a.nbytes for a in flat)), header,
            *(memoryview(a.view(np.uint8)) for a in flat if a.nbytes)]


def write(writer: asyncio.StreamWriter, kind: str, fields: tuple = (), arrays=()) -> None:
    """Queue one frame on the stream (the transport sends what it can at once, and buffers the rest)."""
    for part in pack(kind, fields, arrays):
        writer.write(part)


async def read(reader: asyncio.StreamReader):
    """The next frame as (kind, fields, arrays), the arrays read-only views of its payload; None at the end
    of the stream (the other process closed it, or ended)."""
    try:
        size, length = HEAD.unpack(await reader.readexactly(HEAD.size))
        header = await reader.readexactly(size)
        payload = await reader.readexactly(length) if length else b""
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return _frame(header, payload)


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
        arrays.append(np.frombuffer(payload, dtype, count, at).reshape(shape))
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
