"""Which tower encodes, for the commands and the service: the GPU engine (one replica per device) or,
with cpu=True, the float32 NumPy reference. Either takes prepared images (uint8 canvas, grid, info)
and returns each image's embedding as a host bf16 array; `lanes` batches can run at once, one per
replica. Both are batch-invariant: an image's embedding has the same bits whatever it is batched
with (the reference computes each image on its own; the engine's GEMMs never split their sums).
"""

from __future__ import annotations

import numpy as np


class Backend:
    def __init__(self, binding, *, cpu: bool, devices: list[int] | None = None, capacity_tokens: int = 8000):
        import ml_dtypes

        self.geometry = binding.geometry
        self.capacity_tokens = capacity_tokens
        self.cpu = cpu
        self.resize = "host" if cpu else "gpu"  # who resizes the images this backend is given
        if cpu:
            from . import reference

            self._tower = reference.Tower(binding)
            self._bf16 = ml_dtypes.bfloat16
            self.lanes = 1
            self.name = "cpu (float32 reference)"
        else:
            from . import gpu

            gpu.require()
            import cupy

            from .engine.replicas import Replicas

            self._engine = Replicas(binding, devices or [cupy.cuda.Device().id], capacity_tokens=capacity_tokens)
            self.lanes = len(self._engine)
            self.name = "gpu " + ",".join(map(str, self._engine.devices))

    def encode_on(self, lane: int, items: list) -> list[np.ndarray]:
        """One batch of prepared images on replica `lane` (from any thread) -> host bf16 arrays."""
        if self.cpu:
            from . import reference
            from .preprocess import normalise_patchify

            return [reference.encode_pixels(self._tower, normalise_patchify(canvas), np.array([grid], np.int64))
                    .astype(self._bf16) for canvas, grid, _ in items]
        model = self._engine.models[lane]
        outs = model.encode_prepared(items)
        return [o.get() for o in outs]  # the caller's stream was made to wait for them

    def run(self, batches: list) -> list[list[np.ndarray]]:
        """Several batches at once, batch j on lane j % lanes; results in order."""
        if self.cpu:
            return [self.encode_on(0, items) for items in batches]
        return self._engine.map(lambda m, items: [o.get() for o in m.encode_prepared(items)], batches)
