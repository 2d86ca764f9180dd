"""Hostile values of the keys the architecture modules read (qwen2, qwen3, gemma3): each load
fails with one LlamapyError naming the key or tensor — never another exception — and the CLI
prints it as one `error:` line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT

import llamapy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from family_models import rewrite_gguf, write_family_gguf  # noqa: E402

U32, I32, F32, STR, ARR = VT.UINT32, VT.INT32, VT.FLOAT32, VT.STRING, VT.ARRAY

CASES = [
    ("qwen3", "qwen3.attention.key_length", (0, U32, None), "key_length / value_length 0/"),
    ("gemma3", "gemma3.feed_forward_length", (100, U32, None), "tensor 'blk.0.ffn_gate.weight' has shape"),
    ("qwen3", "qwen3.attention.key_length", ("abc", STR, None), "'qwen3.attention.key_length' has value 'abc'"),
    ("qwen3", "qwen3.attention.head_count_kv", ([2, 2, 2], ARR, I32), "has 3 values, expected one per layer"),
    ("qwen3", "qwen3.attention.head_count_kv", (3, U32, None), "head_count 4 is not a multiple of head_count_kv 3"),
    ("qwen3", "qwen3.attention.head_count", (0, U32, None), "invalid head_count 0"),
    ("qwen3", "qwen3.block_count", (10**9, U32, None), "block_count 1000000000 out of range"),
    ("qwen2", "qwen2.feed_forward_length", ([256, -1], ARR, I32), "feed_forward_length -1 out of range"),
    ("qwen2", "qwen2.rope.freq_base", (float("nan"), F32, None), "'qwen2.rope.freq_base' has value nan"),
    ("qwen2", "qwen2.rope.scaling.type", ("yarn", STR, None), "rope scaling 'yarn' is not supported"),
    ("qwen2", "general.architecture", ("qwen9", STR, None), "unsupported architecture 'qwen9'"),
    ("gemma3", "gemma3.attention.sliding_window", (-5, I32, None), "'gemma3.attention.sliding_window' has value -5"),
    ("gemma3", "gemma3.attention.sliding_window_pattern", ([1, 0, 1], ARR, I32), "has 3 values, expected one"),
    ("gemma3", "gemma3.attention.sliding_window_pattern", (-2, I32, None), "sliding_window_pattern' has value -2"),
    ("gemma3", "gemma3.rope.freq_base_swa", (float("inf"), F32, None), "freq_base_swa' has value inf"),
    ("gemma3", "gemma3.final_logit_softcapping", (30.0, F32, None), "final_logit_softcapping 30.0 is not supported"),
    ("gemma3", "gemma3.attention.value_length", (16, U32, None), "gemma3 needs key_length == value_length"),
    ("qwen3", "qwen3.pooling_type", (7, U32, None), "pooling_type 7 out of range"),
    ("qwen3", "qwen3.attention.causal", (False, VT.BOOL, None), "llamapy runs causal attention only"),
]  # fmt: skip


def _hostile(tmp_path: Path, arch: str, key: str, value: tuple) -> Path:  # type: ignore[type-arg]
    src = write_family_gguf(tmp_path / "src.gguf", arch, n_layer=2, n_embd=64, n_ff=128, head_dim=32)
    return rewrite_gguf(src, tmp_path / "hostile.gguf", set_keys={key: value})


@pytest.mark.parametrize(("arch", "key", "value", "message"), CASES, ids=lambda c: str(c)[:40])
def test_hostile_key_is_one_named_error(tmp_path: Path, arch: str, key: str, value: tuple, message: str) -> None:  # type: ignore[type-arg]
    path = _hostile(tmp_path, arch, key, value)
    with pytest.raises(llamapy.LlamapyError) as e:
        llamapy.Llama(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_prints_one_line(tmp_path: Path) -> None:
    path = _hostile(tmp_path, "gemma3", "gemma3.attention.sliding_window", (-5, I32, None))
    p = subprocess.run([sys.executable, "-m", "llamapy", "run", str(path), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "gemma3.attention.sliding_window" in errors[0]
