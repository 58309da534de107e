"""A request's images and videos on the host, for glmvit-serve: what each holds from admission to its pass
(read from file headers and containers, nothing decoded: the server admits a request against its pixels in
flight before decoding it), and their decoding on the decoding threads, or in processes of their own for
the formats whose decoder holds the GIL (OffProcess)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import multiprocessing
import os
import signal
import threading
import time
import warnings

from ..errors import ImageError
from ..preprocessing import decode
from ..preprocessing.decode import header_size, is_ico
from ..preprocessing import resample
from ..preprocessing.image import content_size, prepare_canvas, smart_resize
from ..preprocessing.video import plan_video, sample_frames
from ..preprocessing.video_files import FrameFiles, VideoFile
from .requests import Refused


LARGE_IMAGE_PIXELS = 1 << 24  # an image over this (16.8 MP) is decoded on at most all but one decoding thread


def quiet_libtiff() -> None:
    """libtiff's own error and warning handlers off in this process: they write every message to stderr
    ("ZIPDecode: Decoding error at scanline 0, incorrect data check."), a line in the server's log for each
    damaged TIFF a client sends; Pillow reads libtiff's return codes, not its messages, and names the image
    in the 422. The libtiff Pillow loaded is found among the process's mapped files (Linux; elsewhere, left
    as it is)."""
    import ctypes

    from PIL import Image  # noqa: F401 - loads Pillow's core, and with it its libtiff

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libtiff" in line}
        for path in paths:
            lib = ctypes.CDLL(path)
            for name in ("TIFFSetErrorHandler", "TIFFSetWarningHandler"):
                getattr(lib, name).restype = ctypes.c_void_p
                getattr(lib, name)(None)
    except (OSError, AttributeError):  # not Linux, or a libtiff without them: its messages stay
        pass


def _child_ignores_signals(server: int):
    """A decoding process leaves SIGINT and SIGTERM to the server (a terminal's Ctrl-C reaches the whole
    process group): the server ends it. It also ends once the server (process id `server`) is gone, however
    that ended (SIGKILL, the out-of-memory killer): a thread checks its parent every second. Pillow's warning
    that an icon's image is not the size its header says is not printed: the decoded size is what is checked
    against max_pixels and used."""
    warnings.filterwarnings("ignore", "Image was not the expected size", UserWarning)  # this process's own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch():
        while os.getppid() == server:
            time.sleep(1.0)
        os._exit(0)  # nobody is left to answer

    threading.Thread(target=watch, name="glmvit-orphan-watch", daemon=True).start()


class OffProcess:
    """decode.offload for the service: the formats not in decode.DECODED_IN_PROCESS (JPEG 2000, whose
    decoder holds the GIL; ICNS, ...) and images Pillow decodes in Python (a BMP's RLE) decoded in processes
    of their own, started on first use, so that the event loop and the other threads run meanwhile (one 81 MP
    JPEG 2000 froze the server for 12 s). The decoding thread that asked waits for it without the GIL."""

    def __init__(self, workers: int):
        self.workers, self._pool, self._lock, self._closed = workers, None, threading.Lock(), False

    def __call__(self, data: bytes, name: str, max_pixels):
        with self._lock:
            if self._closed:
                raise _stopping(name)
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(self.workers,
                                                                    mp_context=multiprocessing.get_context("spawn"),
                                                                    initializer=_child_ignores_signals,
                                                                    initargs=(os.getpid(),))
            pool = self._pool
        try:
            return pool.submit(decode.decode_rgb, data, name, max_pixels).result()
        except (concurrent.futures.process.BrokenProcessPool, concurrent.futures.CancelledError, RuntimeError) as e:
            # RuntimeError: submit after shutdown; CancelledError: a queued decode dropped by shutdown.
            with self._lock:
                if self._pool is pool:
                    self._pool = None
                closed = self._closed
            if closed:
                raise _stopping(name) from None
            if isinstance(e, concurrent.futures.process.BrokenProcessPool):  # killed (out of memory, say)
                raise ImageError(f"{name}: its decoder's process ended before the image was decoded "
                                 "(out of memory?)") from None
            raise

    def shutdown(self) -> None:
        """The decoding processes ended now (what they decode has no one to answer any more), none left; a
        decode asked for from now on, or cut short, is refused with 503."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            for process in list(getattr(pool, "_processes", {}).values()):  # no public way to end a busy one
                with contextlib.suppress(Exception):
                    process.kill()
            pool.shutdown(wait=False, cancel_futures=True)


def _stopping(name: str) -> Refused:
    return Refused(503, f"{name}: not decoded: the server is shutting down; retry on another server")


@functools.lru_cache(maxsize=None)
def have_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def dims(n: int, size) -> str:
    return f"{size[0]} x {size[1]} = {n:,}" if size else f"{n:,}"


def pixels_held(n: int, size, lo: int, hi: int, patching, frames: int | None = None) -> int:
    """What an image (or `frames` frames of one size) holds from admission to its pass: the largest of its
    decoded pixels (n), its canvas's (the canvas is made while the decoded image is still there) and its resize
    tables' at 4 bytes a pixel (far below the image's own for a photo; 80,864,000 for a 1 x 20,000,000 image).
    frames: a video's sampled frames (None: a still image)."""
    if size is None:
        return n
    w, h = size
    try:
        canvas = smart_resize(h, w, min_image_tokens=lo, max_image_tokens=hi, factor=patching.factor,
                              temporal_factor=patching.temporal_patch_size, num_frames=frames)
        ch, cw = content_size(h, w, canvas, min_image_tokens=lo, factor=patching.factor,
                              temporal_factor=patching.temporal_patch_size, num_frames=frames)
    except ValueError:  # the decode refuses it, saying why
        return n
    tables = (resample.table_bytes(w, cw) + resample.table_bytes(h, ch)) // 4
    return max(n, canvas[0] * canvas[1] * (frames or 1), tables)


# What each sampled video frame holds beside its pixels, in pixels of 4 bytes: its decoded array, the decoder's
# and PyAV's objects, its share of the float32 patch rows. Measured: 50,000 8 x 8 JPEG frames, sent to be
# encoded unsampled, raised the server's peak memory by 2.2 GB, ~45 KB a frame.
FRAME_OVERHEAD_PIXELS = 16384


def sampled_frames(total: int, fps, duration, common: dict):
    """The frame indices plan_video will take of `total` (None where it will refuse them, saying why)."""
    try:
        if not common["sample"]:
            return range(total)  # not a list: a file of millions of tiny packets would make one of them
        if fps is None:
            return None
        return [int(i) for i in sample_frames(total, fps, duration=duration, target_fps=common["target_fps"],
                                              max_frames=common["max_frames"], max_duration=common["max_duration"])]
    except (ValueError, TypeError):
        return None


def video_pixels(video: dict, index: int, common: dict, limit: int, max_video_pixels: int, patching,
                 icons: list | None = None, stop=None) -> int:
    """The pixels a request video holds from admission to its pass, read from its frame files' headers or its
    container (nothing decoded): its sampled frames', or their canvases' if more, and FRAME_OVERHEAD_PIXELS a
    frame; 0 where that cannot be told (decoding refuses it, saying why). A sampled frame file over
    --max-pixels is refused here (422). icons: gets one entry per sampled frame that is an ICO file (counted at
    --max-pixels: its header may understate it)."""
    if video["file"] is not None:
        try:
            from ..preprocessing.video_files import probe, timing

            w, h, total, file_fps, file_duration = probe(video["file"], f"video {index}", limit, video["fps"],
                                                         video["duration"], stop)
            fps, duration = timing(total, file_fps, file_duration, video["fps"], video["duration"])  # as read
        except Exception:  # noqa: BLE001  (fps 0, say: refused, saying why, when the video is read)
            return 0
        picked = sampled_frames(total, fps, duration, common)
        if picked is None:
            return 0
        unique = len(picked) if isinstance(picked, range) else len(set(picked))
        size, decoded = (w, h), unique * w * h
        if w <= 0 or h <= 0:  # a header of no size (0x0, or one FFmpeg found invalid): its frames are known only
            # decoded, and the decode holds each up to the frame limit, all of them up to max_video_pixels
            return min(unique * limit, max_video_pixels) + len(picked) * FRAME_OVERHEAD_PIXELS
    else:
        picked = sampled_frames(len(video["frames"]), video["fps"], video["duration"], common)
        if picked is None:
            return 0
        size, decoded = None, 0
        for j in sorted(set(picked)):
            n, frame_size = header_size(video["frames"][j], limit)
            if n > limit:
                raise Refused(422, f"videos[{index}].frames[{j}] has {dims(n, frame_size)} pixels, over the server's "
                                   f"limit of {limit:,} an image (--max-pixels): refused as a possible "
                                   "decompression bomb; send smaller frames", index)
            if frame_size is None and icons is not None and is_ico(video["frames"][j]):
                icons.append(j)
            size, decoded = size or frame_size, decoded + n
    if decoded > max_video_pixels:  # refused by the decode before it decodes anything
        return 0
    return pixels_held(decoded, size, common["min_image_tokens"], common["max_image_tokens"], patching,
                       len(picked)) + len(picked) * FRAME_OVERHEAD_PIXELS


def prepare_image(data: bytes, index: int, lo: int, hi: int, max_pixels, backend, patching):
    """One request image, on a decoding thread: decoded, sized and handed to the backend (its upload, where
    the GPU resizes: backend.ahead), so the engine thread has only the pass's launch left to do."""
    return backend.ahead(prepare_canvas(io.BytesIO(data), index, min_image_tokens=lo, max_image_tokens=hi,
                                        max_pixels=max_pixels, resize=backend.resize, patching=patching,
                                        name=f"image {index}"))  # as the request numbers it


def prepare_video(video: dict, index: int, common: dict, max_pixels, max_total_pixels, patching, stop=None):
    """One request video -> video.plan_video's (frames, grid, info): sampled first, then only the sampled
    frames decoded (frame files as images are, a video file by PyAV; what cannot be is an ImageError naming
    it); the backend makes their pixels."""
    source = (VideoFile(video["file"], max_total_pixels, max_pixels, stop) if video["file"] is not None else
              FrameFiles(video["frames"], max_pixels, max_total_pixels))
    return plan_video(source, index, fps=video["fps"], duration=video["duration"], patching=patching, **common)
