/* Quantized matvec and dequantization on the repacked (rows-interleaved) weight layouts.
 *
 * ggml counterparts (ggml-cpu): quants.c ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 /
 * q4_K_q8_K / q6_K_q8_K for the dot products, and repack.cpp (ggml's block_q4_0x8 etc. and
 * ggml_gemv_*) for the idea of interleaving the blocks of several rows so that one SIMD lane
 * works on one row. Unlike ggml the activations are NOT quantized to q8: the weights are expanded
 * to float32 and multiplied with the float32 activations, so the only rounding is the weights'
 * own (plus float32 sums).
 *
 * Layout (built by qmatmul.py `_repack_*`; all arrays C-contiguous). A tile holds LP_R = 64
 * consecutive rows; T full tiles; nb blocks per row (n_in/32 for Q4_0/Q4_1/Q8_0, n_in/256 for
 * Q4_K/Q6_K). For every block and every byte/field j of the block the tile stores the 64 rows'
 * values side by side, i.e. an array of shape (T, nb, k, 64). The f16 scales stay f16, the
 * file's bits (dm: IEEE half, read as uint16 and widened to float32 by h2f / ldh, exactly), so
 * a tile holds the file's bytes, only reordered (Q4_K: plus 4 bytes a block, its 6-bit scales
 * unpacked). `parts` points to these arrays in this order:
 *   Q4_0: qs uint8 (T,nb,16,R), dm f16 (T,nb,1,R) = d
 *         element j (< 16) of a block = d*((q&15)-8), element 16+j = d*((q>>4)-8)
 *   Q4_1: qs uint8 (T,nb,16,R), dm f16 (T,nb,2,R) = d, m
 *         d*(q&15) + m, d*(q>>4) + m
 *   Q8_0: qs int8 (T,nb,32,R), dm f16 (T,nb,1,R) = d;  element j = (float)q * d
 *   Q4_K: qs uint8 (T,nb,128,R), sm uint8 (T,nb,16,R) (8 scales then 8 mins, 6-bit values
 *         already unpacked), dm f16 (T,nb,2,R) = d, dmin. Sub-block pair p (0..3): byte l (< 32)
 *         of qs[p*32 + l] gives element p*64+l = d*sc[2p]*(q&15) - dmin*mn[2p] and element
 *         p*64+32+l = d*sc[2p+1]*(q>>4) - dmin*mn[2p+1].
 *   Q6_K: ql uint8 (T,nb,128,R), qh uint8 (T,nb,64,R), sc int8 (T,nb,16,R), dm f16 (T,nb,1,R)
 *         half hf (0..1), l (< 32), a = ql[hf*64+l], c = ql[hf*64+32+l], h = qh[hf*32+l]:
 *         element hf*128 + l      = d*sc[k]  *(((a&15) | ((h&3)<<4))  - 32)
 *                 hf*128 + 32 + l = d*sc[k+2]*(((c&15) | ((h&12)<<2)) - 32)
 *                 hf*128 + 64 + l = d*sc[k+4]*(((a>>4) | (h&48))      - 32)
 *                 hf*128 + 96 + l = d*sc[k+6]*(((c>>4) | ((h&192)>>2)) - 32),  k = hf*8 + l/16
 *
 * Exported (all row-major, float32; see the comments at each group of functions below):
 *   lp_mv_<t>(parts, n_tiles, nb, x, n_tok, out, ld_out, n_threads)     matvec / small matmul
 *   lp_dqt_<t>(parts, t0, t1, nb, out_t, ld, n_threads)                  whole tiles, transposed
 *   lp_dqr_<t>(parts, nb, ids, n, out)                                   selected rows
 * for <t> in q4_0, q4_1, q8_0, q4_k, q6_k.
 *
 * The matvec kernels keep the 64 rows of a tile in SIMD lanes (8-float vectors; a group of 8*NV
 * rows is held in registers), so there is no horizontal sum anywhere; two tokens are done at
 * once when there are several, sharing the expansion of the weights. They use fused
 * multiply-adds; results are within float32 summation error of the exact dot products
 * (tested: |err| <= 1e-5 * sum_i |w_i x_i| per output).
 * The dequantization kernels are BIT-EXACT with numpy's llamapy.quants / gguf-py: the same
 * float32 operations in the same order (d * q + m, (d * sc) * q - dmin * mn, ...). With f16
 * scales and small integer quants every product but Q6_K's last is exact in float32, so each
 * output is one rounding of the exact value, and an FMA would give the same bits; the code still
 * writes the unfused `a * b + c` that the build's -ffp-contract=off keeps as it is. (The F16C
 * conversion quiets a signalling-nan scale where numpy keeps it; no output can tell, as each is
 * an arithmetic result of its scales, which quiets it the same way.)
 *
 * Threads: a team (lp_team.h) over chunks of tiles (see run_tiles), never for small calls, and
 * never in a child made by fork() (libgomp hangs there once the parent has used it).
 *
 * Built by setup.py once per SIMD variant (portable, -mavx2 -mfma -mf16c, + AVX-512) with
 *   -O3 -std=gnu11 -ffp-contract=off -fno-math-errno -fvisibility=hidden -fopenmp
 * The code is GCC/clang vector extensions (8 x 32-bit lanes; one AVX2 register, two SSE / NEON
 * ones) plus two intrinsics of x86: the FMA (without it, or with -DLP_QMM_GENERIC, a multiply and
 * an add) and F16C's f16 -> f32 conversion (without it, or with -DLP_QMM_GENERIC, integer and
 * float32 operations on the bits, as exact). OpenMP is optional.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lp_team.h"
#if defined(__FMA__) && defined(__AVX__) && !defined(LP_QMM_GENERIC)
#include <immintrin.h>
#define LP_QMM_FMA 1
#endif
#if defined(__F16C__) && defined(__AVX__) && !defined(LP_QMM_GENERIC)
#include <immintrin.h>
#define LP_QMM_F16C 1
#endif

#define LP_R 64
/* Calls with fewer weights (n_tiles*64*n_in*n_tok) than this never start threads. */
#define LP_PAR_MIN_WEIGHTS (1LL << 18)
/* A dequantized element costs about this many matvec weights (it is written out). */
#define LP_DQ_WEIGHT 4

#if defined(__GNUC__) && !defined(__clang__)
/* 32-byte vectors between static inline helpers on a target without AVX: no ABI is involved */
#pragma GCC diagnostic ignored "-Wpsabi"
/* the x block sums passed by pointer are filled by block_sums32; gcc cannot always see it */
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define QMM_API __attribute__((visibility("default")))
#define QMM_INLINE static inline __attribute__((always_inline))

/* ---------------------------------------------------------------------------------------- */
/* 8-lane vectors                                                                            */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

QMM_INLINE v8f ldf(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* (macros, not functions, where a vector is an argument: no vector ABI on non-AVX targets) */
#define stf(p, v)                                                                                   \
    do {                                                                                            \
        const v8f stf_v_ = (v);                                                                     \
        memcpy((p), &stf_v_, sizeof stf_v_);                                                        \
    } while (0)

/* f16 (the IEEE half bits the scales are stored as) -> float32, exact: vcvtph2ps with F16C,
 * else the bits (normals and subnormals: the exponent and mantissa moved into a float32 and
 * scaled by 2^112, exact; inf and nan keep their payload) */
#ifdef LP_QMM_F16C
QMM_INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* 8 consecutive f16 */
QMM_INLINE v8f ldh(const uint16_t *p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
QMM_INLINE float h2f(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    uint32_t mag;
    if (em >= 0x7c00u) {
        mag = 0x7f800000u | (em << 13);
    } else {
        float f;
        memcpy(&f, &(uint32_t){em << 13}, sizeof f);
        f *= 0x1p112f;
        memcpy(&mag, &f, sizeof mag);
    }
    const uint32_t u = mag | ((uint32_t)(h & 0x8000u) << 16);
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* 8 consecutive f16: the same, on 8 lanes */
QMM_INLINE v8f ldh(const uint16_t *p) {
    typedef uint32_t v8u __attribute__((vector_size(32)));
    const v8u h = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    const v8u em = h & 0x7fffu, e13 = em << 13;
    const v8u big = (v8u)(em >= 0x7c00u); /* inf / nan: all ones */
    const v8u mag = (v8u)((v8f)e13 * 0x1p112f);
    return (v8f)((big & (e13 | 0x7f800000u)) | (~big & mag) | ((h & 0x8000u) << 16));
}
#endif

QMM_INLINE v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

QMM_INLINE v8i spli(int32_t x) { return (v8i){x, x, x, x, x, x, x, x}; }

#define cvt(v) __builtin_convertvector((v), v8f)

/* 8 bytes, zero- / sign-extended to int32 lanes (gcc makes this one vpmovzxbd / vpmovsxbd with
 * AVX2; __builtin_convertvector from an 8-byte vector is much worse) */
QMM_INLINE v8i ldu8(const uint8_t *p) { return (v8i){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }

QMM_INLINE v8i ldi8(const int8_t *p) { return (v8i){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }

/* a*b + c, fused where the CPU has it (the matvecs; the dequantization keeps numpy's operations) */
#ifdef LP_QMM_FMA
#define fmadd(a, b, c) ((v8f)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
#define fmadd(a, b, c) ((a) * (b) + (c))
#endif

/* ---------------------------------------------------------------------------------------- */
/* threading                                                                                 */

/* Every kernel here is written once as a function of its thread's lp_par (lp_team.h): called
 * from the executor inside its one region per split, or through lp_par_run by the exported
 * function, which opens a region of its own. */
static int use_threads(int n_threads, int64_t units, int64_t work) {
    return n_threads > 1 && units > 1 && work >= LP_PAR_MIN_WEIGHTS;
}

typedef void (*tiles_fn)(const void *const *parts, int64_t ta, int64_t tb, int64_t nb, const float *x,
                         const float *xs, int64_t n_tok, float *out, int64_t ld_out);

static void fill_nan(float *out, int64_t n_tok, int64_t n_cols, int64_t ld_out);

/* fn over tiles [0, n_tiles): on thread 0 alone, or in min(n_tiles, 4*nth) chunks of tiles
 * handed out dynamically when the work is big enough. Each chunk writes its own output columns.
 * xs NULL where the type needs it (out of memory): this thread's chunks become nan. */
static void run_tiles(lp_par *p, tiles_fn fn, int need_xs, const void *const *parts, int64_t n_tiles, int64_t nb,
                      const float *x, const float *xs, int64_t n_tok, float *out, int64_t ld_out, int64_t work) {
    const int par = use_threads(p->nth, n_tiles, work);
    const int64_t nc = !par ? 1 : n_tiles < 4LL * p->nth ? n_tiles : 4LL * p->nth;
    for (int64_t c = lp_par_first(p, par, nc); c < nc; c = lp_par_then(p, par, c)) {
        const int64_t ta = c * n_tiles / nc, tb = (c + 1) * n_tiles / nc;
        if (need_xs && xs == NULL)
            fill_nan(out + ta * LP_R, n_tok, (tb - ta) * LP_R, ld_out);
        else
            fn(parts, ta, tb, nb, x, xs, n_tok, out, ld_out);
    }
}

/* Sums of x over runs of 32 elements, xs[t*(n_in/32) + i], for the "+ m" / "- dmin*m" terms:
 * in `stack` (XS_STACK floats) when they fit, else in a malloc'd buffer; NULL when out of memory. */
#define XS_STACK 4096

static float *block_sums32(const float *restrict x, int64_t n_tok, int64_t n_in, float *stack) {
    const int64_t n32 = n_in / 32;
    float *restrict xs = n_tok * n32 <= XS_STACK ? stack : (float *)malloc((size_t)(n_tok * n32) * sizeof(float));
    if (xs == NULL)
        return NULL;
    for (int64_t t = 0; t < n_tok; t++) {
        for (int64_t i = 0; i < n32; i++) {
            const float *p = x + t * n_in + i * 32;
            float l[8];
            for (int k = 0; k < 8; k++)
                l[k] = (p[k] + p[8 + k]) + (p[16 + k] + p[24 + k]);
            xs[t * n32 + i] = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
        }
    }
    return xs;
}

static void fill_nan(float *out, int64_t n_tok, int64_t n_cols, int64_t ld_out) {
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t i = 0; i < n_cols; i++)
            out[t * ld_out + i] = NAN;
}

/* ---------------------------------------------------------------------------------------- */
/* matvec: out[t*ld_out + tile*64 + r] = sum_i x[t*n_in + i] * W[tile*64 + r, i]             */
/*                                                                                            */
/* Each *_group computes NT tokens (1 or 2) x 8*NV rows of one tile over all blocks: per block */
/* the rows' partial dots s are summed in registers, then scaled and added to the outputs      */
/* themselves (o: the first token's, the second's at o + ld_out), through memory: kept in      */
/* registers across the block loop gcc would run out of them and spill the hot sums instead.  */
/* x points to the first token's row (the second's at x + n_in).                               */

#define ACC ldf(o + u * ld_out + 8 * k)
#define ACC_UPDATE(e)                                                                               \
    do {                                                                                            \
        stf(o + u * ld_out + 8 * k, (e));                                                           \
        __asm__ __volatile__("" ::: "memory"); /* keep it a store */                               \
    } while (0)

/* SPLIT: two accumulators per row vector (low / high nibbles, even / odd j) so that 2*NT*NV
 * independent FMA chains hide the FMA latency. */
QMM_INLINE void q4_0_group(const uint8_t *restrict qs, const uint16_t *restrict dm, int64_t nb, const float *restrict x,
                           int64_t n_in, float *restrict o, int64_t ld_out, const int NT, const int NV,
                           const int SPLIT) {
    const v8i m15 = spli(15), k8 = spli(8);
    for (int u = 0; u < NT; u++)
        for (int k = 0; k < NV; k++)
            stf(o + u * ld_out + 8 * k, splat(0.0f));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = qs + b * 16 * LP_R;
        const float *xb = x + b * 32;
        v8f s[2][2][8];
        for (int h = 0; h < 2; h++)
            for (int u = 0; u < NT; u++)
                for (int k = 0; k < NV; k++)
                    s[h][u][k] = splat(0.0f);
        for (int j = 0; j < 16; j++) {
            v8f xl[2], xh[2];
            for (int u = 0; u < NT; u++) {
                xl[u] = splat(xb[u * n_in + j]);
                xh[u] = splat(xb[u * n_in + 16 + j]);
            }
            for (int k = 0; k < NV; k++) {
                const v8i v = ldu8(q + j * LP_R + 8 * k);
                const v8f lo = cvt((v & m15) - k8), hi = cvt((v >> 4) - k8);
                for (int u = 0; u < NT; u++) {
                    s[0][u][k] = fmadd(lo, xl[u], s[0][u][k]);
                    s[SPLIT][u][k] = fmadd(hi, xh[u], s[SPLIT][u][k]);
                }
            }
        }
        const uint16_t *d = dm + b * LP_R;
        for (int k = 0; k < NV; k++) {
            const v8f dk = ldh(d + 8 * k);
            for (int u = 0; u < NT; u++)
                ACC_UPDATE(fmadd(dk, SPLIT ? s[0][u][k] + s[1][u][k] : s[0][u][k], ACC));
        }
    }
}

QMM_INLINE void q4_1_group(const uint8_t *restrict qs, const uint16_t *restrict dm, int64_t nb, const float *restrict x,
                           const float *restrict xs, int64_t n_in, float *restrict o, int64_t ld_out, const int NT,
                           const int NV, const int SPLIT) {
    const v8i m15 = spli(15);
    for (int u = 0; u < NT; u++)
        for (int k = 0; k < NV; k++)
            stf(o + u * ld_out + 8 * k, splat(0.0f));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = qs + b * 16 * LP_R;
        const float *xb = x + b * 32;
        v8f s[2][2][8];
        for (int h = 0; h < 2; h++)
            for (int u = 0; u < NT; u++)
                for (int k = 0; k < NV; k++)
                    s[h][u][k] = splat(0.0f);
        for (int j = 0; j < 16; j++) {
            v8f xl[2], xh[2];
            for (int u = 0; u < NT; u++) {
                xl[u] = splat(xb[u * n_in + j]);
                xh[u] = splat(xb[u * n_in + 16 + j]);
            }
            for (int k = 0; k < NV; k++) {
                const v8i v = ldu8(q + j * LP_R + 8 * k);
                const v8f lo = cvt(v & m15), hi = cvt(v >> 4);
                for (int u = 0; u < NT; u++) {
                    s[0][u][k] = fmadd(lo, xl[u], s[0][u][k]);
                    s[SPLIT][u][k] = fmadd(hi, xh[u], s[SPLIT][u][k]);
                }
            }
        }
        const uint16_t *d = dm + b * 2 * LP_R, *m = d + LP_R;
        v8f xsb[2];
        for (int u = 0; u < NT; u++)
            xsb[u] = splat(xs[u * (n_in / 32) + b]);
        for (int k = 0; k < NV; k++) {
            const v8f dk = ldh(d + 8 * k), mk = ldh(m + 8 * k);
            for (int u = 0; u < NT; u++)
                ACC_UPDATE(fmadd(dk, SPLIT ? s[0][u][k] + s[1][u][k] : s[0][u][k], fmadd(mk, xsb[u], ACC)));
        }
    }
}

QMM_INLINE void q8_0_group(const int8_t *restrict qs, const uint16_t *restrict dm, int64_t nb, const float *restrict x,
                           int64_t n_in, float *restrict o, int64_t ld_out, const int NT, const int NV,
                           const int SPLIT) {
    for (int u = 0; u < NT; u++)
        for (int k = 0; k < NV; k++)
            stf(o + u * ld_out + 8 * k, splat(0.0f));
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q = qs + b * 32 * LP_R;
        const float *xb = x + b * 32;
        v8f s[2][2][8];
        for (int h = 0; h < 2; h++)
            for (int u = 0; u < NT; u++)
                for (int k = 0; k < NV; k++)
                    s[h][u][k] = splat(0.0f);
        for (int j = 0; j < 32; j += 2) {
            v8f x0[2], x1[2];
            for (int u = 0; u < NT; u++) {
                x0[u] = splat(xb[u * n_in + j]);
                x1[u] = splat(xb[u * n_in + j + 1]);
            }
            for (int k = 0; k < NV; k++) {
                const v8f w0 = cvt(ldi8(q + j * LP_R + 8 * k)), w1 = cvt(ldi8(q + (j + 1) * LP_R + 8 * k));
                for (int u = 0; u < NT; u++) {
                    s[0][u][k] = fmadd(w0, x0[u], s[0][u][k]);
                    s[SPLIT][u][k] = fmadd(w1, x1[u], s[SPLIT][u][k]);
                }
            }
        }
        const uint16_t *d = dm + b * LP_R;
        for (int k = 0; k < NV; k++) {
            const v8f dk = ldh(d + 8 * k);
            for (int u = 0; u < NT; u++)
                ACC_UPDATE(fmadd(dk, SPLIT ? s[0][u][k] + s[1][u][k] : s[0][u][k], ACC));
        }
    }
}

QMM_INLINE void q4_k_group(const uint8_t *restrict qs, const uint8_t *restrict sm, const uint16_t *restrict dm,
                           int64_t nb, const float *restrict x, const float *restrict xs, int64_t n_in,
                           float *restrict o, int64_t ld_out, const int NT, const int NV,
                           const int SPLIT) {
    (void)SPLIT;
    const v8i m15 = spli(15);
    for (int u = 0; u < NT; u++)
        for (int k = 0; k < NV; k++)
            stf(o + u * ld_out + 8 * k, splat(0.0f));
    for (int64_t b = 0; b < nb; b++) {
        const uint16_t *d = dm + b * 2 * LP_R, *dmin = d + LP_R;
        const uint8_t *smb = sm + b * 16 * LP_R;
        for (int p = 0; p < 4; p++) {
            const uint8_t *q = qs + (b * 128 + p * 32) * LP_R;
            const float *xp = x + b * 256 + p * 64;
            v8f s0[2][8], s1[2][8];
            for (int u = 0; u < NT; u++)
                for (int k = 0; k < NV; k++)
                    s0[u][k] = s1[u][k] = splat(0.0f);
            for (int l = 0; l < 32; l++) {
                v8f xl[2], xh[2];
                for (int u = 0; u < NT; u++) {
                    xl[u] = splat(xp[u * n_in + l]);
                    xh[u] = splat(xp[u * n_in + 32 + l]);
                }
                for (int k = 0; k < NV; k++) {
                    const v8i v = ldu8(q + l * LP_R + 8 * k);
                    const v8f lo = cvt(v & m15), hi = cvt(v >> 4);
                    for (int u = 0; u < NT; u++) {
                        s0[u][k] = fmadd(lo, xl[u], s0[u][k]);
                        s1[u][k] = fmadd(hi, xh[u], s1[u][k]);
                    }
                }
            }
            /* sums of x over the two sub-blocks of 32 */
            v8f x0[2], x1[2];
            for (int u = 0; u < NT; u++) {
                const float *xsu = xs + u * (n_in / 32) + b * 8 + 2 * p;
                x0[u] = splat(xsu[0]);
                x1[u] = splat(xsu[1]);
            }
            for (int k = 0; k < NV; k++) {
                const v8f dk = ldh(d + 8 * k), nk = -ldh(dmin + 8 * k);
                const v8f c0 = dk * cvt(ldu8(smb + (2 * p) * LP_R + 8 * k));
                const v8f c1 = dk * cvt(ldu8(smb + (2 * p + 1) * LP_R + 8 * k));
                const v8f m0 = nk * cvt(ldu8(smb + (8 + 2 * p) * LP_R + 8 * k));
                const v8f m1 = nk * cvt(ldu8(smb + (9 + 2 * p) * LP_R + 8 * k));
                for (int u = 0; u < NT; u++)
                    ACC_UPDATE(fmadd(c0, s0[u][k], fmadd(c1, s1[u][k], fmadd(m0, x0[u], fmadd(m1, x1[u], ACC)))));
            }
        }
    }
}

QMM_INLINE void q6_k_group(const uint8_t *restrict ql, const uint8_t *restrict qh, const int8_t *restrict sc,
                           const uint16_t *restrict dm, int64_t nb, const float *restrict x, int64_t n_in,
                           float *restrict o, int64_t ld_out, const int NT, const int NV,
                           const int SPLIT) {
    (void)SPLIT;
    const v8i m15 = spli(15), m48 = spli(48), k32 = spli(32);
    for (int u = 0; u < NT; u++)
        for (int k = 0; k < NV; k++)
            stf(o + u * ld_out + 8 * k, splat(0.0f));
    for (int64_t b = 0; b < nb; b++) {
        const uint16_t *d = dm + b * LP_R;
        for (int hf = 0; hf < 2; hf++) {
            for (int i = 0; i < 2; i++) {
                const float *xe = x + b * 256 + hf * 128;
                v8f s1[2][8], s2[2][8], s3[2][8], s4[2][8];
                for (int u = 0; u < NT; u++)
                    for (int k = 0; k < NV; k++)
                        s1[u][k] = s2[u][k] = s3[u][k] = s4[u][k] = splat(0.0f);
                for (int l = i * 16; l < i * 16 + 16; l++) {
                    const uint8_t *qa = ql + (b * 128 + hf * 64 + l) * LP_R;
                    const uint8_t *qc = qa + 32 * LP_R;
                    const uint8_t *qq = qh + (b * 64 + hf * 32 + l) * LP_R;
                    for (int k = 0; k < NV; k++) {
                        const v8i a = ldu8(qa + 8 * k), c = ldu8(qc + 8 * k), h = ldu8(qq + 8 * k);
                        const v8f w1 = cvt(((a & m15) | ((h << 4) & m48)) - k32);
                        const v8f w2 = cvt(((c & m15) | ((h << 2) & m48)) - k32);
                        const v8f w3 = cvt(((a >> 4) | (h & m48)) - k32);
                        const v8f w4 = cvt(((c >> 4) | ((h >> 2) & m48)) - k32);
                        for (int u = 0; u < NT; u++) {
                            const float *xu = xe + u * n_in + l;
                            s1[u][k] = fmadd(w1, splat(xu[0]), s1[u][k]);
                            s2[u][k] = fmadd(w2, splat(xu[32]), s2[u][k]);
                            s3[u][k] = fmadd(w3, splat(xu[64]), s3[u][k]);
                            s4[u][k] = fmadd(w4, splat(xu[96]), s4[u][k]);
                        }
                    }
                }
                const int8_t *scb = sc + (b * 16 + hf * 8 + i) * LP_R;
                for (int k = 0; k < NV; k++) {
                    const v8f dk = ldh(d + 8 * k);
                    const v8f c1 = dk * cvt(ldi8(scb + 8 * k));
                    const v8f c2 = dk * cvt(ldi8(scb + 2 * LP_R + 8 * k));
                    const v8f c3 = dk * cvt(ldi8(scb + 4 * LP_R + 8 * k));
                    const v8f c4 = dk * cvt(ldi8(scb + 6 * LP_R + 8 * k));
                    for (int u = 0; u < NT; u++)
                        ACC_UPDATE(fmadd(c1, s1[u][k], fmadd(c2, s2[u][k], fmadd(c3, s3[u][k], fmadd(c4, s4[u][k], ACC)))));
                }
            }
        }
    }
}

/* Tiles [ta, tb): token pairs, then a last single token; groups of 8*NV rows of the tile.
 * NV1 / NV2: row vectors per group for one / two tokens (what the 16 vector registers hold).
 * The group's arguments may use `tile`, `t` and `r0`. */
#define TILE_LOOP(GROUP, CFG, ...) TILE_LOOP_(GROUP, CFG, __VA_ARGS__)
#define TILE_LOOP_(GROUP, NV1, S1, NV2, S2, ...)                                                    \
    _Static_assert(NV1 <= 8 && NV2 <= 8 && LP_R % (8 * NV1) == 0 && LP_R % (8 * NV2) == 0, "NV");    \
    for (int64_t tile = ta; tile < tb; tile++) {                                                    \
        int64_t t = 0;                                                                              \
        for (; t + 2 <= n_tok; t += 2)                                                              \
            for (int64_t r0 = 0; r0 < LP_R; r0 += 8 * (NV2))                                        \
                GROUP(__VA_ARGS__, 2, NV2, S2);                                                     \
        for (; t < n_tok; t++)                                                                      \
            for (int64_t r0 = 0; r0 < LP_R; r0 += 8 * (NV1))                                        \
                GROUP(__VA_ARGS__, 1, NV1, S1);                                                     \
    }

/* (NV1, S1, NV2, S2) of each type: row vectors per group and SPLIT, for one / two tokens at
 * once. 8 to 16 accumulators, what the 16 AVX2 registers hold. Measured on Zen 3 (noisy): all
 * choices within a few % when the matrix is in cache; from DRAM a whole tile per pass (NV1 = 8)
 * is ~10% faster for one token. -D them to experiment. */
#ifndef Q4_0_CFG
#define Q4_0_CFG 8, 0, 4, 0
#endif
#ifndef Q4_1_CFG
#define Q4_1_CFG 8, 0, 4, 0
#endif
#ifndef Q8_0_CFG
#define Q8_0_CFG 8, 0, 4, 0
#endif
#ifndef Q4_K_CFG
#define Q4_K_CFG 4, 0, 2, 0
#endif
#ifndef Q6_K_CFG
#define Q6_K_CFG 2, 0, 1, 0
#endif

/* field 0 of block 0 of `tile`, row r0, in part i (K fields per block); x / out of token t */
#define TP(type, i, K) ((const type *)parts[i] + tile * nb * (K) * LP_R + r0)
#define XT (x + t * n_in)
#define XST (xs + t * (n_in / 32))
#define OT (out + t * ld_out + tile * LP_R + r0)

static void mv_q4_0_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t nb, const float *x,
                          const float *xs, int64_t n_tok, float *out, int64_t ld_out) {
    const int64_t n_in = nb * 32;
    (void)xs;
    TILE_LOOP(q4_0_group, Q4_0_CFG, TP(uint8_t, 0, 16), TP(uint16_t, 1, 1), nb, XT, n_in, OT, ld_out)
}

static void mv_q4_1_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t nb, const float *x,
                          const float *xs, int64_t n_tok, float *out, int64_t ld_out) {
    const int64_t n_in = nb * 32;
    TILE_LOOP(q4_1_group, Q4_1_CFG, TP(uint8_t, 0, 16), TP(uint16_t, 1, 2), nb, XT, XST, n_in, OT, ld_out)
}

static void mv_q8_0_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t nb, const float *x,
                          const float *xs, int64_t n_tok, float *out, int64_t ld_out) {
    const int64_t n_in = nb * 32;
    (void)xs;
    TILE_LOOP(q8_0_group, Q8_0_CFG, TP(int8_t, 0, 32), TP(uint16_t, 1, 1), nb, XT, n_in, OT, ld_out)
}

static void mv_q4_k_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t nb, const float *x,
                          const float *xs, int64_t n_tok, float *out, int64_t ld_out) {
    const int64_t n_in = nb * 256;
    TILE_LOOP(q4_k_group, Q4_K_CFG, TP(uint8_t, 0, 128), TP(uint8_t, 1, 16), TP(uint16_t, 2, 2), nb, XT, XST, n_in, OT,
              ld_out)
}

static void mv_q6_k_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t nb, const float *x,
                          const float *xs, int64_t n_tok, float *out, int64_t ld_out) {
    const int64_t n_in = nb * 256;
    (void)xs;
    TILE_LOOP(q6_k_group, Q6_K_CFG, TP(uint8_t, 0, 128), TP(uint8_t, 1, 64), TP(int8_t, 2, 16), TP(uint16_t, 3, 1), nb,
              XT, n_in, OT, ld_out)
}

/* The exported matvecs. out[t*ld_out + tile*64 + r] = sum_i x[t*n_in + i] * W[tile*64 + r, i]
 * for the tiles [0, n_tiles) and tokens t < n_tok (x is (n_tok, n_in) row-major; out must not
 * overlap x or the weights: it holds the running sums during the call). Threads: see run_tiles.
 * `need_xs`: the type's "m" / "dmin" terms use x's sums over runs of 32 (each thread sums them
 * for itself: n_in/32 floats a token, nothing to share). */
typedef struct {
    tiles_fn fn;
    int need_xs;
    int64_t qk;
    const void *const *parts;
    int64_t n_tiles, nb;
    const float *x;
    int64_t n_tok;
    float *out;
    int64_t ld_out;
} mv_job;

static void mv_par(lp_par *p, const mv_job *j) {
    if (j->n_tiles <= 0 || j->n_tok <= 0)
        return;
    const int64_t n_in = j->nb * j->qk;
    float stack[XS_STACK];
    const float *xs = j->need_xs ? block_sums32(j->x, j->n_tok, n_in, stack) : NULL;
    run_tiles(p, j->fn, j->need_xs, j->parts, j->n_tiles, j->nb, j->x, xs, j->n_tok, j->out, j->ld_out,
              j->n_tiles * LP_R * n_in * j->n_tok);
    if (xs != NULL && xs != stack)
        free((void *)xs);
}

static int64_t mv_job_run(lp_par *p, void *j) {
    mv_par(p, j);
    return 0;
}

/* lp_mv_<t>: on up to n_threads threads of its own; lp_mvp_<t>: a thread of a running team
 * (the executor's records) */
#define MV_EXPORTS(t, need_xs, qk)                                                                                  \
    QMM_API void lp_mvp_##t(lp_par *p, const void *const *parts, int64_t n_tiles, int64_t nb, const float *x,       \
                            int64_t n_tok, float *out, int64_t ld_out) {                                            \
        const mv_job j = {mv_##t##_tiles, need_xs, qk, parts, n_tiles, nb, x, n_tok, out, ld_out};                 \
        mv_par(p, &j);                                                                                              \
    }                                                                                                               \
    QMM_API void lp_mv_##t(const void *const *parts, int64_t n_tiles, int64_t nb, const float *x, int64_t n_tok,    \
                           float *out, int64_t ld_out, int n_threads) {                                             \
        mv_job j = {mv_##t##_tiles, need_xs, qk, parts, n_tiles, nb, x, n_tok, out, ld_out};                       \
        lp_par_run(n_threads, mv_job_run, &j);                                                                      \
    }

MV_EXPORTS(q4_0, 0, 32)
MV_EXPORTS(q4_1, 1, 32)
MV_EXPORTS(q8_0, 0, 32)
MV_EXPORTS(q4_k, 1, 256)
MV_EXPORTS(q6_k, 0, 256)

/* ---------------------------------------------------------------------------------------- */
/* dequantization of whole tiles, transposed (the sgemm operand of prompt processing):       */
/* tiles t0..t1 -> out_t (n_in, ld) row-major, row r of tile `tile` in column (tile-t0)*64+r. */
/* Bit-exact with gguf-py (unfused float32 operations in numpy's order).                     */

typedef void (*dqt_fn)(const void *const *parts, int64_t ta, int64_t tb, int64_t t0, int64_t nb, float *out_t,
                       int64_t ld);

typedef struct {
    dqt_fn fn;
    const void *const *parts;
    int64_t t0, t1, nb;
    float *out_t;
    int64_t ld, work;
} dqt_job;

/* the tiles [t0, t1): on thread 0 alone, or in min(n, 4*nth) chunks handed out dynamically */
static int64_t dqt_job_run(lp_par *p, void *arg) {
    const dqt_job *j = arg;
    const int64_t n_t = j->t1 - j->t0;
    const int par = use_threads(p->nth, n_t, j->work);
    const int64_t nc = !par ? 1 : n_t < 4LL * p->nth ? n_t : 4LL * p->nth;
    for (int64_t c = lp_par_first(p, par, nc); c < nc; c = lp_par_then(p, par, c))
        j->fn(j->parts, j->t0 + c * n_t / nc, j->t0 + (c + 1) * n_t / nc, j->t0, j->nb, j->out_t, j->ld);
    return 0;
}

static void dqt_run(dqt_fn fn, int64_t qk, const void *const *parts, int64_t t0, int64_t t1, int64_t nb,
                    float *out_t, int64_t ld, int n_threads) {
    if (t1 <= t0 || nb <= 0)
        return;
    dqt_job j = {fn, parts, t0, t1, nb, out_t, ld, (t1 - t0) * LP_R * nb * qk * LP_DQ_WEIGHT};
    lp_par_run(n_threads, dqt_job_run, &j);
}

static void dqt_q4_0_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t t0, int64_t nb, float *out_t,
                           int64_t ld) {
    const uint8_t *restrict qs = (const uint8_t *)parts[0];
    const uint16_t *restrict dm = (const uint16_t *)parts[1];
    const v8i m15 = spli(15), k8 = spli(8);
    for (int64_t tile = ta; tile < tb; tile++) {
        float *restrict oc = out_t + (tile - t0) * LP_R;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const uint8_t *q = qs + blk * 16 * LP_R;
            const uint16_t *d = dm + blk * LP_R;
            for (int j = 0; j < 16; j++) {
                float *o0 = oc + (b * 32 + j) * ld, *o1 = o0 + 16 * ld;
                for (int k = 0; k < 8; k++) {
                    const v8i v = ldu8(q + j * LP_R + 8 * k);
                    const v8f dk = ldh(d + 8 * k);
                    stf(o0 + 8 * k, dk * cvt((v & m15) - k8));
                    stf(o1 + 8 * k, dk * cvt((v >> 4) - k8));
                }
            }
        }
    }
}

static void dqt_q4_1_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t t0, int64_t nb, float *out_t,
                           int64_t ld) {
    const uint8_t *restrict qs = (const uint8_t *)parts[0];
    const uint16_t *restrict dm = (const uint16_t *)parts[1];
    const v8i m15 = spli(15);
    for (int64_t tile = ta; tile < tb; tile++) {
        float *restrict oc = out_t + (tile - t0) * LP_R;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const uint8_t *q = qs + blk * 16 * LP_R;
            const uint16_t *d = dm + blk * 2 * LP_R, *m = d + LP_R;
            for (int j = 0; j < 16; j++) {
                float *o0 = oc + (b * 32 + j) * ld, *o1 = o0 + 16 * ld;
                for (int k = 0; k < 8; k++) {
                    const v8i v = ldu8(q + j * LP_R + 8 * k);
                    const v8f dk = ldh(d + 8 * k), mk = ldh(m + 8 * k);
                    stf(o0 + 8 * k, dk * cvt(v & m15) + mk);
                    stf(o1 + 8 * k, dk * cvt(v >> 4) + mk);
                }
            }
        }
    }
}

static void dqt_q8_0_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t t0, int64_t nb, float *out_t,
                           int64_t ld) {
    const int8_t *restrict qs = (const int8_t *)parts[0];
    const uint16_t *restrict dm = (const uint16_t *)parts[1];
    for (int64_t tile = ta; tile < tb; tile++) {
        float *restrict oc = out_t + (tile - t0) * LP_R;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const int8_t *q = qs + blk * 32 * LP_R;
            const uint16_t *d = dm + blk * LP_R;
            for (int j = 0; j < 32; j++) {
                float *o = oc + (b * 32 + j) * ld;
                for (int k = 0; k < 8; k++)
                    stf(o + 8 * k, cvt(ldi8(q + j * LP_R + 8 * k)) * ldh(d + 8 * k));
            }
        }
    }
}

static void dqt_q4_k_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t t0, int64_t nb, float *out_t,
                           int64_t ld) {
    const uint8_t *restrict qs = (const uint8_t *)parts[0];
    const uint8_t *restrict sm = (const uint8_t *)parts[1];
    const uint16_t *restrict dm = (const uint16_t *)parts[2];
    const v8i m15 = spli(15);
    for (int64_t tile = ta; tile < tb; tile++) {
        float *restrict oc = out_t + (tile - t0) * LP_R;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const uint16_t *d = dm + blk * 2 * LP_R, *dmin = d + LP_R;
            const uint8_t *smb = sm + blk * 16 * LP_R;
            for (int p = 0; p < 4; p++) {
                /* d*sc and dmin*mn of the two sub-blocks, as numpy rounds them */
                v8f dl0[8], dl1[8], ml0[8], ml1[8];
                for (int k = 0; k < 8; k++) {
                    const v8f dk = ldh(d + 8 * k), nk = ldh(dmin + 8 * k);
                    dl0[k] = dk * cvt(ldu8(smb + (2 * p) * LP_R + 8 * k));
                    dl1[k] = dk * cvt(ldu8(smb + (2 * p + 1) * LP_R + 8 * k));
                    ml0[k] = nk * cvt(ldu8(smb + (8 + 2 * p) * LP_R + 8 * k));
                    ml1[k] = nk * cvt(ldu8(smb + (9 + 2 * p) * LP_R + 8 * k));
                }
                const uint8_t *q = qs + (blk * 128 + p * 32) * LP_R;
                for (int l = 0; l < 32; l++) {
                    float *o0 = oc + (b * 256 + p * 64 + l) * ld, *o1 = o0 + 32 * ld;
                    for (int k = 0; k < 8; k++) {
                        const v8i v = ldu8(q + l * LP_R + 8 * k);
                        stf(o0 + 8 * k, dl0[k] * cvt(v & m15) - ml0[k]);
                        stf(o1 + 8 * k, dl1[k] * cvt(v >> 4) - ml1[k]);
                    }
                }
            }
        }
    }
}

static void dqt_q6_k_tiles(const void *const *parts, int64_t ta, int64_t tb, int64_t t0, int64_t nb, float *out_t,
                           int64_t ld) {
    const uint8_t *restrict ql = (const uint8_t *)parts[0];
    const uint8_t *restrict qh = (const uint8_t *)parts[1];
    const int8_t *restrict sc = (const int8_t *)parts[2];
    const uint16_t *restrict dm = (const uint16_t *)parts[3];
    const v8i m15 = spli(15), m48 = spli(48), k32 = spli(32);
    for (int64_t tile = ta; tile < tb; tile++) {
        float *restrict oc = out_t + (tile - t0) * LP_R;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const uint16_t *d = dm + blk * LP_R;
            for (int hf = 0; hf < 2; hf++) {
                for (int i = 0; i < 2; i++) {
                    /* d*sc of the 4 sub-blocks of 16 this run of l touches */
                    v8f dl[4][8];
                    const int8_t *scb = sc + (blk * 16 + hf * 8 + i) * LP_R;
                    for (int s = 0; s < 4; s++)
                        for (int k = 0; k < 8; k++)
                            dl[s][k] = ldh(d + 8 * k) * cvt(ldi8(scb + 2 * s * LP_R + 8 * k));
                    for (int l = i * 16; l < i * 16 + 16; l++) {
                        const uint8_t *qa = ql + (blk * 128 + hf * 64 + l) * LP_R;
                        const uint8_t *qc = qa + 32 * LP_R;
                        const uint8_t *qq = qh + (blk * 64 + hf * 32 + l) * LP_R;
                        float *o = oc + (b * 256 + hf * 128 + l) * ld;
                        for (int k = 0; k < 8; k++) {
                            const v8i a = ldu8(qa + 8 * k), c = ldu8(qc + 8 * k), h = ldu8(qq + 8 * k);
                            stf(o + 8 * k, dl[0][k] * cvt(((a & m15) | ((h << 4) & m48)) - k32));
                            stf(o + 32 * ld + 8 * k, dl[1][k] * cvt(((c & m15) | ((h << 2) & m48)) - k32));
                            stf(o + 64 * ld + 8 * k, dl[2][k] * cvt(((a >> 4) | (h & m48)) - k32));
                            stf(o + 96 * ld + 8 * k, dl[3][k] * cvt(((c >> 4) | ((h >> 2) & m48)) - k32));
                        }
                    }
                }
            }
        }
    }
}

QMM_API void lp_dqt_q4_0(const void *const *parts, int64_t t0, int64_t t1, int64_t nb, float *out_t, int64_t ld,
                         int n_threads) {
    dqt_run(dqt_q4_0_tiles, 32, parts, t0, t1, nb, out_t, ld, n_threads);
}

QMM_API void lp_dqt_q4_1(const void *const *parts, int64_t t0, int64_t t1, int64_t nb, float *out_t, int64_t ld,
                         int n_threads) {
    dqt_run(dqt_q4_1_tiles, 32, parts, t0, t1, nb, out_t, ld, n_threads);
}

QMM_API void lp_dqt_q8_0(const void *const *parts, int64_t t0, int64_t t1, int64_t nb, float *out_t, int64_t ld,
                         int n_threads) {
    dqt_run(dqt_q8_0_tiles, 32, parts, t0, t1, nb, out_t, ld, n_threads);
}

QMM_API void lp_dqt_q4_k(const void *const *parts, int64_t t0, int64_t t1, int64_t nb, float *out_t, int64_t ld,
                         int n_threads) {
    dqt_run(dqt_q4_k_tiles, 256, parts, t0, t1, nb, out_t, ld, n_threads);
}

QMM_API void lp_dqt_q6_k(const void *const *parts, int64_t t0, int64_t t1, int64_t nb, float *out_t, int64_t ld,
                         int n_threads) {
    dqt_run(dqt_q6_k_tiles, 256, parts, t0, t1, nb, out_t, ld, n_threads);
}

/* ---------------------------------------------------------------------------------------- */
/* dequantization of selected rows: rows ids[0..n) (row id = tile*64 + r, each < T*64) into   */
/* out (n, n_in) row-major. Row r of a tile is lane r of every (.., 64) run. Bit-exact.        */

QMM_API void lp_dqr_q4_0(const void *const *parts, int64_t nb, const int64_t *ids, int64_t n, float *out) {
    const uint8_t *qs = (const uint8_t *)parts[0];
    const uint16_t *dm = (const uint16_t *)parts[1];
    for (int64_t i = 0; i < n; i++) {
        const int64_t tile = ids[i] / LP_R, r = ids[i] % LP_R;
        float *restrict o = out + i * nb * 32;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const uint8_t *q = qs + blk * 16 * LP_R + r;
            const float d = h2f(dm[blk * LP_R + r]);
            for (int j = 0; j < 16; j++) {
                const int32_t v = q[j * LP_R];
                o[b * 32 + j] = d * (float)((v & 15) - 8);
                o[b * 32 + 16 + j] = d * (float)((v >> 4) - 8);
            }
        }
    }
}

QMM_API void lp_dqr_q4_1(const void *const *parts, int64_t nb, const int64_t *ids, int64_t n, float *out) {
    const uint8_t *qs = (const uint8_t *)parts[0];
    const uint16_t *dm = (const uint16_t *)parts[1];
    for (int64_t i = 0; i < n; i++) {
        const int64_t tile = ids[i] / LP_R, r = ids[i] % LP_R;
        float *restrict o = out + i * nb * 32;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const uint8_t *q = qs + blk * 16 * LP_R + r;
            const float d = h2f(dm[blk * 2 * LP_R + r]), m = h2f(dm[blk * 2 * LP_R + LP_R + r]);
            for (int j = 0; j < 16; j++) {
                const int32_t v = q[j * LP_R];
                o[b * 32 + j] = d * (float)(v & 15) + m;
                o[b * 32 + 16 + j] = d * (float)(v >> 4) + m;
            }
        }
    }
}

QMM_API void lp_dqr_q8_0(const void *const *parts, int64_t nb, const int64_t *ids, int64_t n, float *out) {
    const int8_t *qs = (const int8_t *)parts[0];
    const uint16_t *dm = (const uint16_t *)parts[1];
    for (int64_t i = 0; i < n; i++) {
        const int64_t tile = ids[i] / LP_R, r = ids[i] % LP_R;
        float *restrict o = out + i * nb * 32;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const int8_t *q = qs + blk * 32 * LP_R + r;
            const float d = h2f(dm[blk * LP_R + r]);
            for (int j = 0; j < 32; j++)
                o[b * 32 + j] = (float)q[j * LP_R] * d;
        }
    }
}

QMM_API void lp_dqr_q4_k(const void *const *parts, int64_t nb, const int64_t *ids, int64_t n, float *out) {
    const uint8_t *qs = (const uint8_t *)parts[0];
    const uint8_t *sm = (const uint8_t *)parts[1];
    const uint16_t *dm = (const uint16_t *)parts[2];
    for (int64_t i = 0; i < n; i++) {
        const int64_t tile = ids[i] / LP_R, r = ids[i] % LP_R;
        float *restrict o = out + i * nb * 256;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const float d = h2f(dm[blk * 2 * LP_R + r]), dmin = h2f(dm[blk * 2 * LP_R + LP_R + r]);
            const uint8_t *s = sm + blk * 16 * LP_R + r;
            for (int p = 0; p < 4; p++) {
                const float d0 = d * (float)s[(2 * p) * LP_R], d1 = d * (float)s[(2 * p + 1) * LP_R];
                const float n0 = dmin * (float)s[(8 + 2 * p) * LP_R], n1 = dmin * (float)s[(9 + 2 * p) * LP_R];
                const uint8_t *q = qs + (blk * 128 + p * 32) * LP_R + r;
                float *op = o + b * 256 + p * 64;
                for (int l = 0; l < 32; l++) {
                    const int32_t v = q[l * LP_R];
                    op[l] = d0 * (float)(v & 15) - n0;
                    op[32 + l] = d1 * (float)(v >> 4) - n1;
                }
            }
        }
    }
}

QMM_API void lp_dqr_q6_k(const void *const *parts, int64_t nb, const int64_t *ids, int64_t n, float *out) {
    const uint8_t *ql = (const uint8_t *)parts[0];
    const uint8_t *qh = (const uint8_t *)parts[1];
    const int8_t *sc = (const int8_t *)parts[2];
    const uint16_t *dm = (const uint16_t *)parts[3];
    for (int64_t i = 0; i < n; i++) {
        const int64_t tile = ids[i] / LP_R, r = ids[i] % LP_R;
        float *restrict o = out + i * nb * 256;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = tile * nb + b;
            const float d = h2f(dm[blk * LP_R + r]);
            for (int hf = 0; hf < 2; hf++) {
                for (int i2 = 0; i2 < 2; i2++) {
                    const int8_t *s = sc + (blk * 16 + hf * 8 + i2) * LP_R + r;
                    const float d1 = d * (float)s[0], d2 = d * (float)s[2 * LP_R];
                    const float d3 = d * (float)s[4 * LP_R], d4 = d * (float)s[6 * LP_R];
                    float *oe = o + b * 256 + hf * 128;
                    for (int l = i2 * 16; l < i2 * 16 + 16; l++) {
                        const int32_t a = ql[(blk * 128 + hf * 64 + l) * LP_R + r];
                        const int32_t c = ql[(blk * 128 + hf * 64 + 32 + l) * LP_R + r];
                        const int32_t h = qh[(blk * 64 + hf * 32 + l) * LP_R + r];
                        oe[l] = d1 * (float)(((a & 15) | ((h & 3) << 4)) - 32);
                        oe[32 + l] = d2 * (float)(((c & 15) | ((h & 12) << 2)) - 32);
                        oe[64 + l] = d3 * (float)(((a >> 4) | (h & 48)) - 32);
                        oe[96 + l] = d4 * (float)(((c >> 4) | ((h & 192) >> 2)) - 32);
                    }
                }
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* MUL_MAT with quantized activations on the file's block layout (lp_quants.h's entry points) */
/*                                                                                          */
/* ggml counterpart: ggml-cpu.c ggml_compute_forward_mul_mat: the activations are converted  */
/* once into the weight type's vec_dot_type, then every output is one vec_dot of a weight row */
/* and an activation row. Threads split the rows (never the tokens: a decode step has one),  */
/* in chunks handed out dynamically so that a thread that is descheduled does not hold the   */
/* others up. The K types' kernels come from kquants.c; their references are weak, so a      */
/* library built without that file reports those types as unsupported (lp_vec_dot_type -1)  */
/* and the caller keeps its float32-activation path for them.                                */

#include "lp_quants.h"

#pragma weak lp_quantize_row_q8_K
#pragma weak lp_vec_dot_q2_K_q8_K
#pragma weak lp_vec_dot_q3_K_q8_K
#pragma weak lp_vec_dot_q4_K_q8_K
#pragma weak lp_vec_dot_q5_K_q8_K
#pragma weak lp_vec_dot_q6_K_q8_K

/* the optional multi-column kernels (lp_quants.h, LP_GEMM_COLS): NULL where a type has none */
#pragma weak lp_gemm_f32
#pragma weak lp_gemm_f16
#pragma weak lp_gemm_bf16
#pragma weak lp_gemm_f32_panel
#pragma weak lp_gemv_f32
#pragma weak lp_gemm_f16_panel
#pragma weak lp_gemm_bf16_panel
#pragma weak lp_gemm_q4_0_q8_0
#pragma weak lp_gemm_q5_0_q8_0
#pragma weak lp_gemm_q8_0_q8_0
#pragma weak lp_gemm_q4_1_q8_1
#pragma weak lp_gemm_q5_1_q8_1
#pragma weak lp_gemm_q2_K_q8_K
#pragma weak lp_gemm_q3_K_q8_K
#pragma weak lp_gemm_q4_K_q8_K
#pragma weak lp_gemm_q5_K_q8_K
#pragma weak lp_gemm_q6_K_q8_K
#pragma weak lp_gemv_q4_0_q8_0
#pragma weak lp_gemv_q5_0_q8_0
#pragma weak lp_gemv_q4_1_q8_1
#pragma weak lp_gemv_q5_1_q8_1
#pragma weak lp_gemv_q8_0_q8_0
#pragma weak lp_gemv_q2_K_q8_K
#pragma weak lp_gemv_q3_K_q8_K
#pragma weak lp_gemv_q4_K_q8_K
#pragma weak lp_gemv_q5_K_q8_K
#pragma weak lp_gemv_q6_K_q8_K
void lp_gemv_q4_0_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q5_0_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q4_1_q8_1(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q5_1_q8_1(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q8_0_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q2_K_q8_K(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q3_K_q8_K(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q4_K_q8_K(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q5_K_q8_K(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_q6_K_q8_K(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemm_f32(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_f16(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_bf16(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemv_f32(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemm_f32_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_f16_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_bf16_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q4_0_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q5_0_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q8_0_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q4_1_q8_1(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q5_1_q8_1(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q2_K_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q3_K_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q4_K_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q5_K_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q6_K_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
/* the q types' single-row variants (quants.c GK_DEFINE): for a decode batch's weights, streamed
 * from memory once, where rows in pairs are slower */
#pragma weak lp_gemm_q5_0_q8_0_r1
#pragma weak lp_gemm_q8_0_q8_0_r1
#pragma weak lp_gemm_q4_1_q8_1_r1
#pragma weak lp_gemm_q5_1_q8_1_r1
void lp_gemm_q5_0_q8_0_r1(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q8_0_q8_0_r1(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q4_1_q8_1_r1(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q5_1_q8_1_r1(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
/* the q types' prompt kernels (quants.c GP_DEFINE, AVX-512 and AVX2): any nc, a thread's whole range of
 * rows and every token of the call at once */
#pragma weak lp_gemm_q5_0_q8_0_panel
#pragma weak lp_gemm_q8_0_q8_0_panel
#pragma weak lp_gemm_q4_1_q8_1_panel
#pragma weak lp_gemm_q5_1_q8_1_panel
void lp_gemm_q5_0_q8_0_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q8_0_q8_0_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q4_1_q8_1_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_q5_1_q8_1_panel(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);

/* the MoE models' types (iquants.c): every kernel there, referenced weakly as the K types' */
#pragma weak lp_vec_dot_iq4_nl_q8_0
#pragma weak lp_vec_dot_mxfp4_q8_0
#pragma weak lp_vec_dot_iq4_xs_q8_K
#pragma weak lp_gemm_iq4_nl_q8_0
#pragma weak lp_gemm_mxfp4_q8_0
#pragma weak lp_gemm_iq4_xs_q8_K
#pragma weak lp_gemv_iq4_nl_q8_0
#pragma weak lp_gemv_mxfp4_q8_0
#pragma weak lp_gemv_iq4_xs_q8_K
void lp_vec_dot_iq4_nl_q8_0(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_mxfp4_q8_0(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_iq4_xs_q8_K(int n, float *s, const void *vx, const void *vy);
void lp_gemm_iq4_nl_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_mxfp4_q8_0(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemm_iq4_xs_q8_K(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x, int64_t x_bytes, int nc);
void lp_gemv_iq4_nl_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_mxfp4_q8_0(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);
void lp_gemv_iq4_xs_q8_K(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);

/* Rows a thread takes at once (output columns of one chunk), and the rows of a cache block:
 * for prompts, MM_ROW_BLOCK weight rows stay in L1 while every token's activations pass by. */
#define MM_ROW_BLOCK 16
/* rows a gemv takes at once when it runs once per token (mm_rows): 128 rows of the 1B shape's
 * 8192-wide Q4_K are 590 KB, in L2 for the next token. With threads a K type's chunk is
 * MM_ROW_BLOCK_K rows already (64 on AVX-512, 16 on AVX2) on matrices of 2 nth such blocks; one
 * thread, a smaller matrix, or Q8_0 (~4 chunks a thread) has its range cut here. */
#define MM_GEMV_ROWS 128
/* the K types' gemms (any column count, lp_quants.h) take this many rows a call: the AVX-512
 * ones prepare their activations once a call for all its rows (measured ~+15% over 16 rows) */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define MM_ROW_BLOCK_K 64
#else
#define MM_ROW_BLOCK_K MM_ROW_BLOCK
#endif

/* tokens from which the q types take their prompt kernel (gemm_panel). AVX2's 2-row tile beats the
 * 4-column kernel from ~12 tokens on SmolLM2's matrices (in cache) and from 16-64 on the 1B shape's
 * (streamed from memory; 8 tokens 6.2 vs 7.7 ms); AVX-512's 8-row tile from 5 (quants.c). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define MM_PANEL_MIN (LP_GEMM_COLS + 1)
#else
#define MM_PANEL_MIN 16
#endif

typedef void (*mm_quantize_fn)(const float *x, void *y, int64_t k);

typedef struct {
    int vec_dot_type;
    int64_t blck, act_bsize; /* activation block: elements, bytes */
    mm_quantize_fn quantize;
    lp_vec_dot_fn dot;
    lp_gemm_fn gemm; /* NULL: one dot per output */
    lp_gemm_fn gemm_r1; /* NULL: gemm; else the same outputs, weight rows one at a time */
    lp_gemv_fn gemv;    /* one token over many rows; NULL: one dot per row */
    int gemm_cols;      /* the most columns gemm takes a call (set after the initializer) */
    lp_gemm_fn gemm_panel; /* NULL, or any nc over a whole range of rows: prompts (set after it) */
    int gemv_cols;         /* up to this many tokens, one gemv a token (set after it; 0: never) */
    int panel_min;         /* tokens from which gemm_panel runs (set after it) */
} mm_traits;

static void mm_copy_f32(const float *x, void *y, int64_t k) { memcpy(y, x, (size_t)k * sizeof(float)); }

static void mm_to_f16(const float *x, void *vy, int64_t k) {
    lp_half *y = vy;
    for (int64_t i = 0; i < k; i++) y[i] = lp_f2h(x[i]);
}

static void mm_to_bf16(const float *x, void *vy, int64_t k) {
    lp_bf16 *y = vy;
    for (int64_t i = 0; i < k; i++) y[i] = lp_f2bf(x[i]);
}

/* 0 and the type's traits, or -1 when this library has no kernel for it */
static int mm_traits_of(int type, mm_traits *t) {
    const mm_quantize_fn q8_K = lp_quantize_row_q8_K; /* NULL without kquants.c */
    switch (type) {
    case LP_TYPE_F32: *t = (mm_traits){LP_TYPE_F32, 1, 4, mm_copy_f32, lp_vec_dot_f32, lp_gemm_f32, NULL, lp_gemv_f32}; break;
    case LP_TYPE_F16: *t = (mm_traits){LP_TYPE_F16, 1, 2, mm_to_f16, lp_vec_dot_f16, lp_gemm_f16}; break;
    case LP_TYPE_BF16: *t = (mm_traits){LP_TYPE_BF16, 1, 2, mm_to_bf16, lp_vec_dot_bf16, lp_gemm_bf16}; break;
    case LP_TYPE_Q5_0: *t = (mm_traits){LP_TYPE_Q8_0, QK8_0, sizeof(block_q8_0), lp_quantize_row_q8_0, lp_vec_dot_q5_0_q8_0, lp_gemm_q5_0_q8_0, lp_gemm_q5_0_q8_0_r1, lp_gemv_q5_0_q8_0}; break;
    case LP_TYPE_Q8_0: *t = (mm_traits){LP_TYPE_Q8_0, QK8_0, sizeof(block_q8_0), lp_quantize_row_q8_0, lp_vec_dot_q8_0_q8_0, lp_gemm_q8_0_q8_0, lp_gemm_q8_0_q8_0_r1, lp_gemv_q8_0_q8_0}; break;
    case LP_TYPE_Q4_1: *t = (mm_traits){LP_TYPE_Q8_1, QK8_1, sizeof(block_q8_1), lp_quantize_row_q8_1, lp_vec_dot_q4_1_q8_1, lp_gemm_q4_1_q8_1, lp_gemm_q4_1_q8_1_r1, lp_gemv_q4_1_q8_1}; break;
    case LP_TYPE_Q5_1: *t = (mm_traits){LP_TYPE_Q8_1, QK8_1, sizeof(block_q8_1), lp_quantize_row_q8_1, lp_vec_dot_q5_1_q8_1, lp_gemm_q5_1_q8_1, lp_gemm_q5_1_q8_1_r1, lp_gemv_q5_1_q8_1}; break;
    case LP_TYPE_Q2_K: *t = (mm_traits){LP_TYPE_Q8_K, QK_K, sizeof(block_q8_K), q8_K, lp_vec_dot_q2_K_q8_K, lp_gemm_q2_K_q8_K, NULL, lp_gemv_q2_K_q8_K}; break;
    case LP_TYPE_Q3_K: *t = (mm_traits){LP_TYPE_Q8_K, QK_K, sizeof(block_q8_K), q8_K, lp_vec_dot_q3_K_q8_K, lp_gemm_q3_K_q8_K, NULL, lp_gemv_q3_K_q8_K}; break;
    case LP_TYPE_Q4_K: *t = (mm_traits){LP_TYPE_Q8_K, QK_K, sizeof(block_q8_K), q8_K, lp_vec_dot_q4_K_q8_K, lp_gemm_q4_K_q8_K, NULL, lp_gemv_q4_K_q8_K}; break;
    case LP_TYPE_Q5_K: *t = (mm_traits){LP_TYPE_Q8_K, QK_K, sizeof(block_q8_K), q8_K, lp_vec_dot_q5_K_q8_K, lp_gemm_q5_K_q8_K, NULL, lp_gemv_q5_K_q8_K}; break;
    case LP_TYPE_Q6_K: *t = (mm_traits){LP_TYPE_Q8_K, QK_K, sizeof(block_q8_K), q8_K, lp_vec_dot_q6_K_q8_K, lp_gemm_q6_K_q8_K, NULL, lp_gemv_q6_K_q8_K}; break;
    /* (Q4_0, IQ4_NL, MXFP4, IQ4_XS: iquants.c, 2-4 tokens in one call over the range, the activations prepared once) */
    case LP_TYPE_Q4_0: *t = (mm_traits){LP_TYPE_Q8_0, QK8_0, sizeof(block_q8_0), lp_quantize_row_q8_0, lp_vec_dot_q4_0_q8_0, lp_gemm_q4_0_q8_0, lp_gemm_q4_0_q8_0, lp_gemv_q4_0_q8_0}; break;
    case LP_TYPE_IQ4_NL: *t = (mm_traits){LP_TYPE_Q8_0, QK8_0, sizeof(block_q8_0), lp_quantize_row_q8_0, lp_vec_dot_iq4_nl_q8_0, lp_gemm_iq4_nl_q8_0, lp_gemm_iq4_nl_q8_0, lp_gemv_iq4_nl_q8_0}; break;
    case LP_TYPE_MXFP4: *t = (mm_traits){LP_TYPE_Q8_0, QK8_0, sizeof(block_q8_0), lp_quantize_row_q8_0, lp_vec_dot_mxfp4_q8_0, lp_gemm_mxfp4_q8_0, lp_gemm_mxfp4_q8_0, lp_gemv_mxfp4_q8_0}; break;
    case LP_TYPE_IQ4_XS: *t = (mm_traits){LP_TYPE_Q8_K, QK_K, sizeof(block_q8_K), q8_K, lp_vec_dot_iq4_xs_q8_K, lp_gemm_iq4_xs_q8_K, lp_gemm_iq4_xs_q8_K, lp_gemv_iq4_xs_q8_K}; break;
    default: return -1;
    }
    t->gemm_cols = type == LP_TYPE_Q3_K || type == LP_TYPE_Q4_K || type == LP_TYPE_Q5_K || type == LP_TYPE_Q6_K
                           || type == LP_TYPE_Q4_0 || type == LP_TYPE_IQ4_NL || type == LP_TYPE_MXFP4 || type == LP_TYPE_IQ4_XS /* iquants.c: any nc, a panel */
                       ? LP_GEMM_COLS_K : LP_GEMM_COLS;
    /* 2..gemv_cols tokens: gemv a token over rows kept in cache beats the K types' multi-column
     * kernels (their 8-column row kernel only from 8 tokens on AVX-512). Measured on the 1B shape's
     * 16 ffn_down (8192 wide, ~150 MB), 2 threads, ms old -> new (bench/RESULTS.md, stop 22):
     *   AVX-512 Q4_K 2 / 4 / 6 tokens 8.3 / 18.9 / 26.5 -> 5.1 / 9.7 / 14.4, 8 tokens 11.0 -> 19.9;
     *           Q6_K 4 / 7 19.3 / 23.7 -> 11.0 / 16.2; Q2_K 2 / 4 / 7 4.6 / 9.6 / 15.0 -> 3.4 / 6.8 / 12.2;
     *   AVX2    Q4_K 2 / 4 / 6 12.0 / 15.7 / 24.2 -> 9.8 / 14.0 / 21.3, 8 tokens 27.5 -> 28.3;
     *           Q6_K 4 / 6 23.5 / 28.8 -> 18.1 / 24.3, 2 tokens 7.0 -> 7.8; Q2_K 2 11.0 -> 7.2, 4 11.0 -> 13.2;
     *           Q8_0 (its AVX2 gemv a vec_dot a row then) 2 / 4 tokens 17.5 / 27.4 -> 14.3 / 23.9, 5: 32.2 -> 32.5;
     *           Q5_K (stop 32, llamapy bench of the 1B --pure file, tok/s) pp2 26.3 -> 33.7, pp4 50.9 -> 38.6;
     *           Q3_K (the same) pp2 34.7 -> 36.1, pp4 53.6 -> 41.2 (its AVX-512 build runs the same AVX2
     *           code for both: 2 there too, unmeasured); IQ4_XS (its 4-row gemv since stop 32) pp2
     *           20.5 -> 32.7, pp3 25.9 -> 33.0, pp4 38.5 -> 35.0 (on AVX-512 its gemm takes 1-4 tokens
     *           with its gemv's kernel: 0).
     * The other types' multi-column decode kernels beat it (AVX-512 Q4_1 at 4 tokens 11.9 vs 20.0). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    t->gemv_cols = t->gemv == NULL || t->vec_dot_type != LP_TYPE_Q8_K || type == LP_TYPE_IQ4_XS ? 0
                 : type == LP_TYPE_Q3_K ? 2 : 7;
#else
    t->gemv_cols = t->gemv == NULL ? 0 : type == LP_TYPE_Q8_0 ? 4 : t->vec_dot_type != LP_TYPE_Q8_K ? 0
                 : type == LP_TYPE_Q2_K || type == LP_TYPE_Q3_K || type == LP_TYPE_Q5_K ? 2 : type == LP_TYPE_IQ4_XS ? 3 : 6;
#endif
    t->gemm_panel = type == LP_TYPE_Q4_1 ? lp_gemm_q4_1_q8_1_panel
                  : type == LP_TYPE_Q5_0 ? lp_gemm_q5_0_q8_0_panel : type == LP_TYPE_Q5_1 ? lp_gemm_q5_1_q8_1_panel
                  : type == LP_TYPE_Q8_0 ? lp_gemm_q8_0_q8_0_panel
                  /* (iquants.c's gemms take a whole range of rows too: the offset sums made once) */
                  : type == LP_TYPE_Q4_0 || type == LP_TYPE_IQ4_NL || type == LP_TYPE_MXFP4 ? t->gemm
                  /* (the float types: quants.c's fk_panel, 2 x 2 tiles over float32 activations) */
                  : type == LP_TYPE_F32 ? lp_gemm_f32_panel : type == LP_TYPE_F16 ? lp_gemm_f16_panel
                  : type == LP_TYPE_BF16 ? lp_gemm_bf16_panel : NULL;
    /* iquants.c's from 5 tokens on AVX2 too (its decode kernel takes up to 4): in one call the
     * activations' offset sums are made once, not once per MM_ROW_BLOCK rows (1B Q4_0, 2 threads:
     * pp5 45.5 -> 48.0, pp8 57.5 -> 62.5, pp12 67.6 -> 71.5 tok/s) */
    /* f16 / bf16 from 8 tokens: the panel converts the activations once where the 4-column kernel
     * converts them for every row (AVX2, SmolLM2 F16, 2 threads: pp8 222 -> 246, pp12 232 -> 263
     * tok/s; from 2 tokens it lost below 4, as F32's, which converts nothing, did up to 12) */
    t->panel_min = t->gemm_panel == t->gemm ? LP_GEMM_COLS + 1
                 : (type == LP_TYPE_F16 || type == LP_TYPE_BF16) && MM_PANEL_MIN > 8 ? 8 : MM_PANEL_MIN;
    return t->quantize != NULL && t->dot != NULL ? 0 : -1;
}

QMM_API int lp_vec_dot_type(int ggml_type) {
    mm_traits t;
    return mm_traits_of(ggml_type, &t) == 0 ? t.vec_dot_type : -1;
}

QMM_API int64_t lp_act_row_bytes(int ggml_type, int64_t n_in) {
    mm_traits t;
    if (mm_traits_of(ggml_type, &t) != 0 || n_in % t.blck) return -1;
    return n_in / t.blck * t.act_bsize;
}

/* this thread's rows of a (n_tok, n_in) activation: a static share when the work is big enough,
 * else all of them on thread 0 */
static void act_rows(const lp_par *p, int64_t n_tok, int64_t n_in, int64_t *a, int64_t *b) {
    if (use_threads(p->nth, n_tok, n_tok * n_in * 4)) {
        lp_par_range(p, n_tok, a, b);
    } else {
        *a = 0;
        *b = p->ith == 0 ? n_tok : 0;
    }
}

/* x (n_tok rows, stride ld_x) into the weight type's vec_dot_type rows of xq; 0, or -1 for a
 * type without quantized products. A thread of a running team (the executor's records). */
int lp_quantize_act_par(lp_par *p, int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok,
                        void *xq) {
    mm_traits t;
    if (mm_traits_of(ggml_type, &t) != 0 || n_in % t.blck) return -1;
    const int64_t rb = n_in / t.blck * t.act_bsize;
    int64_t a, b;
    act_rows(p, n_tok, n_in, &a, &b);
    for (int64_t i = a; i < b; i++) t.quantize(x + i * ld_x, (uint8_t *)xq + i * rb, n_in);
    return 0;
}

/* the arguments of lp_quantize_act and lp_round_act (out: xq, or the rounded floats) */
typedef struct {
    int type;
    const float *x;
    int64_t ld_x, n_in, n_tok;
    void *out;
    int64_t ld_out;
} act_job;

static int64_t quantize_act_run(lp_par *p, void *arg) {
    const act_job *j = arg;
    return lp_quantize_act_par(p, j->type, j->x, j->ld_x, j->n_in, j->n_tok, j->out);
}

QMM_API int lp_quantize_act(int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok, void *xq,
                            int n_threads) {
    act_job j = {ggml_type, x, ld_x, n_in, n_tok, xq, 0};
    return lp_par_run(n_threads, quantize_act_run, &j) ? -1 : 0;
}

/* rows [r0, r1) of y for every token: MM_ROW_BLOCK rows against all tokens at a time, in
 * groups of gemm_cols tokens where the type has a multi-column kernel */
static void mm_rows(const mm_traits *t, const uint8_t *w, int64_t r0, int64_t r1, int64_t row_bytes, int n_in,
                    const uint8_t *xq, int64_t act_bytes, int64_t n_tok, float *y, int64_t ld_y) {
    if (n_tok == 1 && t->gemv != NULL) { /* decode: the whole range, its activation prepared once */
        t->gemv(n_in, y + r0, w + r0 * row_bytes, row_bytes, (int)(r1 - r0), xq);
        return;
    }
    if (n_tok > 1 && n_tok <= t->gemv_cols) {
        /* a few tokens (a decode batch) on a K type, or Q8_0 on AVX2: its gemv once per token over
         * MM_GEMV_ROWS rows at a time, which stay in L2 for the other tokens (see gemv_cols) */
        for (int64_t rb = r0; rb < r1; rb += MM_GEMV_ROWS) {
            const int64_t re = rb + MM_GEMV_ROWS < r1 ? rb + MM_GEMV_ROWS : r1;
            for (int64_t k = 0; k < n_tok; k++)
                t->gemv(n_in, y + k * ld_y + rb, w + rb * row_bytes, row_bytes, (int)(re - rb), xq + k * act_bytes);
        }
        return;
    }
    if (n_tok >= t->panel_min && t->gemm_panel != NULL) { /* a prompt: the range's rows decoded once */
        t->gemm_panel(n_in, y + r0, ld_y, w + r0 * row_bytes, row_bytes, (int)(r1 - r0), xq, act_bytes, (int)n_tok);
        return;
    }
    if (n_tok > 1 && n_tok <= LP_GEMM_COLS && t->gemm_r1 != NULL) {
        /* a decode batch: the whole range in one call, its columns prepared once (per 16 rows the
         * AVX-512 kernel's preparation was ~20 % of the work at 576 inputs) */
        t->gemm_r1(n_in, y + r0, ld_y, w + r0 * row_bytes, row_bytes, (int)(r1 - r0), xq, act_bytes, (int)n_tok);
        return;
    }
    const int64_t rblk = t->gemm != NULL && n_tok > 1 && t->gemm_cols > LP_GEMM_COLS ? MM_ROW_BLOCK_K : MM_ROW_BLOCK;
    for (int64_t rb = r0; rb < r1; rb += rblk) {
        const int64_t re = rb + rblk < r1 ? rb + rblk : r1;
        if (t->gemm != NULL && n_tok > 1) {
            /* one column group: these rows are read once, from memory (see gemm_r1) */
            const lp_gemm_fn gemm = n_tok <= t->gemm_cols && t->gemm_r1 != NULL ? t->gemm_r1 : t->gemm;
            for (int64_t k = 0; k < n_tok; k += t->gemm_cols) {
                const int nc = (int)(n_tok - k < t->gemm_cols ? n_tok - k : t->gemm_cols);
                gemm(n_in, y + k * ld_y + rb, ld_y, w + rb * row_bytes, row_bytes, (int)(re - rb),
                     xq + k * act_bytes, act_bytes, nc);
            }
            continue;
        }
        for (int64_t k = 0; k < n_tok; k++) {
            const uint8_t *xk = xq + k * act_bytes;
            float *yk = y + k * ld_y;
            for (int64_t r = rb; r < re; r++) t->dot(n_in, yk + r, w + r * row_bytes, xk);
        }
    }
}

/* y (n_tok, ld_y) = xq . W^T over W's n_rows rows; 0, or -1 for a type without quantized
 * products. A thread of a running team (the executor's records). */
int lp_mul_mat_q_par(lp_par *p, int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in,
                     const void *xq, int64_t n_tok, float *y, int64_t ld_y) {
    mm_traits t;
    if (mm_traits_of(ggml_type, &t) != 0 || n_in % t.blck || n_in > INT32_MAX) return -1;
    const int64_t act_bytes = n_in / t.blck * t.act_bsize;
    if (n_rows <= 0 || n_tok <= 0) return 0;
    const int nth = p->nth;
    const int par = use_threads(nth, (n_rows + MM_ROW_BLOCK - 1) / MM_ROW_BLOCK, n_rows * n_in * n_tok);
    /* ~4 chunks a thread, whole row blocks each: both cores busy on 576 rows (36 blocks); a
     * prompt on the K types' gemms with rows for 2 calls a thread: one chunk per MM_ROW_BLOCK_K
     * rows (the gemm's call), so that a thread slowed down by others leaves at most one such
     * call to wait for. One thread: one chunk. */
    const int64_t unit = par && t.gemm != NULL && n_tok > 1 && t.gemm_cols > LP_GEMM_COLS &&
                                 n_rows >= 2LL * nth * MM_ROW_BLOCK_K
                             ? MM_ROW_BLOCK_K
                             : MM_ROW_BLOCK;
    const int64_t n_units = (n_rows + unit - 1) / unit;
    const int64_t n_chunk = !par ? 1 : unit == MM_ROW_BLOCK ? 4LL * nth : n_units;
    const int64_t nc = n_units < n_chunk ? n_units : n_chunk;
    for (int64_t c = lp_par_first(p, par, nc); c < nc; c = lp_par_then(p, par, c)) {
        const int64_t a = c * n_units / nc * unit, b0 = (c + 1) * n_units / nc * unit;
        const int64_t b = b0 < n_rows ? b0 : n_rows;
        mm_rows(&t, w, a, b, row_bytes, (int)n_in, xq, act_bytes, n_tok, y, ld_y);
    }
    return 0;
}

typedef struct {
    int type;
    const void *w;
    int64_t n_rows, row_bytes, n_in;
    const void *xq;
    int64_t n_tok;
    float *y;
    int64_t ld_y;
} mm_job;

static int64_t mul_mat_q_run(lp_par *p, void *arg) {
    const mm_job *j = arg;
    return lp_mul_mat_q_par(p, j->type, j->w, j->n_rows, j->row_bytes, j->n_in, j->xq, j->n_tok, j->y, j->ld_y);
}

QMM_API int lp_mul_mat_q(int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in,
                         const void *xq, int64_t n_tok, float *y, int64_t ld_y, int n_threads) {
    mm_job j = {ggml_type, w, n_rows, row_bytes, n_in, xq, n_tok, y, ld_y};
    return lp_par_run(n_threads, mul_mat_q_run, &j) ? -1 : 0;
}

/* x rounded to what the vec_dot kernels see: quantized to the vec_dot_type and expanded back to
 * float32 (exactly: d * q, f16 or bf16 values), for products big enough for sgemm on expanded
 * weights, which then computes the same sums as lp_mul_mat up to the float32 summation order. */
static void mm_round_row(const mm_traits *t, const float *x, int64_t n_in, float *out) {
    uint8_t buf[sizeof(block_q8_K)];
    for (int64_t b = 0; b < n_in; b += t->blck) {
        const float *xb = x + b;
        float *ob = out + b;
        switch (t->vec_dot_type) {
        case LP_TYPE_F32: memcpy(ob, xb, (size_t)t->blck * sizeof(float)); break;
        case LP_TYPE_F16: ob[0] = lp_h2f(lp_f2h(xb[0])); break;
        case LP_TYPE_BF16: ob[0] = lp_bf2f(lp_f2bf(xb[0])); break;
        case LP_TYPE_Q8_0: {
            t->quantize(xb, buf, QK8_0);
            const block_q8_0 *q = (const block_q8_0 *)buf;
            const float d = lp_h2f(q->d);
            for (int j = 0; j < QK8_0; j++) ob[j] = d * (float)q->qs[j];
            break;
        }
        case LP_TYPE_Q8_1: {
            t->quantize(xb, buf, QK8_1);
            const block_q8_1 *q = (const block_q8_1 *)buf;
            const float d = lp_h2f(q->d);
            for (int j = 0; j < QK8_1; j++) ob[j] = d * (float)q->qs[j];
            break;
        }
        case LP_TYPE_Q8_K: {
            t->quantize(xb, buf, QK_K);
            const block_q8_K *q = (const block_q8_K *)buf;
            for (int j = 0; j < QK_K; j++) ob[j] = q->d * (float)q->qs[j];
            break;
        }
        }
    }
}

static int64_t round_act_run(lp_par *p, void *arg) {
    const act_job *j = arg;
    mm_traits t;
    if (mm_traits_of(j->type, &t) != 0 || j->n_in % t.blck) return -1;
    int64_t a, b;
    act_rows(p, j->n_tok, j->n_in, &a, &b);
    for (int64_t i = a; i < b; i++) mm_round_row(&t, j->x + i * j->ld_x, j->n_in, (float *)j->out + i * j->ld_out);
    return 0;
}

QMM_API int lp_round_act(int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok, float *out,
                         int64_t ld_out, int n_threads) {
    act_job j = {ggml_type, x, ld_x, n_in, n_tok, out, ld_out};
    return lp_par_run(n_threads, round_act_run, &j) ? -1 : 0;
}

QMM_API int lp_mul_mat(int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in,
                       const float *x, int64_t ld_x, int64_t n_tok, float *y, int64_t ld_y, void *wsp, int n_threads) {
    if (lp_quantize_act(ggml_type, x, ld_x, n_in, n_tok, wsp, n_threads) != 0) return -1;
    return lp_mul_mat_q(ggml_type, w, n_rows, row_bytes, n_in, wsp, n_tok, y, ld_y, n_threads);
}

/* MUL_MAT_ID with quantized activations (ggml-cpu's ggml_compute_forward_mul_mat_id): y (T, U, M)
 * where slot u of token t is row (t, u or 0) of xq (T, ux, act bytes; ux 1: one row for all of a
 * token's slots) times the matrix of expert ids[t, u] (rows ids*M .. of w, the experts stacked).
 * Thread 0 groups the (token, slot) pairs by expert (experts in order, each one's pairs in token
 * order: ggml's matrix_rows) and gathers their activation rows; then each chosen expert's rows
 * multiply, once, all the rows that chose it (mm_rows over chunks of its rows, handed out across
 * the team as one dynamic loop over every expert's chunks), into a buffer in that order; then the
 * rows go to their (token, slot). Returns 0, -1 for a type without quantized products, -2 for an
 * expert id out of range, -3 out of memory. A thread of a running team. wsp: lp_mul_mat_id_q_wsp
 * bytes (any alignment) for the plan and the grouped rows, or NULL: one malloc a call (measured,
 * bench/RESULTS.md stop 29: seven before). */
typedef struct {
    int64_t *start;  /* n_expert + 1: each expert's first row in the grouped order */
    int64_t *pair;   /* T*U: t*U + u of each grouped row */
    uint8_t *xg;     /* T*U rows of act bytes, grouped */
    float *yg;       /* T*U rows of M floats, grouped */
    int64_t *chunk;  /* units: expert << 32 | chunk index */
    int64_t n_units, n_chunk_rows;
    int err;
    void *own;       /* the plan's memory when no workspace was given (freed with it) */
} mmid_plan;

/* The plan's arrays, each 64-byte aligned, in one block of mmid_bytes (the most any ids need):
 * the caller's workspace (the executor's arena: no allocation a call), else one malloc. */
#define MMID_AL(n) (((n) + 63) & ~(int64_t)63)
static int64_t mmid_bytes(int64_t n_expert, int64_t M, int64_t act_bytes, int64_t n) {
    const int64_t used = n < n_expert ? n : n_expert, blocks = (M + MM_ROW_BLOCK - 1) / MM_ROW_BLOCK;
    return 64 + MMID_AL((int64_t)sizeof(mmid_plan)) + MMID_AL((n_expert + 1) * 8) + MMID_AL(n * 8) +
           MMID_AL(n * act_bytes) + MMID_AL(n * M * 4) + MMID_AL(n_expert * 8) + MMID_AL((used * blocks + 1) * 8);
}

static mmid_plan *mmid_make(const mm_traits *t, int64_t n_expert, int64_t M, int64_t n_in, const void *xq, int64_t ux,
                            const int32_t *ids, int64_t ids_st, int64_t T, int64_t U, int nth, void *wsp) {
    const int64_t act_bytes = n_in / t->blck * t->act_bsize, n = T * U;
    void *own = wsp == NULL ? malloc((size_t)mmid_bytes(n_expert, M, act_bytes, n)) : NULL;
    if (wsp == NULL && own == NULL) return NULL;
    uint8_t *m = (uint8_t *)MMID_AL((int64_t)(uintptr_t)(wsp != NULL ? wsp : own));
#define MMID_TAKE(p, bytes) ((p) = (void *)m, m += MMID_AL(bytes))
    mmid_plan *pl;
    MMID_TAKE(pl, (int64_t)sizeof *pl);
    memset(pl, 0, sizeof *pl);
    pl->own = own;
    MMID_TAKE(pl->start, (n_expert + 1) * 8);
    MMID_TAKE(pl->pair, n * 8);
    MMID_TAKE(pl->xg, n * act_bytes);
    MMID_TAKE(pl->yg, n * M * 4);
    int64_t *fill;
    MMID_TAKE(fill, n_expert * 8);
    MMID_TAKE(pl->chunk, ((n < n_expert ? n : n_expert) * ((M + MM_ROW_BLOCK - 1) / MM_ROW_BLOCK) + 1) * 8);
#undef MMID_TAKE
    memset(pl->start, 0, (size_t)(n_expert + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        const int32_t e = ids[(i / U) * ids_st + i % U];
        if (e < 0 || e >= n_expert) { pl->err = -2; return pl; }
        pl->start[e + 1]++;
    }
    for (int64_t e = 0; e < n_expert; e++) pl->start[e + 1] += pl->start[e];
    memcpy(fill, pl->start, (size_t)n_expert * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) { /* token order within each expert */
        const int64_t tok = i / U, u = i % U, k = fill[ids[tok * ids_st + u]]++;
        pl->pair[k] = i;
        memcpy(pl->xg + k * act_bytes, (const uint8_t *)xq + (tok * ux + (ux == 1 ? 0 : u)) * act_bytes,
               (size_t)act_bytes);
    }
    /* units of MM_ROW_BLOCK rows: about 4 a thread over all the work, never fewer than one a expert */
    int64_t used = 0;
    for (int64_t e = 0; e < n_expert; e++) used += pl->start[e + 1] > pl->start[e];
    const int64_t blocks = (M + MM_ROW_BLOCK - 1) / MM_ROW_BLOCK;
    int64_t per = used ? (4LL * nth + used - 1) / used : 1;
    per = per < 1 ? 1 : per > blocks ? blocks : per;
    pl->n_chunk_rows = (blocks + per - 1) / per * MM_ROW_BLOCK;
    const int64_t n_chunks = (M + pl->n_chunk_rows - 1) / pl->n_chunk_rows;
    for (int64_t e = 0; e < n_expert; e++)
        if (pl->start[e + 1] > pl->start[e])
            for (int64_t c = 0; c < n_chunks; c++) pl->chunk[pl->n_units++] = e << 32 | c;
    return pl;
}

static void mmid_free(mmid_plan *pl) {
    if (pl) free(pl->own);
}

/* the bytes of lp_mul_mat_id_q's workspace for these shapes (any ids), -1 for a type without
 * quantized products */
QMM_API int64_t lp_mul_mat_id_q_wsp(int ggml_type, int64_t n_expert, int64_t M, int64_t n_in, int64_t T, int64_t U) {
    mm_traits t;
    if (mm_traits_of(ggml_type, &t) != 0 || n_in % t.blck) return -1;
    return mmid_bytes(n_expert, M, n_in / t.blck * t.act_bsize, T * U);
}

int lp_mul_mat_id_q_par(lp_par *p, int ggml_type, const void *w, int64_t n_expert, int64_t M, int64_t row_bytes,
                        int64_t n_in, const void *xq, int64_t ux, const int32_t *ids, int64_t ids_st, int64_t T,
                        int64_t U, float *y, void *wsp) {
    mm_traits t;
    if (mm_traits_of(ggml_type, &t) != 0 || n_in % t.blck || n_in > INT32_MAX) return -1;
    const int64_t act_bytes = n_in / t.blck * t.act_bsize;
    mmid_plan *pl = lp_par_share(p, p->ith == 0 ? mmid_make(&t, n_expert, M, n_in, xq, ux, ids, ids_st, T, U, p->nth, wsp)
                                               : NULL);
    int err = pl == NULL ? -3 : pl->err;
    if (err == 0) {
        for (int64_t c = lp_par_next(p); c < pl->n_units; c = lp_par_next(p)) {
            const int64_t e = pl->chunk[c] >> 32, a = (pl->chunk[c] & 0xffffffff) * pl->n_chunk_rows;
            const int64_t b = a + pl->n_chunk_rows < M ? a + pl->n_chunk_rows : M, k0 = pl->start[e];
            mm_rows(&t, (const uint8_t *)w + e * M * row_bytes, a, b, row_bytes, (int)n_in, pl->xg + k0 * act_bytes,
                    act_bytes, pl->start[e + 1] - k0, pl->yg + k0 * M, M);
        }
        lp_par_barrier(p);
        int64_t r0, r1;
        lp_par_range(p, T * U, &r0, &r1);
        for (int64_t k = r0; k < r1; k++) memcpy(y + pl->pair[k] * M, pl->yg + k * M, (size_t)M * sizeof(float));
    }
    lp_par_barrier(p); /* everyone is done with the plan before thread 0 frees it */
    if (p->ith == 0) mmid_free(pl);
    return err;
}

typedef struct {
    int type;
    const void *w;
    int64_t n_expert, M, row_bytes, n_in;
    const void *xq;
    int64_t ux;
    const int32_t *ids;
    int64_t ids_st, T, U;
    float *y;
    void *wsp;
} mmid_job;

static int64_t mul_mat_id_q_run(lp_par *p, void *arg) {
    const mmid_job *j = arg;
    int rc = lp_mul_mat_id_q_par(p, j->type, j->w, j->n_expert, j->M, j->row_bytes, j->n_in, j->xq, j->ux, j->ids,
                                 j->ids_st, j->T, j->U, j->y, j->wsp);
    return rc == 0 ? 0 : -rc; /* a positive error for lp_par_run */
}

QMM_API int lp_mul_mat_id_q(int ggml_type, const void *w, int64_t n_expert, int64_t M, int64_t row_bytes, int64_t n_in,
                            const void *xq, int64_t ux, const int32_t *ids, int64_t ids_st, int64_t T, int64_t U,
                            float *y, void *wsp, int n_threads) {
    mmid_job j = {ggml_type, w, n_expert, M, row_bytes, n_in, xq, ux, ids, ids_st, T, U, y, wsp};
    return -(int)lp_par_run(n_threads, mul_mat_id_q_run, &j);
}
