"""The llama graph for one micro-batch (llama.cpp's src/models/llama.cpp, `llm_build_llama`).

This module only builds graph nodes — it imports no numeric kernels. Node names follow llama.cpp's
callback names (`attn_norm-0`, `Qcur-0`, `ffn_out-0`, `l_out-0`, `result_output`), so a dump lines
up with llama-eval-callback's. Shapes in comments are numpy's: T tokens, H query heads, Hkv KV
heads, D head size, E embedding, F feed-forward, V vocabulary, N cells attended to.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..graph import Graph
from ..tensor import Tensor, TensorFlag
from ..types import GGMLType
from .kv_cache import KVCache
from .loader import LlamaParams, ModelWeights


@dataclass
class LlamaGraph:
    """A built graph and the input tensors to fill before each run."""

    graph: Graph
    tokens: Tensor  # (T,) token ids
    pos: Tensor  # (T,) positions
    kv_idx: Tensor  # (T,) cache cells the new K/V rows go to
    kq_mask: Tensor  # (T, N)
    out_ids: Tensor  # (n_outputs,) rows of the batch whose logits are wanted
    logits: Tensor  # (n_outputs, V)
    n_tokens: int
    n_kv: int
    n_outputs: int


def _input(name: str, shape: tuple[int, ...], t: GGMLType = GGMLType.I32) -> Tensor:
    return Tensor(name, shape, t, flags=TensorFlag.INPUT)


def attention(
    p: LlamaParams, w: dict[str, Tensor], x: Tensor, il: int, kv: KVCache, g: LlamaGraph, freqs: Tensor | None
) -> Tensor:
    T, H, Hkv, D, N = g.n_tokens, p.n_head, p.n_head_kv, p.head_dim, g.n_kv
    if "attn_qkv" in w:
        qkv = ops.mul_mat(w["attn_qkv"], x, f"wqkv-{il}")  # (T, H*D + 2*Hkv*D)
        q = ops.cols(qkv, 0, H * D, f"Qcur-{il}")  # (T, H*D)
        k = ops.cols(qkv, H * D, (H + Hkv) * D, f"Kcur-{il}")  # (T, Hkv*D)
        v = ops.cols(qkv, (H + Hkv) * D, (H + 2 * Hkv) * D, f"Vcur-{il}")  # (T, Hkv*D)
    else:
        q = ops.mul_mat(w["attn_q"], x, f"Qcur-{il}")  # (T, H*D)
        k = ops.mul_mat(w["attn_k"], x, f"Kcur-{il}")  # (T, Hkv*D)
        v = ops.mul_mat(w["attn_v"], x, f"Vcur-{il}")  # (T, Hkv*D)
    q = ops.reshape(q, (T, H, D), f"Qcur-{il} (reshaped)")  # (T, H, D)
    k = ops.reshape(k, (T, Hkv, D), f"Kcur-{il} (reshaped)")  # (T, Hkv, D)
    rope = dict(n_dims=p.n_rot, freq_base=p.rope_freq_base, freq_scale=p.rope_freq_scale,
                freq_factors=freqs, mode=p.rope_type)  # fmt: skip
    q = ops.rope(q, g.pos, name=f"Qcur-{il} (rope)", **rope)  # type: ignore[arg-type]
    k = ops.rope(k, g.pos, name=f"Kcur-{il} (rope)", **rope)  # type: ignore[arg-type]
    # store this batch's K/V rows in the cache, then attend to the first N cells of it
    k2 = ops.reshape(k, (T, Hkv * D), f"Kcur-{il} (rows)")  # (T, Hkv*D)
    k_all = ops.set_rows(kv.k[il], g.kv_idx, k2, f"k_cache_store-{il}")
    v_all = ops.set_rows(kv.v[il], g.kv_idx, v, f"v_cache_store-{il}")
    k_view = ops.view(k_all, (N, Hkv, D), 0, f"k-{il}")  # (N, Hkv, D)
    v_view = ops.view(v_all, (N, Hkv, D), 0, f"v-{il}")  # (N, Hkv, D)
    att = ops.flash_attn_ext(q, k_view, v_view, g.kq_mask, None, f"fattn-{il}")  # (T, H, D)
    att = ops.reshape(att, (T, H * D), f"kqv_out-{il}")  # (T, H*D)
    return ops.mul_mat(w["attn_output"], att, f"attn_out-{il}")  # (T, E)


def feed_forward(w: dict[str, Tensor], x: Tensor, il: int) -> Tensor:
    if "ffn_gate_up" in w:
        gate_up = ops.mul_mat(w["ffn_gate_up"], x, f"ffn_gate_up-{il}")  # (T, 2F)
        F = gate_up.shape[-1] // 2
        gate = ops.cols(gate_up, 0, F, f"ffn_gate-{il}")  # (T, F)
        up = ops.cols(gate_up, F, 2 * F, f"ffn_up-{il}")  # (T, F)
    else:
        gate = ops.mul_mat(w["ffn_gate"], x, f"ffn_gate-{il}")  # (T, F)
        up = ops.mul_mat(w["ffn_up"], x, f"ffn_up-{il}")  # (T, F)
    return ops.mul_mat(w["ffn_down"], ops.swiglu(gate, up, f"ffn_swiglu-{il}"), f"ffn_out-{il}")  # (T, E)


def build_graph(
    p: LlamaParams, w: ModelWeights, kv: KVCache, n_tokens: int, n_kv: int, n_outputs: int
) -> LlamaGraph:
    g = LlamaGraph(
        graph=Graph(),
        tokens=_input("inp_tokens", (n_tokens,)),
        pos=_input("inp_pos", (n_tokens,)),
        kv_idx=_input("inp_kv_idx", (n_tokens,), GGMLType.I64),
        kq_mask=_input("kq_mask", (n_tokens, n_kv), GGMLType.F32),
        out_ids=_input("inp_out_ids", (n_outputs,)),
        logits=w.output,  # replaced below
        n_tokens=n_tokens,
        n_kv=n_kv,
        n_outputs=n_outputs,
    )
    x = ops.get_rows(w.tok_embd, g.tokens, "inp_embd")  # (T, E)
    for il, lw in enumerate(w.layers):
        cur = ops.rms_norm(x, p.rms_eps, f"norm-{il}")
        cur = ops.mul(cur, lw["attn_norm"], f"attn_norm-{il}")
        cur = attention(p, lw, cur, il, kv, g, w.rope_freqs)  # (T, E)
        if il == p.n_layer - 1 and n_outputs < n_tokens:
            # only the rows whose logits are wanted go on (llama.cpp's inp_out_ids)
            cur = ops.get_rows(cur, g.out_ids, f"attn_out_sel-{il}")  # (n_outputs, E)
            x = ops.get_rows(x, g.out_ids, f"inpSA_sel-{il}")  # (n_outputs, E)
        ffn_inp = ops.add(cur, x, f"ffn_inp-{il}")
        cur = ops.rms_norm(ffn_inp, p.rms_eps, f"norm_ffn-{il}")
        cur = ops.mul(cur, lw["ffn_norm"], f"ffn_norm-{il}")
        cur = feed_forward(lw, cur, il)
        x = ops.add(cur, ffn_inp, f"l_out-{il}")  # (T or n_outputs, E)
    x = ops.rms_norm(x, p.rms_eps, "norm")
    x = ops.mul(x, w.output_norm, "result_norm")
    g.logits = ops.mul_mat(w.output, x, "result_output")  # (n_outputs, V)
    g.graph = Graph.build(g.logits)
    return g
