"""Speculative decoding (llamapy/speculative.py, the engine's verification): every drafter gives
the tokens decoding alone gives — greedy and seeded sampling, with drafts kept, cut and refused —
the rejected guesses leave no cells behind, and max_tokens, stop strings, constraints, several
slots, a failing drafter and the timings behave as without one."""

from __future__ import annotations

import numpy as np
import pytest

from llamapy.api import Llama
from llamapy.engine import Engine, Request
from llamapy.model.constrain import ConstraintSpec
from llamapy.model.sampler import SamplingParams
from llamapy.speculative import CallableDrafter, ModelDrafter, NgramDrafter, PromptLookup, SpecParams
from llamapy.types import LlamapyError

from conftest import write_llama_gguf

GREEDY = SamplingParams(temp=0, ignore_eos=True)
SEEDED = SamplingParams(temp=0.9, seed=7, ignore_eos=True)
PROMPT = "the cat and the dog and the cat and the dog and the cat"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("spec")
    return write_llama_gguf(d / "target.gguf", seed=3), write_llama_gguf(d / "other.gguf", seed=4, n_layer=1)


@pytest.fixture(scope="module")
def llm(files):
    m = Llama(files[0], n_ctx=512, n_threads=1)
    yield m
    m.close()


def run(llm: Llama, req: Request, draft=None, n_parallel: int = 1) -> list:  # noqa: ANN001
    llm.ctx.kv.clear()
    eng = Engine(llm.ctx, n_parallel=n_parallel, draft=draft)
    return list(eng.generate(req))


def toks(evs: list) -> list[int]:
    return [e.token for e in evs if e.kind == "token"]


class Guess:
    """A drafter guessing the reference's next tokens with every third guess wrong: drafts
    kept in part at every step."""

    def __init__(self, ref: list[int], n_prompt: int, n_vocab: int) -> None:
        self.ref, self.n_prompt, self.n_vocab, self.calls = ref, n_prompt, n_vocab, 0

    def draft(self, seq: int, tokens, n_max: int) -> list[int]:  # noqa: ANN001
        self.calls += 1
        i = len(tokens) - self.n_prompt  # generated tokens so far (the pending one included)
        out = list(self.ref[i : i + min(n_max, 5)])
        if len(out) > 2:
            out[2] = (out[2] + 1) % self.n_vocab
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_drafter_gives_the_tokens_of_decoding_alone(llm: Llama, files, sampling: SamplingParams) -> None:
    prompt = llm.tokenize(PROMPT)
    ref = toks(run(llm, Request(prompt, 40, sampling)))
    other = Llama(files[1], n_ctx=512, n_threads=1)
    same = Llama(files[0], n_ctx=512, n_threads=1)
    try:
        drafters = {
            "ngram": NgramDrafter(3, 8),
            "lookup": PromptLookup(2, 6),
            "guess": Guess(ref, len(prompt), llm.model.params.n_vocab),
            "other model": ModelDrafter(other.ctx, n_max=4),
            "same model": ModelDrafter(same.ctx, n_max=4),
        }
        for name, d in drafters.items():
            evs = run(llm, Request(prompt, 40, sampling), d)
            assert toks(evs) == ref, name
            t = evs[-1].timings
            assert t.draft_n_accepted <= t.draft_n, name
            if name in ("guess", "same model"):
                assert t.draft_n > 0 and t.draft_n_accepted > 0, name
            if name == "same model" and sampling is GREEDY:
                assert t.draft_n_accepted == t.draft_n  # its own greedy guesses are all kept
            if name == "guess":
                assert 0 < t.draft_n_accepted < t.draft_n
                assert "draft_n" in t.to_dict()
    finally:
        other.close()
        same.close()


def test_rejected_guesses_leave_no_cells(llm: Llama) -> None:
    prompt = llm.tokenize(PROMPT)
    ref = toks(run(llm, Request(prompt, 30, GREEDY)))
    g = Guess(ref, len(prompt), llm.model.params.n_vocab)
    eng = Engine(llm.ctx, n_parallel=1, draft=g)
    llm.ctx.kv.clear()
    evs = list(eng.generate(Request(prompt, 30, GREEDY)))
    assert toks(evs) == ref
    slot = eng.slots[0]
    # the cache holds exactly the tokens evaluated: the prompt and all generated but the last
    assert slot.cached == prompt + ref[:-1]
    assert llm.ctx.kv.n_used() == len(slot.cached)
    assert g.calls < 30  # several tokens a step


def test_limits_stops_and_constraints_as_without_a_drafter(llm: Llama) -> None:
    prompt = llm.tokenize(PROMPT)
    d = NgramDrafter(2, 16)
    for n in (1, 2, 7):  # max_tokens cuts a run of kept guesses exactly
        evs = run(llm, Request(prompt, n, GREEDY), d)
        assert len(toks(evs)) == n and evs[-1].finish_reason == "length"
        assert toks(evs) == toks(run(llm, Request(prompt, n, GREEDY)))
    text = llm.detokenize(toks(run(llm, Request(prompt, 30, GREEDY))))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    a, b = (run(llm, Request(prompt, 30, GREEDY, stop=[stop]), x) for x in (None, d))
    assert [e.text for e in a] == [e.text for e in b] and b[-1].finish_reason == "stop"
    spec = ConstraintSpec("gbnf", 'root ::= ("the" | " cat" | " dog" | " and")+')
    a, b = (run(llm, Request(prompt, 20, GREEDY, constraint=spec), x) for x in (None, d))
    assert toks(a) == toks(b)


def test_several_slots_with_a_draft_model(llm: Llama, files) -> None:
    prompts = [llm.tokenize(p) for p in (PROMPT, "a b c d e a b c d", "she said it and she")]
    refs = [toks(run(llm, Request(p, 16, GREEDY))) for p in prompts]
    same = Llama(files[0], n_ctx=512, n_threads=1)
    try:
        llm.ctx.kv.clear()
        eng = Engine(llm.ctx, n_parallel=3, n_ctx_slot=160, draft=ModelDrafter(same.ctx, n_max=3))
        out: dict[int, list] = {}
        ids = [eng.submit(Request(p, 16, GREEDY), lambda ev: out.setdefault(ev.id, []).append(ev)) for p in prompts]
        for _ in range(500):
            if all(i in out and out[i][-1].kind == "done" for i in ids):
                break
            eng.step()
        assert [toks(out[i]) for i in ids] == refs
        assert eng.metrics.n_draft_accepted_total > 0 and eng.metrics.n_drafts_total > 0
    finally:
        same.close()


def test_a_failing_drafter_ends_its_request_only(llm: Llama) -> None:
    class Broken:
        def draft(self, seq, tokens, n_max):  # noqa: ANN001, ANN202
            raise RuntimeError("no guess")

        def close(self) -> None:
            pass

    evs = run(llm, Request(llm.tokenize(PROMPT), 8, GREEDY), Broken())
    assert evs[-1].finish_reason == "error" and "drafting failed" in evs[-1].error
    bad = CallableDrafter(lambda ids: np.array([10**6]), llm.model.params.n_vocab)
    evs = run(llm, Request(llm.tokenize(PROMPT), 8, GREEDY), bad)
    assert evs[-1].finish_reason == "error" and "outside the vocabulary" in evs[-1].error


def test_the_api_takes_llama_cpp_pythons_draft_model(files) -> None:
    from llamapy import LlamaPromptLookupDecoding

    with Llama(files[0], n_ctx=256, n_threads=1) as plain:
        ref = plain.generate(PROMPT, 24, temp=0, ignore_eos=True).tokens
        ref_c = plain.create_completion(PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"]
    def drafted(m: Llama) -> list[int]:  # the greedy tokens, checking that the drafter took part
        r = m.generate(PROMPT, 24, temp=0, ignore_eos=True)
        assert r.timings.n_drafted > 0
        return r.tokens

    with Llama(files[0], n_ctx=256, n_threads=1, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4)) as m:
        assert drafted(m) == ref
        assert [c.token for c in m.stream(PROMPT, 24, temp=0, ignore_eos=True)] == ref
        assert m.create_completion(PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"] == ref_c
        assert m._engine().metrics.n_draft_tokens_total > 0  # the create_* methods draft too
    with Llama(files[0], n_ctx=256, n_threads=1, draft_model=lambda ids: ids[-3:]) as m:  # any callable
        assert drafted(m) == ref
    with Llama(files[0], n_ctx=256, n_threads=1, draft_model=str(files[1]), spec=SpecParams("draft-simple", n_max=2)) as m:
        assert isinstance(m.draft, ModelDrafter) and m.draft.n_max == 2
        assert drafted(m) == ref
        owner = m.draft.owner
    assert owner.closed  # close() closes the draft model too
    with pytest.raises(LlamapyError, match="needs a draft model"):
        Llama(files[0], n_ctx=256, n_threads=1, spec=SpecParams("draft-simple"))


def test_cli_run_and_its_errors(files, default_model) -> None:  # noqa: ANN001
    """`llamapy run` with -md / --spec-type: the plain run's text, the acceptance line; bad flags,
    a missing draft and a draft of another vocabulary in one line each, before anything runs."""
    import subprocess
    import sys

    target = str(files[0])

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llamapy", "run", target, "-t", "1", "-c", "256", *args],
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    base = ["-p", PROMPT, "-n", "24", "--temp", "0", "--ignore-eos"]
    plain = cli(*base)
    assert plain.returncode == 0, plain.stderr
    for flags in (["-md", str(files[1]), "--spec-draft-n-max", "4"], ["--spec-type", "ngram-simple",
                  "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "4"]):  # fmt: skip
        r = cli(*base, *flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout == plain.stdout
        assert "common_speculative_init:" in r.stderr and "draft acceptance = " in r.stderr
    for flags, needle in ((["-md", "/nonexistent/d.gguf"], "-md /nonexistent/d.gguf: no such file"),
                          (["--spec-type", "eagle"], "--spec-type eagle"),
                          (["--spec-type", "draft-simple"], "needs a draft model (-md FNAME)"),
                          (["-md", target, "--spec-type", "ngram-simple"], "drafts with --spec-type draft-simple"),
                          (["--spec-type", "ngram-simple", "--spec-draft-p-min", "2"], "--spec-draft-p-min 2"),
                          (["-md", str(default_model)], "vocabulary does not match the target's: vocabulary type")):  # fmt: skip
        r = cli("-p", "hi", "-n", "2", *flags)
        err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert r.returncode == 1 and "Traceback" not in r.stderr and len(err) == 1 and needle in err[0], (flags, r.stderr)


def test_server_drafts_and_counts(files, tmp_path: "os.PathLike[str]") -> None:  # noqa: ANN001, F821
    """`serve -md`: completions as without a draft, llama-server's draft_n / draft_n_accepted in
    the timings and its spec_decode_* counters in /metrics."""
    pytest.importorskip("fastapi")
    import httpx
    from serving import Server

    s = Server(files[0], ["-np", "2", "-c", "256", "-t", "1", "-md", str(files[0]), "--metrics"], tmp_path / "server.log")
    try:
        body = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.url + "/completion", json=body, timeout=60).json()
        with Llama(files[0], n_ctx=256, n_threads=1) as m:
            assert r["tokens"] == m.generate(PROMPT, 16, temp=0, ignore_eos=True).tokens
        assert r["timings"]["draft_n"] > 0 and r["timings"]["draft_n_accepted"] == r["timings"]["draft_n"]
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert f"llamacpp:spec_decode_num_draft_tokens_total {r['timings']['draft_n']}" in metrics
        assert "llamacpp:spec_decode_num_drafts_total" in metrics
    finally:
        s.stop()
