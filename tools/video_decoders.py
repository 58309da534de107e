"""Video files read by preprocessing/video_files.py (PyAV) against the reference processor's decoder,
torchcodec's VideoDecoder(seek_mode="exact") on the CPU, as HF transformers 5.23.0's fetch_videos opens a
path: the frame count, fps and duration its sampling reads, and every frame's RGB bytes.

    python tools/video_decoders.py CLIP [CLIP ...]        # each file compared, a line each
    python tools/video_decoders.py --golden DIR           # DIR/golden.json written for DIR's clips

With --golden, also HF's Glm5NextVideoProcessor given each path (its default decoder is torchcodec): the grid,
the sampled frames and a digest of pixel_values_videos at max_image_tokens=PROCESSOR_TOKENS, for
tests/test_video_files.py to check ours against where torch is absent. Needs torch, torchcodec (and the
FFmpeg libraries it loads), av and, for --golden, torchvision and transformers 5.23.0; the package itself
needs none of torch.
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from glmvit_cupy.preprocessing import video_files  # noqa: E402


def reference(path):
    """(frames [n, H, W, 3] uint8, num_frames, average_fps, duration_seconds) as torchcodec gives them."""
    from torchcodec.decoders import VideoDecoder

    d = VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=0, device="cpu")
    m = d.metadata
    frames = d.get_frames_at(indices=list(range(m.num_frames))).data.permute(0, 2, 3, 1).contiguous().numpy()
    return frames, m.num_frames, m.average_fps, m.duration_seconds


def ours(path):
    _, _, total, fps, duration = video_files.probe(path)
    frames, meta = video_files.load_video(path, lambda t, f, d: np.arange(t))
    return np.stack(frames), total, fps, duration


PROCESSOR_TOKENS = 600


def processor(path) -> dict:
    """HF's video processor given the path, as a user calls it: its grid, frames and pixels' digest."""
    import warnings

    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = Glm5NextVideoProcessor()(videos=[path], return_metadata=True, max_image_tokens=PROCESSOR_TOKENS)
    pixels = np.asarray(out["pixel_values_videos"], dtype=np.float32)
    return {"grid": np.asarray(out["video_grid_thw"]).tolist()[0], "sha256": digest(pixels),
            "frames_indices": [int(i) for i in out["video_metadata"][0].frames_indices]}


def digest(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("clips", nargs="*")
    ap.add_argument("--golden", metavar="DIR", help="write DIR/golden.json for the clips in DIR")
    args = ap.parse_args(argv)
    clips = args.clips or sorted(os.path.join(args.golden, f) for f in os.listdir(args.golden)
                                 if not f.endswith(".json"))
    golden, bad = {}, 0
    for path in clips:
        rf, rn, rfps, rdur = reference(path)
        of, on, ofps, odur = ours(path)
        same = rf.shape == of.shape and np.array_equal(rf, of)
        diff = "" if same or rf.shape != of.shape else f", max |diff| {np.abs(rf.astype(int) - of).max()}"
        ok = same and (rn, rfps, rdur) == (on, ofps, odur)
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {os.path.basename(path)}: torchcodec {rf.shape} {rn} frames {rfps:.6g} fps "
              f"{rdur:.6g} s | ours {of.shape} {on} frames {ofps:.6g} fps {odur:.6g} s | frames "
              f"{'equal' if same else 'differ'}{diff}")
        golden[os.path.basename(path)] = {"frames": rn, "fps": rfps, "duration": rdur, "shape": list(rf.shape),
                                          "sha256": digest(rf)}
        if args.golden:
            golden[os.path.basename(path)]["processor"] = processor(path)
    if args.golden:
        with open(os.path.join(args.golden, "golden.json"), "w") as f:
            json.dump(golden, f, indent=1, sort_keys=True)
    print(f"{len(clips) - bad} of {len(clips)} equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
