"""Where a small encode_pixels call's time goes (CuPy float32 input, its graph replayed), timed as
bench_encoder times a call (events around it on the caller's stream, synchronised after each):
the GPU's share between events (caller -> start of staging -> after the graph -> after the copy ->
the caller's end event) and the host's steps of the same call (perf_counter; three steps wrapped in
place, the glue between them as the gaps). Also the call as the library runs it, and the graph
replayed back to back.

    python tools/host_share.py [calls]
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from benchmarks.common import official_checkpoint, table, time_ms  # noqa: E402

STEPS = ("into check_pixels", "check_pixels", "to plans.get (lock, device, stream)", "plans.get",
         "to staging (caller's event, start event)", "stage_pixels", "to return (flag, graph launch, copy, events)")


def instrumented(model, pv, g, host):
    """One model.encode_pixels call with its host steps timed in place (us into `host`): check_pixels,
    plans.get and stage_pixels wrapped, the glue between them timed as the gaps."""
    from glmvit_cupy.engine import model as model_mod, runner as runner_mod

    T = time.perf_counter_ns
    ts = {}

    def stamp(name, f):
        def timed(*a, **k):
            ts[name + "0"] = T()
            try:
                return f(*a, **k)
            finally:
                ts[name + "1"] = T()
        return timed

    check, stage, get = model_mod.checks.check_pixels, runner_mod.stage_pixels, model.runner.plans.get
    model_mod.checks.check_pixels, runner_mod.stage_pixels = stamp("check", check), stamp("stage", stage)
    model.runner.plans.get = stamp("plan", get)
    try:
        t0 = T()
        out = model.encode_pixels(pv, g)
        t1 = T()
    finally:
        model_mod.checks.check_pixels, runner_mod.stage_pixels = check, stage
        del model.runner.plans.get
    marks = [t0, ts["check0"], ts["check1"], ts["plan0"], ts["plan1"], ts["stage0"], ts["stage1"], t1]
    for k, a, b in zip(STEPS, marks, marks[1:]):
        host.setdefault(k, []).append((b - a) / 1e3)
    events = dict(model.runner._events)
    return out, events["start"], events["forward"], events["copy_out"]


def main():
    import cupy

    from glmvit_cupy import GlmVit

    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    model = GlmVit.from_checkpoint(official_checkpoint(), capacity_tokens=8000)
    rng = np.random.default_rng(0)
    gpu_rows, host_rows = [], []
    for name, grid in (("448²", [(1, 32, 32)]), ("224²", [(1, 16, 16)]), ("896²", [(1, 64, 64)]),
                       ("16 x 448²", [(1, 32, 32)] * 16)):
        n = sum(t * h * w for t, h, w in grid)
        pv = cupy.asarray(rng.standard_normal((n, model.geometry.patch_dim), dtype=np.float32))
        g = np.array(grid, np.int64)
        for _ in range(5):
            model.encode_pixels(pv, g)
        cupy.cuda.Device().synchronize()
        alone = time_ms(lambda: model.encode_pixels(pv, g), warmup=5, repeat=calls)
        plan = model.runner.plans.find(g)
        s = model.runner.stream
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(s)
        for _ in range(50):
            plan.graph.launch(s)
        b.record(s)
        b.synchronize()
        replay = cupy.cuda.get_elapsed_time(a, b) / 50
        host, split = {}, []
        caller = cupy.cuda.get_current_stream()
        for i in range(calls + 5):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(caller)
            _, start, fwd, done = instrumented(model, pv, g, host)
            b.record(caller)
            b.synchronize()
            if i >= 5:
                e = cupy.cuda.get_elapsed_time
                split.append((e(a, b), e(a, start), e(start, fwd), e(fwd, done), e(done, b)))
        m = np.median(np.array(split), axis=0)
        gpu_rows.append([name, f"{alone:.3f}", f"{replay:.3f}"] + [f"{x:.3f}" for x in m])
        host_rows.append([name] + [f"{np.median(host[k][5:]):.1f}" for k in STEPS])
    table(["case", "call ms (library)", "graph back to back ms", "call ms (instrumented)", "caller -> staging",
           "staging + graph", "graph end -> copy done", "copy -> caller end"], gpu_rows)
    print()
    table(["host us, median"] + list(STEPS), host_rows)


if __name__ == "__main__":
    main()
