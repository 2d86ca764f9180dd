/* The compiled executor of a CPU split: one call runs a whole plan of op records.
 *
 * ggml counterparts: ggml-cpu.c's ggml_graph_compute (a node loop over a cgraph whose tensors
 * have their data pointers set by ggml-alloc) and ggml_backend_cpu_graph_plan_create /
 * _plan_compute; the fusions are those of ggml-cpu (rms_norm followed by a mul with the norm
 * weight, an add feeding a norm).
 *
 * A plan is an array of records built once per graph shape by backend/executor.py: every
 * pointer in it is absolute (the compute arena, the inputs block, the weights, the KV cache are
 * all allocated before the plan is built and live as long as it does), so running a step is
 * one loop over the records, without Python. What changes per token (token ids, positions, KV
 * cells, the mask) is written into the inputs block by the caller before the call.
 *
 * The records call the same kernels as the reference path (cpu.py's table, cpu_kernels.py): the
 * quantized-activation MUL_MAT (lp_quantize_act once per input and vec_dot_type, then
 * lp_mul_mat_q), or in the float32-activation mode the repacked matvec through a function
 * pointer in the record (lp_mv_<t>); lp_attend / lp_attend_f16 / lp_attend_q and lp_swiglu of ops.c
 * (a Q8_0/Q4_0 cache: its rows quantized and, where llama.cpp's attn_rot rotates them, rotated by
 * ops.c's lp_kv_quantize_row / lp_hadamard_runs, quants.quantize / rotate bit for bit); rms_norm,
 * rope and the elementwise ops repeat ops.c's
 * and numpy's float32 operations in the same order, so a decode step is bit-identical to
 * run_nodes (see tests/backend/test_executor.py; the f32 tail rows of a matrix whose row count
 * is not a multiple of 64 are summed here, not by BLAS: within float32 noise).
 *
 * Threads: one team of `n_threads` (lp_team.h: one OpenMP region) runs the whole plan, as ggml
 * runs a graph: every thread walks the records, the matvecs, the activations' quantization and
 * attention share out their work, the row-wise records (norms, elementwise ops, rope, SwiGLU,
 * copies) share out the rows of a big batch (ex_rows: each row computed as alone, so the same
 * bits), and the small records run on thread 0 while the others wait at the next barrier,
 * spinning (a decode step's records take microseconds: waking sleeping threads for each of them
 * cost more than the work). Nothing here keeps thread state between calls, so contexts with
 * different -t do not interfere.
 * Built like the other kernels_c sources (-ffp-contract=off: no FMA contraction).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EX_API __attribute__((visibility("default")))

#include "lp_team.h"

/* elements of a row-wise record from which its rows are shared out among the threads: a prompt's
 * micro-batch, and a decode step of 4 sequences (4 x 576 for SmolLM2's norms); one token's stay on
 * thread 0. Measured (SmolLM2, 2 threads, 10 alternating rounds): a 4-sequence step 6.40 -> 6.01 ms
 * (median; faster in every round) from 65536 to 2048, a 1-sequence step unchanged. */
#define EX_PAR_MIN (1 << 11)

/* ops.c: attention as a thread of a team (every cache type, LP_KV_*); the rotation of a
 * quantized cache (llama.cpp's attn_rot) and its rows' quantization */
void lp_attend_q_par(lp_par *p, const float *q, int64_t T, int64_t H, int64_t D, const void *k, const void *v,
                     int64_t N, int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh,
                     const float *mask, int64_t mask_st, float scale, float *out, int kt, int vt,
                     const float *sinks);
void lp_hadamard_runs(float *x, int64_t len, int64_t n, float c);
void lp_kv_quantize_row(void *dst, const float *x, int64_t n, int t);
void lp_kv_row(float *dst, const void *base, int64_t off, int type, int64_t n);
void lp_swiglu_oai(const float *gate, const float *up, int64_t rows, int64_t n, int64_t gate_st, int64_t up_st,
                   float alpha, float limit, float *out);
void lp_geglu(const float *gate, const float *up, int64_t rows, int64_t n, int64_t gate_st, int64_t up_st,
              const float *table, float *out);
void lp_swiglu(const float *gate, const float *up, int64_t rows, int64_t n, int64_t gate_st, int64_t up_st,
               float *out);

/* qmatmul.c: MUL_MAT with quantized activations, as a thread of a team (lp_quants.h) */
int lp_quantize_act_par(lp_par *p, int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok,
                        void *xq);
int lp_mul_mat_q_par(lp_par *p, int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in,
                     const void *xq, int64_t n_tok, float *y, int64_t ld_y);
int lp_mul_mat_id_q_par(lp_par *p, int ggml_type, const void *w, int64_t n_expert, int64_t M, int64_t row_bytes,
                        int64_t n_in, const void *xq, int64_t ux, const int32_t *ids, int64_t ids_st, int64_t T,
                        int64_t U, float *y, void *wsp);
/* ops.c: ggml's soft_max_f32 over strided rows, and a descending argsort of each row */
void lp_soft_max_rows(const float *x, int64_t rows, int64_t n, int64_t xs, float scale, float *out);
void lp_argsort_rows(const float *x, int64_t rows, int64_t n, int64_t xs, int32_t *out);

/* the matvec ABI of qmatmul.c's lp_mvp_<t> (a thread of a team) */
typedef void (*mvp_fn)(lp_par *p, const void *const *parts, int64_t n_tiles, int64_t nb, const float *x,
                       int64_t n_tok, float *out, int64_t ld_out);
/* qmatmul.c's lp_dqr_<t>: selected rows of a repacked matrix, expanded */
typedef void (*dqr_fn)(const void *const *parts, int64_t nb, const int64_t *ids, int64_t n, float *out);

/* Op codes and record layout: keep in step with executor.py (OPS, REC). Every slot is 8 bytes:
 * an integer, a pointer, or a double's bits. Slot 0 is the op, 1 the destination, 2..5 sources. */
enum {
    EX_GET_ROWS_Q = 1,
    EX_GET_ROWS_F32 = 2,
    EX_RMS_NORM = 3, /* optionally fused: an add before it, a mul by the norm weight after it */
    EX_MUL = 4,
    EX_ADD = 5,
    EX_SCALE = 6,
    EX_SWIGLU = 7,
    EX_MUL_MAT = 8,
    EX_ROPE = 9,
    EX_SET_ROWS = 10,
    EX_ATTN = 11,
    EX_CPY = 12,
    EX_QUANT_ACT = 13, /* activations quantized to a weight type's vec_dot_type, once for its products */
    EX_MUL_MAT_Q = 14, /* MUL_MAT on the file's blocks with those quantized activations */
    /* the mixture-of-experts router and experts (build_moe_ffn) */
    EX_SOFT_MAX = 15,
    EX_ARGSORT = 16,
    EX_SUM_ROWS = 17,
    EX_CLAMP = 18,
    EX_DIV = 19,
    EX_GET_ROWS_B = 20,   /* GET_ROWS with a batch of id rows: (B, R, C), (B, n) -> (B, n, C) */
    EX_MUL_MAT_ID_Q = 21, /* MUL_MAT_ID on the file's blocks with quantized activations */
    EX_ADD_ID = 22,       /* each (token, slot)'s row of an (n_expert, M) bias by its expert id */
    EX_GEGLU = 32,        /* GELU(gate) * up (gemma3; executor.py's GEGLU, the GPU's code too) */
};

#define EX_REC 25

typedef union {
    int64_t i;
    double f;
    void *p;
} ex_slot;

#define I(k) (r[k].i)
#define F(k) (r[k].f)
#define P(k) (r[k].p)

/* ops.c: RMS norm over strided rows, times an optional weight (lp_rms_norm's sums) */
void lp_rms_rows(const float *x, int64_t rows, int64_t n, int64_t xs, double eps, const float *w, float *out);

/* ops.c: rope over strided rows (the Q/K columns of a fused QKV product) */
void lp_rope_rows(const float *x, int64_t T, int64_t H, int64_t D, int64_t xs_t, int64_t xs_h, const int32_t *pos,
                  const float *rc, int64_t n_dims, int neox, float *out);

/* float32 rows of a weight (the f32 tail of a repacked matrix, or an F32 matrix): out[t, j] for
 * j < n_rows, a plain float32 sum (BLAS sums in another order: within float32 noise) */
static void mm_f32(const float *x, int64_t n_tok, int64_t n_in, int64_t x_st, const float *w, int64_t n_rows,
                   float *out, int64_t ld_out) {
    for (int64_t t = 0; t < n_tok; t++) {
        const float *xr = x + t * x_st;
        for (int64_t j = 0; j < n_rows; j++) {
            const float *wr = w + j * n_in;
            float acc[8] = {0};
            int64_t i = 0;
            for (; i + 8 <= n_in; i += 8)
                for (int l = 0; l < 8; l++) acc[l] += xr[i + l] * wr[i + l];
            float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (; i < n_in; i++) s += xr[i] * wr[i];
            out[t * ld_out + j] = s;
        }
    }
}

static uint16_t to_f16(float x) {
#if defined(__FLT16_MAX__)
    _Float16 h = (_Float16)x; /* round to nearest even, as numpy's astype(float16) */
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
#else
    (void)x;
    return 0x7e00u; /* never reached: lp_exec_caps() says f16 stores are not available */
#endif
}

/* Attention (any number of query tokens): ops.c's kernel, which shares out its (KV head, query
 * block) units, or with few units their chunks of cells, among the team once the work is big
 * enough; each query's output is the same whatever the thread count. A rotated quantized cache
 * (llama.cpp's attn_rot): Q into K's rotated basis first, the output back from V's after, on
 * thread 0. Returns 1 out of memory (on every thread). */
static int attention(lp_par *p, const ex_slot *r) {
    const int64_t nq = I(6) * I(7) * I(8);
    const float *q = P(2);
    float *qr = NULL;
    if (I(20)) {
        if (p->ith == 0 && (qr = malloc((size_t)nq * sizeof(float)))) {
            memcpy(qr, q, (size_t)nq * sizeof(float));
            lp_hadamard_runs(qr, nq, I(20), (float)F(22));
        }
        if (!(qr = lp_par_share(p, qr))) return 1;
        q = qr;
    }
    lp_attend_q_par(p, q, I(6), I(7), I(8), P(3), P(4), I(9), I(10), I(11), I(12), I(13), I(14), I(15), P(5), I(16),
                    (float)F(17), P(1), (int)I(18), (int)I(19), (const float *)P(24));
    if (I(20) || I(21)) lp_par_barrier(p); /* the output is whole; no one reads qr any more */
    if (p->ith == 0) {
        if (I(21)) lp_hadamard_runs(P(1), I(6) * I(7) * I(11), I(21), (float)F(23));
        free(qr);
    }
    return 0;
}

/* Rows [r0, r1) of a row-wise record (each row computed on its own: the same bits in any split). */
static void ex_rows(const ex_slot *r, int64_t r0, int64_t r1) {
    switch (I(0)) {
    case EX_RMS_NORM: {
        /* dst (rows, n) = rms_norm(x) [* w]: [6] rows, [7] n, [8] x stride, [9] eps, src1 w or
         * NULL; fused add first when [10] is set: x = [10] (rows, n) = src2 + src3 (strides
         * [11], [12]; 0: a broadcast row). [13] T > 0: the per-head norm of a strided view (Q / K
         * of a fused QKV product): [6] rows a token, T tokens [14] / [15] apart in x / dst, the
         * record's rows t * [6] + h */
        const int64_t n = I(7);
        if (I(13)) {
            for (int64_t g = r0; g < r1;) {
                const int64_t t = g / I(6), h = g % I(6), k = (I(6) - h < r1 - g) ? I(6) - h : r1 - g;
                lp_rms_rows((const float *)P(2) + t * I(14) + h * I(8), k, n, I(8), F(9), P(3),
                            (float *)P(1) + t * I(15) + h * n);
                g += k;
            }
            break;
        }
        if (P(10)) {
            float *s = P(10);
            const float *a = P(4), *b = P(5);
            for (int64_t t = r0; t < r1; t++)
                for (int64_t i = 0; i < n; i++) s[t * n + i] = a[t * I(11) + i] + b[t * I(12) + i];
        }
        lp_rms_rows((const float *)P(2) + r0 * I(8), r1 - r0, n, I(8), F(9), P(3), (float *)P(1) + r0 * n);
        break;
    }
    case EX_MUL:
    case EX_ADD:
    case EX_DIV: {
        /* dst (rows, n) = a op b: [6] rows, [7] n, [8] a stride, [9] b stride (0: broadcast),
         * [10] b has one value per row (the router's weights: ggml's broadcast of ne[0] = 1) */
        const float *a = P(2), *b = P(3);
        float *d = P(1);
        const int64_t n = I(7), bi = I(10) ? 0 : 1;
        for (int64_t t = r0; t < r1; t++) {
            const float *ar = a + t * I(8), *br = b + t * I(9);
            float *dr = d + t * n;
            if (I(0) == EX_MUL)
                for (int64_t i = 0; i < n; i++) dr[i] = ar[i] * br[i * bi];
            else if (I(0) == EX_ADD)
                for (int64_t i = 0; i < n; i++) dr[i] = ar[i] + br[i * bi];
            else
                for (int64_t i = 0; i < n; i++) dr[i] = ar[i] / br[i * bi];
        }
        break;
    }
    case EX_SOFT_MAX:
        /* dst (rows, n) = softmax(x * scale): [6] rows, [7] n, [8] x stride, [9] scale */
        lp_soft_max_rows((const float *)P(2) + r0 * I(8), r1 - r0, I(7), I(8), (float)F(9), (float *)P(1) + r0 * I(7));
        break;
    case EX_ARGSORT:
        /* dst (rows, n) int32: each row's indices, largest value first: [6] rows, [7] n, [8] x stride */
        lp_argsort_rows((const float *)P(2) + r0 * I(8), r1 - r0, I(7), I(8), (int32_t *)P(1) + r0 * I(7));
        break;
    case EX_SUM_ROWS:
        /* dst (rows, 1): each row summed in order in double (ggml_vec_sum_f32): [6] rows, [7] n, [8] stride */
        for (int64_t t = r0; t < r1; t++) {
            const float *x = (const float *)P(2) + t * I(8);
            double acc = 0.0;
            for (int64_t i = 0; i < I(7); i++) acc += (double)x[i];
            ((float *)P(1))[t] = (float)acc;
        }
        break;
    case EX_CLAMP: {
        /* [6] rows, [7] n, [8] stride, [9] min, [10] max */
        const float lo = (float)F(9), hi = (float)F(10);
        for (int64_t t = r0; t < r1; t++) {
            const float *x = (const float *)P(2) + t * I(8);
            float *d = (float *)P(1) + t * I(7);
            for (int64_t i = 0; i < I(7); i++) d[i] = x[i] < lo ? lo : x[i] > hi ? hi : x[i];
        }
        break;
    }
    case EX_SCALE: {
        /* [6] rows, [7] n, [8] stride, [9] s */
        const float *a = P(2);
        float *d = P(1);
        const float s = (float)F(9);
        for (int64_t t = r0; t < r1; t++)
            for (int64_t i = 0; i < I(7); i++) d[t * I(7) + i] = a[t * I(8) + i] * s;
        break;
    }
    case EX_SWIGLU:
        /* [6] rows, [7] n, [8] gate stride, [9] up stride; [10] 1: swiglu_oai with [11] alpha, [12] limit */
        if (I(10))
            lp_swiglu_oai((const float *)P(2) + r0 * I(8), (const float *)P(3) + r0 * I(9), r1 - r0, I(7), I(8), I(9),
                          (float)F(11), (float)F(12), (float *)P(1) + r0 * I(7));
        else
            lp_swiglu((const float *)P(2) + r0 * I(8), (const float *)P(3) + r0 * I(9), r1 - r0, I(7), I(8), I(9),
                      (float *)P(1) + r0 * I(7));
        break;
    case EX_GEGLU:
        /* [6] rows, [7] n, [8] gate stride, [9] up stride; src2 the GELU table (kernels.gelu_table) */
        lp_geglu((const float *)P(2) + r0 * I(8), (const float *)P(3) + r0 * I(9), r1 - r0, I(7), I(8), I(9), P(4),
                 (float *)P(1) + r0 * I(7));
        break;
    case EX_ADD_ID:
        /* dst (T*U, M) <- src0 a (T*U, M) + src1 b[ids]: [6] T*U rows, [7] M, [8] a row stride, [9] U,
         * [10] ids row stride; src2 ids (T, U) int32 */
        for (int64_t t = r0; t < r1; t++) {
            const float *a = (const float *)P(2) + t * I(8);
            const float *b = (const float *)P(3) + (int64_t)((const int32_t *)P(4))[t / I(9) * I(10) + t % I(9)] * I(7);
            float *d = (float *)P(1) + t * I(7);
            for (int64_t i = 0; i < I(7); i++) d[i] = a[i] + b[i];
        }
        break;
    case EX_ROPE:
        /* src1 pos (int32), src2 rope constants (float, kernels.rope_consts): [6] T, [7] H, [8] D, [9] token stride,
         * [10] head stride, [11] n_dims, [12] neox; rows: tokens */
        lp_rope_rows((const float *)P(2) + r0 * I(9), r1 - r0, I(7), I(8), I(9), I(10), (const int32_t *)P(3) + r0, P(4),
                     I(11), (int)I(12), (float *)P(1) + r0 * I(7) * I(8));
        break;
    case EX_CPY:
        /* dst (rows, n) contiguous <- src rows: [6] rows, [7] n, [8] src stride */
        for (int64_t t = r0; t < r1; t++)
            memcpy((float *)P(1) + t * I(7), (const float *)P(2) + t * I(8), (size_t)I(7) * 4);
        break;
    }
}

/* the rows a row-wise record shares out ([6]: rows or tokens; a per-head RMS_NORM's, [13] tokens of them) */
static int64_t ex_n_rows(const ex_slot *r) {
    return I(6) * (I(0) == EX_RMS_NORM && I(13) ? I(13) : 1);
}

/* work of a row-wise record */
static int64_t ex_rows_work(const ex_slot *r) {
    return ex_n_rows(r) * I(7) * (I(0) == EX_ROPE ? I(8) : 1);
}

/* Bit 0: SET_ROWS into an f16 cache is available (the compiler has _Float16). */
EX_API int64_t lp_exec_caps(void) {
#if defined(__FLT16_MAX__)
    return 1;
#else
    return 0;
#endif
}

/* the row-wise records (ex_rows) */
static int ex_rowwise(int64_t op) {
    return op == EX_RMS_NORM || op == EX_MUL || op == EX_ADD || op == EX_SCALE || op == EX_SWIGLU || op == EX_ROPE ||
           op == EX_CPY || op == EX_DIV || op == EX_SOFT_MAX || op == EX_ARGSORT || op == EX_SUM_ROWS ||
           op == EX_CLAMP || op == EX_ADD_ID || op == EX_GEGLU;
}

/* A record that has a serial part only (thread 0 runs it, the others go on to the next barrier)
 * or one the team shares out: 0 / 1. */
static int ex_is_par(const ex_slot *r) {
    if (ex_rowwise(I(0))) return ex_n_rows(r) > 1 && ex_rows_work(r) >= EX_PAR_MIN;
    switch (I(0)) {
    case EX_QUANT_ACT:
        return I(9) > 1;
    case EX_MUL_MAT:
    case EX_MUL_MAT_Q:
    case EX_MUL_MAT_ID_Q:
    case EX_ATTN:
        return 1;
    default:
        return 0;
    }
}

/* this thread's part of a shared-out record; nonzero: it failed (every thread says so) */
static int ex_par_record(lp_par *p, const ex_slot *r) {
    switch (I(0)) {
    case EX_MUL_MAT: {
        /* dst (n_tok, n_out) = x @ W.T: [6] n_tok, [7] n_in, [8] x stride (== n_in for the
         * matvec), [9] mvp fn or NULL, [10] parts, [11] n_tiles, [12] nb, [13] n_out,
         * [14] n_full (rows in tiles), [15] f32 rows n_full.. (or all rows: no fn) */
        const int64_t n_tok = I(6), n_in = I(7), n_out = I(13), n_full = I(14);
        float *dst = P(1);
        if (P(9) && I(11) > 0)
            ((mvp_fn)P(9))(p, (const void *const *)P(10), I(11), I(12), P(2), n_tok, dst, n_out);
        if (n_full < n_out && p->ith == 0)
            mm_f32(P(2), n_tok, n_in, I(8), P(15), n_out - n_full, dst + n_full, n_out);
        return 0;
    }
    case EX_ATTN:
        /* src0 q (T,H,D) contiguous, src1 k, src2 v, src3 mask: [6] T, [7] H, [8] D, [9] N,
         * [10] Hkv, [11] Dv, [12..15] k/v strides (in their storage units), [16] mask stride,
         * [17] scale, [18] / [19] K / V type (ops.c's LP_KV_*), [20] / [21] K / V rotation run
         * (0: none), [22] / [23] their scales, [24] sinks (H,) or 0 */
        return attention(p, r);
    case EX_QUANT_ACT:
        /* dst xq <- src0 x: [6] weight type, [7] x row stride, [8] n_in, [9] n_tok */
        return lp_quantize_act_par(p, (int)I(6), P(2), I(7), I(8), I(9), P(1)) != 0;
    case EX_MUL_MAT_Q:
        /* dst y <- W (src0, the file's rows) . xq (src1): [6] type, [7] n_rows, [8] row bytes,
         * [9] n_in, [10] n_tok, [11] y row stride */
        return lp_mul_mat_q_par(p, (int)I(6), P(2), I(7), I(8), I(9), P(3), I(10), P(1), I(11)) != 0;
    case EX_MUL_MAT_ID_Q:
        /* dst y (T, U, M) <- the experts W (src0, stacked, the file's rows) . xq (src1, T x ux rows)
         * chosen by ids (src2, int32 rows of stride [12]): [6] type, [7] n_expert, [8] M,
         * [9] row bytes, [10] n_in, [11] ux, [13] T, [14] U, [15] its workspace in the arena
         * (lp_mul_mat_id_q_wsp bytes) */
        return lp_mul_mat_id_q_par(p, (int)I(6), P(2), I(7), I(8), I(9), I(10), P(3), I(11), P(4), I(12), I(13),
                                   I(14), P(1), P(15)) != 0;
    default: { /* a row-wise record of a big batch: a static share of its rows */
        if (!ex_rowwise(I(0))) return 1;
        int64_t r0, r1;
        lp_par_range(p, ex_n_rows(r), &r0, &r1);
        if (r0 < r1) ex_rows(r, r0, r1);
        return 0;
    }
    }
}

/* a serial record, on thread 0; nonzero: it failed (a row id out of range, out of memory, an
 * unknown op) */
static int ex_serial_record(const ex_slot *r) {
    switch (I(0)) {
    case EX_GET_ROWS_Q: {
        /* dst (n, n_in) <- rows ids of a repacked matrix: [6] n, [7] n_in, [8] nb, [9] dqr,
         * [10] parts, [11] n_full, [12] tail f32 rows, [13] n_rows */
        const int32_t *ids = P(2);
        float *dst = P(1);
        const int64_t n_in = I(7);
        for (int64_t i = 0; i < I(6); i++) {
            const int64_t id = ids[i];
            if (id < 0 || id >= I(13)) return 1;
            if (id < I(11))
                ((dqr_fn)P(9))((const void *const *)P(10), I(8), &id, 1, dst + i * n_in);
            else
                memcpy(dst + i * n_in, (const float *)P(12) + (id - I(11)) * n_in, (size_t)n_in * 4);
        }
        return 0;
    }
    case EX_GET_ROWS_F32: {
        /* dst (n, c) <- rows ids of src: [6] n, [7] c, [8] src row stride (f32 elements; bytes for
         * the others), [9] src rows, [10] src type (0 f32, 1 f16, 2 Q8_0, 3 Q4_0: ops.c's LP_KV_*) */
        const int32_t *ids = P(3);
        float *dst = P(1);
        for (int64_t i = 0; i < I(6); i++) {
            if (ids[i] < 0 || ids[i] >= I(9)) return 1;
            if (I(10))
                lp_kv_row(dst + i * I(7), P(2), ids[i] * I(8) / (I(10) == 1 ? 2 : 1), (int)I(10), I(7));
            else
                memcpy(dst + i * I(7), (const float *)P(2) + ids[i] * I(8), (size_t)I(7) * 4);
        }
        return 0;
    }
    case EX_GET_ROWS_B: {
        /* dst (B, n, C) <- for each batch b, rows ids[b] of table[b]: [6] B, [7] n, [8] C,
         * [9] table batch stride, [10] table row stride, [11] table rows, [12] ids batch stride
         * (the ids of a batch contiguous) */
        const float *tab = P(2);
        const int32_t *ids = P(3);
        float *dst = P(1);
        for (int64_t b = 0; b < I(6); b++)
            for (int64_t i = 0; i < I(7); i++) {
                const int32_t id = ids[b * I(12) + i];
                if (id < 0 || id >= I(11)) return 1;
                memcpy(dst + (b * I(7) + i) * I(8), tab + b * I(9) + id * I(10), (size_t)I(8) * 4);
            }
        return 0;
    }
    case EX_SET_ROWS: {
        /* rows ids (int64, src1) of dst <- rows of src2: [6] n, [7] cols, [8] src stride,
         * [9] dst rows, [10] dst type (0 f32, 1 f16, 2 Q8_0, 3 Q4_0: ops.c's LP_KV_*),
         * [11] dst row stride (elements; bytes for Q8_0/Q4_0), [12] rotation run (0: none),
         * [13] its scale (a rotated cache stores each row rotated, then quantized) */
        const int64_t *ids = P(3);
        const float *src = P(4);
        float *rot = NULL;
        if (I(12) && !(rot = malloc((size_t)I(7) * sizeof(float)))) return 1;
        for (int64_t i = 0; i < I(6); i++) {
            const int64_t id = ids[i];
            if (id < 0 || id >= I(9)) {
                free(rot);
                return 1;
            }
            const float *s = src + i * I(8);
            if (rot) {
                memcpy(rot, s, (size_t)I(7) * sizeof(float));
                lp_hadamard_runs(rot, I(7), I(12), (float)F(13));
                s = rot;
            }
            if (I(10) >= 2) {
                lp_kv_quantize_row((uint8_t *)P(1) + id * I(11), s, I(7), (int)I(10));
            } else if (I(10)) {
                uint16_t *d = (uint16_t *)P(1) + id * I(11);
                for (int64_t c = 0; c < I(7); c++) d[c] = to_f16(s[c]);
            } else {
                memcpy((float *)P(1) + id * I(11), s, (size_t)I(7) * 4);
            }
        }
        free(rot);
        return 0;
    }
    default: { /* a small record of the others: as a team of one */
        lp_team solo = {0};
        lp_par one = {&solo, 0, 1, 0};
        return ex_par_record(&one, r);
    }
    }
}

typedef struct {
    const int64_t *recs;
    int64_t n_rec;
} ex_job;

/* Every thread walks the records, as ggml's threads walk a graph. Barriers: before a shared-out
 * record (its inputs are whole), and before the first serial record after one; a run of serial
 * records is thread 0's alone, in order. A failure is the team's: thread 0 reports a serial
 * record's and meets the others at their next barrier; a shared-out record's is seen by everyone
 * at the barrier after it. */
static int64_t ex_walk(lp_par *p, void *arg) {
    const ex_job *j = arg;
    int prev_par = 0;
    for (int64_t k = 0; k < j->n_rec; k++) {
        const ex_slot *r = (const ex_slot *)(j->recs + k * EX_REC);
        const int par = ex_is_par(r);
        if (k > 0 && (par || prev_par)) {
            lp_par_barrier(p);
            if (lp_par_error(p)) return 0;
        }
        prev_par = par;
        if (par) {
            if (ex_par_record(p, r)) lp_par_fail(p, k + 1);
        } else if (p->ith == 0 && ex_serial_record(r)) {
            lp_par_fail(p, k + 1);
            lp_par_barrier(p);
            return 0;
        }
    }
    lp_par_barrier(p);
    return 0;
}

/* Run records [0, n_rec) on n_threads threads: one team (one OpenMP region) for the whole
 * split. Returns 0, or 1 + the index of the record that failed (a row id out of range, or out
 * of memory); what ran before it has run. */
EX_API int64_t lp_exec_run(const int64_t *recs, int64_t n_rec, int n_threads) {
    ex_job j = {recs, n_rec};
    return lp_par_run(n_threads, ex_walk, &j);
}
