"""Small random-weight GGUFs of the non-llama families (qwen2, qwen3, gemma3) and an independent
float64 forward pass of each, written here from the models' papers / reference code — not from
llamapy's graph builders. Used by test_families.py, and by references/make_family_refs.py for
the files llama.cpp is compared on (there with a real vocabulary read from a vocab GGUF)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

BYTE_VOCAB = (
    ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    + ["▁the", "▁a", "▁and", "▁of", "▁to", "▁in", "ing", "ed", "▁he", "▁she", "er", "▁it"]
)  # fmt: skip


def add_vocab(w: gguf.GGUFWriter, vocab: Path | None) -> list[str]:
    """The tokenizer keys: copied from a vocab GGUF, or a byte-level SPM vocabulary of 271
    tokens; the token list."""
    if vocab is None:
        tokens = BYTE_VOCAB
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        return tokens
    v = gguf.GGUFReader(str(vocab))

    def f(k: str) -> Any:
        return v.fields[k].contents() if k in v.fields else None

    tokens = f("tokenizer.ggml.tokens")
    w.add_tokenizer_model(f("tokenizer.ggml.model"))
    w.add_tokenizer_pre(f("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(f("tokenizer.ggml.token_type"))
    if f("tokenizer.ggml.merges") is not None:
        w.add_token_merges(f("tokenizer.ggml.merges"))
    if f("tokenizer.ggml.scores") is not None:
        w.add_token_scores(f("tokenizer.ggml.scores"))
    for key, add in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", w.add_eos_token_id)):  # fmt: skip
        if f(key) is not None:
            add(int(f(key)))
    w.add_add_bos_token(False)
    return list(tokens)


def write_family_gguf(
    path: Path,
    arch: str,
    n_layer: int = 2,
    n_embd: int = 128,
    n_ff: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    tied: bool = True,
    qtype: T = T.F32,
    seed: int = 0,
    n_swa: int = 8,
    swa_pattern: int = 2,
    embd_scale: float = 1.0,
    vocab: Path | None = None,
    rope_base: float = 1_000_000.0,
) -> Path:
    """qwen2 (Q/K/V biases), qwen3 (per-head Q/K norms, head size apart from n_embd/n_head) or
    gemma3 (Q/K norms, post norms, GELU FFN, sliding window `n_swa` on all but every
    `swa_pattern`-th layer). `vocab`: a vocab GGUF to copy the tokenizer from (else a byte-level
    SPM vocabulary of 271 tokens)."""
    rng = np.random.default_rng(seed)
    hd = head_dim or n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is T.F32 else gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "gemma3":
        w.add_sliding_window(n_swa)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", swa_pattern)
    tokens = add_vocab(w, vocab)
    n_vocab = len(tokens)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / math.sqrt(cols)).astype(np.float32)

    def vec(n: int, mean: float = 1.0, sd: float = 0.1) -> np.ndarray:
        return (mean + sd * rng.standard_normal(n)).astype(np.float32)

    def add(name: str, data: np.ndarray) -> None:
        if qtype is T.F32 or data.ndim == 1:
            w.add_tensor(name, data.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (rng.standard_normal((n_vocab, n_embd)) * embd_scale).astype(np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", vec(n_embd))
        add(p + "attn_q.weight", mat(n_head * hd, n_embd))
        add(p + "attn_k.weight", mat(n_head_kv * hd, n_embd))
        add(p + "attn_v.weight", mat(n_head_kv * hd, n_embd))
        if arch == "qwen2":
            add(p + "attn_q.bias", vec(n_head * hd, 0.0, 0.5))
            add(p + "attn_k.bias", vec(n_head_kv * hd, 0.0, 0.5))
            add(p + "attn_v.bias", vec(n_head_kv * hd, 0.0, 0.5))
        else:
            add(p + "attn_q_norm.weight", vec(hd))
            add(p + "attn_k_norm.weight", vec(hd))
        add(p + "attn_output.weight", mat(n_embd, n_head * hd, 0.5))
        if arch == "gemma3":
            add(p + "post_attention_norm.weight", vec(n_embd))
            add(p + "post_ffw_norm.weight", vec(n_embd))
        add(p + "ffn_norm.weight", vec(n_embd))
        add(p + "ffn_gate.weight", mat(n_ff, n_embd))
        add(p + "ffn_up.weight", mat(n_ff, n_embd))
        add(p + "ffn_down.weight", mat(n_embd, n_ff, 0.5))
    add("output_norm.weight", vec(n_embd))
    if not tied:
        add("output.weight", mat(n_vocab, n_embd, 4.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_weights(path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """A file's metadata getter `md(key, default)`, its weights as float64 `w(name)` (dequantized),
    and its tensors by name: what the float64 reference passes read."""
    r = gguf.GGUFReader(str(path))

    def md(k: str, default: Any = None) -> Any:
        return r.fields[k].contents() if k in r.fields else default

    ts = {t.name: t for t in r.tensors}

    def w(name: str) -> np.ndarray:
        t = ts[name]
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in (T.F32, T.F16):
            return np.asarray(t.data, np.float64).reshape(shape)
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float64)

    return md, w, ts


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Every position's logits by a float64 forward pass of the model's equations."""
    md, w, ts = read_weights(path)

    arch = md("general.architecture")
    n_layer, E = md(f"{arch}.block_count"), md(f"{arch}.embedding_length")
    H, Hkv = md(f"{arch}.attention.head_count"), md(f"{arch}.attention.head_count_kv")
    D = md(f"{arch}.attention.key_length", E // H)
    eps = md(f"{arch}.attention.layer_norm_rms_epsilon")
    base = md(f"{arch}.rope.freq_base")
    gemma = arch == "gemma3"
    n_swa = md(f"{arch}.attention.sliding_window", 0) if gemma else 0
    pattern = md(f"{arch}.attention.sliding_window_pattern", 6)
    emb = w("token_embd.weight")
    out_w = w("output.weight") if "output.weight" in ts else emb
    x = emb[tokens]  # (T, E)
    n = len(tokens)
    if gemma:
        x = x * math.sqrt(E)

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v: np.ndarray, b: float) -> np.ndarray:  # NEOX: pairs (i, i + D/2)
        inv = b ** (-np.arange(0, D, 2) / D)
        ang = np.arange(n)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        h = D // 2
        return np.concatenate([v[..., :h] * c - v[..., h:] * s, v[..., :h] * s + v[..., h:] * c], -1)

    def gelu(v: np.ndarray) -> np.ndarray:
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))

    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for il in range(n_layer):
        p = f"blk.{il}."
        local = n_swa > 0 and il % pattern < pattern - 1
        visible = (j <= i) & ((i - j < n_swa) if local else True)
        mask = np.where(visible, 0.0, -np.inf)
        h = norm(x, w(p + "attn_norm.weight"))

        def proj(k: str, heads: int) -> np.ndarray:
            y = h @ w(p + f"{k}.weight").T
            if p + f"{k}.bias" in ts:
                y = y + w(p + f"{k}.bias")
            return y.reshape(n, heads, D)

        q, k, v = proj("attn_q", H), proj("attn_k", Hkv), proj("attn_v", Hkv)
        if p + "attn_q_norm.weight" in ts:
            q, k = norm(q, w(p + "attn_q_norm.weight")), norm(k, w(p + "attn_k_norm.weight"))
        b = md(f"{arch}.rope.freq_base_swa", 10000.0) if local else base
        q, k = rope(q, b), rope(k, b)
        g = H // Hkv
        att = np.empty((n, H, D))
        for hh in range(H):
            s = q[:, hh] @ k[:, hh // g].T / math.sqrt(D) + mask
            pr = np.exp(s - s.max(-1, keepdims=True))
            att[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hh // g]
        a = att.reshape(n, H * D) @ w(p + "attn_output.weight").T
        if gemma:
            a = norm(a, w(p + "post_attention_norm.weight"))
        x = x + a
        h = norm(x, w(p + "ffn_norm.weight"))
        gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        act = gelu(gate) if gemma else gate / (1 + np.exp(-gate))
        f = (act * up) @ w(p + "ffn_down.weight").T
        if gemma:
            f = norm(f, w(p + "post_ffw_norm.weight"))
        x = x + f
    return norm(x, w("output_norm.weight")) @ out_w.T


def rewrite_gguf(
    src: Path,
    out: Path,
    set_keys: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] | None = None,
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    add_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A copy of `src` with keys set ((value, type, array element type)), keys or tensors
    dropped, float32 tensors added: hostile-file tests start from a valid family file, a
    reranker from a qwen3 one."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    set_keys = dict(set_keys or {})
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in drop_keys:
            continue
        if f.name in set_keys:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), vt)
    for name, (value, vt, sub) in set_keys.items():
        w.add_key_value(name, value, vt, sub_type=sub)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(x) for x in t.shape])),
                         raw_dtype=t.tensor_type)  # fmt: skip
    for name, a in (add_tensors or {}).items():
        w.add_tensor(name, np.asarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


RERANK_TEMPLATE = "<q>{query}</q><d>{document}</d>"


def write_reranker_gguf(path: Path, labels: tuple[str, ...] = ("yes", "no"), template: bool = False) -> Path:
    """A tiny qwen3 reranker (Qwen3-Reranker's layout): pooling rank, a float32 classifier head
    `cls.output` of one row per label, `classifier.output_labels` (none: one row), and with
    `template` a `tokenizer.chat_template.rerank` (else the pair is BOS, query, EOS, document)."""
    VT = gguf.GGUFValueType
    src = write_family_gguf(path.with_suffix(".src.gguf"), "qwen3", n_layer=2, n_embd=64, n_ff=128, head_dim=32, seed=3)
    keys: dict[str, Any] = {"qwen3.pooling_type": (4, VT.UINT32, None)}
    if labels:
        keys["qwen3.classifier.output_labels"] = (list(labels), VT.ARRAY, VT.STRING)
    if template:
        keys["tokenizer.chat_template.rerank"] = (RERANK_TEMPLATE, VT.STRING, None)
    head = np.random.default_rng(7).standard_normal((max(len(labels), 1), 64)).astype(np.float32) * 0.3
    rewrite_gguf(src, path, set_keys=keys, add_tensors={"cls.output.weight": head})
    src.unlink()
    return path


def write_lora_gguf(model: Path, out: Path, targets: tuple[str, ...], rank: int = 4, alpha: float = 8.0,
                    seed: int = 0, dtype: T = T.F32, gain: float = 0.5) -> Path:  # fmt: skip
    """A LoRA adapter for `model` as convert_lora_to_gguf.py writes one (general.type adapter,
    adapter.type lora, adapter.lora.alpha; `NAME.lora_a` [n_in, r] and `NAME.lora_b` [r, n_out],
    token_embd's [r, n_vocab] and [r, n_embd]) with random pairs for the `targets` (a tensor
    name, or a regex over the model's tensor names); alpha 0 writes no alpha key."""
    import re

    from llamapy.model.gguf import GGUFFile

    rng = np.random.default_rng(seed)
    with GGUFFile(model) as gf:
        arch = gf.metadata["general.architecture"]
        names = [n for n in gf.tensors if any(re.fullmatch(t, n) for t in targets)]
        shapes = {n: gf.tensors[n].shape for n in names}  # numpy order
    w = gguf.GGUFWriter(str(out), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    if alpha:
        w.add_float32("adapter.lora.alpha", alpha)
    for name in names:
        rows, cols = shapes[name]
        if name == "token_embd.weight":  # rows of A picked by token id: (V, r), B (E, r)
            a, b = rng.standard_normal((rows, rank)), rng.standard_normal((cols, rank)) / math.sqrt(rank)
        else:  # A (r, n_in), B (n_out, r)
            a, b = rng.standard_normal((rank, cols)) / math.sqrt(cols), rng.standard_normal((rows, rank)) / math.sqrt(rank)
        for half, x in (("lora_a", a), ("lora_b", b * gain)):
            x = x.astype(np.float32)
            w.add_tensor(f"{name}.{half}", x.astype(np.float16) if dtype is T.F16 else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def merge_lora(model: Path, adapter: Path, out: Path, scale: float = 1.0) -> Path:
    """`model` (float32) with an adapter merged into its weights, W + s·B·A (token_embd:
    E + s·A·Bᵀ), s = scale·alpha/r as llama.cpp computes it — llama-export-lora's result, made
    independently of llamapy's graphs."""
    from llamapy.model.gguf import GGUFFile

    with GGUFFile(adapter) as ad:
        alpha = float(ad.metadata.get("adapter.lora.alpha", 0.0))
        pairs = {}
        for n in ad.tensors:
            base, half = n.rsplit(".", 1)
            x = ad.tensor_bytes(n).view(np.float16 if ad.tensors[n].type == T.F16 else np.float32)
            pairs.setdefault(base, {})[half] = x.astype(np.float64).reshape(ad.tensors[n].shape)
    add = {}
    r = gguf.GGUFReader(str(model))
    for t in r.tensors:
        if t.name in pairs:
            a, b = pairs[t.name]["lora_a"], pairs[t.name]["lora_b"]
            s = scale * alpha / b.shape[-1] if alpha else scale
            delta = a @ b.T if t.name == "token_embd.weight" else b @ a
            add[t.name] = (np.asarray(t.data, np.float64) + s * delta).astype(np.float32)
    return rewrite_gguf(model, out, drop_tensors=tuple(add), add_tensors=add)


def write_control_vector(out: Path, n_embd: int, layers: tuple[int, ...], seed: int = 0, gain: float = 1.0,
                         arch: str = "controlvector") -> Path:  # fmt: skip
    """A control vector as llama.cpp's cvector-generator writes one: `direction.N` float32 vectors
    of n_embd for the layers N (>= 1), general.architecture "controlvector"."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_string("controlvector.model_hint", "llama")
    w.add_uint32("controlvector.layer_count", len(layers))
    for il in layers:
        w.add_tensor(f"direction.{il}", (rng.standard_normal(n_embd) * gain).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
