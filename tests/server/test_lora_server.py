"""LoRA adapters in the engine and `llamapy serve` (llama-server's --lora, --lora-init-without-apply,
GET/POST /lora-adapters and a request's "lora" list): requests with different scales run side
by side with the tokens each gets alone, a slot's cached prefix is reused only under the same
scales, and bad lists are a 400."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from llamapy.api import Llama
from llamapy.context import ModelOptions
from llamapy.engine import Engine, Request
from llamapy.model.sampler import SamplingParams
from llamapy.types import LlamapyError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from family_models import write_family_gguf, write_lora_gguf  # noqa: E402

GREEDY = SamplingParams(temp=0, ignore_eos=True)
TARGETS = (r"blk\.\d+\.(attn_q|attn_v|ffn_down)\.weight", "output.weight")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("lora")
    model = write_family_gguf(d / "m.gguf", "qwen3", tied=False, seed=4)
    return model, write_lora_gguf(model, d / "a.gguf", TARGETS, seed=1), write_lora_gguf(model, d / "b.gguf", TARGETS, seed=2)


def _alone(model: Path, lora: list[tuple[str, float]], prompt: list[int], n: int) -> list[int]:
    with Llama(model, model_options=ModelOptions(lora=lora), n_ctx=256) as llm:
        return llm.generate(prompt, n, temp=0, ignore_eos=True).tokens


def _run(engine: Engine, reqs: list[Request]) -> list[list[int]]:
    out: dict[int, list] = {}
    ids = [engine.submit(r, lambda ev: out.setdefault(ev.id, []).append(ev)) for r in reqs]
    for _ in range(2_000):
        if all(i in out and out[i][-1].kind == "done" for i in ids):
            break
        engine.step()
    return [[e.token for e in out[i] if e.kind == "token"] for i in ids]


def test_requests_with_different_scales_side_by_side(files: tuple[Path, Path, Path]) -> None:
    model, a, b = files
    prompt = [1, 260, 40, 75, 262, 100]
    scales = [(1.0, 0.0), (0.0, 1.0), (0.0, 0.0), (0.5, 2.0)]
    refs = [_alone(model, [(str(a), sa), (str(b), sb)], prompt, 10) for sa, sb in scales]
    assert len({tuple(r) for r in refs}) >= 3  # the adapters change the text
    with Llama(model, model_options=ModelOptions(lora=[(str(a), 1.0), (str(b), 1.0)]), n_ctx=512) as llm:
        eng = Engine(llm.ctx, n_parallel=4, n_ctx_slot=128)
        assert eng.lora == (1.0, 1.0)
        got = _run(eng, [Request(prompt, 10, GREEDY, lora=s) for s in scales])
        assert got == refs
        # the same prompt under the same scales reuses a slot's cached prefix; under others, none
        assert eng.metrics.prompt_tokens_cached_total == 0
        assert _run(eng, [Request(prompt, 10, GREEDY, lora=(1.0, 0.0))]) == [refs[0]]
        cached = eng.metrics.prompt_tokens_cached_total
        assert cached == len(prompt) - 1
        assert _run(eng, [Request(prompt, 10, GREEDY, lora=(0.25, 0.0))]) == [_alone(model, [(str(a), 0.25), (str(b), 0.0)], prompt, 10)]
        assert eng.metrics.prompt_tokens_cached_total == cached
        # a request naming none runs with the engine's scales
        eng.lora = (0.0, 1.0)
        assert _run(eng, [Request(prompt, 10, GREEDY)]) == [refs[1]]
        with pytest.raises(LlamapyError, match="lora: expected a finite scale for each of the 2 adapters"):
            eng.submit(Request(prompt, 4, GREEDY, lora=(1.0,)), lambda ev: None)


pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server(files: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory):
    from serving import Server

    model, a, b = files
    s = Server(model, ["-np", "2", "-c", "256", "-t", "1", "--lora", str(a), "--lora-scaled", f"{b}:0.5",
                       "--lora-init-without-apply"], tmp_path_factory.mktemp("log") / "server.log")  # fmt: skip
    yield s
    s.stop()


def _complete(server, lora: list | None = None) -> list[int]:  # noqa: ANN001
    body = {"prompt": [1, 260, 40, 75, 262, 100], "n_predict": 10, "temperature": 0, "ignore_eos": True}
    if lora is not None:
        body["lora"] = lora
    r = httpx.post(server.url + "/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_server_lora_endpoints(server, files: tuple[Path, Path, Path]) -> None:  # noqa: ANN001
    model, a, b = files
    prompt = [1, 260, 40, 75, 262, 100]
    listed = httpx.get(server.url + "/lora-adapters", timeout=30).json()
    assert listed == [{"id": 0, "path": str(a), "scale": 0.0, "task_name": "", "prompt_prefix": ""},
                      {"id": 1, "path": str(b), "scale": 0.0, "task_name": "", "prompt_prefix": ""}]  # fmt: skip
    base = _alone(model, [], prompt, 10)
    assert _complete(server) == base  # --lora-init-without-apply: not applied until set
    assert _complete(server, [{"id": 1, "scale": 0.5}]) == _alone(model, [(str(b), 0.5)], prompt, 10)
    assert _complete(server, []) == base  # an empty list: the server's scales, as llama-server
    r = httpx.post(server.url + "/lora-adapters", json=[{"id": 0, "scale": 1.0}], timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}
    assert [x["scale"] for x in httpx.get(server.url + "/lora-adapters", timeout=30).json()] == [1.0, 0.0]
    assert _complete(server) == _alone(model, [(str(a), 1.0)], prompt, 10)
    for body, path in (([{"id": 2, "scale": 1.0}], "/lora-adapters"), ({"id": 0}, "/lora-adapters"),
                       ({"prompt": "ab", "lora": [{"id": 5, "scale": 1}]}, "/completion"),
                       ({"prompt": "ab", "lora": [{"id": 0, "scale": "x"}]}, "/completion"),
                       ({"model": "m", "prompt": "ab", "lora": {"id": 0}}, "/v1/completions")):  # fmt: skip
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    assert "no adapter with id 5 (this server has 2" in httpx.post(
        server.url + "/completion", json={"prompt": "ab", "lora": [{"id": 5, "scale": 1}]}, timeout=30).json()["error"]["message"]
