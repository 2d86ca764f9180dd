"""The kernel libraries are built when llamapy is installed (setup.py), one per SIMD variant, and
only loaded at run time; without a C compiler the install still succeeds and llamapy runs its
numpy kernels, saying so once on stderr and in `llamapy devices`."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llamapy.backend import native

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("LLAMAPY_KERNELS")}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**e, **env}, timeout=600)


PROBE = "from llamapy.backend import native, qmatmul; print(native.variant(), qmatmul.kernels(), native.error())"


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")
def test_install_built_every_variant() -> None:
    """The install (tests/run.sh: pip install -e) built portable, and on x86-64 AVX2 and AVX-512
    too (the AVX-512 one compiles on any x86-64 host, runs only where the CPU has it)."""
    assert native.built() == (["avx512", "avx2", "portable"] if X86 else ["portable"])


def test_run_time_compiles_nothing(tmp_path: Path) -> None:
    """No compiler reachable at run time (CC and PATH pointing nowhere): the library still loads."""
    if not native.built():
        pytest.skip("this install built no kernel library")
    r = _run([sys.executable, "-c", PROBE], CC=str(tmp_path / "no-cc"), PATH=str(tmp_path))
    assert r.returncode == 0, r.stderr
    best = next(v for v in native.built() if native.runnable(v))
    assert r.stdout.split() == [best, "c", "None"]


def test_without_kernels_numpy_said_once(tmp_path: Path) -> None:
    """No library for the wanted variant (as after an install without a compiler): numpy
    kernels, said once on stderr by the CLI and in `llamapy devices`; the run still works."""
    env = {"LLAMAPY_KERNELS_VARIANT": "portable-missing"}
    r = _run([sys.executable, "-c", PROBE], **env)
    assert r.returncode == 0 and r.stdout.startswith("None numpy unknown kernel variant"), r.stdout + r.stderr
    r = _run([sys.executable, "-m", "llamapy", "run", "-p", "Hi", "-n", "2", "--temp", "0", "-c", "64"], **env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("no compiled CPU kernels") == 1
    r = _run([sys.executable, "-m", "llamapy", "devices"], **env)
    assert "CPU kernels: numpy  (C kernels: unknown kernel variant" in r.stdout


@pytest.mark.slow
def test_setup_without_compiler_succeeds(tmp_path: Path) -> None:
    """build_ext with a compiler that does not exist: a warning per variant, exit 0, no library."""
    r = _run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
              "--build-temp", str(tmp_path / "tmp")], CC=str(tmp_path / "no-cc"))
    assert r.returncode == 0, r.stderr
    assert "the portable CPU kernels were not built" in r.stderr
    assert not list((tmp_path / "lib").rglob("*.so"))


@pytest.mark.slow
def test_setup_builds_variants(tmp_path: Path) -> None:
    """A build from the sources writes one library per variant into the package's _kernels/."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine")
    r = _run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
              "--build-temp", str(tmp_path / "tmp")])
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in (tmp_path / "lib" / "llamapy" / "backend" / "_kernels").glob("*.so"))
    assert names == (["lp_avx2.so", "lp_avx512.so", "lp_portable.so"] if X86 else ["lp_portable.so"])
