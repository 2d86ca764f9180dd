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
 * Threads: `n_threads` of each call go to the matvecs and attention (OpenMP regions inside them),
 * and to the row-wise records (norms, elementwise ops, rope, SwiGLU, copies) of a big batch,
 * whose rows are shared out (ex_rows: each row computed as alone, so the same bits); nothing
 * here keeps thread state between calls, so contexts with different -t do not interfere.
 * Built like the other kernels_c sources (-ffp-contract=off: no FMA contraction).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EX_API __attribute__((visibility("default")))

#ifdef _OPENMP
#include <omp.h>
/* qmatmul.c: set in a child made by fork(), where libgomp cannot run: there the row-wise records
 * stay on the calling thread, as the kernels do */
extern volatile int lp_fork_child;
#endif
/* elements of a row-wise record from which its rows are shared out among the threads (a prompt's
 * micro-batch: 512 x 2048; a decode step's records stay on one thread) */
#define EX_PAR_MIN (1 << 16)

/* ops.c (attention threads itself, up to n_threads, and stays on the calling thread in a fork
 * child, where libgomp cannot run) */
void lp_attend(const float *q, int64_t T, int64_t H, int64_t D, const float *k, const float *v, int64_t N,
               int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh, const float *mask,
               int64_t mask_st, float scale, float *out, int n_threads);
void lp_attend_f16(const float *q, int64_t T, int64_t H, int64_t D, const uint16_t *k, const uint16_t *v, int64_t N,
                   int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh,
                   const float *mask, int64_t mask_st, float scale, float *out, int n_threads);
void lp_attend_q(const float *q, int64_t T, int64_t H, int64_t D, const void *k, const void *v, int64_t N,
                 int64_t Hkv, int64_t Dv, int64_t k_sn, int64_t k_sh, int64_t v_sn, int64_t v_sh, const float *mask,
                 int64_t mask_st, float scale, float *out, int kt, int vt, int n_threads);
void lp_hadamard_runs(float *x, int64_t len, int64_t n, float c);
void lp_kv_quantize_row(void *dst, const float *x, int64_t n, int t);
void lp_swiglu(const float *gate, const float *up, int64_t rows, int64_t n, int64_t gate_st, int64_t up_st,
               float *out);

/* qmatmul.c: MUL_MAT with quantized activations (lp_quants.h) */
int lp_quantize_act(int ggml_type, const float *x, int64_t ld_x, int64_t n_in, int64_t n_tok, void *xq,
                    int n_threads);
int lp_mul_mat_q(int ggml_type, const void *w, int64_t n_rows, int64_t row_bytes, int64_t n_in, const void *xq,
                 int64_t n_tok, float *y, int64_t ld_y, int n_threads);

/* the matvec ABI of qmatmul.c's lp_mv_<t> */
typedef void (*mv_fn)(const void *const *parts, int64_t n_tiles, int64_t nb, const float *x, int64_t n_tok,
                      float *out, int64_t ld_out, int n_threads);
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
};

#define EX_REC 24

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
 * block) units, or with few units their chunks of cells, among up to n_threads threads once the
 * work is big enough; each query's output is the same whatever the thread count. */
static int attention(const ex_slot *r, int n_threads) {
    const int kt = (int)I(18), vt = (int)I(19);
    if (kt == vt && kt <= 1 && !I(20) && !I(21)) { /* f32 or f16 K and V */
        if (kt)
            lp_attend_f16(P(2), I(6), I(7), I(8), P(3), P(4), I(9), I(10), I(11), I(12), I(13), I(14), I(15), P(5),
                          I(16), (float)F(17), P(1), n_threads);
        else
            lp_attend(P(2), I(6), I(7), I(8), P(3), P(4), I(9), I(10), I(11), I(12), I(13), I(14), I(15), P(5), I(16),
                      (float)F(17), P(1), n_threads);
        return 0;
    }
    /* a quantized cache (Q8_0/Q4_0 blocks, strides in bytes), maybe rotated (llama.cpp's
     * attn_rot): Q into K's rotated basis first, the output back from V's after */
    const int64_t nq = I(6) * I(7) * I(8);
    const float *q = P(2);
    float *qr = NULL;
    if (I(20)) {
        qr = malloc((size_t)nq * sizeof(float));
        if (!qr) return 1;
        memcpy(qr, q, (size_t)nq * sizeof(float));
        lp_hadamard_runs(qr, nq, I(20), (float)F(22));
        q = qr;
    }
    lp_attend_q(q, I(6), I(7), I(8), P(3), P(4), I(9), I(10), I(11), I(12), I(13), I(14), I(15), P(5), I(16),
                (float)F(17), P(1), kt, vt, n_threads);
    if (I(21)) lp_hadamard_runs(P(1), I(6) * I(7) * I(11), I(21), (float)F(23));
    free(qr);
    return 0;
}

/* Rows [r0, r1) of a row-wise record (each row computed on its own: the same bits in any split). */
static void ex_rows(const ex_slot *r, int64_t r0, int64_t r1) {
    switch (I(0)) {
    case EX_RMS_NORM: {
        /* dst (rows, n) = rms_norm(x) [* w]: [6] rows, [7] n, [8] x stride, [9] eps, src1 w or
         * NULL; fused add first when [10] is set: x = [10] (rows, n) = src2 + src3 (strides
         * [11], [12]; 0: a broadcast row) */
        const int64_t n = I(7);
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
    case EX_ADD: {
        /* dst (rows, n) = a op b: [6] rows, [7] n, [8] a stride, [9] b stride (0: broadcast) */
        const float *a = P(2), *b = P(3);
        float *d = P(1);
        const int64_t n = I(7);
        for (int64_t t = r0; t < r1; t++) {
            const float *ar = a + t * I(8), *br = b + t * I(9);
            float *dr = d + t * n;
            if (I(0) == EX_MUL)
                for (int64_t i = 0; i < n; i++) dr[i] = ar[i] * br[i];
            else
                for (int64_t i = 0; i < n; i++) dr[i] = ar[i] + br[i];
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
        /* [6] rows, [7] n, [8] gate stride, [9] up stride */
        lp_swiglu((const float *)P(2) + r0 * I(8), (const float *)P(3) + r0 * I(9), r1 - r0, I(7), I(8), I(9),
                  (float *)P(1) + r0 * I(7));
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

/* a row-wise record: its rows ([6]: rows or tokens) on up to n_threads threads when it is big */
static void ex_rows_run(const ex_slot *r, int n_threads) {
    const int64_t rows = I(6);
    int64_t work = rows * I(7);
    if (I(0) == EX_ROPE) work *= I(8);
#ifdef _OPENMP
    if (n_threads > 1 && rows > 1 && work >= EX_PAR_MIN && !lp_fork_child && !omp_in_parallel()) {
        const int nt = rows < n_threads ? (int)rows : n_threads;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int c = 0; c < nt; c++) ex_rows(r, c * rows / nt, (c + 1) * rows / nt);
        return;
    }
#else
    (void)n_threads;
    (void)work;
#endif
    ex_rows(r, 0, rows);
}

/* Bit 0: SET_ROWS into an f16 cache is available (the compiler has _Float16). */
EX_API int64_t lp_exec_caps(void) {
#if defined(__FLT16_MAX__)
    return 1;
#else
    return 0;
#endif
}

/* Run records [0, n_rec). Returns 0, or 1 + the index of the record that failed (a row id out
 * of range, or out of memory); what ran before it has run. */
EX_API int64_t lp_exec_run(const int64_t *recs, int64_t n_rec, int n_threads) {
    for (int64_t k = 0; k < n_rec; k++) {
        const ex_slot *r = (const ex_slot *)(recs + k * EX_REC);
        switch (I(0)) {
        case EX_GET_ROWS_Q: {
            /* dst (n, n_in) <- rows ids of a repacked matrix: [6] n, [7] n_in, [8] nb, [9] dqr,
             * [10] parts, [11] n_full, [12] tail f32 rows, [13] n_rows */
            const int32_t *ids = P(2);
            float *dst = P(1);
            const int64_t n_in = I(7);
            for (int64_t i = 0; i < I(6); i++) {
                const int64_t id = ids[i];
                if (id < 0 || id >= I(13)) return k + 1;
                if (id < I(11))
                    ((dqr_fn)P(9))((const void *const *)P(10), I(8), &id, 1, dst + i * n_in);
                else
                    memcpy(dst + i * n_in, (const float *)P(12) + (id - I(11)) * n_in, (size_t)n_in * 4);
            }
            break;
        }
        case EX_GET_ROWS_F32: {
            /* dst (n, c) <- rows ids of src: [6] n, [7] c, [8] src row stride, [9] src rows */
            const float *src = P(2);
            const int32_t *ids = P(3);
            float *dst = P(1);
            for (int64_t i = 0; i < I(6); i++) {
                if (ids[i] < 0 || ids[i] >= I(9)) return k + 1;
                memcpy(dst + i * I(7), src + ids[i] * I(8), (size_t)I(7) * 4);
            }
            break;
        }
        case EX_RMS_NORM:
        case EX_MUL:
        case EX_ADD:
        case EX_SCALE:
        case EX_SWIGLU:
        case EX_ROPE:
        case EX_CPY:
            ex_rows_run(r, n_threads);
            break;
        case EX_MUL_MAT: {
            /* dst (n_tok, n_out) = x @ W.T: [6] n_tok, [7] n_in, [8] x stride (== n_in for the
             * matvec), [9] mv fn or NULL, [10] parts, [11] n_tiles, [12] nb, [13] n_out,
             * [14] n_full (rows in tiles), [15] f32 rows n_full.. (or all rows: no fn) */
            const int64_t n_tok = I(6), n_in = I(7), n_out = I(13), n_full = I(14);
            float *dst = P(1);
            if (P(9) && I(11) > 0)
                ((mv_fn)P(9))((const void *const *)P(10), I(11), I(12), P(2), n_tok, dst, n_out, n_threads);
            if (n_full < n_out)
                mm_f32(P(2), n_tok, n_in, I(8), P(15), n_out - n_full, dst + n_full, n_out);
            break;
        }
        case EX_SET_ROWS: {
            /* rows ids (int64, src1) of dst <- rows of src2: [6] n, [7] cols, [8] src stride,
             * [9] dst rows, [10] dst type (0 f32, 1 f16, 2 Q8_0, 3 Q4_0: ops.c's LP_KV_*),
             * [11] dst row stride (elements; bytes for Q8_0/Q4_0), [12] rotation run (0: none),
             * [13] its scale (a rotated cache stores each row rotated, then quantized) */
            const int64_t *ids = P(3);
            const float *src = P(4);
            float *rot = NULL;
            if (I(12) && !(rot = malloc((size_t)I(7) * sizeof(float)))) return k + 1;
            for (int64_t i = 0; i < I(6); i++) {
                const int64_t id = ids[i];
                if (id < 0 || id >= I(9)) {
                    free(rot);
                    return k + 1;
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
            break;
        }
        case EX_ATTN:
            /* src0 q (T,H,D) contiguous, src1 k, src2 v, src3 mask: [6] T, [7] H, [8] D, [9] N,
             * [10] Hkv, [11] Dv, [12..15] k/v strides (in their storage units), [16] mask stride,
             * [17] scale, [18] / [19] K / V type (ops.c's LP_KV_*), [20] / [21] K / V rotation run
             * (0: none), [22] / [23] their scales */
            if (attention(r, n_threads)) return k + 1;
            break;
        case EX_QUANT_ACT:
            /* dst xq <- src0 x: [6] weight type, [7] x row stride, [8] n_in, [9] n_tok */
            if (lp_quantize_act((int)I(6), P(2), I(7), I(8), I(9), P(1), n_threads) != 0) return k + 1;
            break;
        case EX_MUL_MAT_Q:
            /* dst y <- W (src0, the file's rows) . xq (src1): [6] type, [7] n_rows, [8] row bytes,
             * [9] n_in, [10] n_tok, [11] y row stride */
            if (lp_mul_mat_q((int)I(6), P(2), I(7), I(8), I(9), P(3), I(10), P(1), I(11), n_threads) != 0)
                return k + 1;
            break;
        default:
            return k + 1;
        }
    }
    return 0;
}
