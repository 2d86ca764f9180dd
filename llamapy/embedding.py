"""Embeddings: texts' hidden states, pooled and normalised (llama.cpp's examples/embedding/
embedding.cpp, `llm_graph_context::build_pooling` in llama-graph.cpp, `common_embd_normalize` and
`common_embd_similarity_cos` in common/common.cpp; llama-cpp-python's `Llama.embed`).

The graph's result is the output norm's rows (`Context.decode(..., embd=True)`); pooling happens
here, on the host: `mean` averages a sequence's rows, `cls` takes its first, `last` its last,
`none` keeps them all. The rows asked for are only those the pooling reads (the last layer
computes no others), and a sequence may span micro-batches: its mean is over all of its tokens.
`rank` (rerankers) needs a classifier head, which llamapy does not load: refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .types import LlamapyError, UnsupportedError

POOLING = ("none", "mean", "cls", "last", "rank")  # llama_pooling_type 0..4


def pooling_name(name: str | None, model_default: int) -> str:
    """The pooling to use: `name`, or the model's own (`{arch}.pooling_type`) when None."""
    chosen = POOLING[model_default] if name is None else name
    if chosen not in POOLING:
        raise LlamapyError(f"pooling {name!r}: expected one of {', '.join(POOLING)}")
    if chosen == "rank":
        raise UnsupportedError("pooling 'rank' (a reranker's score) needs a classifier head, which llamapy does not load")
    return chosen


def normalize(x: np.ndarray, embd_norm: int) -> np.ndarray:
    """One embedding scaled as common_embd_normalize: -1 none, 0 max absolute to the int16 range,
    1 taxicab, 2 euclidean, p > 2 the p-norm. Sums in double over float32 terms, as there."""
    if embd_norm < -1:
        raise LlamapyError(f"--embd-normalize {embd_norm}: expected -1 (none), 0 (int16), 1, 2 or a p > 2")
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
    pooling `none` (those not normalised, as llama-server's). Each prompt is its own sequence from
    position 0; as many prompts as fit in the batch and the context go in one decode, the KV cache
    cleared before each (embedding.cpp's batch_decode)."""
    if pooling not in POOLING[:4]:
        raise LlamapyError(f"pooling {pooling!r}: expected one of {', '.join(POOLING[:4])}")
    room = min(ctx.n_batch, ctx.n_ctx)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise LlamapyError(f"prompt {i} is empty: nothing to embed")
        if len(p) > room:
            raise LlamapyError(
                f"prompt {i} has {len(p)} tokens, more than the batch holds ({room}: -b {ctx.n_batch}, -c {ctx.n_ctx})"
            )
    out: list[np.ndarray] = []
    i = 0
    while i < len(prompts):
        group = [prompts[i]]
        while i + len(group) < len(prompts) and sum(map(len, group)) + len(prompts[i + len(group)]) <= room:
            group.append(prompts[i + len(group)])
        out += _embed_group(ctx, group, pooling, embd_norm)
        i += len(group)
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
    else:  # one row a sequence: its first token (cls) or its last
        want[starts if pooling == "cls" else ends - 1] = True
    ctx.kv.clear()
    try:
        rows = ctx.decode(toks, pos, seq, want, embd=True)  # (n_outputs, E)
    finally:
        ctx.kv.clear()
    if pooling == "none":
        return [rows[a:b].copy() for a, b in zip(starts, ends)]
    if pooling == "mean":
        pooled = [rows[a:b].astype(np.float64).mean(axis=0).astype(np.float32) for a, b in zip(starts, ends)]
    else:
        pooled = list(rows)
    return [normalize(v, embd_norm) for v in pooled]
