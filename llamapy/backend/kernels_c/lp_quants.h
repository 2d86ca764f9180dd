/* ggml's quantized block layouts and the vec_dot ABI shared by the C kernels.
 *
 * ggml counterparts: ggml-common.h (block_q4_0 ... block_q8_K, QK_K = 256, K_SCALE_SIZE = 12),
 * ggml-cpu/quants.h (quantize_row_q8_0/q8_1/q8_K, ggml_vec_dot_<type>_<vec_dot_type>) and
 * ggml-cpu.c's type_traits_cpu (which vec_dot_type each weight type multiplies with).
 *
 * The structs are byte-for-byte the GGUF file's blocks, so a weight row is used where it is
 * mapped, without repacking. Every kernel source is compiled once per SIMD variant (portable,
 * AVX2, AVX-512 VNNI; see native.py / setup.py) into its own library, so the function names
 * below are the same in every variant and the loader picks the library at run time.
 *
 *   weight type         vec_dot_type   dot product
 *   F32                 F32            lp_vec_dot_f32        (x: float)
 *   F16                 F16            lp_vec_dot_f16        (ggml rounds x to f16)
 *   BF16                BF16           lp_vec_dot_bf16       (ggml rounds x to bf16)
 *   Q4_0, Q5_0, Q8_0    Q8_0           lp_vec_dot_q4_0_q8_0 ... (Q4_0: iquants.c, with IQ4_NL)
 *   Q4_1, Q5_1          Q8_1           lp_vec_dot_q4_1_q8_1 ...
 *   Q2_K ... Q6_K       Q8_K           lp_vec_dot_q2_K_q8_K ...
 *
 * vec_dot(n, s, x, y): *s = the dot product of the n elements (n a multiple of the block size)
 * of weight row x and activation row y, both in their block layouts, computed as ggml defines
 * it: exact integer sums of products of quants inside a block, times the block scales, summed
 * in float32.
 * quantize_row_q8_*(x, y, k): k floats (a multiple of the block size) into blocks, with ggml's
 * rounding (nearest, ties away from zero; q8_0/q8_1 bit-identical to gguf.quants.quantize for
 * Q8_0; q8_1's s = d * sum(qs) as ggml stores it; q8_K's bsums = sums of 16 quants).
 */
#ifndef LP_QUANTS_H
#define LP_QUANTS_H

#include <stdint.h>
#include <string.h>

#include "lp_team.h"

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK8_1 32
#define QK_K 256
#define K_SCALE_SIZE 12

typedef uint16_t lp_half; /* IEEE binary16 bits */
typedef uint16_t lp_bf16; /* bfloat16 bits */

typedef struct { lp_half d; uint8_t qs[QK4_0 / 2]; } block_q4_0;
typedef struct { lp_half d, m; uint8_t qs[QK4_1 / 2]; } block_q4_1;
typedef struct { lp_half d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; } block_q5_0;
typedef struct { lp_half d, m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; } block_q5_1;
typedef struct { lp_half d; int8_t qs[QK8_0]; } block_q8_0;
typedef struct { lp_half d, s; int8_t qs[QK8_1]; } block_q8_1; /* s = d * sum(qs) */

typedef struct { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; lp_half d, dmin; } block_q2_K;
typedef struct { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; lp_half d; } block_q3_K;
typedef struct { lp_half d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; } block_q4_K;
typedef struct { lp_half d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_K;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; lp_half d; } block_q6_K;
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K;

_Static_assert(sizeof(block_q4_0) == 18, "q4_0");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1");
_Static_assert(sizeof(block_q8_0) == 34, "q8_0");
_Static_assert(sizeof(block_q8_1) == 36, "q8_1");
_Static_assert(sizeof(block_q2_K) == 84, "q2_K");
_Static_assert(sizeof(block_q3_K) == 110, "q3_K");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K");
_Static_assert(sizeof(block_q8_K) == 292, "q8_K");

/* f16 <-> f32, exact (f32 -> f16 rounds to nearest even), without F16C so every variant shares it;
 * variants with F16C may use _cvtsh_ss / _mm256_cvtph_ps, which give the same bits. */
static inline float lp_h2f(lp_half h) {
    const uint32_t em = h & 0x7fffu;
    uint32_t mag;
    if (em >= 0x7c00u) {
        mag = 0x7f800000u | (em << 13);
    } else {
        float f;
        uint32_t b = em << 13;
        memcpy(&f, &b, sizeof f);
        f *= 0x1p112f;
        memcpy(&mag, &f, sizeof mag);
    }
    const uint32_t u = mag | ((uint32_t)(h & 0x8000u) << 16);
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

static inline lp_half lp_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (lp_half)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
    if (ax >= 0x477ff000u) return (lp_half)(sign | 0x7c00u); /* rounds to inf */
    if (ax < 0x38800000u) { /* subnormal or zero in f16: add then subtract a magic number */
        float a;
        memcpy(&a, &ax, sizeof a);
        a += 0.5f;
        uint32_t b;
        memcpy(&b, &a, sizeof b);
        return (lp_half)(sign | (b - 0x3f000000u));
    }
    const uint32_t mant_odd = (ax >> 13) & 1u;
    const uint32_t r = ax + 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to even */
    return (lp_half)(sign | (r >> 13));
}

static inline float lp_bf2f(lp_bf16 h) {
    const uint32_t u = (uint32_t)h << 16;
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* f32 -> bf16 as ggml's ggml_compute_fp32_to_bf16: round to nearest even, nan kept quiet */
static inline lp_bf16 lp_f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (lp_bf16)((u >> 16) | 64);
    return (lp_bf16)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

/* activation quantization (ggml-cpu quants.c quantize_row_q8_*) */
void lp_quantize_row_q8_0(const float *x, void *y, int64_t k);
void lp_quantize_row_q8_1(const float *x, void *y, int64_t k);
/* ggml's reference Q8_0 quantizer (quantize_row_q8_0_ref): the KV cache stores (quants.c) */
void lp_quantize_row_q8_0_ref(const float *x, void *y, int64_t k);
void lp_quantize_row_q8_K(const float *x, void *y, int64_t k);

/* Decode reads G weight rows side by side, block by block (G independent chains hide the
 * arithmetic's latency). Measured on an AMD EPYC (Zen 5) host, one thread, a 160 MB Q6_K matrix:
 * the hardware prefetchers do not follow such short interleaved streams (a 2048-wide Q6_K row is
 * 26 cache lines, and each group of rows starts G new streams): 4 rows side by side read 11 GB/s
 * from memory, one row at a time 31 (and 40+ in cache). So each multi-row decode kernel
 * prefetches in software the group LP_PF_AHEAD bytes (at least one group) ahead, one slice a block
 * step: 37 GB/s. lp_pf_group(w, span, nb) at a group's first row w (span: its G rows' bytes),
 * lp_pf_step(&pf, i) at block i. */
#define LP_PF_AHEAD 4096
typedef struct {
    const char *p;        /* the group ahead */
    int64_t step, span;   /* bytes prefetched a block step (whole lines), the group's bytes */
} lp_pf;

static inline lp_pf lp_pf_group(const void *w, int64_t span, int nb) {
    const int64_t ahead = LP_PF_AHEAD <= span ? span : (LP_PF_AHEAD + span - 1) / span * span; /* whole groups */
    return (lp_pf){(const char *)w + ahead, ((span + nb - 1) / nb + 63) & ~(int64_t)63, span};
}

static inline void lp_pf_step(const lp_pf *f, int i) {
    const int64_t end = (i + 1) * f->step < f->span ? (i + 1) * f->step : f->span;
    for (int64_t o = i * f->step; o < end; o += 64) __builtin_prefetch(f->p + o, 0, 3);
}

/* one row at a time (a single stream) needs it too where rows are a page: the prefetchers stop at
 * 4 KiB boundaries, and a 2048-wide F16 row is one (1B F16 decode, Zen 5: 12 -> 14.4 tok/s). The bytes
 * [p + LP_PF_AHEAD, + bytes) */
static inline void lp_pf_ahead(const void *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + LP_PF_AHEAD + o, 0, 3);
}

/* Several outputs at once (ggml's vec_dot with nrc > 1, and repack.cpp's gemm): weight rows
 * w, w + row_bytes, ... (nr of them) against activation rows x, x + x_bytes, ... (nc of them,
 * nc <= LP_GEMM_COLS), s[c * ld_s + r] = dot(row r, column c). Each output is bit-identical to
 * the type's lp_vec_dot_* (same operations in the same order per output), so the token count
 * of a batch never changes a result; what the kernel saves is decoding each weight block once
 * for all nc columns. lp_gemm_<type>_<vec_dot_type> is optional per type: qmatmul.c
 * references it weakly and loops lp_vec_dot_* where a type has none. */
#define LP_GEMM_COLS 4
/* lp_gemm_q3_K/q4_K/q5_K/q6_K_q8_K take any nc (they loop over columns themselves; the AVX-512
 * Q4_K/Q5_K/Q6_K kernels 8 at a time, cache-blocked over the row): qmatmul.c hands them this
 * many tokens a call (a whole 512-token micro-batch: the AVX-512 kernels decode each weight block
 * of their rows once a call, measured +29 % at 512 tokens a call over 64) */
#define LP_GEMM_COLS_K 512
/* lp_gemm_q4_1_q8_1_panel, q5_0_q8_0, q5_1_q8_1, q8_0_q8_0 _panel (the AVX2 and AVX-512 builds): the
 * same outputs as lp_gemm_<type> for ANY nc, for prompts (qmatmul.c mm_rows hands them a thread's
 * whole range of rows and every token of the call: the weights are decoded once per panel of rows,
 * the activations prepared once a call); the same lp_gemm_fn signature. */
typedef void (*lp_gemm_fn)(int n, float *s, int64_t ld_s, const void *w, int64_t row_bytes, int nr, const void *x,
                           int64_t x_bytes, int nc);

/* One activation row against nr weight rows (decode): s[r] = dot(row r, x), each bit-identical to
 * the type's lp_vec_dot_*; the activation side is prepared once for all rows. Optional per type
 * and variant (lp_gemv_q4_0_q8_0, q5_0_q8_0, q4_1_q8_1, q5_1_q8_1, q8_0_q8_0, q2_K_q8_K, q3_K_q8_K,
 * q4_K_q8_K, q6_K_q8_K and the iquants.c types' in the AVX2 and AVX-512 builds, q5_K_q8_K in the
 * AVX2 one; Q2_K's is a vec_dot per row on AVX2):
 * qmatmul.c references them weakly and runs one vec_dot per row where a library has none. */
typedef void (*lp_gemv_fn)(int n, float *s, const void *w, int64_t row_bytes, int nr, const void *x);

/* dot products: weight row vx (its type) with activation row vy (its vec_dot_type) */
typedef void (*lp_vec_dot_fn)(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_f32(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_f16(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_bf16(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q4_0_q8_0(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q4_1_q8_1(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q5_0_q8_0(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q5_1_q8_1(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q8_0_q8_0(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q2_K_q8_K(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q3_K_q8_K(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q4_K_q8_K(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q5_K_q8_K(int n, float *s, const void *vx, const void *vy);
void lp_vec_dot_q6_K_q8_K(int n, float *s, const void *vx, const void *vy);

/* ggml_type ids (ggml.h), the `ggml_type` argument of the matmul entry points below */
enum {
    LP_TYPE_F32 = 0, LP_TYPE_F16 = 1, LP_TYPE_Q4_0 = 2, LP_TYPE_Q4_1 = 3, LP_TYPE_Q5_0 = 6,
    LP_TYPE_Q5_1 = 7, LP_TYPE_Q8_0 = 8, LP_TYPE_Q8_1 = 9, LP_TYPE_Q2_K = 10, LP_TYPE_Q3_K = 11,
    LP_TYPE_Q4_K = 12, LP_TYPE_Q5_K = 13, LP_TYPE_Q6_K = 14, LP_TYPE_Q8_K = 15, LP_TYPE_BF16 = 30,
    LP_TYPE_IQ4_NL = 20, LP_TYPE_IQ4_XS = 23, LP_TYPE_MXFP4 = 39, /* kernels_c/iquants.c */
};

/* MUL_MAT with quantized activations (ggml_compute_forward_mul_mat), in kernels_c/qmatmul.c.
 *
 * Weights w: n_rows rows of row_bytes bytes, each row n_in elements in the GGUF block layout of
 * ggml_type (the file's bytes, no repacking). Activations x: n_tok rows of n_in floats, row t at
 * x + t*ld_x. Output y: y[t*ld_y + r] = vec_dot(weight row r, activation row t quantized to the
 * weight type's vec_dot_type), r < n_rows, t < n_tok.
 *
 * lp_vec_dot_type(type)        the vec_dot_type's ggml id (F32 for F32, F16 for F16, BF16, Q8_0,
 *                              Q8_1 or Q8_K), or -1 when this library has no kernel for the type
 *                              (e.g. a K type before kquants.c is built in): the caller falls back
 * lp_act_row_bytes(type, n_in) bytes of one activation row in that vec_dot_type (-1: no kernel)
 * lp_quantize_act(type, x, ld_x, n_in, n_tok, xq, n_threads)
 *                              x -> xq, n_tok rows of lp_act_row_bytes each, packed; returns 0,
 *                              -1 without a kernel. One quantization serves every weight of the
 *                              same vec_dot_type (fused Q/K/V, gate/up).
 * lp_mul_mat_q(type, w, n_rows, row_bytes, n_in, xq, n_tok, y, ld_y, n_threads)
 *                              the product from already quantized activations; 0, or -1
 * lp_mul_mat(type, w, n_rows, row_bytes, n_in, x, ld_x, n_tok, y, ld_y, wsp, n_threads)
 *                              both steps; wsp: n_tok * lp_act_row_bytes(type, n_in) bytes
 * lp_round_act(type, x, ld_x, n_in, n_tok, out, ld_out, n_threads)
 *                              x quantized to the vec_dot_type and expanded back to float32
 *                              (d * q exactly; f16 / bf16 values): float32 tiles + sgemm on these
 *                              compute lp_mul_mat's sums (large batches); 0, or -1
 * Threads: n_threads threads for this call only (no global state), chunks of rows; the _par forms
 * are one thread of a running team (lp_team.h: the executor's one region per split). */
int lp_vec_dot_type(int ggml_type);
int64_t lp_act_row_bytes(int ggml_type, int64_t n_in);
int lp_quantize_act(int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok, void *xq,
                    int n_threads);
int lp_mul_mat_q(int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in, const void *xq,
                 int64_t n_tok, float *y, int64_t ld_y, int n_threads);
int lp_mul_mat(int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in, const float *x,
               int64_t ld_x, int64_t n_tok, float *y, int64_t ld_y, void *wsp, int n_threads);
int lp_round_act(int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok, float *out, int64_t ld_out,
                 int n_threads);
int lp_quantize_act_par(lp_par *p, int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok,
                        void *xq);
int lp_mul_mat_q_par(lp_par *p, int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in,
                     const void *xq, int64_t n_tok, float *y, int64_t ld_y);

#endif
