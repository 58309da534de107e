"""Spreading work over several GPUs: the balancing and the device checks (no GPU needed)."""

import pytest

from glmvit_cupy.checks import check_devices
from glmvit_cupy.scheduling.batching import spread


def test_spread_balances_tokens_and_keeps_every_index_once():
    costs = [1024, 256, 8000, 4096, 4096, 64, 1024]  # 18560 patches
    groups = spread(costs, 2)
    assert sorted(i for g in groups for i in g) == list(range(len(costs)))
    assert all(g == sorted(g) for g in groups)
    loads = [sum(costs[i] for i in g) for g in groups]
    # Longest first: 8000 | 4096 4096 -> 8000+1024 | 8192+1024 ... ends 9280 | 9280.
    assert loads == [9280, 9280]


def test_spread_more_bins_than_items_and_one_bin():
    assert spread([5, 3], 4) == [[0], [1], [], []]
    assert spread([5, 3, 9], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="at least one"):
        spread([1], 0)


@pytest.mark.parametrize("bad, why", [
    (0, "list of CUDA device ordinals"), ("0,1", "list of CUDA device ordinals"), ([], "at least one"),
    ([0, 2], "2 is not a CUDA device of this machine \\(it has 2"), ([-1], "-1 is not"), ([True], "True is not"),
    ([0.0], "0.0 is not"),
])
def test_bad_device_lists_say_what_is_wrong(bad, why):
    with pytest.raises(ValueError, match=why):
        check_devices(bad, 2)


def test_device_lists_may_repeat_a_gpu():
    assert check_devices((1, 1, 0), 2) == [1, 1, 0]
