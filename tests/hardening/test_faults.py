"""Runtime faults: Ctrl-C during `run` stops within a token, keeps what was printed and the
timings, exits 130; conversation mode reads turns from stdin and ends cleanly at EOF."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "llamapy", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE, env=env,
    )  # fmt: skip


def test_sigint_during_run_prints_timings_and_exits_130(tiny32: Path) -> None:
    p = _spawn("run", str(tiny32), "-p", "Once upon a time", "-n", "-2", "-c", "2048", "--temp", "0")
    # wait for generated text to start flowing
    first = b""
    deadline = time.time() + 120
    while not first and time.time() < deadline:
        first = p.stdout.read1(64)  # type: ignore[union-attr]
    assert first, "no token was streamed"
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert time.time() - t0 < 10
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err
    assert b"eval time" in err and b"interrupted" in err
    assert len(first + out) > 0


def test_conversation_mode_reads_turns_from_stdin(default_model: Path) -> None:
    p = _spawn("run", str(default_model), "-cnv", "-n", "8", "--temp", "0", "-c", "512")
    out, err = p.communicate(b"Hi there\nWhat is 2+2?\n", timeout=300)
    assert p.returncode == 0, err.decode()
    assert len(out.decode().strip().splitlines()) >= 2  # one answer per turn
    assert b"<|im_start|>" not in out  # the template is not echoed
