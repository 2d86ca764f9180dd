"""What the placement and scheduler tests import: a Llama with placement / context options, and
the CLI run in a subprocess (`sys.executable -m llamapy`)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import llamapy
from llamapy.context import ContextOptions, ModelOptions


def open_llm(
    path: Any,
    ngl: int | str = 0,
    *,
    ts: tuple[float, ...] = (),
    mg: int = 0,
    devices: list[str] | None = None,
    ot: list[tuple[str, str]] | None = None,
    **ctx: Any,
) -> llamapy.Llama:
    co = ContextOptions(n_ctx=ctx.pop("n_ctx", 256), **ctx)
    mo = ModelOptions(n_gpu_layers=ngl, tensor_split=ts, main_gpu=mg, devices=devices, override_tensor=ot or ())
    return llamapy.Llama(path, model_options=mo, context_options=co)


def cli(*args: Any, env: dict[str, str] | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    """`python -m llamapy ARGS`; `prelude` is Python run first in the same process (to stand in
    a fake /proc/meminfo reader, say)."""
    e = dict(os.environ)
    e.pop("LLAMAPY_DEBUG", None)
    e.update(env or {})
    cmd = [sys.executable, "-m", "llamapy"]
    if prelude:
        cmd = [sys.executable, "-c", prelude + "\nimport runpy; runpy.run_module('llamapy', run_name='__main__')"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=e, timeout=600)


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The run failed with exactly one `error: …` line containing every needle, no traceback."""
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1, r.stderr
    for n in needles:
        assert n in err[0], err[0]
    return err[0]
