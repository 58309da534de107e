"""The NumPy float32 reference equals HF transformers' float32 forward on the golden tower."""

import dataclasses

import numpy as np
import pytest

from tests.golden import cases

from glmvit_cupy import reference

G = np.load(cases.OUTPUTS)
CASES = sorted({k.split("/")[0] for k in G.files})


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def tower():
    return reference.Tower(reference.bind_tower(cases.TOWER_DIR))


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_hf_fp32(tower, name):
    stats = {}
    out = reference.encode_pixels(tower, G[f"{name}/pixel_values"], G[f"{name}/grid_thw"], stats=stats)
    want = G[f"{name}/hf_fp32"]
    assert out.shape == want.shape
    assert rel(out, want) <= 1e-4
    # The weights make the clamp fire in every block and in the merger, or a missing clamp would pass.
    assert all(s["gate_above"] > 0 and s["up_outside"] > 0 for s in stats.values()), stats
    assert len(stats) == cases.GEOMETRY.depth + 1


def test_hf_bf16_error_is_recorded_and_larger(tower):
    # The accuracy bar the GPU must meet: HF bf16 vs HF fp32 on the same inputs.
    for name in CASES:
        e = rel(G[f"{name}/hf_bf16"], G[f"{name}/hf_fp32"])
        assert 1e-4 < e < 0.2, (name, e)


def test_no_clamp_gives_a_different_answer(tower, monkeypatch):
    pv, grid = G["img_64x64/pixel_values"], G["img_64x64/grid_thw"]
    base = reference.encode_pixels(tower, pv, grid)
    monkeypatch.setattr(reference, "clamped_swiglu", lambda g, u, limit, *a: reference.silu(g) * u)
    assert rel(reference.encode_pixels(tower, pv, grid), base) > 1e-3


def test_video_frames_are_separate_segments(tower):
    # grid (2, 8, 6): two frames of 48 patches; each frame alone must give the same rows.
    pv = G["video_2x8x6/pixel_values"]
    both = reference.encode_pixels(tower, pv, [[2, 8, 6]])
    first = reference.encode_pixels(tower, pv[:48], [[1, 8, 6]])
    second = reference.encode_pixels(tower, pv[48:], [[1, 8, 6]])
    assert rel(both, np.concatenate([first, second])) < 1e-5


LIVE_GRIDS = {1: [[1, 5, 7], [2, 3, 4]], 2: [[1, 6, 8], [2, 4, 4]], 3: [[1, 6, 9], [2, 3, 6]]}  # by merge size


@pytest.mark.parametrize("merge", sorted(LIVE_GRIDS))
def test_reference_matches_live_hf_on_fresh_weights(tmp_path, merge, rng):
    """Not the golden file alone: HF transformers 5.23.0's float32 forward, run here on the CPU, on weights
    and pixels drawn afresh (where torch and transformers 5.23.0 are installed: the GPU machine's check),
    for the released 2 x 2 merge and for others the config may declare."""
    from tests import hf_bar

    why = hf_bar.available("cpu")
    if why:
        pytest.skip(f"needs HF transformers 5.23.0 and torch: {why}")
    from glmvit_cupy.checkpoint.synthetic import write_checkpoint

    seed = int(rng.integers(1 << 30))
    geo = dataclasses.replace(cases.GEOMETRY, spatial_merge_size=merge)
    binding = reference.bind_tower(write_checkpoint(tmp_path / "ckpt", geo, seed=seed))
    rng = np.random.default_rng(seed)
    grid = np.array(LIVE_GRIDS[merge])
    pv = rng.standard_normal((int(np.prod(grid, 1).sum()), geo.patch_dim), dtype=np.float32)
    stats = {}
    ours = reference.encode_pixels(binding, pv, grid, stats=stats)
    hf = hf_bar.hf_forward(binding, pv, grid, "float32", device="cpu")
    assert all(s["gate_above"] > 0 for s in stats.values()), stats  # the clamp fires on these weights
    assert rel(ours, hf) <= 1e-4, (seed, rel(ours, hf))


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_downsample_is_the_conv2d_over_each_frame(tmp_path, merge, rng):
    """The merger's downsample equals a Conv2d of kernel and stride m, written out as loops over the
    frame's (h, w) layout (the rows put there by their positions), for every merge size."""
    from glmvit_cupy.checkpoint.synthetic import write_checkpoint

    geo = dataclasses.replace(cases.GEOMETRY, spatial_merge_size=merge, depth=1)
    tower = reference.Tower(reference.bind_tower(write_checkpoint(tmp_path / "ckpt", geo, seed=3)))
    t, h, w = 1, 3 * merge, 2 * merge
    x = rng.standard_normal((h * w, geo.hidden_size), dtype=np.float32)
    frame = np.zeros((h, w, geo.hidden_size), np.float32)
    for row, (ph, pw) in zip(x, reference.position_ids([(t, h, w)], merge)):
        frame[ph, pw] = row
    kern = tower.w["downsample.weight"].reshape(geo.out_hidden_size, geo.hidden_size, merge, merge)
    want = np.array([np.einsum("ochw,hwc->o", kern, frame[i:i + merge, j:j + merge])
                     for i in range(0, h, merge) for j in range(0, w, merge)]) + tower.w["downsample.bias"]
    got = tower.downsample(x)
    assert got.shape == want.shape and rel(got, want) < 1e-5


def test_sub_layers_against_closed_forms(rng):
    """Properties the reference's pieces must have, independent of any recorded output."""
    # Equal keys: attention averages the values of its segment only.
    q = rng.standard_normal((7, 2, 8))
    k = np.repeat(rng.standard_normal((1, 2, 8)), 7, axis=0)
    v = rng.standard_normal((7, 2, 8))
    out = reference.attention(q, k, v, [(0, 3), (3, 7)])
    assert np.allclose(out[:3], v[:3].mean(0)) and np.allclose(out[3:], v[3:].mean(0))
    # RoPE at position (0, 0) is the identity; elsewhere a rotation (norms kept).
    cos, sin = reference.rotary(np.array([[0, 0], [5, 9]], np.float64), 16, 10000.0, np.float64)
    x = rng.standard_normal((2, 16))
    y = x * cos + reference.rotate_half(x) * sin
    assert np.allclose(y[0], x[0]) and np.allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1))
    assert not np.allclose(y[1], x[1])
    # RMSNorm: unit root-mean-square before the weight.
    n = reference.rms_norm(rng.standard_normal((3, 32)) * 5, np.ones(32), 0.0)
    assert np.allclose(np.sqrt((n * n).mean(1)), 1.0)


def test_row_count_must_match_grid(tower):
    with pytest.raises(ValueError, match="rows"):
        reference.encode_pixels(tower, G["img_64x64/pixel_values"][:-4], G["img_64x64/grid_thw"])


@pytest.mark.parametrize("dtype", [np.complex64, np.bool_, object])
def test_pixel_values_must_be_real_numbers(tower, dtype):
    """Complex, bool or object pixels are refused by dtype before any compute (a cast would drop an imaginary
    part without a word); the GPU model shares the check (checks.check_pixels)."""
    pv = np.ones((64, 1176), dtype)
    with pytest.raises(ValueError, match=f"pixel_values has dtype {np.dtype(dtype)}; it must hold real numbers"):
        reference.encode_pixels(tower, pv, [[1, 8, 8]])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300])
def test_pixel_values_must_be_finite(tower, bad, rng):
    """NaN or infinity (1e300 is infinite in float32) would spread through attention to every row of the image:
    refused, naming how many rows and the first."""
    pv = rng.standard_normal((64, 1176))
    pv[37, 5] = bad
    with pytest.raises(ValueError, match=r"pixel_values: 1 of 64 rows hold NaN or infinity \(in float32; the first "
                                         r"is row 37\)"):
        reference.encode_pixels(tower, pv, [[1, 8, 8]])


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.float16, "bfloat16", "nonsense", None])
def test_the_reference_computes_in_float32_or_float64_only(dtype):
    """An integer or half dtype would cast the weights and compute another tower without a word: refused."""
    import ml_dtypes  # noqa: F401  (NumPy learns "bfloat16")

    with pytest.raises(ValueError, match="the reference computes in float32 or float64"):
        reference.Tower(reference.bind_tower(cases.TOWER_DIR), dtype)
    if dtype is None:  # encode_pixels' default: float32
        return
    with pytest.raises(ValueError, match="the reference computes in float32 or float64"):
        reference.encode_pixels(cases.TOWER_DIR, np.ones((4, 1176), np.float32), [[1, 2, 2]], dtype=dtype)


def test_weights_too_large_for_float32_compute_without_warning_lines(tower):
    """Weights scaled past float32's range overflow inside the forward (infinity, NaN, or norms dividing by
    infinity); NumPy's warning lines stay out of the commands' output (the commands refuse non-finite
    embeddings, counting them)."""
    import copy
    import warnings

    big = copy.copy(tower)
    big.w = {k: v * np.float32(1e30) if k.endswith(("proj.weight", "qkv.weight")) else v for k, v in tower.w.items()}
    name = CASES[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning fails the test
        out = big.forward(G[f"{name}/pixel_values"], G[f"{name}/grid_thw"])
    assert out.shape == G[f"{name}/hf_fp32"].shape


def test_forwards_on_several_threads_leave_the_processs_blas_limit_as_it_was(tower):
    """threadpoolctl's BLAS limit is the process's: forwards overlapping on threads share one pin, lifted by
    the last to end; each restoring its own would leave the process at one BLAS thread after."""
    import threading

    from threadpoolctl import threadpool_info

    def blas():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    name = CASES[0]
    pv, grid = G[f"{name}/pixel_values"], G[f"{name}/grid_thw"]
    alone = tower.forward(pv, grid)
    before, outs = blas(), {}  # this machine's own: 2 on CI's two cores
    if max(before, default=1) < 2:
        pytest.skip(f"BLAS runs {before} threads here: one thread, nothing to pin")
    start = threading.Barrier(4)

    def work(i):
        start.wait()
        outs[i] = tower.forward(pv, grid)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert blas() == before, (before, blas())
    assert all(np.array_equal(outs[i], alone) for i in range(4))


def test_a_towers_dtype_is_the_one_it_computes_in_and_another_is_refused(tower):
    name = CASES[0]
    pv, grid = G[f"{name}/pixel_values"], G[f"{name}/grid_thw"]
    assert reference.encode_pixels(tower, pv, grid).dtype == np.float32
    assert reference.encode_pixels(tower, pv, grid, dtype=np.float32).dtype == np.float32
    for other in (np.float64, np.float16, "junk"):
        with pytest.raises(ValueError, match="but this Tower computes in float32: build a Tower"):
            reference.encode_pixels(tower, pv, grid, dtype=other)
    with pytest.raises(ValueError, match="stats must be a dict"):
        reference.encode_pixels(tower, pv, grid, stats=[])


def test_ragged_rows_are_named(tower):
    """pixel_values as a ragged list: a ValueError naming pixel_values, not NumPy's bare 'inhomogeneous shape'."""
    row = [0.0] * tower.geo.patch_dim
    with pytest.raises(ValueError, match="pixel_values"):
        reference.encode_pixels(tower, [row, row, row, row[:5]], [[1, 2, 2]])
