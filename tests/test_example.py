"""examples/encode_image.py without a GPU (--cpu): the README's main command on the golden tower, its
embeddings equal to the float32 reference's, and one line with exit status 2 for what a user gets wrong."""

import os
import sys

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from tests.golden import cases

from glmvit_cupy import bind_tower, reference
from glmvit_cupy import preprocess

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import encode_image  # noqa: E402

TOWER = str(cases.TOWER_DIR)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("ex")
    paths = []
    for i, (h, w) in enumerate([(100, 150), (70, 64)]):
        paths.append(str(d / f"im{i}.png"))
        Image.fromarray(cases._smooth(h, w, 300 + i)).save(paths[-1])
    return paths


def reference_bf16(paths):
    pv, grid = preprocess(paths)
    return reference.encode_pixels(bind_tower(TOWER), pv, grid).astype(ml_dtypes.bfloat16)


def test_cpu_run_saves_what_the_reference_computes(images, tmp_path, capsys):
    from safetensors.numpy import load_file

    out = str(tmp_path / "e.safetensors")
    paths = images + images[:1]  # the same file twice: two tensors, not one
    assert encode_image.main(paths + ["--checkpoint", TOWER, "--cpu", "--save", out]) == 0
    assert "float32 NumPy reference runs on the CPU" in capsys.readouterr().out
    got = load_file(out)
    assert len(got) == 3
    want = reference_bf16(paths)
    flat = np.concatenate([got[k] for k in (images[0] + "#0", images[1], images[0] + "#2")])
    assert flat.dtype == ml_dtypes.bfloat16 and np.array_equal(flat.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("argv, says", [
    (["/nonexistent.jpg"], "/nonexistent.jpg: no such file"),
    (["README.md"], "README.md: cannot decode image"),
    (["{img}", "--max-image-tokens", "0"], "--max-image-tokens 0 must be an integer from 16"),
    (["{img}", "--checkpoint", "/nonexistent"], "/nonexistent: no such file or directory"),
    (["{img}", "--save", "/nonexistent-dir/e.npy"], "No such file or directory"),
])
def test_mistakes_are_one_line_and_status_2(images, capsys, argv, says):
    argv = [a.format(img=images[0]) for a in argv]
    if "--checkpoint" not in argv:
        argv += ["--checkpoint", TOWER]
    assert encode_image.main(argv + ["--cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encode_image.py: ") and says in err and "Traceback" not in err


@pytest.mark.parametrize("save, says", [
    ("e.txt", "--save e.txt: use a .safetensors or .npy file name"),
    ("/proc/x.safetensors", "--save /proc/x.safetensors: cannot write in /proc"),
    ("{tmp}/d.npy", "is a folder; give a file name in it"),
])
def test_a_bad_save_is_refused_before_any_work(images, capsys, tmp_path, save, says):
    """Before the checkpoint is read (a nonexistent one is not reached) or anything encoded."""
    (tmp_path / "d.npy").mkdir()
    argv = [images[0], "--checkpoint", "/nonexistent", "--save", save.format(tmp=tmp_path)]
    assert encode_image.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("encode_image.py: ") and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("limit", ["5", "15", "0", "2147483648"])
def test_a_token_limit_below_the_minimum_is_the_flag_before_any_work(images, capsys, limit):
    """--max-image-tokens under 16 printed an image of fewer tokens than 16, then failed naming
    min_image_tokens and max_image_tokens, the library's arguments, not the flag; now one line before any
    work, naming the flag and the range it takes."""
    assert encode_image.main([images[0], "--checkpoint", TOWER, "--cpu", "--max-image-tokens", limit]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"encode_image.py: --max-image-tokens {limit} must be an integer from 16 (the fewest "
                                 "tokens an image is resized to, the reference processor's minimum) to 2,147,483,647\n")


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(encode_image, "run", interrupted)
    assert encode_image.main([]) == 130 and "encode_image.py: interrupted; nothing saved" in capsys.readouterr().err


def test_embeddings_of_weights_that_overflow_are_said_and_not_saved(images, tmp_path, capsys):
    """Finite weights large enough to overflow the forward (cases.overflowing_tower): the example printed
    "mean +nan, std nan" and saved the NaN embeddings with status 0. Each image is named with the reason,
    nothing is saved, status 1; the video example likewise."""
    import encode_video

    bad = cases.overflowing_tower(tmp_path / "bad")
    out = tmp_path / "e.safetensors"
    assert encode_image.main(images + ["--checkpoint", bad, "--cpu", "--save", str(out)]) == 1
    said = capsys.readouterr()
    for path in images:
        assert f"encode_image.py: {path}: the tower's output holds" in said.err, said.err
    assert f"nothing saved to {out}" in said.err and "nan" not in said.out and not out.exists()
    assert encode_video.main(images[:1] * 2 + ["--fps", "2", "--checkpoint", bad, "--cpu", "--save", str(out)]) == 1
    said = capsys.readouterr()
    assert "encode_video.py: video: the tower's output holds" in said.err and not out.exists(), said.err


def test_control_characters_in_file_names_are_escaped(images, tmp_path, capsys):
    """A file name holding a newline or an escape sequence forged a line of output ("all good") and drove the
    terminal; the examples write it escaped, as glmvit-encode does."""
    evil = tmp_path / "a\x1b[31mred\nencode_image.py: all good\x07.png"
    evil.write_bytes(open(images[0], "rb").read())
    assert encode_image.main([str(evil), "--checkpoint", TOWER, "--cpu"]) == 0
    said = capsys.readouterr().out
    assert "\x1b" not in said and "\x07" not in said and "\\x1b[31mred\\x0aencode_image.py: all good\\x07.png" in said
    assert not any(line.startswith("encode_image.py: all good") for line in said.splitlines()), said
    junk = tmp_path / "b\x1b[2Jjunk.png"
    junk.write_bytes(b"not an image")
    assert encode_image.main([str(junk), "--checkpoint", TOWER, "--cpu"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "b\\x1b[2Jjunk.png" in err, err


def test_video_example_on_the_cpu_saves_what_the_reference_computes(tmp_path, capsys):
    """examples/encode_video.py: frames from files, sampled and preprocessed as HF's video processor, the
    embeddings the float32 reference's; a bad flag is one line and status 2."""
    import encode_video
    from safetensors.numpy import load_file

    from glmvit_cupy import preprocess_video

    frames = encode_video.pan(6)[:, ::4, ::4]
    paths = []
    for i, f in enumerate(frames):
        paths.append(str(tmp_path / f"f{i}.png"))
        Image.fromarray(f).save(paths[-1])
    out = str(tmp_path / "v.safetensors")
    assert encode_video.main(paths + ["--fps", "4", "--checkpoint", TOWER, "--cpu", "--save", out]) == 0
    said = capsys.readouterr().out
    assert "float32 NumPy reference runs on the CPU" in said and "frames [0, 1, 2, 4]" in said  # 3 found at 2 fps, 4 wanted: spread
    pv, grid, _ = preprocess_video(frames, fps=4.0, max_image_tokens=4000)
    want = reference.encode_pixels(bind_tower(TOWER), pv, grid).astype(ml_dtypes.bfloat16)
    got = load_file(out)["video"]
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert encode_video.main(paths + ["--fps", "-1", "--checkpoint", TOWER, "--cpu"]) == 2
    assert "video 0: --fps -1.0 must be a positive finite number" in capsys.readouterr().err  # the flag's name
    assert encode_video.main(paths + ["--max-video-tokens", "1", "--checkpoint", TOWER, "--cpu"]) == 2
    assert "video 0: --max-video-tokens 1 is too small" in capsys.readouterr().err  # the flag, not the library's name
    av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    clip = str(tmp_path / "clip.mkv")  # the same frames as a lossless file: the same embeddings
    with av.open(clip, "w") as c:
        s = c.add_stream("ffv1", rate=4)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    assert encode_video.main(["--video", clip, "--checkpoint", TOWER, "--cpu", "--save", out]) == 0
    assert f"{clip} of 80x100 px at 4 fps ->" in capsys.readouterr().out  # the file's rate, not "its fps"
    pv, grid, _ = preprocess_video(frames, fps=4.0, duration=6 / 4, max_image_tokens=4000)  # a file's: frames / fps
    want = reference.encode_pixels(bind_tower(TOWER), pv, grid).astype(ml_dtypes.bfloat16)
    assert np.array_equal(load_file(out)["video"].view(np.uint16), want.view(np.uint16))
    assert encode_video.main(["--video", str(tmp_path / "none.mp4"), "--checkpoint", TOWER, "--cpu"]) == 2
    assert "none.mp4' is not found (no such file)" in capsys.readouterr().err
    (tmp_path / "frames.jpg").mkdir()  # a folder, whatever its name says: not taken for an image file
    assert encode_video.main(["--video", str(tmp_path / "frames.jpg"), "--checkpoint", TOWER, "--cpu"]) == 2
    assert "frames.jpg' is a folder; a video file was expected" in capsys.readouterr().err


def test_video_example_mistakes_are_said_in_the_scripts_terms(capsys):
    """examples/encode_video.py: a bad --target-fps names the flag, not the library's sample_frames; an image
    given as --video says it is an image and how the script takes frames (files, without --video)."""
    import encode_video

    assert encode_video.main(["--target-fps", "0", "--checkpoint", TOWER, "--cpu"]) == 2
    err = capsys.readouterr().err
    assert "video 0: --target-fps 0.0 must be a positive finite number" in err and "sample_frames" not in err
    assert encode_video.main(["--target-fps", "0.01", "--checkpoint", TOWER, "--cpu"]) == 2
    err = capsys.readouterr().err  # too short: advice in flags, not sample=False
    assert "video 0: a 16-frame video" in err and err.rstrip().endswith("; raise --target-fps"), err
    photo = encode_video.PHOTO
    assert encode_video.main(["--video", photo, "--checkpoint", TOWER, "--cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--video {photo}: is an image file, not a video; give a video's frames as image files" in err
    assert "without --video" in err and "HxWx3" not in err


def test_the_ray_example_without_the_ray_extra_is_one_line_and_status_2(monkeypatch, capsys, tmp_path):
    """Without Ray it raised ModuleNotFoundError with a traceback; now it names the extra, leaving no --out."""
    import ray_encode

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, installed or not
    out = tmp_path / "out"
    assert ray_encode.main([str(tmp_path), "--checkpoint", TOWER, "--out", str(out), "--cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_encode: the ray extra is not installed") and "pip install -e '.[ray]'" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_the_random_checkpoint_goes_to_the_users_cache_folder(tmp_path, monkeypatch, capsys):
    """Without --checkpoint the example writes its random checkpoint under $XDG_CACHE_HOME where it is set
    (the freedesktop rule for a user's cache), else under ~/.cache."""
    import glmvit_cupy.checkpoint.synthetic as synthetic

    monkeypatch.setattr(synthetic, "cached_checkpoint", lambda path, geometry, seed: path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert encode_image.random_checkpoint() == str(tmp_path / "cache" / "glmvit_cupy" / "random-official-seed0")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert encode_image.random_checkpoint() == str(tmp_path / "home" / ".cache" / "glmvit_cupy" /
                                                   "random-official-seed0")
    assert "writing a random-weight checkpoint" in capsys.readouterr().out
