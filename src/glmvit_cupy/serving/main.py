"""glmvit-serve: the GLM-5.3-Flash vision tower as an HTTP service. The HTTP contract, every status code, the
metrics and the client: docs/SERVING.md.

    glmvit-serve --checkpoint /models/GLM-5.3-Flash --port 8000
    glmvit-serve --checkpoint tests/golden/tower --cpu            # the float32 reference, no GPU

SIGTERM, SIGHUP (unless ignored: nohup) or Ctrl-C: drain (/health and new requests get 503 while what is in flight finishes, at most
--drain-timeout seconds), let the forward pass running end, then exit 0; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import socket
import struct
import sys
import threading
import time
import warnings

MAX_CONNECTIONS = 512
BACKLOG = 2048  # connections the kernel holds for accepting (uvicorn's default)
FILES_BESIDE_CONNECTIONS = 128  # descriptors the process holds besides its connections (files, pipes, threads)


EXIT_STATUS = """exit status:
  0  stopped by SIGTERM, SIGHUP or Ctrl-C (after the drain, or at once on a second signal)
  1  the model failed to load after the start (NaN weights, say): logged with the reason
  2  a flag out of range, a checkpoint that fails its checks, no usable GPU without --cpu, --cpu with
     --devices, a --vllm-ec-dir that cannot be written, an open-file limit too low for --max-connections,
     or the serve extra not installed
  3  the address cannot be listened on (the port in use, say)"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glmvit-serve", description=__doc__, epilog=EXIT_STATUS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder, shard or index, or Hub id (org/name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    ap.add_argument("--cpu", action="store_true", help="use the float32 NumPy reference (slow; no GPU needed)")
    ap.add_argument("--devices", default=None, metavar="0,1,...", help="CUDA devices, one replica each")
    ap.add_argument("--capacity-tokens", type=int, default=8000, help="tokens per forward pass (default 8000)")
    ap.add_argument("--max-wait-ms", type=float, default=5.0,
                    help="the longest an image waits, from its arrival, for others to share its forward pass "
                    "while the GPU is idle (default 5)")
    ap.add_argument("--cache-mib", type=float, default=1024.0,
                    help="memory for finished embeddings, by content hash (default 1024; 0: no cache)")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="images admitted and waiting for a forward pass (default 256); a request with more gets 413, "
                         "one that does not fit the room left 429")
    ap.add_argument("--max-body-mib", type=float, default=256.0, help="largest request body (default 256)")
    ap.add_argument("--max-bodies-in-flight-mib", type=float, default=1024.0,
                    help="request and reply bodies held at once, server-wide: a request's from its arrival until it "
                         "is answered, a reply's until it is sent (default 1024); one that does not fit now gets "
                         "429. At least --max-body-mib and --max-reply-mib")
    ap.add_argument("--max-image-mib", type=float, default=64.0, help="largest image file (default 64)")
    ap.add_argument("--max-reply-mib", type=float, default=1024.0,
                    help="largest reply: the embeddings of one request, repeats included (default 1024); more: 413")
    ap.add_argument("--max-pixels", type=int, default=None,
                    help="largest image (or video frame) to decode, in pixels, read from its header (default: "
                         "Pillow's guard, 89,478,485); more: 422")
    ap.add_argument("--max-video-pixels", type=int, default=2**32,
                    help="a video's sampled frames' pixels together (default 2^32); only "
                         "sampled frames are decoded")
    ap.add_argument("--max-pixels-in-flight", type=int, default=2**28,
                    help="pixels of images and videos admitted and not yet through their forward passes, server-wide "
                         "(default 2^28 = 268,435,456, about 1 GiB decoded); a request that needs more gets 413, one "
                         "that needs more than is free now 429")
    ap.add_argument("--max-connections", type=int, default=None,
                    help=f"HTTP connections open at once; more are answered 503 and closed (default {MAX_CONNECTIONS}, "
                         "fewer where the open-file limit, ulimit -n, is lower)")
    ap.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a request's headers may take to arrive; then 408 and the connection closes "
                         "(default 10)")
    ap.add_argument("--body-timeout", type=float, default=60.0,
                    help="seconds a request's body may take to arrive after its headers; then 408 (default 60)")
    ap.add_argument("--reply-timeout", type=float, default=60.0,
                    help="seconds a client may leave its reply unread (the server's send buffer full); then the "
                         "connection closes and the reply's memory is let go (default 60)")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds to wait for requests in flight before closing their connections "
                         "(default 30)")
    ap.add_argument("--decode-workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads decoding and resizing images (default: min(8, CPUs))")
    ap.add_argument("--vllm-ec-dir", default=None, metavar="DIR",
                    help="also write each embedding as DIR/<key>/encoder_cache.safetensors for vLLM (the key: the "
                         "image's sha256, with its token limits where they are not the defaults; docs/SERVING.md)")
    return ap


def check_settings(args) -> str | None:
    """What is wrong with the numeric flags, or None."""
    for flag, value in (("--capacity-tokens", args.capacity_tokens), ("--max-queue", args.max_queue),
                        ("--decode-workers", args.decode_workers), ("--max-video-pixels", args.max_video_pixels),
                        ("--max-pixels-in-flight", args.max_pixels_in_flight),
                        ("--max-connections", 1 if args.max_connections is None else args.max_connections)):
        if value < 1:
            return f"{flag} {value} must be at least 1"
    if args.max_pixels is not None and args.max_pixels < 1:
        return (f"--max-pixels {args.max_pixels} must be at least 1 (pixels an image may have before it is refused "
                "as a decompression bomb); leave it out for Pillow's own limit")
    from PIL import Image

    one = args.max_pixels if args.max_pixels is not None else Image.MAX_IMAGE_PIXELS
    if args.max_pixels_in_flight < one:
        return (f"--max-pixels-in-flight {args.max_pixels_in_flight:,} is below the {one:,} pixels one image may "
                f"have (--max-pixels): such an image could never be decoded; raise it to at least {one:,}")
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is not a TCP port: 0..65535 (0: any free port)"
    for flag, value, least in (("--max-wait-ms", args.max_wait_ms, 0.0), ("--cache-mib", args.cache_mib, 0.0)):
        if not (math.isfinite(value) and value >= least):
            return f"{flag} {value:g} must be a finite number of at least {least:g}"
    for flag, value in (("--max-body-mib", args.max_body_mib), ("--max-image-mib", args.max_image_mib),
                        ("--max-bodies-in-flight-mib", args.max_bodies_in_flight_mib),
                        ("--max-reply-mib", args.max_reply_mib),
                        ("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--reply-timeout", args.reply_timeout),
                        ("--drain-timeout", args.drain_timeout)):
        if not (math.isfinite(value) and value > 0):
            return f"{flag} {value:g} must be a finite number above 0"
    for flag, most, what in (("--max-body-mib", args.max_body_mib, "body"), ("--max-reply-mib", args.max_reply_mib,
                                                                                "reply")):
        if args.max_bodies_in_flight_mib < most:
            return (f"--max-bodies-in-flight-mib {args.max_bodies_in_flight_mib:g} is below the {most:g} MiB one {what} "
                    f"may have ({flag}): such a {what} could never be held; raise it to at least {most:g}")
    return None


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), or OSError; uvicorn listens on it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def open_files_for(max_connections: int | None) -> tuple[int, int, str | None]:
    """(the connection cap, the listening backlog, or what is wrong). Each connection is a descriptor, and up to
    a backlog of them are accepted at once before the cap closes the extra ones: the open-file limit is raised,
    where it is lower, to the cap + the backlog + FILES_BESIDE_CONNECTIONS; where the hard limit does not allow
    that, the backlog is shortened (not below 128), then the default cap lowered."""
    try:
        import resource
    except ImportError:  # not a Unix: no limit to read
        return max_connections or MAX_CONNECTIONS, BACKLOG, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = hard if hard != resource.RLIM_INFINITY else 1 << 20
    cap = max_connections or MAX_CONNECTIONS
    spare = room - FILES_BESIDE_CONNECTIONS - 128
    if cap > spare:
        if max_connections is not None or spare < 1:
            return cap, 0, (f"--max-connections {cap} needs about {cap + 128 + FILES_BESIDE_CONNECTIONS} open files, "
                            f"and this process may open {room} (ulimit -n): lower --max-connections to at most "
                            f"{max(0, spare)}, or raise the limit")
        cap = spare
    backlog = min(BACKLOG, room - FILES_BESIDE_CONNECTIONS - cap)
    need = cap + backlog + FILES_BESIDE_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return cap, backlog, None


def log(message: str) -> None:
    """One line on stderr, written whole: a signal's handler logs too, and print's separate writes of the
    text and its newline let a second signal's line land between them."""
    sys.stderr.write(f"glmvit-serve: {message}\n")
    sys.stderr.flush()


class _Counted:
    """A connection's transport whose write() counts the bytes written: those written less those unsent are what
    the client took. A wrapper, since uvloop's transports (uvicorn's loop where uvloop is installed) do not let
    write be replaced; every other attribute is the transport's own."""

    __slots__ = ("transport", "written")

    def __init__(self, transport):
        self.transport, self.written = transport, 0

    def write(self, data) -> None:
        self.written += len(data)
        self.transport.write(data)

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


def protocol(max_connections: int, header_timeout: float, metrics, reply_timeout: float = 60.0):
    """uvicorn's h11 protocol with a cap on connections (one over it is answered 503 and closed at once), a
    deadline for each request's headers (408 and closed: uvicorn itself waits for them without end), and
    one for a reply the client stops reading: once writing pauses (the transport's buffer over its
    high-water mark), a connection whose client took nothing more for reply_timeout seconds (bytes
    written less _unsent) is aborted, which lets its reply go (a client that never reads would otherwise hold it, up to --max-reply-mib, for as long as it
    stays connected, even past a close, which waits for the buffer to drain). A slow reader makes
    progress and keeps its connection."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def raw(status: str, error: str) -> bytes:
        body = json.dumps({"error": error, "index": None}).encode()
        return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body

    class Protocol(H11Protocol):
        refused = False
        headers_timer = None
        reply_timer = None

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
            self.transport = _Counted(transport)  # what the request cycles and the app's replies write through

        def connection_lost(self, exc):
            if self.refused:
                return
            self._disarm()
            self._unarm_reply()
            super().connection_lost(exc)
            metrics.connections.set(len(self.connections))

        def data_received(self, data):
            super().data_received(data)
            if self.cycle is not None:  # what the app's replies wait on (app.Releasing)
                self.cycle.scope["glmvit.transport"] = self.transport
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


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError as e:
        print(f"glmvit-serve: the serve extra is not installed ({e}): pip install -e '.[serve]' in the glmvit-cupy "
              "checkout", file=sys.stderr)
        return 2
    from .. import gpu, vllm_ec
    from ..backend import Backend
    from ..checkpoint.bind import bind_tower
    from ..checks import DEFAULT_MAX_IMAGE_TOKENS, device_list
    from ..errors import CheckpointError, OutputError
    from ..preprocessing.image import Patching
    from .app import Settings, create_app

    why = check_settings(args)
    if why:  # the operator's mistake, said at start: not a 422 blaming every client later
        print(f"glmvit-serve: {why}", file=sys.stderr)
        return 2
    if args.cpu and args.devices:
        print("glmvit-serve: --cpu serves the float32 reference on the host, without a GPU: leave out --devices",
              file=sys.stderr)
        return 2
    try:
        devices = device_list(args.devices) if args.devices else None
        binding = bind_tower(args.checkpoint)
        Patching.of(binding.geometry)  # the server takes images: a tower of RGB patches
    except (CheckpointError, argparse.ArgumentTypeError, ValueError) as e:
        print(f"glmvit-serve: {e}", file=sys.stderr)
        return 2
    why = None if args.cpu else gpu.problem()
    if why:  # the hint names this command's own way to run without a GPU
        why = why.replace(gpu.CPU_HINT, "glmvit-serve --cpu serves the float32 reference on the CPU without any of it")
        print(f"glmvit-serve: cannot use the GPU: {why}", file=sys.stderr)
        return 2
    if args.vllm_ec_dir:
        try:
            vllm_ec.check_folder(args.vllm_ec_dir)  # a wrong folder stops the start, not every request after it
        except OutputError as e:
            print(f"glmvit-serve: {e}", file=sys.stderr)
            return 2
    max_connections, backlog, why = open_files_for(args.max_connections)
    if why:
        print(f"glmvit-serve: {why}", file=sys.stderr)
        return 2
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address, as a URL writes it
    try:
        sock = listen(args.host, args.port)
    except socket.gaierror as e:
        print(f"glmvit-serve: cannot listen on --host {args.host} ({e.strerror or e}): give an address or a name "
              "this machine resolves (127.0.0.1, 0.0.0.0, ::)", file=sys.stderr)
        return 3
    except OSError as e:  # before the model loads: nothing to undo
        print(f"glmvit-serve: cannot listen on {host}:{args.port} ({e.strerror or e}): choose another --port "
              "(0: any free one) or --host", file=sys.stderr)
        return 3
    port = sock.getsockname()[1]
    settings = Settings(checkpoint=os.path.abspath(binding.path), capacity_tokens=args.capacity_tokens,
                        max_wait_ms=args.max_wait_ms, cache_mib=args.cache_mib, max_queue=args.max_queue,
                        max_body_mib=args.max_body_mib, max_image_mib=args.max_image_mib,
                        max_bodies_in_flight_mib=args.max_bodies_in_flight_mib,
                        max_reply_mib=args.max_reply_mib, max_pixels=args.max_pixels,
                        max_video_pixels=args.max_video_pixels, max_pixels_in_flight=args.max_pixels_in_flight,
                        body_timeout=args.body_timeout, decode_workers=args.decode_workers,
                        vllm_ec_dir=args.vllm_ec_dir)
    # Graphs for every pass the service can form from images of >= 64 tokens are captured at load
    # (GlmVit.precapture(every_budget=True)): none is captured while requests wait.
    def load_backend():
        if args.vllm_ec_dir:  # the tower's fingerprint goes into each vLLM file (vllm_ec.write); read at load
            settings.weights = binding.fingerprint
        return Backend(binding, cpu=args.cpu, devices=devices, capacity_tokens=args.capacity_tokens,
                       max_image_tokens=DEFAULT_MAX_IMAGE_TOKENS, every_budget=True)

    app = create_app(load_backend, settings)
    state = app.state.glmvit

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
            the server as SIGTERM does, instead of killing it mid-request), unless SIGHUP is ignored (nohup)."""
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
                log(f"{name}: draining, {state['in_flight']} requests in flight; /health and new requests get 503; "
                    f"exiting once they are answered, within {args.drain_timeout:g} s (a second signal: now)")
                return
            log(f"{name} while stopping: stopping now, without waiting for requests in flight")
            self.should_exit = self.force_exit = True
            state.get("stop_now", lambda: None)()  # nor for the passes, if the shutdown already waits for them
            state["off_process"].shutdown()  # nor for a decode in another process

        async def on_tick(self, counter):
            if not self.ready and state["status"] == "ok":
                self.ready = True
                log(f"ready: serving on http://{host}:{port} (loaded in {time.monotonic() - started:.1f} s)")
            if not self.should_exit and state["status"] == "failed":
                log(f"the model failed to load: {state['error']}")
                self.failed = self.should_exit = True
            if self.draining_since is not None and not self.should_exit:
                # Done once every request is answered and every reply is out of our buffers (a handler returns
                # with its reply still being sent; the kernel sends what it holds after the process exits).
                if state["in_flight"] == 0 and not any(c.transport is not None and
                                                       c.transport.get_write_buffer_size() > 0
                                                       for c in self.server_state.connections):
                    self.should_exit = True
                elif time.monotonic() - self.draining_since > args.drain_timeout:
                    log(f"{state['in_flight']} requests still in flight (or replies still being sent) after "
                        f"{args.drain_timeout:g} s (--drain-timeout): closing their connections")
                    self.should_exit = True
            return await super().on_tick(counter)

    # Pillow warns about corrupt EXIF or metadata in a client's image (UserWarning, a new line per request):
    # a client could fill the log with them. The image is decoded or refused (422) either way.
    warnings.filterwarnings("ignore", module=r"PIL\.")
    print(f"glmvit-serve: {binding.path} on http://{host}:{port} "
          f"({'cpu, float32 reference' if args.cpu else 'gpu'}; /health says when it is loaded)", flush=True)
    # timeout_graceful_shutdown: once drained, the connections left have their answers; what has not ended
    # within it is cancelled.
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on",
                                   http=protocol(max_connections, args.header_timeout, app.state.metrics,
                                                 args.reply_timeout),
                                   backlog=backlog, timeout_graceful_shutdown=2))
    # uvicorn logs "ERROR: Cancel N running task(s), timeout graceful shutdown exceeded" when it cancels the
    # requests the drain gave up on: the drain's own line has said so already, and nothing failed.
    logging.getLogger("uvicorn.error").addFilter(lambda record: not record.getMessage().startswith("Cancel "))
    state["log"] = log
    started = time.monotonic()
    server.run(sockets=[sock])
    code = 1 if server.failed else 0
    # The interpreter may still wait for a parsing or decoding thread's job; a signal meanwhile ends the
    # process at once with this status (uvicorn has put back the default handlers: 143, or a traceback).
    for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda *_: os._exit(code))
    # After a second signal, threads may still be running a forward pass or loading the model: the
    # interpreter's shutdown under them can crash the process (exit 139), so it exits without one.
    running = sorted(t.name for t in threading.enumerate() if t.daemon and t.is_alive() and
                     t.name.startswith("glmvit-"))
    state["off_process"].shutdown()  # its decoding processes, if any, end with the server
    if running:
        log(f"stopped (exit {code}), not waiting for the work still running (threads {', '.join(running)})")
        sys.stdout.flush()
        os._exit(code)
    log(f"stopped (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
