"""Whether the GPU engine can run on this machine, and if not, why in one sentence.

Host side: CuPy is imported here only to ask. The engine's facades check before touching the GPU, so
a machine without CuPy, a GPU, a driver or the CUDA libraries gets GpuUnavailable naming what is
missing and what to install, instead of a CUDA runtime error deep in a traceback.
"""

from __future__ import annotations

import ctypes
import os

from .errors import GpuUnavailable

INSTALL = "pip install -e '.[cuda12]' in the glmvit-cupy checkout (or '.[cuda13]' for a CUDA 13 driver)"
CPU_HINT = "the float32 reference runs on the CPU without any of it (glmvit_cupy.reference, glmvit-encode --cpu)"


def import_problem() -> str | None:
    """Why the engine's modules cannot be imported here (CuPy or its cuBLAS missing), or None."""
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"CuPy is not installed ({e}): {INSTALL}; {CPU_HINT}"
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)
    except ImportError as e:
        return (f"cuBLAS was not found ({e}): {INSTALL} brings the CUDA libraries, or point CUDA_PATH at a CUDA "
                f"toolkit; {CPU_HINT}")
    return None


def problem() -> str | None:
    """Why the engine cannot run here (no CuPy, no GPU or driver, no cuBLAS or NVRTC), or None."""
    why = import_problem()
    if why:
        return why
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, a driver too old for this CuPy, no device
        driver = driver_version()
        if driver is None:  # CUDA then says "driver version is insufficient", which is not the problem
            return f"no NVIDIA driver is installed (libcuda could not be loaded), so there is no usable GPU; {CPU_HINT}"
        if "insufficient" in str(e).lower() or "InsufficientDriver" in str(e):
            runtime = cupy.cuda.runtime.runtimeGetVersion()
            return (f"the NVIDIA driver supports CUDA up to {_cuda(driver)}, older than this CuPy's CUDA runtime "
                    f"{_cuda(runtime)}: upgrade the driver, or install the CuPy that matches it "
                    f"({'cuda12' if driver >= 12000 else 'an older CuPy'} extra); {CPU_HINT}")
        return f"no usable CUDA GPU found ({type(e).__name__}: {e}); {CPU_HINT}"
    if count == 0:
        return f"no CUDA GPU found; {CPU_HINT}"
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:
        return (f"NVRTC, which compiles the kernels, was not found ({type(e).__name__}: {e}): {INSTALL} brings it, "
                "or point CUDA_PATH at a CUDA toolkit")
    return None


def driver_version() -> int | None:
    """The CUDA version the installed NVIDIA driver supports (e.g. 12080 for 12.8), or None where no driver
    library can be loaded (a machine without an NVIDIA driver)."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    try:
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except AttributeError:
        return None
    return version.value


def _cuda(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def require():
    """Raise GpuUnavailable saying why, unless the engine can run here."""
    why = problem()
    if why:
        raise GpuUnavailable(why)


def unavailable(name: str, why: str):
    """A stand-in for the engine class `name` where CuPy cannot be imported: the name imports (so
    `from glmvit_cupy import *` works anywhere); building one raises GpuUnavailable with the reason."""
    def refuse(*args, **kwargs):
        raise GpuUnavailable(f"{name} needs the GPU engine, which cannot run here: {why}")

    return type(name, (), {"__init__": refuse, "from_checkpoint": staticmethod(refuse),
                           "__doc__": f"The GPU engine's {name}; not usable here: {why}"})
