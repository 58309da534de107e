"""Token budgets: the fixed sizes a forward runs at, so that one CUDA graph serves every batch that fits,
and the device data (positions, segments, attention tiles) that tells a budget's forward what this
batch is. Pure NumPy: tested without a GPU. The plans that hold this on the GPU are in plans.py.
"""

from __future__ import annotations

import numpy as np

from . import attention

MIN_BUDGET = 256  # patches: 64 tokens
STEPS = (4, 5, 6, 7)  # steps per octave, as quarters of its power of two: at most 25% padding


def _ladder(n: int, minimum: int) -> int:
    """The smallest 2^k x (1, 1.25, 1.5 or 1.75) that is >= n and >= minimum (a power of two)."""
    k = max(minimum, 1 << max(0, (n - 1).bit_length() - 1))
    for s in STEPS:
        if k * s // 4 >= n:
            return k * s // 4
    return 2 * k


def budget(patches: int, capacity_patches: int) -> int:
    """The budget (patches a forward runs over) that holds `patches`: _ladder's, at least MIN_BUDGET, at
    most the capacity (which is itself the last budget)."""
    if not 0 < patches <= capacity_patches:
        raise ValueError(f"{patches} patches: a forward holds 1 to {capacity_patches}")
    return min(_ladder(patches, MIN_BUDGET), capacity_patches)


# A budget's standard tile count holds every batch whose frames average at least this many patches
# (256 tokens): one graph per (budget, variant) then serves them all, and can be captured before any
# batch is seen (full_pass_budgets). Its small-frame count holds every batch whose frames average at
# least SMALL_FRAME_PATCHES (64 tokens: the small images a service packs many to a pass), so the
# graphs of such passes can be captured ahead too (tile_counts_ahead). Idle tiles cost a CTA that
# returns at once: at 4,096 patches the small-frame count adds 8 of them per head.
STANDARD_FRAME_PATCHES = 1024
SMALL_FRAME_PATCHES = 256


def standard_tiles(budget_patches: int, rows: int, frame_patches: int = STANDARD_FRAME_PATCHES) -> int:
    """The tile count of a budget whose frames average >= frame_patches: S frames of P <= B patches have
    at most ceil(B / rows) + S - 1 tiles of `rows` rows, and S <= B // frame_patches."""
    return _ladder(-(-budget_patches // rows) + budget_patches // frame_patches, 8)


def tile_counts_ahead(budget_patches: int, rows: int) -> list[int]:
    """The tile counts of this budget known before any batch: the standard one, then the small-frame one."""
    return sorted({standard_tiles(budget_patches, rows, f) for f in (STANDARD_FRAME_PATCHES, SMALL_FRAME_PATCHES)})


def tile_count(real_tiles: int, budget_patches: int, rows: int) -> int:
    """Query tiles a plan's attention launches for `real_tiles` in this budget (the idle ones exit at
    once): the first of tile_counts_ahead that holds them, or past those (frames of fewer than 64
    tokens on average) _ladder's of the real tiles, so a few counts serve every batch of a budget."""
    for n in tile_counts_ahead(budget_patches, rows):
        if real_tiles <= n:
            return n
    return _ladder(real_tiles, 8)


def all_budgets(capacity_patches: int) -> list[int]:
    """Every budget of this capacity, ascending."""
    out = [budget(1, capacity_patches)]
    while out[-1] < capacity_patches:
        out.append(budget(out[-1] + 1, capacity_patches))
    return out


def full_pass_budgets(capacity_patches: int, image_patches: int, smallest: int) -> list[int]:
    """The budgets of at least `smallest` patches that a pass packed to capacity can land in when no
    image has more than `image_patches` patches: a pass closes only when the next image would not fit,
    so it holds more than capacity - image_patches (batching.pack)."""
    if not 0 < image_patches <= capacity_patches:
        raise ValueError(f"{image_patches} patches an image: a forward holds 1 to {capacity_patches}")
    first = max(capacity_patches - image_patches + 1, smallest)
    if first > capacity_patches:
        return []
    return [b for b in all_budgets(capacity_patches) if b >= budget(first, capacity_patches)]


def positions(grid, merge: int) -> np.ndarray:
    """(h, w) of every patch, in the merge x merge block order of the reference processor's rows."""
    out = []
    for t, h, w in grid:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blk = (h // merge, merge, w // merge, merge)
        p = np.stack([hh.reshape(blk).transpose(0, 2, 1, 3).ravel(),
                      ww.reshape(blk).transpose(0, 2, 1, 3).ravel()], axis=1)
        out += [p] * t  # each frame repeats the positions
    return np.concatenate(out).astype(np.int32)


def meta_offsets(budget_patches: int, tiles: int, merge: int) -> tuple[int, ...]:
    """Offsets (in int32) of positions, cu_seqlens, tile_seg, tile_q0 and the end, in a plan's meta. A
    frame holds at least merge^2 patches, so a budget holds at most budget_patches // merge^2 segments."""
    offs = [0, 2 * budget_patches]
    offs.append(offs[-1] + budget_patches // merge**2 + 1)
    offs.append(offs[-1] + tiles)
    offs.append(offs[-1] + tiles)
    return tuple(offs)


def meta(grid, budget_patches: int, rows: int, tiles: int, merge: int) -> np.ndarray:
    """A call's int32 meta for a plan of this budget and tile count: the real rows' positions (zeros past
    them), segment bounds (the last repeated), the real tiles (then idle ones: segment -1)."""
    seg_lens = [h * w for t, h, w in grid for _ in range(t)]  # each frame is its own attention segment
    cu = np.concatenate([[0], np.cumsum(seg_lens)]).astype(np.int32)
    seg, q0 = attention.tiles(cu, rows)
    o = meta_offsets(budget_patches, tiles, merge)
    out = np.zeros(o[-1], np.int32)
    out[:2 * int(cu[-1])] = positions(grid, merge).reshape(-1)
    out[o[1]:o[2]] = cu[-1]
    out[o[1]:o[1] + len(cu)] = cu
    out[o[2]:o[3]] = -1
    out[o[2]:o[2] + len(seg)] = seg
    out[o[3]:o[3] + len(q0)] = q0
    return out
