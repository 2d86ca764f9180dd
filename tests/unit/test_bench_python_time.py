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


def test_python_time_gpu_plan_mode(make_llama: Callable[..., Path]) -> None:
    """--gpu-plan: the decode split at -ngl all runs as one GPU plan (one graph) on the no-op
    TEST device, and a positive median is reported. No timing assertion."""
    path = make_llama(n_layer=2, qtype=T.Q8_0)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "python_time.py"), str(path), "--gpu-plan", "-n", "5",
                        "--evict-mib", "1", "-c", "256"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "TEST0 GPU plan:" in lines[1] and "one CUDA graph" in lines[1], r.stdout
    median = float(lines[2].split("median ")[1].split(",")[0])
    assert median > 0, r.stdout
