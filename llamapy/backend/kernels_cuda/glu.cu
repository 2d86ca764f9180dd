// GLU: SWIGLU, GEGLU and SWIGLU_OAI, act(gate) * up (ggml-cuda unary.cu's swiglu / geglu /
// swiglu_oai kernels). Launched
// by llamapy/backend/cuda_ops.py (`glu`); the numpy reference is kernels.py's glu and gelu.
//
// gate and up are separate row-strided operands, so the halves of a fused gate_up product
// ((T, 2F): gate at column 0, up at column F, both with row stride 2F) are read in place.
#include "common.cuh"

// silu_mul and gelu_f16 are common.cuh's (the products' GLU epilogue uses them too).

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

// SWIGLU_OAI (gpt-oss's clamped SwiGLU, ggml's swiglu_oai; kernels.glu): x = min(g, limit),
// y = clamp(u, -limit, limit), x / (1 + exp(alpha * -x)) * (y + 1), each operation rounded to
// float32 in the reference's order (expf within 2 ulp of numpy's).
extern "C" __global__ void swiglu_oai_f32(const float* g, long long sg, const float* u, long long su,
                                          float* y, long long sy, int n, float alpha, float limit) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    const float x = fminf(g[r * sg + i], limit);
    const float up = fminf(fmaxf(u[r * su + i], -limit), limit);
    const float sig = __fdiv_rn(x, __fadd_rn(1.0f, expf(__fmul_rn(alpha, -x))));
    y[r * sy + i] = __fmul_rn(sig, __fadd_rn(up, 1.0f));
}
