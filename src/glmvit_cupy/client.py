"""A small client for glmvit-serve (http.client: the base install, no serve extra). Each thread keeps one
connection to the server open between calls (HTTP keep-alive), so a call costs the server no new connection
(2.15 against 2.38 CPU ms for one small image a request, single runs that vary by ~10%: `benchmarks/bench_serve.py
--host-only --small --requests 4000 --server-cpus 0 --client-cpus 1`, without and with `--new-connections`).

    from glmvit_cupy.client import Client
    embs, meta = Client("http://127.0.0.1:8000").encode(["cat.jpg", open("dog.png", "rb").read()])
    # embs: one ml_dtypes.bfloat16 NumPy array [tokens, out_hidden] per image
    # meta: per image {"sha256", "key", "grid_thw", "tokens", "cached"}
    embs, meta = Client().encode_video([["f0.png", "f1.png", ...]], fps=30.0)  # one list of frames a video
    embs, meta = Client().encode_video(["clip.mp4"])  # or video files (paths or bytes): the server decodes them
    # meta: per video {"key", "grid_thw", "tokens", "frame_tokens", "frames_indices", "timestamps", "cached"}
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import numbers
import os
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request

import numpy as np

from .errors import ServerError, quoted


# A kept connection the server has since closed (its keep-alive timeout; a restart; a TLS proxy closing without
# close_notify) fails the next call before any answer with one of these: the call goes again once, on a new one.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
          ssl.SSLEOFError, ssl.SSLZeroReturnError)


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 600.0, max_answer_mib: float = 4096.0,
                 total_timeout: float = 3600.0):
        """url: the server's (http or https, with any path the server sits under); timeout: seconds a call
        waits for the server to connect, or to send the next part of its answer; total_timeout: seconds a
        call may take in all, however the server paces its answer (a TimeoutError past it). ValueError for a
        url that is not http(s)://host[:port][/path], or a timeout that is not a positive number of seconds.
        max_answer_mib: the largest answer read (glmvit-serve's own limit, --max-reply-mib, is 1024 by
        default); a larger one is an OSError, not read into memory."""
        if not isinstance(url, str):
            raise ValueError(f"Client: the url must be a string such as 'http://127.0.0.1:8000', got "
                             f"{type(url).__name__}")
        for name, value in (("timeout", timeout), ("total_timeout", total_timeout)):
            if value is not None and (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
                                      or not 0 < value < 2**31):
                raise ValueError(f"Client: {name}={value!r} must be a positive number of seconds (below 2**31), "
                                 "or None to wait without end")
        if isinstance(max_answer_mib, (bool, np.bool_)) or not isinstance(max_answer_mib, numbers.Real) \
                or not 1 / 1024 <= max_answer_mib <= 2**40:
            raise ValueError(f"Client: max_answer_mib={max_answer_mib!r} must be a number of MiB from 1/1024 (1 KiB: "
                             "every answer would be refused below it) to 2^40")
        self.url, self.max_answer = url.rstrip("/"), int(max_answer_mib * 2**20)
        self.timeout = None if timeout is None else float(timeout)
        self.total_timeout = None if total_timeout is None else float(total_timeout)
        try:
            parts = urllib.parse.urlsplit(self.url)
            port = parts.port
        except ValueError:  # an unclosed IPv6 bracket, a port that is no number
            parts, port = urllib.parse.urlsplit(""), -1
        if (parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query or parts.fragment
                or "@" in parts.netloc or not parts.path.isascii() or any(c in parts.path for c in " \t\r\n")):
            raise ValueError(f"Client: {url!r} is not a server's URL: give http://HOST[:PORT][/PATH] (or https://), "
                             "with no user name, query or fragment")
        self._parts = parts
        self._proxy = _proxy_for(parts)
        self._proxy_headers = {}  # a plain HTTP proxy's credentials (an https one gets them in its tunnel's CONNECT)
        if self._proxy is not None and self._proxy.username is not None:
            credentials = urllib.parse.unquote(self._proxy.username) + ":" + urllib.parse.unquote(
                self._proxy.password or "")
            auth = {"Proxy-Authorization": "Basic " + base64.b64encode(credentials.encode()).decode("ascii")}
            self._proxy_headers, self._tunnel_headers = ({}, auth) if parts.scheme == "https" else (auth, {})
        else:
            self._tunnel_headers = {}
        self._local = threading.local()  # this thread's open connection

    def __getstate__(self) -> dict:  # pickled (to a process pool, a Ray task) without its connections
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _local=threading.local())

    def health(self) -> dict:
        return self._parsed(lambda raw: _object(json.loads(raw)), self._call("GET", "/health")[1])

    def _parsed(self, parse, raw: bytes):
        """parse(raw) of a 2xx answer, or OSError: the answer is not glmvit-serve's (another server, a proxy's
        page)."""
        try:
            return parse(raw)
        except Exception as e:  # noqa: BLE001 - any parser's error on bytes the server sent
            raise OSError(f"the server at {self.url} answered with something that is not glmvit-serve's answer "
                          f"({type(e).__name__}: {e!s:.200}); is the URL right?") from None

    def encode(self, images, *, min_image_tokens: int | None = None,
               max_image_tokens: int | None = None) -> tuple[list[np.ndarray], list[dict]]:
        """Image files (paths, bytes or binary file objects; HxWx3 uint8 arrays go as PNG), or one of them ->
        (one bf16 array per image, per-image metadata), lists either way. ValueError for anything else,
        naming it."""
        if isinstance(images, np.ndarray) and images.ndim not in (3, 4):
            raise ValueError(f"images: an array of shape {list(images.shape)}; an image is an HxWx3 uint8 array "
                             "(several: a list of them, or an [N, H, W, 3] array)")
        if _one_file(images) or (isinstance(images, np.ndarray) and images.ndim == 3):
            images = [images]  # one image, not a sequence of them
        images = _listed(images, "images", "image files (paths or bytes) or HxWx3 uint8 arrays")
        limits = {k: _plain(v) if isinstance(v, np.generic) else v for k, v in
                  (("min_image_tokens", min_image_tokens), ("max_image_tokens", max_image_tokens)) if v is not None}
        if len(images) == 1 and all(isinstance(v, int) and not isinstance(v, bool) for v in limits.values()):
            # One image goes as its file, the limits in the query: no base64 or JSON on either side.
            query = "?" + urllib.parse.urlencode(limits) if limits else ""
            data = _file_bytes(images[0], "image 0")
            try:
                _, raw = self._send("POST", "/v1/encode" + query, data, "application/octet-stream", images)
            except ServerError as e:
                older = e.index is None and "image/*" not in e.error  # a server older than image file bodies
                # Or bytes that start as JSON does ({ or [): the server took them for a JSON request sent as a
                # file, which this client never sends; as JSON, they are judged as the image they were given as.
                json_like = e.index == 0 and "sent as an image file" in e.error
                if e.status != 415 or not (older or json_like):
                    raise
                # The image goes as JSON
                body = {"images": [base64.b64encode(data).decode("ascii")], **limits}
                _, raw = self._post("/v1/encode", body, images)
        else:
            body = {"images": [_file_b64(im, f"image {i}") for i, im in enumerate(images)], **limits}
            _, raw = self._post("/v1/encode", body, images)
        return self._parsed(lambda raw: _answer(raw, len(images), "images"), raw)

    def encode_video(self, videos, *, fps=None, duration=None, **settings) -> tuple[list[np.ndarray], list[dict]]:
        """Videos, each a list of frames (image files as paths or bytes, or HxWx3 uint8 arrays, sent as PNG:
        lossless), a uint8 [T, H, W, 3] array, or a video file (a path or its bytes; the server decodes it
        with PyAV, its fps and duration the container's unless given; a file of one still image is refused)
        -> (one bf16 array per video, per-video metadata). A list holding a frame array is one video's
        frames, as preprocess_video takes it. fps and duration: one value for all or one per video; settings:
        preprocess_video's (sample, target_fps, max_frames, max_duration, min_image_tokens, max_image_tokens)."""
        if _one_file(videos) or (isinstance(videos, np.ndarray) and videos.ndim == 4) or (
                isinstance(videos, (list, tuple)) and any(isinstance(v, np.ndarray) and v.ndim == 3 for v in videos)):
            videos = [videos]  # one video (a file, a [T, H, W, 3] array or frames), not a sequence of them
        videos = _listed(videos, "videos", "video files, frame lists or [T, H, W, 3] uint8 arrays")
        n = len(videos)

        def per(v, name):
            if not isinstance(v, (list, tuple)):
                return [v] * n
            if len(v) != n:
                raise ValueError(f"{name} has {len(v)} values for {n} videos: give one value, or one per video")
            return list(v)

        fpss, durations = per(fps, "fps"), per(duration, "duration")

        def one(i, video):
            if _one_file(video):
                sent = {"file": _file_b64(video, f"video {i}")}
            else:
                if not isinstance(video, (np.ndarray, list, tuple)):
                    raise ValueError(f"video {i}: {type(video).__name__} is not a video file (a path or its bytes), "
                                     "a list of frames or a uint8 [T, H, W, 3] array")
                if isinstance(video, np.ndarray) and video.ndim != 4:
                    raise ValueError(f"video {i}: an array video is uint8 [T, H, W, 3], got {video.dtype} "
                                     f"{list(video.shape)}")
                sent = {"frames": [_file_b64(f, f"video {i} frame {j}") for j, f in enumerate(video)]}
            return {**sent, "fps": fpss[i], "duration": durations[i]}

        body = {"videos": [one(i, v) for i, v in enumerate(videos)], **settings}
        _, raw = self._post("/v1/encode_video", body, videos)
        return self._parsed(lambda raw: _answer(raw, n, "videos"), raw)

    def _post(self, path, body: dict, given: list):
        """POST body as JSON; a ServerError naming an image or video also names what the caller gave for it."""
        return self._send("POST", path, json.dumps(body, default=_plain).encode(), "application/json", given)

    def _send(self, method, path, data: bytes, kind: str, given: list):
        try:
            return self._call(method, path, data, kind)
        except ServerError as e:
            if e.index is None or not 0 <= e.index < len(given):
                raise
            raise ServerError(e.status, e.error, e.index, _source(given[e.index])) from None

    def _call(self, method, path, data=None, kind=None):
        status, raw = self._exchange(method, path, data, {"Content-Type": kind} if kind else {})
        if 200 <= status < 300:
            return status, raw
        if status < 400:  # glmvit-serve answers 200 or an error: a redirect or the like is something in between
            raise ServerError(status, f"the server at {self.url} answered {status}, not 200 (a redirect? give the "
                                      "URL the server itself listens on)", None)
        try:
            err = json.loads(raw)
            error, index = err.get("error", ""), err.get("index")
        except (ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested past Python's stack
            text = raw[:2000].decode(errors="replace")  # a proxy's page, say: its start says what it is
            raise ServerError(status, text + (f" ... ({len(raw):,} bytes in all)" if len(raw) > 2000 else "")
                              + self._doubled(status), None) from None
        if not isinstance(error, str):
            error = json.dumps(error)[:2000]
        if not isinstance(index, int) or isinstance(index, bool):
            index = None  # glmvit-serve names an image by its position or not at all
        raise ServerError(status, error + self._doubled(status), index)

    def _doubled(self, status: int) -> str:
        """For a 404: where the URL's path already ends in a route the client appends (Client(".../v1/encode")
        asks for /v1/encode/v1/encode), the advice to give the server's base URL; else nothing. Said on a 404,
        not refused when built: a server may sit under any path, even one that ends so."""
        for route in ROUTES if status == 404 else ():
            if self._parts.path.endswith(route):
                return (f"; the Client's URL {self.url} already ends in {route}, which the client adds itself: give "
                        f"Client the server's base URL, {self.url[:-len(route)]}")
        return ""

    def _exchange(self, method, path, data, headers, deadline: float | None = None) -> tuple[int, bytes]:
        """(status, body) of one request on this thread's connection, opened if it has none (or if it was
        opened by the process this one forked from: the two would read each other's answers). A kept connection
        that has anything to read before the request (the server closed it, or left an unasked answer) is
        replaced first. A server may answer before the body is all sent (413: over its limit) and close: that
        answer is read. A kept connection that fails while the request is sent, or closes with no answer at
        all (_STALE), is replaced and the request sent again, once; nothing else is sent twice. The whole of it
        (the retry too) is done by `deadline` (time.monotonic(); total_timeout from now if None), or
        TimeoutError; an answer takes at most twice max_answer_mib and 16 MiB from the socket (headers,
        chunks' framing), or OSError."""
        if deadline is None and self.total_timeout is not None:
            deadline = time.monotonic() + self.total_timeout
        local = self._local
        if getattr(local, "conn", None) is None or local.pid != os.getpid():
            local.conn, local.pid = self._connect(), os.getpid()
        conn = local.conn
        if conn.sock is not None and _readable(conn.sock):
            conn.close()  # closed by the server while idle, or holding bytes nobody asked for: a new socket
        kept = conn.sock is not None  # a socket that served an earlier call (http.client opens one as needed)
        r = None  # the answer, once its status line came
        try:
            # Each wait (connecting, sending, each read of the answer) ends by the deadline: a server trickling
            # a byte at a time would otherwise restart `timeout` with each.
            wait = _wait(self.timeout, deadline)
            conn.timeout = wait
            if kept:
                conn.sock.settimeout(wait)
            conn.response_class = lambda sock, **kw: http.client.HTTPResponse(
                _Metered(sock, self.timeout, deadline, 2 * self.max_answer + (16 << 20)), **kw)
            try:
                conn.request(method, self._target(path), body=data, headers={**headers, **self._proxy_headers})
            except _STALE as e:
                sent = e  # the server may have answered and closed before reading it all: its answer, if any
            else:
                sent = None
            try:
                r = conn.getresponse()
            except (http.client.HTTPException, OSError) as e:
                if sent is not None and not isinstance(e, http.client.RemoteDisconnected):
                    raise sent from None
                if not (kept and isinstance(e, _STALE)):
                    raise
                conn.close()  # closed (FIN) or reset (RST) before any answer: unanswered, sent again below
            else:
                try:
                    r = _final(conn, r, method)
                    return r.status, self._read(r)
                except ValueError as e:  # http.client on a chunk size below -1 (it reads a negative length)
                    raise http.client.HTTPException(f"a chunk's size is not one ({e})") from None
        except http.client.HTTPException as e:  # not HTTP: a status line, a header or a chunk that is not one
            conn.close()
            if isinstance(e, OSError):  # RemoteDisconnected: closed with no answer, a ConnectionError as it is
                raise self._unanswered(e, method, path, r is not None) from None
            raise OSError(f"the server at {self.url} did not answer in HTTP ({type(e).__name__}: {e!s:.200})") \
                from None
        except TimeoutError as e:
            conn.close()
            if not isinstance(e, _Late) and self.timeout is not None and (deadline is None or
                                                                          time.monotonic() < deadline):
                if isinstance(e, _SlowLookup):
                    raise TimeoutError(f"{method} {path} to the server at {self.url}: looking up the name "
                                       f"{e.args[0]} took over {self.timeout:g} s (the Client's timeout); the "
                                       "name server (DNS) is slow or does not answer: check the host name, give "
                                       "an IP address, or give Client a larger timeout") from None
                # `timeout`: no part of the answer came in time (the socket's own message is just "timed out")
                raise TimeoutError(f"{method} {path} to the server at {self.url}: nothing came for {self.timeout:g} s "
                                   "(the Client's timeout: the longest wait to connect, to send, or for the next "
                                   "part of the answer); the server is stalled or overloaded, or the URL reaches "
                                   "something that does not answer; give Client a larger timeout, or None for no "
                                   "limit") from None
            raise TimeoutError(f"{method} {path} to the server at {self.url} took over {self.total_timeout:g} s "
                               "in all (the Client's total_timeout): the server answered too slowly, or not at "
                               "all; give Client a larger total_timeout, or None for no limit") from None
        except _Overfed as e:
            conn.close()
            raise OSError(f"the server at {self.url} sent over {e.args[0]:,} bytes for one answer (headers, framing "
                          f"and body), past what an answer within the client's limit of {self.max_answer:,} bytes "
                          "(max_answer_mib) takes; is the URL right?") from None
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as e:  # on a new connection: no retry
            conn.close()
            raise self._unanswered(e, method, path, r is not None) from None
        except ConnectionRefusedError as e:  # nothing listens there: say where, and what would
            conn.close()
            if self._proxy is not None:  # the connection was the proxy's
                raise ConnectionRefusedError(e.errno, f"nothing listens at the proxy {self._proxy.netloc} that "
                                             f"{self.url} goes through ({e.strerror}): start it, or set "
                                             f"{self._parts.scheme}_proxy / no_proxy") from None
            raise ConnectionRefusedError(e.errno, f"nothing listens at {self.url} ({e.strerror}): start "
                                         "glmvit-serve there, or give Client the URL it listens on") from None
        except BaseException:
            conn.close()
            raise
        return self._exchange(method, path, data, headers, deadline)  # nothing was answered: once more

    def _unanswered(self, e: OSError, method: str, path: str, begun: bool) -> OSError:
        """A connection the server closed or reset before its answer ended (begun: after its status line), said
        as the same ConnectionError (callers retry on its type) naming the call and the server: the socket's own
        is a bare "[Errno 104] Connection reset by peer"."""
        said = (f"{method} {path} to the server at {self.url}: the server closed the connection "
                f"{'before its answer ended' if begun else 'without answering'} ({e.strerror or e}); it may have "
                "stopped or restarted, or the URL reaches something that is not glmvit-serve")
        if isinstance(e, http.client.RemoteDisconnected):
            return http.client.RemoteDisconnected(said)
        return type(e)(e.errno, said) if e.errno is not None else type(e)(said)

    def _read(self, r) -> bytes:
        """The answer's body, read a MiB at a time up to max_answer_mib (OSError past it: a Content-Length or
        a chunked body without end is never held whole)."""
        if r.status in (204, 304) or 100 <= r.status < 200:  # no body, whatever a Content-Length says
            return b""
        declared = (r.getheader("Content-Length") or "").strip()
        announced = int(declared) if declared.isascii() and declared.isdigit() else None
        if announced is not None and announced > self.max_answer:
            raise OSError(f"the server at {self.url} announces an answer of {announced:,} bytes, over the "
                          f"client's limit of {self.max_answer:,} (max_answer_mib)")
        parts, size = [], 0
        while True:
            part = r.read(1 << 20)
            if not part:
                if announced is not None and size < announced:
                    raise OSError(f"the server at {self.url} closed its answer after {size:,} of the "
                                  f"{announced:,} bytes it announced")
                return b"".join(parts)
            size += len(part)
            if size > self.max_answer:
                raise OSError(f"the server at {self.url} sent an answer of over {self.max_answer:,} bytes, the "
                              "client's limit (max_answer_mib)")
            parts.append(part)

    def _connect(self) -> http.client.HTTPConnection:
        p = self._parts
        kind = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        if self._proxy is None:
            conn = kind(p.hostname, p.port, timeout=self.timeout)
        else:
            conn = kind(self._proxy.hostname, self._proxy.port, timeout=self.timeout)
            if p.scheme == "https":
                conn.set_tunnel(p.hostname, p.port, headers=self._tunnel_headers)
        # http.client's hook for opening the socket (its connect() calls it with the connection's timeout, which
        # _exchange bounds by the call's deadline): the name looked up within that wait too. The connection
        # keeps the host's name for its Host header and TLS (SNI, the certificate's name).
        conn._create_connection = _open
        return conn

    def _target(self, path: str) -> str:
        """The request target: the path, or the whole URL for a plain HTTP proxy."""
        p = self._parts
        via = f"{p.scheme}://{p.netloc}" if self._proxy is not None and p.scheme == "http" else ""
        return via + p.path.rstrip("/") + path


ROUTES = ("/v1/encode_video", "/v1/encode", "/health", "/metrics")  # glmvit-serve's, which the client appends
INFORMATIONAL_LIMIT = 64  # 1xx answers read past before the final one; a proxy sends one or two


def _open(address, timeout=None, source_address=None) -> socket.socket:
    """socket.create_connection, but its name lookup too ends within `timeout` (getaddrinfo blocks without a
    limit of its own on a DNS server that does not answer): looked up on a helper thread, waited on for
    `timeout`, then each address tried with what is left of it; past it, a TimeoutError, as a connect's own
    timeout raises. A lookup that outlasts its wait ends on its own thread, its answer dropped."""
    host, port = address
    started = time.monotonic()
    if timeout is None or _numeric(host):  # nothing to wait on: no limit, or no DNS (an address)
        found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    else:
        answer = []
        done = threading.Event()

        def look_up():
            try:
                answer.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
            except BaseException as e:  # noqa: BLE001 - the caller's to raise (socket.gaierror, mostly)
                answer.append(e)
            done.set()

        threading.Thread(target=look_up, name=f"glmvit-client lookup of {host}", daemon=True).start()
        if not done.wait(timeout):
            raise _SlowLookup(host)
        if isinstance(answer[0], BaseException):
            raise answer[0]
        found = answer[0]
    error = None
    for family, kind, proto, _, addr in found:
        left = None if timeout is None else timeout - (time.monotonic() - started)
        if left is not None and left <= 0:
            raise TimeoutError(f"connecting to {host} took over {timeout:g} s")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            if source_address:
                sock.bind(source_address)
            sock.connect(addr)
            sock.settimeout(timeout)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error if error is not None else OSError(f"getaddrinfo found no address for {host}")


def _numeric(host: str) -> bool:
    """Whether a host is an IPv4 or IPv6 address, which getaddrinfo reads without a lookup."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host.split("%", 1)[0])
            return True
        except (OSError, ValueError):
            pass
    return False


def _wait(timeout: float | None, deadline: float | None) -> float | None:
    """The longest one wait may take: `timeout`, or less where the deadline comes first (_Late past it)."""
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Late()
    return left if timeout is None else min(timeout, left)


class _Late(TimeoutError):
    """A call's deadline passed (Client.total_timeout); _exchange says which call, and how long it had."""


class _SlowLookup(TimeoutError):
    """The name lookup of args[0] (the server's host or its proxy's) did not end within the wait it had."""


class _Overfed(OSError):
    """More bytes came for one answer than any answer within the client's limit takes (args[0]: that many)."""


class _Metered(io.RawIOBase):
    """What an HTTPResponse reads a socket through: each read waits at most the call's `timeout` and ends by
    its `deadline` (time.monotonic(), or None: _Late past it), and the bytes read for the answer stop at
    `most` (_Overfed): http.client reads some answers whole, unmetered by Client._read (a chunk of negative
    size: the rest of the stream). Holds the socket open as sock.makefile does, until closed."""

    def __init__(self, sock, timeout: float | None, deadline: float | None, most: int):
        super().__init__()
        self.sock, self.timeout, self.deadline, self.most, self.got = sock, timeout, deadline, most, 0
        self.raw = sock.makefile("rb", buffering=0)

    def makefile(self, mode: str, *args, **kwargs):  # HTTPResponse's own: its buffered reader over this
        return io.BufferedReader(self)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int | None:
        if self.got > self.most:
            raise _Overfed(self.most)
        wait = _wait(self.timeout, self.deadline)
        self.sock.settimeout(wait)
        try:
            n = self.raw.readinto(memoryview(b)[:self.most + 1 - self.got])
        except TimeoutError:
            if wait != self.timeout:  # the deadline's wait, not `timeout`'s, ran out
                raise _Late() from None
            raise
        self.got += n or 0
        return n

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


def _readable(sock) -> bool:
    """Whether a socket has anything to read now (or is closed): poll, not select, which refuses a
    descriptor number past 1023 (a process with many files open)."""
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(sock, select.POLLIN)
        return bool(p.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


def _final(conn: http.client.HTTPConnection, r: http.client.HTTPResponse, method: str) -> http.client.HTTPResponse:
    """The final answer behind any informational ones (1xx but 101: 103 Early Hints from a proxy, say), which
    a client reads past (RFC 9110, 15.2); http.client itself reads past 100 Continue only. Each next answer
    is read from the same buffered reader, which may hold its first bytes already. Past INFORMATIONAL_LIMIT of
    them the server is not one to wait on (each one would restart the read timeout): OSError."""
    seen = 0
    while 100 < r.status < 200 and r.status != 101:
        seen += 1
        if seen > INFORMATIONAL_LIMIT:
            conn.close()
            raise OSError(f"the server sent {INFORMATIONAL_LIMIT} informational (1xx) answers and no final one; is the "
                          "URL right?")
        final = conn.response_class(conn.sock, method=method)
        final.fp, r.fp = r.fp, None  # the reader moves on: the 1xx answer, let go, must not close it
        final.begin()
        if final.will_close:  # as getresponse does: no next request on this socket
            conn.close()  # the socket ends once `final` has read its body and closed the reader
        r = final
    return r


def _proxy_for(parts):
    """The proxy urllib would send a request for this URL through (HTTP_PROXY and the like, NO_PROXY heeded), as
    urlsplit's parts; None for none. ValueError naming the variable for a proxy URL that is not one."""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.netloc):  # host[:port], as urllib asks
        return None
    via = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
    try:
        via.port
    except ValueError:
        via = None
    if via is None or not via.hostname:
        raise ValueError(f"Client: the {parts.scheme}_proxy setting {proxy!r} (environment) is not a proxy's URL: give "
                         "http://HOST:PORT, or unset it")
    return via


def _bf16_tensors(raw: bytes) -> dict:
    """The bf16 tensors of a safetensors byte string (safetensors.numpy.load knows no bf16)."""
    import ml_dtypes  # here, not at import: it takes ~0.5 s
    from safetensors import deserialize

    out = {}
    for name, t in deserialize(raw):
        if t["dtype"] != "BF16":
            raise ValueError(f"tensor {name!r} is {t['dtype']}, not the BF16 glmvit-serve sends")
        out[name] = np.frombuffer(t["data"], dtype=ml_dtypes.bfloat16).reshape(t["shape"])
    return out


def _metadata(raw: bytes) -> dict:
    """The __metadata__ of a safetensors byte string."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]).get("__metadata__", {})


def _answer(raw: bytes, n: int, what: str) -> tuple[list[np.ndarray], list[dict]]:
    """An encode's answer: its n tensors in order (the file parsed once), and the metadata of each; ValueError
    where it is not one for n images or videos."""
    tensors = _bf16_tensors(raw)
    if set(tensors) != {str(i) for i in range(n)}:
        raise ValueError(f"tensors {sorted(tensors)[:8]} for {n} {what}; glmvit-serve names them 0..{n - 1}")
    for name, t in tensors.items():
        if t.ndim != 2:
            raise ValueError(f"tensor {name} has shape {list(t.shape)}, not the [tokens, width] of an embedding")
    meta = json.loads(_metadata(raw)[what])
    if not isinstance(meta, list) or len(meta) != n or not all(isinstance(m, dict) for m in meta):
        raise ValueError(f"its metadata is not a list of {n} objects, one for each of the {what}")
    for i, m in enumerate(meta):
        if m.get("tokens") != tensors[str(i)].shape[0] or isinstance(m.get("tokens"), bool):
            raise ValueError(f"its metadata gives {what} {i} {quoted(m.get('tokens'))} tokens, its tensor "
                             f"{tensors[str(i)].shape[0]} rows")
    return [tensors[str(i)] for i in range(n)], meta


def _object(value) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def _listed(items, what: str, expected: str) -> list:
    """items as a non-empty list, or ValueError naming what was given instead."""
    if isinstance(items, dict):  # its keys are no images
        raise ValueError(f"{what}: a dict is not {expected}, nor a sequence of them")
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"{what}: {type(items).__name__} is not {expected}, nor a sequence of them") from None
    if not items:
        raise ValueError(f"{what}: none given; give one or more {expected}")
    return items


def _one_file(item) -> bool:
    """A path, a file's bytes or a file object: one image or video, not a sequence of them."""
    return isinstance(item, (str, os.PathLike, bytes, bytearray, memoryview)) or hasattr(item, "read")


def _plain(v):
    """A NumPy number or bool in a request's settings as the JSON value it is (json knows only Python's)."""
    if isinstance(v, np.generic) and v.ndim == 0 and v.dtype.kind in "biuf":
        return v.item()
    raise ValueError(f"a setting of {type(v).__name__} {v!r} cannot go in a request: give a number or a bool")


def _file_b64(frame, what: str) -> str:
    """An image, frame or video file as base64 (_file_bytes)."""
    return base64.b64encode(_file_bytes(frame, what)).decode("ascii")


def _file_bytes(frame, what: str) -> bytes:
    """An image, frame or video file's bytes: a path's or bytes as they are, an HxWx3 uint8 array as a PNG
    (lossless). OSError for a path that is not a readable regular file; ValueError naming `what` for an empty
    file and anything else (an array of another shape or type would be read differently than preprocess reads
    it: an alpha channel dropped, not composited)."""
    given = frame
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
            raise ValueError(f"{what}: an array is sent as an HxWx3 uint8 RGB image, got {frame.dtype} "
                             f"{list(frame.shape)}; send other images as their files (paths or bytes)")
        if frame.shape[0] == 0 or frame.shape[1] == 0:
            raise ValueError(f"{what}: the array {list(frame.shape)} holds no pixels; an image is at least 1x1")
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="PNG", compress_level=1)
        frame = buf.getvalue()
    elif isinstance(frame, (str, os.PathLike)):
        from .files import open_regular

        # A regular file only: a FIFO would wait for a writer forever, a device such as /dev/zero read without end.
        try:
            with open_regular(frame, what, error=OSError) as f:
                frame = f.read()
        except OSError as e:
            if e.errno is None:  # open_regular's own, naming the path and `what` already
                raise
            raise type(e)(e.errno, f"{what}: {e.strerror}", os.fspath(frame)) from None
    elif hasattr(frame, "read"):  # a file object: the rest of it, from where it stands
        import io

        data = "" if isinstance(frame, io.TextIOBase) else frame.read()  # text: not read (it may not decode)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"{what}: a file object that reads {type(data).__name__}, not bytes: open it in binary "
                             "mode ('rb')")
        frame = data
    elif not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what}: {type(frame).__name__} is not an image file's path or bytes, nor an HxWx3 uint8 "
                         "array")
    if not len(frame):  # the server would answer that a request's body is empty, as to curl
        if hasattr(given, "read") and not isinstance(given, (bytes, bytearray, memoryview)):
            raise ValueError(f"{what}: the file object gave 0 bytes from where it stands (at its end? one object "
                             "given twice, or read before); an image or video file was expected")
        named = f"{os.fspath(given)!r} is" if isinstance(given, (str, os.PathLike)) else "the file given is"
        raise ValueError(f"{what}: {named} empty (0 bytes); an image or video file was expected")
    return bytes(frame)


def _source(item) -> str | None:
    """What a caller gave for one image or video, as an error names it: a path, or its kind."""
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    if isinstance(item, (bytes, bytearray)):
        return f"{len(item):,} bytes"
    if isinstance(item, np.ndarray):
        return f"array {tuple(item.shape)}"
    if isinstance(item, (list, tuple)):
        first = _source(item[0]) if item else None
        return f"{len(item)} frames" + (f" from {first}" if first and isinstance(item[0], (str, os.PathLike)) else "")
    return type(item).__name__
