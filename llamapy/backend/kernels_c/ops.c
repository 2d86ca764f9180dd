/* The small per-token ops of the CPU backend: rms_norm, rope, attention, swiglu.
 *
 * ggml counterparts (ggml-cpu): ops.cpp ggml_compute_forward_rms_norm (sum of squares in
 * ggml_float = double), ggml_compute_forward_rope (rope_yarn with ext_factor 0: plain
 * cos/sin of pos * theta_scale^i, neox and normal pairings), ggml_compute_forward_flash_attn_ext
 * (the arithmetic of its tiled path, flash_attn_ext_tiled, bit for bit over an f32/f16 cache, for
 * every number of query rows: Q in f32, fma-chain scores, an online softmax stepped per tile of
 * 64 cells with ggml's SIMD exp and sums; the tiles are 64 of a row's visible cells, so that a
 * row's result depends only on its own visible cells in order: see tile_softmax; llama.cpp itself
 * uses another arithmetic below 64 rows, and splits a decode query's cells among threads), and
 * vec.h ggml_vec_swiglu_f32 / ggml_v_expf.
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

/* round to f16 and back (round to nearest even; overflow to inf); f16_bits: the f16's bits */
#if defined(__FLT16_MAX__) && !defined(LP_NO_FLOAT16)
LP_INLINE float round_f16(float x) { return (float)(_Float16)x; }
LP_INLINE uint16_t f16_bits(float x) {
    const _Float16 h = (_Float16)x;
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}
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
LP_INLINE uint16_t f16_bits(float x) { return f32_to_f16(x); }
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

/* kv_row for the executor's GET_ROWS of a table in one of those types (token embeddings in F16,
 * Q8_0 or Q4_0 as the file has them) */
void lp_kv_row(float *dst, const void *base, int64_t off, int type, int64_t n) { kv_row(dst, base, off, type, n); }

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
 * freq_scale, each pair's rope_freqs divisor, then YaRN's ext_factor, attn_factor and correction
 * dims (kernels.rope_consts). Rounded as ggml's
 * rope_cache_init + rotate_pairs, bit for bit: theta_scale = powf(base, -2/n_dims), the angle by
 * the f32 recurrence theta *= theta_scale (not p * theta_scale^i), cosf/sinf, and the rotation
 * with one fma each as llama.cpp's -march=native build contracts it. Shared by lp_rope and
 * executor.c (one library: not exported). */
void lp_rope_rows(const float *x, int64_t T, int64_t H, int64_t D, int64_t xs_t, int64_t xs_h, const int32_t *pos,
                  const float *rc, int64_t n_dims, int neox, float *out) {
    const int64_t half = n_dims / 2;
    const float freq_scale = rc[1], *ff = rc + 2;
    const float theta_scale = powf(rc[0], -2.0f / (float)n_dims);
    /* YaRN (ggml's rope_yarn): after the divisors, ext_factor, attn_factor and the correction
     * dims; ext_factor 0 and attn_factor 1 are plain rope, the same bits */
    const float ext = rc[2 + half], c0 = rc[4 + half], c1 = rc[5 + half];
    /* the fmas of llama.cpp's build, which contracts a * b + c (-march=native, GCC's default) */
    const float mscale = ext != 0.0f ? rc[3 + half] * fmaf(0.1f, logf(1.0f / freq_scale), 1.0f) : rc[3 + half];
    float cs_stack[2 * 256];
    float *cs = half <= 256 ? cs_stack : malloc(2 * (size_t)half * sizeof(float));
    if (!cs) return;
    float *sn = cs + half;
    for (int64_t t = 0; t < T; t++) {
        float theta = (float)pos[t];
        for (int64_t i = 0; i < half; i++) {
            const float te = theta / ff[i];
            float th = freq_scale * te;
            if (ext != 0.0f) { /* the pairs below the ramp keep the trained angle */
                const float y = ((float)i - c0) / fmaxf(0.001f, c1 - c0);
                const float mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext;
                th = fmaf(th, 1.0f - mix, te * mix);
            }
            cs[i] = cosf(th) * mscale;
            sn[i] = sinf(th) * mscale;
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

#define ATT_GROUP 16  /* KV cells per step of the score pass: two transposed blocks of 8 */
#define ATT_VGROUP 16 /* KV cells per step of the V sums */
#define ATT_ROWS 32   /* query rows (tokens x the heads of a KV group) per work unit, at least */
/* Visible cells per tile: a row's visible (unmasked) cells are cut, in cell order, into tiles of
 * this many, and the online softmax steps once per tile, as llama.cpp's flash_attn_ext_tiled
 * steps once per KV tile of GGML_FA_TILE_KV = 64 cells. llama.cpp's tiles are 64 cell indices
 * (fully masked cells inside one add exactly 0); these are 64 visible cells, so the cuts depend
 * only on the row's own visible cells: the same tiles wherever a sequence's cells start on a
 * multiple of 64 and are contiguous (llama-perplexity's layout), and placement-invariant
 * everywhere. */
#define ATT_TILE 64

#define ATT_SCORES_MAX (64.0 * 1024 * 1024) /* bytes of scores the two-phase threaded decode keeps */

#ifndef ATT_PAR_WORK
#define ATT_PAR_WORK (1 << 20) /* multiply-adds (T*N*H*(D+Dv)) from which threads are used */
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
    int64_t span; /* score row length of the scratch: the widest tile's cells (att_tile_span) */
    const float *sinks; /* (H,) one logit per query head in its softmax's denominator, or NULL */
} att_args;

/* Each token's tiles: tile j of token t holds its visible cells in [bnd[t*nb + j], bnd[t*nb + j +
 * 1]) (the first cell of its visible cell number j*ATT_TILE; the last bound: after its last
 * visible cell), for j < nch[t]; nch[t] = 0: nothing visible. */
typedef struct {
    const int64_t *bnd, *nch, *nvis; /* nvis[t]: token t's visible cells */
    int64_t nb; /* bounds per token: the most tiles N cells can make, plus one */
} att_chunks;

/* e^x for the softmax weights (x = score - max: <= 0, -inf or nan), as ggml_vec_soft_max_f32
 * computes it with ggml_v_expf on the llama.cpp build for this CPU (vec.h), bit for bit: on an
 * AVX-512 F+DQ build the __m512 variant (exp(b) by the polynomial, then scalef by 2^n: here two
 * multiplies by halves of 2^n, exact then rounded once, as scalef; |n| > 192: 0 or inf), else the
 * __m256 one (exp(b) - 1, then fma(j, 2^n, 2^n), with its |n| > 126 and > 192 cases). Branch-free,
 * so the loops over it vectorize. */
LP_INLINE float att_expf(float x) {
    const float r = 0x1.8p23f;
    const float z = lp_fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = lp_fmaf(-n, 0x1.7f7d1cp-20f, lp_fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float an = fabsf(n);
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    const float j = lp_fmaf(lp_fmaf(lp_fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, lp_fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                            u, lp_fmaf(0x1.ffffecp-1f, b, 1.0f));
    const int ni = an <= 192.0f ? (int)n : 0, n1 = ni / 2, n2 = ni - n1; /* nan: j is nan */
    const float res = j * bits_f32((uint32_t)(n1 + 127) << 23) * bits_f32((uint32_t)(n2 + 127) << 23);
    return an > 192.0f ? (n > 0.0f ? INFINITY : 0.0f) : res;
#else
    const uint32_t e = f32_bits(z) << 23;
    const float k = bits_f32(e + 0x3f800000u);
    const float j = lp_fmaf(lp_fmaf(lp_fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, lp_fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                            u, 0x1.ffffecp-1f * b);
    const uint32_t gb = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = bits_f32(gb + 0x7f000000u), s2 = bits_f32(e - gb);
    const float big = lp_fmaf(s2, j, s2) * s1, norm = lp_fmaf(k, j, k);
    return an > 192.0f ? s1 * s1 : an > 126.0f ? big : norm;
#endif
}

/* The sum of one SIMD vector of weights as ggml_vec_soft_max_f32 takes it: AVX-512,
 * _mm512_reduce_add_ps (gcc: halves added, then (t0+t4)+(t2+t6) + (t1+t5)+(t3+t7)), 16 lanes;
 * AVX2, the same tree over 8. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define ATT_SUM_W 16
#else
#define ATT_SUM_W 8
#endif
LP_INLINE float att_vsum(const float *w) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = ATT_SUM_W == 16 ? w[8 + i] + w[i] : w[i];
    return ((t[4] + t[0]) + (t[6] + t[2])) + ((t[5] + t[1]) + (t[7] + t[3]));
}

/* A unit's running state, in floats: max M (R), sum S (R), nan seen (R), V sums (R x Dv) */
LP_INLINE size_t att_state_floats(int64_t R, int64_t Dv) { return (size_t)(R * (Dv + 3)); }

/* 8 rows of 8 floats (r[u][0..8)) transposed in registers: out[i] = (r[0][i], ..., r[7][i]) */
LP_INLINE void v8_transpose(v8f r[8]) {
    v8f t[8], s[8];
    for (int p = 0; p < 4; p++) {
        t[2 * p] = SHUF8(r[2 * p], r[2 * p + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[2 * p + 1] = SHUF8(r[2 * p], r[2 * p + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int p = 0; p < 2; p++) {
        s[4 * p + 0] = SHUF8(t[4 * p], t[4 * p + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        s[4 * p + 1] = SHUF8(t[4 * p], t[4 * p + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        s[4 * p + 2] = SHUF8(t[4 * p + 1], t[4 * p + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        s[4 * p + 3] = SHUF8(t[4 * p + 1], t[4 * p + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = SHUF8(s[i], s[4 + i], 0, 1, 2, 3, 8, 9, 10, 11);
        r[4 + i] = SHUF8(s[i], s[4 + i], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* Columns d0..d0+7 of 8 K rows (rows[u]: f16 bits where f16, else f32), transposed:
 * r[e] = (row 0 [d0+e], ..., row 7 [d0+e]), a lane per cell. f16 rows are transposed as 16-bit
 * values and widened after (F16C), so no widened copy of the rows is made. */
LP_INLINE void kblock8(const void *const rows[8], const int f16, int64_t d0, v8f r[8]) {
#if defined(__F16C__) && defined(__AVX2__)
    if (f16) {
        __m128i x[8], y[8];
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) x[u] = _mm_loadu_si128((const __m128i *)((const uint16_t *)rows[u] + d0));
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            y[2 * p] = _mm_unpacklo_epi16(x[2 * p], x[2 * p + 1]);
            y[2 * p + 1] = _mm_unpackhi_epi16(x[2 * p], x[2 * p + 1]);
        }
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            x[4 * p + 0] = _mm_unpacklo_epi32(y[4 * p], y[4 * p + 2]);
            x[4 * p + 1] = _mm_unpackhi_epi32(y[4 * p], y[4 * p + 2]);
            x[4 * p + 2] = _mm_unpacklo_epi32(y[4 * p + 1], y[4 * p + 3]);
            x[4 * p + 3] = _mm_unpackhi_epi32(y[4 * p + 1], y[4 * p + 3]);
        }
#pragma GCC unroll 4
        for (int e = 0; e < 4; e++) {
            const __m256 lo = _mm256_cvtph_ps(_mm_unpacklo_epi64(x[e], x[4 + e]));
            const __m256 hi = _mm256_cvtph_ps(_mm_unpackhi_epi64(x[e], x[4 + e]));
            memcpy(&r[2 * e], &lo, sizeof lo);
            memcpy(&r[2 * e + 1], &hi, sizeof hi);
        }
        return;
    }
#endif
    if (f16) {
        for (int e = 0; e < 8; e++)
            for (int u = 0; u < 8; u++) r[e][u] = f16_bits_to_f32(((const uint16_t *)rows[u])[d0 + e]);
        return;
    }
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) r[u] = v8_load((const float *)rows[u] + d0);
    v8_transpose(r);
}

/* column d of 8 K rows (a D % 8 tail) */
LP_INLINE v8f kcol8(const void *const rows[8], const int f16, int64_t d) {
    v8f r;
    for (int u = 0; u < 8; u++)
        r[u] = f16 ? f16_bits_to_f32(((const uint16_t *)rows[u])[d]) : ((const float *)rows[u])[d];
    return r;
}

/* kT[(b*D + d)*8 + u] = row b*8+u [d], for the 16 rows (two blocks of 8): the K group transposed
 * once for many query rows */
LP_INLINE void k_transpose16(float *restrict kT, const void *const rows[16], const int f16, int64_t D) {
    for (int b = 0; b < 2; b++) {
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            v8f r[8];
            kblock8(rows + 8 * b, f16, d, r);
            for (int e = 0; e < 8; e++) v8_store(kT + (b * D + d + e) * 8, r[e]);
        }
        for (; d < D; d++) v8_store(kT + (b * D + d) * 8, kcol8(rows + 8 * b, f16, d));
    }
}

/* Scores of up to 4 query rows (q[i], i < nr) with the 16 cells of two transposed K blocks: per
 * cell ggml's simd_gemm order, one fma chain over d from 0 (lanes: cells; the rows and blocks
 * are independent chains, interleaved for the fma latency) */
LP_INLINE void kq_rows4(const float *const q[4], const int nr, const float *restrict kT, int64_t D, v8f o[4][2]) {
    v8f a[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = v8_splat(0.0f);
    for (int64_t d = 0; d < D; d++) {
        const v8f k0 = v8_load(kT + d * 8), k1 = v8_load(kT + (D + d) * 8);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            const v8f qv = v8_splat(q[i][d]);
            a[i][0] = v8_fma(qv, k0, a[i][0]);
            a[i][1] = v8_fma(qv, k1, a[i][1]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) o[i][0] = a[i][0], o[i][1] = a[i][1];
}

/* The same for up to 4 query rows and the 16 K rows, transposed 8x8 in registers on the way (no
 * transposed copy): for a unit of few rows (a decode step), where the copy would cost more than
 * the products */
LP_INLINE void kq_rows4_direct(const float *const q[4], const int nr, const void *const rows[16], const int f16,
                               int64_t D, v8f o[4][2]) {
    v8f a[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = v8_splat(0.0f);
    int64_t d0 = 0;
    for (; d0 + 8 <= D; d0 += 8) {
#pragma GCC unroll 2
        for (int blk = 0; blk < 2; blk++) {
            v8f r[8];
            kblock8(rows + 8 * blk, f16, d0, r);
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++)
#pragma GCC unroll 4
                for (int i = 0; i < nr; i++) a[i][blk] = v8_fma(v8_splat(q[i][d0 + e]), r[e], a[i][blk]);
        }
    }
    for (; d0 < D; d0++)
        for (int blk = 0; blk < 2; blk++) {
            const v8f kv = kcol8(rows + 8 * blk, f16, d0);
            for (int i = 0; i < nr; i++) a[i][blk] = v8_fma(v8_splat(q[i][d0]), kv, a[i][blk]);
        }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) o[i][0] = a[i][0], o[i][1] = a[i][1];
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

/* A work unit: the query tokens [t0, t1), the KV heads [kh0, kh0 + nh) and of each of their
 * groups the query heads [gq0, gq0 + ng): R = nh * Rh rows, Rh = (t1-t0)*ng per KV head (row r:
 * KV head kh0 + r/Rh, token t0 + (r%Rh)/ng, query head (kh0 + r/Rh)*g + gq0 + (r%Rh)%ng). One KV
 * head per unit for a prompt (many units); for a few tokens every head in one unit (attend always
 * takes whole groups: gq0 = 0, ng = g; att_row_q maps any). */
typedef struct {
    int64_t kh0, nh, t0, t1, gq0, ng, n_chunks; /* n_chunks: the most tiles any of its tokens has */
} att_unit;

LP_INLINE int64_t att_row_q(const att_args *a, const att_unit *w, int64_t Rh, int64_t r, int64_t *t) {
    const int64_t rr = r % Rh;
    *t = w->t0 + rr / w->ng;
    return (w->kh0 + r / Rh) * a->g + w->gq0 + rr % w->ng; /* query head */
}

/* The cells [*lo, *hi) that tile j of any of a unit's tokens holds (empty: lo >= hi) */
LP_INLINE void att_tile_cells(const att_chunks *ch, const att_unit *w, int64_t j, int64_t N, int64_t *lo, int64_t *hi) {
    int64_t l = N, h = 0;
    for (int64_t t = w->t0; t < w->t1; t++)
        if (j < ch->nch[t]) {
            const int64_t *b = ch->bnd + t * ch->nb + j;
            l = b[0] < l ? b[0] : l;
            h = b[1] > h ? b[1] : h;
        }
    *lo = l, *hi = h < N ? h : N;
}

/* Which of the n (<= 16) columns at p hold, in any of `rows` rows (stride st), a value other
 * than `dead` (a masked cell: -inf; a cell of zero weight: 0): live[c] 1 or 0; returns whether
 * any does. 16 columns take 8 lanes at a time. */
LP_INLINE int att_live(const float *p, int64_t rows, int64_t st, int64_t n, float dead, unsigned char *live) {
    int lv = 0;
    if (n == 16) {
        v8i l0 = {0}, l1 = {0};
        const v8f d = v8_splat(dead);
        for (int64_t r = 0; r < rows; r++) {
            l0 |= v8_load(p + r * st) != d;
            l1 |= v8_load(p + r * st + 8) != d;
        }
        for (int u = 0; u < 8; u++) {
            live[u] = (unsigned char)(l0[u] != 0), live[8 + u] = (unsigned char)(l1[u] != 0);
            lv |= live[u] | live[8 + u];
        }
        return lv;
    }
    for (int64_t c = 0; c < n; c++) {
        int l = 0;
        for (int64_t r = 0; r < rows; r++) l |= p[r * st + c] != dead;
        live[c] = (unsigned char)l;
        lv |= l;
    }
    return lv;
}

/* Bit c: cell c of a mask row (n <= 64 cells) visible (not -inf; nan is, as the scalar test) */
LP_INLINE uint64_t att_mask_bits(const float *mr, int64_t n) {
    uint64_t m = 0;
#if defined(__AVX2__)
    if (n == 64) {
        const __m256 minf = _mm256_set1_ps(-INFINITY);
        for (int k = 0; k < 8; k++)
            m |= (uint64_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(mr + 8 * k), minf, _CMP_NEQ_UQ)) << (8 * k);
        return m;
    }
#endif
    for (int64_t c = 0; c < n; c++) m |= (uint64_t)(mr[c] != -INFINITY) << c;
    return m;
}

/* The cells of [lo, lo + n) in which any of `rows` rows at p (cell lo first, stride st) holds a
 * value other than `dead`, in order, into cells (absolute indices); returns their count. A unit's
 * tile may span other sequences' cells (a unified cache whose sequences decode side by side
 * takes cells in turn): the passes below work on these cells alone, 16 at a time. */
LP_INLINE int64_t att_live_cells(const float *p, int64_t rows, int64_t st, int64_t n, float dead, int64_t lo,
                                 int32_t *cells) {
    int64_t k = 0;
    unsigned char live[16];
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const int64_t nb = n - c0 < 16 ? n - c0 : 16;
        if (!att_live(p + c0, rows, st, nb, dead, live)) continue;
        for (int64_t c = 0; c < nb; c++)
            if (live[c]) cells[k++] = (int32_t)(lo + c0 + c);
    }
    return k;
}

/* the cache rows of the listed cells [i0, i0 + n) (< end) of KV heads [kh0, kh0 + nh) prefetched
 * (att_prefetch's arguments) */
LP_INLINE void att_prefetch_cells(const void *base, int t, const int32_t *cells, int64_t i0, int64_t n, int64_t end,
                                  int64_t sn, int64_t sh, int64_t kh0, int64_t nh, int64_t row_bytes) {
    for (int64_t i = i0; i < i0 + n && i < end; i++) att_prefetch(base, t, cells[i], 1, cells[i] + 1, sn, sh, kh0, nh, row_bytes);
}

/* The rows' scores of tile j (cells [lo, hi)) as one step of llama.cpp's flash_attn_ext_tiled
 * (ops.cpp) computes them: per cell an fma chain over d from 0 (simd_gemm's order), times scale,
 * plus the mask (-inf: -inf). Only the cells some token of the unit sees are scored: their list
 * goes to cells, and row r's scores to sc[r * span + i] for cell cells[i] (a unit's tile may span
 * other sequences' cells: a unified cache whose sequences decode side by side takes cells in
 * turn). Returns the number of cells. K rows are widened once per group of ATT_GROUP cells for
 * all rows of their head and transposed (by 8: a lane per cell). scr: qs (R x D), kf and kT
 * (ATT_GROUP x D each), a zero row (D). */
static int64_t tile_scores(const att_args *a, const att_unit *w, int64_t lo, int64_t hi, float *restrict scr,
                           int32_t *restrict cells, float *restrict sc) {
    const int64_t t0 = w->t0, t1 = w->t1, kh0 = w->kh0, nh = w->nh, ng = w->ng, Rh = (t1 - t0) * ng, R = nh * Rh;
    const int64_t D = a->D, span = a->span;
    const int kt = a->kt;
    float *restrict qs = scr, *restrict kf = qs + R * D, *restrict kT = kf + ATT_GROUP * D, *zr = kT + ATT_GROUP * D;
    memset(zr, 0, (size_t)D * sizeof(float)); /* (f32 zeros: f16 zeros too) */
    for (int64_t r = 0; r < R; r++) {
        int64_t t;
        const int64_t h = att_row_q(a, w, Rh, r, &t);
        memcpy(qs + r * D, a->q + (t * a->H + h) * D, (size_t)D * sizeof(float));
    }
    const float *mask = a->mask + t0 * a->mask_st;
    const int64_t mask_st = a->mask_st, Tu = t1 - t0;
    const float minf = -INFINITY, scale = a->scale;
    const int64_t k_rb = att_row_bytes(kt, D);
    const int64_t n_live = att_live_cells(mask + lo, Tu, mask_st, hi - lo, minf, lo, cells); /* cells any token sees */
    att_prefetch_cells(a->k, kt, cells, 0, ATT_PREFETCH, n_live, a->k_sn, a->k_sh, kh0, nh, k_rb);
    for (int64_t i0 = 0; i0 < n_live; i0 += ATT_GROUP) {
        const int64_t nb = n_live - i0 < ATT_GROUP ? n_live - i0 : ATT_GROUP;
        const int32_t *cg = cells + i0;
        /* 16 cells in a row (a sequence's own cells): the mask read as vectors */
        const int64_t c0 = nb == ATT_GROUP && cg[nb - 1] - cg[0] == nb - 1 ? cg[0] : -1;
        att_prefetch_cells(a->k, kt, cells, i0 + ATT_PREFETCH, ATT_GROUP, n_live, a->k_sn, a->k_sh, kh0, nh, k_rb);
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t kh = kh0 + hh;
            /* the group's K rows: f32 and f16 in place, quantized ones widened into kf; rows
             * past the last cell a row of zeros (zr) */
            const void *rows[ATT_GROUP];
            const int f16 = kt == LP_KV_F16;
            for (int64_t c = 0; c < ATT_GROUP; c++) {
                const int64_t off = (c < nb ? cg[c] : 0) * a->k_sn + kh * a->k_sh;
                if (c >= nb)
                    rows[c] = zr;
                else if (kt == LP_KV_F32)
                    rows[c] = (const float *)a->k + off;
                else if (f16)
                    rows[c] = (const uint16_t *)a->k + off;
                else {
                    kv_row(kf + c * D, a->k, off, kt, D);
                    rows[c] = kf + c * D;
                }
            }
            const int rf16 = f16; /* (the zero row reads as 0 either way) */
            if (Rh > 4) k_transpose16(kT, rows, rf16, D); /* many rows: one transposed copy for all */
            for (int64_t rr = 0; rr < Rh; rr += 4) {
                const int nr = Rh - rr < 4 ? (int)(Rh - rr) : 4;
                const float *qp[4];
                for (int i = 0; i < 4; i++) qp[i] = qs + (hh * Rh + (i < nr ? rr + i : rr)) * D;
                v8f o[4][2];
                if (Rh > 4) {
                    switch (nr) { /* (constant row counts: the loops unrolled) */
                    case 1: kq_rows4(qp, 1, kT, D, o); break;
                    case 2: kq_rows4(qp, 2, kT, D, o); break;
                    case 3: kq_rows4(qp, 3, kT, D, o); break;
                    default: kq_rows4(qp, 4, kT, D, o);
                    }
                } else {
                    switch (nr) {
                    case 1: kq_rows4_direct(qp, 1, rows, rf16, D, o); break;
                    case 2: kq_rows4_direct(qp, 2, rows, rf16, D, o); break;
                    case 3: kq_rows4_direct(qp, 3, rows, rf16, D, o); break;
                    default: kq_rows4_direct(qp, 4, rows, rf16, D, o);
                    }
                }
                for (int i = 0; i < nr; i++) {
                    const float *mr = mask + ((rr + i) / ng) * mask_st;
                    float *s = sc + (hh * Rh + rr + i) * span + i0;
                    if (c0 >= 0) { /* score * scale + mask; a -inf mask: -inf */
                        for (int b = 0; b < 2; b++) {
                            const v8f mv = v8_load(mr + c0 + 8 * b);
                            v8_store(s + 8 * b, v8_select(mv == v8_splat(minf), mv, o[i][b] * v8_splat(scale) + mv));
                        }
                        continue;
                    }
                    float d16[16];
                    v8_store(d16, o[i][0]);
                    v8_store(d16 + 8, o[i][1]);
                    for (int64_t c = 0; c < nb; c++) s[c] = mr[cg[c]] == minf ? minf : d16[c] * scale + mr[cg[c]];
                }
            }
        }
    }
    return n_live;
}

/* the first of the n sorted cells that is >= c */
LP_INLINE int64_t att_lower(const int32_t *cells, int64_t n, int64_t c) {
    int64_t l = 0, h = n;
    while (l < h) {
        const int64_t m = (l + h) / 2;
        if (cells[m] < c)
            l = m + 1;
        else
            h = m;
    }
    return l;
}

/* Tile j's softmax step for each row, on its scores sc (tile_scores: n cells, listed): the row's
 * visible cells of its tile packed in order into ATT_TILE lanes (padding: -inf), their max, the
 * new max Mnew = fmaxf(M, max) and on a rise the state rescaled by libm's expf(M - Mnew) (V sums
 * only in columns [dv0, dv1)); the weights ggml's SIMD exp of (score - Mnew), summed as
 * ggml_vec_soft_max_f32 (each SIMD vector's tree sum, added in double), S = (float)(S + sum).
 * The weights are written back over sc at their cells' places (0 elsewhere). Returns whether any row has
 * a weight. st: M (R), S (R), nan seen (R), V sums (R x Dv). */
static int tile_softmax(const att_args *a, const att_chunks *ch, const att_unit *w, int64_t j,
                        const int32_t *restrict cells, int64_t n_c, float *restrict sc, float *restrict st,
                        int64_t dv0, int64_t dv1) {
    const int64_t Rh = (w->t1 - w->t0) * w->ng, R = w->nh * Rh, Dv = a->Dv, span = a->span;
    float *restrict M = st, *restrict S = M + R, *restrict nan_seen = S + R, *restrict acc = nan_seen + R;
    const float minf = -INFINITY;
    int any_w = 0;
    for (int64_t r = 0; r < R; r++) {
        float *s = sc + r * span;
        const int64_t t = w->t0 + (r % Rh) / w->ng;
        int64_t w0 = 0, w1 = 0; /* the row's tile: the listed cells [w0, w1) */
        if (j < ch->nch[t]) {
            const int64_t *b = ch->bnd + t * ch->nb + j;
            w0 = att_lower(cells, n_c, b[0]), w1 = att_lower(cells, n_c, b[1]);
        }
        const float *mr = a->mask + t * a->mask_st;
        float tile[ATT_TILE];
        int32_t idx[ATT_TILE];
        int n = 0;
        const int64_t left = ch->nvis[t] - j * ATT_TILE, nj = left < ATT_TILE ? left : ATT_TILE;
        const int dense = w1 - w0 == nj; /* the tile's cells all visible: no packing */
        if (dense) {
            n = (int)nj;
            memcpy(tile, s + w0, (size_t)n * sizeof(float));
        } else {
            for (int64_t c = w0; c < w1 && n < ATT_TILE; c++)
                if (mr[cells[c]] != minf) tile[n] = s[c], idx[n++] = (int32_t)c;
        }
        for (int i = n; i < ATT_TILE; i++) tile[i] = minf;
        memset(s, 0, (size_t)n_c * sizeof(float));
        v8f m8 = v8_splat(minf);
        v8i nan8 = {0};
        for (int i = 0; i < ATT_TILE; i += 8) { /* the max is exact in any order; nan skipped */
            const v8f x = v8_load(tile + i);
            m8 = v8_select(x > m8, x, m8);
            nan8 |= x != x;
        }
        float mx = minf;
        for (int u = 0; u < 8; u++) {
            mx = m8[u] > mx ? m8[u] : mx;
            if (nan8[u]) nan_seen[r] = 1.0f; /* reaches the output through nan_seen */
        }
        if (mx == minf) continue; /* nothing visible (or -inf/nan scores only): weights 0 */
        any_w = 1;
        const float Mnew = fmaxf(M[r], mx);
        if (Mnew > M[r]) {
            const float ms = expf(M[r] - Mnew); /* libm, as ggml (M = -inf first: 0) */
            float *ar = acc + r * Dv;
            for (int64_t i = dv0; i < dv1; i++) ar[i] *= ms;
            S[r] *= ms;
        }
        M[r] = Mnew;
        float wt[ATT_TILE];
        for (int i = 0; i < ATT_TILE; i++) wt[i] = att_expf(tile[i] - Mnew);
        double sum = 0.0;
        for (int i = 0; i < ATT_TILE; i += ATT_SUM_W) sum += (double)att_vsum(wt + i);
        S[r] = (float)((double)S[r] + sum);
        if (dense)
            memcpy(s + w0, wt, (size_t)n * sizeof(float));
        else
            for (int i = 0; i < n; i++) s[idx[i]] = wt[i];
    }
    return any_w;
}

/* Tile j's V sums for columns [dv0, dv1): per element one fma chain over the cells in order,
 * continuing the rescaled running sums (ggml's simd_gemm(VKQ32, KQ, V32)), in groups of the listed
 * cells (tile_scores': n, their weights in sc). An f16/quantized group is widened once for the
 * rows of its head (f32 read in place where its cells are in a row); a group no row weighs is
 * skipped, and a row's cells of weight exactly 0, which changes no bit (a running sum from +0 is
 * never -0). A quantized V: the whole rows (dv0 = 0, dv1 = Dv). vf: ATT_VGROUP x Dv floats. */
static void tile_v(const att_args *a, const att_unit *w, const int32_t *restrict cells, int64_t n,
                   const float *restrict sc, float *restrict acc, int64_t dv0, int64_t dv1, float *restrict vf) {
    const int64_t Rh = (w->t1 - w->t0) * w->ng, R = w->nh * Rh, Dv = a->Dv, span = a->span;
    const int64_t kh0 = w->kh0, nh = w->nh, nd = dv1 - dv0;
    const int vt = a->vt;
    const int64_t v_rb = att_row_bytes(vt, Dv);
    unsigned char live[ATT_VGROUP];
    att_prefetch_cells(a->v, vt, cells, 0, ATT_PREFETCH, n, a->v_sn, a->v_sh, kh0, nh, v_rb);
    for (int64_t i0 = 0; i0 < n; i0 += ATT_VGROUP) {
        const int64_t ngr = n - i0 < ATT_VGROUP ? n - i0 : ATT_VGROUP;
        const int32_t *cg = cells + i0;
        att_prefetch_cells(a->v, vt, cells, i0 + ATT_PREFETCH, ATT_VGROUP, n, a->v_sn, a->v_sh, kh0, nh, v_rb);
        if (!att_live(sc + i0, R, span, ngr, 0.0f, live)) continue; /* cells of any non-zero weight */
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t kh = kh0 + hh;
            const float *v0;
            int64_t vs;
            if (vt == LP_KV_F32 && cg[ngr - 1] - cg[0] == ngr - 1) {
                v0 = (const float *)a->v + kh * a->v_sh + cg[0] * a->v_sn + dv0, vs = a->v_sn;
            } else {
                for (int64_t i = 0; i < ngr; i++) {
                    if (!live[i]) continue;
                    const int64_t off = cg[i] * a->v_sn + kh * a->v_sh + dv0;
                    if (vt == LP_KV_F32)
                        memcpy(vf + i * nd, (const float *)a->v + off, (size_t)nd * sizeof(float));
                    else
                        kv_row(vf + i * nd, a->v, off, vt, nd);
                }
                v0 = vf, vs = nd;
            }
            for (int64_t rr = 0; rr < Rh; rr++) {
                const int64_t r = hh * Rh + rr;
                v_accumulate(acc + r * Dv + dv0, sc + r * span + i0, ngr, v0, vs, nd);
            }
        }
    }
}

/* The widest cell range a unit's tile pass scores, rounded up to ATT_GROUP: the scratch's score
 * rows, so they span a tile (ATT_TILE cells when a sequence's cells are contiguous), not N.
 * blk: the query blocks' first tokens (n_tb + 1: the last is T). */
static int64_t att_tile_span(const att_chunks *ch, const int64_t *blk, int64_t n_tb) {
    int64_t span = 0;
    for (int64_t b = 0; b < n_tb; b++) {
        const int64_t t0 = blk[b], t1 = blk[b + 1];
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
            const int64_t w = hi > lo ? hi - lo : 0;
            span = w > span ? w : span;
        }
    }
    return (span + ATT_GROUP - 1) / ATT_GROUP * ATT_GROUP + ATT_GROUP;
}

/* Unit u: `hpu` KV heads and `ngu` query heads of each group per unit; the last query blocks
 * first (most cells), heads innermost */
LP_INLINE att_unit att_unit_at(const att_args *a, const att_chunks *ch, const int64_t *blk, int64_t n_tb, int64_t hpu,
                               int64_t ngu, int64_t u) {
    att_unit w;
    const int64_t ngs = a->g / ngu, nhu = a->Hkv / hpu * ngs, b = n_tb - 1 - u / nhu, hu = u % nhu;
    w.kh0 = hu / ngs * hpu, w.nh = hpu, w.gq0 = hu % ngs * ngu, w.ng = ngu;
    w.t0 = blk[b], w.t1 = blk[b + 1], w.n_chunks = 0;
    for (int64_t t = w.t0; t < w.t1; t++) w.n_chunks = ch->nch[t] > w.n_chunks ? ch->nch[t] : w.n_chunks;
    return w;
}

LP_INLINE void att_state_clear(float *st, int64_t R, int64_t Dv) {
    for (int64_t r = 0; r < R; r++) st[r] = -INFINITY, st[R + r] = 0.0f, st[2 * R + r] = 0.0f;
    memset(st + 3 * R, 0, (size_t)(R * Dv) * sizeof(float));
}

/* The unit's running state normalized into out, columns [dv0, dv1): acc * (1/S), as ggml; a nan
 * score: nan, as numpy; nothing visible: zeros */
static void att_store(const att_args *a, const att_unit *w, const float *st, int64_t dv0, int64_t dv1) {
    const int64_t Rh = (w->t1 - w->t0) * w->ng, R = w->nh * Rh, Dv = a->Dv, H = a->H;
    const float *M = st, *S = st + R, *n = st + 2 * R, *acc = st + 3 * R;
    for (int64_t r = 0; r < R; r++) {
        int64_t t;
        const int64_t h = att_row_q(a, w, Rh, r, &t);
        float *o = a->out + (t * H + h) * Dv;
        if (n[r] != 0.0f || M[r] == -INFINITY) {
            const float fill = n[r] != 0.0f ? NAN : 0.0f;
            for (int64_t i = dv0; i < dv1; i++) o[i] = fill;
            continue;
        }
        const float *ar = acc + r * Dv;
        float s = S[r], ms = 1.0f;
        if (a->sinks) { /* ggml's add_sinks: the sink joins the max and the sum, with no value */
            const float sk = a->sinks[h];
            if (sk > M[r]) ms = expf(M[r] - sk), s = s * ms + 1.0f;
            else s = s + expf(sk - M[r]);
        }
        const float inv = s == 0.0f ? 0.0f : 1.0f / s;
        if (ms != 1.0f)
            for (int64_t i = dv0; i < dv1; i++) o[i] = (ar[i] * ms) * inv;
        else
            for (int64_t i = dv0; i < dv1; i++) o[i] = ar[i] * inv;
    }
}

/* One worker's scratch, in floats: a tile's scores (R x span), the score pass's Q rows and K
 * groups, one V group widened, the tile's cells (span), then the unit's running state */
LP_INLINE size_t att_core_floats(int64_t R, int64_t D, int64_t Dv, int64_t span) {
    return (size_t)(R * span + R * D + (2 * ATT_GROUP + 1) * D + ATT_VGROUP * Dv + span);
}
typedef struct {
    float *sc, *scr, *vf;
    int32_t *cells;
} att_bufs;
LP_INLINE att_bufs att_bufs_of(float *buf, int64_t R, int64_t D, int64_t Dv, int64_t span) {
    att_bufs b;
    b.sc = buf, b.scr = buf + R * span, b.vf = b.scr + R * D + (2 * ATT_GROUP + 1) * D;
    b.cells = (int32_t *)(b.vf + ATT_VGROUP * Dv);
    return b;
}
LP_INLINE size_t att_scratch_floats(int64_t R, int64_t D, int64_t Dv, int64_t span) {
    return att_core_floats(R, D, Dv, span) + att_state_floats(R, Dv);
}

/* A whole unit on one thread: its tiles in order, each scored, stepped and summed */
static void attend_unit(const att_args *a, const att_chunks *ch, const att_unit *w, int64_t R_max, float *buf) {
    const int64_t R = w->nh * (w->t1 - w->t0) * w->ng, D = a->D, Dv = a->Dv;
    const att_bufs b = att_bufs_of(buf, R_max, D, Dv, a->span);
    float *st = buf + att_core_floats(R_max, D, Dv, a->span);
    att_state_clear(st, R, Dv);
    for (int64_t j = 0; j < w->n_chunks; j++) {
        int64_t lo, hi;
        att_tile_cells(ch, w, j, a->N, &lo, &hi);
        if (lo >= hi) continue;
        const int64_t n = tile_scores(a, w, lo, hi, b.scr, b.cells, b.sc);
        if (tile_softmax(a, ch, w, j, b.cells, n, b.sc, st, 0, Dv)) tile_v(a, w, b.cells, n, b.sc, st + 3 * R, 0, Dv, b.vf);
    }
    att_store(a, w, st, 0, Dv);
}

/* What thread 0 prepares for every thread of one attention call. */
typedef struct {
    att_args a;     /* with Q rounded (a quantized K) and the score span */
    att_chunks ch;
    int64_t n_tb, hpu, units, R, ncol;
    size_t scratch; /* floats of a thread's buffer */
    int64_t *bnd, *blk, *first, items; /* (bnd owns ch's and blk's arrays) */
    float *qround, *scores;
    int32_t *cells; /* the two phases: each item's cells (span), their count after them */
} att_plan;

/* the tiles, the unit shape and the shared score buffer of a call of nt threads (NULL: out of
 * memory) */
static att_plan *att_plan_make(const att_args *in, int nt, att_plan *pl) {
    const int64_t T = in->T, N = in->N;
    *pl = (att_plan){.a = *in};
    att_args *a = &pl->a;
    /* each token's tiles: its visible cells, counted in cell order */
    const int64_t nbd = (N + ATT_TILE - 1) / ATT_TILE + 1;
    const int64_t nw = (N + 63) / 64; /* a mask row as bits */
    int64_t *bnd = pl->bnd = malloc((size_t)(T * (nbd + 3) + 1 + 2 * nw) * sizeof(int64_t));
    if (!bnd) return NULL;
    int64_t *nch = bnd + T * nbd, *nvis = nch + T, *blk = pl->blk = nvis + T;
    uint64_t *bits = (uint64_t *)(blk + T + 1), *head_bits = bits + nw;
    memset(head_bits, 0, (size_t)nw * sizeof(uint64_t));
    /* Query blocks (units' tokens): up to tb consecutive tokens that see mostly the same cells (a
     * prompt's tokens, within a sliding window too), sharing each K group they score. A token
     * that shares under half its cells with its block's first (another sequence's, in a decode
     * step of several) starts a block of its own. */
    const int64_t g = a->g, tb = g >= ATT_ROWS ? 1 : (ATT_ROWS + g - 1) / g;
    int64_t n_tb = 0, tbm = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t head = n_tb > 0 && t - blk[n_tb - 1] < tb ? blk[n_tb - 1] : t;
        int64_t *bt = bnd + t * nbd, seen = 0, last = 0, shared = 0;
        for (int64_t w = 0; w < nw; w++) {
            uint64_t m = att_mask_bits(a->mask + t * a->mask_st + 64 * w, N - 64 * w < 64 ? N - 64 * w : 64);
            bits[w] = m;
            if (!m) continue;
            shared += __builtin_popcountll(m & head_bits[w]);
            last = 64 * w + 64 - __builtin_clzll(m);
            /* tile j starts at visible cell j * ATT_TILE: where that falls in this word */
            for (int64_t k = (ATT_TILE - seen % ATT_TILE) % ATT_TILE, n = __builtin_popcountll(m); k < n; k += ATT_TILE) {
                uint64_t r = m;
                for (int64_t i = 0; i < k; i++) r &= r - 1; /* drop the k lowest cells */
                bt[(seen + k) / ATT_TILE] = 64 * w + __builtin_ctzll(r);
            }
            seen += __builtin_popcountll(m);
        }
        nch[t] = (seen + ATT_TILE - 1) / ATT_TILE, nvis[t] = seen;
        bt[nch[t]] = last;
        if (head == t || 2 * shared < (seen < nvis[head] ? seen : nvis[head])) {
            blk[n_tb++] = t;
            memcpy(head_bits, bits, (size_t)nw * sizeof(uint64_t));
        }
        const int64_t size = t + 1 - blk[n_tb - 1];
        tbm = size > tbm ? size : tbm;
    }
    blk[n_tb] = T;
    pl->ch = (att_chunks){bnd, nch, nvis, nbd};
    /* Q rounded through Q8_0 once for a quantized K (q_to_vec_dot); f32 and f16 K: Q stays f32,
     * as in llama.cpp's tiled path */
    if (a->kt >= LP_KV_Q8_0) {
        if (!(pl->qround = malloc((size_t)(T * a->H * a->D) * sizeof(float)))) return NULL;
        for (int64_t i = 0; i < T * a->H; i++) round_q8_0_row(pl->qround + i * a->D, a->q + i * a->D, a->D);
        a->q = pl->qround;
    }
    a->span = att_tile_span(&pl->ch, blk, n_tb);
    /* Fewer query blocks than threads (decode): every head in one unit and the two phases of
     * attend_par, while their scores (every tile of every unit) take at most ATT_SCORES_MAX bytes;
     * else one KV head per unit on threads. One thread and a few blocks, or blocks of few rows (a
     * decode step's tokens of several sequences): every head in one unit. */
    int64_t max_tiles = 0;
    for (int64_t t = 0; t < T; t++) max_tiles = nch[t] > max_tiles ? nch[t] : max_tiles;
    const int two = nt > 1 && n_tb < nt &&
                    (double)n_tb * (double)max_tiles * (double)(tbm * g * a->Hkv * a->span) * 4.0 <= ATT_SCORES_MAX;
    const int64_t hpu = two || (nt == 1 && n_tb < 4) || tbm * g < ATT_ROWS ? a->Hkv : 1, units = a->Hkv / hpu * n_tb;
    pl->n_tb = n_tb, pl->hpu = hpu, pl->units = units, pl->ncol = 1;
    pl->R = tbm * g * hpu;
    pl->scratch = att_scratch_floats(pl->R, a->D, a->Dv, a->span);
    /* the (unit, tile) scores first, then the (unit, KV head, column range) V sums */
    if (two) {
        int64_t *first = pl->first = malloc((size_t)(units + 1) * sizeof(int64_t));
        if (!first) return NULL;
        for (int64_t u = 0; u < units; u++) {
            first[u] = pl->items;
            pl->items += att_unit_at(a, &pl->ch, blk, n_tb, hpu, g, u).n_chunks;
        }
        first[units] = pl->items;
        if (pl->items > 1 && (!(pl->scores = malloc((size_t)(pl->items * pl->R * a->span) * sizeof(float))) ||
                              !(pl->cells = malloc((size_t)(pl->items * (a->span + 1)) * sizeof(int32_t)))))
            return NULL;
        /* column ranges of whole 8-lane vectors (a quantized V: whole rows, as it is widened) */
        pl->ncol = a->vt >= LP_KV_Q8_0 ? 1 : (3 * nt + units * hpu - 1) / (units * hpu); /* ~3 items a thread */
        if (pl->ncol > a->Dv / 8) pl->ncol = a->Dv / 8 > 1 ? a->Dv / 8 : 1;
    }
    return pl;
}

static void att_plan_free(att_plan *pl) {
    free(pl->scores), free(pl->cells), free(pl->first);
    free(pl->qround);
    free(pl->bnd);
}

/* Attention of T query tokens over N cells (ggml's flash_attn_ext, the arithmetic of its tiled
 * path for every row count): work units of (KV heads, query heads of a group, a block of query
 * tokens), each row's cells cut into tiles of ATT_TILE visible cells, stepped through in order
 * (an online softmax). A prompt (many query blocks) has one KV head per unit, each unit on one
 * thread. A few tokens (decode): every head in one unit, and on several threads in two phases:
 * the tiles' scores shared out (each score depends on its cell alone), then the V sums shared
 * out by KV head and column range (each column's chain is sequential over the tiles on its
 * own), each such item repeating its head's cheap softmax steps. llama.cpp instead splits one query's cells among its
 * threads and combines their partial results, which cannot keep the sequential tile order.
 * Either way a row's arithmetic is the same, so the output does not depend on the thread count
 * or on the other rows. Each unit reads only the cells its tokens see (the causal lower
 * triangle, one sequence's cells). The whole team once the work reaches ATT_PAR_WORK, else
 * thread 0 alone. No state outside the call. */
static void attend_par(lp_par *p, const att_args *in) {
    if (in->T <= 0 || in->H <= 0 || in->Hkv <= 0 || in->Dv <= 0) return;
    const int nt = p->nth > 1 && in->T * in->N * in->H * (in->D + in->Dv) >= ATT_PAR_WORK ? p->nth : 1;
    if (nt == 1 && p->ith != 0) return;
    att_plan mine, *pl = p->ith == 0 ? att_plan_make(in, nt, &mine) : NULL;
    if (nt > 1) pl = lp_par_share(p, pl);
    if (pl == NULL) { /* out of memory: nothing written */
        if (p->ith == 0) att_plan_free(&mine);
        return;
    }
    const att_args *a = &pl->a;
    const att_chunks *ch = &pl->ch;
    const int64_t *blk = pl->blk, n_tb = pl->n_tb, hpu = pl->hpu, units = pl->units, R = pl->R;
    const int64_t g = a->g, N = a->N, D = a->D, Dv = a->Dv, span = a->span;
    float *buf = malloc(pl->scratch * sizeof(float)); /* NULL: nothing written */
    const att_bufs b = att_bufs_of(buf, R, D, Dv, span);
    if (pl->scores) {
        const int64_t *first = pl->first;
        for (int64_t i = lp_par_first(p, nt > 1, pl->items); i < pl->items; i = lp_par_then(p, nt > 1, i)) {
            int64_t u = 0;
            while (first[u + 1] <= i) u++;
            const att_unit w = att_unit_at(a, ch, blk, n_tb, hpu, g, u);
            int64_t lo, hi;
            att_tile_cells(ch, &w, i - first[u], N, &lo, &hi);
            int32_t *cells = pl->cells + i * (span + 1);
            cells[span] = buf && lo < hi ? (int32_t)tile_scores(a, &w, lo, hi, b.scr, cells, pl->scores + i * R * span) : 0;
        }
        lp_par_barrier(p); /* every score is made */
        const int64_t ncol = pl->ncol, vitems = units * hpu * ncol, cw = (Dv / 8 + ncol - 1) / ncol * 8;
        for (int64_t i = lp_par_first(p, nt > 1, vitems); i < vitems; i = lp_par_then(p, nt > 1, i)) {
            /* (unit, one of its KV heads, a column range): the head's rows of the unit's scores */
            const int64_t u = i / (hpu * ncol), hh = i / ncol % hpu, dv0 = i % ncol * cw;
            const int64_t dv1 = dv0 + cw < Dv ? dv0 + cw : Dv;
            att_unit w = att_unit_at(a, ch, blk, n_tb, hpu, g, u);
            const int64_t Ru = (w.t1 - w.t0) * w.ng; /* rows of one KV head */
            w.kh0 += hh, w.nh = 1;
            if (!buf || dv0 >= Dv) continue;
            float *st = buf + att_core_floats(R, D, Dv, span);
            att_state_clear(st, Ru, Dv);
            for (int64_t j = 0; j < w.n_chunks; j++) {
                const int32_t *cells = pl->cells + (first[u] + j) * (span + 1);
                const int64_t n = cells[span];
                if (n == 0) continue;
                for (int64_t r = 0; r < Ru; r++) /* (the head's rows: their listed cells' scores) */
                    memcpy(b.sc + r * span, pl->scores + ((first[u] + j) * R + hh * Ru + r) * span, (size_t)n * sizeof(float));
                if (tile_softmax(a, ch, &w, j, cells, n, b.sc, st, dv0, dv1)) tile_v(a, &w, cells, n, b.sc, st + 3 * Ru, dv0, dv1, b.vf);
            }
            att_store(a, &w, st, dv0, dv1);
        }
    } else {
        for (int64_t u = lp_par_first(p, nt > 1, units); u < units; u = lp_par_then(p, nt > 1, u)) {
            const att_unit w = att_unit_at(a, ch, blk, n_tb, hpu, g, u);
            if (buf) attend_unit(a, ch, &w, R, buf);
        }
    }
    free(buf);
    if (nt > 1) lp_par_barrier(p); /* no one reads the plan any more */
    if (p->ith == 0) att_plan_free(&mine);
}

static int64_t attend_run(lp_par *p, void *a) {
    attend_par(p, a);
    return 0;
}

static void attend(const att_args *a, int n_threads) { lp_par_run(n_threads, attend_run, (void *)a); }

/* cache types lp_attend_q reads: each of K, V one of LP_KV_*, a quantized one in whole blocks */
static int att_types_ok(int kt, int vt, int64_t D, int64_t Dv) {
    if (kt < LP_KV_F32 || kt > LP_KV_Q4_0 || vt < LP_KV_F32 || vt > LP_KV_Q4_0) return 0;
    return !((kt >= LP_KV_Q8_0 && D % 32) || (vt >= LP_KV_Q8_0 && Dv % 32));
}

#define ATT_ARGS(kt_, vt_)                                                                                       \
    {q, k, v, mask, out, T, H, D, N, Hkv, Dv, Hkv > 0 ? H / Hkv : 1, k_sn, k_sh, v_sn, v_sh, mask_st, scale, kt_, \
     vt_, 0, NULL}

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

/* The same over an f16 cache (k, v: IEEE half bits; strides in elements). Q stays f32 and the K
 * and V rows are widened, as llama.cpp's tiled path does; scores and V sums in f32. */
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
 * summed, as ggml's v_to_float path. sinks: NULL, or (H,) logits that join each query head's
 * softmax denominator (ggml_flash_attn_ext_add_sinks, gpt-oss). */
LP_API void lp_attend_q(const float *q, int64_t T, int64_t H, int64_t D, const void *k, const void *v, int64_t N,
                        int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh,
                        const float *mask, int64_t mask_st, float scale, float *out, int kt, int vt,
                        const float *sinks, int n_threads) {
    if (!att_types_ok(kt, vt, D, Dv)) return;
    att_args a = ATT_ARGS(kt, vt);
    a.sinks = sinks;
    attend(&a, n_threads);
}

/* lp_attend_q as a thread of a running team (the executor's records) */
void lp_attend_q_par(lp_par *p, const float *q, int64_t T, int64_t H, int64_t D, const void *k, const void *v,
                     int64_t N, int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh,
                     const float *mask, int64_t mask_st, float scale, float *out, int kt, int vt,
                     const float *sinks) {
    if (!att_types_ok(kt, vt, D, Dv)) return;
    att_args a = ATT_ARGS(kt, vt);
    a.sinks = sinks;
    attend_par(p, &a);
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

/* GELU(gate) * up as ggml-cpu's GGML_GELU_FP16 path computes it (kernels.gelu): gate rounded to
 * f16, its GELU read from `table` (kernels.gelu_table: float32 values of f16s, by the f16's bits),
 * gate <= -10 giving 0 and gate >= 10 gate itself; rows with strides as lp_swiglu. */
LP_API void lp_geglu(const float *gate, const float *up, int64_t rows, int64_t n, int64_t gate_st, int64_t up_st,
                     const float *table, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_st, *u = up + r * up_st;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float x = g[i];
            const float y = x <= -10.0f ? 0.0f : x >= 10.0f ? x : table[f16_bits(x)];
            o[i] = y * u[i];
        }
    }
}

/* gpt-oss's clamped SwiGLU as ggml-cpu's swiglu_oai computes it (scalar, libm expf): x =
 * min(gate, limit), y = clamp(up, -limit, limit), x / (1 + e^(alpha * -x)) * (y + 1); rows with
 * strides as lp_swiglu. */
LP_API void lp_swiglu_oai(const float *gate, const float *up, int64_t rows, int64_t n, int64_t gate_st,
                          int64_t up_st, float alpha, float limit, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_st, *u = up + r * up_st;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float x = limit < g[i] ? limit : g[i]; /* std::min(x, limit) */
            const float y = u[i] < -limit ? -limit : limit < u[i] ? limit : u[i]; /* std::clamp */
            o[i] = (x / (1.0f + expf(alpha * (-x)))) * (y + 1.0f);
        }
    }
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

/* ---------------------------------------------------------------------------------------- */
/* soft_max and argsort (the mixture-of-experts router)                                      */

/* ggml's soft_max_f32 without a mask, on the llama.cpp build for this CPU (-march=native), bit
 * for bit: x * scale, its max, e^(x - max) by the SIMD exp over whole vectors (16 floats with
 * AVX-512 F+DQ, else 8: ggml_vec_soft_max_f32) each vector's sum reduced as _mm512_reduce_add_ps /
 * the AVX2 hadd sequence and added in double, libm's expf on the tail, then every value times
 * (float)(1.0 / sum). */
LP_API void lp_soft_max_rows(const float *x, int64_t rows, int64_t n, int64_t xs, float scale, float *out) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    enum { W = 16 };
#else
    enum { W = 8 };
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        float *y = out + r * n;
        float max = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            y[i] = xr[i] * scale;
            max = y[i] > max ? y[i] : max;
        }
        double sum = 0.0;
        int64_t i = 0;
        for (; i + W <= n; i += W) {
            float v[W];
            for (int l = 0; l < W; l++) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
                v[l] = lp_expf_avx512(y[i + l] - max);
#else
                v[l] = lp_expf(y[i + l] - max);
#endif
                y[i + l] = v[l];
            }
            float h[8], q[4];
#if defined(__AVX512F__) && defined(__AVX512DQ__)
            for (int l = 0; l < 8; l++) h[l] = v[l + 8] + v[l];
#else
            for (int l = 0; l < 8; l++) h[l] = v[l];
#endif
            for (int l = 0; l < 4; l++) q[l] = h[l + 4] + h[l];
            sum += (double)((q[0] + q[2]) + (q[1] + q[3]));
        }
        for (; i < n; i++) {
            y[i] = expf(y[i] - max);
            sum += (double)y[i];
        }
        const float inv = (float)(1.0 / sum);
        for (int64_t k = 0; k < n; k++) y[k] *= inv;
    }
}

/* each row's indices, largest value first, equal values in index order (a stable sort; ggml's
 * argsort leaves ties in no promised order) */
LP_API void lp_argsort_rows(const float *x, int64_t rows, int64_t n, int64_t xs, int32_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        int32_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float key = xr[i];
            int64_t j = i;
            for (; j > 0 && xr[o[j - 1]] < key; j--) o[j] = o[j - 1];
            o[j] = (int32_t)i;
        }
    }
}
