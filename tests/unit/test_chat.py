"""Chat templates: SmolLM2's renders as transformers does; hostile templates do nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llamapy.model import chat
from llamapy.model.chat import CHATML_TEMPLATE, ChatTemplateError, render_chat, template_or_default
from llamapy.types import LlamapyError
from tests_support import shared


# tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf, byte for byte.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

USER = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------------
# faithful rendering


def test_smollm2_matches_transformers_reference() -> None:
    cases = json.loads(shared("reference", "smollm2", "chat_render.json").read_text())
    assert cases
    for case in cases:
        got = render_chat(
            SMOLLM2_TEMPLATE, case["messages"], add_generation_prompt=case["add_generation_prompt"]
        )
        assert got == case["rendered"]


def test_smollm2_with_system_and_no_generation_prompt() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    got = render_chat(SMOLLM2_TEMPLATE, msgs, add_generation_prompt=False)
    assert got == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


def test_default_template_is_chatml() -> None:
    assert template_or_default(None) == CHATML_TEMPLATE
    assert template_or_default("") == CHATML_TEMPLATE
    assert template_or_default("x") == "x"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_chat(CHATML_TEMPLATE, msgs) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


BENIGN = """\
{{ bos_token }}
{%- set ns = namespace(sys='') -%}
{% for m in messages %}
  {% if m.role == 'system' %}
    {% set ns.sys = m.content | trim %}
    {% continue %}
  {% endif %}
  {% if m.role not in ['user', 'assistant'] %}
    {{ raise_exception('bad role ' ~ m.role) }}
  {% endif %}
[{{ loop.index0 }}{{ '^' if loop.first }}{{ '$' if loop.last }}] {{ m.role | upper }}: {{ m.content }}
  {% if m.role == 'assistant' %}{{ eos_token }}
{% endif %}
{% endfor %}
{% if ns.sys %}SYS={{ ns.sys | tojson }}
{% endif %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


def test_benign_template_trim_lstrip_loops_namespace() -> None:
    msgs = [
        {"role": "system", "content": "  be <nice> & brief  "},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    got = render_chat(BENIGN, msgs, bos_token="<s>", eos_token="</s>")
    # Reasoning with trim_blocks (newline after a block tag dropped) and lstrip_blocks (spaces
    # before a block tag dropped): each message contributes exactly its "[...]" line; the
    # system message is skipped by `continue`, so the user turn at index 1 is not loop.first;
    # tojson does not HTML-escape (transformers' filter).
    assert got == (
        "<s>"
        "[1] USER: Q1\n"
        "[2] ASSISTANT: A1\n"
        "</s>\n"
        "[3$] USER: Q2\n"
        'SYS="be <nice> & brief"\n'
        "ASSISTANT:"
    )


def test_benign_first_flag_and_no_generation_prompt() -> None:
    got = render_chat(BENIGN, USER, add_generation_prompt=False)
    assert got == "[0^$] USER: hi\n"


def test_raise_exception_is_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        render_chat(BENIGN, [{"role": "tool", "content": "x"}])
    assert issubclass(ChatTemplateError, LlamapyError)


def test_extra_variables_and_tojson_options() -> None:
    t = "{{ tools | tojson(indent=2) }}|{{ documents is none }}|{{ enable_thinking }}"
    got = render_chat(t, USER, tools=[{"name": "f"}], enable_thinking=False)
    assert got == '[\n  {\n    "name": "f"\n  }\n]|True|False'
    assert render_chat("{{ 'é' | tojson }}", USER) == '"é"'


def test_strftime_now() -> None:
    assert render_chat("{{ strftime_now('%Y') }}", USER) == time.strftime("%Y")


def test_compile_error_is_one_line() -> None:
    with pytest.raises(ChatTemplateError) as ei:
        render_chat("{% for m in messages %}\n{{ m }", USER)
    assert "\n" not in str(ei.value)
    assert "compile" in str(ei.value)


def test_runtime_error_is_one_line() -> None:
    with pytest.raises(ChatTemplateError) as ei:
        render_chat("{{ messages[0]['content'] + 1 }}", USER)
    assert "\n" not in str(ei.value)


def test_compiled_templates_are_cached() -> None:
    chat._compile.cache_clear()
    render_chat(SMOLLM2_TEMPLATE, USER)
    render_chat(SMOLLM2_TEMPLATE, USER)
    assert chat._compile.cache_info().hits >= 1


def test_callers_messages_untouched() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        render_chat("{% set _ = messages[0].update({'content': 'x'}) %}ok", msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------------
# hostile templates


@pytest.fixture()
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def _payloads(marker: Path) -> list[str]:
    m = str(marker)
    return [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        f"{{{{ cycler.__init__.__globals__.os.popen('touch {m}').read() }}}}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ self._TemplateReference__context }}",
        "{{ lipsum.__globals__['os'] }}",
        f"{{{{ lipsum.__globals__['os'].system('touch {m}') }}}}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ config }}",
        "{{ config.__class__.__init__.__globals__['os'] }}",
        "{{ request }}",
        "{{ request.application.__globals__.__builtins__ }}",
        "{{ ''.format.__globals__ }}",
        "{{ '{0.__class__.__mro__}'.format('') }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ range.__globals__ }}",
        f"{{{{ open('{m}', 'w').write('x') }}}}",
        "{{ open('/etc/passwd').read() }}",
        "{% include '/etc/passwd' %}",
        "{% import 'os' as os %}{{ os.system('id') }}",
        "{% from 'os' import system %}",
        "{% extends '/etc/passwd' %}",
        "{{ __import__('os').system('id') }}",
    ]


def test_injection_payloads_do_nothing(marker: Path) -> None:
    passwd = Path("/etc/passwd").read_text() if Path("/etc/passwd").exists() else "root:x:0:0"
    for payload in _payloads(marker):
        try:
            out = render_chat(payload, USER)
        except ChatTemplateError as e:
            out = str(e)
            assert "\n" not in out
        assert not marker.exists(), payload
        assert "root:x:0:0" not in out, payload
        assert passwd.strip() not in out or not passwd.strip(), payload
        assert "<module" not in out and "<function" not in out, payload
        assert "uid=" not in out, payload
        assert "subclasses" not in out or "unsafe" in out, payload


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ self._TemplateReference__context }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ ''.format.__globals__ }}",
        "{% include '/etc/passwd' %}",
        "{% import 'os' as os %}",
        "{{ open('/etc/passwd').read() }}",
    ],
)
def test_payloads_are_errors(payload: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(payload, USER)


def test_undefined_globals_render_empty() -> None:
    # transformers' environment has no `config` / `request` (Flask's); they are just undefined.
    assert render_chat("[{{ config }}{{ request }}]", USER) == "[]"


@pytest.mark.parametrize(
    "payload",
    [
        "{% set x = messages.append(1) %}",
        "{% set x = messages.pop() %}",
        "{% set x = messages[0].update({'role': 'system'}) %}",
        "{% set x = messages[0].clear() %}",
        "{{ messages.insert(0, 1) }}",
        "{% set x = messages[0].__setitem__('role', 'x') %}",
    ],
)
def test_mutation_fails(payload: str) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        render_chat(payload, msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "payload",
    [
        "{% for i in range(10**9) %}x{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "{{ 'a' * 10**10 }}",
        "{{ 10**10 * 'a' }}",
        "{{ ['a'] * 10**10 }}",
        "{{ 'a' * 10000000000 }}",
        "{{ 2 ** 100000000 }}",
        "{{ 'a' | center(10000000000) }}",
        "{{ 'a'.ljust(10000000000) }}",
        "{{ 'a'.zfill(10**10) }}",
        "{{ '%10000000000s' % 1 }}",
        "{{ '%10000000000s' | format(1) }}",
        "{{ '{:>10000000000}'.format(1) }}",
        "{{ [1] | batch(10000000000, 'x') | list }}",
        "{{ ('a' * 1000000).replace('a', 'a' * 1000) }}",
        "{{ ('a' * 1000000) | replace('a', 'a' * 1000) }}",
        "{{ lipsum(10**9) }}",
        "{% set ns = namespace(s='a' * 1000000) %}"
        "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        "{% set ns = namespace(s='a' * 1000000) %}"
        "{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
        "{% set x %}{% for i in range(100000) %}{{ 'a' * 9000000 }}{% endfor %}{% endset %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    ],
)
def test_resource_bombs_fail_fast(payload: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_chat(payload, USER)
    # Bounded by the step budget and the wall-clock limit (2 s) plus slack for slow CI.
    assert time.monotonic() - t0 < chat.LIMITS.max_seconds + 3.0, payload


def test_limits_leave_real_work_alone() -> None:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * 1000}
            for i in range(2000)]
    out = render_chat(SMOLLM2_TEMPLATE, msgs)
    assert out.count("<|im_start|>") == 2000 + 2
    assert render_chat("{{ 'ab' * 3 }}|{{ [1] + [2] }}|{{ 2 ** 10 }}|{{ '%05d' % 7 }}", USER) == (
        "ababab|[1, 2]|1024|00007"
    )


def test_loop_semantics_survive_the_step_meter() -> None:
    # Every `for` iterates through a metering generator; loop.length/last/previtem, `else`,
    # recursive loops and unpacking must behave exactly as in plain jinja.
    t = (
        "{% for m in messages %}{{ loop.length }}{{ loop.revindex }}{{ loop.last }}"
        "{{ loop.previtem is defined }}{% endfor %}"
        "{% for x in [] %}a{% else %}E{% endfor %}"
        "{% for x in [[1, [2]], 3] recursive %}"
        "{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}{% endfor %}"
        "{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}"
        "{{ messages | map(attribute='role') | join(',') }}"
    )
    msgs = [{"role": "u", "content": ""}, {"role": "a", "content": ""}]
    assert render_chat(t, msgs) == "22FalseFalse21TrueTrueE123a1u,a"
