"""Shared fixtures: where ../shared is, the default model, and small llama GGUFs written with
gguf.GGUFWriter (any layer count, any quant type) for differential tests."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests_support import shared

# LLAMAPY_CUDA_EMU=1: `cupy` is tests/gpu/emu_cupy.py's stand-in over the CUDA emulator (installed
# before any test imports cupy or llamapy discovers its backends), so tests/gpu runs llamapy's CUDA
# backend unmodified on the CPU; llamapy itself knows nothing of it
if os.environ.get("LLAMAPY_CUDA_EMU") == "1":
    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    import emu_cupy

    emu_cupy.install_for_tests()

# repacked-weight cache files of the models tests write go to a scratch folder, not ~/.cache
os.environ.setdefault("LLAMAPY_REPACK_CACHE", tempfile.mkdtemp(prefix="llamapy-repack-"))

# byte offsets of the f16 super-block scales (d, dmin) inside one block, per K-quant type:
# random bytes elsewhere are valid quants, but random scales could be inf/nan
K_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


@pytest.fixture(scope="session")
def default_model() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the pip cache (.ci/run fetches it first)."""
    from llamapy.model.fetch import default_model_path
    from llamapy.types import LlamapyError

    try:
        return default_model_path()
    except LlamapyError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def tiny32() -> Path:
    return shared("reference", "tiny32", "tiny32-Q4_K_M.gguf")


def quantize_rows(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of `w` (rows, cols) in `qtype`: gguf-py's quantizer where it has one, else
    random valid blocks (K-quants: random quants, small fixed scales)."""
    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        blck, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = w.shape[0] * w.shape[1] // blck
        raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
        for k, off in enumerate(K_SCALE_OFFSETS[qtype]):
            # Q3_K/Q6_K scales are signed int8 (up to 127): keep their product with d small
            d = 1e-3 if qtype in (T.Q3_K, T.Q6_K) else 0.01
            val = np.float16(d / (1 if k == 0 else 2))
            raw[:, off : off + 2] = np.frombuffer(val.tobytes(), np.uint8)
        return raw.reshape(w.shape[0], -1)


def write_llama_gguf(
    path: Path,
    n_layer: int = 2,
    n_embd: int = 256,
    n_ff: int = 512,
    n_head: int = 4,
    n_head_kv: int = 2,
    qtype: T = T.Q8_0,
    embd_type: T | None = None,
    tied: bool = True,
    rope_freqs: bool = False,
    seed: int = 0,
    arch: str = "llama",
    chat_template: str | None = None,
    sorted_layers: bool = False,
    add_space_prefix: bool | None = None,
    v_type: T | None = None,
) -> Path:
    """A small llama GGUF with random weights and a byte-level SPM vocabulary. `sorted_layers`:
    each layer's tensors in name order (attn_k, attn_norm, ..., ffn_up, as llama-quantize's files
    have them: no fused weight's parts one after another), else q, k, v and gate, up adjacent.
    `v_type`: attn_v's type (Q4_K_M files keep it in Q6_K: Q, K and V then stay three products)."""
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁the", "▁a", "▁and", "▁of", "▁to", "▁in", "ing", "ed", "▁he", "▁she", "er", "▁it"]
    tokens += words
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(words))]
    ttypes = [2, 3, 3] + [6] * 256 + [1] * len(words)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test-{n_layer}l-{qtype.name}")
    w.add_block_count(n_layer)
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(ttypes)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    layer: list[tuple[str, np.ndarray, T]] = []  # a layer's tensors, with sorted_layers

    def add(name: str, data: np.ndarray, t: T) -> None:
        if name.startswith("blk.") and sorted_layers:
            layer.append((name, data, t))
        else:
            write(name, data, t)

    def write(name: str, data: np.ndarray, t: T) -> None:
        if t in (T.F32,):
            w.add_tensor(name, data.astype(np.float32))
        elif t is T.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quantize_rows(data, t, rng), raw_dtype=t)

    add("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(np.float32), embd_type or qtype)
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32), T.F32)
        add(p + "attn_q.weight", mat(n_embd, n_embd), qtype)
        add(p + "attn_k.weight", mat(n_head_kv * head_dim, n_embd), qtype)
        add(p + "attn_v.weight", mat(n_head_kv * head_dim, n_embd), v_type or qtype)
        add(p + "attn_output.weight", mat(n_embd, n_embd, 0.5), qtype)
        add(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32), T.F32)
        add(p + "ffn_gate.weight", mat(n_ff, n_embd), qtype)
        add(p + "ffn_up.weight", mat(n_ff, n_embd), qtype)
        add(p + "ffn_down.weight", mat(n_embd, n_ff, 0.5), qtype)
        for name, data, t in sorted(layer, key=lambda e: e[0]):
            write(name, data, t)
        layer.clear()
    add("output_norm.weight", np.ones(n_embd, np.float32), T.F32)
    if not tied:
        add("output.weight", mat(n_vocab, n_embd, 4.0), qtype)
    if rope_freqs:
        add("rope_freqs.weight", (1.0 + rng.random(head_dim // 2)).astype(np.float32), T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def make_llama(tmp_path: Path) -> Callable[..., Path]:
    counter = iter(range(10**6))

    def make(**kw: object) -> Path:
        return write_llama_gguf(tmp_path / f"model{next(counter)}.gguf", **kw)  # type: ignore[arg-type]

    return make


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the backends its environment asks for (LLAMAPY_TEST_GPU, LLAMAPY_BACKENDS)."""
    from llamapy.backend import registry

    monkeypatch.setattr(registry, "_cache", None)
    yield
    registry._cache = None


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
