"""gpt-oss's harmony replies read back (toolcalls.py's `harmony` format, llama.cpp's
common_chat_parse_gpt_oss) and the prompt of a tool round trip rendered by the real template
(tests/unit/chat_templates/openai-gpt-oss-120b.jinja). The texts are what gpt-oss writes after the
generation prompt `<|start|>assistant`; `<|return|>` / `<|call|>` end the text here as they end a
reply (the engine stops on them before they reach the text)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llamapy.model.chat import render_chat
from llamapy.model.toolcalls import (
    Message,
    ReplyStream,
    Syntax,
    Tool,
    ToolCall,
    detect_format,
    parse,
    prepare_messages,
    template_caps,
    template_variables,
)

TEMPLATE = (Path(__file__).parent / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
QWEN3 = (Path(__file__).parent / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
TOOLS = Syntax("harmony", parse_tools=True)
NO_TOOLS = Syntax("harmony", parse_tools=False)
A, S, F = "<|channel|>analysis<|message|>", "<|start|>assistant", "<|channel|>final<|message|>"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}'

CASES = {
    "analysis+final": (f"{A}The user greets.<|end|>{S}{F}Hello!<|return|>", Message("Hello!", "The user greets.")),
    "call": (f"{A}Need the weather.<|end|>{S}{CALL}<|call|>",
             Message("", "Need the weather.", [ToolCall("get_weather", '{"location":"Paris"}')])),
    "call in the role header": (' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Oslo"}',
                                Message(tool_calls=[ToolCall("get_weather", '{"location": "Oslo"}')])),
    "two calls": (f"{CALL}<|end|>{S} to=functions.f<|channel|>commentary<|constrain|>json<|message|> {{}}<|call|>",
                  Message(tool_calls=[ToolCall("get_weather", '{"location":"Paris"}'), ToolCall("f", "{}")])),
    "no space before constrain": ('<|channel|>commentary to=functions.f<|constrain|>json<|message|>{"a":1}',
                                  Message(tool_calls=[ToolCall("f", '{"a":1}')])),
    "no content type": ("<|channel|>analysis to=functions.f<|message|>{}", Message(tool_calls=[ToolCall("f", "{}")])),
    "preamble on commentary": (f"<|channel|>commentary<|message|>Checking.<|end|>{S}{CALL}",
                               Message("Checking.", "", [ToolCall("get_weather", '{"location":"Paris"}')])),
    "cut off in the arguments": (f"{A}x<|end|>{S}{CALL[:-9]}", Message("", "x", [ToolCall("get_weather", '{"location"')])),
    "cut off in the analysis": (f"{A}Still thinking", Message("", "Still thinking")),
    "cut off in a header": (f"{A}x<|end|>{S}<|channel|>fin", Message("", "x")),
    "no channel": ("Just text, no header.", Message("Just text, no header.")),
    "text before the header": (f"Hm.{F}Yes.", Message("Hm.Yes.")),
    "unknown channel": ("<|channel|>other<|message|>q<|end|>", Message("<|channel|>other<|message|>q")),
    "markers inside the analysis": (f"{A}a <|channel|> b<|end|>{S}{F}c", Message("c", "a <|channel|> b")),
}  # fmt: skip


def test_detected_from_the_template_with_or_without_tools() -> None:
    assert detect_format(TEMPLATE, with_tools=False) == detect_format(TEMPLATE, with_tools=True) == "harmony"
    assert detect_format(TEMPLATE, with_tools=True, with_schema=True) == "harmony"
    assert detect_format(QWEN3, with_tools=False) == "content"  # (the channels alone decide)
    assert not NO_TOOLS.plain  # the channels are read even without tools


@pytest.mark.parametrize("name", list(CASES))
def test_parse(name: str) -> None:
    text, want = CASES[name]
    assert parse(text, TOOLS) == want


def test_calls_are_dropped_when_no_tools_were_offered() -> None:
    """As llama.cpp (parse_tool_calls false): the reply's reasoning and content stay."""
    assert parse(CASES["call"][0], NO_TOOLS) == Message("", "Need the weather.")
    assert parse(CASES["analysis+final"][0], NO_TOOLS) == CASES["analysis+final"][1]


def _deltas(chunks: list[str], syntax: Syntax) -> tuple[Message, ReplyStream]:
    s, out = ReplyStream(syntax), Message()
    for d in [d for c in chunks for d in s.feed(c)] + s.finish():
        out.content += d.get("content", "")
        out.reasoning_content += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if c["index"] == len(out.tool_calls):
                assert c["id"].startswith("call_") and c["type"] == "function"
                out.tool_calls.append(ToolCall(c["function"]["name"], "", c["id"]))
            out.tool_calls[c["index"]].arguments += c["function"].get("arguments", "")
    return out, s


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_deltas_add_up_to_the_parse_wherever_the_text_is_cut(name: str) -> None:
    """The text in two pieces cut at every position, and a character at a time: the deltas add up to
    the parse of the whole text (nothing sent is ever taken back), ids included."""
    text, want = CASES[name]
    cuts = [[text[:n], text[n:]] for n in range(len(text) + 1)] + [list(text)]
    for chunks in cuts:
        got, s = _deltas(chunks, TOOLS)
        assert (got.content, got.reasoning_content) == (want.content, want.reasoning_content), chunks
        assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in want.tool_calls], chunks
        assert [c.id for c in got.tool_calls] == [c.id for c in s.message.tool_calls]


def test_no_marker_leaks_while_streaming() -> None:
    text = f"{A}Need the weather.<|end|>{S}{CALL}<|end|>{S}{F}Done."
    s = ReplyStream(TOOLS)
    for ch in text:
        for d in s.feed(ch):
            assert "<|" not in d.get("content", "") + d.get("reasoning_content", ""), d
            for c in d.get("tool_calls", []):
                assert "<|" not in c["function"].get("arguments", ""), d


# -- the prompt ------------------------------------------------------------------------------------

WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]})  # fmt: skip


def _render(messages: list[dict], tools: list[Tool]) -> str:
    caps = template_caps(TEMPLATE)
    msgs = prepare_messages(messages, tools, "harmony", caps)
    return render_chat(TEMPLATE, msgs, add_generation_prompt=True, **template_variables("harmony", tools, caps))


def _call(i: str, city: str) -> dict:
    return {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"location": city})}}


def test_a_tool_round_trip_renders_as_harmony() -> None:
    """The tools in the developer turn's `functions` namespace; the assistant's call in the role
    header with its reasoning_content on the analysis channel (the template's `thinking`); the
    result as the tool's own turn, named after the call; then the generation prompt."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [_call("c1", "Paris")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    before = time.strftime("%Y-%m-%d")
    got = _render(msgs, [WEATHER])
    dates = {before, time.strftime("%Y-%m-%d")}
    assert any(f"Current date: {d}\n" in got for d in dates)
    assert ("# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
            "Calls to these tools must go to the commentary channel: 'functions'.<|end|>") in got  # fmt: skip
    assert ("<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
            "// The weather in a city\ntype get_weather = (_: {\nlocation: string,\n}) => any;\n\n"
            "} // namespace functions<|end|>") in got  # fmt: skip
    assert got.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant"
    ), got


def test_parallel_calls_become_one_turn_each_with_its_result() -> None:
    """The template renders a turn's first call only, and names a result after the last call:
    each call gets its own turn, followed by its result (by tool_call_id, whatever their order)."""
    two = Tool("get_time", "", {"type": "object", "properties": {}})
    msgs = [{"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "Paris"),
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": "noon"},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "assistant", "content": "Sunny at noon."}]  # fmt: skip
    got = _render(msgs, [WEATHER, two])
    assert got.endswith(
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Sunny at noon.<|end|><|start|>assistant"
    ), got


def test_a_tool_without_a_description_renders() -> None:
    """The template concatenates the description: it is always passed (llama.cpp does too)."""
    assert "// \ntype f = () => any;" in _render([{"role": "user", "content": "hi"}], [Tool("f")])


def test_template_kwargs_are_the_templates_variables() -> None:
    """llama-server's chat_template_kwargs and OpenAI's reasoning_effort: passed when the template
    names the variable, refused when it would be ignored or would replace the render's own."""
    from llamapy.server.protocol import ApiError, template_kwargs

    assert template_kwargs({"reasoning_effort": "high"}, TEMPLATE) == {"reasoning_effort": "high"}
    assert template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}, QWEN3) == {"enable_thinking": False}
    for body, source, needle in [
        ({"reasoning_effort": "high"}, QWEN3, "no such variable"),
        ({"chat_template_kwargs": {"messages": []}}, QWEN3, "cannot be set"),
        ({"chat_template_kwargs": ["x"]}, QWEN3, "must be an object"),
    ]:
        with pytest.raises(ApiError, match=needle):
            template_kwargs(body, source)
