// Flash attention forward, any sm_80+ GPU: the fallback where the Hopper kernel cannot run (head
// dims other than 64, or a GPU without sm_90a). Any head dim D that is a multiple of 4 up to 256 (the
// axial RoPE's own condition, config.py): the MMAs run over DP = D rounded up to 16 columns, the
// columns past D zero in shared memory (so Q K^T and P V are exactly those over D), and only D
// columns are stored; rows come in 16-byte pieces where D is a multiple of 8, else in 8-byte ones.
// Variable-length segments (one per image frame) packed in one launch, non-causal, bf16 tensor-core
// MMA (mma.sync m16n8k16) with fp32 accumulation and an online softmax; O(n) memory.
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
// H200 (python benchmarks/bench_kernels.py, kernels back to back; one segment of 1,024 / 4,096 /
// 16,384 / 32,000 keys): 167 / 222 / 233 / 232 TFLOP/s at head dim 64 with 4 warps (sm80_d64);
// cuDNN (torch SDPA) in the same run 300 / 466 / 492 / 471.
#include "attention_epilogue.cuh"
#include "attention_scheduler.cuh"
#include "softmax.cuh"

// The shared row of a D-column head: DP = D rounded up to 16 (the MMAs' k step), + 8 (the pad keeps
// ldmatrix's 8 row addresses on distinct banks).
template <int D>
struct HeadCols {
    static constexpr int DP = (D + 15) / 16 * 16, LDS = DP + 8;
    static constexpr int W = D % 8 == 0 ? 8 : 4;  // bf16 a copy: 16 bytes, or 8 where D % 8 = 4
};

// Copy `rows` rows of D bf16 (row stride ld elements) into shared rows of HeadCols<D>::LDS. Rows at
// or past `valid` read as 0; columns D..DP-1 are not written (zero_pad_cols clears them once).
template <int D, int NT>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int rows, int valid, long ld) {
    constexpr int W = HeadCols<D>::W, CH = D / W, LDS = HeadCols<D>::LDS;  // CH: copies per row
    for (int i = threadIdx.x; i < rows * CH; i += NT) {
        const int r = i / CH, c = (i % CH) * W;
        const bool ok = r < valid;
        const bf16* src = g + (ok ? (long)r * ld + c : 0);
        if constexpr (W == 8) cp16(s + r * LDS + c, src, ok);
        else cp8(s + r * LDS + c, src, ok);
    }
}

// Zeros in columns D..DP-1 of `rows` shared rows: no copy writes them, so they stay zero for every tile.
template <int D, int NT>
__device__ __forceinline__ void zero_pad_cols(bf16* s, int rows) {
    constexpr int DP = HeadCols<D>::DP, LDS = HeadCols<D>::LDS, PW = (DP - D) / 4;  // 8-byte words a row
    if constexpr (PW > 0) {
        for (int i = threadIdx.x; i < rows * PW; i += NT)
            *reinterpret_cast<uint2*>(s + (i / PW) * LDS + D + (i % PW) * 4) = make_uint2(0u, 0u);
    }
}

template <int D, int NW>
__global__ void __launch_bounds__(32 * NW) flash_fwd_sm80(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                          const int* __restrict__ tile_q0, int heads, int ldi, float scale_log2) {
    constexpr int BM = 16 * NW, NT = 32 * NW, DP = HeadCols<D>::DP, LDS = HeadCols<D>::LDS, BN = 64;  // BN: keys a K/V tile
    if (idle_tile(tile_seg)) return;  // the whole CTA, before any barrier
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    bf16* sK = sQ + BM * LDS;          // [2][BN][LDS]
    bf16* sV = sK + 2 * BN * LDS;      // [2][BN][LDS]

    const auto [h, s0, s1, q0, ld] = query_tile(cu, tile_seg, tile_q0, heads, D);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;

    zero_pad_cols<D, NT>(sQ, BM + 4 * BN);  // Q and both K and V buffers (contiguous)
    load_tile<D, NT>(sQ, q + (long)q0 * ldi + h * D, BM, s1 - q0, ldi);
    load_tile<D, NT>(sK, k + (long)s0 * ldi + h * D, BN, s1 - s0, ldi);
    load_tile<D, NT>(sV, v + (long)s0 * ldi + h * D, BN, s1 - s0, ldi);
    cp_commit();
    cp_wait_all();
    __syncthreads();

    unsigned qf[DP / 16][4];
    {
        const bf16* base = sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], base + kk * 16);
    }

    float acc[DP / 8][4];
#pragma unroll
    for (int j = 0; j < DP / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
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
        for (int kk = 0; kk < DP / 16; ++kk) {
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
        softmax_tile<BN, DP / 2>(&s[0][0], pa, &acc[0][0], m0, m1, l0, l1, s1 - (s0 + it * BN), t, scale_log2, true);
        // O += P V.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < DP / 8; j += 2) {
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

    store_o<D, DP>(o, &acc[0][0], l0, l1, q0 + warp * 16 + g, s1, ld, h * D, t);
}
