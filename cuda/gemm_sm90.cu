// The MLP's gate/up GEMM with the clamped SwiGLU in its epilogue, on Hopper (sm_90a):
//   out[M, I] = bf16(swiglu(a @ Wg^T + bg, a @ Wu^T + bu)),  W = [Wg; Wu] as bound at load: [2I, K].
// cuBLAS would write gate|up [M, 2I] in bf16 and a second pass read it back (activations.cu); here the
// gate and up halves of an output tile are one wgmma accumulator (m64n256: columns 0-127 gate, 128-255
// up), so each thread holds both operands of its outputs and the pair never leaves registers. The
// biases are added in fp32 before the activation (the unfused path rounds gate|up to bf16 first).
//
// Structure (as attention_sm90.cu): one producer thread streams 64-wide K slices of A [128 rows] and of
// the gate and up rows of W [2 x 128 rows] with TMA into STAGES 128B-swizzled slots, each guarded by a
// "full" mbarrier (completed by the copies' bytes) and an "empty" one (one arrival per consumer warp
// once its wgmmas have read the slot). Two consumer warpgroups own 64 rows of the 128-row tile each; a
// slot is released as soon as the wgmma group after it has been issued (wait_group 1), so the tensor
// cores always have the next group queued. Persistent: a CTA per SM walks the tiles (in the order
// TileWalk says), and the producer fills the next tile's slots while the consumers run the epilogue.
// Two kernels share that skeleton: gemm_swiglu_sm90 (cooperative: both consumer warpgroups on one
// 128 x 256 tile, so the tensor cores idle during its epilogue) and, further down,
// gemm_swiglu_pingpong_sm90 (each warpgroup on its own 128 x 128 tile, one's epilogue under the
// other's MMAs); engine/gemm_sm90.py picks by K and by the waves the cooperative tiles fill.
//
// Napkin math (16 x 448² = 16,384 rows, K = 1,024, I = 4,096, per block): 275 GFLOP, ~380 us at the
// ~730 TFLOP/s cuBLAS reaches on its gate/up GEMM, which then writes gate|up (268 MB) for a swiglu
// pass that reads it back and writes 134 MB (~110 us at the 3.7 TB/s it reaches). Fused, the bytes are
// A 33 MB, W 16 MB (L2-resident), out 134 MB: ~40 us of HBM under the MMA. Each 128 x 256 x 64 step
// moves 48 KB from L2 for 4.2 MFLOP. Measured (python benchmarks/bench_kernels.py, H200, TFLOP/s
// counting gate and up): at 16,384 rows the launcher's pick (ping-pong) 699, against cuBLAS's gate/up
// GEMM alone 728 and cuBLAS + the swiglu pass 585 (1.20x end to end); the merger's 2,048 x 20,480 x
// 4,096 (cooperative) 762, against 781 and 734. TileWalk's order (cooperative, 32,000 rows): rows
// fastest 622, columns fastest 667; the merger's shape 761 against 540 the other way round. (A cp.async
// producer warpgroup in place of TMA is slower: docs/PERFORMANCE.md.)
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "gemm_sm90.cu needs sm_90a (wgmma, TMA, setmaxnreg): compile it for compute capability 9.0 only"
#endif
#include "barriers.cuh"
#include "swiglu.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// Tile: 128 rows (two consumer warpgroups of 64), 128 output columns (256 of W: gate and up), K by 64
// (a 128-byte row: the swizzle's width).
#define GS_BM 128
#define GS_BN 128
#define GS_BK 64
#define GS_A_TILE (GS_BM * 128)      // bytes of a slot's A rows
#define GS_B_TILE (2 * GS_BN * 128)  // and of its W rows, gate then up

// The static tile schedule every role walks in the same order: tile -> (first row, first column).
// The CTAs in flight share the operand that is walked slowest, from L2: rows fastest when W is the
// larger (it is then read from HBM once, A's tiles stay in L2), columns fastest when A is (a
// 32,000-row A is 65 MB, past L2: walked rows fastest, every column tile read it again from HBM).
struct TileWalk {
    int mtiles, ntiles, tiles, columns_fastest;
    __device__ __forceinline__ int m0(int tile) const {
        return (columns_fastest ? tile / ntiles : tile % mtiles) * GS_BM;
    }
    __device__ __forceinline__ int n0(int tile) const {
        return (columns_fastest ? tile % ntiles : tile / mtiles) * GS_BN;
    }
};

// The producer thread (both kernels): for each K slice, wait for its slot to be empty, then three TMA
// copies that complete the slot's full barrier: A's rows, and two boxes of W rows (B_TILE bytes in all,
// half each) from W row w0 and w0 + second, w0 = the tile's column index x wstep.
template <int STAGES, int B_TILE>
__device__ __forceinline__ void produce(const TmaMap* ta, const TmaMap* tw, unsigned char* sA, unsigned char* sB,
                                        unsigned full0, unsigned empty0, TileWalk walk, int ksteps, int wstep,
                                        int second) {
    tma_prefetch_map(ta);
    tma_prefetch_map(tw);
    int it = 0;  // K slices issued so far, over all of this CTA's tiles: slot and phase
    for (int tile = blockIdx.x; tile < walk.tiles; tile += gridDim.x) {
        const int m0 = walk.m0(tile), w0 = walk.n0(tile) / GS_BN * wstep;
        for (int ks = 0; ks < ksteps; ++ks, ++it) {
            const int st = it % STAGES;
            if (it >= STAGES) mbar_wait(empty0 + 8 * st, ((it / STAGES) - 1) & 1);
            const unsigned full = full0 + 8 * st;
            mbar_expect_tx(full, GS_A_TILE + B_TILE);
            tma_load_2d(sA + st * GS_A_TILE, ta, ks * GS_BK, m0, full);
            tma_load_2d(sB + st * B_TILE, tw, ks * GS_BK, w0, full);                         // gate rows
            tma_load_2d(sB + st * B_TILE + B_TILE / 2, tw, ks * GS_BK, w0 + second, full);   // up rows
        }
    }
}

// A consumer warpgroup's K loop over one tile: acc = its 64 rows of A x the slot's 256 W rows.
template <int STAGES>
__device__ __forceinline__ void mma_tile(float* acc, const unsigned char* sA, const unsigned char* sB, unsigned full0,
                                         unsigned empty0, int& it, int ksteps, int wg, int lane) {
    for (int ks = 0; ks < ksteps; ++ks, ++it) {
        const int st = it % STAGES;
        mbar_wait(full0 + 8 * st, (it / STAGES) & 1);
        wgmma_fence();
        const unsigned long long da = sw128_desc(sA + st * GS_A_TILE + wg * 64 * 128);
        const unsigned long long db = sw128_desc(sB + st * GS_B_TILE);
#pragma unroll
        for (int kk = 0; kk < GS_BK / 16; ++kk) wgmma_ss_n256(acc, da + 2 * kk, db + 2 * kk, ks > 0 || kk > 0);
        wgmma_commit();
        wgmma_wait1();  // the previous slice's group is done: its slot can be refilled
        if (ks > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
    }
    wgmma_wait0();
    if (lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
}

// The epilogue: this thread's rows r and r + 8, columns n0 + 8j + 2t and + 1 (j < COLS / 8) of the
// activation, from the gate (acc[4j..]) and up (acc[UP + 4j..]) values it holds. Both kernels' epilogue:
// the cooperative one's m64n256 accumulator (COLS 128, UP 64), the ping-pong one's m64n128 halves (64, 32).
template <int COLS, int UP>
__device__ __forceinline__ void store_swiglu(const float* acc, const bf16* __restrict__ bg, const bf16* __restrict__ bu,
                                             bf16* __restrict__ out, int r, int n0, int t, int M, int I, float limit) {
#pragma unroll
    for (int j = 0; j < COLS / 8; ++j) {
        const int c = n0 + 8 * j + 2 * t;
        float2 b_g = make_float2(0.f, 0.f), b_u = make_float2(0.f, 0.f);
        if (bg) b_g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bg + c));
        if (bu) b_u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bu + c));
        const float* gv = acc + 4 * j;
        const float* uv = acc + UP + 4 * j;
        if (r < M)
            *reinterpret_cast<unsigned*>(out + (long)r * I + c) =
                pack_bf16(swiglu1(gv[0] + b_g.x, uv[0] + b_u.x, limit), swiglu1(gv[1] + b_g.y, uv[1] + b_u.y, limit));
        if (r + 8 < M)
            *reinterpret_cast<unsigned*>(out + (long)(r + 8) * I + c) =
                pack_bf16(swiglu1(gv[2] + b_g.x, uv[2] + b_u.x, limit), swiglu1(gv[3] + b_g.y, uv[3] + b_u.y, limit));
    }
}

// Launch: 384 threads (2 consumer warpgroups + the producer's); dynamic shared memory
// STAGES * (GS_A_TILE + GS_B_TILE) + 1024 bytes; any grid (a CTA takes tiles blockIdx.x, + gridDim.x,
// ...). ta: A [M, K], tw: W [2I, K], boxes of 64 columns x 128 rows, 128B swizzle (engine/gemm_sm90.py's
// gate_up_swiglu encodes them); K % 64 == 0, I % 128 == 0, out [M, I] contiguous; rows of A past M read
// as zeros and are not stored. Biases may be null (the merger has none). columns_fastest: TileWalk's order.
template <int STAGES>
__global__ void __launch_bounds__(384, 1) gemm_swiglu_sm90(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tw,
                                 const bf16* __restrict__ bg, const bf16* __restrict__ bu, bf16* __restrict__ out,
                                 int M, int K, int I, float limit, int columns_fastest) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[STAGES], empty[STAGES]
    // 1024-byte aligned: the 128B swizzle's pattern repeats every 8 rows of 128 bytes.
    unsigned char* sA = reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    unsigned char* sB = sA + STAGES * GS_A_TILE;
    const unsigned full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);
    const int mtiles = (M + GS_BM - 1) / GS_BM, ksteps = K / GS_BK;
    const TileWalk walk{mtiles, I / GS_BN, mtiles * (I / GS_BN), columns_fastest};

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, 2 * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    }
    __syncthreads();

    if (threadIdx.x >= 256) {  // the producer warpgroup: one thread issues every copy
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 256) produce<STAGES, GS_B_TILE>(&ta, &tw, sA, sB, full0, empty0, walk, ksteps, GS_BN, I);
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    float acc[128];  // m64n256: acc[4j..4j+3] gate columns 8j + 2t (+1) of rows g and g + 8; acc[64 + ...] up
    int it = 0;
    for (int tile = blockIdx.x; tile < walk.tiles; tile += gridDim.x) {
        mma_tile<STAGES>(acc, sA, sB, full0, empty0, it, ksteps, wg, lane);
        store_swiglu<GS_BN, 64>(acc, bg, bu, out, walk.m0(tile) + wg * 64 + warp * 16 + (lane >> 2), walk.n0(tile),
                                lane & 3, M, I, limit);
    }
}

// ---------------------------------------------------------------------------------------------------
// Ping-pong consumers, so that one warpgroup's epilogue runs under the other's MMAs. Each consumer
// warpgroup owns whole tiles of 128 rows x 128 W rows (64 gate + 64 up: two m64n128 wgmmas a k16 step,
// 128 accumulators a thread as above), the CTA's tiles alternating between the two. The producer fills
// one ring of slots in tile order, so the warpgroups' K loops take turns: a warpgroup starts its tile's
// K loop only once the other has waited on every slot of the tile before (named barriers 1 and 2),
// which the slots' phase parity also needs (a slot may not be waited on two phases ahead;
// tools/pingpong_protocol.py models it). L2 traffic a FLOP is 4/3 of the cooperative kernel's (32 KB a
// 2.1 MFLOP slice against 48 KB a 4.2 MFLOP one), so it wins where the epilogue is a large share of a
// short K loop. Measured (python benchmarks/bench_kernels.py, H200, TFLOP/s): K = 1,024 (the block
// MLP) at 4,096 / 16,384 / 32,000 rows 674 / 700 / 702 against the cooperative kernel's 631 / 663 / 667
// (its better tile order); the merger's K = 4,096 at 2,048 rows 735 against 761. engine/gemm_sm90.py
// picks.
// A tile's W rows are two boxes of 64: gate rows 64c.. and up rows I + 64c.. (64 output columns).
#define PP_B_TILE (128 * 128)  // bytes of a slot's 128 W rows (its A rows: GS_A_TILE, as the cooperative kernel's)

// This thread's rows r and r + 8 of one 64-row half (acc: its 64 accumulators, gate columns 8j + 2t
// (+1) in acc[4j..], up in acc[32 + 4j..], j < 8), output columns n0...
struct SwigluEpilogue {
    const bf16* __restrict__ bg;
    const bf16* __restrict__ bu;
    bf16* __restrict__ out;
    int M, I;
    float limit;
    static constexpr int kWStep = 64;  // W rows a tile's gate box starts apart (its up box at + I)
    __device__ __forceinline__ int second() const { return I; }
    __device__ __forceinline__ void half(const float* acc, int r, int col, int t) const {
        store_swiglu<64, 32>(acc, bg, bu, out, r, col * 64, t, M, I, limit);
    }
};

// The whole kernel body: 384 threads (2 consumer warpgroups + the producer's), STAGES * 32 KB + 1024
// bytes of dynamic shared memory; ta: A [M, K] in boxes of 128 rows, tw: W in boxes of 64 rows, both
// 64 columns wide (128B swizzle); ntiles: output column tiles; K % 64 == 0.
template <int STAGES, class Epilogue>
__device__ __forceinline__ void pingpong_gemm(const TmaMap& ta, const TmaMap& tw, int M, int K, int ntiles,
                                              int columns_fastest, const Epilogue& epi) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];
    unsigned char* sA = reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    unsigned char* sB = sA + STAGES * GS_A_TILE;
    const unsigned full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);
    const int mtiles = (M + GS_BM - 1) / GS_BM, ksteps = K / GS_BK;
    // TileWalk counts columns in GS_BN units: n0(tile) / GS_BN is the tile's column index.
    const TileWalk walk{mtiles, ntiles, mtiles * ntiles, columns_fastest};

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, 4);  // the 4 warps of the warpgroup that consumed the slot
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x >= 256) {  // the producer: every slot of every tile, in tile order
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 256)
            produce<STAGES, PP_B_TILE>(&ta, &tw, sA, sB, full0, empty0, walk, ksteps, Epilogue::kWStep, epi.second());
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    float acc[128];  // acc[0..63]: rows 0-63 of the tile (m64n128), acc[64..127]: rows 64-127
    int local = 0;   // the CTA's tiles so far: even ones are warpgroup 0's, odd ones 1's
    for (int tile = blockIdx.x; tile < walk.tiles; tile += gridDim.x, ++local) {
        if ((local & 1) != wg) continue;
        if (local > 0) named_sync(1 + wg, 256);  // the other warpgroup has waited on every slot before ours
        int it = local * ksteps;
        for (int ks = 0; ks < ksteps; ++ks, ++it) {
            const int st = it % STAGES;
            mbar_wait(full0 + 8 * st, (it / STAGES) & 1);
            wgmma_fence();
            const unsigned long long da = sw128_desc(sA + st * GS_A_TILE);
            const unsigned long long da2 = sw128_desc(sA + st * GS_A_TILE + 64 * 128);
            const unsigned long long db = sw128_desc(sB + st * PP_B_TILE);
#pragma unroll
            for (int kk = 0; kk < GS_BK / 16; ++kk) {
                wgmma_ss_n128(acc, da + 2 * kk, db + 2 * kk, ks > 0 || kk > 0);
                wgmma_ss_n128(acc + 64, da2 + 2 * kk, db + 2 * kk, ks > 0 || kk > 0);
            }
            wgmma_commit();
            wgmma_wait1();
            if (ks > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
        }
        if (tile + gridDim.x < walk.tiles) named_arrive(2 - wg, 256);  // the next tile's warpgroup may start
        wgmma_wait0();
        if (lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
        const int r = walk.m0(tile) + warp * 16 + (lane >> 2), col = walk.n0(tile) / GS_BN;
        epi.half(acc, r, col, lane & 3);
        epi.half(acc + 64, r + 64, col, lane & 3);
    }
}

// As gemm_swiglu_sm90 (same arguments; W's box 64 rows; I % 64 == 0).
template <int STAGES>
__global__ void __launch_bounds__(384, 1) gemm_swiglu_pingpong_sm90(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tw,
                                 const bf16* __restrict__ bg, const bf16* __restrict__ bu, bf16* __restrict__ out,
                                 int M, int K, int I, float limit, int columns_fastest) {
    pingpong_gemm<STAGES>(ta, tw, M, K, I / 64, columns_fastest, SwigluEpilogue{bg, bu, out, M, I, limit});
}
