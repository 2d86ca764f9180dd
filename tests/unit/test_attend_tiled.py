"""ops.c's attention (lp_attend / lp_attend_f16) against a float32 emulation of llama.cpp's tiled
flash attention (ggml-cpu ops.cpp flash_attn_ext_tiled, the path of >= 64 query rows over an f32 or
f16 cache), bit for bit, on random data: Q in f32, the K rows widened to f32, each score one fma
chain over d (simd_gemm's order) times scale plus the mask, per tile of 64 cells the tile's max, a
rescale of the running sums by libm's expf on a rise, the weights by ggml's SIMD exp (vec.h
ggml_v_expf) summed as ggml_vec_soft_max_f32 (a tree sum per SIMD vector, those added in double),
the V sums one fma chain per element over the cells in order, then times 1/S.

The tiles are 64 *visible* cells of the row, in order (llama.cpp: 64 cell indices; the same where a
sequence's cells are contiguous from a multiple of 64, as llama-perplexity lays them out), and
llamapy uses this arithmetic for every row count (llama.cpp switches below 64 rows). The emulation
follows the SIMD variant of each kernel build (AVX-512: 16-lane sums and the scalef exp; AVX2: 8
lanes and its exp); the portable build has no fma instruction and is compared within a tolerance.
fma is emulated exactly: the product in float64 is exact, the float64 sum's error is recovered by
TwoSum and decides the one case where rounding the float64 sum to float32 would differ (a tie).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest

try:
    from .test_native_ops import c_attend, lib  # noqa: F401 - the fixture
except ImportError:
    from test_native_ops import c_attend, lib  # type: ignore[no-redef] # noqa: F401

F32, F64 = np.float32, np.float64


def H(x: str) -> np.float32:  # noqa: N802 - a C hex float literal
    return F32(float.fromhex(x))


_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_libm.expf.argtypes, _libm.expf.restype = [ctypes.c_float], ctypes.c_float


def fma32(a, b, c):  # noqa: ANN001, ANN201 - float32 arrays (broadcast)
    """a*b + c rounded once to float32, as fmaf (finite inputs)."""
    a64, b64, c64 = np.asarray(a, F64), np.asarray(b, F64), np.asarray(c, F64)
    p = a64 * b64  # exact: 24 + 24 bits
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)  # s + e == p + c exactly
    r = s.astype(F32)
    r64 = r.astype(F64)
    other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf))).astype(F32)
    tie = (s != r64) & (s == (r64 + other.astype(F64)) / 2) & (e != 0)
    # at a tie the exact value lies on e's side of s
    pick_other = tie & (np.sign(e) == np.sign(other.astype(F64) - r64))
    return np.where(pick_other, other, r).astype(F32)


def v_expf(x: np.ndarray, variant: str) -> np.ndarray:
    """ggml_v_expf of float32 x (<= 0, -inf) on the variant's build."""
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        r = H("0x1.8p23")
        z = fma32(x, H("0x1.715476p+0"), r)
        n = (z - r).astype(F32)
        b = fma32(-n, H("0x1.7F7D1Cp-20"), fma32(-n, H("0x1.62E4p-1"), x))
        u = (b * b).astype(F32)
        p = fma32(fma32(H("0x1.0E4020p-7"), b, H("0x1.573E2Ep-5")), u, fma32(H("0x1.555E66p-3"), b, H("0x1.FFFDB6p-2")))
        an = np.abs(n)
        if variant == "avx512":
            j = fma32(p, u, fma32(H("0x1.FFFFECp-1"), b, F32(1.0)))
            ni = np.where(an <= 192, n, 0).astype(np.int64)
            res = np.ldexp(j.astype(F64), ni).astype(F32)  # j * 2^n, rounded once (scalef)
            return np.where(an > 192, np.where(n > 0, F32(np.inf), F32(0)), res).astype(F32)
        j = fma32(p, u, (H("0x1.FFFFECp-1") * b).astype(F32))
        zb = z.view(np.uint32)
        e = (zb << np.uint32(23)).astype(np.uint32)
        k = (e + np.uint32(0x3F800000)).view(F32)
        norm = fma32(k, j, k)
        gb = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
        s1 = (gb + np.uint32(0x7F000000)).astype(np.uint32).view(F32)
        s2 = (e - gb).astype(np.uint32).view(F32)
        big = (fma32(s2, j, s2) * s1).astype(F32)
        return np.where(an > 192, (s1 * s1).astype(F32), np.where(an > 126, big, norm)).astype(F32)


def vsum(w: np.ndarray, lanes: int) -> np.ndarray:
    """One SIMD vector's sum per row as ggml_vec_soft_max_f32 takes it (gcc's _mm512_reduce_add_ps
    for 16 lanes: halves added first; then ((t0+t4)+(t2+t6)) + ((t1+t5)+(t3+t7)))."""
    t = (w[:, 8:16] + w[:, :8]).astype(F32) if lanes == 16 else w
    return (((t[:, 4] + t[:, 0]) + (t[:, 6] + t[:, 2])) + ((t[:, 5] + t[:, 1]) + (t[:, 7] + t[:, 3]))).astype(F32)


def emulate_tiled(q, k, v, mask, scale, variant):  # noqa: ANN001, ANN201
    """out (T, H, Dv) of llama.cpp's tiled flash attention, tiles of 64 visible cells per row."""
    T, H, D = q.shape
    N, Hkv, _ = k.shape
    Dv, g, lanes = v.shape[2], H // Hkv, 16 if variant == "avx512" else 8
    kf, vf = k.astype(F32), v.astype(F32)
    vis = mask != -np.inf
    nvis = vis.sum(1)
    J = int((nvis.max() + 63) // 64)
    idx = np.full((T, J * 64), -1, np.int64)  # each row's visible cells in order, padded with -1
    for t in range(T):
        c = np.flatnonzero(vis[t])
        idx[t, : len(c)] = c
    rows = np.arange(T)[:, None]
    out = np.zeros((T, H, Dv), F32)
    for h in range(H):
        kh = h // g
        s = np.zeros((T, N), F32)
        for d in range(D):
            s = fma32(q[:, h, d : d + 1], kf[None, :, kh, d], s)
        s = (s * F32(scale)).astype(F32)
        s = np.where(vis, (s + mask).astype(F32), F32(-np.inf))
        M, S, acc = np.full(T, -np.inf, F32), np.zeros(T, F32), np.zeros((T, Dv), F32)
        for j in range(J):
            ids = idx[:, j * 64 : (j + 1) * 64]
            tile = np.where(ids >= 0, s[rows, np.maximum(ids, 0)], F32(-np.inf)).astype(F32)
            act = tile.max(1) > -np.inf
            mnew = np.where(act, np.maximum(M, tile.max(1)), M).astype(F32)
            for t in np.flatnonzero(act & (mnew > M)):
                ms = F32(_libm.expf(float(M[t] - mnew[t])))
                acc[t] = (acc[t] * ms).astype(F32)
                S[t] = F32(S[t] * ms)
            M = mnew
            with np.errstate(invalid="ignore"):
                w = np.where(act[:, None], v_expf((tile - M[:, None]).astype(F32), variant), F32(0))
            total = np.zeros(T, F64)
            for c in range(0, 64, lanes):
                total = total + vsum(w[:, c : c + lanes], lanes).astype(F64)
            S = np.where(act, (S.astype(F64) + total).astype(F32), S)
            vt = vf[np.maximum(ids, 0), kh, :]  # (T, 64, Dv)
            for i in range(64):  # weight 0 (padding, inactive rows): the sums unchanged
                acc = np.where((w[:, i : i + 1] != 0), fma32(w[:, i : i + 1], vt[:, i, :], acc), acc)
        inv = np.where(S == 0, F32(0), (F32(1) / np.where(S == 0, F32(1), S)).astype(F32))
        out[:, h] = np.where((M == -np.inf)[:, None], F32(0), (acc * inv[:, None]).astype(F32))
    return out


def _case(rng, T, N, Hkv, g, D, layout):  # noqa: ANN001, ANN201
    q = rng.standard_normal((T, Hkv * g, D)).astype(F32) * F32(2)
    k = rng.standard_normal((N, Hkv, D)).astype(F32)
    v = rng.standard_normal((N, Hkv, D)).astype(F32)
    cell, tok = np.arange(N)[None, :], np.arange(T)[:, None]
    if layout == "causal":  # the last T of N cells, each token up to itself
        mask = np.where(cell <= tok + (N - T), 0.0, -np.inf)
    elif layout == "interleaved":  # a decode step of 4 sequences that took cells in turn after a shared prefix
        n_seq, prefix = min(T, 4), 40
        mine = ((cell - prefix) % n_seq == tok % n_seq) & (cell <= tok + (N - T))
        mask = np.where((cell < prefix) | mine, 0.0, -np.inf)
    elif layout == "window":  # causal within a sliding window of 100 cells (gemma3's local layers)
        mask = np.where((cell <= tok + (N - T)) & (cell > tok + (N - T) - 100), 0.0, -np.inf)
    elif layout == "sequences":  # T tokens in 4 sequences of contiguous cells from multiples of 64
        per = -(-T // 4)
        start = (tok // per) * ((N // 4) // 64 * 64)
        mask = np.where((cell >= start) & (cell <= start + tok % per), 0.0, -np.inf)
    else:  # holes and finite biases
        mask = np.where(rng.random((T, N)) < 0.3, -np.inf, 0.0)
        mask[rng.random((T, N)) < 0.2] = -0.5
        mask[:, 0] = 0.0
        if T > 2:
            mask[1] = -np.inf  # a row that sees nothing: zeros
    return q, k, v, mask.astype(F32)


CASES = [  # T, N, Hkv, g, D, layout
    (1, 1, 1, 1, 64, "causal"),
    (1, 600, 3, 3, 64, "causal"),
    (7, 130, 2, 4, 128, "holes"),
    (64, 64, 3, 3, 64, "causal"),
    (96, 96, 1, 9, 64, "causal"),
    (129, 300, 2, 2, 128, "holes"),
    (200, 512, 3, 3, 64, "sequences"),
    (37, 450, 2, 3, 72, "causal"),  # a head dimension that is not a multiple of 8
    (4, 520, 3, 3, 64, "interleaved"),  # N - T - 40: a multiple of the 4 sequences
    (12, 292, 2, 3, 64, "interleaved"),
    (40, 300, 3, 3, 64, "window"),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("T,N,Hkv,g,D,layout", CASES)
def test_attend_equals_tiled_emulation(lib, T, N, Hkv, g, D, layout, dtype):  # noqa: ANN001
    rng = np.random.default_rng(T * 7919 + N * 31 + D)
    q, k, v, mask = _case(rng, T, N, Hkv, g, D, layout)
    k, v = k.astype(dtype), v.astype(dtype)
    scale = 1.0 / np.sqrt(D)
    want = emulate_tiled(q, k, v, mask, scale, _variant(lib))
    for nt in (1, 2):
        got = c_attend(lib, q, k, v, mask, scale, nt)
        if _variant(lib) == "portable":  # no fma instruction: not llama.cpp's bits
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        else:
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _variant(lib) -> str:  # noqa: ANN001
    name = getattr(lib, "_name", "")
    return next(v for v in ("avx512", "avx2", "portable") if f"lp_{v}" in name)


def test_fma32_emulation() -> None:
    """The exact fma emulation on known cases: a product that rounds differently fused, and the
    float64 sum landing on (the exact value just off) a float32 tie."""
    a, b = F32(1 + 2**-12), F32(1 + 2**-12)  # a*b = 1 + 2^-11 + 2^-24: rounds up only when fused
    assert fma32(a, b, F32(0)) == F32(a * b)
    one = F32(1)
    # 1 + 2^-24 + tiny: the float64 sum is the tie 1 + 2^-24, the exact value just above it
    x = fma32(F32(2**-24), F32(1 + 2**-23), one)
    assert x == np.nextafter(one, F32(2))
    y = fma32(F32(2**-24), F32(1 - 2**-24), one)  # just below the tie: 1
    assert y == one
