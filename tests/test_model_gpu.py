"""GlmVit on the GPU against HF's float32 output (golden tower) and the NumPy float32 reference
(official geometry, random weights with the clamp firing). The bar is HF transformers' own bf16
error on the same inputs."""

import math
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from tests.conftest import gpu_or_skip

pytestmark = pytest.mark.gpu
cupy = gpu_or_skip()

from tests import hf_bar  # noqa: E402
from tests.golden import cases  # noqa: E402

from glmvit_cupy import GlmVit, GpuOutOfMemory, Replicas, reference  # noqa: E402
from glmvit_cupy.checkpoint.bind import bind_tower  # noqa: E402
from glmvit_cupy.checkpoint.synthetic import write_checkpoint  # noqa: E402
from glmvit_cupy.config import VisionGeometry  # noqa: E402
from glmvit_cupy.engine.attention import FIXED_OFFSET_LIMIT  # noqa: E402

G = np.load(cases.OUTPUTS)
GOLDEN = sorted({k.split("/")[0] for k in G.files})


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def f32(x):
    return cupy.asnumpy(x).astype(np.float32)


@pytest.fixture(scope="module")
def small():
    return GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=600)


def test_a_device_that_is_not_here_is_refused_by_name():
    count = cupy.cuda.runtime.getDeviceCount()
    binding = bind_tower(cases.TOWER_DIR)
    for bad in (count, -1, True, "0", 0.0):
        with pytest.raises(ValueError, match=rf"device={bad!r} is not a CUDA device of this machine \(it has {count}"):
            GlmVit(binding, device=bad, capacity_tokens=64)
    assert GlmVit(binding, device=np.int64(0), capacity_tokens=64).device.id == 0


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_vs_hf_fp32(small, name):
    pv, grid, want = G[f"{name}/pixel_values"], G[f"{name}/grid_thw"], G[f"{name}/hf_fp32"]
    out = small.encode_pixels(pv, grid)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == want.shape
    ours = rel(f32(out), want)
    bar = rel(G[f"{name}/hf_bf16"], want)  # HF bf16 (CPU, in the golden file)
    why = hf_bar.available()
    if why is None:
        bar = rel(hf_bar.hf_forward(small_binding(), pv, grid), want)  # HF bf16 on this GPU
    print(f"{name}: ours {ours:.3e}  HF bf16 {bar:.3e}")
    assert ours <= bar


def small_binding():
    return bind_tower(cases.TOWER_DIR)


def test_scratch_is_lazy():
    m = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=64)
    assert m.runner._arena is None
    m.encode_pixels(G["img_64x64/pixel_values"], G["img_64x64/grid_thw"])
    assert m.runner._arena is not None and m.runner.arena() is m.runner._arena


def test_bad_input_leaves_model_usable(small):
    pv, grid = G["img_100x150/pixel_values"], G["img_100x150/grid_thw"]
    good = f32(small.encode_pixels(pv, grid))
    with pytest.raises(ValueError, match="1176 values"):
        small.encode_pixels(pv[:, :1000], grid)
    with pytest.raises(ValueError, match="even"):
        small.encode_pixels(pv, [[1, 3, 4]])
    with pytest.raises(ValueError, match="rows but grid_thw describes"):
        small.encode_pixels(pv[:-4], grid)
    with pytest.raises(ValueError, match="capacity"):
        small.encode_pixels(np.zeros((4 * 601 * 4, 1176), np.float32), [[1, 4 * 2, 601 * 2]])
    assert np.array_equal(f32(small.encode_pixels(pv, grid)), good)


def test_cupy_and_numpy_inputs_agree(small):
    pv, grid = G["img_140x90/pixel_values"], G["img_140x90/grid_thw"]
    a = f32(small.encode_pixels(pv, grid))
    assert np.array_equal(f32(small.encode_pixels(cupy.asarray(pv), cupy.asarray(grid))), a)


def test_threads_match_sequential(small):
    names = GOLDEN * 3
    inputs = {n: (G[f"{n}/pixel_values"], G[f"{n}/grid_thw"]) for n in GOLDEN}  # NpzFile is not thread-safe
    seq = {n: f32(small.encode_pixels(*inputs[n])) for n in GOLDEN}
    got, errors = {}, []

    def work(i, n):
        try:
            got[i] = f32(small.encode_pixels(*inputs[n]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i, n)) for i, n in enumerate(names)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors
    assert all(np.array_equal(got[i], seq[n]) for i, n in enumerate(names))


def test_out_of_memory_is_reported_and_recovered():
    pool = cupy.get_default_memory_pool()
    m = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=600)
    pv, grid = G["img_64x64/pixel_values"], G["img_64x64/grid_thw"]
    old = pool.get_limit()
    pool.set_limit(size=pool.used_bytes() + 1024)
    try:
        with pytest.raises(GpuOutOfMemory, match="out of memory"):
            m.encode_pixels(pv, grid)
    finally:
        pool.set_limit(size=old)
    assert rel(f32(m.encode_pixels(pv, grid)), G["img_64x64/hf_fp32"]) < 0.05


def test_encode_images_equals_pixels(small):
    imgs = cases.tower_cases()["batch_abc"]
    outs = small.encode(imgs)
    assert [o.shape[0] for o in outs] == [g[1] * g[2] // 4 for g in G["batch_abc/grid_thw"]]
    whole = f32(small.encode_pixels(G["batch_abc/pixel_values"], G["batch_abc/grid_thw"]))
    assert np.array_equal(np.concatenate([f32(o) for o in outs]), whole)


def test_encode_resizes_on_the_gpu_as_preprocess_does(small, tmp_path, rng):
    """encode(images) (GPU resize, the default; and host resize) equals encode_pixels(*preprocess(images))
    bit for bit: a photo, a PNG with alpha, a 1-pixel-high strip, a tall strip, an array, a PIL image."""
    from PIL import Image

    from glmvit_cupy.preprocessing.image import preprocess

    png = tmp_path / "alpha.png"
    Image.fromarray(rng.integers(0, 256, (90, 130, 4), dtype=np.uint8), "RGBA").save(png)
    exact = tmp_path / "canvas.png"  # 112 x 140: its own canvas at >= 20 tokens (no resize, no pad)
    Image.fromarray(rng.integers(0, 256, (112, 140, 3), dtype=np.uint8)).save(exact)
    photo = os.path.join(os.path.dirname(__file__), "..", "examples", "grace_hopper.jpg")
    images = [photo, str(png), rng.integers(0, 256, (1, 300, 3), dtype=np.uint8), str(exact),
              rng.integers(0, 256, (700, 9, 3), dtype=np.uint8), Image.open(photo).rotate(30, expand=True)]
    for tokens in (20, 64, 300):
        whole = np.concatenate([small.encode_pixels(*preprocess(im, max_image_tokens=tokens)).get()
                                for im in images])  # one by one: the capacity is 600 tokens
        for resize in ("gpu", "host"):
            outs = small.encode(images, max_image_tokens=tokens, resize=resize, workers=3)
            assert np.array_equal(np.concatenate([o.get() for o in outs]).view(np.uint16), whole.view(np.uint16))


SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""


def test_embeddings_download_through_a_page_locked_block_exactly(rng):
    """PinnedPool.download (how glmvit-encode, the server and Ray bring embeddings back): arrays of several
    sizes, including slices of one output, equal their own get() bit for bit, though written late on another
    stream that the current stream was made to wait for; the block (poisoned first) is not shared."""
    from glmvit_cupy.engine.pools import PinnedPool

    pool = PinnedPool()
    poison = pool.take(64 << 20)
    np.frombuffer(poison.mem, np.uint8, poison.size)[:] = 0xFF
    pool.give(poison)
    side = cupy.cuda.Stream(non_blocking=True)
    whole = cupy.asarray(rng.standard_normal((3001, 4096), dtype=np.float32).astype(ml_dtypes.bfloat16))
    scaled = cupy.empty_like(whole)
    cupy.cuda.get_current_stream().synchronize()
    with side:
        cupy.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(200_000_000),))  # ~0.1 s on that stream, then
        cupy.cuda.runtime.memcpyAsync(scaled.data.ptr, whole.data.ptr, whole.nbytes,  # `scaled` written
                                      cupy.cuda.runtime.memcpyDeviceToDevice, side.ptr)
    cupy.cuda.get_current_stream().wait_event(side.record())
    arrays = [scaled[:1], scaled[1:38], scaled[38:], cupy.asarray(rng.standard_normal(5, dtype=np.float32))]
    got = pool.download(arrays)
    side.synchronize()
    for g, a in zip(got, arrays):
        want = a.get()
        assert g.dtype == want.dtype and g.shape == want.shape
        assert np.array_equal(g.view(np.uint8), want.view(np.uint8))
        assert not np.shares_memory(g, np.frombuffer(poison.mem, np.uint8, poison.size))
    assert pool.take(10) is poison  # back in the pool and idle
    pool.give(poison)
    np.frombuffer(poison.mem, np.uint8, poison.size)[:] = 0xFF
    with pool.downloaded(arrays) as views:  # glmvit-encode's writer: views of the block, no copy
        for v, a in zip(views, arrays):
            assert np.array_equal(v.view(np.uint8), a.get().view(np.uint8))
            assert np.shares_memory(v, np.frombuffer(poison.mem, np.uint8, poison.size))
    assert pool.take(10) is poison


def test_lent_page_locked_blocks_come_back_only_when_idle():
    """A decoded image's page-locked block goes back when its array is garbage, and is taken again only once
    the upload that last read it has run; only [H, W, :3] views of lent [H, W, 4] arrays count as lent."""
    import gc

    from glmvit_cupy.engine.pools import PinnedPool

    pool = PinnedPool()
    a = pool.array((300, 500, 4))
    view = a[..., :3]
    block = pool.lent(view)
    assert block is not None and block.size >= a.nbytes
    assert pool.lent(a) is None and pool.lent(np.empty((300, 500, 3), np.uint8)) is None
    assert pool.lent(view[1:]) is None  # not the block's start
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(2_000_000_000),), stream=stream)  # ~1 s
    block.event = stream.record()  # as if an upload were still reading it
    del a, view
    gc.collect()
    assert not block.idle and pool.take(block.size) is not block
    stream.synchronize()
    assert pool.take(block.size) is block


def test_images_uploaded_by_their_decoding_threads_come_back_only_when_idle(small, tmp_path, rng):
    """The prepare threads' device uploads: every image (JPEG decoded into the thread's buffer, PNG pasted
    there, a caller's array) arrives exactly; the thread's buffer is reused at once (the next image
    overwrites it); a block comes back when its image is garbage and is taken again only once the stream
    that read it has run past it."""
    import gc

    from PIL import Image

    from glmvit_cupy.engine.uploads import Uploaded, Uploader
    from glmvit_cupy.preprocessing.decode import load, rgb_pixels

    up = Uploader(cupy.cuda.Device())
    want, got = [], []
    for i, (h, w) in enumerate([(333, 500), (120, 900), (64, 64), (700, 9)]):
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        path = tmp_path / f"u{i}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(a).save(path)
        decoded = rgb_pixels(load(str(path), str(path), None, up.buffer), up.buffer)
        want.append(np.array(decoded))
        got.append(up(decoded))
        decoded[...] = 7  # the buffer is this thread's again: the upload must already have its bytes
    got.append(up(a))  # an array of the caller's: three bytes a pixel
    want.append(a)
    for g, w_ in zip(got, want):
        assert isinstance(g, Uploaded) and g.shape == w_.shape
        g.event.synchronize()
        assert np.array_equal(g.array[..., :3].get(), w_)
    assert got[0].array.shape[2] == 4 and got[-1].array.shape[2] == 3
    block = got[0].block
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(2_000_000_000),), stream=stream)  # ~1 s
    block.event = stream.record()  # as the stager does: reused once its reads have run
    del got[0]
    gc.collect()
    assert up.pool.take(block.size) is not block
    stream.synchronize()
    assert up.pool.take(block.size) is block


def test_prepared_images_encode_alike_twice(small, tmp_path, rng):
    """Prepared items that a caller keeps (their pixels in lent page-locked blocks) encode to the same bits
    again, as encode(images) does, and as the same pixels in ordinary memory do."""
    from PIL import Image

    from glmvit_cupy.engine.pools import HOST
    from glmvit_cupy.scheduling import batching, feed

    paths = []
    for i, (h, w) in enumerate([(333, 500), (120, 900), (64, 64)]):
        paths.append(str(tmp_path / f"{i}.jpg"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1], quality=90)
    pinned = batching.preparer(small.geometry, small.capacity_tokens, max_image_tokens=300, resize="gpu")
    prepared = list(feed.in_order(lambda i, im: pinned(i, im, host_buffer=HOST.array), paths, 2))
    assert all(HOST.lent(im) is not None for im, _, _ in prepared)
    runs = [[o.get().view(np.uint16) for o in small.encode_prepared(prepared)] for _ in range(2)]
    runs.append([o.get().view(np.uint16) for o in small.encode(paths, max_image_tokens=300)])
    plain = list(batching.prepare_images(small.geometry, small.capacity_tokens, paths, max_image_tokens=300,
                                         resize="gpu", workers=2))  # [H, W, :3] views of ordinary memory
    assert all(HOST.lent(im) is None and im.strides[1] == 4 for im, _, _ in plain)
    runs.append([o.get().view(np.uint16) for o in small.encode_prepared(plain)])
    one = small.runner.uploads.uploading(batching.preparer(small.geometry, small.capacity_tokens,
                                                           max_image_tokens=300, resize="gpu"))
    uploaded = list(feed.in_order(one, paths, 1))  # one thread: one buffer, reused
    runs += [[o.get().view(np.uint16) for o in small.encode_prepared(uploaded)] for _ in range(2)]
    for r in runs[1:]:
        assert all(np.array_equal(x, y) for x, y in zip(runs[0], r))


# -- the official geometry, random weights -------------------------------------------------------

@pytest.fixture(scope="module")
def official(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("official"), VisionGeometry.official(), seed=11)
    binding = bind_tower(path)
    return binding, GlmVit(binding, capacity_tokens=8000), reference.Tower(binding)


def official_images():
    return {"448x448": cases._smooth(448, 448, seed=40), "896x672": cases._smooth(896, 672, seed=41),
            "300x500": cases._smooth(300, 500, seed=42)}


def test_batching_never_changes_an_embedding(official):
    """An image's embedding has the same bits alone, in a batch, or beside any other image: small
    images (88 and 132 tokens) are where cuBLAS would split K across blocks if the handle allowed it."""
    _, model, _ = official
    assert model.runner.blas.batch_invariant
    imgs = [cases._smooth(448, 448, 40), cases._smooth(300, 500, 42), cases._smooth(200, 300, 43),
            cases._smooth(896, 672, 41), cases._smooth(100, 900, 45), cases._smooth(1400, 1000, 46)]
    together = [f32(o) for o in model.encode(imgs)]
    for i, img in enumerate(imgs):
        alone = f32(model.encode([img])[0])
        pair = f32(model.encode([imgs[(i + 1) % len(imgs)], img])[1])
        assert np.array_equal(alone, together[i]) and np.array_equal(alone, pair), (i, alone.shape)


def test_tuned_gemms_change_no_bit_of_any_embedding(official, monkeypatch):
    """The load tunes cublasLt's algorithms for the forward's GEMM shapes (gemm_tune.py) and keeps only
    those with cuBLAS's default bits: a model built with tune_gemms=False (the default pick everywhere)
    gives the same bits, at budgets on and between the tuned row counts (256 / 1,024 / 4,096 / 16,384); so does
    one that keeps a cublasLt algorithm for every shape and row count, even a slower one (MIN_GAIN -inf)."""
    from glmvit_cupy.engine import gemm_tune

    binding, model, _ = official
    shapes = {r["gemm"] for r in model.gemm_tuning}
    assert {"attn.qkv", "attn.proj", "mlp.down_proj", "merger.downsample", "merger.down_proj"} <= shapes
    assert all(r["same_bits"] > 0 for r in model.gemm_tuning), model.gemm_tuning
    print("kept:", [(r["gemm"], r["rows"], r["chosen"], round(r["gemm_ex_us"], 1), round(r["best_us"], 1))
                    for r in model.gemm_tuning])
    plain = GlmVit(binding, capacity_tokens=8000, tune_gemms=False)
    assert plain.gemm_tuning == [] and not plain.runner.blas.algos
    monkeypatch.setattr(gemm_tune, "MIN_GAIN", -math.inf)
    forced = GlmVit(binding, capacity_tokens=8000)
    assert all(r["chosen"] is not None for r in forced.gemm_tuning), forced.gemm_tuning
    imgs = [cases._smooth(448, 448, 40), cases._smooth(1400, 1000, 46), cases._smooth(896, 672, 41)]
    want = [f32(o) for o in plain.encode(imgs) + plain.encode(imgs[1:])]
    for m in (model, forced):
        assert all(np.array_equal(f32(g), w) for g, w in zip(m.encode(imgs) + m.encode(imgs[1:]), want))
        print("GEMM shapes on cublasLt / looked up:", m.runner.blas.lt_usage())
    assert forced.runner.blas.lt_usage()[0] > 0  # the forwards above did run cublasLt


def test_forward_runs_exactly_the_tuned_gemm_shapes(official, monkeypatch):
    """layers.gemm_shapes restates the forward's cuBLAS GEMMs for the load's tuning: every GEMM an eager
    forward runs (the patch embed aside) must be one of its shapes within its most rows a call, and every
    shape it lists must run, with the fused gate/up and without it. A shape the list missed would run on
    cuBLAS's untuned default pick; a stale one would cost load time."""
    from glmvit_cupy.engine import gemm as gemm_module, layers

    binding, model, _ = official
    g = model.geometry
    plain = GlmVit(binding, capacity_tokens=600, fused_swiglu=False, tune_gemms=False, graphs=False)
    real = gemm_module.gemm
    for m in (model, plain):
        calls = []

        def record(a, w, out, beta=0.0, handle=None, calls=calls):
            calls.append((w.shape[0], w.shape[1], np.dtype(out.dtype), beta == 1.0, a.shape[0]))
            return real(a, w, out, beta, handle=handle)

        monkeypatch.setattr(gemm_module, "gemm", record)
        monkeypatch.setattr(m.runner, "graphs", False)
        imgs = [cases._smooth(448, 448, 40), cases._smooth(1400, 1000, 46)] if m is model else \
            [cases._smooth(448, 448, 40), cases._smooth(700, 500, 46)]
        m.encode(imgs)
        m.encode(imgs[:1])
        monkeypatch.setattr(gemm_module, "gemm", real)
        listed = {}
        for _, n, k, dtype, acc, rows in layers.gemm_shapes(g, m.capacity_tokens * 4, m.fused_swiglu):
            key = (n, k, np.dtype(dtype), acc)
            listed[key] = max(listed.get(key, 0), rows)
        embed = (g.hidden_size, g.patch_dim, np.dtype(np.float32), False)
        ran = {}
        for n, k, dtype, acc, rows in calls:
            ran[(n, k, dtype, acc)] = max(ran.get((n, k, dtype, acc), 0), rows)
        ran.pop(embed)
        assert set(ran) == set(listed), (m.fused_swiglu, sorted(map(str, ran)), sorted(map(str, listed)))
        assert all(ran[key] <= listed[key] for key in ran), (m.fused_swiglu, ran, listed)


def test_tuning_out_of_memory_leaves_a_working_model(official, monkeypatch, caplog):
    """A GPU too full for the tuning's inputs (here: a real allocation CuPy cannot make, at 4,096 rows
    and up) does not fail the load: those row counts stay on cublasGemmEx, the 1,024-row tuning is
    kept, the failures are logged, and the embeddings keep their bits."""
    import cupy

    from glmvit_cupy.engine import gemm_tune

    binding, model, _ = official
    tune_one = gemm_tune._tune_one

    def full_gpu(handle, rng, m, *args):
        if m >= 4096:
            cupy.empty(1 << 50, np.uint8)  # 1 PiB: OutOfMemoryError from the pool, as on a full GPU
        return tune_one(handle, rng, m, *args)

    monkeypatch.setattr(gemm_tune, "_tune_one", full_gpu)
    monkeypatch.setattr(gemm_tune, "MIN_GAIN", -math.inf)  # keep whatever the 1,024-row tuning finds
    with caplog.at_level("WARNING", logger="glmvit_cupy"):
        tight = GlmVit(binding, capacity_tokens=8000)
    failed = [r for r in tight.gemm_tuning if r["rows"] >= 4096]
    assert failed and all(r["chosen"] is None and r["same_bits"] == 0 for r in failed)
    assert all(r["chosen"] is not None for r in tight.gemm_tuning if r["rows"] < 4096), tight.gemm_tuning
    assert "out of memory" in caplog.text.lower(), caplog.text
    imgs = [cases._smooth(448, 448, 40), cases._smooth(1400, 1000, 46)]
    want = [f32(o) for o in model.encode(imgs)]
    assert all(np.array_equal(f32(g), w) for g, w in zip(tight.encode(imgs), want))


def test_official_geometry_vs_reference(official):
    from glmvit_cupy import preprocess

    binding, model, tower = official
    imgs = official_images()
    refs = {}
    for name, img in imgs.items():
        pv, grid = preprocess([img])
        stats = {}
        ref = reference.encode_pixels(tower, pv, grid, stats=stats)
        assert all(s["gate_above"] > 0 and s["up_outside"] > 0 for s in stats.values()), stats
        refs[name] = ref
        ours = rel(f32(model.encode_pixels(pv, grid)), ref)
        why = hf_bar.available()
        bar = rel(hf_bar.hf_forward(binding, pv, grid), ref) if why is None else 2e-2
        print(f"official {name}: {grid.tolist()} ours {ours:.3e}  HF bf16 {bar:.3e} ({why or 'measured'})")
        assert ours <= bar
    # three images of different sizes in one call equal the three encoded one by one
    together = model.encode(list(imgs.values()))
    alone = [model.encode([img])[0] for img in imgs.values()]
    for t, a, name in zip(together, alone, imgs):
        assert np.array_equal(f32(t), f32(a)), name
        assert rel(f32(t), refs[name]) <= 2e-2


def test_graph_replay_equals_eager_and_reads_fresh_inputs(official):
    """A budget's first call captures its CUDA graph, later calls replay it: every replay must read that
    call's pixels (not the captured call's) and write every output row (poisoned first)."""
    binding, model, _ = official
    eager = GlmVit(binding, capacity_tokens=2048, graphs=False)
    grid = [[1, 32, 32], [1, 16, 24]]  # 1024 + 384 = 1408 patches, two segments: the 1536-patch budget
    rng = np.random.default_rng(5)
    for _ in range(3):
        pv = rng.standard_normal((1408, 1176), dtype=np.float32)
        want = f32(eager.encode_pixels(pv, grid))
        model.runner.arena()["embeddings"].view(cupy.uint16).fill(0x7FC0)  # bf16 NaN
        got = f32(model.encode_pixels(pv, grid))
        assert np.isfinite(got).all() and np.array_equal(got, want)
    plan = model.runner.plans.find(np.array(grid))
    assert plan.patches == 1536 and plan.graph is not None and plan.uses == 3 and not plan.capture_failed
    assert set(model.last_timing) == {"forward", "copy_out"}
    assert set(eager.last_timing) == {"patch_embed", "blocks", "merger", "copy_out"}


def test_replicas_match_one_gpu(official):
    """Two replicas (two GPUs when the machine has them, else twice GPU 0) give bit-identical outputs."""
    from glmvit_cupy import preprocess

    binding, model, _ = official
    devices = [0, 1] if cupy.cuda.runtime.getDeviceCount() >= 2 else [0, 0]
    reps = Replicas.from_checkpoint(binding.path, devices, capacity_tokens=2048)
    assert isinstance(reps, Replicas) and [m.device.id for m in reps.models] == devices
    imgs = list(official_images().values()) + [cases._smooth(200, 300, seed=43)]
    want = [f32(o) for o in model.encode(imgs)]
    got = reps.encode(imgs)
    assert {o.device.id for o in got} == set(devices)
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(f32(g), w), i
    pv, grid = preprocess(imgs)
    for source in (pv, cupy.asarray(pv)):
        whole = reps.encode_pixels(source, grid)
        assert whole.device.id == devices[0]
        assert np.array_equal(f32(whole), np.concatenate(want))
    rows = np.concatenate([[0], np.cumsum(np.prod(grid, 1))])
    batches = [(pv[rows[i]:rows[i + 1]], grid[i:i + 1]) for i in range(len(imgs))]
    for i, out in enumerate(reps.encode_batches(batches)):  # batch j on replica j % 2, as one GPU encodes it
        assert out.device.id == devices[i % 2] and np.array_equal(f32(out), f32(model.encode_pixels(*batches[i]))), i
    from glmvit_cupy import preprocess_video

    rng = np.random.default_rng(8)
    vids = [rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8) for t, h, w in ((5, 90, 140), (3, 200, 60), (8, 64, 64))]
    vpv, vgrid, _ = preprocess_video(vids, sample=False)
    want_v = [f32(o) for o in model.encode_video_pixels(vpv, vgrid)]
    for got_v in (reps.encode_video(vids, sample=False), reps.encode_video_pixels(vpv, vgrid)):  # GPU resize, rows
        assert {o.device.id for o in got_v} == set(devices)
        for i, (g, w) in enumerate(zip(got_v, want_v)):
            assert np.array_equal(f32(g), w), f"video {i}"
    print(f"replicas on devices {devices}: {len(imgs)} images and {len(vids)} videos bit-equal to one GPU")
    with pytest.raises(ValueError, match="not a CUDA device of this machine"):
        Replicas.from_checkpoint(binding.path, [0, 99])
    with pytest.raises(TypeError, match="Replicas.from_checkpoint"):
        GlmVit.from_checkpoint(binding.path, devices=[0])


def test_load_vision_tower_for_serving(tmp_path, caplog):
    import json
    import logging

    from glmvit_cupy import load_vision_tower

    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "glm5_next", "hidden_size": 256}))
    absent = write_checkpoint(tmp_path / "absent", cases.GEOMETRY, tensors={})  # a tower declared, none held
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        assert load_vision_tower(text) is None and not caplog.records
        assert load_vision_tower(absent) is None and "text-only" in caplog.text
    m = load_vision_tower(cases.TOWER_DIR, capacity_tokens=64)
    assert isinstance(m, GlmVit)
    assert rel(f32(m.encode_pixels(G["img_64x64/pixel_values"], G["img_64x64/grid_thw"])),
               G["img_64x64/hf_fp32"]) < 0.02


def test_weight_store_uploads_one_tensor(small):
    store = small_binding().store
    name = "model.visual.blocks.0.attn.qkv.weight"
    dev = store.to_device(name)
    assert dev.dtype == ml_dtypes.bfloat16 and np.array_equal(cupy.asnumpy(dev).view(np.uint16),
                                                               store.get(name).view(np.uint16))


def test_bad_checkpoint_never_touches_a_loaded_model(small, tmp_path):
    from glmvit_cupy import CheckpointError

    pv, grid = G["img_64x64/pixel_values"], G["img_64x64/grid_thw"]
    before = f32(small.encode_pixels(pv, grid))
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError):
        GlmVit.from_checkpoint(tmp_path)
    assert np.array_equal(f32(small.encode_pixels(pv, grid)), before)


MEMORY_PROBE = r"""
import sys, numpy as np, cupy
free0, total = cupy.cuda.runtime.memGetInfo()
from glmvit_cupy import GlmVit
m = GlmVit.from_checkpoint(sys.argv[1], capacity_tokens=8000)
pv = np.random.default_rng(0).standard_normal((32000, 1176), dtype=np.float32)
out = m.encode_pixels(pv, [[1, 160, 200]])
cupy.cuda.Device().synchronize()
free1, _ = cupy.cuda.runtime.memGetInfo()
print(cupy.get_default_memory_pool().total_bytes(), free0 - free1, bool(cupy.isfinite(out.astype(cupy.float32)).all()))
"""


def test_32000_patch_forward_fits_in_2_gib(official):
    """The whole forward's GPU memory at the 8000-token maximum, weights included: the pool
    (weights 1.05 GiB + scratch + output) and all the device memory the process took (cuBLAS's
    workspace, the kernels, CUDA's own), both under 2 GiB."""
    import os
    import subprocess
    import sys

    binding = official[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, binding.path], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    pool, device, finite = r.stdout.split()
    print(f"32000 patches: CuPy pool {int(pool) / 2**30:.3f} GiB, device memory taken {int(device) / 2**30:.3f} GiB")
    assert finite == "True"
    assert int(pool) < 2.0 * 2**30 and int(device) < 2.0 * 2**30


# -- the engine's parts: plan cache, graph-capture fallback, inputs, attention variants, capacity ----------

def test_plan_cache_evicts_the_least_recently_used(official):
    """Two plans kept: the 256-patch budget (captured on its first call), 320, then 384 evicts 256, which
    comes back as a new plan and is captured again. Every output equals an eager model's."""
    binding, _, _ = official
    m, eager = GlmVit(binding, capacity_tokens=256), GlmVit(binding, capacity_tokens=256, graphs=False)
    m.runner.plans.size = 2
    rng = np.random.default_rng(7)
    for grid in ([[1, 16, 16]], [[1, 8, 16]], [[1, 16, 20]], [[1, 16, 24]], [[1, 16, 16]], [[1, 16, 16]]):
        pv = rng.standard_normal((int(np.prod(grid[0])), 1176), dtype=np.float32)
        assert np.array_equal(f32(m.encode_pixels(pv, grid)), f32(eager.encode_pixels(pv, grid)))
        assert len(m.runner.plans) <= 2
    assert [p.patches for p in m.runner.plans._plans.values()] == [384, 256]
    plan = m.runner.plans.find(np.array([[1, 16, 16]]))
    assert plan.uses == 2 and plan.graph is not None  # rebuilt after eviction, captured anew


def test_any_mix_of_shapes_replays_its_budgets_graph_bit_for_bit(official, rng):
    """Random mixes of image shapes, batched: each image's embedding equals its own eager encode (no graph,
    alone, in its own smaller budget) bit for bit, across budgets; the arena's pixel rows are poisoned
    (bf16 NaN) before every call, so a padded row that leaked into a real one would show. A mix whose
    (budget, variant, tiles) was captured before replays without capturing."""
    binding, model, _ = official
    eager = GlmVit(binding, capacity_tokens=8000, graphs=False)
    captures = []
    real = model.runner._capture
    model.runner._capture = lambda plan: (captures.append(plan.patches), real(plan))
    mixes = [[[1, 2 * int(rng.integers(1, 24)), 2 * int(rng.integers(1, 24))] for _ in range(int(rng.integers(1, 6)))]
             for _ in range(12)]
    mixes += [[[1, 16, 16], [1, 16, 16]], [[1, 8, 16], [1, 8, 16], [1, 16, 16]]]  # one key: 512 patches
    budgets = set()
    try:
        for grid in mixes:
            sizes = [t * h * w for t, h, w in grid]
            pv = rng.standard_normal((sum(sizes), 1176), dtype=np.float32)
            key = model.runner.plans.key(np.array(grid))
            seen = np.array(grid) in model.runner.plans
            n_captures = len(captures)
            model.runner.arena()["pixels"].view(cupy.uint16).fill(0x7FC0)
            got = f32(model.encode_pixels(pv, grid))
            assert len(captures) == n_captures + (0 if seen else 1)
            assert set(model.last_timing) == {"forward", "copy_out"}  # replayed, first call of this mix too
            budgets.add(key[0])
            row = 0
            for (t, h, w), n in zip(grid, sizes):
                alone = f32(eager.encode_pixels(pv[row:row + n], [[t, h, w]]))
                assert np.array_equal(got[row // 4:(row + n) // 4], alone), (grid, (t, h, w))
                row += n
    finally:
        model.runner._capture = real
    assert model.runner.plans.key(np.array(mixes[-1])) == model.runner.plans.key(np.array(mixes[-2]))
    assert len(budgets) > 3


def test_a_plans_meta_is_uploaded_only_when_the_grid_changes(official, monkeypatch, rng):
    """Two grids of one plan (same budget, variant and tiles), called A A B A B B: the meta is uploaded on
    the first call and on each change of grid only, and every output equals the eager model's (a skipped
    upload that left the other grid's segments in place would not)."""
    from glmvit_cupy.engine import plans as plans_module

    binding, model, _ = official
    eager = GlmVit(binding, capacity_tokens=8000, graphs=False)
    a, b = [[1, 16, 16], [1, 16, 16]], [[1, 8, 16], [1, 8, 16], [1, 16, 16]]
    assert model.runner.plans.key(np.array(a)) == model.runner.plans.key(np.array(b))
    uploads = []
    real = plans_module.HOST.upload
    monkeypatch.setattr(plans_module.HOST, "upload", lambda src, dst: (uploads.append(dst), real(src, dst)))
    model.encode_pixels(rng.standard_normal((512, 1176), dtype=np.float32), [[1, 32, 16]])  # another plan first
    uploads.clear()
    for grid in (a, a, b, a, b, b):
        pv = rng.standard_normal((512, 1176), dtype=np.float32)
        assert np.array_equal(f32(model.encode_pixels(pv, grid)), f32(eager.encode_pixels(pv, grid))), grid
    plan = model.runner.plans.find(np.array(a))
    assert uploads.count(plan.meta.data.ptr) == 4  # a, b, a, b: the repeats reuse what the plan's meta holds
    assert eager.runner.plans.find(np.array(a)).meta.data.ptr != plan.meta.data.ptr


def test_a_large_budget_runs_eagerly_first_then_captures(official, rng):
    """From runner.CAPTURE_ON_SECOND_CALL patches a budget's first call runs kernel by kernel, its second
    captures and replays, and a third call replays: all bit-equal to an eager model's (fresh pixels each time)."""
    from glmvit_cupy.engine.runner import CAPTURE_ON_SECOND_CALL

    binding, model, _ = official
    eager = GlmVit(binding, capacity_tokens=8000, graphs=False)
    grids = [[[1, 100, 100], [1, 80, 90]], [[1, 80, 90], [1, 100, 100]], [[1, 100, 100], [1, 80, 90]]]  # one key
    plan = None
    for k, grid in enumerate(grids):
        pv = rng.standard_normal((sum(h * w for _, h, w in grid), 1176), dtype=np.float32)
        got = f32(model.encode_pixels(pv, grid))
        timing = set(model.last_timing)
        plan = plan or model.runner.plans.find(np.array(grid))
        assert model.runner.plans.find(np.array(grid)) is plan and plan.patches >= CAPTURE_ON_SECOND_CALL
        assert (timing == {"forward", "copy_out"}) == (k > 0) and (plan.graph is not None) == (k > 0)
        assert np.array_equal(got, f32(eager.encode_pixels(pv, grid)))


def test_precaptured_graphs_replay_full_passes_on_their_first_call(official, rng):
    """GlmVit.precapture(1024) captures the graphs of the budgets that passes packed full of <= 1,024-token
    images land in; such passes then replay on their first call (nothing captured, nothing eager), bit-equal
    to an eager model's, with the arena's pixel rows poisoned first. Bad limits are refused; with graphs off
    nothing is captured."""
    binding, _, _ = official
    model = GlmVit(binding, capacity_tokens=8000)
    eager = GlmVit(binding, capacity_tokens=8000, graphs=False)
    for bad in (0, -5, 2.5, True, "1024"):
        with pytest.raises(ValueError, match="precapture: max_image_tokens"):
            model.precapture(bad)
    assert eager.precapture(1024) == [] and len(eager.runner.plans) == 0
    assert model.precapture(1024) == [28672, 32000] and len(model.runner.plans) == 2
    captures = []
    real = model.runner._capture
    model.runner._capture = lambda plan: (captures.append(plan.patches), real(plan))
    try:
        for grid in ([[1, 64, 64]] * 6 + [[1, 60, 60]],  # 28,176 patches: budget 28,672
                     [[1, 64, 64]] * 3 + [[1, 62, 66]] + [[1, 64, 64]] * 3 + [[1, 56, 56]]):  # 31,820: 32,000
            n = sum(h * w for _, h, w in grid)
            plan = model.runner.plans.find(np.array(grid))
            assert plan is not None and plan.graph is not None and plan.uses == 0, grid
            pv = rng.standard_normal((n, 1176), dtype=np.float32)
            model.runner.arena()["pixels"].view(cupy.uint16).fill(0x7FC0)
            got = f32(model.encode_pixels(pv, grid))
            assert set(model.last_timing) == {"forward", "copy_out"} and plan.uses == 1
            assert np.array_equal(got, f32(eager.encode_pixels(pv, grid)))
    finally:
        model.runner._capture = real
    assert captures == []


def test_every_budget_precaptured_serves_passes_of_small_images_without_a_capture(official, rng):
    """precapture(every_budget=True), as the service does: random passes of 64-169-token images (a service's
    small images, many to a pass) find their graph ready on their first call, nothing captured and nothing
    eager, bit-equal to an eager model's, with the arena's pixel rows poisoned first."""
    from glmvit_cupy.engine.budgets import all_budgets

    binding, _, _ = official
    model = GlmVit(binding, capacity_tokens=8000)
    eager = GlmVit(binding, capacity_tokens=8000, graphs=False)
    assert model.precapture(1024, every_budget=True) == all_budgets(32000)
    captured = len(model.runner.plans)
    captures = []
    real = model.runner._capture
    model.runner._capture = lambda plan: (captures.append(plan.patches), real(plan))
    try:
        for _ in range(6):
            sides = [(2 * int(rng.integers(8, 14)), 2 * int(rng.integers(8, 14))) for _ in range(int(rng.integers(2, 60)))]
            grid = [[1, h, w] for h, w in sides]  # 256-676 patches: 64-169 tokens
            while sum(h * w for _, h, w in grid) > 32000:
                grid.pop()
            if not grid:
                continue
            n = sum(h * w for _, h, w in grid)
            plan = model.runner.plans.find(np.array(grid))
            assert plan is not None and plan.graph is not None, grid
            pv = rng.standard_normal((n, 1176), dtype=np.float32)
            model.runner.arena()["pixels"].view(cupy.uint16).fill(0x7FC0)
            got = f32(model.encode_pixels(pv, grid))
            assert set(model.last_timing) == {"forward", "copy_out"}
            assert np.array_equal(got, f32(eager.encode_pixels(pv, grid)))
    finally:
        model.runner._capture = real
    assert captures == [] and len(model.runner.plans) == captured
    print(f"every budget precaptured: {captured} graphs")


def graphed_and_eager(official):
    """The official tower twice at capacity 256: with CUDA graphs, and eager."""
    binding, _, _ = official
    return GlmVit(binding, capacity_tokens=256), GlmVit(binding, capacity_tokens=256, graphs=False)


def three_passes_equal_eager(m, eager, seed: int, poison: bool = False):
    """Three fresh inputs of grid (1, 8, 8) through m, each equal to eager's bit for bit (poison: m's
    output slot NaN before each forward writes it); the plan they ran."""
    rng = np.random.default_rng(seed)
    grid = [[1, 8, 8]]
    for _ in range(3):
        pv = rng.standard_normal((64, 1176), dtype=np.float32)
        if poison:
            m.runner.arena()["embeddings"].view(cupy.uint16).fill(0x7FC0)
        assert np.array_equal(f32(m.encode_pixels(pv, grid)), f32(eager.encode_pixels(pv, grid)))
    return m.runner.plans.find(np.array(grid))


def test_failed_graph_capture_falls_back_to_eager(official, monkeypatch, caplog):
    m, eager = graphed_and_eager(official)
    real = m.runner.forward

    def failing_under_capture(plan, mark=None):
        if m.runner.stream.is_capturing():
            raise RuntimeError("simulated capture failure")
        return real(plan, mark)

    monkeypatch.setattr(m.runner, "forward", failing_under_capture)
    plan = three_passes_equal_eager(m, eager, 8)
    assert plan.capture_failed and plan.graph is None and plan.uses == 3
    assert "capture failed" in caplog.text and set(m.last_timing) == {"patch_embed", "blocks", "merger", "copy_out"}


def test_a_capture_that_fails_once_is_retried_after_an_eager_run(official, monkeypatch, caplog):
    """A capture that fails the first time only (a library kernel loaded on first launch does that) gets
    its graph on the retry that follows one eager run, and the graph's output is the eager model's."""
    m, eager = graphed_and_eager(official)
    real, failures, eager_runs = m.runner.forward, [], []

    def failing_first_capture(plan, mark=None):
        if m.runner.stream.is_capturing() and not failures:
            failures.append(plan.patches)
            raise RuntimeError("simulated first-launch failure")
        if not m.runner.stream.is_capturing():
            eager_runs.append(plan.patches)
        return real(plan, mark)

    monkeypatch.setattr(m.runner, "forward", failing_first_capture)
    plan = three_passes_equal_eager(m, eager, 9, poison=True)
    assert failures == eager_runs == [plan.patches], (failures, eager_runs)  # one eager run, between the tries
    assert plan.graph is not None and not plan.capture_failed and "capture failed" not in caplog.text
    assert set(m.last_timing) == {"forward", "copy_out"}


def test_bf16_and_other_device_cupy_inputs(small):
    pv, grid = G["img_140x90/pixel_values"], G["img_140x90/grid_thw"]
    want = f32(small.encode_pixels(pv, grid))
    as_bf16 = cupy.asarray(pv.astype(ml_dtypes.bfloat16))  # staged as is, no cast
    assert np.array_equal(f32(small.encode_pixels(as_bf16, grid)), want)
    strided = cupy.asarray(np.repeat(pv, 2, axis=1))[:, ::2]  # a non-contiguous float32 view
    assert np.array_equal(f32(small.encode_pixels(strided, grid)), want)
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("GPU test: one GPU here; the other-device input needs two")
    with cupy.cuda.Device(1):
        other = cupy.asarray(pv)
    out = small.encode_pixels(other, grid)
    assert out.device.id == small.device.id and np.array_equal(f32(out), want)


def test_a_model_on_another_gpu_joins_its_videos_there(small):
    """GlmVit(device=1) called where GPU 0 is current: a video of several passes is joined on GPU 1, in that
    GPU's stream order, with the bits a model on GPU 0 gives (GPU and host resize alike)."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("GPU test: one GPU here; a model on another GPU needs two")
    other = GlmVit.from_checkpoint(cases.TOWER_DIR, device=1, capacity_tokens=600)
    vids = [np.random.default_rng(9).integers(0, 256, (8, 392, 392, 3), dtype=np.uint8)]  # 4 groups of 196 tokens
    for resize in ("gpu", "host"):
        want = f32(small.encode_video(vids, sample=False, resize=resize)[0])
        with cupy.cuda.Device(0):
            got = other.encode_video(vids, sample=False, resize=resize)[0]
        assert got.device.id == 1 and np.array_equal(f32(got), want), resize


def test_input_kinds_in_any_order_each_stage_their_own_pixels(small, monkeypatch, rng):
    """float32 pixels are cast by the forward's first kernel (inside the graph) when the arena's flag says
    so; bf16 pixels and encode(images) write bf16 rows and clear it. Any order of kinds, fresh inputs each
    call, replayed graphs: every output equals an eager model's from NumPy float32, and the flag is written
    only when it changes (a stale flag would cast the last float32 rows over an image's, or leave them)."""
    from glmvit_cupy import preprocess

    eager = GlmVit(bind_tower(cases.TOWER_DIR), capacity_tokens=600, graphs=False)
    writes = []
    real = cupy.cuda.runtime.memsetAsync
    flag = small.runner.arena()["pixels_cast"].data.ptr
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync",
                        lambda *a: (writes.append(a[1]) if a[0] == flag else None, real(*a)))
    kinds = ["numpy", "numpy", "image", "image", "cupy", "bf16", "float64", "image", "strided", "cupy"]
    want_writes, held = [], small.runner._pixels_cast
    for kind in kinds:
        if (kind not in ("image", "bf16")) is not held:
            held = kind not in ("image", "bf16")
            want_writes.append(int(held))
    for k, kind in enumerate(kinds):
        h, w = 2 * int(rng.integers(3, 9)), 2 * int(rng.integers(3, 9))
        if kind == "image":
            image = rng.integers(0, 256, (14 * h, 14 * w, 3), dtype=np.uint8)
            pv, grid = preprocess([image], min_image_tokens=0, max_image_tokens=600)
            got = f32(small.encode(image, min_image_tokens=0, max_image_tokens=600)[0])
        else:
            grid = np.array([[1, h, w]])
            pv = rng.standard_normal((h * w, 1176)).astype(ml_dtypes.bfloat16)  # every kind holds these exactly
            x = {"numpy": pv.astype(np.float32), "cupy": cupy.asarray(pv.astype(np.float32)),
                 "bf16": cupy.asarray(pv), "float64": cupy.asarray(pv.astype(np.float64)),
                 "strided": cupy.asarray(np.repeat(pv.astype(np.float32), 2, axis=1))[:, ::2]}[kind]
            got = f32(small.encode_pixels(x, grid))
        assert np.array_equal(got, f32(eager.encode_pixels(np.asarray(pv, np.float32), grid))), (k, kind)
    assert writes == want_writes and len(writes) >= 6, writes


def test_attention_variant_argument(official):
    binding, model, tower = official
    with pytest.raises(ValueError, match="unknown; choices: sm90_4wg"):
        GlmVit(binding, attention_variant="sm90_3wg_fma1in16")
    with pytest.raises(ValueError, match="head dim 32"):
        GlmVit(binding, attention_variant="sm80_d32")
    rng = np.random.default_rng(9)
    pv, grid = rng.standard_normal((1024, 1176), dtype=np.float32), [[1, 32, 32]]
    want = f32(model.encode_pixels(pv, grid))
    fallback = GlmVit(binding, capacity_tokens=256, attention_variant="sm80_d64")
    assert fallback.runner.plans.key(np.array(grid))[1] == "sm80_d64"
    got = f32(fallback.encode_pixels(pv, grid))
    ref = reference.encode_pixels(tower, pv, grid)
    # The fallback runs mma.sync on the same 64-key tiles and the same softmax code as the Hopper
    # kernels, so it may well give the very same bits (it did on the H200); either way it is as close
    # to the float32 reference as the default (HF bf16: 3.8e-2).
    print(f"sm80_d64 {rel(got, ref):.3e}, default {rel(want, ref):.3e} against the float32 reference, "
          f"bit-equal: {np.array_equal(got, want)}")
    assert rel(got, ref) < 2.5e-2 and rel(want, ref) < 2.5e-2
    if cupy.cuda.Device().compute_capability == "90":
        # These random weights' q_norm / k_norm bound every score well within the limit, so the defaults
        # are the variants without a running max; the two agree bit for bit.
        assert model.score_bound <= FIXED_OFFSET_LIMIT
        assert model.runner.plans.variants == ("sm90_4wg_fixed", "sm90_2wg_fixed")
        for name in model.runner.plans.variants:
            forced = GlmVit(binding, capacity_tokens=256, attention_variant=name)
            assert np.array_equal(f32(forced.encode_pixels(pv, grid)), want), name
        online = [f32(GlmVit(binding, capacity_tokens=256, attention_variant=name).encode_pixels(pv, grid))
                  for name in ("sm90_4wg", "sm90_2wg")]  # the exact-for-any-scores ones: as close
        assert np.array_equal(online[0], online[1])
        print(f"online softmax {rel(online[0], ref):.3e} against the float32 reference")
        assert rel(online[0], ref) < 2.5e-2


def test_huge_values_keep_the_running_max(tmp_path):
    """A checkpoint whose V rows are scaled by 2^110 (finite in bf16) bounds |v| past what the variants
    without a running max can sum in float32: the online ones are the default and forcing a fixed one
    is refused, naming |v|. (No forward: such values overflow the next RMSNorm's float32 sum of squares
    in the reference as well; the bound's arithmetic is tested without a GPU in test_registry.)"""
    from glmvit_cupy.checkpoint.synthetic import random_tower

    geo = cases.GEOMETRY
    tensors = random_tower(geo, 5)
    h = geo.hidden_size
    for i in range(geo.depth):
        w = tensors[f"blocks.{i}.attn.qkv.weight"].astype(np.float32)
        w[2 * h:] *= 2.0 ** 110
        tensors[f"blocks.{i}.attn.qkv.weight"] = w.astype(ml_dtypes.bfloat16)
    binding = bind_tower(write_checkpoint(tmp_path / "huge_v", geo, tensors=tensors))
    model = GlmVit(binding, capacity_tokens=64)
    assert model.value_bound > 105 and model.score_bound <= FIXED_OFFSET_LIMIT
    if cupy.cuda.Device().compute_capability == "90":
        assert model.runner.plans.variants == ("sm90_4wg", "sm90_2wg")
        with pytest.raises(ValueError, match=r"bound \|v\| by 2\^1\d\d"):
            GlmVit(binding, capacity_tokens=64, attention_variant="sm90_4wg_fixed")


def test_a_large_v_bias_reaches_the_output_past_attention(tmp_path):
    """attn.qkv's V bias is not added to v (attention reads v where the QKV GEMM wrote it): it reaches x as
    attn.proj.weight @ b_v in norm2_offset. With V biases twice v's size, the Hopper kernel and the sm_80
    one still match the float32 reference, which the same tower with those biases zeroed misses by ~100%
    (so a lost or misplaced fold fails here)."""
    from glmvit_cupy.checkpoint.synthetic import random_tower

    geo, rng = cases.GEOMETRY, np.random.default_rng(6)
    h, tensors = geo.hidden_size, random_tower(geo, 6)
    zeroed = dict(tensors)
    for i in range(geo.depth):
        key = f"blocks.{i}.attn.qkv.bias"
        b = tensors[key].astype(np.float32)
        b[2 * h:] = rng.standard_normal(h, dtype=np.float32) * 2
        tensors[key] = b.astype(ml_dtypes.bfloat16)
        b[2 * h:] = 0
        zeroed[key] = b.astype(ml_dtypes.bfloat16)
    grid = [[1, 8, 12], [1, 10, 8]]  # two segments, neither a multiple of the 64-key tiles
    pv = rng.standard_normal((8 * 12 + 10 * 8, geo.patch_dim), dtype=np.float32)
    binding = bind_tower(write_checkpoint(tmp_path / "big_v_bias", geo, tensors=tensors))
    ref = reference.encode_pixels(reference.Tower(binding), pv, grid)
    without = reference.encode_pixels(reference.Tower(bind_tower(write_checkpoint(tmp_path / "no_v_bias", geo,
                                                                                tensors=zeroed))), pv, grid)
    assert rel(f32(without), f32(ref)) > 0.5
    variants = [None, "sm80_d64"] if cupy.cuda.Device().compute_capability == "90" else [None]
    for variant in variants:
        got = f32(GlmVit(binding, capacity_tokens=64, attention_variant=variant).encode_pixels(pv, grid))
        print(f"{variant or 'default'}: {rel(got, f32(ref)):.3e} against the float32 reference")
        assert rel(got, f32(ref)) < 2.5e-2


def test_fused_swiglu_and_cublas_mlp_agree_with_the_reference(official, tmp_path):
    """On Hopper the MLPs' gate/up GEMMs apply the clamped SwiGLU themselves (gemm_sm90.cu); fused_swiglu=
    False is cuBLAS and a separate pass. Both are as close to the float32 reference as HF's bf16 allows,
    and differ from each other (one rounds gate|up to bf16 first). Where the kernel cannot run, asking
    for it is refused before any launch, and the default quietly uses cuBLAS."""
    binding, model, tower = official
    sm90 = cupy.cuda.Device().compute_capability == "90"
    assert model.fused_swiglu == sm90
    rng = np.random.default_rng(12)
    pv, grid = rng.standard_normal((2 * 1024, 1176), dtype=np.float32), [[2, 32, 32]]
    ref = reference.encode_pixels(tower, pv, grid)
    plain = GlmVit(binding, capacity_tokens=512, fused_swiglu=False)
    assert plain.fused_swiglu is False and "gate_up" in plain.runner.arena().views
    got, want = f32(plain.encode_pixels(pv, grid)), f32(model.encode_pixels(pv, grid))
    print(f"cuBLAS + pass {rel(got, ref):.3e}, default {rel(want, ref):.3e} against the float32 reference")
    assert rel(got, ref) < 2.5e-2 and rel(want, ref) < 2.5e-2
    if sm90:
        assert not np.array_equal(got, want) and "gate_up" not in model.runner.arena().views
    # 64 wide, intermediate 192: not a multiple of the kernel's 128-column tiles
    geo = VisionGeometry(depth=1, hidden_size=64, num_heads=2, intermediate_size=192, out_hidden_size=128,
                         projection_intermediate_size=256)
    odd = bind_tower(write_checkpoint(tmp_path / "odd", geo, seed=3))
    assert GlmVit(odd, capacity_tokens=64).fused_swiglu is False
    with pytest.raises(ValueError, match=r"fused_swiglu=True cannot run here: .*\(192, 256\)"):
        GlmVit(odd, capacity_tokens=64, fused_swiglu=True)


def test_capacity_is_one_word_and_bounds_the_default_image_limit(small):
    """A model built for 600 tokens encodes a large image without being told 600 again: encode's
    max_image_tokens defaults to the reference's 8000 lowered to the capacity."""
    big = cases._smooth(1400, 1000, seed=44)
    out = small.encode([big])[0]
    assert out.shape[0] <= 600
    assert np.array_equal(f32(out), f32(small.encode([big], max_image_tokens=600)[0]))
    with pytest.raises(ValueError, match="exceeds this model's capacity of 600"):
        small.encode([big], max_image_tokens=601)
    with pytest.warns(DeprecationWarning, match="capacity_tokens"):
        old = GlmVit.from_checkpoint(cases.TOWER_DIR, max_image_tokens=64)
    assert old.capacity_tokens == 64
    with pytest.raises(ValueError, match="capacity_tokens=0 must be a positive integer"):
        GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=0)


ODD_GEOMETRIES = {
    # head dim 32, widths that are not multiples of 4 or 8, one grey channel, 16-pixel single-frame patches
    "hd32_odd_widths": VisionGeometry(depth=2, hidden_size=96, num_heads=3, intermediate_size=100, out_hidden_size=130,
                                      projection_intermediate_size=70, patch_size=16, temporal_patch_size=1,
                                      in_channels=1),
    # head dim 128, the official patch geometry
    "hd128": VisionGeometry(depth=1, hidden_size=256, num_heads=2, intermediate_size=520, out_hidden_size=192,
                            projection_intermediate_size=384),
    # head dims that neither the vector RoPE pass nor the MMAs' 16-column steps divide: 36 (8-byte copies,
    # 48 columns of MMA), 48 (RoPE's warp-per-head kernel), 4 (the smallest the axial RoPE allows)
    "hd36": VisionGeometry(depth=2, hidden_size=108, num_heads=3, intermediate_size=200, out_hidden_size=100,
                           projection_intermediate_size=96),
    "hd48": VisionGeometry(depth=1, hidden_size=96, num_heads=2, intermediate_size=256, out_hidden_size=128,
                           projection_intermediate_size=256),
    "hd4": VisionGeometry(depth=1, hidden_size=12, num_heads=3, intermediate_size=20, out_hidden_size=24,
                          projection_intermediate_size=28),
    # other spatial merges than the released 2 x 2: 3 x 3 (budgets that 9 does not divide) and none (1 x 1)
    "merge3": VisionGeometry(depth=2, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=192,
                             projection_intermediate_size=256, spatial_merge_size=3),
    "merge1": VisionGeometry(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=96,
                             projection_intermediate_size=128, spatial_merge_size=1),
}
ODD_GRIDS = {1: [[1, 5, 7], [2, 3, 4], [1, 11, 9]],    # segments of 35, 12 (x2 frames) and 99 patches
             2: [[1, 6, 10], [2, 4, 6], [1, 14, 8]],   # 60, 24 (x2) and 112
             3: [[1, 6, 9], [2, 3, 6], [1, 12, 9]]}    # 54, 18 (x2) and 108


@pytest.mark.parametrize("name", ODD_GEOMETRIES)
def test_other_geometries_vs_reference(name, tmp_path, rng):
    """Geometries other than the official one (other head dims, widths no kernel's vector width divides, other
    patch shapes, other merge sizes) run every kernel's general path: each as close to the float32 reference
    as the official tower, batched bit-equal to alone, and the replayed graph bit-equal to eager."""
    geo = ODD_GEOMETRIES[name]
    binding = bind_tower(write_checkpoint(tmp_path / name, geo, seed=7))
    tower = reference.Tower(binding)
    grids, mm = ODD_GRIDS[geo.spatial_merge_size], geo.merge_patches
    rows = [t * h * w for t, h, w in grids]
    pv = rng.standard_normal((sum(rows), geo.patch_dim), dtype=np.float32)
    cap = max(2 * sum(rows) // mm, 96)  # budgets past the batch: padded rows
    model = GlmVit(binding, capacity_tokens=cap)
    eager = GlmVit(binding, capacity_tokens=cap, graphs=False)
    batch = f32(model.encode_pixels(pv, grids))
    batch = f32(model.encode_pixels(pv, grids))  # the second call replays its graph
    assert np.array_equal(batch, f32(eager.encode_pixels(pv, grids)))
    ref = reference.encode_pixels(tower, pv, grids)
    err = rel(batch, f32(ref))
    print(f"{name}: {err:.3e} against the float32 reference")
    assert err < 2.5e-2
    start, out_start = 0, 0
    for g, n in zip(grids, rows):
        alone = f32(model.encode_pixels(pv[start:start + n], [g]))
        assert np.array_equal(alone, batch[out_start:out_start + n // mm])
        start, out_start = start + n, out_start + n // mm
    assert batch.shape == (sum(rows) // mm, geo.out_hidden_size)
    if geo.in_channels == 3:  # images: preprocessed with the tower's own patching, resized on the GPU or by Pillow
        from glmvit_cupy.preprocessing.image import Patching, preprocess

        images = [rng.integers(0, 256, (int(rng.integers(20, 300)), int(rng.integers(20, 300)), 3), dtype=np.uint8)
                  for _ in range(3)]
        pv_img, grid_img = preprocess(images, max_image_tokens=cap // 3, patching=Patching.of(geo))
        want = f32(model.encode_pixels(pv_img, grid_img))
        for resize in ("gpu", "host"):
            got = np.concatenate([f32(o) for o in model.encode(images, max_image_tokens=cap // 3, resize=resize)])
            assert np.array_equal(got, want), resize


def test_nan_or_inf_weights_are_refused_by_name_and_leave_the_gpu_working(small, tmp_path):
    """A damaged checkpoint (NaN / inf in an uploaded GEMM weight, in a norm weight, and in a bias the model
    folds into its residual offsets instead of uploading) is refused at load, naming each tensor with its
    count; the loaded model is untouched and the GPU keeps working."""
    from glmvit_cupy import CheckpointError
    from glmvit_cupy.checkpoint.synthetic import random_tower

    geo = cases.GEOMETRY
    tensors = random_tower(geo, 7)
    for name, spots in {"blocks.1.mlp.gate_proj.weight": [(3, 0x7FC0), (4000, 0xFF80)],
                        "merger.up_proj.weight": [(17, 0x7F80)], "blocks.0.attn.proj.bias": [(5, 0xFFC1)],
                        "post_layernorm.weight": [(0, 0x7F80)]}.items():
        a = tensors[name].copy()
        for i, v in spots:
            a.reshape(-1).view(np.uint16)[i] = v
        tensors[name] = a
    pv, grid = G["img_64x64/pixel_values"], G["img_64x64/grid_thw"]
    before = f32(small.encode_pixels(pv, grid))
    with pytest.raises(CheckpointError) as e:
        GlmVit.from_checkpoint(write_checkpoint(tmp_path / "nan", geo, tensors=tensors), capacity_tokens=64)
    msg = str(e.value)
    assert "NaN or infinite weights in 4 tower tensors" in msg, msg
    for name, count in (("blocks.1.mlp.gate_proj.weight", 2), ("merger.up_proj.weight", 1),
                        ("blocks.0.attn.proj.bias", 1), ("post_layernorm.weight", 1)):
        assert f"model.visual.{name} (" in msg and f"): {count} of " in msg, (name, msg)
    assert np.array_equal(f32(small.encode_pixels(pv, grid)), before)
    ok = GlmVit.from_checkpoint(write_checkpoint(tmp_path / "ok", geo, tensors=random_tower(geo, 7)), capacity_tokens=64)
    assert np.isfinite(f32(ok.encode_pixels(pv, grid))).all()


def test_videos_encode_in_frame_groups_with_the_bits_of_one_pass(official):
    """A video is its temporal groups encoded as images of their own: one pass, passes of a few groups (a
    small capacity) and encode_video all give the same bits, near the float32 reference within HF bf16's
    error on the same rows (the live bar where HF runs here)."""
    from glmvit_cupy import preprocess_video

    binding, model, tower = official
    rng = np.random.default_rng(21)
    vids = [np.stack([cases._smooth(180, 260, seed=50 + k) for k in range(7)]),
            rng.integers(0, 256, (4, 90, 120, 3), dtype=np.uint8)]
    pv, grid, infos = preprocess_video(vids, fps=[6.0, 3.0], target_fps=6, max_image_tokens=4000)
    assert grid[:, 0].tolist() == [4, 2] and [i["frames_indices"] for i in infos] == [list(range(7)) + [6],
                                                                                        [0, 1, 2, 3]]
    one = [f32(o) for o in model.encode_video_pixels(pv, grid)]
    ref = reference.encode_pixels(tower, pv, grid)
    why = hf_bar.available()
    hf = hf_bar.hf_forward(binding, pv, grid) if why is None else None
    row = 0
    for i, info in enumerate(infos):
        assert one[i].shape == (info["tokens"], binding.geometry.out_hidden_size)
        r = ref[row:row + info["tokens"]]
        bar = rel(hf[row:row + info["tokens"]], r) if hf is not None else 2e-2
        print(f"video {i} {grid[i].tolist()}: ours {rel(one[i], r):.3e}  HF bf16 {bar:.3e} ({why or 'measured'})")
        assert rel(one[i], r) <= bar
        row += info["tokens"]
    per_group = max(i["frame_tokens"] for i in infos)
    narrow = GlmVit(binding, capacity_tokens=2 * per_group + 1)  # two groups a pass at most: several passes
    for a, b in zip(one, narrow.encode_video_pixels(cupy.asarray(pv), grid)):
        assert np.array_equal(a, f32(b))
    settings = dict(fps=[6.0, 3.0], target_fps=6, max_image_tokens=4000)
    for m, resize in ((model, "gpu"), (model, "host"), (narrow, "gpu")):  # frames resized on the GPU or host
        for a, b in zip(one, m.encode_video(vids, resize=resize, **settings)):
            assert np.array_equal(a, f32(b)), (m.capacity_tokens, resize)
    tiny = GlmVit(binding, capacity_tokens=per_group - 1)
    with pytest.raises(ValueError, match="video 0: one frame group of .* more than this model's capacity"):
        tiny.encode_video_pixels(pv, grid)
    with pytest.raises(ValueError, match="video 0: one frame group of .* more than this model's capacity"):
        tiny.encode_video(vids, **settings)
    with pytest.raises(ValueError, match="resize='cuda': choose one of 'host', 'gpu'"):
        model.encode_video(vids, resize="cuda", **settings)


def test_a_burst_of_large_images_uploads_within_a_byte_budget(official, rng):
    """12 images of 5000 x 3000 through encode(), 8 decoding threads running up to 18 images ahead. The
    threads upload within the uploader's byte limit (uploads.MAX_BYTES: two of these images' 48 MiB
    blocks), except the image the GPU's thread waits for, which goes past it while earlier passes hold
    their blocks. So the uploader's blocks peak at a few images (two to five measured), where uploading
    each image as it is decoded holds eight to twelve; the memory pool grows by the outputs, that peak
    and the staging scratch; the same burst again grows it by its outputs alone."""
    import gc

    from glmvit_cupy.engine.pools import block_size
    from glmvit_cupy.engine.uploads import MAX_BYTES

    _, model, _ = official
    pool = cupy.get_default_memory_pool()
    model.encode(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))  # the arena and the plans exist
    cupy.cuda.runtime.deviceSynchronize()
    gc.collect()
    pool.free_all_blocks()  # the free blocks earlier tests left cached in the pool are not this burst's
    before = pool.total_bytes()
    images = [rng.integers(0, 256, (5000, 3000, 3), dtype=np.uint8) for _ in range(12)]
    block = block_size(images[0].nbytes)
    uploads = model.runner.uploads.pool
    growth, peaks = [], []
    for _ in range(2):  # the second burst finds the uploader's blocks and the staging scratch made
        uploads.peak = uploads.owned
        outs = model.encode(images, workers=8)
        cupy.cuda.runtime.deviceSynchronize()
        out_bytes = sum(o.nbytes for o in outs)
        growth.append(pool.total_bytes() - before - out_bytes)
        peaks.append(uploads.peak)
        before = pool.total_bytes()
        assert len(outs) == 12 and all(o.shape[1] == 4096 for o in outs)
    scratch = model.runner.stager.scratch_bytes
    print(f"pool growth over the outputs ({out_bytes / 2**20:.0f} MiB a burst): {growth[0] / 2**20:.0f} MiB, then "
          f"{growth[1] / 2**20:.0f} MiB; uploader peak {peaks[0] / 2**20:.0f}, then {peaks[1] / 2**20:.0f} MiB "
          f"(blocks of {block / 2**20:.0f} MiB, budget {MAX_BYTES >> 20} MiB); staging scratch {scratch / 2**20:.0f} MiB")
    assert max(peaks) <= 6 * block  # the budget's two, the image waited for, and the passes holding theirs
    assert growth[0] <= peaks[0] + scratch + (8 << 20) and growth[1] <= 16 << 20
