"""The Python API: one object that loads a model and tokenizes, streams, scores and evaluates
(the role of llama.cpp's `common` helpers and llama-cpp-python's `Llama`). The CLI is a thin
layer over it.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .context import Context, ContextOptions, Model, ModelOptions
from .generate import (
    Chunk,
    GenerationResult,
    PerplexityChunk,
    check_n_predict,
    generate,
    perplexity_chunks,
    stream,
)
from .model.constrain import ConstraintError, ConstraintSpec, compile_constraint, response_format_spec
from .model.sampler import SamplingParams
from .speculative import CallableDrafter, Drafter, ModelDrafter, NgramDrafter, SpecParams, check_vocab_compatible
from .types import ContextFullError, LlamapyError


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
        embedding: bool = False,  # llama-cpp-python's switch: every Llama here embeds, so it changes nothing
        lora_path: str | os.PathLike[str] | None = None,  # llama-cpp-python's: one LoRA adapter
        lora_scale: float = 1.0,
        # speculative decoding: llama-cpp-python's draft model (LlamaPromptLookupDecoding(...) or any
        # callable of the ids), a speculative.Drafter, or a draft GGUF's path (llama.cpp's -md)
        draft_model: Any = None,
        spec: SpecParams | None = None,  # with a draft GGUF: n_max, n_min, p_min
        draft_n_gpu_layers: int | str | None = None,  # with a draft GGUF (-ngld); None: as the model
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
        if lora_path is not None:
            mo.lora = [*mo.lora, (str(lora_path), float(lora_scale))]
        _check_options(mo, co)
        self.path = Path(model_path)
        self._model: Model | None = None
        self._ctx: Context | None = None
        self._serving_engine = None  # the create_* methods' one-slot engine, made on first use
        self.draft: Drafter | None = None  # speculative decoding's drafter (set_draft)
        self._model = Model(self.path, mo, co)
        try:
            self._ctx = Context(self._model, co)
            if draft_model is not None or (spec is not None and spec.type != "none"):
                self.set_draft(draft_model, spec, mo.n_gpu_layers if draft_n_gpu_layers is None else draft_n_gpu_layers)
        except BaseException:
            self.close()
            raise

    # every entry point goes through these two: after close() they raise one clear error
    @property
    def model(self) -> Model:
        if self._model is None:
            raise LlamapyError("this Llama is closed (close() was called); load the model again")
        return self._model

    @property
    def ctx(self) -> Context:
        if self._ctx is None:
            raise LlamapyError("this Llama is closed (close() was called); load the model again")
        return self._ctx

    @property
    def closed(self) -> bool:
        return self._model is None

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer, imported lazily by Model
        return self.model.tokenizer

    def close(self) -> None:
        """Free every buffer (device memory included) and unmap the model and cache files.
        Idempotent; any later call raises LlamapyError. Garbage collection of an unclosed
        Llama releases the same memory (the mappings go with their last view)."""
        ctx, model, draft = self._ctx, self._model, self.draft
        self._ctx = self._model = self._serving_engine = self.draft = None
        if draft is not None:
            draft.close()
        if ctx is not None:
            ctx.free()
        if model is not None:
            model.free()

    def set_draft(self, draft_model: Any = None, spec: SpecParams | None = None, n_gpu_layers: int | str = 0) -> None:
        """Decode speculatively from now on (see __init__'s `draft_model`; None with `spec.type`
        "ngram-simple": llama.cpp's n-gram drafter), or, with neither, not at all. A draft GGUF
        is loaded with this context's options and must share the vocabulary."""
        spec = spec or SpecParams(type="draft-simple" if isinstance(draft_model, (str, os.PathLike)) else "none")
        spec.check()
        old, self.draft, self._serving_engine = self.draft, None, None
        if old is not None:
            old.close()
        if isinstance(draft_model, (str, os.PathLike)):
            if spec.type != "draft-simple":
                raise LlamapyError(f"--spec-type {spec.type}: a draft model (-md) drafts with draft-simple")
            draft = Llama(draft_model, context_options=dataclasses.replace(self.ctx.options, n_ctx=self.ctx.n_ctx),
                          n_gpu_layers=n_gpu_layers)  # fmt: skip
            try:
                check_vocab_compatible(self.tokenizer, draft.tokenizer)
            except BaseException:
                draft.close()
                raise
            self.draft = ModelDrafter(draft.ctx, spec.n_max, spec.n_min, spec.p_min, self.model.params.n_vocab, owner=draft)
        elif draft_model is not None:
            if spec.type not in ("none", "draft-simple"):
                raise LlamapyError(f"--spec-type {spec.type} and a draft model: give one")
            self.draft = draft_model if hasattr(draft_model, "draft") else CallableDrafter(draft_model, self.model.params.n_vocab)
        elif spec.type == "ngram-simple":
            self.draft = NgramDrafter(spec.ngram_n, spec.ngram_m)
        elif spec.type == "draft-simple":
            raise LlamapyError("--spec-type draft-simple needs a draft model (-md FNAME)")

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise LlamapyError(f"tokenize: the text must be a str, not {type(text).__name__}")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(self._ids(tokens, "detokenize"))

    def _ids(self, tokens: Sequence[int], what: str) -> list[int]:
        """Token ids given by the caller, as ints in the vocabulary's range."""
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
            raise LlamapyError(f"{what}: expected a sequence of token ids, not {type(tokens).__name__}")
        try:
            ids = [operator.index(t) for t in tokens]
        except TypeError:
            raise LlamapyError(f"{what}: token ids must be integers") from None
        n_vocab = self.model.params.n_vocab
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise LlamapyError(f"{what}: token id {bad} out of range [0, {n_vocab})")
        return ids

    def _tokens(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenize(prompt) if isinstance(prompt, str) else self._ids(prompt, "prompt")

    # -- generation -------------------------------------------------------------------------

    def stream(
        self,
        prompt: str | Sequence[int],
        n_predict: int = -1,
        result: GenerationResult | None = None,
        constraint: ConstraintSpec | None = None,
        **sampling: float | int,
    ) -> Iterator[Chunk]:
        """Yield one Chunk per generated token. `sampling` takes SamplingParams' fields;
        `constraint` a grammar / JSON schema the text must match (model/constrain.py).
        Bad arguments (and a closed Llama) raise here, not at the first chunk."""
        ctx = self.ctx
        check_n_predict(n_predict)
        if constraint is not None:
            compile_constraint(constraint, self.tokenizer)  # an invalid one raises now (then cached)
        return stream(ctx, self._tokens(prompt), n_predict, SamplingParams(**sampling), result,  # type: ignore[arg-type]
                      constraint=constraint, draft=self.draft)  # fmt: skip

    def generate(
        self,
        prompt: str | Sequence[int],
        n_predict: int = -1,
        constraint: ConstraintSpec | None = None,
        **sampling: float | int,
    ) -> GenerationResult:
        return generate(self.ctx, self._tokens(prompt), n_predict, SamplingParams(**sampling), constraint,  # type: ignore[arg-type]
                        draft=self.draft)  # fmt: skip

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
        """Logits (n_tokens, n_vocab) of every position of `tokens`, evaluated from position 0
        as sequence `seq` (replacing what that sequence held). When the context has no room
        for them, ContextFullError is raised and the KV cache is left as it was."""
        ids = self._ids(tokens, "logits")
        ctx = self.ctx
        seq = _check_seq(seq)
        n = len(ids)
        if n == 0:
            raise LlamapyError("logits: no tokens to evaluate")
        room = int(((ctx.kv.pos < 0) | (ctx.kv.seq == seq)).sum())  # free cells + this sequence's
        if n > room:
            raise ContextFullError(
                f"the context is full: {n} tokens do not fit in the {room} cells free for sequence {seq} "
                f"(-c {ctx.n_ctx}, {ctx.kv.n_used()} used)"
            )
        ctx.kv.seq_rm(seq)
        return ctx.decode(ids, np.arange(n), seq, np.ones(n, bool))

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

    # -- embeddings -----------------------------------------------------------------------------

    def embed(
        self, input: str | Sequence[int] | list[str] | list[Sequence[int]], pooling: str | None = None,  # noqa: A002
        normalize: bool | int = False,
    ) -> list:
        """llama-cpp-python's Llama.embed: the embedding of a text or token list (a list of floats),
        or of each in a list (a list of those). `pooling`: none, mean, cls, last or rank (default:
        the model's `pooling_type`); `none` gives every token's row (a list of lists a text),
        `rank` a reranker's scores (one per label, not normalised; see rerank()).
        `normalize`: True for euclidean, or llama.cpp's --embd-normalize number (-1 none, 0 int16
        range, 1 taxicab, 2 euclidean, p > 2 the p-norm); with pooling none, rows are not scaled.
        The KV cache is cleared (as llama-cpp-python's embed does): a generation's state is lost."""
        from .embedding import embed, pooling_name

        single = isinstance(input, str) or (isinstance(input, (Sequence, np.ndarray)) and len(input) > 0
                                            and not isinstance(input[0], (str, Sequence, np.ndarray)))  # fmt: skip
        items = [input] if single else list(input)  # type: ignore[list-item]
        norm = 2 if normalize is True else -1 if normalize is False else int(normalize)
        vecs = embed(self.ctx, [self._tokens(x) for x in items], pooling_name(pooling, self.model), norm)
        out = [v.tolist() for v in vecs]
        return out[0] if single else out

    def create_embedding(
        self, input: str | Sequence[int] | list[str] | list[Sequence[int]], model: str | None = None,  # noqa: A002
        pooling: str | None = None, encoding_format: str = "float",
    ) -> dict:
        """llama-cpp-python's Llama.create_embedding: OpenAI's `list` of embeddings, euclidean
        normalised as OpenAI's and llama-server's are (cosine similarity is their dot product)."""
        from .embedding import embed, pooling_name
        from .server.protocol import embedding_request, embeddings_response

        pool = pooling_name(pooling, self.model)
        if pool == "none":
            raise LlamapyError("create_embedding: pooling 'none' gives no single embedding a text; use embed()")
        body = {"input": input if isinstance(input, str) else list(input), "encoding_format": encoding_format}
        req = embedding_request(body, self.tokenizer, True, 2)
        return embeddings_response(embed(self.ctx, req.prompts, pool, 2), req, model or str(self.path))

    def rerank(self, query: str, documents: Sequence[str]) -> list[float]:
        """A reranker's score of each document for the query (pooling rank: the file's
        classifier head; Qwen3-Reranker's probability of "yes"), in the documents' order: the
        prompt and the score llama-server's /v1/rerank makes. The KV cache is cleared."""
        from .embedding import embed, pooling_name, rerank_tokens

        if not isinstance(query, str) or isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
            raise LlamapyError("rerank: the query is a string and the documents a list of strings")
        pooling_name("rank", self.model)
        prompts = [rerank_tokens(self.model, query, d) for d in documents]
        return [float(v[0]) for v in embed(self.ctx, prompts, "rank", -1)]

    # -- llama-cpp-python's OpenAI-shaped API -------------------------------------------------

    def _engine(self):  # noqa: ANN202 - engine.Engine, imported lazily
        """One slot over this context: the create_* methods decode through the serving engine,
        in the caller's thread, with its prompt cache (dropped when stream/generate/logits touch
        the cache in between)."""
        eng = self._serving_engine
        if eng is None:
            from .engine import Engine

            eng = self._serving_engine = Engine(self.ctx, n_parallel=1, draft=self.draft)
        eng.lora = self.ctx.lora_scales  # what ctx.set_lora_scales last said
        return eng

    def _openai_run(self, parsed, kind: str, constraint: ConstraintSpec | None = None):  # noqa: ANN001, ANN202
        from .server.protocol import Responder

        r = Responder(kind, parsed.model or str(self.path), self.tokenizer, parsed.syntax)
        if constraint is not None:  # (else what the protocol's parser set, if anything: tools, response_format)
            parsed.request.constraint = constraint
        self._engine().compiled(parsed.request)  # an invalid grammar raises now, streaming or not
        events = self._engine().generate(parsed.request)
        if not parsed.stream:
            evs = list(events)
            if evs[-1].finish_reason == "error":
                from .types import LlamapyError

                raise LlamapyError(evs[-1].error or "generation failed")
            return r.response(evs)
        return self._openai_chunks(r, events, parsed.include_usage)

    @staticmethod
    def _openai_chunks(r, events, include_usage: bool) -> Iterator[dict]:  # noqa: ANN001
        from .types import LlamapyError

        yield from r.start_chunks()
        for ev in events:
            if ev.kind == "token":
                yield from r.token_chunks(ev)
            elif ev.finish_reason == "error":
                raise LlamapyError(ev.error or "generation failed")
            else:
                yield from r.end_chunks(ev, include_usage)

    def create_completion(
        self,
        prompt: str | list[int],
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        min_p: float = 0.05,
        top_k: int = 40,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        logprobs: int | None = None,
        stream: bool = False,
        grammar: str | None = None,
        response_format: dict | None = None,
        **unsupported: object,
    ) -> dict | Iterator[dict]:
        """llama-cpp-python's Llama.create_completion: an OpenAI `text_completion` dict, or with
        stream=True an iterator of its chunks. `max_tokens` None or <= 0: until end of generation
        or a full context. `grammar` (GBNF text) or `response_format` ({"type": "json_object"},
        {"type": "json_schema", "json_schema": {"schema": ...}}) constrain the text; an invalid
        one raises ConstraintError. Parameters llamapy does not support (suffix, echo,
        mirostat_mode, …) raise LlamapyError when given a non-default value."""
        body = _body(locals(), unsupported)
        from .server.protocol import completion_request

        if max_tokens is None or max_tokens <= 0:
            body.pop("max_tokens", None)
        spec = _constraint(body)
        return self._openai_run(completion_request(body, self.tokenizer), "completion", spec)

    def create_chat_completion(
        self,
        messages: list[dict],
        max_tokens: int | None = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        min_p: float = 0.05,
        top_k: int = 40,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        stream: bool = False,
        grammar: str | None = None,
        response_format: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict | None = None,
        **unsupported: object,
    ) -> dict | Iterator[dict]:
        """llama-cpp-python's Llama.create_chat_completion: the GGUF's chat template (sandboxed),
        an OpenAI `chat.completion` dict or with stream=True an iterator of its chunks.
        `grammar` / `response_format` constrain the reply as in create_completion; `tools` and
        `tool_choice` as OpenAI's (the reply's `tool_calls`, a required call forced by a grammar).
        `reasoning_effort` (low, medium, high: gpt-oss) and `chat_template_kwargs` are variables of
        the template's render, as llama-server takes them; one the template does not use is refused."""
        body = _body(locals(), unsupported)
        from .server.protocol import ChatTemplate, chat_request

        if max_tokens is None or max_tokens <= 0:
            body.pop("max_tokens", None)
        return self._openai_run(chat_request(body, self.tokenizer, ChatTemplate.of(self.model)), "chat")


# llama-cpp-python parameters that mean "off" at these values are accepted and dropped
_OFF = {"suffix": None, "echo": False, "logit_bias": None, "functions": None, "function_call": None,
        "n": 1,
        "typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0, "logits_processor": None,
        "stopping_criteria": None, "model": None, "best_of": None}  # fmt: skip


def _body(args: dict, unsupported: dict) -> dict:
    body = {k: v for k, v in args.items() if k not in ("self", "unsupported") and v is not None}
    if unsupported.get("mirostat_mode"):  # llama-cpp-python's name of llama-server's "mirostat"
        unsupported = dict(unsupported)
        body["mirostat"] = unsupported.pop("mirostat_mode")
    for k, v in unsupported.items():
        if k not in _OFF or v != _OFF[k]:
            body[k] = v  # rejected by the protocol's field check, with the reason
    if body.get("stream") is False:
        body.pop("stream")
    if body.get("logprobs") is False:
        body.pop("logprobs")
    return body


def _constraint(body: dict) -> ConstraintSpec | None:
    """`grammar` (GBNF text, as llama-cpp-python's LlamaGrammar.from_string takes it) or
    `response_format`, taken out of the body the protocol parses; not both."""
    grammar, rf = body.pop("grammar", None), body.pop("response_format", None)
    if grammar is not None and rf is not None:
        raise ConstraintError("give either grammar or response_format, not both")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise ConstraintError(f"grammar must be GBNF text (a str), not {type(grammar).__name__}")
        return ConstraintSpec("gbnf", grammar)
    return response_format_spec(rf) if rf is not None else None


def _check_seq(seq: object) -> int:
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 0:
        raise LlamapyError(f"seq {seq!r}: a sequence id must be an integer >= 0")
    return int(seq)


def _check_options(mo: ModelOptions, co: ContextOptions) -> None:
    """The checks the CLI makes on -ngl, -c, -b, -ub, -t, for callers of the library."""
    ngl = mo.n_gpu_layers
    if isinstance(ngl, bool) or not (isinstance(ngl, (int, np.integer)) or ngl in ("all", "auto")):
        raise LlamapyError(f"n_gpu_layers {ngl!r}: expected a number, 'all' or 'auto'")
    if co.n_ctx < 0:
        raise LlamapyError(f"n_ctx {co.n_ctx}: the context size must be >= 0 (0 = the model's)")
    if co.n_batch <= 0 or co.n_ubatch <= 0:
        raise LlamapyError(f"n_batch {co.n_batch}, n_ubatch {co.n_ubatch}: batch sizes must be positive")
    if co.n_threads < 0:
        raise LlamapyError(f"n_threads {co.n_threads}: must be >= 0 (0 = every core)")
