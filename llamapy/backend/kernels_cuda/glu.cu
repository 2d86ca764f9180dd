// GLU: SWIGLU and GEGLU, act(gate) * up (ggml-cuda unary.cu's swiglu / geglu kernels). Launched
// by llamapy/backend/cuda_ops.py (`glu`); the numpy reference is kernels.py's glu and gelu.
//
// gate and up are separate row-strided operands, so the halves of a fused gate_up product
// ((T, 2F): gate at column 0, up at column F, both with row stride 2F) are read in place.
#include "common.cuh"

// silu(g) * u = (g / (1 + exp(-g))) * u in float32, as kernels.glu: each operation rounded on
// its own; expf is CUDA's (within 2 ulp of the correctly rounded value, numpy's within 1). A
// gate below ~-88.7 overflows exp to inf and gives -0 (times u), as in ggml.
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// GELU (tanh approximation) as ggml-cpu's GGML_GELU_FP16 table rounds it (kernels.gelu): the
// input rounded to f16, the value computed in float32 in the reference's order and rounded to
// f16; x <= -10 gives 0, x >= 10 gives x.
__device__ __forceinline__ float gelu_f16(float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const float h = f16_to_f32(f32_to_f16(x));
    const float c = 0.79788456080286535587989211986876f;  // sqrt(2 / pi)
    const float a = 0.044715f;
    // 0.5 * h * (1 + tanh(c * h * (1 + a * h * h))), left to right
    const float inner = __fmul_rn(__fmul_rn(c, h), __fadd_rn(1.0f, __fmul_rn(__fmul_rn(a, h), h)));
    const float y = __fmul_rn(__fmul_rn(0.5f, h), __fadd_rn(1.0f, tanhf(inner)));
    return f16_to_f32(f32_to_f16(y));
}

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
