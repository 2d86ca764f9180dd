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
// activation for the f16 tensor-core GEMM (cuda_ops.mul_mat_gemm); y contiguous rows of n.
extern "C" __global__ void cpy_f32_f16(const float* x, long long sx, unsigned short* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * n + i] = f32_to_f16(x[r * sx + i]);
}
