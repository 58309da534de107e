"""How one model's forwards run on its GPU: its own stream and cuBLAS handle, one forward at a time
(a lock), inputs staged into the arena, a CUDA graph per token budget (plans.py), captured on the
budget's first call, CUDA events per stage, and out-of-memory turned into an error that leaves the
model usable.
"""

from __future__ import annotations

import logging
import threading

import cupy

from ..errors import GpuOutOfMemory
from .gemm import Handle

log = logging.getLogger("glmvit_cupy")

# From this many patches a forward runs longer on the GPU than its ~250 launches take on the host, so a
# budget's first call runs eagerly (the GPU starts at once instead of idling through a capture) and its
# second call captures, usually while the GPU is still busy with the batch before it. Smaller budgets are
# host-bound when eager: their first call captures.
CAPTURE_ON_SECOND_CALL = 16384


def _copy(src: cupy.ndarray, stream) -> cupy.ndarray:
    """A copy of `src` the caller owns, made on `stream`. A contiguous slot is copied by memcpy: CuPy's
    copy() runs an element-wise kernel (7 us for 448²'s 2 MB of embeddings under ncu, after the graph)."""
    if not src.flags.c_contiguous:
        return src.copy()
    out = cupy.empty(src.shape, src.dtype)
    cupy.cuda.runtime.memcpyAsync(out.data.ptr, src.data.ptr, src.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                  stream.ptr)
    return out


class Executor:
    def __init__(self, device: cupy.cuda.Device, graphs: bool = True):
        self.device = device
        self.graphs = graphs
        self.lock = threading.Lock()
        with device:
            self.stream = cupy.cuda.Stream(non_blocking=True)  # ours: graphs capture on it
            self.blas = Handle(self.stream)
        self._events: list = []

    def run(self, get_plan, stage, forward, output):
        """One forward under the lock, on our stream, after the caller's stream's work so far.

        get_plan() -> the batch's plan (its budget's, with this batch's meta uploaded); stage() fills the
        arena's input rows (outside any graph: the source differs per call); forward(plan, mark) computes,
        as the budget's CUDA graph (captured on its first call) or eagerly; output(plan) is the slot
        returned. Returns a copy the caller owns (the arena is reused), which the caller's current stream is made to wait for."""
        with self.lock, self.device:
            try:
                return self._run(get_plan, stage, forward, output)
            except cupy.cuda.memory.OutOfMemoryError as e:
                # Nothing half-built is kept: the arena is either whole or absent, a plan whole or absent.
                cupy.get_default_memory_pool().free_all_blocks()
                raise GpuOutOfMemory(f"GPU out of memory on device {self.device.id} ({e}); the model is still "
                                     "usable: encode fewer tokens per call or build it with a smaller "
                                     "capacity_tokens") from None

    def _run(self, get_plan, stage, forward, output):
        stream, caller = self.stream, cupy.cuda.get_current_stream()
        with stream:
            plan = get_plan()  # its uploads are ordered before the kernels that read them
            stream.wait_event(caller.record())  # after the caller's work (its input, say)
            events = [("start", stream.record())]
            stage()
            # A budget's first call (second, for large ones) captures its graph (~250 launches become one;
            # capture costs about one eager forward), which then serves every later batch of that budget,
            # whatever its shapes.
            if self.graphs and self.blas.capturable and plan.graph is None and not plan.capture_failed and \
                    (plan.uses >= 1 or plan.patches < CAPTURE_ON_SECOND_CALL):
                self._capture(plan, forward)
            plan.uses += 1
            if self.graphs and plan.graph is not None:
                plan.graph.launch(stream)
                events.append(("forward", stream.record()))
            else:
                forward(plan, lambda name: events.append((name, stream.record())))
            out = _copy(output(plan), stream)
            events.append(("copy_out", stream.record()))
            caller.wait_event(events[-1][1])
        self._events = events
        return out

    def capture(self, plan, forward) -> bool:
        """Capture `plan`'s graph now, before any batch runs on it (a budget known ahead; the forward
        reads every per-batch detail from the plan's device data, so nothing is computed here), and load
        it onto the GPU. False where graphs are off or cannot be captured (the plan then runs as usual)."""
        if not (self.graphs and self.blas.capturable):
            return False
        with self.lock, self.device, self.stream:
            if plan.graph is None and not plan.capture_failed:
                self._capture(plan, forward)
                if plan.graph is not None:
                    plan.graph.upload(self.stream)  # else its first launch would
        return plan.graph is not None

    def _capture(self, plan, forward):
        """The budget's forward as a CUDA graph; if capture fails, the budget runs eagerly from then on."""
        stream, graph, error = self.stream, None, None
        stream.begin_capture()
        try:
            forward(plan, None)
        except Exception as e:
            error = e
        try:
            graph = stream.end_capture()  # always ended, even after a failed forward
        except Exception as e:
            error = error or e
        if error is not None:
            plan.capture_failed = True
            log.warning("CUDA graph capture failed (%s); this shape runs without a graph", error)
            return
        plan.graph = graph

    @property
    def last_timing(self) -> dict:
        """Milliseconds per stage of the last forward (waits for it): patch_embed (with the input staging),
        blocks, merger, copy_out; a forward replayed from its CUDA graph has one "forward" stage instead
        of the first three."""
        ev = self._events
        if not ev:
            return {}
        ev[-1][1].synchronize()
        return {b: cupy.cuda.get_elapsed_time(ea, eb) for (_, ea), (b, eb) in zip(ev, ev[1:])}
