"""glmvit_cupy.client without a server: a refusal naming an image names what the caller gave for it."""

import base64
import io
import json
import os
import re
import socket
import urllib.parse

import numpy as np
import pytest

from glmvit_cupy import ServerError
from glmvit_cupy.client import Client


def refuse(index, error):
    def exchange(self, method, path, data, headers):
        return 422, json.dumps({"error": error, "index": index}).encode()

    return exchange


def test_an_error_names_the_path_the_caller_gave(tmp_path, monkeypatch):
    good, bad = tmp_path / "cat.png", tmp_path / "dog.png"
    good.write_bytes(b"x")
    bad.write_bytes(b"y")
    monkeypatch.setattr(Client, "_exchange", refuse(1, "image 1: cannot decode image"))
    with pytest.raises(ServerError) as e:
        Client().encode([str(good), bad])
    assert e.value.index == 1 and e.value.source == str(bad) and e.value.status == 422
    assert str(e.value) == f"HTTP 422: image 1: cannot decode image [{bad}]"


def test_bytes_arrays_and_frames_are_named_by_kind(monkeypatch, rng):
    monkeypatch.setattr(Client, "_exchange", refuse(0, "image 0: too large"))
    with pytest.raises(ServerError, match=r"\[4 bytes\]"):
        Client().encode([b"abcd"])
    with pytest.raises(ServerError, match=r"\[array \(5, 6, 3\)\]"):
        Client().encode([rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)])
    monkeypatch.setattr(Client, "_exchange", refuse(None, "the queue is full"))
    with pytest.raises(ServerError) as e:
        Client().encode([b"abcd"])
    assert e.value.source is None and str(e.value) == "HTTP 422: the queue is full"


def test_no_images_or_a_missing_file_are_refused_naming_them(tmp_path, monkeypatch):
    """An empty list is refused before anything is sent, in the caller's terms (not the wire's base64); a
    path that does not open names the image's place in the list and the path."""
    monkeypatch.setattr(Client, "_exchange", Answer())
    for call in (lambda: Client().encode([]), lambda: Client().encode_video(())):
        with pytest.raises(ValueError, match=r"(images|videos): none given; give one or more"):
            call()
    with pytest.raises(FileNotFoundError, match=r"image 1: No such file or directory: '.*nope\.jpg'") as e:
        Client().encode([b"abcd", tmp_path / "nope.jpg"])
    assert e.value.filename == str(tmp_path / "nope.jpg")


def test_an_empty_file_is_refused_naming_it_before_anything_is_sent(tmp_path, monkeypatch):
    """An empty image file went as an empty body, and the server's answer was written for curl ("the body is
    empty: send one image file (or JSON, as application/json)"): the caller now hears which of its files
    is empty, before anything is sent, for an image alone, among others, a video file and a frame."""
    import io

    sent = Answer()
    monkeypatch.setattr(Client, "_exchange", sent)
    (tmp_path / "empty.jpg").write_bytes(b"")
    for call, says in [(lambda: Client().encode(tmp_path / "empty.jpg"), r"image 0: '.*empty\.jpg' is empty"),
                       (lambda: Client().encode([b"abcd", b""]), r"image 1: the file given is empty"),
                       (lambda: Client().encode([io.BytesIO(b"")]), r"image 0: the file object gave 0 bytes"),
                       (lambda: Client().encode_video([tmp_path / "empty.jpg"]), r"video 0: '.*empty\.jpg' is"),
                       (lambda: Client().encode_video([[b"abcd", b""]]), r"video 0 frame 1: the file given is")]:
        with pytest.raises(ValueError, match=says + ".*; an image or video file was expected"):
            call()
    assert sent.sent == []


def test_a_path_that_is_not_a_regular_file_is_refused_unread(tmp_path, monkeypatch):
    """A FIFO would block the client forever, /dev/zero read without end: both refused by what they are,
    before anything is sent; an empty array names the image too."""
    import os

    monkeypatch.setattr(Client, "_exchange", Answer())
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.png")
        with pytest.raises(OSError, match=r"pipe.png: image 0 is a FIFO \(named pipe\), not a regular file"):
            Client().encode([tmp_path / "pipe.png"])
    if os.path.exists("/dev/zero"):
        with pytest.raises(OSError, match="/dev/zero: video 0 is a character device, not a regular file"):
            Client().encode_video(["/dev/zero"])
    with pytest.raises(ValueError, match=r"image 1: the array \[0, 4, 3\] holds no pixels"):
        Client().encode([png(np.zeros((2, 2, 3), np.uint8)), np.zeros((0, 4, 3), np.uint8)])


class Answer:
    """A stand-in for the server: keeps each request's JSON body and answers with one bf16 tensor per image
    (or video) it holds."""

    def __init__(self):
        self.sent = []

    def __call__(self, *request):  # Client._exchange's (method, path, data, headers): set on the class, unbound
        method, path, data, headers = request
        import base64
        import urllib.parse

        import ml_dtypes
        from safetensors.numpy import save

        if headers["Content-Type"] == "application/json":
            assert "?" not in path
            body = json.loads(data)
        else:  # one image file, its limits in the query: kept as the JSON request of it would hold them
            assert headers["Content-Type"] == "application/octet-stream" and path.startswith("/v1/encode")
            query = urllib.parse.parse_qsl(urllib.parse.urlsplit(path).query)
            body = {"images": [base64.b64encode(data).decode()], **{k: int(v) for k, v in query}}
            self.raw = getattr(self, "raw", 0) + 1
        self.sent.append(body)
        items = body.get("images") or body.get("videos")
        what = "images" if "images" in body else "videos"
        out = {str(i): np.full((2, 4), i, ml_dtypes.bfloat16) for i in range(len(items))}
        return 200, save(out, metadata={what: json.dumps([{"tokens": 2}] * len(items))})


def png(a) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def test_one_image_or_video_not_in_a_list_is_one_not_a_sequence(tmp_path, monkeypatch, rng):
    """A path, bytes or an HxWx3 array alone is one image; a [T, H, W, 3] array or a video file alone is one
    video: each sent as the list of one would send it, and answered as a list of one."""
    answer = Answer()
    monkeypatch.setattr(Client, "_exchange", answer)
    a = rng.integers(0, 256, (7, 9, 3), dtype=np.uint8)
    path = tmp_path / "a.png"
    path.write_bytes(png(a))
    for one in (str(path), path, png(a), a):
        embs, meta = Client().encode(one)
        Client().encode([one])
        assert len(embs) == len(meta) == 1 and answer.sent[-1] == answer.sent[-2]
        assert len(answer.sent[-1]["images"]) == 1
    clip = rng.integers(0, 256, (4, 6, 8, 3), dtype=np.uint8)
    for one in (clip, png(a), str(path)):
        embs, _ = Client().encode_video(one, fps=np.float32(2))
        Client().encode_video([one], fps=[2.0])
        assert len(embs) == 1 and answer.sent[-1] == answer.sent[-2] and len(answer.sent[-1]["videos"]) == 1
    assert len(answer.sent[-6]["videos"][0]["frames"]) == 4  # the array video: its four frames
    frames = list(clip)  # a list of HxWx3 frames is one video, as preprocess_video takes it; not one a frame
    embs, _ = Client().encode_video(frames, fps=2.0)
    assert len(embs) == 1 and len(answer.sent[-1]["videos"]) == 1 and len(answer.sent[-1]["videos"][0]["frames"]) == 4
    Client().encode_video([png(a), frames[0]], fps=2.0)  # frames of both kinds: one video
    assert len(answer.sent[-1]["videos"]) == 1 and len(answer.sent[-1]["videos"][0]["frames"]) == 2
    raw = answer.raw
    Client().encode([a], max_image_tokens=np.int64(100), min_image_tokens=np.int32(4))  # NumPy numbers: in the query
    assert answer.sent[-1]["max_image_tokens"] == 100 and answer.sent[-1]["min_image_tokens"] == 4
    assert answer.raw == raw + 1  # one image goes as its file, not as JSON
    Client().encode_video([clip], fps=2.0, sample=np.bool_(False))
    assert answer.sent[-1]["sample"] is False
    # A binary file object is one image (its bytes, from where it stands), not the lines it iterates to.
    with open(path, "rb") as f:
        Client().encode(f)
    with open(path, "rb") as f, pytest.raises(ValueError, match=r"image 1: the file object gave 0 bytes from where "
                                                              r"it stands \(at its end\? one object given twice"):
        Client().encode([f, f])  # the second read finds the file at its end: refused, nothing sent
    with open(path) as f, pytest.raises(ValueError, match=r"image 0: a file object that reads str, not bytes"):
        Client().encode(f)
    with pytest.raises(ValueError, match=r"images: an array of shape \[7, 9\]; an image is an HxWx3 uint8 array"):
        Client().encode(a[..., 0])
    with pytest.raises(ValueError, match="images: a dict is not image files"):
        Client().encode({"cat.jpg": 1})


@pytest.mark.parametrize("bad, says", [
    (np.zeros((5, 6, 4), np.uint8), "image 0: an array is sent as an HxWx3 uint8 RGB image, got uint8 [5, 6, 4]"),
    (np.zeros((5, 6), np.uint8), "image 0: an array is sent as an HxWx3 uint8 RGB image, got uint8 [5, 6]"),
    (np.zeros((5, 6, 3), np.float32), "got float32 [5, 6, 3]"),
    (None, "image 0: NoneType is not an image file's path or bytes"),
    (3.5, "image 0: float is not"),
])
def test_what_the_client_cannot_send_as_an_image_is_refused_by_name(bad, says, monkeypatch):
    monkeypatch.setattr(Client, "_exchange", Answer())
    with pytest.raises(ValueError) as e:
        Client().encode([bad])
    assert says in str(e.value), e.value


def test_video_settings_a_value_a_video_must_match_the_videos(monkeypatch, rng):
    monkeypatch.setattr(Client, "_exchange", Answer())
    clip = rng.integers(0, 256, (2, 6, 8, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="fps has 1 values for 2 videos: give one value, or one per video"):
        Client().encode_video([clip, clip], fps=[2.0])
    with pytest.raises(ValueError, match=r"video 1: an array video is uint8 \[T, H, W, 3\], got uint8 \[6, 8\]"):
        Client().encode_video([clip, clip[0, ..., 0]], fps=2.0)
    with pytest.raises(ValueError, match="a setting of set"):
        Client().encode_video([clip], fps=2.0, target_fps={1})
    with pytest.raises(ValueError, match=r"video 1: dict is not a video file \(a path or its bytes\), a list of frames"):
        Client().encode_video([clip, {"a": 1}], fps=2.0)


class _Counting:
    """A real HTTP/1.1 server on loopback answering /health with the connection it came on: closes each
    connection after `per_connection` requests (as a server's keep-alive timeout would), without a word."""

    def __init__(self, per_connection=None):
        import http.server
        import threading

        self.connections = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                outer.connections += 1
                self.served, self.number = 0, outer.connections

            def do_GET(self):
                body = json.dumps({"status": "ok", "connection": self.number, "path": self.path,
                                   "proxy_auth": self.headers.get("Proxy-Authorization"),
                                   "host": self.headers.get("Host")}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.served += 1
                if per_connection is not None and self.served >= per_connection:
                    self.close_connection = True  # closed with no "Connection: close": the client finds out later

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_calls_from_one_thread_share_one_connection_and_a_closed_one_is_replaced(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = _Counting()
    try:
        client = Client(server.url + "/under/")
        seen = [client.health() for _ in range(5)]
        assert [s["connection"] for s in seen] == [1] * 5 and server.connections == 1
        assert seen[0]["path"] == "/under/health"  # the URL's path is kept
    finally:
        server.close()
    server = _Counting(per_connection=1)  # every kept connection is closed by the time it is used again
    try:
        client = Client(server.url)
        assert [client.health()["connection"] for _ in range(4)] == [1, 2, 3, 4]
    finally:
        server.close()


def test_a_kept_connection_reset_at_the_next_request_is_replaced():
    """A server that has closed a kept connection with unread bytes, or aborts it, answers the next request on it
    with a reset (RST), not an end (FIN): the request was never answered, so it goes again once, on a new
    connection. A connection reset at its first request is not retried: the error is the caller's."""
    import struct
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    seen = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            seen.append([])
            with conn:
                while conn.recv(65536):
                    seen[-1].append(1)
                    if len(seen[-1]) == 2 or len(seen) == 3:  # the kept connection's second request; a third one's first
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        break  # closed with linger 0: a reset
                    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}')

    threading.Thread(target=serve, daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=10)
        assert client.health() == {"status": "ok"} and client.health() == {"status": "ok"}
        assert [len(c) for c in seen] == [2, 1]  # the reset request went again, once, on a new connection
        client._local.conn.close()
        with pytest.raises(ConnectionResetError):
            client.health()
        assert [len(c) for c in seen] == [2, 1, 1]
    finally:
        listener.close()


def test_a_plain_http_proxy_gets_the_whole_url(monkeypatch):
    server = _Counting()
    try:
        monkeypatch.setenv("http_proxy", server.url)  # the proxy: this server, answering for any host
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        assert Client("http://example.invalid:8000/x").health()["path"] == "http://example.invalid:8000/x/health"
    finally:
        server.close()


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host/", "http://", "http://host:port", "http://h/?q=1",
                                 "http://[::1", "http://u:p@host:8000", "http://h/#top", "http://h/a b"])
def test_a_url_that_is_not_a_servers_is_refused(url):
    with pytest.raises(ValueError, match="is not a server's URL"):
        Client(url)


def test_a_url_where_nothing_listens_says_where_and_what_to_start():
    with socket.socket() as s:  # a port just freed: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionRefusedError, match=rf"nothing listens at http://127.0.0.1:{port} .*glmvit-serve"):
        Client(f"http://127.0.0.1:{port}").health()
    with pytest.MonkeyPatch.context() as m:  # through a proxy: the proxy is what refused
        for k in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
            m.delenv(k, raising=False)
        m.setenv("http_proxy", f"http://127.0.0.1:{port}")
        with pytest.raises(ConnectionRefusedError, match=rf"nothing listens at the proxy 127.0.0.1:{port} that "
                                                         r"http://example.invalid:8000 goes through .*http_proxy"):
            Client("http://example.invalid:8000").health()


def test_arguments_that_are_not_a_url_timeout_or_sequence_are_value_errors():
    with pytest.raises(ValueError, match="the url must be a string"):
        Client(None)
    for timeout in (0, -1, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match="must be a positive number of seconds"):
            Client("http://127.0.0.1:1", timeout=timeout)
    for fine in (None, np.int64(30), np.float32(2.5), 0.5):  # None: no limit, as http.client takes it
        Client("http://127.0.0.1:1", timeout=fine, max_answer_mib=np.int64(16))
    for limit in (0, 1e-9, -1, 2**41, float("nan"), True):  # 1e-9 MiB: 0 bytes, every answer refused
        with pytest.raises(ValueError, match="max_answer_mib=.* must be a number of MiB from 1/1024"):
            Client("http://127.0.0.1:1", max_answer_mib=limit)
    client = Client("http://127.0.0.1:1", timeout=2)
    with pytest.raises(ValueError, match="images: NoneType is not image files"):
        client.encode(None)
    with pytest.raises(ValueError, match="videos: int is not video files"):
        client.encode_video(5)


def test_a_client_pickles_without_its_connections(monkeypatch):
    import pickle

    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = _Counting()
    try:
        client = Client(server.url)
        client.health()
        copy = pickle.loads(pickle.dumps(client))
        assert copy.url == client.url and copy.health()["connection"] == 2  # its own connection
    finally:
        server.close()


def _no_proxies(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_a_forked_process_opens_its_own_connection(monkeypatch):
    """A connection kept before a fork is the parent's: the child's calls go on a new one (sharing it, each
    would read the other's answers)."""
    import os

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    _no_proxies(monkeypatch)
    server = _Counting()
    try:
        client = Client(server.url)
        assert client.health()["connection"] == 1
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its answer through the pipe, then out at once
            try:
                os.write(write, json.dumps([client.health()["connection"] for _ in range(2)]).encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        assert json.loads(os.read(read, 1000)) == [2, 2]
        assert client.health()["connection"] == 1  # the parent's own, still
    finally:
        server.close()


def test_proxy_credentials_and_no_proxy_with_a_port(monkeypatch):
    _no_proxies(monkeypatch)
    server = _Counting()
    try:
        monkeypatch.setenv("http_proxy", server.url.replace("http://", "http://us%40er:pa%3Ass@"))
        got = Client("http://example.invalid:8000").health()
        assert got["proxy_auth"] == "Basic " + base64.b64encode(b"us@er:pa:ss").decode()
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy that is not there ...
        monkeypatch.setenv("no_proxy", server.url.replace("http://", ""))  # ... and not used for host:port
        assert Client(server.url).health()["proxy_auth"] is None
    finally:
        server.close()


def test_one_image_goes_as_json_to_a_server_older_than_image_file_bodies(monkeypatch, rng):
    answer = Answer()

    def older(*request):
        if request[-1]["Content-Type"] != "application/json":
            return 415, json.dumps({"error": "Content-Type 'application/octet-stream': send application/json",
                                    "index": None}).encode()
        return answer(*request[-4:])

    monkeypatch.setattr(Client, "_exchange", older)
    embs, _ = Client().encode(png(rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)), max_image_tokens=64)
    assert len(embs) == 1 and answer.sent[-1]["max_image_tokens"] == 64 and not getattr(answer, "raw", 0)


def test_a_proxy_setting_that_is_not_a_url_is_named(monkeypatch):
    _no_proxies(monkeypatch)
    monkeypatch.setenv("http_proxy", "http://proxy:99999")
    with pytest.raises(ValueError, match=r"the http_proxy setting 'http://proxy:99999' \(environment\) is not a proxy"):
        Client("http://example.invalid:8000")


def test_an_error_page_that_is_not_json_is_cut_to_its_start(monkeypatch):
    """A proxy's 502 page of 10 MB went into the ServerError whole (up to --max-answer-mib, 4 GiB)."""
    page = b"<html>bad gateway</html>" + b" " * 10_000_000
    monkeypatch.setattr(Client, "_exchange", lambda *request: (502, page))
    with pytest.raises(ServerError) as e:
        Client().health()
    assert str(e.value).startswith("HTTP 502: <html>bad gateway</html>") and len(str(e.value)) < 2100
    assert f"({len(page):,} bytes in all)" in str(e.value)


@pytest.mark.parametrize("status", [101, 301, 304])
def test_an_answer_that_is_neither_200_nor_an_error_is_a_server_error(monkeypatch, status):
    monkeypatch.setattr(Client, "_exchange", lambda *request: (status, b"<html>moved</html>"))
    with pytest.raises(ServerError, match=f"HTTP {status}: the server at http://127.0.0.1:8000 answered {status}, not 200"):
        Client().health()


def test_too_short_pickles_as_itself():
    import pickle

    from glmvit_cupy import TooShort

    e = TooShort("clip.mp4: 2 frames", "raise --video-fps")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is TooShort and str(back) == str(e) and (back.what, back.advice) == (e.what, e.advice)


def test_untimed_pickles_as_itself():
    import pickle

    from glmvit_cupy import ImageError, Untimed

    e = Untimed("clip.mkv: 20 frames over 0 s")
    back = pickle.loads(pickle.dumps(e.advised("re-mux it")))
    assert type(back) is Untimed and isinstance(back, ImageError) and str(back) == "clip.mkv: 20 frames over 0 s; re-mux it"
    assert str(e) == f"clip.mkv: 20 frames over 0 s; {Untimed.ADVICE}"


def _read_request(conn):
    """Read one whole request (its headers, then Content-Length bytes of body), so that closing the socket
    after it sends a FIN: a close with unread bytes in the receive buffer sends a reset (RST) instead, which
    the client reads as ConnectionResetError, not as a server that closed without answering."""
    conn.settimeout(10)
    got = b""
    while b"\r\n\r\n" not in got and (chunk := conn.recv(65536)):
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    left = int(length[1]) - len(body) if length else 0
    while left > 0 and (chunk := conn.recv(min(left, 65536))):
        left -= len(chunk)


class _Junk:
    """A server that answers every request with the same raw bytes (then, with `endless`, a chunk a read
    forever), then closes."""

    def __init__(self, answer: bytes, endless: bool = False):
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer, self.endless, self.stop = answer, endless, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    _read_request(conn)
                    self._answer(conn)
                except OSError:
                    pass

    def _answer(self, conn):
        conn.sendall(self.answer)
        while self.endless and not self.stop.is_set():
            conn.sendall(b"100000\r\n" + b"x" * 0x100000 + b"\r\n")

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("answer,endless,says", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999\r\n\r\n", False, "announces an answer of 99,999,999,999,999"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True, "sent an answer of over 8,388,608 bytes"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", False, "did not answer in HTTP (BadStatusLine"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", False, "closed its answer after 5 of the 100 bytes"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]", False, "not glmvit-serve's answer (ValueError: a JSON list"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!", False, "not glmvit-serve's answer (JSONDecodeError"),
    # A Content-Length of a digit outside ASCII (latin-1 superscript two): no length, the answer read to its end
    (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n[]", False, "not glmvit-serve's answer (ValueError: a JSON list"),
])
def test_an_answer_that_is_not_glmvit_serves_is_an_oserror_read_within_a_limit(answer, endless, says):
    server = _Junk(answer, endless)
    try:
        with pytest.raises(OSError, match=re.escape(says)):
            Client(server.url, timeout=10, max_answer_mib=8).health()
    finally:
        server.close()


@pytest.mark.parametrize("close", [False, True])
def test_informational_answers_before_the_final_one_are_read_past(close):
    """A 102 and a 103 Early Hints (a proxy's, say) come before the answer, in one write with it: the client
    reads past them to the answer, twice (the server closes each connection after one answer, announcing
    it or not)."""
    final = b"HTTP/1.1 200 OK\r\n" + (b"Connection: close\r\n" if close else b"") + \
        b'Content-Length: 15\r\n\r\n{"status":"ok"}'
    server = _Junk(b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n" +
                   final)
    try:
        client = Client(server.url, timeout=10)
        assert client.health() == {"status": "ok"} and client.health() == {"status": "ok"}
    finally:
        server.close()


def test_endless_informational_answers_are_an_oserror_not_a_wait():
    """A server that sends 1xx answers without end would restart the read timeout with each: past
    INFORMATIONAL_LIMIT of them the client gives up."""
    from glmvit_cupy.client import INFORMATIONAL_LIMIT

    server = _Junk(b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n" * (INFORMATIONAL_LIMIT + 1))
    try:
        with pytest.raises(OSError, match=rf"sent {INFORMATIONAL_LIMIT} informational \(1xx\) answers and no final"):
            Client(server.url, timeout=10).health()
    finally:
        server.close()


def test_an_error_answer_of_json_nested_past_the_stack_is_a_server_error():
    """json.loads raises RecursionError on JSON nested deeper than Python's stack: still a ServerError with the
    answer's status and the start of its text."""
    nested = b"[" * 100_000 + b"]" * 100_000
    server = _Junk(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n" % len(nested) + nested)
    try:
        with pytest.raises(ServerError, match=r"HTTP 500: \[\[\[") as e:
            Client(server.url, timeout=10).health()
        assert e.value.status == 500
    finally:
        server.close()


def test_a_kept_connection_past_descriptor_1023_is_checked_and_reused():
    """Before a request the client checks whether its kept connection has anything to read; select() refuses
    a descriptor past 1023, which any process with many files open gives its next socket."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} files; the test needs 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if hard == resource.RLIM_INFINITY else
                                                min(max(soft, 1200), hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    server = _Junk(b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}')
    try:
        client = Client(server.url, timeout=10)
        assert client.health() == {"status": "ok"}
        assert client._local.conn.sock.fileno() > 1023
        assert client.health() == {"status": "ok"}
    finally:
        server.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_encode_answered_with_no_safetensors_file_is_an_oserror():
    server = _Junk(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n<html></html>"[:-1])
    try:
        with pytest.raises(OSError, match="not glmvit-serve's answer"):
            Client(server.url, timeout=10).encode([b"\x89PNG"])
    finally:
        server.close()


class _Slow:
    """A server that reads a request's headers, then either trickles an answer a byte every 0.2 s for up to
    `lasts` seconds ("trickle") or never reads the body, holding the connection open that long ("unread")."""

    def __init__(self, how: str, lasts: float = 20.0):
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.how, self.lasts, self.stop = how, lasts, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import time

        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(1024)
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1_000_000
            end = time.monotonic() + self.lasts
            try:
                for i in range(len(answer)):
                    if self.stop.is_set() or time.monotonic() > end:
                        return
                    if self.how == "trickle":
                        conn.sendall(answer[i:i + 1])
                    time.sleep(0.2)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("how", ["trickle", "unread"])
def test_a_call_ends_by_its_total_timeout_however_the_server_paces_it(how):
    """A server that sends a byte every 0.2 s restarts the per-read timeout (5 s) with each, and one that never
    reads a large body lets each send wait that long again: the call ends by total_timeout (1 s), with a
    TimeoutError saying what took too long and which setting to change."""
    import time

    server = _Slow(how)
    try:
        client = Client(server.url, timeout=5, total_timeout=1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=re.escape(f"POST /v1/encode to the server at {server.url} took over 1 s "
                                                         "in all (the Client's total_timeout)")) as e:
            client._send("POST", "/v1/encode", bytes(64 << 20), "application/octet-stream", [b""])
        assert "give Client a larger total_timeout, or None for no limit" in str(e.value)
        assert time.monotonic() - t0 < 4.0  # well short of the 5 s of one read, let alone 20 s of trickling
    finally:
        server.close()


def test_total_timeout_must_be_positive_seconds_or_none():
    for bad in (0, -1, float("inf"), "5", True):
        with pytest.raises(ValueError, match="total_timeout=.* must be a positive number of seconds"):
            Client("http://127.0.0.1:1", total_timeout=bad)
    assert Client("http://127.0.0.1:1", total_timeout=None).total_timeout is None
    assert Client("http://127.0.0.1:1").total_timeout == 3600.0


def test_a_chunk_of_negative_size_is_not_read_to_the_end_of_the_stream():
    """http.client reads a chunk of size -1 as "the rest of the stream", all of it, past max_answer_mib (200 MiB
    held for a limit of 8): the bytes read for one answer stop at twice the limit and 16 MiB."""
    server = _Junk(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n" + bytes(200 << 20))
    try:
        with pytest.raises(OSError, match=r"sent over 33,554,432 bytes for one answer \(headers, framing and body\), "
                                          r"past what an answer within the client's limit of 8,388,608 bytes"):
            Client(server.url, timeout=10, max_answer_mib=8).health()
    finally:
        server.close()


def test_a_server_that_closes_without_answering_is_a_connection_error():
    server = _Junk(b"")
    try:
        with pytest.raises(ConnectionError):  # RemoteDisconnected, as http.client says it: callers retry on it
            Client(server.url, timeout=10).health()
    finally:
        server.close()


@pytest.mark.parametrize("index", ["zz", 0.5, True, [1], -1, 99])
def test_an_error_whose_index_is_no_position_of_the_request_names_no_image(monkeypatch, index):
    monkeypatch.setattr(Client, "_exchange", refuse(index, {"not": "text"}))
    with pytest.raises(ServerError) as e:
        Client().encode([b"a", b"b"])
    assert e.value.source is None and e.value.status == 422 and '{"not": "text"}' in e.value.error
    assert e.value.index == (index if type(index) is int else None)


def _safetensors(tensors: dict, meta) -> bytes:
    import ml_dtypes
    from safetensors.numpy import save

    raw = save({k: v.astype(ml_dtypes.bfloat16).view(np.uint16) for k, v in tensors.items()},
               metadata={"images": json.dumps(meta)})
    n = int.from_bytes(raw[:8], "little")  # the uint16 views stand in for bf16: the header says BF16
    head = raw[8:8 + n].replace(b'"U16"', b'"BF16"')
    return len(head).to_bytes(8, "little") + head + raw[8 + n:]


@pytest.mark.parametrize("tensors, meta, says", [
    ({}, [], "tensors [] for 1 images"),
    ({"0": np.ones((2, 3)), "1": np.ones((2, 3))}, [{}], "tensors ['0', '1'] for 1 images"),
    ({"0": np.ones((2, 3, 4))}, [{}], "tensor 0 has shape [2, 3, 4]"),
    ({"0": np.ones((2, 3))}, [{}, {}, {}], "not a list of 1 objects"),
    ({"0": np.ones((2, 3))}, ["x"], "not a list of 1 objects"),
    ({"0": np.ones((2, 3))}, [{}], "its metadata gives images 0 None tokens, its tensor 2 rows"),
    ({"0": np.ones((2, 3))}, [{"tokens": 3}], "gives images 0 3 tokens"),
    ({"0": np.ones((1, 3))}, [{"tokens": True}], "gives images 0 True tokens"),
])
def test_an_answer_that_does_not_match_the_request_is_an_oserror(monkeypatch, tensors, meta, says):
    raw = _safetensors(tensors, meta)
    monkeypatch.setattr(Client, "_exchange", lambda self, method, path, data, headers: (200, raw))
    with pytest.raises(OSError, match=re.escape(says)):
        Client().encode([b"a"])
    ok = _safetensors({"0": np.ones((2, 3))}, [{"tokens": 2}])
    monkeypatch.setattr(Client, "_exchange", lambda self, method, path, data, headers: (200, ok))
    embs, metas = Client().encode([b"a"])
    assert embs[0].shape == (2, 3) and metas == [{"tokens": 2}]


@pytest.mark.parametrize("size", [b"-5", b"-2"])
def test_a_chunk_of_a_negative_size_below_minus_one_is_an_oserror_not_a_value_error(size):
    """http.client reads a chunk of size -5 as a read of -5 bytes, which raises ValueError ("read length must be
    non-negative or -1"): the client's word for a bad argument, not for a server that does not answer in HTTP."""
    server = _Junk(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\n" + b"x" * 100)
    try:
        with pytest.raises(OSError, match=re.escape("did not answer in HTTP (HTTPException: a chunk's size is not one")):
            Client(server.url, timeout=10).health()
    finally:
        server.close()


def test_a_server_that_never_answers_is_a_timeout_naming_the_call_and_the_setting():
    """A server that takes the request and sends nothing: once `timeout` passes, a TimeoutError that names the
    call, the server and the setting, not the socket's bare "timed out"."""
    server = _Slow("unread", lasts=10)
    try:
        with pytest.raises(TimeoutError, match=re.escape(f"GET /health to the server at {server.url}: nothing came "
                                                         "for 0.5 s (the Client's timeout")) as e:
            Client(server.url, timeout=0.5).health()
        assert "give Client a larger timeout, or None for no limit" in str(e.value)
    finally:
        server.close()


def _not_found(self, method, path, data, headers):
    """glmvit-serve's 404, for the path the request asked for (the URL's path and the route)."""
    return 404, json.dumps({"error": f"{method} {self._target(path)}: not found; this server has GET /health, "
                                     "POST /v1/encode", "index": None}).encode()


@pytest.mark.parametrize("url, route, base", [
    ("http://127.0.0.1:18301/v1/encode", "/v1/encode", "http://127.0.0.1:18301"),
    ("http://127.0.0.1:18301/under/v1/encode_video/", "/v1/encode_video", "http://127.0.0.1:18301/under"),
    ("http://127.0.0.1:18301/health", "/health", "http://127.0.0.1:18301"),
])
def test_a_404_for_a_url_that_ends_in_a_route_says_to_give_the_base_url(monkeypatch, url, route, base):
    """Client(".../v1/encode") asked for /v1/encode/v1/encode and said only that it was not found: the 404 now
    says the URL already ends in the route the client adds, and which base URL to give."""
    monkeypatch.setattr(Client, "_exchange", _not_found)
    for call in (lambda c: c.encode([b"abcd"]), lambda c: c.encode([b"ab", b"cd"]), lambda c: c.health()):
        with pytest.raises(ServerError) as e:
            call(Client(url))
        assert e.value.status == 404 and f"{urllib.parse.urlsplit(url).path.rstrip('/')}/" in e.value.error
        assert e.value.error.endswith(f"; the Client's URL {url.rstrip('/')} already ends in {route}, which the client "
                                      f"adds itself: give Client the server's base URL, {base}"), e.value.error
    monkeypatch.setattr(Client, "_exchange", lambda *request: (404, b"<html>no such page</html>"))  # not JSON
    with pytest.raises(ServerError, match=f"HTTP 404: <html>no such page</html>; the Client's URL .* base URL, {base}$"):
        Client(url).health()


def test_a_404_for_a_base_url_says_nothing_of_routes(monkeypatch):
    monkeypatch.setattr(Client, "_exchange", _not_found)
    with pytest.raises(ServerError) as e:
        Client("http://127.0.0.1:18301/encode").encode([b"abcd"])
    assert e.value.error == "POST /encode/v1/encode: not found; this server has GET /health, POST /v1/encode"


class _Resetting(_Junk):
    """A server that reads each request, sends `first` (its answer's start, or nothing) and resets the connection
    (RST: closed with linger 0)."""

    def __init__(self, first: bytes = b""):
        super().__init__(first)

    def _answer(self, conn):
        import struct
        import time

        conn.sendall(self.answer)
        time.sleep(0.2 if self.answer else 0)  # the start read before the reset, not lost to it
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("first, says", [
    (b"", "without answering"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "before its answer ended"),
])
def test_a_new_connection_reset_names_the_call_and_the_server(first, says):
    """A connection the server resets at its first request was a bare "[Errno 104] Connection reset by peer":
    now the same ConnectionResetError (callers catch ConnectionError) saying which call to which server."""
    import errno

    server = _Resetting(first)
    try:
        with pytest.raises(ConnectionResetError) as e:
            Client(server.url, timeout=10).health()
        assert e.value.errno == errno.ECONNRESET and isinstance(e.value, ConnectionError)
        assert str(e.value).startswith(f"[Errno {errno.ECONNRESET}] GET /health to the server at {server.url}: the "
                                       f"server closed the connection {says} (Connection reset by peer)"), str(e.value)
    finally:
        server.close()


def test_a_new_connection_closed_without_an_answer_names_the_call_and_the_server():
    import http.client

    server = _Junk(b"")
    try:
        with pytest.raises(http.client.RemoteDisconnected) as e:  # a ConnectionResetError, as http.client has it
            Client(server.url, timeout=10).encode([b"abcd"])
        assert str(e.value).startswith(f"POST /v1/encode to the server at {server.url}: the server closed the "
                                       "connection without answering (Remote end closed connection without response)")
    finally:
        server.close()


def _stuck_lookups(monkeypatch, names: dict):
    """socket.getaddrinfo as a DNS server that never answers for any host but `names` (host -> the address it
    stands for, looked up at once): the stuck lookups wait until released (then fail)."""
    import threading

    release, real = threading.Event(), socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host in names:
            return real(names[host], port, *args, **kwargs)
        release.wait(10)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return release


@pytest.mark.parametrize("timeout, total, says", [
    (0.5, 3600, ": looking up the name stuck{}.invalid took over 0.5 s (the Client's timeout); the name server"),
    (30, 0.5, " took over 0.5 s in all (the Client's total_timeout)"),
    (None, 0.5, " took over 0.5 s in all (the Client's total_timeout)"),
])
def test_a_name_lookup_that_never_ends_is_bounded_by_the_timeouts(monkeypatch, timeout, total, says):
    """socket.create_connection waits in getaddrinfo for as long as a DNS server takes not to answer, past
    timeout and total_timeout: the lookup now ends within them, with a TimeoutError that names the lookup
    and the name (past `timeout`) or the total; a proxy's name alike. A name looked up in time is still the one the request names (its Host header)."""
    import time

    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = _Counting()
    release = _stuck_lookups(monkeypatch, {"glmvit.test": "127.0.0.1"})
    try:
        for proxy in (None, "http://stuck-proxy.invalid:3128"):
            if proxy:
                monkeypatch.setenv("http_proxy", proxy)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=re.escape("GET /health to the server at http://stuck.invalid:8000"
                                                             + says.format("-proxy" if proxy else ""))):
                Client("http://stuck.invalid:8000", timeout=timeout, total_timeout=total).health()
            assert time.monotonic() - t0 < 2.0, proxy
        monkeypatch.delenv("http_proxy")
        port = server.url.rsplit(":", 1)[1]
        got = Client(f"http://glmvit.test:{port}", timeout=timeout, total_timeout=total).health()
        assert got["status"] == "ok" and got["host"] == f"glmvit.test:{port}", got
    finally:
        release.set()
        server.close()
