"""A checkpoint's vision tower, found, fetched and checked on the host (never imports the engine):

    bind        the binder: config geometry, prefix, and every tensor's presence, dtype and shape
    names       where the tower's tensors sit: prefixes, names and shapes
    shards      WeightStore: memory-mapped safetensors shards, every header checked first
    hub         only the vision shards of a Hugging Face Hub repository
    synthetic   random-weight checkpoints in the official layout (python -m glmvit_cupy.checkpoint.synthetic DIR)
"""

from .bind import TowerBinding, bind_tower, inspect_checkpoint, probe_tower
from .shards import WeightStore

__all__ = ["TowerBinding", "WeightStore", "bind_tower", "inspect_checkpoint", "probe_tower"]
