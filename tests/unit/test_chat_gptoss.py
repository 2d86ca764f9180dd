"""gpt-oss's harmony chat template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja, the
template the gpt-oss GGUFs carry) rendered by llamapy's sandboxed jinja2 as llama.cpp renders it.

The expected strings are derived from the template by reading it (every tag trims the whitespace
around it, so the text is exactly the literals): a system turn with the model identity, knowledge
cutoff, today's date (`strftime_now("%Y-%m-%d")`), "Reasoning: medium" and the valid channels; the
conversation's system message becomes the developer turn under "# Instructions"; the user turn;
an assistant turn on the final channel, closed by `<|end|>` in a prompt, or by `<|return|>` when it
is the last turn and no generation prompt follows (the training form); the generation prompt is
`<|start|>assistant` with no channel (the model writes it).
"""

from __future__ import annotations

import time
from pathlib import Path

from llamapy.model.chat import render_chat

TEMPLATE = (Path(__file__).parent / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


def _system(date: str, reasoning: str = "medium") -> str:
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: {reasoning}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>")  # fmt: skip


BODY = ("<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n<|end|>"
        "<|start|>user<|message|>What is 2+2?<|end|>")  # fmt: skip


def _render(**kw: object) -> tuple[str, set[str]]:
    before = time.strftime("%Y-%m-%d")
    out = render_chat(TEMPLATE, CONVERSATION, **kw)  # type: ignore[arg-type]
    return out, {before, time.strftime("%Y-%m-%d")}  # a render across midnight: either date


def test_harmony_prompt_with_generation_prompt() -> None:
    got, dates = _render(add_generation_prompt=True)
    want = {_system(d) + BODY + "<|start|>assistant<|channel|>final<|message|>4<|end|><|start|>assistant" for d in dates}
    assert got in want, got


def test_harmony_last_assistant_turn_returns() -> None:
    got, dates = _render(add_generation_prompt=False)
    assert got in {_system(d) + BODY + "<|start|>assistant<|channel|>final<|message|>4<|return|>" for d in dates}, got


def test_harmony_reasoning_effort_and_thinking() -> None:
    """The template's own variables (llama.cpp passes `reasoning_effort` through
    chat_template_kwargs): the effort in the system turn; an earlier assistant turn's thinking
    is dropped, the last one's kept on the analysis channel when nothing follows."""
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "thinking": "t1"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "thinking": "t2"}]  # fmt: skip
    before = time.strftime("%Y-%m-%d")
    got = render_chat(TEMPLATE, msgs, add_generation_prompt=False, reasoning_effort="high")
    tail = ("<|start|>user<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|end|>"
            "<|start|>user<|message|>c<|end|><|start|>assistant<|channel|>analysis<|message|>t2<|end|>"
            "<|start|>assistant<|channel|>final<|message|>d<|return|>")  # fmt: skip
    assert got in {_system(d, "high") + tail for d in {before, time.strftime("%Y-%m-%d")}}, got
