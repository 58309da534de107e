"""GlmVit: the GLM-5.3-Flash vision tower on one GPU, the public facade. It checks what a caller
passes, decides what this GPU and checkpoint allow (the attention variants, the fused SwiGLU), uploads
the weights (params.py) and hands every forward to its Runner (runner.py), which owns the stream, the
lock, the cuBLAS handle, the arena, the plans and the CUDA graphs.
"""

from __future__ import annotations

import logging
import math
import time
import warnings

import cupy
import numpy as np

from .. import checks, gpu
from ..checkpoint.bind import TowerBinding, bind_tower
from ..checks import check_resize
from ..config import VisionGeometry
from ..preprocessing.image import Patching
from ..preprocessing.video import frame_groups, plan_videos, video_pixels
from ..scheduling import batching, feed
from . import gemm_sm90, params
from .attention import check_variant, default_variants, score_bound_log2, value_bound_log2
from .runner import Runner
from .uploads import Wants

log = logging.getLogger("glmvit_cupy")


def _abs_max(binding: TowerBinding, suffix: str) -> float:
    """The largest |value| of one tower tensor; inf if it holds a NaN or an inf (then no bound)."""
    m = float(np.abs(binding.host(suffix).astype(np.float32)).max())
    return m if math.isfinite(m) else math.inf


def _capacity(capacity_tokens, max_image_tokens) -> int:
    """capacity_tokens, or its deprecated alias max_image_tokens."""
    if max_image_tokens is not None:
        warnings.warn("GlmVit(max_image_tokens=...) is deprecated: the per-call capacity is capacity_tokens "
                      "(max_image_tokens is the per-image resize limit of encode)", DeprecationWarning, stacklevel=3)
        if capacity_tokens is not None and capacity_tokens != max_image_tokens:
            raise ValueError(f"capacity_tokens={capacity_tokens} and the deprecated max_image_tokens="
                             f"{max_image_tokens} disagree; give capacity_tokens only")
        capacity_tokens = max_image_tokens
    return checks.check_capacity(8000 if capacity_tokens is None else capacity_tokens)


class GlmVit:
    """The vision tower on one GPU. Build with `GlmVit.from_checkpoint(path)`.

    capacity_tokens: the tokens one forward pass holds (scratch is sized from it on the first encode);
    attention_variant: force one of attention.VARIANTS (default: picked per input shape); graphs: run each
    token budget as a CUDA graph, captured on its first call (plans.py); fused_swiglu: the MLPs' gate/up
    GEMMs apply the clamped SwiGLU in their epilogue (gemm_sm90.cu; default: where it can run, Hopper GPUs
    and MLP widths it tiles; False: cuBLAS and a separate pass, as elsewhere); tune_gemms: time cublasLt's
    algorithms for the forward's GEMM shapes at load and keep the fastest that gives cuBLAS's default bits
    (gemm_tune.py; False: cuBLAS's default pick everywhere)."""

    def __init__(self, checkpoint, *, device: int | None = None, capacity_tokens: int | None = None,
                 attention_variant: str | None = None, graphs: bool = True, fused_swiglu: bool | None = None,
                 tune_gemms: bool = True, max_image_tokens: int | None = None):
        """checkpoint: a checkpoint folder, shard, index file or Hub id (checked and bound here, as
        from_checkpoint does), or a TowerBinding already bound (glmvit_cupy.bind_tower)."""
        gpu.require()  # no GPU, driver or CUDA library: GpuUnavailable saying which, not a CUDA error
        binding = checkpoint if isinstance(checkpoint, TowerBinding) else bind_tower(checkpoint)
        if device is not None:  # before CUDA's bare "invalid device ordinal" from the first call on it
            device = checks.check_device(device, cupy.cuda.runtime.getDeviceCount(), "device=",
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
        fits = cc == "90" and all(gemm_sm90.gate_up_swiglu_fits(k, i) for k, i in (
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
            self.runner = Runner(g, self.weights, self.device, variants=names, capacity_patches=self.capacity_patches,
                                 fused_swiglu=self.fused_swiglu, graphs=graphs, tune_gemms=tune_gemms)
            self.device.synchronize()
        self.weight_bytes = binding.nbytes
        self.load_seconds = time.perf_counter() - t0
        log.info("GLM vision tower bound from %s: %d tensors, %.1f MiB of BF16 uploaded in %.2f s "
                 "(only vision bytes were read)", binding.path, len(binding.layout),
                 binding.nbytes / 2**20, self.load_seconds)

    @classmethod
    def from_checkpoint(cls, path, device: int | None = None, *, capacity_tokens: int | None = None,
                        attention_variant: str | None = None, graphs: bool = True, fused_swiglu: bool | None = None,
                        tune_gemms: bool = True, devices=None, max_image_tokens: int | None = None) -> "GlmVit":
        """Check, bind and upload a checkpoint's tower (CheckpointError on any problem): path a checkpoint
        folder, one of its shards, its index file, or a Hub id. The keywords are the class's."""
        if devices is not None:
            raise TypeError("GlmVit.from_checkpoint runs on one GPU; for several use "
                            "glmvit_cupy.Replicas.from_checkpoint(path, devices=[0, 1, ...])")
        return cls(bind_tower(path), device=device, capacity_tokens=capacity_tokens,
                   attention_variant=attention_variant, graphs=graphs, fused_swiglu=fused_swiglu,
                   tune_gemms=tune_gemms, max_image_tokens=max_image_tokens)

    # -- settings ---------------------------------------------------------------------------------
    @property
    def graphs(self) -> bool:
        return self.runner.graphs

    @graphs.setter
    def graphs(self, on: bool):
        self.runner.graphs = on

    @property
    def last_timing(self) -> dict:
        """Milliseconds per stage of the last forward (see Runner.last_timing)."""
        return self.runner.last_timing

    @property
    def gemm_tuning(self) -> list[dict]:
        """Per GEMM shape of the forward: the cublasLt algorithm chosen at load, and why (gemm_tune.py)."""
        return self.runner.gemm_tuning

    def precapture(self, max_image_tokens: int, *, every_budget: bool = False) -> list[int]:
        """Capture now the CUDA graphs of the budgets that passes packed full of images of up to
        `max_image_tokens` tokens land in (those of >= runner.CAPTURE_ON_SECOND_CALL patches, which would
        otherwise run kernel by kernel on their first call and capture on their second), so that a
        stream's first full passes replay. every_budget: also those of every smaller budget, for passes
        of any images of >= 64 tokens on average (a service's: about 100 graphs at 8,000 tokens). Returns the budgets (patches) whose graphs are ready.

        Why at load: a forward's ~250 launches take 40 ms on an idle host but 200-430 ms while 16
        threads decode photos (docs/PERFORMANCE.md), and a stream's first passes run exactly then.
        glmvit-encode, the server and Ray do this for their image limit (the server for every budget);
        encode() does not (a library call's shapes are not known ahead)."""
        max_image_tokens = checks.check_positive("precapture: max_image_tokens", max_image_tokens)
        return self.runner.precapture(self.geometry.merge_patches * min(max_image_tokens, self.capacity_tokens),
                                      every_budget=bool(every_budget))

    # -- encoding ---------------------------------------------------------------------------------
    def encode_pixels(self, pixel_values, grid_thw) -> cupy.ndarray:
        """HF-layout input ([N, patch_dim] pixels, [n, 3] grid; NumPy or CuPy, float or bf16) -> bf16
        [N / merge^2, out_hidden_size] on this GPU (merge: spatial_merge_size). Runs on the model's own
        stream; the caller's current stream waits for the result (no host synchronisation)."""
        grid, n = checks.check_pixels(self.geometry, pixel_values, grid_thw.get() if isinstance(
            grid_thw, cupy.ndarray) else grid_thw, self.capacity_tokens)
        if isinstance(pixel_values, cupy.ndarray) and pixel_values.device.id != self.device.id:
            pixel_values = cupy.asnumpy(pixel_values)  # another GPU's array: through the host, safely ordered
        return self.runner.encode_pixels(grid, n // self.geometry.merge_patches, pixel_values)

    def encode_video_pixels(self, pixel_values_videos, video_grid_thw) -> list[cupy.ndarray]:
        """Video rows in HF's layout (preprocess_video's, or the reference processor's pixel_values_videos and
        video_grid_thw) -> one bf16 [tokens_i, out_hidden_size] per video. A video of more tokens than the
        capacity runs in passes of whole frame groups, short ones share passes: the same bits either way,
        as the tower encodes each temporal group on its own."""
        grid, _ = checks.check_pixels(self.geometry, pixel_values_videos, video_grid_thw.get() if isinstance(
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
        (glmvit_cupy.preprocessing.video.preprocess_video, whose settings `settings` passes on; its info, with the frames'
        timestamps, from video.plan_videos). resize "gpu" (default): the sampled frames are uploaded as they
        are and resized, padded and normalised on the GPU, bit for bit as the host; "host": on the host."""
        planned = plan_videos(videos, fps=fps, sample=sample, patching=Patching.of(self.geometry), **settings)
        return self.encode_planned_videos(planned, resize)

    def encode_planned_videos(self, planned: list, resize: str = "gpu") -> list[cupy.ndarray]:
        """video.plan_videos' (frames, grid, info) per video -> one bf16 output per video (resize: as
        encode_video's). Every video's frame group is checked against the capacity before any is encoded."""
        resize, g = check_resize(resize), self.geometry
        checks.check_planned_videos(planned, g.spatial_merge_size, self.capacity_tokens)
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
        one = batching.preparer(self.geometry, self.capacity_tokens, min_image_tokens, max_image_tokens, max_pixels,
                                resize=resize, decode=decode)
        wants = Wants()  # this call's consumer takes its images in order
        one = self.runner.uploads.uploading(one, wants)  # each decoding thread puts its images on this GPU
        images = [images] if single else list(images)
        prepared = feed.in_order(one, images, feed.default_workers() if workers is None else workers)
        return self.encode_prepared(wants.feeding(prepared))

    def encode_prepared(self, prepared: list) -> list[cupy.ndarray]:
        """(uint8 image, grid, info) triples (batching.preparer's; a list or a lazy iterable) -> one
        output per image, in order. Each batch is launched as soon as it is packed (no host wait)."""
        results = []
        for batch in batching.pack(prepared, self.capacity_tokens, lambda item: item[2]["tokens"]):
            out = self.runner.encode_images(batch)
            row = 0
            for _, _, info in batch:
                results.append(out[row:row + info["tokens"]])
                row += info["tokens"]
        return results
