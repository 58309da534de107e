"""Beyond one machine: encode a Ray Dataset of image or video files (the `ray` extra; Ray imported only here).

    import ray, glmvit_cupy.ray as gvr
    ds = ray.data.read_binary_files("s3://bucket/photos/", include_paths=True)     # columns bytes, path
    out = gvr.encode_dataset(ds, "/models/GLM-5.3-Flash", concurrency=8)           # 8 GPU actors
    clips = gvr.encode_video_dataset(ray.data.read_binary_files("s3://bucket/clips/", include_paths=True),
                                     "/models/GLM-5.3-Flash")

Two stages: `Prepare` decodes on CPU workers (Ray tasks) and plans each canvas (with cpu=True it also
resizes, with Pillow); `Encode` runs in actors that load the tower once (`num_gpus` each, `concurrency`
of them), resize on their GPU and pack rows into forward passes of up to `capacity_tokens`. Output rows keep every input column but the bytes and add:

- `tokens` (int), `grid_thw` (three ints);
- `embedding`: float32 [tokens, out_hidden] holding the exact bf16 values (widening bf16 to float32
  is exact: `embedding.astype(ml_dtypes.bfloat16)` gives the bf16 bits back); a failed row has none:
  an empty [0, out_hidden] array (an array all the same, so every block of the column has one type);
- `error`: None, or why the image could not be used (the row keeps its other columns).

Videos alike (`PrepareVideo`, `EncodeVideo`): the CPU stage reads the file as the reference processor
reads a path (video_files) and hands on only its sampled frames, unresized; the actor resizes them
on its GPU and encodes them in passes of whole frame groups. Their rows also get `frames_indices`,
`timestamps` (seconds) and `fps`, and `grid_thw` is (frame groups, h, w).

Embeddings equal, bit for bit, `GlmVit.encode` (`encode_video`) of the same file alone on the same kind
of GPU (the engine is batch-invariant), or the float32 reference's with cpu=True.
"""

from __future__ import annotations

import io

import numpy as np

from .checks import embedding_problem, image_limits
from .errors import ImageError, TooShort, Untimed, quoted
from .preprocessing.image import REFERENCE, Patching, prepare_canvas


def _unnamed(i: int) -> str:
    """A row's name when the dataset has no "path" column: Ray Data gives a batch no row numbers of the
    whole dataset, so it is named by its place in its batch."""
    return f"row {i} of its batch (no 'path' column to name it)"


def _file_bytes(blob, name) -> bytes:
    """A row's file bytes; ImageError naming the row for a value that holds none (null, a string, a number),
    which fails that row, not the job."""
    if not isinstance(blob, (bytes, bytearray, memoryview, np.ndarray)):
        raise ImageError(f"{name}: the bytes column holds {type(blob).__name__} {quoted(blob)}, not a file's bytes")
    return bytes(blob)


class Prepare:
    """CPU stage: the bytes column -> canvas (uint8, dropped by Encode), grid_thw, tokens, error.
    Batches are pandas DataFrames: pandas and Arrow agree on nulls (a NumPy batch of an all-null text
    column comes back as "nan" strings)."""

    def __init__(self, bytes_column: str, min_image_tokens: int, max_image_tokens: int, max_pixels=None,
                 resize: str = "host", patching: Patching = REFERENCE):
        self.column, self.limits = bytes_column, dict(min_image_tokens=min_image_tokens,
                                                      max_image_tokens=max_image_tokens, max_pixels=max_pixels,
                                                      resize=resize, patching=patching)

    def __call__(self, batch):
        import pandas as pd

        data = batch.pop(self.column)
        names = batch["path"] if "path" in batch else [_unnamed(i) for i in range(len(data))]
        canvases, grids, tokens, contents, errors = [], [], [], [], []
        for i, (blob, name) in enumerate(zip(data, names)):
            try:
                stream = io.BytesIO(_file_bytes(blob, name))
                # errors name the file (or the row), not its place in this batch
                canvas, grid, info = prepare_canvas(stream, i, name=str(name), **self.limits)
                canvas = np.ascontiguousarray(canvas)  # GPU resize: 3 of 4 bytes a pixel; rows travel as Arrow
                canvases.append(canvas), grids.append(np.array(grid, np.int64)), tokens.append(info["tokens"])
                contents.append(np.array(info["content"], np.int64)), errors.append(None)
            except (ImageError, ValueError) as e:  # a failed row: empty arrays (one type per column)
                canvases.append(np.zeros((0, 0, 3), np.uint8)), grids.append(np.zeros(3, np.int64)), tokens.append(0)
                contents.append(np.zeros(2, np.int64)), errors.append(str(e))
        batch["canvas"], batch["grid_thw"], batch["tokens"] = canvases, grids, np.array(tokens, np.int64)
        batch["content_hw"] = contents  # what the GPU resizes a decoded image to (resize "gpu")
        batch["error"] = pd.array(errors, dtype="string")
        return batch


class Encode:
    """The tower, loaded once per actor (a GPU replica, or the reference with cpu=True): canvases ->
    embeddings, rows packed into passes of up to capacity_tokens."""

    def __init__(self, checkpoint, cpu: bool, capacity_tokens: int, max_image_tokens: int | None = None):
        from .checkpoint.bind import bind_tower
        from .backend import Backend

        self.backend = Backend(bind_tower(checkpoint), cpu=cpu, capacity_tokens=capacity_tokens,
                               max_image_tokens=max_image_tokens)

    def __call__(self, batch):
        import pandas as pd

        canvases, contents = list(batch.pop("canvas")), list(batch.pop("content_hw"))
        errors = [None if pd.isna(e) else str(e) for e in batch["error"]]
        grids, tokens = list(batch["grid_thw"]), list(batch["tokens"])
        rows = [i for i, e in enumerate(errors) if e is None]
        items = [(canvases[i], tuple(int(v) for v in grids[i]), {"tokens": int(tokens[i]),
                                                                 "content": tuple(int(v) for v in contents[i])})
                 for i in rows]
        return self._finish(batch, errors, rows, lambda: self.backend.encode_on(0, items))

    def _finish(self, batch, errors: list, rows: list, encode):
        """The batch with its embedding and error columns: encode() gives the bf16 embeddings of `rows` (the
        rows without an error), in order; a failed row has none (an empty array)."""
        import pandas as pd

        width = self.backend.geometry.out_hidden_size
        embeddings = [np.zeros((0, width), np.float32) for _ in errors]
        try:
            for i, emb in zip(rows, encode() if rows else []):
                problem = embedding_problem(emb, str(batch["path"].iloc[i]) if "path" in batch else _unnamed(i))
                if problem is not None:  # an unusable embedding is a failed row
                    errors[i] = problem
                    continue
                embeddings[i] = emb.astype(np.float32)  # exact: every bf16 value is a float32 value
        except Exception as e:  # the engine failed on this batch: its rows say so, the pipeline goes on
            for i in rows:
                errors[i] = f"encoding failed ({type(e).__name__}: {e})"
        batch["embedding"] = embeddings
        batch["error"] = pd.array(errors, dtype="string")
        return batch


class PrepareVideo:
    """CPU stage for videos: the bytes column -> frames (the sampled ones, uint8 [n, H, W, 3]; dropped by
    EncodeVideo), grid_thw, tokens, frames_indices, timestamps, fps, error (`_VIDEO_INFO` travels too)."""

    def __init__(self, bytes_column: str, settings: dict, max_video_pixels, patching: Patching, capacity_tokens: int):
        self.column, self.settings, self.max_pixels = bytes_column, settings, max_video_pixels
        self.patching, self.capacity = patching, capacity_tokens

    def __call__(self, batch):
        import pandas as pd

        from .checks import check_frame_group
        from .preprocessing.video import plan_video
        from .preprocessing.video_files import VideoFile

        data = batch.pop(self.column)
        names = batch["path"] if "path" in batch else [_unnamed(i) for i in range(len(data))]
        cols = {k: [] for k in ("frames", "grid_thw", "tokens", "frames_indices", "timestamps", "fps", "error",
                                *_VIDEO_INFO)}
        for blob, name in zip(data, names):
            try:
                frames, grid, info = plan_video(VideoFile(_file_bytes(blob, name), self.max_pixels), name=str(name),
                                                patching=self.patching, **self.settings)
                check_frame_group(str(name), grid[1], grid[2], self.patching.merge_size, self.capacity)
                got = {"frames": np.stack(frames), "grid_thw": np.array(grid, np.int64), "tokens": info["tokens"],
                       "frames_indices": np.array(info["frames_indices"], np.int64), "fps": float(info["fps"]),
                       "timestamps": np.array(info["timestamps"], np.float64), "error": None,
                       **{k: np.array(info[k.removesuffix("_hw")], np.int64) for k in _VIDEO_INFO}}
            except (ImageError, ValueError) as e:  # a failed row: empty arrays (one type per column)
                if isinstance(e, TooShort):  # the sampler's advice names preprocess_video's sample=, not offered here
                    e = e.advised("raise encode_video_dataset's target_fps to sample it")
                elif isinstance(e, Untimed):  # the reader's advice is a video's fps=, which the pipeline takes none of
                    e = e.advised(UNTIMED)
                got = {"frames": np.zeros((0, 0, 0, 3), np.uint8), "grid_thw": np.zeros(3, np.int64), "tokens": 0,
                       "frames_indices": np.zeros(0, np.int64), "timestamps": np.zeros(0), "fps": float("nan"),
                       "error": str(e), **{k: np.zeros(2, np.int64) for k in _VIDEO_INFO}}
            for k, v in got.items():
                cols[k].append(v)
        for k, v in cols.items():
            batch[k] = pd.array(v, dtype="string") if k == "error" else (np.array(v) if k in ("tokens", "fps") else v)
        return batch


# A file whose packets span no time: the pipeline has no video's own fps to read it by (target_fps is the rate
# sampled).
UNTIMED = (f"encode_video_dataset takes no video's own fps (target_fps is the rate it samples at): {Untimed.REMUX}; "
           "or encode it with GlmVit.encode_video(path, fps=FPS)")
_VIDEO_INFO = ("size_hw", "canvas_hw", "content_hw")  # what the actor's resize needs besides the frames


class EncodeVideo(Encode):
    """The tower, loaded once per actor: each batch's videos -> embeddings, their frame groups packed into
    passes of up to capacity_tokens."""

    def __call__(self, batch):
        import pandas as pd

        frames, grids = list(batch.pop("frames")), list(batch["grid_thw"])
        info = {k: list(batch.pop(k)) for k in _VIDEO_INFO}
        errors = [None if pd.isna(e) else str(e) for e in batch["error"]]
        names = batch["path"] if "path" in batch else [_unnamed(i) for i in range(len(frames))]
        rows = [i for i, e in enumerate(errors) if e is None]
        m2 = self.backend.geometry.spatial_merge_size ** 2
        planned = []
        for i in rows:
            grid = tuple(int(v) for v in grids[i])
            planned.append((list(frames[i]), grid, {"source": str(names[i]), "frame_tokens": grid[1] * grid[2] // m2,
                                                     "tokens": grid[0] * grid[1] * grid[2] // m2,
                                                     **{k.removesuffix("_hw"): tuple(int(v) for v in info[k][i])
                                                        for k in _VIDEO_INFO}}))
        return self._finish(batch, errors, rows, lambda: self.backend.encode_video_on(0, planned))


# The columns each pipeline adds, or adds and drops on the way (an input column of one of these names is refused).
IMAGE_COLUMNS = ("canvas", "content_hw", "grid_thw", "tokens", "embedding", "error")
VIDEO_COLUMNS = ("frames", "grid_thw", "tokens", "frames_indices", "timestamps", "fps", "embedding", "error",
                 *_VIDEO_INFO)


def embedding_bytes(batch):
    """For Parquet and other columnar files (a pandas batch): `embedding` replaced by `embedding_bf16`,
    its bf16 bits as bytes (little-endian, row-major [tokens, out_hidden]; empty for a failed row).
    Back to an array: np.frombuffer(b, ml_dtypes.bfloat16).reshape(tokens, -1)."""
    import ml_dtypes

    batch["embedding_bf16"] = [np.asarray(e).astype(ml_dtypes.bfloat16).tobytes() for e in batch.pop("embedding")]
    return batch


def _actors(ds, bytes_column, cpu, num_gpus, concurrency, checkpoint, added, batch_size):
    """(num_gpus, concurrency, patching) for the encoder actors, every argument checked on the driver: the
    arguments' own values first, then the checkpoint, then what needs Ray (the dataset's columns, which may
    read its first files; the cluster's GPUs, which only Ray knows: the driver's host may have none)."""
    import ray

    from .checkpoint.bind import bind_tower
    from .checks import check_positive

    check_positive("batch_size", batch_size, " (rows to a Prepare or Encode call)")
    if cpu and num_gpus is not None:
        raise ValueError(f"num_gpus={num_gpus!r} with cpu=True: the float32 reference runs in CPU actors that use no "
                         "GPU; drop num_gpus, or drop cpu=True to encode on GPUs")
    if num_gpus is None:
        num_gpus = 1
    elif isinstance(num_gpus, bool) or not isinstance(num_gpus, (int, float)) or not 0 < num_gpus < float("inf"):
        raise ValueError(f"num_gpus={num_gpus!r}: GPUs per encoder actor must be a number above 0 "
                         "(1: a GPU each, 0.5: two actors share one)")
    if concurrency is not None:
        concurrency = check_positive("concurrency", concurrency, " (encoder actors), or None: one a GPU")
    patching = Patching.of(bind_tower(checkpoint).geometry)  # a bad checkpoint fails here, not in every actor
    columns = ds.columns()
    if columns is None:  # no schema: a dataset of no rows (ray.data.from_items([]))
        raise ValueError("the dataset has no columns (no rows to read them from); "
                         "ray.data.read_binary_files(..., include_paths=True) gives 'bytes' and 'path'")
    if bytes_column not in columns:
        raise ValueError(f"the dataset has no column {bytes_column!r} (it has {columns}); "
                         "ray.data.read_binary_files(..., include_paths=True) gives 'bytes' and 'path'")
    taken = sorted(set(columns).difference([bytes_column]).intersection(added))
    if taken:  # "every input column but the bytes is kept": these would be overwritten or dropped
        raise ValueError(f"the dataset's column{'s' if len(taken) > 1 else ''} {', '.join(map(repr, taken))} "
                         f"{'are' if len(taken) > 1 else 'is'} one the pipeline adds (or uses on the way): "
                         "rename it first (ds.rename_columns), or drop it")
    gpus = ray.cluster_resources().get("GPU", 0)
    if not cpu and gpus < num_gpus:
        raise ValueError(f"the Ray cluster has {gpus:g} GPUs, and each encoder actor asks for {num_gpus:g}: its "
                         "actors would wait forever; add GPU nodes, or pass cpu=True for the float32 reference")
    if concurrency is None:
        concurrency = 1 if cpu else max(1, int(gpus // num_gpus))
    return num_gpus, concurrency, patching


def encode_dataset(ds, checkpoint, *, bytes_column: str = "bytes", cpu: bool = False, num_gpus: float | None = None,
                   concurrency: int | None = None, capacity_tokens: int = 8000, min_image_tokens: int = 16,
                   max_image_tokens: int | None = None, max_pixels: int | None = None,
                   batch_size: int = 16):
    """A Ray Dataset with one image file per row (its bytes in `bytes_column`) -> the same rows with
    tokens, grid_thw, embedding and error (see the module's docstring). `max_image_tokens`: default 8000,
    lowered to `capacity_tokens` (as GlmVit.encode's). `num_gpus`: GPUs per encoder actor
    (default 1; a fraction shares a GPU; not with cpu=True, whose actors use none). `concurrency`: encoder
    actors (default: as many as the cluster's GPUs allow at `num_gpus` each; 1 with cpu=True)."""
    import ray

    from .checks import check_capacity, check_max_pixels

    capacity_tokens = check_capacity(capacity_tokens)  # on the driver, before any row is read
    min_image_tokens, max_image_tokens = image_limits(capacity_tokens, min_image_tokens, max_image_tokens)
    check_max_pixels(max_pixels)
    num_gpus, concurrency, patching = _actors(ds, bytes_column, cpu, num_gpus, concurrency, checkpoint,
                                              IMAGE_COLUMNS, batch_size)
    # On GPUs the decoded image travels and the actor's GPU resizes it (bit for bit as Pillow); the float32
    # reference takes Pillow's canvas.
    prepared = ds.map_batches(Prepare(bytes_column, min_image_tokens, max_image_tokens, max_pixels,
                                      "host" if cpu else "gpu", patching),
                              batch_format="pandas", batch_size=batch_size)
    return prepared.map_batches(Encode, fn_constructor_args=(checkpoint, cpu, capacity_tokens, max_image_tokens),
                                compute=ray.data.ActorPoolStrategy(size=concurrency), num_gpus=0 if cpu else num_gpus,
                                batch_format="pandas", batch_size=batch_size)


def encode_video_dataset(ds, checkpoint, *, bytes_column: str = "bytes", cpu: bool = False,
                         num_gpus: float | None = None, concurrency: int | None = None, capacity_tokens: int = 8000,
                         target_fps: float = 2, max_frames: int = 2048, min_video_tokens: int = 16,
                         max_video_tokens: int = 240_000, max_video_pixels: int | None = 2**32, batch_size: int = 4):
    """A Ray Dataset with one video file per row -> the same rows with tokens, grid_thw, frames_indices,
    timestamps, fps, embedding and error (the module's docstring), each video preprocessed as
    preprocess_video(path, target_fps=, max_frames=, min_image_tokens=min_video_tokens,
    max_image_tokens=max_video_tokens) would. A video one of whose frame groups is over capacity_tokens,
    or whose sampled frames have more than max_video_pixels pixels, fails its row. num_gpus and
    concurrency as for encode_dataset; batch_size videos to an actor call (their frames in memory at once)."""
    import ray

    from .checks import check_capacity, check_positive, check_token_limits

    capacity_tokens = check_capacity(capacity_tokens)
    check_positive("max_frames", max_frames)
    min_video_tokens, max_video_tokens = check_token_limits(min_video_tokens, max_video_tokens, "video")
    if min_video_tokens > max_video_tokens:
        raise ValueError(f"min_video_tokens={min_video_tokens} is above max_video_tokens={max_video_tokens}")
    if isinstance(target_fps, (bool, np.bool_)) or not isinstance(target_fps, (int, float, np.integer, np.floating)) \
            or not 0 < target_fps < float("inf"):
        raise ValueError(f"target_fps={target_fps!r} must be a positive number of frames a second")
    target_fps = float(target_fps)
    if max_video_pixels is not None:
        check_positive("max_video_pixels", max_video_pixels, " (a video's sampled frames' pixels together), or None")
    num_gpus, concurrency, patching = _actors(ds, bytes_column, cpu, num_gpus, concurrency, checkpoint,
                                              VIDEO_COLUMNS, batch_size)
    settings = {"target_fps": target_fps, "max_frames": max_frames, "min_image_tokens": min_video_tokens,
                "max_image_tokens": max_video_tokens}
    prepared = ds.map_batches(PrepareVideo(bytes_column, settings, max_video_pixels, patching, capacity_tokens),
                              batch_format="pandas", batch_size=batch_size)
    return prepared.map_batches(EncodeVideo, fn_constructor_args=(checkpoint, cpu, capacity_tokens),
                                compute=ray.data.ActorPoolStrategy(size=concurrency), num_gpus=0 if cpu else num_gpus,
                                batch_format="pandas", batch_size=batch_size)
