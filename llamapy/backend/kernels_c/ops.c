/* The small per-token ops of the CPU backend: rms_norm, rope, attention, swiglu.
 *
 * ggml counterparts (ggml-cpu): ops.cpp ggml_compute_forward_rms_norm (sum of squares in
 * ggml_float = double), ggml_compute_forward_rope (rope_yarn with ext_factor 0: plain
 * cos/sin of pos * theta_scale^i, neox and normal pairings), ggml_compute_forward_flash_attn_ext
 * (there an online softmax over each thread's share of the cells; here three passes per chunk of
 * a fixed number of a row's visible cells, the chunks folded in order, so that a row's result
 * depends only on its own visible cells in order: see attend_chunk and att_fold; V accumulated in
 * f32; an f16 cache gets Q rounded to f16 first, as q_to_vec_dot does), and vec.h
 * ggml_vec_swiglu_f32 / ggml_v_expf.
 * Attention takes any number of query tokens; threads are an argument of each call (none of
 * these kernels keeps state between calls).
 *
 * These are tested against the numpy reference kernels in kernels.py. Built by setup.py once
 * per SIMD variant with -O3 -std=gnu11 -ffp-contract=off -fno-math-errno -fopenmp,
 * i.e. without -ffast-math: -inf cells of the attention mask and inf/nan propagate as in
 * numpy. Reductions are written with explicit accumulator lanes (and fmaf) so that gcc
 * vectorizes them without reassociation flags. libc/libm only.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lp_quants.h" /* lp_f2h, lp_quantize_row_q8_0 (quants.c) */

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors in static functions on a non-AVX target */
#endif

#define LP_API __attribute__((visibility("default")))
#define LP_INLINE static inline __attribute__((always_inline))

/* fmaf where it is one instruction (math.h's FP_FAST_FMAF), else a multiply and an add */
#ifdef FP_FAST_FMAF
#define lp_fmaf fmaf
#else
#define lp_fmaf(a, b, c) ((a) * (b) + (c))
#endif

/* ---------------------------------------------------------------------------------------- */
/* helpers                                                                                   */

LP_INLINE uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

LP_INLINE float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* exp(x) for x <= 88, branch-free so that loops over it vectorize (ggml_v_expf's reduction and
 * polynomial: within ~2 ulp of expf). Results below 2^-126 are flushed to 0 (x < -87.3 or so),
 * -inf gives 0 and nan gives nan. */
LP_INLINE float lp_expf(float x) {
    x = x < -88.0f ? -88.0f : x; /* keeps nan; n >= -127 below, whose scale is 0.0 */
    const float r = 0x1.8p23f;
    const float z = lp_fmaf(x, 0x1.715476p+0f, r); /* x/ln2 rounded to an integer, in z's low bits */
    const float n = z - r;
    const float b = lp_fmaf(-n, 0x1.7f7d1cp-20f, lp_fmaf(-n, 0x1.62e4p-1f, x)); /* x - n*ln2 */
    const uint32_t e = f32_bits(z) << 23;
    const float k = bits_f32(e + 0x3f800000u); /* 2^n (n = -127: 0.0) */
    const float u = b * b;
    const float p = lp_fmaf(lp_fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, lp_fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f));
    const float j = lp_fmaf(p, u, 0x1.ffffecp-1f * b); /* exp(b) - 1 */
    return lp_fmaf(j, k, k);
}

/* 8-float vectors (gcc/clang vector extensions: one AVX register, or two SSE/NEON ones) */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* f16 -> f32 from the bits, branch-free (loops over it vectorize): normals and subnormals are
 * exact after scaling by 2^112 as an f32; inf and nan keep their payload. */
LP_INLINE float f16_bits_to_f32(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    const uint32_t mag = em >= 0x7c00u ? 0x7f800000u | (em << 13) : f32_bits(bits_f32(em << 13) * 0x1p112f);
    return bits_f32(mag | ((uint32_t)(h & 0x8000u) << 16));
}

/* round to f16 and back (round to nearest even; overflow to inf) */
#if defined(__FLT16_MAX__) && !defined(LP_NO_FLOAT16)
LP_INLINE float round_f16(float x) { return (float)(_Float16)x; }
#else
static uint16_t f32_to_f16(float x) {
    const uint32_t u = f32_bits(x);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;  /* nan */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                       /* below 2^-14: an f16 subnormal */
        /* adding 0.5 makes the f32 unit round to multiples of 2^-24 (in the low mantissa bits) */
        const float f = bits_f32(a) + 0.5f;
        return sign | (uint16_t)(f32_bits(f) - 0x3f000000u);
    }
    const uint32_t odd = (a >> 13) & 1u;
    return sign | (uint16_t)((a + 0xc8000fffu + odd) >> 13); /* rebias the exponent by -112, round */
}

LP_INLINE float round_f16(float x) { return f16_bits_to_f32(f32_to_f16(x)); }
#endif

/* dst[0..n) = the f16 values src[0..n), widened: vcvtph2ps with F16C (gcc does not vectorize
 * _Float16 conversions by itself), else the branch-free bit version */
#if (defined(__F16C__) && defined(__AVX__)) || defined(__AVX2__)
#include <immintrin.h>
#endif

LP_INLINE void f16_row(float *restrict dst, const uint16_t *restrict src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = f16_bits_to_f32(src[i]);
}

/* The KV cache's element types (lp_attend_q): f32, f16, and ggml's Q8_0 / Q4_0 blocks of 32 */
enum { LP_KV_F32 = 0, LP_KV_F16 = 1, LP_KV_Q8_0 = 2, LP_KV_Q4_0 = 3 };

/* dst[0..n) = one cache row expanded to f32; `off` counts elements of the type's storage unit:
 * halves for f16, bytes for Q8_0/Q4_0 (whose blocks are an f16 scale d, then 32 int8 / 32 4-bit
 * values: d*q, d*(q-8), as ggml's dequantize_row_q8_0 / q4_0) */
LP_INLINE void kv_row(float *restrict dst, const void *base, int64_t off, int type, int64_t n) {
    if (type == LP_KV_F16) {
        f16_row(dst, (const uint16_t *)base + off, n);
        return;
    }
    const uint8_t *b = (const uint8_t *)base + off;
    for (int64_t i0 = 0; i0 < n; i0 += 32) {
        const float d = f16_bits_to_f32((uint16_t)(b[0] | b[1] << 8));
        if (type == LP_KV_Q8_0) {
            const int8_t *qs = (const int8_t *)(b + 2);
            for (int j = 0; j < 32; j++) dst[i0 + j] = d * (float)qs[j];
            b += 34;
        } else {
#if defined(__AVX2__)
            /* the same operations 8 at a time: nibble - 8 as int32, to float, times d */
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2)), m4 = _mm_set1_epi8(0x0f);
            const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
            const __m256i eight = _mm256_set1_epi32(8);
            const __m256 dv = _mm256_set1_ps(d);
            const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int u = 0; u < 4; u++)
                _mm256_storeu_ps(dst + i0 + 8 * u,
                                 _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(part[u]), eight))));
#else
            for (int j = 0; j < 16; j++) {
                dst[i0 + j] = d * (float)((b[2 + j] & 0x0f) - 8);
                dst[i0 + 16 + j] = d * (float)((b[2 + j] >> 4) - 8);
            }
#endif
            b += 18;
        }
    }
}

/* x[0..n) as the Q8_0 blocks of ggml's quantize_row_q8_0_ref, expanded back (exact in f32): what
 * llama.cpp's flash attention dots a Q4_0/Q8_0 K with (their vec_dot_type is Q8_0) */
LP_INLINE void round_q8_0_row(float *restrict dst, const float *restrict x, int64_t n) {
    for (int64_t i0 = 0; i0 < n; i0 += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(x[i0 + j]) > amax ? fabsf(x[i0 + j]) : amax;
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f, dh = round_f16(d);
        for (int j = 0; j < 32; j++) dst[i0 + j] = dh * (float)(int8_t)roundf(x[i0 + j] * id);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* KV cache stores (executor.c's SET_ROWS into a quantized cache)                             */

/* llama.cpp's attn_rot: each run of n values of x[0..len) (n a power of two dividing len)
 * multiplied by the Hadamard matrix of order n, in place: quants.rotate's butterflies in its order
 * (stage h: pairs h apart within blocks of 2h become a + b, a - b), then the scale c =
 * hadamard(n)[0, 0], so the bits are the reference's. Shared with executor.c (not exported). */
void lp_hadamard_runs(float *x, int64_t len, int64_t n, float c) {
    for (int64_t r0 = 0; r0 + n <= len; r0 += n) {
        float *restrict y = x + r0;
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t b = 0; b < n; b += 2 * h)
                for (int64_t j = b; j < b + h; j++) {
                    const float p = y[j], q = y[j + h];
                    y[j] = p + q, y[j + h] = p - q;
                }
        for (int64_t i = 0; i < n; i++) y[i] *= c;
    }
}

/* n floats (a multiple of 32) as Q4_0 blocks, as ggml's quantize_row_q4_0_ref and quants.quantize:
 * d = the value of largest magnitude (its first) / -8, q = min(15, (int)(x * (1/d) + 8.5)) */
static void quantize_row_q4_0(const float *restrict x, uint8_t *restrict y, int64_t n) {
    for (int64_t i0 = 0; i0 < n; i0 += 32, x += 32, y += 18) {
        float amax = 0.0f, mx = 0.0f;
        for (int j = 0; j < 32; j++)
            if (amax < fabsf(x[j])) amax = fabsf(x[j]), mx = x[j];
        const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const lp_half dh = lp_f2h(d);
        memcpy(y, &dh, 2);
        for (int j = 0; j < 16; j++) {
            const float a = x[j] * id + 8.5f, b = x[16 + j] * id + 8.5f;
            const int qa = (int)a < 15 ? (int)a : 15, qb = (int)b < 15 ? (int)b : 15;
            y[2 + j] = (uint8_t)(qa | qb << 4);
        }
    }
}

/* Row x[0..n) stored as one cache row at dst of type t (LP_KV_Q8_0 / LP_KV_Q4_0: quants.quantize,
 * ggml's reference quantizers, bit for bit). Shared with executor.c (not exported). */
void lp_kv_quantize_row(void *dst, const float *x, int64_t n, int t) {
    if (t == LP_KV_Q8_0)
        lp_quantize_row_q8_0_ref(x, dst, n);
    else
        quantize_row_q4_0(x, dst, n);
}

/* ---------------------------------------------------------------------------------------- */
/* rms_norm                                                                                  */

/* RMS norm of `rows` rows (row t at x + t * xs) into contiguous out, times the weight w when it is
 * given (the executor's fused RMS_NORM x MUL, rounded as numpy's separate mul); shared by
 * lp_rms_norm and executor.c (one library: not exported). Rounded as ggml's rms_norm_f32, bit for
 * bit: each square in float, summed in double in order, the mean rounded to float, then
 * 1.0f / sqrtf(mean + eps) in float (any other order flips q8 activation roundings downstream). */
void lp_rms_rows(const float *x, int64_t rows, int64_t n, int64_t xs, double eps, const float *w, float *out) {
    const float epsf = (float)eps;  /* ggml keeps eps as a float op parameter */
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * xs;
        float *o = out + t * n;
        double s = 0.0;
        for (int64_t i = 0; i < n; i++) s += (double)(xr[i] * xr[i]);
        const float mean = (float)(s / (double)n);
        const float scale = 1.0f / sqrtf(mean + epsf);
        if (w)
            for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * scale) * w[i];
        else
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * scale;
    }
}

LP_API void lp_rms_norm(const float *x, int64_t rows, int64_t n, int64_t x_stride, double eps, float *out) {
    lp_rms_rows(x, rows, n, x_stride, eps, NULL, out);
}

/* ---------------------------------------------------------------------------------------- */
/* rope                                                                                      */

/* rope over rows with strides: row (t, h) of x starts at x + t * xs_t + h * xs_h (the Q/K columns
 * of a fused QKV product, for the executor); out is contiguous (T, H, D). rc: freq_base,
 * freq_scale, then each pair's rope_freqs divisor (kernels.rope_consts). Rounded as ggml's
 * rope_cache_init + rotate_pairs, bit for bit: theta_scale = powf(base, -2/n_dims), the angle by
 * the f32 recurrence theta *= theta_scale (not p * theta_scale^i), cosf/sinf, and the rotation
 * with one fma each as llama.cpp's -march=native build contracts it. Shared by lp_rope and
 * executor.c (one library: not exported). */
void lp_rope_rows(const float *x, int64_t T, int64_t H, int64_t D, int64_t xs_t, int64_t xs_h, const int32_t *pos,
                  const float *rc, int64_t n_dims, int neox, float *out) {
    const int64_t half = n_dims / 2;
    const float freq_scale = rc[1], *ff = rc + 2;
    const float theta_scale = powf(rc[0], -2.0f / (float)n_dims);
    float cs_stack[2 * 256];
    float *cs = half <= 256 ? cs_stack : malloc(2 * (size_t)half * sizeof(float));
    if (!cs) return;
    float *sn = cs + half;
    for (int64_t t = 0; t < T; t++) {
        float theta = (float)pos[t];
        for (int64_t i = 0; i < half; i++) {
            const float th = freq_scale * (theta / ff[i]);
            cs[i] = cosf(th);
            sn[i] = sinf(th);
            theta *= theta_scale;
        }
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + t * xs_t + h * xs_h;
            float *o = out + (t * H + h) * D;
            /* pairs (i, i + half) for neox, (2i, 2i + 1) otherwise */
            const int64_t step = neox ? 1 : 2, off = neox ? half : 1;
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i * step], b = xr[i * step + off];
                const float o0 = fmaf(a, cs[i], -(b * sn[i]));
                const float o1 = fmaf(a, sn[i], b * cs[i]);
                o[i * step] = o0;
                o[i * step + off] = o1;
            }
            if (o != xr)
                for (int64_t i = 2 * half; i < D; i++) o[i] = xr[i];
        }
    }
    if (cs != cs_stack) free(cs);
}

LP_API void lp_rope(const float *x, int64_t T, int64_t H, int64_t D, const int32_t *pos, const float *rc,
                    int64_t n_dims, int neox, float *out) {
    lp_rope_rows(x, T, H, D, H * D, D, pos, rc, n_dims, neox, out);
}

/* ---------------------------------------------------------------------------------------- */
/* attention                                                                                 */

/* v8f: see the helpers above; loads and stores through memcpy, so any alignment */

#if defined(__clang__)
#define SHUF8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

LP_INLINE v8f v8_load(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

LP_INLINE void v8_store(float *p, v8f v) { memcpy(p, &v, sizeof v); }

LP_INLINE v8f v8_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* lanes of a where the mask (all ones or zero, from a vector comparison) is set, else of b */
LP_INLINE v8f v8_select(v8i mask, v8f a, v8f b) { return (v8f)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* a*b + c lane by lane: one vfmadd where the target has FMA (-ffp-contract=off forbids fusing
 * a plain a*b + c) */
LP_INLINE v8f v8_fma(v8f a, v8f b, v8f c) {
#ifdef FP_FAST_FMAF
    v8f r;
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#else
    return a * b + c;
#endif
}

/* [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7], x86's hadd_ps */
LP_INLINE v8f v8_hadd(v8f a, v8f b) {
    return SHUF8(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF8(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* lane c: the sum of a[c]'s lanes (8 horizontal sums in 6 hadds and one cross-half add) */
LP_INLINE v8f v8_hsum8(const v8f a[8]) {
    const v8f g0 = v8_hadd(v8_hadd(a[0], a[1]), v8_hadd(a[2], a[3]));
    const v8f g1 = v8_hadd(v8_hadd(a[4], a[5]), v8_hadd(a[6], a[7]));
    return SHUF8(g0, g1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF8(g0, g1, 4, 5, 6, 7, 12, 13, 14, 15);
}

LP_INLINE float v8_sum(v8f a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* dot products of one query row with the 8 K rows k0 + c*ks (c < 8): one accumulator per row,
 * the query vector loaded once for all 8, the horizontal sums done together */
LP_INLINE v8f dot8(const float *restrict q, const float *restrict k0, int64_t ks, int64_t D) {
    v8f a[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) a[c] = v8_splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        const v8f qv = v8_load(q + i);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) a[c] = v8_fma(qv, v8_load(k0 + c * ks + i), a[c]);
    }
    v8f r = v8_hsum8(a);
    for (; i < D; i++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) r[c] = lp_fmaf(q[i], k0[c * ks + i], r[c]);
    return r;
}

/* a[0..Dv) += sum over c < nb of w[c] * V row c (at v0 + c*vs); cells with weight 0 (masked,
 * or underflowed) are not read. Chunks of 64 columns stay in 8 registers across the cells. */
LP_INLINE void v_accumulate(float *restrict a, const float *restrict w, int64_t nb, const float *restrict v0,
                            int64_t vs, int64_t Dv) {
    int64_t i0 = 0;
    for (; i0 + 64 <= Dv; i0 += 64) {
        v8f x[8];
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) x[u] = v8_load(a + i0 + 8 * u);
        for (int64_t c = 0; c < nb; c++) {
            if (w[c] == 0.0f) continue;
            const v8f wv = v8_splat(w[c]);
            const float *vr = v0 + c * vs + i0;
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) x[u] = v8_fma(wv, v8_load(vr + 8 * u), x[u]);
        }
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) v8_store(a + i0 + 8 * u, x[u]);
    }
    for (; i0 + 8 <= Dv; i0 += 8) {
        v8f x = v8_load(a + i0);
        for (int64_t c = 0; c < nb; c++)
            if (w[c] != 0.0f) x = v8_fma(v8_splat(w[c]), v8_load(v0 + c * vs + i0), x);
        v8_store(a + i0, x);
    }
    for (; i0 < Dv; i0++)
        for (int64_t c = 0; c < nb; c++)
            if (w[c] != 0.0f) a[i0] = lp_fmaf(w[c], v0[c * vs + i0], a[i0]);
}

#define ATT_BLOCK 64  /* KV cells per step of the score pass (a multiple of ATT_VGROUP and of 8) */
#define ATT_VGROUP 16 /* KV cells per step of the V sums */
#define ATT_ROWS 32   /* query rows (tokens x the heads of a KV group) per work unit, at least */
/* Visible cells per chunk of a query's cells: a row's cells are cut, in cell order, into chunks of
 * this many of its visible (unmasked) cells, a constant, so that the cuts depend only on the row's
 * own visible cells (not on N, the batch, the placement or the thread count); chunks are what the
 * threads share out when there are few (KV head, query block) units, e.g. one decode token */
#define ATT_CHUNK 256

#ifndef ATT_PAR_WORK
#define ATT_PAR_WORK (1 << 20) /* multiply-adds (T*N*H*(D+Dv)) from which threads are used */
#endif

#ifdef _OPENMP
#include <omp.h>
#include <pthread.h>
/* libgomp cannot be used in a child made by fork() once the parent has run a parallel region
 * (the child hangs in its first one): there, attention stays on the calling thread (qmatmul.c
 * does the same for its kernels). */
static volatile int ops_fork_child = 0;
static void ops_on_fork_child(void) { ops_fork_child = 1; }
__attribute__((constructor)) static void ops_register_atfork(void) { pthread_atfork(NULL, NULL, ops_on_fork_child); }
#endif

/* What one attention call reads and writes (see lp_attend). */
typedef struct {
    const float *q;
    const void *k, *v;
    const float *mask;
    float *out;
    int64_t T, H, D, N, Hkv, Dv, g, k_sn, k_sh, v_sn, v_sh, mask_st;
    float scale;
    int kt, vt;
    int q_ready;  /* q already rounded for K's type (attend does it once per call) */
    int64_t span; /* score row length of the scratch: the widest chunk's cells (att_chunk_span) */
} att_args;

/* Each token's chunks: chunk j of token t holds its visible cells in [bnd[t*nb + j], bnd[t*nb +
 * j + 1]) (the first cell of its visible cell number j*ATT_CHUNK; the last bound: after its last
 * visible cell), for j < nch[t]; nch[t] = 0: nothing visible. */
typedef struct {
    const int64_t *bnd, *nch;
    int64_t nb; /* bounds per token: the most chunks N cells can make, plus one */
} att_chunks;

/* A partial (or running) result of R rows, in floats: max m (R), weight sum l (R), nan seen (R),
 * then the V sums (R x Dv). */
LP_INLINE size_t att_part_floats(int64_t R, int64_t Dv) { return (size_t)(R * (Dv + 3)); }

/* One worker's scratch, in floats: the unit's Q rows (R x D), the scores of the cells of one
 * chunk pass (R x span: the widest chunk's cells from a whole ATT_BLOCK, plus one block), one K
 * group of 8 rows and one V group widened to f32, then two partial results (a chunk's and the
 * running fold). */
LP_INLINE size_t att_core_floats(int64_t R, int64_t D, int64_t Dv, int64_t span) {
    return (size_t)(R * (D + span) + 8 * D + ATT_VGROUP * Dv);
}
LP_INLINE size_t att_scratch_floats(int64_t R, int64_t D, int64_t Dv, int64_t span) {
    return att_core_floats(R, D, Dv, span) + 2 * att_part_floats(R, Dv);
}

/* the dot product of dot8's lanes, for one K row: the same operations in the same order, so a
 * cell's score does not depend on whether it falls in a group of 8 (on N, on the batch) */
LP_INLINE float dot1(const float *restrict q, const float *restrict k, int64_t D) {
    v8f a = v8_splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) a = v8_fma(v8_load(q + i), v8_load(k + i), a);
    float r = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (; i < D; i++) r = lp_fmaf(q[i], k[i], r);
    return r;
}

/* Cells ahead whose K (score pass) or V (V pass) rows are prefetched: a decode step reads the
 * whole cache once, from memory. */
#define ATT_PREFETCH 32

/* the cache rows of cells [c0, c0 + n) (< end) of KV heads [kh0, kh0 + nh) prefetched (type t,
 * strides in its storage units) */
LP_INLINE void att_prefetch(const void *base, int t, int64_t c0, int64_t n, int64_t end, int64_t sn, int64_t sh,
                            int64_t kh0, int64_t nh, int64_t row_bytes) {
    const int64_t esz = t == LP_KV_F32 ? 4 : t == LP_KV_F16 ? 2 : 1;
    if (sh * esz == row_bytes) { /* the heads side by side (a cache row): one span per cell */
        row_bytes *= nh, nh = 1;
    }
    for (int64_t c = c0; c < c0 + n && c < end; c++)
        for (int64_t h = kh0; h < kh0 + nh; h++) {
            const char *p = (const char *)base + (c * sn + h * sh) * esz;
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o);
        }
}

LP_INLINE int64_t att_row_bytes(int t, int64_t n) {
    return t == LP_KV_F32 ? 4 * n : t == LP_KV_F16 ? 2 * n : t == LP_KV_Q8_0 ? n / 32 * 34 : n / 32 * 18;
}

/* A work unit: the query tokens [t0, t1) and the KV heads [kh0, kh0 + nh): R = nh * Rh rows,
 * Rh = (t1-t0)*g per head (row r: KV head kh0 + r/Rh, token t0 + (r%Rh)/g, query head
 * (kh0 + r/Rh)*g + (r%Rh)%g). One head per unit for a prompt (many units); every head for a few
 * tokens, so that a cell's K and V rows are read whole, in memory order. */
typedef struct {
    int64_t kh0, nh, t0, t1, n_chunks; /* n_chunks: the most chunks any of its tokens has */
} att_unit;

/* Chunk j of a work unit: each row over its token's chunk j (att_chunks); the unit reads the
 * cells [lo, hi) that any of those chunks holds. Writes the chunk's partial result to `part`
 * (att_part_floats(R, Dv)): three passes over the chunk, so that it depends only on the row's
 * visible cells of the chunk, in cell order: (1) every score, each row's max over its chunk;
 * (2) weights exp(s - max) (masked cells and cells of other chunks: exactly 0) and their sum over
 * the cells of non-zero weight in order; (3) V sums over the same cells in cell order. K rows are
 * read (widened) once per group of 8 cells for all rows of their head, V rows once per group of
 * cells. What a row computes does not depend on the other rows of its unit. */
static void attend_chunk(const att_args *a, const att_chunks *ch, const att_unit *w, int64_t j, float *restrict buf,
                         float *restrict part) {
    const int64_t g = a->g, t0 = w->t0, t1 = w->t1, kh0 = w->kh0, nh = w->nh, Rh = (t1 - t0) * g, R = nh * Rh;
    const int64_t D = a->D, Dv = a->Dv, H = a->H, N = a->N, span = a->span;
    const int kt = a->kt, vt = a->vt;
    float *restrict m = part, *restrict l = m + R, *restrict nan_seen = l + R, *restrict acc = nan_seen + R;
    for (int64_t r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f, nan_seen[r] = 0.0f;
    memset(acc, 0, (size_t)(R * Dv) * sizeof(float));
    int64_t lo = N, hi = 0; /* the cells of chunk j of any of the unit's tokens */
    for (int64_t t = t0; t < t1; t++)
        if (j < ch->nch[t]) {
            const int64_t *b = ch->bnd + t * ch->nb + j;
            lo = b[0] < lo ? b[0] : lo;
            hi = b[1] > hi ? b[1] : hi;
        }
    if (lo >= hi) return; /* no token of the unit has a chunk j */
    float *restrict qs = buf, *restrict sc = qs + R * D, *restrict kf = sc + R * span, *restrict vf = kf + 8 * D;
    /* q rows (f16-rounded for an f16 K, as llama.cpp's q_to_vec_dot; Q8_0-rounded for a
     * quantized one) */
    for (int64_t r = 0; r < R; r++) {
        const int64_t rr = r % Rh;
        const float *qr = a->q + ((t0 + rr / g) * H + (kh0 + r / Rh) * g + rr % g) * D;
        float *dst = qs + r * D;
        if (a->q_ready || !kt)
            memcpy(dst, qr, (size_t)D * sizeof(float));
        else if (kt == LP_KV_F16)
            for (int64_t i = 0; i < D; i++) dst[i] = round_f16(qr[i]);
        else if (kt)
            round_q8_0_row(dst, qr, D);
        else
            memcpy(dst, qr, (size_t)D * sizeof(float));
    }
    const float *mask = a->mask + t0 * a->mask_st;
    const int64_t mask_st = a->mask_st, Tu = t1 - t0;
    const float minf = -INFINITY, scale = a->scale;
    const int64_t base = lo / ATT_BLOCK * ATT_BLOCK, end = hi < N ? hi : N; /* cells [base, end) */
    const int64_t k_rb = att_row_bytes(kt, D), v_rb = att_row_bytes(vt, Dv);
    unsigned char live[ATT_BLOCK];
    att_prefetch(a->k, kt, lo, ATT_PREFETCH, end, a->k_sn, a->k_sh, kh0, nh, k_rb);
    /* (1) scores: groups of 8 cells, each K row read once for the rows of its head */
    for (int64_t b0 = base; b0 < end; b0 += ATT_BLOCK) {
        const int64_t nb = end - b0 < ATT_BLOCK ? end - b0 : ATT_BLOCK;
        for (int64_t c = 0; c < nb; c++) {
            int lv = 0;
            for (int64_t t = 0; t < Tu; t++) lv |= mask[t * mask_st + b0 + c] != minf;
            live[c] = (unsigned char)(lv && b0 + c >= lo);
        }
        int64_t c = 0;
        for (; c + 8 <= nb; c += 8) {
            att_prefetch(a->k, kt, b0 + c + ATT_PREFETCH, 8, end, a->k_sn, a->k_sh, kh0, nh, k_rb);
            int lv8 = 0;
            for (int u = 0; u < 8; u++) lv8 |= live[c + u];
            if (!lv8) {
                for (int64_t r = 0; r < R; r++)
                    for (int u = 0; u < 8; u++) sc[r * span + b0 - base + c + u] = minf;
                continue;
            }
            for (int64_t hh = 0; hh < nh; hh++) {
                const int64_t kh = kh0 + hh;
                const float *k0;
                int64_t ks;
                if (kt) {
                    for (int u = 0; u < 8; u++) kv_row(kf + u * D, a->k, (b0 + c + u) * a->k_sn + kh * a->k_sh, kt, D);
                    k0 = kf, ks = D;
                } else {
                    k0 = (const float *)a->k + kh * a->k_sh + (b0 + c) * a->k_sn, ks = a->k_sn;
                }
                for (int64_t rr = 0; rr < Rh; rr++) {
                    const int64_t r = hh * Rh + rr;
                    const v8f d = dot8(qs + r * D, k0, ks, D);
                    const v8f mv = v8_load(mask + (rr / g) * mask_st + b0 + c);
                    v8_store(sc + r * span + b0 - base + c,
                             v8_select(mv == v8_splat(minf), mv, d * v8_splat(scale) + mv));
                }
            }
        }
        for (; c < nb; c++) {
            if (!live[c]) {
                for (int64_t r = 0; r < R; r++) sc[r * span + b0 - base + c] = minf;
                continue;
            }
            for (int64_t hh = 0; hh < nh; hh++) {
                const int64_t kh = kh0 + hh;
                const float *kr;
                if (kt) {
                    kv_row(kf, a->k, (b0 + c) * a->k_sn + kh * a->k_sh, kt, D);
                    kr = kf;
                } else {
                    kr = (const float *)a->k + kh * a->k_sh + (b0 + c) * a->k_sn;
                }
                for (int64_t rr = 0; rr < Rh; rr++) {
                    const int64_t r = hh * Rh + rr;
                    const float mv = mask[(rr / g) * mask_st + b0 + c];
                    sc[r * span + b0 - base + c] = mv == minf ? minf : dot1(qs + r * D, kr, D) * scale + mv;
                }
            }
        }
    }
    /* (2) each row's cells outside its chunk j dropped (-inf), its max (nan skipped: it reaches
     * the output through nan_seen), then its weights and their sum, cell after cell (a masked
     * cell adds exactly 0) */
    const int64_t n_c = end > base ? end - base : 0;
    int any_w = 0;
    for (int64_t r = 0; r < R; r++) {
        float *s = sc + r * span;
        const int64_t t = t0 + (r % Rh) / g;
        int64_t w0 = n_c, w1 = n_c; /* the row's chunk, relative to base */
        if (j < ch->nch[t]) {
            const int64_t *b = ch->bnd + t * ch->nb + j;
            w0 = b[0] - base, w1 = b[1] - base < n_c ? b[1] - base : n_c;
        }
        for (int64_t i = 0; i < w0; i++) s[i] = minf;
        for (int64_t i = w1; i < n_c; i++) s[i] = minf;
        v8f bm8 = v8_splat(minf); /* the max is exact in any order: 8 lanes */
        v8i nan8 = {0};
        int64_t i = 0;
        for (; i + 8 <= n_c; i += 8) {
            const v8f x = v8_load(s + i);
            bm8 = v8_select(x > bm8, x, bm8);
            nan8 |= x != x;
        }
        float mx = minf;
        for (int u = 0; u < 8; u++) {
            mx = bm8[u] > mx ? bm8[u] : mx;
            if (nan8[u]) nan_seen[r] = 1.0f;
        }
        for (; i < n_c; i++) {
            if (s[i] != s[i]) nan_seen[r] = 1.0f;
            else if (s[i] > mx) mx = s[i];
        }
        m[r] = mx;
        if (mx == minf) { /* nothing visible (or nan scores only): weights 0 */
            memset(s, 0, (size_t)n_c * sizeof(float));
            continue;
        }
        any_w = 1;
        for (i = 0; i < n_c; i++) s[i] = lp_expf(s[i] - mx); /* -inf cells: 0 */
        /* the sum in 8 lanes by the index among the cells of non-zero weight (not by cell
         * index, which depends on the placement) */
        float ls[8] = {0};
        int64_t k = 0;
        for (i = 0; i < n_c; i++)
            if (s[i] != 0.0f) ls[k++ & 7] += s[i];
        l[r] = ((ls[0] + ls[4]) + (ls[1] + ls[5])) + ((ls[2] + ls[6]) + (ls[3] + ls[7]));
    }
    /* (3) V sums in groups of cells (an f16/quantized group widened once for the rows of its
     * head); cells of weight 0 are skipped, so a row's sum runs over its chunk's visible cells in
     * cell order */
    if (any_w) att_prefetch(a->v, vt, lo, ATT_PREFETCH, end, a->v_sn, a->v_sh, kh0, nh, v_rb);
    for (int64_t c0 = 0; any_w && c0 < n_c; c0 += ATT_VGROUP) {
        const int64_t ng = n_c - c0 < ATT_VGROUP ? n_c - c0 : ATT_VGROUP;
        att_prefetch(a->v, vt, base + c0 + ATT_PREFETCH, ATT_VGROUP, end, a->v_sn, a->v_sh, kh0, nh, v_rb);
        int lv = 0;
        if (ng == 2 * 8 && ATT_VGROUP == 16) { /* cells of any non-zero weight: 8 lanes at a time */
            v8i l0 = {0}, l1 = {0};
            const v8f zero = v8_splat(0.0f);
            for (int64_t r = 0; r < R; r++) {
                l0 |= v8_load(sc + r * span + c0) != zero;
                l1 |= v8_load(sc + r * span + c0 + 8) != zero;
            }
            for (int u = 0; u < 8; u++) {
                live[u] = (unsigned char)(l0[u] != 0), live[8 + u] = (unsigned char)(l1[u] != 0);
                lv |= live[u] | live[8 + u];
            }
        } else {
            for (int64_t i = 0; i < ng; i++) {
                int li = 0;
                for (int64_t r = 0; r < R; r++) li |= sc[r * span + c0 + i] != 0.0f;
                live[i] = (unsigned char)li;
                lv |= li;
            }
        }
        if (!lv) continue;
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t kh = kh0 + hh;
            const float *v0;
            int64_t vs;
            if (vt) {
                for (int64_t i = 0; i < ng; i++)
                    if (live[i]) kv_row(vf + i * Dv, a->v, (base + c0 + i) * a->v_sn + kh * a->v_sh, vt, Dv);
                v0 = vf, vs = Dv;
            } else {
                v0 = (const float *)a->v + kh * a->v_sh + (base + c0) * a->v_sn, vs = a->v_sn;
            }
            for (int64_t rr = 0; rr < Rh; rr++) {
                const int64_t r = hh * Rh + rr;
                v_accumulate(acc + r * Dv, sc + r * span + c0, ng, v0, vs, Dv);
            }
        }
    }
}

/* A running result of R rows (att_part_floats, first set by att_part_clear) and the next chunk's
 * partial folded into it, row by row: both rescaled to the larger max (ggml's online softmax
 * step, done once per chunk). Always applied to a row's chunks one after the other in order,
 * whichever thread made each partial, so a row's result does not depend on the split. */
LP_INLINE void att_part_clear(float *st, int64_t R, int64_t Dv) {
    for (int64_t r = 0; r < R; r++) st[r] = -INFINITY, st[R + r] = 0.0f, st[2 * R + r] = 0.0f;
    memset(st + 3 * R, 0, (size_t)(R * Dv) * sizeof(float));
}

static void att_fold(float *restrict st, const float *restrict pt, int64_t R, int64_t Dv) {
    float *m = st, *l = st + R, *n = st + 2 * R, *acc = st + 3 * R;
    const float *pm = pt, *pl = pt + R, *pn = pt + 2 * R, *pacc = pt + 3 * R;
    for (int64_t r = 0; r < R; r++) {
        if (pn[r] != 0.0f) n[r] = 1.0f;
        if (pm[r] == -INFINITY) continue; /* nothing in this chunk for the row */
        float *restrict ar = acc + r * Dv;
        const float *restrict pa = pacc + r * Dv;
        if (m[r] == -INFINITY) { /* the row's first chunk: taken as it is */
            m[r] = pm[r], l[r] = pl[r];
            memcpy(ar, pa, (size_t)Dv * sizeof(float));
            continue;
        }
        const float mx = pm[r] > m[r] ? pm[r] : m[r];
        const float fa = m[r] == mx ? 1.0f : lp_expf(m[r] - mx), fb = pm[r] == mx ? 1.0f : lp_expf(pm[r] - mx);
        l[r] = l[r] * fa + pl[r] * fb;
        for (int64_t i = 0; i < Dv; i++) ar[i] = ar[i] * fa + pa[i] * fb;
        m[r] = mx;
    }
}

/* The widest cell range a unit's chunk pass scores (from its first cell's ATT_BLOCK), plus one
 * block: the scratch's score rows, so they span a chunk (~ATT_CHUNK cells when a sequence's cells
 * are contiguous), not N */
static int64_t att_chunk_span(const att_chunks *ch, int64_t T, int64_t tb) {
    int64_t span = 0;
    for (int64_t t0 = 0; t0 < T; t0 += tb) {
        const int64_t t1 = t0 + tb < T ? t0 + tb : T;
        int64_t nc = 0;
        for (int64_t t = t0; t < t1; t++) nc = ch->nch[t] > nc ? ch->nch[t] : nc;
        for (int64_t j = 0; j < nc; j++) {
            int64_t lo = INT64_MAX, hi = 0;
            for (int64_t t = t0; t < t1; t++)
                if (j < ch->nch[t]) {
                    const int64_t *b = ch->bnd + t * ch->nb + j;
                    lo = b[0] < lo ? b[0] : lo;
                    hi = b[1] > hi ? b[1] : hi;
                }
            const int64_t w = hi > lo ? hi - lo / ATT_BLOCK * ATT_BLOCK : 0;
            span = w > span ? w : span;
        }
    }
    return (span + ATT_BLOCK - 1) / ATT_BLOCK * ATT_BLOCK + ATT_BLOCK;
}

/* Unit u of `hpu` heads per unit: the last query blocks first (most cells), heads innermost */
LP_INLINE att_unit att_unit_at(const att_args *a, const att_chunks *ch, int64_t tb, int64_t n_tb, int64_t hpu,
                               int64_t u) {
    att_unit w;
    const int64_t nhu = a->Hkv / hpu, b = n_tb - 1 - u / nhu;
    w.kh0 = u % nhu * hpu, w.nh = hpu;
    w.t0 = b * tb, w.t1 = w.t0 + tb < a->T ? w.t0 + tb : a->T, w.n_chunks = 0;
    for (int64_t t = w.t0; t < w.t1; t++) w.n_chunks = ch->nch[t] > w.n_chunks ? ch->nch[t] : w.n_chunks;
    return w;
}

/* The unit's running result normalized into out: acc / l; a nan score: nan, as numpy; nothing
 * visible: zeros */
static void att_store(const att_args *a, const att_unit *w, const float *st) {
    const int64_t g = a->g, Rh = (w->t1 - w->t0) * g, R = w->nh * Rh, Dv = a->Dv, H = a->H;
    const float *m = st, *l = st + R, *n = st + 2 * R, *acc = st + 3 * R;
    for (int64_t r = 0; r < R; r++) {
        const int64_t rr = r % Rh;
        float *o = a->out + ((w->t0 + rr / g) * H + (w->kh0 + r / Rh) * g + rr % g) * Dv;
        if (n[r] != 0.0f || m[r] == -INFINITY) {
            const float fill = n[r] != 0.0f ? NAN : 0.0f;
            for (int64_t i = 0; i < Dv; i++) o[i] = fill;
            continue;
        }
        const float inv = 1.0f / l[r];
        const float *ar = acc + r * Dv;
        for (int64_t i = 0; i < Dv; i++) o[i] = ar[i] * inv;
    }
}

/* A whole unit on one thread: its chunks in order, each folded in as it is made */
static void attend_unit(const att_args *a, const att_chunks *ch, const att_unit *w, int64_t R_max, float *buf) {
    const int64_t R = w->nh * (w->t1 - w->t0) * a->g;
    float *st = buf + att_core_floats(R_max, a->D, a->Dv, a->span), *pt = st + att_part_floats(R, a->Dv);
    att_part_clear(st, R, a->Dv);
    for (int64_t j = 0; j < w->n_chunks; j++) {
        attend_chunk(a, ch, w, j, buf, pt);
        att_fold(st, pt, R, a->Dv);
    }
    att_store(a, w, st);
}

/* Attention of T query tokens over N cells (ggml's flash_attn_ext): work units of (KV heads, a
 * block of query tokens), each row's cells cut into chunks of ATT_CHUNK visible cells. A prompt
 * (many query blocks) has one KV head per unit, a few tokens every head in one unit. Up to
 * n_threads OpenMP threads once the work reaches ATT_PAR_WORK: with many units each thread takes
 * whole units (dynamically, most cells first); with few (decode) the (unit, chunk) pairs are
 * shared out, their partial results kept, then folded in chunk order per unit (llama.cpp splits
 * one query's cells among its threads too). The folds are the same either way, so the output
 * does not depend on the thread count. Each unit reads only the cells its tokens see (the causal
 * lower triangle, one sequence's cells). No state outside the call: the thread count is an
 * argument. */
static void attend(const att_args *a, int n_threads) {
    const int64_t T = a->T, N = a->N, Dv = a->Dv;
    if (T <= 0 || a->H <= 0 || a->Hkv <= 0 || Dv <= 0) return;
    /* each token's chunks: its visible cells, counted in cell order */
    const int64_t nbd = (N + ATT_CHUNK - 1) / ATT_CHUNK + 1;
    int64_t *bnd = malloc((size_t)(T * (nbd + 1)) * sizeof(int64_t));
    if (!bnd) return;
    int64_t *nch = bnd + T * nbd;
    for (int64_t t = 0; t < T; t++) {
        const float *mr = a->mask + t * a->mask_st;
        int64_t *bt = bnd + t * nbd, seen = 0, last = 0;
        for (int64_t c = 0; c < N; c++)
            if (mr[c] != -INFINITY) {
                if (seen % ATT_CHUNK == 0) bt[seen / ATT_CHUNK] = c;
                seen++, last = c + 1;
            }
        nch[t] = (seen + ATT_CHUNK - 1) / ATT_CHUNK;
        bt[nch[t]] = last;
    }
    const att_chunks ch = {bnd, nch, nbd};
    /* Q rounded for K's type once (not once per chunk): f16, or through Q8_0 (q_to_vec_dot) */
    float *qround = a->kt ? malloc((size_t)(T * a->H * a->D) * sizeof(float)) : NULL;
    att_args a_r = *a; /* (with Q rounded, the score span) */
    if (qround) {
        for (int64_t i = 0; i < T * a->H; i++) {
            const float *qr = a->q + i * a->D;
            float *dst = qround + i * a->D;
            if (a->kt == LP_KV_F16)
                for (int64_t e = 0; e < a->D; e++) dst[e] = round_f16(qr[e]);
            else
                round_q8_0_row(dst, qr, a->D);
        }
        a_r.q = qround, a_r.q_ready = 1;
    }
    a = &a_r;
    const int64_t g = a->g, tb = g >= ATT_ROWS ? 1 : (ATT_ROWS + g - 1) / g; /* tokens per unit */
    const int64_t n_tb = (T + tb - 1) / tb;
    int nt = 1;
#ifdef _OPENMP
    if (n_threads > 1 && !ops_fork_child && !omp_in_parallel() && T * N * a->H * (a->D + Dv) >= ATT_PAR_WORK)
        nt = n_threads;
#else
    (void)n_threads;
#endif
    const int few = n_tb < 4 * (int64_t)nt; /* few query blocks: every head in each unit */
    const int64_t hpu = few ? a->Hkv : 1, units = a->Hkv / hpu * n_tb;
    const int64_t R = (tb < T ? tb : T) * g * hpu;
    a_r.span = att_chunk_span(&ch, T, tb);
    const size_t scratch = att_scratch_floats(R, a->D, Dv, a->span);
    /* few units: the (unit, chunk) pairs shared out, their partials kept, then folded per unit */
    int64_t *first = NULL, *item_u = NULL, items = 0;
    att_unit *us = NULL;
    float *parts = NULL;
    const size_t pf = att_part_floats(R, Dv);
    if (nt > 1 && units < 4 * (int64_t)nt) {
        first = malloc((size_t)units * sizeof(int64_t));
        us = malloc((size_t)units * sizeof(att_unit));
        for (int64_t u = 0; first && us && u < units; u++) {
            us[u] = att_unit_at(a, &ch, tb, n_tb, hpu, u);
            first[u] = items, items += us[u].n_chunks;
        }
        if (first && us && items > 1) {
            parts = malloc((size_t)items * pf * sizeof(float));
            item_u = malloc((size_t)items * sizeof(int64_t));
        }
        if (parts && item_u)
            for (int64_t u = 0; u < units; u++)
                for (int64_t j = 0; j < us[u].n_chunks; j++) item_u[first[u] + j] = u;
    }
    if (parts && item_u) {
        const int nth = items < nt ? (int)items : nt;
#pragma omp parallel num_threads(nth)
        {
            float *buf = malloc(scratch * sizeof(float)); /* NULL: nothing written */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; i++) {
                const att_unit *w = &us[item_u[i]];
                if (buf) attend_chunk(a, &ch, w, i - first[item_u[i]], buf, parts + i * pf);
            }
            /* (the implicit barrier: every partial is made) */
#pragma omp for schedule(static, 1)
            for (int64_t u = 0; u < units; u++) {
                const att_unit *w = &us[u];
                const int64_t Ru = w->nh * (w->t1 - w->t0) * g;
                float *st = buf ? buf + att_core_floats(R, a->D, Dv, a->span) : NULL;
                if (!st) continue;
                att_part_clear(st, Ru, Dv);
                for (int64_t j = 0; j < w->n_chunks; j++) att_fold(st, parts + (first[u] + j) * pf, Ru, Dv);
                att_store(a, w, st);
            }
            free(buf);
        }
    } else if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            float *buf = malloc(scratch * sizeof(float)); /* NULL: nothing written */
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < units; u++) {
                const att_unit w = att_unit_at(a, &ch, tb, n_tb, hpu, u);
                if (buf) attend_unit(a, &ch, &w, R, buf);
            }
            free(buf);
        }
    } else { /* no OpenMP region at all (a fork child cannot run one) */
        float *buf = malloc(scratch * sizeof(float));
        for (int64_t u = 0; buf && u < units; u++) {
            const att_unit w = att_unit_at(a, &ch, tb, n_tb, hpu, u);
            attend_unit(a, &ch, &w, R, buf);
        }
        free(buf);
    }
    free(item_u), free(parts), free(first), free(us);
    free(qround);
    free(bnd);
}

#define ATT_ARGS(kt_, vt_)                                                                                       \
    {q, k, v, mask, out, T, H, D, N, Hkv, Dv, Hkv > 0 ? H / Hkv : 1, k_sn, k_sh, v_sn, v_sh, mask_st, scale, kt_, \
     vt_}

/* softmax(q k^T * scale + mask) v: q (T, H, D) contiguous; k (N, Hkv, D) and v (N, Hkv, Dv) with
 * strides in elements (rows contiguous); query head h reads KV head h / (H / Hkv); mask row t at
 * mask + t * mask_st (-inf: not visible); out (T, H, Dv). A row that sees no cell gets zeros (nan
 * where a score is nan). n_threads: at most this many threads (the caller's -t). */
LP_API void lp_attend(const float *q, int64_t T, int64_t H, int64_t D, const float *k, const float *v, int64_t N,
                      int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh,
                      const float *mask, int64_t mask_st, float scale, float *out, int n_threads) {
    const att_args a = ATT_ARGS(LP_KV_F32, LP_KV_F32);
    attend(&a, n_threads);
}

/* The same over an f16 cache (k, v: IEEE half bits; strides in elements). Q is rounded to f16
 * first, as llama.cpp and the reference kernel do; scores and V sums in f32. */
LP_API void lp_attend_f16(const float *q, int64_t T, int64_t H, int64_t D, const uint16_t *k, const uint16_t *v,
                          int64_t N, int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh,
                          const float *mask, int64_t mask_st, float scale, float *out, int n_threads) {
    const att_args a = ATT_ARGS(LP_KV_F16, LP_KV_F16);
    attend(&a, n_threads);
}

/* The same with K and V each of any cache type (LP_KV_*), read in place: f32/f16 strides in
 * elements, Q8_0/Q4_0 strides in bytes (a head's D elements: whole blocks of 32). Over a
 * quantized K, Q is first rounded through Q8_0 as llama.cpp's q_to_vec_dot does, so each score is
 * ggml's integer dot product (up to the order of the float sums); V rows are expanded to f32 and
 * summed, as ggml's v_to_float path. */
LP_API void lp_attend_q(const float *q, int64_t T, int64_t H, int64_t D, const void *k, const void *v, int64_t N,
                        int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh,
                        const float *mask, int64_t mask_st, float scale, float *out, int kt, int vt, int n_threads) {
    if (kt < LP_KV_F32 || kt > LP_KV_Q4_0 || vt < LP_KV_F32 || vt > LP_KV_Q4_0) return;
    if ((kt >= LP_KV_Q8_0 && D % 32) || (vt >= LP_KV_Q8_0 && Dv % 32)) return;
    const att_args a = ATT_ARGS(kt, vt);
    attend(&a, n_threads);
}

/* ---------------------------------------------------------------------------------------- */
/* swiglu                                                                                    */

/* e^x as ggml's SiLU computes it on an AVX-512 F+DQ build (vec.h ggml_v_expf, the __m512 variant):
 * the same reduction and polynomial as lp_expf but exp(b) itself, then scaled by 2^n (scalef),
 * which rounds differently from lp_expf's (exp(b) - 1) * 2^n + 2^n (ggml's AVX2 variant). */
LP_INLINE float lp_expf_avx512(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    if (!(fabsf(n) <= 192.0f)) return n != n ? n : (n > 0.0f ? INFINITY : 0.0f); /* nan; out of range */
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         fmaf(0x1.ffffecp-1f, b, 1.0f));
    /* j * 2^n in two exact-or-once-rounded steps (|n| <= 192: each half a normal power of two),
     * as scalef rounds: multiplies that vectorize, where ldexpf is a call per value */
    const int ni = (int)n, n1 = ni / 2, n2 = ni - n1;
    return j * bits_f32((uint32_t)(n1 + 127) << 23) * bits_f32((uint32_t)(n2 + 127) << 23);
}

/* SiLU(gate) * up rounded as ggml's ggml_vec_swiglu_f32 on the llama.cpp build for this CPU
 * (-march=native), bit for bit: x / (1 + e^-x) * g, e^-x by its SIMD exp over whole vectors (16
 * floats with AVX-512 F+DQ, 8 with AVX2) and by libm's expf on the tail (n % width). */
LP_API void lp_swiglu(const float *gate, const float *up, int64_t rows, int64_t n, int64_t gate_st, int64_t up_st,
                      float *out) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    const int64_t nv = n / 16 * 16;
#else
    const int64_t nv = n / 8 * 8;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *gr = gate + r * gate_st, *ur = up + r * up_st;
        float *o = out + r * n;
        for (int64_t i = 0; i < nv; i++) {
            const float g = gr[i];
#if defined(__AVX512F__) && defined(__AVX512DQ__)
            const float e = lp_expf_avx512(0.0f - g);
#else
            /* below -88 libm's expf (its overflow to inf gives -0, as ggml's special case does) */
            const float e = g > -88.0f ? lp_expf(-g) : expf(-g);
#endif
            o[i] = g / (1.0f + e) * ur[i];
        }
        for (int64_t i = nv; i < n; i++) o[i] = gr[i] / (1.0f + expf(-gr[i])) * ur[i];
    }
}
