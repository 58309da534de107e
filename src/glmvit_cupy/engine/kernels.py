"""Kernel registry: cuda/*.cu compiled with cupy.RawModule once per device, kernels fetched by name.

    k = kernel("norms", "rmsnorm_residual")                 # an extern "C" kernel
    k = kernel("attention_sm90", "flash_fwd_sm90<4, 4, false, true>")  # one instance of a template kernel

A module is one .cu file (one kernel family). A template kernel is instantiated by name (NVRTC
name expressions), so its instances are listed once, by whoever launches them (attention.py's
variant table), not again in the source. The sources ship inside the package (glmvit_cupy/cuda, built
from the repository's cuda/), so every install kind finds them there; a source checkout or editable
install finds <repo>/cuda; $GLMVIT_CUDA_DIR overrides both.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from ..errors import KernelError

# `extern "C" __global__ void name(` and `__global__ void [__launch_bounds__(...)] name(` at a line's
# start (the second form is a template kernel: `template <...>` on the line before).
_EXTERN = re.compile(r'^extern "C" __global__ void (\w+)\(', re.M)
_TEMPLATE = re.compile(r"^__global__ void (?:__launch_bounds__\(.*?\)\s+)?(\w+)\(", re.M)


def cuda_dir() -> Path:
    candidates = []
    if os.environ.get("GLMVIT_CUDA_DIR"):
        candidates.append(Path(os.environ["GLMVIT_CUDA_DIR"]))
    package = Path(__file__).resolve().parents[1]
    candidates.append(package / "cuda")  # installed: wheel, --user, --target
    if (package.parents[1] / "setup.cfg").is_file():
        candidates.append(package.parents[1] / "cuda")  # a source checkout or editable install: <repo>/cuda
    for c in candidates:
        if (c / "common.cuh").is_file():
            return c
    raise KernelError("cannot find the glmvit-cupy CUDA sources; looked in "
                      + ", ".join(str(c) for c in candidates) + " (set GLMVIT_CUDA_DIR)")


def modules() -> list[str]:
    return sorted(p.stem for p in cuda_dir().glob("*.cu"))


def kernel_names(module: str) -> list[str]:
    """The kernels cuda/<module>.cu declares: extern "C" ones, and template ones by template name."""
    src = (cuda_dir() / f"{module}.cu").read_text()
    return _EXTERN.findall(src) + _TEMPLATE.findall(src)


def compile_options(device) -> tuple:
    cc = device.compute_capability  # e.g. "90"
    arch = f"sm_{cc}a" if cc == "90" else f"sm_{cc}"  # sm_90a: Hopper's own instructions allowed
    return ("-std=c++17", f"--gpu-architecture={arch}", f"-I{cuda_dir()}")


_lock = threading.Lock()
_modules: dict = {}
_kernels: dict = {}


def _compile(module: str, device, name_expressions=()):
    import cupy
    from cupy_backends.cuda.libs.nvrtc import NVRTCError

    path = cuda_dir() / f"{module}.cu"
    try:
        mod = cupy.RawModule(code=path.read_text(), options=compile_options(device),
                             name_expressions=list(name_expressions) or None)
        mod.compile()
    except (cupy.cuda.compiler.CompileException, NVRTCError) as e:
        msg = e.get_message() if hasattr(e, "get_message") else str(e)
        raise KernelError(f"{path}: compile failed for compute capability {device.compute_capability}:\n{msg}") \
            from None
    return mod


def kernel(module: str, name: str):
    """The compiled kernel `name` of cuda/<module>.cu for the current device (cached). A template
    kernel's instance is named with its arguments, e.g. "flash_fwd_sm90<4, 4, false, true>"."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), module, name)  # every launch asks: keep the hit path short
    k = _kernels.get(key)
    if k is not None:
        return k
    dev = cupy.cuda.Device(key[0])
    with _lock:
        k = _kernels.get(key)
        if k is None:
            if module not in modules():
                raise KernelError(f"unknown kernel module {module!r}; modules: {', '.join(modules())}")
            src = (cuda_dir() / f"{module}.cu").read_text()
            base = name.split("<", 1)[0].strip()
            if base not in (_TEMPLATE.findall(src) if "<" in name else _EXTERN.findall(src)):
                raise KernelError(f"module {module!r} has no kernel {name!r}; it has: "
                                  f"{', '.join(kernel_names(module))} (a template kernel is named with its "
                                  "arguments, e.g. name<1, 2>)")
            if "<" in name:  # each instance its own compile: only the instances a model picks are built
                k = _compile(module, dev, [name]).get_function(name)
            else:
                mod = _modules.get((dev.id, module))
                if mod is None:
                    mod = _modules[(dev.id, module)] = _compile(module, dev)
                k = mod.get_function(name)
            _kernels[key] = k
    return k
