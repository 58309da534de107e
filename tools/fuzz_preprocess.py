"""Random images through HF transformers' Glm5NextImageProcessorPil and ours: pixel_values bit-equal, grids
equal, refusals alike. Seeded; prints each mismatch and a count. Needs transformers 5.23.0 (its PIL processor
runs without torch) beside this checkout; no GPU.

    python tools/fuzz_preprocess.py [seed] [count] [patch,merge,frames]   e.g. 2 400: ~15 s; 2 200 16,3,1

The third argument sets another tower's patch geometry on both sides (HF's patch_size, merge_size and
temporal_patch_size; ours glmvit_cupy.Patching); default the reference processor's 14,2,2.

Random sizes (1 to ~4,000 px a side, some 1-3 px strips), modes (RGB, RGBA, L, LA, P with and without a
transparent index, CMYK, I;16, I, F, 1, ...), alpha, files (PNG, JPEG, WebP, BMP, TIFF, GIF; some with an
EXIF orientation), PIL objects and arrays, and random token limits. Arrays whose first dimension is 1, 3 or
4 are counted apart: HF reads them channels-first (README), we read every array H x W x C."""
import hashlib, os, sys, tempfile, time
import numpy as np
from PIL import Image
sys.path[:0] = ["src", "."]
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
from glmvit_cupy import Patching, ImageError
from glmvit_cupy import preprocess

rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
N = int(sys.argv[2]) if len(sys.argv) > 2 else 150
PATCHING = Patching(*map(int, sys.argv[3].split(","))) if len(sys.argv) > 3 else Patching()
HF_PATCHING = dict(patch_size=PATCHING.patch_size, merge_size=PATCHING.merge_size,
                   temporal_patch_size=PATCHING.temporal_patch_size)
proc = Glm5NextImageProcessorPil()
MODES = ["RGB", "RGBA", "L", "LA", "P", "Pt", "CMYK", "I;16", "I", "F", "1", "YCbCr", "RGBX", "PA"]
FORMATS = ["PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF", None, None, None, "array"]
tmp = tempfile.mkdtemp()
stats = {"equal": 0, "both refused": 0, "MISMATCH": 0}
t0 = time.time()
for i in range(N):
    side = lambda: int(np.exp(rng.uniform(0, np.log(4000))))
    h, w = side(), side()
    if rng.random() < 0.1: h = int(rng.integers(1, 4))
    mode = MODES[rng.integers(len(MODES))]
    base = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    if rng.random() < 0.5:  # smooth content
        yy, xx = np.mgrid[0:h, 0:w]
        base = ((np.sin(xx / (w / 7 + 1) + i)[..., None] * 100 + 127 + yy[..., None] % 50) % 256).astype(np.uint8).repeat(3, 2)
    img = Image.fromarray(base, "RGB")
    if mode == "Pt":
        img = img.convert("P"); img.info["transparency"] = int(rng.integers(256))
    elif mode == "PA":
        img = img.convert("RGBA").convert("PA") if hasattr(Image, "PA") or True else img
    elif mode in ("I;16", "I", "F"):
        img = Image.fromarray((rng.random((h, w)) * (65535 if mode == "I;16" else 1e6)).astype(
            {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]))
    else:
        try:
            img = img.convert(mode)
        except Exception:
            pass
    if mode in ("RGBA", "LA") and rng.random() < 0.7:
        a = np.array(img); a[..., -1] = rng.integers(0, 256, a.shape[:2]); img = Image.fromarray(a, mode)
    fmt = FORMATS[rng.integers(len(FORMATS))]
    kw = {}
    if rng.random() < 0.3:
        lo = int(rng.integers(1, 600)); hi = int(rng.integers(lo, 9000)); kw = {"min_image_tokens": lo, "max_image_tokens": hi}
    item = img
    desc = f"#{i} {mode} {w}x{h} {fmt} {kw}"
    try:
        if fmt == "array":
            c = rng.integers(3)
            item = np.array(img.convert("RGB")) if c == 0 else np.array(img.convert("RGBA")) if c == 1 else \
                np.array(img.convert("L"))[..., None]
            if c == 1 and rng.random() < 0.7:
                item[..., 3] = rng.integers(0, 256, item.shape[:2])
        elif fmt is not None:
            path = os.path.join(tmp, f"{i}.{fmt.lower()}")
            save = img
            if fmt == "JPEG" and img.mode not in ("RGB", "L", "CMYK"): save = img.convert("RGB")
            if fmt == "BMP" and img.mode not in ("RGB", "L", "P", "1", "RGBA"): save = img.convert("RGB")
            if fmt == "WEBP" and (max(h, w) > 16383): save = None
            if fmt == "GIF" and img.mode not in ("P", "L", "1"): save = img.convert("P")
            if save is None: raise RuntimeError("skip")
            if rng.random() < 0.3 and fmt in ("JPEG", "TIFF", "PNG", "WEBP"):
                ex = save.getexif(); ex[0x0112] = int(rng.integers(1, 9)); save.save(path, exif=ex)
            else:
                save.save(path)
            item = path
    except Exception as e:
        if str(e) != "skip": print("  (could not write", desc, e, ")")
        item = img
    hf = ours = None
    try:
        f = proc(images=[item], return_tensors="np", **kw, **HF_PATCHING)
        hf = (hashlib.sha256(np.ascontiguousarray(f["pixel_values"], np.float32).tobytes()).hexdigest(), f["image_grid_thw"].tolist())
    except Exception as e:
        hf = ("refused", type(e).__name__, str(e)[:120])
    try:
        pv, grid = preprocess([item], **kw, patching=PATCHING)
        ours = (hashlib.sha256(np.ascontiguousarray(pv).tobytes()).hexdigest(), grid.tolist())
    except ImageError as e:
        ours = ("refused", "ImageError", str(e)[:120])
    except Exception as e:
        ours = ("CRASH", type(e).__name__, str(e)[:200])
    if hf == ours:
        stats["equal"] += 1
    elif isinstance(item, np.ndarray) and item.shape[0] in (1, 3, 4):
        stats["array with H in (1, 3, 4): HF reads it channels-first"] = stats.get("array with H in (1, 3, 4): HF reads it channels-first", 0) + 1
    elif hf[0] == "refused" and ours[0] == "refused":
        stats["both refused"] += 1
    else:
        stats["MISMATCH"] += 1
        print("MISMATCH", desc, "\n   HF  ", hf, "\n   ours", ours, flush=True)
print(f"preprocess fuzz vs HF 5.23.0 ({PATCHING}): {N} images, {stats}, {time.time() - t0:.0f} s")
