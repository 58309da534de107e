"""Shared helpers for the GPU benchmark scripts: CUDA-event timing, FLOP counts, official weights."""

import functools
import os
import subprocess
import tempfile
import threading
import time

import numpy as np

PEAK_BW = 4.8e12       # H200 HBM3e, bytes/s (datasheet)
GEMM_CEIL = 756e12     # the bf16 GEMM ceiling we rate against: 8192^3 on the H200 (our runs: 777-801)


def _median_ms(fn, sync, events, elapsed, warmup, repeat, idle_s=0.0):
    """Median milliseconds of fn() between a pair of CUDA events, after warmup calls and a sync;
    idle_s > 0: the GPU left idle that long before each timed call (a call that starts cool)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        if idle_s:  # the previous call has finished (synchronised below, or before the loop)
            time.sleep(idle_s)
        a, b = events()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(elapsed(a, b))
    return float(np.median(times))


def time_ms(fn, warmup=3, repeat=10, idle_s=0.0):
    """Median milliseconds of fn() between CUDA events on CuPy's current stream."""
    import cupy

    return _median_ms(fn, cupy.cuda.get_current_stream().synchronize, lambda: (cupy.cuda.Event(), cupy.cuda.Event()),
                      cupy.cuda.get_elapsed_time, warmup, repeat, idle_s)


def torch_ms(fn, warmup=3, repeat=10, idle_s=0.0):
    """time_ms for torch work: median milliseconds between CUDA events on torch's current stream."""
    import torch

    def events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    return _median_ms(fn, torch.cuda.synchronize, events, lambda a, b: a.elapsed_time(b), warmup, repeat, idle_s)


class ClockSampler:
    """The SM clock (MHz), board power (W) and the active clock event reasons of the current GPU, sampled
    by nvidia-smi every ~50 ms while the `with` block runs: medians in .mhz and .watts, the highest power
    in .peak_watts, and .reasons {reason: share of samples it was active in}; None / {} where nvidia-smi
    is absent or failed. Why: the H200 lowers its SM clock under dense bf16 GEMMs, and a sustained figure
    is read beside the clock it ran at and what the driver says held the clock down (NVML's
    clocks_event_reasons: the software power cap, hardware slowdown, thermal, ...)."""

    FIELDS = ("clocks.sm,power.draw.instant,clocks_event_reasons.active", "clocks.sm,power.draw")
    REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
               0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks"}

    def __init__(self, period_s=0.05):
        import cupy

        self.period_s, self.bus = period_s, cupy.cuda.Device().pci_bus_id
        self.samples, self.mhz, self.watts, self.peak_watts, self.reasons = [], None, None, None, {}

    def _poll(self):
        fields = self.FIELDS[0]
        while not self._stop.is_set():
            cmd = ["nvidia-smi", "-i", self.bus, f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
                values = [v.strip() for v in r.stdout.strip().split(",")]
                if r.returncode != 0 or len(values) != fields.count(",") + 1:
                    raise ValueError(r.stderr or r.stdout)
                self.samples.append((float(values[0]), float(values[1]),
                                     int(values[2], 16) if len(values) > 2 else None))
            except (OSError, ValueError, subprocess.SubprocessError):
                if fields == self.FIELDS[-1]:
                    return
                fields = self.FIELDS[-1]  # an older driver: no instant power or event reasons
                continue
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.samples:
            self.mhz, self.watts = (float(np.median([s[i] for s in self.samples])) for i in (0, 1))
            self.peak_watts = max(s[1] for s in self.samples)
            masks = [s[2] for s in self.samples if s[2] is not None]
            self.reasons = {name: sum(bool(m & bit) for m in masks) / len(masks)
                            for bit, name in self.REASONS.items() if masks and any(m & bit for m in masks)}
        return False

    def joules(self, ms: float) -> str:
        """The energy of one call of `ms` milliseconds at the median power sampled ("" without samples): at the
        700 W cap a call's time is this energy over the cap, so it is what a faster forward must save."""
        return "" if self.watts is None else f"{self.watts * ms / 1e3:.2f}"

    def __str__(self):
        if self.mhz is None:
            return ""
        reasons = ", ".join(f"{name} {share:.0%}" for name, share in self.reasons.items())
        return f"{self.mhz:.0f} MHz, {self.watts:.0f} W (peak {self.peak_watts:.0f})" + (f"; {reasons}" if reasons else "")


# A one-thread kernel that keeps its stream busy for `ns` nanoseconds (the GPU's global timer).
_HOLD = r"""
extern "C" __global__ void hold(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


@functools.cache
def _hold_kernel():
    import cupy

    return cupy.RawKernel(_HOLD, "hold")


def kernel_ms(fn, stream_ptr=None, warmup=3, batches=5, per_batch=10, hold_ms=20.0):
    """Median milliseconds per fn() as the GPU runs it: each batch of `per_batch` calls is queued
    behind a kernel that holds the stream for `hold_ms`, so the calls run back to back and the host's
    launch time (Python, argument packing: tens of microseconds) is not counted; a kernel's
    throughput, as a replayed CUDA graph sees it. `stream_ptr`: the stream fn() launches on (torch's
    current stream for torch work; default CuPy's current stream)."""
    import cupy

    stream = cupy.cuda.ExternalStream(stream_ptr) if stream_ptr else cupy.cuda.get_current_stream()
    hold = _hold_kernel()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(batches):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        hold((1,), (1,), (np.uint64(hold_ms * 1e6),), stream=stream)
        a.record(stream)
        for _ in range(per_batch):
            fn()
        b.record(stream)
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) / per_batch)
    return float(np.median(times))


def forward_flop(geo, grids):
    """Linear layers + attention + merger FLOP of one forward (2 FLOP a multiply-add; attention 4 n^2 hidden)."""
    h, i, out, pi = geo.hidden_size, geo.intermediate_size, geo.out_hidden_size, geo.projection_intermediate_size
    n = sum(t * hh * ww for t, hh, ww in grids)
    lin = 2 * n * geo.depth * (4 * h * h + 3 * h * i) + 2 * n * geo.patch_dim * h
    attn = sum(t * geo.depth * 4 * (hh * ww) ** 2 * h for t, hh, ww in grids)
    merger = 2 * (n // 4) * (4 * h * out + out * out + 3 * out * pi)
    return lin + attn + merger


def official_checkpoint():
    """A random-weight checkpoint of the official geometry, written once per machine."""
    from glmvit_cupy.config import VisionGeometry
    from glmvit_cupy.checkpoint.synthetic import cached_checkpoint

    return cached_checkpoint(os.path.join(tempfile.gettempdir(), "glmvit_official_seed11"),
                             VisionGeometry.official(), seed=11)


def hf_model_or_none(path, what="HF columns"):
    """HF transformers' bf16 model of the checkpoint at `path` on the GPU (tests/hf_bar.py), or None after
    printing why it cannot run here."""
    from tests import hf_bar

    why = hf_bar.available()
    if why:
        print(f"{what} skipped:", why)
        return None
    from glmvit_cupy.checkpoint.bind import bind_tower

    return hf_bar.hf_model(bind_tower(path))


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
