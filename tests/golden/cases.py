"""The image zoo and tower geometry shared by make_golden.py and the tests.

Every image is made deterministically here (PNG/GIF/TIFF are lossless, so a file
written here decodes to the same pixels anywhere); the one JPEG is committed.
"""

import os

import numpy as np
from PIL import Image

from glmvit_cupy.config import VisionGeometry

HERE = os.path.dirname(os.path.abspath(__file__))
TOWER_DIR = os.path.join(HERE, "tower")
OUTPUTS = os.path.join(HERE, "hf_outputs.npz")
PREPROCESS = os.path.join(HERE, "hf_preprocess.json")
PHOTO = os.path.join(HERE, "..", "..", "examples", "grace_hopper.jpg")

# A small tower with the official head_dim of 64: depth 2, hidden 128, 2 heads.
GEOMETRY = VisionGeometry(depth=2, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=256,
                          projection_intermediate_size=512)
SEED = 1234


def _noise(h, w, c=3, seed=0, dtype=np.uint8, hi=256):
    rng = np.random.default_rng(seed)
    return rng.integers(0, hi, (h, w, c) if c else (h, w), dtype=dtype)


def _smooth(h, w, seed=0):
    """A smooth picture with some texture: resampling differences show up in it."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    r = 127 + 120 * np.sin(xx / max(w, 1) * 7 + seed) * np.cos(yy / max(h, 1) * 5)
    g = 127 + 120 * np.cos((xx + yy) / max(h + w, 1) * 9 + seed)
    b = (xx * 3 + yy * 5 + seed * 17) % 256
    img = np.stack([r, g, b], axis=-1)
    img += np.random.default_rng(seed).normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def png_folder(folder, *sizes):
    """`folder` made, holding a.png, b.png, ... of these (h, w) sizes (_smooth pictures, seeds 1, 2, ...)."""
    import pathlib

    from PIL import Image

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True)
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(_smooth(h, w, i + 1)).save(folder / f"{chr(ord('a') + i)}.png")
    return folder


def images(tmpdir):
    """{name: image input} — PIL images, arrays and file paths of every awkward kind."""
    z = {}
    z["rgb_1x1"] = Image.fromarray(_noise(1, 1, seed=1))
    z["rgb_27x29"] = Image.fromarray(_noise(27, 29, seed=2))
    z["rgb_1x4000"] = Image.fromarray(_noise(1, 4000, seed=3))
    z["rgb_4000x1"] = Image.fromarray(_noise(4000, 1, seed=4))
    z["rgb_5000x3000"] = Image.fromarray(_smooth(5000, 3000, seed=5))
    z["rgb_3000x5000_max1000"] = (Image.fromarray(_smooth(3000, 5000, seed=6)), {"max_image_tokens": 1000})
    z["rgb_28x28"] = Image.fromarray(_noise(28, 28, seed=7))
    z["rgb_56x56_exact"] = Image.fromarray(_smooth(56, 56, seed=8))
    z["rgb_300x200_min300"] = (Image.fromarray(_smooth(300, 200, seed=9)), {"min_image_tokens": 300})
    z["rgb_20x30_min0"] = (Image.fromarray(_noise(20, 30, seed=25)), {"min_image_tokens": 0})  # no upscale
    z["rgb_900x700_min0_max100"] = (Image.fromarray(_smooth(900, 700, seed=26)),
                                    {"min_image_tokens": 0, "max_image_tokens": 100})
    z["gray_L"] = Image.fromarray(_noise(90, 70, c=0, seed=10))
    rgba = _noise(64, 96, c=4, seed=11)
    z["rgba"] = Image.fromarray(rgba, "RGBA")
    z["la"] = Image.fromarray(_noise(50, 40, c=2, seed=12), "LA")
    pal = Image.fromarray(_noise(70, 45, c=0, seed=13)).convert("P")
    pal.info["transparency"] = 7
    z["palette_transparent"] = pal
    z["palette"] = Image.fromarray(_smooth(80, 120, seed=14)).convert("P", palette=Image.Palette.ADAPTIVE)
    z["cmyk"] = Image.fromarray(_noise(60, 61, c=4, seed=15), "CMYK")
    z["i16"] = Image.fromarray(_noise(40, 50, c=0, seed=16, dtype=np.uint16, hi=65536))
    z["array_rgb"] = _smooth(123, 77, seed=17)
    z["array_rgba"] = _noise(33, 90, c=4, seed=18)
    # Files, loaded by path: the reference EXIF-transposes and converts to RGB (no alpha composite).
    gif = os.path.join(tmpdir, "animated.gif")
    frames = [Image.fromarray(_noise(45, 60, seed=20 + k)).convert("P") for k in range(3)]
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=50, loop=0)
    z["gif_animated_path"] = gif
    z["gif_animated_pil"] = Image.open(gif)
    png = os.path.join(tmpdir, "rgba.png")
    Image.fromarray(rgba, "RGBA").save(png)
    z["png_rgba_path"] = png
    tif = os.path.join(tmpdir, "oriented.tiff")
    im = Image.fromarray(_smooth(64, 100, seed=21))
    exif = im.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    im.save(tif, exif=exif)
    z["tiff_exif_rotated_path"] = tif
    z["photo_jpeg_path"] = os.path.abspath(PHOTO)
    # A transparent palette index or colour (GIF, PNG tRNS) survives convert("RGB") in the image's info, and
    # the reference composites it onto white: loaded by path, as by a PIL image.
    gif_t = os.path.join(tmpdir, "transparent.gif")
    pal_t = Image.fromarray(_smooth(66, 90, seed=22)).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    pal_t.save(gif_t, transparency=int(np.asarray(pal_t)[10, 10]))
    z["gif_transparent_path"] = gif_t
    png_pt = os.path.join(tmpdir, "palette_trns.png")
    pal_t.save(png_pt, transparency=int(np.asarray(pal_t)[30, 40]))
    z["png_palette_trns_path"] = png_pt
    png_rgbt = os.path.join(tmpdir, "rgb_trns.png")
    rgb_t = _noise(40, 52, seed=23) // 64 * 64  # few colours, so the transparent one covers many pixels
    Image.fromarray(rgb_t).save(png_rgbt, transparency=tuple(int(v) for v in rgb_t[0, 0]))
    z["png_rgb_trns_path"] = png_rgbt
    png_lt = os.path.join(tmpdir, "grey_trns.png")
    grey_t = _noise(37, 45, c=0, seed=24) // 32 * 32
    Image.fromarray(grey_t).save(png_lt, transparency=int(grey_t[0, 0]))
    z["png_grey_trns_path"] = png_lt
    return z


def tower_cases():
    """{name: list of (image, kwargs)} for the tower's golden outputs: three sizes and one batch."""
    a = Image.fromarray(_smooth(100, 150, seed=30))
    b = Image.fromarray(_smooth(140, 90, seed=31))
    c = Image.fromarray(_smooth(64, 64, seed=32))
    return {"img_100x150": [a], "img_140x90": [b], "img_64x64": [c], "batch_abc": [a, b, c]}


def overflowing_tower(folder, seed: int = 5) -> str:
    """A checkpoint of GEOMETRY whose weights are finite but overflow the forward: its merger's down_proj is
    scaled to near bf16's largest value, so every embedding holds infinities (and NaN)."""
    import ml_dtypes

    from glmvit_cupy.checkpoint.synthetic import random_tower, write_checkpoint

    tensors = random_tower(GEOMETRY, seed)
    w = tensors["merger.down_proj.weight"].astype(np.float32)
    tensors["merger.down_proj.weight"] = (w * np.float32(1e38)).astype(ml_dtypes.bfloat16)
    assert np.isfinite(tensors["merger.down_proj.weight"].astype(np.float32)).all()
    return write_checkpoint(folder, GEOMETRY, seed=seed, tensors=tensors)
