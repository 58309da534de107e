// Clamped SwiGLU (blocks and merger) and bias epilogues.
#include "common.cuh"

__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return g / (1.f + expf(-g)) * u;
}

// gu: [rows, 2*I] (fp32 or bf16) from one GEMM over [gate; up] weights concatenated at load.
// out[r, j] = bf16(silu(min(g, L)) * clamp(u, -L, L)), g = gu[r, j] + bg[j], u = gu[r, I + j] + bu[j].
// Biases may be null (the merger has none). Memory-bound: when I % 4 == 0 each thread moves four
// columns (one wide load per half, an 8-byte store); the arithmetic per element is the same.
template <typename T>
__device__ __forceinline__ void swiglu_rows(const T* __restrict__ gu, const bf16* __restrict__ bg,
                                            const bf16* __restrict__ bu, bf16* __restrict__ out, long rows, int I,
                                            float limit) {
    const long stride = (long)gridDim.x * blockDim.x;
    if ((I & 3) == 0) {
        const int I4 = I >> 2;
        const long n4 = rows * I4;
        for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4; i += stride) {
            const long r = i / I4;
            const int j = (int)(i - r * I4) * 4;
            const float4 g = load4(gu + r * 2 * I + j);
            const float4 u = load4(gu + r * 2 * I + I + j);
            __nv_bfloat162 lo = __floats2bfloat162_rn(swiglu1(g.x + ldf(bg, j), u.x + ldf(bu, j), limit),
                                                      swiglu1(g.y + ldf(bg, j + 1), u.y + ldf(bu, j + 1), limit));
            __nv_bfloat162 hi = __floats2bfloat162_rn(swiglu1(g.z + ldf(bg, j + 2), u.z + ldf(bu, j + 2), limit),
                                                      swiglu1(g.w + ldf(bg, j + 3), u.w + ldf(bu, j + 3), limit));
            uint2 pk;
            pk.x = *reinterpret_cast<unsigned*>(&lo);
            pk.y = *reinterpret_cast<unsigned*>(&hi);
            *reinterpret_cast<uint2*>(out + r * I + j) = pk;
        }
        return;
    }
    const long n = rows * I;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += stride) {
        const long r = i / I;
        const int j = (int)(i - r * I);
        out[i] = __float2bfloat16(swiglu1(load1(gu + r * 2 * I + j) + ldf(bg, j),
                                          load1(gu + r * 2 * I + I + j) + ldf(bu, j), limit));
    }
}

extern "C" __global__ void swiglu_clamp(const float* gu, const bf16* bg, const bf16* bu, bf16* out, long rows,
                                        int I, float limit) {
    swiglu_rows(gu, bg, bu, out, rows, I, limit);
}
extern "C" __global__ void swiglu_clamp_bf16(const bf16* gu, const bf16* bg, const bf16* bu, bf16* out, long rows,
                                             int I, float limit) {
    swiglu_rows(gu, bg, bu, out, rows, I, limit);
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
