// Flash attention forward on Hopper (sm_90a), head dim 64: the tower's attention. Warp-specialised
// as FlashAttention-3 is: one thread of a producer warp streams 64-key K/V tiles by TMA into STAGES
// shared-memory slots, each guarded by a "full" mbarrier (completed by the copies' bytes) and an
// "empty" one (one arrival per consumer warp once its wgmmas have read the slot). NC consumer
// warpgroups own 64 query rows each and never meet at a CTA-wide barrier; they take turns issuing
// their Q K^T wgmma (named barriers, round robin), so one warpgroup's softmax runs while another's
// MMAs keep the tensor cores busy. Registers move from the producer to the consumers (setmaxnreg).
// S = Q K^T reads Q and K from 128B-swizzled shared memory (wgmma SS); O += P V takes P from
// registers (wgmma RS) and V transposed from shared memory. Layouts as attention_sm80.cu.
//
// Persistent (attention_scheduler.cuh): at most one CTA per SM, each walking work items (a query
// tile of one head) that its producer claims from a global counter. Q is double-buffered, so the
// next item's Q and first K/V tiles land while the consumers finish this one, and the turns run on
// across items: no CTA drains and refills the pipeline per tile (+11-15% on 16 segments of 1,024,
// where a tile is only 16 K/V tiles long; +1% on one long segment; docs/PERFORMANCE.md).
//
// Why 4 consumer warpgroups of 64-key tiles: at head dim 64 the softmax's exps (MUFU, 16 a clock
// per SM) cost as many clocks as the MMAs, and each SM sub-partition hides the latency of one
// warp's softmax chain (max, shuffles, exps, sum) only with other warps' MMAs. A TMA producer needs
// few registers (32 here), which leaves 112 per consumer thread for 4 warpgroups: enough for a 64 x
// 64 S, its P fragments and O, not for 128-key tiles (those spilled). 4 warps per sub-partition
// instead of 3 gained 2-20%, and the exps all on MUFU then beat sending a share of them to the FMA
// pipe by another 4-7% (its polynomial takes issue slots that the fourth warp now uses).
//
// Napkin math (16 heads x 64, per block): FLOP = 4 * sum(n_seg^2) * 1024, 4.19 TFLOP at one
// 32,000-patch segment (100.7 TFLOP over the 24 blocks: 79% of the 8000-token forward). A score
// costs 256 MMA FLOP; an SM's tensor cores do 4,096 FLOP a clock (16 scores) and its MUFU 16 ex2
// a clock: the exp unit caps attention at the tensor rate, ~1,070 TFLOP/s at 1.98 GHz on 132 SMs,
// and without overlap of softmax and MMA at half that. Bytes are small beside it (q, k, v, o
// 262 MB at 32,000 rows; K/V re-read per query tile from L2). Measured on the H200 (benchmarks/
// bench_kernels.py, kernels back to back, TFLOP/s at one segment of 4,096 / 16,384 / 32,000 keys and
// 16 segments of 1,024): see docs/PERFORMANCE.md's latest table, beside cuDNN (torch SDPA) in the
// same run; the two are within a few per cent of each other on one segment.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_sm90.cu needs sm_90a (wgmma, setmaxnreg): compile it for compute capability 9.0 only"
#endif
#include "attention_epilogue.cuh"
#include "attention_scheduler.cuh"
#include "barriers.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// Registers the producer warpgroup keeps after setmaxnreg (one thread claiming items and issuing TMA
// copies, and a warp's cp.async of a segment's last V tile; ptxas spills 48 bytes of it at 32, 92 at
// 24, and 32 costs 4 consumer warpgroups nothing), and what the CTA's launch allocation (65,536 over
// its threads, a multiple of 8 each) then gives each consumer thread of NC warpgroups, a multiple of
// 8 and at most 240.
constexpr int PRODUCER_REGISTERS = 32;
__host__ __device__ constexpr int consumer_registers(int nc) {
    const int r = ((65536 / (128 * (nc + 1))) / 8 * 8 * (nc + 1) - PRODUCER_REGISTERS) / nc / 8 * 8;
    return r < 240 ? r : 240;
}

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

template <int NC, int STAGES>
__global__ void __launch_bounds__(128 * (NC + 1), 1) flash_fwd_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                  bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                                  const int* __restrict__ tile_q0, int tiles, int heads, float scale_log2,
                                  int* __restrict__ sched, const __grid_constant__ TmaMap tq,
                                  const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv) {
    constexpr int D = 64, BNW = 64, BM = 64 * NC, TILE = BNW * 128, QBYTES = BM * 128;
    static_assert(BM <= 256, "Q comes in one TMA box, and a box has at most 256 rows");
    const int total = tiles * heads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // qfull[2], qempty[2] (Q is double-buffered: the next item's Q lands while this one's runs),
    // full[STAGES], empty[STAGES]
    __shared__ __align__(8) unsigned long long bars[4 + 2 * STAGES];
    // What the producer tells the consumers: each buffer's item (before its Q copy) and the item after
    // it (before that item's last K/V tile); a value >= total means none.
    __shared__ int item[2], item_next[2];
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    unsigned char* sQ = base;
    unsigned char* sK = sQ + 2 * QBYTES;
    unsigned char* sV = sK + STAGES * TILE;
    const unsigned qfull0 = smem_u32(&bars[0]), qempty0 = smem_u32(&bars[2]), full0 = smem_u32(&bars[4]),
                   empty0 = smem_u32(&bars[4 + STAGES]);
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            mbar_init(qfull0 + 8 * b, 1);
            mbar_init(qempty0 + 8 * b, NC * 4);
        }
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, NC * 4);
        }
    }
    __syncthreads();

    if (wg == NC) {  // the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGISTERS) : "memory");
        // One warp: lane 0 claims the items and issues the TMA copies. Rows past the segment's end
        // arrive as other segments' (or a budget's stale padding) rows, which the softmax masks for K;
        // but 0 * a stale NaN in V would still be NaN, so a segment's last, partial V tile comes by
        // cp.async, zero-filled: the warp's 32 arrivals join the phase before lane 0's own arrival
        // completes it.
        const int tid = threadIdx.x - NC * 128;
        if (tid >= 32) return;
        int w = blockIdx.x, nx = total;
        if (tid == 0 && !busy_item(tile_seg, w, total, tiles)) w = claim_item(sched, tile_seg, total, tiles);
        w = __shfl_sync(0xffffffffu, w, 0);
        if (w >= total) {  // nothing for this CTA
            if (tid == 0) {
                item[0] = w;
                mbar_arrive(qfull0);
                done_claiming(sched);
            }
            return;
        }
        for (int n = 0, kv = 0;; ++n) {
            const auto [h, s0, s1, q0, ld] = item_tile(cu, tile_seg, tile_q0, w, tiles, heads, D);
            const int b = n & 1;
            if (tid == 0) {
                // The buffer's previous item (two back) must have been read by every consumer warp.
                if (n >= 2) mbar_wait(qempty0 + 8 * b, ((n >> 1) - 1) & 1);
                item[b] = w;
                mbar_expect_tx(qfull0 + 8 * b, QBYTES);
                tma_load_2d(sQ + b * QBYTES, &tq, h * D, q0, qfull0 + 8 * b);
                nx = claim_item(sched, tile_seg, total, tiles);  // in flight while the K/V copies go out
            }
            const int ntiles = (s1 - s0 + BNW - 1) / BNW;
            for (int it = 0; it < ntiles; ++it, ++kv) {
                const int st = kv % STAGES;
                if (kv >= STAGES) mbar_wait(empty0 + 8 * st, ((kv / STAGES) - 1) & 1);
                const int kb = s0 + it * BNW;
                const bool partial = s1 - kb < BNW;
                if (partial) {
                    load_tile_sw<BNW, 32>(sV + st * TILE, v + (long)kb * ld + h * D, s1 - kb, ld, tid);
                    mbar_arrive_copies_inc(full0 + 8 * st);
                    __syncwarp();
                }
                if (tid == 0) {
                    if (it == ntiles - 1) item_next[b] = nx;
                    mbar_expect_tx(full0 + 8 * st, partial ? TILE : 2 * TILE);
                    tma_load_2d(sK + st * TILE, &tk, h * D, kb, full0 + 8 * st);
                    if (!partial) tma_load_2d(sV + st * TILE, &tv, h * D, kb, full0 + 8 * st);
                }
            }
            w = __shfl_sync(0xffffffffu, nx, 0);
            if (w >= total) break;
        }
        if (tid == 0) done_claiming(sched);
        cp_wait_all();
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(consumer_registers(NC)) : "memory");
    const int g = lane >> 2, t = lane & 3;
    const int turn = 1 + wg, next = 1 + (wg + 1) % NC;  // named barriers 1..NC: whose turn to issue

    float acc[32];
    float s[BNW / 2];
    unsigned pa[BNW / 16][4];
    unsigned long long dq;

    auto issue_s = [&](int st) {
        const unsigned long long dk = sw128_desc(sK + st * TILE);
        wgmma_ss_n64_init(s, dq, dk);
#pragma unroll
        for (int kk = 1; kk < D / 16; ++kk) wgmma_ss_n64(s, dq + 2 * kk, dk + 2 * kk, 1);
    };
    auto issue_pv = [&](int st, bool accumulate) {
        const unsigned long long dv = sw128_desc(sV + st * TILE);
#pragma unroll
        for (int kk = 0; kk < BNW / 16; ++kk) wgmma_rs_n64_tb(acc, pa[kk], dv + kk * (2048 >> 4), accumulate || kk > 0);
    };

    mbar_wait(qfull0, 0);
    int w = item[0];
    if (w >= total) return;  // nothing for this CTA (no turn taken yet)
    if (NC > 1 && wg == NC - 1) named_arrive(1, 256);  // warpgroup 0 goes first
    for (int n = 0, kv = 0;; ++n) {
        const int b = n & 1;
        if (n > 0) mbar_wait(qfull0 + 8 * b, (n >> 1) & 1);
        const auto [h, s0, s1, q0, ld] = item_tile(cu, tile_seg, tile_q0, w, tiles, heads, D);
        const int ntiles = (s1 - s0 + BNW - 1) / BNW;
        dq = sw128_desc(sQ + b * QBYTES + wg * 64 * 128);
        float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
        int wn = total;
        // A turn is one warpgroup issuing its Q K^T; its softmax and P V follow outside the turn, while
        // the next warpgroup's Q K^T runs. (FA3's intra-warpgroup overlap, this warpgroup's previous P V
        // issued beside its softmax, was slower here each time it was tried: docs/PERFORMANCE.md.) The
        // turns run on across items; the very last one is not passed on (no arrival left pending).
        for (int it = 0; it < ntiles; ++it, ++kv) {
            const int st = kv % STAGES;
            mbar_wait(full0 + 8 * st, (kv / STAGES) & 1);
            const bool last = it == ntiles - 1;
            if (last) wn = item_next[b];
            // A partial tile's V came by cp.async (the generic proxy); wgmma reads through the async one.
            if (s1 - (s0 + it * BNW) < BNW) fence_proxy_async();
            if (NC > 1) named_sync(turn, 256);
            wgmma_fence();
            issue_s(st);
            wgmma_commit();
            if (NC > 1 && !(wg == NC - 1 && last && wn >= total)) named_arrive(next, 256);
            wgmma_wait0();
            if (last && lane == 0) mbar_arrive(qempty0 + 8 * b);  // this warp is done with the buffer's Q
            softmax_tile<BNW, 32>(s, pa, acc, m0, m1, l0, l1, s1 - (s0 + it * BNW), t, scale_log2, it > 0);
            wgmma_fence();
            issue_pv(st, it > 0);
            wgmma_commit();
            wgmma_wait0();
            if (lane == 0) mbar_arrive(empty0 + 8 * st);  // both wgmmas that read the slot are done
        }
        store_o<64>(o, acc, l0, l1, q0 + wg * 64 + warp * 16 + g, s1, ld, h * D, t);
        if (wn >= total) break;
        w = wn;
    }
}
