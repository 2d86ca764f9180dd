"""Helpers the tests import (pytest puts this folder on sys.path with conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
# the reference data beside the clone; LLAMAPY_SHARED points elsewhere (a missing folder shows
# what a fresh clone without it does: every test that needs it skips)
SHARED = Path(os.environ.get("LLAMAPY_SHARED") or REPO.parent / "shared")


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py, loaded afresh as module `bench_<name>`, with bench/ on sys.path while it
    loads: the scripts import each other (compare.py: llama_cpp, models1b) from there."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up there
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(REPO / "bench"))


def shared(*parts: str) -> Path:
    """A file under ../shared, read in place; the test is skipped where it is missing."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is not available")
    return p


def cli(*args: str | bytes, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 300):  # noqa: ANN201
    """`python -m llamapy ARGS` in a subprocess (the installed CLI), LLAMAPY_DEBUG unset."""
    import os
    import subprocess
    import sys

    e = dict(os.environ)
    e.pop("LLAMAPY_DEBUG", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "llamapy", *args], capture_output=True, text=True, env=e, input=stdin,
        timeout=timeout, errors="replace",
    )  # fmt: skip


def wait_child(pid: int, what: str, timeout: float = 20.0) -> None:
    """Wait for a fork child that exits 0 when its check passed; a hung child is killed and
    fails the test naming `what` (the parallel region a fork child could hang in)."""
    import os
    import time

    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the fork child hung in {what}")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def matcher_takes(m, n_vocab: int, tokens: list[int]) -> bool:  # noqa: ANN001
    """Whether a constraint matcher (model/constrain.py) allows each of `tokens` in turn, its
    mask then accept (it has taken those it allowed)."""
    import numpy as np

    from llamapy.model.constrain import ConstraintError

    for t in tokens:
        row = np.zeros(n_vocab, np.float32)
        m.mask(row)
        if not np.isfinite(row[t]):
            return False
        try:
            m.accept(t)
        except ConstraintError:
            return False
    return True


def matcher_allows_eos(m, tok) -> bool:  # noqa: ANN001
    """Whether the matcher's mask lets the tokenizer's end of generation through now."""
    import numpy as np

    row = np.zeros(tok.n_vocab, np.float32)
    m.mask(row)
    return bool(np.isfinite(row[tok.eos]))
