// Clamped SwiGLU (blocks and merger) and the element-wise epilogues: bias + bf16, the pixels' float32 -> bf16.
//
// Napkin math (8000 tokens = 32,000 patches; H200 HBM 4.8 TB/s). All memory-bound (a handful of FLOP
// and one exp an output element against 6 bytes moved). Measured: python benchmarks/bench_kernels.py
// on the H200, kernels timed back to back:
//   swiglu_clamp_bf16, one 4,096-row chunk of the MLP (I = 4,096): reads gate|up bf16 16 KB a row,
//     writes 8 KB: 101 MB, 21 us at HBM speed; the unfused MLP path runs it 8 chunks x 24 blocks a
//     forward. Four rows a thread, 16-byte accesses, __expf: 28 us, 3.7 TB/s (76%).
//   bias_to_bf16, the merger's 8,000 x 4,096 downsample output: 6 B an element, 197 MB, 41 us.
//     Four elements a thread: 50 us, 3.9 TB/s (81%).
//   pixels_to_bf16, 32,000 x 1,176 float32 pixel rows (encode_pixels from float32): 226 MB, 47 us.
//     Four elements a thread: 57 us, 3.9 TB/s (82%).
//     Both are under 0.1% of a large forward; at 448² each is one of ~200 kernels.
#include "common.cuh"
#include "swiglu.cuh"

// Eight bf16 (16 bytes, as loaded) as floats.
__device__ __forceinline__ void unpack8(float* v, uint4 raw) {
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ uint4 ld16(const bf16* p) { return *reinterpret_cast<const uint4*>(p); }

// Eight floats as eight bf16 in one 16-byte store (p 16-byte aligned).
__device__ __forceinline__ void store8(bf16* p, const float* v) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<unsigned*>(&h);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// gu: bf16 [rows, 2*I] from one GEMM over [gate; up] weights concatenated at load.
// out[r, j] = bf16(silu(min(g, L)) * clamp(u, -L, L)), g = gu[r, j] + bg[j], u = gu[r, I + j] + bu[j].
// Biases may be null (the merger has none). Grid: x over a row's columns, y over groups of
// SWIGLU_ROWS rows, both strided (any grid is correct; ops.swiglu_clamp launches ceil(ceil(I/8)/256)
// x min(ceil(rows/4), 65535) blocks of 256): no per-element 64-bit index division. When I % 8 == 0
// (and every pointer is 16-byte aligned) a thread moves eight columns of SWIGLU_ROWS rows, all loads
// issued before any use (16-byte loads and stores; its biases loaded once for all its rows);
// otherwise one column at a time.
#define SWIGLU_ROWS 4
extern "C" __global__ void swiglu_clamp_bf16(const bf16* __restrict__ gu, const bf16* __restrict__ bg,
                                             const bf16* __restrict__ bu, bf16* __restrict__ out, long rows, int I,
                                             float limit) {
    const int c0 = blockIdx.x * blockDim.x + threadIdx.x, cstride = gridDim.x * blockDim.x;
    const size_t any = reinterpret_cast<size_t>(gu) | reinterpret_cast<size_t>(out) | reinterpret_cast<size_t>(bg) |
                       reinterpret_cast<size_t>(bu);
    if ((I & 7) == 0 && (any & 15) == 0) {
        for (int j = 8 * c0; j < I; j += 8 * cstride) {
            float b_g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, b_u[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (bg) unpack8(b_g, ld16(bg + j));
            if (bu) unpack8(b_u, ld16(bu + j));
            for (long r0 = (long)blockIdx.y * SWIGLU_ROWS; r0 < rows; r0 += (long)gridDim.y * SWIGLU_ROWS) {
                uint4 graw[SWIGLU_ROWS], uraw[SWIGLU_ROWS];  // raw: 4 registers a load, not 8 floats
#pragma unroll
                for (int i = 0; i < SWIGLU_ROWS; ++i) {
                    if (r0 + i < rows) {
                        graw[i] = ld16(gu + (r0 + i) * 2 * I + j);
                        uraw[i] = ld16(gu + (r0 + i) * 2 * I + I + j);
                    }
                }
#pragma unroll
                for (int i = 0; i < SWIGLU_ROWS; ++i) {
                    if (r0 + i < rows) {
                        float g[8], u[8], y[8];
                        unpack8(g, graw[i]);
                        unpack8(u, uraw[i]);
#pragma unroll
                        for (int e = 0; e < 8; ++e) y[e] = swiglu1(g[e] + b_g[e], u[e] + b_u[e], limit);
                        store8(out + (r0 + i) * I + j, y);
                    }
                }
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
    const long n = rows * cols, stride = (long)gridDim.x * blockDim.x;
    const long first = blockIdx.x * (long)blockDim.x + threadIdx.x;
    // Four elements a thread where the rows allow it (16-byte loads, 8-byte stores), else one.
    if ((cols & 3) == 0 && (((size_t)y & 15) | ((size_t)out & 7) | ((size_t)bias & 7)) == 0) {
        for (long i = first; 4 * i < n; i += stride) {
            const float4 v = reinterpret_cast<const float4*>(y)[i];
            const int c = (int)((4 * i) % cols);
            const float4 b = bias ? load4(bias + c) : make_float4(0.f, 0.f, 0.f, 0.f);
            store4(out + 4 * i, v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
        }
        return;
    }
    for (long i = first; i < n; i += stride)
        out[i] = __float2bfloat16(y[i] + ldf(bias, (int)(i % cols)));
}

// The forward's first kernel, inside its CUDA graph: the call's float32 pixel rows -> bf16 (the reference
// casts pixel_values to the weight dtype), so a float32 call needs no launch of its own between the host's
// checks and the graph (a CuPy launch there costs ~49 us of host time at 448², the GPU idle: tools/host_share.py).
// *cast == 0: the staging wrote bf16 rows itself (encode(images), bf16 input); nothing to do. *rows: the
// call's real rows (the plan's last segment bound), so a budget's padding rows keep what they held. Four
// elements a thread where x and out are aligned for it, then the last n % 4 one a thread.
extern "C" __global__ void pixels_to_bf16(const int* __restrict__ cast, const int* __restrict__ rows,
                                          const float* __restrict__ x, bf16* __restrict__ out, long cols) {
    if (*cast == 0) return;
    const long n = (long)*rows * cols;
    const long stride = (long)gridDim.x * blockDim.x, first = blockIdx.x * (long)blockDim.x + threadIdx.x;
    long done = 0;
    if ((((size_t)x & 15) | ((size_t)out & 7)) == 0) {
        done = n & ~3L;
        for (long i = first; 4 * i < done; i += stride) {
            const float4 v = reinterpret_cast<const float4*>(x)[i];
            store4(out + 4 * i, v.x, v.y, v.z, v.w);
        }
    }
    for (long i = done + first; i < n; i += stride)
        out[i] = __float2bfloat16(x[i]);
}
