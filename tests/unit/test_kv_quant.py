"""The quantized KV cache (`-ctk`/`-ctv` q8_0, q4_0; llama.cpp's cache types): rows quantized
bit-identically to ggml (gguf.quants), attention against ggml's definition (Q rounded through
Q8_0, integer dot products times the two scales, V expanded), the C kernel against the numpy
reference, and whole models — the written one on the CPU and the TEST device, and tiny32 — close
to the f16 cache at a half / a quarter of its memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.backend import kernels as K
from llamapy.context import ContextOptions, ModelOptions
from llamapy import ops
from llamapy.quants import hadamard, quantize, rotate
from llamapy.tensor import Tensor
from llamapy.types import UnsupportedError
from tests_support import shared

QTYPES = [T.Q8_0, T.Q4_0]


@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
def test_quantize_is_ggml_bit_for_bit(qt: T) -> None:
    rng = np.random.default_rng(1)
    for scale in (1e-4, 1.0, 300.0):
        x = (rng.standard_normal((500, 128)) * scale).astype(np.float32)
        x[0, :32] = 0  # an all-zero block: d = 0
        x[1, :32] = np.arange(32, dtype=np.float32) / 4 - 4  # ties of the rounding
        x[2, 40] = -np.abs(x[2]).max() * 3  # a negative largest value (Q4_0's signed scale)
        x[3, 64:96] = 7.0  # equal magnitudes: Q4_0 takes the first
        assert np.array_equal(quantize(x, qt), np.asarray(gguf.quants.quantize(x, qt)))


def _ggml_attention(q, kraw, vraw, kt, vt, mask, scale):  # noqa: ANN001, ANN202
    """ggml's flash attention over quantized K/V, from its definition in float64: Q as Q8_0 blocks,
    scores = sum over blocks of d_k * d_q * (exact integer dot), V rows expanded."""
    T_, H, D = q.shape
    N, Hkv, _ = kraw.shape
    g = H // Hkv
    qq = np.asarray(gguf.quants.quantize(q.reshape(-1, D), T.Q8_0)).reshape(T_, H, D // 32, 34)
    qd = qq[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # (T, H, nb)
    qi = qq[..., 2:].view(np.int8).astype(np.int64)  # (T, H, nb, 32)

    def blocks(raw, t):  # noqa: ANN001, ANN202
        b = raw.reshape(N, Hkv, D // 32, -1)
        d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
        if t is T.Q8_0:
            return d, b[..., 2:].view(np.int8).astype(np.int64)
        nib = np.concatenate([b[..., 2:] & 0x0F, b[..., 2:] >> 4], axis=-1).astype(np.int64) - 8
        return d, nib

    kd, ki = blocks(kraw, kt)
    v = gguf.quants.dequantize(vraw.reshape(N * Hkv, -1), vt).reshape(N, Hkv, -1).astype(np.float64)
    out = np.empty((T_, H, v.shape[-1]))
    for h in range(H):
        isum = np.einsum("tbi,nbi->tnb", qi[:, h], ki[:, h // g])  # exact integers
        s = (isum * qd[:, h][:, None, :] * kd[:, h // g][None, :, :]).sum(-1) * scale + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // g]
    return out


def _src(t: T, shape: tuple[int, ...], rot: int = 0) -> SimpleNamespace:
    src = SimpleNamespace(type=t, shape=shape, params={"rot": rot} if rot else {})
    src.root = lambda: src
    return src


def _case(rng, kt, vt, n_tokens, N=200, H=4, Hkv=2, D=64):  # noqa: ANN001, ANN202
    q = rng.standard_normal((n_tokens, H, D)).astype(np.float32)
    k = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    kraw = np.asarray(gguf.quants.quantize(k.reshape(-1, D), kt)).reshape(N, Hkv, -1)
    vraw = np.asarray(gguf.quants.quantize(v.reshape(-1, D), vt)).reshape(N, Hkv, -1)
    mask = np.where(rng.random((n_tokens, N)) < 0.8, 0, -np.inf).astype(np.float32)
    mask[:, 0] = 0
    node = SimpleNamespace(
        params={"scale": 0.125}, shape=(n_tokens, H, D),
        src=(_src(T.F32, (n_tokens, H, D)), _src(kt, (N, Hkv, D)), _src(vt, (N, Hkv, D)), _src(T.F32, (n_tokens, N))),
    )  # fmt: skip
    return node, [q, kraw, vraw, mask]


@pytest.mark.parametrize("kt", QTYPES, ids=lambda t: "k" + t.name)
@pytest.mark.parametrize("vt", QTYPES, ids=lambda t: "v" + t.name)
@pytest.mark.parametrize("n_tokens", [1, 5, 150])
def test_reference_attention_is_ggmls_definition(kt: T, vt: T, n_tokens: int) -> None:
    node, s = _case(np.random.default_rng(2), kt, vt, n_tokens)
    got = K.flash_attn_ext(node, s, np)  # type: ignore[arg-type]
    want = _ggml_attention(*s[:3], kt, vt, s[3], 0.125)
    assert np.abs(got - want).max() <= 2e-5


def test_hadamard_is_ggmls_and_its_own_inverse() -> None:
    h = hadamard(128)
    assert h[0, 0] == np.float32(1 / np.sqrt(np.float32(128))) and np.array_equal(h, h.T)
    assert np.array_equal(np.abs(h), np.full((128, 128), h[0, 0]))
    assert np.abs(h @ h - np.eye(128)).max() < 1e-6
    # Sylvester's construction: entry (i, j) has the sign (-1)^popcount(i & j)
    i, j = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    sign = 1 - 2 * (np.vectorize(lambda a: bin(a).count("1"))(i & j) % 2)
    assert np.array_equal(np.sign(h), sign)


@pytest.mark.parametrize("n_tokens", [1, 20])
def test_rotated_cache_is_ggmls_definition_in_the_rotated_basis(n_tokens: int) -> None:
    """A cache marked rot (llama.cpp's attn_rot): SET_ROWS stores H·row quantized; attention is
    ggml's over H·q, the stored blocks, and its output multiplied by H again."""
    from llamapy.backend import cpu_kernels, native

    rng = np.random.default_rng(5)
    N, Hkv, D = 100, 2, 128
    k = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    cache_k = Tensor("cache_k", (N, Hkv * D), T.Q8_0, params={"rot": 128})
    cache_v = Tensor("cache_v", (N, Hkv * D), T.Q4_0, params={"rot": 64})
    ids = np.arange(N)
    kraw = K.set_rows(ops.set_rows(cache_k, Tensor("i", (N,), T.I64), Tensor("x", (N, Hkv * D))),
                      [np.zeros((N, Hkv * D // 32 * 34), np.uint8), ids, k.reshape(N, -1)], np)  # fmt: skip
    vraw = K.set_rows(ops.set_rows(cache_v, Tensor("i", (N,), T.I64), Tensor("x", (N, Hkv * D))),
                      [np.zeros((N, Hkv * D // 32 * 18), np.uint8), ids, v.reshape(N, -1)], np)  # fmt: skip
    assert np.array_equal(kraw, gguf.quants.quantize(rotate(k.reshape(N, -1), 128), T.Q8_0))
    assert np.array_equal(vraw, gguf.quants.quantize(rotate(v.reshape(N, -1), 64), T.Q4_0))
    q = rng.standard_normal((n_tokens, 4, D)).astype(np.float32)
    mask = np.where(rng.random((n_tokens, N)) < 0.8, 0, -np.inf).astype(np.float32)
    mask[:, 0] = 0
    kv, vv = kraw.reshape(N, Hkv, -1), vraw.reshape(N, Hkv, -1)
    node = SimpleNamespace(
        params={"scale": 0.1}, shape=(n_tokens, 4, D),
        src=(_src(T.F32, q.shape), _src(T.Q8_0, (N, Hkv, D), 128), _src(T.Q4_0, (N, Hkv, D), 64), _src(T.F32, mask.shape)),
    )  # fmt: skip
    want = rotate(_ggml_attention(rotate(q, 128), kv, vv, T.Q8_0, T.Q4_0, mask, 0.1).astype(np.float32), 64)
    got = K.flash_attn_ext(node, [q, kv, vv, mask], np)  # type: ignore[arg-type]
    assert np.abs(got - want).max() <= 3e-5
    if native.lib() is not None:
        cpu_kernels._lib = native.lib()
        for n_threads in (1, 2):
            got_c = cpu_kernels.c_flash_attn_ext(node, [q, kv, vv, mask], np, n_threads)  # type: ignore[arg-type]
            assert np.abs(got_c - want).max() <= 3e-5


MIXED = [(kt, vt) for kt in (T.F32, T.F16, *QTYPES) for vt in (T.F16, *QTYPES) if kt in QTYPES or vt in QTYPES]


@pytest.mark.parametrize("kt,vt", MIXED, ids=lambda t: t.name)
def test_c_attend_q_matches_the_reference(kt: T, vt: T) -> None:
    """lp_attend_q reads the blocks in place (1, 8 and 40 tokens, on 1 and 2 threads; cells over
    several of its 64-cell blocks) and gives the numpy reference's result."""
    from llamapy.backend import cpu_kernels, native

    if native.lib() is None:
        pytest.skip("the compiled kernels are not installed (no C compiler at install time)")
    cpu_kernels._lib = native.lib()
    for n_tokens in (1, 8, 40):
        node, s = _case(np.random.default_rng(3), T.Q8_0, T.Q8_0, n_tokens, N=300)
        rng = np.random.default_rng(4)
        k = rng.standard_normal((300, 2, 64)).astype(np.float32)
        v = rng.standard_normal((300, 2, 64)).astype(np.float32)

        def store(x, t):  # noqa: ANN001, ANN202
            if t is T.F32 or t is T.F16:
                return x.astype(np.float32 if t is T.F32 else np.float16)
            return np.asarray(gguf.quants.quantize(x.reshape(600, 64), t)).reshape(300, 2, -1)

        s[1], s[2] = store(k, kt), store(v, vt)
        node.src[1].type, node.src[2].type = kt, vt
        want = K.flash_attn_ext(node, s, np)  # type: ignore[arg-type]
        one = cpu_kernels.c_flash_attn_ext(node, s, np)  # type: ignore[arg-type]
        assert np.abs(one - want).max() <= 2e-5, (kt, vt, n_tokens)
        two = cpu_kernels.c_flash_attn_ext(node, s, np, 2)  # type: ignore[arg-type]
        assert np.array_equal(one, two), (kt, vt, n_tokens)  # the thread count changes nothing


def _kld(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    def logp(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logp(p_logits), logp(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def _decode_each(llm: llamapy.Llama, tokens: list[int]) -> np.ndarray:
    """A prompt of half the tokens, then one token a step (the C decode kernel): every logit row."""
    h = len(tokens) // 2
    rows = [llm.ctx.decode(tokens[:h], list(range(h)), 0, np.ones(h, bool))]
    for i in range(h, len(tokens)):
        rows.append(llm.ctx.decode([tokens[i]], [i], 0))
    return np.concatenate(rows)


def _run(path: Path, ctk: T, ctv: T, tokens: list[int], cpu_matmul: str = "q8", **mo: object) -> tuple[np.ndarray, int]:
    co = ContextOptions(n_ctx=256, type_k=ctk, type_v=ctv, cpu_matmul=cpu_matmul)
    with llamapy.Llama(path, model_options=ModelOptions(**mo), context_options=co) as llm:  # type: ignore[arg-type]
        return _decode_each(llm, tokens), sum(b.nbytes for b in llm.ctx.kv.buffers)


TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33, 34, 99, 120, 261, 5, 6, 44]


@pytest.mark.parametrize("test_device", [False, True], ids=["CPU", "TEST0"])
def test_written_model_quantized_cache_close_to_f16(make_llama, monkeypatch, test_device: bool) -> None:  # noqa: ANN001
    mo: dict[str, object] = {}
    if test_device:
        monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
        monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
        mo["n_gpu_layers"] = "all"
    path = make_llama(n_layer=2, qtype=T.Q8_0)
    base, base_bytes = _run(path, T.F16, T.F16, TOKENS, **mo)
    q8, q8_bytes = _run(path, T.Q8_0, T.Q8_0, TOKENS, **mo)
    q4, q4_bytes = _run(path, T.Q4_0, T.Q4_0, TOKENS, **mo)
    assert q8_bytes * 64 == base_bytes * 34 and q4_bytes * 64 == base_bytes * 18  # 34 / 18 bytes per 32
    # random weights give logits of ~±250 (a KLD of ~0 either way): compare the logits themselves
    top = np.abs(base).max()
    d8, d4 = np.abs(q8 - base).max() / top, np.abs(q4 - base).max() / top
    assert 0 < d8 < 3e-3 and d8 < d4 < 5e-2, (d8, d4)


def test_rotation_can_be_turned_off(make_llama, monkeypatch) -> None:  # noqa: ANN001
    """LLAMA_ATTN_ROT_DISABLE=1 (llama.cpp's switch) stores the rows unrotated."""
    path = make_llama(n_layer=1, qtype=T.Q8_0)
    rot, _ = _run(path, T.Q4_0, T.Q4_0, TOKENS)
    with llamapy.Llama(path, context_options=ContextOptions(n_ctx=64, type_k=T.Q4_0)) as llm:
        assert llm.ctx.kv.k[0].params["rot"] == 64 and "rot" not in llm.ctx.kv.v[0].params  # V is f32
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    plain, _ = _run(path, T.Q4_0, T.Q4_0, TOKENS)
    assert not np.array_equal(rot, plain)
    with llamapy.Llama(path, context_options=ContextOptions(n_ctx=64, type_k=T.Q4_0)) as llm:
        assert "rot" not in llm.ctx.kv.k[0].params


@pytest.mark.slow
def test_tiny32_q8_0_cache_close_to_f16(tiny32: Path) -> None:
    ids = json.loads((tiny32.parent / "tempest.ids").read_text())[:96]
    # float32 activations: with 8-bit ones any difference decorrelates tiny32's peaky logits to
    # the activations' own noise level (KLD ~0.005-0.007 between runs differing in sum order),
    # which would hide what the cache type alone does
    base, base_bytes = _run(tiny32, T.F16, T.F16, ids, cpu_matmul="f32")
    q8, q8_bytes = _run(tiny32, T.Q8_0, T.Q8_0, ids, cpu_matmul="f32")
    assert q8_bytes * 64 == base_bytes * 34
    assert 0 < _kld(base, q8) < 2e-3
    assert (base.argmax(-1) == q8.argmax(-1)).mean() >= 0.9


@pytest.mark.slow
def test_smollm2_rotation_helps_a_q4_0_cache(default_model: Path, monkeypatch) -> None:  # noqa: ANN001
    """As in llama.cpp (SmolLM2 tempest c128x3, q4_0 vs f16: KLD 0.229 unrotated, 0.086 rotated),
    the Hadamard rotation brings a Q4_0 cache's logits much closer to the f16 cache's (SmolLM2's
    keys have outlier channels, which the rotation spreads over the block)."""
    text = shared("data", "text", "tempest.txt")
    with llamapy.Llama(default_model, context_options=ContextOptions(n_ctx=64)) as llm:
        ids = llm.tokenize(text.read_text()[:2000])[:96]
    base, _ = _run(default_model, T.F16, T.F16, ids)
    rot, _ = _run(default_model, T.Q4_0, T.Q4_0, ids)
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    plain, _ = _run(default_model, T.Q4_0, T.Q4_0, ids)
    k_rot, k_plain = _kld(base, rot), _kld(base, plain)
    assert 0 < k_rot < 0.6 * k_plain, (k_rot, k_plain)


def test_unsupported_cache_type_is_refused(make_llama) -> None:  # noqa: ANN001
    with pytest.raises(UnsupportedError, match="supported are f32, f16, q8_0, q4_0"):
        llamapy.Llama(make_llama(n_layer=1), context_options=ContextOptions(n_ctx=64, type_k=T.Q5_0))


def test_head_size_not_of_whole_blocks_is_refused(make_llama) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1, n_embd=96, n_head=2, n_head_kv=1)  # heads of 48
    with pytest.raises(UnsupportedError, match="head size 48 is not a multiple of Q8_0's block of 32"):
        llamapy.Llama(path, context_options=ContextOptions(n_ctx=64, type_v=T.Q8_0))


def test_cli_cache_types(make_llama) -> None:  # noqa: ANN001
    path = make_llama(n_layer=2)  # a cache of 1 MiB at f16
    sizes = {}
    for ct in ("f16", "q8_0", "q4_0"):
        r = subprocess.run(
            [sys.executable, "-m", "llamapy", "run", "-m", str(path), "-p", "the", "-n", "2", "-c", "1024",
             "-ctk", ct, "-ctv", ct, "--temp", "0"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stderr.splitlines() if "KV buffer size" in ln)
        sizes[ct] = float(line.split("=")[1].split()[0])
    assert sizes["q8_0"] < 0.55 * sizes["f16"] and sizes["q4_0"] < 0.3 * sizes["f16"]
    r = subprocess.run([sys.executable, "-m", "llamapy", "run", "-m", str(path), "-p", "x", "-ctv", "q5_1"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: -ctv q5_1: supported")
    assert "Traceback" not in r.stderr
