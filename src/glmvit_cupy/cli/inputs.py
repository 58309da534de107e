"""glmvit-encode's inputs: files, folders and globs expanded into image and video files, images read, hashed
and prepared on threads ahead of the GPU, and the --devices list parsed."""

from __future__ import annotations

import glob
import os

from ..errors import ImageError
from ..files import open_regular
from ..output import image_key
from ..scheduling import feed
from ..serving import vllm_ec

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Containers PyAV (FFmpeg) opens; a folder's files with these names are encoded as videos.
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".wmv", ".flv",
                    ".3gp")


def is_video(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTENSIONS)


def expand_inputs(items, extensions=IMAGE_EXTENSIONS + VIDEO_EXTENSIONS) -> list[str]:
    """Files as given, folders walked for files with these extensions (sorted), globs expanded, each file once
    however it was reached; an input that names nothing is an error (SystemExit with the message)."""
    out, missing = [], []
    for item in items:
        if os.path.isdir(item):
            for root, dirs, files in os.walk(item):
                dirs.sort()
                out += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(extensions)]
        elif os.path.isfile(item):
            out.append(item)
        elif glob.has_magic(item):
            out += sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
        else:
            missing.append(item)
    if missing:
        raise SystemExit(f"glmvit-encode: no such file, folder or matching glob: {', '.join(missing)}")
    seen, unique = set(), []
    for p in out:
        key = image_key(p)  # the same file by any path is one image
        if key not in seen:
            seen.add(key)
            unique.append(os.path.normpath(p))
    return unique


def prepared(paths, workers: int, one):
    """(path, ((uint8 image, grid, info), the file's sha256) or the ImageError / ValueError it raised), as each is
    ready: `workers` threads read, hash and prepare each file with one(index, data, name) ahead of the GPU (as_done:
    the output is keyed by path, so a pass takes the images that are ready; a 12 MP photo decoding holds up none)."""

    def job(i, path):
        try:
            with open_regular(path, "the image", ImageError) as f:  # a FIFO or /dev/zero: refused, not read
                data = f.read()
            return path, (one(i, data, name=path), vllm_ec.key_of(data))
        except OSError as e:
            return path, unreadable(path, e)
        except (ImageError, ValueError) as e:
            return path, e

    return feed.as_done(job, paths, workers)


def unreadable(path, e: OSError) -> ImageError:
    """An input file that cannot be read, and why (a broken symbolic link named as one)."""
    broken = os.path.islink(path) and not os.path.exists(path)
    return ImageError(f"{path}: " + (f"a broken symbolic link (to {os.readlink(path)!r})" if broken
                                     else f"cannot read ({e})"))


