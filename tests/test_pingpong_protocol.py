"""The ping-pong GEMM's barrier protocol (cuda/gemm_sm90.cu), model-checked on the CPU by
tools/pingpong_protocol.py: random interleavings of the producer and both consumer warpgroups over
1-7 tiles, 1-16 K slices and 2-6 slots. The checker must also catch the bug it exists for: without the
named barriers a warpgroup waits on a slot two phases early."""

import pytest

from tools import pingpong_protocol as protocol


def test_protocol_holds_under_random_interleavings(rng):
    protocol.check_all(seeds=[int(s) for s in rng.integers(0, 1 << 30, 8)])


def test_checker_catches_the_missing_named_barriers(rng):
    seed = int(rng.integers(0, 1 << 30))
    with pytest.raises((AssertionError, RuntimeError)):
        for tiles in (2, 3, 4, 5):
            for ksteps in (1, 2, 3, 5):
                for stages in (2, 3, 6):
                    protocol.run(tiles, ksteps, stages, seed + tiles, named_barriers=False)
