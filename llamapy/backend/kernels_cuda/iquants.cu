// llamapy CUDA kernels for the types mixture-of-experts models ship in: IQ4_NL, IQ4_XS, MXFP4
// (ggml-cuda convert.cu's dequantize_block_iq4_nl / iq4_xs / mxfp4 and their mmvq.cu paths).
// Layouts as in ggml-common.h; a unit is an IQ4_NL / MXFP4 block, or one eighth of an IQ4_XS
// super-block. Every value is a small integer of a 16-entry grid times the block's scale (exact in
// float32), as gguf-py computes it. Loaded by llamapy/backend/cuda.py.
#include "common.cuh"

// Entry q (0..15) of a 16-entry table of signed bytes packed little-endian into two 64-bit
// constants: a select and a shift in registers. An indexed array (`kv[q]`) is placed in local
// memory by nvcc (a 16-byte stack frame and an L1 load per weight in every kernel of these types).
LP_HD int table16(unsigned long long lo, unsigned long long hi, int q) {
    return (int)(signed char)(unsigned char)((q < 8 ? lo : hi) >> (8 * (q & 7)));
}

// kvalues_iq4nl (ggml-common.h): the non-linear 4-bit grid of IQ4_NL and IQ4_XS
// {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
LP_HD int iq4nl_value(int q) { return table16(0xf6eaddcfbfad9881ull, 0x7159453526190d01ull, q); }

// kvalues_mxfp4: the e2m1 values doubled (so integers; the scale is halved instead)
// {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}
LP_HD int mxfp4_value(int q) { return table16(0x0c08060403020100ull, 0xf4f8fafcfdfeff00ull, q); }

// IQ4_NL (18 bytes): f16 d, 16 bytes of nibbles (low nibbles are elements 0..15, high 16..31);
// w = d * kvalues[q]
struct DQ_IQ4_NL {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + u * 18;
        const float d = ld_f16(b);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            w[j] = LP_MUL(d, (float)iq4nl_value(b[2 + j] & 15));
            w[j + 16] = LP_MUL(d, (float)iq4nl_value(b[2 + j] >> 4));
        }
    }
};

// IQ4_XS (136 bytes): f16 d, u16 scales_h (2 high bits of each sub-block's scale), scales_l[4]
// (4 low bits, two sub-blocks a byte), qs[128] (16 bytes a sub-block, as IQ4_NL);
// w = (d * (scale - 32)) * kvalues[q]
struct DQ_IQ4_XS {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + (u >> 3) * 136;
        const int j = u & 7;
        const int ls = ((b[4 + j / 2] >> 4 * (j % 2)) & 15) | (((ld_u16(b + 2) >> 2 * j) & 3) << 4);
        const float dl = LP_MUL(ld_f16(b), (float)(ls - 32));
        const u8* qs = b + 8 + 16 * j;
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            w[l] = LP_MUL(dl, (float)iq4nl_value(qs[l] & 15));
            w[l + 16] = LP_MUL(dl, (float)iq4nl_value(qs[l] >> 4));
        }
    }
};

// MXFP4 (17 bytes): an E8M0 exponent e, 16 bytes of nibbles; w = 2^(e - 128) * kvalues[q]
struct DQ_MXFP4 {
    static LP_HD void unit(const u8* row, int u, float* w) {
        const u8* b = row + u * 17;
        const float d = e8m0_half(b[0]);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            w[j] = LP_MUL(d, (float)mxfp4_value(b[1 + j] & 15));
            w[j + 16] = LP_MUL(d, (float)mxfp4_value(b[1 + j] >> 4));
        }
    }
};

LP_KERNELS(iq4_nl, DQ_IQ4_NL)
LP_KERNELS(iq4_xs, DQ_IQ4_XS)
LP_KERNELS(mxfp4, DQ_MXFP4)
