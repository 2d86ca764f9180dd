"""llamapy.backend.native: the C kernels are compiled once into the cache and then only loaded;
without a compiler (or with LLAMAPY_NATIVE=0) the kernels fall back to numba/numpy, reported,
never an error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llamapy.backend import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _py(code: str, **env: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, **env}, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


PROBE = (
    "from llamapy.backend import native, qmatmul; b = native.needs_build(); "
    "print(b, native.lib() is not None, qmatmul.kernels(), native.error())"
)


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")
def test_built_once_then_loaded(tmp_path) -> None:
    first = _py(PROBE, LLAMAPY_CACHE=str(tmp_path))
    assert first == "True True c None"
    assert len(list((tmp_path / "native").glob("llamapy-cpu-*.so"))) == 1
    assert _py(PROBE, LLAMAPY_CACHE=str(tmp_path)) == "False True c None"


@pytest.mark.parametrize(("env", "why"), [({"CC": "/nonexistent/cc"}, "no C compiler found"),
                                          ({"LLAMAPY_NATIVE": "0"}, "disabled by LLAMAPY_NATIVE=0")])
def test_without_c_kernels_falls_back(tmp_path, env: dict[str, str], why: str) -> None:
    out = _py(PROBE, LLAMAPY_CACHE=str(tmp_path), **env)
    assert out.startswith("False False numba ") or out.startswith("False False numpy ")
    assert why in out
