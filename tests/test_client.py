"""glmvit_cupy.client without a server: a refusal naming an image names what the caller gave for it."""

import io
import json
import urllib.error

import numpy as np
import pytest

from glmvit_cupy import ServerError
from glmvit_cupy.client import Client


def refuse(index, error):
    def urlopen(req, timeout=None):
        body = json.dumps({"error": error, "index": index}).encode()
        raise urllib.error.HTTPError(req.full_url, 422, "Unprocessable", {}, io.BytesIO(body))

    return urlopen


def test_an_error_names_the_path_the_caller_gave(tmp_path, monkeypatch):
    good, bad = tmp_path / "cat.png", tmp_path / "dog.png"
    good.write_bytes(b"x")
    bad.write_bytes(b"y")
    monkeypatch.setattr("urllib.request.urlopen", refuse(1, "image 1: cannot decode image"))
    with pytest.raises(ServerError) as e:
        Client().encode([str(good), bad])
    assert e.value.index == 1 and e.value.source == str(bad) and e.value.status == 422
    assert str(e.value) == f"HTTP 422: image 1: cannot decode image [{bad}]"


def test_bytes_arrays_and_frames_are_named_by_kind(monkeypatch, rng):
    monkeypatch.setattr("urllib.request.urlopen", refuse(0, "image 0: too large"))
    with pytest.raises(ServerError, match=r"\[4 bytes\]"):
        Client().encode([b"abcd"])
    with pytest.raises(ServerError, match=r"\[array \(5, 6, 3\)\]"):
        Client().encode([rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)])
    monkeypatch.setattr("urllib.request.urlopen", refuse(None, "the queue is full"))
    with pytest.raises(ServerError) as e:
        Client().encode([b"abcd"])
    assert e.value.source is None and str(e.value) == "HTTP 422: the queue is full"
