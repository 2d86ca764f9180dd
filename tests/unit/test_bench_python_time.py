"""bench/python_time.py (issue 11's Python-time-per-step figure) runs against the library as it
is: its three paths on a small written model, each line with positive step and native times.
No timing assertion."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[2]


def test_python_time_runs_its_three_paths(make_llama: Callable[..., Path]) -> None:
    path = make_llama(n_layer=2, qtype=T.Q4_0)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "python_time.py"), str(path), "-t", "1", "-n", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {line[:28].strip(): line[28:].split() for line in r.stdout.splitlines()[1:]}
    assert list(rows) == ["executor", "run_nodes", "executor, native stubbed"]
    for label, (step, native, _python) in rows.items():
        assert float(step) > 0 and (float(native) > 0) == (label != "executor, native stubbed"), (label, rows)
