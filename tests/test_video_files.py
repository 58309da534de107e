"""Video files (video_files.load_video, through plan_video / preprocess_video): lossless clips written with
PyAV, read back as the same frames the array path samples, containers with and without a frame count, a
count higher than the file holds, and files that cannot be read refused by name."""

import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from glmvit_cupy import ImageError, preprocess_video
from glmvit_cupy.preprocessing import video_files
from glmvit_cupy.preprocessing.video import plan_video

av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")

GOLDEN = Path(__file__).parent / "golden" / "video_files"
CLIPS = {k: v for k, v in json.loads((GOLDEN / "golden.json").read_text()).items()}


def write(path, frames, fps=30, codec="ffv1", pix="bgr0"):
    """A lossless clip: decoding gives `frames` back bit for bit."""
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path


def clip(n, h=42, w=58, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


# Matroska's millisecond timestamps end the 95th frame at 3.166 s, so fps = 95 / 3.166 (torchcodec's too).
@pytest.mark.parametrize("ext,codec,pix,duration", [("mkv", "ffv1", "bgr0", 3.166), ("avi", "ffv1", "bgr0", 95 / 30),
                                                    ("mov", "png", "rgb24", 95 / 30)])
def test_a_file_gives_the_frames_the_array_path_samples(tmp_path, ext, codec, pix, duration):
    """Frames, duration and fps from the packets' timestamps (as torchcodec scans them); the sampled frames,
    indices, timestamps and canvas equal plan_video of the decoded array at that fps and duration."""
    frames = clip(95)  # 95 frames at 30 fps: 3.17 s, ~6 sampled at 2 fps
    path = write(tmp_path / f"clip.{ext}", frames, codec=codec, pix=pix)
    fps = 95 / duration
    assert video_files.probe(path) == (58, 42, 95, fps, duration)
    got, grid, info = plan_video(path, max_image_tokens=400)
    want, wgrid, winfo = plan_video(frames, fps=fps, duration=duration, max_image_tokens=400)
    assert grid == wgrid and info == winfo and len(got) == len(want)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert info["frames_indices"][0] == 0 and info["timestamps"] == [i / fps for i in info["frames_indices"]]
    every, meta = video_files.load_video(path, lambda total, fps, duration: np.arange(total))
    assert np.array_equal(np.stack(every), frames) and meta["frames_indices"] == list(range(95))
    _, every_info = plan_video(path, sample=False)[1:]
    assert every_info["frames_indices"] == list(range(95))


def test_lists_of_files_and_settings_as_for_arrays(tmp_path):
    a, b = clip(40, seed=1), clip(12, 30, 30, seed=2)
    paths = [write(tmp_path / "a.mkv", a, fps=10), str(write(tmp_path / "b.avi", b, fps=4))]  # PathLike and str
    pv, grid, infos = preprocess_video(paths, target_fps=4, max_image_tokens=300)
    pw, gw, iw = preprocess_video([a, b], fps=[10.0, 4.0], duration=[4.0, 3.0], target_fps=4, max_image_tokens=300)
    assert np.array_equal(pv, pw) and np.array_equal(grid, gw)
    assert [i["frames_indices"] for i in infos] == [i["frames_indices"] for i in iw]
    one = preprocess_video(paths[0], fps=5.0, target_fps=4)  # the caller's fps over the container's
    assert one[2][0]["timestamps"] == [i / 5 for i in one[2][0]["frames_indices"]]


def test_a_frame_count_higher_than_the_file_holds_is_sampled_again(tmp_path, monkeypatch):
    """101 frames claimed, 61 held: the first sampling wants frames past the end, so it samples the 61."""
    frames = clip(61)
    path = write(tmp_path / "c.avi", frames)
    real = video_files._probe
    monkeypatch.setattr(video_files, "_probe",
                        lambda *a: (lambda t, f, d: (t + 40, f, (t + 40) / f))(*real(*a)))
    from glmvit_cupy.preprocessing.video import sample_frames

    asked = []
    got, meta = video_files.load_video(path, lambda *a: asked.append(a) or sample_frames(*a[:2], duration=a[2]))
    assert asked == [(101, 30.0, 101 / 30), (61, 30.0, 61 / 30)]
    assert meta["total_frames"] == 61 and meta["duration"] == 61 / 30
    want = sample_frames(61, 30.0, duration=61 / 30)
    assert meta["frames_indices"] == want.tolist() and np.array_equal(np.stack(got), frames[want])


def test_files_that_cannot_be_read_are_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(ImageError, match=r"video 0: '.*nope.mp4' is not found \(no such file\); a video file"):
        plan_video(tmp_path / "nope.mp4")
    (tmp_path / "clips.mp4").mkdir()
    with pytest.raises(ImageError, match=r"video 0: '.*clips.mp4' is a folder; a video file was expected"):
        plan_video(tmp_path / "clips.mp4")
    (tmp_path / "text.mp4").write_text("not a video at all")
    with pytest.raises(ImageError, match=r"video 0: cannot open '.*text.mp4' as a video"):
        plan_video(tmp_path / "text.mp4")
    (tmp_path / "empty.mkv").write_bytes(b"")  # FFmpeg's "Invalid data found" named what it is, as for an image
    with pytest.raises(ImageError, match=r"video 0: '.*empty.mkv' is empty \(0 bytes\); a video file was expected"):
        plan_video(tmp_path / "empty.mkv")
    with pytest.raises(ImageError, match=r"video 0: the video file of 0 bytes is empty \(0 bytes\)"):
        plan_video(video_files.VideoFile(b""))
    short = write(tmp_path / "short.mkv", clip(2), fps=30)
    with pytest.raises(ValueError, match=r"video 1: sample_frames: a 2-frame video at 30\.30[0-9]* fps lasts 0\.066 s, "
                                         r".* gives no frame"):  # mkv's millisecond timestamps: 2 frames in 66 ms
        preprocess_video([write(tmp_path / "ok.mkv", clip(8), fps=4), short])
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 42 * 58 - 1)  # the decompression-bomb guard, as for images
    with pytest.raises(ImageError, match=r"video 0: '.*ok.mkv' has 58x42 frames, over the 2,435 pixels .*"
                                         r"the commands' --max-pixels raises it"):
        plan_video(tmp_path / "ok.mkv", fps=4.0)
    assert plan_video(video_files.VideoFile(tmp_path / "ok.mkv", max_pixels=42 * 58), fps=4.0)[1][0] >= 1  # it reads
    with pytest.raises(ImageError, match=r"has 58x42 frames, over the 1,000 pixels"):  # and lowered alike
        plan_video(video_files.VideoFile(tmp_path / "ok.mkv", max_pixels=1000), fps=4.0)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(ImageError, match=r"reading video files needs PyAV: pip install -e '\.\[video\]'"):
        plan_video(short)


def test_a_video_file_as_bytes_and_its_pixel_cap(tmp_path):
    """VideoFile: the file's bytes read as the path is; the sampled frames' pixels capped before decoding."""
    frames = clip(50)
    path = write(tmp_path / "d.mkv", frames, fps=10)
    want = plan_video(path)
    data = path.read_bytes()
    got = plan_video(video_files.VideoFile(data))
    assert got[1:] == want[1:] and all(np.array_equal(a, b) for a, b in zip(got[0], want[0]))
    n = len(set(want[2]["frames_indices"]))
    with pytest.raises(ImageError, match=f"video 0: its {n} sampled frames have {n * 42 * 58:,} pixels, over the "
                                         f"limit of {n * 42 * 58 - 1:,}"):
        plan_video(video_files.VideoFile(data, max_total_pixels=n * 42 * 58 - 1))
    with pytest.raises(ImageError, match="video 0: cannot open the video file of 9 bytes as a video"):
        plan_video(video_files.VideoFile(b"not a mp4"))
    with pytest.raises(ImageError, match="VideoFile: a path or a video file's bytes expected, got int"):
        video_files.VideoFile(3)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "TIFF"])
def test_a_still_image_as_a_video_file_is_refused_saying_what_it_is(tmp_path, fmt):
    """An image file's bytes (as glmvit-serve gets a video file) or one named like a video decoded as a one-frame
    video, where a path named like an image is refused: each is refused now, saying it is a still image."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(clip(1)[0]).save(buf, fmt)
    (tmp_path / "a.mp4").write_bytes(buf.getvalue())
    for source in (video_files.VideoFile(buf.getvalue()), tmp_path / "a.mp4"):
        with pytest.raises(ImageError, match=r"video 0: .* is a still image \(.*\), not a video file; a video given as "
                                             r"images is a list of its frames"):
            plan_video(source, fps=2.0)
    Image.fromarray(clip(1)[0]).save(tmp_path / "a.gif")  # a GIF may be a video: read as one
    assert plan_video(tmp_path / "a.gif", fps=2.0, sample=False)[1][0] == 1
    if fmt in ("PNG", "JPEG"):  # images one after another (a camera's MJPEG dump, image2pipe): a video of them
        frames = []
        for f in clip(8, seed=1):
            one = io.BytesIO()
            Image.fromarray(f).save(one, fmt)
            frames.append(one.getvalue())
        got = plan_video(video_files.VideoFile(b"".join(frames)), sample=False)
        assert len(got[0]) == 8 and got[2]["total_frames"] == 8


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_clips_read_as_the_reference_processor_reads_them(name):
    """Clips written by FFmpeg's own encoders (10-bit H.264, HEVC HLG and VP9; display rotations of 90, 180 and
    270 degrees; a stream starting at 1.3 s; 29.97 fps with B-frames; a Matroska file whose first video
    stream is a one-frame cover picture, the clip second), against what torchcodec 0.17 (the
    decoder HF's processor opens a path with) made of them (tools/video_decoders.py --golden): the frame
    count, fps and duration to the last bit, every frame's RGB bytes, and the processor's grid, sampled
    frames and pixels given the path. PyAV's plain to_ndarray and the container's rate fail all six: 10-bit
    frames up to ~150 levels off, rotated videos sideways, the offset clip's frames (1.4999999999999998 s, as
    2.8 - 1.3, gives 2 frames at 2 fps, not 3), the 29.97 fps clip's fps in its last bits (30000 / 1001 against
    torchcodec's 15 / 0.5005), and the cover picture read as a 1-frame video (FFmpeg's best stream is the
    clip)."""
    want, path = CLIPS[name], GOLDEN / name
    assert video_files.probe(path)[2:] == (want["frames"], want["fps"], want["duration"])
    frames, meta = video_files.load_video(path, lambda total, fps, duration: np.arange(total))
    got = np.stack(frames)
    assert list(got.shape) == want["shape"] and hashlib.sha256(got.tobytes()).hexdigest() == want["sha256"]
    pixels, grid, info = preprocess_video(path, max_image_tokens=600)
    from tests.video_cases import digest

    hf = want["processor"]
    assert grid.tolist() == [hf["grid"]] and info[0]["frames_indices"] == hf["frames_indices"]
    assert digest(pixels) == hf["sha256"]


def test_a_damaged_container_with_no_readable_packet_is_said_to_be_damaged():
    """An MKV of 4 FFV1 frames with 40 bytes flipped (numpy's default_rng(1) over bytes 100 and on): no packet
    demuxes and it cannot seek back. It is said to be damaged, not taken for a raw stream that needs a
    container."""
    path = Path(__file__).parent / "golden" / "video_files_refused" / "ffv1_damaged.mkv"
    with pytest.raises(ImageError, match=r"ffv1_damaged.mkv' holds no video packet that can be read .*: the file is "
                                         r"damaged or empty"):
        video_files.probe(path)


def test_a_rotation_the_frames_cannot_take_and_a_size_change_are_refused(tmp_path):
    """A display matrix of 45 degrees (FFmpeg writes any angle), and a stream whose frames change size (two
    MPEG-TS files joined): each refused by name, not encoded skewed or half-resized."""
    with pytest.raises(ImageError, match=r"video 0: '.*h264_rotate45.mp4' asks for its frames to be shown rotated "
                                         r"by 45 degrees; only multiples of 90"):
        plan_video(Path(__file__).parent / "golden" / "video_files_refused" / "h264_rotate45.mp4")

    def ts(width, seed):
        buf = io.BytesIO()
        with av.open(buf, "w", format="mpegts") as c:
            s = c.add_stream("mpeg2video", rate=10)
            s.width, s.height, s.pix_fmt = width, 32, "yuv420p"
            for f in clip(5, 32, width, seed):
                for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    c.mux(pkt)
            for pkt in s.encode():
                c.mux(pkt)
        return buf.getvalue()

    path = tmp_path / "joined.ts"
    path.write_bytes(ts(48, 1) + ts(64, 2))
    with pytest.raises(ImageError, match=r"video 0: '.*joined.ts' changes its frame size mid-stream \(48x32 and "
                                         r"64x32 among the sampled frames\)"):
        plan_video(path, sample=False)


def test_a_display_matrix_that_is_no_rotation_is_named_as_such(tmp_path):
    """An all-zero display matrix (PyAV reads its NaN rotation as INT_MIN): refused as a matrix that is no
    rotation, the file named once, not as a wish to turn the frames by -2147483648 degrees."""
    import struct

    data = (GOLDEN / "h264_10bit_rot90.mp4").read_bytes()
    at = data.index(b"tkhd") + 4
    matrix = at + (40 if data[at] == 0 else 52)  # the 3 x 3 display matrix of a version 0 / 1 track header
    path = tmp_path / "zero.mp4"
    path.write_bytes(data[:matrix] + struct.pack(">9i", 0, 0, 0, 0, 0, 0, 0, 0, 1 << 30) + data[matrix + 36:])
    with pytest.raises(ImageError) as refused:
        plan_video(path)
    said = str(refused.value)
    assert "display matrix is not a rotation" in said and "2147483648 degrees;" not in said, said
    assert said.count("zero.mp4") == 1, said


def test_a_duration_of_0_takes_the_files_own(tmp_path):
    """duration=0 means unknown: a file's own duration (30 frames at 10 fps: 3 s) stands, as with none given."""
    path = write(tmp_path / "a.mkv", clip(30), fps=10)
    _, _, (own,) = preprocess_video(str(path))
    _, _, (zero,) = preprocess_video(str(path), duration=0)
    assert zero["frames_indices"] == own["frames_indices"] and zero["duration"] == own["duration"] > 2.9, zero


def test_damaged_files_are_refused_by_name_never_crash():
    """Truncated and byte-flipped copies of a golden clip (seeded): each decodes or is refused with an
    ImageError (or the sampling's ValueError) naming the video; none raises anything else (not an
    AttributeError for a stream whose codec context PyAV cannot open, not av's own errors from the scan)."""
    data = (GOLDEN / "h264_10bit_rot90.mp4").read_bytes()
    rng = np.random.default_rng(7)
    variants = [data[:int(len(data) * f)] for f in (0.9, 0.5, 0.2, 0.05)]
    for _ in range(60):
        b = bytearray(data)
        for i in rng.integers(0, len(b), int(rng.integers(1, 200))):
            b[i] = rng.integers(0, 256)
        variants.append(bytes(b))
    refused = set()
    for v in variants:
        try:
            plan_video(video_files.VideoFile(v), max_image_tokens=300)
        except (ImageError, ValueError) as e:  # ValueError: the sampling's (a damaged clip read as too short)
            assert str(e).startswith("video 0: "), e
            refused.add(str(e).split("(")[0][:60])
    assert len(refused) >= 3  # several kinds of damage, each said in its own words


def test_frames_larger_than_declared_are_refused_before_they_are_kept(tmp_path):
    """An MJPEG file whose first frame is 64x48, as its stream says, and the rest 640x480: every limit is
    checked against the stream's size, so decoding stops at the first larger frame, naming it, and none is
    kept. (A file whose frames are all larger than its header says is read at their size when opened.)"""
    import fractions

    from PIL import Image

    jpegs = []
    for size in ((64, 48), (640, 480)):
        buf = io.BytesIO()
        Image.new("RGB", size, (200, 30, 30)).save(buf, "JPEG", quality=50)
        jpegs.append(buf.getvalue())
    for small, says in ((1, r"changes its frame size mid-stream \(64x48 and 640x480 among the sampled frames\)"),):
        path = tmp_path / f"forged{small}.avi"
        with av.open(str(path), "w") as c:
            s = c.add_stream("mjpeg", rate=10)
            s.width, s.height, s.pix_fmt, s.time_base = 64, 48, "yuvj420p", fractions.Fraction(1, 10)
            for i in range(6):
                p = av.Packet(jpegs[0] if i < small else jpegs[1])
                p.stream, p.pts, p.dts, p.is_keyframe = s, i, i, True
                c.mux(p)
        converted, real = [], video_files._RGB.__call__
        video_files._RGB.__call__ = lambda self, frame: converted.append(frame.width) or real(self, frame)
        try:
            with pytest.raises(ImageError, match=f"forged{small}.avi' " + says):
                preprocess_video(str(path), sample=False)
        finally:
            video_files._RGB.__call__ = real
        assert converted == [64], converted  # the larger frames were never made RGB and kept


def test_a_callers_fps_or_duration_reads_a_file_whose_packets_span_no_time(tmp_path):
    """Every packet at pts 0: the file's own timing cannot be told (Untimed, an ImageError, saying to give fps;
    its .advice what glmvit-encode and Ray reword), and a caller's fps= or duration= stands for it, as for any
    file."""
    import fractions

    from glmvit_cupy import Untimed

    path = write(tmp_path / "still.mkv", clip(20), fps=fractions.Fraction(10**9, 1))  # Matroska's ms: all at 0
    for unknown in ({}, {"duration": 0}):  # duration 0: unknown, as sample_frames takes it
        with pytest.raises(Untimed, match=r"over 0 s; cannot sample it; give its fps \(fps= or duration=\)") as e:
            preprocess_video(str(path), **unknown)
        assert isinstance(e.value, ImageError) and e.value.advice == Untimed.ADVICE
        assert e.value.what.endswith("still.mkv' holds 20 video frames over 0 s; cannot sample it"), e.value.what
    by_fps = preprocess_video(str(path), fps=2.0)
    by_duration = preprocess_video(str(path), duration=10.0)  # 20 frames: the same timing
    assert np.array_equal(by_fps[0], by_duration[0]) and by_fps[1].tolist() == by_duration[1].tolist()
    # An fps so small that the frames' duration passes any float: the fps is named, not a duration never given.
    with pytest.raises(ValueError, match=r"fps=1e-308 makes its 20 frames last longer than any number of seconds"):
        preprocess_video(str(path), fps=1e-308)
    timed = write(tmp_path / "timed.mkv", clip(20), fps=10)
    for duration in (float("nan"), float("inf")):  # the caller's duration is named, not the fps it gave none of
        with pytest.raises(ValueError, match=rf"video 0: duration={duration!r} must be a positive finite number"):
            preprocess_video(str(timed), duration=duration)


def test_the_service_counts_a_file_whose_packets_span_no_time_as_it_reads_it(tmp_path):
    """glmvit-serve admits a video against --max-pixels-in-flight by the pixels it will decode, read from its
    container before decoding (decoding.video_pixels). A file whose packets span no time is read with the
    request's fps or duration, so it is counted with them too, as the same frames timed are: not as 0."""
    import fractions

    from glmvit_cupy.preprocessing.image import REFERENCE
    from glmvit_cupy.serving.decoding import video_pixels

    untimed = write(tmp_path / "still.mkv", clip(20), fps=fractions.Fraction(10**9, 1)).read_bytes()
    timed = write(tmp_path / "timed.mkv", clip(20), fps=2).read_bytes()
    common = {"sample": True, "target_fps": 2, "max_frames": 2048, "max_duration": 0, "min_image_tokens": 16,
              "max_image_tokens": 4096}

    def held(data, fps=None, duration=None):
        video = {"frames": None, "file": data, "fps": fps, "duration": duration}
        return video_pixels(video, 0, common, 10**8, 10**9, REFERENCE)

    assert held(untimed) == 0  # no timing: refused, saying why, when it is read
    assert held(untimed, fps=2.0) == held(untimed, duration=10.0) == held(timed) > 20 * 42 * 58


def test_the_service_counts_each_video_frame_beside_its_pixels():
    """A frame costs the server more than its pixels (its array, the decoder's objects, its patch rows): 50,000
    8 x 8 frames once took 2.2 GB while counted as their 16-token canvases, 39,200,000 pixels. Each sampled
    frame now counts FRAME_OVERHEAD_PIXELS more, so such a request is refused at --max-pixels-in-flight's
    default (2^28), and a frame's own pixels still count: a larger one counts more."""
    from PIL import Image

    from glmvit_cupy.preprocessing.image import REFERENCE
    from glmvit_cupy.serving.decoding import FRAME_OVERHEAD_PIXELS, pixels_held, video_pixels

    def frames(side, n):
        buf = io.BytesIO()
        Image.new("RGB", (side, side), (1, 2, 3)).save(buf, "PNG")
        return [buf.getvalue()] * n

    common = {"sample": False, "target_fps": 2, "max_frames": 2048, "max_duration": 0, "min_image_tokens": 16,
              "max_image_tokens": 4096}

    def held(video_frames):
        return video_pixels({"frames": video_frames, "file": None, "fps": 2.0, "duration": None}, 0, common,
                            10**8, 10**12, REFERENCE)

    small = held(frames(8, 1000))
    assert small == 1000 * (28 * 28 + FRAME_OVERHEAD_PIXELS)  # a 28 x 28 canvas a frame, and the overhead
    assert 50_000 * small // 1000 > 2**28
    large = held(frames(300, 1000))
    assert large == pixels_held(1000 * 300 * 300, (300, 300), 16, 4096, REFERENCE, 1000) + \
        1000 * FRAME_OVERHEAD_PIXELS > 1000 * 300 * 300


def test_a_frame_past_max_pixels_is_refused_before_it_is_decoded_though_not_sampled(tmp_path):
    """A stream of 64x64 frames (its header's size, which the limits check) holding a 3000x3000 frame
    between the sampled ones: FFmpeg refuses that frame before allocating it (max_pixels, set at open), so
    it is never decoded in full; the refusal names the limit. The same file decodes under a limit it fits."""
    from PIL import Image

    def png(w, h):
        buf = io.BytesIO()
        Image.new("L", (w, h), 9).save(buf, "PNG")
        return buf.getvalue()

    small, large = png(64, 64), png(3000, 3000)
    video = b"".join(small if i % 10 == 0 else large for i in range(21))  # a PNG pipe: images as frames
    sampled = lambda total, fps, duration: np.array([0, 10, 20])  # noqa: E731
    with pytest.raises(ImageError, match=r"failed at frame 1 .*a frame larger than the 1,000,000 pixels a decoded "
                                         r"image may have \(max_pixels"):
        video_files.load_video(video, sampled, fps=20.0, max_pixels=1_000_000)
    frames, meta = video_files.load_video(video, sampled, fps=20.0, max_pixels=10_000_000)
    assert [f.shape for f in frames] == [(64, 64, 3)] * 3 and meta["frames_indices"] == [0, 10, 20]


def test_a_raw_elementary_stream_is_refused_saying_what_it_is(tmp_path):
    """An H.264 elementary stream (no container) reads to its end but cannot seek back: the refusal says so,
    not that reading its packets failed."""
    path = tmp_path / "raw.h264"
    with av.open(str(path), "w", format="h264") as c:
        s = c.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for f in clip(20, 48, 64):
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    try:
        preprocess_video(str(path))
    except ImageError as e:
        assert "cannot go back to its start" in str(e) and "without a container" in str(e), str(e)
    # else: this FFmpeg seeks in raw H.264 streams, and the file simply decodes


def test_frames_turned_upright_to_other_shapes_are_refused(tmp_path, monkeypatch):
    """A display rotation that changes between frames (frames of one coded size, turned upright to H x W and
    W x H) is refused as a size change, never staged as one shape."""
    path = write(tmp_path / "c.mkv", clip(4, 42, 58))
    real, calls = video_files._RGB.__call__, []

    def turning(self, frame):  # the second frame's rotation differs: its upright array is transposed
        calls.append(1)
        out = real(self, frame)
        return out.transpose(1, 0, 2) if len(calls) == 2 else out

    monkeypatch.setattr(video_files._RGB, "__call__", turning)
    with pytest.raises(ImageError, match=r"changes its frame size mid-stream \(58x42 and 42x58 among the sampled "
                                         r"frames, turned upright\)"):
        preprocess_video(str(path), sample=False)


def test_a_video_files_pixels_are_counted_at_the_servers_limit_not_pillows(tmp_path, monkeypatch):
    """glmvit-serve admits a video by the pixels it will hold: a file whose frames pass the server's --max-pixels
    but not Pillow's default limit was counted as 0 (its probe refused at Pillow's), so it skipped
    --max-pixels-in-flight while its decode, at the server's limit, went on."""
    from PIL import Image

    from glmvit_cupy.preprocessing.image import Patching
    from glmvit_cupy.serving.decoding import video_pixels

    data = write(tmp_path / "v.mkv", clip(8), fps=4).read_bytes()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # below a 42x58 frame: as a 9504x9504 one at the default
    video = {"file": data, "frames": None, "fps": None, "duration": None}
    common = {"sample": False, "min_image_tokens": 16, "max_image_tokens": 64}
    held = video_pixels(video, 0, common, 10**6, 10**9, Patching())
    assert held >= 8 * 42 * 58
    assert video_pixels(video, 0, common, 1000, 10**9, Patching()) == 0  # over the server's own: its decode refuses


@pytest.mark.parametrize("name", ["take:2.mkv", "http:clip.mkv", "subfile,,start,0,end,9,,:c.mkv"])
def test_a_relative_path_with_a_colon_is_the_file_not_a_protocol_url(tmp_path, monkeypatch, name):
    """FFmpeg reads a name before a colon as a protocol (http:, concat:, subfile,...:): a file in the working
    folder named so is read as the file, as any other path."""
    frames = clip(6)
    write(tmp_path / name, frames, fps=10)
    monkeypatch.chdir(tmp_path)
    got, meta = video_files.load_video(name, lambda total, fps, duration: np.arange(total))
    assert np.array_equal(np.stack(got), frames) and meta["total_frames"] == 6
    assert video_files.probe(name)[:3] == (58, 42, 6)


def test_the_pixel_cap_holds_on_the_frames_decoded_not_the_size_declared(tmp_path, monkeypatch):
    """A stream that declares 0x0 frames (its header's size, which the cap was checked by before decoding)
    holding 64x48 ones: the kept frames are counted at their decoded size, and decoding stops before the
    frame that passes max_total_pixels is kept, naming the file, the cap and the setting; under a cap they
    fit, the frames are the file's."""
    frames = clip(12, 48, 64)
    path = write(tmp_path / "p.mov", frames, fps=10, codec="png", pix="rgb24")  # PNG frames carry their size
    real = video_files._stream

    def zero_declared(container):  # as a header of 0x0 gives it
        stream = real(container)
        stream.codec_context.width = stream.codec_context.height = 0
        return stream

    monkeypatch.setattr(video_files, "_stream", zero_declared)
    every = lambda total, fps, duration: np.arange(total)  # noqa: E731
    converted, rgb = [], video_files._RGB.__call__
    monkeypatch.setattr(video_files._RGB, "__call__", lambda self, frame: converted.append(1) or rgb(self, frame))
    with pytest.raises(ImageError, match=r"video: '.*p.mov''s sampled frames pass the limit of 15,359 pixels "
                                         r"together at frame 4: 5 of 64x48 hold 15,360, though its stream declares "
                                         r"0x0 frames \(max_total_pixels: the commands' --max-video-pixels raises it\)"):
        video_files.load_video(path, every, max_total_pixels=5 * 64 * 48 - 1)
    assert len(converted) == 4  # the frames within the cap, and no more, were made RGB and kept
    got, meta = video_files.load_video(path, every, max_total_pixels=12 * 64 * 48)
    assert np.array_equal(np.stack(got), frames) and meta["total_frames"] == 12
    monkeypatch.setattr(video_files, "_stream", real)  # declared as decoded: refused before decoding, as ever
    with pytest.raises(ImageError, match=r"its 12 sampled frames have 36,864 pixels, over the limit of 15,359"):
        video_files.load_video(path, every, max_total_pixels=5 * 64 * 48 - 1)


def test_a_video_files_bytes_never_open_another_file(tmp_path, monkeypatch):
    """FFmpeg's concat demuxer, found from the bytes' own first line, opens the files its script names,
    relative to the working folder: bytes a client sent must not reach the files of the machine reading them.
    A path still reads as a path."""
    (tmp_path / "secret.mp4").write_bytes((GOLDEN / "h264_2997.mp4").read_bytes())
    monkeypatch.chdir(tmp_path)
    script = b"ffconcat version 1.0\nfile secret.mp4\n"
    with pytest.raises(ImageError):
        video_files.probe(script, "video 0")
    with pytest.raises(ImageError):
        video_files.VideoFile(script).read(lambda total, fps, duration: [0], None, None, "video 0")
    assert video_files.probe(str(tmp_path / "secret.mp4"), "video 0")[2] == 15
