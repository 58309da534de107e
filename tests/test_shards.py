"""Every malformed shard raises CheckpointError naming what is wrong; none crashes the process."""

import json
import re
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from glmvit_cupy import CheckpointError, WeightStore
from glmvit_cupy.checkpoint.shards import read_header


def shard(path, header, data=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def ok_header():
    return {"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}


def test_good_shard_is_zero_copy_and_typed(tmp_path):
    data = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).tobytes() + np.float32([7, 8]).tobytes()
    p = shard(tmp_path / "x.safetensors", ok_header(), data)
    st = WeightStore.open(p)
    a = st.get("a")
    assert a.dtype == ml_dtypes.bfloat16 and a.shape == (2, 3)
    assert a.astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert not a.flags.writeable and not a.flags.owndata  # a view of the map
    assert st.get("b").tolist() == [7.0, 8.0]
    # Cross-check with the safetensors library's own reader.
    with safe_open(p, "numpy") as f:
        assert f.get_tensor("b").tolist() == [7.0, 8.0]


@pytest.mark.parametrize("mutate,needle", [
    (lambda h: h["a"].update(dtype="Q99"), "unknown dtype"),
    (lambda h: h["a"].update(dtype=["BF16"]), "unknown dtype"),
    (lambda h: h["a"].pop("dtype"), "unknown dtype"),
    (lambda h: h["a"].pop("shape"), "non-negative"),
    (lambda h: h["a"].update(data_offsets=[0, 12.0]), "two integers"),
    (lambda h: h.update(__metadata__=[1]), "__metadata__"),
    (lambda h: h["a"].update(data_offsets=[12, 0]), "reversed"),
    (lambda h: h["b"].update(data_offsets=[12, 2000]), "outside"),
    (lambda h: h["a"].update(shape=[2, 4]), "needs 16"),
    (lambda h: h["b"].update(data_offsets=[8, 16]), "overlap"),
    (lambda h: h["a"].update(shape=[2, -3]), "non-negative"),
    (lambda h: h["a"].update(data_offsets="0-12"), "two integers"),
    (lambda h: h.update(c=5), "must be an object"),
    (lambda h: h.update(__metadata__={"format": 1}), "__metadata__ must be an object of strings"),
])
def test_bad_headers(tmp_path, mutate, needle):
    h = ok_header()
    mutate(h)
    p = shard(tmp_path / "bad.safetensors", h, bytes(20))
    with pytest.raises(CheckpointError) as e:
        WeightStore.open(p)
    assert needle in str(e.value) and "bad.safetensors" in str(e.value)


@pytest.mark.parametrize("mutate", [
    lambda h: h["a"].update(shape=[-1] * 100_000), lambda h: h["a"].update(dtype="B" * 1_000_000),
    lambda h: h["a"].update(data_offsets=[0] * 100_000), lambda h: h.update({"x" * 1_000_000: dict(h.pop("a"), dtype="Q9")}),
    lambda h: h["a"].update(shape=[0] * 100_000, data_offsets=[0, 0]),
    # numbers past the 4,300 digits Python's str() takes, and a product of dimensions that is
    lambda h: h["a"].update(shape=[10**4000, 10**4000]), lambda h: h["a"].update(shape=[2**40] * 60),
    lambda h: h["a"].update(data_offsets=[0, 10**4200]), lambda h: h["a"].update(data_offsets=[10**4250, 1]),
])
def test_a_huge_field_is_quoted_short(tmp_path, mutate):
    """A header field of megabytes is named in the one-line error, not repeated whole into the log."""
    h = ok_header()
    mutate(h)
    with pytest.raises(CheckpointError) as e:
        WeightStore.open(shard(tmp_path / "huge.safetensors", h, bytes(20)))
    assert "huge.safetensors" in str(e.value) and len(str(e.value)) < 600, str(e.value)[:300]


def test_data_section_must_be_indexed_whole(tmp_path):
    """As the safetensors format requires: no bytes outside every tensor (a hole, a tail), so nothing
    can hide in a shard, and no name twice (JSON alone would keep the last and drop the first's bytes)."""
    h = ok_header()
    h["b"]["data_offsets"] = [16, 24]
    with pytest.raises(CheckpointError, match="4 bytes before tensor 'b' belong to no tensor"):
        WeightStore.open(shard(tmp_path / "hole.safetensors", h, bytes(24)))
    with pytest.raises(CheckpointError, match="the last 8 bytes of the data section belong to no tensor"):
        WeightStore.open(shard(tmp_path / "tail.safetensors", ok_header(), bytes(28)))
    raw = b'{"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}, ' \
          b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}'
    (tmp_path / "twice.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(20))
    with pytest.raises(CheckpointError, match="names tensor 'a' twice"):
        WeightStore.open(str(tmp_path / "twice.safetensors"))


@pytest.mark.parametrize("raw,says", [
    (struct.pack("<Q", 10**12) + b"{}", "exceeds"),          # an absurd header length
    (struct.pack("<Q", 500) + b"{}", "past the end"),        # a header longer than the file
    (struct.pack("<Q", 5) + b"{abc}", "not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "JSON object"),
    (b"abc", "too short"),                                   # not even the 8-byte length
])
def test_bad_headers_are_refused(tmp_path, raw, says):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(raw)
    with pytest.raises(CheckpointError, match=says):
        read_header(str(p))


def test_a_header_of_too_many_tensors_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    """A 100 MB header of a million empty tensors took ~1 GB and ~20 s to parse: counted first, refused."""
    from glmvit_cupy.checkpoint import shards

    monkeypatch.setattr(shards, "MAX_TENSORS", 1_000)
    entries = ", ".join(f'"t{i}": {{"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}}' for i in range(1_001))
    raw = ("{" + entries + "}").encode()
    p = tmp_path / "many.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    monkeypatch.setattr(shards.json, "loads", lambda *a, **k: pytest.fail("parsed before counting"))
    with pytest.raises(CheckpointError, match="lists 1,001 tensors, more than the 1,000"):
        read_header(str(p))


def test_a_header_whose_keys_are_escaped_is_counted_as_it_is_parsed(tmp_path, monkeypatch):
    """JSON may spell "data_offsets" as "data\\u005foffsets": the byte count before parsing misses those, so the
    entries are counted as they are parsed as well, and parsing stops at the first past the limit."""
    from glmvit_cupy.checkpoint import shards

    monkeypatch.setattr(shards, "MAX_TENSORS", 1_000)
    entries = [f'"t{i}": {{"dtype": "BF16", "shape": [0], "data\\u005foffsets": [0, 0]}}' for i in range(1_001)]
    raw = ("{" + ", ".join(entries) + "}").encode()
    assert raw.count(b'"data_offsets"') == 0
    p = tmp_path / "escaped.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="lists more than the 1,000 tensors a shard may hold"):
        read_header(str(p))
    raw = ("{" + ", ".join(entries[:-1]) + "}").encode()  # 1,000: parsed and taken
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    assert len(read_header(str(p))) == 1_000


def test_a_header_of_too_many_other_objects_is_refused_as_it_is_parsed(tmp_path, monkeypatch):
    """A 100 MB header of 33 million empty objects in one entry took 35 s and 2.6 GB: objects are counted as
    they are parsed (one per tensor, the header and its __metadata__), and parsing stops past the limit."""
    from glmvit_cupy.checkpoint import shards

    monkeypatch.setattr(shards, "MAX_TENSORS", 1_000)
    # Past the values counted first (a header declaring 250,000 tensors may hold 3 million, 1.5 million objects).
    monkeypatch.setattr(shards, "SPARE_VALUES", 10**9)
    calls = []
    repeated_key = shards.repeated_key
    monkeypatch.setattr(shards, "repeated_key", lambda pairs: calls.append(1) or repeated_key(pairs))
    raw = ('{"junk": [' + ", ".join(["{}"] * 100_000) + "]}").encode()
    p = tmp_path / "objects.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="holds more than 1,002 JSON objects"):
        read_header(str(p))
    assert len(calls) <= 1_002
    entries = ", ".join(f'"t{i}": {{"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}}' for i in range(1_000))
    raw = ('{"__metadata__": {"format": "pt"}, ' + entries + "}").encode()  # 1,000 tensors: taken
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    assert len(read_header(str(p))) == 1_000


@pytest.mark.parametrize("junk", [b"[]", b"0", b"[[[[[[[[]]]]]]]]", b'"ab"'])
def test_a_header_of_more_values_than_its_tensors_take_is_refused_before_it_is_parsed(tmp_path, monkeypatch, junk):
    """100 MB of empty lists beside one tensor took 14 s and 2.7 GB to parse, nested ones 48 s and 5 GB: the values
    (commas and opening brackets) are counted first, against 12 a tensor and 65,536 for the metadata."""
    from glmvit_cupy.checkpoint import shards

    tensor = b'"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    raw = b'{' + tensor + b', "__metadata__": {"junk": [' + b", ".join([junk] * 70_000) + b"]}}"
    p = tmp_path / "junk.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"x")
    loads = shards.json.loads
    monkeypatch.setattr(shards.json, "loads", lambda *a, **k: pytest.fail("parsed before counting"))
    with pytest.raises(CheckpointError, match=r"junk.safetensors: the header holds up to [\d,]+ JSON values \(its commas "
                                              r"and opening brackets, counted before parsing\), more than the 65,548 its 1 "
                                              r"tensors take \(12 each at most, and 65,536 for its __metadata__\)"):
        read_header(str(p))
    monkeypatch.setattr(shards.json, "loads", loads)
    entries = ", ".join(f'"t{i}": {{"dtype": "U8", "shape": [1, 1, 1, 1, 1], "data_offsets": [{i}, {i + 1}]}}'
                        for i in range(20_000))  # 12 values a tensor, no spare: taken
    raw = ('{"__metadata__": {"format": "pt"}, ' + entries + "}").encode()
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(20_000))
    assert len(read_header(str(p))) == 20_000


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_files_of_more_values_than_a_checkpoint_holds_are_refused_before_parsing(tmp_path, monkeypatch, name):
    """64 MiB of empty objects as an index took 13 s and 1.8 GB to parse (of nested lists 15 s and 3.4 GB): a
    config.json or index of more than a million values (commas and opening brackets) is refused unparsed."""
    from glmvit_cupy import bind_tower, files
    from glmvit_cupy.checkpoint.synthetic import write_checkpoint
    from tests.golden import cases

    write_checkpoint(tmp_path, cases.GEOMETRY)
    (tmp_path / name).write_bytes(b'{"weight_map": {}, "junk": [' + b"{}," * 1_000_000 + b"{}]}")
    loads = files.json.loads
    monkeypatch.setattr(files.json, "loads", lambda text, **k: pytest.fail("parsed before counting")
                        if len(text) > 1_000_000 else loads(text, **k))
    with pytest.raises(CheckpointError, match=rf"{name}: .* holds up to 2,000,00\d JSON values \(its commas and opening "
                                              r"brackets, counted before parsing\), more than the 1,000,000 a "
                                              r"checkpoint's JSON file holds"):
        bind_tower(tmp_path)


def test_truncated_shard_is_refused_before_mapping(tmp_path):
    data = bytes(20)
    p = shard(tmp_path / "t.safetensors", ok_header(), data)
    raw = open(p, "rb").read()
    open(p, "wb").write(raw[:-5])
    with pytest.raises(CheckpointError, match="truncated"):
        WeightStore.open(p)


def test_shard_truncated_after_open_is_refused_not_a_sigbus(tmp_path):
    p = shard(tmp_path / "t.safetensors", ok_header(), bytes(20))
    st = WeightStore.open(p)
    raw = open(p, "rb").read()
    open(p, "wb").write(raw[:-10])
    with pytest.raises(CheckpointError, match="shrank"):
        st.get("b")


def test_shard_replaced_after_open_is_refused_not_read_against_the_old_header(tmp_path):
    """The same size, other bytes (a re-download, a copy over it): read against the header checked at open it
    would load silently wrong weights; a FIFO put in its place would block. Both refused, naming the shard."""
    import os

    p = shard(tmp_path / "r.safetensors", ok_header(), bytes(range(1, 21)))
    st = WeightStore.open(p)
    other = shard(tmp_path / "new.safetensors", ok_header(), bytes(20))
    os.replace(other, p)
    with pytest.raises(CheckpointError, match=r"r.safetensors: the shard changed since its header was read \(another "
                                              r"file is under its name now\); load the checkpoint again"):
        st.get("a")
    st = WeightStore.open(p)
    os.unlink(p)
    os.mkfifo(p)
    with pytest.raises(CheckpointError, match=r"r.safetensors: cannot memory-map shard .*is a FIFO"):
        st.get("a")


def test_a_shard_only_touched_since_its_header_was_read_is_mapped(tmp_path):
    """Only the modification time moved (touch, a copy tool restoring files): the header is read again and, the
    same bytes, the shard is mapped. A header rewritten in place (the same inode and size) or a shard grown is
    refused, saying what changed."""
    import os

    data = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).tobytes() + np.float32([7, 8]).tobytes()
    p = shard(tmp_path / "t.safetensors", ok_header(), data)

    def touch():
        st = os.stat(p)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))

    store = WeightStore.open(p)
    touch()
    assert store.get("b").tolist() == [7.0, 8.0]
    store = WeightStore.open(p)
    raw = open(p, "rb").read()
    other = raw.replace(b'"a"', b'"c"')  # the same length, another header
    assert len(other) == len(raw) and other != raw
    with open(p, "r+b") as f:  # in place: the same inode
        f.write(other)
    touch()
    with pytest.raises(CheckpointError, match=r"t.safetensors: the shard changed since its header was read \(its "
                                              r"modification time moved and its header is not the one read\); load "
                                              r"the checkpoint again once nothing is writing to it"):
        store.get("b")
    store = WeightStore.open(p)
    with open(p, "ab") as f:
        f.write(bytes(4))
    with pytest.raises(CheckpointError, match=rf"the shard changed since its header was read \(its size went from "
                                              rf"{len(raw)} to {len(raw) + 4} bytes\)"):
        store.get("b")


def test_index_naming_missing_or_wrong_shard(tmp_path):
    shard(tmp_path / "s1.safetensors", ok_header(), bytes(20))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s2.safetensors"}}))
    with pytest.raises(CheckpointError, match="does not exist"):
        WeightStore.open(tmp_path)
    shard(tmp_path / "s2.safetensors", {"z": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    with pytest.raises(CheckpointError, match="does not hold it"):
        WeightStore.open(tmp_path)
    for bad in ("../s1.safetensors", "s1.safe\0tensors"):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": bad}}))
        with pytest.raises(CheckpointError, match=f"index.json: tensor 'a' maps to {re.escape(repr(bad))}, which is "
                                                  "not a file name"):
            WeightStore.open(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="index is not valid JSON"):
        WeightStore.open(tmp_path)


def test_an_index_mapping_tensors_to_a_file_that_is_no_shard_names_them(tmp_path):
    """An index that maps tensors to config.json, or to itself, was refused naming only the file ("header length
    ... exceeds"): the error now names a tensor the index put there, and how many more."""
    shard(tmp_path / "s1.safetensors", ok_header(), bytes(20))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm"}))
    index = tmp_path / "model.safetensors.index.json"
    for target, more in (("config.json", " (and 1 more)"), ("model.safetensors.index.json", " (and 1 more)")):
        index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "v.b": target, "v.c": target}}))
        with pytest.raises(CheckpointError) as e:
            WeightStore.open(tmp_path)
        assert str(e.value).startswith(f"{index}: tensor 'v.b'{more} is indexed in shard '{target}', which cannot be "
                                       f"read as one: {tmp_path / target}: header length "), str(e.value)
        assert "this is not a safetensors file" in str(e.value)
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "v.b": "config.json"}}))
    with pytest.raises(CheckpointError, match=r"tensor 'v\.b' is indexed in shard 'config\.json', which cannot be read"):
        WeightStore.open(tmp_path)
    assert WeightStore.open(tmp_path, only=lambda n: n == "a").get("a").shape  # a shard `only` passes over: unread


def test_unreadable_index_says_so_not_bad_json(tmp_path, monkeypatch):
    from glmvit_cupy import files

    shard(tmp_path / "s1.safetensors", ok_header(), bytes(20))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))

    def refuse(path, *a, **k):  # as a read without permission fails (the tests may run as root)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(files, "open_regular", refuse)
    with pytest.raises(CheckpointError, match=r"the index cannot be read \(.*Permission denied.*readable JSON file"):
        WeightStore.open(tmp_path)


def test_only_filter_skips_absent_text_shards(tmp_path):
    shard(tmp_path / "v.safetensors", ok_header(), bytes(20))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "v.safetensors", "text.w": "text-00009.safetensors"}}))
    st = WeightStore.open(tmp_path, only=lambda n: not n.startswith("text."))
    assert st.names() == ["a"]


def test_empty_directory_and_duplicate_names(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        WeightStore.open(tmp_path)
    shard(tmp_path / "a.safetensors", ok_header(), bytes(20))
    shutil.copy(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="appears in both"):
        WeightStore.open(tmp_path)


def test_require_bf16_explains(tmp_path):
    p = shard(tmp_path / "x.safetensors", ok_header(), bytes(20))
    st = WeightStore.open(p)
    st.require_bf16("a")
    with pytest.raises(CheckpointError, match="'b' is F32.*convert the tower's tensors to BF16"):
        st.require_bf16("b")
    with pytest.raises(CheckpointError, match="missing tensor 'c'"):
        st.get("c")


def test_store_is_a_context_manager_and_counts_its_tensors(tmp_path):
    data = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).tobytes() + np.float32([7, 8]).tobytes()
    with WeightStore.open(shard(tmp_path / "x.safetensors", ok_header(), data)) as st:
        assert len(st) == 2 and "a" in st and "c" not in st
        view = st.get("b")
        assert st._maps
    assert not st._maps and view.tolist() == [7.0, 8.0]  # closing drops the maps; views handed out live on


def test_mangled_shards_are_detected_or_harmless(tmp_path, rng):
    """300 random corruptions of a good shard (flipped header bytes, truncations). Each one either raises
    CheckpointError or, where the bytes are still a valid shard (a flip inside a name, say), is read
    exactly as the safetensors library reads it: never another exception, never a silent misread.
    Every truncation cuts tensor bytes or the header, so every one must be detected."""
    data = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).tobytes() + np.float32([7, 8]).tobytes()
    good = open(shard(tmp_path / "good.safetensors", ok_header(), data), "rb").read()
    p = tmp_path / "mangled.safetensors"
    detected = truncations = 0
    for i in range(300):
        raw = bytearray(good)
        if i % 3 == 0:
            raw = raw[: rng.integers(0, len(raw))]
            truncations += 1
        else:
            for _ in range(rng.integers(1, 4)):
                raw[rng.integers(0, min(len(raw), 8 + 120))] = rng.integers(0, 256)
        p.write_bytes(bytes(raw))
        try:
            st = WeightStore.open(str(p))
            got = {n: (st.info(n).dtype, st.get(n).shape, st.get(n).tobytes()) for n in st.names()}
        except CheckpointError:
            detected += 1
            continue
        assert i % 3, f"truncation to {len(raw)} of {len(good)} bytes was not detected"
        with safe_open(str(p), "numpy") as f:
            want = {n: (f.get_slice(n).get_dtype(), f.get_tensor(n).shape, f.get_tensor(n).tobytes())
                    for n in f.keys()}
        assert got == want, bytes(raw[:140])
    assert detected >= truncations and detected > 150, detected  # most flips break the header; all cuts do


def test_an_indexed_tensor_held_twice_is_refused(tmp_path):
    """With an index, a tensor in two shards the index reads is refused as it is without one, not the
    index's copy taken without a word."""
    shard(tmp_path / "s1.safetensors", ok_header(), bytes(20))
    shard(tmp_path / "s2.safetensors", {"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                                        "c": {"dtype": "U8", "shape": [1], "data_offsets": [12, 13]}}, bytes(13))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"tensor 'a' appears in both .*s1.safetensors and .*s2.safetensors "
                                              r"\(the index names the first\)"):
        WeightStore.open(tmp_path)
    assert WeightStore.open(tmp_path, only=lambda n: n != "c").get("b").shape == (2,)  # s2 not read: not seen


def test_more_dimensions_than_an_array_has_is_refused(tmp_path):
    header = {"a": {"dtype": "BF16", "shape": [2, 3] + [1] * 70, "data_offsets": [0, 12]}}
    with pytest.raises(CheckpointError, match=r"tensor 'a': shape has 72 dimensions, more than the 64"):
        WeightStore.open(shard(tmp_path / "x.safetensors", header, bytes(12)))


def test_a_zero_size_tensor_with_a_huge_dimension_is_refused_at_the_header(tmp_path):
    """[2**63, 0] needs 0 bytes, so no byte count bounds it, but no array can have it: refused where read."""
    for dims in ([2**63, 0], [0, 2**41]):
        header = {"a": {"dtype": "BF16", "shape": dims, "data_offsets": [0, 0]}}
        with pytest.raises(CheckpointError, match=r"tensor 'a': shape \[.*\] has a dimension past 1,099,511,627,776"):
            WeightStore.open(shard(tmp_path / "x.safetensors", header, b""))
    header = {"a": {"dtype": "BF16", "shape": [2**40, 0], "data_offsets": [0, 0]}}
    assert WeightStore.open(shard(tmp_path / "y.safetensors", header, b"")).get("a").shape == (2**40, 0)


def test_json_files_say_what_is_wrong_not_invalid_json(tmp_path):
    """A FIFO as the index, a tensor named twice in a header, a config.json over its limit: each says so, not
    "not valid JSON"."""
    import os

    from glmvit_cupy.files import read_json_file

    shard(tmp_path / "s1.safetensors", ok_header(), bytes(20))
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(CheckpointError) as e:
        WeightStore.open(tmp_path)
    assert "is a FIFO" in str(e.value) and "not valid JSON" not in str(e.value), str(e.value)
    raw = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, ' \
          b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    (tmp_path / "d.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"x")
    with pytest.raises(CheckpointError) as e:
        read_header(str(tmp_path / "d.safetensors"))
    assert "twice" in str(e.value) and "not valid JSON" not in str(e.value), str(e.value)
    big = tmp_path / "config.json"
    big.write_text(json.dumps({"id2label": "x" * (2 << 20)}))
    with pytest.raises(CheckpointError, match=r"config.json: the config is over 1 MiB, more than a checkpoint's "
                                              r"JSON file holds"):
        read_json_file(big, "the config", 1 << 20)


def test_a_shard_cut_short_while_open_is_refused_at_the_next_get_not_a_bus_error(tmp_path):
    """A shard truncated in place after the store mapped it (a re-download, a copy over it): the next get of a
    tensor past its new end is a CheckpointError naming it, not SIGBUS; close() lets go of the files."""
    import os

    p = shard(tmp_path / "s.safetensors", ok_header(), bytes(range(20)))
    store = WeightStore.open(p)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    assert store.get("a").shape == (2, 3)
    header_end = os.path.getsize(p) - 20
    os.truncate(p, header_end + 12)  # "a" (bytes 0-12) whole, "b" (12-20) gone
    assert store.get("a").shape == (2, 3)
    with pytest.raises(CheckpointError, match=r"s.safetensors: shard shrank to \d+ bytes while it was open \(tensor "
                                              r"'b' needs bytes up to \d+\)"):
        store.get("b")
    store.close()
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds


def test_to_device_without_cupy_is_gpu_unavailable(tmp_path):
    import importlib.util

    from glmvit_cupy import GpuUnavailable

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: to_device uploads")
    store = WeightStore.open(shard(tmp_path / "s.safetensors", ok_header(), bytes(20)))
    with pytest.raises(GpuUnavailable, match="WeightStore.to_device needs CuPy: CuPy is not installed"):
        store.to_device("a")


def test_packed_and_complex_dtypes_are_indexed_and_refused_only_when_read(tmp_path):
    """A checkpoint may hold a text model's packed FP4 / FP6 weights or complex tensors beside a BF16 tower:
    safetensors has those dtypes, and one in a shard refused the whole checkpoint. They are indexed by their
    bits (two F4 values a byte, four F6 values in three), so the data section is still checked whole; only
    reading one is refused, by name. A size that is no whole number of bytes is a damaged header."""
    header = {"t4": {"dtype": "F4", "shape": [3, 4], "data_offsets": [0, 6]},
              "t6": {"dtype": "F6_E2M3", "shape": [8], "data_offsets": [6, 12]},
              "c": {"dtype": "C64", "shape": [2], "data_offsets": [12, 28]},
              "a": {"dtype": "BF16", "shape": [2], "data_offsets": [28, 32]}}
    bf = np.random.default_rng().standard_normal(2).astype(ml_dtypes.bfloat16)
    p = shard(tmp_path / "mixed.safetensors", header, bytes(28) + bf.tobytes())
    store = WeightStore.open(p)
    assert store.info("t4").nbytes == 6 and store.info("t6").nbytes == 6 and store.info("c").nbytes == 16
    assert np.array_equal(store.get("a").view(np.uint16), bf.view(np.uint16))
    with pytest.raises(CheckpointError, match=r"tensor 't4' is F4, which this store indexes but cannot read"):
        store.get("t4")
    header["t4"]["shape"] = [3, 3]  # 9 values of 4 bits: no whole number of bytes
    with pytest.raises(CheckpointError, match=r"tensor 't4': dtype F4 x shape \(3, 3\) is not a whole number of bytes"):
        read_header(shard(tmp_path / "odd.safetensors", header, bytes(28) + bf.tobytes()))


def test_unindexed_names_the_shard_holding_what_the_index_leaves_out(tmp_path):
    """unindexed finds the tensors a shard beside the index holds that the index maps to none, passing over a shard
    it cannot read (a FIFO is not waited on); a store opened without an index has none."""
    import os

    shard(tmp_path / "s1.safetensors", ok_header(), bytes(20))
    shard(tmp_path / "s2.safetensors", {"c": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    os.mkfifo(tmp_path / "s3.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    store = WeightStore.open(tmp_path)
    assert store.index == str(tmp_path / "model.safetensors.index.json")
    assert store.unindexed(lambda n: True) == {"b": str(tmp_path / "s1.safetensors"), "c": str(tmp_path / "s2.safetensors")}
    assert store.unindexed(lambda n: n == "c") == {"c": str(tmp_path / "s2.safetensors")}
    alone = WeightStore.open(tmp_path / "s1.safetensors")
    assert alone.index is None and alone.unindexed(lambda n: True) == {}


def test_a_broken_link_among_a_folders_shards_is_named_as_one(tmp_path):
    """A folder without an index whose *.safetensors include a broken symbolic link: the link is named as one,
    not "No such file or directory" for a name the folder lists."""
    shard(tmp_path / "a.safetensors", ok_header(), bytes(20))
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(CheckpointError) as e:
        WeightStore.open(str(tmp_path))
    assert str(e.value) == f"{tmp_path / 'b.safetensors'}: the shard is a broken symbolic link"


def test_a_shard_listed_twice_is_named_as_one_file(tmp_path):
    """One file given twice (or under a link) would read as each of its tensors held in two shards: the error
    says the list names one file twice. Two distinct shards of other tensors open together."""
    rng = np.random.default_rng()
    p = shard(tmp_path / "x.safetensors", ok_header(), rng.bytes(20))
    (tmp_path / "link.safetensors").symlink_to(p)
    for given in ([p, p], [p, str(tmp_path / "link.safetensors")]):
        with pytest.raises(CheckpointError, match=r"are one file, listed twice; give each shard once"):
            WeightStore.open(given)
    other = shard(tmp_path / "y.safetensors", {"c": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}},
                  rng.bytes(2))
    assert WeightStore.open([p, other]).get("c").shape == (1,)


def test_a_git_lfs_pointer_in_place_of_a_shard_says_so(tmp_path):
    """A checkpoint cloned with git but without Git LFS holds, in place of each shard, a pointer of some 130
    bytes naming the shard's digest and size: it was refused as a header length of 2.3e18 bytes, "not a
    safetensors file"; the error says what the file is and how to fetch the shard."""
    p = tmp_path / "model-00001-of-00002.safetensors"
    p.write_text("version https://git-lfs.github.com/spec/v1\n"
                 "oid sha256:58e9751f804f45ef6f8c932d4cb1e9a216fe1fe808881b0f6b9cbd90fe93ab1e\nsize 5368709120\n")
    with pytest.raises(CheckpointError) as e:
        WeightStore.open(str(p))
    said = str(e.value)
    assert said.startswith(f"{p}: is a Git LFS pointer file (") and "5,368,709,120-byte shard" in said, said
    assert "git lfs pull" in said and "header length" not in said, said


def test_a_zero_size_tensor_numpy_cannot_shape_is_refused_by_name(tmp_path):
    """[0, 2**40, 2**40] holds no byte, so no size check caught it, but NumPy refuses that shape ('array is too
    big'): get() raised NumPy's bare ValueError, naming neither file nor tensor."""
    p = shard(tmp_path / "z.safetensors", {"z": {"dtype": "BF16", "shape": [0, 2**40, 2**40], "data_offsets": [0, 0]}})
    with pytest.raises(CheckpointError, match=r"z\.safetensors.*tensor 'z'"):
        WeightStore.open(p).get("z")

