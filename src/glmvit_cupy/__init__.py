"""glmvit-cupy: the GLM-5.3-Flash vision tower on CuPy and hand-written CUDA kernels.

The CPU half (config, checkpoint checks, preprocessing, the float32 reference)
imports without CuPy; `GlmVit` needs CuPy and a GPU and is imported on first use.
"""

from .checkpoint import AbsentTower, bind_tower, inspect_checkpoint
from .config import NoVisionConfig, VisionGeometry, read_config
from .errors import CheckpointError, ImageError
from .preprocess import preprocess
from .weights import WeightStore

__version__ = "0.1.0"

__all__ = [
    "AbsentTower", "CheckpointError", "GlmVit", "ImageError", "NoVisionConfig", "VisionGeometry",
    "WeightStore", "bind_tower", "inspect_checkpoint", "load_vision_tower", "preprocess", "read_config",
]


def __getattr__(name):
    # The GPU engine imports CuPy; keep `import glmvit_cupy` working on machines without it.
    if name in ("GlmVit", "load_vision_tower"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'glmvit_cupy' has no attribute {name!r}")
