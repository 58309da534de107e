"""The video preprocessor equals HF's Glm5NextVideoProcessor (golden digests made on a machine with torch and
torchvision by tools/fuzz_video.py, and live where both are importable), its resize equals a plain re-statement
of ATen's uint8 path, and bad videos are refused by name."""

import json
import math
import os

import numpy as np
import pytest
from PIL import Image

from tests.video_cases import case, digest

from glmvit_cupy import ImageError, Patching, preprocess_video
from glmvit_cupy.preprocessing import resample
from glmvit_cupy.preprocessing.video import frame_groups, normalise_patchify, plan_videos, sample_frames, video_canvases
from glmvit_cupy.scheduling import batching

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "video_hf.json")


def ours(i):
    frames, s = case(i)
    pv, grid, info = preprocess_video(frames, fps=s["fps"], duration=s["duration"], sample=s["sample"],
                                      target_fps=s["target_fps"], min_image_tokens=s["min_image_tokens"],
                                      max_image_tokens=s["max_image_tokens"])
    return pv, grid, info


def golden_cases():
    if not os.path.exists(GOLDEN):
        return {}  # test_golden_file_covers... fails, saying so
    with open(GOLDEN) as f:
        return json.load(f)["cases"]


@pytest.mark.parametrize("i", sorted(int(k) for k in golden_cases()))
def test_bit_identical_to_hf_video_processor(i):
    want = golden_cases()[str(i)]
    if want.get("refused"):
        with pytest.raises((ValueError, ImageError)):
            ours(i)
        return
    pv, grid, info = ours(i)
    assert grid.tolist() == want["grid"] and info[0]["frames_indices"] == want["frames_indices"]
    assert pv.dtype == np.float32 and digest(pv) == want["sha256"], f"case {i}: {case(i)[0].shape} {case(i)[1]}"


def test_golden_file_covers_sampling_resizing_and_refusals():
    g = golden_cases()
    assert g, f"{GOLDEN} is missing: make it with tools/fuzz_video.py 0 300 --golden {GOLDEN} (needs torchvision)"
    frames = [case(int(k)) for k in g]
    kept = [v for v in g.values() if not v.get("refused")]
    assert len(kept) >= 40 and any(v.get("refused") for v in g.values())
    assert any(s["sample"] for _, s in frames) and any(not s["sample"] for _, s in frames)
    assert any(v["grid"][0][0] > 8 for v in kept)  # long videos, many frame groups


def _hf_or_skip():
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
        import transformers
    except ImportError as e:
        pytest.skip(f"the live comparison needs torch, torchvision and transformers 5.23.0 ({e})")
    if transformers.__version__ != "5.23.0":
        pytest.skip(f"transformers {transformers.__version__} is not the reference 5.23.0")
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
    return Glm5NextVideoProcessor()


def test_live_against_hf_with_several_videos_in_one_call(rng):
    proc = _hf_or_skip()
    vids = [rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8) for t, h, w in ((9, 70, 130), (4, 300, 41), (30, 64, 64))]
    meta = [{"total_num_frames": len(v), "fps": f, "duration": None} for v, f in zip(vids, (10.0, 2.0, 29.97))]
    hf = proc(videos=vids, video_metadata=meta, fps=4, max_image_tokens=3000, return_metadata=True,
              input_data_format="channels_last")
    pv, grid, info = preprocess_video(vids, fps=[10.0, 2.0, 29.97], target_fps=4, max_image_tokens=3000)
    assert np.array_equal(np.asarray(hf["pixel_values_videos"]).view(np.uint32), pv.view(np.uint32))
    assert np.asarray(hf["video_grid_thw"]).tolist() == grid.tolist()
    assert [list(m.frames_indices) for m in hf["video_metadata"]] == [i["frames_indices"] for i in info]
    assert [list(m.timestamps) for m in hf["video_metadata"]] == [i["timestamps"] for i in info]


# -- the resize: ATen's uint8 antialiased bicubic, re-stated as plain scalar code -------------------------

def _aten_pass_scalar(src, out_size, along):
    """One pass of ATen's uint8 path written out per output pixel from its C++ (UpSampleKernel.cpp): returns
    (uint8 result, whether any sum fell outside 0..255 before the clamp)."""
    in_size = src.shape[along]
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0

    def cubic(x):
        a, x = -0.5, abs(x)
        if x < 1.0:
            return ((a + 2) * x - (a + 3)) * x * x + 1
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a if x < 2.0 else 0.0

    rows = []
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), taps)
        w = [cubic((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for v in w:
            total += v
        w = [v / total for v in w] if total != 0.0 else w
        rows.append((xmin, w))
    wt_max = max(max(w) for _, w in rows)
    bits = 0
    for bits in range(23):
        if bits == 22 or int(0.5 + wt_max * (1 << (bits + 1))) >= (1 << 15):
            break
    clipped = False
    moved = np.moveaxis(src, along, 0).astype(np.int64)
    out = np.empty((out_size,) + moved.shape[1:], dtype=np.uint8)
    for i, (xmin, w) in enumerate(rows):
        k = [int(-0.5 + v * (1 << bits)) if v * (1 << bits) < 0 else int(0.5 + v * (1 << bits)) for v in w]
        acc = np.full(moved.shape[1:], 1 << (bits - 1), dtype=np.int64)
        for j, kj in enumerate(k):
            acc += moved[xmin + j] * kj
        val = acc >> bits
        clipped |= bool((val < 0).any() or (val > 255).any())
        out[i] = np.clip(val, 0, 255)
    return np.moveaxis(out, 0, along), clipped


@pytest.mark.parametrize("h,w,oh,ow", [(37, 50, 20, 61), (9, 120, 30, 7), (100, 3, 1, 40), (5, 5, 64, 2),
                                       (64, 48, 64, 17), (31, 77, 12, 77), (1, 90, 3, 31)])
def test_aten_resize_equals_the_scalar_statement(h, w, oh, ow):
    rng = np.random.default_rng(h * 1000 + w)
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img[::2] = 255 * (img[::2] > 127)  # hard edges: the negative lobes overshoot
    got = resample.aten_resize(img, oh, ow)
    x, clipped = img, False
    if ow != w:
        x, c = _aten_pass_scalar(x, ow, 1)
        clipped |= c
    if oh != h:
        x, c = _aten_pass_scalar(x, oh, 0)
        clipped |= c
    assert got.shape == (oh, ow, 3) and np.array_equal(got, x)
    if (h, w, oh, ow) == (37, 50, 20, 61):
        assert clipped  # the clamp fired here


def test_aten_weights_differ_from_pillows_where_they_should():
    """Same supports and centres as Pillow, other fixed point: int16 with the side's own precision."""
    a, p = resample.aten_axis(1000, 77), resample.axis(1000, 77)
    assert np.array_equal(a.first, p.first) and np.array_equal(a.count, p.count)
    assert a.precision < 22 == p.precision and np.abs(a.weights).max() < 2 ** 15
    assert np.allclose(a.weights / 2.0 ** a.precision, p.weights / 2.0 ** 22, atol=2 ** -a.precision)


# -- frames, layout, sampling --------------------------------------------------------------------------------

def test_rows_are_frame_groups_of_merge_blocks(rng):
    """Row (g, bh, bw, r, c) holds channel x frame x py x px of patch (bh*M + r, bw*M + c) in frames
    g*T..g*T+T-1, each value (v - 255 mean) / (255 std) in float32, indexed here independently."""
    pat = Patching(4, 2, 2)
    frames = rng.integers(0, 256, (4, 16, 24, 3), dtype=np.uint8)
    rows = normalise_patchify(frames, pat)
    mean = np.float32([0.48145466, 0.4578275, 0.40821073]) * np.float32(255)
    std = np.float32([0.26862954, 0.26130258, 0.27577711]) * np.float32(255)
    gh, gw = 4, 6
    for n in rng.integers(0, len(rows), 12):
        g, rest = divmod(int(n), gh * gw)
        b, rc = divmod(rest, 4)
        bh, bw = divmod(b, gw // 2)
        r, c = divmod(rc, 2)
        y0, x0 = (bh * 2 + r) * 4, (bw * 2 + c) * 4
        for ch in range(3):
            for t in range(2):
                want = (frames[g * 2 + t, y0:y0 + 4, x0:x0 + 4, ch].astype(np.float32) - mean[ch]) / std[ch]
                got = rows[n].reshape(3, 2, 4, 4)[ch, t]
                assert np.array_equal(got, want), (n, ch, t)


def test_several_videos_are_each_videos_rows_in_turn_and_out_is_checked(rng):
    """preprocess_video of several videos writes each one's rows into its own slice of one array: the same
    bits as each video alone, in order (no concatenation copy); normalise_patchify's `out` must fit exactly."""
    videos = [rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
              for t, h, w in ((4, 60, 90), (3, 100, 40), (2, 56, 56))]
    pv, grid, _ = preprocess_video(videos, fps=2.0, sample=False, max_image_tokens=400)
    alone = [preprocess_video(v, fps=2.0, sample=False, max_image_tokens=400) for v in videos]
    assert grid.tolist() == [a[1][0].tolist() for a in alone]
    assert np.array_equal(pv.view(np.uint32), np.concatenate([a[0] for a in alone]).view(np.uint32))
    frames = rng.integers(0, 256, (2, 28, 56, 3), dtype=np.uint8)
    into = np.full((8, 1176), np.nan, np.float32)
    assert normalise_patchify(frames, out=into) is not None and np.array_equal(into, normalise_patchify(frames))
    for bad in (np.empty((7, 1176), np.float32), np.empty((8, 1176), np.float64), np.empty((1176, 8), np.float32).T):
        with pytest.raises(ValueError, match="out must be a C-contiguous float32"):
            normalise_patchify(frames, out=bad)


def test_an_odd_frame_count_repeats_the_last_frame(rng):
    v = rng.integers(0, 256, (3, 56, 56, 3), dtype=np.uint8)
    pv, grid, info = preprocess_video(v, sample=False, min_image_tokens=0)
    pv4, grid4, _ = preprocess_video(np.concatenate([v, v[-1:]]), sample=False, min_image_tokens=0)
    assert grid.tolist() == [[2, 4, 4]] == grid4.tolist() and np.array_equal(pv, pv4)
    assert info[0]["frames_indices"] == [0, 1, 2] and info[0]["timestamps"] is None
    assert info[0]["tokens"] == 8 and info[0]["frame_tokens"] == 4


def test_frame_groups_are_the_sampled_frames_unresized_in_whole_groups(rng):
    """What the GPU stages (frame_groups) holds the frames the host resizes (video_canvases) in the same
    groups: the sampled frames themselves, the last repeated, one (1, h, w) item a group, with the content
    size and the group's tokens."""
    vids = [rng.integers(0, 256, (9, 61, 83, 3), dtype=np.uint8), rng.integers(0, 256, (4, 40, 30, 3), np.uint8)]
    for (frames, grid, info), given in zip(plan_videos(vids, fps=[4.0, 2.0], target_fps=4), vids):
        assert np.array_equal(frames, given[info["frames_indices"]])
        items = frame_groups(frames, grid, info, 2)
        assert len(items) == grid[0] and sum(it[2]["tokens"] for it in items) == info["tokens"]
        canvases = video_canvases(frames, grid, info, 2)
        for g, (group, item_grid, item) in enumerate(items):
            assert item_grid == (1, grid[1], grid[2]) and item["content"] == info["content"]
            assert item["source"] == f"{info['source']} frames {2 * g}..{2 * g + 1}"
            for t in range(2):
                j = min(2 * g + t, len(frames) - 1)  # the last frame repeated
                assert np.array_equal(group[t], frames[j])
                ch, cw = info["content"]
                assert np.array_equal(canvases[2 * g + t, :ch, :cw], resample.aten_resize(frames[j], ch, cw))
    with pytest.raises(ValueError, match="video 1: "):  # every video checked before any pixel is made
        plan_videos([vids[0], vids[1][:, :0]], fps=4.0)


def _png(a) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def test_frame_files_decode_only_the_sampled_frames(rng):
    """FrameFiles (a video as its frames' image files, as glmvit-serve gets them): the array path's frames,
    indices and canvas; a broken file that is not sampled is never read, one that is names its index; the
    frames' sizes and the pixel cap are checked by index before or while decoding."""
    from glmvit_cupy.preprocessing.video import plan_video
    from glmvit_cupy.preprocessing.video_files import FrameFiles

    v = rng.integers(0, 256, (12, 30, 40, 3), dtype=np.uint8)
    files = [_png(f) for f in v]
    want = plan_video(v, fps=6.0)
    picked = want[2]["frames_indices"]
    assert len(set(picked)) < 12  # some frames are not sampled
    skipped = next(j for j in range(12) if j not in picked)
    files[skipped] = b"not an image"
    got = plan_video(FrameFiles(files), fps=6.0)
    assert got[1:] == want[1:] and all(np.array_equal(a, b) for a, b in zip(got[0], want[0]))
    broken = list(files)
    broken[picked[1]] = b"not an image either"
    with pytest.raises(ImageError, match=f"video 0 frame {picked[1]}: "):
        plan_video(FrameFiles(broken), fps=6.0)
    odd = list(files)
    odd[picked[2]] = _png(v[0][:, :20])
    with pytest.raises(ImageError, match=f"video 0: frame {picked[2]} is 20x30, frame 0 40x30; a video's frames"):
        plan_video(FrameFiles(odd), fps=6.0)
    n = len(set(picked))
    with pytest.raises(ImageError, match=f"video 0: its {n} sampled frames have {n * 1200:,} pixels, over the limit"):
        plan_video(FrameFiles(files, max_total_pixels=n * 1200 - 1), fps=6.0)
    assert plan_video(FrameFiles(files, max_total_pixels=n * 1200), fps=6.0)[1:] == want[1:]
    with pytest.raises(ImageError, match="FrameFiles: a non-empty list of image files expected"):
        FrameFiles([])


def test_frame_files_as_paths_and_a_fifo_that_must_not_block(tmp_path, rng):
    import os

    from glmvit_cupy.preprocessing.video import plan_video
    from glmvit_cupy.preprocessing.video_files import FrameFiles

    v = rng.integers(0, 256, (4, 20, 24, 3), dtype=np.uint8)
    paths = []
    for j, f in enumerate(v):
        paths.append(tmp_path / f"f{j}.png")
        paths[-1].write_bytes(_png(f))
    want = plan_video(v, sample=False)
    got = plan_video(FrameFiles(paths, max_total_pixels=10**6), sample=False)
    assert got[1:] == want[1:] and all(np.array_equal(a, b) for a, b in zip(got[0], want[0]))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ImageError, match="video 0 frame 2: is a FIFO"):  # refused by what it is, never opened
        plan_video(FrameFiles(paths[:2] + [tmp_path / "fifo"], max_total_pixels=10**6), sample=False)


def test_frames_as_a_list_of_arrays_or_rgb_pil_images_equal_the_array(rng):
    v = rng.integers(0, 256, (4, 50, 70, 3), dtype=np.uint8)
    a = preprocess_video(v, fps=8.0)
    b = preprocess_video(list(v), fps=8.0)
    c = preprocess_video([Image.fromarray(f) for f in v], fps=8.0)
    for other in (b, c):
        assert np.array_equal(a[0], other[0]) and np.array_equal(a[1], other[1])


def test_sampling_follows_the_reference_rules():
    idx = sample_frames(300, 30.0)  # 10 s: round(299 / 30) + 1 = 11 s counted, 22 frames at 2 fps
    assert len(idx) == 22 and idx[0] == 0 and np.all(np.diff(idx) > 0) and idx[-1] < 300
    assert sample_frames(7, 30.0).tolist() == [0, 0]  # one frame found, made even
    assert sample_frames(100, 24, duration=4.2).tolist() == [0, 12, 24, 36, 48, 60, 72, 84]
    assert len(sample_frames(10_000, 30.0, max_frames=64)) == 64
    long = sample_frames(3000, 30.0, max_duration=5)  # 10 s of frames capped at 5 s: 10 evenly spread
    assert len(long) == 10 and long[-1] == 2999
    assert sample_frames(5, 1.0, target_fps=2).tolist() == [0, 1, 2, 3, 4, 4]
    assert sample_frames(100, 24, duration=0).tolist() == sample_frames(100, 24).tolist()  # 0: unknown  # fewer frames than wanted: all


def test_a_frame_count_past_the_video_spreads_over_its_frames_without_making_the_count(rng, monkeypatch):
    from glmvit_cupy.preprocessing import video

    for _ in range(2000):  # the spread equals the reference's linspace, then unique, whatever the count
        start = int(rng.integers(0, 50))
        end, want = start + int(rng.integers(0, 60)), int(rng.integers(1, 200))
        assert video._spread(start, end, want) == list(dict.fromkeys(
            np.linspace(start, end, want, dtype=int).tolist())), (start, end, want)
    # A tenth of a second of video asked for a billion frames a second: every one of its frames, at once
    # (a billion-value linspace would take minutes and ~30 GB).
    linspace = np.linspace

    def counted(start, stop, num, **kw):
        assert num <= 10**6, f"np.linspace of {num:,} values"
        return linspace(start, stop, num, **kw)

    monkeypatch.setattr(video.np, "linspace", counted)
    assert sample_frames(3, 30.0, duration=10**9, target_fps=1, max_frames=10**9).tolist() == [0, 1, 2, 2]
    assert sample_frames(40, 1.0, target_fps=1e9, max_frames=10**9).tolist() == list(range(40))
    assert sample_frames(10**5, 30.0, duration=10**9, target_fps=1, max_frames=10**9)[-1] == 10**5 - 1


@pytest.mark.parametrize("video,kw,match", [
    (np.zeros((3, 20, 20, 3), np.float32), {}, "frames are float32; give uint8"),
    (np.zeros((3, 20, 20), np.uint8), {}, r"shape \(3, 20, 20\); a video is \[frames, height, width, 3\]"),
    (np.zeros((0, 20, 20, 3), np.uint8), {}, "at least one frame"),
    ([], {}, "empty list"),
    ([np.zeros((20, 20, 3), np.uint8), np.zeros((20, 21, 3), np.uint8)], {}, "frame 1 is 21x20, frame 0 20x20"),
    ([Image.new("RGBA", (9, 9))], {}, "frame 0 is a RGBA PIL image; give RGB frames"),
    ([np.zeros((9, 9, 3), np.uint16)], {}, "frame 0 is uint16"),
    (3.5, {}, "a video is a uint8 .* array, a list of frames or a video file's path, got float"),
])
def test_bad_frames_are_refused_by_name(video, kw, match):
    with pytest.raises(ImageError, match=match) as e:
        preprocess_video(video, sample=False, **kw)
    assert str(e.value).startswith("video 0:")


def test_bad_settings_are_refused_by_name():
    v = np.zeros((4, 30, 30, 3), np.uint8) + 9
    with pytest.raises(ValueError, match="video 0: sampling frames needs the video's fps"):
        preprocess_video(v)
    for bad in (0, -2.0, float("nan"), True, "30"):
        with pytest.raises(ValueError, match=r"video 0: fps=.* must be a positive finite number"):
            preprocess_video(v, fps=bad)
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match=r"video 0: duration=.* must be a positive finite"):
            preprocess_video(v, fps=10.0, duration=bad)
    with pytest.raises(ValueError, match=r"max_duration=-3 must be a positive finite number"):
        preprocess_video(v, fps=10.0, max_duration=-3)
    with pytest.raises(ValueError, match="fps has 3 values for 2 videos"):
        preprocess_video([v, v], fps=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="fps has 3 values for 2 videos"):
        preprocess_video([v, v], fps=np.array([1.0, 2.0, 3.0]))
    # An array of fps is one a video (or, 0-d, one for all), as a list or a number is.
    want = preprocess_video([v, v], fps=[2.0, 4.0])[1]
    assert np.array_equal(preprocess_video([v, v], fps=np.array([2.0, 4.0]))[1], want)
    assert np.array_equal(preprocess_video([v], fps=np.array(2.0))[1], want[:1])
    with pytest.raises(ValueError, match="video 1: sample_frames: a 4-frame video at 60.0 fps lasts"):
        preprocess_video([v, v], fps=[2.0, 60.0], target_fps=0.5)
    with pytest.raises(ValueError, match="video 0: max_image_tokens=1 is too small"):
        preprocess_video(v, sample=False, max_image_tokens=1)
    with pytest.raises(ValueError, match="min_image_tokens=-1 must be an integer from 0 to 2,147,483,647"):
        preprocess_video(v, sample=False, min_image_tokens=-1)
    for bad in ("no", 0, None):  # "no" is truthy: read as True, it would sample what the caller meant to keep
        with pytest.raises(ValueError, match=r"video 0: sample=.* must be True .* or False"):
            preprocess_video(v, fps=10.0, sample=bad)
    assert preprocess_video(v, fps=10.0, sample=np.bool_(False))[1].tolist() == [[2, 6, 6]]  # 4 frames: 2 groups


def test_frame_pieces_cut_videos_into_whole_groups_that_fit():
    grid = np.array([[7, 8, 10], [1, 4, 4], [3, 6, 6]])
    pieces = batching.frame_pieces(grid, 45, 2)  # 20, 4 and 9 tokens a group
    assert [p.grid for p in pieces] == [(2, 8, 10), (2, 8, 10), (2, 8, 10), (1, 8, 10), (1, 4, 4), (3, 6, 6)]
    assert all(p.tokens <= 45 for p in pieces)
    assert pieces[0].start == 0 and all(a.start + a.rows == b.start for a, b in zip(pieces, pieces[1:]))
    assert pieces[-1].start + pieces[-1].rows == int(np.prod(grid, axis=1).sum())
    with pytest.raises(ValueError, match="video 0: one frame group of 8x10 patches is 20 tokens, more than"):
        batching.frame_pieces(grid, 19, 2)


def test_a_video_too_short_to_sample_is_too_short_named_with_advice_to_reword(rng):
    """Two frames at 6 fps sampled at 0.5 a second give no frame: TooShort (a ValueError) through plan_video's
    wrapping, naming the video, with the API's advice; advised() rewords only the advice."""
    from glmvit_cupy import TooShort
    from glmvit_cupy.preprocessing.video import plan_video

    clip = rng.integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)
    with pytest.raises(TooShort) as e:
        plan_video(clip, 3, fps=6.0, target_fps=0.5, name="clip.mp4")
    assert isinstance(e.value, ValueError) and str(e.value).startswith("clip.mp4: sample_frames: a 2-frame video")
    assert str(e.value).endswith("; raise target_fps or pass sample=False to encode the frames as given")
    told = e.value.advised("raise --video-fps")
    assert str(told) == f"{e.value.what}; raise --video-fps" and told.what.startswith("clip.mp4: ")


def test_a_minimum_past_any_memory_is_a_memory_error_naming_the_video_and_the_setting(rng, monkeypatch):
    """min_image_tokens of a billion scales 8 small frames up to a canvas whose pixel rows need ~17 TiB: a
    MemoryError that names the video, its canvas and the settings to lower, not NumPy's bare one. (NumPy's
    own refusal stands in: a machine that overcommits memory might grant the 17 TiB and then run out.)"""
    from glmvit_cupy.preprocessing import video

    def refused(grids, width):
        raise MemoryError(f"Unable to allocate {int(grids.prod(axis=1).sum()) * width * 4 / 2**40:.1f} TiB")

    monkeypatch.setattr(video, "rows_in_turn", refused)
    frames = rng.integers(0, 256, (8, 32, 40, 3), dtype=np.uint8)
    with pytest.raises(MemoryError, match=r"video 0: 400,000 tokens .* GiB, more than this machine can give: "
                                          "lower min_image_tokens or max_image_tokens"):
        preprocess_video(frames, fps=10, min_image_tokens=400_000, max_image_tokens=400_001)
    # A frame group's canvas past 2**31 - 1 pixel values is refused before anything is allocated.
    with pytest.raises(ValueError, match=r"video 0: a 32x40 video's frames would become a \d+x\d+ canvas"):
        preprocess_video(frames, fps=10, min_image_tokens=10**9, max_image_tokens=10**9 + 1)


def test_a_minimum_above_the_maximum_applies_the_maximum_first_as_the_reference_does(rng):
    """The video processor's limits are not ordered (HF's smart_resize applies the maximum first): 100 and 10
    give at most 10 tokens, not a refusal."""
    frames = rng.integers(0, 256, (8, 32, 40, 3), dtype=np.uint8)
    _, _, (info,) = preprocess_video(frames, fps=10, min_image_tokens=100, max_image_tokens=10)
    assert 0 < info["tokens"] <= 10


def test_image_file_paths_given_as_a_video_are_refused_saying_how_to_give_frames(tmp_path, rng):
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"f{i}.png")
        Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)).save(paths[-1])
    with pytest.raises(ValueError, match=r"video 0: .*f0.png is an image file, and a path is a video file: give a "
                                         r"video's frames decoded, as a list of HxWx3 uint8 arrays"):
        preprocess_video([str(p) for p in paths], fps=10)


def test_settings_past_any_float_or_unsampled_are_refused_and_a_fraction_is_a_rate():
    """An integer past any float (10**400) as fps, duration, target_fps or max_duration is a ValueError naming it,
    not an OverflowError; a duration is checked with sample=False too (info records it: never -5 or NaN); a
    Fraction, as PyAV gives a stream's rate, is a number of frames a second like its float."""
    from fractions import Fraction

    v = np.zeros((20, 28, 28, 3), np.uint8) + 9
    for name in ("fps", "duration", "target_fps", "max_duration"):
        with pytest.raises(ValueError, match=rf"video 0: (sample_frames.*: )?{name}=1000.*\(401 characters\) must be a "
                                             "positive finite number"):
            preprocess_video(v, **{"fps": 10, name: 10**400})
    for bad in (-5, float("nan"), "abc", 10**400):
        with pytest.raises(ValueError, match=r"video 0: duration=.* must be a positive finite number"):
            preprocess_video(v, fps=10, duration=bad, sample=False)
    assert preprocess_video(v, fps=10, duration=0, sample=False)[2][0]["duration"] == 0.0  # 0: unknown
    rate = Fraction(30000, 1001)
    got, want = preprocess_video(v, fps=rate), preprocess_video(v, fps=float(rate))
    assert np.array_equal(got[0], want[0]) and got[2] == want[2] and got[2][0]["fps"] == float(rate)
