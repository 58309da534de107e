"""glmvit-encode: images from files, folders or globs -> embeddings in safetensors + a JSON manifest.

    glmvit-encode photos/ 'scans/**/*.png' --checkpoint zai-org/GLM-5.3-Flash --out embeddings/
    glmvit-encode --inspect /models/GLM-5.3-Flash

The output folder holds embeddings-NNNNN.safetensors shards (one bf16 tensor per image, keyed by
the image file's resolved path) and manifest.json (source, size_hw, canvas_hw, grid_thw, tokens,
shard per image; the images that failed, with why; the settings). Each batch is written to a
temporary name and renamed, naming its images in its own metadata; the manifest is rewritten every
few seconds and at the end: an interrupted run loses nothing it finished, and a re-run with the same
settings skips what is done. A bad image is reported and skipped. Read the output with
glmvit_cupy.output.read_embeddings(folder).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import feed, gpu, vllm_ec
from .backend import Backend
from .batching import DECODE, pack, preparer
from .checkpoint import bind_tower
from .errors import CheckpointError, ImageError, OutputError
from .files import open_regular
from .output import Output, image_key
from .preprocess import RESIZE, Patching

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def expand_inputs(items) -> list[str]:
    """Files as given, folders walked for images (sorted), globs expanded, each file once however it was
    reached; an input that names nothing is an error (SystemExit with the message)."""
    out, missing = [], []
    for item in items:
        if os.path.isdir(item):
            for root, dirs, files in os.walk(item):
                dirs.sort()
                out += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(IMAGE_EXTENSIONS)]
        elif os.path.isfile(item):
            out.append(item)
        elif glob.has_magic(item):
            out += sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
        else:
            missing.append(item)
    if missing:
        raise SystemExit(f"glmvit-encode: no such file, folder or matching glob: {', '.join(missing)}")
    seen, unique = set(), []
    for p in out:
        key = image_key(p)  # the same file by any path is one image
        if key not in seen:
            seen.add(key)
            unique.append(os.path.normpath(p))
    return unique


def prepared(paths, workers: int, one):
    """(path, ((uint8 image, grid, info), the file's sha256) or the ImageError / ValueError it raised), as each is
    ready: `workers` threads read, hash and prepare each file with one(index, data, name) ahead of the GPU (as_done:
    the output is keyed by path, so a pass takes the images that are ready; a 12 MP photo decoding holds up none)."""

    def job(i, path):
        try:
            with open_regular(path, "the image", ImageError) as f:  # a FIFO or /dev/zero: refused, not read
                data = f.read()
            return path, (one(i, data, name=path), vllm_ec.key_of(data))
        except OSError as e:
            broken = os.path.islink(path) and not os.path.exists(path)
            return path, ImageError(f"{path}: " + (f"a broken symbolic link (to {os.readlink(path)!r})" if broken
                                                   else f"cannot read ({e})"))
        except (ImageError, ValueError) as e:
            return path, e

    return feed.as_done(job, paths, workers)


def device_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give CUDA device ordinals separated by commas, e.g. 0,1")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glmvit-encode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", help="image files, folders (walked for images) or globs")
    ap.add_argument("--checkpoint", help="checkpoint folder, shard or index, or Hub id (org/name)")
    ap.add_argument("--out", help="output folder (created; re-running the same command resumes)")
    ap.add_argument("--inspect", metavar="CHECKPOINT", help="print what the load-time checks find, then exit")
    ap.add_argument("--capacity-tokens", type=int, default=8000,
                    help="tokens per forward pass; images are packed into passes of this size (default 8000)")
    ap.add_argument("--batch-tokens", type=int, dest="capacity_tokens", help=argparse.SUPPRESS)  # the old name
    ap.add_argument("--max-image-tokens", type=int, default=8000,
                    help="per-image resize limit, as the reference processor's (default 8000)")
    ap.add_argument("--min-image-tokens", type=int, default=16, help="per-image lower limit (default 16)")
    ap.add_argument("--devices", type=device_list, default=None, metavar="0,1,...",
                    help="CUDA devices, one replica each; batches are spread across them (default: the current one)")
    ap.add_argument("--workers", type=int, default=feed.default_workers(),
                    help="threads reading and decoding images ahead of the GPU (default: the CPUs, at most 16); "
                         "each holds one decoded image (36 MB for a 12-megapixel photo)")
    ap.add_argument("--resize", choices=RESIZE, default=None,
                    help="who resizes: the GPU, bit for bit as Pillow (default), or Pillow on the host (--cpu's)")
    ap.add_argument("--decode", choices=DECODE, default="cpu",
                    help="who decodes JPEGs: Pillow (default) or nvImageCodec on the GPU (the gpu-decode extra; "
                         "its pixels differ slightly from Pillow's, see docs/PERFORMANCE.md)")
    ap.add_argument("--max-pixels", type=int, default=None, metavar="N",
                    help="largest image to decode, in pixels (default: Pillow's decompression-bomb guard, "
                         "89,478,485); raise it for large scans or panoramas")
    ap.add_argument("--vllm-ec-dir", default=None, metavar="DIR",
                    help="also write each embedding as DIR/<sha256 of the file>/encoder_cache.safetensors, the "
                         "layout vLLM's shared-storage encoder-cache connector reads")
    ap.add_argument("--cpu", action="store_true", help="use the float32 NumPy reference (slow; no GPU needed)")
    return ap


def parse(argv):
    return parser().parse_args(argv)


def inspect(path) -> int:
    try:
        s = bind_tower(path).summary()
    except CheckpointError as e:
        return fail(e)
    g = s["geometry"]
    print(f"checkpoint  {s['path']}\nprefix      {s['prefix']}\ntensors     {s['tensors']} "
          f"({s['parameters'] / 1e6:.1f} M parameters, {s['bytes'] / 2**30:.2f} GiB BF16)\n"
          f"shards      {', '.join(s['shards'])}\ngeometry    depth {g.depth}, hidden {g.hidden_size}, "
          f"heads {g.num_heads}, mlp {g.intermediate_size}, out {g.out_hidden_size}, merger "
          f"{g.projection_intermediate_size}, patch {g.patch_size}x{g.temporal_patch_size}")
    return 0


def fail(message) -> int:
    print(f"glmvit-encode: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse(argv)
    if args.inspect:
        return inspect(args.inspect)
    if not args.inputs or not args.checkpoint or not args.out:
        return fail("give images, --checkpoint and --out (or --inspect CHECKPOINT); see --help")
    for flag, value, low in (("--workers", args.workers, 1), ("--capacity-tokens", args.capacity_tokens, 1),
                             ("--max-image-tokens", args.max_image_tokens, 1),
                             ("--min-image-tokens", args.min_image_tokens, 0), ("--max-pixels", args.max_pixels, 1)):
        if value is not None and value < low:
            return fail(f"{flag} {value} must be at least {low}")
    gpu_only = [f for f, on in (("--devices", args.devices), ("--decode gpu", args.decode == "gpu"),
                                ("--resize gpu", args.resize == "gpu")) if on and args.cpu]
    if gpu_only:
        return fail(f"--cpu encodes on the host, without a GPU: leave out {' and '.join(gpu_only)}")
    args.resize = args.resize or ("host" if args.cpu else "gpu")
    if args.capacity_tokens < args.max_image_tokens:
        return fail(f"--capacity-tokens {args.capacity_tokens} must be at least --max-image-tokens "
                    f"{args.max_image_tokens}, so that the largest image fits one pass")
    # Everything that can refuse the run is checked before the output folder is made.
    paths = expand_inputs(args.inputs)
    if not paths:
        return fail(f"no images found in {', '.join(args.inputs)} (looked for {', '.join(IMAGE_EXTENSIONS)})")
    try:
        binding = bind_tower(args.checkpoint)
        Patching.of(binding.geometry)  # images need a tower of RGB patches
    except (CheckpointError, ValueError) as e:
        return fail(e)
    why = None if args.cpu else gpu.problem()
    if why:
        return fail(f"cannot use the GPU: {why}")
    settings = {"checkpoint": os.path.abspath(binding.path), "geometry": dict(vars(binding.geometry)),
                "min_image_tokens": args.min_image_tokens, "max_image_tokens": args.max_image_tokens,
                "max_pixels": args.max_pixels}
    try:
        out = Output(args.out, settings)
    except OutputError as e:
        return fail(e)
    todo = [p for p in paths if not out.done(image_key(p))]
    if len(todo) < len(paths):
        print(f"glmvit-encode: {len(paths) - len(todo)} of {len(paths)} images already in {args.out}; skipping them")
    if not todo:
        return 0
    if args.cpu:
        print("glmvit-encode: --cpu: the float32 NumPy reference encodes on the CPU; this is slow", file=sys.stderr)
    try:
        t_load = time.perf_counter()
        enc = Backend(binding, cpu=args.cpu, devices=args.devices, capacity_tokens=args.capacity_tokens,
                      image_tokens=args.max_image_tokens)
        print(f"glmvit-encode: {enc.name} ready in {time.perf_counter() - t_load:.1f} s"
              + (f" (CUDA graphs of {len(enc.graphs_ready)} full-pass budgets captured)" if enc.graphs_ready else ""),
              file=sys.stderr)
    except ValueError as e:
        return fail(e)
    saved_before = len(out)
    try:
        return encode_all(args, todo, enc, out)
    except KeyboardInterrupt:
        print(f"\nglmvit-encode: interrupted; {len(out) - saved_before} images saved this run ({len(out)} in "
              f"{args.out}); re-run the same command to resume", file=sys.stderr)
        return 130


def encode_all(args, todo, enc, out) -> int:
    """Encode `todo` into `out`; 1 if any image failed, else 0. Three things run side by side: the prepare
    threads, the GPU (one group of batches computing while the next is packed and launched) and one
    writer thread, which alone touches the output folder (shards and manifest, in order)."""
    from tqdm import tqdm

    tokens_done, failed = 0, 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), unit="img", dynamic_ncols=True)
    writer = ThreadPoolExecutor(1, thread_name_prefix="glmvit-write")
    writes = []

    def write(group, launched):
        nonlocal tokens_done
        # Copied to the host here, off the GPU's thread, and written straight from page-locked memory.
        with launched.viewed() as per_batch:
            for b, per_image in zip(group, per_batch):
                if args.vllm_ec_dir:
                    for (_, info), emb in zip(b, per_image):
                        vllm_ec.write(args.vllm_ec_dir, info["sha256"], emb)
                out.add_batch([(key, info, emb) for (key, info), emb in zip(b, per_image)])
                tokens_done += sum(info["tokens"] for _, info in b)
                bar.update(len(b))
        bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - t0):.0f}", failed=failed)

    def skip(path, why):
        out.fail(image_key(path), str(why))
        bar.write(f"skipped {path}: {why}")
        bar.update(1)

    def submit(fn, *a):
        writes.append(writer.submit(fn, *a))
        while writes and writes[0].done():
            writes.pop(0).result()  # a write that failed stops the run here

    def usable(stream):
        """The prepared images, keyed; a failed one is recorded and skipped."""
        nonlocal failed
        for path, got in stream:
            if isinstance(got, Exception):
                failed += 1
                submit(skip, path, got)
                continue
            (image, grid, info), sha = got  # sha: the content's key, as vLLM's encoder cache and glmvit-serve use
            key = image_key(path)
            yield key, image, grid, {"source": key, "sha256": sha, "size_hw": list(info["size"]),
                                     "canvas_hw": list(info["canvas"]), "content": list(info["content"]),
                                     "grid_thw": list(grid), "tokens": info["tokens"]}

    def groups(stream):
        """Packed batches, one per device at a time (the replicas run a group side by side)."""
        batches = pack(usable(stream), args.capacity_tokens, lambda item: item[3]["tokens"])
        while group := list(itertools.islice(batches, enc.lanes)):
            yield group

    one = preparer(enc.geometry, args.capacity_tokens, args.min_image_tokens, args.max_image_tokens,
                   args.max_pixels, resize=args.resize, decode=args.decode,
                   host_buffer=enc.host_buffer if args.resize == "gpu" else None, upload=enc.upload)
    stream = prepared(todo, args.workers, one)

    def collect(group):
        """Wait until a launched group is computed and hand it to the writer."""
        entries, launched = group
        launched.wait()
        submit(write, entries, launched)

    running = None  # (keys and infos, Launched) of the group on the GPU
    try:
        with contextlib.closing(stream):  # an interrupted run stops the preparing threads too
            # Each group is launched before the one ahead of it is collected: the GPU never waits for the host.
            # (Two groups ahead measured no faster: docs/PERFORMANCE.md.)
            for group in groups(stream):
                launched = ([[(key, info) for key, _, _, info in b] for b in group],
                            enc.launch([[(im, grid, info) for _, im, grid, info in b] for b in group]))
                if running is not None:
                    collect(running)
                running = launched
            if running is not None:
                collect(running)
                running = None
    finally:
        if running is not None:  # interrupted: the group on the GPU is finished work too
            with contextlib.suppress(Exception):
                collect(running)
        writer.shutdown(wait=True)  # what was computed is written
        out.flush()
    for w in writes:
        w.result()
    bar.close()
    dt = time.perf_counter() - t0
    print(f"glmvit-encode: {len(todo) - failed} images, {tokens_done} tokens in {dt:.1f} s "
          f"({(len(todo) - failed) / dt:.1f} images/s, {tokens_done / dt:.0f} tokens/s); {failed} failed; "
          f"output in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
