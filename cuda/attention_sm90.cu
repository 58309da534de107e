// Flash attention forward on Hopper (sm_90a), head dim 64: the tower's attention. Warp-specialised
// as FlashAttention-3 is: one thread of a producer warp streams 64-key K/V tiles by TMA into STAGES
// shared-memory slots, each guarded by a "full" mbarrier (completed by the copies' bytes) and an
// "empty" one (one arrival per consumer warp once its wgmmas have read the slot). NC consumer
// warpgroups own 64 query rows each and never meet at a CTA-wide barrier; they take turns issuing
// their Q K^T wgmma (named barriers, round robin), so one warpgroup's softmax runs while another's
// MMAs keep the tensor cores busy. Registers move from the producer to the consumers (setmaxnreg).
// S = Q K^T reads Q and K from 128B-swizzled shared memory (wgmma SS); O += P V takes P from
// registers (wgmma RS) and V transposed from shared memory. Layouts and grid as attention_sm80.cu.
// OVERLAP (FlashAttention-3's intra-warpgroup overlap): a turn issues tile it's Q K^T and then tile
// it - 1's P V, so a warpgroup's softmax runs beside its own P V too, not only beside the others' MMAs.
//
// Why 4 consumer warpgroups of 64-key tiles: at head dim 64 the softmax's exps (MUFU, 16 a clock
// per SM) cost as many clocks as the MMAs, and each SM sub-partition hides the latency of one
// warp's softmax chain (max, shuffles, exps, sum) only with other warps' MMAs. A TMA producer needs
// 24 registers, which leaves 112 per consumer thread for 4 warpgroups: enough for a 64 x 64 S, its
// P fragments and O, not for 128-key tiles (those spill). Four warps per sub-partition hide more of
// the softmax chain than three, and every exp stays on MUFU: FA4's polynomial on the FMA pipe for a
// share of them would take issue slots that the fourth warp uses (docs/PERFORMANCE.md).
//
// Napkin math (16 heads x 64, per block): FLOP = 4 * sum(n_seg^2) * 1024, 4.19 TFLOP at one
// 32,000-patch segment (100.7 TFLOP over the 24 blocks: 79% of the 8000-token forward). A score
// costs 256 MMA FLOP; an SM's tensor cores do 4,096 FLOP a clock (16 scores) and its MUFU 16 ex2
// a clock: the exp unit caps attention at the tensor rate, ~1,070 TFLOP/s at 1.98 GHz on 132 SMs,
// and without overlap of softmax and MMA at half that. Bytes are small beside it (q, k, v, o
// 262 MB at 32,000 rows; K/V re-read per query tile from L2). Measured on an H100 SXM, one run, kernels
// back to back as `python benchmarks/bench_kernels.py --attention-only` times them (TFLOP/s at 4,096 /
// 16,384 / 32,000 keys and 16 segments of 1,024): without the running max (the fixed offset, where the
// weights bound every score) 580 / 648 / 595 / 461; with it (ONLINE: lazy past the first tile, the
// last one peeled, the exact step a warp's own) 548 / 608 / 574 / 436; cuDNN (torch SDPA) in the same
// run 470 / 497 / 479 / 436. OVERLAP is worth 4% / 7% to the four-warpgroup fixed / online kernels at
// 16,384 keys and 7-11% to the two-warpgroup pair (one 1,024-key segment: 14.3 / 15.4 us, SDPA 14.3).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_sm90.cu needs sm_90a (wgmma, setmaxnreg): compile it for compute capability 9.0 only"
#endif
#include "attention_epilogue.cuh"
#include "attention_scheduler.cuh"
#include "barriers.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// Registers the producer warpgroup keeps after setmaxnreg (one TMA thread, and a warp's cp.async of a
// segment's last V tile), and what the CTA's launch allocation (65,536 over its threads, a multiple
// of 8 each) then gives each consumer thread of NC warpgroups, a multiple of 8 and at most 240.
constexpr int PRODUCER_REGISTERS = 24;
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

// S = Q K^T for one warp's 16 query rows by mma.sync, from the 128B-swizzled Q rows (q16: the warp's
// first row) and K slot the wgmmas read: the exact step for scores that grew too far past their offsets
// for lift_offsets (softmax.cuh), which needs no warpgroup to join it. The m16n8 accumulators lie in
// this warp's registers as the m64n64 wgmma lays out its 16 rows.
__device__ __forceinline__ void warp_qk(float* s, const unsigned char* q16, const unsigned char* kt, int lane) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
#pragma unroll 1
    for (int kk = 0; kk < 4; ++kk) {  // not unrolled: few registers beside the softmax's live ones
        unsigned qf[4];
        ldsm_x4(qf[0], qf[1], qf[2], qf[3], q16 + sw128((lane & 7) + ((lane >> 3) & 1) * 8, 2 * kk + (lane >> 4)));
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            unsigned b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, kt + sw128(j * 8 + (lane & 7) + (lane >> 4) * 8, 2 * kk + ((lane >> 3) & 1)));
            mma16816(s + 4 * j, qf, b0, b1);
            mma16816(s + 4 * (j + 1), qf, b2, b3);
        }
    }
}

template <int NC, int STAGES, bool ONLINE = true, bool OVERLAP = false>
__global__ void __launch_bounds__(128 * (NC + 1), 1) flash_fwd_sm90(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                  bf16* __restrict__ o, const int* __restrict__ cu, const int* __restrict__ tile_seg,
                                  const int* __restrict__ tile_q0, int heads, int ldi, float scale_log2,
                                  const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
                                  const __grid_constant__ TmaMap tv) {
    constexpr int D = 64, BNW = 64, BM = 64 * NC, TILE = BNW * 128;
    static_assert(BM <= 256, "Q comes in one TMA box, and a box has at most 256 rows");
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
        mbar_init(qbar, 1);
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, NC * 4);
        }
    }
    __syncthreads();

    if (wg == NC) {  // the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGISTERS) : "memory");
        // One warp: lane 0 issues the TMA copies. Rows past the segment's end arrive as other
        // segments' (or a budget's stale padding) rows, which the softmax masks for K; but 0 * a stale
        // NaN in V would still be NaN, so a segment's last, partial V tile comes by cp.async,
        // zero-filled: the warp's 32 arrivals join the phase before lane 0's own arrival completes it.
        const int tid = threadIdx.x - NC * 128;
        if (tid >= 32) return;
        if (tid == 0) {
            mbar_expect_tx(qbar, BM * 128);
            tma_load_2d(sQ, &tq, h * D, q0, qbar);
        }
        for (int it = 0; it < ntiles; ++it) {
            const int st = it % STAGES;
            if (it >= STAGES) mbar_wait(empty0 + 8 * st, ((it / STAGES) - 1) & 1);
            const int kb = s0 + it * BNW;
            const bool partial = s1 - kb < BNW;
            if (partial) {
                load_tile_sw<BNW, 32>(sV + st * TILE, v + (long)kb * ldi + h * D, s1 - kb, ldi, tid);
                mbar_arrive_copies_inc(full0 + 8 * st);
                __syncwarp();
            }
            if (tid == 0) {
                mbar_expect_tx(full0 + 8 * st, partial ? TILE : 2 * TILE);
                tma_load_2d(sK + st * TILE, &tk, h * D, kb, full0 + 8 * st);
                if (!partial) tma_load_2d(sV + st * TILE, &tv, h * D, kb, full0 + 8 * st);
            }
        }
        cp_wait_all();
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(consumer_registers(NC)) : "memory");
    const int g = lane >> 2, t = lane & 3;
    const int turn = 1 + wg, next = 1 + (wg + 1) % NC;  // named barriers 1..NC: whose turn to issue
    const int row0 = q0 + wg * 64 + warp * 16 + g;        // this thread's rows: row0 and row0 + 8
    const bool live0 = row0 < s1, live1 = row0 + 8 < s1;
    if (NC > 1 && wg == NC - 1) named_arrive(1, 256);    // warpgroup 0 goes first
    mbar_wait(qbar, 0);
    const unsigned long long dq = sw128_desc(sQ + wg * 64 * 128);

    float acc[32];
    float s[BNW / 2];
    unsigned pa[BNW / 16][4];
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

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

    // A turn is one warpgroup issuing its Q K^T (and with OVERLAP the last tile's P V); its softmax
    // follows outside the turn, while the next warpgroup's MMAs run.
    auto begin_tile = [&](int it, int kvalid) __attribute__((always_inline)) {
        const int st = it % STAGES;
        mbar_wait(full0 + 8 * st, (it / STAGES) & 1);
        // A partial tile's V came by cp.async (the generic proxy); wgmma reads through the async one.
        if (kvalid < BNW) fence_proxy_async();
        if (NC > 1) named_sync(turn, 256);
        wgmma_fence();
        issue_s(st);
        wgmma_commit();
    };
    auto end_turn = [&](int it) __attribute__((always_inline)) {
        if (NC > 1 && !(wg == NC - 1 && it == ntiles - 1)) named_arrive(next, 256);
    };
    auto release = [&](int it) __attribute__((always_inline)) {
        if (lane == 0) mbar_arrive(empty0 + 8 * (it % STAGES));  // both wgmmas that read the slot are done
    };
    // The running max past a segment's first tile (softmax.cuh): lazily, each warp voting for its own
    // 16 rows; where a warp's vote fails, that warp alone takes the exact step: lift_offsets from P, or,
    // for a score over ~120 log2 units past its offset, S again by mma.sync and softmax_tile. No step
    // waits for the warpgroup, so a lazy tile costs a vote and a compare over the fixed-offset kernel's.
    // The 16-row groups count from the segment's start in every variant and batch, so the choice, and
    // so every bit, depends on the segment alone. O must be free (its last P V done) before online_finish.
    auto online_vote = [&](int kvalid, float& r0, float& r1) __attribute__((always_inline)) {
        return __all_sync(0xffffffffu, softmax_tile_lazy<BNW>(s, m0, m1, r0, r1, kvalid, t, scale_log2, live0, live1));
    };
    auto online_finish = [&](int it, int kvalid, bool lazy, float r0, float r1) __attribute__((always_inline)) {
        if (lazy) {
            l0 += r0;
            l1 += r1;
            pack_p<BNW>(s, pa);
        } else if (!__any_sync(0xffffffffu, (live0 && !(r0 < LIFT_SUM_LIMIT)) || (live1 && !(r1 < LIFT_SUM_LIMIT)))) {
            lift_offsets<BNW, 32>(s, pa, acc, m0, m1, l0, l1, r0, r1);
        } else {
            warp_qk(s, sQ + (wg * 64 + warp * 16) * 128, sK + (it % STAGES) * TILE, lane);
            softmax_tile<BNW, 32, true>(s, pa, acc, m0, m1, l0, l1, kvalid, t, scale_log2, true);
        }
    };
    if constexpr (OVERLAP) {
        // Tile it's softmax runs while tile it - 1's P V does; only what writes P and O (packing P, the
        // rescale, an exact step's S issued again) waits for it. Every row sees the same operations in
        // the same order as without OVERLAP, so the bits are the same (tested).
        const int kvalid0 = s1 - s0 < BNW ? s1 - s0 : BNW;
        begin_tile(0, kvalid0);
        end_turn(0);
        wgmma_wait0();
        softmax_tile<BNW, 32, ONLINE>(s, pa, acc, m0, m1, l0, l1, kvalid0, t, scale_log2, false);
        auto step = [&](int it, int kvalid) __attribute__((always_inline)) {
            begin_tile(it, kvalid);
            issue_pv((it - 1) % STAGES, it > 1);
            wgmma_commit();
            end_turn(it);
            wgmma_wait1();  // this tile's S; the last tile's P V may still run
            if constexpr (ONLINE) {  // the vote beside the P V; P packed and O rescaled once it is done
                float r0, r1;
                const bool lazy = online_vote(kvalid, r0, r1);
                wgmma_wait0();
                release(it - 1);
                online_finish(it, kvalid, lazy, r0, r1);
            } else {
                float r0, r1;
                mask_keys<BNW>(s, kvalid, t);
                exp2_rows<BNW>(s, scale_log2, 0.f, 0.f, r0, r1);
                l0 += r0;
                l1 += r1;
                wgmma_wait0();
                release(it - 1);
                pack_p<BNW>(s, pa);
            }
        };
        if constexpr (ONLINE) {
            for (int it = 1; it < ntiles - 1; ++it) step(it, BNW);
            if (ntiles > 1) step(ntiles - 1, s1 - (s0 + (ntiles - 1) * BNW));
        } else {
            for (int it = 1; it < ntiles; ++it) step(it, s1 - (s0 + it * BNW));
        }
        wgmma_fence();
        issue_pv((ntiles - 1) % STAGES, ntiles > 1);
        wgmma_commit();
        wgmma_wait0();
        release(ntiles - 1);
    } else {
        // kvalid: the tile's keys inside the segment. Only the last tile can be partial, so with the
        // running max it is a step of its own: in the loop kvalid is the constant BNW and the masking
        // compiles away (left to a runtime test, nvcc predicates it into 32 FSEL and their compares on
        // every tile, which costs the online kernels 1-2%).
        auto step = [&](int it, int kvalid) __attribute__((always_inline)) {
            begin_tile(it, kvalid);
            end_turn(it);
            wgmma_wait0();
            if constexpr (ONLINE) {
                if (it == 0) {
                    softmax_tile<BNW, 32, true>(s, pa, acc, m0, m1, l0, l1, kvalid, t, scale_log2, false);
                } else {
                    float r0, r1;
                    const bool lazy = online_vote(kvalid, r0, r1);
                    online_finish(it, kvalid, lazy, r0, r1);
                }
            } else {
                softmax_tile<BNW, 32, false>(s, pa, acc, m0, m1, l0, l1, kvalid, t, scale_log2, false);
            }
            wgmma_fence();
            issue_pv(it % STAGES, it > 0);
            wgmma_commit();
            wgmma_wait0();
            release(it);
        };
        if constexpr (ONLINE) {
            for (int it = 0; it < ntiles - 1; ++it) step(it, BNW);
            step(ntiles - 1, s1 - (s0 + (ntiles - 1) * BNW));
        } else {  // not peeled: peeling costs the fixed-offset kernels 3-7% (docs/PERFORMANCE.md)
            for (int it = 0; it < ntiles; ++it) step(it, s1 - (s0 + it * BNW));
        }
    }
    store_o<64>(o, acc, l0, l1, row0, s1, ld, h * D, t);
}
