// Which query tile a flash-attention CTA computes: the static scheduler. The host builds one
// (segment, first query row) pair per tile over all segments (attention.py `tiles`); the grid is
// (tiles, heads), so CTA (x, y) takes tile x of head y. A CUDA graph fixes the grid for a token
// budget (engine/plans.py), so tiles past the batch's are marked idle (segment -1): their CTAs
// return before touching shared memory or a barrier.
#pragma once

// The CTA's query tile: head blockIdx.y, tile blockIdx.x of segment [s0, s1), first row q0; rows of
// o are ld elements apart (all heads side by side). (Rows of q, k and v are the kernels' ldi apart:
// the engine's are columns of the QKV GEMM's output.)
struct QTile {
    int h, s0, s1, q0;
    long ld;
};
__device__ __forceinline__ bool idle_tile(const int* tile_seg) { return tile_seg[blockIdx.x] < 0; }

__device__ __forceinline__ QTile query_tile(const int* cu, const int* tile_seg, const int* tile_q0, int heads, int d) {
    const int seg = tile_seg[blockIdx.x];
    return {static_cast<int>(blockIdx.y), cu[seg], cu[seg + 1], tile_q0[blockIdx.x], (long)heads * d};
}
