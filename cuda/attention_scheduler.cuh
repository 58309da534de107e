// Which query tile a flash-attention CTA computes. The host builds one (segment, first query row)
// pair per tile over all segments (attention.py `tiles`). attention_sm80.cu's grid is (tiles, heads):
// CTA (x, y) takes tile x of head y. attention_sm90.cu is persistent (below). A CUDA graph fixes the
// grid and the tile count for a token budget (engine/plans.py), so tiles past the batch's are marked
// idle (segment -1): an idle sm80 CTA returns before touching shared memory or a barrier, and the
// persistent walk skips them.
#pragma once

// The CTA's query tile: head blockIdx.y, tile blockIdx.x of segment [s0, s1), first row q0; rows of
// q/k/v/o are ld elements apart (all heads side by side).
struct QTile {
    int h, s0, s1, q0;
    long ld;
};
__device__ __forceinline__ bool idle_tile(const int* tile_seg) { return tile_seg[blockIdx.x] < 0; }

__device__ __forceinline__ QTile query_tile(const int* cu, const int* tile_seg, const int* tile_q0, int heads, int d) {
    const int seg = tile_seg[blockIdx.x];
    return {static_cast<int>(blockIdx.y), cu[seg], cu[seg + 1], tile_q0[blockIdx.x], (long)heads * d};
}

// The persistent walk (attention_sm90.cu): a grid of G <= tiles x heads CTAs; CTA c starts on work
// item c and then takes the next unclaimed item from a counter in global memory (sched[0], items G, G + 1,
// ...), so a CTA that drew short items draws more, as the hardware's block scheduler balanced the
// one-CTA-per-tile grid. Item w is tile w % tiles of head w / tiles: head-major, as that grid was, so the
// CTAs running at once share a head's K and V in L2. Idle tiles (segment -1) are skipped. The CTA that
// claims the last of all (sched[1] counts the CTAs done claiming) zeroes both counters for the next
// launch on the stream; so a counter pair serves one stream at a time.
__device__ __forceinline__ bool busy_item(const int* tile_seg, int w, int total, int tiles) {
    return w < total && tile_seg[w % tiles] >= 0;
}

__device__ __forceinline__ int claim_item(int* sched, const int* tile_seg, int total, int tiles) {
    int w;
    do {
        w = atomicAdd(&sched[0], 1) + static_cast<int>(gridDim.x);
    } while (w < total && tile_seg[w % tiles] < 0);
    return w;
}

// After this CTA's claim came back past the end: the last CTA to get there resets the counters.
__device__ __forceinline__ void done_claiming(int* sched) {
    __threadfence();
    if (atomicAdd(&sched[1], 1) == static_cast<int>(gridDim.x) - 1) {
        __threadfence();
        sched[0] = 0;
        sched[1] = 0;
    }
}

__device__ __forceinline__ QTile item_tile(const int* cu, const int* tile_seg, const int* tile_q0, int w, int tiles,
                                           int heads, int d) {
    const int x = w % tiles, seg = tile_seg[x];
    return {w / tiles, cu[seg], cu[seg + 1], tile_q0[x], (long)heads * d};
}
