"""Several GPUs: one GlmVit replica per device, work spread across them.

Each replica owns its weights, scratch, stream and CUDA graphs; a thread per replica drives it, so
the GPUs run at the same time (CuPy releases the GIL inside CUDA calls, and a replayed graph is one
launch). The balancing (batching.spread) is plain Python, tested without a GPU.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import cupy
import numpy as np

from .. import checks, gpu
from ..checkpoint.bind import TowerBinding, bind_tower
from ..checks import check_resize
from ..scheduling import batching
from .gemm import BF16
from .model import GlmVit


class Replicas:
    """The tower on several GPUs (the same GPU may be listed twice). Same calls as GlmVit:
    encode(images) returns each image's embedding on the GPU that computed it; encode_pixels
    gathers the batch's output onto the first device."""

    def __init__(self, checkpoint, devices, *, capacity_tokens: int | None = None,
                 attention_variant: str | None = None, graphs: bool = True, fused_swiglu: bool | None = None,
                 tune_gemms: bool = True):
        """checkpoint: a path or Hub id (bound once here), or a TowerBinding; devices: CUDA ordinals, one
        replica each (the same one twice makes two replicas on it). The keywords are GlmVit's."""
        gpu.require()
        binding = checkpoint if isinstance(checkpoint, TowerBinding) else bind_tower(checkpoint)
        self.devices = checks.check_devices(devices, cupy.cuda.runtime.getDeviceCount())
        self.models = [GlmVit(binding, device=d, capacity_tokens=capacity_tokens, attention_variant=attention_variant,
                              graphs=graphs, fused_swiglu=fused_swiglu, tune_gemms=tune_gemms) for d in self.devices]
        self.geometry = self.models[0].geometry
        self.capacity_tokens = self.models[0].capacity_tokens
        self._pool = ThreadPoolExecutor(len(self.models), thread_name_prefix="glmvit")

    @classmethod
    def from_checkpoint(cls, path, devices, *, capacity_tokens: int | None = None,
                        attention_variant: str | None = None, graphs: bool = True, fused_swiglu: bool | None = None,
                        tune_gemms: bool = True) -> "Replicas":
        """Check and bind a checkpoint once, then upload one replica per listed device."""
        return cls(bind_tower(path), devices, capacity_tokens=capacity_tokens, attention_variant=attention_variant,
                   graphs=graphs, fused_swiglu=fused_swiglu, tune_gemms=tune_gemms)

    def __len__(self):
        return len(self.models)

    def map(self, fn, work: list) -> list:
        """fn(model, item) for each item, item j on replica j % len(self), all replicas at once;
        results in order, final on every stream. The first error is raised after every replica has stopped."""
        return self.start(fn, work, synchronize=True)()

    def start(self, fn, work: list, synchronize: bool = False) -> Callable[[], list]:
        """As map, but returns at once a function that waits for the results (and raises the first error);
        without synchronize, a result may still be computing on its GPU when it is handed back."""
        lanes = [list(range(r, len(work), len(self))) for r in range(len(self))]

        def lane(r):
            done = [(j, fn(self.models[r], work[j])) for j in lanes[r]]
            if synchronize:
                self.models[r].runner.stream.synchronize()  # final whichever stream reads them next
            return done

        futures = [self._pool.submit(lane, r) for r in range(len(self)) if lanes[r]]

        def wait() -> list:
            results, error = [None] * len(work), None
            for f in futures:
                try:
                    for j, out in f.result():
                        results[j] = out
                except Exception as e:  # keep waiting for the other lanes, then raise
                    error = error or e
            if error is not None:
                raise error
            return results

        return wait

    def encode_batches(self, batches) -> list:
        """[(pixel_values, grid_thw), ...] -> one output per batch, batch j on replica j % len(self)."""
        return self.map(lambda m, b: m.encode_pixels(*b), list(batches))

    def encode(self, images, *, min_image_tokens: int = 16, max_image_tokens: int | None = None,
               max_pixels: int | None = None, resize: str = "gpu", decode: str = "cpu",
               workers: int | None = None) -> list:
        """As GlmVit.encode; images spread over the replicas by tokens (all are decoded first, into ordinary
        memory: which GPU an image goes to is known only once all are, so none is uploaded while decoding)."""
        single = not isinstance(images, (list, tuple))
        prepared = list(batching.prepare_images(self.geometry, self.capacity_tokens, [images] if single else
                                                list(images), min_image_tokens, max_image_tokens, max_pixels,
                                                resize=resize, decode=decode, workers=workers))
        groups = batching.spread([info["tokens"] for _, _, info in prepared], len(self))
        outs = self.map(lambda m, g: m.encode_prepared([prepared[i] for i in g]), groups)
        return _in_order(groups, outs, len(prepared))

    def _spread_rows(self, pixel_values, grid):
        """(row starts, image groups, one (rows, grid) or None per replica): whole images spread by patches,
        their rows gathered on the host (they go to other GPUs: staged there once)."""
        if isinstance(pixel_values, cupy.ndarray):
            pixel_values = cupy.asnumpy(pixel_values)
        sizes = (grid[:, 0] * grid[:, 1] * grid[:, 2]).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        groups = batching.spread(sizes.tolist(), len(self))
        work = [(np.concatenate([pixel_values[starts[i]:starts[i + 1]] for i in g]), grid[g]) if g else None
                for g in groups]
        return starts, groups, work

    def encode_video_pixels(self, pixel_values_videos, video_grid_thw) -> list:
        """As GlmVit.encode_video_pixels; whole videos spread over the replicas by patches, each embedding on
        the GPU that computed it."""
        grid, _ = checks.check_pixels(self.geometry, pixel_values_videos, video_grid_thw.get() if isinstance(
            video_grid_thw, cupy.ndarray) else video_grid_thw)
        _, groups, work = self._spread_rows(pixel_values_videos, grid)
        outs = self.map(lambda m, b: [] if b is None else m.encode_video_pixels(*b), work)
        return _in_order(groups, outs, len(grid))

    encode_video = GlmVit.encode_video  # plan_videos, then this class's encode_planned_videos

    def encode_planned_videos(self, planned: list, resize: str = "gpu") -> list:
        """As GlmVit.encode_planned_videos; whole videos spread over the replicas by tokens, each embedding on
        the GPU that computed it. Every video is checked before any replica starts."""
        check_resize(resize)
        checks.check_planned_videos(planned, self.geometry.spatial_merge_size, self.capacity_tokens)
        groups = batching.spread([info["tokens"] for _, _, info in planned], len(self))
        outs = self.map(lambda m, g: m.encode_planned_videos([planned[i] for i in g], resize), groups)
        return _in_order(groups, outs, len(planned))

    def encode_pixels(self, pixel_values, grid_thw):
        """A batch of images split across the replicas by patches; the output, in order, on devices[0]."""
        mm = self.geometry.merge_patches
        grid = checks.check_grid(grid_thw.get() if isinstance(grid_thw, cupy.ndarray) else grid_thw,
                                   self.geometry.spatial_merge_size)
        sizes = (grid[:, 0] * grid[:, 1] * grid[:, 2]).astype(np.int64)
        if pixel_values.ndim != 2 or pixel_values.shape[0] != sizes.sum():
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)} but grid_thw describes "
                             f"{int(sizes.sum())} patches")
        starts, groups, work = self._spread_rows(pixel_values, grid)
        outs = self.map(lambda m, b: None if b is None else m.encode_pixels(*b), work)
        d0 = self.devices[0]
        with cupy.cuda.Device(d0):
            result = cupy.empty((int(sizes.sum()) // mm, self.geometry.out_hidden_size), dtype=BF16)
            tok_start = starts // mm
            for g, o in zip(groups, outs):
                row = 0
                for i in g:
                    t = int(sizes[i]) // mm
                    part = o[row:row + t]
                    if o.device.id != d0:
                        result[tok_start[i]:tok_start[i] + t].data.copy_from_device(part.data, part.nbytes)
                    else:
                        result[tok_start[i]:tok_start[i] + t] = part
                    row += t
        return result


def _in_order(groups: list, outs: list, n: int) -> list:
    """The outputs of index groups (batching.spread's), one list per group, back in index order."""
    results = [None] * n
    for g, o in zip(groups, outs):
        for i, emb in zip(g, o):
            results[i] = emb
    return results
