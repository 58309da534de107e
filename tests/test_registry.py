"""The kernel registry's view of cuda/ (no GPU needed): every module and kernel the engine asks for exists."""

from glmvit_cupy.attention import VARIANTS, default_variant
from glmvit_cupy.kernels import cuda_dir, kernel_names, modules


def test_modules_and_kernels_the_engine_uses_exist():
    assert modules() == ["activations", "attention", "norms", "pixels", "rotary"]
    assert kernel_names("pixels") == ["patchify_u8"]
    assert (cuda_dir() / "common.cuh").is_file()
    assert set(kernel_names("norms")) == {"rmsnorm_residual", "rmsnorm_im2col", "layernorm_gelu"}
    assert set(kernel_names("activations")) == {"swiglu_clamp", "swiglu_clamp_bf16", "bias_to_bf16", "f32_to_bf16"}
    assert kernel_names("rotary") == ["qk_norm_rope", "qk_norm_rope_bf16"]
    attention = set(kernel_names("attention"))
    assert all(name in attention for name, _, _, _ in VARIANTS.values())


def test_attention_variant_choice():
    assert default_variant(64, "90").startswith("sm90")  # wgmma on Hopper
    assert default_variant(64, "80") == "sm80_d64_w4"  # mma.sync elsewhere
    assert default_variant(128, "90") == "sm80_d128_w4"  # the wgmma kernel is head_dim 64 only
    for _, rows, smem, threads in VARIANTS.values():
        assert rows % 64 == 0 and smem <= 227 * 1024  # an H100/H200 SM's shared memory
        assert threads % 128 == 0 and threads <= 512
