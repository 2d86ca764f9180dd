"""The Python API: one object that loads a model and tokenizes, streams, scores and evaluates
(the role of llama.cpp's `common` helpers and llama-cpp-python's `Llama`). The CLI is a thin
layer over it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .context import Context, ContextOptions, Model, ModelOptions
from .generate import Chunk, GenerationResult, PerplexityChunk, generate, perplexity_chunks, stream
from .model.sampler import SamplingParams


class Llama:
    """A model and one context over it.

    >>> llm = Llama("model.gguf", n_ctx=512)
    >>> for chunk in llm.stream("The capital of France is", n_predict=8, temp=0):
    ...     print(chunk.text, end="")
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        model_options: ModelOptions | None = None,
        context_options: ContextOptions | None = None,
        n_gpu_layers: int | str | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        cpu_matmul: str | None = None,
    ) -> None:
        if model_path is None:
            from .model.fetch import default_model_path

            model_path = default_model_path()
        mo = model_options or ModelOptions()
        if n_gpu_layers is not None:
            mo.n_gpu_layers = n_gpu_layers
        co = context_options or ContextOptions()
        if n_ctx is not None:
            co.n_ctx = n_ctx
        if n_threads is not None:
            co.n_threads = n_threads
        if cpu_matmul is not None:
            co.cpu_matmul = cpu_matmul
        self.path = Path(model_path)
        self.model = Model(self.path, mo, co)
        try:
            self.ctx = Context(self.model, co)
        except BaseException:
            self.model.free()
            raise

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer, imported lazily by Model
        return self.model.tokenizer

    def close(self) -> None:
        """Free every buffer (device memory included)."""
        self.ctx.free()
        self.model.free()

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _tokens(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    # -- generation -------------------------------------------------------------------------

    def stream(
        self,
        prompt: str | Sequence[int],
        n_predict: int = -1,
        result: GenerationResult | None = None,
        **sampling: float | int,
    ) -> Iterator[Chunk]:
        """Yield one Chunk per generated token. `sampling` takes SamplingParams' fields."""
        yield from stream(self.ctx, self._tokens(prompt), n_predict, SamplingParams(**sampling), result)  # type: ignore[arg-type]

    def generate(self, prompt: str | Sequence[int], n_predict: int = -1, **sampling: float | int) -> GenerationResult:
        return generate(self.ctx, self._tokens(prompt), n_predict, SamplingParams(**sampling))  # type: ignore[arg-type]

    def warmup(self) -> float:
        """One throw-away decode, then an empty cache (llama.cpp's common_init warm-up run): the
        first call loads the compiled kernels, so later timings measure only the model.
        Returns its milliseconds."""
        t0 = time.perf_counter()
        tok = self.tokenizer.bos if self.tokenizer.bos is not None else 0
        self.ctx.decode([tok], [0], 0)
        self.ctx.kv.clear()
        return (time.perf_counter() - t0) * 1e3

    # -- scoring ----------------------------------------------------------------------------

    def logits(self, tokens: Sequence[int], seq: int = 0) -> np.ndarray:
        """Logits (n_tokens, n_vocab) of every position of `tokens`, evaluated from position 0."""
        self.ctx.kv.seq_rm(seq)
        n = len(tokens)
        return self.ctx.decode(tokens, np.arange(n), seq, np.ones(n, bool))

    def perplexity(
        self,
        tokens: Sequence[int] | np.ndarray,
        n_chunks: int = -1,
        n_batch: int | None = None,
        n_ctx: int | None = None,
    ) -> Iterator[PerplexityChunk]:
        """llama-perplexity's protocol with chunks of `n_ctx` tokens (default: the context's);
        see generate.perplexity_chunks."""
        return perplexity_chunks(self.ctx, tokens, n_chunks, n_batch, n_ctx=n_ctx)
