#!/usr/bin/env python3
"""Images -> GLM-5.3-Flash embeddings as Parquet, on a local Ray or a Ray cluster, resumable.

    python examples/ray_encode.py photos/ --checkpoint /models/GLM-5.3-Flash --out embeddings/
    python examples/ray_encode.py 's3://bucket/photos/' --checkpoint zai-org/GLM-5.3-Flash --out /shared/emb \\
        --address auto --concurrency 8

Input: a folder (walked), a glob, or a cloud prefix Ray can list (s3://, gs://, ...). Output: Parquet
files in --out, one row per image: path, tokens, grid_thw, error (null if fine) and embedding_bf16,
the embedding's bf16 bits (little-endian, row-major [tokens, out_hidden]; empty for a failed image);
back to an array with
`np.frombuffer(row["embedding_bf16"], ml_dtypes.bfloat16).reshape(row["tokens"], -1)`. Re-running
skips every path already in --out (failed ones included: their error is recorded); with --retry-failed it
encodes the failed ones again, and each one's new row replaces its failed one.
"""

import argparse
import glob
import json
import os
import signal
import sys
import threading
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # run from a checkout without installing
from glmvit_cupy.cli.common import interruption, stopped_by_sigterm  # noqa: E402 - Ctrl-C and SIGTERM as glmvit-encode
from glmvit_cupy.files import open_lock_file, open_regular  # noqa: E402 - lock files and inputs, checked
from glmvit_cupy.output import path_text  # noqa: E402 - a path that is not UTF-8: the repr() of its bytes

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
MAX_IMAGE_MIB = 64  # as glmvit-encode's: a file is read whole, so a larger one fails its row unread
MIN_IMAGE_TOKENS = 16  # the fewest tokens an image is resized to (encode_dataset's min_image_tokens default)
SETTINGS = ".ray_encode.settings.json"  # in --out: what shapes its embeddings (a resume must match it)
STAGING = ".staging-"  # in --out: Ray writes a run's files here; each is moved up once whole
REWRITE = ".rewrite"  # a file of --out being written again without its replaced rows: .NAME.rewrite, hidden


def store(out):
    """(pyarrow file system, root, join) of --out: a local folder, or a URI (file://, s3://, gs://, ...)."""
    import pyarrow.fs as pafs

    if "://" in out:
        fs, root = pafs.FileSystem.from_uri(out)
        return fs, root.rstrip("/") or "/", lambda a, b: f"{a.rstrip('/')}/{b}"
    return pafs.LocalFileSystem(), out, os.path.join


def listed(fs, folder):
    """The FileInfos of a folder's entries (none where it does not exist)."""
    from pyarrow.fs import FileSelector

    return fs.get_file_info(FileSelector(folder, allow_not_found=True))


def move(fs, src, dst):
    """src -> dst (a rename where the file system has them); OSError saying why not."""
    if isinstance(fs, __import__("pyarrow.fs", fromlist=["LocalFileSystem"]).LocalFileSystem):
        os.replace(src, dst)
    else:
        fs.move(src, dst)


def local_files(spec):
    """The image files of a folder or glob as resolved absolute paths (a resume finds them however the input
    is spelled), or None for a cloud prefix (Ray lists those itself). Entries that are not regular files
    this user can read (a broken symbolic link, a FIFO, a device, a file without read permission) are passed
    over, naming the first and counting them: Ray would fail the whole job on one (a FIFO's read never
    ends)."""
    if "://" in spec:
        return None
    if os.path.isdir(spec):
        found = [os.path.join(r, f) for r, _, fs in os.walk(spec) for f in fs if f.lower().endswith(IMAGE_EXTENSIONS)]
    else:
        found = [p for p in glob.glob(spec, recursive=True) if not os.path.isdir(p)]
    odd = sorted(p for p in found if not os.path.isfile(p) or not os.access(p, os.R_OK))
    if odd:
        print(f"ray_encode: passed over {len(odd)} of the inputs that are not regular files this user can read "
              f"(a broken symbolic link, a FIFO, a device, no read permission), e.g. {odd[0]}")
    return sorted({os.path.realpath(p) for p in found}.difference(os.path.realpath(p) for p in odd))


class Done(NamedTuple):
    """What --out holds: paths (as written), foreign (Parquet files there that are not this
    example's), failed (the paths whose every row there is a failed one, as written) and files (this example's
    Parquet files there)."""
    paths: set
    foreign: set
    failed: set
    files: list


def drop_failed(out, file, paths) -> int:
    """The failed rows (an error) of Parquet file `file` in --out whose path is one of `paths`, removed: the
    file written again without them under a hidden name, then moved over it; deleted where no row is left.
    How many rows were removed."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    fs, root, join = store(out)
    table = pq.read_table(file, filesystem=fs)
    if "error" not in table.column_names:
        return 0
    drop = pc.and_(pc.is_in(table["path"], value_set=pa.array(sorted(paths), pa.string())),
                   pc.is_valid(table["error"])).fill_null(False)
    count = pc.sum(drop).as_py() or 0
    if count == len(table):
        fs.delete_file(file)
    elif count:
        again = join(root, f".{file.rsplit('/', 1)[-1]}{REWRITE}")
        pq.write_table(table.filter(pc.invert(drop)), again, filesystem=fs)
        move(fs, again, file)
    return count


def done_paths(out) -> Done:
    """What the output's Parquet files hold (Done). Files a run
    staged (.staging-*/, hidden) and did not move up, because it was stopped, are moved up where they read
    whole. A file that cannot be read (a damaged page, or one a killed run was writing) is moved aside as
    .NAME.unreadable (a hidden name, which Parquet readers pass over), saying so: its rows are encoded again. A
    Parquet file without a text path column is not one of ours: passed over, saying so. Paths held by more than
    one row (two runs at once where the folder cannot be locked, or a killed run's workers finishing their last
    writes during a re-run) are counted and said. A failed row of a path another row holds encoded (left by a
    --retry-failed run stopped before it removed the rows it replaced) is removed; so is a hidden file such a
    run was writing again (.NAME.rewrite: the file it came from is whole)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyarrow.fs import FileType

    fs, root, join = store(out)

    def aside(f, why):
        hidden = join(root, f".{f.rsplit('/', 1)[-1]}.unreadable")
        try:
            move(fs, f, hidden)
        except OSError as moved:
            raise SystemExit(f"ray_encode: {f} cannot be read ({why}) and cannot be moved aside "
                             f"({moved.strerror or moved}): remove it, and re-run") from None
        print(f"ray_encode: {f} cannot be read ({why}); moved aside as {os.path.basename(hidden)}, its rows "
              "are encoded again")

    def problem(f):
        try:
            pq.read_metadata(f, filesystem=fs)
        except (pa.ArrowException, OSError) as e:  # no footer (cut short), or not Parquet
            return " ".join(str(e).split())[:160]
        return None

    entries = listed(fs, root)
    for e in entries:
        if e.type == FileType.File and e.base_name.startswith(".") and e.base_name.endswith(f".parquet{REWRITE}"):
            fs.delete_file(e.path)
    for stage in (e for e in entries if e.type == FileType.Directory and e.base_name.startswith(STAGING)):
        for e in listed(fs, stage.path):
            if e.type == FileType.File and e.base_name.endswith(".parquet"):
                why = problem(e.path)
                if why is None:
                    move(fs, e.path, join(root, e.base_name))
                else:
                    aside(e.path, why)
        if not listed(fs, stage.path):
            fs.delete_dir(stage.path)
    files = sorted(join(root, e.base_name) for e in listed(fs, root) if e.type == FileType.File
                   and e.base_name.endswith(".parquet") and not e.base_name.startswith("."))
    paths, foreign, ours, rows, encoded, failed = set(), set(), [], 0, set(), {}
    for f in files:
        try:
            schema = pq.read_schema(f, filesystem=fs)
            kind = schema.field("path").type if "path" in schema.names else None
            if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                print(f"ray_encode: {f} has no path column of text ({kind or 'none'}), so it is not one of this "
                      "example's files: passed over")
                foreign.add(f)
                continue
            columns = ["path", "error"] if "error" in schema.names else ["path"]
            found = [r for r in pq.read_table(f, columns=columns, filesystem=fs).to_pylist() if r["path"] is not None]
            paths.update(r["path"] for r in found)
            rows += len(found)
            for r in found:
                if r.get("error") is None:
                    encoded.add(r["path"])
                else:
                    failed.setdefault(r["path"], set()).add(f)
            ours.append(f)
        except (pa.ArrowException, OSError) as e:  # no footer (cut short), or a damaged page
            aside(f, " ".join(str(e).split())[:160])
    replaced = {p for p in failed if p in encoded}
    if replaced:
        rows -= sum(drop_failed(out, f, replaced) for f in sorted(set().union(*(failed[p] for p in replaced))))
        ours = [f for f in ours if fs.get_file_info(f).type == FileType.File]  # one of failed rows only: deleted
    if rows > len(paths):
        n = rows - len(paths)
        print(f"ray_encode: {n} {'row' if n == 1 else 'rows'} of {out} {'repeats' if n == 1 else 'repeat'} a path "
              "that another row there holds (two runs "
              "into it at once: a cloud --out, or a file system without locks; or the Ray workers of a killed "
              "run finishing their last writes during a re-run): the repeats hold the same file's embedding; "
              "keep one row a path when reading (pandas: drop_duplicates('path'))")
    return Done(paths, foreign, set(failed) - encoded, ours)


def spellings(paths) -> set:
    """paths, with the real path of each local one: the same files given otherwise are found too."""
    return paths | {os.path.realpath(p) for p in paths if "://" not in p}


def check_settings(out, settings: dict, holds: bool):
    """The settings that shape an --out's embeddings, recorded in it by its first run; ValueError where a
    resume's differ (its rows would sit beside rows of other settings, with nothing to tell them apart).
    holds: --out holds rows already; where it holds none (a first run that stopped before its first write,
    say one without --cpu on a cluster without GPUs), this run's settings replace those recorded."""
    fs, root, join = store(out)
    path = join(root, SETTINGS)
    try:
        with fs.open_input_stream(path) as f:
            had = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        had = None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}): remove it only if every file in {out} was encoded with "
                         "this run's settings") from None
    if had is None or (not holds and had != settings):
        fs.create_dir(root, recursive=True)  # a URI's folder, before Ray makes it
        with fs.open_output_stream(path) as f:
            f.write(json.dumps(settings, indent=1, sort_keys=True).encode())
        return
    differs = [k for k in sorted(set(had) | set(settings)) if had.get(k) != settings.get(k)]
    if differs:
        told = "; ".join(f"{k} {str(had.get(k))[:16]} there, {str(settings.get(k))[:16]} now" for k in differs)
        raise ValueError(f"--out {out} holds embeddings of other settings ({told}): one folder holds one setting "
                         "(use another --out, or the same settings to resume)")


LOCK = ".ray_encode.lock"  # in --out (a hidden name, which Parquet readers pass over)


def lock_out(out):
    """The open lock file of a local --out, locked (flock) for this run: a second run into the same folder
    while one writes would encode every file the first has not finished again, so it is refused, naming the
    pid that holds it. None where no lock file can be made (an --out this user may not write, or a platform
    without flock); the file, unlocked, where the file system has no locks."""
    try:
        import fcntl
    except ImportError:
        return None
    path = os.path.join(out, LOCK)
    try:  # never through a link (a pid written over what it points to), nor waiting on a FIFO for a writer
        f = open_lock_file(path, lambda what: ValueError(f"{path} is not a regular file ({what}), not the lock file "
                                                         "ray_encode makes: remove it, or give another --out"), "r+")
    except OSError:
        if os.path.islink(path) or os.path.isdir(path):
            raise ValueError(f"{path} is a {'symbolic link' if os.path.islink(path) else 'folder'}, not the lock "
                             "file ray_encode makes: remove it, or give another --out") from None
        return None  # an --out this user may not write: what needs writing there fails, saying so
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ValueError(f"--out {out} is being written by another ray_encode run (pid {holder}): wait for it to "
                         "end, then re-run to encode what it left (two runs at once would encode the same files "
                         "twice), or give another --out") from None
    except OSError:  # a file system without locks
        return f
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def main(argv=None) -> int:
    """run(argv); 2 with one line on stderr for a bad flag, input, checkpoint or output folder; 130 on Ctrl-C,
    143 on SIGTERM, saying that the same command resumes."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stopped_by_sigterm) if main_thread else None
    try:
        return run(argv)
    except (ValueError, OSError) as e:  # CheckpointError, a setting out of range, an --out that cannot be written
        print(f"ray_encode: {str(e).replace('cpu=True', '--cpu')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (a scheduler stopping the job) taken as one
        word, status = interruption(e)
        print(f"\nray_encode: {word}; the same command resumes from the Parquet files written", file=sys.stderr)
        return status
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)  # a caller's own (the tests call main in process)


def run(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="folder, glob or cloud prefix of images")
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder or Hub id, readable by every worker")
    ap.add_argument("--out", required=True, help="output folder of Parquet files (re-running resumes)")
    ap.add_argument("--address", default=None, help="Ray cluster address (e.g. auto); default: a local Ray")
    ap.add_argument("--cpu", action="store_true", help="the float32 reference in CPU actors (slow; no GPU)")
    ap.add_argument("--concurrency", type=int, default=None, help="encoder actors (default: one per GPU)")
    ap.add_argument("--num-gpus", type=float, default=None, help="GPUs per encoder actor (default 1; not with --cpu)")
    ap.add_argument("--capacity-tokens", type=int, default=8000, help="tokens per forward pass (default 8000)")
    ap.add_argument("--max-image-tokens", type=int, default=None,
                    help="per-image token limit (default 8000, lowered to --capacity-tokens)")
    ap.add_argument("--max-pixels", type=int, default=None, metavar="N",
                    help="pixels an image may have before it is refused as a decompression bomb (default: "
                         "Pillow's limit, 89,478,485)")
    ap.add_argument("--retry-failed", action="store_true",
                    help="encode again the images whose rows in --out failed; each new row replaces the failed one")
    ap.add_argument("--max-image-mib", type=float, default=MAX_IMAGE_MIB, metavar="MIB",
                    help=f"a larger file fails its row unread (default {MAX_IMAGE_MIB}; a file is read whole)")
    args = ap.parse_args(argv)
    if not 0 < args.max_image_mib < float("inf"):
        ap.error(f"--max-image-mib {args.max_image_mib:g}: give a positive size in MiB")
    if args.max_pixels is not None and args.max_pixels < 1:
        ap.error(f"--max-pixels {args.max_pixels}: give a positive number of pixels")
    if args.cpu and args.num_gpus is not None:
        ap.error("--num-gpus with --cpu: the float32 reference runs in CPU actors that use no GPU; drop one of them")
    if args.num_gpus is not None and not 0 < args.num_gpus < float("inf"):
        ap.error(f"--num-gpus {args.num_gpus:g}: GPUs per encoder actor must be above 0 (0.5: two actors share one)")
    # The flags' values are checked here, and a local input listed below, before --out is made and before Ray
    # starts (seconds, and processes to stop). The check for GPUs waits for Ray: ray.init without --address
    # may join a running cluster (RAY_ADDRESS, or the last `ray start` on this host), whose GPUs this host
    # need not have.
    if args.concurrency is not None and args.concurrency < 1:
        ap.error(f"--concurrency {args.concurrency}: give a positive number of encoder actors, or leave it out "
                 "for one a GPU (one with --cpu)")
    if args.capacity_tokens < MIN_IMAGE_TOKENS:
        ap.error(f"--capacity-tokens {args.capacity_tokens}: give at least {MIN_IMAGE_TOKENS} (a pass holds a whole "
                 f"image, and an image is resized to {MIN_IMAGE_TOKENS} tokens or more); the default is 8000")
    if args.max_image_tokens is not None and not MIN_IMAGE_TOKENS <= args.max_image_tokens <= args.capacity_tokens:
        ap.error(f"--max-image-tokens {args.max_image_tokens}: give from {MIN_IMAGE_TOKENS} (the fewest tokens an "
                 f"image is resized to) up to --capacity-tokens ({args.capacity_tokens}: every image fits a pass), "
                 "or raise --capacity-tokens")
    from glmvit_cupy.checks import check_capacity, image_limits

    limits = image_limits(check_capacity(args.capacity_tokens), MIN_IMAGE_TOKENS, args.max_image_tokens)

    try:  # before --out is made: nothing is left behind
        import ray
    except ImportError as e:
        print(f"ray_encode: the ray extra is not installed ({e}): pip install -e '.[ray]' in the glmvit-cupy checkout",
              file=sys.stderr)
        return 2

    files = local_files(args.input)
    if files is not None and not files:
        print(f"ray_encode: no images found in {args.input} (a folder is walked for "
              f"{', '.join(IMAGE_EXTENSIONS)}; a glob takes every file it matches)", file=sys.stderr)
        return 2
    if "://" not in args.out:  # a local --out is made (or refused, saying why) before Ray starts
        if os.path.lexists(args.out) and not os.path.isdir(args.out):
            raise ValueError(f"--out {args.out} is a file, not a folder; give a folder (it is created if absent)")
        os.makedirs(args.out, exist_ok=True)
        lock = lock_out(args.out)  # held until this run ends (closed when run returns, or the process dies)
    else:
        lock = None
    try:
        return encode(args, ray, limits, files)
    finally:
        if lock is not None:
            lock.close()


def read_files(max_bytes: int):
    """A map_batches function (pandas) of a local listing: "source" (a path's bytes) -> "bytes" (the file's),
    and "read_error", why a file could not be read (gone since it was listed, over --max-image-mib, no longer
    a regular file): that row fails, not the job, as Ray's own reader would fail it. Made here, a closure,
    so Ray ships it by value (the workers cannot import this example)."""
    def read(batch):
        import pandas as pd

        blobs, errors = [], []
        for source, name in zip(batch.pop("source"), batch["path"]):
            try:  # a FIFO or a device: refused, never read (a FIFO's read waits for a writer)
                with open_regular(os.fsdecode(bytes(source)), "the image", OSError) as f:
                    st = os.fstat(f.fileno())
                    if st.st_size > max_bytes:
                        raise OSError(f"{st.st_size / 2**20:,.1f} MiB, over --max-image-mib {max_bytes / 2**20:g}")
                    data = f.read(st.st_size + 1)  # read(n) allocates n bytes: what the file holds, not the limit
                    if len(data) > st.st_size:  # it grew since: up to one byte past the limit
                        data += f.read(max_bytes + 1 - len(data))
                if len(data) > max_bytes:
                    raise OSError(f"over --max-image-mib {max_bytes / 2**20:g} (it grew while read)")
                blobs.append(data), errors.append(None)
            except OSError as e:
                blobs.append(b""), errors.append(f"{name}: cannot read the file ({e.strerror or e})")
        batch["bytes"], batch["read_error"] = blobs, pd.array(errors, dtype="string")
        return batch

    return read


def finisher():
    """A map_batches function (pandas): embedding_bytes, with a row's read error (if any) as its error, the
    reading's column dropped (a closure, shipped by value as read_files')."""
    def finish(batch):
        import pandas as pd

        import glmvit_cupy.ray as gvr

        if "read_error" in batch:
            read = batch.pop("read_error")
            batch["error"] = pd.array([e if pd.isna(r) else r for r, e in zip(read, batch["error"])], dtype="string")
        return gvr.embedding_bytes(batch)

    return finish


def encode(args, ray, limits: tuple[int, int], files: list | None) -> int:
    """The run once its flags are checked: limits, the (min, max) image tokens they come to; files, the local
    input's image files (local_files), or None for a cloud prefix, which Ray lists."""
    import uuid

    import pyarrow.parquet as pq

    import glmvit_cupy.ray as gvr
    from glmvit_cupy.checkpoint.bind import bind_tower

    held = done_paths(args.out)
    retried = held.failed if args.retry_failed else set()
    done = spellings(held.paths - retried)  # every spelling of a local path: the same files given otherwise too
    if files is not None:
        files = [f for f in files if path_text(f) not in done]
        if not files:
            n = len(held.failed)
            again = (f" ({n} failed: {'its error is' if n == 1 else 'their errors are'} recorded there; "
                     f"--retry-failed encodes {'it' if n == 1 else 'them'} again)") if n else ""
            print(f"ray_encode: all images of {args.input} are already in {args.out}{again}")
            return 0
    # What shapes an embedding, fixed for the folder (the pixel and size limits only accept or refuse a file).
    low, high = limits
    binding = bind_tower(args.checkpoint)
    check_settings(args.out, {"weights": binding.fingerprint, "cpu": args.cpu, "min_image_tokens": low,
                              "max_image_tokens": high},  # the tower by its fingerprint: wherever it lies
                   holds=bool(done))
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, stopped_by_sigterm)  # Ray's own handler dumps a stack and exits 15
    if files is not None:  # read here, a row at a time: a file Ray cannot open would fail the whole job
        ds = ray.data.from_items([{"path": path_text(f), "source": os.fsencode(f)} for f in files])
        ds = ds.map_batches(read_files(int(args.max_image_mib * 2**20)), batch_format="pandas")
    else:
        ds = ray.data.read_binary_files(args.input, include_paths=True)
        if done:
            ds = ds.filter(lambda row: row["path"] not in done)
    out = gvr.encode_dataset(ds, args.checkpoint, cpu=args.cpu, num_gpus=args.num_gpus, concurrency=args.concurrency,
                             capacity_tokens=args.capacity_tokens, max_image_tokens=args.max_image_tokens,
                             max_pixels=args.max_pixels)
    fs, root, join = store(args.out)
    stage = join(root, f"{STAGING}{uuid.uuid4().hex}")  # hidden: readers of --out see whole files only
    staged = join(args.out, os.path.basename(stage)) if "://" in args.out else stage
    t0 = time.perf_counter()
    out.map_batches(finisher(), batch_format="pandas").write_parquet(staged)
    dt = time.perf_counter() - t0
    from pyarrow.fs import FileType

    rows = {}
    for e in listed(fs, stage):
        if e.type == FileType.File and e.base_name.endswith(".parquet"):
            rows.update((r["path"], r["error"]) for r in
                        pq.read_table(e.path, columns=["path", "error"], filesystem=fs).to_pylist())
            move(fs, e.path, join(root, e.base_name))
    if not listed(fs, stage):
        fs.delete_dir(stage)
    if retried:  # each retried path's new row replaces its failed one (this run's files are moved up whole first)
        new = spellings(set(rows))
        replaced = {p for p in retried if p in new or ("://" not in p and os.path.realpath(p) in new)}
        import pyarrow as pa

        for f in held.files:
            try:
                drop_failed(args.out, f, replaced)
            except (pa.ArrowException, OSError) as e:
                print(f"ray_encode: {f}: its failed rows of the images encoded again were not removed ("
                      f"{' '.join(str(e).split())[:160]}); the next run removes those now encoded")
    failed, before = sum(e is not None for e in rows.values()), len(held.paths - retried)
    print(f"ray_encode: {len(rows)} image{'s' if len(rows) != 1 else ''} in {dt:.1f} s ({len(rows) / dt:.1f} "
          f"images/s), {failed} failed; {before} {'was' if before == 1 else 'were'} already done; output in "
          f"{args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
