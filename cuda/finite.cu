// Load-time check of the uploaded weights: how many bf16 values are NaN or infinite. A trained tower has
// none; one NaN in a weight makes every embedding that touches it NaN, silently, so the load refuses
// such a checkpoint by name (engine/params.py) rather than serve NaN rows.
//
// Napkin math (the official tower, 1.05 GiB of bf16 in 273 uploaded tensors; H200 HBM 4.8 TB/s): 0.23 ms
// of reads at HBM speed, plus a few microseconds for each of the 273 launches: launch-bound, a few
// milliseconds once a load. Measured (H200, ops.count_nonfinite timed back to back by
// benchmarks/common.kernel_ms): the merger's 160 MiB gate|up in 65 us (2.6 TB/s).
#include "common.cuh"

// count[slot] += the values of x[0..n) whose exponent bits are all ones (inf, NaN). Grid-stride, eight
// values a thread a step where the 16-byte loads are aligned, one a step otherwise.
extern "C" __global__ void count_nonfinite_bf16(const unsigned short* __restrict__ x, long long n,
                                                unsigned long long* __restrict__ count, int slot) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned c = 0;
    long long i0 = 0;
    if ((reinterpret_cast<size_t>(x) & 15) == 0) {
        const long long n8 = n / 8;
        const uint4* v = reinterpret_cast<const uint4*>(x);
        for (long long i = tid; i < n8; i += stride) {
            const uint4 r = v[i];
            const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                c += (w[k] & 0x7f80u) == 0x7f80u;
                c += (w[k] & 0x7f800000u) == 0x7f800000u;
            }
        }
        i0 = n8 * 8;
    }
    for (long long i = i0 + tid; i < n; i += stride) c += (x[i] & 0x7f80u) == 0x7f80u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0 && c) atomicAdd(count + slot, (unsigned long long)c);
}
