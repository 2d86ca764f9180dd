"""LLAMAPY_SCHED_DEBUG=1 dumps the splits of every distinct graph that runs — the prompt's and
the decode step's, each once — as ggml prints each graph it splits. The library only calls
`Scheduler.debug_hook`; the CLI writes the text to stderr."""

from __future__ import annotations

import pytest
from sched_support import cli, open_llm


def _dumps(stderr: str) -> list[list[str]]:
    """The split dumps in `stderr`: each starts at a `## SPLIT #0:` line."""
    out: list[list[str]] = []
    for line in stderr.splitlines():
        if line.startswith("## SPLIT #0:"):
            out.append([])
        if line.startswith("## SPLIT") and out:
            out[-1].append(line)
    return out


def test_cli_dumps_prompt_and_decode_graphs_once_each(tiny32) -> None:  # noqa: ANN001
    prompt = " ".join(["hello"] * 40)  # >= 32 tokens: the prompt's big ops go to TEST0
    r = cli("run", tiny32, "-p", prompt, "-n", "6", "--temp", "0", "--ignore-eos", "-ngl", "0", "-c", "256",
            env={"LLAMAPY_TEST_GPU": "1", "LLAMAPY_SCHED_DEBUG": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    dumps = _dumps(r.stderr)
    assert len(dumps) >= 3, r.stderr  # the reserve-size graph, the prompt, the decode step
    assert len({tuple(d) for d in dumps}) == len(dumps)  # each distinct graph once
    headers = [line for line in r.stderr.splitlines() if line.startswith("sched: graph #")]
    assert len(headers) == len(dumps)
    # the decode step (one token, weights on the host): a single CPU split, printed once for
    # its five runs
    assert dumps.count(["## SPLIT #0: CPU # 0 inputs:"]) == 1
    # the 40-token prompt: CPU and TEST0 splits
    assert any(len(d) > 1 and any("TEST0" in s for s in d) for d in dumps)


def test_no_dump_without_the_variable(tiny32) -> None:  # noqa: ANN001
    r = cli("run", tiny32, "-p", "hi", "-n", "2", env={"LLAMAPY_TEST_GPU": "1", "LLAMAPY_SCHED_DEBUG": "0"})
    assert r.returncode == 0, r.stderr
    assert "## SPLIT" not in r.stderr and "sched: graph" not in r.stderr


@pytest.fixture
def test_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")


def test_hook_sees_each_graph_that_runs_once(make_llama, test_gpu) -> None:  # noqa: ANN001
    with open_llm(make_llama(n_layer=3), 2) as llm:
        seen = []
        llm.ctx.sched.debug_hook = seen.append
        toks = list(range(1, 41))
        llm.logits(toks)
        llm.logits(toks)  # the same graph again: not shown again
        llm.generate(toks[:3], n_predict=4, temp=0)
    n_tokens = [next(t.shape[0] for t in p.graph.leafs if t.name == "inp_tokens") for p in seen]
    assert n_tokens.count(40) == 1 and n_tokens.count(1) == 1, n_tokens
    assert len({id(p) for p in seen}) == len(seen)
