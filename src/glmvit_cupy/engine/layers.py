"""The tower's forward on the GPU, top-down, one function per sub-layer as in reference.py.

Numerics: the residual stream x is float32 (HF's bf16 forward keeps it in bf16), and every sub-layer's
output GEMM accumulates straight into it (cuBLAS beta = 1). Those GEMMs cannot add their biases, so x
is kept without them: each norm adds the running sum of the biases so far (params: `norm1_offset`,
`norm2_offset`, `post_layernorm_offset`) as it reads x, and nothing writes x + bias back. GEMMs that
feed a kernel (QKV, gate/up) write bf16 as the reference's Linear layers do. QKV runs over all rows at
once; the rope pass rewrites its q and k columns in place (the angles' cos and sin computed once a
forward) and attention reads q, k and v where they are. So does the MLP where gate/up and the SwiGLU
are one kernel, else it runs in row chunks so that gate|up stays small.
"""

from __future__ import annotations

import numpy as np

from ..config import VisionGeometry
from . import gemm_sm90, ops
from .arena import MERGER_CHUNK, ROW_CHUNK, Arena
from .gemm import BF16
from .params import Block, Merger, Weights
from .plans import Plan

LAYERNORM_EPS = 1e-5  # the merger's post_projection_norm (nn.LayerNorm's default)


def forward(g: VisionGeometry, w: Weights, s: Arena, plan: Plan, blas, mark=None, fused_swiglu=False):
    """The call's pixel rows (bf16 in s["pixels"], or float32 in s["pixels_f32"] where s["pixels_cast"] is
    set) -> s["embeddings"] [patches / merge^2, out_hidden], over the plan's budget of plan.patches rows.
    mark(stage), when given, is called at each stage's end (the runner times stages with it).
    fused_swiglu: the gate/up GEMMs apply the clamped SwiGLU in their epilogue (gemm_sm90.cu, Hopper)
    instead of cuBLAS writing gate|up for a separate pass."""
    n = plan.patches
    x = s["residual"][:n]
    ops.cast_pixels(s["pixels_cast"], plan.cu_seqlens[-1:], s["pixels_f32"][:n], s["pixels"][:n])
    patch_embed(w, s, n, blas)
    ops.rope_table(plan.positions, w.inv_freq, s["rope"][:n])  # this batch's angles, for every block's rope
    if mark:
        mark("patch_embed")
    for blk in w.blocks:
        attn(g, blk, s, plan, x, blas)
        mlp(g, blk, s, x, blas, fused_swiglu)
    if mark:
        mark("blocks")
    merger(g, w.merger, s, x, blas, fused_swiglu)
    if mark:
        mark("merger")


def gemm_shapes(g: VisionGeometry, patches: int, fused_swiglu=False) -> list[tuple]:
    """(name, n, k, out dtype, accumulate, most rows a call) of forward()'s cuBLAS GEMMs at up to `patches`
    patches: the shapes the model tunes at load (gemm_tune.py). The patch embed, a GEMM once a forward,
    keeps cuBLAS's default pick."""
    h, i, o, pi = g.hidden_size, g.intermediate_size, g.out_hidden_size, g.projection_intermediate_size
    chunk, merged = mlp_chunk(patches, fused_swiglu), max(1, min(patches // g.merge_patches, MERGER_CHUNK))
    f32 = np.float32
    shapes = [("attn.qkv", 3 * h, h, BF16, False, patches), ("attn.proj", h, h, f32, True, patches),
              ("mlp.down_proj", h, i, f32, True, chunk), ("merger.downsample", o, g.merge_dim, f32, False, merged),
              ("merger.proj", o, o, f32, False, merged), ("merger.down_proj", o, pi, BF16, False, merged)]
    if not fused_swiglu:
        shapes += [("mlp.gate_up", 2 * i, h, BF16, False, chunk), ("merger.gate_up", 2 * pi, o, BF16, False, merged)]
    return shapes


def mlp_chunk(n: int, fused_swiglu: bool) -> int:
    """Rows an MLP GEMM runs at once over n rows: all of them where gate/up and the SwiGLU are one kernel
    (no gate|up intermediate), else ROW_CHUNK so that gate|up stays small."""
    return max(1, n if fused_swiglu else min(n, ROW_CHUNK))


def patch_embed(w: Weights, s: Arena, n: int, blas):
    """x = pixels @ patch_embed.proj.weight.T (the Conv3d as a GEMM); its bias is in the norms' offsets."""
    ops.linear(s["pixels"][:n], w.patch_embed_weight, s["residual"][:n], handle=blas, name="GEMM patch_embed")


def attn(g: VisionGeometry, blk: Block, s: Arena, plan: Plan, x, blas):
    """x += attn.proj(attention(rope(q_norm / k_norm(attn.qkv(norm1(x + norm1_offset)))))) without proj's bias
    and without V's (attention passes a constant through: attn.proj.weight @ v's bias joins norm2_offset)."""
    n, heads, h = plan.patches, g.num_heads, g.hidden_size
    normed, qkv, o = s["normed"][:n], s["qkv"][:n], s["attn_out"][:n]
    ops.rmsnorm_residual(x, blk.norm1_offset, blk.norm1, normed, g.rms_norm_eps)  # the biases so far, then norm1
    ops.linear(normed, blk.qkv_weight, qkv, handle=blas, name="GEMM attn.qkv")
    ops.qk_norm_rope(qkv, blk.qkv_bias, blk.q_norm, blk.k_norm, s["rope"][:n], heads,
                     g.rms_norm_eps)  # in place; + q's and k's biases (v's is in norm2_offset)
    q, k, v = qkv[:, :h], qkv[:, h:2 * h], qkv[:, 2 * h:]
    ops.flash_attention(plan.variant, q, k, v, o, plan.cu_seqlens, plan.tile_seg, plan.tile_q0, heads,
                        flop=plan.attention_flop)
    ops.linear(o, blk.proj_weight, x, accumulate=True, handle=blas, name="GEMM attn.proj")


def mlp(g: VisionGeometry, blk: Block, s: Arena, x, blas, fused_swiglu):
    """x += mlp.down_proj(silu(min(gate, L)) * clamp(up, -L, L)) of norm2(x + norm2_offset), without down's bias."""
    n = x.shape[0]
    normed = s["normed"][:n]
    ops.rmsnorm_residual(x, blk.norm2_offset, blk.norm2, normed, g.rms_norm_eps)  # + attn.proj's bias too
    chunk = mlp_chunk(n, fused_swiglu)
    for r0 in range(0, n, chunk):
        rows = min(chunk, n - r0)
        act = s["mlp_act"][:rows]
        gate_up_swiglu(normed[r0:r0 + rows], blk.gate_up_weight, blk.gate_bias, blk.up_bias, act, g.swiglu_limit,
                       s, "gate_up", blas, fused_swiglu, "GEMM mlp.gate_up (+ swiglu)")  # + gate/up biases
        ops.linear(act, blk.down_weight, x[r0:r0 + rows], accumulate=True, handle=blas, name="GEMM mlp.down_proj")


def merger(g: VisionGeometry, m: Merger, s: Arena, x, blas, fused_swiglu):
    """post_layernorm(x + post_layernorm_offset) as the m x m im2col -> downsample -> merger.proj ->
    post_projection_norm + GELU -> clamped SwiGLU -> merger.down_proj, into s["embeddings"]."""
    tokens = x.shape[0] // g.merge_patches  # a budget need not be a multiple of merge^2 (the real rows are)
    cols, out = s["im2col"][:tokens], s["embeddings"][:tokens]
    ops.rmsnorm_im2col(x[:tokens * g.merge_patches], m.post_layernorm_offset, m.post_layernorm, cols,
                       g.rms_norm_eps)  # every bias
    for r0 in range(0, tokens, MERGER_CHUNK):
        rows = min(MERGER_CHUNK, tokens - r0)
        wide, narrow = s["merger_f32"][:rows], s["merger_bf16"][:rows]  # [rows, out_hidden] in fp32 and bf16
        act = s["merger_act"][:rows]
        ops.linear(cols[r0:r0 + rows], m.downsample_weight, wide, handle=blas, name="GEMM merger")
        ops.add_bias_to_bf16(wide, m.downsample_bias, narrow)
        ops.linear(narrow, m.proj_weight, wide, handle=blas, name="GEMM merger")
        ops.layernorm_gelu(wide, m.post_projection_norm_weight, m.post_projection_norm_bias, narrow, LAYERNORM_EPS)
        gate_up_swiglu(narrow, m.gate_up_weight, None, None, act, g.swiglu_limit, s, "merger_gate_up", blas,
                       fused_swiglu, "GEMM merger")
        ops.linear(act, m.down_weight, out[r0:r0 + rows], handle=blas, name="GEMM merger")


def gate_up_swiglu(a, weight, gate_bias, up_bias, act, limit, s: Arena, slot, blas, fuse, name):
    """act = silu(min(gate, L)) * clamp(up, -L, L) of a @ [gate; up].T + biases: one kernel (the model
    decided at load that its MLPs fit gemm_sm90.cu), or cuBLAS into the arena's gate/up `slot` and the
    activations pass."""
    if fuse:
        gemm_sm90.gate_up_swiglu(a, weight, gate_bias, up_bias, act, limit, name=name)
    else:
        gate_up = s[slot][:a.shape[0]]
        ops.linear(a, weight, gate_up, handle=blas, name=name)
        ops.swiglu_clamp(gate_up, gate_bias, up_bias, act, limit)
