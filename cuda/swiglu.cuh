// The clamped SwiGLU of one element: the activations pass (activations.cu) and the GEMM epilogue that
// fuses it (gemm_sm90.cu) compute it with this one function.
#pragma once

// silu(min(g, L)) * clamp(u, -L, L). __expf and __fdividef: ex2.approx and one reciprocal instead of
// expf's range reduction and an IEEE division, which would make this memory-bound pass issue-bound (the
// output is rounded to bf16 right after; the kernel test bounds the error against float64).
__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return __fdividef(g, 1.f + __expf(-g)) * u;
}
