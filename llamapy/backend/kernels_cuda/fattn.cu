// FLASH_ATTN_EXT for few query tokens (decode): all heads in one launch, grouped-query heads
// sharing each K/V row they read, the cells split over thread blocks for long histories and the
// splits' partial softmaxes combined by a second kernel (ggml-cuda fattn-vec.cuh and
// fattn-common.cuh's flash_attn_combine_results; read to understand, not copied). K and V are
// read where the cache holds them: f32, f16, Q8_0 or Q4_0 blocks, in any combination. Launched
// by llamapy/backend/cuda_ops.py (`flash_attn_ext`); the numpy reference is kernels.py's
// flash_attn_ext (attended, cache_rotation, _flash_attn_ext).
//
// What the op computes (ops.flash_attn_ext): out[t, h] = softmax(q[t, h] . K^T * scale +
// mask[t]) V over the first n_kv cells, query head h reading KV head h / (H / Hkv). n_kv, the
// mask's width, is read from device memory when `n_kv_dev` is given, so one launch (one captured
// CUDA graph) serves every length of history; the grid is fixed, and a split whose cells all lie
// beyond n_kv does nothing.
// Attention sinks (gpt-oss; `sinks` not null: one float32 logit per query head) join each row's
// softmax as one more score with no value row: its maximum and its denominator, not its sum of
// values; with split cells the combine adds them, once.
// Over a quantized K, Q is first rounded through Q8_0 (its vec_dot_type, quants.round_trip_q8_0)
// as llama.cpp does; over a rotated cache (attn_rot) Q is rotated into K's basis before that and
// the output rotated back from V's.
//
// Numerics: float32 throughout, as the reference's; the dot products over D are sums in a
// different order (a lane's strided terms, then a warp butterfly), the softmax is online (per
// tile of TILE cells, rescaled) where the reference normalises whole rows: results agree within
// float32 rounding of the sums (~1e-6 relative), not bit for bit.
#include "common.cuh"

#define CT_F32 0
#define CT_F16 1
#define CT_Q8_0 2
#define CT_Q4_0 3

#define FA_TILE 64       // cells per tile of the online softmax
#define FA_THREADS 128   // threads per block (4 warps)
#define FA_MAX_D 256     // largest head size (8 elements a lane)

// element d of one head's row of a cache of type T (cpu_kernels.KV_CODES)
template <int T>
__device__ __forceinline__ float kv_elem(const u8* head, int d) {
    if (T == CT_F32) return reinterpret_cast<const float*>(head)[d];
    if (T == CT_F16) return f16_to_f32(reinterpret_cast<const unsigned short*>(head)[d]);
    if (T == CT_Q8_0) {
        const u8* b = head + (d >> 5) * 34;
        return LP_MUL((float)(signed char)b[2 + (d & 31)], ld_f16(b));
    }
    const u8* b = head + (d >> 5) * 18;  // Q4_0: element j low nibble of byte j, j + 16 high
    const int j = d & 31;
    const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
    return LP_MUL(ld_f16(b), (float)(q - 8));
}

// Q8_0 round trip of 32 floats in place (quants.round_trip_q8_0: ggml's reference quantizer,
// then d_f16 * q)
__device__ __forceinline__ void round_trip_q8_0(float* v) {
    float amax = 0.0f;
    for (int k = 0; k < 32; ++k) amax = fmaxf(amax, fabsf(v[k]));
    const float d = __fdiv_rn(amax, 127.0f);
    const float inv = d == 0.0f ? 0.0f : __fdiv_rn(1.0f, d);
    const float dh = f16_to_f32(f32_to_f16(d));
    for (int k = 0; k < 32; ++k) v[k] = LP_MUL((float)(int)roundf(__fmul_rn(v[k], inv)), dh);
}

// The steps both kernels share, over `rows` rows (the decode kernel's query heads, the prompt
// kernel's query rows).
// After Q's rows are in q_s: the accumulators zeroed, the running maxima and sums started, and Q
// rotated and rounded through Q8_0 as a rotated / quantized cache's K was.
template <int KT>
__device__ __forceinline__ void fa_start_rows(float* q_s, float* acc_s, float* m_s, float* l_s, int rows, int D,
                                              int Dv, int rot_k, float rot_k_scale) {
    for (int i = threadIdx.x; i < rows * Dv; i += blockDim.x) acc_s[i] = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        m_s[r] = __int_as_float(0xff800000);
        l_s[r] = 0.0f;
    }
    __syncthreads();
    if (rot_k) block_hadamard(q_s, rows * D, rot_k, rot_k_scale);
    if (KT == CT_Q8_0 || KT == CT_Q4_0) {
        for (int b = threadIdx.x; b < rows * D / 32; b += blockDim.x) round_trip_q8_0(q_s + 32 * b);
        __syncthreads();
    }
}

// Over a tile of nt cells, the rows' scores FA_TILE apart in p_s:
// Online softmax, a warp per row: p_s's scores become probabilities against the running maximum
// m_s; l_s is rescaled and summed, c_s gets the rescale of what was summed before.
__device__ __forceinline__ void fa_softmax_tile(float* p_s, float* m_s, float* l_s, float* c_s, int rows, int nt) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    const float NEG_INF = __int_as_float(0xff800000);
    for (int r = warp; r < rows; r += n_warps) {
        float* pg = p_s + r * FA_TILE;
        float mx = NEG_INF;
        for (int jj = lane; jj < nt; jj += 32) mx = fmaxf(mx, pg[jj]);
        mx = warp_max(mx);
        const float m_old = m_s[r];
        const float m_new = fmaxf(m_old, mx);
        float sum = 0.0f;
        for (int jj = lane; jj < nt; jj += 32) {
            const float p = m_new == NEG_INF ? 0.0f : expf(pg[jj] - m_new);
            pg[jj] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            const float corr = m_old == NEG_INF ? 0.0f : expf(m_old - m_new);
            c_s[r] = corr;
            l_s[r] = l_s[r] * corr + sum;
            m_s[r] = m_new;
        }
    }
    __syncthreads();
}

// acc = acc * corr + P V over the tile's cells (v0: the tile's first V row, v_cb bytes apart): a
// thread per (row, column); cells of probability 0 (masked) are not read.
template <int VT>
__device__ __forceinline__ void fa_accumulate_pv(float* acc_s, const float* p_s, const float* c_s, int rows, int Dv,
                                                 int nt, const u8* v0, long long v_cb) {
    for (int i = threadIdx.x; i < rows * Dv; i += blockDim.x) {
        const int r = i / Dv, d = i - r * Dv;
        const float* pg = p_s + r * FA_TILE;
        float a = acc_s[i] * c_s[r];
        for (int jj = 0; jj < nt; ++jj) {
            const float p = pg[jj];
            if (p != 0.0f) a += p * kv_elem<VT>(v0 + jj * v_cb, d);
        }
        acc_s[i] = a;
    }
    __syncthreads();
}

// Arguments of both kernels (element strides are in floats, cache strides in bytes):
//   q (T, H, D) f32 at q[t * sqt + h * sqh + d]
//   k, v: the caches; cell c, KV head j at k + c * k_cb + j * k_hb (v alike); n_cells of them
//   mask: (T, >= n_kv) f32, row t at mask + t * sm (sm 0: rows n_kv apart, a compact mask)
//   n_kv: the cells attended, or *n_kv_dev when n_kv_dev is not null
//   out (T, H, Dv) f32 at out[t * sot + h * soh + d]
//   part: scratch for gridDim.z > 1 splits: T * H * S * (Dv + 2) floats (cuda_ops.fattn_scratch)
//   rot_k / rot_v: 0 or the Hadamard orders of a rotated cache, with their 1/sqrt scales
//   sinks: nullable, (H,) float32 sink logits
// Grid (Hkv, T, S), FA_THREADS threads; dynamic shared memory
// (G * D + G * FA_TILE + G * Dv + 3 * G) floats, G = H / Hkv.
template <int KT, int VT>
__device__ __forceinline__ void fattn_impl(
    const float* __restrict__ q, long long sqt, long long sqh, const u8* __restrict__ k, long long k_cb,
    long long k_hb, const u8* __restrict__ v, long long v_cb, long long v_hb, long long n_cells,
    const float* __restrict__ mask, long long sm, int n_kv, const int* __restrict__ n_kv_dev,
    float* __restrict__ out, long long sot, long long soh, float* __restrict__ part, int H, int Hkv,
    int D, int Dv, float scale, int rot_k, float rot_k_scale, int rot_v, float rot_v_scale,
    const float* __restrict__ sinks) {
    extern __shared__ float smem[];
    const int j = blockIdx.x, t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    const int G = H / Hkv;
    float* q_s = smem;                 // (G, D)
    float* p_s = q_s + G * D;          // (G, FA_TILE) scores, then probabilities
    float* acc_s = p_s + G * FA_TILE;  // (G, Dv)
    float* m_s = acc_s + G * Dv;       // (G,) running maximum
    float* l_s = m_s + G;              // (G,) running sum
    float* c_s = l_s + G;              // (G,) this tile's rescale of the sums so far
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    const float NEG_INF = __int_as_float(0xff800000);

    long long n = n_kv_dev ? (long long)*n_kv_dev : (long long)n_kv;
    n = n < 0 ? 0 : (n > n_cells ? n_cells : n);
    const float* mrow = mask + (long long)t * (sm ? sm : n);
    long long chunk = (n + S - 1) / S;
    chunk = (chunk + FA_TILE - 1) / FA_TILE * FA_TILE;
    const long long c0 = (long long)s * chunk;
    const long long c1 = c0 + chunk < n ? c0 + chunk : n;

    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i - g * D;
        q_s[i] = q[(long long)t * sqt + (long long)(j * G + g) * sqh + d];
    }
    fa_start_rows<KT>(q_s, acc_s, m_s, l_s, G, D, Dv, rot_k, rot_k_scale);

    const u8* kh = k + (long long)j * k_hb;
    const u8* vh = v + (long long)j * v_hb;
    for (long long c = c0; c < c1; c += FA_TILE) {
        const int nt = (int)(c1 - c < FA_TILE ? c1 - c : FA_TILE);
        // a tile the mask hides entirely (a prompt's causal future, a sliding window's past)
        // changes nothing: skipped by the whole block
        const bool seen = threadIdx.x < nt && mrow[c + threadIdx.x] != NEG_INF;
        if (!__syncthreads_or(seen)) continue;
        // 1. scores: a warp per cell, a lane per 32nd of the head; masked cells are not read
        for (int jj = warp; jj < nt; jj += n_warps) {
            const float mv = mrow[c + jj];
            if (mv == NEG_INF) {
                for (int g = lane; g < G; g += 32) p_s[g * FA_TILE + jj] = NEG_INF;
                continue;
            }
            const u8* krow = kh + (c + jj) * k_cb;
            float kr[FA_MAX_D / 32];
#pragma unroll
            for (int i = 0; i < FA_MAX_D / 32; ++i) kr[i] = (lane + 32 * i < D) ? kv_elem<KT>(krow, lane + 32 * i) : 0.0f;
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < FA_MAX_D / 32; ++i)
                    if (lane + 32 * i < D) dot += q_s[g * D + lane + 32 * i] * kr[i];
                dot = warp_sum(dot);
                if (lane == 0) p_s[g * FA_TILE + jj] = __fadd_rn(__fmul_rn(dot, scale), mv);
            }
        }
        __syncthreads();
        // 2. online softmax: a warp per query head; 3. acc = acc * corr + P V
        fa_softmax_tile(p_s, m_s, l_s, c_s, G, nt);
        fa_accumulate_pv<VT>(acc_s, p_s, c_s, G, Dv, nt, vh + c * v_cb, v_cb);
    }

    const long long th = (long long)t * H + (long long)j * G;  // (token, first query head) index
    if (S == 1) {
        if (sinks) {  // the sink's logit: the row's maximum and denominator, rescaled to it
            for (int g = threadIdx.x; g < G; g += blockDim.x) {
                const float sk = sinks[j * G + g], m = m_s[g], M = fmaxf(m, sk);
                const float corr = m == NEG_INF ? 0.0f : expf(m - M);
                c_s[g] = corr;
                l_s[g] = l_s[g] * corr + expf(sk - M);
            }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < G * Dv; i += blockDim.x) {
            const float l = l_s[i / Dv];
            const float a = sinks ? acc_s[i] * c_s[i / Dv] : acc_s[i];
            acc_s[i] = l > 0.0f ? a / l : 0.0f;
        }
        __syncthreads();
        if (rot_v) block_hadamard(acc_s, G * Dv, rot_v, rot_v_scale);
        for (int i = threadIdx.x; i < G * Dv; i += blockDim.x) {
            const int g = i / Dv, d = i - g * Dv;
            out[(long long)t * sot + (long long)(j * G + g) * soh + d] = acc_s[i];
        }
        return;
    }
    // partials: (T, H, S, Dv) unnormalised sums, then (T, H, S, 2) (max, sum)
    const long long n_th = (long long)gridDim.y * H;  // T * H
    float* ml = part + n_th * S * Dv;
    for (int i = threadIdx.x; i < G * Dv; i += blockDim.x) {
        const int g = i / Dv, d = i - g * Dv;
        part[((th + g) * S + s) * Dv + d] = acc_s[i];
    }
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
        ml[((th + g) * S + s) * 2] = m_s[g];
        ml[((th + g) * S + s) * 2 + 1] = l_s[g];
    }
}

// The splits of one (token, query head) merged: grid (H, T), FA_THREADS threads, dynamic shared
// memory Dv floats. `S` is the split count the first kernel ran with.
extern "C" __global__ void __launch_bounds__(FA_THREADS)
    fattn_combine(const float* __restrict__ part, int S, int H, int Dv, float* __restrict__ out,
                  long long sot, long long soh, int rot_v, float rot_v_scale, const float* __restrict__ sinks) {
    extern __shared__ float o_s[];
    const int h = blockIdx.x, t = blockIdx.y;
    const long long th = (long long)t * H + h;
    const float* ml = part + (long long)gridDim.y * H * S * Dv;
    const float NEG_INF = __int_as_float(0xff800000);
    float M = sinks ? sinks[h] : NEG_INF;  // the sink joins the maximum and the denominator once
    for (int s = 0; s < S; ++s) M = fmaxf(M, ml[(th * S + s) * 2]);
    float L = sinks ? expf(sinks[h] - M) : 0.0f;
    for (int s = 0; s < S; ++s) {
        const float m = ml[(th * S + s) * 2];
        if (m != NEG_INF) L += ml[(th * S + s) * 2 + 1] * expf(m - M);
    }
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < S; ++s) {
            const float m = ml[(th * S + s) * 2];
            if (m != NEG_INF) a += part[(th * S + s) * Dv + d] * expf(m - M);
        }
        o_s[d] = L > 0.0f ? a / L : 0.0f;
    }
    __syncthreads();
    if (rot_v) block_hadamard(o_s, Dv, rot_v, rot_v_scale);
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) out[(long long)t * sot + (long long)h * soh + d] = o_s[d];
}

#define LP_FATTN_KERNEL(kname, vname, KT, VT)                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) fattn_##kname##_##vname(              \
        const float* q, long long sqt, long long sqh, const u8* k, long long k_cb, long long k_hb,    \
        const u8* v, long long v_cb, long long v_hb, long long n_cells, const float* mask,            \
        long long sm, int n_kv, const int* n_kv_dev, float* out, long long sot, long long soh,        \
        float* part, int H, int Hkv, int D, int Dv, float scale, int rot_k, float rot_k_scale,        \
        int rot_v, float rot_v_scale, const float* sinks) {                                           \
        fattn_impl<KT, VT>(q, sqt, sqh, k, k_cb, k_hb, v, v_cb, v_hb, n_cells, mask, sm, n_kv,       \
                           n_kv_dev, out, sot, soh, part, H, Hkv, D, Dv, scale, rot_k, rot_k_scale,   \
                           rot_v, rot_v_scale, sinks);                                                \
    }

#define LP_FATTN_V(kname, KT)                    \
    LP_FATTN_KERNEL(kname, f32, KT, CT_F32)      \
    LP_FATTN_KERNEL(kname, f16, KT, CT_F16)      \
    LP_FATTN_KERNEL(kname, q8_0, KT, CT_Q8_0)    \
    LP_FATTN_KERNEL(kname, q4_0, KT, CT_Q4_0)

LP_FATTN_V(f32, CT_F32)
LP_FATTN_V(f16, CT_F16)
LP_FATTN_V(q8_0, CT_Q8_0)
LP_FATTN_V(q4_0, CT_Q4_0)

// ---------------------------------------------------------------------------------------------
// FLASH_ATTN_EXT for prompts (many query tokens; ggml-cuda's fattn-tile.cuh is the counterpart,
// read to understand, not copied): every head and query row of the batch in one launch, a block
// per (query head h, tile of FA_QT consecutive query rows), GQA by reading KV head h / (H / Hkv).
// Each query row has its own mask row (the causal mask of a prompt, a sliding window), width >=
// the cells attended (n_kv, or *n_kv_dev). The cells are stepped through in tiles of FA_TILE
// with the decode kernel's online softmax (scores by a warp per cell: each K row read once for
// the FA_QT rows; a tile no row of the block sees is skipped); float32 math, Q rounded through
// Q8_0 over a quantized K and rotated over a rotated cache, as the decode kernel. Results agree
// with the reference within float32 rounding of the sums, as the decode kernel's.
// Grid (H, ceil(T / FA_QT)), FA_THREADS threads; dynamic shared memory
// (FA_QT * D + FA_QT * FA_TILE + FA_QT * Dv + 3 * FA_QT) floats. Arguments as fattn_impl's.
// ---------------------------------------------------------------------------------------------
#define FA_QT 16  // query rows per block

template <int KT, int VT>
__device__ __forceinline__ void fattn_tile_impl(
    const float* __restrict__ q, long long sqt, long long sqh, const u8* __restrict__ k, long long k_cb,
    long long k_hb, const u8* __restrict__ v, long long v_cb, long long v_hb, long long n_cells,
    const float* __restrict__ mask, long long sm, int n_kv, const int* __restrict__ n_kv_dev,
    float* __restrict__ out, long long sot, long long soh, int T, int H, int Hkv, int D, int Dv, float scale,
    int rot_k, float rot_k_scale, int rot_v, float rot_v_scale, const float* __restrict__ sinks) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, t0 = blockIdx.y * FA_QT;
    const int nq = T - t0 < FA_QT ? T - t0 : FA_QT;
    const int j = h / (H / Hkv);
    float* q_s = smem;                  // (FA_QT, D)
    float* p_s = q_s + FA_QT * D;       // (FA_QT, FA_TILE) scores, then probabilities
    float* acc_s = p_s + FA_QT * FA_TILE;  // (FA_QT, Dv)
    float* m_s = acc_s + FA_QT * Dv;    // (FA_QT,) running maximum
    float* l_s = m_s + FA_QT;           // (FA_QT,) running sum
    float* c_s = l_s + FA_QT;           // (FA_QT,) this tile's rescale
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    const float NEG_INF = __int_as_float(0xff800000);

    long long n = n_kv_dev ? (long long)*n_kv_dev : (long long)n_kv;
    n = n < 0 ? 0 : (n > n_cells ? n_cells : n);
    const float* mrow0 = mask + (long long)t0 * (sm ? sm : n);  // row qi at mrow0 + qi * ms
    const long long ms = sm ? sm : n;

    for (int i = threadIdx.x; i < nq * D; i += blockDim.x) {
        const int qi = i / D, d = i - qi * D;
        q_s[i] = q[(long long)(t0 + qi) * sqt + (long long)h * sqh + d];
    }
    fa_start_rows<KT>(q_s, acc_s, m_s, l_s, nq, D, Dv, rot_k, rot_k_scale);

    const u8* kh = k + (long long)j * k_hb;
    const u8* vh = v + (long long)j * v_hb;
    for (long long c = 0; c < n; c += FA_TILE) {
        const int nt = (int)(n - c < FA_TILE ? n - c : FA_TILE);
        bool seen = false;
        for (int i = threadIdx.x; i < nq * nt; i += blockDim.x) {
            const int qi = i / nt, jj = i - qi * nt;
            seen = seen || mrow0[qi * ms + c + jj] != NEG_INF;
        }
        if (!__syncthreads_or(seen)) continue;
        // 1. scores: a warp per cell, a lane per 32nd of the head; a cell no row sees is not read
        for (int jj = warp; jj < nt; jj += n_warps) {
            float vis = 0.0f;
            for (int qi = lane; qi < nq; qi += 32) vis = mrow0[qi * ms + c + jj] != NEG_INF ? 1.0f : vis;
            if (warp_max(vis) == 0.0f) {
                for (int qi = lane; qi < nq; qi += 32) p_s[qi * FA_TILE + jj] = NEG_INF;
                continue;
            }
            const u8* krow = kh + (c + jj) * k_cb;
            float kr[FA_MAX_D / 32];
#pragma unroll
            for (int i = 0; i < FA_MAX_D / 32; ++i) kr[i] = (lane + 32 * i < D) ? kv_elem<KT>(krow, lane + 32 * i) : 0.0f;
            for (int qi = 0; qi < nq; ++qi) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < FA_MAX_D / 32; ++i)
                    if (lane + 32 * i < D) dot += q_s[qi * D + lane + 32 * i] * kr[i];
                dot = warp_sum(dot);
                if (lane == 0) {
                    const float mv = mrow0[qi * ms + c + jj];
                    p_s[qi * FA_TILE + jj] = mv == NEG_INF ? NEG_INF : __fadd_rn(__fmul_rn(dot, scale), mv);
                }
            }
        }
        __syncthreads();
        // 2. online softmax: a warp per query row; 3. acc = acc * corr + P V
        fa_softmax_tile(p_s, m_s, l_s, c_s, nq, nt);
        fa_accumulate_pv<VT>(acc_s, p_s, c_s, nq, Dv, nt, vh + c * v_cb, v_cb);
    }
    if (sinks) {  // the head's sink logit: each row's maximum and denominator, rescaled to it (as fattn_impl)
        __syncthreads();
        for (int qi = threadIdx.x; qi < nq; qi += blockDim.x) {
            const float sk = sinks[h], m = m_s[qi], M = fmaxf(m, sk);
            const float corr = m == NEG_INF ? 0.0f : expf(m - M);
            c_s[qi] = corr;
            l_s[qi] = l_s[qi] * corr + expf(sk - M);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < nq * Dv; i += blockDim.x) {
        const float l = l_s[i / Dv];
        const float a = sinks ? acc_s[i] * c_s[i / Dv] : acc_s[i];
        acc_s[i] = l > 0.0f ? a / l : 0.0f;
    }
    __syncthreads();
    if (rot_v) block_hadamard(acc_s, nq * Dv, rot_v, rot_v_scale);
    for (int i = threadIdx.x; i < nq * Dv; i += blockDim.x) {
        const int qi = i / Dv, d = i - qi * Dv;
        out[(long long)(t0 + qi) * sot + (long long)h * soh + d] = acc_s[i];
    }
}

// At least 8 blocks an SM (32 warps: 64 registers a thread at most): ptxas's own choice for the
// bare bound of 128 threads was 56 registers with 20 bytes of spills for a Q4_0 K (and 64
// registers for the Q8_0 ones); with this cap it keeps every variant at <= 56 and spills nothing.
#define LP_FATTN_TILE_KERNEL(kname, vname, KT, VT)                                                     \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 8) fattn_tile_##kname##_##vname(        \
        const float* q, long long sqt, long long sqh, const u8* k, long long k_cb, long long k_hb,    \
        const u8* v, long long v_cb, long long v_hb, long long n_cells, const float* mask,            \
        long long sm, int n_kv, const int* n_kv_dev, float* out, long long sot, long long soh, int T, \
        int H, int Hkv, int D, int Dv, float scale, int rot_k, float rot_k_scale, int rot_v,          \
        float rot_v_scale, const float* sinks) {                                                      \
        fattn_tile_impl<KT, VT>(q, sqt, sqh, k, k_cb, k_hb, v, v_cb, v_hb, n_cells, mask, sm, n_kv,  \
                                n_kv_dev, out, sot, soh, T, H, Hkv, D, Dv, scale, rot_k, rot_k_scale, \
                                rot_v, rot_v_scale, sinks);                                           \
    }

#define LP_FATTN_TILE_V(kname, KT)                    \
    LP_FATTN_TILE_KERNEL(kname, f32, KT, CT_F32)      \
    LP_FATTN_TILE_KERNEL(kname, f16, KT, CT_F16)      \
    LP_FATTN_TILE_KERNEL(kname, q8_0, KT, CT_Q8_0)    \
    LP_FATTN_TILE_KERNEL(kname, q4_0, KT, CT_Q4_0)

LP_FATTN_TILE_V(f32, CT_F32)
LP_FATTN_TILE_V(f16, CT_F16)
LP_FATTN_TILE_V(q8_0, CT_Q8_0)
LP_FATTN_TILE_V(q4_0, CT_Q4_0)
