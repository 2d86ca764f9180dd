// GLU: SWIGLU, GEGLU and SWIGLU_OAI, act(gate) * up (ggml-cuda unary.cu's swiglu / geglu /
// swiglu_oai kernels). Launched
// by llamapy/backend/cuda_ops.py (`glu`); the numpy reference is kernels.py's glu and gelu.
//
// gate and up are separate row-strided operands, so the halves of a fused gate_up product
// ((T, 2F): gate at column 0, up at column F, both with row stride 2F) are read in place.
#include "common.cuh"

// silu_mul, gelu_f16 and swiglu_oai_mul are common.cuh's (the products' GLU epilogue uses them too).

// grid (ceil(n / blockDim.x), rows); element i of row r: gate g[r * sg + i], up u[r * su + i],
// out y[r * sy + i]. y may be g or u (in place).
extern "C" __global__ void swiglu_f32(const float* g, long long sg, const float* u, long long su,
                                      float* y, long long sy, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * sy + i] = silu_mul(g[r * sg + i], u[r * su + i]);
}

extern "C" __global__ void geglu_f32(const float* g, long long sg, const float* u, long long su,
                                     float* y, long long sy, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * sy + i] = __fmul_rn(gelu_f16(g[r * sg + i]), u[r * su + i]);
}

// SWIGLU_OAI (gpt-oss's clamped SwiGLU: common.cuh's swiglu_oai_mul with its alpha and limit)
extern "C" __global__ void swiglu_oai_f32(const float* g, long long sg, const float* u, long long su,
                                          float* y, long long sy, int n, float alpha, float limit) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * sy + i] = swiglu_oai_mul(g[r * sg + i], u[r * su + i], alpha, limit);
}
