"""Video files (video_files.load_video, through plan_video / preprocess_video): lossless clips written with
PyAV, read back as the same frames the array path samples, containers with and without a frame count, a
count higher than the file holds, and files that cannot be read refused by name."""

import sys

import numpy as np
import pytest

from glmvit_cupy import ImageError, preprocess_video
from glmvit_cupy import video_files
from glmvit_cupy.video import plan_video

av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")


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


@pytest.mark.parametrize("ext,codec,pix", [("mkv", "ffv1", "bgr0"), ("avi", "ffv1", "bgr0"), ("mov", "png", "rgb24")])
def test_a_file_gives_the_frames_the_array_path_samples(tmp_path, ext, codec, pix):
    """Matroska keeps no frame count (packets counted), AVI and MOV do; the sampled frames, indices,
    timestamps and canvas equal plan_video of the decoded array at the container's fps and duration."""
    frames = clip(95)  # 95 frames at 30 fps: 3.17 s, ~6 sampled at 2 fps
    path = write(tmp_path / f"clip.{ext}", frames, codec=codec, pix=pix)
    assert video_files.probe(path) == (95, 30.0, 95 / 30)
    got, grid, info = plan_video(path, max_image_tokens=400)
    want, wgrid, winfo = plan_video(frames, fps=30.0, duration=95 / 30, max_image_tokens=400)
    assert grid == wgrid and info == winfo and len(got) == len(want)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert info["frames_indices"][0] == 0 and info["timestamps"] == [i / 30 for i in info["frames_indices"]]
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
    monkeypatch.setattr(video_files, "_probe", lambda c, p, n: (lambda t, f, d: (t + 40, f, (t + 40) / f))(*real(c, p, n)))
    from glmvit_cupy.video import sample_frames

    asked = []
    got, meta = video_files.load_video(path, lambda *a: asked.append(a) or sample_frames(*a[:2], duration=a[2]))
    assert asked == [(101, 30.0, 101 / 30), (61, 30.0, 61 / 30)]
    assert meta["total_frames"] == 61 and meta["duration"] == 61 / 30
    want = sample_frames(61, 30.0, duration=61 / 30)
    assert meta["frames_indices"] == want.tolist() and np.array_equal(np.stack(got), frames[want])


def test_files_that_cannot_be_read_are_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(ImageError, match=r"video 0: '.*nope.mp4' is not a file"):
        plan_video(tmp_path / "nope.mp4")
    (tmp_path / "text.mp4").write_text("not a video at all")
    with pytest.raises(ImageError, match=r"video 0: cannot open '.*text.mp4' as a video"):
        plan_video(tmp_path / "text.mp4")
    short = write(tmp_path / "short.mkv", clip(2), fps=30)
    with pytest.raises(ValueError, match="video 1: sample_frames: a 2-frame video at 30.0 fps .* gives no frame"):
        preprocess_video([write(tmp_path / "ok.mkv", clip(8), fps=4), short])
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 42 * 58 - 1)  # the decompression-bomb guard, as for images
    with pytest.raises(ImageError, match=r"video 0: '.*ok.mkv' has 58x42 frames, over the 2,435 pixels"):
        plan_video(tmp_path / "ok.mkv", fps=4.0)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(ImageError, match=r"reading video files needs PyAV: pip install 'glmvit-cupy\[video\]'"):
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
    with pytest.raises(ImageError, match=f"video 0: cannot open the video file of 9 bytes as a video"):
        plan_video(video_files.VideoFile(b"not a mp4"))
    with pytest.raises(ImageError, match="VideoFile: a path or a video file's bytes expected, got int"):
        video_files.VideoFile(3)
