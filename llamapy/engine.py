"""The serving engine: continuous batching over slots (llama.cpp's tools/server/server-context.cpp:
`server_slot`, `update_slots`, the per-slot prompt cache `cache_prompt`).

One Engine owns a Context. Its KV cache is split into `n_parallel` slots of `n_ctx_slot` cells
each; slot `i` decodes as KV sequence `i`. A request (`submit`) waits in a bounded queue until a
slot is free; each `step()` then decodes the next token of every generating slot and chunks of
the prompts being evaluated (taken while the step holds fewer than `n_batch` tokens, so a long
prompt does not stall the slots that are generating), samples a token for every row of logits and
hands each request its events through the request's `sink`.

Where the context is batch-invariant (`Context.batch_invariant`: the default 8-bit CPU mode with
q8 kernels for every weight type, whose numbers do not depend on a MUL_MAT's row count), the step
is ONE micro-batch, as llama-server's `update_slots` builds it: the decode tokens first, then the
prompt chunks, cut where the step's `n_batch` tokens end; a token's logits are the same bits
there as alone, so every request still gives its single-request text. Elsewhere (float32
activations, BLAS/sgemm for big batches, a GPU) a MUL_MAT's path depends on its row count
(`use_sgemm`, op offload), and a decode token batched with a 30-token prompt would round
differently from the one-token kernels and change greedy text: decode tokens and each prompt chunk
(cut every `n_batch` tokens from the prompt's start, as a request alone is) then go to separate
`decode` calls.

- `Event(kind="token")` per sampled token: the text it releases (text that might be the start of a
  stop string is held back), the token id, and its logprob / top logprobs when asked;
- one final `Event(kind="done")` with the finish reason ("stop", "length", "context" (the
  slot is full), "cancelled", "error" or "grammar_dead_end" (its constraint allowed no token;
  `error` says why)), the last released text, usage and timings.

A request's `constraint` (model/constrain.py) masks its rows before its sampler chain, with its
own matcher: requests in one step are constrained each on its own; a complete grammar ends the
request with "stop".

Speculative decoding (`draft`, speculative.py): a generating slot's pending token goes into the
step with the drafter's guesses of the tokens after it (as many as its slot and max_tokens leave
room for); its rows are sampled in order with the request's chain and matcher, each guess kept
while the sample equals it, and the cells of the guesses not kept are removed. Every token is
still the request's own sample from the target's logits, so where the context is batch-invariant
the text is the one decoding alone gives.

Prompt cache: an idle slot keeps the K/V of the tokens it last held; a new request goes to the free
slot sharing the longest prefix with its prompt and only the rest is evaluated. What idle slots keep
is bounded in bytes (`cache_bytes`): past it, the least recently used slot's cells are dropped.
Where another slot (busy or idle) holds a longer prefix of the prompt — every chat starts with the
template's system prompt — its cells are shared into the new slot's sequence (`KVCache.seq_cp`:
llama_memory_seq_cp on a unified cache, no K/V copied) instead of being evaluated again; only
where the context is batch-invariant, so those cells are the bits this prompt alone would write.
Requests arriving together (four chats opening with one system prompt) do not each evaluate the
prefix in the same step: a later one waits a step for the earlier one's cells, then takes them.
The shared tokens count as cached (usage, timings' cache_n) and within the slot's context.

Faults: a decode that fails ends the requests in that micro-batch, not the engine. A lost device
(DeviceLostError: a remote node died or stopped answering) takes the context's state with it, so
the engine keeps the reason (`fault`, naming the device): the running requests end with it as
their error, and those waiting or submitted later are refused with it (the server answers 503).

Threads: `start()` runs the step loop in one worker thread; `submit` and `cancel` may be called from
any thread (an asyncio loop: see `open_async`). Without a worker, `generate()` drives `step()` in the
caller's thread. Library code: nothing here prints.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .context import Context

if TYPE_CHECKING:  # asyncio is imported where a server uses it: ~1.5 MiB (ssl) for every `run`
    import asyncio

    from .speculative import Drafter
from .model.constrain import CompiledConstraint, ConstraintSpec, Matcher, compile_constraint
from .model.kv_cache import MAX_SHARE_SEQ
from .model.sampler import Sampler, SamplingParams
from .types import ContextFullError, DeviceLostError, LlamapyError

__all__ = [
    "Engine",
    "EngineMetrics",
    "EngineStoppedError",
    "Event",
    "PromptTooLongError",
    "QueueFullError",
    "Request",
    "SlotInfo",
    "AsyncEvents",
]


SLOT_SIMILARITY = 0.1


class QueueFullError(LlamapyError):
    """Every slot is busy and the waiting queue is full (the server answers 503)."""


class EngineStoppedError(LlamapyError):
    """The engine no longer accepts requests (closing, or its worker died)."""


class PromptTooLongError(LlamapyError):
    """A prompt does not fit a slot's context."""

    def __init__(self, n_prompt: int, n_ctx_slot: int) -> None:
        super().__init__(
            f"the prompt is {n_prompt} tokens, longer than a slot's context ({n_ctx_slot} tokens)"
        )
        self.n_prompt = n_prompt
        self.n_ctx_slot = n_ctx_slot


@dataclass
class Request:
    """What to generate (llama-server's slot_params)."""

    prompt: Sequence[int]
    max_tokens: int = -1  # -1: until end of generation or a full slot
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()  # strings that end generation; never part of the returned text
    logprobs: int | None = None  # None: none; 0: the chosen token's; k > 0: also the top k
    cache_prompt: bool = True  # reuse (and leave) this slot's cached prefix
    special: bool = False  # render special tokens as their text (llama.cpp's --special)
    # a grammar / JSON schema the output must match (model/constrain.py); None: unconstrained
    constraint: ConstraintSpec | None = None
    # each loaded LoRA adapter's scale for this request (llama-server's "lora"); None: the engine's
    lora: Sequence[float] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the slot's cache, not evaluated

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """llama-server's `timings` object."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    sample_ms: float = 0.0  # of predicted_ms, spent sampling
    n_eval: int = 0  # decodes after the prompt (llama_perf_context_print's "eval" runs)
    draft_n: int = 0  # tokens a drafter guessed (speculative decoding)
    draft_n_accepted: int = 0  # of them, kept

    def to_dict(self) -> dict[str, float]:
        def rate(n: int, ms: float) -> float:
            return 1e3 * n / ms if ms > 0 else 0.0

        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(rate(self.prompt_n, self.prompt_ms), 3),
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": round(rate(self.predicted_n, self.predicted_ms), 3),
            # llama-server's, only where something was drafted
            **({"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {}),
        }


@dataclass
class Event:
    """One token of a request, or its end."""

    id: int
    kind: str  # "token" or "done"
    text: str = ""  # text released by this event (may be "")
    token: int = -1
    index: int = -1  # 0-based among the generated tokens
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), best first
    # "stop", "length", "context", "cancelled", "error", "grammar_dead_end" (done only)
    finish_reason: str | None = None
    error: str | None = None
    stop_word: str | None = None  # the stop string that ended generation (done only)
    usage: Usage | None = None
    timings: Timings | None = None
    slot: int = -1


@dataclass
class SlotInfo:
    """A snapshot of one slot (llama-server's /slots)."""

    id: int
    n_ctx: int
    is_processing: bool
    id_task: int
    n_cached: int  # tokens whose K/V the slot holds
    n_prompt: int
    n_decoded: int


@dataclass
class EngineMetrics:
    """llama-server's /metrics counters."""

    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    n_tokens_max: int = 0
    requests_total: int = 0
    # not llama-server's: what `llamapy batch` reports (its micro-batches and their decode time)
    n_batch_tokens_max: int = 0
    decode_seconds_total: float = 0.0
    # not llama-server's: prompt tokens whose cells another slot's sequence shared (seq_cp); part
    # of prompt_tokens_cached_total
    prompt_tokens_shared_total: int = 0
    # speculative decoding (llama-server's spec_decode_num_draft_tokens_total / _accepted_tokens_)
    n_draft_tokens_total: int = 0
    n_draft_accepted_total: int = 0
    n_drafts_total: int = 0  # verification steps (drafts of at least one token)


Sink = Callable[[Event], None]
Flush = Callable[[], None]


@dataclass
class _Job:
    id: int
    req: Request
    sink: Sink
    prompt: list[int]
    flush: Flush | None = None  # called once after each batch of events given to `sink`
    sampler: Sampler | None = None
    constraint: CompiledConstraint | None = None
    matcher: Matcher | None = None  # this request's place in its constraint (None: unconstrained)
    decoder: Any = None
    n_done: int = 0  # prompt tokens in the KV cache
    n_cached: int = 0
    pending: int = -1  # sampled token still to be decoded (-1: none)
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # all generated text so far
    n_sent: int = 0  # characters of `text` already released
    t_submit: float = 0.0
    t_start: float = 0.0
    t_prompt_end: float = 0.0
    stop_word: str | None = None
    sample_ms: float = 0.0
    lora: tuple[float, ...] = ()  # the adapters' scales it runs with
    n_drafted: int = 0  # speculative decoding: tokens guessed for it, and of them kept
    n_accepted: int = 0


@dataclass
class _Slot:
    id: int
    seq: int  # its KV cache sequence
    cached: list[int] = field(default_factory=list)  # tokens whose K/V sequence `seq` holds
    job: _Job | None = None
    last_used: float = 0.0
    lora: tuple[float, ...] = ()  # the adapters' scales its cached K/V were computed with


def _shared(s: _Slot, job: _Job, tokens: Sequence[int]) -> int:
    """How much of the prompt the slot's `tokens` hold as this job would compute them: none
    under other LoRA scales (llama-server clears a slot's cache on a change of adapters)."""
    return common_prefix(tokens, job.prompt) if s.lora == job.lora else 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _stop_cut(text: str, start: int, stops: Sequence[str]) -> tuple[int | None, int]:
    """Where a stop string begins in text[start':] (None: nowhere) and how much of `text` is safe
    to release (not possibly the start of a stop string)."""
    if not stops:
        return None, len(text)
    longest = max(len(s) for s in stops)
    lo = max(0, start - longest)
    hits = [i for i in (text.find(s, lo) for s in stops if s) if i >= 0]
    if hits:
        return min(hits), min(hits)
    safe = len(text)
    for s in stops:
        # the longest suffix of `text` that is a proper prefix of `s` is held back
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                safe = min(safe, len(text) - k)
                break
    return None, safe


def _stop_at(text: str, i: int, stops: Sequence[str]) -> str:
    """The (longest) stop string found at text[i:]."""
    return max((s for s in stops if s and text.startswith(s, i)), key=len)


class Engine:
    """Continuous batching over `n_parallel` slots of one Context."""

    def __init__(
        self,
        ctx: Context,
        n_parallel: int = 1,
        n_ctx_slot: int | None = None,
        max_queue: int = 64,
        cache_bytes: int | None = None,
        first_seq: int = 0,
        draft: Drafter | None = None,
    ) -> None:
        """`n_ctx_slot` defaults to the context divided among the slots; slot i decodes as KV
        sequence `first_seq + i`. `cache_bytes` bounds what idle slots keep (default: all).
        `draft`: speculative decoding's guesses (speculative.py), verified a step at a time."""
        if n_parallel < 1:
            raise LlamapyError(f"-np {n_parallel}: the number of slots must be >= 1")
        n_slot = n_ctx_slot if n_ctx_slot is not None else ctx.n_ctx // n_parallel
        if n_slot < 1 or n_slot * n_parallel > ctx.n_ctx:
            raise LlamapyError(
                f"{n_parallel} slots of {n_slot} tokens do not fit a context of {ctx.n_ctx} cells"
            )
        if max_queue < 0:
            raise LlamapyError(f"--queue {max_queue}: must be >= 0")
        self.ctx = ctx
        self.tokenizer = ctx.model.tokenizer
        self.n_parallel = n_parallel
        self.n_ctx_slot = n_slot
        self.max_queue = max_queue
        self.bytes_per_token = self._kv_bytes_per_token(ctx)
        # default: what every idle slot could hold, i.e. unbounded within the slots' cells
        self.cache_bytes = cache_bytes if cache_bytes is not None else n_slot * n_parallel * self.bytes_per_token
        self.metrics = EngineMetrics()
        self.draft = draft
        # the LoRA scales of requests that name none (llama-server's POST /lora-adapters sets them)
        self.lora: tuple[float, ...] = ctx.lora_scales
        self.slots = [_Slot(i, first_seq + i, lora=self.lora) for i in range(n_parallel)]
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._waiting: deque[_Job] = deque()
        self._cancel: set[int] = set()
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._kv_version = -1  # the KV cache's state after our last step (see _check_kv)
        self._held: list[tuple[_Job, Event]] | None = None  # events of the step running
        self._post: _Post | None = None  # the asyncio loop of the latest open_async
        # prompt prefixes are shared across slots (seq_cp) where every slot's sequence can share cells
        self._share = all(s.seq < MAX_SHARE_SEQ for s in self.slots)
        self.loop_error: BaseException | None = None
        # a device of the context was lost (DeviceLostError): the requests running on it failed,
        # and nothing more can run on this context; the error's text (it names the device)
        self.fault: str | None = None

    @staticmethod
    def _kv_bytes_per_token(ctx: Context) -> int:
        kv = ctx.kv
        total = sum(b.nbytes for b in kv.buffers)
        return max(1, total // max(1, kv.size))

    # -- submitting ---------------------------------------------------------------------------

    def check(self, req: Request) -> list[int]:
        """The request's prompt as token ids, or LlamapyError (empty, too long, bad ids)."""
        toks = [int(t) for t in req.prompt]
        if not toks:
            raise LlamapyError("the prompt is empty (no tokens to evaluate)")
        if len(toks) > self.n_ctx_slot:
            raise PromptTooLongError(len(toks), self.n_ctx_slot)
        n_vocab = self.ctx.model.params.n_vocab
        if min(toks) < 0 or max(toks) >= n_vocab:
            raise LlamapyError(f"token id out of range [0, {n_vocab})")
        if req.max_tokens < -1:
            raise LlamapyError(f"max_tokens {req.max_tokens}: use -1 (no limit) or N >= 0")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise LlamapyError(f"logprobs {req.logprobs}: must be between 0 and 20")
        bad = [t for t, _ in req.sampling.logit_bias if not 0 <= t < n_vocab]
        if bad:
            raise LlamapyError(f"logit bias for token {bad[0]}: out of range [0, {n_vocab})")
        if req.lora is not None and (len(req.lora) != len(self.lora) or not all(np.isfinite(req.lora))):
            raise LlamapyError(f"lora: expected a finite scale for each of the {len(self.lora)} adapters")
        self.compiled(req)
        return toks

    def compiled(self, req: Request) -> CompiledConstraint | None:
        """The request's constraint compiled for this model's vocabulary (cached on its
        tokenizer), or ConstraintError naming what is wrong with it."""
        return compile_constraint(req.constraint, self.tokenizer) if req.constraint is not None else None

    def submit(self, req: Request, sink: Sink, flush: Flush | None = None) -> int:
        """Queue a request; its events go to `sink` (called from the stepping thread, which must
        not block). `flush`, when given, is called once after all of a step's events have gone to
        their sinks (once per step for requests sharing it), so that a consumer woken per batch
        (an asyncio loop: open_async) sees a step's events together. Raises PromptTooLongError /
        LlamapyError for a bad request, QueueFullError when every slot is busy and `max_queue`
        requests are already waiting."""
        toks = self.check(req)
        with self._cv:
            if self._closing:
                raise EngineStoppedError("the engine is shutting down")
            if self.loop_error is not None:
                raise EngineStoppedError(f"the engine stopped: {self.loop_error!r}")
            if self.fault is not None:
                raise EngineStoppedError(f"the model is unavailable: {self.fault}")
            busy = sum(1 for s in self.slots if s.job is not None)
            if len(self._waiting) + busy >= self.n_parallel + self.max_queue:
                raise QueueFullError(
                    f"all {self.n_parallel} slots are busy and {len(self._waiting)} requests are waiting"
                )
            job = _Job(next(self._ids), req, sink, toks, flush, t_submit=time.perf_counter(), constraint=self.compiled(req),
                       lora=tuple(map(float, req.lora)) if req.lora is not None else self.lora)  # fmt: skip
            self._waiting.append(job)
            self.metrics.requests_total += 1
            self._cv.notify_all()
        return job.id

    def assume_cached(self, slot: int, tokens: Sequence[int]) -> None:
        """Declare that slot `slot`'s sequence already holds the K/V of `tokens` (written by an
        earlier run over this context, e.g. a conversation's previous turns), so that a prompt
        sharing their prefix evaluates only the rest. The slot must be idle."""
        with self._step_lock:
            s = self.slots[slot]
            if s.job is not None:
                raise LlamapyError(f"slot {slot} is busy")
            toks = [int(t) for t in tokens]
            # trust the cells, not the caller: keep only the prefix whose positions the sequence
            # really holds (a generation cut by -n never decoded its last token)
            kv = self.ctx.kv
            held = kv.pos[kv.holds(s.seq) & (kv.pos >= 0) & (kv.pos < len(toks))]
            have = np.zeros(len(toks) + 1, bool)
            have[held] = True
            s.cached = toks[: int(np.argmin(have))]
            s.lora = self.ctx.lora_scales
            self._kv_version = kv.version

    def cancel(self, rid: int) -> None:
        """Stop a request: its slot is freed at the start of the next step (its events end with
        finish_reason "cancelled"). Unknown or finished ids are ignored."""
        with self._cv:
            self._cancel.add(rid)
            self._cv.notify_all()

    # -- state --------------------------------------------------------------------------------

    def n_waiting(self) -> int:
        return len(self._waiting)

    def n_busy(self) -> int:
        return sum(1 for s in self.slots if s.job is not None)

    def slot_info(self) -> list[SlotInfo]:
        out = []
        for s in self.slots:
            job = s.job
            out.append(
                SlotInfo(
                    id=s.id,
                    n_ctx=self.n_ctx_slot,
                    is_processing=job is not None,
                    id_task=job.id if job is not None else -1,
                    n_cached=len(s.cached),
                    n_prompt=len(job.prompt) if job is not None else 0,
                    n_decoded=len(job.tokens) if job is not None else 0,
                )
            )
        return out

    def cached_bytes(self) -> int:
        """Bytes of K/V the idle slots keep for later requests."""
        return sum(len(s.cached) for s in self.slots if s.job is None) * self.bytes_per_token

    # -- the step -----------------------------------------------------------------------------

    def _check_kv(self) -> None:
        """Someone else (Llama.stream, Llama.logits) used this context's KV cache since our last
        step: what the slots believe they hold is gone."""
        if self.ctx.kv.version != self._kv_version:
            for s in self.slots:
                if s.job is None:
                    s.cached = []
                    self.ctx.kv.seq_rm(s.seq)

    def _take_cancels(self) -> None:
        with self._lock:
            ids, self._cancel = self._cancel, set()
            if not ids:
                return
            gone = [j for j in self._waiting if j.id in ids]
            for j in gone:
                self._waiting.remove(j)
        for j in gone:
            self._emit(j, Event(j.id, "done", finish_reason="cancelled", usage=Usage(len(j.prompt))))
        for s in self.slots:
            if s.job is not None and s.job.id in ids:
                self._finish(s, "cancelled")

    def _admit(self) -> None:
        if self.fault is not None:  # nothing can start: what waits fails with the reason
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
            for j in waiting:
                self._emit(j, Event(j.id, "done", finish_reason="error", error=f"the model is unavailable: {self.fault}"))
            return
        while True:
            free = [s for s in self.slots if s.job is None]
            with self._lock:
                if not free or not self._waiting:
                    return
                job = self._waiting.popleft()
            slot = self._pick(free, job)
            try:
                self._start(slot, job)
            except Exception as e:  # noqa: BLE001 - a request that cannot start fails alone
                if slot.job is job:
                    self._finish(slot, "error", error=f"{type(e).__name__}: {e}", drop=True)
                else:
                    self._emit(job, Event(job.id, "done", finish_reason="error", error=f"{type(e).__name__}: {e}"))

    @staticmethod
    def _pick(free: list[_Slot], job: _Job) -> _Slot:
        """The free slot whose cache shares the longest prefix with the prompt, if that covers at
        least SLOT_SIMILARITY of it (llama-server's --slot-prompt-similarity); otherwise the
        least recently used one, so that another conversation's cache is kept."""
        if job.req.cache_prompt:
            best = max(free, key=lambda s: (_shared(s, job, s.cached), -s.last_used))
            if _shared(best, job, best.cached) > SLOT_SIMILARITY * len(job.prompt):
                return best
        return min(free, key=lambda s: s.last_used)

    def _start(self, slot: _Slot, job: _Job) -> None:
        job.t_start = time.perf_counter()
        keep = _shared(slot, job, slot.cached) if job.req.cache_prompt else 0
        last = len(job.prompt) - 1  # the last prompt token is evaluated for its logits
        keep = min(keep, last)
        self.ctx.kv.seq_rm(slot.seq, keep)
        slot.cached = job.prompt[:keep]
        slot.lora = job.lora
        slot.job = job
        job.n_done = job.n_cached = keep
        self._share_prefix(slot)
        job.sampler = Sampler(job.req.sampling)
        job.matcher = job.constraint.matcher() if job.constraint is not None else None
        for t in job.prompt:
            job.sampler.accept(t)
        job.decoder = self.tokenizer.stream_decoder(job.req.special)
        self.metrics.prompt_tokens_cached_total += keep

    def _sharing(self, job: _Job) -> bool:
        """Whether this prompt may take other slots' cells: only where a token's K/V are the
        same bits in any micro-batch (batch_invariant: another slot evaluated them in other
        micro-batches than this prompt alone would), and where the cache can share cells
        between the slots' sequences."""
        return self._share and job.req.cache_prompt and self.ctx.batch_invariant()

    def _share_prefix(self, slot: _Slot) -> None:
        """If another slot (busy or idle) holds a longer prefix of this slot's prompt than the
        slot has, and the request has evaluated nothing itself yet, that slot's cells of it join
        this slot's sequence (seq_cp) instead of being evaluated again — e.g. the chat
        template's system prompt every conversation starts with."""
        job = slot.job
        assert job is not None
        if job.n_done != job.n_cached or not self._sharing(job):
            return
        best, n = None, job.n_done
        last = len(job.prompt) - 1  # the last prompt token is evaluated for its logits
        for s in self.slots:
            if s is not slot and s.cached:
                k = min(_shared(s, job, s.cached), last)
                if k > n:
                    best, n = s, k
        if best is None:
            return
        kv = self.ctx.kv
        kv.seq_rm(slot.seq)
        kv.seq_cp(best.seq, slot.seq, 0, n)
        slot.cached = job.prompt[:n]
        self.metrics.prompt_tokens_cached_total += n - job.n_done
        self.metrics.prompt_tokens_shared_total += n
        job.n_done = job.n_cached = n

    def _waits(self, slot: _Slot) -> bool:
        """Whether this slot's prompt should wait a step: an earlier request still evaluating its
        prompt is about to write cells of a prefix the two share (requests arriving together,
        all opening with the same system prompt), which this one then takes (_share_prefix)
        instead of evaluating it a second time in the same step."""
        job = slot.job
        assert job is not None
        if job.n_done != job.n_cached or not self._sharing(job):
            return False
        last = len(job.prompt) - 1
        for s in self.slots:
            o = s.job
            if o is None or s is slot or o.id > job.id or o.n_done >= len(o.prompt) or not o.req.cache_prompt:
                continue
            k = min(_shared(s, job, o.prompt), last)
            if k > job.n_done and o.n_done < k:
                return True
        return False

    def step(self) -> bool:
        """Cancel, admit, decode one micro-batch and sample. Returns False when there was nothing
        to do."""
        with self._step_lock:
            self._held = []  # a step's events go out together at its end, then one flush (see _Post)
            try:
                self._check_kv()
                self._take_cancels()
                self._admit()
                worked = self._decode_step()
                self._kv_version = self.ctx.kv.version
                return worked
            finally:
                held, self._held = self._held, None
                for job, ev in held:
                    self._hand(job, ev)
                self._flush([job for job, _ in held])

    def _decode_step(self) -> bool:
        busy = [s for s in self.slots if s.job is not None]
        # (tokens, positions, sequences, wanted logits, slots sampled from the rows, prompt chunks,
        # LoRA scales): one decode each
        calls: list[tuple[list[int], list[int], list[int], list[bool], list[_Slot], list[tuple[_Slot, int]], tuple[float, ...]]] = []
        gen = [s for s in busy if s.job is not None and s.job.pending >= 0]  # one token each
        # and, with a drafter, its guesses of the next ones (verified by the rows' samples)
        drafts = {s.id: self._guess(s) for s in gen} if self.draft is not None else {}
        gen = [s for s in gen if s.job is not None]  # (a drafter's failure ends its request)
        for lora in dict.fromkeys(s.job.lora for s in gen):  # type: ignore[union-attr]
            g = [s for s in gen if s.job.lora == lora]  # type: ignore[union-attr]
            toks = [t for s in g for t in (s.job.pending, *drafts.get(s.id, ()))]  # type: ignore[union-attr]
            pos = [len(s.cached) + i for s in g for i in range(1 + len(drafts.get(s.id, ())))]
            seqs = [s.seq for s in g for _ in range(1 + len(drafts.get(s.id, ())))]
            calls.append((toks, pos, seqs, [True] * len(toks), g, [], lora))
        n_tokens = sum(len(c[0]) for c in calls)
        one = self.ctx.batch_invariant()  # one micro-batch for the whole step
        for s in busy:  # then chunks of the prompts still to evaluate
            job = s.job
            if job is None or job.n_done >= len(job.prompt):
                continue
            self._share_prefix(s)  # what another slot evaluated since this request started
            if self._waits(s):
                continue
            if n_tokens >= self.ctx.n_batch and calls:
                break
            room = self.ctx.n_batch - n_tokens if one else self.ctx.n_batch
            chunk = job.prompt[job.n_done : job.n_done + room]
            n_tokens += len(chunk)
            last = job.n_done + len(chunk) == len(job.prompt)
            sample = last and job.req.max_tokens != 0
            calls.append((list(chunk), list(range(job.n_done, job.n_done + len(chunk))), [s.seq] * len(chunk),
                          [False] * (len(chunk) - 1) + [sample], [s] if sample else [], [(s, len(chunk))], job.lora))  # fmt: skip
        if not calls:
            return False
        if one and len(calls) > 1:  # one micro-batch for each set of LoRA scales
            calls = [(*(([x for c in calls if c[6] == lora for x in c[i]]) for i in range(6)), lora)  # type: ignore[misc]
                     for lora in dict.fromkeys(c[6] for c in calls)]  # fmt: skip
        m = self.metrics
        m.n_decode_total += 1
        m.n_busy_slots_total += len(busy)
        m.n_batch_tokens_max = max(m.n_batch_tokens_max, max(len(c[0]) for c in calls))
        for toks, pos, seqs, want, rows, prompting, lora in calls:
            t0 = time.perf_counter()
            try:
                if lora != self.ctx.lora_scales:
                    self.ctx.set_lora_scales(lora)
                logits = self._decode(toks, pos, seqs, want)
            except ContextFullError:
                # only when something else holds cells of this context (the slots' own always fit)
                for s in busy:
                    if s.job is not None:
                        self._finish(s, "context", drop=True)
                return True
            except Exception as e:  # noqa: BLE001 - one failed batch ends its requests, not the engine
                if isinstance(e, DeviceLostError):  # the context's state on that device is gone
                    self.fault = why = str(e)
                else:
                    why = f"decode failed: {type(e).__name__}: {e}"
                for s in busy:
                    if s.job is not None:
                        self._finish(s, "error", error=why, drop=True)
                return True
            t1 = time.perf_counter()
            m.decode_seconds_total += t1 - t0
            for s in rows:
                if s.job is not None and s.job.pending >= 0:
                    s.cached.append(s.job.pending)
                    s.job.pending = -1
            for s, n in prompting:
                job = s.job
                assert job is not None
                s.cached.extend(job.prompt[job.n_done : job.n_done + n])
                job.n_done += n
                m.prompt_tokens_total += n
                if job.n_done == len(job.prompt):
                    job.t_prompt_end = t1
                    m.prompt_seconds_total += t1 - job.t_start
                    if job.req.max_tokens == 0:
                        self._finish(s, "length")
            r = 0
            for s in rows:
                d = drafts.get(s.id, [])
                try:
                    self._sample_drafted(s, logits[r : r + 1 + len(d)], d)
                except Exception as e:  # noqa: BLE001 - a request whose sampling fails ends alone
                    if s.job is not None:
                        self._finish(s, "error", error=f"sampling failed: {type(e).__name__}: {e}", drop=True)
                r += 1 + len(d)
        for s in self.slots:
            m.n_tokens_max = max(m.n_tokens_max, len(s.cached))
        return True

    def _decode(self, toks: list[int], pos: list[int], seqs: list[int], want: list[bool]) -> np.ndarray:
        out = self.ctx.decode(np.asarray(toks, np.int32), np.asarray(pos, np.int64), np.asarray(seqs, np.int64), np.asarray(want, bool))
        return out

    def _guess(self, s: _Slot) -> list[int]:
        """The drafter's guess of the tokens after slot `s`'s pending one, as many as its slot and
        its request's max_tokens leave room for (llama-server's get_n_draft_max)."""
        job = s.job
        assert job is not None and self.draft is not None
        room = self.n_ctx_slot - len(s.cached) - 2
        if job.req.max_tokens > 0:
            room = min(room, job.req.max_tokens - len(job.tokens) - 1)
        if room <= 0:
            return []
        try:
            d = self.draft.draft(s.seq, [*s.cached, job.pending], room)[:room]
        except Exception as e:  # noqa: BLE001 - a failing drafter ends its request, not the engine
            self._finish(s, "error", error=f"drafting failed: {type(e).__name__}: {e}", drop=True)
            return []
        job.n_drafted += len(d)
        self.metrics.n_draft_tokens_total += len(d)
        self.metrics.n_drafts_total += bool(d)
        return d

    def _sample_drafted(self, s: _Slot, rows: np.ndarray, draft: Sequence[int]) -> None:
        """Sample the rows of a pending token and its draft in order (common_sampler_sample_and_accept_n):
        while a row's token is the draft's next guess, that guess's K/V, already in the cache, is
        kept and the next row sampled; the cells of the guesses not kept are dropped."""
        for i, row in enumerate(rows):
            self._sample(s, row)
            job = s.job
            if i == len(draft) or job is None or job.pending != draft[i]:
                break
            s.cached.append(job.pending)
            job.pending = -1
            job.n_accepted += 1
            self.metrics.n_draft_accepted_total += 1
        if len(draft):
            self.ctx.kv.seq_rm(s.seq, len(s.cached))

    def _sample(self, s: _Slot, row: np.ndarray) -> None:
        job = s.job
        assert job is not None and job.sampler is not None
        p = job.req.sampling
        eog = self.tokenizer.eog_ids
        if p.ignore_eos and eog:
            row = row.copy()
            row[list(eog)] = -np.inf
        ts = time.perf_counter()
        gm = job.matcher
        if gm is not None:
            # the grammar first, then the chain (common_sampler with grammar_first): the chain
            # only ever sees allowed tokens, end of generation among them once the grammar is complete
            if not (p.ignore_eos and eog):  # (else already a copy)
                row = row.copy()
            gm.mask(row)
            if gm.dead:
                why = gm.error or "no token can continue the output"
                self._finish(s, "grammar_dead_end", error=f"the grammar reached a dead end: {why}")
                return
        token = job.sampler.sample(row)
        job.sampler.accept(token)
        if gm is not None and token not in eog:
            gm.accept(token)
        job.sample_ms += (time.perf_counter() - ts) * 1e3
        if token in eog:
            self._finish(s, "stop")
            return
        ev = Event(job.id, "token", token=token, index=len(job.tokens), slot=s.id)
        if job.req.logprobs is not None:
            # log p = logit - log(sum(exp(logits))): one pass over the row (float32 exps, a float64
            # sum), where a whole float64 log_softmax took ~0.5 ms a token
            m = float(row.max())
            lse = m + float(np.log(np.exp(row - m, dtype=np.float32).sum(dtype=np.float64)))
            ev.logprob = float(row[token]) - lse
            k = job.req.logprobs
            if k > 0:
                top = np.argpartition(-row, k - 1)[:k]
                top = top[np.lexsort((top, -row[top]))]
                ev.top_logprobs = [(int(t), float(row[t]) - lse) for t in top]
        job.tokens.append(token)
        self.metrics.tokens_predicted_total += 1
        job.text += job.decoder.push(token)
        cut, safe = _stop_cut(job.text, job.n_sent, job.req.stop)
        if cut is not None:
            job.stop_word = _stop_at(job.text, cut, job.req.stop)
            job.text = job.text[:cut]
        ev.text = job.text[job.n_sent : max(job.n_sent, safe)]
        job.n_sent = max(job.n_sent, safe)
        self._emit(job, ev)
        if s.job is not job:  # the sink failed: already cancelled
            return
        if cut is not None or (gm is not None and gm.done):  # a complete grammar allows only the end
            self._finish(s, "stop")
        elif job.req.max_tokens > 0 and len(job.tokens) >= job.req.max_tokens:
            self._finish(s, "length")
        elif len(s.cached) >= self.n_ctx_slot:
            self._finish(s, "context")  # the slot is full
        else:
            job.pending = token

    def _finish(self, s: _Slot, reason: str, error: str | None = None, drop: bool = False) -> None:
        job = s.job
        assert job is not None
        now = time.perf_counter()
        tail = ""
        if job.decoder is not None and job.stop_word is None:
            job.text += job.decoder.flush()  # an unfinished character becomes U+FFFD
        if reason not in ("cancelled", "error") and job.n_sent < len(job.text):
            cut, _ = _stop_cut(job.text, job.n_sent, job.req.stop)
            if cut is not None:
                job.stop_word = _stop_at(job.text, cut, job.req.stop)
                job.text = job.text[:cut]
                reason = "stop"
            tail = job.text[job.n_sent :]
            job.n_sent = len(job.text)
        t_first = job.t_prompt_end or now
        timings = Timings(
            cache_n=job.n_cached,
            prompt_n=job.n_done - job.n_cached,
            prompt_ms=(t_first - job.t_start) * 1e3,
            predicted_n=len(job.tokens),
            predicted_ms=(now - t_first) * 1e3 if job.t_prompt_end else 0.0,
            sample_ms=job.sample_ms,
            n_eval=max(0, len(s.cached) - len(job.prompt)) if job.t_prompt_end else 0,
            draft_n=job.n_drafted,
            draft_n_accepted=job.n_accepted,
        )
        self.metrics.tokens_predicted_seconds_total += timings.predicted_ms / 1e3
        usage = Usage(len(job.prompt), len(job.tokens), job.n_cached)
        s.job = None
        s.last_used = now
        if drop or not job.req.cache_prompt:
            self.ctx.kv.seq_rm(s.seq)
            s.cached = []
        self._bound_cache()
        self._emit(job, Event(job.id, "done", text=tail, finish_reason=reason, error=error,
                              stop_word=job.stop_word, usage=usage, timings=timings, slot=s.id))  # fmt: skip

    def _bound_cache(self) -> None:
        """Drop the least recently used idle slots' cells until the rest fit `cache_bytes`."""
        idle = sorted((s for s in self.slots if s.job is None and s.cached), key=lambda s: s.last_used)
        for s in idle:
            if self.cached_bytes() <= self.cache_bytes:
                break
            self.ctx.kv.seq_rm(s.seq)
            s.cached = []

    def _emit(self, job: _Job, ev: Event) -> None:
        if self._held is not None:
            self._held.append((job, ev))
            return
        self._hand(job, ev)
        self._flush([job])

    def _hand(self, job: _Job, ev: Event) -> None:
        try:
            job.sink(ev)
        except Exception:  # noqa: BLE001 - a broken consumer (closed loop) cancels its request
            if ev.kind == "token":
                for s in self.slots:
                    if s.job is job:
                        job.sink, job.flush = lambda _ev: None, None
                        self._finish(s, "cancelled")

    @staticmethod
    def _flush(jobs: list[_Job]) -> None:
        # once per distinct flush (requests on one asyncio loop share it), after every sink call
        for flush in dict.fromkeys(j.flush for j in jobs if j.flush is not None):
            try:
                flush()
            except Exception:  # noqa: BLE001 - its loop closed since: the next event cancels the request
                pass

    # -- the worker thread --------------------------------------------------------------------

    def start(self) -> None:
        """Run the step loop in a worker thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="llamapy-engine", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _idle(self) -> bool:
        return not self._waiting and not self._cancel and all(s.job is None for s in self.slots)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._closing and self._idle():
                        self._cv.wait()
                    if self._closing and self._idle():
                        return
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 - fail what ran, keep serving
                    self._fail_running(f"internal error: {type(e).__name__}: {e}")
        except BaseException as e:  # noqa: BLE001 - kept for the owner (server's /health)
            self.loop_error = e
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
            for j in waiting:
                self._emit(j, Event(j.id, "done", finish_reason="error", error=f"engine stopped: {e}"))
            self._fail_running(f"engine stopped: {e}")

    def _fail_running(self, error: str) -> None:
        for s in self.slots:
            if s.job is not None:
                self._finish(s, "error", error=error, drop=True)

    def close(self, cancel: bool = True, timeout: float | None = 30.0) -> None:
        """Stop accepting requests; cancel (or, with cancel=False, finish) what is running; stop the
        worker. The Context stays its owner's to free."""
        with self._cv:
            self._closing = True
            if cancel:
                self._cancel.update(j.id for j in self._waiting)
                self._cancel.update(s.job.id for s in self.slots if s.job is not None)
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        elif cancel:
            self.step()

    # -- clients ------------------------------------------------------------------------------

    def generate(self, req: Request) -> Iterator[Event]:
        """The events of one request, in order, ending with its "done" event. With a worker
        running this waits on it; otherwise it steps the engine in this thread. Closing the
        iterator early cancels the request."""
        done = False
        if self.running:
            q: queue.SimpleQueue[Event] = queue.SimpleQueue()
            rid = self.submit(req, q.put)
            try:
                while True:
                    ev = q.get()
                    done = ev.kind == "done"
                    yield ev
                    if done:
                        return
            finally:
                if not done:
                    self.cancel(rid)
        buf: deque[Event] = deque()
        rid = self.submit(req, buf.append)
        try:
            while True:
                while buf:
                    ev = buf.popleft()
                    done = ev.kind == "done"
                    yield ev
                    if done:
                        return
                if not self.step() and not buf:
                    raise LlamapyError("the engine stopped without finishing the request")
        finally:
            if not done:
                self.cancel(rid)
                self.step()  # frees the slot now: nobody else may step this engine

    def open_async(self, req: Request) -> AsyncEvents:
        """Submit `req` now (errors raise here, before any response is started) and return its
        events for the running asyncio loop; the worker thread (start()) decodes."""
        import asyncio

        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Event] = asyncio.Queue()
        if self._post is None or self._post.loop is not loop:
            self._post = _Post(loop)
        post = self._post
        return AsyncEvents(self, self.submit(req, lambda ev: post.put(q, ev), post.wake), q)


class _Post:
    """Events for the queues of one asyncio loop, handed over with one wake-up per step: `put`
    only queues an event; the engine calls `wake` once after the step's last event, so the loop
    never takes a step's first events before the rest are queued. call_soon_threadsafe writes to
    the loop's self-pipe, which wakes the loop thread, and one write per event took ~7 % of the
    engine thread's time at 4 busy slots (py-spy, serve_load)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[asyncio.Queue[Event], Event]] = deque()
        self.armed = False

    def put(self, q: asyncio.Queue[Event], ev: Event) -> None:  # the engine thread
        if self.loop.is_closed():  # (the engine then cancels the request: _hand)
            raise RuntimeError("the event loop is closed")
        self.items.append((q, ev))

    def wake(self) -> None:  # the engine thread, after a step's puts
        # armed: a drain is scheduled that has not yet cleared it, so it takes every item queued
        # before this check; an empty deque: a drain running now took them
        if self.items and not self.armed:
            self.armed = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # the loop thread
        self.armed = False
        while self.items:
            q, ev = self.items.popleft()
            q.put_nowait(ev)


class AsyncEvents:
    """One request's events on an asyncio loop. close() (or leaving `async with`) before the
    "done" event cancels the request; the engine frees its slot at its next step."""

    def __init__(self, engine: Engine, rid: int, q: asyncio.Queue[Event]) -> None:
        self.engine = engine
        self.id = rid
        self._q = q
        self.done = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Event]:
        while not self.done:
            ev = await self._q.get()
            self.done = ev.kind == "done"
            yield ev

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.cancel(self.id)

    async def __aenter__(self) -> AsyncEvents:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
