"""gpt-oss's harmony chat end to end on a tiny random gpt-oss file whose vocabulary has the harmony
special tokens (moe_models.write_harmony_vocab) and the real chat template: the tokens that end a
reply, the call grammars run by llguidance on that vocabulary, and Llama.create_chat_completion
reading the reply into reasoning_content / content / tool_calls, streamed and not. The weights are
random: the text is forced by a grammar, or only the parse of what the model wrote is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamapy.model.toolcalls import Tool, call_grammar, harmony_final_grammar
from llamapy.types import LlamapyError
from moe_models import SHAPES, write_gptoss_gguf, write_harmony_vocab
from tests_support import matcher_allows_eos, matcher_takes

pytest.importorskip("llguidance")

TEMPLATE = (Path(__file__).parents[1] / "unit" / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
PARAMS = {"type": "object", "properties": {"location": {"enum": ["Paris", "Oslo"]}}, "required": ["location"],
          "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# seed 2's weights: greedy, the forced reply takes the call header rather than reasoning first
# (both are legal harmony; with seed 0 it reasons until max_tokens)
SEED = 2


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    import llamapy

    d = tmp_path_factory.mktemp("harmony")
    path = write_gptoss_gguf(d / "g.gguf", **SHAPES["tiny-gptoss"], vocab=write_harmony_vocab(d / "v.gguf"),
                             chat_template=TEMPLATE, seed=SEED)  # fmt: skip
    with llamapy.Llama(path, n_ctx=1024, n_threads=1) as m:
        yield m


def test_the_reply_ends_on_return_and_call_not_end(llm) -> None:  # noqa: ANN001
    """As llama.cpp's vocab marks o200k_harmony: <|return|> and <|call|> end generation, <|end|>
    (between two messages of one reply) does not; the header tokens are written as text."""
    tok = llm.tokenizer
    one = {t: tok.encode(t, add_special=False, parse_special=True) for t in ("<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|message|>")}
    assert all(len(ids) == 1 for ids in one.values()), one
    assert [tok.is_eog(one[t][0]) for t in one] == [True, True, False, False, False]
    assert [tok.token_to_piece(one[t][0], special=False) for t in ("<|end|>", "<|channel|>", "<|message|>")] == [
        b"<|end|>", b"<|channel|>", b"<|message|>"]  # fmt: skip


def _matcher(llm, kind: str, src: str):  # noqa: ANN001, ANN202
    from llamapy.model.constrain import ConstraintSpec, compile_constraint

    return compile_constraint(ConstraintSpec(kind, src), llm.tokenizer).matcher()


def _allows(llm, m, text: str) -> bool:  # noqa: ANN001
    tok = llm.tokenizer
    return matcher_takes(m, tok.n_vocab, tok.encode(text, add_special=False, parse_special=True))


def _ends(llm, m) -> bool:  # noqa: ANN001
    return matcher_allows_eos(m, llm.tokenizer)


W = [Tool("get_weather", "", PARAMS), Tool("f")]
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}'


def test_required_grammar_admits_reasoning_then_a_call_only(llm) -> None:  # noqa: ANN001
    req = lambda parallel=False: _matcher(llm, *call_grammar("harmony", W, parallel, llm.tokenizer))  # noqa: E731
    m = req()
    assert not _ends(llm, m) and _allows(llm, m, CALL) and _ends(llm, m)
    m = req()
    assert _allows(llm, m, "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant" + CALL) and _ends(llm, m)
    assert _allows(llm, req(), "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}")
    assert not _allows(llm, req(), "<|channel|>final<|message|>Hi")  # an answer instead of a call
    assert not _allows(llm, req(), "<|channel|>commentary to=functions.nope")  # an unknown tool
    assert not _allows(llm, req(), CALL.replace("Paris", "Rome"))  # arguments outside the schema
    m = req(parallel=True)
    assert _allows(llm, m, CALL + "<|start|>assistant" + CALL) and _ends(llm, m)


def test_auto_grammar_leaves_text_free_and_holds_a_call_once_opened(llm) -> None:  # noqa: ANN001
    auto = lambda: _matcher(llm, *call_grammar("harmony", W, False, llm.tokenizer, lazy=True))  # noqa: E731
    m = auto()
    assert _allows(llm, m, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi") and _ends(llm, m)
    m = auto()
    assert _allows(llm, m, "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant" + CALL) and _ends(llm, m)
    m = auto()  # the recipient in the role header, as the template writes past calls
    assert _allows(llm, m, ' to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Oslo"}') and _ends(llm, m)
    assert not _allows(llm, auto(), '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town"')


def test_final_json_grammar(llm) -> None:  # noqa: ANN001
    m = _matcher(llm, "lark", harmony_final_grammar(PARAMS))
    assert _allows(llm, m, '<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>{"location":"Oslo"}')
    assert _ends(llm, m)
    assert not _allows(llm, _matcher(llm, "lark", harmony_final_grammar(PARAMS)), '<|channel|>final<|message|>{"x"')


def _streamed(chunks: list[dict]) -> dict:
    out: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for c in chunks:
        d = c["choices"][0]["delta"] if c["choices"] else {}
        out["content"] += d.get("content") or ""
        out["reasoning_content"] += d.get("reasoning_content", "")
        for t in d.get("tool_calls", []):
            if t["index"] == len(out["tool_calls"]):
                out["tool_calls"].append({"name": t["function"]["name"], "arguments": ""})
            out["tool_calls"][t["index"]]["arguments"] += t["function"].get("arguments", "")
    return out


def test_reasoning_and_answer_split(llm) -> None:  # noqa: ANN001
    """A harmony reply (forced by a grammar: the weights are random) comes back as reasoning_content
    and content, streamed as deltas with no marker in them."""
    g = 'root ::= "<|channel|>analysis<|message|>Greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"'
    r = llm.create_chat_completion(ASK, grammar=g, temperature=0, max_tokens=100)
    msg = r["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"], r["choices"][0]["finish_reason"]) == ("Greeting.", "Hi!", "stop")
    s = _streamed(list(llm.create_chat_completion(ASK, grammar=g, temperature=0, max_tokens=100, stream=True)))
    assert (s["reasoning_content"], s["content"], s["tool_calls"]) == ("Greeting.", "Hi!", [])


def test_a_forced_call(llm) -> None:  # noqa: ANN001
    """tool_choice naming the function: the grammar forces a harmony call; the reply is a tool call
    with arguments valid for the schema, finish_reason tool_calls, and the stream says the same."""
    import jsonschema

    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=100)
    r = llm.create_chat_completion(ASK, **kw)
    msg = r["choices"][0]["message"]
    assert msg.get("tool_calls"), f"seed {SEED}'s greedy reply no longer opens with the call (a legal harmony reply too): {msg}"
    (call,) = msg["tool_calls"]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS)
    s = _streamed(list(llm.create_chat_completion(ASK, stream=True, **kw)))
    assert s["tool_calls"] == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]
    # cut off by max_tokens inside the arguments: the call as far as it got, finish_reason length
    cut = llm.create_chat_completion(ASK, **dict(kw, max_tokens=r["usage"]["completion_tokens"] - 3))
    (part,) = cut["choices"][0]["message"]["tool_calls"]
    assert cut["choices"][0]["finish_reason"] == "length"
    full, got = call["function"]["arguments"], part["function"]["arguments"]
    assert full.startswith(got) and len(got) < len(full), (got, full)


def test_the_request_reaches_the_template(llm) -> None:  # noqa: ANN001
    """reasoning_effort (and chat_template_kwargs) are the template's variables; the history's call
    and result render natively; what the template cannot honour is refused."""
    from llamapy.server.protocol import ApiError, ChatTemplate, chat_request

    tpl = ChatTemplate.of(llm.model)
    hist = ASK + [{"role": "assistant", "content": None, "reasoning_content": "Need it.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    p = chat_request({"messages": hist, "tools": TOOLS, "reasoning_effort": "high"}, llm.tokenizer, tpl)
    assert "\nReasoning: high\n" in p.prompt_text and p.syntax.format == "harmony" and p.syntax.parse_tools
    assert p.prompt_text.endswith('<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|>'
                                  '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}<|call|>'
                                  '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant')  # fmt: skip
    p = chat_request({"messages": ASK, "chat_template_kwargs": {"reasoning_effort": "low"}}, llm.tokenizer, tpl)
    assert "\nReasoning: low\n" in p.prompt_text and not p.syntax.parse_tools
    rf = {"type": "json_schema", "json_schema": {"schema": PARAMS}}
    p = chat_request({"messages": ASK, "response_format": rf}, llm.tokenizer, tpl)
    assert p.request.constraint.source == harmony_final_grammar(PARAMS)  # the JSON on the final channel
    for body, needle in [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {}}}}}, "at /"),
        ({"reasoning_effort": "extreme"}, "must be one of"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "no such variable"),
        ({"chat_template_kwargs": {"builtin_tools": ["browser"]}}, "cannot be set"),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}, "reasoning_effort": "high"}, "disagrees"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "cannot be combined"),
    ]:
        with pytest.raises(ApiError, match=needle):
            chat_request({"messages": ASK, **body}, llm.tokenizer, tpl)
    with pytest.raises(LlamapyError, match="must be one of"):
        llm.create_chat_completion(ASK, reasoning_effort="max", max_tokens=1)
