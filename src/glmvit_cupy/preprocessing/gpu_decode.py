"""Opt-in JPEG decoding on the GPU through NVIDIA's nvImageCodec (the `gpu-decode-cu12` / `-cu13`
extras; imported only here, only when asked for).

Its pixels are not libjpeg-turbo's (nvJPEG's IDCT and chroma upsampling differ), so embeddings drift
from the reference's slightly: docs/PERFORMANCE.md gives the measured drift and when it pays. Anything
it does not take (not a JPEG, a CMYK or unusual JPEG, a file it fails on) is decoded by Pillow as
usual, so the same inputs are accepted and refused with the same errors.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ..errors import ImageError
from ..files import open_regular
from .decode import ENCODED_BYTES, MAX_JPEG_SCANS, jpeg_scans_in, pillow_limit

_JPEG = b"\xff\xd8\xff"


class Decoder:
    def __init__(self, max_pixels: int | None = None):
        try:
            from nvidia import nvimgcodec
        except ImportError as e:
            raise ImageError("decode='gpu' needs NVIDIA nvImageCodec: pip install -e '.[gpu-decode-cu12]' "
                             f"(or -cu13 for CUDA 13) ({e})") from None
        self._nv = nvimgcodec
        self._local = threading.local()  # a decoder per thread: each has its own stream and buffers
        self.max_pixels = pillow_limit() if max_pixels is None else max_pixels

    def _decoder(self):
        d = getattr(self._local, "decoder", None)
        if d is None:
            d = self._local.decoder = self._nv.Decoder()
        return d

    def decode(self, image, index: int = 0):
        """An encoded image (path, bytes or file object) -> HxWx3 uint8 RGB, EXIF orientation applied; None
        when Pillow should decode it (other formats and inputs, or the GPU decoder declined)."""
        if isinstance(image, (str, os.PathLike)):
            try:
                with open_regular(image, "the image", ImageError) as f:  # a FIFO or device: not read here
                    data = f.read()
            except (OSError, ImageError):
                return None  # Pillow's path reports it
        elif isinstance(image, ENCODED_BYTES):
            data = bytes(image)
        else:
            return None
        frame = frame_header(data) if data.startswith(_JPEG) else None
        if frame is None or frame[1] != 3:
            return None  # grey (1) and CMYK (4) JPEGs convert as Pillow does
        if frame[0] in _PROGRESSIVE and jpeg_scans_in(data) > MAX_JPEG_SCANS:
            return None  # each scan decodes the whole image again: Pillow's path refuses it by name
        try:
            stream = self._nv.CodeStream(data)
            if self.max_pixels is not None and stream.width * stream.height > self.max_pixels:
                return None  # Pillow refuses it with the usual message
            out = self._decoder().decode(stream, params=self._nv.DecodeParams(apply_exif_orientation=True))
            if out is None:
                return None
            rgb = np.asarray(out.cpu())
        except Exception:
            return None
        if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
            return None
        return np.ascontiguousarray(rgb)


# Start-of-frame markers (SOF0-SOF15 but DHT, JPG and DAC, which share the range), and the progressive ones
# (SOF2, 6, 10, 14: Pillow's "progressive").
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})


def components(data: bytes) -> int | None:
    """The colour components of a JPEG, from its frame header (3: Pillow's "RGB", 1: "L", 4: "CMYK"), read by
    walking the markers up to the frame, without decoding; None if the bytes do not get there."""
    frame = frame_header(data)
    return None if frame is None else frame[1]


def frame_header(data: bytes) -> tuple[int, int] | None:
    """(start-of-frame marker, colour components) of a JPEG, as components() reads them; None if the bytes do
    not get there."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in _SOF:  # length (2), precision (1), height (2), width (2), components (1)
            return (marker, data[i + 9]) if i + 9 < len(data) else None
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None
