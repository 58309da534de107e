"""The built wheel carries its CUDA sources inside the package and finds them wherever it is installed
(here: pip install --target), never a stray cuda/ folder beside the install. Builds the wheel from this
checkout, as a user's pip would (CPU CI)."""

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # With the build tools already here (a machine without network), else as pip does by default.
    for isolation in (["--no-build-isolation"], []):
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), ROOT],
                           capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            break
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = [out / f for f in os.listdir(out) if f.endswith(".whl")]
    return whl


def test_wheel_holds_sources_license_and_typing(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    sources = {n.rsplit("/", 1)[-1] for n in names if n.startswith("glmvit_cupy/cuda/")}
    in_repo = {f for f in os.listdir(os.path.join(ROOT, "cuda")) if f.endswith((".cu", ".cuh"))}
    assert sources == in_repo and "attention_sm90.cu" in sources
    assert "glmvit_cupy/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    # Every module of the source tree, sub-packages included, is in the wheel.
    src = os.path.join(ROOT, "src")
    in_tree = {os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/") for d, _, fs in os.walk(src)
               for f in fs if f.endswith(".py")}
    assert in_tree <= set(names), in_tree - set(names)
    assert "glmvit_cupy/engine/ops.py" in names and "glmvit_cupy/serving/app.py" in names


def test_target_install_finds_its_own_kernels(wheel, tmp_path):
    target = tmp_path / "target"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (tmp_path / "cuda").mkdir()  # an unrelated cuda/ beside the install must not be taken
    (tmp_path / "cuda" / "common.cuh").write_text("// someone else's\n")
    code = ("import glmvit_cupy\nfrom glmvit_cupy.engine.kernels import cuda_dir, modules\n"
            "print(glmvit_cupy.__file__)\nprint(cuda_dir())\nprint(','.join(modules()))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GLMVIT_CUDA_DIR")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(env, PYTHONPATH=str(target)))
    assert r.returncode == 0, r.stderr[-2000:]
    package, found, mods = r.stdout.split()
    assert package.startswith(str(target)) and found == str(target / "glmvit_cupy" / "cuda")
    assert mods.split(",") == sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "cuda")) if f.endswith(".cu"))
