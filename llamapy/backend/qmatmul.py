"""Quantized MUL_MAT for the CPU backend (ggml-cpu's `ggml_compute_forward_mul_mat` and the
`ggml_vec_dot_*` kernels of ggml-cpu `quants.c`).

Weights stay exactly as the GGUF file stores them: `QMatrix` keeps a (n_out, row_bytes) uint8
view of the (memory-mapped) tensor and never expands the whole matrix to float32. Unlike ggml, the
activations are NOT quantized to q8: each kernel multiplies the weight blocks with the float32
activations directly, so the only rounding is the weights' own.

Paths, picked per call:
  * n_tokens < `BLAS_MIN_TOKENS` (decode, short batches), Q4_1 and Q8_0: numba kernels on a
    row-interleaved repack (tiles of `REPACK_ROWS` rows; the innermost loop runs across rows, so
    it vectorizes without a horizontal sum per block). Costs +20% / +6% of the file's bytes;
    the mapped rows are then no longer referenced.
  * n_tokens < `BLAS_MIN_TOKENS`, every other type: numba kernels, one per type, that walk
    the file's blocks row by row. A block's dot is summed in float32 lanes (fastmath reassoc lets
    LLVM vectorize it) and then scaled; `x`'s block sums turn the `+ m` / `- dmin*m` terms into
    one multiply per block. Rows are split over `prange` chunks, one per thread.
  * n_tokens >= `BLAS_MIN_TOKENS` (prompt processing): row tiles are expanded to float32 and handed
    to numpy's BLAS (`x @ tile.T`); the tile bounds the memory.
  * no numba, or LLAMAPY_NO_NUMBA=1: the tile + BLAS path for every n_tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from llamapy import quants
from llamapy.types import GGMLType, UnsupportedError, block_size

try:  # numba is optional: without it everything runs on numpy + BLAS.
    if os.environ.get("LLAMAPY_NO_NUMBA", "") not in ("", "0"):
        raise ImportError("disabled by LLAMAPY_NO_NUMBA")
    import numba
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - depends on the environment
    numba = None
    HAVE_NUMBA = False

# At or above this many tokens, dequantized tiles + BLAS beat the per-block kernels.
BLAS_MIN_TOKENS = 16
# Float32 elements per dequantized tile on the BLAS path (4 MiB).
TILE_ELEMS = 1 << 20
# Below this many weights a matrix is not worth waking a second thread for.
PARALLEL_MIN_WEIGHTS = 1 << 16

# f16 bit pattern -> float32, for the kernels (a 256 KiB table stays mostly in L2).
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_num_threads = 0


def set_num_threads(n: int) -> None:
    """Threads the kernels use (llama.cpp's `-t`); 0 means every core numba may use."""
    global _num_threads
    _num_threads = max(0, int(n))
    if HAVE_NUMBA and _num_threads:
        numba.set_num_threads(min(_num_threads, numba.config.NUMBA_NUM_THREADS))


def _threads(n_threads: int) -> int:
    n = n_threads or _num_threads
    if not HAVE_NUMBA:
        return 1
    limit = numba.config.NUMBA_NUM_THREADS
    return min(n, limit) if n > 0 else numba.get_num_threads()


# --------------------------------------------------------------------------------------------
# numba kernels.
# `L` is always 16, passed at run time on purpose: with constant trip counts LLVM fully unrolls
# the short per-block loops before its loop vectorizer runs and the SLP vectorizer then emits
# scalar gathers (measured 2.5x slower); a run-time count keeps them vectorized reductions.
# Each `_mv_<type>(w, x, xs, out, r0, r1, tab, L)` computes out[:, r0:r1] for the
# rows r0..r1 of `w` (uint8 (n_out, row_bytes), the file's layout); `x` is (n_tok, n_in) float32,
# `xs` its sums over runs of 16 elements (n_tok, n_in // 16), `tab` is F16_TABLE.
# --------------------------------------------------------------------------------------------

# reassoc lets LLVM vectorize the per-block float32 sums; contract allows FMAs. No nnan/ninf:
# inf/nan in activations must still propagate as they would in ggml.
_FM = {"reassoc", "contract", "nsz"}

KERNELS: dict[GGMLType, tuple[Callable[..., Any], Callable[..., Any]]] = {}
REPACKED: dict[GGMLType, tuple[Callable[..., Any], Callable[..., Any]]] = {}
# Rows per repacked tile: wide enough for 8-lane AVX2 loops with little loop overhead
# (measured on Q4_1 1536x576: R=16 3.2, R=32 6.5, R=64 7.2 G weights/s on one thread).
REPACK_ROWS = 64
# Bytes per block of the header (f16 scales) and the quants, for the repacked types.
_REPACK_SPLIT = {GGMLType.Q4_1: (4, 16), GGMLType.Q8_0: (2, 32)}

if HAVE_NUMBA:
    _jit = njit(cache=True, fastmath=_FM, nogil=True, boundscheck=False)
    _pjit = njit(cache=True, parallel=True, nogil=True)

    @_jit
    def _f16(w: np.ndarray, o: int, tab: np.ndarray) -> np.float32:
        return tab[np.int64(w[o]) | (np.int64(w[o + 1]) << 8)]

    @_jit
    def _block_sums16(x: np.ndarray) -> np.ndarray:
        n_tok, n_in = x.shape
        xs = np.empty((n_tok, n_in // 16), dtype=np.float32)
        for t in range(n_tok):
            for b in range(n_in // 16):
                s = np.float32(0.0)
                for j in range(16):
                    s += x[t, b * 16 + j]
                xs[t, b] = s
        return xs

    @_jit
    def _mv_f32(w, x, xs, out, r0, r1, tab, L):
        n_tok, n_in = x.shape
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for i in range(n_in):
                    acc += wr[i] * xt[i]
                out[t, r] = acc

    @_jit
    def _mv_f16(w, x, xs, out, r0, r1, tab, L):
        n_tok, n_in = x.shape
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for i in range(n_in):
                    acc += tab[np.int64(wr[i])] * xt[i]
                out[t, r] = acc

    @_jit
    def _mv_bf16(w, x, xs, out, r0, r1, tab, L):
        # `w` is the uint16 view here; bf16 is the top half of a float32, so a (u16 << 16)
        # int32 array viewed as float32 gives the value without rounding.
        n_tok, n_in = x.shape
        buf = np.empty(n_in, dtype=np.int32)
        fbuf = buf.view(np.float32)
        for r in range(r0, r1):
            wr = w[r]
            for i in range(n_in):
                buf[i] = np.int32(wr[i]) << 16
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for i in range(n_in):
                    acc += fbuf[i] * xt[i]
                out[t, r] = acc

    @_jit
    def _mv_q8_0(w, x, xs, out, r0, r1, tab, L):
        # `w` is the int8 view: 34-byte blocks of f16 d + 32 int8.
        n_tok, n_in = x.shape
        nb = n_in // 32
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 34
                    d = tab[(np.int64(wr[o]) & 0xFF) | ((np.int64(wr[o + 1]) & 0xFF) << 8)]
                    s = np.float32(0.0)
                    for j in range(2 * L):
                        s += np.float32(wr[o + 2 + j]) * xt[b * 32 + j]
                    acc += d * s
                out[t, r] = acc

    @_jit
    def _mv_q4_0(w, x, xs, out, r0, r1, tab, L):
        n_tok, n_in = x.shape
        nb = n_in // 32
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 18
                    d = _f16(wr, o, tab)
                    s = np.float32(0.0)
                    for j in range(L):
                        q = np.int32(wr[o + 2 + j])
                        s += np.float32((q & 15) - 8) * xt[b * 32 + j]
                        s += np.float32((q >> 4) - 8) * xt[b * 32 + 16 + j]
                    acc += d * s
                out[t, r] = acc

    @_jit
    def _mv_q4_1(w, x, xs, out, r0, r1, tab, L):
        n_tok, n_in = x.shape
        nb = n_in // 32
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 20
                    d = _f16(wr, o, tab)
                    m = _f16(wr, o + 2, tab)
                    s = np.float32(0.0)
                    for j in range(L):
                        q = np.int32(wr[o + 4 + j])
                        s += np.float32(q & 15) * xt[b * 32 + j]
                        s += np.float32(q >> 4) * xt[b * 32 + 16 + j]
                    acc += d * s + m * (xs[t, 2 * b] + xs[t, 2 * b + 1])
                out[t, r] = acc

    @_jit
    def _mv_q5_0(w, x, xs, out, r0, r1, tab, L):
        n_tok, n_in = x.shape
        nb = n_in // 32
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 22
                    d = _f16(wr, o, tab)
                    qh = (np.int64(wr[o + 2]) | (np.int64(wr[o + 3]) << 8)
                          | (np.int64(wr[o + 4]) << 16) | (np.int64(wr[o + 5]) << 24))
                    s = np.float32(0.0)
                    for j in range(L):
                        q = np.int32(wr[o + 6 + j])
                        h0 = np.int32((qh >> j) & 1) << 4
                        h1 = np.int32((qh >> (j + 16)) & 1) << 4
                        s += np.float32(((q & 15) | h0) - 16) * xt[b * 32 + j]
                        s += np.float32(((q >> 4) | h1) - 16) * xt[b * 32 + 16 + j]
                    acc += d * s
                out[t, r] = acc

    @_jit
    def _mv_q5_1(w, x, xs, out, r0, r1, tab, L):
        n_tok, n_in = x.shape
        nb = n_in // 32
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 24
                    d = _f16(wr, o, tab)
                    m = _f16(wr, o + 2, tab)
                    qh = (np.int64(wr[o + 4]) | (np.int64(wr[o + 5]) << 8)
                          | (np.int64(wr[o + 6]) << 16) | (np.int64(wr[o + 7]) << 24))
                    s = np.float32(0.0)
                    for j in range(L):
                        q = np.int32(wr[o + 8 + j])
                        h0 = np.int32((qh >> j) & 1) << 4
                        h1 = np.int32((qh >> (j + 16)) & 1) << 4
                        s += np.float32((q & 15) | h0) * xt[b * 32 + j]
                        s += np.float32((q >> 4) | h1) * xt[b * 32 + 16 + j]
                    acc += d * s + m * (xs[t, 2 * b] + xs[t, 2 * b + 1])
                out[t, r] = acc

    @_jit
    def _mv_q2_k(w, x, xs, out, r0, r1, tab, L):
        # 84-byte super-blocks: scales[16] (lo 4 bits scale, hi 4 bits min), qs[64], d, dmin.
        n_tok, n_in = x.shape
        nb = n_in // 256
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 84
                    d = _f16(wr, o + 80, tab)
                    dmin = _f16(wr, o + 82, tab)
                    for n in range(2):
                        for k in range(4):
                            sh = 2 * k
                            for half in range(2):
                                s = np.float32(0.0)
                                e0 = b * 256 + n * 128 + k * 32 + half * 16
                                q0 = o + 16 + n * 32 + half * 16
                                for l in range(L):
                                    q = (np.int32(wr[q0 + l]) >> sh) & 3
                                    s += np.float32(q) * xt[e0 + l]
                                sc = np.int32(wr[o + n * 8 + k * 2 + half])
                                acc += d * np.float32(sc & 15) * s
                                acc -= dmin * np.float32(sc >> 4) * xs[t, e0 // 16]
                out[t, r] = acc

    @_jit
    def _mv_q3_k(w, x, xs, out, r0, r1, tab, L):
        # 110-byte super-blocks: hmask[32], qs[64], scales[12] (16 signed 6-bit), d.
        n_tok, n_in = x.shape
        nb = n_in // 256
        scl = np.empty(16, dtype=np.float32)
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 110
                    d = _f16(wr, o + 108, tab)
                    for i in range(L):
                        lo = (np.int32(wr[o + 96 + (i & 7)]) >> (4 * (i >> 3))) & 15
                        hi = (np.int32(wr[o + 104 + (i & 3)]) >> (2 * (i >> 2))) & 3
                        scl[i] = d * np.float32((lo | (hi << 4)) - 32)
                    for n in range(2):
                        for k in range(4):
                            sh = 2 * k
                            hb = 4 * n + k
                            for half in range(2):
                                s = np.float32(0.0)
                                e0 = b * 256 + n * 128 + k * 32 + half * 16
                                q0 = o + 32 + n * 32 + half * 16
                                for l in range(L):
                                    q = (np.int32(wr[q0 + l]) >> sh) & 3
                                    h = (np.int32(wr[o + half * 16 + l]) >> hb) & 1
                                    s += np.float32(q - 4 + 4 * h) * xt[e0 + l]
                                acc += scl[n * 8 + k * 2 + half] * s
                out[t, r] = acc

    @_jit
    def _k_scale(wr, o, j):
        """Q4_K/Q5_K packed 6-bit (scale, min) of sub-block j from the 12 bytes at o."""
        if j < 4:
            sc = np.int32(wr[o + j]) & 63
            mn = np.int32(wr[o + j + 4]) & 63
        else:
            sc = (np.int32(wr[o + j + 4]) & 15) | ((np.int32(wr[o + j - 4]) >> 6) << 4)
            mn = (np.int32(wr[o + j + 4]) >> 4) | ((np.int32(wr[o + j]) >> 6) << 4)
        return sc, mn

    @_jit
    def _mv_q4_k(w, x, xs, out, r0, r1, tab, L):
        # 144-byte super-blocks: d, dmin, scales[12], qs[128] (4 runs of 32 bytes, lo then hi).
        n_tok, n_in = x.shape
        nb = n_in // 256
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 144
                    d = _f16(wr, o, tab)
                    dmin = _f16(wr, o + 2, tab)
                    for p in range(4):
                        e0 = b * 256 + p * 64
                        q0 = o + 16 + p * 32
                        s0 = np.float32(0.0)
                        s1 = np.float32(0.0)
                        for l in range(2 * L):
                            q = np.int32(wr[q0 + l])
                            s0 += np.float32(q & 15) * xt[e0 + l]
                            s1 += np.float32(q >> 4) * xt[e0 + 32 + l]
                        sc0, m0 = _k_scale(wr, o + 4, 2 * p)
                        sc1, m1 = _k_scale(wr, o + 4, 2 * p + 1)
                        x0 = xs[t, e0 // 16] + xs[t, e0 // 16 + 1]
                        x1 = xs[t, e0 // 16 + 2] + xs[t, e0 // 16 + 3]
                        acc += d * (np.float32(sc0) * s0 + np.float32(sc1) * s1)
                        acc -= dmin * (np.float32(m0) * x0 + np.float32(m1) * x1)
                out[t, r] = acc

    @_jit
    def _mv_q5_k(w, x, xs, out, r0, r1, tab, L):
        # 176-byte super-blocks: d, dmin, scales[12], qh[32] (bit i = sub-block i), qs[128].
        n_tok, n_in = x.shape
        nb = n_in // 256
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 176
                    d = _f16(wr, o, tab)
                    dmin = _f16(wr, o + 2, tab)
                    for p in range(4):
                        e0 = b * 256 + p * 64
                        q0 = o + 48 + p * 32
                        s0 = np.float32(0.0)
                        s1 = np.float32(0.0)
                        for l in range(2 * L):
                            q = np.int32(wr[q0 + l])
                            h = np.int32(wr[o + 16 + l]) >> (2 * p)
                            s0 += np.float32((q & 15) | ((h & 1) << 4)) * xt[e0 + l]
                            s1 += np.float32((q >> 4) | ((h & 2) << 3)) * xt[e0 + 32 + l]
                        sc0, m0 = _k_scale(wr, o + 4, 2 * p)
                        sc1, m1 = _k_scale(wr, o + 4, 2 * p + 1)
                        x0 = xs[t, e0 // 16] + xs[t, e0 // 16 + 1]
                        x1 = xs[t, e0 // 16 + 2] + xs[t, e0 // 16 + 3]
                        acc += d * (np.float32(sc0) * s0 + np.float32(sc1) * s1)
                        acc -= dmin * (np.float32(m0) * x0 + np.float32(m1) * x1)
                out[t, r] = acc

    @_jit
    def _mv_q6_k(w, x, xs, out, r0, r1, tab, L):
        # 210-byte super-blocks: ql[128], qh[64], scales[16] (int8), d. Two halves of 128.
        n_tok, n_in = x.shape
        nb = n_in // 256
        for r in range(r0, r1):
            wr = w[r]
            for t in range(n_tok):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 210
                    d = _f16(wr, o + 208, tab)
                    for hf in range(2):
                        ql = o + hf * 64
                        qh = o + 128 + hf * 32
                        sc = o + 192 + hf * 8
                        e0 = b * 256 + hf * 128
                        for i in range(2):
                            s1 = np.float32(0.0)
                            s2 = np.float32(0.0)
                            s3 = np.float32(0.0)
                            s4 = np.float32(0.0)
                            for l in range(i * L, i * L + L):
                                a = np.int32(wr[ql + l])
                                c = np.int32(wr[ql + 32 + l])
                                h = np.int32(wr[qh + l])
                                s1 += np.float32(((a & 15) | ((h & 3) << 4)) - 32) * xt[e0 + l]
                                s2 += np.float32(((c & 15) | ((h & 12) << 2)) - 32) * xt[e0 + 32 + l]
                                s3 += np.float32(((a >> 4) | (h & 48)) - 32) * xt[e0 + 64 + l]
                                s4 += np.float32(((c >> 4) | ((h & 192) >> 2)) - 32) * xt[e0 + 96 + l]
                            z = (np.float32(np.int8(wr[sc + i])) * s1
                                 + np.float32(np.int8(wr[sc + i + 2])) * s2
                                 + np.float32(np.int8(wr[sc + i + 4])) * s3
                                 + np.float32(np.int8(wr[sc + i + 6])) * s4)
                            acc += d * z
                out[t, r] = acc

    # One parallel driver per kernel, written out: numba caches each by its own name, and
    # compiles it lazily, on the first use of its type. Rows split into `n_chunks` runs.
    @_pjit
    def _par_f32(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_f32(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_f16(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_f16(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_bf16(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_bf16(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q4_0(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q4_0(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q4_1(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q4_1(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q5_0(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q5_0(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q5_1(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q5_1(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q8_0(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q8_0(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q2_k(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q2_k(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q3_k(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q3_k(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q4_k(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q4_k(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q5_k(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q5_k(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    @_pjit
    def _par_q6_k(w, x, xs, out, tab, n_chunks, L):
        n = w.shape[0]
        for c in prange(n_chunks):
            _mv_q6_k(w, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, tab, L)

    KERNELS.update({
        GGMLType.F32: (_mv_f32, _par_f32),
        GGMLType.F16: (_mv_f16, _par_f16),
        GGMLType.BF16: (_mv_bf16, _par_bf16),
        GGMLType.Q4_0: (_mv_q4_0, _par_q4_0),
        GGMLType.Q4_1: (_mv_q4_1, _par_q4_1),
        GGMLType.Q5_0: (_mv_q5_0, _par_q5_0),
        GGMLType.Q5_1: (_mv_q5_1, _par_q5_1),
        GGMLType.Q8_0: (_mv_q8_0, _par_q8_0),
        GGMLType.Q2_K: (_mv_q2_k, _par_q2_k),
        GGMLType.Q3_K: (_mv_q3_k, _par_q3_k),
        GGMLType.Q4_K: (_mv_q4_k, _par_q4_k),
        GGMLType.Q5_K: (_mv_q5_k, _par_q5_k),
        GGMLType.Q6_K: (_mv_q6_k, _par_q6_k),
    })

    # Repacked kernels for the priority types (Q4_1, Q8_0): rows innermost. A tile of R rows
    # stores, for each block b and byte j, the R rows' bytes side by side, and the block
    # scales as float32 rows of R; the innermost loop then runs over R independent rows
    # (no reduction), which LLVM vectorizes cleanly: ~2x the per-row kernels above.

    @_jit
    def _rp_q4_1(qs, dm, x, xs, out, t0, t1, R):
        # qs (n_tiles, nb, 16, R) uint8; dm (n_tiles, nb, 2, R) float32 (d, m).
        n_tok = x.shape[0]
        nb = qs.shape[1]
        s = np.empty(R, dtype=np.float32)
        acc = np.empty(R, dtype=np.float32)
        for tile in range(t0, t1):
            for t in range(n_tok):
                xt = x[t]
                for r in range(R):
                    acc[r] = 0.0
                for b in range(nb):
                    for r in range(R):
                        s[r] = 0.0
                    for j in range(16):
                        xl = xt[b * 32 + j]
                        xh = xt[b * 32 + 16 + j]
                        q = qs[tile, b, j]
                        for r in range(R):
                            v = np.int32(q[r])
                            lo = np.float32(np.int32(v & 15))
                            s[r] += lo * xl + np.float32(np.int32(v >> 4)) * xh
                    xsb = xs[t, 2 * b] + xs[t, 2 * b + 1]
                    d = dm[tile, b, 0]
                    m = dm[tile, b, 1]
                    for r in range(R):
                        acc[r] += d[r] * s[r] + m[r] * xsb
                for r in range(R):
                    out[t, tile * R + r] = acc[r]

    @_jit
    def _rp_q8_0(qs, dm, x, xs, out, t0, t1, R):
        # qs (n_tiles, nb, 32, R) int8; dm (n_tiles, nb, 1, R) float32 (d).
        n_tok = x.shape[0]
        nb = qs.shape[1]
        s = np.empty(R, dtype=np.float32)
        acc = np.empty(R, dtype=np.float32)
        for tile in range(t0, t1):
            for t in range(n_tok):
                xt = x[t]
                for r in range(R):
                    acc[r] = 0.0
                for b in range(nb):
                    for r in range(R):
                        s[r] = 0.0
                    for j in range(32):
                        xj = xt[b * 32 + j]
                        q = qs[tile, b, j]
                        for r in range(R):
                            s[r] += np.float32(np.int32(q[r])) * xj
                    d = dm[tile, b, 0]
                    for r in range(R):
                        acc[r] += d[r] * s[r]
                for r in range(R):
                    out[t, tile * R + r] = acc[r]

    @_pjit
    def _rpp_q4_1(qs, dm, x, xs, out, n_chunks, R):
        n = qs.shape[0]
        for c in prange(n_chunks):
            _rp_q4_1(qs, dm, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, R)

    @_pjit
    def _rpp_q8_0(qs, dm, x, xs, out, n_chunks, R):
        n = qs.shape[0]
        for c in prange(n_chunks):
            _rp_q8_0(qs, dm, x, xs, out, c * n // n_chunks, (c + 1) * n // n_chunks, R)

    REPACKED.update({
        GGMLType.Q4_1: (_rp_q4_1, _rpp_q4_1),
        GGMLType.Q8_0: (_rp_q8_0, _rpp_q8_0),
    })


def numba_enabled() -> bool:
    """Whether the numba kernels are in use (False without numba or with LLAMAPY_NO_NUMBA=1)."""
    return HAVE_NUMBA


@dataclass
class QMatrix:
    """A weight matrix (n_out rows of n_in elements) kept quantized, ready for matmul.

    Most types keep `data`, the file's own bytes ((n_out, row_bytes) uint8, usually a read-only
    view of the GGUF memmap): nothing is copied and the pages stay droppable by the OS.
    Q4_1 and Q8_0 (with numba) are repacked once into row-interleaved tiles (`_qs`, `_dm`;
    +20% / +6% over the file's bytes) and the mapped rows are released; `data` then only keeps
    a copy of the last n_out % REPACK_ROWS rows, in the file's layout.
    """

    qtype: GGMLType
    n_out: int
    n_in: int
    data: np.ndarray = field(repr=False)
    # The view the per-row kernels read (int8 for Q8_0, uint16 for F16/BF16, float32 for F32).
    _kdata: np.ndarray | None = field(repr=False, default=None)
    _qs: np.ndarray | None = field(repr=False, default=None)
    _dm: np.ndarray | None = field(repr=False, default=None)
    _n_full: int = 0  # rows held by the repacked tiles

    @classmethod
    def prepare(cls, raw: np.ndarray, qtype: GGMLType, n_out: int, n_in: int) -> QMatrix:
        qtype = GGMLType(qtype)
        if qtype not in quants.DEQUANT_TYPES:
            raise UnsupportedError(f"matmul with weights of type {qtype.name}")
        blck, bsize = block_size(qtype)
        if n_in % blck:
            raise ValueError(f"n_in={n_in} is not a multiple of {qtype.name}'s block of {blck}")
        row_bytes = n_in // blck * bsize
        data = np.asarray(raw).view(np.uint8)
        if data.size != n_out * row_bytes:
            raise ValueError(
                f"{qtype.name} matrix {n_out}x{n_in} needs {n_out * row_bytes} bytes, got {data.size}"
            )
        # A reshape of a contiguous view, never a copy: the memmap is what we hold.
        data = np.ascontiguousarray(data.reshape(n_out, row_bytes))
        m = cls(qtype, n_out, n_in, data)
        if HAVE_NUMBA and qtype in REPACKED and n_out >= REPACK_ROWS:
            m._repack()
        m._kdata = _kernel_view(qtype, m.data)
        return m

    def _repack(self) -> None:
        hdr, nq = _REPACK_SPLIT[self.qtype]
        R = REPACK_ROWS
        nb = self.n_in // 32
        n_full = self.n_out // R * R
        blocks = self.data[:n_full].reshape(n_full // R, R, nb, hdr + nq)
        qs = blocks[..., hdr:].transpose(0, 2, 3, 1)
        if self.qtype == GGMLType.Q8_0:
            qs = qs.view(np.int8)
        self._qs = np.ascontiguousarray(qs)
        scales = np.ascontiguousarray(blocks[..., :hdr]).view(np.float16).astype(np.float32)
        self._dm = np.ascontiguousarray(scales.transpose(0, 2, 3, 1))
        self._n_full = n_full
        # Drop the mapped rows: only the (copied) tail stays in the file's layout.
        self.data = np.array(self.data[n_full:])

    def _raw_rows(self, ids: np.ndarray) -> np.ndarray:
        """The file's bytes of rows `ids` (int64 array), (len(ids), row_bytes) uint8."""
        if self._qs is None:
            return self.data[ids]
        hdr, nq = _REPACK_SPLIT[self.qtype]
        R = REPACK_ROWS
        nb = self.n_in // 32
        out = np.empty((ids.size, nb, hdr + nq), np.uint8)
        full = ids < self._n_full
        f = ids[full]
        if f.size:
            tiles, rr = f // R, f % R
            out[full, :, hdr:] = self._qs[tiles, :, :, rr].view(np.uint8)
            d = self._dm[tiles, :, :, rr].astype(np.float16)  # exact: they came from f16
            out[full, :, :hdr] = d.view(np.uint8)
        if (~full).any():
            out[~full] = self.data[ids[~full] - self._n_full].reshape(-1, nb, hdr + nq)
        return out.reshape(ids.size, -1)

    @property
    def nbytes(self) -> int:
        """Bytes this object holds: the quantized rows (file layout) plus any repacked tiles."""
        n = int(self.data.nbytes)
        if self._qs is not None and self._dm is not None:
            n += int(self._qs.nbytes + self._dm.nbytes)
        return n

    def _ids(self, rows: np.ndarray | slice | None) -> np.ndarray:
        if rows is None:
            return np.arange(self.n_out, dtype=np.int64)
        if isinstance(rows, slice):
            return np.arange(self.n_out, dtype=np.int64)[rows]
        ids = np.asarray(rows, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < -self.n_out or ids.max() >= self.n_out):
            raise IndexError(f"row id out of range 0..{self.n_out - 1}")
        return np.where(ids < 0, ids + self.n_out, ids)

    def dequantize(self, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """float32 (n, n_in) of the selected rows (all when `rows` is None)."""
        if self._qs is None and (rows is None or isinstance(rows, slice)):
            sel = self.data if rows is None else self.data[rows]
            return quants.dequantize(sel, self.qtype, self.n_in).reshape(-1, self.n_in)
        return quants.dequantize(self._raw_rows(self._ids(rows)), self.qtype, self.n_in).reshape(
            -1, self.n_in
        )

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """GET_ROWS: float32 (len(ids), n_in), e.g. token embeddings."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_out):
            raise IndexError(f"row id out of range 0..{self.n_out - 1}")
        return self.dequantize(ids)

    def matmul(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """x float32 (n_tokens, n_in) -> float32 (n_tokens, n_out) = x @ W.T."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        if squeeze:
            x = x.reshape(1, -1)
        if x.ndim != 2 or x.shape[1] != self.n_in:
            raise ValueError(f"x has shape {x.shape}, expected (n_tokens, {self.n_in})")
        n_tok = x.shape[0]
        if self.qtype == GGMLType.F32 and n_tok >= 2:
            # Already float32: the file's rows are the BLAS operand, no copy.
            out = x @ self.data.view(np.float32).T
        elif HAVE_NUMBA and n_tok < BLAS_MIN_TOKENS:
            out = self._matmul_numba(x, n_threads)
        else:
            out = self._matmul_tiles(x)
        return out.reshape(-1) if squeeze else out

    def _matmul_numba(self, x: np.ndarray, n_threads: int) -> np.ndarray:
        n_tok = x.shape[0]
        out = np.empty((n_tok, self.n_out), dtype=np.float32)
        xs = _block_sums16(x)
        nt = _threads(n_threads)
        big = self.n_out * self.n_in * n_tok >= PARALLEL_MIN_WEIGHTS
        if nt > 1 and big and numba.get_num_threads() != nt:
            numba.set_num_threads(nt)
        if self._qs is not None:
            serial, parallel = REPACKED[self.qtype]
            n_tiles = self._qs.shape[0]
            if nt > 1 and big and n_tiles >= nt:
                parallel(self._qs, self._dm, x, xs, out, nt, REPACK_ROWS)
            else:
                serial(self._qs, self._dm, x, xs, out, 0, n_tiles, REPACK_ROWS)
            if self._n_full < self.n_out:
                tail = np.empty((n_tok, self.n_out - self._n_full), dtype=np.float32)
                KERNELS[self.qtype][0](
                    self._kdata, x, xs, tail, 0, tail.shape[1], F16_TABLE, 16
                )
                out[:, self._n_full :] = tail
            return out
        serial, parallel = KERNELS[self.qtype]
        if nt > 1 and big and self.n_out >= 2 * nt:
            parallel(self._kdata, x, xs, out, F16_TABLE, nt, 16)
        else:
            serial(self._kdata, x, xs, out, 0, self.n_out, F16_TABLE, 16)
        return out

    def _matmul_tiles(self, x: np.ndarray) -> np.ndarray:
        # Prompt processing / no numba: expand row tiles to f32 and let BLAS do the flops.
        out = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        step = max(1, TILE_ELEMS // self.n_in)
        for r0 in range(0, self.n_out, step):
            r1 = min(self.n_out, r0 + step)
            tile = self.dequantize(slice(r0, r1))
            np.matmul(x, tile.T, out=out[:, r0:r1])
        return out


def _kernel_view(qtype: GGMLType, data: np.ndarray) -> np.ndarray:
    """The dtype view of the file's rows that the per-row kernel of `qtype` reads."""
    if qtype == GGMLType.Q8_0:
        return data.view(np.int8)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        return data.view(np.uint16)
    if qtype == GGMLType.F32:
        return data.view(np.float32)
    return data
