"""Quantized MUL_MAT for the CPU backend (ggml-cpu's `ggml_compute_forward_mul_mat` and the
`ggml_vec_dot_*` kernels of ggml-cpu `quants.c`).

Weights stay exactly as the GGUF file stores them: `QMatrix` keeps a (n_out, row_bytes) uint8
view of the (memory-mapped) tensor and never expands the whole matrix to float32. Unlike ggml, the
activations are NOT quantized to q8: each kernel multiplies the weight blocks with the float32
activations directly, so the only rounding is the weights' own.

Paths, picked per call:
  * n_tokens < `BLAS_MIN_TOKENS` (decode, short batches), Q4_0/Q4_1/Q8_0/Q4_K/Q6_K: numba
    kernels on a row-interleaved repack (tiles of `REPACK_ROWS` rows; the innermost loop runs
    across rows, so it vectorizes without a horizontal sum per block). Costs +11/+20/+6/+6/+1%
    of the file's bytes; the mapped rows are then released (MADV_DONTNEED on a read-only map).
  * n_tokens < `BLAS_MIN_TOKENS`, every other type: numba kernels, one per type, that walk
    the file's blocks row by row. A block's dot is summed in float32 lanes (fastmath reassoc lets
    LLVM vectorize it) and then scaled; `x`'s block sums turn the `+ m` / `- dmin*m` terms into
    one multiply per block.
  * n_tokens >= `BLAS_MIN_TOKENS` (prompt processing): row tiles are expanded to float32 by numba
    kernels (bit-exact with `llamapy.quants`; repacked tiles come out transposed, which is the
    layout sgemm wants) and handed to numpy's BLAS; the tile bounds the memory.
  * no numba, or LLAMAPY_NO_NUMBA=1: numpy dequantization + BLAS for every n_tokens.
Threads: calls of >= `PARALLEL_MIN_WEIGHTS` are cut into chunks run by the caller and helper
threads of our own (`_POOL`, not numba's prange), so that a helper that is not scheduled never
stalls the caller.
"""

from __future__ import annotations

import itertools
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from llamapy import quants
from llamapy.types import GGMLType, UnsupportedError, block_size

try:  # numba is optional: without it everything runs on numpy + BLAS.
    if os.environ.get("LLAMAPY_NO_NUMBA", "") not in ("", "0"):
        raise ImportError("disabled by LLAMAPY_NO_NUMBA")
    import numba
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - depends on the environment
    numba = None
    HAVE_NUMBA = False

# At or above this many tokens, dequantized tiles + BLAS beat the per-block kernels.
BLAS_MIN_TOKENS = 16
# Float32 elements per dequantized tile on the BLAS path (4 MiB).
TILE_ELEMS = 1 << 20

# f16 bit pattern -> float32, for the kernels (a 256 KiB table stays mostly in L2).
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_num_threads = 0


def set_num_threads(n: int) -> None:
    """Threads the kernels use (llama.cpp's `-t`); 0 means one per core."""
    global _num_threads
    _num_threads = max(0, int(n))


_numba_threads = 0


def _set_numba_threads(n: int) -> None:
    global _numba_threads
    if n != _numba_threads:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        _numba_threads = n


def _threads(n_threads: int) -> int:
    if not HAVE_NUMBA:
        return 1
    n = n_threads or _num_threads
    return n if n > 0 else (os.cpu_count() or 1)


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

# Per-row kernels on the file's layout, rows-innermost kernels on repacked tiles, and the
# dequantization kernels of each layout (see below for their signatures).
KERNELS: dict[GGMLType, Callable[..., Any]] = {}
REPACKED: dict[GGMLType, Callable[..., Any]] = {}
PAR_REPACKED: dict[GGMLType, Callable[..., Any]] = {}
# Decode calls with at least this many weights use the prange drivers when threads > 1.
PRANGE_MIN_WEIGHTS = 1 << 18
DEQUANT: dict[GGMLType, Callable[..., Any]] = {}
DEQUANT_REPACKED: dict[GGMLType, Callable[..., Any]] = {}
PAR_REPACKED: dict[GGMLType, Callable[..., Any]] = {}
# Decode calls with at least this many weights use the prange drivers when threads > 1.
PRANGE_MIN_WEIGHTS = 1 << 18
DEQUANT_TILES: dict[GGMLType, Callable[..., Any]] = {}
# Rows per repacked tile: wide enough for 8-lane AVX2 loops with little loop overhead
# (measured on Q4_1 1536x576: R=16 3.2, R=32 6.5, R=64 7.2 G weights/s on one thread).
REPACK_ROWS = 64

if HAVE_NUMBA:
    _jit = njit(cache=True, fastmath=_FM, nogil=True, boundscheck=False)

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

    KERNELS.update({
        GGMLType.F32: _mv_f32,
        GGMLType.F16: _mv_f16,
        GGMLType.BF16: _mv_bf16,
        GGMLType.Q4_0: _mv_q4_0,
        GGMLType.Q4_1: _mv_q4_1,
        GGMLType.Q5_0: _mv_q5_0,
        GGMLType.Q5_1: _mv_q5_1,
        GGMLType.Q8_0: _mv_q8_0,
        GGMLType.Q2_K: _mv_q2_k,
        GGMLType.Q3_K: _mv_q3_k,
        GGMLType.Q4_K: _mv_q4_k,
        GGMLType.Q5_K: _mv_q5_k,
        GGMLType.Q6_K: _mv_q6_k,
    })

    # ----------------------------------------------------------------------------------------
    # Repacked kernels: rows innermost. A tile of R rows stores, for each block b and byte j,
    # the R rows' bytes side by side, and the block scales as float32 rows of R; the innermost
    # loop then runs over R independent rows (no reduction), which LLVM vectorizes cleanly.
    # Each `_rp_<type>(p, x, xs, out, t0, t1)` computes out[:, t0*R:t1*R] from the tuple of
    # arrays `p` (see `_REPACK` for their layout).
    # ----------------------------------------------------------------------------------------

    @_jit
    def _rp_q4_0(p, x, xs, out, t0, t1):
        qs, dm = p  # qs (T, nb, 16, R) uint8; dm (T, nb, 1, R) float32 (d)
        n_tok = x.shape[0]
        nb, R = qs.shape[1], qs.shape[3]
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
                            s[r] += np.float32((v & 15) - 8) * xl + np.float32((v >> 4) - 8) * xh
                    d = dm[tile, b, 0]
                    for r in range(R):
                        acc[r] += d[r] * s[r]
                for r in range(R):
                    out[t, tile * R + r] = acc[r]

    @_jit
    def _rp_q4_1(p, x, xs, out, t0, t1):
        qs, dm = p  # qs (T, nb, 16, R) uint8; dm (T, nb, 2, R) float32 (d, m)
        n_tok = x.shape[0]
        nb, R = qs.shape[1], qs.shape[3]
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
    def _rp_q8_0(p, x, xs, out, t0, t1):
        qs, dm = p  # qs (T, nb, 32, R) int8; dm (T, nb, 1, R) float32 (d)
        n_tok = x.shape[0]
        nb, R = qs.shape[1], qs.shape[3]
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

    @_jit
    def _rp_q4_k(p, x, xs, out, t0, t1):
        # qs (T, nb, 128, R) uint8; sm (T, nb, 16, R) uint8 (8 scales, 8 mins, 6 bits each);
        # dm (T, nb, 2, R) float32 (d, dmin).
        qs, sm, dm = p
        n_tok = x.shape[0]
        nb, R = qs.shape[1], qs.shape[3]
        s0 = np.empty(R, dtype=np.float32)
        s1 = np.empty(R, dtype=np.float32)
        acc = np.empty(R, dtype=np.float32)
        for tile in range(t0, t1):
            for t in range(n_tok):
                xt = x[t]
                for r in range(R):
                    acc[r] = 0.0
                for b in range(nb):
                    d = dm[tile, b, 0]
                    dmin = dm[tile, b, 1]
                    for pp in range(4):
                        e0 = b * 256 + pp * 64
                        for r in range(R):
                            s0[r] = 0.0
                            s1[r] = 0.0
                        for l in range(32):
                            xl = xt[e0 + l]
                            xh = xt[e0 + 32 + l]
                            q = qs[tile, b, pp * 32 + l]
                            for r in range(R):
                                v = np.int32(q[r])
                                s0[r] += np.float32(v & 15) * xl
                                s1[r] += np.float32(v >> 4) * xh
                        x0 = xs[t, e0 // 16] + xs[t, e0 // 16 + 1]
                        x1 = xs[t, e0 // 16 + 2] + xs[t, e0 // 16 + 3]
                        c0 = sm[tile, b, 2 * pp]
                        c1 = sm[tile, b, 2 * pp + 1]
                        m0 = sm[tile, b, 8 + 2 * pp]
                        m1 = sm[tile, b, 9 + 2 * pp]
                        for r in range(R):
                            acc[r] += d[r] * (np.float32(c0[r]) * s0[r] + np.float32(c1[r]) * s1[r])
                            acc[r] -= dmin[r] * (np.float32(m0[r]) * x0 + np.float32(m1[r]) * x1)
                for r in range(R):
                    out[t, tile * R + r] = acc[r]

    @_jit
    def _rp_q6_k(p, x, xs, out, t0, t1):
        # ql (T, nb, 128, R) uint8; qh (T, nb, 64, R) uint8; sc (T, nb, 16, R) int8;
        # dm (T, nb, 1, R) float32 (d).
        ql, qh, sc, dm = p
        n_tok = x.shape[0]
        nb, R = ql.shape[1], ql.shape[3]
        s1 = np.empty(R, dtype=np.float32)
        s2 = np.empty(R, dtype=np.float32)
        s3 = np.empty(R, dtype=np.float32)
        s4 = np.empty(R, dtype=np.float32)
        acc = np.empty(R, dtype=np.float32)
        for tile in range(t0, t1):
            for t in range(n_tok):
                xt = x[t]
                for r in range(R):
                    acc[r] = 0.0
                for b in range(nb):
                    d = dm[tile, b, 0]
                    for hf in range(2):
                        e0 = b * 256 + hf * 128
                        for i in range(2):
                            for r in range(R):
                                s1[r] = 0.0
                                s2[r] = 0.0
                                s3[r] = 0.0
                                s4[r] = 0.0
                            for l in range(i * 16, i * 16 + 16):
                                x1 = xt[e0 + l]
                                x2 = xt[e0 + 32 + l]
                                x3 = xt[e0 + 64 + l]
                                x4 = xt[e0 + 96 + l]
                                qa = ql[tile, b, hf * 64 + l]
                                qc = ql[tile, b, hf * 64 + 32 + l]
                                qq = qh[tile, b, hf * 32 + l]
                                for r in range(R):
                                    a = np.int32(qa[r])
                                    c = np.int32(qc[r])
                                    h = np.int32(qq[r])
                                    s1[r] += np.float32(((a & 15) | ((h & 3) << 4)) - 32) * x1
                                    s2[r] += np.float32(((c & 15) | ((h & 12) << 2)) - 32) * x2
                                    s3[r] += np.float32(((a >> 4) | (h & 48)) - 32) * x3
                                    s4[r] += np.float32(((c >> 4) | ((h & 192) >> 2)) - 32) * x4
                            k = hf * 8 + i
                            c1 = sc[tile, b, k]
                            c2 = sc[tile, b, k + 2]
                            c3 = sc[tile, b, k + 4]
                            c4 = sc[tile, b, k + 6]
                            for r in range(R):
                                acc[r] += d[r] * (np.float32(c1[r]) * s1[r] + np.float32(c2[r]) * s2[r]
                                                  + np.float32(c3[r]) * s3[r] + np.float32(c4[r]) * s4[r])
                for r in range(R):
                    out[t, tile * R + r] = acc[r]

    REPACKED.update({
        GGMLType.Q4_0: _rp_q4_0,
        GGMLType.Q4_1: _rp_q4_1,
        GGMLType.Q8_0: _rp_q8_0,
        GGMLType.Q4_K: _rp_q4_k,
        GGMLType.Q6_K: _rp_q6_k,
    })

    # Multi-threaded drivers for decode: numba's prange over chunks of tiles (each chunk writes
    # its own output columns). Measured streaming 40 distinct 3072x576 Q4_1 matrices: 1 thread
    # 4.6 GB/s, 2 threads 8.7 GB/s; the Python-thread pool below reached 5.9 GB/s.
    _pjit = njit(cache=True, parallel=True, nogil=True)

    @_pjit
    def _prp_q4_0(p, x, xs, out, n_tiles, n_chunks):
        for c in numba.prange(n_chunks):
            _rp_q4_0(p, x, xs, out, c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks)

    @_pjit
    def _prp_q4_1(p, x, xs, out, n_tiles, n_chunks):
        for c in numba.prange(n_chunks):
            _rp_q4_1(p, x, xs, out, c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks)

    @_pjit
    def _prp_q8_0(p, x, xs, out, n_tiles, n_chunks):
        for c in numba.prange(n_chunks):
            _rp_q8_0(p, x, xs, out, c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks)

    @_pjit
    def _prp_q4_k(p, x, xs, out, n_tiles, n_chunks):
        for c in numba.prange(n_chunks):
            _rp_q4_k(p, x, xs, out, c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks)

    @_pjit
    def _prp_q6_k(p, x, xs, out, n_tiles, n_chunks):
        for c in numba.prange(n_chunks):
            _rp_q6_k(p, x, xs, out, c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks)

    PAR_REPACKED.update({
        GGMLType.Q4_0: _prp_q4_0,
        GGMLType.Q4_1: _prp_q4_1,
        GGMLType.Q8_0: _prp_q8_0,
        GGMLType.Q4_K: _prp_q4_k,
        GGMLType.Q6_K: _prp_q6_k,
    })

    # ----------------------------------------------------------------------------------------
    # Dequantization kernels (prompt processing tiles, GET_ROWS, dequantize): the same float
    # operations, in the same order, as `llamapy.quants` (and so gguf-py), hence bit-exact; no
    # fastmath. `_dq_<type>(w, ids, out, i0, i1, tab)` expands file-layout rows ids[i0:i1] into
    # out[i0:i1]; `_dqr_<type>(p, ids, out, i0, i1)` does the same from the repacked tiles.
    # ----------------------------------------------------------------------------------------
    _djit = njit(cache=True, nogil=True, boundscheck=False)

    @_djit
    def _dq_q4_0(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 32
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 18
                d = _f16(wr, o, tab)
                for j in range(16):
                    v = np.int32(wr[o + 2 + j])
                    o_[b * 32 + j] = d * np.float32(np.int32((v & 15) - 8))
                    o_[b * 32 + 16 + j] = d * np.float32(np.int32((v >> 4) - 8))

    @_djit
    def _dq_q4_1(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 32
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 20
                d = _f16(wr, o, tab)
                m = _f16(wr, o + 2, tab)
                for j in range(16):
                    v = np.int32(wr[o + 4 + j])
                    o_[b * 32 + j] = d * np.float32(np.int32(v & 15)) + m
                    o_[b * 32 + 16 + j] = d * np.float32(np.int32(v >> 4)) + m

    @_djit
    def _dq_q5_0(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 32
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 22
                d = _f16(wr, o, tab)
                qh = (np.int64(wr[o + 2]) | (np.int64(wr[o + 3]) << 8)
                      | (np.int64(wr[o + 4]) << 16) | (np.int64(wr[o + 5]) << 24))
                for j in range(16):
                    v = np.int32(wr[o + 6 + j])
                    h0 = np.int32((qh >> j) & 1) << 4
                    h1 = np.int32((qh >> (j + 16)) & 1) << 4
                    o_[b * 32 + j] = d * np.float32(np.int32(((v & 15) | h0) - 16))
                    o_[b * 32 + 16 + j] = d * np.float32(np.int32(((v >> 4) | h1) - 16))

    @_djit
    def _dq_q5_1(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 32
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 24
                d = _f16(wr, o, tab)
                m = _f16(wr, o + 2, tab)
                qh = (np.int64(wr[o + 4]) | (np.int64(wr[o + 5]) << 8)
                      | (np.int64(wr[o + 6]) << 16) | (np.int64(wr[o + 7]) << 24))
                for j in range(16):
                    v = np.int32(wr[o + 8 + j])
                    h0 = np.int32((qh >> j) & 1) << 4
                    h1 = np.int32((qh >> (j + 16)) & 1) << 4
                    o_[b * 32 + j] = d * np.float32(np.int32((v & 15) | h0)) + m
                    o_[b * 32 + 16 + j] = d * np.float32(np.int32((v >> 4) | h1)) + m

    @_djit
    def _dq_q8_0(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 32
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 34
                d = _f16(wr, o, tab)
                for j in range(32):
                    o_[b * 32 + j] = np.float32(np.int8(wr[o + 2 + j])) * d

    @_djit
    def _dq_q2_k(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 256
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 84
                d = _f16(wr, o + 80, tab)
                dmin = _f16(wr, o + 82, tab)
                for n in range(2):
                    for k in range(4):
                        for half in range(2):
                            sc = np.int32(wr[o + n * 8 + k * 2 + half])
                            dl = d * np.float32(np.int32(sc & 15))
                            ml = dmin * np.float32(np.int32(sc >> 4))
                            e0 = b * 256 + n * 128 + k * 32 + half * 16
                            q0 = o + 16 + n * 32 + half * 16
                            for l in range(16):
                                q = (np.int32(wr[q0 + l]) >> (2 * k)) & 3
                                o_[e0 + l] = dl * np.float32(np.int32(q)) - ml

    @_djit
    def _dq_q3_k(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 256
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 110
                d = _f16(wr, o + 108, tab)
                for n in range(2):
                    for k in range(4):
                        hb = 4 * n + k
                        for half in range(2):
                            si = n * 8 + k * 2 + half
                            lo = (np.int32(wr[o + 96 + (si & 7)]) >> (4 * (si >> 3))) & 15
                            hi = (np.int32(wr[o + 104 + (si & 3)]) >> (2 * (si >> 2))) & 3
                            dl = d * np.float32(np.int32((lo | (hi << 4)) - 32))
                            e0 = b * 256 + n * 128 + k * 32 + half * 16
                            q0 = o + 32 + n * 32 + half * 16
                            for l in range(16):
                                q = (np.int32(wr[q0 + l]) >> (2 * k)) & 3
                                h = (np.int32(wr[o + half * 16 + l]) >> hb) & 1
                                o_[e0 + l] = dl * np.float32(np.int32(q - 4 + 4 * h))

    @_djit
    def _dq_q4_k(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 256
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 144
                d = _f16(wr, o, tab)
                dmin = _f16(wr, o + 2, tab)
                for p in range(4):
                    sc0, m0 = _k_scale(wr, o + 4, 2 * p)
                    sc1, m1 = _k_scale(wr, o + 4, 2 * p + 1)
                    d0 = d * np.float32(np.int32(sc0))
                    d1 = d * np.float32(np.int32(sc1))
                    n0 = dmin * np.float32(np.int32(m0))
                    n1 = dmin * np.float32(np.int32(m1))
                    e0 = b * 256 + p * 64
                    q0 = o + 16 + p * 32
                    for l in range(32):
                        v = np.int32(wr[q0 + l])
                        o_[e0 + l] = d0 * np.float32(np.int32(v & 15)) - n0
                        o_[e0 + 32 + l] = d1 * np.float32(np.int32(v >> 4)) - n1

    @_djit
    def _dq_q5_k(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 256
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 176
                d = _f16(wr, o, tab)
                dmin = _f16(wr, o + 2, tab)
                for p in range(4):
                    sc0, m0 = _k_scale(wr, o + 4, 2 * p)
                    sc1, m1 = _k_scale(wr, o + 4, 2 * p + 1)
                    d0 = d * np.float32(np.int32(sc0))
                    d1 = d * np.float32(np.int32(sc1))
                    n0 = dmin * np.float32(np.int32(m0))
                    n1 = dmin * np.float32(np.int32(m1))
                    e0 = b * 256 + p * 64
                    q0 = o + 48 + p * 32
                    for l in range(32):
                        v = np.int32(wr[q0 + l])
                        h = np.int32(wr[o + 16 + l]) >> (2 * p)
                        o_[e0 + l] = d0 * np.float32(np.int32((v & 15) | ((h & 1) << 4))) - n0
                        o_[e0 + 32 + l] = d1 * np.float32(np.int32((v >> 4) | ((h & 2) << 3))) - n1

    @_djit
    def _dq_q6_k(w, ids, out, i0, i1, tab):
        nb = out.shape[1] // 256
        for i in range(i0, i1):
            wr = w[ids[i]]
            o_ = out[i]
            for b in range(nb):
                o = b * 210
                d = _f16(wr, o + 208, tab)
                for hf in range(2):
                    ql = o + hf * 64
                    qh = o + 128 + hf * 32
                    sc = o + 192 + hf * 8
                    e0 = b * 256 + hf * 128
                    for i2 in range(2):
                        d1 = d * np.float32(np.int8(wr[sc + i2]))
                        d2 = d * np.float32(np.int8(wr[sc + i2 + 2]))
                        d3 = d * np.float32(np.int8(wr[sc + i2 + 4]))
                        d4 = d * np.float32(np.int8(wr[sc + i2 + 6]))
                        for l in range(i2 * 16, i2 * 16 + 16):
                            a = np.int32(wr[ql + l])
                            c = np.int32(wr[ql + 32 + l])
                            h = np.int32(wr[qh + l])
                            o_[e0 + l] = d1 * np.float32(np.int32(((a & 15) | ((h & 3) << 4)) - 32))
                            o_[e0 + 32 + l] = d2 * np.float32(np.int32(((c & 15) | ((h & 12) << 2)) - 32))
                            o_[e0 + 64 + l] = d3 * np.float32(np.int32(((a >> 4) | (h & 48)) - 32))
                            o_[e0 + 96 + l] = d4 * np.float32(np.int32(((c >> 4) | ((h & 192) >> 2)) - 32))

    DEQUANT.update({
        GGMLType.Q4_0: _dq_q4_0,
        GGMLType.Q4_1: _dq_q4_1,
        GGMLType.Q5_0: _dq_q5_0,
        GGMLType.Q5_1: _dq_q5_1,
        GGMLType.Q8_0: _dq_q8_0,
        GGMLType.Q2_K: _dq_q2_k,
        GGMLType.Q3_K: _dq_q3_k,
        GGMLType.Q4_K: _dq_q4_k,
        GGMLType.Q5_K: _dq_q5_k,
        GGMLType.Q6_K: _dq_q6_k,
    })

    # From the repacked tiles: row r of tile T is column r of every (.., R) slice.

    @_djit
    def _dqr_q4_0(p, ids, out, i0, i1):
        qs, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        for i in range(i0, i1):
            tile, r = ids[i] // R, ids[i] % R
            o_ = out[i]
            for b in range(nb):
                d = dm[tile, b, 0, r]
                for j in range(16):
                    v = np.int32(qs[tile, b, j, r])
                    o_[b * 32 + j] = d * np.float32(np.int32((v & 15) - 8))
                    o_[b * 32 + 16 + j] = d * np.float32(np.int32((v >> 4) - 8))

    @_djit
    def _dqr_q4_1(p, ids, out, i0, i1):
        qs, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        for i in range(i0, i1):
            tile, r = ids[i] // R, ids[i] % R
            o_ = out[i]
            for b in range(nb):
                d = dm[tile, b, 0, r]
                m = dm[tile, b, 1, r]
                for j in range(16):
                    v = np.int32(qs[tile, b, j, r])
                    o_[b * 32 + j] = d * np.float32(np.int32(v & 15)) + m
                    o_[b * 32 + 16 + j] = d * np.float32(np.int32(v >> 4)) + m

    @_djit
    def _dqr_q8_0(p, ids, out, i0, i1):
        qs, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        for i in range(i0, i1):
            tile, r = ids[i] // R, ids[i] % R
            o_ = out[i]
            for b in range(nb):
                d = dm[tile, b, 0, r]
                for j in range(32):
                    o_[b * 32 + j] = np.float32(np.int32(qs[tile, b, j, r])) * d

    @_djit
    def _dqr_q4_k(p, ids, out, i0, i1):
        qs, sm, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        for i in range(i0, i1):
            tile, r = ids[i] // R, ids[i] % R
            o_ = out[i]
            for b in range(nb):
                d = dm[tile, b, 0, r]
                dmin = dm[tile, b, 1, r]
                for p_ in range(4):
                    d0 = d * np.float32(np.int32(sm[tile, b, 2 * p_, r]))
                    d1 = d * np.float32(np.int32(sm[tile, b, 2 * p_ + 1, r]))
                    n0 = dmin * np.float32(np.int32(sm[tile, b, 8 + 2 * p_, r]))
                    n1 = dmin * np.float32(np.int32(sm[tile, b, 9 + 2 * p_, r]))
                    e0 = b * 256 + p_ * 64
                    for l in range(32):
                        v = np.int32(qs[tile, b, p_ * 32 + l, r])
                        o_[e0 + l] = d0 * np.float32(np.int32(v & 15)) - n0
                        o_[e0 + 32 + l] = d1 * np.float32(np.int32(v >> 4)) - n1

    @_djit
    def _dqr_q6_k(p, ids, out, i0, i1):
        ql, qh, sc, dm = p
        R, nb = ql.shape[3], ql.shape[1]
        for i in range(i0, i1):
            tile, r = ids[i] // R, ids[i] % R
            o_ = out[i]
            for b in range(nb):
                d = dm[tile, b, 0, r]
                for hf in range(2):
                    e0 = b * 256 + hf * 128
                    for i2 in range(2):
                        k = hf * 8 + i2
                        d1 = d * np.float32(np.int32(sc[tile, b, k, r]))
                        d2 = d * np.float32(np.int32(sc[tile, b, k + 2, r]))
                        d3 = d * np.float32(np.int32(sc[tile, b, k + 4, r]))
                        d4 = d * np.float32(np.int32(sc[tile, b, k + 6, r]))
                        for l in range(i2 * 16, i2 * 16 + 16):
                            a = np.int32(ql[tile, b, hf * 64 + l, r])
                            c = np.int32(ql[tile, b, hf * 64 + 32 + l, r])
                            h = np.int32(qh[tile, b, hf * 32 + l, r])
                            o_[e0 + l] = d1 * np.float32(np.int32(((a & 15) | ((h & 3) << 4)) - 32))
                            o_[e0 + 32 + l] = d2 * np.float32(np.int32(((c & 15) | ((h & 12) << 2)) - 32))
                            o_[e0 + 64 + l] = d3 * np.float32(np.int32(((a >> 4) | (h & 48)) - 32))
                            o_[e0 + 96 + l] = d4 * np.float32(np.int32(((c >> 4) | ((h & 192) >> 2)) - 32))

    DEQUANT_REPACKED.update({
        GGMLType.Q4_0: _dqr_q4_0,
        GGMLType.Q4_1: _dqr_q4_1,
        GGMLType.Q8_0: _dqr_q8_0,
        GGMLType.Q4_K: _dqr_q4_k,
        GGMLType.Q6_K: _dqr_q6_k,
    })

    # Whole tiles t0..t1 of the repacked layout, transposed: row r of tile `tile` becomes
    # column (tile - t0) * R + r of out_t (n_in, n_rows); reads and writes both run along r.

    @_djit
    def _dqt_q4_0(p, out_t, t0, t1):
        qs, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        for tile in range(t0, t1):
            c0_ = (tile - t0) * R
            for b in range(nb):
                d = dm[tile, b, 0]
                for j in range(16):
                    q = qs[tile, b, j]
                    for r in range(R):
                        v = np.int32(q[r])
                        out_t[b * 32 + j, c0_ + r] = d[r] * np.float32(np.int32((v & 15) - 8))
                        out_t[b * 32 + 16 + j, c0_ + r] = d[r] * np.float32(np.int32((v >> 4) - 8))

    @_djit
    def _dqt_q4_1(p, out_t, t0, t1):
        # Computed into local runs of R first: LLVM then vectorizes the expansion (it cannot
        # prove out_t does not alias the inputs), and the copies are plain streams.
        qs, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        lo = np.empty(R, dtype=np.float32)
        hi = np.empty(R, dtype=np.float32)
        for tile in range(t0, t1):
            c0_ = (tile - t0) * R
            for b in range(nb):
                d = dm[tile, b, 0]
                m = dm[tile, b, 1]
                for j in range(16):
                    q = qs[tile, b, j]
                    for r in range(R):
                        v = np.int32(q[r])
                        lo[r] = d[r] * np.float32(np.int32(v & 15)) + m[r]
                        hi[r] = d[r] * np.float32(np.int32(v >> 4)) + m[r]
                    out_t[b * 32 + j, c0_ : c0_ + R] = lo
                    out_t[b * 32 + 16 + j, c0_ : c0_ + R] = hi

    @_djit
    def _dqt_q8_0(p, out_t, t0, t1):
        qs, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        v = np.empty(R, dtype=np.float32)
        for tile in range(t0, t1):
            c0_ = (tile - t0) * R
            for b in range(nb):
                d = dm[tile, b, 0]
                for j in range(32):
                    q = qs[tile, b, j]
                    for r in range(R):
                        v[r] = np.float32(np.int32(q[r])) * d[r]
                    out_t[b * 32 + j, c0_ : c0_ + R] = v

    @_djit
    def _dqt_q4_k(p, out_t, t0, t1):
        qs, sm, dm = p
        R, nb = qs.shape[3], qs.shape[1]
        lo = np.empty(R, dtype=np.float32)
        hi = np.empty(R, dtype=np.float32)
        dl = np.empty((2, R), dtype=np.float32)
        ml = np.empty((2, R), dtype=np.float32)
        for tile in range(t0, t1):
            c0_ = (tile - t0) * R
            for b in range(nb):
                d = dm[tile, b, 0]
                dmin = dm[tile, b, 1]
                for p_ in range(4):
                    for h in range(2):
                        c = sm[tile, b, 2 * p_ + h]
                        mn = sm[tile, b, 8 + 2 * p_ + h]
                        for r in range(R):
                            dl[h, r] = d[r] * np.float32(np.int32(c[r]))
                            ml[h, r] = dmin[r] * np.float32(np.int32(mn[r]))
                    e0 = b * 256 + p_ * 64
                    for l in range(32):
                        q = qs[tile, b, p_ * 32 + l]
                        for r in range(R):
                            v = np.int32(q[r])
                            lo[r] = dl[0, r] * np.float32(np.int32(v & 15)) - ml[0, r]
                            hi[r] = dl[1, r] * np.float32(np.int32(v >> 4)) - ml[1, r]
                        out_t[e0 + l, c0_ : c0_ + R] = lo
                        out_t[e0 + 32 + l, c0_ : c0_ + R] = hi

    @_djit
    def _dqt_q6_k(p, out_t, t0, t1):
        ql, qh, sc, dm = p
        R, nb = ql.shape[3], ql.shape[1]
        dl = np.empty((4, R), dtype=np.float32)
        v = np.empty((4, R), dtype=np.float32)
        for tile in range(t0, t1):
            c0_ = (tile - t0) * R
            for b in range(nb):
                d = dm[tile, b, 0]
                for hf in range(2):
                    e0 = b * 256 + hf * 128
                    for i2 in range(2):
                        for k in range(4):
                            c = sc[tile, b, hf * 8 + i2 + 2 * k]
                            for r in range(R):
                                dl[k, r] = d[r] * np.float32(np.int32(c[r]))
                        for l in range(i2 * 16, i2 * 16 + 16):
                            qa = ql[tile, b, hf * 64 + l]
                            qc = ql[tile, b, hf * 64 + 32 + l]
                            qq = qh[tile, b, hf * 32 + l]
                            for r in range(R):
                                a = np.int32(qa[r])
                                c_ = np.int32(qc[r])
                                h = np.int32(qq[r])
                                v[0, r] = dl[0, r] * np.float32(np.int32(((a & 15) | ((h & 3) << 4)) - 32))
                                v[1, r] = dl[1, r] * np.float32(np.int32(((c_ & 15) | ((h & 12) << 2)) - 32))
                                v[2, r] = dl[2, r] * np.float32(np.int32(((a >> 4) | (h & 48)) - 32))
                                v[3, r] = dl[3, r] * np.float32(np.int32(((c_ >> 4) | ((h & 192) >> 2)) - 32))
                            for k in range(4):
                                out_t[e0 + 32 * k + l, c0_ : c0_ + R] = v[k]

    DEQUANT_TILES.update({
        GGMLType.Q4_0: _dqt_q4_0,
        GGMLType.Q4_1: _dqt_q4_1,
        GGMLType.Q8_0: _dqt_q8_0,
        GGMLType.Q4_K: _dqt_q4_k,
        GGMLType.Q6_K: _dqt_q6_k,
    })


def numba_enabled() -> bool:
    """Whether the numba kernels are in use (False without numba or with LLAMAPY_NO_NUMBA=1)."""
    return HAVE_NUMBA


# --------------------------------------------------------------------------------------------
# Threads. numba's parallel layers (omp/workqueue) split a `prange` statically and then wait
# at a barrier for every thread: on a shared, loaded machine a thread that is not scheduled
# stalls the whole call (measured: 2-thread decode slower than 1 thread). Instead, a call is
# cut into chunks that the calling thread and persistent helper threads claim one at a time
# (the kernels release the GIL). The caller never waits for a helper that has not started: it
# runs every chunk still unclaimed itself and then waits only for chunks in flight.
# --------------------------------------------------------------------------------------------


class _Job:
    __slots__ = ("fn", "n", "claim", "done", "event", "error")

    def __init__(self, fn: Callable[[int], None], n: int) -> None:
        self.fn, self.n = fn, n
        self.claim = itertools.count()  # next() is atomic under the GIL
        self.done = itertools.count(1)
        self.event = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        n = self.n
        while True:
            c = next(self.claim)
            if c >= n:
                return
            try:
                self.fn(c)
            except BaseException as e:  # pragma: no cover - re-raised by the caller
                self.error = e
            if next(self.done) == n:
                self.event.set()


class _Pool:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.n_helpers = 0
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def _helper(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            job.work()

    def run(self, fn: Callable[[int], None], n_chunks: int, n_threads: int) -> None:
        """fn(0..n_chunks-1), on up to n_threads threads (the caller is one of them)."""
        if n_threads <= 1 or n_chunks <= 1:
            for c in range(n_chunks):
                fn(c)
            return
        want = min(n_threads, n_chunks) - 1
        with self.lock:
            if self.pid != os.getpid():  # forked: the helpers did not come along
                self.__init__()  # type: ignore[misc]
            while self.n_helpers < want:
                threading.Thread(target=self._helper, daemon=True, name="llamapy-qmatmul").start()
                self.n_helpers += 1
        job = _Job(fn, n_chunks)
        for _ in range(want):
            self.queue.put(job)
        job.work()
        job.event.wait()
        if job.error is not None:
            raise job.error


    def run_private(
        self,
        fn: Callable[[int, np.ndarray], None],
        n_chunks: int,
        n_threads: int,
        out: np.ndarray,
        cols: Callable[[int], tuple[int, int]],
    ) -> None:
        """Like `run` for kernels that write out[:, cols(c)] of chunk c, but the caller never
        waits long on a helper: helpers compute into a private buffer and copy their columns
        into `out` only while the call is open; when the caller has run out of chunks it gives
        the helpers about one chunk's time, then closes the call and computes whatever they
        have not delivered itself (same kernel, same inputs: the same bits)."""
        if n_threads <= 1 or n_chunks <= 1:
            for c in range(n_chunks):
                fn(c, out)
            return
        want = min(n_threads, n_chunks) - 1
        with self.lock:
            if self.pid != os.getpid():
                self.__init__()  # type: ignore[misc]
            while self.n_helpers < want:
                threading.Thread(target=self._helper, daemon=True, name="llamapy-qmatmul").start()
                self.n_helpers += 1
        job = _PrivateJob(fn, n_chunks, out, cols)
        for _ in range(want):
            self.queue.put(job)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        mine = job.work_caller()
        if job.n_published < n_chunks:
            per_chunk = (time.perf_counter() - t0) / max(1, mine)
            job.event.wait(min(0.002, 1.5 * per_chunk + 30e-6))
        with job.lock:
            job.closed = True
            missing = [c for c in range(n_chunks) if not job.published[c]]
        for c in missing:
            fn(c, out)


class _PrivateJob:
    __slots__ = ("fn", "n", "out", "cols", "claim", "lock", "closed", "published",
                 "n_published", "event")

    def __init__(self, fn, n, out, cols) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.n, self.out, self.cols = fn, n, out, cols
        self.claim = itertools.count()
        self.lock = threading.Lock()
        self.closed = False
        self.published = [False] * n
        self.n_published = 0
        self.event = threading.Event()

    def _publish(self, c: int) -> None:
        # Under self.lock.
        self.published[c] = True
        self.n_published += 1
        if self.n_published == self.n:
            self.event.set()

    def work_caller(self) -> int:
        done = 0
        while True:
            c = next(self.claim)
            if c >= self.n:
                return done
            self.fn(c, self.out)
            done += 1
            with self.lock:
                self._publish(c)

    def work(self) -> None:  # a helper
        buf: np.ndarray | None = None
        while not self.closed:
            c = next(self.claim)
            if c >= self.n:
                return
            if buf is None:
                buf = np.empty_like(self.out)
            try:
                self.fn(c, buf)
            except Exception:  # pragma: no cover - the caller recomputes the chunk
                continue
            a, b = self.cols(c)
            with self.lock:
                if self.closed:
                    return
                self.out[:, a:b] = buf[:, a:b]
                self._publish(c)


_POOL = _Pool()

# Weights per chunk handed to a thread (~40 us of matvec): smaller matrices run on the calling
# thread alone, bigger ones in about this much work per chunk.
CHUNK_WEIGHTS = 1 << 18
# At most this many chunks per thread (bounds the per-chunk dispatch cost, ~3 us each).
MAX_CHUNKS_PER_THREAD = 8


# Below this many weights (x tokens) a call stays on the calling thread: on a shared machine a
# helper's wake-up and its last chunk cost more than they save (measured on 1536x576 Q4_1).
PARALLEL_MIN_WEIGHTS = 1 << 20


def _n_chunks(work: int, units: int, nt: int) -> int:
    if nt <= 1 or work < PARALLEL_MIN_WEIGHTS:
        return 1
    return int(max(1, min(units, work // CHUNK_WEIGHTS, MAX_CHUNKS_PER_THREAD * nt)))


# --------------------------------------------------------------------------------------------
# Repacking (rows innermost).
# --------------------------------------------------------------------------------------------


def _tr(a: np.ndarray) -> np.ndarray:
    """(T, R, nb, k) -> contiguous (T, nb, k, R)."""
    return np.ascontiguousarray(np.moveaxis(a, 1, 3))


def _f16_fields(b: np.ndarray) -> np.ndarray:
    """(T, R, nb, 2k) bytes holding k f16 -> (T, nb, k, R) float32 (exact)."""
    return _tr(np.ascontiguousarray(b).view(np.float16).astype(np.float32))


def _repack_q4_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _tr(b[..., 2:18]), _f16_fields(b[..., 0:2])


def _repack_q4_1(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _tr(b[..., 4:20]), _f16_fields(b[..., 0:4])


def _repack_q8_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _tr(b[..., 2:34]).view(np.int8), _f16_fields(b[..., 0:2])


def _repack_q4_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    sc, mn = quants.k_scale_min(b[..., 4:16].reshape(-1, 12))
    sm = np.concatenate([sc, mn], axis=1).reshape(*b.shape[:3], 16)
    return _tr(b[..., 16:144]), _tr(sm), _f16_fields(b[..., 0:4])


def _repack_q6_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return (_tr(b[..., 0:128]), _tr(b[..., 128:192]), _tr(b[..., 192:208]).view(np.int8),
            _f16_fields(b[..., 208:210]))


# Types with rows-innermost kernels; overhead over the file's bytes: Q4_0 +11%, Q4_1 +20%,
# Q8_0 +6%, Q4_K +6%, Q6_K +1%.
_REPACK: dict[GGMLType, Callable[[np.ndarray], tuple[np.ndarray, ...]]] = {
    GGMLType.Q4_0: _repack_q4_0,
    GGMLType.Q4_1: _repack_q4_1,
    GGMLType.Q8_0: _repack_q8_0,
    GGMLType.Q4_K: _repack_q4_k,
    GGMLType.Q6_K: _repack_q6_k,
}


def _drop_mapped_pages(a: np.ndarray) -> None:
    """Tell the OS the pages of `a` are not needed any more, when `a` is a view of a read-only
    file mapping (re-read from the file if ever touched again); anything else is left alone."""
    base: Any = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, np.ndarray):
        return
    obj = base.obj if isinstance(base, memoryview) else base
    if not isinstance(obj, mmap.mmap) or not hasattr(obj, "madvise"):
        return
    try:
        start = np.frombuffer(obj, np.uint8).ctypes.data
    except (TypeError, ValueError):  # pragma: no cover - a closed or writable mapping
        return
    try:
        np.frombuffer(obj, np.uint8)[:0].setflags(write=True)
        return  # writable mapping: MADV_DONTNEED could drop changes
    except ValueError:
        pass
    page = mmap.PAGESIZE
    lo = a.ctypes.data - start
    hi = lo + a.nbytes
    lo = -(-lo // page) * page
    hi = hi // page * page
    if 0 <= lo < hi <= len(obj):
        try:
            obj.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError, AttributeError):  # pragma: no cover
            pass


@dataclass
class QMatrix:
    """A weight matrix (n_out rows of n_in elements) kept quantized, ready for matmul.

    Most types keep `data`, the file's own bytes ((n_out, row_bytes) uint8, usually a read-only
    view of the GGUF memmap): nothing is copied and the pages stay droppable by the OS.
    Types in `_REPACK` (with numba) are repacked once into row-interleaved tiles (`_rp`, a tuple
    of arrays) and the mapped rows are released (and their pages dropped when they are a
    read-only file mapping); `data` then only keeps a copy of the last n_out % REPACK_ROWS rows,
    in the file's layout.
    """

    qtype: GGMLType
    n_out: int
    n_in: int
    data: np.ndarray = field(repr=False)
    # The view the per-row kernels read (int8 for Q8_0, uint16 for F16/BF16, float32 for F32).
    _kdata: np.ndarray | None = field(repr=False, default=None)
    _rp: tuple[np.ndarray, ...] | None = field(repr=False, default=None)
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
        if HAVE_NUMBA and qtype in _REPACK and n_out >= REPACK_ROWS:
            m._repack()
        m._kdata = _kernel_view(qtype, m.data)
        return m

    def _repack(self) -> None:
        blck, bsize = block_size(self.qtype)
        R = REPACK_ROWS
        nb = self.n_in // blck
        n_full = self.n_out // R * R
        src = self.data
        self._rp = _REPACK[self.qtype](src[:n_full].reshape(n_full // R, R, nb, bsize))
        self._n_full = n_full
        # Drop the mapped rows: only the (copied) tail stays in the file's layout.
        self.data = np.array(src[n_full:])
        _drop_mapped_pages(src[:n_full])

    @property
    def repacked(self) -> bool:
        return self._rp is not None

    def state(self) -> list[np.ndarray] | None:
        """The arrays a repacked matrix is made of (tiles..., tail rows), for a cache file;
        None when the matrix is not repacked (it is then just the file's bytes)."""
        if self._rp is None:
            return None
        return [*self._rp, self.data]

    @classmethod
    def from_state(cls, qtype: GGMLType, n_out: int, n_in: int, arrays: list[np.ndarray]) -> QMatrix:
        """Rebuild a repacked matrix from `state()`'s arrays (e.g. views of a mapped cache file)."""
        qtype = GGMLType(qtype)
        *rp, tail = arrays
        m = cls(qtype, n_out, n_in, tail)
        m._rp = tuple(rp)
        m._n_full = n_out - tail.shape[0]
        m._kdata = _kernel_view(qtype, m.data)
        return m

    @property
    def nbytes(self) -> int:
        """Bytes this object holds: the quantized rows (file layout) plus any repacked tiles."""
        n = int(self.data.nbytes)
        if self._rp is not None:
            n += sum(int(a.nbytes) for a in self._rp)
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

    def dequantize(self, rows: np.ndarray | slice | None = None, n_threads: int = 0) -> np.ndarray:
        """float32 (n, n_in) of the selected rows (all when `rows` is None).

        C-contiguous, except for a run of whole repacked tiles, which comes back in Fortran order
        (the transpose of the (n_in, n) array the fast kernel writes; `.T` of it is what BLAS
        wants as the right-hand operand)."""
        ids = self._ids(rows)
        fast = self._rp is not None or (HAVE_NUMBA and self.qtype in DEQUANT)
        if not fast:
            sel = self.data if rows is None else self.data[rows] if isinstance(rows, slice) else self.data[ids]
            return quants.dequantize(sel, self.qtype, self.n_in).reshape(-1, self.n_in)
        R, n = REPACK_ROWS, ids.size
        if self._rp is not None and n and ids[0] % R == 0 and n % R == 0 and ids[-1] < self._n_full:
            if n == 1 or bool((np.diff(ids) == 1).all()):
                # Whole tiles in order (the BLAS path's tiles): expanded transposed, at full
                # speed, and returned as the transpose of that (a Fortran-ordered array).
                return self._dequant_tiles_t(int(ids[0]) // R, n // R, n_threads).T
        out = np.empty((n, self.n_in), dtype=np.float32)
        self._dequant_into(ids, out, n_threads)
        return out

    def _dequant_tiles_t(self, ta: int, n_t: int, n_threads: int) -> np.ndarray:
        """Repacked tiles ta..ta+n_t expanded to float32, transposed: (n_in, n_t * R)."""
        R = REPACK_ROWS
        # Rows padded by 16 floats: a stride of a multiple of 4 KiB aliases in L1.
        out_t = np.empty((self.n_in, n_t * R + 16), dtype=np.float32)[:, : n_t * R]
        nt = _threads(n_threads)
        nc = _n_chunks(n_t * R * self.n_in * 4, n_t, nt)
        kt, p = DEQUANT_TILES[self.qtype], self._rp

        def chunk(c: int) -> None:
            a, b = c * n_t // nc, (c + 1) * n_t // nc
            kt(p, out_t[:, a * R : b * R], ta + a, ta + b)

        _POOL.run(chunk, nc, nt)
        return out_t

    def _dequant_into(self, ids: np.ndarray, out: np.ndarray, n_threads: int) -> None:
        n = ids.size
        if n == 0:
            return
        nt = _threads(n_threads)
        n_chunks = _n_chunks(n * self.n_in * 4, n, nt)  # an element costs ~4 matvec weights
        if self._rp is None:
            k, w = DEQUANT[self.qtype], self.data

            def chunk(c: int) -> None:
                k(w, ids, out, c * n // n_chunks, (c + 1) * n // n_chunks, F16_TABLE)

            _POOL.run(chunk, n_chunks, nt)
            return
        full = bool(ids.max() < self._n_full)
        rp_ids = ids if full else ids[ids < self._n_full]
        target = out if full else np.empty((rp_ids.size, self.n_in), np.float32)
        kr, p, nr = DEQUANT_REPACKED[self.qtype], self._rp, rp_ids.size

        def chunk_r(c: int) -> None:
            kr(p, rp_ids, target, c * nr // n_chunks, (c + 1) * nr // n_chunks)

        if nr:
            _POOL.run(chunk_r, min(n_chunks, nr), nt)
        if not full:
            tail = ids >= self._n_full
            out[~tail] = target
            t_ids = ids[tail] - self._n_full
            t_out = np.empty((t_ids.size, self.n_in), np.float32)
            DEQUANT[self.qtype](self.data, t_ids, t_out, 0, t_ids.size, F16_TABLE)
            out[tail] = t_out

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
        elif (HAVE_NUMBA or self._rp is not None) and n_tok < BLAS_MIN_TOKENS:
            out = self._matmul_numba(x, n_threads)
        else:
            out = self._matmul_tiles(x, n_threads)
        return out.reshape(-1) if squeeze else out

    def _matmul_numba(self, x: np.ndarray, n_threads: int) -> np.ndarray:
        n_tok = x.shape[0]
        out = np.empty((n_tok, self.n_out), dtype=np.float32)
        xs = _block_sums16(x)
        nt = _threads(n_threads)
        work = self.n_out * self.n_in * n_tok
        if self._rp is not None:
            kr, p = REPACKED[self.qtype], self._rp
            n_tiles = self._n_full // REPACK_ROWS
            if nt > 1 and work >= PRANGE_MIN_WEIGHTS and n_tiles >= 2 * nt:
                _set_numba_threads(nt)
                PAR_REPACKED[self.qtype](p, x, xs, out, n_tiles, min(n_tiles, 4 * nt))
                self._matmul_tail(x, xs, out)
                return out
            nc = _n_chunks(work, n_tiles, nt)

            def chunk(c: int, dst: np.ndarray) -> None:
                kr(p, x, xs, dst, c * n_tiles // nc, (c + 1) * n_tiles // nc)

            def cols(c: int) -> tuple[int, int]:
                return c * n_tiles // nc * REPACK_ROWS, (c + 1) * n_tiles // nc * REPACK_ROWS

            _POOL.run_private(chunk, nc, nt, out, cols)
            self._matmul_tail(x, xs, out)
            return out
        k, w, n = KERNELS[self.qtype], self._kdata, self.n_out
        nc = _n_chunks(work, n, nt)

        def chunk_f(c: int, dst: np.ndarray) -> None:
            k(w, x, xs, dst, c * n // nc, (c + 1) * n // nc, F16_TABLE, 16)

        def cols_f(c: int) -> tuple[int, int]:
            return c * n // nc, (c + 1) * n // nc

        _POOL.run_private(chunk_f, nc, nt, out, cols_f)
        return out

    def _matmul_tail(self, x: np.ndarray, xs: np.ndarray, out: np.ndarray) -> None:
        """The last n_out % REPACK_ROWS rows, kept in the file's layout."""
        if self._n_full < self.n_out:
            tail = np.empty((x.shape[0], self.n_out - self._n_full), dtype=np.float32)
            KERNELS[self.qtype](self._kdata, x, xs, tail, 0, tail.shape[1], F16_TABLE, 16)
            out[:, self._n_full :] = tail

    def matmul_tiles(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """x @ W.T through f32 tiles and sgemm whatever the batch (the BLAS backend's path)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.qtype == GGMLType.F32:
            return x @ self.data.view(np.float32).T
        return self._matmul_tiles(x, n_threads)

    def _matmul_tiles(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        # Prompt processing / no numba: expand row tiles to f32 and let BLAS do the flops.
        out = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        step = max(1, TILE_ELEMS // self.n_in)
        r_start = 0
        if self._rp is not None:
            R = REPACK_ROWS
            n_t, step_t = self._n_full // R, max(1, step // R)
            for t0 in range(0, n_t, step_t):
                t1 = min(n_t, t0 + step_t)
                tile_t = self._dequant_tiles_t(t0, t1 - t0, n_threads)  # (n_in, rows)
                np.matmul(x, tile_t, out=out[:, t0 * R : t1 * R])
            r_start = self._n_full
        for r0 in range(r_start, self.n_out, step):
            r1 = min(self.n_out, r0 + step)
            tile = self.dequantize(slice(r0, r1), n_threads)
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
