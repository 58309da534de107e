"""One GPU's forwards. A Runner owns everything a forward touches on its device: the stream and the
cuBLAS handle bound to it, the lock (one forward at a time), the arena (scratch, sized once), the plans
(per token budget: device meta and CUDA graph), the stager (inputs into the arena) and the uploader
(decoding threads put images on this GPU through it). It stages a batch, runs the forward itself (as
the budget's CUDA graph, or kernel by kernel) and hands back a copy of the output rows.

GlmVit (model.py) is the public facade over one Runner; Replicas holds one GlmVit per device.
"""

from __future__ import annotations

import logging
import threading

import cupy
import numpy as np

from ..config import VisionGeometry
from ..errors import GpuOutOfMemory
from ..preprocessing.image import value_table
from ..preprocessing.video import value_table as video_value_table
from . import arena, gemm_tune, layers
from .budgets import all_budgets, full_pass_budgets
from .gemm import Handle
from .params import Weights
from .plans import PlanCache
from .staging import Stager, stage_pixels
from .uploads import Uploader

log = logging.getLogger("glmvit_cupy")

# From this many patches a forward runs longer on the GPU than its ~250 launches take on the host, so a
# budget's first call runs eagerly (the GPU starts at once instead of idling through a capture) and its
# second call captures, usually while the GPU is still busy with the batch before it. Smaller budgets are
# host-bound when eager: their first call captures.
CAPTURE_ON_SECOND_CALL = 16384

MAX_PLANS = 48  # token budgets (by attention variant and tile count) whose CUDA graph stays cached, past
                # those captured at load for every budget (Runner.precapture(every_budget=True))


class Runner:
    """The forwards of one tower on one GPU. variants: the attention variants this GPU may pick from
    (attention.py); fused_swiglu: the MLPs' gate/up GEMMs apply the SwiGLU in their epilogue
    (gemm_sm90.cu); graphs: each token budget runs as a CUDA graph; tune_gemms: time cublasLt's
    algorithms for the forward's GEMM shapes now and keep the fastest with cuBLAS's default bits."""

    def __init__(self, geometry: VisionGeometry, weights: Weights, device: cupy.cuda.Device, *, variants: tuple,
                 capacity_patches: int, fused_swiglu: bool, graphs: bool = True, tune_gemms: bool = True):
        g = geometry
        self.geometry, self.weights, self.device = g, weights, device
        self.capacity_patches = capacity_patches
        self.fused_swiglu = fused_swiglu
        self.graphs = graphs
        self.lock = threading.Lock()
        with device:
            self.stream = cupy.cuda.Stream(non_blocking=True)  # ours: graphs capture on it
            self.blas = Handle(self.stream)
            # Per GEMM shape: its fastest cublasLt algorithm with cuBLAS's default bits (report: gemm_tune).
            self.gemm_tuning = gemm_tune.tune(self.blas, layers.gemm_shapes(g, capacity_patches, fused_swiglu)) \
                if tune_gemms else []
            self.plans = PlanCache(variants, g.num_heads, g.hidden_size, device.attributes["MultiProcessorCount"],
                                   capacity_patches, g.spatial_merge_size, MAX_PLANS)
            self.stager = Stager(cupy.asarray(value_table()), g.temporal_patch_size, g.patch_size,
                                 g.spatial_merge_size, cupy.asarray(video_value_table()))
            self.uploads = Uploader(device)
        self._arena: arena.Arena | None = None
        self._pixels_cast = None  # what the arena's pixels_cast flag holds once our stream gets there
        self._events: list = []

    def arena(self) -> arena.Arena:
        """The scratch, allocated on first use, once, sized from the capacity."""
        if self._arena is None:
            p = self.capacity_patches
            self._arena = arena.Arena(arena.slots(self.geometry, p, self.fused_swiglu))
            log.info("GLM vision scratch allocated on first encode: %d patches (%d tokens), %.1f MiB",
                     p, p // self.geometry.merge_patches, self._arena.nbytes / 2**20)
        return self._arena

    # -- one forward --------------------------------------------------------------------------------
    def encode_images(self, batch: list) -> cupy.ndarray:
        """Prepared images ((uint8 image, grid, info) each; their tokens within the capacity) -> their
        output rows, in order, as one bf16 array the caller owns."""
        tokens = sum(info["tokens"] for _, _, info in batch)
        return self._run([grid for _, grid, _ in batch], tokens, lambda s: self.stager.images(batch, s["pixels"]))

    def encode_pixels(self, grid: np.ndarray, tokens: int, pixel_values) -> cupy.ndarray:
        """Checked pixel rows (NumPy or this GPU's CuPy; float32, bf16 or any real type) -> output rows."""
        return self._run(grid, tokens, lambda s: stage_pixels(s["pixels_f32"], s["pixels"], pixel_values))

    def forward(self, plan, mark=None) -> None:
        """The forward over the arena's pixel rows, eagerly on the current stream (also what a capture
        records). mark(stage), when given, is called at each stage's end."""
        layers.forward(self.geometry, self.weights, self.arena(), plan, self.blas, mark, self.fused_swiglu)

    def _run(self, grid, tokens: int, stage) -> cupy.ndarray:
        """One forward of this grid under the lock, on our stream, after the caller's stream's work so far.
        stage(arena) fills the pixel rows and says whether they are float32 ones for the forward to cast.
        Returns a copy of the `tokens` output rows (the arena is reused), which the caller's current stream
        is made to wait for. Out of GPU memory is GpuOutOfMemory, with the model still usable."""
        with self.lock, self.device:
            try:
                return self._run_locked(grid, tokens, stage)
            except cupy.cuda.memory.OutOfMemoryError as e:
                # Nothing half-built is kept: the arena is either whole or absent, a plan whole or absent.
                cupy.get_default_memory_pool().free_all_blocks()
                raise GpuOutOfMemory(f"GPU out of memory on device {self.device.id} ({e}); the model is still "
                                     "usable: encode fewer tokens per call or build it with a smaller "
                                     "capacity_tokens") from None

    def _run_locked(self, grid, tokens: int, stage) -> cupy.ndarray:
        stream, caller = self.stream, cupy.cuda.get_current_stream()
        with stream:
            plan = self.plans.get(grid)  # its meta uploads are ordered before the kernels that read them
            stream.wait_event(caller.record())  # after the caller's work (its input, say)
            events = [("start", stream.record())]
            s = self.arena()
            self._set_pixels_cast(s, bool(stage(s)))
            # A budget's first call (second, for large ones) captures its graph (~250 launches become one;
            # capture costs about one eager forward), which then serves every later batch of that budget,
            # whatever its shapes.
            if self._may_capture(plan) and (plan.uses >= 1 or plan.patches < CAPTURE_ON_SECOND_CALL):
                self._capture(plan)
            plan.uses += 1
            if self.graphs and plan.graph is not None:
                plan.graph.launch(stream)
                events.append(("forward", stream.record()))
            else:
                self.forward(plan, lambda name: events.append((name, stream.record())))
            out = _copy(s["embeddings"][:tokens], stream)
            events.append(("copy_out", stream.record()))
            caller.wait_event(events[-1][1])
        self._events = events
        return out

    def _set_pixels_cast(self, s: arena.Arena, cast: bool) -> None:
        """The arena's pixels_cast flag (read by the forward's first kernel) set to `cast`, written only when
        it changes: only these writes change it, all on our stream, as plans skip a meta upload."""
        if cast is not self._pixels_cast:
            self._pixels_cast = None  # unknown until the write is enqueued
            cupy.cuda.runtime.memsetAsync(s["pixels_cast"].data.ptr, int(cast), 4, cupy.cuda.get_current_stream().ptr)
            self._pixels_cast = cast

    # -- CUDA graphs --------------------------------------------------------------------------------
    def _may_capture(self, plan) -> bool:
        return self.graphs and self.blas.capturable and plan.graph is None and not plan.capture_failed

    def precapture(self, image_patches: int, every_budget: bool = False) -> list[int]:
        """Capture now the graphs of the budgets that passes packed full of images of `image_patches`
        patches land in (those of >= CAPTURE_ON_SECOND_CALL patches: smaller ones capture on their first
        call anyway), and load them onto the GPU. every_budget: also every budget of the capacity, each
        variant at each tile count known ahead (PlanCache.ahead): the passes a service forms from
        whatever images come, so that none of them captures while requests wait. Returns the budgets
        whose graph is ready."""
        if not (self.graphs and self.blas.capturable):
            return []
        ready = []
        with self.lock, self.device, self.stream:
            self.arena()  # allocated outside the capture
            plans = [(b, [self.plans.full_pass(b, image_patches)])
                     for b in full_pass_budgets(self.capacity_patches, image_patches, CAPTURE_ON_SECOND_CALL)]
            if every_budget:
                size, self.plans.size = self.plans.size, float("inf")  # none is evicted while they are built
                try:
                    plans += [(b, self.plans.ahead(b)) for b in all_budgets(self.capacity_patches)]
                except BaseException:  # out of memory, say: the cache keeps its bound
                    self.plans.size = size
                    raise
                self.plans.size = len(self.plans) + MAX_PLANS
            # The forward reads every per-batch detail from the plan's device data: nothing to stage.
            for b, group in plans:
                for plan in group:
                    if self._may_capture(plan):
                        self._capture(plan, warm_up=True)
                        if plan.graph is not None:
                            plan.graph.upload(self.stream)  # else its first launch would
                if all(plan.graph is not None for plan in group) and b not in ready:
                    ready.append(b)
        return sorted(ready)

    def _capture(self, plan, warm_up: bool = False) -> None:
        """The budget's forward as a CUDA graph. A capture can fail where the same forward runs eagerly:
        on the H100, budget 6,144's first capture failed in cublasLtMatmul (cublasStatus 13) at a GEMM
        algorithm no call had launched yet (`pytest -m gpu tests/test_model_gpu.py -k every_budget`); a
        kernel loads on its first launch, which a capture does not allow. So a budget is captured again
        after an eager run has launched its kernels: at once when `warm_up` (precapture: no input is
        staged, so the arena is free for that run), else on its next call, the failed one running
        eagerly. After a second failure the budget runs eagerly from then on."""
        error = self._try_capture(plan)
        if error is not None and warm_up:
            try:
                self.forward(plan)
                error = self._try_capture(plan)
            except Exception as e:  # the budget cannot run eagerly either: its calls report that
                error = e
        if error is not None:
            plan.capture_tries += 1
            if warm_up or plan.capture_tries >= 2:
                plan.capture_failed = True
                log.warning("CUDA graph capture failed (%s); this shape runs without a graph", error)

    def _try_capture(self, plan) -> Exception | None:
        """Capture plan's forward into plan.graph; the error if that failed."""
        stream, graph, error = self.stream, None, None
        stream.begin_capture()
        try:
            self.forward(plan)
        except Exception as e:
            error = e
        try:
            graph = stream.end_capture()  # always ended, even after a failed forward
        except Exception as e:
            error = error or e
        if error is None:
            plan.graph = graph
        return error

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


def _copy(src: cupy.ndarray, stream) -> cupy.ndarray:
    """A copy of `src` the caller owns, made on `stream`. A contiguous slot is copied by memcpy: CuPy's
    copy() runs an element-wise kernel (7 us for 448²'s 2 MB of embeddings under ncu, after the graph)."""
    if not src.flags.c_contiguous:
        return src.copy()
    out = cupy.empty(src.shape, src.dtype)
    cupy.cuda.runtime.memcpyAsync(out.data.ptr, src.data.ptr, src.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                  stream.ptr)
    return out
