"""Where the vision tower's tensors sit in a checkpoint: their prefixes, names and shapes.

The rule every reader of a checkpoint shares: the Hub download fetches only the shards holding
these names, the binder checks every one of them, and the random-checkpoint writer produces them.
"""

from __future__ import annotations

from ..config import VisionGeometry

# The flat layout, the nested one a re-quantisation through AutoModelForImageTextToText leaves,
# and a bare tower export: tried first, in this order. Any other prefix ending in the module name
# `visual.` is taken too (a wrapper's, e.g. PEFT's "base_model.model.model.visual."), where it is the
# only one the checkpoint holds a tower under.
VISION_PREFIXES = ("model.visual.", "model.language_model.visual.", "visual.")
_ANCHOR = "patch_embed.proj.weight"  # the tensor whose name tells where a tower sits


def is_vision_name(name: str) -> bool:
    """True for a tensor under a module named `visual` at any depth (every prefix a tower may have)."""
    return name.startswith("visual.") or ".visual." in name


def tower_prefixes(names) -> list[str]:
    """The prefixes a tower sits under among these tensor names: the known ones first, in
    VISION_PREFIXES' order, then any other ending in `visual.`, sorted."""
    found = {n[:-len(_ANCHOR)] for n in names if n.endswith(_ANCHOR)}
    found = {p for p in found if p == "visual." or p.endswith(".visual.")}
    return [p for p in VISION_PREFIXES if p in found] + sorted(found.difference(VISION_PREFIXES))


def towers_elsewhere(names, geo: VisionGeometry) -> list[str]:
    """The prefixes not ending in `visual.` under which `names` (a set) hold every tensor of the tower `geo`
    describes, sorted: a whole tower, renamed, that the loader does not take (the reference model's names and the
    Hub download's rule are `*visual.*`). Part of one is not counted: another module may share a name or two."""
    under = {n[:-len(_ANCHOR)] for n in names if n.endswith(_ANCHOR)}
    under = sorted(p for p in under if not (p == "visual." or p.endswith(".visual.")))
    if not under or geo.tensor_count > len(names):  # a depth past the names: no whole tower, nor a layout to build
        return []
    layout = tower_layout(geo)
    # Each check stops at the first name missing: the work is bounded by the names themselves.
    return [p for p in under if all(p + s in names for s in layout)]


def module_shapes(geo: VisionGeometry) -> dict[str, tuple]:
    """The two convolutions' weights in their modules' own shapes, as the reference stores them: the patch-embed
    Conv3d [hidden, channels, temporal, patch, patch] and the downsample Conv2d [out, hidden, merge, merge]."""
    return {
        "patch_embed.proj.weight": (geo.hidden_size, geo.in_channels, geo.temporal_patch_size,
                                    geo.patch_size, geo.patch_size),
        "downsample.weight": (geo.out_hidden_size, geo.hidden_size, geo.spatial_merge_size, geo.spatial_merge_size),
    }


def tower_layout(geo: VisionGeometry) -> dict[str, tuple]:
    """Every tensor the encoder reads, under the prefix, with the shape it is read as.

    2-D entries are (rows, cols) GEMM views; a stored tensor has that shape, or for the two convolutions
    their module_shapes: the 5-D patch-embed Conv3d is read as [1024, 1176] and the 4-D downsample Conv2d
    as [4096, 4096] over the same bytes. 1-D entries must match exactly.
    """
    h, i, hd = geo.hidden_size, geo.intermediate_size, geo.head_dim
    out, merger_inter = geo.out_hidden_size, geo.projection_intermediate_size
    t = {
        "patch_embed.proj.weight": (h, geo.patch_dim),
        "patch_embed.proj.bias": (h,),
    }
    for b in range(geo.depth):
        p = f"blocks.{b}."
        t.update({
            p + "norm1.weight": (h,),
            p + "norm2.weight": (h,),
            p + "attn.qkv.weight": (3 * h, h),
            p + "attn.qkv.bias": (3 * h,),
            p + "attn.q_norm.weight": (hd,),
            p + "attn.k_norm.weight": (hd,),
            p + "attn.proj.weight": (h, h),
            p + "attn.proj.bias": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.gate_proj.bias": (i,),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.up_proj.bias": (i,),
            p + "mlp.down_proj.weight": (h, i),
            p + "mlp.down_proj.bias": (h,),
        })
    t.update({
        "post_layernorm.weight": (h,),
        "downsample.weight": (out, geo.merge_dim),
        "downsample.bias": (out,),
        "merger.proj.weight": (out, out),
        "merger.post_projection_norm.weight": (out,),
        # The bias is what tells the merger's LayerNorm from the tower's RMSNorms:
        # a checkpoint without it must fail here, not run an RMSNorm in its place.
        "merger.post_projection_norm.bias": (out,),
        "merger.gate_proj.weight": (merger_inter, out),
        "merger.up_proj.weight": (merger_inter, out),
        "merger.down_proj.weight": (out, merger_inter),
    })
    assert len(t) == geo.tensor_count  # 14 per block + 11
    return t
