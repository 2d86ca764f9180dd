"""Shared graph builders (llama.cpp's llm_graph_context: `build_norm`, `build_qkv` + `build_attn`,
`build_ffn`). Architectures compose these; only what differs lives in their modules.

Only graph nodes are built here — no numeric kernels. Node names are llama.cpp's callback names
(`attn_norm-0`, `Qcur-0`, `ffn_out-0`), so a dump lines up with llama-eval-callback's. Shapes in
comments are numpy's: T tokens, H query heads, Hkv KV heads, D head size, E embedding, F
feed-forward, N cells attended to.
"""

from __future__ import annotations

from .. import ops
from ..tensor import Tensor
from .base import HParams
from .inputs import GraphInputs


def rms_norm(x: Tensor, weight: Tensor, eps: float, name: str, norm_name: str | None = None) -> Tensor:
    """RMS_NORM over the last axis, then MUL by the weight (build_norm with LLM_NORM_RMS)."""
    cur = ops.rms_norm(x, eps, norm_name or f"{name} (norm)")
    return ops.mul(cur, weight, name)


def mm(g: GraphInputs, w: Tensor, x: Tensor, name: str) -> Tensor:
    """MUL_MAT of a weight, plus each applied LoRA adapter's scale·B(A·x) for it
    (build_lora_mm): (T, M) for x (T, K) and w (M, K)."""
    terms = g.lora.get(w.name, ())
    out = ops.mul_mat(w, x, f"{name}-base" if terms else name)  # (T, M)
    for i, t in enumerate(terms):
        ax = ops.mul_mat(t.a, x, f"{name}-lora_a{i}")  # (T, r)
        bax = ops.mul_mat(t.b, ax, f"{name}-lora_b{i}")  # (T, M)
        out = ops.add(out, ops.scale(bax, t.scale, f"{name}-lora{i}"), name)
    return out


def input_embd(g: GraphInputs, tok_embd: Tensor) -> Tensor:
    """The tokens' embedding rows (T, E), plus each applied adapter's scale·B·A[token]
    (build_inp_embd: A's rows are picked by token id)."""
    x = ops.get_rows(tok_embd, g.tokens, "inp_embd")  # (T, E)
    for i, t in enumerate(g.lora.get(tok_embd.name, ())):
        rows = ops.get_rows(t.a, g.tokens, f"inp_embd-lora_a{i}")  # (T, r)
        delta = ops.mul_mat(t.b, rows, f"inp_embd-lora_b{i}")  # (T, E)
        x = ops.add(x, ops.scale(delta, t.scale, f"inp_embd-lora{i}"), "inp_embd")
    return x


def cvec(g: GraphInputs, x: Tensor, il: int) -> Tensor:
    """A layer's output plus the control vector's direction for it, if any (build_cvec)."""
    d = g.cvec.get(il)
    return x if d is None else ops.add(x, d, f"l_out_cvec-{il}")  # (T, E) + (E,)


def _bias(x: Tensor, w: dict[str, Tensor], key: str, name: str) -> Tensor:
    b = w.get(f"{key}.bias")
    return x if b is None else ops.add(x, b, name)


def qkv(p: HParams, w: dict[str, Tensor], x: Tensor, il: int, g: GraphInputs) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K, V projections (build_qkv): one fused MUL_MAT when the loader fused them (and one ADD
    of their fused biases, llama.cpp's bqkv: each element the same sum as its part's ADD), else
    three, plus the optional biases. Returns (T, H*D), (T, Hkv*D), (T, Hkv*Dv)."""
    H, Hkv, D, Dv = p.n_head_arr[il], p.n_head_kv_arr[il], p.head_dim, p.head_dim_v
    if "attn_qkv" in w:
        fused = ops.mul_mat(w["attn_qkv"], x, f"wqkv-{il}")  # (T, H*D + Hkv*D + Hkv*Dv)
        fused = _bias(fused, w, "attn_qkv", f"bqkv-{il}")
        q = ops.cols(fused, 0, H * D, f"Qcur-{il}")  # (T, H*D)
        k = ops.cols(fused, H * D, (H + Hkv) * D, f"Kcur-{il}")  # (T, Hkv*D)
        v = ops.cols(fused, (H + Hkv) * D, (H + Hkv) * D + Hkv * Dv, f"Vcur-{il}")  # (T, Hkv*Dv)
        return q, k, v
    q = _bias(mm(g, w["attn_q"], x, f"Qcur-{il}"), w, "attn_q", f"Qcur_b-{il}")  # (T, H*D)
    k = _bias(mm(g, w["attn_k"], x, f"Kcur-{il}"), w, "attn_k", f"Kcur_b-{il}")  # (T, Hkv*D)
    v = _bias(mm(g, w["attn_v"], x, f"Vcur-{il}"), w, "attn_v", f"Vcur_b-{il}")  # (T, Hkv*Dv)
    return q, k, v


def attention(
    p: HParams,
    w: dict[str, Tensor],
    x: Tensor,
    il: int,
    g: GraphInputs,
    freqs: Tensor | None = None,
    q_scale: float | None = None,
) -> Tensor:
    """Self-attention of one layer over the KV cache (build_qkv + build_attn): Q/K/V with optional
    biases, optional per-head RMS norms of Q and K (`attn_q_norm` / `attn_k_norm`, before rope),
    rope with the layer's base (and YaRN's parameters), the sliding-window mask on a
    sliding-window layer, attention sinks (`attn_sinks`), and the output projection (with its
    optional bias). `q_scale` multiplies Q (a SCALE node, as gemma3 does) and then the
    attention runs at scale 1; by default the attention scales by 1/sqrt(D)."""
    T, H, Hkv, D, Dv, N = g.n_tokens, p.n_head_arr[il], p.n_head_kv_arr[il], p.head_dim, p.head_dim_v, g.kv.size
    q, k, v = qkv(p, w, x, il, g)
    q = ops.reshape(q, (T, H, D), f"Qcur-{il} (reshaped)")  # (T, H, D)
    k = ops.reshape(k, (T, Hkv, D), f"Kcur-{il} (reshaped)")  # (T, Hkv, D)
    if "attn_q_norm" in w:
        q = rms_norm(q, w["attn_q_norm"], p.rms_eps, f"Qcur_normed-{il}")  # per head: over D
    if "attn_k_norm" in w:
        k = rms_norm(k, w["attn_k_norm"], p.rms_eps, f"Kcur_normed-{il}")
    rope = dict(n_dims=p.n_rot, freq_base=p.rope_base(il), freq_scale=p.rope_scale(il),
                freq_factors=freqs, mode=p.rope_type, yarn=p.rope_yarn)  # fmt: skip
    q = ops.rope(q, g.pos, name=f"Qcur-{il} (rope)", **rope)  # type: ignore[arg-type]
    k = ops.rope(k, g.pos, name=f"Kcur-{il} (rope)", **rope)  # type: ignore[arg-type]
    scale = None
    if q_scale is not None:
        q = ops.scale(q, q_scale, f"Qcur_scaled-{il}")
        scale = 1.0
    # Q, V, K and then both cache stores go into the graph together (build_attn's order): a
    # layer whose KV cache is on the host then needs one switch there and back, not two
    g.gf.expand(q, v, k)
    # store this batch's K/V rows in the cache; the views span all N cells, and the attention reads
    # the first n_kv of them, its mask's width (ops.flash_attn_ext)
    kv = g.kv
    k2 = ops.reshape(k, (T, Hkv * D), f"Kcur-{il} (rows)")  # (T, Hkv*D)
    k_all = ops.set_rows(kv.k[il], g.kv_idx, k2, f"k_cache_store-{il}")
    v_all = ops.set_rows(kv.v[il], g.kv_idx, v, f"v_cache_store-{il}")
    g.gf.expand(k_all, v_all)
    k_view = ops.view(k_all, (N, Hkv, D), 0, f"k-{il}")  # (N, Hkv, D)
    v_view = ops.view(v_all, (N, Hkv, Dv), 0, f"v-{il}")  # (N, Hkv, Dv)
    mask = g.kq_mask(p.n_swa if p.is_swa(il) else 0)
    att = ops.flash_attn_ext(q, k_view, v_view, mask, scale, f"fattn-{il}", w.get("attn_sinks"))  # (T, H, Dv)
    att = ops.reshape(att, (T, H * Dv), f"kqv_out-{il}")  # (T, H*Dv)
    return _bias(mm(g, w["attn_output"], att, f"attn_out-{il}"), w, "attn_output", f"attn_out_b-{il}")  # (T, E)


def feed_forward(w: dict[str, Tensor], x: Tensor, il: int, g: GraphInputs, act: str = "swiglu") -> Tensor:
    """A gated FFN (build_ffn with LLM_FFN_PAR): down(act(gate(x)) * up(x)), `act` one of
    ggml's GLU ops — swiglu (SiLU) or geglu (GELU, tanh approximation)."""
    if "ffn_gate_up" in w:
        gate_up = ops.mul_mat(w["ffn_gate_up"], x, f"ffn_gate_up-{il}")  # (T, 2F)
        F = gate_up.shape[-1] // 2
        gate = ops.cols(gate_up, 0, F, f"ffn_gate-{il}")  # (T, F)
        up = ops.cols(gate_up, F, 2 * F, f"ffn_up-{il}")  # (T, F)
    else:
        gate = mm(g, w["ffn_gate"], x, f"ffn_gate-{il}")  # (T, F)
        up = mm(g, w["ffn_up"], x, f"ffn_up-{il}")  # (T, F)
    h = ops.glu(gate, up, act, f"ffn_{act}-{il}")  # (T, F)
    return mm(g, w["ffn_down"], h, f"ffn_out-{il}")  # (T, E)


def select_outputs(g: GraphInputs, il: int, n_layer: int, *xs: Tensor) -> tuple[Tensor, ...]:
    """In the last layer, keep only the rows whose logits are wanted (llama.cpp's inp_out_ids)."""
    if il != n_layer - 1 or not g.select_outputs:
        return xs
    names = ("attn_out_sel", "inpSA_sel")
    return tuple(ops.get_rows(x, g.out_ids, f"{names[min(i, 1)]}-{il}") for i, x in enumerate(xs))  # (n_out, E)


# the smallest normal f16: llama.cpp clamps the sum of the chosen experts' weights to it before
# dividing by it (build_moe_ffn)
_MIN_WEIGHT_SUM = 6.103515625e-5
# gpt-oss's clamped SwiGLU (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def moe_ffn(p: HParams, w: dict[str, Tensor], x: Tensor, il: int, g: GraphInputs, norm_w: bool = True,
            gating: str = "softmax", act: str = "swiglu") -> Tensor:  # fmt: skip
    """A mixture-of-experts FFN (build_moe_ffn): the router's logits (plus `ffn_gate_inp.bias`),
    each token's top n_expert_used experts and their weights — `gating` "softmax": the softmax
    over all experts' logits, then the top k (normalised to sum 1 when `norm_w`); "softmax_weight"
    (gpt-oss): the top k of the logits, then the softmax over those k — scaled by
    expert_weights_scale, the chosen experts' gated FFNs (MUL_MAT_ID, each expert's bias added by
    ADD_ID when the file has `ffn_*_exps.bias`; `act` "swiglu" or "swiglu_oai"), weighted and
    summed over the slots in slot order."""
    T, E, U = x.shape[0], p.n_embd, p.n_expert_used
    logits = mm(g, w["ffn_gate_inp"], x, f"ffn_moe_logits-{il}")  # (T, n_expert)
    logits = _bias(logits, w, "ffn_gate_inp", f"ffn_moe_logits_biased-{il}")
    probs = ops.soft_max(logits, name=f"ffn_moe_probs-{il}") if gating == "softmax" else logits  # (T, n_expert)
    selected = ops.argsort_top_k(probs, U, f"ffn_moe_topk-{il}")  # (T, U) I32, largest first
    probs3 = ops.reshape(probs, (T, p.n_expert, 1), f"ffn_moe_probs-{il} (reshaped)")  # (T, n_expert, 1)
    weights = ops.get_rows(probs3, selected, f"ffn_moe_weights-{il}")  # (T, U, 1)
    if gating == "softmax_weight":
        w2 = ops.reshape(weights, (T, U), f"ffn_moe_weights-{il} (2d)")  # (T, U)
        w2 = ops.soft_max(w2, name=f"ffn_moe_weights_softmax-{il}")
        weights = ops.reshape(w2, (T, U, 1), f"ffn_moe_weights_softmax-{il} (3d)")  # (T, U, 1)
    if norm_w:
        w2 = ops.reshape(weights, (T, U), f"ffn_moe_weights-{il} (2d)")  # (T, U)
        total = ops.sum_rows(w2, f"ffn_moe_weights_sum-{il}")  # (T, 1)
        total = ops.clamp(total, _MIN_WEIGHT_SUM, float("inf"), f"ffn_moe_weights_sum_clamped-{il}")
        w2 = ops.div(w2, total, f"ffn_moe_weights_norm-{il}")  # (T, U)
        weights = ops.reshape(w2, (T, U, 1), f"ffn_moe_weights_norm-{il} (3d)")  # (T, U, 1)
    if p.expert_weights_scale not in (0.0, 1.0):
        weights = ops.scale(weights, p.expert_weights_scale, f"ffn_moe_weights_scaled-{il}")
    g.gf.expand(weights)  # the router before the experts, as llama.cpp orders them
    cur = ops.reshape(x, (T, 1, E), f"ffn_norm-{il} (3d)")  # (T, 1, E): one row for every slot

    def expert_mm(key: str, h: Tensor, name: str) -> Tensor:
        out = ops.mul_mat_id(w[key], h, selected, name)  # (T, U, M)
        b = w.get(f"{key}.bias")  # (n_expert, M)
        return out if b is None else ops.add_id(out, b, selected, f"{name}_biased")

    up = expert_mm("ffn_up_exps", cur, f"ffn_moe_up-{il}")  # (T, U, F)
    gate = expert_mm("ffn_gate_exps", cur, f"ffn_moe_gate-{il}")  # (T, U, F)
    oai = dict(alpha=SWIGLU_OAI_ALPHA, limit=SWIGLU_OAI_LIMIT) if act == "swiglu_oai" else {}
    par = ops.glu(gate, up, act, f"ffn_moe_{act}-{il}", **oai)  # (T, U, F)
    experts = expert_mm("ffn_down_exps", par, f"ffn_moe_down-{il}")  # (T, U, E)
    experts = ops.mul(experts, weights, f"ffn_moe_weighted-{il}")  # (T, U, E)
    g.gf.expand(experts)
    flat = ops.reshape(experts, (T, U * E), f"ffn_moe_weighted-{il} (rows)")  # (T, U*E)
    # the slots summed in slot order (largest weight first), as llama.cpp's chain of ADDs
    out = ops.cols(flat, 0, E, f"ffn_moe_slot0-{il}")  # (T, E)
    for i in range(1, U):
        out = ops.add(out, ops.cols(flat, i * E, (i + 1) * E, f"ffn_moe_slot{i}-{il}"), f"ffn_moe_out-{il}")
    return ops.cont(out, f"ffn_moe_out-{il}") if U == 1 else out  # (T, E)
