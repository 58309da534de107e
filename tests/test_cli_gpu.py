"""glmvit-encode on the GPU (one replica per --devices entry): the same files as the CPU backend
within bf16 rounding, bit-equal to GlmVit.encode, spread over two replicas."""

import json
import os

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from tests.conftest import gpu_or_skip

pytestmark = pytest.mark.gpu
cupy = gpu_or_skip()

from tests.golden import cases  # noqa: E402

from glmvit_cupy import GlmVit, reference
from glmvit_cupy.cli import main as cli
from glmvit_cupy import preprocess  # noqa: E402


def test_gpu_command_matches_reference_and_model(tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    sizes = [(100, 150), (64, 64), (140, 90), (90, 200), (120, 120)]
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(cases._smooth(h, w, 10 + i)).save(folder / f"{i}.png")
    (folder / "bad.jpg").write_bytes(b"\xff\xd8\xffnot a jpeg")
    devices = "0,1" if cupy.cuda.runtime.getDeviceCount() >= 2 else "0,0"
    out = tmp_path / "out"
    # 60-token batches: the five images (117 tokens) make two or three batches (packed in the order the
    # images are ready), run side by side on the two replicas.
    rc = cli.main([str(folder), "--checkpoint", str(cases.TOWER_DIR), "--out", str(out), "--devices", devices,
                   "--capacity-tokens", "60", "--max-image-tokens", "60"])
    assert rc == 1  # the broken JPEG is reported, not fatal
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["images"]) == 5 and list(manifest["failed"]) == [str(folder / "bad.jpg")]
    shards = {f for f in os.listdir(out) if f.endswith(".safetensors")}
    per_shard = {}
    for entry in manifest["images"].values():
        per_shard[entry["shard"]] = per_shard.get(entry["shard"], 0) + entry["tokens"]
    assert set(per_shard) == shards and len(shards) >= 2 and max(per_shard.values()) <= 60, per_shard
    tensors = {}
    for f in shards:
        tensors.update(load_file(str(out / f)))
    model = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=60)
    tower = reference.Tower(reference.bind_tower(cases.TOWER_DIR))
    for key, entry in manifest["images"].items():
        got = tensors[key].astype(np.float32)
        alone = cupy.asnumpy(model.encode([key], max_image_tokens=60)[0]).astype(np.float32)
        pv, grid = preprocess([key], max_image_tokens=60)
        ref = reference.encode_pixels(tower, pv, grid)
        assert entry["tokens"] == got.shape[0] == grid[0, 1] * grid[0, 2] // 4
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, key
        assert np.linalg.norm(got - alone) / np.linalg.norm(alone) < 1e-2, key  # batching may differ in last bits
    print(capsys.readouterr().out.strip().splitlines()[-1])


def test_gpu_command_encodes_videos_as_the_model(tmp_path):
    """glmvit-encode on two replicas with video files (a clip of several 60-token passes, a rotated 10-bit one, a
    late-starting one) beside an image: each video bit-equal to GlmVit.encode_video of its path with the same
    settings, frames resized on the GPU or (--resize host) on the host alike, and near the float32 reference."""
    import pytest

    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    import shutil

    from tests.test_cli_videos import write_clip

    from glmvit_cupy.output import read_embeddings
    from glmvit_cupy.preprocessing.video import preprocess_video

    folder, golden = tmp_path / "media", os.path.join(os.path.dirname(__file__), "golden", "video_files")
    folder.mkdir()
    write_clip(folder / "pan.mkv", n=30, h=150, w=200, fps=5)
    for name in ("h264_10bit_rot90.mp4", "h264_offset.mp4"):
        shutil.copy(os.path.join(golden, name), folder / name)
    Image.fromarray(cases._smooth(100, 150, 3)).save(folder / "a.png")
    devices = "0,1" if cupy.cuda.runtime.getDeviceCount() >= 2 else "0,0"
    settings = ["--capacity-tokens", "60", "--max-image-tokens", "60", "--max-video-tokens", "300"]
    runs = {}
    for resize in ("gpu", "host"):
        out = tmp_path / f"out-{resize}"
        assert cli.main([str(folder), "--checkpoint", str(cases.TOWER_DIR), "--out", str(out), "--devices", devices,
                         "--resize", resize, *settings]) == 0
        runs[resize] = read_embeddings(out)
    manifest, embs = runs["gpu"]
    model = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=60)
    tower = reference.Tower(reference.bind_tower(cases.TOWER_DIR))
    videos = [k for k, e in manifest["images"].items() if e.get("kind") == "video"]
    assert len(videos) == 3 and len(embs) == 4
    for key in videos:
        alone = cupy.asnumpy(model.encode_video(key, max_image_tokens=300)[0])
        assert np.array_equal(embs[key], alone) and np.array_equal(runs["host"][1][key], alone), key
        pv, grid, info = preprocess_video(key, max_image_tokens=300)
        ref = reference.encode_pixels(tower, pv, grid)
        got = embs[key].astype(np.float32)
        assert manifest["images"][key]["grid_thw"] == grid[0].tolist()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, key
    assert max(manifest["images"][k]["grid_thw"][0] * manifest["images"][k]["frame_tokens"] for k in videos) > 60


def test_gpu_command_on_a_tower_of_another_merge_size(tmp_path):
    """A 3 x 3-merge tower of 16-pixel single-frame patches through glmvit-encode on two replicas: each image's
    tokens are its canvas's (48-pixel tokens), and its embedding is the float32 reference's of the pixels
    preprocessed with the tower's own patching."""
    import dataclasses

    from glmvit_cupy.checkpoint.synthetic import write_checkpoint
    from glmvit_cupy.preprocessing.image import Patching

    geo = dataclasses.replace(cases.GEOMETRY, spatial_merge_size=3, patch_size=16, temporal_patch_size=1)
    ckpt = write_checkpoint(tmp_path / "m3", geo, seed=5)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, (h, w) in enumerate([(100, 150), (300, 90), (48, 48)]):
        Image.fromarray(cases._smooth(h, w, 20 + i)).save(folder / f"{i}.png")
    devices = "0,1" if cupy.cuda.runtime.getDeviceCount() >= 2 else "0,0"
    out = tmp_path / "out"
    assert cli.main([str(folder), "--checkpoint", ckpt, "--out", str(out), "--devices", devices,
                     "--capacity-tokens", "40", "--max-image-tokens", "40"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    tensors = {}
    for f in {e["shard"] for e in manifest["images"].values()}:
        tensors.update(load_file(str(out / f)))
    tower = reference.Tower(reference.bind_tower(ckpt))
    for key, entry in manifest["images"].items():
        got = tensors[key].astype(np.float32)
        pv, grid = preprocess([key], max_image_tokens=40, patching=Patching.of(geo))
        assert entry["tokens"] == got.shape[0] == grid[0, 1] * grid[0, 2] // 9 and pv.shape[1] == 3 * 16 * 16
        ref = reference.encode_pixels(tower, pv, grid)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, key


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_on_the_gpu_encodes_videos_and_images_as_the_model(tmp_path, workers):
    """glmvit-serve on the GPU, in one process and with two HTTP workers beside the engine's: a video request
    (two videos, frames as PNG) and image requests at once, each bit-equal to GlmVit.encode_video_pixels /
    encode of the same inputs; the golden tower."""
    import io

    import pytest

    pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    from tests.test_serve import start, videos_beside_images

    from glmvit_cupy import preprocess_video

    proc, client = start(tmp_path, "--capacity-tokens", 300, "--workers", workers, checkpoint=str(cases.TOWER_DIR),
                         cpu=False,
                         wait_s=300)  # a fresh machine compiles the kernels first
    try:
        vids, images, embs, meta, got = videos_beside_images(client)
        assert "gpu" in client.health()["backend"]
        model = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=300)
        pv, grid, _ = preprocess_video(vids, fps=[4.0, 2.0], max_image_tokens=200)
        for e, w in zip(embs, model.encode_video_pixels(pv, grid)):
            assert np.array_equal(e.view(np.uint16), w.get().view(np.uint16))
        for i in range(2):
            want = model.encode([io.BytesIO(images[i])])[0].get()
            assert np.array_equal(got[i].view(np.uint16), want.view(np.uint16))
        print(f"glmvit-serve on the GPU: {len(vids)} videos {[m['grid_thw'] for m in meta]} and 2 images bit-equal")
    finally:
        proc.terminate()
        proc.wait(30)


def test_ray_video_stages_on_the_gpu_equal_the_model(tmp_path):
    """The Ray video pipeline's two stages called as Ray calls them (Ray itself does not fit the GPU machine):
    PrepareVideo's rows into EncodeVideo on the GPU, three videos in one actor call (their groups share
    passes), each bit-equal to GlmVit.encode_video of its file alone."""
    import pytest

    pd = pytest.importorskip("pandas", reason="pandas (Ray Data's batches) is not installed")
    pytest.importorskip("av", reason="the video extra (PyAV) is not installed")
    from tests.test_cli_videos import write_clip

    from glmvit_cupy.preprocessing.image import Patching
    from glmvit_cupy.ray import EncodeVideo, PrepareVideo

    golden = os.path.join(os.path.dirname(__file__), "golden", "video_files")
    paths = [os.path.join(golden, "h264_10bit_rot90.mp4"), os.path.join(golden, "hevc_hlg_rot270.mp4"),
             str(write_clip(tmp_path / "pan.mkv", n=20, h=120, w=160, fps=5))]
    batch = pd.DataFrame({"bytes": [open(p, "rb").read() for p in paths], "path": paths})
    settings = {"target_fps": 2, "max_frames": 2048, "min_image_tokens": 16, "max_image_tokens": 300}
    patching = Patching.of(reference.bind_tower(cases.TOWER_DIR).geometry)
    rows = EncodeVideo(str(cases.TOWER_DIR), False, 60)(PrepareVideo("bytes", settings, None, patching, 60)(batch))
    model = GlmVit.from_checkpoint(cases.TOWER_DIR, capacity_tokens=60)
    for path, emb, err in zip(paths, rows["embedding"], rows["error"]):
        alone = cupy.asnumpy(model.encode_video(path, max_image_tokens=300)[0]).astype(np.float32)
        assert pd.isna(err) and np.array_equal(emb, alone), (path, err)


def test_gpu_embeddings_of_weights_that_overflow_are_failed_not_saved(tmp_path, capsys):
    """The GPU engine on weights that overflow the forward (cases.overflowing_tower): each image is failed
    saying so, nothing of it saved, exit 1, as on the CPU backend."""
    folder = cases.png_folder(tmp_path / "imgs", (60, 80), (64, 64))
    out = tmp_path / "out"
    rc = cli.main([str(folder), "--checkpoint", cases.overflowing_tower(tmp_path / "bad"), "--out", str(out)])
    assert rc == cli.FAILED, capsys.readouterr()
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["images"] and len(manifest["failed"]) == 2
    assert all("NaN or infinite values" in why for why in manifest["failed"].values()), manifest["failed"]
    assert not [f for f in os.listdir(out) if f.endswith(".safetensors")]
