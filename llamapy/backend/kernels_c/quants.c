/* Activation quantization and the dot products of the non-K types on ggml's block layouts.
 *
 * ggml counterparts (ggml-cpu): arch/x86/quants.c quantize_row_q8_0 / q8_1 (the SIMD ones llama.cpp's
 * x86 builds run, not their _ref versions) and ggml_vec_dot_q4_1_q8_1, q5_0_q8_0, q5_1_q8_1,
 * q8_0_q8_0 (their AVX2 bodies' float order; Q4_0, which llama.cpp's x86 builds repack and run
 * through IQ4_NL's 8x8 kernels, is iquants.c's); vec.c ggml_vec_dot_f32 / f16 / bf16. The
 * ABI (block structs, names) is lp_quants.h's.
 *
 * Definitions (llamapy computes llama.cpp's x86 bits for these; the tests check them against
 * quants.quantize_q8_act and a float emulation of the sums below):
 *   q8_0 of a block of 32 floats: amax = max|x|, d = amax / 127 stored as f16, id = 127 / amax,
 *     q = round-half-to-EVEN(x * id) - NOT gguf.quants (ggml's reference: 1/d and roundf), which
 *     the KV cache's lp_quantize_row_q8_0_ref keeps.
 *   q8_1: the same q and d, plus s = f16(d * sum(q)) with the unrounded d.
 *   dot(q4_1, q8_1) = sum_blocks f16(dx) * f16(dy) * sum_j qx_j * qy_j + mx * sy  (exact int sum)
 *   dot(q5_0, q8_0) = ... (qx_j | hbit_j << 4) - 16 and no mins;  dot(q5_1, q8_1): (qx_j | hbit_j << 4), + mx * sy
 *   dot(q8_0, q8_0) = sum_blocks dx * dy * sum_j qx_j * qy_j
 *   f16 / bf16: the activations are rounded to f16 / bf16 first (ggml's vec_dot_type), products
 *     summed in float32.
 * The q types' float32 sums follow ggml's AVX2 order exactly in every variant (below, "dot
 * products: q types"); the float types' order is this file's own.
 *
 * SIMD: each q dot product has an AVX2 body (one 32-quant block per step: the nibbles widened to
 * bytes, u8 x s8 products summed pairwise to int16 with maddubs and then to int32 with madd, or in
 * one dpbusd where AVX-512 VNNI is there, times the two scales into the 8 float32 lanes of one
 * accumulator) and a portable C body (8 scalar lanes, fmaf) for every other target. The same file
 * is compiled once per variant (setup.py). The multi-column lp_gemm_* and the decode lp_gemv_* at
 * the end repeat the vec_dots' float operations exactly.
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

#define LP_API __attribute__((visibility("default")))

/* roundf for the reference quantizer: nearest, ties away from zero (numpy's np_roundf in gguf-py) */
static inline int lp_round(float v) { return (int)roundf(v); }

/* --- activation quantization ------------------------------------------------------------------ */

/* One block of 32 floats as llama.cpp's x86 build quantizes activations (arch/x86/quants.c
 * quantize_row_q8_0 / q8_1, used for every MUL_MAT input whose weight dots with q8_0 / q8_1):
 *   amax = max|x| (max_ps in ggml's tree: 4 vectors of 8 in order, then 8 -> 4 -> 2 -> 1),
 *   d = amax / 127 (stored as f16), id = 127 / amax (0 when amax == 0; NOT 1 / d),
 *   q = round-to-nearest-EVEN(x * id) (vroundps), then int32 -> int8 with saturation (packs),
 * and returns the sum of the int32 qs (q8_1's s = f16(d * sum)). ggml's reference quantizer
 * (quantize_row_q8_0_ref, = gguf.quants) uses 1/d and roundf instead: a different value on ~1 %
 * of blocks (ties and the 127/amax vs 1/(amax/127) rounding), and llama.cpp runs the SIMD one,
 * so every variant here computes the SIMD definition: the AVX2 body with ggml's instructions'
 * semantics, the portable one with the same max tree (a > b ? a : b is max_ps, nan included),
 * nearbyintf (ties to even under the default rounding mode) and the same saturation (a nan or
 * infinite product is cvtps's 0x80000000, so -128). */
static inline float lp_maxps(float a, float b) { return a > b ? a : b; }

static inline int lp_quant_block32(const float *x, int8_t *qs, float *pd) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + 8 * j);
    __m256 m = _mm256_andnot_ps(sign, v[0]);
    for (int j = 1; j < 4; j++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 vid = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    __m256i qi[4];
    for (int j = 0; j < 4; j++)
        qi[j] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i acc = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    /* saturating packs, then undo their 128-bit lane order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)qs, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i a4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    a4 = _mm_add_epi32(a4, _mm_shuffle_epi32(a4, 0x4e));
    a4 = _mm_add_epi32(a4, _mm_shuffle_epi32(a4, 0xb1));
    *pd = amax / 127.0f;
    return _mm_cvtsi128_si32(a4);
#else
    float m[8];
    for (int l = 0; l < 8; l++) m[l] = fabsf(x[l]);
    for (int j = 1; j < 4; j++)
        for (int l = 0; l < 8; l++) m[l] = lp_maxps(m[l], fabsf(x[8 * j + l]));
    for (int l = 0; l < 4; l++) m[l] = lp_maxps(m[4 + l], m[l]);
    for (int l = 0; l < 2; l++) m[l] = lp_maxps(m[l], m[l + 2]);
    const float amax = lp_maxps(m[0], m[1]);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    uint32_t sum = 0; /* wraps as the int32 lanes do */
    for (int j = 0; j < 32; j++) {
        const float v = nearbyintf(x[j] * id);
        const int32_t q = fabsf(v) < 2147483648.0f ? (int32_t)v : INT32_MIN;
        qs[j] = (int8_t)(q < -128 ? -128 : q > 127 ? 127 : q);
        sum += (uint32_t)q;
    }
    *pd = amax / 127.0f;
    return (int32_t)sum;
#endif
}

LP_API void lp_quantize_row_q8_0(const float *x, void *vy, int64_t k) {
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < k / QK8_0; i++, x += QK8_0) {
        float d;
        lp_quant_block32(x, y[i].qs, &d);
        y[i].d = lp_f2h(d);
    }
}

LP_API void lp_quantize_row_q8_1(const float *x, void *vy, int64_t k) {
    block_q8_1 *y = vy;
    for (int64_t i = 0; i < k / QK8_1; i++, x += QK8_1) {
        float d;
        const int sum = lp_quant_block32(x, y[i].qs, &d);
        y[i].d = lp_f2h(d);
        y[i].s = lp_f2h(d * (float)sum);
    }
}

/* Q8_0 blocks as ggml's reference quantize_row_q8_0_ref (= gguf.quants, quants.quantize): the KV
 * cache stores (ops.c lp_kv_quantize_row) keep this definition, which their tests and the numpy
 * reference follow (llama.cpp's own SET_ROWS uses the SIMD from_float above; see bench/RESULTS.md).
 * d = max|x| / 127, q = roundf(x * (1/d)). */
void lp_quantize_row_q8_0_ref(const float *x, void *vy, int64_t k) {
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < k / QK8_0; i++, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) y[i].qs[j] = (int8_t)lp_round(x[j] * id);
        y[i].d = lp_f2h(d);
    }
}

/* --- AVX2 helpers ----------------------------------------------------------------------------- */

#if defined(__AVX2__)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 partial sums of u[i] * s[i] (u unsigned bytes, s signed bytes) */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 8 int32 partial sums of a[i] * b[i], both signed bytes (|a[i]| <= 128) */
static inline __m256i dot_s8s8(__m256i a, __m256i b) {
    return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

/* 16 bytes of packed nibbles -> 32 bytes: the low nibbles then the high ones (ggml's order) */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* the 32 bits of qh -> 32 bytes, 0x10 where bit j is set */
static inline __m256i hbits32(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)h),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* f16 -> f32 in one instruction where F16C is there (the same bits as lp_h2f) */
#if defined(__F16C__)
#define H2F(h) _cvtsh_ss(h)
#else
#define H2F(h) lp_h2f(h)
#endif

static inline __m256 h2f_pair(lp_half a, lp_half b) { return _mm256_set1_ps(H2F(a) * H2F(b)); }

#else
#define H2F(h) lp_h2f(h)
#endif

/* --- dot products: q types -------------------------------------------------------------------- */

/* Every q-type dot product sums its floats in the order of ggml's AVX2 ggml_vec_dot_<t>_<q8> (the
 * one llama.cpp's x86 builds run, AVX-512 ones included: these functions have no AVX-512 body):
 *   lane l (0..7) of block i = the exact int32 sum of the products of quants 4l..4l+3 (quant j
 *     of every type is its element j: Q4/Q5 low nibbles are elements 0..15, high ones 16..31),
 *   acc[l] = fma(dx_i * dy_i (one f32 product), float(lane l), acc[l]), block after block into
 *     ONE accumulator,
 *   the mins kinds (q4_1, q5_1): summs += mx_i * sy_i in block order, a separate float,
 *   result = hsum_float_8(acc) (+ summs), hsum_float_8 = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
 * The portable bodies compute exactly this with 8 scalar lanes and fmaf; gemm / gemv below repeat
 * it per output. The int32 lanes are exact however they are formed (maddubs pairs stay below
 * 2 x 127 x 127: no saturation; dpbusd has none). */

/* hsum_float_8's pairing of 8 lanes */
static inline float lp_hsum8_order(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* the portable body of one block: acc[l] = fmaf(d, sum of qx[4l..4l+3] * qy[4l..4l+3], acc[l]) */
static inline void lp_block_lanes(float acc[8], float d, const int qx[32], const int8_t *qy) {
    for (int l = 0; l < 8; l++) {
        int p = 0;
        for (int k = 4 * l; k < 4 * l + 4; k++) p += qx[k] * qy[k];
        acc[l] = fmaf(d, (float)p, acc[l]);
    }
}

#if defined(__AVX2__)
#define LP_VD_ACC __m256 acc = _mm256_setzero_ps()
#define LP_VD_SUM hsum8(acc)
#else
#define LP_VD_ACC float acc[8] = {0}
#define LP_VD_SUM lp_hsum8_order(acc)
#endif

LP_API void lp_vec_dot_q4_1_q8_1(int n, float *s, const void *vx, const void *vy) {
    const block_q4_1 *x = vx;
    const block_q8_1 *y = vy;
    const int nb = n / QK8_1;
    LP_VD_ACC;
    float summ = 0.0f;
    for (int i = 0; i < nb; i++) {
        summ += H2F(x[i].m) * H2F(y[i].s);
#if defined(__AVX2__)
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(nibbles32(x[i].qs), qy)), h2f_pair(x[i].d, y[i].d), acc);
#else
        int q[32];
        for (int j = 0; j < 16; j++) q[j] = x[i].qs[j] & 0x0f, q[j + 16] = x[i].qs[j] >> 4;
        lp_block_lanes(acc, lp_h2f(x[i].d) * lp_h2f(y[i].d), q, y[i].qs);
#endif
    }
    *s = LP_VD_SUM + summ;
}

/* 5-bit quants j of a q5 block: the nibble plus bit j of qh as bit 4 */
static inline int q5_at(const uint8_t *qs, const uint8_t *qh, int j) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const int nib = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
    return nib | (int)(((h >> j) & 1u) << 4);
}

LP_API void lp_vec_dot_q5_0_q8_0(int n, float *s, const void *vx, const void *vy) {
    const block_q5_0 *x = vx;
    const block_q8_0 *y = vy;
    const int nb = n / QK8_0;
    LP_VD_ACC;
    for (int i = 0; i < nb; i++) {
#if defined(__AVX2__)
        const __m256i q = _mm256_or_si256(nibbles32(x[i].qs), hbits32(x[i].qh));
        const __m256i qx = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8s8(qx, qy)), h2f_pair(x[i].d, y[i].d), acc);
#else
        int q[32];
        for (int j = 0; j < 32; j++) q[j] = q5_at(x[i].qs, x[i].qh, j) - 16;
        lp_block_lanes(acc, lp_h2f(x[i].d) * lp_h2f(y[i].d), q, y[i].qs);
#endif
    }
    *s = LP_VD_SUM;
}

LP_API void lp_vec_dot_q5_1_q8_1(int n, float *s, const void *vx, const void *vy) {
    const block_q5_1 *x = vx;
    const block_q8_1 *y = vy;
    const int nb = n / QK8_1;
    LP_VD_ACC;
    float summ = 0.0f;
    for (int i = 0; i < nb; i++) {
        summ += H2F(x[i].m) * H2F(y[i].s);
#if defined(__AVX2__)
        const __m256i qx = _mm256_or_si256(nibbles32(x[i].qs), hbits32(x[i].qh));
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(qx, qy)), h2f_pair(x[i].d, y[i].d), acc);
#else
        int q[32];
        for (int j = 0; j < 32; j++) q[j] = q5_at(x[i].qs, x[i].qh, j);
        lp_block_lanes(acc, lp_h2f(x[i].d) * lp_h2f(y[i].d), q, y[i].qs);
#endif
    }
    *s = LP_VD_SUM + summ;
}

#if defined(__AVX2__)
/* acc + one Q8_0 block against activation block y (its quants qy, loaded): the vec_dot's step,
 * which gv8_rows (decode) takes too */
static inline __m256 q8_0_block(__m256 acc, const block_q8_0 *x, const block_q8_0 *y, __m256i qy) {
    const __m256i qx = _mm256_loadu_si256((const __m256i *)x->qs);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8s8(qx, qy)), h2f_pair(x->d, y->d), acc);
}
#endif

LP_API void lp_vec_dot_q8_0_q8_0(int n, float *s, const void *vx, const void *vy) {
    const block_q8_0 *x = vx;
    const block_q8_0 *y = vy;
    const int nb = n / QK8_0;
    LP_VD_ACC;
    for (int i = 0; i < nb; i++) {
#if defined(__AVX2__)
        acc = q8_0_block(acc, x + i, y + i, _mm256_loadu_si256((const __m256i *)y[i].qs));
#else
        int q[32];
        for (int j = 0; j < 32; j++) q[j] = x[i].qs[j];
        lp_block_lanes(acc, lp_h2f(x[i].d) * lp_h2f(y[i].d), q, y[i].qs);
#endif
    }
    *s = LP_VD_SUM;
}
#undef LP_VD_ACC
#undef LP_VD_SUM

/* --- dot products: float types ---------------------------------------------------------------- */

/* One body per float type (FK_*: how 16 or 8 elements load as float32) for one weight row against
 * nc activation rows, inlined with nc a constant: lp_vec_dot_* is its nc = 1 case and lp_gemm_*
 * loops rows over it, so each output takes the same operations in the same order either way
 * (lp_quants.h's bit-identity rule) while a weight vector loads and converts once for nc columns.
 * Decode is memory-bound here (2 bytes a weight): the AVX-512 body reads 64 weights a step into
 * 4 independent accumulators per column (ggml's GGML_F16_STEP / GGML_F16_EPR: 4 x 16 lanes), so
 * the loads stay ahead of the FMA latency; the AVX2 body keeps 2 x 8 lanes; the portable body 8
 * float32 lanes that gcc vectorizes without reassociation flags. */
enum { FK_F32, FK_F16, FK_BF16 };
#define FK_SIZE(kind) ((kind) == FK_F32 ? 4 : 2)
#define LP_INLINE static inline __attribute__((always_inline))

LP_INLINE float fk_at(int kind, const void *p, int64_t i) {
    if (kind == FK_F32) return ((const float *)p)[i];
    if (kind == FK_F16) return lp_h2f(((const lp_half *)p)[i]);
    return lp_bf2f(((const lp_bf16 *)p)[i]);
}

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
#define FK_AVX512 1
LP_INLINE __m512 fk_load16(int kind, const void *p, int64_t i) {
    if (kind == FK_F32) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (kind == FK_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16: the high half */
}
#elif defined(__AVX2__) && defined(__F16C__)
#define FK_AVX2 1
LP_INLINE __m256 fk_load8(int kind, const void *p, int64_t i) {
    if (kind == FK_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (kind == FK_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* s[c * ld_s] = dot(w, column c) for c < nc; column c starts at x + c * x_bytes */
LP_INLINE void fk_cols(int kind, int n, float *s, int64_t ld_s, const void *w, const void *x, int64_t x_bytes, int nc) {
    const uint8_t *xb = x;
    float sum[LP_GEMM_COLS];
    int i = 0;
#if defined(FK_AVX512)
    __m512 a[LP_GEMM_COLS][4];
    for (int c = 0; c < nc; c++) a[c][0] = a[c][1] = a[c][2] = a[c][3] = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        lp_pf_ahead((const char *)w + i * FK_SIZE(kind), 64 * FK_SIZE(kind));
        const __m512 w0 = fk_load16(kind, w, i), w1 = fk_load16(kind, w, i + 16);
        const __m512 w2 = fk_load16(kind, w, i + 32), w3 = fk_load16(kind, w, i + 48);
        for (int c = 0; c < nc; c++) {
            const void *xc = xb + c * x_bytes;
            a[c][0] = _mm512_fmadd_ps(w0, fk_load16(kind, xc, i), a[c][0]);
            a[c][1] = _mm512_fmadd_ps(w1, fk_load16(kind, xc, i + 16), a[c][1]);
            a[c][2] = _mm512_fmadd_ps(w2, fk_load16(kind, xc, i + 32), a[c][2]);
            a[c][3] = _mm512_fmadd_ps(w3, fk_load16(kind, xc, i + 48), a[c][3]);
        }
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 w0 = fk_load16(kind, w, i);
        for (int c = 0; c < nc; c++) a[c][0] = _mm512_fmadd_ps(w0, fk_load16(kind, xb + c * x_bytes, i), a[c][0]);
    }
    for (int c = 0; c < nc; c++)
        sum[c] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[c][0], a[c][1]), _mm512_add_ps(a[c][2], a[c][3])));
#elif defined(FK_AVX2)
    __m256 a[LP_GEMM_COLS][2];
    for (int c = 0; c < nc; c++) a[c][0] = a[c][1] = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        lp_pf_ahead((const char *)w + i * FK_SIZE(kind), 16 * FK_SIZE(kind));
        const __m256 w0 = fk_load8(kind, w, i), w1 = fk_load8(kind, w, i + 8);
        for (int c = 0; c < nc; c++) {
            const void *xc = xb + c * x_bytes;
            a[c][0] = _mm256_fmadd_ps(w0, fk_load8(kind, xc, i), a[c][0]);
            a[c][1] = _mm256_fmadd_ps(w1, fk_load8(kind, xc, i + 8), a[c][1]);
        }
    }
    for (int c = 0; c < nc; c++) sum[c] = hsum8(_mm256_add_ps(a[c][0], a[c][1]));
#else
    float acc[LP_GEMM_COLS][8] = {{0}};
    for (; i + 8 <= n; i += 8)
        for (int c = 0; c < nc; c++)
            for (int l = 0; l < 8; l++) acc[c][l] += fk_at(kind, w, i + l) * fk_at(kind, xb + c * x_bytes, i + l);
    for (int c = 0; c < nc; c++) {
        sum[c] = 0.0f;
        for (int l = 0; l < 8; l++) sum[c] += acc[c][l];
    }
#endif
    for (int c = 0; c < nc; c++) {
        for (int j = i; j < n; j++) sum[c] += fk_at(kind, w, j) * fk_at(kind, xb + c * x_bytes, j);
        s[c * ld_s] = sum[c];
    }
}

/* nr rows x nc columns (lp_gemm_fn) of fk_cols, nc a constant in each case */
LP_INLINE void fk_gemm(int kind, int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                       int64_t x_bytes, int nc) {
    for (int r = 0; r < nr; r++) {
        const void *wr = (const uint8_t *)w + r * row_bytes;
        switch (nc) {
        case 1: fk_cols(kind, n, s + r, ld_s, wr, x, x_bytes, 1); break;
        case 2: fk_cols(kind, n, s + r, ld_s, wr, x, x_bytes, 2); break;
        case 3: fk_cols(kind, n, s + r, ld_s, wr, x, x_bytes, 3); break;
        default: fk_cols(kind, n, s + r, ld_s, wr, x, x_bytes, LP_GEMM_COLS); break;
        }
    }
}

/* R x C outputs (R <= FK_TR rows, C <= FK_TC columns) of fk_cols against float32 columns xf (the
 * activations' f16 / bf16 values converted once: the same floats fk_load gives): per output the
 * same accumulators, steps and reduction as fk_cols, so each is bit-identical to the vec_dot; what
 * the tile saves is loads (and f16 conversions) — each weight vector serves C columns and each
 * activation vector R rows, where fk_cols reloads and converts the activations for every row. */
#define FK_TR 2 /* rows of a tile (fk_panel: 2 x 3) */
#define FK_TC 3
LP_INLINE void fk_tile(int kind, int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, const float *xf,
                       int64_t ldx, int R, int C) {
    const void *wr[FK_TR];
    for (int r = 0; r < R; r++) wr[r] = (const uint8_t *)w + r * row_bytes;
    const float *xc[FK_TC] = {xf, xf + ldx, xf + 2 * ldx};
    float sum[FK_TR][FK_TC];
    int i = 0;
#if defined(FK_AVX512)
    __m512 a[FK_TR][FK_TC][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c][0] = a[r][c][1] = a[r][c][2] = a[r][c][3] = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        for (int r = 0; r < R; r++) lp_pf_ahead((const char *)wr[r] + i * FK_SIZE(kind), 64 * FK_SIZE(kind));
        for (int q = 0; q < 4; q++) {
            __m512 wv[FK_TR];
            for (int r = 0; r < R; r++) wv[r] = fk_load16(kind, wr[r], i + 16 * q);
            for (int c = 0; c < C; c++) {
                const __m512 xv = _mm512_loadu_ps(xc[c] + i + 16 * q);
                for (int r = 0; r < R; r++) a[r][c][q] = _mm512_fmadd_ps(wv[r], xv, a[r][c][q]);
            }
        }
    }
    for (; i + 16 <= n; i += 16)
        for (int r = 0; r < R; r++) {
            const __m512 wv = fk_load16(kind, wr[r], i);
            for (int c = 0; c < C; c++) a[r][c][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xc[c] + i), a[r][c][0]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            sum[r][c] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][c][0], a[r][c][1]), _mm512_add_ps(a[r][c][2], a[r][c][3])));
#elif defined(FK_AVX2)
    __m256 a[FK_TR][FK_TC][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c][0] = a[r][c][1] = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        for (int q = 0; q < 2; q++) {
            __m256 wv[FK_TR];
            for (int r = 0; r < R; r++) wv[r] = fk_load8(kind, wr[r], i + 8 * q);
            for (int c = 0; c < C; c++) {
                const __m256 xv = _mm256_loadu_ps(xc[c] + i + 8 * q);
                for (int r = 0; r < R; r++) a[r][c][q] = _mm256_fmadd_ps(wv[r], xv, a[r][c][q]);
            }
        }
        for (int r = 0; r < R; r++) lp_pf_ahead((const char *)wr[r] + i * FK_SIZE(kind), 16 * FK_SIZE(kind));
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sum[r][c] = hsum8(_mm256_add_ps(a[r][c][0], a[r][c][1]));
#else
    float acc[FK_TR][FK_TC][8] = {{{0}}};
    for (; i + 8 <= n; i += 8)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                for (int l = 0; l < 8; l++) acc[r][c][l] += fk_at(kind, wr[r], i + l) * xc[c][i + l];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            sum[r][c] = 0.0f;
            for (int l = 0; l < 8; l++) sum[r][c] += acc[r][c][l];
        }
#endif
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            for (int j = i; j < n; j++) sum[r][c] += fk_at(kind, wr[r], j) * xc[c][j];
            s[c * ld_s + r] = sum[r][c];
        }
}

/* Bytes of weight rows a panel keeps in cache (L3) while every column passes over them, so that
 * the activations stream once per block: 1B F16 pp512, 2 threads, Zen 2: 96 KiB 39.4, 2 MiB 42.4,
 * 8 MiB 42.3 tok/s; SmolLM2's smaller matrices the same at 24 KiB .. 8 MiB */
#define FK_PANEL_BYTES (2048 * 1024)

/* Any nc columns over nr rows (lp_gemm_fn; a prompt's whole micro-batch, a thread's range of
 * rows): the activations converted to float32 once, then blocks of rows that stay in cache while
 * 2 x 3 tiles of fk_tile run over the columns. */
LP_INLINE void fk_panel(int kind, int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr,
                        const void *x, int64_t x_bytes, int nc) {
    float *buf = NULL;
    const float *xf = x;
    int64_t ldx = x_bytes / (int64_t)sizeof(float);
    if (kind != FK_F32) {
        buf = malloc((size_t)nc * (size_t)n * sizeof(float));
        if (buf == NULL) { /* no room for the float32 copy: the column groups of fk_gemm */
            for (int c = 0; c < nc; c += LP_GEMM_COLS)
                fk_gemm(kind, n, s + c * ld_s, ld_s, w, row_bytes, nr, (const uint8_t *)x + c * x_bytes, x_bytes,
                        nc - c < LP_GEMM_COLS ? nc - c : LP_GEMM_COLS);
            return;
        }
        for (int c = 0; c < nc; c++) {
            const void *xc = (const uint8_t *)x + c * x_bytes;
            int j = 0;
#if defined(FK_AVX512)
            for (; j + 16 <= n; j += 16) _mm512_storeu_ps(buf + (int64_t)c * n + j, fk_load16(kind, xc, j));
#elif defined(FK_AVX2)
            for (; j + 8 <= n; j += 8) _mm256_storeu_ps(buf + (int64_t)c * n + j, fk_load8(kind, xc, j));
#endif
            for (; j < n; j++) buf[(int64_t)c * n + j] = fk_at(kind, xc, j);
        }
        xf = buf;
        ldx = n;
    }
    const int rb = row_bytes >= FK_PANEL_BYTES / 2 ? 2 : (int)(FK_PANEL_BYTES / row_bytes) & ~1;
    for (int r0 = 0; r0 < nr; r0 += rb) {
        const int r1 = r0 + rb < nr ? r0 + rb : nr;
        for (int c = 0; c < nc; c += FK_TC) {
            const int C = nc - c >= FK_TC ? FK_TC : nc - c;
            for (int r = r0; r < r1; r += 2) {
                const void *wr = (const uint8_t *)w + r * row_bytes;
                float *sr = s + c * ld_s + r;
                const float *xr = xf + c * ldx;
                const int R = r + 1 < r1 ? 2 : 1;
                /* R and C constants in each call, so that the tile's arrays stay in registers */
                if (R == 2) {
                    if (C == 3) fk_tile(kind, n, sr, ld_s, wr, row_bytes, xr, ldx, 2, 3);
                    else if (C == 2) fk_tile(kind, n, sr, ld_s, wr, row_bytes, xr, ldx, 2, 2);
                    else fk_tile(kind, n, sr, ld_s, wr, row_bytes, xr, ldx, 2, 1);
                } else {
                    if (C == 3) fk_tile(kind, n, sr, ld_s, wr, row_bytes, xr, ldx, 1, 3);
                    else if (C == 2) fk_tile(kind, n, sr, ld_s, wr, row_bytes, xr, ldx, 1, 2);
                    else fk_tile(kind, n, sr, ld_s, wr, row_bytes, xr, ldx, 1, 1);
                }
            }
        }
    }
    free(buf);
}

/* BF16 with AVX512_BF16 (ggml's vec_dot_bf16 on such CPUs): vdpbf16ps multiplies 32 bf16 pairs
 * and adds each two neighbouring products into 16 float32 lanes, no conversion at all. The
 * avx512 library is built without -mavx512bf16 (most AVX-512 CPUs lack it), so this body is
 * compiled for it alone and chosen at run time (__builtin_cpu_supports); on other CPUs the bf16
 * dot products are fk_cols' (LP_NO_BF16DP leaves this body out: the tests build that library to
 * check it on CPUs that have the instruction). vdpbf16ps treats denormal inputs as zero, as ggml's
 * dot product does there. */
#if defined(FK_AVX512) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 10) && !defined(LP_NO_BF16DP)
#define FK_BF16DP 1
#define BF16DP_TARGET __attribute__((target("avx512bf16")))

BF16DP_TARGET LP_INLINE __m512bh bf16dp_load32(const void *p, int64_t i) {
    return (__m512bh)_mm512_loadu_si512((const void *)((const lp_bf16 *)p + i));
}

BF16DP_TARGET LP_INLINE void bf16dp_cols(int n, float *s, int64_t ld_s, const void *w, const void *x, int64_t x_bytes,
                                         int nc) {
    const uint8_t *xb = x;
    __m512 a[LP_GEMM_COLS][4];
    int i = 0;
    for (int c = 0; c < nc; c++) a[c][0] = a[c][1] = a[c][2] = a[c][3] = _mm512_setzero_ps();
    for (; i + 128 <= n; i += 128) {
        lp_pf_ahead((const lp_bf16 *)w + i, 256);
        const __m512bh w0 = bf16dp_load32(w, i), w1 = bf16dp_load32(w, i + 32);
        const __m512bh w2 = bf16dp_load32(w, i + 64), w3 = bf16dp_load32(w, i + 96);
        for (int c = 0; c < nc; c++) {
            const void *xc = xb + c * x_bytes;
            a[c][0] = _mm512_dpbf16_ps(a[c][0], w0, bf16dp_load32(xc, i));
            a[c][1] = _mm512_dpbf16_ps(a[c][1], w1, bf16dp_load32(xc, i + 32));
            a[c][2] = _mm512_dpbf16_ps(a[c][2], w2, bf16dp_load32(xc, i + 64));
            a[c][3] = _mm512_dpbf16_ps(a[c][3], w3, bf16dp_load32(xc, i + 96));
        }
    }
    for (; i + 32 <= n; i += 32) {
        const __m512bh w0 = bf16dp_load32(w, i);
        for (int c = 0; c < nc; c++) a[c][0] = _mm512_dpbf16_ps(a[c][0], w0, bf16dp_load32(xb + c * x_bytes, i));
    }
    for (int c = 0; c < nc; c++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[c][0], a[c][1]), _mm512_add_ps(a[c][2], a[c][3])));
        for (int j = i; j < n; j++) sum += fk_at(FK_BF16, w, j) * fk_at(FK_BF16, xb + c * x_bytes, j);
        s[c * ld_s] = sum;
    }
}

BF16DP_TARGET static void bf16dp_gemm(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr,
                                      const void *x, int64_t x_bytes, int nc) {
    for (int r = 0; r < nr; r++) {
        const void *wr = (const uint8_t *)w + r * row_bytes;
        switch (nc) {
        case 1: bf16dp_cols(n, s + r, ld_s, wr, x, x_bytes, 1); break;
        case 2: bf16dp_cols(n, s + r, ld_s, wr, x, x_bytes, 2); break;
        case 3: bf16dp_cols(n, s + r, ld_s, wr, x, x_bytes, 3); break;
        default: bf16dp_cols(n, s + r, ld_s, wr, x, x_bytes, LP_GEMM_COLS); break;
        }
    }
}

/* whether this CPU runs bf16dp_* (read from libgcc's CPU model: no state of ours) */
static inline int bf16dp_ok(void) { return __builtin_cpu_supports("avx512bf16"); }
#endif

LP_API void lp_vec_dot_f32(int n, float *s, const void *vx, const void *vy) { fk_cols(FK_F32, n, s, 0, vx, vy, 0, 1); }

LP_API void lp_vec_dot_f16(int n, float *s, const void *vx, const void *vy) { fk_cols(FK_F16, n, s, 0, vx, vy, 0, 1); }

LP_API void lp_vec_dot_bf16(int n, float *s, const void *vx, const void *vy) {
#if defined(FK_BF16DP)
    if (bf16dp_ok()) {
        bf16dp_gemm(n, s, 0, vx, 0, 1, vy, 0, 1);
        return;
    }
#endif
    fk_cols(FK_BF16, n, s, 0, vx, vy, 0, 1);
}

LP_API void lp_gemm_f32(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                        int64_t x_bytes, int nc) {
    fk_gemm(FK_F32, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

LP_API void lp_gemm_f16(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                        int64_t x_bytes, int nc) {
    fk_gemm(FK_F16, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

LP_API void lp_gemm_bf16(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                         int64_t x_bytes, int nc) {
#if defined(FK_BF16DP)
    if (bf16dp_ok()) {
        bf16dp_gemm(n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
        return;
    }
#endif
    fk_gemm(FK_BF16, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

/* the panels and F32's gemv only where fk_tile has SIMD bodies: the portable build keeps tiles +
 * sgemm for prompts and a vec_dot a row for decode */
#if defined(FK_AVX512) || defined(FK_AVX2)
/* F32 decode (lp_gemv_fn): the activation row against nr weight rows, 4 at a time (four streams
 * from memory; each output fk_cols' accumulators, steps and reduction, so the vec_dot's bits):
 * SmolLM2 F32 tg128 42.0 -> 44-47 tok/s on Zen 2. Its own body rather than fk_tile 4 x 1: fk_tile's
 * arrays sized for 4 rows kept the 2 x 3 prompt tiles' accumulators in memory (F16 pp512 335 ->
 * 280). The f16 / bf16 rows keep their vec_dot a row: a 2- or 4-row tile over the activations
 * converted once measured slower there (82 -> 67 tok/s). */
LP_INLINE void fk_rows4_f32(int n, float *s, const void *w, int64_t row_bytes, const float *x) {
    const float *wr[4];
    for (int r = 0; r < 4; r++) wr[r] = (const float *)((const uint8_t *)w + r * row_bytes); /* (any row_bytes) */
    float sum[4];
    int i = 0;
#if defined(FK_AVX512)
    __m512 a[4][4];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        for (int r = 0; r < 4; r++) lp_pf_ahead(wr[r] + i, 256);
        for (int q = 0; q < 4; q++) {
            const __m512 xv = _mm512_loadu_ps(x + i + 16 * q);
            for (int r = 0; r < 4; r++) a[r][q] = _mm512_fmadd_ps(_mm512_loadu_ps(wr[r] + i + 16 * q), xv, a[r][q]);
        }
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        for (int r = 0; r < 4; r++) a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(wr[r] + i), xv, a[r][0]);
    }
    for (int r = 0; r < 4; r++)
        sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
#else /* FK_AVX2 */
    __m256 a[4][2];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        for (int r = 0; r < 4; r++) lp_pf_ahead(wr[r] + i, 64);
        for (int q = 0; q < 2; q++) {
            const __m256 xv = _mm256_loadu_ps(x + i + 8 * q);
            for (int r = 0; r < 4; r++) a[r][q] = _mm256_fmadd_ps(_mm256_loadu_ps(wr[r] + i + 8 * q), xv, a[r][q]);
        }
    }
    for (int r = 0; r < 4; r++) sum[r] = hsum8(_mm256_add_ps(a[r][0], a[r][1]));
#endif
    for (int r = 0; r < 4; r++) {
        for (int j = i; j < n; j++) sum[r] += wr[r][j] * x[j];
        s[r] = sum[r];
    }
}

LP_API void lp_gemv_f32(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x) {
    int r = 0;
    for (; r + 4 <= nr; r += 4)
        fk_rows4_f32(n, s + r, (const uint8_t *)w + r * row_bytes, row_bytes, x);
    for (; r < nr; r++) fk_cols(FK_F32, n, s + r, 0, (const uint8_t *)w + r * row_bytes, x, 0, 1);
}

LP_API void lp_gemm_f32_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                              int64_t x_bytes, int nc) {
    fk_panel(FK_F32, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

LP_API void lp_gemm_f16_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                              int64_t x_bytes, int nc) {
    fk_panel(FK_F16, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}

LP_API void lp_gemm_bf16_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                               int64_t x_bytes, int nc) {
#if defined(FK_BF16DP)
    if (bf16dp_ok()) { /* vdpbf16ps multiplies bf16 pairs itself: its own order, in groups of columns */
        for (int c = 0; c < nc; c += LP_GEMM_COLS)
            bf16dp_gemm(n, s + c * ld_s, ld_s, w, row_bytes, nr, (const uint8_t *)x + c * x_bytes, x_bytes,
                        nc - c < LP_GEMM_COLS ? nc - c : LP_GEMM_COLS);
        return;
    }
#endif
    fk_panel(FK_BF16, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);
}
#endif

/* --- several outputs at once: the q types' lp_gemm_* (lp_quants.h, LP_GEMM_COLS) ------------ */

/* Each weight block is decoded once (nibbles, high bits, its scale) for GEMM_NR rows and dotted
 * with up to LP_GEMM_COLS activation rows. Per output the float32 operations are the vec_dot's
 * own, in its order: the same int32 lanes (dot_u8s8 / dot_s8s8), the scale dx * dy rounded once
 * and broadcast, one fmadd per block into the output's one accumulator, the mins term
 * m * s added in block order, and hsum8 at the end; so a token's numbers never depend on the
 * batch it is in. The activation scales of the nc columns are converted once per call. */

#if defined(__AVX2__)

#define LP_INLINE static inline __attribute__((always_inline))

/* rows at once: the avx512 build has 32 vector registers (2 rows x 4 columns, one accumulator each) */
#if defined(__AVX512F__)
#define GEMM_NR 2
#else
#define GEMM_NR 1
#endif

enum { GK_Q4_1, GK_Q5_0, GK_Q5_1, GK_Q8_0 };
_Static_assert(LP_GEMM_COLS == 4, "the mins terms of the columns are one __m128");

/* bytes of a weight block of each kind, and whether its vec_dot has a mins term (q8_1 y) */
#define GK_WBYTES(k) ((k) == GK_Q4_1 ? 20 : (k) == GK_Q5_0 ? 22 : (k) == GK_Q5_1 ? 24 : 34)
#define GK_MINS(k) ((k) == GK_Q4_1 || (k) == GK_Q5_1)
#define GK_SIGNED(k) ((k) == GK_Q5_0 || (k) == GK_Q8_0)
/* bytes of an activation block (q8_1 for the mins kinds, else q8_0), and the offset of its quants */
#define GK_YB(k) (GK_MINS(k) ? (int)sizeof(block_q8_1) : (int)sizeof(block_q8_0))
#define GK_YQ(k) (GK_MINS(k) ? 4 : 2)

/* the 32 quants of weight block b as the vec_dot forms them (signed kinds: |q| in *qx and q in
 * *sx, for dot_s8s8's sign trick; unsigned kinds: q in *qx) */
LP_INLINE void gk_decode(const int kind, const uint8_t *b, __m256i *qx, __m256i *sx) {
    if (kind == GK_Q4_1) {
        *qx = nibbles32(b + 4);
    } else if (kind == GK_Q5_0) {
        *sx = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), hbits32(b + 2)), _mm256_set1_epi8(16));
    } else if (kind == GK_Q5_1) {
        *qx = _mm256_or_si256(nibbles32(b + 8), hbits32(b + 4));
    } else {
        *sx = _mm256_loadu_si256((const __m256i *)(b + 2));
    }
    if (GK_SIGNED(kind)) *qx = _mm256_sign_epi8(*sx, *sx);
}

/* the mins terms of block i for NR rows and the 4 columns in one vector each: m * s then +, in
 * block order, as the vec_dot's summs */
LP_INLINE void gk_mins(const int kind, const int NR, int i, __m128 summ[], const uint8_t *w, int64_t row_bytes,
                       const float *ys) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        lp_half h;
        memcpy(&h, w + r * row_bytes + (int64_t)i * GK_WBYTES(kind) + 2, 2);
        summ[r] = _mm_add_ps(summ[r], _mm_mul_ps(_mm_set1_ps(H2F(h)), _mm_loadu_ps(ys + i * LP_GEMM_COLS)));
    }
}

/* block i of NR weight rows against NC activation rows (x: the first one; yd: its scale at
 * yd[i * LP_GEMM_COLS]) */
LP_INLINE void gk_step(const int kind, const int NR, const int NC, int i, __m256 acc[][LP_GEMM_COLS],
                       const uint8_t *w, int64_t row_bytes, const uint8_t *x, int64_t x_bytes, const float *yd) {
    const int wb = GK_WBYTES(kind), yb = GK_YB(kind), yq = GK_YQ(kind);
    __m256i qx[GEMM_NR], sx[GEMM_NR];
    __m256 dx[GEMM_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const uint8_t *b = w + r * row_bytes + (int64_t)i * wb;
        gk_decode(kind, b, &qx[r], &sx[r]);
        lp_half h;
        memcpy(&h, b, 2);
        dx[r] = _mm256_set1_ps(H2F(h));
    }
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) {
        const __m256i qy = _mm256_loadu_si256((const __m256i *)(x + c * x_bytes + (int64_t)i * yb + yq));
        const __m256 dy = _mm256_broadcast_ss(yd + i * LP_GEMM_COLS + c);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m256i p = GK_SIGNED(kind) ? dot_u8s8(qx[r], _mm256_sign_epi8(qy, sx[r])) : dot_u8s8(qx[r], qy);
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dx[r], dy), acc[r][c]);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define GK_ZMM 1
#define GK_ZP 4 /* prepared activation vectors a block (gk_zprep) */
/* block i of NR weight rows against NCP column pairs, a pair in one 512-bit vector: the low half
 * is column 2k's 8 int32 lanes and float accumulator, the high half column 2k + 1's, so one
 * 512-bit dpbusd / convert / scale / fmadd does one block of two outputs, each half in its
 * output's one accumulator in block order (as the vec_dot). The weight block is decoded once
 * into both halves; dpbusd has no intermediate saturation, so dot_s8s8's sign trick may negate
 * the activations where the weight is negative with a mask instead (where it is 0 the product is
 * 0 either way). */
LP_INLINE void gk_step_z(const int kind, const int NR, const int NCP, int i, __m512 acc[][LP_GEMM_COLS / 2],
                         const uint8_t *w, int64_t row_bytes, const __m512i *zp) {
    const int wb = GK_WBYTES(kind);
    __m512i qx[GEMM_NR];
    __mmask64 neg[GEMM_NR];
    __m512 dx[GEMM_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const uint8_t *b = w + r * row_bytes + (int64_t)i * wb;
        __m256i q, sq;
        gk_decode(kind, b, &q, &sq);
        qx[r] = _mm512_broadcast_i64x4(q);
        if (GK_SIGNED(kind)) neg[r] = _mm512_movepi8_mask(_mm512_broadcast_i64x4(sq));
        lp_half h;
        memcpy(&h, b, 2);
        dx[r] = _mm512_set1_ps(H2F(h));
    }
#pragma GCC unroll 2
    for (int k = 0; k < NCP; k++) {
        const __m512i qy = _mm512_load_si512(zp + GK_ZP * i + 2 * k);
        const __m512 dy = _mm512_castsi512_ps(_mm512_load_si512(zp + GK_ZP * i + 2 * k + 1));
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m512i q = GK_SIGNED(kind) ? _mm512_mask_sub_epi8(qy, neg[r], _mm512_setzero_si512(), qy) : qy;
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx[r], q);
            acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dx[r], dy), acc[r][k]);
        }
    }
}

/* per block i, zp[GK_ZP * i + 2k] the quants of column pair k (column 2k's block in the low half,
 * 2k+1's in the high half) and zp[GK_ZP * i + 2k + 1] their scales as [dy x8, dy' x8]: the
 * activation side of gk_step_z, built once per call instead of once per weight row */
LP_INLINE void gk_zprep(const int kind, int nb, int ncp, const uint8_t *x, int64_t x_bytes, const float *yd,
                        __m512i *zp) {
    const int yb = GK_YB(kind), yq = GK_YQ(kind);
    for (int i = 0; i < nb; i++)
        for (int k = 0; k < ncp; k++) {
            const uint8_t *yc = x + 2 * k * x_bytes + (int64_t)i * yb + yq;
            zp[GK_ZP * i + 2 * k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)yc)),
                                                       _mm256_loadu_si256((const __m256i *)(yc + x_bytes)), 1);
            zp[GK_ZP * i + 2 * k + 1] = _mm512_castps_si512(
                _mm512_insertf32x8(_mm512_set1_ps(yd[i * LP_GEMM_COLS + 2 * k]),
                                   _mm256_set1_ps(yd[i * LP_GEMM_COLS + 2 * k + 1]), 1));
        }
}
#endif

/* One activation row (decode) against many weight rows of the nibble kinds (Q4_1, Q5_0, Q5_1):
 * the vec_dot's float32 operations per row exactly, in fewer instructions. Everything on the
 * activation side is prepared once per call for all rows (lp_gemv_*: a thread's whole range
 * of rows): the quants, for the signed kinds the offset sums (-8 or -16 x the sum of each 4
 * activations, so that the weights' quants are used unsigned, 0..15 / 0..31, instead of the sign
 * trick per row and block), and the scales; the two scales of a block pair are converted by one
 * vcvtph2ps. Rows are read side by side (independent fmadd chains), with the group of rows ahead
 * prefetched in software (lp_pf_group, lp_quants.h): without that prefetch, 2 or 4 interleaved
 * rows ran 0.65-0.75x one row's speed on matrices streamed from memory (an older host); with it,
 * AVX2's 4 rows (gv_rows) against one: the 1B --pure shape's 48 ffn matrices, 2 threads, Q4_0
 * (here then, iquants.c's since) 16.5 / 17.0 / 18.9 -> 15.7 / 15.5 / 18.7 ms; Q4_1 / Q5_0 / Q5_1
 * ffn_up within +-4 % (stop 23).
 * The mins term of Q4_1 / Q5_1 (m * s, added in block order into a float32) stays the vec_dot's
 * scalar chain.
 *
 * AVX-512 (gv_row2): two ROWS a 512-bit step, block by block: the vector holds the block i quants
 * of rows r and r+1 as they lie in memory (both rows' low nibbles, then both rows' high ones),
 * against the activation block prepared in the same order, so int32 lanes 0-3 and 8-11 are row
 * r's vec_dot lanes 0-3 and 4-7, lanes 4-7 and 12-15 row r+1's; scaled (dx * dy rounded as the
 * vec_dot's) and fmadd-ed into a 512-bit accumulator whose halves are the two rows' one accumulators, in block order, then
 * summed as the vec_dot does (hsum8). (Two blocks of one row in a vector would need two
 * dependent fmadds a step: the one-accumulator order makes one row a latency chain.) An odd last
 * row takes gv_row1, the same in 256 bits. The nibble kinds take 8 rows at once (gv_rowq: four
 * such row pairs, four independent fmadd chains, 1.2-1.5x faster than one pair on SmolLM2's
 * Q4_1 matrices; the streams-from-memory concern above did not show on this host's Q4_1, whose
 * matrices sit in its L3, but did on Q8_0's 49152x576 output, which keeps gv_row2). AVX2 (gv_dots): a block pair as two 256-bit
 * vectors (below), the quants through maddubs (pairs at most 2 x 31 x 127: no saturation) and
 * madd. */
#define GV_MAX_NB 1024 /* the prepared activation row (~128 bytes a block) stays on the stack */

/* offsets in a weight block of the quants and of qh (Q5_x) */
#define GV_QS(k) ((k) == GK_Q8_0 ? 2 : (k) == GK_Q4_1 ? 4 : (k) == GK_Q5_0 ? 6 : 8)
#define GV_QH(k) ((k) == GK_Q5_0 ? 2 : 4)
#define GV_HIGH(k) ((k) == GK_Q5_0 || (k) == GK_Q5_1)

/* the f16 values at p and p + stride, converted together: a, -, b, - as float32 */
LP_INLINE __m128 gv_pair(const uint8_t *p, int64_t stride) {
    int32_t a, b;
    memcpy(&a, p, 4); /* the value is the low half (little endian); the high one is not used */
    memcpy(&b, p + stride, 4);
    return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(a), b, 1));
}

/* the tail block i (nb odd) as the vec_dot's step into acc, and its mins term */
LP_INLINE void gv_tail(const int kind, int i, const uint8_t *w, const uint8_t *x, __m256 *acc, float *summ) {
    const uint8_t *b = w + (int64_t)i * GK_WBYTES(kind), *yb = x + (int64_t)i * GK_YB(kind);
    __m256i qx, sx;
    gk_decode(kind, b, &qx, &sx);
    const __m256i qy = _mm256_loadu_si256((const __m256i *)(yb + GK_YQ(kind)));
    const __m256i p = GK_SIGNED(kind) ? dot_u8s8(qx, _mm256_sign_epi8(qy, sx)) : dot_u8s8(qx, qy);
    lp_half hx, hy;
    memcpy(&hx, b, 2);
    memcpy(&hy, yb, 2);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), h2f_pair(hx, hy), *acc);
    if (GK_MINS(kind)) {
        memcpy(&hx, b + 2, 2);
        memcpy(&hy, yb + 2, 2);
        *summ += H2F(hx) * H2F(hy);
    }
}

/* the first 4 bytes (a block's d, m / d and its first quants) of 4 rows row_bytes apart, one
 * row an int32 lane */
LP_INLINE __m128i gv_heads4(const uint8_t *b, int64_t row_bytes) {
    int32_t h0, h1, h2, h3;
    memcpy(&h0, b, 4);
    memcpy(&h1, b + row_bytes, 4);
    memcpy(&h2, b + 2 * row_bytes, 4);
    memcpy(&h3, b + 3 * row_bytes, 4);
    return _mm_insert_epi32(_mm_insert_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1), h2, 2), h3, 3);
}

/* the mins terms of a block pair (a, -, b, - from gv_pair products) into summ, block i first */
LP_INLINE float gv_mins(float summ, __m128 ms) {
    summ += _mm_cvtss_f32(ms);
    return summ + _mm_cvtss_f32(_mm_movehl_ps(ms, ms));
}

#if defined(GK_ZMM)
/* the quants of blocks b0 and b0 + stride (the same block of two rows) as unsigned bytes (0..15 /
 * 0..31), as they lie in memory: [b0 low nibbles, b1 low nibbles, b0 high nibbles, b1 high
 * nibbles] (16 each; the activations are prepared in the same order, so int32 lanes 0-3 and 8-11
 * are b0's vec_dot lanes 0-3 and 4-7, lanes 4-7 and 12-15 b1's). Q8_0: [b0 0-15, b1 0-15, b0 16-31,
 * b1 16-31] plus 128 (0..255; the prepared offset sums take the 128 x the activations off). */
LP_INLINE __m512i gv_quants(const int kind, const uint8_t *b0, int64_t stride) {
    const uint8_t *b1 = b0 + stride;
    if (kind == GK_Q8_0) {
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        return _mm512_xor_si512(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), q),
                                _mm512_set1_epi8((char)0x80));
    }
    /* [b0 | b1 | b0 | b1] (a broadcast load, a merge-masked one), the upper half shifted */
    __m512i z = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b0 + GV_QS(kind)))),
                                            0xF0F0, _mm_loadu_si128((const __m128i *)(b1 + GV_QS(kind))));
    z = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4), _mm512_set1_epi8(0x0f));
    if (GV_HIGH(kind)) { /* bit j of qh is quant j's bit 4 */
        uint32_t h0, h1;
        memcpy(&h0, b0 + GV_QH(kind), 4);
        memcpy(&h1, b1 + GV_QH(kind), 4);
        const __mmask64 m = (uint64_t)(h0 & 0xffffu) | (uint64_t)(h1 & 0xffffu) << 16 | (uint64_t)(h0 >> 16) << 32 |
                            (uint64_t)(h1 >> 16) << 48;
        z = _mm512_mask_add_epi8(z, m, z, _mm512_set1_epi8(16));
    }
    return z;
}

/* a, -, b, - as float32 lanes [a x4, b x4, a x4, b x4] (the lanes of gv_quants' rows) */
LP_INLINE __m512 gv_spread(__m128 f) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2),
                                 _mm512_castps128_ps512(f));
}

/* prep, per block i: [2i] the activation quants as [0-15, 0-15, 16-31, 16-31] (gv_quants' order),
 * [2i+1] (signed kinds) their offset sums; yd[i], ys[i]: the activation scale and sum s as
 * float32 */
#define GV_PREP 2
typedef __m512i gv_vec;

LP_INLINE void gv_row2(const int kind, int nb, const uint8_t *w, int64_t row_bytes, const gv_vec *prep,
                       const float *yd, const float *ys, float *s) {
    const int wb = GK_WBYTES(kind);
    __m512 acc = _mm512_setzero_ps();
    __m128 summ = _mm_setzero_ps(); /* lanes 0 and 2: the two rows' sums of m * s */
    const lp_pf pf = lp_pf_group(w, 2 * row_bytes, nb);
    for (int i = 0; i < nb; i++) {
        lp_pf_step(&pf, i);
        const gv_vec *pi = prep + GV_PREP * i;
        const uint8_t *b = w + (int64_t)i * wb;
        const __m512i off = GK_SIGNED(kind) ? _mm512_load_si512(pi + 1) : _mm512_setzero_si512();
        const __m512i p = _mm512_dpbusd_epi32(off, gv_quants(kind, b, row_bytes), _mm512_load_si512(pi));
        const __m512 d = _mm512_mul_ps(gv_spread(gv_pair(b, row_bytes)), _mm512_set1_ps(yd[i]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), d, acc);
        if (GK_MINS(kind)) summ = _mm_add_ps(summ, _mm_mul_ps(gv_pair(b + 2, row_bytes), _mm_set1_ps(ys[i])));
    }
    float sm[4];
    _mm_storeu_ps(sm, summ);
    /* the rows' lanes together again: row 0's are 0-3 and 8-11, row 1's 4-7 and 12-15 */
    acc = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15), acc);
    const float v0 = hsum8(_mm512_castps512_ps256(acc)), v1 = hsum8(_mm512_extractf32x8_ps(acc, 1));
    s[0] = GK_MINS(kind) ? v0 + sm[0] : v0;
    s[1] = GK_MINS(kind) ? v1 + sm[2] : v1;
}

LP_INLINE float gv_row1(const int kind, int nb, const uint8_t *w, const gv_vec *prep, const float *yd,
                        const float *ys) {
    const int wb = GK_WBYTES(kind);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    for (int i = 0; i < nb; i++) {
        const gv_vec *pi = prep + GV_PREP * i;
        const uint8_t *b = w + (int64_t)i * wb;
        __m256i q = kind == GK_Q8_0 ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80))
                                    : nibbles32(b + GV_QS(kind));
        if (GV_HIGH(kind)) q = _mm256_or_si256(q, hbits32(b + GV_QH(kind)));
        /* the prepared [0-15, 0-15, 16-31, 16-31] -> 0-31 (and its offsets' lanes likewise) */
        const __m512i sel = _mm512_setr_epi64(0, 1, 4, 5, 0, 1, 4, 5);
        const __m256i qy = _mm512_castsi512_si256(_mm512_permutexvar_epi64(sel, _mm512_load_si512(pi)));
        const __m256i off = GK_SIGNED(kind) ? _mm512_castsi512_si256(_mm512_permutexvar_epi64(sel, _mm512_load_si512(pi + 1)))
                                            : _mm256_setzero_si256();
        const __m256i p = _mm256_dpbusd_epi32(off, q, qy);
        lp_half h;
        memcpy(&h, b, 2);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(H2F(h) * yd[i]), acc);
        if (GK_MINS(kind)) {
            memcpy(&h, b + 2, 2);
            summ += H2F(h) * ys[i];
        }
    }
    const float v = hsum8(acc);
    return GK_MINS(kind) ? v + summ : v;
}

/* Four rows at once (two of gv_row2's row pairs, two independent fmadd chains): the four rows'
 * first 4 bytes of block i (d and m: Q4_1 / Q5_1; d and 2 bytes not used: the others) go into one
 * vector and through one vcvtph2ps, [d0 m0 d1 m1 d2 m2 d3 m3], and one multiply by [dy s] x4 gives
 * every dx * dy and m * s of the block (the vec_dot's products, rounded once each); the m * s
 * lanes are added into 8 sums (odd lanes: the 4 rows' summs, in block order), the dx * dy ones
 * spread to the row pairs' lanes by two permutes. */
/* NP (2 or 4) row pairs at once */
LP_INLINE void gv_rowq(const int kind, const int NP, int nb, const uint8_t *w, int64_t row_bytes, const gv_vec *prep,
                       const float *yds, float *s) {
    const int wb = GK_WBYTES(kind);
    __m512 acc[4];
    __m512i sp[4];
#pragma GCC unroll 4
    for (int k = 0; k < NP; k++) {
        acc[k] = _mm512_setzero_ps();
        sp[k] = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2), _mm512_set1_epi32(4 * k));
    }
    __m512 summ = _mm512_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 2 * NP * row_bytes, nb);
    for (int i = 0; i < nb; i++) {
        lp_pf_step(&pf, i);
        const gv_vec *pi = prep + GV_PREP * i;
        const uint8_t *b = w + (int64_t)i * wb;
        __m128i h[2];
#pragma GCC unroll 2
        for (int g = 0; g < NP / 2; g++) h[g] = gv_heads4(b + 4 * g * row_bytes, row_bytes);
        __m512 pr;
        if (NP == 4)
            pr = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h[0]), h[1], 1)),
                               _mm512_castpd_ps(_mm512_set1_pd(*(const double *)(yds + 2 * i))));
        else
            pr = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtph_ps(h[0]), _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(yds + 2 * i)))));
        if (GK_MINS(kind)) summ = _mm512_add_ps(summ, pr);
        const __m512i y = _mm512_load_si512(pi);
        const __m512i off = GK_SIGNED(kind) ? _mm512_load_si512(pi + 1) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < NP; k++) {
            const __m512i p = _mm512_dpbusd_epi32(off, gv_quants(kind, b + 2 * k * row_bytes, row_bytes), y);
            acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(sp[k], pr), acc[k]);
        }
    }
    float sm[16];
    _mm512_storeu_ps(sm, summ);
    const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
#pragma GCC unroll 4
    for (int k = 0; k < NP; k++) {
        const __m512 a = _mm512_permutexvar_ps(rows, acc[k]);
        const float v0 = hsum8(_mm512_castps512_ps256(a)), v1 = hsum8(_mm512_extractf32x8_ps(a, 1));
        s[2 * k] = GK_MINS(kind) ? v0 + sm[4 * k + 1] : v0;
        s[2 * k + 1] = GK_MINS(kind) ? v1 + sm[4 * k + 3] : v1;
    }
}

/* A decode batch (lp_gemm_<type>_r1: 2-4 tokens, weights read once): gv_rowq's structure with
 * NC columns: a row pair's quants decoded once for all the columns, the rows' d (and m) converted
 * and spread once; per row pair x column one vpdpbusd, convert, multiply (dx pair x dy) and fmadd,
 * per column one multiply and add for the 2 NP rows' m * s (odd lanes, block order). prep: NC
 * columns' gv_gemv preparations, nb blocks apart; yds: their [dy s] pairs, 2 nb apart. */
LP_INLINE void gv_cols(const int kind, const int NP, const int NC, int nb, float *s, int64_t ld_s, const uint8_t *w,
                       int64_t row_bytes, const gv_vec *prep, const float *yds) {
    const int wb = GK_WBYTES(kind);
    __m512 acc[4][4], summ[4], dx[4];
    __m512i sp[4];
#pragma GCC unroll 4
    for (int k = 0; k < NP; k++) {
        sp[k] = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2), _mm512_set1_epi32(4 * k));
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) acc[k][c] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) summ[c] = _mm512_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 2 * NP * row_bytes, nb);
    for (int i = 0; i < nb; i++) {
        lp_pf_step(&pf, i);
        const uint8_t *b = w + (int64_t)i * wb;
        __m128i h[2];
#pragma GCC unroll 2
        for (int g = 0; g < NP / 2; g++) h[g] = gv_heads4(b + 4 * g * row_bytes, row_bytes);
        const __m512 f = NP == 4 ? _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h[0]), h[1], 1))
                                 : _mm512_castps256_ps512(_mm256_cvtph_ps(h[0]));
#pragma GCC unroll 4
        for (int k = 0; k < NP; k++) dx[k] = _mm512_permutexvar_ps(sp[k], f);
        if (GK_MINS(kind))
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++)
                summ[c] = _mm512_add_ps(summ[c], _mm512_mul_ps(f, _mm512_set1_ps(yds[2 * (c * nb + i) + 1])));
#pragma GCC unroll 4
        for (int k = 0; k < NP; k++) {
            const __m512i q = gv_quants(kind, b + 2 * k * row_bytes, row_bytes);
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++) {
                const gv_vec *pc = prep + GV_PREP * (c * nb + i);
                const __m512i off = GK_SIGNED(kind) ? _mm512_load_si512(pc + 1) : _mm512_setzero_si512();
                const __m512i p = _mm512_dpbusd_epi32(off, q, _mm512_load_si512(pc));
                acc[k][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dx[k], _mm512_set1_ps(yds[2 * (c * nb + i)])),
                                            acc[k][c]);
            }
        }
    }
    const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) {
        float sm[16];
        _mm512_storeu_ps(sm, summ[c]);
#pragma GCC unroll 4
        for (int k = 0; k < NP; k++) {
            const __m512 a = _mm512_permutexvar_ps(rows, acc[k][c]);
            const float v0 = hsum8(_mm512_castps512_ps256(a)), v1 = hsum8(_mm512_extractf32x8_ps(a, 1));
            s[c * ld_s + 2 * k] = GK_MINS(kind) ? v0 + sm[4 * k + 1] : v0;
            s[c * ld_s + 2 * k + 1] = GK_MINS(kind) ? v1 + sm[4 * k + 3] : v1;
        }
    }
}

/* the activation side of one column (gv_gemv's): prep (GV_PREP vectors a block), yds ([dy s] pairs) */
LP_INLINE void gv_prep1(const int kind, int nb, const uint8_t *x, gv_vec *prep, float *yds) {
    const int yb = GK_YB(kind), yq = GK_YQ(kind);
    for (int i = 0; i < nb; i++) {
        const uint8_t *y = x + (int64_t)i * yb;
        const __m512i qy = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(y + yq))));
        prep[GV_PREP * i] = qy;
        if (GK_SIGNED(kind)) { /* -(offset x the sum of each 4 activations) */
            const __m512i c = _mm512_set1_epi8((char)(kind == GK_Q8_0 ? 128 : 16));
            prep[GV_PREP * i + 1] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, qy));
        }
        lp_half h;
        memcpy(&h, y, 2);
        yds[2 * i] = H2F(h);
        yds[2 * i + 1] = 0.0f;
        if (GK_MINS(kind)) {
            memcpy(&h, y + 2, 2);
            yds[2 * i + 1] = H2F(h);
        }
    }
}

#ifndef GV_COLS_NP
#define GV_COLS_NP 2
#endif
/* nc (1..LP_GEMM_COLS) columns over nr rows: the rows GV_COLS_NP pairs at a time; the rest (fewer
 * rows) 0..2 NP - 1 through gk_gemm. -1 where the prepared columns would not fit the stack. */
LP_INLINE int gv_gemm_cols(const int kind, int n, float *s, int64_t ld_s, const uint8_t *w, int64_t row_bytes, int nr,
                           const uint8_t *x, int64_t x_bytes, int nc) {
    const int nb = n / QK8_0;
    if (nb <= 0 || nb * nc > GV_MAX_NB) return -1;
    gv_vec prep[GV_PREP * nb * nc];
    float yds[2 * nb * nc] __attribute__((aligned(8)));
    for (int c = 0; c < nc; c++) gv_prep1(kind, nb, x + c * x_bytes, prep + GV_PREP * nb * c, yds + 2 * nb * c);
    const int G = 2 * GV_COLS_NP;
    int r = 0;
    for (; r + G <= nr; r += G) {
        const uint8_t *wr = w + r * row_bytes;
        switch (nc) {
        case 1: gv_cols(kind, GV_COLS_NP, 1, nb, s + r, ld_s, wr, row_bytes, prep, yds); break;
        case 2: gv_cols(kind, GV_COLS_NP, 2, nb, s + r, ld_s, wr, row_bytes, prep, yds); break;
        case 3: gv_cols(kind, GV_COLS_NP, 3, nb, s + r, ld_s, wr, row_bytes, prep, yds); break;
        default: gv_cols(kind, GV_COLS_NP, 4, nb, s + r, ld_s, wr, row_bytes, prep, yds); break;
        }
    }
    return r;
}

#ifndef GV_ROWS
#define GV_ROWS 8
#endif
LP_INLINE void gv_gemv(const int kind, int nb, float *s, const uint8_t *w, int64_t row_bytes, int nr,
                       const uint8_t *x) {
    gv_vec prep[GV_PREP * (nb > 0 ? nb : 1)];
    float yd[nb > 0 ? nb : 1], ys[nb > 0 ? nb : 1];
    float yds[2 * (nb > 0 ? nb : 1)] __attribute__((aligned(8)));
    gv_prep1(kind, nb, x, prep, yds);
    for (int i = 0; i < nb; i++) yd[i] = yds[2 * i], ys[i] = yds[2 * i + 1]; /* (gv_row2/gv_row1 take them apart) */
    int r = 0;
    /* Q8_0 (34 bytes a block: SmolLM2's 49152x576 output, read from memory) stays 2 rows at a time:
     * 8 rows' streams at once were slower there (2.85 vs 2.49 ms one thread, 0.88x), where Q4_1's
     * were 1.35x faster */
    if (kind != GK_Q8_0) {
        for (; r + GV_ROWS <= nr; r += GV_ROWS) gv_rowq(kind, GV_ROWS / 2, nb, w + r * row_bytes, row_bytes, prep, yds, s + r);
        for (; r + 4 <= nr; r += 4) gv_rowq(kind, 2, nb, w + r * row_bytes, row_bytes, prep, yds, s + r);
    }
    for (; r + 2 <= nr; r += 2) gv_row2(kind, nb, w + r * row_bytes, row_bytes, prep, yd, ys, s + r);
    if (r < nr) s[r] = gv_row1(kind, nb, w + r * row_bytes, prep, yd, ys);
}

#else
/* prep, per block pair j: [5j] the activation quants 0-15 of both blocks (block i's, then block
 * i+1's), [5j+1] their quants 16-31, [5j+2], [5j+3] the offset sums of those (signed kinds),
 * [5j+4] [dy0 s0 dy1 s1] twice (the blocks' scales and, mins kinds, sums s; 0 for the others).
 * A row takes a block pair as two vectors, the low nibbles of both blocks' 16 bytes and the high
 * ones: int32 lanes 0-3 of the low vector are the vec_dot's lanes 0-3 of block i, 4-7 its lanes
 * 0-3 of block i+1, and the high vector the lanes 4-7 of each; two 128-bit permutes put block
 * i's 8 lanes and block i+1's together, fmadd-ed into the one accumulator in block order.
 * A weight block's first 4 bytes are d and m (Q4_1, Q5_1), so one vcvtph2ps of them times
 * [dy s] gives a block's dx * dy and m * s at once (the vec_dot's products, rounded once each);
 * four rows (gv_rows4) convert the four rows' heads of a block in one go, and add the four rows'
 * m * s as one vector (odd lanes, each row's sum in block order). The rows' dx * dy are
 * broadcast by a 128-bit permute per half and an in-lane one per row: with vpermps per row Q5_0
 * was 7 % slower on Zen 2. There (bench_kernels.py --wide --threads 1, 8192 x 2048, against the
 * former kernel, which converted d and m apart per row and pair): Q4_1 1.017 -> 0.782 ms, Q5_1
 * 1.449 -> 1.210, Q5_0 1.248 -> 1.240; then the qh words' broadcast from a vector (movd, pinsrd)
 * rather than through a 64-bit register: Q5_0 1.235 -> 1.208, Q5_1 1.200 -> 1.191. */
#define GV_PREP 5
typedef __m256i gv_vec;

/* the qh words of two blocks (h in every 64-bit lane: block i's low, block i+1's high) -> bytes
 * 0x10 where the quant's bit 4 is set, in the pair order: bits 0-15 of both blocks (half 0), or
 * bits 16-31 (half 1) */
LP_INLINE __m256i gv2_hbits(__m256i h, int half) {
    const __m256i pick = half == 0 ? _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0404040404040404LL,
                                                        0x0505050505050505LL)
                                   : _mm256_setr_epi64x(0x0202020202020202LL, 0x0303030303030303LL,
                                                        0x0606060606060606LL, 0x0707070707070707LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, pick), bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* block pair j (b: its first weight block) of one row: the int32 dot products of its low and
 * high vectors (see prep above) */
LP_INLINE void gv_dots(const int kind, const uint8_t *b, const gv_vec *pj, __m256i *plo, __m256i *phi) {
    const int wb = GK_WBYTES(kind);
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
    const __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + GV_QS(kind)))),
                                              _mm_loadu_si128((const __m128i *)(b + wb + GV_QS(kind))), 1);
    __m256i lo = _mm256_and_si256(t, m4), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), m4);
    if (GV_HIGH(kind)) {
        int32_t h0, h1;
        memcpy(&h0, b + GV_QH(kind), 4);
        memcpy(&h1, b + wb + GV_QH(kind), 4);
        const __m256i h = _mm256_broadcastq_epi64(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1));
        lo = _mm256_or_si256(lo, gv2_hbits(h, 0));
        hi = _mm256_or_si256(hi, gv2_hbits(h, 1));
    }
    *plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_load_si256(pj)), ones);
    *phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_load_si256(pj + 1)), ones);
    if (GK_SIGNED(kind)) {
        *plo = _mm256_add_epi32(*plo, _mm256_load_si256(pj + 2));
        *phi = _mm256_add_epi32(*phi, _mm256_load_si256(pj + 3));
    }
}

/* the pair's dot products scaled by its blocks' dx * dy (d0, d1: broadcast) into acc, block i first */
LP_INLINE __m256 gv_fmadd(__m256 acc, __m256i plo, __m256i phi, __m256 d0, __m256 d1) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(plo, phi, 0x20)), d0, acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(plo, phi, 0x31)), d1, acc);
}

/* one row (w) into s: one stream, prefetched ahead (lp_pf_ahead) */
LP_INLINE void gv_row(const int kind, int nb, const uint8_t *w, const uint8_t *x, const gv_vec *prep, float *s) {
    const int wb = GK_WBYTES(kind), np = nb / 2;
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    for (int j = 0; j < np; j++) {
        const uint8_t *b = w + (int64_t)(2 * j) * wb;
        const gv_vec *pj = prep + GV_PREP * j;
        lp_pf_ahead(b, 2 * wb);
        __m256i plo, phi;
        gv_dots(kind, b, pj, &plo, &phi);
        /* [dx0 * dy0, m0 * s0, dx1 * dy1, m1 * s1] */
        const __m128 p = _mm_mul_ps(gv_pair(b, wb), _mm256_castps256_ps128(_mm256_castsi256_ps(_mm256_load_si256(pj + 4))));
        acc = gv_fmadd(acc, plo, phi, _mm256_broadcastss_ps(p), _mm256_broadcastss_ps(_mm_movehl_ps(p, p)));
        if (GK_MINS(kind)) summ = gv_mins(summ, _mm_movehdup_ps(p));
    }
    if (nb & 1) gv_tail(kind, nb - 1, w, x, &acc, &summ);
    const float v = hsum8(acc);
    *s = GK_MINS(kind) ? v + summ : v;
}

/* four rows (w, w + row_bytes, ...) into s[0..4): independent fmadd chains (one row's two fmadds
 * a pair are its loop's latency), the group's rows ahead prefetched (lp_pf_group) */
LP_INLINE void gv_rows4(const int kind, int nb, const uint8_t *w, int64_t row_bytes, const uint8_t *x,
                        const gv_vec *prep, float *s) {
    const int wb = GK_WBYTES(kind), np = nb / 2;
    __m256 acc[4], summ = _mm256_setzero_ps(); /* summ: row r's sum of m * s in lane 2r + 1 */
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    const lp_pf pf = lp_pf_group(w, 4 * row_bytes, np > 0 ? np : 1);
    for (int j = 0; j < np; j++) {
        const uint8_t *b = w + (int64_t)(2 * j) * wb;
        const gv_vec *pj = prep + GV_PREP * j;
        lp_pf_step(&pf, j);
        const __m256 y = _mm256_castsi256_ps(_mm256_load_si256(pj + 4));
        /* row r's dx * dy in lane 2r, m * s in lane 2r + 1: block i (p0), block i + 1 (p1) */
        const __m256 p0 = _mm256_mul_ps(_mm256_cvtph_ps(gv_heads4(b, row_bytes)), _mm256_permute_ps(y, 0x44));
        const __m256 p1 = _mm256_mul_ps(_mm256_cvtph_ps(gv_heads4(b + wb, row_bytes)), _mm256_permute_ps(y, 0xEE));
        if (GK_MINS(kind)) summ = _mm256_add_ps(_mm256_add_ps(summ, p0), p1);
        /* rows 0-1's lanes in both halves (h[0], h[2]), rows 2-3's (h[1], h[3]): then one in-lane
         * permute a row broadcasts its dx * dy */
        const __m256 h[4] = {_mm256_permute2f128_ps(p0, p0, 0x00), _mm256_permute2f128_ps(p0, p0, 0x11),
                             _mm256_permute2f128_ps(p1, p1, 0x00), _mm256_permute2f128_ps(p1, p1, 0x11)};
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m256i plo, phi;
            gv_dots(kind, b + r * row_bytes, pj, &plo, &phi);
            const __m256 d0 = r & 1 ? _mm256_permute_ps(h[r >> 1], 0xAA) : _mm256_permute_ps(h[r >> 1], 0x00);
            const __m256 d1 = r & 1 ? _mm256_permute_ps(h[2 + (r >> 1)], 0xAA) : _mm256_permute_ps(h[2 + (r >> 1)], 0x00);
            acc[r] = gv_fmadd(acc[r], plo, phi, d0, d1);
        }
    }
    float sm[8];
    _mm256_storeu_ps(sm, summ);
    for (int r = 0; r < 4; r++) {
        float t = GK_MINS(kind) ? sm[2 * r + 1] : 0.0f;
        if (nb & 1) gv_tail(kind, nb - 1, w + r * row_bytes, x, &acc[r], &t);
        const float v = hsum8(acc[r]);
        s[r] = GK_MINS(kind) ? v + t : v;
    }
}

LP_INLINE void gv_prep(const int kind, int np, const uint8_t *x, gv_vec *prep) {
    const int yb = GK_YB(kind), yq = GK_YQ(kind);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < np; j++) {
        const uint8_t *y0 = x + (int64_t)(2 * j) * yb + yq, *y1 = y0 + yb;
        gv_vec *pj = prep + GV_PREP * j;
        for (int k = 0; k < 2; k++)
            pj[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(y0 + 16 * k))),
                                            _mm_loadu_si128((const __m128i *)(y1 + 16 * k)), 1);
        if (GK_SIGNED(kind)) { /* -(offset x the sum of each 4 activations) */
            const __m256i c = _mm256_set1_epi8(16); /* Q5_0 (Q8_0 takes gv8_rows on AVX2: GV_FAST) */
            for (int k = 0; k < 2; k++)
                pj[2 + k] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(_mm256_maddubs_epi16(c, pj[k]), ones));
        }
        /* [dy0 s0 dy1 s1] (q8_1 blocks: d then s); q8_0 blocks have no s: those lanes 0 */
        __m128 ds = gv_pair(x + (int64_t)(2 * j) * yb, yb);
        if (!GK_MINS(kind)) ds = _mm_blend_ps(ds, _mm_setzero_ps(), 0xA);
        pj[4] = _mm256_castps_si256(_mm256_set_m128(ds, ds));
    }
}
LP_INLINE void gv_gemv(const int kind, int nb, float *s, const uint8_t *w, int64_t row_bytes, int nr,
                       const uint8_t *x) {
    const int np = nb / 2;
    gv_vec prep[GV_PREP * (np > 0 ? np : 1)];
    gv_prep(kind, np, x, prep);
    int r = 0;
    for (; r + 4 <= nr; r += 4) gv_rows4(kind, nb, w + r * row_bytes, row_bytes, x, prep, s + r);
    for (; r < nr; r++) gv_row(kind, nb, w + r * row_bytes, x, prep, s + r);
}
#endif


/* NR weight rows x NC activation rows (compile-time constants once inlined) */
LP_INLINE void gk_tile(const int kind, const int NR, const int NC, int nb, float *s, int64_t ld_s,
                       const uint8_t *w, int64_t row_bytes, const uint8_t *x, int64_t x_bytes, const float *yd,
                       const float *ys, const void *zp) {
    __m128 summ[GEMM_NR]; /* the 4 columns' sums of m * s */
    float sm[GEMM_NR][4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) summ[r] = _mm_setzero_ps();
#if defined(GK_ZMM)
    /* column pairs in 512-bit accumulators; an odd last column in a 256-bit one */
    const int NCP = NC / 2, c1 = NC - 1;
    __m512 accz[GEMM_NR][LP_GEMM_COLS / 2];
    __m256 acc1[GEMM_NR][LP_GEMM_COLS];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        acc1[r][0] = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int k = 0; k < NCP; k++) accz[r][k] = _mm512_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        if (GK_MINS(kind)) gk_mins(kind, NR, i, summ, w, row_bytes, ys);
        gk_step_z(kind, NR, NCP, i, accz, w, row_bytes, (const __m512i *)zp);
        if (NC & 1) gk_step(kind, NR, 1, i, acc1, w, row_bytes, x + c1 * x_bytes, x_bytes, yd + c1);
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        _mm_storeu_ps(sm[r], summ[r]);
#pragma GCC unroll 2
        for (int k = 0; k < NCP; k++) {
            const float lo = hsum8(_mm512_castps512_ps256(accz[r][k])), hi = hsum8(_mm512_extractf32x8_ps(accz[r][k], 1));
            s[2 * k * ld_s + r] = GK_MINS(kind) ? lo + sm[r][2 * k] : lo;
            s[(2 * k + 1) * ld_s + r] = GK_MINS(kind) ? hi + sm[r][2 * k + 1] : hi;
        }
        if (NC & 1) s[c1 * ld_s + r] = GK_MINS(kind) ? hsum8(acc1[r][0]) + sm[r][c1] : hsum8(acc1[r][0]);
    }
#else
    (void)zp;
    __m256 acc[GEMM_NR][LP_GEMM_COLS];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++) {
        if (GK_MINS(kind)) gk_mins(kind, NR, i, summ, w, row_bytes, ys);
        gk_step(kind, NR, NC, i, acc, w, row_bytes, x, x_bytes, yd);
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        _mm_storeu_ps(sm[r], summ[r]);
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) s[c * ld_s + r] = GK_MINS(kind) ? hsum8(acc[r][c]) + sm[r][c] : hsum8(acc[r][c]);
    }
#endif
}

LP_INLINE void gk_rows(const int kind, const int NC, const int pairs, int nb, float *s, int64_t ld_s,
                       const uint8_t *w, int64_t row_bytes, int nr, const uint8_t *x, int64_t x_bytes,
                       const float *yd, const float *ys, const void *zp) {
    int r = 0;
    /* rows in pairs only for 3-4 columns: with 1-2 the pairs were slower on memory-bound
     * matrices (2048x8192 at 2 tokens: 0.4-0.66x, noisy) and no faster on small ones; and only
     * where asked (`pairs`): on weights streamed from memory once (a decode batch of <= 4
     * tokens) single rows are faster at 3-4 columns too (SmolLM2's 49152x576 Q8_0 output at 4
     * tokens: 1.9 ms single rows, 3.4 ms pairs; a 4-token decode step 12 % faster, noisy).
     * Those figures predate the one-accumulator order: an output is now one fmadd chain (a
     * 512-bit vector holds a column pair), so 1-2 columns take rows in pairs to have two
     * independent chains (2 tokens on SmolLM2's matrices: 3x slower with single rows) */
    if (GEMM_NR == 2 && ((pairs && NC >= 3) || NC <= 2))
        for (; r + 2 <= nr; r += 2)
            gk_tile(kind, 2, NC, nb, s + r, ld_s, w + r * row_bytes, row_bytes, x, x_bytes, yd, ys, zp);
    for (; r < nr; r++) gk_tile(kind, 1, NC, nb, s + r, ld_s, w + r * row_bytes, row_bytes, x, x_bytes, yd, ys, zp);
}

LP_INLINE void gk_gemm(const int kind, const int pairs, int n, float *s, int64_t ld_s, const void *vw,
                       int64_t row_bytes, int nr, const void *vx, int64_t x_bytes, int nc) {
    const int nb = n / QK8_0;
    const uint8_t *x = vx;
    /* the columns' scales (and q8_1 sums) as float32, [block][column] */
    float yd[nb * LP_GEMM_COLS], ys[GK_MINS(kind) ? nb * LP_GEMM_COLS : 1];
    if (GK_MINS(kind) && nc < LP_GEMM_COLS) memset(ys, 0, sizeof ys); /* the unused lanes */
    for (int c = 0; c < nc; c++) {
        const uint8_t *xc = x + c * x_bytes;
        for (int i = 0; i < nb; i++) {
            lp_half h;
            memcpy(&h, xc + (int64_t)i * (GK_MINS(kind) ? sizeof(block_q8_1) : sizeof(block_q8_0)), 2);
            yd[i * LP_GEMM_COLS + c] = H2F(h);
            if (GK_MINS(kind)) {
                memcpy(&h, xc + (int64_t)i * sizeof(block_q8_1) + 2, 2);
                ys[i * LP_GEMM_COLS + c] = H2F(h);
            }
        }
    }
    const uint8_t *w = vw;
#if defined(GK_ZMM)
    __m512i zp[GK_ZP * (nb > 0 ? nb : 1)];
    gk_zprep(kind, nb, (nc < LP_GEMM_COLS ? nc : LP_GEMM_COLS) / 2, x, x_bytes, yd, zp);
#else
    const void *zp = NULL;
#endif
    switch (nc) {
    case 1: gk_rows(kind, 1, pairs, nb, s, ld_s, w, row_bytes, nr, x, x_bytes, yd, ys, zp); break;
    case 2: gk_rows(kind, 2, pairs, nb, s, ld_s, w, row_bytes, nr, x, x_bytes, yd, ys, zp); break;
    case 3: gk_rows(kind, 3, pairs, nb, s, ld_s, w, row_bytes, nr, x, x_bytes, yd, ys, zp); break;
    default: gk_rows(kind, 4, pairs, nb, s, ld_s, w, row_bytes, nr, x, x_bytes, yd, ys, zp); break;
    }
}

/* the rows the decode-batch kernel (gv_gemm_cols, AVX-512) did; gk_gemm does the rest */
#if defined(GK_ZMM)
#define GK_R1_ROWS(kind, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc) gv_gemm_cols(kind, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc)
#else
#define GK_R1_ROWS(kind, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc) 0
#endif
/* name: rows in pairs at 3-4 columns (weights reused from cache: a prompt's column groups);
 * name_r1: one row at a time (weights streamed from memory once: a decode batch); on AVX-512
 * gv_gemm_cols (4 rows a step, each row pair's quants decoded once for the 2-4 columns) does its
 * rows first: Q4_1 at 2 / 4 tokens 1.3-1.5x faster than single rows (one thread, SmolLM2's
 * matrices in L3), Q8_0's 49152x576 output at 4 tokens 1.2x */
#define GK_DEFINE(name, kind)                                                                             \
    LP_API void name(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, \
                     int64_t x_bytes, int nc) {                                                           \
        gk_gemm(kind, 1, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);                                   \
    }                                                                                                     \
    LP_API void name##_r1(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr,        \
                          const void *x, int64_t x_bytes, int nc) {                                       \
        const int r = GK_R1_ROWS(kind, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc);                     \
        if (r < nr)                                                                                       \
            gk_gemm(kind, 0, n, s + (r > 0 ? r : 0), ld_s, (const uint8_t *)w + (r > 0 ? r : 0) * row_bytes, \
                    row_bytes, nr - (r > 0 ? r : 0), x, x_bytes, nc);                                     \
    }
GK_DEFINE(lp_gemm_q4_1_q8_1, GK_Q4_1)
GK_DEFINE(lp_gemm_q5_0_q8_0, GK_Q5_0)
GK_DEFINE(lp_gemm_q5_1_q8_1, GK_Q5_1)
GK_DEFINE(lp_gemm_q8_0_q8_0, GK_Q8_0)
#undef GK_DEFINE

/* the 32 quants of weight block b as stored: the nibble kinds' 0..15 / 0..31 (Q5_0 before its
 * - 16), Q8_0's signed (the prompt panels below) */
LP_INLINE __m256i gp_raw(const int kind, const uint8_t *b) {
    if (kind == GK_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m256i q = nibbles32(b + GV_QS(kind));
    return GV_HIGH(kind) ? _mm256_or_si256(q, hbits32(b + GV_QH(kind))) : q;
}

#if defined(GK_ZMM)
/* Prompts (any number of columns, lp_gemm_<type>_panel; qmatmul.c mm_rows hands them a thread's
 * whole range of rows and every token of the micro-batch): each output's float32 operations are
 * its vec_dot's, in its order (the int32 lanes of a block, one cvt, the scale dx * dy rounded once,
 * one fmadd into the one accumulator; the mins m * s then + in block order; hsum8 + summ), so the
 * same bits as lp_gemm_* and the vec_dot. What changes is how little is done around them:
 * - the activations are prepared once a call (gp_act: per group of 4 columns and block, the 4
 *   columns' 32 quants, their scales d and sums s as float32), on the heap (~1.1 x their bytes);
 * - the weights are decoded once per PANEL of rows (gp_quad: per 4 rows and block, two 512-bit
 *   vectors of quants, rows 2k and 2k+1 side by side, their scales as [dx x8 | dx' x8], and the
 *   4 rows' mins spread to [m x4 ...]), a panel (~32 KiB) staying in L1 while every column group
 *   passes by;
 * - a tile is 8 rows x 4 columns (16 accumulators, two outputs a vector: a row pair's halves):
 *   per block and row pair x column one vpdpbusd (its quants against the column's broadcast from
 *   memory), one convert, one multiply (dx pair x dy broadcast from memory) and one fmadd, and the
 *   mins of 4 rows x 4 columns one multiply and add (16 chains in one vector).
 * The signed kinds (Q5_0, Q8_0) keep their weights signed (q - 16, q) and take the
 * activations unsigned (a + 128, exact: a ^ 0x80), the panel holding -128 x each 4 weights' sum
 * as the vpdpbusd's start: the lanes sum (a + 128) w - 128 w = a w exactly (vpdpbusd does not
 * saturate). Measured (one thread of the shared 2-core AVX-512 host, SmolLM2's 576x576, 1536x576
 * and 576x1536 through lp_mul_mat_q, A/B in one process, best of 7; the same bits): 512 tokens
 * ~33 -> ~80 G multiply-adds/s for Q4_1 (2.4x), Q4_0 (here then) 2.4-2.5x, Q5_0 2.8-2.9x,
 * Q5_1 2.6-2.8x, Q8_0 2.0-2.1x; Q4_1 at 64 tokens 2.2-2.3x, 17: 1.6-1.7x, 8: 1.35-1.4x, 5: ~1.03x. */
typedef struct {
    __m512i q[2]; /* row pairs (0,1) and (2,3): 32 quants each, side by side */
    __m512 d[2];  /* [dx x8 | dx' x8] of the pairs */
    __m512 m;     /* mins kinds: [m0 x4, m1 x4, m2 x4, m3 x4] */
    __m512i c[2]; /* signed kinds: the pairs' -128 x the sums of each 4 weights */
} gp_quad;
typedef struct {
    uint8_t q[4][32]; /* the 4 columns' quants (signed kinds: + 128) */
    float d[4], s[4];
} gp_act;
#define GP_PANEL_BYTES (32 * 1024)
#define GP_QUAD_BYTES(k) (GK_SIGNED(k) ? (int)sizeof(gp_quad) : (int)offsetof(gp_quad, c))

/* the 32 quants of weight block b as the panel holds them: unsigned kinds 0..15 / 0..31, signed
 * kinds signed */
LP_INLINE __m256i gp_quants(const int kind, const uint8_t *b) {
    const __m256i q = gp_raw(kind, b);
    if (kind == GK_Q5_0) return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    return q;
}

/* rows w .. w + (nrows - 1) * row_bytes (nrows 1..4; missing rows repeat the last) -> nb quads */
LP_INLINE void gp_decode(const int kind, int nb, const uint8_t *w, int64_t row_bytes, int nrows, uint8_t *pq) {
    const int wb = GK_WBYTES(kind), qb = GP_QUAD_BYTES(kind);
    for (int i = 0; i < nb; i++) {
        gp_quad *p = (gp_quad *)(pq + (int64_t)i * qb);
        float m[16];
        for (int k = 0; k < 2; k++) {
            const uint8_t *b0 = w + (int64_t)(2 * k < nrows ? 2 * k : nrows - 1) * row_bytes + (int64_t)i * wb;
            const uint8_t *b1 = w + (int64_t)(2 * k + 1 < nrows ? 2 * k + 1 : nrows - 1) * row_bytes + (int64_t)i * wb;
            const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(gp_quants(kind, b0)), gp_quants(kind, b1), 1);
            _mm512_store_si512(&p->q[k], q);
            lp_half h0, h1;
            memcpy(&h0, b0, 2);
            memcpy(&h1, b1, 2);
            _mm512_store_ps(&p->d[k], _mm512_insertf32x8(_mm512_set1_ps(H2F(h0)), _mm256_set1_ps(H2F(h1)), 1));
            if (GK_MINS(kind)) {
                memcpy(&h0, b0 + 2, 2);
                memcpy(&h1, b1 + 2, 2);
                for (int l = 0; l < 4; l++) m[8 * k + l] = H2F(h0), m[8 * k + 4 + l] = H2F(h1);
            }
            if (GK_SIGNED(kind))
                _mm512_store_si512(&p->c[k], _mm512_sub_epi32(_mm512_setzero_si512(),
                                                              _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                                                  _mm512_set1_epi8((char)0x80), q)));
        }
        if (GK_MINS(kind)) _mm512_store_ps(&p->m, _mm512_loadu_ps(m));
    }
}

/* columns x .. x + (nc - 1) * x_bytes -> ng = ceil(nc / 4) groups of nb gp_act (a missing
 * column repeats the last) */
LP_INLINE void gp_prep(const int kind, int nb, const uint8_t *x, int64_t x_bytes, int nc, gp_act *a) {
    const int yb = GK_YB(kind), yq = GK_YQ(kind);
    for (int g = 0; g * 4 < nc; g++)
        for (int c = 0; c < 4; c++) {
            const uint8_t *xc = x + (int64_t)(4 * g + c < nc ? 4 * g + c : nc - 1) * x_bytes;
            for (int i = 0; i < nb; i++) {
                gp_act *p = a + (int64_t)g * nb + i;
                const uint8_t *y = xc + (int64_t)i * yb;
                __m256i q = _mm256_loadu_si256((const __m256i *)(y + yq));
                if (GK_SIGNED(kind)) q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
                _mm256_store_si256((__m256i *)p->q[c], q);
                lp_half h;
                memcpy(&h, y, 2);
                p->d[c] = H2F(h);
                if (GK_MINS(kind)) {
                    memcpy(&h, y + 2, 2);
                    p->s[c] = H2F(h);
                } else
                    p->s[c] = 0.0f;
            }
        }
}

/* NQ quads (pq: quad 0's nb entries, then quad 1's) x one group of 4 columns: out[c][4j + k] */
LP_INLINE void gp_tile(const int kind, const int NQ, int nb, const uint8_t *pq, const gp_act *a, float out[4][8]) {
    const int qb = GP_QUAD_BYTES(kind);
    __m512 acc[4][4], summ[2];
#pragma GCC unroll 4
    for (int h = 0; h < 2 * NQ; h++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[h][c] = _mm512_setzero_ps();
    summ[0] = summ[1] = _mm512_setzero_ps();
    for (int i = 0; i < nb; i++) {
        const gp_act *ai = a + i;
        __m512i y[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) y[c] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)ai->q[c]));
#pragma GCC unroll 2
        for (int j = 0; j < NQ; j++) {
            const gp_quad *p = (const gp_quad *)(pq + ((int64_t)j * nb + i) * qb);
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++) {
                const __m512i wq = _mm512_load_si512(&p->q[k]);
                const __m512 dx = _mm512_load_ps(&p->d[k]);
                const __m512i c0 = GK_SIGNED(kind) ? _mm512_load_si512(&p->c[k]) : _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const __m512i s = GK_SIGNED(kind) ? _mm512_dpbusd_epi32(c0, y[c], wq) : _mm512_dpbusd_epi32(c0, wq, y[c]);
                    acc[2 * j + k][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dx, _mm512_set1_ps(ai->d[c])),
                                                        acc[2 * j + k][c]);
                }
            }
            if (GK_MINS(kind))
                summ[j] = _mm512_add_ps(summ[j], _mm512_mul_ps(_mm512_load_ps(&p->m), _mm512_broadcast_f32x4(_mm_load_ps(ai->s))));
        }
    }
    float sm[2][16];
#pragma GCC unroll 2
    for (int j = 0; j < NQ; j++) _mm512_storeu_ps(sm[j], summ[j]);
#pragma GCC unroll 2
    for (int j = 0; j < NQ; j++)
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m512 v = acc[2 * j + k][c];
                const float lo = hsum8(_mm512_castps512_ps256(v)), hi = hsum8(_mm512_extractf32x8_ps(v, 1));
                out[c][4 * j + 2 * k] = GK_MINS(kind) ? lo + sm[j][4 * (2 * k) + c] : lo;
                out[c][4 * j + 2 * k + 1] = GK_MINS(kind) ? hi + sm[j][4 * (2 * k + 1) + c] : hi;
            }
}

/* 0, or -1 where the buffers cannot be allocated (the caller then takes 4 columns a call) */
LP_INLINE int gp_gemm(const int kind, int n, float *s, int64_t ld_s, const uint8_t *w, int64_t row_bytes, int nr,
                      const uint8_t *x, int64_t x_bytes, int nc) {
    const int nb = n / QK8_0, ng = (nc + 3) / 4, qb = GP_QUAD_BYTES(kind);
    if (nb <= 0 || nr <= 0 || nc <= 0) return nb <= 0 ? -1 : 0;
    int rq = (int)(GP_PANEL_BYTES / ((int64_t)nb * qb)); /* quads a panel */
    rq = rq < 2 ? 2 : rq & ~1;
    if (rq * 4 > nr + 7) rq = (nr + 7) / 8 * 2;
    gp_act *a = aligned_alloc(64, ((size_t)ng * nb * sizeof(gp_act) + 63) / 64 * 64);
    uint8_t *pq = aligned_alloc(64, (size_t)rq * nb * qb);
    if (a == NULL || pq == NULL) {
        free(a);
        free(pq);
        return -1;
    }
    gp_prep(kind, nb, x, x_bytes, nc, a);
    for (int r0 = 0; r0 < nr; r0 += 4 * rq) {
        const int rows = nr - r0 < 4 * rq ? nr - r0 : 4 * rq, nq = (rows + 3) / 4;
        for (int j = 0; j < nq; j++) {
            const int left = rows - 4 * j;
            gp_decode(kind, nb, w + (int64_t)(r0 + 4 * j) * row_bytes, row_bytes, left < 4 ? left : 4,
                      pq + (int64_t)j * nb * qb);
        }
        for (int g = 0; g < ng; g++) {
            const int cols = nc - 4 * g < 4 ? nc - 4 * g : 4;
            for (int j = 0; j < nq; j += 2) {
                float out[4][8];
                const int two = j + 1 < nq, rr = rows - 4 * j < 8 ? rows - 4 * j : 8;
                if (two) gp_tile(kind, 2, nb, pq + (int64_t)j * nb * qb, a + (int64_t)g * nb, out);
                else gp_tile(kind, 1, nb, pq + (int64_t)j * nb * qb, a + (int64_t)g * nb, out);
                for (int c = 0; c < cols; c++)
                    for (int r = 0; r < rr; r++) s[(int64_t)(4 * g + c) * ld_s + r0 + 4 * j + r] = out[c][r];
            }
        }
    }
    free(a);
    free(pq);
    return 0;
}

#else
/* Prompts on AVX2 (lp_gemm_<type>_panel, as above): each output's float32 operations are its
 * vec_dot's, in its order, so the same bits; around them, the AVX-512 panel's plan in 256 bits
 * without VNNI:
 * - the activations prepared once a call (gp2_act: per group of 4 columns and block, the quants,
 *   d and s as float32, and for Q5_0 -16 x the sums of each 4 quants);
 * - the weights decoded once per panel of rows (gp2_pair: per 2 rows and block, the quants as
 *   stored, the scales as [dx x4 | dx' x4] and the mins as [m x4 | m' x4]; Q8_0 also the signed
 *   quants);
 * - a tile is 2 rows x 4 columns (8 accumulators): per block and output one maddubs, one madd,
 *   one convert and one fmadd (and the tile's 8 dx * dy in one multiply); Q5_0 adds the
 *   column's offset sums (the weights used unsigned: (q - 16) y = q y - 16 y, exact), Q8_0 keeps
 *   the vec_dot's sign trick (its q + 128 would overflow maddubs' pairs), and the mins of 2 rows
 *   x 4 columns are one multiply and add (8 chains in one vector).
 * The panel (GP2_PANEL_BYTES) is L2-sized: a 2-row tile is small, so each column group's
 * activations (kept in L1 across the panel's rows) are read from further out once per panel.
 * Measured (stop 23, 2 threads, the AVX2 library, one layer's 7 matrices, A/B in one process;
 * the same bits): SmolLM2 Q4_1, 512 tokens, 22.4 ms -> 19.7 / 18.9 / 19.0 with 16 / 64 / 256 KiB
 * panels, 64 tokens 3.17 -> 2.59, 16: 0.82 -> 0.75, 8: 0.39 -> 0.39, 5: 0.34 -> 0.46 (below
 * MM_PANEL_MIN, qmatmul.c); the 1B shape --pure Q4_0 (here then; iquants.c's since), 512 tokens
 * 411 -> 346 / 322 / 307 ms, 64:
 * 45.6 -> 39.0, 16: 11.6 -> 11.6. The tile's 8 scales dx * dy are one multiply, stored and
 * broadcast back by loads (instead of 8 multiplies): Q4_1 / Q8_0 1B shape 512 tokens a further
 * 306 -> 279 / 343 -> 312 ms, SmolLM2 20.5 -> 19.8; Q4_0 / Q5_0 (their offset sums are another load
 * an output) 346 / 331 -> 344 / 351, 321 -> 333 (noise). */
typedef struct {
    __m256i q[2];  /* rows r, r + 1: the 32 quants as stored (Q8_0: |q|) */
    __m256i sq[2]; /* Q8_0: the signed quants */
    __m256 d;      /* [dx x4 | dx' x4] */
    __m256 m;      /* mins kinds: [m x4 | m' x4] */
} gp2_pair;
typedef struct {
    int8_t q[4][32]; /* the 4 columns' quants */
    __m256i c[4];    /* Q5_0: -16 x the sums of each 4 quants */
    float d[4], s[4];
} gp2_act;
#define GP2_PANEL_BYTES (256 * 1024)
#define GP2_OFFSET(k) ((k) == GK_Q5_0 ? 16 : 0)

/* rows w, w + row_bytes (nrows 1 or 2; a missing row repeats the first) -> nb pairs */
LP_INLINE void gp2_decode(const int kind, int nb, const uint8_t *w, int64_t row_bytes, int nrows, gp2_pair *pp) {
    const int wb = GK_WBYTES(kind);
    for (int i = 0; i < nb; i++) {
        gp2_pair *p = pp + i;
        float d[8], m[8];
        for (int r = 0; r < 2; r++) {
            const uint8_t *b = w + (r < nrows ? r : 0) * row_bytes + (int64_t)i * wb;
            const __m256i q = gp_raw(kind, b);
            _mm256_store_si256(&p->q[r], kind == GK_Q8_0 ? _mm256_sign_epi8(q, q) : q);
            if (kind == GK_Q8_0) _mm256_store_si256(&p->sq[r], q);
            lp_half h;
            memcpy(&h, b, 2);
            for (int l = 0; l < 4; l++) d[4 * r + l] = H2F(h);
            if (GK_MINS(kind)) {
                memcpy(&h, b + 2, 2);
                for (int l = 0; l < 4; l++) m[4 * r + l] = H2F(h);
            }
        }
        _mm256_store_ps((float *)&p->d, _mm256_loadu_ps(d));
        if (GK_MINS(kind)) _mm256_store_ps((float *)&p->m, _mm256_loadu_ps(m));
    }
}

/* columns x .. x + (nc - 1) * x_bytes -> ceil(nc / 4) groups of nb gp2_act (a missing column
 * repeats the last) */
LP_INLINE void gp2_prep(const int kind, int nb, const uint8_t *x, int64_t x_bytes, int nc, gp2_act *a) {
    const int yb = GK_YB(kind), yq = GK_YQ(kind);
    for (int g = 0; g * 4 < nc; g++)
        for (int c = 0; c < 4; c++) {
            const uint8_t *xc = x + (int64_t)(4 * g + c < nc ? 4 * g + c : nc - 1) * x_bytes;
            for (int i = 0; i < nb; i++) {
                gp2_act *p = a + (int64_t)g * nb + i;
                const uint8_t *y = xc + (int64_t)i * yb;
                const __m256i q = _mm256_loadu_si256((const __m256i *)(y + yq));
                _mm256_store_si256((__m256i *)p->q[c], q);
                if (GP2_OFFSET(kind))
                    _mm256_store_si256(&p->c[c], _mm256_sub_epi32(_mm256_setzero_si256(),
                                                                  _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(GP2_OFFSET(kind)), q),
                                                                                    _mm256_set1_epi16(1))));
                lp_half h;
                memcpy(&h, y, 2);
                p->d[c] = H2F(h);
                p->s[c] = 0.0f;
                if (GK_MINS(kind)) {
                    memcpy(&h, y + 2, 2);
                    p->s[c] = H2F(h);
                }
            }
        }
}

/* one row pair x one group of 4 columns: out[c][r] */
LP_INLINE void gp2_tile(const int kind, int nb, const gp2_pair *pp, const gp2_act *a, float out[4][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4], summ = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    float dd[8] __attribute__((aligned(32)));
    for (int i = 0; i < nb; i++) {
        const gp2_pair *p = pp + i;
        const gp2_act *ai = a + i;
        /* the 8 scales dx * dy in one multiply, each broadcast back from memory (a load, not a
         * multiply a tile output) */
        _mm256_store_ps(dd, _mm256_mul_ps(_mm256_load_ps((const float *)&p->d), _mm256_broadcast_ps((const __m128 *)ai->d)));
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i y = _mm256_load_si256((const __m256i *)ai->q[c]);
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) {
                const __m256i wq = _mm256_load_si256(&p->q[r]);
                const __m256i yr = kind == GK_Q8_0 ? _mm256_sign_epi8(y, _mm256_load_si256(&p->sq[r])) : y;
                __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, yr), ones);
                if (GP2_OFFSET(kind)) s32 = _mm256_add_epi32(s32, _mm256_load_si256(&ai->c[c]));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(&dd[4 * r + c]), acc[r][c]);
            }
        }
        if (GK_MINS(kind))
            summ = _mm256_add_ps(summ, _mm256_mul_ps(_mm256_load_ps((const float *)&p->m), _mm256_broadcast_ps((const __m128 *)ai->s)));
    }
    float sm[8];
    _mm256_storeu_ps(sm, summ);
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) out[c][r] = GK_MINS(kind) ? hsum8(acc[r][c]) + sm[4 * r + c] : hsum8(acc[r][c]);
}

/* 0, or -1 where the buffers cannot be allocated (the caller then takes 4 columns a call) */
LP_INLINE int gp_gemm(const int kind, int n, float *s, int64_t ld_s, const uint8_t *w, int64_t row_bytes, int nr,
                      const uint8_t *x, int64_t x_bytes, int nc) {
    const int nb = n / QK8_0, ng = (nc + 3) / 4;
    if (nb <= 0 || nr <= 0 || nc <= 0) return nb <= 0 ? -1 : 0;
    int rp = (int)(GP2_PANEL_BYTES / ((int64_t)nb * sizeof(gp2_pair))); /* row pairs a panel */
    rp = rp < 1 ? 1 : rp;
    if (rp * 2 > nr + 1) rp = (nr + 1) / 2;
    gp2_act *a = aligned_alloc(64, ((size_t)ng * nb * sizeof(gp2_act) + 63) / 64 * 64);
    gp2_pair *pp = aligned_alloc(64, ((size_t)rp * nb * sizeof(gp2_pair) + 63) / 64 * 64);
    if (a == NULL || pp == NULL) {
        free(a);
        free(pp);
        return -1;
    }
    gp2_prep(kind, nb, x, x_bytes, nc, a);
    for (int r0 = 0; r0 < nr; r0 += 2 * rp) {
        const int rows = nr - r0 < 2 * rp ? nr - r0 : 2 * rp, np = (rows + 1) / 2;
        for (int j = 0; j < np; j++)
            gp2_decode(kind, nb, w + (int64_t)(r0 + 2 * j) * row_bytes, row_bytes, rows - 2 * j < 2 ? 1 : 2, pp + (int64_t)j * nb);
        for (int g = 0; g < ng; g++) {
            const int cols = nc - 4 * g < 4 ? nc - 4 * g : 4;
            for (int j = 0; j < np; j++) {
                float out[4][2];
                const int rr = rows - 2 * j < 2 ? 1 : 2;
                gp2_tile(kind, nb, pp + (int64_t)j * nb, a + (int64_t)g * nb, out);
                for (int c = 0; c < cols; c++)
                    for (int r = 0; r < rr; r++) s[(int64_t)(4 * g + c) * ld_s + r0 + 2 * j + r] = out[c][r];
            }
        }
    }
    free(a);
    free(pp);
    return 0;
}
#endif

/* lp_gemm_<type>_panel: any nc (lp_quants.h); the 4-column kernel where the buffers cannot be had */
#define GP_DEFINE(name, kind)                                                                            \
    LP_API void name##_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr,    \
                             const void *x, int64_t x_bytes, int nc) {                                   \
        if (gp_gemm(kind, n, s, ld_s, w, row_bytes, nr, x, x_bytes, nc) == 0) return;                    \
        for (int c = 0; c < nc; c += LP_GEMM_COLS)                                                       \
            name(n, s + c * ld_s, ld_s, w, row_bytes, nr, (const uint8_t *)x + c * x_bytes, x_bytes,     \
                 nc - c < LP_GEMM_COLS ? nc - c : LP_GEMM_COLS);                                         \
    }
GP_DEFINE(lp_gemm_q4_1_q8_1, GK_Q4_1)
GP_DEFINE(lp_gemm_q5_0_q8_0, GK_Q5_0)
GP_DEFINE(lp_gemm_q5_1_q8_1, GK_Q5_1)
GP_DEFINE(lp_gemm_q8_0_q8_0, GK_Q8_0)
#undef GP_DEFINE

/* lp_gemv_* (lp_quants.h): the decode kernels above (gv_gemv, AVX-512 or AVX2); a row longer than
 * the stack buffer allows (GV_MAX_NB blocks) is one vec_dot per row. Q8_0 on AVX2 keeps the
 * vec_dot's sign trick (its quants plus 128 would overflow maddubs' pairs) in gv8_rows: 8 rows side
 * by side, each the vec_dot's one-accumulator chain (8 chains hide the fmadd latency that bounds a
 * row alone), the group ahead prefetched (lp_pf_group). Measured on the Zen 2 host: 100,000 x 2880
 * (gpt-oss's output matrix's width), one thread, 11.0-11.3 -> 12.7 GB/s (4 rows: 11.5-11.9);
 * gptoss6 tg64, 2 threads, against the vec_dot a row alternated three times: 18.1 / 18.7 / 17.5
 * -> 19.2 / 19.8 / 19.6 tok/s. */
#if defined(GK_ZMM)
#define GV_FAST(kind) 1
#else
#define GV_FAST(kind) ((kind) != GK_Q8_0)
#endif
#define GV8_ROWS 8
LP_INLINE void gv8_rows(int nb, float *s, const uint8_t *w, int64_t row_bytes, const block_q8_0 *y) {
    __m256 acc[GV8_ROWS];
    for (int r = 0; r < GV8_ROWS; r++) acc[r] = _mm256_setzero_ps();
    const lp_pf pf = lp_pf_group(w, GV8_ROWS * row_bytes, nb);
    for (int i = 0; i < nb; i++) {
        lp_pf_step(&pf, i);
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        for (int r = 0; r < GV8_ROWS; r++) acc[r] = q8_0_block(acc[r], (const block_q8_0 *)(w + r * row_bytes) + i, y + i, qy);
    }
    for (int r = 0; r < GV8_ROWS; r++) s[r] = hsum8(acc[r]);
}
#define GV_DEFINE(name, kind, dot)                                                                        \
    LP_API void name(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x) {          \
        const int nb = n / QK8_0;                                                                         \
        int r = 0;                                                                                        \
        if (!GV_FAST(kind))                                                                               \
            for (; r + GV8_ROWS <= nr; r += GV8_ROWS)                                                     \
                gv8_rows(nb, s + r, (const uint8_t *)w + r * row_bytes, row_bytes, x);                    \
        if (nb > GV_MAX_NB || !GV_FAST(kind)) {                                                           \
            for (; r < nr; r++) dot(n, s + r, (const uint8_t *)w + r * row_bytes, x);                     \
            return;                                                                                       \
        }                                                                                                 \
        gv_gemv(kind, nb, s, w, row_bytes, nr, x);                                                        \
    }
GV_DEFINE(lp_gemv_q5_0_q8_0, GK_Q5_0, lp_vec_dot_q5_0_q8_0)
GV_DEFINE(lp_gemv_q4_1_q8_1, GK_Q4_1, lp_vec_dot_q4_1_q8_1)
GV_DEFINE(lp_gemv_q5_1_q8_1, GK_Q5_1, lp_vec_dot_q5_1_q8_1)
GV_DEFINE(lp_gemv_q8_0_q8_0, GK_Q8_0, lp_vec_dot_q8_0_q8_0)
#undef GV_DEFINE
#undef GV_FAST

#endif
