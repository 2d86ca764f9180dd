"""Conversation mode in a terminal (issue 10), through a pseudo-terminal as a user types:
Ctrl-C during an answer gives the `> ` prompt back and the conversation goes on; Ctrl-C at the
prompt, Ctrl-D and /exit end the session; readline's history; the prompt on stdout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")


def spawn(model: Path, *args: str, stderr_to: Path | None = None) -> "pexpect.spawn":
    argv = [sys.executable, "-m", "llamapy", "run", str(model), "-c", "1024", "--temp", "0", *args]
    if stderr_to is None:
        return pexpect.spawn(argv[0], argv[1:], encoding="utf-8", timeout=180, dimensions=(24, 200))
    # only stdout on the terminal: what appears there was written to stdout
    import shlex

    cmd = " ".join(shlex.quote(a) for a in argv) + " 2>" + shlex.quote(str(stderr_to))
    return pexpect.spawn("/bin/sh", ["-c", cmd], encoding="utf-8", timeout=180, dimensions=(24, 200))


def finish(c: "pexpect.spawn") -> int:
    c.expect(pexpect.EOF)
    c.close()
    return c.exitstatus if c.exitstatus is not None else 128 + (c.signalstatus or 0)


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(default_model: Path) -> None:
    c = spawn(default_model, "-n", "-1", "--ignore-eos")  # an answer that never ends by itself
    c.expect("enabling conversation mode")
    c.expect("> ")
    c.sendline("Tell me a long story about a dragon.")
    c.expect("dragon.\r\n")
    c.expect(r"\w+ \w+ \w+")  # the answer flows
    c.sendintr()
    c.expect("\r\n> ")  # the prompt is back: the session goes on
    assert c.isalive()
    c.sendline("And a cat?")
    c.expect("cat\\?\r\n")
    c.expect(r"\w+ \w+")  # a second answer, in the same conversation
    c.sendintr()
    c.expect("\r\n> ")
    c.sendline("/exit")
    assert finish(c) == 0
    assert "Traceback" not in (c.before or "")


def test_ctrl_c_at_the_prompt_ends_the_session(default_model: Path) -> None:
    c = spawn(default_model, "-n", "4")
    c.expect("> ")
    c.sendintr()
    assert finish(c) == 130
    assert "Traceback" not in (c.before or "")


def test_ctrl_d_ends_the_session(default_model: Path) -> None:
    c = spawn(default_model, "-n", "4")
    c.expect("> ")
    c.sendline("Hi")
    c.expect("Hi\r\n")
    c.expect("\r\n> ")
    c.sendeof()
    assert finish(c) == 0


def test_history_and_prompt_on_stdout(default_model: Path, tmp_path: Path) -> None:
    err = tmp_path / "stderr.txt"
    c = spawn(default_model, "-n", "3", stderr_to=err)
    c.expect("> ")  # stderr goes to a file: this prompt came from stdout
    c.sendline("What is the capital of France?")
    c.expect("France\\?\r\n")
    c.expect("\r\n> ")
    c.send("\x1b[A")  # the up arrow: readline brings the last line back
    c.expect("What is the capital of France\\?")
    c.send("\x15")  # Ctrl-U: readline erases the line
    c.sendline("/exit")
    assert finish(c) == 0
    assert "enabling conversation mode" in err.read_text()
