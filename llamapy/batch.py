"""Parallel decoding of many prompts over one context (llama.cpp's tools/batched and
tools/parallel, with continuous batching as in tools/parallel's `-cb`).

`n_parallel` slots share the context's unified KV cache: slot `s` decodes as sequence id `s`, and
each slot may use `n_ctx // n_parallel` cells, as llama-parallel sizes them. Every step builds ONE
batch holding the whole prompt of each sequence admitted at this step plus the last sampled token
of each sequence still generating; logits are asked for only at the last prompt token of a new
sequence and at every generating token. When a sequence ends — an end-of-generation token
(`stop`), its `n_predict` (`length`) or a full slot (`context`) — its cells are dropped
(`seq_rm`) and the next prompt takes the slot at the next step.

`run_batch()` yields one `BatchRecord` per prompt as it finishes (completion order, not input
order). A prompt that cannot run (no tokens, longer than a slot) yields an error record and the
rest carry on. Library code: nothing here prints.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .context import Context
from .generate import check_n_predict
from .model.sampler import Sampler, SamplingParams
from .types import LlamapyError

__all__ = ["BatchRecord", "BatchRequest", "BatchStats", "run_batch"]


@dataclass
class BatchRequest:
    """One prompt and its own overrides of the batch-wide settings (None: use the batch's)."""

    prompt: str | Sequence[int]
    n_predict: int | None = None
    temp: float | None = None
    seed: int | None = None
    id: Any = None
    index: int | None = None  # default: the request's position in the input


@dataclass
class BatchRecord:
    """What became of one prompt. `error` is set (and the generation fields empty) when the prompt
    could not run."""

    index: int
    id: Any
    prompt: str | list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    n_prompt_tokens: int = 0
    n_tokens: int = 0
    finish_reason: str = ""  # "stop", "length", "context"; "" with an error
    error: str | None = None
    prompt_ms: float = 0.0  # wall time of the step(s) that evaluated this prompt
    predicted_ms: float = 0.0  # from the first sampled token to the end
    seed: int | None = None  # the sampler's seed (the one drawn, when random)

    def to_dict(self) -> dict[str, Any]:
        """The JSONL record (llama-server's timing names)."""
        if self.error is not None:
            return {"index": self.index, "id": self.id, "prompt": self.prompt, "error": self.error}
        n_gen = self.n_tokens
        return {
            "index": self.index,
            "id": self.id,
            "prompt": self.prompt,
            "text": self.text,
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_tokens": n_gen,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "timings": {
                "prompt_n": self.n_prompt_tokens,
                "prompt_ms": round(self.prompt_ms, 3),
                "prompt_per_second": round(_rate(self.n_prompt_tokens, self.prompt_ms), 3),
                "predicted_n": n_gen,
                "predicted_ms": round(self.predicted_ms, 3),
                "predicted_per_second": round(_rate(n_gen, self.predicted_ms), 3),
                "total_ms": round(self.prompt_ms + self.predicted_ms, 3),
            },
        }


@dataclass
class BatchStats:
    """Totals of one `run_batch` call, filled in as it runs."""

    n_steps: int = 0  # batches decoded
    n_prompt_tokens: int = 0
    n_gen_tokens: int = 0
    decode_ms: float = 0.0
    wall_ms: float = 0.0
    max_batch: int = 0  # largest batch built in one step


def _rate(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


@dataclass
class _Slot:
    """A sequence being decoded."""

    seq: int
    rec: BatchRecord
    sampler: Sampler
    decoder: Any
    n_predict: int
    n_past: int = 0
    pending: int = -1  # the token to evaluate at the next step (-1: the prompt is pending)
    prompt_tokens: list[int] = field(default_factory=list)
    t_first: float = 0.0


def _as_request(item: BatchRequest | str | Sequence[int], i: int) -> BatchRequest:
    if isinstance(item, BatchRequest):
        return item if item.index is not None else replace(item, index=i)
    return BatchRequest(prompt=item, index=i)  # type: ignore[arg-type]


def run_batch(
    ctx: Context,
    requests: Iterable[BatchRequest | str | Sequence[int]],
    n_parallel: int = 8,
    n_predict: int = -1,
    sampling: SamplingParams | None = None,
    stats: BatchStats | None = None,
) -> Iterator[BatchRecord]:
    """Decode `requests` as up to `n_parallel` parallel sequences of `ctx`; yield a record for each
    as it finishes. `requests` is consumed lazily, one item whenever a slot is free.

    `n_predict` and `sampling` are the defaults; a BatchRequest's `n_predict`, `temp` and `seed`
    override them for that prompt. -1 (and -2) generate until end of generation or a full slot.
    """
    if n_parallel < 1:
        raise LlamapyError(f"-np {n_parallel}: the number of parallel sequences must be >= 1")
    check_n_predict(n_predict)
    n_slot = ctx.n_ctx // n_parallel
    if n_slot < 1:
        raise LlamapyError(f"-c {ctx.n_ctx} is too small for -np {n_parallel}: each sequence needs cells")
    base = sampling or SamplingParams()
    tok = ctx.model.tokenizer
    eog = tok.eog_ids
    st = stats if stats is not None else BatchStats()
    t_start = time.perf_counter()
    it = iter(requests)
    exhausted = False
    free_seqs = list(range(n_parallel - 1, -1, -1))  # pop() hands out 0 first
    active: list[_Slot] = []
    counter = 0

    def admit(req: BatchRequest) -> _Slot | BatchRecord:
        prompt = req.prompt if isinstance(req.prompt, str) else [int(t) for t in req.prompt]
        rec = BatchRecord(index=int(req.index or 0), id=req.id if req.id is not None else req.index, prompt=prompt)
        try:
            npred = n_predict if req.n_predict is None else int(req.n_predict)
            check_n_predict(npred)
            params = base
            if req.temp is not None:
                params = replace(params, temp=float(req.temp))
            if req.seed is not None:
                params = replace(params, seed=int(req.seed))
            toks = tok.encode(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) else prompt
            if not toks:
                raise LlamapyError("the prompt is empty (no tokens to evaluate)")
            if len(toks) > n_slot:
                raise LlamapyError(
                    f"the prompt is {len(toks)} tokens, longer than a sequence's share of the context "
                    f"({n_slot} cells = -c {ctx.n_ctx} // -np {n_parallel})"
                )
            if min(toks) < 0 or max(toks) >= ctx.model.params.n_vocab:
                raise LlamapyError(f"token id out of range [0, {ctx.model.params.n_vocab})")
        except LlamapyError as e:
            rec.error = str(e)
            return rec
        except (TypeError, ValueError) as e:
            rec.error = f"invalid request: {e}"
            return rec
        sampler = Sampler(params)
        for t in toks:
            sampler.accept(t)
        rec.seed = sampler.seed
        rec.n_prompt_tokens = len(toks)
        seq = free_seqs.pop()
        ctx.kv.seq_rm(seq)
        return _Slot(seq, rec, sampler, tok.stream_decoder(), npred, prompt_tokens=list(toks))

    def finish(slot: _Slot, reason: str, now: float) -> BatchRecord:
        rec = slot.rec
        rec.finish_reason = reason
        tail = slot.decoder.flush()
        if tail:
            rec.text += tail
        rec.n_tokens = len(rec.tokens)
        rec.predicted_ms = (now - slot.t_first) * 1e3 if slot.t_first else 0.0
        ctx.kv.seq_rm(slot.seq)
        free_seqs.append(slot.seq)
        return rec

    try:
        while True:
            # -- admit prompts into the free slots -----------------------------------------
            new: list[_Slot] = []
            while free_seqs and not exhausted:
                try:
                    item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                got = admit(_as_request(item, counter))
                counter += 1
                if isinstance(got, BatchRecord):
                    st.wall_ms = (time.perf_counter() - t_start) * 1e3
                    yield got
                    continue
                new.append(got)
            if not active and not new:
                break
            # -- one batch: new prompts (logits at their last token) + one token per generating seq
            toks: list[int] = []
            pos: list[int] = []
            seqs: list[int] = []
            want: list[bool] = []
            rows: list[_Slot] = []  # the slot of each logits row, in batch order
            for s in active:
                toks.append(s.pending)
                pos.append(s.n_past)
                seqs.append(s.seq)
                want.append(True)
                rows.append(s)
            for s in new:
                n = len(s.prompt_tokens)
                toks.extend(s.prompt_tokens)
                pos.extend(range(n))
                seqs.extend([s.seq] * n)
                want.extend([False] * (n - 1) + [s.n_predict != 0])
                if s.n_predict != 0:
                    rows.append(s)
            t0 = time.perf_counter()
            logits = _decode(ctx, toks, pos, seqs, want)
            t1 = time.perf_counter()
            st.n_steps += 1
            st.decode_ms += (t1 - t0) * 1e3
            st.max_batch = max(st.max_batch, len(toks))
            st.n_prompt_tokens += sum(len(s.prompt_tokens) for s in new)
            for s in active:
                s.n_past += 1
            for s in new:
                s.rec.prompt_ms = (t1 - t0) * 1e3
                s.n_past = len(s.prompt_tokens)
                s.t_first = t1
            done: list[BatchRecord] = []
            for s in new:
                if s.n_predict == 0:
                    done.append(finish(s, "length", t1))
            still: list[_Slot] = []
            for s, row in zip(rows, logits):
                token = s.sampler.sample(row)
                s.sampler.accept(token)
                if token in eog:
                    done.append(finish(s, "stop", time.perf_counter()))
                    continue
                s.rec.tokens.append(token)
                s.rec.text += s.decoder.push(token)
                st.n_gen_tokens += 1
                if s.n_predict > 0 and len(s.rec.tokens) >= s.n_predict:
                    done.append(finish(s, "length", time.perf_counter()))
                elif s.n_past >= n_slot:
                    done.append(finish(s, "context", time.perf_counter()))
                else:
                    s.pending = token
                    still.append(s)
            active = still
            st.wall_ms = (time.perf_counter() - t_start) * 1e3
            yield from done
    finally:
        # abandoned (error, Ctrl-C, or the caller stopped iterating): leave no cells behind
        for seq in range(n_parallel):
            if seq not in free_seqs:
                ctx.kv.seq_rm(seq)


def _decode(ctx: Context, toks: list[int], pos: list[int], seqs: list[int], want: list[bool]) -> np.ndarray:
    """ctx.decode over one step's batch, fed in pieces of n_batch tokens as llama.cpp does."""
    t = np.asarray(toks, np.int32)
    p = np.asarray(pos, np.int64)
    s = np.asarray(seqs, np.int64)
    w = np.asarray(want, bool)
    out = []
    step = max(1, ctx.n_batch)
    for b0 in range(0, len(t), step):
        b1 = min(len(t), b0 + step)
        rows = ctx.decode(t[b0:b1], p[b0:b1], s[b0:b1], w[b0:b1])
        if len(rows):
            out.append(rows)
    if not out:
        return np.zeros((0, ctx.model.params.n_vocab), np.float32)
    return np.concatenate(out)
