"""Per token budget, what the forward needs beside the pixels, and its CUDA graph.

A batch of P patches runs as a forward over a budget of B >= P patches (budgets: four per power of two,
from 256 patches up to the model's capacity). What differs between batches of one budget is device data
the kernels read, uploaded into the budget's buffers before a call whose grid they do not hold yet:
each patch's (h, w) position, the attention segments and the attention's query tiles. A graph
captured for the budget therefore replays for any mix of image shapes that fits it. The rows past P
compute on stale inputs and are never read: every kernel but attention treats rows independently, and
attention's tiles cover only the P real rows, each within its own segment, so padding changes no bit
of any output.

Plans are kept per (budget, attention variant, tile count) in a small LRU cache; evicting one frees
its graph. The attention's grid is part of the graph, so its tile count is fixed per plan: a budget's standard
count (enough for any batch whose frames average >= 1,024 patches), its small-frame count (>= 256
patches: small images many to a pass), or rounded up like the budget past those; the surplus tiles are
marked idle (segment -1: the kernels return at once). A budget's usual plans are thus known before any
batch comes, and their graphs can be captured at load (GlmVit.precapture).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import cupy
import numpy as np

from . import attention
from .attention import Variant
from .budgets import budget, meta, meta_offsets, standard_tiles, tile_count, tile_counts_ahead
from .pools import HOST


@dataclass
class Plan:
    patches: int              # the budget: rows every kernel runs over
    meta: cupy.ndarray        # int32: the buffers below, uploaded when a call's grid differs
    positions: cupy.ndarray   # int32 [patches, 2]: (h, w) in the merge-block row order of pixel_values
    cu_seqlens: cupy.ndarray  # int32 [patches // merge^2 + 1]: segment bounds (one per frame of each image)
    tile_seg: cupy.ndarray    # int32 [tiles]: each attention query tile's segment (-1: idle)
    tile_q0: cupy.ndarray     # int32 [tiles]: and its first row
    variant: Variant
    attention_flop: int = 0   # this call's, per block: 4 * sum(segment^2) * hidden
    uses: int = 0
    meta_of: object = None    # the host meta last uploaded into `meta` (PlanCache.get skips an upload of it again)
    graph: object = None
    capture_failed: bool = False
    capture_tries: int = 0  # failed captures so far


class PlanCache:
    """Plans by (budget, variant, tile count), the least recently used dropped past `size`."""

    GRIDS = 256  # grids whose key and meta stay cached on the host (a server sees its sizes again)

    def __init__(self, variants: tuple, heads: int, hidden: int, sms: int, capacity_patches: int, merge: int,
                 size: int = 48):
        self.variants, self.heads, self.hidden, self.sms, self.size = variants, heads, hidden, sms, size
        self.capacity_patches, self.merge = capacity_patches, merge
        self._plans: OrderedDict = OrderedDict()
        self._grids: OrderedDict = OrderedDict()  # grid -> (plan key, host meta, attention FLOP per block)

    def __len__(self):
        return len(self._plans)

    def key(self, grid) -> tuple[int, str, int]:
        """(budget, variant name, tile count) of a grid (int [images, 3])."""
        grid = np.asarray(grid).tolist()
        seg_lens = [h * w for t, h, w in grid for _ in range(t)]
        b = budget(sum(seg_lens), self.capacity_patches)
        name = attention.pick_variant(self.variants, seg_lens, self.heads, self.sms)
        rows = attention.VARIANTS[name].rows
        return b, name, tile_count(sum(-(-n // rows) for n in seg_lens), b, rows)

    def __contains__(self, grid) -> bool:
        return self.key(grid) in self._plans

    def find(self, grid) -> Plan | None:
        """The plan this grid would run on, if built (nothing uploaded, nothing reordered)."""
        return self._plans.get(self.key(grid))

    def get(self, grid) -> Plan:
        """The plan for this grid (int [images, 3]), built on first use, with this grid's meta uploaded on
        the current stream, ahead of the kernels that read it (unless the plan's meta already holds it:
        only these uploads write it, all on the model's one stream, so the same grid again, the usual
        case of a batch job, costs no copy; its ~20 us of host time come before the GPU can start)."""
        key, host, flop = self._describe(grid)
        plan = self._plan(key)
        if plan.meta_of is not host:  # the cached host array of this grid: identity means the same meta
            plan.meta_of = None  # until the copy is enqueued
            HOST.upload(host, plan.meta.data.ptr)
            plan.meta_of = host
        plan.attention_flop = flop
        return plan

    def full_pass(self, budget_patches: int, image_patches: int) -> Plan:
        """The plan a pass of this budget runs on when it is filled with frames of `image_patches`
        patches (its standard tile count: any batch whose frames average >= 1,024 patches shares it),
        built if need be, nothing uploaded: for capturing its graph before any such batch comes."""
        frame = min(image_patches, budget_patches)
        name = attention.pick_variant(self.variants, [frame] * (budget_patches // frame), self.heads, self.sms)
        return self._plan((budget_patches, name, standard_tiles(budget_patches, attention.VARIANTS[name].rows)))

    def ahead(self, budget_patches: int) -> list[Plan]:
        """The plans of this budget known before any batch (each variant's tile_counts_ahead), built if need
        be, nothing uploaded: a service captures their graphs at load."""
        return [self._plan((budget_patches, name, tiles)) for name in self.variants
                for tiles in tile_counts_ahead(budget_patches, attention.VARIANTS[name].rows)]

    def _plan(self, key) -> Plan:
        """The plan of this key, built on first use; the least recently used dropped past `size`."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._new(*key)
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return plan

    def _describe(self, grid):
        """(plan key, host meta, attention FLOP per block) of a grid, cached."""
        g = tuple(map(tuple, np.asarray(grid).tolist()))
        hit = self._grids.get(g)
        if hit is None:
            key = self.key(g)
            hit = (key, meta(g, key[0], attention.VARIANTS[key[1]].rows, key[2], self.merge),
                   4 * sum(h * w * h * w * t for t, h, w in g) * self.hidden)
            self._grids[g] = hit
            while len(self._grids) > self.GRIDS:
                self._grids.popitem(last=False)
        self._grids.move_to_end(g)
        return hit

    def _new(self, b: int, name: str, tiles: int) -> Plan:
        o = meta_offsets(b, tiles, self.merge)
        dev = cupy.zeros(o[-1], dtype=cupy.int32)
        return Plan(b, dev, dev[o[0]:o[1]].reshape(b, 2), dev[o[1]:o[2]], dev[o[2]:o[3]], dev[o[3]:o[4]],
                    attention.VARIANTS[name])
