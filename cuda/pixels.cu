// Pixels on the GPU: Pillow's BICUBIC resize of the decoded image, the zero pad to the canvas, the
// reference's rescale + normalise and the patchify, so the host only decodes.
//
// Napkin math. patchify_u8 (a 2,240 x 2,800 canvas = 32,000 patches; H200 HBM 4.8 TB/s): reads 18.8 MB
// of uint8 (the 3 KB table from L1), writes 32,000 x 1,176 bf16 = 75 MB: 94 MB, 20 us at HBM speed;
// memory-bound. Measured (python benchmarks/bench_kernels.py, H200): 206 us, 0.46 TB/s (10%: a thread
// per output element with 64-bit index arithmetic and 2-byte stores). Once an image, beside a 2.6-300 ms
// forward.
// Resize of a 12 MP photo (4,000 x 3,000) to a 1,024-token canvas (756 x 1,008, 17 taps a side): the
// first (horizontal) pass reads the 36 MB image once from HBM (its taps overlap in L1/L2) and does
// 3,000 x 1,008 x 3 x 17 = 154 M integer multiply-adds (~10 us of the SMs' INT32 rate); the fused
// second pass 756 x 1,008 x 3 x 17 = 39 M plus the patchify's writes. Bound: the 36 MB read, ~8 us.
// Measured (H200, ops.resample_pass and ops.resample_patchify timed back to back by
// benchmarks/common.kernel_ms): 119 us and 44 us, well off both bounds (a thread per output byte, a
// one-byte load and a weight load a tap); the PCIe upload of the same 36 MB (~2 ms at 20 GB/s) is what
// the image costs the GPU.
#include "common.cuh"

// Output element i of the HF pixel_values layout (patches in M x M merge-block order; each row
// (channel, frame, py, px)) -> the canvas pixel it shows, for one frame: channel `ch` at (y, x); `p` is
// the patch row, `off` the offset of frame 0's element in that row. MC: the merge size known at compile
// time (2, the released tower's: shifts and masks), or 0 to use the run-time M.
struct PatchPixel { long p; int ch, y, x, off; };

template <int MC>
__device__ __forceinline__ PatchPixel patch_pixel(long i, int W, int P, int m) {
    const int M = MC ? MC : m, MM = M * M, PP = P * P, bwn = W / P / M;
    PatchPixel r;
    r.p = i / (3 * PP);
    const int rem = (int)(i - r.p * 3 * PP);
    r.ch = rem / PP;
    const int py = (rem % PP) / P, px = rem % P;
    const int bh = (int)(r.p / (MM * bwn)), rest = (int)(r.p % (MM * bwn));
    const int bw = rest / MM, j = rest % MM;  // the block's column, and the patch's place inside it
    r.y = (bh * M + j / M) * P + py;
    r.x = (bw * M + j % M) * P + px;
    r.off = py * P + px;
    return r;
}

__device__ __forceinline__ PatchPixel patch_pixel_at(long i, int W, int P, int M) {
    return M == 2 ? patch_pixel<2>(i, W, P, 2) : patch_pixel<0>(i, W, P, M);
}

// slot < 0: a still image, its pixel repeated over the row's T frames; slot t: frame t of a video's
// temporal group (the group's T frames are staged one launch each, each writing its own slot).
__device__ __forceinline__ void store_frames(bf16* out, const PatchPixel& q, int T, int P, int slot, bf16 val) {
    const int PP = P * P;
    bf16* o = out + q.p * 3 * T * PP + (long)q.ch * T * PP + q.off;
    if (slot >= 0) {
        o[(long)slot * PP] = val;
        return;
    }
    for (int t = 0; t < T; ++t) o[(long)t * PP] = val;
}

// canvas: uint8 [H, W, 3]; table: float32 [3, 256], table[c * 256 + v] = what rescale + normalise
// make of value v in channel c (preprocessing/image.py's _value_table: the reference's own float
// operations), so out is bit-identical to bf16 of the host's patches. out: bf16 [H/P * W/P,
// 3 * T * P * P]; M the merge; slot as store_frames'.
extern "C" __global__ void patchify_u8(const unsigned char* __restrict__ canvas, const float* __restrict__ table,
                                       bf16* __restrict__ out, int H, int W, int T, int P, int M, int slot) {
    const long n = (long)(H / P) * (W / P) * 3 * P * P;  // one frame's worth of output
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const PatchPixel q = patch_pixel_at(i, W, P, M);
        store_frames(out, q, T, P, slot, __float2bfloat16(table[q.ch * 256 + canvas[((long)q.y * W + q.x) * 3 + q.ch]]));
    }
}

// -- 8-bit resampling: Pillow's (src/libImaging/Resample.c) and ATen's (UpSampleKernel.cpp) -----------
// Output position o of a pass reads count[o] source pixels from first[o] on, weighted by the int32
// fixed-point weights[o * taps + j] with `prec` fractional bits (preprocessing/resample.py's axis:
// Pillow's own numbers, 22 bits; its aten_axis: ATen's uint8 antialias int16 weights, 22 bits or fewer
// per side). Both add 2^(prec - 1), sum byte x weight in 32-bit int (their bounds keep it from
// overflowing) and keep bits prec.. clipped to 0..255; integer sums are exact in any order, so this
// equals their bytes.
__device__ __forceinline__ unsigned char resample_tap_sum(const unsigned char* s, long stride, int count,
                                                          const int* __restrict__ w, int prec) {
    int acc = 1 << (prec - 1);
    for (int j = 0; j < count; ++j) acc += (int)s[j * stride] * w[j];
    acc >>= prec;  // arithmetic shift, as Pillow's clip8 table lookup and ATen's shift
    return (unsigned char)(acc < 0 ? 0 : (acc > 255 ? 255 : acc));
}

// One pass, uint8 [rows_in, src_w, 3] -> dst uint8 [rows, cols, 3]. along 1 (horizontal): dst[r, o]
// reads src row r, columns first[o]...; along 0 (vertical): dst[o, c] reads src column c, rows first[o]....
extern "C" __global__ void resample_pass_u8(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                            const int* __restrict__ first, const int* __restrict__ count,
                                            const int* __restrict__ weights, int taps, int prec, int along,
                                            int src_w, int rows, int cols) {
    const long n = (long)rows * cols * 3;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % 3);
        const long px = i / 3;
        const int r = (int)(px / cols), c = (int)(px % cols);
        const int o = along ? c : r;
        const unsigned char* s = along ? src + ((long)r * src_w + first[o]) * 3 + ch
                                       : src + ((long)first[o] * src_w + c) * 3 + ch;
        dst[i] = resample_tap_sum(s, along ? 3 : (long)src_w * 3, count[o], weights + (long)o * taps, prec);
    }
}

// The last pass fused with the zero pad, normalise and patchify: out as patchify_u8's for an H x W canvas
// whose top-left content_h x content_w pixels are the resized image and the rest zeros. The content
// pixel (y, x) is the pass `along` (0 vertical, 1 horizontal) over src uint8 [., src_w, 3] at output
// position y or x, or, along -1, src's pixel itself (nothing to resize); slot as store_frames'.
extern "C" __global__ void resample_patchify_u8(const unsigned char* __restrict__ src, const int* __restrict__ first,
                                                const int* __restrict__ count, const int* __restrict__ weights,
                                                int taps, int prec, int along, int src_w, int content_h,
                                                int content_w, const float* __restrict__ table,
                                                bf16* __restrict__ out, int H, int W, int T, int P, int M, int slot) {
    const long n = (long)(H / P) * (W / P) * 3 * P * P;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const PatchPixel q = patch_pixel_at(i, W, P, M);
        unsigned char v = 0;  // the pad
        if (q.y < content_h && q.x < content_w) {
            if (along == 1)
                v = resample_tap_sum(src + ((long)q.y * src_w + first[q.x]) * 3 + q.ch, 3, count[q.x],
                                     weights + (long)q.x * taps, prec);
            else if (along == 0)
                v = resample_tap_sum(src + ((long)first[q.y] * src_w + q.x) * 3 + q.ch, (long)src_w * 3,
                                     count[q.y], weights + (long)q.y * taps, prec);
            else
                v = src[((long)q.y * src_w + q.x) * 3 + q.ch];
        }
        store_frames(out, q, T, P, slot, __float2bfloat16(table[q.ch * 256 + v]));
    }
}
