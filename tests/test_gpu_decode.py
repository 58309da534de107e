"""The GPU decoder's host side, without a GPU: which JPEGs it takes (read from the frame header, as Pillow
would name their mode) and the error when its extra is not installed."""

import io

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy.errors import ImageError
from glmvit_cupy.preprocessing.gpu_decode import components


@pytest.mark.parametrize("mode,kw", [("RGB", {}), ("RGB", {"progressive": True}), ("RGB", {"subsampling": 0}),
                                     ("L", {}), ("CMYK", {}), ("RGB", {"exif": b"Exif\x00\x00" + b"\x00" * 64})])
def test_components_agree_with_pillows_mode(mode, kw, rng):
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)).convert(mode).save(buf, "JPEG", **kw)
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).mode == mode
    assert components(data) == {"L": 1, "RGB": 3, "CMYK": 4}[mode]
    for cut in (3, 20, data.index(b"\xff\xc0" if b"\xff\xc0" in data else b"\xff\xc2") + 5):
        assert components(data[:cut]) is None  # stops before the frame's component count: not taken


def test_not_a_jpeg_is_not_taken():
    assert components(b"\xff\xd8\xff" + b"\x00" * 10) is None
    assert components(b"") is None


def test_without_the_extra_the_error_says_what_to_install():
    try:
        import nvidia.nvimgcodec  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("nvImageCodec is installed here")
    from glmvit_cupy.preprocessing.gpu_decode import Decoder

    with pytest.raises(ImageError, match=r"pip install -e '\.\[gpu-decode-cu12\]'"):
        Decoder()


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this OS")
def test_a_fifo_path_is_left_to_pillows_path_not_read(tmp_path):
    """A FIFO path is declined at once, never read (None: the Pillow path then refuses it by what it is). In a
    daemon thread: a decode that reads the path whole would block on it, and the test fails, not hangs."""
    import os
    import threading

    from glmvit_cupy.preprocessing.gpu_decode import Decoder

    os.mkfifo(tmp_path / "pipe.jpg")
    decoder = Decoder.__new__(Decoder)  # the file handling only: nvImageCodec is not needed before the read
    got = []
    t = threading.Thread(target=lambda: got.append(decoder.decode(str(tmp_path / "pipe.jpg"))), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and got == [None]


def test_a_progressive_jpeg_of_too_many_scans_is_left_to_pillows_refusal(rng):
    """nvImageCodec decodes a progressive JPEG once per scan too, so one of more scans than MAX_JPEG_SCANS is
    declined (None: the Pillow path refuses it by name) and never reaches it; Pillow's own progressive
    JPEGs (10 scans) and baseline ones do. A stand-in for nvImageCodec records what reaches it."""
    import threading
    import types

    from glmvit_cupy.preprocessing import decode
    from glmvit_cupy.preprocessing.gpu_decode import Decoder

    pixels = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    reached = []

    class Stream:
        def __init__(self, data):
            reached.append(data)
            self.width, self.height = 80, 60

    class NvDecoder:
        def decode(self, stream, params=None):
            return types.SimpleNamespace(cpu=lambda: pixels)

    decoder = Decoder.__new__(Decoder)
    decoder._nv = types.SimpleNamespace(CodeStream=Stream, Decoder=NvDecoder, DecodeParams=lambda **kw: None)
    decoder._local, decoder.max_pixels = threading.local(), None
    files = {}
    for kind, kw in (("baseline", {}), ("progressive", {"progressive": True})):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90, **kw)
        files[kind] = buf.getvalue()
    data = files["progressive"]
    last = data[data.rfind(b"\xff\xda"):-2]  # the last scan, up to the end marker
    many = data[:-2] + last * decode.MAX_JPEG_SCANS + b"\xff\xd9"
    assert decode.jpeg_scans(io.BytesIO(many)) > decode.MAX_JPEG_SCANS
    assert decoder.decode(many) is None and reached == []
    with pytest.raises(ImageError, match="a progressive JPEG of .* scans, more than the 64"):
        decode.load(many, "many.jpg")
    for kind, data in files.items():
        assert np.array_equal(decoder.decode(data), pixels), kind
    assert reached == [files["baseline"], files["progressive"]]
