"""Embeddings: texts' hidden states, pooled and normalised, and rerankers' scores (llama.cpp's
examples/embedding/embedding.cpp, `llm_graph_context::build_pooling` in llama-graph.cpp,
`common_embd_normalize` and `common_embd_similarity_cos` in common/common.cpp, the server's
`format_prompt_rerank`; llama-cpp-python's `Llama.embed`).

The graph's result is the output norm's rows (`Context.decode(..., output="embd")`); pooling
happens here, on the host: `mean` averages a sequence's rows, `cls` takes its first, `last` its
last, `none` keeps them all. The rows asked for are only those the pooling reads (the last layer
computes no others), and a sequence may span micro-batches: its mean is over all of its tokens.
`rank` (a reranker: Qwen3-Reranker) reads the last token's row through the file's classifier head
in the graph (`output="rank"`): one score per label, not normalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .types import LlamapyError, UnsupportedError

POOLING = ("none", "mean", "cls", "last", "rank")  # llama_pooling_type 0..4


def pooling_name(name: str | None, model: Any) -> str:
    """The pooling to use for `model` (a context.Model): `name`, or the file's own
    (`{arch}.pooling_type`) when None; `rank` only with a classifier head."""
    chosen = POOLING[model.params.pooling_type] if name is None else name
    if chosen not in POOLING:
        raise LlamapyError(f"pooling {name!r}: expected one of {', '.join(POOLING)}")
    if chosen == "rank" and model.weights.cls_out is None:
        raise UnsupportedError("pooling 'rank' needs a reranker's classifier head (cls.output), which this file does not have")
    return chosen


def rerank_tokens(model: Any, query: str, doc: str, cli: bool = False) -> list[int]:
    """A query and a document as one reranker prompt: the file's `rerank` template with {query}
    and {document} filled in, else BOS, query, EOS, SEP, document, EOS as the vocabulary adds
    them (the server's format_prompt_rerank; `cli`: llama-embedding's variant, which tokenizes
    the template's text with BOS/EOS added and joins the pair's text with the EOS/SEP texts)."""
    tok, md = model.tokenizer, model.gguf.metadata
    template = md.get("tokenizer.chat_template.rerank")
    add_sep = bool(md.get("tokenizer.ggml.add_sep_token", False))
    if isinstance(template, str):
        text = template.replace("{query}", query).replace("{document}", doc)
        return tok.encode(text, add_special=cli, parse_special=True)
    eos = tok.eos if tok.eos is not None else tok.special.sep
    if cli:
        joint = [tok.token_to_piece(t, special=True).decode("utf-8", "replace")
                 for t, on in ((tok.eos, tok.add_eos), (tok.special.sep, add_sep)) if on and t is not None]  # fmt: skip
        return tok.encode(query + "".join(joint) + doc, add_special=True, parse_special=True)
    ids = [tok.bos] if tok.add_bos and tok.bos is not None else []
    ids += tok.encode(query, add_special=False, parse_special=False)
    ids += [eos] if tok.add_eos and eos is not None else []
    ids += [tok.special.sep] if add_sep and tok.special.sep is not None else []
    ids += tok.encode(doc, add_special=False, parse_special=False)
    return ids + ([eos] if tok.add_eos and eos is not None else [])


def check_embd_norm(embd_norm: int) -> None:
    """--embd-normalize's values: -1 (none), 0 (int16), 1, 2 or a p > 2."""
    if embd_norm < -1:
        raise LlamapyError(f"--embd-normalize {embd_norm}: expected -1 (none), 0 (int16), 1, 2 or a p > 2")


def normalize(x: np.ndarray, embd_norm: int) -> np.ndarray:
    """One embedding scaled as common_embd_normalize: -1 none, 0 max absolute to the int16 range,
    1 taxicab, 2 euclidean, p > 2 the p-norm. Sums in double over float32 terms, as there."""
    check_embd_norm(embd_norm)
    x = np.asarray(x, np.float32)
    if embd_norm == -1:
        return x.copy()
    if embd_norm == 0:
        s = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif embd_norm == 2:
        s = float(np.sqrt(np.sum((x * x).astype(np.float64))))
    else:
        s = float(np.sum(np.abs(x).astype(np.float64) ** embd_norm) ** (1.0 / embd_norm))
    return x * np.float32(1.0 / s if s > 0.0 else 0.0)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """common_embd_similarity_cos: 1 for two zero vectors, 0 when only one is."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = float(a64 @ a64), float(b64 @ b64)
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(a64 @ b64) / (np.sqrt(na) * np.sqrt(nb))


def embed(ctx, prompts: Sequence[Sequence[int]], pooling: str, embd_norm: int) -> list[np.ndarray]:  # noqa: ANN001 - Context
    """The embedding of each prompt (token ids): a (n_embd,) vector, or (n_tokens, n_embd) rows with
    pooling `none` (those not normalised, as llama-server's), or with `rank` its (n_cls_out,)
    scores (not normalised: llama-embedding's normalisation of them reads past the scores, and
    llama-server's does not apply it). Each prompt is its own sequence from
    position 0; as many prompts as fit in the batch and the context go in one decode, the KV cache
    cleared before each (embedding.cpp's batch_decode)."""
    if pooling not in POOLING:
        raise LlamapyError(f"pooling {pooling!r}: expected one of {', '.join(POOLING)}")
    room = min(ctx.n_batch, ctx.n_ctx)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise LlamapyError(f"prompt {i} is empty: nothing to embed")
        if len(p) > room:
            raise LlamapyError(
                f"prompt {i} has {len(p)} tokens, more than the batch holds ({room}: -b {ctx.n_batch}, -c {ctx.n_ctx})"
            )
    out: list[np.ndarray] = []
    group: list[Sequence[int]] = []
    n_group = 0  # the group's tokens, kept as it grows (not summed again for every prompt)
    for p in prompts:
        if group and n_group + len(p) > room:
            out += _embed_group(ctx, group, pooling, embd_norm)
            group, n_group = [], 0
        group.append(p)
        n_group += len(p)
    if group:
        out += _embed_group(ctx, group, pooling, embd_norm)
    return out


def _embed_group(ctx, group: list[Sequence[int]], pooling: str, embd_norm: int) -> list[np.ndarray]:  # noqa: ANN001
    toks = np.concatenate([np.asarray(p, np.int32) for p in group])
    pos = np.concatenate([np.arange(len(p)) for p in group])
    seq = np.concatenate([np.full(len(p), s) for s, p in enumerate(group)])
    starts = np.cumsum([0] + [len(p) for p in group])[:-1]
    ends = starts + [len(p) for p in group]
    want = np.zeros(len(toks), bool)
    if pooling in ("none", "mean"):
        want[:] = True
    else:  # one row a sequence: its first token (cls) or its last (last; rank, causal models)
        want[starts if pooling == "cls" else ends - 1] = True
    ctx.kv.clear()
    try:
        # (n_outputs, E) rows, or rank's (n_seq, n_cls_out) scores
        rows = ctx.decode(toks, pos, seq, want, output="rank" if pooling == "rank" else "embd")
    finally:
        ctx.kv.clear()
    if pooling == "none":
        return [rows[a:b].copy() for a, b in zip(starts, ends)]
    if pooling == "rank":
        return list(rows)  # (n_cls_out,) each
    if pooling == "mean":
        pooled = [rows[a:b].astype(np.float64).mean(axis=0).astype(np.float32) for a, b in zip(starts, ends)]
    else:
        pooled = list(rows)
    return [normalize(v, embd_norm) for v in pooled]
