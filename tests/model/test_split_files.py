"""A model split by llama-gguf-split runs from its first file as the whole file does: the same
logits to the bit on the CPU and the TEST device, the same text and load log from the CLI, and a
later file alone refused in one line. The slow test splits the default model with llama.cpp's
own llama-gguf-split (skipped where it is not built)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.context import ContextOptions, ModelOptions
from family_models import write_family_gguf
from tests_support import bench_module, cli, split_gguf

TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33]


def _logits(path: Path, ngl: int | str = 0) -> list[np.ndarray]:
    """A prompt's logits, then two decode steps."""
    n = len(TOKENS)
    with llamapy.Llama(path, model_options=ModelOptions(n_gpu_layers=ngl), context_options=ContextOptions(n_ctx=64)) as llm:
        out = [llm.ctx.decode(TOKENS, list(range(n)), 0, np.ones(n, bool))]
        out += [llm.ctx.decode([5 + i], [n + i], 0, np.ones(1, bool)) for i in range(2)]
    return out


@pytest.fixture
def whole(tmp_path: Path) -> Path:
    # qwen2 with Q/K/V biases: the loader fuses Q, K and V, whose parts may lie in two files
    return write_family_gguf(tmp_path / "whole.gguf", "qwen2", qtype=T.Q8_0, tied=False, n_layer=3)


@pytest.mark.parametrize("n", [2, 5])
def test_split_model_gives_the_whole_files_logits(tmp_path: Path, whole: Path, n: int) -> None:
    paths = split_gguf(whole, tmp_path / "m", n)
    for a, b in zip(_logits(whole), _logits(paths[0])):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_split_model_on_the_test_device(tmp_path: Path, whole: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    paths = split_gguf(whole, tmp_path / "m", 3, empty_first=True)
    for a, b in zip(_logits(whole, "all"), _logits(paths[0], "all")):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_cli_runs_info_and_refuses_a_later_file(tmp_path: Path, whole: Path) -> None:
    paths = split_gguf(whole, tmp_path / "m", 3)
    args = ["-p", "abc", "-n", "8", "--temp", "0", "-c", "64"]
    ref, got = cli("run", str(whole), *args), cli("run", str(paths[0]), *args)
    assert ref.returncode == 0 and got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == ref.stdout
    assert "llama_model_loader: additional 2 GGUFs metadata loaded." in got.stderr
    assert "additional" not in ref.stderr
    info = cli("info", str(paths[0]))
    assert info.returncode == 0, info.stderr
    assert f"* Split 3 of 3: {paths[2]}" in info.stdout and " in split 2\n" in info.stdout
    bad = cli("run", str(paths[1]), *args)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "error: m-00002-of-00003.gguf: file 2 of a model split in 3; open it from its first file (m-00001-of-00003.gguf)"
    ]


@pytest.mark.slow
def test_llama_gguf_split_files_of_the_default_model(tmp_path: Path, default_model: Path) -> None:
    """The default model cut by llama.cpp's tool, by tensor count and by size with an empty first
    file: the whole file's logits, bit for bit."""
    llama_cpp = bench_module("llama_cpp")
    tool = llama_cpp.find_gguf_split()
    if tool is None and llama_cpp.find_tools():  # llama.cpp is built here: one more target, seconds
        tool = llama_cpp.build_gguf_split(timeout=600)
    if tool is None:
        pytest.skip("llama.cpp is not built (python bench/llama_cpp.py build --gguf-split)")
    toks = list(range(1, 40))
    with llamapy.Llama(default_model, context_options=ContextOptions(n_ctx=64)) as llm:
        ref = llm.logits(toks)
    for name, flags in {"tensors": ["--split-max-tensors", "100"],
                        "size": ["--split-max-size", "40M", "--no-tensor-first-split"]}.items():  # fmt: skip
        subprocess.run([str(tool), "--split", *flags, str(default_model), str(tmp_path / name)], check=True,
                       capture_output=True)  # fmt: skip
        first = sorted(tmp_path.glob(f"{name}-*.gguf"))[0]
        with llamapy.Llama(first, context_options=ContextOptions(n_ctx=64)) as llm:
            assert len(llm.model.gguf.splits) >= 2, name
            assert np.array_equal(llm.logits(toks).view(np.uint32), ref.view(np.uint32)), name
