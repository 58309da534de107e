// Clamped SwiGLU (blocks and merger) and bias epilogues.
#include "common.cuh"

// gu: fp32 [rows, 2*I] from one GEMM over [gate; up] weights concatenated at load.
// out[r, j] = bf16(silu(min(g, L)) * clamp(u, -L, L)), g = gu[r, j] + bg[j], u = gu[r, I + j] + bu[j].
// Biases may be null (the merger has none).
extern "C" __global__ void swiglu_clamp(const float* __restrict__ gu, const bf16* __restrict__ bg,
                                        const bf16* __restrict__ bu, bf16* __restrict__ out,
                                        long rows, int I, float limit) {
    const long n = rows * I;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / I;
        const int j = (int)(i - r * I);
        float g = gu[r * 2 * I + j] + ldf(bg, j);
        float u = gu[r * 2 * I + I + j] + ldf(bu, j);
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        out[i] = __float2bfloat16(g / (1.f + expf(-g)) * u);
    }
}

// out = bf16(y + bias), y fp32 [rows, cols]: the downsample conv's epilogue.
extern "C" __global__ void bias_to_bf16(const float* __restrict__ y, const bf16* __restrict__ bias,
                                        bf16* __restrict__ out, long rows, int cols) {
    const long n = rows * cols;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(y[i] + ldf(bias, (int)(i % cols)));
}

// out = bf16(x), for the pixel input (the reference casts pixel_values to the weight dtype).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16* __restrict__ out, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(x[i]);
}
