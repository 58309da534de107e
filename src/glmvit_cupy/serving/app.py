"""The HTTP contract of glmvit-serve (Starlette).

    GET  /health      200 {"status": "ok", "geometry": {...}, ...}; 503 while loading or stopping
    POST /v1/encode   JSON {"images": [base64, ...], "min_image_tokens": 16, "max_image_tokens": 8000}
                      (base64 plain, wrapped, URL-safe or a data URL; a limit absent or null: its default;
                      any other field: 400)
                      -> 200 application/octet-stream: a safetensors file, one bf16 tensor per image
                      named "0", "1", ... and __metadata__["images"] = JSON [{sha256, grid_thw, tokens,
                      cached}, ...]
    POST /v1/encode_video
                      JSON {"videos": [{"frames": [base64 image file, ...], "fps": 30.0, "duration": null}, ...],
                      "sample": true, "target_fps": 2, "max_frames": 2048, "max_duration": 0,
                      "min_image_tokens": 16, "max_image_tokens": 240000} (video.preprocess_video's settings;
                      absent or null: its default) -> 200 a safetensors file, one bf16 tensor per video and
                      __metadata__["videos"] = JSON [{grid_thw, tokens, frame_tokens, frames_indices,
                      timestamps}, ...]
    GET  /metrics     Prometheus text

Errors are JSON {"error": why, "index": the image's (or video's) position or null}: 400 malformed request, 413
too large, 415 not JSON, 422 an image that cannot be decoded (nothing of that request is encoded),
429 queue full, 503 loading or shutting down, 500 the engine failed. Decoding runs on a thread pool
and the engine on the batcher's threads: the event loop never blocks on either.
"""

from __future__ import annotations

import asyncio
import binascii
import dataclasses
import functools
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ImageError
from ..preprocessing.image import prepare_canvas
from ..preprocessing.video import plan_video
from ..preprocessing.video_files import FrameFiles, VideoFile
from . import vllm_ec
from .batcher import Batcher, QueueFull
from .cache import EmbeddingCache
from .metrics import Metrics
from .requests import Refused, b64decode, decode_frames, parse_images, parse_videos, read_body


@dataclass
class Settings:
    checkpoint: str                 # the checkpoint's identity in cache keys
    capacity_tokens: int = 8000
    max_wait_ms: float = 5.0
    cache_mib: float = 1024.0
    max_queue: int = 256            # images waiting for a forward pass
    max_body_mib: float = 256.0
    max_image_mib: float = 64.0
    max_pixels: int | None = None
    max_video_pixels: int = 2**32   # a video's sampled frames' pixels together (decoding stops short of more)
    decode_workers: int = 8
    vllm_ec_dir: str | None = None


def create_app(load_backend, settings: Settings) -> Starlette:
    """The service; load_backend() builds the Backend, on a thread, while /health answers 503."""
    metrics = Metrics()
    cache = EmbeddingCache(int(settings.cache_mib * 2**20))
    state = {"status": "loading", "backend": None, "batcher": None, "error": None}
    pool = ThreadPoolExecutor(settings.decode_workers, thread_name_prefix="glmvit-decode")

    def on_pass(images, tokens, seconds):
        metrics.passes.inc()
        metrics.tokens.inc(tokens)
        metrics.pass_images.observe(images)
        metrics.pass_fill.observe(tokens / settings.capacity_tokens)
        metrics.pass_seconds.observe(seconds)

    def load():
        try:
            backend = load_backend()
            state["batcher"] = Batcher(backend, capacity_tokens=settings.capacity_tokens,
                                       max_wait_s=settings.max_wait_ms / 1e3, max_queue=settings.max_queue,
                                       on_pass=on_pass)
            state["backend"], state["status"] = backend, "ok"
        except Exception as e:  # reported by /health and every request
            state["status"], state["error"] = "failed", f"{type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=load, name="glmvit-load", daemon=True).start()
        yield
        state["status"] = "stopping"
        if state["batcher"] is not None:
            await asyncio.get_running_loop().run_in_executor(None, state["batcher"].stop)
        pool.shutdown(wait=False, cancel_futures=True)

    def not_ready() -> str:
        why = {"loading": "the model is still loading", "stopping": "the server is shutting down"}
        return why.get(state["status"], f"the model failed to load ({state['error']})")

    async def health(request):
        if state["status"] != "ok":
            return JSONResponse({"status": state["status"], "error": not_ready()}, status_code=503)
        b = state["backend"]
        return JSONResponse({"status": "ok", "geometry": dataclasses.asdict(b.geometry), "backend": b.name,
                             "capacity_tokens": settings.capacity_tokens, "queue_depth": state["batcher"].depth})

    async def metrics_text(request):
        if state["batcher"] is not None:
            metrics.queue.set(state["batcher"].depth)
        metrics.cache_bytes.set(cache.bytes)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def endpoint(handle):
        """A POST endpoint: handle(request)'s response, a Refused as its JSON error, anything else a 500 (the
        engine failed, out of memory say: the server stays up); counted and timed."""
        async def run(request):
            t0 = time.perf_counter()
            try:
                response = await handle(request)
            except Refused as e:
                response = JSONResponse({"error": e.error, "index": e.index}, status_code=e.status)
            except Exception as e:
                response = JSONResponse({"error": f"encoding failed ({type(e).__name__}: {e})", "index": None},
                                        status_code=500)
            metrics.requests.labels(str(response.status_code)).inc()
            metrics.latency.observe(time.perf_counter() - t0)
            return response
        return run

    async def json_body(request) -> bytes:
        """The request's body, or Refused: the model not ready (503), not JSON (415), too large (413)."""
        if state["status"] != "ok":
            raise Refused(503, not_ready())
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise Refused(415, f"Content-Type {kind or 'none'!r}: send application/json")
        return await read_body(request, int(settings.max_body_mib * 2**20))

    def split_hits(keys):
        """({i: the cache's entry for keys[i] or None}, {key: the first index that needs encoding}): a key
        repeated in one request is encoded once."""
        hits = {i: cache.get(k) for i, k in enumerate(keys)}
        todo = {}
        for i, k in enumerate(keys):
            if hits[i] is None:
                todo.setdefault(k, i)
        return hits, todo

    async def on_pool(calls: dict, failed) -> list:
        """{request index: a call} run on the decoding pool, results in order; the first failure a 422 naming
        its index (an ImageError or ValueError, counted in `failed`), anything else raised as it is."""
        loop = asyncio.get_running_loop()
        got = await asyncio.gather(*[loop.run_in_executor(pool, c) for c in calls.values()], return_exceptions=True)
        for i, g in zip(calls, got):
            if isinstance(g, BaseException):
                failed.inc()
                if isinstance(g, (ImageError, ValueError)):
                    raise Refused(422, str(g), i)
                raise g
        return got

    def queued(submit):
        """submit()'s futures, or Refused: 429 when the queue is full, 503 once shutting down."""
        try:
            return submit()
        except QueueFull as e:
            raise Refused(429 if state["status"] == "ok" else 503, str(e)) from None

    async def hand_to_vllm(keys, out):
        if settings.vllm_ec_dir:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    pool, lambda: [vllm_ec.write(settings.vllm_ec_dir, k, out[str(i)]) for i, k in enumerate(keys)])
            except OSError as e:  # a full disk, the folder gone: the request fails, saying where
                raise Refused(500, f"the embeddings were computed, but writing them to the vLLM encoder cache "
                                   f"{settings.vllm_ec_dir} failed: {e}") from None

    async def _encode(request):
        images, lo, hi = parse_images(await json_body(request), settings.capacity_tokens)
        blobs = []
        for i, text in enumerate(images):
            try:
                data = b64decode(text)
            except (binascii.Error, ValueError) as e:
                raise Refused(400, f"images[{i}] is not valid base64 ({e})", i) from None
            if len(data) > settings.max_image_mib * 2**20:
                raise Refused(413, f"images[{i}] is {len(data)} bytes, over the {settings.max_image_mib:g} MiB limit "
                                   "per image", i)
            blobs.append(data)
        shas = [vllm_ec.key_of(d) for d in blobs]
        keys = [(sha, lo, hi, settings.checkpoint) for sha in shas]
        hits, todo = split_hits(keys)
        backend = state["backend"]
        patching = backend.patching()  # once a request (main refused towers whose patches are not RGB)
        prepared = await on_pool({i: functools.partial(_prepare, blobs[i], i, lo, hi, settings.max_pixels,
                                                       backend.resize, patching) for i in todo.values()},
                                 metrics.images.labels("failed"))
        futures = queued(lambda: state["batcher"].submit(list(prepared)))
        encoded = dict(zip(todo, await asyncio.gather(*futures)))
        grids = {k: item[1] for k, item in zip(todo, prepared)}
        out, meta = {}, []
        for i, k in enumerate(keys):
            if hits[i] is not None:
                emb, grid = hits[i]
                metrics.cache_hits.inc()
                metrics.images.labels("cached").inc()
            else:
                emb, grid = encoded[k], grids[k]
                cache.put(k, emb, grid)
                metrics.images.labels("encoded").inc()
            out[str(i)] = emb
            meta.append({"sha256": shas[i], "grid_thw": list(grid), "tokens": int(emb.shape[0]),
                         "cached": hits[i] is not None})
        await hand_to_vllm(shas, out)
        from safetensors.numpy import save

        return Response(save(out, metadata={"images": json.dumps(meta)}), media_type="application/octet-stream")

    async def _encode_video(request):
        """Frames decoded and videos sampled on the pool; their resize (on the GPU where images are) and passes
        run as one task on a lane's thread, between image passes (the engine is one thread's). A video's key
        (vllm_ec.video_key_of: its frame files and settings) finds it in the cache and names its vLLM file."""
        videos, common = parse_videos(await json_body(request))
        decode_frames(videos, settings.max_image_mib)
        keys = [vllm_ec.video_key_of(v["frames"] or [v["file"]], v["fps"], v["duration"], common) for v in videos]
        hits, todo = split_hits([(k, settings.checkpoint) for k in keys])
        backend = state["backend"]
        patching = backend.patching()
        args = (common, settings.max_pixels, settings.max_video_pixels, patching)
        done = await on_pool({i: functools.partial(_prepare_video, videos[i], i, *args) for i in todo.values()},
                             metrics.videos.labels("failed"))
        for i, got in zip(todo.values(), done):
            if got[2]["frame_tokens"] > settings.capacity_tokens:
                metrics.videos.labels("failed").inc()
                raise Refused(422, f"video {i}: a group of {patching.temporal_patch_size} frames is "
                                   f"{got[2]['frame_tokens']} tokens, over the server's capacity of "
                                   f"{settings.capacity_tokens} tokens per pass; lower max_image_tokens", i)
        embs = []
        if todo:
            embs = await queued(lambda: state["batcher"].submit_task(lambda lane: backend.encode_video_on(lane, done)))
            metrics.tokens.inc(sum(int(e.shape[0]) for e in embs))
        encoded = {k: (emb, {"grid_thw": list(info["grid"]), "tokens": info["tokens"],
                             "frame_tokens": info["frame_tokens"], "frames_indices": info["frames_indices"],
                             "timestamps": info["timestamps"]}) for k, emb, (_, _, info) in zip(todo, embs, done)}
        out, meta = {}, []
        for i, k in enumerate(keys):
            emb, m = hits[i] if hits[i] is not None else encoded[(k, settings.checkpoint)]
            if hits[i] is None:
                cache.put((k, settings.checkpoint), emb, m)
            else:
                metrics.cache_hits.inc()
            metrics.videos.labels("encoded" if hits[i] is None else "cached").inc()
            out[str(i)] = emb
            meta.append({"key": k, **m, "cached": hits[i] is not None})
        await hand_to_vllm(keys, out)
        from safetensors.numpy import save

        return Response(save(out, metadata={"videos": json.dumps(meta)}), media_type="application/octet-stream")

    routes = [Route("/health", health), Route("/metrics", metrics_text),
              Route("/v1/encode", endpoint(_encode), methods=["POST"]),
              Route("/v1/encode_video", endpoint(_encode_video), methods=["POST"])]
    offered = ", ".join(f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}" for r in routes)

    async def http_error(request, exc):  # a wrong path or method: JSON, as every other error a client gets
        hint = f"; this server has {offered}" if exc.status_code in (404, 405) else ""
        return JSONResponse({"error": f"{request.method} {request.url.path}: {str(exc.detail).lower()}{hint}",
                             "index": None}, status_code=exc.status_code, headers=exc.headers)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.glmvit = state
    app.state.metrics = metrics
    return app


def _prepare(data: bytes, index: int, lo: int, hi: int, max_pixels, resize: str, patching):
    return prepare_canvas(io.BytesIO(data), index, min_image_tokens=lo, max_image_tokens=hi, max_pixels=max_pixels,
                          resize=resize, patching=patching)


def _prepare_video(video: dict, index: int, common: dict, max_pixels, max_total_pixels, patching):
    """One request video -> video.plan_video's (frames, grid, info): sampled first, then only the sampled
    frames decoded (frame files as images are, a video file by PyAV; what cannot be is an ImageError naming
    it); the backend makes their pixels."""
    source = (VideoFile(video["file"], max_total_pixels) if video["file"] is not None else
              FrameFiles(video["frames"], max_pixels, max_total_pixels))
    return plan_video(source, index, fps=video["fps"], duration=video["duration"], patching=patching, **common)
