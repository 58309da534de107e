"""Bind the vision tower's tensors in a checkpoint, CPU side only.

The binder checks everything the encoder will rely on — config geometry, the
prefix, every tensor's presence, dtype and shape — and hands back
names. It never uploads, and never imports the model: the loader only binds.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..config import VisionGeometry, read_config
from ..errors import AbsentTower, CheckpointError, NoVisionConfig, quoted
from ..files import not_regular, read_json_file
from .hub import resolve
from .names import VISION_PREFIXES, is_vision_name, module_shapes, tower_layout, tower_prefixes, towers_elsewhere
from .shards import INDEX_NAME, WeightStore, list_folder

log = logging.getLogger("glmvit_cupy")

@dataclass
class TowerBinding:
    """A checked tower: where its tensors are, under which prefix, with which geometry."""

    path: str
    prefix: str
    geometry: VisionGeometry
    store: WeightStore
    layout: dict = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(self.store.info(self.prefix + s).nbytes for s in self.layout)

    def host(self, suffix: str):
        """Zero-copy bf16 NumPy view of one tower tensor, flattened to the shape it is read as."""
        return self.store.get(self.prefix + suffix).reshape(self.layout[suffix])

    def nonfinite_error(self, counts: dict) -> CheckpointError:
        """The error for tower tensors holding NaN or infinite values ({suffix: how many}): a trained tower
        has none, and one such weight turns every embedding it touches into NaN."""
        names = [s for s in self.layout if s in counts]  # in the checkpoint's order
        listed = "; ".join(f"{self.prefix + s} ({os.path.basename(self.store.info(self.prefix + s).file)}): "
                           f"{counts[s]:,} of {math.prod(self.layout[s]):,}" for s in names[:5])
        more = f"; and {len(names) - 5} more tensors" if len(names) > 5 else ""
        return CheckpointError(f"checkpoint {self.path}: NaN or infinite weights in {len(names)} tower tensor"
                               f"{'s' if len(names) > 1 else ''}: {listed}{more}. A trained tower has none and "
                               f"every embedding would come out NaN: the file is damaged; download it again")

    def check_values(self) -> None:
        """CheckpointError (nonfinite_error) if any tower tensor holds a NaN or an infinity, read on the host
        from the bf16 bits (exponent all ones), one tensor at a time: the whole tower is read once."""
        bad = {}
        for s in self.layout:
            bits = self.host(s).view(np.uint16)
            n = int(np.count_nonzero((bits & 0x7F80) == 0x7F80))
            if n:
                bad[s] = n
        if bad:
            raise self.nonfinite_error(bad)

    def zero_weights(self) -> list[str]:
        """The tower's weights (the tensors named *weight: matrices, norms, embeddings; not the biases) whose
        every value is zero, which no trained tower has: a shard preallocated and never written (a download
        cut short) reads as zeros and passes every other check, giving the same embedding, or zeros, for
        every image. Each is sampled first (16 runs of 256 values: ~22 MB read at the official geometry) and
        read whole only where every sampled value is zero."""
        zero = []
        for s in self.layout:
            if not s.endswith("weight"):
                continue
            bits = self.host(s).reshape(-1).view(np.uint16)
            step = max(256, bits.size // 16)
            if any((bits[i:i + 256] & 0x7FFF).any() for i in range(0, bits.size, step)):
                continue
            if not (bits & 0x7FFF).any():  # +0 and -0
                zero.append(s)
        return zero

    @functools.cached_property
    def fingerprint(self) -> str:
        """The tower's identity: the sha256 hex of its geometry (vision_config: rms_norm_eps, swiglu_limit and
        rope_theta change the embeddings too) and its tensors' names (without the prefix), dtypes, shapes and
        bytes, in the layout's order. The same tower gives the same fingerprint wherever it lies (a copy, a
        symbolic link, named by a shard or the index); weights or config rewritten in place give another.
        Reads the whole tower once (1.05 GiB at the official geometry: 1.4 s on 2 cores)."""
        h = hashlib.sha256(json.dumps(vars(self.geometry), sort_keys=True).encode())
        for s in self.layout:
            info = self.store.info(self.prefix + s)
            h.update(json.dumps([s, info.dtype, list(info.shape)]).encode())
            h.update(self.store.get(self.prefix + s).view(np.uint8).data)
        self.store.check_unchanged()  # the shards mapped at binding (zero_weights) may be written to since
        return h.hexdigest()

    def summary(self) -> dict:
        g = self.geometry
        return {
            "path": self.path,
            "prefix": self.prefix,
            "geometry": g,
            "tensors": len(self.layout),
            "bytes": self.nbytes,
            "parameters": self.nbytes // 2,
            "shards": [os.path.basename(f) for f in
                       sorted({self.store.info(self.prefix + s).file for s in self.layout})],
        }


def _check_shape(store: WeightStore, name: str, want: tuple, module: tuple | None):
    """`name`'s stored shape is `want`, or `module` (a convolution's own shape over the same bytes) where given.
    A shape that only has as many values is refused: its dimensions would be read in another order."""
    info = store.info(name)
    shape = tuple(info.shape)
    if shape == tuple(want) or shape == module:
        return
    as_module = f" or {list(module)} (the module's own shape)" if module else ""
    raise CheckpointError(
        f"{info.file}: tensor {quoted(name, 200)} has shape {quoted(shape, 80)}, but vision_config makes the encoder read it as "
        f"{list(want)}{as_module}; the checkpoint's tower geometry does not match its config")


def _held_in(found: dict, first: int = 3) -> str:
    """'a' in s1.safetensors, 'b' in s2.safetensors and N more: where the first few of {name: shard} are."""
    listed = ", ".join(f"{quoted(n, 200)} in {os.path.basename(f)}" for n, f in list(found.items())[:first])
    return listed + (f" and {len(found) - first:,} more" if len(found) > first else "")


def _list_them(n: int) -> str:
    """What to do about `n` tower tensors that shards hold but the index does not list."""
    return (f"the index must list every tower tensor (add {'them' if n > 1 else 'it'} to its weight_map, or save the "
            "checkpoint again)")


def _unlisted_note(store: WeightStore, unlisted: dict) -> str:
    """What to say of vision tensors that shards beside the index hold but the index maps to none ('' for none)."""
    if not unlisted:
        return ""
    n = len(unlisted)
    return (f"{store.index} maps no shard for {n:,} vision tensor{'s' if n > 1 else ''} that shards beside it hold "
            f"({_held_in(unlisted)}): {_list_them(n)}")


# transformers' shard names: model-00002-of-00003.safetensors. A folder's shards so named tell how many it should hold.
_NUMBERED = re.compile(r"(.*)-(\d{1,9})-of-(\d{1,9})\.safetensors")


def _numbered_gap(folder: str) -> str:
    """Where `folder`'s shards are named PREFIX-0000k-of-0000n.safetensors and some k of 1..n is not there (a
    download cut short, a file deleted): which, as '{folder} holds 2 of the 3 shards their names count: no
    model-00002-of-00003.safetensors; ...'. '' where none is missing or the names count nothing."""
    try:
        names = os.listdir(folder)
    except OSError:
        return ""
    groups: dict = {}
    for n in names:
        m = _NUMBERED.fullmatch(n)
        if m and 0 < int(m[2]) <= int(m[3]) <= 99_999:
            groups.setdefault((m[1], m[3]), set()).add(int(m[2]))
    short = sorted(((key, held) for key, held in groups.items() if len(held) < int(key[1])),
                   key=lambda g: (-len(g[1]), g[0]))  # a tower's group holds the most shards: it comes first
    said = []
    for (prefix, total), held in short[:3]:  # 3 groups, each by its first 3 absent names
        absent = list(itertools.islice((f"{prefix}-{k:0{len(total)}d}-of-{total}.safetensors"
                                        for k in range(1, int(total) + 1) if k not in held), 3))
        count = int(total) - len(held)
        said.append(f"{folder} holds {len(held):,} of the {int(total):,} shards their names count: no "
                    f"{', '.join(absent)}{f' and {count - 3:,} more' if count > 3 else ''}")
    if not said:
        return ""
    more = f"; {len(short) - 3:,} more groups of numbered shards lack some" if len(short) > 3 else ""
    return "; ".join(said) + more + "; a shard is missing (a download cut short?): download it again"


def _missing_error(store: WeightStore, prefix: str, layout: dict, missing: list, alone: str,
                   gap: str = "") -> CheckpointError:
    """The error for tower tensors the store lacks: the first few by name and shape, and a count. Where an index
    chose the shards, it says so, and names the shard holding each one that a shard beside the index holds."""
    named = ", ".join(f"{quoted(n, 200)} (shape {list(layout[n[len(prefix):]])})" for n in missing[:3])
    if len(missing) == 1:
        what = f"tensor {named}, which the encoder needs"
    else:
        what = (f"{len(missing):,} of the {len(layout):,} tower tensors the encoder needs: {named}"
                + (f" and {len(missing) - 3:,} more" if len(missing) > 3 else ""))
    if store.index is None:
        return CheckpointError(f"{store.display}: missing {what}{alone}" + (f"; {gap}" if gap else ""))
    found = store.unindexed(set(missing).__contains__)
    held = {n: found[n] for n in missing if n in found}  # in the layout's order
    absent = len(missing) - len(held)
    says = (f"{store.index}: missing {what}: the index maps no shard for {'it' if len(missing) == 1 else 'them'} "
            f"({len(layout) - len(missing):,} of the {len(layout):,} tower tensors listed)")
    if held:
        where = (f"it is in {os.path.basename(next(iter(held.values())))}" if len(missing) == 1 else
                 f"shards beside it hold {'all ' if not absent else ''}{len(held):,}{' of them' if absent else ''}: "
                 f"{_held_in(held)}")
        says += f"; {where}: {_list_them(len(held))}"
    if absent:
        rest = ("it" if len(missing) == 1 else "any of them" if not held else
                f"the other {absent:,}" if absent > 1 else "the other one")
        says += (f"; no shard beside the index holds {rest}: a shard is missing, or the checkpoint was saved "
                 f"without {'it' if absent == 1 else 'them'}")
    return CheckpointError(says)


def _index_listing(shard: str) -> str | None:
    """The index beside `shard` if it lists that shard, else None. A damaged index is a CheckpointError: the
    shard alone could hold part of a tower, or none of it, and be loaded as if that were all."""
    index = os.path.join(os.path.dirname(shard) or ".", INDEX_NAME)
    if not shard.endswith(".safetensors") or not os.path.isfile(index):
        return None
    try:
        weight_map = read_json_file(index, "the index").get("weight_map")
        return index if os.path.basename(shard) in set(weight_map.values()) else None
    except (CheckpointError, AttributeError, TypeError) as e:
        why = e if isinstance(e, CheckpointError) else "it has no 'weight_map' of tensor names to shard files"
        raise CheckpointError(f"{shard}: the index beside it cannot be read, so which shards hold the tower is not "
                              f"known ({why}); repair or remove {index}, or give the checkpoint's folder") from None


def _refuse_towers_elsewhere(path: str, store: WeightStore, geo: VisionGeometry) -> None:
    """CheckpointError where the checkpoint holds a whole tower under a prefix that does not end in `visual.`:
    not an absent tower (probe_tower would serve text-only), nor one to take (the reference model, its servers
    and the Hub download find the tower by that module name)."""
    found = towers_elsewhere(store.every_name(), geo)
    if not found:
        return
    whose = "its" if len(found) == 1 else "one tower's"
    listed = ", ".join(quoted(p, 80) for p in found[:8]) + (f" and {len(found) - 8:,} more" if len(found) > 8 else "")
    raise CheckpointError(
        f"{path}: the checkpoint holds the vision tower's {geo.tensor_count:,} tensors under "
        f"{'each of ' if len(found) > 1 else ''}{listed} (e.g. {quoted(found[0] + 'patch_embed.proj.weight', 120)}), "
        f"but a tower is loaded only under a prefix ending in the module name 'visual.' ({', '.join(VISION_PREFIXES)}, "
        "or a wrapper's such as 'base_model.model.model.visual.'), as the reference model names it: rename "
        f"{whose} tensors to 'model.visual.' and the same suffixes "
        f"(e.g. 'model.visual.patch_embed.proj.weight') and save the checkpoint again")


def _geometry_beside(folder: str, given: str):
    """read_config(folder), where the checkpoint `given` (that folder, or a file in it) has its config.json; where
    there is none, an error that says what was given instead: an output folder of embeddings, or a lone file."""
    if not os.path.lexists(os.path.join(folder, "config.json")):
        if os.path.isdir(given) and os.path.isfile(os.path.join(given, "manifest.json")):
            raise CheckpointError(f"{given}: a folder of embeddings (glmvit-encode's output: manifest.json and "
                                  "shards), not a checkpoint; give the checkpoint's folder (config.json and "
                                  "*.safetensors), one of its shards, its index .json, or a Hub id")
        if not os.path.isdir(given):
            raise CheckpointError(f"{given}: no config.json beside it, so it is not a shard or index in its "
                                  "checkpoint's folder (an embeddings file from glmvit-encode or glmvit-serve is not "
                                  "a checkpoint); give the checkpoint's folder (config.json and *.safetensors), one "
                                  "of its shards or its index .json there, or a Hub id")
    return read_config(folder)


def bind_tower(path: str | os.PathLike) -> TowerBinding:
    """Validate a checkpoint's vision tower without a GPU.

    `path` is a directory, a shard or index file, or a Hub id ('org/name': only config.json,
    the index and the shards holding vision tensors are downloaded; needs the `hub` extra).
    Raises NoVisionConfig for a text-only checkpoint, AbsentTower when the config
    declares a tower of which the shards hold no tensor, and CheckpointError for anything else.
    """
    path = resolve(path)
    if os.path.isdir(path):
        if not list_folder(path):
            raise CheckpointError(f"{path}: empty directory; expected config.json and *.safetensors shards")
        geo = _geometry_beside(path, path)
        source = path
    elif os.path.isfile(path):
        if not path.endswith((".safetensors", ".json")):
            raise CheckpointError(f"{path} is not a checkpoint: give its folder (config.json and *.safetensors), one "
                                  "of its .safetensors shards, its index .json, or a Hub id")
        # A bare shard or index: the config sits beside it. A shard that the index beside it lists is one part
        # of that checkpoint, whose tower may span several shards: the index is read.
        geo = _geometry_beside(os.path.dirname(path) or ".", path)
        source = _index_listing(path) or path
    else:
        what = not_regular(path)
        raise CheckpointError(f"{path}: is {what}, not a checkpoint folder or file" if what else
                              f"{path}: no such file or directory")
    store = WeightStore.open(source, only=is_vision_name)
    # A shard given alone, which no index beside it lists: the tower may lie in shards not given.
    alone = ("; only this shard was given, and no index beside it lists it: if the tower is in other shards, "
             "give the checkpoint's folder or its index") if source.endswith(".safetensors") else ""

    def gap() -> str:  # a folder's shards, without an index: the ones their names count and it lacks
        return _numbered_gap(path) if store.index is None and not alone and os.path.isdir(path) else ""

    prefixes = tower_prefixes(store.names())
    unlisted = store.unindexed(is_vision_name) if not prefixes else {}  # vision tensors the index leaves out
    if not prefixes and len(store):  # a part of a tower: a shard missing, not a text-only checkpoint
        some = ", ".join(quoted(n, 120) for n in sorted(store.names())[:3])
        raise CheckpointError(
            f"{path}: the tower is incomplete: {'this shard holds' if alone else 'the shards hold'} {len(store):,} "
            f"vision tensors (e.g. {some}) but no '*visual.patch_embed.proj.weight'; "
            + (_unlisted_note(store, unlisted) or gap() or "a shard holding the rest of the tower is "
               f"missing{alone or (', or the index does not list its tensors' if store.index else '')}"))
    if unlisted:  # an index that lists none of the tower the shards beside it hold: not a tower absent
        raise CheckpointError(f"{path}: the index lists no vision tensor; {_unlisted_note(store, unlisted)}")
    if not prefixes:
        _refuse_towers_elsewhere(path, store, geo)
        raise AbsentTower(
            f"{path}: config.json declares a vision tower, but no '*visual.patch_embed.proj.weight' is in the "
            f"checkpoint (looked under {', '.join(VISION_PREFIXES)} and any other prefix ending in 'visual.'); "
            f"{'this shard holds' if alone else 'the shards hold'} no tower to load{alone}")
    if prefixes[0] not in VISION_PREFIXES and len(prefixes) > 1:
        raise CheckpointError(
            f"{path}: the checkpoint holds a vision tower under each of "
            f"{', '.join(quoted(p, 80) for p in prefixes[:8])}{f' and {len(prefixes) - 8:,} more' if len(prefixes) > 8 else ''}; which one "
            f"to load is not clear (a single one, or one under {', '.join(VISION_PREFIXES)}, would be taken)")
    prefix = prefixes[0]
    if len(prefixes) > 1:  # a known prefix wins, as VISION_PREFIXES orders them; the others are worth a word
        log.warning("%s: the checkpoint holds a vision tower under %s too; the one under %s is loaded", path,
                    ", ".join(quoted(p, 80) for p in prefixes[1:4]), quoted(prefix, 80))
    # The blocks alone need 14 tensors each (VisionGeometry.tensor_count). Checked before the layout, whose names a
    # hostile depth (10**12) would exhaust memory building; a shortfall of a few tensors gets the precise message below.
    if 14 * geo.depth > len(store):
        held = next(b for b in range(len(store) + 1) if f"{prefix}blocks.{b}.norm1.weight" not in store)
        blocks = (f" ({f'blocks 0-{held - 1}' if held else 'no block'} at most: no '{prefix}blocks.{held}.norm1.weight')"
                  if held < geo.depth else "")
        raise CheckpointError(
            f"{path}: vision_config declares depth = {geo.depth} blocks of 14 tensors, but "
            f"{'this shard holds' if alone else 'the shards hold'} {len(store):,} vision tensors in all{blocks}"
            + (alone or "; " + (_unlisted_note(store, store.unindexed(is_vision_name)) or gap()
                                or "the config does not describe this checkpoint")))
    layout, modules = tower_layout(geo), module_shapes(geo)
    missing = [prefix + s for s in layout if prefix + s not in store]
    if missing:
        raise _missing_error(store, prefix, layout, missing, alone, gap())
    for suffix, want in layout.items():
        name = prefix + suffix
        store.require_bf16(name)
        _check_shape(store, name, want, modules.get(suffix))
    unused = [n for n in store.names() if n.startswith(prefix) and n[len(prefix):] not in layout]
    if unused:  # the reference ignores them too (HF: "unexpected keys"), but a config that skips blocks is worth a word
        log.warning("%s: %d tower tensors are not read under vision_config (depth = %d), e.g. %s", path, len(unused),
                    geo.depth, ", ".join(quoted(n, 200) for n in unused[:3]))
    binding = TowerBinding(path=path, prefix=prefix, geometry=geo, store=store, layout=layout)
    zero = binding.zero_weights()
    if zero:
        files = sorted({os.path.basename(store.info(prefix + s).file) for s in zero})
        named = ", ".join(quoted(prefix + s, 200) for s in zero[:5]) + (f" and {len(zero) - 5} more" * (len(zero) > 5))
        raise CheckpointError(
            f"checkpoint {path}: {len(zero)} tower weight{'s are' if len(zero) > 1 else ' is'} all zeros: {named} "
            f"(in {', '.join(files[:3])}{' and others' * (len(files) > 3)}). A trained tower has no all-zero weight, "
            "and every image would get the same embedding: the file was not fully written (a download cut short, a "
            "preallocated file?): download it again")
    return binding


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    """Run every load-time check without a GPU, the weights' values included (NaN or infinities), and
    summarise the tower. Raises CheckpointError."""
    binding = bind_tower(path)
    binding.check_values()
    return binding.summary()


def probe_tower(path: str | os.PathLike) -> TowerBinding | None:
    """bind_tower for serving engines: None (with a warning for the second) when there is no tower.

    A text-only checkpoint returns None quietly. A declared-but-absent tower also returns
    None, but warns: image requests will be refused later and the operator should hear
    it at load, not at the first request.
    """
    try:
        return bind_tower(path)
    except NoVisionConfig:
        return None
    except AbsentTower as e:
        log.warning("%s; serving text-only (image input will be refused)", e)
        return None
