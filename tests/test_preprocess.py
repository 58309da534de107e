"""The host preprocessor equals HF's Glm5NextImageProcessorPil bit for bit, and refuses bad images."""

import hashlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import ImageError, preprocess
from glmvit_cupy.preprocess import smart_resize
from tests.golden import cases

GOLDEN = json.load(open(cases.PREPROCESS))


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return cases.images(str(tmp_path_factory.mktemp("zoo")))


@pytest.mark.parametrize("name", sorted(GOLDEN["images"]))
def test_bit_identical_to_hf(zoo, name):
    want = GOLDEN["images"][name]
    item = zoo[name]
    img, kw = item if isinstance(item, tuple) else (item, {})
    if "error" in want:
        with pytest.raises(ImageError):
            preprocess([img], **kw)
        return
    pv, grid = preprocess([img], **kw)
    assert pv.dtype == np.float32 and grid.dtype == np.int64
    assert list(pv.shape) == want["shape"] and grid.tolist() == want["grid_thw"]
    assert hashlib.sha256(np.ascontiguousarray(pv).tobytes()).hexdigest() == want["sha256"], \
        f"{name}: sum {pv.astype(np.float64).sum()} vs HF {want['sum']}"


def test_batch_concatenates_in_order(zoo):
    pv, grid = preprocess([zoo["rgb_28x28"], zoo["gray_L"]])
    assert grid.tolist() == [[1, 8, 8], [1, 10, 8]]
    assert pv.shape == (64 + 80, 1176)


def test_golden_tower_inputs_match(zoo):
    g = np.load(cases.OUTPUTS)
    for name, imgs in cases.tower_cases().items():
        pv, grid = preprocess(imgs)
        assert np.array_equal(pv, g[f"{name}/pixel_values"]) and np.array_equal(grid, g[f"{name}/grid_thw"])


@pytest.mark.parametrize("hw,want", [
    ((28, 28), (112, 112)),        # 1 token -> scaled up to the 16-token minimum: 4 x 4 tokens
    ((56 * 4, 56 * 4), (224, 224)),  # exactly 64 tokens: untouched
    ((1, 4000), (28, 4004)),        # 1 x 143 tokens: already over the minimum, aligned up
    ((5000, 3000), (3220, 1932)),   # over 8000 tokens: the binary search's 230 x 138 patches = 7935 tokens
])
def test_smart_resize_cases(hw, want):
    assert smart_resize(*hw) == want


def test_patch_order_is_merge_block_major():
    # A 56 x 56 image has 4 x 4 patches: row 1 of pixel_values is patch (0, 1), row 2 is (1, 0).
    rgb = np.zeros((112, 112, 3), np.uint8)
    rgb[14:28, 0:14] = 255  # patch (h=1, w=0)
    pv, grid = preprocess([rgb], min_image_tokens=16)
    bright = np.where(pv[:, :196].mean(axis=1) > 1.5)[0]
    assert grid.tolist() == [[1, 8, 8]] and bright.tolist() == [2]  # block (0,0), inside it (r=1, c=0) -> 2
    # the temporal axis repeats the frame: (channel, t, py, px)
    assert np.array_equal(pv[:, 0:196], pv[:, 196:392])


def test_undecodable_and_truncated(tmp_path, zoo):
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    with pytest.raises(ImageError, match="junk.png"):
        preprocess([str(junk)])
    buf = io.BytesIO()
    Image.fromarray(cases._smooth(200, 200)).save(buf, "JPEG")
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ImageError, match="cut.jpg"):
        preprocess([zoo["rgb_28x28"], str(cut)])
    with pytest.raises(ImageError, match="no such file"):
        preprocess([str(tmp_path / "missing.png")])
    with pytest.raises(ImageError, match="image 1"):
        preprocess([zoo["rgb_28x28"], io.BytesIO(b"not an image")])


def test_zero_size_and_bad_arrays():
    with pytest.raises(ImageError, match="zero-size"):
        preprocess([np.zeros((0, 5, 3), np.uint8)])
    with pytest.raises(ImageError, match="uint8"):
        preprocess([np.zeros((5, 5, 3), np.float32)])
    with pytest.raises(ImageError, match="unsupported input type"):
        preprocess([42])
    with pytest.raises(ImageError, match="no images"):
        preprocess([])


def test_decompression_bomb(tmp_path, monkeypatch):
    p = tmp_path / "bomb.png"
    Image.new("RGB", (2000, 2000)).save(p)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageError, match="decompression bomb"):
        preprocess([str(p)])


def test_bad_token_limits():
    # One token is the smallest budget: a 28 x 28 canvas, 2 x 2 patches.
    assert preprocess([np.zeros((500, 500, 3), np.uint8)], max_image_tokens=1, min_image_tokens=1)[1].tolist() \
        == [[1, 2, 2]]
    with pytest.raises(ValueError, match="positive integers"):
        preprocess([np.zeros((5, 5, 3), np.uint8)], max_image_tokens=0)
