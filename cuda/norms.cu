// Norms of the GLM vision tower. The residual stream x is float32 (more accurate than
// the reference's bf16 stream); norms read it in fp32 and emit bf16 GEMM inputs.
//
// Napkin math (32,000 patches x 1,024; H200 HBM 4.8 TB/s). Memory-bound (~4 FLOP an element):
//   rmsnorm_residual: reads x (4 B), writes the bf16 output (2 B): 197 MB, 41 us at HBM speed; 48 a
//     forward. x itself is never written: the biases of the GEMMs that accumulate into it arrive as
//     one fp32 offset row (their running sum, engine/params.py), added as x is read (writing x + bias
//     back would move 4 B more an element). Measured: 53 us, 3.7 TB/s (77%).
//   rmsnorm_im2col: the same bytes, once a forward; strided stores. Measured: 122 us, 1.6 TB/s (34%).
//   layernorm_gelu (8,000 x 4,096 merger rows): reads fp32 (4 B), writes bf16 (2 B): 197 MB, 41 us.
//     Measured: 72 us, 2.7 TB/s (57%); under 0.1% of a forward.
//   (Measured: python benchmarks/bench_kernels.py on the H200, kernels timed back to back.)
#include "common.cuh"

// x[c] + offset[c] (offset may be null: nothing added).
__device__ __forceinline__ float offset_at(const float* xr, const float* offset, int c) {
    return offset ? xr[c] + offset[c] : xr[c];
}

// 1 / sqrt(ss_row / cols + eps), ss_row the block's sum of this thread's ss: an RMS norm's scale (ss of the
// values) or a LayerNorm's (ss of their deviations from the mean). Every thread of the block must call it.
__device__ __forceinline__ float row_inv_std(float ss, int cols, float eps, float* red) {
    return rsqrtf(block_sum(ss, red) / cols + eps);
}

// The row's mean from this thread's partial sum s (a block reduction, as above).
__device__ __forceinline__ float row_mean(float s, int cols, float* red) { return block_sum(s, red) / cols; }

// One row, one block: 1 / sqrt(mean((xr + offset)^2) + eps).
__device__ __forceinline__ float rms_inv(const float* xr, const float* offset, int cols, float eps, float* red) {
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = offset_at(xr, offset, c);
        ss += v * v;
    }
    return row_inv_std(ss, cols, eps, red);
}

// Four floats of row xr at column c into v, the offset (when given) added; returns their sum of
// squares. The register paths of both rmsnorm_residual kernels load a row this way.
__device__ __forceinline__ float load4_offset(float4& v, const float* xr, const float* offset, int c) {
    v = *reinterpret_cast<const float4*>(xr + c);
    if (offset) {
        const float4 b = *reinterpret_cast<const float4*>(offset + c);
        v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
    }
    return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
}

// bf16(v * inv * w[c..c+3]) into o (o 8-byte aligned).
__device__ __forceinline__ void store4_scaled(bf16* o, const float4& v, float inv, const bf16* w, int c) {
    const float4 wv = load4(w + c);
    store4(o, v.x * inv * wv.x, v.y * inv * wv.y, v.z * inv * wv.z, v.w * inv * wv.w);
}

// out[r] = bf16(y * rsqrt(mean(y^2) + eps) * w) of y = x[r] + offset (the running sum of the biases of
// the GEMMs that accumulated into x, fp32; null: none). x is only read. One block per row.
extern "C" __global__ void rmsnorm_residual(const float* __restrict__ x, const float* __restrict__ offset,
                                            const bf16* __restrict__ w, bf16* __restrict__ out,
                                            int rows, int cols, float eps) {
    __shared__ float red[32];
    const long r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * cols;
    if ((cols & 3) == 0 && cols <= 16 * (int)blockDim.x) {
        // The row in registers, up to four float4 a thread: x is read once, every access 8 or 16
        // bytes wide (the scalar loop below reads x twice, 4 bytes at a time: 58% of HBM).
        float4 v[4];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c = 4 * (threadIdx.x + k * blockDim.x);
            if (c < cols) ss += load4_offset(v[k], xr, offset, c);
        }
        const float inv = row_inv_std(ss, cols, eps, red);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c = 4 * (threadIdx.x + k * blockDim.x);
            if (c < cols) store4_scaled(out + r * cols + c, v[k], inv, w, c);
        }
        return;
    }
    const float inv = rms_inv(xr, offset, cols, eps, red);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[r * cols + c] = __float2bfloat16(offset_at(xr, offset, c) * inv * __bfloat162float(w[c]));
}

// rmsnorm_residual for rows of up to 32 x 4 x RMS_WARP_VEC floats (cols % 4 == 0): one warp a row,
// eight rows a block of 256, the row in registers (read once, 16-byte accesses) and summed by the
// warp alone: no shared memory, no block barrier (the block-per-row kernel above spends them on
// every row). ops.rmsnorm_residual picks it where it fits.
#define RMS_WARP_VEC 8
extern "C" __global__ void rmsnorm_residual_warp(const float* __restrict__ x, const float* __restrict__ offset,
                                                 const bf16* __restrict__ w, bf16* __restrict__ out,
                                                 int rows, int cols, float eps) {
    const long r = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;  // a whole warp: no shuffle below misses a lane
    const float* xr = x + r * cols;
    float4 v[RMS_WARP_VEC];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < RMS_WARP_VEC; ++k) {
        const int c = 4 * (lane + 32 * k);
        if (c < cols) ss += load4_offset(v[k], xr, offset, c);
    }
    const float inv = rsqrtf(warp_sum(ss) / cols + eps);
#pragma unroll
    for (int k = 0; k < RMS_WARP_VEC; ++k) {
        const int c = 4 * (lane + 32 * k);
        if (c < cols) store4_scaled(out + r * cols + c, v[k], inv, w, c);
    }
}

// The final post_layernorm fused with the downsample's m x m im2col (group = m^2 rows a merged row):
// patch row r is position j = r % group of merged row r / group, and channel c lands at column
// c * group + j, the Conv2d weight's (channel, kh, kw) order. The offset as in rmsnorm_residual.
extern "C" __global__ void rmsnorm_im2col(const float* __restrict__ x, const float* __restrict__ offset,
                                          const bf16* __restrict__ w, bf16* __restrict__ out,
                                          int rows, int cols, float eps, int group) {
    __shared__ float red[32];
    const long r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * cols;
    const float inv = rms_inv(xr, offset, cols, eps, red);
    bf16* o = out + (r / group) * (long)cols * group + (r % group);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        o[(long)c * group] = __float2bfloat16(offset_at(xr, offset, c) * inv * __bfloat162float(w[c]));
}

// The merger's LayerNorm (eps, weight, bias) fused with exact (erf) GELU:
// out = bf16(gelu((y - mean) / sqrt(var + eps) * w + b)). Two-pass variance for accuracy.
__device__ __forceinline__ float gelu_erf(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }

// One output element from its centred input d = y - mean, both paths alike (the same bits either way).
__device__ __forceinline__ float ln_gelu(float d, float inv, float w, float b) { return gelu_erf(d * inv * w + b); }

extern "C" __global__ void layernorm_gelu(const float* __restrict__ y, const bf16* __restrict__ w,
                                          const bf16* __restrict__ b, bf16* __restrict__ out,
                                          int rows, int cols, float eps) {
    __shared__ float red[32];
    const long r = blockIdx.x;
    if (r >= rows) return;
    const float* yr = y + r * cols;
    bf16* o = out + r * cols;
    if ((cols & 3) == 0 && cols <= 16 * (int)blockDim.x &&
        (((size_t)y & 15) | ((size_t)out & 7) | ((size_t)w & 7) | ((size_t)b & 7)) == 0) {
        // The row in registers, up to four float4 a thread: y read once with 16-byte accesses and both
        // passes over registers (the scalar loop below reads the row three times, 4 bytes at a time).
        float4 v[4];
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c = 4 * (threadIdx.x + k * blockDim.x);
            if (c < cols) {
                v[k] = *reinterpret_cast<const float4*>(yr + c);
                s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
            }
        }
        const float mean = row_mean(s, cols, red);
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c = 4 * (threadIdx.x + k * blockDim.x);
            if (c < cols) {
                v[k] = make_float4(v[k].x - mean, v[k].y - mean, v[k].z - mean, v[k].w - mean);
                ss += (v[k].x * v[k].x + v[k].y * v[k].y) + (v[k].z * v[k].z + v[k].w * v[k].w);
            }
        }
        const float inv = row_inv_std(ss, cols, eps, red);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c = 4 * (threadIdx.x + k * blockDim.x);
            if (c < cols) {
                const float4 wv = load4(w + c), bv = load4(b + c);
                store4(o + c, ln_gelu(v[k].x, inv, wv.x, bv.x), ln_gelu(v[k].y, inv, wv.y, bv.y),
                       ln_gelu(v[k].z, inv, wv.z, bv.z), ln_gelu(v[k].w, inv, wv.w, bv.w));
            }
        }
        return;
    }
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += yr[c];
    const float mean = row_mean(s, cols, red);
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) { float d = yr[c] - mean; ss += d * d; }
    const float inv = row_inv_std(ss, cols, eps, red);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        o[c] = __float2bfloat16(ln_gelu(yr[c] - mean, inv, __bfloat162float(w[c]), __bfloat162float(b[c])));
}
