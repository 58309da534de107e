"""glmvit-serve on loopback with the float32 reference and the golden tower (CPU CI): every status code,
bit equality with the reference, batching across concurrent requests, the cache, a client that goes
away, SIGTERM, the vLLM encoder-cache layout, and the client."""

import base64
import functools
import io
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("starlette", reason="the serve extra (starlette, uvicorn, prometheus_client) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from tests.golden import cases  # noqa: E402

from glmvit_cupy import ServerError, reference
from glmvit_cupy.cli import main as cli  # noqa: E402
from glmvit_cupy.client import Client  # noqa: E402
from glmvit_cupy.preprocessing.image import REFERENCE, Patching, normalise_patchify, prepare_canvas  # noqa: E402

TOWER = str(cases.TOWER_DIR)
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def png(h, w, seed) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(cases._smooth(h, w, seed)).save(buf, format="PNG")
    return buf.getvalue()


def served_port(proc, wait_s: float) -> int:
    """The port a server started with --port 0 took, from its start line ("glmvit-serve: ... on
    http://127.0.0.1:PORT (...)"). The kernel picks the port as the server binds it: a port picked free by the
    test and passed to the server could be taken by another process (a parallel run, a Ray worker) before
    the server binds it, and the test would then fail, or talk to that other server. Read byte by byte from
    the pipe, so that proc.stdout's later reads (communicate's, with a timeout, read the pipe itself) still get
    every line after it."""
    import re
    import select

    deadline = time.monotonic() + wait_s
    fd, said = proc.stdout.fileno(), b""
    while True:
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                proc.kill()
                raise AssertionError(f"the server did not say its port in {wait_s:g} s: "
                                     f"{(said + line).decode(errors='replace')}")
            byte = os.read(fd, 1)
            if not byte:  # it ended before it listened
                proc.wait()
                raise AssertionError((said + line).decode(errors="replace"))
            line += byte
        said += line
        if found := re.search(rb" on http://127\.0\.0\.1:(\d+) ", line):
            return int(found[1])


def start(tmp_path, *flags, checkpoint=TOWER, cpu=True, wait_s=15.0):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "glmvit_cupy.serving.main", "--checkpoint", checkpoint,
                             *(["--cpu"] if cpu else []), "--port", "0", *map(str, flags)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, healthy(proc, Client(f"http://127.0.0.1:{served_port(proc, wait_s)}", timeout=60), wait_s)


def healthy(proc, client, wait_s: float):
    """The client once the server's /health says ok; AssertionError with the server's output if it exits
    or does not come up within wait_s (the process is killed then)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if client.health()["status"] == "ok":
                return client
        except (OSError, ServerError):
            time.sleep(0.05)
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
    proc.kill()
    raise AssertionError(f"the server did not come up in {wait_s:g} s: {proc.stdout.read()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    proc, client = start(tmp, "--max-queue", 4, "--max-body-mib", 1, "--max-image-mib", 0.5,
                         "--cache-mib", 16, "--vllm-ec-dir", tmp / "ec", "--max-video-pixels", 20_000_000)
    yield client, tmp / "ec"
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


@pytest.fixture(scope="module")
def tower():
    return reference.Tower(reference.bind_tower(TOWER))


def reference_bf16(tower, data, patching=REFERENCE, **limits):
    canvas, grid, _ = prepare_canvas(io.BytesIO(data), 0, patching=patching, **limits)
    return reference.encode_pixels(tower, normalise_patchify(canvas, patching), [grid]).astype(ml_dtypes.bfloat16)


def post(client, body, kind="application/json", query=""):
    """(status, reply bytes or the error's JSON) of one POST on its own connection. A server that answers before
    reading the whole body (413 from Content-Length, a bad query) closes, and the send may fail: its answer is
    read all the same (urllib would raise instead)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", int(client.url.rsplit(":", 1)[1]), timeout=60)
    try:
        try:
            conn.request("POST", "/v1/encode" + query, body=body, headers={"Content-Type": kind})
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    return (r.status, data) if r.status == 200 else (r.status, json.loads(data))


def metric(client, name) -> float:
    text = urllib.request.urlopen(client.url + "/metrics", timeout=10).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ") or
               ln.startswith(name + "{"))


def test_health_and_bit_equality(server, tower):
    client, _ = server
    h = client.health()
    assert h["status"] == "ok" and h["geometry"]["hidden_size"] == 128 and "reference" in h["backend"]
    images = [png(100, 150, 21), png(64, 96, 22)]
    embs, meta = client.encode(images, max_image_tokens=100)
    for data, emb, m in zip(images, embs, meta):
        ref = reference_bf16(tower, data, max_image_tokens=100)
        assert emb.dtype == ml_dtypes.bfloat16 and np.array_equal(emb.view(np.uint16), ref.view(np.uint16))
        assert m["tokens"] == emb.shape[0] and len(m["sha256"]) == 64 and m["cached"] is False


def test_an_image_request_is_timed_by_part_and_a_cached_one_is_not(server, rng):
    client, _ = server
    parts = ("read", "decode", "engine", "reply")

    def now():
        return ({p: metric(client, f'glmvit_request_part_seconds_count{{part="{p}"}}') for p in parts},
                {p: metric(client, f'glmvit_request_part_seconds_sum{{part="{p}"}}') for p in parts},
                metric(client, "glmvit_request_seconds_sum"))

    fresh = [png(60 + int(rng.integers(0, 40)), 70, int(rng.integers(1 << 30))) for _ in range(3)]
    n0, s0, l0 = now()
    client.encode(fresh[0])                # its file as the body
    client.encode(fresh[1:])               # two images in JSON: one request
    n1, s1, l1 = now()
    assert all(n1[p] - n0[p] == 2 for p in parts), (n0, n1)
    assert all(s1[p] > s0[p] for p in parts), (s0, s1)
    # The parts cover each request from its start to its answer, nothing twice.
    assert abs(sum(s1[p] - s0[p] for p in parts) - (l1 - l0)) < 1e-6
    client.encode(fresh[0])                # from the cache: no pass to wait for, not timed by part
    n2, _, l2 = now()
    assert n2 == n1 and l2 > l1


def test_a_request_decoding_in_a_second_round_is_timed_to_its_last_decode():
    from glmvit_cupy.serving.metrics import Metrics

    m = Metrics()  # an image's first owner gone, this request decodes it in a second round
    m.record_request(1.0, [("read", 1.1), ("decode", 1.2), ("decode", 1.45), ("engine", 1.5)], 1.75)
    m.record_request(2.0, [("read", 2.1)], 2.2)  # refused before decoding: not timed by part
    got = {p: m.registry.get_sample_value("glmvit_request_part_seconds_sum", {"part": p})
           for p in ("read", "decode", "engine", "reply")}
    assert got == pytest.approx({"read": 0.1, "decode": 0.35, "engine": 0.05, "reply": 0.25})


@pytest.mark.parametrize("body,kind,status,says,index", [
    (b"{not json", "application/json", 400, "not valid JSON", None),
    (b" \r\n", "application/json", 400, "the body is empty: send a JSON object, an object with an 'images' list", None),
    (bytes(range(0xd8, 0xe0)) + b"\xff" * 30_000 + b'"' * 20_000, "application/json", 400,
     "a byte outside ASCII at offset 0: a request is ASCII JSON (base64 text, numbers and field names); one image "
     "file goes to /v1/encode as the body", None),  # an image file sent as JSON, told so before its bytes are counted
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 413, "the body holds 100,000 JSON strings, arrays",
     None),  # counted before parsing (past the parser's depth too)
    (b"[" * 70 + b"]" * 70, "application/json", 400, "must be a JSON object", None),
    (b"[]", "application/json", 400, "JSON object", None),
    (b'{"images": []}', "application/json", 400, "non-empty list", None),
    (b'{"pictures": ["aa"]}', "application/json", 400, "unknown field 'pictures'", None),
    (b'{"min_image_tokens": 16}', "application/json", 400, "non-empty list", None),
    (b'{"images": [5]}', "application/json", 400, "not a base64 string", 0),
    (b'{"images": ["aGVsbG8=", ""]}', "application/json", 400, "images[1] is empty", 1),
    (b'{"images": ["aGVsbG8=", "data:image/png;base64,"]}', "application/json", 400, "images[1] is empty", 1),
    (b'{"images": ["aGVsbG8=", "!!!"]}', "application/json", 400, "images[1] is not valid base64", 1),
    (b'{"images": ["aGVsbG8=", "/tmp/x.jpg"]}', "application/json", 400, "images[1] is not valid base64 ('.', "
     "character 6 once whitespace is left out, is not base64: A-Z, a-z, 0-9, + and / (or - and _), and = only at the "
     "end); '/tmp/x.jpg' looks like a file path, which the server does not open: give the image file's bytes in "
     "base64 (or as a data URL, data:<media type>;base64,<data>), not its path", 1),  # a path: said to be one
    (b'{"images": ["photo.png"]}', "application/json", 400, "'photo.png' looks like a file path", 0),
    (b'{"images": ["aGVsbG8="], "max_image_tokens": 0}', "application/json", 400, "integer from 1 to 2,147,483,647", None),
    (b'{"images": ["aGVsbG8="], "min_image_tokens": "16"}', "application/json", 400, "integer from 0 to 2,147,483,647", None),
    (b'{"images": ["aGVsbG8="], "max_image_tokens": 9000}', "application/json", 400, "capacity of 8000", None),
    (b'{"images": ["aGVsbG8="], "max_image_tokens": ' + b"9" * 5000 + b"}", "application/json", 400,
     "an integer of over 4,300 digits", None),
    (b'{"images": ["aGVsbG8="]}', "text/plain", 415, "send application/json", None),
    (b'{"images": ["aGVsbG8="], "max_image_tokens": NaN}', "application/json", 400, "NaN is not a JSON number", None),
    (b'{"videos": [{"frames": ["aGVsbG8="], "fps": -Infinity}]}', "application/json", 400,
     "-Infinity is not a JSON number", None),
])
def test_bad_requests(server, body, kind, status, says, index):
    got, err = post(server[0], body, kind)
    assert got == status and says in err["error"] and err["index"] == index, err


def test_one_image_file_as_the_body_with_its_limits_in_the_query(server, tower, rng):
    """A body that is one image file (image/* or application/octet-stream), its limits in the query string, is
    the JSON request of that image: the same bits, the same metadata; the Client sends one image so."""
    from glmvit_cupy.client import _bf16_tensors as load, _metadata

    client, _ = server
    data = png(90, 70, int(rng.integers(1000)))
    want = reference_bf16(tower, data, max_image_tokens=40, min_image_tokens=20)
    got, raw = post(client, json.dumps({"images": [base64.b64encode(data).decode()], "max_image_tokens": 40,
                                        "min_image_tokens": 20}).encode())
    assert got == 200, raw
    as_json = json.loads(_metadata(raw)["images"])
    for kind in ("image/png", "application/octet-stream", "image/jpeg"):  # the type is not checked: the bytes say
        got, raw = post(client, data, kind, "?max_image_tokens=40&min_image_tokens=20")
        assert got == 200, raw
        assert np.array_equal(load(raw)["0"].view(np.uint16), want.view(np.uint16))
        assert [dict(m, cached=False) for m in json.loads(_metadata(raw)["images"])] == [dict(as_json[0], cached=False)]
    embs, meta = client.encode(data, max_image_tokens=np.int64(40), min_image_tokens=20)
    assert np.array_equal(embs[0].view(np.uint16), want.view(np.uint16)) and meta[0]["key"] == as_json[0]["key"]
    got, raw = post(client, json.dumps({"images": [base64.b64encode(data).decode()]}).encode(), query="?t=1")
    assert got == 200, raw  # a JSON request's query string (a cache-buster, say) is left alone but for the limits
    got, raw = post(client, data, "image/png")  # no query: the defaults
    assert got == 200 and load(raw)["0"].shape[0] != want.shape[0]
    none = reference_bf16(tower, data, max_image_tokens=40, min_image_tokens=0)  # 0: no minimum, keyed too
    got, raw = post(client, data, "image/png", "?max_image_tokens=40&min_image_tokens=0")
    assert got == 200 and np.array_equal(load(raw)["0"].view(np.uint16), none.view(np.uint16)), raw[:300]


def test_a_body_refused_before_it_is_read_reaches_the_client_as_its_status(server):
    """The server answers 413 from Content-Length and closes without reading the body; the client, whose send
    then fails, reads that answer (on a kept connection too) and sends the body once."""
    client, _ = server
    before = metric(client, 'glmvit_requests_total{status="413"}')
    client.health()  # the connection is kept from here
    for big in (os.urandom(2_000_000), os.urandom(24_000_000), [os.urandom(700_000)] * 2, [os.urandom(9_000_000)] * 2):
        with pytest.raises(ServerError) as e:
            client.encode(big)
        assert e.value.status == 413, e.value
    assert "images[0] is 2,000,000 bytes, over the 0.5 MiB limit per image" in str(client_error(client))
    with pytest.raises(ServerError) as e:  # a JSON body under --max-body-mib holding one image over the limit
        client.encode([b"\x89PNG", b"\x89PNG" * 150_000])  # two images: JSON, not one file as the body
    assert e.value.status == 413 and "images[1] is 600,000 bytes, over the 0.5 MiB limit" in str(e.value), e.value
    assert metric(client, 'glmvit_requests_total{status="413"}') == before + 6


def client_error(client):
    try:
        client.encode(os.urandom(2_000_000))
    except ServerError as e:
        return e


@pytest.mark.parametrize("body,kind,query,status,says,index", [
    (b"\x89PNG", "image/png", "?max_tokens=5", 400, "unknown query parameter 'max_tokens'", None),
    (b"\x89PNG", "image/png", "?max_image_tokens=5&max_image_tokens=6", 400, "given twice", None),
    (b"\x89PNG", "image/png", "?max_image_tokens=5.0", 400, "whole number of tokens", None),
    (b"\x89PNG", "image/png", "?max_image_tokens=-5", 400, "whole number of tokens", None),
    (b"\x89PNG", "image/png", "?max_image_tokens=" + "9" * 40, 400, "=9999999999999999999999999999999999999999 is past", None),
    (b"\x89PNG", "image/png", "?max_image_tokens=" + "0" * 40 + "9000", 400, "capacity of 8000", None),
    (b'{"images": ["aGVsbG8="]}', "image/png", "", 415, "the body is JSON, sent as an image file", 0),
    (b"\x89PNG" * 200_000, "application/octet-stream", "?max_image_tokens=x", 400, "whole number", None),
    (b"\x89PNG", "image/png", "?max_image_tokens=9000", 400, "capacity of 8000", None),
    (b"", "image/png", "", 400, "the body is empty", 0),
    (b"\x89PNG" * 200_000, "image/png", "", 413, "images[0] is 800,000 bytes, over the 0.5 MiB limit per image", 0),
    (b"not an image", "application/octet-stream", "", 422, "image 0: cannot decode image", 0),
    (b'{"images": ["aGVsbG8="]}', "application/json", "?max_image_tokens=5", 400, "max_image_tokens in the query string of a JSON request", None),
    (b"\x89PNG", "", "", 415, "no Content-Type: send", None),
    (b"\x89PNG", "text/plain", "", 415, "or one image file as image/* or application/octet-stream", None),
])
def test_bad_image_file_requests(server, body, kind, query, status, says, index):
    got, err = post(server[0], body, kind, query)
    assert got == status and says in err["error"] and err["index"] == index, err


@pytest.mark.parametrize("id_length", [ord("{"), ord("[")])
def test_a_tga_whose_first_byte_opens_json_is_an_image_file(server, tower, rng, id_length):
    """A TGA has no magic number: its first byte is its ID field's length, which may read as JSON's "{" or "[".
    Sent as the body it is the image Pillow reads, not a JSON request sent as a file."""
    from glmvit_cupy.client import _bf16_tensors as load

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(buf, format="TGA",
                                                                             id_section=b"x" * id_length)
    data = buf.getvalue()
    assert data[:1] == bytes([id_length])
    got, raw = post(server[0], data, "image/x-tga", "?max_image_tokens=80")
    assert got == 200, raw
    assert np.array_equal(load(raw)["0"].view(np.uint16), reference_bf16(tower, data, max_image_tokens=80).view(np.uint16))


def test_base64_as_clients_send_it_and_null_limits(server, tower, rng):
    """Wrapped lines (the base64 tool's 76 columns), the URL-safe alphabet and a data URL are the same
    image; a limit given as null is its default."""
    from glmvit_cupy.client import _bf16_tensors as load, _metadata

    client, _ = server
    data = png(90, 70, int(rng.integers(1000)))
    while b"+" not in base64.b64encode(data):
        data = png(90, 70, int(rng.integers(1000)))  # one whose base64 has '+' (so URL-safe differs)
    text = base64.b64encode(data).decode()
    forms = {"wrapped": "\n".join(text[i:i + 76] for i in range(0, len(text), 76)),
             "url-safe": base64.urlsafe_b64encode(data).decode(),
             "data URL": "data:image/png;base64," + text, "data URL in capitals": "DATA:image/png;BASE64," + text}
    assert forms["url-safe"] != text
    want = reference_bf16(tower, data, max_image_tokens=80)
    for how, form in forms.items():
        got, raw = post(client, json.dumps({"images": [form], "max_image_tokens": 80, "min_image_tokens": None}).encode())
        assert got == 200, (how, raw)
        assert np.array_equal(load(raw)["0"].view(np.uint16), want.view(np.uint16)), how
    got, raw = post(client, json.dumps({"images": [text], "max_image_tokens": None}).encode())
    assert got == 200 and load(raw)["0"].shape[0] == json.loads(_metadata(raw)["images"])[0]["tokens"]
    got, err = post(client, json.dumps({"images": ["data:image/png," + text]}).encode())
    assert got == 400 and "data URL must carry base64" in err["error"] and err["index"] == 0


def test_unknown_fields_are_refused_by_name(server):
    client, _ = server
    body = {"images": [base64.b64encode(png(40, 40, 5)).decode()], "max_image_token": 64}  # misspelt
    got, err = post(client, json.dumps(body).encode())
    assert got == 400 and err["index"] is None
    assert err["error"] == ("unknown field 'max_image_token'; a request has 'images', 'min_image_tokens', "
                            "'max_image_tokens'")


def test_a_compressed_body_is_refused_by_its_encoding(server):
    import gzip

    client, _ = server
    body = gzip.compress(json.dumps({"images": [base64.b64encode(png(20, 20, 1)).decode()]}).encode())
    req = urllib.request.Request(client.url + "/v1/encode", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 415 and json.loads(e.value.read())["error"] == (
        "Content-Encoding 'gzip': send the body uncompressed (identity)")


def raw_request(client, head: bytes, body: bytes) -> tuple[int, dict | bytes]:
    """(status, answer) of one request sent as these bytes, on its own connection: a refusal's JSON, or the
    answer's bytes as they came."""
    with socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(head + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, _, reply = answer.partition(b"\r\n\r\n")
    code = int(status.split()[1])
    return code, json.loads(reply) if code >= 400 else reply


def test_a_second_content_encoding_header_is_read_too(server):
    """Content-Encoding given twice, identity then gzip, is the list 'identity, gzip': the body is compressed, and
    refused by its encoding as the one header saying so is, not read as it came (a confusing non-ASCII 400)."""
    import gzip

    client, _ = server
    rng = np.random.default_rng()
    body = gzip.compress(json.dumps({"images": [base64.b64encode(png(20, 20, int(rng.integers(1 << 30)))).decode()]})
                         .encode())
    head = (f"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Encoding: identity\r\n"
            f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    status, reply = raw_request(client, head, body)
    assert status == 415 and reply["error"] == ("Content-Encoding 'identity, gzip': send the body uncompressed "
                                                "(identity)")


def test_two_content_types_are_refused_saying_so(server):
    """Content-Type given twice, as JSON and as an image, would be read as the first: the request is refused (400)
    naming both. The same type given twice is one type, and the image is encoded."""
    client, _ = server
    image = png(20, 20, int(np.random.default_rng().integers(1 << 30)))
    for types, status in ((("application/json", "image/png"), 400), (("image/png", "image/png; q=1"), 200)):
        head = (f"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: {types[0]}\r\nContent-Type: {types[1]}\r\n"
                f"Content-Length: {len(image)}\r\nConnection: close\r\n\r\n").encode()
        got, reply = raw_request(client, head, image)
        assert got == status, reply
        if status == 400:
            assert reply["error"] == ("Content-Type given as 'application/json' and 'image/png': send one "
                                      "Content-Type header")


@pytest.mark.parametrize("method,path,status,says", [
    ("GET", "/v1/encode", 405, "GET /v1/encode: method not allowed; this server has GET /health, GET /metrics, "
                               "POST /v1/encode, POST /v1/encode_video"),
    ("GET", "/v1/encode_video", 405, "GET /v1/encode_video: method not allowed"),
    ("POST", "/health", 405, "POST /health: method not allowed"),
    ("GET", "/v1/encoder", 404, "GET /v1/encoder: not found; this server has"),
    ("POST", "/v1/encode/", 404, "POST /v1/encode/: not found; this server has"),  # no redirect built from Host
    ("GET", "/health/", 404, "GET /health/: not found"),
    ("GET", "/" + "a" * 50_000, 404, "GET '/aaaa"),  # quoted short, not echoed whole
])
def test_wrong_path_or_method_is_json(server, method, path, status, says):
    req = urllib.request.Request(server[0].url + path, method=method, data=b"{}" if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == status and e.value.headers["Content-Type"] == "application/json"
    err = json.loads(e.value.read())
    assert err["error"].startswith(says) and err["index"] is None and len(err["error"]) < 1_000, err
    if status == 405:  # the methods the path takes, as HTTP asks
        assert {m.strip() for m in e.value.headers["Allow"].split(",")} in ({"POST"}, {"GET", "HEAD"})


def test_too_large_and_undecodable(server):
    client, _ = server
    # A body declared over the limit is refused from its headers, before it is read.
    s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (2 << 20))
    s.settimeout(10)
    reply = b""
    while not reply.endswith(b"}"):  # the headers, then the JSON body
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
    reply = reply.decode()
    s.close()
    assert reply.startswith("HTTP/1.1 413") and "MiB limit" in reply
    big = base64.b64encode(os.urandom(600_000)).decode()
    got, err = post(client, json.dumps({"images": [base64.b64encode(png(64, 64, 1)).decode(), big]}).encode())
    assert got == 413 and err["index"] == 1 and "per image" in err["error"]
    before = metric(client, "glmvit_forward_passes_total")
    got, err = post(client, json.dumps({"images": [base64.b64encode(png(64, 64, 2)).decode(),
                                                   base64.b64encode(b"not an image").decode()]}).encode())
    assert got == 422 and err["index"] == 1 and "cannot decode" in err["error"]
    assert metric(client, "glmvit_forward_passes_total") == before  # nothing of that request was encoded
    failed = metric(client, 'glmvit_images_total{outcome="failed"}')
    got, err = post(client, json.dumps({"images": [base64.b64encode(b"not an image %d" % i).decode()
                                                   for i in range(3)]}).encode())
    assert got == 422 and err["index"] == 0, err  # the first is named; all three count as failed
    assert metric(client, 'glmvit_images_total{outcome="failed"}') == failed + 3


def test_concurrent_requests_and_the_cache(server, tower):
    client, ec = server
    images = [png(80 + 8 * i, 90, 30 + i) for i in range(4)]
    passes, results = metric(client, "glmvit_forward_passes_total"), {}
    timed = metric(client, "glmvit_pass_thread_cpu_seconds_count")

    def one(i):
        results[i] = client.encode([images[i]])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    # The reference computes each image alone, so its passes hold one image each (requests take turns);
    # passes shared on the GPU are test_batcher's.
    assert metric(client, "glmvit_forward_passes_total") - passes == 4
    assert metric(client, "glmvit_pass_thread_cpu_seconds_count") - timed == 4 * 2  # launch and fetch of each
    for i, data in enumerate(images):
        assert np.array_equal(results[i][0][0].view(np.uint16), reference_bf16(tower, data).view(np.uint16))
    hits = metric(client, "glmvit_cache_hits_total")
    embs, meta = client.encode([images[0]])
    assert meta[0]["cached"] and np.array_equal(embs[0], results[0][0][0])
    assert metric(client, "glmvit_cache_hits_total") == hits + 1 and metric(client, "glmvit_cache_bytes") > 0
    # The vLLM hand-off: DIR/<sha256>/encoder_cache.safetensors, one tensor "ec_cache", finished files only.
    from safetensors import safe_open

    assert meta[0]["key"] == meta[0]["sha256"]  # the default token limits: the file's sha256, as vLLM's uuid
    path = ec / meta[0]["key"] / "encoder_cache.safetensors"
    with safe_open(str(path), "numpy") as f:
        assert list(f.keys()) == ["ec_cache"] and np.array_equal(f.get_tensor("ec_cache"), embs[0])
        assert f.metadata() == {"glmvit_weights": reference.bind_tower(TOWER).fingerprint}  # the tower that made it
    assert not [p for p in ec.rglob("*") if p.name.endswith(".tmp")]


def test_other_token_limits_hand_vllm_another_key(server):
    """The same image under other token limits is another embedding, so another vLLM key and file: a file
    written under one set of limits is never handed over for another."""
    from safetensors import safe_open

    from glmvit_cupy.vllm_ec import key_for_image

    client, ec = server
    data = png(200, 300, 33)
    got = {}
    for hi in (64, 1000):
        embs, meta = client.encode([data], max_image_tokens=hi)
        got[hi] = meta[0]["key"]
        assert meta[0]["key"] == key_for_image(meta[0]["sha256"], 16, hi) != meta[0]["sha256"]
        with safe_open(str(ec / meta[0]["key"] / "encoder_cache.safetensors"), "numpy") as f:
            assert np.array_equal(f.get_tensor("ec_cache").view(np.uint16), embs[0].view(np.uint16))
    assert got[64] != got[1000]


def test_something_in_the_way_of_one_vllm_key_is_a_409_naming_that_image_alone(server):
    """A folder where one image's vLLM file goes (and a file where another's key folder goes) made the whole request
    a 500 naming no image, and the files of the images after it were never written. Now: a 409 naming the first
    blocked image (its index and the path in the way) and how many more; every other image's file is written, the
    embeddings are kept (a retry once the way is clear is served from the cache), the server stays up, and
    glmvit_vllm_files_total counts each key's outcome."""
    import shutil

    client, ec = server
    blocked, free, other = png(41, 57, 61), png(43, 59, 62), png(45, 61, 63)
    keys = [vllm_ec_key(d) for d in (blocked, free, other)]
    (ec / keys[0] / "encoder_cache.safetensors").mkdir(parents=True)
    (ec / keys[2]).write_bytes(b"not the cache's")
    before = {o: metric(client, f'glmvit_vllm_files_total{{outcome="{o}"}}') for o in ("written", "blocked", "failed")}
    conflicts = metric(client, 'glmvit_requests_total{status="409"}')
    body = json.dumps({"images": [base64.b64encode(d).decode() for d in (blocked, free, blocked, other)]}).encode()
    status, err = post(client, body)
    assert status == 409 and err["index"] == 0, err
    assert err["error"].startswith(f"images[0]: its embedding is computed, but its file in the vLLM encoder cache "
                                   f"cannot be written: {ec / keys[0] / 'encoder_cache.safetensors'} is not a plain "
                                   "file"), err
    assert "so is the file of 1 more of this request's images (images[3])" in err["error"], err
    assert "the files of the request's other images are written" in err["error"], err
    assert (ec / keys[1] / "encoder_cache.safetensors").is_file() and client.health()["status"] == "ok"
    after = {o: metric(client, f'glmvit_vllm_files_total{{outcome="{o}"}}') for o in before}
    assert {o: after[o] - before[o] for o in before} == {"written": 1, "blocked": 2, "failed": 0}
    assert metric(client, 'glmvit_requests_total{status="409"}') == conflicts + 1
    hits = metric(client, "glmvit_cache_hits_total")
    shutil.rmtree(ec / keys[0])
    (ec / keys[2]).unlink()
    embs, meta = client.encode([blocked, free, blocked, other])
    assert [m["key"] for m in meta] == [keys[0], keys[1], keys[0], keys[2]] and all(m["cached"] for m in meta)
    assert metric(client, "glmvit_cache_hits_total") == hits + 4  # nothing encoded again
    from safetensors.numpy import load_file

    for k, emb in zip(keys, (embs[0], embs[1], embs[3])):
        assert np.array_equal(load_file(str(ec / k / "encoder_cache.safetensors"))["ec_cache"].view(np.uint16),
                              emb.view(np.uint16))


def test_a_blocked_vllm_key_is_logged_with_its_own_status(tmp_path):
    """The operator's log line of a 409 (something in the way of one image's vLLM file) said 500, the status of
    the folder's own failure: it names the status the client got."""
    ec = tmp_path / "ec"
    proc, client = start(tmp_path, "--vllm-ec-dir", ec)
    try:
        blocked = png(41, 57, 64)
        (ec / vllm_ec_key(blocked) / "encoder_cache.safetensors").mkdir(parents=True)
        status, err = post(client, json.dumps({"images": [base64.b64encode(blocked).decode()]}).encode())
        assert status == 409 and err["index"] == 0, err
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    logged = proc.stdout.read()
    assert "glmvit-serve: /v1/encode: 409: images[0]: its embedding is computed, but its file" in logged, logged
    assert ": 500: " not in logged, logged


def vllm_ec_key(data: bytes) -> str:
    from glmvit_cupy.vllm_ec import key_for_image, key_of

    return key_for_image(key_of(data), 16, 8000)


def test_a_client_that_goes_away_breaks_nothing(server, tower):
    client, _ = server
    gone, kept = png(96, 64, 70), png(64, 120, 71)
    body = json.dumps({"images": [base64.b64encode(gone).decode()]}).encode()
    s = socket.create_connection(("127.0.0.1", int(client.url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    s.close()  # gone before the answer, its image decoded, queued or in its pass
    embs, _ = client.encode([kept])
    assert np.array_equal(embs[0].view(np.uint16), reference_bf16(tower, kept).view(np.uint16))
    assert client.health()["status"] == "ok"


def test_client_error_fields(server):
    with pytest.raises(ServerError) as e:
        server[0].encode([png(64, 64, 3), b"\x89PNG broken"])
    assert e.value.status == 422 and e.value.index == 1


def test_a_tower_of_another_merge_size_is_served_with_its_own_patching(tmp_path):
    """A 3 x 3-merge tower of 16-pixel single-frame patches: the server's tokens and embeddings are the
    reference's of the image preprocessed with the tower's own patching, bit for bit."""
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import write_checkpoint

    geo = dataclasses.replace(cases.GEOMETRY, spatial_merge_size=3, patch_size=16, temporal_patch_size=1, depth=1)
    ckpt = write_checkpoint(tmp_path / "m3", geo, seed=6)
    proc, client = start(tmp_path, "--max-wait-ms", 50, checkpoint=ckpt)
    try:
        images = [png(100, 150, 31), png(300, 64, 32)]
        embs, meta = client.encode(images, max_image_tokens=60)
        tower = reference.Tower(reference.bind_tower(ckpt))
        for data, emb, m in zip(images, embs, meta):
            ref = reference_bf16(tower, data, Patching.of(geo), max_image_tokens=60)
            assert np.array_equal(emb.view(np.uint16), ref.view(np.uint16)) and m["tokens"] == emb.shape[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_loading_answers_503(tmp_path):
    """While the model loads, /health and /v1/encode say 503 (in process, with a slow loader)."""
    import uvicorn

    from glmvit_cupy.serving.app import Settings, create_app

    release = threading.Event()

    def slow_load():
        release.wait(30)
        raise RuntimeError("no model in this test")

    app = create_app(slow_load, Settings(checkpoint="test"))
    sock = socket.create_server(("127.0.0.1", 0))  # bound here: no other process can take the port meanwhile
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    client = Client(f"http://127.0.0.1:{port}", timeout=10)
    for _ in range(200):
        try:
            client.health()
        except ServerError as e:
            assert e.status == 503 and "loading" in e.error
            break
        except OSError:
            time.sleep(0.05)
    got, err = post(client, b'{"images": ["aGVsbG8="]}')
    assert got == 503 and "still loading" in err["error"]
    release.set()
    deadline = time.monotonic() + 10  # the loading thread fails once it wakes: soon, but not at once on a busy host
    while "still loading" in post(client, b'{"images": ["aGVsbG8="]}')[1]["error"] and time.monotonic() < deadline:
        time.sleep(0.05)
    got, err = post(client, b'{"images": ["aGVsbG8="]}')
    assert got == 503 and "failed to load (RuntimeError: no model in this test)" in err["error"]
    app.state.glmvit["status"] = "stopping"  # what SIGTERM sets before uvicorn drains the connections
    got, err = post(client, b'{"images": ["aGVsbG8="]}')
    assert got == 503 and "shutting down" in err["error"]
    srv.should_exit = True
    th.join(10)


def test_a_bad_image_never_touches_another_request(server, tower):
    client, _ = server
    good = png(88, 64, 95)
    got = {}
    tg = threading.Thread(target=lambda: got.update(good=client.encode([good])))
    tg.start()
    bad = post(client, json.dumps({"images": [base64.b64encode(b"GIF89a broken").decode()]}).encode())
    tg.join()
    assert bad[0] == 422 and bad[1]["index"] == 0
    assert np.array_equal(got["good"][0][0].view(np.uint16), reference_bf16(tower, good).view(np.uint16))


def test_glmvit_encode_writes_the_vllm_layout_too(tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(png(64, 80, 90))
    assert cli.main([str(img), "--checkpoint", TOWER, "--out", str(tmp_path / "out"), "--cpu",
                     "--vllm-ec-dir", str(tmp_path / "ec")]) == 0
    import hashlib

    from safetensors import safe_open

    sha = hashlib.sha256(img.read_bytes()).hexdigest()
    with safe_open(str(tmp_path / "ec" / sha / "encoder_cache.safetensors"), "numpy") as f:
        assert f.get_tensor("ec_cache").dtype == ml_dtypes.bfloat16
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert next(iter(manifest["images"].values()))["sha256"] == sha
    # Other token limits: another embedding, under vllm_ec.key_for_image's key, not the sha256's.
    from glmvit_cupy.vllm_ec import key_for_image

    assert cli.main([str(img), "--checkpoint", TOWER, "--out", str(tmp_path / "out64"), "--cpu",
                     "--max-image-tokens", "64", "--vllm-ec-dir", str(tmp_path / "ec")]) == 0
    with safe_open(str(tmp_path / "ec" / key_for_image(sha, 16, 64) / "encoder_cache.safetensors"), "numpy") as f:
        assert f.get_tensor("ec_cache").shape[0] <= 64


def test_devices_with_cpu_is_refused_before_loading(capsys):
    from glmvit_cupy.serving import main as serve_main
    assert serve_main.main(["--checkpoint", TOWER, "--cpu", "--devices", "0"]) == 2
    assert "--cpu serves the float32 reference on the host, without a GPU: leave out --devices" in \
        capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--max-pixels", "-3"], "--max-pixels -3 must be at least 1"),
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--max-wait-ms", "-1"], "--max-wait-ms -1 must be a finite number of at least 0"),
    (["--max-wait-ms", "inf"], "--max-wait-ms inf must be a finite"),
    (["--cache-mib", "-5"], "--cache-mib -5 must be a finite number of at least 0"),
    (["--max-body-mib", "0"], "--max-body-mib 0 must be a finite number above 0"),
    (["--max-image-mib", "nan"], "--max-image-mib nan must be a finite number above 0"),
    # Bytes are counted whole: --max-body-mib 1e-9 is 0 bytes, and every request got 413 "over the 0 MiB limit".
    (["--max-body-mib", "1e-9"], "--max-body-mib 1e-09 must be at least 1/1024 (1 KiB)"),
    (["--max-image-mib", "0.0005"], "--max-image-mib 0.0005 must be at least 1/1024 (1 KiB)"),
    (["--max-queue", "0"], "--max-queue 0 must be at least 1"),
    (["--max-video-pixels", "0"], "--max-video-pixels 0 must be at least 1"),
    (["--max-pixels-in-flight", "0"], "--max-pixels-in-flight 0 must be at least 1"),
    (["--max-pixels", "1000000", "--max-pixels-in-flight", "999999"], "--max-pixels-in-flight 999,999 is below the "
     "1,000,000 pixels one image may have (--max-pixels): such an image could never be decoded"),
    (["--max-pixels-in-flight", "1000"], "below the 89,478,485 pixels one image may have"),
    # Every image's canvas holds at least the 16-token minimum (16 x 784 pixels): below it, every image got 413.
    (["--max-pixels", "10000", "--max-pixels-in-flight", "10000"], "--max-pixels-in-flight 10,000 is below the "
     "12,544 pixels of the smallest canvas (16 tokens, a request's default min_image_tokens): no image could be"),
    (["--max-connections", "0"], "--max-connections 0 must be at least 1"),
    (["--header-timeout", "0"], "--header-timeout 0 must be a finite number above 0"),
    (["--body-timeout", "inf"], "--body-timeout inf must be a finite number above 0"),
    (["--drain-timeout", "-1"], "--drain-timeout -1 must be a finite number above 0"),
    (["--reply-timeout", "0"], "--reply-timeout 0 must be a finite number above 0"),
    (["--max-reply-mib", "nan"], "--max-reply-mib nan must be a finite number above 0"),
    (["--max-bodies-in-flight-mib", "0"], "--max-bodies-in-flight-mib 0 must be a finite number above 0"),
    (["--max-bodies-in-flight-mib", "100"], "--max-bodies-in-flight-mib 100 is below the 256 MiB one body may have "
     "(--max-body-mib): such a body could never be held; raise it to at least 256"),
    (["--max-bodies-in-flight-mib", "300"], "--max-bodies-in-flight-mib 300 is below the 1024 MiB one reply may have "
     "(--max-reply-mib)"),
])
def test_bad_settings_are_refused_at_start_not_per_request(capsys, flags, says):
    """An operator's bad flag stops the server before it loads, with exit code 2 and the reason (not a 422
    on every request as if the client were wrong, not a traceback)."""
    from glmvit_cupy.serving import main as serve_main
    assert serve_main.main(["--checkpoint", TOWER, "--cpu"] + flags) == 2
    assert says in capsys.readouterr().err


def test_control_characters_in_a_checkpoints_names_are_escaped_at_start(capsys, tmp_path):
    """A shard whose name holds a newline and escape sequences (a folder without an index: the error names
    it) forged a "glmvit-serve:" line and drove the terminal; it is written escaped, as glmvit-encode does."""
    from glmvit_cupy.serving import main as serve_main

    (tmp_path / "config.json").write_text(open(os.path.join(TOWER, "config.json")).read())
    (tmp_path / "evil\x1b[31mRED\nglmvit-serve: all good\x07.safetensors").write_bytes(b"xx")
    assert serve_main.main(["--checkpoint", str(tmp_path), "--cpu"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "evil\\x1b[31mRED\\x0aglmvit-serve: all good\\x07" in err, err
    assert not any(line.startswith("glmvit-serve: all good") for line in err.splitlines()), err


def test_a_vllm_folder_that_cannot_be_written_is_refused_at_start(capsys, tmp_path):
    """--vllm-ec-dir naming a file (or a folder that cannot be made): exit 2 at start, saying why, not a 500
    on every request after a "ready"."""
    from glmvit_cupy.serving import main as serve_main

    (tmp_path / "f").write_text("x")
    cases = [(tmp_path / "f", "Not a directory (ENOTDIR); make it a folder"),
             (tmp_path / "f" / "sub", "Not a directory (ENOTDIR)")]
    if os.path.isdir("/proc/self"):  # a folder whose permission bits allow writes (to root) that fail
        cases.append(("/proc/glmvit-ec", "no file can be made in /proc: "))
    for ec, says in cases:
        assert serve_main.main(["--checkpoint", TOWER, "--cpu", "--vllm-ec-dir", str(ec)]) == 2
        err = capsys.readouterr().err
        assert f"glmvit-serve: cannot use the vLLM encoder cache folder {ec}: " in err and says in err, err
    assert serve_main.main(["--checkpoint", TOWER, "--cpu", "--vllm-ec-dir", ""]) == 2  # an unset variable
    assert "--vllm-ec-dir is empty (an unset variable?)" in capsys.readouterr().err


def test_a_port_in_use_is_refused_at_start_with_exit_3(capsys):
    """A port another socket holds: exit 3 before the model loads, saying which address and what to do."""
    from glmvit_cupy.serving import main as serve_main
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        assert serve_main.main(["--checkpoint", TOWER, "--cpu", "--port", str(port)]) == 3
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use): choose another --port (0: any free one)" \
        in capsys.readouterr().err


def test_port_0_says_the_port_it_took():
    """--port 0: the start line and the ready line name the port taken, which answers."""
    proc = subprocess.Popen([sys.executable, "-m", "glmvit_cupy.serving.main", "--checkpoint", TOWER, "--cpu",
                             "--port", "0"], env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        first, ready = proc.stdout.readline(), proc.stdout.readline()
        port = int(first.split("http://127.0.0.1:")[1].split()[0])
        assert port != 0 and f"ready: serving on http://127.0.0.1:{port} (loaded in" in ready, (first, ready)
        assert Client(f"http://127.0.0.1:{port}").health()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_tower_whose_patches_are_not_rgb_is_refused_at_start(capsys, tmp_path):
    """The server takes images: a tower of one-channel patches stops it before it loads, naming the field."""
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import write_checkpoint
    from glmvit_cupy.serving import main as serve_main

    ckpt = write_checkpoint(tmp_path / "grey", dataclasses.replace(cases.GEOMETRY, in_channels=1, depth=1))
    assert serve_main.main(["--checkpoint", ckpt, "--cpu"]) == 2
    assert "in_channels = 1; use encode_pixels" in capsys.readouterr().err


# -- videos -----------------------------------------------------------------------------------------------

def clip(t, h, w, seed):
    return np.stack([cases._smooth(h, w, seed + k) for k in range(t)])


def post_video(client, body):
    req = urllib.request.Request(client.url + "/v1/encode_video", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("video, settings, says", [
    ({"fps": 4}, {"target_fps": 1e308}, "give a frame count past any float"),
    ({"fps": 5e-324}, {}, "give a frame count past any float"),
    ({"fps": 4, "duration": 1e308}, {}, "give a frame count past any float"),
    ({"fps": 1e-310}, {"sample": False}, "fps=1e-310 puts frame 7 at a time past any float"),  # no inf in the reply
    ({"fps": 2}, {"min_image_tokens": 10**400}, "min_image_tokens=1000000000000000000000000000000000000000... "
                                                 "(401 characters) must be an integer from 0 to 2,147,483,647"),
])
def test_video_settings_past_any_float_are_a_422_naming_the_video(server, video, settings, says):
    client, _ = server
    frame = base64.b64encode(png(24, 32, 5)).decode()
    status, err = post_video(client, {"videos": [{"frames": [frame] * 8, **video}], **settings})
    assert status == 422 and err["index"] == 0 and err["error"].startswith("video 0") and says in err["error"], err


def test_a_huge_value_is_quoted_short_in_the_error(server):
    """A bad value a request sends is quoted in at most ~40 characters, not echoed whole into the reply."""
    client, _ = server
    status, err = post(client, json.dumps({"images": ["x"], "max_image_tokens": "A" * 1_000_000}).encode())
    assert status in (400, 422) and len(err["error"]) < 300 and "(1,000,002 characters)" in err["error"], err


def videos_beside_images(client):
    """Two videos in one request while two image requests run on threads: (videos, image files, the videos'
    embeddings, their metadata, {i: image i's embedding})."""
    vids = [clip(5, 60, 90, 70), clip(3, 40, 44, 80)]
    images = [png(70, 50, 23), png(40, 90, 24)]
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, client.encode([images[i]])[0][0]))
               for i in range(2)]
    for th in threads:
        th.start()
    embs, meta = client.encode_video(vids, fps=[4.0, 2.0], max_image_tokens=200)
    for th in threads:
        th.join()
    return vids, images, embs, meta, got


def test_videos_bit_equal_to_the_reference_beside_image_requests(server, tower):
    """Two videos in one request (frames sent as PNG: lossless), sampled and preprocessed as the reference
    video processor, bit-equal to the reference on preprocess_video's rows, while image requests run."""
    from glmvit_cupy import preprocess_video

    client, ec = server
    before = metric(client, "glmvit_videos_total")
    vids, images, embs, meta, got_images = videos_beside_images(client)
    pv, grid, infos = preprocess_video(vids, fps=[4.0, 2.0], max_image_tokens=200)
    ref = reference.encode_pixels(tower, pv, grid).astype(ml_dtypes.bfloat16)
    ref = np.split(ref, np.cumsum([i["tokens"] for i in infos])[:-1])
    for emb, r, m, info in zip(embs, ref, meta, infos):
        assert emb.dtype == ml_dtypes.bfloat16 and np.array_equal(emb.view(np.uint16), r.view(np.uint16))
        assert m == {"grid_thw": list(info["grid"]), "tokens": info["tokens"], "frame_tokens": info["frame_tokens"],
                     "frames_indices": info["frames_indices"], "timestamps": info["timestamps"], "cached": False,
                     "key": m["key"]}
    assert [m["frames_indices"] for m in meta] == [[0, 1, 2, 4], [0, 1, 2, 2]]
    for i in range(2):
        assert np.array_equal(got_images[i].view(np.uint16), reference_bf16(tower, images[i]).view(np.uint16))
    assert metric(client, "glmvit_videos_total") == before + 2
    every, every_meta = client.encode_video([list(vids[1])], sample=False, max_image_tokens=200)  # frames as given
    pv1, grid1, _ = preprocess_video(vids[1], sample=False, max_image_tokens=200)
    want = reference.encode_pixels(tower, pv1, grid1).astype(ml_dtypes.bfloat16)
    assert np.array_equal(every[0].view(np.uint16), want.view(np.uint16))
    # The same video with other settings is another key; the same request again comes from the cache, the
    # repeated video of one request is encoded once; every video's embedding is in the vLLM layout.
    assert every_meta[0]["key"] != meta[1]["key"] and len({m["key"] for m in meta}) == 2
    hits = metric(client, "glmvit_cache_hits_total")
    again, again_meta = client.encode_video([vids[1], vids[0], vids[1]], fps=[2.0, 4.0, 2.0], max_image_tokens=200)
    assert [m["cached"] for m in again_meta] == [True, True, True]
    assert [m["key"] for m in again_meta] == [meta[1]["key"], meta[0]["key"], meta[1]["key"]]
    for a, b in zip(again, [embs[1], embs[0], embs[1]]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    assert metric(client, "glmvit_cache_hits_total") == hits + 3
    encoded = metric(client, 'glmvit_videos_total{outcome="encoded"}')
    fresh, fresh_meta = client.encode_video([vids[0], vids[0]], fps=3.0, max_image_tokens=200)  # new key, twice
    # encoded once: the repeat is served from the first one's encode, and says so
    assert [m["cached"] for m in fresh_meta] == [False, True] and fresh_meta[0]["key"] == fresh_meta[1]["key"]
    assert metric(client, 'glmvit_videos_total{outcome="encoded"}') == encoded + 1
    assert np.array_equal(fresh[0].view(np.uint16), fresh[1].view(np.uint16))
    from safetensors import safe_open

    for m, e in zip(meta + every_meta + fresh_meta, embs + every + fresh):
        with safe_open(str(ec / m["key"] / "encoder_cache.safetensors"), "numpy") as f:
            assert list(f.keys()) == ["ec_cache"] and np.array_equal(f.get_tensor("ec_cache").view(np.uint16),
                                                                      e.view(np.uint16))


def test_a_video_file_is_decoded_by_the_server(server, tower, tmp_path):
    """A video sent as its file (a lossless clip): the server samples and decodes it as preprocess_video does
    the same path, bit-equal to the reference; its key is the file's; again from the cache."""
    av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    from glmvit_cupy import preprocess_video

    frames = clip(21, 44, 60, 90)
    path = tmp_path / "clip.mkv"
    with av.open(str(path), "w") as c:
        st = c.add_stream("ffv1", rate=6)
        st.width, st.height, st.pix_fmt = 60, 44, "bgr0"
        for f in frames:
            for pkt in st.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(pkt)
        for pkt in st.encode():
            c.mux(pkt)
    client, ec = server
    embs, meta = client.encode_video([str(path), path.read_bytes()], max_image_tokens=200)
    pv, grid, infos = preprocess_video(path, max_image_tokens=200)
    want = reference.encode_pixels(tower, pv, grid).astype(ml_dtypes.bfloat16)
    assert meta[0]["frames_indices"] == infos[0]["frames_indices"] and meta[0]["timestamps"] == infos[0]["timestamps"]
    for e in embs:
        assert np.array_equal(e.view(np.uint16), want.view(np.uint16))
    assert meta[0]["key"] == meta[1]["key"] and (ec / meta[0]["key"] / "encoder_cache.safetensors").exists()
    again, again_meta = client.encode_video([path.read_bytes()], max_image_tokens=200)
    assert again_meta[0]["cached"] and np.array_equal(again[0].view(np.uint16), want.view(np.uint16))


def test_the_same_bytes_as_a_video_file_and_as_a_frame_are_two_videos(server):
    """An animated GIF is a video file of six frames, or one frame (its first) of a video: two embeddings,
    two keys, and neither answered from the other's cache entry, in either order."""
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    client, _ = server
    frames = [Image.fromarray(np.full((40, 56, 3), 40 * i, np.uint8)) for i in range(6)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
    gif = buf.getvalue()
    as_file = client.encode_video([gif], fps=4.0, max_image_tokens=200)
    as_frame = client.encode_video([[gif]], fps=4.0, max_image_tokens=200)
    assert not as_frame[1][0]["cached"] and as_frame[1][0]["key"] != as_file[1][0]["key"]
    assert as_frame[1][0]["grid_thw"][0] == 1 and as_file[1][0]["grid_thw"][0] > 1
    again = client.encode_video([[gif]], fps=4.0, max_image_tokens=200)
    assert again[1][0]["cached"] and np.array_equal(again[0][0].view(np.uint16), as_frame[0][0].view(np.uint16))


def test_a_video_key_covers_its_frames_in_order_and_every_setting():
    from glmvit_cupy import vllm_ec

    frames, settings = [b"a", b"b"], {"sample": True, "target_fps": 2, "max_image_tokens": 200}
    key = functools.partial(vllm_ec.video_key_of, kind="frames")
    mine = key(frames, 4.0, None, settings)
    assert mine == key(list(frames), 4.0, None, dict(reversed(list(settings.items()))))
    others = [key(frames[::-1], 4.0, None, settings), key(frames, 2.0, None, settings),
              key(frames, 4.0, 1.0, settings), key(frames[:1], 4.0, None, settings),
              key(frames, 4.0, None, {**settings, "max_image_tokens": 100}),
              vllm_ec.video_key_of(frames[:1], 4.0, None, settings, kind="file")]  # the bytes as a video file
    assert len({mine, *others}) == 7 and all(len(k) == 64 for k in others)
    for kind, files in (("file", frames), ("clip", frames[:1])):
        with pytest.raises(ValueError, match="kind is 'frames' .image files. or 'file' .one video file."):
            vllm_ec.video_key_of(files, 4.0, None, settings, kind=kind)


def _b64png(a) -> str:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_damaged_video_files_are_refused_by_name_and_the_server_goes_on(server):
    """Truncated copies of golden clips sent as files: each a 422 naming video 0 (PyAV's own errors from the
    container and the packet scan, or the sampling of what is left), never a 500; then a whole clip encodes."""
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    golden = os.path.join(os.path.dirname(__file__), "golden", "video_files")
    for name in ("h264_10bit_rot90.mp4", "vp9_10bit.webm"):
        with open(os.path.join(golden, name), "rb") as f:
            data = f.read()
        for fraction in (0.02, 0.1, 0.5):
            body = {"videos": [{"file": base64.b64encode(data[:int(len(data) * fraction)]).decode()}]}
            got, err = post_video(server[0], body)
            assert got == 422 and err["error"].startswith("video 0: ") and err["index"] == 0, (name, fraction, err)
    whole = {"videos": [{"file": base64.b64encode(data).decode()}]}  # vp9_10bit.webm
    assert post_video(server[0], whole)[0] == 200
    got, err = post_video(server[0], {"videos": [dict(whole["videos"][0], fps=0)]})  # its admission divided by 0
    assert got in (400, 422) and err["index"] == 0 and "fps" in err["error"], err


def test_a_video_file_whose_stream_declares_no_size_is_a_422(server, tmp_path):
    """An MPEG-4 file without its decoder setup box (esds): PyAV reports the stream as 0 x 0, and the
    admission's pixel count divided by it (a 500 with a traceback once)."""
    av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    path = str(tmp_path / "v.mp4")
    with av.open(path, "w") as c:
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for i in range(24):
            frame = np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
            for pkt in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    with open(path, "rb") as f:
        data = f.read()
    assert data.count(b"esds") == 1
    for sample in (True, False):
        body = {"videos": [{"file": base64.b64encode(data.replace(b"esds", b"esXs")).decode()}], "sample": sample}
        got, err = post_video(server[0], body)
        assert got == 422 and err["error"].startswith("video 0: ") and err["index"] == 0, err


@pytest.mark.parametrize("body,status,says,index", [
    ([], 400, "JSON object with a 'videos' list", None),
    ({"videos": []}, 400, "'videos' must be a non-empty list", None),
    ({"videos": [{"frames": ["F"], "fps": 2}], "fps": 2}, 400, "unknown field 'fps'; a video request has", None),
    ({"videos": ["x"]}, 400, "videos[0] is str, not an object", 0),
    ({"videos": [{"frames": ["F"], "rate": 2}]}, 400, "videos[0]: unknown field 'rate'; a video has", 0),
    ({"videos": [{"frames": []}]}, 400, "videos[0].frames must be a non-empty list", 0),
    ({"videos": [{"frames": ["F"]}, {"frames": ["F", "!!"]}]}, 400, "videos[1].frames[1] is not valid base64", 1),
    ({"videos": [{"frames": ["F", "data:image/png;base64,"]}]}, 400, "videos[0].frames[1] is empty", 0),
    ({"videos": [{"file": "data:video/mp4;base64,"}]}, 400, "videos[0].file is empty", 0),
    ({"videos": [{"frames": ["F"], "fps": 2}], "sample": "yes"}, 400, "'sample' must be true or false", None),
    ({"videos": [{"frames": ["F", "aGVsbG8="], "fps": 2}]}, 422, "video 0 frame 1: cannot decode", 0),
    ({"videos": [{"frames": ["F", "G"], "fps": 2}]}, 422, "video 0: frame 1 is 30x20, frame 0 20x20", 0),
    ({"videos": [{"frames": ["F"]}]}, 422, "video 0: sampling frames needs the video's fps", 0),
    ({"videos": [{"frames": ["F"], "fps": -1}]}, 422, "video 0: fps=-1 must be a positive finite number", 0),
    ({"videos": [{"frames": ["F"], "fps": 2}], "target_fps": 0}, 422, "target_fps=0 must be a positive", 0),
    ({"videos": [{"frames": ["B", "B"], "fps": 2}]}, 422, "video 0: a group of 2 frames is 8649 tokens, over the "
                                                         "server's capacity of 8000 tokens per pass", 0),
    ({"videos": [{"frames": ["F"], "fps": 2}, {"frames": ["B", "B", "B"], "fps": 2}]}, 422,
     "video 1: its 3 sampled frames have 20,342,448 pixels, over the limit of 20,000,000", 1),
    ({"videos": [{"frames": ["F", "nope", "F"], "fps": 2}], "max_frames": 2}, 200, None, None),  # frames 0, 2 sampled
    ({"videos": [{"frames": ["F"], "file": "F"}]}, 400, "videos[0] needs 'frames' (its frames' image files) or "
                                                       "'file' (a video file), one of the two", 0),
    ({"videos": [{"fps": 2}]}, 400, "videos[0] needs 'frames'", 0),
    ({"videos": [{"file": 7}]}, 400, "videos[0].file must be a base64 string (a video file)", 0),
    ({"videos": [{"file": "!!"}]}, 400, "videos[0].file is not valid base64", 0),
    ({"videos": [{"file": "clip.mp4"}]}, 400, "'clip.mp4' looks like a file path, which the server does not open: "
                                              "give the video file's bytes in base64", 0),
    ({"videos": [{"frames": ["F", "f1.png"]}]}, 400, "videos[0].frames[1] is not valid base64 ('.', character 2 "
     "once whitespace is left out, is not base64: A-Z, a-z, 0-9, + and / (or - and _), and = only at the end); "
     "'f1.png' looks like a file path, which the server does not open: give each frame as its image file's bytes", 0),
    ({"videos": [{"file": "aGVsbG8="}]}, 422, "video 0: cannot open the video file of 5 bytes as a video", 0),
])
def test_video_requests_refused_by_name(server, body, status, says, index):
    if says and "cannot open the video file" in says and importlib.util.find_spec("av") is None:
        pytest.skip("the video extra (PyAV) is not installed: a video file is refused before it is opened")
    frames = {"F": _b64png(clip(1, 20, 20, 1)[0]), "G": _b64png(clip(1, 20, 30, 2)[0]),
              "B": _b64png(np.full((2604, 2604, 3), 90, np.uint8))}
    if isinstance(body, dict):
        body = json.loads(json.dumps(body))
        for v in body.get("videos", []):
            if isinstance(v, dict) and "frames" in v:
                v["frames"] = [frames.get(f, f) for f in v["frames"]]
    got, err = post_video(server[0], body)
    if status == 200:  # only sampled frames are decoded: an unsampled one is never read
        assert got == 200, err
        return
    assert got == status and says in err["error"] and err["index"] == index, err


def test_a_vllm_cache_that_cannot_be_written_fails_the_request_saying_where(tmp_path):
    """--vllm-ec-dir made unwritable while the server runs (here: a file where the folder was): the request
    gets a 500 that says the embeddings were computed but could not be written there, and why; the server
    stays up and serves the next request once the folder is back."""
    import shutil

    ec = tmp_path / "ec"
    proc, client = start(tmp_path, "--vllm-ec-dir", ec)
    try:
        body = json.dumps({"images": [base64.b64encode(png(60, 80, 31)).decode()]}).encode()
        shutil.rmtree(ec, ignore_errors=True)
        ec.write_text("not a folder")
        status, err = post(client, body)
        assert status == 500 and f"writing them to the vLLM encoder cache {ec} failed" in err["error"], err
        ec.unlink()
        status, _ = post(client, body)
        assert status == 200 and len(os.listdir(ec)) == 1 and client.health()["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_embeddings_of_weights_that_overflow_are_a_500_naming_the_image_never_sent(tmp_path):
    """A checkpoint whose finite weights overflow the forward (cases.overflowing_tower): a request gets a 500
    naming the image and saying why, nothing reaches the vLLM folder, the same image asked again (now in
    the cache) fails alike, and a video request too; the server stays up."""
    ec = tmp_path / "ec"
    proc, client = start(tmp_path, "--vllm-ec-dir", ec, "--max-wait-ms", 5,
                         checkpoint=cases.overflowing_tower(tmp_path / "bad"))
    try:
        body = json.dumps({"images": [base64.b64encode(png(60, 80, 41)).decode(),
                                      base64.b64encode(png(50, 70, 42)).decode()]}).encode()
        for _ in range(2):
            status, err = post(client, body)
            assert status == 500 and err["index"] == 0, err
            assert err["error"].startswith("images[0]: the tower's output holds ") and "NaN or infinite" in err["error"]
        assert not (ec.exists() and os.listdir(ec))
        with pytest.raises(ServerError) as e:
            client.encode_video([clip(3, 40, 44, 80)], fps=[2.0])
        assert e.value.status == 500 and e.value.index == 0, e.value
        assert e.value.error.startswith("videos[0]: the tower's output holds "), e.value
        assert client.health()["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    logged = proc.stdout.read()  # the operator is told of each 500
    assert logged.count("glmvit-serve: /v1/encode: 500: images[0]: the tower's output holds ") == 2, logged
    assert "glmvit-serve: /v1/encode_video: 500: videos[0]: the tower's output holds " in logged, logged


def test_a_capacity_under_the_default_minimum_serves_requests_that_give_no_limits():
    """--capacity-tokens 8: a request giving no limits got 400 'min_image_tokens=16 is above max_image_tokens=8',
    blaming the client for the server's setting; its default minimum is now the capacity."""
    from glmvit_cupy.serving.requests import image_file_limits

    assert image_file_limits([], 8) == (8, 8) and image_file_limits([], 8000) == (16, 8000)
    assert image_file_limits([("min_image_tokens", "4")], 8) == (4, 8)


def test_an_order_refused_for_a_default_limit_says_it_is_the_servers():
    """A request giving only max_image_tokens=1 was told 'min_image_tokens=16 is above max_image_tokens=1', a 16
    it never sent; the limit it did not give is named as the server's default."""
    from glmvit_cupy.serving.requests import Refused, image_file_limits

    with pytest.raises(Refused) as e:
        image_file_limits([("max_image_tokens", "1")], 8000)
    assert e.value.status == 400 and str(e.value).startswith(
        "min_image_tokens=16 (the server's default: give it) is above max_image_tokens=1: an image is resized")
    with pytest.raises(Refused) as e:
        image_file_limits([("min_image_tokens", "100"), ("max_image_tokens", "50")], 8000)
    assert str(e.value).startswith("min_image_tokens=100 is above max_image_tokens=50: ")
    with pytest.raises(Refused, match=r"^min_image_tokens=9000 is above max_image_tokens=8000 \(the server's default"):
        image_file_limits([("min_image_tokens", "9000")], 16000)  # a maximum of up to 16,000 may be given
    # Over the capacity, the maximum is not what to change: the capacity bounds both.
    with pytest.raises(Refused, match=r"^min_image_tokens = 9000 exceeds the server's capacity of 8000 tokens per "):
        image_file_limits([("min_image_tokens", "9000")], 8000)


def test_a_file_that_is_no_image_is_refused_as_one_whether_sent_alone_or_not(server, tmp_path):
    """A file starting as JSON does ({ or [) sent alone goes as the body, and the server's 415 told the caller
    to "send JSON as application/json"; beside a second image the same file was a 422 "cannot decode image".
    One file, one answer: the 422, naming it."""
    client, _ = server
    path = tmp_path / "package.json"
    path.write_text('{"name": "x"}\n')
    for images in ([path], [path, path]):
        with pytest.raises(ServerError) as e:
            client.encode(images)
        assert e.value.status == 422 and "cannot decode image" in e.value.error and e.value.source == str(path), \
            (images, e.value)
