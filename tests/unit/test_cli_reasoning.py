"""`llamapy run`'s conversation mode with reasoning models: each reply read with the server's parser
as it streams (model/toolcalls.py), the answer on stdout, the reasoning on stderr, the parsed message
in the history, so that turn 2's prompt is the one the API renders for the same conversation; and
llama.cpp's --reasoning-format / -rea / --reasoning-budget / --chat-template-kwargs, refused where
they cannot be honoured. Two tiny random models with real templates: gpt-oss (harmony channels,
a vocabulary with the harmony special tokens) and a llama file carrying Qwen3's `<think>` template.
The weights are random: a grammar makes the reply open with reasoning, but the letters in it are
the model's, and what each run shows is checked against the parse of what the same run generated
(`--reasoning-format none` shows it raw)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import write_llama_gguf
from tests_support import cli

pytest.importorskip("llguidance")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from moe_models import SHAPES, write_gptoss_gguf, write_harmony_vocab  # noqa: E402

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
# reasoning and answer in disjoint alphabets: a reasoning letter on stdout is a leak
GRAMMARS = {
    "gptoss": 'root ::= "<|channel|>analysis<|message|>" [a-m]{3,8} "<|end|><|start|>assistant<|channel|>final<|message|>" [n-z]{3,8}',
    "qwen3": 'root ::= "<think>\\n" [a-m]{3,8} "\\n</think>\\n\\n" [n-z]{3,8}',
}
PROMPT = re.compile(r"run: prompt: '(.*?)'\nrun: number of tokens in prompt = (\d+)\n", re.S)
THOUGHT = re.compile(r"\[Start thinking\]\n(.*?)\n\[End thinking\]\n", re.S)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("reasoning")
    return {
        "gptoss": write_gptoss_gguf(d / "g.gguf", **SHAPES["tiny-gptoss"], vocab=write_harmony_vocab(d / "v.gguf"),
                                    chat_template=(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(), seed=2),
        "qwen3": write_llama_gguf(d / "q.gguf", seed=7, chat_template=(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()),
    }  # fmt: skip


def chat(model: Path, *args: str, turns: str = "Hi\nAgain\n"):  # noqa: ANN201
    r = cli("run", str(model), "-c", "1024", "-t", "1", "--temp", "0", "-n", "40", *args, stdin=turns)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return r


def api(model: Path):  # noqa: ANN201
    """What the server renders and how it reads the reply (server/protocol.py), in this process."""
    from llamapy.model.gguf import GGUFFile
    from llamapy.model.tokenizer import Tokenizer
    from llamapy.server.protocol import ChatTemplate, chat_request

    md = GGUFFile(model).metadata
    tok = Tokenizer.from_metadata(md)
    tpl = ChatTemplate(md["tokenizer.chat_template"], tok.token_text(tok.bos) if tok.bos is not None else "",
                       tok.token_text(tok.eos) if tok.eos is not None else "")  # fmt: skip
    return lambda body: chat_request(body, tok, tpl)


@pytest.mark.parametrize("name", ["gptoss", "qwen3"])
def test_two_turns(models: dict[str, Path], name: str) -> None:
    """stdout has each reply's content alone, stderr its reasoning between llama-cli's markers:
    the parse (the server's, for that prompt) of the raw text the same greedy run writes under
    --reasoning-format none. The history keeps the parsed reply (also under none): turn 2's prompt,
    text and token count, is what the API renders for the conversation as a client sends it back
    (with the raw reply in the history, gpt-oss's template refuses turn 2)."""
    from llamapy.model.toolcalls import parse

    raw = chat(models[name], "--grammar", GRAMMARS[name], "--reasoning-format", "none", "--verbose-prompt")
    got = chat(models[name], "--grammar", GRAMMARS[name], "--verbose-prompt")
    render = api(models[name])
    hi, again = {"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}
    syntax = render({"messages": [hi]}).syntax  # (no tools: the same for every turn)
    assert syntax.format == ("harmony" if name == "gptoss" else "content") and syntax.reasoning == (name == "qwen3")
    opener = "<|channel|>" if name == "gptoss" else "<think>"
    raw_replies = re.split("\n(?=" + re.escape(opener) + ")", raw.stdout.removesuffix("\n"))  # (each reply, then "\n")
    assert len(raw_replies) == 2 and all(r.startswith(opener) for r in raw_replies), raw.stdout
    expected = [parse(reply, syntax) for reply in raw_replies]
    assert all(m.reasoning_content and m.content for m in expected)
    assert got.stdout.splitlines() == [m.content for m in expected]
    assert THOUGHT.findall(got.stderr) == [m.reasoning_content for m in expected]
    assert not re.search("[a-m]", got.stdout), got.stdout  # no reasoning letter, no marker on stdout
    assert "[Start thinking]" not in raw.stderr  # none: nothing is read apart

    first = {"role": "assistant", "content": expected[0].content, "reasoning_content": expected[0].reasoning_content}
    turns = [render({"messages": [hi]}), render({"messages": [hi, first, again]})]
    want = [(t.prompt_text, str(len(t.request.prompt))) for t in turns]
    assert PROMPT.findall(got.stderr) == want
    assert PROMPT.findall(raw.stderr) == want
    assert want[1][0].startswith(want[0][0]) and expected[0].content in want[1][0][len(want[0][0]):]


def test_reasoning_budget_zero_turns_thinking_off(models: dict[str, Path]) -> None:
    """Qwen3's switch: --reasoning-budget 0 and -rea off render enable_thinking=false (the empty
    <think></think> the template writes), as the API does with chat_template_kwargs."""
    want = api(models["qwen3"])({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": False}})
    assert want.prompt_text.endswith("<think>\n\n</think>\n\n")
    for flags in (["--reasoning-budget", "0"], ["-rea", "off"], ["--chat-template-kwargs", '{"enable_thinking": false}']):
        r = chat(models["qwen3"], "-n", "2", "--verbose-prompt", *flags, turns="Hi\n")
        assert PROMPT.findall(r.stderr)[0] == (want.prompt_text, str(len(want.request.prompt))), flags


def test_template_variables_reach_the_render(models: dict[str, Path]) -> None:
    r = chat(models["gptoss"], "-n", "2", "--verbose-prompt", "--chat-template-kwargs", '{"reasoning_effort": "low"}', turns="Hi\n")
    assert "\nReasoning: low\n" in PROMPT.findall(r.stderr)[0][0]


@pytest.mark.parametrize(
    "name,args,needle",
    [
        ("gptoss", ["--reasoning-budget", "0"], "--reasoning-budget 0: this model's chat template has no switch to turn thinking off"),
        ("gptoss", ["-rea", "on"], "-rea on: this model's chat template has no switch to turn thinking on"),
        ("gptoss", ["--chat-template-kwargs", '{"enable_thinking": false}'], "'enable_thinking': this model's chat template has no such variable"),
        ("gptoss", ["--chat-template-kwargs", '{"builtin_tools": ["browser"]}'], "--chat-template-kwargs: 'builtin_tools' cannot be set here"),
        ("gptoss", ["--chat-template-kwargs", "{"], "--chat-template-kwargs: not valid JSON"),
        ("gptoss", ["--chat-template-kwargs", "[1]"], "--chat-template-kwargs: expected a JSON object"),
        ("qwen3", ["--reasoning-budget", "100"], "--reasoning-budget 100: llamapy takes -1 (unrestricted) or 0"),
        ("qwen3", ["--reasoning-budget", "-2"], "--reasoning-budget -2"),
        ("qwen3", ["--reasoning-format", "deepseek-legacy"], "deepseek-legacy is not supported"),
        ("qwen3", ["--reasoning-format", "think"], "--reasoning-format think: expected auto, deepseek or none"),
        ("qwen3", ["-rea", "maybe"], "-rea maybe: expected on, off or auto"),
        ("qwen3", ["-rea", "on", "--reasoning-budget", "0"], "-rea on and --reasoning-budget 0 disagree"),
        ("qwen3", ["--reasoning-budget", "0", "--chat-template-kwargs", '{"enable_thinking": true}'], "disagree on enable_thinking"),
        ("qwen3", ["-p", "Hi", "--reasoning-budget", "0"], "--reasoning-budget 0: only conversation mode (-cnv) renders a chat template"),
        ("qwen3", ["-no-cnv", "-p", "Hi", "--chat-template-kwargs", "{}"], "only conversation mode"),
    ],
)
def test_flags_refused_with_one_line(models: dict[str, Path], name: str, args: list[str], needle: str) -> None:
    r = cli("run", str(models[name]), "-c", "256", "-t", "1", "-n", "2", *args, stdin="Hi\n")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.stderr[-2000:]
    assert r.stdout == ""


def test_raw_completion_is_not_parsed(models: dict[str, Path]) -> None:
    """-p without conversation mode stays llama-completion's raw text, markers and all."""
    r = cli("run", str(models["gptoss"]), "-c", "256", "-t", "1", "--temp", "0", "-p", "Hi", "--grammar", GRAMMARS["gptoss"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("<|channel|>analysis<|message|>") and "[Start thinking]" not in r.stderr


# -- in a terminal ----------------------------------------------------------------------------------


def test_terminal_shows_reasoning_gray_and_stdout_alone(models: dict[str, Path], tmp_path: Path) -> None:
    """stdout and stderr on a terminal: the reasoning in llama.cpp's gray between its markers, then
    the answer; stderr to a file: the terminal shows the answers only."""
    pexpect = pytest.importorskip("pexpect")
    import shlex

    argv = [sys.executable, "-m", "llamapy", "run", str(models["gptoss"]), "-c", "1024", "-t", "1", "--temp", "0",
            "--grammar", GRAMMARS["gptoss"]]  # fmt: skip
    c = pexpect.spawn(argv[0], argv[1:], encoding="utf-8", timeout=180, dimensions=(24, 200))
    c.expect("> ")
    c.sendline("Hi")
    c.expect(re.escape("\x1b[90m[Start thinking]") + r"\r\n([a-m]+)\r\n\[End thinking\]\r\n\r\n" + re.escape("\x1b[0m") + r"([n-z]+)\r\n")
    thought, answer = c.match.group(1), c.match.group(2)
    c.expect("> ")
    c.sendline("/exit")
    c.expect(pexpect.EOF)
    err = tmp_path / "stderr.txt"
    c = pexpect.spawn("/bin/sh", ["-c", " ".join(shlex.quote(a) for a in argv) + " 2>" + shlex.quote(str(err))],
                      encoding="utf-8", timeout=180, dimensions=(24, 200))  # fmt: skip
    c.expect("> ")
    c.sendline("Hi")
    c.expect("Hi\r\n")
    c.expect(r"\r\n> ")
    assert c.before.strip() == answer  # the terminal (stdout): the answer alone
    c.sendline("/exit")
    c.expect(pexpect.EOF)
    assert THOUGHT.findall(err.read_text()) == [thought] and "\x1b[" not in err.read_text()  # a file: no colour
