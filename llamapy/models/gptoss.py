"""gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE, src/models/openai-moe-iswa.cpp): attention with
Q/K/V/O biases and a learned sink logit per head, sliding-window layers (`attention.
sliding_window`) alternating with full ones (the pattern from the file, by default every second
layer global), YaRN rope (`rope.scaling.*`: factor, original context), the post-attention norm as
the FFN's norm, and in every layer a mixture of experts: the router's biased logits, the top
`expert_used_count` of them and a softmax over those ("softmax_weight" gating), the experts'
biases (ADD_ID) and the clamped SwiGLU (ggml's swiglu_oai) — layers.moe_ffn.

Graph nodes only; no numeric kernels.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any

from gguf import MODEL_ARCH, MODEL_TENSOR, Keys

from .. import ops
from ..tensor import Tensor
from ..types import GGUFError
from .base import ROPE_NEOX, Architecture, HParams, KeyReader, TensorSpec, attn_tensors, read_experts, read_swa_pattern
from .inputs import GraphInputs
from .layers import attention, cvec, input_embd, mm, moe_ffn, rms_norm, select_outputs

if TYPE_CHECKING:
    from ..model.loader import ModelWeights

# llama.cpp's llama_hparams defaults (gpt-oss sets no YaRN keys of its own)
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


def yarn_params(scaling: str, freq_scale: float, n_ctx_orig: int, rope_attn_factor: float) -> tuple[float, ...]:
    """(n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow) as llama_context sets them for
    a YaRN model: ext_factor 1, and attn_factor get_mscale(factor) / (1 + 0.1 ln factor) — ggml's
    rope_yarn multiplies by the second again, so cos/sin end up scaled by 1 + 0.1 ln factor —
    in float32 as llama.cpp rounds it."""
    if scaling != "yarn":
        return ()
    f = _f32
    factor = f(1.0 / f(freq_scale))
    # 0.1 * ln(factor) + 1 as one fma, as llama.cpp's build contracts it (the f32 product is
    # exact in a double: one rounding)
    m = f(f(0.1) * f(math.log(factor)) + 1.0)
    mscale = m if factor > 1.0 else 1.0
    attn = f(f(mscale * f(1.0 / m)) * f(rope_attn_factor))
    return (float(n_ctx_orig), 1.0, attn, YARN_BETA_FAST, YARN_BETA_SLOW)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]  # type: ignore[no-any-return]


class GptOss(Architecture):
    name = "gpt-oss"
    gguf_arch = MODEL_ARCH.GPT_OSS
    rope_type = ROPE_NEOX
    rope_scalings = ("none", "linear", "yarn")

    def read_extra(self, r: KeyReader, fields: dict[str, Any]) -> None:
        read_experts(r, fields, required=True)
        n_swa = r.get(Keys.Attention.SLIDING_WINDOW)
        if n_swa <= 0:
            raise GGUFError(f"key {r.name(Keys.Attention.SLIDING_WINDOW)!r} has value {n_swa}, expected > 0")
        fields.update(n_swa=n_swa, swa_layers=read_swa_pattern(r, fields["n_layer"], 2),
                      rope_freq_base_swa=r.get(Keys.Rope.FREQ_BASE_SWA, fields["rope_freq_base"], float),
                      rope_freq_scale_swa=fields["rope_freq_scale"])  # fmt: skip
        scaling = r.get(Keys.Rope.SCALING_TYPE, "none", str)
        n_ctx_orig = r.get(Keys.Rope.SCALING_ORIG_CTX_LEN, fields["n_ctx_train"])
        fields["rope_yarn"] = yarn_params(scaling, fields["rope_freq_scale"], n_ctx_orig,
                                          r.get(Keys.Rope.SCALING_ATTN_FACTOR, 1.0, float))  # fmt: skip

    def check(self, p: HParams) -> None:
        # llama.cpp reshapes Q/K/V by n_rot: the rotated width is the whole head
        if not p.head_dim == p.head_dim_v == p.n_rot:
            raise GGUFError(f"gpt-oss needs key_length == value_length == rope.dimension_count "
                            f"(got {p.head_dim}, {p.head_dim_v}, {p.n_rot})")  # fmt: skip

    def layer_tensors(self, p: HParams, il: int) -> list[TensorSpec]:
        e, x, ff = p.n_embd, p.n_expert, p.n_ff_exp
        T = MODEL_TENSOR
        return [*attn_tensors(p, il, bias=True, post_norm=True),
                TensorSpec(T.ATTN_OUT, (e,), il, "bias"),
                TensorSpec(T.ATTN_SINKS, (p.n_head_arr[il],), il),
                TensorSpec(T.FFN_GATE_INP, (x, e), il), TensorSpec(T.FFN_GATE_INP, (x,), il, "bias"),
                TensorSpec(T.FFN_GATE_EXP, (x, ff, e), il), TensorSpec(T.FFN_GATE_EXP, (x, ff), il, "bias"),
                TensorSpec(T.FFN_UP_EXP, (x, ff, e), il), TensorSpec(T.FFN_UP_EXP, (x, ff), il, "bias"),
                TensorSpec(T.FFN_DOWN_EXP, (x, e, ff), il), TensorSpec(T.FFN_DOWN_EXP, (x, e), il, "bias")]  # fmt: skip

    def build(self, p: HParams, w: ModelWeights, g: GraphInputs) -> Tensor:
        x = input_embd(g, w.tok_embd)  # (T, E)
        for il, lw in enumerate(w.layers):
            cur = rms_norm(x, lw["attn_norm"], p.rms_eps, f"attn_norm-{il}", f"norm-{il}")
            cur = attention(p, lw, cur, il, g)  # (T, E): sinks, biases, the window on local layers
            cur, x = select_outputs(g, il, p.n_layer, cur, x)  # (T or n_outputs, E)
            ffn_inp = ops.add(cur, x, f"ffn_inp-{il}")
            cur = rms_norm(ffn_inp, lw["post_attention_norm"], p.rms_eps, f"attn_post_norm-{il}", f"norm_ffn-{il}")
            cur = moe_ffn(p, lw, cur, il, g, norm_w=False, gating="softmax_weight", act="swiglu_oai")
            x = ops.add(cur, ffn_inp, f"l_out-{il}")  # (T or n_outputs, E)
            x = cvec(g, x, il)
        x = rms_norm(x, w.output_norm, p.rms_eps, "result_norm", "norm")
        return mm(g, w.output, x, "result_output")  # (n_outputs, V)


ARCH = GptOss()
