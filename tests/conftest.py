import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # so `tests.golden` imports


def gpu_or_skip():
    """Import CuPy and check for a device, or skip the calling test module saying why."""
    import pytest

    try:
        import cupy
    except ImportError as e:
        pytest.skip(f"GPU test: CuPy is not installed ({e}); install the cuda12/cuda13 extra on a GPU machine",
                    allow_module_level=True)
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        pytest.skip(f"GPU test: no usable CUDA device ({type(e).__name__}: {e})", allow_module_level=True)
    if n == 0:
        pytest.skip("GPU test: no CUDA device", allow_module_level=True)
    return cupy
