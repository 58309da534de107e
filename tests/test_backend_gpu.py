"""The service's GPU backend as the batcher drives it: images uploaded on the threads that decode them
(Backend.ahead), passes launched on an engine thread (launch_on) and waited for and copied back on a
completion thread (Pass.wait, Pass.fetch), with up to two passes out at once; every embedding bit-equal
to GlmVit.encode of the same bytes alone. One replica and two (on one GPU where there is one)."""

import asyncio
import io
import threading

import numpy as np
import pytest
from PIL import Image

from tests.conftest import gpu_or_skip

pytestmark = pytest.mark.gpu
cupy = gpu_or_skip()

from tests.golden import cases  # noqa: E402

from glmvit_cupy import GlmVit, bind_tower  # noqa: E402
from glmvit_cupy.preprocessing.image import prepare_canvas  # noqa: E402
from glmvit_cupy.backend import Backend  # noqa: E402
from glmvit_cupy.serving.batcher import Batcher  # noqa: E402
from glmvit_cupy.engine.uploads import Uploaded  # noqa: E402


def pngs(rng, n):
    out = []
    for _ in range(n):
        h, w = (int(v) for v in rng.integers(40, 260, 2))
        buf = io.BytesIO()
        Image.fromarray(cases._smooth(h, w, int(rng.integers(1 << 30)))).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


@pytest.mark.parametrize("replicas", [1, 2])
def test_served_passes_equal_encoding_each_image_alone(rng, replicas):
    devices = [0, 1] if replicas == 2 and cupy.cuda.runtime.getDeviceCount() >= 2 else [0] * replicas
    backend = Backend(bind_tower(cases.TOWER_DIR), cpu=False, devices=devices, capacity_tokens=300)
    data = pngs(rng, 24)
    passes = []
    batcher = Batcher(backend, capacity_tokens=300, max_wait_s=0.002, max_queue=256, on_pass=passes.append)
    decoded_on = set()

    def prepare(blob, i):  # as the service's decoding threads do
        item = backend.ahead(prepare_canvas(io.BytesIO(blob), i, max_image_tokens=120, resize=backend.resize,
                                            patching=backend.patching()))
        decoded_on.add(type(item[0]))
        return item

    async def go():
        loop = asyncio.get_running_loop()
        requests = [data[i:i + 3] for i in range(0, len(data), 3)]
        items = await asyncio.gather(*[asyncio.gather(*[loop.run_in_executor(None, prepare, b, i)
                                                        for i, b in enumerate(r)]) for r in requests])
        futures = [batcher.submit(list(it)) for it in items]
        return [await asyncio.gather(*f) for f in futures]

    try:
        got = [e for r in asyncio.run(go()) for e in r]
    finally:
        batcher.stop()
    assert decoded_on == ({Uploaded} if replicas == 1 else {np.ndarray})  # uploaded ahead with one GPU
    assert any(t.images > 1 for t in passes) and all(t.gpu >= 0 and t.fetch >= 0 for t in passes)
    assert {t.lane for t in passes} == set(range(replicas))
    model = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=300)
    for blob, emb in zip(data, got):
        want = model.encode([io.BytesIO(blob)], max_image_tokens=120)[0].get()
        assert emb.dtype == want.dtype and np.array_equal(emb.view(np.uint16), want.view(np.uint16))
    print(f"{replicas} replica(s): {len(data)} images in {len(passes)} passes, bit-equal to encoding alone")


def test_a_pass_fetched_on_another_thread_while_the_next_runs():
    """Two passes launched back to back from one thread, fetched in order from another: each equals its
    images encoded alone, and the first pass's outputs are let go once fetched."""
    backend = Backend(bind_tower(cases.TOWER_DIR), cpu=False, capacity_tokens=300)
    rng = np.random.default_rng(5)
    blobs = pngs(rng, 6)
    items = [backend.ahead(prepare_canvas(io.BytesIO(b), i, max_image_tokens=120, resize=backend.resize,
                                          patching=backend.patching()))
             for i, b in enumerate(blobs)]
    first, second = backend.launch_on(0, items[:3]), backend.launch_on(0, items[3:])
    got = {}
    t = threading.Thread(target=lambda: got.update(a=first.fetch(), b=second.fetch()))
    t.start()
    t.join(60)
    assert first.outs is None and second.outs is None
    model = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=300)
    for blob, emb in zip(blobs, got["a"] + got["b"]):
        want = model.encode([io.BytesIO(blob)], max_image_tokens=120)[0].get()
        assert np.array_equal(emb.view(np.uint16), want.view(np.uint16))
