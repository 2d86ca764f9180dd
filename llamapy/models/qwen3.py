"""qwen3 (llama.cpp's src/models/qwen3.cpp): llama's block with per-head RMS norms of Q and K
before rope (`attn_q_norm`, `attn_k_norm`), NEOX rope, and a head size read from
`attention.key_length` — not n_embd / n_head; a reranker's classifier head `cls.output` when
the file has one (Qwen3-Reranker: pooling `rank`, the last token's scores softmaxed).

Graph nodes only; no numeric kernels.
"""

from __future__ import annotations

from gguf import MODEL_ARCH, MODEL_TENSOR

from ..types import GGUFError
from .base import ROPE_NEOX, HParams, TensorSpec
from .llama import Llama


class Qwen3(Llama):
    name = "qwen3"
    gguf_arch = MODEL_ARCH.QWEN3
    rope_type = ROPE_NEOX
    rope_scalings = ("none", "linear")
    qk_norm = True
    rank_softmax = True

    def tensors(self, p: HParams) -> list[TensorSpec]:
        # a reranker's head (Qwen3-Reranker: one row per label), which gguf-py's table for qwen3
        # does not list (hence after the check in super().tensors) and llama.cpp's qwen3 loads
        return [*super().tensors(p), TensorSpec(MODEL_TENSOR.CLS_OUT, (p.n_cls_out, p.n_embd), required=False)]

    def check(self, p: HParams) -> None:
        # llama.cpp asserts n_embd_head_k == n_embd_head_v == n_rot; n_embd need not be H*D
        if not p.head_dim == p.head_dim_v == p.n_rot:
            raise GGUFError(f"qwen3 needs key_length == value_length == rope.dimension_count "
                            f"(got {p.head_dim}, {p.head_dim_v}, {p.n_rot})")  # fmt: skip


ARCH = Qwen3()
