// The Tensor Memory Accelerator (sm_90): a 2-D tile copied global -> shared by one thread, described by
// a tensor map the host encodes (engine/tensor_maps.py: cuTensorMapEncodeTiled) and passes by value as
// a __grid_constant__ kernel parameter. The copy completes bytes on an mbarrier (barriers.cuh
// mbar_expect_tx); rows and columns past the tensor's end arrive as zeros.
#pragma once
#include "ptx.cuh"

// CUtensorMap's size and alignment (cuda.h is not available to NVRTC); its bytes are opaque here.
struct __align__(64) TmaMap {
    unsigned long long words[16];
};

// The box at element coordinates (c0 along the contiguous dimension, c1 along rows) into dst.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, int c0, int c1, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
