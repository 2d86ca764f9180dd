"""Compiled CPU kernels for the small per-token ops (ggml-cpu's ops.cpp: rms_norm, rope,
flash_attn_ext), JIT-compiled with numba and cached on disk.

During decode every op works on a few hundred floats, so numpy's per-call overhead (a dozen
array temporaries for one attention head) costs more than the arithmetic; one compiled loop per
op removes it. The numpy kernels in kernels.py stay the reference these are tested against, and
the fallback when numba is missing (LLAMAPY_NO_NUMBA=1). Prompts keep the BLAS attention path:
for a block of 128 queries sgemm beats a scalar loop.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ..tensor import Op, Tensor
from .kernels import KERNELS, Kernel

ATTN_MAX_TOKENS = 8  # up to this many queries, attention runs in the compiled loop

try:
    if os.environ.get("LLAMAPY_NO_NUMBA", "0") not in ("", "0"):
        raise ImportError("disabled by LLAMAPY_NO_NUMBA")
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised with LLAMAPY_NO_NUMBA=1
    HAVE_NUMBA = False


if HAVE_NUMBA:

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


if HAVE_NUMBA:

    @njit(cache=True, fastmath={"contract"})
    def _swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:  # (rows, n) f32, any strides
        rows, n = gate.shape
        out = np.empty((rows, n), np.float32)
        for r in range(rows):
            for i in range(n):
                g = gate[r, i]
                out[r, i] = g / (np.float32(1.0) + np.float32(math.exp(-max(g, np.float32(-88.0))))) * up[r, i]
        return out


def glu(node: Tensor, s: list[Any], xp: Any) -> Any:
    gate, up = s
    if gate.ndim != 2:
        return KERNELS[Op.GLU](node, s, xp)
    return _swiglu(gate, up)


_inv_freq: dict[tuple, np.ndarray] = {}


def _rope_inv_freq(n_dims: int, base: float, scale: float) -> np.ndarray:
    key = (n_dims, base, scale)
    inv = _inv_freq.get(key)
    if inv is None:
        inv = _inv_freq[key] = base ** (-2.0 * np.arange(n_dims // 2) / n_dims) * scale
    return inv


def rms_norm(node: Tensor, s: list[Any], xp: Any) -> Any:
    x = s[0]
    flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)  # (rows, n)
    return _rms_norm(flat, float(node.params["eps"])).reshape(x.shape)


def rope(node: Tensor, s: list[Any], xp: Any) -> Any:
    x, pos = s[0], s[1]
    p = node.params
    n_dims = p["n_dims"]
    inv = _rope_inv_freq(n_dims, p["freq_base"], p["freq_scale"])
    if len(s) > 2:
        inv = inv / s[2].astype(np.float64)
    return _rope(np.ascontiguousarray(x, dtype=np.float32), pos, inv, n_dims, p["mode"] == 2)


def flash_attn_ext(node: Tensor, s: list[Any], xp: Any) -> Any:
    q, k, v, mask = s
    if q.shape[0] > ATTN_MAX_TOKENS:
        return KERNELS[Op.FLASH_ATTN_EXT](node, s, xp)
    if k.dtype == np.float16:
        # numba computes in f32: widen the cache view, and round Q as llama.cpp's f16 path does
        q = q.astype(np.float16)
        k, v = k.astype(np.float32), v.astype(np.float32)
    q = np.ascontiguousarray(q, dtype=np.float32)
    return _attend(q, k, v, mask.astype(np.float32, copy=False), float(node.params["scale"]))


CPU_KERNELS: dict[Op, Kernel] = (
    {**KERNELS, Op.RMS_NORM: rms_norm, Op.ROPE: rope, Op.FLASH_ATTN_EXT: flash_attn_ext, Op.GLU: glu}
    if HAVE_NUMBA
    else KERNELS
)
