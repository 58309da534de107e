"""glmvit-serve's HTTP server: uvicorn on a protocol with a connection cap and deadlines for a request's
headers and for a reply the client stops reading, stopping in two steps on a signal (drain, then at
once). Used by the one-process server (main.py) and by each HTTP worker (workers.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import struct
import sys
import threading
import time

# The signal the server process drains its HTTP workers with (twice: stops them); they ignore SIGTERM, SIGINT
# and SIGHUP, which a terminal's Ctrl-C or a service manager sends to the whole process group.
DRAIN = getattr(signal, "SIGUSR1", signal.SIGTERM)


def log(message: str) -> None:
    """One line on stderr, written whole: a signal's handler logs too, and print's separate writes of the
    text and its newline let a second signal's line land between them."""
    sys.stderr.write(f"glmvit-serve: {message}\n")
    sys.stderr.flush()


# A connection closed after an answer while its client may still be sending (a request refused before its
# body or headers were all read, or not valid HTTP/1.1) lingers: its side shut for writing once the answer is
# out, what the client still sends read and dropped until the client closes, up to these. Closed at once, its
# socket would be reset (RST) on the client's next bytes, which loses the answer the client has not read yet.
LINGER_S = 2.0
LINGER_BYTES = 4 << 20


class _Counted:
    """A connection's transport whose write() counts the bytes written: those written less those unsent are what
    the client took. A wrapper, since uvloop's transports (uvicorn's loop where uvloop is installed) do not let
    write be replaced; every other attribute is the transport's own. close() is `on_close` (the protocol's
    close after an answer, which may linger) unless it lingers already or the transport is closing; while it
    lingers the connection is closing to everything that asks (is_closing), and what is written is dropped: its
    answer is out, its side shut for writing (an app answering after the HTTP layer's 400 would raise)."""

    __slots__ = ("lingering", "on_close", "transport", "written")

    def __init__(self, transport, on_close=None):
        self.transport, self.written, self.on_close, self.lingering = transport, 0, on_close, False

    def write(self, data) -> None:
        if self.lingering:
            return
        self.written += len(data)
        self.transport.write(data)

    def close(self) -> None:
        if self.on_close is None or self.lingering or self.transport.is_closing():
            self.transport.close()
        else:
            self.on_close()

    def is_closing(self) -> bool:
        return self.lingering or self.transport.is_closing()

    def close_now(self) -> None:
        """Closed without lingering: what the client still sends is past any answer's (a body's rest dropped
        beyond its limits, long after that answer)."""
        self.transport.close()

    def __getattr__(self, name):
        return getattr(self.transport, name)


def _unsent(transport) -> int:
    """Bytes written to a connection that its client has not taken yet: the transport's buffer, and on Linux
    the socket's send queue (SIOCOUTQ: unsent or unacknowledged), which a slow reader drains a little at a
    time while the transport's buffer waits for the kernel to report room (half the send buffer, which
    can take seconds)."""
    if transport is None:
        return 0
    left = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    try:
        import fcntl
        import termios
    except ImportError:  # not a Unix: the transport's buffer alone
        return left
    if sock is not None and hasattr(termios, "TIOCOUTQ"):
        with contextlib.suppress(OSError, ValueError):
            left += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return left


class _Chunks:
    """What a chunked body's size lines declare in all, read from its bytes as they are fed to h11 (which checks
    them: a line that is not a size stops the count here, and h11 refuses it). A size line counts once its
    LF came, as h11 reads it; only its first 64 bytes are kept. After a chunk's bytes, the next two are its
    CRLF, skipped as h11 skips them (h11 before 0.16 without looking at them: a line end searched for there
    instead would take the next size line for them, and miss what it declares)."""

    __slots__ = ("declared", "left", "line", "state")

    def __init__(self):
        self.declared, self.left, self.line, self.state = 0, 0, b"", "size"

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n and self.state != "end":
            if self.state in ("data", "crlf"):  # a chunk's bytes, then the two h11 reads after them (its CRLF)
                take = min(self.left, n - i)
                self.left, i = self.left - take, i + take
                if self.left == 0:
                    self.state, self.left = ("crlf", 2) if self.state == "data" else ("size", 0)
                continue
            end = data.find(b"\n", i)  # a size line
            self.line = (self.line + data[i:n if end < 0 else end])[:64]
            if end < 0:
                return
            i = end + 1
            size = re.match(rb"[0-9A-Fa-f]{1,20}", self.line)
            self.line = b""
            if size is None:
                self.state = "end"
                return
            self.left = int(size.group(), 16)
            self.declared += self.left
            self.state = "data" if self.left else "end"  # size 0: the last chunk (trailers follow)


def protocol(max_connections: int, header_timeout: float, metrics, reply_timeout: float = 60.0,
             body_timeout: float = 60.0, max_body_bytes: int = 64 << 20, linger_s: float = LINGER_S,
             linger_bytes: int = LINGER_BYTES):
    """uvicorn's h11 protocol with a cap on connections (one over it is answered 503 and closed at once), a
    deadline for each request's headers (408 and closed: uvicorn itself waits for them without end), and
    one for the rest of a body answered before it was read (body_timeout, max_body_bytes: then closed), and
    one for a reply the client stops reading: once writing pauses (the transport's buffer over its
    high-water mark), or a reply ends with bytes left in that buffer, a connection whose client took nothing
    more for reply_timeout seconds (bytes written less _unsent) is aborted, which lets its reply go (a client
    that never reads would otherwise hold it, up to --max-reply-mib, for as long as it stays connected, even
    past a close, which waits for the buffer to drain). A slow reader makes progress and keeps its
    connection. A chunked body whose chunks declare more than max_body_bytes is refused as soon as a chunk's
    size line says so (413, not a wait for bytes that may never come), and a request that is not valid
    HTTP/1.1 (a malformed chunk, say) gets a JSON 400 naming what h11 found wrong, counted as the encode's
    status where it was one. Every answer that closes its connection while the client may still be sending
    (those, a 408, an app's refusal with Connection: close) lingers (LINGER_S, LINGER_BYTES): up to
    max_connections connections at once, not counted against that cap (they hold no request); past that,
    one closes at once."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def raw(status: str, error: str) -> bytes:
        body = json.dumps({"error": error, "index": None}).encode()
        return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body

    class Connection(h11.Connection):
        """h11's connection, keeping what uvicorn's handling of it drops: the error that made a request invalid,
        and how many body bytes its chunks declare so far (those that came, and the rest of the chunk under
        way, which h11 reads as it comes: its size line read by _Chunks from the bytes fed to h11, since h11's
        events do not give a chunk's size before its bytes)."""
        error = None
        came = 0
        chunks = None  # the chunked body under way's size lines, read as its bytes are fed

        def receive_data(self, data):
            if self.chunks is not None:
                self.chunks.feed(bytes(data))
            super().receive_data(data)

        def next_event(self):
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as e:
                self.error = e
                raise
            if isinstance(event, h11.Request):
                self.came = 0
                # h11 takes Transfer-Encoding: chunked alone; its body starts with the bytes h11 has not read yet
                self.chunks = _Chunks() if any(name == b"transfer-encoding" for name, _ in event.headers) else None
                if self.chunks is not None:
                    self.chunks.feed(self.trailing_data[0])
                if not event.target.startswith(b"/") and event.target != b"*":
                    event = self.origin_form(event)
            elif isinstance(event, h11.Data):
                self.came += len(event.data)
            return event

        def origin_form(self, event):
            """A request whose target is absolute-form (http://HOST[:PORT]/PATH?QUERY), which a server must accept
            (RFC 9112 3.2.2), as the same request to /PATH?QUERY, its Host the target's authority (the Host header
            is ignored then, or added for HTTP/1.0); a target that is neither is a RemoteProtocolError (400)."""
            target = event.target
            scheme, sep, rest = target.partition(b"://")
            if not sep or scheme.lower() not in (b"http", b"https"):
                self.error = h11.RemoteProtocolError(f"the request target {target[:100]!r} is neither a path "
                                                     "(/PATH?QUERY) nor an absolute http(s)://HOST/PATH URL")
                raise self.error
            authority = re.match(rb"[^/?#]*", rest).group()
            if not authority or b"@" in authority:  # RFC 9110 4.2.1 (an empty host), 4.2.4 (user info)
                self.error = h11.RemoteProtocolError(f"the request target {target[:100]!r} is an absolute URL with "
                                                     f"{'user info' if authority else 'no host'}: give http(s)://HOST"
                                                     "[:PORT]/PATH, or the path alone with a Host header")
                raise self.error
            path = rest[len(authority):].partition(b"#")[0]
            headers = [(name, value) for name, value in event.headers if name != b"host"]
            return h11.Request(method=event.method, target=path if path.startswith(b"/") else b"/" + path,
                               headers=[(b"host", authority), *headers], http_version=event.http_version)

        @property
        def declared(self) -> int:
            return max(self.came, self.chunks.declared) if self.chunks is not None and \
                self.their_state is h11.SEND_BODY else self.came

    lingering = set()  # connections lingering after their answer: out of uvicorn's set, closing within linger_s

    class Protocol(H11Protocol):
        h11_connection = Connection
        refused = False
        linger_timer = None
        linger_left = 0  # bytes still read and dropped while lingering
        headers_timer = None
        reply_timer = None
        drop_timer = None  # while the rest of an answered request's body is read and dropped
        dropped = 0

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            most = config.h11_max_incomplete_event_size  # None: h11's default, as uvicorn reads it
            self.conn = Connection(h11.SERVER) if most is None else Connection(h11.SERVER, most)

        def connection_made(self, transport):
            if len(self.connections) >= max_connections:
                self.refused, self.transport = True, transport
                transport.write(raw("503 Service Unavailable", f"the server has {max_connections} connections open, "
                                    "its limit (--max-connections): retry later"))
                transport.close()
                return
            super().connection_made(transport)
            metrics.connections.set(len(self.connections))
            self._arm()
            # What the request cycles and the app's replies write through, and close through (_close).
            self.transport = _Counted(transport, self._close)

        def connection_lost(self, exc):
            if self.refused:
                return
            self._disarm()
            self._unarm_reply()
            self._stop_dropping()
            if self.linger_timer is not None:
                self.linger_timer.cancel()
                self.linger_timer = None
            lingering.discard(self)
            super().connection_lost(exc)
            metrics.connections.set(len(self.connections))

        def data_received(self, data):
            if self.transport.lingering:  # answered and closing: read and dropped, up to linger_bytes
                self.linger_left -= len(data)
                if self.linger_left < 0:
                    self._linger_end()
                return
            if self.drop_timer is not None:
                self.dropped += len(data)
                if self.dropped > max_body_bytes:
                    self._stop_dropping()
                    self.transport.close_now()  # past the body's limit, long after its answer: no lingering
                    return
            super().data_received(data)
            if self.transport.is_closing():  # answered and closed (a request that is not HTTP: send_400_response)
                return
            if self.drop_timer is not None and self.conn.declared > max_body_bytes:
                self._stop_dropping()  # the rest of an answered body declares more than a body may be: not waited on
                self.transport.close_now()
                return
            if self.drop_timer is not None and self.conn.their_state is not h11.SEND_BODY:
                self._stop_dropping()  # the answered request's body has all been read and dropped
            if self.cycle is not None and not self.cycle.response_complete and self.conn.declared > self.conn.came:
                declared = self.conn.declared
                if declared > self.cycle.scope.get("glmvit.body_declared", 0):
                    # A chunk's size line came ahead of its bytes: the body's reader (requests.read_body) learns
                    # what it declares now, and refuses a body over its limit without waiting for them.
                    self.cycle.scope["glmvit.body_declared"] = declared
                    self.cycle.message_event.set()
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # a request's headers are in (or the rest of an answered one's body is read and dropped)
            elif self.conn.trailing_data[0]:
                if self.headers_timer is None:
                    self._arm()  # a next request's headers are arriving: they have their deadline too
            elif self.conn.our_state is h11.IDLE and self.timeout_keep_alive_task is None:
                # The last of a body uvicorn read and dropped after its answer: the connection is idle, and closes
                # after uvicorn's keep-alive timeout as after any answer (uvicorn cancels that timer on each
                # piece of such a body and does not set it again).
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request that is not valid HTTP/1.1 (a malformed request line, header or
            chunk): a JSON 400 saying what h11 found wrong, and the connection closed. A request already
            answered (the rest of its body being dropped, its reply under way) can be told nothing more: its
            connection just closes (uvicorn's own answer there would raise h11's LocalProtocolError)."""
            if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
                self.transport.close_now()
                return
            why = str(self.conn.error or msg)[:300]
            advice = ("send one Transfer-Encoding header saying chunked alone (or a Content-Length), the body "
                      "uncompressed" if "Transfer-Encoding" in why else  # h11's "Only Transfer-Encoding: chunked ..."
                      "a chunk is its size in hexadecimal digits and CRLF, then that many bytes and CRLF; a chunk "
                      "of size 0 ends the body" if "chunk" in why else
                      "send a request line, headers and body framed as HTTP/1.1 frames them")
            if self.cycle is not None:  # an encode reading its body: counted with this answer, not as gone (499)
                self.cycle.scope["glmvit.answered"] = 400
            self.transport.write(raw("400 Bad Request", f"the request is not valid HTTP/1.1 ({why}): {advice}"))
            self.transport.close()

        def handle_events(self):
            super().handle_events()
            if self.cycle is not None:  # what the app's replies wait on (app.Releasing)
                # Here, not in data_received: a pipelined request's cycle begins in on_response_complete.
                self.cycle.scope["glmvit.transport"] = self.transport

        def on_response_complete(self):
            super().on_response_complete()
            self._watch_unsent()
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                # Answered before its body was read (/health, a 404, a refusal): uvicorn reads and drops the rest,
                # restarting its keep-alive timer on each piece, however slow or long. The rest may take what
                # a body may (--body-timeout, --max-body-mib), and the connection is then kept; past either,
                # it closes.
                self.dropped = 0
                self.drop_timer = self.loop.call_later(body_timeout, self._drop_late)

        def _drop_late(self):
            self.drop_timer = None
            if self.conn.their_state is h11.SEND_BODY:
                self.transport.close_now()

        def _close(self):
            """The connection closed after an answer (a 400, a 408, the app's refusal with Connection: close):
            at once where the client has sent all it meant to (a request read whole, an idle connection), else
            lingering: the answer sent and this side shut for writing (the client reads the answer, then the
            end of the stream), what the client still sends read and dropped until it closes, for at most
            linger_s seconds and linger_bytes bytes (then closed, or aborted where the answer is still unsent).
            Past max_connections lingering at once, closed at once."""
            conn, transport = self.conn, self.transport.transport
            if (conn.their_state not in (h11.SEND_BODY, h11.ERROR) and conn.error is None
                    and not conn.trailing_data[0]) or len(lingering) >= max_connections:
                transport.close()
                return
            self.transport.lingering = True
            lingering.add(self)
            self.connections.discard(self)  # holds no request: not one of the --max-connections, nor drained
            metrics.connections.set(len(self.connections))
            self._disarm()
            self._stop_dropping()
            self._unset_keepalive_if_required()
            self.linger_left = linger_bytes
            self.linger_timer = self.loop.call_later(linger_s, self._linger_end)
            transport.resume_reading()  # uvicorn pauses reading while a body's bytes wait for the app
            if transport.can_write_eof():  # once the answer in the buffer is out
                transport.write_eof()

        def _linger_end(self):
            self.linger_timer = None
            transport = self.transport.transport
            if transport.get_write_buffer_size() > 0:
                transport.abort()  # a client that neither reads its answer nor stops sending holds nothing more
            else:
                transport.close()

        def _stop_dropping(self):
            if self.drop_timer is not None:
                self.drop_timer.cancel()
                self.drop_timer = None

        def _arm(self):
            self.headers_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self):
            if self.headers_timer is not None:
                self.headers_timer.cancel()
                self.headers_timer = None

        def pause_writing(self):
            super().pause_writing()
            if self.reply_timer is None:
                self._watch_reply(None)

        def _watch_unsent(self):
            """A reply whose last bytes wait in the transport's buffer under its high-water mark (the kernel's
            send queue full, pause_writing never called) is watched as a paused one is: a client that never
            reads would otherwise hold it, and its room in --max-bodies-in-flight-mib, for good."""
            if self.reply_timer is None and self.transport.get_write_buffer_size() > 0:
                self._watch_reply(None)

        def _watch_reply(self, before):
            """Every reply_timeout seconds while anything is unsent: abort if the client took nothing since
            (what it took: the bytes written less those unsent, which new writes cannot make look smaller)."""
            self.reply_timer = None
            left = _unsent(self.transport)
            if left == 0:
                return
            taken = self.transport.written - left
            if before is not None and taken <= before:
                log(f"a client left its reply unread for {reply_timeout:g} s (--reply-timeout): connection closed, "
                    f"{left:,} bytes unsent")
                self.transport.abort()
                return
            self.reply_timer = self.loop.call_later(reply_timeout, self._watch_reply, taken)

        def _unarm_reply(self):
            if self.reply_timer is not None:
                self.reply_timer.cancel()
                self.reply_timer = None

        def _headers_late(self):
            self.headers_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no request's headers came
                self.transport.write(raw("408 Request Timeout", f"the request's headers did not arrive within "
                                         f"{header_timeout:g} s (--header-timeout)"))
                self.transport.close()

    return Protocol


def build_server(app, args, max_connections: int, backlog: int, ready: str | None, worker: bool = False):
    """uvicorn's Server for the app, on glmvit-serve's protocol (connection cap, header and reply deadlines),
    stopping in two steps on a signal (draining, then at once). ready: the line logged once the model is
    loaded (None: the engine process logs it). worker: an HTTP worker of --workers N, which drains on
    SIGTERM from the server process and leaves SIGINT and SIGHUP (a terminal's, the group's) to it."""
    import uvicorn

    state = app.state.glmvit
    state["log"] = log
    started = time.monotonic()

    class Server(uvicorn.Server):
        """Stops in two steps on SIGTERM, SIGHUP or SIGINT: draining (readiness and new requests 503, still accepting)
        until nothing is in flight or --drain-timeout passes, then uvicorn's own shutdown; a second signal
        stops at once. A model that fails to load stops it too."""
        draining_since = None
        failed = False
        ready = False

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's SIGINT and SIGTERM, and SIGHUP alike (a closed terminal or a supervisor's hang-up drains
            the server as SIGTERM does, instead of killing it mid-request), unless SIGHUP is ignored (nohup).
            A worker: DRAIN alone, from the server process."""
            if worker:
                old = signal.signal(DRAIN, self.handle_exit)
                try:
                    yield
                finally:
                    signal.signal(DRAIN, old)
                return
            hup = getattr(signal, "SIGHUP", None)
            if hup is None or threading.current_thread() is not threading.main_thread() \
                    or signal.getsignal(hup) is signal.SIG_IGN:  # nohup: a hang-up is to be ignored, and is
                with super().capture_signals():
                    yield
                return
            old = signal.signal(hup, self.handle_exit)
            try:
                with super().capture_signals():
                    yield
            finally:
                signal.signal(hup, old)

        def handle_exit(self, sig, frame):
            name = signal.Signals(sig).name
            if self.draining_since is None and not self.should_exit:
                self.draining_since = time.monotonic()
                if state["status"] != "failed":
                    state["status"] = "stopping"
                if worker:  # the server process has said so
                    return
                n = state["in_flight"]
                log(f"{name}: draining, {n} request{'' if n == 1 else 's'} in flight; /health and new requests get 503; "
                    f"exiting once they are answered, within {args.drain_timeout:g} s (a second signal: now)")
                return
            if not worker:
                log(f"{name} while stopping: stopping now, without waiting for requests in flight")
            self.should_exit = self.force_exit = True
            state.get("stop_now", lambda: None)()  # nor for the passes, if the shutdown already waits for them
            state["off_process"].shutdown()  # nor for a decode in another process

        async def on_tick(self, counter):
            if "gauges" in state:  # with HTTP workers /metrics reads every worker's gauges as last set
                state["gauges"]()
            if not self.ready and state["status"] == "ok":
                self.ready = True
                if ready is not None:
                    log(f"ready: {ready} (loaded in {time.monotonic() - started:.1f} s)")
            if not self.should_exit and state["status"] == "failed":
                if not worker:  # a worker's engine failed: the server process says why
                    log(f"the model failed to load: {state['error']}")
                self.failed = self.should_exit = True
            if self.draining_since is not None and not self.should_exit:
                # Done once every request is answered and every reply is out of our buffers (a handler returns
                # with its reply still being sent; the kernel sends what it holds after the process exits).
                idle = state["in_flight"] == 0 and not any(c.transport is not None and
                                                          c.transport.get_write_buffer_size() > 0
                                                          for c in self.server_state.connections)
                # A worker (state["released"] False until then) tells the engine process once it is idle, and
                # answers 503 until every worker is: one that stopped accepting sooner would drop the
                # connections it had just accepted from the socket they share.
                if idle and "drained" in state:
                    state.pop("drained")()
                if idle and state.get("released", True):
                    self.should_exit = True
                elif time.monotonic() - self.draining_since > args.drain_timeout:
                    if not idle:
                        log(f"{state['in_flight']} requests still in flight (or replies still being sent) after "
                            f"{args.drain_timeout:g} s (--drain-timeout): closing their connections")
                    self.should_exit = True
            return await super().on_tick(counter)

    # timeout_graceful_shutdown: once drained, the connections left have their answers; what has not ended
    # within it is cancelled.
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on",
                                   http=protocol(max_connections, args.header_timeout, app.state.metrics,
                                                 args.reply_timeout, args.body_timeout,
                                                 int(args.max_body_mib * (1 << 20))),
                                   backlog=backlog, timeout_graceful_shutdown=2))
    # uvicorn logs "ERROR: Cancel N running task(s), timeout graceful shutdown exceeded" when it cancels the
    # requests the drain gave up on: the drain's own line has said so already, and nothing failed.
    logging.getLogger("uvicorn.error").addFilter(lambda record: not record.getMessage().startswith("Cancel "))
    logging.getLogger("uvicorn.error").addFilter(Sparse("Invalid HTTP request"))
    return server


class Sparse(logging.Filter):
    """Lets a message starting with `prefix` through once every `every` seconds, counting those held back in the
    next: uvicorn logs "Invalid HTTP request received." for each malformed request, as often as clients send
    them (150 such clients wrote 1,300 lines in 30 s)."""

    def __init__(self, prefix: str, every: float = 10.0):
        super().__init__()
        self.prefix, self.every, self.next, self.held = prefix, every, 0.0, 0

    def filter(self, record) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        now = time.monotonic()
        if now < self.next:
            self.held += 1
            return False
        if self.held:
            record.msg, record.args = f"{record.getMessage()} (and {self.held} more since the last such line)", ()
        self.held, self.next = 0, now + self.every
        return True
