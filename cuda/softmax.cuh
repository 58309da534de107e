// The softmax of the flash-attention kernels (mma.sync and wgmma lay a thread's S
// accumulators out alike).
#pragma once
#include "ptx.cuh"

// 2^x on the special-function unit; x <= 16 with the running max where a tile is kept lazy (its offset
// trails the max by up to log2(LAZY_SUM_LIMIT); a tile past that is rescaled or comes again), |x| <=
// FIXED_OFFSET_LIMIT without it; -inf (a masked key) -> 0; x >= 128 -> inf.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Keys at or past kvalid (a segment's last, partial tile) get score -inf: P = 0.
template <int BNW>
__device__ __forceinline__ void mask_keys(float* s, int kvalid, int t) {
    if (kvalid < BNW) {
#pragma unroll
        for (int j = 0; j < BNW / 8; ++j) {
            const int c = j * 8 + 2 * t;
            if (c >= kvalid) s[4 * j] = s[4 * j + 2] = NEG_INF;
            if (c + 1 >= kvalid) s[4 * j + 1] = s[4 * j + 3] = NEG_INF;
        }
    }
}

// P as the bf16 A fragments of the P V MMA (the same register layout for mma.sync m16n8k16 and wgmma RS).
template <int BNW>
__device__ __forceinline__ void pack_p(const float* s, unsigned (*pa)[4]) {
#pragma unroll
    for (int kk = 0; kk < BNW / 16; ++kk) {
        pa[kk][0] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
        pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// P = exp2(S * scale - offset) in place, for this thread's two rows (offsets o0, o1), and this thread's
// parts of their sums.
template <int BNW>
__device__ __forceinline__ void exp2_rows(float* s, float scale_log2, float o0, float o1, float& r0, float& r1) {
    r0 = r1 = 0.f;
#pragma unroll
    for (int j = 0; j < BNW / 8; ++j) {
        s[4 * j] = ex2(fmaf(s[4 * j], scale_log2, -o0));
        s[4 * j + 1] = ex2(fmaf(s[4 * j + 1], scale_log2, -o0));
        s[4 * j + 2] = ex2(fmaf(s[4 * j + 2], scale_log2, -o1));
        s[4 * j + 3] = ex2(fmaf(s[4 * j + 3], scale_log2, -o1));
        r0 += s[4 * j] + s[4 * j + 1];
        r1 += s[4 * j + 2] + s[4 * j + 3];
    }
}

// One K/V tile's softmax on this thread's S accumulators (rows g and g + 8 of its 16-row slice; the
// m16n8 mma.sync and the m64nN wgmma lay them out alike: 4 values per 8 keys): mask keys at or past
// kvalid, then pack P as the bf16 A fragments of the P V MMA (the same register layout for mma.sync
// m16n8k16 and wgmma RS) and add it to the row sums.
// ONLINE: P = exp2(S * scale - running max), the max and sum updated and O rescaled (NACC floats of O
// per thread; not on the first tile) as the max grows: exact for any scores.
// !ONLINE: P = exp2(S * scale), no max at all. Valid only when every score is known to lie within
// +-FIXED_OFFSET_LIMIT (log2 units) of 0, so no exp overflows and a row's largest P stays a normal
// float; the model checks that bound from its q_norm / k_norm weights at load (engine/attention.py
// score_bound_log2). It drops the max's 32 FMNMX, its shuffles and the 32-float rescale a tile.
template <int BNW, int NACC, bool ONLINE = true>
__device__ __forceinline__ void softmax_tile(float* s, unsigned (*pa)[4], float* acc, float& m0, float& m1, float& l0,
                                             float& l1, int kvalid, int t, float scale_log2, bool rescale) {
    mask_keys<BNW>(s, kvalid, t);
    float mx0 = 0.f, mx1 = 0.f;
    if constexpr (ONLINE) {
        // The max of the raw scores, scaled once (scale_log2 > 0: the same value as scaling each).
        mx0 = mx1 = NEG_INF;
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
    }
    float r0, r1;
    exp2_rows<BNW>(s, scale_log2, mx0, mx1, r0, r1);
    if constexpr (ONLINE) {
        const float c0 = ex2(m0 - mx0), c1 = ex2(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 = l0 * c0 + r0;
        l1 = l1 * c1 + r1;
        if (rescale) {
#pragma unroll
            for (int j = 0; j < NACC / 4; ++j) {
                acc[4 * j] *= c0; acc[4 * j + 1] *= c0;
                acc[4 * j + 2] *= c1; acc[4 * j + 3] *= c1;
            }
        }
    } else {
        l0 += r0;
        l1 += r1;
    }
    pack_p<BNW>(s, pa);
}

// How far a lazy tile's P may rise above 1 (a thread's 16 P of a row sum to at most this, so each P
// does): P <= 2^16 keeps a row sum of 2^15 keys below 2^31 and O below 2^31 x max|v| in float32.
#define LAZY_SUM_LIMIT 65536.f

// The running max's tile without its work (lazy rescaling, as FlashAttention-4 does it): P =
// exp2(S * scale - m) against the rows' current offsets m0 / m1, left as they are, with no O rescale;
// r0 / r1 get this thread's part of the row sums. Valid while no score has grown past its row's offset
// by more than log2(LAZY_SUM_LIMIT): then every P <= 2^16, and the softmax is exact whatever the
// offset (O and l share it). Returns whether that holds for this thread's live rows (NaN compares
// false). The kernel votes on it across each warp: all true, and the warp adds r to l and packs P;
// else the warp takes the exact step, lift_offsets. What a lazy tile saves against softmax_tile: the
// max's 32 FMNMX and its shuffles, two exps and the 32-float rescale of O.
template <int BNW>
__device__ __forceinline__ bool softmax_tile_lazy(float* s, float m0, float m1, float& r0, float& r1, int kvalid,
                                                  int t, float scale_log2, bool live0, bool live1) {
    mask_keys<BNW>(s, kvalid, t);
    exp2_rows<BNW>(s, scale_log2, m0, m1, r0, r1);
    return (!live0 || r0 <= LAZY_SUM_LIMIT) && (!live1 || r1 <= LAZY_SUM_LIMIT);
}

// Below this a thread's part of a lazy row sum leaves every P of the row a finite float that lift_offsets
// can scale back to 1; at or past it (or inf: a score more than 128 log2 units past its offset, or NaN)
// S must come again.
#define LIFT_SUM_LIMIT 0x1p120f

// log2(x) on the special-function unit (absolute error ~2^-22 for x in [1, 2^120]).
__device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The exact step from a lazy tile's P, where the warp's vote failed but every P is a float (this
// thread's r0, r1 < LIFT_SUM_LIMIT on live rows): each row whose largest P passed 1 moves its offset up
// to that P's score (by lg2 of it) and scales its P, l and NACC floats of O by ex2 of the offset's
// change, as softmax_tile does with the new max: its largest P becomes 1 to float rounding (bf16 packs
// it as exactly 1), so a row one key dominates gets that key's v exactly. The others stay as they are.
// The warp needs neither S again nor its warpgroup: no barrier a tile. Then P is packed as softmax_tile
// packs it.
template <int BNW, int NACC>
__device__ __forceinline__ void lift_offsets(float* s, unsigned (*pa)[4], float* acc, float& m0, float& m1,
                                             float& l0, float& l1, float r0, float r1) {
    float mx0 = 0.f, mx1 = 0.f;
#pragma unroll
    for (int j = 0; j < BNW / 8; ++j) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    // A row not live may hold inf or NaN (the compares are false): it stays put, and is never stored.
    const float n0 = mx0 > 1.f && mx0 <= 0x1p127f ? m0 + lg2(mx0) : m0;
    const float n1 = mx1 > 1.f && mx1 <= 0x1p127f ? m1 + lg2(mx1) : m1;
    const float f0 = ex2(m0 - n0), f1 = ex2(m1 - n1);  // from the rounded offsets, as softmax_tile's c0, c1
    m0 = n0;
    m1 = n1;
    l0 = l0 * f0 + r0 * f0;
    l1 = l1 * f1 + r1 * f1;
#pragma unroll
    for (int j = 0; j < BNW / 8; ++j) {
        s[4 * j] *= f0; s[4 * j + 1] *= f0;
        s[4 * j + 2] *= f1; s[4 * j + 3] *= f1;
    }
#pragma unroll
    for (int j = 0; j < NACC / 4; ++j) {
        acc[4 * j] *= f0; acc[4 * j + 1] *= f0;
        acc[4 * j + 2] *= f1; acc[4 * j + 3] *= f1;
    }
    pack_p<BNW>(s, pa);
}
