"""Streaming generation and llama-perplexity's evaluation protocol (llama.cpp's
tools/completion's loop, `common_sampler`, tools/perplexity's `perplexity()`).

`stream()` is a generator of small dataclasses, one per generated token, whose `text` never holds
half a UTF-8 character; `generate()` joins it. It is a client of the serving engine
(`engine.py`) with one slot over the whole context, so `run`, the Python API and `serve` share
one decoding loop. `perplexity_chunks()` evaluates a token stream the
way llama-perplexity does and yields each chunk's scored positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .context import Context
from .engine import Engine, Request
from .model.constrain import ConstraintSpec
from .model.sampler import SamplingParams
from .speculative import Drafter
from .types import LlamapyError


@dataclass(frozen=True)
class Chunk:
    """One generated token."""

    token: int
    text: str  # complete UTF-8 text this token finished (may be "")
    index: int  # 0-based position among the generated tokens


@dataclass
class Timings:
    """llama.cpp's `llama_perf_context_print` figures."""

    load_ms: float = 0.0
    prompt_ms: float = 0.0
    n_prompt: int = 0
    eval_ms: float = 0.0
    n_eval: int = 0
    sample_ms: float = 0.0
    n_sample: int = 0
    n_drafted: int = 0  # speculative decoding: tokens guessed, and of them kept
    n_accepted: int = 0


@dataclass
class GenerationResult:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    # "stop" (end of generation, or a complete grammar), "length" (-n), "context" (full),
    # "grammar_dead_end" (the constraint allows no token; `error` says why)
    finish_reason: str = ""
    error: str = ""
    timings: Timings = field(default_factory=Timings)


def check_n_predict(n_predict: int) -> None:
    if n_predict < -2:
        raise LlamapyError(f"-n {n_predict}: use -1 (until end of generation), -2 (until the context is full) or N >= 0")


def stream(
    ctx: Context,
    prompt_tokens: Sequence[int],
    n_predict: int = -1,
    sampling: SamplingParams | None = None,
    result: GenerationResult | None = None,
    seq: int = 0,
    cached: Sequence[int] = (),
    special: bool = False,
    constraint: ConstraintSpec | None = None,
    draft: Drafter | None = None,
) -> Iterator[Chunk]:
    """Evaluate the prompt, then sample until an end-of-generation token, `n_predict` tokens
    (-1: no limit, -2: until the context is full) or a full context.

    `result`, when given, receives the finish reason, tokens and timings as they happen.
    `cached` lists the tokens sequence `seq` already holds in the KV cache (a conversation's
    earlier turns): only what follows their common prefix with the prompt is evaluated.
    `special`: special tokens are rendered as their text (llama.cpp's --special).
    `constraint`: a grammar / JSON schema the output must match (ConstraintError before anything
    is evaluated when it is invalid).
    `draft`: speculative decoding's drafter (speculative.py).
    """
    check_n_predict(n_predict)
    res = result if result is not None else GenerationResult()
    res.timings.load_ms = ctx.model.info.load_ms
    if len(prompt_tokens) == 0:
        raise LlamapyError("the prompt is empty (no tokens to evaluate)")
    if len(prompt_tokens) > ctx.n_ctx:
        raise LlamapyError(f"the prompt is {len(prompt_tokens)} tokens, longer than the context (-c {ctx.n_ctx})")
    # one slot over the whole context, decoding as sequence `seq`: the serving engine's loop,
    # driven from this thread
    engine = Engine(ctx, n_parallel=1, n_ctx_slot=ctx.n_ctx, first_seq=seq, draft=draft)
    engine.assume_cached(0, cached)
    max_tokens = n_predict if n_predict >= 0 else -1  # -1 and -2: until the end or a full context
    req = Request([int(t) for t in prompt_tokens], max_tokens, sampling or SamplingParams(), special=special,
                  constraint=constraint)  # fmt: skip
    engine.compiled(req)  # an invalid constraint fails before the prompt is evaluated
    for ev in engine.generate(req):
        if ev.kind == "token":
            res.tokens.append(ev.token)
            res.text += ev.text
            yield Chunk(ev.token, ev.text, ev.index)
            continue
        t = ev.timings
        if ev.finish_reason == "error" or t is None:
            raise LlamapyError(ev.error or "generation failed")
        res.finish_reason = ev.finish_reason or ""
        res.error = ev.error or ""
        res.timings.prompt_ms = t.prompt_ms
        res.timings.n_prompt = t.prompt_n
        res.timings.sample_ms = t.sample_ms
        res.timings.n_sample = len(res.tokens) + (ev.finish_reason == "stop")
        res.timings.eval_ms = max(0.0, t.predicted_ms - t.sample_ms)
        res.timings.n_eval = t.n_eval
        res.timings.n_drafted, res.timings.n_accepted = t.draft_n, t.draft_n_accepted
        if ev.text:
            res.text += ev.text
            yield Chunk(res.tokens[-1] if res.tokens else -1, ev.text, len(res.tokens))


def generate(
    ctx: Context,
    prompt_tokens: Sequence[int],
    n_predict: int = -1,
    sampling: SamplingParams | None = None,
    constraint: ConstraintSpec | None = None,
    draft: Drafter | None = None,
) -> GenerationResult:
    res = GenerationResult()
    for _ in stream(ctx, prompt_tokens, n_predict, sampling, res, constraint=constraint, draft=draft):
        pass
    return res


# -- llama-perplexity's protocol -------------------------------------------------------------


@dataclass
class PerplexityChunk:
    index: int  # chunk number, 0-based
    tokens: np.ndarray  # the chunk's n_ctx tokens as in the text (before any BOS overwrite)
    logits: np.ndarray  # (n_ctx - 1 - n_ctx/2, n_vocab): predictions for positions first+1 ...
    nll: np.ndarray  # negative log-likelihood of each scored token


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity_chunks(
    ctx: Context,
    tokens: Sequence[int] | np.ndarray,
    n_chunks: int = -1,
    n_batch: int | None = None,
    first_chunk: int = 0,
    n_ctx: int | None = None,
) -> Iterator[PerplexityChunk]:
    """Evaluate `tokens` as llama-perplexity does with chunks of `n_ctx` tokens (default: the
    context's n_ctx; the context must hold `n_seq * n_ctx` cells):

    non-overlapping chunks of n_ctx tokens; when the model adds BOS, the first token of every
    chunk is *overwritten* with BOS while evaluating; the KV cache is cleared per group; only the
    positions after n_ctx/2 are scored; `max(1, n_batch // n_ctx)` chunks run at once as separate
    sequences of one batch.
    """
    toks = np.asarray(tokens, np.int32)
    n_ctx = ctx.n_ctx if n_ctx is None else n_ctx
    if n_ctx <= 0 or n_ctx > ctx.n_ctx:
        raise LlamapyError(f"perplexity chunks of {n_ctx} tokens need 0 < n_ctx <= the context's {ctx.n_ctx}")
    if len(toks) < 2 * n_ctx:
        raise LlamapyError(
            f"need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}, "
            f"the text has {len(toks)}"
        )
    n_chunk_max = len(toks) // n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(n_chunks, n_chunk_max)
    n_batch = n_batch or ctx.n_batch
    n_seq = max(1, min(n_batch // n_ctx, ctx.n_ctx // n_ctx))  # as many chunks as the cache holds
    tokenizer = ctx.model.tokenizer
    first = n_ctx // 2
    for i in range(first_chunk, n_chunk, n_seq):
        n_seq_batch = min(n_seq, n_chunk - i)
        ctx.kv.clear()
        batch_toks, batch_pos, batch_seq, want = [], [], [], []
        for s in range(n_seq_batch):
            chunk = toks[(i + s) * n_ctx : (i + s + 1) * n_ctx].copy()
            if tokenizer.add_bos:
                chunk[0] = tokenizer.bos
            batch_toks.append(chunk)
            batch_pos.append(np.arange(n_ctx))
            batch_seq.append(np.full(n_ctx, s))
            want.append(np.arange(n_ctx) >= first)
        # llama.cpp feeds the group in batches of n_batch tokens (split into ubatches inside)
        all_t = np.concatenate(batch_toks)
        all_p = np.concatenate(batch_pos)
        all_s = np.concatenate(batch_seq)
        all_w = np.concatenate(want)
        out = []
        step = max(n_batch, 1)
        for b0 in range(0, len(all_t), step):
            b1 = min(len(all_t), b0 + step)
            if all_w[b0:b1].any():
                out.append(ctx.decode(all_t[b0:b1], all_p[b0:b1], all_s[b0:b1], all_w[b0:b1]))
            else:
                ctx.decode(all_t[b0:b1], all_p[b0:b1], all_s[b0:b1], all_w[b0:b1])
        logits = np.concatenate(out)  # (n_seq_batch * (n_ctx - first), n_vocab)
        per = n_ctx - first
        for s in range(n_seq_batch):
            lg = logits[s * per : s * per + per - 1]  # positions first .. n_ctx-2 predict the next
            orig = toks[(i + s) * n_ctx : (i + s + 1) * n_ctx]
            target = orig[first + 1 :]
            nll = -log_softmax(lg)[np.arange(len(target)), target]
            yield PerplexityChunk(i + s, orig, lg, nll)
