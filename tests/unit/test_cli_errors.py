"""Bad input through the CLI: one clear line on stderr, a non-zero exit, no traceback (unless
LLAMAPY_DEBUG=1); and the flag names llama.cpp users type."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("LLAMAPY_DEBUG", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "llamapy", *args], capture_output=True, text=True, env=e, input=stdin, timeout=300
    )


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1, r.stderr
    for n in needles:
        assert n in err[0], err[0]


def test_missing_file() -> None:
    one_line_error(cli("run", "/nonexistent/model.gguf", "-p", "hi"), "no such file")


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_text("hello, I am not a model at all")
    one_line_error(cli("run", str(p), "-p", "hi"), "not a GGUF file", "magic")


def test_truncated_gguf(tmp_path: Path, tiny32: Path) -> None:
    p = tmp_path / "t.gguf"
    p.write_bytes(tiny32.read_bytes()[:4000])
    one_line_error(cli("run", str(p), "-p", "hi"), "offset")


def test_unknown_architecture(make_llama) -> None:  # noqa: ANN001
    one_line_error(cli("run", str(make_llama(n_layer=1, arch="mamba")), "-p", "hi"), "unsupported architecture 'mamba'")


def test_unknown_quant_type(tmp_path: Path, make_llama) -> None:  # noqa: ANN001
    """A tensor type llamapy does not compute (IQ2_XXS) named in the error."""
    src = make_llama(n_layer=1)
    from llamapy.model.gguf import GGUFFile

    gf = GGUFFile(src)
    data = bytearray(src.read_bytes())
    info = next(iter(gf.tensors.values()))
    name = info.name.encode()
    at = data.index(name) + len(name) + 4 + 8 * len(info.ne)  # after name, n_dims, dims: the type
    data[at : at + 4] = (16).to_bytes(4, "little")  # IQ2_XXS
    p = tmp_path / "iq.gguf"
    p.write_bytes(bytes(data))
    r = cli("run", str(p), "-p", "hi")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "IQ2_XXS" in r.stderr or "block size" in r.stderr or "runs past" in r.stderr


def test_prompt_longer_than_context(tiny32: Path) -> None:
    one_line_error(cli("run", str(tiny32), "-p", "word " * 200, "-c", "64"), "longer than the context")


def test_context_larger_than_memory(tiny32: Path) -> None:
    one_line_error(cli("run", str(tiny32), "-p", "hi", "-c", str(2**30)), "-c", "MiB")


def test_n_below_minus_two(tiny32: Path) -> None:
    one_line_error(cli("run", str(tiny32), "-p", "hi", "-n", "-3"), "-n -3")


def test_non_utf8_prompt_file(tmp_path: Path, tiny32: Path) -> None:
    p = tmp_path / "bad.txt"
    p.write_bytes(b"caf\xe9\n")
    one_line_error(cli("run", str(tiny32), "-f", str(p)), "not valid UTF-8")


def test_empty_prompt_file(tmp_path: Path, tiny32: Path) -> None:
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    one_line_error(cli("run", str(tiny32), "-f", str(p)), "empty")


def test_traceback_only_with_debug(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_text("nope")
    r = cli("run", str(p), "-p", "hi", env={"LLAMAPY_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_ngl_beyond_layer_count_is_clamped(tiny32: Path) -> None:
    r = cli("run", str(tiny32), "-p", "Hello", "-n", "2", "--temp", "0", "-ngl", "999", env={"LLAMAPY_TEST_GPU": "1"})
    assert r.returncode == 0, r.stderr
    assert "offloaded 33/33 layers to GPU" in r.stderr
    assert "offloading output layer to GPU" in r.stderr


def test_ngl20_load_log(tiny32: Path) -> None:
    r = cli("run", str(tiny32), "-p", "Hello", "-n", "1", "-ngl", "20", env={"LLAMAPY_TEST_GPU": "1", "LLAMAPY_SCHED_DEBUG": "1"})
    assert r.returncode == 0, r.stderr
    assert "offloading 19 repeating layers to GPU" in r.stderr
    assert "offloaded 20/33 layers to GPU" in r.stderr
    assert "TEST0 compute buffer size" in r.stderr and "CPU compute buffer size" in r.stderr
    assert "## SPLIT #0: CPU" in r.stderr


def test_stdout_carries_only_text(tiny32: Path) -> None:
    r = cli("run", str(tiny32), "-p", "Hello", "-n", "3", "--temp", "0")
    assert r.returncode == 0
    assert "llama_" not in r.stdout and "load time" in r.stderr


def test_devices_lists_pass_and_failures() -> None:
    r = cli("devices", env={"LLAMAPY_TEST_GPU": "1"})
    assert r.returncode == 0, r.stderr
    assert "CPU" in r.stdout and "PASS" in r.stdout and "TEST0" in r.stdout
    if "CUDA0" not in r.stdout:
        assert "CUDA" in r.stdout and "FAIL" in r.stdout  # reported, never a crash
    assert "CPU kernels: " in r.stdout
    r = cli("devices", env={"LLAMAPY_KERNELS": "numpy"})
    assert "CPU kernels: numpy  (C kernels: LLAMAPY_KERNELS=numpy)" in r.stdout


def test_info_accepts_vocab_only_files_of_any_architecture() -> None:
    from tests_support import shared

    r = cli("info", str(shared("data", "vocab", "ggml-vocab-phi-3.gguf")))
    assert r.returncode == 0, r.stderr
    assert "general.architecture = 'phi3'" in r.stdout
    r = cli("tokenize", str(shared("data", "vocab", "ggml-vocab-phi-3.gguf")), "-p", "Hello world", "--ids")
    assert r.returncode == 0 and r.stdout.startswith("[")


@pytest.mark.parametrize("argv", [["-ngl", "5"], ["-ngl=5"], ["--n-gpu-layers", "5"]])
def test_llama_cpp_flag_spellings(argv: list[str], tiny32: Path) -> None:
    from typer.testing import CliRunner

    import llamapy.cli as cli_mod
    from llamapy.cli import app

    cli_mod.main  # noqa: B018 - registers the commands
    from llamapy.cli import batch, bench, info, perplexity, run  # noqa: F401

    r = CliRunner().invoke(app, ["run", str(tiny32), "-p", "Hi", "-n", "1", *argv], env={"LLAMAPY_TEST_GPU": "1"})
    assert r.exit_code == 0, r.output


def test_logit_bias_and_typical_flags(tiny32: Path) -> None:
    """-l TOKEN_ID(+/-)BIAS as llama.cpp reads it (a ban moves the greedy text), --typical; a
    malformed bias or an id past the vocabulary is one line."""
    args = ["run", str(tiny32), "-p", "The capital of France is", "-n", "4", "--temp", "0", "-c", "64"]
    base = cli(*args)
    assert base.returncode == 0, base.stderr[-1500:]
    from llamapy.api import Llama

    with Llama(tiny32, n_ctx=64) as llm:
        tok = llm.generate("The capital of France is", 1, temp=0).tokens[0]
    banned = cli(*args, "-l", f"{tok}-inf", "--logit-bias", "1+0.5")
    assert banned.returncode == 0 and banned.stdout != base.stdout, banned.stderr[-1500:]
    assert cli(*args, "--typical", "0.5").returncode == 0
    one_line_error(cli(*args, "-l", "5*2"), "--logit-bias 5*2: expected TOKEN_ID(+/-)BIAS")
    one_line_error(cli(*args, "-l", "99999999+1"), "logit bias for token 99999999: out of range")


def test_more_sampler_flags(tiny32: Path) -> None:
    args = ["run", str(tiny32), "-p", "The capital of France is", "-n", "3", "--temp", "0.8", "-s", "1", "-c", "64"]
    for flags in (["--mirostat", "2", "--mirostat-lr", "0.2", "--mirostat-ent", "3"], ["--top-nsigma", "1"],
                  ["--xtc-probability", "0.5", "--xtc-threshold", "0.1"]):  # fmt: skip
        r = cli(*args, *flags)
        assert r.returncode == 0, (flags, r.stderr[-1500:])
    one_line_error(cli(*args, "--mirostat", "3"), "--mirostat 3: 0 (off), 1 or 2")
