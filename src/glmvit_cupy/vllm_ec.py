"""Hand-off to vLLM: embeddings written where vLLM's shared-storage encoder-cache connector reads them.

vLLM's ECExampleConnector (ECSharedStorageConnector in earlier vLLM releases) looks for
`<shared_storage_path>/<mm_hash>/encoder_cache.safetensors` holding one tensor named "ec_cache",
[tokens, hidden]; a file that exists is ready. We key an image by key_for_image (the sha256 hex of its file's
bytes under the reference processor's default token limits, else of that and its limits), a video by
video_key_of (whether it came as frames or a video file, those files, and the settings that shape
its embedding), and write under a
temporary name of our own (locked while it is written), fsync it, then rename it into place, so vLLM never
reads half a file; a temporary file that a writer killed mid-write left is removed by the next write of its key
once it is STALE_SECONDS old and unlocked. The
language-only vLLM is started with --ec-transfer-config '{"ec_connector": "ECExampleConnector", "ec_role":
"ec_consumer", "ec_connector_extra_config": {"shared_storage_path": DIR}}' and each request passes that key
as the image's uuid (docs/SERVING.md, "Handing embeddings to vLLM").

The files are the usual new files: mode 0666 and the key's folder 0777, less the umask (the kernel applies
it, so a vLLM under another user of the same group reads them as the umask allows). Nothing is written
outside DIR: a key is a lowercase hex sha256, and a symbolic link at DIR/<key> or at its file is refused,
never followed (the key's folder is opened without following links and everything in it is done relative
to that open folder). POSIX only (dir_fd operations).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import stat
import struct
import time

import numpy as np

from .checks import DEFAULT_MAX_IMAGE_TOKENS, is_integer, nonfinite
from .errors import OutputError, quoted
from .files import probe_write

log = logging.getLogger("glmvit_cupy")

FILE = "encoder_cache.safetensors"
TENSOR = "ec_cache"
WEIGHTS = "glmvit_weights"  # the file's metadata key for the fingerprint of the tower that made it
KEY = re.compile(r"[0-9a-f]{64}")  # what key_of and video_key_of give: a sha256's lowercase hex
TEMPORARY = re.compile(re.escape(FILE) + r"\.(\d+)\.[0-9a-f]{16}\.tmp")  # _write_file's: FILE.<pid>.<random>.tmp
# A temporary file untouched this long, that no writer holds locked, was left by one that died mid-write (kill -9, a
# crash, a power cut): a live writer's is written to, fsync'd and renamed in seconds, and locked all the while.
STALE_SECONDS = 600

CHUNK = 1 << 30  # bytes per os.write (Linux moves at most ~2 GiB per call)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FIXES = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space under the disk quota",
          errno.EFBIG: "raise the file-size limit (ulimit -f)", errno.EACCES: "let this user write there",
          errno.EPERM: "let this user write there", errno.EROFS: "mount it writable",
          errno.ENOTDIR: "make it a folder"}


def key_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


DEFAULT_LIMITS = (16, DEFAULT_MAX_IMAGE_TOKENS)  # the reference processor's min and max tokens an image, as vLLM's


def key_for_image(sha: str, min_image_tokens: int, max_image_tokens: int) -> str:
    """An image's key from its file's sha256 hex and the token limits it was resized under: the sha256 itself
    under the reference processor's defaults (16, 8000), the embedding vLLM's own processor would make;
    else the sha256 hex of a canonical JSON of the two, since other limits give another embedding.
    ValueError for a sha that is not a lowercase sha256 hex, or a limit that is not an integer of at least 0
    (min_image_tokens: 0 is none) or 1 (max_image_tokens)."""
    check_key(sha, "key_for_image: sha")
    def limit(name, v, least) -> int:
        v = int(v) if isinstance(v, (float, np.floating)) and float(v).is_integer() else v  # 16.0 is 16
        if not (is_integer(v) and v >= least):
            raise ValueError(f"key_for_image: {name}={quoted(v)} is not an integer of at least {least} (a token "
                             "limit, as the image was resized under)")
        return int(v)

    min_image_tokens = limit("min_image_tokens", min_image_tokens, 0)
    max_image_tokens = limit("max_image_tokens", max_image_tokens, 1)
    if (min_image_tokens, max_image_tokens) == DEFAULT_LIMITS:
        return sha
    doc = {"image": sha, "min_image_tokens": min_image_tokens, "max_image_tokens": max_image_tokens}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def video_key_of(files: list[bytes], fps, duration, settings: dict, *, kind: str) -> str:
    """A video's key: the sha256 hex of a canonical JSON of its kind ("frames": `files` are its frames' image
    files; "file": `files` is its one video file), those files' sha256s, its fps and duration and the
    preprocess_video settings (sampling, token limits) that decide which frames count and their size. The
    same bytes as a video file or as a frame give other frames, and other settings another embedding: so
    another key."""
    return video_key_of_shas([key_of(f) for f in files], fps, duration, settings, kind=kind)


def video_key_of_shas(shas: list[str], fps, duration, settings: dict, *, kind: str) -> str:
    """video_key_of from the files' sha256 hex digests (a video file hashed in pieces, not held in memory).
    Whole-number floats count as ints (target_fps 2.0 is 2): one setting, one key, however it was typed."""
    if kind not in ("frames", "file") or (kind == "file" and len(shas) != 1):
        raise ValueError(f"video_key_of: kind={kind!r} with {len(shas)} files; kind is 'frames' (image files) or "
                         "'file' (one video file)")
    for i, sha in enumerate(shas):
        check_key(sha, f"video_key_of: file {i}'s sha256")

    def number(name, v):  # what JSON holds, NumPy's numbers as Python's
        v = v.item() if isinstance(v, np.generic) and v.dtype.kind in "biuf" else v
        if not (v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v))):
            raise ValueError(f"video_key_of: {name}={quoted(v)} is not a number, bool, string or None")
        return int(v) if isinstance(v, float) and v.is_integer() else v

    if not isinstance(settings, dict):
        raise ValueError(f"video_key_of: settings is a {type(settings).__name__}, not a dict of preprocess_video's")
    doc = {"kind": kind, "files": list(shas), "fps": number("fps", fps), "duration": number("duration", duration),
           "settings": {k: number(k, settings[k]) for k in sorted(settings)}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def check_key(key, what: str = "vLLM encoder cache key") -> None:
    """ValueError unless `key` is a lowercase hex sha256 (key_of, video_key_of): it names a folder of DIR,
    so nothing that could name another place ('..', '/', '\\', NUL, '' or an absolute path) gets through."""
    if not (isinstance(key, str) and KEY.fullmatch(key)):
        raise ValueError(f"{what} {quoted(key, 80)} is not a lowercase hex sha256 (64 characters 0-9a-f, "
                         "as vllm_ec.key_of and video_key_of give); a key names one folder inside the cache folder")


def check_embedding(embedding) -> None:
    """ValueError unless `embedding` is what the file holds and vLLM splices: a NumPy bf16 [tokens, hidden]
    array of finite values, tokens and hidden at least 1."""
    if not isinstance(embedding, np.ndarray):
        raise ValueError(f"vllm_ec.write: the embedding is a {type(embedding).__name__}, not a NumPy array "
                         "(cupy.asnumpy a GPU one)")
    if embedding.dtype.name != "bfloat16" or embedding.ndim != 2 or 0 in embedding.shape:
        raise ValueError(f"vllm_ec.write: the embedding is {embedding.dtype} {list(embedding.shape)}, not the bf16 "
                         "[tokens, hidden] (tokens, hidden >= 1) an encoder-cache file holds")
    if nonfinite(embedding):  # by the bf16 exponent bits, no float32 copy
        raise ValueError("vllm_ec.write: the embedding holds NaN or infinite values; a tower's output is finite "
                         "(encode it again; check the weights with glmvit-encode --inspect)")


def write(folder: str, key: str, embedding: np.ndarray, weights: str | None = None) -> str:
    """DIR/<key>/encoder_cache.safetensors with the bf16 [tokens, hidden] embedding; returns its path.
    `weights`: the tower's fingerprint (TowerBinding.fingerprint), kept in the file's metadata. An existing
    file for the key is left as it is (the same key and tower give the same embedding) when it names the
    same weights, or when no `weights` is given; a file that names other weights or none (another tower's,
    a checkpoint replaced under the same folder, or written without a fingerprint) is replaced. Writers of one key at once all succeed, leaving one complete file. ValueError for a key that is not a sha256 hex;
    OutputError, one line naming the path, for anything the disk
    refuses (OSError of any kind) or a link in the way, with no temporary file left behind."""
    from safetensors.numpy import save

    check_key(key)
    check_embedding(embedding)
    target = os.path.join(folder, key, FILE)
    # safetensors makes the bytes (its own serializer, in memory: an embedding is a few MB); we write them,
    # so that what the disk refuses is an OSError of ours, not a SafetensorError from its writer.
    data = save({TENSOR: np.ascontiguousarray(embedding)}, metadata={WEIGHTS: weights} if weights else None)
    top = _open_cache(folder)
    try:
        here = _open_key_folder(top, folder, key)
    finally:
        os.close(top)
    try:
        _clear_stale(here, os.path.join(folder, key))
        if not _finished(here, target, weights):
            _write_file(here, target, data)
    finally:
        os.close(here)
    return target


def _clear_stale(here: int, where: str) -> None:
    """Remove the temporary files in the key's folder (open as `here`) that writers killed mid-write left: named as
    _write_file names them, by another process, a plain file untouched for STALE_SECONDS and not locked (a live
    writer holds its own locked from its creation to its rename; where the file system has no locks, the age alone
    tells). Nothing else is touched, and nothing that fails here stops the write."""
    import fcntl  # here, as in _locked: the keys (key_of, key_for_image) are any platform's

    try:
        names = os.listdir(here)
    except OSError:
        return
    now = time.time()
    for name in names:
        m = TEMPORARY.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():  # this process's own may be in a thread's hands
            continue
        try:
            st = os.stat(name, dir_fd=here, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_SECONDS:
                continue
            # Read-write: an NFS client takes flock as a POSIX write lock, which a read-only descriptor cannot.
            fd = os.open(name, os.O_RDWR | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0),
                         dir_fd=here)
        except OSError:  # gone meanwhile, or another user's we cannot open: left alone
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live writer's (its file system slow): left alone
                continue
            except OSError:  # no locks on this file system
                pass
            if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) == (st.st_ino, st.st_dev):
                os.unlink(name, dir_fd=here)
                log.info("%s: removed %s, the temporary file of a writer that stopped mid-write", where, name)
        except OSError:
            pass
        finally:
            os.close(fd)


def holds(folder: str, key: str, weights: str | None = None) -> bool:
    """Whether DIR/<key> holds a whole file of these weights already (what write would keep); nothing is made.
    A link or anything but a plain file there is an OutputError, as for write."""
    check_key(key)
    try:
        here = os.open(os.path.join(folder, key), _DIR | _NOFOLLOW)
    except OSError:
        return False  # no such folder yet (or not one: write says what is wrong with it)
    try:
        return _finished(here, os.path.join(folder, key, FILE), weights, quiet=True)
    finally:
        os.close(here)


def _failed(what: str, e: BaseException) -> OutputError:
    """`what` failed because of `e`, as one line: the OS's reason, then what would fix it."""
    code = getattr(e, "errno", None)
    reason = (getattr(e, "strerror", None) or str(e) or type(e).__name__)
    if code in errno.errorcode:
        reason += f" ({errno.errorcode[code]})"
    fix = _FIXES.get(code, "make it writable")
    return OutputError(" ".join(f"{what}: {reason}; {fix}, or give --vllm-ec-dir another folder".splitlines()))


class InTheWay(OutputError):
    """Something not the cache's own at one key (a file or a link where its folder goes, a FIFO or a folder where its
    file goes), or a key's folder this user may not write (another user's, or made read-only): that key alone
    cannot be written; the others can."""


def _key_failed(what: str, where: str, e: OSError) -> OutputError:
    """_failed, but InTheWay where the OS refuses this user the key's own folder `where` (EACCES, EPERM), which the
    cache folder's other keys do not share; anything else (a full disk, a read-only mount), or a cache folder this
    user may not write either (made read-only with all its keys, say), is the whole folder's."""
    if getattr(e, "errno", None) not in (errno.EACCES, errno.EPERM):
        return _failed(what, e)
    cache = os.path.dirname(where)
    if not _writable(cache):  # no key could be made there either: not this key's alone
        return _failed(f"{what} (nor may this user write the vLLM encoder cache folder {cache})", e)
    reason = f"{e.strerror or e} ({errno.errorcode[e.errno]})"
    return InTheWay(" ".join(f"{what}: {reason}; let this user write {where}, or remove that folder (it is made "
                             "again)".splitlines()))


def _writable(folder: str) -> bool:
    """Whether this user (its effective ids, where the OS tells them apart) may make files in `folder`."""
    try:
        if os.access in os.supports_effective_ids:
            return os.access(folder, os.W_OK | os.X_OK, effective_ids=True)
        return os.access(folder, os.W_OK | os.X_OK)
    except OSError:
        return False


def _link_error(path: str, dir_fd: int, name: str) -> InTheWay:
    try:
        to = f" (to {os.readlink(name, dir_fd=dir_fd)})"
    except OSError:
        to = ""
    return InTheWay(" ".join(f"{path} is a symbolic link{to}; the vLLM encoder cache does not follow links "
                                "out of its folder: remove it and the embedding is written there again".splitlines()))


def _open_cache(folder: str) -> int:
    """DIR opened as a folder (created if absent; DIR itself may be a link the user chose)."""
    try:
        try:
            return os.open(folder, _DIR)
        except FileNotFoundError:
            os.makedirs(folder, exist_ok=True)
            return os.open(folder, _DIR)
    except OSError as e:
        raise _failed(f"cannot use the vLLM encoder cache folder {folder}", e) from e


def check_folder(folder: str) -> None:
    """OutputError, one line saying why and what would fix it, unless `folder` is a folder this process can write
    into, or can be made as one (its nearest existing parent a writable folder; nothing is left there): checked
    when a command starts, so that a wrong --vllm-ec-dir fails the start, not every request or batch after it."""
    what = f"cannot use the vLLM encoder cache folder {folder}"
    if not isinstance(folder, (str, os.PathLike)) or not os.fspath(folder):
        raise OutputError(f"the vLLM encoder cache folder is {quoted(folder)}; give a folder's path (it is made if "
                          "absent)")
    here = os.path.abspath(folder)
    while True:
        try:
            st = os.stat(here)
        except FileNotFoundError:
            if os.path.islink(here):
                raise _failed(what, OSError(errno.ENOENT, f"{here} is a broken symbolic link")) from None
            parent = os.path.dirname(here)
            if parent == here:
                raise _failed(what, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))) from None
            here = parent
            continue
        except OSError as e:  # a symbolic link loop, a path through a file
            raise _failed(what, e) from e
        break
    if not stat.S_ISDIR(st.st_mode):
        raise _failed(what, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    try:
        probe_write(here)
    except OSError as e:
        raise _failed(f"{what}: no file can be made in {here}", e) from e


def _open_key_folder(top: int, folder: str, key: str) -> int:
    """DIR/<key> opened as a folder, made if absent (mode 0777 less the umask); a link there is refused."""
    where = os.path.join(folder, key)
    try:
        os.mkdir(key, 0o777, dir_fd=top)
    except FileExistsError:
        pass
    except OSError as e:
        raise _failed(f"cannot make {where}", e) from e
    try:
        return os.open(key, _DIR | _NOFOLLOW, dir_fd=top)
    except OSError as e:
        try:
            mode = os.stat(key, dir_fd=top, follow_symlinks=False).st_mode
        except OSError:
            mode = None
        if mode is not None and stat.S_ISLNK(mode):
            raise _link_error(where, top, key) from None
        if mode is not None and not stat.S_ISDIR(mode):
            raise InTheWay(f"{where} is not a folder; remove it and the embedding is written there "
                           "again") from None
        raise _key_failed(f"cannot open {where}", where, e) from e


def _finished(here: int, target: str, weights: str | None = None, quiet: bool = False) -> bool:
    """Whether the key's file is there already, of these weights (given `weights`, a file whose metadata names
    other weights or none is not); a link or anything but a plain file there is refused."""
    try:
        st = os.stat(FILE, dir_fd=here, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _key_failed(f"cannot look at {target}", os.path.dirname(target), e) from e
    if stat.S_ISREG(st.st_mode):
        made_by, whole = _weights_of(here, st.st_size) if weights else (weights, True)
        if made_by != weights:
            why = ("holds an embedding of " + (f"other weights (fingerprint {made_by[:12]}...)" if made_by else
                   "unrecorded weights") + f" (this tower's fingerprint: {weights[:12]}...)")
        elif not whole:
            why = (f"names this tower but is not a whole embedding file (cut short, or no bf16 {TENSOR!r} tensor "
                   "of its size)")
        else:
            return True
        if not quiet:
            log.warning("%s %s: replaced", target, why)
        return False
    if stat.S_ISLNK(st.st_mode):
        raise _link_error(target, here, FILE)
    raise InTheWay(f"{target} is not a plain file; remove it and the embedding is written there again")


def _weights_of(here: int, size: int) -> tuple[str | None, bool]:
    """(the fingerprint in the key's file's metadata (write's `weights`), or None: none recorded, or a header
    that does not read (written by another program, or damaged); whether the file is whole: one bf16 2-D
    TENSOR whose bytes end the file, as write makes it)."""
    try:
        fd = os.open(FILE, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=here)
    except OSError:
        return None, False
    try:
        n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
        if n > 1 << 20:
            return None, False
        header = json.loads(os.pread(fd, n, 8))
        made_by = header.get("__metadata__", {}).get(WEIGHTS)
        t = header.get(TENSOR)
        whole = (isinstance(t, dict) and t.get("dtype") == "BF16" and isinstance(t.get("shape"), list)
                 and len(t["shape"]) == 2 and all(isinstance(d, int) for d in t["shape"])
                 and t.get("data_offsets") == [0, 2 * t["shape"][0] * t["shape"][1]]
                 and size == 8 + n + t["data_offsets"][1])
        return (made_by if isinstance(made_by, str) else None), whole
    except (OSError, ValueError, struct.error, AttributeError, TypeError):
        return None, False
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:CHUNK]):]


def _write_file(here: int, target: str, data: bytes) -> None:
    """The file written under a name no other writer uses, fsync'd, then renamed onto FILE (a writer of the
    same key that renames first leaves the same bytes). On any failure the temporary file is removed."""
    name = f"{FILE}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags, 0o666, dir_fd=here)  # the kernel takes the umask off 0666
    except OSError as e:
        raise _key_failed(f"cannot write {target}", os.path.dirname(target), e) from e
    held = _locked(fd)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        os.close(fd)  # a network file system may report a failed write only here
        os.replace(name, FILE, src_dir_fd=here, dst_dir_fd=here)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=here)
        if isinstance(e, OSError):
            raise _key_failed(f"cannot write {target}", os.path.dirname(target), e) from e
        raise
    finally:
        if held is not None:
            os.close(held)


def _locked(fd: int) -> int | None:
    """A second descriptor of the temporary file open as `fd`, holding a lock on it (flock) until it is closed, past
    fd's close and the rename: _clear_stale never takes a live writer's file. None where it cannot be had."""
    import fcntl

    try:
        held = os.dup(fd)
    except OSError:
        return None
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: the file's age alone tells a stale one
        pass
    return held
