"""Per input shape (the grid of every image in a batch), what the forward needs beside the pixels:
each patch's (h, w) position, the attention segments and query tiles, the attention variant, and,
once the shape repeats, its CUDA graph. Kept in a small LRU cache; evicting a plan frees its graph.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import cupy
import numpy as np

from . import attention
from .attention import Variant


@dataclass
class Plan:
    patches: int
    positions: cupy.ndarray  # int32 [patches, 2]: (h, w) in the merge-block row order of pixel_values
    cu_seqlens: cupy.ndarray  # int32 [segments + 1]: one segment per frame of each image
    tile_seg: cupy.ndarray    # int32 [tiles]: each attention query tile's segment
    tile_q0: cupy.ndarray     # int32 [tiles]: and its first row
    variant: Variant
    attention_flop: int       # per block: 4 * sum(segment^2) * hidden
    uses: int = 0
    graph: object = None
    capture_failed: bool = False


def positions(grid) -> np.ndarray:
    """(h, w) of every patch, in the 2x2 merge-block order of the reference processor's rows."""
    out = []
    for t, h, w in grid:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blk = (h // 2, 2, w // 2, 2)
        p = np.stack([hh.reshape(blk).transpose(0, 2, 1, 3).ravel(),
                      ww.reshape(blk).transpose(0, 2, 1, 3).ravel()], axis=1)
        out += [p] * t  # each frame repeats the positions
    return np.concatenate(out).astype(np.int32)


class PlanCache:
    """Plans by input shape, the least recently used dropped past `size`."""

    def __init__(self, variants: tuple, heads: int, hidden: int, sms: int, size: int = 32):
        self.variants, self.heads, self.hidden, self.sms, self.size = variants, heads, hidden, sms, size
        self._plans: OrderedDict = OrderedDict()

    def __len__(self):
        return len(self._plans)

    def __contains__(self, grid) -> bool:
        return self._key(grid) in self._plans

    @staticmethod
    def _key(grid):
        return tuple(map(tuple, np.asarray(grid).tolist()))

    def get(self, grid) -> Plan:
        """The plan of this grid (int64 [images, 3]), built on first use; its uploads run on the
        current stream, ahead of the kernels that read them."""
        key = self._key(grid)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        seg_lens = [h * w for t, h, w in key for _ in range(t)]  # each frame is its own attention segment
        cu = np.concatenate([[0], np.cumsum(seg_lens)]).astype(np.int32)
        variant = attention.VARIANTS[attention.pick_variant(self.variants, seg_lens, self.heads, self.sms)]
        tile_seg, tile_q0 = attention.tiles(cu, variant.rows)
        plan = Plan(int(cu[-1]), *(cupy.asarray(a) for a in (positions(key), cu, tile_seg, tile_q0)), variant,
                    4 * sum(n * n for n in seg_lens) * self.hidden)
        self._plans[key] = plan
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan
