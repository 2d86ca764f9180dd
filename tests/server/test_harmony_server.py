"""gpt-oss's harmony replies through `llamapy serve` and OpenAI's client: a tiny random gpt-oss file
with the harmony special tokens and the real chat template (tests/model/moe_models.py). The text
is forced by a grammar or by the tool call's own grammar: the weights are random."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from moe_models import SHAPES, write_gptoss_gguf, write_harmony_vocab  # noqa: E402
from serving import Server  # noqa: E402

TEMPLATE = (Path(__file__).resolve().parents[1] / "unit" / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
PARAMS = {"type": "object", "properties": {"location": {"enum": ["Paris", "Oslo"]}}, "required": ["location"],
          "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SEED = 2  # (test_gptoss_chat.py: this file's greedy forced reply opens with the call)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp("harmony")
    path = write_gptoss_gguf(d / "g.gguf", **SHAPES["tiny-gptoss"], vocab=write_harmony_vocab(d / "v.gguf"),
                             chat_template=TEMPLATE, seed=SEED)  # fmt: skip
    s = Server(path, ["-c", "1024", "-t", "1"], d / "serve.log")
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    yield c
    c.close()
    s.stop()


def test_reasoning_content_and_calls_over_http(client) -> None:  # noqa: ANN001
    g = 'root ::= "<|channel|>analysis<|message|>Greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"'
    chunks = list(client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=100, stream=True,
                                                 extra_body={"grammar": g, "reasoning_effort": "low"}))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Greeting."
    assert "".join(d.content or "" for d in deltas) == "Hi!"
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=100, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["location"] in ("Paris", "Oslo")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="x", messages=ASK, max_tokens=4, extra_body={"reasoning_effort": "max"})
    assert info.value.status_code == 400 and "reasoning_effort" in str(info.value)
