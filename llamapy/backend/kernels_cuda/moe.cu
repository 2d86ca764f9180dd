// The router of a mixture-of-experts FFN on float32 rows (ggml-cuda softmax.cu, argsort.cu,
// getrows.cu's batched rows, sumrows.cu, clamp.cu and binbcast.cu's one-value-per-row DIV / MUL;
// topk-moe.cu fuses the first of them). Launched by llamapy/backend/cuda_ops.py (`soft_max`,
// `argsort`, `get_rows_batched`, `sum_rows`, `clamp`, `binary_row`); the numpy references are
// kernels.py's soft_max, argsort, get_rows, sum_rows, clamp, div, mul and add_id (ggml-cuda
// add-id.cu: the experts' biases). The expert products
// themselves (MUL_MAT_ID) are each weight type's mmv_id_<type> (common.cuh), beside the decoders.
// Rows of a router are short (n_expert logits, n_expert_used weights): a warp or a thread a row.
#include "common.cuh"

// SOFT_MAX without a mask: y = exp(x * scale - max) / sum, one warp per row (grid (rows), 32
// threads). Each operation rounded as numpy's float32 ones; expf is CUDA's (within 2 ulp) and
// the sum a warp's tree, not numpy's pairwise order: within a few ulp of the reference.
// One row by the block's one warp (lane i takes values i, i + 32, ...); y may be x.
__device__ __forceinline__ void warp_softmax(const float* x, float* y, int n, float scale) {
    float m = -__int_as_float(0x7f800000);
    for (int i = threadIdx.x; i < n; i += 32) m = fmaxf(m, __fmul_rn(x[i], scale));
    m = warp_max(m);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += 32) {
        const float e = expf(__fsub_rn(__fmul_rn(x[i], scale), m));
        y[i] = e;
        s = __fadd_rn(s, e);
    }
    s = warp_sum(s);
    for (int i = threadIdx.x; i < n; i += 32) y[i] = __fdiv_rn(y[i], s);
}

extern "C" __global__ void soft_max_f32(const float* __restrict__ x, long long sx, float* __restrict__ y,
                                        long long sy, int n, float scale) {
    warp_softmax(x + (long long)blockIdx.x * sx, y + (long long)blockIdx.x * sy, n, scale);
}

// ARGSORT, descending, equal values in index order (kernels.argsort: a stable sort of -x): each
// value's rank is the number of values before it in that order, so y[rank] = its index. One
// block a row, the threads over the values (O(n^2) comparisons: n is the number of experts).
__device__ __forceinline__ int rank_desc(const float* x, int n, int i) {
    const float v = x[i];
    int rank = 0;
    for (int j = 0; j < n; ++j) rank += (x[j] > v) || (x[j] == v && j < i);
    return rank;
}

extern "C" __global__ void argsort_desc_f32(const float* __restrict__ x, long long sx, int* __restrict__ y,
                                            long long sy, int n) {
    const float* xr = x + (long long)blockIdx.x * sx;
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[(long long)blockIdx.x * sy + rank_desc(xr, n, i)] = i;
}

// GET_ROWS of a batch: y[b, i, :] = t[b, ids[b * sid + i], :] (rows of C; t's batch stride sb and
// row stride sr, y contiguous (B, n_ids, C)); one thread an element. An id outside [0, R) gives
// NaN.
extern "C" __global__ void get_rows_batched_f32(const float* __restrict__ t, long long sb, long long sr, int R,
                                                const int* __restrict__ ids, long long sid, float* __restrict__ y,
                                                int B, int n_ids, int C) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)B * n_ids * C) return;
    const int c = (int)(g % C);
    const long long bi = g / C;
    const int b = (int)(bi / n_ids), i = (int)(bi % n_ids);
    const int r = ids[(long long)b * sid + i];
    y[g] = (r < 0 || r >= R) ? __int_as_float(0x7fc00000) : t[(long long)b * sb + (long long)r * sr + c];
}

// SUM_ROWS as ggml_vec_sum_f32 (kernels.sum_rows): each row summed in order in double, rounded to
// float32 once; one thread a row, y one value a row.
extern "C" __global__ void sum_rows_f32(const float* __restrict__ x, long long sx, float* __restrict__ y, int rows,
                                        int n) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * sx;
    double s = 0.0;
    for (int i = 0; i < n; ++i) s = __dadd_rn(s, (double)xr[i]);
    y[r] = (float)s;
}

// CLAMP: y = min(max(x, lo), hi) (np.clip), grid (ceil(n / blockDim.x), rows), y contiguous rows of n
extern "C" __global__ void clamp_f32(const float* __restrict__ x, long long sx, float* __restrict__ y, int n,
                                     float lo, float hi) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    y[r * n + i] = fminf(fmaxf(x[r * sx + i], lo), hi);
}

// MUL / DIV by one value per row (the router's weights: the normalisation by each token's sum, the
// slots' outputs by their weights): y[r, i] = a[r, i] op b[r * sb]; op 0 MUL, 1 DIV. Grid
// (ceil(n / blockDim.x), rows); y may be a.
extern "C" __global__ void binary_row_f32(const float* a, long long sa, const float* __restrict__ b, long long sb,
                                          float* y, long long sy, int n, int op) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    const float av = a[r * sa + i], bv = b[r * sb];
    y[r * sy + i] = op == 0 ? __fmul_rn(av, bv) : __fdiv_rn(av, bv);
}

// The router as one launch (ggml-cuda's topk-moe.cu fuses the same chain): SOFT_MAX of a token's
// logits, their ARGSORT (every index, written to ids: the experts are its first n_used), the
// chosen probabilities, their sum (in double, in order), CLAMP(lo, hi) and the DIV; w gets the
// n_used normalised weights. Each step computes what its own kernel above computes, in the same
// order, so the results are those of the six launches bit for bit. One warp a row; dynamic shared
// memory: 4 * (n + n_used) bytes.
extern "C" __global__ void router_f32(const float* __restrict__ x, long long sx, int* __restrict__ ids,
                                      float* __restrict__ w, int n, int n_used, float scale, float lo, float hi) {
    extern __shared__ float router_smem[];
    float* p = router_smem;       // n probabilities
    float* sel = p + n;           // n_used chosen ones
    warp_softmax(x + (long long)blockIdx.x * sx, p, n, scale);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += 32) {
        const int rank = rank_desc(p, n, i);
        ids[(long long)blockIdx.x * n + rank] = i;
        if (rank < n_used) sel[rank] = p[i];
    }
    __syncthreads();
    double t = 0.0;
    for (int u = 0; u < n_used; ++u) t = __dadd_rn(t, (double)sel[u]);
    const float c = fminf(fmaxf((float)t, lo), hi);
    for (int u = threadIdx.x; u < n_used; u += 32) w[(long long)blockIdx.x * n_used + u] = __fdiv_rn(sel[u], c);
}

// ADD_ID (gpt-oss's expert biases, ggml_add_id; kernels.add_id): y[p, i] = a[p * sa + i] +
// b[e * sb + i], e = ids[(p / n_used) * sid + p % n_used], for the rows p of the (token, slot)
// pairs; grid (ceil(n / blockDim.x), pairs). y may be a. An id outside [0, n_expert) gives NaN.
extern "C" __global__ void add_id_f32(const float* a, long long sa, const float* __restrict__ b, long long sb,
                                      int n_expert, const int* __restrict__ ids, long long sid, float* y,
                                      long long sy, int n, int n_used) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long p = blockIdx.y;
    const int e = ids[(p / n_used) * sid + p % n_used];
    const float bv = (e < 0 || e >= n_expert) ? __int_as_float(0x7fc00000) : b[(long long)e * sb + i];
    y[p * sy + i] = __fadd_rn(a[p * sa + i], bv);
}

// gpt-oss's router as one launch ("softmax_weight" gating): the ARGSORT of a token's (biased)
// logits (every index, written to ids: the experts are its first n_used), the chosen logits and
// the SOFT_MAX of those n_used (times scale), into w. Each step computes what argsort_desc_f32
// and soft_max_f32 compute, in the same order (a lane's strided sum, then the warp's), so the
// results are those of the three launches bit for bit. The row is read into shared memory before
// anything is written (ids or w may lie over this row's logits). One warp a row; dynamic shared
// memory: 4 * (n + n_used) bytes.
extern "C" __global__ void router_topk_f32(const float* x, long long sx, int* ids, float* w, int n, int n_used,
                                           float scale) {
    extern __shared__ float topk_smem[];
    float* v = topk_smem;   // n logits
    float* sel = v + n;     // n_used chosen ones
    const float* xr = x + (long long)blockIdx.x * sx;
    for (int i = threadIdx.x; i < n; i += 32) v[i] = xr[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += 32) {
        const int rank = rank_desc(v, n, i);
        ids[(long long)blockIdx.x * n + rank] = i;
        if (rank < n_used) sel[rank] = v[i];
    }
    __syncthreads();
    warp_softmax(sel, w + (long long)blockIdx.x * n_used, n_used, scale);
}

// -- MUL_MAT_ID of a prompt (more tokens than mmv_id takes): the (token, slot) pairs grouped by
// expert, so that each used expert's rows are decoded to f16 once and multiplied with all its
// pairs' rows by one GEMM (cuda_ops.mul_mat_id_gemm; ggml-cuda's mmid helpers and vLLM's
// moe_align group the same way). The numpy reference is kernels.mul_mat_id (+ add_id, glu).

// The grouping, one block: offs (n_expert + 2 int32) gets each expert's first row of the sorted
// order (offs[e] .. offs[e + 1]; ids outside [0, n_expert) last, as bucket n_expert) and order
// (n_tok * n_used int32) the pair index t * n_used + u of each sorted row, in pair order within
// an expert (deterministic: a pair's sums do not depend on the grouping). Thread e counts and
// then places its bucket's pairs; thread 0 turns the counts into offsets between the two.
extern "C" __global__ void moe_sort(const int* __restrict__ ids, long long sid, int n_tok, int n_used, int n_expert,
                                    int* __restrict__ order, int* __restrict__ offs) {
    const int n_pairs = n_tok * n_used;
    for (int e = threadIdx.x; e <= n_expert; e += blockDim.x) {
        int n = 0;
        for (int p = 0; p < n_pairs; ++p) {
            const int id = ids[(long long)(p / n_used) * sid + p % n_used];
            n += (id < 0 || id >= n_expert ? n_expert : id) == e;
        }
        offs[e + 1] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offs[0] = 0;
        for (int e = 0; e <= n_expert; ++e) offs[e + 1] += offs[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= n_expert; e += blockDim.x) {
        int k = offs[e];
        for (int p = 0; p < n_pairs; ++p) {
            const int id = ids[(long long)(p / n_used) * sid + p % n_used];
            if ((id < 0 || id >= n_expert ? n_expert : id) == e) order[k++] = p;
        }
    }
}

// Where sorted row r's GEMM row lies: r itself (pad 0: the experts' rows one after another, a GEMM
// an expert), or, for the GEMMs batched over the experts (each expert's rows padded to `pad`),
// row r - offs[e] of expert e's block of pad rows (-1: an id out of range, no GEMM row).
__device__ __forceinline__ long long moe_gemm_row(int e, int n_expert, const int* __restrict__ offs, int pad,
                                                  long long r) {
    if (!pad) return r;
    return e < 0 || e >= n_expert ? -1 : (long long)e * pad + (r - offs[e]);
}

// The GEMM's input: sorted row r = the input row of pair order[r] = t * n_used + u (x + t * sxt +
// u * sxu; sxu 0: one row a token) rounded to f16 (cpy_f32_f16's rounding and scale: x / s with
// n_part partial maxima of the pairs' rows, ab = {s, 0}), at its GEMM row (moe_gemm_row: ids of
// sid, the offsets and pad). Grid (ceil(n / blockDim.x), rows).
extern "C" __global__ void moe_gather_f16(const float* __restrict__ x, long long sxt, long long sxu,
                                          const int* __restrict__ order, const int* __restrict__ ids, long long sid,
                                          int n_used, int n_expert, const int* __restrict__ offs, int pad,
                                          unsigned short* __restrict__ y, int n, const float* __restrict__ part,
                                          int n_part, float* ab) {
    const float inv = f16_input_scale(part, n_part, ab);  // (every thread: it synchronizes)
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = blockIdx.y;
    const int p = order[r];
    const long long g = moe_gemm_row(ids[(long long)(p / n_used) * sid + p % n_used], n_expert, offs, pad, r);
    if (g < 0) return;
    y[g * n + i] = f32_to_f16(__fmul_rn(x[(long long)(p / n_used) * sxt + (long long)(p % n_used) * sxu + i], inv));
}

// The GEMM's rows back to their pairs with mmv_id's epilogue: sorted row r's GEMM row of prod
// (moe_gemm_row; ldp floats apart; the gate's sums at column 0, the up's at column M when op >= 0)
// is pair p = order[r], expert e = ids of p; y[p * M + i] = the sum + b[e * sb + i] (b optional),
// or op(gate + b, up + b2) (0 SwiGLU, 1 GEGLU, 2 swiglu_oai with alpha and limit): the bits of
// add_id and glu.cu after the product. An expert outside [0, n_expert) gives NaN rows, as mmv_id.
// Grid (ceil(M / blockDim.x), rows).
extern "C" __global__ void moe_scatter(const float* __restrict__ prod, long long ldp, const int* __restrict__ order,
                                       const int* __restrict__ ids, long long sid, int n_used, int n_expert,
                                       const int* __restrict__ offs, int pad, float* __restrict__ y, int M, int op,
                                       const float* __restrict__ b, const float* __restrict__ b2, long long sb,
                                       float alpha, float limit) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const long long r = blockIdx.y;
    const int p = order[r];
    const int e = ids[(long long)(p / n_used) * sid + p % n_used];
    const long long g = moe_gemm_row(e, n_expert, offs, pad, r);
    float out = __int_as_float(0x7fc00000);
    if (e >= 0 && e < n_expert) {
        float v = prod[g * ldp + i];
        if (b) v = __fadd_rn(v, b[(long long)e * sb + i]);
        out = v;
        if (op >= 0) {
            float up = prod[g * ldp + M + i];
            if (b2) up = __fadd_rn(up, b2[(long long)e * sb + i]);
            out = op == 0 ? silu_mul(v, up) : op == 1 ? __fmul_rn(gelu_f16(v), up) : swiglu_oai_mul(v, up, alpha, limit);
        }
    }
    y[(long long)p * M + i] = out;
}
