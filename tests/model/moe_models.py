"""Random-weight mixture-of-experts GGUFs (qwen3moe; llama with experts, Mixtral-style; gpt-oss)
and an independent float64 forward pass of them, written from the models' reference code
(Mixtral's and Qwen3-MoE's `SparseMoeBlock`: softmax router, top-k, weights renormalised, SwiGLU
experts, weighted sum; Hugging Face's `modeling_gpt_oss`: biased router, softmax over the top k,
experts with biases and the clamped SwiGLU, attention sinks, sliding-window layers, YaRN rope) —
not from llamapy's graph builders.

As a script it writes the real shapes with fewer layers, for comparisons with llama.cpp
(`llama-quantize` them to the shipped types):

    python tests/model/moe_models.py qwen3-30b-a3b VOCAB.gguf out.gguf --layers 8
    python tests/model/moe_models.py mixtral-8x7b VOCAB.gguf out.gguf --layers 4
    python tests/model/moe_models.py tiny-qwen3moe - out.gguf        # the byte vocabulary
    python tests/model/moe_models.py gpt-oss-20b VOCAB.gguf out.gguf --layers 6

F32 tensors (--f16: F16); a real shape's float32 file is large (Qwen3-30B-A3B: ~2.4 GB a layer).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from family_models import add_vocab, read_weights

# the shapes llama.cpp's users run (config.json of each model), and tiny ones for the tests
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_ff=6144, n_ff_exp=768, n_expert=128,
                          n_expert_used=8, n_head=32, n_head_kv=4, head_dim=128, rope_base=1_000_000.0),
    "mixtral-8x7b": dict(arch="llama", n_layer=32, n_embd=4096, n_ff=14336, n_expert=8, n_expert_used=2,
                         n_head=32, n_head_kv=8, head_dim=128, rope_base=1_000_000.0),
    "tiny-qwen3moe": dict(arch="qwen3moe", n_layer=2, n_embd=128, n_ff=192, n_ff_exp=64, n_expert=8,
                          n_expert_used=3, n_head=4, n_head_kv=2, head_dim=48),
    "tiny-mixtral": dict(arch="llama", n_layer=2, n_embd=128, n_ff=96, n_expert=4, n_expert_used=2,
                         n_head=4, n_head_kv=2, head_dim=32),
    # gpt-oss-20b's config.json; "tiny" keeps its head size, YaRN and the Q width != n_embd
    "gpt-oss-20b": dict(arch="gpt-oss", n_layer=24, n_embd=2880, n_ff_exp=2880, n_expert=32, n_expert_used=4,
                        n_head=64, n_head_kv=8, head_dim=64, n_swa=128, rope_base=150000.0),
    "tiny-gptoss": dict(arch="gpt-oss", n_layer=2, n_embd=128, n_ff_exp=96, n_expert=8, n_expert_used=4,
                        n_head=4, n_head_kv=2, head_dim=64, n_swa=6, rope_base=150000.0),
}  # fmt: skip


# o200k_harmony's special tokens, which gpt-oss's replies are written in
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def _byte_chars() -> list[str]:
    """GPT-2's byte-level BPE alphabet: byte b as one printable character."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_harmony_vocab(path: Path) -> Path:
    """A vocabulary GGUF (no tensors) for write_gptoss_gguf(vocab=): byte-level BPE as gpt-oss's
    o200k_harmony (spaces are plain bytes there, unlike SentencePiece's byte vocabulary), a few
    merges, and the harmony special tokens, control tokens as in gpt-oss's files."""
    chars = _byte_chars()
    merges = [("Ġ", "t"), ("a", "n"), ("i", "n"), ("o", "n")]
    tokens = chars + [a + b for a, b in merges] + HARMONY_TOKENS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_token_types([1] * (len(tokens) - len(HARMONY_TOKENS)) + [3] * len(HARMONY_TOKENS))
    w.add_bos_token_id(tokens.index("<|start|>"))
    w.add_eos_token_id(tokens.index("<|return|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gptoss_gguf(
    path: Path,
    arch: str = "gpt-oss",
    n_layer: int = 2,
    n_embd: int = 128,
    n_ff_exp: int = 96,
    n_expert: int = 8,
    n_expert_used: int = 4,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_swa: int = 6,
    rope_base: float = 150000.0,
    yarn_factor: float = 32.0,
    n_ctx_orig: int = 4096,
    qtype: T = T.F32,
    exp_qtype: T | None = None,
    seed: int = 0,
    vocab: Path | None = None,
    embd_scale: float = 1.0,
    n_sinks: int | None = None,
    router_bias: bool = True,
    chat_template: str | None = None,
) -> Path:
    """A gpt-oss file as convert_hf_to_gguf writes one (separate gate/up experts, every bias,
    `attn_sinks`, YaRN keys). `exp_qtype`: the experts' type (MXFP4 as shipped; default qtype);
    norms, biases and sinks stay F32. `n_sinks`: the sinks' length, when a test wants it wrong;
    `router_bias=False` leaves the router's bias out; `chat_template`: tokenizer.chat_template."""
    assert arch == "gpt-oss"
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("gpt-oss-random")
    w.add_block_count(n_layer)
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_sliding_window(n_swa)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(yarn_factor)
    w.add_rope_scaling_orig_ctx_len(n_ctx_orig)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is T.F32 else gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens = add_vocab(w, vocab)
    n_vocab = len(tokens)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def mat(*shape: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * (gain / math.sqrt(shape[-1]))).astype(np.float32)

    def vec(*shape: int, mean: float = 0.0, sd: float = 0.1) -> np.ndarray:
        return (mean + sd * rng.standard_normal(shape)).astype(np.float32)

    def add(name: str, data: np.ndarray, t: T = qtype) -> None:
        if t is T.F32 or data.ndim == 1 or name.endswith(".bias"):
            w.add_tensor(name, data.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)

    et = exp_qtype or qtype
    add("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32) * embd_scale)
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", vec(n_embd, mean=1.0))
        for nm, rows in (("attn_q", n_head * head_dim), ("attn_k", n_head_kv * head_dim), ("attn_v", n_head_kv * head_dim)):
            add(p + nm + ".weight", mat(rows, n_embd))
            add(p + nm + ".bias", vec(rows))
        add(p + "attn_output.weight", mat(n_embd, n_head * head_dim, gain=0.5))
        add(p + "attn_output.bias", vec(n_embd))
        add(p + "attn_sinks.weight", vec(n_sinks or n_head, mean=1.0, sd=1.0))  # some heads mostly attend to the sink
        add(p + "post_attention_norm.weight", vec(n_embd, mean=1.0))
        add(p + "ffn_gate_inp.weight", mat(n_expert, n_embd, gain=2.0))
        if router_bias:
            add(p + "ffn_gate_inp.bias", vec(n_expert))
        # gain 4: gate values past the clamp's limit (7) occur, so the clamp matters
        add(p + "ffn_gate_exps.weight", mat(n_expert, n_ff_exp, n_embd, gain=4.0), et)
        add(p + "ffn_gate_exps.bias", vec(n_expert, n_ff_exp))
        add(p + "ffn_up_exps.weight", mat(n_expert, n_ff_exp, n_embd, gain=4.0), et)
        add(p + "ffn_up_exps.bias", vec(n_expert, n_ff_exp))
        add(p + "ffn_down_exps.weight", mat(n_expert, n_embd, n_ff_exp, gain=0.5), et)
        add(p + "ffn_down_exps.bias", vec(n_expert, n_embd))
    add("output_norm.weight", vec(n_embd, mean=1.0))
    add("output.weight", mat(n_vocab, n_embd, gain=4.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_moe_gguf(
    path: Path,
    arch: str = "qwen3moe",
    n_layer: int = 2,
    n_embd: int = 128,
    n_ff: int = 192,
    n_ff_exp: int | None = None,
    n_expert: int = 8,
    n_expert_used: int = 3,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    qtype: T = T.F32,
    seed: int = 0,
    rope_base: float = 10000.0,
    vocab: Path | None = None,
    embd_scale: float = 1.0,
    tied: bool = False,
    n_router: int | None = None,
) -> Path:
    """qwen3moe (Q/K norms, NEOX rope, experts `n_ff_exp` wide) or llama with experts (normal
    rope, experts `n_ff` wide). `vocab`: a vocab GGUF to copy the tokenizer from (else the
    byte-level SPM vocabulary of family_models). `n_router`: the router's rows, when a test wants
    them to disagree with n_expert."""
    rng = np.random.default_rng(seed)
    hd = head_dim or n_embd // n_head
    ff_exp = n_ff if arch == "llama" else (n_ff_exp or n_ff // n_expert_used)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"moe-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    if arch == "qwen3moe":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_expert_feed_forward_length(ff_exp)
    else:
        w.add_rope_dimension_count(hd)
    ftype = {T.F32: gguf.LlamaFileType.ALL_F32, T.F16: gguf.LlamaFileType.MOSTLY_F16}.get(qtype, gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_file_type(ftype)
    tokens = add_vocab(w, vocab)
    n_vocab = len(tokens)

    def mat(*shape: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * (gain / math.sqrt(shape[-1]))).astype(np.float32)

    def vec(n: int, mean: float = 1.0, sd: float = 0.1) -> np.ndarray:
        return (mean + sd * rng.standard_normal(n)).astype(np.float32)

    def add(name: str, data: np.ndarray) -> None:
        if qtype is T.F32 or data.ndim == 1:
            w.add_tensor(name, data.astype(np.float32))
        elif qtype is T.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (rng.standard_normal((n_vocab, n_embd), dtype=np.float32) * embd_scale))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", vec(n_embd))
        add(p + "attn_q.weight", mat(n_head * hd, n_embd))
        add(p + "attn_k.weight", mat(n_head_kv * hd, n_embd))
        add(p + "attn_v.weight", mat(n_head_kv * hd, n_embd))
        if arch == "qwen3moe":
            add(p + "attn_q_norm.weight", vec(hd))
            add(p + "attn_k_norm.weight", vec(hd))
        add(p + "attn_output.weight", mat(n_embd, n_head * hd, gain=0.5))
        add(p + "ffn_norm.weight", vec(n_embd))
        add(p + "ffn_gate_inp.weight", mat(n_router or n_expert, n_embd, gain=2.0))  # a router with clear choices
        add(p + "ffn_gate_exps.weight", mat(n_expert, ff_exp, n_embd))
        add(p + "ffn_up_exps.weight", mat(n_expert, ff_exp, n_embd))
        add(p + "ffn_down_exps.weight", mat(n_expert, n_embd, ff_exp, gain=0.5))
    add("output_norm.weight", vec(n_embd))
    if not tied:
        add("output.weight", mat(n_vocab, n_embd, gain=4.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Every position's logits by a float64 forward pass (Hugging Face's MixtralSparseMoeBlock /
    Qwen3MoeSparseMoeBlock: softmax over the router's logits, the top k, renormalised, each
    chosen expert's SwiGLU FFN weighted and summed)."""
    md, w, ts = read_weights(path)

    arch = md("general.architecture")
    if arch == "gpt-oss":
        return _gptoss_logits(md, w, ts, tokens)
    n_layer, E = md(f"{arch}.block_count"), md(f"{arch}.embedding_length")
    H, Hkv = md(f"{arch}.attention.head_count"), md(f"{arch}.attention.head_count_kv")
    D = md(f"{arch}.attention.key_length", E // H)
    eps, base = md(f"{arch}.attention.layer_norm_rms_epsilon"), md(f"{arch}.rope.freq_base")
    k_used = md(f"{arch}.expert_used_count")
    emb = w("token_embd.weight")
    out_w = w("output.weight") if "output.weight" in ts else emb
    x = emb[tokens]  # (T, E)
    n = len(tokens)

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v: np.ndarray) -> np.ndarray:
        ang = np.arange(n)[:, None] * (base ** (-np.arange(0, D, 2) / D))[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if arch == "llama":  # adjacent pairs (2i, 2i+1)
            a, b = v[..., 0::2], v[..., 1::2]
            out = np.empty_like(v)
            out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
            return out
        h = D // 2  # NEOX: pairs (i, i + D/2)
        return np.concatenate([v[..., :h] * c - v[..., h:] * s, v[..., :h] * s + v[..., h:] * c], -1)

    mask = np.where(np.arange(n)[None, :] <= np.arange(n)[:, None], 0.0, -np.inf)
    for il in range(n_layer):
        p = f"blk.{il}."
        h = norm(x, w(p + "attn_norm.weight"))
        q = (h @ w(p + "attn_q.weight").T).reshape(n, H, D)
        k = (h @ w(p + "attn_k.weight").T).reshape(n, Hkv, D)
        v = (h @ w(p + "attn_v.weight").T).reshape(n, Hkv, D)
        if p + "attn_q_norm.weight" in ts:
            q, k = norm(q, w(p + "attn_q_norm.weight")), norm(k, w(p + "attn_k_norm.weight"))
        q, k = rope(q), rope(k)
        g = H // Hkv
        att = np.empty((n, H, D))
        for hh in range(H):
            s = q[:, hh] @ k[:, hh // g].T / math.sqrt(D) + mask
            pr = np.exp(s - s.max(-1, keepdims=True))
            att[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hh // g]
        x = x + att.reshape(n, H * D) @ w(p + "attn_output.weight").T
        h = norm(x, w(p + "ffn_norm.weight"))
        logits = h @ w(p + "ffn_gate_inp.weight").T  # (T, n_expert)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        gate_e, up_e, down_e = w(p + "ffn_gate_exps.weight"), w(p + "ffn_up_exps.weight"), w(p + "ffn_down_exps.weight")
        moe = np.zeros_like(x)
        for t in range(n):
            top = np.argsort(-probs[t], kind="stable")[:k_used]
            wt = probs[t, top] / probs[t, top].sum()
            for e, we in zip(top, wt):
                gt, up = gate_e[e] @ h[t], up_e[e] @ h[t]
                moe[t] += we * (down_e[e] @ (gt / (1 + np.exp(-gt)) * up))
        x = x + moe
    return norm(x, w("output_norm.weight")) @ out_w.T


def _gptoss_logits(md: Any, w: Any, ts: dict[str, Any], tokens: list[int]) -> np.ndarray:
    """Hugging Face's GptOssForCausalLM in float64: YaRN rope (the frequencies blended between
    extrapolation and interpolation over the correction range, cos/sin times 0.1 ln(factor) + 1),
    attention with biases and one sink logit per head in each softmax's denominator, a window of
    `sliding_window` positions on even layers, the router's top k with a softmax over them, and
    experts with biases and the clamped SwiGLU (alpha 1.702, limit 7)."""
    a = "gpt-oss"
    n_layer, H, Hkv = md(f"{a}.block_count"), md(f"{a}.attention.head_count"), md(f"{a}.attention.head_count_kv")
    D, eps, base = md(f"{a}.attention.key_length"), md(f"{a}.attention.layer_norm_rms_epsilon"), md(f"{a}.rope.freq_base")
    k_used, n_swa = md(f"{a}.expert_used_count"), md(f"{a}.attention.sliding_window")
    factor, orig = md(f"{a}.rope.scaling.factor"), md(f"{a}.rope.scaling.original_context_length")
    x = w("token_embd.weight")[tokens]  # (T, E)
    n = len(tokens)

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    # YaRN (transformers' _compute_yarn_parameters, beta_fast 32, beta_slow 1, truncated range)
    def corr(n_rot: float) -> float:
        return D * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(corr(32.0)), 0), min(math.ceil(corr(1.0)), D - 1)
    extrap = base ** (-np.arange(0, D, 2) / D)  # (D/2,)
    ramp = np.clip((np.arange(D // 2) - lo) / max(hi - lo, 0.001), 0, 1)
    inv_freq = extrap / factor * ramp + extrap * (1 - ramp)
    ang = np.arange(n)[:, None] * inv_freq[None, :]  # (T, D/2)
    mscale = 0.1 * math.log(factor) + 1.0
    c, s_ = (np.cos(ang) * mscale)[:, None, :], (np.sin(ang) * mscale)[:, None, :]

    def rope(v: np.ndarray) -> np.ndarray:  # NEOX halves
        h = D // 2
        return np.concatenate([v[..., :h] * c - v[..., h:] * s_, v[..., :h] * s_ + v[..., h:] * c], -1)

    qpos, kpos = np.arange(n)[:, None], np.arange(n)[None, :]
    causal = np.where(kpos <= qpos, 0.0, -np.inf)
    window = np.where((kpos <= qpos) & (qpos - kpos < n_swa), 0.0, -np.inf)
    for il in range(n_layer):
        p = f"blk.{il}."
        h = norm(x, w(p + "attn_norm.weight"))
        q = (h @ w(p + "attn_q.weight").T + w(p + "attn_q.bias")).reshape(n, H, D)
        k = (h @ w(p + "attn_k.weight").T + w(p + "attn_k.bias")).reshape(n, Hkv, D)
        v = (h @ w(p + "attn_v.weight").T + w(p + "attn_v.bias")).reshape(n, Hkv, D)
        q, k = rope(q), rope(k)
        sinks = w(p + "attn_sinks.weight")
        mask = window if il % 2 == 0 else causal  # layer_types: sliding, full, sliding, ...
        att = np.empty((n, H, D))
        for hh in range(H):
            sc = q[:, hh] @ k[:, hh // (H // Hkv)].T / math.sqrt(D) + mask  # (T, T)
            both = np.concatenate([sc, np.full((n, 1), sinks[hh])], -1)  # the sink: one more column
            pr = np.exp(both - both.max(-1, keepdims=True))
            pr = pr / pr.sum(-1, keepdims=True)
            att[:, hh] = pr[:, :n] @ v[:, hh // (H // Hkv)]
        x = x + att.reshape(n, H * D) @ w(p + "attn_output.weight").T + w(p + "attn_output.bias")
        h = norm(x, w(p + "post_attention_norm.weight"))
        logits = h @ w(p + "ffn_gate_inp.weight").T
        if p + "ffn_gate_inp.bias" in ts:
            logits = logits + w(p + "ffn_gate_inp.bias")
        ge, gb = w(p + "ffn_gate_exps.weight"), w(p + "ffn_gate_exps.bias")
        ue, ub = w(p + "ffn_up_exps.weight"), w(p + "ffn_up_exps.bias")
        de, db = w(p + "ffn_down_exps.weight"), w(p + "ffn_down_exps.bias")
        moe = np.zeros_like(x)
        for t in range(n):
            top = np.argsort(-logits[t], kind="stable")[:k_used]
            wt = np.exp(logits[t, top] - logits[t, top].max())
            wt /= wt.sum()
            for e, we in zip(top, wt):
                gt = np.minimum(ge[e] @ h[t] + gb[e], 7.0)
                up = np.clip(ue[e] @ h[t] + ub[e], -7.0, 7.0)
                act = gt / (1 + np.exp(-1.702 * gt)) * (up + 1)
                moe[t] += we * (de[e] @ act + db[e])
        x = x + moe
    return norm(x, w("output_norm.weight")) @ w("output.weight").T


def main() -> None:
    ap = argparse.ArgumentParser(description="a random-weight MoE GGUF of a real shape with fewer layers")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("vocab", help="a GGUF to copy the tokenizer from, or - for the byte vocabulary")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--embd-scale", type=float, default=0.2)  # logit spread ~ scale * sqrt(n_embd)
    ap.add_argument("--f16", action="store_true", help="F16 matrices (half the size of F32)")
    a = ap.parse_args()
    kw = dict(SHAPES[a.shape])
    if a.layers:
        kw["n_layer"] = a.layers
    write = write_gptoss_gguf if kw["arch"] == "gpt-oss" else write_moe_gguf
    write(Path(a.out), **kw, seed=a.seed, vocab=None if a.vocab == "-" else Path(a.vocab),  # type: ignore[operator]
          embd_scale=a.embd_scale, qtype=T.F16 if a.f16 else T.F32)  # fmt: skip


if __name__ == "__main__":
    main()
