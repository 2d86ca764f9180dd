"""qwen2 (llama.cpp's src/models/qwen2.cpp): llama's block with Q/K/V biases and NEOX rope;
the output matrix tied to the embedding or not.

Graph nodes only; no numeric kernels.
"""

from __future__ import annotations

from gguf import MODEL_ARCH

from .base import ROPE_NEOX
from .llama import Llama


class Qwen2(Llama):
    name = "qwen2"
    gguf_arch = MODEL_ARCH.QWEN2
    rope_type = ROPE_NEOX
    rope_scalings = ("none", "linear")
    qkv_bias = True


ARCH = Qwen2()
