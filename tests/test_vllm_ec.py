"""vllm_ec.write: the file vLLM reads is what safetensors writes; writers of one key at once all succeed; the
files get the umask's mode; a write the disk refuses is one OutputError line with no temporary file left;
nothing is written outside the cache folder, whatever the key or the links planted in it."""

import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import glmvit_cupy
from glmvit_cupy.errors import OutputError
from glmvit_cupy import vllm_ec

FILE = "encoder_cache.safetensors"
SRC = os.path.dirname(os.path.dirname(glmvit_cupy.__file__))  # subprocesses import the code under test
KEY = vllm_ec.key_of(b"an image's bytes")


def embedding(rng, tokens=64, hidden=256):
    return rng.standard_normal((tokens, hidden), dtype=np.float32).astype(ml_dtypes.bfloat16)


def python(*args, code):
    """`code` run by a fresh interpreter (its own umask, its own limits) on this checkout; its stdout as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_file_is_what_safetensors_writes(tmp_path, rng):
    """One tensor "ec_cache", bf16, the embedding's bits; the bytes are safetensors' own (save_file's) for a
    bf16 embedding and a transposed view alike."""
    emb = embedding(rng)
    path = vllm_ec.write(str(tmp_path), KEY, emb)
    assert path == str(tmp_path / KEY / FILE) and os.listdir(tmp_path / KEY) == [FILE]
    got = load_file(path)
    assert list(got) == ["ec_cache"] and got["ec_cache"].dtype == ml_dtypes.bfloat16
    assert got["ec_cache"].shape == emb.shape and np.array_equal(got["ec_cache"].view(np.uint16), emb.view(np.uint16))
    for i, array in enumerate([emb, emb.T]):
        key = vllm_ec.key_of(bytes([i]))
        save_file({"ec_cache": np.ascontiguousarray(array)}, str(tmp_path / "reference"))
        written = vllm_ec.write(str(tmp_path), key, array)
        assert (tmp_path / key / FILE).read_bytes() == (tmp_path / "reference").read_bytes(), array.dtype
        assert np.array_equal(load_file(written)["ec_cache"], array)


@pytest.mark.parametrize("bad, says", [
    (np.ones((3, 8), np.float32), r"is float32 \[3, 8\], not the bf16 \[tokens, hidden\]"),
    (np.ones(8, ml_dtypes.bfloat16), r"is bfloat16 \[8\], not the bf16"),
    (np.ones((1, 3, 8), ml_dtypes.bfloat16), r"is bfloat16 \[1, 3, 8\]"),
    (np.ones((0, 8), ml_dtypes.bfloat16), r"is bfloat16 \[0, 8\]"),
    (np.full((3, 8), np.nan, np.float32).astype(ml_dtypes.bfloat16), "holds NaN or infinite values"),
    (None, "the embedding is a NoneType, not a NumPy array"),
])
def test_an_embedding_that_is_not_a_finite_bf16_matrix_is_refused_before_anything_is_written(tmp_path, bad, says):
    """A float32, 1-D, 3-D, empty or NaN embedding was written as it was (a file vLLM and holds() cannot take,
    replaced at every later write); None raised safetensors' own error."""
    with pytest.raises(ValueError, match=says):
        vllm_ec.write(str(tmp_path), KEY, bad)
    assert os.listdir(tmp_path) == []


def test_keys_are_made_of_checked_values():
    """key_for_image took any string for a sha and truncated 16.5 tokens to 16; video_key_of raised TypeError
    for NumPy numbers, which it now takes as the numbers they are."""
    sha = vllm_ec.key_of(b"x")
    for args, says in [(("not a sha", 16, 8000), "key_for_image: sha 'not a sha' is not a lowercase hex sha256"),
                       ((sha, 16.5, 100), r"key_for_image: min_image_tokens=16\.5 is not an integer of at least 0"),
                       ((sha, True, 100), "min_image_tokens=True"), ((sha, 16, None), "max_image_tokens=None"),
                       ((sha, -1, 100), "min_image_tokens=-1"), ((sha, 0, 0), "max_image_tokens=0 is not an "
                                                                              "integer of at least 1")]:
        with pytest.raises(ValueError, match=says):
            vllm_ec.key_for_image(*args)
    assert vllm_ec.key_for_image(sha, np.int64(16), 8000) == sha != vllm_ec.key_for_image(sha, 16, 100)
    assert vllm_ec.key_for_image(sha, 0, 8000) not in (sha, vllm_ec.key_for_image(sha, 1, 8000))  # 0: no minimum
    assert vllm_ec.key_for_image(sha, 16.0, 8000.0) == sha and vllm_ec.key_for_image(sha, 8.0, 100) == \
        vllm_ec.key_for_image(sha, 8, 100)  # whole-number floats are the integers they hold, as before
    same = vllm_ec.video_key_of([b"a"], 2.0, None, {"max_frames": 5}, kind="file")
    assert vllm_ec.video_key_of([b"a"], np.float32(2.0), None, {"max_frames": np.int64(5)}, kind="file") == same
    for fps, settings, says in [(float("nan"), {}, "fps=nan"), (2.0, {"x": [1]}, r"x=\[1\] is not a number"),
                                (2.0, [], "settings is a list")]:
        with pytest.raises(ValueError, match=says):
            vllm_ec.video_key_of([b"a"], fps, None, settings, kind="file")
    with pytest.raises(ValueError, match="video_key_of: file 0's sha256 'zz' is not a lowercase hex sha256"):
        vllm_ec.video_key_of_shas(["zz"], 2.0, None, {}, kind="frames")


def test_an_empty_folder_name_is_refused_at_the_check():
    with pytest.raises(OutputError, match="the vLLM encoder cache folder is ''; give a folder's path"):
        vllm_ec.check_folder("")


def test_an_existing_file_is_left_as_it_is(tmp_path, rng):
    first = vllm_ec.write(str(tmp_path), KEY, embedding(rng))
    before = open(first, "rb").read()
    assert vllm_ec.write(str(tmp_path), KEY, embedding(rng)) == first and open(first, "rb").read() == before


def test_a_file_of_other_weights_is_replaced_one_of_the_same_is_kept(tmp_path, rng, caplog):
    """The tower's fingerprint rides in the file's metadata: the same key written by a tower of other weights
    (a checkpoint replaced under one cache folder), or over a file that names none, replaces the file with a
    warning; the same tower keeps it, and so does a write that gives no fingerprint."""
    from safetensors import safe_open

    a, b = embedding(rng), embedding(rng)
    path = vllm_ec.write(str(tmp_path), KEY, a, weights="1" * 64)
    with safe_open(path, "np") as f:
        assert f.metadata() == {"glmvit_weights": "1" * 64}
    vllm_ec.write(str(tmp_path), KEY, b, weights="1" * 64)
    assert np.array_equal(load_file(path)["ec_cache"].view(np.uint16), a.view(np.uint16))
    vllm_ec.write(str(tmp_path), KEY, b, weights="2" * 64)
    assert np.array_equal(load_file(path)["ec_cache"].view(np.uint16), b.view(np.uint16))
    assert "holds an embedding of other weights (fingerprint 111111111111...) (this tower's fingerprint: 222222222222" in \
        caplog.text and os.listdir(tmp_path / KEY) == [FILE]
    vllm_ec.write(str(tmp_path), KEY, a)  # no fingerprint given: whatever is there stays
    assert np.array_equal(load_file(path)["ec_cache"].view(np.uint16), b.view(np.uint16))
    other = vllm_ec.key_of(b"other")
    unmarked = vllm_ec.write(str(tmp_path), other, a)  # no fingerprint recorded: which tower made it is unknown
    vllm_ec.write(str(tmp_path), other, b, weights="2" * 64)
    assert np.array_equal(load_file(unmarked)["ec_cache"].view(np.uint16), b.view(np.uint16))
    assert "holds an embedding of unrecorded weights" in caplog.text


def test_a_broken_file_naming_this_tower_is_replaced(tmp_path, rng, caplog):
    """A file whose metadata names this tower but which is cut short, or holds another tensor than a bf16
    ec_cache, would be read by vLLM as it is: it is replaced, with a warning, not kept."""
    a = embedding(rng)
    path = vllm_ec.write(str(tmp_path), KEY, a, weights="1" * 64)
    whole = open(path, "rb").read()
    for broken in (lambda: open(path, "wb").write(whole[:-7]),
                   lambda: save_file({"zzz": np.zeros((2, 2), np.float32)}, path, metadata={"glmvit_weights": "1" * 64})):
        broken()
        caplog.clear()
        vllm_ec.write(str(tmp_path), KEY, a, weights="1" * 64)
        assert open(path, "rb").read() == whole and "is not a whole embedding file" in caplog.text, caplog.text
    vllm_ec.write(str(tmp_path), KEY, embedding(rng), weights="1" * 64)  # a whole one is kept
    assert open(path, "rb").read() == whole


def test_writers_of_one_key_at_once_all_succeed(tmp_path, rng):
    """16 threads write each new key at once (the same array, as a server's retried requests can): every
    call returns the path, and each key's folder holds one complete file and no temporary one."""
    emb = embedding(rng, tokens=1024)
    failures = []
    for n in range(8):
        key = vllm_ec.key_of(bytes([n]))
        start = threading.Barrier(16)

        def one():
            start.wait()
            try:
                assert vllm_ec.write(str(tmp_path), key, emb) == str(tmp_path / key / FILE)
            except Exception as e:  # noqa: BLE001  (every failure is reported below)
                failures.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert os.listdir(tmp_path / key) == [FILE]
        assert np.array_equal(load_file(str(tmp_path / key / FILE))["ec_cache"].view(np.uint16), emb.view(np.uint16))
    assert not failures, failures[:3]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_files_and_folders_get_the_umasks_mode(tmp_path, umask):
    """The file is 0666 less the umask, the folders it makes 0777 less it: a vLLM under another user reads
    what the umask lets it (set in a subprocess: the umask is the whole process's)."""
    got = python(tmp_path / "ec", umask, code="""if True:
        import json, os, sys
        import ml_dtypes, numpy as np
        os.umask(int(sys.argv[2]))
        from glmvit_cupy import vllm_ec
        path = vllm_ec.write(sys.argv[1], vllm_ec.key_of(b"x"), np.ones((4, 8), ml_dtypes.bfloat16))
        print(json.dumps([os.stat(p).st_mode & 0o777 for p in (path, os.path.dirname(path), sys.argv[1])]))""")
    assert got == [0o666 & ~umask, 0o777 & ~umask, 0o777 & ~umask], [oct(m) for m in got]


def test_a_full_disk_is_one_output_error_line_and_no_temporary_file(tmp_path, monkeypatch, rng):
    """The disk fills up partway through the file, whichever way its bytes go out (safetensors raises
    SafetensorError, not OSError; os.write raises OSError ENOSPC): an OutputError of one line naming the
    key's folder and the OS's reason; no file is left."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def full_file(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    real_write = os.write

    def full_write(fd, data):  # the header goes out, then the disk is full
        if len(data) > 200:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(safetensors.numpy, "save_file", full_file)
    monkeypatch.setattr(os, "write", full_write)
    with pytest.raises(OutputError) as got:
        vllm_ec.write(str(tmp_path), KEY, embedding(rng))
    monkeypatch.undo()
    message = str(got.value)
    assert "\n" not in message and str(tmp_path / KEY) in message and "No space left on device" in message, message
    assert os.listdir(tmp_path / KEY) == []


def test_a_file_over_the_size_limit_is_one_output_error_line(tmp_path):
    """A real EFBIG (RLIMIT_FSIZE in a subprocess; safetensors reports it as SafetensorError): an OutputError
    of one line naming the file and the reason; no temporary file is left."""
    got = python(tmp_path, code="""if True:
        import json, os, resource, signal, sys
        import ml_dtypes, numpy as np
        from glmvit_cupy import vllm_ec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            vllm_ec.write(sys.argv[1], vllm_ec.key_of(b"big"), np.ones((512, 1024), ml_dtypes.bfloat16))
            print(json.dumps(None))
        except Exception as e:
            from glmvit_cupy.errors import OutputError
            print(json.dumps([type(e).__name__, isinstance(e, OutputError), str(e)]))""")
    key = vllm_ec.key_of(b"big")
    assert got is not None and got[1], got
    assert "\n" not in got[2] and str(tmp_path / key / FILE) in got[2] and "File too large" in got[2], got
    assert os.listdir(tmp_path / key) == []


def test_a_cache_folder_that_is_a_file_is_an_output_error(tmp_path, rng):
    (tmp_path / "ec").write_text("not a folder")
    with pytest.raises(OutputError, match=f"vLLM encoder cache folder {tmp_path / 'ec'}: Not a directory") as got:
        vllm_ec.write(str(tmp_path / "ec"), KEY, embedding(rng))
    assert "\n" not in str(got.value)


@pytest.mark.parametrize("key", ["../x", "ABS", "a/b", "", "..", ".", "a\\b", KEY[:-1] + "\0", KEY.upper(),
                                 KEY[:-1], KEY + "/", "../" + KEY])
def test_keys_that_could_name_another_place_are_refused(tmp_path, rng, key):
    """A key is a lowercase hex sha256; anything else is a ValueError naming it, and nothing is written."""
    key = str(tmp_path / "abs") if key == "ABS" else key
    cache = tmp_path / "ec"
    cache.mkdir()
    with pytest.raises(ValueError, match="key " + re.escape(repr(key))):
        vllm_ec.write(str(cache), key, embedding(rng))
    assert os.listdir(tmp_path) == ["ec"] and os.listdir(cache) == []


def test_a_link_planted_at_the_keys_folder_is_not_followed(tmp_path, rng):
    cache, outside = tmp_path / "ec", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    (cache / KEY).symlink_to(outside)
    with pytest.raises(OutputError, match="is a symbolic link") as got:
        vllm_ec.write(str(cache), KEY, embedding(rng))
    assert str(cache / KEY) in str(got.value) and str(outside) in str(got.value)
    assert os.listdir(outside) == [] and (cache / KEY).is_symlink()


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_link_planted_at_the_keys_file_is_not_followed(tmp_path, rng, target_exists):
    """A link at DIR/<key>/encoder_cache.safetensors is refused: vLLM would read whatever it points to,
    and writing through it would change a file outside the cache."""
    cache, outside = tmp_path / "ec", tmp_path / "outside.safetensors"
    (cache / KEY).mkdir(parents=True)
    if target_exists:
        outside.write_bytes(b"someone else's file")
    (cache / KEY / FILE).symlink_to(outside)
    with pytest.raises(OutputError, match="is a symbolic link") as got:
        vllm_ec.write(str(cache), KEY, embedding(rng))
    assert str(cache / KEY / FILE) in str(got.value)
    assert (outside.read_bytes() == b"someone else's file") if target_exists else not outside.exists()
    assert os.listdir(cache / KEY) == [FILE]


def test_a_cache_folder_that_is_a_link_is_used(tmp_path, rng):
    """DIR itself may be a link the user chose (a cache on another disk): it is followed."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "ec").symlink_to(tmp_path / "disk")
    vllm_ec.write(str(tmp_path / "ec"), KEY, embedding(rng))
    assert os.listdir(tmp_path / "disk" / KEY) == [FILE]


def _writer_paused_before_its_rename(folder, key):
    """A process writing `key` (1024 x 256) that stops once its temporary file is whole (in its fsync) and goes on,
    renaming it into place, when a line comes on its stdin; returned once its temporary file is there."""
    code = """if True:
        import os, sys
        import ml_dtypes, numpy as np
        from glmvit_cupy import vllm_ec
        real = os.fsync
        def paused(fd):
            print("written", flush=True)
            sys.stdin.readline()
            real(fd)
        os.fsync = paused
        vllm_ec.write(sys.argv[1], sys.argv[2], np.ones((1024, 256), ml_dtypes.bfloat16))
        print("done", flush=True)"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder), key], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "written\n", proc.communicate(timeout=60)
    return proc


def _age(path, seconds):
    then = os.stat(path).st_mtime - seconds
    os.utime(path, (then, then))


def test_a_writer_killed_mid_write_leaves_a_temporary_file_the_next_write_removes(tmp_path, rng):
    """kill -9 between a file's bytes and its rename left encoder_cache.safetensors.<pid>.<random>.tmp in the key's
    folder for good: no later write looked at it. The next write of the key now removes it once it is
    STALE_SECONDS old (its writer's lock went with the process); a younger one, and any other file, stays."""
    proc = _writer_paused_before_its_rename(tmp_path, KEY)
    proc.kill()
    proc.wait(30)
    (left,) = os.listdir(tmp_path / KEY)
    assert vllm_ec.TEMPORARY.fullmatch(left) and os.path.getsize(tmp_path / KEY / left) > 1024 * 256 * 2
    (tmp_path / KEY / "notes.tmp").write_text("someone else's")
    vllm_ec.write(str(tmp_path), KEY, embedding(rng))
    assert sorted(os.listdir(tmp_path / KEY)) == sorted([FILE, left, "notes.tmp"])  # young: may be a live one's
    _age(tmp_path / KEY / left, vllm_ec.STALE_SECONDS + 1)
    _age(tmp_path / KEY / "notes.tmp", vllm_ec.STALE_SECONDS + 1)
    vllm_ec.write(str(tmp_path), KEY, embedding(rng))  # the file is there: kept, and the leftover removed
    assert sorted(os.listdir(tmp_path / KEY)) == [FILE, "notes.tmp"]


def test_a_live_writers_temporary_file_is_never_removed_however_old(tmp_path, rng):
    """A writer slow past STALE_SECONDS (a hung network file system) still holds its temporary file locked: another
    process's write of the key leaves it, and the slow writer's rename then succeeds."""
    proc = _writer_paused_before_its_rename(tmp_path, KEY)
    try:
        (temporary,) = os.listdir(tmp_path / KEY)
        _age(tmp_path / KEY / temporary, vllm_ec.STALE_SECONDS + 1)
        vllm_ec.write(str(tmp_path), KEY, embedding(rng))
        assert sorted(os.listdir(tmp_path / KEY)) == sorted([FILE, temporary])
        out, err = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 0 and out == "done\n", err
        assert os.listdir(tmp_path / KEY) == [FILE]
    finally:
        proc.kill()


@pytest.mark.parametrize("code,alone", [(errno.EACCES, True), (errno.EPERM, True), (errno.ENOSPC, False),
                                        (errno.EROFS, False)])
def test_a_keys_folder_this_user_may_not_write_blocks_that_key_alone(tmp_path, monkeypatch, rng, code, alone):
    """The key's folder refusing this user (another user's, or made read-only: EACCES, EPERM) is InTheWay, that key
    alone, naming the folder to fix, so that glmvit-encode and glmvit-serve write the other keys; a full disk or a
    read-only mount stays the whole folder's OutputError."""
    real_open = os.open

    def refused(path, *a, **k):
        if isinstance(path, str) and vllm_ec.TEMPORARY.fullmatch(path):
            raise OSError(code, os.strerror(code))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(OutputError) as got:
        vllm_ec.write(str(tmp_path), KEY, embedding(rng))
    monkeypatch.undo()
    assert isinstance(got.value, vllm_ec.InTheWay) == alone, got.value
    message = str(got.value)
    assert message.startswith(f"cannot write {tmp_path / KEY / FILE}: {os.strerror(code)} ({errno.errorcode[code]})")
    if alone:
        assert message.endswith(f"let this user write {tmp_path / KEY}, or remove that folder (it is made again)")
    assert os.listdir(tmp_path / KEY) == []
    vllm_ec.write(str(tmp_path), KEY, embedding(rng))  # the way clear: written
    assert os.listdir(tmp_path / KEY) == [FILE]


def test_a_key_folder_refused_in_a_cache_folder_refused_too_is_the_whole_folders(tmp_path, monkeypatch, rng):
    """A key's folder refusing this user (EACCES) where the cache folder refuses it too (the whole folder made
    read-only, or another user's) was InTheWay, that key alone: glmvit-serve answered 409 'let this user write
    DIR/<key>, or remove that folder' (which the folder itself forbids) and glmvit-encode failed the file alone.
    It is the whole folder's OutputError, naming the cache folder; where the cache folder is writable, the key
    alone stays blocked."""
    real_open, real_access = os.open, os.access

    def refused(path, *a, **k):
        if isinstance(path, str) and vllm_ec.TEMPORARY.fullmatch(path):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return real_open(path, *a, **k)

    def access(path, mode, **k):
        return False if os.fspath(path) == str(tmp_path) else real_access(path, mode, **k)

    monkeypatch.setattr(os, "open", refused)
    monkeypatch.setattr(os, "access", access)
    with pytest.raises(OutputError) as got:
        vllm_ec.write(str(tmp_path), KEY, embedding(rng))
    assert not isinstance(got.value, vllm_ec.InTheWay), got.value
    assert str(got.value).startswith(f"cannot write {tmp_path / KEY / FILE} (nor may this user write the vLLM "
                                     f"encoder cache folder {tmp_path}): {os.strerror(errno.EACCES)} (EACCES)")
    monkeypatch.setattr(os, "access", real_access)
    with pytest.raises(vllm_ec.InTheWay):
        vllm_ec.write(str(tmp_path), KEY, embedding(rng))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
                    reason="runs a writer as the user nobody (needs root and setpriv)")
def test_a_read_only_cache_folder_is_the_whole_folders_as_another_user_finds_it(rng):
    """As the user nobody: a cache folder made read-only with its keys (chmod -R a-w) refuses the write of a key
    whose folder is there as the whole folder's OutputError, naming the cache folder, as it refuses a new key; a
    key's folder alone made read-only in a writable cache folder is InTheWay."""
    import pwd
    import shutil
    import tempfile

    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user nobody")
    top = tempfile.mkdtemp()  # in the system's temporary folder: a path the user nobody can reach
    ec = os.path.join(top, "ec")
    try:
        os.mkdir(ec)
        vllm_ec.write(ec, KEY, embedding(rng), "old weights")
        for path in (top, ec, os.path.join(ec, KEY), os.path.join(ec, KEY, FILE)):
            os.chown(path, nobody, -1)
        os.chmod(top, 0o755)
        code = (f"import sys; sys.path.insert(0, {SRC!r}); import numpy as np, ml_dtypes\n"
                "from glmvit_cupy import vllm_ec\n"
                f"try:\n    vllm_ec.write({ec!r}, {KEY!r}, np.ones((2, 4), ml_dtypes.bfloat16), 'new weights')\n"
                "except vllm_ec.InTheWay as e:\n    print('key', e)\n"
                "except vllm_ec.OutputError as e:\n    print('folder', e)\n")

        def as_nobody() -> str:
            run = subprocess.run(["/usr/bin/setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                                  sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stderr
            return run.stdout.strip()

        os.chmod(os.path.join(ec, KEY), 0o555)
        os.chmod(ec, 0o555)
        said = as_nobody()
        assert said.startswith(f"folder cannot write {os.path.join(ec, KEY, FILE)} (nor may this user write the vLLM "
                               f"encoder cache folder {ec}): "), said
        os.chmod(ec, 0o755)
        said = as_nobody()
        assert said.startswith(f"key cannot write {os.path.join(ec, KEY, FILE)}: "), said
    finally:
        for path in (ec, os.path.join(ec, KEY)):
            with contextlib.suppress(OSError):
                os.chmod(path, 0o755)
        shutil.rmtree(top, ignore_errors=True)
