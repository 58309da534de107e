// Normalise and patchify on the GPU, from the resized, zero-padded uint8 canvas the host prepares
// (8x fewer bytes to upload than float32 patches, and no float work on the host).
//
// Napkin math (a 2,240 x 2,800 canvas = 32,000 patches; H200 HBM 4.8 TB/s): reads 18.8 MB of uint8
// (each byte once, the 3 KB table from L1), writes 32,000 x 1,176 bf16 = 75 MB: 94 MB, 20 us at HBM
// speed; memory-bound (a lookup and a store an element). Measured (bench_kernels, 66a180c): 214 us,
// 0.44 TB/s (9%: a thread per output element with 64-bit index arithmetic and 2-byte stores).
// Far from the bound, but once an image, beside a 2.6-300 ms forward.
#include "common.cuh"

// canvas: uint8 [H, W, 3]; table: float32 [3, 256], table[c * 256 + v] = what rescale + normalise
// make of value v in channel c (preprocess._value_table: the reference's own float operations), so
// out is bit-identical to bf16 of the host's patches. out: bf16 [H/P * W/P, 3 * T * P * P], the HF
// pixel_values layout: patches in 2x2 merge-block order (block row, block col, row and column in
// the block), each row (channel, frame, py, px), the still image repeated over the T frames.
extern "C" __global__ void patchify_u8(const unsigned char* __restrict__ canvas, const float* __restrict__ table,
                                       bf16* __restrict__ out, int H, int W, int T, int P) {
    const int PP = P * P, gw = W / P, bwn = gw / 2;
    const long n = (long)(H / P) * gw * 3 * PP;  // one frame's worth of output
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long p = i / (3 * PP);
        const int rem = (int)(i - p * 3 * PP);
        const int ch = rem / PP, py = (rem % PP) / P, px = rem % P;
        const int bh = (int)(p / (4 * bwn)), rest = (int)(p % (4 * bwn));
        const int y = (bh * 2 + (rest & 3) / 2) * P + py, x = ((rest >> 2) * 2 + (rest & 1)) * P + px;
        const bf16 val = __float2bfloat16(table[ch * 256 + canvas[((long)y * W + x) * 3 + ch]]);
        bf16* o = out + p * 3 * T * PP + (long)ch * T * PP + py * P + px;
        for (int t = 0; t < T; ++t) o[(long)t * PP] = val;
    }
}
