"""The one module of input checks (glmvit_cupy.checks), and the calls that rely on it refusing what they
cannot honour, before any image is read."""

import numpy as np
import pytest

from glmvit_cupy import checks, preprocess, preprocess_video


@pytest.mark.parametrize("lo,hi", [(17, 16), (8001, 8000), (1, 0)])
def test_min_above_max_is_refused_saying_so(lo, hi):
    with pytest.raises(ValueError, match=f"min_image_tokens={lo} is above max_image_tokens={hi}" if hi else
                       "max_image_tokens=0 must be an integer from 1 to 2,147,483,647"):
        checks.check_token_limits(lo, hi)


def test_min_equal_to_max_is_allowed():
    assert checks.check_token_limits(64, 64) == (64, 64)


def test_every_entry_point_refuses_min_above_max(rng):
    image = rng.integers(0, 256, (1, 1, 3), dtype=np.uint8)  # a 1x1 image: min would win, silently
    with pytest.raises(ValueError, match="min_image_tokens=100 is above max_image_tokens=10"):
        preprocess([image], min_image_tokens=100, max_image_tokens=10)
    with pytest.raises(ValueError, match="min_image_tokens=100 is above max_image_tokens=10"):
        checks.image_limits(8000, 100, 10)
    frames = rng.integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)
    # The video processor's limits (a video's total) follow the reference, which applies the maximum first.
    pv, grid, _ = preprocess_video(frames, fps=2.0, max_image_tokens=8)
    assert grid[0].prod() // 4 <= 8
    with pytest.raises(ValueError, match="min_video_tokens=9 is above max_video_tokens=8: a video"):
        checks.check_token_limits(9, 8, "video")


def test_nonfinite_counts_nan_and_infinities_of_bf16_by_bits_and_of_float32_by_value(rng):
    """Fresh random embeddings with NaN, +inf and -inf planted at random places (and bf16's largest finite
    value, which must not count): the bit test agrees with NumPy's isfinite on the float32 widening."""
    import ml_dtypes

    for _ in range(5):
        emb = (rng.standard_normal((int(rng.integers(1, 300)), 64)) * 1e3).astype(np.float32)
        flat = emb.reshape(-1)
        places = rng.choice(flat.size, size=min(flat.size, int(rng.integers(0, 20))), replace=False)
        flat[places] = rng.choice([np.nan, np.inf, -np.inf], size=len(places))
        big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # bits 0x7F7F and 0xFF7F: finite, not counted
        flat[rng.integers(0, flat.size, 2)] = [big, -big]
        bf16 = emb.astype(ml_dtypes.bfloat16)
        want = int((~np.isfinite(bf16.astype(np.float32))).sum())
        assert checks.nonfinite(bf16) == want == checks.nonfinite(bf16.astype(np.float32))
        problem = checks.embedding_problem(bf16, "images[2]")
        if want:
            assert problem.startswith(f"images[2]: the tower's output holds {want:,} NaN or infinite values of "
                                      f"{bf16.size:,}") and "check the checkpoint" in problem
        else:
            assert problem is None
    assert checks.embedding_problem(np.ones((3, 4), ml_dtypes.bfloat16), "x") is None
    for one in (np.inf, -np.inf, np.nan, -np.nan):  # each kind alone: either half of the bit test finds it
        emb = rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16)
        emb[int(rng.integers(5)), int(rng.integers(7))] = one
        assert checks.nonfinite(emb) == 1, one


def test_a_limit_lowered_to_the_capacity_is_said_to_be_one():
    """encode(images) with neither limit given, on a model of capacity_tokens=8: max_image_tokens defaults to
    the capacity, and the message said 'min_image_tokens=16 is above max_image_tokens=8', naming a value the
    caller never passed and not the capacity that made it."""
    with pytest.raises(ValueError, match=r"max_image_tokens=8 \(.*capacity_tokens.*\)") as e:
        checks.image_limits(8, 16, None)
    assert "capacity_tokens" in str(e.value)


@pytest.mark.parametrize("grid", [[[1, 2, 2], [1, 2]], [[1, 2, 2], [1, [2], 2]]])
def test_a_ragged_grid_is_named(grid):
    """A ragged list is not an array: NumPy's own 'inhomogeneous shape' message named no argument."""
    with pytest.raises(ValueError, match="grid_thw"):
        checks.check_grid(grid, 2)
