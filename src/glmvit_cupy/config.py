"""The tower's geometry: one frozen object read from a checkpoint's config.json.

Every field the encoder needs lives here, so the loader, the reference and the
GPU engine cannot disagree on, say, which of two 4096s is the intermediate size.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass

from .errors import CheckpointError, NoVisionConfig, quoted
from .files import read_json_file

VISION_MODEL_TYPES = ("glm5_next_vision", "glm_ocr_vision")
FLOAT32_TINY = 2.0**-126  # float32's least normal value: an rms_norm_eps below it is lost in the norms' float32 sum
FLOAT32_MAX = 3.4028234663852886e38  # float32's largest value: past it a setting the kernels take in float32 is inf


# Pixel values one output token takes (in_channels x temporal_patch_size x (patch_size x spatial_merge_size)^2):
# 4,704 in GLM-5.3-Flash. The token limits bound tokens, so this bounds an image's canvas: 8,000 tokens of this
# many values are 4.2 GB in float32.
MAX_VALUES_PER_TOKEN = 1 << 17
# The largest size a geometry's integer field takes: a shard's header refuses a tensor dimension past it
# (shards.MAX_DIM), and past 4,300 digits an integer cannot even be printed in an error (JSON gives 4,000).
MAX_SIZE = 2**40


# A geometry's integer fields, each a positive integer, and why where it is not.
_PATCH = "a patch needs a non-zero integer size (the Conv3d kernel is this big)"
_SIZES = {**dict.fromkeys(("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                           "projection_intermediate_size", "in_channels"), "it must be a positive integer"),
          "patch_size": _PATCH, "temporal_patch_size": _PATCH,
          "spatial_merge_size": "the downsample merges m x m patches into a token (a Conv2d of kernel and stride m), "
                                "so m must be a positive integer"}


@dataclass(frozen=True)
class VisionGeometry:
    """Glm5NextVisionConfig's fields that decide what the tower computes.

    Defaults are Glm5NextVisionConfig's (transformers 5.23.0), used for any field
    a config.json leaves out. The official GLM-5.3-Flash checkpoint sets
    out_hidden_size = 4096 (the class default is 1536); see `official()`.
    """

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0

    # -- derived sizes ---------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one pixel_values row: (channel, temporal, py, px) = 3 x 2 x 14 x 14 = 1176."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_patches(self) -> int:
        """Patches that merge into one output token: spatial_merge_size^2 = 4."""
        return self.spatial_merge_size**2

    @property
    def merge_dim(self) -> int:
        """Width of one downsample im2col row: hidden x 2 x 2 = 4096."""
        return self.hidden_size * self.merge_patches

    def embedding_bytes(self, tokens: int) -> int:
        """Bytes of `tokens` output embeddings (bf16 rows of out_hidden_size): what a pass or a file holds."""
        return tokens * self.out_hidden_size * 2

    @property
    def tensor_count(self) -> int:
        """14 tensors per block + 11 outside: 24 x 14 + 11 = 347."""
        return 14 * self.depth + 11

    @classmethod
    def official(cls) -> "VisionGeometry":
        """GLM-5.3-Flash's released geometry: the class defaults with out_hidden_size 4096."""
        return cls(out_hidden_size=4096)

    def validate(self, where: str = "vision_config") -> "VisionGeometry":
        """Reject geometries the encoder cannot compute, saying why."""

        def bad(field, value, why):
            raise CheckpointError(f"{where}: {field} = {quoted(value, 80)} cannot work: {why}")

        for field, why in _SIZES.items():
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(field, v, why)
        for field in _SIZES:
            if getattr(self, field) > MAX_SIZE:
                bad(field, getattr(self, field), f"it is past 2**40 ({MAX_SIZE:,}), more than any tensor's dimension "
                    "or a checkpoint's blocks")
        m = self.spatial_merge_size
        per_token = self.in_channels * self.temporal_patch_size * (self.patch_size * m) ** 2
        if per_token > MAX_VALUES_PER_TOKEN:
            bad("spatial_merge_size", m,
                f"a token would take in_channels x temporal_patch_size x (patch_size x spatial_merge_size)^2 = "
                f"{self.in_channels} x {self.temporal_patch_size} x ({self.patch_size} x {m})^2 = {per_token:,} pixel "
                f"values, past the {MAX_VALUES_PER_TOKEN:,} this encoder takes (GLM-5.3-Flash: 4,704); the token "
                "limits count tokens, so such a tower would turn a small image into gigabytes of patches")
        if self.hidden_size % self.num_heads:
            bad("hidden_size", self.hidden_size,
                f"it is not divisible by num_heads = {self.num_heads}, so heads would not tile the width")
        if self.head_dim % 4:
            bad("num_heads", self.num_heads,
                f"head_dim = {self.hidden_size} / {self.num_heads} = {self.head_dim} is not a multiple of 4; "
                "the axial RoPE splits a head into an h half and a w half, and rotates each half by halves")
        if not (isinstance(self.rms_norm_eps, float) and math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            bad("rms_norm_eps", self.rms_norm_eps, "it must be a positive finite float (it sits under a square root)")
        if self.rms_norm_eps < FLOAT32_TINY:
            bad("rms_norm_eps", self.rms_norm_eps, f"the norms add it in float32, where it is below the least normal "
                f"value ({FLOAT32_TINY:.4g}) and rounds to 0 or loses its precision; give at least that")
        if self.rms_norm_eps > FLOAT32_MAX:
            bad("rms_norm_eps", self.rms_norm_eps, f"the norms add it in float32, where it is past the largest value "
                f"({FLOAT32_MAX:.4g}) and becomes infinite: every norm would give 0 and every image the same "
                "embedding")
        for field in ("swiglu_limit", "rope_theta"):
            v = getattr(self, field)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):  # NumPy numbers too
                bad(field, v, "it must be a number")
        if not (math.isfinite(self.swiglu_limit) and self.swiglu_limit > 0):
            bad("swiglu_limit", self.swiglu_limit, "the SwiGLU clamp needs a positive finite limit")
        if self.swiglu_limit < FLOAT32_TINY:
            bad("swiglu_limit", self.swiglu_limit, f"the SwiGLU clamp runs in float32, where it is below the least "
                f"normal value ({FLOAT32_TINY:.4g}) and clamps every activation to 0 or about it; give at least that")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            bad("rope_theta", self.rope_theta, "RoPE frequencies theta^(-2k/d) need theta > 1")
        return self


def _as_int_size(field, value, where):
    # HF allows patch_size as [14, 14], a patch's height and width; the tower only supports square patches.
    # A list of another length ([2, 14, 14]: a Conv3d kernel's) is no patch side, whatever its values.
    if isinstance(value, (list, tuple)):
        sides = field != "patch_size" or len(value) == 2
        if not sides or len(value) == 0 or any(not isinstance(v, int) or isinstance(v, bool) for v in value) \
                or len(set(value)) != 1:
            why = ("a list gives a patch's [height, width], and only square patches are supported"
                   if field == "patch_size" else "a list must hold one size (the frames a patch spans)")
            raise CheckpointError(f"{where}: {field} = {quoted(value, 80)} cannot work: {why}")
        value = value[0]
    return value


def _as_float(key: str, value, where: str) -> float:
    try:
        return float(value)
    except OverflowError:
        raise CheckpointError(f"{where}: {key} = {quoted(value)} is past any float") from None


def geometry_from_dict(vision: dict, *, text_hidden_size=None, where: str = "vision_config",
                       text_key: str = "text_config.hidden_size") -> VisionGeometry:
    """Build and validate a geometry from a vision_config dictionary."""
    if not isinstance(vision, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(vision).__name__}")
    mt = vision.get("model_type")
    if mt is not None and mt not in VISION_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: model_type = {quoted(mt, 80)} is not a GLM vision tower (expected one of {VISION_MODEL_TYPES})")
    kw = {}
    aliases = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
    for alias, name in aliases.items():
        if alias in vision and name in vision and vision[alias] != vision[name]:
            raise CheckpointError(f"{where}: {name} = {quoted(vision[name])} but {alias} = {quoted(vision[alias])}; "
                                  "the two name one size: give one, or both equal")
    fields = {f.name: f for f in dataclasses.fields(VisionGeometry)}
    for key, value in vision.items():
        key = aliases.get(key, key)
        if key in fields and key != "rope_theta":
            kw[key] = value
    for field in ("patch_size", "temporal_patch_size"):
        if field in kw:
            kw[field] = _as_int_size(field, kw[field], where)
    rope = vision.get("rope_parameters")
    rope = {} if rope is None else rope
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope_parameters = {quoted(rope, 80)} must be an object")
    rope_type = rope.get("rope_type", "axial")
    if rope_type != "axial":
        raise CheckpointError(f"{where}: rope_parameters.rope_type = {quoted(rope_type, 80)} cannot work: "
                              "the GLM tower's rotary embedding is axial (h, w) only")
    theta = rope.get("rope_theta", vision.get("rope_theta", 10000.0))
    for key in ("rms_norm_eps", "swiglu_limit"):
        if key in kw and isinstance(kw[key], int) and not isinstance(kw[key], bool):
            kw[key] = _as_float(key, kw[key], where)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise CheckpointError(f"{where}: rope_theta = {quoted(theta)} must be a number")
    kw["rope_theta"] = _as_float("rope_theta", theta, where)
    for key in ("rms_norm_eps", "swiglu_limit"):
        if key in kw and (not isinstance(kw[key], float)):
            raise CheckpointError(f"{where}: {key} = {quoted(kw[key], 80)} must be a number")
    if vision.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act = {quoted(vision['hidden_act'], 80)} cannot work: "
                              "the tower's SwiGLU kernels compute silu")
    if vision.get("attention_bias", True) is not True:
        raise CheckpointError(f"{where}: attention_bias = {quoted(vision['attention_bias'], 80)} is not supported: "
                              "GLM-5.3-Flash's qkv, proj and MLP projections all carry biases")
    geo = VisionGeometry(**kw).validate(where)
    if text_hidden_size is not None and (not isinstance(text_hidden_size, int) or isinstance(text_hidden_size, bool)):
        raise CheckpointError(f"{where}: {text_key} = {quoted(text_hidden_size)} must be an integer (the "
                              "width of a text embedding row, which out_hidden_size must equal)")
    if text_hidden_size is not None and text_hidden_size != geo.out_hidden_size:
        raise CheckpointError(
            f"{where}: out_hidden_size = {geo.out_hidden_size} but {text_key} = {quoted(text_hidden_size, 80)}; "
            "each image token's embedding replaces one text embedding row, so the widths must be equal")
    return geo


def read_config(path: str | os.PathLike) -> VisionGeometry:
    """Read config.json (a file, or the directory holding it) into a VisionGeometry.

    Accepts a multimodal config (model_type glm5_next, with vision_config) or a bare
    vision config. A text-only config raises NoVisionConfig, a CheckpointError.
    """
    path = os.fsdecode(path)  # a bytes path too, as bind_tower takes it
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    cfg = read_json_file(path, "config.json", 16 << 20,
                         missing=f"{path}: no such file; a checkpoint directory needs a config.json to know its geometry")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: config.json must hold a JSON object, not {type(cfg).__name__}")
    if cfg.get("model_type") in VISION_MODEL_TYPES:
        return geometry_from_dict(cfg, where=f"{path}")
    if "vision_config" not in cfg or cfg["vision_config"] is None:
        raise NoVisionConfig(
            f"{path}: text-only checkpoint (model_type {quoted(cfg.get('model_type'), 80)} has no vision_config); "
            "it has no vision tower to load")
    text = cfg.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CheckpointError(f"{path}: text_config = {quoted(text)} must be an object (HF's text model config)")
    text_hidden, text_key = (text.get("hidden_size") if isinstance(text, dict) else None), "text_config.hidden_size"
    if text_hidden is None and text is None:
        text_hidden, text_key = cfg.get("hidden_size"), "the top-level hidden_size"  # flat text fields, as HF takes them
    return geometry_from_dict(cfg["vision_config"], text_hidden_size=text_hidden, where=f"{path}: vision_config",
                              text_key=text_key)
