"""The default model and tiny32 end to end against llama.cpp's reference files
(../shared/reference: token ids, greedy continuations), plus the graph dump of a decode step."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

import llamapy
from llamapy.context import ContextOptions
from tests_support import shared

pytestmark = []


def _run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llamapy", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smol(default_model):  # noqa: ANN001, ANN201
    with llamapy.Llama(default_model, context_options=ContextOptions(n_ctx=512)) as llm:
        yield llm


def _greedy_refs() -> list[dict]:
    lines = shared("reference", "smollm2", "greedy_f32.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def test_teacher_forced_greedy_matches_llama_cpp(smol) -> None:  # noqa: ANN001
    """Feed prompt + reference continuation (tokenized separately); the reference token's logit
    must be within 0.1 of the largest logit at >= 95 % of the continuation positions."""
    hits = total = 0
    for ref in _greedy_refs():
        p = smol.tokenize(ref["prompt"])
        c = smol.tokenizer.encode(ref["text"], add_special=False, parse_special=False)
        lg = smol.logits(p + c)
        for j, tok in enumerate(c):
            row = lg[len(p) + j - 1]
            hits += int(row.max() - row[tok] <= 0.1)
            total += 1
    assert total > 100
    assert hits / total >= 0.95, f"{hits}/{total}"


def test_free_running_greedy_first_tokens(smol) -> None:  # noqa: ANN001
    for ref in _greedy_refs():
        want = smol.tokenizer.encode(ref["text"], add_special=False, parse_special=False)[:4]
        got = smol.generate(ref["prompt"], n_predict=8, temp=0).tokens[:4]
        assert got == want, ref["prompt"]


def test_cli_run_streams_the_greedy_text(default_model) -> None:  # noqa: ANN001
    ref = _greedy_refs()[0]
    r = _run_cli("run", str(default_model), "-p", ref["prompt"], "-n", "48", "--temp", "0", "-c", "512")
    assert r.returncode == 0, r.stderr
    with llamapy.Llama(default_model, n_ctx=512) as llm:
        want = llm.tokenizer.encode(ref["text"], add_special=False)[:4]
        got = llm.tokenizer.encode(r.stdout, add_special=False)[:4]
    assert got == want
    assert "prompt eval time" in r.stderr and "eval time" in r.stderr and "load time" in r.stderr
    assert ref["prompt"] not in r.stdout  # no prompt echo on stdout


@pytest.mark.parametrize("name", ["tempest", "macbeth"])
def test_cli_tokenize_equals_llama_tokenize(default_model, name: str) -> None:  # noqa: ANN001
    text = shared("data", "text", f"{name}.txt")
    r = _run_cli("tokenize", str(default_model), "-f", str(text), "--ids")
    assert r.returncode == 0, r.stderr
    want = ast.literal_eval(shared("reference", "smollm2", f"{name}.ids").read_text())
    assert ast.literal_eval(r.stdout) == want


def test_cli_tokenize_tiny32_spm(tiny32) -> None:  # noqa: ANN001
    r = _run_cli("tokenize", str(tiny32), "-f", str(shared("data", "text", "tempest.txt")), "--ids")
    assert r.returncode == 0, r.stderr
    assert ast.literal_eval(r.stdout) == ast.literal_eval(shared("reference", "tiny32", "tempest.ids").read_text())


def test_detokenize_gives_the_text_back(smol) -> None:  # noqa: ANN001
    for name in ("tempest", "macbeth"):
        data = shared("data", "text", f"{name}.txt").read_bytes()
        ids = ast.literal_eval(shared("reference", "smollm2", f"{name}.ids").read_text())
        assert smol.tokenizer.detokenize(ids) == data


def test_tiny32_runs_end_to_end_and_decode_graph_is_one_cpu_split(tiny32) -> None:  # noqa: ANN001
    with llamapy.Llama(tiny32, n_ctx=256) as llm:
        res = llm.generate("Hello", n_predict=4, temp=0)
        assert len(res.tokens) >= 1
        n_past = len(llm.tokenize("Hello")) + len(res.tokens)
        llm.ctx.decode([res.tokens[-1]], [n_past])
        g = llm.ctx.graph(1, 1)
        plan = llm.ctx.sched.reserve(g.graph)
        assert len(plan.splits) == 1 and llm.ctx.backends[plan.splits[0].backend].name == "CPU"
        dump = g.graph.dump()
        ops_seen = {line.split()[1] for line in dump.splitlines()}
        assert {"GET_ROWS", "RMS_NORM", "MUL", "MUL_MAT", "ROPE", "SET_ROWS", "VIEW",
                "FLASH_ATTN_EXT", "RESHAPE", "ADD", "GLU"} <= ops_seen  # fmt: skip
        assert len(dump.splitlines()) == len(g.graph.nodes)
        n_mats = sum(1 for layer in llm.model.weights.layers for t in layer.values() if len(t.shape) == 2)
        assert sum(1 for n in g.graph.nodes if n.op.name == "MUL_MAT") == n_mats + 1


@pytest.mark.parametrize("module", ["llama", "qwen2", "qwen3", "gemma3", "layers", "base"])
def test_graph_modules_import_no_kernels(module: str) -> None:
    import importlib

    m = importlib.import_module(f"llamapy.models.{module}")
    tree = ast.parse(open(m.__file__).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("numpy" in i or "kernels" in i or "qmatmul" in i or "cupy" in i for i in imported), imported


def test_ignore_eos_never_samples_an_end_of_generation_token(make_llama) -> None:  # noqa: ANN001
    from llamapy.generate import GenerationResult, stream
    from llamapy.model.sampler import SamplingParams

    with llamapy.Llama(make_llama(n_layer=1), context_options=ContextOptions(n_ctx=64)) as llm:
        eog = sorted(llm.tokenizer.eog_ids)
        assert eog
        decode = llm.ctx.decode

        def eos_wins(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            out = decode(*a, **kw)
            out[:, eog[0]] = 1e9  # the model "wants" to stop at every step
            return out

        llm.ctx.decode = eos_wins  # type: ignore[method-assign]
        res = GenerationResult()
        assert list(stream(llm.ctx, [1, 2, 3], 5, SamplingParams(temp=0), res)) == []
        assert res.finish_reason == "stop"
        res = GenerationResult()
        chunks = list(stream(llm.ctx, [1, 2, 3], 5, SamplingParams(temp=0, ignore_eos=True), res))
        assert len(chunks) == 5 and res.finish_reason == "length"
        assert not set(res.tokens) & set(eog)
