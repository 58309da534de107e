// Clamped SwiGLU (blocks and merger) and the element-wise epilogues: bias + bf16, float32 -> bf16.
//
// Napkin math (8000 tokens = 32,000 patches; H200 HBM 4.8 TB/s). All memory-bound (a handful of FLOP
// and one exp an output element against 6 bytes moved):
//   swiglu_clamp_bf16, one 4,096-row chunk of the MLP (I = 4,096): reads gate|up bf16 16 KB a row,
//     writes 8 KB: 101 MB, 21 us at HBM speed; 8 chunks x 24 blocks a forward. Measured
//     (bench_kernels, 66a180c): 52 us, 1.9 TB/s (40%); 7.8 ms of the 8000-token forward.
//   bias_to_bf16, the merger's 8,000 x 4,096 downsample output: 6 B an element, 197 MB, 41 us.
//     Measured: 117 us, 1.7 TB/s (35%).
//   f32_to_bf16, 32,000 x 1,176 float32 pixel rows (encode_pixels from float32): 226 MB, 47 us.
//     Measured: 121 us, 1.9 TB/s (39%). Both are under 0.1% of a forward.
#include "common.cuh"

__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return g / (1.f + expf(-g)) * u;
}

// gu: bf16 [rows, 2*I] from one GEMM over [gate; up] weights concatenated at load.
// out[r, j] = bf16(silu(min(g, L)) * clamp(u, -L, L)), g = gu[r, j] + bg[j], u = gu[r, I + j] + bu[j].
// Biases may be null (the merger has none). Grid: x over a row's columns, y over rows, both
// strided (any grid is correct; launch ceil(ceil(I/8)/256) x min(rows, 65535) blocks of 256): no
// per-element 64-bit index division. When I % 8 == 0 a thread moves eight columns (16-byte loads
// of bf16, its biases loaded once for all its rows); otherwise one column at a time.
__device__ __forceinline__ void load8(float* v, const bf16* p) {
    const float4 a = load4(p), b = load4(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

extern "C" __global__ void swiglu_clamp_bf16(const bf16* __restrict__ gu, const bf16* __restrict__ bg,
                                             const bf16* __restrict__ bu, bf16* __restrict__ out, long rows, int I,
                                             float limit) {
    const int c0 = blockIdx.x * blockDim.x + threadIdx.x, cstride = gridDim.x * blockDim.x;
    if ((I & 7) == 0) {
        for (int j = 8 * c0; j < I; j += 8 * cstride) {
            float b_g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, b_u[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (bg) load8(b_g, bg + j);
            if (bu) load8(b_u, bu + j);
            for (long r = blockIdx.y; r < rows; r += gridDim.y) {
                float g[8], u[8];
                load8(g, gu + r * 2 * I + j);
                load8(u, gu + r * 2 * I + I + j);
                float y[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) y[e] = swiglu1(g[e] + b_g[e], u[e] + b_u[e], limit);
                bf16* o = out + r * I + j;
                store4(o, y[0], y[1], y[2], y[3]);
                store4(o + 4, y[4], y[5], y[6], y[7]);
            }
        }
        return;
    }
    for (int j = c0; j < I; j += cstride)
        for (long r = blockIdx.y; r < rows; r += gridDim.y)
            out[r * I + j] = __float2bfloat16(swiglu1(load1(gu + r * 2 * I + j) + ldf(bg, j),
                                                      load1(gu + r * 2 * I + I + j) + ldf(bu, j), limit));
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
