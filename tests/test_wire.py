"""Frames between glmvit-serve's HTTP workers and its engine (serving/wire.py): whatever way the bytes are cut
on their way, every frame comes out whole and equal to what was sent, payloads and headers larger than the
scratch buffer included (read into buffers of their own: the scratch never grows); the end of the stream is
None; a reader that falls behind pauses the socket and resumes it."""

import asyncio
import pickle
import socket

import ml_dtypes
import numpy as np
import pytest

from glmvit_cupy.serving import wire


class Transport:
    """Records what the Link asks of its transport."""

    def __init__(self):
        self.paused = self.resumed = 0
        self.written = []

    def pause_reading(self):
        self.paused += 1

    def resume_reading(self):
        self.resumed += 1

    def write(self, data):
        self.written.append(bytes(data))

    def is_closing(self):
        return False

    def get_extra_info(self, name, default=None):
        return default  # no socket under it


def frames(rng):
    """Frames of every shape: empty, small, a payload past the scratch buffer, a header past it, 0-d arrays."""
    big = rng.standard_normal((700, 4096)).astype(ml_dtypes.bfloat16)  # 5.7 MB: past SCRATCH
    return [("cancel", ((3, 0),), []),
            ("images", (7, [((1, 4, 6), {"tokens": 6})]), [rng.integers(0, 256, (13, 17, 3), dtype=np.uint8)]),
            ("done", (7, 0), [big]),
            ("videos", (8, ["x" * (wire.Link.SCRATCH + 12345)]), []),  # a header larger than the scratch
            ("done", (9, 1), [rng.standard_normal(()).astype(np.float32), rng.standard_normal((2, 3))]),
            ("release", (), [])]


def feed(link, data: bytes, cuts):
    """Give `data` to the link as asyncio would: into its get_buffer() views, in pieces of at most `cuts`."""
    at = 0
    while at < len(data):
        view = link.get_buffer(-1)
        assert len(view) > 0
        n = min(len(view), cuts(), len(data) - at)
        view[:n] = data[at:at + n]
        at += n
        del view
        link.buffer_updated(n)


def same(sent, got):
    kind, fields, arrays = sent
    assert got[0] == kind and got[1] == fields and len(got[2]) == len(arrays)
    for a, b in zip(arrays, got[2]):
        a = np.asarray(a)
        assert b.shape == a.shape and b.dtype == a.dtype and not b.flags.writeable
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("cut", ["one byte", "ragged", "whole"])
def test_frames_come_out_whole_however_the_bytes_are_cut(cut, rng):
    sent = frames(rng)
    data = b"".join(bytes(p) for f in sent for p in wire.pack(*f))
    sizes = {"one byte": lambda: 1 if rng.random() < 0.001 else 1 << 30, "whole": lambda: 1 << 30,
             "ragged": lambda: int(rng.integers(1, 70000))}[cut]

    async def go():
        link = wire.Link()
        link.connection_made(Transport())
        if cut == "one byte":  # a byte at a time through the first frames, then as they come
            head = b"".join(bytes(p) for f in sent[:2] for p in wire.pack(*f))
            feed(link, head, lambda: 1)
            feed(link, data[len(head):], sizes)
        else:
            feed(link, data, sizes)
        link.eof_received()
        assert len(link._scratch) == wire.Link.SCRATCH  # a large header was read into a buffer of its own
        got = [await link.read() for _ in sent]
        assert await link.read() is None
        return got

    for s, g in zip(sent, asyncio.run(go())):
        same(s, g)


def test_a_reader_behind_pauses_the_socket_and_resumes_it(monkeypatch):
    monkeypatch.setattr(wire.Link, "PAUSE_BYTES", 2 << 20)
    frame = ("done", (1, 0), [np.arange(300_000, dtype=np.float32)])  # 1.2 MB each
    data = b"".join(bytes(p) for p in wire.pack(*frame))

    async def go():
        link = wire.Link()
        transport = Transport()
        link.connection_made(transport)
        feed(link, data, lambda: 1 << 30)
        assert transport.paused == 0  # 1.2 MB waiting: over the limit only with a second
        feed(link, data, lambda: 1 << 30)
        assert transport.paused == 1
        await link.read()
        assert transport.resumed == 0  # 1.2 MB still waiting: over half the limit
        await link.read()
        assert transport.resumed == 1

    asyncio.run(go())


def test_a_frame_sent_over_a_socket_pair_arrives_equal(rng):
    sent = frames(rng)

    async def go():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair(socket.AF_UNIX)
        _, left = await loop.create_unix_connection(wire.Link, sock=a)
        _, right = await loop.create_unix_connection(wire.Link, sock=b)
        for f in sent:
            left.send(*f)
        got = [await right.read() for _ in sent]
        left.close()
        assert await right.read() is None
        right.close()
        return got

    for s, g in zip(sent, asyncio.run(go())):
        same(s, g)


def test_an_embedding_goes_into_the_socket_at_once(rng):
    """The link gives its socket room for a frame: a 2 MB embedding (256 tokens of the official tower) is taken
    by the kernel in one send, none of it left in the transport's buffer for later turns of the loop."""
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            cap = int(f.read())
    except OSError:
        pytest.skip("no /proc/sys/net/core/wmem_max: the system's cap on socket buffers is not known here")
    if cap < 4 << 20:
        pytest.skip(f"this system caps a socket's send buffer at {cap} bytes (net.core.wmem_max)")
    embedding = rng.standard_normal((256, 4096)).astype(ml_dtypes.bfloat16)

    async def go():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair(socket.AF_UNIX)
        _, left = await loop.create_unix_connection(wire.Link, sock=a)
        _, right = await loop.create_unix_connection(wire.Link, sock=b)
        left.send("done", (1, 0), [embedding])
        waiting = left.transport.get_write_buffer_size()
        got = await right.read()
        left.close()
        right.close()
        return waiting, got

    waiting, got = asyncio.run(go())
    assert waiting == 0
    same(("done", (1, 0), [embedding]), got)


def test_an_error_crosses_as_itself_or_as_its_text():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    assert isinstance(wire.error_from(wire.error_fields(ValueError("bad image 3"))), ValueError)
    e = wire.error_from(wire.error_fields(Odd(1, 2)))
    assert isinstance(e, RuntimeError) and "Odd: 1/2" in str(e)
    assert "could not be read" in str(wire.error_from(pickle.dumps(1)[:-1]))
