"""Host video preprocessor: decoded frames -> (pixel_values_videos [N, 1176] float32, video_grid_thw [n, 3] int64).

Bit-identical to transformers' Glm5NextVideoProcessor as it runs on the CPU (its torchvision backend): the
same frame sampling (frames at `target_fps` per second of the source, capped at max_frames, deduplicated,
made even), one canvas for all of a video's frames (smart_resize over the frame count, 240,000 tokens at
most by default), each frame resized to the content size by ATen's uint8 BICUBIC antialias path
(resample.aten_resize), zero padded bottom/right, normalised in float32 as (x - 255 mean) / (255 std), the
last frame repeated up to a multiple of the temporal patch, and patches in the same merge-block order as
images, temporal_patch_size consecutive frames a row. The tower encodes each group of temporal_patch_size
frames as an image of its own (grid (1, h, w)); a video's output is its groups' outputs in order.

Frames are what a decoder gives: a uint8 [T, H, W, 3] array, or a list of HxWx3 uint8 arrays or RGB PIL
images of one size; or a video file, read by video_files as the reference's decoder (torchcodec) reads
it.
"""

from __future__ import annotations

import math
import numbers
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..checks import check_positive, check_token_limits
from ..errors import TooShort, quoted
from . import resample
from .image import MEAN, REFERENCE, STD, Patching, check_patching, content_size, rows_in_turn, rows_out, smart_resize
from .video_files import FrameFiles, VideoFile, video_frames

TARGET_FPS = 2  # frames sampled per second of video (the reference processor's fps)
MAX_FRAMES = 2048
MIN_VIDEO_TOKENS = 16
STILL_IMAGES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")  # not video files (a GIF may be one)
MAX_VIDEO_TOKENS = 240_000  # the reference video processor's max_image_tokens: a video's total


# The video processor's fused rescale and normalise: mean and std as float32 tensors times 1 / (1/255) = 255
# (one float32 rounding each), then (x - mean') / std' in float32.
_MEAN_STD = (np.array(MEAN, dtype=np.float32) * np.float32(255.0), np.array(STD, dtype=np.float32) * np.float32(255.0))


def _value_table() -> np.ndarray:
    """float32 [3, 256]: what the video processor makes of each uint8 value, per channel (_MEAN_STD's steps); a
    lookup gives the same bits."""
    mean, std = _MEAN_STD
    return (np.arange(256, dtype=np.float32)[None, :] - mean[:, None]) / std[:, None]


_TABLE = _value_table()


def value_table() -> np.ndarray:
    """A copy of the float32 [3, 256] uint8 -> normalised-value table of video frames (the GPU's staging reads it)."""
    return _TABLE.copy()


def _positive_number(name: str, v, where: str) -> float:
    """v as a positive finite int, or float (any other real number: a Fraction, as PyAV gives a stream's rate),
    else ValueError naming it: also an integer past any float (10**400), which float arithmetic cannot take."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise ValueError(f"{where}: {name}={quoted(v)} must be a positive finite number")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f <= 0:
        raise ValueError(f"{where}: {name}={quoted(v)} must be a positive finite number")
    return int(v) if isinstance(v, numbers.Integral) else f


def _spread(start: int, end: int, want: int) -> list[int]:
    """np.linspace(start, end, want, dtype=int) as a list, the reference's spread of `want` frames, without
    making `want` values when that is more than the frames between start and end: spaced by at most one,
    the truncated values then hit every frame from start to end, which is all the caller keeps (unique).
    A max_frames of 10**9 would otherwise hold the interpreter for minutes and many GB."""
    if want > end - start:
        return list(range(start, end + 1))
    return np.linspace(start, end, want, dtype=int).tolist()


def sample_frames(total_frames: int, fps: float, *, duration: float | None = None, target_fps: float = TARGET_FPS,
                  max_frames: int = MAX_FRAMES, max_duration: float = 0) -> np.ndarray:
    """Indices of the frames the reference samples from a video of total_frames frames at fps frames a second
    (duration: the container's, in seconds, if known; else from the frame count). About target_fps frames a
    second of video, at most max_frames; max_duration > 0 caps the seconds counted. Unique, ascending, an
    even count (the last repeated when odd). ValueError when the video is too short to give any."""
    check_positive("sample_frames: total_frames", total_frames)
    fps = _positive_number("fps", fps, "sample_frames")
    target_fps = _positive_number("target_fps", target_fps, "sample_frames")
    check_positive("sample_frames: max_frames", max_frames)
    if duration is not None and (isinstance(duration, bool) or duration != 0):  # 0: unknown, as the reference reads it
        duration = _positive_number("duration", duration, "sample_frames")
    if max_duration != 0:
        max_duration = _positive_number("max_duration", max_duration, "sample_frames (0: no cap)")
    max_idx = total_frames - 1
    try:
        duration = duration or round(max_idx / fps) + 1  # the reference: metadata.duration or this
        max_seconds = int(duration)  # the cap below counts the source's whole seconds
        duration = duration if max_duration <= 0 else min(duration, max_duration)
        want = min(int(duration * target_fps), max_frames)
    except OverflowError:  # a duration or frame count past any float: no video lasts that long
        raise ValueError(f"sample_frames: fps={quoted(fps)}, duration={quoted(duration)} and target_fps="
                         f"{quoted(target_fps)} give a frame count past any float; pass the video's real fps and "
                         "duration") from None
    if total_frames < want:
        picked = _spread(0, max_idx, want)
    else:
        picked, second, step = [], 0, 1 / target_fps
        for i in range(total_frames):
            if i * (1 / fps) >= second:  # the frame's timestamp, as the reference computes it
                second += step
                picked.append(i)
                if second >= max_seconds:
                    break
    if len(picked) < want:
        start, end = (picked[0], picked[-1]) if picked else (0, max(max_idx, 0))
        picked = _spread(start, end, want)
    elif len(picked) > want:
        picked = _spread(0, max_idx, want)
    unique = list(dict.fromkeys(picked))
    if not unique:
        raise TooShort(f"sample_frames: a {total_frames}-frame video at {fps} fps lasts {duration} s, which "
                       f"gives no frame at target_fps={target_fps} (int(duration x target_fps) = {want})")
    if len(unique) % 2:
        unique.append(unique[-1])
    return np.array(unique, dtype=np.int64)


def normalise_patchify(frames_u8: np.ndarray, patching: Patching = REFERENCE,
                       out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [T, H, W, 3] canvases (T a multiple of temporal_patch_size) -> [T/tp * H/p * W/p, 3 tp p p] float32,
    rows in (frame group, merge block, patch) order, each row channel x frame x py x px; into `out` when given
    (a C-contiguous float32 array of that shape: a slice of several videos' rows, so none is copied again)."""
    P, M, T = check_patching(patching).patch_size, patching.merge_size, patching.temporal_patch_size
    t, hh, ww, c = frames_u8.shape
    if t % T or hh % patching.factor or ww % patching.factor:
        raise ValueError(f"normalise_patchify: {t} frames of {hh}x{ww} are not whole {T}-frame groups of "
                         f"{patching.factor}-pixel tokens")
    gt, gh, gw = t // T, hh // P, ww // P
    per_group = gh * gw
    out = rows_out(out, (gt * per_group, c * T * P * P)).reshape(gt * per_group, c, T * P * P)
    mean, std = _MEAN_STD

    def group(g):
        """Frame group g's rows: its bytes reordered (a quarter of the float traffic), then the table's own
        float32 steps on them: the same bits as looking each value up, 2x faster (the gather cost ~20 ns a
        value). NumPy lets go of the GIL in both, so groups run side by side."""
        p = frames_u8[g * T:(g + 1) * T].reshape(T, gh // M, M, P, gw // M, M, P, c)
        p = np.ascontiguousarray(p.transpose(1, 4, 2, 5, 7, 0, 3, 6))  # bh, bw, r, c, channel, tp, py, px
        rows = out[g * per_group:(g + 1) * per_group]
        np.subtract(p.reshape(per_group, c, T * P * P), mean[:c, None], out=rows, dtype=np.float32)
        np.divide(rows, std[:c, None], out=rows)

    if gt > 1:
        with ThreadPoolExecutor(min(gt, os.cpu_count() or 1, 16)) as pool:
            list(pool.map(group, range(gt)))
    elif gt:
        group(0)
    return out.reshape(gt * per_group, c * T * P * P)


def plan_video(video, index: int = 0, *, fps=None, sample: bool = True, duration=None,
               target_fps: float = TARGET_FPS, max_frames: int = MAX_FRAMES, max_duration: float = 0,
               min_image_tokens: int = MIN_VIDEO_TOKENS, max_image_tokens: int = MAX_VIDEO_TOKENS,
               patching: Patching = REFERENCE, name: str | None = None):
    """One video's checks, frame sampling and canvas, without its pixels -> (frames: the n sampled frames, a
    list of HxWx3 uint8 views of the given ones, nothing copied; grid (t, h, w); info as prepare_video's).
    video_canvases (host) or frame_groups (for the GPU) make its pixels. A video file's path (str or
    PathLike, or a video_files.VideoFile) is read by video_files.load_video: its container's fps and
    duration unless given, only the sampled frames decoded; a video_files.FrameFiles (its frames' image
    files) decodes only those too."""
    name = f"video {index}" if name is None else name
    check_patching(patching)
    if not isinstance(sample, (bool, np.bool_)):
        raise ValueError(f"{name}: sample={quoted(sample)} must be True (sample about target_fps frames a second) "
                         "or False (encode the frames as given)")
    try:
        min_image_tokens, max_image_tokens = check_token_limits(min_image_tokens, max_image_tokens, ordered=False)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if fps is not None:
        fps = _positive_number("fps", fps, name)
    if duration is not None and (isinstance(duration, (bool, np.bool_)) or duration != 0):  # 0: unknown
        duration = _positive_number("duration", duration, name)  # checked sampled or not: info records it
    def pick(total, fps, duration):  # the frames to use out of `total`
        if not sample:
            return np.arange(total, dtype=np.int64)
        if fps is None:
            raise ValueError(f"{name}: sampling frames needs the video's fps (frames a second); pass fps=, or "
                             "sample=False to encode the frames as given")
        try:
            return sample_frames(total, fps, duration=duration, target_fps=target_fps, max_frames=max_frames,
                                 max_duration=max_duration)
        except TooShort as e:
            raise e.within(name) from None
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    if isinstance(video, (str, os.PathLike)):
        if os.path.isfile(video) and os.path.splitext(os.fspath(video))[1].lower() in STILL_IMAGES:
            raise ValueError(f"{name}: {os.fspath(video)} is an image file, and a path is a video file: give a "
                             "video's frames decoded, as a list of HxWx3 uint8 arrays (np.asarray(Image.open(p)."
                             "convert('RGB')) each)")
        video = VideoFile(video)
    if isinstance(video, (FrameFiles, VideoFile)):  # files: only the sampled frames are decoded
        sampled, meta = video.read(pick, fps, duration, name)
        picked, fps = np.array(meta["frames_indices"], dtype=np.int64), meta["fps"]
        total, duration = meta["total_frames"], meta["duration"]
    else:
        frames = video_frames(video, name)
        total = len(frames)
        picked = pick(total, fps, duration)
        sampled = [frames[i] for i in picked]
    n, (height, width) = len(picked), sampled[0].shape[:2]
    factor, T = patching.factor, patching.temporal_patch_size
    try:
        canvas = smart_resize(height, width, min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens,
                              factor=factor, temporal_factor=T, num_frames=n)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    content = content_size(height, width, canvas, min_image_tokens=min_image_tokens, factor=factor,
                           temporal_factor=T, num_frames=n)
    grid = (-(-n // T), canvas[0] // patching.patch_size, canvas[1] // patching.patch_size)
    frame_tokens = grid[1] * grid[2] // patching.merge_size ** 2
    times = None if fps is None else [int(i) / fps for i in picked]
    if times is not None and not math.isfinite(times[-1]):  # a frame time past any float: inf in the metadata
        raise ValueError(f"{name}: fps={quoted(fps)} puts frame {int(picked[-1])} at a time past any float; "
                         "pass the video's real fps")
    info = {"source": name, "frames_indices": picked.tolist(), "timestamps": times,
            "size": (height, width), "canvas": canvas, "content": content, "grid": grid,
            "tokens": grid[0] * frame_tokens, "frame_tokens": frame_tokens, "fps": fps,
            "duration": None if duration is None else float(duration), "total_frames": total}
    return sampled, grid, info


def video_canvases(frames: list, grid, info: dict, temporal: int) -> np.ndarray:
    """A planned video's frames resized on the host (ATen's bytes) and zero padded to its canvas, the last
    frame repeated to whole temporal groups: uint8 [t * temporal, canvas h, canvas w, 3]."""
    n, (height, width) = len(frames), info["size"]
    (ch, cw), canvas = info["content"], info["canvas"]
    out = np.zeros((grid[0] * temporal, canvas[0], canvas[1], 3), dtype=np.uint8)
    if (ch, cw) == (height, width):
        out[:n, :ch, :cw] = frames
    else:
        def one(j):
            out[j, :ch, :cw] = resample.aten_resize(frames[j], ch, cw)

        with ThreadPoolExecutor(min(n, os.cpu_count() or 1, 16)) as pool:  # NumPy's loops let go of the GIL
            list(pool.map(one, range(n)))
    out[n:] = out[n - 1]  # the last frame repeated to a whole temporal group
    return out


def frame_groups(frames: list, grid, info: dict, temporal: int) -> list:
    """A planned video as the GPU stages it: one (FrameGroup, (1, h, w), item info) per temporal group, the
    sampled frames unresized (the last repeated to a whole group), item info with the "content" size to
    resize them to and the group's "tokens". Each group is an image of its own to the tower, so encoding
    the groups and joining their outputs gives the video's."""
    n = len(frames)
    return [(FrameGroup([frames[min(j, n - 1)] for j in range(lo, lo + temporal)]), (1, grid[1], grid[2]),
             {"source": f"{info['source']} frames {lo}..{lo + temporal - 1}", "content": info["content"],
              "tokens": info["frame_tokens"]}) for lo in range(0, grid[0] * temporal, temporal)]


class FrameGroup(list):
    """One temporal group's frames, HxWx3 uint8 arrays (views, not copies), staged into one row's frame
    slots; `shape` is the [frames, H, W, 3] they would stack to."""

    @property
    def shape(self) -> tuple:
        return (len(self), *self[0].shape) if self else (0,)


def prepare_video(video, index: int = 0, *, fps=None, sample: bool = True, duration=None,
                  target_fps: float = TARGET_FPS, max_frames: int = MAX_FRAMES, max_duration: float = 0,
                  min_image_tokens: int = MIN_VIDEO_TOKENS, max_image_tokens: int = MAX_VIDEO_TOKENS,
                  patching: Patching = REFERENCE, name: str | None = None):
    """One video -> (patches [t*h*w, patch_dim] float32, (t, h, w), info dict). info: "source", "frames_indices"
    (the frames used, as indices into the given ones), "timestamps" (seconds, index / fps; None without fps),
    "size", "canvas", "content", "grid", "tokens" (t*h*w / merge^2), "frame_tokens" (h*w / merge^2), "fps" and
    "duration" the sampling used (None where not known), "total_frames" (the frames sampled from)."""
    frames, grid, info = plan_video(video, index, fps=fps, sample=sample, duration=duration, target_fps=target_fps,
                                    max_frames=max_frames, max_duration=max_duration,
                                    min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens,
                                    patching=patching, name=name)
    return normalise_patchify(video_canvases(frames, grid, info, patching.temporal_patch_size), patching), grid, info


def _as_list(videos) -> list:
    """One video or a list of them: a list of videos holds 4-D arrays, lists of frames or video files' paths."""
    one = (str, os.PathLike, FrameFiles, VideoFile)
    if isinstance(videos, (np.ndarray, *one)):
        return [videos]
    if isinstance(videos, (list, tuple)) and videos and all(
            isinstance(v, (list, tuple, *one)) or (isinstance(v, np.ndarray) and v.ndim == 4) for v in videos):
        return list(videos)
    return [videos]


def plan_videos(videos, *, fps=None, sample: bool = True, duration=None, target_fps: float = TARGET_FPS,
                max_frames: int = MAX_FRAMES, max_duration: float = 0, min_image_tokens: int = MIN_VIDEO_TOKENS,
                max_image_tokens: int = MAX_VIDEO_TOKENS, patching: Patching = REFERENCE) -> list[tuple]:
    """plan_video for each of `videos` (as preprocess_video takes them), every video checked before any
    pixel is made: one (frames, grid, info) each."""
    videos = _as_list(videos)
    n = len(videos)

    def per_video(name, v):
        if isinstance(v, np.ndarray):  # one value a video, or one for all (0-d), as a list or a scalar would be
            v = v.tolist() if v.ndim == 1 else v[()] if v.ndim == 0 else v
        if isinstance(v, (list, tuple)):
            if len(v) != n:
                raise ValueError(f"preprocess_video: {name} has {len(v)} values for {n} videos")
            return list(v)
        return [v] * n

    fpss, durations = per_video("fps", fps), per_video("duration", duration)
    return [plan_video(video, i, fps=fpss[i], sample=sample, duration=durations[i], target_fps=target_fps,
                       max_frames=max_frames, max_duration=max_duration, min_image_tokens=min_image_tokens,
                       max_image_tokens=max_image_tokens, patching=patching) for i, video in enumerate(videos)]


def preprocess_video(videos, *, fps=None, sample: bool = True, duration=None, target_fps: float = TARGET_FPS,
                     max_frames: int = MAX_FRAMES, max_duration: float = 0,
                     min_image_tokens: int = MIN_VIDEO_TOKENS, max_image_tokens: int = MAX_VIDEO_TOKENS,
                     patching: Patching = REFERENCE) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """Videos -> (pixel_values_videos float32 [N, patch_dim], video_grid_thw int64 [n, 3], one info dict each),
    as the reference video processor with these settings (its names: fps is the source's, target_fps its
    `fps`, min/max_image_tokens a video's total). `videos`: one video (uint8 [T, H, W, 3] array or list of
    frames) or a list of them; fps and duration: one value for all or a list with one per video. With
    sample=False every frame given is used (the reference's do_sample_frames=False). info["timestamps"]
    are what a prompt needs (the reference labels each temporal group by its first frame's)."""
    plans = plan_videos(videos, fps=fps, sample=sample, duration=duration, target_fps=target_fps,
                        max_frames=max_frames, max_duration=max_duration, min_image_tokens=min_image_tokens,
                        max_image_tokens=max_image_tokens, patching=patching)
    return (*video_pixels(plans, patching), [i for _, _, i in plans])


def video_pixels(plans: list, patching: Patching = REFERENCE) -> tuple[np.ndarray, np.ndarray]:
    """plan_videos' plans -> (pixel_values_videos float32, video_grid_thw int64), made on the host."""
    T, grids = patching.temporal_patch_size, np.array([g for _, g, _ in plans], dtype=np.int64).reshape(-1, 3)
    try:
        pixels, parts = rows_in_turn(grids, 3 * T * patching.patch_size ** 2)  # RGB
        for (frames, grid, info), part in zip(plans, parts):
            normalise_patchify(video_canvases(frames, grid, info, T), patching, out=part)
    except MemoryError:
        big = max((info for _, _, info in plans), key=lambda info: info["tokens"])
        rows = int(grids.prod(axis=1).sum())
        raise MemoryError(f"{big['source']}: {big['tokens']:,} tokens ({len(big['frames_indices'])} frames on a "
                          f"{big['canvas'][0]} x {big['canvas'][1]} canvas); these videos' pixel rows need "
                          f"{rows * 3 * T * patching.patch_size ** 2 * 4 / 2**30:,.1f} GiB, more than this "
                          "machine can give: lower min_image_tokens or max_image_tokens") from None
    return pixels, grids
