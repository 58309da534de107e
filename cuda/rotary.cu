// Attention prologue: QKV bias, per-head q/k RMSNorm, axial 2-D RoPE, split into q, k, v.
#include "common.cuh"

// qkv: fp32 or bf16 [rows, 3*H*D] straight from the QKV GEMM (rows start at global patch row0);
// bias bf16 [3*H*D]; qn, kn: bf16 [D] norm weights; pos: int32 [N, 2] (h, w) per patch;
// inv_freq: fp32 [D/4]. Writes q, k, v bf16 [N, H*D] (head h at columns h*D..h*D+D-1),
// the layout the attention kernel reads and the proj GEMM's input layout too.
//
// One warp per (row, head, part): q, k and v of a head are three independent warps, so three
// times the loads are in flight. Lane i holds elements d and d + D/2 (d = i, i+32, ...), which
// are exactly the pair rotate_half mixes: out[d] = x[d] cos a_d - x[d+D/2] sin a_d,
// out[d+D/2] = x[d+D/2] cos a_d + x[d] sin a_d, with a_d = a_{d+D/2} (angles repeat).
template <typename T>
__device__ __forceinline__ void qk_norm_rope_rows(const T* __restrict__ qkv, const bf16* __restrict__ bias,
                                                  const bf16* __restrict__ qn, const bf16* __restrict__ kn,
                                                  const int* __restrict__ pos, const float* __restrict__ inv_freq,
                                                  bf16* __restrict__ q, bf16* __restrict__ k, bf16* __restrict__ v,
                                                  int rows, int row0, int heads, int D, float eps) {
    const long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (long)rows * heads * 3) return;
    const int part = (int)(warp % 3);
    const int lr = (int)(warp / 3 / heads), h = (int)(warp / 3 % heads);
    const long r = (long)row0 + lr;
    const int HD = heads * D, half = D / 2, quarter = D / 4;
    const T* s = qkv + (long)lr * 3 * HD + part * HD + h * D;
    const bf16* bb = bias + part * HD + h * D;
    bf16* dst = (part == 0 ? q : part == 1 ? k : v) + r * HD + h * D;
    if (part == 2) {
        for (int d = lane; d < D; d += 32) dst[d] = __float2bfloat16(load1(s + d) + __bfloat162float(bb[d]));
        return;
    }
    const float ph = (float)pos[2 * r], pw = (float)pos[2 * r + 1];
    float ss = 0.f;
    for (int d = lane; d < D; d += 32) { float t = load1(s + d) + __bfloat162float(bb[d]); ss += t * t; }
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
    const bf16* nw = part == 0 ? qn : kn;
    for (int d = lane; d < half; d += 32) {
        const float a = (load1(s + d) + __bfloat162float(bb[d])) * inv * __bfloat162float(nw[d]);
        const float b = (load1(s + d + half) + __bfloat162float(bb[d + half])) * inv * __bfloat162float(nw[d + half]);
        const float ang = d < quarter ? ph * inv_freq[d] : pw * inv_freq[d - quarter];
        float sn, cs;
        sincosf(ang, &sn, &cs);
        dst[d] = __float2bfloat16(a * cs - b * sn);
        dst[d + half] = __float2bfloat16(b * cs + a * sn);
    }
}

extern "C" __global__ void qk_norm_rope(const float* qkv, const bf16* bias, const bf16* qn, const bf16* kn,
                                        const int* pos, const float* inv_freq, bf16* q, bf16* k, bf16* v, int rows,
                                        int row0, int heads, int D, float eps) {
    qk_norm_rope_rows(qkv, bias, qn, kn, pos, inv_freq, q, k, v, rows, row0, heads, D, eps);
}
extern "C" __global__ void qk_norm_rope_bf16(const bf16* qkv, const bf16* bias, const bf16* qn, const bf16* kn,
                                             const int* pos, const float* inv_freq, bf16* q, bf16* k, bf16* v,
                                             int rows, int row0, int heads, int D, float eps) {
    qk_norm_rope_rows(qkv, bias, qn, kn, pos, inv_freq, q, k, v, rows, row0, heads, D, eps);
}
