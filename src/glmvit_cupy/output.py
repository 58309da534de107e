"""The output folder of glmvit-encode, written and read back.

    embeddings-NNNNN.safetensors   one bf16 tensor [tokens, out_hidden] per image, named by its key; its
                                   metadata "glmvit" holds the manifest's header and its images' entries
    manifest.json                  {"header": settings, "images": {key: entry}, "failed": {key: why}}

The header also holds "folder_id", the folder's identity: 32 random hex digits drawn when the folder is made (or
first resumed by a version that records one), kept for its life and never a setting. A shard the manifest does not
list is taken only where it records this folder's id, or none (an earlier version's shard): another folder's shard
copied in under a new number is passed over, named in a warning, by a resume and by read_embeddings. With no
manifest, the folder's id is the one its shards record; shards recording several are refused (OutputError), as
nothing tells which folder's they are.

"images" holds videos too: a video's entry has "kind": "video" (and its grid_thw [t, h, w], frames_indices,
timestamps, fps); an image's has no "kind".

An image's key is its file's resolved absolute path (os.path.realpath), so the same file reached
through another relative path, a "." or a symlink is the same image. A path that is not valid UTF-8 (a
name the OS allows but safetensors cannot store) is keyed by the repr() of its bytes, b'/photos/caf\\xe9.jpg':
no resolved path starts with b' or b", so the two kinds never meet; key_path(key) gives the path back, and
such an entry also holds "path_bytes", the path's bytes in hex. Every shard is written to a
temporary name and renamed, so a shard is whole or absent. The manifest is rewritten (atomically) at
most every few seconds and when the run ends: rewriting it after every batch cost a millions-of-images
run time quadratic in its length. A run stopped before its manifest caught up loses nothing: its
shards name their own images, and resuming (or read_embeddings) takes them from there. A re-run with
the same settings skips what is done. A shard the manifest lists counts only where its own metadata records
what the manifest does: another folder's shard copied in under its name is named, never taken for this
folder's. Files get the usual mode for new files (0666 less the umask).

A write that fails (a full disk, lost permissions) raises OutputError naming the file and the reason;
the shards written before it stay.

Each entry records its file's size and modification time ("file"): a resume encodes a file whose stamp
differs again, into a later shard, and the older shard keeps its old embedding; a key's entry names the
shard of its current one (the latest, where a stopped run left shards the manifest does not list).

Reading the output: `read_embeddings(folder)` (NumPy bf16 arrays, as ml_dtypes.bfloat16), or, from the shard
each entry names, `safetensors.numpy.load_file(shard)` after `import ml_dtypes` (which teaches NumPy bf16),
or `safetensors.torch.load_file(shard)` for torch.bfloat16 tensors.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
import time

import numpy as np

from .checks import is_integer
from .errors import OutputError, quoted
from .files import kind, not_regular, open_lock_file, open_regular

log = logging.getLogger("glmvit_cupy")

MANIFEST = "manifest.json"
KEY = ("the image file's resolved absolute path (os.path.realpath); a path that is not valid UTF-8: the repr() of "
       "its bytes, b'...' (glmvit_cupy.output.key_path gives the path back)")
SHARD = re.compile(r"embeddings-(\d{5,9})\.safetensors$")  # five digits, more from shard 100,000 on
LAST_SHARD = 999_999_999  # nine digits at most: a stray file of a longer number is not a shard
FLUSH_SECONDS = 5.0  # the manifest is rewritten at most this often while a run goes on
# Settings a folder's header may lack (a folder written by an earlier version): "video" (it encoded no videos, so it
# resumes under this run's settings) and "weights" (its tower is then told by the checkpoint's path alone).
ADDED = ("video", "weights")
# Limits an earlier version recorded that shape no embedding (they only accept or refuse a file): ignored.
LIMITS = ("max_pixels", "max_video_pixels")
# The header's folder identity (not a setting: never compared with a run's); one of FOLDER_ID_FORM, or absent
# (a folder or shard of an earlier version).
FOLDER_ID = "folder_id"
FOLDER_ID_FORM = re.compile(r"[0-9a-f]{32}")


def _folder_id(header) -> str | None:
    """The folder id a header (a manifest's or a shard's) records, or None where it records none or another value."""
    value = header.get(FOLDER_ID) if isinstance(header, dict) else None
    return value if isinstance(value, str) and FOLDER_ID_FORM.fullmatch(value) else None


def image_key(path) -> str:
    """The file's resolved absolute path, as path_text gives it."""
    return path_text(os.path.realpath(os.fsdecode(path)))  # a str, for a bytes path too


def path_text(path: str) -> str:
    """A path as a manifest stores it: itself; for one that is not valid UTF-8 (os.fsdecode's surrogateescape
    characters: bytes a file name may hold but safetensors and JSON text cannot), the repr() of its bytes."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return repr(os.fsencode(path))
    return path


def key_path(key: str) -> str:
    """The path of the file a key names, as os functions take it (the inverse of image_key for a resolved path).
    ValueError for anything image_key does not give: a key is an absolute path, or b'...', the repr() of an
    absolute path's bytes."""
    path = key
    if isinstance(key, str) and key.startswith(("b'", 'b"')) and len(key) < 1 << 16:  # no path is longer
        try:
            raw = ast.literal_eval(key)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raw = None
        path = os.fsdecode(raw) if isinstance(raw, bytes) and repr(raw) == key else None
    if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:  # no path holds a NUL
        raise ValueError(f"{quoted(key)} is not a key glmvit-encode writes: a resolved absolute path, or b'...', the "
                         "repr() of one's bytes")
    return path


def file_stamp(st: os.stat_result) -> list[int]:
    """A file's size and modification time (ns), as each entry records them ("file"): a resume encodes a file
    again when they differ, as make and rsync tell a changed file."""
    return [st.st_size, st.st_mtime_ns]


def stamp_of(path) -> list[int] | None:
    try:
        return file_stamp(os.stat(path))
    except OSError:
        return None


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: what a terminal acts on


def shown(text) -> str:
    """`text` as it can be printed and stored as UTF-8, on one line: the undecodable bytes of a file name
    (os.fsdecode's surrogates) and every control character (a newline or an escape sequence in a file
    name would forge a line of output or drive the terminal) written as \\xNN."""
    text = str(text)
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # surrogates that stand for no byte
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _reason(e: BaseException) -> str:
    """The OS's or safetensors' reason for a failed write, in one line."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return shown(" ".join(text.split()) or type(e).__name__)


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _still(key: str, entry: dict, unknown: bool = True) -> bool:
    """Whether an entry found in a shard is of the file as it is now: its stamp equals the file's. An entry
    without one, or a file that cannot be reached, gives `unknown` (taken as it is, by default)."""
    try:
        now = stamp_of(key_path(key))
    except ValueError:
        return unknown
    if now is None or "file" not in entry:
        return unknown
    return entry["file"] == now


def _current(images: dict, failed) -> dict:
    """Of an unlisted shard's entries, those a resume and read_embeddings take: each of the file as it is now (its
    stamp the file's, or taken as it is where the file cannot be reached), and a key the manifest records as
    failed only where the stamp is the file's now: a file that failed and is gone since (deleted, its mount away)
    has no stamp, and its older shard would bring back its old embedding."""
    return {k: e for k, e in images.items() if _still(k, e, unknown=k not in failed)}


def _newer(entries: dict, found: dict) -> list:
    """found's entries (keys of one shard) put into `entries` where that shard is later than the one the key's
    entry names (a file encoded again is in a later shard, and an older shard still holds its old
    embedding); the keys put in."""
    put = []
    for key, entry in found.items():
        old = entries.get(key)
        if old is None or _shard_number(str(old.get("shard", ""))) < _shard_number(entry["shard"]):
            entries[key] = entry
            put.append(key)
    return put


# Why a key whose manifest entry a resume drops is failed: its embedding is not in this folder any more.
LOST = ("the shard its entry names no longer holds its embedding as the entry describes it (lost or damaged); a run "
        "given the file encodes it again")
# ... and why where the shard under its name is not the one the manifest lists (its own metadata records the key
# otherwise).
FOREIGN = ("not the shard the manifest lists under that name (copied in from another folder?), so not this file's "
           "embedding; a run given the file encodes it again")
STAGING = ".glmvit-encode.tmp"  # the folder in --out where a shard is written before it takes its name


def is_output_file(name: str) -> bool:
    """Whether a file name is one this module writes in an output folder (a shard, the manifest, the lock, or
    either's temporary): never an input of the run that writes it."""
    name = name.removesuffix(".tmp")
    return name in (MANIFEST, LOCK) or SHARD.match(name) is not None


def _shard_number(name: str) -> int:
    """The number of a shard (or of its temporary file, which a stopped run may leave); -1 for other files."""
    m = SHARD.match(name.removesuffix(".tmp"))
    return int(m.group(1)) if m else -1


def shard_entries(folder: str, skip=()) -> dict[str, tuple[dict, dict]]:
    """{shard name: (its run's header, {key: entry})} for the shards in `folder` (except those in `skip`)
    that name their images in their metadata. A shard that cannot be read is left out (its images are
    not done); one that cannot be opened for a reason that may pass is an OutputError (_shard_tensors)."""
    out = {}
    for name in sorted(_listed(folder), key=_shard_number):
        path = os.path.join(folder, name)
        if not SHARD.match(name) or name in skip:
            continue
        read = _shard_tensors(path)  # None for a FIFO named like one (never opened), a folder, or one gone since
        try:
            if read is None or read[1] is None:
                if not os.path.isfile(path):
                    continue
                raise ValueError("safetensors refused it, or it has no glmvit metadata")  # or an older run's shard
            tensors, (header, images) = read[0], (read[1]["header"], read[1]["images"])
            entries = {k: dict(v, shard=name) for k, v in images.items() if k in tensors}  # TypeError: not ours
            entries = {k: e for k, e in entries.items()  # only what the shard holds as its entry describes it
                       if _embedding_problem(k, e, tensors[k], _expect(header)) is None}
        except Exception as e:  # no metadata (an older run's shard, listed in its manifest), unreadable, or not ours
            log.warning("%s: cannot be read whole (truncated or damaged: %s), or its metadata does not name its "
                        "images; none of them is taken from it (a resume encodes them again)", path,
                        " ".join(str(e).split())[:160] or type(e).__name__)
            continue
        out[name] = (header, entries)
    return out


def _unopened(path: str, e: OSError) -> OutputError:
    """The error for a shard that cannot be opened for a reason that may pass (no permission, an I/O error)."""
    return OutputError(f"cannot open {shown(path)}: {_reason(e)}; glmvit-encode reads every shard to know which "
                       "images are done and drops none it cannot open for a reason that may pass: make it readable "
                       "(chmod u+r, or check the mount), or move it away so that its images are encoded again")


def _listed(folder: str) -> list[str]:
    """The names in `folder`, or OutputError saying why it cannot be listed (no read permission, an I/O error):
    which shards it holds decides what is done."""
    try:
        return os.listdir(folder)
    except OSError as e:
        raise OutputError(f"cannot list the output folder {shown(folder)}: {_reason(e)}; glmvit-encode reads which "
                          "shards it holds to know what is done: make it readable (chmod u+r), or give another "
                          "--out") from None


def _counted_shards(names: list) -> str:
    shown_names = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{shown_names} ({len(names)} shard{'s' if len(names) != 1 else ''})"


def _shards_id(folder: str, found: dict) -> str | None:
    """The folder id of a folder with no manifest, as its shards (`found`: shard_entries) record it: the one id they
    record, or None where none records one (an earlier version's shards). OutputError where they record several,
    naming the shards of each: with no manifest, nothing tells which of them are this folder's."""
    ids: dict = {}
    for name, (header, _) in found.items():
        if (recorded := _folder_id(header)) is not None:
            ids.setdefault(recorded, []).append(name)
    if len(ids) > 1:
        each = "; ".join(f"folder_id {i}: {_counted_shards(names)}" for i, names in ids.items())
        raise OutputError(f"{shown(folder)} has no {MANIFEST}, and its shards were written into {len(ids)} output "
                          f"folders ({each}): with no manifest to say which is this folder's, none is taken for "
                          f"another's. Move the shards copied in from another folder out of it (or put back this "
                          f"folder's {MANIFEST}), then run again")
    return next(iter(ids), None)


def _this_folders(folder: str, found: dict, own: str | None, where: str, quiet=()) -> dict:
    """`found` (shard_entries: shards the manifest does not list) less those written into another output folder:
    a shard recording a folder id other than `own` (this folder's; None: it has none, `where` says why). Such a
    shard's embeddings are another folder's, however alike its settings: it is passed over, named in a warning
    (except those in `quiet`, already named). A shard recording no id (an earlier version's) is kept."""
    kept = {}
    for name, (header, images) in found.items():
        if FOLDER_ID not in header or (own is not None and _folder_id(header) == own):
            kept[name] = (header, images)
        elif name not in quiet:
            theirs = _folder_id(header) or quoted(header[FOLDER_ID])
            log.warning("%s: written into another output folder (its folder_id is %s; this folder's %s) and not "
                        "listed in %s (copied in from another folder?): passed over, its %d image%s not taken for "
                        "this folder's; move it out of the folder (a run given their files encodes those this "
                        "folder lacks)", shown(os.path.join(folder, name)), theirs,
                        f"is {own}, {where}" if own is not None else where, MANIFEST, len(images),
                        "s" if len(images) != 1 else "")
    return kept


LOCK = ".glmvit-encode.lock"  # held by the process writing a folder: two runs into one --out would overwrite shards


def _lock_folder(folder: str, made: bool = False):
    """The open lock file of `folder`, locked for this process (a POSIX record lock: the kernel drops it when the
    process ends, however it ends), or OutputError when another process holds it. made: the lock file is this
    run's to make (none was there), removed again where the file system has no locks."""
    import fcntl

    path = os.path.join(folder, LOCK)
    try:
        f = open_lock_file(path, lambda what: OutputError(f"{shown(path)} is {what}, not the lock file glmvit-encode "
                                                          "makes: remove it, or give another --out"))
    except IsADirectoryError:
        raise OutputError(f"{shown(path)} is a folder, not the lock file glmvit-encode makes: remove it, or give "
                          "another --out") from None
    except OSError as e:
        if os.path.islink(path):  # O_CREAT through it would make (and lock) a file wherever it points
            raise OutputError(f"{shown(path)} is a symbolic link (to {shown(os.readlink(path))}), not the lock file "
                              "glmvit-encode makes: remove it, or give another --out") from None
        if isinstance(e, PermissionError) and os.path.isfile(path):  # there, not writable (copied read-only)
            raise OutputError(f"{shown(path)} cannot be opened for writing ({_reason(e)}); glmvit-encode locks that "
                              "file while it writes the folder: make it writable (chmod u+w) or remove it") from None
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # a folder this process cannot write in
            raise OutputError(f"cannot create {shown(path)}: {_reason(e)}; glmvit-encode locks the folder it writes, "
                              "so --out must be a folder it can write in (read_embeddings reads a read-only one)") \
                from None
        raise OutputError(f"cannot create {shown(path)}: {_reason(e)}") from None
    try:
        # A POSIX record lock: the process drops it when it closes any descriptor of this file, so the command never
        # opens it as an input (Output.is_lock).
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):  # ENOLCK, ENOSYS: no locks there at all
            if made:  # no run can hold a lock there: nothing of this one's is left behind
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise OutputError(f"cannot lock {shown(path)}: {_reason(e)}; glmvit-encode locks the folder it writes, so "
                              "that no two runs write it at once: give an --out on a file system with locks (a local "
                              "disk, or NFS with its lock service running)") from None
        raise OutputError(f"{shown(folder)}: another process is writing to this output folder (it holds {LOCK}); "
                          "wait for that run to end, or give another --out") from None
    return f


class Output:
    """The output folder: shards written atomically, each naming its images; the manifest rewritten
    atomically at most every `flush_seconds` and on flush().

    `settings` (checkpoint, geometry, the per-image limits) must equal those a resumed folder was
    written with: one folder never mixes resolutions or checkpoints."""

    def __init__(self, folder: str, settings: dict, flush_seconds: float = FLUSH_SECONDS):
        self.folder = folder
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise OutputError(f"--out {folder} is a file, not a folder; give a folder (it is created if absent)")
        path = os.path.join(folder, MANIFEST)
        self.manifest = {"header": dict(settings, key=KEY), "images": {}, "failed": {}}
        self.flush_seconds = flush_seconds
        self._written, self._dirty = time.monotonic(), False
        self._named = 0  # the last shard number the manifest on disk names (_resume)
        self._listed_id: str | None = None  # the folder id the manifest on disk records (_resume)
        self._on_disk: set | None = None  # the shards the manifest on disk lists; None: there is none (_resume)
        self._record_id = False  # the manifest on disk records no id: written with this folder's before any shard
        self.mode = _umask_mode()
        # An existing folder is locked before its manifest is read: a run writing it may end meanwhile, rewriting
        # the manifest (a file it failed, an entry it dropped) after this one has read it.
        made = not os.path.lexists(os.path.join(folder, LOCK))  # a refused run leaves no lock file it made
        new = not os.path.lexists(folder)  # nor a folder it made
        self._lock = _lock_folder(folder, made) if os.path.isdir(folder) else None
        try:
            if os.path.exists(path):
                self._resume(path, settings)
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                if os.path.islink(folder) and not os.path.exists(folder):  # a broken link, or a loop of links
                    raise OutputError(f"cannot create the output folder {shown(folder)}: it is a symbolic link to "
                                      f"{shown(os.readlink(folder))}, which leads nowhere; remove the link or make "
                                      "what it points to") from None
                raise OutputError(f"cannot create the output folder {shown(folder)}: {_reason(e)}") from None
            self._lock = self._lock or _lock_folder(folder, made)
            self._recover(settings)
            self._check_temporaries()
            if self._record_id:  # before any shard records the id: an unlisted shard of it is then this folder's
                self.flush()
        except BaseException:
            if self._lock is not None:
                if made:  # while still locked: a run that locks it after the close must not lose it to this unlink
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, LOCK))
                self._lock.close()
            if new:  # emptied of its lock file above: only an empty folder goes
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            raise
        # Past every shard here (a leftover .tmp's number too) and every one the manifest on disk names: a shard
        # lost since keeps its name until the manifest no longer lists it, else a run stopped before its manifest
        # caught up would leave another shard under a name the manifest lists for other entries.
        self.next_shard = max([0, self._named, *map(_shard_number, _listed(folder))]) + 1
        self._clear_temporaries()
        if self.next_shard > LAST_SHARD:
            raise OutputError(f"{shown(folder)} holds shard {LAST_SHARD:,}, the last number a shard may have; "
                              "give another --out")

    def is_lock(self, path) -> bool:
        """Whether `path` leads to this folder's lock file (by device and inode: through a link, a hard link, any
        name). Never to be opened as an input: closing any descriptor of it drops this process's POSIX lock, and a
        second run could then write the folder alongside this one."""
        if self._lock is None:
            return False
        try:
            st, held = os.stat(path), os.fstat(self._lock.fileno())
        except (OSError, ValueError):
            return False
        return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)

    def _check_temporaries(self) -> None:
        """OutputError unless the names this run writes under before renaming are free for it: STAGING absent or a
        folder, the manifest's temporary anything but a folder (a file or link there is replaced). Else every write
        would fail, and a re-run the same way."""
        for name, what, ok in ((STAGING, "the folder each shard is written in before it takes its name", stat.S_ISDIR),
                               (MANIFEST + ".tmp", "the manifest's temporary file",
                                lambda mode: not stat.S_ISDIR(mode))):
            path = os.path.join(self.folder, name)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if not ok(mode):
                there = ("a symbolic link" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else kind(mode))
                raise OutputError(f"{shown(path)} is {there}, where glmvit-encode makes {what}: remove it, or give "
                                  "another --out")

    def _clear_temporaries(self) -> None:
        """Remove what a run stopped mid-write left in STAGING (files never renamed into place: nothing refers to
        them), and the folder. Under the folder's lock: no other run is writing there."""
        staging = os.path.join(self.folder, STAGING)
        if os.path.islink(staging) or not os.path.isdir(staging):
            return
        with contextlib.suppress(OSError):
            for entry in os.scandir(staging):
                if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                    os.remove(entry.path)
            os.rmdir(staging)

    def discard(self) -> None:
        """Remove the folder this Output made, before anything was written to it (its lock file alone)."""
        with contextlib.suppress(OSError):  # unlinked while still locked, as __init__ does on a refusal
            os.unlink(os.path.join(self.folder, LOCK))
        self._lock.close()
        with contextlib.suppress(OSError):  # something else put there meanwhile stays, and so does the folder
            os.rmdir(self.folder)

    def _check(self, header: dict, settings: dict, where: str):
        name = _difference(header, settings)
        if name == "weights":
            raise OutputError(f"{self.folder} was written by a tower of other weights (fingerprint "
                              f"{str(header.get(name))[:12]}..., recorded in {where}) than {settings['checkpoint']} "
                              f"holds now ({settings[name][:12]}...): one folder holds one tower's embeddings (use "
                              "another --out, or the checkpoint that wrote it)")
        if name is not None:
            have, want = header.get(name), settings[name]
            if isinstance(have, dict) and isinstance(want, dict):  # the video settings: the parts that differ, by flag
                parts = sorted(k for k in set(have) | set(want) if k not in LIMITS and have.get(k) != want.get(k))
                differs = [(f"{name}.{k}", have.get(k), want.get(k)) for k in parts] or [(name, have, want)]
            else:
                differs = [(name, have, want)]
            said = "; ".join(f"{n} = {have_!r}, this run asks for {want_!r}{_flag(n)}" for n, have_, want_ in differs)
            recorded = "the setting is" if len(differs) == 1 else "the settings are"
            raise OutputError(f"{self.folder} was written with {said} ({recorded} recorded in {where}); one folder "
                              "holds one setting (use another --out, or the same settings to resume)")

    def _resume(self, path, settings):
        try:
            with open_regular(path, "the manifest", OutputError) as f:  # a FIFO or /dev/zero: refused, not read
                old = json.loads(f.read())
            if not isinstance(old, dict):
                raise TypeError(f"it holds a JSON {type(old).__name__}, not the object a manifest is")
            header, images = old["header"], old["images"]
            if not (isinstance(header, dict) and isinstance(images, dict)):  # not assert: kept under python -O
                raise TypeError("its header and images are not objects")
        except (OSError, ValueError, KeyError, TypeError, RecursionError, OutputError) as e:
            raise OutputError(f"{path} is unreadable or truncated ({type(e).__name__}: {e}); it cannot say what is "
                              "done. Move it away and run again: what the shards here hold (their own metadata) is "
                              "kept and the rest encoded; or use another --out") from None
        self._check(header, settings, MANIFEST)
        self._listed_id = _folder_id(header)
        self._on_disk = {e["shard"] for e in images.values() if isinstance(e, dict) and isinstance(e.get("shard"), str)}
        self._named = max([0, *(_shard_number(s) for s in self._on_disk if SHARD.fullmatch(s))])
        # Keep only entries whose shard reads whole and holds them as its own metadata records them: a shard lost or
        # damaged since, or replaced by another folder's of the same name, is encoded again. A shard of other
        # settings under a listed name is refused, as an unlisted one is (_recover).
        foreign: dict = {}
        own = _own_shards(self.folder, images, _expect(settings), {k: v for k, v in header.items() if k != "key"},
                          foreign)
        for shard in sorted({images[k]["shard"] for k in foreign}):
            keys = [k for k in foreign if images[k]["shard"] == shard]
            log.warning("%s: not the shard %s lists under that name (copied in from another folder?): %s; its %d "
                        "image%s listed there %s encoded again", shown(os.path.join(self.folder, shard)), MANIFEST,
                        foreign[keys[0]], len(keys), "s" if len(keys) != 1 else "", "are" if len(keys) != 1 else "is")
        self.manifest["images"] = {k: v for k, v in images.items() if k in own}
        # Earlier failures stay failures until encoded (a run that tries one again replaces its reason).
        failed = old.get("failed", {})
        if isinstance(failed, dict):
            self.manifest["failed"] = {k: v for k, v in failed.items()
                                       if isinstance(k, str) and isinstance(v, str) and k not in own}
        # An entry dropped is failed, so that neither _recover nor read_embeddings takes its key from an older shard
        # the manifest no longer lists, which may still hold the file's embedding from before it changed.
        for key in images:
            if key in foreign:
                self.manifest["failed"][key] = shown(f"{images[key]['shard']}: {foreign[key]}; {FOREIGN}")
            elif key not in own:
                self.manifest["failed"].setdefault(key, LOST)
        # What was dropped (an entry whose shard no longer holds it whole, a malformed one) leaves the manifest
        # at this run's flush, even a run with nothing to encode: read_embeddings then reads the folder again.
        self._dirty = (len(self.manifest["images"]) != len(images) or not isinstance(failed, dict)
                       or len(self.manifest["failed"]) != len(failed))

    def _recover(self, settings):
        """Images of shards the manifest does not list yet (the run before stopped before writing it), those of this
        folder's id (or none); and the folder's id: the manifest's, else the one its shards record, else a new one."""
        listed = {v.get("shard") for v in self.manifest["images"].values()}
        found = shard_entries(self.folder, skip=listed)
        for name, (header, _) in found.items():  # another tower's shard is refused, whatever id it records
            self._check(header, settings, name)
        if self._on_disk is not None:
            own, where = self._listed_id, f"recorded in {MANIFEST}"
            if own is None:  # an earlier version's manifest (or one edited): the id is recorded from this run on
                own, where = secrets.token_hex(16), (f"recorded in {MANIFEST} from this run on: the {MANIFEST} an "
                                                     "earlier version wrote records none")
                self._record_id = self._dirty = True
        else:
            own, where = _shards_id(self.folder, found), "as its other shards record it"
            if own is None:
                own, where = secrets.token_hex(16), "new: none of its shards records one"
        self.manifest["header"][FOLDER_ID] = own
        found = _this_folders(self.folder, found, own, where, quiet=self._on_disk or ())
        failed = self.manifest["failed"]
        changed = False
        for name, (header, images) in found.items():
            for key in _newer(self.manifest["images"], _current(images, failed)):  # as read_embeddings takes them
                self.manifest["failed"].pop(key, None)
                changed = True
        self._dirty = self._dirty or changed

    def done(self, key, stamp: list | None = None) -> bool:
        """Whether the file keyed `key` is encoded here; with its stamp now (file_stamp), not if the entry's
        stamp differs: the file changed since (an entry written without one is taken as it is)."""
        entry = self.manifest["images"].get(key)
        if entry is None:
            return False
        return stamp is None or not isinstance(entry, dict) or entry.get("file", stamp) == stamp

    def __len__(self):
        return len(self.manifest["images"])

    def _write_json(self):
        path = os.path.join(self.folder, MANIFEST)
        try:
            with contextlib.suppress(FileNotFoundError):  # whatever is under the name (a link: never written through)
                os.unlink(path + ".tmp")
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.manifest))  # json.dumps uses the C encoder; json.dump never does (3-4x slower)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(path + ".tmp", self.mode)
            os.replace(path + ".tmp", path)
        except OSError as e:  # the manifest before it stays whole; the shards name their own images
            with contextlib.suppress(OSError):
                os.remove(path + ".tmp")
            raise OutputError(f"cannot write {shown(path)}: {_reason(e)}") from None

    def flush(self):
        """Rewrite the manifest now, if anything changed since it was last written."""
        if self._dirty:
            self._write_json()
            self._written, self._dirty = time.monotonic(), False

    def _changed(self):
        self._dirty = True
        if time.monotonic() - self._written >= self.flush_seconds:
            self.flush()

    def add_batch(self, entries: list[tuple[str, dict, np.ndarray]]):
        if not entries:  # a batch whose every embedding was unusable: no shard of nothing
            return
        from safetensors import SafetensorError
        from safetensors.numpy import save_file

        name = f"embeddings-{self.next_shard:05d}.safetensors"
        self.next_shard += 1
        # Written in STAGING, then renamed into place: safetensors writes through a hidden temporary of its own
        # beside its target, which a process killed mid-write leaves behind; there, the next run removes it.
        staging = os.path.join(self.folder, STAGING)
        tmp = os.path.join(staging, name)
        entries = [(key, _with_path(key, info), emb) for key, info, emb in entries]
        own = {"header": self.manifest["header"], "images": {key: info for key, info, _ in entries}}
        try:
            os.makedirs(staging, exist_ok=True)
            save_file({key: np.ascontiguousarray(emb) for key, _, emb in entries}, tmp,
                      metadata={"glmvit": json.dumps(own)})
            os.chmod(tmp, self.mode)
            os.replace(tmp, os.path.join(self.folder, name))
        except (OSError, SafetensorError) as e:  # safetensors says ENOSPC / EFBIG as a SafetensorError
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise OutputError(f"cannot write {shown(os.path.join(self.folder, name))}: {_reason(e)}") from None
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(staging)  # empty again once the shard has its name
        for key, info, _ in entries:
            self.manifest["images"][key] = dict(info, shard=name)
            self.manifest["failed"].pop(key, None)
        self._changed()

    def unfail(self, key) -> None:
        """What failed in an earlier run no longer does, though it is not encoded (a folder that could not be
        listed, and now is: its files stand for it)."""
        if self.manifest["failed"].pop(key, None) is not None:
            self._dirty = True

    def fail(self, key, why):
        """The file keyed `key` failed (this run): recorded with why; an embedding of it from an earlier run (the
        file has changed since, or it would not be tried) is no longer its entry."""
        self.manifest["failed"][key] = shown(why)
        self.manifest["images"].pop(key, None)
        self._changed()


def _with_path(key: str, info: dict) -> dict:
    """An entry as written: one keyed by the repr() of its path's bytes also holds those bytes in hex."""
    if key.startswith(("b'", 'b"')):
        return dict(info, path_bytes=os.fsencode(key_path(key)).hex())
    return info


# What may wait for glmvit-encode's writer: each waiting write holds embeddings, on the GPU that made them
# until the writer copies them out, so a disk slower than the GPUs must hold the GPUs back rather than fill
# their memory. 4 writes (a 1024-token pass's images are ~60 MB, a 10 s 720p video's ~107 MB) and 2 GiB of
# embeddings (one video at the 240,000-token cap is ~2 GB: one write always may).
PENDING_WRITES = 4
PENDING_BYTES = 2 << 30


class Writer:
    """One thread that alone touches an Output (its shards and manifest, in the order asked), so the GPU and
    the prepare threads never wait for the disk. submit(fn, *a, nbytes=0) queues fn(*a); at most `pending`
    writes, and at most `pending_bytes` of their nbytes (one always may), wait before submit waits for the
    oldest (None: no bound). A write that failed raises from the next submit, or from check() after close();
    the writes queued after it are not run (the run stops; a re-run does them)."""

    def __init__(self, out: Output, pending: int | None = PENDING_WRITES,
                 pending_bytes: int | None = PENDING_BYTES):
        from concurrent.futures import ThreadPoolExecutor

        self.out, self.pending, self.pending_bytes = out, pending, pending_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="glmvit-write")
        self._writes: list = []  # (future, nbytes), oldest first
        self._failed = False

    def _over(self) -> bool:
        if self.pending is not None and len(self._writes) > self.pending:
            return True
        return (self.pending_bytes is not None and len(self._writes) > 1
                and sum(n for _, n in self._writes) > self.pending_bytes)

    def _run(self, fn, a):
        if self._failed:
            return
        try:
            fn(*a)
        except BaseException:
            self._failed = True
            raise

    def submit(self, fn, *a, nbytes: int = 0) -> None:
        self._writes.append((self._pool.submit(self._run, fn, a), nbytes))
        while self._writes and (self._writes[0][0].done() or self._over()):
            self._writes.pop(0)[0].result()

    def close(self) -> None:
        """Wait for what was submitted and flush the manifest (in a `finally`: an interrupted run's finished
        work is written too); check() then raises the first write that failed."""
        self._pool.shutdown(wait=True)
        try:
            self.out.flush()
        except OutputError:  # the manifest's write
            if not self._failed:  # else the write that failed first is the one to report
                raise

    def check(self) -> None:
        writes, self._writes = self._writes, []
        for w, _ in writes:
            w.result()


def _described(f) -> dict:
    """{key: (dtype, shape)} of an open shard's tensors, from its header alone."""
    slices = {k: f.get_slice(k) for k in f.keys()}
    return {k: (t.get_dtype(), list(t.get_shape())) for k, t in slices.items()}


def _shard_tensors(path) -> tuple[dict, dict | None] | None:
    """({image key: (dtype, shape)} of a shard's tensors, its own metadata: {"header": its run's settings, "images":
    {key: entry}}, or None for a shard that records none (an earlier version's)); None if it is missing or cannot
    be read whole (truncated or damaged: safetensors checks that its header covers the file exactly; or metadata
    that is not what this module writes)."""
    from safetensors import safe_open

    if not_regular(path):  # a FIFO or a device named like a shard: never opened (a FIFO would block)
        return None
    try:
        with safe_open(path, framework="numpy") as f:
            tensors, meta = _described(f), (f.metadata() or {}).get("glmvit")
        if meta is not None:
            meta = json.loads(meta)
            if not (isinstance(meta, dict) and isinstance(meta.get("header"), dict)
                    and isinstance(meta.get("images"), dict)):
                return None
        return tensors, meta
    except FileNotFoundError:  # missing: not done
        return None
    except OSError as e:  # no permission, an I/O error: the shard may well be whole; dropping it would lose it
        if os.path.isdir(path):  # a folder in its place: not a shard
            return None
        raise _unopened(path, e) from None
    except Exception:  # SafetensorError (damaged), ValueError (metadata): not done
        return None


def _expect(header) -> tuple[int | None, int | None]:
    """What a header's geometry records of every embedding: its width (out_hidden_size) and the patches a
    token merges along each side (spatial_merge_size); None for either it does not record."""
    geometry = header.get("geometry") if isinstance(header, dict) else None
    got = [geometry.get(k) if isinstance(geometry, dict) else None for k in ("out_hidden_size", "spatial_merge_size")]
    width, merge = (v if is_integer(v) and v >= 1 else None for v in got)
    return width, merge


def _embedding_problem(key, entry, have, expect) -> str | None:
    """What is wrong with `key`'s tensor `have` ((dtype, shape), as a shard header says) for its entry, or None:
    one bf16 row of the header's width per token of the entry, as many tokens as its grid_thw makes."""
    width, merge = expect
    tokens = entry.get("tokens") if isinstance(entry, dict) else None
    if not (is_integer(tokens) and tokens >= 1):
        return f"the entry of {shown(key)} gives {quoted(tokens)} tokens, not a positive count"
    grid = entry.get("grid_thw")
    if grid is not None and merge is not None and not (
            isinstance(grid, list) and len(grid) == 3 and all(is_integer(x) and x >= 1 for x in grid)
            and grid[0] * grid[1] * grid[2] == tokens * merge * merge):
        return (f"the entry of {shown(key)} gives grid_thw {quoted(grid)} and {tokens} tokens, but a grid of [t, h, w] "
                f"patches makes t x h x w / {merge * merge} tokens")
    dtype, shape = have
    if dtype != "BF16" or len(shape) != 2 or shape[0] != tokens or (width is not None and shape[1] != width):
        want = f"[{tokens}, {width if width is not None else 'out_hidden_size'}]"
        return f"the tensor of {shown(key)} is {dtype} {shape}, not the BF16 {want} its entry makes it"
    return None


def _entry_problem(key, entry, meta) -> str | None:
    """What a shard's own metadata (`meta`: _shard_tensors) records of `key` otherwise than its manifest entry says,
    or None (also for a shard that records nothing). The two are written together from one entry: a field both
    record with other values means the file under the shard's name is not the shard the manifest lists (copied in
    from another folder). A field one of them lacks (a manifest an earlier version wrote, or edited) is no sign."""
    if meta is None:
        return None
    own = meta["images"].get(key)
    if not isinstance(own, dict):
        return f"it holds a tensor named {shown(key)}, but its own metadata lists no such image"
    entry = {k: v for k, v in entry.items() if k != "shard"}
    parts = sorted(k for k in set(own) & set(entry) if not _same(own[k], entry[k]))
    if not parts:
        return None
    differs = ", ".join(f"{k} = {quoted(own[k], 80)} (the manifest: {quoted(entry[k], 80)})" for k in parts[:3])
    return f"its own metadata records {shown(key)} otherwise: {differs}"


def _same(a, b) -> bool:
    """Whether two values read from JSON are the same as written (a NaN read back equals itself so); a value nested
    too deep to compare is not."""
    try:
        return a == b or json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    except (RecursionError, ValueError, TypeError):
        return False


def _listed_difference(header: dict, reference: dict) -> str | None:
    """_difference of a listed shard's header from the manifest's: a shard of an earlier version, which recorded no
    weights' fingerprint, was taken by its checkpoint's path when the folder was resumed, and the path the manifest
    records since is that of the latest run (the same weights, wherever they lie now)."""
    if "weights" in reference and "weights" not in header:
        reference = {k: v for k, v in reference.items() if k != "checkpoint"}
    return _difference(header, reference)


def _own_shards(folder, images: dict, expect: tuple, reference: dict | None = None, foreign: dict | None = None) -> set:
    """The keys of manifest entries whose shard is a file of this folder by a name this module writes (nothing
    outside the folder, nothing else in it) that reads whole and holds the key's embedding as the entry describes
    it (bf16 [tokens, width], grid_thw making the tokens; `expect`: _expect), its own metadata recording the same
    entry; each shard's header is read once. A shard whose own metadata records other settings than `reference`
    (the manifest's header) is an OutputError naming it and the setting: it is not this folder's shard of that
    name, and nothing of it is taken."""
    found: dict = {}

    def own(key, entry):
        shard = entry.get("shard") if isinstance(entry, dict) else None
        if not isinstance(shard, str) or SHARD.fullmatch(shard) is None:
            return False
        path = os.path.join(folder, shard)
        if shard not in found:
            found[shard] = _shard_tensors(path)
            if found[shard] is None and os.path.exists(path):
                log.warning("%s: cannot be read whole (truncated or damaged, or its metadata is not what glmvit-encode "
                            "writes); its images are not counted as done", path)
            meta = found[shard][1] if found[shard] is not None else None
            if meta is not None and reference is not None:
                name = _listed_difference(meta["header"], reference)
                if name is not None:
                    listed = sum(isinstance(e, dict) and e.get("shard") == shard for e in images.values())
                    raise OutputError(
                        f"{shown(path)} was written with other settings than the manifest ({MANIFEST}) in "
                        f"{shown(folder)}: {_what_differs(name, meta['header'].get(name), reference[name])}; the "
                        f"manifest lists {listed} image{'s' if listed != 1 else ''} in it, so it is not this folder's "
                        "shard of that name (copied in from another folder?): move it away (a re-run then encodes "
                        "those images again), or put back this folder's own")
        if found[shard] is None:
            return False
        tensors, meta = found[shard]
        if key not in tensors or _embedding_problem(key, entry, tensors[key], expect) is not None:
            return False
        problem = _entry_problem(key, entry, meta)
        if problem is not None and foreign is not None:
            foreign[key] = problem
        return problem is None

    return {k for k, e in images.items() if own(k, e)}


def _not_own(folder, key, entry, expect) -> tuple[str, bool]:
    """Why `key`'s manifest entry is not one of _own_shards, and whether it is because the shard's own metadata
    records the key otherwise (the shard is another folder's)."""
    shard = entry.get("shard") if isinstance(entry, dict) else None
    read = None
    if isinstance(shard, str) and SHARD.fullmatch(shard):
        read = _shard_tensors(os.path.join(folder, shard))
    if read is not None and key in read[0]:
        problem = _embedding_problem(key, entry, read[0][key], expect)
        if problem is not None:
            return f"{problem} (in {shard})", False
        return _entry_problem(key, entry, read[1]), True
    if not isinstance(entry, dict):
        state = f"the entry is {quoted(entry, 80)}, not an object"
    elif not (isinstance(shard, str) and SHARD.fullmatch(shard)):
        state = f"its shard is {quoted(shard, 80)}, not a shard's name"
    elif not os.path.lexists(os.path.join(folder, shard)):
        state = f"{shard} is missing"
    elif (odd := not_regular(os.path.join(folder, shard))) is not None:
        state = f"{shard} is {odd}, not a file"
    elif read is None:
        state = f"{shard} cannot be read whole (truncated or damaged)"
    else:
        state = f"{shard} holds no tensor of that name"
    return f"its entry {key!r} names no shard of this folder that reads whole and holds it ({state})", False


def _difference(header: dict, settings: dict) -> str | None:
    """The first of `settings` that `header` (a manifest's or a shard's) records otherwise, or None. The pixel
    limits an earlier version recorded are ignored, and so is a setting it did not record (ADDED); the
    checkpoint's path counts only where a header has no weights' fingerprint."""
    header = {k: ({n: x for n, x in v.items() if n not in LIMITS} if isinstance(v, dict) else v)
              for k, v in header.items() if k not in LIMITS}
    for name, value in settings.items():
        if name in LIMITS or (name in ADDED and name not in header):  # written before the setting was
            continue
        if name == FOLDER_ID:  # which folder, not a setting: a listed shard written before the folder had one lacks it
            continue
        if name == "checkpoint" and "weights" in header and "weights" in settings:
            continue  # the weights' fingerprint says which tower wrote the folder, wherever it lies now
        if isinstance(value, dict):
            value = {n: x for n, x in value.items() if n not in LIMITS}
        if header.get(name) != value:
            return name
    return None


# The glmvit-encode flag that gives each setting a folder records (a video's, under "video."): named where a resume
# is refused for it.
FLAGS = {"min_image_tokens": "--min-image-tokens",
         "max_image_tokens": "--max-image-tokens; its default is 8000, or --capacity-tokens if lower",
         "video.target_fps": "--video-fps", "video.max_frames": "--max-frames",
         "video.min_image_tokens": "--min-video-tokens", "video.max_image_tokens": "--max-video-tokens"}


def _flag(name: str) -> str:
    """' (--flag)' for a setting a glmvit-encode flag gives, else ''."""
    return f" ({FLAGS[name]})" if name in FLAGS else ""


def _what_differs(name: str, have, want) -> str:
    """'name.part = have (there: want)' for each part of two dicts that differs (at most 3), or the whole."""
    if isinstance(have, dict) and isinstance(want, dict):
        parts = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        return ", ".join(f"{name}.{k} = {quoted(have.get(k))} (there: {quoted(want.get(k))})" for k in parts[:3])
    return f"{name} = {quoted(have)} (there: {quoted(want)})"


def read_embeddings(folder) -> tuple[dict, dict]:
    """(manifest, {key: bf16 NumPy array [tokens, out_hidden]}) of a glmvit-encode output folder,
    including the shards of a run that stopped before its manifest listed them. A key is the file's
    resolved path, or for a path that is not valid UTF-8 the repr() of its bytes: key_path(key) gives the
    path either way."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy: safetensors.numpy needs it to read the shards)
    from safetensors.numpy import load_file

    if not isinstance(folder, (str, bytes, os.PathLike)):
        raise TypeError(f"read_embeddings: folder is a {type(folder).__name__}, not a path (str, bytes or "
                        "os.PathLike): give the folder glmvit-encode wrote (its --out)")
    folder = os.fsdecode(folder)  # bytes too (a name that is not UTF-8): the keys and shards' names are str
    if not os.path.isdir(folder):
        raise OutputError(f"{shown(folder)}: " + ("is not a folder" if os.path.lexists(folder) else "no such folder") +
                          "; give the folder glmvit-encode wrote (its --out)")
    path = os.path.join(folder, MANIFEST)
    manifest = {"header": None, "images": {}, "failed": {}}
    has_manifest = os.path.exists(path)
    if has_manifest:
        try:
            with open_regular(path, "the manifest", OutputError) as f:  # a FIFO or /dev/zero: refused, not read
                manifest = json.loads(f.read())
            if not (isinstance(manifest, dict) and isinstance(manifest.get("images"), dict)
                    and isinstance(manifest.get("failed", {}), dict)):
                raise TypeError("it is not an object with an 'images' object and a 'failed' object")
            expect = _expect(manifest.get("header"))
            header = manifest.get("header")
            own = _own_shards(folder, manifest["images"], expect,
                              {k: v for k, v in header.items() if k != "key"} if isinstance(header, dict) else None)
            bad = next((k for k in manifest["images"] if k not in own), None)
            if bad is not None:
                why, foreign = _not_own(folder, bad, manifest["images"][bad], expect)
                if foreign:  # the manifest is sound; the shard under the name it gives is another folder's
                    raise OutputError(
                        f"{shown(os.path.join(folder, manifest['images'][bad]['shard']))} is not the shard {MANIFEST} "
                        f"in {shown(folder)} lists under that name (copied in from another folder?): {why}; put "
                        "back this folder's own shard, or re-run glmvit-encode into the folder: given their files, "
                        "it encodes the images the manifest lists there again")
                # The manifest reads; what it lists is not there as it says (a shard lost, damaged or swapped since,
                # or an entry edited): a resume drops such an entry and encodes its file again.
                raise OutputError(f"{shown(path)}: {shown(why)}; re-run glmvit-encode into {shown(folder)} with the same "
                                  "inputs (it counts such an entry as not done and encodes its file again), or move "
                                  f"{MANIFEST} away to read the shards alone")
            listed = {e["shard"] for e in manifest["images"].values()}
        except OutputError:  # a shard, named; the manifest is not to blame
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise OutputError(f"{path} is unreadable or not a glmvit-encode manifest ({type(e).__name__}: {e}); "
                              "move it away to read the shards alone") from None
    else:
        listed = set()
    # The settings every shard must share: the manifest's (what a resume compares: not `key`, the description
    # of how keys are made, which an earlier version worded otherwise), else the first shard's.
    reference, where = None, f"the manifest ({MANIFEST})"
    if isinstance(manifest.get("header"), dict):
        reference = {k: v for k, v in manifest["header"].items() if k != "key"}
    found = shard_entries(folder, skip=listed)
    for shard, (header, images) in found.items():
        if reference is None:
            manifest["header"], where = header, shard
            reference = {k: v for k, v in header.items() if k != "key"}
        name = _difference(header, reference)
        if name is not None:  # copied in from another folder: its embeddings are not this folder's
            raise OutputError(f"{shown(os.path.join(folder, shard))} was written with other settings than "
                              f"{where} in {shown(folder)}: {_what_differs(name, header.get(name), reference[name])}"
                              "; one folder holds one tower's embeddings at one setting: move away the shard(s) "
                              "not of this folder")
    # Of the same settings, another folder's shard is told by its folder id (the manifest's; with none, the one the
    # shards record): passed over, as a resume passes it over, named in a warning.
    if has_manifest:
        own = _folder_id(manifest.get("header"))
        where = (f"recorded in {MANIFEST}" if own is not None else
                 f"{MANIFEST} records none: an earlier version wrote it, and a later one records the id there before "
                 "it writes a shard")
    else:
        own, where = _shards_id(folder, found), "as its other shards record it"
        if own is not None:
            manifest["header"] = dict(manifest["header"], **{FOLDER_ID: own})
        else:
            where = "shards record none"
    for shard, (header, images) in _this_folders(folder, found, own, where).items():
        failed = manifest.get("failed", {})
        for key in _newer(manifest["images"], _current(images, failed)):  # what a resume takes, and only that
            failed.pop(key, None)
    by_shard = {shard: load_file(os.path.join(folder, shard))
                for shard in sorted({e["shard"] for e in manifest["images"].values()})}
    # Each key from the shard its entry names: an older shard may still hold the key of a file encoded again. Every
    # entry's tensor was checked against it above (listed) or in shard_entries (unlisted): bf16 [tokens, width].
    embs = {k: by_shard[e["shard"]][k] for k, e in manifest["images"].items()}
    return manifest, embs
