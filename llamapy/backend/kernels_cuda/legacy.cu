// llamapy CUDA kernels for the 32-element block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
// (ggml-cuda dequantize.cuh / convert.cu's dequantize_block and the mmv paths of mmvq.cu).
// Block layouts as in ggml-common.h; one unit is one block. Loaded by llamapy/backend/cuda.py.
// Quants are read with the widest loads the block's alignment allows (rows start 256-byte
// aligned; Q4_0 / Q5_0 / Q8_0 blocks of 18 / 22 / 34 bytes are 2-byte aligned, Q4_1 / Q5_1
// blocks of 20 / 24 bytes 4-byte aligned, their quants too).
#include "common.cuh"

// Q4_0: f16 d, 16 bytes of nibbles (low nibbles are elements 0..15, high ones 16..31); w = d*(q-8)
struct DQ_Q4_0 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + u * 18;
        const float d = ld_f16(b);
        unsigned int qw[4];
        ld_words<4, 2>(b + 2, qw);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int q = byte_at(qw, j);
            w[j] = LP_MUL(d, (float)((q & 15) - 8));
            w[j + 16] = LP_MUL(d, (float)((q >> 4) - 8));
        }
    }
};

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; w = d*q + m
struct DQ_Q4_1 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + u * 20;
        const float d = ld_f16(b);
        const float m = ld_f16(b + 2);
        unsigned int qw[4];
        ld_words<4, 4>(b + 4, qw);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int q = byte_at(qw, j);
            w[j] = LP_ADD(LP_MUL(d, (float)(q & 15)), m);
            w[j + 16] = LP_ADD(LP_MUL(d, (float)(q >> 4)), m);
        }
    }
};

// Q5_0: f16 d, u32 qh (bit j = 5th bit of element j), 16 bytes of nibbles; w = d*(q-16)
struct DQ_Q5_0 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + u * 22;
        const float d = ld_f16(b);
        unsigned int qw[5];  // qh, then the 16 bytes of nibbles
        ld_words<5, 2>(b + 2, qw);
        const unsigned int qh = qw[0];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int q = byte_at(qw + 1, j);
            const int lo = (q & 15) | (int)(((qh >> j) & 1u) << 4);
            const int hi = (q >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            w[j] = LP_MUL(d, (float)(lo - 16));
            w[j + 16] = LP_MUL(d, (float)(hi - 16));
        }
    }
};

// Q5_1: f16 d, f16 m, u32 qh, 16 bytes of nibbles; w = d*q + m
struct DQ_Q5_1 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + u * 24;
        const float d = ld_f16(b);
        const float m = ld_f16(b + 2);
        unsigned int qw[5];  // qh, then the 16 bytes of nibbles
        ld_words<5, 4>(b + 4, qw);
        const unsigned int qh = qw[0];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int q = byte_at(qw + 1, j);
            const int lo = (q & 15) | (int)(((qh >> j) & 1u) << 4);
            const int hi = (q >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            w[j] = LP_ADD(LP_MUL(d, (float)lo), m);
            w[j + 16] = LP_ADD(LP_MUL(d, (float)hi), m);
        }
    }
};

// Q8_0: f16 d, 32 int8; w = q*d
struct DQ_Q8_0 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + u * 34;
        const float d = ld_f16(b);
        unsigned int qw[8];
        ld_words<8, 2>(b + 2, qw);
#pragma unroll
        for (int j = 0; j < 32; ++j) w[j] = LP_MUL((float)(signed char)byte_at(qw, j), d);
    }
};

LP_KERNELS(q4_0, DQ_Q4_0)
LP_KERNELS(q4_1, DQ_Q4_1)
LP_KERNELS(q5_0, DQ_Q5_0)
LP_KERNELS(q5_1, DQ_Q5_1)
LP_KERNELS(q8_0, DQ_Q8_0)
