"""glmvit-encode: images and videos from files, folders or globs -> embeddings in safetensors + a JSON manifest.

    glmvit-encode photos/ 'scans/**/*.png' clips/ --checkpoint zai-org/GLM-5.3-Flash --out embeddings/
    glmvit-encode --inspect /models/GLM-5.3-Flash

The output folder holds embeddings-NNNNN.safetensors shards (one bf16 tensor per image or video, keyed
by the file's resolved path, or for a path that is not valid UTF-8 by the repr() of its bytes) and
manifest.json (source, size_hw, canvas_hw, grid_thw, tokens, shard per file, a video's with kind "video",
its frames_indices, timestamps and fps; the files that failed, with why; the settings). Each batch is
written to a temporary name and renamed, naming its files in its own metadata; the manifest is rewritten
every few seconds and at the end: an interrupted run loses nothing it finished, and a re-run with the
same settings skips what is done. A bad file (or one over --max-image-mib / --max-video-mib) is reported
and skipped; a re-run tries it again. With --cpu each image is a pass of its own, saved as it finishes.
Folders and ** follow symbolic links but enter each folder once. Video files (the `video` extra, PyAV) are
read as the reference processor reads a path and encoded after the images. Read the output with
glmvit_cupy.output.read_embeddings(folder).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import logging
import os
import signal
import sys
import threading
import time
import warnings

from .. import __version__, gpu
from ..checkpoint.bind import bind_tower, inspect_checkpoint
from ..checks import (DECODE, DEFAULT_MAX_IMAGE_TOKENS, GPU_HEAD_DIMS, RESIZE, TOKEN_LIMIT, device_list,
                      embedding_problem)
from ..errors import CheckpointError, OutputError
from ..output import Output, Writer, image_key, key_path, path_text, shown, stamp_of
from ..preprocessing.image import Patching
from ..preprocessing.video import MAX_FRAMES, MAX_VIDEO_TOKENS, MIN_VIDEO_TOKENS, TARGET_FPS
from ..scheduling import feed
from ..backend import Backend
from ..scheduling.batching import pack, preparer
from .. import vllm_ec
from .common import (DONE, EXIT_STATUS, FAILED, USAGE, WRITE, Disconnected, Streams, counted, interruption,
                     no_vllm_file, skipped, stopped_by_sigterm, write_vllm)
from .inputs import (IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, NoSuchInput, expand_inputs, is_video, looks_like_an_image,
                     prepared)
from .videos import encode_videos, file_sha256, video_settings

MAX_IMAGE_MIB = 64  # as glmvit-serve's --max-image-mib: an image file is read whole, on each of --workers threads
# A video file is hashed in pieces and decoded as it streams, never held whole: its limit bounds the time spent
# on a file (hashing runs at about 1 GB/s), not memory, so it is large.
MAX_VIDEO_MIB = 64 * 1024
MAX_WORKERS = 256  # --workers at most


class _Deprecated(argparse.Action):
    """A flag kept as an alias of a newer one: stored under the newer one's name, with a note on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--" + self.dest.replace("_", "-")
        print(f"{parser.prog}: {option_string} is deprecated; use {new} (same meaning)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glmvit-encode", description=__doc__, epilog=EXIT_STATUS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", help="image and video files, folders (walked for both) or globs")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--checkpoint", help="checkpoint folder, shard or index, or Hub id (org/name)")
    ap.add_argument("--out", help="output folder (created; re-running the same command resumes)")
    ap.add_argument("--inspect", metavar="CHECKPOINT", help="print what the load-time checks find, then exit")
    ap.add_argument("--capacity-tokens", type=int, default=8000,
                    help="tokens per forward pass; images are packed into passes of this size (default 8000)")
    ap.add_argument("--batch-tokens", type=int, dest="capacity_tokens", action=_Deprecated, help=argparse.SUPPRESS)
    ap.add_argument("--max-image-tokens", type=int, default=None,
                    help=f"per-image resize limit, as the reference processor's (default {DEFAULT_MAX_IMAGE_TOKENS}, "
                         "or --capacity-tokens if that is lower); at most --capacity-tokens")
    ap.add_argument("--min-image-tokens", type=int, default=16, help="per-image lower limit (default 16; 0: none)")
    ap.add_argument("--devices", type=device_list, default=None, metavar="0,1,...",
                    help="CUDA devices, one replica each; batches are spread across them (default: the current one)")
    ap.add_argument("--workers", type=int, default=feed.default_workers(),
                    help="threads reading and decoding images ahead of the GPU (default: the CPUs, at most 16); "
                         "each holds one decoded image (36 MB for a 12-megapixel photo)")
    ap.add_argument("--resize", choices=RESIZE, default=None,
                    help="who resizes images and video frames: the GPU, bit for bit as the host (default), or the "
                         "host (--cpu's)")
    ap.add_argument("--decode", choices=DECODE, default="cpu",
                    help="who decodes JPEGs: Pillow (default) or nvImageCodec on the GPU (the gpu-decode-cu12 or "
                         "gpu-decode-cu13 extra; "
                         "its pixels differ slightly from Pillow's, see docs/PERFORMANCE.md)")
    ap.add_argument("--max-pixels", type=int, default=None, metavar="N",
                    help="largest image (or video frame) to decode, in pixels (default: Pillow's "
                         "decompression-bomb guard, 89,478,485); raise it for large scans or panoramas")
    ap.add_argument("--max-image-mib", type=float, default=MAX_IMAGE_MIB, metavar="MIB",
                    help=f"largest image file, in MiB (default {MAX_IMAGE_MIB}, as glmvit-serve's); a larger one is "
                         "reported as failed from its size, never read")
    ap.add_argument("--max-video-mib", type=float, default=MAX_VIDEO_MIB, metavar="MIB",
                    help=f"largest video file, in MiB (default {MAX_VIDEO_MIB:,}; a video is read in pieces, never "
                         "whole); a larger one is reported as failed from its size")
    ap.add_argument("--vllm-ec-dir", default=None, metavar="DIR",
                    help="also write each embedding as DIR/<key>/encoder_cache.safetensors, the layout vLLM's "
                         "shared-storage encoder-cache connector reads; the key is the file's sha256 under the "
                         "default token limits (16, 8000), else vllm_ec.key_for_image of it and the limits")
    ap.add_argument("--no-videos", action="store_true", help="leave video files out (folders and globs included)")
    ap.add_argument("--max-video-tokens", type=int, default=MAX_VIDEO_TOKENS,
                    help=f"a video's resize limit, all its frames together (default {MAX_VIDEO_TOKENS:,}, the "
                         "reference video processor's); one group of 2 frames must fit --capacity-tokens")
    ap.add_argument("--min-video-tokens", type=int, default=MIN_VIDEO_TOKENS,
                    help=f"a video's lower limit (default {MIN_VIDEO_TOKENS})")
    ap.add_argument("--video-fps", type=float, default=TARGET_FPS,
                    help=f"frames sampled per second of video (default {TARGET_FPS}, the reference's)")
    ap.add_argument("--max-frames", type=int, default=MAX_FRAMES,
                    help=f"most frames sampled from a video (default {MAX_FRAMES})")
    ap.add_argument("--max-video-pixels", type=int, default=2**32, metavar="N",
                    help="a video's sampled frames' pixels together, checked before decoding (default 2^32; up to "
                         "4 videos are held at once, 3 bytes a pixel)")
    ap.add_argument("--cpu", action="store_true", help="use the float32 NumPy reference (slow; no GPU needed)")
    return ap


MAX_TARGET_FPS = 10_000  # --video-fps at most: finer than any video's frames (1e308 overflows the sampler)


def parse(argv):
    """Inputs before, between and after the options; after `--`, every word is an input (a file named
    `-x.jpg`): parse_intermixed_args does not take `--` itself before Python 3.12."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    args = parser().parse_intermixed_args(argv)
    args.inputs += rest
    return args


def _size(n: int) -> str:
    """Bytes in the largest binary unit they reach: '1.05 GiB' for the official tower, '2.0 MiB' for the test tower."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.{2 if shift == 30 else 1}f} {unit}"
    return f"{n} bytes"


def inspect(path) -> int:
    try:
        s = inspect_checkpoint(path)  # every load-time check, the weights' values included
    except CheckpointError as e:
        return fail(e)
    g = s["geometry"]
    print(f"checkpoint  {shown(s['path'])}\nprefix      {shown(s['prefix'])}\ntensors     {s['tensors']} "
          f"({s['parameters'] / 1e6:.1f} M parameters, {_size(s['bytes'])} BF16)\n"
          f"shards      {', '.join(shown(x) for x in s['shards'])}\ngeometry    depth {g.depth}, hidden {g.hidden_size}, "
          f"heads {g.num_heads}, mlp {g.intermediate_size}, out {g.out_hidden_size}, merger "
          f"{g.projection_intermediate_size}, patch {g.patch_size}x{g.temporal_patch_size}, merge "
          f"{g.spatial_merge_size}x{g.spatial_merge_size}, channels {g.in_channels}")
    for note in refusals(g):  # the checks above pass, but a later step would refuse: said now, not at that step
        print(f"refused     {note}")
    return 0


def refusals(g) -> list[str]:
    """What the encoder refuses later of a geometry the load-time checks pass: images and video frames for a tower
    whose patches are not RGB (Patching.of), the GPU engine for a head dim its attention kernels do not take
    (engine.attention.default_variants)."""
    said = []
    try:
        Patching.of(g)
    except ValueError:
        said.append(f"images and videos: in_channels = {g.in_channels}, but images and video frames are RGB (3 "
                    "channels), so glmvit-encode, glmvit-serve and encode(images) refuse this tower; only "
                    "encode_pixels, given pixel_values of that many channels, runs it")
    if g.head_dim not in GPU_HEAD_DIMS:
        said.append(f"the GPU: head_dim = {g.hidden_size} / {g.num_heads} = {g.head_dim}, but the GPU engine's "
                    f"attention kernels take head dims that are multiples of 4 up to {GPU_HEAD_DIMS[-1]}; only the "
                    "float32 reference runs this tower (glmvit-encode --cpu)")
    return said


def fail(message) -> int:
    """Say why the run is refused, in one line; the status for it (nothing was run)."""
    print(f"glmvit-encode: {shown(message)}", file=sys.stderr)
    return USAGE


class _LogAboveTheBar(logging.Handler):
    """The package's warnings (a vLLM file of another tower replaced, say) as lines of their own above the
    progress bar, not in the middle of it."""

    def emit(self, record):
        from tqdm import tqdm

        try:
            tqdm.write(f"glmvit-encode: {shown(record.getMessage())}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - stderr gone (a closed pipe): logging's own way, never the write's failure
            self.handleError(record)


def _warning_above_the_bar(message, category, filename, lineno, file=None, line=None):
    """Python's warnings (Pillow's on a damaged file) as lines above the progress bar, naming the image a
    decoding thread was on."""
    from tqdm import tqdm

    from ..preprocessing.decode import decoding

    name = decoding()
    if name and category.__name__ == "DecompressionBombWarning":  # the image is refused, and its line says so
        return
    where = f"{name}: " if name else ""
    said = f"{where}{message}" + (f" ({category.__name__} from {os.path.basename(filename)})" if not name else
                                  " (Pillow; the image is encoded as Pillow reads it, as the reference's is)")
    try:
        tqdm.write(f"glmvit-encode: {said}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - stderr gone (a closed pipe): the warning is lost, never the run
        pass


def main(argv=None) -> int:
    with Streams() as streams:  # stdout or stderr closed, or its reader gone (a broken pipe): no traceback
        # SIGTERM (a scheduler stopping the job) stops the run as Ctrl-C does: what finished is saved, and said.
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, stopped_by_sigterm) if main_thread else None
        pkg, handler = logging.getLogger("glmvit_cupy"), None
        if not logging.getLogger().handlers and not pkg.handlers:  # logging left unset: Python's last resort
            handler = _LogAboveTheBar(logging.WARNING)
            pkg.addHandler(handler)
        args = None
        try:
            args = parse(argv)
            with warnings.catch_warnings():  # the filters and showwarning are put back after the run
                warnings.filterwarnings("always", module=r"PIL\.")  # each damaged image named, not only the first
                warnings.showwarning = _warning_above_the_bar
                status = run(args)
            streams.flush()  # what a pipe's buffer still holds: a reader gone shows here at the latest
            return status
        except KeyboardInterrupt as e:  # before the encoding began (walking the inputs, loading the checkpoint)
            word, status = interruption(e)
            nothing_to_save = args is None or args.inspect is not None  # --help, --inspect
            if isinstance(e, Disconnected) and nothing_to_save:
                print(f"\nglmvit-encode: {word}", file=sys.stderr)
            elif isinstance(e, Disconnected):  # or as the run ended, its last lines unread
                print(f"\nglmvit-encode: {word}; what finished is saved; re-run the same command to resume",
                      file=sys.stderr)
            else:
                print(f"\nglmvit-encode: {word} before anything was encoded", file=sys.stderr)
            return status
        finally:
            if handler is not None:
                pkg.removeHandler(handler)
            if main_thread:
                signal.signal(signal.SIGTERM, previous)


def run(args) -> int:
    if args.inspect is not None:  # an empty one (an unset variable) too: inspect says so
        extra = [what for what, given in (("images or videos", args.inputs), ("--checkpoint", args.checkpoint),
                                          ("--out", args.out)) if given]
        if extra:
            return fail(f"--inspect CHECKPOINT runs alone: leave out {' and '.join(extra)}, or leave out --inspect "
                        "to encode")
        return inspect(args.inspect)
    missing = [what for what, given in (("images or videos", args.inputs), ("--checkpoint", args.checkpoint),
                                        ("--out", args.out)) if not given]
    if missing:
        return fail(f"missing {' and '.join(missing)}: an encode needs images or videos, --checkpoint and --out "
                    "(or --inspect CHECKPOINT alone); see --help")
    for flag, value, low in (("--workers", args.workers, 1), ("--capacity-tokens", args.capacity_tokens, 1),
                             ("--max-image-tokens", args.max_image_tokens, 1),
                             ("--min-image-tokens", args.min_image_tokens, 0), ("--max-pixels", args.max_pixels, 1),
                             ("--max-video-tokens", args.max_video_tokens, 1),
                             ("--min-video-tokens", args.min_video_tokens, 0), ("--max-frames", args.max_frames, 1),
                             ("--max-video-pixels", args.max_video_pixels, 1)):
        if value is not None and value < low:
            return fail(f"{flag} {value} must be at least {low}")
        if value is not None and "tokens" in flag and value > TOKEN_LIMIT:
            return fail(f"{flag} {value} must be at most {TOKEN_LIMIT:,}")
    if args.workers > MAX_WORKERS:  # each a thread holding a decoded image: thousands fail to start (pids, memory)
        return fail(f"--workers {args.workers} must be at most {MAX_WORKERS}: each is a thread reading and decoding "
                    "one image; past the CPUs they add nothing")
    for flag, value in (("--max-image-mib", args.max_image_mib), ("--max-video-mib", args.max_video_mib)):
        if not 2**-20 <= value <= 2**40:  # one byte to 1 EiB: past any file
            return fail(f"{flag} {value:g} must be a number of MiB from one byte ({2**-20:.3g}) to {2**40:,}")
    if not 0 < args.video_fps <= MAX_TARGET_FPS:
        return fail(f"--video-fps {args.video_fps:g} must be a positive number of frames a second, at most "
                    f"{MAX_TARGET_FPS:,}, finer than any video's frames")
    if args.vllm_ec_dir is not None and not args.vllm_ec_dir.strip():
        return fail("--vllm-ec-dir is empty (an unset variable?): give a folder, or leave the flag out")
    if args.min_video_tokens > args.max_video_tokens:
        return fail(f"--min-video-tokens {args.min_video_tokens} is above --max-video-tokens {args.max_video_tokens}")
    gpu_only = [f for f, on in (("--devices", args.devices), ("--decode gpu", args.decode == "gpu"),
                                ("--resize gpu", args.resize == "gpu")) if on and args.cpu]
    if gpu_only:
        return fail(f"--cpu encodes on the host, without a GPU: leave out {' and '.join(gpu_only)}")
    args.resize = args.resize or ("host" if args.cpu else "gpu")
    why = token_limits(args)
    if why:
        return fail(why)
    # Everything that can refuse the run is checked before the output folder is made.
    kinds = IMAGE_EXTENSIONS + (() if args.no_videos else VIDEO_EXTENSIONS)
    passed_over: list[str] = []
    listed: list[str] = []
    try:
        paths = [p for p in expand_inputs(args.inputs, kinds, passed_over, listed)
                 if not (args.no_videos and is_video(p))]
    except NoSuchInput as e:
        return fail(e)
    images_passed = [p for p in passed_over if looks_like_an_image(p)]
    if images_passed:  # a folder's other files are not inputs; images among them are said, to be noticed
        print(f"glmvit-encode: passed over {counted(len(images_passed), 'image file')} in the folders whose names end "
              f"in none of {', '.join(kinds)} (e.g. {shown(images_passed[0])}); name a file to encode it whatever "
              "its name", file=sys.stderr)
    if not paths:
        return fail(f"no images or videos found in {', '.join(args.inputs)} (looked for {', '.join(kinds)})")
    videos = [p for p in paths if is_video(p)]
    if videos and importlib.util.find_spec("av") is None:
        return fail(f"{counted(len(videos), 'video file')} among the inputs ({videos[0]}"
                    f"{', ...' if len(videos) > 1 else ''}); reading them needs PyAV: pip install -e '.[video]' in "
                    "the glmvit-cupy checkout, or leave them out with --no-videos")
    try:
        binding = bind_tower(args.checkpoint)
        Patching.of(binding.geometry)  # images need a tower of RGB patches
    except (CheckpointError, ValueError) as e:
        return fail(e)
    why = None if args.cpu else gpu.problem()
    if why:
        return fail(f"cannot use the GPU: {why}")
    if args.vllm_ec_dir:
        try:
            vllm_ec.check_folder(args.vllm_ec_dir)  # a wrong folder stops the start, not a run at its first batch
        except OutputError as e:
            return fail(e)
    per_video = video_settings(args)
    try:  # reads the whole tower: a shard rewritten since its header was read is refused here, by name
        weights = binding.fingerprint
    except CheckpointError as e:
        return fail(e)
    # What shapes an embedding, fixed for the folder. The pixel and size limits only accept or refuse a file,
    # so a re-run with a higher one resumes here and encodes what they refused.
    settings = {"checkpoint": path_text(os.path.abspath(binding.path)), "weights": weights,
                "geometry": dict(vars(binding.geometry)),
                "min_image_tokens": args.min_image_tokens, "max_image_tokens": args.max_image_tokens,
                "video": per_video}
    created = not os.path.lexists(args.out)
    try:
        out = Output(args.out, settings)
    except OutputError as e:  # a file, other settings, a damaged manifest, a folder that cannot be made
        return fail(e)
    for folder in listed:  # a folder an earlier run could not list, listed now: its files stand for it
        out.unfail(image_key(folder))
    own = [p for p in paths if out.is_lock(p)]  # never opened: closing it would drop this run's lock on the folder
    for p in own:
        print(skipped(p, f"the lock file of --out {shown(args.out)}, not an image; never read"), file=sys.stderr)
    paths = [p for p in paths if p not in own]
    keys = {p: image_key(p) for p in paths}  # a realpath each: once
    todo = [p for p in paths if not out.done(keys[p], stamp_of(p))]
    changed = sum(out.done(keys[p]) for p in todo)  # encoded before, changed since
    if changed:
        print(f"glmvit-encode: {counted(changed, 'file')} in {shown(args.out)} changed since "
              f"{'it was' if changed == 1 else 'they were'} encoded (size or modification time); encoding "
              f"{'it' if changed == 1 else 'them'} again")
    if len(todo) < len(paths):
        print(f"glmvit-encode: {len(paths) - len(todo)} of {counted(len(paths), 'file')} already in "
              f"{shown(args.out)}; skipping {'it' if len(paths) - len(todo) == 1 else 'them'}")
    blocked = 0  # earlier images whose vLLM file something in the way of its key kept from being written
    if args.vllm_ec_dir and len(todo) < len(paths):  # finished in an earlier run: their vLLM files too
        pending = set(todo)
        try:
            backfilled, blocked = backfill_vllm(args, out, [keys[p] for p in paths if p not in pending])
        except OutputError as e:
            return stopped_writing(e)
        if backfilled:
            print(f"glmvit-encode: {counted(backfilled, 'file')} encoded earlier had no file in --vllm-ec-dir "
                  f"{shown(args.vllm_ec_dir)}: written from {shown(args.out)}")
    again = sum(keys[p] in out.manifest["failed"] for p in todo)
    if again:
        print(f"glmvit-encode: {counted(again, 'file')} failed in an earlier run; trying "
              f"{'it' if again == 1 else 'them'} again")
    if not todo:
        try:  # shards the last run wrote before its manifest caught up are in it now, their files no longer failed
            out.flush()
        except OutputError as e:
            return stopped_writing(e)
        return FAILED if blocked or own else DONE
    todo_videos = [p for p in todo if is_video(p)]
    todo = [p for p in todo if not is_video(p)]
    if args.cpu:
        print("glmvit-encode: --cpu: the float32 NumPy reference encodes on the CPU; this is slow", file=sys.stderr)
    try:
        t_load = time.perf_counter()
        enc = Backend(binding, cpu=args.cpu, devices=args.devices, capacity_tokens=args.capacity_tokens,
                      max_image_tokens=args.max_image_tokens)
        print(f"glmvit-encode: {enc.name} ready in {time.perf_counter() - t_load:.1f} s"
              + (f" (CUDA graphs of {len(enc.graphs_ready)} full-pass budgets captured)" if enc.graphs_ready else ""),
              file=sys.stderr)
    except ValueError as e:  # the weights' values (NaN, infinities), found as the engine loads them
        if created:  # exit 2 creates nothing: the folder this run made goes again
            out.discard()
        return fail(e)
    saved_before = len(out)
    try:
        rc = encode_all(args, todo, enc, out) if todo else DONE
        rc = max(rc, encode_videos(args, todo_videos, enc, out, per_video) if todo_videos else DONE)
        return max(rc, FAILED if blocked or own else DONE)
    except KeyboardInterrupt as e:
        n = len(out) - saved_before
        word, status = interruption(e)
        print(f"\nglmvit-encode: {word}; {counted(n, 'file')} saved this run ({len(out)} in {shown(args.out)}); "
              "re-run the same command to resume", file=sys.stderr)
        return status
    except (OutputError, OSError) as e:  # a write: a full disk, lost permissions, a mount gone (it names the file)
        n = len(out) - saved_before
        return stopped_writing(e, f"the run stopped with {counted(n, 'file')} saved ({len(out)} in {shown(args.out)})")


def stopped_writing(e: Exception, ran: str | None = None) -> int:
    """WRITE, once stderr says which write failed (e names the file), what the run had done (`ran`, if it had
    begun encoding) and how to go on."""
    what = e if isinstance(e, OutputError) else f"a write failed ({e})"
    print(("\n" if ran else "") + f"glmvit-encode: {shown(what)}" + (f"; {ran}" if ran else "")
          + "; fix it (free space, permissions) and re-run the same command" + (" to resume" if ran else ""),
          file=sys.stderr)
    return WRITE


def backfill_vllm(args, out, done: list) -> tuple[int, int]:
    """The vLLM files of images and videos `out` holds already, written from their shards where
    --vllm-ec-dir has none (or a broken one, or another tower's): a re-run with --vllm-ec-dir, or after a
    cache folder was cleared, fills it. Returns (how many were written, how many could not be: something
    in the way of their keys, each named)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, which safetensors.numpy reads it as)
    from safetensors import safe_open

    weights = out.manifest["header"]["weights"]
    missing: dict[str, list] = {}
    in_the_way = 0  # keys whose place something not the cache's own holds: blocked, as when they are written
    for key in done:
        entry = out.manifest["images"][key]
        try:
            if entry.get("key") is not None:  # a video's entry has its key
                ec_key = entry["key"]
            elif entry.get("sha256") is None and entry.get("file") is None:  # too old to tell the file unchanged
                raise ValueError("its entry records neither the file's sha256 nor its size and time")
            else:  # an image's sha256; an entry of an older run has none: the file, unchanged since, is read
                sha = entry.get("sha256") or file_sha256(key_path(key))[0]
                ec_key = vllm_ec.key_for_image(sha, args.min_image_tokens, args.max_image_tokens)
            if not vllm_ec.holds(args.vllm_ec_dir, ec_key, weights):
                missing.setdefault(entry["shard"], []).append((key, ec_key))
        except vllm_ec.InTheWay as e:  # as when it is written: named, its embedding saved in --out
            print(no_vllm_file(key_path(key), e), file=sys.stderr)
            in_the_way += 1
        except (ValueError, OSError) as e:  # the file gone or unreadable (ImageError), a damaged entry
            print(skipped(key, f"no --vllm-ec-dir file written for it: {e}"), file=sys.stderr)
    written, blocked = 0, in_the_way
    for shard, items in sorted(missing.items()):
        with safe_open(os.path.join(out.folder, shard), "numpy") as f:
            for key, ec_key in items:
                said = write_vllm(args.vllm_ec_dir, ec_key, f.get_tensor(key), weights, key_path(key),
                                  lambda line: print(line, file=sys.stderr))
                written, blocked = written + said, blocked + (not said)
    return written, blocked


def token_limits(args) -> str | None:
    """Settle --max-image-tokens (its default: 8000, or --capacity-tokens if lower, as the Python API's) and
    say what is wrong with the image token limits, if anything."""
    given = args.max_image_tokens is not None
    if not given:
        args.max_image_tokens = min(DEFAULT_MAX_IMAGE_TOKENS, args.capacity_tokens)
        if args.max_image_tokens < DEFAULT_MAX_IMAGE_TOKENS:  # it changes the embeddings: said, not done quietly
            print(f"glmvit-encode: images of over {args.max_image_tokens} tokens are resized down to fit one pass "
                  f"(--max-image-tokens defaults to --capacity-tokens {args.capacity_tokens} where that is below "
                  f"{DEFAULT_MAX_IMAGE_TOKENS}); give --max-image-tokens to set it", file=sys.stderr)
    elif args.max_image_tokens > args.capacity_tokens:
        return (f"--max-image-tokens {args.max_image_tokens} is above --capacity-tokens {args.capacity_tokens}: the "
                "largest image must fit one pass; lower --max-image-tokens or raise --capacity-tokens")
    if args.min_image_tokens > args.max_image_tokens:
        where = "" if given else f" (its default: {DEFAULT_MAX_IMAGE_TOKENS}, or --capacity-tokens if lower)"
        return (f"--min-image-tokens {args.min_image_tokens} is above --max-image-tokens {args.max_image_tokens}"
                f"{where}: an image is resized to between the two, so the minimum must not exceed the maximum")
    return None


def encode_all(args, todo, enc, out) -> int:
    """Encode `todo` into `out`; FAILED if any image failed, else DONE. Three things run side by side: the prepare
    threads, the GPU (one group of batches computing while the next is packed and launched) and one
    writer thread, which alone touches the output folder (shards and manifest, in order). The CPU reference
    computes each image on its own anyway: there each image is a pass of its own, saved (and counted on the
    bar) as it finishes, so Ctrl-C loses at most the image being computed."""
    from tqdm import tqdm

    tokens_done, failed = 0, 0
    shown_failed = 0  # failures the bar has counted: skip runs on the writer's thread, after `failed` counts them
    unusable = []  # images whose embedding came back unusable (the writer's thread appends them)
    blocked = []  # images saved whose vLLM file could not be written (something in the way of its key)
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), unit="img", dynamic_ncols=True)
    writer = Writer(out)  # a disk slower than the GPUs holds them back (output.PENDING_WRITES)
    weights = out.manifest["header"]["weights"]  # the tower's fingerprint, kept in each vLLM file

    def write(group, launched):
        nonlocal tokens_done
        if not launched.claim():  # handed over twice: an interrupt between collect's hand-over and its note
            return
        # Copied to the host here, off the GPU's thread, and written straight from page-locked memory.
        with launched.viewed() as per_batch:
            for b, per_image in zip(group, per_batch):
                kept = []
                for (key, info), emb in zip(b, per_image):
                    problem = embedding_problem(emb, key)
                    if problem is None:
                        kept.append((key, info, emb))
                    else:  # never saved: the image is failed, saying why
                        unusable.append(key)
                        out.fail(key, problem)
                        bar.write(skipped(key, problem))
                if args.vllm_ec_dir:
                    for key, info, emb in kept:
                        if not write_vllm(args.vllm_ec_dir, vllm_ec.key_for_image(
                                info["sha256"], args.min_image_tokens, args.max_image_tokens), emb, weights,
                                key_path(key), bar.write):
                            blocked.append(key)
                out.add_batch(kept)
                tokens_done += sum(info["tokens"] for _, info, _ in kept)
                bar.update(len(b))
        postfix()

    def postfix():
        bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - t0):.0f}",
                        failed=shown_failed + len(unusable))

    def skip(path, why):
        nonlocal shown_failed
        shown_failed += 1
        out.fail(image_key(path), str(why))
        bar.write(skipped(path, why))
        bar.update(1)
        postfix()

    submit = writer.submit  # a write that failed stops the run at the next submit

    def usable(stream):
        """The prepared images, keyed; a failed one is recorded and skipped."""
        nonlocal failed
        for path, got in stream:
            if isinstance(got, Exception):
                failed += 1
                submit(skip, path, got)
                continue
            (image, grid, info), sha, stamp = got  # sha: the content's key, as vLLM's encoder cache and glmvit-serve use
            key = image_key(path)
            yield key, image, grid, {"source": key, "sha256": sha, "file": stamp, "size_hw": list(info["size"]),
                                     "canvas_hw": list(info["canvas"]), "content": list(info["content"]),
                                     "grid_thw": list(grid), "tokens": info["tokens"]}

    def groups(stream):
        """Packed batches, one per device at a time (the replicas run a group side by side); on the CPU, one
        image a pass."""
        if enc.cpu:
            batches = ([item] for item in usable(stream))
        else:
            batches = pack(usable(stream), args.capacity_tokens, lambda item: item[3]["tokens"])
        while group := list(itertools.islice(batches, enc.lanes)):
            yield group

    one = enc.preparing(preparer(enc.geometry, args.capacity_tokens, args.min_image_tokens, args.max_image_tokens,
                                 args.max_pixels, resize=args.resize, decode=args.decode))
    stream = enc.feeding(prepared(todo, args.workers, one, max_bytes=int(args.max_image_mib * 2**20)))

    def collect(group):
        """Wait until a launched group is computed and hand it to the writer."""
        entries, launched = group
        launched.wait()
        tokens = sum(info["tokens"] for b in entries for _, info in b)
        submit(write, entries, launched, nbytes=enc.geometry.embedding_bytes(tokens))

    running = None  # (keys and infos, Launched) of the group on the GPU
    try:
        with contextlib.closing(stream):  # an interrupted run stops the preparing threads too
            # Each group is launched before the one ahead of it is collected: the GPU never waits for the host.
            # (Two groups ahead measured no faster: docs/PERFORMANCE.md.)
            for group in groups(stream):
                launched = ([[(key, info) for key, _, _, info in b] for b in group],
                            enc.launch([[(im, grid, info) for _, im, grid, info in b] for b in group]))
                if running is not None:
                    collect(running)
                running = launched
            if running is not None:
                collect(running)
                running = None
    finally:
        if running is not None:  # interrupted: the group on the GPU is finished work too
            with contextlib.suppress(Exception):
                collect(running)
        writer.close()  # what was computed is written
        bar.close()  # here: left to exit, it would print after the line saying why a run stopped
    writer.check()
    dt = time.perf_counter() - t0
    failed += len(unusable)
    print(f"glmvit-encode: {counted(len(todo) - failed, 'image')}, {tokens_done} tokens in {dt:.1f} s "
          f"({(len(todo) - failed) / dt:.1f} images/s, {tokens_done / dt:.0f} tokens/s); {failed} failed; "
          + (f"{len(blocked)} without a --vllm-ec-dir file; " if blocked else "") + f"output in {shown(args.out)}")
    return FAILED if failed or blocked else DONE


if __name__ == "__main__":
    sys.exit(main())
