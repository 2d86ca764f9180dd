"""Reference op implementations, one function per Op, written against an array module `xp`
(numpy here, CuPy on CUDA) — the role of ggml-cpu's `ggml_compute_forward_*`.

Every kernel takes the node and its sources' native values and returns the node's value. A
quantized weight arrives as a `WeightMatrix` (interface.py; QMatrix on the host); everything
else is an array. Activations are float32 throughout.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..quants import KV_QUANT_TYPES, dequantize, quantize, rotate, round_trip_q8_0
from ..tensor import Op, Tensor
from .qmatmul import QMatrix
from ..types import GGMLType, storage
from .threads import blas_threads

Kernel = Callable[[Tensor, list[Any], Any], Any]


def _as_f32(xp: Any, a: Any) -> Any:
    return a if a.dtype == xp.float32 else a.astype(xp.float32)


def get_rows(node: Tensor, s: list[Any], xp: Any) -> Any:
    table, ids = s
    if not isinstance(table, xp.ndarray):  # a WeightMatrix (interface.py)
        return table.get_rows(ids)
    if ids.ndim == 2:  # (B, R, C), (B, n) -> (B, n, C): batch b's rows from table[b]
        return _as_f32(xp, xp.take_along_axis(table, ids.astype(xp.int64)[:, :, None], axis=1))
    return _as_f32(xp, table[ids.astype(xp.int64)])


def set_rows(node: Tensor, s: list[Any], xp: Any) -> Any:
    dst, ids, src = s
    rows = src.reshape(src.shape[0], -1)
    if node.type in KV_QUANT_TYPES:  # a Q8_0/Q4_0 cache: rows quantized as ggml's from_float does
        host = _host(xp, rows)
        rot = node.src[0].params.get("rot", 0)  # llama.cpp's attn_rot: stored rotated (KVCache)
        rows = xp.asarray(quantize(rotate(host, rot) if rot else host, node.type))
    dst[ids.astype(xp.int64, copy=False)] = rows.astype(dst.dtype, copy=False)
    return dst


def _host(xp: Any, a: Any) -> np.ndarray:
    return a if xp is np else xp.asnumpy(a)


def rms_norm(node: Tensor, s: list[Any], xp: Any) -> Any:
    x = s[0]
    # as ggml's rms_norm_f32 rounds, bit for bit: squares in f32, summed in f64 in order (cumsum is
    # sequential; a pairwise sum differs in the last bits), the mean rounded to f32, then
    # 1 / sqrt(mean + eps) in f32
    ss = xp.cumsum((x * x).astype(xp.float64), axis=-1)[..., -1:]
    mean = (ss / x.shape[-1]).astype(xp.float32)
    return x * (xp.float32(1.0) / xp.sqrt(mean + xp.float32(node.params["eps"])))


def mul(node: Tensor, s: list[Any], xp: Any) -> Any:
    return s[0] * _as_f32(xp, s[1])


def add(node: Tensor, s: list[Any], xp: Any) -> Any:
    return s[0] + _as_f32(xp, s[1])


def add_id(node: Tensor, s: list[Any], xp: Any) -> Any:
    """a (T, U, M) + b[ids] (ggml_add_id): each (token, slot)'s row of b by its expert id."""
    a, b, ids = s
    flat = ids.reshape(-1).astype(xp.int64)  # (T*U,)
    # a 2-D weight is a WeightMatrix (interface.py): its rows by id, as GET_ROWS reads them
    rows = _as_f32(xp, b)[flat] if isinstance(b, xp.ndarray) else b.get_rows(flat)  # (T*U, M)
    return a + rows.reshape(a.shape)  # (T, U, M)


def div(node: Tensor, s: list[Any], xp: Any) -> Any:
    return s[0] / _as_f32(xp, s[1])


def clamp(node: Tensor, s: list[Any], xp: Any) -> Any:
    return xp.clip(s[0], xp.float32(node.params["min"]), xp.float32(node.params["max"]))


def sum_rows(node: Tensor, s: list[Any], xp: Any) -> Any:
    # as ggml_vec_sum_f32: each row summed in order in f64, then rounded to f32
    return xp.cumsum(s[0].astype(xp.float64), axis=-1)[..., -1:].astype(xp.float32)


def argsort(node: Tensor, s: list[Any], xp: Any) -> Any:
    # descending; equal values keep their index order (a stable sort of the negated values)
    return xp.argsort(-s[0], axis=-1, kind="stable").astype(xp.int32)


def scale(node: Tensor, s: list[Any], xp: Any) -> Any:
    return s[0] * xp.float32(node.params["s"])


def glu(node: Tensor, s: list[Any], xp: Any) -> Any:
    gate, up = s
    op = "swiglu" if node is None else node.params.get("op", "swiglu")  # no node: swiglu (direct calls)
    if op == "geglu":
        return gelu(xp, gate) * up
    if op == "swiglu_oai":  # ggml's swiglu_oai, f32 throughout as ggml-cpu computes it
        lim, alpha = xp.float32(node.params["limit"]), xp.float32(node.params["alpha"])
        x = xp.minimum(gate, lim)
        y = xp.clip(up, -lim, lim)
        with np.errstate(over="ignore"):
            return (x / (xp.float32(1.0) + xp.exp(alpha * -x))) * (y + xp.float32(1.0))
    # silu(g) = g / (1 + exp(-g)) as ggml: below g ~ -88.7 exp overflows to inf and the result is -0
    with np.errstate(over="ignore"):
        return (gate / (1.0 + xp.exp(-gate))) * up


GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = 0.79788456080286535587989211986876


def _gelu_of_f16(xp: Any, h: Any) -> Any:
    """GELU of float32 values that are f16 values, rounded to f16: ggml-cpu's GELU table entries."""
    y = 0.5 * h * (1.0 + xp.tanh(xp.float32(SQRT_2_OVER_PI) * h * (1.0 + xp.float32(GELU_COEF_A) * h * h)))
    return y.astype(xp.float16).astype(xp.float32)


def gelu(xp: Any, x: Any) -> Any:
    """GELU, tanh approximation, as ggml-cpu computes it (GGML_GELU_FP16): the input rounded to
    f16 and the result read from an f16 table — so the value is rounded to f16 too — with
    x <= -10 giving 0 and x >= 10 giving x."""
    y = _gelu_of_f16(xp, x.astype(xp.float16).astype(xp.float32))
    return xp.where(x <= -10.0, xp.float32(0), xp.where(x >= 10.0, x, y)).astype(xp.float32)


def gelu_table() -> np.ndarray:
    """The table `gelu` reads, float32 (65536,): entry i is the value for the f16 of bits i (the
    CPU executor's GEGLU record, ops.c's lp_geglu; the same numpy arithmetic as `gelu`)."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return _gelu_of_f16(np, h)


def mul_mat(node: Tensor, s: list[Any], xp: Any) -> Any:
    w, x = s
    if not isinstance(w, xp.ndarray):  # a WeightMatrix (interface.py)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # (n, K)
        # the reference: float32 activations (the CPU backend's q8 mode is its own MUL_MAT)
        out = w.matmul(x2, q8=False) if isinstance(w, QMatrix) else w.matmul(x2)  # (n, M)
        return out.reshape(*lead, out.shape[-1])
    w = _as_f32(xp, w)
    x = _as_f32(xp, x)
    if w.ndim > 2 and x.ndim == w.ndim and x.shape[0] != w.shape[0]:
        # ggml broadcast: x's batch i uses w's batch i // (nx / nw)
        w = xp.repeat(w, x.shape[0] // w.shape[0], axis=0)
    return xp.matmul(x, xp.swapaxes(w, -1, -2))


def expert_rows(w: Any, e: int, m: int, xp: Any) -> Any:
    """Expert `e`'s (m, K) matrix of a stacked (n_expert * m, K) weight: a WeightMatrix's row
    range (no copy of the blocks) or an array's slice."""
    if isinstance(w, xp.ndarray):
        return _as_f32(xp, w.reshape(-1, w.shape[-1])[e * m : (e + 1) * m])
    return w.row_range(e * m, (e + 1) * m)


def expert_groups(ids: Any) -> list[tuple[int, Any, Any]]:
    """(expert, token indices, slot indices) for every expert some token chose, experts in
    increasing order and each expert's (token, slot) pairs in token order (ggml's
    matrix_row_counts / matrix_rows)."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)  # (T*U,) token-major
    U = ids.shape[1]
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = [*starts.tolist(), flat.size]
    return [(int(e), order[a:b] // U, order[a:b] % U) for e, a, b in zip(experts, bounds, bounds[1:])]


def mul_mat_id(node: Tensor, s: list[Any], xp: Any) -> Any:
    """MUL_MAT_ID: each expert's matrix multiplies, once, the rows of every token that chose it."""
    w, x, ids = s
    T, U, M = node.shape
    out = xp.zeros((T, U, M), xp.float32)
    host_ids = ids if xp is np else xp.asnumpy(ids)
    if host_ids.size and (host_ids.min() < 0 or host_ids.max() >= node.src[0].shape[0]):
        raise IndexError(f"{node.name}: expert id out of range 0..{node.src[0].shape[0] - 1}")
    shared = x.shape[1] == 1  # one input row for all of a token's slots
    for e, tok, slot in expert_groups(host_ids):
        if xp is not np:  # the index arrays on the device (CuPy)
            tok, slot = xp.asarray(tok), xp.asarray(slot)
        xs = x[tok, 0] if shared else x[tok, slot]  # (n, K)
        we = expert_rows(w, e, M, xp)
        if isinstance(we, xp.ndarray):
            y = xp.matmul(_as_f32(xp, xs), we.T)
        else:  # the reference: float32 activations (the CPU backend's q8 mode is its own)
            y = we.matmul(xp.ascontiguousarray(xs), q8=False) if isinstance(we, QMatrix) else we.matmul(xs)
        out[tok, slot] = y
    return out


def soft_max(node: Tensor, s: list[Any], xp: Any) -> Any:
    a = s[0] * xp.float32(node.params["scale"])
    if len(s) > 1:
        a = a + _as_f32(xp, s[1])
    a = a - a.max(axis=-1, keepdims=True)
    e = xp.exp(a)
    return e / e.sum(axis=-1, keepdims=True)


_rope_tables: dict[tuple, tuple] = {}


def rope_cos_sin(
    xp: Any, pos: Any, n_dims: int, base: float, freq_scale: float, factors: Any | None, yarn: tuple = ()
) -> tuple[Any, Any]:
    """cos/sin tables (n_tokens, n_dims/2) for llama.cpp's rope (ggml rope_cache_init).

    Every layer's Q and K rope the same positions: the tables are kept while the same position
    array is alive (the key holds a reference, so an id cannot be reused meanwhile)."""
    key = (id(pos), id(factors), n_dims, base, freq_scale, yarn)
    hit = _rope_tables.get(key)
    if hit is not None and hit[0] is pos and hit[1]() is factors:
        return hit[2], hit[3]
    if len(_rope_tables) > 8:
        _rope_tables.clear()
    cos, sin = _rope_tables_compute(xp, pos, n_dims, base, freq_scale, factors, yarn)
    # rope_freqs is a weight (a view of the model's mapping): held weakly, so that a closed
    # model's file is not kept mapped by this table
    try:
        fref: Any = (lambda: None) if factors is None else weakref.ref(factors)
    except TypeError:  # an array type without weak references: no caching
        return cos, sin
    _rope_tables[key] = (pos, fref, cos, sin)
    return cos, sin


def rope_consts(n_dims: int, base: float, freq_scale: float, factors: Any | None, yarn: tuple = ()) -> np.ndarray:
    """(6 + n_dims/2,) float32: freq_base, freq_scale, each pair's rope_freqs divisor (1 without
    them), then YaRN's ext_factor, attn_factor and correction dims (0, 1, 0, 0 without YaRN), as
    ggml keeps them (float op parameters): the C kernels (ops.c lp_rope_rows) take these and
    round the angles as ggml does."""
    ff = np.ones(n_dims // 2, np.float32) if factors is None else np.asarray(factors, np.float32)[: n_dims // 2]
    y = [0.0, 1.0, 0.0, 0.0]
    if yarn:
        n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow = yarn
        y = [ext_factor, attn_factor, *yarn_corr_dims(n_dims, int(n_ctx_orig), base, beta_fast, beta_slow)]
    return np.ascontiguousarray(np.concatenate([np.array([base, freq_scale], np.float32), ff, np.array(y, np.float32)]))


def yarn_mscale(freq_scale: float, ext_factor: float, attn_factor: float) -> np.float32:
    """The factor of YaRN's cos/sin (ggml's rope_yarn): attn_factor, times 1 + 0.1 ln(1 /
    freq_scale) when ext_factor is not 0 — one fma, as llama.cpp's build contracts it (the f32
    product is exact in f64: one rounding)."""
    mscale = np.float32(attn_factor)
    if ext_factor != 0.0:
        log = np.float32(np.log(np.float32(1) / np.float32(freq_scale)))
        mscale = mscale * np.float32(float(np.float32(0.1)) * float(log) + 1.0)
    return np.float32(mscale)


def yarn_table(n_dims: int, base: float, freq_scale: float, yarn: tuple) -> np.ndarray:
    """(5,) float32 for rope.cu: rope_consts' YaRN tail (ext_factor, attn_factor, the correction
    dims) and the cos/sin factor (yarn_mscale)."""
    n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow = yarn
    c0, c1 = yarn_corr_dims(n_dims, int(n_ctx_orig), base, beta_fast, beta_slow)
    return np.array([ext_factor, attn_factor, c0, c1, yarn_mscale(freq_scale, ext_factor, attn_factor)], np.float32)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The pairs YaRN ramps between (ggml_rope_yarn_corr_dims): below the first it extrapolates
    (the trained frequency), above the second it interpolates (scaled by freq_scale); f32 as ggml."""
    f = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        num = f(n_dims) * f(np.log(f(f(n_ctx_orig) / (f(n_rot) * f(2) * f(np.pi)))))
        return f(num / (f(2) * f(np.log(f(base)))))

    lo, hi = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return float(max(f(0), lo)), float(min(f(n_dims - 1), hi))


def rope_theta_scale(base: float, n_dims: int) -> np.float32:
    """ggml's theta_scale = powf(base, -2.0f/n_dims), correctly rounded (as glibc's powf is)."""
    return np.float32(float(np.float32(base)) ** float(np.float32(-2.0) / np.float32(n_dims)))


def _rope_tables_compute(
    xp: Any, pos: Any, n_dims: int, base: float, freq_scale: float, factors: Any | None, yarn: tuple = ()
) -> tuple[Any, Any]:
    # the angles as ggml's rope_cache_init rounds them (bit for bit; any other rounding flips q8
    # activation roundings downstream): theta_0 = p, theta_i+1 = theta_i * theta_scale in f32 —
    # a sequential product, not p * theta_scale^i — then / rope_freqs and * freq_scale in f32.
    # On the host: numpy's cumprod is sequential, CuPy's is a parallel scan that rounds the
    # products in another order (an ulp of a 4095-radian angle moves its cos by 5e-4)
    if xp is not np:
        cos, sin = _rope_tables_compute(np, _host(xp, pos), n_dims, base, freq_scale,
                                        None if factors is None else _host(xp, factors), yarn)
        return xp.asarray(cos), xp.asarray(sin)
    half = n_dims // 2
    steps = np.full((pos.shape[0], half), rope_theta_scale(base, n_dims), dtype=np.float32)  # (n_tokens, n_dims/2)
    steps[:, 0] = pos.astype(np.float32)
    theta = np.cumprod(steps, axis=1)
    if factors is not None:
        theta = theta / _as_f32(np, factors)[:half]
    extrap = theta
    theta = np.float32(freq_scale) * theta
    mscale = np.float32(1.0)
    if yarn:  # ggml's rope_yarn: pairs below the ramp keep the trained angle, cos/sin scaled
        n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow = yarn
        mscale = yarn_mscale(freq_scale, ext_factor, attn_factor)
        if ext_factor != 0.0:
            lo, hi = yarn_corr_dims(n_dims, int(n_ctx_orig), base, beta_fast, beta_slow)
            y = (np.arange(half, dtype=np.float32) - np.float32(lo)) / np.float32(max(0.001, hi - lo))
            mix = np.asarray((np.float32(1) - np.clip(y, 0, 1)) * np.float32(ext_factor))  # (n_dims/2,)
            # fma(theta, 1 - mix, extrap * mix), as llama.cpp's build contracts it: the f32
            # products are exact in f64, one rounding to f32
            theta = (theta.astype(np.float64) * (1 - mix) + (extrap * mix).astype(np.float64)).astype(np.float32)
    # cos/sin of the f32 angle rounded from f64: glibc's cosf/sinf (the C kernel) differ in the
    # last bit for ~1 angle in 4000
    th = theta.astype(np.float64)
    cos, sin = np.cos(th).astype(np.float32), np.sin(th).astype(np.float32)
    if mscale != 1.0:
        cos, sin = cos * np.float32(mscale), sin * np.float32(mscale)
    return cos, sin


def _rot(xp: Any, a: Any, b: Any, c: Any, s: Any, sign: float) -> Any:
    """a*c + sign*(b*s) rounded as ggml's rotate_pairs compiles (-march=native, fp-contract):
    fma(a, c, sign*(b*s)), the f32 product b*s rounded first (f64 holds a*c exactly)."""
    return (a.astype(xp.float64) * c + sign * (b * s).astype(xp.float64)).astype(xp.float32)


def rope(node: Tensor, s: list[Any], xp: Any) -> Any:
    x, pos = s[0], s[1]
    factors = s[2] if len(s) > 2 else None
    p = node.params
    n_dims = p["n_dims"]
    cos, sin = rope_cos_sin(xp, pos, n_dims, p["freq_base"], p["freq_scale"], factors, p.get("yarn", ()))
    cos = cos[:, None, :]  # (n_tokens, 1, n_dims/2): same angle for every head
    sin = sin[:, None, :]
    out = x.copy()
    if p["mode"] == 0:  # normal: pairs (x[2i], x[2i+1])
        x0 = x[..., 0:n_dims:2]
        x1 = x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = _rot(xp, x0, x1, cos, sin, -1.0)
        out[..., 1:n_dims:2] = _rot(xp, x0, x1, sin, cos, 1.0)
    else:  # neox: pairs (x[i], x[i + n_dims/2])
        h = n_dims // 2
        x0 = x[..., :h]
        x1 = x[..., h:n_dims]
        out[..., :h] = _rot(xp, x0, x1, cos, sin, -1.0)
        out[..., h:n_dims] = _rot(xp, x0, x1, sin, cos, 1.0)
    return out


def flash_attn_ext(node: Tensor, s: list[Any], xp: Any) -> Any:
    s = attended(s)
    rot_k, rot_v = cache_rotation(node)
    if not (rot_k or rot_v):
        return _flash_attn_ext(node, s, xp)
    # a rotated cache (llama.cpp's attn_rot): Q in K's rotated basis, the output rotated back
    q = xp.asarray(rotate(_host(xp, s[0]), rot_k)) if rot_k else s[0]
    out = _flash_attn_ext(node, [q, *s[1:]], xp)
    return xp.asarray(rotate(_host(xp, out), rot_v)) if rot_v else out


def attended(s: list[Any]) -> list[Any]:
    """FLASH_ATTN_EXT's values (q, k, v, mask) with K and V cut to the cells attended: the
    mask's width. The graph's K/V views span the whole cache; how many of its cells a
    micro-batch attends to is a property of its mask's value (ops.flash_attn_ext)."""
    q, k, v, mask = s[:4]
    return [q, k[: mask.shape[-1]], v[: mask.shape[-1]], mask, *s[4:]]


def cache_rotation(node: Tensor) -> tuple[int, int]:
    """The Hadamard orders (0: none) the K and V caches a FLASH_ATTN_EXT reads are stored in."""
    return node.src[1].root().params.get("rot", 0), node.src[2].root().params.get("rot", 0)


def _flash_attn_ext(node: Tensor, s: list[Any], xp: Any) -> Any:
    q, k, v, mask = s[:4]
    sinks = _as_f32(xp, s[4]) if len(s) > 4 else None
    kt, vt = node.src[1].type, node.src[2].type
    if kt in KV_QUANT_TYPES:
        # llama.cpp converts Q to K's vec_dot_type (Q8_0 for a Q8_0 or Q4_0 cache) and takes
        # integer dot products: the same as float products of the expanded blocks, up to the
        # order of the float sums
        q = xp.asarray(round_trip_q8_0(_host(xp, q)))
        k = _expand(k, kt, node.src[1].shape[-1], xp)
    if vt in KV_QUANT_TYPES:  # ggml expands each V row to f32 (v_to_float) before summing it
        v = _expand(v, vt, node.src[2].shape[-1], xp)
    n_tokens = q.shape[0]
    if n_tokens <= FA_BLOCK:
        return _attend(q, k, v, mask, node.params["scale"], xp, sinks)
    # a prompt: query blocks only read the key range their mask leaves visible (the causal
    # lower triangle, one sequence's cells), which roughly halves the work of a long prompt
    out = xp.empty((n_tokens, q.shape[1], v.shape[-1]), xp.float32)
    finite = mask > -xp.inf  # (T, N)
    for t0 in range(0, n_tokens, FA_BLOCK):
        t1 = min(n_tokens, t0 + FA_BLOCK)
        cols = xp.flatnonzero(finite[t0:t1].any(axis=0))
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, 1)
        out[t0:t1] = _attend(q[t0:t1], k[lo:hi], v[lo:hi], mask[t0:t1, lo:hi], node.params["scale"], xp, sinks)
    return out


FA_BLOCK = 128  # query rows per block of a prompt's attention


def _expand(raw: Any, t: GGMLType, d: int, xp: Any) -> Any:
    """A quantized cache view, (N, Hkv, row_bytes_per_head) uint8 -> (N, Hkv, d) float32."""
    flat = _host(xp, raw).reshape(-1, raw.shape[-1])  # (N*Hkv, bytes)
    return xp.asarray(dequantize(flat, t, d).reshape(*raw.shape[:2], d))


def _attend(q: Any, k: Any, v: Any, mask: Any, scale: float, xp: Any, sinks: Any = None) -> Any:
    """softmax(q k^T * scale + mask) v for one block of queries; query head h reads kv head
    h // (n_head / n_head_kv), llama.cpp's GQA grouping. The readable form: the C kernel (ops.c)
    follows llama.cpp's tiled arithmetic bit for bit (fma-chain scores, an online softmax per 64
    visible cells with ggml's SIMD exp), which this does not emulate (whole-row BLAS products and
    np.exp: equal within ~1e-6); tests/unit/test_attend_tiled.py holds the bit-exact emulation."""
    n_tokens, n_head, hd = q.shape
    n_kv, n_head_kv, _ = k.shape
    g = n_head // n_head_kv
    # an f16 cache: Q stays f32 and K is widened, as llama.cpp's tiled flash attention does (its
    # path for fewer than 64 query rows would round Q to f16: llamapy keeps one arithmetic for
    # every row count, so that a query's result does not depend on its batch)
    qh = q.transpose(1, 0, 2).reshape(n_head_kv, g * n_tokens, hd)  # (Hkv, G*T, D)
    k = _as_f32(xp, k)
    v = _as_f32(xp, v)
    m = _as_f32(xp, mask)
    out = xp.empty((n_head_kv, g * n_tokens, v.shape[-1]), xp.float32)
    if xp is np:
        with blas_threads(1):  # small products: a second BLAS thread only waits (threads.py)
            _attend_heads(qh, k, v, m, scale, out, g, xp, sinks)
    else:
        _attend_heads(qh, k, v, m, scale, out, g, xp, sinks)
    return out.reshape(n_head, n_tokens, -1).transpose(1, 0, 2)  # (T, H, Dv)


def _attend_heads(qh: Any, k: Any, v: Any, m: Any, scale: float, out: Any, g: int, xp: Any, sinks: Any) -> None:
    n_head_kv = k.shape[1]
    n_tokens, n_kv = m.shape
    # one 2-D product per KV head: the query heads of a group share it without a broadcast copy
    for h in range(n_head_kv):
        kq = qh[h] @ k[:, h, :].T  # (G*T, Nkv)
        kq = kq.reshape(g, n_tokens, n_kv)  # (G, T, Nkv)
        kq *= xp.float32(scale)
        kq += m
        top = kq.max(axis=-1, keepdims=True)  # (G, T, 1)
        if sinks is not None:  # head h*G+j's sink joins its rows' denominators (and their max)
            sk = sinks[h * g : (h + 1) * g].reshape(g, 1, 1)  # (G, 1, 1)
            top = xp.maximum(top, sk)
        kq -= top
        xp.exp(kq, out=kq)
        total = kq.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total += xp.exp(sk - top)
        kq /= total
        out[h] = kq.reshape(g * n_tokens, n_kv) @ v[:, h, :]  # (G*T, Dv)


def reshape(node: Tensor, s: list[Any], xp: Any) -> Any:
    return s[0].reshape(node.shape)


def view(node: Tensor, s: list[Any], xp: Any) -> Any:
    if "cols" in node.params:
        c0, c1 = node.params["cols"]
        return s[0][..., c0:c1]
    off = node.params["offset"]
    n = node.n_elements
    if node.type in KV_QUANT_TYPES:
        # the value holds whole rows of blocks (types.storage): a window of whole rows, its last
        # dimension split into whole blocks (a head of a multiple of 32 elements)
        width = node.src[0].shape[-1]
        r0, nr = off // width, n // width
        shape, _ = storage(node.type, node.shape)
        return s[0].reshape(-1, s[0].shape[-1])[r0 : r0 + nr].reshape(shape)
    return s[0].reshape(-1)[off : off + n].reshape(node.shape)


def permute(node: Tensor, s: list[Any], xp: Any) -> Any:
    return s[0].transpose(node.params["axes"])


def cont(node: Tensor, s: list[Any], xp: Any) -> Any:
    return xp.ascontiguousarray(s[0])


KERNELS: dict[Op, Kernel] = {
    Op.GET_ROWS: get_rows,
    Op.SET_ROWS: set_rows,
    Op.RMS_NORM: rms_norm,
    Op.MUL: mul,
    Op.ADD: add,
    Op.ADD_ID: add_id,
    Op.DIV: div,
    Op.SCALE: scale,
    Op.CLAMP: clamp,
    Op.SUM_ROWS: sum_rows,
    Op.ARGSORT: argsort,
    Op.MUL_MAT_ID: mul_mat_id,
    Op.GLU: glu,
    Op.MUL_MAT: mul_mat,
    Op.SOFT_MAX: soft_max,
    Op.ROPE: rope,
    Op.FLASH_ATTN_EXT: flash_attn_ext,
    Op.RESHAPE: reshape,
    Op.VIEW: view,
    Op.PERMUTE: permute,
    Op.CONT: cont,
}


def leaf_storage(t: Tensor) -> Any:
    """The value of a tensor that no node computed: it must live in a buffer (a weight, the KV
    cache) — inputs are in the environment."""
    if t.buffer is None:
        raise RuntimeError(f"tensor {t.name!r} has no value: not set as input and not in a buffer")
    return t.buffer.storage(t)


def run_nodes(
    nodes: Any,
    env: dict[Tensor, Any],
    xp: Any,
    storage: Callable[[Tensor], Any] = leaf_storage,
    table: dict[Op, Kernel] = KERNELS,
) -> None:
    """Evaluate nodes in order with a kernel table; shared by the CPU, TEST and CUDA backends.
    A split's node list says which values die after each node (sched/split.py `NodeList`):
    they are dropped from `env` as soon as they are dead."""
    release = getattr(nodes, "release", None) or [()] * len(nodes)
    get, pop = env.get, env.pop  # a decode step runs ~800 nodes: keep the loop lean
    for node, dead in zip(nodes, release):
        srcs = [v if (v := get(src)) is not None else storage(src) for src in node.src]
        env[node] = table[node.op](node, srcs, xp)
        for t in dead:
            pop(t, None)


def reference(node: Tensor, srcs: list[np.ndarray]) -> np.ndarray:
    """The one numpy reference every backend's op tests compare against."""
    return KERNELS[node.op](node, srcs, np)
