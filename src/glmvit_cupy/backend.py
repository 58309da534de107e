"""Which tower encodes, for the commands and the service: the GPU engine (one replica per device) or,
with cpu=True, the float32 NumPy reference. Either takes prepared images (uint8 canvas, grid, info)
and returns each image's embedding as a host bf16 array; `lanes` batches can run at once, one per
replica. Both are batch-invariant: an image's embedding has the same bits whatever it is batched
with (the reference computes each image on its own; the engine's GEMMs never split their sums).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


class Backend:
    def __init__(self, binding, *, cpu: bool, devices: list[int] | None = None, capacity_tokens: int = 8000):
        import ml_dtypes

        self.geometry = binding.geometry
        self.capacity_tokens = capacity_tokens
        self.cpu = cpu
        self.resize = "host" if cpu else "gpu"  # who resizes the images this backend is given
        self.host_buffer = None
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

            from .engine.blocks import HOST
            from .engine.replicas import Replicas

            self._engine = Replicas(binding, devices or [cupy.cuda.Device().id], capacity_tokens=capacity_tokens)
            self._copy = {}  # replica -> the stream its results come back to the host on
            for m in self._engine.models:
                with m.device:
                    self._copy[m] = cupy.cuda.Stream(non_blocking=True)
            self.host_buffer = HOST.array  # where prepare threads put decoded images: page-locked, uploaded as is
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

    def launch(self, batches: list) -> Callable[[], list[list[np.ndarray]]]:
        """Start several batches (batch j on lane j % lanes) and return at once a function that waits for
        their host arrays, in order: the GPUs compute them, and copy them back on a stream of their own,
        while the caller prepares and launches the next ones. (The CPU reference computes them here.)"""
        if self.cpu:
            done = [self.encode_on(0, items) for items in batches]
            return lambda: done
        wait = self._engine.start(self._start, batches)

        def result():
            out = []
            for hosts, copied, _ in wait():
                copied.synchronize()
                out.append(hosts)
            return out

        return result

    def _start(self, model, items):
        """Launch one batch on `model` -> (page-locked host arrays, the event after their copies, the device
        outputs, kept alive until those copies have run)."""
        import cupy
        import cupyx

        outs = model.encode_prepared(items)  # the current stream waits for them
        with model.device:
            copy = self._copy[model]
            copy.wait_event(cupy.cuda.get_current_stream().record())
            hosts = [cupyx.empty_pinned(o.shape, o.dtype) for o in outs]
            for o, h in zip(outs, hosts):
                cupy.asnumpy(o, stream=copy, out=h, blocking=False)
            return hosts, copy.record(), outs
