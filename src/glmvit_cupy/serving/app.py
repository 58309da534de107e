"""The HTTP contract of glmvit-serve (Starlette).

    GET  /health      200 {"status": "ok", "geometry": {...}, ...}; 503 while loading, failed or draining
    POST /v1/encode   JSON {"images": [base64, ...], "min_image_tokens": 16, "max_image_tokens": 8000}
                      (base64 plain, wrapped, URL-safe or a data URL; a limit absent or null: its default;
                      any other field: 400), or one image file as the body (image/* or application/
                      octet-stream), its limits in the query: ?min_image_tokens=16&max_image_tokens=8000
                      -> 200 application/octet-stream: a safetensors file, one bf16 tensor per image
                      named "0", "1", ... and __metadata__["images"] = JSON [{sha256, key, grid_thw,
                      tokens, cached}, ...]
    POST /v1/encode_video
                      JSON {"videos": [{"frames": [base64 image file, ...], "fps": 30.0, "duration": null}, ...],
                      "sample": true, "target_fps": 2, "max_frames": 2048, "max_duration": 0,
                      "min_image_tokens": 16, "max_image_tokens": 240000} (video.preprocess_video's settings;
                      absent or null: its default) -> 200 a safetensors file, one bf16 tensor per video and
                      __metadata__["videos"] = JSON [{key, grid_thw, tokens, frame_tokens,
                      frames_indices, timestamps, cached}, ...]
    GET  /metrics     Prometheus text

Errors are JSON {"error": why, "index": the image's (or video's) position or null}: 400 malformed request, 408
the body too slow, 413 too large (a body, an image file, more images than the queue holds, more pixels than
--max-pixels-in-flight), 415 neither JSON nor an image file, 409 something in the way of one image's (or video's)
vLLM file (the others are written), 422 an image that cannot be decoded (nothing of that request is encoded),
429 the queue or the pixels in flight full now, 501 a video file on a server without PyAV, 503 loading or
shutting down, 500 the engine failed, or the vLLM folder refused the writes.

A request is admitted before any image of it is decoded: its images counted against the queue's room, then
their pixels, read from the files' headers, against the pixels in flight; only then are they decoded, on
the Decoders' threads (requests in turn; decoding.py), and queued for the batcher's passes. The event loop
never blocks on either. The same content in flight is encoded once (flights.py): a request finds an image
(or video) another request is encoding and waits for that result. Work whose every client went away is
dropped before its pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import json
import re
import threading
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass

from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import vllm_ec
from ..checks import embedding_problem
from ..errors import ImageError, OutputError, quoted
from ..preprocessing import decode
from .batcher import Batcher, Budget, Decoders, QueueFull
from .cache import EmbeddingCache
from .decoding import (LARGE_IMAGE_PIXELS, OffProcess, dims, have_pyav, header_size, pixels_held, prepare_image,
                       prepare_video, quiet_libtiff, video_pixels)
from .flights import Flights
from .metrics import Metrics
from .requests import (BODY_LIMIT, LIMIT_FIELDS, Refused, decode_frames, decoded, image_file_limits,
                       parse_images, parse_videos, read_body)

@dataclass
class Settings:
    checkpoint: str                 # the checkpoint's identity in cache keys
    capacity_tokens: int = 8000
    max_wait_ms: float = 1.0
    cache_mib: float = 1024.0
    max_queue: int = 256            # images waiting for a forward pass
    max_body_mib: float = 256.0
    max_bodies_in_flight_mib: float = 1024.0  # bodies of requests in flight, from arrival to answer, together
    max_image_mib: float = 64.0
    max_reply_mib: float = 1024.0   # one request's embeddings, repeats included
    max_pixels: int | None = None   # one image's pixels (None: Pillow's MAX_IMAGE_PIXELS)
    max_video_pixels: int = 2**32   # a video's sampled frames' pixels together (decoding stops short of more)
    max_pixels_in_flight: int = 2**28  # pixels of images and videos admitted and not yet through their passes
    body_timeout: float = 60.0      # seconds a body may take to arrive after its headers
    decode_workers: int = 8
    vllm_ec_dir: str | None = None
    weights: str | None = None      # the tower's fingerprint (TowerBinding.fingerprint), set at load for vllm_ec
    shares: str | None = None       # with HTTP workers: the file of the server-wide budgets (shares.py)
    slot: int = 0                   # and this worker's row in it


# The scope of the request an endpoint is answering (its tasks inherit it): where its hold on the bodies in
# flight is kept.
REQUEST_SCOPE: contextvars.ContextVar = contextvars.ContextVar("glmvit_request_scope")


class Releasing:
    """A response that calls release() once it has been sent, or has failed to be."""

    def __init__(self, response: Response, release):
        self.response, self.release = response, release

    async def __call__(self, scope, receive, send):
        try:
            await self.response(scope, receive, send)  # returns once it is in the transport's buffer
            self.response = None  # the buffer holds a copy: the body goes now
            # Held until the kernel has taken it all (or the connection was aborted, which empties the buffer:
            # --reply-timeout); http_server.py's protocol puts the transport in the scope.
            transport = scope.get("glmvit.transport")
            try:
                wait = 0.001  # doubling to 50 ms: a budget held 50 ms past a 6 MiB reply's send refused the next
                while transport is not None and transport.get_write_buffer_size() > 0:
                    await asyncio.sleep(wait)
                    wait = min(2 * wait, 0.05)
            except asyncio.CancelledError:  # a drain that ran out closes the connection: nothing failed here
                pass
        finally:
            self.release()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


JSON = "application/json"
IMAGE_FILE = "application/octet-stream"  # or any image/*: a body that is one image file
# Work on fewer bytes than these runs on the event loop, where a hop to a thread and back costs more than
# the work: a reply (a 1 MB one is made in ~0.1 ms), a body to parse (base64 of 256 KiB: ~1 ms), a
# request's image headers (a file's chunks can take ~0.1 ms a KiB).
INLINE_REPLY, INLINE_BODY, INLINE_HEADERS = 4 << 20, 256 << 10, 64 << 10
_JSON_START = re.compile(rb"\s*[{\[]")  # matched at a body's start: whitespace, then an object or array


def create_app(load_backend, settings: Settings) -> Starlette:
    """The service; load_backend() builds the Backend, on a thread, while /health answers 503."""
    quiet_libtiff()  # a client's damaged TIFF writes nothing to the server's log
    metrics = Metrics()
    cache = EmbeddingCache(int(settings.cache_mib * 2**20))
    state = {"status": "loading", "backend": None, "batcher": None, "error": None, "in_flight": 0}
    decoders = Decoders(settings.decode_workers)
    parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="glmvit-parse")
    # One process a decoding thread: a thread waiting on a busy process would hold up the small images that
    # the large-image rule keeps a thread free for.
    off_process = OffProcess(settings.decode_workers)
    state["off_process"] = off_process  # main ends its processes on a second signal
    budget_bytes = int(settings.max_bodies_in_flight_mib * 2**20)  # bytes of bodies held by requests
    if settings.shares is None:
        budget, bodies = Budget(settings.max_pixels_in_flight), Budget(budget_bytes)
    else:  # with HTTP workers both are the server's, held across its workers (POSIX: flock)
        from .shares import Shares, SharedBudget

        held = Shares(settings.shares)
        budget = SharedBudget(held, settings.slot, "pixels", settings.max_pixels_in_flight)
        bodies = SharedBudget(held, settings.slot, "bodies", budget_bytes)
    limit = settings.max_pixels if settings.max_pixels is not None else Image.MAX_IMAGE_PIXELS
    flights = Flights(cache, lambda: state["batcher"])  # content being encoded now, by key

    def loaded(backend):
        # An engine in another process (serving/remote.py) brings its own queue; a backend here gets a Batcher.
        state["batcher"] = getattr(backend, "batcher", None) or Batcher(
            backend, capacity_tokens=settings.capacity_tokens, max_wait_s=settings.max_wait_ms / 1e3,
            max_queue=settings.max_queue, on_pass=lambda times: metrics.record_pass(times, settings.capacity_tokens),
            on_drop=metrics.record_drop, on_busy=lambda lane, seconds: metrics.engine_busy.inc(seconds))
        state["backend"] = backend
        if state["status"] == "loading":  # not when a SIGTERM came first: the server is draining
            state["status"] = "ok"

    def failed(e: Exception):  # reported by /health and every request; glmvit-serve logs it and exits
        state["status"], state["error"] = "failed", f"{type(e).__name__}: {e}"

    def load():
        try:
            loaded(load_backend())
        except Exception as e:
            failed(e)

    async def load_async():
        try:
            loaded(await load_backend())
        except Exception as e:
            failed(e)

    @asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        now = asyncio.Event()
        state["stop_now"] = lambda: loop.call_soon_threadsafe(now.set)  # a second signal (http_server.py)
        if asyncio.iscoroutinefunction(load_backend):  # an engine process to connect to (serving/remote.py)
            loading = asyncio.ensure_future(load_async())
            if getattr(load_backend, "at_start", False):  # the engine is loaded: ready before the first request
                await asyncio.shield(loading)
        else:
            threading.Thread(target=load, name="glmvit-load", daemon=True).start()
        offload, decode.offload = decode.offload, off_process
        yield
        if asyncio.iscoroutinefunction(load_backend):
            loading.cancel()
        state["status"] = "stopping"
        try:
            if state["batcher"] is not None:  # the passes finish, unless a second signal stops the wait
                # On a daemon thread, not the loop's executor, whose threads the loop's close waits for.
                stopped = loop.create_future()

                if state["batcher"].busy:
                    state.get("log", lambda message: None)(
                        "finishing the forward passes running and queued (a second signal: stop now)")

                def stop_batcher():  # a pass is never cut short: the process cannot exit under a running one
                    state["batcher"].stop()
                    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                        loop.call_soon_threadsafe(lambda: stopped.done() or stopped.set_result(None))

                threading.Thread(target=stop_batcher, name="glmvit-stop", daemon=True).start()
                forced = asyncio.ensure_future(now.wait())
                await asyncio.wait({stopped, forced}, return_when=asyncio.FIRST_COMPLETED)
                forced.cancel()
        except asyncio.CancelledError:  # cancelled by uvicorn's forced exit: stop now
            pass
        finally:
            decoders.shutdown()
            parser.shutdown(wait=False, cancel_futures=True)
            decode.offload = offload
            off_process.shutdown()

    def gauges() -> None:
        if state["batcher"] is not None:
            metrics.queue.set(state["batcher"].depth)
        metrics.cache_bytes.set(cache.bytes)
        metrics.pixels.set(budget.own)  # the gauge sums every worker's

    if metrics.shared:  # with HTTP workers, /metrics reads every worker's gauges: set on each tick (http_server.py)
        state["gauges"] = gauges

    def not_ready() -> str:
        why = {"loading": "the model is still loading", "stopping": "the server is shutting down"}
        return why.get(state["status"], f"the model failed to load ({state['error']})")

    async def health(request):
        if state["status"] != "ok":
            return JSONResponse({"status": state["status"], "error": not_ready()}, status_code=503)
        b = state["backend"]
        return JSONResponse({"status": "ok", "geometry": dataclasses.asdict(b.geometry), "backend": b.name,
                             "capacity_tokens": settings.capacity_tokens, "queue_depth": state["batcher"].depth,
                             "pixels_in_flight": budget.used})

    async def metrics_text(request):
        gauges()
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def endpoint(handle):
        """A POST endpoint: handle(request)'s response, a Refused as its JSON error, a client gone before its
        answer as 499 (nobody reads it; counted), anything else a 500 (the engine failed, out of memory say:
        the server stays up); counted, timed, and counted in flight while it runs (SIGTERM waits for them)."""
        async def run(request):
            t0 = time.perf_counter()
            state["in_flight"] += 1
            REQUEST_SCOPE.set(request.scope)
            stamps = request.scope["glmvit.stamps"] = []  # stamp(): the request's parts, as each ends
            try:
                try:
                    response = await handle(request)
                except Refused as e:  # a body too slow or too large: the rest is not read, and the connection closes
                    response = JSONResponse({"error": e.error, "index": e.index}, status_code=e.status,
                                            headers={"Connection": "close"} if e.close else None)
                    if e.status in (409, 500):  # the server's own failure (a write, the model): the operator is told
                        state.get("log", lambda message: None)(f"{request.url.path}: {e.status}: {e.error}")
                except (ClientGone, ClientDisconnect):
                    # 499: nobody reads the answer; or the HTTP layer's own, for a body that is not HTTP (400)
                    response = Response(status_code=request.scope.get("glmvit.answered", 499))
                except asyncio.CancelledError:  # the drain ran out, or a second signal: a short answer, no traceback
                    response = JSONResponse({"error": "the server stopped before this request was answered "
                                             "(its --drain-timeout ran out, or a second signal stopped it); send it "
                                             "again to a running server",
                                             "index": None}, status_code=503, headers={"Connection": "close"})
                except Exception as e:
                    response = JSONResponse({"error": f"encoding failed ({type(e).__name__}: {e})", "index": None},
                                            status_code=500)
                    state.get("log", lambda message: None)(
                        f"{request.url.path}: 500: encoding failed:\n{traceback.format_exc().rstrip()}")
            finally:
                state["in_flight"] -= 1
                bodies.give(request.scope.pop("glmvit.body_bytes", 0))
            metrics.requests.labels(str(response.status_code)).inc()
            t1 = time.perf_counter()
            metrics.latency.observe(t1 - t0)
            if response.status_code == 200:
                metrics.record_request(t0, stamps, t1)
            held = request.scope.pop("glmvit.reply_bytes", 0)
            if held and response.status_code == 200:
                return Releasing(response, lambda: bodies.give(held))
            bodies.give(held)
            return response
        return run

    async def json_body(request) -> list:
        """[the request's body] (JSON), or Refused: see kind_of and body_of."""
        kind_of(request, (JSON,))
        return await body_of(request)

    def kind_of(request, kinds: tuple) -> str:
        """The request's Content-Type, or Refused: the model not ready (503), a Content-Type not in `kinds`
        (415), a query string that gives a JSON request's limits (400: they are fields of its body)."""
        if state["status"] != "ok":
            raise Refused(503, not_ready())
        given = sorted({v.split(";")[0].strip().lower() for v in request.headers.getlist("content-type")})
        if len(given) > 1:  # one would be read and the body taken for it: which one is meant?
            raise Refused(400, f"Content-Type given as {' and '.join(quoted(k, 80) for k in given)}: send one "
                               "Content-Type header")
        kind = given[0] if given else ""
        if kind not in kinds and not (IMAGE_FILE in kinds and kind.startswith("image/")):
            raise Refused(415, f"{f'Content-Type {kind!r}' if kind else 'no Content-Type'}: send " + (
                "application/json, or one image file as image/* or application/octet-stream" if IMAGE_FILE in kinds
                else "application/json"))
        # Every Content-Encoding header, as one list (RFC 9110 5.3): a second one naming gzip is not left unread.
        coding = ", ".join(v.strip() for v in request.headers.getlist("content-encoding")).lower() or "identity"
        if coding not in ("", "identity"):  # read as it came, a gzip body would be refused as non-ASCII
            raise Refused(415, f"Content-Encoding {quoted(coding)}: send the body uncompressed (identity)")
        if kind == JSON:
            given = sorted({k for k, _ in request.query_params.multi_items()} & set(LIMIT_FIELDS))
            if given:  # other parameters (a cache-buster, say) are left alone
                raise Refused(400, f"{', '.join(given)} in the query string of a JSON request: give "
                                   f"{'them' if len(given) > 1 else 'it'} as fields of the body")
        return kind

    async def body_of(request, limit: int | None = None, over: tuple = BODY_LIMIT) -> list:
        """[the request's body], or Refused: over `limit` bytes (--max-body-mib unless smaller; 413), more than
        the bodies in flight have room for now (429), too slow (408). Its bytes are held in `bodies` until the
        request is answered (endpoint gives them back); the list lets the parser drop the body."""
        most = int(settings.max_body_mib * 2**20)
        body = await read_body(request, most if limit is None else min(limit, most), settings.body_timeout, bodies,
                               over if limit is not None and limit < most else BODY_LIMIT)
        request.scope["glmvit.body_bytes"] = len(body)
        return [body]

    async def parse(read, held: list):
        """read(held) on the parsing thread (a body of up to INLINE_BODY here): one body at a time, so
        that only one is expanded into Python strings and decoded bytes at once (about 3x its size); JSON
        parsing holds the interpreter, so two bodies on two threads would be no faster."""
        if len(held[0]) <= INLINE_BODY:
            return read(held)
        return await asyncio.get_running_loop().run_in_executor(parser, read, held)

    async def unless_gone(request, work):
        """The value of the coroutine `work`, run as a task; ClientGone once the client disconnects first: the
        task is cancelled, and what it queued that no other request waits for is dropped before its pass."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server gave up on this request (shutdown past its time)
            gone.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        gone.cancel()
        if task.done():
            try:
                return task.result()
            finally:
                # A refusal re-raised here would otherwise keep `task` (and through its traceback the request's
                # files and decoded images) in a cycle until the garbage collector next runs: hundreds of MB
                # past the limits that counted them as let go.
                del task
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()

    # -- admission ---------------------------------------------------------------------------------------

    def reserve_queue(n: int, what: str) -> None:
        """Room for n images (or tasks) in the batcher's queue, or Refused: 413 never, 429 not now, 503
        shutting down."""
        try:
            state["batcher"].reserve(n, what)
        except QueueFull as e:
            status = 503 if state["status"] != "ok" or "shutting down" in str(e) else 413 if e.ever else 429
            raise Refused(status, str(e)) from None

    def take_pixels(total: int, what: str, icons: int = 0) -> None:
        """Hold `total` pixels for a request's images or videos, or Refused; icons: how many of its images (or
        its videos' frames) are ICO files, which count as --max-pixels each (their headers may understate them)."""
        of = "them" if what == "images" else "their frames"
        note = (f" ({icons} of {of} ICO files, counted at --max-pixels, {limit:,} pixels, each: their headers "
                "need not say what they hold; send them as PNG)") if icons else ""
        if total > budget.total:
            raise Refused(413, f"this request's {what} need {total:,} pixels decoded and resized at once{note}, over "
                               f"the {budget.total:,} the server holds in flight (--max-pixels-in-flight): send fewer "
                               f"or smaller {what} a request, or lower their max_image_tokens")
        if not budget.take(total):
            raise Refused(429, f"{budget.used:,} of the {budget.total:,} pixels the server holds in flight "
                               f"(--max-pixels-in-flight) are taken, and this request's {what} need {total:,}"
                               f"{note}: retry later")

    def decode_failures(indices, results, failed):
        """The first failure of a request's decoding jobs as a 422 naming its index (an ImageError or
        ValueError), anything else raised as it is (a Refused: the server shutting down cut a decode short).
        Every job that failed counts in `failed`, not only the first."""
        failed.inc(sum(isinstance(g, BaseException) and not isinstance(g, Refused) for g in results))
        for i, g in zip(indices, results):
            if isinstance(g, Refused):
                raise Refused(g.status, g.error, i, g.close)
            if isinstance(g, BaseException):
                if isinstance(g, (ImageError, ValueError)):
                    raise Refused(422, str(g), i)
                raise g

    async def hand_to_vllm(keys, out, what: str) -> bool:
        """The embeddings written for vLLM (with --vllm-ec-dir), checked first; True if they were (checked). Something
        in the way of one key (vllm_ec.InTheWay: a file or folder not the cache's own, a key's folder this user may
        not write) blocks that key alone: the others are written, then a 409 names the first image (or video) it
        blocked. A failure of the folder itself (a full disk, the folder gone) stops the writes: a 500."""
        if not settings.vllm_ec_dir:
            return False
        blocked: dict = {}  # key: (the first index of it, why)

        def write():
            _check_finite(out, what)  # nothing unusable reaches vLLM
            done: set = set()
            try:
                for i, k in enumerate(keys):
                    if k in done or k in blocked:  # a repeat in the request: one file
                        continue
                    try:
                        vllm_ec.write(settings.vllm_ec_dir, k, out[str(i)], settings.weights)
                        done.add(k)
                    except vllm_ec.InTheWay as e:
                        blocked[k] = (i, str(e))
            finally:
                metrics.vllm_files.labels("written").inc(len(done))
                metrics.vllm_files.labels("blocked").inc(len(blocked))
                metrics.vllm_files.labels("failed").inc(len(set(keys)) - len(done) - len(blocked))

        try:
            await asyncio.get_running_loop().run_in_executor(None, write)
        except (OSError, OutputError) as e:  # a full disk, the folder gone: the request fails, saying where
            raise Refused(500, f"the embeddings were computed, but writing them to the vLLM encoder cache "
                               f"{settings.vllm_ec_dir} failed: {e}") from None
        if blocked:
            (i, why), *more = sorted(blocked.values())
            also = ""
            if more:
                named = ", ".join(f"{what}[{j}]" for j, _ in more[:5]) + (", ..." if len(more) > 5 else "")
                also = f"; so is the file of {len(more)} more of this request's {what} ({named})"
            others = f"the files of the request's other {what} are written; " if len(blocked) < len(set(keys)) else ""
            raise Refused(409, f"{what}[{i}]: its embedding is computed, but its file in the vLLM encoder cache cannot "
                               f"be written: {why}{also}; {others}send the request again once the server's operator "
                               "has cleared the way (with the cache on, it is not encoded again)", i)
        return True

    async def reply(out: dict, what: str, meta: list, checked: bool = False) -> Response:
        """The embeddings as one safetensors file, made on a thread past INLINE_REPLY (512 MiB take 2.5 s on a
        2-core machine), after checking them for NaN and infinity unless hand_to_vllm did (`checked`);
        a reply over --max-reply-mib is refused (413) before it is made: a small request repeating one
        image at a large token count would otherwise make a reply thousands of times its size."""
        size = sum(a.nbytes for a in out.values())
        if size > settings.max_reply_mib * 2**20:
            raise Refused(413, f"the reply would hold {size / 2**20:,.1f} MiB ({size:,} bytes) of embeddings for {len(out)} {what}, over "
                               f"the server's limit of {settings.max_reply_mib:g} MiB a reply (--max-reply-mib): send "
                               f"fewer {what} a request, or a lower max_image_tokens")
        # The reply takes the request body's place in the bodies in flight until it is sent (endpoint).
        scope = REQUEST_SCOPE.get()
        bodies.give(scope.pop("glmvit.body_bytes", 0))
        if not bodies.take(size):
            raise Refused(429, f"the request and reply bodies the server holds ({bodies.used / 2**20:,.1f} MiB) leave no "
                               f"room for this reply's {size / 2**20:,.1f} MiB within the limit of "
                               f"{bodies.total / 2**20:g} MiB (--max-bodies-in-flight-mib): retry shortly (with the "
                               "cache on, what was encoded is not encoded again)")
        scope["glmvit.reply_bytes"] = size
        from safetensors.numpy import save

        def made():
            if not checked:  # also for an embedding the cache kept: it fails every request that asks
                _check_finite(out, what)
            return save(out, metadata={what: json.dumps(meta)})

        body = made() if size <= INLINE_REPLY else await asyncio.get_running_loop().run_in_executor(None, made)
        return Response(body, media_type="application/octet-stream")

    # -- images ------------------------------------------------------------------------------------------

    async def _encode(request):
        # Parsing and base64 take about 0.9 s for a 240 MiB body on a 2-core machine: on a thread, the event loop
        # keeps answering other requests (and /health) meanwhile.
        if kind_of(request, (JSON, IMAGE_FILE)) == JSON:
            blobs, shas, lo, hi = await parse(read_images, await body_of(request))
        else:  # one image file: its limits and size are checked before it is read
            lo, hi = image_file_limits(request.query_params.multi_items(), settings.capacity_tokens)
            held = await body_of(request, int(settings.max_image_mib * 2**20),
                                 ("images[0]", "limit per image (--max-image-mib): send a smaller image", 0))
            blobs, shas = await parse(read_image_file, held)
        stamp("read")
        return await unless_gone(request, encode_images(blobs, shas, lo, hi))

    def read_image_file(held: list):
        """([the body's image file], [its sha256]) of a request whose body is one image file, or Refused."""
        data = bytes(held.pop())
        if not data:
            raise Refused(400, "the body is empty: send one image file (or JSON, as application/json)", 0)
        # A JSON request sent as a file, unless Pillow reads an image's header there: a TGA has no magic
        # number, and its first byte (the length of its ID field) may be "{" or "[".
        if _JSON_START.match(data) and header_size(data)[0] == 0:
            raise Refused(415, "the body is JSON, sent as an image file: send JSON as application/json", 0)
        return [data], [vllm_ec.key_of(data)]

    def read_images(held: list):
        """(image files, their sha256, min and max tokens) of the request body in `held`, or Refused; on the
        parsing thread. The body, then each image's base64 text, is let go as soon as it is read."""
        images, lo, hi = parse_images(held.pop(), settings.capacity_tokens, settings.max_queue)
        if len(images) > settings.max_queue:  # counted before anything is decoded
            raise Refused(413, f"this request has {len(images)} images, more than the server's queue ever holds "
                               f"({settings.max_queue}, --max-queue): send at most {settings.max_queue} a request")
        blobs = []
        for i, text in enumerate(images):
            images[i] = None
            data = decoded(text, f"images[{i}]", i, "the image file's bytes")
            if not data:  # "data:image/png;base64," or "====": no bytes once decoded
                raise Refused(400, f"images[{i}] is empty: give each image as its file's bytes in base64", i)
            if len(data) > settings.max_image_mib * 2**20:
                raise Refused(413, f"images[{i}] is {len(data):,} bytes, over the {settings.max_image_mib:g} MiB limit "
                                   "per image (--max-image-mib)", i)
            blobs.append(data)
        return blobs, [vllm_ec.key_of(d) for d in blobs], lo, hi

    async def encode_images(blobs, shas, lo, hi):
        keys = [(sha, lo, hi, settings.checkpoint) for sha in shas]
        first = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        backend = state["backend"]
        patching = backend.patching()  # once a request (main refused towers whose patches are not RGB)

        def encoded(f, emb):
            metrics.images.labels("encoded").inc()

        async def queue_own(own, held):
            """Decode this request's own images and queue them, admitted first: room in the queue, then their
            pixels (from the files' headers) in flight; each image's pixels are held until its pass ends."""
            idx = [first[k] for k in own]
            reserve_queue(len(own), "images")
            pixels, queued = 0, False
            try:
                if sum(len(blobs[i]) for i in idx) <= INLINE_HEADERS:  # an ICO or ICNS counts as --max-pixels
                    heads = [header_size(blobs[i], limit) for i in idx]
                else:
                    heads = await asyncio.get_running_loop().run_in_executor(
                        None, lambda: [header_size(blobs[i], limit) for i in idx])
                need = []
                for i, (n, size) in zip(idx, heads):
                    if n > limit:
                        metrics.images.labels("failed").inc()
                        raise Refused(422, f"images[{i}] has {dims(n, size)} pixels, over the server's limit of "
                                           f"{limit:,} an image (--max-pixels): refused as a possible decompression "
                                           "bomb; send a smaller image", i)
                    need.append(pixels_held(n, size, lo, hi, patching))
                icons = sum(size is None and decode.is_ico(blobs[i]) for i, (_, size) in zip(idx, heads))
                take_pixels(sum(need), "images", icons)
                pixels = sum(need)
                prepared = await decoders.run(
                    [(functools.partial(prepare_image, blobs[i], i, lo, hi, limit, backend, patching),
                      n > LARGE_IMAGE_PIXELS) for i, (n, _) in zip(idx, heads)])
                decode_failures(idx, prepared, metrics.images.labels("failed"))
                kept = [min(n, item[0].shape[0] * item[0].shape[1]) for n, item in zip(need, prepared)]
                budget.give(pixels - sum(kept))  # an image holds its prepared pixels until its pass ends
                pixels = sum(kept)
                futures = state["batcher"].submit(prepared, reserved=True)
                queued = True
                stamp("decode")
            finally:
                if not queued:
                    state["batcher"].unreserve(len(own))
                    budget.give(pixels)
            for k, fut, item, n in zip(own, futures, prepared, kept):
                fut.add_done_callback(lambda _, n=n: budget.give(n))
                flights.queued_as([held[k]], fut, lambda emb, grid=item[1]: [(emb, grid)], encoded)

        got, how = await flights.gather(list(first), queue_own)
        stamp("engine")
        out, meta, seen = {}, [], set()
        for i, k in enumerate(keys):
            emb, grid = got[k]
            outcome = how[k] if k not in seen or how[k] == "cached" else "shared"  # a repeat: its first one's
            seen.add(k)
            if outcome == "cached":
                metrics.cache_hits.inc()
            if outcome != "encoded":  # an encode is counted once, when its pass ends
                metrics.images.labels(outcome).inc()
            out[str(i)] = emb
            meta.append({"sha256": shas[i], "key": vllm_ec.key_for_image(shas[i], lo, hi), "grid_thw": list(grid),
                         "tokens": int(emb.shape[0]), "cached": outcome != "encoded"})
        checked = await hand_to_vllm([m["key"] for m in meta], out, "images")
        return await reply(out, "images", meta, checked)

    # -- videos ------------------------------------------------------------------------------------------

    async def _encode_video(request):
        """Frames decoded and videos sampled on the decoding threads; their resize (on the GPU where images
        are) and passes run as one task on a lane's thread, between image passes (the engine is one thread's).
        A video's key (vllm_ec.video_key_of: its frame files or video file, and settings) finds it in the cache and names its
        vLLM file."""
        videos, common, keys = await parse(read_videos, await json_body(request))
        return await unless_gone(request, encode_videos(videos, common, keys))

    def read_videos(held: list):
        """(videos, their settings, their keys) of the request body in `held`, frames decoded from base64, or
        Refused; on the parsing thread, as read_images."""
        videos, common = parse_videos(held.pop())
        for i, v in enumerate(videos):
            if v["file"] is not None and not have_pyav():
                raise Refused(501, f"videos[{i}] is a video file, and this server cannot decode video files (PyAV, "
                                   "the video extra, is not installed on it); send the video's frames instead, as "
                                   "image files: {\"frames\": [base64 image file, ...], \"fps\": frames a second}", i)
        decode_frames(videos, settings.max_image_mib)
        # Here, on the parsing thread as an image's sha256 is: hashing a request's frames (500,000 of them, or a
        # 256 MiB file) on the event loop would hold every other request for about a second.
        keys = [vllm_ec.video_key_of(v["frames"] or [v["file"]], v["fps"], v["duration"], common,
                                     kind="frames" if v["frames"] else "file") for v in videos]
        return videos, common, keys

    async def encode_videos(videos, common, keys):
        first = {}
        for i, k in enumerate(keys):
            first.setdefault((k, settings.checkpoint), i)
        backend = state["backend"]
        patching = backend.patching()

        def encoded(f, emb):
            metrics.videos.labels("encoded").inc()
            metrics.tokens.inc(int(emb.shape[0]))

        async def queue_own(own, held):
            idx = [first[k] for k in own]
            reserve_queue(1, "tasks")
            pixels, queued = 0, False
            try:
                icons: list = []
                # On the decoding threads, in turn with other requests' work (a file of millions of tiny packets
                # takes minutes to scan), and stopped once every client of it has gone.
                stop = threading.Event()
                try:
                    (need,) = await decoders.run([(lambda: [
                        video_pixels(videos[i], i, common, limit, settings.max_video_pixels, patching, icons, stop)
                        for i in idx], True)], on_cancel=stop.set)
                    if isinstance(need, BaseException):
                        raise need
                except Refused:  # a frame over --max-pixels: the video failed, as one its decode refuses
                    metrics.videos.labels("failed").inc()
                    raise
                take_pixels(sum(need), "videos", len(icons))
                pixels = sum(need)
                args = (common, limit, settings.max_video_pixels, patching)
                done = await decoders.run([(functools.partial(prepare_video, videos[i], i, *args, stop), True)
                                           for i in idx], on_cancel=stop.set)
                decode_failures(idx, done, metrics.videos.labels("failed"))
                for i, got in zip(idx, done):
                    if got[2]["frame_tokens"] > settings.capacity_tokens:
                        metrics.videos.labels("failed").inc()
                        raise Refused(422, f"video {i}: a group of {patching.temporal_patch_size} frames is "
                                           f"{got[2]['frame_tokens']} tokens, over the server's capacity of "
                                           f"{settings.capacity_tokens} tokens per pass; lower max_image_tokens", i)

                job = state["batcher"].submit_videos(done, reserved=True)
                queued = True
            finally:
                if not queued:
                    state["batcher"].unreserve(1)
                    budget.give(pixels)
            job.add_done_callback(lambda _: budget.give(pixels))
            about = [{"grid_thw": list(info["grid"]), "tokens": info["tokens"], "frame_tokens": info["frame_tokens"],
                      "frames_indices": info["frames_indices"], "timestamps": info["timestamps"]}
                     for _, _, info in done]
            flights.queued_as([held[k] for k in own], job, lambda embs: list(zip(embs, about)), encoded)

        got, how = await flights.gather(list(first), queue_own)
        out, meta, seen = {}, [], set()
        for i, k in enumerate(keys):
            ck = (k, settings.checkpoint)
            emb, m = got[ck]
            outcome = how[ck] if ck not in seen or how[ck] == "cached" else "shared"
            seen.add(ck)
            if outcome == "cached":
                metrics.cache_hits.inc()
            if outcome != "encoded":
                metrics.videos.labels(outcome).inc()
            out[str(i)] = emb
            meta.append({"key": k, **m, "cached": outcome != "encoded"})
        checked = await hand_to_vllm(keys, out, "videos")
        return await reply(out, "videos", meta, checked)

    routes = [Route("/health", health), Route("/metrics", metrics_text),
              Route("/v1/encode", endpoint(_encode), methods=["POST"]),
              Route("/v1/encode_video", endpoint(_encode_video), methods=["POST"])]
    offered = ", ".join(f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}" for r in routes)

    async def http_error(request, exc):  # a wrong path or method: JSON, as every other error a client gets
        hint = f"; this server has {offered}" if exc.status_code in (404, 405) else ""
        path = request.url.path if len(request.url.path) <= 200 else quoted(request.url.path, 200)  # not 50 KB back
        return JSONResponse({"error": f"{request.method} {path}: {str(exc.detail).lower()}{hint}",
                             "index": None}, status_code=exc.status_code, headers=exc.headers)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.router.redirect_slashes = False  # /v1/encode/ is a 404 naming the paths, not a redirect built from Host
    app.state.glmvit = state
    app.state.metrics = metrics
    app.state.pixels = budget
    return _QuietForcedExit(_OneFraming(app, {r.path for r in routes if "POST" in r.methods}))


class _OneFraming:
    """The app, for requests whose body is framed one way: one with both Transfer-Encoding and Content-Length
    (h11 takes the chunked body; a proxy in front may have taken the length and read the rest as another
    request: smuggling) is answered 400, on any path, and its connection closed (RFC 9112 6.3)."""

    def __init__(self, app, counted: set):
        self.app, self.state, self.counted = app, app.state, counted  # counted: the encoders' paths (their metric)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"transfer-encoding" in names and b"content-length" in names:
                if scope["path"] in self.counted and scope["method"] == "POST":
                    self.state.metrics.requests.labels("400").inc()
                response = JSONResponse({"error": "the request has both Transfer-Encoding and Content-Length; a body "
                                         "is framed by one of them", "index": None},
                                        status_code=400, headers={"Connection": "close"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class _QuietForcedExit:
    """The app, whose lifespan ends quietly when a second signal stops the server at once: uvicorn's forced
    exit never sends the lifespan's shutdown and cancels it instead, which Starlette reports as a failed
    shutdown with a CancelledError traceback, though nothing failed."""

    def __init__(self, app):
        self.app, self.state = app, app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def quiet(message):
            if message["type"] == "lifespan.shutdown.failed" and \
                    message.get("message", "").rstrip().endswith("CancelledError"):
                return
            await send(message)

        try:
            await self.app(scope, receive, quiet)
        except asyncio.CancelledError:
            pass


async def _disconnected(receive) -> None:
    """Returns once the client has disconnected (called after the body was read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def stamp(part: str) -> None:
    """Marks the end of a part of the current request (metrics.REQUEST_PARTS)."""
    REQUEST_SCOPE.get()["glmvit.stamps"].append((part, time.perf_counter()))


def _check_finite(out: dict, what: str) -> None:
    """Refused (500, naming the image or video) when an embedding holds NaN or infinity: the checkpoint's
    weights overflow the forward for it (checks.embedding_problem)."""
    for i, emb in out.items():
        problem = embedding_problem(emb, f"{what}[{i}]")
        if problem is not None:
            raise Refused(500, problem, int(i))
