"""The whole llama graph against an independent float64 forward pass written here from the
paper's equations, on small models written with GGUFWriter: several layer counts, every quant
type, tied and untied outputs, llama3-style rope_freqs, prompt in one batch, in micro-batches and
token by token through the KV cache."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.context import ContextOptions
from llamapy.model.gguf import GGUFFile


def reference_logits(path, tokens: list[int]) -> np.ndarray:  # noqa: ANN001
    gf = GGUFFile(path)
    md = gf.metadata

    def w(name: str) -> np.ndarray:
        info = gf.tensors[name]
        raw = np.array(gf.tensor_bytes(name))
        if info.type in (T.F32, T.F16):
            return raw.view(np.float32 if info.type is T.F32 else np.float16).reshape(info.shape).astype(np.float64)
        return gguf.quants.dequantize(raw, info.type).reshape(info.shape).astype(np.float64)

    n_layer = md["llama.block_count"]
    n_head, n_head_kv = md["llama.attention.head_count"], md["llama.attention.head_count_kv"]
    eps = md["llama.attention.layer_norm_rms_epsilon"]
    base = md["llama.rope.freq_base"]
    emb = w("token_embd.weight")
    out_w = w("output.weight") if "output.weight" in gf.tensors else emb
    freqs = w("rope_freqs.weight") if "rope_freqs.weight" in gf.tensors else None
    x = emb[tokens]  # (T, E)
    n, e = x.shape
    hd = e // n_head

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v: np.ndarray) -> np.ndarray:  # (T, H, D), pairs (2i, 2i+1)
        inv = base ** (-np.arange(0, hd, 2) / hd)
        if freqs is not None:
            inv = inv / freqs
        ang = np.arange(n)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = v.copy()
        out[..., 0::2] = v[..., 0::2] * c - v[..., 1::2] * s
        out[..., 1::2] = v[..., 0::2] * s + v[..., 1::2] * c
        return out

    causal = np.triu(np.full((n, n), -np.inf), 1)
    for il in range(n_layer):
        p = f"blk.{il}."
        h = norm(x, w(p + "attn_norm.weight"))
        q = rope((h @ w(p + "attn_q.weight").T).reshape(n, n_head, hd))
        k = rope((h @ w(p + "attn_k.weight").T).reshape(n, n_head_kv, hd))
        v = (h @ w(p + "attn_v.weight").T).reshape(n, n_head_kv, hd)
        g = n_head // n_head_kv
        att = np.empty((n, n_head, hd))
        for hh in range(n_head):
            s = q[:, hh] @ k[:, hh // g].T / np.sqrt(hd) + causal
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, hh] = pr @ v[:, hh // g]
        x = x + att.reshape(n, e) @ w(p + "attn_output.weight").T
        h = norm(x, w(p + "ffn_norm.weight"))
        gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(p + "ffn_down.weight").T
    return norm(x, w("output_norm.weight")) @ out_w.T


def _check(path, tokens, **ctx_kw) -> None:  # noqa: ANN001
    ref = reference_logits(path, tokens)
    co = ContextOptions(n_ctx=ctx_kw.pop("n_ctx", 256), type_k=T.F32, type_v=T.F32, **ctx_kw)
    with llamapy.Llama(path, context_options=co) as llm:
        got = llm.logits(tokens)
    err = np.abs(got - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), f"max |Δlogit| {err} vs max |logit| {np.abs(ref).max()}"


TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33, 34]

WRITABLE = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.BF16]


@pytest.mark.parametrize("qtype", WRITABLE, ids=lambda t: t.name)
def test_every_quant_type_matches_reference(make_llama, qtype: T) -> None:
    _check(make_llama(n_layer=2, qtype=qtype), TOKENS)


@pytest.mark.parametrize("n_layer", [1, 3, 32])
def test_layer_counts(make_llama, n_layer: int) -> None:
    _check(make_llama(n_layer=n_layer, n_embd=128, n_ff=256, qtype=T.Q8_0), TOKENS)


def test_untied_output_and_rope_freqs(make_llama) -> None:
    _check(make_llama(n_layer=2, tied=False, rope_freqs=True, qtype=T.Q4_K, embd_type=T.Q6_K), TOKENS)


@pytest.mark.parametrize("ubatch", [1, 4])
def test_micro_batches_reuse_the_cache(make_llama, ubatch: int) -> None:
    """-ub 1 sends every token through the single-token decode path."""
    _check(make_llama(n_layer=2, qtype=T.Q4_1), TOKENS, n_ubatch=ubatch, n_batch=8)


def test_unsupported_architecture_is_a_clear_error(make_llama) -> None:
    path = make_llama(n_layer=1, arch="falcon")
    with pytest.raises(llamapy.LlamapyError, match="unsupported architecture 'falcon'"):
        llamapy.Llama(path)


def test_long_prompt_takes_the_blocked_attention_path(make_llama) -> None:
    """More tokens than one attention block: query blocks read only their visible keys."""
    from llamapy.backend.kernels import FA_BLOCK

    toks = [1] + [int(t) for t in np.random.default_rng(1).integers(3, 270, 2 * FA_BLOCK + 37)]
    _check(make_llama(n_layer=2, n_embd=128, n_ff=256, qtype=T.Q8_0), toks, n_ctx=512, n_ubatch=512, n_batch=512)


def test_two_sequences_in_one_batch_equal_two_runs(make_llama) -> None:
    """Cells of another sequence are masked out: a batch holding two sequences gives each the
    logits it gets alone (llama.cpp's unified KV cache)."""
    path = make_llama(n_layer=2, qtype=T.Q4_0)
    a, b = TOKENS, TOKENS[::-1]
    co = ContextOptions(n_ctx=256, type_k=T.F32, type_v=T.F32)
    with llamapy.Llama(path, context_options=co) as llm:
        la, lb = llm.logits(a), llm.logits(b)
        llm.ctx.kv.clear()
        both = llm.ctx.decode(a + b, list(range(len(a))) + list(range(len(b))), [0] * len(a) + [1] * len(b),
                              np.ones(len(a) + len(b), bool))  # fmt: skip
    assert np.abs(both[: len(a)] - la).max() <= 1e-4 * np.abs(la).max()
    assert np.abs(both[len(a) :] - lb).max() <= 1e-4 * np.abs(lb).max()


@pytest.mark.parametrize("impl", ["c", "numba", "numpy"])
@pytest.mark.parametrize("ubatch", [1, 64])
def test_every_kernel_set_matches_reference(make_llama, monkeypatch, impl: str, ubatch: int) -> None:
    """The C kernels, numba's and the numpy fallback (qmatmul.kernels()) each run the whole model:
    decode (-ub 1: matvec, decode attention) and a 42-token batch (BLAS on expanded tiles),
    K-quants included."""
    from llamapy.backend import native, qmatmul

    if impl == "c" and native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    if impl == "numba" and qmatmul.numba_kernels() is None:
        pytest.skip(f"no numba: {qmatmul._nk_error}")
    monkeypatch.setattr(qmatmul, "_kernels", impl)
    toks = TOKENS * 3
    _check(make_llama(n_layer=2, n_embd=256, n_ff=512, qtype=T.Q4_K, embd_type=T.Q6_K), toks,
           n_ubatch=ubatch, n_batch=64)  # fmt: skip
    _check(make_llama(n_layer=2, qtype=T.Q4_1, embd_type=T.Q8_0), toks, n_ubatch=ubatch, n_batch=64)
