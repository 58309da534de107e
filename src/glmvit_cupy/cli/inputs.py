"""glmvit-encode's inputs: files, folders and globs expanded into image and video files (each folder entered
once, so a symbolic link loop ends), images checked for size, read, hashed and prepared on threads ahead of
the GPU."""

from __future__ import annotations

import fnmatch
import glob
import os

from .. import vllm_ec
from ..errors import ImageError
from ..files import open_regular
from ..output import file_stamp, image_key, is_output_file, shown
from ..scheduling import feed

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".avif", ".bmp", ".gif", ".tif", ".tiff")
# Containers PyAV (FFmpeg) opens; a folder's files with these names are encoded as videos.
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".wmv", ".flv",
                    ".3gp")


# Other names a photo or scan goes by (HEIC from phones, camera raw, JPEG XL), beside Pillow's own formats:
# a folder's files named so are said when passed over, so that an unlisted image format is noticed.
IMAGE_LIKE = (".heic", ".heif", ".jxl", ".dng", ".cr2", ".cr3", ".nef", ".arw", ".raf", ".orf", ".rw2")
NOT_IMAGES = (".pdf", ".ps", ".eps", ".h5", ".hdf", ".mpeg", ".mpg", ".grib", ".bufr")  # Pillow's, not photos


def looks_like_an_image(path: str) -> bool:
    """Whether a file's name is an image format's (Pillow's registered extensions, or IMAGE_LIKE): one a folder
    walk passed over is worth a word."""
    from PIL import Image

    ext = os.path.splitext(path)[1].lower()
    return ext in IMAGE_LIKE or (ext in Image.registered_extensions() and ext not in NOT_IMAGES)


def is_video(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTENSIONS)


class NoSuchInput(ValueError):
    """An input that names no file, folder or matching glob."""


def expand_inputs(items, extensions=IMAGE_EXTENSIONS + VIDEO_EXTENSIONS, passed_over=None, listed=None) -> list[str]:
    """Files as given, folders walked for files with these extensions (sorted), globs expanded, each file once
    however it was reached. Folders and `**` follow symbolic links to folders but enter each folder (by device
    and inode) once, so a link loop ends. An input that names nothing: NoSuchInput naming it. `passed_over`, a
    list, gets the folders' files whose names have none of the extensions; `listed`, the folders walked."""
    out, missing = [], []
    for item in items:
        if os.path.isdir(item):
            out += walk(item, extensions, passed_over, listed)
        elif os.path.lexists(item):  # a file, or a FIFO, device or broken link: reading it says which
            out.append(item)
        elif glob.has_magic(item):
            matches = sorted(expand_glob(item))
            # A last part naming an extension (`S/**/*.ppm`) names its files as a glob without ** does: taken.
            ext = os.path.splitext(os.path.basename(item))[1]
            if "**" in item and not (ext and not glob.has_magic(ext)):  # it walks: it takes the files a folder walk
                # takes, by their names' extensions (never an output folder's shards, manifest and lock, nor a
                # --vllm-ec-dir's files), and passes over the rest. The outermost folders it matches are walked
                # (`S/**` matches S; `photos/**/2024` only folders), the files it matches outside them taken.
                folders = _outermost([p for p in matches if os.path.isdir(p)])  # matches are sorted: parents first
                tops = {os.path.normpath(f) for f in folders}
                found = [p for p in matches if not os.path.isdir(p) and not _inside(p, tops)]
                files = [p for p in found if p.lower().endswith(extensions)]
                if passed_over is not None:
                    passed_over += [p for p in found if not p.lower().endswith(extensions)]
            else:  # what is not a folder, as a folder walk takes it (a broken link: reading it says so), but not the
                # shards, manifests and locks of output folders it reaches (`out/*`): they are never images
                found = files = [p for p in matches if not os.path.isdir(p) and not is_output_file(os.path.basename(p))]
                # Folders it matches are walked, as the shell's expansion would give them (a `**` naming an
                # extension takes only the files it names).
                folders = [] if "**" in item else [p for p in matches if os.path.isdir(p)]
            if not found and not folders:  # a mistyped glob among other inputs is as wrong as a mistyped path
                missing.append(item)
            out += files
            for folder in folders:
                out += walk(folder, extensions, passed_over, listed)
        else:
            missing.append(item)
    if missing:
        raise NoSuchInput(f"no such file, folder or matching glob: {', '.join(map(shown, missing))}")
    seen, unique = set(), []
    for p in out:
        key = image_key(p)  # the same file by any path is one image
        if key not in seen:
            seen.add(key)
            unique.append(_tidy(p))
    return unique


def _outermost(folders: list[str]) -> list[str]:
    """The folders not inside another of them (by their paths' text), in their order, a parent before its own."""
    kept, tops = [], set()
    for f in folders:
        if not _inside(f, tops):
            kept.append(f)
            tops.add(os.path.normpath(f))
    return kept


def _inside(path: str, tops: set) -> bool:
    """Whether `path` lies below one of the folders `tops` (normalised paths), by the text of their paths."""
    parent, at = os.path.dirname(os.path.normpath(path)), None
    while parent and parent != at:
        if parent in tops:
            return True
        parent, at = os.path.dirname(parent), parent
    return False


def _tidy(path: str) -> str:
    """`path` without its `.` parts and repeated separators. A path with a `..` part stays as given: the system
    resolves `link/..` after following the link, to another folder than dropping both as text gives."""
    return path if os.pardir in path.split(os.sep) else os.path.normpath(path)


def _identity(path):
    """(st_dev, st_ino) of the folder `path` leads to (symbolic links followed), or None if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _listing(folder) -> tuple[list[str], list[str]]:
    """(names of the folder's entries that are not folders, names of its folders (links to folders included)),
    each sorted; OSError if the folder cannot be listed."""
    files, dirs = [], []
    with os.scandir(folder) as it:
        for e in it:
            try:
                is_dir = e.is_dir()  # follows a symbolic link
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(e.name)
    return sorted(files), sorted(dirs)


def _scan(folder) -> tuple[list[str], list[str]]:
    """_listing, where an unreadable folder has no entries."""
    try:
        return _listing(folder)
    except OSError:
        return [], []


def _folders_under(top, seen: set, hidden: bool = True) -> list[str]:
    """`top` and every folder below it, top-down in sorted order, each folder (by device and inode) entered once
    across calls sharing `seen`: a symbolic link back up the tree is not followed again. hidden=False leaves out
    names starting with "." (as glob's ** does). A folder that cannot be looked up is listed and not entered."""
    order, stack = [], [top]
    while stack:
        folder = stack.pop()
        ident = _identity(folder)
        if ident is None:  # not even looked up (a folder above it not searchable, a path past the system's
            order.append(folder)  # limit): listed all the same, so that reading it fails and says why
            continue
        if ident in seen:
            continue
        seen.add(ident)
        order.append(folder)
        _, dirs = _scan(folder)
        stack += [os.path.join(folder, d) for d in reversed(dirs) if hidden or not d.startswith(".")]
    return order


def walk(top, extensions, passed_over=None, listed=None) -> list[str]:
    """The files under folder `top` with these extensions: each folder's files (sorted), then its subfolders'.
    A folder that cannot be listed is itself in the list: reading it fails, and the run reports it with the
    OS's reason instead of passing over what it holds. `listed`, a list, gets the folders that could be."""
    out = []
    for folder in _folders_under(top, set()):
        try:
            files, _ = _listing(folder)
        except OSError:
            out.append(folder)
            continue
        if listed is not None:
            listed.append(folder)
        out += [os.path.join(folder, f) for f in files if f.lower().endswith(extensions)]
        if passed_over is not None:
            passed_over += [os.path.join(folder, f) for f in files if not f.lower().endswith(extensions)]
    return out


def expand_glob(pattern: str) -> list[str]:
    """glob.glob(pattern, recursive=True), except that ** enters each folder (by device and inode) once, so a
    symbolic link loop ends instead of being followed to the system's depth limit on every branch. As glob:
    names starting with "." match only a pattern part starting with "."; ** matches no folder or any folders."""
    parts = [p for p in pattern.split(os.sep) if p]
    paths = [os.sep] if pattern.startswith(os.sep) else [""]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            seen: set = set()
            paths = [f for p in paths for f in _folders_under(p or os.curdir, seen, hidden=False)]
            if last:  # a trailing ** matches the files below too
                part = "*"
            else:
                continue
        if glob.has_magic(part):
            found = []
            for p in paths:
                files, dirs = _scan(p or os.curdir)
                names = sorted(dirs if not last else files + dirs)
                if not part.startswith("."):
                    names = [n for n in names if not n.startswith(".")]
                found += [os.path.join(p, n) for n in fnmatch.filter(names, part)]
            paths = found
        else:
            paths = [os.path.join(p, part) for p in paths
                     if (os.path.lexists if last else os.path.isdir)(os.path.join(p, part))]
    if pattern.endswith(os.sep):  # 'photos/*/': folders only, as the shell and glob.glob give it
        paths = [p for p in paths if os.path.isdir(p)]
    return [_tidy(p) if p.startswith(os.curdir + os.sep) else p for p in paths]


def prepared(paths, workers: int, one, max_bytes: int | None = None):
    """(path, ((uint8 image, grid, info), the file's sha256, its stamp as read (output.file_stamp)) or the
    ImageError / ValueError it raised), as each is
    ready: `workers` threads read, hash and prepare each file with one(index, data, name) ahead of the GPU (as_done:
    the output is keyed by path, so a pass takes the images that are ready; a 12 MP photo decoding holds up none).
    A file over max_bytes is refused from its size before any of it is read."""

    def job(i, path):
        if os.path.isdir(path):  # a folder walk() could not list, or a file replaced by a folder since
            try:
                os.scandir(path).close()
            except OSError as e:
                return path, ImageError(f"{path}: a folder that cannot be listed ({e}); the files in it are not "
                                        "encoded")
            return path, ImageError(f"{path}: a folder, not a file: it could not be listed when the inputs were read, "
                                    "or took a file's place since; run again to encode the files in it")
        try:
            with open_regular(path, "the image", ImageError) as f:  # a FIFO or /dev/zero: refused, not read
                st = os.fstat(f.fileno())
                if max_bytes is not None:
                    size = st.st_size
                    check_size(path, size, max_bytes, "image")
                    # read(n) allocates n bytes at once: ask for what the file holds (and one more, to see
                    # it grew past the limit since), not for the limit.
                    data = f.read(min(size, max_bytes) + 1)
                    if len(data) > size:
                        data += f.read(max_bytes + 1 - len(data))
                    check_size(path, len(data), max_bytes, "image")  # it grew since
                else:
                    data = f.read()
            return path, (one(i, data, name=path), vllm_ec.key_of(data), file_stamp(st))
        except OSError as e:
            return path, unreadable(path, e)
        except (ImageError, ValueError) as e:
            return path, e
        except MemoryError:  # a large file under a memory limit: this file fails, the run goes on
            return path, ImageError(f"{path}: not enough memory to read and decode it; lower --workers, or "
                                    "--max-image-mib to skip files this large")

    return feed.as_done(job, paths, workers)


def check_size(path, size: int, max_bytes: int, what: str) -> None:
    """ImageError naming the file, its size and the flag that raises the limit, if size is over max_bytes."""
    if size > max_bytes:
        flag = f"--max-{what}-mib"
        raise ImageError(f"{path}: the {what} file is {mib(size)} MiB, over the {flag} limit of {mib(max_bytes)} MiB; "
                         f"raise {flag} to encode it")


def mib(n: int) -> str:
    """n bytes in MiB, as few digits as say it: 64, 6,144, 0.5, 0.01."""
    x = n / 2**20
    return f"{x:,.1f}".removesuffix(".0") if x >= 1 or x == 0 else f"{x:.2g}"


def unreadable(path, e: OSError) -> ImageError:
    """An input file that cannot be read, and why (a broken or looping symbolic link named as one)."""
    if os.path.islink(path) and not os.path.exists(path):
        import errno

        what = "a symbolic link loop" if e.errno == errno.ELOOP else "a broken symbolic link"
        return ImageError(f"{path}: {what} (to {os.readlink(path)!r})")
    return ImageError(f"{path}: cannot read ({e})")


