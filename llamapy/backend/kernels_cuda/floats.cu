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

// rows of F16 / BF16 are 64-byte multiples (n_in % 32 == 0): 16-byte loads
struct DQ_F16 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        unsigned int hw[16];
        ld_words<16, 16>(row + u * 64, hw);
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = f16_to_f32((unsigned short)(hw[i >> 1] >> (16 * (i & 1))));
    }
};

struct DQ_BF16 {
    // bf16 is the top half of a float32: exact
    static LP_HD void unit(const u8* row, int u, float* w) {
        unsigned int hw[16];
        ld_words<16, 16>(row + u * 64, hw);
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = bits_to_f32(((hw[i >> 1] >> (16 * (i & 1))) & 0xffffu) << 16);
    }
};

// F32 gate/up rows: at 80 registers mmv_glu_f32 spills 8 bytes (reloaded between the gate row and
// the up row); it takes 2 blocks an SM (up to 128 registers) instead
template <>
struct mmv_glu_min_blocks<DQ_F32> {
    static constexpr int value = 2;
};

LP_KERNELS(f32, DQ_F32)
LP_KERNELS(f16, DQ_F16)
LP_KERNELS(bf16, DQ_BF16)
