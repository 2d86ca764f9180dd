"""First contact with the CLI (issue 10): usage errors, --version, a closed stdout, llama.cpp's
flag spellings, escapes, --help, the sampler seed, [end of text], -r. Each runs the installed
CLI in a subprocess, as a user would, in an environment without click (typer >= 0.29)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import cli, shared


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr


def one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    no_traceback(r)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


# -- usage errors and --version ----------------------------------------------------------------


def test_version() -> None:
    from llamapy import __version__

    r = cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"llamapy {__version__}"


def test_bare_llamapy_shows_the_help_without_a_traceback() -> None:
    r = cli()
    no_traceback(r)
    assert r.returncode == 2
    assert "Usage: llamapy" in r.stderr and "run" in r.stderr


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["bogus"], "No such command 'bogus'"),
        (["run", "-p", "hi", "--bogus"], "No such option: --bogus"),
        (["run", "-p", "hi", "-n", "abc"], "'-n'"),
        (["run", "-p", "hi", "-xyz"], "unknown option -xyz"),
        (["run", "-p", "hi", "-n5"], "unknown option -n5"),  # llama.cpp has no glued values either
        (["run", "-p", "hi", "-fa", "maybe"], "-fa maybe"),
        (["tokenize", "-p", "hi", "-fa", "on"], "unknown option -fa"),
    ],
    ids=["command", "option", "int", "multi-letter", "glued", "fa-value", "fa-elsewhere"],
)
def test_usage_errors_are_one_line(argv: list[str], needle: str, tiny32: Path) -> None:
    if argv[0] in ("run", "tokenize"):
        argv = [argv[0], str(tiny32), *argv[1:]]
    one_error_line(cli(*argv), needle)


def test_closed_stdout_ends_quietly() -> None:
    vocab = shared("data", "vocab", "ggml-vocab-llama-bpe.gguf")  # --full: megabytes of output
    p = subprocess.Popen(
        [sys.executable, "-m", "llamapy", "info", str(vocab), "--full"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.readline()
    p.stdout.close()  # as `| head -1`
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert first.startswith(b"* File:")
    assert err == "", err
    assert p.returncode != 0


# -- llama.cpp's spellings -----------------------------------------------------------------------


def test_fa_is_one_option_not_f_a(tiny32: Path, tmp_path: Path) -> None:
    """`-fa on` once meant `-f a` (a prompt file named `a`) plus a stray `on`."""
    (tmp_path / "a").write_text("a prompt read from a file called a")
    r = subprocess.run(
        [sys.executable, "-m", "llamapy", "run", str(tiny32), "-p", "Hello", "-n", "2", "-fa", "on"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "-fa on has no effect" in r.stderr


def test_llama_cpp_spellings_are_accepted(tiny32: Path) -> None:
    r = cli(
        "run", str(tiny32), "-p", "Hello", "--predict", "3", "--temperature", "0", "-tb", "2", "--no-mmap",
        "--jinja", "-fa", "off", "-st", "-sp", "-no-cnv",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "-tb has no effect" in r.stderr and "--no-mmap has no effect" in r.stderr and "-fa off has no effect" in r.stderr
    assert "eval time =" in r.stderr and "/     2 runs" in r.stderr  # --predict 3: 3 tokens, 2 evals


def test_log_disable(tiny32: Path) -> None:
    r = cli("run", str(tiny32), "-p", "Hello", "-n", "2", "--log-disable")
    assert r.returncode == 0
    assert r.stderr == "" and r.stdout.strip()
    one_error_line(cli("run", "/nonexistent.gguf", "-p", "hi", "--log-disable"), "no such file")


def test_reverse_prompt_stops_generation(tiny32: Path) -> None:
    free = cli("run", str(tiny32), "-p", "Once upon a time", "-n", "24", "--temp", "0")
    assert free.returncode == 0, free.stderr
    words = free.stdout.split()
    assert len(words) >= 6, free.stdout
    stop = words[len(words) // 2]
    r = cli("run", str(tiny32), "-p", "Once upon a time", "-n", "24", "--temp", "0", "-r", stop)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith(stop)
    assert free.stdout.startswith(r.stdout.rstrip()) and len(r.stdout.rstrip()) < len(free.stdout.rstrip())


def test_sampler_seed_is_logged_and_repeats_the_run(tiny32: Path) -> None:
    args = ["run", str(tiny32), "-p", "Once upon a time", "-n", "12", "--temp", "1.5", "--top-k", "0"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    m = re.search(r"^sampler seed: (\d+)$", first.stderr, re.M)
    assert m, first.stderr
    again = cli(*args, "-s", m.group(1))
    assert again.stdout == first.stdout
    assert f"sampler seed: {m.group(1)}" in again.stderr


def test_end_of_text_is_said(default_model: Path) -> None:
    """A prompt whose greedy continuation is at once <|im_end|>: nothing on stdout, and llama.cpp's
    `[end of text]` on stderr."""
    prompt = "<|im_start|>user\\nReply with one word: yes.<|im_end|>\\n<|im_start|>assistant\\nYes."
    r = cli("run", str(default_model), "-p", prompt, "-n", "8", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
    assert "[end of text]" in r.stderr


# -- conversation mode chosen by the chat template -----------------------------------------------


def test_chat_template_enables_conversation_mode(default_model: Path) -> None:
    r = cli("run", str(default_model), "-n", "4", "--temp", "0", "-c", "256", stdin="Hi\n")
    assert r.returncode == 0, r.stderr
    assert "chat template is available, enabling conversation mode (disable it with -no-cnv)" in r.stderr
    assert r.stdout.strip()  # the answer
    one_error_line(cli("run", str(default_model), "-no-cnv", "-c", "256", stdin="Hi\n"), "no prompt")


def test_no_template_no_prompt_is_an_error(tiny32: Path) -> None:
    one_error_line(cli("run", str(tiny32), stdin="Hi\n"), "no prompt")


def test_single_turn(default_model: Path) -> None:
    r = cli("run", str(default_model), "-cnv", "-st", "-n", "4", "--temp", "0", "-c", "256", stdin="Hi\nAgain\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("\n> ") == 1  # one prompt: one turn, then the end


# -- escapes (on by default, as llama.cpp's -e) ------------------------------------------------------


def test_escapes_are_on_by_default(default_model: Path) -> None:
    r = cli("tokenize", str(default_model), "-p", "a\\nb", "--ids")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[81, 198, 82]"
    r = cli("tokenize", str(default_model), "-p", "a\\nb", "--ids", "--no-escape")
    assert r.stdout.strip() != "[81, 198, 82]"


@pytest.mark.parametrize(
    "text", [b"abc\\", b"a\\x4", b"a\\x4g", b"\\q", b"\xed\xa0\x80", b"\xed\xa0\x80\\n", b"caf\xe9\\t", b"\\xff\\xfe"],
    ids=["trailing", "short-x", "bad-hex", "unknown", "surrogate", "surrogate-n", "latin1", "bytes"],
)
def test_malformed_escapes_are_taken_literally(text: bytes, tiny32: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "llamapy", "tokenize", str(tiny32), "-e", "-p", text], capture_output=True, timeout=300
    )
    assert r.returncode == 0, r.stderr.decode()
    assert b"Traceback" not in r.stderr and b"error" not in r.stderr


def test_run_takes_malformed_escapes_literally(tiny32: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "llamapy", "run", str(tiny32), "-e", "-p", b"a\\x4 \xed\xa0\x80 abc\\", "-n", "1"],
        capture_output=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    assert b"Traceback" not in r.stderr and b"error" not in r.stderr


def test_process_escapes_as_llama_cpp() -> None:
    from llamapy.cli.common import process_escapes

    assert process_escapes("a\\nb\\tc\\\\d\\'e\\\"f") == "a\nb\tc\\d'e\"f"
    assert process_escapes("\\x41\\x4") == "A\\x4"
    assert process_escapes("abc\\") == "abc\\"
    assert process_escapes("\\q\\é") == "\\q\\é"
    assert process_escapes("\\xff").encode("utf-8", "surrogateescape") == b"\xff"
    assert process_escapes("\\xc3\\xa9") == "é"


def test_tokenize_keeps_a_literal_special_token() -> None:
    """llama-tokenize parses special tokens by default; with --no-bos a `<|begin_of_text|>`
    written in the text is the text's own and stays."""
    vocab = str(shared("data", "vocab", "ggml-vocab-llama-bpe.gguf"))
    r = cli("tokenize", vocab, "-p", "<|begin_of_text|>Hello", "--ids", "--no-bos")
    assert r.stdout.strip() == "[128000, 9906]", r.stderr
    r = cli("tokenize", vocab, "-p", "<|begin_of_text|>Hello", "--ids")
    assert r.stdout.strip() == "[128000, 128000, 9906]"
    r = cli("tokenize", vocab, "-p", "<|begin_of_text|>Hello", "--ids", "--no-bos", "--no-parse-special")
    assert r.stdout.strip().startswith("[27, 91, ")  # '<', '|', ...


# -- --help ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "perplexity", "tokenize", "batch", "bench", "info"])
def test_help_fits_80_columns_with_whole_flags_descriptions_and_defaults(command: str) -> None:
    import typer.main

    from llamapy.cli import app, main  # noqa: F401
    from llamapy.cli import batch, bench, info, perplexity, run  # noqa: F401

    r = cli(command, "--help", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    text = r.stdout
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    for p in cmd.params:
        if p.param_type_name != "option":
            continue
        for name in [*p.opts, *p.secondary_opts]:
            assert re.search(rf"(^|[\s,/]){re.escape(name)}([\s,]|$)", text, re.M), f"{command}: {name} missing"
        assert p.help, f"{command}: {p.opts} has no description"
        if p.default not in (None, False) and not p.is_flag:
            # the default follows the description (wrapped lines joined)
            block = " ".join(text.split())
            assert "[default:" in block
    n_values = sum(1 for p in cmd.params if p.param_type_name == "option" and p.default not in (None, False) and not p.is_flag)
    assert " ".join(text.split()).count("[default:") >= n_values


def test_ctrl_c_works_where_sigint_was_inherited_ignored(tiny32: Path) -> None:
    """A background job of a script starts with SIGINT ignored; llama-completion installs its own
    handler all the same, and so does `run`: Ctrl-C still stops it with 130."""
    import signal
    import time

    p = subprocess.Popen(
        [sys.executable, "-m", "llamapy", "run", str(tiny32), "-p", "Once upon a time", "-n", "-2", "-c", "2048"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509
    )  # fmt: skip
    assert p.stdout is not None
    first = b""
    deadline = time.time() + 120
    while not first and time.time() < deadline:
        first = p.stdout.read1(64)  # type: ignore[attr-defined]
    assert first, "no token was streamed"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err
