"""gemma3 (llama.cpp's src/models/gemma3.cpp, the iSWA graph): embeddings scaled by sqrt(n_embd),
per-head Q/K RMS norms, Q scaled by the file's query scale, norms after attention and after the
FFN, a GELU-gated FFN, and sliding-window attention on the local layers — with their own rope
base (`rope.freq_base_swa`, 10 000 by default) apart from the global layers' one.

Which layers are local: `attention.sliding_window_pattern` (a per-layer array, or a period n:
every n-th layer global, llama.cpp's default 6). Graph nodes only; no numeric kernels.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gguf import MODEL_ARCH, MODEL_TENSOR, Keys

from .. import ops
from ..tensor import Tensor
from ..types import GGUFError, UnsupportedError
from .base import ROPE_NEOX, Architecture, HParams, KeyReader, TensorSpec, attn_tensors, ffn_tensors, read_swa_pattern
from .inputs import GraphInputs
from .layers import attention, cvec, feed_forward, input_embd, mm, rms_norm, select_outputs

if TYPE_CHECKING:
    from ..model.loader import ModelWeights


class Gemma3(Architecture):
    name = "gemma3"
    gguf_arch = MODEL_ARCH.GEMMA3
    rope_type = ROPE_NEOX
    rope_scalings = ("none", "linear")

    def read_extra(self, r: KeyReader, fields: dict[str, Any]) -> None:
        n_layer = fields["n_layer"]
        n_swa = r.get(Keys.Attention.SLIDING_WINDOW, 0)
        if n_swa < 0:
            raise GGUFError(f"key {r.name(Keys.Attention.SLIDING_WINDOW)!r} has value {n_swa}, expected >= 0")
        if n_swa > 0:
            fields["n_swa"] = n_swa
            fields["swa_layers"] = read_swa_pattern(r, n_layer, 6)
            fields["rope_freq_base_swa"] = r.get(Keys.Rope.FREQ_BASE_SWA, 10000.0, float)
        softcap = r.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0, float)
        if softcap:
            raise UnsupportedError(f"{r.name(Keys.LLM.FINAL_LOGIT_SOFTCAPPING)} {softcap} is not supported")
        # llama.cpp: 1/sqrt(head size), but 1/sqrt(n_embd/n_head) for the 27B model (62 layers)
        d = fields["n_embd"] // fields["n_head_arr"][0] if n_layer == 62 else fields["head_dim"]
        fields["attn_scale"] = 1.0 / math.sqrt(d) if d > 0 else 0.0  # d <= 0: validate() says so

    def check(self, p: HParams) -> None:
        if p.head_dim != p.head_dim_v:
            raise GGUFError(f"gemma3 needs key_length == value_length (got {p.head_dim}, {p.head_dim_v})")

    def layer_tensors(self, p: HParams, il: int) -> list[TensorSpec]:
        return attn_tensors(p, il, qk_norm=True, post_norm=True) + ffn_tensors(
            p, il, norm=MODEL_TENSOR.FFN_PRE_NORM, post_norm=True
        )

    def build(self, p: HParams, w: ModelWeights, g: GraphInputs) -> Tensor:
        x = input_embd(g, w.tok_embd)  # (T, E)
        x = ops.scale(x, math.sqrt(p.n_embd), "inp_scaled")
        for il, lw in enumerate(w.layers):
            cur = rms_norm(x, lw["attn_norm"], p.rms_eps, f"attn_norm-{il}", f"norm-{il}")
            cur = attention(p, lw, cur, il, g, None, q_scale=p.attn_scale)  # (T, E)
            cur, x = select_outputs(g, il, p.n_layer, cur, x)  # (T or n_outputs, E)
            cur = rms_norm(cur, lw["post_attention_norm"], p.rms_eps, f"attn_post_norm-{il}")
            sa_out = ops.add(cur, x, f"sa_out-{il}")
            cur = rms_norm(sa_out, lw["ffn_norm"], p.rms_eps, f"ffn_norm-{il}", f"norm_ffn-{il}")
            cur = feed_forward(lw, cur, il, g, "geglu")
            cur = rms_norm(cur, lw["post_ffw_norm"], p.rms_eps, f"ffn_post_norm-{il}")
            x = ops.add(cur, sa_out, f"l_out-{il}")  # (T or n_outputs, E)
            x = cvec(g, x, il)
        x = rms_norm(x, w.output_norm, p.rms_eps, "result_norm", "norm")
        return mm(g, w.output, x, "result_output")  # (n_outputs, V)


ARCH = Gemma3()
