"""The serving engine (llamapy.engine): continuous batching with the same greedy tokens as a
single-sequence run, cancel, the bounded queue, prompt-cache reuse and its byte bound, stop
strings, and driving it from asyncio while a worker thread decodes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from llamapy.api import Llama
from llamapy.engine import Engine, PromptTooLongError, QueueFullError, Request
from llamapy.model.sampler import SamplingParams
from llamapy.types import LlamapyError

from conftest import write_llama_gguf

GREEDY = SamplingParams(temp=0, ignore_eos=True)
PROMPTS = ["the cat and the dog", "a b c d e", "she said it", "in the beginning of it all"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = write_llama_gguf(tmp_path_factory.mktemp("engine") / "tiny.gguf", seed=3)
    m = Llama(path, n_ctx=512, n_threads=1)
    yield m
    m.close()


def reference(llm: Llama, prompt: str, n: int) -> list[int]:
    llm.ctx.kv.clear()
    return llm.generate(prompt, n, temp=0, ignore_eos=True).tokens


def run_all(engine: Engine, reqs: list[Request]) -> dict[int, list]:
    """Submit everything, step until all are done; events per request id."""
    out: dict[int, list] = {}
    ids = [engine.submit(r, lambda ev: out.setdefault(ev.id, []).append(ev)) for r in reqs]
    for _ in range(10_000):
        if all(i in out and out[i][-1].kind == "done" for i in ids):
            break
        engine.step()
    return {i: out[i] for i in ids}


def tokens(evs: list) -> list[int]:
    return [e.token for e in evs if e.kind == "token"]


def test_parallel_greedy_equals_single_runs(llm: Llama) -> None:
    refs = [reference(llm, p, 12) for p in PROMPTS]
    eng = Engine(llm.ctx, n_parallel=2, n_ctx_slot=128)  # 4 requests over 2 slots: queueing too
    res = run_all(eng, [Request(llm.tokenize(p), 12, GREEDY) for p in PROMPTS])
    for evs, ref, p in zip(res.values(), refs, PROMPTS):
        assert tokens(evs) == ref, p
        done = evs[-1]
        assert done.finish_reason == "length"
        assert done.usage.prompt_tokens == len(llm.tokenize(p)) and done.usage.completion_tokens == 12
        assert "".join(e.text for e in evs) == llm.detokenize(ref)
    assert eng.metrics.n_decode_total < 4 * 12  # the requests shared micro-batches
    assert all(not s.is_processing for s in eng.slot_info())


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_one_micro_batch_per_step_where_batch_invariant(llm: Llama, mode: str) -> None:
    """A prompt arriving while other slots generate: in the 8-bit mode (batch-invariant) the
    step decodes the generating slots' tokens and the prompt chunk in ONE micro-batch (cut at
    n_batch: a long prompt in chunks of at most 24 tokens beside 2 decode tokens), in the
    float32 mode in separate calls; either way every request gives its single-run tokens."""
    from llamapy.context import ContextOptions
    from llamapy.generate import generate

    m = Llama(llm.path, context_options=ContextOptions(n_ctx=512, n_batch=26, n_threads=1, cpu_matmul=mode))
    try:
        ctx = m.ctx
        assert ctx.batch_invariant() == (mode == "q8")
        prompts = [m.tokenize(p) for p in PROMPTS[:2]] + [m.tokenize(" ".join(["the cat and the dog"] * 2))]
        assert len(prompts[2]) > 26
        refs = []
        for p in prompts:
            ctx.kv.clear()
            refs.append(generate(ctx, p, 10, GREEDY).tokens)
        eng = Engine(ctx, n_parallel=3, n_ctx_slot=128)
        calls: list[tuple[int, int]] = []  # (tokens, logits wanted) per decode call
        decode = eng._decode

        def counted(toks: list[int], pos: list[int], seqs: list[int], want: list[bool]):  # noqa: ANN202
            calls.append((len(toks), sum(want)))
            return decode(toks, pos, seqs, want)

        eng._decode = counted  # type: ignore[method-assign]
        out: dict[int, list] = {}
        ids = [eng.submit(Request(p, 10, GREEDY), lambda ev: out.setdefault(ev.id, []).append(ev)) for p in prompts[:2]]
        for _ in range(3):
            eng.step()
        ids.append(eng.submit(Request(prompts[2], 10, GREEDY), lambda ev: out.setdefault(ev.id, []).append(ev)))
        steps0, calls0 = eng.metrics.n_decode_total, len(calls)
        for _ in range(500):
            if all(i in out and out[i][-1].kind == "done" for i in ids):
                break
            eng.step()
        late = calls[calls0:]
        if mode == "q8":
            assert len(late) == eng.metrics.n_decode_total - steps0  # one call per step
            assert late[0] == (26, 2)  # 2 decode tokens + 24 prompt tokens
            assert max(n for n, _ in late) <= 26
        else:
            assert len(late) > eng.metrics.n_decode_total - steps0
            assert late[:2] == [(2, 2), (26, 0)]  # apart, the prompt cut at n_batch from its start
        for i, ref in zip(ids, refs):
            assert tokens(out[i]) == ref
    finally:
        m.close()


def test_graph_cache_keeps_the_shapes_in_use(llm: Llama) -> None:
    """The context's graph cache drops the least recently used shapes: a server's decode shape,
    used every step, survives a stream of one-off prompt-chunk shapes."""
    ctx = llm.ctx
    decode = ctx.graph(3, 3)
    for n in range(4, 40):
        ctx.graph(n, 1)
        assert ctx.graph(3, 3) is decode
    assert len(ctx._graphs) <= 17


def test_prompt_cache_reuse_and_bound(llm: Llama) -> None:
    base = llm.tokenize(PROMPTS[3])
    longer = base + llm.tokenize(" and the end", add_special=False)
    ref = reference(llm, PROMPTS[3] + " and the end", 8)
    eng = Engine(llm.ctx, n_parallel=2, n_ctx_slot=128)
    run_all(eng, [Request(base, 4, GREEDY)])
    (evs,) = run_all(eng, [Request(longer, 8, GREEDY)]).values()
    assert evs[-1].usage.cached_tokens == len(base)  # the prefix was not evaluated again
    assert evs[-1].timings.prompt_n == len(longer) - len(base)
    assert tokens(evs) == ref
    # a bound of 0 bytes keeps nothing for idle slots
    eng0 = Engine(llm.ctx, n_parallel=2, n_ctx_slot=128, cache_bytes=0)
    run_all(eng0, [Request(base, 4, GREEDY)])
    assert all(s.n_cached == 0 for s in eng0.slot_info())
    (evs,) = run_all(eng0, [Request(longer, 8, GREEDY)]).values()
    assert evs[-1].usage.cached_tokens == 0
    assert tokens(evs) == ref


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_prompt_prefix_shared_across_slots(llm: Llama, mode: str) -> None:
    """A request whose prompt shares a prefix with what another (busy) slot holds evaluates only
    the rest: the prefix's cells join its sequence (seq_cp). Its tokens and logprobs are the bits
    of a run alone, also after the slot that wrote the shared cells moves on to another prompt.
    Only where the context is batch-invariant (the 8-bit mode): in the float32 mode nothing is
    shared."""
    from llamapy.context import ContextOptions

    m = Llama(llm.path, context_options=ContextOptions(n_ctx=512, n_batch=64, n_threads=1, cpu_matmul=mode))
    try:
        assert m.ctx.batch_invariant() == (mode == "q8")
        _prefix_sharing(m, mode == "q8")
    finally:
        m.close()


def _prefix_sharing(llm: Llama, shares: bool) -> None:
    head = "the cat and the dog sat on the mat in the house of"
    a, b, c = head + " it all", head + " a b c d e", "she said it"

    def req(text: str) -> Request:
        return Request(llm.tokenize(text), 12, GREEDY, logprobs=3)

    def bits(evs: list) -> list:
        # the float32 mode rounds a batch of decode rows differently (sgemm): its tokens only
        return [(e.token, e.logprob, e.top_logprobs) if shares else e.token for e in evs if e.kind == "token"]

    refs = {}
    for t in (a, b, c):
        llm.ctx.kv.clear()
        refs[t] = bits(next(iter(run_all(Engine(llm.ctx), [req(t)]).values())))
    pa, pb = llm.tokenize(a), llm.tokenize(b)
    n_head = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)
    assert n_head > 8
    llm.ctx.kv.clear()
    eng = Engine(llm.ctx, n_parallel=2, n_ctx_slot=128)
    out: dict[int, list] = {}

    def sink(ev) -> None:
        out.setdefault(ev.id, []).append(ev)

    ia = eng.submit(req(a), sink)
    for _ in range(3):  # a's prompt is evaluated, it generates
        eng.step()
    evaluated = eng.metrics.prompt_tokens_total
    ib = eng.submit(req(b), sink)
    eng.step()  # b starts beside a, sharing a's cells of the common prefix
    # (unshared, b's first chunk is an n_batch of 64: a's decode token goes to a separate call)
    assert eng.metrics.prompt_tokens_total - evaluated == (len(pb) - n_head if shares else 64)
    assert eng.metrics.prompt_tokens_shared_total == (n_head if shares else 0)
    while out[ia][-1].kind != "done":
        eng.step()
    ic = eng.submit(req(c), sink)  # takes a's slot and drops a's cells but those b shares
    while any(i not in out or out[i][-1].kind != "done" for i in (ib, ic)):
        eng.step()
    assert bits(out[ia]) == refs[a]
    assert bits(out[ib]) == refs[b]
    assert bits(out[ic]) == refs[c]
    done = out[ib][-1]
    if not shares:
        assert done.usage.cached_tokens == 0 and eng.metrics.prompt_tokens_shared_total == 0
        return
    assert done.usage.cached_tokens == n_head and done.timings.prompt_n == len(pb) - n_head
    eng.close()
    for s in eng.slots:  # with no slot holding them, no cell is left
        llm.ctx.kv.seq_rm(s.seq)
    assert llm.ctx.kv.n_used() == 0
    # arriving together: b waits one step for a's cells of the prefix instead of evaluating it too
    eng = Engine(llm.ctx, n_parallel=3, n_ctx_slot=128)
    res = run_all(eng, [req(a), req(b), req(c)])
    assert [bits(evs) for evs in res.values()] == [refs[a], refs[b], refs[c]]
    pc = llm.tokenize(c)
    n_c = next(i for i, (x, y) in enumerate(zip(pa, pc)) if x != y)  # c shares a's first tokens
    assert eng.metrics.prompt_tokens_total == len(pa) + len(pb) - n_head + len(pc) - n_c
    assert [evs[-1].usage.cached_tokens for evs in res.values()] == [0, n_head, n_c]


def test_cache_dropped_when_someone_else_uses_the_kv(llm: Llama) -> None:
    p = llm.tokenize(PROMPTS[0])
    eng = Engine(llm.ctx, n_parallel=1)
    run_all(eng, [Request(p, 4, GREEDY)])
    llm.generate("a b", 3, temp=0)  # rewrites sequence 0 behind the engine's back
    (evs,) = run_all(eng, [Request(p, 6, GREEDY)]).values()
    assert evs[-1].usage.cached_tokens == 0
    assert tokens(evs) == reference(llm, PROMPTS[0], 6)


def test_cancel_frees_the_slot_at_the_next_step(llm: Llama) -> None:
    eng = Engine(llm.ctx, n_parallel=1, n_ctx_slot=256)
    got: list = []
    rid = eng.submit(Request(llm.tokenize(PROMPTS[1]), 200, GREEDY), got.append)
    for _ in range(5):
        eng.step()
    assert eng.slot_info()[0].is_processing
    eng.cancel(rid)
    eng.step()
    assert not eng.slot_info()[0].is_processing
    assert got[-1].kind == "done" and got[-1].finish_reason == "cancelled"
    assert 0 < got[-1].usage.completion_tokens < 200
    # a queued request can be cancelled too, and the engine carries on
    (evs,) = run_all(eng, [Request(llm.tokenize(PROMPTS[2]), 3, GREEDY)]).values()
    assert evs[-1].finish_reason == "length"


def test_generator_close_cancels(llm: Llama) -> None:
    eng = Engine(llm.ctx, n_parallel=1)
    gen = eng.generate(Request(llm.tokenize(PROMPTS[0]), 100, GREEDY))
    next(gen), next(gen)
    gen.close()
    assert not eng.slot_info()[0].is_processing


def test_queue_bound_and_bad_requests(llm: Llama) -> None:
    eng = Engine(llm.ctx, n_parallel=1, n_ctx_slot=64, max_queue=1)
    p = llm.tokenize(PROMPTS[0])
    eng.submit(Request(p, 4, GREEDY), lambda ev: None)
    eng.submit(Request(p, 4, GREEDY), lambda ev: None)
    with pytest.raises(QueueFullError):
        eng.submit(Request(p, 4, GREEDY), lambda ev: None)
    with pytest.raises(PromptTooLongError, match="65 tokens.*64"):
        eng.check(Request([1] * 65))
    with pytest.raises(LlamapyError, match="empty"):
        eng.check(Request([]))
    with pytest.raises(LlamapyError, match="out of range"):
        eng.check(Request([10**6]))
    with pytest.raises(LlamapyError, match="slots"):
        Engine(llm.ctx, n_parallel=2, n_ctx_slot=1024)
    eng.close()


def test_slot_full_ends_with_length(llm: Llama) -> None:
    eng = Engine(llm.ctx, n_parallel=1, n_ctx_slot=32)
    p = llm.tokenize(PROMPTS[1])
    assert len(p) < 32
    (evs,) = run_all(eng, [Request(p, -1, GREEDY)]).values()
    assert evs[-1].finish_reason == "context"
    assert len(p) + evs[-1].usage.completion_tokens == 32 + 1  # the last token is never decoded


def test_max_tokens_zero_and_logprobs(llm: Llama) -> None:
    eng = Engine(llm.ctx, n_parallel=1)
    p = llm.tokenize(PROMPTS[2])
    (evs,) = run_all(eng, [Request(p, 0, GREEDY)]).values()
    assert [e.kind for e in evs] == ["done"] and evs[0].finish_reason == "length"
    (evs,) = run_all(eng, [Request(p, 3, GREEDY, logprobs=4)]).values()
    for e in evs[:-1]:
        assert len(e.top_logprobs) == 4
        assert e.top_logprobs[0] == (e.token, e.logprob)  # greedy: the chosen token is the best
        assert [lp for _, lp in e.top_logprobs] == sorted((lp for _, lp in e.top_logprobs), reverse=True)
        assert e.logprob <= 0


def test_stop_strings(llm: Llama) -> None:
    eng = Engine(llm.ctx, n_parallel=1)
    p = llm.tokenize(PROMPTS[3])
    (evs,) = run_all(eng, [Request(p, 20, GREEDY)]).values()
    full = "".join(e.text for e in evs)
    assert len(full) >= 6
    stop = full[3:6]
    cut = full.index(stop)
    (evs,) = run_all(eng, [Request(p, 20, GREEDY, stop=[stop, "never-there"])]).values()
    assert "".join(e.text for e in evs) == full[:cut]
    assert evs[-1].finish_reason == "stop"
    assert evs[-1].stop_word == stop


def test_asyncio_client_with_worker_thread(llm: Llama) -> None:
    refs = [reference(llm, p, 6) for p in PROMPTS[:3]]
    eng = Engine(llm.ctx, n_parallel=3)
    eng.start()

    async def one(p: str) -> list[int]:
        out = []
        async with eng.open_async(Request(llm.tokenize(p), 6, GREEDY)) as evs:
            async for ev in evs:
                if ev.kind == "token":
                    out.append(ev.token)
        return out

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in PROMPTS[:3]))

    try:
        assert asyncio.run(main()) == refs
        # leaving early cancels: the slot is idle soon after
        async def early() -> None:
            async with eng.open_async(Request(llm.tokenize(PROMPTS[0]), 400, GREEDY)) as evs:
                async for _ in evs:
                    break

        asyncio.run(early())
        t0 = time.monotonic()
        while eng.n_busy() and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert eng.n_busy() == 0
    finally:
        eng.close()
    assert not eng.running


def test_a_step_wakes_the_loop_once_and_a_closed_loop_cancels(llm: Llama) -> None:
    """A step's events reach an asyncio loop with one call_soon_threadsafe (one write to its
    self-pipe), not one per event, however the two threads interleave; a request whose loop has
    closed is cancelled."""
    eng = Engine(llm.ctx, n_parallel=3)

    async def main() -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        wakes: list[int] = []
        real = loop.call_soon_threadsafe
        drained = threading.Event()

        def drain(f: Callable[[], None]) -> None:
            f()
            drained.set()

        def wake(f: Callable[..., None], *a: object) -> asyncio.Handle:
            if f.__name__ != "_drain":  # to_thread's own result comes back through it too
                return real(f, *a)
            wakes.append(1)
            # the worst interleaving, forced on every run: the loop thread takes what is queued
            # before the engine thread goes on (the wait only bounds a hang; it never paces the test)
            drained.clear()
            h = real(drain, f)
            if not drained.wait(60):
                raise RuntimeError("the loop did not run the drain")
            return h

        loop.call_soon_threadsafe = wake  # type: ignore[method-assign]
        streams = [eng.open_async(Request(llm.tokenize(p), 4, GREEDY)) for p in PROMPTS[:3]]
        per_step, got = [], [0, 0, 0]
        while any(not e.done for e in streams):
            n0 = sum(wakes)
            await asyncio.to_thread(eng.step)
            per_step.append(sum(wakes) - n0)
            for i, e in enumerate(streams):
                while not e._q.empty():
                    ev = e._q.get_nowait()
                    got[i] += ev.kind == "token"
                    e.done = ev.kind == "done"
        return per_step, got

    per_step, got = asyncio.run(main())
    assert got == [4, 4, 4] and max(per_step) == 1

    async def abandoned() -> None:
        eng.open_async(Request(llm.tokenize(PROMPTS[0]), 50, GREEDY))
        await asyncio.to_thread(eng.step)  # its loop closes with the request running

    asyncio.run(abandoned())
    for _ in range(3):
        eng.step()
    assert eng.n_busy() == 0


def test_generate_stream_runs_on_the_engine_and_reuses_what_the_sequence_holds(llm: Llama) -> None:
    from llamapy.generate import GenerationResult, stream

    first = llm.tokenize(PROMPTS[0])
    res = GenerationResult()
    list(stream(llm.ctx, first, 5, GREEDY, res))
    assert res.finish_reason == "length" and len(res.tokens) == 5 and res.timings.n_eval == 4
    follow = first + res.tokens + llm.tokenize(" and", add_special=False)
    res2 = GenerationResult()
    list(stream(llm.ctx, follow, 3, GREEDY, res2, cached=first + res.tokens))
    # the last generated token was never decoded (-n stopped first): it is evaluated again
    assert res2.timings.n_prompt == len(follow) - (len(first) + 4)
    assert res2.tokens == reference(llm, follow, 3)


def test_a_failing_request_does_not_stop_the_engine(llm: Llama) -> None:
    """A request whose sampler cannot be built fails alone; the worker keeps serving."""
    eng = Engine(llm.ctx, n_parallel=2)
    eng.start()
    try:
        bad = list(eng.generate(Request(llm.tokenize(PROMPTS[0]), 3, SamplingParams(repeat_last_n=10**30))))
        assert bad[-1].finish_reason == "error" and "OverflowError" in bad[-1].error
        good = list(eng.generate(Request(llm.tokenize(PROMPTS[0]), 3, GREEDY)))
        assert good[-1].finish_reason == "length" and eng.loop_error is None
    finally:
        eng.close()
