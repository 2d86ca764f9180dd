"""numba kernels of the CPU backend: the fallback when the C kernels (native.py) cannot be built.

Imported only on demand (`qmatmul.numba_kernels()`), because importing numba loads LLVM: ~60 MiB
at import and ~130 MiB once kernels run. Holds the quantized MUL_MAT / dequantization kernels
(ggml-cpu quants.c `ggml_vec_dot_*`, repack.cpp) and the small per-token ops (ggml-cpu ops.cpp:
rms_norm, rope, flash_attn_ext, swiglu); every kernel is JIT-compiled and cached on disk.
"""

from __future__ import annotations

import math
import platform
from typing import Any, Callable

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit
from numba.extending import intrinsic

from llamapy.types import GGMLType


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
# Multi-threaded (prange) drivers of the REPACKED kernels.
PAR_REPACKED: dict[GGMLType, Callable[..., Any]] = {}
DEQUANT: dict[GGMLType, Callable[..., Any]] = {}
DEQUANT_REPACKED: dict[GGMLType, Callable[..., Any]] = {}
DEQUANT_TILES: dict[GGMLType, Callable[..., Any]] = {}


_jit = njit(cache=True, fastmath=_FM, nogil=True, boundscheck=False)


@_jit
def _f16(w: np.ndarray, o: int, tab: np.ndarray) -> np.float32:
    return tab[np.int64(w[o]) | (np.int64(w[o + 1]) << 8)]


def _hw_f16() -> bool:
    """Whether numba's target CPU converts f16 -> f32 in hardware (x86 F16C). Elsewhere LLVM
    would lower the conversion to a runtime routine that numba's JIT does not link (a crash,
    not an error), so `_h2f` is then done with integer and float32 operations."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from numba.core import config
        import llvmlite.binding as llb

        if config.CPU_FEATURES is not None:  # NUMBA_CPU_FEATURES
            return "+f16c" in config.CPU_FEATURES.split(",")
        if config.CPU_NAME is not None:  # NUMBA_CPU_NAME without features: no guessing
            return False
        return bool(llb.get_host_cpu_features().get("f16c", False))
    except Exception:  # pragma: no cover - an llvmlite without the query
        return False


@intrinsic
def _h2f_hw(typingctx, h):
    """f16 bits -> float32 with LLVM's fpext (vcvtph2ps); for `_hw_f16()` targets only."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())

    return numba.types.float32(numba.types.uint16), codegen


@njit(cache=True, nogil=True, boundscheck=False)
def _h2f_bits(h) -> np.float32:
    """f16 bits -> float32 from integer and float32 operations, bit for bit numpy's
    conversion; branch-free once inlined (loops over it vectorize): exponent and mantissa
    moved into a float32 and scaled by 2^112 (normals and subnormals, exact), inf/nan kept
    with their payload, then the sign."""
    em = np.uint32(h) & np.uint32(0x7FFF)
    e13 = np.uint32(em << np.uint32(13))
    if em >= np.uint32(0x7C00):
        mag = np.uint32(e13 | np.uint32(0x7F800000))
    else:
        mag = np.float32(e13.view(np.float32) * np.float32(2.0**112)).view(np.uint32)
    return np.uint32(mag | np.uint32((np.uint32(h) & np.uint32(0x8000)) << np.uint32(16))).view(np.float32)


# f16 bits (the repacked tiles' scales; numba has no float16 arrays on the CPU) -> float32,
# exact. The hardware conversion turns a signalling nan into a quiet one, where numpy keeps
# it: no dequantized value differs, as each is an arithmetic result of its scales (which quiets
# a nan the same way).
# On Q4_1 1536x576 (one thread, Zen 3) the bit version costs ~10% of the matvec's speed.
_h2f = _h2f_hw if _hw_f16() else _h2f_bits


def repacked_args(rp: tuple) -> tuple:
    """The tuple the repacked kernels below take for a repacked matrix's arrays `rp`
    (qmatmul `_REPACK`): the same arrays, the float16 scales viewed as their uint16 bits."""
    return tuple(a.view(np.uint16) if a.dtype == np.float16 else a for a in rp)


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
# the R rows' bytes side by side, and the block scales as f16 rows of R; the innermost
# loop then runs over R independent rows (no reduction), which LLVM vectorizes cleanly.
# Each `_rp_<type>(p, x, xs, out, t0, t1)` computes out[:, t0*R:t1*R] from the tuple of
# arrays `p` (see `_REPACK` for their layout), the f16 scales (`dm`, always last) passed as
# their uint16 bits: `repacked_args(rp)`. The same `p` for every kernel on repacked tiles.
# ----------------------------------------------------------------------------------------


@_jit
def _rp_q4_0(p, x, xs, out, t0, t1):
    qs, dm = p  # qs (T, nb, 16, R) uint8; dm (T, nb, 1, R) uint16 (f16 bits of d)
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
                    acc[r] += _h2f(d[r]) * s[r]
            for r in range(R):
                out[t, tile * R + r] = acc[r]


@_jit
def _rp_q4_1(p, x, xs, out, t0, t1):
    qs, dm = p  # qs (T, nb, 16, R) uint8; dm (T, nb, 2, R) uint16 (f16 bits of d, m)
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
                    acc[r] += _h2f(d[r]) * s[r] + _h2f(m[r]) * xsb
            for r in range(R):
                out[t, tile * R + r] = acc[r]


@_jit
def _rp_q8_0(p, x, xs, out, t0, t1):
    qs, dm = p  # qs (T, nb, 32, R) int8; dm (T, nb, 1, R) uint16 (f16 bits of d)
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
                    acc[r] += _h2f(d[r]) * s[r]
            for r in range(R):
                out[t, tile * R + r] = acc[r]


@_jit
def _rp_q4_k(p, x, xs, out, t0, t1):
    # qs (T, nb, 128, R) uint8; sm (T, nb, 16, R) uint8 (8 scales, 8 mins, 6 bits each);
    # dm (T, nb, 2, R) uint16 (f16 bits of d, dmin).
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
                        acc[r] += _h2f(d[r]) * (np.float32(c0[r]) * s0[r] + np.float32(c1[r]) * s1[r])
                        acc[r] -= _h2f(dmin[r]) * (np.float32(m0[r]) * x0 + np.float32(m1[r]) * x1)
            for r in range(R):
                out[t, tile * R + r] = acc[r]


@_jit
def _rp_q6_k(p, x, xs, out, t0, t1):
    # ql (T, nb, 128, R) uint8; qh (T, nb, 64, R) uint8; sc (T, nb, 16, R) int8;
    # dm (T, nb, 1, R) uint16 (f16 bits of d).
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
                            acc[r] += _h2f(d[r]) * (np.float32(c1[r]) * s1[r] + np.float32(c2[r]) * s2[r]
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
# out[i0:i1]; `_dqr_<type>(p, ids, out, i0, i1)` does the same from the repacked tiles (`p`:
# `repacked_args(rp)`, the f16 scales as their bits).
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
            d = _h2f(dm[tile, b, 0, r])
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
            d = _h2f(dm[tile, b, 0, r])
            m = _h2f(dm[tile, b, 1, r])
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
            d = _h2f(dm[tile, b, 0, r])
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
            d = _h2f(dm[tile, b, 0, r])
            dmin = _h2f(dm[tile, b, 1, r])
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
            d = _h2f(dm[tile, b, 0, r])
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
                    out_t[b * 32 + j, c0_ + r] = _h2f(d[r]) * np.float32(np.int32((v & 15) - 8))
                    out_t[b * 32 + 16 + j, c0_ + r] = _h2f(d[r]) * np.float32(np.int32((v >> 4) - 8))


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
                    lo[r] = _h2f(d[r]) * np.float32(np.int32(v & 15)) + _h2f(m[r])
                    hi[r] = _h2f(d[r]) * np.float32(np.int32(v >> 4)) + _h2f(m[r])
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
                    v[r] = np.float32(np.int32(q[r])) * _h2f(d[r])
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
                        dl[h, r] = _h2f(d[r]) * np.float32(np.int32(c[r]))
                        ml[h, r] = _h2f(dmin[r]) * np.float32(np.int32(mn[r]))
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
                            dl[k, r] = _h2f(d[r]) * np.float32(np.int32(c[r]))
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


# --------------------------------------------------------------------------------------------
# Per-token ops (the C versions are in kernels_c/ops.c; numpy references in kernels.py).
# --------------------------------------------------------------------------------------------


@njit(cache=True)
def _rms_norm(x: np.ndarray, eps: float) -> np.ndarray:  # x (rows, n) f32
    rows, n = x.shape
    out = np.empty_like(x)
    for r in range(rows):
        s = 0.0  # float64, as ggml's ggml_float
        for i in range(n):
            v = np.float64(x[r, i])
            s += v * v
        scale = np.float32(1.0 / math.sqrt(s / n + eps))
        for i in range(n):
            out[r, i] = x[r, i] * scale
    return out


@njit(cache=True)
def _rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, n_dims: int, neox: bool) -> np.ndarray:
    # x (T, H, D) f32; inv_freq (n_dims/2,) float64 already divided by freq factors and
    # multiplied by freq_scale
    T, H, D = x.shape
    half = n_dims // 2
    out = x.copy()
    for t in range(T):
        p = np.float64(pos[t])
        for i in range(half):
            theta = p * inv_freq[i]
            c = np.float32(math.cos(theta))
            s = np.float32(math.sin(theta))
            i0 = i + half if neox else 2 * i + 1
            j0 = i if neox else 2 * i
            for h in range(H):
                a = x[t, h, j0]
                b = x[t, h, i0]
                out[t, h, j0] = a * c - b * s
                out[t, h, i0] = a * s + b * c
    return out

# reassoc/contract let LLVM vectorize the dot products and sums; no nnan/ninf: the masked
# (-inf) cells are tested explicitly


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    # q (T, H, D), k/v (N, Hkv, D) f32, mask (T, N) f32 -> (T, H, Dv). Each K row is read
    # once for the g query heads that share it (GQA), then each head's softmax weights V.
    T, H, D = q.shape
    N, Hkv, _ = k.shape
    Dv = v.shape[2]
    g = H // Hkv
    out = np.zeros((T, H, Dv), np.float32)
    sc = np.empty((g, N), np.float32)
    m = np.empty(g, np.float32)
    acc = np.empty(Dv, np.float32)
    for t in range(T):
        for kh in range(Hkv):
            m[:] = -np.inf
            for n in range(N):
                mv = mask[t, n]
                if mv == -np.inf:
                    sc[:, n] = -np.inf
                    continue
                for j in range(g):
                    h = kh * g + j
                    d = np.float32(0.0)
                    for i in range(D):
                        d += q[t, h, i] * k[n, kh, i]
                    d = d * scale + mv
                    sc[j, n] = d
                    if d > m[j]:
                        m[j] = d
            for j in range(g):
                if m[j] == -np.inf:
                    continue
                total = np.float32(0.0)
                acc[:] = 0.0
                for n in range(N):
                    s = sc[j, n]
                    if s == -np.inf:
                        continue
                    w = np.float32(math.exp(s - m[j]))
                    total += w
                    for i in range(Dv):
                        acc[i] += w * v[n, kh, i]
                for i in range(Dv):
                    out[t, kh * g + j, i] = acc[i] / total
    return out


@njit(cache=True, fastmath={"contract"})
def _swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:  # (rows, n) f32, any strides
    rows, n = gate.shape
    out = np.empty((rows, n), np.float32)
    for r in range(rows):
        for i in range(n):
            g = gate[r, i]
            out[r, i] = g / (np.float32(1.0) + np.float32(math.exp(-max(g, np.float32(-88.0))))) * up[r, i]
    return out
