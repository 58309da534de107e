"""glmvit-cupy: the GLM-5.3-Flash vision tower on CuPy and hand-written CUDA kernels.

The host half (config, checkpoint checks, preprocessing, batching, the float32 reference and every
error) imports without CuPy; the GPU engine (`GlmVit`, `Replicas`, `load_vision_tower`, in
glmvit_cupy.engine) needs CuPy and a GPU and is imported on first use.
"""

from .checkpoint import bind_tower, inspect_checkpoint
from .config import VisionGeometry, read_config
from .errors import AbsentTower, CheckpointError, GpuOutOfMemory, ImageError, KernelError, NoVisionConfig
from .preprocess import preprocess
from .weights import WeightStore

__version__ = "0.1.0"

__all__ = [
    "AbsentTower", "CheckpointError", "GlmVit", "GpuOutOfMemory", "ImageError", "KernelError", "NoVisionConfig",
    "Replicas", "VisionGeometry", "WeightStore", "bind_tower", "inspect_checkpoint", "load_vision_tower",
    "preprocess", "read_config",
]

_ENGINE = {"GlmVit": "model", "load_vision_tower": "model", "Replicas": "replicas"}


def __getattr__(name):
    # The GPU engine imports CuPy; keep `import glmvit_cupy` working on machines without it.
    if name in _ENGINE:
        import importlib

        return getattr(importlib.import_module(f".engine.{_ENGINE[name]}", __name__), name)
    raise AttributeError(f"module 'glmvit_cupy' has no attribute {name!r}")
