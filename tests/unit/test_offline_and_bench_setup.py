"""Setup items of issue 10: the fast suite skips (never fails) when the default model cannot be
fetched, and bench/llama_cpp.py finds ../shared next to the checkout only and keeps AMX out of
the llama.cpp build on hosts that report it (without building anything here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests_support import REPO, bench_module

# tests that need the default model, each through the default_model fixture
NEEDS_MODEL = [
    "tests/model/test_perplexity.py::test_kld_smollm2",
    "tests/model/test_batch.py::test_smollm2_small_batch_matches_single_runs",
    "tests/unit/test_cli_usage.py::test_end_of_text_is_said",
]


def test_tests_that_need_the_default_model_skip_offline(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.update(
        LLAMAPY_CACHE=str(tmp_path / "empty-cache"),  # no model cached...
        PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="",  # ...nor fetchable
    )  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *NEEDS_MODEL],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "failed" not in r.stdout and "error" not in r.stdout.lower().split("short test summary")[0], r.stdout[-3000:]
    assert "default model unavailable" in r.stdout
    assert " passed" not in r.stdout  # every one of them skipped


def test_bench_finds_shared_next_to_the_checkout_only() -> None:
    mod = bench_module("llama_cpp")
    assert mod.REFERENCE == REPO.parent / "shared" / "reference" / "smollm2" / "bench.json"
    for path in (REPO / "bench").glob("*.py"):
        assert '"/work/' not in path.read_text(), path  # no machine's absolute path


def test_llama_cpp_build_flags_keep_amx_out_where_reported() -> None:
    mod = bench_module("llama_cpp")
    intel = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
    amd = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    flags = mod.cmake_flags(intel)
    assert f"-DCMAKE_C_FLAGS={no_amx}" in flags and f"-DCMAKE_CXX_FLAGS={no_amx}" in flags
    assert flags[: len(mod.CMAKE_FLAGS)] == mod.CMAKE_FLAGS
    assert mod.cmake_flags(amd) == mod.CMAKE_FLAGS
