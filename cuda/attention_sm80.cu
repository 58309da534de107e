// Flash attention forward, any sm_80+ GPU: the fallback where the Hopper kernel cannot run (head
// dims 32 and 128, or a GPU without sm_90a). Variable-length segments (one per image frame) packed
// in one launch, non-causal, bf16 tensor-core MMA (mma.sync m16n8k16) with fp32 accumulation and
// an online softmax; O(n) memory.
//
// q, k, v, o: bf16 [N, H*D], head h at columns h*D.. (q, k and v rows ldi elements apart: where
// qk_norm_rope leaves them in the QKV GEMM's output; o where the proj GEMM reads it: no transposes
// through memory). Grid (query tiles over all segments,
// heads), NW warps of 16 query rows each; K/V tiles of 64 keys, double-buffered with cp.async.
//
// Napkin math (the tower: 16 heads x 64, per block): FLOP = 4 * sum(n_seg^2) * 1024, e.g.
// 4.19 TFLOP at one 32,000-patch segment, 17.2 GFLOP at 1,024 patches. Bytes: q, k, v, o 2 B x
// 1024 a row (8 MB at 1,024 rows, 262 MB at 32,000), K/V re-read once per 64-row query tile
// from L2. Compute-bound: mma.sync reaches about half of Hopper's wgmma rate. Measured on the
// H200 (bench_kernels, 66a180c; one segment of 1,024 / 4,096 / 16,384 / 32,000 keys): 120 / 216 /
// 236 / 235 TFLOP/s at head dim 64 with 4 warps; cuDNN (torch SDPA) 112 / 396 / 488 / 475.
#include "attention_epilogue.cuh"
#include "attention_scheduler.cuh"
#include "softmax.cuh"

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

template <int D, int NW>
__global__ void __launch_bounds__(32 * NW) flash_fwd_sm80(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                          const int* __restrict__ tile_q0, int heads, int ldi, float scale_log2) {
    constexpr int BM = 16 * NW, NT = 32 * NW, LDS = D + 8, BN = 64;  // BN: keys per K/V tile
    if (idle_tile(tile_seg)) return;  // the whole CTA, before any barrier
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    bf16* sK = sQ + BM * LDS;          // [2][BN][LDS]
    bf16* sV = sK + 2 * BN * LDS;      // [2][BN][LDS]

    const auto [h, s0, s1, q0, ld] = query_tile(cu, tile_seg, tile_q0, heads, D);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;

    load_tile<D, NT>(sQ, q + (long)q0 * ldi + h * D, BM, s1 - q0, ldi);
    load_tile<D, NT>(sK, k + (long)s0 * ldi + h * D, BN, s1 - s0, ldi);
    load_tile<D, NT>(sV, v + (long)s0 * ldi + h * D, BN, s1 - s0, ldi);
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
            load_tile<D, NT>(sK + (buf ^ 1) * BN * LDS, k + (long)kb * ldi + h * D, BN, s1 - kb, ldi);
            load_tile<D, NT>(sV + (buf ^ 1) * BN * LDS, v + (long)kb * ldi + h * D, BN, s1 - kb, ldi);
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
