#!/usr/bin/env python3
"""Encode a video with the GLM-5.3-Flash vision tower, preprocessed as HF's Glm5NextVideoProcessor.

    python examples/encode_video.py                                   # a pan over the bundled photo
    python examples/encode_video.py f0.png f1.png ... --fps 24 --checkpoint /models/GLM-5.3-Flash
    python examples/encode_video.py --video clip.mp4                  # needs the video extra (PyAV)

The frames are image files in order, with --fps the source's frame rate, or a video file (--video: its
container's fps; only the sampled frames are decoded); about --target-fps frames a second are sampled. Without --checkpoint the tower has RANDOM
weights of the official geometry (shapes and timings real, embeddings meaningless). Without a GPU (or
with --cpu) the float32 NumPy reference runs on the CPU instead: slowly, and it says so.
"""

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # run from a checkout without installing
sys.path.insert(0, HERE)

from encode_image import PHOTO, check_save, checkpoint, guarded, report  # noqa: E402

from glmvit_cupy import TooShort, bind_tower, gpu, preprocess_video  # noqa: E402
from glmvit_cupy.checks import in_flags  # noqa: E402
from glmvit_cupy.output import shown  # noqa: E402
from glmvit_cupy.preprocessing.decode import load_rgb  # noqa: E402
from glmvit_cupy.preprocessing.image import Patching  # noqa: E402
from glmvit_cupy.preprocessing.video import STILL_IMAGES  # noqa: E402


def pan(frames: int = 16):
    """A camera panning across the bundled photo: frames 320 x 400 px, 8 px apart."""
    photo = np.asarray(load_rgb(PHOTO, "photo"))
    return np.stack([photo[40:440, 8 * k:8 * k + 320] for k in range(frames)])


def main(argv=None) -> int:
    """0, or 2 with one line on stderr for a bad frame, checkpoint, flag or an unusable GPU."""
    return guarded(run, argv, "encode_video.py")


def run(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("frames", nargs="*", help="frame image files, in order (default: a pan over the bundled photo)")
    ap.add_argument("--video", help="a video file instead of frame files (decoded by PyAV: the video extra)")
    ap.add_argument("--fps", type=float, help="the source's frames a second (default: the video file's, or 8)")
    ap.add_argument("--target-fps", type=float, default=2.0, help="frames sampled a second of video (default 2)")
    ap.add_argument("--max-video-tokens", type=int, default=4000, help="the video's token limit (default 4000)")
    ap.add_argument("--checkpoint", help="checkpoint folder, shard, index or Hub id (org/name: the hub extra); "
                    "default: random weights, said loudly")
    ap.add_argument("--save", help="write the embeddings to a .safetensors (bf16) or .npy file")
    ap.add_argument("--cpu", action="store_true", help="use the float32 NumPy reference even if a GPU exists")
    args = ap.parse_args(argv)
    if args.save:  # said before any work, not after it
        check_save(args.save)
    if args.video and args.frames:
        ap.error("give frame files or --video, not both")
    if args.video and os.path.isfile(args.video) and os.path.splitext(args.video)[1].lower() in STILL_IMAGES:
        raise ValueError(f"--video {args.video}: is an image file, not a video; give a video's frames as image "
                         f"files in order, without --video, and their rate as --fps (e.g. encode_video.py "
                         f"{args.video} f1.png ... --fps 24)")
    frames = args.video or ([load_rgb(f, i) for i, f in enumerate(args.frames)] if args.frames else pan())
    fps = args.fps if args.fps is not None or args.video else 8.0
    binding = bind_tower(checkpoint(args.checkpoint))
    why = "--cpu given" if args.cpu else gpu.problem()

    t = time.perf_counter()
    settings = dict(fps=fps, target_fps=args.target_fps, max_image_tokens=args.max_video_tokens,
                    patching=Patching.of(binding.geometry))
    try:
        pv, grid, (info,) = preprocess_video(frames, **settings)
    except ValueError as e:  # the library names its arguments and functions; here they are flags
        if isinstance(e, TooShort):  # its advice names sample=False, which this script has no flag for
            e = e.advised("raise --target-fps")
        flags = in_flags(str(e).replace("sample_frames: ", ""),  # the library's function, no part of this script
                         {"max_image_tokens": "--max-video-tokens", "target_fps": "--target-fps", "fps": "--fps"})
        raise ValueError(flags) from None
    source = shown(args.video) if args.video else f"{len(frames)} frame{'' if len(frames) == 1 else 's'}"
    rate = f"{info['fps']:g} fps" if info["fps"] else "an unknown frame rate"  # a file's: its container's
    print(f"{source} of {info['size'][1]}x{info['size'][0]} px at {rate} -> frames "
          f"{info['frames_indices']} -> canvas {info['canvas'][1]}x{info['canvas'][0]}, grid {tuple(info['grid'])}, "
          f"{info['tokens']} tokens ({info['frame_tokens']} a group of {binding.geometry.temporal_patch_size} "
          f"frames); preprocess {1e3 * (time.perf_counter() - t):.1f} ms")
    print("group timestamps (s):", [round(s, 3) for s in info["timestamps"][::binding.geometry.temporal_patch_size]])
    if why is None:
        from glmvit_cupy import GlmVit

        model = GlmVit(binding, capacity_tokens=max(info["frame_tokens"], 1024))
        del settings["patching"]  # the model's own
        model.encode_video(frames, **settings)  # warm-up: kernels compile, graphs capture
        t = time.perf_counter()
        (out,) = model.encode_video(frames, **settings)  # the sampled frames resized on the GPU
        emb = out.get()
        ms = 1e3 * (time.perf_counter() - t)
        (host_rows,) = model.encode_video_pixels(pv, grid)  # the rows preprocessed on the host above
        same = np.array_equal(emb.view(np.uint16), host_rows.get().view(np.uint16))
        print(f"{'decode + ' if args.video else ''}GPU resize + encode: {ms:.1f} ms for {info['tokens']} tokens "
              f"(bit-equal to the host-preprocessed rows: {same})")
    else:
        import ml_dtypes

        from glmvit_cupy import reference

        print(f"!! the GPU engine cannot run here: {why} !!")
        print("!! so the float32 NumPy reference runs on the CPU instead: slow (tens of seconds at the official "
              "geometry) !!")
        t = time.perf_counter()
        emb = reference.encode_pixels(binding, pv, grid).astype(ml_dtypes.bfloat16)
        print(f"CPU reference: {time.perf_counter() - t:.1f} s")
    return report("encode_video.py", ["video"], [emb], args.save)


if __name__ == "__main__":
    sys.exit(main())
