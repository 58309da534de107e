// Which query tile a flash-attention CTA computes: the static scheduler. The host builds one
// (segment, first query row) pair per tile over all segments (attention.py `tiles`); the grid is
// (tiles, heads), so CTA (x, y) takes tile x of head y.
#pragma once

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
