"""The service's Prometheus metrics, in a registry of its own (several apps may live in one process). With
HTTP workers (glmvit-serve --workers N) every process writes its own into PROMETHEUS_MULTIPROC_DIR
(prometheus_client's multiprocess mode) and /metrics sums them: text() says which."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


# Seconds, for parts of a pass: from tens of microseconds (a launch from a CUDA graph) to seconds.
FINE = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


# The parts of an image request in its HTTP worker, in order; each ends where the next begins.
REQUEST_PARTS = {"read": "its body received and parsed",
                 "decode": "admitted, its images decoded and handed to the engine",
                 "engine": "waiting for their passes (the engine process's round trip included)",
                 "reply": "the answer made"}


class Metrics:
    OUTCOMES = ("encoded", "cached", "shared", "failed", "dropped")

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.shared = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))  # other processes' metrics beside these
        self.requests = Counter("glmvit_requests", "Encode requests by outcome (HTTP status)", ["status"], registry=r)
        self.images = Counter("glmvit_images", "Images by outcome: encoded (a forward pass ran for it), cached (from "
                              "the cache), shared (from the encode of the same bytes in this or a concurrent "
                              "request), failed, dropped (every request for it went away before its pass)",
                              ["outcome"], registry=r)
        self.videos = Counter("glmvit_videos", "Videos by outcome: encoded, cached, shared, failed, dropped",
                              ["outcome"], registry=r)
        for outcome in self.OUTCOMES:  # listed at 0 from the start, by every process (the workers' too)
            self.images.labels(outcome)
            self.videos.labels(outcome)
        self.tokens = Counter("glmvit_tokens", "Image and video tokens encoded on the engine", registry=r)
        self.passes = Counter("glmvit_forward_passes", "Forward passes run", registry=r)
        self.pass_images = Histogram("glmvit_forward_pass_images", "Images in a forward pass", registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.pass_fill = Histogram("glmvit_forward_pass_fill", "Tokens in a forward pass over the capacity",
                                   registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
        self.pass_seconds = Histogram("glmvit_forward_pass_seconds", "Wall time of a forward pass from its launch to "
                                      "its embeddings on the host", registry=r)
        parts = ("queued: its oldest image's wait before the launch; launch: the engine thread packing, staging and "
                 "launching it; gpu: waiting for the GPU after the launch; fetch: copying the embeddings back; "
                 "resolve: readying them for their requests, each pass counted before they have them")
        self.pass_parts = Histogram("glmvit_pass_part_seconds", "A forward pass's time by part (" + parts + ")",
                                    ["part"], registry=r, buckets=FINE)
        self.pass_cpu = Histogram("glmvit_pass_thread_cpu_seconds", "CPU time the thread of a forward pass's part spent "
                                  "in it (launch: the engine thread; fetch: the completion thread); that part's "
                                  "glmvit_pass_part_seconds less this is the thread waiting (for the GIL, the driver)",
                                  ["part"], registry=r, buckets=FINE)
        self.image_parts = Histogram("glmvit_image_part_seconds", "A forward pass's time by part over its images, "
                                     "per image", ["part"], registry=r, buckets=FINE)
        self.engine_busy = Counter("glmvit_engine_busy_seconds", "Seconds the engine threads spent working: packing, "
                                   "staging and launching passes, running video tasks (never waiting for the GPU)",
                                   registry=r)
        self.queue = Gauge("glmvit_queue_depth", "Images and video tasks admitted and waiting for a forward pass "
                           "(queued, or being decoded)", registry=r, multiprocess_mode="livesum")
        self.pixels = Gauge("glmvit_pixels_in_flight", "Pixels of images and videos admitted and not yet through "
                            "their passes", registry=r, multiprocess_mode="livesum")
        self.connections = Gauge("glmvit_connections", "Open HTTP connections", registry=r,
                                 multiprocess_mode="livesum")
        self.vllm_files = Counter("glmvit_vllm_files", "Files handed to vLLM (--vllm-ec-dir), one a distinct key of a "
                                  "request, by outcome: written (there now, written or kept), blocked (something in "
                                  "the way of that key alone: the request is a 409), failed (the folder refused: the "
                                  "request is a 500)", ["outcome"], registry=r)
        for outcome in ("written", "blocked", "failed"):
            self.vllm_files.labels(outcome)
        self.cache_hits = Counter("glmvit_cache_hits", "Images and videos served from the cache", registry=r)
        self.cache_bytes = Gauge("glmvit_cache_bytes", "Bytes the cache holds: embeddings, their metadata and keys",
                                 registry=r, multiprocess_mode="livesum")
        self.latency = Histogram("glmvit_request_seconds", "Encode request latency", registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.request_parts = Histogram("glmvit_request_part_seconds", "An answered image request's time in its HTTP "
                                       "worker by part (" + ", ".join(f"{k}: {v}" for k, v in REQUEST_PARTS.items()) +
                                       "); glmvit_request_seconds less their sum is nothing", ["part"], registry=r,
                                       buckets=FINE)

    def record_pass(self, times, capacity_tokens: int) -> None:
        """One image pass's PassTimes (serving/batcher.py), from the completion thread."""
        self.passes.inc()
        self.tokens.inc(times.tokens)
        self.pass_images.observe(times.images)
        self.pass_fill.observe(times.tokens / capacity_tokens)
        self.pass_seconds.observe(times.launch + times.gpu + times.fetch)
        for part in times.PARTS:
            seconds = getattr(times, part)
            self.pass_parts.labels(part).observe(seconds)
            self.image_parts.labels(part).observe(seconds / times.images)
        for part in times.CPU_PARTS:
            self.pass_cpu.labels(part).observe(getattr(times, part + "_cpu"))

    def record_request(self, t0: float, stamps: list, t1: float) -> None:
        """An image request's parts: stamps, (part, time) as its work ends each, from t0 (received) to t1
        (answered); only a request that reached the engine has them all. A part stamped twice (images decoded
        in a second round, their first owner gone) ends at its last stamp."""
        last = dict(stamps)  # the first order of the parts, each its last time
        if list(last) != list(REQUEST_PARTS)[:-1]:
            return
        for part, t in [*last.items(), ("reply", t1)]:
            self.request_parts.labels(part).observe(t - t0)
            t0 = t

    def record_drop(self, job) -> None:
        """A job dropped before its pass (every request for it went away)."""
        if job.task is None:
            self.images.labels("dropped").inc()
        else:
            self.videos.labels("dropped").inc(getattr(job.task, "videos", 1))

    def text(self) -> bytes:
        """The Prometheus text: this registry's, or every process's where the server has HTTP workers."""
        if not self.shared:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        every = CollectorRegistry()
        multiprocess.MultiProcessCollector(every)
        return generate_latest(every)


def multiprocess_into(folder: str) -> None:
    """Metrics made from now on, in this process and the processes it starts, written into `folder`
    (prometheus_client's multiprocess mode) for /metrics to sum."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    from prometheus_client import values

    values.ValueClass = values.get_value_class()
