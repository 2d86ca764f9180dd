// llamapy CUDA kernels for the 256-element super-block types Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
// (ggml-cuda convert.cu's dequantize_block_q*_K and the K-quant paths of mmvq.cu). Layouts as in
// ggml-common.h; unit j (0..7) of a super-block is its elements 32*j .. 32*j+31.
// Loaded by llamapy/backend/cuda.py. Quants are read with the widest loads the block's alignment
// allows (rows start 256-byte aligned: Q4_K / Q5_K blocks of 144 / 176 bytes keep their 32-byte
// runs 16-byte aligned, Q2_K's 84-byte blocks 4-byte, Q3_K / Q6_K's 110 / 210 bytes 2-byte).
#include "common.cuh"

// Q2_K (84 bytes): scales[16] (low nibble scale, high nibble min of each 16 elements),
// qs[64] (2 bits; byte l of half h holds elements h*128 + 32*k + l at bits 2k), f16 d, f16 dmin.
// w = (d*sc)*q - dmin*m
struct DQ_Q2_K {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + (u >> 3) * 84;
        const int j = u & 7;
        const float d = ld_f16(b + 80);
        const float dmin = ld_f16(b + 82);
        unsigned int qw[8];
        ld_words<8, 4>(b + 16 + (j >> 2) * 32, qw);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int sc = b[2 * j + h];
            const float dl = LP_MUL(d, (float)(sc & 15));
            const float ml = LP_MUL(dmin, (float)(sc >> 4));
#pragma unroll
            for (int l = 16 * h; l < 16 * h + 16; ++l)
                w[l] = LP_SUB(LP_MUL(dl, (float)((byte_at(qw, l) >> sh) & 3)), ml);
        }
    }
};

// Q3_K (110 bytes): hmask[32] (bit j of byte l: high bit of element 32*j + l, set = no -4),
// qs[64] (2 bits, as Q2_K), scales[12] (16 signed 6-bit scales), f16 d. w = (d*(sc-32))*q
struct DQ_Q3_K {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + (u >> 3) * 110;
        const int j = u & 7;
        const float d = ld_f16(b + 108);
        unsigned int qw[8], hw[8];
        ld_words<8, 2>(b + 32 + (j >> 2) * 32, qw);
        ld_words<8, 2>(b, hw);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float dl = LP_MUL(d, (float)(scale_q3k(b + 96, 2 * j + h) - 32));
#pragma unroll
            for (int l = 16 * h; l < 16 * h + 16; ++l) {
                const int q = ((byte_at(qw, l) >> sh) & 3) - (((byte_at(hw, l) >> j) & 1) ? 0 : 4);
                w[l] = LP_MUL(dl, (float)q);
            }
        }
    }
};

// Q4_K (144 bytes): f16 d, f16 dmin, scales[12], qs[128] (32-byte runs: low nibbles are unit 2p,
// high nibbles unit 2p+1). w = (d*sc)*q - dmin*m
struct DQ_Q4_K {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + (u >> 3) * 144;
        const int j = u & 7;
        const float d = ld_f16(b);
        const float dmin = ld_f16(b + 2);
        int sc, m;
        scale_min_k4(b + 4, j, &sc, &m);
        const float dl = LP_MUL(d, (float)sc);
        const float ml = LP_MUL(dmin, (float)m);
        unsigned int qw[8];
        ld_words<8, 16>(b + 16 + (j >> 1) * 32, qw);
        const int sh = 4 * (j & 1);
#pragma unroll
        for (int l = 0; l < 32; ++l) w[l] = LP_SUB(LP_MUL(dl, (float)((byte_at(qw, l) >> sh) & 15)), ml);
    }
};

// Q5_K (176 bytes): f16 d, f16 dmin, scales[12], qh[32] (bit j of byte l: 5th bit of element
// 32*j + l), qs[128] as Q4_K. w = (d*sc)*q - dmin*m
struct DQ_Q5_K {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + (u >> 3) * 176;
        const int j = u & 7;
        const float d = ld_f16(b);
        const float dmin = ld_f16(b + 2);
        int sc, m;
        scale_min_k4(b + 4, j, &sc, &m);
        const float dl = LP_MUL(d, (float)sc);
        const float ml = LP_MUL(dmin, (float)m);
        unsigned int qw[8], hw[8];
        ld_words<8, 16>(b + 16, hw);
        ld_words<8, 16>(b + 48 + (j >> 1) * 32, qw);
        const int sh = 4 * (j & 1);
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            const int q = ((byte_at(qw, l) >> sh) & 15) | (((byte_at(hw, l) >> j) & 1) << 4);
            w[l] = LP_SUB(LP_MUL(dl, (float)q), ml);
        }
    }
};

// Q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d; two
// halves of 128 elements. In half a, element 32*k + l takes the nibble (k >> 1) of
// ql[64a + 32*(k & 1) + l] and bits 2k of qh[32a + l]. w = (d*sc)*(q - 32)
struct DQ_Q6_K {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + (u >> 3) * 210;
        const int j = u & 7;
        const int a = j >> 2, k = j & 3;
        const float d = ld_f16(b + 208);
        unsigned int lw[8], hw[8];
        ld_words<8, 2>(b + 64 * a + 32 * (k & 1), lw);
        ld_words<8, 2>(b + 128 + 32 * a, hw);
        const int shl = 4 * (k >> 1);
        const int shh = 2 * k;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float dl = LP_MUL(d, (float)(signed char)b[192 + 2 * j + h]);
#pragma unroll
            for (int l = 16 * h; l < 16 * h + 16; ++l) {
                const int q = (((byte_at(lw, l) >> shl) & 15) | (((byte_at(hw, l) >> shh) & 3) << 4)) - 32;
                w[l] = LP_MUL(dl, (float)q);
            }
        }
    }
};

LP_KERNELS(q2_k, DQ_Q2_K)
LP_KERNELS(q3_k, DQ_Q3_K)
LP_KERNELS(q4_k, DQ_Q4_K)
LP_KERNELS(q5_k, DQ_Q5_K)
LP_KERNELS(q6_k, DQ_Q6_K)
