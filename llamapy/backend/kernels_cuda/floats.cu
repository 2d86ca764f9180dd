// llamapy CUDA kernels for unquantized weights: F32, F16, BF16 (ggml-cuda convert.cu's
// convert_unary and the float paths of mmv.cu). Loaded by llamapy/backend/cuda.py.
#include "common.cuh"

struct DQ_F32 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const float* p = reinterpret_cast<const float*>(row) + u * 32;  // rows are 128-byte multiples
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = p[i];
    }
};

struct DQ_F16 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + u * 32;
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = f16_to_f32(p[i]);
    }
};

struct DQ_BF16 {
    // bf16 is the top half of a float32: exact
    static LP_HD void unit(const u8* row, int u, float* w) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + u * 32;
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = bits_to_f32((unsigned int)p[i] << 16);
    }
};

LP_KERNELS(f32, DQ_F32)
LP_KERNELS(f16, DQ_F16)
LP_KERNELS(bf16, DQ_BF16)
