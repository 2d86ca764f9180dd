"""llamapy: llama.cpp's inference stack rebuilt in Python (GGUF loader, a small ggml, backends,
scheduler, llama graph, CLI).

    >>> import llamapy
    >>> llm = llamapy.Llama("model.gguf")            # or Llama() for the default model
    >>> print(llm.generate("Hello", n_predict=16, temp=0).text)
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import Llama
from .context import Context, ContextOptions, Model, ModelOptions
from .generate import Chunk, GenerationResult, generate, perplexity_chunks, stream
from .model.constrain import ConstraintError, ConstraintSpec
from .speculative import LlamaPromptLookupDecoding, SpecParams
from .types import GGMLType, LlamapyError

__all__ = [
    "Llama", "Model", "Context", "ModelOptions", "ContextOptions", "Chunk", "GenerationResult",
    "generate", "stream", "perplexity_chunks", "GGMLType", "LlamapyError", "ConstraintSpec", "ConstraintError",
    "LlamaPromptLookupDecoding", "SpecParams", "__version__",
]  # fmt: skip
