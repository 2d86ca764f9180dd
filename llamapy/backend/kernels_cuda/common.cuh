// llamapy CUDA kernels: what every quant family shares (ggml-cuda's common.cuh, the
// dequantize/convert templates of convert.cu and the matrix-vector kernels of mmv.cu / mmvq.cu).
//
// Every weight type is read as "units" of 32 consecutive elements of one row: a legacy block
// (Q4_0 ... Q8_0), one eighth of a K-quant super-block, or 32 plain F32/F16/BF16 values. A
// decoder `DQ::unit(row, u, w)` expands unit `u` of `row` into w[0..31] with the same float
// operations, in the same order and with the same rounding (no FMA contraction), as gguf-py's
// `gguf.quants.dequantize`, so a dequantized weight is bit-identical to the reference.
//
// Three kernels are built on a decoder:
//   dequant_<type>: one thread per unit -> float32 rows (the cuBLAS path, dequantize()).
//   get_rows_<type>: the same through a list of int32 row ids (GET_ROWS: token embeddings).
//   mmv_<type>:     y[t, r] = sum_k W[r, k] * x[t, k] for n_tok <= MMV_MAX_TOK (decode). One warp
//                   per output row; lane l takes units l, l+32, ...; each unit is decoded once and
//                   dotted with every token's 32 activations (float32, no q8 quantization of x);
//                   the lanes' partial sums are added with a butterfly of warp shuffles.
//                   In the default ("q8") mode the plans' large decode products take mmvq.cu's
//                   kernels instead: x quantized once to q8_1, int8 dot products (__dp4a) with the
//                   file's blocks; --f32-activations keeps these float32 ones everywhere.
//
// The decoders are __host__ __device__: tests build them for the CPU (-DLLAMAPY_HOST_TEST) and
// compare them with gguf-py on a machine without a GPU. No standard headers are included, so the
// sources compile unchanged with NVRTC (cupy.RawModule) and nvcc.
#pragma once

typedef unsigned char u8;

#define LP_HD __host__ __device__ __forceinline__

#ifndef MMV_MAX_TOK
#define MMV_MAX_TOK 8
#endif
static_assert(MMV_MAX_TOK <= 32, "the products' epilogues take a token (a pair) a lane");

// Products and sums that must round exactly as numpy's float32 operations do: never contracted
// into an FMA on the device (the host test build is compiled with -ffp-contract=off).
#ifdef __CUDA_ARCH__
#define LP_MUL(a, b) __fmul_rn((a), (b))
#define LP_ADD(a, b) __fadd_rn((a), (b))
#define LP_SUB(a, b) __fsub_rn((a), (b))
#else
#define LP_MUL(a, b) ((a) * (b))
#define LP_ADD(a, b) ((a) + (b))
#define LP_SUB(a, b) ((a) - (b))
#endif

// little-endian loads from byte addresses (blocks are only 2-byte aligned)
LP_HD unsigned short ld_u16(const u8* p) {
    return (unsigned short)(p[0] | (p[1] << 8));
}

LP_HD unsigned int ld_u32(const u8* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
           ((unsigned int)p[3] << 24);
}

LP_HD float bits_to_f32(unsigned int b) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    union { unsigned int u; float f; } v;
    v.u = b;
    return v.f;
#endif
}

// ggml_e8m0_to_fp32_half: 2^(e - 128) (e < 2: a subnormal): MXFP4's
// scale (iquants.cu, mmvq.cu)
LP_HD float e8m0_half(int e) {
    return bits_to_f32(e < 2 ? 0x00200000u << e : (unsigned int)(e - 1) << 23);
}

// IEEE half -> float (exact)
LP_HD float f16_to_f32(unsigned short h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 31u;
    const unsigned int m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
        const float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (e == 31) return bits_to_f32(sign | 0x7f800000u | (m << 13));  // inf / nan
    return bits_to_f32(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

LP_HD float ld_f16(const u8* p) { return f16_to_f32(ld_u16(p)); }

// Wide loads of a block's quants (decode is bandwidth-bound, and a byte load per weight makes it
// instruction-bound): N little-endian 32-bit words from p, which the caller knows to be aligned
// to A bytes (16: one 128-bit load per 16 bytes; 4: 32-bit loads; 2: pairs of 16-bit loads). The
// CPU emulator of the tests (LP_EMU) takes these loads too and checks their alignment; the host
// decoder tests copy the same bytes.
template <int N, int A>
LP_HD void ld_words(const u8* p, unsigned int* o) {
#if defined(__CUDA_ARCH__) || defined(LP_EMU)
    if (A >= 16) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
            o[4 * i] = v.x;
            o[4 * i + 1] = v.y;
            o[4 * i + 2] = v.z;
            o[4 * i + 3] = v.w;
        }
    } else if (A >= 4) {
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = __ldg(reinterpret_cast<const unsigned int*>(p) + i);
    } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = (unsigned int)__ldg(h + 2 * i) | ((unsigned int)__ldg(h + 2 * i + 1) << 16);
    }
#else
    __builtin_memcpy(o, p, 4 * N);
#endif
}

// Scale s (0..15, one per 16 elements) of a Q3_K super-block from its 12 bytes at sc: 4 low bits
// (byte s & 7, the high nibble from 8 on), 2 high bits (byte 8 + s % 4, bits 2 * (s / 4)), less 32
// in the callers: kquants.cu's decoder and mmvq.cu's.
LP_HD int scale_q3k(const u8* sc, int s) {
    return ((sc[s & 7] >> (4 * (s >> 3))) & 15) | (((sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3) << 4);
}

// The packed 6-bit (scale, min) of sub-block j of Q4_K / Q5_K (ggml's get_scale_min_k4):
// kquants.cu's decoders and mmvq.cu's.
LP_HD void scale_min_k4(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// byte l of words loaded by ld_words (l a constant after unrolling: the words stay in registers)
LP_HD int byte_at(const unsigned int* o, int l) { return (int)((o[l >> 2] >> (8 * (l & 3))) & 0xffu); }

// float -> IEEE half, round to nearest even (numpy's astype(float16))
LP_HD unsigned short f32_to_f16(float f) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else  // the same rounding in integers, for the host builds of the tests
    union { float f; unsigned int u; } v;
    v.f = f;
    const unsigned int sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);  // nan
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 (and inf): inf
    const unsigned int e = a >> 23;
    if (e < 113) {  // below 2^-14: a subnormal half, units of 2^-24
        if (e < 102) return (unsigned short)sign;  // below 2^-25: rounds to zero
        const unsigned int m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
        unsigned int q = m >> shift;
        const unsigned int rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return (unsigned short)(sign | q);
    }
    unsigned int q = ((e - 112) << 10) | ((a & 0x7fffffu) >> 13);
    const unsigned int rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
    return (unsigned short)(sign | q);
#endif
}

// A warp's sum of v (every lane gets it); the full warp must be converged.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Element i (0 <= i < N, known only at run time) of a register array, read and written through
// an unrolled select: nvcc places an array indexed at run time in local memory (off-chip, through
// L1), one indexed only by constants after unrolling stays in registers.
template <int N, typename T>
__device__ __forceinline__ T reg_get(const T (&a)[N], int i) {
    T v = a[0];
#pragma unroll
    for (int k = 1; k < N; ++k)
        if (k == i) v = a[k];
    return v;
}

template <int N, typename T>
__device__ __forceinline__ void reg_set(T (&a)[N], int i, T v) {
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (k == i) a[k] = v;
}

/* a decoded unit of 32 weights times 32 activations (float4 loads), summed in one fixed order:
 * every product kernel (mmv, mmv_glu, mmv_id) sums with this, so their bits agree */
__device__ __forceinline__ float dot_unit(const float* v, const float* x) {
    const float4* xp = reinterpret_cast<const float4*>(x);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 a = __ldg(xp + i);
        s += v[4 * i] * a.x;
        s += v[4 * i + 1] * a.y;
        s += v[4 * i + 2] * a.z;
        s += v[4 * i + 3] * a.w;
    }
    return s;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Value g of a q8_1 copy (mmvq.cu's layout: the quants q[g], the block g / 32's float32 pair
// (d, d * sum(q)) at ds[2 * (g / 32)]) from x, one lane a value: the 32 lanes of the converged warp
// hold one block, g a multiple of 32 in lane 0. ggml-cuda's rule: d = amax / 127,
// q = roundf(x / d) (halves away from zero; amax 0: q = 0). mmvq.cu's quantize_q8_1 and norm.cu's
// rms_norm_f32 (the copy of its result) both store through this.
__device__ __forceinline__ void q8_1_store(float x, long long g, signed char* q, float* ds) {
    const float amax = warp_max(fabsf(x));
    const float d = __fdiv_rn(amax, 127.0f);
    const int qi = amax == 0.0f ? 0 : (int)roundf(__fdiv_rn(x, d));
    const int sum = warp_sum(qi);
    q[g] = (signed char)qi;
    if ((threadIdx.x & 31) == 0) {
        ds[2 * (g >> 5)] = d;
        ds[2 * (g >> 5) + 1] = __fmul_rn(d, (float)sum);
    }
}

// The max of v over the block (every thread gets it): called by every thread, blockDim.x a
// multiple of 32, once per kernel (one shared array).
__device__ __forceinline__ float block_max(float v) {
    __shared__ float red[32];
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = fmaxf(v, red[w]);
    return v;
}

// The f16 input of a prompt's GEMM kept in range (an activation past 65504 would round to inf):
// a power-of-two scale s = 2^k, the smallest k >= 0 with max|x| / s <= 2^15, the input rounded as
// x / s (exact: a power of two) and the GEMM's alpha = s, which cuBLAS reads from device memory
// (cuda_ops.CublasGemm), so nothing but the converted input changes and no pass over the output
// runs; s = 1, today's bits, when nothing is that large. The max takes two launches and no
// grid-wide sync: elementwise.cu's amax_f32 writes one partial maximum a block (a few hundred),
// then every block of the convert launch (cpy_f32_f16, moe.cu's moe_gather_f16) reduces them
// itself here, and block 0 writes ab = {s, 0}: the GEMM's alpha and beta. Returns 1 / s (1 for
// n_part 0: no scale). k is at most 113, which every finite float32 (below 2^128) needs at most
// (an inf input gets 113 too, and stays inf).
__device__ __forceinline__ float f16_input_scale(const float* __restrict__ part, int n_part, float* ab) {
    float m = 0.0f;
    for (int j = threadIdx.x; j < n_part; j += blockDim.x) m = fmaxf(m, part[j]);
    const unsigned int b = __float_as_uint(block_max(m));
    int k = (int)(b >> 23) - 127 - 15 + ((b & 0x7fffffu) != 0u);  // ceil(log2 m) - 15 (m normal or inf)
    k = k < 0 ? 0 : (k > 113 ? 113 : k);
    if (ab && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        ab[0] = __uint_as_float((unsigned int)(127 + k) << 23);
        ab[1] = 0.0f;
    }
    return __uint_as_float((unsigned int)(127 - k) << 23);
}

// Hadamard rotation in place of a[0 .. len) in shared memory, in runs of `rot` values (a power of
// two dividing len), as quants.rotate computes it: stages hs = 1, 2, ..., rot/2 of butterflies
// (a + b, a - b) over the pairs hs apart inside each block of 2*hs, then every value times
// `scale` (1/sqrt(rot) as quants.hadamard rounds it), each operation rounded in float32. Called
// by every thread of the block (it synchronizes); the caller synchronizes before it.
__device__ __forceinline__ void block_hadamard(float* a, int len, int rot, float scale) {
    const int half = rot / 2;
    for (int hs = 1; hs < rot; hs <<= 1) {
        for (int k = threadIdx.x; k < len / 2; k += blockDim.x) {
            const int r = k / half, kk = k % half;
            const int i0 = r * rot + (kk / hs) * 2 * hs + kk % hs, i1 = i0 + hs;
            const float x = a[i0], y = a[i1];
            a[i0] = __fadd_rn(x, y);
            a[i1] = __fsub_rn(x, y);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < len; i += blockDim.x) a[i] = __fmul_rn(a[i], scale);
    __syncthreads();
}

// GLU gates (glu.cu, and the GLU epilogue of the matrix-vector products below)
// silu(g) * u = (g / (1 + exp(-g))) * u in float32, as kernels.glu: each operation rounded on
// its own; expf is CUDA's (within 2 ulp of the correctly rounded value, numpy's within 1). A
// gate below ~-88.7 overflows exp to inf and gives -0 (times u), as in ggml.
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// SWIGLU_OAI (gpt-oss's clamped SwiGLU, ggml's swiglu_oai; kernels.glu): x = min(g, limit),
// y = clamp(u, -limit, limit), x / (1 + exp(alpha * -x)) * (y + 1), each operation rounded to
// float32 in the reference's order (expf within 2 ulp of numpy's). glu.cu and mmv_id's epilogue.
__device__ __forceinline__ float swiglu_oai_mul(float g, float u, float alpha, float limit) {
    const float x = limit < g ? limit : g;  // std::min and std::clamp as ggml's: a NaN stays NaN
    const float up = u < -limit ? -limit : (limit < u ? limit : u);
    const float sig = __fdiv_rn(x, __fadd_rn(1.0f, expf(__fmul_rn(alpha, -x))));
    return __fmul_rn(sig, __fadd_rn(up, 1.0f));
}

// GELU (tanh approximation) as ggml-cpu's GGML_GELU_FP16 table rounds it (kernels.gelu): the
// input rounded to f16, the value computed in float32 in the reference's order and rounded to
// f16; x <= -10 gives 0, x >= 10 gives x.
__device__ __forceinline__ float gelu_f16(float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const float h = f16_to_f32(f32_to_f16(x));
    const float c = 0.79788456080286535587989211986876f;  // sqrt(2 / pi)
    const float a = 0.044715f;
    // 0.5 * h * (1 + tanh(c * h * (1 + a * h * h))), left to right
    const float inner = __fmul_rn(__fmul_rn(c, h), __fadd_rn(1.0f, __fmul_rn(__fmul_rn(a, h), h)));
    const float y = __fmul_rn(__fmul_rn(0.5f, h), __fadd_rn(1.0f, tanhf(inner)));
    return f16_to_f32(f32_to_f16(y));
}

// ---------------------------------------------------------------------------------------------
// dequantize: n_units units of 32 elements; unit g is unit (g % units_per_row) of row
// (g / units_per_row); rows are row_bytes apart in `w`; y is float32, 32 * n_units elements.
// ---------------------------------------------------------------------------------------------
template <typename DQ>
__device__ __forceinline__ void dequant_impl(const u8* __restrict__ w, float* __restrict__ y,
                                             long long n_units, int units_per_row,
                                             long long row_bytes) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n_units) return;
    const long long row = g / units_per_row;
    const int u = (int)(g - row * units_per_row);
    float v[32];
    DQ::unit(w + row * row_bytes, u, v);
    float4* out = reinterpret_cast<float4*>(y + g * 32);  // 128-byte aligned: y is a fresh array
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

// dequant_f16: the same units rounded to IEEE half (round to nearest even, numpy's
// astype(float16)): a prompt's weight, or a tile of its rows, for the f16 tensor-core GEMM
// (cuBLAS, f32 accumulation; cuda_ops.mul_mat_gemm). One thread per unit, 64-byte stores: y is
// 16-byte aligned.
template <typename DQ>
__device__ __forceinline__ void dequant_f16_impl(const u8* __restrict__ w, unsigned short* __restrict__ y,
                                                 long long n_units, int units_per_row, long long row_bytes) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n_units) return;
    const long long row = g / units_per_row;
    const int u = (int)(g - row * units_per_row);
    float v[32];
    DQ::unit(w + row * row_bytes, u, v);
    unsigned int h[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) h[i] = (unsigned int)f32_to_f16(v[2 * i]) | ((unsigned int)f32_to_f16(v[2 * i + 1]) << 16);
    uint4* out = reinterpret_cast<uint4*>(y + g * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = make_uint4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
}

// ---------------------------------------------------------------------------------------------
// GET_ROWS (ggml-cuda getrows.cu): rows ids[i] of w (n_rows rows of row_bytes) -> y[i * sy + ...]
// float32; one thread per unit of 32. An id outside [0, n_rows) gives a row of NaN (never a read
// outside the matrix: Context.decode checks token ids, this only keeps a bad one visible).
// ---------------------------------------------------------------------------------------------
template <typename DQ>
__device__ __forceinline__ void get_rows_impl(const u8* __restrict__ w, long long row_bytes, int n_rows,
                                              const int* __restrict__ ids, float* __restrict__ y,
                                              long long sy, int n_ids, int units_per_row) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)n_ids * units_per_row) return;
    const int i = (int)(g / units_per_row);
    const int u = (int)(g - (long long)i * units_per_row);
    const int row = ids[i];
    float* out = y + (long long)i * sy + u * 32;
    if (row < 0 || row >= n_rows) {
        for (int k = 0; k < 32; ++k) out[k] = __int_as_float(0x7fc00000);
        return;
    }
    float v[32];
    DQ::unit(w + (long long)row * row_bytes, u, v);
#pragma unroll
    for (int k = 0; k < 32; ++k) out[k] = v[k];
}

// ---------------------------------------------------------------------------------------------
// matrix-vector: W (n_out rows of row_bytes) times x (n_tok, n_in) float32, row-major and
// 16-byte aligned, n_in a multiple of 32 -> y (n_tok, n_out). blockDim.x = 32 * rows per block.
// ---------------------------------------------------------------------------------------------
// One row's sums for n_tok <= MMV_MAX_TOK tokens: lane l takes units l, l + 32, ..., and
// `unit(u, acc)` adds unit u's products into acc[t] for every token t < n_tok (each unit decoded
// once for all of them); then the lanes' partial sums are added with a butterfly. Token t's sum is
// returned to lane t (0 to the lanes past n_tok): the epilogues then take a token a lane, one call
// site of their division's slow path where lane 0 had MMV_MAX_TOK in an unrolled loop (with every
// token's sums live across them: mmv_glu spilled). Every product kernel (mmv, mmv_glu, mmv_id; the
// int8 ones of mmvq.cu) sums a row here. The accumulators are indexed by constants only (the token
// loops are unrolled), so they stay in registers.
template <typename Unit>
__device__ __forceinline__ float row_sums(int n_units, int n_tok, Unit unit) {
    const int lane = threadIdx.x & 31;
    float acc[MMV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < MMV_MAX_TOK; ++t) acc[t] = 0.0f;
    for (int u = lane; u < n_units; u += 32) unit(u, acc);
    float s_t = 0.0f;
#pragma unroll
    for (int t = 0; t < MMV_MAX_TOK; ++t) {
        if (t < n_tok) {
            const float s = warp_sum(acc[t]);
            if (lane == t) s_t = s;
        }
    }
    return s_t;
}

// One row of W (`wr`, n_units units) times the float32 rows of x (token t's at xrow(t), 16-byte
// aligned): each unit decoded to 32 floats (DQ::unit) and dotted with every token's 32
// activations (dot_unit's order), so mmv, mmv_glu and mmv_id agree bit for bit.
template <typename DQ, typename XRow>
__device__ __forceinline__ float mmv_row(const u8* __restrict__ wr, int n_units, int n_tok, XRow xrow) {
    return row_sums(n_units, n_tok, [&](int u, float (&acc)[MMV_MAX_TOK]) {
        float v[32];
        DQ::unit(wr, u, v);
#pragma unroll
        for (int t = 0; t < MMV_MAX_TOK; ++t)
            if (t < n_tok) acc[t] += dot_unit(v, xrow(t) + u * 32);
    });
}

// The epilogues of the matrix-vector kernels over `rowsum(r)` (row r's sums, token t's in lane t;
// a warp a row, blockDim.x = 32 x rows a block). mmv_store: y[t, r] = the sum, plus b[r] when
// b is given (a float32 bias of n_out: the ADD after the product as its epilogue, the bits of the
// product then add_f32). mmv_glu_store: W stacks the gate rows (0 .. n_ff-1) over the up rows
// (n_ff .. 2 n_ff-1), as the fused ffn_gate_up matrix does; a warp takes gate row r and up row
// n_ff + r and writes y[t, r] = act(gate) * up (op 0: SiLU, 1: GELU-tanh as glu.cu), the bits of
// the product then glu. The gate's sums are reduced to a lane each before the up row is read: its
// accumulators are not live across the second row.
template <typename RowSum>
__device__ __forceinline__ void mmv_store(float* __restrict__ y, int n_out, int n_tok, const float* __restrict__ b,
                                          RowSum rowsum) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n_out) return;  // uniform per warp: the shuffles see a full warp
    float s = rowsum(row);
    if (b) s = __fadd_rn(s, b[row]);
    if (lane < n_tok) y[(long long)lane * n_out + row] = s;
}

template <typename RowSum>
__device__ __forceinline__ void mmv_glu_store(float* __restrict__ y, int n_ff, int n_tok, int op, RowSum rowsum) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n_ff) return;  // uniform per warp
    const float g = rowsum(row);
    const float up = rowsum(row + n_ff);
    if (lane < n_tok) y[(long long)lane * n_ff + row] = op == 0 ? silu_mul(g, up) : __fmul_rn(gelu_f16(g), up);
}

template <typename DQ>
__device__ __forceinline__ void mmv_impl(const u8* __restrict__ w, const float* __restrict__ x,
                                         float* __restrict__ y, int n_out, int n_in,
                                         long long row_bytes, int n_tok, const float* __restrict__ b) {
    mmv_store(y, n_out, n_tok, b, [&](int r) {
        return mmv_row<DQ>(w + (long long)r * row_bytes, n_in >> 5, n_tok, [&](int t) { return x + (long long)t * n_in; });
    });
}

template <typename DQ>
__device__ __forceinline__ void mmv_glu_impl(const u8* __restrict__ w, const float* __restrict__ x,
                                             float* __restrict__ y, int n_ff, int n_in, long long row_bytes,
                                             int n_tok, int op) {
    mmv_glu_store(y, n_ff, n_tok, op, [&](int r) {
        return mmv_row<DQ>(w + (long long)r * row_bytes, n_in >> 5, n_tok, [&](int t) { return x + (long long)t * n_in; });
    });
}

// MUL_MAT_ID (ggml-cuda's mmvq with ids, moe.cu's router feeds it): the experts of a stacked
// expert matrix (n_expert blocks of M rows, expert_bytes apart) times the rows of the (token,
// slot) pairs that chose them. Grid (row blocks, n_tok * n_used): block p takes pair p's expert
// e = ids[t * sid + u]; if an earlier pair chose e too, that pair's block does this work, so each
// chosen expert's rows are read once per step for every pair that chose it (at most one pair a
// token when a token's experts differ; more are taken MMV_MAX_TOK at a time). Pair q's input row
// is x + t * sxt + u * sxu (sxu 0: the token's one row for every slot), 16-byte aligned; its
// output y[q * M + row]. Each output is summed exactly as mmv_impl sums that row for that row
// of x. w2 (optional): the up experts, w the gate ones: y = act(gate) * up (op as mmv_glu_impl,
// 2: swiglu_oai with alpha and limit), the GLU as the products' epilogue. b / b2 (optional): the
// experts' bias rows (ADD_ID, gpt-oss), row e at b + e * sb, added to w's / w2's sums before the
// GLU (the bits of mmv_id, then add_id, then glu). The expert ids are read from device memory (the router's
// ARGSORT): a captured graph does not depend on the routing. An id outside [0, n_expert) gives
// NaN rows (never a read outside the matrix). One expert row's sums are `rowsum(wr, n, xo)`: the
// row at wr times the n pairs' input rows at offsets xo[0..n) (mmv_row over the float32 rows, x +
// xo[t]; mmvq.cu's mmvq_id over the rows of x's q8_1 copy, sxt / sxu then counted in copy rows).
template <typename RowSum>
__device__ __forceinline__ void mmv_id_impl(const u8* __restrict__ w, const u8* __restrict__ w2,
                                            long long expert_bytes, int n_expert, long long sxt, long long sxu,
                                            const int* __restrict__ ids, long long sid, float* __restrict__ y,
                                            int M, long long row_bytes, int n_tok, int n_used, int op,
                                            const float* __restrict__ b, const float* __restrict__ b2,
                                            long long sb, float alpha, float limit, RowSum rowsum) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int n_pairs = n_tok * n_used;
    const int p = blockIdx.y;
    const int e = ids[(long long)(p / n_used) * sid + p % n_used];
    for (int q = 0; q < p; ++q)
        if (ids[(long long)(q / n_used) * sid + q % n_used] == e) return;  // uniform per block
    if (row >= M) return;  // uniform per warp
    const bool bad = e < 0 || e >= n_expert;
    int q = p;
    while (q < n_pairs) {
        // the next (up to) MMV_MAX_TOK pairs that chose e, as their input rows' offsets from x in
        // 32-bit registers (cuda_ops checks they fit; 64-bit ones, or the pair indices, left
        // mmv_id over ~80 registers and spilling), written through reg_set and read at constant
        // t; lane t keeps pair t itself for the epilogue
        int xo[MMV_MAX_TOK] = {};
        int n = 0, pq_t = 0;
        for (; q < n_pairs && n < MMV_MAX_TOK; ++q) {
            if (ids[(long long)(q / n_used) * sid + q % n_used] != e) continue;
            if (lane == n) pq_t = q;
            reg_set(xo, n++, (int)((q / n_used) * sxt + (q % n_used) * sxu));
        }
        float g = 0.0f, up = 0.0f;
        if (!bad) {
            g = rowsum(w + (long long)e * expert_bytes + (long long)row * row_bytes, n, xo);
            if (w2) up = rowsum(w2 + (long long)e * expert_bytes + (long long)row * row_bytes, n, xo);
        }
        if (lane < n) {
            if (b && !bad) g = __fadd_rn(g, b[(long long)e * sb + row]);
            if (b2 && !bad) up = __fadd_rn(up, b2[(long long)e * sb + row]);
            float r = g;
            if (w2) r = op == 0 ? silu_mul(g, up) : op == 1 ? __fmul_rn(gelu_f16(g), up) : swiglu_oai_mul(g, up, alpha, limit);
            if (bad) r = __int_as_float(0x7fc00000);
            y[(long long)pq_t * M + row] = r;
        }
    }
}

// The matrix-vector kernels run 256 threads (8 warps) a block. mmv_ and mmv_glu_ are held to 3
// blocks (24 warps) an SM, i.e. 80 registers a thread: ptxas fits them there without spilling,
// where on its own it gave several mmv_glu_ 82-86 registers (2 blocks, 16 warps). A type whose
// gate/up kernel would spill under that cap says so with a specialization (floats.cu's F32).
// mmv_id_ (70-96 registers, 2 blocks) spills under it: its pairs' offsets and epilogue.
template <typename DQ>
struct mmv_glu_min_blocks {
    static constexpr int value = 3;
};

// The entry points of one type: extern "C" so that cupy.RawModule finds them by name.
#define LP_DEVICE_KERNELS(name, DQ)                                                                 \
    extern "C" __global__ void dequant_##name(const u8* __restrict__ w, float* __restrict__ y,      \
                                              long long n_units, int units_per_row,                 \
                                              long long row_bytes) {                                \
        dequant_impl<DQ>(w, y, n_units, units_per_row, row_bytes);                                  \
    }                                                                                               \
    extern "C" __global__ void dequant_f16_##name(const u8* __restrict__ w, unsigned short* __restrict__ y, \
                                                  long long n_units, int units_per_row, long long row_bytes) { \
        dequant_f16_impl<DQ>(w, y, n_units, units_per_row, row_bytes);                              \
    }                                                                                               \
    extern "C" __global__ void get_rows_##name(const u8* __restrict__ w, long long row_bytes,      \
                                               int n_rows, const int* __restrict__ ids,             \
                                               float* __restrict__ y, long long sy, int n_ids,      \
                                               int units_per_row) {                                 \
        get_rows_impl<DQ>(w, row_bytes, n_rows, ids, y, sy, n_ids, units_per_row);                 \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256, mmv_glu_min_blocks<DQ>::value)                \
        mmv_glu_##name(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, \
                       int n_ff, int n_in, long long row_bytes, int n_tok, int op) {                \
        mmv_glu_impl<DQ>(w, x, y, n_ff, n_in, row_bytes, n_tok, op);                                \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 3)                                            \
        mmv_##name(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,    \
                   int n_out, int n_in, long long row_bytes, int n_tok, const float* __restrict__ b) { \
        mmv_impl<DQ>(w, x, y, n_out, n_in, row_bytes, n_tok, b);                                    \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                               \
        mmv_id_##name(const u8* __restrict__ w, const u8* __restrict__ w2, long long expert_bytes,   \
                      int n_expert, const float* __restrict__ x, long long sxt, long long sxu,      \
                      const int* __restrict__ ids, long long sid, float* __restrict__ y, int M,     \
                      int n_in, long long row_bytes, int n_tok, int n_used, int op,                 \
                      const float* __restrict__ b, const float* __restrict__ b2, long long sb,      \
                      float alpha, float limit) {                                                   \
        mmv_id_impl(w, w2, expert_bytes, n_expert, sxt, sxu, ids, sid, y, M, row_bytes, n_tok, n_used, op, \
                    b, b2, sb, alpha, limit, [&](const u8* wr, int n, const int (&xo)[MMV_MAX_TOK]) {  \
                        return mmv_row<DQ>(wr, n_in >> 5, n, [&](int t) { return x + xo[t]; });    \
                    });                                                                             \
    }

#ifdef LLAMAPY_HOST_TEST
// A CPU build of the decoders, for tests on machines without a GPU (see tests/gpu).
#define LP_KERNELS(name, DQ)                                                                        \
    LP_DEVICE_KERNELS(name, DQ)                                                                     \
    extern "C" void host_dequant_##name(const u8* w, float* y, long long n_rows, int units_per_row, \
                                        long long row_bytes) {                                      \
        for (long long r = 0; r < n_rows; ++r)                                                      \
            for (int u = 0; u < units_per_row; ++u)                                                 \
                DQ::unit(w + r * row_bytes, u, y + (r * units_per_row + u) * 32);                   \
    }
#else
#define LP_KERNELS(name, DQ) LP_DEVICE_KERNELS(name, DQ)
#endif
