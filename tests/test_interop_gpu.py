"""Outputs leave through DLPack without a copy: torch (and any DLPack consumer) sees bfloat16 on the GPU."""

import numpy as np
import pytest

from tests.conftest import gpu_or_skip

pytestmark = pytest.mark.gpu
cupy = gpu_or_skip()

from glmvit_cupy import GlmVit  # noqa: E402
from tests.golden import cases  # noqa: E402


def test_torch_from_dlpack_is_zero_copy():
    torch = pytest.importorskip("torch", reason="torch is not installed; DLPack export is checked with it")
    g = np.load(cases.OUTPUTS)
    m = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=64)
    out = m.encode_pixels(g["img_64x64/pixel_values"], g["img_64x64/grid_thw"])
    t = torch.from_dlpack(out)
    assert t.dtype == torch.bfloat16 and t.is_cuda and tuple(t.shape) == out.shape
    assert t.data_ptr() == out.data.ptr  # the same memory
    assert np.array_equal(t.float().cpu().numpy(), cupy.asnumpy(out).astype(np.float32))
