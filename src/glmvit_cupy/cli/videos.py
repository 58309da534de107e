"""glmvit-encode's video files: each read on a thread (its file hashed, its sampled frames decoded by
video_files, as the reference processor reads a path), encoded on a free GPU lane (passes of whole frame
groups, the frames resized where --resize says), and written to the same output folder as the images: one
shard a video, its entry's "kind" "video". Finished videos are written as they finish, so an interrupted
run loses none of them.

The settings that shape a video's embedding are the server's video settings (serving/requests.py), so a
video's "key" (vllm_ec.video_key_of of its file and those settings) is the one glmvit-serve gives the same
file, and names its --vllm-ec-dir entry.
"""

from __future__ import annotations

import hashlib
import os
import queue
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from .. import checks
from ..errors import ImageError, TooShort, Untimed
from ..files import identity, open_regular
from ..output import Writer, file_stamp, image_key, shown
from ..scheduling import feed
from .. import vllm_ec
from .common import DONE, FAILED, counted, skipped, write_vllm
from .inputs import check_size, unreadable

# A file whose packets span no time: this command has no video's own fps to read it by (--video-fps is the
# rate sampled).
UNTIMED = (f"glmvit-encode takes no video's own fps (--video-fps is the rate it samples at): {Untimed.REMUX}; or "
           "encode it in Python with GlmVit.encode_video(path, fps=FPS)")
VIDEO_WORKERS = 4  # videos decoding at once: each decode already runs on FFmpeg's frame threads
HASH_CHUNK = 1 << 20


def video_settings(args) -> dict:
    """The preprocess_video settings of this run, as glmvit-serve names them (its video_key_of's input)."""
    return {"sample": True, "target_fps": args.video_fps, "max_frames": args.max_frames, "max_duration": 0,
            "min_image_tokens": args.min_video_tokens, "max_image_tokens": args.max_video_tokens}


def file_sha256(path, max_bytes: int | None = None) -> tuple[str, list]:
    """The file's sha256 hex, read in pieces (a video can be larger than memory), and its stamp as read
    (output.file_stamp); a FIFO is refused, and so is a file over max_bytes, from its size, before any of it
    is read."""
    sha, st = _hashed(path, max_bytes)
    return sha, file_stamp(st)


def _hashed(path, max_bytes: int | None) -> tuple[str, os.stat_result]:
    h = hashlib.sha256()
    with open_regular(path, "the video", ImageError) as f:
        st = os.fstat(f.fileno())
        if max_bytes is not None:
            check_size(path, st.st_size, max_bytes, "video")
        while piece := f.read(HASH_CHUNK):
            h.update(piece)
    return h.hexdigest(), st


def _same_file(path, st: os.stat_result) -> None:
    """The video is decoded through an open of its own: an ImageError if the path no longer names the file that was
    hashed (renamed over, rewritten), whose hash and stamp would then go with another file's embedding."""
    try:
        now = identity(os.stat(path))
    except OSError:
        now = None
    if now != identity(st):
        raise ImageError(f"{path}: the file changed while it was read (replaced or rewritten); not encoded: "
                         "run again to encode it as it is now")


def planned_videos(paths, workers: int, settings: dict, patching, capacity_tokens: int, max_video_pixels,
                   max_bytes: int | None = None, max_pixels: int | None = None):
    """(path, ((frames, grid, info), entry for the manifest) or the ImageError / ValueError it raised), as each
    is ready; at most `workers` videos' frames held at once beyond those the caller holds. A file over
    max_bytes is refused before it is read."""
    from ..preprocessing.video import plan_video
    from ..preprocessing.video_files import VideoFile

    def job(i, path):
        try:
            sha, st = _hashed(path, max_bytes)
            frames, grid, info = plan_video(VideoFile(path, max_video_pixels, max_pixels), i, name=path,
                                            patching=patching, **settings)
            _same_file(path, st)
            checks.check_frame_group(path, grid[1], grid[2], patching.merge_size, capacity_tokens)
        except OSError as e:
            return path, unreadable(path, e)
        except TooShort as e:  # the sampler's advice names its Python arguments; this command's is --video-fps
            return path, e.advised("raise --video-fps (a run's setting: into another --out)")
        except Untimed as e:  # the reader's advice is a video's fps=, which this command takes none of
            return path, e.advised(UNTIMED)
        except ImageError as e:
            return path, e
        except ValueError as e:  # the sampler's limits are named as the Python API's arguments: here, the flags
            return path, ValueError(checks.in_flags(str(e), {"max_image_tokens": "--max-video-tokens",
                                                             "min_image_tokens": "--min-video-tokens"}))
        entry = {"kind": "video", "source": image_key(path), "sha256": sha, "file": file_stamp(st),
                 "key": vllm_ec.video_key_of_shas([sha], None, None, settings, kind="file"), "size_hw": list(info["size"]),
                 "canvas_hw": list(info["canvas"]), "content": list(info["content"]), "grid_thw": list(grid),
                 "tokens": info["tokens"], "frame_tokens": info["frame_tokens"],
                 "frames_indices": info["frames_indices"], "timestamps": info["timestamps"], "fps": info["fps"],
                 "duration": info["duration"], "total_frames": info["total_frames"]}
        return path, ((frames, grid, info), entry)

    return feed.as_done(job, paths, min(workers, VIDEO_WORKERS), ahead=min(workers, VIDEO_WORKERS))


def encode_videos(args, todo, enc, out, settings: dict) -> int:
    """Encode the video files `todo` into `out` (the image run's Output); FAILED if any video failed, else DONE.
    One video a GPU lane at a time, every lane busy while videos are ready; a lane takes its next video once
    the GPU has the last one's work, and one writer thread copies each out and writes it as it finishes."""
    from tqdm import tqdm

    bar = tqdm(total=len(todo), unit="video", dynamic_ncols=True)
    encoded, tokens, failed = 0, 0, 0
    lanes = queue.SimpleQueue()
    for lane in range(enc.lanes):
        lanes.put(lane)
    gpu = ThreadPoolExecutor(enc.lanes, thread_name_prefix="glmvit-video")
    writer = Writer(out)  # it alone touches `out`; what waits for it is bounded (output.PENDING_WRITES)
    submit = writer.submit
    running: dict = {}  # future of a lane's launch -> (key, entry)
    unusable = []  # videos whose embedding came back unusable (the writer's thread appends them)
    blocked = []  # videos saved whose vLLM file could not be written (something in the way of its key)
    t0 = time.perf_counter()

    def on_lane(lane, planned):
        try:
            return enc.launch_video_on(lane, [planned], resize=args.resize)
        finally:
            lanes.put(lane)

    def write(key, entry, launched):
        with launched.viewed() as views:  # waits for the video's forwards; the views die with the `with`
            emb = views[0][0]
            problem = checks.embedding_problem(emb, entry["source"])
            if problem is not None:  # never saved: the video is failed, saying why
                unusable.append(entry["tokens"])
                out.fail(key, problem)
                bar.write(skipped(entry["source"], problem))
                return
            if args.vllm_ec_dir and not write_vllm(args.vllm_ec_dir, entry["key"], emb,
                                                   out.manifest["header"]["weights"], entry["source"], bar.write):
                blocked.append(key)
            out.add_batch([(key, entry, emb)])

    def collect(done):
        nonlocal encoded, tokens, failed
        for fut in done:
            key, entry = running.pop(fut)
            try:
                launched = fut.result()
            except (ImageError, ValueError) as e:  # the engine's own checks of this video
                failed += 1
                submit(out.fail, key, str(e))
                bar.write(skipped(entry["source"], e))
            else:
                # the lane takes the next video meanwhile
                submit(write, key, entry, launched, nbytes=enc.geometry.embedding_bytes(entry["tokens"]))
                encoded, tokens = encoded + 1, tokens + entry["tokens"]
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", failed=failed)

    stream = planned_videos(todo, args.workers, settings, enc.patching(), args.capacity_tokens,
                            args.max_video_pixels, max_bytes=int(args.max_video_mib * 2**20),
                            max_pixels=args.max_pixels)
    try:
        for path, got in stream:
            if isinstance(got, Exception):
                failed += 1
                submit(out.fail, image_key(path), str(got))
                bar.write(skipped(path, got))
                bar.update(1)
                continue
            planned, entry = got
            while len(running) >= enc.lanes:  # every lane busy: take in what finished
                collect(wait(running, return_when=FIRST_COMPLETED)[0])
            lane = lanes.get()
            running[gpu.submit(on_lane, lane, planned)] = (image_key(path), entry)
        collect(wait(running)[0])
    finally:
        stream.close()  # an interrupted run stops the decoding threads too
        # What is on a lane is finished work: written before the run stops.
        for fut in list(running):
            if not fut.cancel():
                try:
                    collect([fut])
                except Exception:  # noqa: BLE001 - already interrupted; the video is encoded again next run
                    running.pop(fut, None)
        gpu.shutdown(wait=True)
        writer.close()  # what was computed is written
        bar.close()  # here: left to exit, it would print after the line saying why a run stopped
    writer.check()
    dt = time.perf_counter() - t0
    encoded, failed, tokens = encoded - len(unusable), failed + len(unusable), tokens - sum(unusable)
    print(f"glmvit-encode: {counted(encoded, 'video')}, {tokens} tokens in {dt:.1f} s ({encoded / dt:.2f} videos/s, "
          f"{tokens / dt:.0f} tokens/s); {failed} failed; "
          + (f"{len(blocked)} without a --vllm-ec-dir file; " if blocked else "") + f"output in {shown(args.out)}")
    return FAILED if failed or blocked else DONE
