"""WeightStore: memory-mapped safetensors shards with every header checked up front.

A GLM-5.3 checkpoint's shards hold hundreds of GB of text weights in FP8, U8 and
F32 beside the 1 GiB BF16 vision tower. The store parses and validates every
header it opens before any tensor byte is touched, maps the files read-only, and
reads only the tensors a caller asks for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import struct
import types
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import CheckpointError, GpuUnavailable, quoted
from ..files import identity, json_values, not_regular, open_regular, read_json_file, repeated_key

# The safetensors dtype names this store can map (dtypes() gives their NumPy types).
DTYPE_NAMES = ("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "U16", "I16", "F16", "BF16", "U32", "I32", "F32",
               "U64", "I64", "F64")


# Dtypes the safetensors format has that this store indexes but does not map (a text model's packed 4- and
# 6-bit weights, complex numbers): their bits an element. A checkpoint may hold them beside the tower, which
# is BF16 (require_bf16); get() refuses them by name.
UNMAPPED_BITS = types.MappingProxyType({"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64})


@functools.cache
def dtypes() -> types.MappingProxyType:
    """The NumPy type of each safetensors dtype name. ml_dtypes (bf16, the fp8 types) is imported here, on first
    use: its import takes ~0.5 s, which `import glmvit_cupy` and every command's --help would otherwise pay."""
    import ml_dtypes

    numpy_types = (np.bool_, np.uint8, np.int8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu,
                   np.uint16, np.int16, np.float16, ml_dtypes.bfloat16, np.uint32, np.int32, np.float32, np.uint64,
                   np.int64, np.float64)
    return types.MappingProxyType({name: np.dtype(t) for name, t in zip(DTYPE_NAMES, numpy_types, strict=True)})


MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on a header
MAX_DIM = 2**40  # NumPy refuses an array whose dimension times its itemsize passes 2**63
# A shard of a whole GLM-5.3 checkpoint names a few thousand tensors; a 100 MB header of a million empty ones
# takes ~1 GB and ~20 s to parse. Counted before parsing (each entry has one "data_offsets" key).
MAX_TENSORS = 250_000
# A tensor's entry holds 7 JSON values and its shape's sizes (4 or 5 dimensions at most in a real checkpoint);
# beyond what its tensors take, a header holds its __metadata__'s few. Counted before parsing (files.json_values): 100 MB of
# empty lists beside one tensor took 14 s and 2.7 GB to parse, nested ones 48 s and 5 GB.
VALUES_PER_TENSOR = 12
SPARE_VALUES = 65_536
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live, as its shard header declares them."""

    name: str
    dtype: str
    shape: tuple
    file: str
    offset: int  # absolute byte offset in the file
    nbytes: int
    identity: tuple = ()  # the shard's (device, inode, size, mtime) when its header was read: mapped only as that
    header_sha256: bytes = b""  # the digest of the header's JSON bytes: a shard only touched since is mapped if equal


MAX_DIMS = 64  # NumPy's (and CuPy's) most dimensions an array has


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# What a Git LFS pointer file starts with: a repository cloned without Git LFS holds one, of some 130 bytes, in
# place of each large file (its shards).
LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _lfs_pointer(path: str, pointer: bytes) -> str:
    """The error for a Git LFS pointer file where a shard should be: what it is and how to fetch the shard."""
    m = re.search(rb"^size (\d{1,20})$", pointer, re.M)
    stands_for = f" for a {int(m[1]):,}-byte shard" if m else ""
    return (f"{path}: is a Git LFS pointer file ({len(pointer)} bytes{stands_for}), not the shard: the checkpoint was "
            "cloned without Git LFS, so its shards were never downloaded; run 'git lfs install' and 'git lfs pull' "
            "in the clone, or download the checkpoint with huggingface_hub (or give its Hub id)")


def _raw_header(path: str) -> tuple[bytes, tuple]:
    """The header's JSON bytes of a shard, and the file's identity (files.identity): CheckpointError for anything but a regular
    file whose 8-byte length and header fit in it."""
    try:
        with open_regular(path, "the shard") as f:
            ident = identity(os.fstat(f.fileno()))
            size = ident[2]
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short for the 8-byte safetensors header length")
            (hlen,) = struct.unpack("<Q", head)
            if head == LFS_POINTER[:8] and size <= 1024:  # 'version ': a length of 2.3e18, past the limit below
                pointer = head + f.read(1024)
                if pointer.startswith(LFS_POINTER):
                    raise CheckpointError(_lfs_pointer(path, pointer))
            if hlen > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit; "
                    "this is not a safetensors file (or it is corrupt)")
            if 8 + hlen > size:
                raise CheckpointError(
                    f"{path}: header length {hlen} runs past the end of the {size}-byte file (truncated?)")
            raw = f.read(hlen)
    except FileNotFoundError as e:  # a folder's listing holds a broken symbolic link by name: said as one
        broken = not_regular(path)
        raise CheckpointError(f"{path}: the shard is {broken}" if broken else f"{path}: cannot read shard ({e})") \
            from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard ({e})") from None
    return raw, ident


def read_metadata(path: str) -> dict:
    """A shard's __metadata__ ({} where it has none), its header read and parsed as read_header does;
    CheckpointError for a file that is not a safetensors shard."""
    meta = _parsed(path, _raw_header(path)[0]).get("__metadata__")
    return meta if isinstance(meta, dict) else {}


def _parsed(path: str, raw: bytes) -> dict:
    """A header's JSON object: CheckpointError for one that is not JSON, not an object, names a tensor twice, or
    lists more tensors than MAX_TENSORS (counted before parsing, and as it parses)."""
    def too_many(lists: str) -> CheckpointError:
        return CheckpointError(f"{path}: the header lists {lists} a shard may hold here (a real shard holds a few "
                               "thousand); the file is damaged or not a checkpoint")

    count = raw.count(b'"data_offsets"')
    if count > MAX_TENSORS:
        raise too_many(f"{count:,} tensors, more than the {MAX_TENSORS:,}")
    values, most = json_values(raw), VALUES_PER_TENSOR * count + SPARE_VALUES
    if values > most:
        raise CheckpointError(f"{path}: the header holds up to {values:,} JSON values (its commas and opening brackets, "
                              f"counted before parsing), more than the {most:,} its {count:,} tensors take "
                              f"({VALUES_PER_TENSOR} each at most, and {SPARE_VALUES:,} for its __metadata__); the file "
                              "is damaged or not a checkpoint")

    entries = objects = 0

    def unique(pairs):
        # A repeated name would shadow the first entry's bytes: refuse it (JSON alone keeps the last). Entries are
        # counted as they are parsed too: JSON may spell "data_offsets" with escapes the byte count above misses.
        # So is every object: a header holds one per tensor, itself and its __metadata__; millions of others
        # (empty ones in a list) would take gigabytes and half a minute through this hook.
        nonlocal entries, objects
        obj = dict(pairs)  # a repeated key leaves it shorter: looked for only then (the header's own has 250,000)
        entries += "data_offsets" in obj
        objects += 1
        if entries > MAX_TENSORS:
            raise too_many(f"more than the {MAX_TENSORS:,} tensors")
        if objects > MAX_TENSORS + 2:
            raise CheckpointError(f"{path}: the header holds more than {MAX_TENSORS + 2:,} JSON objects (one per "
                                  "tensor, the header and its __metadata__); the file is damaged or not a checkpoint")
        twice = repeated_key(pairs) if len(obj) < len(pairs) else None
        if twice is not None:
            raise CheckpointError(f"{path}: the header names tensor {quoted(twice, 120)} twice; each name must be unique")
        return obj

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except CheckpointError:  # unique's, a ValueError too: said as it is
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # nested too deep; an int past str()'s digits
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header


def read_header(path: str) -> dict:
    """Parse and validate one shard's header; return {name: TensorInfo}. Touches no tensor data."""
    raw, ident = _raw_header(path)
    header, size = _parsed(path, raw), ident[2]
    data_start = 8 + len(raw)
    data_len = size - data_start
    digest = hashlib.sha256(raw).digest()
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointError(f"{path}: __metadata__ must be an object of strings (the safetensors format), "
                                      f"got {quoted(entry, 80)}")
            continue
        where = f"{path}: tensor {quoted(name, 120)}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: header entry must be an object, got {entry!r:.80}")
        dtype = entry.get("dtype")
        if not isinstance(dtype, str) or (dtype not in DTYPE_NAMES and dtype not in UNMAPPED_BITS):
            raise CheckpointError(f"{where}: unknown dtype {quoted(dtype, 40)} (known: "
                                  f"{', '.join(DTYPE_NAMES + tuple(UNMAPPED_BITS))})")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise CheckpointError(f"{where}: shape {quoted(shape, 80)} is not a list of non-negative integers")
        if len(shape) > MAX_DIMS:
            raise CheckpointError(f"{where}: shape has {len(shape)} dimensions, more than the {MAX_DIMS} an array can "
                                  "have (NumPy's limit); the header is damaged")
        if any(d > MAX_DIM for d in shape):  # a zero-size tensor's other sizes are bounded by no byte count
            raise CheckpointError(f"{where}: shape {quoted(shape, 80)} has a dimension past {MAX_DIM:,} (2**40), more "
                                  "than any tensor has; the header is damaged")
        offs = entry.get("data_offsets")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise CheckpointError(f"{where}: data_offsets {quoted(offs, 80)} must be two integers [begin, end]")
        begin, end = offs
        if begin < 0 or end < begin:
            raise CheckpointError(f"{where}: data_offsets {quoted(offs, 80)} are negative or reversed")
        if end > data_len:
            raise CheckpointError(
                f"{where}: data_offsets {quoted(offs, 80)} lie outside the {data_len}-byte data section "
                "(the shard is truncated or its header is wrong)")
        bits = dtypes()[dtype].itemsize * 8 if dtype in DTYPE_NAMES else UNMAPPED_BITS[dtype]
        if bits * _prod(d for d in shape if d) >= 8 << 63:  # NumPy sizes a shape by its non-zero dimensions alone
            raise CheckpointError(f"{where}: dtype {dtype} x shape {quoted(tuple(shape), 80)} is past the 2**63 bytes an "
                                  "array may span, even with no element; the header is damaged")
        want, spare = divmod(bits * _prod(shape), 8)
        if spare:
            raise CheckpointError(f"{where}: dtype {dtype} x shape {quoted(tuple(shape), 80)} is not a whole number of "
                                  "bytes; the header is damaged")
        if want > data_len:  # also a product too long to print
            raise CheckpointError(
                f"{where}: dtype {dtype} x shape {quoted(tuple(shape), 80)} needs more bytes than the shard's "
                f"{data_len}-byte data section holds; the header is damaged")
        if end - begin != want:
            raise CheckpointError(
                f"{where}: {end - begin} bytes on disk, but dtype {dtype} x shape {quoted(tuple(shape), 80)} needs {want}")
        infos[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, end - begin, ident, digest)
    # The format indexes the data section whole, without holes or overlaps (so no bytes hide in it):
    # sorted by offset, each tensor starts where the one before ends, and the last ends at the file's end.
    end, prev = data_start, None
    for info in sorted(infos.values(), key=lambda i: (i.offset, i.nbytes)):
        if info.offset < end:
            raise CheckpointError(f"{path}: tensors {quoted(prev, 120)} and {quoted(info.name, 120)} overlap in the data section "
                                  f"(bytes {info.offset - data_start}-{info.offset - data_start + info.nbytes} "
                                  f"start before {end - data_start})")
        if info.offset > end:
            raise CheckpointError(f"{path}: {info.offset - end} bytes before tensor {quoted(info.name, 120)} belong to no "
                                  "tensor; the data section must be indexed whole (the header or file is corrupt)")
        end, prev = info.offset + info.nbytes, info.name
    if end != size:
        raise CheckpointError(f"{path}: the last {size - end} bytes of the data section belong to no tensor; "
                              "the data section must be indexed whole (the header or file is corrupt)")
    return infos


def list_folder(path: str) -> list[str]:
    """os.listdir of a checkpoint folder, or CheckpointError naming it (no permission to list it, an I/O error)."""
    try:
        return os.listdir(path)
    except OSError as e:
        raise CheckpointError(f"{path}: the checkpoint folder cannot be read as it cannot be listed ({e}); it must be "
                              f"a readable folder holding config.json and *.safetensors shards (or {INDEX_NAME})") \
            from None


def _shard_list(path) -> tuple[list[str], dict | None, str]:
    """Resolve what open() was given into (shard files, index weight_map or None, display name)."""
    if isinstance(path, (list, tuple)):
        files = [os.fspath(p) for p in path]
        if not files:
            raise CheckpointError("WeightStore.open: an empty list of shards")
        seen = {}
        for f in files:  # the same file twice would read as every tensor held twice
            key = os.path.realpath(f)
            if key in seen:
                raise CheckpointError(f"WeightStore.open: {seen[key]} and {f} are one file, listed twice; "
                                      "give each shard once")
            seen[key] = f
        return files, None, ", ".join(files)
    path = os.fspath(path)
    if os.path.isfile(path):
        if os.path.basename(path) == "config.json":
            raise CheckpointError(f"{path}: is the model's config; give its folder ({os.path.dirname(path) or '.'}), "
                                  f"which holds the shards (and {INDEX_NAME} where there are several)")
        if path.endswith(".json"):
            return _from_index(path)
        return [path], None, path
    if not os.path.isdir(path):
        what = not_regular(path)
        raise CheckpointError(f"{path}: is {what}, not a shard or checkpoint folder" if what else
                              f"{path}: no such file or directory")
    index = os.path.join(path, INDEX_NAME)
    if os.path.lexists(index):  # a FIFO or broken link there is refused by name, not passed over
        return _from_index(index)
    files = sorted(os.path.join(path, f) for f in list_folder(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: the directory holds no *.safetensors shards and no {INDEX_NAME}")
    return files, None, path


def checked_weight_map(index, index_path) -> dict:
    """An index's (parsed JSON) weight_map, checked: an object of tensor name -> the name of a shard file in the
    index's own folder (no path: a shard elsewhere, or a folder, is refused), else CheckpointError."""
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index_path}: index needs a 'weight_map' object of tensor name -> shard file name")
    for name, shard in wm.items():
        if os.path.basename(shard) != shard or shard in ("", ".", "..") or "\0" in shard:
            raise CheckpointError(f"{index_path}: tensor {quoted(name, 120)} maps to {quoted(shard, 120)}, which is not a file name "
                                  "inside the checkpoint directory")
    return wm


def _from_index(index_path):
    wm = checked_weight_map(read_json_file(index_path, "the index"), index_path)
    folder = os.path.dirname(index_path)
    return None, {k: os.path.join(folder, v) for k, v in wm.items()}, index_path


def _changed(file: str, info: TensorInfo, now: tuple) -> str | None:
    """What changed in a shard whose identity is `now`, not the one its header was read with (info's), or None
    where only the modification time moved and its header is byte for byte the one read: a touch, or a copy tool
    restoring times: every name, dtype, shape and offset checked then still holds."""
    then = info.identity
    if now[:2] != then[:2]:
        return "another file is under its name now"
    if now[2] != then[2]:
        return f"its size went from {then[2]} to {now[2]} bytes"
    try:
        raw, again = _raw_header(file)
    except CheckpointError as e:
        return f"its modification time moved and its header cannot be read again: {e}"
    if again != now:  # written to again as it was read
        return "its modification time moved, and it changed again as its header was read"
    if hashlib.sha256(raw).digest() != info.header_sha256:
        return "its modification time moved and its header is not the one read"
    return None


def _changed_error(file: str, changed: str) -> CheckpointError:
    return CheckpointError(f"{file}: the shard changed since its header was read ({changed}); load the checkpoint "
                           "again once nothing is writing to it")


class WeightStore:
    """Read-only, memory-mapped view of a checkpoint's tensors."""

    def __init__(self, infos: dict, display: str, index: str | None = None, listed: frozenset = frozenset()):
        self._infos, self.display = infos, display
        # The index that chose the shards (or None), and every name it maps (without one, every name the shards'
        # headers hold): the names `only` passed over included.
        self.index, self._listed = index, listed
        self._maps: dict[str, mmap.mmap] = {}

    @classmethod
    def open(cls, path, *, only: Callable[[str], bool] | None = None) -> "WeightStore":
        """Open a directory (with an index json, or a set of *.safetensors), one file, or a list of shards.

        `only`, when given, limits an indexed checkpoint to the tensors it accepts:
        shards holding none of them need not exist and are never opened.
        """
        files, weight_map, display = _shard_list(path)
        infos: dict[str, TensorInfo] = {}
        if weight_map is not None:
            wanted = {n: f for n, f in weight_map.items() if only is None or only(n)}
            headers = {}
            for name, shard in sorted(wanted.items()):
                if shard not in headers:
                    if not os.path.isfile(shard):
                        what = not_regular(shard)
                        raise CheckpointError(f"{display}: tensor {quoted(name, 120)} is indexed in shard "
                                              f"{quoted(os.path.basename(shard), 120)}, which " +
                                              (f"is {what}" if what else "does not exist"))
                    try:
                        headers[shard] = read_header(shard)
                    except CheckpointError as e:  # the index maps names to a file that is no shard: which ones
                        mapped = sum(f == shard for f in wanted.values())
                        more = f" (and {mapped - 1:,} more)" if mapped > 1 else ""
                        raise CheckpointError(f"{display}: tensor {quoted(name, 120)}{more} is indexed in shard "
                                              f"{quoted(os.path.basename(shard), 120)}, which cannot be read as one: "
                                              f"{e}") from None
                if name not in headers[shard]:
                    raise CheckpointError(f"{display}: the index puts tensor {quoted(name, 120)} in {shard}, "
                                          "but that shard's header does not hold it")
                infos[name] = headers[shard][name]
            for other, header in headers.items():  # a second copy in another shard read: which one is meant?
                for name in header:  # each header once: linear in the tensors read, however many shards
                    if name in infos and infos[name].file != other:
                        raise CheckpointError(f"tensor {quoted(name, 120)} appears in both {infos[name].file} and "
                                              f"{other} (the index names the first); a tensor is held in one shard")
        else:
            every = set()
            for shard in files:
                for name, info in read_header(shard).items():
                    every.add(name)
                    if only is not None and not only(name):
                        continue
                    if name in infos:
                        raise CheckpointError(f"tensor {quoted(name, 120)} appears in both {infos[name].file} and {shard}")
                    infos[name] = info
        if weight_map is None:
            return cls(infos, display, listed=frozenset(every))
        return cls(infos, display, display, frozenset(weight_map))

    def every_name(self) -> frozenset:
        """Every tensor name the checkpoint holds as opening it read them, the ones `only` passed over included:
        the index's, or without one every name in the headers of the shards opened. Names only: the shards an
        index names for the others need not exist."""
        return self._listed

    def unindexed(self, wanted: Callable[[str], bool]) -> dict[str, str]:
        """{name: shard file} of the tensors `wanted` accepts that a shard in the index's folder holds but the index
        maps to none ({} for a store opened without an index). Reads the header of every *.safetensors there; one
        that cannot be read is passed over: this explains an error, it decides nothing."""
        if self.index is None:
            return {}
        folder = os.path.dirname(self.index) or "."
        try:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        except OSError:
            return {}
        found: dict[str, str] = {}
        for f in files:
            try:
                header = read_header(os.path.join(folder, f))
            except CheckpointError:
                continue
            for name in header:
                if name not in self._listed and name not in found and wanted(name):
                    found[name] = os.path.join(folder, f)
        return found

    # -- lookup -------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.display}: missing tensor {quoted(name, 120)}") from None

    def get(self, name: str) -> np.ndarray:
        """A zero-copy, read-only NumPy view of one tensor (bf16 as ml_dtypes.bfloat16)."""
        info = self.info(name)
        mm = self._map(info.file)
        # A shard cut short since it was mapped faults the process (SIGBUS) where a view reads past its end.
        # Checked here; one cut while a view is being read cannot be (copy the bytes to be safe from that).
        size = mm.size()  # the file's size now (mmap's own descriptor)
        if size < info.offset + info.nbytes:
            raise CheckpointError(f"{info.file}: shard shrank to {size} bytes while it was open (tensor "
                                  f"{quoted(name, 120)} needs bytes up to {info.offset + info.nbytes}); a checkpoint "
                                  "must not change while it is read")
        if info.dtype not in dtypes():
            raise CheckpointError(f"{info.file}: tensor {quoted(name, 120)} is {info.dtype}, which this store indexes but "
                                  f"cannot read (it reads {', '.join(DTYPE_NAMES)})")
        dtype = dtypes()[info.dtype]
        count = info.nbytes // dtype.itemsize
        return np.frombuffer(mm, dtype=dtype, count=count, offset=info.offset).reshape(info.shape)

    def require_bf16(self, name: str) -> TensorInfo:
        """Refuse any dtype but BF16 for a tensor the encoder will read as BF16."""
        info = self.info(name)
        if info.dtype != "BF16":
            floats = info.dtype in ("F16", "F32", "F64")
            raise CheckpointError(
                f"{info.file}: tensor {quoted(name, 120)} is {info.dtype}, but the encoder reads the vision tower as "
                "BF16, as the official checkpoint stores it (its FP8 and NVFP4 exports keep the tower in BF16 too); "
                + ("convert the tower's tensors to BF16 (a cast from this float type) and save the checkpoint again"
                   if floats else "a quantised or integer tower must be dequantised to BF16 with its scales first, not cast"))
        return info

    def to_device(self, name: str, stream=None):
        """Upload one tensor to the current CuPy device; only this tensor's bytes are read. GpuUnavailable
        where CuPy cannot be imported."""
        from .. import gpu

        why = gpu.import_problem()
        if why:
            raise GpuUnavailable(f"WeightStore.to_device needs CuPy: {why}")
        import cupy

        host = self.get(name)
        out = cupy.empty(host.shape, dtype=host.dtype)
        out.set(host, stream=stream)
        return out

    def _map(self, file: str) -> mmap.mmap:
        mm = self._maps.get(file)
        if mm is None:
            mine = [i for i in self._infos.values() if i.file == file]
            try:  # opened as the header was (regular files only: a FIFO put in its place would block)
                with open_regular(file, "the shard") as f:
                    now = identity(os.fstat(f.fileno()))
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:  # CheckpointError (not a regular file) is a ValueError
                raise CheckpointError(f"{file}: cannot memory-map shard ({e})") from None
            # A shard truncated after its header was read would fault on access (SIGBUS); one replaced or
            # rewritten would be read against the old header's offsets.
            end = max((i.offset + i.nbytes for i in mine), default=0)
            size = now[2]
            if size < end or len(mm) < end:
                mm.close()
                raise CheckpointError(f"{file}: shard shrank to {size} bytes since its header was read "
                                      f"(tensors need {end}); refusing to map it")
            changed = _changed(file, mine[0], now) if mine and mine[0].identity and now != mine[0].identity else None
            if changed:
                mm.close()
                raise _changed_error(file, changed)
            self._maps[file] = mm
        return mm

    def check_unchanged(self) -> None:
        """CheckpointError naming a mapped shard that is no longer the file its header was read from (another
        file under its name, another size, or another header): a copy or download still writing it, whose
        bytes read since may not be the tensors the header describes. A shard is checked as it is mapped;
        this checks again after a read that must be of one file state (the fingerprint)."""
        for file in list(self._maps):
            mine = next((i for i in self._infos.values() if i.file == file), None)
            if mine is None or not mine.identity:
                continue
            try:
                now = identity(os.stat(file))
            except OSError as e:
                raise CheckpointError(f"{file}: the shard cannot be looked up again ({e.strerror or e}); load the "
                                      "checkpoint again once nothing is writing to it") from None
            changed = _changed(file, mine, now) if now != mine.identity else None
            if changed:
                raise _changed_error(file, changed)

    def close(self):
        """Drop the maps (views handed out keep their pages alive until they are freed)."""
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
