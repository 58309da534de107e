"""What a video comes as -> its frames: decoded frames checked (video_frames), its frames' image files of
which only the sampled ones are decoded (FrameFiles), or a video file's sampled frames decoded by PyAV
(load_video; the `video` extra, imported only when a path is given).

As the reference video processor reads a path (HF transformers 5.23.0's fetch_videos: torchcodec's
VideoDecoder, seek_mode="exact", on the CPU): frames, duration and fps from a scan of the stream's packets,
the sampled indices (the caller's pick: video.plan_video passes the video processor's rule) kept from one
sequential decode in presentation order, each converted to RGB by FFmpeg's scale filter and turned upright
by its display rotation. Checked bit for bit against torchcodec 0.17 (tools/video_decoders.py; the golden
clips in tests/golden/video_files). Only the sampled frames are kept, so a long video costs its decoding
time, not its size in memory. Where FFmpeg's own versions differ (a decoder's output, a demuxer's packet
durations), torchcodec on another FFmpeg can differ too. HF's load_video(backend="pyav") reads otherwise
(the container's rate, no rotation, to_ndarray's colour conversion).
"""

from __future__ import annotations

import errno
import io
import math
import numbers
import os
from fractions import Fraction

import numpy as np
from PIL import Image

from ..errors import ImageError, Untimed
from .decode import header_size, pillow_limit


def _av():
    try:
        import av
    except ImportError as e:
        raise ImageError(f"reading video files needs PyAV: pip install -e '.[video]' in the glmvit-cupy checkout ({e}); or decode the "
                         "frames yourself and pass them as a uint8 [T, H, W, 3] array") from None
    return av


def _label(source) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"the video file of {len(source):,} bytes"
    return repr(os.fspath(source))


def _open(source, name: str, max_pixels: int | None = None):
    """source (a path, or a video file's bytes) opened by PyAV, its video stream (_stream) checked: frames of
    at most max_pixels pixels (None: Pillow's MAX_IMAGE_PIXELS, the images' decompression-bomb guard)."""
    av, label = _av(), _label(source)
    is_bytes = isinstance(source, (bytes, bytearray, memoryview))
    if not is_bytes and not os.path.isfile(source):
        what = ("a folder" if os.path.isdir(source) else "not a regular file" if os.path.lexists(source)
                else "not found (no such file)")
        raise ImageError(f"{name}: {label} is {what}; a video file was expected")
    try:
        # A path is made absolute: FFmpeg reads "take:2.mp4" or "http:x.mp4" as a protocol's URL, "/.../take:2.mp4"
        # as the file.
        # No protocol for a file's bytes (a server's client sent them): a demuxer that opens other files or URLs
        # named inside it (FFmpeg's concat script, probed from its content: "ffconcat version 1.0\nfile x.mp4")
        # would otherwise read the server's own files, relative to its working folder. A path: local files only.
        container = av.open(io.BytesIO(bytes(source)) if is_bytes else os.path.abspath(os.fspath(source)),
                            container_options={"protocol_whitelist": "none" if is_bytes else "file"})
    except (av.FFmpegError, OSError, ValueError) as e:
        try:
            empty = len(memoryview(source).cast("B")) == 0 if is_bytes else os.path.getsize(source) == 0
        except (OSError, TypeError, ValueError):
            empty = False
        if empty:  # FFmpeg says only "Invalid data found when processing input"
            raise ImageError(f"{name}: {label} is empty (0 bytes); a video file was expected") from None
        raise ImageError(f"{name}: cannot open {label} as a video ({e})") from None
    if not container.streams.video:
        container.close()
        raise ImageError(f"{name}: {label} has no video stream")
    stream = _stream(container)
    if stream.codec_context is None:  # PyAV has no decoder for it (a damaged header, an unknown codec)
        container.close()
        raise ImageError(f"{name}: {label}'s video stream cannot be decoded (no decoder for its codec, or a "
                         "damaged header)")
    limit = pillow_limit() if max_pixels is None else max_pixels
    if stream.width * stream.height > limit:  # each kept frame is 3 bytes a pixel
        container.close()
        raise ImageError(f"{name}: {label} has {stream.width}x{stream.height} frames, over the {limit:,} pixels a "
                         "decoded image may have (max_pixels, the images' decompression-bomb guard: the "
                         "commands' --max-pixels raises it)")
    # And every frame it decodes, sampled or not, whatever its header declared: FFmpeg refuses a larger one
    # before it allocates it (a stream of 64x64 frames can hold a 15000x15000 one). FFmpeg checks its own
    # buffer's size, rows padded to up to 64 pixels: the slack keeps the declared size, within the limit, in.
    slack = 64 * max(stream.width + stream.height, 16384)
    stream.codec_context.options = {**stream.codec_context.options, "max_pixels": str(limit + slack)}
    return container


def _positive(v) -> bool:
    """A caller's fps or duration that can stand for a file's (0 means "unknown", as sample_frames takes it; an
    integer past any float is none)."""
    try:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    except OverflowError:
        return False


def _stream(container):
    """The video stream the reference decodes: FFmpeg's best one (av_find_best_stream, as torchcodec asks), not
    the first: a still cover picture or thumbnail stored as a 1-frame stream can come before the video."""
    return container.streams.best("video") or container.streams.video[0]


def probe(source, name: str = "video", max_pixels: int | None = None, fps=None, duration=None, stop=None
          ) -> tuple[int, int, int, float | None, float]:
    """(width, height, frames, fps, duration in seconds) of a video file's video stream (_stream), as the
    reference processor's decoder reads them (torchcodec, seek_mode="exact"): a scan of the stream's packets,
    nothing decoded. Frames over max_pixels (None: Pillow's limit) are refused as the decode refuses them. fps /
    duration: a caller's, as load_video takes them: where one is given, packets that span no time are read
    (fps None), as load_video reads them. stop: a threading.Event that ends the scan early (Dropped)."""
    with _open(source, name, max_pixels) as container:
        stream = _stream(container)
        return (stream.width, stream.height,
                *_probe(container, stream, source, name, _positive(fps) or _positive(duration), stop))


class Dropped(ImageError):
    """A read stopped by its caller's stop event (the request it was for went away)."""


STOP_EVERY = 1 << 14  # packets scanned between looks at the stop event (~50 ms)


def _stopped(stop, name) -> None:
    if stop is not None and stop.is_set():
        raise Dropped(f"{name}: not read: the request it came with was dropped")


def _probe(container, stream, source, name, timing_given: bool = False, stop=None, found: dict | None = None):
    """(frames, fps, duration), and found["start"] = the earliest pts (None: none) where found is given: frames =
    the stream's packets (less those flagged discard), duration = the latest pts + duration less the earliest
    pts, fps = frames / duration. A container's own frame count and rate can differ from these
    (variable frame rate, a count it never wrote): the reference samples by these."""
    av = _av()
    frames, first, end = 0, None, None
    try:
        for packet in container.demux(stream):
            if not packet.size or getattr(packet, "is_discard", False):  # size 0: the demuxer's last, empty one
                continue
            pts = packet.pts if packet.pts is not None else packet.dts
            frames += 1
            if not frames % STOP_EVERY:
                _stopped(stop, name)
            if pts is not None:
                first = pts if first is None else min(first, pts)
                end = pts + (packet.duration or 0) if end is None else max(end, pts + (packet.duration or 0))
    except Dropped:  # its request went away: said as it is
        raise
    except (av.FFmpegError, OSError, ValueError) as e:  # a damaged or truncated container
        raise ImageError(f"{name}: reading the packets of {_label(source)} failed after {frames} ({e})") from None
    try:
        container.seek(0)
    except (av.FFmpegError, OSError, ValueError) as e:  # a raw stream (an H.264 elementary stream, say)
        if frames == 0:  # or nothing readable at all
            raise ImageError(f"{name}: {_label(source)} holds no video packet that can be read ({e} going back to "
                             "its start): the file is damaged or empty") from None
        raise ImageError(f"{name}: {_label(source)} read to its end ({frames} packets) but cannot go back to its "
                         f"start ({e}): a raw stream without a container? Put it in one (MP4, MKV)") from None
    kind = container.format  # an image reader (png_pipe, jpeg_pipe, image2) reads concatenated images as frames
    if frames == 1 and (kind.name == "image2" or kind.name.endswith("_pipe")):
        raise ImageError(f"{name}: {_label(source)} is a still image ({kind.long_name}), not a video file; a video "
                         "given as images is a list of its frames")
    tb = stream.time_base  # each end in seconds, then subtracted: the reference's float64 steps, bit for bit
    duration = end * tb.numerator / tb.denominator - first * tb.numerator / tb.denominator if first is not None else 0.0
    if frames <= 0 or (duration <= 0 and not timing_given):
        said = f"{name}: {_label(source)} holds {frames} video frames over {duration:g} s; cannot sample it"
        raise Untimed(said) if frames > 0 else ImageError(said)
    if found is not None:
        found["start"] = first
    return frames, (frames / duration if duration > 0 else None), duration


def timing(total: int, file_fps, file_duration: float, fps=None, duration=None) -> tuple:
    """(fps, duration) a video is sampled by: the caller's where given, else the file's (probe's); a caller's
    fps alone gives duration = frames / fps, and where the file's packets span no time (file_fps None) the
    caller's fps or duration stands for its own. ZeroDivisionError or TypeError for a caller's fps of 0 or
    a missing timing, which load_video refuses before it gets here."""
    if file_fps is None:
        fps = fps if _positive(fps) else total / duration
    if duration is None or (duration == 0 and fps is None):  # 0: unknown, as sample_frames takes it
        duration = file_duration if fps is None else total / fps
    return (file_fps if fps is None else fps), duration


def load_video(source, pick, *, fps=None, duration=None, name: str = "video", max_total_pixels: int | None = None,
               max_pixels: int | None = None, stop=None):
    """A video file (path or bytes) -> (frames: HxWx3 uint8 arrays, those at pick(total, fps, duration)'s
    indices, in its order; meta: {"fps", "duration", "total_frames", "frames_indices"}). fps / duration: the
    caller's where the file's are wrong (None: the file's, as _probe reads them; a caller's fps alone gives
    duration = frames / fps).
    max_total_pixels: a cap on the picked frames' pixels together, checked before decoding by the stream's
    declared size and while decoding by each kept frame's own (a header of 0x0, or smaller than its frames,
    cannot let more through); max_pixels: one frame's (None: Pillow's MAX_IMAGE_PIXELS). A container
    whose frame count is more than it holds is picked from again over the frames it holds. ImageError
    naming the file for anything that cannot be read; pick's own errors pass through."""
    with _open(source, name, max_pixels) as container:  # one open: probed, then decoded (twice if the count was high)
        stream = _stream(container)
        declared = (stream.width, stream.height)  # as _open checked it; a scan of the packets can change it
        found = {}
        total, file_fps, file_duration = _probe(container, stream, source, name, _positive(fps) or _positive(duration),
                                                stop, found)
        start = found.get("start")
        stream.thread_type = "AUTO"  # frame threads: decoding is the cost
        own_duration = duration is None  # the file's, or frames / the caller's fps
        fps, duration = timing(total, file_fps, file_duration, fps, duration)
        if not math.isfinite(duration) and not own_duration:
            raise ValueError(f"{name}: duration={duration!r} is not a finite number of seconds; give the video's "
                             "real duration (or leave it out: the file's own)")
        if not math.isfinite(duration):  # a caller's fps of 1e-308, say
            raise ValueError(f"{name}: fps={fps:g} makes its {total} frames last longer than any number of seconds; "
                             "give the video's real fps (or leave it out: the file's own)")
        indices = pick(total, fps, duration)
        unique = len(set(int(i) for i in indices))
        if max_total_pixels is not None and unique * declared[0] * declared[1] > max_total_pixels:
            raise ImageError(f"{name}: its {unique} sampled frames have {unique * declared[0] * declared[1]:,} "
                             f"pixels, over the limit of {max_total_pixels:,} (the commands' --max-video-pixels); a shorter "
                             "or smaller video fits")
        kept, decoded = _decode(container, stream, source, name, indices, declared, max_pixels, max_total_pixels,
                                start, stop)
        if len(kept) < unique and decoded < total:  # the count was high: pick again from what is there
            total = decoded
            duration = total / fps if own_duration else duration
            indices = pick(total, fps, duration)
            kept = None  # the first pass's frames let go of before the second's are kept
            kept, _ = _decode(container, stream, source, name, indices, declared, max_pixels, max_total_pixels,
                              start, stop)
    missing = sorted(set(int(i) for i in indices) - set(kept))
    if missing:  # the file decodes differently from one pass to the next
        raise ImageError(f"{name}: decoding {_label(source)} gave no frame {missing[0]} of the {total} it has")
    meta = {"fps": float(fps), "duration": float(duration), "total_frames": total,
            "frames_indices": [int(i) for i in indices]}
    return [kept[int(i)] for i in indices], meta


class VideoFile:
    """A video file (a path, or its bytes) with a cap on its sampled frames' pixels together and on one frame's
    (max_pixels), for plan_video (a plain path is one with no cap together and Pillow's for a frame)."""

    def __init__(self, source, max_total_pixels: int | None = None, max_pixels: int | None = None, stop=None):
        if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
            raise ImageError(f"VideoFile: a path or a video file's bytes expected, got {type(source).__name__}")
        self.source, self.max_total_pixels, self.max_pixels, self.stop = source, max_total_pixels, max_pixels, stop

    def read(self, pick, fps, duration, name: str):
        return load_video(self.source, pick, fps=fps, duration=duration, name=name,
                          max_total_pixels=self.max_total_pixels, max_pixels=self.max_pixels, stop=self.stop)


def _decode(container, stream, source, name, indices, declared, max_pixels, max_total_pixels=None, start=None,
            stop=None) -> tuple[dict, int]:
    """({index: HxWx3 uint8} for the wanted indices that decoding reached, frames decoded), one sequential
    pass from the start, stopping after the last wanted frame; each kept frame converted by _RGB. max_pixels:
    the frame limit _open gave FFmpeg (None: Pillow's), which an error names; max_total_pixels: the kept
    frames' pixels together, counted at their decoded size (None: no cap), refused before the frame that
    passes it is kept."""
    av = _av()
    wanted, kept, last, i = set(int(j) for j in indices), {}, int(indices[-1]), -1
    rgb = _RGB(av, name, source)
    (dw, dh), first, changed = declared, None, None  # the header's size, which the limits were checked by
    held, over = 0, False  # the kept frames' pixels as decoded: a header of 0x0 checked nothing before
    try:
        if start is not None and start < 0:  # frames before 0 (timestamps that wrapped): seek(0) would pass them
            container.seek(start, stream=stream)  # as the reference seeks to its scan's first frame
        else:
            container.seek(0)
        for i, frame in enumerate(container.decode(stream)):
            if not i % 256:
                _stopped(stop, name)
            if i in wanted:  # stopped at the first sampled frame of another size: none such is ever kept
                size = (frame.width, frame.height)
                first = first or size
                if size != first or (dw * dh and size[0] * size[1] > dw * dh):
                    changed = size
                    break
                held += size[0] * size[1]
                if max_total_pixels is not None and held > max_total_pixels:
                    over = True
                    break
                kept[i] = rgb(frame)
            if i >= last:
                break
    except ImageError:  # a frame refused by name (_RGB): said as it is
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        if getattr(e, "errno", None) == errno.EINVAL:  # as FFmpeg refuses a frame past max_pixels (_open)
            limit = pillow_limit() if max_pixels is None else max_pixels
            raise ImageError(f"{name}: decoding {_label(source)} failed at frame {i + 1} ({e}): a frame larger than "
                             f"the {limit:,} pixels a decoded image may have (max_pixels, the commands' "
                             "--max-pixels), or a damaged one") from None
        raise ImageError(f"{name}: decoding {_label(source)} failed after {i + 1} frames ({e})") from None
    if over:
        said = "" if first == (dw, dh) else f", though its stream declares {dw}x{dh} frames"
        raise ImageError(f"{name}: {_label(source)}'s sampled frames pass the limit of {max_total_pixels:,} pixels "
                         f"together at frame {i}: {len(kept) + 1} of {first[0]}x{first[1]} hold {held:,}{said} "
                         "(max_total_pixels: the commands' --max-video-pixels raises it); a shorter or smaller video "
                         "fits")
    if changed is not None and changed != first:
        raise ImageError(f"{name}: {_label(source)} changes its frame size mid-stream ({first[0]}x{first[1]} and "
                         f"{changed[0]}x{changed[1]} among the sampled frames); a video's frames share one size")
    if changed is not None:
        raise ImageError(f"{name}: {_label(source)} declares {dw}x{dh} frames, but its frame {i} is {changed[0]}x"
                         f"{changed[1]}; the file is damaged or forged")
    if not kept:
        raise ImageError(f"{name}: {_label(source)} gave no frame to decode")
    shapes = sorted({f.shape for f in kept.values()})  # upright: a rotation that changes between frames too
    if len(shapes) > 1:
        raise ImageError(f"{name}: {_label(source)} changes its frame size mid-stream ({shapes[0][1]}x"
                         f"{shapes[0][0]} and {shapes[1][1]}x{shapes[1][0]} among the sampled frames, turned "
                         "upright); a video's frames share one size")
    return kept, i + 1


class _RGB:
    """A decoded frame -> HxWx3 uint8 RGB as the reference's decoder (torchcodec on the CPU) makes it: FFmpeg's
    scale filter with its default (bicubic) flags to rgb24, then turned upright by the frame's display
    rotation (phones store portrait video as landscape frames and a rotation). Why not PyAV's
    to_ndarray(format="rgb24"): it converts 10- and 12-bit frames another way (up to ~150 levels apart at
    chroma edges) and ignores the rotation. One filter graph per frame format and size."""

    def __init__(self, av, name, source):
        self.av, self.name, self.source, self.key, self.graph = av, name, source, None, None

    def _build(self, frame):
        g = self.av.filter.Graph()
        chain = [g.add_buffer(width=frame.width, height=frame.height, format=frame.format,
                              time_base=frame.time_base or Fraction(1, 1000)),
                 g.add("scale", "flags=bicubic"), g.add("format", "rgb24"), g.add("buffersink")]
        for a, b in zip(chain, chain[1:]):
            a.link_to(b)
        g.configure()
        return g

    def __call__(self, frame) -> np.ndarray:
        key = (frame.format.name, frame.width, frame.height)
        if key != self.key:
            self.graph, self.key = self._build(frame), key
        self.graph.push(frame)
        out = self.graph.pull().to_ndarray()
        rotation = getattr(frame, "rotation", 0) or 0  # degrees counter-clockwise
        if not -360 <= rotation <= 360:  # PyAV's INT_MIN for a matrix that is no rotation (all zeros, say)
            raise ImageError(f"{self.name}: {_label(self.source)}'s display matrix is not a rotation (PyAV reads it "
                             f"as {rotation} degrees): write it again with a rotation (FFmpeg 6 and up: ffmpeg "
                             "-display_rotation 0 -i FILE -c copy OUT)")
        if rotation % 90:
            raise ImageError(f"{self.name}: {_label(self.source)} asks for its frames to be shown rotated by "
                             f"{rotation} degrees; only multiples of 90 can be applied")
        turns = round(rotation / 90) % 4
        return np.ascontiguousarray(np.rot90(out, turns)) if turns else out


class FrameFiles:
    """A video given as its frames' image files (paths or encoded bytes, in order). plan_video decodes only
    the frames its sampling picks (decode.load: the same checks and errors as images, named "video i frame
    j"); max_pixels: each frame's decompression-bomb guard (None: Pillow's); max_total_pixels: a cap on the
    picked frames' pixels together, read from their headers before any is decoded (None: no cap)."""

    def __init__(self, files, max_pixels: int | None = None, max_total_pixels: int | None = None):
        if not isinstance(files, (list, tuple)) or not files:
            raise ImageError(f"FrameFiles: a non-empty list of image files expected, got {type(files).__name__}")
        self.files, self.max_pixels, self.max_total_pixels = list(files), max_pixels, max_total_pixels

    def __len__(self):
        return len(self.files)

    def read(self, pick, fps, duration, name: str):
        """(the picked frames as HxWx3 uint8 arrays, {"fps", "duration", "total_frames", "frames_indices"}) for
        pick(len, fps, duration)."""
        from .decode import load

        indices = [int(i) for i in pick(len(self.files), fps, duration)]
        unique = sorted(set(indices))
        if self.max_total_pixels is not None:
            # An ICO or ICNS frame counts as the decode's limit, as glmvit-serve's admission counts it.
            bound = self.max_pixels if self.max_pixels is not None else pillow_limit()
            total = sum(header_size(self.files[j], bound)[0] for j in unique)
            if total > self.max_total_pixels:
                raise ImageError(f"{name}: its {len(unique)} sampled frames have {total:,} pixels, over the limit "
                                 f"of {self.max_total_pixels:,}; send fewer or smaller frames")
        decoded = {}
        for j in unique:
            f = np.asarray(load(self.files[j], f"{name} frame {j}", self.max_pixels))
            first = decoded[unique[0]] if decoded else f
            if f.shape != first.shape:
                raise ImageError(f"{name}: frame {j} is {f.shape[1]}x{f.shape[0]}, frame {unique[0]} "
                                 f"{first.shape[1]}x{first.shape[0]}; a video's frames share one size")
            decoded[j] = f
        return [decoded[j] for j in indices], {"fps": fps, "duration": duration, "total_frames": len(self.files),
                                               "frames_indices": indices}


def video_frames(video, name: str) -> np.ndarray:
    """One video's frames as a uint8 [T, H, W, 3] array (a view where it already is one), or ImageError
    naming the video and what would be right."""
    if isinstance(video, np.ndarray):
        frames = video
    elif isinstance(video, (list, tuple)):
        if not video:
            raise ImageError(f"{name}: a video needs at least one frame, got an empty list")
        arrays = []
        for j, f in enumerate(video):
            if isinstance(f, Image.Image):
                if f.mode != "RGB":
                    raise ImageError(f"{name}: frame {j} is a {f.mode} PIL image; give RGB frames "
                                     "(frame.convert('RGB'))")
                f = np.asarray(f)
            if not isinstance(f, np.ndarray) or f.ndim != 3:
                raise ImageError(f"{name}: frame {j} is {type(f).__name__} {getattr(f, 'shape', '')}; each frame "
                                 "must be an HxWx3 uint8 array or an RGB PIL image")
            if f.dtype != np.uint8:
                raise ImageError(f"{name}: frame {j} is {f.dtype}; give uint8 RGB frames (as a decoder gives them)")
            if arrays and f.shape != arrays[0].shape:
                raise ImageError(f"{name}: frame {j} is {f.shape[1]}x{f.shape[0]}, frame 0 "
                                 f"{arrays[0].shape[1]}x{arrays[0].shape[0]}; a video's frames share one size")
            arrays.append(f)
        frames = np.stack(arrays)
    else:
        raise ImageError(f"{name}: a video is a uint8 [frames, height, width, 3] array, a list of frames or a "
                         f"video file's path, got {type(video).__name__}")
    if frames.dtype != np.uint8:
        raise ImageError(f"{name}: frames are {frames.dtype}; give uint8 RGB frames (as a decoder gives them)")
    if frames.ndim != 4 or frames.shape[3] != 3 or 0 in frames.shape:
        raise ImageError(f"{name}: frames have shape {frames.shape}; a video is [frames, height, width, 3] uint8 "
                         "RGB with at least one frame of at least 1x1")
    return frames
