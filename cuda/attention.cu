// Flash attention forward for the vision tower: variable-length segments (one per image
// frame) packed in one launch, non-causal, O(n) memory, bf16 tensor-core MMA
// (mma.sync m16n8k16, sm_80+) with fp32 accumulation and an online softmax.
//
// q, k, v, o: bf16 [N, H*D], head h at columns h*D.. — where qk_norm_rope leaves q/k/v
// and where the proj GEMM reads o: no transposes through memory.
// Grid: (query tiles over all segments, heads). tile_seg[t] is the tile's segment,
// tile_q0[t] its first query row; cu_seqlens [S+1] bounds the segments.
#include "common.cuh"

#define BN 64  // keys per K/V tile

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; zero-fills when !valid (rows past a segment's end).
__device__ __forceinline__ void cp16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Copy `rows` rows of D bf16 (row stride ld elements) into shared rows of D + 8 (the pad
// keeps ldmatrix's 8 row addresses on distinct banks). Rows at or past `valid` read as 0.
template <int D, int NT>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int rows, int valid, long ld) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < rows * CH; i += NT) {
        const int r = i / CH, c = (i % CH) * 8;
        const bool ok = r < valid;
        cp16(s + r * (D + 8) + c, g + (ok ? (long)r * ld + c : 0), ok);
    }
}

// The CTA's query tile: head blockIdx.y, tile blockIdx.x of segment [s0, s1), first row q0; rows of
// q/k/v/o are ld elements apart (all heads side by side).
struct QTile {
    int h, s0, s1, q0;
    long ld;
};
__device__ __forceinline__ QTile query_tile(const int* cu, const int* tile_seg, const int* tile_q0, int heads, int d) {
    const int seg = tile_seg[blockIdx.x];
    return {static_cast<int>(blockIdx.y), cu[seg], cu[seg + 1], tile_q0[blockIdx.x], (long)heads * d};
}

// 2^x on the special-function unit; x <= 0 here (scores minus their running max), -inf -> 0.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 2^x for x <= 0 on the FMA units instead (FA4's trick). At head_dim 64 the special-function unit's
// 16 ex2 a clock per SM are exactly what the tensor cores need, so the softmax can hand a share of
// its exps to the 128-a-clock FMA pipe. x = j + f with j = round(x) (the 1.5 * 2^23 shift leaves
// j in the low mantissa bits), 2^f on [-0.5, 0.5] by a cubic (relative error 1.4e-4, well under
// bf16's 3.9e-3 step), and j added to the exponent bits. Clamped at -127, where the result is 0.
__device__ __forceinline__ float ex2_fma(float x) {
    x = fmaxf(x, -127.f);
    const float r = __fadd_rn(x, 12582912.f);
    const float f = __fsub_rn(x, __fsub_rn(r, 12582912.f));
    const float p = fmaf(fmaf(fmaf(0.05592212f, f, 0.24223785f), f, 0.693121f), f, 1.f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(r) << 23));
}

// One K/V tile's online softmax on this thread's S accumulators (rows g and g + 8 of its 16-row
// slice; the m16n8 mma.sync and the m64nN wgmma lay them out alike: 4 values per 8 keys): mask keys at or past kvalid, update the running max and sum, rescale O (unless this is the
// first tile; NACC floats of O per thread), and pack P = exp2(S * scale - max) as the bf16 A
// fragments of the P V MMA (the same register layout for mma.sync m16n8k16 and wgmma RS).
// FMA_EVERY > 0: one value per row in every FMA_EVERY-th group of 8 keys takes ex2_fma (a share of
// 1 / (4 FMA_EVERY) of the exps).
template <int BNW, int NACC, int FMA_EVERY = 0>
__device__ __forceinline__ void softmax_tile(float* s, unsigned (*pa)[4], float* acc, float& m0, float& m1, float& l0,
                                             float& l1, int kvalid, int t, float scale_log2, bool rescale) {
    if (kvalid < BNW) {
#pragma unroll
        for (int j = 0; j < BNW / 8; ++j) {
            const int c = j * 8 + 2 * t;
            if (c >= kvalid) s[4 * j] = s[4 * j + 2] = NEG_INF;
            if (c + 1 >= kvalid) s[4 * j + 1] = s[4 * j + 3] = NEG_INF;
        }
    }
    // The max of the raw scores, scaled once (scale_log2 > 0: the same value as scaling each).
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int j = 0; j < BNW / 8; ++j) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = fmaxf(m0, mx0 * scale_log2);
    mx1 = fmaxf(m1, mx1 * scale_log2);
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float c0 = ex2(m0 - mx0), c1 = ex2(m1 - mx1);
    m0 = mx0;
    m1 = mx1;
    float r0 = 0.f, r1 = 0.f;
#pragma unroll
    for (int j = 0; j < BNW / 8; ++j) {
        const bool fma_pipe = FMA_EVERY > 0 && j % (FMA_EVERY > 0 ? FMA_EVERY : 1) == 0;
        s[4 * j] = fma_pipe ? ex2_fma(fmaf(s[4 * j], scale_log2, -mx0)) : ex2(fmaf(s[4 * j], scale_log2, -mx0));
        s[4 * j + 1] = ex2(fmaf(s[4 * j + 1], scale_log2, -mx0));
        s[4 * j + 2] = fma_pipe ? ex2_fma(fmaf(s[4 * j + 2], scale_log2, -mx1)) : ex2(fmaf(s[4 * j + 2], scale_log2, -mx1));
        s[4 * j + 3] = ex2(fmaf(s[4 * j + 3], scale_log2, -mx1));
        r0 += s[4 * j] + s[4 * j + 1];
        r1 += s[4 * j + 2] + s[4 * j + 3];
    }
    l0 = l0 * c0 + r0;
    l1 = l1 * c1 + r1;
    if (rescale) {
#pragma unroll
        for (int j = 0; j < NACC / 4; ++j) {
            acc[4 * j] *= c0; acc[4 * j + 1] *= c0;
            acc[4 * j + 2] *= c1; acc[4 * j + 3] *= c1;
        }
    }
#pragma unroll
    for (int kk = 0; kk < BNW / 16; ++kk) {
        pa[kk][0] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
        pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// O / l for this thread's two rows, stored as bf16 where the proj GEMM reads o.
template <int D>
__device__ __forceinline__ void store_o(bf16* o, const float* acc, float l0, float l1, int row0, int s1, long ld,
                                        int col0, int t) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    const int row1 = row0 + 8;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        const int c = col0 + j * 8 + 2 * t;
        if (row0 < s1)
            *reinterpret_cast<unsigned*>(o + (long)row0 * ld + c) = pack_bf16(acc[4 * j] * i0, acc[4 * j + 1] * i0);
        if (row1 < s1)
            *reinterpret_cast<unsigned*>(o + (long)row1 * ld + c) = pack_bf16(acc[4 * j + 2] * i1, acc[4 * j + 3] * i1);
    }
}

template <int D, int NW>
__device__ void flash_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                          const int* __restrict__ tile_q0, int heads, float scale_log2) {
    constexpr int BM = 16 * NW, NT = 32 * NW, LDS = D + 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    bf16* sK = sQ + BM * LDS;          // [2][BN][LDS]
    bf16* sV = sK + 2 * BN * LDS;      // [2][BN][LDS]

    const auto [h, s0, s1, q0, ld] = query_tile(cu, tile_seg, tile_q0, heads, D);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;

    load_tile<D, NT>(sQ, q + (long)q0 * ld + h * D, BM, s1 - q0, ld);
    load_tile<D, NT>(sK, k + (long)s0 * ld + h * D, BN, s1 - s0, ld);
    load_tile<D, NT>(sV, v + (long)s0 * ld + h * D, BN, s1 - s0, ld);
    cp_commit();
    cp_wait_all();
    __syncthreads();

    unsigned qf[D / 16][4];
    {
        const bf16* base = sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], base + kk * 16);
    }

    float acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    const int ntiles = (s1 - s0 + BN - 1) / BN;
    for (int it = 0; it < ntiles; ++it) {
        const int buf = it & 1;
        if (it + 1 < ntiles) {
            const int kb = s0 + (it + 1) * BN;
            load_tile<D, NT>(sK + (buf ^ 1) * BN * LDS, k + (long)kb * ld + h * D, BN, s1 - kb, ld);
            load_tile<D, NT>(sV + (buf ^ 1) * BN * LDS, v + (long)kb * ld + h * D, BN, s1 - kb, ld);
        }
        cp_commit();
        const bf16* K = sK + buf * BN * LDS;
        const bf16* V = sV + buf * BN * LDS;

        // S = Q K^T for this warp's 16 rows x BN keys.
        float s[BN / 8][4];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < BN / 8; j += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3,
                        K + (j * 8 + (lane & 7) + (lane >> 4) * 8) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
                mma16816(s[j], qf[kk], b0, b1);
                mma16816(s[j + 1], qf[kk], b2, b3);
            }
        }
        // Keys past the segment's end do not exist; online softmax in log2 units; P as A fragments.
        unsigned pa[BN / 16][4];
        softmax_tile<BN, D / 2>(&s[0][0], pa, &acc[0][0], m0, m1, l0, l1, s1 - (s0 + it * BN), t, scale_log2, true);
        // O += P V.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < D / 8; j += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3,
                          V + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + j * 8 + (lane >> 4) * 8);
                mma16816(acc[j], pa[kk], b0, b1);
                mma16816(acc[j + 1], pa[kk], b2, b3);
            }
        }
        cp_wait_all();
        __syncthreads();
    }

    store_o<D>(o, &acc[0][0], l0, l1, q0 + warp * 16 + g, s1, ld, h * D, t);
}

#define FLASH_ENTRY(D, NW)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * NW) flash_attn_d##D##_w##NW(                         \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, const int* cu, const int* tile_seg,         \
        const int* tile_q0, int heads, float scale_log2) {                                                 \
        flash_fwd<D, NW>(q, k, v, o, cu, tile_seg, tile_q0, heads, scale_log2);                            \
    }

FLASH_ENTRY(32, 4)
FLASH_ENTRY(64, 4)
FLASH_ENTRY(64, 8)
FLASH_ENTRY(128, 4)

// ---------------------------------------------------------------------------------------------
// Hopper path (sm_90a): the same algorithm on warpgroup MMA. Each warpgroup (128 threads) owns 64
// query rows; S = Q K^T reads Q and K straight from 128B-swizzled shared memory (wgmma SS), and
// O += P V takes P from registers (wgmma RS) with V read transposed from shared memory. K/V tiles
// are double-buffered with cp.async. Head dim 64 only.
#include "wgmma.cuh"

// Byte offset of 16-byte chunk c of row r in a 128B-swizzled tile of 128-byte rows.
__device__ __forceinline__ int sw128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// ROWS rows of 64 bf16 into a 128B-swizzled tile, by NT threads numbered tid = 0..NT-1.
template <int ROWS, int NT>
__device__ __forceinline__ void load_tile_sw(unsigned char* s, const bf16* g, int valid, long ld, int tid) {
#pragma unroll 4
    for (int i = tid; i < ROWS * 8; i += NT) {
        const int r = i >> 3, c = i & 7;
        const bool ok = r < valid;
        cp16(s + sw128(r, c), g + (ok ? (long)r * ld + c * 8 : 0), ok);
    }
}

template <int NWG, int BNW, bool PIPE>
__device__ void flash_fwd_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                               bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                               const int* __restrict__ tile_q0, int heads, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // PIPE: three K/V stages, and the next tile's S = Q K^T is issued right behind this tile's
    // P V, so the tensor cores are fed across the barrier. Otherwise: two stages, no overlap.
    constexpr int D = 64, BM = 64 * NWG, NT = 128 * NWG, STAGES = PIPE ? 3 : 2;
    constexpr int TILE = BNW * 128;  // bytes of one K or V tile
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // wgmma's 128B swizzle is anchored to 1024-byte boundaries: align the tiles to one.
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    unsigned char* sQ = base;
    unsigned char* sK = sQ + BM * 128;
    unsigned char* sV = sK + STAGES * TILE;

    const auto [h, s0, s1, q0, ld] = query_tile(cu, tile_seg, tile_q0, heads, D);
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;

    load_tile_sw<BM, NT>(sQ, q + (long)q0 * ld + h * D, s1 - q0, ld, threadIdx.x);
    load_tile_sw<BNW, NT>(sK, k + (long)s0 * ld + h * D, s1 - s0, ld, threadIdx.x);
    load_tile_sw<BNW, NT>(sV, v + (long)s0 * ld + h * D, s1 - s0, ld, threadIdx.x);
    cp_commit();
    cp_wait_all();
    fence_proxy_async();
    __syncthreads();

    const unsigned long long dq = sw128_desc(sQ + wg * 64 * 128);
    // acc is first written by the first P V wgmma (scale_d = 0): zeroing it here instead would put
    // non-wgmma writes to its registers inside the S wgmma's pipeline stage, and serialize both.
    float acc[32];
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    float s[BNW / 2];

    auto issue_s = [&](int stage) {
        const unsigned long long dk = sw128_desc(sK + stage * TILE);
        if constexpr (BNW == 64) wgmma_ss_n64_init(s, dq, dk);
        else wgmma_ss_n128_init(s, dq, dk);
#pragma unroll
        for (int kk = 1; kk < D / 16; ++kk) {
            if constexpr (BNW == 64) wgmma_ss_n64(s, dq + 2 * kk, dk + 2 * kk, 1);
            else wgmma_ss_n128(s, dq + 2 * kk, dk + 2 * kk, 1);
        }
    };

    const int ntiles = (s1 - s0 + BNW - 1) / BNW;
    if constexpr (PIPE) {
        wgmma_fence();
        issue_s(0);
        wgmma_commit();
    }
    for (int it = 0; it < ntiles; ++it) {
        const int st = it % STAGES, nx = (it + 1) % STAGES;
        if (it + 1 < ntiles) {
            // Stage nx last held tile it + 1 - STAGES, whose MMAs every warpgroup has finished.
            const int kb = s0 + (it + 1) * BNW;
            load_tile_sw<BNW, NT>(sK + nx * TILE, k + (long)kb * ld + h * D, s1 - kb, ld, threadIdx.x);
            load_tile_sw<BNW, NT>(sV + nx * TILE, v + (long)kb * ld + h * D, s1 - kb, ld, threadIdx.x);
        }
        cp_commit();
        if constexpr (!PIPE) {
            wgmma_fence();
            issue_s(st);
            wgmma_commit();
        }
        wgmma_wait0();

        unsigned pa[BNW / 16][4];
        softmax_tile<BNW, 32>(s, pa, acc, m0, m1, l0, l1, s1 - (s0 + it * BNW), t, scale_log2, it > 0);
        const unsigned long long dv = sw128_desc(sV + st * TILE);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BNW / 16; ++kk) wgmma_rs_n64_tb(acc, pa[kk], dv + kk * (2048 >> 4), it > 0 || kk > 0);
        wgmma_commit();
        if constexpr (PIPE) {
            if (it + 1 < ntiles) {
                cp_wait_all();
                fence_proxy_async();
                __syncthreads();
                wgmma_fence();
                issue_s(nx);
                wgmma_commit();
            }
        } else {
            wgmma_wait0();
            cp_wait_all();
            fence_proxy_async();
            __syncthreads();
        }
    }
    wgmma_wait0();
    store_o<64>(o, acc, l0, l1, q0 + wg * 64 + warp * 16 + g, s1, ld, h * D, t);
#else
    __trap();  // built for a device without sm_90a's wgmma: the caller picks the mma.sync kernel
#endif
}

#define FLASH90_ENTRY(NWG, BNW, MINB, PIPE, SUFFIX)                                                         \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB) flash90_attn_d64_g##NWG##_n##BNW##SUFFIX( \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, const int* cu, const int* tile_seg,         \
        const int* tile_q0, int heads, float scale_log2) {                                                 \
        flash_fwd_sm90<NWG, BNW, PIPE>(q, k, v, o, cu, tile_seg, tile_q0, heads, scale_log2);              \
    }

// (warpgroups per CTA, keys per tile, CTAs per SM the registers are budgeted for, pipelined, suffix)
FLASH90_ENTRY(1, 64, 4, false, )
FLASH90_ENTRY(1, 128, 3, false, )
FLASH90_ENTRY(2, 64, 2, false, )
FLASH90_ENTRY(3, 128, 1, false, )
FLASH90_ENTRY(1, 128, 2, true, _p)
FLASH90_ENTRY(3, 128, 1, true, _p)

// ---------------------------------------------------------------------------------------------
// Hopper, warp-specialised: a producer warpgroup streams K/V through STAGES shared-memory slots
// with cp.async, each slot guarded by a "full" mbarrier (completed by the copies themselves) and an
// "empty" one (one arrival per consumer warp once its wgmmas have read the slot). NC consumer
// warpgroups own 64 query rows each and never meet at a CTA-wide barrier; they take turns issuing
// their wgmmas (named barriers, round robin), so one warpgroup's softmax runs while another's
// P V and Q K^T keep the tensor cores busy. Registers move from the producer to the consumers
// (setmaxnreg).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives once every cp.async this thread issued before it has landed (the count was set for it).
__device__ __forceinline__ void mbar_arrive_copies(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

template <int NC, int STAGES, int CREG, int FMA_EVERY>
__device__ void flash_fwd_sm90_ws(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                  bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                                  const int* __restrict__ tile_q0, int heads, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 64, BNW = 128, BM = 64 * NC, TILE = BNW * 128;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bars[1 + 2 * STAGES];  // q, full[STAGES], empty[STAGES]
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    unsigned char* sQ = base;
    unsigned char* sK = sQ + BM * 128;
    unsigned char* sV = sK + STAGES * TILE;
    const unsigned qbar = smem_u32(&bars[0]), full0 = smem_u32(&bars[1]), empty0 = smem_u32(&bars[1 + STAGES]);

    const auto [h, s0, s1, q0, ld] = query_tile(cu, tile_seg, tile_q0, heads, D);
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int ntiles = (s1 - s0 + BNW - 1) / BNW;

    if (threadIdx.x == 0) {
        mbar_init(qbar, 128);
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full0 + 8 * i, 128);
            mbar_init(empty0 + 8 * i, NC * 4);
        }
    }
    __syncthreads();

    if (wg == NC) {  // the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        const int tid = threadIdx.x - NC * 128;
        load_tile_sw<BM, 128>(sQ, q + (long)q0 * ld + h * D, s1 - q0, ld, tid);
        mbar_arrive_copies(qbar);
        for (int it = 0; it < ntiles; ++it) {
            const int st = it % STAGES;
            if (it >= STAGES) mbar_wait(empty0 + 8 * st, ((it / STAGES) - 1) & 1);
            const int kb = s0 + it * BNW;
            load_tile_sw<BNW, 128>(sK + st * TILE, k + (long)kb * ld + h * D, s1 - kb, ld, tid);
            load_tile_sw<BNW, 128>(sV + st * TILE, v + (long)kb * ld + h * D, s1 - kb, ld, tid);
            mbar_arrive_copies(full0 + 8 * st);
        }
        cp_wait_all();
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CREG) : "memory");
    const int g = lane >> 2, t = lane & 3;
    const int turn = 1 + wg, next = 1 + (wg + 1) % NC;  // named barriers 1..NC: whose turn to issue
    if (NC > 1 && wg == NC - 1) named_arrive(1, 256);    // warpgroup 0 goes first
    mbar_wait(qbar, 0);
    fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
    const unsigned long long dq = sw128_desc(sQ + wg * 64 * 128);

    float acc[32];
    float s[BNW / 2];
    unsigned pa[BNW / 16][4];
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    auto issue_s = [&](int st) {
        const unsigned long long dk = sw128_desc(sK + st * TILE);
        wgmma_ss_n128_init(s, dq, dk);
#pragma unroll
        for (int kk = 1; kk < D / 16; ++kk) wgmma_ss_n128(s, dq + 2 * kk, dk + 2 * kk, 1);
    };
    auto issue_pv = [&](int st, bool accumulate) {
        const unsigned long long dv = sw128_desc(sV + st * TILE);
#pragma unroll
        for (int kk = 0; kk < BNW / 16; ++kk) wgmma_rs_n64_tb(acc, pa[kk], dv + kk * (2048 >> 4), accumulate || kk > 0);
    };

    // A turn is one warpgroup issuing its Q K^T; its softmax and P V follow outside the turn, while
    // the next warpgroup's Q K^T runs. (Issuing the previous tile's P V inside the turn as well,
    // FA3's intra-warpgroup overlap, was 20-40% slower with three consumer warpgroups and no faster
    // with two: docs/PERFORMANCE.md.)
    for (int it = 0; it < ntiles; ++it) {
        const int st = it % STAGES;
        mbar_wait(full0 + 8 * st, (it / STAGES) & 1);
        fence_proxy_async();
        if (NC > 1) named_sync(turn, 256);
        wgmma_fence();
        issue_s(st);
        wgmma_commit();
        if (NC > 1 && !(wg == NC - 1 && it == ntiles - 1)) named_arrive(next, 256);
        wgmma_wait0();
        softmax_tile<BNW, 32, FMA_EVERY>(s, pa, acc, m0, m1, l0, l1, s1 - (s0 + it * BNW), t, scale_log2, it > 0);
        wgmma_fence();
        issue_pv(st, it > 0);
        wgmma_commit();
        wgmma_wait0();
        if (lane == 0) mbar_arrive(empty0 + 8 * st);  // both wgmmas that read the slot are done
    }
    store_o<64>(o, acc, l0, l1, q0 + wg * 64 + warp * 16 + g, s1, ld, h * D, t);
#else
    __trap();
#endif
}

#define FLASH90_WS_ENTRY(NC, STAGES, CREG, FMA_EVERY, SUFFIX)                                                \
    extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1) flash90_attn_d64_ws##NC##_s##STAGES##SUFFIX( \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, const int* cu, const int* tile_seg,               \
        const int* tile_q0, int heads, float scale_log2) {                                                       \
        flash_fwd_sm90_ws<NC, STAGES, CREG, FMA_EVERY>(q, k, v, o, cu, tile_seg, tile_q0, heads, scale_log2);    \
    }

// (consumer warpgroups, K/V slots, consumer registers after setmaxnreg: the producer keeps 40,
//  a share of the exps on the FMA pipe: 1 / (4 FMA_EVERY), 0 = none)
FLASH90_WS_ENTRY(2, 2, 232, 0, )
FLASH90_WS_ENTRY(2, 3, 232, 0, )
FLASH90_WS_ENTRY(3, 2, 152, 0, )
FLASH90_WS_ENTRY(3, 3, 152, 0, )
FLASH90_WS_ENTRY(2, 3, 232, 4, _f16)
FLASH90_WS_ENTRY(3, 3, 152, 4, _f16)
FLASH90_WS_ENTRY(3, 3, 152, 8, _f32)
