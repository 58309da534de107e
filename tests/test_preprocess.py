"""The host preprocessor equals HF's Glm5NextImageProcessorPil bit for bit, and refuses bad images."""

import hashlib
import io
import json
import re
import struct
import threading
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.golden import cases

from glmvit_cupy import ImageError
from glmvit_cupy import Patching, preprocess
from glmvit_cupy.preprocessing.decode import load_rgb
from glmvit_cupy.preprocessing.image import normalise_patchify, prepare_canvas, smart_resize

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
    """Each image's rows in turn, the bits it has alone (preprocess writes them into one array's slices)."""
    pv, grid = preprocess([zoo["rgb_28x28"], zoo["gray_L"]])
    assert grid.tolist() == [[1, 8, 8], [1, 10, 8]]
    assert pv.shape == (64 + 80, 1176)
    alone = np.concatenate([preprocess(zoo["rgb_28x28"])[0], preprocess(zoo["gray_L"])[0]])
    assert np.array_equal(pv.view(np.uint32), alone.view(np.uint32))
    canvas = np.random.default_rng(1).integers(0, 256, (28, 56, 3), dtype=np.uint8)
    for bad in (np.empty((7, 1176), np.float32), np.empty((8, 1176), np.float64), np.empty((1176, 8), np.float32).T):
        with pytest.raises(ValueError, match="out must be a C-contiguous float32"):
            normalise_patchify(canvas, out=bad)


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


@pytest.mark.parametrize("kw", [dict(min_image_tokens=10**6, max_image_tokens=2 * 10**6),
                                dict(patching=Patching(patch_size=10**6)),
                                dict(patching=Patching(temporal_patch_size=10**9))])
def test_a_canvas_past_memory_is_refused_before_it_is_made(kw):
    # A huge minimum or patching would ask for terabytes: a ValueError naming the canvas, not a MemoryError
    # (or the kernel's OOM killer) once the arrays are allocated.
    rgb = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)
    with pytest.raises(ValueError, match=r"64x64 image would become a \d+x\d+ canvas.*pixel values"):
        preprocess([rgb], **kw)
    assert smart_resize(64, 64, min_image_tokens=456_000, max_image_tokens=456_000)  # just under: allowed


@pytest.mark.parametrize("kind", [np.uint8, np.int16, np.uint16, np.int64])
def test_numpy_integer_sizes_and_patching_give_what_python_ints_give(kind):
    """NumPy's fixed-width integers wrapped in the canvas arithmetic: uint8 sizes looped forever in the binary
    search, int16 ones gave another canvas, an int16 Patching a math domain error."""
    h, w = (200, 250) if kind is np.uint8 else (3000, 2000)
    assert smart_resize(kind(h), kind(w), max_image_tokens=30) == smart_resize(h, w, max_image_tokens=30)
    patching = Patching(kind(14), kind(2), kind(2))
    assert patching == Patching() and type(patching.patch_size) is int
    rgb = np.random.default_rng(1).integers(0, 256, (900, 1200, 3), np.uint8)
    pv, grid = preprocess([rgb], patching=patching, max_image_tokens=300)
    want, want_grid = preprocess([rgb], max_image_tokens=300)
    assert np.array_equal(grid, want_grid) and np.array_equal(pv, want)


@pytest.mark.parametrize("hw", [(0, 0), (0, 40), (40, -1), (40.0, 40)])
def test_a_size_without_pixels_is_a_value_error_not_a_division_by_zero(hw):
    # A video stream that declares 0 x 0 reached smart_resize from glmvit-serve's admission: a 500 once.
    from glmvit_cupy.serving.decoding import pixels_held

    with pytest.raises(ValueError, match="both sides positive integers"):
        smart_resize(*hw)
    assert pixels_held(0, hw[::-1], 16, 8000, Patching(), frames=4) == 0  # the decode refuses it, saying why


@pytest.mark.parametrize("kw", [dict(factor=0), dict(temporal_factor=0), dict(num_frames=0), dict(num_frames=-2)])
def test_a_sampling_factor_below_one_is_a_value_error_not_a_division_by_zero(kw):
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be a positive integer"):
        smart_resize(40, 40, **kw)


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
    cut.write_bytes(buf.getvalue()[:300])  # inside the header: Pillow says "Truncated File Read"
    with pytest.raises(ImageError, match="cut.jpg.*the file ends early"):
        preprocess([str(cut)])
    buf = io.BytesIO()
    Image.fromarray(cases._smooth(60, 80)).save(buf, "WEBP")
    cut = tmp_path / "cut.webp"
    cut.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ImageError, match=r"cut.webp.*could not create decoder object\); the WebP data is incomplete"):
        preprocess([str(cut)])
    with pytest.raises(ImageError, match="no such file"):
        preprocess([str(tmp_path / "missing.png")])
    with pytest.raises(ImageError, match="image 1"):
        preprocess([zoo["rgb_28x28"], io.BytesIO(b"not an image")])


def test_a_damaged_exif_tag_is_an_image_error_and_a_run_goes_on(tmp_path, capsys):
    """An EXIF tag of the wrong type makes Pillow's exif_transpose raise struct.error: the image is refused
    by name (ImageError), and glmvit-encode skips it and encodes the rest."""
    from glmvit_cupy.cli.main import main as cli_main

    exif = Image.Exif()
    exif[0x112], exif[0x10F] = 6, "Cam"  # orientation 6, and a Make tag whose type is then damaged
    buf = io.BytesIO()
    Image.new("RGB", (40, 50)).save(buf, "JPEG", exif=exif)
    bad = buf.getvalue().replace(b"\x01\x0f\x00\x02", b"\x01\x08\x00\x02")
    assert bad != buf.getvalue()
    with pytest.raises(ImageError, match=r"image 0 \(bytes\): cannot decode image \(error: .*the file is damaged"):
        preprocess([bad])
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.jpg").write_bytes(bad)
    Image.new("RGB", (40, 50), (9, 90, 200)).save(tmp_path / "in" / "good.png")
    assert cli_main([str(tmp_path / "in"), "--checkpoint", cases.TOWER_DIR, "--out", str(tmp_path / "out"),
                     "--cpu"]) == 1  # some inputs failed
    said = "".join(capsys.readouterr())
    assert "skipped" in said and "bad.jpg: cannot decode image" in said, said
    assert "1 image," in said and "1 failed" in said and "Traceback" not in said, said


def test_damaged_headers_of_other_formats_are_image_errors():
    """Pillow's DDS and BLP readers raise NotImplementedError (BLPFormatError) on a damaged header: an
    ImageError naming the image, as for every damaged file, not an escape that stops a run."""
    buf = io.BytesIO()
    Image.new("RGBA", (8, 8)).save(buf, "DDS")
    dds = bytearray(buf.getvalue())
    dds[80:84] = bytes(4)  # pixel format flags 0
    buf = io.BytesIO()
    Image.new("P", (8, 8)).save(buf, "BLP")
    blp = bytearray(buf.getvalue())
    blp[4:8] = b"\x09\0\0\0"  # compression 9
    for data in (dds, blp):
        with pytest.raises(ImageError, match=r"image 0 \(bytes\): cannot decode image"):
            preprocess([bytes(data)])


def test_a_pngs_header_size_is_read_from_ihdr_without_opening_it(rng, monkeypatch, tmp_path):
    """glmvit-serve reads small images' sizes on its event loop: Pillow's open inflates every zTXt chunk before
    the image data (58 chunks of 1 MB in a 61 KB file: ~0.1 s), so a PNG is sized from its IHDR, as Pillow
    sizes it, and never opened there, as bytes or as a file (video frames given as paths). Other formats
    still are."""
    from PIL import PngImagePlugin

    from glmvit_cupy.preprocessing import decode

    info = PngImagePlugin.PngInfo()
    for k in range(3):
        info.add_text(f"t{k}", "x" * 100_000, zip=True)
    for h, w in ((61, 47), (1, 900), (300, 2)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG", pnginfo=info)
        data = buf.getvalue()
        assert data.count(b"zTXt") == 3
        with Image.open(io.BytesIO(data)) as im:
            assert im.size == (w, h)
        with monkeypatch.context() as m:
            m.setattr(decode.Image, "open", lambda *a, **k: pytest.fail("a PNG was opened to size it"))
            assert decode.header_size(data) == (h * w, (w, h))
            (tmp_path / "t.png").write_bytes(data)
            assert decode.header_size(str(tmp_path / "t.png")) == (h * w, (w, h))
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(buf, "BMP")
    assert decode.header_size(buf.getvalue()) == (600, (30, 20))
    for at, byte in ((12, ord("X")), (20, 0x7F), (30, 0)):  # not IHDR; a size or CRC the CRC does not hold
        bad = bytearray(data)
        bad[at] = byte
        assert decode.header_size(bytes(bad)) == (0, None)  # left to Pillow, which names the damage


def test_every_bytes_like_holding_a_file_is_that_file(rng):
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (61, 47, 3), dtype=np.uint8)).save(buf, "PNG")
    data = buf.getvalue()
    want = preprocess([data])
    strided = memoryview(bytes(b for b in data for _ in range(2)))[::2]  # the file's bytes, not C-contiguous
    assert not strided.c_contiguous and strided.tobytes() == data
    from glmvit_cupy.preprocessing.decode import header_size

    assert header_size(strided) == header_size(data) == (61 * 47, (47, 61))  # the pixel caps count it too
    for held in (bytearray(data), memoryview(data), memoryview(bytearray(data)), strided):
        got = preprocess([held])
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), type(held)


def test_an_unknown_format_says_so_without_pillows_object_repr():
    with pytest.raises(ImageError) as e:
        preprocess([b"<svg xmlns='http://www.w3.org/2000/svg'/>"])
    assert "not in an image format Pillow reads" in str(e.value) and " object at 0x" not in str(e.value)


def test_a_url_is_refused_saying_it_is_not_fetched():
    with pytest.raises(ImageError, match=r"https://example.invalid/a.png: no such file; URLs are not fetched"):
        preprocess(["https://example.invalid/a.png"])


def test_zero_size_and_bad_arrays():
    with pytest.raises(ImageError, match="zero-size"):
        preprocess([np.zeros((0, 5, 3), np.uint8)])
    with pytest.raises(ImageError, match="uint8"):
        preprocess([np.zeros((5, 5, 3), np.float32)])
    with pytest.raises(ImageError, match="unsupported input type int; pass a path.*uint8 array$"):
        preprocess([42])
    with pytest.raises(ImageError, match="unsupported input type generator; .* several images go in a list"):
        preprocess(p for p in ["a.png", "b.png"])
    with pytest.raises(ImageError, match="no images"):
        preprocess([])


def test_decompression_bomb(tmp_path, monkeypatch):
    p = tmp_path / "bomb.png"
    Image.new("RGB", (2000, 2000)).save(p)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageError, match="decompression bomb") as e:
        preprocess([str(p)])
    # One limit in the message, Pillow's (twice it, where Pillow raises) left out; the image's size given.
    assert "limit of 1,000 pixels" in str(e.value) and "(it is 4,000,000)" in str(e.value), str(e.value)
    assert "2000" not in str(e.value).replace("2000 x 2000", ""), str(e.value)


def test_bad_token_limits():
    # One token is the smallest budget: a 28 x 28 canvas, 2 x 2 patches.
    assert preprocess([np.zeros((500, 500, 3), np.uint8)], max_image_tokens=1, min_image_tokens=1)[1].tolist() \
        == [[1, 2, 2]]
    with pytest.raises(ValueError, match="max_image_tokens=0 must be an integer from 1 to 2,147,483,647"):
        preprocess([np.zeros((5, 5, 3), np.uint8)], max_image_tokens=0)
    with pytest.raises(ValueError, match="min_image_tokens=True must be an integer from 0 to 2,147,483,647"):
        preprocess([np.zeros((5, 5, 3), np.uint8)], min_image_tokens=True)  # a bool is not a token count
    with pytest.raises(ValueError, match="min_image_tokens=-1 must be an integer from 0 to 2,147,483,647"):
        preprocess([np.zeros((5, 5, 3), np.uint8)], min_image_tokens=-1)
    with pytest.raises(ValueError, match="max_image_tokens=2147483648 must be an integer from 1 to 2,147,483,647"):
        preprocess([np.zeros((5, 5, 3), np.uint8)], max_image_tokens=2**31)  # past it the resize's float math overflows
    # 0 is no minimum, as the reference allows: a 20 x 30 image stays 1 x 2 tokens (16 would scale it up)
    assert preprocess([np.zeros((20, 30, 3), np.uint8)], min_image_tokens=0)[1].tolist() == [[1, 2, 4]]
    # numpy integers are token counts, as encode() takes them
    assert preprocess([np.zeros((500, 500, 3), np.uint8)], max_image_tokens=np.int64(1),
                      min_image_tokens=np.int32(1))[1].tolist() == [[1, 2, 2]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "5"])
def test_bad_max_pixels_is_refused_as_a_setting_before_any_image(bad, tmp_path):
    """max_pixels is the decompression-bomb limit: None or a positive integer. Anything else is a ValueError
    naming the setting, from every entry, before an image is read (not a per-image refusal of every image)."""
    from glmvit_cupy.scheduling.batching import preparer

    png = io.BytesIO()
    Image.new("RGB", (64, 48)).save(png, "PNG")
    for call in (lambda: preprocess([io.BytesIO(png.getvalue())], max_pixels=bad),
                 lambda: prepare_canvas(io.BytesIO(png.getvalue()), max_pixels=bad),
                 lambda: preparer(cases.GEOMETRY, 600, max_pixels=bad)):
        with pytest.raises(ValueError, match=rf"max_pixels={bad!r} must be a positive integer"):
            call()
    assert preprocess([io.BytesIO(png.getvalue())], max_pixels=64 * 48)[1].tolist() == [[1, 8, 10]]


def _photo(h, w, seed):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)).astype(np.int16)
    return np.clip(img + rng.integers(-20, 21, img.shape, dtype=np.int16), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("fmt,kw", [("JPEG", {"quality": 92}), ("JPEG", {"progressive": True}), ("PNG", {})])
def test_one_block_decode_gives_pillows_pixels(fmt, kw):
    """The whole file goes to Pillow's decoder in one call (the GIL is taken once): files well over Pillow's
    64 KiB block decode to the same bytes as Pillow's default loop, EXIF rotation included."""
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90
    Image.fromarray(_photo(700, 1100, 5)).save(buf, fmt, exif=exif, **kw)
    data = buf.getvalue()
    assert len(data) > 2 * 65536  # several of Pillow's default blocks
    from PIL import ImageOps

    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert want.shape == (1100, 700, 3)
    for source in (data, io.BytesIO(data)):
        assert np.array_equal(load_rgb(source), want)


def _tiff_of_shared_strips(row: bytes, strips: int, pad: int) -> bytes:
    """An uncompressed grey TIFF, one row a strip, every strip at the one offset of `row`, then `pad` bytes."""
    entries = ((256, 4, 1, len(row)), (257, 4, 1, strips), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (273, 4, strips, None), (278, 4, 1, 1), (279, 4, strips, None))
    offsets_at = 8 + 2 + 12 * len(entries) + 4
    counts_at = offsets_at + 4 * strips
    row_at = counts_at + 4 * strips
    values = {273: offsets_at, 279: counts_at}
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHII", tag, kind, n, values.get(tag, v)) for tag, kind, n, v in entries) + b"\0" * 4
    return (b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack(f"<{strips}I", *[row_at] * strips)
            + struct.pack(f"<{strips}I", *[len(row)] * strips) + row + b"\0" * pad)


def test_strips_sharing_one_offset_are_read_in_pillows_blocks_not_the_whole_files(rng):
    """Pillow reads a tile up to the next one's offset, but a whole block for tiles sharing an offset: with the
    one-call block (64 MiB), a TIFF whose strips all point at one row read the rest of the file once per strip
    (a 50 MB file of 200 strips took 7.6 s, Pillow alone 0.04 s). Such a file is read in Pillow's blocks."""

    class Counted(io.BytesIO):
        read_bytes = 0

        def read(self, n=-1):
            got = super().read(n)
            Counted.read_bytes += len(got)
            return got

    row = rng.integers(0, 256, int(rng.integers(20, 60)), dtype=np.uint8)
    strips = int(rng.integers(40, 80))
    data = _tiff_of_shared_strips(row.tobytes(), strips, 4 << 20)
    with Image.open(io.BytesIO(data)) as f:
        assert len(f.tile) == strips
        want = np.asarray(f.convert("RGB"))
    assert np.array_equal(want, np.repeat(np.broadcast_to(row, (strips, len(row)))[..., None], 3, axis=2))
    assert np.array_equal(load_rgb(Counted(data)), want)
    assert Counted.read_bytes <= len(data) + strips * 65536  # Pillow's own: a 64 KiB block a strip at most


@pytest.mark.parametrize("h,w", [(1, 1), (1, 37), (53, 1), (97, 131), (480, 640)])
def test_rgb_pixels_into_a_given_buffer(h, w):
    """The GIL-free copy: the first three of four bytes a pixel, in the buffer the caller lends (fresh random
    pixels; the buffer poisoned first), equal to Pillow's own packing."""
    from glmvit_cupy.preprocessing.decode import rgb_pixels

    pil = Image.fromarray(_photo(h, w, h * w))
    lent = []

    def buffer(shape):
        lent.append(np.full(shape, 0xA5, np.uint8))
        return lent[-1]

    out = rgb_pixels(pil, buffer)
    assert lent and lent[0].shape == (h, w, 4) and out.shape == (h, w, 3)
    assert out.__array_interface__["data"][0] == lent[0].__array_interface__["data"][0]  # a view, no copy
    assert np.array_equal(out, np.asarray(pil))
    assert np.array_equal(rgb_pixels(pil), np.asarray(pil))  # NumPy's memory by default
    arr = np.asarray(pil)
    assert rgb_pixels(arr) is arr  # arrays pass through


def test_gpu_resize_input_is_the_decoded_image_in_lent_memory(tmp_path):
    """prepare_canvas(resize="gpu") hands the decoded pixels over in host_buffer memory, named by `name`."""
    path = tmp_path / "p.jpg"
    Image.fromarray(_photo(300, 500, 9)).save(path, quality=90)
    shapes = []

    def buffer(shape):
        shapes.append(shape)
        return np.zeros(shape, np.uint8)

    img, grid, info = prepare_canvas(path.read_bytes(), 3, max_image_tokens=64, resize="gpu", host_buffer=buffer,
                                     name="photo p")
    assert shapes == [(300, 500, 4)] and info["source"] == "photo p" and info["content"] != (300, 500)
    assert np.array_equal(img, np.asarray(Image.open(path).convert("RGB")))
    with pytest.raises(ImageError, match="^photo q: cannot decode"):
        prepare_canvas(b"not an image", 0, resize="gpu", name="photo q")


@pytest.mark.parametrize("kind", ["upright", "progressive", "rotated", "xmp-rotated", "grey", "cmyk", "png"])
def test_decoding_into_lent_memory_gives_pillows_pixels(kind, monkeypatch):
    """With a host_buffer, an upright colour JPEG is decoded by Pillow straight into a lent [H, W, 4] buffer
    (poisoned first); a JPEG that EXIF (or XMP) turns, a grey or CMYK one and a PNG are decoded as usual
    and copied in after. Every way gives the reference's pixels."""
    from PIL import ImageOps

    buf = io.BytesIO()
    img = Image.fromarray(_photo(240, 320, 11))
    exif = Image.Exif()
    if kind != "xmp-rotated":
        exif[0x0112] = 6 if kind == "rotated" else 1
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    if kind == "grey":
        img = img.convert("L")
    if kind == "cmyk":
        img = img.convert("CMYK")
    img.save(buf, "PNG" if kind == "png" else "JPEG", quality=90, exif=exif, progressive=kind == "progressive",
             **({"xmp": xmp} if kind == "xmp-rotated" else {}))
    data = buf.getvalue()
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert want.shape[:2] == ((320, 240) if "rotated" in kind else (240, 320))  # the turn happened
    assert want.shape[:2] == ((320, 240) if "rotated" in kind else (240, 320))  # the turn happened
    lent = []

    def buffer(shape):
        lent.append(np.full(shape, 0xA5, np.uint8))
        return lent[-1]

    pastes = []
    real = Image.Image.paste
    monkeypatch.setattr(Image.Image, "paste", lambda self, *a, **k: (pastes.append(1), real(self, *a, **k))[1])
    got, _, info = prepare_canvas(data, 0, max_image_tokens=64, resize="gpu", host_buffer=buffer)
    assert np.array_equal(got, want) and info["size"] == want.shape[:2]
    assert len(pastes) == (0 if kind in ("upright", "progressive") else 1)  # upright JPEGs were decoded in place
    assert len(lent) == 1 and got.__array_interface__["data"][0] == lent[0].__array_interface__["data"][0]
    host, _, _ = prepare_canvas(data, 0, max_image_tokens=64, host_buffer=buffer)  # host resize: not lent
    assert len(lent) == 1 and host.shape[2] == 3


@pytest.mark.parametrize("name", sorted(GOLDEN["images"]))
def test_the_gpu_paths_input_is_the_reference_image(zoo, name):
    """Every kind of image in the zoo: what resize "gpu" hands the GPU (decoded into lent memory, pasted,
    or the array as given) is the reference's RGB image, and resizing it with the integer twin of the GPU
    kernels and padding gives the host canvas bit for bit."""
    from glmvit_cupy.preprocessing import resample
    from glmvit_cupy.preprocessing.decode import load_rgb

    if "error" in GOLDEN["images"][name]:
        pytest.skip("an image the reference refuses (tested above)")
    item = zoo[name]
    img, kw = item if isinstance(item, tuple) else (item, {})

    def buffer(shape):
        return np.full(shape, 0x5A, np.uint8)

    got, grid, info = prepare_canvas(img, 0, resize="gpu", host_buffer=buffer, **kw)
    assert info["resize"] == "gpu" and np.array_equal(got, load_rgb(img))
    canvas, grid_h, _ = prepare_canvas(img, 0, **kw)
    ch, cw = info["content"]
    out = np.zeros_like(canvas)
    out[:ch, :cw] = resample.resize(np.ascontiguousarray(got), ch, cw) if (ch, cw) != got.shape[:2] else got
    assert grid == grid_h and np.array_equal(out, canvas)


def test_four_channels_finds_the_4_byte_buffer_under_an_rgb_view(rng):
    """What the uploads copy in one piece: [H, W, :3] views of contiguous memory starting where the view starts
    (an exact [H, W, 4] buffer, or the front of a larger one, as a decoding thread's reused buffer is), and
    nothing else."""
    from glmvit_cupy.preprocessing.decode import four_channels

    exact = rng.integers(0, 256, (5, 7, 4), dtype=np.uint8)
    got = four_channels(exact[..., :3])
    assert got is not None and got.shape == (5, 7, 4) and np.shares_memory(got, exact)
    assert np.array_equal(got, exact)
    big = rng.integers(0, 256, 1000, dtype=np.uint8)
    view = big[:5 * 7 * 4].reshape(5, 7, 4)[..., :3]
    got = four_channels(view)
    assert got is not None and np.array_equal(got[..., :3], view) and np.shares_memory(got, big)
    assert four_channels(exact[1:, :, :3]) is None          # does not start where its memory starts
    assert four_channels(exact[:, 1:, :3]) is None          # rows are not 4 x its width apart
    assert four_channels(np.ascontiguousarray(exact[..., :3])) is None  # 3 bytes a pixel already
    assert four_channels(exact.view(np.int8)[..., :3]) is None  # not uint8


@pytest.mark.parametrize("shape", [(1, 40, 3), (3, 50, 3), (4, 31, 3), (4, 7, 4), (1, 300, 1)])
def test_arrays_are_height_width_channels_whatever_their_height(shape, rng):
    """An array is always read as H x W x C. (HF's processor guesses the channel axis and reads an array whose
    first dimension is 1, 3 or 4 as channels-first: a 1 x 40 RGB strip becomes a 40 x 3 grey image there. We
    keep the one rule, so an array encodes as the same picture given as a PIL image.)"""
    a = rng.integers(0, 256, shape, dtype=np.uint8)
    pil = Image.fromarray(a[..., 0] if shape[2] == 1 else a, {1: "L", 3: "RGB", 4: "RGBA"}[shape[2]])
    pv, grid = preprocess([a])
    pv2, grid2 = preprocess([pil])
    assert np.array_equal(grid, grid2) and np.array_equal(pv, pv2)
    assert grid[0, 1] * 14 <= 3 * 14 * 28 and grid[0, 2] >= grid[0, 1]  # wide, as the strip is


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this OS")
def test_an_image_path_that_is_a_fifo_or_device_is_refused_by_what_it_is(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "zero.jpg").symlink_to("/dev/zero")
    (tmp_path / "gone.jpg").symlink_to(tmp_path / "nothing")
    for name, says in (("pipe.png", "is a FIFO (named pipe), not an image file"),
                       ("zero.jpg", "is a character device, not an image file"),
                       ("gone.jpg", "is a broken symbolic link, not an image file")):
        with pytest.raises(ImageError, match=re.escape(says)):
            preprocess([str(tmp_path / name)])


@pytest.mark.parametrize("patch,merge,frames", [(14, 2, 2), (16, 3, 1), (8, 1, 3), (6, 4, 2)])
def test_other_patchings_put_each_patch_where_its_position_says(patch, merge, frames, rng):
    """A tower of another patch size, merge or frame count (Patching) gets rows of 3 x frames x patch^2
    values, patch i of a frame at the (h, w) that merge-block order gives it: written out here from the
    position alone and the rescale + normalise table, on a random canvas-sized image (no resize)."""
    from glmvit_cupy.preprocessing.image import Patching, value_table

    pt = Patching(patch, merge, frames)
    th, tw = 3, 5  # tokens down and across
    rgb = rng.integers(0, 256, (th * pt.factor, tw * pt.factor, 3), dtype=np.uint8)
    pv, grid = preprocess([rgb], min_image_tokens=0, max_image_tokens=th * tw, patching=pt)
    assert grid.tolist() == [[1, th * merge, tw * merge]] and pv.shape == (th * tw * merge**2, 3 * frames * patch**2)
    table = value_table()
    for i in range(pv.shape[0]):
        blk, j = divmod(i, merge * merge)
        ph, pw = blk // tw * merge + j // merge, blk % tw * merge + j % merge
        px = rgb[ph * patch:(ph + 1) * patch, pw * patch:(pw + 1) * patch]  # [patch, patch, 3]
        want = np.stack([np.stack([table[c][px[..., c]].ravel()] * frames) for c in range(3)])  # (c, t, py*px)
        assert np.array_equal(pv[i], want.ravel()), (i, ph, pw)


def test_a_tower_whose_patches_are_not_rgb_is_refused_for_images():
    from glmvit_cupy import VisionGeometry
    from glmvit_cupy.preprocessing.image import Patching
    from glmvit_cupy.scheduling.batching import preparer

    assert Patching.of(VisionGeometry(patch_size=16, spatial_merge_size=3, temporal_patch_size=1)) == Patching(16, 3, 1)
    with pytest.raises(ValueError, match="in_channels = 1; use encode_pixels"):
        preparer(VisionGeometry(in_channels=1), 64)
    for bad in ({"patch_size": 0}, {"merge_size": True}, {"temporal_patch_size": 2.0}):
        with pytest.raises(ValueError, match=f"Patching: {next(iter(bad))}="):
            Patching(**bad)
    with pytest.raises(TypeError, match=r"give a glmvit_cupy.Patching, e.g. Patching.of\(model.geometry\)"):
        preprocess([np.zeros((28, 28, 3), np.uint8)], patching=VisionGeometry())


def test_formats_outside_the_in_process_set_go_to_offload_when_it_is_set(monkeypatch, rng):
    """decode.offload (glmvit-serve's other process) receives the file of every format whose decoder may hold
    the GIL or outgrow its header (JPEG 2000, ICNS, TGA, ...), and only those: JPEG and PNG decode here. Its
    array comes back as the image."""
    from glmvit_cupy.preprocessing import decode

    pixels = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    files = {}
    for kind in ("PNG", "JPEG", "TGA", "JPEG2000"):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, kind)
        files[kind] = buf.getvalue()
    calls = []

    def offload(data, name, max_pixels):
        calls.append(data)
        decode.offload = None  # as in the other process
        try:
            return decode.decode_rgb(data, name, max_pixels)
        finally:
            decode.offload = offload

    monkeypatch.setattr(decode, "offload", offload)
    for kind, data in files.items():
        got = decode.rgb_pixels(decode.load(data, kind))
        assert got.shape == (20, 30, 3)
    assert calls == [files["TGA"], files["JPEG2000"]]


def test_an_image_larger_decoded_than_its_header_said_is_refused(monkeypatch):
    """The pixel limit holds for the decoded size too: an ICNS icon's header may name a small size while
    what it holds decodes larger (a 3 KB icon held an 88 MP image). Here Pillow's size grows at load."""
    from glmvit_cupy.preprocessing import decode

    buf = io.BytesIO()
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(buf, "PNG")
    real_load = Image.Image.load

    def grows(self):
        out = real_load(self)
        if self.format == "PNG" and self.size == (40, 40):
            self._size = (4000, 4000)  # what an icon's embedded image does to it
        return out

    monkeypatch.setattr(Image.Image, "load", grows)
    with pytest.raises(ImageError, match="decoded, it is 4000 x 4000 = 16,000,000; its header said less"):
        decode.load(buf.getvalue(), "icon", max_pixels=1_000_000)


def _ico_holding(png_bytes: bytes, bmp_entry: bytes = b"") -> bytes:
    """An ICO whose directory entries say 16 x 16 and hold `png_bytes` (a PNG of any size) and, if given,
    a BMP entry's bytes after it."""
    entries = [png_bytes] + ([bmp_entry] if bmp_entry else [])
    head = struct.pack("<HHH", 0, 1, len(entries))
    at, directory = 6 + 16 * len(entries), b""
    for e in entries:
        directory += struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(e), at)
        at += len(e)
    return head + directory + b"".join(entries)


def _pipe(data: bytes):
    """A binary file object over `data` that cannot seek, as a pipe's or an HTTP response's."""
    class Pipe(io.RawIOBase):
        def __init__(self):
            self.left = io.BytesIO(data)

        def readable(self):
            return True

        def readinto(self, b):
            return self.left.readinto(b)

    return io.BufferedReader(Pipe())


def test_a_file_object_in_text_mode_is_named_and_one_that_cannot_seek_is_decoded(tmp_path):
    fresh = np.random.default_rng().integers(0, 255, (30, 40, 3), np.uint8)
    png = io.BytesIO()
    Image.fromarray(fresh).save(png, "PNG")
    (tmp_path / "a.png").write_bytes(png.getvalue())
    with open(tmp_path / "a.png") as text, pytest.raises(
            ImageError, match=r"a.png \(image 0\): a file object in text mode \(it reads str\): open the file in "
                              r"binary mode, open\(path, 'rb'\)"):
        preprocess([text])
    assert np.array_equal(load_rgb(_pipe(png.getvalue())), fresh)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, for 1,600 over 1,000
def test_a_raised_limit_is_not_taken_from_another_threads_raise(monkeypatch):
    """A decode asking for as much as another thread has raised Pillow's global to, for that thread's own open,
    must not open on that raise: the other thread puts the global back mid-open, and Pillow then refused an
    image within the limit asked for (seen as random refusals with glmvit-encode --max-pixels --workers 8)."""
    from glmvit_cupy.preprocessing import decode

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow refuses to open past twice this: 200
    big = io.BytesIO()
    Image.fromarray(np.random.default_rng().integers(0, 255, (30, 30, 3), np.uint8)).save(big, "PNG")
    raised, opening = threading.Event(), threading.Event()
    real_open = Image.open

    def slow_open(*a, **k):  # the other thread restores the global while this open runs
        opening.set()
        time.sleep(0.2)
        return real_open(*a, **k)

    def another():  # as _open does for a decode of max_pixels=10_000, until this thread's open has begun
        with decode._pillow_limit:
            old, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, 10_000
            raised.set()
            opening.wait(0.5)
            Image.MAX_IMAGE_PIXELS = old

    monkeypatch.setattr(Image, "open", slow_open)
    t = threading.Thread(target=another)
    t.start()
    raised.wait()
    try:
        assert decode.load(big.getvalue(), "big.png", max_pixels=10_000).size == (30, 30)
    finally:
        t.join()


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, of the image refused here
def test_the_pixel_limit_is_read_as_the_process_has_it_while_another_thread_raises_it(monkeypatch):
    """A decode asking for a higher limit raises Pillow's global for a moment, under a lock: a decode on
    another thread with the default limit meanwhile still refuses what is over it."""
    from glmvit_cupy.preprocessing import decode

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    over = io.BytesIO()
    Image.fromarray(np.random.default_rng().integers(0, 255, (40, 40, 3), np.uint8)).save(over, "PNG")
    raised = threading.Event()

    def another():  # as _open does for a decode of max_pixels=10**9, held long enough to overlap
        with decode._pillow_limit:
            old, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, 10**9
            raised.set()
            time.sleep(0.3)
            Image.MAX_IMAGE_PIXELS = old

    t = threading.Thread(target=another)
    t.start()
    raised.wait()
    try:
        with pytest.raises(ImageError, match="over the limit of 1,000 pixels"):
            load_rgb(over.getvalue())
    finally:
        t.join()


@pytest.mark.filterwarnings("ignore:Image was not the expected size:UserWarning")  # Pillow's, for this icon
def test_an_icon_holding_an_image_over_the_limit_is_refused_before_it_is_opened(monkeypatch):
    """Pillow decodes an ICO's image as it opens the file, so its limit is checked on the sizes the icon's
    images' own headers give (a PNG's IHDR, a BMP's DIB header) before Pillow sees it: a 688 KB icon
    holding a 13,300 x 13,300 PNG took a process to 1.4 GB only to be refused. One within the limit is
    decoded as before."""
    from glmvit_cupy.preprocessing import decode

    fresh = np.random.default_rng().integers(0, 255, (30, 40, 3), np.uint8)
    big, small = io.BytesIO(), io.BytesIO()
    Image.new("L", (3000, 2000)).save(big, "PNG")  # 6,000,000 pixels in a few KB
    Image.fromarray(fresh).save(small, "PNG")
    dib = struct.pack("<IiiHHIIiiII", 40, 2500, 2 * 2500, 1, 32, 0, 0, 0, 0, 0, 0)  # a 2,500 x 2,500 BMP entry
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    for icon, inside in ((_ico_holding(big.getvalue()), 6_000_000), (_ico_holding(small.getvalue(), dib), 6_250_000)):
        assert decode.ico_pixels(icon) == inside
        for form in (icon, io.BytesIO(icon), _pipe(icon)):  # a pipe's is read whole first: checked the same
            with pytest.raises(ImageError, match=rf"decompression bomb: over the limit of 1,000,000 pixels.*"
                                                 rf"an icon holding an image of {inside:,}"):
                decode.load(form, "icon", max_pixels=1_000_000)
    assert opened == []
    got = decode.rgb_pixels(decode.load(_ico_holding(small.getvalue()), "icon", max_pixels=1_000_000))
    assert np.array_equal(got, fresh) and opened == [1]
    assert decode.ico_pixels(b"\x00\x00\x01\x00\x01") == 0 and decode.ico_pixels(small.getvalue()) == 0


def test_decoding_leaves_the_processs_warning_filters_alone(monkeypatch, tmp_path):
    """Python's warning filters are one list for the whole process (before 3.14): a decode that changed them
    for itself, on one thread, changed them for every other thread and could leave them changed (a bomb
    warning turned into an error for good). Decoding sets none; Pillow's DecompressionBombWarning, where
    the process's filters make it an error, is refused as a bomb by name."""
    from glmvit_cupy.preprocessing import decode

    def changed(*a, **k):
        raise AssertionError("a decode changed the process's warning filters")

    for fn in ("catch_warnings", "simplefilter", "filterwarnings", "resetwarnings"):
        monkeypatch.setattr(warnings, fn, changed)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    over = tmp_path / "over.png"  # 1,600 pixels: over Pillow's limit, under twice it: Pillow warns
    Image.fromarray(np.random.default_rng().integers(0, 255, (40, 40, 3), np.uint8)).save(over)
    big = io.BytesIO()
    Image.new("L", (3000, 2000)).save(big, "PNG")
    filters = list(warnings.filters)
    warnings.filters.insert(0, ("error", None, Image.DecompressionBombWarning, None, 0))
    warnings._filters_mutated() if hasattr(warnings, "_filters_mutated") else None
    try:
        with pytest.raises(ImageError, match="over.png: refused as a possible decompression bomb: over the limit "
                                             "of 1,000 pixels"):
            decode.load(str(over), str(over))
        with pytest.raises(ImageError, match="an icon holding an image of 6,000,000"):
            decode.load(_ico_holding(big.getvalue()), "icon")
        assert decode.rgb_pixels(decode.load(str(over), "over", max_pixels=2000)).shape == (40, 40, 3)
        assert decode.header_size(str(over), 2000) == (1600, (40, 40))
        img = Image.new("RGB", (20, 20))
        assert decode.rgb_pixels(decode.load(img, "pil")).shape == (20, 20, 3)
    finally:
        del warnings.filters[0]
        warnings._filters_mutated() if hasattr(warnings, "_filters_mutated") else None
    assert list(warnings.filters) == filters


def _hf_rgb(img: Image.Image) -> Image.Image:
    """HF's convert_to_rgb of a PIL image: RGBA composited onto white, then RGB."""
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


@pytest.mark.parametrize("kind", ["RGBa", "P with an RGBA palette"])
def test_pil_alpha_not_in_an_a_band_is_dropped_as_hf_drops_it(kind, rng):
    """HF 5.23.0's convert_to_rgb composites onto white only an image with a band named "A" or a transparency
    entry; premultiplied RGBa and a P image whose RGBA palette has no transparency entry (Image.quantize of
    RGBA) go through convert("RGB"), their alpha dropped."""
    rgba = Image.fromarray(rng.integers(0, 256, (30, 41, 4), dtype=np.uint8), "RGBA")
    img = rgba.convert("RGBa") if kind == "RGBa" else rgba.quantize()
    assert kind == "RGBa" or (img.palette.mode == "RGBA" and "transparency" not in img.info)
    ours, grid = preprocess(img)
    want, want_grid = preprocess(img.convert("RGB"))
    assert np.array_equal(grid, want_grid) and np.array_equal(ours, want)
    composited, _ = preprocess(_hf_rgb(img))
    assert not np.array_equal(ours, composited)  # the alpha would matter for these pixels


@pytest.mark.parametrize("kind", ["RGBA", "PA", "P with a transparent index, as a file"])
def test_compositing_in_strips_of_rows_gives_the_whole_images_bits(kind, rng, monkeypatch, tmp_path):
    """Transparency is composited a strip of rows at a time (a whole 89 MP palette image held three RGBA
    copies): strips of 64 pixels here, so a 37 x 41 image is composited a row at a time."""
    from glmvit_cupy.preprocessing import decode

    monkeypatch.setattr(decode, "STRIP_PIXELS", 64)
    rgba = Image.fromarray(rng.integers(0, 256, (37, 41, 4), dtype=np.uint8), "RGBA")
    img = rgba if kind == "RGBA" else rgba.convert("PA")
    if kind.endswith("file"):
        img = rgba.convert("RGB").quantize(colors=64)
        img.info["transparency"] = int(rng.integers(0, 64))
        img.save(tmp_path / "t.png", transparency=img.info["transparency"])
        with Image.open(tmp_path / "t.png") as f:
            f.load()
            want = np.asarray(_hf_rgb(f))
        got = decode.load(str(tmp_path / "t.png"), "t.png")
    else:
        want, got = np.asarray(_hf_rgb(img)), decode.load(img, "img")
    assert np.array_equal(np.asarray(got), want)
    assert not np.array_equal(want, np.asarray(img.convert("RGB")))  # the alpha matters here


def test_a_progressive_jpeg_of_too_many_scans_is_refused_before_it_is_decoded(tmp_path, rng):
    """Each scan decodes the whole image again: a small file of one scan repeated thousands of times took tens
    of seconds on a decoding thread. Pillow's own progressive JPEGs (10 scans) decode as before."""
    from glmvit_cupy.preprocessing import decode

    im = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as f:
        assert np.array_equal(np.asarray(decode.load(data, "ok.jpg")), np.asarray(f.convert("RGB")))
    last = data[data.rfind(b"\xff\xda"):-2]  # the last scan, up to the end marker
    many = data[:-2] + last * decode.MAX_JPEG_SCANS + b"\xff\xd9"
    (tmp_path / "many.jpg").write_bytes(many)
    scans = data.count(b"\xff\xda") + decode.MAX_JPEG_SCANS
    for given in (many, str(tmp_path / "many.jpg")):
        with pytest.raises(ImageError, match=f"many.jpg: a progressive JPEG of {scans} scans, more than the 64"):
            decode.load(given, "many.jpg")


def _strip_tiff(rows: int, big_endian: bool = False) -> bytes:
    """A 1 x rows grey TIFF of one-row strips that all point at one byte (SHORT offsets and counts)."""
    e = ">" if big_endian else "<"
    fields = [(256, 3, 1, 1), (257, 4, 1, rows), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1), (273, 3, rows, 0),
              (277, 3, 1, 1), (278, 4, 1, 1), (279, 3, rows, 0)]
    offsets = 10 + 2 + 12 * len(fields) + 4
    out = (b"MM\0*" if big_endian else b"II*\0") + struct.pack(e + "I", 10) + b"\x80\0" + struct.pack(e + "H", len(fields))
    for tag, kind, count, value in fields:
        if tag in (273, 279):
            value = offsets if tag == 273 else offsets + 2 * rows
            out += struct.pack(e + "HHII", tag, kind, count, value)
        elif kind == 3:
            out += struct.pack(e + "HHIHH", tag, kind, count, value, 0)
        else:
            out += struct.pack(e + "HHII", tag, kind, count, value)
    out += struct.pack(e + "I", 0)
    return out + np.full(rows, 8, e + "u2").tobytes() + np.ones(rows, e + "u2").tobytes()


@pytest.mark.parametrize("big_endian", [False, True])
def test_a_tiff_of_too_many_strips_is_refused_before_pillow_opens_it(tmp_path, big_endian):
    """A 23 MB TIFF of 6,000,000 one-row strips sharing one byte took 86 s and 2 GB to open and decode (Pillow
    builds and decodes a tile a strip), counted as a 6 MP image. Past MAX_TIFF_BLOCKS it is refused by its
    directory's count, as bytes and as a file; one within it decodes as Pillow decodes it."""
    from glmvit_cupy.preprocessing import decode

    small = _strip_tiff(300, big_endian)
    assert decode.tiff_blocks(small) == 300
    with Image.open(io.BytesIO(small)) as f:
        assert np.array_equal(np.asarray(decode.load(small, "ok.tif")), np.asarray(f.convert("RGB")))
    many = _strip_tiff(decode.MAX_TIFF_BLOCKS + 1, big_endian)
    assert decode.header_size(small) == (300, (1, 300)) and decode.header_size(many) == (0, None)  # never opened
    (tmp_path / "many.tif").write_bytes(many)
    for given in (many, str(tmp_path / "many.tif"), io.BytesIO(many)):
        with pytest.raises(ImageError, match=f"many.tif: a TIFF stored in {decode.MAX_TIFF_BLOCKS + 1:,} strips or "
                                             f"tiles, more than the {decode.MAX_TIFF_BLOCKS:,}"):
            decode.load(given, "many.tif")
    for other in (b"", b"II*\0", b"II*\0\xff\xff\xff\x7f", b"\x89PNG\r\n\x1a\n" + bytes(30)):  # cut short, not a TIFF
        assert decode.tiff_blocks(other) == 0


def _png_chunk(kind: bytes, data: bytes = b"") -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _chunky_png(rng, extra: int, where: str, junk: bytes = _png_chunk(b"zzZz")) -> bytes:
    """A random 24 x 16 RGB PNG with `extra` copies of the chunk `junk` (an empty ancillary one) before its
    image data or after it."""
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "PNG")
    png = buf.getvalue()
    junk = junk * extra
    if where == "before its image data":
        return png[:33] + junk + png[33:]
    end = png.rindex(b"IEND") - 4
    return png[:end] + junk + png[end:]


@pytest.mark.parametrize("where", ["before its image data", "after its image data"])
def test_a_png_of_too_many_chunks_is_refused_before_pillow_opens_it(tmp_path, rng, where):
    """A 12 MB PNG of 1,000,000 empty ancillary chunks took 3.5 s to open and decode (Pillow reads each in a
    Python step), before its image data or after it. Past MAX_PNG_CHUNKS it is refused, as bytes and as a file,
    by walking the chunks' lengths; one within it decodes as Pillow decodes it."""
    from glmvit_cupy.preprocessing import decode

    some = _chunky_png(rng, 300, where)
    assert decode.png_chunks(some) == (303, 0)  # IHDR, IDAT, IEND and 300 more
    with Image.open(io.BytesIO(some)) as f:
        assert np.array_equal(np.asarray(decode.load(some, "ok.png")), np.asarray(f.convert("RGB")))
    many = _chunky_png(rng, decode.MAX_PNG_CHUNKS, where)
    assert decode.png_chunks(many) == (decode.MAX_PNG_CHUNKS + 1, 0)  # counting stops past the limit
    (tmp_path / "many.png").write_bytes(many)
    for given in (many, str(tmp_path / "many.png"), io.BytesIO(many)):
        with pytest.raises(ImageError, match=f"many.png: a PNG of over {decode.MAX_PNG_CHUNKS:,} chunks"):
            decode.load(given, "many.png")
    for other in (b"", b"\x89PNG\r\n\x1a\n", b"GIF89a" + bytes(30), some[:40]):  # cut short, not a PNG
        assert decode.png_chunks(other)[0] <= 2


def test_a_png_of_more_than_one_colour_profile_is_refused(tmp_path, rng):
    """Pillow inflates every iCCP chunk as it opens a PNG (outside its text-memory cap): 19,000 chunks of ~1 KB
    that inflate to ~1 MB each took 42.8 s. The PNG format allows one profile; a file of more is refused by its
    chunks' count, and one of one decodes as Pillow decodes it."""
    from glmvit_cupy.preprocessing import decode

    profile = _png_chunk(b"iCCP", b"x\0\0" + zlib.compress(b"\0" * (1 << 16), 9))
    one = _chunky_png(rng, 1, "before its image data", profile)
    assert decode.png_chunks(one) == (4, 1)
    with Image.open(io.BytesIO(one)) as f:
        assert np.array_equal(np.asarray(decode.load(one, "one.png")), np.asarray(f.convert("RGB")))
    two = _chunky_png(rng, 2, "before its image data", profile)
    (tmp_path / "two.png").write_bytes(two)
    for given in (two, str(tmp_path / "two.png")):
        with pytest.raises(ImageError, match="two.png: a PNG of 2 colour profiles \\(iCCP chunks\\); the PNG format "
                                             "allows one"):
            decode.load(given, "two.png")


def _jpeg_segment(marker: int, payload: bytes) -> bytes:
    return b"\xff" + bytes([marker]) + struct.pack(">H", len(payload) + 2) + payload


def test_a_baseline_jpeg_of_many_scans_is_refused(rng):
    """libjpeg decodes a baseline JPEG whose scans hold fewer components than its frame once per scan, over the
    whole image: 100 KB of 10,000 empty one-component scans of a 16 MP frame took 13.8 s. Every JPEG's scans are
    counted, not only a progressive one's; a baseline file of one scan a component decodes as Pillow decodes
    it."""
    from glmvit_cupy.preprocessing import decode

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "JPEG")
    plain = buf.getvalue()
    assert decode.jpeg_scans_in(plain) == 1
    with Image.open(io.BytesIO(plain)) as f:
        assert np.array_equal(np.asarray(decode.load(plain, "ok.jpg")), np.asarray(f.convert("RGB")))
    with Image.open(io.BytesIO(plain)) as f:  # its tables, then scans of the luma component only, no data
        tables = b"".join(_jpeg_segment(m, p) for m, p in _jpeg_segments(plain) if m in (0xDB, 0xC4))
        frame = next(_jpeg_segment(m, p) for m, p in _jpeg_segments(plain) if m == 0xC0)
        assert not f.info.get("progressive")
    scan = _jpeg_segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    many = b"\xff\xd8" + tables + frame + scan * (decode.MAX_JPEG_SCANS + 1) + b"\xff\xd9"
    with Image.open(io.BytesIO(many)) as f:
        assert f.format == "JPEG" and not f.info.get("progressive")
    with pytest.raises(ImageError, match=f"many.jpg: a JPEG of {decode.MAX_JPEG_SCANS + 1} scans, more than the "
                                         f"{decode.MAX_JPEG_SCANS} an image may have here"):
        decode.load(many, "many.jpg")


def _jpeg_segments(data: bytes):
    """(marker, payload) of a JPEG's segments from SOI to its first scan."""
    at = 2
    while data[at + 1] != 0xDA:
        size = int.from_bytes(data[at + 2:at + 4], "big")
        yield data[at + 1], data[at + 4:at + 2 + size]
        at += 2 + size


def test_an_iptc_file_holding_another_image_file_is_refused(rng):
    """Pillow loads an IPTC/NAA file by opening the image file its field (8, 10) holds, in any format, past every
    check here and the pixel limit (a 140 KB PNG of 144 MP inside one decoded, where alone it is refused): such a
    file is refused by its format."""
    from glmvit_cupy.preprocessing import decode

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "PNG")

    def field(record, dataset, data, long=False):
        size = b"\x84\x00" + struct.pack(">I", len(data)) if long else struct.pack(">H", len(data))
        return b"\x1c" + bytes([record, dataset]) + size + data

    iptc = (field(3, 60, b"\x01\x00") + field(3, 20, struct.pack(">I", 24)) + field(3, 30, struct.pack(">I", 16)) +
            field(3, 120, b"\x05") + field(8, 10, buf.getvalue(), long=True))
    with Image.open(io.BytesIO(iptc)) as f:
        assert f.format == "IPTC"
    with pytest.raises(ImageError, match="inner.iptc: an IPTC file is not decoded here \\(it holds another image file"):
        decode.load(iptc, "inner.iptc")


def test_a_tiffs_strips_are_counted_past_many_other_entries():
    """A TIFF's strip count was read from its first directory's first 4,096 entries: 5,000 entries of another tag
    before StripOffsets hid 7,500,000 one-row strips (45 s, 2.7 GB). Every entry of a classic TIFF's directory is
    read."""
    from glmvit_cupy.preprocessing import decode

    strips, padding = decode.MAX_TIFF_BLOCKS + 1, 5000

    def entry(tag, kind, count, value):
        return struct.pack("<HHII", tag, kind, count, value)

    entries = padding + 9
    pixels = 8 + 2 + 12 * entries + 4
    offsets, counts = pixels + 8, pixels + 8 + 4 * strips
    table = [entry(65000, 3, 1, 0)] * padding + [
        entry(256, 4, 1, 8), entry(257, 4, 1, strips), entry(258, 3, 1, 8), entry(259, 3, 1, 1), entry(262, 3, 1, 1),
        entry(273, 4, strips, offsets), entry(277, 3, 1, 1), entry(278, 4, 1, 1), entry(279, 4, strips, counts)]
    tiff = (b"II*\0" + struct.pack("<IH", 8, entries) + b"".join(table) + bytes(4) + b"\x80" * 8 +
            struct.pack("<I", pixels) * strips + struct.pack("<I", 8) * strips)
    assert decode.tiff_blocks(tiff) == strips
    with pytest.raises(ImageError, match=f"padded.tif: a TIFF stored in {strips:,} strips or tiles"):
        decode.load(tiff, "padded.tif")


def test_a_tiff_tag_of_many_fractions_is_refused(rng):
    """Pillow makes a Python Fraction of each RATIONAL value of a tag it reads (XResolution, as it opens the
    file): 7,800,000 in a 62 MB TIFF took 17.8 s and 1.3 GB. A first directory's entry of over MAX_TIFF_FRACTIONS
    is refused before the file is opened; a TIFF Pillow writes (its resolution one fraction each) decodes."""
    from glmvit_cupy.preprocessing import decode

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "TIFF", dpi=(72, 72))
    plain = buf.getvalue()
    assert decode.tiff_fractions(plain) == 1
    with Image.open(io.BytesIO(plain)) as f:
        assert np.array_equal(np.asarray(decode.load(plain, "ok.tif")), np.asarray(f.convert("RGB")))
    count = decode.MAX_TIFF_FRACTIONS + 1
    entries = [(256, 4, 1, 24), (257, 4, 1, 16), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1), (273, 4, 1, 0),
               (277, 3, 1, 1), (278, 4, 1, 16), (279, 4, 1, 384), (282, 5, count, 0)]
    data = 8 + 2 + 12 * len(entries) + 4
    entries = [e if e[0] not in (273, 282) else e[:3] + (data if e[0] == 273 else data + 384,) for e in entries]
    tiff = (b"II*\0" + struct.pack("<IH", 8, len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) +
            bytes(4) + rng.integers(0, 256, 384, dtype=np.uint8).tobytes() + struct.pack("<II", 72, 1) * count)
    assert decode.tiff_fractions(tiff) == count
    assert decode.header_size(tiff) == (0, None)  # never opened
    with pytest.raises(ImageError, match=f"many.tif: a TIFF with a tag of {count:,} fractions"):
        decode.load(tiff, "many.tif")


def test_a_jpeg_of_too_many_header_segments_is_refused_before_pillow_opens_it(tmp_path, rng):
    """Pillow walks a JPEG's marker segments before its first scan in a Python step each as it opens the file,
    and keeps every APP segment: 5,000,000 empty APP5 segments (a 20 MB file) took 7.4 s and 705 MB. Past
    MAX_JPEG_SEGMENTS the file is refused by walking the segments' lengths; one within it (fill bytes before a
    marker too) decodes as Pillow decodes it."""
    from glmvit_cupy.preprocessing import decode

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    plain = decode.jpeg_header_segments(jpeg)
    assert 4 <= plain <= 12  # APP0, DQT, SOF0, DHT: Pillow's writer
    some = jpeg[:2] + b"\xff\xff\xe5\0\x02" * 300 + jpeg[2:]
    assert decode.jpeg_header_segments(some) == plain + 300
    with Image.open(io.BytesIO(some)) as f:
        assert np.array_equal(np.asarray(decode.load(some, "ok.jpg")), np.asarray(f.convert("RGB")))
    many = jpeg[:2] + b"\xff\xe5\0\x02" * decode.MAX_JPEG_SEGMENTS + jpeg[2:]
    assert decode.jpeg_header_segments(many) == decode.MAX_JPEG_SEGMENTS + 1  # counting stops past the limit
    assert decode.header_size(some) == (384, (24, 16)) and decode.header_size(many) == (0, None)  # never opened
    _refused_every_way(tmp_path, many, "many.jpg",
                       f"many.jpg: a JPEG of over {decode.MAX_JPEG_SEGMENTS:,} marker segments")
    for other in (b"", b"\xff\xd8", b"\x89PNG\r\n\x1a\n" + bytes(30), jpeg[:7]):  # cut short, not a JPEG
        assert decode.jpeg_header_segments(other) <= 1


def test_netpbm_files_of_long_headers_or_many_comments_are_refused(tmp_path, rng):
    """Pillow reads a Netpbm header a byte a Python call at a time (10 MB of whitespace: 2.6 s) and removes each
    comment of a plain (ASCII) file's data by copying its block (500,000 in 1 MB: 9.5 s). Past MAX_PNM_HEADER
    header bytes or MAX_PNM_COMMENTS comments a file is refused, and not opened to be sized; within them (a
    comment in the header, as GIMP writes) it decodes as Pillow decodes it."""
    from glmvit_cupy.preprocessing import decode

    pixels = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    binary = b"P6\n# CREATOR: GIMP PNM Filter Version 1.1\n5 6\n255\n" + pixels.tobytes()
    plain = b"P3\n5 6\n255\n" + b"# a note\n" * 300 + " ".join(map(str, pixels.ravel())).encode()
    for name, data in (("binary.ppm", binary), ("plain.ppm", plain)):
        assert decode.pnm_costs(data)[1] == (300 if name == "plain.ppm" else 0)
        assert np.array_equal(np.asarray(decode.load(data, name)), pixels)
        assert decode.header_size(data) == (30, (5, 6))
    spaced = b"P6\n" + b" " * decode.MAX_PNM_HEADER + b"5 6\n255\n" + pixels.tobytes()
    noted = b"P1\n5 6\n" + b"#\n" * (decode.MAX_PNM_COMMENTS + 1) + b"0 1 " * 15
    assert decode.pnm_costs(spaced)[0] == decode.MAX_PNM_HEADER + 1 and decode.header_size(spaced) == (0, None)
    for name, data, said in (("spaced.ppm", spaced, f"over {decode.MAX_PNM_HEADER:,} header bytes"),
                             ("noted.pbm", noted, f"{decode.MAX_PNM_COMMENTS + 1:,} comments")):
        (tmp_path / name).write_bytes(data)
        for given in (data, str(tmp_path / name), io.BytesIO(data)):
            with pytest.raises(ImageError, match=f"{name}: a Netpbm file of {said}, more than an image may have"):
                decode.load(given, name)
    for other in (b"", b"P", b"PK\x03\x04" + bytes(30), b"P6\n5"):  # cut short, not Netpbm
        assert decode.pnm_costs(other)[1] == 0 and decode.pnm_costs(other)[0] <= 4


def _refused_every_way(tmp_path, data: bytes, name: str, match: str) -> None:
    """decode.load refuses a file with `match`, given as its bytes, as a path and as a file object."""
    from glmvit_cupy.preprocessing import decode

    (tmp_path / name).write_bytes(data)
    for given in (data, str(tmp_path / name), io.BytesIO(data)):
        with pytest.raises(ImageError, match=match):
            decode.load(given, name)


def _gif(rng, before: bytes) -> bytes:
    """A 24 x 16 GIF of random colours with `before` inserted ahead of its first image (after the colour
    table)."""
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).convert("P").save(buf, "GIF")
    gif = buf.getvalue()
    at = 13 + (3 << ((gif[10] & 7) + 1) if gif[10] & 0x80 else 0)
    return gif[:at] + before + gif[at:]


def test_a_gif_of_too_many_blocks_before_its_image_is_refused(tmp_path, rng):
    """Pillow reads a GIF's extensions before its first image in a Python step each as it opens the file:
    2,000,000 empty comments (10 MB) took 3.5 s. Past MAX_GIF_BLOCKS blocks (extensions and their sub-blocks)
    the file is refused by walking their lengths, and not opened to be sized; within them it decodes as Pillow
    decodes it."""
    from glmvit_cupy.preprocessing import decode

    plain = decode.gif_blocks(_gif(rng, b""))
    some = _gif(rng, b"\x21\xfe\x05notes\x00" * 300 + b"\x21\xfe" + b"\x01x" * 300 + b"\0")
    assert decode.gif_blocks(some) == plain + 300 * 2 + 301
    with Image.open(io.BytesIO(some)) as f:
        assert np.array_equal(np.asarray(decode.load(some, "ok.gif")), np.asarray(f.convert("RGB")))
    assert decode.header_size(some) == (384, (24, 16))
    for many in (_gif(rng, b"\x21\xfe\x01x\x00" * (decode.MAX_GIF_BLOCKS // 2 + 1)),
                 _gif(rng, b"\x21\xfe" + b"\x01x" * decode.MAX_GIF_BLOCKS + b"\0")):
        assert decode.gif_blocks(many) == decode.MAX_GIF_BLOCKS + 1  # counting stops past the limit
        assert decode.header_size(many) == (0, None)  # never opened
        _refused_every_way(tmp_path, many, "many.gif",
                           f"many.gif: a GIF of over {decode.MAX_GIF_BLOCKS:,} blocks before")
    for other in (b"", b"GIF89a", b"\x89PNG\r\n\x1a\n" + bytes(30), some[:40]):  # cut short, not a GIF
        assert decode.gif_blocks(other) <= 2


def _rle_bmp(width: int, height: int, rows: bytes, bits: int = 8) -> bytes:
    """A palette BMP of RLE (bits 8: RLE8, 4: RLE4) data `rows`, grey palette."""
    colours = 1 << bits
    palette = b"".join(bytes([i * 255 // (colours - 1)] * 3 + [0]) for i in range(colours))
    at = 14 + 40 + len(palette)
    return (b"BM" + struct.pack("<IHHI", at + len(rows), 0, 0, at) +
            struct.pack("<IiiHHIIiiII", 40, width, height, 1, bits, 1 if bits == 8 else 2, len(rows), 2835, 2835,
                        colours, 0) + palette + rows)


@pytest.mark.parametrize("kind", ["QOI", "DDS", "PPM, maximum value 1,000", "BMP, RLE8 rows ended early"])
def test_images_pillow_decodes_in_python_are_bounded_and_decoded_off_the_process(rng, monkeypatch, kind):
    """Pillow decodes some formats with decoders written in Python, a step a pixel holding the GIL (QOI
    ~0.85 us a pixel, a PPM of maximum value 1,000 ~1.7 us; a BMP's RLE ~0.1 us a pixel of a row ended early: a
    38 KB file of 88 MP took 12.2 s and 709 MB). Past MAX_PYTHON_DECODED pixels (a BMP's RLE: its own limit) such
    an image is refused after its header is read, before it is decoded; within it, it decodes as Pillow decodes
    it, and a process that offloads slow decoders (glmvit-serve) hands it to its decoding processes, a BMP too."""
    from glmvit_cupy.preprocessing import decode

    def make(w, h, small):
        if kind.startswith("BMP"):
            row = b"\x01\x07\x00\x00" if not small else bytes([0, w]) + rng.integers(0, 256, w, np.uint8).tobytes()
            return _rle_bmp(w, h, (row + (b"\0" * (w % 2) if small else b"") + b"\0\0" * small) * h + b"\0\1")
        if kind.startswith("PPM"):
            return b"P6\n%d %d\n1000\n" % (w, h) + (rng.integers(0, 1001, (h, w, 3)).astype(">u2").tobytes()
                                                    if small else b"")
        buf = io.BytesIO()
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) if small else Image.new("RGB", (w, h))
        image.save(buf, kind)
        return buf.getvalue()

    most = decode.MAX_PYTHON_DECODED_BY["bmp_rle"] if kind.startswith("BMP") else decode.MAX_PYTHON_DECODED
    data = make(24, 16, small=True)
    with Image.open(io.BytesIO(data)) as f:
        assert decode.python_decoder(f) is not None
        assert np.array_equal(np.asarray(decode.load(data, "ok")), np.asarray(f.convert("RGB")))
    handed, apart = [], rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    monkeypatch.setattr(decode, "offload", lambda data, name, max_pixels: handed.append(name) or apart)
    assert np.array_equal(np.asarray(decode.load(data, "ok")), apart) and handed == ["ok"]
    monkeypatch.setattr(decode, "offload", None)
    large = make(most // 2048 + 1, 2048, small=False)  # one row over the limit
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded"))  # refused from its header
    with pytest.raises(ImageError, match=rf"large: a {kind.split(',')[0]} image of {most // 2048 + 1} x 2048 = "
                                         rf"{(most // 2048 + 1) * 2048:,} pixels whose data Pillow decodes in Python"):
        decode.load(large, "large")


def _overlapping_tiff(width: int, rows: int, gap: int) -> bytes:
    """An uncompressed RGB TIFF of two strips, `rows` rows and one, the second starting `gap` bytes after the
    first (the first's data is rows x width x 3 bytes)."""
    row = width * 3
    pixels = np.random.default_rng(3).integers(0, 256, row * rows + row + gap, dtype=np.uint8).tobytes()
    fields = [(256, 4, 1, width), (257, 4, 1, rows + 1), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 2),
              (273, 4, 2, None), (277, 3, 1, 3), (278, 4, 1, rows), (279, 4, 2, None)]
    ifd = 8 + len(pixels) + (len(pixels) & 1)
    arrays = ifd + 2 + 12 * len(fields) + 4
    out = b"II*\0" + struct.pack("<I", ifd) + pixels + bytes(len(pixels) & 1) + struct.pack("<H", len(fields))
    for tag, kind, count, value in fields:
        if tag == 273:
            value = arrays
        elif tag == 279:
            value = arrays + 8
        out += struct.pack("<HHIHH" if kind == 3 else "<HHII", tag, kind, count, value, *((0,) if kind == 3 else ()))
    out += struct.pack("<I", 0)
    return out + struct.pack("<II", 8, 8 + gap) + struct.pack("<II", row * rows, row)


def test_a_tiff_of_overlapping_uncompressed_strips_is_refused(tmp_path):
    """Pillow reads an uncompressed strip up to the next strip's offset at a time and decodes its growing buffer
    after each read: two strips one byte apart took 5.1 s for a 4.8 MB file, over a minute for 18 MB. A strip
    whose data (one bit a pixel at least) runs past the next one's start is refused; strips end to end decode as
    Pillow decodes them."""
    from glmvit_cupy.preprocessing import decode

    whole = _overlapping_tiff(40, 6, 40 * 6 * 3)
    with Image.open(io.BytesIO(whole)) as f:
        assert decode.tiff_overlap(f.tile) is None
        assert np.array_equal(np.asarray(decode.load(whole, "ok.tif")), np.asarray(f.convert("RGB")))
    bad = _overlapping_tiff(4000, 20, 1)
    with Image.open(io.BytesIO(bad)) as f:
        assert decode.tiff_overlap(f.tile) == (8, 500 * 20, 1)
    (tmp_path / "bad.tif").write_bytes(bad)
    for given in (bad, str(tmp_path / "bad.tif")):
        with pytest.raises(ImageError, match="bad.tif: a TIFF whose uncompressed strips or tiles overlap \\(the one "
                                             "at byte 8 holds at least 10,000 bytes, and the next starts 1 byte after it"):
            decode.load(given, "bad.tif")


@pytest.mark.parametrize("where", ["in its ICC profile", "after its end"])
def test_bytes_reading_as_scan_markers_outside_the_scans_count_for_none(where, rng):
    """Only the scans libjpeg decodes count against MAX_JPEG_SCANS: FF DA inside a segment's payload (a large
    binary ICC profile) or after the end of the image (a Motion Photo's video) is no scan, and such a valid
    progressive JPEG is decoded as Pillow (the reference) decodes it, not refused."""
    from glmvit_cupy.preprocessing import decode

    blob = bytearray(rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes())
    for at in sorted(rng.choice(len(blob) - 2, 2 * decode.MAX_JPEG_SCANS, replace=False)):
        blob[at:at + 2] = b"\xff\xda"
    im = Image.fromarray(rng.integers(0, 256, (int(rng.integers(20, 90)), int(rng.integers(20, 90)), 3),
                                      dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, "JPEG", progressive=True, **({"icc_profile": bytes(blob)} if where.startswith("in") else {}))
    data = buf.getvalue() + (bytes(blob) if where.startswith("after") else b"")
    assert data.count(b"\xff\xda") > decode.MAX_JPEG_SCANS
    with Image.open(io.BytesIO(data)) as f:
        want = np.asarray(f.convert("RGB"))
    assert np.array_equal(load_rgb(data), want)


def test_an_eps_file_is_refused_never_handed_to_ghostscript(tmp_path, monkeypatch):
    """Pillow opens an EPS header itself but decodes the file by running Ghostscript on it: an untrusted file
    is refused by what it is, before anything runs (Ghostscript called here would fail the test)."""
    from PIL import EpsImagePlugin

    from glmvit_cupy.preprocessing import decode

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: pytest.fail("Ghostscript was run"))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto 10 10 lineto stroke\n%%EOF\n"
    (tmp_path / "a.eps").write_bytes(eps)
    for given in (eps, str(tmp_path / "a.eps")):
        with pytest.raises(ImageError, match=r"a.eps: an EPS file is not decoded here \(Pillow decodes it by "
                                             r"running Ghostscript.*convert it to PNG first"):
            decode.load(given, "a.eps")


def test_a_pil_image_whose_file_closed_before_it_loaded_is_an_image_error(tmp_path, rng):
    path = tmp_path / "lazy.png"
    Image.fromarray(rng.integers(0, 256, (30, 30, 3), dtype=np.uint8)).save(path)
    with Image.open(path) as im:
        pass
    with open(path, "rb") as f:  # the caller's own file, closed: Pillow keeps the closed file object
        im2 = Image.open(f)
    for lazy in (im, im2):
        with pytest.raises(ImageError, match=r"image 0 \(PngImageFile\): cannot convert PIL image to RGB .*its file "
                                             r"was closed before its pixels were read: call im.load\(\) while the "
                                             r"file is open"):
            preprocess(lazy)


def test_an_empty_file_an_empty_path_and_an_unreadable_file_are_said_as_such(tmp_path, monkeypatch):
    empty = tmp_path / "e.jpg"
    empty.write_bytes(b"")
    for image in (str(empty), b"", io.BytesIO(b"")):
        with pytest.raises(ImageError, match=r"the file is empty \(0 bytes\); an image file was expected"):
            preprocess(image)
    with pytest.raises(ImageError, match=r"^image 0 \(an empty path\): no such file"):
        preprocess("")
    locked = tmp_path / "locked.png"
    Image.new("RGB", (8, 8)).save(locked)

    def denied(path, *a, **k):  # what open() raises for a file without read permission (root reads it all the same)
        raise PermissionError(13, "Permission denied", str(path))

    from glmvit_cupy.preprocessing import decode

    monkeypatch.setattr(decode.Image, "open", denied)
    with pytest.raises(ImageError, match=r"locked.png: cannot be read \(permission denied\)"):
        preprocess(str(locked))


def test_a_file_that_starts_as_an_image_format_pillow_cannot_open_names_that_format():
    """A PNG of 0 x 0 pixels was called "not in an image format Pillow reads": its first bytes say PNG, and the
    message says so, and that its header is what is wrong."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    empty_png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")
    for form in (empty_png, io.BytesIO(empty_png)):
        with pytest.raises(ImageError, match=r"it starts as a PNG file, but Pillow cannot open it \(its header is "
                                             r"damaged, or gives a size of 0\)"):
            preprocess(form)
    with pytest.raises(ImageError, match="not in an image format Pillow reads"):
        preprocess(b"hello, not an image")


def test_a_video_file_given_as_an_image_is_said_as_a_video(tmp_path):
    """An MP4 or WebM under an image's name (or its bytes given as an image) was "not in an image format Pillow
    reads": it is said to be a video, and how a video is read; an AVIF (an ftyp box too) is still an image."""
    videos = Path(__file__).parent / "golden" / "video_files"
    for source, kind in (("h264_2997.mp4", "MP4/QuickTime"), ("vp9_10bit.webm", "Matroska/WebM")):
        renamed = tmp_path / f"{source}.png"
        renamed.write_bytes((videos / source).read_bytes())
        for form in (str(renamed), renamed.read_bytes()):
            with pytest.raises(ImageError, match=re.escape(f"cannot decode image: it is a video file ({kind}), not an "
                                                           "image; a video is read as one by its name's extension")) as e:
                preprocess(form)
            assert "glmvit-serve's POST /v1/encode_video (Client.encode_video)" in str(e.value)  # the service's way too
    with pytest.raises(ImageError, match="not in an image format Pillow reads"):
        preprocess(b"\0\0\0\x18ftypheic" + bytes(20))  # a HEIC's box: an image format Pillow lacks, not a video


@pytest.mark.parametrize("resize", ["host", "gpu"])
def test_an_image_pillow_cannot_resize_is_an_image_error(resize):
    """A 68,000,000 x 1 image is within Pillow's pixel limit, but resizing it needs over 2 GiB of filter tables:
    Pillow raised MemoryError (a 500 from glmvit-serve, a crash elsewhere), and the GPU path made the tables for
    minutes. It is an ImageError naming the image, before any table is made."""
    from glmvit_cupy.preprocessing.image import prepare_canvas

    wide = np.zeros((1, 68_000_000, 3), np.uint8)
    with pytest.raises(ImageError, match=r"^strip: resizing its 68000000 x 1 pixels to \d+ x \d+ needs filter "
                                         r"tables of over 2 GiB, which Pillow \(the reference's resizer\) refuses"):
        prepare_canvas(wide, resize=resize, name="strip")


def _damaged_avif(rng) -> bytes:
    """An AVIF file whose coded data is zeroed: libavif opens it and fails on its colour planes."""
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(buf, "AVIF")
    data = buf.getvalue()
    at = data.find(b"mdat") + 4
    return data[:at] + bytes(len(data) - at)


def test_a_damaged_avif_is_an_image_error_naming_it(rng):
    """Pillow's AVIF reader raises a plain RuntimeError on a damaged file: refused by name, as other formats'
    damage is, never the whole call (glmvit-encode stopped with a traceback)."""
    from PIL import features

    if not features.check("avif"):
        pytest.skip("this Pillow reads no AVIF")
    data, ok = _damaged_avif(rng), np.zeros((4, 4, 3), np.uint8)
    with pytest.raises(ImageError, match=r"image 1 \(bytes\): cannot decode image \(RuntimeError: .*\); the file is "
                                         r"damaged"):
        preprocess([ok, data])
    with pytest.raises(ImageError, match=r"image 1 \(AvifImageFile\): cannot convert PIL image to RGB \(RuntimeError"):
        preprocess([ok, Image.open(io.BytesIO(data))])


@pytest.mark.parametrize("limit", [np.int32(1_200_000_000), np.uint32(2**31), np.int64(2**62)])
def test_a_numpy_integer_max_pixels_is_the_limit_it_says(limit):
    """max_pixels as a NumPy integer (check_max_pixels takes one) went into Pillow's MAX_IMAGE_PIXELS as it
    was, where Pillow's 2 * MAX_IMAGE_PIXELS wrapped negative: every image, a 64 x 48 PNG too, was refused as
    a decompression bomb 'over the limit of 1,200,000,000 pixels (it is 3,072)'."""
    png = io.BytesIO()
    Image.new("RGB", (64, 48)).save(png, "PNG")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor an overflow RuntimeWarning from Pillow's arithmetic
        assert preprocess([png.getvalue()], max_pixels=limit)[1].tolist() == [[1, 8, 10]]
        assert preprocess([io.BytesIO(png.getvalue())], max_pixels=limit)[1].tolist() == [[1, 8, 10]]


@pytest.mark.parametrize("kw", [dict(patching=Patching(patch_size=10**160)), dict(patching=Patching(merge_size=10**200)),
                                dict(patching=Patching(temporal_patch_size=10**320))])
@pytest.mark.parametrize("min_image_tokens", [0, 16])
def test_an_absurd_patching_is_a_value_error_not_an_overflow(kw, min_image_tokens):
    """A Patching takes any positive integer; one past float range made smart_resize's float math (and the
    canvas message's own formatting) raise OverflowError, not the documented ValueError."""
    with pytest.raises(ValueError, match="pixel values"):
        preprocess([np.zeros((30, 40, 3), np.uint8)], min_image_tokens=min_image_tokens, **kw)
