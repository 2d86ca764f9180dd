// RMS_NORM with the MUL by its weight and the ADD before it fused (ggml-cuda norm.cu's
// rms_norm_f32 and its rms_norm + mul fusion; the ADD fusion is the CPU executor's, kernels_c/
// executor.c). Launched by llamapy/backend/cuda_ops.py (`rms_norm`); the numpy reference is
// kernels.py's rms_norm, mul and add.
//
// Numerics, as the reference rounds: v = a + b in float32 (fused ADD), squares v*v in float32,
// summed in float64 (the reference sums in order; here a tree of float64 sums: a different order,
// but 29 more bits than the float32 mean keeps, so the rounded mean differs only when a float64
// sum lands within 2^-29 of a float32 rounding boundary), mean = (float)(sum / n),
// scale = 1.0f / sqrtf(mean + eps) in float32, y = (v * scale) * w[col], every product rounded on
// its own (no FMA contraction).
#include "common.cuh"

// One thread block per row and token; blockDim.x a multiple of 32, at most 1024.
//   x:   rows of n float32, row r of token t (blockIdx.y) at x + t * sxt + r * sx (a prompt's
//        per-head Q/K norms over a strided view: every token's heads in one launch)
//   b:   nullable; the second ADD operand, row r at b + r * sb (sb 0: one row broadcast)
//   sum: nullable; where v = x + b is written (the residual stream the layer keeps), r * ss
//   w:   nullable; the norm weight, n float32 (one row broadcast)
//   y:   the result, row r of token t at y + t * syt + r * sy (b and sum: one token, gridDim.y 1)
//   q8:  nullable; the q8_1 copy of y for the int8 products after it (mmvq.cu's layout: quants at
//        q8 + r * n, pairs at q8ds; gridDim.y 1, n a multiple of 32, so each warp's 32 values of
//        a pass are one block): the QUANTIZE_Q8_1 launch fused in (gpu_plan's `_fuse_norm_q8`),
//        the same bits, as it quantizes the float32 y it would read back
// No pointer is __restrict__: y may be x (in place), sum may be x (an in-place ADD); a thread
// reads and writes only its own columns, and after the sum is written it reads it from there.
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm_f32(const float* x, long long sx, const float* b, long long sb, float* sum, long long ss,
                 const float* w, float* y, long long sy, int n, float eps, long long sxt, long long syt,
                 signed char* q8, float* q8ds) {
    __shared__ double red[32];
    const long long row = blockIdx.x;
    const float* xr = x + blockIdx.y * sxt + row * sx;
    const float* br = b ? b + row * sb : nullptr;
    float* sr = sum ? sum + row * ss : nullptr;
    float* yr = y + blockIdx.y * syt + row * sy;

    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (br) v = __fadd_rn(v, br[i]);
        if (sr) sr[i] = v;
        acc += (double)__fmul_rn(v, v);
    }
    acc = warp_sum(acc);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    acc = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0;
    acc = warp_sum(acc);  // every warp has the row's total

    const float mean = (float)(acc / (double)n);
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = sr ? sr[i] : (br ? __fadd_rn(xr[i], br[i]) : xr[i]);
        v = __fmul_rn(v, scale);
        if (w) v = __fmul_rn(v, w[i]);
        yr[i] = v;
        if (q8) q8_1_store(v, row * n + i, q8, q8ds);  // (uniform: every warp's pass is a block)
    }
}
