"""llama (llama.cpp's src/models/llama.cpp, `llm_build_llama`): pre-norm blocks of RMS-normed
attention with normal-mode rope (and llama3 rope factors from `rope_freqs`) and a SwiGLU FFN.

This module only builds graph nodes — it imports no numeric kernels. Node names follow llama.cpp's
callback names (`attn_norm-0`, `Qcur-0`, `ffn_out-0`, `l_out-0`, `result_output`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import MODEL_ARCH, MODEL_TENSOR

from .. import ops
from ..tensor import Tensor
from ..types import GGUFError
from .base import ROPE_NORM, Architecture, HParams, TensorSpec, attn_tensors, ffn_tensors
from .inputs import GraphInputs
from .layers import attention, feed_forward, rms_norm, select_outputs

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

    def check(self, p: HParams) -> None:
        # llama.cpp: "invalid n_rot" unless it is the head size; llamapy's llama also needs E = H*D
        if p.head_dim * p.n_head != p.n_embd:
            raise GGUFError(f"head_dim {p.head_dim} x {p.n_head} heads != embedding_length {p.n_embd}")

    def tensors(self, p: HParams) -> list[TensorSpec]:
        spec = super().tensors(p)
        return [*spec, TensorSpec(MODEL_TENSOR.ROPE_FREQS, (p.n_rot // 2,), required=False)]

    def layer_tensors(self, p: HParams, il: int) -> list[TensorSpec]:
        return attn_tensors(p, il, bias=self.qkv_bias, qk_norm=self.qk_norm) + ffn_tensors(p, il)

    def build(self, p: HParams, w: ModelWeights, g: GraphInputs) -> Tensor:
        x = ops.get_rows(w.tok_embd, g.tokens, "inp_embd")  # (T, E)
        for il, lw in enumerate(w.layers):
            cur = rms_norm(x, lw["attn_norm"], p.rms_eps, f"attn_norm-{il}", f"norm-{il}")
            cur = attention(p, lw, cur, il, g, w.rope_freqs)  # (T, E)
            cur, x = select_outputs(g, il, p.n_layer, cur, x)  # (T or n_outputs, E)
            ffn_inp = ops.add(cur, x, f"ffn_inp-{il}")
            cur = rms_norm(ffn_inp, lw["ffn_norm"], p.rms_eps, f"ffn_norm-{il}", f"norm_ffn-{il}")
            cur = feed_forward(lw, cur, il, self.ffn_act)
            x = ops.add(cur, ffn_inp, f"l_out-{il}")  # (T or n_outputs, E)
        x = rms_norm(x, w.output_norm, p.rms_eps, "result_norm", "norm")
        return ops.mul_mat(w.output, x, "result_output")  # (n_outputs, V)


ARCH = Llama()
