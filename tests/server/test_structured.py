"""Structured output and tool calls through `llamapy serve`, driven with the official `openai`
client: response_format json_schema (every reply validated with `jsonschema`), json_object, tools
with tool_choice required (non-streamed and streamed, then the tool's result and a final answer)
on the default model (SmolLM2, whose chatml template knows no tools: the generic JSON format) and
on tiny random models carrying real templates (Qwen3's hermes `<tool_call>`, Llama 3.2's JSON,
Mistral Nemo's `[TOOL_CALLS]`, Gemma 2's template with no system turn), and bad requests (400s
naming the field and the position)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from conftest import write_llama_gguf  # noqa: E402
from serving import Server  # noqa: E402

from llamapy.types import LlamapyError  # noqa: E402

TEMPLATES = Path(__file__).resolve().parents[1] / "unit" / "chat_templates"
OBJ = {"type": "object", "additionalProperties": False}


def obj(props: dict, required: list[str] | None = None, **kw: object) -> dict:
    return dict(OBJ, properties=props, required=list(props) if required is None else required, **kw)


STR = {"type": "string", "maxLength": 12}
# (prompt, schema): nested objects, arrays with bounds, enums, required/optional, numbers with
# ranges, strings with patterns; each allows a short answer
SCHEMAS = [
    ("Describe a person: name and age.", obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Give a person's first and last name.", obj({"person": obj({"first": STR, "last": STR})})),
    ("List two or three colors.", obj({"colors": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}})),
    ("Is the sky green?", obj({"answer": {"enum": ["yes", "no", "maybe"]}})),
    ("What is the temperature today in Celsius?", obj({"temperature": {"type": "integer", "minimum": -50, "maximum": 50}})),
    ("Give a US zip code.", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("Name a city, and its country if you know it.", obj({"city": STR, "country": STR}, required=["city"])),
    ("A shopping list of one or two items with quantities.", obj({"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                                                  "items": obj({"name": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("Is Paris the capital of France?", obj({"is_capital": {"type": "boolean"}})),
    ("Three numbers between 1 and 100.", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 100}, "minItems": 3, "maxItems": 3}),
    ("A ticket's priority and status.", obj({"priority": {"type": "integer", "enum": [1, 2, 3]}, "status": {"type": "string", "enum": ["open", "closed"]}})),
    ("What is today's date?", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("Rate this on a scale of 0 to 10.", obj({"rating": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}})),
    ("A nested value.", obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})})),
    ("Report the version and whether it is ok.", obj({"version": {"const": "1.0"}, "ok": {"type": "boolean"}})),
    ("A small number or a short word.", obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "maxLength": 5}]}})),
    ("An airport code.", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}})),
    ("A line segment from one point to another.", {"$defs": {"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                            "y": {"type": "integer", "minimum": -9, "maximum": 9}})},
                                                   **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    ("Your middle name, if any.", obj({"middle_name": {"type": ["string", "null"], "maxLength": 10}})),
    ("Tag this with colors and a score from 0 to 10.", obj({"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
                                                            "score": {"type": "integer", "minimum": 0, "maximum": 10}})),
]  # fmt: skip

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": obj({"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"])}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": obj({"tz": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$", "maxLength": 20}})}}  # fmt: skip
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def smol(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Server(default_model, ["-np", "2", "-c", "4096", "-t", "2"], tmp_path_factory.mktemp("log") / "smol.log", ready_s=600)
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600)
    yield s, c
    c.close()
    s.stop()


def check_schema_reply(client, prompt: str, schema: dict) -> None:
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}})  # fmt: skip
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content  # the grammar completed, not cut off
    jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_replies_validate(smol, i: int) -> None:
    """All twenty in the fast suite: ~0.7 s each on 2 cores (greedy, short answers)."""
    check_schema_reply(smol[1], *SCHEMAS[i])


def test_json_object_and_llama_server_fields(smol) -> None:
    s, c = smol
    ask = 'Reply with a JSON object with one key, "answer", whose value is the capital of France.'
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": ask}],
                                  temperature=0, max_tokens=100, response_format={"type": "json_object"})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    schema = obj({"n": {"type": "integer", "minimum": 1, "maximum": 9}})
    for path, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 40}),
                       ("/v1/completions", {"prompt": "A number:", "max_tokens": 40}),
                       ("/completion", {"prompt": "A number:", "n_predict": 40})):  # fmt: skip
        r = httpx.post(s.url + path, json=dict(body, json_schema=schema, temperature=0), timeout=600)
        assert r.status_code == 200, r.text
        j = r.json()
        text = j["content"] if path == "/completion" else (j["choices"][0].get("message") or j["choices"][0])
        text = text if isinstance(text, str) else text.get("content") or text.get("text")
        jsonschema.validate(json.loads(text), schema)
    g = httpx.post(s.url + "/v1/chat/completions", timeout=600, json={
        "messages": ASK, "temperature": 0, "max_tokens": 20, "grammar": 'root ::= ("yes" | "no") "."'}).json()  # fmt: skip
    assert g["choices"][0]["message"]["content"] in ("yes.", "no.")


def accumulate(stream) -> tuple[dict, str]:
    """A streamed chat reply put back together as OpenAI clients do it."""
    msg: dict = {"content": "", "tool_calls": []}
    finish = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        msg["content"] += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index == len(msg["tool_calls"]):
                assert tc.id and tc.type == "function" and tc.function.name
                msg["tool_calls"].append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            msg["tool_calls"][tc.index]["arguments"] += tc.function.arguments or ""
            msg["pieces"] = msg.get("pieces", 0) + bool(tc.function.arguments)
        finish = ch.finish_reason or finish
    return msg, finish


def tool_round(client, tools: list, choice, first: str | None = None, n: int = 120) -> list[dict]:
    """tool_choice forces a call (non-streamed and streamed); its arguments validate; the tool's
    result goes back and the model answers in words. Returns the conversation."""
    r = client.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice=choice, temperature=0, max_tokens=n)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch.message
    call = ch.message.tool_calls[0]
    if first:
        assert call.function.name == first
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    streamed, finish = accumulate(client.chat.completions.create(
        model="x", messages=ASK, tools=tools, tool_choice=choice, temperature=0, max_tokens=n, stream=True))  # fmt: skip
    assert finish == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]  # fmt: skip
    assert streamed["pieces"] > 2  # a forced call's arguments stream as they are written
    convo = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]  # fmt: skip
    # the answer: tools still offered but not wanted now (a 135M model given `auto` calls again)
    final = client.chat.completions.create(model="x", messages=convo, tools=tools, tool_choice="none", temperature=0, max_tokens=24)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    answer, _ = accumulate(client.chat.completions.create(model="x", messages=convo, tools=tools, tool_choice="none",
                                                          temperature=0, max_tokens=24, stream=True))  # fmt: skip
    assert answer["content"] == final.choices[0].message.content
    return convo


def test_tools_required_on_the_default_model(smol) -> None:
    tool_round(smol[1], TOOLS, "required")
    tool_round(smol[1], TOOLS, {"type": "function", "function": {"name": "get_time"}}, first="get_time")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tpl")
    # SentencePiece with add_space_prefix (as Llama 2's): the text a grammar forces must be
    # tokenized without the leading space (constrain._Wrapper), or the first forced token dies
    return {p.stem: write_llama_gguf(d / f"{p.stem}.gguf", seed=7, chat_template=p.read_text())
            for p in TEMPLATES.glob("*.jinja")}


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "meta-llama-Llama-3.2-3B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407",
                                  "google-gemma-2-2b-it"])  # fmt: skip
def test_tools_required_with_real_templates(tiny_models: dict[str, Path], tmp_path: Path, name: str) -> None:
    """Random weights: only the grammar makes these calls; each family's own syntax is forced and
    read back. Llama 3.2's template takes one call per turn, Mistral's wants its 9-character ids."""
    s = Server(tiny_models[name], ["-c", "8192", "-t", "1"], tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600)
        # (byte tokens: every character is a token, and random weights like JSON's optional whitespace)
        convo = tool_round(c, TOOLS, "required", n=1000)
        if "Mistral" in name:
            assert len(convo[1]["tool_calls"][0]["id"]) == 9
        # auto: the lazy grammar (free text until a call opens) runs in the engine too
        r = c.chat.completions.create(model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=16)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        c.close()
    finally:
        s.stop()


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": obj({"a": {"type": "integer", "minimum": "zero"}})}}},
     "response_format.json_schema.schema at /properties/a/minimum: invalid json schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": obj({"a": {"type": "array", "uniqueItems": True}})}}},
     'Unimplemented keys: ["uniqueItems"] at /properties/a'),  # a keyword llguidance cannot enforce: refused, not ignored
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}}, "at /type"),
    ({"tools": [dict(WEATHER, function=dict(WEATHER["function"], parameters={"type": "object", "properties": {"a": {"type": "int"}}}))]},
     "tools[0].function.parameters at /properties/a/type"),
    ({"json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}, "only one of"),
    ({"grammar": "root ::= foo"}, "grammar: invalid"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"tools": TOOLS, "grammar": "root ::= \"a\""}, "cannot be combined with 'tools'"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0] must be"),
    ({"response_format": {"type": "yaml"}}, "response_format type 'yaml'"),
    ({"messages": [{"role": "tool", "content": "x", "tool_calls": []}]}, "unsupported field(s) ['tool_calls']"),
])  # fmt: skip
def test_bad_requests_name_the_field_and_position(smol, body: dict, needle: str) -> None:
    r = httpx.post(smol[0].url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=600)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error" and "\n" not in err["message"]
    with pytest.raises(openai.BadRequestError, match="invalid json schema"):  # the official client sees a 400
        smol[1].chat.completions.create(model="x", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}})  # fmt: skip


def test_python_api_tools_and_reasoning(tiny_models: dict[str, Path]) -> None:
    """Llama.create_chat_completion(tools=, tool_choice=) as llama-cpp-python's, and Qwen3's
    <think> split into reasoning_content (here written by a grammar: the weights are random)."""
    from llamapy.api import Llama

    with Llama(tiny_models["Qwen-Qwen3-0.6B"], n_ctx=8192, n_threads=1) as llm:
        r = llm.create_chat_completion(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0, max_tokens=1000)  # fmt: skip
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert r["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS["get_weather"])
        # (no spaces: this byte vocabulary writes a space only inside its few word tokens)
        think = 'root ::= "<think>\\nA_greeting.\\n</think>\\n\\nHello!"'
        r = llm.create_chat_completion(ASK, grammar=think, temperature=0, max_tokens=100)
        msg = r["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("A_greeting.", "Hello!")
        chunks = list(llm.create_chat_completion(ASK, grammar=think, temperature=0, max_tokens=100, stream=True))
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "A_greeting."
        assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
        assert not any("<think>" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)
        with pytest.raises(LlamapyError, match="not among the tools"):
            llm.create_chat_completion(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_dead_end_keeps_its_finish_reason() -> None:
    """The engine's "grammar_dead_end" reaches the client as such (streamed and not), never "stop"."""
    from llamapy.engine import Event, Usage
    from llamapy.server.protocol import Responder

    done = Event(0, "done", finish_reason="grammar_dead_end", error="the grammar reached a dead end", usage=Usage(3))
    assert Responder("chat", "m", None).response([done])["choices"][0]["finish_reason"] == "grammar_dead_end"
    assert Responder("chat", "m", None).end_chunks(done, False)[-1]["choices"][0]["finish_reason"] == "grammar_dead_end"


def test_what_each_request_asks_of_the_engine(tiny_models: dict[str, Path]) -> None:
    """The format, the constraint and the prompt chat_request hands the engine (llama.cpp's
    choices), without generating."""
    from llamapy.model.tokenizer import Tokenizer
    from llamapy.server.protocol import ChatTemplate, chat_request

    path = tiny_models["Qwen-Qwen3-0.6B"]
    tok = Tokenizer.from_file(path)
    tpl = ChatTemplate((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(), "<s>", "</s>")

    def plan(**body: object):  # noqa: ANN202
        p = chat_request({"messages": ASK, **body}, tok, tpl)
        return p.syntax, p.request.constraint, p.prompt_text

    syntax, spec, prompt = plan(tools=TOOLS)  # auto: free text, a call it opens held to the tools
    assert (syntax.format, syntax.parse_tools, syntax.reasoning, syntax.forced) == ("hermes", True, True, False)
    assert spec.kind == "lark" and spec.source.startswith("start: TEXT | head ")
    assert "<tools>" in prompt and '"name": "get_time"' in prompt
    syntax, spec, _ = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
    assert spec.kind == "lark" and spec.source.startswith('start: call ("\\n" call)*') and "get_time" in spec.source
    _, spec, _ = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in spec.source and "get_weather" not in spec.source
    syntax, spec, prompt = plan(tools=TOOLS, tool_choice="none")  # nothing offered, nothing read
    assert (syntax.format, syntax.parse_tools, spec) == ("content", False, None) and "<tools>" not in prompt
    # tools with a schema: llama.cpp's generic format, a call or the schema's response
    schema = obj({"n": {"type": "integer"}})
    syntax, spec, _ = plan(tools=TOOLS, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert syntax.format == "generic" and spec.kind == "json_schema"
    assert json.loads(spec.source)["anyOf"][1]["properties"]["response"] == schema
    # a conversation that carries calls renders without tools offered, and a template without
    # tools gets them written into its turns
    convo = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    p = chat_request({"messages": convo}, tok, tpl)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in p.prompt_text
    gemma = ChatTemplate((TEMPLATES / "google-gemma-2-2b-it.jinja").read_text(), "<s>", "</s>")
    p = chat_request({"messages": convo, "tools": TOOLS}, tok, gemma)
    assert p.syntax.format == "generic" and "You can call any of the following tools" in p.prompt_text
    assert '{"tool_response": {"tool": "get_weather", "content": "sunny"}}' in p.prompt_text
