"""Parallel decoding of many prompts over one context (llama.cpp's tools/batched and
tools/parallel, with continuous batching as in tools/parallel's `-cb`).

A thin client of the serving engine (`engine.py`): `n_parallel` slots share the context's unified
KV cache, slot `s` decoding as sequence id `s`, and each slot may use `n_ctx // n_parallel` cells,
as llama-parallel sizes them. Prompts are submitted lazily, one whenever a slot is free; every
engine step decodes ONE micro-batch holding the next token of every generating sequence plus the
prompts (or prompt chunks, up to `n_batch` tokens) of the sequences just admitted. When a sequence
ends — an end-of-generation token or a complete grammar (`stop`), its `n_predict` (`length`), a full
slot (`context`) or a grammar that allows no token (`grammar_dead_end`) —
its cells are dropped (no prompt cache: `cache_prompt` off) and the next prompt takes the slot.

`run_batch()` yields one `BatchRecord` per prompt as it finishes (completion order, not input
order). A prompt that cannot run (no tokens, longer than a slot, bad settings) yields an error
record and the rest carry on; a failure of the engine itself (a decode that fails, a lost device)
ends the run with a BatchFailed error, after every record that finished before it (those of the
failing step included) was yielded: no finished record is lost. The prompts that were running get
no record (a resumed run decodes them again); the error names them. Library code: nothing here
prints.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .context import Context
from .engine import Engine, EngineMetrics, Event, PromptTooLongError, Request
from .generate import check_n_predict
from .model.constrain import ConstraintSpec
from .model.sampler import Sampler, SamplingParams
from .types import LlamapyError

__all__ = ["BatchFailed", "BatchRecord", "BatchRequest", "BatchStats", "run_batch"]


class BatchFailed(LlamapyError):
    """The engine failed (a decode error, a lost device) while `running` (input indices) were
    being decoded; every record finished before it was yielded."""

    def __init__(self, reason: str, running: list[int]) -> None:
        shown = ", ".join(map(str, running[:10])) + (", …" if len(running) > 10 else "")
        super().__init__(f"{reason} (prompt{'s' if len(running) != 1 else ''} {shown} running)")
        self.reason = reason
        self.running = running


@dataclass
class BatchRequest:
    """One prompt and its own overrides of the batch-wide settings (None: use the batch's)."""

    prompt: str | Sequence[int]
    n_predict: int | None = None
    temp: float | None = None
    seed: int | None = None
    id: Any = None
    index: int | None = None  # default: the request's position in the input
    constraint: ConstraintSpec | None = None  # this prompt's grammar / JSON schema


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
    finish_reason: str = ""  # "stop", "length", "context", "grammar_dead_end"; "" with an error
    error: str | None = None
    prompt_ms: float = 0.0  # from taking a slot to the end of the prompt's evaluation
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
    constraint: ConstraintSpec | None = None,
) -> Iterator[BatchRecord]:
    """Decode `requests` as up to `n_parallel` parallel sequences of `ctx`; yield a record for each
    as it finishes. `requests` is consumed lazily, one item whenever a slot is free.

    `n_predict` and `sampling` are the defaults; a BatchRequest's `n_predict`, `temp` and `seed`
    override them for that prompt. -1 (and -2) generate until end of generation or a full slot.
    `constraint` constrains every prompt without one of its own (BatchRequest.constraint); an
    invalid one makes an error record.
    """
    if n_parallel < 1:
        raise LlamapyError(f"-np {n_parallel}: the number of parallel sequences must be >= 1")
    check_n_predict(n_predict)
    n_slot = ctx.n_ctx // n_parallel
    if n_slot < 1:
        raise LlamapyError(f"-c {ctx.n_ctx} is too small for -np {n_parallel}: each sequence needs cells")
    base = sampling or SamplingParams()
    tok = ctx.model.tokenizer
    st = stats if stats is not None else BatchStats()
    st0 = replace(st)  # a stats object given twice accumulates
    # the engine is driven from this thread (no worker); max_queue 0: requests are submitted only
    # into free slots, so that `requests` is read no further ahead than the slots go
    engine = Engine(ctx, n_parallel=n_parallel, n_ctx_slot=n_slot, max_queue=0, cache_bytes=0)
    events: deque[Event] = deque()  # the sink: filled during engine.step(), drained after it
    live: dict[int, BatchRecord] = {}  # request id -> its record, until its "done" event
    t_start = time.perf_counter()
    it = iter(requests)
    exhausted = False
    counter = 0

    def prepare(req: BatchRequest) -> BatchRecord | tuple[BatchRecord, Request]:
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
            # the seed is drawn here when random, so that the record can report it
            rec.seed = Sampler(params).seed
            params = replace(params, seed=rec.seed)
            toks = tok.encode(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) else prompt
            request = Request(toks, max_tokens=npred if npred >= 0 else -1, sampling=params, cache_prompt=False,
                              constraint=req.constraint if req.constraint is not None else constraint)  # fmt: skip
            rec.n_prompt_tokens = len(engine.check(request))
        except PromptTooLongError as e:
            rec.error = (
                f"the prompt is {e.n_prompt} tokens, longer than a sequence's share of the context "
                f"({n_slot} cells = -c {ctx.n_ctx} // -np {n_parallel})"
            )
        except LlamapyError as e:
            rec.error = str(e)
        except (TypeError, ValueError) as e:
            rec.error = f"invalid request: {e}"
        if rec.error is not None:
            rec.seed = None
            return rec
        return rec, request

    def update_stats() -> None:
        m: EngineMetrics = engine.metrics
        st.n_steps = st0.n_steps + m.n_decode_total
        st.n_prompt_tokens = st0.n_prompt_tokens + m.prompt_tokens_total
        st.n_gen_tokens = st0.n_gen_tokens + m.tokens_predicted_total
        st.decode_ms = st0.decode_ms + m.decode_seconds_total * 1e3
        st.max_batch = max(st0.max_batch, m.n_batch_tokens_max)
        st.wall_ms = st0.wall_ms + (time.perf_counter() - t_start) * 1e3

    failed: list[tuple[int, str]] = []  # (index, error) of the prompts the engine failed

    def take(ev: Event) -> BatchRecord | None:
        """Fold one event into its record; the record when it is complete."""
        rec = live[ev.id]
        rec.text += ev.text
        if ev.kind == "token":
            rec.tokens.append(ev.token)
            return None
        del live[ev.id]
        if ev.finish_reason not in ("stop", "length", "context", "grammar_dead_end") or ev.timings is None:
            # the engine failed (a decode error, a lost device), not this request: the run stops
            # after this step, with no record for it, so that a resumed run tries it again
            failed.append((rec.index, ev.error or ev.finish_reason))
            return None
        rec.finish_reason = ev.finish_reason
        rec.n_tokens = len(rec.tokens)
        rec.prompt_ms = ev.timings.prompt_ms
        rec.predicted_ms = ev.timings.predicted_ms
        return rec

    try:
        while True:
            # -- submit prompts into the free slots ----------------------------------------
            while len(live) < n_parallel and not exhausted:
                try:
                    item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                got = prepare(_as_request(item, counter))
                counter += 1
                if isinstance(got, BatchRecord):
                    update_stats()
                    yield got
                    continue
                rec, request = got
                live[engine.submit(request, events.append)] = rec
            if not live:
                break
            # -- one engine step: one micro-batch over every live sequence ---------------------
            engine.step()
            done = [rec for rec in map(take, _drain(events)) if rec is not None]
            update_stats()
            yield from done  # first: what finished in the failing step is kept too
            if failed:
                raise BatchFailed(failed[0][1], sorted(i for i, _ in failed) + sorted(r.index for r in live.values()))
    finally:
        # finished, abandoned (error, Ctrl-C, or the caller stopped iterating): cancel what runs
        # and leave no cells behind
        try:
            engine.close(cancel=True)
        finally:
            for slot in engine.slots:
                ctx.kv.seq_rm(slot.seq)


def _drain(q: deque[Event]) -> Iterator[Event]:
    while q:
        yield q.popleft()
