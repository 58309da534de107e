"""glmvit-serve: the GLM-5.3-Flash vision tower as an HTTP service. The HTTP contract, every status code, the
metrics and the client: docs/SERVING.md.

    glmvit-serve --checkpoint /models/GLM-5.3-Flash --port 8000
    glmvit-serve --checkpoint tests/golden/tower --cpu            # the float32 reference, no GPU

SIGTERM, SIGHUP (unless ignored: nohup) or Ctrl-C: drain (/health and new requests get 503 while what is in flight finishes, at most
--drain-timeout seconds), let the forward pass running end, then exit 0; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
import threading
import time
import warnings

from .. import __version__

MAX_CONNECTIONS = 512
MAX_WORKERS = 256
BACKLOG = 2048  # connections the kernel holds for accepting (uvicorn's default)
FILES_BESIDE_CONNECTIONS = 128  # descriptors the process holds besides its connections (files, pipes, threads)


EXIT_STATUS = """exit status:
  0  stopped by SIGTERM, SIGHUP or Ctrl-C (after the drain, or at once on a second signal)
  1  the model failed to load after the start (NaN weights, say): logged with the reason
  2  a flag out of range, a checkpoint that fails its checks, no usable GPU without --cpu, --cpu with
     --devices, a --vllm-ec-dir that cannot be written, an open-file limit too low for --max-connections,
     the serve extra not installed, or no folder for the HTTP workers' socket to the engine
  3  the address cannot be listened on (the port in use, say)
  130  Ctrl-C while starting"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glmvit-serve", description=__doc__, epilog=EXIT_STATUS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder, shard or index, or Hub id (org/name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    ap.add_argument("--cpu", action="store_true", help="use the float32 NumPy reference (slow; no GPU needed)")
    ap.add_argument("--devices", default=None, metavar="0,1,...", help="CUDA devices, one replica each")
    ap.add_argument("--capacity-tokens", type=int, default=8000, help="tokens per forward pass (default 8000)")
    # 1 ms: small images 669 / 669 images/s against 636 / 645 at 5 ms, p99 38 / 58 ms against 92 / 63
    # (benchmarks/bench_serve.py --small --max-wait-ms, H100); large ones 95.8 against 93.7.
    ap.add_argument("--max-wait-ms", type=float, default=1.0,
                    help="the longest an image waits, from its arrival, for others to share its forward pass "
                    "while the GPU is idle (default 1)")
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
    ap.add_argument("--workers", type=int, default=None, metavar="N",
                    help="HTTP worker processes (default: half the CPUs, at most 8, on the GPU; 1 with --cpu). With "
                         "N > 1 the workers answer HTTP, decode and reply on N cores, and this process only runs the "
                         "engine; with 1, one process does both. Each worker holds its own "
                         "--max-queue, --max-connections and --decode-workers; --max-pixels-in-flight and "
                         "--max-bodies-in-flight-mib hold for the whole server, and --cache-mib is shared out "
                         "between the workers")
    ap.add_argument("--vllm-ec-dir", default=None, metavar="DIR",
                    help="also write each embedding as DIR/<key>/encoder_cache.safetensors for vLLM (the key: the "
                         "image's sha256, with its token limits where they are not the defaults; docs/SERVING.md)")
    return ap


def check_settings(args) -> str | None:
    """What is wrong with the numeric flags, or None."""
    for flag, value in (("--capacity-tokens", args.capacity_tokens), ("--max-queue", args.max_queue),
                        ("--decode-workers", args.decode_workers), ("--workers", 1 if args.workers is None else args.workers), ("--max-video-pixels", args.max_video_pixels),
                        ("--max-pixels-in-flight", args.max_pixels_in_flight),
                        ("--max-connections", 1 if args.max_connections is None else args.max_connections)):
        if value < 1:
            return f"{flag} {value} must be at least 1"
    if args.workers is not None and args.workers > MAX_WORKERS:
        return (f"--workers {args.workers} is more HTTP worker processes than {MAX_WORKERS}: each is a process of "
                "its own; a few per GPU's worth of host work is enough (the default: half the CPUs, at most 8)")
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
        if flag.endswith("-mib") and value < 1 / 1024:  # bytes are counted whole: 1e-9 MiB is 0 bytes
            return f"{flag} {value:g} must be at least 1/1024 (1 KiB)"
    for flag, most, what in (("--max-body-mib", args.max_body_mib, "body"), ("--max-reply-mib", args.max_reply_mib,
                                                                                "reply")):
        if args.max_bodies_in_flight_mib < most:
            return (f"--max-bodies-in-flight-mib {args.max_bodies_in_flight_mib:g} is below the {most:g} MiB one {what} "
                    f"may have ({flag}): such a {what} could never be held; raise it to at least {most:g}")
    if args.vllm_ec_dir is not None and not args.vllm_ec_dir.strip():
        return "--vllm-ec-dir is empty (an unset variable?): give a folder, or leave the flag out"
    return None


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one) and listening, or OSError: a client that connects
    while the server starts waits in the backlog for uvicorn to accept it, not refused."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
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


def say(message: str) -> None:
    """One line on stderr, its file names and errors escaped (output.shown): a control character in a shard's
    or folder's name would forge a line or drive the terminal."""
    from ..output import shown

    print(f"glmvit-serve: {shown(message)}", file=sys.stderr)


def main(argv=None) -> int:
    try:
        return serve(argv)
    except KeyboardInterrupt:  # Ctrl-C while it imports, loads or binds: before the server's own handlers
        print("\nglmvit-serve: interrupted while starting (exit 130)", file=sys.stderr)
        return 130


def serve(argv) -> int:
    """The command; its exit status."""
    args = parser().parse_args(argv)
    try:
        import uvicorn  # noqa: F401 - the serve extra, checked before anything starts
    except ImportError as e:
        say(f"the serve extra is not installed ({e}): pip install -e '.[serve]' in the glmvit-cupy "
            "checkout")
        return 2
    from .. import gpu, vllm_ec
    from ..backend import Backend
    from ..checkpoint.bind import bind_tower
    from ..checks import DEFAULT_MAX_IMAGE_TOKENS, device_list
    from ..errors import CheckpointError, OutputError
    from ..output import shown
    from ..preprocessing.image import Patching
    from .app import Settings, create_app
    from .http_server import build_server, log
    from .requests import default_limits

    why = check_settings(args)
    if why:  # the operator's mistake, said at start: not a 422 blaming every client later
        say(why)
        return 2
    if args.cpu and args.devices:
        print("glmvit-serve: --cpu serves the float32 reference on the host, without a GPU: leave out --devices",
              file=sys.stderr)
        return 2
    try:
        devices = device_list(args.devices) if args.devices else None
        binding = bind_tower(args.checkpoint)
        patching = Patching.of(binding.geometry)  # the server takes images: a tower of RGB patches
    except (CheckpointError, argparse.ArgumentTypeError, ValueError) as e:
        say(str(e))
        return 2
    lo = default_limits(args.capacity_tokens)[0]
    least = lo * patching.factor ** 2  # every image's canvas under the default limits holds at least this
    if args.max_pixels_in_flight < least:
        say(f"--max-pixels-in-flight {args.max_pixels_in_flight:,} is below the {least:,} pixels of "
            f"the smallest canvas ({lo} tokens, a request's default min_image_tokens): no image could be served; "
            f"raise it to at least {least:,}")
        return 2
    why = None if args.cpu else gpu.problem()
    if why:  # the hint names this command's own way to run without a GPU
        why = why.replace(gpu.CPU_HINT, "glmvit-serve --cpu serves the float32 reference on the CPU without any of it")
        say(f"cannot use the GPU: {why}")
        return 2
    if args.vllm_ec_dir:
        try:
            vllm_ec.check_folder(args.vllm_ec_dir)  # a wrong folder stops the start, not every request after it
        except OutputError as e:
            say(str(e))
            return 2
    max_connections, backlog, why = open_files_for(args.max_connections)
    if why:
        say(why)
        return 2
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address, as a URL writes it
    try:
        sock = listen(args.host, args.port, backlog)
    except socket.gaierror as e:
        say(f"cannot listen on --host {args.host} ({e.strerror or e}): give an address or a name "
            "this machine resolves (127.0.0.1, 0.0.0.0, ::)")
        return 3
    except OSError as e:  # before the model loads: nothing to undo
        say(f"cannot listen on {host}:{args.port} ({e.strerror or e}): choose another --port "
            "(0: any free one) or --host")
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

    # Pillow warns about corrupt EXIF or metadata in a client's image (UserWarning, a new line per request):
    # a client could fill the log with them. The image is decoded or refused (422) either way.
    warnings.filterwarnings("ignore", module=r"PIL\.")
    print(f"glmvit-serve: {shown(binding.path)} on http://{host}:{port} "
          f"({'cpu, float32 reference' if args.cpu else 'gpu'}; /health says when it is loaded)", flush=True)
    if args.workers is None:  # one process is bound by the interpreter lock near one core of host work
        args.workers = 1 if args.cpu else max(1, min(8, (os.cpu_count() or 1) // 2))
    if args.workers > 1:
        from .workers import run_with_workers

        return run_with_workers(args, sock, settings, load_backend, max_connections, backlog,
                                f"serving on http://{host}:{port}", log)
    app = create_app(load_backend, settings)
    state = app.state.glmvit
    server = build_server(app, args, max_connections, backlog, ready=f"serving on http://{host}:{port}")
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
    # The decoding and parsing pools were shut down without waiting: their idle threads end at once, and one
    # still decoding works for a request the drain gave up on. The interpreter would wait for it, after
    # "stopped" was said.
    deadline = time.monotonic() + 0.5
    for t in threading.enumerate():
        if not t.daemon and t.name.startswith(("glmvit-decode", "glmvit-parse")):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                running.append(t.name)
    state["off_process"].shutdown()  # its decoding processes, if any, end with the server
    if running:
        log(f"stopped (exit {code}), not waiting for the work still running (threads {', '.join(running)})")
        sys.stdout.flush()
        os._exit(code)
    log(f"stopped (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
