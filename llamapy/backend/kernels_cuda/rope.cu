// ROPE (normal and NeoX modes, rope_freqs divisors: Llama-3's frequency factors, YaRN) fused with
// SET_ROWS, the store of the rows into the KV cache: f32, f16, or Q8_0 / Q4_0 blocks, rotated
// first by the Hadamard matrix where the cache is (llama.cpp's attn_rot). ggml-cuda's rope.cu
// and set-rows.cu / cpy-utils.cuh do these as separate kernels. Launched by
// llamapy/backend/cuda_ops.py (`rope`, `set_rows`); the numpy reference is kernels.py's rope
// and set_rows (with quants.rotate and quants.quantize).
//
// Numerics, as the reference rounds them (bit for bit but for cos/sin, below):
//   * the angle of pair i at position p: theta = p, then i times theta *= theta_scale in float32
//     (ggml's rope_cache_init recurrence; theta_scale = powf(base, -2/n_dims) is computed on the
//     host), / factors[i] (float32), then freq_scale * theta (float32);
//   * YaRN (ggml's rope_yarn; `yarn` not null: ext_factor, attn_factor, the correction dims c0,
//     c1, and mscale, the cos/sin scale kernels.yarn_mscale computes on the host): with ramp
//     y = (i - c0) / max(0.001, c1 - c0) and mix = (1 - clamp(y, 0, 1)) * ext_factor, the angle is
//     fma(freq_scale * theta, 1 - mix, theta * mix) (ops.c's and the reference's one rounding),
//     and cos, sin are multiplied by mscale (float32);
//   * cos and sin of that float32 angle in float64, rounded to float32 (numpy's float64 cos/sin
//     and CUDA's are each within an ulp of float64: the float32 results differ only when the
//     float64 value lies that close to a float32 rounding boundary);
//   * out0 = (float)((double)x0 * c - (double)(x1 * s)), out1 = (float)((double)x0 * s +
//     (double)(x1 * c)): the products x1*s, x1*c rounded to float32 (kernels._rot);
//   * the stored row: f16 rounded to nearest even; Q8_0 / Q4_0 with the float32 operations of
//     ggml's reference quantizers (quants.quantize); the rotation as quants.rotate's butterflies,
//     stage by stage, then times 1/sqrt(n) in float32.
#include "common.cuh"

// the KV cache's element types: cpu_kernels.KV_CODES (ops.c's LP_KV_*); -1: no store
#define CT_NONE -1
#define CT_F32 0
#define CT_F16 1
#define CT_Q8_0 2
#define CT_Q4_0 3

__device__ __forceinline__ float rope_theta(int p, int i, float theta_scale, const float* factors,
                                            float freq_scale, const float* yarn) {
    float th = (float)p;
    for (int k = 0; k < i; ++k) th = __fmul_rn(th, theta_scale);
    if (factors) th = __fdiv_rn(th, factors[i]);
    const float scaled = __fmul_rn(freq_scale, th);
    if (!yarn || yarn[0] == 0.0f) return scaled;
    // YaRN: the pairs below the ramp keep the trained (extrapolated) angle
    const float y = __fdiv_rn(__fsub_rn((float)i, yarn[2]), fmaxf(0.001f, __fsub_rn(yarn[3], yarn[2])));
    const float mix = __fmul_rn(__fsub_rn(1.0f, fminf(1.0f, fmaxf(0.0f, y))), yarn[0]);
    return __fmaf_rn(scaled, __fsub_rn(1.0f, mix), __fmul_rn(th, mix));
}

// Q8_0 block of 32 floats (34 bytes: f16 d, 32 int8), as quants.quantize
__device__ __forceinline__ void quantize_q8_0(const float* v, u8* blk) {
    float amax = 0.0f;
    for (int k = 0; k < 32; ++k) amax = fmaxf(amax, fabsf(v[k]));
    const float d = __fdiv_rn(amax, 127.0f);
    const float inv = d == 0.0f ? 0.0f : __fdiv_rn(1.0f, d);
    const unsigned short dh = f32_to_f16(d);
    blk[0] = (u8)(dh & 0xff);
    blk[1] = (u8)(dh >> 8);
    for (int k = 0; k < 32; ++k) blk[2 + k] = (u8)(signed char)(int)roundf(__fmul_rn(v[k], inv));
}

// Q4_0 block of 32 floats (18 bytes: f16 d, 16 bytes of nibbles: element j low, j + 16 high)
__device__ __forceinline__ void quantize_q4_0(const float* v, u8* blk) {
    float amax = 0.0f, vmax = 0.0f;
    for (int k = 0; k < 32; ++k) {
        if (fabsf(v[k]) > amax) {  // the first value of largest magnitude, with its sign
            amax = fabsf(v[k]);
            vmax = v[k];
        }
    }
    const float d = __fdiv_rn(vmax, -8.0f);
    const float inv = d == 0.0f ? 0.0f : __fdiv_rn(1.0f, d);
    const unsigned short dh = f32_to_f16(d);
    blk[0] = (u8)(dh & 0xff);
    blk[1] = (u8)(dh >> 8);
    for (int j = 0; j < 16; ++j) {
        const int lo = (int)fminf(truncf(__fadd_rn(__fmul_rn(v[j], inv), 8.5f)), 15.0f);
        const int hi = (int)fminf(truncf(__fadd_rn(__fmul_rn(v[j + 16], inv), 8.5f)), 15.0f);
        blk[2 + j] = (u8)(lo | (hi << 4));
    }
}

// One thread block per (token, head): grid (T, H), any blockDim.x that is a multiple of 32.
//   x:  (T, H, D) float32, element (t, h, d) at x[t * sxt + h * sxh + d]
//   y:  nullable; the float32 result, at y[t * syt + h * syh + d] (may be x: in place)
//   mode: 0 normal (pairs 2i, 2i+1), 2 NeoX (pairs i, i + n_dims/2), -1 no rotation (a plain
//         SET_ROWS: pos and factors are not read); dimensions from n_dims on are copied
//   pos: (T,) int32 positions; factors: nullable, n_dims/2 rope_freqs divisors; yarn: nullable,
//        the 5 YaRN floats above
//   ids: (T,) int64 cache cells; cache: rows of cache_rb bytes, head h of a row at h * D
//        elements (n_cells rows: a cell outside them is not written)
//   rot: 0, or the Hadamard order the quantized cache's rows are stored in (runs of rot values
//        within a head: D % rot == 0), rot_scale its 1/sqrt(rot) as quants.hadamard rounds it
// Dynamic shared memory: D floats for the quantized caches (CT_Q8_0, CT_Q4_0), else none.
template <int CT>
__device__ __forceinline__ void rope_set_rows_impl(
    int t, int h, const float* x, long long sxt, long long sxh, const int* __restrict__ pos, float* y,
    long long syt, long long syh, int D, int n_dims, int mode, float theta_scale, float freq_scale,
    const float* __restrict__ factors, const long long* __restrict__ ids, long long n_cells,
    u8* __restrict__ cache, long long cache_rb, int rot, float rot_scale, const float* __restrict__ yarn) {
    extern __shared__ float head_s[];
    const float* xh = x + (long long)t * sxt + (long long)h * sxh;
    const int p = mode >= 0 ? pos[t] : 0;
    const int half = n_dims / 2;
    long long cell = -1;
    if (CT != CT_NONE) {
        cell = ids[t];
        if (cell < 0 || cell >= n_cells) cell = -1;
    }

    // every thread reads both values of its pairs before any writes y (y may be x): values first
    // D <= 8 * blockDim.x (cuda_ops checks); registers: written and read through reg_set /
    // reg_get (an index known at run time put the array in local memory)
    float vals[8] = {};
    int nv = 0;
    for (int d = threadIdx.x; d < D; d += blockDim.x, ++nv) {
        float v;
        if (mode < 0 || d >= n_dims) {
            v = xh[d];
        } else {
            const bool first = mode == 0 ? (d & 1) == 0 : d < half;
            const int i = mode == 0 ? d >> 1 : (first ? d : d - half);
            const int other = mode == 0 ? (first ? d + 1 : d - 1) : (first ? d + half : d - half);
            const float th = rope_theta(p, i, theta_scale, factors, freq_scale, yarn);
            // (CUDA's double cos/sin give these kernels their one stack frame, 40 bytes, used only
            // by the argument reduction of |th| >= 2^31: test_cuda_ptx's STACK_BOUNDS)
            float c = (float)cos((double)th), s = (float)sin((double)th);
            if (yarn) {
                c = __fmul_rn(c, yarn[4]);
                s = __fmul_rn(s, yarn[4]);
            }
            const float x0 = first ? xh[d] : xh[other];
            const float x1 = first ? xh[other] : xh[d];
            v = first ? (float)((double)x0 * (double)c - (double)__fmul_rn(x1, s))
                      : (float)((double)x0 * (double)s + (double)__fmul_rn(x1, c));
        }
        reg_set(vals, nv, v);
    }
    __syncthreads();  // every read of x is done before y (possibly x) is written
    nv = 0;
    for (int d = threadIdx.x; d < D; d += blockDim.x, ++nv) {
        const float v = reg_get(vals, nv);
        if (y) y[(long long)t * syt + (long long)h * syh + d] = v;
        if (CT == CT_F32 && cell >= 0) reinterpret_cast<float*>(cache + cell * cache_rb)[(long long)h * D + d] = v;
        if (CT == CT_F16 && cell >= 0)
            reinterpret_cast<unsigned short*>(cache + cell * cache_rb)[(long long)h * D + d] = f32_to_f16(v);
        if (CT == CT_Q8_0 || CT == CT_Q4_0) head_s[d] = v;
    }
    if (CT != CT_Q8_0 && CT != CT_Q4_0) return;
    if (cell < 0) return;  // uniform over the block
    __syncthreads();
    if (rot) block_hadamard(head_s, D, rot, rot_scale);
    const int bsize = CT == CT_Q8_0 ? 34 : 18;
    u8* row = cache + cell * cache_rb + (long long)h * (D / 32) * bsize;
    for (int b = threadIdx.x; b < D / 32; b += blockDim.x) {
        if (CT == CT_Q8_0) quantize_q8_0(head_s + 32 * b, row + 34 * b);
        else quantize_q4_0(head_s + 32 * b, row + 18 * b);
    }
}

#define LP_ROPE_KERNEL(name, CT)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) rope_set_rows_##name(                        \
        const float* x, long long sxt, long long sxh, const int* pos, float* y, long long syt,      \
        long long syh, int D, int n_dims, int mode, float theta_scale, float freq_scale,            \
        const float* factors, const long long* ids, long long n_cells, u8* cache, long long cache_rb, \
        int rot, float rot_scale, const float* yarn) {                                              \
        rope_set_rows_impl<CT>(blockIdx.x, blockIdx.y, x, sxt, sxh, pos, y, syt, syh, D, n_dims,    \
                               mode, theta_scale, freq_scale, factors, ids, n_cells, cache,         \
                               cache_rb, rot, rot_scale, yarn);                                     \
    }

LP_ROPE_KERNEL(none, CT_NONE)
LP_ROPE_KERNEL(f32, CT_F32)
LP_ROPE_KERNEL(f16, CT_F16)
LP_ROPE_KERNEL(q8_0, CT_Q8_0)
LP_ROPE_KERNEL(q4_0, CT_Q4_0)

// A layer's three stores in one launch (the rows of a fused Q/K/V product): grid (T, H + 2 Hkv);
// blocks y < H rope Q head y into q_out, the next Hkv rope K's heads and store them into the K
// cache, the last Hkv store V's heads into the V cache. Each block is exactly the block of the
// kernels above for that head, so the results are theirs bit for bit. Q, K and V are read at
// q, k, v with row stride sxt (their heads D / D / Dv apart), Q and K with `yarn` when given;
// dynamic shared memory
// 4 * max(D, Dv) bytes when a cache is quantized.
template <int KT, int VT>
__device__ __forceinline__ void rope_qkv_impl(
    const float* q, const float* k, const float* v, long long sxt, const int* pos, float* q_out, long long syt,
    int H, int Hkv, int D, int Dv, int n_dims, int mode, float theta_scale, float freq_scale, const float* factors,
    const long long* ids, long long n_cells, u8* k_cache, long long k_rb, int k_rot, float k_rot_scale,
    u8* v_cache, long long v_rb, int v_rot, float v_rot_scale, const float* yarn) {
    const int t = blockIdx.x, hy = blockIdx.y;
    if (hy < H)
        rope_set_rows_impl<CT_NONE>(t, hy, q, sxt, D, pos, q_out, syt, D, D, n_dims, mode, theta_scale,
                                    freq_scale, factors, nullptr, 0, nullptr, 0, 0, 0.0f, yarn);
    else if (hy < H + Hkv)
        rope_set_rows_impl<KT>(t, hy - H, k, sxt, D, pos, nullptr, 0, 0, D, n_dims, mode, theta_scale,
                               freq_scale, factors, ids, n_cells, k_cache, k_rb, k_rot, k_rot_scale, yarn);
    else
        rope_set_rows_impl<VT>(t, hy - H - Hkv, v, sxt, Dv, pos, nullptr, 0, 0, Dv, 0, -1, 0.0f, 1.0f,
                               nullptr, ids, n_cells, v_cache, v_rb, v_rot, v_rot_scale, nullptr);
}

#define LP_ROPE_QKV_KERNEL(kname, vname, KT, VT)                                                    \
    extern "C" __global__ void __launch_bounds__(256) rope_qkv_##kname##_##vname(                  \
        const float* q, const float* k, const float* v, long long sxt, const int* pos, float* q_out,  \
        long long syt, int H, int Hkv, int D, int Dv, int n_dims, int mode, float theta_scale,        \
        float freq_scale, const float* factors, const long long* ids, long long n_cells,              \
        u8* k_cache, long long k_rb, int k_rot, float k_rot_scale, u8* v_cache, long long v_rb,       \
        int v_rot, float v_rot_scale, const float* yarn) {                                           \
        rope_qkv_impl<KT, VT>(q, k, v, sxt, pos, q_out, syt, H, Hkv, D, Dv, n_dims, mode, theta_scale, \
                              freq_scale, factors, ids, n_cells, k_cache, k_rb, k_rot, k_rot_scale,   \
                              v_cache, v_rb, v_rot, v_rot_scale, yarn);                               \
    }

#define LP_ROPE_QKV_V(kname, KT)                     \
    LP_ROPE_QKV_KERNEL(kname, f32, KT, CT_F32)       \
    LP_ROPE_QKV_KERNEL(kname, f16, KT, CT_F16)       \
    LP_ROPE_QKV_KERNEL(kname, q8_0, KT, CT_Q8_0)     \
    LP_ROPE_QKV_KERNEL(kname, q4_0, KT, CT_Q4_0)

LP_ROPE_QKV_V(f32, CT_F32)
LP_ROPE_QKV_V(f16, CT_F16)
LP_ROPE_QKV_V(q8_0, CT_Q8_0)
LP_ROPE_QKV_V(q4_0, CT_Q4_0)
