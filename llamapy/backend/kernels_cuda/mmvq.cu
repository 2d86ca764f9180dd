// llamapy CUDA decode products on int8 dot products (ggml-cuda's quantize.cu quantize_q8_1, and
// mmvq.cu's mul_mat_vec_q with the vec_dot_*_q8_1 of vecdotq.cuh): the default ("q8") mode's
// matrix-vector products of the large matrices (gpu_plan.MMVQ_MIN_WEIGHTS).
//
// quantize_q8_1: each token's float32 row, in blocks of 32, to int8 with a scale, once per product
//   (common.cuh's q8_1_store: d = amax / 127, q = roundf(x / d), ggml-cuda's rule; norm.cu's
//   rms_norm_f32 writes the copy of its result through it too, gpu_plan's `_fuse_norm_q8`).
//   Layout (llamapy's, not ggml's interleaved block_q8_1): the quants of every block first, 32 bytes
//   each (token t's block u at byte (t * n_units + u) * 32: two 128-bit loads a block), then a
//   float32 pair (d, d * sum(q)) per block. ggml-cuda stores half2 (d, sum of the float x); the
//   float32 d * sum(q) makes each unit's product exactly the dot of the dequantized weights with the
//   dequantized activations (what ggml-cuda's K-quant dots compute with dp4a(0x01010101, q), and
//   what ggml's CPU q8_1 stores), so one numpy reference (quants.quantize_q8_1_cuda) covers every
//   type; the pair costs 8 bytes a block instead of 4, on a copy of a few KiB.
//
// mmvq_<type>: y[t, r] = sum_u unit_u(W[r]) . x_q8[t, u] for n_tok <= MMV_MAX_TOK, one warp a row as
//   common.cuh's mmv (lane l takes units l, l+32, ...). A decoder VQ::unit(row, u, q, d, m) gives
//   unit u as 32 int8 in 8 words (element order, as the activations' quants), a float scale per
//   16 elements (d[0], d[1]: equal but for the K types' with a scale per 16: Q2_K, Q3_K, Q6_K)
//   and an offset m[0], the unit's weights being d * q + m; per token the unit's sum is
//       dy * (d[0] * dp4a(q[0..3], y[0..3]) + d[1] * dp4a(q[4..7], y[4..7])) + m[0] * sy
//   with (dy, sy) the block's pair. Q2_K has an offset per 16 elements (m[0], m[1]: vq_half_mins),
//   its sum dy * (... + m[0] * dp4a(1, y[0..3]) + m[1] * dp4a(1, y[4..7])): 8 more dp4a a unit.
//   Else 8 dp4a, 2 x 128-bit loads of y a unit and token, where mmv takes
//   ~210 instructions and 128 bytes of float32 activations (the analysis in docs/architecture.md).
//   Numerics: each unit's sum is rounded in float32, the lanes' sums added as mmv adds them; the
//   result is the float64 product of the dequantized weights and activations within float32
//   rounding (tests/gpu/test_cuda_kernels.py), not bit-equal to the f32 mode or to llama.cpp.
// mmvq_glu_<type>: the stacked gate/up matrix with its GLU as epilogue, as mmv_glu.
// mmvq_id_<type>: MUL_MAT_ID on the q8_1 copy (common.cuh's mmv_id_impl, its routing, biases and
//   GLU epilogue): pair (t, u)'s input is the copy's row t * sxt + u * sxu — the token's one row
//   (sxt 1, sxu 0: gate / up, the norm's copy) or the pair's own (sxt n_used, sxu 1: down, the GLU
//   result's copy); each pair's sums are mmvq_<type>'s of that row with its expert's rows. Held to
//   3 blocks an SM (80 registers): left free, ptxas gave Q4_0's and IQ4_NL's 64 and spilled.
#include "common.cuh"

// 8 words of signed bytes times 8 words: the two halves' int32 sums
__device__ __forceinline__ void dot_q8(const int* q, const int* y, int* s0, int* s1) {
    int a = 0, b = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        a = __dp4a(q[i], y[i], a);
        b = __dp4a(q[4 + i], y[4 + i], b);
    }
    *s0 = a;
    *s1 = b;
}

// 4 bits of b spread to bit 4 of each byte (the 5th bit of four consecutive elements)
__device__ __forceinline__ int spread4(unsigned int b) {
    return (int)(((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25));
}

// the 32 nibbles of 4 words: low nibbles are elements 0..15 (q[0..3]), high ones 16..31 (q[4..7]);
// hi (optional, Q5_0 / Q5_1): the 32 fifth bits, bit l for element l
__device__ __forceinline__ void split_nibbles(const unsigned int* qw, int* q, unsigned int hi = 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        q[i] = (int)(qw[i] & 0x0f0f0f0fu) | spread4(hi >> (4 * i));
        q[4 + i] = (int)((qw[i] >> 4) & 0x0f0f0f0fu) | spread4(hi >> (16 + 4 * i));
    }
}

// the (d, m) f16 pair of a Q4_1 / Q5_1 block, in one 32-bit load
__device__ __forceinline__ void load_dm(const u8* b, float* d, float* m) {
    unsigned int dm;
    ld_words<1, 4>(b, &dm);
    d[0] = d[1] = f16_to_f32((unsigned short)dm);
    *m = f16_to_f32((unsigned short)(dm >> 16));
}

// Whether a decoder gives an offset per 16 elements (m[0], m[1]) rather than one a unit
template <typename VQ>
struct vq_half_mins {
    static constexpr bool value = false;
};

// Q4_0 (18 bytes): w = d * (q - 8) = d * q - 8 d
struct VQ_Q4_0 {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + u * 18;
        unsigned int qw[4];
        ld_words<4, 2>(b + 2, qw);
        split_nibbles(qw, q);
        d[0] = d[1] = ld_f16(b);
        *m = -8.0f * d[0];
    }
};

// Q4_1 (20 bytes): w = d * q + m
struct VQ_Q4_1 {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + u * 20;
        unsigned int qw[4];
        ld_words<4, 4>(b + 4, qw);
        split_nibbles(qw, q);
        load_dm(b, d, m);
    }
};

// Q5_0 (22 bytes): w = d * (q - 16), the 5th bits in qh
struct VQ_Q5_0 {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + u * 22;
        unsigned int qw[5];
        ld_words<5, 2>(b + 2, qw);
        split_nibbles(qw + 1, q, qw[0]);
        d[0] = d[1] = ld_f16(b);
        *m = -16.0f * d[0];
    }
};

// Q5_1 (24 bytes): w = d * q + m
struct VQ_Q5_1 {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + u * 24;
        unsigned int qw[5];
        ld_words<5, 4>(b + 4, qw);
        split_nibbles(qw + 1, q, qw[0]);
        load_dm(b, d, m);
    }
};

// Q8_0 (34 bytes): w = d * q
struct VQ_Q8_0 {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + u * 34;
        ld_words<8, 2>(b + 2, reinterpret_cast<unsigned int*>(q));
        d[0] = d[1] = ld_f16(b);
        *m = 0.0f;
    }
};

// sub-block j's scale d * sc and offset -(dmin * mn) of a Q4_K / Q5_K super-block at b (f16 d,
// f16 dmin, then the 12 bytes of 6-bit scales and mins): one 32-bit load of (d, dmin)
__device__ __forceinline__ void k4_scale_min(const u8* b, int j, float* d, float* m) {
    int sc, mn;
    scale_min_k4(b + 4, j, &sc, &mn);
    load_dm(b, d, m);
    d[0] = d[1] = d[0] * (float)sc;
    *m = -(*m * (float)mn);
}

// Q2_K (84 bytes), sub-block j: w = (d * sc) * q - dmin * mn, a scale and a min per 16 elements
// (bytes 2j, 2j + 1: low nibble the scale, high the min), q the 2 bits at 2 * (j % 4) of qs's bytes
struct VQ_Q2_K {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + (u >> 3) * 84;
        const int j = u & 7;
        unsigned int qw[8];
        ld_words<8, 4>(b + 16 + (j >> 2) * 32, qw);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)((qw[i] >> sh) & 0x03030303u);
        float dd[2], dmin;
        load_dm(b + 80, dd, &dmin);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int sc = b[2 * j + h];
            d[h] = dd[0] * (float)(sc & 15);
            m[h] = -(dmin * (float)(sc >> 4));
        }
    }
};
template <>
struct vq_half_mins<VQ_Q2_K> {
    static constexpr bool value = true;
};

// Q3_K (110 bytes), sub-block j: w = (d * (sc - 32)) * (q - 4), a scale per 16 elements, q the 2
// bits at 2 * (j % 4) of qs's bytes with hmask's bit j as the third (set: no -4), less 4 per byte
// as Q6_K's less 32
struct VQ_Q3_K {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + (u >> 3) * 110;
        const int j = u & 7;
        unsigned int qw[8], hw[8];
        ld_words<8, 2>(b + 32 + (j >> 2) * 32, qw);
        ld_words<8, 2>(b, hw);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int v = ((qw[i] >> sh) & 0x03030303u) | (((hw[i] >> j) & 0x01010101u) << 2);
            q[i] = (int)(((v | 0x80808080u) - 0x04040404u) ^ 0x80808080u);
        }
        const float dd = ld_f16(b + 108);
        d[0] = dd * (float)(scale_q3k(b + 96, 2 * j) - 32);
        d[1] = dd * (float)(scale_q3k(b + 96, 2 * j + 1) - 32);
        *m = 0.0f;
    }
};

// Q4_K (144 bytes), sub-block j of 32: w = (d * sc) * q - dmin * mn
struct VQ_Q4_K {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + (u >> 3) * 144;
        const int j = u & 7;
        unsigned int qw[8];
        ld_words<8, 16>(b + 16 + (j >> 1) * 32, qw);
        const int sh = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)((qw[i] >> sh) & 0x0f0f0f0fu);
        k4_scale_min(b, j, d, m);
    }
};

// Q5_K (176 bytes): Q4_K's with the 5th bits in qh (bit j of byte l)
struct VQ_Q5_K {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + (u >> 3) * 176;
        const int j = u & 7;
        unsigned int qw[8], hw[8];
        ld_words<8, 16>(b + 16, hw);
        ld_words<8, 16>(b + 48 + (j >> 1) * 32, qw);
        const int sh = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)(((qw[i] >> sh) & 0x0f0f0f0fu) | (((hw[i] >> j) & 0x01010101u) << 4));
        k4_scale_min(b, j, d, m);
    }
};

// Q6_K (210 bytes): w = (d * sc) * (q - 32), a scale per 16 elements; q - 32 per byte as
// ((q | 0x80) - 0x20) ^ 0x80 (q <= 63: no borrow crosses a byte)
struct VQ_Q6_K {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + (u >> 3) * 210;
        const int j = u & 7;
        const int a = j >> 2, k = j & 3;
        unsigned int lw[8], hw[8];
        ld_words<8, 2>(b + 64 * a + 32 * (k & 1), lw);
        ld_words<8, 2>(b + 128 + 32 * a, hw);
        const int shl = 4 * (k >> 1), shh = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int v = ((lw[i] >> shl) & 0x0f0f0f0fu) | (((hw[i] >> shh) & 0x03030303u) << 4);
            q[i] = (int)(((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u);
        }
        const float dd = ld_f16(b + 208);
        d[0] = dd * (float)(signed char)b[192 + 2 * j];
        d[1] = dd * (float)(signed char)b[193 + 2 * j];
        *m = 0.0f;
    }
};

// 4 bytes of 4-bit indices (0..15) -> the int8 values of a 16-entry grid t (4 words, entries
// 4w .. 4w+3 in word w, little-endian): two __byte_perm lookups of 8 entries, picked per byte by
// the index's bit 3 (ggml-cuda's get_int_from_table_16)
__device__ __forceinline__ int grid16(unsigned int q4, unsigned int t0, unsigned int t1, unsigned int t2,
                                      unsigned int t3) {
    const unsigned int v = q4 & 0x07070707u;
    const unsigned int x = v | (v >> 4);  // the four 3-bit indices as selector nibbles
    const unsigned int sel = (x & 0xffu) | ((x >> 8) & 0xff00u);
    const unsigned int lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
    const unsigned int m = ((q4 >> 3) & 0x01010101u) * 0xffu;
    return (int)((lo & ~m) | (hi & m));
}

// kvalues_iq4nl and kvalues_mxfp4 (ggml-common.h; iquants.cu's iq4nl_value / mxfp4_value) as int8
// bytes, four a word
#define LP_IQ4NL_GRID 0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u
#define LP_MXFP4_GRID 0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu

// IQ4_NL (18 bytes): w = d * kvalues[q], low nibbles elements 0..15
struct VQ_IQ4_NL {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + u * 18;
        unsigned int qw[4];
        ld_words<4, 2>(b + 2, qw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = grid16(qw[i] & 0x0f0f0f0fu, LP_IQ4NL_GRID);
            q[4 + i] = grid16((qw[i] >> 4) & 0x0f0f0f0fu, LP_IQ4NL_GRID);
        }
        d[0] = d[1] = ld_f16(b);
        *m = 0.0f;
    }
};

// IQ4_XS (136 bytes), sub-block j: w = (d * (scale - 32)) * kvalues[q]
struct VQ_IQ4_XS {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + (u >> 3) * 136;
        const int j = u & 7;
        const int ls = ((b[4 + j / 2] >> 4 * (j % 2)) & 15) | (((ld_u16(b + 2) >> 2 * j) & 3) << 4);
        unsigned int qw[4];
        ld_words<4, 4>(b + 8 + 16 * j, qw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = grid16(qw[i] & 0x0f0f0f0fu, LP_IQ4NL_GRID);
            q[4 + i] = grid16((qw[i] >> 4) & 0x0f0f0f0fu, LP_IQ4NL_GRID);
        }
        d[0] = d[1] = ld_f16(b) * (float)(ls - 32);
        *m = 0.0f;
    }
};

// MXFP4 (17 bytes, so byte loads): w = 2^(e - 128) * kvalues[q] (the grid doubled, the scale halved)
struct VQ_MXFP4 {
    static __device__ __forceinline__ void unit(const u8* row, int u, int* q, float* d, float* m) {
        const u8* b = row + u * 17;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int w = ld_u32(b + 1 + 4 * i);
            q[i] = grid16(w & 0x0f0f0f0fu, LP_MXFP4_GRID);
            q[4 + i] = grid16((w >> 4) & 0x0f0f0f0fu, LP_MXFP4_GRID);
        }
        d[0] = d[1] = e8m0_half(b[0]);
        *m = 0.0f;
    }
};

// x (n_tok rows of n_in floats, sx apart) -> the q8_1 copy (layout above). One thread a value, a
// warp a block; n_in a multiple of 32, so no warp straddles two blocks.
extern "C" __global__ void __launch_bounds__(256)
    quantize_q8_1(const float* __restrict__ x, long long sx, signed char* __restrict__ q, float* __restrict__ ds,
                  int n_in, int n_tok) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)n_tok * n_in) return;  // uniform per warp
    const long long t = g / n_in;
    q8_1_store(x[t * sx + (g - t * n_in)], g, q, ds);
}

// unit u of a row times token t's block u of the copy
template <typename VQ>
__device__ __forceinline__ float dot_unit_q8(const int* q, const float* d, const float* m, const int* __restrict__ xq,
                                             const float* __restrict__ xds, long long blk) {
    const uint4* yp = reinterpret_cast<const uint4*>(xq) + 2 * blk;
    const uint4 lo = __ldg(yp), hi = __ldg(yp + 1);
    const int y[8] = {(int)lo.x, (int)lo.y, (int)lo.z, (int)lo.w, (int)hi.x, (int)hi.y, (int)hi.z, (int)hi.w};
    const float2 s = __ldg(reinterpret_cast<const float2*>(xds) + blk);
    int s0, s1;
    dot_q8(q, y, &s0, &s1);
    if (vq_half_mins<VQ>::value) {  // the halves' sums of the quants, for their own offsets
        const int ones[8] = {0x01010101, 0x01010101, 0x01010101, 0x01010101,
                             0x01010101, 0x01010101, 0x01010101, 0x01010101};
        int h0, h1;
        dot_q8(ones, y, &h0, &h1);
        return s.x * (d[0] * (float)s0 + d[1] * (float)s1 + m[0] * (float)h0 + m[1] * (float)h1);
    }
    return s.x * (d[0] * (float)s0 + d[1] * (float)s1) + m[0] * s.y;
}

// One row of W times n_tok rows of the q8_1 copy, token t's the copy's row xrow(t) (common.cuh's
// row_sums: lane l takes units l, l + 32, ...)
template <typename VQ, typename XRow>
__device__ __forceinline__ float mmvq_row(const u8* __restrict__ wr, int n_units, int n_tok, const int* __restrict__ xq,
                                          const float* __restrict__ xds, XRow xrow) {
    return row_sums(n_units, n_tok, [&](int u, float (&acc)[MMV_MAX_TOK]) {
        int q[8];
        float d[2], m[2];
        VQ::unit(wr, u, q, d, m);
#pragma unroll
        for (int t = 0; t < MMV_MAX_TOK; ++t)
            if (t < n_tok) acc[t] += dot_unit_q8<VQ>(q, d, m, xq, xds, (long long)xrow(t) * n_units + u);
    });
}

#define LP_MMVQ_KERNELS(name, VQ)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 4)                                            \
        mmvq_##name(const u8* __restrict__ w, const int* __restrict__ xq, const float* __restrict__ xds, \
                    float* __restrict__ y, int n_out, int n_in, long long row_bytes, int n_tok,     \
                    const float* __restrict__ b) {                                                  \
        mmv_store(y, n_out, n_tok, b, [&](int r) {                                                  \
            return mmvq_row<VQ>(w + (long long)r * row_bytes, n_in >> 5, n_tok, xq, xds, [](int t) { return t; }); \
        });                                                                                         \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 4)                                            \
        mmvq_glu_##name(const u8* __restrict__ w, const int* __restrict__ xq, const float* __restrict__ xds, \
                        float* __restrict__ y, int n_ff, int n_in, long long row_bytes, int n_tok, int op) { \
        mmv_glu_store(y, n_ff, n_tok, op, [&](int r) {                                              \
            return mmvq_row<VQ>(w + (long long)r * row_bytes, n_in >> 5, n_tok, xq, xds, [](int t) { return t; }); \
        });                                                                                         \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 3)                                            \
        mmvq_id_##name(const u8* __restrict__ w, const u8* __restrict__ w2, long long expert_bytes,  \
                       int n_expert, const int* __restrict__ xq, const float* __restrict__ xds,     \
                       long long sxt, long long sxu, const int* __restrict__ ids, long long sid,    \
                       float* __restrict__ y, int M, int n_in, long long row_bytes, int n_tok,      \
                       int n_used, int op, const float* __restrict__ b, const float* __restrict__ b2, \
                       long long sb, float alpha, float limit) {                                    \
        mmv_id_impl(w, w2, expert_bytes, n_expert, sxt, sxu, ids, sid, y, M, row_bytes, n_tok, n_used, op, \
                    b, b2, sb, alpha, limit, [&](const u8* wr, int n, const int (&xo)[MMV_MAX_TOK]) {  \
                        return mmvq_row<VQ>(wr, n_in >> 5, n, xq, xds, [&](int t) { return xo[t]; }); \
                    });                                                                             \
    }

LP_MMVQ_KERNELS(q4_0, VQ_Q4_0)
LP_MMVQ_KERNELS(q4_1, VQ_Q4_1)
LP_MMVQ_KERNELS(q5_0, VQ_Q5_0)
LP_MMVQ_KERNELS(q5_1, VQ_Q5_1)
LP_MMVQ_KERNELS(q8_0, VQ_Q8_0)
LP_MMVQ_KERNELS(q2_k, VQ_Q2_K)
LP_MMVQ_KERNELS(q3_k, VQ_Q3_K)
LP_MMVQ_KERNELS(q4_k, VQ_Q4_K)
LP_MMVQ_KERNELS(q5_k, VQ_Q5_K)
LP_MMVQ_KERNELS(q6_k, VQ_Q6_K)
LP_MMVQ_KERNELS(iq4_nl, VQ_IQ4_NL)
LP_MMVQ_KERNELS(iq4_xs, VQ_IQ4_XS)
LP_MMVQ_KERNELS(mxfp4, VQ_MXFP4)
