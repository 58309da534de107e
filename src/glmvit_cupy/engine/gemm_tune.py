"""At load, per GEMM shape of the forward and a few row counts: the fastest cublasLt algorithm that gives
exactly the bits of cublasGemmEx's default pick, kept on the Handle only where it beats that pick.

Why bits and not a tolerance: the engine's outputs must not depend on the batch an image shares a
forward with, nor on the budget it lands in. Every candidate is checked bit for bit against the default
on random inputs (gemm_lt offers only algorithms without split-K or workspace, so each output element is
summed over K in one order); a row count between the tuned ones runs the algorithm of the nearest
where cublasLt's heuristic offers that configuration for its shape (Handle.lt_choice).

Timing: each candidate's `reps` calls are captured in a CUDA graph and replayed, so the host's launch
cost (~15 us a ctypes call, longer than a 1,024-row GEMM) is not counted; the best of `rounds` replays.
On the H200 the whole tuning took 1.05 s for a model of 8,000 tokens' capacity (the load logs it).
"""

from __future__ import annotations

import logging
import time

import cupy
import numpy as np

from . import gemm_lt
from .gemm import BF16, Handle, gemm

log = logging.getLogger("glmvit_cupy")

# Row counts tuned (each capped at the shape's most rows a call). 256: the merger of a 448² image and the
# blocks of the smallest ones, where cuBLAS's default pick is slowest against cublasLt's (attn.proj 5.6 ->
# 5.0 us, mlp.down_proj 10.1 -> 9.3, merger.down_proj 36.3 -> 34.6 on the H200).
TUNE_ROWS = (256, 1024, 4096, 16384)
MIN_GAIN = 0.03                  # a candidate must be this much faster than GemmEx's pick to be kept
MAX_CANDIDATES = 8               # of the heuristic's list, the first this many that give the same bits


def tuning_rows(max_rows: int) -> list[int]:
    """The row counts a shape called with up to max_rows rows is tuned at."""
    if max_rows < 1:
        raise ValueError(f"gemm_tune: a shape needs at least one row a call, got max_rows={max_rows}")
    return sorted({min(r, max_rows) for r in TUNE_ROWS})


def tune(handle: Handle, shapes, min_gain: float | None = None, rounds: int = 3, reps: int = 10) -> list[dict]:
    """Fill handle.algos for shapes [(name, n, k, out dtype, accumulate, max_rows)]; returns one report
    row a (shape, rows): GemmEx's and the chosen algorithm's microseconds. Nothing is tuned (and []
    returned) where cublasLt or graph capture is not available: every GEMM then stays on cublasGemmEx.
    min_gain: None, MIN_GAIN; -inf keeps the fastest same-bits candidate even where GemmEx is faster."""
    min_gain = MIN_GAIN if min_gain is None else min_gain
    lib = gemm_lt.library()
    if lib is None or not handle.capturable:
        log.info("cublasLt not reachable through ctypes: every GEMM runs cublasGemmEx's default algorithm")
        return []
    if handle.lt is None:
        handle.lt = gemm_lt.LtHandle(lib)
    t0, report = time.perf_counter(), []
    rng = cupy.random.default_rng(0x61F3)
    with handle.stream:
        for name, n, k, dtype, accumulate, max_rows in shapes:
            dtype = np.dtype(dtype)
            if (n, k, dtype, bool(accumulate)) in handle.algos:
                continue  # the same GEMM under another name (the merger's downsample and proj)
            picks = []
            for m in tuning_rows(max_rows):
                try:
                    algo, row = _tune_one(handle, rng, m, n, k, dtype, accumulate, min_gain, rounds, reps)
                except (RuntimeError, cupy.cuda.memory.OutOfMemoryError) as e:
                    # A cublasLt status, or no room for the tuning's inputs on a full GPU: this shape at these
                    # rows stays on GemmEx (bits unchanged), and the load goes on: tuning is only for speed.
                    cupy.get_default_memory_pool().free_all_blocks()
                    log.warning("cublasLt tuning of %s at %d rows failed (%s): cublasGemmEx runs it", name, m, e)
                    algo, row = None, {"same_bits": 0, "gemm_ex_us": float("nan"), "best_us": float("nan"),
                                       "chosen": None}
                picks.append((m, algo))
                report.append({"gemm": name, "rows": m, "n": n, "k": k, **row})
            handle.adopt(n, k, dtype, accumulate, picks)
        handle.stream.synchronize()
    cupy.get_default_memory_pool().free_all_blocks()  # the tuning's inputs
    log.info("cublasLt tuned %d GEMM shapes in %.2f s: %d of %d row counts run a faster algorithm than "
             "cublasGemmEx's default", len(handle.algos), time.perf_counter() - t0,
             sum(r["chosen"] is not None for r in report), len(report))
    return report


def _tune_one(handle, rng, m, n, k, dtype, accumulate, min_gain, rounds, reps):
    """(the algorithm kept or None, its report row) for one shape at m rows."""
    beta = 1.0 if accumulate else 0.0
    a = rng.standard_normal((m, k), dtype=np.float32).astype(BF16)
    w = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(BF16)
    base = rng.standard_normal((m, n), dtype=np.float32).astype(dtype)
    want = base.copy()
    gemm(a, w, want, beta, handle=handle)  # GemmEx's default: the bits every candidate must give
    problem = gemm_lt.Problem(handle.lt, m, n, k, k, k, n, gemm_lt.CUDA_R_32F if dtype == np.float32
                              else gemm_lt.CUDA_R_16BF)
    one, b = np.ones((), np.float32), np.asarray(beta, np.float32)
    same = []
    for algo in problem.candidates():
        got = base.copy()
        problem.run(algo, a.data.ptr, w.data.ptr, got.data.ptr, one.ctypes.data, b.ctypes.data, handle.stream.ptr)
        if bool(cupy.array_equal(got.view(np.uint8), want.view(np.uint8))):
            same.append(algo)
        if len(same) == MAX_CANDIDATES:
            break
    scratch = base.copy()
    runs = [lambda: gemm(a, w, scratch, beta, handle=handle)] + [
        lambda algo=algo: problem.run(algo, a.data.ptr, w.data.ptr, scratch.data.ptr, one.ctypes.data,
                                      b.ctypes.data, handle.stream.ptr) for algo in same]
    us = _graph_us(handle.stream, runs, rounds, reps)
    best = int(np.argmin(us[1:])) + 1 if same else 0
    keep = best > 0 and us[best] < us[0] * (1.0 - min_gain)
    return (same[best - 1] if keep else None), {
        "same_bits": len(same), "gemm_ex_us": us[0], "best_us": us[best], "chosen": best - 1 if keep else None}


def _graph_us(stream, runs, rounds, reps) -> list[float]:
    """Microseconds a call of each of `runs`, replayed `reps` at a time from a CUDA graph; best of
    `rounds`, the runs interleaved so that the clock's drift falls on all of them alike."""
    graphs = []
    for fn in runs:
        stream.begin_capture()
        try:
            for _ in range(reps):
                fn()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)  # the first replay uploads the graph
        graphs.append(graph)
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            start = stream.record()
            graph.launch(stream)
            end = stream.record()
            end.synchronize()
            best[i] = min(best[i], 1e3 * cupy.cuda.get_elapsed_time(start, end) / reps)
    return best
