"""qwen3 (llama.cpp's src/models/qwen3.cpp): llama's block with per-head RMS norms of Q and K
before rope (`attn_q_norm`, `attn_k_norm`), NEOX rope, and a head size read from
`attention.key_length` — not n_embd / n_head.

Graph nodes only; no numeric kernels.
"""

from __future__ import annotations

from gguf import MODEL_ARCH

from ..types import GGUFError
from .base import ROPE_NEOX, HParams
from .llama import Llama


class Qwen3(Llama):
    name = "qwen3"
    gguf_arch = MODEL_ARCH.QWEN3
    rope_type = ROPE_NEOX
    rope_scalings = ("none", "linear")
    qk_norm = True

    def check(self, p: HParams) -> None:
        # llama.cpp asserts n_embd_head_k == n_embd_head_v == n_rot; n_embd need not be H*D
        if not p.head_dim == p.head_dim_v == p.n_rot:
            raise GGUFError(f"qwen3 needs key_length == value_length == rope.dimension_count "
                            f"(got {p.head_dim}, {p.head_dim_v}, {p.n_rot})")  # fmt: skip


ARCH = Qwen3()
