"""glmvit-serve under abuse, on loopback with the float32 reference (CPU CI): requests admitted against the
queue and the pixels in flight before anything is decoded, decoding threads shared fairly, slow and
numerous connections, content in flight encoded once, work for clients gone dropped, draining on SIGTERM,
a model that fails to load, what the metrics and the cache count, and the messages a client gets."""

import base64
import contextlib
import io
import json
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("starlette", reason="the serve extra (starlette, uvicorn, prometheus_client) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from tests.golden import cases  # noqa: E402
from tests.test_serve import SRC, TOWER, healthy, metric, png, post, post_video, served_port  # noqa: E402

from glmvit_cupy import ServerError  # noqa: E402
from glmvit_cupy.client import Client  # noqa: E402


def launch(*flags, checkpoint=TOWER, data_limit=None, prelude="pass", wait_s=20.0, cwd=None):
    """glmvit-serve --cpu in a subprocess (its memory capped at data_limit bytes of RLIMIT_DATA; `prelude`:
    Python run before main; cwd: its working folder): (process, client), once /health says ok."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))

    def cap():
        if data_limit is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (data_limit, data_limit))
        # As from a terminal: under nohup (SIGHUP ignored, and inherited) the server would ignore SIGHUP too.
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    code = f"import sys; {prelude}; from glmvit_cupy.serving.main import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "--checkpoint", checkpoint, "--cpu", "--port", "0",
                             *map(str, flags)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=cap, cwd=cwd)
    return proc, healthy(proc, Client(f"http://127.0.0.1:{served_port(proc, wait_s)}", timeout=60), wait_s)


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def slow(seconds: float) -> str:
    """A prelude making every pass of the reference take `seconds` longer, on the engine thread: work queued
    behind a pass then waits in the queue for a known time."""
    return ("import time; from glmvit_cupy.backend import Backend; launch_on = Backend.launch_on; "
            f"Backend.launch_on = lambda self, lane, items: (time.sleep({seconds}), launch_on(self, lane, items))[1]")


def busy(seconds: float) -> str:
    """As slow(), but the engine thread computes (NumPy matrix products) for `seconds`, as a CPU pass does:
    a process that exits under it can crash."""
    return ("import time; import numpy as np; from glmvit_cupy.backend import Backend; "
            "launch_on = Backend.launch_on; a = np.ones((384, 384), np.float32); "
            "work = lambda end: [a @ a for _ in iter(lambda: time.perf_counter() < end, False)]; "
            f"Backend.launch_on = lambda self, lane, items: (work(time.perf_counter() + {seconds}), "
            "launch_on(self, lane, items))[1]")


@pytest.fixture(scope="module")
def server():
    """Small limits, to be reached by small requests."""
    proc, client = launch("--max-queue", 8, "--max-pixels", 16_000_000, "--max-pixels-in-flight", 20_000_000,
                          "--max-wait-ms", 400,
                          "--decode-workers", 2, "--header-timeout", 1, "--body-timeout", 1, "--max-connections", 16,
                          "--cache-mib", 16, "--max-reply-mib", 1)
    yield proc, client
    stop(proc)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(w: int, h: int) -> bytes:
    """A PNG that says it is w x h (its pixels are not there: only its header is ever read)."""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def variants(data: bytes, n: int) -> list[bytes]:
    """n files of one PNG's pixels with distinct bytes (a text chunk after the header): n sha256s, n encodes."""
    return [data[:33] + chunk(b"tEXt", b"n\x00%d" % i) + data[33:] for i in range(n)]


def flat_png(w: int, h: int, colour=(90, 120, 150)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def raw_request(client, head: bytes, wait_s: float) -> bytes:
    """What the server answers to `head` (sent, then nothing more) within wait_s seconds, up to its close."""
    s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
    s.settimeout(wait_s)
    s.sendall(head)
    reply = b""
    try:
        while True:
            got = s.recv(65536)
            if not got:
                break
            reply += got
    except socket.timeout:
        pass
    s.close()
    return reply


# -- 1. admission before decoding; pixels in flight; decoding threads shared -----------------------------------

def test_more_images_than_the_queue_holds_is_413_before_any_is_decoded(server):
    """9 images against --max-queue 8, one of them not an image: refused from the count, 413, before any is
    decoded (decoding first would have found the broken one: 422)."""
    _, client = server
    images = [b64(png(40, 40 + i, 300 + i)) for i in range(8)] + [b64(b"not an image")]
    got, err = post(client, json.dumps({"images": images}).encode())
    assert got == 413 and err["index"] is None, err
    assert err["error"] == ("this request has 9 images, more than the server's queue ever holds (8, --max-queue): "
                            "send at most 8 a request")


def ico_holding(png_bytes: bytes) -> bytes:
    """An ICO whose one directory entry says 16 x 16 and holds `png_bytes` (a PNG of any size)."""
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(png_bytes), 22) + png_bytes


def test_an_icon_counts_as_the_decode_limit_since_its_header_can_understate(server):
    """An ICO's directory says 16 x 16 but may hold a PNG of up to --max-pixels, and Pillow decodes it as it
    opens it: reading its "header" decoded it, outside --max-pixels-in-flight (four 81 MP ones: 2.4 GB). It
    is now told by its first bytes, never opened to be admitted, and counts as --max-pixels (16,000,000
    here): two in one request need 32,000,000, over the 20,000,000 in flight, so 413 before any is
    decoded; one alone is answered."""
    from glmvit_cupy.preprocessing.decode import header_size

    _, client = server
    inner = flat_png(600, 500)
    icon = ico_holding(inner)
    assert header_size(icon) == (0, None) and header_size(icon, 16_000_000) == (16_000_000, None)  # never opened
    assert header_size(inner, 16_000_000) == (300_000, (600, 500))  # a PNG's header is its size
    import warnings

    from glmvit_cupy.preprocessing.decode import decode_rgb

    with warnings.catch_warnings():  # the decoding process's decode, under its filters: no other warning
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "Image was not the expected size", UserWarning)  # as decoding.py's
        assert decode_rgb(icon, "image 0").shape == (500, 600, 3)
    got, err = post(client, json.dumps({"images": [b64(icon), b64(ico_holding(flat_png(600, 501)))]}).encode())
    assert got == 413 and "need 32,000,000 pixels decoded and resized at once (2 of them ICO files, counted at --max-pixels, " \
        "16,000,000 pixels, each: their headers need not say what they hold; send them as PNG), over the " \
        "20,000,000" in err["error"], err
    got, answer = post(client, json.dumps({"images": [b64(icon)], "max_image_tokens": 64}).encode())
    assert got == 200, answer


def test_a_videos_icon_frames_are_named_in_its_refusal_and_a_frame_over_the_limit_counts_as_failed(server):
    """Two ICO frames of a video count 16,000,000 pixels each, and 16,384 more each (a frame's own memory):
    413 saying so (it named no ICO before); a frame
    over --max-pixels is refused 422 at admission and counted as a failed video, as its decode would count it."""
    _, client = server
    icons = [b64(ico_holding(flat_png(60, 50, (10 + i, 20, 30)))) for i in range(2)]
    got, err = post_video(client, {"videos": [{"frames": icons, "fps": 2}], "sample": False})
    assert got == 413 and "need 32,032,768 pixels decoded and resized at once (2 of their frames ICO files, counted at " \
        "--max-pixels, 16,000,000 pixels, each" in err["error"], err
    failed = metric(client, 'glmvit_videos_total{outcome="failed"}')
    got, err = post_video(client, {"videos": [{"frames": [b64(png_header(5000, 4000))] * 2, "fps": 2}]})
    assert got == 422 and "over the server's limit of 16,000,000" in err["error"], err
    assert metric(client, 'glmvit_videos_total{outcome="failed"}') == failed + 1


@pytest.mark.filterwarnings("ignore:Image was not the expected size:UserWarning")  # Pillow's, for these icons
def test_icon_frames_of_a_video_count_alike_at_admission_and_at_decode():
    """Admission counts each ICO frame as --max-pixels and lets the decode refuse a video over
    --max-video-pixels; the decode must count them the same way and refuse it, not decode every frame."""
    from glmvit_cupy import ImageError
    from glmvit_cupy.preprocessing.video_files import FrameFiles

    frames = [ico_holding(flat_png(100, 100, (10 + i, 20, 30))) for i in range(3)]
    files = FrameFiles(frames, max_pixels=10_000, max_total_pixels=25_000)
    with pytest.raises(ImageError, match="its 3 sampled frames have 30,000 pixels, over the limit of 25,000"):
        files.read(lambda n, fps, duration: range(n), 2.0, 1.5, "video 0")
    got, _ = FrameFiles(frames, max_pixels=10_000, max_total_pixels=30_000).read(
        lambda n, fps, duration: range(n), 2.0, 1.5, "video 0")
    assert [f.shape for f in got] == [(100, 100, 3)] * 3


def test_pixels_in_flight_413_never_429_not_now(server):
    """--max-pixels-in-flight 20,000,000: a request whose images need more is refused from their headers (413,
    naming the flag); one that needs more than is free while another's are decoded waits for nothing: 429 at
    once, and is answered once the first is through."""
    _, client = server
    two = [b64(png_header(4000, 2500)), b64(png_header(5000, 2001))]
    got, err = post(client, json.dumps({"images": two}).encode())
    assert got == 413 and err["index"] is None, err
    assert "this request's images need 20,005,000 pixels decoded and resized at once, over the 20,000,000 the server holds " \
           "in flight (--max-pixels-in-flight)" in err["error"]
    big = variants(flat_png(3900, 3900), 2)  # 15.2 M pixels each: one fits, two do not
    first = {}
    t = threading.Thread(target=lambda: first.update(r=post(client, json.dumps(
        {"images": [b64(big[0])], "max_image_tokens": 64}).encode())))
    t.start()
    deadline = time.monotonic() + 10  # the first request admitted: its pixels held until its pass (400 ms' wait)
    while client.health()["pixels_in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.health()["pixels_in_flight"] > 0, "the first request was never admitted"
    t0 = time.monotonic()
    got, err = post(client, json.dumps({"images": [b64(big[1])], "max_image_tokens": 64}).encode())
    assert got == 429 and "(--max-pixels-in-flight) are taken" in err["error"] and "retry later" in err["error"], err
    assert time.monotonic() - t0 < 2.0  # at once: nothing of it was decoded
    t.join()
    assert first["r"][0] == 200
    got, _ = post(client, json.dumps({"images": [b64(big[1])], "max_image_tokens": 64}).encode())
    assert got == 200


@pytest.fixture(scope="module")
def capped():
    """Default limits but images of up to 2^27 pixels, two decoding threads, and at most 1.5 GiB of data
    (RLIMIT_DATA): the server's own ~0.2 GiB, the decode of one such image (0.7 GiB) and room to spare."""
    proc, client = launch("--decode-workers", 2, "--max-pixels", 2**27, data_limit=3 << 29)
    yield proc, client
    stop(proc)


def test_a_bomb_of_many_large_images_is_refused_at_once_beside_a_small_request(capped):
    """150 distinct one-colour 2500 x 2500 PNGs (3.6 MB of JSON, 2.8 GB as canvases): refused from their
    headers (413, over --max-pixels-in-flight) while a one-image request beside it is answered within 2 s;
    the server stays within its memory limit and up."""
    proc, client = capped
    bomb = json.dumps({"images": [b64(v) for v in variants(flat_png(2500, 2500), 150)]}).encode()
    got = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: got.update(bomb=post(client, bomb)))
    t.start()
    time.sleep(0.1)
    t1 = time.monotonic()
    embs, _ = client.encode([png(60, 80, 401)])
    assert time.monotonic() - t1 < 2.0 and embs[0].shape[0] > 0
    t.join(30)
    status, err = got["bomb"]
    assert status == 413 and "--max-pixels-in-flight" in err["error"], err
    assert time.monotonic() - t0 < 10.0
    assert proc.poll() is None and client.health()["status"] == "ok"


def test_large_images_never_hold_every_decoding_thread(capped):
    """Two 11500 x 11500 TIFFs (132 M pixels each, 200 kB, a second or so each to decode; within the pixels in
    flight) on two decoding threads: a one-image request sent meanwhile is decoded on the thread they leave
    free and answered within a second; the TIFFs are answered too."""
    buf = io.BytesIO()
    Image.new("L", (11500, 11500), 77).save(buf, format="TIFF", compression="tiff_deflate")
    tiffs = variants_tiff(buf.getvalue(), 2)
    _, client = capped
    got = {}
    t = threading.Thread(target=lambda: got.update(bomb=post(client, json.dumps(
        {"images": [b64(x) for x in tiffs], "max_image_tokens": 64}).encode())))
    t.start()
    time.sleep(0.3)  # both TIFFs admitted, decoding
    t0 = time.monotonic()
    embs, _ = client.encode([png(64, 90, 402)])
    took = time.monotonic() - t0
    t.join(60)
    assert took < 1.0, f"a one-image request beside the TIFFs took {took:.2f} s"
    assert got["bomb"][0] == 200


def variants_tiff(data: bytes, n: int) -> list[bytes]:
    """n TIFFs of one's pixels with distinct bytes (bytes appended after its last IFD: never read)."""
    return [data + b"%d" % i for i in range(n)]


# -- 2. slow clients, many connections, SIGTERM with a stalled one --------------------------------------------

def test_a_body_framed_both_ways_is_refused_and_the_connection_closed(server):
    """Transfer-Encoding and Content-Length together (h11 takes the chunks; a proxy may take the length, and
    read the rest as another request): 400 naming both, and the connection closes."""
    _, client = server
    before = metric(client, 'glmvit_requests_total{status="400"}')
    body = json.dumps({"images": [b64(png(40, 40, 5))]}).encode()
    reply = raw_request(client, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                                + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n", 10.0)
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), reply
    assert b"both Transfer-Encoding and Content-Length" in reply, reply
    for head in (b"GET /health", b"GET /metrics", b"GET /nowhere", b"PUT /v1/encode"):  # every path: no request
        reply = raw_request(client, head + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n"  # hides behind the body
                                    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
                            10.0)
        assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1") == 1, (head, reply)
        assert b"both Transfer-Encoding and Content-Length" in reply and b"connection: close" in reply.lower(), reply
    assert metric(client, 'glmvit_requests_total{status="400"}') == before + 1  # the encoder's, counted as its own


CHUNKED = b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("rest, declared", [
    (b"fffffffffff\r\n", "17,592,186,044,415"),  # a size line, then nothing: no bytes to wait for
    (b"ffffffffffffffffffff\r\n", "1,208,925,819,614,629,174,706,175"),  # 20 hex digits, h11's most: 2^80 - 1
    (b"20000000;name=value\r\n{\"images\": [", "536,870,912"),  # with a chunk extension, and a start of its bytes
    (b"5\r\n{\"ima\r\n10000000\r\n", "268,435,461"),  # a first chunk within the limit, the second past it
])
def test_a_chunked_body_declaring_more_than_the_limit_is_413_at_once(server, rest, declared):
    """A chunk's size line over --max-body-mib (256 MiB) is refused when it arrives, 413 naming the size and the
    flag, the connection closed: not a wait for bytes that may never come until --body-timeout (408)."""
    _, client = server
    before = metric(client, 'glmvit_requests_total{status="413"}')
    t0 = time.monotonic()
    reply = raw_request(client, CHUNKED + rest, 10.0)
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower(), reply
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert err.startswith(f"the body's chunks (Transfer-Encoding: chunked) declare {declared} bytes, over the 256 "
                          "MiB limit (--max-body-mib)"), err
    assert time.monotonic() - t0 < 5.0
    assert metric(client, 'glmvit_requests_total{status="413"}') == before + 1


def test_what_a_chunked_body_declares_is_counted_without_h11s_internals():
    """The bytes a chunked body's size lines declare (the rest of the chunk under way too: a 413 at once, not a
    wait for them) were read from h11's private ChunkedReader._bytes_in_chunk, and were 0 for an h11 keeping
    that count under another name. They are read from the bytes fed to h11: here its reader is one whose state
    is out of sight, called as h11 calls it."""
    import h11

    from glmvit_cupy.serving.http_server import protocol

    conn = protocol(8, 1.0, None).h11_connection(h11.SERVER)

    def data() -> bytes:
        got = b""
        while (event := conn.next_event()) is not h11.NEED_DATA:
            got += event.data if isinstance(event, h11.Data) else b""
        return got

    class Opaque:  # h11's reader as h11 uses it (called, read_eof), its own attributes not to be had
        __slots__ = ()

        def __call__(self, buf):
            return opaque_reader(buf)

        def read_eof(self):
            return opaque_reader.read_eof()

    conn.receive_data(CHUNKED + b"5\r\nhel")
    assert isinstance(conn.next_event(), h11.Request)
    opaque_reader, conn._reader = conn._reader, Opaque()
    assert data() == b"hel" and conn.declared == 5  # the rest of the chunk under way counts
    conn.receive_data(b"lo\r\n1")  # a size line not ended yet does not
    assert data() == b"lo" and conn.declared == 5
    conn.receive_data(b"0000000;name=value\r\n{\"images\": [")
    assert data() == b'{"images": [' and conn.declared == 5 + 0x10000000
    conn.receive_data(b"x" * (0x10000000 - 12) + b"\r\n0\r\n\r\n")
    assert len(data()) == 0x10000000 - 12 and conn.their_state is h11.DONE and conn.declared == conn.came


@pytest.mark.parametrize("rest, says", [
    (b"-5\r\nhello\r\n0\r\n\r\n", "illegal chunk header"),  # negative
    (b"fffffffffffffffffffff\r\n", "illegal chunk header"),  # 21 hex digits: past h11's most
    (b"0x5\r\nhello\r\n0\r\n\r\n", "illegal chunk header"),
    (b"5\n{\"ima\r\n0\r\n\r\n", "illegal chunk header"),  # a bare LF after the size
    (b"2\r\n{}XX0\r\n\r\n", "malformed chunk footer"),  # no CRLF after the chunk's bytes
    (b"1" * 20000, "Receive buffer too long"),  # a size line without end
])
def test_a_malformed_chunk_is_a_json_400_saying_what_and_counted_so(server, rest, says):
    """A chunk that is not HTTP/1.1 gets a JSON 400 naming what h11 found and how a chunk is framed, the
    connection closed, and the encode counts it as 400 (not as a client gone, 499)."""
    _, client = server
    before = {s: metric(client, f'glmvit_requests_total{{status="{s}"}}') for s in (400, 499)}
    reply = raw_request(client, CHUNKED + rest, 10.0)
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), reply
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert err["error"].startswith(f"the request is not valid HTTP/1.1 ({says}") and err["index"] is None, err
    assert "chunk" not in says or "a chunk is its size in hexadecimal digits and CRLF" in err["error"], err
    time.sleep(0.2)  # the endpoint counts once it sees the connection go
    assert {s: metric(client, f'glmvit_requests_total{{status="{s}"}}') for s in (400, 499)} == \
        {400: before[400] + 1, 499: before[499]}



@pytest.mark.parametrize("coding, says", [
    (b"gzip, chunked", "Only Transfer-Encoding: chunked is supported"),
    (b"chunked, chunked", "Only Transfer-Encoding: chunked is supported"),
])
def test_a_transfer_coding_other_than_chunked_is_told_what_to_send(server, coding, says):
    """A Transfer-Encoding that h11 does not take is told to send chunked alone, not how a chunk is framed (its
    message names "chunked", which once picked the advice for a malformed chunk)."""
    _, client = server
    body = json.dumps({"images": [base64.b64encode(os.urandom(24)).decode()]}).encode()
    head = CHUNKED.replace(b"chunked", coding) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    reply = raw_request(client, head, 10.0)
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), reply
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert err.startswith(f"the request is not valid HTTP/1.1 ({says}") and "a chunk is its size" not in err, err
    assert "send one Transfer-Encoding header saying chunked alone" in err, err

def test_an_absolute_form_target_is_served_as_its_path_and_query(server):
    """GET http://HOST:PORT/health HTTP/1.1 (absolute-form, which a server must accept: RFC 9112 3.2.2) was a 404
    for the path "http://...": it is served as /health, its query kept, the target's host taking the Host
    header's place; an absolute URL with no host or with user info, or of another scheme, is a 400 saying so."""
    _, client = server
    port = int(client.url.rsplit(":", 1)[1])
    for target in (b"http://127.0.0.1:%d/health" % port, b"HTTP://elsewhere.example/health"):
        reply = raw_request(client, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 10.0)
        assert reply.startswith(b"HTTP/1.1 200") and json.loads(reply.split(b"\r\n\r\n", 1)[1])["status"] == "ok", \
            (target, reply)
    body = png(40, 40, 7)
    reply = raw_request(client, b"POST http://127.0.0.1:%d/v1/encode?max_image_tokens=x HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Type: image/png\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                        % (port, len(body)) + body, 10.0)
    assert reply.startswith(b"HTTP/1.1 400") and b"max_image_tokens='x'" in reply, reply  # the query reached it
    for target, says in ((b"http:///health", "an absolute URL with no host"),
                         (b"http://u@127.0.0.1/health", "an absolute URL with user info"),
                         (b"ftp://127.0.0.1/health", "neither a path (/PATH?QUERY) nor an absolute http(s)://")):
        reply = raw_request(client, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n", 10.0)
        assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), (target, reply)
        err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert f"the request target {target!r} is {says}" in err, err
    assert client.health()["status"] == "ok"


def test_a_bad_or_huge_chunk_after_an_early_answer_closes_at_once_without_a_traceback():
    """The rest of a chunked body answered before it was read (/health, a 415, a 404) is read and dropped: a
    malformed chunk there made uvicorn answer a second time, which h11 refused with a traceback in the log
    ("Fatal error on transport"), and a chunk declaring more than --max-body-mib was waited on for all of
    --body-timeout (30 s here). Both now close the connection at once."""
    proc, client = launch("--body-timeout", 30)
    try:
        for head, rest in [(b"GET /health", b"5\r\nhello\r\n-5\r\n"),
                           (b"POST /v1/encode", b"5\r\nhello\r\nzz\r\n"),
                           (b"GET /nowhere", b"ffffffffff\r\n")]:
            s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])), timeout=15)
            t0 = time.monotonic()
            s.sendall(head + b" HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
            time.sleep(0.3)  # answered before the rest comes
            s.sendall(rest)
            reply = b""
            while got := s.recv(65536):
                reply += got
            s.close()
            assert reply.startswith((b"HTTP/1.1 200", b"HTTP/1.1 415", b"HTTP/1.1 404")), reply
            assert reply.count(b"HTTP/1.1") == 1, reply
            assert time.monotonic() - t0 < 10.0, head  # closed, not left for --body-timeout
        assert client.health()["status"] == "ok"
    finally:
        stop(proc)
    out = proc.stdout.read()
    assert "Traceback" not in out and "Fatal error" not in out, out


def answer_then_send(port: int, head: bytes, more: bytes = b"") -> bytes:
    """What the server answers to `head` and `more`, both sent whole (or as far as the server takes them) before
    the answer is read; ConnectionResetError where the server reset the connection instead."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head)
            s.sendall(more)
        reply = b""
        while got := s.recv(65536):
            reply += got
        return reply


def test_an_answer_given_while_the_client_still_sends_reaches_it(server):
    """A header section past h11's limit (16 KiB), or a body whose Content-Length is over --max-body-mib, is
    answered (400, 413) while the client is still sending: the server closed at once, and the client's next
    bytes made the kernel reset the connection (RST), the answer lost. The connection lingers: the answer,
    then the end of the stream, what the client still sends read and dropped."""
    _, client = server
    port = int(client.url.rsplit(":", 1)[1])
    for _ in range(5):
        reply = answer_then_send(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), reply[:300]
        assert b"Receive buffer too long" in reply, reply
        reply = answer_then_send(port, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: 400000000\r\n\r\n", os.urandom(2 << 20))
        assert reply.startswith(b"HTTP/1.1 413") and b"--max-body-mib" in reply, reply[:300]
    assert client.health()["status"] == "ok"


@pytest.mark.parametrize("step", [1, 2, 3, 1000])
def test_a_chunks_size_lines_are_counted_as_h11_reads_them(step):
    """The server's count of what a chunked body's size lines declare (its early 413) reads the two bytes after
    a chunk's data as its CRLF, as h11 does (h11 before 0.16 skips them unread): it searched for a line end
    there, which took the next size line for that CRLF and missed what the line declared."""
    from glmvit_cupy.serving.http_server import _Chunks

    for body, declared in [(b"1\r\nz\r\n10;a=b\r\n" + b"y" * 16 + b"\r\n0\r\n\r\n", 17),
                           (b"1\r\nzXXffffff\r\n", 1 + 0xFFFFFF),  # what h11 < 0.16 reads as a 16 MiB chunk
                           (b"3\r\n\r\n\n\r\n5\r\n", 8)]:  # a chunk's bytes are any bytes
        chunks = _Chunks()
        for i in range(0, len(body), step):
            chunks.feed(body[i:i + step])
        assert chunks.declared == declared, (body, step)


def test_an_app_answering_after_the_400_of_a_lingering_connection_logs_no_traceback():
    """A request h11 took (its handler started: a 404, /health, an encode) whose next bytes are not HTTP (a
    malformed chunk) is answered 400 by the HTTP layer and lingers, its side shut for writing; the handler's
    own answer came after that and raised "Cannot call write() after write_eof()" with a traceback in the log,
    then closed the connection at once. What is written to a lingering connection is dropped."""
    proc, client = launch()
    try:
        port = int(client.url.rsplit(":", 1)[1])
        for head in (b"GET /nowhere", b"GET /health", b"POST /v1/encode", b"GET /metrics"):
            reply = answer_then_send(port, head + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                           b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n")
            assert reply.startswith(b"HTTP/1.1 400") and b"illegal chunk header" in reply, (head, reply)
            assert reply.count(b"HTTP/1.1 4") == 1, reply  # the one answer (a 404 after it: two)
        time.sleep(0.5)  # the handlers' answers, after the 400s
        assert client.health()["status"] == "ok"
    finally:
        stop(proc)
    out = proc.stdout.read()
    assert "Traceback" not in out and "write_eof" not in out, out


@pytest.mark.parametrize("pace", ["flood", "trickle"])
def test_a_connection_lingering_after_its_answer_is_closed_within_its_bounds(server, pace):
    """A client that goes on sending after an early answer (here a 400 for headers past the limit) without
    ever closing is read and dropped for at most LINGER_S seconds and LINGER_BYTES bytes, then closed."""
    from glmvit_cupy.serving.http_server import LINGER_BYTES, LINGER_S

    _, client = server
    with socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (64 << 10))
        t0 = time.monotonic()
        reply = b""
        while got := s.recv(65536):  # the answer, then the end of the stream at once: not left for the bound
            reply += got
        assert reply.startswith(b"HTTP/1.1 400") and time.monotonic() - t0 < 1.0, reply
        sent = 0
        with pytest.raises(OSError):
            while time.monotonic() - t0 < 30:
                s.sendall(bytes(1 << 20) if pace == "flood" else b"x")
                sent += 1 << 20 if pace == "flood" else 1
                if pace == "trickle":
                    time.sleep(0.1)
        assert time.monotonic() - t0 < LINGER_S + 1.5
        assert sent <= LINGER_BYTES + (32 << 20), sent  # and what the sockets' buffers held
    assert client.health()["status"] == "ok"


def test_headers_that_do_not_arrive_in_time_get_408(server):
    _, client = server
    t0 = time.monotonic()
    reply = raw_request(client, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Ty", 5.0)
    assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout" in reply, reply
    assert time.monotonic() - t0 < 4.0


def test_a_kept_connection_answered_before_its_body_was_read_serves_the_next_request(server):
    """A request refused before its body is read (a bad query on an image file) leaves the rest of its body to be
    read and dropped; the connection then waits, past --header-timeout (1 s), for the next request, which gets
    its own answer (not a 408 left there for it), and the Client's next call on it too."""
    import http.client

    _, client = server
    port = int(client.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for _ in range(2):
            conn.request("POST", "/v1/encode?max_image_tokens=x", body=os.urandom(300_000),
                         headers={"Content-Type": "image/png"})
            r = conn.getresponse()
            assert r.status == 400 and b"whole number of tokens" in r.read()
            time.sleep(1.5)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    finally:
        conn.close()
    with pytest.raises(ServerError, match="HTTP 400: max_image_tokens='x'"):
        client._send("POST", "/v1/encode?max_image_tokens=x", os.urandom(300_000), "image/png", [b""])
    time.sleep(1.5)
    assert client.health()["status"] == "ok"


def test_the_rest_of_an_answered_body_is_dropped_within_the_body_limits_then_the_connection_closes(server):
    """A request answered before its body was read (/health with a body) held its connection as long as the
    client sent a byte every few seconds, and read and dropped any amount: the rest may take --body-timeout
    (1 s here) and --max-body-mib, as a body may, and then the connection closes."""
    _, client = server
    port = int(client.url.rsplit(":", 1)[1])

    def answered(s):
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")

    with socket.create_connection(("127.0.0.1", port)) as s:  # a byte every 0.2 s
        answered(s)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            while time.monotonic() - t0 < 10:
                s.sendall(b"x")
                time.sleep(0.2)
                s.settimeout(0.01)
                with contextlib.suppress(socket.timeout):
                    if s.recv(1) == b"":
                        raise ConnectionResetError("closed")
        assert time.monotonic() - t0 < 3.0
    with socket.create_connection(("127.0.0.1", port)) as s:  # as fast as it goes
        answered(s)
        sent = 0
        with pytest.raises(OSError):
            while sent < 4 << 30:
                s.sendall(bytes(1 << 20))
                sent += 1 << 20
        assert sent <= (256 << 20) + (32 << 20), sent  # --max-body-mib (256 by default) and what buffers held
    assert client.health()["status"] == "ok"


def test_a_refused_request_lets_its_files_go_at_once():
    """Ten requests of four 2.9-megapixel noise PNGs (37 MB of files), each refused 413 for the pixels in flight:
    the server lets each one's bodies go with its answer, not at the garbage collector's next run (which
    left it ~270 MB larger after ten)."""
    proc, client = launch("--cache-mib", 0, "--max-pixels", 10_000_000, "--max-pixels-in-flight", 10_000_000,
                          "--max-body-mib", 64, "--max-reply-mib", 64, "--max-bodies-in-flight-mib", 64)

    def rss_mib():
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024

    try:
        rng = np.random.default_rng(5)
        images = []
        for _ in range(4):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (1700, 1700, 3), np.uint8)).save(buf, "PNG", compress_level=1)
            images.append(buf.getvalue())
        with pytest.raises(ServerError, match="HTTP 413"):
            client.encode(images)
        before = rss_mib()
        for i in range(10):
            with pytest.raises(ServerError, match="HTTP 413"):
                client.encode(images, min_image_tokens=17 + i)
        assert rss_mib() - before < 100, (before, rss_mib())
    finally:
        stop(proc)


def test_a_body_that_does_not_arrive_in_time_gets_408(server):
    _, client = server
    reply = raw_request(client, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 1000\r\n\r\n{\"images\": [", 5.0)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert err == {"error": "the body did not arrive within 1 s (--body-timeout): 12 bytes of the 1,000 declared "
                            "came; send it at once", "index": None}


def test_connections_are_capped_and_half_open_ones_closed(server):
    """60 connections that send half their headers, against --max-connections 16: the server holds at most 16
    (the others are answered 503 and closed at once), closes those after --header-timeout, and answers a
    normal request while the 60 sockets are still open on the client's side."""
    proc, client = server
    port = int(client.url.rsplit(":", 1)[1])
    before = len(os.listdir(f"/proc/{proc.pid}/fd"))
    socks = []
    try:
        for _ in range(60):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        time.sleep(0.3)
        held = len(os.listdir(f"/proc/{proc.pid}/fd")) - before
        assert held <= 16, f"the server holds {held} more descriptors with 60 half-open connections"
        refused = 0
        for s in socks[16:]:
            s.settimeout(2)
            reply = s.recv(65536)
            refused += reply.startswith(b"HTTP/1.1 503") and b"--max-connections" in reply
        assert refused >= 40
        time.sleep(1.5)  # past --header-timeout: the held ones are closed
        embs, _ = client.encode([png(50, 70, 403)])
        assert embs[0].shape[0] > 0
    finally:
        for s in socks:
            s.close()


def terminated(proc, within: float, beside: str) -> tuple[int, str, float]:
    """SIGTERM to the server: (its exit status, its output, seconds until it ended); an AssertionError saying
    what it was left `beside` if it runs past `within` seconds."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"SIGTERM left the server running beside {beside}") from None
    return code, proc.stdout.read(), time.monotonic() - t0


def test_sigterm_ends_the_process_in_bounded_time_beside_a_stalled_body():
    """A client that sends half a body and stalls (--body-timeout 60): SIGTERM still ends the server within
    --drain-timeout (1 s) and a few seconds more, saying why."""
    proc, client = launch("--drain-timeout", 1)
    s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
    try:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"images\": [")
        time.sleep(0.3)
        code, out, took = terminated(proc, 10, "a stalled client")
        assert code == 0 and took < 10
        assert "1 request in flight" in out and "still in flight (or replies still being sent) after 1 s (--drain-timeout)" in out, out
        assert "Traceback" not in out and "Exception in ASGI application" not in out, out  # one line, no trace
        s.settimeout(5)
        answer = s.recv(65536)
        assert answer == b"" or (b" 503 " in answer and b"--drain-timeout" in answer), answer
    finally:
        s.close()
        stop(proc)


def test_sigterm_ends_the_process_beside_a_decode_still_running():
    """A decode of 30 s for a client that gave up: the drain ends after --drain-timeout, and the process with it,
    not when the decoding thread's job ends (it said "stopped (exit 0)" and lived on)."""
    prelude = ("import time; from glmvit_cupy.preprocessing import decode; slow = decode._decode_named; "
               "decode._decode_named = lambda *a, **k: (time.sleep(30), slow(*a, **k))[1]")
    proc, client = launch("--drain-timeout", 1, prelude=prelude)
    try:
        with pytest.raises((OSError, ServerError)):  # the client gives up; its decode goes on
            Client(client.url, timeout=0.5).encode([png(64, 64, 7)])
        code, out, took = terminated(proc, 10, "a decode still running")
        assert code == 0 and took < 6, out
        assert "not waiting for the work still running (threads glmvit-decode" in out, out
    finally:
        stop(proc)


# -- 3. content in flight encoded once; work for clients gone dropped -------------------------------------------

def test_concurrent_requests_for_one_new_image_encode_it_once(slow_server):
    _, client = slow_server  # a 0.5 s pass: all eight arrive while it runs
    data = png(90, 120, 404)
    encoded, passes = metric(client, 'glmvit_images_total{outcome="encoded"}'), metric(client,
                                                                                       "glmvit_forward_passes_total")
    shared = metric(client, 'glmvit_images_total{outcome="shared"}')
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.update({i: client.encode([data])})) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert metric(client, 'glmvit_images_total{outcome="encoded"}') == encoded + 1
    assert metric(client, "glmvit_forward_passes_total") == passes + 1
    first = got[0][0][0]
    assert all(np.array_equal(g[0][0].view(np.uint16), first.view(np.uint16)) for g in got.values())
    assert sorted(g[1][0]["cached"] for g in got.values()) == [False] + [True] * 7  # one encode, 7 served from it
    assert metric(client, 'glmvit_images_total{outcome="shared"}') == shared + 7


@pytest.fixture(scope="module")
def slow_server():
    """Passes that take 0.5 s (slow()), a queue of 4."""
    proc, client = launch("--max-queue", 4, "--cache-mib", 0, prelude=slow(0.5))
    yield proc, client
    stop(proc)


def test_queue_full_is_429(slow_server):
    """4 + 2 images against --max-queue 4: the first request's first image is in its pass, 3 wait; the second
    request (3 + 2 > 4) is refused whole with 429 and the first is answered. 5 images never fit: 413."""
    _, client = slow_server
    a = [b64(png(64, 64 + 8 * i, 50 + i)) for i in range(4)]
    b = [b64(png(72, 64, 60 + i)) for i in range(2)]
    got = {}
    ta = threading.Thread(target=lambda: got.update(a=post(client, json.dumps({"images": a}).encode())))
    ta.start()
    time.sleep(0.25)
    got["b"] = post(client, json.dumps({"images": b}).encode())
    ta.join()
    assert got["a"][0] == 200 and got["b"][0] == 429, got
    assert "--max-queue" in got["b"][1]["error"] and got["b"][1]["index"] is None
    five = [b64(png(80, 64 + 8 * i, 70 + i)) for i in range(5)]
    status, err = post(client, json.dumps({"images": five}).encode())  # 5 images: never fit a queue of 4
    assert status == 413 and "send at most 4 a request" in err["error"] and "--max-queue" in err["error"]


@pytest.mark.parametrize("image", ["new", "the long request's last"])
def test_a_one_image_request_does_not_wait_for_all_of_a_long_one(slow_server, image):
    """Requests take turns: a one-image request sent while a four-image request's first 0.5 s pass runs is
    answered a pass before the long request ends (FIFO would answer it after). Its image may be the long
    request's last: it shares that encode, queued as a request of its own (Batcher.expedite), not in the
    long request's turns."""
    _, client = slow_server
    long = [png(64, 64 + 8 * i, (80 if image == "new" else 95) + i) for i in range(4)]
    done = {}

    def send_long():
        client.encode(long)
        done["long"] = time.perf_counter()

    t = threading.Thread(target=send_long)
    t.start()
    time.sleep(0.2)
    embs, meta = client.encode([png(72, 72, 90) if image == "new" else long[3]])
    one = time.perf_counter()
    t.join(30)
    assert meta[0]["cached"] is (image != "new")
    assert done["long"] - one > 0.25, done["long"] - one  # a 0.5 s pass apart, not answered together


def test_work_queued_only_for_a_client_gone_is_dropped_before_its_pass(slow_server):
    """A request whose client disconnects while its image waits in the queue (behind another request's
    0.5 s pass): the image leaves the queue, no pass runs for it, and it is counted as dropped."""
    _, client = slow_server
    passes = metric(client, "glmvit_forward_passes_total")
    dropped = metric(client, 'glmvit_images_total{outcome="dropped"}')
    ahead = threading.Thread(target=lambda: client.encode([png(64, 64, 404)]))
    ahead.start()
    time.sleep(0.1)  # its pass has started
    body = json.dumps({"images": [b64(png(70, 100, 405))]}).encode()
    s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.15)  # decoded and queued behind it
    s.close()
    ahead.join(30)
    time.sleep(0.8)
    assert metric(client, "glmvit_forward_passes_total") == passes + 1
    assert metric(client, 'glmvit_images_total{outcome="dropped"}') == dropped + 1
    assert client.health()["queue_depth"] == 0


def padded(images: list[bytes], size: int) -> bytes:
    """An image request's body of `size` bytes: JSON whitespace after the images."""
    body = json.dumps({"images": [b64(d) for d in images]}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def chunked_post(client, body: bytes, piece: int = 64 << 10) -> tuple[int, dict]:
    """POST body without a Content-Length (chunked, as a streaming client sends it): (status, JSON answer)."""
    s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])), timeout=30)
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(0, len(body), piece):
        s.sendall(b"%x\r\n" % len(body[i:i + piece]) + body[i:i + piece] + b"\r\n")
    s.sendall(b"0\r\n\r\n")
    # The connection stays open until the answer is in (a half-close would read as a disconnect): the answer
    # is read to its Content-Length.
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += s.recv(65536) or b"\r\n\r\n"
    head, _, rest = reply.partition(b"\r\n\r\n")
    length = next(int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:"))
    while len(rest) < length and (chunk := s.recv(65536)):
        rest += chunk
    s.close()
    return int(head.split()[1]), json.loads(rest)


def test_bodies_in_flight_are_bounded_and_a_body_over_the_room_is_read_then_429():
    """--max-bodies-in-flight-mib 1.5: a 0.9 MiB request in its 1 s pass holds 0.9 MiB; another 0.9 MiB body,
    sent whole before its client reads (urllib) or chunked without a length, is read and dropped, then
    answered 429 naming the flag (not a reset connection); once the first is answered, the same body is
    encoded (every refusal gave its bytes back), and so it is beside four connections whose headers
    declared 1 MiB bodies that never came."""
    proc, client = launch("--max-body-mib", 1, "--max-reply-mib", 1, "--max-bodies-in-flight-mib", 1.5, "--cache-mib", 0,
                          prelude=slow(1.0))
    try:
        first = padded([png(64, 64, 11)], 900 << 10)
        second = padded([png(72, 64, 12)], 900 << 10)
        got = {}
        t = threading.Thread(target=lambda: got.update(first=post(client, first)))
        t.start()
        time.sleep(0.4)
        for status, err in (post(client, second), chunked_post(client, second)):
            assert status == 429, err
            assert "the request bodies the server holds" in err["error"], err
            assert "--max-bodies-in-flight-mib" in err["error"], err
        t.join()
        assert got["first"][0] == 200
        # Headers that declare a body hold nothing until its bytes come: four idle ones, each declaring the
        # most a body may be, leave a whole body's room.
        idle = [socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1]))) for _ in range(4)]
        for s in idle:
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1048576\r\n\r\n")
        time.sleep(0.2)
        assert post(client, second)[0] == 200
        for s in idle:
            s.close()
        # Over --max-body-mib by its Content-Length: 413 at once, and the connection closes (the body unread)
        reply = raw_request(client, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: 1433600\r\n\r\n", 5.0)
        assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower(), reply
    finally:
        stop(proc)


def test_many_large_bodies_at_once_are_parsed_in_turn_within_memory():
    """Eight 30 MiB bodies at once (4 files of 7.5 MiB each, not images) under a 0.75 GiB data limit: each
    body is parsed on the one parsing thread in turn, so one at a time is expanded into strings and bytes
    (about 3x its size; eight at once took 4.7 GiB for eight 240 MiB bodies). Every one is answered 422,
    and the server goes on serving."""
    proc, client = launch(data_limit=3 << 28)
    try:
        files = [os.urandom(15 << 19) for _ in range(4)]
        body = json.dumps({"images": [b64(f) for f in files]}).encode()
        got = []
        threads = [threading.Thread(target=lambda: got.append(post(client, body))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(g[0] for g in got) == [422] * 8, [(g[0], g[1]) for g in got if g[0] != 422]
        assert post(client, json.dumps({"images": [b64(png(64, 64, 3))]}).encode())[0] == 200
    finally:
        stop(proc)


def test_a_shared_encode_outlives_the_request_that_started_it(slow_server):
    """Two requests for one new image: the first one's client goes away while the image is encoded (a 0.5 s
    pass); the second, waiting on the same encode, still gets it, from the one pass that runs."""
    _, client = slow_server
    data = png(80, 110, 412)
    body = json.dumps({"images": [b64(data)]}).encode()
    passes = metric(client, "glmvit_forward_passes_total")
    dropped = metric(client, 'glmvit_images_total{outcome="dropped"}')
    s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.1)
    got = {}
    t = threading.Thread(target=lambda: got.update(r=client.encode([data])))
    t.start()
    time.sleep(0.1)
    s.close()
    t.join(30)
    embs, meta = got["r"]
    assert meta[0]["cached"] is True and embs[0].shape[0] > 0  # served from the encode the first one started
    assert metric(client, "glmvit_forward_passes_total") == passes + 1
    assert metric(client, 'glmvit_images_total{outcome="dropped"}') == dropped


def test_a_request_refused_hands_its_images_to_those_waiting_for_them(server):
    """A request whose second image is broken is refused (422) after a second request joined the encode of its
    first image: the second request encodes that image itself and is answered."""
    _, client = server
    big = variants(flat_png(3000, 3000, (10, 200, 30)), 1)[0]  # 9 M pixels: a few hundred ms to decode
    got = {}
    t = threading.Thread(target=lambda: got.update(a=post(client, json.dumps(
        {"images": [b64(big), b64(b"GIF89a broken")], "max_image_tokens": 64}).encode())))
    t.start()
    time.sleep(0.05)
    b = post(client, json.dumps({"images": [b64(big)], "max_image_tokens": 64}).encode())
    t.join(30)
    assert got["a"][0] == 422 and got["a"][1]["index"] == 1
    assert b[0] == 200


# -- 4. SIGTERM drains; a model that fails to load ends the process -------------------------------------------

@pytest.mark.parametrize("sig,workers", [("SIGTERM", 1), ("SIGHUP", 1), ("SIGTERM", 2)])
def test_sigterm_drains_with_503_then_exits_saying_so(sig, workers):
    """While a request is in flight after SIGTERM (or SIGHUP: a closed terminal, a supervisor's hang-up),
    /health and a new request on a new connection get 503 (not a refused connection); the request in flight is
    answered; the process logs the drain and its exit. With HTTP workers alike: the worker holding the
    request drains, the engine process (whose passes the prelude slows) stops after them."""
    proc, client = launch("--workers", workers, prelude=slow(1.5))
    try:
        done = {}
        t = threading.Thread(target=lambda: done.update(r=client.encode([png(64, 64, 406)])))
        t.start()
        time.sleep(0.4)  # in its pass
        proc.send_signal(getattr(signal, sig))
        deadline = time.monotonic() + 0.9  # the request is still in its pass meanwhile (1.5 s)
        while True:  # the signal is handled on the server's main thread, soon but not at once on a busy machine
            try:
                client.health()
            except ServerError as e:
                assert e.status == 503 and "shutting down" in e.error, e
                break
            assert time.monotonic() < deadline, "/health still answers 200 0.9 s after the signal"
            time.sleep(0.05)
        got, err = post(client, json.dumps({"images": [b64(png(40, 40, 407))]}).encode())
        assert got == 503 and "shutting down" in err["error"]
        t.join(30)
        assert done["r"][0][0].shape[0] == 16
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        drained = f"{sig}: draining, 1 request in flight" if workers == 1 else f"{sig}: draining the 2 HTTP workers"
        assert drained in out and "stopped (exit 0)" in out, out
    finally:
        stop(proc)


def test_jpeg_2000_is_decoded_in_another_process_and_the_server_keeps_answering(server):
    """Pillow's JPEG 2000 decoder holds the GIL for the whole decode (0.4 s for 16 MP here; an 81 MP file
    froze the server 12 s): two 3800x2600 JPEG 2000 files are decoded in a process of their own while
    /health answers within 0.45 s throughout (decoded on two threads of one process they hold its lock for
    0.94 s here), and their embeddings equal those of the same pixels as PNG."""
    from PIL import features

    if not features.check("jpg_2000"):
        pytest.skip("this Pillow has no JPEG 2000 codec (OpenJPEG)")
    _, client = server
    jp2, pngs = [], []
    for i in range(2):
        pixels = np.zeros((2600, 3800, 3), np.uint8)
        pixels[:, :, i] = 200
        pixels[:1300] //= 3
        for kind, out in (("JPEG2000", jp2), ("PNG", pngs)):  # Pillow's JPEG 2000 is lossless by default
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, kind)
            out.append(buf.getvalue())
    worst, done = [0.0], threading.Event()

    def probe():
        while not done.is_set():
            t = time.perf_counter()
            client.health()
            worst[0] = max(worst[0], time.perf_counter() - t)
            time.sleep(0.02)

    t = threading.Thread(target=probe)
    t.start()
    try:
        embs, meta = client.encode(jp2, max_image_tokens=256)
    finally:
        done.set()
        t.join()
    assert worst[0] < 0.45, worst  # a loaded 2-core runner has taken 0.31 s
    want, _ = client.encode(pngs, max_image_tokens=256)
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(embs, want))


def test_corrupt_exif_in_a_clients_image_never_reaches_the_log():
    """Pillow warns about a JPEG's corrupt EXIF on every decode of it; a client sending such images would fill
    the server's log with those lines. The image is encoded and nothing is logged."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(buf, format="JPEG",
                                                          exif=b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x05\x00")
    proc, client = launch("--cache-mib", 0)
    try:
        for _ in range(3):
            assert post(client, json.dumps({"images": [b64(buf.getvalue())]}).encode())[0] == 200
    finally:
        stop(proc)
    out = proc.stdout.read()
    assert "Corrupt EXIF" not in out and "Warning" not in out, out


def reply_reader(client, images: int, rcvbuf: int = 4096):
    """A socket that has sent a request (Connection: close) for `images` repeats of one image at 1,024 tokens
    (512 KiB of embeddings each, golden tower), its receive buffer small so the server's fills."""
    body = json.dumps({"images": [b64(png(1, 1, 431))] * images, "min_image_tokens": 1024,
                       "max_image_tokens": 1024}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def read_all(s, pause: float = 0.0, size: int = 64 << 10) -> int:
    got = 0
    s.settimeout(10)
    try:
        while chunk := s.recv(size):
            got += len(chunk)
            time.sleep(pause)
    except ConnectionResetError:
        pass
    s.close()
    return got


def test_a_reply_left_unread_is_cut_off_and_let_go():
    """A client that asks for a 16 MiB reply and never reads it: once nothing of it has been sent for
    --reply-timeout 1, the server aborts the connection (logging it) and lets the reply go, also after its
    own close (Connection: close), which waits for the buffer to drain. Its other clients are served."""
    proc, client = launch("--reply-timeout", 1, "--cache-mib", 0)
    try:
        s = reply_reader(client, 32)
        s.settimeout(60)
        assert s.recv(64).startswith(b"HTTP/1.1 200")  # the reply is made (on a busy host: seconds), fills the buffers
        time.sleep(4)  # and stays unread past twice the timeout
        assert client.encode([png(40, 40, 432)])[0][0].shape[0] == 16
        assert read_all(s) < 16 << 20
    finally:
        stop(proc)
    out = proc.stdout.read()
    assert "left its reply unread for 1 s (--reply-timeout): connection closed" in out, out


def test_replies_being_sent_are_held_within_the_bodies_in_flight():
    """A small request makes a large reply (an image repeated: 8 MiB from 40 KB); replies left to slow
    readers held 2 GB server-wide. --max-bodies-in-flight-mib 12: a reply being sent holds its 8 MiB until
    the client has it, a second such reply meanwhile is 429 naming the flag, and once the first is read
    the second is answered."""
    proc, client = launch("--max-bodies-in-flight-mib", 12, "--max-reply-mib", 10, "--max-body-mib", 1,
                          "--cache-mib", 64)
    try:
        first = reply_reader(client, 16)
        first.settimeout(30)
        assert first.recv(64).startswith(b"HTTP/1.1 200")  # its reply made; the rest stuck in the buffers
        time.sleep(0.5)
        body = json.dumps({"images": [b64(png(1, 1, 431))] * 16, "min_image_tokens": 1024,
                           "max_image_tokens": 1024}).encode()
        status, err = post(client, body)
        assert status == 429 and "request and reply bodies" in err["error"], err
        assert "--max-bodies-in-flight-mib" in err["error"], err
        assert post(client, body)[0] == 429  # still: no matter how long it waits, not while unread
        assert read_all(first) > (8 << 20) - 64
        time.sleep(0.2)
        assert post(client, body)[0] == 200
    finally:
        stop(proc)


def test_a_pipelined_reply_is_held_within_the_bodies_in_flight_too():
    """A request pipelined behind another on one connection is read only once the first is answered, outside
    the socket's data callback: its large reply holds its 8 MiB until the client has it as the first request's
    would (the protocol puts the transport in each request's scope), so another such request meanwhile is
    429, and answered once the reply is read."""
    proc, client = launch("--max-bodies-in-flight-mib", 12, "--max-reply-mib", 10, "--max-body-mib", 1,
                          "--cache-mib", 64)
    try:
        small = json.dumps({"images": [b64(png(9, 7, int(np.random.default_rng().integers(1 << 30))))]}).encode()
        big = json.dumps({"images": [b64(png(1, 1, 431))] * 16, "min_image_tokens": 1024,
                          "max_image_tokens": 1024}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
        s.sendall(b"".join(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + close +
                           b"Content-Length: %d\r\n\r\n" % len(body) + body
                           for body, close in ((small, b""), (big, b"Connection: close\r\n"))))
        s.settimeout(30)
        got = b""
        while got.count(b"HTTP/1.1 200") < 2:  # the first answer, then the start of the pipelined one's
            got += s.recv(256)
        time.sleep(0.5)  # the rest of its reply stuck in the buffers
        status, err = post(client, big)
        assert status == 429 and "--max-bodies-in-flight-mib" in err["error"], err
        assert read_all(s) > (8 << 20) - 64
        time.sleep(0.2)
        assert post(client, big)[0] == 200
    finally:
        stop(proc)


def test_a_slow_steady_reader_keeps_its_connection():
    """A client reading a 3 MiB reply 16 KiB every 20 ms (about 4 s in all, against --reply-timeout 1) is
    making progress: it gets the whole reply."""
    proc, client = launch("--reply-timeout", 1, "--cache-mib", 0)
    try:
        s = reply_reader(client, 6, rcvbuf=16 << 10)
        time.sleep(1)  # the reply is made and waits in the buffers
        assert read_all(s, pause=0.02, size=16 << 10) > 3 << 20
    finally:
        stop(proc)
    assert "--reply-timeout" not in proc.stdout.read()


def test_a_reply_left_under_the_high_water_mark_is_watched_too():
    """A reply whose last bytes stay in the transport's buffer, under its high-water mark (the kernel's send
    queue full of the rest), never pauses writing: the protocol watches it once the reply ends all the same,
    and aborts the connection when its client took nothing for --reply-timeout; an empty buffer is not
    watched."""
    import asyncio

    from glmvit_cupy.serving.http_server import _Counted, protocol

    class Stuck:  # a client that reads nothing: 100 bytes stay unsent until the connection is aborted
        aborted = False

        def get_write_buffer_size(self):
            return 0 if self.aborted else self.left

        def get_extra_info(self, name):
            return None

        def abort(self):
            self.aborted = True

    loop = asyncio.new_event_loop()
    try:
        for left in (100, 0):
            p = object.__new__(protocol(8, 5.0, None, reply_timeout=0.05))
            stuck = Stuck()
            stuck.left = left
            p.loop, p.transport = loop, _Counted(stuck)
            p.transport.written = 1000
            p._watch_unsent()
            assert (p.reply_timer is not None) == (left > 0)
            loop.run_until_complete(asyncio.sleep(0.3))
            assert stuck.aborted == (left > 0)
    finally:
        loop.close()


def test_sigterm_lets_a_reply_being_read_finish():
    """SIGTERM while a client reads a 16 MiB reply at ~3 MB/s (64 KiB every 20 ms, ~5 s): the drain waits
    until the reply has left the server's buffers (more than the kernel's hold), so the client gets all of
    it, not what was sent before uvicorn's 2 s of graceful shutdown ran out; then the process exits 0."""
    proc, client = launch("--cache-mib", 0)
    try:
        s = reply_reader(client, 32, rcvbuf=64 << 10)
        time.sleep(1.5)  # the reply is made and waits in the buffers
        got = {}
        t = threading.Thread(target=lambda: got.update(n=read_all(s, pause=0.02)))
        t.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert got["n"] > 16 << 20 and proc.wait(30) == 0
    finally:
        stop(proc)


def test_a_second_sigterm_after_the_drain_stops_without_waiting_for_the_pass():
    """The drain gave up (--drain-timeout 0.3) on a request whose pass computes for 6 s, uvicorn's 2 s for its
    task ran out, and the shutdown waits for that pass; a second SIGTERM then stops the process at once, not
    when the pass ends, with exit status 0."""
    proc, client = launch("--drain-timeout", 0.3, prelude=busy(6.0))
    try:
        t = threading.Thread(target=lambda: post(client, json.dumps({"images": [b64(png(64, 64, 433))]}).encode()),
                             daemon=True)
        t.start()
        time.sleep(0.3)  # in its pass
        proc.send_signal(signal.SIGTERM)
        time.sleep(3.2)  # the drain and uvicorn's wait have given up; the shutdown waits for the pass
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        t0 = time.perf_counter()
        proc.wait(30)
        assert time.perf_counter() - t0 < 1.5  # the pass had ~2.5 s left
        out = proc.stdout.read()
        # The pass still computes: the process exits without the interpreter's shutdown under it (which can
        # crash it, exit 139), saying so.
        assert proc.returncode == 0, out
        assert "finishing the forward passes running and queued" in out, out
        assert "stopped (exit 0), not waiting for the work still running" in out and "glmvit-engine-0" in out, out
        assert "ERROR" not in out, out  # uvicorn's cancel line: the drain's own has said it
    finally:
        stop(proc)


def test_a_second_sigterm_stops_at_once_without_a_traceback():
    """SIGTERM, then SIGTERM again while a request's 1.5 s pass runs: the process stops at once, as
    documented, logging why, with no traceback (the lifespan's wait for the passes was cancelled)."""
    proc, client = launch(prelude=slow(1.5))
    try:
        t = threading.Thread(target=lambda: post(client, json.dumps({"images": [b64(png(64, 64, 430))]}).encode()),
                             daemon=True)
        t.start()
        time.sleep(0.4)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        out = proc.stdout.read()
        assert "SIGTERM while stopping: stopping now" in out and "Traceback" not in out, out
    finally:
        stop(proc)


def test_a_client_that_connects_once_the_address_is_printed_is_answered():
    """The start line names the address before uvicorn runs (the app is built, the server made): a client
    that connected then was refused (ECONNREFUSED: the socket was bound but not listening), so a script
    that starts the server and calls it at once failed. The socket listens from the start line on: the
    connection waits for uvicorn and is answered."""
    prelude = ("import time, glmvit_cupy.serving.app as m; f = m.create_app; "
               "m.create_app = lambda *a, **k: (time.sleep(2), f(*a, **k))[1]")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    code = f"import sys; {prelude}; from glmvit_cupy.serving.main import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "--checkpoint", TOWER, "--cpu", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = Client(f"http://127.0.0.1:{served_port(proc, 20)}", timeout=60)
        try:  # at once, while create_app still sleeps
            assert client.health()["status"] == "ok"
        except ServerError as e:  # answered: still loading
            assert e.status == 503 and "still loading" in str(e), e
    finally:
        stop(proc)


def test_ctrl_c_while_starting_is_one_line_and_status_130():
    """Ctrl-C while the command imports, checks the checkpoint or binds (before the server's own handlers):
    one line and exit status 130, no traceback."""
    prelude = ("import time, glmvit_cupy.checkpoint.bind as b; f = b.bind_tower; "
               "b.bind_tower = lambda *a, **k: (print('binding', flush=True), time.sleep(30), f(*a, **k))[2]")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    code = f"import sys; {prelude}; from glmvit_cupy.serving.main import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "--checkpoint", TOWER, "--cpu", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "binding"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
        out = proc.stdout.read()
        assert "glmvit-serve: interrupted while starting (exit 130)" in out and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_model_that_fails_to_load_is_logged_and_the_process_exits_1(tmp_path, workers):
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import random_tower, write_checkpoint

    geo = dataclasses.replace(cases.GEOMETRY, depth=1)
    tensors = random_tower(geo, 7)
    name = "blocks.0.attn.qkv.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = np.nan  # a damaged download
    ckpt = write_checkpoint(tmp_path / "nan", geo, tensors=tensors)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "glmvit_cupy.serving.main", "--checkpoint", ckpt, "--cpu",
                             "--port", "0", "--workers", str(workers)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"a model that cannot load left the server up: {proc.stdout.read()}")
    out = proc.stdout.read()
    assert code == 1 and "the model failed to load: CheckpointError" in out and "NaN" in out, out
    assert out.count("failed to load") == 1, out  # said once, by the server, not again by each worker


# -- 5. what the metrics, the cache and the messages say ---------------------------------------------------------

def test_an_image_sent_five_times_is_one_encode_and_four_served_from_it(server):
    from glmvit_cupy.client import _bf16_tensors as load, _metadata

    _, client = server
    encoded = metric(client, 'glmvit_images_total{outcome="encoded"}')
    shared = metric(client, 'glmvit_images_total{outcome="shared"}')
    got, raw = post(client, json.dumps({"images": [b64(png(72, 56, 408))] * 5}).encode())
    assert got == 200
    meta = json.loads(_metadata(raw)["images"])
    assert [m["cached"] for m in meta] == [False, True, True, True, True]
    assert metric(client, 'glmvit_images_total{outcome="encoded"}') == encoded + 1
    assert metric(client, 'glmvit_images_total{outcome="shared"}') == shared + 4
    tensors = load(raw)
    assert all(np.array_equal(tensors[str(i)].view(np.uint16), tensors["0"].view(np.uint16)) for i in range(5))


def test_a_reply_over_the_limit_is_413_before_it_is_made(server):
    """A 1x1 PNG sent three times at 1,024 tokens: one encode, but a reply of 1.5 MiB (three 512 KiB
    embeddings) against --max-reply-mib 1: 413 naming the flag, and nothing of the reply is built."""
    _, client = server
    tiny = b64(png(1, 1, 420))
    encoded = metric(client, 'glmvit_images_total{outcome="encoded"}')
    status, err = post(client, json.dumps({"images": [tiny] * 3, "min_image_tokens": 1024,
                                           "max_image_tokens": 1024}).encode())
    assert status == 413 and "1.5 MiB (1,572,864 bytes) of embeddings for 3 images" in err["error"] and "--max-reply-mib" in err["error"]
    assert metric(client, 'glmvit_images_total{outcome="encoded"}') == encoded + 1
    status, _ = post(client, json.dumps({"images": [tiny], "min_image_tokens": 1024, "max_image_tokens": 1024}).encode())
    assert status == 200  # one of them fits


def test_base64_decoded_piece_by_piece_equals_decoding_at_once(rng):
    """requests.b64decode works a MiB of text at a time (so the event loop's thread gets the interpreter
    between pieces): the same bytes as base64's one call for texts across piece boundaries in every form
    clients send (URL-safe text without its padding too), and an error for a bad character (named, with
    where it is), length or padding wherever it is (padding that ends a piece too)."""
    import binascii

    from glmvit_cupy.serving import requests

    piece = requests._PIECE
    for n in (0, 1, 2, 3, piece * 3 // 4 - 1, piece * 3 // 4, piece * 3 // 4 + 1, 3 * piece // 2 + 7):
        raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for text in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode(),
                     base64.urlsafe_b64encode(raw).decode().rstrip("="),  # unpadded, as URL-safe text often is
                     base64.encodebytes(raw).decode(), "data:image/png;base64," + base64.b64encode(raw).decode()):
            assert requests.b64decode(text) == raw
    text = base64.b64encode(rng.integers(0, 256, 2 * piece, dtype=np.uint8).tobytes()).decode()
    for bad in (text[:-3], text[:piece + 5] + "*" + text[piece + 6:], "*" + text[1:], "QU\u00e9D",
                text[:piece - 2] + "==" + text[piece:], text[:piece - 4] + "==" + text[piece - 2:]):  # padding inside
        with pytest.raises((binascii.Error, ValueError)):
            base64.b64decode("".join(bad.split()), validate=True)  # refused by one call too
        with pytest.raises((binascii.Error, ValueError)):
            requests.b64decode(bad)
    # what one call accepts, this accepts: extra padding after a whole quad, padding alone past a piece,
    # the ASCII whitespace str.split() knows (its separators too)
    for odd in ("QUJD===", "A" * piece + "==", "\x1cQU\x1fJD\x0b"):
        assert requests.b64decode(odd) == base64.b64decode("".join(odd.split()), validate=True)
    with pytest.raises(binascii.Error, match=r"'\*', character 1,048,581 once whitespace is left out, is not base64"):
        requests.b64decode(text[:piece + 5] + "*" + text[piece + 6:])
    for odd in ["A" * n for n in (1, 4001, piece + 1)] + ["AAAAA=AAA"]:  # the message one call gives, counts too
        with pytest.raises(binascii.Error) as one:
            base64.b64decode(odd, validate=True)
        with pytest.raises(binascii.Error, match=re.escape(str(one.value))):
            requests.b64decode(odd)
    # Unicode whitespace is refused, where it is (splitting a long text on it took 5.5 GB)
    for odd, at in (("QUJD\u2028QUJD", "U+2028, outside ASCII, at character 4"), ("QU\xa0JD", "U+00A0")):
        with pytest.raises(binascii.Error, match=re.escape(at)):
            requests.b64decode(odd)


def test_text_that_is_no_base64_but_a_path_or_url_is_said_to_be_one():
    """A client that sent "/tmp/x.jpg" as an image heard only that '.' is not base64: text that reads as a file
    path or URL is now said to be one, and what to send instead; base64 cut short (a JPEG's begins with '/'),
    or text of other characters, is not taken for one."""
    from glmvit_cupy.serving import requests

    for text, looks in (("/tmp/x.jpg", "file path"), ("photo.png", "file path"), ("./a/b.webp", "file path"),
                        ("~/a", "file path"), ("C:\\pics\\a.jpg", "file path"), ("https://example.com/a.jpg", "URL")):
        with pytest.raises(requests.Refused) as e:
            requests.decoded(text, "images[2]", 2, "the image file's bytes")
        assert e.value.status == 400 and e.value.index == 2 and e.value.error.startswith("images[2] is not valid base64 (")
        assert e.value.error.endswith(f"); {text!r} looks like a {looks}, which the server does not open: give the image "
                                      "file's bytes in base64 (or as a data URL, data:<media type>;base64,<data>), not its "
                                      f"{'URL' if looks == 'URL' else 'path'}"), e.value.error
    for text in ("/9j/4AAQSkZJRgABA", "!!!", "QUJD*", "a.b c.jpg\n" * 500):
        with pytest.raises(requests.Refused) as e:
            requests.decoded(text, "images[0]", 0, "the image file's bytes")
        assert "looks like" not in e.value.error, e.value.error
    assert requests.decoded("aGVsbG8=", "images[0]", 0, "the image file's bytes") == b"hello"


def test_the_cache_counts_what_its_entries_hold():
    """Many small embeddings in a 100 kB cache: what the cache holds, measured, stays within its bound (keys,
    metadata and array headers count, not only the arrays' bytes)."""
    import tracemalloc

    import ml_dtypes

    from glmvit_cupy.serving.cache import EmbeddingCache

    checkpoint = "/models/some-checkpoint"
    tracemalloc.start()
    try:
        cache = EmbeddingCache(100_000)
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2000):
            cache.put(("%064x" % i, 16, 64, checkpoint), np.zeros((2, 16), ml_dtypes.bfloat16), (1, 2, 4))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 100_000 and 0 < cache.bytes <= 100_000, (held, cache.bytes, len(cache))
    assert cache.bytes >= held * 0.8  # an honest estimate, not a bound far above what is held
    assert cache.get(("%064x" % 1999, 16, 64, checkpoint)) is not None
    assert cache.get(("%064x" % 0, 16, 64, checkpoint)) is None  # the oldest went first


def test_embeddings_split_from_one_array_are_counted_as_their_own_rows():
    """A video request's embeddings come split from one array: cached as views, each entry kept the whole
    array alive and was counted so (400 videos of 8 KB: 1 GB counted, the cache emptied). Each entry keeps
    and counts its own rows; the first entry's rows are not a view of what a later request mutates."""
    import ml_dtypes

    from glmvit_cupy.serving.cache import EmbeddingCache

    whole = np.random.default_rng().standard_normal((400 * 4, 64)).astype(ml_dtypes.bfloat16)
    parts = np.split(whole, 400)
    cache = EmbeddingCache(10 << 20)
    for i, part in enumerate(parts):
        cache.put(("video %d" % i, "ckpt"), part, {"frames": 2})
    assert len(cache) == 400 and cache.bytes < 400 * (part.nbytes + 2_000)
    kept = cache.get(("video 7", "ckpt"))[0]
    assert kept.base is None and np.array_equal(kept.view(np.uint16), parts[7].view(np.uint16))
    whole[28] = 0  # the request's array, reused: the cache's copy is its own
    assert not np.array_equal(kept.view(np.uint16), parts[7].view(np.uint16))


def bmp_header(w: int, h: int) -> bytes:
    """A 24-bit BMP that says it is w x h (its pixels are not there)."""
    return b"BM" + struct.pack("<IHHI", 54, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("w,h,header,says", [
    (5000, 4000, png_header, "images[1] has 5000 x 4000 = 20,000,000 pixels, over the server's limit of 16,000,000 "
                             "an image (--max-pixels): refused as a possible decompression bomb; send a smaller image"),
    (20_000, 20_000, png_header, "images[1] has 20000 x 20000 = 400,000,000 pixels, over the server's limit of "
                                 "16,000,000 an image (--max-pixels): refused"),  # a PNG: sized from its IHDR
    (20_000, 20_000, bmp_header, "images[1] has 400,000,000 pixels, over the server's limit of 16,000,000 an image "
                                 "(--max-pixels): refused"),  # over twice Pillow's own limit: Pillow refuses to open it
])
def test_a_decompression_bomb_is_refused_naming_the_servers_flag_and_one_limit(server, w, h, header, says):
    _, client = server
    got, err = post(client, json.dumps({"images": [b64(png(30, 30, 409)), b64(header(w, h))]}).encode())
    assert got == 422 and err["index"] == 1, err
    assert err["error"].startswith(says), err
    assert "glmvit-encode" not in err["error"] and "178956970" not in err["error"] and "89,478,485" not in err["error"]


# -- 6, 7. what an operator and a client are told -------------------------------------------------------------

def test_the_install_hint_names_an_install_that_works(monkeypatch, capsys):
    from glmvit_cupy.serving import main as serve_main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # the serve extra not installed
    assert serve_main.main(["--checkpoint", TOWER, "--cpu"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[serve]'" in err and "glmvit-cupy[serve]" not in err, err


def test_a_video_file_on_a_server_without_pyav_is_501_saying_what_to_send():
    proc, client = launch(prelude="sys.modules['av'] = None")  # PyAV absent
    try:
        frames = [b64(png(20, 20, 410)), b64(png(20, 20, 411))]
        got, err = post_video(client, {"videos": [{"frames": frames, "fps": 2}, {"file": b64(b"\x00" * 64)}]})
        assert got == 501 and err["index"] == 1, err
        assert err["error"].startswith("videos[1] is a video file, and this server cannot decode video files")
        assert '"frames": [base64 image file, ...]' in err["error"] and "pip" not in err["error"]
        got, _ = post_video(client, {"videos": [{"frames": frames, "fps": 2}]})  # frames still are
        assert got == 200
    finally:
        stop(proc)


def test_the_connection_cap_fits_the_open_file_limit(monkeypatch):
    """The default cap is lowered where the hard open-file limit is too low for it; an asked-for cap that does
    not fit is refused, saying what would."""
    import resource

    from glmvit_cupy.serving import main as serve_main

    raised = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 700))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: raised.append(limits))
    assert serve_main.open_files_for(None) == (444, 128, None) and raised == [(700, 700)]
    cap, _, why = serve_main.open_files_for(600)
    assert why == ("--max-connections 600 needs about 856 open files, and this process may open 700 (ulimit -n): "
                   "lower --max-connections to at most 444, or raise the limit")
    assert serve_main.open_files_for(100) == (100, 472, None)


def post_raw(client, body: bytes) -> tuple[int, dict]:
    """(status, JSON answer) of a body POSTed as it is, to /v1/encode or, for a video request, /v1/encode_video."""
    import urllib.error
    import urllib.request

    path = "/v1/encode" if b"images" in body else "/v1/encode_video"
    req = urllib.request.Request(client.url + path, data=body, method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    return e.value.code, json.loads(e.value.read())


@pytest.mark.parametrize("body, says", [
    (b'{"images": [' + b"[]," * 2000 + b'"QQ=="]}', "the body holds 4,004 JSON strings, arrays, objects and commas; a "
     "request of up to 8 images (--max-queue) holds at most 96: send at most 8 images a request, each as one base64 "
     "string"),
    (b'{"videos": [' + b'"",' * 600_000 + b'{}]}', "JSON strings, arrays, objects and commas; a video request holds at "
     "most 1,000,000: send fewer frames a request (a video file is one string)"),
])
def test_a_body_of_many_json_items_is_refused_before_it_is_parsed(server, body, says):
    """A body of many tiny JSON items costs json.loads an object each, holding the interpreter (60 MB of "[],"
    took 1.5 GB and 7 s): refused (413, too large for its kind) from a count of their marks, before any
    parsing."""
    status, err = post_raw(server[1], body)
    assert status == 413 and says in err["error"], err


@pytest.mark.parametrize("body, says", [
    ('{"images": ["QUJD\u00a0"]}'.encode(), "a byte outside ASCII at offset 17"),
    (b'{"images": ["QUJD\\u00a0"]}', "escapes a character outside ASCII at offset 17 (\\u00a0)"),
    (b'{"images": ["QUJD\\ud83d\\ude00"]}', "escapes a character outside ASCII at offset 17 (\\ud83d)"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "min_image_tokens": "16"}', "'min_image_tokens' must be an integer"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "max_frames": [3]}', "'max_frames' must be an integer, got [3]"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "target_fps": true}', "'target_fps' must be a number, got True"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": "2"}]}', "videos[0].fps must be a number or null, got '2'"),
    (b'{"images": [], "images": ["QQ=="]}', "the field 'images' is given twice in one object"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2, "fps": 30}]}', "the field 'fps' is given twice"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 1%s}]}' % (b"0" * 400), "videos[0].fps = 1000000"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2, "duration": %d}]}' % 2**1024, "videos[0].duration = 1797"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "target_fps": 9%s}' % (b"9" * 400), "'target_fps' = 999999"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "max_duration": %d}' % 2**1100, "'max_duration' = "),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "max_frames": %d}' % 2**1100, "'max_frames' = "),
    # A number in a float's form past any float: json.loads reads it as infinity (once a 500 from the video's key)
    (b'{"videos": [{"frames": ["QQ=="], "fps": 1e999}]}', "videos[0].fps is past any float (read as inf)"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2, "duration": -1E400}]}', "videos[0].duration is past any float"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "target_fps": -1e999}', "'target_fps' is past any float"),
    (b'{"videos": [{"frames": ["QQ=="], "fps": 2}], "max_duration": 1e999}', "'max_duration' is past any float"),
])
def test_a_body_outside_the_requests_form_is_400_before_any_work(server, body, says):
    """A request is ASCII JSON: one non-ASCII character (or an escape of one) would make every string of the
    parse 2 or 4 bytes a character (a 240 MiB body took 2-6 GB), so it is refused before parsing. A video
    setting of the wrong type is the client's mistake (400), not the engine's (500)."""
    status, err = post_raw(server[1], body)
    assert status == 400 and says in err["error"], err


def test_an_escaped_backslash_before_u_is_no_escape_of_a_character_outside_ascii():
    """JSON's "\\\\u00e9" is an escaped backslash, then the ASCII text "u00e9": parsed (and refused later for
    what it is, not base64), not refused as an escape of a character outside ASCII; one more backslash makes
    it such an escape, named where it is."""
    from glmvit_cupy.serving.requests import Refused, parse_images

    assert parse_images(b'{"images": ["\\\\u00e9QQ=="]}', 8000)[0] == ["\\u00e9QQ=="]
    with pytest.raises(Refused, match=re.escape("escapes a character outside ASCII at offset 15 (\\u00e9)")):
        parse_images(b'{"images": ["\\\\\\u00e9QQ=="]}', 8000)


def test_a_body_with_a_utf8_byte_order_mark_is_read(server):
    """Some clients (.NET, PowerShell) start a UTF-8 body with a byte-order mark: skipped, not refused."""
    _, client = server
    body = b"\xef\xbb\xbf" + json.dumps({"images": [b64(png(40, 40, 77))]}).encode()
    assert post(client, body)[0] == 200


def test_an_unexpected_failure_is_a_500_and_its_traceback_is_logged():
    """A pass that raises something no check foresaw (here: a ZeroDivisionError from the engine): the request
    gets a 500 saying so, the operator's log holds the traceback, and the next request is served."""
    prelude = ("from glmvit_cupy.backend import Backend; launch_on = Backend.launch_on; calls = []; "
               "Backend.launch_on = lambda self, lane, items: (calls.append(1), "
               "1 / 0 if len(calls) == 1 else launch_on(self, lane, items))[1]")
    proc, client = launch(prelude=prelude)
    try:
        body = json.dumps({"images": [b64(png(60, 80, 51))]}).encode()
        status, err = post(client, body)
        assert status == 500 and err == {"error": "encoding failed (ZeroDivisionError: division by zero)",
                                         "index": None}, err
        assert post(client, body)[0] == 200
    finally:
        stop(proc)
    logged = proc.stdout.read()
    assert "glmvit-serve: /v1/encode: 500: encoding failed:\nTraceback (most recent call last):" in logged, logged
    assert "ZeroDivisionError: division by zero" in logged, logged


def test_a_video_frame_over_max_pixels_is_a_422_naming_it(server):
    """A video's frame file whose header says more pixels than --max-pixels (16,000,000 here): 422 naming the
    video, the frame and its size, from the header alone (nothing decoded)."""
    frame = b64(png_header(5000, 4000))
    status, err = post_video(server[1], {"videos": [{"frames": [b64(png(40, 40, 501)), frame], "fps": 1.0}],
                                         "sample": False})
    assert status == 422 and err["index"] == 0, err
    assert err["error"].startswith("videos[0].frames[1] has 5000 x 4000 = 20,000,000 pixels, over the server's "
                                   "limit of 16,000,000 an image (--max-pixels)"), err


def test_a_hang_up_is_ignored_under_nohup():
    """With SIGHUP ignored when it starts (nohup), a hang-up leaves the server serving; SIGTERM still drains."""
    proc, client = launch(prelude="import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN)")
    try:
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert proc.poll() is None and client.health()["status"] == "ok"
        assert client.encode([png(40, 40, 502)])[0][0].shape[0] > 0
    finally:
        stop(proc)
    assert proc.returncode == 0 and "SIGHUP" not in proc.stdout.read()


def test_malformed_requests_are_logged_sparsely(monkeypatch):
    """uvicorn logs a line for each malformed request, as often as clients send them: one passes every 10 s,
    the next that passes counting those held back."""
    import logging

    from glmvit_cupy.serving import http_server

    now = [100.0]
    monkeypatch.setattr(http_server.time, "monotonic", lambda: now[0])
    sparse = http_server.Sparse("Invalid HTTP request")

    def record(msg):
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, (), None)

    passed = [sparse.filter(r) for r in [record("Invalid HTTP request received.") for _ in range(50)]]
    assert passed == [True] + [False] * 49 and sparse.filter(record("Cancel 1 running task(s)"))
    now[0] += 10
    late = record("Invalid HTTP request received.")
    assert sparse.filter(late) and late.getMessage() == ("Invalid HTTP request received. (and 49 more since the last "
                                                         "such line)")


def test_an_image_far_from_square_counts_its_resize_tables_in_flight():
    """A 1 x 20,000,000 image holds 20,000,000 pixels decoded and a 6,272,000-pixel canvas, but resizing it makes
    323 MB of tables (80,864,000 pixels at 4 bytes): --max-pixels-in-flight counts the largest, so a few such
    requests cannot take gigabytes past it. A photo's tables are far below its pixels: its count is unchanged."""
    from glmvit_cupy.preprocessing import resample
    from glmvit_cupy.preprocessing.image import Patching, content_size, smart_resize
    from glmvit_cupy.serving.decoding import pixels_held

    tall = pixels_held(20_000_000, (1, 20_000_000), 16, 8000, Patching())
    ch, cw = content_size(20_000_000, 1, smart_resize(20_000_000, 1))
    assert tall == (resample.table_bytes(20_000_000, ch) + resample.table_bytes(1, cw)) // 4 > 80_000_000
    canvas = smart_resize(3000, 4000)
    assert pixels_held(12_000_000, (4000, 3000), 16, 8000, Patching()) == 12_000_000 >= canvas[0] * canvas[1]


GOLDEN_CLIP = os.path.join(os.path.dirname(__file__), "golden", "video_files", "h264_2997.mp4")


def test_a_client_cannot_have_the_server_encode_or_probe_its_own_files(tmp_path):
    """A "video file" that is FFmpeg's concat script (probed from its first line) naming secret.mp4 in the
    server's working folder was a 200 with that file's embedding; one naming a missing file said "No such
    file or directory" (a probe of the server's files). Both are a 422 saying the same."""
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    import shutil

    shutil.copy(GOLDEN_CLIP, tmp_path / "secret.mp4")
    proc, client = launch(checkpoint=os.path.abspath(TOWER), cwd=tmp_path)
    try:
        answers = [post_video(client, {"videos": [{"file": base64.b64encode(
            b"ffconcat version 1.0\nfile %s.mp4\n" % name).decode()}], "max_image_tokens": 256})
            for name in (b"secret", b"absent")]
    finally:
        stop(proc)
    for status, err in answers:
        assert status == 422 and err["index"] == 0, err
    assert answers[0][1]["error"] == answers[1][1]["error"] and "No such file" not in answers[1][1]["error"], answers


def test_a_requests_video_keys_are_made_off_the_event_loop():
    """A video's key hashes every frame (up to ~500,000 of them in a request, or a 256 MiB file): made on the
    event loop, it held every other request for ~1 s. For a body parsed on a thread (over 256 KiB) it is made
    there, beside the body's parse."""
    prelude = ("import threading, glmvit_cupy.vllm_ec as v; real = v.video_key_of; "
               "v.video_key_of = lambda *a, **k: (threading.current_thread() is threading.main_thread() and "
               "print('video key made on the event loop', file=sys.stderr, flush=True), real(*a, **k))[1]")
    proc, client = launch("--cache-mib", 0, prelude=prelude)
    frames = [base64.b64encode(b"P5\n2 1\n255\n" + bytes([i % 256, i // 256 % 256])).decode() for i in range(30_000)]
    try:
        status, _ = post_video(client, {"videos": [{"frames": frames, "fps": 2.0}], "max_frames": 4,
                                        "max_image_tokens": 64})
    finally:
        stop(proc)
    out = proc.stdout.read()
    assert status == 200 and "video key made on the event loop" not in out, (status, out[-2000:])


def test_a_damaged_tiff_in_a_clients_image_never_reaches_the_log():
    """libtiff writes its errors to the process's stderr ("ZIPDecode: Decoding error at scanline 0, incorrect
    data check.") on every decode: a client sending such images would fill the server's log, as Pillow's
    corrupt-EXIF warnings would. The image is a 422 naming it, and nothing is logged."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(
        buf, format="TIFF", compression="tiff_deflate")
    data = bytearray(buf.getvalue())
    data[300] ^= 0xFF  # inside the deflate stream: libtiff's ZIPDecode fails
    proc, client = launch("--cache-mib", 0)
    try:
        for _ in range(3):
            with pytest.raises(ServerError) as e:
                client.encode(bytes(data), max_image_tokens=64)
            assert e.value.status == 422, e.value
    finally:
        stop(proc)
    out = proc.stdout.read()
    assert "ZIPDecode" not in out and "scanline" not in out, out
