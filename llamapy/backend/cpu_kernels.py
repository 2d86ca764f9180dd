"""Compiled CPU kernels for the small per-token ops (ggml-cpu's ops.cpp: rms_norm, rope,
flash_attn_ext, swiglu, soft_max, argsort): the C ones (kernels_c/ops.c), when the install built them.

During decode every op works on a few hundred floats, so numpy's per-call overhead (a dozen
array temporaries for one attention head) costs more than the arithmetic; one compiled loop per
op removes it. The numpy kernels in kernels.py stay the reference these are tested against, and
the fallback without compiled kernels (LLAMAPY_KERNELS=numpy).

Attention runs in C for any number of query tokens with the arithmetic of llama.cpp's tiled flash
attention (its path for >= 64 query rows over an f32/f16 cache: the same bits there), threaded
over (KV head, block of queries) units, or, when the units are few (decode), over a query's
tiles of cells for the scores and over columns for the V sums; each query's output does not
depend on the rest of the batch, on the cells attended beyond what it sees, or on the thread
count (ops.c). The thread count is an argument: the table
entry runs on one thread, the CPU backend passes its own -t (`c_flash_attn_ext(..., n_threads)`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..quants import KV_QUANT_TYPES, rotate
from ..tensor import Op, Tensor
from ..types import GGMLType
from . import native
from .kernels import KERNELS, Kernel, attended, cache_rotation, rope_consts
from .qmatmul import kernels

_ptr = native.ptr


# A decode step runs ~270 of these small kernels, so their Python side is kept short: a node's
# constant arguments (eps, rope frequencies, scale) are worked out on its first run and kept on
# the node itself, so they live as long as its graph (a process-global table keyed by nodes
# would keep every graph, and through its weights the model's mappings, alive after close()).
_CONSTS_ATTR = "_lp_consts"


def _node_consts(node: Tensor, make: Any) -> tuple:
    c = node.__dict__.get(_CONSTS_ATTR)
    if c is None:
        c = make()
        setattr(node, _CONSTS_ATTR, c)
    return c


# --- C (kernels_c/ops.c) ---------------------------------------------------------------------


def _c_rms_norm(node: Tensor, s: list[Any], xp: Any) -> Any:
    x = s[0]
    flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)  # (rows, n)
    out = np.empty_like(flat)
    rows, n = flat.shape
    (eps,) = _node_consts(node, lambda: (float(node.params["eps"]),))
    _lib.lp_rms_norm(_ptr(flat), rows, n, n, eps, _ptr(out))
    return out.reshape(x.shape)


def _rope_consts(node: Tensor, s: list[Any]) -> tuple[np.ndarray, int, int]:
    """A ROPE node's (rope_consts, n_dims, neox), worked out on its first run."""

    def make() -> tuple[np.ndarray, int, int]:
        p = node.params
        factors = s[2] if len(s) > 2 else None  # rope_freqs: a weight, fixed for the node
        rc = rope_consts(p["n_dims"], p["freq_base"], p["freq_scale"], factors, p.get("yarn", ()))
        return rc, p["n_dims"], int(p["mode"] == 2)

    return _node_consts(node, make)


def _c_rope(node: Tensor, s: list[Any], xp: Any) -> Any:
    x = np.ascontiguousarray(s[0], dtype=np.float32)  # (T, H, D)
    pos = np.ascontiguousarray(s[1], dtype=np.int32)
    inv, n_dims, neox = _rope_consts(node, s)
    out = np.empty_like(x)
    T, H, D = x.shape
    _lib.lp_rope(_ptr(x), T, H, D, _ptr(pos), _ptr(inv), n_dims, neox, _ptr(out))
    return out


# lp_attend_q's cache type codes (ops.c LP_KV_*)
KV_CODES = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q8_0: 2, GGMLType.Q4_0: 3}


def c_flash_attn_ext(node: Tensor, s: list[Any], xp: Any, n_threads: int = 1) -> Any:
    """FLASH_ATTN_EXT in C (lp_attend / lp_attend_f16 / lp_attend_q) on up to n_threads threads."""
    s = attended(s)
    kt, vt = node.src[1].type, node.src[2].type
    if kt in KV_QUANT_TYPES or vt in KV_QUANT_TYPES or len(s) > 4:  # a quantized cache, or sinks
        return _c_attend_q(node, s, KV_CODES[kt], KV_CODES[vt], n_threads)
    q, k, v, mask = s
    q = np.ascontiguousarray(q, dtype=np.float32)  # (an f16 cache too: Q stays f32, as llama.cpp's tiled path)
    mask = mask.astype(np.float32, copy=False)
    # k, v: (N, Hkv, D) views of the cache (f32 or f16), read in place when their rows are contiguous
    if k.strides[2] != k.itemsize or k.dtype != v.dtype:
        k = np.ascontiguousarray(k, dtype=np.float32)
    if v.strides[2] != v.itemsize or v.dtype != k.dtype:
        v = np.ascontiguousarray(v, dtype=k.dtype)
    if mask.strides[1] != 4:
        mask = np.ascontiguousarray(mask)
    T, H, D = q.shape
    N, Hkv, Dv = v.shape
    out = np.empty((T, H, Dv), np.float32)
    ks, vs, isz = k.strides, v.strides, k.itemsize  # in elements for the kernel
    fn = _lib.lp_attend_f16 if isz == 2 else _lib.lp_attend
    (scale,) = _node_consts(node, lambda: (float(node.params["scale"]),))
    fn(_ptr(q), T, H, D, _ptr(k), _ptr(v), N, Hkv, Dv, ks[0] // isz, ks[1] // isz, vs[0] // isz, vs[1] // isz,
       _ptr(mask), mask.strides[0] // 4, scale, _ptr(out), n_threads)
    return out


def _c_attend_q(node: Tensor, s: list[Any], kt: int, vt: int, n_threads: int) -> Any:
    """A Q8_0/Q4_0 cache (either of K, V), or attention sinks: lp_attend_q reads its blocks in place."""
    q, k, v, mask = s[:4]
    sinks = np.ascontiguousarray(s[4], dtype=np.float32) if len(s) > 4 else None
    rot_k, rot_v = cache_rotation(node)  # llama.cpp's attn_rot (kernels.flash_attn_ext)
    q = rotate(q, rot_k) if rot_k else np.ascontiguousarray(q, dtype=np.float32)
    mask = np.ascontiguousarray(mask, dtype=np.float32)
    # k, v: (N, Hkv, D) f32/f16 elements or (N, Hkv, head_bytes) uint8 blocks; rows contiguous
    k = k if k.strides[2] == k.itemsize else np.ascontiguousarray(k)
    v = v if v.strides[2] == v.itemsize else np.ascontiguousarray(v)
    T, H, D = q.shape
    N, Hkv, _ = v.shape
    Dv = node.shape[-1]
    out = np.empty((T, H, Dv), np.float32)
    ki, vi = k.itemsize, v.itemsize  # strides in the type's storage unit: halves, floats or bytes
    (scale,) = _node_consts(node, lambda: (float(node.params["scale"]),))
    _lib.lp_attend_q(_ptr(q), T, H, D, _ptr(k), _ptr(v), N, Hkv, Dv, k.strides[0] // ki, k.strides[1] // ki,
                     v.strides[0] // vi, v.strides[1] // vi, _ptr(mask), mask.strides[0] // 4, scale, _ptr(out),
                     kt, vt, None if sinks is None else _ptr(sinks), n_threads)  # fmt: skip
    return rotate(out, rot_v) if rot_v else out


def _c_glu(node: Tensor, s: list[Any], xp: Any) -> Any:
    gate, up = s
    if gate.ndim > 2:  # (T, U, F): the experts' rows, as rows
        out = _c_glu(node, [gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])], xp)
        return out.reshape(gate.shape)
    op = node.params.get("op")
    if op not in ("swiglu", "swiglu_oai") or gate.ndim != 2 or gate.dtype != np.float32 or up.dtype != np.float32 \
            or gate.strides[1] != 4 or up.strides[1] != 4:
        return KERNELS[Op.GLU](node, s, xp)
    rows, n = gate.shape
    out = np.empty((rows, n), np.float32)
    if op == "swiglu_oai":
        _lib.lp_swiglu_oai(_ptr(gate), _ptr(up), rows, n, gate.strides[0] // 4, up.strides[0] // 4,
                           node.params["alpha"], node.params["limit"], _ptr(out))  # fmt: skip
    else:
        _lib.lp_swiglu(_ptr(gate), _ptr(up), rows, n, gate.strides[0] // 4, up.strides[0] // 4, _ptr(out))
    return out


def _rows_f32(x: np.ndarray) -> tuple[np.ndarray, int, int]:
    flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)  # (rows, n)
    return flat, flat.shape[0], flat.shape[1]


def _c_soft_max(node: Tensor, s: list[Any], xp: Any) -> Any:
    """ggml's soft_max rounding (ops.c lp_soft_max_rows); with a mask, the reference."""
    if len(s) > 1:
        return KERNELS[Op.SOFT_MAX](node, s, xp)
    flat, rows, n = _rows_f32(s[0])
    out = np.empty_like(flat)
    _lib.lp_soft_max_rows(_ptr(flat), rows, n, n, float(node.params["scale"]), _ptr(out))
    return out.reshape(s[0].shape)


def _c_argsort(node: Tensor, s: list[Any], xp: Any) -> Any:
    flat, rows, n = _rows_f32(s[0])
    out = np.empty((rows, n), np.int32)
    _lib.lp_argsort_rows(_ptr(flat), rows, n, n, _ptr(out))
    return out.reshape(s[0].shape)


_TABLES: dict[str, dict[Op, Kernel]] = {
    "c": {**KERNELS, Op.RMS_NORM: _c_rms_norm, Op.ROPE: _c_rope, Op.FLASH_ATTN_EXT: c_flash_attn_ext,
          Op.GLU: _c_glu, Op.SOFT_MAX: _c_soft_max, Op.ARGSORT: _c_argsort},
    "numpy": KERNELS,
}


_lib: Any = None  # native.lib(), once the C table is in use


def cpu_kernels() -> dict[Op, Kernel]:
    """The CPU backend's kernel table for the compiled kernels in use (qmatmul.kernels())."""
    global _lib
    impl = kernels()
    if impl == "c" and _lib is None:
        _lib = native.lib()
    return _TABLES[impl]
