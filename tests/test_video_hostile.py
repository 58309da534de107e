"""Hostile video files: a stream that declares 0x0 frames and holds large ones, timestamps that wrap, and a
file of millions of tiny packets, each against what the server counts, what the reader keeps, and how soon a
dropped request's reading stops."""

import fractions
import io
import struct

import numpy as np
import pytest

av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")

from glmvit_cupy.preprocessing import video_files  # noqa: E402
from glmvit_cupy.preprocessing.video import REFERENCE  # noqa: E402


def unsized_avi(w=640, h=480, frames=40, fps=10, lead_s=6, declared=(0, 0)) -> bytes:
    """An AVI of H.264 whose header declares `declared` frames: 6 s of silent lead-in packets ("Q264" then
    an access unit delimiter: the decoder takes them and gives no frame, without an error) make FFmpeg's
    stream probe stop before the first real frame, so the stream stays at the header's size; the frames that
    follow are w x h (their SPS in-band)."""
    enc = av.CodecContext.create("libx264", "w")
    enc.width, enc.height, enc.pix_fmt = w, h, "yuv420p"
    enc.time_base, enc.framerate = fractions.Fraction(1, fps), fps
    enc.options = {"preset": "ultrafast", "g": "1000"}
    packets = []
    for i in range(frames):
        f = av.VideoFrame.from_ndarray(np.full((h, w, 3), i * 5 % 255, np.uint8), format="rgb24").reformat(
            format="yuv420p")
        f.pts = i
        packets += [bytes(p) for p in enc.encode(f)]
    packets += [bytes(p) for p in enc.encode(None)]
    placeholder, lead = b"\x00\x00\x00\x01\x0cPLACE", b"Q264\x00\x00\x00\x01\x09\xf0"  # same length
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as c:  # the AVI muxer wants a start code first: patched in below
        s = c.add_stream("h264", rate=fps)
        s.width, s.height, s.time_base = 16, 16, fractions.Fraction(1, fps)
        for i, d in enumerate([placeholder] * (lead_s * fps) + packets):
            p = av.Packet(d)
            p.stream, p.pts, p.dts, p.time_base, p.is_keyframe = s, i, i, s.time_base, i <= lead_s * fps
            c.mux(p)
    data = bytearray(buf.getvalue().replace(placeholder, lead))
    j = data.index(b"strf") + 8  # BITMAPINFOHEADER: biSize, biWidth, biHeight
    assert struct.unpack_from("<Iii", data, j) == (40, 16, 16)
    struct.pack_into("<ii", data, j + 4, *declared)
    struct.pack_into("<ii", data, data.index(b"avih") + 8 + 32, *declared)  # dwWidth, dwHeight
    return bytes(data)


def test_a_stream_declaring_0x0_frames_is_admitted_at_the_pixels_its_decode_holds():
    """glmvit-serve admits a video file against --max-pixels-in-flight by its stream's declared frame size
    (serving.decoding.video_pixels) before decoding it. A header of 0x0 (here an AVI whose probe stops before
    the first frame) is counted as 0 pixels a frame, and 16,384 of overhead, while the decode keeps its
    frames at their decoded size, capped only by --max-video-pixels (2^32): the admission must count at
    least what the decode then holds."""
    from glmvit_cupy.serving.decoding import prepare_video, video_pixels

    data = unsized_avi()
    with av.open(io.BytesIO(data)) as c:
        assert (c.streams.video[0].width, c.streams.video[0].height) == (0, 0)  # as the server reads it
    common = {"sample": True, "target_fps": 2, "max_frames": 2048, "max_duration": 0, "min_image_tokens": 16,
              "max_image_tokens": 240000}
    video = {"file": data, "frames": None, "fps": None, "duration": None}
    admitted = video_pixels(video, 0, common, 89_478_485, 2**32, REFERENCE)
    frames, _, _ = prepare_video(video, 0, common, 89_478_485, 2**32, REFERENCE)
    held = sum(f.shape[0] * f.shape[1] for f in frames)
    assert frames[0].shape == (480, 640, 3)
    assert admitted >= held, f"admitted {admitted:,} pixels, the decode held {held:,}"


def wrapped_ts(n=100, fps=10, before_wrap_s=5) -> bytes:
    """An MPEG-TS of n MPEG-2 frames whose 33-bit timestamps wrap `before_wrap_s` seconds in (as a broadcast
    capture's do once a day): FFmpeg reads the frames before the wrap with negative timestamps."""
    enc = av.CodecContext.create("mpeg2video", "w")
    enc.width, enc.height, enc.pix_fmt = 48, 32, "yuv420p"
    enc.time_base, enc.framerate, enc.gop_size, enc.max_b_frames = fractions.Fraction(1, fps), fps, fps, 0
    rng = np.random.default_rng(0)
    packets = []
    for i in range(n):
        f = av.VideoFrame.from_ndarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8), format="rgb24").reformat(
            format="yuv420p")
        f.pts = i
        packets += [(bytes(p), p.is_keyframe) for p in enc.encode(f)]
    packets += [(bytes(p), p.is_keyframe) for p in enc.encode(None)]
    start, step = (1 << 33) - before_wrap_s * 90000, 90000 // fps
    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts") as c:
        s = c.add_stream("mpeg2video", rate=fps)
        s.width, s.height, s.time_base = 48, 32, fractions.Fraction(1, 90000)
        for i, (d, key) in enumerate(packets):
            p = av.Packet(d)
            p.stream, p.pts, p.dts, p.time_base, p.is_keyframe = s, start + i * step, start + i * step, s.time_base, key
            c.mux(p)
    return buf.getvalue()


def test_frames_before_a_timestamp_wrap_are_decoded_too():
    """The scan counts 100 frames over 10 s; the decode after container.seek(0) starts at timestamp 0, the
    wrap, and drops the 5 s before it: the video was then re-sampled as a 49-frame, 4.9 s one, without a word
    (torchcodec, the reference, seeks to the scanned first frame's timestamp)."""
    data = wrapped_ts()
    with av.open(io.BytesIO(data)) as c:
        assert sum(1 for _ in c.decode(c.streams.video[0])) == 100  # read from its start, the file has them all
    assert video_files.probe(data, "video 0")[2:] == (100, 10.0, 10.0)
    got, meta = video_files.load_video(data, lambda total, fps, duration: np.arange(total))
    assert meta["total_frames"] >= 95 and meta["duration"] >= 9.5, meta["total_frames"]


def packet_storm(n: int) -> bytes:
    """A NUT file of n 1-byte MJPEG packets at 25 fps (4 bytes each in the file): FFmpeg opens it, and the scan
    of its packets (the frame count) reads every one. Its title, "variant-0000", is there to be replaced
    (n distinct files for the price of one)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="nut") as c:
        c.metadata["title"] = "variant-0000"
        s = c.add_stream("mjpeg", rate=25)
        s.width, s.height, s.pix_fmt, s.time_base = 16, 16, "yuvj420p", fractions.Fraction(1, 25)
        for i in range(n):
            p = av.Packet(b"\x00")
            p.stream, p.pts, p.dts, p.is_keyframe = s, i, i, True
            c.mux(p)
    return buf.getvalue()


def test_counting_a_packet_storm_unsampled_holds_no_python_object_a_packet():
    """sample=False: the admission's sampled_frames makes list(range(total)) and a set of it, ~110 bytes a
    packet of a 4-byte-a-packet file (a 192 MB file, the body limit's: ~5 GB) before the count refuses it."""
    import tracemalloc

    from glmvit_cupy.serving.decoding import video_pixels

    data = packet_storm(1 << 20)
    size = len(data)
    common = {"sample": False, "target_fps": 2, "max_frames": 2048, "max_duration": 0, "min_image_tokens": 16,
              "max_image_tokens": 240000}
    tracemalloc.start()
    try:
        video_pixels({"file": data, "frames": None, "fps": None, "duration": None}, 0, common, 89_478_485, 2**32,
                     REFERENCE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * size, f"{peak:,} bytes for a {size:,}-byte file"



def test_a_dropped_requests_scan_and_decode_stop_at_its_event():
    """A file of millions of tiny packets takes seconds to minutes to scan (~3 us a packet): once its request is
    dropped, the stop event ends the admission's scan and the decode (Dropped, an ImageError naming it) within
    STOP_EVERY packets, rather than holding a decoding thread and the file for a client that left."""
    import threading

    stop = threading.Event()
    stop.set()
    data = packet_storm(2 * video_files.STOP_EVERY)
    for read in (lambda: video_files.probe(data, "video 3", stop=stop),
                 lambda: video_files.VideoFile(data, stop=stop).read(lambda t, f, d: [0], None, None, "video 3")):
        with pytest.raises(video_files.Dropped, match="video 3: not read"):
            read()
    assert video_files.probe(data, "video 3")[2] == 2 * video_files.STOP_EVERY  # read whole without it


def test_a_cancelled_decoding_job_is_told_to_stop_before_it_is_waited_for():
    """Decoders.run, cancelled (the client went away), calls on_cancel before it waits for the jobs already
    running: a job watching that event returns at once instead of holding its thread to the end."""
    import asyncio
    import threading

    from glmvit_cupy.serving.batcher import Decoders

    stop, started, seen = threading.Event(), threading.Event(), []

    def job():
        started.set()
        seen.append(stop.wait(60))  # True: told to stop; False: ran to its end

    async def main():
        decoders = Decoders(2)
        task = asyncio.ensure_future(decoders.run([(job, True)], on_cancel=stop.set))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        decoders.pool.shutdown()

    asyncio.run(main())
    assert seen == [True]
