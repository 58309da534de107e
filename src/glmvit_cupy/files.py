"""Files opened for reading — a checkpoint's shards and JSON files, images named by path — as regular files
only. A FIFO, device, folder or socket named like one is refused by what it is, and never read: a plain
open() of a FIFO would wait forever for a writer, and a device such as /dev/zero reads without end."""

from __future__ import annotations

import functools
import json
import os
import secrets
import stat

from .errors import CheckpointError, quoted

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def identity(st: os.stat_result) -> tuple:
    """What tells a file changed since it was read: another file under its name, or the same one modified."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def not_regular(path) -> str | None:
    """What `path` is when it exists but is not a regular file (after symbolic links), or is a broken or
    looping symbolic link; None for a regular file or nothing there at all."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else None
    except OSError as e:  # a symbolic link loop, a path through a file
        return f"unreadable ({e.strerror})"
    except UnicodeEncodeError:  # a lone surrogate (a JSON escape such as \ud800): no file name encodes it
        return "not a valid path (it holds a character no file name can encode)"
    except ValueError:  # a NUL byte: no file can have such a name
        return "not a valid path (it holds a NUL byte)"
    return None if stat.S_ISREG(mode) else kind(mode)


def open_regular(path, what: str, error=CheckpointError):
    """open(path, "rb") of a regular file; anything else is `error` naming what it is. Opened without blocking
    (a FIFO would wait for a writer), checked, then read as usual."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: {what} is {kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_lock_file(path, error, mode: str = "r+b"):
    """`path` opened for reading and writing, created if absent: never through a symbolic link (O_CREAT would
    make, and then lock, a file wherever it points) and without waiting on a FIFO for a writer; error(what is
    there) where that is not a regular file, os.open's OSError where it cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise error(kind(st_mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def repeated_key(pairs: list):
    """The first key a JSON object's (key, value) pairs give twice, or None: json.loads keeps the last of a
    repeated key without a word (an object_pairs_hook sees them all)."""
    if len({k for k, _ in pairs}) == len(pairs):
        return None
    seen = set()
    return next(k for k, _ in pairs if k in seen or seen.add(k))


def _one_of_each(path, what, pairs):
    """A JSON object's pairs as a dict, refusing a key given twice (looked for where the dict is shorter)."""
    obj = dict(pairs)
    twice = repeated_key(pairs) if len(obj) < len(pairs) else None
    if twice is not None:
        raise CheckpointError(f"{path}: {what} gives {quoted(twice, 80)} twice in one object; which one is meant is "
                              "not clear: keep one")
    return obj


# The JSON values a checkpoint's JSON file may hold: an index holds one per tensor (a whole GLM-5.3 checkpoint's
# some tens of thousands, 64 MiB of names at most), a config.json some hundreds. Python's parser makes an object of
# each, and of a million parses in about a second; 64 MiB of empty lists or objects took 10-15 s and 2-3 GB.
MAX_JSON_VALUES = 1_000_000


def json_values(raw: bytes) -> int:
    """A bound on the values and object members JSON text holds, counted without parsing it: each but the first
    of an array or object follows a comma, each first an opening bracket. Those inside strings count too: the
    bound is never short of what json.loads would make."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def read_json_file(path, what: str, limit: int = 64 << 20, missing: str | None = None):
    """A checkpoint's JSON file (config.json, the index) parsed; missing, unreadable, not a regular file, not
    JSON, or of more than MAX_JSON_VALUES values (counted before parsing): CheckpointError."""
    try:
        with open_regular(path, what) as f:
            text = f.read(limit + 1)
        if len(text) > limit:
            raise CheckpointError(f"{path}: {what} is over {limit >> 20} MiB, more than a checkpoint's JSON file "
                                  "holds; is it the right file?")
        values = json_values(text)
        if values > MAX_JSON_VALUES:
            raise CheckpointError(f"{path}: {what} holds up to {values:,} JSON values (its commas and opening brackets, "
                                  f"counted before parsing), more than the {MAX_JSON_VALUES:,} a checkpoint's JSON file "
                                  "holds (an index lists one per tensor, a config.json some hundreds); is it the right "
                                  "file?")
        return json.loads(text, object_pairs_hook=functools.partial(_one_of_each, path, what))
    except CheckpointError:  # a ValueError too: said as it is, not as "not valid JSON"
        raise
    except FileNotFoundError:
        broken = not_regular(path)  # a broken symbolic link
        raise CheckpointError(f"{path}: {what} is {broken}" if broken else missing or f"{path}: {what} is missing") \
            from None
    except OSError as e:  # no permission, an I/O error, a symbolic link loop
        raise CheckpointError(f"{path}: {what} cannot be read ({e}); it must be a readable JSON file") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # nested too deep; an int past str()'s digits
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None


def probe_write(folder) -> None:
    """OSError (the system's own: EROFS, EACCES, ENOENT, ...) unless a file can be made in `folder`: one is made
    and removed at once, which says what permission bits cannot (a read-only mount, a pseudo file system
    such as /proc, writes refused even to root)."""
    probe = os.path.join(folder, f".glmvit-probe-{secrets.token_hex(8)}")
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
    try:
        os.unlink(probe)
    except OSError:
        pass
