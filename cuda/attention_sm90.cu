// Flash attention forward on Hopper (sm_90a), head dim 64: the tower's attention. Warp-specialised
// as FlashAttention-3 is: a producer warpgroup streams 128-key K/V tiles with cp.async into STAGES
// shared-memory slots, each guarded by a "full" mbarrier (completed by the copies themselves) and
// an "empty" one (one arrival per consumer warp once its wgmmas have read the slot). NC consumer
// warpgroups own 64 query rows each and never meet at a CTA-wide barrier; they take turns issuing
// their Q K^T wgmma (named barriers, round robin), so one warpgroup's softmax runs while another's
// MMAs keep the tensor cores busy. Registers move from the producer to the consumers (setmaxnreg).
// S = Q K^T reads Q and K from 128B-swizzled shared memory (wgmma SS); O += P V takes P from
// registers (wgmma RS) and V transposed from shared memory. FMA_EVERY > 0 sends one exp in
// 4 * FMA_EVERY to the FMA pipe (softmax.cuh ex2_fma). Layouts and grid as attention_sm80.cu.
//
// Napkin math (16 heads x 64, per block): FLOP = 4 * sum(n_seg^2) * 1024, 4.19 TFLOP at one
// 32,000-patch segment (100.7 TFLOP over the 24 blocks: 79% of the 8000-token forward). A score
// costs 256 MMA FLOP; an SM's tensor cores do 4,096 FLOP a clock (16 scores) and its MUFU 16 ex2
// a clock: the exp unit caps attention at the tensor rate, ~1,070 TFLOP/s at 1.98 GHz on 132 SMs,
// and without overlap of softmax and MMA at half that. Bytes are small beside it (q, k, v, o
// 262 MB at 32,000 rows; K/V re-read per query tile from L2). Measured on the H200 (bench_kernels,
// 66a180c; one segment of 1,024 / 4,096 / 16,384 / 32,000 keys, TFLOP/s): 3 consumer warpgroups
// 136 / 341 / 432 / 429, 2 consumer warpgroups 131 / 300 / 353 / 369 (2 win on short segments
// batched, where 192-row tiles leave SMs idle); cuDNN (torch SDPA) 112 / 396 / 488 / 475.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_sm90.cu needs sm_90a (wgmma, setmaxnreg): compile it for compute capability 9.0 only"
#endif
#include "attention_epilogue.cuh"
#include "attention_scheduler.cuh"
#include "barriers.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

// Registers a consumer thread gets after setmaxnreg (the producer keeps 40): what the 65,536 of an
// SM allow for NC + 1 warpgroups of 128 threads, rounded down to a multiple of 8.
__host__ __device__ constexpr int consumer_registers(int nc) { return nc == 2 ? 232 : 152; }

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

template <int NC, int STAGES, int FMA_EVERY>
__global__ void __launch_bounds__(128 * (NC + 1), 1) flash_fwd_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                  bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                                  const int* __restrict__ tile_q0, int heads, float scale_log2) {
    constexpr int D = 64, BNW = 128, BM = 64 * NC, TILE = BNW * 128;
    if (idle_tile(tile_seg)) return;  // the whole CTA, before any barrier
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

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(consumer_registers(NC)) : "memory");
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
}
