"""What every kernel launcher shares (ops.py's, gemm_sm90.py's): the block size of the element-wise
kernels, grid arithmetic, the shared-memory opt-in of the Hopper kernels, the SM count, and the
tracing hook a profiler uses to see every launch without touching the engine."""

from __future__ import annotations

import contextlib
import functools

import cupy
import numpy as np

from .kernels import kernel

THREADS = 256
_prepared: set = set()  # (device, module, kernel) whose shared-memory limit was raised
_tracer = None  # set by traced(): record(name, start_event, end_event, flop) around every launch


@contextlib.contextmanager
def traced(record):
    """Within the block, every launch is bracketed by events on the current stream and reported as
    record(name, start, end, flop) (FLOP for GEMMs and attention, else 0). Not for CUDA graph capture."""
    global _tracer
    old, _tracer = _tracer, record
    try:
        yield
    finally:
        _tracer = old


def launch(name, flop, fn):
    """fn() (one kernel launch), seen by the tracer when one is set."""
    if _tracer is None:
        return fn()
    stream = cupy.cuda.get_current_stream()
    start = stream.record()
    out = fn()
    _tracer(name, start, stream.record(), flop)
    return out


def cdiv(a, b):
    return -(-a // b)


def grid_1d(n):
    """Blocks for a grid-stride loop over n elements (capped: the loop covers the rest)."""
    return (int(min(max(1, cdiv(n, THREADS)), 65535 * 8)),)


def ptr_or_null(a):
    return np.uint64(0) if a is None else a


def with_shared_memory(module: str, name: str, nbytes: int):
    """The compiled kernel, allowed nbytes of dynamic shared memory (raised once per device: past
    48 KiB a launch fails unless the kernel's limit was raised first)."""
    fn = kernel(module, name)
    key = (cupy.cuda.runtime.getDevice(), module, name)
    if key not in _prepared:
        fn.max_dynamic_shared_size_bytes = nbytes
        _prepared.add(key)
    return fn


def sm_count():
    return _sms_of(cupy.cuda.runtime.getDevice())


@functools.cache
def _sms_of(dev: int) -> int:
    return cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
