"""Speculative decoding's drafters (llama.cpp's common/speculative.cpp `draft-simple`,
common/ngram-map.cpp `ngram-simple`; llama-cpp-python's llama_speculative.py
`LlamaPromptLookupDecoding`).

A drafter guesses the next few tokens of a sequence; the engine (`engine.py`) then decodes the
sampled token and the guesses in one micro-batch, samples every row with the request's own chain
and keeps the guesses up to the first the chain did not pick (common_sampler_sample_and_accept_n).
Each generated token is still sampled from the target model's own logits, one draw of the
request's RNG a token, so the text is the one decoding alone gives wherever a row's logits are the
same bits in a batch as alone (`Context.batch_invariant`, the default 8-bit CPU mode); only the
speed changes, by how many guesses are kept.

- `ModelDrafter` (`-md FILE`, --spec-type draft-simple): a smaller model with the same vocabulary
  greedily continues the sequence in a context of its own (one KV sequence a slot), stopping after
  `n_max` tokens or at a top token whose probability among its model's top 10 is below `p_min`.
- `NgramDrafter` (--spec-type ngram-simple): the last `size_n` tokens are looked for earlier in the
  sequence (the latest place first); up to `size_m` tokens that followed them there are the guess.
- `PromptLookup` (llama-cpp-python's `draft_model=LlamaPromptLookupDecoding(...)`): the last
  `max_ngram_size` down to 1 tokens are looked for, the earliest place first; up to
  `num_pred_tokens` tokens that followed them are the guess. Any llama-cpp-python draft model (a
  callable of the token ids returning the guess) is used through `CallableDrafter`.

Library code: nothing here prints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .engine import common_prefix
from .types import LlamapyError

if TYPE_CHECKING:
    from .context import Context

__all__ = [
    "SPEC_TYPES",
    "CallableDrafter",
    "Drafter",
    "LlamaPromptLookupDecoding",
    "ModelDrafter",
    "NgramDrafter",
    "PromptLookup",
    "SpecParams",
    "check_vocab_compatible",
]

SPEC_TYPES = ("none", "draft-simple", "ngram-simple")
DRAFT_TOP_K = 10  # the draft's chain: top-k 10, the most likely token taken (draft-simple's)
VOCAB_MAX_SIZE_DIFFERENCE = 128  # as llama.cpp: vocabularies this close may be compatible
VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass
class SpecParams:
    """llama.cpp's common_params_speculative (the flags of `run` and `serve`)."""

    type: str = "none"  # "draft-simple" with -md, "ngram-simple", or "none"
    n_max: int = 3  # --spec-draft-n-max: most tokens a model drafts
    n_min: int = 0  # --spec-draft-n-min: a shorter draft is not used
    p_min: float = 0.0  # --spec-draft-p-min: the draft stops at a less likely token
    ngram_n: int = 12  # --spec-ngram-simple-size-n: tokens looked up
    ngram_m: int = 48  # --spec-ngram-simple-size-m: tokens drafted after a match

    def check(self) -> None:
        if self.type not in SPEC_TYPES:
            raise LlamapyError(f"--spec-type {self.type}: llamapy drafts with one of {', '.join(SPEC_TYPES)}")
        if self.n_max < 0:
            raise LlamapyError(f"--spec-draft-n-max {self.n_max}: must be >= 0")
        if self.n_min < 0:
            raise LlamapyError(f"--spec-draft-n-min {self.n_min}: must be >= 0")
        if not 0.0 <= self.p_min <= 1.0:
            raise LlamapyError(f"--spec-draft-p-min {self.p_min:g}: must be within [0, 1]")
        for flag, v in (("--spec-ngram-simple-size-n", self.ngram_n), ("--spec-ngram-simple-size-m", self.ngram_m)):
            if not 1 <= v <= 1024:
                raise LlamapyError(f"{flag} {v}: must be between 1 and 1024")


class Drafter(Protocol):
    """Guesses what follows `tokens` (a slot's history, its last sampled token last)."""

    def draft(self, seq: int, tokens: Sequence[int], n_max: int) -> list[int]: ...

    def close(self) -> None: ...


@dataclass
class NgramDrafter:
    """ngram-simple: the m tokens that followed the latest earlier occurrence of the last n."""

    size_n: int = 12
    size_m: int = 48

    def draft(self, seq: int, tokens: Sequence[int], n_max: int) -> list[int]:
        n, m = self.size_n, self.size_m
        t = np.asarray(tokens, np.int64)  # the history, then the token just sampled
        if len(t) <= n + m + 2:  # too short to hold a match and its continuation
            return []
        pattern = t[-n:]
        # earlier windows of the history starting at 1 .. len-n-2: position 0 is never a match and
        # the window one before the pattern is skipped, as in llama.cpp
        win = np.lib.stride_tricks.sliding_window_view(t[: len(t) - 2], n)[1:]
        hits = np.flatnonzero((win == pattern).all(axis=1))
        if len(hits) == 0:
            return []
        start = int(hits[-1]) + 1 + n  # the latest match's continuation
        copy = min(m, len(t) - 1 - start)
        if copy < n:  # a continuation shorter than the pattern is not used
            return []
        k = min(copy, n_max)
        return [int(x) for x in t[start : start + k]]

    def close(self) -> None:
        pass


@dataclass
class PromptLookup:
    """Prompt lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding): the longest n-gram
    ending the sequence, from `max_ngram_size` down, found at its earliest place."""

    max_ngram_size: int = 2
    num_pred_tokens: int = 10

    def __post_init__(self) -> None:
        if self.max_ngram_size < 1 or self.num_pred_tokens < 1:
            raise LlamapyError("prompt lookup: max_ngram_size and num_pred_tokens must be >= 1")

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        """llama-cpp-python's draft-model call: the guess for `input_ids`."""
        t = np.asarray(input_ids, np.intc)
        for n in range(min(self.max_ngram_size, len(t) - 1), 0, -1):
            win = np.lib.stride_tricks.sliding_window_view(t, n)
            for i in np.flatnonzero((win == t[-n:]).all(axis=1)):
                start = int(i) + n
                end = min(start + self.num_pred_tokens, len(t))
                if start < end:
                    return t[start:end]
        return np.zeros(0, np.intc)

    def draft(self, seq: int, tokens: Sequence[int], n_max: int) -> list[int]:
        return [int(x) for x in self(np.asarray(tokens, np.intc))[:n_max]]

    def close(self) -> None:
        pass


LlamaPromptLookupDecoding = PromptLookup  # llama-cpp-python's name


@dataclass
class CallableDrafter:
    """Any llama-cpp-python draft model: `fn(input_ids) -> guessed ids`."""

    fn: Callable[[np.ndarray], Any]
    n_vocab: int

    def draft(self, seq: int, tokens: Sequence[int], n_max: int) -> list[int]:
        out = [int(x) for x in np.asarray(self.fn(np.asarray(tokens, np.intc))).reshape(-1)[:n_max]]
        bad = [x for x in out if not 0 <= x < self.n_vocab]
        if bad:
            raise LlamapyError(f"the draft model returned token id {bad[0]}, outside the vocabulary (0..{self.n_vocab - 1})")
        return out

    def close(self) -> None:
        pass


def check_vocab_compatible(target: Any, draft: Any) -> None:
    """The checks of llama.cpp's common_speculative_are_compatible, one line on failure."""
    why = ""
    if target.kind != draft.kind:
        why = f"vocabulary type {draft.kind} against the target's {target.kind}"
    elif target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        why = f"BOS (add {int(draft.add_bos)}, id {draft.bos}) against the target's (add {int(target.add_bos)}, id {target.bos})"
    elif target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        why = f"EOS (add {int(draft.add_eos)}, id {draft.eos}) against the target's (add {int(target.add_eos)}, id {target.eos})"
    elif abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        why = f"{draft.n_vocab} tokens against the target's {target.n_vocab}"
    else:
        for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
            if target.token_text(i) != draft.token_text(i):
                why = f"token {i} is {draft.token_text(i)!r}, the target's {target.token_text(i)!r}"
                break
    if why:
        raise LlamapyError(f"-md: the draft model's vocabulary does not match the target's: {why}")


@dataclass
class ModelDrafter:
    """draft-simple: a draft model's greedy continuation, in a context of its own whose KV
    sequence `seq` follows the engine's sequence `seq` (what it shares with the slot's tokens is
    kept, the rest evaluated again, as llama.cpp's draft context mirrors the target's)."""

    ctx: Context
    n_max: int = 3
    n_min: int = 0  # a shorter draft is dropped
    p_min: float = 0.0
    n_vocab_target: int = 0  # drafted ids at or past it end the draft (a larger draft vocabulary)
    owner: Any = None  # what close() closes (the draft's Llama); None: only its context's cache
    cached: dict[int, list[int]] = field(default_factory=dict)  # the draft's K/V, by sequence

    def draft(self, seq: int, tokens: Sequence[int], n_max: int) -> list[int]:
        n_max = min(n_max, self.n_max, self.ctx.n_ctx - len(tokens))
        if n_max <= 0 or not tokens:
            return []
        # the last token is always evaluated, for its logits
        keep = common_prefix(self.cached.get(seq, []), tokens[:-1])
        self.ctx.kv.seq_rm(seq, keep)
        have = self.cached[seq] = list(tokens[:keep])
        todo = list(tokens[keep:])
        out: list[int] = []
        while True:
            # (decode cuts a long catch-up into micro-batches and returns the last token's logits)
            row = self.ctx.decode(todo, np.arange(len(have), len(have) + len(todo)), seq)[-1]
            have.extend(todo)
            tok, p = _top_of_top_k(row)
            if p < self.p_min or (self.n_vocab_target and tok >= self.n_vocab_target):
                break
            out.append(tok)
            if len(out) >= n_max:
                break
            todo = [tok]
        return out if len(out) >= self.n_min else []

    def close(self) -> None:
        self.cached.clear()
        if self.owner is not None:
            self.owner.close()


def _top_of_top_k(row: np.ndarray) -> tuple[int, float]:
    """The most likely token and its probability among the DRAFT_TOP_K most likely (the draft's
    top-k chain: its softmax runs over the k kept)."""
    k = min(DRAFT_TOP_K, len(row))
    top = np.argpartition(-row, k - 1)[:k]
    top = top[np.lexsort((top, -row[top]))]  # by logit, ties to the lower id
    e = np.exp(row[top].astype(np.float64) - float(row[top[0]]))
    return int(top[0]), float(e[0] / e.sum())
