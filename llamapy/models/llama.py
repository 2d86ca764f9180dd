"""llama (llama.cpp's src/models/llama.cpp, `llm_build_llama`): pre-norm blocks of RMS-normed
attention with normal-mode rope (and llama3 rope factors from `rope_freqs`) and a SwiGLU FFN —
or, when the file has `llama.expert_count` (Mixtral-style), a mixture of SwiGLU experts behind a
softmax router (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`; layers.moe_ffn).

This module only builds graph nodes — it imports no numeric kernels. Node names follow llama.cpp's
callback names (`attn_norm-0`, `Qcur-0`, `ffn_out-0`, `l_out-0`, `result_output`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_ARCH, MODEL_TENSOR

from .. import ops
from ..tensor import Tensor
from ..types import GGUFError
from .base import (ROPE_NORM, Architecture, HParams, KeyReader, TensorSpec, attn_tensors, ffn_tensors,
                   moe_tensors, read_experts)
from .inputs import GraphInputs
from .layers import attention, cvec, feed_forward, input_embd, mm, moe_ffn, rms_norm, select_outputs

if TYPE_CHECKING:
    from ..model.loader import ModelWeights


class Llama(Architecture):
    name = "llama"
    gguf_arch = MODEL_ARCH.LLAMA
    rope_type = ROPE_NORM
    rope_scalings = ("none", "linear", "llama3")
    ffn_act = "swiglu"

    qkv_bias = False
    qk_norm = False
    moe = False  # experts in every layer (qwen3moe); llama has them when the file says so

    def read_extra(self, r: KeyReader, fields: dict[str, Any]) -> None:
        read_experts(r, fields, required=self.moe)

    def check(self, p: HParams) -> None:
        # llama.cpp: "invalid n_rot" unless it is the head size; llamapy's llama also needs E = H*D
        if p.head_dim * p.n_head != p.n_embd:
            raise GGUFError(f"head_dim {p.head_dim} x {p.n_head} heads != embedding_length {p.n_embd}")

    def tensors(self, p: HParams) -> list[TensorSpec]:
        spec = super().tensors(p)
        return [*spec, TensorSpec(MODEL_TENSOR.ROPE_FREQS, (p.n_rot // 2,), required=False)]

    def layer_tensors(self, p: HParams, il: int) -> list[TensorSpec]:
        attn = attn_tensors(p, il, bias=self.qkv_bias, qk_norm=self.qk_norm)
        if p.n_expert:  # llama's experts are n_ff wide; qwen3moe's n_ff_exp (read_experts)
            return attn + moe_tensors(p, il, p.n_ff_exp if self.moe else p.n_ff_arr[il])
        return attn + ffn_tensors(p, il)

    def build(self, p: HParams, w: ModelWeights, g: GraphInputs) -> Tensor:
        x = input_embd(g, w.tok_embd)  # (T, E)
        for il, lw in enumerate(w.layers):
            cur = rms_norm(x, lw["attn_norm"], p.rms_eps, f"attn_norm-{il}", f"norm-{il}")
            cur = attention(p, lw, cur, il, g, w.rope_freqs)  # (T, E)
            cur, x = select_outputs(g, il, p.n_layer, cur, x)  # (T or n_outputs, E)
            ffn_inp = ops.add(cur, x, f"ffn_inp-{il}")
            cur = rms_norm(ffn_inp, lw["ffn_norm"], p.rms_eps, f"ffn_norm-{il}", f"norm_ffn-{il}")
            if "ffn_gate_inp" in lw:
                cur = moe_ffn(p, lw, cur, il, g)  # (T or n_outputs, E)
            else:
                cur = feed_forward(lw, cur, il, g, self.ffn_act)
            x = ops.add(cur, ffn_inp, f"l_out-{il}")  # (T or n_outputs, E)
            x = cvec(g, x, il)
        x = rms_norm(x, w.output_norm, p.rms_eps, "result_norm", "norm")
        return mm(g, w.output, x, "result_output")  # (n_outputs, V)


ARCH = Llama()
