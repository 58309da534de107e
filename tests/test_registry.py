"""The kernel registry's view of cuda/ (no GPU needed): every module and kernel the engine asks for exists."""

from glmvit_cupy.attention import VARIANTS, default_variants, pick_variant
from glmvit_cupy.kernels import cuda_dir, kernel_names, modules


def test_modules_and_kernels_the_engine_uses_exist():
    assert modules() == ["activations", "attention", "norms", "pixels", "rotary"]
    assert kernel_names("pixels") == ["patchify_u8"]
    assert (cuda_dir() / "common.cuh").is_file()
    assert set(kernel_names("norms")) == {"rmsnorm_residual", "rmsnorm_im2col", "layernorm_gelu"}
    assert set(kernel_names("activations")) == {"swiglu_clamp_bf16", "bias_to_bf16", "f32_to_bf16"}
    assert kernel_names("rotary") == ["qk_norm_rope_bf16"]
    attention = set(kernel_names("attention"))
    assert all(name in attention for name, _, _, _ in VARIANTS.values())


def test_attention_variant_choice():
    assert all(v.startswith("sm90") for v in default_variants(64, "90"))  # wgmma on Hopper
    assert default_variants(64, "80") == ("sm80_d64_w4",)  # mma.sync elsewhere
    assert default_variants(128, "90") == ("sm80_d128_w4",)  # the wgmma kernel is head_dim 64 only
    for _, rows, smem, threads in VARIANTS.values():
        assert rows % 64 == 0 and smem <= 227 * 1024  # an H100/H200 SM's shared memory
        assert threads % 128 == 0 and threads <= 512


def test_attention_variant_per_shape():
    """Short segments take 128-row tiles, long ones 192-row tiles (132 SMs, 16 heads)."""
    both = default_variants(64, "90")
    # 1,024 keys: ceil(1024 / 192) = 6 tiles x 16 heads = 96 CTAs, 36 of 132 SMs idle; 8 x 16 = 128 fill them.
    assert pick_variant(both, [1024], 16, 132) == "sm90_ws2_s3_f16"
    # 32,000 keys: 167 x 16 = 2,672 CTAs (21 waves) against 250 x 16 = 4,000 (31 waves) of 2/3 the rows.
    assert pick_variant(both, [32000], 16, 132) == "sm90_ws3_s3_f16"
    assert pick_variant(("sm80_d64_w4",), [1024], 16, 132) == "sm80_d64_w4"  # a single choice stands
