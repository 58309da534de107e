"""Frames between glmvit-serve's HTTP workers and its engine (serving/wire.py): whatever way the bytes are cut
on their way, every frame comes out whole and equal to what was sent, payloads and headers larger than the
scratch buffer included (read into buffers of their own: the scratch never grows); the end of the stream is
None; a reader that falls behind pauses the socket and resumes it; a large payload goes through a file in the
link's spill folder, removed once read (or once its link ends unread), and through the socket where no
file can be written."""

import asyncio
import os
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


async def linked(spill=None):
    """Two Links at the ends of a Unix socket pair, on the running loop."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair(socket.AF_UNIX)
    _, left = await loop.create_unix_connection(lambda: wire.Link(spill=spill), sock=a)
    _, right = await loop.create_unix_connection(lambda: wire.Link(spill=spill), sock=b)
    return left, right


@pytest.mark.parametrize("folder", [None, "there", "missing"])
def test_frames_cross_a_socket_pair_equal_large_payloads_through_a_file_removed_once_read(folder, tmp_path, rng):
    spill = folder and str(tmp_path / "frames")  # missing: no file can be written, the socket takes them
    if folder == "there":
        os.mkdir(spill)
    sent = frames(rng)

    async def go():
        left, right = await linked(spill)
        for f in sent:
            left.send(*f)
        if folder == "there":  # the 5.7 MB embedding alone is past SPILL_BYTES; written before it is read
            assert [os.path.getsize(os.path.join(spill, n)) for n in os.listdir(spill)] == [sent[2][2][0].nbytes]
        got = [await right.read() for _ in sent]
        if folder == "there":
            assert os.listdir(spill) == []
        left.close()
        assert await right.read() is None
        right.close()
        return got

    for s, g in zip(sent, asyncio.run(go())):
        same(s, g)


def test_what_the_reader_left_unread_goes_with_the_link_and_a_bad_name_is_refused(tmp_path, rng):
    spill = str(tmp_path)
    big = [rng.standard_normal((64, 1024)).astype(np.float32)]  # 256 KiB

    async def go():
        left, right = await linked(spill)
        other = wire.Link(spill=spill)  # another link of this process: its files are its own
        kept = wire.pack("done", (0, 0), big, spill, other.tag)
        left.send("done", (1, 0), big)
        left.send("done", (2, 0), big)
        assert len(os.listdir(spill)) == 3
        same(("done", (1, 0), big), await right.read())
        right.close()  # the second frame never read: its file goes when the sender's link ends
        assert await left.read() is None
        return kept

    kept = asyncio.run(go())
    assert len(os.listdir(spill)) == 1
    same(("done", (0, 0), big), wire._frame(bytes(kept[1]), b"", spill))
    assert os.listdir(spill) == []
    header = pickle.dumps(("done", (0, 0), [((4,), "float32")], "../escape"), protocol=5)
    lost = wire._frame(header, b"", spill)[2]
    assert isinstance(lost, wire.PayloadLost) and "does not read" in str(lost)
    lost = wire._frame(bytes(kept[1]), b"", spill)[2]  # read once: gone
    assert isinstance(lost, wire.PayloadLost) and "No such file" in str(lost)


def test_frames_sent_before_a_close_are_read_and_a_lost_payload_fails_its_frame_alone(tmp_path, rng):
    spill = str(tmp_path)
    big = [rng.standard_normal((64, 1024)).astype(np.float32)]

    async def go():
        left, right = await linked(spill)
        doomed = wire.pack("done", (1, 0), big, spill, left.tag)
        os.unlink(os.path.join(spill, pickle.loads(doomed[1])[3]))  # its file gone before the reader gets to it
        for part in doomed:
            left.transport.write(part)
        left.send("done", (2, 0), big)
        left.close()  # this end closing: the other still reads what was sent
        kind, fields, arrays = await right.read()
        assert (kind, fields) == ("done", (1, 0)) and isinstance(arrays, wire.PayloadLost)
        same(("done", (2, 0), big), await right.read())
        assert await right.read() is None
        right.close()

    asyncio.run(go())
    assert os.listdir(spill) == []


def test_an_error_crosses_as_itself_or_as_its_text():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    assert isinstance(wire.error_from(wire.error_fields(ValueError("bad image 3"))), ValueError)
    e = wire.error_from(wire.error_fields(Odd(1, 2)))
    assert isinstance(e, RuntimeError) and "Odd: 1/2" in str(e)
    assert "could not be read" in str(wire.error_from(pickle.dumps(1)[:-1]))


def test_a_worker_whose_answer_is_lost_fails_that_image_alone(tmp_path, rng):
    remote = pytest.importorskip("glmvit_cupy.serving.remote", reason="the serve extra is not installed")
    spill = str(tmp_path)
    emb = rng.standard_normal((64, 1024)).astype(np.float32)
    image = rng.integers(0, 256, (300, 300, 3), dtype=np.uint8)  # 270 KB: through a file

    async def go():
        worker_end, engine_end = await linked(spill)
        about = {"geometry": None, "name": "fake", "resize": "gpu", "shares_passes": True, "lanes": 1,
                 "fingerprint": None}
        engine = remote.RemoteEngine(worker_end, about, max_queue=8)
        futures = engine.submit([(image, (1, 2, 2), {"tokens": 1}), (image, (1, 2, 2), {"tokens": 1})])
        kind, fields, arrays = await engine_end.read()
        assert kind == "images" and len(arrays) == 2 and np.array_equal(arrays[1], image)
        doomed = wire.pack("done", (fields[0], 0), [emb], spill, engine_end.tag)
        os.unlink(os.path.join(spill, pickle.loads(doomed[1])[3]))
        for part in doomed:
            engine_end.transport.write(part)
        engine_end.send("done", (fields[0], 1), [emb])
        with pytest.raises(wire.PayloadLost):
            await futures[0]
        assert np.array_equal(await futures[1], emb) and engine._gone is None  # the link goes on
        worker_end.close()
        assert await engine_end.read() is None
        engine_end.close()

    asyncio.run(go())
