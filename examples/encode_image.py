#!/usr/bin/env python3
"""Encode images with the GLM-5.3-Flash vision tower.

    python examples/encode_image.py                                  # the bundled photo, random weights
    python examples/encode_image.py a.jpg b.png --checkpoint /models/GLM-5.3-Flash --save emb.safetensors

Without --checkpoint the tower has RANDOM weights of the official geometry (the embeddings are
meaningless; the shapes, the speed and the code path are real). Without a GPU (or with --cpu) the
float32 NumPy reference runs on the CPU instead: slowly, and it says so.
"""

import argparse
import logging
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # run from a checkout without installing

from glmvit_cupy import VisionGeometry, bind_tower, gpu, preprocess  # noqa: E402
from glmvit_cupy.checks import embedding_problem  # noqa: E402
from glmvit_cupy.output import shown  # noqa: E402
from glmvit_cupy.preprocessing.image import Patching, prepare  # noqa: E402

PHOTO = os.path.join(HERE, "grace_hopper.jpg")


def random_checkpoint():
    from glmvit_cupy.checkpoint.synthetic import cached_checkpoint

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(cache, "glmvit_cupy", "random-official-seed0")
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"writing a random-weight checkpoint of the official geometry to {path} (1.05 GiB, once; "
              "delete the folder to free the space)")
    return cached_checkpoint(path, VisionGeometry.official(), seed=0)


def save(path, names, arrays):
    if path.endswith(".safetensors"):  # else .npy (run() checked)
        from safetensors.numpy import save_file

        keys = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]  # one tensor an image
        save_file({k: np.ascontiguousarray(a) for k, a in zip(keys, arrays)}, path)
    else:
        np.save(path, np.concatenate(arrays).astype(np.float32))  # NumPy files cannot hold bf16
    print(f"saved {len(arrays)} embedding(s) to {shown(path)}")


def report(prog, names, arrays, path) -> int:
    """Each embedding's shape and statistics, then --save (path) if given: 0; 1 where an embedding holds NaN
    or infinity (weights that make the forward overflow), said by name, and nothing saved."""
    problems = [embedding_problem(a, shown(n)) for n, a in zip(names, arrays)]
    for n, a, problem in zip(names, arrays, problems):
        if problem is None:
            f = a.astype(np.float32)
            print(f"{shown(n)}: embeddings {a.shape} {a.dtype}, mean {f.mean():+.4f}, std {f.std():.4f}")
        else:
            print(f"{prog}: {problem}", file=sys.stderr)
    if any(problems):
        if path:
            print(f"{prog}: nothing saved to {shown(path)}", file=sys.stderr)
        return 1
    if path:
        save(path, names, arrays)
    return 0


def check_save(path):
    """--save's name and place, checked before any work: a .safetensors or .npy file name in a folder this
    process can write (files.probe_write), not a folder. ValueError saying what is wrong."""
    if not path.endswith((".safetensors", ".npy")):
        raise ValueError(f"--save {path}: use a .safetensors or .npy file name")
    if os.path.isdir(path):
        raise ValueError(f"--save {path}: is a folder; give a file name in it, e.g. {os.path.join(path, 'emb.npy')}")
    from glmvit_cupy.files import probe_write

    folder = os.path.dirname(os.path.abspath(path))
    try:
        probe_write(folder)
    except OSError as e:
        raise ValueError(f"--save {path}: cannot write in {folder} ({e.strerror}); give a file in a folder you "
                         "can write") from None


MIN_IMAGE_TOKENS = 16  # the reference processor's per-image minimum, which this example keeps


def check_max_tokens(max_image_tokens: int):
    """--max-image-tokens, checked before any work and named as the flag: ValueError saying what is wrong."""
    from glmvit_cupy.checks import TOKEN_LIMIT

    if not MIN_IMAGE_TOKENS <= max_image_tokens <= TOKEN_LIMIT:
        raise ValueError(f"--max-image-tokens {max_image_tokens} must be an integer from {MIN_IMAGE_TOKENS} (the "
                         f"fewest tokens an image is resized to, the reference processor's minimum) to {TOKEN_LIMIT:,}")


def guarded(run, argv, prog: str) -> int:
    """run(argv), or 2 with one line on stderr for a bad input, checkpoint, flag or an unusable GPU; 130 with
    one line on Ctrl-C."""
    from glmvit_cupy import GpuOutOfMemory, GpuUnavailable

    try:
        return run(argv)
    except (ValueError, OSError, GpuUnavailable, GpuOutOfMemory) as e:  # ImageError, CheckpointError: ValueErrors
        print(f"{prog}: {shown(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; nothing saved", file=sys.stderr)
        return 130
    except Exception as e:
        if type(e).__name__ != "SafetensorError":  # a write --save's check could not foresee (a full disk)
            raise
        print(f"{prog}: writing --save failed ({shown(e)})", file=sys.stderr)
        return 2


def checkpoint(path):
    """The checkpoint given, or the random-weight one, said loudly."""
    if path:
        return path
    print("!! no --checkpoint given: using RANDOM weights of the official geometry; "
          "the embeddings are meaningless, the shapes and timings are real !!")
    return random_checkpoint()


def main(argv=None) -> int:
    """0; 1 where an embedding holds NaN or infinity (weights that make the forward overflow: said, nothing
    saved); 2 with one line on stderr for a bad image, checkpoint, flag or an unusable GPU."""
    return guarded(run, argv, "encode_image.py")


def run(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("images", nargs="*", help="image files (default: the bundled photo)")
    ap.add_argument("--checkpoint", help="checkpoint folder, shard, index or Hub id (org/name: the hub extra); "
                    "default: random weights, said loudly")
    ap.add_argument("--save", help="write embeddings to a .safetensors (bf16, one tensor per image) or .npy file "
                    "(float32, all images' rows in one array, in order)")
    ap.add_argument("--cpu", action="store_true", help="use the float32 NumPy reference even if a GPU exists")
    ap.add_argument("--max-image-tokens", type=int, default=8000, help="per-image token limit (default 8000)")
    args = ap.parse_args(argv)
    check_max_tokens(args.max_image_tokens)  # said before any work, not after it
    if args.save:
        check_save(args.save)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    images = args.images or [PHOTO]
    binding = bind_tower(checkpoint(args.checkpoint))  # a bad checkpoint is said before the images are read
    why = "--cpu given" if args.cpu else gpu.problem()

    t = time.perf_counter()
    patching = Patching.of(binding.geometry)  # the checkpoint's patch size, merge and frames
    prepared = [prepare(im, i, min_image_tokens=MIN_IMAGE_TOKENS, max_image_tokens=args.max_image_tokens,
                        patching=patching)
                for i, im in enumerate(images)]
    t_pre = time.perf_counter() - t
    for _, grid, info in prepared:
        print(f"{shown(info['source'])}: {info['size'][1]}x{info['size'][0]} px -> canvas {info['canvas'][1]}x"
              f"{info['canvas'][0]}, grid {grid}, {info['tokens']} tokens")
    print(f"preprocess: {1e3 * t_pre:.1f} ms")

    if why is None:
        from glmvit_cupy import GlmVit

        model = GlmVit(binding, capacity_tokens=args.max_image_tokens)
        for _ in range(2):  # warm-up: the first call compiles kernels, the second captures a CUDA graph
            outs = model.encode(images, max_image_tokens=args.max_image_tokens)
        t = time.perf_counter()
        outs = model.encode(images, max_image_tokens=args.max_image_tokens)
        outs[-1].get()
        wall = time.perf_counter() - t
        stages = ", ".join(f"{k} {v:.2f} ms" for k, v in model.last_timing.items())
        print(f"GPU encode: {1e3 * wall:.1f} ms end to end (preprocess included); last forward: {stages}")
        arrays = [o.get() for o in outs]
    else:
        from glmvit_cupy import reference

        print(f"!! the GPU engine cannot run here: {why} !!")
        print("!! so the float32 NumPy reference runs on the CPU instead: slow (30-70 s for one photo at the "
              "official geometry on 2 cores) !!")
        pv, grid = preprocess(images, min_image_tokens=MIN_IMAGE_TOKENS, max_image_tokens=args.max_image_tokens,
                              patching=patching)
        t = time.perf_counter()
        ref = reference.encode_pixels(binding, pv, grid)
        print(f"CPU reference: {time.perf_counter() - t:.1f} s")
        splits = np.cumsum([info["tokens"] for _, _, info in prepared])[:-1]
        import ml_dtypes

        arrays = [a.astype(ml_dtypes.bfloat16) for a in np.split(ref, splits)]
    return report("encode_image.py", [info["source"] for _, _, info in prepared], arrays, args.save)


if __name__ == "__main__":
    sys.exit(main())
