// ADD, MUL and SCALE on float32 rows (ggml-cuda binbcast.cu's add / mul with a broadcast row,
// scale.cu). Launched by llamapy/backend/cuda_ops.py (`binary`, `scale`); the numpy references
// are kernels.py's add, mul and scale. Each result is one float32 operation, rounded as numpy's.
#include "common.cuh"

// grid (ceil(n / blockDim.x), rows); a's row r at a + r * sa, b's at b + r * sb (sb 0: one row
// broadcast to every row, a norm weight or a bias), y's at y + r * sy. y may be a or b.
extern "C" __global__ void add_f32(const float* a, long long sa, const float* b, long long sb,
                                   float* y, long long sy, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * sy + i] = __fadd_rn(a[r * sa + i], b[r * sb + i]);
}

extern "C" __global__ void mul_f32(const float* a, long long sa, const float* b, long long sb,
                                   float* y, long long sy, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * sy + i] = __fmul_rn(a[r * sa + i], b[r * sb + i]);
}

// y = a * s (gemma3's input and query scales)
extern "C" __global__ void scale_f32(const float* a, long long sa, float* y, long long sy, int n, float s) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * sy + i] = __fmul_rn(a[r * sa + i], s);
}

// float32 rows -> IEEE half (round to nearest even, numpy's astype(float16)): a prompt's
// activation for the f16 tensor-core GEMM (cuda_ops.mul_mat_gemm); y contiguous rows of n. With
// n_part partial maxima of |x| (amax_f32's), the rows are scaled first: y = x / s and ab = {s, 0}
// (common.cuh's f16_input_scale); n_part 0: y = x as it is.
extern "C" __global__ void cpy_f32_f16(const float* x, long long sx, unsigned short* y, int n,
                                       const float* __restrict__ part, int n_part, float* ab) {
    const float inv = f16_input_scale(part, n_part, ab);  // (every thread: it synchronizes)
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * n + i] = f32_to_f16(__fmul_rn(x[r * sx + i], inv));
}

// The first launch of an f16 GEMM input's scale (common.cuh's f16_input_scale): part[b] = max |x|
// over rows b, b + gridDim.x, ... of the input, row p at x + (p / n_used) * sxt + (p % n_used) *
// sxu (a prompt's rows: n_used 1; a MUL_MAT_ID's (token, slot) pairs), a fixed number of blocks
// (cuda_ops.AMAX_BLOCKS at most) each looping over its rows. NaN is passed over (fmaxf): the
// product is NaN either way.
extern "C" __global__ void amax_f32(const float* __restrict__ x, long long sxt, long long sxu, int n_used, int rows,
                                    int n, float* __restrict__ part) {
    float m = 0.0f;
    for (int p = blockIdx.x; p < rows; p += gridDim.x) {
        const float* xr = x + (long long)(p / n_used) * sxt + (long long)(p % n_used) * sxu;
        for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, fabsf(xr[i]));
    }
    m = block_max(m);
    if (threadIdx.x == 0) part[blockIdx.x] = m;
}
