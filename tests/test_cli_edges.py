"""glmvit-encode at its edges, on the CPU backend (the float32 reference) with the golden tower: a file too
large to read, a file name that is not UTF-8, symbolic link loops, full disks, Ctrl-C on the CPU, the exit
statuses, the image token limits and the command's words."""

import errno
import json
import os
import resource
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from tests.golden import cases

from glmvit_cupy import reference
from glmvit_cupy.cli import main as cli
from glmvit_cupy import output
from glmvit_cupy.output import LOCK, image_key, read_embeddings

TOWER = str(cases.TOWER_DIR)
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def run(*args):
    return cli.main([str(a) for a in args])


def command(*args, limit_bytes=None, timeout=120):
    """glmvit-encode in a fresh interpreter (strict UTF-8 output), under an address-space limit if given."""
    def cap():
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
               PYTHONIOENCODING="utf-8:strict")
    return subprocess.run([sys.executable, "-m", "glmvit_cupy.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=cap, env=env)


@pytest.fixture
def folder(tmp_path):
    return cases.png_folder(tmp_path / "imgs", (60, 80), (64, 64))


# -- 1. a file too large to read ---------------------------------------------------------------------------

def test_a_huge_file_named_like_an_image_is_failed_from_its_size_and_the_rest_is_saved(folder, tmp_path):
    """A 6 GiB file named .tif (sparse: no disk) is refused from its size, by name, with the flag that raises
    the limit, never read; the images beside it are saved. The process's address space is held to 2 GiB
    throughout: reading the file whole would end the run with nothing saved."""
    huge = folder / "huge.tif"
    with open(huge, "wb") as f:
        f.truncate(6 << 30)
    out = tmp_path / "out"
    r = command(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--workers", 2, limit_bytes=2 << 30)
    said = r.stdout + r.stderr
    assert r.returncode == 1, said[-3000:]
    assert f"{huge}: the image file is 6,144 MiB, over the --max-image-mib limit of 64 MiB; raise --max-image-mib" \
        in said, said[-3000:]
    manifest, embs = read_embeddings(out)
    assert sorted(os.path.basename(k) for k in embs) == ["a.png", "b.png"]
    assert list(manifest["failed"]) == [image_key(huge)] and "--max-image-mib" in manifest["failed"][image_key(huge)]


def test_a_rerun_with_a_higher_max_pixels_resumes_and_encodes_what_was_refused(folder, tmp_path):
    """--max-pixels only accepts or refuses a file: the error's advice (raise it) works in the same folder, and
    a folder whose header recorded the limits (an earlier version) resumes under other ones."""
    out = tmp_path / "out"
    r = command(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--max-pixels", 4096)
    assert r.returncode == 1 and "--max-pixels" in r.stdout + r.stderr, r.stdout + r.stderr
    manifest, embs = read_embeddings(out)
    assert sorted(os.path.basename(k) for k in embs) == ["b.png"] and len(manifest["failed"]) == 1
    path = out / "manifest.json"
    old = json.loads(path.read_text())
    old["header"]["max_pixels"] = 4096
    old["header"]["video"]["max_video_pixels"] = None
    path.write_text(json.dumps(old))
    r = command(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--max-pixels", 5000)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest, embs = read_embeddings(out)
    assert sorted(os.path.basename(k) for k in embs) == ["a.png", "b.png"] and not manifest["failed"]


def test_a_file_under_the_limit_but_over_the_memory_fails_alone(folder, tmp_path):
    """Raised past what memory holds (--max-image-mib 7000 under a 2 GiB address space), the 6 GiB file
    fails by name with the reason, and the images beside it are saved: no MemoryError traceback."""
    huge = folder / "huge.tif"
    with open(huge, "wb") as f:
        f.truncate(6 << 30)
    out = tmp_path / "out"
    r = command(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--workers", 2, "--max-image-mib", 7000,
                limit_bytes=2 << 30)
    said = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in said, said[-3000:]
    assert f"{huge}: not enough memory to read and decode it" in said, said[-3000:]
    _, embs = read_embeddings(out)
    assert sorted(os.path.basename(k) for k in embs) == ["a.png", "b.png"]


def test_the_file_size_limits_are_flags_and_a_resume_with_a_higher_one_encodes_the_file(folder, tmp_path, capsys):
    out = tmp_path / "out"
    size = os.path.getsize(folder / "a.png")  # about 14 KiB
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--max-image-mib", size / 2**20 / 2) == 1
    said = capsys.readouterr().out
    assert "a.png: the image file is 0" in said and "over the --max-image-mib limit" in said
    # The limit shapes no embedding: the same folder resumes under another, and the file is encoded.
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    manifest, embs = read_embeddings(out)
    assert len(embs) == 2 and not manifest["failed"]
    for flag in ("--max-image-mib", "--max-video-mib"):
        for bad in ("0", "-1", "inf", "nan", "1e-09"):  # 1e-9 MiB is no whole byte: it was a limit of 0
            assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "o2", "--cpu", flag, bad) == 2
            assert f"{flag} {bad} must be a number of MiB from one byte" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_a_video_file_over_max_video_mib_is_failed_before_it_is_read(folder, tmp_path, capsys, monkeypatch):
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    import shutil

    from glmvit_cupy.cli import videos

    clip = folder / "clip.mp4"
    shutil.copy(os.path.join(os.path.dirname(__file__), "golden", "video_files", "h264_offset.mp4"), clip)
    read = []
    monkeypatch.setattr(videos, "HASH_CHUNK", 1 << 10)
    real_sha = videos.hashlib.sha256
    monkeypatch.setattr(videos.hashlib, "sha256", lambda *a: read.append(1) or real_sha(*a))
    out = tmp_path / "out"
    assert run(clip, folder / "a.png", "--checkpoint", TOWER, "--out", out, "--cpu", "--max-video-mib", 0.001) == 1
    assert f"{clip}: the video file is 0" in capsys.readouterr().out
    manifest, embs = read_embeddings(out)
    assert list(manifest["failed"]) == [image_key(clip)] and "over the --max-video-mib limit of 0" in \
        manifest["failed"][image_key(clip)] and len(embs) == 1
    assert run(clip, "--checkpoint", TOWER, "--out", out, "--cpu") == 0  # the default takes it


# -- 2. file names that are not UTF-8 ----------------------------------------------------------------------

def test_a_file_name_that_is_not_utf8_is_encoded_keyed_and_resumed(folder, tmp_path, capsys):
    """A name with a Latin-1 byte (the OS allows it, safetensors cannot store it as a key): its key is the
    repr() of its path's bytes; key_path gives the path back, the manifest entry holds the bytes, a re-run
    skips it, and a broken one is reported without a crash."""
    odd = os.fsdecode(os.fsencode(str(folder)) + b"/caf\xe9.png")
    with open(odd, "wb") as f:
        f.write((folder / "a.png").read_bytes())
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    manifest, embs = read_embeddings(out)
    key = repr(os.fsencode(os.path.realpath(odd)))
    assert key.startswith("b'") and len(embs) == 3 and key in embs
    assert output.key_path(key) == os.path.realpath(odd) and os.path.isfile(output.key_path(key))
    assert bytes.fromhex(manifest["images"][key]["path_bytes"]) == os.fsencode(os.path.realpath(odd))
    assert manifest["images"][key]["source"] == key
    assert np.array_equal(embs[key].view(np.uint16), embs[image_key(folder / "a.png")].view(np.uint16))
    json.loads((out / "manifest.json").read_text(encoding="utf-8"))  # plain UTF-8 JSON
    capsys.readouterr()
    broken = os.fsdecode(os.fsencode(str(folder)) + b"/bad\xff.png")
    with open(broken, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\nnot really")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 1  # the broken one; the rest resumed
    printed = capsys.readouterr().out
    assert "3 of 4 files already in" in printed and "skipped " in printed and "bad\\xff.png" in printed
    manifest, _ = read_embeddings(out)
    (failed,) = manifest["failed"]
    assert output.key_path(failed) == os.path.realpath(broken) and "bad\\xff.png" in manifest["failed"][failed]


def test_not_utf8_names_through_a_strict_utf8_terminal(folder, tmp_path):
    """Printed names (skipped files, the summary, --out itself) never raise on a strict UTF-8 stdout."""
    with open(os.fsencode(str(folder)) + b"/bad\xff.png", "wb") as f:
        f.write(b"not an image")
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xfe")
    r = command(folder, "--checkpoint", TOWER, "--out", out, "--cpu")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "bad\\xff.png" in r.stdout and "out\\xfe" in r.stdout and "Traceback" not in r.stderr



def test_a_checkpoint_whose_path_is_not_utf8_is_recorded_as_its_bytes(folder, tmp_path):
    """The manifest's header recorded a checkpoint path that is not UTF-8 as a lone surrogate ("\\udcff"), which
    no UTF-8 reader takes; it is the repr() of its bytes, as an image's key is, and the folder resumes."""
    ckpt = os.fsdecode(os.fsencode(str(tmp_path)) + b"/tower\xff")
    shutil.copytree(TOWER, ckpt)
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", ckpt, "--out", out, "--cpu") == 0
    text = (out / "manifest.json").read_bytes().decode("utf-8")
    assert "\\udc" not in text
    assert json.loads(text)["header"]["checkpoint"] == repr(os.fsencode(os.path.abspath(ckpt)))
    assert run(folder, "--checkpoint", ckpt, "--out", out, "--cpu") == 0

# -- 3. symbolic link loops --------------------------------------------------------------------------------

@pytest.fixture
def loops(folder):
    (folder / "sub").mkdir()
    Image.fromarray(cases._smooth(40, 40, 3)).save(folder / "sub" / "c.png")
    os.symlink("..", folder / "sub" / "up")        # two loops: each level of ** doubles the paths
    os.symlink("../..", folder / "sub" / "top")
    os.symlink(".", folder / "self")
    return folder


def test_a_glob_and_a_walk_end_in_symbolic_link_loops(loops, tmp_path):
    """glob 'dir/**/*.png' with two link loops inside ran for minutes (every branch followed to the system's
    depth limit). Checked in a subprocess with a time limit, so a regression fails instead of hanging."""
    code = ("from glmvit_cupy.cli.inputs import expand_inputs\n"
            f"print(expand_inputs([{str(loops / '**' / '*.png')!r}]))\nprint(expand_inputs([{str(loops)!r}]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("expanding a glob over symbolic link loops did not end in 30 s")
    assert r.returncode == 0, r.stderr
    want = [str(loops / "a.png"), str(loops / "b.png"), str(loops / "sub" / "c.png")]
    assert r.stdout.splitlines() == [repr(want), repr(want)]
    out = tmp_path / "out"
    assert run(loops / "**" / "*.png", loops, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    assert len(read_embeddings(out)[1]) == 3


def test_a_folder_walk_follows_a_link_to_a_folder_elsewhere(folder, tmp_path):
    """A folder linked in from elsewhere is walked (as ** does), once, however many links lead to it."""
    other = tmp_path / "elsewhere"
    other.mkdir()
    Image.fromarray(cases._smooth(40, 60, 4)).save(other / "d.png")
    os.symlink(other, folder / "linked")
    os.symlink(other, folder / "again")
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    assert sorted(os.path.basename(k) for k in read_embeddings(out)[1]) == ["a.png", "b.png", "d.png"]


def test_a_path_through_a_link_and_up_names_the_file_the_system_opens(tmp_path):
    """t/link/../x.png is real/x.png when link -> real/sub: the system follows the link before going up. Dropping
    `link/..` as text named t/x.png, another file, which was encoded under its key without a word."""
    from glmvit_cupy.cli.inputs import expand_inputs

    (tmp_path / "real" / "sub").mkdir(parents=True)
    Image.fromarray(cases._smooth(40, 60, 4)).save(tmp_path / "real" / "x.png")
    Image.fromarray(cases._smooth(20, 20, 5)).save(tmp_path / "x.png")  # the decoy the text form names
    os.symlink(tmp_path / "real" / "sub", tmp_path / "link")
    through = str(tmp_path / "link" / ".." / "x.png")
    assert [image_key(p) for p in expand_inputs([through])] == [str(tmp_path / "real" / "x.png")]
    found = expand_inputs([str(tmp_path / "link" / "..")])
    assert [image_key(p) for p in found] == [str(tmp_path / "real" / "x.png")]
    out = tmp_path / "out"
    assert run(through, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    manifest, embeddings = read_embeddings(out)
    assert list(embeddings) == [str(tmp_path / "real" / "x.png")]
    assert list(manifest["images"][str(tmp_path / "real" / "x.png")]["size_hw"]) == [40, 60]


# -- 4. write failures -------------------------------------------------------------------------------------

def test_a_manifest_or_folder_that_cannot_be_written_is_one_line(folder, tmp_path, monkeypatch, capsys):
    """An --out that cannot be made refuses the run before it starts (status 2, nothing written); a manifest that
    cannot be written stops it (status 3), and the shards written hold their images for the re-run."""
    (tmp_path / "file").write_text("x")
    assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "file" / "out", "--cpu") == 2
    err = capsys.readouterr().err
    made = tmp_path / "file" / "out"
    assert err.strip().splitlines()[-1] == f"glmvit-encode: cannot create the output folder {made}: Not a directory"
    real_replace = os.replace

    def full(src, dst):
        if str(dst).endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(output.os, "replace", full)
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 3
    err = capsys.readouterr().err
    assert f"glmvit-encode: cannot write {out / 'manifest.json'}: No space left on device; the run stopped" in err
    assert "Traceback" not in err and not [f for f in os.listdir(out) if f.endswith(".tmp")]
    monkeypatch.setattr(output.os, "replace", real_replace)
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0  # the shards held their images
    assert "2 of 2 files already" in capsys.readouterr().out


def test_a_shard_over_the_file_size_limit_is_one_line_and_status_3(folder, tmp_path):
    """A real write error, not a stand-in: under RLIMIT_FSIZE a shard larger than the limit fails in
    safetensors' own writer (a SafetensorError saying EFBIG, as it says ENOSPC). One line names the shard,
    exit status 3, and the shards written before it stay."""
    Image.fromarray(cases._smooth(500, 500, 7)).save(folder / "big.png")  # a 165 KB shard; a.png's, b.png's 10 KB
    out = tmp_path / "out"

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "glmvit_cupy.cli.main", str(folder), "--checkpoint", TOWER, "--out",
                        str(out), "--cpu", "--workers", "1"], capture_output=True, text=True, timeout=120,
                       preexec_fn=cap, env=env)
    assert r.returncode == 3, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("glmvit-encode: cannot write")]
    assert f"cannot write {out / 'embeddings-00003.safetensors'}: Error while serializing: I/O error: File too " \
           "large (os error 27); the run stopped with 2 files saved (2 in" in line, line
    assert "Traceback" not in r.stderr
    manifest, embs = read_embeddings(out)
    assert sorted(os.path.basename(k) for k in embs) == ["a.png", "b.png"]
    assert sorted(os.listdir(out)) == [LOCK, "embeddings-00001.safetensors", "embeddings-00002.safetensors",
                                       "manifest.json"]


@pytest.mark.parametrize("how", ["oserror", "outputerror", "a file in its place"])
def test_a_vllm_dir_that_cannot_be_written_is_one_line_and_status_3(folder, tmp_path, monkeypatch, capsys, how):
    """A --vllm-ec-dir write that fails mid-run (a full disk): status 3, the run stopped, one line. One that was
    already unusable (a file where the folder goes) never starts the run: status 2, --out not made."""
    from glmvit_cupy.errors import OutputError
    from glmvit_cupy import vllm_ec

    def full(folder, key, embedding, weights=None):
        if how == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise OutputError(f"cannot write {folder}/{key}/encoder_cache.safetensors: No space left on device")

    ec = tmp_path / "ec"
    if how == "a file in its place":
        ec.write_text("x")
        assert run(folder / "a.png", "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu",
                   "--vllm-ec-dir", ec) == 2
        err = capsys.readouterr().err
        assert f"glmvit-encode: cannot use the vLLM encoder cache folder {ec}: Not a directory (ENOTDIR); make it " \
            "a folder, or give --vllm-ec-dir another folder" in err, err
        assert not (tmp_path / "out").exists()
        if os.path.isdir("/proc/self"):  # permission bits that allow writes (to root) that fail anyway
            assert run(folder / "a.png", "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu",
                       "--vllm-ec-dir", "/proc/glmvit-ec") == 2
            assert "no file can be made in /proc: " in capsys.readouterr().err
            assert not (tmp_path / "out").exists()
        return
    monkeypatch.setattr(vllm_ec, "write", full)
    assert run(folder / "a.png", "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu", "--vllm-ec-dir", ec) == 3
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "the run stopped" in x]
    assert str(ec) in line and "re-run the same command" in line and "Traceback" not in err
    assert "No space left on device" in line, line


# -- 5. Ctrl-C on the CPU ----------------------------------------------------------------------------------

@pytest.fixture
def six(tmp_path):
    d = tmp_path / "six"
    d.mkdir()
    for i in range(6):
        Image.fromarray(cases._smooth(56, 84, 20 + i)).save(d / f"{i}.png")
    return d


def test_ctrl_c_on_the_cpu_keeps_every_image_that_finished(six, tmp_path, monkeypatch, capsys):
    """Six images fit one 8000-token pass, but on the CPU each image is a pass of its own, saved as it
    finishes: Ctrl-C on the fourth image keeps the three before it."""
    real, calls = reference.encode_pixels, []

    def fourth_interrupts(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(reference, "encode_pixels", fourth_interrupts)
    out = tmp_path / "out"
    assert run(six, "--checkpoint", TOWER, "--out", out, "--cpu") == 130
    assert "interrupted; 3 files saved this run (3 in" in capsys.readouterr().err
    assert len(read_embeddings(out)[1]) == 3
    monkeypatch.setattr(reference, "encode_pixels", real)
    assert run(six, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    assert "3 of 6 files already" in capsys.readouterr().out and len(read_embeddings(out)[1]) == 6


def test_sigterm_stops_a_run_as_ctrl_c_does_and_exits_143(six, tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM during the fourth image: the three finished are saved and said, status 143
    (128 + 15, as shells report it), no traceback; a re-run resumes. The signal is delivered for real, to
    this (the main) thread, while glmvit-encode's handler is installed; the test's own is back after."""
    import os
    import signal

    real, calls = reference.encode_pixels, []

    def fourth_is_terminated(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(reference, "encode_pixels", fourth_is_terminated)
    out = tmp_path / "out"
    assert run(six, "--checkpoint", TOWER, "--out", out, "--cpu") == 143
    assert "terminated (SIGTERM); 3 files saved this run (3 in" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before and len(read_embeddings(out)[1]) == 3
    monkeypatch.setattr(reference, "encode_pixels", real)
    assert run(six, "--checkpoint", TOWER, "--out", out, "--cpu") == 0


def test_the_cpu_progress_bar_counts_each_image_with_an_eta(six, tmp_path, monkeypatch, capsys):
    import re
    import time

    real = reference.encode_pixels

    def slow(*a, **kw):
        time.sleep(0.25)  # past tqdm's 0.1 s between redraws: each update is drawn
        return real(*a, **kw)

    monkeypatch.setattr(reference, "encode_pixels", slow)
    assert run(six, "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu") == 0
    bar = capsys.readouterr().err
    # n/6 drawn with the time left (mm:ss, not "?") for images before the last: the bar moves per image
    drawn = {int(n) for n in re.findall(r"([1-5])/6 \[\d\d:\d\d<\d\d:\d\d", bar)}
    assert len(drawn) >= 3, bar


# -- 6. exit statuses --------------------------------------------------------------------------------------

def test_the_exit_statuses_are_in_help_and_followed(folder, tmp_path, capsys):
    epilog = cli.parser().format_help()
    for status in ("0 ", "1 ", "2 ", "3 ", "130 ", "141 ", "143 "):
        assert f"\n  {status}" in epilog.split("exit status:")[1]
    out = tmp_path / "out"
    assert run(tmp_path / "nope.png", "--checkpoint", TOWER, "--out", out, "--cpu") == 2  # names nothing
    assert "no such file, folder or matching glob" in capsys.readouterr().err
    typo = str(tmp_path / "typo" / "*.png")  # a glob matching nothing, beside inputs that exist: as wrong
    assert run(folder, typo, "--checkpoint", TOWER, "--out", out, "--cpu") == 2 and not out.exists()
    assert f"no such file, folder or matching glob: {typo}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert run(tmp_path / "empty", "--checkpoint", TOWER, "--out", out, "--cpu") == 2  # holds nothing
    assert not out.exists()
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 1
    capsys.readouterr()
    # A resume whose only files left are earlier failures: they are tried again, fail again, and the run says
    # so: status 1, as long as any input is not in the output folder.
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 1
    said = capsys.readouterr().out
    assert "2 of 3 files already" in said and "1 file failed in an earlier run; trying it again" in said
    Image.fromarray(cases._smooth(30, 30, 9)).save(folder / "broken.png", format="PNG")  # mended
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    manifest, embs = read_embeddings(out)
    assert len(embs) == 3 and not manifest["failed"]
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0  # nothing left to do


def test_ctrl_c_before_encoding_is_130_and_one_line(folder, tmp_path, monkeypatch, capsys):
    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "bind_tower", interrupted)  # Ctrl-C while a large checkpoint loads
    try:
        assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu") == 130
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C before encoding escaped glmvit-encode as a KeyboardInterrupt (a traceback)")
    assert capsys.readouterr().err.strip() == "glmvit-encode: interrupted before anything was encoded"


def interrupted_script(name: str, stops_at: str) -> tuple[str, dict]:
    """Python code running console script `name` as setup.cfg declares it (as pip writes it) with Ctrl-C
    pressed as it first imports module `stops_at`, and the environment that finds this checkout's package."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(SRC, "..", "setup.cfg"))
    scripts = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].split("\n") if line)
    module, function = scripts[name].split(":")
    code = ("import sys\n"
            "class CtrlC:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name == {stops_at!r}:\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, CtrlC())\n"
            f"from {module} import {function}\n"
            f"sys.exit({function}())\n")
    return code, dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))


def test_ctrl_c_while_the_command_imports_is_130_and_one_line(folder, tmp_path):
    """Ctrl-C while glmvit-encode imports (NumPy, Pillow, the checkpoint loader: a second or more from a cold
    disk) ended in a KeyboardInterrupt traceback from the console script's import line, before main() had a
    handler. The console script setup.cfg declares runs as pip writes it, its first import of NumPy interrupted."""
    code, env = interrupted_script("glmvit-encode", "numpy")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", code, str(folder), "--checkpoint", TOWER, "--out", str(out), "--cpu"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 130, r.stderr[-3000:]
    assert r.stderr.strip() == "glmvit-encode: interrupted before anything was encoded" and not out.exists()


@pytest.mark.parametrize("stops_at", ["argparse", "glmvit_cupy.serving.main"])
def test_ctrl_c_while_glmvit_serve_imports_is_130_and_one_line(stops_at):
    """glmvit-serve's console script imported glmvit_cupy.serving.main (argparse, socket, threading: a cold disk
    makes it long) on its own import line, before main() had a handler: Ctrl-C there was a traceback. It now
    imports the command inside its entry point, as glmvit-encode's does (the test above): one line, status 130."""
    code, env = interrupted_script("glmvit-serve", stops_at)
    r = subprocess.run([sys.executable, "-c", code, "--checkpoint", TOWER, "--cpu", "--port", "18377"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 130, (r.returncode, r.stderr[-3000:])
    assert r.stderr.strip() == "glmvit-serve: interrupted while starting (exit 130)", r.stderr[-3000:]


def encode_in_a_process(folder, out, buffered=False, **streams):
    """glmvit-encode on `folder` into `out` in a fresh interpreter, its stdout and stderr as `streams` says
    (subprocess.run's keywords; PIPE by default), writing through to them unless `buffered`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
               PYTHONIOENCODING="utf-8:strict")
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, "-m", "glmvit_cupy.cli.main", str(folder), "--checkpoint", TOWER, "--out",
                           str(out), "--cpu"], **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams},
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_reader_gone_from_stdout_or_stderr_stops_the_run_as_ctrl_c_does(folder, tmp_path, stream, buffered):
    """`glmvit-encode ... | head -1`: a line written to a pipe whose reader went away ended the run in a traceback,
    or as a failed write to the output folder (status 3, "fix it (free space, permissions)"), or, buffered, in
    Python's "Exception ignored" at exit (status 120). It stops as Ctrl-C stops it: status 141 (128 + SIGPIPE),
    one line where the other stream can say it, what finished saved and left as it is, and the same command
    resumes."""
    (folder / "broken.png").write_bytes(b"not an image")  # its line, on stdout, meets the pipe mid-run
    out = tmp_path / "out"
    reader, gone = os.pipe()
    os.close(reader)
    try:
        r = encode_in_a_process(folder, out, buffered, **{stream: gone})
    finally:
        os.close(gone)
    said = r.stderr if stream == "stdout" else r.stdout
    assert r.returncode == 141 and "Traceback" not in said and "Exception ignored" not in said, said
    if stream == "stdout":
        assert any(line.startswith("glmvit-encode: stopped: the reader of its output went away (a broken pipe); ")
                   for line in said.splitlines()), said
    before = read_embeddings(out)[1]  # what the stopped run saved
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.FAILED  # broken.png, as ever
    manifest, after = read_embeddings(out)
    assert sorted(after) == sorted(image_key(folder / n) for n in ("a.png", "b.png"))
    for key, emb in before.items():
        assert np.array_equal(after[key].view(np.uint16), emb.view(np.uint16))
    assert list(manifest["failed"]) == [image_key(folder / "broken.png")]


@pytest.mark.parametrize("what", [["--help"], ["--inspect", TOWER]], ids=["help", "inspect"])
def test_a_reader_gone_from_a_run_that_encodes_nothing_says_nothing_of_resuming(what):
    """`glmvit-encode --help | true`: the reader gone stops it with status 141, and its line says only that;
    "what finished is saved; re-run the same command to resume" is for an encode."""
    reader, gone = os.pipe()
    os.close(reader)
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-m", "glmvit_cupy.cli.main", *what], stdout=gone,
                           stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    finally:
        os.close(gone)
    assert r.returncode == 141 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "glmvit-encode: stopped: the reader of its output went away (a broken pipe)"


@pytest.mark.parametrize("fd", [1, 2], ids=["stdout", "stderr"])
def test_a_stdout_or_stderr_closed_from_the_start_is_no_error(folder, tmp_path, fd):
    """`glmvit-encode ... 2>&-`: Python gives None for a stream closed from the start, and the progress bar's
    first write to it ended the run, before any image, in an AttributeError (status 1). The run goes on, saying
    nothing there, and ends as it would: status 1 for the file that fails, the other two saved."""
    (folder / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "out"
    r = encode_in_a_process(folder, out, preexec_fn=lambda: os.close(fd))
    said = r.stderr if fd == 1 else r.stdout
    assert r.returncode == cli.FAILED and "Traceback" not in said, said
    manifest, embs = read_embeddings(out)
    assert sorted(embs) == sorted(image_key(folder / n) for n in ("a.png", "b.png"))
    assert list(manifest["failed"]) == [image_key(folder / "broken.png")]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here (a device whose writes fail: ENOSPC)")
@pytest.mark.parametrize("fd", [1, 2], ids=["stdout", "stderr"])
def test_a_stdout_or_stderr_that_cannot_be_written_stops_nothing(folder, tmp_path, fd):
    """`glmvit-encode ... > log` on a full disk: a write to stdout that failed ended the run as a failed write to
    the output folder (status 3, "free space") or in a traceback, and on stderr, before anything was encoded,
    in a traceback nobody saw (status 1, the output folder holding only its lock). The run goes on, its lines
    there dropped, ends as it would (status 1 for the file that fails, the other two saved), and the other
    stream says which stream could not be written and why."""
    (folder / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        r = encode_in_a_process(folder, out, buffered=True, **{"stdout" if fd == 1 else "stderr": full})
    said = r.stderr if fd == 1 else r.stdout
    name = "stdout" if fd == 1 else "stderr"
    assert r.returncode == cli.FAILED and "Traceback" not in said and "Exception ignored" not in said, said
    assert said.splitlines()[-1].startswith(f"glmvit-encode: {name} could not be written ([Errno 28] "), said
    manifest, embs = read_embeddings(out)
    assert sorted(embs) == sorted(image_key(folder / n) for n in ("a.png", "b.png"))
    assert list(manifest["failed"]) == [image_key(folder / "broken.png")]


def test_names_a_stream_cannot_encode_are_escaped_not_a_crash(folder, tmp_path):
    """In an ASCII locale a file name outside ASCII, printed as it failed, ended the writer thread in a
    UnicodeEncodeError (a folder left with a manifest and no shard), and a non-ASCII --out the final line, in a
    traceback. Such a character is written as a backslash escape, and the run ends as it would."""
    (folder / "b\u00e4d\U0001f600.png").write_bytes(b"not an image")
    out = tmp_path / "s\u00e9"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
               PYTHONIOENCODING="ascii:strict")
    r = subprocess.run([sys.executable, "-m", "glmvit_cupy.cli", str(folder), "--checkpoint", TOWER, "--out", str(out),
                        "--cpu"], capture_output=True, timeout=120, env=env)
    said = r.stdout.decode("ascii") + r.stderr.decode("ascii")  # ASCII only, as the locale asks
    assert r.returncode == cli.FAILED and "Traceback" not in said, said
    assert "b\\xe4d\\U0001f600.png: cannot decode image" in said and "output in " + str(tmp_path) + "/s\\xe9" in said
    manifest, embs = read_embeddings(out)
    assert sorted(embs) == sorted(image_key(folder / n) for n in ("a.png", "b.png"))
    assert list(manifest["failed"]) == [image_key(folder / "b\u00e4d\U0001f600.png")]


# -- 7. the image token limits -----------------------------------------------------------------------------

def test_min_above_max_image_tokens_is_refused_before_the_checkpoint_is_loaded(folder, tmp_path, capsys):
    out = tmp_path / "out"
    for ckpt in (tmp_path / "no-such-checkpoint", TOWER):
        assert run(folder, "--checkpoint", ckpt, "--out", out, "--cpu", "--min-image-tokens", 100,
                   "--max-image-tokens", 50) == 2
        err = capsys.readouterr().err
        assert err.strip() == ("glmvit-encode: --min-image-tokens 100 is above --max-image-tokens 50: an image is "
                               "resized to between the two, so the minimum must not exceed the maximum")
        assert not out.exists()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--capacity-tokens", 10) == 2
    assert "--min-image-tokens 16 is above --max-image-tokens 10 (its default: 8000, or --capacity-tokens if " \
        "lower)" in capsys.readouterr().err


def test_capacity_tokens_alone_lowers_the_image_limit_as_the_api_does(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--capacity-tokens", 1000) == 0
    assert read_embeddings(out)[0]["header"]["max_image_tokens"] == 1000
    assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "o2", "--cpu", "--capacity-tokens", 1000,
               "--max-image-tokens", 2000) == 2
    assert "--max-image-tokens 2000 is above --capacity-tokens 1000" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()



def test_the_deprecated_batch_tokens_alias_works_and_says_so(capsys):
    args = cli.parser().parse_args(["x.png", "--batch-tokens", "1000"])
    assert args.capacity_tokens == 1000
    assert "glmvit-encode: --batch-tokens is deprecated; use --capacity-tokens" in capsys.readouterr().err
    assert cli.parser().parse_args(["x.png", "--capacity-tokens", "900"]).capacity_tokens == 900
    assert capsys.readouterr().err == ""

# -- 8. the command's words --------------------------------------------------------------------------------

def test_one_image_is_one_image(folder, tmp_path, capsys):
    assert run(folder / "a.png", "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu") == 0
    (summary,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("glmvit-encode: 1 ")]
    assert summary.startswith("glmvit-encode: 1 image, ")


def test_a_damaged_avif_in_a_folder_fails_alone(folder, tmp_path, capsys):
    """Pillow's AVIF reader raises a plain RuntimeError on a damaged file, which stopped the run with a
    traceback and nothing saved: the file is skipped by name, the images beside it saved, exit status 1."""
    import io

    from PIL import features

    if not features.check("avif"):
        pytest.skip("this Pillow reads no AVIF")
    buf = io.BytesIO()
    Image.new("RGB", (30, 20), (10, 200, 30)).save(buf, "AVIF")
    data = buf.getvalue()
    at = data.find(b"mdat") + 4
    (folder / "bad.avif").write_bytes(data[:at] + bytes(len(data) - at))
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 1
    assert f"skipped {folder / 'bad.avif'}: cannot decode image (RuntimeError: " in capsys.readouterr().out
    manifest, embs = read_embeddings(out)
    assert sorted(map(os.path.basename, embs)) == ["a.png", "b.png"]
    assert list(map(os.path.basename, manifest["failed"])) == ["bad.avif"]


def test_no_install_hint_names_a_package_no_index_has():
    import pathlib

    for path in pathlib.Path(cli.__file__).parent.glob("*.py"):
        assert "glmvit-cupy[" not in path.read_text(), path


def test_a_folder_that_cannot_be_listed_is_reported_not_passed_over(folder, tmp_path, monkeypatch, capsys):
    """An unreadable subfolder is a failed input, named with the OS's reason (root lists every folder, so the
    refusal is simulated); the rest is saved and the run exits 1."""
    import shutil

    locked = folder / "locked"
    locked.mkdir()
    shutil.copy(next(folder.glob("*.png")), locked / "inside.png")
    real = os.scandir

    def scandir(path="."):
        if os.path.normpath(os.fspath(path)) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["failed"]) == [image_key(str(locked))] and len(manifest["images"]) == 2
    assert f"skipped {locked}: a folder that cannot be listed ([Errno 13] Permission denied" in capsys.readouterr().out
    # Listed in the next run, its file is encoded and the folder's failure leaves the manifest (it stayed for good,
    # so a run that had encoded everything still said the folder failed).
    monkeypatch.setattr(os, "scandir", real)
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["failed"] == {} and len(manifest["images"]) == 3


def test_a_folder_too_deep_to_look_up_is_reported_not_passed_over(folder, tmp_path, capsys):
    """A folder whose path is past the system's limit (25 names of 200 characters: os.stat fails with
    ENAMETOOLONG) is a failed input saying so; the rest is saved and the run exits 1."""
    import shutil

    fd, deep = os.open(folder, os.O_RDONLY), str(folder)
    for k in range(25):
        name = f"{k:02d}" + "d" * 198
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd, deep = inner, os.path.join(deep, name)
    with open(next(folder.glob("*.png")), "rb") as src, \
            open(os.open("inside.png", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.close(fd)
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["images"]) == 2 and len(manifest["failed"]) == 1, manifest["failed"]
    said = capsys.readouterr().out
    assert ": cannot read ([Errno 36] File name too long" in said, said[-300:]


# -- weights that overflow the forward -----------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_embeddings_of_weights_that_overflow_are_failed_not_saved(folder, tmp_path, capsys):
    """Finite weights large enough to overflow the forward (tests/golden/cases.overflowing_tower): each image
    is failed saying so, nothing of it is saved (nor written for vLLM), the run exits 1; the good tower then
    encodes the same folder into the same output on a resume."""
    bad = cases.overflowing_tower(tmp_path / "bad")
    out, ec = tmp_path / "out", tmp_path / "ec"
    assert run(folder, "--checkpoint", bad, "--out", out, "--cpu", "--vllm-ec-dir", ec) == cli.FAILED
    said = capsys.readouterr()
    assert "0 images, 0 tokens" in said.out and "2 failed" in said.out, said.out
    manifest, embs = read_embeddings(out)
    assert not embs and not manifest["images"] and not (ec.exists() and os.listdir(ec))
    for key, why in manifest["failed"].items():
        assert why.startswith(f"{key}: the tower's output holds ") and "NaN or infinite values" in why
        assert f"skipped {key}: the tower's output holds" in said.out
    shutil.rmtree(out)
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE
    assert len(read_embeddings(out)[1]) == 2


def test_control_characters_in_a_file_name_never_reach_the_terminal_raw(folder, tmp_path, capsys):
    """A file name holding a newline and an escape sequence (the OS allows both): reported on one line with
    them written as \\xNN, so it can neither forge a line of output nor drive the terminal."""
    bad = folder / "a\nskipped FAKE: fake\x1b[2J.jpg"
    bad.write_bytes(b"not an image")
    assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu") == cli.FAILED
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\nskipped FAKE" not in out, out
    assert f"skipped {folder}/a\\x0askipped FAKE: fake\\x1b[2J.jpg: " in out, out
    why = read_embeddings(tmp_path / "out")[0]["failed"][image_key(bad)]
    assert "\n" not in why and "\x1b" not in why


def test_a_file_changed_since_it_was_encoded_is_encoded_again(folder, tmp_path, capsys):
    """A resume compares each encoded file's size and modification time with its entry's: a file replaced by
    other content under the same name is encoded again (saying so) and read back as the new content's
    embedding, the unchanged one is skipped."""
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE
    old = read_embeddings(out)[1][image_key(folder / "a.png")]
    Image.fromarray(cases._smooth(140, 90, 77)).save(folder / "a.png")  # other pixels, other size
    os.utime(folder / "a.png", ns=(1, 1_000_000_000_123))  # another time, whatever the clock's resolution
    capsys.readouterr()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE
    said = capsys.readouterr().out
    assert "1 file in" in said and "changed since it was encoded" in said and "1 of 2 files already" in said, said
    manifest, embs = read_embeddings(out)
    new = embs[image_key(folder / "a.png")]
    tower = reference.Tower(reference.bind_tower(TOWER))
    from glmvit_cupy import preprocess

    want = reference.encode_pixels(tower, *preprocess([str(folder / "a.png")])).astype(ml_dtypes.bfloat16)
    assert not np.array_equal(new.view(np.uint16), old.view(np.uint16))
    assert np.array_equal(new.view(np.uint16), want.view(np.uint16))
    assert manifest["images"][image_key(folder / "a.png")]["file"][1] == 1_000_000_000_123
    capsys.readouterr()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE  # nothing changed now
    assert "2 of 2 files already" in capsys.readouterr().out


def test_a_file_changed_into_one_that_fails_has_no_embedding_left(folder, tmp_path, capsys):
    """A file encoded, then replaced by one that cannot be decoded: the resume fails it, and neither the
    manifest, nor a later resume, nor read_embeddings gives its old embedding (the older shard still holds it)."""
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE
    (folder / "a.png").write_bytes(b"not an image any more")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.FAILED
    for _ in range(2):
        manifest, embs = read_embeddings(out)
        key = image_key(folder / "a.png")
        assert key not in embs and key not in manifest["images"] and key in manifest["failed"], manifest
        assert image_key(folder / "b.png") in embs
        assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.FAILED  # tried again, fails again
    capsys.readouterr()


def test_a_failed_file_removed_since_never_gets_its_old_embedding_back(folder, tmp_path, capsys):
    """A file encoded, then changed into one that fails, then removed (or its mount gone): the resume after that
    took its old embedding from the shard the manifest no longer listed, as the work of a run that stopped
    before its manifest (nothing to compare a stamp with), and erased the failure: the folder gave the old
    picture's embedding for a file that failed."""
    out = tmp_path / "out"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE  # one shard each (--cpu)
    (folder / "a.png").write_bytes(b"not an image any more")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.FAILED
    os.remove(folder / "a.png")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE  # b.png, done already
    manifest, embs = read_embeddings(out)
    key = image_key(folder / "a.png")
    assert key not in embs and key not in manifest["images"] and key in manifest["failed"], manifest
    assert list(embs) == [image_key(folder / "b.png")]
    capsys.readouterr()


def test_a_replaced_vllm_file_is_said_on_a_line_of_its_own(folder, tmp_path):
    """A vLLM file of another tower under an image's key is replaced, and glmvit-encode says so on a line of
    its own, not inside the progress bar."""
    from safetensors.numpy import load_file, save_file

    ec = tmp_path / "ec"
    assert run(folder / "a.png", "--checkpoint", TOWER, "--out", tmp_path / "o1", "--cpu", "--vllm-ec-dir", ec) == 0
    (path,) = ec.glob("*/encoder_cache.safetensors")
    save_file(load_file(path), path, metadata={"glmvit_weights": "0" * 64})
    done = command(folder / "a.png", "--checkpoint", TOWER, "--out", tmp_path / "o2", "--cpu", "--vllm-ec-dir", ec)
    assert done.returncode == 0, done.stderr  # a process of its own: logging as a user's run has it
    lines = done.stderr.replace("\r", "\n").splitlines()
    assert any(line.startswith(f"glmvit-encode: {path} holds an embedding of other weights") and
               line.endswith(": replaced") for line in lines), lines


def test_a_rerun_with_vllm_ec_dir_writes_the_files_of_what_was_encoded_before(folder, tmp_path, capsys):
    """Images encoded in an earlier run without --vllm-ec-dir (or whose vLLM file was deleted since) get their
    files from the shards on a re-run that skips them: the same files, byte for byte, as a fresh run writes."""
    import shutil

    out, ec, fresh = tmp_path / "out", tmp_path / "ec", tmp_path / "fresh"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == 0
    assert "2 files encoded earlier had no file in --vllm-ec-dir" in capsys.readouterr().out
    assert run(folder, "--checkpoint", TOWER, "--out", tmp_path / "o2", "--cpu", "--vllm-ec-dir", fresh) == 0
    keys = sorted(p.name for p in fresh.iterdir())
    assert sorted(p.name for p in ec.iterdir()) == keys and len(keys) == 2
    for k in keys:
        assert (ec / k / "encoder_cache.safetensors").read_bytes() == (fresh / k / "encoder_cache.safetensors").read_bytes()
    shutil.rmtree(ec / keys[0])
    capsys.readouterr()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == 0
    assert "1 file encoded earlier had no file" in capsys.readouterr().out
    assert (ec / keys[0] / "encoder_cache.safetensors").read_bytes() == \
        (fresh / keys[0] / "encoder_cache.safetensors").read_bytes()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == 0
    assert "had no file" not in capsys.readouterr().out  # all there: nothing written
    manifest = json.loads((out / "manifest.json").read_text())  # entries of an older run: no sha256
    for entry in manifest["images"].values():
        del entry["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(ec)
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == 0
    assert "2 files encoded earlier had no file" in capsys.readouterr().out
    assert sorted(p.name for p in ec.iterdir()) == keys  # keyed by the files' sha256, read again
    for entry in manifest["images"].values():  # older still: no stamp either, so the file may have changed
        entry.pop("file", None)
    (out / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(ec)
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == 0
    assert "no --vllm-ec-dir file written for it: its entry records neither" in capsys.readouterr().err
    assert not ec.exists() or not any(ec.iterdir())


def test_a_link_in_the_way_of_an_earlier_files_vllm_entry_is_named_as_when_it_is_written(tmp_path, capsys):
    """A re-run filling --vllm-ec-dir from --out that finds a symbolic link where one file's entry goes names it
    as a run writing it does (`no --vllm-ec-dir file for PATH: ...`, its embedding saved), not as `skipped`, a
    failed file; the link and what it points to stay as they are, and the status is 1."""
    import hashlib

    from glmvit_cupy import vllm_ec

    rng = np.random.default_rng()
    folder, out, ec = tmp_path / "imgs", tmp_path / "out", tmp_path / "ec"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 256, (int(rng.integers(30, 80)), int(rng.integers(30, 80)), 3),
                                     dtype=np.uint8)).save(folder / name)
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE
    key = vllm_ec.key_for_image(hashlib.sha256((folder / "a.png").read_bytes()).hexdigest(), 16, 8000)
    (ec / key).mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("not the cache's")
    (ec / key / "encoder_cache.safetensors").symlink_to(victim)
    capsys.readouterr()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == cli.FAILED
    err = capsys.readouterr().err
    assert f"no --vllm-ec-dir file for {os.path.realpath(folder / 'a.png')}: " in err, err
    assert "its embedding is saved in --out" in err and "skipped" not in err, err
    assert victim.read_text() == "not the cache's" and len(read_embeddings(out)[1]) == 2


def test_something_in_the_way_of_one_vllm_key_fails_that_input_alone(folder, tmp_path, capsys):
    """A file of someone else's where one image's --vllm-ec-dir folder goes: its embedding is still saved in
    --out, the other images get their vLLM files, the line names the image and the obstacle, and the status
    is 1 (not 3: nothing stopped); each re-run says so again until the obstacle goes, then writes the file."""
    import hashlib

    from glmvit_cupy import vllm_ec

    out, ec = tmp_path / "out", tmp_path / "ec"
    sha = hashlib.sha256((folder / "a.png").read_bytes()).hexdigest()
    key = vllm_ec.key_for_image(sha, 16, 8000)
    ec.mkdir()
    (ec / key).write_text("not ours")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == cli.FAILED
    got = capsys.readouterr()
    assert f"no --vllm-ec-dir file for {folder / 'a.png'}: {ec / key} is not a folder" in got.err + got.out
    assert "1 without a --vllm-ec-dir file" in got.out
    manifest, embeddings = read_embeddings(out)
    assert len(embeddings) == 2 and not manifest["failed"]
    assert len([p for p in ec.iterdir() if p.is_dir()]) == 1 and (ec / key).read_text() == "not ours"
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == cli.FAILED
    assert f"{ec / key} is not a folder" in capsys.readouterr().err
    (ec / key).unlink()
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == cli.DONE
    assert "1 file encoded earlier had no file in --vllm-ec-dir" in capsys.readouterr().out
    assert (ec / key / "encoder_cache.safetensors").is_file()
    (ec / key / "encoder_cache.safetensors").unlink()  # a link where its file goes: in the way too, on a re-run
    (ec / key / "encoder_cache.safetensors").symlink_to(tmp_path / "elsewhere")
    assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == cli.FAILED
    assert "is a symbolic link" in capsys.readouterr().err


def test_pillows_warning_on_damaged_exif_names_the_image(tmp_path, rng):
    """A JPEG whose EXIF block is damaged: Pillow warns (without a file name) and reads no orientation, as
    the reference's loader does; the command names the image in one line, and encodes it."""
    import io

    im = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))
    exif = im.getexif()
    exif[0x0112] = 3
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif)
    data = bytearray(buf.getvalue())
    at = max(data.find(b"MM\x00*"), data.find(b"II*\x00"))
    data[at + 4:at + 8] = b"\xff\xff\xff\x00"  # the first IFD's offset: past the block's end
    (tmp_path / "imgs").mkdir()
    names = [f"turned{i}.jpg" for i in range(3)]  # the same warning thrice: each named (not once a run)
    for name in names:
        (tmp_path / "imgs" / name).write_bytes(bytes(data))
    done = command(tmp_path / "imgs", "--checkpoint", TOWER, "--cpu", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.replace("\r", "\n").splitlines() if "Corrupt EXIF" in ln]
    named = {n for n in names for ln in lines if f"{n}: Corrupt EXIF data" in ln}
    assert named == set(names) and "warnings.warn" not in done.stderr, done.stderr
    manifest, embeddings = read_embeddings(tmp_path / "out")
    assert len(embeddings) == 3 and not manifest["failed"]


def test_a_bomb_warning_is_not_said_for_the_image_its_refusal_names(capsys):
    """Pillow warns of an image over its limit before the decode refuses it; glmvit-encode's line for that
    image is the refusal ("skipped ...: refused as a possible decompression bomb"), so the warning, which
    would say the image is encoded, is not printed. Pillow's other warnings on an image still are."""
    from glmvit_cupy.cli.main import _warning_above_the_bar
    from glmvit_cupy.preprocessing import decode

    decode._now.name = "big.png"
    try:
        _warning_above_the_bar(Image.DecompressionBombWarning("Image size (2000 pixels) exceeds limit"),
                               Image.DecompressionBombWarning, "Image.py", 1)
        assert capsys.readouterr().err == ""
        _warning_above_the_bar(UserWarning("Corrupt EXIF data"), UserWarning, "TiffImagePlugin.py", 1)
        assert "big.png: Corrupt EXIF data (Pillow;" in capsys.readouterr().err
    finally:
        decode._now.name = None


def test_a_folders_files_of_other_names_are_counted_as_passed_over(tmp_path, capsys):
    """A folder's .jfif and .jpe photos are images too; a .heic (which this Pillow may not read) or an icon is
    passed over, and the run says how many such image files it passed over and names one, instead of finishing
    with exit 0 as if the folder were done; a caption or a PDF beside them is passed over without a word."""
    src = tmp_path / "imgs"
    src.mkdir()
    pixels = np.random.default_rng().integers(0, 255, (40, 56, 3), np.uint8)
    Image.fromarray(pixels).save(src / "a.jfif", "JPEG")
    Image.fromarray(pixels).save(src / "b.jpe", "JPEG")
    (src / "c.heic").write_bytes(b"not read")
    (src / "d.ico").write_bytes(b"not read")
    (src / "notes.txt").write_text("x")  # a caption beside its image: not said
    (src / "scan.pdf").write_text("x")
    out = tmp_path / "out"
    assert run(src, "--checkpoint", TOWER, "--out", out, "--cpu") == cli.DONE
    err = capsys.readouterr().err
    assert "passed over 2 image files in the folders whose names end in none of .jpg" in err and \
        f"(e.g. {src / 'c.heic'}); name a file to encode it" in err, err
    assert sorted(os.path.basename(k) for k in read_embeddings(out)[1]) == ["a.jfif", "b.jpe"]


def test_files_after_a_double_dash_are_inputs_whatever_their_names(tmp_path, monkeypatch):
    """`glmvit-encode --out o -- -x.jpg`: after `--` a word starting with `-` is a file, as in any command."""
    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.random.default_rng().integers(0, 255, (40, 56, 3), np.uint8)).save("-x.jpg")
    args = cli.parse(["--out", "o", "a.png", "--", "-x.jpg", "--cpu"])
    assert args.inputs == ["a.png", "-x.jpg", "--cpu"] and args.out == "o" and not args.cpu
    assert run("--checkpoint", TOWER, "--out", "o", "--cpu", "--", "-x.jpg") == cli.DONE
    assert [os.path.basename(k) for k in read_embeddings("o")[1]] == ["-x.jpg"]


def test_a_glob_over_output_folders_takes_no_shard_manifest_or_lock(folder, tmp_path, capsys):
    """`glmvit-encode 'S/**' --out S/out` after a run into S took S's shards and manifests (and its own, on a
    re-run) as images: each failed to decode, went into `failed`, and every later run exited 1 for them."""
    assert run(folder, "--checkpoint", TOWER, "--out", folder, "--cpu") == 0  # its shards beside the images
    pattern, out = str(folder / "**"), folder / "out"
    for _ in range(2):  # the second run's glob reaches out/ too
        assert run(pattern, "--checkpoint", TOWER, "--out", out, "--cpu") == 0
        said = capsys.readouterr().out
        assert "cannot decode" not in said and "safetensors" not in said.replace(str(out), "")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["failed"] == {} and len(manifest["images"]) == 2


def test_a_double_star_glob_takes_the_files_a_folder_walk_takes(folder, tmp_path, capsys):
    """`'S/**'` took every file below S: notes, a HEIC photo, the encoder_cache.safetensors files of a --vllm-ec-dir
    in S; each failed to decode, went into `failed`, and every run exited 1 for them. A `**` takes what a walk of S
    takes (image and video names), and the images it passes over are said, as a walk says them."""
    from glmvit_cupy.cli.inputs import expand_inputs

    (folder / "notes.txt").write_text("not an image")
    (folder / "sub").mkdir()
    (folder / "sub" / "phone.heic").write_bytes(b"not read: HEIC is no format Pillow reads")
    Image.fromarray(cases._smooth(40, 56, 7)).save(folder / "sub" / "c.png")
    ec, out = folder / "ec", folder / "out"
    pattern = str(folder / "**")
    for _ in range(2):  # the second run's glob reaches out/ and ec/ as written by the first
        assert run(pattern, "--checkpoint", TOWER, "--out", out, "--cpu", "--vllm-ec-dir", ec) == cli.DONE
        err = capsys.readouterr().err
        assert "passed over 1 image file" in err and "phone.heic" in err, err
    assert len(list(ec.glob("*/encoder_cache.safetensors"))) == 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["failed"] == {} and len(manifest["images"]) == 3
    assert expand_inputs([pattern]) == expand_inputs([str(folder)])  # the walk's files, in the walk's order
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")  # a ** that matches files, none of them images
    assert run(tmp_path / "notes" / "**", "--checkpoint", TOWER, "--out", tmp_path / "o2", "--cpu") == cli.USAGE
    assert "no images or videos found in" in capsys.readouterr().err


def test_a_double_star_glob_naming_an_extension_takes_the_files_it_names(tmp_path, capsys):
    """`'S/**/*.ppm'` names its files by their extension: a walk passes .ppm over, but this glob asks for them, and
    a ** taking only a walk's files encoded none of them ("no images or videos found", exit 2)."""
    from glmvit_cupy.cli.inputs import expand_inputs

    (tmp_path / "S" / "sub").mkdir(parents=True)
    Image.fromarray(cases._smooth(40, 56, 7)).save(tmp_path / "S" / "sub" / "c.ppm")
    (tmp_path / "S" / "notes.txt").write_text("not asked for")
    pattern = str(tmp_path / "S" / "**" / "*.ppm")
    assert expand_inputs([pattern]) == [pattern.replace(os.path.join("**", "*.ppm"), os.path.join("sub", "c.ppm"))]
    assert run(pattern, "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu") == cli.DONE
    assert list(read_embeddings(tmp_path / "out")[1]) == [image_key(tmp_path / "S" / "sub" / "c.ppm")]


@pytest.mark.parametrize("pattern", ["*.png", os.path.join("**", "*.png")], ids=["glob", "double-star"])
def test_a_glob_takes_a_broken_link_as_a_folder_walk_does(tmp_path, pattern, capsys):
    """A broken symbolic link a glob matched was dropped (the shell's glob takes it): alone, the run ended in "no
    such file, folder or matching glob" (exit 2); beside images, unnoticed. It is taken, and reading it fails,
    naming it, as when a folder walk meets it."""
    from glmvit_cupy.cli.inputs import expand_inputs

    (tmp_path / "S").mkdir()
    os.symlink(tmp_path / "moved-away.png", tmp_path / "S" / "gone.png")
    assert expand_inputs([str(tmp_path / "S" / pattern)]) == [str(tmp_path / "S" / "gone.png")]
    assert run(tmp_path / "S" / pattern, "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu") == cli.FAILED
    assert f"{tmp_path / 'S' / 'gone.png'}: a broken symbolic link (to " in capsys.readouterr().out


def test_a_double_star_glob_matching_folders_walks_them(tmp_path):
    """`'photos/**/2024'` matches folders only, and was "no such file, folder or matching glob": a `**` did not walk
    the folders it matched. It walks the outermost of them (a 2024 inside a 2024 once), and `'photos/**'` and
    `'photos/**/*'` still take what a walk of photos takes, each file once."""
    from glmvit_cupy.cli.inputs import expand_inputs

    photos = tmp_path / "photos"
    for sub in ("a/2024", "b/2024/2024", "b/2023", "2024"):
        (photos / sub).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(photos / sub / "x.png")
    (photos / "top.png").write_bytes((photos / "2024" / "x.png").read_bytes())
    got = expand_inputs([str(photos / "**" / "2024")])
    assert got == [str(photos / sub / "x.png") for sub in ("2024", "a/2024", "b/2024/2024")]
    walked = expand_inputs([str(photos)])
    assert len(walked) == 5
    assert expand_inputs([str(photos / "**")]) == walked
    assert sorted(expand_inputs([str(photos / "**" / "*")])) == sorted(walked)
    passed = []
    (photos / "b" / "2024" / "notes.txt").write_text("x")
    expand_inputs([str(photos / "**" / "2024")], passed_over=passed)
    assert passed == [str(photos / "b" / "2024" / "notes.txt")]  # said once, though two matched folders hold it


def test_a_quoted_glob_that_matches_folders_walks_them_as_the_shell_would(tmp_path):
    """'photos-*' matching two folders was 'no such file, folder or matching glob', while the shell's own
    expansion of it walked them."""
    from glmvit_cupy.cli.inputs import expand_inputs

    for name in ("photos-2023", "photos-2024"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / name / "a.png")
    (tmp_path / "photos-2024" / "notes.txt").write_text("x")
    got = expand_inputs([str(tmp_path / "photos-*")])
    assert got == [str(tmp_path / "photos-2023" / "a.png"), str(tmp_path / "photos-2024" / "a.png")]
    assert expand_inputs([str(tmp_path / "photos-*" / "*.png")]) == got


def test_a_file_that_became_a_folder_is_named_for_what_it_is(tmp_path):
    """An input file replaced by a folder during a run was reported as 'a folder that cannot be listed', which
    the empty folder was not."""
    from glmvit_cupy.cli.inputs import prepared

    (tmp_path / "x.png").mkdir()
    ((path, got),) = list(prepared([str(tmp_path / "x.png")], 1, lambda *a: None))
    assert "a folder, not a file: it could not be listed when the inputs were read, or took a file's place" in str(got)


def test_an_input_naming_the_output_folders_lock_keeps_the_folder_locked(folder, tmp_path, monkeypatch):
    """The lock is a POSIX record lock (lockf): closing any descriptor of the lock file in the process drops it.
    An input naming the lock file (read, refused as an image, closed) must not let a second run in."""
    out = tmp_path / "out"
    assert run(folder / "a.png", "--checkpoint", TOWER, "--out", out, "--cpu") == 0
    probes = []
    real = output.Output.add_batch

    def add_batch(self, entries):
        real(self, entries)
        if not probes:  # a second run into the same folder while this one writes it
            probes.append(command(folder / "a.png", "--checkpoint", TOWER, "--out", out, "--cpu"))

    monkeypatch.setattr(output.Output, "add_batch", add_batch)
    assert run(out / LOCK, folder / "b.png", "--checkpoint", TOWER, "--out", out, "--cpu", "--workers", 1) == 1
    assert probes[0].returncode == 2, probes[0].stderr
    assert "another process is writing" in probes[0].stderr



def test_a_folder_on_a_file_system_without_locks_is_not_said_to_be_written_by_another_run(folder, tmp_path,
                                                                                          monkeypatch, capsys):
    """lockf fails with ENOLCK (an NFS mount without lockd, a FUSE file system without locks): no other run holds
    the folder, so saying one does (wait for that run to end) sends the user waiting for nothing, for ever."""
    import errno
    import fcntl

    def no_locks(*a):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    (tmp_path / "there").mkdir()
    for out in (tmp_path / "out", tmp_path / "there"):  # a new folder, an existing one: nothing made is left
        assert run(folder, "--checkpoint", TOWER, "--out", out, "--cpu") == 2
        err = capsys.readouterr().err
        assert "another process" not in err and "No locks available" in err, err
    assert sorted(os.listdir(tmp_path)) == ["imgs", "there"] and os.listdir(tmp_path / "there") == []



def test_workers_past_what_the_system_can_start_is_no_traceback(tmp_path, monkeypatch, capsys):
    """--workers has no upper bound: 5000 under a memory or pids limit (ulimit -v, a container's pids.max) ends the
    run in RuntimeError: can't start new thread, a traceback (status 1, which the docs give to failed inputs)."""
    import threading

    folder = cases.png_folder(tmp_path / "imgs", *[(28 + i, 28) for i in range(40)])
    real = threading.Thread.start

    def start(self):
        if threading.active_count() > 8:  # the system's limit on threads (ulimit -v, pids.max), met
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    rc = run(folder, "--checkpoint", TOWER, "--out", tmp_path / "out", "--cpu", "--workers", 5000)
    assert rc in (0, 2), rc
    assert rc == 2 or len(read_embeddings(tmp_path / "out")[1]) == 40



def test_a_glob_ending_in_a_slash_matches_folders_only_as_the_shells_does(tmp_path):
    """'photos/*/' is the shell's (and glob.glob's) way to name the folders in photos, not its files: the run takes
    photos/top.png as well, encoding (and keying into the folder) a file the user left out."""
    import glob

    from glmvit_cupy.cli.inputs import expand_inputs

    top = cases.png_folder(tmp_path / "photos", (60, 80))
    (top / "a.png").rename(top / "top.png")
    cases.png_folder(top / "sub", (64, 64))
    pattern = f"{top}/*/"
    assert glob.glob(pattern) == [f"{top}/sub/"]
    assert expand_inputs([pattern]) == [f"{top}/sub/a.png"]
