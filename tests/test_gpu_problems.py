"""Why the GPU engine cannot run, told apart (no GPU needed): no CuPy, no NVIDIA driver at all, a driver
older than CuPy's CUDA runtime. CuPy is stood in for by a fake module, so every branch runs here."""

import sys
import types

from glmvit_cupy import gpu


class _RuntimeError(Exception):
    pass


def fake_cupy(monkeypatch, error):
    def count():
        raise error

    runtime = types.SimpleNamespace(getDeviceCount=count, runtimeGetVersion=lambda: 13020)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy_backends", types.ModuleType("cupy_backends"))
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = types.ModuleType("cublas")
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda", types.ModuleType("cupy_backends.cuda"))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", libs.cublas)


INSUFFICIENT = _RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")


def test_no_driver_is_not_called_an_old_driver(monkeypatch):
    fake_cupy(monkeypatch, INSUFFICIENT)
    monkeypatch.setattr(gpu, "driver_version", lambda: None)
    why = gpu.problem()
    assert "no NVIDIA driver is installed" in why and "insufficient" not in why and "glmvit-encode --cpu" in why


def test_old_driver_says_which_versions(monkeypatch):
    fake_cupy(monkeypatch, INSUFFICIENT)
    monkeypatch.setattr(gpu, "driver_version", lambda: 12040)
    why = gpu.problem()
    assert "supports CUDA up to 12.4, older than this CuPy's CUDA runtime 13.2" in why and "cuda12" in why


def test_other_errors_are_passed_on(monkeypatch):
    fake_cupy(monkeypatch, _RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected"))
    monkeypatch.setattr(gpu, "driver_version", lambda: 13000)
    assert "no usable CUDA GPU found (_RuntimeError: cudaErrorNoDevice" in gpu.problem()


def test_this_machine_driver_version_is_an_int_or_none():
    v = gpu.driver_version()
    assert v is None or (isinstance(v, int) and v >= 1000)


def test_install_hint_points_at_the_checkout():
    assert "pip install -e '.[cuda12]'" in gpu.INSTALL and "glmvit-cupy[" not in gpu.INSTALL
