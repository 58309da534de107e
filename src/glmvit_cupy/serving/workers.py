"""glmvit-serve --workers N: N HTTP worker processes on one listening socket, and this process as the
engine (engine_server.py). A worker answers HTTP, hashes, decodes and caches, and makes the replies, as
the one-process server does (app.py); the tower, its passes and its threads live here alone. One process
serving both is bound by the interpreter lock near one core of host work an image; with workers, that
work spreads over their cores and the engine's thread only packs, launches and hands back.

Signals go to this process: SIGTERM, SIGHUP or Ctrl-C drain every worker (each answers what it holds, at
most --drain-timeout), then the engine stops; a second signal stops the workers at once. A worker that
ends on its own (killed, out of memory) is replaced; its queued images are dropped from the passes.
Each worker holds its own --max-queue, --max-pixels-in-flight, --max-bodies-in-flight-mib and
--max-connections; the cache's --cache-mib is shared out between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings

from . import shares, wire
from .http_server import DRAIN
from .metrics import multiprocess_into


def run_with_workers(args, sock, settings, load_backend, max_connections: int, backlog: int, where: str,
                     log) -> int:
    """Serve on `sock` with args.workers HTTP workers until a signal, or the model fails to load; the exit
    status. load_backend(): the Backend, loaded here."""
    def say(message: str) -> None:  # a closed stderr (a pipe's reader gone) must not stop the supervision
        with contextlib.suppress(OSError, ValueError):
            log(message)

    folder = _folder()
    try:
        os.mkdir(os.path.join(folder, "metrics"))
        multiprocess_into(os.path.join(folder, "metrics"))
        code, now = asyncio.run(_serve(args, sock, settings, load_backend, max_connections, backlog, where, say,
                                       folder))
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    # After a second signal, or with the model still loading, threads may still run a forward pass or the
    # load: the interpreter's shutdown under them can crash the process (exit 139), so it exits without one.
    if now or any(t.daemon and t.is_alive() and t.name.startswith("glmvit-") for t in threading.enumerate()):
        sys.stdout.flush()
        os._exit(code)
    return code


PREFIX = "glmvit-serve-"
OWNER = "owner.pid"  # the serving process's id, in its folder


def _folder() -> str:
    """A new folder of this user's alone for the engine's socket and the metrics: in the temporary folder
    (TMPDIR), or where that is too deep for a Unix socket's name (107 bytes), the first of /tmp, /var/tmp
    and /dev/shm that takes one. Folders a killed server left there are removed first (sweep)."""
    sweep(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=PREFIX)
    if len(os.path.join(folder, "engine.sock")) > 100:
        for base in ("/tmp", "/var/tmp", "/dev/shm"):
            try:
                sweep(base)
                short = tempfile.mkdtemp(prefix=PREFIX, dir=base)
            except OSError:
                continue
            os.rmdir(folder)
            folder = short
            break
        # else: the socket's start says what is wrong
    try:
        with open(os.path.join(folder, OWNER), "w") as f:
            f.write(f"{os.getpid()} {_namespace()}")
    except OSError:  # a full disk, say: the folder goes, and the socket's start says what is wrong
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def sweep(base: str) -> list[str]:
    """Remove the folders under `base` that a glmvit-serve of this user left behind when it was killed
    (SIGKILL, out of memory: its own cleanup never ran): those whose owner process no longer exists. A
    folder without an owner file (being made right now), of a process that lives or of another PID
    namespace is kept. Returns the folders removed."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            with open(os.path.join(entry.path, OWNER)) as f:
                pid, space = f.read(64).split(" ", 1)
                pid = int(pid)
        except (OSError, ValueError):
            continue
        if pid <= 0 or space != _namespace() or _alive(pid):
            continue  # a process of another host or PID namespace (sharing the folder) is not ours to judge
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _namespace() -> str:
    """Where this process's ids mean something: its host and PID namespace (Linux; the first namespace has
    the same number on every host, so a temporary folder shared between hosts needs the name too)."""
    try:
        space = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        space = ""
    return f"{socket.gethostname()}:{space}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # another user's process, or no pid at all: not ours to remove
        return True
    return True


async def _serve(args, sock, settings, load_backend, max_connections, backlog, where, log, folder):
    """(exit status, whether to exit at once) once the server has stopped."""
    from prometheus_client import multiprocess

    from .engine_server import EngineServer
    from .metrics import Metrics

    loop = asyncio.get_running_loop()
    started = time.monotonic()
    # The workers bound what they admit (--max-queue each): the engine's own queue takes all they send.
    engine = EngineServer(load_backend, capacity_tokens=args.capacity_tokens, max_wait_ms=args.max_wait_ms,
                          max_queue=1 << 40, metrics=Metrics(), fingerprint=lambda: settings.weights, log=log)
    path = os.path.join(folder, "engine.sock")
    try:
        unix = await loop.create_unix_server(lambda: wire.Link(engine.worker), path)
    except OSError as e:  # a path over the 107 bytes a Unix socket's name may have, say
        log(f"cannot open the engine's socket {path} ({e.strerror or e}): set TMPDIR to a short folder this "
            "user can write, or serve with --workers 1")
        return 2, False
    engine.start_loading()
    settings.cache_mib = args.cache_mib / args.workers
    settings.shares = os.path.join(folder, "shares")  # the pixels and bodies in flight, held server-wide
    shares.create(settings.shares, args.workers)
    context = multiprocessing.get_context("spawn")
    spawned: dict = {}  # worker slot -> when its process was last started

    def spawn(i: int):
        p = context.Process(target=worker_main, name=f"glmvit-serve-worker-{i}",
                            args=(sock, path, args, dataclasses.replace(settings, slot=i), max_connections, backlog,
                                  os.getpid()))
        p.start()
        spawned[i] = time.monotonic()
        return p

    workers = [spawn(i) for i in range(args.workers)]
    signals = {"count": 0, "name": None}
    wake = asyncio.Event()

    def on_signal(sig):
        signals["count"] += 1
        signals["name"] = signal.Signals(sig).name
        wake.set()

    for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # nohup: a hang-up stays ignored
            loop.add_signal_handler(sig, on_signal, sig)

    def tell_workers():
        for p in workers:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, DRAIN)

    code, announced, told, forced, early, replaced = 0, False, 0, False, 0, set()
    drain_ends = None  # when the workers' drain must be over, whatever they do: then they are killed
    try:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), 0.1)
            wake.clear()
            if engine.state == "failed" and code == 0:
                log(f"the model failed to load: {engine.error}")
                code, told = 1, 1  # the workers stop on their own: their engine failed
                signals["count"] = max(signals["count"], 1)
                drain_ends = time.monotonic() + args.drain_timeout + 5.0
            if engine.state == "ok" and not announced and engine.workers >= args.workers:
                announced = True
                log(f"ready: {where} with {args.workers} HTTP workers (loaded in {time.monotonic() - started:.1f} s)")
            if signals["count"] > told:
                if told == 0:
                    log(f"{signals['name']}: draining the {args.workers} HTTP workers; /health and new requests "
                        f"get 503; exiting once they have answered, within {args.drain_timeout:g} s (a second "
                        "signal: now)")
                else:
                    log(f"{signals['name']} while stopping: stopping now, without waiting for requests in flight")
                    forced = True
                told = signals["count"]
                tell_workers()
                # Each worker ends its own drain within --drain-timeout and its connections 2 s later; one that
                # does not (stopped, wedged) is killed, so that the server exits within the time it said.
                drain_ends = drain_ends or time.monotonic() + args.drain_timeout + 5.0
                if forced:
                    deadline = time.monotonic() + 2.0
                    while any(p.is_alive() for p in workers) and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                    break
            for i, p in enumerate(workers):
                if p.exitcode is None or told:
                    continue
                early += p.pid not in engine.started
                if early >= 3:  # three in a row: workers cannot start, and more would not either
                    log(f"{early} HTTP workers ended before they reached the engine (the last: {_ended(p)}): "
                        "stopping")
                    code, told = 1, 1
                    signals["count"] = max(signals["count"], 1)
                    drain_ends = time.monotonic() + args.drain_timeout + 5.0
                    tell_workers()
                elif time.monotonic() - spawned[i] >= 1.0:  # at most one start a second a slot
                    log(f"HTTP worker {p.pid} ended ({_ended(p)}): starting another")
                    multiprocess.mark_process_dead(p.pid)
                    shares.clear(settings.shares, i)  # what it held in flight is free again
                    workers[i] = spawn(i)
                    replaced.add(workers[i].pid)
            if early and replaced & engine.started:
                early = 0  # a replacement reached the engine: the deaths before were not a worker that cannot start
                replaced.clear()
            if told and not forced and engine.everyone_drained({p.pid for p in workers if p.exitcode is None}):
                engine.release()
            if told and all(p.exitcode is not None for p in workers):
                break
            if told and sock.fileno() != -1:
                # No worker is started any more: the workers' copies alone keep the socket listening, so the last
                # one to stop accepting closes it, and a new connection is refused, not queued until this process
                # exits and then reset.
                sock.close()
            if drain_ends is not None and time.monotonic() > drain_ends:
                stuck = [p for p in workers if p.exitcode is None]
                log(f"HTTP workers {', '.join(str(p.pid) for p in stuck)} still running "
                    f"{args.drain_timeout + 5:g} s after the drain began (--drain-timeout + 5 s): killed")
                for p in stuck:
                    p.kill()
                drain_ends = None
    finally:
        if not told:  # leaving by an error: the workers drain rather than orphan
            tell_workers()
        for p in workers:
            if forced and p.is_alive():
                p.kill()
    sock.close()  # none accepts any more: new connections are refused, not left waiting for the passes
    for p in workers:
        p.join(1.0)
        multiprocess.mark_process_dead(p.pid)
    unix.close()
    if forced:
        log(f"stopped (exit {code}), not waiting for the forward passes still running")
        return code, True
    if engine.batcher is not None and engine.batcher.busy:
        log("finishing the forward passes running and queued (a second signal: stop now)")
    stopped = asyncio.Event()

    def stop():  # on a daemon thread: a pass never cut short, and never waited for at a second signal
        engine.stop()
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stopped.set)

    threading.Thread(target=stop, name="glmvit-stop", daemon=True).start()
    while not stopped.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), 0.1)
        wake.clear()
        if signals["count"] > told:
            log(f"stopped (exit {code}), not waiting for the forward passes still running")
            return code, True
    log(f"stopped (exit {code})")
    return code, False


def _ended(p) -> str:
    return f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit status {p.exitcode}"


def worker_main(sock, path: str, args, settings, max_connections: int, backlog: int, parent: int) -> None:
    """An HTTP worker: the app (app.create_app) on the shared socket, its engine the server process's."""
    from .http_server import build_server, log

    # A terminal's Ctrl-C, or a service manager's SIGTERM, reaches the whole group: the server process decides,
    # and drains its workers with DRAIN.
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    # A drain before this worker serves (the server stopped while it started): it holds nothing, so it ends, with
    # status 0. DRAIN's default action would end it too, but as a fatal signal: at once even while the process is
    # stopped (SIGSTOP, a debugger), where the server's own deadline should decide. The server's handler
    # replaces this one as it starts serving (http_server.py).
    signal.signal(DRAIN, lambda signum, frame: os._exit(0))

    def watch():  # the server process gone however it ended (SIGKILL): nobody is left to encode
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="glmvit-orphan-watch", daemon=True).start()
    warnings.filterwarnings("ignore", module=r"PIL\.")
    from .app import create_app
    from .remote import RemoteEngine

    # The engine's first answer, before this worker accepts anything: "ready" (loaded), and the worker is
    # ready as it starts serving; "loading", and it answers 503 until the engine's "ready" comes.
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        link.connect(path)
        wire.write_blocking(link, "hello", (os.getpid(),))
        first = wire.read_blocking(link)
    except OSError as e:
        if os.getppid() == parent:  # the server still runs: say why this worker cannot serve
            log(f"HTTP worker {os.getpid()}: cannot reach the engine at {path} ({e.strerror or e})")
        first = None
    if first is None or first[0] == "failed":  # the server stopped, or its tower failed to load (it says why)
        os._exit(1)
    link.setblocking(False)
    app = None

    async def load_backend():
        engine = await RemoteEngine.connect(link, first, settings.max_queue)
        settings.weights = engine.fingerprint
        state = app.state.glmvit
        engine.on_gone = lambda: state.update(status="failed", error="the engine process stopped")
        state.update(drained=engine.drained, released=False)  # the drain's end is the server's (http_server.py)
        engine.on_release = lambda: state.update(released=True)
        return engine

    load_backend.at_start = first[0] == "ready"  # the app awaits it before serving

    app = create_app(load_backend, settings)
    server = build_server(app, args, max_connections, backlog, ready=None, worker=True)
    server.run(sockets=[sock])
    state = app.state.glmvit
    state["off_process"].shutdown()
    error = state.get("error") or ""
    if server.failed and not error.startswith("EngineFailed"):  # the engine's own failure: the server logs it
        log(f"HTTP worker {os.getpid()}: {error}; exiting")
    code = 1 if server.failed else 0
    if any(t.daemon and t.is_alive() and t.name.startswith("glmvit-") and t.name != "glmvit-orphan-watch"
           for t in threading.enumerate()):
        os._exit(code)  # a decoding thread still busy: the interpreter's shutdown would wait for it
    raise SystemExit(code)  # the interpreter's own exit: the decoding processes' resources let go
