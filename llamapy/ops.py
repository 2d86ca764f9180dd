"""Op builders with shape inference (ggml.c's `ggml_mul_mat`, `ggml_rope_ext`, ... constructors).

Each function only creates a graph node; nothing is computed here. Shapes are numpy-ordered (see
tensor.py). Results are F32 unless the op writes into an existing tensor (SET_ROWS).
"""

from __future__ import annotations

import math

from .tensor import Op, Tensor
from .types import GGMLType

F32 = GGMLType.F32


def _node(name: str, kind: Op, shape: tuple[int, ...], *src: Tensor, **params: object) -> Tensor:
    return Tensor(name=name, shape=tuple(shape), op=kind, src=src, params=dict(params))


def get_rows(a: Tensor, ids: Tensor, name: str = "get_rows") -> Tensor:
    """Rows `ids` of `a`: (R, C), (n,) -> (n, C), dequantized to f32. With a batch of id rows,
    ggml's 3-D form: (B, R, C), (B, n) -> (B, n, C), batch b's rows from a[b] (the router's
    weights of the chosen experts)."""
    if len(ids.shape) == 2:
        if len(a.shape) != 3 or a.shape[0] != ids.shape[0]:
            raise ValueError(f"get_rows {name}: ids {ids.shape} do not batch over {a.shape}")
        return _node(name, Op.GET_ROWS, (*ids.shape, a.shape[-1]), a, ids)
    return _node(name, Op.GET_ROWS, (ids.shape[0], a.shape[-1]), a, ids)


def set_rows(dst: Tensor, ids: Tensor, src: Tensor, name: str = "set_rows") -> Tensor:
    """Write `src` (n, C) into rows `ids` of `dst` (R, C), in place; the result *is* `dst`."""
    if src.shape[-1] != dst.shape[-1] or src.shape[0] != ids.shape[0]:
        raise ValueError(f"set_rows: {src.shape} into {dst.shape} at {ids.shape}")
    t = _node(name, Op.SET_ROWS, dst.shape, dst, ids, src)
    t.type = dst.type
    t.view_src = dst
    return t


def rms_norm(x: Tensor, eps: float, name: str = "norm") -> Tensor:
    return _node(name, Op.RMS_NORM, x.shape, x, eps=eps)


def mul(a: Tensor, b: Tensor, name: str = "mul") -> Tensor:
    """Elementwise a * b, `b` broadcast over `a`'s leading dimensions (a norm weight, say)."""
    return _node(name, Op.MUL, a.shape, a, b)


def add(a: Tensor, b: Tensor, name: str = "add") -> Tensor:
    return _node(name, Op.ADD, a.shape, a, b)


def add_id(a: Tensor, b: Tensor, ids: Tensor, name: str = "add_id") -> Tensor:
    """ggml_add_id: a (T, U, M) + b (n_expert, M) row ids[t, u] for slot u of token t (each
    chosen expert's bias)."""
    if len(a.shape) != 3 or len(b.shape) != 2 or ids.shape != a.shape[:2] or b.shape[1] != a.shape[2]:
        raise ValueError(f"add_id {name}: a {a.shape}, b {b.shape}, ids {ids.shape} disagree")
    return _node(name, Op.ADD_ID, a.shape, a, b, ids)


def div(a: Tensor, b: Tensor, name: str = "div") -> Tensor:
    """Elementwise a / b, `b` broadcast over `a` (ggml_div: b's dimensions divide a's)."""
    if any(x % y for x, y in zip(a.shape[::-1], b.shape[::-1])) or len(b.shape) > len(a.shape):
        raise ValueError(f"div {name}: {b.shape} does not broadcast over {a.shape}")
    return _node(name, Op.DIV, a.shape, a, b)


def clamp(a: Tensor, lo: float, hi: float, name: str = "clamp") -> Tensor:
    return _node(name, Op.CLAMP, a.shape, a, min=lo, max=hi)


def sum_rows(a: Tensor, name: str = "sum_rows") -> Tensor:
    """The sum of each row: (..., n) -> (..., 1)."""
    return _node(name, Op.SUM_ROWS, (*a.shape[:-1], 1), a)


def argsort_top_k(a: Tensor, k: int, name: str = "argsort_top_k") -> Tensor:
    """The indices of each row's k largest values, largest first: (..., n) -> (..., k) I32
    (ggml_argsort_top_k: a descending ARGSORT and a view of its first k columns)."""
    if not 0 < k <= a.shape[-1]:
        raise ValueError(f"argsort_top_k {name}: k={k} of {a.shape[-1]}")
    srt = _node(f"{name} (argsort)", Op.ARGSORT, a.shape, a)
    srt.type = GGMLType.I32
    return cols(srt, 0, k, name)


def scale(a: Tensor, s: float, name: str = "scale") -> Tensor:
    return _node(name, Op.SCALE, a.shape, a, s=s)


# ggml_glu_op: SiLU and GELU (tanh approximation) gates, and gpt-oss's clamped SwiGLU
GLU_OPS = ("swiglu", "geglu", "swiglu_oai")


def glu(gate: Tensor, up: Tensor, op: str = "swiglu", name: str = "ffn_glu", **params: float) -> Tensor:
    """act(gate) * up: ggml_swiglu_split / ggml_geglu_split, the GLU op; "swiglu_oai"
    (ggml_swiglu_oai) takes `alpha` and `limit`: min(gate, limit) * sigmoid(alpha * that) *
    (clamp(up, -limit, limit) + 1)."""
    if gate.shape != up.shape:
        raise ValueError(f"{op}: {gate.shape} vs {up.shape}")
    if op not in GLU_OPS:
        raise ValueError(f"glu: unknown op {op!r} (one of {', '.join(GLU_OPS)})")
    if (op == "swiglu_oai") != bool(params):
        raise ValueError(f"glu {name}: {op} with parameters {params}")
    return _node(name, Op.GLU, gate.shape, gate, up, op=op, **params)


def swiglu(gate: Tensor, up: Tensor, name: str = "ffn_swiglu") -> Tensor:
    """silu(gate) * up: ggml_swiglu_split."""
    return glu(gate, up, "swiglu", name)


def mul_mat(w: Tensor, x: Tensor, name: str = "mul_mat") -> Tensor:
    """x @ w.T as ggml_mul_mat(w, x): w (..., M, K), x (..., N, K) -> (..., N, M).

    `w`'s leading (batch) dimensions broadcast over `x`'s when they divide them, as in ggml.
    """
    if w.shape[-1] != x.shape[-1]:
        raise ValueError(f"mul_mat {name}: inner dims differ, {w.shape} vs {x.shape}")
    return _node(name, Op.MUL_MAT, (*x.shape[:-1], w.shape[-2]), w, x)


def mul_mat_id(w: Tensor, x: Tensor, ids: Tensor, name: str = "mul_mat_id") -> Tensor:
    """ggml_mul_mat_id: w (n_expert, M, K) stacked experts, x (T, U or 1, K), ids (T, U) I32 ->
    (T, U, M), slot u of token t = x[t, u or 0] @ w[ids[t, u]].T. One input row (U = 1) is shared
    by all of a token's slots (gate and up); U rows, one per slot (down)."""
    if len(w.shape) != 3 or len(x.shape) != 3 or len(ids.shape) != 2:
        raise ValueError(f"mul_mat_id {name}: w {w.shape}, x {x.shape}, ids {ids.shape}")
    T, U = ids.shape
    if w.shape[-1] != x.shape[-1] or x.shape[0] != T or x.shape[1] not in (1, U):
        raise ValueError(f"mul_mat_id {name}: w {w.shape}, x {x.shape}, ids {ids.shape} disagree")
    return _node(name, Op.MUL_MAT_ID, (T, U, w.shape[1]), w, x, ids)


def soft_max(a: Tensor, mask: Tensor | None = None, scale: float = 1.0, name: str = "soft_max") -> Tensor:
    src = (a,) if mask is None else (a, mask)
    return _node(name, Op.SOFT_MAX, a.shape, *src, scale=scale)


def rope(
    x: Tensor,
    pos: Tensor,
    n_dims: int,
    freq_base: float,
    freq_scale: float = 1.0,
    freq_factors: Tensor | None = None,
    mode: int = 0,
    name: str = "rope",
    yarn: tuple[float, ...] = (),
) -> Tensor:
    """Rotary embedding of x (n_tokens, n_head, head_dim) at positions `pos` (n_tokens,).

    mode 0 is llama.cpp's "normal" mode (rotates adjacent pairs), 2 is NEOX (rotates halves).
    `yarn`: (n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow), ggml_rope_ext's YaRN
    parameters; () is plain rope (ext_factor 0, attn_factor 1).
    """
    src = (x, pos) if freq_factors is None else (x, pos, freq_factors)
    extra = {"yarn": tuple(yarn)} if yarn else {}
    return _node(
        name, Op.ROPE, x.shape, *src, n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale, **extra
    )


def flash_attn_ext(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None, name: str = "fattn",
    sinks: Tensor | None = None,
) -> Tensor:
    """softmax(q k^T * scale + mask) v over grouped heads (ggml_flash_attn_ext).

    `sinks` (n_head,): one learned logit per head that joins each softmax's denominator and
    adds no value (ggml_flash_attn_ext_add_sinks; gpt-oss).

    q (n_tokens, n_head, hd), k/v (n_kv, n_head_kv, hd), mask (n_tokens, n_kv) -> (n_tokens, n_head, hd).
    The mask's value may be narrower than its tensor, (n_tokens, n <= n_kv): the op then attends to
    the first n cells. So k/v can view the whole cache, and the number of cells a micro-batch
    attends to is an input of the graph, not part of its shape (ggml pads and rebuilds instead).
    """
    n_tokens, n_head, hd = q.shape
    if n_head % k.shape[1]:
        raise ValueError(f"{name}: {n_head} query heads do not group over {k.shape[1]} kv heads")
    if mask.shape != (n_tokens, k.shape[0]):
        raise ValueError(f"{name}: mask {mask.shape} != {(n_tokens, k.shape[0])}")
    if sinks is not None and sinks.shape != (n_head,):
        raise ValueError(f"{name}: sinks {sinks.shape} != ({n_head},)")
    s = 1.0 / math.sqrt(hd) if scale is None else scale
    src = (q, k, v, mask) if sinks is None else (q, k, v, mask, sinks)
    return _node(name, Op.FLASH_ATTN_EXT, (n_tokens, n_head, v.shape[-1]), *src, scale=s)


def reshape(a: Tensor, shape: tuple[int, ...], name: str | None = None) -> Tensor:
    n = 1
    for d in shape:
        n *= d
    if n != a.n_elements:
        raise ValueError(f"reshape {a.name}: {a.shape} -> {shape}")
    t = _node(name or f"{a.name} (reshaped)", Op.RESHAPE, shape, a)
    t.type = a.type
    t.view_src = a
    return t


def view(a: Tensor, shape: tuple[int, ...], offset: int = 0, name: str | None = None) -> Tensor:
    """A contiguous window of `a`: `shape` elements starting at element `offset`."""
    n = 1
    for d in shape:
        n *= d
    if offset + n > a.n_elements:
        raise ValueError(f"view {a.name}: {shape} at {offset} exceeds {a.shape}")
    t = _node(name or f"{a.name} (view)", Op.VIEW, shape, a, offset=offset)
    t.type = a.type
    t.view_src = a
    return t


def cols(a: Tensor, start: int, stop: int, name: str | None = None) -> Tensor:
    """Columns [start, stop) of every row of `a`: a strided view (the parts of a fused matmul's
    output, as ggml_view_2d does with an offset and the parent's row stride)."""
    if not 0 <= start < stop <= a.shape[-1]:
        raise ValueError(f"cols {a.name}: [{start}, {stop}) of {a.shape}")
    t = _node(name or f"{a.name} (cols)", Op.VIEW, (*a.shape[:-1], stop - start), a, cols=(start, stop))
    t.type = a.type
    t.view_src = a
    return t


def permute(a: Tensor, axes: tuple[int, ...], name: str | None = None) -> Tensor:
    t = _node(name or f"{a.name} (permuted)", Op.PERMUTE, tuple(a.shape[i] for i in axes), a, axes=axes)
    t.type = a.type
    t.view_src = a
    return t


def cont(a: Tensor, name: str | None = None) -> Tensor:
    return _node(name or f"{a.name} (cont)", Op.CONT, a.shape, a)
