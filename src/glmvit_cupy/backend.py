"""Which tower encodes, for the commands and the service: the GPU engine (one replica per device) or,
with cpu=True, the float32 NumPy reference. Either takes prepared images (uint8 canvas, grid, info)
and returns each image's embedding as a host bf16 array; `lanes` batches can run at once, one per
replica. Both are batch-invariant: an image's embedding has the same bits whatever it is batched
with (the reference computes each image on its own; the engine's GEMMs never split their sums).

The service splits a pass's host work over three threads (serving/batcher.py): ahead() runs on the thread
that decoded the image (it uploads it), launch_on() on the lane's engine thread (staging kernels, the
forward's launch), and the returned pass's wait() and fetch() on the lane's completion thread (the GPU's
time, the copies back).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np


class Backend:
    def __init__(self, binding, *, cpu: bool, devices: list[int] | None = None, capacity_tokens: int = 8000,
                 max_image_tokens: int | None = None, every_budget: bool = False):
        """max_image_tokens: the most tokens an image will have; given, each replica captures at load the CUDA
        graphs that passes packed full of such images replay (GlmVit.precapture); every_budget: those of
        every budget too, for passes of whatever images come (the service)."""
        import ml_dtypes

        if cpu and devices:
            raise ValueError(f"Backend: cpu=True runs the float32 reference on the host, devices={devices!r} chooses "
                             "GPUs: give one or the other")
        from .checks import check_capacity, check_positive

        capacity_tokens = check_capacity(capacity_tokens)  # either path, before any load
        if max_image_tokens is not None:
            check_positive("Backend: max_image_tokens", max_image_tokens, " (the most tokens an image will have) or None")
        self.geometry = binding.geometry
        self.capacity_tokens = capacity_tokens
        self.cpu = cpu
        self.resize = "host" if cpu else "gpu"  # who resizes the images this backend is given
        self.shares_passes = not cpu  # the reference computes each image alone: a pass shares nothing
        self._wants = None  # what the command's consumer waits for (preparing, feeding)
        self.graphs_ready: list[int] = []  # budgets (patches) whose CUDA graphs every replica captured at load
        if cpu:
            from . import reference

            self._tower = reference.Tower(binding)
            self._bf16 = ml_dtypes.bfloat16
            self.lanes = 1
            self.name = "cpu (float32 reference)"
        else:
            from . import gpu

            gpu.require()
            import cupy

            from .engine.pools import HOST
            from .engine.replicas import Replicas

            self._engine = Replicas(binding, devices or [cupy.cuda.Device().id], capacity_tokens=capacity_tokens)
            self.lanes = len(self._engine)
            self.name = "gpu " + ",".join(map(str, self._engine.devices))
            # The embeddings come back through page-locked blocks (HOST.download); one per lane is locked
            # now, sized for a full pass, rather than while the first batches run (locking stalls the process).
            out_bytes = self.geometry.embedding_bytes(capacity_tokens) + (1 << 20)
            with contextlib.suppress(MemoryError):
                blocks = [HOST.take(out_bytes) for _ in range(self.lanes)]
                for b in blocks:
                    HOST.give(b)
            self._warm_up()
            if max_image_tokens is not None:
                # Replicas of one checkpoint and capacity capture the same budgets: every one captures,
                # and any one's list names them.
                for model in self._engine.models:
                    self.graphs_ready = model.precapture(max_image_tokens, every_budget=every_budget)

    def preparing(self, one):
        """A host preparer's function (batching.preparer's) as the prepare threads should run it for this
        backend: with one GPU each thread uploads its own images (engine/uploads.py); with several, which
        GPU an image goes to is known once it is packed, so images are decoded into page-locked blocks and
        uploaded from there; the CPU reference takes them as they are."""
        if self.cpu:
            return one
        if len(self._engine) == 1:
            from .engine.uploads import Wants

            self._wants = Wants(ordered=False)  # the command takes images as they finish (feeding)
            return self._engine.models[0].runner.uploads.uploading(one, self._wants)
        from .engine.pools import HOST

        return lambda i, image, name=None: one(i, image, name=name, host_buffer=HOST.array)

    def feeding(self, prepared):
        """The stream of images prepared by the last preparing(...)'s function, taken as they finish, as the
        consumer should take it: with one GPU, each wait for an image lets one upload past the uploader's
        byte limit (engine/uploads.py), so the limit never stalls a consumer that has nothing to pack."""
        return prepared if self._wants is None else self._wants.feeding(prepared)

    def _warm_up(self) -> None:
        """One small image through each replica, as glmvit-encode and the server send them: CUDA loads each
        kernel on its first launch and cuBLAS sets up on its first calls, which the first real batch would
        otherwise wait for (docs/PERFORMANCE.md). Skipped where the geometry or the limits
        leave encode(images) nothing to prepare (the real images then say what is wrong)."""
        from .scheduling.batching import preparer

        try:
            one = preparer(self.geometry, self.capacity_tokens, min_image_tokens=1,
                           max_image_tokens=min(64, self.capacity_tokens), resize="gpu")
            item = one(0, np.random.default_rng(0).integers(0, 256, (40, 57, 3), dtype=np.uint8))
        except ValueError:
            return
        for model in self._engine.models:
            model.encode_prepared([item])
            model.runner.stream.synchronize()

    def patching(self):
        """How this tower's images become pixel rows (preprocessing.image.Patching.of: ValueError for a tower whose
        patches are not RGB, which images cannot feed)."""
        from .preprocessing.image import Patching

        return Patching.of(self.geometry)

    def ahead(self, item: tuple) -> tuple:
        """A prepared image (uint8 image, grid, info) as the engine takes it fastest, on the thread that
        prepared it: with one GPU, uploaded to it now (engine/uploads.py), so the engine thread only orders
        its stream after the copy; otherwise as it is. Where an upload cannot get device memory the image
        stays on the host. The uploader's byte limit does not hold these back: the service bounds its
        images by pixels in flight (--max-pixels-in-flight) before they are decoded."""
        if self.cpu or len(self._engine) != 1:
            return item
        from .engine.uploads import UNBOUNDED

        image, grid, info = item
        return self._engine.models[0].runner.uploads(image, wants=UNBOUNDED), grid, info

    def launch_on(self, lane: int, items: list) -> "Pass":
        """Launch one batch of prepared images on replica `lane` (from its engine thread) and return at once
        (the CPU reference computes it here): the Pass's wait() and fetch() give the host bf16 arrays."""
        if self.cpu:
            return Pass(None, self.encode_on(0, items), None)
        model = self._engine.models[lane]
        outs, event = _after(model, model.encode_prepared(items))
        return Pass(model, outs, event)

    def encode_on(self, lane: int, items: list) -> list[np.ndarray]:
        """One batch of prepared images on replica `lane` (from any thread) -> host bf16 arrays."""
        if self.cpu:
            from . import reference
            from .preprocessing.image import normalise_patchify

            patching = self.patching()
            return [reference.encode_pixels(self._tower, normalise_patchify(canvas, patching),
                                            np.array([grid], np.int64)).astype(self._bf16) for canvas, grid, _ in items]
        from .engine.pools import HOST

        model = self._engine.models[lane]
        outs = model.encode_prepared(items)
        with model.device:
            return HOST.download(outs)  # the caller's stream (this device's) was made to wait for them

    def encode_video_on(self, lane: int, planned: list, resize: str | None = None) -> list[np.ndarray]:
        """Planned videos (video.plan_videos') on replica `lane` (from any thread) -> one host bf16 array per
        video, in passes of whole frame groups; frames resized where `resize` says (None: where this backend
        resizes images; the CPU reference always on the host)."""
        if self.cpu:
            from . import reference
            from .preprocessing.video import video_pixels

            pixels, grid = video_pixels(planned, self.patching())
            out = reference.encode_pixels(self._tower, pixels, grid).astype(self._bf16)
            tokens = np.prod(grid, axis=1) // self.geometry.merge_patches
            return np.split(out, np.cumsum(tokens)[:-1])
        from .engine.pools import HOST

        model = self._engine.models[lane]
        outs = model.encode_planned_videos(planned, resize or self.resize)
        with model.device:
            return HOST.download(outs)

    def launch_video_on(self, lane: int, planned: list, resize: str | None = None) -> "Launched":
        """As encode_video_on, but returns once replica `lane` has the work (its checks passed): viewed()
        then lends one list, an embedding a video, as views of page-locked blocks. So the lane takes the
        next video while these are copied out, and nothing is copied into ordinary memory."""
        if self.cpu:
            return Launched(None, [self.encode_video_on(lane, planned, resize)])
        model = self._engine.models[lane]
        done = _after(model, model.encode_planned_videos(planned, resize or self.resize))
        return Launched(lambda: [done], None)

    def launch(self, batches: list) -> "Launched":
        """Start several batches (batch j on lane j % lanes) and return at once: the GPUs compute them while
        the caller prepares and launches the next ones. (The CPU reference computes them here.)"""
        if self.cpu:
            return Launched(None, [self.encode_on(0, items) for items in batches])
        return Launched(self._engine.start(self._start, batches), None)

    @staticmethod
    def _start(model, items):
        """Launch one batch on `model` -> (its device outputs, the event after them)."""
        return _after(model, model.encode_prepared(items))


def _after(model, outs: list) -> tuple:
    """(outs, an event on model's GPU after them): encode_prepared and encode_planned_videos make the current
    stream wait for their outputs, so an event recorded on it now completes once they are computed."""
    import cupy

    with model.device:
        return outs, cupy.cuda.get_current_stream().record()


class Pass:
    """One batch launched on a GPU (or computed already, model None): wait() returns once it is computed,
    fetch() then copies its embeddings into host arrays (through a page-locked block, on a stream of the
    calling thread's own) and lets the device's outputs go."""

    _streams = threading.local()  # per thread and device: the stream its copies back run on

    def __init__(self, model, outs: list, event):
        self.model, self.outs, self.event = model, outs, event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def fetch(self) -> list[np.ndarray]:
        if self.model is None:
            return self.outs
        import cupy

        from .engine.pools import HOST

        self.wait()
        outs, self.outs = self.outs, None
        with self.model.device:
            if not hasattr(self._streams, "by_device"):
                self._streams.by_device = {}
            stream = self._streams.by_device.get(self.model.device.id)
            if stream is None:
                stream = self._streams.by_device[self.model.device.id] = cupy.cuda.Stream(non_blocking=True)
            with stream:
                return HOST.download(outs)


class Launched:
    """Batches on their GPUs (or already computed, by the CPU reference): wait() returns once they are
    computed; viewed() (from any thread, once) lends their embeddings, one list per batch, as views of
    page-locked blocks (pools.PinnedPool.downloaded), and lets the device's copies go."""

    def __init__(self, wait, host):
        self._wait, self._host, self._done = wait, host, None
        self._claimed = False

    def claim(self) -> bool:
        """True the first time only: the one writer of these batches (a second hand-over is ignored)."""
        claimed, self._claimed = self._claimed, True
        return not claimed

    def wait(self) -> None:
        if self._host is None and self._done is None:
            if self._wait is None:
                raise RuntimeError("these batches' embeddings were already read with viewed()")
            self._done, self._wait = self._wait(), None  # the batches' images are let go (their blocks reused)
            for _, event in self._done:
                event.synchronize()

    @contextlib.contextmanager
    def viewed(self):
        """The embeddings, one list per batch, valid only inside the `with` (the blocks then go back): for a
        caller that writes them out (glmvit-encode's writer), no copy into ordinary memory."""
        if self._host is not None:
            yield self._host
            return
        self.wait()
        from .engine.pools import HOST

        done, self._done = self._done, None
        with contextlib.ExitStack() as stack:
            views = []
            for outs, _ in done:
                with outs[0].device if outs else contextlib.nullcontext():
                    views.append(stack.enter_context(HOST.downloaded(outs)))
            yield views
