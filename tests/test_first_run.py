"""A new user's first run on any machine (CPU CI): names import without CuPy, no GPU is one sentence,
and glmvit-encode never surprises: resolved resume keys, one setting per folder, empty inputs,
readable output, large images, Ctrl-C, bad --out and manifest, clear messages for wrong input."""

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.golden import cases

import glmvit_cupy
from glmvit_cupy import CheckpointError, GpuUnavailable, ImageError, gpu, inspect_checkpoint, reference
from glmvit_cupy.cli import main as cli
from glmvit_cupy.output import read_embeddings
from glmvit_cupy import preprocess

TOWER = str(cases.TOWER_DIR)
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def run(*args):
    return cli.main([str(a) for a in args])


def python(code):
    """Run code in a fresh interpreter that cannot import CuPy (as on a CPU-only install)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.path.join(SRC, ".."), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", "import sys; sys.modules['cupy'] = None\n" + code],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def folder(tmp_path):
    return cases.png_folder(tmp_path / "imgs", (100, 150), (64, 64))


# -- import and the GPU ---------------------------------------------------------------------------

def test_every_name_imports_without_cupy_and_building_says_why():
    r = python("""
from glmvit_cupy import *
import glmvit_cupy, pydoc
assert 'GlmVit' in dir(glmvit_cupy) and 'load_vision_tower' in dir(glmvit_cupy)
text = pydoc.render_doc(glmvit_cupy, renderer=pydoc.plaintext)
assert 'GlmVit' in text and 'load_vision_tower' in text, text[:500]
for make in (lambda: GlmVit.from_checkpoint('x'), lambda: Replicas.from_checkpoint('x', [0])):
    try:
        make()
    except GpuUnavailable as e:
        assert 'CuPy is not installed' in str(e) and "pip install -e '.[cuda12]'" in str(e), e
    else:
        raise SystemExit('no GpuUnavailable')
print('ok')
""")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_load_vision_tower_text_only_needs_no_gpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "hidden_size": 64}))
    r = python(f"""
import glmvit_cupy
assert glmvit_cupy.load_vision_tower({str(tmp_path)!r}) is None
try:
    glmvit_cupy.load_vision_tower({TOWER!r})
except glmvit_cupy.GpuUnavailable as e:
    print('refused:', e)
""")
    assert r.returncode == 0 and "refused: GlmVit needs the GPU engine" in r.stdout, r.stderr


def test_no_gpu_reasons_are_one_sentence(monkeypatch):
    """With CuPy present but no driver or device, or no NVRTC: the reason, not a CUDA error."""
    import types

    runtime = types.SimpleNamespace(getDeviceCount=lambda: (_ for _ in ()).throw(
        RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")))
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(gpu, "import_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(gpu, "driver_version", lambda: None)  # no NVIDIA driver (test_gpu_problems: the others)
    why = gpu.problem()
    assert why.startswith("no NVIDIA driver is installed") and "--cpu" in why
    runtime.getDeviceCount = lambda: 0
    assert gpu.problem().startswith("no CUDA GPU found")
    with pytest.raises(GpuUnavailable, match="no CUDA GPU found"):
        gpu.require()


def test_cli_without_a_gpu_says_so_and_creates_nothing(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu, "problem", lambda: "no CUDA GPU found; the float32 reference runs on the CPU "
                        "without any of it (glmvit_cupy.reference, glmvit-encode --cpu)")
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out) == 2
    assert "cannot use the GPU: no CUDA GPU found" in capsys.readouterr().err and not out.exists()


# -- the batch command ----------------------------------------------------------------------------

def test_resume_keys_are_resolved_files(folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.chdir(folder)
    assert run("a.png", "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    assert run(".", "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    os.symlink(folder / "a.png", tmp_path / "link.png")
    assert run(folder, tmp_path / "link.png", "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    manifest, arrays = read_embeddings(out)
    assert sorted(manifest["images"]) == [os.path.realpath(folder / "a.png"), os.path.realpath(folder / "b.png")]
    assert "resolved absolute path" in manifest["header"]["key"]
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) == 2  # a.png encoded once
    assert "2 of 2 files already" in capsys.readouterr().out


def test_resuming_with_other_settings_is_refused(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(folder / "a.png", "--checkpoint", TOWER, "--out", out, "--cpu", "--max-image-tokens", 300) == 0
    capsys.readouterr()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 2
    err = capsys.readouterr().err
    assert "written with max_image_tokens = 300, this run asks for 8000" in err
    assert len(read_embeddings(out)[0]["images"]) == 1


def test_empty_inputs_are_an_error_and_create_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert run(tmp_path / "empty", "--checkpoint", TOWER, "--out", out, "--cpu") == 2
    assert "no images or videos found in" in capsys.readouterr().err and not out.exists()
    assert run(str(tmp_path / "*.png"), "--checkpoint", TOWER, "--out", out, "--cpu") == 2
    assert "no such file, folder or matching glob" in capsys.readouterr().err and not out.exists()


def test_output_is_readable_and_modes_are_consistent(folder, tmp_path):
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {f: stat.S_IMODE(os.stat(out / f).st_mode) for f in os.listdir(out)}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    manifest, arrays = read_embeddings(out)
    key = os.path.realpath(folder / "a.png")
    assert arrays[key].dtype.name == "bfloat16" and arrays[key].shape == (manifest["images"][key]["tokens"], 256)
    shard = out / manifest["images"][key]["shard"]
    # As the README says: plain safetensors.numpy after `import ml_dtypes`, in a fresh interpreter.
    r = python(f"import ml_dtypes\nfrom safetensors.numpy import load_file\nprint(load_file({str(shard)!r})"
               f"[{key!r}].dtype)")
    assert r.returncode == 0 and r.stdout.strip() == "bfloat16", r.stderr
    try:
        import torch
        from safetensors.torch import load_file
    except ImportError:
        return  # torch is optional; the GPU machine's run covers this branch
    t = load_file(str(shard))[key]
    assert t.dtype == torch.bfloat16 and np.array_equal(t.view(torch.int16).numpy(), arrays[key].view(np.int16))


def test_large_images_need_max_pixels(tmp_path, monkeypatch, capsys):
    p = tmp_path / "big.png"
    Image.fromarray(cases._smooth(400, 300, 4)).save(p)
    with pytest.raises(ImageError, match=r"over the limit of 100,000 pixels.*max_pixels.*400 = 120,000"):
        preprocess([str(p)], max_pixels=100_000)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow's own guard, far below (and 2x below)
    with pytest.raises(ImageError, match="decompression bomb"):
        preprocess([str(p)])
    pv, grid = preprocess([str(p)], max_pixels=200_000)  # raised for this call only
    assert grid.tolist() and Image.MAX_IMAGE_PIXELS == 1000
    out = tmp_path / "out"
    assert run(p, "--checkpoint", TOWER, "--out", out, "--cpu") == 1  # refused, reported, skipped
    assert "--max-pixels" in capsys.readouterr().out
    assert run(p, "--checkpoint", TOWER, "--out", tmp_path / "out2", "--cpu", "--max-pixels", 200_000) == 0


def test_bad_out_and_truncated_manifest(folder, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "file", "--cpu") == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "out")
    assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "link", "--cpu") == 2
    assert f"is a symbolic link to {tmp_path / 'gone' / 'out'}, which leads nowhere" in capsys.readouterr().err
    out = tmp_path / "out"
    assert run(folder / "a.png", "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    (out / "manifest.json").write_text((out / "manifest.json").read_text()[:50])
    capsys.readouterr()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 2
    assert "unreadable or truncated" in capsys.readouterr().err
    (out / "manifest.json").write_text("[]")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 2
    assert "it holds a JSON list, not the object a manifest is" in capsys.readouterr().err


def test_every_flag_has_help():
    missing = [a.dest for a in cli.parser()._actions if not a.help]
    assert not missing, missing


# -- clear messages for wrong input ---------------------------------------------------------------

def test_reference_checks_input_like_the_gpu_path(rng):
    tower = reference.Tower(reference.bind_tower(TOWER))
    pv = rng.standard_normal((64, 1176), dtype=np.float32)
    with pytest.raises(ValueError, match="each row must be one patch of 1176 values"):
        reference.encode_pixels(tower, pv[:, :1000], [[1, 8, 8]])
    with pytest.raises(ValueError, match="each row must be one patch"):
        reference.encode_pixels(tower, pv.ravel(), [[1, 8, 8]])
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \(1, 7, 8\).*even"):
        reference.encode_pixels(tower, pv[:56], [[1, 7, 8]])
    with pytest.raises(ValueError, match="64 rows but grid_thw describes 48 patches"):
        reference.encode_pixels(tower, pv, [[1, 6, 8]])


def test_folders_and_images_are_not_mistaken(tmp_path):
    with pytest.raises(ImageError, match="is a folder, not an image file"):
        preprocess([str(tmp_path)])
    img = tmp_path / "an_image.png"
    Image.new("RGB", (4, 4)).save(img)
    with pytest.raises(CheckpointError, match="an_image.png is not a checkpoint"):
        inspect_checkpoint(img)


def test_version_and_typing_marker():
    assert glmvit_cupy.__version__ and (os.path.isfile(os.path.join(os.path.dirname(glmvit_cupy.__file__),
                                                                    "py.typed")))



def test_serve_without_a_gpu_points_at_its_own_cpu_flag(monkeypatch, capsys):
    """glmvit-serve without --cpu on a machine without a GPU: exit 2, and the hint names glmvit-serve --cpu,
    not another command."""
    pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    from glmvit_cupy.serving import main as serve

    monkeypatch.setattr(gpu, "problem", lambda: f"no CUDA GPU found; {gpu.CPU_HINT}")
    assert serve.main(["--checkpoint", TOWER, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot use the GPU: no CUDA GPU found; glmvit-serve --cpu serves the float32 reference" in err, err
    assert "glmvit-encode" not in err
