"""GlmVit: the GLM-5.3-Flash vision tower on one GPU. A thin facade over the engine's parts:

    params.upload     the weights on the GPU            layers.forward   the maths, top-down
    arena.Arena       scratch, sized once               plans.PlanCache  per-budget index data + graphs
    executor.Executor stream, cuBLAS, lock, CUDA graphs, timing
    staging.Stager    inputs into the arena: uploads, and the resize + patchify on the GPU
"""

from __future__ import annotations

import logging
import math
import time
import warnings

import cupy
import numpy as np

from .. import batching, gpu
from ..checkpoint import TowerBinding, bind_tower
from ..config import VisionGeometry
from ..preprocess import Patching, check_resize, value_table
from ..video import frame_groups, plan_videos, video_pixels
from ..video import value_table as video_value_table
from . import arena, fused, gemm_tune, layers, params
from .attention import check_variant, default_variants, score_bound_log2, value_bound_log2
from .budgets import full_pass_budgets
from .executor import CAPTURE_ON_SECOND_CALL, Executor
from .plans import PlanCache
from .staging import Stager, stage_pixels
from .uploads import Uploader

log = logging.getLogger("glmvit_cupy")


def _abs_max(binding: TowerBinding, suffix: str) -> float:
    """The largest |value| of one tower tensor; inf if it holds a NaN or an inf (then no bound)."""
    m = float(np.abs(binding.host(suffix).astype(np.float32)).max())
    return m if math.isfinite(m) else math.inf


def _capacity(capacity_tokens, max_image_tokens) -> int:
    """capacity_tokens, or the deprecated keyword that once meant it."""
    if max_image_tokens is not None:
        warnings.warn("GlmVit(max_image_tokens=...) is deprecated: the per-call capacity is now capacity_tokens "
                      "(max_image_tokens is the per-image resize limit of encode)", DeprecationWarning, stacklevel=3)
        if capacity_tokens is not None and capacity_tokens != max_image_tokens:
            raise ValueError(f"capacity_tokens={capacity_tokens} and the deprecated max_image_tokens="
                             f"{max_image_tokens} disagree; give capacity_tokens only")
        capacity_tokens = max_image_tokens
    return batching.check_capacity(8000 if capacity_tokens is None else capacity_tokens)


class GlmVit:
    """The vision tower on one GPU. Build with `GlmVit.from_checkpoint(path)`.

    capacity_tokens: the tokens one forward pass holds (scratch is sized from it on the first encode);
    attention_variant: force one of attention.VARIANTS (default: picked per input shape); graphs: run each
    token budget as a CUDA graph, captured on its first call (plans.py); fused_swiglu: the MLPs' gate/up
    GEMMs apply the clamped SwiGLU in their epilogue (gemm_sm90.cu; default: where it can run, Hopper GPUs
    and MLP widths it tiles; False: cuBLAS and a separate pass, as elsewhere); tune_gemms: time cublasLt's
    algorithms for the forward's GEMM shapes at load and keep the fastest that gives cuBLAS's default bits
    (gemm_tune.py; False: cuBLAS's default pick everywhere)."""

    MAX_PLANS = 48  # token budgets (by attention variant and tile count) whose CUDA graph stays cached

    def __init__(self, binding: TowerBinding, *, device=None, capacity_tokens: int | None = None,
                 attention_variant: str | None = None, graphs: bool = True, max_image_tokens: int | None = None,
                 fused_swiglu: bool | None = None, tune_gemms: bool = True):
        gpu.require()  # no GPU, driver or CUDA library: GpuUnavailable saying which, not a CUDA error
        if device is not None:  # before CUDA's bare "invalid device ordinal" from the first call on it
            device = batching.check_device(device, cupy.cuda.runtime.getDeviceCount(), "device=",
                                           "; for several GPUs use glmvit_cupy.Replicas")
        g = binding.geometry
        self.geometry: VisionGeometry = g
        self.capacity_tokens = _capacity(capacity_tokens, max_image_tokens)
        self.device = cupy.cuda.Device(device if device is not None else cupy.cuda.Device().id)
        cc = self.device.compute_capability
        # Every score's bound from the q_norm / k_norm weights: within attention.FIXED_OFFSET_LIMIT the
        # Hopper kernels drop the softmax's running max.
        self.score_bound = max(score_bound_log2(_abs_max(binding, f"blocks.{i}.attn.q_norm.weight"),
                                                _abs_max(binding, f"blocks.{i}.attn.k_norm.weight"), g.head_dim)
                               for i in range(g.depth))
        # And |v|'s from norm1 and attn.qkv's V rows: the output of those kernels must stay a float.
        h = g.hidden_size
        self.value_bound = max(value_bound_log2(binding.host(f"blocks.{i}.norm1.weight"),
                                                binding.host(f"blocks.{i}.attn.qkv.weight")[2 * h:],
                                                binding.host(f"blocks.{i}.attn.qkv.bias")[2 * h:])
                               for i in range(g.depth))
        self.capacity_patches = self.capacity_tokens * g.merge_patches  # the rows one forward pass holds
        bounds = (self.score_bound, self.value_bound, self.capacity_patches)  # a segment: at most one pass
        names = (check_variant(attention_variant, g.head_dim, cc, *bounds).name,) if attention_variant \
            else default_variants(g.head_dim, cc, *bounds)
        fits = cc == "90" and all(fused.gate_up_swiglu_fits(k, i) for k, i in (
            (g.hidden_size, g.intermediate_size), (g.out_hidden_size, g.projection_intermediate_size)))
        if fused_swiglu and not fits:
            raise ValueError(
                f"fused_swiglu=True cannot run here: gemm_sm90.cu needs a Hopper GPU (compute capability 9.0; "
                f"this is {cc[:-1]}.{cc[-1]}), hidden_size and out_hidden_size multiples of 64 "
                f"({g.hidden_size}, {g.out_hidden_size}) and intermediate sizes multiples of 128 "
                f"({g.intermediate_size}, {g.projection_intermediate_size}); leave it unset")
        self.fused_swiglu = fits if fused_swiglu is None else bool(fused_swiglu)
        t0 = time.perf_counter()
        with self.device:
            self.weights = params.upload(binding)
            self.value_table = cupy.asarray(value_table())  # [3, 256] float32: uint8 -> normalised value
            self.plans = PlanCache(names, g.num_heads, g.hidden_size, self.device.attributes["MultiProcessorCount"],
                                   self.capacity_patches, g.spatial_merge_size, self.MAX_PLANS)
            self.executor = Executor(self.device, graphs)
            # Per GEMM shape: its fastest cublasLt algorithm with cuBLAS's default bits (report: gemm_tune).
            self.gemm_tuning = gemm_tune.tune(self.executor.blas, layers.gemm_shapes(
                g, self.capacity_patches, self.fused_swiglu)) if tune_gemms else []
            self.stager = Stager(self.value_table, g.temporal_patch_size, g.patch_size, g.spatial_merge_size,
                                 cupy.asarray(video_value_table()))
            self.uploads = Uploader(self.device)  # prepare threads put decoded images on this GPU through it
            self.device.synchronize()
        self._arena = None
        self._pixels_cast = None  # what the arena's pixels_cast flag holds once the model's stream gets there
        self.weight_bytes = binding.nbytes
        self.load_seconds = time.perf_counter() - t0
        log.info("GLM vision tower bound from %s: %d tensors, %.1f MiB of BF16 uploaded in %.2f s "
                 "(only vision bytes were read)", binding.path, len(binding.layout),
                 binding.nbytes / 2**20, self.load_seconds)

    @classmethod
    def from_checkpoint(cls, path, device: int | None = None, *, capacity_tokens: int | None = None, devices=None,
                        **kw) -> "GlmVit":
        """Check, bind and upload a checkpoint's tower (CheckpointError on any problem)."""
        if devices is not None:
            raise TypeError("GlmVit.from_checkpoint runs on one GPU; for several use "
                            "glmvit_cupy.Replicas.from_checkpoint(path, devices=[0, 1, ...])")
        return cls(bind_tower(path), device=device, capacity_tokens=capacity_tokens, **kw)

    # -- settings ---------------------------------------------------------------------------------
    @property
    def graphs(self) -> bool:
        return self.executor.graphs

    @graphs.setter
    def graphs(self, on: bool):
        self.executor.graphs = on

    @property
    def last_timing(self) -> dict:
        """Milliseconds per stage of the last forward (see Executor.last_timing)."""
        return self.executor.last_timing

    def arena(self) -> arena.Arena:
        """The scratch, allocated on first use, once, sized from capacity_tokens."""
        if self._arena is None:
            patches = self.capacity_patches
            self._arena = arena.Arena(arena.layout(self.geometry, patches, self.fused_swiglu))
            log.info("GLM vision scratch allocated on first encode: %d patches (%d tokens), %.1f MiB",
                     patches, self.capacity_tokens, self._arena.nbytes / 2**20)
        return self._arena

    def precapture(self, max_image_tokens: int) -> list[int]:
        """Capture now the CUDA graphs of the budgets that passes packed full of images of up to
        `max_image_tokens` tokens land in (those of >= CAPTURE_ON_SECOND_CALL patches, which would
        otherwise run kernel by kernel on their first call and capture on their second), so that a
        stream's first full passes replay. Returns the budgets (patches) whose graph is ready.

        Why at load: a forward's ~250 launches take 40 ms on an idle host but 200-430 ms while 16
        threads decode photos (measured, docs/PERFORMANCE.md), and a stream's first passes run exactly
        then. glmvit-encode, the server and Ray do this for their image limit; encode() does not (a
        library call's shapes are not known ahead)."""
        max_image_tokens = batching.check_positive("precapture: max_image_tokens", max_image_tokens)
        if not (self.graphs and self.executor.blas.capturable):
            return []
        image = self.geometry.merge_patches * min(max_image_tokens, self.capacity_tokens)
        ready = []
        with self.device:
            self.arena()  # allocated outside the capture
            for b in full_pass_budgets(self.capacity_patches, image, CAPTURE_ON_SECOND_CALL):
                if self.executor.capture(self.plans.full_pass(b, image), self._forward):
                    ready.append(b)
        return ready

    # -- encoding ---------------------------------------------------------------------------------
    def encode_pixels(self, pixel_values, grid_thw) -> cupy.ndarray:
        """HF-layout input ([N, patch_dim] pixels, [n, 3] grid; NumPy or CuPy, float or bf16) -> bf16
        [N / merge^2, out_hidden_size] on this GPU (merge: spatial_merge_size). Runs on the model's own
        stream; the caller's current stream waits for the result (no host synchronisation)."""
        grid, n = batching.check_pixels(self.geometry, pixel_values, grid_thw.get() if isinstance(
            grid_thw, cupy.ndarray) else grid_thw, self.capacity_tokens)
        if isinstance(pixel_values, cupy.ndarray) and pixel_values.device.id != self.device.id:
            pixel_values = cupy.asnumpy(pixel_values)  # another GPU's array: through the host, safely ordered
        return self._encode(grid, n // self.geometry.merge_patches,
                            lambda s: stage_pixels(s["pixels_f32"], s["pixels"], pixel_values))

    def encode_video_pixels(self, pixel_values_videos, video_grid_thw) -> list[cupy.ndarray]:
        """Video rows in HF's layout (preprocess_video's, or the reference processor's pixel_values_videos and
        video_grid_thw) -> one bf16 [tokens_i, out_hidden_size] per video. A video of more tokens than the
        capacity runs in passes of whole frame groups, short ones share passes: the same bits either way,
        as the tower encodes each temporal group on its own."""
        grid, _ = batching.check_pixels(self.geometry, pixel_values_videos, video_grid_thw.get() if isinstance(
            video_grid_thw, cupy.ndarray) else video_grid_thw)
        outs = [[] for _ in range(len(grid))]
        for batch in batching.pack(batching.frame_pieces(grid, self.capacity_tokens, self.geometry.spatial_merge_size),
                                   self.capacity_tokens, lambda p: p.tokens):
            start, end = batch[0].start, batch[-1].start + batch[-1].rows  # pieces are consecutive rows
            out = self.encode_pixels(pixel_values_videos[start:end], [p.grid for p in batch])
            row = 0
            for p in batch:
                outs[p.video].append(out[row:row + p.tokens])
                row += p.tokens
        with self.device:  # on this model's GPU and its stream order, whatever device the caller has current
            return [o[0] if len(o) == 1 else cupy.concatenate(o) for o in outs]

    def encode_video(self, videos, *, fps=None, sample: bool = True, resize: str = "gpu",
                     **settings) -> list[cupy.ndarray]:
        """Decoded videos (uint8 [T, H, W, 3] arrays or lists of frames; one or a list) -> one bf16
        [tokens_i, out_hidden_size] per video, preprocessed exactly as the reference video processor
        (glmvit_cupy.video.preprocess_video, whose settings `settings` passes on; its info, with the frames'
        timestamps, from video.plan_videos). resize "gpu" (default): the sampled frames are uploaded as they
        are and resized, padded and normalised on the GPU, bit for bit as the host; "host": on the host."""
        planned = plan_videos(videos, fps=fps, sample=sample, patching=Patching.of(self.geometry), **settings)
        return self.encode_planned_videos(planned, resize)

    def encode_planned_videos(self, planned: list, resize: str = "gpu") -> list[cupy.ndarray]:
        """video.plan_videos' (frames, grid, info) per video -> one bf16 output per video (resize: as
        encode_video's). Every video's frame group is checked against the capacity before any is encoded."""
        resize, g = check_resize(resize), self.geometry
        batching.check_planned_videos(planned, g.spatial_merge_size, self.capacity_tokens)
        if resize == "host":
            return self.encode_video_pixels(*video_pixels(planned, Patching.of(g)))
        outs = iter(self.encode_prepared([item for frames, grid, info in planned
                                          for item in frame_groups(frames, grid, info, g.temporal_patch_size)]))
        joined = []
        with self.device:  # as encode_video_pixels: the joins on this model's GPU
            for _, grid, _ in planned:  # a video's groups are consecutive outputs
                parts = [next(outs) for _ in range(grid[0])]
                joined.append(parts[0] if len(parts) == 1 else cupy.concatenate(parts))
        return joined

    def encode(self, images, *, min_image_tokens: int = 16, max_image_tokens: int | None = None,
               max_pixels: int | None = None, resize: str = "gpu", decode: str = "cpu",
               workers: int | None = None) -> list[cupy.ndarray]:
        """Images (paths, file objects, bytes, PIL images, HxWx3 uint8 arrays) -> one bf16 [tokens_i,
        out_hidden] CuPy array per image, preprocessed exactly as the reference processor with these
        limits (max_image_tokens None: 8000, or the capacity if smaller; max_pixels: the decompression-bomb
        guard for encoded images, default Pillow's 89.5 MP). Images share forward passes as the capacity
        allows; `workers` threads decode ahead while the GPU runs. resize "gpu" (default): the GPU resizes,
        bit for bit as Pillow; "host": Pillow does. decode "gpu": JPEGs decoded by nvImageCodec (not
        bit-identical to Pillow's decoder; see docs/PERFORMANCE.md)."""
        single = not isinstance(images, (list, tuple))
        prepared = batching.prepare_images(self.geometry, self.capacity_tokens, [images] if single else list(images),
                                           min_image_tokens, max_image_tokens, max_pixels, resize=resize,
                                           decode=decode, workers=workers, host_buffer=self.uploads.buffer,
                                           upload=self.uploads)
        return self.encode_prepared(prepared)

    def encode_prepared(self, prepared: list) -> list[cupy.ndarray]:
        """(uint8 image, grid, info) triples (batching.prepare_images; a list or a lazy iterable) -> one
        output per image, in order. Each batch is launched as soon as it is packed (no host wait)."""
        results = []
        for batch in batching.pack(prepared, self.capacity_tokens, lambda item: item[2]["tokens"]):
            out = self._encode([grid for _, grid, _ in batch], sum(info["tokens"] for _, _, info in batch),
                               lambda s, b=batch: self._stage_images(b, s))
            row = 0
            for _, _, info in batch:
                results.append(out[row:row + info["tokens"]])
                row += info["tokens"]
        return results

    def _stage_images(self, batch, s) -> bool:
        self.stager.images(batch, s["pixels"])
        return False  # bf16 rows written: nothing for the forward to cast

    def _encode(self, grid, tokens: int, stage):
        """One forward of this grid (`tokens` output rows, over its token budget), stage(arena) filling the
        pixel rows and saying whether they are float32 ones for the forward to cast."""
        def staged():
            s = self.arena()
            self._set_pixels_cast(s, bool(stage(s)))

        return self.executor.run(lambda: self.plans.get(grid), staged, self._forward,
                                 lambda plan: self.arena()["embeddings"][:tokens])

    def _set_pixels_cast(self, s, cast: bool):
        """The arena's pixels_cast flag (read by the forward's first kernel) set to `cast`, written only when
        it changes: only these writes change it, all on the model's stream, as plans skip a meta upload."""
        if cast is not self._pixels_cast:
            self._pixels_cast = None  # unknown until the write is enqueued
            cupy.cuda.runtime.memsetAsync(s["pixels_cast"].data.ptr, int(cast), 4, cupy.cuda.get_current_stream().ptr)
            self._pixels_cast = cast

    def _forward(self, plan, mark):
        layers.forward(self.geometry, self.weights, self.arena(), plan, self.executor.blas, mark, self.fused_swiglu)

