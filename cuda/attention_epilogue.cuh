// The flash-attention epilogue: normalise O by the row sums and store it as bf16.
#pragma once
#include "ptx.cuh"

// O / l for this thread's two rows, stored as bf16 where the proj GEMM reads o: the first D of the DP
// columns the MMAs ran over (the rest are a head dim's padding, attention_sm80.cu).
template <int D, int DP = D>
__device__ __forceinline__ void store_o(bf16* o, const float* acc, float l0, float l1, int row0, int s1, long ld,
                                        int col0, int t) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    const int row1 = row0 + 8;
#pragma unroll
    for (int j = 0; j < DP / 8; ++j) {
        if (DP != D && j * 8 + 2 * t >= D) continue;  // D is even: a pair is wholly in or out
        const int c = col0 + j * 8 + 2 * t;
        if (row0 < s1)
            *reinterpret_cast<unsigned*>(o + (long)row0 * ld + c) = pack_bf16(acc[4 * j] * i0, acc[4 * j + 1] * i0);
        if (row1 < s1)
            *reinterpret_cast<unsigned*>(o + (long)row1 * ld + c) = pack_bf16(acc[4 * j + 2] * i1, acc[4 * j + 3] * i1);
    }
}
