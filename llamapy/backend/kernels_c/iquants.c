/* The quant types mixture-of-experts models ship in: IQ4_NL, IQ4_XS and MXFP4 (dequantization,
 * their dot products with the q8 activations, and the multi-row kernels built on them), and Q4_0's
 * products: llama.cpp's x86 builds repack Q4_0 (every matrix of a multiple of 8 rows) and run it
 * through the very kernels IQ4_NL takes, with the grid q - 8.
 *
 * ggml counterparts: ggml-common.h (block_iq4_nl, block_iq4_xs, block_mxfp4, kvalues_iq4nl,
 * kvalues_mxfp4), ggml-quants.c (dequantize_row_iq4_nl / iq4_xs / mxfp4), ggml-cpu's
 * arch/x86/quants.c (ggml_vec_dot_iq4_xs_q8_K), arch/x86/repack.cpp
 * (gemv/gemm_q4_b32_8x8_q8_0_lut_avx: the q4_0_8x8, iq4_nl_8x8 and mxfp4_8x8 kernels llama.cpp's
 * x86 builds run on these weights, every matrix of a multiple of 8 rows: decode and prompts
 * alike) and
 * tiled/tiled-kernel.cpp (its IQ4_XS prompts).
 *
 * Kernels (the file's blocks where they are mapped, no repacking): decode (1-4 tokens, a whole
 * range of rows a call) prepares the activations once and takes 8 rows a step, two a 512-bit
 * vector on AVX-512 (b32_rows8_zmm, xs_rows8_zmm), 8 or 4 on AVX2 (b32_rows8_ymm1, b32_rows4_ymm,
 * xs_rows4_ymm1),
 * the 16-entry grid looked up with one byte shuffle, the rows' block sums reduced once a block,
 * their scales gathered in general registers; prompts transpose 8 rows' decoded blocks into a
 * panel with the rows in the lanes, which every token then reads with its activation bytes
 * broadcast (no horizontal sums). With VNNI (and for Q4_0 and MXFP4 on AVX2) the grids are
 * shifted to unsigned bytes and the activations' block sums subtracted, instead of the sign trick;
 * AVX2's IQ4_NL decode puts the sign on the weights against a prepared |y|.
 *
 * Numerics (each output bit for bit what llama.cpp 0.3.36's x86 build computes):
 *   Q4_0 . Q8_0, IQ4_NL . Q8_0, MXFP4 . Q8_0 (the repacked 8x8 kernels' order): per 32-element
 *     block i the exact int32 sum S_i of kvalue * q8, acc = fmaf((float)S_i, d_w,i * d_y,i, acc)
 *     block after block, from 0: one chain per output. d_w is the f16 scale (Q4_0, IQ4_NL) or 2^(e - 128)
 *     (ggml_e8m0_to_fp32_half: MXFP4's e2m1 values are stored doubled, as integers).
 *   IQ4_XS . Q8_K (the order of llama.cpp's tiled microkernels, tiled/tiled-kernel.cpp, which run
 *     its prompts): per 256-element block the exact int32 total S_i over its 8 sub-blocks of
 *     scale_sub * (kvalues . q8), r = (float)S_i * d_w,i, acc = fmaf(r, d_y,i, acc). llama.cpp's
 *     decode (ggml_vec_dot_iq4_xs_q8_K: 8 lanes, hsum_float_8) sums in another order, so it is
 *     not batch-invariant; llamapy takes the prompt order at every batch size, as for Q3_K-Q6_K.
 * The int32 sums are exact however they are formed (maddubs pairs stay below 2 x 127 x 128), so
 * the portable bodies (scalar, fmaf) and the AVX2 / AVX-512 ones give the same bits, and so do the
 * multi-row / multi-column kernels (lp_gemv_*, lp_gemm_*: the vec_dot per output).
 * Dequantization is exact (an f16 or power-of-two scale times a small integer, IQ4_XS's d * scale
 * rounded first as ggml does): the same bits as gguf-py's.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lp_quants.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define IQ_API __attribute__((visibility("default")))
#else
#define IQ_API
#endif

typedef struct { lp_half d; uint8_t qs[16]; } block_iq4_nl;
typedef struct { lp_half d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; } block_iq4_xs;
typedef struct { uint8_t e; uint8_t qs[16]; } block_mxfp4;
_Static_assert(sizeof(block_iq4_nl) == 18, "iq4_nl");
_Static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs");
_Static_assert(sizeof(block_mxfp4) == 17, "mxfp4");

static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const int8_t kvalues_q4_0[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7}; /* q - 8 */

/* ggml_e8m0_to_fp32_half: 2^(e - 128), as float32 bits (e < 2: subnormal) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ------------------------------------------------------------------------------------------- */
/* dequantization (ggml-quants.c dequantize_row_*)                                              */

static void deq_iq4_nl(const void *vx, float *y, int64_t nb) {
    const block_iq4_nl *x = vx;
    for (int64_t i = 0; i < nb; i++, y += 32) {
        const float d = lp_h2f(x[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)kvalues_iq4nl[x[i].qs[j] & 15];
            y[j + 16] = d * (float)kvalues_iq4nl[x[i].qs[j] >> 4];
        }
    }
}

static void deq_mxfp4(const void *vx, float *y, int64_t nb) {
    const block_mxfp4 *x = vx;
    for (int64_t i = 0; i < nb; i++, y += 32) {
        const float d = e8m0_half(x[i].e);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)kvalues_mxfp4[x[i].qs[j] & 15];
            y[j + 16] = d * (float)kvalues_mxfp4[x[i].qs[j] >> 4];
        }
    }
}

/* IQ4_XS sub-block ib's scale (6 bits: 4 in scales_l, 2 in scales_h), minus 32 */
static inline int iq4_xs_scale(const block_iq4_xs *b, int ib) {
    return (((b->scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((b->scales_h >> 2 * ib) & 3) << 4)) - 32;
}

static void deq_iq4_xs(const void *vx, float *y, int64_t nb) {
    const block_iq4_xs *x = vx;
    for (int64_t i = 0; i < nb; i++) {
        const float d = lp_h2f(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++, y += 32) {
            const float dl = d * (float)iq4_xs_scale(&x[i], ib);
            const uint8_t *qs = x[i].qs + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * (float)kvalues_iq4nl[qs[j] & 15];
                y[j + 16] = dl * (float)kvalues_iq4nl[qs[j] >> 4];
            }
        }
    }
}

/* n_rows rows of `type` (row_bytes apart, n_in elements each) -> float32 rows ld_out apart;
 * 0, or -1 for a type this file does not know or a width not a multiple of its block */
IQ_API int lp_dequantize_rows(int type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in, float *out,
                              int64_t ld_out) {
    void (*fn)(const void *, float *, int64_t);
    int64_t blck;
    switch (type) {
    case LP_TYPE_IQ4_NL: fn = deq_iq4_nl, blck = 32; break;
    case LP_TYPE_MXFP4: fn = deq_mxfp4, blck = 32; break;
    case LP_TYPE_IQ4_XS: fn = deq_iq4_xs, blck = QK_K; break;
    default: return -1;
    }
    if (n_in % blck) return -1;
    for (int64_t r = 0; r < n_rows; r++) fn((const uint8_t *)w + r * row_bytes, out + r * ld_out, n_in / blck);
    return 0;
}

/* The multi-row / multi-column entry points (lp_gemm_*, lp_gemv_*) are in the SIMD builds only:
 * the portable library has none, as for the other types (qmatmul.py takes float32 tiles + sgemm
 * for its prompts, qmatmul.c a vec_dot per output). */

/* ------------------------------------------------------------------------------------------- */
/* Q4_0, IQ4_NL and MXFP4 against Q8_0: 32-element blocks of 16 nibble bytes under one scale    */

/* The grids shifted to unsigned bytes, for u8 x s8 products without the sign trick:
 * sum((v + off) * y) - off * sum(y) = sum(v * y), exactly. Q4_0 (off 8, at most 15) and MXFP4
 * (off 12, at most 24): maddubs' int16 pairs stay below 2 x 24 x 128, so AVX2 too, and g16 of them
 * (g16 x 2 x max x 128 < 2^15) can be summed in int16 before one madd; IQ4_NL (off 128) only with
 * VNNI (its pairs would saturate). */
static const uint8_t ulut_q4_0[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const uint8_t ulut_mxfp4[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
static const uint8_t ulut_iq4nl[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

typedef struct {
    int bsize, qoff;      /* block bytes, offset of its 16 quant bytes */
    const int8_t *lut;    /* nibble -> int8 */
    int e8m0;             /* scale: 1 an E8M0 byte (MXFP4), 0 an f16 (IQ4_NL, Q4_0) */
    int uoff;             /* the unsigned grid: ulut = lut + uoff */
    const uint8_t *ulut;
    int g16;              /* maddubs results summed in int16 before a madd; 0: ulut does not fit maddubs */
} b32_kind;

static const b32_kind K_Q4_0 = {sizeof(block_q4_0), 2, kvalues_q4_0, 0, 8, ulut_q4_0, 8};
static const b32_kind K_IQ4_NL = {sizeof(block_iq4_nl), 2, kvalues_iq4nl, 0, 128, ulut_iq4nl, 0};
static const b32_kind K_MXFP4 = {sizeof(block_mxfp4), 1, kvalues_mxfp4, 1, 12, ulut_mxfp4, 4};

static inline float b32_scale(const b32_kind *k, const uint8_t *blk) {
    if (k->e8m0) return e8m0_half(blk[0]);
    lp_half h;
    memcpy(&h, blk, sizeof h);
    return lp_h2f(h);
}

static inline int b32_isum_scalar(const b32_kind *k, const uint8_t *qs, const int8_t *y) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += k->lut[qs[j] & 15] * y[j] + k->lut[qs[j] >> 4] * y[j + 16];
    return s;
}

#if defined(__AVX2__)
/* 16 nibble bytes -> the block's 32 int8 values in element order (low nibbles, then high) */
static inline __m256i b32_values(__m128i lut, const uint8_t *qs) {
    /* the 16 bytes in both halves (a load, no shuffle), the high half shifted: one shuffle for all
     * 32 values (the shuffle port bounds the decode kernels) */
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i n = _mm256_and_si256(_mm256_blend_epi32(b, _mm256_srli_epi16(b, 4), 0xf0), _mm256_set1_epi8(0x0f));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(lut), n);
}

/* 8 int32 partial sums of w[i] * y[i], both signed bytes (|w[i]| <= 127) */
static inline __m256i dot8_s8(__m256i w, __m256i y) {
    const __m256i u = _mm256_sign_epi8(w, w), s = _mm256_sign_epi8(y, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 8 int32 partial sums of u[i] * y[i] (u unsigned, y signed bytes; without VNNI u[i] <= 127 or
 * pairs below 2^15: maddubs saturates its int16 pairs) */
static inline __m256i dot8_u8s8(__m256i u, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, y);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
#endif
}

/* acc + the 8 int32 partial sums of u[i] * y[i] (as dot8_u8s8) */
static inline __m256i dot8_u8s8_acc(__m256i acc, __m256i u, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, y);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1)));
#endif
}

static inline int hsum_i32x8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

#endif

/* one row against nc activation rows (x_bytes apart): s[c * ld_s] = the chain of fmaf over blocks */
static void b32_row(const b32_kind *k, int nb, float *s, int64_t ld_s, const uint8_t *w, const uint8_t *x,
                    int64_t x_bytes, int nc) {
    for (int c = 0; c < nc; c++) {
        const block_q8_0 *y = (const block_q8_0 *)(x + c * x_bytes);
        float acc = 0.0f;
        for (int i = 0; i < nb; i++) {
            const uint8_t *blk = w + (int64_t)i * k->bsize;
#if defined(__AVX2__)
            const __m128i lut = _mm_loadu_si128((const __m128i *)k->lut);
            const int S = hsum_i32x8(dot8_s8(b32_values(lut, blk + k->qoff), _mm256_loadu_si256((const __m256i *)y[i].qs)));
#else
            const int S = b32_isum_scalar(k, blk + k->qoff, y[i].qs);
#endif
            acc = fmaf((float)S, b32_scale(k, blk) * lp_h2f(y[i].d), acc);
        }
        s[c * ld_s] = acc;
    }
}

#if defined(__AVX2__)
/* the scales of the blocks at blk, blk + row_bytes, ... (8 rows) as floats: the same bits as
 * b32_scale (F16C's conversion is exact; E8M0 as bits, e < 2 the subnormal 0x00200000 << e).
 * The 8 fields are gathered in general registers and moved to a vector at once (8 element
 * inserts, or 8 stores and a reload, loaded the decode kernel's shuffle port or stalled it). */
static inline __m256 b32_scales8p(const b32_kind *k, const uint8_t *const row[8]) {
    if (k->e8m0) {
        uint64_t e8 = 0;
        for (int r = 0; r < 8; r++) e8 |= (uint64_t)row[r][0] << 8 * r;
        /* (e - 1) << 23, or for e < 2 (that is 0 or negative) the subnormal 0x00400000 >> (1 - e)
         * (a shift by a negative count, as unsigned, gives 0): the larger as signed */
        const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)e8));
        const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i small = _mm256_srlv_epi32(_mm256_set1_epi32(0x00400000), _mm256_sub_epi32(_mm256_set1_epi32(1), e));
        return _mm256_castsi256_ps(_mm256_max_epi32(big, small));
    }
    uint16_t h[8];
    for (int r = 0; r < 8; r++) memcpy(&h[r], row[r], 2);
    uint64_t lo = h[0] | (uint64_t)h[1] << 16 | (uint64_t)h[2] << 32 | (uint64_t)h[3] << 48;
    uint64_t hi = h[4] | (uint64_t)h[5] << 16 | (uint64_t)h[6] << 32 | (uint64_t)h[7] << 48;
    __asm__("" : "+r"(lo), "+r"(hi)); /* (kept in general registers: gcc's vectorized packing costs shuffles) */
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo));
}

static inline __m256 b32_scales8(const b32_kind *k, const uint8_t *blk, int64_t row_bytes) {
    const uint8_t *row[8];
    for (int r = 0; r < 8; r++) row[r] = blk + r * row_bytes;
    return b32_scales8p(k, row);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* AVX-512 decode (1-4 tokens): two rows a 512-bit vector, rows r and r + 4, on the unsigned grids
 * through dpbusd. Each vector is [a 0-15, b 0-15, a 16-31, b 16-31] (a broadcast load, a masked
 * one, the upper half's nibbles shifted: one shuffle, the lookup, for 64 values); the activation
 * blocks are prepared once a call in that order, with the grid's offset correction (-off x the
 * block's quant sum) in the two rows' first lanes, where dpbusd starts, so the 8 rows' exact
 * block sums come out of one reduction (7 shuffles). */
#define B32_ZMM 1
#define B32_ZMM_COLS 4     /* up to this many columns (the panel's transposes cost more below) */
#define B32_PREP_STACK 512 /* prepared blocks (128 bytes each) kept on the stack; more: malloc */

/* rows a and b's block values on the unsigned grid `lut` (its 16 entries in each 128-bit lane) */
static inline __m512i b32_values2(__m512i lut, const uint8_t *qa, const uint8_t *qb) {
    __m512i z = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qa)), 0xF0F0,
                                            _mm_loadu_si128((const __m128i *)qb));
    z = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4), _mm512_set1_epi8(0x0f));
    return _mm512_shuffle_epi8(lut, z);
}

/* one q8_0 block prepared for b32_values2's order: p[0] its quants [0-15, 0-15, 16-31, 16-31],
 * p[1] -off x their sum in int32 lanes 0 and 4 (rows a and b), 0 elsewhere; *yd its scale */
static inline void b32_prep(int off, const block_q8_0 *y, __m512i *p, float *yd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)y->qs);
    p[0] = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(v));
    p[1] = _mm512_maskz_set1_epi32(0x0011, -off * hsum_i32x8(dot8_u8s8(_mm256_set1_epi8(1), v)));
    *yd = _cvtsh_ss(y->d);
}

/* p[r] = dpbusd of rows r and r + 4 -> the 8 rows' totals, in order: per 128-bit lane the four
 * vectors' lane sums [p0, p1, p2, p3] (lanes 0 and 2: rows 0-3, lanes 1 and 3: rows 4-7) */
static inline __m256i hsum8_rows_zmm(const __m512i p[4]) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    return _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
}

/* 8 rows against NC prepared columns (column c's block i at prep[2 (c nb + i)], its scale at
 * yd[c nb + i]): per output the vec_dot's chain, acc = fmaf(S_i, d_w d_y, acc) */
static inline __attribute__((always_inline)) void b32_rows8_zmm(const b32_kind *k, const int NC, int nb, float *s,
                                                                int64_t ld_s, const uint8_t *w, int64_t row_bytes,
                                                                const __m512i *prep, const float *yd) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k->ulut));
    __m256 acc[B32_ZMM_COLS];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 8 * row_bytes, nb);
    /* rows 0-3 at p0 + {0, rb, 2 rb, rb3}, rows 4-7 at p4 + the same: four registers for the
     * eight rows' addresses (one a row spilled them) */
    const uint8_t *p0 = w, *p4 = w + 4 * row_bytes;
    const int64_t rb = row_bytes, rb3 = 3 * row_bytes;
    for (int i = 0; i < nb; i++, p0 += k->bsize, p4 += k->bsize) {
        lp_pf_step(&pf, i);
        const uint8_t *row[8] = {p0, p0 + rb, p0 + 2 * rb, p0 + rb3, p4, p4 + rb, p4 + 2 * rb, p4 + rb3};
        const __m256 dwv = b32_scales8p(k, row);
        __m512i wz[4];
        for (int r = 0; r < 4; r++) wz[r] = b32_values2(lut, row[r] + k->qoff, row[r + 4] + k->qoff);
        for (int c = 0; c < NC; c++) {
            const __m512i *pc = prep + 2 * ((int64_t)c * nb + i);
            __m512i pz[4];
            for (int r = 0; r < 4; r++) pz[r] = _mm512_dpbusd_epi32(pc[1], wz[r], pc[0]);
            const __m256 sc = _mm256_mul_ps(dwv, _mm256_set1_ps(yd[(int64_t)c * nb + i]));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_rows_zmm(pz)), sc, acc[c]);
        }
    }
    for (int c = 0; c < NC; c++) {
        float o[8];
        _mm256_storeu_ps(o, acc[c]);
        for (int r = 0; r < 8; r++) s[c * ld_s + r] = o[r];
    }
}

/* rows 0 .. 8 floor(nr / 8) against nc <= B32_ZMM_COLS columns (b32_rows8_zmm); the rows done (0 when there
 * is no memory for the prepared columns) */
static inline __attribute__((always_inline)) int b32_gemv_zmm(const b32_kind *k, int nb, float *s, int64_t ld_s, const uint8_t *w, int64_t row_bytes, int nr,
                        const uint8_t *x, int64_t x_bytes, int nc) {
    const int off = k->uoff;
    const int64_t n = (int64_t)nc * nb;
    __m512i stack[2 * B32_PREP_STACK];
    float yd_stack[B32_PREP_STACK];
    __m512i *prep = n <= B32_PREP_STACK ? stack : aligned_alloc(64, (size_t)n * 2 * sizeof(__m512i));
    float *yd = n <= B32_PREP_STACK ? yd_stack : malloc((size_t)n * sizeof(float));
    int r = 0;
    if (prep != NULL && yd != NULL) {
        for (int c = 0; c < nc; c++)
            for (int i = 0; i < nb; i++)
                b32_prep(off, (const block_q8_0 *)(x + c * x_bytes) + i, prep + 2 * ((int64_t)c * nb + i),
                         yd + (int64_t)c * nb + i);
        for (r = 0; r + 8 <= nr; r += 8) {
            const uint8_t *wr = w + r * row_bytes;
            if (nc == 1) b32_rows8_zmm(k, 1, nb, s + r, ld_s, wr, row_bytes, prep, yd);
            else if (nc == 2) b32_rows8_zmm(k, 2, nb, s + r, ld_s, wr, row_bytes, prep, yd);
            else if (nc == 3) b32_rows8_zmm(k, 3, nb, s + r, ld_s, wr, row_bytes, prep, yd);
            else b32_rows8_zmm(k, 4, nb, s + r, ld_s, wr, row_bytes, prep, yd);
        }
    }
    if (prep != stack) free(prep);
    if (yd != yd_stack) free(yd);
    return r;
}
#endif

#endif

#if defined(__AVX2__)
/* Prompts: 8 rows against any number of columns with the rows in the lanes. Each block's 8 value
 * vectors are transposed once into a panel of 8 vectors of 4-byte groups (vector g: values
 * 4g..4g+3 of every row), so a column's 8 block sums are 8 products with its activation bytes
 * broadcast, no horizontal sums; the panel (B32_PANEL_BLOCKS blocks at a time, L1-sized) serves
 * every column, each column's chain carried from one panel to the next. */
#define B32_PANEL_BLOCKS 32
#define B32_PANEL_MIN 4 /* columns from which the panel beats rows8's horizontal sums */
#define B32_YS_STACK 2048 /* offset sums on the stack (the decode kernels); more: malloc */

static inline void transpose8_i32(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int g = 0; g < 4; g++) {
        v[g] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x20);
        v[g + 4] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x31);
    }
}

/* off * (the sum of each activation block's 32 quants), column c's block i at [c * nb + i]: the
 * shifted grids' correction, made once per call for every row group */
static void b32_ysums(int off, int nb, const uint8_t *x, int64_t x_bytes, int nc, int32_t *ys) {
    for (int c = 0; c < nc; c++) {
        const block_q8_0 *y = (const block_q8_0 *)(x + c * x_bytes);
        for (int i = 0; i < nb; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)y[i].qs);
            ys[(int64_t)c * nb + i] = off * hsum_i32x8(dot8_u8s8(_mm256_set1_epi8(1), v));
        }
    }
}

/* One column's 8 row totals of block i on the unsigned grid, less its offset sum ys: the 8 products
 * summed k->g16 at a time in int16 before one madd (without VNNI: multiplies are what AVX2's
 * prompts are bound by, Zen 2 issuing maddubs and madd on one pipe), else a madd (or dpbusd) each */
static inline __attribute__((always_inline)) __m256i b32_panel_utot(const b32_kind *k, const __m256i *pi,
                                                                     const int32_t *q, int32_t ys) {
    __m256i tot = _mm256_set1_epi32(-ys);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    for (int g = 0; g < 8; g++) tot = dot8_u8s8_acc(tot, pi[g], _mm256_set1_epi32(q[g]));
#else
    for (int g0 = 0; g0 < 8; g0 += k->g16) {
        __m256i h = _mm256_maddubs_epi16(pi[g0], _mm256_set1_epi32(q[g0]));
        for (int g = g0 + 1; g < g0 + k->g16; g++) h = _mm256_add_epi16(h, _mm256_maddubs_epi16(pi[g], _mm256_set1_epi32(q[g])));
        tot = _mm256_add_epi32(tot, _mm256_madd_epi16(h, _mm256_set1_epi16(1)));
    }
#endif
    return tot;
}

static inline __attribute__((always_inline)) void b32_panel8(const b32_kind *k, int off, const int32_t *ys, int nb,
                                                             float *s, int64_t ld_s, const uint8_t *w, int64_t row_bytes,
                                                             const uint8_t *x, int64_t x_bytes, int nc) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)(off == 0 ? (const void *)k->lut : (const void *)k->ulut));
    __m256i panel[B32_PANEL_BLOCKS][8];
    __m256 dw[B32_PANEL_BLOCKS];
    __m256 acc[LP_GEMM_COLS_K];
    for (int c = 0; c < nc; c++) acc[c] = _mm256_setzero_ps();
    for (int i0 = 0; i0 < nb; i0 += B32_PANEL_BLOCKS) {
        const int m = nb - i0 < B32_PANEL_BLOCKS ? nb - i0 : B32_PANEL_BLOCKS;
        for (int i = 0; i < m; i++) {
            const uint8_t *blk = w + (int64_t)(i0 + i) * k->bsize;
            for (int r = 0; r < 8; r++) panel[i][r] = b32_values(lut, blk + r * row_bytes + k->qoff);
            transpose8_i32(panel[i]);
            dw[i] = b32_scales8(k, blk, row_bytes);
        }
        for (int c = 0; c < nc; c++) {
            const block_q8_0 *y = (const block_q8_0 *)(x + c * x_bytes) + i0;
            __m256 a = acc[c];
            for (int i = 0; i < m; i++) {
                const int32_t *q = (const int32_t *)y[i].qs;
                __m256i tot;
                if (off == 0) {
                    tot = _mm256_setzero_si256();
                    for (int g = 0; g < 8; g++) tot = _mm256_add_epi32(tot, dot8_s8(panel[i][g], _mm256_set1_epi32(q[g])));
                } else {
                    tot = b32_panel_utot(k, panel[i], q, ys[(int64_t)c * nb + i0 + i]);
                }
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(dw[i], _mm256_set1_ps(_cvtsh_ss(y[i].d))), a);
            }
            acc[c] = a;
        }
    }
    for (int c = 0; c < nc; c++) {
        float o[8];
        _mm256_storeu_ps(o, acc[c]);
        for (int r = 0; r < 8; r++) s[c * ld_s + r] = o[r];
    }
}

#if !defined(B32_ZMM)
/* AVX2 decode (1-4 tokens): 4 rows at a time, each row's block values decoded once and multiplied
 * by every column at once (the 4 x NC partial-sum vectors stay in the 16 registers: 8 rows x
 * several columns spilled), the 4 rows' block sums by one reduction (6 shuffles; Q4_0 and MXFP4:
 * hadds of the int16 pairs and one madd), their scales gathered in a general register. IQ4_NL
 * through the sign trick (its grid does not fit maddubs unsigned), Q4_0 and MXFP4 on their
 * unsigned grids less the prepared offset sums. 4 columns here, not the panel: the 1B shape
 * --pure Q4_0, 2 threads, pp4 43.2 -> 52.7 tok/s (pp3 43.3 -> 47.5 with the hadds). */
#define B32_YMM_COLS 4

/* the 4 vectors' lane totals, in order: [v0, v1, v2, v3] */
static inline __m128i hsum4_rows(const __m256i v[4]) {
    const __m256i s0 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
    const __m256i s1 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
    const __m256i t = _mm256_add_epi32(_mm256_blend_epi32(s0, s1, 0xCC), _mm256_alignr_epi8(s1, s0, 8));
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

/* the 4 rows' totals from their maddubs results (int16 pairs), [v0, v1, v2, v3]: two rounds of
 * hadd sum 4 pairs of a row in int16 (the kinds with g16 >= 4), one madd the rest — 1 multiply
 * instead of hsum4_rows' 4 madds before it */
static inline __m128i hsum4_rows_i16(const __m256i v[4]) {
    const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(v[0], v[1]), _mm256_hadd_epi16(v[2], v[3]));
    const __m256i m = _mm256_madd_epi16(h, _mm256_set1_epi16(1)); /* per 128-bit lane [v0 v1 v2 v3] */
    return _mm_add_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
}

/* the scales of 4 rows' blocks (row[0..3]) as floats (b32_scales8p's, 4 rows) */
static inline __m128 b32_scales4p(const b32_kind *k, const uint8_t *const row[4]) {
    if (k->e8m0) {
        uint32_t e4 = 0;
        for (int r = 0; r < 4; r++) e4 |= (uint32_t)row[r][0] << 8 * r;
        const __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)e4)); /* (b32_scales8p's) */
        const __m128i big = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
        const __m128i small = _mm_srlv_epi32(_mm_set1_epi32(0x00400000), _mm_sub_epi32(_mm_set1_epi32(1), e));
        return _mm_castsi128_ps(_mm_max_epi32(big, small));
    }
    uint16_t h[4];
    for (int r = 0; r < 4; r++) memcpy(&h[r], row[r], 2);
    uint64_t lo = h[0] | (uint64_t)h[1] << 16 | (uint64_t)h[2] << 32 | (uint64_t)h[3] << 48;
    __asm__("" : "+r"(lo)); /* (b32_scales8p's) */
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)lo));
}

/* 4 rows against NC columns (x_bytes apart; ys: the unsigned grid's offset sums, column c's block
 * i at [c nb + i]): per output the vec_dot's chain */
static inline __attribute__((always_inline)) void b32_rows4_ymm(const b32_kind *k, const int NC, const int32_t *ys,
                                                                int nb, float *s, int64_t ld_s, const uint8_t *w,
                                                                int64_t row_bytes, const uint8_t *x, int64_t x_bytes) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)(k->g16 ? (const void *)k->ulut : (const void *)k->lut));
    __m128 acc[B32_YMM_COLS];
    for (int c = 0; c < NC; c++) acc[c] = _mm_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 4 * row_bytes, nb);
    const uint8_t *p0 = w;
    const int64_t rb = row_bytes, rb3 = 3 * row_bytes;
    for (int i = 0; i < nb; i++, p0 += k->bsize) {
        lp_pf_step(&pf, i);
        const uint8_t *row[4] = {p0, p0 + rb, p0 + 2 * rb, p0 + rb3};
        const __m128 dw = b32_scales4p(k, row);
        __m256i p[B32_YMM_COLS][4];
        for (int r = 0; r < 4; r++) {
            const __m256i wv = b32_values(lut, row[r] + k->qoff);
            for (int c = 0; c < NC; c++) {
                const __m256i yv = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)(x + c * x_bytes) + i)->qs);
                p[c][r] = k->g16 >= 4 ? _mm256_maddubs_epi16(wv, yv) : k->g16 ? dot8_u8s8(wv, yv) : dot8_s8(wv, yv);
            }
        }
        for (int c = 0; c < NC; c++) {
            const block_q8_0 *y = (const block_q8_0 *)(x + c * x_bytes) + i;
            __m128i tot = k->g16 >= 4 ? hsum4_rows_i16(p[c]) : hsum4_rows(p[c]);
            if (k->g16) tot = _mm_sub_epi32(tot, _mm_set1_epi32(ys[(int64_t)c * nb + i]));
            acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(tot), _mm_mul_ps(dw, _mm_set1_ps(_cvtsh_ss(y->d))), acc[c]);
        }
    }
    for (int c = 0; c < NC; c++) _mm_storeu_ps(s + c * ld_s, acc[c]);
}

/* the 8 vectors' lane totals, in order (v[r]'s total in lane r): 11 shuffles (unpacks, then an
 * alignr and a lane swap, each with a blend) */
static inline __m256i hsum8_rows(const __m256i v[8]) {
    __m256i s[4], t[2];
    for (int k = 0; k < 4; k++) /* [v2k, v2k+1, v2k, v2k+1] pair sums, per 128-bit lane */
        s[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++) /* rows 4k..4k+3, per 128-bit lane */
        t[k] = _mm256_add_epi32(_mm256_blend_epi32(s[2 * k], s[2 * k + 1], 0xCC), _mm256_alignr_epi8(s[2 * k + 1], s[2 * k], 8));
    return _mm256_add_epi32(_mm256_blend_epi32(t[0], t[1], 0xF0), _mm256_permute2x128_si256(t[0], t[1], 0x21));
}

/* One token (decode proper), 8 rows at once: the 8-row reduction costs 11 shuffles where two
 * 4-row ones cost 12 and 2 more float steps (hsum4_rows_i16's hadds, 6 for 8 rows, were slower
 * here: 1024 x 2048 Q4_0, one thread, 92 -> 102 us, on the shuffle port the lookups use; with
 * 2-4 columns they win). IQ4_NL with the sign moved to the weights: sign(v, y) times |y|,
 * prepared once a call (ay), one operation a row less than the sign trick (|y| <= 127, so
 * maddubs' pairs stay below 2^15); Q4_0 and MXFP4 on their unsigned grids less ys. yd: the
 * activation scales as floats. */
static inline __attribute__((always_inline)) void b32_rows8_ymm1(const b32_kind *k, const int32_t *ys,
                                                                 const __m256i *ay, const float *yd, int nb, float *s,
                                                                 const uint8_t *w, int64_t row_bytes,
                                                                 const uint8_t *x) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)(k->g16 ? (const void *)k->ulut : (const void *)k->lut));
    __m256 acc = _mm256_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 8 * row_bytes, nb);
    const uint8_t *p0 = w, *p4 = w + 4 * row_bytes; /* (b32_rows8_zmm's addressing) */
    const int64_t rb = row_bytes, rb3 = 3 * row_bytes;
    for (int i = 0; i < nb; i++, p0 += k->bsize, p4 += k->bsize) {
        lp_pf_step(&pf, i);
        const uint8_t *row[8] = {p0, p0 + rb, p0 + 2 * rb, p0 + rb3, p4, p4 + rb, p4 + 2 * rb, p4 + rb3};
        const __m256 dwv = b32_scales8p(k, row);
        const __m256i yv = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)x + i)->qs);
        __m256i p[8];
        for (int r = 0; r < 8; r++) {
            const __m256i wv = b32_values(lut, row[r] + k->qoff);
            p[r] = k->g16 ? dot8_u8s8(wv, yv) : dot8_u8s8(_mm256_load_si256(ay + i), _mm256_sign_epi8(wv, yv));
        }
        __m256i tot = hsum8_rows(p);
        if (k->g16) tot = _mm256_sub_epi32(tot, _mm256_set1_epi32(ys[i]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(dwv, _mm256_set1_ps(yd[i])), acc);
    }
    _mm256_storeu_ps(s, acc);
}

/* rows 0 .. 4 floor(nr / 4) against nc <= B32_YMM_COLS columns; the rows done (0: no memory) */
static inline __attribute__((always_inline)) int b32_gemv_ymm(const b32_kind *k, int nb, float *s, int64_t ld_s,
                                                              const uint8_t *w, int64_t row_bytes, int nr,
                                                              const uint8_t *x, int64_t x_bytes, int nc) {
    int32_t ys_stack[B32_YS_STACK];
    int32_t *ys = NULL;
    if (k->g16) {
        ys = (int64_t)nc * nb <= B32_YS_STACK ? ys_stack : malloc((size_t)nc * (size_t)nb * sizeof(int32_t));
        if (ys == NULL) return 0;
        b32_ysums(k->uoff, nb, x, x_bytes, nc, ys);
    }
    int r = 0;
    if (nc == 1 && nb <= B32_YS_STACK) {
        __m256i ay[B32_YS_STACK];
        float yd[B32_YS_STACK];
        for (int i = 0; i < nb; i++) {
            const block_q8_0 *y = (const block_q8_0 *)x + i;
            ay[i] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)y->qs));
            yd[i] = _cvtsh_ss(y->d);
        }
        for (; r + 8 <= nr; r += 8) b32_rows8_ymm1(k, ys, ay, yd, nb, s + r, w + r * row_bytes, row_bytes, x);
    }
    for (; r + 4 <= nr; r += 4) {
        const uint8_t *wr = w + r * row_bytes;
        if (nc == 1) b32_rows4_ymm(k, 1, ys, nb, s + r, ld_s, wr, row_bytes, x, x_bytes);
        else if (nc == 2) b32_rows4_ymm(k, 2, ys, nb, s + r, ld_s, wr, row_bytes, x, x_bytes);
        else if (nc == 3) b32_rows4_ymm(k, 3, ys, nb, s + r, ld_s, wr, row_bytes, x, x_bytes);
        else b32_rows4_ymm(k, 4, ys, nb, s + r, ld_s, wr, row_bytes, x, x_bytes);
    }
    if (ys != ys_stack) free(ys);
    return r;
}
#endif

/* (always inlined: each kind a constant, its offsets, grouping and scale decoding folded in) */
static inline __attribute__((always_inline)) void b32_gemm(const b32_kind *k, int n, float *s, int64_t ld_s,
                                                           const void *vw, int64_t row_bytes, int nr,
                                                           const void *vx, int64_t x_bytes, int nc) {
    const uint8_t *w = vw, *x = vx;
    const int nb = n / 32;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    int off = k->uoff; /* the unsigned grids and dpbusd for all */
#else
    int off = k->g16 ? k->uoff : 0; /* the unsigned grid and maddubs where it fits, else the sign trick */
#endif
    int r = 0;
#if defined(B32_ZMM)
    if (nc <= B32_ZMM_COLS) {
        r = b32_gemv_zmm(k, nb, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
        off = -1; /* (the rows left: b32_row) */
    }
#else
    if (nc <= B32_YMM_COLS) {
        r = b32_gemv_ymm(k, nb, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
        off = -1;
    }
#endif
    int32_t *ys = off > 0 && nr >= 8 ? malloc((size_t)nc * (size_t)nb * sizeof(int32_t)) : NULL;
    if (ys != NULL) b32_ysums(off, nb, x, x_bytes, nc, ys);
    if (off == 0 || ys != NULL) { /* (no memory for the sums: every row through b32_row) */
        for (int c0 = 0; c0 < nc; c0 += LP_GEMM_COLS_K) { /* (nc >= B32_PANEL_MIN here) */
            const int m = nc - c0 < LP_GEMM_COLS_K ? nc - c0 : LP_GEMM_COLS_K;
            for (r = 0; r + 8 <= nr; r += 8)
                b32_panel8(k, off, ys == NULL ? NULL : ys + (int64_t)c0 * nb, nb, s + c0 * ld_s + r, ld_s,
                           w + r * row_bytes, row_bytes, x + c0 * x_bytes, x_bytes, m);
        }
    }
    free(ys);
    for (; r < nr; r++)
        for (int c0 = 0; c0 < nc; c0 += LP_GEMM_COLS) {
            const int m = nc - c0 < LP_GEMM_COLS ? nc - c0 : LP_GEMM_COLS;
            b32_row(k, nb, s + c0 * ld_s + r, ld_s, w + r * row_bytes, x + c0 * x_bytes, x_bytes, m);
        }
}
#endif

IQ_API void lp_vec_dot_q4_0_q8_0(int n, float *s, const void *vx, const void *vy) {
    b32_row(&K_Q4_0, n / 32, s, 0, vx, vy, 0, 1);
}

IQ_API void lp_vec_dot_iq4_nl_q8_0(int n, float *s, const void *vx, const void *vy) {
    b32_row(&K_IQ4_NL, n / 32, s, 0, vx, vy, 0, 1);
}

IQ_API void lp_vec_dot_mxfp4_q8_0(int n, float *s, const void *vx, const void *vy) {
    b32_row(&K_MXFP4, n / 32, s, 0, vx, vy, 0, 1);
}

#if defined(__AVX2__)
IQ_API void lp_gemm_q4_0_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                              int64_t x_bytes, int nc) {
    b32_gemm(&K_Q4_0, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

IQ_API void lp_gemv_q4_0_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x) {
    b32_gemm(&K_Q4_0, n, s, 0, w, row_bytes, nr, x, 0, 1);
}

IQ_API void lp_gemm_iq4_nl_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                                int64_t x_bytes, int nc) {
    b32_gemm(&K_IQ4_NL, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

IQ_API void lp_gemm_mxfp4_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                               int64_t x_bytes, int nc) {
    b32_gemm(&K_MXFP4, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

IQ_API void lp_gemv_iq4_nl_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x) {
    b32_gemm(&K_IQ4_NL, n, s, 0, w, row_bytes, nr, x, 0, 1);
}

IQ_API void lp_gemv_mxfp4_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x) {
    b32_gemm(&K_MXFP4, n, s, 0, w, row_bytes, nr, x, 0, 1);
}
#endif

/* ------------------------------------------------------------------------------------------- */
/* IQ4_XS against Q8_K                                                                          */

#if defined(__AVX2__)
/* the block's exact integer sum (below) in 8 int32 lanes */
static inline __m256i xs_lanes(const block_iq4_xs *b, const int8_t *q8) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)kvalues_iq4nl);
    __m256i sum = _mm256_setzero_si256();
    for (int ib = 0; ib < QK_K / 32; ib++) {
        const __m256i wv = b32_values(lut, b->qs + 16 * ib);
        const __m256i y = _mm256_loadu_si256((const __m256i *)(q8 + 32 * ib));
        const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(y, wv));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, _mm256_set1_epi16((int16_t)iq4_xs_scale(b, ib))));
    }
    return sum;
}
#endif

/* the block's exact integer sum: over its 8 sub-blocks, scale * (kvalues . q8) */
static inline int xs_total(const block_iq4_xs *b, const int8_t *q8) {
#if defined(__AVX2__)
    return hsum_i32x8(xs_lanes(b, q8));
#else
    int S = 0;
    for (int ib = 0; ib < QK_K / 32; ib++) {
        const uint8_t *qs = b->qs + 16 * ib;
        const int8_t *y = q8 + 32 * ib;
        int p = 0;
        for (int j = 0; j < 16; j++) p += kvalues_iq4nl[qs[j] & 15] * y[j] + kvalues_iq4nl[qs[j] >> 4] * y[j + 16];
        S += iq4_xs_scale(b, ib) * p;
    }
    return S;
#endif
}

IQ_API void lp_vec_dot_iq4_xs_q8_K(int n, float *s, const void *vx, const void *vy) {
    const block_iq4_xs *x = vx;
    const block_q8_K *y = vy;
    float acc = 0.0f;
    for (int i = 0; i < n / QK_K; i++) acc = fmaf((float)xs_total(&x[i], y[i].qs) * lp_h2f(x[i].d), y[i].d, acc);
    *s = acc;
}

#if defined(__AVX2__)
/* one row against nc <= LP_GEMM_COLS activation rows, each block's values decoded once */
static void xs_row(int nb, float *s, int64_t ld_s, const block_iq4_xs *x, const uint8_t *act, int64_t x_bytes, int nc) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)kvalues_iq4nl);
    float acc[LP_GEMM_COLS] = {0};
    for (int i = 0; i < nb; i++) {
        __m256i u[QK_K / 32], sg[QK_K / 32], ls[QK_K / 32];
        for (int ib = 0; ib < QK_K / 32; ib++) {
            sg[ib] = b32_values(lut, x[i].qs + 16 * ib);
            u[ib] = _mm256_sign_epi8(sg[ib], sg[ib]);
            ls[ib] = _mm256_set1_epi16((int16_t)iq4_xs_scale(&x[i], ib));
        }
        const float dx = lp_h2f(x[i].d);
        for (int c = 0; c < nc; c++) {
            const block_q8_K *y = (const block_q8_K *)(act + c * x_bytes) + i;
            __m256i sum = _mm256_setzero_si256();
            for (int ib = 0; ib < QK_K / 32; ib++) {
                const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib)), sg[ib]);
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u[ib], sy), ls[ib]));
            }
            acc[c] = fmaf((float)hsum_i32x8(sum) * dx, y->d, acc[c]);
        }
    }
    for (int c = 0; c < nc; c++) s[c * ld_s] = acc[c];
}

/* Prompts: 8 rows against any number of columns on a transposed panel, as b32_panel8, a block's
 * 8 sub-blocks each summed with the rows in the lanes, times the rows' sub-block scales */
#define XS_PANEL_BLOCKS 4

static void xs_panel8(int nb, float *s, int64_t ld_s, const uint8_t *w, int64_t row_bytes, const uint8_t *x,
                      int64_t x_bytes, int nc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const int off = 128; /* the unsigned grid: dpbusd, less q8_K's bsums */
    const __m128i lut = _mm_loadu_si128((const __m128i *)ulut_iq4nl);
#else
    const int off = 0; /* the sign trick */
    const __m128i lut = _mm_loadu_si128((const __m128i *)kvalues_iq4nl);
#endif
    __m256i panel[XS_PANEL_BLOCKS][QK_K / 32][8], ls[XS_PANEL_BLOCKS][QK_K / 32];
    __m256 dw[XS_PANEL_BLOCKS];
    float acc[LP_GEMM_COLS_K][8];
    memset(acc, 0, sizeof(float) * 8 * (size_t)nc);
    for (int i0 = 0; i0 < nb; i0 += XS_PANEL_BLOCKS) {
        const int m = nb - i0 < XS_PANEL_BLOCKS ? nb - i0 : XS_PANEL_BLOCKS;
        for (int i = 0; i < m; i++) {
            const block_iq4_xs *b[8];
            for (int r = 0; r < 8; r++) b[r] = (const block_iq4_xs *)(w + r * row_bytes) + i0 + i;
            for (int ib = 0; ib < QK_K / 32; ib++) {
                for (int r = 0; r < 8; r++) panel[i][ib][r] = b32_values(lut, b[r]->qs + 16 * ib);
                transpose8_i32(panel[i][ib]);
                ls[i][ib] = _mm256_setr_epi32(iq4_xs_scale(b[0], ib), iq4_xs_scale(b[1], ib), iq4_xs_scale(b[2], ib),
                                              iq4_xs_scale(b[3], ib), iq4_xs_scale(b[4], ib), iq4_xs_scale(b[5], ib),
                                              iq4_xs_scale(b[6], ib), iq4_xs_scale(b[7], ib));
            }
            uint16_t h[8];
            for (int r = 0; r < 8; r++) h[r] = b[r]->d;
            dw[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        }
        for (int c = 0; c < nc; c++) {
            const block_q8_K *y = (const block_q8_K *)(x + c * x_bytes) + i0;
            __m256 a = _mm256_loadu_ps(acc[c]);
            for (int i = 0; i < m; i++) {
                __m256i S = _mm256_setzero_si256();
                for (int ib = 0; ib < QK_K / 32; ib++) {
                    const int32_t *q = (const int32_t *)(y[i].qs + 32 * ib);
                    __m256i t;
                    if (off == 0) {
                        t = _mm256_setzero_si256();
                        for (int g = 0; g < 8; g++) t = _mm256_add_epi32(t, dot8_s8(panel[i][ib][g], _mm256_set1_epi32(q[g])));
                    } else {
                        t = _mm256_set1_epi32(-off * (y[i].bsums[2 * ib] + y[i].bsums[2 * ib + 1]));
                        for (int g = 0; g < 8; g++) t = dot8_u8s8_acc(t, panel[i][ib][g], _mm256_set1_epi32(q[g]));
                    }
                    S = _mm256_add_epi32(S, _mm256_mullo_epi32(t, ls[i][ib]));
                }
                a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S), dw[i]), _mm256_set1_ps(y[i].d), a);
            }
            _mm256_storeu_ps(acc[c], a);
        }
    }
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < 8; r++) s[c * ld_s + r] = acc[c][r];
}

#if defined(B32_ZMM)
/* AVX-512 IQ4_XS decode (1-4 tokens): b32_rows8_zmm's layout for each 32-element sub-block (rows r
 * and r + 4 a vector, the unsigned grid through dpbusd, the activations prepared once a call with
 * the offset correction from q8_K's bsums); each sub-block's lane sums times the two rows'
 * 6-bit scales (vpmulld: exact), summed over the block in int32 lanes and reduced once a block:
 * the vec_dot's S_i, then per row r = (float)S_i * d_w, acc = fmaf(r, d_y, acc). */
#define XS_ZMM_COLS 4

/* one q8_K block prepared: p[2 ib], p[2 ib + 1] sub-block ib's quants and correction (b32_prep's) */
static inline void xs_prep(const block_q8_K *y, __m512i *p) {
    for (int ib = 0; ib < QK_K / 32; ib++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib));
        p[2 * ib] = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(v));
        p[2 * ib + 1] = _mm512_maskz_set1_epi32(0x0011, -128 * (y->bsums[2 * ib] + y->bsums[2 * ib + 1]));
    }
}

/* blocks a and b's 8 sub-block scales (minus 32) as int32 lanes [a's 0-7 | b's 0-7] */
static inline __m512i xs_scales2(const uint8_t *a, const uint8_t *b) {
    const __m512i l = _mm512_mask_broadcastd_epi32(_mm512_broadcastd_epi32(_mm_loadu_si32(a + 4)), 0xFF00,
                                                   _mm_loadu_si32(b + 4)); /* scales_l */
    const __m512i h = _mm512_mask_broadcastd_epi32(_mm512_broadcastd_epi32(_mm_loadu_si32(a + 2)), 0xFF00,
                                                   _mm_loadu_si32(b + 2)); /* scales_h (low 16 bits) */
    const __m512i sl = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi32(l, sl), _mm512_set1_epi32(15));
    const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, sh), _mm512_set1_epi32(3)), 4);
    return _mm512_sub_epi32(_mm512_or_si512(lo, hi), _mm512_set1_epi32(32));
}

static inline __attribute__((always_inline)) void xs_rows8_zmm(const int NC, int nb, float *s, int64_t ld_s,
                                                               const uint8_t *w, int64_t row_bytes,
                                                               const __m512i *prep, const float *yd) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)ulut_iq4nl));
    __m256 acc[XS_ZMM_COLS];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 8 * row_bytes, nb);
    const uint8_t *p0 = w, *p4 = w + 4 * row_bytes; /* (b32_rows8_zmm's addressing) */
    const int64_t rb = row_bytes, rb3 = 3 * row_bytes;
    for (int i = 0; i < nb; i++, p0 += sizeof(block_iq4_xs), p4 += sizeof(block_iq4_xs)) {
        lp_pf_step(&pf, i);
        const uint8_t *row[8] = {p0, p0 + rb, p0 + 2 * rb, p0 + rb3, p4, p4 + rb, p4 + 2 * rb, p4 + rb3};
        __m512i sc[4], tot[XS_ZMM_COLS][4];
        for (int r = 0; r < 4; r++) sc[r] = xs_scales2(row[r], row[r + 4]);
        for (int c = 0; c < NC; c++)
            for (int r = 0; r < 4; r++) tot[c][r] = _mm512_setzero_si512();
        for (int ib = 0; ib < QK_K / 32; ib++) {
            /* sub-block ib's scale of row a in lanes 0-3 and 8-11, of row b in 4-7 and 12-15 */
            const __m512i sel = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 0, 0, 0, 0, 8, 8, 8, 8),
                                                 _mm512_set1_epi32(ib));
            for (int r = 0; r < 4; r++) {
                const __m512i wz = b32_values2(lut, row[r] + 8 + 16 * ib, row[r + 4] + 8 + 16 * ib);
                const __m512i scr = _mm512_permutexvar_epi32(sel, sc[r]);
                for (int c = 0; c < NC; c++) {
                    const __m512i *pc = prep + 2 * (((int64_t)c * nb + i) * (QK_K / 32) + ib);
                    tot[c][r] = _mm512_add_epi32(tot[c][r], _mm512_mullo_epi32(_mm512_dpbusd_epi32(pc[1], wz, pc[0]), scr));
                }
            }
        }
        const __m256 dwv = b32_scales8p(&K_IQ4_NL, row); /* the f16 d at each block's start */
        for (int c = 0; c < NC; c++) {
            const __m256 r8 = _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8_rows_zmm(tot[c])), dwv);
            acc[c] = _mm256_fmadd_ps(r8, _mm256_set1_ps(yd[(int64_t)c * nb + i]), acc[c]);
        }
    }
    for (int c = 0; c < NC; c++) {
        float o[8];
        _mm256_storeu_ps(o, acc[c]);
        for (int r = 0; r < 8; r++) s[c * ld_s + r] = o[r];
    }
}

/* rows 0 .. 8 floor(nr / 8) against nc <= XS_ZMM_COLS columns; the rows done (0: no memory) */
static int xs_gemv_zmm(int nb, float *s, int64_t ld_s, const uint8_t *w, int64_t row_bytes, int nr, const uint8_t *x,
                       int64_t x_bytes, int nc) {
    const int64_t n = (int64_t)nc * nb * (QK_K / 32);
    __m512i stack[2 * B32_PREP_STACK];
    float yd_stack[B32_PREP_STACK];
    __m512i *prep = n <= B32_PREP_STACK ? stack : aligned_alloc(64, (size_t)n * 2 * sizeof(__m512i));
    float *yd = n <= B32_PREP_STACK ? yd_stack : malloc((size_t)nc * (size_t)nb * sizeof(float));
    int r = 0;
    if (prep != NULL && yd != NULL) {
        for (int c = 0; c < nc; c++)
            for (int i = 0; i < nb; i++) {
                const block_q8_K *y = (const block_q8_K *)(x + c * x_bytes) + i;
                xs_prep(y, prep + 2 * ((int64_t)c * nb + i) * (QK_K / 32));
                yd[(int64_t)c * nb + i] = y->d;
            }
        for (r = 0; r + 8 <= nr; r += 8) {
            const uint8_t *wr = w + r * row_bytes;
            if (nc == 1) xs_rows8_zmm(1, nb, s + r, ld_s, wr, row_bytes, prep, yd);
            else if (nc == 2) xs_rows8_zmm(2, nb, s + r, ld_s, wr, row_bytes, prep, yd);
            else if (nc == 3) xs_rows8_zmm(3, nb, s + r, ld_s, wr, row_bytes, prep, yd);
            else xs_rows8_zmm(4, nb, s + r, ld_s, wr, row_bytes, prep, yd);
        }
    }
    if (prep != stack) free(prep);
    if (yd != yd_stack) free(yd);
    return r;
}
#endif

IQ_API void lp_gemm_iq4_xs_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                                int64_t x_bytes, int nc) {
    const uint8_t *wb = w, *xb = x;
    int r = 0;
#if defined(B32_ZMM)
    if (nc <= XS_ZMM_COLS) r = xs_gemv_zmm(n / QK_K, s, ld_s, wb, row_bytes, nr, xb, x_bytes, nc);
    else
#endif
    if (nc >= B32_PANEL_MIN)
        for (int c0 = 0; c0 < nc; c0 += LP_GEMM_COLS_K) {
            const int m = nc - c0 < LP_GEMM_COLS_K ? nc - c0 : LP_GEMM_COLS_K;
            for (r = 0; r + 8 <= nr; r += 8)
                xs_panel8(n / QK_K, s + c0 * ld_s + r, ld_s, wb + r * row_bytes, row_bytes, xb + c0 * x_bytes, x_bytes, m);
        }
    for (int c0 = 0; c0 < nc; c0 += LP_GEMM_COLS) {
        const int m = nc - c0 < LP_GEMM_COLS ? nc - c0 : LP_GEMM_COLS;
        for (int rr = r; rr < nr; rr++)
            xs_row(n / QK_K, s + c0 * ld_s + rr, ld_s, (const block_iq4_xs *)(wb + rr * row_bytes), xb + c0 * x_bytes,
                   x_bytes, m);
    }
}

#if !defined(B32_ZMM)
/* AVX2 decode: 4 rows at once, each block's 4 integer totals by one reduction (hsum4_rows) and
 * the vec_dot's chain in 4 float32 lanes (fmaf(S * d_w, d_y, acc): its bits). A vec_dot a row
 * (one chain) before: the 1B shape --pure IQ4_XS, 2 threads, see bench/RESULTS.md stop 32. */
static void xs_rows4_ymm1(int nb, float *s, const uint8_t *w, int64_t row_bytes, const block_q8_K *y) {
    const block_iq4_xs *xr[4];
    for (int r = 0; r < 4; r++) xr[r] = (const block_iq4_xs *)(w + r * row_bytes);
    __m128 acc = _mm_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 4 * row_bytes, nb);
    for (int i = 0; i < nb; i++) {
        lp_pf_step(&pf, i);
        __m256i v[4];
        for (int r = 0; r < 4; r++) v[r] = xs_lanes(xr[r] + i, y[i].qs);
        const __m128 dx = _mm_cvtph_ps(_mm_setr_epi16((short)xr[0][i].d, (short)xr[1][i].d, (short)xr[2][i].d,
                                                      (short)xr[3][i].d, 0, 0, 0, 0));
        acc = _mm_fmadd_ps(_mm_mul_ps(_mm_cvtepi32_ps(hsum4_rows(v)), dx), _mm_set1_ps(y[i].d), acc);
    }
    _mm_storeu_ps(s, acc);
}
#endif

IQ_API void lp_gemv_iq4_xs_q8_K(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x) {
    int r0 = 0;
#if defined(B32_ZMM)
    r0 = xs_gemv_zmm(n / QK_K, s, 0, w, row_bytes, nr, x, 0, 1);
#else
    for (; r0 + 4 <= nr; r0 += 4)
        xs_rows4_ymm1(n / QK_K, s + r0, (const uint8_t *)w + r0 * row_bytes, row_bytes, (const block_q8_K *)x);
#endif
    for (int r = r0; r < nr; r++) {
        const uint8_t *row = (const uint8_t *)w + r * row_bytes;
        lp_pf_ahead(row, (int)row_bytes);
        lp_vec_dot_iq4_xs_q8_K(n, s + r, row, x);
    }
}
#endif
