"""Tools in chat: the prompt that offers them, the grammar that forces a call, and the parser that
turns the model's text back into OpenAI's `tool_calls` and `reasoning_content` (llama.cpp's
common/chat.cpp: `common_chat_templates_apply_jinja`, the `common_chat_params_init_*` handlers
and the `common_chat_parse_*` parsers; minja's polyfills for templates that know no tools).

The format a model writes its calls in is decided from its chat template's source, as llama.cpp
decides it, in llama.cpp's order:

- `hermes`  (`<tool_call>` in the template: Qwen 2.5 / 3, Hermes):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one per call;
- `llama3`  (`<|start_header_id|>ipython<|end_header_id|>`: Llama 3.1-3.3):
  `{"name": "f", "parameters": {...}}`, optionally after `<|python_tag|>`;
- `mistral` (`[TOOL_CALLS]`: Mistral Nemo / Small): `[TOOL_CALLS][{"name": .., "arguments": ..,
  "id": ..}]`;
- `generic` (any other template, e.g. SmolLM2's chatml and Gemma 2/3, whose templates know no
  tools; also tools mixed with a JSON schema): the whole reply is one JSON object,
  `{"tool_call": {"name": .., "arguments": ..}}` or `{"response": ...}`, forced by a JSON schema
  (so `tool_choice: auto` is constrained too: without the schema the reply could not be read);
- `harmony` (`<|channel|>` in the template: gpt-oss, whatever the tools): messages on channels,
  `<|channel|>analysis<|message|>…<|end|>` (reasoning_content), `<|start|>assistant<|channel|>
  final<|message|>…` (content) and calls `<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{…}` (or `to=functions.NAME` in the role header), each ended by `<|end|>`, or by the
  end-of-generation tokens `<|return|>` / `<|call|>`;
- `content`: no tools, plain text.

Templates that write `<think>` (Qwen3, R1 distills) have `<think>…</think>` split off into
reasoning_content, with or without tools.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .chat import ChatTemplateError, render_chat
from .constrain import JSON_WHITESPACE

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHANNEL, MESSAGE, START_ASSISTANT = "<|channel|>", "<|message|>", "<|start|>assistant"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
# what the generic format's system message asks for (llama.cpp's wording)
GENERIC_INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) "
                       "or with `response` reply to the user's request")  # fmt: skip


@dataclass(frozen=True)
class Tool:
    """One entry of the request's `tools` (a function; OpenAI's only tool type)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        # description always (llama.cpp's common_chat_tools_to_json_oaicompat): gpt-oss's template
        # concatenates it, and fails on a tool without one
        fn: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""


@dataclass
class Message:
    """A parsed assistant reply."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Syntax:
    """How to read one request's reply."""

    format: str = "content"  # hermes | llama3 | mistral | generic | harmony | content
    reasoning: bool = False  # the template writes <think>…</think>
    thinking_open: bool = False  # the prompt itself ends inside <think>
    parse_tools: bool = False
    forced: bool = False  # the grammar admits only calls (tool_choice required / named)

    @property
    def plain(self) -> bool:
        return not (self.reasoning or self.parse_tools or self.format == "harmony")

    @classmethod
    def of_reply(cls, fmt: str, template: str, prompt: str, parse_tools: bool = False, forced: bool = False) -> Syntax:
        """How to read the reply to `prompt`, rendered from `template` (the server's chat replies
        and `run`'s conversation turns alike): <think> is read where the template writes it, and
        a prompt that ends inside <think> (a template's forced reasoning) starts the reply there."""
        return cls(fmt, reasoning=THINK_OPEN in template, thinking_open=prompt.endswith(THINK_OPEN + "\n"),
                   parse_tools=parse_tools, forced=forced)  # fmt: skip


def detect_format(template: str, with_tools: bool, with_schema: bool = False) -> str:
    """llama.cpp's choice of handler, for the formats llamapy reads."""
    if CHANNEL in template:
        return "harmony"  # with or without tools: the channels are read in every reply
    if not with_tools:
        return "content"
    if HERMES_OPEN in template and not with_schema:
        return "hermes"
    if with_schema:
        return "generic"  # llama.cpp: tools mixed with a JSON schema go through the generic handler
    if "<|start_header_id|>ipython<|end_header_id|>" in template:
        return "llama3"
    if MISTRAL_CALLS in template:
        return "mistral"
    return "generic"


# -- what the template can render by itself (minja's capability probes) ---------------------------


@dataclass(frozen=True)
class Caps:
    system: bool
    tools: bool
    tool_calls: bool
    tool_role: bool


_PROBE_TOOL = Tool("probe_fn_q7", "probe", {"type": "object", "properties": {"probe_arg": {"type": "string"}}})
_PROBE_CALL = {"id": "call00001", "type": "function",
               "function": {"name": "probe_fn_q7", "arguments": {"probe_arg": "probe_value_q7"}}}  # fmt: skip


def _renders(template: str, messages: list[dict], marker: str, **kw: Any) -> bool:
    try:
        return marker in render_chat(template, messages, add_generation_prompt=False, **kw)
    except ChatTemplateError:
        return False


@functools.lru_cache(maxsize=16)
def template_caps(template: str) -> Caps:
    user = {"role": "user", "content": "hello"}
    call = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    result = {"role": "tool", "tool_call_id": "call00001", "name": "probe_fn_q7", "content": "probe_result_q7"}
    return Caps(
        system=_renders(template, [{"role": "system", "content": "probe_system_q7"}, user], "probe_system_q7"),
        tools=_renders(template, [user], "probe_fn_q7", tools=[_PROBE_TOOL.openai()]),
        tool_calls=_renders(template, [user, call], "probe_value_q7"),
        tool_role=_renders(template, [user, call, result], "probe_result_q7"),
    )


# -- the prompt ------------------------------------------------------------------------------------


def _arguments_object(arguments: Any) -> Any:
    # templates write arguments with `| tojson` (transformers' convention: a dict)
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _generic_calls(calls: list[dict]) -> str:
    """An assistant turn's calls written as the generic format's reply."""
    items = [{"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])} for c in calls]
    return json.dumps({"tool_call": items[0]} if len(items) == 1 else {"tool_calls": items}, ensure_ascii=False)


def _harmony_turns(messages: list[dict]) -> list[dict]:
    """The conversation as gpt-oss's template takes it: a call's reasoning_content in `thinking`
    (llama.cpp's common_chat_params_init_gpt_oss); one call per assistant turn, each followed by its
    result (matched by tool_call_id), since the template renders only a turn's first call and
    names a tool result after the call before it."""
    results = {m["tool_call_id"]: m for m in messages if m["role"] == "tool" and m.get("tool_call_id")}
    placed: set[int] = set()
    out: list[dict] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] == "tool" and id(m) in placed:
            continue
        if m["role"] != "assistant" or not calls:
            out.append(m)
            continue
        for j, c in enumerate(calls):
            turn = {"role": "assistant", "content": m.get("content") if j == 0 else "", "tool_calls": [c]}
            if j == 0 and m.get("reasoning_content"):
                turn["thinking"] = m["reasoning_content"]
            out.append(turn)
            r = results.get(c.get("id")) if len(calls) > 1 else None
            if r is not None and id(r) not in placed:
                out.append(r)
                placed.add(id(r))
    return out


def prepare_messages(messages: list[dict], tools: list[Tool], fmt: str, caps: Caps) -> list[dict]:
    """The conversation as the template can render it: tool calls, tool results and the tool list
    written into plain turns where the template has no way of its own (minja's polyfills)."""
    if fmt == "harmony":
        messages = _harmony_turns(messages)
    names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            if caps.tool_calls and fmt != "generic":
                m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_arguments_object(c["function"]["arguments"])))
                                   for c in m["tool_calls"]]  # fmt: skip
                m["content"] = m.get("content") or ""
            else:
                text = m.get("content") or ""
                m = {"role": "assistant", "content": (text + "\n" if text else "") + _generic_calls(m["tool_calls"])}
        elif m["role"] == "tool" and not caps.tool_role:
            resp = json.dumps({"tool_response": {"tool": m.get("name") or names.get(m.get("tool_call_id"), ""),
                                                 "content": m.get("content") or ""}}, ensure_ascii=False)  # fmt: skip
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + resp  # one user turn for consecutive results
                continue
            m = {"role": "user", "content": resp, "_tool_results": True}
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    notes = []
    if tools and not caps.tools:
        notes.append("You can call any of the following tools to satisfy the user's requests: "
                     + json.dumps([t.openai() for t in tools], indent=2, ensure_ascii=False))  # fmt: skip
    if fmt == "generic":
        notes.append(GENERIC_INSTRUCTION)
    if notes:
        note = "\n\n".join(notes)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=(out[0]["content"] + "\n\n" if out[0]["content"] else "") + note)
        elif caps.system:
            out.insert(0, {"role": "system", "content": note})
        else:  # templates without a system turn (Gemma 2): into the first user turn
            i = next((i for i, m in enumerate(out) if m["role"] == "user"), 0)
            out[i] = dict(out[i], content=note + "\n\n" + out[i]["content"])
    return out


def template_variables(fmt: str, tools: list[Tool], caps: Caps) -> dict[str, Any]:
    """The extra variables of the render (llama.cpp passes Llama 3.x's date and asks for its tools
    in the system turn)."""
    extra: dict[str, Any] = {}
    if tools and caps.tools:
        extra["tools"] = [t.openai() for t in tools]
    if fmt == "llama3":
        extra.update(date_string=datetime.now().strftime("%d %b %Y"), tools_in_user_message=False)
    return extra


# -- the grammar that forces a call (tool_choice required / a named function) --------------------


def _call_schema(t: Tool, args_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": t.name}, args_key: t.parameters},
            "required": ["name", args_key], "additionalProperties": False}  # fmt: skip


def _one_of(schemas: list[dict]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def generic_schema(tools: list[Tool], required: bool, parallel: bool, response: dict | None) -> dict[str, Any]:
    """The generic format's reply: a call, or (unless a call is required) a response."""
    call = _one_of([_call_schema(t, "arguments") for t in tools])
    calls = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
              "required": ["tool_calls"], "additionalProperties": False} if parallel else
             {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"], "additionalProperties": False})  # fmt: skip
    if required:
        return calls
    reply = {"type": "object", "properties": {"response": response or {"type": "string"}},
             "required": ["response"], "additionalProperties": False}  # fmt: skip
    return {"anyOf": [calls, reply]}


def _marker(text: str, tokenizer: Any) -> str:
    """A marker in Lark: the special token itself when the vocabulary has it as a control token
    (llguidance matches those only by id), else its text."""
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
        if len(ids) == 1 and tokenizer.is_control(ids[0]):
            return f"<[{ids[0]}]>"
    return json.dumps(text)


def call_grammar(fmt: str, tools: list[Tool], parallel: bool, tokenizer: Any, lazy: bool = False) -> tuple[str, str]:
    """(kind, source) of a constraint that admits only tool calls of these tools, in the format's
    syntax, each call's arguments held to its `parameters` schema. `lazy` (tool_choice auto,
    llama.cpp's lazy grammars): any text, until the text opens a call, which is then held to it."""
    if fmt == "generic":
        return "json_schema", json.dumps(generic_schema(tools, not lazy, parallel, None))
    if fmt == "harmony":
        return "lark", _harmony_grammar(tools, parallel, lazy)
    if fmt == "hermes":
        mark, after = HERMES_OPEN, f'"\\n" body "\\n" {_marker(HERMES_CLOSE, tokenizer)}'
        body = _one_of([_call_schema(t, "arguments") for t in tools])
    elif fmt == "llama3":
        mark, after = "", "body"
        body = _one_of([_call_schema(t, "parameters") for t in tools])
    elif fmt == "mistral":
        mark, after = MISTRAL_CALLS, "body"
        item = _one_of([dict(_call_schema(t, "arguments"), properties=dict(
            _call_schema(t, "arguments")["properties"], id={"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}),
            required=["name", "arguments", "id"]) for t in tools])  # fmt: skip
        body = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    else:
        raise ValueError(f"no call grammar for format {fmt!r}")
    more = {"hermes": ' ("\\n" call)*', "llama3": ' (";" " "? call)*'}.get(fmt, "") if parallel else ""
    m = _marker(mark, tokenizer) if mark else ""
    rules = [f"call: {m} {after}".replace("  ", " ")]
    if not lazy:
        rules.insert(0, f"start: call{more}")
    elif fmt == "llama3":  # a reply that opens with "{" is a call, any other is text
        tag = _marker(PYTHON_TAG, tokenizer)
        rules.insert(0, f"start: (TEXT | {tag + '? ' if tag.startswith('<[') else ''}call{more})?")
        rules.append("TEXT: /[^{](.|\\n)*/")
    elif m.startswith("<["):  # a control token opens the calls: text can never contain it
        rules.insert(0, f"start: TEXT? (call{more})?")
        rules.append("TEXT: /(.|\\n)*/")
    else:  # a marker written as text: free text up to it (a lazy lexeme), then the call
        rules.insert(0, f"start: TEXT | head {after}{more}")
        rules += [f"head[lazy]: TEXT {m}", "TEXT: /(.|\\n)*/"]
    # JSON whitespace bounded as in every other constraint (constrain.py: else a small model can
    # write newlines forever between two keys)
    body = dict(body, **{"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})
    return "lark", "\n".join(rules) + f"\nbody: %json {json.dumps(body)}\n"


def _harmony_grammar(tools: list[Tool], parallel: bool, lazy: bool) -> str:
    """gpt-oss's calls (llama.cpp's gpt-oss grammars). Forced: reasoning on the analysis channel
    may come first, then `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and
    the arguments. Lazy: free text up to `to=functions.`, then a known name, the rest of its header
    (the recipient in the channel header, or in the role header before the channel) and its
    arguments. The markers are text to llguidance: gpt-oss's vocabulary renders them (user-defined
    tokens; only <|return|> and <|call|>, the ends of a reply, are control tokens)."""
    ws = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}  # (as in every other constraint)
    args = [f"args{i}: %json {json.dumps(dict(t.parameters, **ws))}" for i, t in enumerate(tools)]
    if lazy:
        heads = [f'"{t.name}" ("<|channel|>" ("commentary" | "analysis"))? (" " "<|constrain|>"? "json")? "<|message|>" args{i}'
                 for i, t in enumerate(tools)]  # fmt: skip
        rules = ["start: TEXT | head call", 'head[lazy]: TEXT "to=functions."']
    else:
        heads = [f'"<|channel|>commentary to=functions.{t.name} <|constrain|>json<|message|>" args{i}' for i, t in enumerate(tools)]
        more = ' ("<|start|>assistant" call)*' if parallel else ""
        rules = [f"start: think? call{more}", 'think[lazy]: "<|channel|>analysis<|message|>" TEXT "<|end|><|start|>assistant"']
    return "\n".join(rules + ["call: " + " | ".join(heads), "TEXT: /(.|\\n)*/"] + args) + "\n"


def harmony_final_grammar(schema: Any) -> str:
    """A JSON answer (response_format) on gpt-oss's final channel, after reasoning if the model
    writes some (llama.cpp's gpt-oss json_schema grammar)."""
    body = dict(schema, **{"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}) if isinstance(schema, dict) else schema
    return ('start: think? "<|channel|>final" (" " "<|constrain|>"? "json")? "<|message|>" body\n'
            'think[lazy]: "<|channel|>analysis<|message|>" TEXT "<|end|><|start|>assistant"\n'
            f"TEXT: /(.|\\n)*/\nbody: %json {json.dumps(body)}\n")  # fmt: skip


# -- reading the reply -----------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


def _json_at(s: str, i: int) -> tuple[Any, int] | None:
    """The JSON value starting at s[i] (after spaces) and the index after it, or None."""
    while i < len(s) and s[i] in _WS:
        i += 1
    try:
        return _DECODER.raw_decode(s, i)
    except json.JSONDecodeError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker` (held back while
    streaming: it may yet become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call(obj: Any, keys: tuple[str, ...], src: str = "", start: int = 0, end: int = 0) -> ToolCall | None:
    """A decoded call object as a ToolCall; with `src`, its arguments are the text the model wrote
    (src[start:end] holds the object), so that what was streamed of them is a prefix."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None or not isinstance(obj[key], (dict, str)):
        return None
    args = obj[key] if isinstance(obj[key], str) else json.dumps(obj[key], ensure_ascii=False)
    m = re.compile(rf'"{key}"\s*:\s*').search(src, start, end) if src and not isinstance(obj[key], str) else None
    got = _json_at(src, m.end()) if m else None
    if got and got[0] == obj[key]:
        args = src[m.end():got[1]]  # type: ignore[union-attr]
    return ToolCall(obj["name"], args, obj["id"] if isinstance(obj.get("id"), str) else "")


# the head of a call object whose arguments are still being written
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _read_call(s: str, i: int, keys: tuple[str, ...]) -> tuple[ToolCall | None, int, bool]:
    """(call, end, complete) for the call object at s[i]. Incomplete, a call is returned when its
    name and the start of its arguments are there (the arguments so far)."""
    while i < len(s) and s[i] in _WS:
        i += 1
    got = _json_at(s, i)
    if got:
        return _call(got[0], keys, s, i, got[1]), got[1], True
    m = _CALL_HEAD.match(s, i)
    if not m:
        return None, len(s), False
    args = _json_at(s, m.end())
    so_far = s[m.end():args[1]] if args else s[m.end():]
    return ToolCall(json.loads(f'"{m.group(1)}"'), "" if so_far.startswith('"') else so_far), len(s), False


def _split_reasoning(text: str, syntax: Syntax, partial: bool) -> tuple[str, str]:
    """(reasoning, rest). An unclosed <think> at the end is all reasoning."""
    if not syntax.reasoning:
        return "", text
    body = text
    if not syntax.thinking_open:
        lead = text.lstrip(_WS)
        if not lead.startswith(THINK_OPEN):
            if partial and lead and THINK_OPEN.startswith(lead):
                return "", ""  # "<thi": may be the opening tag
            return "", text
        body = lead[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:
        held = _partial_suffix(body, THINK_CLOSE) if partial else 0
        return body[: len(body) - held].strip(_WS), ""
    return body[:end].strip(_WS), body[end + len(THINK_CLOSE):].lstrip(_WS)


def _parse_hermes(text: str, partial: bool, forced: bool) -> Message:
    msg, pos = Message(), 0
    while True:
        i = text.find(HERMES_OPEN, pos)
        if i < 0:
            tail = text[pos:]
            msg.content += tail[: len(tail) - (_partial_suffix(tail, HERMES_OPEN) if partial else 0)]
            return msg
        msg.content += text[pos:i]
        call, j, complete = _read_call(text, i + len(HERMES_OPEN), ("arguments",))
        while j < len(text) and text[j] in _WS:
            j += 1
        if call is None or not complete or not text.startswith(HERMES_CLOSE, j):
            if call is not None and forced:
                msg.tool_calls.append(call)  # still being written, or cut off (finish_reason length)
            elif not partial:
                msg.content += text[i:]  # malformed: the text as it is
            return msg
        msg.tool_calls.append(call)
        pos = j + len(HERMES_CLOSE)
        while pos < len(text) and text[pos] in _WS:
            pos += 1


def _parse_llama3(text: str, partial: bool, forced: bool) -> Message:
    s = text.lstrip(_WS)
    if partial and PYTHON_TAG.startswith(s):
        return Message()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):]
    if not s.lstrip(_WS).startswith("{"):
        return Message(content=text if not partial or s.strip(_WS) else "")
    calls: list[ToolCall] = []
    i = 0
    while True:
        call, i, complete = _read_call(s, i, ("parameters", "arguments"))
        if call is None or not complete:
            if call is not None and forced:
                return Message(tool_calls=calls + [call])
            return Message(tool_calls=calls) if partial else Message(content=text)
        calls.append(call)
        while i < len(s) and s[i] in _WS + ";":
            i += 1
        if i >= len(s):
            return Message(tool_calls=calls)


def _parse_mistral(text: str, partial: bool, forced: bool) -> Message:
    i = text.find(MISTRAL_CALLS)
    if i < 0:
        return Message(content=text[: len(text) - (_partial_suffix(text, MISTRAL_CALLS) if partial else 0)])
    msg, j = Message(content=text[:i]), i + len(MISTRAL_CALLS)
    while j < len(text) and text[j] in _WS:
        j += 1
    if text.startswith("[", j):
        while True:  # [call, call, ...]
            call, j, complete = _read_call(text, j + 1, ("arguments",))
            if call is not None and (complete or forced):
                msg.tool_calls.append(call)
            while j < len(text) and text[j] in _WS:
                j += 1
            if call is None or not complete or not text.startswith((",", "]"), j):
                break
            if text[j] == "]":
                return msg
    if partial or forced and msg.tool_calls:
        return msg
    return Message(content=text)  # malformed: the text as it is


_GENERIC_CALL = re.compile(r'\s*\{\s*"tool_call"\s*:')


def _parse_generic(text: str, partial: bool, forced: bool) -> Message:
    m = _GENERIC_CALL.match(text)
    if m:
        call, end, complete = _read_call(text, m.end(), ("arguments",))
        if call is not None and (forced or complete and text[end:].strip(_WS) == "}"):
            return Message(tool_calls=[call])
    got = _json_at(text, 0)
    obj = got[0] if got and not text[got[1]:].strip(_WS) else None
    if isinstance(obj, dict):
        if isinstance(obj.get("tool_calls"), list):
            calls = [_call(o, ("arguments",)) for o in obj["tool_calls"]]
            if calls and all(calls):
                return Message(tool_calls=calls)  # type: ignore[arg-type]
        elif "response" in obj:
            r = obj["response"]
            return Message(content=r if isinstance(r, str) else json.dumps(r, ensure_ascii=False))
    return Message() if partial else Message(content=text)


# a message's header, after `<|start|>assistant`: the recipient in the role header or after the
# channel, then an optional content type, `<|constrain|>json` or `json` (llama.cpp's regexes)
_HARMONY_HEADER = re.compile(
    r"\s*(?:to=functions\.(?P<to1>[^<\s]+)\s*)?<\|channel\|>(?P<channel>\w+)"
    r"(?:\s+to=functions\.(?P<to2>[^<\s]+))?(?:\s*<\|constrain\|>[\w-]+|\s+[\w-]+)?\s*")
_HARMONY_END = re.compile("|".join(re.escape(e) for e in HARMONY_ENDS))


def _parse_harmony(text: str, partial: bool, with_tools: bool) -> Message:
    """gpt-oss's messages in order (llama.cpp's common_chat_parse_gpt_oss): analysis to reasoning,
    final and commentary to content, a message to functions.NAME to a call whose arguments are
    the text written (streamed as written; cut off, as far as it got). A reply with no header at
    all is content; text before the first header is content too (llama.cpp drops it: nothing is
    dropped here); a header cut off (max_tokens) is dropped, as llama.cpp drops it. Calls are read
    only when tools were offered (else dropped, as llama.cpp does)."""
    msg, pos = Message(), 0
    while True:
        while pos < len(text) and text[pos] in _WS:
            pos += 1
        if text.startswith(START_ASSISTANT, pos):
            pos += len(START_ASSISTANT)
        i = text.find(MESSAGE, pos)
        if i < 0:
            if not partial and CHANNEL not in text and MESSAGE not in text:
                msg.content = text
            return msg
        header = text[pos:i]
        m = _HARMONY_HEADER.fullmatch(header)
        k = header.rfind(CHANNEL)
        if m is None and k > 0 and _HARMONY_HEADER.fullmatch(header, k):
            msg.content += header[:k]  # text before the header
            m = _HARMONY_HEADER.fullmatch(header, k)
        end = _HARMONY_END.search(text, i + len(MESSAGE))
        stop = end.start() if end else len(text)
        body = text[i + len(MESSAGE): stop]
        if end is None and partial:  # an end marker may be arriving
            body = body[: len(body) - max(_partial_suffix(body, e) for e in HARMONY_ENDS)]
        name = m and (m["to1"] or m["to2"])
        if m is None or m["channel"] not in ("analysis", "commentary", "final") or name and m["channel"] == "final":
            msg.content += text[pos:i + len(MESSAGE)] + body  # an unknown header: the text as written
        elif name:
            if with_tools:
                msg.tool_calls.append(ToolCall(name, body.lstrip(_WS)))
        elif m["channel"] == "analysis":
            msg.reasoning_content += body
        else:
            msg.content += body
        if end is None:
            return msg
        pos = end.end()


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral, "generic": _parse_generic}


def parse(text: str, syntax: Syntax, partial: bool = False) -> Message:
    """The reply read as `syntax` says. `partial`: text still growing, so what may yet become a
    marker, a tool call or the end of the reasoning is held back. Malformed calls in a final reply
    come back as plain content, never an error. A forced call (the grammar admits nothing else)
    is returned while its arguments are being written, and as far as it got when cut off."""
    if syntax.format == "harmony":
        return _parse_harmony(text, partial, syntax.parse_tools)
    reasoning, rest = _split_reasoning(text, syntax, partial)
    parser = _PARSERS.get(syntax.format) if syntax.parse_tools else None
    msg = parser(rest, partial, syntax.forced) if parser else Message(content=rest)
    msg.reasoning_content = reasoning
    return msg


def new_call_id(fmt: str) -> str:
    if fmt == "mistral":  # Mistral's template wants 9 alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


class ReplyStream:
    """A reply read as it streams, as OpenAI's deltas: the whole text parsed again at each step
    and compared with the last parse (llama.cpp's common_chat_msg_diff). A call opens with a
    header delta (index, id, type, name), then its arguments follow in pieces: as they are written
    when the call is forced, else at once when its JSON is complete (an unforced call may yet turn
    out malformed, and then it is content)."""

    def __init__(self, syntax: Syntax) -> None:
        self.syntax = syntax
        self.text = ""
        self.message = Message()

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if self.syntax.plain:  # nothing to read: the text passes through as it comes
            return [{"content": text}] if text else []
        return self._advance(parse(self.text, self.syntax, partial=True))

    def finish(self) -> list[dict[str, Any]]:
        if self.syntax.plain:
            self.message.content = self.text
            return []
        return self._advance(parse(self.text, self.syntax, partial=False))

    def _advance(self, new: Message) -> list[dict[str, Any]]:
        old, out = self.message, []
        if new.reasoning_content.startswith(old.reasoning_content) and len(new.reasoning_content) > len(old.reasoning_content):
            out.append({"reasoning_content": new.reasoning_content[len(old.reasoning_content):]})
            old.reasoning_content = new.reasoning_content
        if new.content.startswith(old.content) and len(new.content) > len(old.content):
            out.append({"content": new.content[len(old.content):]})
            old.content = new.content
        for i, c in enumerate(new.tool_calls):
            if i == len(old.tool_calls):
                old.tool_calls.append(ToolCall(c.name, "", c.id or new_call_id(self.syntax.format)))
                out.append({"tool_calls": [{"index": i, "id": old.tool_calls[i].id, "type": "function",
                                            "function": {"name": c.name, "arguments": ""}}]})  # fmt: skip
            sent = old.tool_calls[i]
            if c.arguments.startswith(sent.arguments) and len(c.arguments) > len(sent.arguments):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments[len(sent.arguments):]}}]})
            sent.arguments = c.arguments  # (a final parse that disagrees still fixes the whole message)
        return out


def message_dict(msg: Message) -> dict[str, Any]:
    """The reply as OpenAI's `message` (content null when there are only calls)."""
    d: dict[str, Any] = {"role": "assistant", "content": msg.content if msg.content or not msg.tool_calls else None}
    if msg.reasoning_content:
        d["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in msg.tool_calls]  # fmt: skip
    return d
