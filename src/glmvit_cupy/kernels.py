"""Kernel registry: cuda/*.cu compiled once per device with cupy.RawModule, fetched by name.

    k = kernel("norms", "rmsnorm_residual")

A module is one .cu file (one kernel family). Sources are found in a source
checkout (<repo>/cuda), in an installed wheel (<prefix>/share/glmvit_cupy/cuda), or
where $GLMVIT_CUDA_DIR points.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import threading
from pathlib import Path


class KernelError(RuntimeError):
    """A kernel module or name does not exist, or a module failed to compile."""


def cuda_dir() -> Path:
    candidates = []
    if os.environ.get("GLMVIT_CUDA_DIR"):
        candidates.append(Path(os.environ["GLMVIT_CUDA_DIR"]))
    candidates.append(Path(__file__).resolve().parents[2] / "cuda")  # source checkout / editable install
    for base in {sys.prefix, sysconfig.get_paths().get("data", sys.prefix)}:
        candidates.append(Path(base) / "share" / "glmvit_cupy" / "cuda")
    for c in candidates:
        if (c / "common.cuh").is_file():
            return c
    raise KernelError("cannot find the glmvit-cupy CUDA sources; looked in "
                      + ", ".join(str(c) for c in candidates) + " (set GLMVIT_CUDA_DIR)")


def modules() -> list[str]:
    return sorted(p.stem for p in cuda_dir().glob("*.cu"))


def kernel_names(module: str) -> list[str]:
    """The entry points a module's source declares (extern "C" kernels and FLASH_ENTRY instances)."""
    src = (cuda_dir() / f"{module}.cu").read_text()
    names = [n for n in re.findall(r'extern "C" __global__ void (\w+)\(', src) if not n.startswith("__")]
    names += [f"flash_attn_d{d}_w{w}" for d, w in re.findall(r"^FLASH_ENTRY\((\d+),\s*(\d+)\)", src, re.M)]
    names += [f"flash90_attn_d64_g{g}_n{n}{sfx}" for g, n, sfx in
              re.findall(r"^FLASH90_ENTRY\((\d+),\s*(\d+),\s*\d+,\s*\w+,\s*(\w*)\)", src, re.M)]
    names += [f"flash90_attn_d64_ws{nc}_s{st}{sfx}" for nc, st, sfx in
              re.findall(r"^FLASH90_WS_ENTRY\((\d+),\s*(\d+),\s*\d+,\s*\d+,\s*(\w*)\)", src, re.M)]
    return names


_lock = threading.Lock()
_modules: dict = {}
_kernels: dict = {}


def compile_options(device) -> tuple:
    cc = device.compute_capability  # e.g. "90"
    arch = f"sm_{cc}a" if cc == "90" else f"sm_{cc}"  # sm_90a: Hopper's own instructions allowed
    return ("-std=c++17", f"--gpu-architecture={arch}", f"-I{cuda_dir()}")


def _module(name: str):
    import cupy

    dev = cupy.cuda.Device()
    key = (dev.id, name)
    mod = _modules.get(key)
    if mod is None:
        path = cuda_dir() / f"{name}.cu"
        if not path.is_file():
            raise KernelError(f"unknown kernel module {name!r}; modules: {', '.join(modules())}")
        try:
            mod = cupy.RawModule(code=path.read_text(), options=compile_options(dev))
            mod.compile()
        except cupy.cuda.compiler.CompileException as e:
            raise KernelError(f"{path}: compile failed:\n{e.get_message() if hasattr(e, 'get_message') else e}") \
                from None
        _modules[key] = mod
    return mod


def kernel(module: str, name: str):
    """The compiled kernel `name` of cuda/<module>.cu for the current device (cached)."""
    import cupy

    key = (cupy.cuda.Device().id, module, name)
    k = _kernels.get(key)
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                mod = _module(module)
                if name not in kernel_names(module):
                    raise KernelError(f"module {module!r} has no kernel {name!r}; it has: "
                                      f"{', '.join(kernel_names(module))}")
                k = mod.get_function(name)
                _kernels[key] = k
    return k
