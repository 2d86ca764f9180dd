"""A dense model whose weights are IQ4_NL, IQ4_XS or MXFP4 (the quant types mixture-of-experts
models ship in) runs end to end on the CPU: with float32 activations its logits are the float64
forward pass of the dequantized file (family_models.reference_logits); in the default q8 mode the
compiled executor gives run_nodes' bits, a prompt's logits are the same bits in one batch and token
by token (the q8 kernels keep one order at every batch size), and stay close to the reference."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy import quants
from llamapy.context import ContextOptions
from llamapy.types import block_size
from family_models import reference_logits, write_family_gguf

TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33, 34, 120, 121, 122, 50, 51]
TYPES = {"IQ4_NL": T.IQ4_NL, "IQ4_XS": T.IQ4_XS, "MXFP4": T.MXFP4}


def _nearest(x: np.ndarray, d: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest x / d, per element (d broadcast; d = 0 -> index of 0-ish)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d != 0, x / d, 0)
    return np.abs(t[..., None] - values.astype(np.float32)).argmin(axis=-1).astype(np.uint8)


def _pack(q: np.ndarray) -> np.ndarray:
    """(…, 32) nibble indices -> (…, 16) bytes: elements 0..15 low nibbles, 16..31 high."""
    return q[..., :16] | (q[..., 16:] << np.uint8(4))


def quantize_for_test(data: np.ndarray, qtype: T) -> np.ndarray:
    """A simple quantizer into valid IQ4_NL / IQ4_XS blocks (round to the nearest grid value
    under a max-based scale; not ggml's search, which only changes which valid blocks the file
    holds) and gguf-py's MXFP4 one."""
    if qtype == T.MXFP4:
        return gguf.quants.quantize(data, qtype)
    rows, cols = data.shape
    kv = quants.KVALUES_IQ4NL
    b = data.reshape(-1, 32).astype(np.float32)
    m = b[np.arange(b.shape[0]), np.abs(b).argmax(axis=1)]
    if qtype == T.IQ4_NL:
        d = (m / np.float32(-127)).astype(np.float16)
        q = _nearest(b, d.astype(np.float32)[:, None], kv)
        return np.concatenate([d.view(np.uint8).reshape(-1, 2), _pack(q)], axis=1).reshape(rows, -1)
    s = (m / np.float32(-127)).reshape(-1, 8)  # IQ4_XS: 8 sub-block scales per 256
    smax = s[np.arange(s.shape[0]), np.abs(s).argmax(axis=1)]
    d = (smax / np.float32(-32)).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.clip(np.rint(np.where(df != 0, s / df, 0)), -32, 31).astype(np.int32)
    q = _nearest(b.reshape(-1, 8, 32), (df * ls)[..., None], kv)
    l6 = (ls + 32).astype(np.uint16)
    sl = ((l6[:, 0::2] & 15) | ((l6[:, 1::2] & 15) << 4)).astype(np.uint8)
    sh = ((l6 >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype(np.uint16)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), sh.view(np.uint8).reshape(-1, 2), sl,
                          _pack(q).reshape(-1, 128)], axis=1)  # fmt: skip
    return out.reshape(rows, -1)


def write_model(path: Path, qtype: T) -> Path:
    """A tiny untied qwen3 (n_embd 256, n_ff 512: rows a multiple of IQ4_XS's 256) with every
    matrix, the token embeddings and the output included, in `qtype`."""
    f32 = write_family_gguf(path.with_suffix(".f32.gguf"), "qwen3", n_embd=256, n_ff=512, head_dim=64, tied=False)
    r = gguf.GGUFReader(str(f32))
    w = gguf.GGUFWriter(str(path), "qwen3")
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            vt = f.types[0]
            sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2:
            q = quantize_for_test(np.ascontiguousarray(data, np.float32), qtype)
            assert q.shape[1] == data.shape[1] // block_size(qtype)[0] * block_size(qtype)[1]
            w.add_tensor(t.name, q, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(path: Path, tokens: list[int], mode: str, ubatch: int = 512) -> np.ndarray:
    co = ContextOptions(n_ctx=256, type_k=T.F32, type_v=T.F32, cpu_matmul=mode, n_ubatch=ubatch, n_batch=512)
    with llamapy.Llama(path, context_options=co) as llm:
        return llm.ctx.decode(tokens, list(range(len(tokens))), 0, np.ones(len(tokens), bool))


@pytest.fixture(scope="module", params=list(TYPES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, np.ndarray]:
    name = request.param
    path = write_model(tmp_path_factory.mktemp("iq") / f"{name}.gguf", TYPES[name])
    return name, path, reference_logits(path, TOKENS)


def test_f32_mode_is_the_dequantized_model(model: tuple[str, Path, np.ndarray]) -> None:
    name, path, ref = model
    got = _logits(path, TOKENS, "f32")
    err = np.abs(got - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), (name, err, np.abs(ref).max())


def test_q8_mode_batch_invariant_executor_and_close(model: tuple[str, Path, np.ndarray],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    name, path, ref = model
    full = _logits(path, TOKENS, "q8")
    one = _logits(path, TOKENS, "q8", ubatch=1)  # token by token through the KV cache
    assert np.array_equal(full.view(np.uint32), one.view(np.uint32)), name
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "0")  # run_nodes, the reference path
    nodes = _logits(path, TOKENS, "q8")
    assert np.array_equal(full.view(np.uint32), nodes.view(np.uint32)), name
    # 8-bit activations: a few percent of the logits' range, the same argmax almost everywhere
    assert np.abs(full - ref).max() <= 0.05 * np.abs(ref).max(), name
    assert (full.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.8, name


def test_offloaded_layers_on_the_test_device(model: tuple[str, Path, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """-ngl 2 and all on the TEST device (a GPU-like device running the numpy reference kernels
    on its own copies of the blocks): the CPU's float32-mode logits within float32 rounding."""
    from llamapy.context import ModelOptions

    name, path, ref = model
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    co = ContextOptions(n_ctx=128, type_k=T.F32, type_v=T.F32, cpu_matmul="f32")
    outs = []
    for ngl in (0, 2, "all"):
        with llamapy.Llama(path, model_options=ModelOptions(n_gpu_layers=ngl), context_options=co) as llm:
            if ngl != 0:
                assert any(b.name.startswith("TEST") for b in llm.model.weights.buffers)
            outs.append(llm.ctx.decode(TOKENS, list(range(len(TOKENS))), 0, np.ones(len(TOKENS), bool)))
    for o in outs[1:]:
        assert np.abs(o - outs[0]).max() <= 1e-5 * np.abs(ref).max(), name


def test_cli_runs_and_shows_the_type(model: tuple[str, Path, np.ndarray]) -> None:
    """`llamapy info` names the tensors' type and `llamapy run` generates greedily from the file,
    the same tokens as the library's greedy decoding in the default mode."""
    from tests_support import cli

    name, path, _ = model
    info = cli("info", str(path))
    assert info.returncode == 0, info.stderr
    assert "blk.0.ffn_up.weight" in info.stdout and name in info.stdout
    run = cli("run", str(path), "-p", "the a", "-n", "6", "--temp", "0", "-c", "128")
    assert run.returncode == 0, run.stderr
    with llamapy.Llama(path, context_options=ContextOptions(n_ctx=128)) as llm:
        want = "".join(c.text for c in llm.stream("the a", n_predict=6, temp=0))
    assert run.stdout.rstrip("\n").endswith(want) and want, (run.stdout, want)
