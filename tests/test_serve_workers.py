"""glmvit-serve --workers N on the CPU (the float32 reference, the golden tower): HTTP workers beside the
engine process answer as one process does, bit for bit, with /metrics summed over every process; a
killed worker is replaced, SIGTERM drains them all, a killed server takes its workers with it."""

import contextlib
import os
import signal
import time

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("starlette", reason="the serve extra (starlette, uvicorn, prometheus_client) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from tests.test_serve import TOWER, png, start, videos_beside_images  # noqa: E402

from glmvit_cupy import bind_tower, preprocess_video, reference  # noqa: E402
from glmvit_cupy.errors import ServerError  # noqa: E402
from glmvit_cupy.serving.shares import Shares  # noqa: E402
from glmvit_cupy.backend import Backend  # noqa: E402
from glmvit_cupy.preprocessing.image import prepare_canvas  # noqa: E402


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and (stat(int(e)) or [None, None])[1] == str(pid)}


def workers_of(proc) -> set[int]:
    """The server's HTTP workers (its children running worker_main; not multiprocessing's resource tracker)."""
    found = set()
    for pid in children(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
        except OSError:
            continue
        if b"multiprocessing.spawn" in line and b"resource_tracker" not in line:
            found.add(pid)
    return found


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def metric(client, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(client.url + "/metrics", timeout=10).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name) and not ln.startswith("#"))


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what} within {seconds:g} s")


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc (Linux)")


@needs_proc
def test_workers_answer_bit_equal_to_the_reference_and_metrics_sum_every_process(tmp_path):
    proc, client = start(tmp_path, "--workers", 3, "--cache-mib", 0)
    try:
        assert len(wait_for(lambda: len(workers_of(proc)) == 3 and workers_of(proc), 10, "three workers")) == 3
        vids, images, embs, meta, got = videos_beside_images(client)
        backend = Backend(bind_tower(TOWER), cpu=True)
        for i, data in enumerate(images):
            import io

            alone = backend.encode_on(0, [prepare_canvas(io.BytesIO(data))])[0]
            assert np.array_equal(got[i].view(np.uint16), alone.view(np.uint16))
        pv, grid, infos = preprocess_video(vids, fps=[4.0, 2.0], max_image_tokens=200)
        ref = reference.encode_pixels(reference.Tower(bind_tower(TOWER)), pv, grid).astype(ml_dtypes.bfloat16)
        ref = np.split(ref, np.cumsum([i["tokens"] for i in infos])[:-1])
        for emb, r in zip(embs, ref):
            assert np.array_equal(emb.view(np.uint16), r.view(np.uint16))
        more = [png(30 + 7 * k, 50, 40 + k) for k in range(12)]
        for k, data in enumerate(more):  # spread over the workers by the kernel: each counts its own
            assert client.encode([data])[0][0].shape[1] == 256
        # Every process's counts, whichever worker answers /metrics: 3 + 12 image requests and one of videos.
        for _ in range(3):
            assert metric(client, 'glmvit_requests_total{status="200"}') == 15
            assert metric(client, 'glmvit_images_total{outcome="encoded"}') == 14
            assert metric(client, "glmvit_forward_passes_total") == 14  # the engine process's
            assert metric(client, 'glmvit_videos_total{outcome="encoded"}') == 2
        import urllib.request

        text = urllib.request.urlopen(client.url + "/metrics", timeout=10).read().decode()
        for kind in ("images", "videos"):  # every outcome listed, at 0 where none happened, as with one process
            for outcome in ("encoded", "cached", "shared", "failed", "dropped"):
                assert f'glmvit_{kind}_total{{outcome="{outcome}"}}' in text, (kind, outcome)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "with 3 HTTP workers" in out and "draining the 3 HTTP workers" in out and "stopped (exit 0)" in out


@needs_proc
def test_a_killed_worker_is_replaced_and_the_server_keeps_answering(tmp_path, monkeypatch):
    """The pixels in flight are the server's: while each worker's row holds half of them, either worker refuses
    a request (429); a worker killed is replaced, and what it held is free again."""
    short = tmp_path / "t"
    short.mkdir()
    monkeypatch.setenv("TMPDIR", str(short))
    proc, client = start(tmp_path, "--workers", 2)
    try:
        first = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 10, "two workers")
        (folder,) = short.iterdir()
        half = 2**28 // 2  # --max-pixels-in-flight's default, half held by each worker
        with Shares(str(folder / "shares")) as held:
            for slot in range(held.slots):
                held.take(slot, 0, half, 2**28)
            for k in range(4):  # whichever worker the kernel gives each connection to
                with pytest.raises(ServerError, match="268,435,456 of the 268,435,456 pixels the server holds") as e:
                    client.encode([png(40, 50, 9 + k)])
                assert e.value.status == 429
            victim = min(first)
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: victim not in workers_of(proc) and len(workers_of(proc)) == 2, 15, "a new worker")
            assert sorted(held.own(slot, 0) for slot in range(held.slots)) == [0, half]
            for slot in range(held.slots):
                held.give(slot, 0, held.own(slot, 0))
        for k in range(8):  # whichever worker the kernel gives each connection to
            embs, meta = client.encode([png(40, 40 + 14 * k, 60 + k)])
            assert embs[0].shape == (meta[0]["tokens"], 256) and np.isfinite(embs[0].astype(np.float32)).all()
            assert client.health()["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert f"HTTP worker {victim} ended (killed by SIGKILL): starting another" in out


@needs_proc
def test_a_killed_server_takes_its_workers_with_it(tmp_path):
    proc, client = start(tmp_path, "--workers", 2)
    try:
        workers = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 10, "two workers")
        client.encode([png(40, 50, 7)])
        proc.kill()
        proc.wait(10)

        wait_for(lambda: all((stat(w) or ["Z"])[0] == "Z" for w in workers), 5, "the workers gone")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_sweep_removes_only_the_folders_of_dead_servers_of_this_host_and_namespace(tmp_path):
    import subprocess
    import sys

    from glmvit_cupy.serving import workers

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    here = workers._namespace()
    owners = {"dead": f"{dead.stdout.strip()} {here}", "alive": f"{os.getpid()} {here}",
              "elsewhere": f"{dead.stdout.strip()} otherhost:{here.split(':')[1]}", "half": "12",
              "huge": f"{10**20} {here}"}  # past any pid: os.kill raises OverflowError
    for name, owner in owners.items():
        (tmp_path / (workers.PREFIX + name)).mkdir()
        (tmp_path / (workers.PREFIX + name) / workers.OWNER).write_text(owner)
    (tmp_path / (workers.PREFIX + "making")).mkdir()  # no owner file yet
    (tmp_path / "other-dead").mkdir()
    (tmp_path / "other-dead" / workers.OWNER).write_text(owners["dead"])
    assert workers.sweep(str(tmp_path)) == [str(tmp_path / (workers.PREFIX + "dead"))]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["other-dead"] + [workers.PREFIX + n for n in ("alive", "elsewhere", "half", "huge", "making")])


@needs_proc
def test_the_folder_of_a_killed_server_goes_when_the_next_one_starts(tmp_path, monkeypatch):
    """SIGKILL leaves the engine's socket and metrics folder behind (no cleanup runs); the next glmvit-serve
    of this user removes it as it makes its own, and removes its own when it stops."""
    short = tmp_path / "t"
    short.mkdir()
    monkeypatch.setenv("TMPDIR", str(short))
    proc, client = start(tmp_path, "--workers", 2)
    client.encode([png(40, 50, 7)])
    proc.kill()
    proc.communicate(timeout=10)
    left = [p.name for p in short.iterdir()]
    assert len(left) == 1 and left[0].startswith("glmvit-serve-"), left
    proc, client = start(tmp_path, "--workers", 2)
    try:
        wait_for(lambda: left[0] not in [p.name for p in short.iterdir()], 10, "the stale folder removed")
        assert len(list(short.iterdir())) == 1  # its own
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and not list(short.iterdir()), out


@pytest.mark.parametrize("workers,why", [("0", "--workers 0 must be at least 1"),
                                         ("300", "--workers 300 is more HTTP worker processes than 256")])
def test_a_worker_count_out_of_range_is_refused_at_start(workers, why):
    import subprocess
    import sys

    from tests.test_serve import SRC

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "glmvit_cupy.serving.main", "--checkpoint", TOWER, "--cpu",
                          "--workers", workers], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and why in run.stderr, run.stderr


@needs_proc
def test_a_temp_folder_too_long_for_a_unix_socket_falls_back_to_tmp(tmp_path, monkeypatch):
    """A Unix socket's name holds 107 bytes: under a long TMPDIR the engine's socket is made in /tmp (it could
    not be made there, and the server would exit 2 saying so)."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    proc, client = start(tmp_path, "--workers", 2)
    try:
        assert client.encode([png(40, 60, 3)])[0][0].shape[1] == 256
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and "stopped (exit 0)" in out, out


def launch_alone(*flags, prelude="pass", env_extra=None):
    """glmvit-serve --cpu leading a process group of its own (as a service manager starts it), `prelude` run
    first:
    (process, client) once /health says ok."""
    import subprocess
    import sys

    from tests.test_serve import SRC, healthy, served_port
    from glmvit_cupy.client import Client

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), **(env_extra or {}))
    code = f"import sys; {prelude}; from glmvit_cupy.serving.main import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "--checkpoint", TOWER, "--cpu", "--port", "0",
                             *map(str, flags)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return proc, healthy(proc, Client(f"http://127.0.0.1:{served_port(proc, 20)}", timeout=60), 20)


def in_thread(fn):
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.update(r=_outcome(fn)))
    t.start()
    return t, box


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return e


@needs_proc
def test_one_sigterm_to_the_whole_group_drains_as_one_to_the_server():
    """A service manager (systemd's control-group stop) or `kill -TERM -PGID` signals every process: the
    workers leave it to the server process, so the request in flight is answered, not cut short as by a
    second signal."""
    from tests.test_serve_limits import slow

    proc, client = launch_alone("--workers", 2, prelude=slow(1.5))
    try:
        t, box = in_thread(lambda: client.encode([png(64, 64, 406)]))
        time.sleep(0.4)  # in its pass
        os.killpg(proc.pid, signal.SIGTERM)
        t.join(30)
        assert not isinstance(box["r"], Exception), box["r"]
        assert box["r"][0][0].shape[0] == 16
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "draining the 2 HTTP workers" in out and "while stopping" not in out and "stopped (exit 0)" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def listeners(pids, port: int) -> dict:
    """{pid: whether it holds the socket listening on `port`} (from /proc/net/tcp and each /proc/PID/fd)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inode = fields[9]
    held = {}
    for pid in pids:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            links = set()
        held[pid] = inode is not None and f"socket:[{inode}]" in links
    return held


@needs_proc
def test_a_drain_refuses_new_connections_once_the_last_worker_stops_accepting(tmp_path):
    """The server process lets go of the listening socket as it tells the workers to drain: once the last worker
    has closed its copy, a new connection is refused at once, even while the workers are still ending (here
    frozen by SIGSTOP), instead of being queued until the server exits and then reset."""
    import socket

    proc, client = launch_alone("--workers", 2)
    port = int(client.url.rsplit(":", 1)[1])
    frozen = set()
    try:
        workers = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 10, "two workers")
        # a worker is a process before it holds the listening socket (on a loaded 2-core host, visibly so)
        wait_for(lambda: all(listeners([proc.pid, *workers], port).values()), 10,
                 "the server and both workers listening")
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while frozen != workers and time.monotonic() < deadline:  # each worker frozen once it stops listening
            for pid, holds in listeners(workers - frozen, port).items():
                if not holds:
                    with contextlib.suppress(ProcessLookupError):  # or it has ended: not listening either
                        os.kill(pid, signal.SIGSTOP)
                    frozen.add(pid)
            time.sleep(0.001)
        assert frozen == workers and not listeners([proc.pid], port)[proc.pid]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # where the test failed before its own SIGTERM
        assert proc.wait(30) == 0


@needs_proc
def test_new_connections_are_refused_while_the_engine_finishes_its_passes(tmp_path):
    """Once the workers have gone (the drain timed out), the server process closes the listening socket: a
    connection is refused at once, not left waiting for the pass; a second signal then stops it at once and
    its temporary folder goes with it."""
    import socket

    from tests.test_serve_limits import slow

    temp = tmp_path / "t"
    temp.mkdir()
    proc, client = launch_alone("--workers", 2, "--drain-timeout", 0.3, prelude=slow(6),
                                env_extra={"TMPDIR": str(temp)})
    try:
        assert [p.name for p in temp.iterdir()] and all(p.name.startswith("glmvit-serve-") for p in temp.iterdir())
        t, box = in_thread(lambda: client.encode([png(64, 64, 407)]))
        time.sleep(0.5)  # in its pass
        proc.send_signal(signal.SIGTERM)
        port = int(client.url.rsplit(":", 1)[1])

        def refused():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except ConnectionRefusedError:
                return True
            return False

        wait_for(refused, 5, "a refused connection while the pass runs")
        assert proc.poll() is None  # still finishing its pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        t.join(10)
        out = proc.stdout.read()
        assert "not waiting for the forward passes still running" in out, out
        assert list(temp.iterdir()) == [], list(temp.iterdir())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@needs_proc
def test_an_engine_failure_of_one_request_fails_that_request_alone():
    """An image the engine process cannot take (its upload fails: out of memory, say) is that request's 500;
    the worker's link, its other requests and the worker itself go on."""
    prelude = ("from glmvit_cupy.backend import Backend; ahead = Backend.ahead; "
               "Backend.ahead = lambda self, item: (_ for _ in ()).throw(MemoryError('no room for this upload')) "
               "if item[2]['size'][0] == 41 else ahead(self, item)")
    proc, client = launch_alone("--workers", 2, prelude=prelude)
    try:
        before = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 10, "two workers")
        from glmvit_cupy import ServerError

        for k in range(6):
            with pytest.raises(ServerError) as e:
                client.encode([png(41, 50, 500 + k)])
            assert e.value.status == 500 and "MemoryError: no room for this upload" in e.value.error
            assert client.encode([png(40, 50, 600 + k)])[0][0].shape[1] == 256
        assert workers_of(proc) == before  # none replaced
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and "ended" not in out, out


@needs_proc
def test_a_wedged_worker_is_killed_once_the_drain_is_over_and_the_server_exits():
    """A worker that never ends its drain (stopped by SIGSTOP here) is killed --drain-timeout + 5 s after the
    drain began, and the server exits 0 saying so, instead of waiting for it without end."""
    proc, client = launch_alone("--workers", 2, "--drain-timeout", 0.5)
    try:
        victims = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 10, "two workers")
        client.encode([png(40, 50, 9)])
        victim = min(victims)
        # Stopped once it handles DRAIN (worker_main's first lines): before, DRAIN's default action is a fatal
        # signal, which ends even a stopped process at once (a loaded machine once stopped a worker that early).
        wait_for(lambda: catches(victim, signal.SIGUSR1), 20, "the worker to handle DRAIN")
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        took, out = time.monotonic() - t0, proc.stdout.read()
        assert 5.0 < took < 15.0, (took, victim, victims, out)
        assert f"HTTP workers {victim} still running 5.5 s after the drain began (--drain-timeout + 5 s): killed" \
            in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@needs_proc
def test_workers_that_cannot_reach_the_engine_stop_the_server_after_three_in_a_row(tmp_path):
    """The engine's socket gone (a /tmp cleaner, say): each replacement fails to reach it and says why; the
    third in a row stops the server with exit 1, though a worker still runs."""
    temp = tmp_path / "t"
    temp.mkdir()
    proc, client = launch_alone("--workers", 2, env_extra={"TMPDIR": str(temp)})
    try:
        first = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 10, "two workers")
        client.encode([png(40, 50, 11)])
        (folder,) = list(temp.iterdir())
        (folder / "engine.sock").unlink()
        os.kill(min(first), signal.SIGKILL)
        assert proc.wait(30) == 1
        out = proc.stdout.read()
        assert "cannot reach the engine at" in out and "3 HTTP workers ended before they reached the engine" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_reply_left_unread_past_the_drain_ends_without_a_traceback(workers):
    """A client that never reads its large reply: the drain runs out, its connection is closed, the server
    exits 0, and no traceback reaches the log (the reply's wait for its socket is cancelled, nothing failed)."""
    import base64
    import json
    import socket

    proc, client = launch_alone("--workers", workers, "--drain-timeout", 1)
    try:
        port = int(client.url.rsplit(":", 1)[1])
        body = json.dumps({"images": [base64.b64encode(png(400, 400, 12)).decode()] * 64}).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        s.recv(1)  # the reply has begun: the rest waits in the server's buffers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        s.close()
        assert "Traceback" not in out and "CancelledError" not in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_engine_uploads_small_requests_on_its_loop_and_large_ones_on_a_thread():
    """A request's decoded images of at most EngineServer.INLINE_BYTES together are uploaded on the engine's event
    loop (no crossing to an upload thread and back); more go to an upload thread, so the loop keeps reading
    frames meanwhile. An upload that fails is that request's error, on either path."""
    import asyncio
    import threading

    from glmvit_cupy.serving.engine_server import EngineServer

    where = []

    class Uploader:
        def ahead(self, item):
            if item[2].get("fail"):
                raise MemoryError("out of device memory for this upload")
            where.append(threading.current_thread().name)
            return item

    class Queue:
        def submit(self, items):
            return [info["n"] for _, _, info in items]

        def stop(self):
            pass

    limit = EngineServer.INLINE_BYTES
    small = np.ones((limit // 3 - 7,), np.uint8)  # three of them are just under the limit, four over it
    grid = (1, 2, 2)

    async def go():
        server = EngineServer(lambda: None, capacity_tokens=100, max_wait_ms=1.0, max_queue=8, metrics=None)
        server.backend, server.batcher = Uploader(), Queue()
        got = [await server._queue("images", (0, [(grid, {"n": i}) for i in range(3)]), [small] * 3),
               await server._queue("images", (1, [(grid, {"n": i}) for i in range(4)]), [small] * 4)]
        for n in (3, 4):
            with pytest.raises(MemoryError, match="out of device memory"):
                await server._queue("images", (2, [(grid, {"n": 0, "fail": True})] * n), [small] * n)
        server.stop()
        return got

    assert asyncio.run(go()) == [[0, 1, 2], [0, 1, 2, 3]]
    assert where[:3] == [threading.main_thread().name] * 3
    assert len(where) == 7 and all(name.startswith("glmvit-upload") for name in where[3:])
