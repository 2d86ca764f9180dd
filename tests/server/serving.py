"""Starting and stopping a real `llamapy serve` subprocess for the server tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class Server:
    """`python -m llamapy serve MODEL --port 0 ARGS…` on loopback; the port is read from its log."""

    def __init__(self, model: Path, args: list[str], log: Path, ready_s: float = 120.0,
                 cli: list[str] | None = None, env: dict[str, str] | None = None) -> None:  # fmt: skip
        """`cli`: the command that runs llamapy's CLI (default: python -m llamapy)."""
        self.log = log
        self._log_fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [*(cli or [sys.executable, "-m", "llamapy"]), "serve", str(model), "--host", "127.0.0.1", "--port", "0", *args],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=self._log_fh, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        self.url = ""
        try:
            self._wait(ready_s)
        except BaseException:
            self.stop()
            raise

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait(self, ready_s: float) -> None:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:  # the port
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.text()}")
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.text())
            if m:
                self.url = m.group(1)
                break
            time.sleep(0.05)
        while time.monotonic() < deadline:  # the model
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.text()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {ready_s} s:\n{self.text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log_fh.close()
