"""GlmVit: the GLM-5.3-Flash vision tower on the GPU.

Reads top-down: from_checkpoint binds and uploads the weights; forward() runs the
patch embed, the blocks (attention, then MLP) and the merger, one small method each.
The residual stream is float32 (the reference keeps it in bf16): every sub-layer's
GEMM accumulates straight into it (cuBLAS beta = 1), and its bias is added by the
next norm, which reads the stream anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import cupy
import numpy as np

from .attention import FlashAttention, default_variants, pick_variant
from .checkpoint import TowerBinding, bind_tower, probe_tower
from .config import VisionGeometry, check_grid
from .gemm import BF16, Handle, gemm
from .kernels import kernel
from .preprocess import MERGE, prepare_canvas, value_table

log = logging.getLogger("glmvit_cupy")


class GpuOutOfMemory(MemoryError):
    """The GPU ran out of memory; the model is still usable (try fewer tokens per call)."""


@dataclass
class Block:
    norm1: cupy.ndarray
    qkv_w: cupy.ndarray
    qkv_b: cupy.ndarray
    q_norm: cupy.ndarray
    k_norm: cupy.ndarray
    proj_w: cupy.ndarray
    proj_b: cupy.ndarray
    norm2: cupy.ndarray
    gate_up_w: cupy.ndarray  # [gate; up] concatenated at load: one GEMM for both
    gate_b: cupy.ndarray
    up_b: cupy.ndarray
    down_w: cupy.ndarray
    down_b: cupy.ndarray


@dataclass
class Merger:
    post_layernorm: cupy.ndarray
    downsample_w: cupy.ndarray
    downsample_b: cupy.ndarray
    proj_w: cupy.ndarray
    norm_w: cupy.ndarray
    norm_b: cupy.ndarray
    gate_up_w: cupy.ndarray
    down_w: cupy.ndarray


@dataclass
class _Plan:
    """One input shape: its per-patch positions, segment bounds and attention tiles on the device,
    and, once the shape repeats, the CUDA graph of its forward."""
    n: int
    pos: cupy.ndarray
    cu: cupy.ndarray
    tile_seg: cupy.ndarray
    tile_q0: cupy.ndarray
    attn: FlashAttention
    uses: int = 0
    graph: object = None
    capture_failed: bool = False


def _upload(binding: TowerBinding, *suffixes):
    """Upload one tensor, or several concatenated along rows (gate and up)."""
    hosts = [binding.host(s) for s in suffixes]
    if len(hosts) == 1:
        out = cupy.empty(hosts[0].shape, dtype=BF16)
        out.set(np.ascontiguousarray(hosts[0]))
        return out
    out = cupy.empty((sum(h.shape[0] for h in hosts),) + hosts[0].shape[1:], dtype=BF16)
    row = 0
    for h in hosts:
        out[row:row + h.shape[0]].set(np.ascontiguousarray(h))
        row += h.shape[0]
    return out


def _cdiv(a, b):
    return -(-a // b)


def _slot_bytes(shape, dtype) -> int:
    """Bytes an arena view takes: every view starts 256-byte aligned."""
    return _cdiv(int(np.prod(shape)) * np.dtype(dtype).itemsize, 256) * 256


class Arena:
    """One device allocation carved into named views. Phases that never overlap in time
    (input staging, the blocks, the merger) share the same bytes."""

    def __init__(self, layout: dict):
        # layout: {phase: {name: (shape, dtype)}}; phase "keep" is never shared.
        def size(spec):
            return sum(_slot_bytes(s, d) for s, d in spec.values())

        keep = size(layout.get("keep", {}))
        shared = max((size(v) for k, v in layout.items() if k != "keep"), default=0)
        self.nbytes = keep + shared
        self.base = cupy.empty(self.nbytes, dtype=cupy.uint8)
        self.views = {}
        for phase, spec in layout.items():
            off = 0 if phase == "keep" else keep
            for name, (shape, dtype) in spec.items():
                self.views[name] = cupy.ndarray(shape, dtype=np.dtype(dtype), memptr=self.base.data + off)
                off += _slot_bytes(shape, dtype)

    def __getitem__(self, name):
        return self.views[name]


def _blocks(n, threads=256):
    return (int(min(max(1, _cdiv(n, threads)), 65535 * 8)),)


def _row_grid(rows, cols, per_thread=8, threads=256):
    """x over a row's columns (per_thread a thread), y over rows: cuda/activations.cu swiglu."""
    return (_cdiv(_cdiv(cols, per_thread), threads), int(min(rows, 65535)))


class GlmVit:
    """The vision tower on one GPU. Build with `GlmVit.from_checkpoint(path)`."""

    QKV_CHUNK = 4096     # rows per QKV / MLP GEMM chunk (bounds the fp32 intermediates)
    MERGER_CHUNK = 2048  # merged rows per merger chunk
    MAX_PLANS = 32       # input shapes whose index data (and CUDA graph) stay cached

    def __init__(self, binding: TowerBinding, *, device=None, max_image_tokens: int = 8000,
                 attention_variant: str | None = None, graphs: bool = True):
        geo = binding.geometry
        if not isinstance(max_image_tokens, int) or max_image_tokens < 1:
            raise ValueError(f"max_image_tokens={max_image_tokens!r} must be a positive integer")
        if geo.head_dim not in (32, 64, 128):
            raise ValueError(f"head_dim {geo.head_dim}: the attention kernel is built for 32, 64 and 128")
        self.geometry: VisionGeometry = geo
        self.max_image_tokens = max_image_tokens
        self.max_patches = max_image_tokens * MERGE * MERGE
        self.device = cupy.cuda.Device(device if device is not None else cupy.cuda.Device().id)
        self._lock = threading.Lock()
        self._arena = None
        self._events: list = []
        self._plans: OrderedDict = OrderedDict()
        self.graphs = graphs
        t0 = time.perf_counter()
        with self.device:
            self.patch_w = _upload(binding, "patch_embed.proj.weight")
            self.patch_b = _upload(binding, "patch_embed.proj.bias")
            self.blocks = [self._bind_block(binding, i) for i in range(geo.depth)]
            self.merger = Merger(
                post_layernorm=_upload(binding, "post_layernorm.weight"),
                downsample_w=_upload(binding, "downsample.weight"),
                downsample_b=_upload(binding, "downsample.bias"),
                proj_w=_upload(binding, "merger.proj.weight"),
                norm_w=_upload(binding, "merger.post_projection_norm.weight"),
                norm_b=_upload(binding, "merger.post_projection_norm.bias"),
                gate_up_w=_upload(binding, "merger.gate_proj.weight", "merger.up_proj.weight"),
                down_w=_upload(binding, "merger.down_proj.weight"),
            )
            spatial = geo.head_dim // 2
            # As the reference computes it, in float32: 1 / theta^(arange(0, spatial, 2) / spatial).
            exps = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
            self.inv_freq = cupy.asarray(np.float32(1.0) / np.power(np.float32(geo.rope_theta), exps))
            self._sms = self.device.attributes["MultiProcessorCount"]
            self._kernels(attention_variant)
            self._stream = cupy.cuda.Stream(non_blocking=True)  # ours: graphs capture on it
            self._blas = Handle(self._stream)
            self.device.synchronize()
        self.weight_bytes = binding.nbytes
        self.load_seconds = time.perf_counter() - t0
        log.info("GLM vision tower bound from %s: %d tensors, %.1f MiB of BF16 uploaded in %.2f s "
                 "(only vision bytes were read)", binding.path, len(binding.layout),
                 binding.nbytes / 2**20, self.load_seconds)

    @classmethod
    def from_checkpoint(cls, path, device=None, max_image_tokens: int = 8000, *, devices=None, **kw):
        """Check, bind and upload a checkpoint's tower (CheckpointError on any problem).

        With devices=[0, 1, ...] the result is a Replicas: one copy per GPU, batches spread across them."""
        binding = bind_tower(path)
        if devices is not None:
            if device is not None:
                raise ValueError("give device or devices, not both")
            from .replicas import Replicas

            return Replicas(binding, devices, max_image_tokens=max_image_tokens, **kw)
        return cls(binding, device=device, max_image_tokens=max_image_tokens, **kw)

    @staticmethod
    def _bind_block(b: TowerBinding, i: int) -> Block:
        p = f"blocks.{i}."
        return Block(
            norm1=_upload(b, p + "norm1.weight"), qkv_w=_upload(b, p + "attn.qkv.weight"),
            qkv_b=_upload(b, p + "attn.qkv.bias"), q_norm=_upload(b, p + "attn.q_norm.weight"),
            k_norm=_upload(b, p + "attn.k_norm.weight"), proj_w=_upload(b, p + "attn.proj.weight"),
            proj_b=_upload(b, p + "attn.proj.bias"), norm2=_upload(b, p + "norm2.weight"),
            gate_up_w=_upload(b, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            gate_b=_upload(b, p + "mlp.gate_proj.bias"), up_b=_upload(b, p + "mlp.up_proj.bias"),
            down_w=_upload(b, p + "mlp.down_proj.weight"), down_b=_upload(b, p + "mlp.down_proj.bias"),
        )

    def _kernels(self, attention_variant):
        self.k_rms = kernel("norms", "rmsnorm_residual")
        self.k_rms_im2col = kernel("norms", "rmsnorm_im2col")
        self.k_ln_gelu = kernel("norms", "layernorm_gelu")
        # QKV and gate/up GEMMs write bf16 (as the reference's Linear layers do; their biases are
        # added in fp32 by these kernels): half the bytes the two memory-bound kernels read.
        self.k_rope = kernel("rotary", "qk_norm_rope_bf16")
        self.k_swiglu = kernel("activations", "swiglu_clamp_bf16")
        self.k_bias = kernel("activations", "bias_to_bf16")
        self.k_cast = kernel("activations", "f32_to_bf16")
        self.k_patchify = kernel("pixels", "patchify_u8")
        self.value_table = cupy.asarray(value_table())  # [3, 256] float32: uint8 -> normalised value
        d = self.geometry.head_dim
        names = [attention_variant] if attention_variant else default_variants(d, self.device.compute_capability)
        self.attns = {v: FlashAttention(d, v) for v in names}  # one is picked per input shape

    # -- scratch ----------------------------------------------------------------------
    def _scratch(self) -> Arena:
        """Allocated on the first encode, once, sized from max_image_tokens."""
        if self._arena is None:
            g, p = self.geometry, self.max_patches
            ch, cm = min(p, self.QKV_CHUNK), min(p // 4, self.MERGER_CHUNK)
            h, f32, bf = g.hidden_size, np.float32, BF16
            layout = {
                "keep": {"x": ((p, h), f32)},
                "input": {"pixels_f32": ((p, g.patch_dim), f32), "pixels": ((p, g.patch_dim), bf),
                          "canvas": ((p * g.in_channels * g.patch_size ** 2,), np.uint8)},
                "blocks": {"n": ((p, h), bf), "q": ((p, h), bf), "k": ((p, h), bf), "v": ((p, h), bf),
                           "o": ((p, h), bf), "qkv": ((ch, 3 * h), bf),
                           "gu": ((ch, 2 * g.intermediate_size), bf), "act": ((ch, g.intermediate_size), bf)},
                # "out" lives in the merger phase, smaller than the blocks phase: it costs no bytes.
                "merger": {"out": ((p // 4, g.out_hidden_size), bf),
                           "cols": ((p // 4, g.merge_dim), bf), "y": ((cm, g.out_hidden_size), f32),
                           "yb": ((cm, g.out_hidden_size), bf),
                           "mgu": ((cm, 2 * g.projection_intermediate_size), bf),
                           "mact": ((cm, g.projection_intermediate_size), bf)},
            }
            self._arena = Arena(layout)
            log.info("GLM vision scratch allocated on first encode: %d patches (%d tokens), %.1f MiB",
                     p, self.max_image_tokens, self._arena.nbytes / 2**20)
        return self._arena

    # -- input checks -----------------------------------------------------------------
    def _check(self, pixel_values, grid_thw):
        g = self.geometry
        grid = check_grid(grid_thw.get() if isinstance(grid_thw, cupy.ndarray) else grid_thw)
        n = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
        if pixel_values.ndim != 2 or pixel_values.shape[1] != g.patch_dim:
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; each row must be one patch of "
                             f"{g.patch_dim} values (channel {g.in_channels} x temporal {g.temporal_patch_size} x "
                             f"{g.patch_size} x {g.patch_size})")
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw describes {n} patches")
        if n > self.max_patches:
            raise ValueError(f"{n} patches ({n // 4} tokens) exceed this model's capacity of {self.max_patches} "
                             f"patches (max_image_tokens={self.max_image_tokens}); split the batch or build the "
                             "model with a larger max_image_tokens")
        return grid, n

    def _plan_for(self, grid, n) -> "_Plan":
        """This input shape's device-side index data (cached per shape, with its CUDA graph)."""
        key = tuple(map(tuple, grid.tolist()))
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        pos, cu = [], [0]
        for t, h, w in grid.tolist():
            hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            blk = (h // 2, 2, w // 2, 2)
            p = np.stack([hh.reshape(blk).transpose(0, 2, 1, 3).ravel(),
                          ww.reshape(blk).transpose(0, 2, 1, 3).ravel()], axis=1)
            for _ in range(t):  # each frame is its own attention segment
                pos.append(p)
                cu.append(cu[-1] + h * w)
        cu = np.array(cu, np.int32)
        attn = self.attns[pick_variant(self.attns, np.diff(cu), self.geometry.num_heads, self._sms)]
        tile_seg, tile_q0 = attn.tiles(cu)
        plan = _Plan(n, *(cupy.asarray(a) for a in (np.concatenate(pos).astype(np.int32), cu, tile_seg, tile_q0)),
                     attn)
        self._plans[key] = plan
        while len(self._plans) > self.MAX_PLANS:
            self._plans.popitem(last=False)
        return plan

    # -- the forward pass ---------------------------------------------------------------
    def encode_pixels(self, pixel_values, grid_thw) -> cupy.ndarray:
        """HF-layout input ([N, patch_dim] pixels, [n, 3] grid; NumPy or CuPy) -> bf16 [N/4, out_hidden_size].

        The work runs on the model's own stream; the caller's current stream is made to wait for
        the result (no host synchronisation), so the output is ready for whatever runs next there."""
        grid, n = self._check(pixel_values, grid_thw)
        if isinstance(pixel_values, cupy.ndarray) and pixel_values.device.id != self.device.id:
            pixel_values = cupy.asnumpy(pixel_values)  # another GPU's array: through the host, safely ordered
        return self._run(lambda: self._stage_pixels(pixel_values, n), grid, n)

    def _run(self, stage, grid, n):
        """One forward under the model lock; stage() fills the arena's bf16 pixel rows first."""
        with self._lock, self.device:
            try:
                return self._forward(stage, grid, n)
            except cupy.cuda.memory.OutOfMemoryError as e:
                # Nothing half-built is kept: the arena is either whole or absent.
                cupy.get_default_memory_pool().free_all_blocks()
                raise GpuOutOfMemory(f"GPU out of memory encoding {n} patches on device {self.device.id} "
                                     f"({e}); the model is still usable: encode fewer tokens per call or build it "
                                     "with a smaller max_image_tokens") from None

    def _forward(self, stage, grid, n):
        s, stream, caller = self._scratch(), self._stream, cupy.cuda.get_current_stream()
        with stream:
            plan = self._plan_for(grid, n)  # its uploads are ordered before the kernels that read them
            stream.wait_event(caller.record())  # stream-ordered after the caller's work (its input, say)
            ev = [("start", stream.record())]
            stage()
            # A shape seen twice is worth a graph: ~250 launches become one (capture costs ~one forward).
            if self.graphs and self._blas.capturable and plan.graph is None and plan.uses and not plan.capture_failed:
                self._capture(plan)
            plan.uses += 1
            if self.graphs and plan.graph is not None:
                plan.graph.launch(stream)
                ev.append(("forward", stream.record()))
            else:
                self._body(plan, ev)
            out = s["out"][:n // 4].copy()  # the arena is reused by the next call; the caller owns this
            ev.append(("copy_out", stream.record()))
            caller.wait_event(ev[-1][1])
        self._events = ev
        return out

    def _body(self, plan, ev=None):
        """The whole forward from staged bf16 pixels to s["out"]: the part a CUDA graph captures."""
        s, n = self._scratch(), plan.n
        x = s["x"][:n]
        self._gemm(s["pixels"][:n], self.patch_w, x)  # the bias is added by block 0's norm
        if ev is not None:
            ev.append(("patch_embed", self._stream.record()))
        bias = self.patch_b
        for blk in self.blocks:
            self.attention(blk, x, bias, plan)
            self.mlp(blk, x, n)
            bias = blk.down_b
        if ev is not None:
            ev.append(("blocks", self._stream.record()))
        self.merge(x, bias, n, s["out"][:n // 4])
        if ev is not None:
            ev.append(("merger", self._stream.record()))

    def _gemm(self, a, w, out, beta=0.0):
        gemm(a, w, out, beta, handle=self._blas)

    def _capture(self, plan):
        """The shape's forward as a CUDA graph; if capture fails, the shape runs eagerly from then on."""
        stream, graph, error = self._stream, None, None
        stream.begin_capture()
        try:
            self._body(plan)
        except Exception as e:
            error = e
        try:
            graph = stream.end_capture()  # always ended, even after a failed body
        except Exception as e:
            error = error or e
        if error is not None:
            plan.capture_failed = True
            log.warning("CUDA graph capture failed (%s); this shape runs without a graph", error)
            return
        plan.graph = graph

    @property
    def last_timing(self) -> dict:
        """Milliseconds per stage of the last forward (waits for it): patch_embed (with the pixel upload),
        blocks, merger, copy_out; a forward replayed from its CUDA graph has one "forward" stage instead
        of the first three."""
        ev = self._events
        if not ev:
            return {}
        ev[-1][1].synchronize()
        return {b: cupy.cuda.get_elapsed_time(ea, eb) for (_, ea), (b, eb) in zip(ev, ev[1:])}

    def _stage_pixels(self, pixel_values, n):
        """Pixels -> the arena's bf16 staging rows (outside any graph: the source differs per call)."""
        s, pd = self._scratch(), self.geometry.patch_dim
        pix = s["pixels"][:n]
        if isinstance(pixel_values, cupy.ndarray) and pixel_values.dtype == BF16:
            pix[...] = pixel_values
            return
        if isinstance(pixel_values, cupy.ndarray):
            src = cupy.ascontiguousarray(pixel_values, dtype=np.float32)
        else:
            src = s["pixels_f32"][:n]
            src.set(np.ascontiguousarray(pixel_values, dtype=np.float32))
        self.k_cast(_blocks(n * pd), (256,), (src, pix, np.int64(n * pd)))

    def _stage_canvases(self, canvases):
        """uint8 canvases -> the arena's bf16 pixel rows, one upload and one patchify launch each."""
        s, g = self._scratch(), self.geometry
        off = row = 0
        for canvas in canvases:
            h, w = canvas.shape[:2]
            rows = (h // g.patch_size) * (w // g.patch_size)
            dst = s["canvas"][off:off + canvas.size]
            dst.set(np.ascontiguousarray(canvas).reshape(-1))
            self.k_patchify(_blocks(rows * 3 * g.patch_size ** 2), (256,),
                            (dst, self.value_table, s["pixels"][row:row + rows], np.int32(h), np.int32(w),
                             np.int32(g.temporal_patch_size), np.int32(g.patch_size)))
            off += canvas.size
            row += rows

    def attention(self, blk: Block, x, bias, plan):
        """x += proj(attn(rope(norm(qkv(rmsnorm(x + bias))))))."""
        g, s, n = self.geometry, self._scratch(), plan.n
        h, heads, d = g.hidden_size, g.num_heads, g.head_dim
        nrm, q, k, v, o = (s[a][:n] for a in ("n", "q", "k", "v", "o"))
        self.k_rms((n,), (256,), (x, bias, blk.norm1, nrm, np.int32(n), np.int32(h), np.float32(g.rms_norm_eps)))
        pos = plan.pos
        for r0 in range(0, n, self.QKV_CHUNK):
            rows = min(self.QKV_CHUNK, n - r0)
            qkv = s["qkv"][:rows]
            self._gemm(nrm[r0:r0 + rows], blk.qkv_w, qkv)
            self.k_rope(_blocks(rows * heads * d // 8), (256,),  # a thread per (row, head, 4 pairs)
                        (qkv, blk.qkv_b, blk.q_norm, blk.k_norm, pos, self.inv_freq, q, k, v,
                         np.int32(rows), np.int32(r0), np.int32(heads), np.int32(d), np.float32(g.rms_norm_eps)))
        plan.attn(q, k, v, o, plan.cu, plan.tile_seg, plan.tile_q0, heads)
        self._gemm(o, blk.proj_w, x, beta=1.0)

    def mlp(self, blk: Block, x, n):
        """x += down(silu(min(gate, L)) * clamp(up, -L, L)), row chunk by row chunk."""
        g, s = self.geometry, self._scratch()
        nrm, inter = s["n"][:n], g.intermediate_size
        self.k_rms((n,), (256,), (x, blk.proj_b, blk.norm2, nrm, np.int32(n), np.int32(g.hidden_size),
                                  np.float32(g.rms_norm_eps)))
        for r0 in range(0, n, self.QKV_CHUNK):
            rows = min(self.QKV_CHUNK, n - r0)
            gu, act = s["gu"][:rows], s["act"][:rows]
            self._gemm(nrm[r0:r0 + rows], blk.gate_up_w, gu)
            self.k_swiglu(_row_grid(rows, inter), (256,),
                          (gu, blk.gate_b, blk.up_b, act, np.int64(rows), np.int32(inter), np.float32(g.swiglu_limit)))
            self._gemm(act, blk.down_w, x[r0:r0 + rows], beta=1.0)

    def merge(self, x, bias, n, out):
        """post_layernorm -> 2x2 im2col -> downsample conv -> merger MLP, into out [n/4, out_hidden]."""
        g, s, m = self.geometry, self._scratch(), self.merger
        cols = s["cols"][:n // 4]
        self.k_rms_im2col((n,), (256,), (x, bias, m.post_layernorm, cols, np.int32(n), np.int32(g.hidden_size),
                                         np.float32(g.rms_norm_eps)))
        oh, pi = g.out_hidden_size, g.projection_intermediate_size
        for r0 in range(0, n // 4, self.MERGER_CHUNK):
            rows = min(self.MERGER_CHUNK, n // 4 - r0)
            y, yb, mgu, mact = s["y"][:rows], s["yb"][:rows], s["mgu"][:rows], s["mact"][:rows]
            self._gemm(cols[r0:r0 + rows], m.downsample_w, y)
            self.k_bias(_blocks(rows * oh), (256,), (y, m.downsample_b, yb, np.int64(rows), np.int32(oh)))
            self._gemm(yb, m.proj_w, y)
            self.k_ln_gelu((rows,), (256,), (y, m.norm_w, m.norm_b, yb, np.int32(rows), np.int32(oh),
                                             np.float32(1e-5)))
            self._gemm(yb, m.gate_up_w, mgu)
            self.k_swiglu(_row_grid(rows, pi), (256,), (mgu, np.uint64(0), np.uint64(0), mact, np.int64(rows),
                                                       np.int32(pi), np.float32(g.swiglu_limit)))
            self._gemm(mact, m.down_w, out[r0:r0 + rows])

    # -- images -------------------------------------------------------------------------
    def encode(self, images, *, min_image_tokens: int = 16, max_image_tokens: int = 8000) -> list:
        """Images (paths, file objects, PIL images, HxWx3 uint8 arrays) -> one bf16 [tokens_i, out_hidden]
        CuPy array per image, preprocessed exactly as the reference processor with these token limits.
        Images are packed into as few forward passes as the model's capacity allows."""
        single = not isinstance(images, (list, tuple))
        prepared = prepare_images(self, [images] if single else list(images), min_image_tokens, max_image_tokens)
        return self.encode_prepared(prepared)

    def encode_prepared(self, prepared) -> list:
        """(canvas, grid, info) triples from prepare_images -> one output per image, in order. The uint8
        canvases are uploaded and normalised + patchified on the GPU (bit-identical to the host's)."""
        results, batch = [], []

        def flush():
            if not batch:
                return
            canvases = [c for c, _, _ in batch]
            grid = np.array([gr for _, gr, _ in batch], np.int64)
            out = self._run(lambda: self._stage_canvases(canvases), grid, int((grid[:, 1] * grid[:, 2]).sum()))
            row = 0
            for _, _, info in batch:
                results.append(out[row:row + info["tokens"]])
                row += info["tokens"]
            batch.clear()

        used = 0
        for item in prepared:
            patches = item[1][1] * item[1][2]
            if used + patches > self.max_patches:
                flush()
                used = 0
            batch.append(item)
            used += patches
        flush()
        return results


def prepare_images(model, images, min_image_tokens, max_image_tokens) -> list:
    """Host preprocessing for encode(): checks the geometry, prepares each image, checks capacity."""
    g = model.geometry
    if g.in_channels != 3 or g.patch_size != 14 or g.temporal_patch_size != 2:
        raise ValueError("encode(images) needs the RGB, 14-pixel, 2-frame patch geometry of the preprocessor; "
                         "use encode_pixels for others")
    prepared = [prepare_canvas(im, i, min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens)
                for i, im in enumerate(images)]
    for _, grid, info in prepared:
        if grid[1] * grid[2] > model.max_patches:
            raise ValueError(f"{info['source']}: {info['tokens']} tokens exceed this model's capacity of "
                             f"{model.max_image_tokens} tokens; build it with max_image_tokens >= "
                             f"{info['tokens']} or pass a smaller max_image_tokens to encode()")
    return prepared


def load_vision_tower(path, **kw) -> GlmVit | None:
    """For serving engines: the tower, or None for a text-only checkpoint (quietly) and for a
    declared-but-absent tower (with a warning). Any other problem raises CheckpointError."""
    binding = probe_tower(path)
    return None if binding is None else GlmVit(binding, **kw)
