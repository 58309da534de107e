"""glmvit-serve under load: N concurrent clients on loopback sending JPEGs of mixed sizes (150-2,500
tokens, or 64-300 with --small), one image a request; images/s, p50/p99 latency and forward-pass fill (from /metrics), beside
the same engine called one request at a time in this process (host decoding included in both). Also
checks that every served embedding equals, bit for bit, GlmVit.encode of the same bytes alone, and
prints where a pass's time goes (/metrics' glmvit_pass_part_seconds): per pass and per image, the
engine thread's launch against the completion thread's wait for the GPU and copies back, and how much of
the launch and the copies back their thread spent on the CPU (glmvit_pass_thread_cpu_seconds); a request's
parts in its HTTP worker (glmvit_request_part_seconds) beside what the client waited; and the
server's CPU time an image, all its processes and threads together (one process near one core busy: the
interpreter's lock bounds it).

    python benchmarks/bench_serve.py [--checkpoint PATH] [--clients 16] [--requests 240] [--small] [--cpu]
        [--workers N] [--client-processes 4]
    python benchmarks/bench_serve.py --host-only --small     # the service's own host cost, any machine
    python benchmarks/bench_serve.py --host-only --small --requests 4000 --server-cpus 0 --client-cpus 1 \
        [--json] [--new-connections]

--host-only replaces the tower with zeros of its output's shape (on the CPU backend, so images are resized
by Pillow on the decoding threads): what is left is the service's host work an image (HTTP,
hashing, decoding, the reply), the ceiling it puts on images/s whatever the GPU. --server-cpus / --client-cpus
pin the server and the clients to their own CPUs (Linux), so that the server's CPU ms a request is its own work
and not the two contending; --json sends each image as base64 in JSON instead of as the request's body;
--new-connections opens a connection a request instead of keeping one a client thread. --workers N runs the
server with N HTTP worker processes (glmvit-serve --workers; default: its own); the clients run in
--client-processes processes (default 4), so that their own interpreter lock does not bound what is measured.
"""

import argparse
import base64
import io
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))  # run from a checkout
from benchmarks.common import official_checkpoint, table  # noqa: E402
from glmvit_cupy.serving.metrics import REQUEST_PARTS  # noqa: E402 - an image request's parts, in order
from tests.golden import cases  # noqa: E402

# (height, width) in pixels: 150 to 2,500 tokens at 28 x 28 pixels a token.
SIZES = [(336, 448), (448, 448), (300, 500), (640, 480), (896, 672), (1024, 768), (1200, 900), (1400, 1300),
         (256, 1024), (720, 1280)]
# --small: 64-300 tokens, where sharing a forward pass matters most.
SMALL = [(224, 224), (224, 336), (280, 280), (336, 336), (252, 364), (308, 308), (392, 280), (448, 336)]


def jpegs(n, sizes):
    out = []
    for i in range(n):
        h, w = sizes[i % len(sizes)]
        buf = io.BytesIO()
        Image.fromarray(cases._smooth(h, w, 100 + i)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def metric(url, name):
    """The sum of a metric's samples named exactly `name` (labels included, as /metrics writes them)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.rsplit(" ", 1)[0] == name)


PARTS = ("queued", "launch", "gpu", "fetch", "resolve")


CPU_PARTS = ("launch", "fetch")  # also timed in their thread's CPU time (glmvit_pass_thread_cpu_seconds)


# --host-only: the CPU backend's encode gives zeros of the tower's output shape, computing nothing.
NO_TOWER = ("import numpy as np, ml_dtypes\n"
            "Backend.encode_on = lambda self, lane, items: [np.zeros((it[2]['tokens'], self.geometry.out_hidden_size), "
            "ml_dtypes.bfloat16) for it in items]")


def cpus(text: str) -> set[int]:
    """CPU numbers from '0', '0,2' or '0-3'."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def process_cpu_s(pid) -> float | None:
    """A process's CPU seconds so far, every thread's user and system time (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def tree_cpu_s(pid) -> float | None:
    """CPU seconds so far of a process and every process under it (its HTTP workers, its decoding processes)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        cpu = process_cpu_s(p)
        if cpu is None and p == pid:
            return None
        total += cpu or 0.0
        todo.extend(children.get(p, []))
    return total


def parts(url):
    return {**{p: metric(url, f'glmvit_pass_part_seconds_sum{{part="{p}"}}') for p in PARTS},
            **{"request_" + p: metric(url, f'glmvit_request_part_seconds_sum{{part="{p}"}}') for p in REQUEST_PARTS},
            "requests": metric(url, 'glmvit_request_part_seconds_count{part="read"}'),
            **{p + "_cpu": metric(url, f'glmvit_pass_thread_cpu_seconds_sum{{part="{p}"}}') for p in CPU_PARTS}}


def drive(url, work, alone, mine, threads, args, pipe):
    """A client process: `threads` threads sending the requests `mine` (indices into work); sends back
    (latencies, indices whose embedding differs from encoding alone)."""
    from glmvit_cupy.client import Client, _bf16_tensors

    client = Client(url, timeout=600)
    lat, bad, lock, todo = [], [], threading.Lock(), list(mine)

    def run():
        while True:
            with lock:
                if not todo:
                    return
                j = todo.pop()
            t = time.perf_counter()
            caller = Client(url, timeout=600) if args.new_connections else client
            if args.json:  # as Client.encode sends several images: base64 in JSON
                emb = next(iter(_bf16_tensors(caller._post("/v1/encode", {"images": [
                    base64.b64encode(work[j]).decode()]}, [work[j]])[1]).values()))
            else:
                emb = caller.encode([work[j]])[0][0]
            with lock:
                lat.append(time.perf_counter() - t)
                if not np.array_equal(emb.view(np.uint16), alone[work[j]].view(np.uint16)):
                    bad.append(j)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    [t.start() for t in pool]
    [t.join() for t in pool]
    pipe.send((lat, bad))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="default: random weights of the official geometry")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--requests", type=int, default=240, help="requests in all, one image each (default 240)")
    ap.add_argument("--distinct", type=int, default=40, help="distinct images (default 40)")
    ap.add_argument("--small", action="store_true", help="small images (64-300 tokens) instead of 150-2,500")
    ap.add_argument("--cpu", action="store_true", help="the float32 reference (slow)")
    ap.add_argument("--host-only", action="store_true",
                    help="the tower replaced by zeros (CPU backend): the service's host cost alone")
    ap.add_argument("--new-connections", action="store_true", help="a new connection a request (no keep-alive)")
    ap.add_argument("--json", action="store_true", help="clients send each image as base64 in JSON, not as the body")
    ap.add_argument("--workers", type=int, default=None,
                    help="the server's HTTP worker processes (default: the server's own default)")
    ap.add_argument("--max-wait-ms", type=float, default=None, help="the server's --max-wait-ms (default: its own)")
    ap.add_argument("--client-processes", type=int, default=4, help="processes the clients run in (default 4)")
    ap.add_argument("--server-cpus", type=cpus, default=None, help="CPUs the server runs on, e.g. 0 or 0-3 (Linux)")
    ap.add_argument("--client-cpus", type=cpus, default=None, help="CPUs the clients run on, once the server is up")
    args = ap.parse_args()
    if args.host_only:
        args.cpu = True
    from glmvit_cupy import bind_tower
    from glmvit_cupy.backend import Backend
    from glmvit_cupy.client import Client
    from glmvit_cupy.preprocessing.image import prepare_canvas

    ckpt = args.checkpoint or official_checkpoint()
    images = jpegs(args.distinct, SMALL if args.small else SIZES)
    work = [images[i % len(images)] for i in range(args.requests)]

    # One request at a time, in process: decode + resize, one forward pass, embedding to the host.
    backend = Backend(bind_tower(ckpt), cpu=args.cpu)
    if args.host_only:
        exec(NO_TOWER, {"Backend": Backend})
    alone = {}
    for data in images[:3]:  # warm: compile, plans
        backend.encode_on(0, [prepare_canvas(io.BytesIO(data))])
    lat = []
    t0 = time.perf_counter()
    for data in work:
        t = time.perf_counter()
        emb = backend.encode_on(0, [prepare_canvas(io.BytesIO(data))])[0]
        lat.append(time.perf_counter() - t)
        alone.setdefault(data, emb)
    seq_s = time.perf_counter() - t0
    tokens = sum(a.shape[0] for a in (alone[d] for d in work))

    # The server: one image a request, N clients at once, no cache (every request reaches the engine).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    prelude = f"from glmvit_cupy.backend import Backend; exec({NO_TOWER!r}); " if args.host_only else ""
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; {prelude}from glmvit_cupy.serving.main import main; "
                             "sys.exit(main())", "--checkpoint", ckpt, "--port", str(port),
                             "--cache-mib", "0", "--max-queue", "4096"] +
                            (["--max-wait-ms", str(args.max_wait_ms)] if args.max_wait_ms is not None else []) +
                            (["--workers", str(args.workers)] if args.workers else []) +
                            (["--cpu"] if args.cpu else []), env=env)
    if args.server_cpus is not None:  # before its interpreter starts any thread: they inherit it
        os.sched_setaffinity(proc.pid, args.server_cpus)
    client = Client(f"http://127.0.0.1:{port}", timeout=600)
    try:
        for _ in range(600):
            try:
                if client.health()["status"] == "ok":
                    break
            except Exception:
                time.sleep(0.1)
        for data in images:  # warm the server's shapes too
            client.encode([data])
        p0 = metric(client.url, "glmvit_forward_passes_total")
        fill0 = (metric(client.url, "glmvit_forward_pass_fill_sum"), metric(client.url, "glmvit_forward_pass_images_sum"))
        busy0, parts0 = metric(client.url, "glmvit_engine_busy_seconds_total"), parts(client.url)
        if args.client_cpus is not None:
            os.sched_setaffinity(0, args.client_cpus)  # the client threads below inherit it
        context = multiprocessing.get_context("fork")  # the clients inherit the images and the embeddings alone
        procs, pipes = [], []
        for k in range(args.client_processes):
            mine = list(range(k, len(work), args.client_processes))
            threads = len(range(k, args.clients, args.client_processes))
            if not mine or not threads:
                continue
            there, here = context.Pipe(duplex=False)
            procs.append(context.Process(target=drive, args=(client.url, work, alone, mine, threads, args, here)))
            pipes.append(there)
        cpu0, eng0, t0 = tree_cpu_s(proc.pid), process_cpu_s(proc.pid), time.perf_counter()
        [p.start() for p in procs]
        slat, bad = [], []
        for there in pipes:
            got_lat, got_bad = there.recv()
            slat += got_lat
            bad += got_bad
        [p.join() for p in procs]
        srv_s = time.perf_counter() - t0
        cpu1, eng1 = tree_cpu_s(proc.pid), process_cpu_s(proc.pid)
        srv_cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        eng_cpu = None if eng0 is None or eng1 is None else eng1 - eng0  # the top process: the engine's
        passes = metric(client.url, "glmvit_forward_passes_total") - p0
        fill = (metric(client.url, "glmvit_forward_pass_fill_sum") - fill0[0]) / passes
        per_pass = (metric(client.url, "glmvit_forward_pass_images_sum") - fill0[1]) / passes
        # The engine thread's share of the run (packing, staging and launching; never waiting for the GPU): near
        # 100% it is the bound; well under it, the GPU or the requests' host work (HTTP, base64, decoding) is.
        busy = (metric(client.url, "glmvit_engine_busy_seconds_total") - busy0) / srv_s
        spent = {p: v - parts0[p] for p, v in parts(client.url).items()}
        images_served = per_pass * passes
    finally:
        proc.terminate()
        proc.wait(60)
    rows = [["one request at a time, in process", 1, len(work), f"{len(work) / seq_s:.1f}", f"{tokens / seq_s:.0f}",
             f"{1e3 * np.median(lat):.1f}", f"{1e3 * np.percentile(lat, 99):.1f}", len(work), "1.0", "", ""],
            [f"glmvit-serve, {args.clients} clients, {args.workers or 'default'} workers", args.clients, len(work),
             f"{len(work) / srv_s:.1f}",
             f"{tokens / srv_s:.0f}", f"{1e3 * np.median(slat):.1f}", f"{1e3 * np.percentile(slat, 99):.1f}",
             int(passes), f"{per_pass:.1f}", f"{100 * fill:.0f}%", f"{100 * busy:.0f}%"]]
    table(["setup", "clients", "images", "images/s", "tokens/s", "p50 ms", "p99 ms", "forward passes",
           "images a pass", "pass fill (of 8000 tokens)", "engine thread busy"], rows)
    print()
    # The thread's CPU time beside a part's wall time: the difference is the thread waiting (for the GIL held by
    # the event loop or the decoding threads, or in the driver), not working.
    table(["part of a pass (glmvit_pass_part_seconds)", "thread", "ms a pass", "of which the thread's CPU ms",
           "ms an image", "share of the run"],
          [[p, {"queued": "(waiting)", "launch": "engine", "resolve": "completion"}.get(p, "completion"),
            f"{1e3 * spent[p] / passes:.2f}", f"{1e3 * spent[p + '_cpu'] / passes:.2f}" if p in CPU_PARTS else "",
            f"{1e3 * spent[p] / images_served:.2f}", f"{100 * spent[p] / srv_s:.0f}%"] for p in PARTS])
    print()
    # A request's life: its parts in the HTTP worker, and what the client saw beyond them (its own host work,
    # loopback, the worker's event loop before the request reached the app).
    timed = spent["requests"] or 1
    worker = [1e3 * spent["request_" + p] / timed for p in REQUEST_PARTS]
    table(["part of a request (glmvit_request_part_seconds)", "ms a request", "share of the client's latency"],
          [[p, f"{ms:.2f}", f"{100 * ms / (1e3 * np.mean(slat)):.0f}%"] for p, ms in zip(REQUEST_PARTS, worker)] +
          [["the client and loopback (the client's mean less the worker's)", f"{1e3 * np.mean(slat) - sum(worker):.2f}",
            f"{100 - 100 * sum(worker) / (1e3 * np.mean(slat)):.0f}%"]])
    if srv_cpu is not None:
        # CPU time of all the server's threads: near one core busy, whatever the threads, the interpreter's lock
        # (one thread runs Python at a time) is the bound, and the CPU ms an image is what to cut.
        print(f"\nserver: {1e3 * srv_cpu / len(work):.2f} CPU ms an image (all its processes and threads, user + system), "
              f"{srv_cpu / srv_s:.2f} cores busy on average")
    if eng_cpu is not None:
        # The engine process alone (uploads, packing, launches, copies back, both ends of its socket; with one
        # worker, HTTP too): near one core, its interpreter lock is what the requests wait on.
        print(f"engine process: {1e3 * eng_cpu / len(work):.2f} CPU ms an image, {eng_cpu / srv_s:.2f} cores busy")
    name = "the tower replaced by zeros (--host-only)" if args.host_only else backend.name
    print(f"\n{name}; {len(images)} distinct JPEGs of {min(a.shape[0] for a in alone.values())}-"
          f"{max(a.shape[0] for a in alone.values())} tokens; served embeddings bit-equal to encoding alone: "
          f"{len(work) - len(bad)} of {len(work)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
