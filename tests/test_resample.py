"""resample.py against the installed Pillow, bit for bit (CPU): the coefficient tables, the pass order
and the integer arithmetic the GPU kernels apply. Fresh random sizes and bytes every run."""

import os

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy.preprocessing import resample
from glmvit_cupy.preprocessing.image import content_size, smart_resize
from glmvit_cupy.scheduling import feed
from tests.conftest import module_rng

rng = module_rng(__name__)  # fresh inputs every run, seeded per test (conftest)
PHOTO = os.path.join(os.path.dirname(__file__), "..", "examples", "grace_hopper.jpg")


def pillow(img, out_h, out_w):
    return np.asarray(Image.fromarray(img).resize((out_w, out_h), resample=Image.Resampling.BICUBIC))


def random_pairs(n):
    """Size pairs up and down, 1-pixel sides, extreme aspect ratios and strong shrinks."""
    pairs = []
    for i in range(n):
        h, w, oh, ow = (int(v) for v in rng.integers(1, 160, 4))
        kind = i % 6
        if kind == 1:
            h, oh = 1, int(rng.integers(1, 40))
        elif kind == 2:
            w, ow = int(rng.integers(1, 3)), int(rng.integers(1, 200))
        elif kind == 3:  # strong shrink: wide filters (many taps)
            h, w = int(rng.integers(200, 700)), int(rng.integers(200, 700))
            oh, ow = max(1, h // int(rng.integers(5, 60))), max(1, w // int(rng.integers(5, 60)))
        elif kind == 4:  # extreme aspect
            h, w, oh, ow = int(rng.integers(300, 900)), int(rng.integers(1, 6)), int(rng.integers(20, 90)), 1
        pairs.append((h, w, oh, ow))
    return pairs


def image(h, w):
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img[::2] = np.where(img[::2] > 127, 255, 0)  # hard edges: overshoot past 0 and 255, so the clip fires
    return img


def test_the_installed_pillow_follows_a_known_pass_order():
    assert resample.pass_order() in resample.ORDERS


def test_random_size_pairs_equal_pillow():
    pairs = random_pairs(360)
    clipped = 0
    for h, w, oh, ow in pairs:
        img = image(h, w)
        want = pillow(img, oh, ow)
        got = resample.resize(img, oh, ow)
        assert got.shape == want.shape and np.array_equal(got, want), (h, w, oh, ow)
        clipped += int(((want == 0) | (want == 255)).sum())
    assert clipped > 0


def test_both_pass_orders_happen_and_matter():
    """On the probes the rules disagree about, the two orders give different bytes, and only the
    installed Pillow's rule gives Pillow's."""
    names = list(resample.ORDERS)
    mine = names.index(resample.pass_order())
    differ = 0
    for h, w, oh, ow in resample._PROBES:
        img = image(h, w)
        outs = [resample.resize(img, oh, ow, r) for r in resample.ORDERS.values()]
        assert np.array_equal(outs[mine], pillow(img, oh, ow))
        differ += any(not np.array_equal(outs[mine], o) for o in outs)
    assert differ >= 3


def test_tables_are_normalised_fixed_point():
    """Fixed-point weights: each row sums to 2^22 within its rounding, zero past its count."""
    ax = resample.axis(1000, 77)
    sums = ax.weights.sum(axis=1)
    assert np.all(np.abs(sums - (1 << 22)) <= ax.taps)
    assert np.all(ax.weights[np.arange(ax.taps)[None, :] >= ax.count[:, None]] == 0)
    with pytest.raises(ValueError, match="at least 1"):
        resample.axis(0, 3)


def test_tables_made_in_row_chunks_equal_pillow(monkeypatch):
    """The weights are made CHUNK at a time: chunks that split a side's positions anywhere (7 weights: a row or
    less at a time; 400: several rows) give the bits of one chunk, and Pillow's, a shrink of 200,000 columns to
    28 (142,859 taps) and its transpose included."""
    pairs = random_pairs(24) + [(1, 200_000, 1, 28), (200_000, 1, 28, 1), (3, 5_000, 2, 7)]
    images = [image(h, w) for h, w, _, _ in pairs]
    whole = [resample.pillow_tables(h, w, oh, ow) for h, w, oh, ow in pairs]
    for chunk in (7, 400):
        monkeypatch.setattr(resample, "CHUNK", chunk)
        resample.pillow_tables.cache_clear()
        for (h, w, oh, ow), img, one in zip(pairs, images, whole):
            made = resample.pillow_tables(h, w, oh, ow)
            for a, b in ((made.horizontal, one.horizontal), (made.vertical, one.vertical)):
                assert (a is None) == (b is None)
                assert a is None or all(np.array_equal(x, y) for x, y in ((a.first, b.first), (a.count, b.count),
                                                                          (a.weights, b.weights)))
            assert np.array_equal(resample.resize(img, oh, ow), pillow(img, oh, ow)), (h, w, oh, ow, chunk)
        aten = resample.aten_axis(5_000, 7)
        monkeypatch.setattr(resample, "CHUNK", 1 << 20)
        assert np.array_equal(aten.weights, resample.aten_axis(5_000, 7).weights)


def test_tables_past_the_cache_bytes_are_made_again_not_kept(monkeypatch):
    """The tables of recent sizes are kept (photos repeat them), but at most CACHE_BYTES of them: those of an
    image far from square (hundreds of MB) were kept for good, 256 sizes of them."""
    resample.pillow_tables.cache_clear()
    small = resample.pillow_tables(40, 50, 20, 30)
    assert resample.pillow_tables(40, 50, 20, 30) is small
    monkeypatch.setattr(resample, "CACHE_BYTES", 20_000)
    big = resample.pillow_tables(1, 9_000, 1, 28)  # 28 x 1,287 int32 weights: past 20,000 bytes
    assert resample.pillow_tables(1, 9_000, 1, 28) is not big
    assert resample.pillow_tables(40, 50, 20, 30) is small
    for k in range(40):  # more small ones than the bytes hold: the oldest go
        resample.pillow_tables(40 + k, 50, 20, 30)
    assert resample.pillow_tables(40, 50, 20, 30) is not small


def test_the_sides_pillow_refuses_to_resize_are_refused_alike():
    """Pillow refuses (MemoryError) a side whose double weights would pass INT_MAX bytes: a 68,000,000 x 1 image to
    28 columns; pillow_refuses says so, and not for 66,000,000 (which Pillow resizes, with 2 GB of tables)."""
    assert resample.pillow_refuses(68_000_000, 28) and not resample.pillow_refuses(66_000_000, 28)
    assert not resample.pillow_refuses(68_000_000, 68_000_000) and not resample.pillow_refuses(28, 1_000_000)
    with pytest.raises(MemoryError):
        Image.new("L", (68_000_000, 1)).resize((28, 1), resample=Image.Resampling.BICUBIC)


@pytest.mark.parametrize("max_tokens", [64, 1024, 8000])
def test_a_photo_to_its_canvas_equals_pillow(max_tokens):
    rgb = np.asarray(Image.open(PHOTO).convert("RGB"))
    h, w = rgb.shape[:2]
    canvas = smart_resize(h, w, max_image_tokens=max_tokens)
    ch, cw = content_size(h, w, canvas)
    assert np.array_equal(resample.resize(rgb, ch, cw), pillow(rgb, ch, cw))


def test_feed_keeps_order_and_raises_in_turn():
    def fn(i, x):
        if x == "bad":
            raise ValueError(f"item {i}")
        return i * 10

    items = [0, 1, "bad", 3]
    for workers in (1, 3):
        gen = feed.in_order(fn, items, workers, ahead=2)
        assert [next(gen), next(gen)] == [0, 10]
        with pytest.raises(ValueError, match="item 2"):
            next(gen)
    assert list(feed.in_order(fn, range(20), 4)) == [i * 10 for i in range(20)]


def test_feed_as_done_lets_later_items_pass_a_slow_one():
    """as_done yields calls as they finish: three later items come out while item 0 still runs (in_order
    would wait for it), every item once; an error is raised when its call is yielded (and ends the
    stream); one worker keeps input order; closing early stops the pool."""
    import threading

    release = threading.Event()

    def fn(i, x):
        if i == 0:
            assert release.wait(20), "item 0 was never released"
        if x == "bad":
            raise ValueError(f"item {i}")
        return x

    gen = feed.as_done(fn, list("abcdef"), 3, ahead=4)
    first = [next(gen) for _ in range(3)]
    release.set()
    rest = list(gen)
    assert "a" not in first and sorted(first + rest) == list("abcdef")
    gen = feed.as_done(fn, ["x", "bad", "y"], 2)
    release.set()
    got, errors = [], []
    while True:
        try:
            got.append(next(gen))
        except ValueError as e:
            errors.append(str(e))
        except StopIteration:
            break
    assert set(got) <= {"x", "y"} and errors == ["item 1"]  # a generator that raised has ended
    assert list(feed.as_done(lambda i, x: x, "abc", 1)) == list("abc")
    gen = feed.as_done(lambda i, x: x, list(range(100)), 4)
    next(gen)
    gen.close()


def test_feed_starts_no_more_threads_than_items(monkeypatch):
    """One image, one thread: no pool at all (a pool of 16 threads for a single image cost ~1 ms a call)."""
    import concurrent.futures

    pools = []
    real = concurrent.futures.ThreadPoolExecutor

    def counting(n, **kw):
        pools.append(n)
        return real(n, **kw)

    monkeypatch.setattr(feed, "ThreadPoolExecutor", counting)
    assert list(feed.in_order(lambda i, x: x, ["a"], 16)) == ["a"] and pools == []
    assert list(feed.in_order(lambda i, x: x, "abc", 16)) == list("abc") and pools == [3]
    assert list(feed.in_order(lambda i, x: x, iter("abcd"), 2)) == list("abcd") and pools == [3, 2]


def test_table_bytes_are_the_tables_bytes():
    """table_bytes (what glmvit-serve counts in flight for an image's resize, before decoding it) is what the
    tables hold, for shrinks, stretches and sides that keep their size."""
    pairs = [(h, oh) for h, _, oh, _ in random_pairs(30)] + [(w, ow) for _, w, _, ow in random_pairs(30)]
    for in_size, out_size in pairs + [(200_000, 28), (28, 5_000)]:
        ax = resample.axis(in_size, out_size)
        want = 0 if in_size == out_size else ax.first.nbytes + ax.count.nbytes + ax.weights.nbytes
        assert ax.nbytes == ax.first.nbytes + ax.count.nbytes + ax.weights.nbytes
        assert resample.table_bytes(in_size, out_size) == want, (in_size, out_size)
