// Attention prologue, in place on the QKV GEMM's output: q and k get attn.qkv's bias, the per-head
// RMSNorm and the axial 2-D RoPE; v is left as the GEMM wrote it (attention reads q, k and v where they
// are). V's bias is not added here: softmax rows sum to one, so attention(q, k, v + b) = attention(q, k,
// v) + b, and attn.proj maps that b to the constant attn.proj.weight @ b, which params.py folds into the
// norms' residual offsets in float64 with the biases.
//
// Napkin math (8000 tokens = 32,000 rows, 16 heads x 64; H200 HBM 4.8 TB/s): qk_norm_rope_bf16 reads
// and writes q and k (4 KB a row each way): 262 MB, 55 us at HBM speed; ~30 FLOP an element pair:
// memory-bound, 24 passes a forward. The angles' cos and sin are computed once a forward (rope_table:
// 256 B a row, 8 MB) and read by every block's pass, so no pass spends registers and issue slots on
// sincosf. Measured (python benchmarks/bench_kernels.py, H200): the pass 85 us, 3.1 TB/s (64%); the
// table 6 us, once a forward.
#include "common.cuh"

// out: fp32 [rows, D]: (cos a_d, sin a_d) at columns 2d, 2d + 1 for the rotation pair d < D/2 of patch
// r at pos[r] = (h, w): pairs d < D/4 turn with h at inv_freq[d], the rest with w at inv_freq[d - D/4].
// A thread per (row, pair).
extern "C" __global__ void rope_table(const int* __restrict__ pos, const float* __restrict__ inv_freq,
                                      float* __restrict__ out, int rows, int D) {
    const int half = D / 2, quarter = D / 4;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * half) return;
    const long r = i / half;
    const int d = (int)(i % half);
    const float p = (float)pos[2 * r + (d < quarter ? 0 : 1)];
    float sn, cs;
    sincosf(p * inv_freq[d < quarter ? d : d - quarter], &sn, &cs);
    *reinterpret_cast<float2*>(out + r * D + 2 * d) = make_float2(cs, sn);
}

// qkv: bf16 [rows, 3*H*D] from the QKV GEMM (row r is patch r of the batch), rewritten in place:
// columns 0..H*D-1 become q, H*D..2*H*D-1 k (head h at h*D..h*D+D-1 of each); bias bf16 [3*H*D] (its
// q and k parts are read); qn, kn: bf16 [D] norm weights; rope: fp32 [>= rows, D] from rope_table.
//
// A thread per (row, head, 4 rotation pairs): thread i of a row (heads * D / 8 threads) owns, for
// head h = i / (D/8) and j = i % (D/8), the pairs d = 4j..4j+3 with d + D/2 of both q and k (the pair
// rotate_half mixes: out[d] = x[d] cos a_d - x[d+D/2] sin a_d, out[d+D/2] = x[d+D/2] cos a_d + x[d] sin a_d,
// a_d = a_{d+D/2}), so each angle's (cos, sin) is read once for q and k, and it writes only what it
// read (in place is safe). All loads are 8 bytes wide. A head's D/8 threads are adjacent lanes of one
// warp: its sum of squares is an xor-shuffle reduction among them, so D/8 must be a power of two up to
// 32 (D = 8, 16, 32, 64, 128 or 256); other head dims take qk_norm_rope_any_bf16 below.
__device__ __forceinline__ void load_add4(float* out, const bf16* x, const bf16* b) {
    const float4 u = load4(x), w = load4(b);
    out[0] = u.x + w.x; out[1] = u.y + w.y; out[2] = u.z + w.z; out[3] = u.w + w.w;
}

extern "C" __global__ void qk_norm_rope_bf16(bf16* qkv, const bf16* __restrict__ bias,
                                             const bf16* __restrict__ qn, const bf16* __restrict__ kn,
                                             const float* __restrict__ rope, int rows, int heads, int D, float eps) {
    const int per_head = D / 8, tpr = heads * per_head, HD = heads * D, half = D / 2;
    const long gid = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = gid < (long)rows * tpr;  // idle lanes still join the shuffles (whole heads idle)
    const int lr = active ? (int)(gid / tpr) : 0, i = (int)(gid % tpr);
    const int j = i % per_head, c = (i / per_head) * D + 4 * j;  // c: column of this thread's first pair
    bf16* src = qkv + (long)lr * 3 * HD;
    float qa[4] = {0.f, 0.f, 0.f, 0.f}, qb[4] = {0.f, 0.f, 0.f, 0.f}, ka[4] = {0.f, 0.f, 0.f, 0.f},
          kb[4] = {0.f, 0.f, 0.f, 0.f};
    if (active) {
        load_add4(qa, src + c, bias + c);
        load_add4(qb, src + c + half, bias + c + half);
        load_add4(ka, src + HD + c, bias + HD + c);
        load_add4(kb, src + HD + c + half, bias + HD + c + half);
    }
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        sq += qa[e] * qa[e] + qb[e] * qb[e];
        sk += ka[e] * ka[e] + kb[e] * kb[e];
    }
    for (int o = per_head / 2; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    if (!active) return;
    const float iq = rsqrtf(sq / D + eps), ik = rsqrtf(sk / D + eps);
    // This thread's pairs 4j..4j+3: (cos, sin) of each, 32 bytes of the row's table.
    const float4 t0 = *reinterpret_cast<const float4*>(rope + (long)lr * D + 8 * j);
    const float4 t1 = *reinterpret_cast<const float4*>(rope + (long)lr * D + 8 * j + 4);
    const float cs4[4] = {t0.x, t0.z, t1.x, t1.z}, sn4[4] = {t0.y, t0.w, t1.y, t1.w};
    float oqa[4], oqb[4], oka[4], okb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float cs = cs4[e], sn = sn4[e];
        const int d = 4 * j + e;
        const float a = qa[e] * iq * __bfloat162float(qn[d]), b = qb[e] * iq * __bfloat162float(qn[d + half]);
        oqa[e] = a * cs - b * sn;
        oqb[e] = b * cs + a * sn;
        const float ak = ka[e] * ik * __bfloat162float(kn[d]), bk = kb[e] * ik * __bfloat162float(kn[d + half]);
        oka[e] = ak * cs - bk * sn;
        okb[e] = bk * cs + ak * sn;
    }
    store4(src + c, oqa[0], oqa[1], oqa[2], oqa[3]);
    store4(src + c + half, oqb[0], oqb[1], oqb[2], oqb[3]);
    store4(src + HD + c, oka[0], oka[1], oka[2], oka[3]);
    store4(src + HD + c + half, okb[0], okb[1], okb[2], okb[3]);
}

// The same for any head dim D (a multiple of 4, so each rotation half is whole pairs; ops.qk_norm_rope
// picks it where the kernel above cannot run): a warp per (row, head) (grid-stride), lane l over the elements l,
// l + 32, ... for the sums of squares, then over the pairs d = l, l + 32, ... < D/2. 2-byte accesses: for
// geometries other than the released one, where this pass is a small part of a small forward. In
// place is safe: every lane's reads feed the sums, which the shuffles complete before any lane writes.
extern "C" __global__ void qk_norm_rope_any_bf16(bf16* qkv, const bf16* __restrict__ bias,
                                                 const bf16* __restrict__ qn, const bf16* __restrict__ kn,
                                                 const float* __restrict__ rope, int rows, int heads, int D,
                                                 float eps) {
    const int lane = threadIdx.x & 31, HD = heads * D, half = D / 2;
    const long warps = (long)gridDim.x * blockDim.x >> 5;  // blockDim.x is a multiple of 32: whole warps
    for (long w = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < (long)rows * heads; w += warps) {
        const long r = w / heads;
        const int c0 = (int)(w % heads) * D;  // the head's first column
        bf16* q = qkv + r * 3 * HD + c0;
        bf16* k = q + HD;
        const bf16* bq = bias + c0;
        const bf16* bk = bias + HD + c0;
        float sq = 0.f, sk = 0.f;
        for (int d = lane; d < D; d += 32) {
            const float a = load1(q + d) + load1(bq + d), b = load1(k + d) + load1(bk + d);
            sq += a * a;
            sk += b * b;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        const float iq = rsqrtf(sq / D + eps), ik = rsqrtf(sk / D + eps);
        for (int d = lane; d < half; d += 32) {
            const float2 t = *reinterpret_cast<const float2*>(rope + r * D + 2 * d);  // (cos, sin)
            const float a = (load1(q + d) + load1(bq + d)) * iq * __bfloat162float(qn[d]);
            const float b = (load1(q + d + half) + load1(bq + d + half)) * iq * __bfloat162float(qn[d + half]);
            const float ka = (load1(k + d) + load1(bk + d)) * ik * __bfloat162float(kn[d]);
            const float kb = (load1(k + d + half) + load1(bk + d + half)) * ik * __bfloat162float(kn[d + half]);
            q[d] = __float2bfloat16_rn(a * t.x - b * t.y);
            q[d + half] = __float2bfloat16_rn(b * t.x + a * t.y);
            k[d] = __float2bfloat16_rn(ka * t.x - kb * t.y);
            k[d + half] = __float2bfloat16_rn(kb * t.x + ka * t.y);
        }
    }
}
