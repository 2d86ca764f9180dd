/* K-quant dot products with q8_K activations, and the q8_K activation quantizer.
 *
 * ggml counterparts: ggml-quants.c quantize_row_q8_K_ref; ggml-cpu quants.c
 * ggml_vec_dot_q{2,3,4,5,6}_K_q8_K_generic and their x86 versions in arch/x86/quants.c; for the
 * float32 order, repack.cpp's ggml_gemm_q4_K_8x8_q8_K / ggml_gemm_q2_K_8x8_q8_K and
 * tiled/tiled-kernel.cpp.
 *
 * What is computed (ggml's definition): for each 256-element super-block, the exact integer sum
 * of weight quants times activation quants inside each sub-block, times the sub-block's integer
 * scale, summed as an integer; then times the float32 product of the two super-block scales
 * (weight d x activation d), minus, for types with mins, dmin x activation d x the integer
 * sum of mins times the activation's 16-element sums (bsums); the block results summed in
 * float32. Only the float32 part has an order to choose. Q2_K-Q6_K take, in every variant and at
 * every batch size, the order of llama.cpp 0.3.36's x86 prompt kernels (kq_q4k_chain,
 * kq_q2k_chain, kq_tiled_step below), so llama-perplexity's logits for a K-quant file are llamapy's bit for bit
 * (tests/model/test_perplexity.py, the tiny32 Q4_K_M same-file test): Q4_K weights go through
 * its repacked q4_K_8x8 gemm there (every ne[1] % 8 == 0 matrix, AVX2 and AVX-512), the others'
 * prompts of >= 8 rows through the tiled microtiles. llama.cpp itself is not batch-invariant here
 * (its 1-3 leftover rows of a Q4_K batch run the q4_K_8x8 gemv, per super-block; < 8 rows of the
 * others the vec_dots, 8 lanes + hsum): llamapy keeps one order for a token alone or in any batch,
 * so its decode matches llama.cpp's prompt arithmetic, not its 1-token one. Q2_K takes the order of
 * llama.cpp's AVX-512 build (kq_q2k_chain: its repacked q2_K_8x8 gemm, per 128-element half, every
 * ne[1] % 8 == 0 matrix; its gemv for 1-3 leftover rows sums per block instead; its AVX2 builds
 * do not repack Q2_K and run the tiled microtiles: not followed).
 *
 * This file is compiled once per SIMD variant (see lp_quants.h), each defining the same names:
 *   portable C     - no -march flags (scalar fmaf: the same order, so the same bits, as the
 *                    others for Q3_K-Q6_K);
 *   AVX2           - maddubs (u8 weight x s8 activation -> s16 pairs) then madd with the
 *                    sub-block scales (-> s32), ggml's approach: no saturation is possible,
 *                    since a pair is at most 2 x 63 x 127 < 32767;
 *   AVX-512 VNNI   - the same with 64-byte vectors and vpdpwssd (madd + add in one) for Q4_K,
 *                    Q5_K and Q6_K, and Q2_K's whole block in one maddubs per shift; Q3_K uses
 *                    the AVX2 code (few models use it); the
 *                    prompt kernels of Q4_K-Q6_K take 8 tokens x 64 rows a step (lp_gemm_*).
 * Weight types whose quants are signed (Q3_K: -4..3, Q6_K: -32..31) are used offset to
 * unsigned (+4, +32) for maddubs, and the offset times the scaled bsums is subtracted.
 */
#include "lp_quants.h"

#include <math.h>
#include <stdlib.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* the library is built with -fvisibility=hidden: export the entry points */
#if defined(__GNUC__)
#define KQ_API __attribute__((visibility("default")))
#else
#define KQ_API
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX2__)
#define LP_KQ_AVX512 1
#endif

/* ---------------------------------------------------------------------------------------------
 * shared scalar helpers
 */

/* f16 -> f32 (exact either way); F16C's one instruction where the variant has it */
#if defined(__F16C__)
static inline float kq_h2f(lp_half h) { return _cvtsh_ss(h); }
#else
static inline float kq_h2f(lp_half h) { return lp_h2f(h); }
#endif

/* nearest integer, ties to even: ggml's nearest_int (the float + 1.5*2^23 trick rounds with the
 * FPU's default mode). Done in double so that no compiler can fuse the preceding float multiply
 * into an FMA with the magic add (-ffp-contract=fast is GCC's default), which would round the
 * exact product instead of the float32 one ggml rounds. */
static inline int kq_nearest_int(float v) {
    double t = (double)v + 6755399441055744.0; /* 1.5 * 2^52 */
    int64_t bits;
    memcpy(&bits, &t, sizeof bits);
    return (int)(int32_t)(uint32_t)bits;
}

/* Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4) */
static inline void kq_scale_min_k4(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (uint8_t)((q[j + 8] & 0xF) | ((q[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
    }
}

/* Q3_K: 12 bytes -> 16 signed six-bit scales (stored +32) */
static inline void kq_scales_q3(const uint8_t *q, int8_t sc[16]) {
    for (int j = 0; j < 16; ++j) {
        const int lo = j < 8 ? (q[j] & 0xF) : (q[j - 8] >> 4);
        const int hi = (q[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        sc[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* exact integer dot product of 16 (or 32) weight quants with activation quants */
static inline int32_t kq_dot16(const int8_t *a, const int8_t *b) {
    int32_t s = 0;
    for (int l = 0; l < 16; ++l) s += (int32_t)a[l] * b[l];
    return s;
}

/* ---------------------------------------------------------------------------------------------
 * The float32 part, in ggml's order for prompts on x86 (llama.cpp 0.3.36, see the file comment):
 * every kernel below (vec_dot, gemm, gemv, each SIMD variant) computes the exact integers of a
 * block and hands them to one of these, so all give the same bits.
 *
 * Q4_K (repack.cpp ggml_gemm_q4_K_8x8_q8_K, AVX2 and AVX-512 bodies alike): per block, per pair p
 * of 32-element sub-blocks (64 elements), S_p = sc[2p] dot(2p) + sc[2p+1] dot(2p+1) and
 * M_p = mn[2p] bsum32(2p) + mn[2p+1] bsum32(2p+1), then
 *   acc  = fma((float)S_p, d_w * d_y, acc);  accm = fma((float)M_p, dmin_w * d_y, accm)
 * and the result acc - accm. */
static inline void kq_q4k_chain(const int32_t S[4], const int32_t M[4], float dd, float dm, float *acc, float *accm) {
    float a = *acc, b = *accm;
    for (int p = 0; p < 4; ++p) {
        a = fmaf((float)S[p], dd, a);
        b = fmaf((float)M[p], dm, b);
    }
    *acc = a;
    *accm = b;
}

/* Q2_K (repack.cpp ggml_gemm_q2_K_8x8_q8_K: llama.cpp repacks Q2_K on AVX-512 and runs its prompts
 * there, per 128-element half; that gemm's AVX2 bodies, for the columns past a multiple of 16, in
 * the same order): per block, per half h, S_h = sum of sc dot16 over its 8 sub-blocks and
 * M_h = sum of mn bsum16, then
 *   acc  = fma((float)S_h, d_w * d_y, acc);  accm = fma((float)M_h, dmin_w * d_y, accm)
 * and the result acc - accm: kq_q4k_chain's form with two steps a block. */
static inline void kq_q2k_chain(const int32_t S[2], const int32_t M[2], float dd, float dm, float *acc, float *accm) {
    float a = *acc, b = *accm;
    for (int h = 0; h < 2; ++h) {
        a = fmaf((float)S[h], dd, a);
        b = fmaf((float)M[h], dm, b);
    }
    *acc = a;
    *accm = b;
}

/* Q3_K / Q5_K / Q6_K (tiled/tiled-kernel.cpp, the AVX-512 VNNI and AVX2 microtiles alike; GCC
 * contracts the VNNI one's final multiply-add into an FMA): per block the exact integer total S
 * (and, with mins, M = sum mn bsum32), then
 *   r = (float)S * d_w;  [r = fma(-dmin_w, (float)M, r)];  acc = fma(r, d_y, acc) */
static inline float kq_tiled_step(int32_t S, float xd, float yd, float acc) {
    return fmaf((float)S * xd, yd, acc);
}
static inline float kq_tiled_step_min(int32_t S, int32_t M, float xd, float xdmin, float yd, float acc) {
    return fmaf(fmaf(-xdmin, (float)M, (float)S * xd), yd, acc);
}

/* ---------------------------------------------------------------------------------------------
 * quantize_row_q8_K
 */

KQ_API void lp_quantize_row_q8_K(const float *restrict x, void *restrict vy, int64_t k) {
    block_q8_K *restrict y = (block_q8_K *)vy;
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        /* the element of largest magnitude, first of equals, with its sign; nan is ignored */
        float amax = 0.0f, max = 0.0f;
#if defined(__AVX2__)
        {
            const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            __m256 m = _mm256_setzero_ps();
            for (int j = 0; j < QK_K; j += 8)
                m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), absmask), m); /* nan -> m */
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            amax = _mm_cvtss_f32(h);
            if (amax > 0.0f) {
                for (int j = 0; j < QK_K; ++j) {
                    float ax = x[j] < 0 ? -x[j] : x[j];
                    if (ax == amax) { max = x[j]; break; }
                }
            }
        }
#else
        for (int j = 0; j < QK_K; ++j) {
            const float ax = x[j] < 0 ? -x[j] : x[j];
            if (ax > amax) { amax = ax; max = x[j]; }
        }
#endif
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        /* -127/max, not 127/amax: ggml's choice (so d has the sign of -max) */
        const float iscale = -127.0f / max;
#if defined(__AVX2__)
        {
            const __m256 vs = _mm256_set1_ps(iscale);
            const __m256i q127 = _mm256_set1_epi32(127);
            const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for (int j = 0; j < QK_K; j += 32) {
                /* cvtps rounds with MXCSR's default mode: nearest, ties to even, as nearest_int */
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 0), vs));
                __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8), vs));
                __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 16), vs));
                __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 24), vs));
                a = _mm256_min_epi32(a, q127);
                b = _mm256_min_epi32(b, q127);
                c = _mm256_min_epi32(c, q127);
                d = _mm256_min_epi32(d, q127);
                /* packs interleave 128-bit lanes: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7 */
                __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
                p = _mm256_permutevar8x32_epi32(p, order);
                _mm256_storeu_si256((__m256i *)(y[i].qs + j), p);
            }
        }
#else
        for (int j = 0; j < QK_K; ++j) {
            const int v = kq_nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
#endif
        for (int j = 0; j < QK_K / 16; ++j) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * j + l];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1.0f / iscale;
    }
}

/* ---------------------------------------------------------------------------------------------
 * AVX2 helpers
 */
#if defined(__AVX2__)

static inline float kq_hsum_ps256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float kq_hsum_ps128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Scales of 16-element sub-blocks: 16 int8 -> int16, the first 8 in both 128-bit lanes (.lo)
 * and the last 8 in both (.hi), so that one in-lane byte shuffle gives the scale of each s16
 * lane maddubs produces for elements 32g .. 32g+31: [s[2g] x 8 | s[2g+1] x 8]. */
typedef struct { __m256i lo, hi; } kq_sc16;

static inline kq_sc16 kq_sc16_load(__m128i sc8) {
    const __m256i s = _mm256_cvtepi8_epi16(sc8);
    return (kq_sc16){_mm256_permute2x128_si256(s, s, 0x00), _mm256_permute2x128_si256(s, s, 0x11)};
}

static inline __m256i kq_scales16_pair(kq_sc16 sc, int g) {
    const int a = 2 * (g & 3); /* int16 index of s[2g] within its half */
    const __m256i m = _mm256_setr_m128i(_mm_set1_epi16((short)(((2 * a + 1) << 8) | (2 * a))),
                                        _mm_set1_epi16((short)(((2 * a + 3) << 8) | (2 * a + 2))));
    return _mm256_shuffle_epi8(g < 4 ? sc.lo : sc.hi, m);
}

/* 8 int16 scales duplicated in both 128-bit lanes -> scale number k in every s16 lane */
static inline __m256i kq_scale16_bcast(__m256i sc16x2, int k) {
    return _mm256_shuffle_epi8(sc16x2, _mm256_set1_epi16((short)(((2 * k + 1) << 8) | (2 * k))));
}

/* maddubs then madd by scales: 32 u8 weights x 32 s8 activations -> 8 int32 partial sums */
static inline __m256i kq_dot32(__m256i w, const int8_t *q8, __m256i sc16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)q8)), sc16);
}

/* Q4_K/Q5_K 12 scale bytes -> (scales lo, scales hi, mins lo, mins hi) as four little-endian
 * words of 4 six-bit values, the same packing ggml's kmask code produces; from a block's first
 * 16 bytes (d, dmin, the 12 scale bytes a, b, c as dwords 1-3) per 128-bit lane (two blocks at
 * once): [a & 0x3f.., (c & 0x0f..) | ((a >> 6) & 3..) << 4, b & 0x3f.., ((c >> 4) & 0x0f..) |
 * ((b >> 6) & 3..) << 4] */
static inline __m256i kq_scale_min_k4_x2(__m256i v) {
    const __m256i acbc = _mm256_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1)), aabb = _mm256_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 1));
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(acbc, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)),
                                        _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f,
                                                          0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(aabb, 2),
                                        _mm256_setr_epi32(0, 0x30303030, 0, 0x30303030, 0, 0x30303030, 0, 0x30303030));
    return _mm256_or_si256(lo, hi);
}

/* one Q4_K or Q5_K block's (the same first 16 bytes) */
static inline __m128i kq_scale_min_k4_vec(const void *block) {
    return _mm256_castsi256_si128(kq_scale_min_k4_x2(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)block))));
}

/* Q3_K 12 scale bytes -> 16 int8 scales (-32..31) */
static inline __m128i kq_scales_q3_vec(const uint8_t *q) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    const uint32_t s0 = (a & 0x0f0f0f0fu) | (((c >> 0) & 0x03030303u) << 4);
    const uint32_t s1 = (b & 0x0f0f0f0fu) | (((c >> 2) & 0x03030303u) << 4);
    const uint32_t s2 = ((a >> 4) & 0x0f0f0f0fu) | (((c >> 4) & 0x03030303u) << 4);
    const uint32_t s3 = ((b >> 4) & 0x0f0f0f0fu) | (((c >> 6) & 0x03030303u) << 4);
    return _mm_sub_epi8(_mm_set_epi32((int)s3, (int)s2, (int)s1, (int)s0), _mm_set1_epi8(32));
}

/* a q8_K block's 16 bsums summed per 32 elements: 8 int16 */
static inline __m128i kq_bs32(const int16_t *bsums) {
    const __m256i bs = _mm256_loadu_si256((const __m256i *)bsums);
    return _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
}

/* mins . (bsums summed per 32 elements): 8 int16 mins (upper lane of mins_scales) -> 4 int32 */
static inline __m128i kq_mins_dot(__m256i mins_scales16, const int16_t *bsums) {
    return _mm_madd_epi16(_mm256_extracti128_si256(mins_scales16, 1), kq_bs32(bsums));
}

/* integer sums (exact in any order) */
static inline int32_t kq_hsum_epi32_128(__m128i v) {
    v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 1, 1)));
    return _mm_cvtsi128_si32(v);
}
static inline int32_t kq_hsum_epi32_256(__m256i v) {
    return kq_hsum_epi32_128(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
/* [sum P0, sum P1, sum P2, sum P3] of four 8-lane vectors */
static inline __m128i kq_sum4_256(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* [v0 | v1 | v2 | v3] summed per 128-bit lane: lanes [v0, v1, v2, v3] of each half, the halves
 * adding to the sums (an unpack-and-add tree: no hadd) */
static inline __m256i kq_t4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
    const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(v2, v3), _mm256_unpackhi_epi32(v2, v3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}

/* u[p] = kq_t4 of pair p's four vectors -> f[p] = their sums as float32 (exact), pair-major */
static inline void kq_t4_pairs(const __m256i u[4], __m128 f[4]) {
    const __m256 f01 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20),
                                                           _mm256_permute2x128_si256(u[0], u[1], 0x31)));
    const __m256 f23 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(u[2], u[3], 0x20),
                                                           _mm256_permute2x128_si256(u[2], u[3], 0x31)));
    f[0] = _mm256_castps256_ps128(f01), f[1] = _mm256_extractf128_ps(f01, 1);
    f[2] = _mm256_castps256_ps128(f23), f[3] = _mm256_extractf128_ps(f23, 1);
}

/* [4 values of a | of b], [of c | of d] -> f[p] = [a_p, b_p, c_p, d_p] (a 4 x 4 transpose) */
static inline void kq_t4_mins(__m256 m01, __m256 m23, __m128 f[4]) {
    const __m256 ml = _mm256_unpacklo_ps(m01, m23), mh = _mm256_unpackhi_ps(m01, m23); /* [a0 c0 a1 c1 | b0 d0 b1 d1] */
    const __m128 ml0 = _mm256_castps256_ps128(ml), ml1 = _mm256_extractf128_ps(ml, 1);
    const __m128 mh0 = _mm256_castps256_ps128(mh), mh1 = _mm256_extractf128_ps(mh, 1);
    f[0] = _mm_unpacklo_ps(ml0, ml1), f[1] = _mm_unpackhi_ps(ml0, ml1);
    f[2] = _mm_unpacklo_ps(mh0, mh1), f[3] = _mm_unpackhi_ps(mh0, mh1);
}

/* one Q4_K block's pair sums and min sums through kq_q4k_chain */
static inline void kq_q4k_step(__m128i S, __m128i M, float dd, float dm, float *acc, float *accm) {
    int32_t s[4], m[4];
    _mm_storeu_si128((__m128i *)s, S);
    _mm_storeu_si128((__m128i *)m, M);
    kq_q4k_chain(s, m, dd, dm, acc, accm);
}

/* kq_q2k_chain for one block, both chains in one register: SM = [S_0, M_0, S_1, M_1] (exact),
 * acc lanes 0, 1 = (acc, accm); two FMAs of [S_h, M_h] by [d_w d_y, dmin_w d_y] */
static inline __m128 kq_q2k_step(__m128i SM, float dd, float dm, __m128 acc) {
    const __m128 f = _mm_cvtepi32_ps(SM);
    const __m128 d = _mm_setr_ps(dd, dm, dd, dm);
    acc = _mm_fmadd_ps(f, d, acc);
    return _mm_fmadd_ps(_mm_movehl_ps(f, f), d, acc);
}

#endif /* __AVX2__ */

#if defined(LP_KQ_AVX512)
/* [sum P0, sum P1, sum P2, sum P3] of four 16-lane vectors */
static inline __m128i kq_sum4_512(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
    const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b)); /* per 128 bits */
    const __m256i d = _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
}
/* [sum of lanes 0-7 of a, of lanes 8-15 of a, the same of b] */
static inline __m128i kq_sum_halves_512(__m512i a, __m512i b) {
    return kq_sum4_512(_mm512_maskz_mov_epi32(0x00FF, a), _mm512_maskz_mov_epi32(0xFF00, a),
                       _mm512_maskz_mov_epi32(0x00FF, b), _mm512_maskz_mov_epi32(0xFF00, b));
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Q2_K: 16 sub-blocks of 16, 2-bit quants, 4-bit scale and 4-bit min each
 *
 * q2k_cols is one weight row against nc activation rows, inlined with nc a constant:
 * lp_vec_dot_q2_K_q8_K is its nc = 1 case and lp_gemm_q2_K_q8_K loops rows over it, so every
 * output takes the same operations in the same order (lp_quants.h's bit-identity rule), while
 * each weight block is unpacked once for all nc columns. The AVX-512 body works on all 64 bytes
 * of quants at once: shift sh of byte l holds element 32 sh + l (l < 32) and 128 + 32 sh + l - 32
 * (l >= 32), so one 512-bit maddubs covers four sub-blocks, the activations are the two matching
 * 32-byte runs, and one vpermw spreads the four sub-blocks' scales over the 32 int16 lanes.
 */
#define KQ_INLINE static inline __attribute__((always_inline))

#if defined(LP_KQ_AVX512)
/* vpermw indices: int16 lane j of shift sh's products (bytes 2j, 2j+1) lies in sub-block
 * 2 sh + j / 8 for j < 16 and 8 + 2 sh + (j - 16) / 8 above */
#define KQ_LANES(sh) {2*sh, 2*sh, 2*sh, 2*sh, 2*sh, 2*sh, 2*sh, 2*sh, \
    2*sh+1, 2*sh+1, 2*sh+1, 2*sh+1, 2*sh+1, 2*sh+1, 2*sh+1, 2*sh+1, \
    8+2*sh, 8+2*sh, 8+2*sh, 8+2*sh, 8+2*sh, 8+2*sh, 8+2*sh, 8+2*sh, \
    9+2*sh, 9+2*sh, 9+2*sh, 9+2*sh, 9+2*sh, 9+2*sh, 9+2*sh, 9+2*sh}
static const int16_t kq_q2k_scale_lanes[4][32] __attribute__((aligned(64))) = {KQ_LANES(0), KQ_LANES(1), KQ_LANES(2), KQ_LANES(3)};
#undef KQ_LANES
#endif

KQ_INLINE void q2k_cols(int n, float *restrict s, int64_t ld_s, const block_q2_K *restrict x, const uint8_t *restrict vy,
                        int64_t y_bytes, int nc) {
    const int nb = n / QK_K;
#if defined(__AVX2__)
    /* lanes 0, 1: acc, accm of kq_q2k_chain (lanes 2, 3 unused) */
    __m128 acc[LP_GEMM_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = _mm_setzero_ps();
#if defined(LP_KQ_AVX512)
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m512i sc_idx[4] = {_mm512_loadu_si512((const void *)kq_q2k_scale_lanes[0]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[1]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[2]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[3])};
    for (int i = 0; i < nb; ++i) {
        const float xd = kq_h2f(x[i].d), xdmin = kq_h2f(x[i].dmin);
        const __m128i sc_mn = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sc_mn, m4)));
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc_mn, 4), m4));
        const __m512i bits = _mm512_loadu_si512((const void *)x[i].qs);
        const __m512i w0 = _mm512_and_si512(bits, m3), w1 = _mm512_and_si512(_mm512_srli_epi16(bits, 2), m3);
        const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(bits, 4), m3), w3 = _mm512_and_si512(_mm512_srli_epi16(bits, 6), m3);
        const __m512i s0 = _mm512_permutexvar_epi16(sc_idx[0], sc16), s1 = _mm512_permutexvar_epi16(sc_idx[1], sc16);
        const __m512i s2 = _mm512_permutexvar_epi16(sc_idx[2], sc16), s3 = _mm512_permutexvar_epi16(sc_idx[3], sc16);
        for (int c = 0; c < nc; ++c) {
            const block_q8_K *y = (const block_q8_K *)(vy + c * y_bytes) + i;
            /* int32 lanes 0-3: the mins of half 0 (sub-blocks 0-7), 4-7: half 1 */
            const __m256i summs = _mm256_madd_epi16(mins16, _mm256_loadu_si256((const __m256i *)y->bsums));
            const int8_t *q8 = y->qs;
#define KQ_Q8X2(o) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q8 + (o)))), \
                                      _mm256_loadu_si256((const __m256i *)(q8 + 128 + (o))), 1)
            /* int32 lanes 0-7: half 0 (quant bytes 0-31), 8-15: half 1 */
            __m512i sumi = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(w0, KQ_Q8X2(0)), s0);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w1, KQ_Q8X2(32)), s1);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w2, KQ_Q8X2(64)), s2);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w3, KQ_Q8X2(96)), s3);
#undef KQ_Q8X2
            const __m128i SM = kq_sum4_512(_mm512_maskz_mov_epi32(0x00FF, sumi), _mm512_zextsi128_si512(_mm256_castsi256_si128(summs)),
                                           _mm512_maskz_mov_epi32(0xFF00, sumi), _mm512_zextsi128_si512(_mm256_extracti128_si256(summs, 1)));
            acc[c] = kq_q2k_step(SM, xd * y->d, xdmin * y->d, acc[c]);
        }
    }
#else
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    for (int i = 0; i < nb; ++i) {
        const float xd = kq_h2f(x[i].d), xdmin = kq_h2f(x[i].dmin);
        const __m128i sc_mn = _mm_loadu_si128((const __m128i *)x[i].scales);
        const kq_sc16 sc = kq_sc16_load(_mm_and_si128(sc_mn, m4));
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc_mn, 4), m4));
        __m256i sumi[2][LP_GEMM_COLS];
        /* half k of the block: quants 32 k .. 32 k + 31, elements 128 k .. 128 k + 127 */
        for (int k = 0; k < 2; ++k) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * k));
            const __m256i w0 = _mm256_and_si256(bits, m3), w1 = _mm256_and_si256(_mm256_srli_epi16(bits, 2), m3);
            const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m3), w3 = _mm256_and_si256(_mm256_srli_epi16(bits, 6), m3);
            const __m256i s0 = kq_scales16_pair(sc, 4 * k + 0), s1 = kq_scales16_pair(sc, 4 * k + 1);
            const __m256i s2 = kq_scales16_pair(sc, 4 * k + 2), s3 = kq_scales16_pair(sc, 4 * k + 3);
            for (int c = 0; c < nc; ++c) {
                const int8_t *q = ((const block_q8_K *)(vy + c * y_bytes) + i)->qs + 128 * k;
                const __m256i p0 = kq_dot32(w0, q, s0), p1 = kq_dot32(w1, q + 32, s1);
                const __m256i p2 = kq_dot32(w2, q + 64, s2), p3 = kq_dot32(w3, q + 96, s3);
                sumi[k][c] = _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3));
            }
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K *y = (const block_q8_K *)(vy + c * y_bytes) + i;
            /* int32 lanes 0-3: the mins of half 0 (sub-blocks 0-7), 4-7: half 1 */
            const __m256i summs = _mm256_madd_epi16(mins16, _mm256_loadu_si256((const __m256i *)y->bsums));
            const __m256i zero = _mm256_setzero_si256();
            const __m128i SM = kq_sum4_256(sumi[0][c], _mm256_blend_epi32(zero, summs, 0x0F), sumi[1][c],
                                           _mm256_blend_epi32(zero, summs, 0xF0));
            acc[c] = kq_q2k_step(SM, xd * y->d, xdmin * y->d, acc[c]);
        }
    }
#endif
    for (int c = 0; c < nc; ++c) {
        float a[4];
        _mm_storeu_ps(a, acc[c]);
        s[c * ld_s] = a[0] - a[1];
    }
#else
    float acc[LP_GEMM_COLS] = {0}, accm[LP_GEMM_COLS] = {0};
    for (int i = 0; i < nb; ++i) {
        const uint8_t *sc = x[i].scales;
        int8_t q[QK_K];
        for (int k = 0; k < 2; ++k)
            for (int sh = 0; sh < 4; ++sh)
                for (int l = 0; l < 32; ++l)
                    q[128 * k + 32 * sh + l] = (int8_t)((x[i].qs[32 * k + l] >> (2 * sh)) & 3);
        const float xd = kq_h2f(x[i].d), xdmin = kq_h2f(x[i].dmin);
        for (int c = 0; c < nc; ++c) {
            const block_q8_K *y = (const block_q8_K *)(vy + c * y_bytes) + i;
            int32_t S[2] = {0, 0}, M[2] = {0, 0};
            for (int j = 0; j < 16; ++j) {
                S[j / 8] += (sc[j] & 0xF) * kq_dot16(q + 16 * j, y->qs + 16 * j);
                M[j / 8] += (sc[j] >> 4) * y->bsums[j];
            }
            kq_q2k_chain(S, M, xd * y->d, xdmin * y->d, &acc[c], &accm[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c * ld_s] = acc[c] - accm[c];
#endif
}

KQ_API void lp_vec_dot_q2_K_q8_K(int n, float *restrict s, const void *restrict vx, const void *restrict vy) {
    q2k_cols(n, s, 0, (const block_q2_K *)vx, (const uint8_t *)vy, 0, 1);
}

/* the AVX2 and AVX-512 (below) builds only, as the other K gemms: without it (the portable build)
 * Q2_K prompts go to sgemm (qmatmul.py _has_gemm), one vec_dot per output being slower there.
 * AVX2: each row against up to LP_GEMM_COLS columns (q2k_cols) */
#if defined(__AVX2__) && !defined(LP_KQ_AVX512)
KQ_API void lp_gemm_q2_K_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                              int64_t x_bytes, int nc) {
    for (int r = 0; r < nr; ++r) {
        const block_q2_K *wr = (const block_q2_K *)((const uint8_t *)w + r * row_bytes);
        switch (nc) {
        case 1: q2k_cols(n, s + r, ld_s, wr, x, x_bytes, 1); break;
        case 2: q2k_cols(n, s + r, ld_s, wr, x, x_bytes, 2); break;
        case 3: q2k_cols(n, s + r, ld_s, wr, x, x_bytes, 3); break;
        default: q2k_cols(n, s + r, ld_s, wr, x, x_bytes, LP_GEMM_COLS); break;
        }
    }
}
#endif

/* lp_gemv_q2_K_q8_K: one token over nr rows, each output the vec_dot's bits. AVX-512: four rows at
 * once, their sub-sums reduced together (kq_tr4_512) and kq_q2k_chain in 4 float32 lanes (one row a
 * lane: the same FMAs in the same order as the vec_dot); the rest, and the AVX2 build, row by row. */
#if defined(LP_KQ_AVX512)
/* per 128-bit lane k: [sum of a's int32 lanes 4k..4k+3, of b's, of c's, of d's] */
static inline __m512i kq_tr4_512(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* one row's block decoded: its quants by shift (w), the scales of each shift's int16 lanes (sc),
 * the 16 mins as int16 */
typedef struct { __m512i w[4], sc[4]; __m256i mins16; } kq_q2k_dec;

KQ_INLINE void kq_q2k_decode(const block_q2_K *restrict x, const __m512i sc_idx[4], kq_q2k_dec *d) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m128i sc_mn = _mm_loadu_si128((const __m128i *)x->scales);
    const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sc_mn, m4)));
    d->mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc_mn, 4), m4));
    const __m512i bits = _mm512_loadu_si512((const void *)x->qs);
    for (int sh = 0; sh < 4; ++sh) {
        d->w[sh] = _mm512_and_si512(_mm512_srli_epi16(bits, 2 * sh), m3);
        d->sc[sh] = _mm512_permutexvar_epi16(sc_idx[sh], sc16);
    }
}

/* that block against one activation block: sumi (int32 lanes 0-7 half 0, 8-15 half 1, as
 * q2k_cols), summs in the low 256 bits (lanes 0-3 half 0, 4-7 half 1; the upper bits unused) */
KQ_INLINE void kq_q2k_mul(const kq_q2k_dec *d, const block_q8_K *restrict y, __m512i *sumi, __m512i *summs) {
    *summs = _mm512_castsi256_si512(_mm256_madd_epi16(d->mins16, _mm256_loadu_si256((const __m256i *)y->bsums)));
    __m512i acc = _mm512_setzero_si512();
    for (int sh = 0; sh < 4; ++sh) {
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * sh))),
                                             _mm256_loadu_si256((const __m256i *)(y->qs + 128 + 32 * sh)), 1);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(d->w[sh], q), d->sc[sh]);
    }
    *sumi = acc;
}

KQ_API void lp_gemv_q2_K_q8_K(int n, float *restrict s, const void *restrict w, int64_t row_bytes, int nr,
                              const void *restrict x) {
    const int nb = n / QK_K;
    const block_q8_K *y = (const block_q8_K *)x;
    const __m512i sc_idx[4] = {_mm512_loadu_si512((const void *)kq_q2k_scale_lanes[0]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[1]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[2]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[3])};
    int r = 0;
    for (; r + 4 <= nr; r += 4) {
        const block_q2_K *xr[4];
        for (int k = 0; k < 4; ++k) xr[k] = (const block_q2_K *)((const uint8_t *)w + (r + k) * row_bytes);
        __m128 acc = _mm_setzero_ps(), accm = _mm_setzero_ps();
        const lp_pf pf = lp_pf_group(xr[0], 4 * row_bytes, nb);
        for (int i = 0; i < nb; ++i) {
            lp_pf_step(&pf, i);
            __m512i e[4], f[4];
            for (int k = 0; k < 4; ++k) {
                kq_q2k_dec d;
                kq_q2k_decode(xr[k] + i, sc_idx, &d);
                kq_q2k_mul(&d, y + i, &e[k], &f[k]);
            }
            const __m512i ue = kq_tr4_512(e[0], e[1], e[2], e[3]), uf = kq_tr4_512(f[0], f[1], f[2], f[3]);
            const __m128i S0 = _mm_add_epi32(_mm512_castsi512_si128(ue), _mm512_extracti32x4_epi32(ue, 1));
            const __m128i S1 = _mm_add_epi32(_mm512_extracti32x4_epi32(ue, 2), _mm512_extracti32x4_epi32(ue, 3));
            const __m128i M0 = _mm512_castsi512_si128(uf), M1 = _mm512_extracti32x4_epi32(uf, 1);
            const __m128 yd = _mm_set1_ps(y[i].d);
            const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_setr_epi16((short)xr[0][i].d, (short)xr[1][i].d, (short)xr[2][i].d,
                                                                     (short)xr[3][i].d, 0, 0, 0, 0)), yd);
            const __m128 dm = _mm_mul_ps(_mm_cvtph_ps(_mm_setr_epi16((short)xr[0][i].dmin, (short)xr[1][i].dmin,
                                                                     (short)xr[2][i].dmin, (short)xr[3][i].dmin, 0, 0, 0, 0)), yd);
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(S0), dd, acc);
            accm = _mm_fmadd_ps(_mm_cvtepi32_ps(M0), dm, accm);
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(S1), dd, acc);
            accm = _mm_fmadd_ps(_mm_cvtepi32_ps(M1), dm, accm);
        }
        _mm_storeu_ps(s + r, _mm_sub_ps(acc, accm));
    }
    for (; r < nr; ++r) q2k_cols(n, s + r, 0, (const block_q2_K *)((const uint8_t *)w + r * row_bytes), (const uint8_t *)x, 0, 1);
}
/* lp_gemm_q2_K_q8_K (AVX-512): two rows x two columns a step, both rows' blocks decoded once for
 * the two columns, the four outputs' sub-sums reduced together (kq_tr4_512) and kq_q2k_chain in 4
 * float32 lanes [(r, c), (r+1, c), (r, c+1), (r+1, c+1)]: each output the vec_dot's bits. An odd
 * row or column goes through q2k_cols. */
KQ_INLINE void kq_q2k_2x2(int nb, float *restrict s, int64_t ld_s, const block_q2_K *restrict xa,
                          const block_q2_K *restrict xb, const block_q8_K *restrict y0, const block_q8_K *restrict y1,
                          const __m512i sc_idx[4]) {
    __m128 acc = _mm_setzero_ps(), accm = _mm_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        kq_q2k_dec da, db;
        kq_q2k_decode(xa + i, sc_idx, &da);
        kq_q2k_decode(xb + i, sc_idx, &db);
        __m512i e[4], f[4];
        kq_q2k_mul(&da, y0 + i, &e[0], &f[0]);
        kq_q2k_mul(&db, y0 + i, &e[1], &f[1]);
        kq_q2k_mul(&da, y1 + i, &e[2], &f[2]);
        kq_q2k_mul(&db, y1 + i, &e[3], &f[3]);
        const __m512i ue = kq_tr4_512(e[0], e[1], e[2], e[3]), uf = kq_tr4_512(f[0], f[1], f[2], f[3]);
        const __m128i S0 = _mm_add_epi32(_mm512_castsi512_si128(ue), _mm512_extracti32x4_epi32(ue, 1));
        const __m128i S1 = _mm_add_epi32(_mm512_extracti32x4_epi32(ue, 2), _mm512_extracti32x4_epi32(ue, 3));
        const __m128i M0 = _mm512_castsi512_si128(uf), M1 = _mm512_extracti32x4_epi32(uf, 1);
        const __m128 yd = _mm_setr_ps(y0[i].d, y0[i].d, y1[i].d, y1[i].d);
        const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_setr_epi16((short)xa[i].d, (short)xb[i].d, (short)xa[i].d,
                                                                 (short)xb[i].d, 0, 0, 0, 0)), yd);
        const __m128 dm = _mm_mul_ps(_mm_cvtph_ps(_mm_setr_epi16((short)xa[i].dmin, (short)xb[i].dmin, (short)xa[i].dmin,
                                                                 (short)xb[i].dmin, 0, 0, 0, 0)), yd);
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(S0), dd, acc);
        accm = _mm_fmadd_ps(_mm_cvtepi32_ps(M0), dm, accm);
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(S1), dd, acc);
        accm = _mm_fmadd_ps(_mm_cvtepi32_ps(M1), dm, accm);
    }
    float o[4];
    _mm_storeu_ps(o, _mm_sub_ps(acc, accm));
    s[0] = o[0];
    s[1] = o[1];
    s[ld_s] = o[2];
    s[ld_s + 1] = o[3];
}

KQ_API void lp_gemm_q2_K_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                              int64_t x_bytes, int nc) {
    const int nb = n / QK_K;
    const __m512i sc_idx[4] = {_mm512_loadu_si512((const void *)kq_q2k_scale_lanes[0]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[1]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[2]),
                               _mm512_loadu_si512((const void *)kq_q2k_scale_lanes[3])};
    const uint8_t *vy = (const uint8_t *)x;
    int r = 0;
    for (; r + 2 <= nr; r += 2) {
        const block_q2_K *xa = (const block_q2_K *)((const uint8_t *)w + r * row_bytes);
        const block_q2_K *xb = (const block_q2_K *)((const uint8_t *)w + (r + 1) * row_bytes);
        int c = 0;
        for (; c + 2 <= nc; c += 2)
            kq_q2k_2x2(nb, s + c * ld_s + r, ld_s, xa, xb, (const block_q8_K *)(vy + c * x_bytes),
                       (const block_q8_K *)(vy + (c + 1) * x_bytes), sc_idx);
        if (c < nc) {
            q2k_cols(n, s + c * ld_s + r, 0, xa, vy + c * x_bytes, 0, 1);
            q2k_cols(n, s + c * ld_s + r + 1, 0, xb, vy + c * x_bytes, 0, 1);
        }
    }
    if (r < nr) {
        const block_q2_K *xa = (const block_q2_K *)((const uint8_t *)w + r * row_bytes);
        for (int c = 0; c < nc; ++c) q2k_cols(n, s + c * ld_s + r, 0, xa, vy + c * x_bytes, 0, 1);
    }
}
#elif defined(__AVX2__)
KQ_API void lp_gemv_q2_K_q8_K(int n, float *restrict s, const void *restrict w, int64_t row_bytes, int nr,
                              const void *restrict x) {
    for (int r = 0; r < nr; ++r)
        q2k_cols(n, s + r, 0, (const block_q2_K *)((const uint8_t *)w + r * row_bytes), (const uint8_t *)x, 0, 1);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Q3_K: 16 sub-blocks of 16, 3-bit quants (2 low bits + a high bit that, when clear, means -4),
 * signed 6-bit scales
 */
#if defined(__AVX2__)
/* one Q3_K block's integer sum in 8 int32 lanes (the AVX2 vec_dot's, the +4 offset's share
 * subtracted; their total is exact) */
KQ_INLINE __m256i kq_q3k_lanes(const block_q3_K *restrict x, const block_q8_K *restrict y) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m4 = _mm256_set1_epi8(4);
    const __m128i sc8 = kq_scales_q3_vec(x->scales);
    const kq_sc16 sc = kq_sc16_load(sc8);
    /* weights are used as q + 4 = low bits | high bit << 2 (0..7): subtract 4 x scale x bsums */
    const __m256i off = _mm256_slli_epi32(
        _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), _mm256_loadu_si256((const __m256i *)y->bsums)), 2);
    const __m256i hbits = _mm256_loadu_si256((const __m256i *)x->hmask);
    const int8_t *q8 = y->qs;
    __m256i sumi = _mm256_setzero_si256();
#if defined(__GNUC__)
#pragma GCC unroll 2
#endif
    for (int k = 0; k < 2; ++k) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * k));
#if defined(__GNUC__)
#pragma GCC unroll 4
#endif
        for (int sh = 0; sh < 4; ++sh) {
            const int b = 4 * k + sh; /* hmask bit of these 32 elements, moved to bit 2 */
            __m256i h = b < 2 ? _mm256_slli_epi16(hbits, 2 - b) : _mm256_srli_epi16(hbits, b - 2);
            h = _mm256_and_si256(h, m4);
            const __m256i w = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 2 * sh), m3), h);
            sumi = _mm256_add_epi32(sumi, kq_dot32(w, q8 + 128 * k + 32 * sh, kq_scales16_pair(sc, b)));
        }
    }
    return _mm256_sub_epi32(sumi, off);
}
#endif

KQ_API void lp_vec_dot_q3_K_q8_K(int n, float *restrict s, const void *restrict vx, const void *restrict vy) {
    const block_q3_K *restrict x = (const block_q3_K *)vx;
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    const int nb = n / QK_K;
#if defined(__AVX2__)
    float acc = 0.0f;
    for (int i = 0; i < nb; ++i) acc = kq_tiled_step(kq_hsum_epi32_256(kq_q3k_lanes(x + i, y + i)), kq_h2f(x[i].d), y[i].d, acc);
    *s = acc;
#else
    float sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        int8_t sc[16];
        kq_scales_q3(x[i].scales, sc);
        /* quants used as q + 4 = low bits | high bit << 2 (no branch per element); the
         * offset's share, 4 x scale x bsums, is subtracted */
        int8_t q[QK_K];
        for (int k = 0; k < 2; ++k)
            for (int sh = 0; sh < 4; ++sh) {
                const int b = 4 * k + sh;
                for (int l = 0; l < 32; ++l)
                    q[32 * b + l] = (int8_t)(((x[i].qs[32 * k + l] >> (2 * sh)) & 3) |
                                             (((x[i].hmask[l] >> b) & 1) << 2));
            }
        int isum = 0;
        for (int j = 0; j < 16; ++j) isum += sc[j] * (kq_dot16(q + 16 * j, y[i].qs + 16 * j) - 4 * y[i].bsums[j]);
        sumf = kq_tiled_step(isum, kq_h2f(x[i].d), y[i].d, sumf);
    }
    *s = sumf;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * Q4_K: 8 sub-blocks of 32, 4-bit quants, 6-bit scale and 6-bit min each
 */
/* the vec_dot of nb blocks (inlined into lp_gemv_q4_K_q8_K's row loop too) */
KQ_INLINE float kq_dot_q4_K(int nb, const block_q4_K *restrict x, const block_q8_K *restrict y) {
    float acc = 0.0f, accm = 0.0f;
#if defined(LP_KQ_AVX512)
    const __m512i m4 = _mm512_set1_epi8(0xF);
    /* int16 lane permutations picking scale k for the first 16 lanes and k+1 for the rest */
    const __m512i idx01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(0)), _mm256_set1_epi16(1), 1);
    const __m512i idx23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(2)), _mm256_set1_epi16(3), 1);
    const __m512i idx45 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(4)), _mm256_set1_epi16(5), 1);
    const __m512i idx67 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(6)), _mm256_set1_epi16(7), 1);
    for (int i = 0; i < nb; ++i) {
        const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x + i));
        const __m512i sc = _mm512_castsi256_si512(ms16); /* scales in int16 lanes 0..7 */
        const int8_t *q8 = y[i].qs;
        /* 64 bytes of qs: low nibbles = sub-blocks 0 | 2, high = 1 | 3; regroup to 0 | 1, 2 | 3 */
        const __m512i b0 = _mm512_loadu_si512((const void *)x[i].qs);
        const __m512i b1 = _mm512_loadu_si512((const void *)(x[i].qs + 64));
        const __m512i l0 = _mm512_and_si512(b0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), m4);
        const __m512i l1 = _mm512_and_si512(b1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), m4);
        /* pair p: sub-blocks 2p | 2p+1, each lane scaled */
        const __m512i p0 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_shuffle_i64x2(l0, h0, 0x44), _mm512_loadu_si512((const void *)(q8 + 0))),
                                             _mm512_permutexvar_epi16(idx01, sc));
        const __m512i p1 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_shuffle_i64x2(l0, h0, 0xEE), _mm512_loadu_si512((const void *)(q8 + 64))),
                                             _mm512_permutexvar_epi16(idx23, sc));
        const __m512i p2 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_shuffle_i64x2(l1, h1, 0x44), _mm512_loadu_si512((const void *)(q8 + 128))),
                                             _mm512_permutexvar_epi16(idx45, sc));
        const __m512i p3 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_shuffle_i64x2(l1, h1, 0xEE), _mm512_loadu_si512((const void *)(q8 + 192))),
                                             _mm512_permutexvar_epi16(idx67, sc));
        kq_q4k_step(kq_sum4_512(p0, p1, p2, p3), kq_mins_dot(ms16, y[i].bsums), kq_h2f(x[i].d) * y[i].d,
                    kq_h2f(x[i].dmin) * y[i].d, &acc, &accm);
    }
#elif defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int i = 0; i < nb; ++i) {
        const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x + i));
        const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(ms16));
        const uint8_t *q4 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i pj[4];
#if defined(__GNUC__)
#pragma GCC unroll 4
#endif
        for (int j = 0; j < 4; ++j) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * j));
            const __m256i lo = _mm256_and_si256(bits, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            pj[j] = _mm256_add_epi32(kq_dot32(lo, q8 + 64 * j, kq_scale16_bcast(sc, 2 * j)),
                                     kq_dot32(hi, q8 + 64 * j + 32, kq_scale16_bcast(sc, 2 * j + 1)));
        }
        kq_q4k_step(kq_sum4_256(pj[0], pj[1], pj[2], pj[3]), kq_mins_dot(ms16, y[i].bsums), kq_h2f(x[i].d) * y[i].d,
                    kq_h2f(x[i].dmin) * y[i].d, &acc, &accm);
    }
#else
    for (int i = 0; i < nb; ++i) {
        uint8_t sc[8], mn[8];
        kq_scale_min_k4(x[i].scales, sc, mn);
        int8_t q[QK_K];
        for (int j = 0; j < 4; ++j)
            for (int l = 0; l < 32; ++l) {
                q[64 * j + l] = (int8_t)(x[i].qs[32 * j + l] & 0xF);
                q[64 * j + 32 + l] = (int8_t)(x[i].qs[32 * j + l] >> 4);
            }
        int32_t S[4], M[4];
        for (int p = 0; p < 4; ++p) {
            S[p] = 0;
            M[p] = 0;
            for (int j = 2 * p; j < 2 * p + 2; ++j) {
                S[p] += sc[j] * (kq_dot16(q + 32 * j, y[i].qs + 32 * j) + kq_dot16(q + 32 * j + 16, y[i].qs + 32 * j + 16));
                M[p] += mn[j] * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
            }
        }
        kq_q4k_chain(S, M, kq_h2f(x[i].d) * y[i].d, kq_h2f(x[i].dmin) * y[i].d, &acc, &accm);
    }
#endif
    return acc - accm;
}

KQ_API void lp_vec_dot_q4_K_q8_K(int n, float *restrict s, const void *restrict vx, const void *restrict vy) {
    *s = kq_dot_q4_K(n / QK_K, (const block_q4_K *)vx, (const block_q8_K *)vy);
}

/* ---------------------------------------------------------------------------------------------
 * Q5_K: Q4_K with a fifth bit per quant in qh (bit j of qh[l] for element l of sub-block j)
 */
#if defined(__AVX2__) && !defined(LP_KQ_AVX512)
/* one Q5_K block's integer sum in 8 int32 lanes (the AVX2 vec_dot's; their total is exact) and
 * its mins sum *M (kq_tiled_step_min's) */
KQ_INLINE __m256i kq_q5k_lanes(const block_q5_K *restrict x, const block_q8_K *restrict y, int32_t *M) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m16 = _mm256_set1_epi8(16);
    const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x));
    *M = kq_hsum_epi32_128(kq_mins_dot(ms16, y->bsums));
    const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(ms16));
    const __m256i hbits = _mm256_loadu_si256((const __m256i *)x->qh);
    const uint8_t *q4 = x->qs;
    const int8_t *q8 = y->qs;
    __m256i sumi = _mm256_setzero_si256();
#if defined(__GNUC__)
#pragma GCC unroll 4
#endif
    for (int j = 0; j < 4; ++j) {
        /* qh bit b -> bit 4 of each byte (a 16-bit shift by <= 4 keeps bits within bytes) */
        const int bl = 2 * j, bh = 2 * j + 1;
        __m256i hl = bl <= 4 ? _mm256_slli_epi16(hbits, 4 - bl) : _mm256_srli_epi16(hbits, bl - 4);
        __m256i hh = bh <= 4 ? _mm256_slli_epi16(hbits, 4 - bh) : _mm256_srli_epi16(hbits, bh - 4);
        hl = _mm256_and_si256(hl, m16);
        hh = _mm256_and_si256(hh, m16);
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * j));
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(bits, m4), hl);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), hh);
        const __m256i pl = kq_dot32(lo, q8 + 64 * j, kq_scale16_bcast(sc, bl));
        const __m256i ph = kq_dot32(hi, q8 + 64 * j + 32, kq_scale16_bcast(sc, bh));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    return sumi;
}
#endif

KQ_API void lp_vec_dot_q5_K_q8_K(int n, float *restrict s, const void *restrict vx, const void *restrict vy) {
    const block_q5_K *restrict x = (const block_q5_K *)vx;
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    const int nb = n / QK_K;
#if defined(LP_KQ_AVX512)
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i m16 = _mm512_set1_epi8(16);
    const __m512i idx01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(0)), _mm256_set1_epi16(1), 1);
    const __m512i idx23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(2)), _mm256_set1_epi16(3), 1);
    const __m512i idx45 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(4)), _mm256_set1_epi16(5), 1);
    const __m512i idx67 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(6)), _mm256_set1_epi16(7), 1);
    /* per 256-bit half: move qh bit 2p (first half) / 2p+1 (second half) to bit 4; 64-bit
     * shifts by <= 4 keep the bit in its own byte */
    const __m512i sh01 = _mm512_setr_epi64(4, 4, 4, 4, 3, 3, 3, 3);
    const __m512i sh23 = _mm512_setr_epi64(2, 2, 2, 2, 1, 1, 1, 1);
    const __m512i sh45 = _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i sh67 = _mm512_setr_epi64(2, 2, 2, 2, 3, 3, 3, 3);
    float acc = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x + i));
        const int32_t M = kq_hsum_epi32_128(kq_mins_dot(ms16, y[i].bsums));
        const __m512i sc = _mm512_castsi256_si512(ms16);

        const int8_t *q8 = y[i].qs;
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x[i].qh));
        /* high bits of sub-blocks 0|1, 2|3 (shifted left) and 4|5, 6|7 (shifted right) */
        const __m512i h01 = _mm512_and_si512(_mm512_sllv_epi64(qh, sh01), m16);
        const __m512i h23 = _mm512_and_si512(_mm512_sllv_epi64(qh, sh23), m16);
        const __m512i h45 = _mm512_and_si512(_mm512_srlv_epi64(qh, sh45), m16);
        const __m512i h67 = _mm512_and_si512(_mm512_srlv_epi64(qh, sh67), m16);
        const __m512i b0 = _mm512_loadu_si512((const void *)x[i].qs);
        const __m512i b1 = _mm512_loadu_si512((const void *)(x[i].qs + 64));
        const __m512i l0 = _mm512_and_si512(b0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), m4);
        const __m512i l1 = _mm512_and_si512(b1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), m4);
        const __m512i w01 = _mm512_or_si512(_mm512_shuffle_i64x2(l0, hi0, 0x44), h01);
        const __m512i w23 = _mm512_or_si512(_mm512_shuffle_i64x2(l0, hi0, 0xEE), h23);
        const __m512i w45 = _mm512_or_si512(_mm512_shuffle_i64x2(l1, hi1, 0x44), h45);
        const __m512i w67 = _mm512_or_si512(_mm512_shuffle_i64x2(l1, hi1, 0xEE), h67);
        __m512i sumi = _mm512_setzero_si512();
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w01, _mm512_loadu_si512((const void *)(q8 + 0))),
                                   _mm512_permutexvar_epi16(idx01, sc));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w23, _mm512_loadu_si512((const void *)(q8 + 64))),
                                   _mm512_permutexvar_epi16(idx23, sc));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w45, _mm512_loadu_si512((const void *)(q8 + 128))),
                                   _mm512_permutexvar_epi16(idx45, sc));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w67, _mm512_loadu_si512((const void *)(q8 + 192))),
                                   _mm512_permutexvar_epi16(idx67, sc));
        acc = kq_tiled_step_min(_mm512_reduce_add_epi32(sumi), M, kq_h2f(x[i].d), kq_h2f(x[i].dmin), y[i].d, acc);
    }
    *s = acc;
#elif defined(__AVX2__)
    float acc = 0.0f;
    for (int i = 0; i < nb; ++i) {
        int32_t M;
        const __m256i sumi = kq_q5k_lanes(x + i, y + i, &M);
        acc = kq_tiled_step_min(kq_hsum_epi32_256(sumi), M, kq_h2f(x[i].d), kq_h2f(x[i].dmin), y[i].d, acc);
    }
    *s = acc;
#else
    float sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        uint8_t sc[8], mn[8];
        kq_scale_min_k4(x[i].scales, sc, mn);
        int summs = 0;
        for (int j = 0; j < 16; ++j) summs += y[i].bsums[j] * mn[j / 2];
        int8_t q[QK_K];
        for (int j = 0; j < 4; ++j)
            for (int l = 0; l < 32; ++l) {
                const uint8_t h = x[i].qh[l];
                q[64 * j + l] = (int8_t)((x[i].qs[32 * j + l] & 0xF) | (((h >> (2 * j)) & 1) << 4));
                q[64 * j + 32 + l] = (int8_t)((x[i].qs[32 * j + l] >> 4) | (((h >> (2 * j + 1)) & 1) << 4));
            }
        int isum = 0;
        for (int j = 0; j < 8; ++j)
            isum += sc[j] * (kq_dot16(q + 32 * j, y[i].qs + 32 * j) + kq_dot16(q + 32 * j + 16, y[i].qs + 32 * j + 16));
        sumf = kq_tiled_step_min(isum, summs, kq_h2f(x[i].d), kq_h2f(x[i].dmin), y[i].d, sumf);
    }
    *s = sumf;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * Q6_K: 16 sub-blocks of 16, 6-bit quants stored +32 (4 low bits in ql, 2 high in qh), signed
 * 8-bit scales. Per 128 elements: ql[0..32) low nibbles = elements 0..31, ql[32..64) low =
 * 32..63, ql[0..32) high = 64..95, ql[32..64) high = 96..127; qh bits 2s..2s+1 of qh[l] are the
 * high bits of element 32s + l.
 */
/* the vec_dot of nb blocks (inlined into lp_gemv_q6_K_q8_K's row loop too) */
#if defined(__AVX2__)
/* one Q6_K block's integer sum in 8 int32 lanes (the +32 offset's share subtracted), the
 * AVX2 vec_dot's lanes (any lanes would do: their total is exact) */
KQ_INLINE __m256i kq_q6k_lanes(const block_q6_K *restrict x, const block_q8_K *restrict y) {
#if defined(LP_KQ_AVX512)
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i m48 = _mm512_set1_epi8(48);
    /* qh bits 0-1 | 2-3 to bits 4-5 (left by 4 | 2), and bits 4-5 | 6-7 (right by 0 | 2) */
    const __m512i shl = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i shr = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    /* int16 lane permutations: scale g, g+1, g+2, g+3 for each run of 8 lanes */
    const __m512i idx0 = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16(0), _mm_set1_epi16(1))),
        _mm256_setr_m128i(_mm_set1_epi16(2), _mm_set1_epi16(3)), 1);
    const __m512i four = _mm512_set1_epi16(4);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
    const __m512i sc = _mm512_castsi256_si512(sc16);
    const int8_t *q8 = y->qs;
    __m512i sumi = _mm512_setzero_si512();
    __m512i idx = idx0;
    for (int k = 0; k < 2; ++k) {
        const __m512i ql = _mm512_loadu_si512((const void *)(x->ql + 64 * k));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qh + 32 * k)));
        const __m512i wa = _mm512_or_si512(_mm512_and_si512(ql, m15), _mm512_and_si512(_mm512_sllv_epi64(qh, shl), m48));
        const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m15),
                                           _mm512_and_si512(_mm512_srlv_epi64(qh, shr), m48));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(wa, _mm512_loadu_si512((const void *)(q8 + 128 * k))),
                                   _mm512_permutexvar_epi16(idx, sc));
        idx = _mm512_add_epi16(idx, four);
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(wb, _mm512_loadu_si512((const void *)(q8 + 128 * k + 64))),
                                   _mm512_permutexvar_epi16(idx, sc));
        idx = _mm512_add_epi16(idx, four);
    }
    /* quants were used +32: subtract 32 x scale x bsums */
    const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
    return _mm256_sub_epi32(s8, _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)y->bsums)), 5));
#else
    const __m256i m15 = _mm256_set1_epi8(15);
    const __m256i m48 = _mm256_set1_epi8(48);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)x->scales);
    const kq_sc16 sc = kq_sc16_load(sc8);
    const __m256i off = _mm256_slli_epi32(
        _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), _mm256_loadu_si256((const __m256i *)y->bsums)), 5);
    const int8_t *q8 = y->qs;
    __m256i sumi = _mm256_setzero_si256();
#if defined(__GNUC__)
#pragma GCC unroll 2
#endif
    for (int k = 0; k < 2; ++k) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * k));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * k + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * k));
        /* 16-bit shifts by <= 4 then masking bits 4-5 keep every bit in its own byte */
        const __m256i w0 = _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m48));
        const __m256i w1 = _mm256_or_si256(_mm256_and_si256(ql1, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m48));
        const __m256i w2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15), _mm256_and_si256(qh, m48));
        const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m48));
        const __m256i p0 = kq_dot32(w0, q8 + 128 * k + 0, kq_scales16_pair(sc, 4 * k + 0));
        const __m256i p1 = kq_dot32(w1, q8 + 128 * k + 32, kq_scales16_pair(sc, 4 * k + 1));
        const __m256i p2 = kq_dot32(w2, q8 + 128 * k + 64, kq_scales16_pair(sc, 4 * k + 2));
        const __m256i p3 = kq_dot32(w3, q8 + 128 * k + 96, kq_scales16_pair(sc, 4 * k + 3));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
    }
    return _mm256_sub_epi32(sumi, off);
#endif
}
#endif

KQ_INLINE float kq_dot_q6_K(int nb, const block_q6_K *restrict x, const block_q8_K *restrict y) {
#if defined(__AVX2__)
    float acc = 0.0f;
    for (int i = 0; i < nb; ++i) acc = kq_tiled_step(kq_hsum_epi32_256(kq_q6k_lanes(x + i, y + i)), kq_h2f(x[i].d), y[i].d, acc);
    return acc;
#else
    float sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        int8_t q[QK_K];
        for (int k = 0; k < 2; ++k) {
            const uint8_t *ql = x[i].ql + 64 * k;
            const uint8_t *qh = x[i].qh + 32 * k;
            int8_t *a = q + 128 * k;
            for (int l = 0; l < 32; ++l) {
                a[l + 0] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                a[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                a[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                a[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        int isum = 0;
        for (int j = 0; j < 16; ++j) isum += x[i].scales[j] * kq_dot16(q + 16 * j, y[i].qs + 16 * j);
        sumf = kq_tiled_step(isum, kq_h2f(x[i].d), y[i].d, sumf);
    }
    return sumf;
#endif
}

KQ_API void lp_vec_dot_q6_K_q8_K(int n, float *restrict s, const void *restrict vx, const void *restrict vy) {
    *s = kq_dot_q6_K(n / QK_K, (const block_q6_K *)vx, (const block_q8_K *)vy);
}

/* ---------------------------------------------------------------------------------------------
 * Multi-column kernels (lp_quants.h, lp_gemm_fn): one weight row against nc <= LP_GEMM_COLS
 * activation rows at a time. Each weight block is decoded once (nibbles, high bits, scales,
 * mins) and multiplied with every column; per column the vec_dot's own operations are done in
 * the vec_dot's order: the same int32 lanes (integer sums, exact whatever their order) go
 * through the same float32 FMAs into per-column accumulators, reduced the same way, so every
 * output is bit-identical to the variant's lp_vec_dot_*_q8_K. Only the AVX2 / AVX-512 builds
 * have them; the portable build leaves them out (qmatmul.c then loops the vec_dot).
 * ggml counterpart: the nrc > 1 vec_dots and repack.cpp's gemm (which repack the weights).
 */
#if defined(__AVX2__)

#if defined(__GNUC__)
#define KQ_INLINE static inline __attribute__((always_inline))
#else
#define KQ_INLINE static inline
#endif

/* column c's block i: the activation rows are x_bytes apart */
#define KQ_COL(y, y_bytes, c, i) ((const block_q8_K *)((y) + (int64_t)(c) * (y_bytes)) + (i))

/* one entry point per type: columns in chunks of at most `cols` (the 256-bit kernels take 4:
 * with 16 ymm registers, 8 columns' accumulators spill; measured ~5x slower for AVX2 Q4_K),
 * rows one by one, the chunk's column count a compile-time constant in the inlined row kernel
 * (so its per-column accumulators stay in registers) */
#define KQ_GEMM_ENTRY(name, block_t, row_fn, cols) KQ_GEMM_ENTRY_L(KQ_API, name, block_t, row_fn, cols)
#define KQ_GEMM_ENTRY_L(linkage, name, block_t, row_fn, cols)                                                  \
    linkage void name(int n, float *restrict s, int64_t ld_s, const void *restrict w, int64_t row_bytes, int nr, \
                     const void *restrict x, int64_t x_bytes, int nc) {                                        \
        for (int c0 = 0; c0 < nc; c0 += (cols)) {                                                               \
            const int m = nc - c0 < (cols) ? nc - c0 : (cols);                                                  \
            const uint8_t *y = (const uint8_t *)x + c0 * x_bytes;                                               \
            float *sc = s + c0 * ld_s;                                                                          \
            for (int r = 0; r < nr; ++r) {                                                                      \
                const block_t *xr = (const block_t *)((const uint8_t *)w + r * row_bytes);                      \
                switch (m) {                                                                                    \
                case 1: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, 1); break;                               \
                case 2: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, 2); break;                               \
                case 3: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, 3); break;                               \
                KQ_GEMM_CASES_8(row_fn)                                                                         \
                default: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, (cols)); break;                         \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }
#if LP_GEMM_COLS == 8
#define KQ_GEMM_CASES_8(row_fn)                                                                                 \
    case 4: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, 4); break;                                           \
    case 5: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, 5); break;                                           \
    case 6: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, 6); break;                                           \
    case 7: row_fn(n / QK_K, sc + r, ld_s, xr, y, x_bytes, 7); break;
#elif LP_GEMM_COLS == 4
#define KQ_GEMM_CASES_8(row_fn)
#else
#error "KQ_GEMM_ENTRY handles LP_GEMM_COLS = 4 or 8"
#endif
#define KQ_COLS256 4 /* LP_GEMM_COLS >= 4 */

/* Q3_K (one kernel for both builds, as its vec_dot) */
KQ_INLINE void kq_gemm_q3_K_row(int nb, float *s, int64_t ld_s, const block_q3_K *x, const uint8_t *y, int64_t y_bytes,
                                const int nc) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m4 = _mm256_set1_epi8(4);
    float acc[LP_GEMM_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const float xd = kq_h2f(x[i].d);
        const __m128i sc8 = kq_scales_q3_vec(x[i].scales);
        const kq_sc16 sc = kq_sc16_load(sc8);
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)x[i].hmask);
        __m256i sumi[LP_GEMM_COLS];
        for (int c = 0; c < nc; ++c) sumi[c] = _mm256_setzero_si256();
        for (int k = 0; k < 2; ++k) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * k));
            for (int sh = 0; sh < 4; ++sh) {
                const int b = 4 * k + sh;
                __m256i h = b < 2 ? _mm256_slli_epi16(hbits, 2 - b) : _mm256_srli_epi16(hbits, b - 2);
                h = _mm256_and_si256(h, m4);
                const __m256i wq = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 2 * sh), m3), h);
                const __m256i scb = kq_scales16_pair(sc, b);
                for (int c = 0; c < nc; ++c)
                    sumi[c] = _mm256_add_epi32(sumi[c], kq_dot32(wq, KQ_COL(y, y_bytes, c, i)->qs + 128 * k + 32 * sh, scb));
            }
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K *yc = KQ_COL(y, y_bytes, c, i);
            const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)yc->bsums)), 2);
            acc[c] = kq_tiled_step(kq_hsum_epi32_256(_mm256_sub_epi32(sumi[c], off)), xd, yc->d, acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c * ld_s] = acc[c];
}
KQ_GEMM_ENTRY(lp_gemm_q3_K_q8_K, block_q3_K, kq_gemm_q3_K_row, KQ_COLS256)

#if defined(LP_KQ_AVX512)

/* the int16 scales of sub-blocks 2p (first 16 lanes) and 2p+1 (last 16) */
KQ_INLINE void kq_scale_pairs512(__m256i ms16, __m512i scp[4]) {
    const __m512i sc = _mm512_castsi256_si512(ms16);
    for (int p = 0; p < 4; ++p) {
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * p))),
                                               _mm256_set1_epi16((short)(2 * p + 1)), 1);
        scp[p] = _mm512_permutexvar_epi16(idx, sc);
    }
}

/* one Q4_K / Q5_K block's weights as 4 x 64 bytes (sub-blocks 2p | 2p+1) */
KQ_INLINE void kq_decode_q4_K(const block_q4_K *x, __m512i w[4]) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i b0 = _mm512_loadu_si512((const void *)x->qs);
    const __m512i b1 = _mm512_loadu_si512((const void *)(x->qs + 64));
    const __m512i l0 = _mm512_and_si512(b0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), m4);
    const __m512i l1 = _mm512_and_si512(b1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), m4);
    w[0] = _mm512_shuffle_i64x2(l0, h0, 0x44);
    w[1] = _mm512_shuffle_i64x2(l0, h0, 0xEE);
    w[2] = _mm512_shuffle_i64x2(l1, h1, 0x44);
    w[3] = _mm512_shuffle_i64x2(l1, h1, 0xEE);
}

KQ_INLINE void kq_decode_q5_K(const block_q5_K *x, __m512i w[4]) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i m16 = _mm512_set1_epi8(16);
    const __m512i sh01 = _mm512_setr_epi64(4, 4, 4, 4, 3, 3, 3, 3);
    const __m512i sh23 = _mm512_setr_epi64(2, 2, 2, 2, 1, 1, 1, 1);
    const __m512i sh45 = _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i sh67 = _mm512_setr_epi64(2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->qh));
    const __m512i b0 = _mm512_loadu_si512((const void *)x->qs);
    const __m512i b1 = _mm512_loadu_si512((const void *)(x->qs + 64));
    const __m512i l0 = _mm512_and_si512(b0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), m4);
    const __m512i l1 = _mm512_and_si512(b1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), m4);
    w[0] = _mm512_or_si512(_mm512_shuffle_i64x2(l0, hi0, 0x44), _mm512_and_si512(_mm512_sllv_epi64(qh, sh01), m16));
    w[1] = _mm512_or_si512(_mm512_shuffle_i64x2(l0, hi0, 0xEE), _mm512_and_si512(_mm512_sllv_epi64(qh, sh23), m16));
    w[2] = _mm512_or_si512(_mm512_shuffle_i64x2(l1, hi1, 0x44), _mm512_and_si512(_mm512_srlv_epi64(qh, sh45), m16));
    w[3] = _mm512_or_si512(_mm512_shuffle_i64x2(l1, hi1, 0xEE), _mm512_and_si512(_mm512_srlv_epi64(qh, sh67), m16));
}

/* Q4_K / Q5_K, AVX-512, up to LP_GEMM_COLS columns (w[p]: a block's weights of sub-blocks 2p | 2p+1,
 * scp[p] their scales): Q4_K each column's pair sums through kq_q4k_chain, Q5_K its block total
 * through kq_tiled_step_min */
KQ_INLINE void kq_gemm_q4_K_row(int nb, float *s, int64_t ld_s, const block_q4_K *x, const uint8_t *y, int64_t y_bytes,
                                const int nc) {
    float acc[LP_GEMM_COLS], accm[LP_GEMM_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = 0.0f, accm[c] = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x + i));
        __m512i scp[4], w[4];
        kq_scale_pairs512(ms16, scp);
        kq_decode_q4_K(x + i, w);
        const float xd = kq_h2f(x[i].d), xdmin = kq_h2f(x[i].dmin);
        for (int c = 0; c < nc; ++c) {
            const block_q8_K *yc = KQ_COL(y, y_bytes, c, i);
            __m512i P[4];
            for (int p = 0; p < 4; ++p)
                P[p] = _mm512_madd_epi16(_mm512_maddubs_epi16(w[p], _mm512_loadu_si512((const void *)(yc->qs + 64 * p))), scp[p]);
            kq_q4k_step(kq_sum4_512(P[0], P[1], P[2], P[3]), kq_mins_dot(ms16, yc->bsums), xd * yc->d, xdmin * yc->d,
                        &acc[c], &accm[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c * ld_s] = acc[c] - accm[c];
}

KQ_INLINE void kq_gemm_q5_K_row(int nb, float *s, int64_t ld_s, const block_q5_K *x, const uint8_t *y, int64_t y_bytes,
                                const int nc) {
    float acc[LP_GEMM_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x + i));
        __m512i scp[4], w[4];
        kq_scale_pairs512(ms16, scp);
        kq_decode_q5_K(x + i, w);
        const float xd = kq_h2f(x[i].d), xdmin = kq_h2f(x[i].dmin);
        for (int c = 0; c < nc; ++c) {
            const block_q8_K *yc = KQ_COL(y, y_bytes, c, i);
            __m512i sumi = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p)
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w[p], _mm512_loadu_si512((const void *)(yc->qs + 64 * p))),
                                           scp[p]);
            acc[c] = kq_tiled_step_min(_mm512_reduce_add_epi32(sumi), kq_hsum_epi32_128(kq_mins_dot(ms16, yc->bsums)), xd, xdmin,
                                       yc->d, acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c * ld_s] = acc[c];
}

/* Eight columns at once (KQ_COLS8), Q4_K / Q5_K / Q6_K, cache-blocked, from decoded weights:
 * - a weight block decoded (kq_panel: its quants as unsigned bytes, its scales spread to int16
 *   lanes, its mins and d: ~30 vector operations, as many as the 8 columns' products of it) is
 *   used by every group of 8 columns of the call: from KQ_PANEL_MIN_COLS columns on, the blocks of
 *   the call's rows are decoded once into a panel on the heap (up to KQ_PANEL_MAX bytes, ~3x the
 *   blocks' size) that the groups read; below, as they are used (registers). qmatmul.c hands
 *   these gemms LP_GEMM_COLS_K (512) tokens a call: a prompt's micro-batch decodes each block once
 *   per 64 rows, not once per 8 tokens;
 * - the columns' blocks are taken KQ_KC at a time and copied, with what depends only on the
 *   activations (each column's bsums summed per 32 elements, four columns to a vector, and its
 *   d), into one aligned buffer (kq_act8, ~21 KiB, in L1) prepared once for up to KQ_RC rows, each
 *   row's accumulators kept between chunks (kq_state8);
 * - per row and column a block then costs 4 vpdpbusd + 2 merges + 2 madd (kq_pairs; Q4_K: 4
 *   vpdpbusd + 2 packs + 2 madd, its pairs kept apart) and the share of a transposing reduction
 *   of the 8 columns' integer sums (exact), then the float32 part for the 8 columns at once in
 *   8 lanes (kq_q4k_chain / kq_tiled_step's operations in their order), the mins of four columns
 *   one madd.
 * Per output these are the vec_dot's float32 operations on the same integers in the same order:
 * the same bits. Measured (before the x86 prompt order of 2026-12-02; since then Q4_K's kernel
 * does ~45 % more operations a block, measured 0.93-1.06x main's time at 128-512 tokens, 1.3x at
 * 8-32) (one thread of the shared 2-core Intel Xeon
 * AVX-512 host, 64 rows x 2048 inputs x 512 tokens, A/B in one process, best of 30): decoding per
 * 8 columns (before) ~96 G multiply-adds/s, from the panel ~120 (Q4_K and Q6_K; ~+25 %); 8-15
 * tokens (decoded as used) ~+5 %, 16-31 about even; the products alone are as fast with maddubs +
 * madd as with vpdpbusd + merges (the latter's panel holds 2 scale vectors instead of 4). Tried
 * and not kept: 12 or 16 columns (slower), chunks of 4 or 16 blocks (the same), the d broadcasts
 * from memory (the same); before: chains interleaved across columns. */
#define KQ_COLS8 8
#define KQ_NG (KQ_COLS8 / 4) /* groups of 4 columns (the mins: 4 columns x 4 lanes a vector) */
#define KQ_KC 8  /* blocks of a chunk: 16 KiB of activations */
#define KQ_RC 64 /* rows a chunk serves (qmatmul.c passes 64 a call), their state 40 KiB of stack */
#define KQ_PANEL_MIN_COLS 32 /* columns from which a call decodes into a panel (below: as used) */
#define KQ_PANEL_MAX (1 << 20) /* bytes of decoded blocks a call holds (64 rows x 8192 inputs: 917 KiB) */
typedef struct {
    int8_t qs[KQ_KC][KQ_COLS8][QK_K];
    int16_t bs32[KQ_KC][KQ_NG][32]; /* block i, columns 4g .. 4g+3: 8 sums of 32 activations each */
    float ydm[KQ_KC][KQ_NG][16]; /* lane 4c + k: column 4g + c's d */
    float yd[KQ_KC][KQ_COLS8 < 16 ? 16 : KQ_COLS8]; /* columns' d */
    int16_t bsums[KQ_KC][KQ_COLS8][16];
} __attribute__((aligned(64))) kq_act8;
typedef struct {
    __m256 acc, accm; /* lane c: column c's accumulators (kq_q4k_chain's acc, accm; the others' acc) */
} kq_state8;

/* blocks [i0, i0 + kc) of the 8 columns at y into a */
KQ_INLINE void kq_act8_fill(int i0, int kc, const uint8_t *y, int64_t y_bytes, kq_act8 *a) {
    for (int i = 0; i < kc; ++i) {
        /* the d lanes past the columns are multiplied too (one 16-lane multiply): zeros, not
         * whatever the stack held (a denormal there costs a microcode assist a block) */
        for (int c = KQ_COLS8; c < (int)(sizeof a->yd[i] / sizeof a->yd[i][0]); ++c) a->yd[i][c] = 0.0f;
        for (int c = 0; c < KQ_COLS8; ++c) {
            const block_q8_K *yc = KQ_COL(y, y_bytes, c, i0 + i);
            for (int k = 0; k < 4; ++k)
                _mm512_store_si512((void *)(a->qs[i][c] + 64 * k), _mm512_loadu_si512((const void *)(yc->qs + 64 * k)));
            _mm256_store_si256((__m256i *)a->bsums[i][c], _mm256_loadu_si256((const __m256i *)yc->bsums));
            _mm_store_si128((__m128i *)&a->bs32[i][c >> 2][8 * (c & 3)], kq_bs32(yc->bsums));
            a->yd[i][c] = yc->d;
            for (int k = 0; k < 4; ++k) a->ydm[i][c >> 2][4 * (c & 3) + k] = yc->d;
        }
    }
}

/* one weight block decoded for the 8-column kernels */
typedef struct {
    __m512i w[4];  /* the quants as unsigned bytes, chunk p: kq_decode_* */
    __m512i sc[2]; /* int16 scale pairs of chunks 0, 1 and 2, 3 (kq_pair_scales) */
    union {
        struct {
            int16_t mins[8]; /* Q4_K / Q5_K: the 6-bit mins */
            float d, dmin;
        } k45;
        struct {
            int16_t nsc[16]; /* Q6_K: -32 x the 16 scales (the +32 offset's share) */
            float d;
        } k6;
    } u;
} __attribute__((aligned(64))) kq_panel;

/* The integer part of a block x column: int32 lane j of the vec_dot's sum is
 * sum_p s(p, j) * D(p, j), D(p, j) = the 4-byte dot product of weight chunk p's lane j with the
 * activations (the vec_dot's maddubs pairs of that lane, added) and s(p, j) the scale of its
 * sub-block: integers, exact in any order, and |D| <= 4 x 63 x 128 < 2^15 for the 4-, 5- and
 * 6-bit quants. Here each D is one vpdpbusd lane, chunks 2q and 2q+1 are merged into one
 * int16 pair per lane (D(2q, j) low, D(2q+1, j) high: a masked byte shuffle) and multiplied by
 * the scale pair (s(2q, j), s(2q+1, j)) in one madd / dpwssd. */
KQ_INLINE __m512i kq_pair_scales(__m512i s_even, __m512i s_odd) {
    /* s_even / s_odd hold s(p, j) in both int16 halves of lane j */
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, s_even, s_odd);
}

/* a zeroed register by the zeroing idiom (no execution port), not a copy of a zero register */
KQ_INLINE __m512i kq_zero512(void) {
    __m512i z;
    __asm__ volatile("vpxord %0, %0, %0" : "=v"(z));
    return z;
}


/* the merged pairs of chunks 0, 1 (pr[0]) and 2, 3 (pr[1]) of weights w against 256 activations */
KQ_INLINE void kq_pairs(const __m512i w[4], const int8_t *q8, __m512i pr[2]) {
    const __m512i up = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 1, 0, 0, 4, 5, 0, 0, 8, 9, 0, 0, 12, 13));
    const __mmask64 hi = 0xCCCCCCCCCCCCCCCCull; /* bytes 2, 3 of each lane */
    for (int q = 0; q < 2; ++q) {
        const __m512i lo = _mm512_dpbusd_epi32(kq_zero512(), w[2 * q], _mm512_load_si512((const void *)(q8 + 128 * q)));
        const __m512i up_d = _mm512_dpbusd_epi32(kq_zero512(), w[2 * q + 1], _mm512_load_si512((const void *)(q8 + 128 * q + 64)));
        pr[q] = _mm512_mask_shuffle_epi8(lo, hi, up_d, up);
    }
}

KQ_INLINE void kq_load_panel(const kq_panel *p, __m512i w[4], __m512i *sc01, __m512i *sc23) {
    for (int k = 0; k < 4; ++k) w[k] = _mm512_load_si512((const void *)&p->w[k]);
    *sc01 = _mm512_load_si512((const void *)&p->sc[0]);
    *sc23 = _mm512_load_si512((const void *)&p->sc[1]);
}

/* Q4_K / Q5_K: one block decoded into p */
#define KQ_Q45_PANEL(type)                                                                                      \
    KQ_INLINE void kq_panel_##type(const block_##type *x, kq_panel *p) {                                        \
        const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x));                              \
        __m512i scp[4], w[4];                                                                                   \
        kq_scale_pairs512(ms16, scp);                                                                           \
        kq_decode_##type(x, w);                                                                                 \
        for (int k = 0; k < 4; ++k) _mm512_store_si512((void *)&p->w[k], w[k]);                                 \
        _mm512_store_si512((void *)&p->sc[0], kq_pair_scales(scp[0], scp[1]));                                  \
        _mm512_store_si512((void *)&p->sc[1], kq_pair_scales(scp[2], scp[3]));                                  \
        _mm_store_si128((__m128i *)p->u.k45.mins, _mm256_extracti128_si256(ms16, 1));                           \
        p->u.k45.d = kq_h2f(x->d);                                                                              \
        p->u.k45.dmin = kq_h2f(x->dmin);                                                                        \
    }
KQ_Q45_PANEL(q5_K)

/* Q4_K's panel: sc[q] are the int16 scales for kq_gemm_q4_K_block8's packs of chunks 2q, 2q+1: per
 * 128 bits, lanes 0-1 (elements 0-7 of a sub-block) (sc[4q] x 4, sc[4q+2] x 4), lanes 2-3 (elements
 * 8-15) (sc[4q+1] x 4, sc[4q+3] x 4) */
KQ_INLINE void kq_panel_q4_K(const block_q4_K *x, kq_panel *p) {
    const __m256i ms16 = _mm256_cvtepu8_epi16(kq_scale_min_k4_vec(x));
    __m512i w[4];
    kq_decode_q4_K(x, w);
    for (int k = 0; k < 4; ++k) _mm512_store_si512((void *)&p->w[k], w[k]);
    for (int q = 0; q < 2; ++q) {
        const __m128i lo = _mm_setr_epi16((short)(4 * q), (short)(4 * q), (short)(4 * q), (short)(4 * q), (short)(4 * q + 2),
                                          (short)(4 * q + 2), (short)(4 * q + 2), (short)(4 * q + 2));
        const __m128i hi = _mm_add_epi16(lo, _mm_set1_epi16(1));
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(lo)), _mm256_broadcastsi128_si256(hi), 1);
        _mm512_store_si512((void *)&p->sc[q], _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(ms16)));
    }
    _mm_store_si128((__m128i *)p->u.k45.mins, _mm256_extracti128_si256(ms16, 1));
    p->u.k45.d = kq_h2f(x->d);
    p->u.k45.dmin = kq_h2f(x->dmin);
}

/* per 128 bits [a0 + a1, a2 + a3, b0 + b1, b2 + b3] */
KQ_INLINE __m512i kq_h4(__m512i a, __m512i b) {
    const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0))),
                            _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1))));
}
/* 128-bit lanes [a.0 + a.1, a.2 + a.3, b.0 + b.1, b.2 + b.3] */
KQ_INLINE __m512i kq_l2(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
/* lane c = the sum of v[c]'s 16 lanes */
KQ_INLINE __m256i kq_sum8_512(const __m512i v[8]) {
    __m512i t[4];
    for (int k = 0; k < 4; ++k)
        t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
    const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
    const __m512i w = kq_l2(u0, u1);
    return _mm512_castsi512_si256(kq_l2(w, w));
}
/* lane c = the sum of column c's 4 lanes in m0 (columns 0-3, lanes 4c + k) and m1 (4-7) */
KQ_INLINE __m256i kq_sum_mins8(__m512i m0, __m512i m1) {
    const __m512i h = kq_h4(m0, m1);
    return _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), kq_h4(h, h)));
}
/* the mins sums of the 8 columns, lanes 4c + p per group of 4: mn[2p] bs32[2p] + mn[2p+1] bs32[2p+1] */
KQ_INLINE void kq_mins8(const kq_panel *p, const kq_act8 *a, int i, __m512i md[KQ_NG]) {
    const __m512i mins = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)p->u.k45.mins));
    for (int g = 0; g < KQ_NG; ++g) md[g] = _mm512_madd_epi16(mins, _mm512_load_si512((const void *)a->bs32[i][g]));
}

/* Q4_K, one block of a row (its panel entry p) x the 8 columns' block i, through kq_q4k_chain for
 * the 8 at once. Per column the chunks' raw 4-byte dot products (vpdpbusd; |D| <= 4 x 63 x 127 <
 * 2^15) are packed to int16 two chunks at a time and multiplied by their scales (madd: in each 128
 * bits lanes 0-1 pair 2q, lanes 2-3 pair 2q+1); the 16 such vectors are summed per pair (kq_h4,
 * kq_l2: lanes 4c + p), moved to pair-major order and taken through the chain. */
KQ_INLINE void kq_gemm_q4_K_block8(const kq_panel *p, const kq_act8 *a, int i, __m256 *acc, __m256 *accm) {
    __m512i w[4];
    for (int k = 0; k < 4; ++k) w[k] = _mm512_load_si512((const void *)&p->w[k]);
    const __m512i sc0 = _mm512_load_si512((const void *)&p->sc[0]), sc1 = _mm512_load_si512((const void *)&p->sc[1]);
    __m512i h[KQ_COLS8];
    for (int c = 0; c < KQ_COLS8; ++c) {
        const int8_t *q8 = a->qs[i][c];
        __m512i x[4];
        for (int k = 0; k < 4; ++k) x[k] = _mm512_dpbusd_epi32(kq_zero512(), w[k], _mm512_load_si512((const void *)(q8 + 64 * k)));
        h[c] = kq_h4(_mm512_madd_epi16(_mm512_packs_epi32(x[0], x[1]), sc0), _mm512_madd_epi16(_mm512_packs_epi32(x[2], x[3]), sc1));
    }
    const __m512i r0 = kq_l2(kq_l2(h[0], h[1]), kq_l2(h[2], h[3])); /* lanes 4c + p, columns 0-3 */
    const __m512i r1 = kq_l2(kq_l2(h[4], h[5]), kq_l2(h[6], h[7]));
    __m512i md[KQ_NG];
    kq_mins8(p, a, i, md);
    /* pair-major, [S_p | M_p] for the 8 columns (lanes c | 8 + c): one FMA a pair for both chains */
    const __m512i i01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i i23 = _mm512_add_epi32(i01, _mm512_set1_epi32(2));
    const __m512i s01 = _mm512_permutex2var_epi32(r0, i01, r1), s23 = _mm512_permutex2var_epi32(r0, i23, r1);
    const __m512i m01 = _mm512_permutex2var_epi32(md[0], i01, md[1]), m23 = _mm512_permutex2var_epi32(md[0], i23, md[1]);
    const __m256 yd = _mm256_load_ps(a->yd[i]);
    const __m512 dd = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(p->u.k45.d), yd)),
                                         _mm256_mul_ps(_mm256_set1_ps(p->u.k45.dmin), yd), 1);
    __m512 am = _mm512_insertf32x8(_mm512_castps256_ps512(*acc), *accm, 1);
    am = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_i64x2(s01, m01, 0x44)), dd, am);
    am = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_i64x2(s01, m01, 0xEE)), dd, am);
    am = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_i64x2(s23, m23, 0x44)), dd, am);
    am = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_i64x2(s23, m23, 0xEE)), dd, am);
    *acc = _mm512_castps512_ps256(am);
    *accm = _mm512_extractf32x8_ps(am, 1);
}

/* Q5_K, 8 columns through kq_tiled_step_min: each column's block total (kq_pairs, madd / dpwssd
 * by the pair scales, summed) and mins total */
KQ_INLINE void kq_gemm_q5_K_block8(const kq_panel *p, const kq_act8 *a, int i, __m256 *acc) {
    __m512i w[4], sc01, sc23;
    kq_load_panel(p, w, &sc01, &sc23);
    __m512i t[KQ_COLS8];
    for (int c = 0; c < KQ_COLS8; ++c) {
        __m512i pr[2];
        kq_pairs(w, a->qs[i][c], pr);
        t[c] = _mm512_dpwssd_epi32(_mm512_madd_epi16(pr[0], sc01), pr[1], sc23);
    }
    __m512i md[KQ_NG];
    kq_mins8(p, a, i, md);
    const __m256 r = _mm256_mul_ps(_mm256_cvtepi32_ps(kq_sum8_512(t)), _mm256_set1_ps(p->u.k45.d));
    const __m256 r2 = _mm256_fnmadd_ps(_mm256_set1_ps(p->u.k45.dmin), _mm256_cvtepi32_ps(kq_sum_mins8(md[0], md[1])), r);
    *acc = _mm256_fmadd_ps(r2, _mm256_load_ps(a->yd[i]), *acc);
}

/* one row's blocks [0, kc) into its state: from the panel pn (at the chunk's first block), or,
 * with pn NULL, decoded from the row's blocks x as they are used (a local panel entry, kept in
 * registers) */
KQ_INLINE void kq_gemm_q4_K_row8(int kc, const kq_panel *pn, const block_q4_K *x, const kq_act8 *a, kq_state8 *st,
                                 int first) {
    __m256 acc = first ? _mm256_setzero_ps() : st->acc, accm = first ? _mm256_setzero_ps() : st->accm;
    for (int i = 0; i < kc; ++i) {
        kq_panel e;
        const kq_panel *p = pn != NULL ? pn + i : (kq_panel_q4_K(x + i, &e), &e);
        kq_gemm_q4_K_block8(p, a, i, &acc, &accm);
    }
    st->acc = acc;
    st->accm = accm;
}
KQ_INLINE void kq_gemm_q5_K_row8(int kc, const kq_panel *pn, const block_q5_K *x, const kq_act8 *a, kq_state8 *st,
                                 int first) {
    __m256 acc = first ? _mm256_setzero_ps() : st->acc;
    for (int i = 0; i < kc; ++i) {
        kq_panel e;
        const kq_panel *p = pn != NULL ? pn + i : (kq_panel_q5_K(x + i, &e), &e);
        kq_gemm_q5_K_block8(p, a, i, &acc);
    }
    st->acc = acc;
}

/* one Q6_K block for the gemms: w[p] = the 6-bit quants of sub-blocks 2p (low 256 bits) and
 * 2p + 1 (high), unsigned (+32 offset kept), and scq[p] = their int16 scales spread to match
 * (sc: the 16 scales in int16 lanes 0..15) */
KQ_INLINE void kq_decode_q6_K(const block_q6_K *x, __m512i sc, __m512i w[4], __m512i scq[4]) {
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i m48 = _mm512_set1_epi8(48);
    const __m512i shl = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i shr = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    const __m512i idx0 = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16(0), _mm_set1_epi16(1))),
        _mm256_setr_m128i(_mm_set1_epi16(2), _mm_set1_epi16(3)), 1);
    const __m512i four = _mm512_set1_epi16(4);
    __m512i idx = idx0;
    for (int k = 0; k < 2; ++k) {
        const __m512i ql = _mm512_loadu_si512((const void *)(x->ql + 64 * k));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qh + 32 * k)));
        w[2 * k] = _mm512_or_si512(_mm512_and_si512(ql, m15), _mm512_and_si512(_mm512_sllv_epi64(qh, shl), m48));
        w[2 * k + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m15),
                                       _mm512_and_si512(_mm512_srlv_epi64(qh, shr), m48));
        scq[2 * k] = _mm512_permutexvar_epi16(idx, sc);
        idx = _mm512_add_epi16(idx, four);
        scq[2 * k + 1] = _mm512_permutexvar_epi16(idx, sc);
        idx = _mm512_add_epi16(idx, four);
    }
}

KQ_INLINE void kq_panel_q6_K(const block_q6_K *x, kq_panel *p) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
    __m512i w[4], scq[4];
    kq_decode_q6_K(x, _mm512_castsi256_si512(sc16), w, scq);
    for (int k = 0; k < 4; ++k) _mm512_store_si512((void *)&p->w[k], w[k]);
    _mm512_store_si512((void *)&p->sc[0], kq_pair_scales(scq[0], scq[1]));
    _mm512_store_si512((void *)&p->sc[1], kq_pair_scales(scq[2], scq[3]));
    _mm256_store_si256((__m256i *)p->u.k6.nsc, _mm256_mullo_epi16(sc16, _mm256_set1_epi16(-32)));
    p->u.k6.d = kq_h2f(x->d);
}

/* Q6_K, eight columns through kq_tiled_step: each column's block total, the quants' +32 offset
 * (32 x scales . bsums) subtracted inside the 512-bit integer sum (one madd of the bsums with -32 x
 * scales into lanes 0..7, exact) */
KQ_INLINE void kq_gemm_q6_K_row8(int kc, const kq_panel *pn, const block_q6_K *x, const kq_act8 *a, kq_state8 *st,
                                 int first) {
    __m256 acc = first ? _mm256_setzero_ps() : st->acc;
    for (int i = 0; i < kc; ++i) {
        kq_panel e;
        const kq_panel *p = pn != NULL ? pn + i : (kq_panel_q6_K(x + i, &e), &e);
        __m512i w[4], sc01, sc23;
        kq_load_panel(p, w, &sc01, &sc23);
        const __m512i nsc32 = _mm512_zextsi256_si512(_mm256_load_si256((const __m256i *)p->u.k6.nsc));
        __m512i t[KQ_COLS8];
        for (int c = 0; c < KQ_COLS8; ++c) {
            __m512i pr[2];
            kq_pairs(w, a->qs[i][c], pr);
            const __m512i sumi = _mm512_madd_epi16(_mm512_zextsi256_si512(_mm256_load_si256((const __m256i *)a->bsums[i][c])), nsc32);
            t[c] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sumi, pr[0], sc01), pr[1], sc23);
        }
        const __m256 r = _mm256_mul_ps(_mm256_cvtepi32_ps(kq_sum8_512(t)), _mm256_set1_ps(p->u.k6.d));
        acc = _mm256_fmadd_ps(r, _mm256_load_ps(a->yd[i]), acc);
    }
    st->acc = acc;
}

/* the 8 columns' results out of a row's state */
KQ_INLINE void kq_finish8(const kq_state8 *st, float *s, int64_t ld_s, int mins) {
    float v[KQ_COLS8];
    _mm256_storeu_ps(v, mins ? _mm256_sub_ps(st->acc, st->accm) : st->acc);
    for (int c = 0; c < KQ_COLS8; ++c) s[c * ld_s] = v[c];
}

KQ_INLINE void kq_gemm_q6_K_row(int nb, float *s, int64_t ld_s, const block_q6_K *x, const uint8_t *y, int64_t y_bytes,
                                const int nc) {
    float acc[LP_GEMM_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const float xd = kq_h2f(x[i].d);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        const __m512i sc = _mm512_castsi256_si512(sc16);
        __m512i w[4], scq[4];
        kq_decode_q6_K(&x[i], sc, w, scq);
        for (int c = 0; c < nc; ++c) {
            const block_q8_K *yc = KQ_COL(y, y_bytes, c, i);
            __m512i sumi = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p)
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(w[p], _mm512_loadu_si512((const void *)(yc->qs + 64 * p))),
                                           scq[p]);
            __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
            s8 = _mm256_sub_epi32(s8, _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)yc->bsums)), 5));
            acc[c] = kq_tiled_step(kq_hsum_epi32_256(s8), xd, yc->d, acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c * ld_s] = acc[c];
}

#else /* AVX2 */

#endif /* LP_KQ_AVX512 */

#if defined(LP_KQ_AVX512)
#define KQ_COLS_K LP_GEMM_COLS
#else
#define KQ_COLS_K KQ_COLS256
#endif
#if defined(LP_KQ_AVX512)
/* Whole groups of 8 columns through the _row8 kernels, the rest 4 at a time. With two groups or
 * more, the blocks of the call's rows are decoded once into a panel on the heap (rows in chunks
 * whose panel fits KQ_PANEL_MAX) that every group reads; with one group (a decode batch of 8-15
 * tokens), or where the panel cannot be allocated, each row's blocks are decoded chunk by chunk as
 * they are used, into KQ_KC panel entries on the stack. The same kernels either way, so the same
 * bits: each output is its vec_dot's. */
#define KQ_GEMM_PANEL(type, state_t, finish)                                                               \
    KQ_GEMM_ENTRY_L(static, kq_gemm4_##type, block_##type, kq_gemm_##type##_row, KQ_COLS_K)                      \
    KQ_API void lp_gemm_##type##_q8_K(int n, float *restrict s, int64_t ld_s, const void *restrict w, int64_t row_bytes, \
                                      int nr, const void *restrict x, int64_t x_bytes, int nc) {                \
        const int nb = n / QK_K;                                                                                \
        const int c_end = nc / KQ_COLS8 * KQ_COLS8;                                                             \
        int rp = KQ_RC; /* rows a panel holds */                                                                \
        while (rp > 1 && (size_t)rp * nb * sizeof(kq_panel) > KQ_PANEL_MAX) rp /= 2;                            \
        if (rp > nr) rp = nr;                                                                                   \
        kq_panel *pn = c_end >= KQ_PANEL_MIN_COLS && nb > 0 ? aligned_alloc(64, (size_t)rp * nb * sizeof(kq_panel)) : NULL; \
        kq_act8 a;                                                                                              \
        state_t st[KQ_RC];                                                                                      \
        if (pn != NULL) {                                                                                       \
            for (int r0 = 0; r0 < nr; r0 += rp) {                                                               \
                const int rc = nr - r0 < rp ? nr - r0 : rp;                                                     \
                for (int r = 0; r < rc; ++r) {                                                                  \
                    const block_##type *xr = (const block_##type *)((const uint8_t *)w + (r0 + r) * row_bytes); \
                    for (int i = 0; i < nb; ++i) kq_panel_##type(xr + i, pn + (size_t)r * nb + i);              \
                }                                                                                               \
                for (int c0 = 0; c0 < c_end; c0 += KQ_COLS8) {                                                  \
                    const uint8_t *y = (const uint8_t *)x + c0 * x_bytes;                                       \
                    for (int i0 = 0; i0 < nb; i0 += KQ_KC) {                                                    \
                        const int kc = nb - i0 < KQ_KC ? nb - i0 : KQ_KC;                                       \
                        kq_act8_fill(i0, kc, y, x_bytes, &a);                                                   \
                        for (int r = 0; r < rc; ++r)                                                            \
                            kq_gemm_##type##_row8(kc, pn + (size_t)r * nb + i0, NULL, &a, st[r], i0 == 0);          \
                    }                                                                                           \
                    for (int r = 0; r < rc; ++r) finish(st[r], s + c0 * ld_s + r0 + r, ld_s);                   \
                }                                                                                               \
            }                                                                                                   \
            free(pn);                                                                                           \
        } else {                                                                                                \
            for (int c0 = 0; c0 < c_end; c0 += KQ_COLS8) {                                                      \
                const uint8_t *y = (const uint8_t *)x + c0 * x_bytes;                                           \
                for (int r0 = 0; r0 < nr; r0 += KQ_RC) {                                                        \
                    const int rc = nr - r0 < KQ_RC ? nr - r0 : KQ_RC;                                           \
                    for (int i0 = 0; i0 < nb; i0 += KQ_KC) {                                                    \
                        const int kc = nb - i0 < KQ_KC ? nb - i0 : KQ_KC;                                       \
                        kq_act8_fill(i0, kc, y, x_bytes, &a);                                                   \
                        for (int r = 0; r < rc; ++r) {                                                          \
                            const block_##type *xr = (const block_##type *)((const uint8_t *)w + (r0 + r) * row_bytes) + i0; \
                            kq_gemm_##type##_row8(kc, NULL, xr, &a, st[r], i0 == 0);                            \
                        }                                                                                       \
                    }                                                                                           \
                    for (int r = 0; r < rc; ++r) finish(st[r], s + c0 * ld_s + r0 + r, ld_s);                   \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        if (c_end < nc)                                                                                         \
            kq_gemm4_##type(n, s + c_end * ld_s, ld_s, w, row_bytes, nr, (const uint8_t *)x + c_end * x_bytes, x_bytes, \
                            nc - c_end);                                                                        \
    }
typedef kq_state8 kq_st8[1];
#define KQ_FINISH_MINS(st, s, ld) kq_finish8(st, s, ld, 1)
#define KQ_FINISH(st, s, ld) kq_finish8(st, s, ld, 0)
KQ_GEMM_PANEL(q4_K, kq_st8, KQ_FINISH_MINS)
KQ_GEMM_PANEL(q5_K, kq_st8, KQ_FINISH)
KQ_GEMM_PANEL(q6_K, kq_st8, KQ_FINISH)
#else
/* AVX2 prompts and decode batches of Q4_K, Q5_K and Q6_K (lp_gemm_*, any nc; from KQ_X4_MIN_COLS
 * columns on the 4 rows x 4 columns kernels further below, these for fewer). The columns go in
 * groups of 4; per group, what every row needs of them is prepared once (kq_q4c for Q4_K and Q5_K:
 * their d and bsums summed per 32, two columns a vector; kq_q6c: their d). Each row's blocks are
 * decoded into entries (kq_q4p, kq_q5p, kq_q6p: the quants as bytes, each scale broadcast for
 * madd): once a call into a panel on the heap when there are enough groups (KQ_AVX2_GEMM's G),
 * else per group as used, one entry on the stack. Per block and group (kq_<type>_block4) the
 * vec_dot's integers and float operations, so the same bits: Q4_K's pair sums reduced for the 4
 * columns at once by an unpack-and-add tree into pair-major [pair 0 | pair 1], [pair 2 | pair 3]
 * and taken through kq_q4k_chain in 4 float32 lanes; Q5_K's and Q6_K's block totals
 * (kq_sum4_256) through kq_tiled_step(_min) in 4 lanes. A missing column (c >= nc) is computed
 * (a copy of the last) and not stored. Measured (stop 23, 2 threads, the AVX2 library, one
 * layer's 7 matrices of the 1B shape, A/B in one process), against one column at a time with
 * scalar steps and each row decoded per group: 512 tokens Q4_K_M 430 / 473 -> 324 / 346 ms with
 * the 4-column reductions, then 348 -> 286 with Q4_K's panel; --pure Q4_K 328 -> 249 (panel),
 * Q6_K 366 -> 317 (reductions), Q5_K 440 -> 381 (reductions) -> 271 (panel). */
typedef struct {
    __m256i lo[4], hi[4]; /* sub-blocks 2j and 2j + 1: the quants as bytes */
    __m256i sc[8];        /* scale k in every int16 lane */
    __m256i mins;         /* the 8 mins as int16, in both 128-bit lanes */
    float d, dmin;
} kq_q4p;
typedef struct {
    __m256i bs01, bs23; /* [bs32 of column 0 | of column 1], [2 | 3] (kq_mins_dot's) */
    float yd[4];
} kq_q4c;
typedef struct {
    __m256i w[8];  /* elements 32k .. 32k + 31 as q + 32 (0..63) */
    __m256i sc[8]; /* their two 16-element sub-blocks' scales (kq_scales16_pair) */
    __m256i sc16;  /* the 16 scales (the +32 offset's share: 32 x scale x bsums) */
    float d;
} kq_q6p;
typedef struct {
    float yd[4];
} kq_q6c;
typedef kq_q4p kq_q5p; /* Q5_K's entries: the quants with their fifth bit (0..31) */

/* the scales, mins, d and dmin of a Q4_K or Q5_K block (the same first 16 bytes) into p */
KQ_INLINE void kq_q45p_head(const block_q4_K *x, kq_q4p *p) {
    const __m128i sm8 = kq_scale_min_k4_vec(x);
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm8));
    for (int k = 0; k < 8; ++k) _mm256_store_si256(&p->sc[k], kq_scale16_bcast(sc, k));
    _mm256_store_si256(&p->mins, _mm256_broadcastsi128_si256(_mm_unpackhi_epi8(sm8, _mm_setzero_si128())));
    p->d = kq_h2f(x->d);
    p->dmin = kq_h2f(x->dmin);
}

KQ_INLINE void kq_q4p_fill(const block_q4_K *x, kq_q4p *p) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    kq_q45p_head(x, p);
    for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
        _mm256_store_si256(&p->lo[j], _mm256_and_si256(bits, m4));
        _mm256_store_si256(&p->hi[j], _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4));
    }
}

KQ_INLINE void kq_q6p_fill(const block_q6_K *x, kq_q6p *p) {
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)x->scales);
    const kq_sc16 sc = kq_sc16_load(sc8);
    _mm256_store_si256(&p->sc16, _mm256_cvtepi8_epi16(sc8));
    for (int k = 0; k < 2; ++k) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * k));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * k + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * k));
        __m256i *w = p->w + 4 * k;
        _mm256_store_si256(w, _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m48)));
        _mm256_store_si256(w + 1, _mm256_or_si256(_mm256_and_si256(ql1, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m48)));
        _mm256_store_si256(w + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15), _mm256_and_si256(qh, m48)));
        _mm256_store_si256(w + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                                                  _mm256_and_si256(_mm256_srli_epi16(qh, 2), m48)));
        for (int j = 0; j < 4; ++j) _mm256_store_si256(&p->sc[4 * k + j], kq_scales16_pair(sc, 4 * k + j));
    }
    p->d = kq_h2f(x->d);
}

KQ_INLINE void kq_q5p_fill(const block_q5_K *x, kq_q5p *p) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m16 = _mm256_set1_epi8(16);
    kq_q45p_head((const block_q4_K *)x, p);
    const __m256i hbits = _mm256_loadu_si256((const __m256i *)x->qh);
    for (int j = 0; j < 4; ++j) { /* qh bit 2j (2j + 1) of element l moved to bit 4 */
        const int bl = 2 * j, bh = 2 * j + 1;
        const __m256i hl = bl <= 4 ? _mm256_slli_epi16(hbits, 4 - bl) : _mm256_srli_epi16(hbits, bl - 4);
        const __m256i hh = bh <= 4 ? _mm256_slli_epi16(hbits, 4 - bh) : _mm256_srli_epi16(hbits, bh - 4);
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
        _mm256_store_si256(&p->lo[j], _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_and_si256(hl, m16)));
        _mm256_store_si256(&p->hi[j], _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), _mm256_and_si256(hh, m16)));
    }
}

/* columns yc[0..3]'s block i into c (a missing column repeats the last) */
KQ_INLINE void kq_q4c_fill(int i, const block_q8_K *const yc[4], kq_q4c *c) {
    __m128i bs32[4];
    for (int k = 0; k < 4; ++k) {
        bs32[k] = kq_bs32(yc[k][i].bsums);
        c->yd[k] = yc[k][i].d;
    }
    _mm256_store_si256(&c->bs01, _mm256_setr_m128i(bs32[0], bs32[1]));
    _mm256_store_si256(&c->bs23, _mm256_setr_m128i(bs32[2], bs32[3]));
}
KQ_INLINE void kq_q6c_fill(int i, const block_q8_K *const yc[4], kq_q6c *c) {
    for (int k = 0; k < 4; ++k) c->yd[k] = yc[k][i].d;
}

/* one Q4_K block (entry p) x the 4 columns' block i, through kq_q4k_chain (lanes: columns) */
KQ_INLINE void kq_q4_K_block4(const kq_q4p *p, const block_q8_K *const yc[4], int i, const kq_q4c *ci, const int nc,
                              __m128 *acc, __m128 *accm) {
    (void)nc;
    __m256i u[4]; /* per 128-bit lane [columns 0-3] of pair j, each lane half the sum */
    for (int j = 0; j < 4; ++j) {
        const __m256i lo = _mm256_load_si256(&p->lo[j]), hi = _mm256_load_si256(&p->hi[j]);
        __m256i pc[4];
        for (int c = 0; c < 4; ++c) {
            const int8_t *q8 = yc[c][i].qs + 64 * j;
            pc[c] = _mm256_add_epi32(kq_dot32(lo, q8, _mm256_load_si256(&p->sc[2 * j])),
                                     kq_dot32(hi, q8 + 32, _mm256_load_si256(&p->sc[2 * j + 1])));
        }
        u[j] = kq_t4(pc[0], pc[1], pc[2], pc[3]);
    }
    __m128 sf[4], mf[4];
    kq_t4_pairs(u, sf);
    /* [M pairs 0-3 of column 0 | of column 1], [2 | 3] -> pair-major */
    const __m256i mins = _mm256_load_si256(&p->mins);
    kq_t4_mins(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, _mm256_load_si256(&ci->bs01))),
               _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, _mm256_load_si256(&ci->bs23))), mf);
    const __m128 ydv = _mm_loadu_ps(ci->yd);
    const __m128 dd = _mm_mul_ps(_mm_set1_ps(p->d), ydv), dm = _mm_mul_ps(_mm_set1_ps(p->dmin), ydv);
    for (int k = 0; k < 4; ++k) {
        *acc = _mm_fmadd_ps(sf[k], dd, *acc);
        *accm = _mm_fmadd_ps(mf[k], dm, *accm);
    }
}

/* one Q5_K block (entry p) x the 4 columns' block i, through kq_tiled_step_min (lanes: columns) */
KQ_INLINE void kq_q5_K_block4(const kq_q5p *p, const block_q8_K *const yc[4], int i, const kq_q4c *ci, const int nc,
                              __m128 *acc, __m128 *accm) {
    (void)nc;
    (void)accm;
    __m256i sumi[4];
    for (int c = 0; c < 4; ++c) sumi[c] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i lo = _mm256_load_si256(&p->lo[j]), hi = _mm256_load_si256(&p->hi[j]);
        for (int c = 0; c < 4; ++c) {
            const int8_t *q8 = yc[c][i].qs + 64 * j;
            sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(kq_dot32(lo, q8, _mm256_load_si256(&p->sc[2 * j])),
                                                                 kq_dot32(hi, q8 + 32, _mm256_load_si256(&p->sc[2 * j + 1]))));
        }
    }
    const __m128 S = _mm_cvtepi32_ps(kq_sum4_256(sumi[0], sumi[1], sumi[2], sumi[3]));
    /* the mins totals: [M pairs of column 0 | 1], [2 | 3] summed per column -> [c0, c1, c2, c3] */
    const __m256i mins = _mm256_load_si256(&p->mins);
    const __m256i h = _mm256_hadd_epi32(_mm256_madd_epi16(mins, _mm256_load_si256(&ci->bs01)),
                                        _mm256_madd_epi16(mins, _mm256_load_si256(&ci->bs23)));
    const __m256i hh = _mm256_hadd_epi32(h, h); /* [c0, c2, c0, c2 | c1, c3, c1, c3] */
    const __m128 M = _mm_cvtepi32_ps(_mm_unpacklo_epi32(_mm256_castsi256_si128(hh), _mm256_extracti128_si256(hh, 1)));
    const __m128 r = _mm_fmadd_ps(_mm_set1_ps(-p->dmin), M, _mm_mul_ps(S, _mm_set1_ps(p->d)));
    *acc = _mm_fmadd_ps(r, _mm_loadu_ps(ci->yd), *acc);
}

/* one Q6_K block (entry p) x the columns' block i, through kq_tiled_step (lanes: columns; a
 * missing column's lane stays 0) */
KQ_INLINE void kq_q6_K_block4(const kq_q6p *p, const block_q8_K *const yc[4], int i, const kq_q6c *ci, const int nc,
                              __m128 *acc, __m128 *accm) {
    (void)accm;
    __m256i sumi[KQ_COLS256];
    for (int c = 0; c < KQ_COLS256; ++c) sumi[c] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
        const __m256i w = _mm256_load_si256(&p->w[k]), scp = _mm256_load_si256(&p->sc[k]);
        for (int c = 0; c < nc; ++c) sumi[c] = _mm256_add_epi32(sumi[c], kq_dot32(w, yc[c][i].qs + 32 * k, scp));
    }
    const __m256i sc16 = _mm256_load_si256(&p->sc16);
    for (int c = 0; c < nc; ++c)
        sumi[c] = _mm256_sub_epi32(sumi[c], _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)yc[c][i].bsums)), 5));
    const __m128 S = _mm_cvtepi32_ps(kq_sum4_256(sumi[0], sumi[1], sumi[2], sumi[3]));
    *acc = _mm_fmadd_ps(_mm_mul_ps(S, _mm_set1_ps(p->d)), _mm_loadu_ps(ci->yd), *acc);
}

/* kq_gemm_<type>_rows, the AVX2 lp_gemm_<type>_q8_K below KQ_X4_MIN_COLS columns (the 4 x 4
 * kernels' fallback): kq_rows_<type> runs a row (its panel entries xp, or its
 * blocks x decoded as used) over one group's nb blocks; the entry point prepares the groups, and
 * the panel from more than G groups (measured on the 1B shape's layer: Q4_K from 9 columns even or
 * better, 8 columns 9.3 -> 10.0 ms with it; Q5_K 9 / 16 columns 8.2 -> 10.1, 13.3 -> 12.4; Q6_K
 * 9 / 16 / 20 / 32 columns 7.8 -> 9.0, 11.8 -> 12.3, 14.4 -> 14.6, 22.0 -> 20.4) */
#define KQ_AVX2_GEMM(type, linkage, fname, PT, CT, OUT, G)                                                       \
    KQ_INLINE void kq_rows_##type(int nb, float *s, int64_t ld_s, const PT *xp, const block_##type *x,             \
                                  const block_q8_K *const yc[4], const CT *cp, const int nc) {                       \
        __m128 acc = _mm_setzero_ps(), accm = _mm_setzero_ps();                                                  \
        if (xp != NULL) /* two loops: one body each, no select in the hot one */                                \
            for (int i = 0; i < nb; ++i) kq_##type##_block4(xp + i, yc, i, cp + i, nc, &acc, &accm);           \
        else                                                                                                     \
            for (int i = 0; i < nb; ++i) {                                                                       \
                PT e;                                                                                            \
                PT##_fill(x + i, &e);                                                                            \
                kq_##type##_block4(&e, yc, i, cp + i, nc, &acc, &accm);                                          \
            }                                                                                                    \
        float out[4];                                                                                            \
        _mm_storeu_ps(out, OUT);                                                                                 \
        for (int c = 0; c < nc; ++c) s[c * ld_s] = out[c];                                                       \
    }                                                                                                            \
    linkage void fname(int n, float *restrict s, int64_t ld_s, const void *restrict w, int64_t row_bytes, int nr,  \
                       const void *restrict x, int64_t x_bytes, int nc) {                                        \
        const int nb = n / QK_K;                                                                                 \
        if (nb <= 0 || nr <= 0 || nc <= 0) return;                                                               \
        PT *pn = nc > (G) * KQ_COLS256 ? aligned_alloc(32, (size_t)nr * nb * sizeof(PT)) : NULL;                 \
        for (int r = 0; pn != NULL && r < nr; ++r)                                                               \
            for (int i = 0; i < nb; ++i)                                                                         \
                PT##_fill((const block_##type *)((const uint8_t *)w + r * row_bytes) + i, pn + (int64_t)r * nb + i); \
        CT cp[nb];                                                                                               \
        for (int c0 = 0; c0 < nc; c0 += KQ_COLS256) {                                                            \
            const int m = nc - c0 < KQ_COLS256 ? nc - c0 : KQ_COLS256;                                           \
            const block_q8_K *yc[4];                                                                             \
            for (int c = 0; c < 4; ++c) yc[c] = KQ_COL((const uint8_t *)x, x_bytes, c0 + (c < m ? c : m - 1), 0);  \
            for (int i = 0; i < nb; ++i) CT##_fill(i, yc, cp + i);                                               \
            for (int r = 0; r < nr; ++r) {                                                                       \
                float *sr = s + c0 * ld_s + r;                                                                   \
                const PT *xp = pn != NULL ? pn + (int64_t)r * nb : NULL;                                         \
                const block_##type *xr = (const block_##type *)((const uint8_t *)w + r * row_bytes);             \
                switch (m) {                                                                                     \
                case 1: kq_rows_##type(nb, sr, ld_s, xp, xr, yc, cp, 1); break;                                  \
                case 2: kq_rows_##type(nb, sr, ld_s, xp, xr, yc, cp, 2); break;                                  \
                case 3: kq_rows_##type(nb, sr, ld_s, xp, xr, yc, cp, 3); break;                                  \
                default: kq_rows_##type(nb, sr, ld_s, xp, xr, yc, cp, 4); break;                                 \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        free(pn);                                                                                                \
    }
KQ_AVX2_GEMM(q4_K, static, kq_gemm_q4_K_rows, kq_q4p, kq_q4c, _mm_sub_ps(acc, accm), 2)
KQ_AVX2_GEMM(q5_K, static, kq_gemm_q5_K_rows, kq_q5p, kq_q4c, acc, 3)
KQ_AVX2_GEMM(q6_K, static, kq_gemm_q6_K_rows, kq_q6p, kq_q6c, acc, 6)
#undef KQ_AVX2_GEMM

/* Q4_K prompts on AVX2, 4 rows x 4 columns a step (lp_gemm_q4_K_q8_K from KQ_X4_MIN_COLS
 * columns). The kernels above take one row against 4 columns: per block and column 8 maddubs and
 * 8 madd (each 32-element sub-block's pair sums times its scale), 16 multiplies for 256
 * products. A core with one vector-multiply pipe (Zen 2: vpmaddubsw and vpmaddwd share it) is
 * bound by that count: the 1B shape's pp512 ran at ~0.9 multiplies a cycle (0.93x llama.cpp).
 * Here 4 rows are interleaved (ggml's repacked q4_K_8x8 does so with 8): a vector holds 8 quants
 * of each of 4 rows (row r in bytes 8r .. 8r+7), multiplied by 8 activations broadcast to the 4
 * rows, so the 4 maddubs of one sub-block's 32 elements add in int16 (|sum| <= 4 x 2 x 15 x 128
 * < 2^15) before one madd by the scales (row r's in lanes 4r .. 4r+3): per block, 4 rows and 4
 * columns 128 maddubs + 32 madd + 8 madd for the mins, 24 products a multiply instead of 16. The
 * integers are the vec_dot's (exact in any order) and each output's float32 chain is
 * kq_q4k_chain's, in 8 lanes (layout L of a column pair (c, c'): rows [0 1 0 1 | 2 3 2 3] x
 * columns [c c c' c' | c c c' c']): the same bits. */
typedef struct {
    __m256i w[8][4]; /* sub-block s, elements 8k .. 8k+7 of rows 0-3 (bytes 8r ..) */
    __m256i sc[8];   /* sub-block s's scale of row r in int16 lanes 4r .. 4r+3 */
    __m256i mn[4];   /* pair p: the int16 pair (mn[2p], mn[2p+1]) of layout L's row in each int32 lane */
    __m256 d, dmin;  /* layout L's rows */
} kq_q4p4;
typedef struct {
    __m256i bs[2][4]; /* column pair h, pair p: (bs32[2p], bs32[2p+1]) of layout L's column a lane */
    __m256 yd[2];     /* column pair h: layout L's columns' d */
} kq_q4c4;

static const int kq_rows_l[8] = {0, 1, 0, 1, 2, 3, 2, 3}; /* layout L: the row of each lane */

/* 4 rows' entries (kq_q4p / kq_q5p: each row's quants as bytes, scales, mins, d) interleaved into p */
static void kq_q45p4_interleave(const kq_q4p e[4], kq_q4p4 *p) {
    int16_t sc[8][16], mn[4][16];
    float dl[8], dml[8];
    for (int r = 0; r < 4; ++r)
        for (int k = 0; k < 8; ++k)
            for (int l = 0; l < 4; ++l) sc[k][4 * r + l] = (int16_t)_mm256_extract_epi16(e[r].sc[k], 0);
    for (int i = 0; i < 8; ++i) {
        int16_t m8[16];
        _mm256_storeu_si256((__m256i *)m8, e[kq_rows_l[i]].mins);
        for (int pp = 0; pp < 4; ++pp) mn[pp][2 * i] = m8[2 * pp], mn[pp][2 * i + 1] = m8[2 * pp + 1];
        dl[i] = e[kq_rows_l[i]].d, dml[i] = e[kq_rows_l[i]].dmin;
    }
    for (int sb = 0; sb < 8; ++sb) {
        uint8_t q[4][32]; /* row r's 32 quants of sub-block sb */
        for (int r = 0; r < 4; ++r) _mm256_storeu_si256((__m256i *)q[r], (sb & 1) ? e[r].hi[sb >> 1] : e[r].lo[sb >> 1]);
        for (int k = 0; k < 4; ++k) {
            uint8_t v[32];
            for (int r = 0; r < 4; ++r) memcpy(v + 8 * r, q[r] + 8 * k, 8);
            _mm256_store_si256(&p->w[sb][k], _mm256_loadu_si256((const __m256i *)v));
        }
        _mm256_store_si256(&p->sc[sb], _mm256_loadu_si256((const __m256i *)sc[sb]));
    }
    for (int pp = 0; pp < 4; ++pp) _mm256_store_si256(&p->mn[pp], _mm256_loadu_si256((const __m256i *)mn[pp]));
    _mm256_store_ps((float *)&p->d, _mm256_loadu_ps(dl));
    _mm256_store_ps((float *)&p->dmin, _mm256_loadu_ps(dml));
}
#define KQ_Q45P4_FILL(type)                                                                                      \
    static void kq_##type##p4_fill(const block_##type##_K *const x[4], kq_q4p4 *p) {                              \
        kq_q4p e[4];                                                                                             \
        for (int r = 0; r < 4; ++r) kq_##type##p_fill(x[r], e + r);                                               \
        kq_q45p4_interleave(e, p);                                                                               \
    }
KQ_Q45P4_FILL(q4)
KQ_Q45P4_FILL(q5)
#undef KQ_Q45P4_FILL
typedef kq_q4p4 kq_q5p4;
typedef kq_q4c4 kq_q5c4;
#define kq_q5c4_fill kq_q4c4_fill

/* columns yc[0..3]'s block i into c */
KQ_INLINE void kq_q4c4_fill(int i, const block_q8_K *const yc[4], kq_q4c4 *c) {
    for (int h = 0; h < 2; ++h) {
        const block_q8_K *a = yc[2 * h] + i, *b = yc[2 * h + 1] + i;
        const __m256i ab = _mm256_setr_m128i(kq_bs32(a->bsums), kq_bs32(b->bsums)); /* int32 lane p: pair p's */
        for (int pp = 0; pp < 4; ++pp)
            _mm256_store_si256(&c->bs[h][pp], _mm256_permutevar8x32_epi32(ab, _mm256_setr_epi32(pp, pp, 4 + pp, 4 + pp, pp, pp,
                                                                                                  4 + pp, 4 + pp)));
        _mm256_store_ps((float *)&c->yd[h], _mm256_setr_ps(a->d, a->d, b->d, b->d, a->d, a->d, b->d, b->d));
    }
}

/* 8 activations from memory, for a broadcast */
KQ_INLINE int64_t kq_ld64(const int8_t *q) {
    int64_t v;
    memcpy(&v, q, sizeof v);
    return v;
}

/* the integers of one Q4_K / Q5_K block (entry p) of 4 rows x the 4 columns' block (quants q8[c]):
 * v[c][p] pair p's sums [r0 r0 r1 r1 | r2 r2 r3 r3] (two lanes a row), sub-block by sub-block,
 * each weight vector loaded once for the 4 columns */
KQ_INLINE void kq_q45_pairs4x4(const kq_q4p4 *p, const int8_t *const q8[4], __m256i v[4][4]) {
    for (int pp = 0; pp < 4; ++pp) {
        __m256i t[4];
        for (int o = 0; o < 2; ++o) {
            const int sb = 2 * pp + o;
            __m256i a[4];
            for (int k = 0; k < 4; ++k) {
                const __m256i wk = _mm256_load_si256(&p->w[sb][k]);
                for (int c = 0; c < 4; ++c) {
                    const __m256i m = _mm256_maddubs_epi16(wk, _mm256_set1_epi64x(kq_ld64(q8[c] + 32 * sb + 8 * k)));
                    a[c] = k ? _mm256_add_epi16(a[c], m) : m;
                }
            }
            const __m256i scv = _mm256_load_si256(&p->sc[sb]);
            for (int c = 0; c < 4; ++c) {
                const __m256i m = _mm256_madd_epi16(a[c], scv);
                t[c] = o ? _mm256_add_epi32(t[c], m) : m;
            }
        }
        for (int c = 0; c < 4; ++c) v[c][pp] = t[c];
    }
}

/* Q4_K: one block of 4 rows x 4 columns into the chains of the column pairs (acc[h], accm[h],
 * layout L), kq_q4k_chain's steps */
KQ_INLINE void kq_q4_K_block4x4(const kq_q4p4 *p, const int8_t *const q8[4], const kq_q4c4 *ci, __m256 acc[2],
                                __m256 accm[2]) {
    __m256i v[4][4];
    kq_q45_pairs4x4(p, q8, v);
    __m256i hs[4][2]; /* column c, pairs 2q, 2q+1: [p: r0 r1, p+1: r0 r1 | p: r2 r3, p+1: r2 r3] */
    for (int c = 0; c < 4; ++c)
        for (int q = 0; q < 2; ++q) hs[c][q] = _mm256_hadd_epi32(v[c][2 * q], v[c][2 * q + 1]);
    for (int h = 0; h < 2; ++h) {
        const __m256 yd = _mm256_load_ps((const float *)&ci->yd[h]);
        const __m256 dd = _mm256_mul_ps(_mm256_load_ps((const float *)&p->d), yd);
        const __m256 dm = _mm256_mul_ps(_mm256_load_ps((const float *)&p->dmin), yd);
        __m256 a = acc[h], b = accm[h];
        for (int pp = 0; pp < 4; ++pp) {
            const __m256i x0 = hs[2 * h][pp >> 1], x1 = hs[2 * h + 1][pp >> 1];
            const __m256i S = (pp & 1) ? _mm256_unpackhi_epi64(x0, x1) : _mm256_unpacklo_epi64(x0, x1);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), dd, a);
            const __m256i M = _mm256_madd_epi16(_mm256_load_si256(&p->mn[pp]), _mm256_load_si256(&ci->bs[h][pp]));
            b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), dm, b);
        }
        acc[h] = a, accm[h] = b;
    }
}

/* Q5_K (5-bit quants: |sum of 4 maddubs| <= 4 x 2 x 31 x 128 < 2^15): the pairs' sums added to
 * the block total S, the mins' to M, each output through kq_tiled_step_min */
KQ_INLINE void kq_q5_K_block4x4(const kq_q4p4 *p, const int8_t *const q8[4], const kq_q4c4 *ci, __m256 acc[2],
                                __m256 accm[2]) {
    (void)accm;
    __m256i v[4][4], tot[4];
    kq_q45_pairs4x4(p, q8, v);
    for (int c = 0; c < 4; ++c) tot[c] = _mm256_add_epi32(_mm256_add_epi32(v[c][0], v[c][1]), _mm256_add_epi32(v[c][2], v[c][3]));
    for (int h = 0; h < 2; ++h) {
        const __m256i S = _mm256_hadd_epi32(tot[2 * h], tot[2 * h + 1]); /* layout L */
        __m256i M = _mm256_madd_epi16(_mm256_load_si256(&p->mn[0]), _mm256_load_si256(&ci->bs[h][0]));
        for (int pp = 1; pp < 4; ++pp)
            M = _mm256_add_epi32(M, _mm256_madd_epi16(_mm256_load_si256(&p->mn[pp]), _mm256_load_si256(&ci->bs[h][pp])));
        const __m256 r = _mm256_fnmadd_ps(_mm256_load_ps((const float *)&p->dmin), _mm256_cvtepi32_ps(M),
                                          _mm256_mul_ps(_mm256_cvtepi32_ps(S), _mm256_load_ps((const float *)&p->d)));
        acc[h] = _mm256_fmadd_ps(r, _mm256_load_ps((const float *)&ci->yd[h]), acc[h]);
    }
}

/* Q6_K the same way: a 16-element sub-block is 2 vectors of 8 quants a row (0..63 as unsigned
 * bytes), their 2 maddubs summed in int16 (|sum| <= 2 x 2 x 63 x 127 < 2^15) before one madd by its
 * scales; the +32 offset's share (32 x sum of scale x bsum16) one madd a pair of sub-blocks for
 * the column pair's 8 lanes; each output's block total through kq_tiled_step: 208 multiplies a
 * block of 4 rows x 4 columns instead of 272. */
typedef struct {
    __m256i w[8][4]; /* elements 32g + 8k .. + 7 of rows 0-3 (bytes 8r ..), as q + 32 */
    __m256i sc[16];  /* sub-block j's scale of row r in int16 lanes 4r .. 4r+3 */
    __m256i sp[8];   /* sub-blocks 2t, 2t+1: the int16 pair of scales of layout L's row in each int32 lane */
    __m256 d;        /* layout L's rows */
} kq_q6p4;
typedef struct {
    __m256i bs[2][8]; /* column pair h, sub-blocks 2t, 2t+1: the bsums pair of layout L's column a lane */
    __m256 yd[2];
} kq_q6c4;

static void kq_q6p4_fill(const block_q6_K *const x[4], kq_q6p4 *p) {
    int16_t sc[16][16], sp[8][16];
    float dl[8];
    uint8_t v[4][8][32]; /* row r, chunk g: elements 32g .. 32g+31 as q + 32 */
    for (int r = 0; r < 4; ++r) {
        kq_q6p e;
        kq_q6p_fill(x[r], &e);
        for (int g = 0; g < 8; ++g) _mm256_storeu_si256((__m256i *)v[r][g], e.w[g]);
        for (int j = 0; j < 16; ++j)
            for (int l = 0; l < 4; ++l) sc[j][4 * r + l] = x[r]->scales[j];
    }
    for (int i = 0; i < 8; ++i) {
        const int r = kq_rows_l[i];
        for (int t = 0; t < 8; ++t) sp[t][2 * i] = x[r]->scales[2 * t], sp[t][2 * i + 1] = x[r]->scales[2 * t + 1];
        dl[i] = kq_h2f(x[r]->d);
    }
    for (int g = 0; g < 8; ++g)
        for (int k = 0; k < 4; ++k) {
            uint8_t b[32];
            for (int r = 0; r < 4; ++r) memcpy(b + 8 * r, v[r][g] + 8 * k, 8);
            _mm256_store_si256(&p->w[g][k], _mm256_loadu_si256((const __m256i *)b));
        }
    for (int j = 0; j < 16; ++j) _mm256_store_si256(&p->sc[j], _mm256_loadu_si256((const __m256i *)sc[j]));
    for (int t = 0; t < 8; ++t) _mm256_store_si256(&p->sp[t], _mm256_loadu_si256((const __m256i *)sp[t]));
    _mm256_store_ps((float *)&p->d, _mm256_loadu_ps(dl));
}

KQ_INLINE void kq_q6c4_fill(int i, const block_q8_K *const yc[4], kq_q6c4 *c) {
    for (int h = 0; h < 2; ++h) {
        const block_q8_K *a = yc[2 * h] + i, *b = yc[2 * h + 1] + i;
        int32_t pa[8], pb[8];
        memcpy(pa, a->bsums, sizeof pa);
        memcpy(pb, b->bsums, sizeof pb);
        for (int t = 0; t < 8; ++t)
            _mm256_store_si256(&c->bs[h][t], _mm256_blend_epi32(_mm256_set1_epi32(pa[t]), _mm256_set1_epi32(pb[t]), 0xCC));
        _mm256_store_ps((float *)&c->yd[h], _mm256_setr_ps(a->d, a->d, b->d, b->d, a->d, a->d, b->d, b->d));
    }
}

KQ_INLINE void kq_q6_K_block4x4(const kq_q6p4 *p, const int8_t *const q8[4], const kq_q6c4 *ci, __m256 acc[2],
                                __m256 accm[2]) {
    (void)accm;
    __m256i t[4]; /* column c: the scaled sums [r0 r0 r1 r1 | r2 r2 r3 r3] */
    for (int j = 0; j < 16; ++j) {
        const int g = j >> 1, k0 = 2 * (j & 1);
        const __m256i w0 = _mm256_load_si256(&p->w[g][k0]), w1 = _mm256_load_si256(&p->w[g][k0 + 1]);
        const __m256i scv = _mm256_load_si256(&p->sc[j]);
        for (int c = 0; c < 4; ++c) {
            const int8_t *y = q8[c] + 16 * j;
            const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi64x(kq_ld64(y))),
                                               _mm256_maddubs_epi16(w1, _mm256_set1_epi64x(kq_ld64(y + 8))));
            const __m256i m = _mm256_madd_epi16(a, scv);
            t[c] = j ? _mm256_add_epi32(t[c], m) : m;
        }
    }
    for (int h = 0; h < 2; ++h) {
        __m256i off = _mm256_madd_epi16(_mm256_load_si256(&p->sp[0]), _mm256_load_si256(&ci->bs[h][0]));
        for (int u = 1; u < 8; ++u)
            off = _mm256_add_epi32(off, _mm256_madd_epi16(_mm256_load_si256(&p->sp[u]), _mm256_load_si256(&ci->bs[h][u])));
        const __m256i S = _mm256_sub_epi32(_mm256_hadd_epi32(t[2 * h], t[2 * h + 1]), _mm256_slli_epi32(off, 5));
        acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S), _mm256_load_ps((const float *)&p->d)),
                                 _mm256_load_ps((const float *)&ci->yd[h]), acc[h]);
    }
}

/* lp_gemm_<type>_q8_K of the 4 x 4 kernels: from KQ_X4_MIN_COLS columns, rows in groups of 4
 * decoded once a call into a panel (PT), the columns 4 at a time (a missing one repeats the last,
 * computed and not stored), what each needs prepared once (CT); fewer columns, the rows past a
 * multiple of 4, or no memory for the panel: the row-at-a-time gemm ROWS */
/* from 16 tokens (Zen 2, the 1B Q4_K_M, `llamapy bench -p N -n 0 -r 3`, 2 threads; tok/s with the
 * row-at-a-time kernels -> these): pp16 63.8 -> 66.5, pp24 66.7 -> 75.8; from 8 they lost: pp8
 * 56.2 -> 45.5, pp12 59.1 -> 56.5 (the 4-row panel decoded for 2-3 groups of tokens) */
#define KQ_X4_MIN_COLS 16
#define KQ_AVX2_GEMM4X4(type, PT, CT, ROWS, OUT)                                                                  \
    KQ_API void lp_gemm_##type##_q8_K(int n, float *restrict s, int64_t ld_s, const void *restrict w,             \
                                      int64_t row_bytes, int nr, const void *restrict x, int64_t x_bytes, int nc) { \
        const int nb = n / QK_K, nr4 = nc >= KQ_X4_MIN_COLS ? nr & ~3 : 0;                                       \
        PT *pn = nb > 0 && nr4 > 0 ? aligned_alloc(32, (size_t)(nr4 / 4) * nb * sizeof(PT)) : NULL;              \
        CT *cp = pn != NULL ? aligned_alloc(32, (size_t)nb * sizeof(CT)) : NULL;                                   \
        if (cp == NULL) {                                                                                        \
            free(pn);                                                                                            \
            ROWS(n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);                                                  \
            return;                                                                                              \
        }                                                                                                        \
        for (int g = 0; g < nr4 / 4; ++g)                                                                        \
            for (int i = 0; i < nb; ++i) {                                                                       \
                const block_##type *xr[4];                                                                       \
                for (int r = 0; r < 4; ++r) xr[r] = (const block_##type *)((const uint8_t *)w + (4 * g + r) * row_bytes) + i; \
                PT##_fill(xr, pn + (int64_t)g * nb + i);                                                         \
            }                                                                                                    \
        for (int c0 = 0; c0 < nc; c0 += 4) {                                                                     \
            const int m = nc - c0 < 4 ? nc - c0 : 4;                                                             \
            const block_q8_K *yc[4];                                                                             \
            for (int c = 0; c < 4; ++c) yc[c] = KQ_COL((const uint8_t *)x, x_bytes, c0 + (c < m ? c : m - 1), 0);  \
            for (int i = 0; i < nb; ++i) CT##_fill(i, yc, cp + i);                                               \
            for (int g = 0; g < nr4 / 4; ++g) {                                                                  \
                __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                                      \
                __m256 accm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                                     \
                for (int i = 0; i < nb; ++i) {                                                                   \
                    const int8_t *q8[4] = {yc[0][i].qs, yc[1][i].qs, yc[2][i].qs, yc[3][i].qs};                  \
                    kq_##type##_block4x4(pn + (int64_t)g * nb + i, q8, cp + i, acc, accm);                       \
                }                                                                                                \
                for (int h = 0; h < 2; ++h) {                                                                    \
                    float out[8];                                                                                \
                    _mm256_storeu_ps(out, OUT);                                                                  \
                    for (int l = 0; l < 8; ++l) {                                                                \
                        const int c = 2 * h + ((l >> 1) & 1);                                                    \
                        if (c < m) s[(int64_t)(c0 + c) * ld_s + 4 * g + kq_rows_l[l]] = out[l];                  \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        free(cp);                                                                                                \
        free(pn);                                                                                                \
        if (nr4 < nr)                                                                                            \
            ROWS(n, s + nr4, ld_s, (const uint8_t *)w + nr4 * row_bytes, row_bytes, nr - nr4, x, x_bytes, nc);   \
    }
KQ_AVX2_GEMM4X4(q4_K, kq_q4p4, kq_q4c4, kq_gemm_q4_K_rows, _mm256_sub_ps(acc[h], accm[h]))
KQ_AVX2_GEMM4X4(q5_K, kq_q5p4, kq_q5c4, kq_gemm_q5_K_rows, acc[h])
KQ_AVX2_GEMM4X4(q6_K, kq_q6p4, kq_q6c4, kq_gemm_q6_K_rows, acc[h])
#undef KQ_AVX2_GEMM4X4
#endif

#define KQ_GV_MAX_NB 128 /* the prepared activation row (AVX-512 Q4_K: 276 bytes a block) stays on the stack */
#if defined(LP_KQ_AVX512)
/* Decode (lp_quants.h lp_gemv_fn): one activation row against a thread's whole range of weight
 * rows in order so the weights stream from memory in order. Per output these are the vec_dot's
 * float32 operations on the same integers in its order (the same bits); what changes is around
 * them: no call and no constants per row, and for Q4_K on AVX-512 the activations are copied once
 * a call into the order of the weights' nibbles, [sub-blocks 0 | 2], [1 | 3], [4 | 6], [5 | 7]
 * (the low and high nibbles of qs[0..64) and qs[64..128) as they load), with their bsums summed
 * per 32 and d, so a block needs no shuffle of its weights: the integer sums of the low and high
 * nibbles, added, hold [pair 0 | pair 1] and [pair 2 | pair 3] (exact, any order), and four rows
 * go through kq_q4k_chain together (kq_gv_q4_K_rows4). Measured (noisy, one thread, 150 MB Q4_K matrices streamed from memory): ~+10-17 %
 * over one vec_dot per row; Q6_K ~+2-3 %. Software prefetch 384-1536 bytes ahead within the rows: no gain
 * there; the next group of rows prefetched (lp_pf_group, lp_quants.h) made them 1.3-3x faster from memory on a Zen 5 host.
 * ggml counterpart: ggml_vec_dot_q4_K_q8_K / q6_K, called per row by ggml_compute_forward_mul_mat. */
typedef struct {
    __m512i q[4]; /* the quants of sub-blocks [0 | 2], [1 | 3], [4 | 6], [5 | 7] */
    __m128i bs32; /* bsums summed per 32 elements (kq_mins_dot's) */
    float d;
} kq_gv_q4;

KQ_INLINE void kq_gv_q4_K_prep(int nb, const block_q8_K *y, kq_gv_q4 *a) {
    for (int i = 0; i < nb; ++i) {
        const int8_t *q8 = y[i].qs;
        for (int p = 0; p < 4; ++p) { /* p: 64 (p >> 1) + 32 (p & 1) elements in, then 64 more */
            const int8_t *o = q8 + 128 * (p >> 1) + 32 * (p & 1);
            a[i].q[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)o)),
                                           _mm256_loadu_si256((const __m256i *)(o + 64)), 1);
        }
        a[i].bs32 = kq_bs32(y[i].bsums);
        a[i].d = y[i].d;
    }
}

/* int16 lane shuffle (within 128-bit lanes of 8 scales): scale j for the first 16 lanes, k for the rest */
#define KQ_GV_IDX(j, k)                                                                                       \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)((2 * (j) + 1) << 8 | 2 * (j)))),   \
                       _mm256_set1_epi16((short)((2 * (k) + 1) << 8 | 2 * (k))), 1)

KQ_INLINE float kq_gv_q4_K_row(int nb, const block_q4_K *x, const kq_gv_q4 *a) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i i02 = KQ_GV_IDX(0, 2), i13 = KQ_GV_IDX(1, 3), i46 = KQ_GV_IDX(4, 6), i57 = KQ_GV_IDX(5, 7);
    float acc = 0.0f, accm = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const __m128i sm8 = kq_scale_min_k4_vec(x + i); /* 8 scales, 8 mins */
        const __m128i mins = _mm_unpackhi_epi8(sm8, _mm_setzero_si128());
        const __m512i sc = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm8)); /* the 8 int16 scales in each 128 bits */
        const __m512i b0 = _mm512_loadu_si512((const void *)x[i].qs);
        const __m512i b1 = _mm512_loadu_si512((const void *)(x[i].qs + 64));
        const __m512i l0 = _mm512_and_si512(b0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), m4);
        const __m512i l1 = _mm512_and_si512(b1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), m4);
        /* [sub-blocks 0 + 1 | 2 + 3] = [pair 0 | pair 1], and [pair 2 | pair 3] */
        __m512i z01 = _mm512_madd_epi16(_mm512_maddubs_epi16(l0, a[i].q[0]), _mm512_shuffle_epi8(sc, i02));
        z01 = _mm512_dpwssd_epi32(z01, _mm512_maddubs_epi16(h0, a[i].q[1]), _mm512_shuffle_epi8(sc, i13));
        __m512i z23 = _mm512_madd_epi16(_mm512_maddubs_epi16(l1, a[i].q[2]), _mm512_shuffle_epi8(sc, i46));
        z23 = _mm512_dpwssd_epi32(z23, _mm512_maddubs_epi16(h1, a[i].q[3]), _mm512_shuffle_epi8(sc, i57));
        kq_q4k_step(kq_sum_halves_512(z01, z23), _mm_madd_epi16(mins, a[i].bs32), kq_h2f(x[i].d) * a[i].d,
                    kq_h2f(x[i].dmin) * a[i].d, &acc, &accm);
    }
    return acc - accm;
}

/* Four rows at once, kq_q4k_chain in 4 float32 lanes (one per row: the same operations as
 * kq_gv_q4_K_row's, so the same bits). The rows' [pair 0 | pair 1], [pair 2 | pair 3] vectors are
 * summed per 256-bit half by one transposing reduction (unpack, add; lanes 4p + r in the end),
 * their mins sums by one permutation. */
KQ_INLINE void kq_gv_q4_K_rows4(int nb, const uint8_t *w, int64_t row_bytes, const kq_gv_q4 *a, float *s) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i i02 = KQ_GV_IDX(0, 2), i13 = KQ_GV_IDX(1, 3), i46 = KQ_GV_IDX(4, 6), i57 = KQ_GV_IDX(5, 7);
    const __m512i pidx = _mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 1, 3, 9, 11, 5, 7, 13, 15);
    const __m512i midx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const block_q4_K *x[4];
    for (int r = 0; r < 4; ++r) x[r] = (const block_q4_K *)(w + r * row_bytes);
    __m128 acc = _mm_setzero_ps(), accm = _mm_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 4 * row_bytes, nb);
    for (int i = 0; i < nb; ++i) {
        lp_pf_step(&pf, i);
        __m512i t[4];
        __m128i mr[4];
        for (int r = 0; r < 4; ++r) {
            const block_q4_K *xb = x[r] + i;
            const __m128i sm8 = kq_scale_min_k4_vec(xb);
            mr[r] = _mm_madd_epi16(_mm_unpackhi_epi8(sm8, _mm_setzero_si128()), a[i].bs32);
            const __m512i sc = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm8));
            const __m512i b0 = _mm512_loadu_si512((const void *)xb->qs);
            const __m512i b1 = _mm512_loadu_si512((const void *)(xb->qs + 64));
            const __m512i l0 = _mm512_and_si512(b0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), m4);
            const __m512i l1 = _mm512_and_si512(b1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), m4);
            __m512i z01 = _mm512_madd_epi16(_mm512_maddubs_epi16(l0, a[i].q[0]), _mm512_shuffle_epi8(sc, i02));
            z01 = _mm512_dpwssd_epi32(z01, _mm512_maddubs_epi16(h0, a[i].q[1]), _mm512_shuffle_epi8(sc, i13));
            __m512i z23 = _mm512_madd_epi16(_mm512_maddubs_epi16(l1, a[i].q[2]), _mm512_shuffle_epi8(sc, i46));
            z23 = _mm512_dpwssd_epi32(z23, _mm512_maddubs_epi16(h1, a[i].q[3]), _mm512_shuffle_epi8(sc, i57));
            /* per 128 bits [z01 0+2, z23 0+2, z01 1+3, z23 1+3] */
            t[r] = _mm512_add_epi32(_mm512_unpacklo_epi32(z01, z23), _mm512_unpackhi_epi32(z01, z23));
        }
        /* per 128 bits k: [z01 r, z23 r, z01 r+1, z23 r+1] summed over 128-bit lane k */
        const __m512i u01 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
        const __m512i u23 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
        const __m512 S = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(pidx, kq_l2(u01, u23))); /* lanes 4p + r */
        const __m512i m = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_m128i(mr[0], mr[1])), _mm256_setr_m128i(mr[2], mr[3]), 1);
        const __m512 M = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(midx, m));
        const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi16((short)x[0][i].d, (short)x[1][i].d, (short)x[2][i].d, (short)x[3][i].d,
                                                         (short)x[0][i].dmin, (short)x[1][i].dmin, (short)x[2][i].dmin,
                                                         (short)x[3][i].dmin));
        const __m128 yd = _mm_set1_ps(a[i].d);
        const __m128 dd = _mm_mul_ps(_mm256_castps256_ps128(dm), yd), dmn = _mm_mul_ps(_mm256_extractf128_ps(dm, 1), yd);
        acc = _mm_fmadd_ps(_mm512_castps512_ps128(S), dd, acc);
        accm = _mm_fmadd_ps(_mm512_castps512_ps128(M), dmn, accm);
        acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(S, 1), dd, acc);
        accm = _mm_fmadd_ps(_mm512_extractf32x4_ps(M, 1), dmn, accm);
        acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(S, 2), dd, acc);
        accm = _mm_fmadd_ps(_mm512_extractf32x4_ps(M, 2), dmn, accm);
        acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(S, 3), dd, acc);
        accm = _mm_fmadd_ps(_mm512_extractf32x4_ps(M, 3), dmn, accm);
    }
    _mm_storeu_ps(s, _mm_sub_ps(acc, accm));
}

KQ_API void lp_gemv_q4_K_q8_K(int n, float *restrict s, const void *restrict w, int64_t row_bytes, int nr,
                              const void *restrict x) {
    const int nb = n / QK_K;
    if (nb > KQ_GV_MAX_NB || nb == 0) {
        for (int r = 0; r < nr; ++r) lp_vec_dot_q4_K_q8_K(n, s + r, (const uint8_t *)w + r * row_bytes, x);
        return;
    }
    kq_gv_q4 a[nb];
    kq_gv_q4_K_prep(nb, (const block_q8_K *)x, a);
    int r = 0;
    for (; r + 4 <= nr; r += 4) kq_gv_q4_K_rows4(nb, (const uint8_t *)w + r * row_bytes, row_bytes, a, s + r);
    for (; r < nr; ++r) s[r] = kq_gv_q4_K_row(nb, (const block_q4_K *)((const uint8_t *)w + r * row_bytes), a);
}
#else
/* AVX2: four rows at once, kq_q4k_chain in 4 float32 lanes (one per row: the vec_dot's operations,
 * so its bits); the rest row by row through the vec_dot's body. Around the vec_dot's integer work
 * (which is most of it), in fewer vector operations than four vec_dots: the activations' bsums
 * summed per 32 once a call (bs32x2, in both 128-bit lanes), two rows' block headers in one
 * 256-bit vector (their scales and mins decoded together, their mins sums in one madd), the
 * 16 [row][pair] integer vectors reduced by one unpack-and-add tree straight into pair-major
 * order [pair 0 | pair 1], [pair 2 | pair 3], and the four rows' d and dmin gathered by shuffles.
 * Against the former per-row scalar scale decode, hadd reductions and transposes (stop 23, the same
 * bits): one thread, 1024 rows of the 1B shape's ffn_gate in cache, 58.4 -> 51.5 us; 2 threads from
 * memory, the 1B --pure Q4_K ffn matrices 16.9 / 16.4 -> 12.5 / 13.9 ms, Q4_K_M's layers 24.8 -> 22.6 ms. */
KQ_INLINE void kq_gv_q4_K_rows4(int nb, const uint8_t *w, int64_t row_bytes, const block_q8_K *y, const __m256i *bs32x2,
                                float *s) {
    const __m256i m4 = _mm256_set1_epi8(0xF), zero = _mm256_setzero_si256();
    /* int16 [d0 m0 d2 m2 d1 m1 d3 m3] -> [d0 d1 d2 d3 m0 m1 m2 m3] */
    const __m128i dsel = _mm_setr_epi8(0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15);
    const block_q4_K *x[4];
    for (int r = 0; r < 4; ++r) x[r] = (const block_q4_K *)(w + r * row_bytes);
    __m128 acc = _mm_setzero_ps(), accm = _mm_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 4 * row_bytes, nb);
    for (int i = 0; i < nb; ++i) {
        lp_pf_step(&pf, i);
        /* the first 16 bytes of rows 0 | 1 and 2 | 3: d, dmin, the scale bytes */
        const __m256i h01 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(x[0] + i))),
                                                    _mm_loadu_si128((const __m128i *)(x[1] + i)), 1);
        const __m256i h23 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(x[2] + i))),
                                                    _mm_loadu_si128((const __m128i *)(x[3] + i)), 1);
        const __m256i sm01 = kq_scale_min_k4_x2(h01), sm23 = kq_scale_min_k4_x2(h23); /* 8 scales, 8 mins a lane */
        /* [M pairs 0-3 of row 0 | of row 1], [rows 2 | 3] */
        const __m256 m01 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpackhi_epi8(sm01, zero), bs32x2[i]));
        const __m256 m23 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpackhi_epi8(sm23, zero), bs32x2[i]));
        const __m256i s01 = _mm256_unpacklo_epi8(sm01, zero), s23 = _mm256_unpacklo_epi8(sm23, zero);
        const __m256i sc[4] = {_mm256_permute4x64_epi64(s01, 0x44), _mm256_permute4x64_epi64(s01, 0xEE),
                               _mm256_permute4x64_epi64(s23, 0x44), _mm256_permute4x64_epi64(s23, 0xEE)};
        __m256i u[4]; /* per 128-bit lane [rows 0, 1, 2, 3] of pair p, each lane half the sum */
        for (int p = 0; p < 4; ++p) { /* pair by pair: its 4 rows' vectors reduced at once (registers) */
            __m256i pr[4];
            for (int r = 0; r < 4; ++r) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(x[r][i].qs + 32 * p));
                pr[r] = _mm256_add_epi32(kq_dot32(_mm256_and_si256(bits, m4), y[i].qs + 64 * p, kq_scale16_bcast(sc[r], 2 * p)),
                                         kq_dot32(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), y[i].qs + 64 * p + 32,
                                                  kq_scale16_bcast(sc[r], 2 * p + 1)));
            }
            u[p] = kq_t4(pr[0], pr[1], pr[2], pr[3]);
        }
        __m128 sf[4], mf[4]; /* pair-major: the rows' pair sums, their mins sums */
        kq_t4_pairs(u, sf);
        kq_t4_mins(m01, m23, mf);
        /* dword 0 of each header is (d, dmin): [d0m0 d2m2 . . | d1m1 d3m3 . .] -> qwords 0, 2 */
        const __m128i dq = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_unpacklo_epi32(h01, h23), _MM_SHUFFLE(3, 1, 2, 0)));
        const __m256 dm = _mm256_cvtph_ps(_mm_shuffle_epi8(dq, dsel));
        const __m128 yd = _mm_set1_ps(y[i].d);
        const __m128 dd = _mm_mul_ps(_mm256_castps256_ps128(dm), yd), dmn = _mm_mul_ps(_mm256_extractf128_ps(dm, 1), yd);
        for (int p = 0; p < 4; ++p) {
            acc = _mm_fmadd_ps(sf[p], dd, acc);
            accm = _mm_fmadd_ps(mf[p], dmn, accm);
        }
    }
    _mm_storeu_ps(s, _mm_sub_ps(acc, accm));
}

KQ_API void lp_gemv_q4_K_q8_K(int n, float *restrict s, const void *restrict w, int64_t row_bytes, int nr,
                              const void *restrict x) {
    const int nb = n / QK_K;
    const block_q8_K *y = (const block_q8_K *)x;
    int r = 0;
    if (nb <= KQ_GV_MAX_NB && nr >= 4) {
        __m256i bs32x2[nb > 0 ? nb : 1];
        for (int i = 0; i < nb; ++i) bs32x2[i] = _mm256_broadcastsi128_si256(kq_bs32(y[i].bsums));
        for (; r + 4 <= nr; r += 4) kq_gv_q4_K_rows4(nb, (const uint8_t *)w + r * row_bytes, row_bytes, y, bs32x2, s + r);
    }
    for (; r < nr; ++r) s[r] = kq_dot_q4_K(nb, (const block_q4_K *)((const uint8_t *)w + r * row_bytes), y);
}
#endif /* LP_KQ_AVX512 */

/* Decode of Q3_K, Q5_K (the AVX2 build; AVX-512 keeps its vec_dot a row) and Q6_K: four rows at
 * once, their blocks' integer lanes (kq_q3k/q5k/q6k_lanes, the vec_dots' own) summed together
 * (kq_sum4_256) and the vec_dot's float step in 4 float32 lanes — kq_tiled_step, Q5_K's
 * kq_tiled_step_min with -dmin negated exactly — so its bits; the rest row by row. A vec_dot a row
 * is one fmaf chain a block: on the Zen 2 host (bench/RESULTS.md stop 32), the 1B --pure files'
 * tg64 Q3_K 24.8 -> 29.9, Q5_K 19.0 -> 25.0 tok/s (Q6_K had this kernel before). */
KQ_INLINE void kq_gemv4_tiled(const int type, int n, float *restrict s, const uint8_t *restrict w, int64_t row_bytes,
                              int nr, const void *restrict x, lp_vec_dot_fn dot) {
    const int nb = n / QK_K;
    const block_q8_K *y = (const block_q8_K *)x;
    const int64_t bs = type == LP_TYPE_Q3_K ? (int64_t)sizeof(block_q3_K)
                     : type == LP_TYPE_Q5_K ? (int64_t)sizeof(block_q5_K) : (int64_t)sizeof(block_q6_K);
    const __m128 sign = _mm_set1_ps(-0.0f);
    int r = 0;
    for (; r + 4 <= nr; r += 4) {
        const uint8_t *w4 = w + r * row_bytes;
        __m128 acc = _mm_setzero_ps();
        const lp_pf pf = lp_pf_group(w4, 4 * row_bytes, nb);
        for (int i = 0; i < nb; ++i) {
            lp_pf_step(&pf, i);
            __m256i v[4];
            int32_t M[4] = {0};
            lp_half d[4], dmin[4] = {0};
            for (int k = 0; k < 4; ++k) {
                const uint8_t *b = w4 + k * row_bytes + i * bs;
                if (type == LP_TYPE_Q3_K) {
                    v[k] = kq_q3k_lanes((const block_q3_K *)b, y + i);
                    d[k] = ((const block_q3_K *)b)->d;
#if !defined(LP_KQ_AVX512)
                } else if (type == LP_TYPE_Q5_K) {
                    v[k] = kq_q5k_lanes((const block_q5_K *)b, y + i, &M[k]);
                    d[k] = ((const block_q5_K *)b)->d;
                    dmin[k] = ((const block_q5_K *)b)->dmin;
#endif
                } else {
                    v[k] = kq_q6k_lanes((const block_q6_K *)b, y + i);
                    d[k] = ((const block_q6_K *)b)->d;
                }
            }
            const __m128 xd = _mm_cvtph_ps(_mm_setr_epi16((short)d[0], (short)d[1], (short)d[2], (short)d[3], 0, 0, 0, 0));
            __m128 rv = _mm_mul_ps(_mm_cvtepi32_ps(kq_sum4_256(v[0], v[1], v[2], v[3])), xd);
            if (type == LP_TYPE_Q5_K) {
                const __m128 dm = _mm_cvtph_ps(_mm_setr_epi16((short)dmin[0], (short)dmin[1], (short)dmin[2], (short)dmin[3], 0, 0, 0, 0));
                rv = _mm_fmadd_ps(_mm_xor_ps(dm, sign), _mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)M)), rv);
            }
            acc = _mm_fmadd_ps(rv, _mm_set1_ps(y[i].d), acc);
        }
        _mm_storeu_ps(s + r, acc);
    }
    for (; r < nr; ++r) dot(n, s + r, w + r * row_bytes, x);
}

KQ_API void lp_gemv_q3_K_q8_K(int n, float *restrict s, const void *restrict w, int64_t row_bytes, int nr,
                              const void *restrict x) {
    kq_gemv4_tiled(LP_TYPE_Q3_K, n, s, w, row_bytes, nr, x, lp_vec_dot_q3_K_q8_K);
}

#if !defined(LP_KQ_AVX512)
KQ_API void lp_gemv_q5_K_q8_K(int n, float *restrict s, const void *restrict w, int64_t row_bytes, int nr,
                              const void *restrict x) {
    kq_gemv4_tiled(LP_TYPE_Q5_K, n, s, w, row_bytes, nr, x, lp_vec_dot_q5_K_q8_K);
}
#endif

KQ_API void lp_gemv_q6_K_q8_K(int n, float *restrict s, const void *restrict w, int64_t row_bytes, int nr,
                              const void *restrict x) {
    kq_gemv4_tiled(LP_TYPE_Q6_K, n, s, w, row_bytes, nr, x, lp_vec_dot_q6_K_q8_K);
}

#endif /* __AVX2__ */
