"""The kernel registry's view of cuda/ and the attention variant table (no GPU needed): every kernel the
engine launches exists, and every variant is derived consistently and refused where it cannot run."""

import dataclasses
import math
import pathlib
import re

import numpy as np
import pytest

from glmvit_cupy.engine.attention import (FIXED_OFFSET_LIMIT, FIXED_OUTPUT_LIMIT, VARIANTS, check_variant,
                                          default_variants, fixed_offset_fits, pick_variant, score_bound_log2, tiles,
                                          value_bound_log2)
from glmvit_cupy.engine.kernels import cuda_dir, kernel_names, modules


def launched_kernels() -> set:
    """(module, kernel) of every launch the engine's launchers name: kernel("m", "k") and
    with_shared_memory("m", "k<...>") in any engine module, and the attention VARIANTS' entries."""
    import ast

    import glmvit_cupy.engine as engine

    out = {(v.module, v.entry.split("<")[0]) for v in VARIANTS.values()}
    for path in pathlib.Path(engine.__file__).parent.glob("*.py"):  # every engine module that launches
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("kernel", "with_shared_memory"):
                mod, entry = node.args[:2]
                if isinstance(mod, ast.Constant):
                    text = entry.value if isinstance(entry, ast.Constant) else entry.values[0].value  # f"k<...>"
                    out.add((mod.value, text.split("<")[0]))
    return out


def test_every_kernel_is_launched_and_every_launch_has_its_kernel():
    declared = {(m, k) for m in modules() for k in kernel_names(m)}
    launched = launched_kernels()
    assert launched == declared, (launched - declared, declared - launched)
    assert {m for m, _ in launched} == set(modules())  # and every .cu file serves the engine
    assert (cuda_dir() / "common.cuh").is_file()


def test_every_kernel_file_opens_with_its_napkin_math():
    for m in modules():
        head = (cuda_dir() / f"{m}.cu").read_text().split("#include")[0]
        assert "Napkin math" in head and re.search(r"[Mm]easured", head), m


def test_variant_table_derives_entries_and_sizes():
    v = VARIANTS["sm90_4wg"]
    assert v.entry == "flash_fwd_sm90<4, 4, true, true>" and v.rows == 256 and v.threads == 640  # overlapped
    assert dataclasses.replace(v, overlap=False).entry == "flash_fwd_sm90<4, 4>"
    assert v.shared_bytes == 256 * 128 + 4 * 2 * 64 * 128 + 1024
    assert VARIANTS["sm90_2wg"].entry == "flash_fwd_sm90<2, 4, true, true>"  # overlapped
    assert dataclasses.replace(VARIANTS["sm90_2wg"], overlap=False).entry == "flash_fwd_sm90<2, 4>"
    assert VARIANTS["sm80_d128"].entry == "flash_fwd_sm80<128, 4>"
    assert VARIANTS["sm80_d64"].shared_bytes == (64 + 4 * 64) * 72 * 2
    assert VARIANTS["sm80_d36"].entry == "flash_fwd_sm80<36, 4>"  # any multiple of 4: the MMAs over 48 columns
    assert VARIANTS["sm80_d36"].shared_bytes == (64 + 4 * 64) * (48 + 8) * 2
    assert VARIANTS["sm80_d256"].shared_bytes == (64 + 4 * 64) * (256 + 8) * 2
    assert {v.head_dim for v in VARIANTS.values() if v.arch == "sm80"} == set(range(4, 257, 4))
    for v in VARIANTS.values():
        assert v.rows % 64 == 0 and v.shared_bytes <= 227 * 1024  # an H100/H200 SM's shared memory
        assert v.threads % 128 == 0 and v.threads <= 1024
        assert v.arch != "sm90" or v.rows <= 256  # Q arrives in one TMA box: at most 256 rows


def test_attention_variant_choice():
    assert all(v.startswith("sm90") for v in default_variants(64, "90"))  # wgmma on Hopper
    assert default_variants(64, "80") == ("sm80_d64",)  # mma.sync elsewhere
    assert default_variants(128, "90") == ("sm80_d128",)  # the wgmma kernel is head_dim 64 only
    assert default_variants(48, "90") == ("sm80_d48",) and default_variants(4, "80") == ("sm80_d4",)
    for bad in (2, 30, 260):  # the RoPE needs a multiple of 4 (config.py refuses the rest); 256 at most
        with pytest.raises(ValueError, match=rf"head_dim {bad}: .* multiples of 4 up to 256; the float32 reference"):
            default_variants(bad, "90")


@pytest.mark.parametrize("name,head_dim,cc,says", [
    ("sm90_3wg_fma1in16", 64, "90", r"unknown; choices: sm90_4wg, sm90_2wg, sm90_4wg_fixed, sm90_2wg_fixed, sm80_d<head dim> \(a multiple of 4 up to 256\)$"),
    ("sm90_4wg", 64, "80", r"needs a Hopper GPU .* this GPU is 8\.0: use sm80_d64"),
    ("sm90_4wg", 64, "100", r"this GPU is 10\.0"),
    ("sm80_d32", 64, "90", r"built for head dim 32, this tower's is 64; choices for it: sm90_4wg"),
])
def test_bad_attention_variants_are_refused_before_any_launch(name, head_dim, cc, says):
    with pytest.raises(ValueError, match=says):
        check_variant(name, head_dim, cc)


def test_fixed_offset_variants_only_where_the_weights_bound_every_score():
    """The variants without a running max run only when score_bound_log2 of the norm weights is within
    FIXED_OFFSET_LIMIT: chosen by default then, refused (naming the online variant) past it."""
    small, large = score_bound_log2(1.3, 1.2, 64), score_bound_log2(4.0, 3.0, 64)
    assert small <= FIXED_OFFSET_LIMIT < large
    assert default_variants(64, "90", small, 0.0) == ("sm90_4wg_fixed", "sm90_2wg_fixed")
    assert default_variants(64, "90", large, 0.0) == default_variants(64, "90") == ("sm90_4wg", "sm90_2wg")
    assert default_variants(64, "90", math.nan) == ("sm90_4wg", "sm90_2wg")  # no bound: the online ones
    assert default_variants(64, "80", small) == ("sm80_d64",)
    assert VARIANTS["sm90_4wg_fixed"].entry == "flash_fwd_sm90<4, 4, false, true>"
    assert dataclasses.replace(VARIANTS["sm90_4wg_fixed"], overlap=False).entry == "flash_fwd_sm90<4, 4, false>"
    assert check_variant("sm90_4wg_fixed", 64, "90", small, 0.0).name == "sm90_4wg_fixed"
    with pytest.raises(ValueError, match=r"running max.* allow 139\.9: use sm90_4wg$"):
        check_variant("sm90_4wg_fixed", 64, "90", large)
    with pytest.raises(ValueError, match="running max"):
        check_variant("sm90_2wg_fixed", 64, "90", math.nan)
    with pytest.raises(ValueError, match="running max"):  # no bound given: none assumed
        check_variant("sm90_4wg_fixed", 64, "90")


def test_fixed_offset_variants_only_where_the_output_stays_a_float():
    """Their output sums up to max_keys values of 2^score_bound x |v| in float32: past FIXED_OUTPUT_LIMIT
    (or with no bound on |v|) the online variants are the default and the fixed ones are refused, naming |v|."""
    score = score_bound_log2(1.3, 1.2, 64)
    keys = 32000
    fits = FIXED_OUTPUT_LIMIT - score - math.log2(keys) - 0.5
    assert fixed_offset_fits(score, fits, keys) and not fixed_offset_fits(score, fits + 1.0, keys)
    assert not fixed_offset_fits(score, fits, 4 * keys)  # the same weights, four times the capacity
    assert default_variants(64, "90", score, fits, keys) == ("sm90_4wg_fixed", "sm90_2wg_fixed")
    for v in (fits + 1.0, math.inf, math.nan):
        assert default_variants(64, "90", score, v, keys) == ("sm90_4wg", "sm90_2wg")
    assert check_variant("sm90_2wg_fixed", 64, "90", score, fits, keys).name == "sm90_2wg_fixed"
    with pytest.raises(ValueError, match=r"bound \|v\| by 2\^\d+\.\d.*past 2\^126 in all: use sm90_2wg$"):
        check_variant("sm90_2wg_fixed", 64, "90", score, fits + 1.0, keys)
    assert check_variant("sm90_4wg", 64, "90", score, math.inf, keys).name == "sm90_4wg"  # online: any |v|


def test_value_bound_holds_and_is_reached(rng):
    """|v| = |norm1(x) @ W_v.T + b_v| stays under value_bound_log2 for random x, and x along the row of
    W_v * w_norm1 that gives the bound (on its bias's side) comes within its 2% margin; a NaN weight
    gives no bound, zero weights -inf."""
    h = 96
    w = rng.uniform(-3.0, 3.0, h)
    wv, bv = rng.standard_normal((40, h)) * 0.1, rng.standard_normal(40)
    bound = value_bound_log2(w, wv, bv)

    def v_of(x):
        normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w
        return normed @ wv.T + bv

    x = rng.standard_normal((5000, h)) * rng.uniform(0.01, 100, (5000, 1))
    assert np.log2(np.abs(v_of(x)).max()) < bound
    rows = wv * w
    k = int(np.argmax(math.sqrt(h) * np.sqrt((rows * rows).sum(1)) + np.abs(bv)))
    worst = rows[k] * np.sign(bv[k])  # the RMSNorm of x parallel to W_v[k] * w_norm1, on the bias's side
    assert np.log2(abs(v_of(worst[None] * 7.0)[0, k])) > bound - math.log2(1.03)
    assert value_bound_log2(w, np.where(np.arange(h) == 3, np.nan, wv), bv) == math.inf
    assert value_bound_log2(w, np.zeros_like(wv), np.zeros_like(bv)) == -math.inf


def test_score_bound_holds_and_is_reached(rng):
    """The bound from the norm weights alone (RMSNorm, then a rotation of pairs, then q . k / sqrt(D)
    in log2 units): random q and k stay under it, and the extreme case (all of x on the coordinate
    with the largest weight, the same for q and k, the same rotation) comes within its 1% margin."""
    d, j = 64, 5
    wq, wk = rng.uniform(-2.0, 2.0, d), rng.uniform(-2.0, 2.0, d)
    wq[j], wk[j] = -2.5, 2.5  # both largest |w| on one coordinate: the extreme case below reaches the bound
    bound = score_bound_log2(np.abs(wq).max(), np.abs(wk).max(), d)

    def normed_rotated(x, w, ang):
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w
        a, b = y[..., : d // 2], y[..., d // 2:]
        return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)

    ang = rng.uniform(0, 2 * np.pi, (4000, d // 2))
    q = normed_rotated(rng.standard_normal((4000, d)) * rng.uniform(0.01, 100, (4000, 1)), wq, ang)
    k = normed_rotated(rng.standard_normal((4000, d)), wk, ang[::-1])
    assert np.abs((q * k).sum(-1)).max() * math.log2(math.e) / math.sqrt(d) < bound
    e = np.zeros(d)
    e[j] = 1.0
    qe, ke = normed_rotated(e, wq, ang[0]), normed_rotated(e, wk, ang[0])
    assert abs((qe * ke).sum()) * math.log2(math.e) / math.sqrt(d) >= bound / 1.01 * (1 - 1e-4)


def test_good_attention_variants_pass():
    assert check_variant("sm80_d64", 64, "90").name == "sm80_d64"  # the fallback also runs on Hopper
    assert check_variant("sm90_2wg", 64, "90").warpgroups == 2


def test_attention_variant_per_shape():
    """A lone short segment takes 128-row tiles; long ones, and batches of short ones, 256-row tiles
    (132 SMs, 16 heads)."""
    both = default_variants(64, "90")
    # 1,024 keys: 1024 / 256 = 4 tiles x 16 heads = 64 CTAs, 68 of 132 SMs idle; 8 x 16 = 128 fill them.
    assert pick_variant(both, [1024], 16, 132) == "sm90_2wg"
    # 16 segments of 1,024: 1,024 CTAs (8 waves) against 2,048 (16 waves) of half the rows.
    assert pick_variant(both, [1024] * 16, 16, 132) == "sm90_4wg"
    # 32,000 keys: 125 x 16 = 2,000 CTAs (16 waves) against 250 x 16 = 4,000 (31 waves) of half the rows.
    assert pick_variant(both, [32000], 16, 132) == "sm90_4wg"
    assert pick_variant(("sm80_d64",), [1024], 16, 132) == "sm80_d64"  # a single choice stands


def test_tiles_cover_every_segment_row_once():
    cu = [0, 1, 193, 193 + 500]
    seg, q0 = tiles(cu, 192)
    assert seg.tolist() == [0, 1, 2, 2, 2] and q0.tolist() == [0, 1, 193, 385, 577]


def test_budgets_hold_their_batch_with_at_most_a_quarter_padding():
    from glmvit_cupy.engine.budgets import MIN_BUDGET, SMALL_FRAME_PATCHES, budget, standard_tiles, tile_count

    seen = set()
    for p in range(1, 40001, 7):
        b = budget(p, 32000) if p <= 32000 else None
        if b is None:
            with pytest.raises(ValueError, match="a forward holds 1 to 32000"):
                budget(p, 32000)
            continue
        assert p <= b <= 32000 and b % 4 == 0 and (b <= max(MIN_BUDGET, 1.25 * p) or b == 32000)
        seen.add(b)
    assert len(seen) <= 4 * 7 + 1  # four a power of two from 256 to 32,000 patches, and the capacity
    assert budget(1024, 32000) == 1024 and budget(1025, 32000) == 1280 and budget(5, 120) == 120
    for n in range(1, 5000):
        for b, rows in ((256, 64), (4096, 128), (32000, 192)):
            assert n <= tile_count(n, b, rows) <= max(8, 1.25 * n, standard_tiles(b, rows, SMALL_FRAME_PATCHES))


def test_batches_share_the_tile_counts_known_ahead(rng):
    """Random batches in any budget and tile size: frames averaging >= 1,024 patches get the budget's
    standard tile count, frames averaging >= 256 patches (64-token images) the standard or the small-frame
    one (so a service's passes of small images replay graphs captured at load); smaller frames go past
    both. Idle tiles stay few for large frames."""
    from glmvit_cupy.engine.budgets import budget, standard_tiles, tile_count, tile_counts_ahead

    past = 0
    for _ in range(3000):
        rows = int(rng.choice([64, 128, 192, 256]))
        lo, hi = [(1, 64), (64, 256), (256, 1024)][int(rng.integers(3))]  # frames of < 256, < 1,024, any patches
        frames = [int(rng.integers(lo, hi)) * 4 for _ in range(int(rng.integers(1, 40)))]
        p = sum(frames)
        if p > 32000:
            continue
        b = budget(p, 32000)
        real = sum(-(-f // rows) for f in frames)
        n = tile_count(real, b, rows)
        assert n >= real
        if p >= 1024 * len(frames):
            assert n == standard_tiles(b, rows), (frames, rows)
        if p >= 256 * len(frames):
            assert n in tile_counts_ahead(b, rows), (frames, rows)
        past += n not in tile_counts_ahead(b, rows)
    assert past > 30  # frames under 256 patches go past the counts known ahead
    # 15 frames of 260 patches in tiles of 256 rows: 30 tiles, past the standard 20, within the small-frame 32
    assert tile_count(30, budget(15 * 260, 32000), 256) == 32 == tile_counts_ahead(4096, 256)[1] > standard_tiles(4096, 256)
    # a pass of 7 frames of 4,096 patches (1,024-token photos) in its budget: few idle tiles
    assert tile_count(7 * 22, budget(7 * 4096, 32000), 192) == standard_tiles(28672, 192) == 192


def test_full_pass_budgets_are_those_a_packed_pass_lands_in(rng):
    """Random streams of images of up to M patches, packed to capacity (batching.pack): every closed pass
    (all but the last) of >= `smallest` patches lands in one of full_pass_budgets, and each of those is hit."""
    from glmvit_cupy.engine.budgets import all_budgets, budget, full_pass_budgets
    from glmvit_cupy.scheduling.batching import pack

    assert all_budgets(32000)[:5] == [256, 320, 384, 448, 512] and all_budgets(32000)[-2:] == [28672, 32000]
    assert full_pass_budgets(32000, 4096, 16384) == [28672, 32000]
    assert full_pass_budgets(32000, 32000, 16384) == [16384, 20480, 24576, 28672, 32000]
    assert full_pass_budgets(32000, 512, 16384) == [32000] and full_pass_budgets(8000, 4000, 16384) == []
    with pytest.raises(ValueError, match="a forward holds 1 to 32000"):
        full_pass_budgets(32000, 32004, 16384)
    for cap, m in ((32000, 4096), (32000, 32000), (31744, 2048), (20000, 6000)):
        want, hit = set(full_pass_budgets(cap, m, 16384)), set()
        # At least 40 streams, then on until each wanted budget is hit: 28,672 at M = 4,096 first shows in
        # a median of 6 streams but at times past 40, so a fixed 40 would fail by chance.
        for stream in range(2000):
            if stream >= 40 and (hit == want or cap == 20000 or m == 32000):
                break
            sizes = (rng.integers(1, m // 4 + 1, 60) * 4).tolist()
            passes = list(pack(sizes, cap, lambda s: s))
            for p in passes[:-1]:
                b = budget(sum(p), cap)
                if b >= 16384:
                    assert b in want, (cap, m, p)
                    hit.add(b)
        assert hit == want or cap == 20000 or m == 32000, (hit, want)


def test_budget_meta_pads_positions_segments_and_tiles():
    """A batch's device data within its budget: real positions then zeros, segment bounds then the total
    repeated, real tiles then idle ones (segment -1), at the offsets the plan's views use."""
    from glmvit_cupy.engine.budgets import meta_offsets, meta, positions

    grid = [[1, 4, 6], [2, 2, 2], [1, 8, 4]]  # 24 + 2 frames x 4 + 32 = 64 patches, 4 segments
    b, rows = 96, 16
    cu = np.array([0, 24, 28, 32, 64], np.int32)
    seg, q0 = tiles(cu, rows)
    m = meta(grid, b, rows, 12, 2)
    o = meta_offsets(b, 12, 2)
    assert o == (0, 192, 192 + 25, 217 + 12, 229 + 12) and m.shape == (o[-1],) and m.dtype == np.int32
    assert meta_offsets(b, 12, 1)[2] == 192 + 97 and meta_offsets(b, 12, 3)[2] == 192 + 11  # segments <= b // merge^2
    pos = m[o[0]:o[1]].reshape(b, 2)
    assert np.array_equal(pos[:64], positions(grid, 2)) and not pos[64:].any()
    assert np.array_equal(m[o[1]:o[1] + 5], cu) and (m[o[1] + 5:o[2]] == 64).all()
    assert np.array_equal(m[o[2]:o[2] + len(seg)], seg) and (m[o[2] + len(seg):o[3]] == -1).all()
    assert np.array_equal(m[o[3]:o[3] + len(q0)], q0) and len(seg) == 6


def closed_form_positions(grid, merge):
    """(h, w) of each patch row i of a frame, from i alone: block i // m^2 in row-major block order, then
    position i % m^2 row-major inside the block."""
    out = []
    for t, h, w in grid:
        i = np.arange(h * w)
        blk, j = i // (merge * merge), i % (merge * merge)
        bw = w // merge
        out += [np.stack([blk // bw * merge + j // merge, blk % bw * merge + j % merge], axis=1)] * t
    return np.concatenate(out)


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_positions_follow_the_merge_block_order(merge):
    """The GPU plans' positions and the float32 reference's (written apart) both equal the closed form."""
    from glmvit_cupy import reference
    from glmvit_cupy.engine.budgets import positions

    grid = [[1, 2 * merge, 3 * merge], [2, merge, 4 * merge], [1, 5 * merge, merge]]
    want = closed_form_positions(grid, merge)
    assert np.array_equal(positions(grid, merge), want)
    assert np.array_equal(reference.position_ids(grid, merge), want)


def test_budget_tiles_cover_each_real_row_once_and_no_padded_row(rng):
    """For random batches (frames, odd sizes, many small images): within its budget, the non-idle tiles
    cover every real row exactly once, inside the row's own segment, and no padded row; the tile count
    holds the real tiles."""
    from glmvit_cupy.engine.budgets import budget, meta_offsets, meta, tile_count

    for _ in range(200):
        mg = int(rng.integers(1, 4))  # the tower's spatial_merge_size
        grid = [[int(rng.integers(1, 3)), mg * int(rng.integers(1, 30)), mg * int(rng.integers(1, 30))]
                for _ in range(int(rng.integers(1, 12)))]
        n = sum(t * h * w for t, h, w in grid)
        b = budget(n, 1 << 18)  # up to 11 x 2 x 87 x 87 = 166,518 patches
        rows = int(rng.choice([16, 64, 128, 192]))
        seg_lens = [h * w for t, h, w in grid for _ in range(t)]
        real = sum(-(-s // rows) for s in seg_lens)
        tiles_n = tile_count(real, b, rows)
        m = meta(grid, b, rows, tiles_n, mg)
        o = meta_offsets(b, tiles_n, mg)
        cu, seg, q0 = m[o[1]:o[2]], m[o[2]:o[3]], m[o[3]:o[4]]
        covered = np.zeros(b, np.int32)
        for s, q in zip(seg, q0):
            if s < 0:
                continue
            assert cu[s] <= q < cu[s + 1]
            covered[q:min(q + rows, cu[s + 1])] += 1
        assert (covered[:n] == 1).all() and not covered[n:].any()
        assert (seg >= 0).sum() == real and b >= n and len(seg) >= real
