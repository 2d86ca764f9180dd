"""Tool calls and reasoning read from literal model outputs (llamapy/model/toolcalls.py), the
format chosen from real chat templates (tests/unit/chat_templates/), the prompt they render with
tools, and the streamed deltas adding up to the whole reply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamapy.model.chat import CHATML_TEMPLATE, render_chat
from llamapy.model.toolcalls import (
    ReplyStream,
    Syntax,
    Tool,
    call_grammar,
    detect_format,
    generic_schema,
    message_dict,
    parse,
    prepare_messages,
    template_caps,
    template_variables,
)
from tests_support import matcher_allows_eos, matcher_takes

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
LLAMA32 = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text()
NEMO = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
GEMMA2 = (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text()
WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})  # fmt: skip


def syn(fmt: str, reasoning: bool = False, tools: bool = True) -> Syntax:
    return Syntax(fmt, reasoning=reasoning, parse_tools=tools)


def test_format_detected_from_the_template_as_llama_cpp_does() -> None:
    assert detect_format(QWEN3, True) == "hermes"
    assert detect_format(LLAMA32, True) == "llama3"
    assert detect_format(NEMO, True) == "mistral"
    assert detect_format(GEMMA2, True) == "generic"
    assert detect_format(CHATML_TEMPLATE, True) == "generic"
    assert detect_format(QWEN3, False) == "content"
    assert detect_format(QWEN3, True, with_schema=True) == "generic"  # tools + a JSON schema


@pytest.mark.parametrize("text, calls, content", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})], ""),
    ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}</tool_call>',
     [("a", {}), ("b", {"x": [1, 2]})], "Let me look.\n"),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"k\\": 1}"}\n</tool_call>', [("f", {"k": 1})], ""),
    ("no tools today", [], "no tools today"),
])  # fmt: skip
def test_hermes(text: str, calls: list, content: str) -> None:
    m = parse(text, syn("hermes"))
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == calls
    assert m.content == content


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # unbalanced
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',  # no closing tag
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
    "<tool_call>",
])  # fmt: skip
def test_malformed_calls_are_content(text: str) -> None:
    m = parse(text, syn("hermes"))
    assert m.tool_calls == [] and m.content == text


def test_llama3() -> None:
    m = parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}', syn("llama3"))
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert m.content == ""
    m = parse('<|python_tag|>{"type": "function", "name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": 2}}', syn("llama3"))
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("f", {}), ("g", {"y": 2})]
    for text in ('{"name": "f", "parameters": {', '{"city": "Oslo"}', "The weather is fine."):
        m = parse(text, syn("llama3"))
        assert m.tool_calls == [] and m.content == text


def test_mistral() -> None:
    m = parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcDEF123"}]', syn("mistral"))
    assert [(c.name, json.loads(c.arguments), c.id) for c in m.tool_calls] == [("get_weather", {"city": "Rome"}, "abcDEF123")]
    m = parse('[TOOL_CALLS] [{"name": "a", "arguments": {}, "id": "aaaaaaaaa"}, {"name": "b", "arguments": {"x": 1}, "id": "bbbbbbbbb"}]', syn("mistral"))
    assert [(c.name, c.arguments, c.id) for c in m.tool_calls] == [("a", "{}", "aaaaaaaaa"), ("b", '{"x": 1}', "bbbbbbbbb")]
    for text in ("[TOOL_CALLS][{\"name\": \"f\"}]", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}} junk", "[TOOL_CALLS]{\"name\": \"f\", \"arguments\": {}}", "[TOOL_CALLS][", "plain"):
        m = parse(text, syn("mistral"))
        assert m.tool_calls == [] and m.content == text


def test_generic() -> None:
    m = parse('{"tool_call": {"name": "get_weather", "arguments": {"city": "Lima"}}}', syn("generic"))
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("get_weather", {"city": "Lima"})]
    m = parse('{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"z": 1}}]}', syn("generic"))
    assert [c.name for c in m.tool_calls] == ["a", "b"]
    assert parse('{"response": "Hello there"}', syn("generic")).content == "Hello there"
    assert parse('{"response": {"n": 1}}', syn("generic")).content == '{"n": 1}'
    for text in ('{"tool_call": {"name": "f"}}', '{"response": "x"} trailing', '{"other": 1}', "[1, 2]", "{"):
        m = parse(text, syn("generic"))
        assert m.tool_calls == [] and m.content == text


def test_reasoning_split() -> None:
    text = "<think>\nThe user wants Paris.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
    m = parse(text, syn("hermes", reasoning=True))
    assert m.reasoning_content == "The user wants Paris." and m.content == "" and len(m.tool_calls) == 1
    m = parse("<think>\nhmm\n</think>\n\nHello!", syn("content", reasoning=True, tools=False))
    assert (m.reasoning_content, m.content) == ("hmm", "Hello!")
    m = parse("<think>still thinking", syn("content", reasoning=True, tools=False))
    assert (m.reasoning_content, m.content) == ("still thinking", "")  # unclosed: all reasoning
    m = parse("plain answer", syn("content", reasoning=True, tools=False))
    assert (m.reasoning_content, m.content) == ("", "plain answer")
    m = parse("thought</think>answer", Syntax("content", reasoning=True, thinking_open=True))
    assert (m.reasoning_content, m.content) == ("thought", "answer")


def _stream(text: str, syntax: Syntax, step: int = 1) -> tuple[list[dict], ReplyStream]:
    s, deltas = ReplyStream(syntax), []
    for i in range(0, len(text), step):
        deltas += s.feed(text[i: i + step])
    deltas += s.finish()
    return deltas, s


def _accumulate(deltas: list[dict]) -> dict:
    out: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        out["content"] += d.get("content", "")
        out["reasoning_content"] += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(out["tool_calls"]):
                assert tc["type"] == "function" and tc["id"] and tc["function"]["name"]
                out["tool_calls"].append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            out["tool_calls"][tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return out


@pytest.mark.parametrize("fmt, reasoning, text", [
    ("hermes", True, "<think>\nplan: call it\n</think>\n\nSure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Nice\"}}\n</tool_call>"),
    ("hermes", False, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call> broken"),
    ("llama3", False, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"),
    ("llama3", False, "{\"not\": \"a call\"}"),
    ("mistral", False, "Calling.[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}]"),
    ("generic", False, "{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}}"),
    ("generic", False, "{\"response\": \"It is sunny.\"}"),
    ("content", True, "<think>a</think>b <tool_call> c"),
])  # fmt: skip
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_adds_up_to_the_whole_reply(fmt: str, reasoning: bool, text: str, step: int) -> None:
    syntax = syn(fmt, reasoning, tools=fmt != "content")
    deltas, s = _stream(text, syntax, step)
    whole = parse(text, syntax)
    acc = _accumulate(deltas)
    assert acc["content"] == whole.content and acc["reasoning_content"] == whole.reasoning_content
    assert [(c["name"], c["arguments"]) for c in acc["tool_calls"]] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [c["id"] for c in acc["tool_calls"]] == [c.id for c in s.message.tool_calls]
    if fmt == "mistral":
        assert acc["tool_calls"][0]["id"] == "abcdefghi"  # the model's own id is kept


def test_no_tool_markup_leaks_while_streaming() -> None:
    text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
    s = ReplyStream(syn("hermes"))
    for ch in text:
        for d in s.feed(ch):
            assert "content" not in d  # the tag's first characters are held back, never sent
    assert [d["tool_calls"][0]["function"].get("name") for d in s.finish()] == []  # already sent at the closing tag


def test_message_dict() -> None:
    d = message_dict(parse('{"tool_call": {"name": "f", "arguments": {"a": 1}}}', syn("generic")))
    assert d["content"] is None and d["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert "reasoning_content" not in message_dict(parse("hi", syn("content", tools=False)))


# -- the prompt -----------------------------------------------------------------------------------

CALL = {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "18 C, clear"},
]


def render(template: str, fmt: str) -> str:
    caps = template_caps(template)
    msgs = prepare_messages(CONVERSATION, [WEATHER], fmt, caps)
    return render_chat(template, msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                       **template_variables(fmt, [WEATHER], caps))  # fmt: skip


def test_templates_that_know_tools_render_them_natively() -> None:
    q = render(QWEN3, "hermes")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in q
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in q
    assert "<tool_response>\n18 C, clear\n</tool_response>" in q and q.endswith("<|im_start|>assistant\n")
    ll = render(LLAMA32, "llama3")
    assert "Environment: ipython" in ll and '"name": "get_weather"' in ll.split("<|eot_id|>")[0]  # tools in the system turn
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in ll
    # a string is `iterable` to jinja, so this template writes a tool result through tojson (as under transformers)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C, clear"' in ll
    n = render(NEMO, "mistral")
    assert "[AVAILABLE_TOOLS]" in n and '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]' in n
    assert '[TOOL_RESULTS]{"content": 18 C, clear, "call_id": "abcdefghi"}[/TOOL_RESULTS]' in n


def test_templates_without_tools_get_them_written_into_turns() -> None:
    g = render(GEMMA2, "generic")  # no system turn: the tools go into the first user turn
    first_user = g.split("<end_of_turn>")[0]
    assert "You can call any of the following tools" in first_user and "get_weather" in first_user
    assert "Respond in JSON format" in first_user
    assert '<start_of_turn>model\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}<end_of_turn>' in g
    assert '{"tool_response": {"tool": "get_weather", "content": "18 C, clear"}}' in g  # as a user turn
    c = render(CHATML_TEMPLATE, "generic")
    assert c.startswith("<|im_start|>system\nYou can call any of the following tools")


# -- the grammar ----------------------------------------------------------------------------------


def test_call_grammars() -> None:
    kind, src = call_grammar("hermes", [WEATHER], False, None)
    assert kind == "lark" and src.startswith('start: call\ncall: "<tool_call>" "\\n" body "\\n" "</tool_call>"')
    body = json.loads(src.split("body: %json ", 1)[1])
    assert body["properties"]["name"] == {"const": "get_weather"} and body["properties"]["arguments"] == WEATHER.parameters
    kind, src = call_grammar("llama3", [WEATHER, Tool("f")], True, None)
    assert "parameters" in src and '"anyOf"' in src and src.startswith('start: call (";" " "? call)*')
    kind, src = call_grammar("mistral", [WEATHER], False, None)
    assert '"[TOOL_CALLS]" body' in src and '"maxItems": 1' in src
    kind, src = call_grammar("generic", [WEATHER], False, None)
    assert kind == "json_schema" and json.loads(src)["required"] == ["tool_call"]
    auto = generic_schema([WEATHER], False, False, None)
    assert auto["anyOf"][1]["properties"]["response"] == {"type": "string"}


def test_control_token_markers_are_named_by_id() -> None:
    class Tok:  # a vocabulary where [TOOL_CALLS] is control token 5
        def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
            return [5] if text == "[TOOL_CALLS]" else [ord(ch) for ch in text]

        def is_control(self, t: int) -> bool:
            return t == 5

    assert "call: <[5]> body" in call_grammar("mistral", [WEATHER], False, Tok())[1]
    assert 'call: "<tool_call>"' in call_grammar("hermes", [WEATHER], False, Tok())[1]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'),
    ("generic", '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "abcdefghi"}]'),
])  # fmt: skip
def test_forced_calls_stream_their_arguments_as_written(fmt: str, text: str) -> None:
    forced = Syntax(fmt, parse_tools=True, forced=True)
    deltas, s = _stream(text, forced, step=2)
    args = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "arguments" in d["tool_calls"][0]["function"]]
    assert len([a for a in args if a]) > 10  # in pieces, as the model writes them
    acc = _accumulate(deltas)
    assert [(c["name"], c["arguments"]) for c in acc["tool_calls"]] == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert acc["content"] == "" and s.message.tool_calls[0].arguments == acc["tool_calls"][0]["arguments"]
    # cut off by max_tokens: the call as far as it got (OpenAI's finish_reason "length" shape)
    cut = parse(text[: text.index("Paris") + 3], forced)
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("get_weather", '{"city": "Par')] and cut.content == ""
    # unforced, the same cut text is content, and nothing of it was streamed as a call
    deltas, _ = _stream(text[: text.index("Paris") + 3], Syntax(fmt, parse_tools=True), step=2)
    assert _accumulate(deltas)["tool_calls"] == []


def test_arguments_are_the_text_the_model_wrote() -> None:
    m = parse('<tool_call>\n{"name": "f", "arguments": {"a":  [1, 2.50]}}\n</tool_call>', syn("hermes"))
    assert m.tool_calls[0].arguments == '{"a":  [1, 2.50]}'
    m = parse('<tool_call>\n{"name": "f", "arguments": "{\\"k\\": 1}"}\n</tool_call>', syn("hermes", ))
    assert m.tool_calls[0].arguments == '{"k": 1}'  # a JSON string of arguments: its value


def test_no_text_makes_a_parser_fail() -> None:
    """Every prefix of real replies, and of junk, in every mode: a Message, never an exception."""
    import random

    rng = random.Random(3)
    samples = [
        '<think>\nok\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "\\u00e9\\"}"}]}}\n</tool_call>',
        '<|python_tag|>{"name": "f", "parameters": {"x": null}}; {"name": "g", "parameters": "{}"}',
        '[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "abcdefghi"}, {"name": 1}]',
        '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}{"tool_call": {"name": "f", "arguments": {}}}',
        "".join(rng.choice('{}[]":,\\ntool_call<>/ name arguments"[TOOL_CALLS]') for _ in range(300)),
    ]
    for fmt in ("hermes", "llama3", "mistral", "generic", "content"):
        for forced in (False, True):
            syntax = Syntax(fmt, reasoning=True, parse_tools=fmt != "content", forced=forced)
            for text in samples:
                for n in range(len(text) + 1):
                    for partial in (True, False):
                        m = parse(text[:n], syntax, partial)
                        assert isinstance(m.content, str) and all(isinstance(c.arguments, str) for c in m.tool_calls)


# -- the grammars, run: what a matcher lets through ----------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    pytest.importorskip("llguidance")
    from conftest import write_llama_gguf

    from llamapy.model.tokenizer import Tokenizer

    # SentencePiece with add_space_prefix, as Llama 2's (the texts below have no spaces)
    return Tokenizer.from_file(write_llama_gguf(tmp_path_factory.mktemp("tok") / "t.gguf"))


def _matcher(tok, fmt: str, lazy: bool, parallel: bool = False):  # noqa: ANN001, ANN202
    from llamapy.model.constrain import ConstraintSpec, compile_constraint

    kind, src = call_grammar(fmt, [WEATHER, Tool("f")], parallel, tok, lazy=lazy)
    return compile_constraint(ConstraintSpec(kind, src), tok).matcher()


def _allows(tok, m, text: str) -> bool:  # noqa: ANN001
    """Whether the matcher takes `text` (then it has taken it)."""
    # (a reply goes on from the prompt: no space prefix)
    return matcher_takes(m, tok.n_vocab, tok.encode(text, add_special=False, parse_special=False, space_prefix=False))


def _eos_ok(tok, m) -> bool:  # noqa: ANN001
    return matcher_allows_eos(m, tok)


CALL = '{"name":"get_weather","arguments":{"city":"Oslo"}}'


@pytest.mark.parametrize("fmt, text, bad", [
    ("hermes", f"Let_me_check.<tool_call>\n{CALL}\n</tool_call>", 'Let_me_check.<tool_call>\n{"name":"nope"'),
    ("llama3", CALL.replace("arguments", "parameters"), '{"name":"get_weather","parameters":{"town"'),
    ("mistral", f'Sure.[TOOL_CALLS][{CALL[:-1]},"id":"abcdefghi"}}]', 'Sure.[TOOL_CALLS][{"name":"get_weather","arguments":{"city":1'),
])  # fmt: skip
def test_auto_grammars_leave_text_free_and_hold_a_call_once_opened(tok, fmt: str, text: str, bad: str) -> None:  # noqa: ANN001
    m = _matcher(tok, fmt, lazy=True)
    assert _eos_ok(tok, m)  # an empty reply
    assert _allows(tok, m, text) and _eos_ok(tok, m)
    m = _matcher(tok, fmt, lazy=True)
    assert _allows(tok, m, "The_weather_is_fine,_no_tools_needed.") and _eos_ok(tok, m)
    m = _matcher(tok, fmt, lazy=True)
    assert not _allows(tok, m, bad)  # an unknown tool, a missing required argument, a wrong type


@pytest.mark.parametrize("fmt, text", [
    ("hermes", f"<tool_call>\n{CALL}\n</tool_call>"),
    ("llama3", CALL.replace("arguments", "parameters")),
    ("mistral", f'[TOOL_CALLS][{CALL[:-1]},"id":"abcdefghi"}}]'),
])  # fmt: skip
def test_required_grammars_admit_only_calls(tok, fmt: str, text: str) -> None:  # noqa: ANN001
    m = _matcher(tok, fmt, lazy=False)
    assert not _eos_ok(tok, m)
    assert _allows(tok, m, text) and _eos_ok(tok, m)
    assert not _allows(tok, _matcher(tok, fmt, lazy=False), "Hello")
    if fmt == "hermes":  # parallel: more calls after a newline
        m = _matcher(tok, fmt, lazy=False, parallel=True)
        assert _allows(tok, m, f"{text}\n{text}") and _eos_ok(tok, m)
