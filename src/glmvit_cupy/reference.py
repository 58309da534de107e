"""The tower's forward pass in plain NumPy float32 (or float64): the oracle for the GPU path.

Written for clarity, one function per sub-layer, names as in the checkpoint. It
shares no compute code with the GPU engine, so a bug in one cannot hide in both.
Attention runs per segment, per head, in query chunks, so memory stays bounded.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from .checkpoint.bind import TowerBinding, bind_tower
from .checks import check_pixels
from .config import VisionGeometry


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu_erf(x):
    from math import erf, sqrt

    verf = np.vectorize(erf, otypes=[np.float64])
    return (0.5 * x * (1.0 + verf(x / sqrt(2.0)))).astype(x.dtype)


def silu(x):
    return x / (1.0 + np.exp(-x))


def clamped_swiglu(g, u, limit, stats=None, where=""):
    if stats is not None:
        stats.setdefault(where, {"gate_above": 0, "up_outside": 0})
        stats[where]["gate_above"] += int((g > limit).sum())
        stats[where]["up_outside"] += int((np.abs(u) > limit).sum())
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return silu(g) * u


def position_ids(grid_thw, merge):
    """(h, w) of every patch, in the input's merge x merge block row order, frame after frame."""
    rows = []
    for t, h, w in grid_thw:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        ww = ww.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        rows.append(np.tile(np.stack([hh, ww], axis=1), (t, 1)))
    return np.concatenate(rows, axis=0)


def segments(grid_thw):
    """Attention segments: each frame (h*w patches) of each image is its own."""
    bounds, start = [], 0
    for t, h, w in grid_thw:
        for _ in range(t):
            bounds.append((start, start + h * w))
            start += h * w
    return bounds


def rotary(pos, head_dim, theta, dtype):
    """cos, sin [N, head_dim]: angles [h*f, w*f] repeated twice, f = theta^(-2k/(head_dim/2))."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, spatial, 2, dtype=dtype) / spatial))
    ang = np.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=1).astype(dtype)
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang), np.sin(ang)


def rotate_half(x):
    d = x.shape[-1] // 2
    return np.concatenate([-x[..., d:], x[..., :d]], axis=-1)


def attention(q, k, v, bounds, chunk=1024):
    """softmax(q k^T / sqrt(d)) v inside each segment. q, k, v: [N, heads, d]."""
    n, heads, d = q.shape
    out = np.empty_like(q)
    scale = 1.0 / np.sqrt(d)
    for s, e in bounds:
        for hd in range(heads):
            ks, vs = k[s:e, hd], v[s:e, hd]
            for q0 in range(s, e, chunk):
                q1 = min(q0 + chunk, e)
                sc = (q[q0:q1, hd] @ ks.T) * scale
                sc = np.exp(sc - sc.max(axis=1, keepdims=True))
                out[q0:q1, hd] = (sc / sc.sum(axis=1, keepdims=True)) @ vs
    return out


class Tower:
    """The tower's weights as float arrays, keyed by checkpoint name (without prefix)."""

    def __init__(self, binding: TowerBinding, dtype=np.float32):
        """binding: bind_tower's (or a checkpoint path, bound here); dtype: float32 (the oracle) or float64."""
        if not isinstance(binding, TowerBinding):
            binding = bind_tower(binding)
        try:
            ok = dtype is not None and np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64))
        except TypeError:  # not a dtype at all
            ok = False
        if not ok:
            raise ValueError(f"the reference computes in float32 or float64, not {dtype!r}: an integer or a half "
                             "type would compute another tower; give dtype=np.float32 (or np.float64)")
        dtype = np.dtype(dtype)
        self.geo: VisionGeometry = binding.geometry
        self.w = {s: binding.host(s).astype(dtype) for s in binding.layout}
        self.dtype = dtype
        bad = {s: n for s, w in self.w.items() if (n := int(np.count_nonzero(~np.isfinite(w))))}
        if bad:  # NaN or inf weights: every output would be NaN (the GPU model refuses them alike)
            raise binding.nonfinite_error(bad)

    def block(self, i, x, cos, sin, bounds, stats):
        g, w, p = self.geo, self.w, f"blocks.{i}."
        n = x.shape[0]
        h = rms_norm(x, w[p + "norm1.weight"], g.rms_norm_eps)
        qkv = h @ w[p + "attn.qkv.weight"].T + w[p + "attn.qkv.bias"]
        q, k, v = qkv.reshape(n, 3, g.num_heads, g.head_dim).transpose(1, 0, 2, 3)
        q = rms_norm(q, w[p + "attn.q_norm.weight"], g.rms_norm_eps)
        k = rms_norm(k, w[p + "attn.k_norm.weight"], g.rms_norm_eps)
        c, s = cos[:, None, :], sin[:, None, :]
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        o = attention(q, k, v, bounds).reshape(n, -1)
        x = x + o @ w[p + "attn.proj.weight"].T + w[p + "attn.proj.bias"]
        h = rms_norm(x, w[p + "norm2.weight"], g.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T + w[p + "mlp.gate_proj.bias"]
        up = h @ w[p + "mlp.up_proj.weight"].T + w[p + "mlp.up_proj.bias"]
        act = clamped_swiglu(gate, up, g.swiglu_limit, stats, f"blocks.{i}")
        return x + act @ w[p + "mlp.down_proj.weight"].T + w[p + "mlp.down_proj.bias"]

    def downsample(self, x):
        """The m x m Conv2d of stride m over each frame: m^2 consecutive rows are one block (the input's
        row order), so it is a GEMM over their im2col in the weight's (channel, kh, kw) order."""
        g, w = self.geo, self.w
        cols = x.reshape(-1, g.merge_patches, g.hidden_size).transpose(0, 2, 1).reshape(-1, g.merge_dim)
        return cols @ w["downsample.weight"].T + w["downsample.bias"]

    def merger(self, x, stats):
        g, w = self.geo, self.w
        x = rms_norm(x, w["post_layernorm.weight"], g.rms_norm_eps)
        y = self.downsample(x) @ w["merger.proj.weight"].T
        y = gelu_erf(layer_norm(y, w["merger.post_projection_norm.weight"], w["merger.post_projection_norm.bias"]))
        gate = y @ w["merger.gate_proj.weight"].T
        up = y @ w["merger.up_proj.weight"].T
        return clamped_swiglu(gate, up, g.swiglu_limit, stats, "merger") @ w["merger.down_proj.weight"].T

    def forward(self, pixel_values, grid_thw, stats=None):
        # One BLAS thread: a multithreaded sgemm may sum in another order (5 of 6,144 bf16 outputs of a
        # golden image changed between 1 and 2 threads), and the reference must give the same bits in
        # every process: a Ray worker (one thread), a server, a test.
        # Weights too large for float arithmetic overflow to infinity and NaN, without NumPy's warning lines
        # (as on the GPU): the commands count non-finite outputs and refuse them, saying why.
        with _one_blas_thread(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return self._forward(pixel_values, grid_thw, stats)

    def _forward(self, pixel_values, grid_thw, stats=None):
        g = self.geo
        try:
            pixel_values = np.asarray(pixel_values)
        except (ValueError, TypeError) as e:  # a ragged list: NumPy's message names no argument
            raise ValueError(f"pixel_values must be an array of shape [patches, {g.patch_dim}]; the rows given are "
                             f"not one ({e})") from None
        grid_thw, _ = check_pixels(g, pixel_values, grid_thw)  # the GPU path's checks and messages
        with np.errstate(over="ignore"):  # a float64 past float32's range: infinity, refused just below
            x = pixel_values.astype(self.dtype)
        finite = np.isfinite(x).all(axis=1)
        if not finite.all():  # NaN or infinity would spread through attention to every row of its image
            bad = np.flatnonzero(~finite)
            raise ValueError(f"pixel_values: {len(bad):,} of {len(x):,} rows hold NaN or infinity (in {self.dtype}"
                             f"; the first is row {bad[0]}); pixels must be finite, as preprocess gives them")
        x = x @ self.w["patch_embed.proj.weight"].T + self.w["patch_embed.proj.bias"]
        cos, sin = rotary(position_ids(grid_thw, g.spatial_merge_size).astype(self.dtype), g.head_dim,
                          g.rope_theta, self.dtype)
        bounds = segments(grid_thw)
        for i in range(g.depth):
            x = self.block(i, x, cos, sin, bounds, stats)
        return self.merger(x, stats)


_pin = {"forwards": 0, "undo": None, "setters": None}  # the forwards running; how to lift their shared limit
_pin_lock = threading.Lock()


def _openblas_setters() -> list:
    """openblas_set_num_threads_local of each BLAS loaded, where every one is an OpenBLAS that has it
    (0.3.27 on), else []. With threadpoolctl's openblas_set_num_threads instead, forwards on four threads
    at once gave other bits than one alone (OpenBLAS 0.3.31,
    tests/test_reference.py::test_forwards_on_several_threads_leave_the_processs_blas_limit_as_it_was);
    with this call they give the same."""
    from threadpoolctl import ThreadpoolController

    found, blas = [], ThreadpoolController().select(user_api="blas").lib_controllers
    if any(lib.internal_api != "openblas" for lib in blas):  # MKL or BLIS beside it: the process-wide limit
        return []
    for lib in blas:
        fn = next((getattr(lib.dynlib, name) for name in ("openblas_set_num_threads_local",
                                                          "scipy_openblas_set_num_threads_local64_",
                                                          "openblas_set_num_threads_local64_")
                   if hasattr(lib.dynlib, name)), None)
        if fn is None:
            return []
        found.append(fn)
    return found


@contextlib.contextmanager
def _one_blas_thread():
    """BLAS at one thread while any forward runs, shared by the forwards running on several threads: set by
    the first to start, lifted by the last to end (each setting and lifting its own would lift it under a
    forward still running, and leave the process at one thread after). Set through OpenBLAS's own call
    where it has one (see _openblas_setters), else threadpoolctl's process-wide limit."""
    with _pin_lock:
        if _pin["forwards"] == 0:
            if _pin["setters"] is None:
                _pin["setters"] = _openblas_setters()
            if _pin["setters"]:
                before = [fn(1) for fn in _pin["setters"]]  # each returns the count it replaced
                _pin["undo"] = lambda: [fn(n) for fn, n in zip(_pin["setters"], before)]
            else:
                from threadpoolctl import threadpool_limits

                _pin["undo"] = threadpool_limits(limits=1, user_api="blas").restore_original_limits
        _pin["forwards"] += 1
    try:
        yield
    finally:
        with _pin_lock:
            _pin["forwards"] -= 1
            if _pin["forwards"] == 0:
                _pin["undo"]()
                _pin["undo"] = None


def encode_pixels(checkpoint_path, pixel_values, grid_thw, *, dtype=None, stats=None) -> np.ndarray:
    """HF transformers 5.23.0's Glm5NextVisionModel forward in NumPy: [N, patch_dim] pixels -> [N / m^2, out_hidden].

    `dtype`: float32 (None, the default) or float64. `checkpoint_path` may also be a TowerBinding or a Tower
    (to reuse loaded weights: it computes in its own dtype, and another `dtype` given is a ValueError).
    `stats`, a dict, receives per-layer counts of values the SwiGLU clamp cut.
    """
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict (it receives the clamp's counts per layer) or None, not "
                         f"{type(stats).__name__}")
    if isinstance(checkpoint_path, Tower):
        tower = checkpoint_path
        try:
            if dtype is None:
                dtype = tower.dtype
            same = np.dtype(dtype) == tower.dtype
        except TypeError:
            same = False
        if not same:
            raise ValueError(f"dtype={dtype!r}, but this Tower computes in {tower.dtype.name}: build a "
                             f"Tower(binding, dtype) for another, or leave dtype out")
    else:
        tower = Tower(checkpoint_path, np.float32 if dtype is None else dtype)
    return tower.forward(pixel_values, grid_thw, stats)
