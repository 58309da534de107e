"""At load, per GEMM shape of the forward and a few row counts: the fastest cublasLt algorithm that gives
exactly the bits of cublasGemmEx's default pick, kept on the Handle only where it beats that pick.

Why bits and not a tolerance: the engine's outputs must not depend on the batch an image shares a
forward with, nor on the budget it lands in. Every candidate is checked bit for bit against the default
(gemm_lt offers only algorithms without split-K or workspace, so each output element is summed over K in
one order, which must be the default's); a row count between the tuned ones runs the algorithm of the
nearest where cublasLt's heuristic offers that configuration for its shape (Handle.lt_choice).

Random inputs alone do not prove the order: a sum taken in another order differs from the default's in
about 2**-15 of its bf16 outputs, so on a small shape (the merger of a test tower: 96 x 100 outputs) a
candidate summing in another order passes about three times in four. Each candidate is therefore also
run on `cancelling` inputs, where every output holds +2**24 and -2**24 among its products: the small
products added while the sum sits at 2**24 lose their low bits, so any other grouping of the K terms
changes the result by about its own size.

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
                except Exception as e:  # noqa: BLE001 - tuning is only for speed
                    # A cublasLt status, no room for the tuning's inputs on a full GPU, or anything else: this
                    # shape at these rows stays on GemmEx (bits unchanged), and the load goes on.
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
    probes = [(a, w, want)]
    if k >= 4:
        ca, cw = cancelling(a, w)
        cwant = base.copy()
        gemm(ca, cw, cwant, beta, handle=handle)
        probes.append((ca, cw, cwant))
    same = []
    for algo in problem.candidates():
        for pa, pw, pwant in probes:
            got = base.copy()
            problem.run(algo, pa.data.ptr, pw.data.ptr, got.data.ptr, one.ctypes.data, b.ctypes.data,
                        handle.stream.ptr)
            if not bool(cupy.array_equal(got.view(np.uint8), pwant.view(np.uint8))):
                break
        else:
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


BIG = 0x4580  # bf16 4096: 4096 * 4096 = 2**24, where a float32's unit in the last place is 2


def cancelling(a: cupy.ndarray, w: cupy.ndarray) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Copies of a [M, K] and w [N, K] (K >= 4) whose every output sums +2**24 and -2**24 among small
    products: even rows at K columns 0 and K - 1, odd rows at K / 2 and K / 2 - 1, so that the large
    pair sits at the ends of the sum for some outputs and in its middle for others."""
    k = a.shape[1]
    if k < 4:
        raise ValueError(f"cancelling: K = {k}; the four columns it writes need K >= 4")
    lo, hi = k // 2 - 1, k // 2
    a, w = a.copy(), w.copy()
    ab, wb = a.view(np.uint16), w.view(np.uint16)  # written as bf16 bit patterns: exact, no conversion
    wb[:, [0, hi]], wb[:, [k - 1, lo]] = BIG, BIG | 0x8000
    ab[:, [0, k - 1, lo, hi]] = 0
    ab[0::2, [0, k - 1]] = BIG
    ab[1::2, [lo, hi]] = BIG
    return a, w


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
