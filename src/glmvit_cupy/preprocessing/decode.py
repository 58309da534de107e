"""Images in: any accepted input (a path, file object, bytes, PIL image or uint8 array) -> RGB, decoded
as the reference loads a path (Pillow, EXIF transpose, convert("RGB"), a transparent colour onto white), with
Pillow's decompression-bomb guard, and without holding the GIL longer than it must: threads decode
side by side while another drives the GPU.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
import threading
import zlib

import numpy as np
from PIL import Image, ImageOps

from ..errors import ImageError
from ..files import not_regular


def name_of(image, index) -> str:
    """What errors call an image: its path, or its index (and a file object's name)."""
    if isinstance(image, (str, os.PathLike)):
        return os.fspath(image) or f"image {index} (an empty path)"
    name = getattr(image, "name", None)
    if isinstance(name, str):
        return f"{name} (image {index})"
    return f"image {index} ({type(image).__name__})"


ENCODED_BYTES = (bytes, bytearray, memoryview)  # an encoded file's bytes, as a caller may hold them
DECODE_BLOCK = 1 << 26  # bytes of the file handed to Pillow's decoder at once


# Pillow decodes JPEG 2000 through Python calls that read the file, so it holds the GIL for the whole
# decode (an 81 MP file: 10 s in which no other thread of the process runs); an ICNS icon may hold one,
# and its header's size need not be the decoded image's. A process that must keep answering meanwhile
# (glmvit-serve) sets `offload` to decode every format but these, whose C decoders run without the GIL
# on the size their header says, in another process (and a BMP whose RLE Pillow decodes in Python); None
# decodes everything here.
DECODED_IN_PROCESS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF"})
offload = None  # offload(file bytes, name, max_pixels) -> HxWx3 uint8 array, or raises ImageError
# A progressive JPEG is decoded once per scan: a 156 KB 16 MP file of its last scan repeated 2,000 times takes
# ~24 s to decode. So is a baseline one whose scans hold fewer components than its frame (100 KB of 10,000
# empty one-component scans of a 16 MP frame: 13.8 s). Encoders write about 10 scans (Pillow and libjpeg 10,
# mozjpeg up to ~20; a baseline file one, or one a component).
MAX_JPEG_SCANS = 64
# Segments a JPEG's markers are walked through to count its scans (a Python step each): encoders write some
# tens, a file with a large ICC profile or XMP block some hundreds (one a 64 KB piece).
MAX_JPEG_SEGMENTS = 1 << 16
# Strips or tiles a TIFF's image may be stored in. Pillow builds a tile for each as it opens the file and decodes
# each apart (~2 us and ~14 us a block): a 23 MB TIFF of 6,000,000 one-row strips that share one byte took 86 s
# and 2 GB to decode, counted as 6 MP. Writers aim at ~8 KB strips or 256 x 256 tiles: 11,000-66,000 strips
# at Pillow's 89.5 MP limit; this many one-row strips decode in 1.1 s (a 2-core host).
MAX_TIFF_BLOCKS = 1 << 17
# Values of type RATIONAL a TIFF tag may hold. Pillow makes a Python Fraction of each as it reads the tag (it reads
# XResolution as it opens the file): one of 7,800,000 (62 MB) took 17.8 s and 1.3 GB. Writers store 1-9 in a tag.
MAX_TIFF_FRACTIONS = 1 << 12
# Chunks a PNG may have. Pillow reads every chunk in a Python step as it opens and decodes the file (~3 us a
# chunk): a 12 MB PNG of 1,000,000 empty ancillary chunks around a 64 x 64 image took 3.5 s. Writers put a few
# chunks around IDATs of 8-64 KB: ~8,000 chunks in a 64 MB file; this many empty ones decode in ~0.4 s.
MAX_PNG_CHUNKS = 1 << 17
# A Netpbm (PBM, PGM, PPM) file's header bytes and a plain (ASCII) one's comments. Pillow reads a header a byte
# a Python call at a time (10 MB of whitespace in one: 2.6 s) and removes each comment of a plain file's data by
# copying its 1 MiB block (500,000 in a 1 MB file: 9.5 s). Writers put one comment line, if any, in the header.
MAX_PNM_HEADER = 1 << 16
MAX_PNM_COMMENTS = 1 << 10
# Blocks (extensions and their sub-blocks) a GIF may have before its first image. Pillow reads each in a Python
# step as it opens the file (~0.7 us an extension): 2,000,000 empty comments, a 10 MB file, took 3.5 s. Writers
# put a few extensions there (loop count, frame timing, a comment or XMP in some hundred sub-blocks).
MAX_GIF_BLOCKS = 1 << 17
# Pixels an image may have whose data Pillow decodes with a decoder written in Python (Image.DECODERS: QOI, BLP,
# a DDS's uncompressed RGB, a Netpbm file's plain or non-8-bit data, 16-bit SGI, XPM, MSP, a BMP's RLE). It takes
# a Python step a pixel, holding the GIL: ~0.85 us for QOI, ~0.94 a DDS, ~1.7 a PPM of maximum value 1,000 (a
# 2-core host), so one at Pillow's 89.5 MP limit takes one to three minutes; this many take ~4 s at most. A
# BMP's RLE takes a step a run, and one a pixel (~0.1 us) only of rows ended early: it may have more.
MAX_PYTHON_DECODED = 1 << 22
MAX_PYTHON_DECODED_BY = {"bmp_rle": 1 << 24}
# Formats Pillow decodes by running an outside program on the file (EPS: Ghostscript, a PostScript interpreter):
# refused, so an untrusted file is never handed to one.
RUNS_A_PROGRAM = frozenset({"EPS"})
# Formats whose file holds another image file that Pillow opens as it loads (IPTC/NAA), in any format and without
# the checks above or the pixel limit: refused.
HOLDS_AN_IMAGE_FILE = frozenset({"IPTC"})


def decode_rgb(data: bytes, name: str, max_pixels: int | None = None) -> np.ndarray:
    """An image file's bytes -> HxWx3 uint8, as load decodes them (what offload runs in the other process)."""
    return np.ascontiguousarray(rgb_pixels(load(data, name, max_pixels)))


_BOMB_SIZE = re.compile(r"\((\d+) pixels\)")


# Formats whose header's size need not be the decoded image's: an ICO or ICNS entry may hold a PNG of any
# size under its declared 16 x 16 (a 260 KB ICO decoded to 81 MP). Only the decode's limit bounds them.
# Pillow's ICO plugin decodes the icon's image as it opens the file, so an ICO is told by its first bytes
# (opened, its "header" would cost a whole decode: 81 MP, 0.7 s and 240 MB, outside any budget); an ICNS
# file opens on its header.
UNDERSTATED = frozenset({"ICNS"})
ICO_MAGIC = b"\x00\x00\x01\x00"


@contextlib.contextmanager
def _reading(file):
    """A binary file object at the start of an image file (its bytes, a path, or a file object, whose position
    is put back after)."""
    if isinstance(file, ENCODED_BYTES):
        yield _bytes_io(file)
    elif isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            yield f
    else:
        at = file.tell()
        try:
            file.seek(0)
            yield file
        finally:
            file.seek(at)


def _head(file, n: int) -> bytes | None:
    """An image file's first n bytes, read as Pillow reads it (from its start); None if it cannot be read."""
    try:
        if isinstance(file, ENCODED_BYTES):  # no copy of the whole
            view = memoryview(file)
            return bytes(view.cast("B")[:n] if view.c_contiguous else view.tobytes()[:n])  # whatever its format
        with _reading(file) as f:
            return f.read(n)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def is_ico(file) -> bool:
    """Whether an image file (its bytes, a path or a binary file object) starts as an ICO does."""
    return _head(file, 4) == ICO_MAGIC


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ihdr_size(head: bytes, checked: bool = False) -> tuple[int, int] | None:
    """(width, height) from a PNG's first 24 bytes (its signature, then IHDR: the first chunk, by the format),
    as Pillow sizes it; None for anything else. checked: from its first 33 bytes, None unless IHDR is whole
    and its CRC holds (a damaged header is Pillow's to name)."""
    if len(head) < 24 or head[:8] != PNG_MAGIC or head[12:16] != b"IHDR":
        return None
    if checked and (len(head) < 33 or head[8:12] != b"\0\0\0\x0d"
                    or zlib.crc32(head[12:29]) != struct.unpack_from(">I", head, 29)[0]):
        return None
    return struct.unpack_from(">II", head, 16)


def ico_pixels(file) -> int:
    """The most pixels any image inside an ICO file holds, from its directory and each entry's own header
    (a PNG's IHDR, a BMP's DIB header), nothing decoded: what Pillow would decode as it opens the file. 0
    where the file is not an ICO or its headers are cut short (opening it says why)."""
    try:
        with _reading(file) as f:
            head = f.read(6)
            if len(head) < 6 or head[:4] != ICO_MAGIC:
                return 0
            count = struct.unpack_from("<H", head, 4)[0]
            directory = f.read(16 * count)
            most = 0
            for i in range(len(directory) // 16):
                f.seek(struct.unpack_from("<I", directory, 16 * i + 12)[0])
                entry = f.read(24)
                if entry[:8] == PNG_MAGIC:
                    size = _ihdr_size(entry)
                    if size is None:
                        continue
                    w, h = size
                elif len(entry) >= 12:  # a DIB: its height counts the image and its mask, as Pillow halves it
                    core = struct.unpack_from("<I", entry)[0] == 12  # BITMAPCOREHEADER: 16-bit sizes
                    w, h = (abs(x) for x in struct.unpack_from("<HH" if core else "<ii", entry, 4))
                    h //= 2
                else:
                    continue
                most = max(most, w * h)
            return most
    except (OSError, ValueError, AttributeError, TypeError, struct.error):
        return 0


def header_size(file, understated: int = 0) -> tuple[int, tuple | None]:
    """(pixels, (width, height)) of an image file (its bytes, or a path) from its header, nothing decoded;
    (0, None) where Pillow cannot tell or the path is not a regular file, which could block a read (decoding
    it says why). Pillow refuses to open an image over twice its pixel limit: the pixels then come from its
    message. An ICO, or a format whose header may understate its size (UNDERSTATED), counts at least
    `understated` pixels (the decode's limit: what it may turn out to hold)."""
    if not isinstance(file, ENCODED_BYTES) and not (isinstance(file, (str, os.PathLike)) and os.path.isfile(file)):
        return 0, None
    if is_ico(file):  # not opened: that would decode it
        return understated or 0, None
    head = _head(file, 33) or b""  # read once: a PNG's IHDR, and the first bytes that name other formats
    png = _ihdr_size(head, checked=True)
    if png is not None:  # not opened: Pillow inflates every zTXt and iCCP chunk before IDAT as it opens
        return png[0] * png[1], png
    if slow_structure(file, head[:4]) is not None:
        return 0, None  # not opened (opening walks every segment or header byte, or builds a tile a strip)
    try:
        with _open(_bytes_io(file) if isinstance(file, ENCODED_BYTES) else file, understated or None) as im:
            w, h = im.size
            return max(w * h, (understated or 0) if im.format in UNDERSTATED else 0), (w, h)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # the warning: filtered to error
        found = _BOMB_SIZE.search(str(e))
        return (int(found.group(1)) if found else 0), None
    except Exception:  # noqa: BLE001 - decoding it reports what is wrong, by name
        return 0, None


_MAGIC = ((PNG_MAGIC, "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
          (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


def _starts_as(image) -> str | None:
    """The format an image file's first bytes name (PNG, JPEG, GIF, WebP, BMP, TIFF), if any: for the message
    when Pillow cannot open it."""
    head = _head(image, 12)
    if head is None:
        return None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    return next((kind for magic, kind in _MAGIC if head.startswith(magic)), None)


def _video_kind(image) -> str | None:
    """The video container an undecodable image file's first bytes name (MP4/QuickTime, Matroska/WebM, AVI), if any:
    a video under an image's name, said as one."""
    head = _head(image, 12)
    if head is None:
        return None
    if head[4:8] == b"ftyp" and head[8:12] not in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"):
        return "MP4/QuickTime"  # an ftyp box, but not an image's (AVIF, HEIC)
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "Matroska/WebM"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "AVI"
    return None


def _is_empty(image) -> bool:
    """Whether an image file (its bytes, a path or a seekable file object) holds no bytes at all."""
    return _head(image, 1) == b""


def _bytes_io(data) -> io.BytesIO:
    """A file's bytes as a file object; a non-contiguous memoryview is copied first (BytesIO takes contiguous
    buffers only)."""
    return io.BytesIO(data.tobytes() if isinstance(data, memoryview) and not data.c_contiguous else data)


# A marker that has a length: FF then none of 00 (a stuffed FF in entropy-coded data), FF (fill), 01 or D0-D7
# (TEM, RST0-7: markers without a length, which a scan's data holds); one FF, so a run of them never backtracks.
_MARKER = re.compile(rb"\xff([^\x00\x01\xd0-\xd7\xff])")


def jpeg_scans(fp) -> int:
    """jpeg_scans_in the whole of a JPEG file object, its position kept."""
    at = fp.tell()
    try:
        fp.seek(0)
        return jpeg_scans_in(fp.read())
    finally:
        fp.seek(at)


def jpeg_scans_in(data: bytes) -> int:
    """The scans libjpeg decodes in a JPEG file's bytes: its start-of-scan markers (FF DA) up to the end of the
    image (FF D9), found as libjpeg finds markers. Each segment's payload is skipped by its length, so bytes that
    read FF DA inside one (an ICC profile, an EXIF block and its thumbnail) or after the end of the image (a
    Motion Photo's video, an MPO's other images) are not counted: libjpeg never decodes them as scans. The
    markers are walked only where the file holds more FF DA pairs than MAX_JPEG_SCANS, and at most
    MAX_JPEG_SEGMENTS of them: past that, every pair counts."""
    pairs = data.count(b"\xff\xda")
    if pairs <= MAX_JPEG_SCANS:  # no fewer than its scans: within the limit whatever they are
        return pairs
    scans, at = 0, 2  # after SOI
    for _ in range(MAX_JPEG_SEGMENTS):
        found = _MARKER.search(data, at)
        if found is None or found[1][0] == 0xD9:  # the end of the file, or of the image (EOI)
            return scans
        at = found.end()
        scans += found[1][0] == 0xDA
        at += int.from_bytes(data[at:at + 2], "big")  # a segment's length counts its own two bytes
    return pairs


def slow_structure(file, head: bytes | None) -> str | None:
    """What makes an image file (its first four bytes `head`) one Pillow would take far longer to open or decode
    than its pixels warrant, found before it is opened, or None: a TIFF of over MAX_TIFF_BLOCKS strips or tiles
    or a tag of over MAX_TIFF_FRACTIONS fractions,
    a JPEG of over MAX_JPEG_SEGMENTS header segments, a Netpbm file of a long header or many comments, a PNG of
    over MAX_PNG_CHUNKS chunks or more than one colour profile, a GIF of over MAX_GIF_BLOCKS blocks before its
    image; said with what to do instead."""
    head = head or b""
    if head[:3] == b"GIF" and gif_blocks(file) > MAX_GIF_BLOCKS:
        return (f"a GIF of over {MAX_GIF_BLOCKS:,} blocks before its first image, more than an image may have here "
                "(writers use a few; each is read apart): re-save it")
    entries = tiff_entries(file) if head[:2] in (b"II", b"MM") else []  # read once for both checks
    if (blocks := tiff_blocks(file, entries)) > MAX_TIFF_BLOCKS:
        return (f"a TIFF stored in {blocks:,} strips or tiles, more than the {MAX_TIFF_BLOCKS:,} an image may have "
                "here (each is decoded apart; writers use far fewer): re-save it with larger strips, or as PNG")
    if (fractions := tiff_fractions(file, entries)) > MAX_TIFF_FRACTIONS:
        return (f"a TIFF with a tag of {fractions:,} fractions (RATIONAL values), more than the "
                f"{MAX_TIFF_FRACTIONS:,} a tag may have here (Pillow makes an object of each; writers store one to "
                "a few): re-save it")
    if head[:3] == b"\xff\xd8\xff" and jpeg_header_segments(file) > MAX_JPEG_SEGMENTS:
        return (f"a JPEG of over {MAX_JPEG_SEGMENTS:,} marker segments before its image data, more than an image "
                "may have here (writers use some tens; each is read apart): re-save it")
    if head[:1] == b"P":
        header, comments = pnm_costs(file)
        if header > MAX_PNM_HEADER or comments > MAX_PNM_COMMENTS:
            what = f"over {MAX_PNM_HEADER:,} header bytes" if header > MAX_PNM_HEADER else f"{comments:,} comments"
            return (f"a Netpbm file of {what}, more than an image may have here (Pillow reads each byte or comment "
                    "apart; writers use a line or two): re-save it")
    if head == PNG_MAGIC[:4]:
        chunks, profiles = png_chunks(file)
        if chunks > MAX_PNG_CHUNKS:
            return (f"a PNG of over {MAX_PNG_CHUNKS:,} chunks, more than an image may have here (writers use a few "
                    "beside its image data; each is read apart): re-save it")
        if profiles > 1:  # Pillow inflates each as it opens the file: 2,000 of ~1 MB each took 4.7 s
            return f"a PNG of {profiles:,} colour profiles (iCCP chunks); the PNG format allows one: re-save it"
    return None


def jpeg_header_segments(file, limit: int = MAX_JPEG_SEGMENTS) -> int:
    """How many marker segments a JPEG holds before its first scan (what Pillow walks in a Python step each as
    it opens the file, keeping every APP segment), counted from their lengths up to the first start of scan, a
    byte that is no marker, the end of the file or limit + 1 (where counting stops). 0 for another format."""
    count = 0
    try:
        with _reading(file) as f:
            if f.read(2) != b"\xff\xd8":
                return 0
            while count <= limit:
                head = f.read(2)
                while head[:1] == b"\xff" and head[1:] == b"\xff":  # fill bytes before a marker
                    head = head[1:] + f.read(1)
                if len(head) < 2 or head[0] != 0xFF or head[1] == 0xDA:
                    break
                count += 1
                if head[1] not in (0x01, *range(0xD0, 0xD9)):  # TEM, RSTn and SOI have no length
                    f.seek(int.from_bytes(f.read(2), "big") - 2, os.SEEK_CUR)
    except (OSError, ValueError, OverflowError):
        pass
    return count


def gif_blocks(file, limit: int = MAX_GIF_BLOCKS) -> int:
    """How many blocks a GIF holds before its first image (each extension and each of its sub-blocks, what
    Pillow reads in a Python step each as it opens the file), counted from their lengths up to the first image,
    the trailer, a byte that starts no block, the end of the file or limit + 1 (where counting stops). 0 for
    another format."""
    count = 0
    try:
        with _reading(file) as f:
            head = f.read(13)  # signature, then the logical screen's width, height, flags, background, aspect
            if len(head) < 13 or head[:3] != b"GIF":
                return 0
            if head[10] & 0x80:  # a global colour table of 2 ** (n + 1) RGB entries
                f.seek(3 << ((head[10] & 7) + 1), os.SEEK_CUR)
            while count <= limit and f.read(1) == b"\x21":  # an extension: its label, then sub-blocks to a 0
                f.read(1)
                count += 1
                while count <= limit and (size := f.read(1)) not in (b"", b"\0"):
                    count += 1
                    f.seek(size[0], os.SEEK_CUR)
    except (OSError, ValueError, OverflowError):
        pass
    return count


def python_decoder(img: Image.Image) -> str | None:
    """The name of the Python-written decoder (Image.DECODERS) Pillow would decode an opened image's data with,
    or None where its decoders are C ones."""
    return next((tile[0] for tile in img.tile if tile[0] in getattr(Image, "DECODERS", {})), None)


def pnm_costs(file) -> tuple[int, int]:
    """(header bytes, comments) of a Netpbm file as Pillow reads it: the bytes up to its last header token's
    end (magic, width, height and, but for a bitmap, the maximum value; whitespace and # comments between),
    MAX_PNM_HEADER + 1 past that many; and for a plain (ASCII) one, the # in the whole file. (0, 0) for another
    format."""
    try:
        with _reading(file) as f:
            data = f.read(MAX_PNM_HEADER + 1)
            if len(data) < 2 or data[:1] != b"P" or data[1:2] not in b"123456fF":
                return 0, 0
            at, tokens = 2, (3 if data[1:2] in b"14" else 4) - 1
            while tokens and at < len(data):
                if data[at:at + 1] == b"#":  # to the end of its line
                    ends = [i for i in (data.find(b"\n", at), data.find(b"\r", at)) if i >= 0]
                    at = min(ends) + 1 if ends else len(data)
                elif data[at:at + 1].isspace():
                    at += 1
                else:
                    while at < len(data) and not data[at:at + 1].isspace() and data[at:at + 1] != b"#":
                        at += 1
                    tokens -= 1
            comments = 0
            if data[1:2] in b"123":
                comments = data.count(b"#") + sum(block.count(b"#") for block in iter(lambda: f.read(1 << 20), b""))
            return at, comments
    except (OSError, ValueError):
        return 0, 0


def tiff_blocks(file, entries: list | None = None) -> int:
    """How many strips or tiles a TIFF's first image is stored in, from the count of its first directory's
    StripOffsets or TileOffsets: what Pillow would make a tile of each as it opens the file. 0 for another
    format, or a header cut short (opening it says why). entries: its tiff_entries, where already read."""
    entries = tiff_entries(file) if entries is None else entries
    return max((count for tag, _, count in entries if tag in (273, 324)), default=0)


def tiff_fractions(file, entries: list | None = None) -> int:
    """The most values of type RATIONAL or SRATIONAL an entry of a TIFF's first directory holds: Pillow makes a
    Python fraction of each as it reads such a tag (XResolution as it opens the file). 0 for another format.
    entries: its tiff_entries, where already read."""
    entries = tiff_entries(file) if entries is None else entries
    return max((count for _, kind, count in entries if kind in (5, 10)), default=0)


def tiff_entries(file) -> list[tuple[int, int, int]]:
    """(tag, type, count) of each entry of a TIFF's first directory (classic TIFF and BigTIFF; the first 65,536,
    a classic directory's most), nothing else read; [] for another format, or a header cut short."""
    try:
        with _reading(file) as f:
            head = f.read(16)
            big = head[2:4] in (b"+\0", b"\0+")
            if head[:2] not in (b"II", b"MM") or head[2:4] not in (b"*\0", b"\0*", b"+\0", b"\0+"):
                return []
            order = "<" if head[:2] == b"II" else ">"
            f.seek(struct.unpack_from(order + ("Q" if big else "I"), head, 8 if big else 4)[0])
            raw = f.read(8 if big else 2)
            entries = struct.unpack(order + ("Q" if big else "H"), raw)[0]
            size, entry = (20, order + "HHQ") if big else (12, order + "HHI")
            table = f.read(size * min(entries, 1 << 16))
            return [struct.unpack_from(entry, table, i * size) for i in range(len(table) // size)]
    except (OSError, ValueError, OverflowError, struct.error):
        return []


def png_chunks(file, limit: int = MAX_PNG_CHUNKS) -> tuple[int, int]:
    """(chunks, colour profiles): how many chunks a PNG holds and how many of them are iCCP, counted from their
    headers up to IEND, the end of the file or limit + 1 chunks (where counting stops), nothing else read.
    (0, 0) for another format."""
    count = profiles = 0
    try:
        with _reading(file) as f:
            if f.read(8) != PNG_MAGIC:
                return 0, 0
            while count <= limit:
                head = f.read(8)
                if len(head) < 8:
                    break
                count += 1
                profiles += head[4:] == b"iCCP"
                if head[4:] == b"IEND":
                    break
                f.seek(struct.unpack_from(">I", head)[0] + 4, os.SEEK_CUR)
    except (OSError, ValueError, OverflowError, struct.error):
        pass
    return count, profiles


def tiff_overlap(tiles) -> tuple[int, int, int] | None:
    """(offset, bytes, gap) of the first uncompressed strip or tile of an opened TIFF whose data (at least
    `bytes`: one bit a pixel) runs past the next block's start `gap` bytes on, or None. Pillow reads such a
    block `gap` bytes at a time and decodes its growing buffer again after each read: a 4.8 MB TIFF of two
    strips one byte apart took 5.1 s, an 18 MB one over a minute. Writers never overlap uncompressed blocks."""
    ordered = sorted(tiles, key=lambda tile: tile[2])
    for tile, after in zip(ordered, ordered[1:]):
        x0, y0, x1, y1 = tile[1]
        least = (x1 - x0 + 7) // 8 * (y1 - y0)
        if tile[0] == "raw" and 0 < after[2] - tile[2] < least:
            return tile[2], least, after[2] - tile[2]
    return None


def _file_bytes(image) -> bytes:
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    if isinstance(image, io.BytesIO):
        return image.getvalue()
    image.seek(0)
    return image.read()


# Pillow's decompression-bomb guard (Image.MAX_IMAGE_PIXELS, 89.5 MP unless changed) refuses larger
# images; max_pixels raises (or lowers) the limit for one call, as one would for scans or panoramas.
_pillow_limit = threading.Lock()


def pillow_limit() -> int | None:
    """Pillow's bomb limit as the process has it, not as another thread's _open raises it for a moment."""
    with _pillow_limit:
        return Image.MAX_IMAGE_PIXELS


def _open(image, limit) -> Image.Image:
    """Image.open with Pillow's own bomb limit at least `limit` (None: Pillow's as it is). Pillow reads it
    from a module global: that is raised only when asked for more than it allows, under a lock, and put back
    at once. So Pillow warns (DecompressionBombWarning, as the process's warning filters say) only of images
    over `limit`, which the callers refuse; no warning filter is changed here: those are the process's, and
    changing them is not safe while other threads decode."""
    current = pillow_limit()  # under the lock: not a limit another thread has raised for its own open
    if current is None or (limit is not None and limit <= current):
        return Image.open(image)
    with _pillow_limit:  # a Python int: Pillow doubles it, and a NumPy integer's double wraps negative
        old, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None if limit is None else int(limit)
        try:
            return Image.open(image)
        finally:
            Image.MAX_IMAGE_PIXELS = old


def _mapped(buf: np.ndarray):
    """A Pillow core image of mode RGB over an [H, W, 4] uint8 buffer (Pillow keeps RGB as 4 bytes a pixel):
    what Pillow writes into it lands in `buf`. Pillow's own frombuffer mapping, with the RGB layout."""
    h, w = buf.shape[:2]
    return Image.core.map_buffer(buf, (w, h), "raw", 0, ("RGB", 0, 1))


_now = threading.local()


def decoding() -> str | None:
    """The name of the image this thread is decoding, if any: for a warning Pillow gives meanwhile (damaged
    EXIF data, say), which does not name its file."""
    return getattr(_now, "name", None)


def _decode(image, name, max_pixels=None, host_buffer=None):
    _now.name = name
    try:
        return _decode_named(image, name, max_pixels, host_buffer)
    finally:
        _now.name = None


def _decode_named(image, name, max_pixels=None, host_buffer=None):
    """Open a path or file object the way the reference loads a path: EXIF transpose, convert('RGB').
    Images over max_pixels (default: Pillow's guard, 89.5 MP) are refused before they are decoded.
    With host_buffer, an upright colour JPEG is decoded straight into an [H, W, 4] buffer from it and
    its first three channels returned (no image memory of Pillow's, no copy); others come back as PIL
    images."""
    limit = pillow_limit() if max_pixels is None else max_pixels
    bomb = (f"{name}: refused as a possible decompression bomb: over the limit of {limit or 0:,} pixels; pass "
            "max_pixels (glmvit-encode --max-pixels) to allow larger images")
    try:
        head = _head(image, 4)  # read once for the checks below
        if head == ICO_MAGIC:  # opening it decodes it: refused first on the sizes its images' headers give
            inside = ico_pixels(image)
            if limit is not None and inside > limit:
                raise ImageError(f"{bomb} (an icon holding an image of {inside:,})")
            if offload is not None:  # opening it here would decode it here, on this thread
                return offload(_file_bytes(image), name, max_pixels)
        costly = slow_structure(image, head)
        if costly is not None:  # before Pillow opens it: its parser would read each block, segment or byte apart
            raise ImageError(f"{name}: {costly}")
        img = _open(image, limit)
        if img.format in RUNS_A_PROGRAM:
            img.close()
            raise ImageError(f"{name}: an {img.format} file is not decoded here (Pillow decodes it by running "
                             "Ghostscript, an outside program, on it); convert it to PNG first")
        if img.format in HOLDS_AN_IMAGE_FILE:
            img.close()
            raise ImageError(f"{name}: an {img.format} file is not decoded here (it holds another image file, which "
                             "Pillow would open unchecked); take the image out of it, or convert it to PNG first")
        w, h = img.size
        if limit is not None and w * h > limit:
            raise ImageError(f"{bomb} (it is {w} x {h} = {w * h:,})")
        slow = python_decoder(img)
        most = MAX_PYTHON_DECODED_BY.get(slow, MAX_PYTHON_DECODED)
        if slow is not None and w * h > most:
            img.close()
            raise ImageError(f"{name}: a {img.format} image of {w} x {h} = {w * h:,} pixels whose data Pillow decodes "
                             f"in Python ({slow!r} decoder, a step a pixel: about a second a million), more than the "
                             f"{most:,} allowed such an image here: convert it to PNG")
        overlap = tiff_overlap(img.tile) if img.format == "TIFF" else None
        if overlap is not None:
            at, least, gap = overlap
            img.close()
            apart = f"{gap:,} byte{'s' * (gap != 1)}"
            raise ImageError(f"{name}: a TIFF whose uncompressed strips or tiles overlap (the one at byte {at:,} holds "
                             f"at least {least:,} bytes, and the next starts {apart} after it; it would be read that "
                             "many bytes at a time): re-save it")
        if img.format in ("JPEG", "MPO"):  # a baseline one too: scans of fewer components than its frame
            scans = jpeg_scans(img.fp)
            if scans > MAX_JPEG_SCANS:
                kind = "progressive JPEG" if img.info.get("progressive") else "JPEG"
                raise ImageError(f"{name}: a {kind} of {scans:,} scans, more than the {MAX_JPEG_SCANS} "
                                 "an image may have here (encoders write about 10; each scan decodes the whole "
                                 "image again): re-encode it")
        if offload is not None and (img.format not in DECODED_IN_PROCESS or slow is not None):
            data = _file_bytes(image)
            img.close()
            return offload(data, name, max_pixels)
        # One decoder call for the whole file (Pillow feeds 64 KiB at a time by default and takes the GIL
        # back after each): the decode then runs without the GIL, and threads decode side by side. Pillow
        # reads each tile up to the next tile's offset, but a block from a tile whose offset another shares
        # (a TIFF's strips may all point at one place): there a whole block a tile read the rest of the file
        # once per strip (a 50 MB TIFF of 200 such strips: 7.6 s against Pillow's 0.04 s), so such an image
        # keeps Pillow's block.
        if len({tile[2] for tile in img.tile}) == len(img.tile):
            img.decodermaxblock = max(img.decodermaxblock, DECODE_BLOCK)
        into = _target(img, host_buffer)
        img.load()
        if limit is not None and img.size[0] * img.size[1] > limit:  # a header that understated it (ICNS)
            w, h = img.size
            raise ImageError(f"{bomb} (decoded, it is {w} x {h} = {w * h:,}; its header said less)")
        if into is not None:
            return into[..., :3]
        ImageOps.exif_transpose(img, in_place=True)  # in place: no copy when nothing is to be turned
        rgb = img if img.mode == "RGB" else img.convert("RGB")
        # A palette or grey image's transparent index (GIF, PNG tRNS) survives convert("RGB") as a colour
        # in info, and the reference's processor then composites that colour onto white as it does for
        # a PIL image with transparency.
        return _onto_white(rgb) if rgb.info.get("transparency") is not None else rgb
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # Pillow's names its own limit
        found = _BOMB_SIZE.search(str(e))
        raise ImageError(f"{bomb} (it is {int(found.group(1)):,})" if found else bomb) from None
    except IsADirectoryError:
        raise ImageError(f"{name}: is a folder, not an image file") from None
    except FileNotFoundError:
        raise ImageError(f"{name}: no such file") from None
    except Image.UnidentifiedImageError:  # Pillow's own message names only its file object
        if _is_empty(image):
            raise ImageError(f"{name}: the file is empty (0 bytes); an image file was expected") from None
        video = _video_kind(image)
        if video:
            raise ImageError(f"{name}: cannot decode image: it is a video file ({video}), not an image; a video is "
                             "read as one by its name's extension (.mp4, .mkv, .webm, ...) in glmvit-encode, with "
                             "encode_video in Python, and by glmvit-serve's POST /v1/encode_video "
                             "(Client.encode_video)") from None
        kind = _starts_as(image)
        if kind:
            raise ImageError(f"{name}: cannot decode image: it starts as a {kind} file, but Pillow cannot open it "
                             "(its header is damaged, or gives a size of 0)") from None
        raise ImageError(f"{name}: cannot decode image (UnidentifiedImageError: not in an image format Pillow "
                         "reads, e.g. JPEG, PNG, WebP, GIF, BMP, TIFF)") from None
    except PermissionError:
        raise ImageError(f"{name}: cannot be read (permission denied)") from None
    except (OSError, ValueError, SyntaxError, EOFError, TypeError, MemoryError) as e:
        # Pillow says "image file is truncated (N bytes not processed)" for a file cut short, N counting only
        # its decoder's last buffer: the file is what a user needs to hear about.
        cut = "; the file ends early: it is incomplete (cut short in a copy or download?)" if \
            "truncated" in str(e).lower() or isinstance(e, EOFError) else ""  # "Truncated File Read": a JPEG
        if "could not create decoder object" in str(e):  # libwebp's word for a file cut short, or damaged
            cut = "; the WebP data is incomplete or damaged (cut short in a copy or download?)"
        raise ImageError(f"{name}: cannot decode image ({type(e).__name__}: {e}){cut}") from None
    except (struct.error, IndexError, KeyError, ZeroDivisionError, AttributeError, ArithmeticError,
            NotImplementedError) as e:  # NotImplementedError: DDS's and BLP's readers on a damaged header
        # A decoder's own failure on a damaged file (struct.error from a bad EXIF tag in exif_transpose, say):
        # the image is refused by name, never the whole call. Not a catch-all: a server's Refused (503, the
        # decoding processes shut down) and a GPU's errors on the page-locked buffer pass as they are.
        raise ImageError(f"{name}: cannot decode image ({type(e).__name__}: {e}); the file is damaged") from None
    except RuntimeError as e:  # Pillow's AVIF reader (libavif) on a damaged file: "Failed to decode image: ..."
        if type(e) is not RuntimeError:  # a GPU's errors (CuPy's CUDARuntimeError) are subclasses: they pass
            raise
        raise ImageError(f"{name}: cannot decode image (RuntimeError: {e}); the file is damaged") from None


STRIP_PIXELS = 1 << 22  # pixels composited at a time: 16 MB of RGBA


def _onto_white(img: Image.Image) -> np.ndarray:
    """RGB uint8 HxWx3 of img composited onto white by its alpha or transparency, as the reference's
    convert_to_rgb does, a strip of rows at a time: compositing is per pixel, and whole it holds three RGBA
    copies. An 88 KB palette PNG of 9459 x 9459 pixels with a transparent index takes the process to a 0.9 GB
    peak so, against 1.9 GB composited whole."""
    w, h = img.size
    out = np.empty((h, w, 3), np.uint8)
    rows = max(1, STRIP_PIXELS // max(w, 1))
    for top in range(0, h, rows):
        rgba = img.crop((0, top, w, min(h, top + rows))).convert("RGBA")  # crop keeps palette and transparency
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        out[top:top + rgba.height] = np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return out


def _from_pil(img: Image.Image, name) -> np.ndarray:
    """RGB uint8 HxWx3 from a PIL image, compositing transparency onto white as the reference does: a band
    named "A" or a transparent colour. Alpha in no band so named (premultiplied RGBa, a P image's RGBA palette
    without a transparency entry) is dropped by convert("RGB"), as the reference's convert_to_rgb drops it."""
    loaded = getattr(img, "_im", None) is not None or vars(img).get("im") is not None  # Pillow 11's name; 10's
    fp = getattr(img, "fp", "")
    closed = not loaded and (fp is None or bool(getattr(fp, "closed", False)))  # lazy, and its file gone or closed
    try:
        img.load()
        closed = False
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            return _onto_white(img)
        return np.asarray(img.convert("RGB"))
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError, Image.DecompressionBombError,
            Image.DecompressionBombWarning, AssertionError, TypeError, AttributeError, struct.error, IndexError,
            KeyError, RuntimeError) as e:  # a damaged image's own failures (AVIF's: RuntimeError), Pillow's bomb guard
        hint = ("; its file was closed before its pixels were read: call im.load() while the file is open"
                if closed else "")
        raise ImageError(f"{name}: cannot convert PIL image to RGB ({type(e).__name__}: {e}){hint}") from None


def _from_array(a: np.ndarray, name) -> np.ndarray:
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise ImageError(f"{name}: array of dtype {a.dtype} and shape {a.shape}; expected an HxWx3 "
                         "(or HxWx1, HxWx4) uint8 array")
    if a.shape[2] == 1:
        return np.repeat(a, 3, axis=2)
    if a.shape[2] == 4:
        alpha = a[..., 3:4] / 255
        return np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return np.ascontiguousarray(a)


def _target(img, host_buffer) -> np.ndarray | None:
    """The [H, W, 4] buffer an opened image will be decoded into, set as its image memory; None when it is
    decoded as usual: no buffer, not a colour JPEG (others convert after decoding), or an EXIF orientation
    that turns it (the turn makes a new image anyway)."""
    if host_buffer is None or img.format != "JPEG" or img.mode != "RGB" or \
            img.getexif().get(ORIENTATION, 1) not in (1, None):
        return None
    w, h = img.size
    buf = host_buffer((h, w, 4))
    try:
        img.im = _mapped(buf)  # ImageFile.load decodes into an image memory already there
    except (AttributeError, TypeError, ValueError):  # a Pillow without the mapping
        return None
    return buf


ORIENTATION = 0x0112  # the EXIF tag exif_transpose reads


def _binary_seekable(file, name: str):
    """A file object as the decode reads it: one in text mode refused; one that cannot seek (a pipe, a
    socket's, an HTTP response) read whole into memory first, as Pillow itself would, so that its header is
    checked (an icon's sizes, say) before anything is decoded."""
    try:
        text = isinstance(file, io.TextIOBase) or isinstance(file.read(0), str)
    except (OSError, ValueError, TypeError):  # closed, say: the decode says what is wrong
        return file
    if text:
        raise ImageError(f"{name}: a file object in text mode (it reads str): open the file in binary mode, "
                         "open(path, 'rb')")
    try:
        if file.seekable():
            return file
    except (AttributeError, OSError, ValueError):
        pass
    return io.BytesIO(file.read())


def load(image, name: str, max_pixels: int | None = None, host_buffer=None):
    """Any accepted image input -> an RGB PIL image (encoded inputs: no copy made yet) or HxWx3 uint8
    array (an upright colour JPEG, with host_buffer: decoded into its memory). Raises ImageError naming
    the image `name`."""
    if isinstance(image, (str, os.PathLike)):
        if os.path.isdir(image):
            raise ImageError(f"{name}: is a folder, not an image file (glmvit-encode walks folders)")
        if not os.path.isfile(image):
            odd = not_regular(image)  # a FIFO would block a decoder's read: refused by what it is
            if odd:
                raise ImageError(f"{name}: is {odd}, not an image file")
            url = str(image).startswith(("http://", "https://", "s3://", "gs://"))
            raise ImageError(f"{name}: no such file" + ("; URLs are not fetched: download the image and pass the file, "
                                                         "its bytes or a PIL image" if url else ""))
        out = _decode(image, name, max_pixels, host_buffer)
    elif isinstance(image, ENCODED_BYTES):
        out = _decode(_bytes_io(image), name, max_pixels, host_buffer)
    elif hasattr(image, "read"):
        out = _decode(_binary_seekable(image, name), name, max_pixels, host_buffer)
    elif isinstance(image, Image.Image):
        out = _from_pil(image, name)
    elif isinstance(image, np.ndarray):
        out = _from_array(image, name)
    else:
        several = "; several images go in a list" if hasattr(image, "__iter__") else ""  # a generator, a set, ...
        raise ImageError(f"{name}: unsupported input type {type(image).__name__}; pass a path, a file object, "
                         f"the file's bytes, a PIL image or an HxWx3 uint8 array{several}")
    h, w = (out.size[1], out.size[0]) if isinstance(out, Image.Image) else out.shape[:2]
    if h == 0 or w == 0:
        raise ImageError(f"{name}: zero-size image {(h, w)}")
    return out


def rgb_pixels(img, host_buffer=None) -> np.ndarray:
    """A decoded image (RGB PIL image or HxWx3 uint8 array) -> HxWx3 uint8. A PIL image is copied without the
    GIL into an [H, W, 4] buffer (host_buffer(shape), e.g. page-locked memory for the GPU upload; default
    NumPy), whose first three channels are returned as a view: Pillow keeps RGB as 4 bytes a pixel, and its
    tobytes() packs them to 3 under the GIL (~25 ms for 12 MP, which stalls every other thread)."""
    if not isinstance(img, Image.Image):
        return img
    w, h = img.size
    buf = host_buffer((h, w, 4)) if host_buffer is not None else np.empty((h, w, 4), np.uint8)
    try:
        target = img._new(_mapped(buf))  # paste is then one memcpy per row
        target.readonly = 0
        target.paste(img)
    except (AttributeError, TypeError, ValueError):  # a Pillow without the mapping: the packing copy
        return np.asarray(img)
    return buf[..., :3]


def four_channels(image: np.ndarray) -> np.ndarray | None:
    """The [H, W, 4] array whose first three channels the uint8 [H, W, 3] `image` is, when it is such a view
    of contiguous memory starting where it starts (what load and rgb_pixels return from an [H, W, 4]
    buffer, however large the buffer): its 4 bytes a pixel then travel in one copy, not a gather."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        return None
    h, w = image.shape[:2]
    base = image.base
    if (not isinstance(base, np.ndarray) or image.strides != (w * 4, 4, 1) or not base.flags.c_contiguous
            or base.nbytes < h * w * 4 or base.__array_interface__["data"][0] != image.__array_interface__["data"][0]):
        return None
    return base.reshape(-1).view(np.uint8)[:h * w * 4].reshape(h, w, 4)


def load_rgb(image, index: int = 0, max_pixels: int | None = None) -> np.ndarray:
    """Any accepted image input -> HxWx3 uint8 RGB. Raises ImageError naming the image. Encoded images
    over max_pixels (None: Pillow's 89.5-megapixel guard) are refused before they are decoded."""
    return np.asarray(load(image, name_of(image, index), max_pixels))
