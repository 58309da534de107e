"""glmvit-cupy: the GLM-5.3-Flash vision tower on CuPy and hand-written CUDA kernels.

Every name here imports on any machine. The host half (config, checkpoint checks, preprocessing,
batching, the float32 reference and every error) needs no CuPy; the GPU engine (`GlmVit`,
`Replicas`, in glmvit_cupy.engine) is imported on first use, and where CuPy or the CUDA libraries
are missing those names stand for classes that raise GpuUnavailable, saying why, when built. The
host names but the errors are imported on first use too, so that `import glmvit_cupy`, which every
import of the commands begins with, takes a millisecond: a command's Ctrl-C while it imports meets
its own handler (cli.command), not a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (AbsentTower, CheckpointError, GpuOutOfMemory, GpuUnavailable, ImageError, KernelError,
                     NoVisionConfig, OutputError, ServerError, TooShort, Untimed)

__version__ = "0.2.0.dev0"

if TYPE_CHECKING:  # for type checkers only: at run time these are imported on first use
    import os

    from .checkpoint.bind import bind_tower, inspect_checkpoint, probe_tower
    from .checkpoint.shards import WeightStore
    from .config import VisionGeometry, read_config
    from .engine.model import GlmVit
    from .engine.replicas import Replicas
    from .preprocessing.image import Patching, preprocess
    from .preprocessing.video import preprocess_video

__all__ = [
    "AbsentTower", "CheckpointError", "GlmVit", "GpuOutOfMemory", "GpuUnavailable", "ImageError", "KernelError",
    "NoVisionConfig", "OutputError", "Patching", "Replicas", "ServerError", "TooShort", "Untimed", "VisionGeometry",
    "WeightStore", "bind_tower", "inspect_checkpoint", "load_vision_tower", "preprocess", "preprocess_video",
    "probe_tower", "read_config",
]

_ENGINE = {"GlmVit": "model", "Replicas": "replicas"}
# The host names (NumPy, Pillow and safetensors behind most): imported on first use, from these modules.
_HOST = {"bind_tower": "checkpoint.bind", "inspect_checkpoint": "checkpoint.bind", "probe_tower": "checkpoint.bind",
         "WeightStore": "checkpoint.shards", "VisionGeometry": "config", "read_config": "config",
         "Patching": "preprocessing.image", "preprocess": "preprocessing.image",
         "preprocess_video": "preprocessing.video"}
# The public modules, named in the docs: attributes of the package, imported on first use (ray needs Ray).
# checkpoint and config hold the host names' classes (glmvit_cupy.checkpoint.TowerBinding).
_MODULES = ("checkpoint", "checks", "client", "config", "output", "ray", "reference", "vllm_ec")


def __getattr__(name):
    if name in _MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _HOST:
        import importlib

        globals()[name] = obj = getattr(importlib.import_module(f".{_HOST[name]}", __name__), name)
        return obj
    # The GPU engine imports CuPy: import it on first use, so `import glmvit_cupy` works anywhere.
    if name in _ENGINE:
        from . import gpu

        why = gpu.import_problem()
        if why:
            return gpu.unavailable(name, why)
        import importlib

        globals()[name] = obj = getattr(importlib.import_module(f".engine.{_ENGINE[name]}", __name__), name)
        return obj
    raise AttributeError(f"module 'glmvit_cupy' has no attribute {name!r}")


def __dir__():
    """The public names, the documented modules and the dunders: not what this file itself imports to be written
    (TYPE_CHECKING; `annotations`, the __future__ import) nor its private tables."""
    own = {n for n in globals() if n.startswith("__") or not n.startswith("_")} - {"TYPE_CHECKING", "annotations"}
    return sorted(own | set(__all__) | set(_MODULES))


def load_vision_tower(path: str | os.PathLike, **kw) -> GlmVit | None:
    """For serving engines: the tower on the GPU (a GlmVit, keywords as GlmVit's), or None for a
    text-only checkpoint (quietly; no GPU or CuPy needed to find that out) and for a declared-but-
    absent tower (with a warning). Any other problem raises CheckpointError, or GpuUnavailable."""
    from .checkpoint.bind import probe_tower

    binding = probe_tower(path)
    return None if binding is None else __getattr__("GlmVit")(binding, **kw)
