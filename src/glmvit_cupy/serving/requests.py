"""What a glmvit-serve request may hold: its body read within the limit, base64 as clients send it, and the
fields of an image request (/v1/encode) and of a video request (/v1/encode_video), or Refused saying what is
wrong (status, reason, the image's or video's position)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import re

from ..checks import DEFAULT_MAX_IMAGE_TOKENS, check_token_limits
from ..errors import quoted
from ..files import repeated_key
from ..preprocessing.video import MAX_VIDEO_TOKENS


class Refused(Exception):
    """A request refused: its status, why, the image's (or video's) position; `close`: the connection closes
    after the answer (the rest of the body is not read)."""

    def __init__(self, status: int, error: str, index: int | None = None, close: bool = False):
        super().__init__(error)
        self.status, self.error, self.index, self.close = status, error, index, close


BODY_LIMIT = ("the body", "limit (--max-body-mib)", None)  # what read_body's 413 names: the body and its flag


async def read_body(request, limit: int, timeout: float, room=None, over: tuple = BODY_LIMIT) -> bytearray:
    """The body, or Refused: over `limit` bytes (413, from Content-Length when it says so, or from what a
    chunked body's chunks declare so far, as http_server's protocol counts them: the rest is left unread and
    the connection closes), more than `room` (a batcher.Budget of bytes, server-wide) has free
    (429, once the body has arrived: it is read and dropped as it comes, so the client, which may send before
    it reads, gets the answer), or not all there within `timeout` seconds of its headers (408). A body holds
    `room` for the bytes that have arrived, as they arrive (headers that declare a size hold nothing). A body
    read holds len(body) of it, for the caller to give back; a refusal gives back what it took. `over`: (what
    the body is, the limit's name, the image's position or None) as the 413 says them."""
    from starlette.requests import ClientDisconnect  # here: the base install (the CLI's video settings) has none

    what, named, index = over
    declared = request.headers.get("content-length")
    declared = int(declared) if declared and declared.isdigit() else None
    if declared is not None and declared > limit:
        raise Refused(413, f"{what} is {declared:,} bytes, over the {limit / 2**20:g} MiB {named}", index, close=True)
    body = bytearray()
    held = 0
    full = None  # the 429 once `room` has no room for the body

    def hold(n: int) -> None:
        nonlocal held, full
        if room is None or full is not None:
            return
        if room.take(n):
            held += n
            return
        full = Refused(429, f"the request bodies the server holds ({room.used / 2**20:,.1f} MiB, this one's "
                            f"{held / 2**20:,.1f} MiB so far among them) leave no room for the rest of this one, within "
                            f"the limit of {room.total / 2**20:g} MiB (--max-bodies-in-flight-mib): retry shortly")
        room.give(held)
        held = 0
        body.clear()

    got = 0

    async def read():
        nonlocal got
        more = True
        while more:
            message = await request.receive()  # an empty one when a chunk's size line came ahead of its bytes
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk, more = message.get("body", b""), message.get("more_body", False)
            got += len(chunk)
            if got > limit:
                raise Refused(413, f"{what} is over the {limit / 2**20:g} MiB {named}", index, close=True)
            coming = request.scope.get("glmvit.body_declared", 0)
            if coming > limit:
                raise Refused(413, f"{what}'s chunks (Transfer-Encoding: chunked) declare {coming:,} bytes, over the "
                                   f"{limit / 2**20:g} MiB {named}; {got:,} of them came", index, close=True)
            if full is None and chunk:
                body.extend(chunk)
                if len(body) > held:  # what has arrived, as it comes
                    hold(len(body) - held)

    try:
        await asyncio.wait_for(read(), timeout)
    except BaseException as e:
        if room is not None:
            room.give(held)
        if isinstance(e, asyncio.TimeoutError):
            of = f" of the {declared:,} declared" if declared is not None else ""
            raise Refused(408, f"the body did not arrive within {timeout:g} s (--body-timeout): {got:,} bytes"
                               f"{of} came; send it at once", close=True) from None
        raise
    if full is not None:  # what it held is given back already
        raise full
    return body  # holding len(body) of room: each arrival took its own size


LIMIT_FIELDS = ("min_image_tokens", "max_image_tokens")  # a JSON request's fields, an image file's query
FIELDS = ("images", *LIMIT_FIELDS)  # what a request may hold


_PIECE = 1 << 20  # base64 characters decoded at a time (a multiple of 4)
_URL_SAFE_BYTES = bytes.maketrans(b"-_", b"+/")
_WHITESPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"  # the ASCII characters str.split() splits on


def b64decode(text: str) -> bytes:
    """An image file's bytes from its base64 text as clients send it: plain, wrapped in lines (the base64
    tool wraps at 76 columns), in the URL-safe alphabet, or as a data URL (data:image/png;base64,...).
    The same bytes, or the same refusal (binascii.Error), as base64.b64decode(validate=True) of the text
    without its whitespace, but the whole quads before any padding are decoded a MiB of text at a time
    (one call on 64 MiB would hold the GIL for ~0.2 s, and with it the event loop) and the rest, padding
    included, in one last call. ASCII whitespace goes in one pass over the bytes (str.split would make an
    object per piece: 5.5 GB for 250 MB of "QU QU ...")."""
    if text[:5].lower() == "data:":  # the scheme and ";base64" in any case (RFC 2397, RFC 3986)
        head, comma, text = text.partition(",")
        if not comma or not head.lower().endswith(";base64"):
            raise ValueError("a data URL must carry base64: data:<media type>;base64,<data>")
    if not text.isascii():  # base64 is ASCII; Unicode spaces are refused too (splitting on them would cost 5.5 GB)
        at = re.search(r"[^\x00-\x7f]", text).start()
        raise binascii.Error(f"Only base64 data is allowed (U+{ord(text[at]):04X}, outside ASCII, at character {at:,})")
    data = text.encode("ascii")
    data = data.translate(_URL_SAFE_BYTES, _WHITESPACE)
    end = data.find(b"=")
    end = len(data) if end == -1 else end  # where the data characters end
    whole = end // 4 * 4
    if whole == end:
        whole = max(whole - 4, 0)  # the last quad goes to the last call, beside any padding
    tail = data[whole:]
    if end == len(data) and len(tail) % 4 in (2, 3):  # no padding, as URL-safe base64 often comes: added
        tail += b"=" * (4 - len(tail) % 4)
    try:
        out = [base64.b64decode(data[i:min(i + _PIECE, whole)], validate=True) for i in range(0, whole, _PIECE)]
        out.append(base64.b64decode(tail, validate=True))
    except binascii.Error as e:
        bad = re.search(rb"[^A-Za-z0-9+/=]", data)
        if bad is not None:
            raise binascii.Error(f"{chr(bad.group()[0])!r}, character {bad.start():,} once whitespace is left out, is "
                                 "not base64: A-Z, a-z, 0-9, + and / (or - and _), and = only at the end") from None
        if "number of data characters" in str(e):  # a count of the last call's piece, not of the text
            raise binascii.Error(f"Invalid base64-encoded string: number of data characters ({end}) cannot be 1 "
                                 "more than a multiple of 4") from None
        raise
    return b"".join(out)


def decoded(text: str, where: str, index: int, what: str) -> bytes:
    """b64decode(text) of the request's `where` (images[0], videos[1].frames[2]), or Refused (400) saying it is
    not base64 and, for text that reads as a file path or URL (a caller's "/tmp/x.jpg" or "photo.png"), that
    the server takes `what` (the image file's bytes) in base64, not a path to open."""
    try:
        return b64decode(text)
    except (binascii.Error, ValueError) as e:
        looks = _path_or_url(text)
        hint = "" if looks is None else (
            f"; {quoted(text, 80)} looks like a {looks}, which the server does not open: give {what} in base64 (or "
            f"as a data URL, data:<media type>;base64,<data>), not its {'URL' if looks == 'URL' else 'path'}")
        raise Refused(400, f"{where} is not valid base64 ({e}){hint}", index) from None


def _path_or_url(text: str) -> str | None:
    """"file path" or "URL" for short text that reads as one, else None. Only text that is not base64 is asked,
    and each form holds a character base64 has not ('.', ':', '~' or a backslash): base64 that begins with '/'
    (a JPEG's does) and is cut short is not taken for a path."""
    if len(text) > 4096 or not text.isprintable():
        return None
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text):
        return "URL"
    if (text.startswith(("./", "../", "~", "\\")) or re.match(r"[A-Za-z]:[\\/]", text)
            or (text.startswith("/") and "." in text) or re.search(r"\.[A-Za-z][A-Za-z0-9]{0,4}$", text)):
        return "file path"
    return None


# JSON strings, arrays, objects and commas a video request may hold (frames: a string and a comma each).
MAX_VIDEO_ITEMS = 1_000_000


def _check_items(body: bytes, most: int, what: str, advice: str) -> None:
    """Refused (413) for a body of more JSON strings, arrays, objects and commas than a request of its kind
    holds, counted before it is parsed: json.loads makes an object of each and holds the interpreter
    meanwhile (60 MB of "[]," took 1.5 GB and 7 s), while base64 holds none of their marks."""
    n = body.count(b'"') // 2 + body.count(b"[") + body.count(b"{") + body.count(b",")
    if n > most:
        raise Refused(413, f"the body holds {n:,} JSON strings, arrays, objects and commas; {what} holds at most "
                           f"{most:,}: {advice}")


# A \u escape of a character outside ASCII: a "\u" after an even run of backslashes (JSON's "\\u00e9" is an
# escaped backslash, then the ASCII text "u00e9").
_NON_ASCII_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u)(?!00[0-7][0-9a-fA-F])")


def _text(body) -> str:
    """The body as text, or Refused (400) if it holds anything but ASCII: a request holds base64, numbers
    and ASCII names, and one non-ASCII character (or a \\u escape of one) would make every string of the
    parse take 2 or 4 bytes a character (a 240 MiB body: 2 GB). json.loads of the bytes would decode them
    itself with a slower error handler (1.25 s for a 240 MiB body against 0.13 s here, holding the
    interpreter, and with it the event loop, all the while)."""
    if body.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some clients send: skipped
        body = body[3:]
    if not body.isascii():
        at = re.search(rb"[\x80-\xff]", body).start()
        raise Refused(400, f"the body holds a byte outside ASCII at offset {at:,}: a request is ASCII JSON (base64 "
                           "text, numbers and field names); one image file goes to /v1/encode as the body, with "
                           "Content-Type image/* or application/octet-stream")
    if b"\\u" in body:
        found = _NON_ASCII_ESCAPE.search(body)
        if found:
            at = found.start(1)
            raise Refused(400, f"the body escapes a character outside ASCII at offset {at:,} "
                               f"({bytes(body[at:at + 6]).decode()}): a request is ASCII JSON "
                               "(base64 text, numbers and field names)")
    return str(body, "ascii")


def _load(text: str, want: str):
    if not text.strip():
        raise Refused(400, f"the body is empty: send a JSON object, {want}")
    try:
        return json.loads(text, object_pairs_hook=_unique, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
        if "int_max_str_digits" in str(e):  # Python's own advice is for Python code, not an HTTP client
            raise Refused(400, "the body holds an integer of over 4,300 digits; the limits are whole numbers "
                               "of tokens (at most a few thousand)") from None
        raise Refused(400, f"the body is not valid JSON ({e})") from None


def _not_json(name: str):
    """NaN, Infinity and -Infinity, which Python's parser takes and JSON (RFC 8259) has not: refused as not JSON."""
    raise ValueError(f"{name} is not a JSON number: give a finite number")


def _unique(pairs: list) -> dict:
    """A JSON object whose every field is named once: a field given twice is refused, not the last one kept
    without a word."""
    twice = repeated_key(pairs)
    if twice is not None:
        raise Refused(400, f"the field {quoted(twice)} is given twice in one object; give each field once")
    return dict(pairs)


def parse_images(body: bytes, capacity: int, max_images: int = 256):
    """(images as base64 strings, min and max tokens) of an image request, or Refused. max_images: the most a
    request may hold (--max-queue), which bounds the JSON items parsed."""
    text = _text(body)  # first: an image file sent as JSON is told where it goes, not counted as JSON
    _check_items(body, 4 * max_images + 64, f"a request of up to {max_images} images (--max-queue)",
                 f"send at most {max_images} images a request, each as one base64 string")
    del body  # the caller passed its last reference: the body's memory goes before the parse makes strings
    req = _load(text, "an object with an 'images' list of base64 strings")
    if not isinstance(req, dict):
        raise Refused(400, "the body must be a JSON object with an 'images' list")
    unknown = sorted(set(req) - set(FIELDS))
    if unknown:  # a misspelt limit would otherwise be the default without a word
        raise Refused(400, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                           f"a request has {', '.join(map(repr, FIELDS))}")
    images = req.get("images")
    if not isinstance(images, list) or not images:
        raise Refused(400, "'images' must be a non-empty list of base64 strings (image files)")
    for i, text in enumerate(images):
        if not isinstance(text, str):
            raise Refused(400, f"images[{i}] is {type(text).__name__}, not a base64 string", i)
        if not text.strip():
            raise Refused(400, f"images[{i}] is empty: give each image as its file's bytes in base64", i)
    return images, *_limits(req.get("min_image_tokens"), req.get("max_image_tokens"), capacity)


DEFAULT_MIN_IMAGE_TOKENS = 16  # a request's min_image_tokens when it gives none (the reference processor's)


def default_limits(capacity: int) -> tuple[int, int]:
    """(min, max image tokens) of a request that gives neither, within the server's capacity (below 16 tokens
    a pass, the minimum is the capacity: a request giving neither is served, not refused for its default)."""
    return min(DEFAULT_MIN_IMAGE_TOKENS, capacity), min(DEFAULT_MAX_IMAGE_TOKENS, capacity)


def _limits(lo, hi, capacity: int) -> tuple[int, int]:
    """(min, max image tokens) a request gives (None: the default), checked, or Refused (400)."""
    default_lo, default_hi = default_limits(capacity)
    # A limit not given is the server's default: a refused order says which, so that the client gives it.
    notes = tuple("" if v is not None else " (the server's default: give it)" for v in (lo, hi))
    try:
        lo, hi = check_token_limits(default_lo if lo is None else lo, default_hi if hi is None else hi,
                                    ordered=False)
        if lo > capacity:
            raise Refused(400, f"min_image_tokens = {lo} exceeds the server's capacity of {capacity} tokens per pass")
        lo, hi = check_token_limits(lo, hi, notes=notes)
    except ValueError as e:
        raise Refused(400, str(e)) from None
    if hi > capacity:
        raise Refused(400, f"max_image_tokens = {hi} exceeds the server's capacity of {capacity} tokens per pass")
    return lo, hi


def image_file_limits(query: list[tuple[str, str]], capacity: int) -> tuple[int, int]:
    """(min, max image tokens) of a request whose body is one image file, from its query string's (name, value)
    pairs, or Refused (400): only the two limits, each at most once, as decimal integers."""
    given = {}
    for name, value in query:
        if name not in LIMIT_FIELDS:
            raise Refused(400, f"unknown query parameter {quoted(name)}; a request whose body is an image file takes "
                               f"{', '.join(map(repr, LIMIT_FIELDS))}")
        if name in given:
            raise Refused(400, f"the query parameter {quoted(name)} is given twice; give it once")
        if not (value.isascii() and value.isdigit()):
            raise Refused(400, f"{name}={quoted(value)}: give a whole number of tokens, as decimal digits")
        digits = value.lstrip("0") or "0"
        if len(digits) > 10:  # int() of thousands of digits is slow, and refused past 4,300 of them
            raise Refused(400, f"{name}={value[:40]}{'...' if len(value) > 40 else ''} is past any limit: give an "
                               "integer up to 2,147,483,647")
        given[name] = int(digits)
    return _limits(given.get("min_image_tokens"), given.get("max_image_tokens"), capacity)


VIDEO_FIELDS = ("videos", "sample", "target_fps", "max_frames", "max_duration", "min_image_tokens", "max_image_tokens")
VIDEO_ENTRY = ("frames", "file", "fps", "duration")  # what one video holds: its frames' image files, or a video file


def parse_videos(body: bytes) -> tuple[list[dict], dict]:
    """(videos [{"frames": [base64] or None, "file": base64 or None, "fps", "duration"}], the settings for
    preprocess_video) or Refused 400.
    The settings' values are checked by preprocess_video itself (a 422 naming the video)."""
    text = _text(body)
    _check_items(body, MAX_VIDEO_ITEMS, "a video request", "send fewer frames a request (a video file is one string)")
    del body  # as in parse_images
    req = _load(text, "an object with a 'videos' list")
    if not isinstance(req, dict):
        raise Refused(400, "the body must be a JSON object with a 'videos' list")
    unknown = sorted(set(req) - set(VIDEO_FIELDS))
    if unknown:
        raise Refused(400, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                           f"a video request has {', '.join(map(repr, VIDEO_FIELDS))}")
    videos = req.get("videos")
    if not isinstance(videos, list) or not videos:
        raise Refused(400, "'videos' must be a non-empty list of {\"frames\": [base64 image files], \"fps\": ...}")
    out = []
    for i, v in enumerate(videos):
        if not isinstance(v, dict):
            raise Refused(400, f"videos[{i}] is {type(v).__name__}, not an object with 'frames' and 'fps'", i)
        extra = sorted(set(v) - set(VIDEO_ENTRY))
        if extra:
            raise Refused(400, f"videos[{i}]: unknown field{'s' if len(extra) > 1 else ''} "
                               f"{', '.join(map(repr, extra))}; a video has {', '.join(map(repr, VIDEO_ENTRY))}", i)
        frames, file = v.get("frames"), v.get("file")
        if (frames is None) == (file is None):
            raise Refused(400, f"videos[{i}] needs 'frames' (its frames' image files) or 'file' (a video file), "
                               "one of the two", i)
        if frames is not None and (not isinstance(frames, list) or not frames or
                                   not all(isinstance(f, str) for f in frames)):
            raise Refused(400, f"videos[{i}].frames must be a non-empty list of base64 strings (image files)", i)
        if file is not None and not isinstance(file, str):
            raise Refused(400, f"videos[{i}].file must be a base64 string (a video file)", i)
        for k in ("fps", "duration"):
            if v.get(k) is not None and not _number(v[k]):
                raise Refused(400, f"videos[{i}].{k} must be a number or null, got {quoted(v[k])}", i)
            _within_float(f"videos[{i}].{k}", v.get(k), i)
        out.append({"frames": None if frames is None else list(frames), "file": file, "fps": v.get("fps"),
                    "duration": v.get("duration")})
    defaults = {"sample": True, "target_fps": 2, "max_frames": 2048, "max_duration": 0, "min_image_tokens": 16,
                "max_image_tokens": MAX_VIDEO_TOKENS}
    common = {k: (defaults[k] if req.get(k) is None else req[k]) for k in defaults}
    if not isinstance(common["sample"], bool):
        raise Refused(400, f"'sample' must be true or false, got {quoted(common['sample'])}")
    for k in ("target_fps", "max_duration"):  # the values themselves: preprocess_video's checks (422)
        if not _number(common[k]):
            raise Refused(400, f"'{k}' must be a number, got {quoted(common[k])}")
    for k in ("max_frames", "min_image_tokens", "max_image_tokens"):
        if not _number(common[k]) or not isinstance(common[k], int):
            raise Refused(400, f"'{k}' must be an integer, got {quoted(common[k])}")
    for k in ("target_fps", "max_duration", "max_frames"):
        _within_float(f"'{k}'", common[k])
    return out, common


def _within_float(name: str, x, index: int | None = None) -> None:
    """Refused (400) for an integer no float can hold (past 2**1024), or a number in a float's form past any
    float (JSON's 1e999, which json.loads reads as infinity): the frame sampling's float math cannot take it."""
    if isinstance(x, float) and not math.isfinite(x):
        raise Refused(400, f"{name} is past any float (read as {x}): give a finite number, below 1.8e308 in size",
                      index)
    if isinstance(x, int) and not isinstance(x, bool):
        try:
            float(x)
        except OverflowError:
            raise Refused(400, f"{name} = {quoted(x)} is past any float: give a number below 1.8e308", index) \
                from None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def decode_frames(videos: list[dict], max_image_mib: float) -> None:
    """Each video's base64 frames (or file) replaced by the bytes they hold, in place, or Refused: not base64
    (400), a frame over the per-image limit (413; a video file has the body's limit)."""
    for i, v in enumerate(videos):
        if v["file"] is not None:
            v["file"] = decoded(v["file"], f"videos[{i}].file", i, "the video file's bytes")
            if not v["file"]:
                raise Refused(400, f"videos[{i}].file is empty: give the video file's bytes in base64", i)
            continue
        for j, text in enumerate(v["frames"]):
            v["frames"][j] = decoded(text, f"videos[{i}].frames[{j}]", i, "each frame as its image file's bytes")
            if not v["frames"][j]:
                raise Refused(400, f"videos[{i}].frames[{j}] is empty: give each frame as its file's bytes in "
                                   "base64", i)
            if len(v["frames"][j]) > max_image_mib * 2**20:
                raise Refused(413, f"videos[{i}].frames[{j}] is {len(v['frames'][j]):,} bytes, over the "
                                   f"{max_image_mib:g} MiB limit per image", i)
