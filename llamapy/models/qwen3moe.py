"""qwen3moe (llama.cpp's src/models/qwen3moe.cpp): qwen3's attention (per-head Q/K RMS norms,
NEOX rope, head size from `attention.key_length`) and in every layer a mixture of experts —
a softmax router over `expert_count` experts, the top `expert_used_count` of them per token,
their weights normalised to sum 1, SwiGLU experts `expert_feed_forward_length` wide, no shared
expert (layers.moe_ffn).

Graph nodes only; no numeric kernels.
"""

from __future__ import annotations

from gguf import MODEL_ARCH

from .qwen3 import Qwen3


class Qwen3MoE(Qwen3):
    name = "qwen3moe"
    gguf_arch = MODEL_ARCH.QWEN3MOE
    moe = True


ARCH = Qwen3MoE()
