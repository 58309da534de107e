"""JPEG files on disk -> embeddings on the host, images/s and GPU busy, beside HF transformers 5.23.0
(its PIL processor + the eager bf16 model) in the same run, on the same random official-geometry weights.

    python benchmarks/bench_e2e.py [--images 48] [--budgets 8000,1024] [--no-hf] [--no-gpu-decode]

A seeded folder of JPEG photos, 0.5-12 megapixels, mixed aspect ratios. Rows: HF; ours encode() from one
thread with host resize (Pillow), with GPU resize (the default), with GPU decode (nvImageCodec, when
installed); glmvit-encode on the 48 files and on 4 hard-linked copies of them (the median of 3 fresh processes). GPU busy: NVML utilisation sampled every 100 ms while the row runs. Also
checks that GPU resize gives the host path's embeddings bit for bit, and measures the GPU decoder's drift.
"""

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import hf_model_or_none, official_checkpoint, table  # noqa: E402

FRESH = 3  # glmvit-encode runs a row, each a fresh process


def make_photos(folder, n, seed=0):
    """n JPEGs of 0.5-12 MP: smooth colour fields with edges and sensor-like noise, quality 90."""
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        mp = 0.5 + 11.5 * (i / max(1, n - 1))
        aspect = [4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4, 2 / 3][i % 6]
        w = int(round((mp * 1e6 * aspect) ** 0.5))
        h = int(round(mp * 1e6 / w))
        path = os.path.join(folder, f"photo_{i:02d}_{w}x{h}.jpg")
        if not os.path.exists(path):
            small = rng.integers(0, 256, (max(2, h // 64), max(2, w // 64), 3), dtype=np.uint8)
            img = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)).astype(np.int16)
            img = img + rng.integers(-12, 13, img.shape, dtype=np.int16)
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(path)
    return paths


class Busy:
    """GPU utilisation (NVML, via nvidia-smi) sampled every 100 ms while the block runs: the mean in %."""

    def __enter__(self):
        self.samples, self.stop = [], threading.Event()
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "-lms", "100", "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                                     stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line))

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=1)

    @property
    def mean(self):
        return float(np.mean(self.samples)) if self.samples else float("nan")


def main():
    n = int(sys.argv[sys.argv.index("--images") + 1]) if "--images" in sys.argv else 48
    budgets = [int(b) for b in sys.argv[sys.argv.index("--budgets") + 1].split(",")] if "--budgets" in sys.argv \
        else [8000, 1024]
    use_hf = "--no-hf" not in sys.argv
    from glmvit_cupy import GlmVit

    folder = os.path.join(tempfile.gettempdir(), "glmvit_e2e_photos")
    paths = make_photos(folder, n)
    copies = []  # the same photos under other names (glmvit-encode keys images by path)
    for k in range(4):
        os.makedirs(os.path.join(folder, f"copy{k}"), exist_ok=True)
        for p in paths:
            q = os.path.join(folder, f"copy{k}", os.path.basename(p))
            if not os.path.exists(q):
                os.link(p, q)
            copies.append(q)
    size = sum(os.path.getsize(p) for p in paths)
    print(f"{n} JPEGs in {folder}: {size / 2**20:.0f} MiB; {os.cpu_count()} CPUs")
    ckpt = official_checkpoint()
    model = GlmVit.from_checkpoint(ckpt, capacity_tokens=8000)
    gpu_decode = "--no-gpu-decode" not in sys.argv
    try:
        from glmvit_cupy.preprocessing.gpu_decode import Decoder
        Decoder()
    except Exception as e:
        print("GPU decode rows skipped:", e)
        gpu_decode = False
    hf = hf_model_or_none(ckpt, "HF rows") if use_hf else None
    if hf is not None:
        import torch
        from transformers.image_utils import load_image
        from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    rows, drift_rows = [], []
    for budget in budgets:
        def ours(**kw):
            return [o.get() for o in model.encode(paths, max_image_tokens=budget, **kw)]

        modes = [("ours encode(), host resize", dict(resize="host")), ("ours encode(), GPU resize", dict(resize="gpu"))]
        if gpu_decode:
            modes.append(("ours encode(), GPU resize + GPU decode", dict(resize="gpu", decode="gpu")))
        outs = {}
        for name, kw in modes:
            ours(**kw)  # warm: kernels, plans and graphs of these shapes, threads
            with Busy() as busy:
                t = time.perf_counter()
                outs[name] = ours(**kw)
                dt = time.perf_counter() - t
            rows.append([budget, name, f"{n / dt:.1f}", f"{busy.mean:.0f}%"])
        same = all(np.array_equal(a.view(np.uint16), b.view(np.uint16))
                   for a, b in zip(outs[modes[0][0]], outs[modes[1][0]]))
        rows.append([budget, "GPU resize embeddings == host resize's, bit for bit", "yes" if same else "NO", ""])
        if gpu_decode:
            name = modes[2][0]
            rel = [float(np.linalg.norm(a.astype(np.float32) - b.astype(np.float32)) /
                         np.linalg.norm(b.astype(np.float32))) for a, b in zip(outs[name], outs[modes[1][0]])]
            drift_rows.append([budget, "embedding rel L2, GPU decode vs Pillow decode", f"max {max(rel):.2e}",
                               f"mean {np.mean(rel):.2e}"])
        # glmvit-encode, a fresh process: on the 48 files (its start-up, threads, pinned blocks, first
        # forwards of new shapes, all inside the time), and on 4 hard-linked copies of them (192 files).
        # A fresh process's figure spreads by ~15% from run to run: the median of FRESH runs, each listed.
        for label, files in (("glmvit-encode (GPU resize)", paths), (f"glmvit-encode, {4 * n} files", copies)):
            got, failure = [], None
            for _ in range(FRESH):
                with tempfile.TemporaryDirectory() as out:
                    cmd = [sys.executable, "-m", "glmvit_cupy.cli.main", *files, "--checkpoint", ckpt, "--out", out,
                           "--max-image-tokens", str(budget)]
                    run = subprocess.run(cmd, capture_output=True, text=True,
                                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
                    m = re.search(r"\(([\d.]+) images/s", run.stdout + run.stderr)
                    if not m:
                        failure = f"failed: {run.stderr[-300:]}"
                        break
                    got.append(float(m.group(1)))
            rows.append([budget, f"{label}, median of {FRESH} fresh processes",
                         failure or f"{np.median(got):.1f} ({', '.join(f'{g:.1f}' for g in got)})", ""])
        if hf is not None:
            proc_b = Glm5NextImageProcessorPil(max_image_tokens=budget)

            def hf_one(p):
                feat = proc_b(images=load_image(p), return_tensors="pt")
                with torch.no_grad():
                    o = hf(hidden_states=feat["pixel_values"].to("cuda", torch.bfloat16),
                           grid_thw=feat["image_grid_thw"].to("cuda"))
                return o.pooler_output.float().cpu().numpy()

            for p in paths[:2]:
                hf_one(p)
            with Busy() as busy:
                t = time.perf_counter()
                for p in paths:
                    hf_one(p)
                dt = time.perf_counter() - t
            rows.append([budget, "HF transformers (PIL processor + eager bf16)", f"{n / dt:.1f}", f"{busy.mean:.0f}%"])
    table(["token budget", "path", "images/s", "GPU busy"], rows)
    if gpu_decode:
        from glmvit_cupy.preprocessing.decode import load_rgb

        dec, mx, mean = Decoder(), [], []
        for p in paths:
            a, b = load_rgb(p).astype(np.int16), dec.decode(p)
            if b is None or b.shape != a.shape:
                continue
            d = np.abs(a - b)
            mx.append(int(d.max())), mean.append(float(d.mean()))
        drift_rows.append(["-", "pixels, GPU decode vs Pillow (libjpeg-turbo)", f"max {max(mx)}", f"mean {np.mean(mean):.3f}"])
        print()
        table(["token budget", "GPU decode drift", "max", "mean"], drift_rows)


if __name__ == "__main__":
    main()
