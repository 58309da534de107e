"""Random images through the GPU model: encode(images), with the resize on the GPU and on the host, each
bit-equal to encode_pixels(*preprocess(image)). The small golden tower; random sizes (1 to ~3,500 px a side),
modes, files (PNG, JPEG, GIF) and PIL objects, three token minimums (0 among them) and four maximums. Prints each mismatch and a count.

    python tools/fuzz_gpu_resize.py [seed] [count]      e.g. 11 400: ~20 s on the H200"""
import os, sys, tempfile, time
import numpy as np
from PIL import Image
sys.path[:0] = ["src", "."]
from glmvit_cupy import GlmVit
from glmvit_cupy import preprocess
from tests.golden import cases

m = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=8000)
rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
N = int(sys.argv[2]) if len(sys.argv) > 2 else 80
tmp = tempfile.mkdtemp()
MODES = ["RGB", "RGBA", "L", "LA", "P", "Pt", "CMYK", "I;16"]
bad, t0, groups = 0, time.time(), 0
batch = []
for i in range(N):
    side = lambda: int(np.exp(rng.uniform(0, np.log(3500))))
    h, w = side(), side()
    mode = MODES[rng.integers(len(MODES))]
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    if mode == "Pt":
        img = img.convert("P"); img.info["transparency"] = int(rng.integers(256))
    elif mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
    else:
        img = img.convert(mode)
    f = rng.integers(4)
    item = img
    if f == 1 and mode != "CMYK":
        p = os.path.join(tmp, f"{i}.png"); img.save(p); item = p
    elif f == 2 and mode in ("RGB", "L", "CMYK"):
        p = os.path.join(tmp, f"{i}.jpg"); img.save(p, quality=int(rng.integers(30, 100))); item = p
    elif f == 3 and mode == "Pt":
        p = os.path.join(tmp, f"{i}.gif"); img.save(p); item = p
    batch.append(item)
    if len(batch) == 4 or i == N - 1:
        hi = int(rng.choice([64, 300, 1000, 2000]))
        lo = int(rng.choice([0, 16, 300]))  # 0: no minimum (small images stay small)
        want = [m.encode_pixels(*preprocess([x], min_image_tokens=lo, max_image_tokens=hi)).get() for x in batch]
        for resize in ("gpu", "host"):
            got = [o.get() for o in m.encode(batch, min_image_tokens=lo, max_image_tokens=hi, resize=resize, workers=3)]
            for x, a, b in zip(batch, got, want):
                if a.shape != b.shape or not np.array_equal(a.view(np.uint16), b.view(np.uint16)):
                    bad += 1
                    print("MISMATCH", resize, lo, hi, x if isinstance(x, str) else (x.mode, x.size), a.shape, b.shape)
        groups += 1
        batch = []
print(f"GPU resize fuzz: {N} images in {groups} batches x 2 resize modes, mismatches {bad}, {time.time() - t0:.0f} s")
