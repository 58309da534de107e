"""glmvit-serve: the GLM-5.3-Flash vision tower as an HTTP service (see glmvit_cupy.serving.app).

    glmvit-serve --checkpoint /models/GLM-5.3-Flash --port 8000
    glmvit-serve --checkpoint tests/golden/tower --cpu            # the float32 reference, no GPU

SIGTERM or Ctrl-C: stop accepting, answer 503 to new requests on open connections, finish what is in
flight, exit 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glmvit-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder, shard or index, or Hub id (org/name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    ap.add_argument("--cpu", action="store_true", help="use the float32 NumPy reference (slow; no GPU needed)")
    ap.add_argument("--devices", default=None, metavar="0,1,...", help="CUDA devices, one replica each")
    ap.add_argument("--capacity-tokens", type=int, default=8000, help="tokens per forward pass (default 8000)")
    ap.add_argument("--max-wait-ms", type=float, default=5.0,
                    help="how long an image waits for others to share its forward pass (default 5)")
    ap.add_argument("--cache-mib", type=float, default=1024.0,
                    help="memory for finished embeddings, by content hash (default 1024; 0: no cache)")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="images waiting for a forward pass before requests get 429 (default 256)")
    ap.add_argument("--max-body-mib", type=float, default=256.0, help="largest request body (default 256)")
    ap.add_argument("--max-image-mib", type=float, default=64.0, help="largest image file (default 64)")
    ap.add_argument("--max-pixels", type=int, default=None,
                    help="largest image to decode, in pixels (default: Pillow's guard, 89,478,485)")
    ap.add_argument("--max-video-pixels", type=int, default=2**32,
                    help="a video's sampled frames' pixels together (default 2^32); only "
                         "sampled frames are decoded")
    ap.add_argument("--decode-workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads decoding and resizing images (default: min(8, CPUs))")
    ap.add_argument("--vllm-ec-dir", default=None, metavar="DIR",
                    help="also write each embedding as DIR/<sha256>/encoder_cache.safetensors for vLLM")
    return ap


def check_settings(args) -> str | None:
    """What is wrong with the numeric flags, or None."""
    for flag, value in (("--capacity-tokens", args.capacity_tokens), ("--max-queue", args.max_queue),
                        ("--decode-workers", args.decode_workers), ("--max-video-pixels", args.max_video_pixels)):
        if value < 1:
            return f"{flag} {value} must be at least 1"
    if args.max_pixels is not None and args.max_pixels < 1:
        return (f"--max-pixels {args.max_pixels} must be at least 1 (pixels an image may have before it is refused "
                "as a decompression bomb); leave it out for Pillow's own limit")
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is not a TCP port: 0..65535 (0: any free port)"
    for flag, value, least in (("--max-wait-ms", args.max_wait_ms, 0.0), ("--cache-mib", args.cache_mib, 0.0)):
        if not (math.isfinite(value) and value >= least):
            return f"{flag} {value:g} must be a finite number of at least {least:g}"
    for flag, value in (("--max-body-mib", args.max_body_mib), ("--max-image-mib", args.max_image_mib)):
        if not (math.isfinite(value) and value > 0):
            return f"{flag} {value:g} must be a finite number above 0"
    return None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError as e:
        print(f"glmvit-serve: the serve extra is not installed ({e}): pip install 'glmvit-cupy[serve]'",
              file=sys.stderr)
        return 2
    from .. import gpu
    from ..checkpoint.bind import bind_tower
    from ..checks import DEFAULT_MAX_IMAGE_TOKENS, device_list
    from ..errors import CheckpointError
    from ..preprocessing.image import Patching
    from ..scheduling.backend import Backend
    from .app import Settings, create_app

    why = check_settings(args)
    if why:  # the operator's mistake, said at start: not a 422 blaming every client later
        print(f"glmvit-serve: {why}", file=sys.stderr)
        return 2
    if args.cpu and args.devices:
        print("glmvit-serve: --cpu serves the float32 reference on the host, without a GPU: leave out --devices",
              file=sys.stderr)
        return 2
    try:
        devices = device_list(args.devices) if args.devices else None
        binding = bind_tower(args.checkpoint)
        Patching.of(binding.geometry)  # the server takes images: a tower of RGB patches
    except (CheckpointError, argparse.ArgumentTypeError, ValueError) as e:
        print(f"glmvit-serve: {e}", file=sys.stderr)
        return 2
    why = None if args.cpu else gpu.problem()
    if why:
        print(f"glmvit-serve: cannot use the GPU: {why}", file=sys.stderr)
        return 2
    settings = Settings(checkpoint=os.path.abspath(binding.path), capacity_tokens=args.capacity_tokens,
                        max_wait_ms=args.max_wait_ms, cache_mib=args.cache_mib, max_queue=args.max_queue,
                        max_body_mib=args.max_body_mib, max_image_mib=args.max_image_mib, max_pixels=args.max_pixels,
                        max_video_pixels=args.max_video_pixels, decode_workers=args.decode_workers,
                        vllm_ec_dir=args.vllm_ec_dir)
    # Graphs for full passes of images at the default limit are captured at load (GlmVit.precapture
    # clamps it to the capacity).
    app = create_app(lambda: Backend(binding, cpu=args.cpu, devices=devices, capacity_tokens=args.capacity_tokens,
                                     image_tokens=DEFAULT_MAX_IMAGE_TOKENS), settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # new requests on open connections get 503 from now on
            app.state.glmvit["status"] = "stopping"
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a clean stop: exit 0, not re-raise the signal afterwards

    print(f"glmvit-serve: {binding.path} on http://{args.host}:{args.port} "
          f"({'cpu, float32 reference' if args.cpu else 'gpu'}; /health says when it is loaded)", flush=True)
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on")).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
