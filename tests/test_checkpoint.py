"""Tower binding: prefixes, the flattened-shape rule, strict BF16, and the two no-tower outcomes."""

import json
import logging
import os
import re

import ml_dtypes
import numpy as np
import pytest

from tests.conftest import said_within
from tests.golden import cases

from glmvit_cupy import AbsentTower, CheckpointError, NoVisionConfig, bind_tower, inspect_checkpoint
from glmvit_cupy.checkpoint.bind import probe_tower
from glmvit_cupy.checkpoint.names import VISION_PREFIXES as PREFIXES, tower_layout
from glmvit_cupy.checkpoint.shards import WeightStore
from glmvit_cupy.checkpoint.synthetic import random_tower, write_checkpoint
from glmvit_cupy.config import VisionGeometry

GEO = cases.GEOMETRY


@pytest.fixture(scope="module")
def tensors():
    return random_tower(GEO, seed=5)


def test_official_layout_is_347_tensors_and_564m_parameters():
    layout = tower_layout(VisionGeometry.official())
    assert len(layout) == 24 * 14 + 11 == 347
    params = sum(int(np.prod(s)) for s in layout.values())
    assert 563e6 < params < 565e6  # about 564 M, 1.05 GiB in bf16
    assert layout["patch_embed.proj.weight"] == (1024, 1176)
    assert layout["downsample.weight"] == (4096, 4096)


def test_golden_tower_inspects():
    s = inspect_checkpoint(cases.TOWER_DIR)
    assert s["prefix"] == "model.visual." and s["geometry"] == GEO
    assert s["tensors"] == 2 * 14 + 11 == 39
    assert s["bytes"] == 2 * s["parameters"]
    assert len(s["shards"]) == 2


def test_any_shard_of_an_indexed_checkpoint_binds_the_whole_tower(tmp_path, tensors):
    """A shard named where the checkpoint is asked for, its index beside it listing it: the tower spans both
    shards, and either one binds the whole of it; the same shard without the index is that file alone."""
    write_checkpoint(tmp_path, GEO, tensors=tensors, shards=2)
    shards = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    whole = inspect_checkpoint(tmp_path)
    for shard in shards:
        s = inspect_checkpoint(tmp_path / shard)
        assert s["tensors"] == whole["tensors"] and s["shards"] == whole["shards"] == shards
    os.remove(tmp_path / "model.safetensors.index.json")
    for shard in shards:  # part of the tower, or none of it: the error says the rest may be in shards not given
        with pytest.raises(CheckpointError, match="this shard holds .*; only this shard was given, and no index beside "
                                                  "it lists it: if the tower is in other shards, give the checkpoint's "
                                                  "folder or its index$"):
            bind_tower(tmp_path / shard)


def test_a_shard_name_no_file_name_can_hold_is_named_for_what_it_holds(tmp_path, tensors):
    """An index naming a shard by a lone surrogate (a JSON escape) was blamed on a NUL byte."""
    import json

    write_checkpoint(tmp_path, GEO, tensors=tensors, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.visual.merger.proj.weight"] = "\ud800.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="holds a character no file name can encode") as e:
        bind_tower(tmp_path)
    assert "NUL" not in str(e.value)


@pytest.mark.parametrize("index", ['{"weight_map": {"a": ', '[1, 2]', '{"weight_map": 3}'])
def test_a_shard_beside_a_damaged_index_names_the_index(tmp_path, tensors, index):
    """The shard alone held part of the tower (a depth error) or none of it (a text-only engine then served
    without vision): the damaged index is what is wrong, and the error says so."""
    write_checkpoint(tmp_path, GEO, tensors=tensors, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    for shard in sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors")):
        with pytest.raises(CheckpointError, match="the index beside it cannot be read.*repair or remove"):
            bind_tower(tmp_path / shard)
        with pytest.raises(CheckpointError, match="the index beside it cannot be read"):
            probe_tower(tmp_path / shard)


@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_prefix_binds(tmp_path, tensors, prefix):
    write_checkpoint(tmp_path, GEO, tensors=tensors, prefix=prefix)
    assert bind_tower(tmp_path).prefix == prefix


def test_a_wrappers_prefix_binds(tmp_path, tensors):
    # PEFT saves a merged model under "base_model.model."; any prefix ending in the module name `visual.` is taken.
    prefix = "base_model.model.model.visual."
    write_checkpoint(tmp_path, GEO, tensors=tensors, prefix=prefix)
    b = bind_tower(tmp_path)
    assert b.prefix == prefix and inspect_checkpoint(tmp_path)["prefix"] == prefix
    for name in ("blocks.1.attn.qkv.weight", "merger.proj.weight"):
        np.testing.assert_array_equal(b.host(name).view(np.uint16), tensors[name].reshape(b.layout[name]).view(np.uint16))


def _add_tower(path, tensors, prefix, fname):
    import json

    from safetensors.numpy import save_file

    named = {prefix + k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(named, path / fname, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: fname for n in named})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_towers_under_two_other_prefixes_are_refused_and_a_known_prefix_is_taken(tmp_path, tensors, caplog):
    write_checkpoint(tmp_path, GEO, tensors=tensors, prefix="a.visual.")
    _add_tower(tmp_path, tensors, "b.visual.", "extra-1.safetensors")
    with pytest.raises(CheckpointError, match=r"under each of 'a\.visual\.', 'b\.visual\.'; which one"):
        bind_tower(tmp_path)
    _add_tower(tmp_path, tensors, "visual.", "extra-2.safetensors")  # a known prefix settles it, and says so
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        assert bind_tower(tmp_path).prefix == "visual."
    assert "holds a vision tower under 'a.visual.', 'b.visual.' too; the one under 'visual.' is loaded" in caplog.text


def test_many_towers_and_long_names_are_quoted_short(tmp_path, tensors):
    """200,000 one-tensor "towers" under other prefixes once made a 4 MB error line, and a tower under a 1 MB
    prefix with one wrong shape a 1 MB one: the prefixes are listed to 8 and counted, names quoted short."""
    import json

    from safetensors.numpy import save_file

    write_checkpoint(tmp_path, GEO, tensors=tensors, prefix="a.visual.")
    anchor = np.zeros((1, 1), ml_dtypes.bfloat16)
    save_file({f"p{i}.visual.patch_embed.proj.weight": anchor for i in range(30)}, tmp_path / "extra.safetensors")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({f"p{i}.visual.patch_embed.proj.weight": "extra.safetensors" for i in range(30)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"under each of 'a\.visual\.', 'p0\.visual\.', .* and 23 more; which") as e:
        bind_tower(tmp_path)
    assert len(str(e.value)) < 1_000
    long = "x" * 100_000 + ".visual."
    wrong = dict(tensors, **{"merger.proj.weight": tensors["merger.proj.weight"][:, :-1]})
    write_checkpoint(tmp_path / "long", GEO, tensors=wrong, prefix=long)
    with pytest.raises(CheckpointError, match=r"tensor 'xxxx.*\.\.\. \(100,028 characters\) has shape") as e:
        bind_tower(tmp_path / "long")
    assert len(str(e.value)) < 1_000


def test_text_tensors_are_never_read(tmp_path, tensors):
    write_checkpoint(tmp_path, GEO, tensors=tensors)
    b = bind_tower(tmp_path)
    # The store opened with the vision filter knows no text tensor at all.
    assert not [n for n in b.store.names() if "language_model" in n]


def mutated(tmp_path, tensors, **changes):
    t = dict(tensors)
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            del t[k]
        else:
            t[k] = v
    return write_checkpoint(tmp_path, GEO, tensors=t)


@pytest.mark.parametrize("dtype,name", [(np.float16, "F16"), (np.float32, "F32"),
                                        (ml_dtypes.float8_e4m3fn, "F8_E4M3")])
def test_non_bf16_vision_tensor(tmp_path, tensors, dtype, name):
    bad = tensors["blocks.1.attn.qkv.weight"].astype(np.float32).astype(dtype)
    mutated(tmp_path, tensors, **{"blocks__1__attn__qkv__weight": bad})
    with pytest.raises(CheckpointError) as e:
        bind_tower(tmp_path)
    msg = str(e.value)
    assert "model.visual.blocks.1.attn.qkv.weight" in msg and f"is {name}" in msg and "cast" in msg


def test_missing_tensor(tmp_path, tensors):
    mutated(tmp_path, tensors, **{"blocks__0__mlp__down_proj__bias": None})
    with pytest.raises(CheckpointError, match="missing tensor 'model.visual.blocks.0.mlp.down_proj.bias'"):
        bind_tower(tmp_path)


def _unindex(path, *suffixes):
    """Take tower tensors out of the index's weight_map (their shards keep them): {name: the shard that holds it}."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    held = {"model.visual." + s: index["weight_map"].pop("model.visual." + s) for s in suffixes}
    index_path.write_text(json.dumps(index))
    return held


def test_tower_tensors_the_index_leaves_out_are_named_with_the_index_and_their_shards(tmp_path, tensors):
    """An index that lists no shard for a tower tensor a shard holds said only "missing tensor": the error names
    the tensors (the first three and a count), the index, how many it lists, and the shard holding each."""
    path = write_checkpoint(tmp_path, GEO, tensors=tensors)
    index = str(tmp_path / "model.safetensors.index.json")
    held = _unindex(tmp_path, "blocks.1.attn.qkv.weight")
    with pytest.raises(CheckpointError) as e:
        bind_tower(path)
    assert str(e.value) == (
        f"{index}: missing tensor 'model.visual.blocks.1.attn.qkv.weight' (shape [384, 128]), which the encoder needs: "
        f"the index maps no shard for it (38 of the 39 tower tensors listed); it is in "
        f"{held['model.visual.blocks.1.attn.qkv.weight']}: the index must list every tower tensor (add it to its "
        "weight_map, or save the checkpoint again)")
    held.update(_unindex(tmp_path, "blocks.0.norm1.weight", "downsample.bias", "merger.proj.weight", "post_layernorm.weight"))
    with pytest.raises(CheckpointError) as e:
        bind_tower(path)
    assert str(e.value).startswith(
        f"{index}: missing 5 of the 39 tower tensors the encoder needs: 'model.visual.blocks.0.norm1.weight' (shape "
        "[128]), 'model.visual.blocks.1.attn.qkv.weight' (shape [384, 128]), 'model.visual.post_layernorm.weight' "
        "(shape [128]) and 2 more: the index maps no shard for them (34 of the 39 tower tensors listed); shards beside "
        f"it hold all 5: 'model.visual.blocks.0.norm1.weight' in {held['model.visual.blocks.0.norm1.weight']}, "), str(e.value)
    assert str(e.value).endswith(" and 2 more: the index must list every tower tensor (add them to its weight_map, or "
                                 "save the checkpoint again)"), str(e.value)
    # One the index leaves out, one no shard holds either.
    path = mutated(tmp_path / "gone", tensors, blocks__0__mlp__down_proj__bias=None)
    held = _unindex(tmp_path / "gone", "merger.proj.weight")
    with pytest.raises(CheckpointError) as e:
        bind_tower(path)
    assert str(e.value).endswith(
        "the index maps no shard for them (37 of the 39 tower tensors listed); shards beside it hold 1 of them: "
        f"'model.visual.merger.proj.weight' in {held['model.visual.merger.proj.weight']}: the index must list every "
        "tower tensor (add it to its weight_map, or save the checkpoint again); no shard beside the index holds the "
        "other one: a shard is missing, or the checkpoint was saved without it"), str(e.value)
    assert "'model.visual.blocks.0.mlp.down_proj.bias' (shape [128])" in str(e.value)


def test_an_index_leaving_out_a_block_or_the_patch_embedding_says_so_not_that_the_config_is_wrong(tmp_path, tensors):
    """Too few tower tensors listed for the config's depth, or no patch embedding listed: where shards beside the
    index hold what it leaves out, the error says that and where they are, not that the config or a shard is wrong."""
    path = write_checkpoint(tmp_path, GEO, tensors=tensors)
    block = [s for s in tensors if s.startswith("blocks.1.")]
    _unindex(tmp_path, *block)
    with pytest.raises(CheckpointError) as e:
        bind_tower(path)
    assert (f"; {tmp_path / 'model.safetensors.index.json'} maps no shard for 14 vision tensors that shards beside it "
            "hold ('model.visual.blocks.1.") in str(e.value), str(e.value)
    assert "does not describe" not in str(e.value)
    path = write_checkpoint(tmp_path / "patch", GEO, tensors=tensors)
    held = _unindex(tmp_path / "patch", "patch_embed.proj.weight")
    with pytest.raises(CheckpointError) as e:
        bind_tower(path)
    assert str(e.value).endswith(
        f"but no '*visual.patch_embed.proj.weight'; {tmp_path / 'patch' / 'model.safetensors.index.json'} maps no "
        f"shard for 1 vision tensor that shards beside it hold ('model.visual.patch_embed.proj.weight' in "
        f"{held['model.visual.patch_embed.proj.weight']}): the index must list every tower tensor (add it to its "
        "weight_map, or save the checkpoint again)"), str(e.value)


def test_missing_layernorm_bias(tmp_path, tensors):
    mutated(tmp_path, tensors, **{"merger__post_projection_norm__bias": None})
    with pytest.raises(CheckpointError, match="post_projection_norm.bias"):
        bind_tower(tmp_path)


def test_wrong_shape_names_flat_view(tmp_path, tensors):
    w = tensors["downsample.weight"]  # (256, 128, 2, 2) read as [256, 512]
    mutated(tmp_path, tensors, **{"downsample__weight": np.ascontiguousarray(w[:, :64])})
    with pytest.raises(CheckpointError, match=r"\(256, 64, 2, 2\).*\[256, 512\] or \[256, 128, 2, 2\]"):
        bind_tower(tmp_path)


@pytest.mark.parametrize("name, shape", [
    ("downsample.weight", (256, 2, 2, 128)),           # channels last: as many values, read in another order
    ("downsample.weight", (256, 512, 1)),
    ("patch_embed.proj.weight", (128, 3, 8, 7, 7)),   # 3 x 8 x 7 x 7 = 3 x 2 x 14 x 14 = 1176
    ("patch_embed.proj.weight", (128, 14, 14, 2, 3)),
    ("blocks.0.attn.proj.weight", (128, 2, 64)),
])
def test_a_shape_with_as_many_values_in_another_order_is_refused(tmp_path, tensors, name, shape):
    w = tensors[name].reshape(shape)
    mutated(tmp_path, tensors, **{name.replace(".", "__"): w})
    with pytest.raises(CheckpointError, match=re.escape(f"{name}' has shape {shape}")):
        bind_tower(tmp_path)


def test_a_config_whose_patch_geometry_contradicts_the_stored_conv3d_is_refused(tmp_path, tensors):
    # patch 7 x 8 frames makes rows of 1,176 values too; the stored Conv3d says 14 x 2. HF refuses the mismatch.
    mutated(tmp_path, tensors)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["vision_config"].update(patch_size=7, temporal_patch_size=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"patch_embed.proj.weight' has shape \(128, 3, 2, 14, 14\)"):
        bind_tower(tmp_path)


def test_flattened_shape_rule_accepts_other_axes(tmp_path, tensors):
    # [256, 512] stored 2-D instead of (256, 128, 2, 2): same bytes, same GEMM view.
    flat = tensors["downsample.weight"].reshape(256, 512)
    mutated(tmp_path, tensors, **{"downsample__weight": flat})
    assert bind_tower(tmp_path).host("downsample.weight").shape == (256, 512)


def test_text_only_and_absent_tower_are_distinct(tmp_path, tensors, caplog):
    import json

    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "glm5_next", "hidden_size": 256}))
    with pytest.raises(NoVisionConfig, match="text-only"):
        inspect_checkpoint(text)
    absent = tmp_path / "absent"
    write_checkpoint(absent, GEO, tensors={})  # the text stand-ins alone
    with pytest.raises(AbsentTower, match="declares a vision tower"):
        inspect_checkpoint(absent)
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        assert probe_tower(text) is None
        assert not caplog.records
        assert probe_tower(absent) is None
        assert "text-only" in caplog.text


@pytest.mark.parametrize("prefix", ["model.vision_tower.", "vision_model.", "encoder."])
@pytest.mark.parametrize("layout", ["index", "shards", "one shard"])
def test_a_whole_tower_under_a_prefix_not_ending_in_visual_is_named_not_absent(tmp_path, tensors, prefix, layout):
    """A whole tower under another prefix was AbsentTower ("no tower to load"), and probe_tower served text-only:
    the error names the prefix it is under and the one a tower is loaded under."""
    path = write_checkpoint(tmp_path, GEO, tensors=tensors, prefix=prefix, shards=1 if layout == "one shard" else 2)
    given = path
    if layout != "index":
        os.remove(tmp_path / "model.safetensors.index.json")
    if layout == "one shard":
        given = str(next(tmp_path.glob("*.safetensors")))
    for said in _refused_not_absent(given, bind_tower, probe_tower):
        assert said.startswith(
            f"{given}: the checkpoint holds the vision tower's 39 tensors under {prefix!r} (e.g. "
            f"'{prefix}patch_embed.proj.weight'), but a tower is loaded only under a prefix ending in the module name "
            "'visual.' (model.visual., "), said
        assert "rename its tensors to 'model.visual.'" in said


def _refused_not_absent(path, *probes) -> list[str]:
    """The messages of the CheckpointErrors that each of `probes` raises for `path`, none an AbsentTower (which
    probe_tower would take for a text-only checkpoint)."""
    said = []
    for probe in probes:
        with pytest.raises(CheckpointError) as e:
            probe(path)
        assert not isinstance(e.value, AbsentTower)
        said.append(str(e.value))
    return said


def test_towers_under_other_prefixes_are_all_named_and_part_of_one_is_no_tower(tmp_path, tensors, caplog):
    """Two whole towers elsewhere are both named; a tensor or two of the tower's names elsewhere (another module
    may share them), or a tower short of one tensor, leave the tower absent."""
    from safetensors.numpy import save_file

    write_checkpoint(tmp_path, GEO, tensors=tensors, prefix="b.tower.")
    _add_tower(tmp_path, tensors, "a.tower.", "extra-1.safetensors")
    with pytest.raises(CheckpointError, match=r"tower's 39 tensors under each of 'a\.tower\.', 'b\.tower\.' \(e\.g\. "
                                              r"'a\.tower\.patch_embed\.proj\.weight'\).* rename one tower's tensors"):
        bind_tower(tmp_path)
    short = tmp_path / "short"
    write_checkpoint(short, GEO, tensors={k: v for k, v in tensors.items() if k != "merger.proj.weight"},
                     prefix="model.vision_tower.")
    few = tmp_path / "few"
    write_checkpoint(few, GEO, tensors={})
    save_file({"model.audio.patch_embed.proj.weight": tensors["patch_embed.proj.weight"],
               "model.audio.blocks.0.norm1.weight": tensors["blocks.0.norm1.weight"]}, few / "audio.safetensors")
    os.remove(few / "model.safetensors.index.json")
    for path in (short, few):
        with pytest.raises(AbsentTower, match="declares a vision tower"):
            bind_tower(path)


def test_part_of_a_tower_is_incomplete_not_absent(tmp_path, tensors, caplog):
    """A shard holding the patch embedding missing: an error naming what is there, never text-only serving."""
    import json

    path = write_checkpoint(tmp_path / "half", GEO, tensors=tensors, shards=2)
    index = json.loads((tmp_path / "half" / "model.safetensors.index.json").read_text())
    first = index["weight_map"]["model.visual.patch_embed.proj.weight"]
    (tmp_path / "half" / first).unlink()
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != first}
    (tmp_path / "half" / "model.safetensors.index.json").write_text(json.dumps(index))
    for probe in (inspect_checkpoint, probe_tower):
        with pytest.raises(CheckpointError, match=r"the tower is incomplete: the shards hold \d+ vision tensors "
                                                  r"\(e\.g\. 'model\.visual\.") as e:
            probe(path)
        assert not isinstance(e.value, AbsentTower)


def test_an_index_listing_none_of_the_tower_its_shards_hold_is_not_an_absent_tower(tmp_path, tensors, caplog):
    """An index whose weight_map lists no vision tensor, beside shards holding the whole tower, was AbsentTower
    ("the shards hold no tower to load"), and probe_tower served text-only: the error names the index and the
    shards holding what it leaves out."""
    path = write_checkpoint(tmp_path, GEO, tensors=tensors)
    held = _unindex(tmp_path, *tensors)
    for said in _refused_not_absent(path, inspect_checkpoint, probe_tower):
        assert said.startswith(
            f"{path}: the index lists no vision tensor; {tmp_path / 'model.safetensors.index.json'} maps no shard for "
            f"{len(held)} vision tensors that shards beside it hold ("), said
        assert "the index must list every tower tensor" in said


def test_empty_directory_and_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="empty directory"):
        inspect_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        inspect_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="the checkpoint path is empty: give a checkpoint folder"):
        bind_tower("")
    import os

    from tests.golden import cases

    assert bind_tower(os.fsencode(cases.TOWER_DIR)).geometry == bind_tower(cases.TOWER_DIR).geometry  # a bytes path


def test_geometry_disagreeing_with_tensors(tmp_path, tensors):
    import json

    write_checkpoint(tmp_path, GEO, tensors=tensors)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["vision_config"]["intermediate_size"] = 512
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight.*does not match its config"):
        bind_tower(tmp_path)


def test_cached_checkpoint_writes_once(tmp_path, tensors, monkeypatch):
    from glmvit_cupy.checkpoint import synthetic

    path = synthetic.cached_checkpoint(tmp_path / "c", GEO, seed=5)
    assert bind_tower(path).geometry == GEO and not (tmp_path / "c.tmp").exists()
    monkeypatch.setattr(synthetic, "write_checkpoint", lambda *a, **k: pytest.fail("written twice"))
    assert synthetic.cached_checkpoint(tmp_path / "c", GEO, seed=5) == str(tmp_path / "c")
    with pytest.raises(ValueError, match="holds random weights of seed 5, not seed 6: give a new folder"):
        synthetic.cached_checkpoint(tmp_path / "c", GEO, seed=6)
    import dataclasses

    with pytest.raises(ValueError, match="holds a checkpoint of another geometry"):
        synthetic.cached_checkpoint(tmp_path / "c", dataclasses.replace(GEO, depth=GEO.depth + 1), seed=5)


def test_the_seed_of_a_folder_is_read_from_a_shard_that_is_checked_first(tmp_path, tensors):
    """written_seed reads the first shard the index lists, which may hold no tower tensor and so was never bound:
    a FIFO there must not block it, garbage must not raise; neither is a seed."""
    import json
    import os

    from glmvit_cupy.checkpoint import synthetic

    path = synthetic.cached_checkpoint(tmp_path / "c", GEO, seed=5)
    assert synthetic.written_seed(path) == 5
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "a-text.safetensors"  # sorted first
    (tmp_path / "c" / "model.safetensors.index.json").write_text(json.dumps(index))
    os.mkfifo(tmp_path / "c" / "a-text.safetensors")
    assert synthetic.written_seed(path) is None
    (tmp_path / "c" / "a-text.safetensors").unlink()
    (tmp_path / "c" / "a-text.safetensors").write_bytes(b"garbage!garbage!")
    assert synthetic.written_seed(path) is None
    index["weight_map"]["lm_head.weight"] = "../a-text.safetensors"
    (tmp_path / "c" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert synthetic.written_seed(path) is None
    (tmp_path / "c" / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)  # past the stack
    assert synthetic.written_seed(path) is None


def _config(path, change):
    import json

    cfg = json.loads((path / "config.json").read_text())
    change(cfg["vision_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_depth_past_the_shards_is_refused_before_the_layout(tmp_path, tensors):
    """A config may claim any depth: 10**12 blocks would exhaust memory building their 14 x 10**12 names,
    so the binder compares the claim with the shards first and says what they hold."""
    write_checkpoint(tmp_path, GEO, tensors=tensors)
    for depth in (10**12, GEO.depth + 1):
        _config(tmp_path, lambda v: v.__setitem__("depth", depth))
        with pytest.raises(CheckpointError, match=rf"depth = {depth} blocks.*hold 39 vision tensors.*blocks 0-1 at "
                                                  r"most: no 'model.visual.blocks.2.norm1.weight'"):
            bind_tower(tmp_path)


def test_a_depth_short_of_the_shards_binds_and_says_what_it_leaves(tmp_path, tensors, caplog):
    """The reference builds the blocks its config names and ignores the rest; so does the binder, aloud."""
    write_checkpoint(tmp_path, GEO, tensors=tensors)
    _config(tmp_path, lambda v: v.__setitem__("depth", 1))
    with caplog.at_level(logging.WARNING, logger="glmvit_cupy"):
        b = bind_tower(tmp_path)
    assert b.geometry.depth == 1 and len(b.layout) == 25
    assert "14 tower tensors are not read under vision_config (depth = 1)" in caplog.text
    assert "model.visual.blocks.1." in caplog.text


@pytest.mark.parametrize("which", ["config.json", "index", "header"])
def test_json_nested_past_the_parsers_depth_is_a_checkpoint_error(tmp_path, tensors, which):
    """Python's JSON parser raises RecursionError (not a JSONDecodeError) past ~1,000 levels: each of the
    checkpoint's three JSON readers turns it into a CheckpointError naming the file."""
    import struct

    write_checkpoint(tmp_path, GEO, tensors=tensors)
    deep = b"[" * 2_000 + b"]" * 2_000  # past the parser's depth, within the values a header may hold
    if which == "config.json":
        target = tmp_path / "config.json"
        target.write_bytes(deep)
    elif which == "index":
        target = tmp_path / "model.safetensors.index.json"
        target.write_bytes(deep)
    else:
        target = sorted(tmp_path.glob("*.safetensors"))[0]
        target.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(CheckpointError, match="not valid JSON") as e:
        bind_tower(tmp_path)
    assert str(target) in str(e.value)


def _poisoned(tensors, where):
    """tensors with {suffix: [(flat index, bf16 bits)]} written over."""
    t = dict(tensors)
    for name, spots in where.items():
        a = t[name].copy()
        bits = a.reshape(-1).view(np.uint16)
        for i, v in spots:
            bits[i] = v
        t[name] = a
    return t


# +inf, -inf, a quiet NaN, a NaN with a payload; and bf16's largest finite value, a subnormal and -0 (fine)
NONFINITE = [0x7F80, 0xFF80, 0x7FC0, 0xFF81]
EDGE_FINITE = [0x7F7F, 0xFF7F, 0x0001, 0x8000]


def test_the_reference_refuses_nan_and_inf_weights_by_name(tmp_path, tensors):
    from glmvit_cupy import reference

    # One in a GEMM weight, three in a bias the GPU model folds into its offsets, one in a norm weight.
    where = {"blocks.1.attn.qkv.weight": [(5, 0x7FC0)], "blocks.0.mlp.down_proj.bias": [(0, 0x7F80), (3, 0xFF80),
             (7, 0xFF81)], "merger.post_projection_norm.weight": [(2, 0x7F80)]}
    path = write_checkpoint(tmp_path, GEO, tensors=_poisoned(tensors, where))
    with pytest.raises(CheckpointError) as e:
        reference.Tower(bind_tower(path))
    msg = str(e.value)
    assert "NaN or infinite weights in 3 tower tensors" in msg and "download it again" in msg
    assert "model.visual.blocks.1.attn.qkv.weight" in msg and ": 1 of 49,152" in msg
    assert "model.visual.blocks.0.mlp.down_proj.bias" in msg and ": 3 of 128" in msg
    assert "merger.post_projection_norm.weight" in msg
    # The edge of the finite range is not refused.
    path = write_checkpoint(tmp_path / "edge", GEO, tensors=_poisoned(
        tensors, {"blocks.1.attn.qkv.weight": list(enumerate(EDGE_FINITE))}))
    reference.Tower(bind_tower(path))


def test_all_zero_weights_are_refused_by_name_zero_biases_are_not(tmp_path, tensors):
    """A shard preallocated and never written reads as zeros and passed every check: its images got all-zero
    embeddings, and one all-zero norm weight gave every image the same embedding. A weight whose every value is
    +0 or -0 is refused by name; one nonzero value anywhere (past the sampled runs too), and zero biases, pass."""
    from safetensors import safe_open

    norm = dict(tensors)
    norm["post_layernorm.weight"] = np.zeros_like(tensors["post_layernorm.weight"])
    with pytest.raises(CheckpointError) as e:
        bind_tower(write_checkpoint(tmp_path / "norm", GEO, tensors=norm))
    said = str(e.value)
    assert "1 tower weight is all zeros: 'model.visual.post_layernorm.weight' (in model-0000" in said, said
    assert "download it again" in said, said
    edge = dict(tensors)
    for suffix in tensors:
        if suffix.endswith("bias"):
            edge[suffix] = np.zeros_like(tensors[suffix])
    big = "blocks.0.mlp.down_proj.weight"
    flat = np.zeros(tensors[big].size, np.uint16)
    flat[257] = 0x8000  # -0: zero all the same
    flat[-1] = 0x0001   # one subnormal, the last value, outside every sampled run
    edge[big] = flat.view(ml_dtypes.bfloat16).reshape(tensors[big].shape)
    bind_tower(write_checkpoint(tmp_path / "edge", GEO, tensors=edge))
    flat[-1] = 0x8000
    edge[big] = flat.view(ml_dtypes.bfloat16).reshape(tensors[big].shape)
    with pytest.raises(CheckpointError, match=f"all zeros: 'model.visual.{big}'"):
        bind_tower(write_checkpoint(tmp_path / "edge0", GEO, tensors=edge))
    # A shard whose data section is all zeros (its header intact): every weight in it is named.
    folder = write_checkpoint(tmp_path / "shard", GEO, tensors=tensors, shards=2)
    shard = os.path.join(folder, "model-00002-of-00002.safetensors")
    with safe_open(shard, "numpy") as f:
        held = [n for n in f.keys() if n.startswith("model.visual.") and n.endswith("weight")]
    raw = open(shard, "rb").read()
    start = 8 + int.from_bytes(raw[:8], "little")
    open(shard, "wb").write(raw[:start] + bytes(len(raw) - start))
    with pytest.raises(CheckpointError) as e:
        bind_tower(folder)
    said = str(e.value)
    assert f"{len(held)} tower weights are all zeros: " in said and "(in model-00002-of-00002.safetensors)" in said, said


def _swap(folder, name, kind):
    p = folder / name
    p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "folder":
        p.mkdir()
    elif kind == "dev_zero":
        p.symlink_to("/dev/zero")
    elif kind == "loop":
        p.symlink_to(p)
    elif kind == "broken_link":
        p.symlink_to(folder / "gone")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
@pytest.mark.parametrize("name,kind,says", [
    ("config.json", "fifo", "config.json is a FIFO (named pipe), not a regular file"),
    ("config.json", "dev_zero", "config.json is a character device, not a regular file"),
    ("config.json", "broken_link", "config.json is a broken symbolic link"),
    ("config.json", "loop", "config.json cannot be read"),
    ("model.safetensors.index.json", "fifo", "the index is a FIFO (named pipe), not a regular file"),
    ("model.safetensors.index.json", "dev_zero", "the index is a character device, not a regular file"),
    ("model.safetensors.index.json", "broken_link", "the index is a broken symbolic link"),
    ("model-00002-of-00002.safetensors", "fifo", "which is a FIFO (named pipe)"),
    ("model-00002-of-00002.safetensors", "dev_zero", "which is a character device"),
    ("model-00002-of-00002.safetensors", "folder", "which is a folder"),
    ("model-00002-of-00002.safetensors", "loop", "which is unreadable (Too many levels of symbolic links)"),
    ("model-00002-of-00002.safetensors", "broken_link", "which is a broken symbolic link"),
])
def test_checkpoint_files_that_are_not_regular_files_are_refused_by_what_they_are(tmp_path, name, kind, says):
    """A FIFO named config.json made the load wait forever for a writer (and /dev/zero would read without end):
    each odd file is refused at once, saying what it is."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(cases.TOWER_DIR, folder)
    _swap(folder, name, kind)
    said = said_within(lambda: inspect_checkpoint(folder), CheckpointError)
    assert says in said, said
    if kind == "fifo" and name.endswith(".safetensors"):  # an unindexed shard folder and a bare path: the same
        (folder / "model.safetensors.index.json").unlink()
        with pytest.raises(CheckpointError, match="the shard is a FIFO"):
            inspect_checkpoint(folder)
        with pytest.raises(CheckpointError, match="is a FIFO \\(named pipe\\), not a checkpoint folder or file"):
            inspect_checkpoint(folder / name)
        with pytest.raises(CheckpointError, match="is a FIFO \\(named pipe\\), not a shard or checkpoint folder"):
            WeightStore.open(folder / name)


def test_random_checkpoint_command(tmp_path, monkeypatch, capsys):
    """python -m glmvit_cupy.checkpoint.synthetic DIR: says loudly that the weights are random, writes a
    checkpoint that binds, readable as the umask allows (safetensors alone writes 0600), refuses a folder
    that holds something else and leaves a finished one as it is. (The small geometry stands in for the
    official one, which takes ~12 s to write.)"""
    from glmvit_cupy.checkpoint import synthetic

    monkeypatch.setattr(synthetic.VisionGeometry, "official", staticmethod(lambda: GEO))
    old = os.umask(0o022)
    try:
        assert synthetic.main([str(tmp_path / "rnd")]) == 0
    finally:
        os.umask(old)
    err = capsys.readouterr().err
    assert "RANDOM WEIGHTS" in err and "--checkpoint" in err
    assert bind_tower(str(tmp_path / "rnd")).geometry == GEO
    assert {oct(os.stat(p).st_mode & 0o777) for p in (tmp_path / "rnd").iterdir()} == {oct(0o644)}
    assert synthetic.main([str(tmp_path / "rnd")]) == 0 and "already holds a checkpoint" in capsys.readouterr().err
    assert synthetic.main([str(tmp_path / "rnd"), "--seed", "0"]) == 0
    assert "(random weights, seed 0); nothing written" in capsys.readouterr().err
    # Other weights asked of a folder that holds seed 0's: refused, not silently the old ones.
    assert synthetic.main([str(tmp_path / "rnd"), "--seed", "1"]) == 2
    assert "already holds random weights of seed 0, not seed 1: give a new folder" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert synthetic.main([str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "not an empty folder" in err and "RANDOM WEIGHTS" not in err  # refused before it says it writes
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    # Each refused before anything is written, with one line: nothing half-written is left behind.
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    (tmp_path / "stale.tmp").write_text("x")
    for target, says in (("cfg", "holds a config.json but no checkpoint this package reads"),
                         ("link", "is a symbolic link to"), ("stale", "stale.tmp (where the checkpoint is written "
                                                                     "first) is in the way")):
        assert synthetic.main([str(tmp_path / target)]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    assert synthetic.main(["/proc/glmvit-rnd"]) == 2 and "cannot write /proc/glmvit-rnd" in capsys.readouterr().err
    assert not os.path.exists("/proc/glmvit-rnd.tmp")
    (tmp_path / "empty").mkdir()  # an empty folder is written into (renamed onto), not removed first
    real = synthetic.write_checkpoint

    def interrupted(path, *a, **k):
        real(path, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "write_checkpoint", interrupted)
    assert synthetic.main([str(tmp_path / "empty")]) == 130 and "interrupted" in capsys.readouterr().err
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
    assert not (tmp_path / "empty.tmp").exists()  # the half-written gigabyte is removed
    monkeypatch.setattr(synthetic, "write_checkpoint", real)
    assert synthetic.main([str(tmp_path / "empty")]) == 0 and bind_tower(str(tmp_path / "empty")).geometry == GEO


def test_inspect_reads_the_values_too(tmp_path, tensors):
    """inspect_checkpoint (glmvit-encode --inspect) runs every load-time check, NaN and infinite weights
    included, as the engine and the reference refuse them; the edge of the finite range passes."""
    from glmvit_cupy import inspect_checkpoint

    where = {"blocks.1.attn.qkv.weight": [(5, v) for v in NONFINITE[:1]] + [(9, NONFINITE[3])],
             "merger.post_projection_norm.weight": [(2, NONFINITE[1])]}
    path = write_checkpoint(tmp_path, GEO, tensors=_poisoned(tensors, where))
    with pytest.raises(CheckpointError, match="NaN or infinite weights in 2 tower tensors.*qkv.weight.*: 2 of"):
        inspect_checkpoint(path)
    edge = write_checkpoint(tmp_path / "edge", GEO, tensors=_poisoned(
        tensors, {"blocks.1.attn.qkv.weight": list(enumerate(EDGE_FINITE))}))
    assert inspect_checkpoint(edge)["tensors"] == len(tensors)


@pytest.mark.parametrize("edit, says", [
    (lambda c: c["vision_config"].update(rms_norm_eps=10**400), "rms_norm_eps = 1000000000000000000000000000000000000000"
                                                                "... (401 characters) is past any float"),
    (lambda c: c["vision_config"]["rope_parameters"].update(rope_theta=10**400),
     "rope_theta = 1000000000000000000000000000000000000000... (401 characters) is past any float"),
    (lambda c: c["vision_config"].update(depth="DEPTH"), "config.json is not valid JSON (Exceeds the limit"),
])
def test_numbers_past_what_python_holds_are_a_checkpoint_error(tmp_path, edit, says):
    """An integer past any float, or past the digits Python parses (4,300): a CheckpointError naming the file or
    the field, not an OverflowError or ValueError traceback."""
    import json
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(cases.TOWER_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config).replace('"DEPTH"', "9" * 5000))  # json.dumps cannot
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(folder)
    assert says in str(e.value), str(e.value)


def test_a_folder_that_cannot_be_listed_is_a_checkpoint_error(tmp_path, monkeypatch):
    """No permission to list the folder (root reads every folder, so the refusal is simulated): bind_tower and
    WeightStore.open say so alike."""
    real = os.listdir

    def refused(path):
        if os.fspath(path) == str(tmp_path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", refused)
    with pytest.raises(CheckpointError, match="the checkpoint folder cannot be read .*Permission denied"):
        bind_tower(tmp_path)
    with pytest.raises(CheckpointError, match="cannot be listed .*Permission denied"):
        WeightStore.open(tmp_path)


def test_the_fingerprint_follows_the_tower_not_its_path(tmp_path):
    """A copy, a link or a shard path give the same fingerprint; a config value that changes the embeddings
    (swiglu_limit) gives another (a weight's bit: test_cli's folder test)."""
    import json
    import shutil

    from tests.golden import cases

    here = bind_tower(cases.TOWER_DIR).fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(cases.TOWER_DIR, copy)
    (tmp_path / "link").symlink_to(copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    assert {bind_tower(p).fingerprint for p in (copy, tmp_path / "link", shard)} == {here} and len(here) == 64
    cfg = json.loads((copy / "config.json").read_text())
    where = cfg.get("vision_config", cfg)
    where["swiglu_limit"] = where.get("swiglu_limit", 10.0) + 1
    (copy / "config.json").write_text(json.dumps(cfg))
    assert bind_tower(copy).fingerprint != here


def test_random_checkpoint_command_refuses_a_negative_seed(tmp_path, capsys):
    """--seed -1 is a usage error (exit status 2, one line), said before the banner and anything written:
    NumPy's generators take non-negative seeds only."""
    from glmvit_cupy.checkpoint import synthetic

    with pytest.raises(SystemExit) as exit_:
        synthetic.main([str(tmp_path / "rnd"), "--seed", "-1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--seed -1: a seed is a non-negative integer" in err and "RANDOM WEIGHTS" not in err, err
    assert not (tmp_path / "rnd").exists() and not (tmp_path / "rnd.tmp").exists()


@pytest.mark.parametrize("lost", [1, 2, 3])
def test_a_folder_without_an_index_missing_a_numbered_shard_names_that_shard(tmp_path, tensors, lost):
    """Shards named model-0000k-of-0000n.safetensors, no index, one of them gone (a download cut short): the error
    named the config as wrong ("the config does not describe this checkpoint") or an index there is none of; it
    names the shard missing."""
    path = write_checkpoint(tmp_path, GEO, tensors=tensors, shards=3)
    (tmp_path / "model.safetensors.index.json").unlink()
    gone = f"model-0000{lost}-of-00003.safetensors"
    (tmp_path / gone).unlink()
    with pytest.raises(CheckpointError) as e:
        bind_tower(path)
    said = str(e.value).replace(str(tmp_path), "FOLDER")
    assert f"FOLDER holds 2 of the 3 shards their names count: no {gone}; a shard is missing" in said, said
    assert "does not describe" not in said and "index" not in said, said
    assert not isinstance(e.value, AbsentTower)


def test_many_numbered_groups_missing_shards_are_summed_up_not_listed(tmp_path, tensors):
    """Beside a tower missing a shard, six groups of numbered junk shards, each naming 99,999 shards and
    holding one: the error built every absent name of every group (30 s and a 60 KB line for 300 such
    groups); it names three groups by their first three absent shards, the tower's (holding the most) first,
    and counts the rest."""
    from safetensors.numpy import save_file

    path = write_checkpoint(tmp_path, GEO, tensors=tensors, shards=3)
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    for i in range(6):
        save_file({}, str(tmp_path / f"junk{i}-00001-of-99999.safetensors"))
    with pytest.raises(CheckpointError) as e:
        bind_tower(path)
    said = str(e.value).replace(str(tmp_path), "FOLDER")
    assert "FOLDER holds 1 of the 99,999 shards their names count: no junk0-00002-of-99999.safetensors, " \
           "junk0-00003-of-99999.safetensors, junk0-00004-of-99999.safetensors and 99,995 more" in said, said
    assert said.index("no model-00002-of-00003.safetensors;") < said.index("junk0-"), said
    assert "junk1-00002" in said and "junk2-" not in said and "; 4 more groups of numbered shards lack some" in said, said
    assert len(said) < 2000, len(said)


def test_embeddings_given_as_a_checkpoint_are_named_as_such(tmp_path):
    """glmvit-encode's output folder (manifest.json and shards), or an embeddings .safetensors file with no
    config.json beside it, given where a checkpoint goes: the error says what was given, not only that a
    config.json is missing from a folder the user never named."""
    from safetensors.numpy import save_file

    out = tmp_path / "embeddings"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    save_file({"a.jpg": np.zeros((4, 8), np.float32)}, str(out / "embeddings-00001.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(f"{out}: a folder of embeddings (glmvit-encode's output")):
        bind_tower(out)
    lone = tmp_path / "answer.safetensors"
    save_file({"embeddings": np.zeros((4, 8), np.float32)}, str(lone))
    for given in (lone, out / "embeddings-00001.safetensors"):
        with pytest.raises(CheckpointError, match=re.escape(f"{given}: no config.json beside it, so it is not a shard")):
            bind_tower(given)
    for given in (lone, out):
        with pytest.raises(CheckpointError, match="a Hub id"):
            inspect_checkpoint(given)
