"""The drafters' guesses (llamapy/speculative.py) against plain loops that spell out what llama.cpp's
common_ngram_simple_draft and llama-cpp-python's LlamaPromptLookupDecoding do, on random token
streams with repeats; the draft model's top-of-top-10 and the vocabulary check."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llamapy.speculative import NgramDrafter, PromptLookup, SpecParams, _top_of_top_k, check_vocab_compatible
from llamapy.types import LlamapyError


def ngram_simple_loop(history: list[int], sampled: int, n: int, m: int) -> list[int]:
    """common/ngram-map.cpp's common_ngram_simple_draft, step by step."""
    cur = len(history)
    if cur <= n + m + 1:
        return []
    pattern = history[cur - n + 1 :] + [sampled]
    match = 0
    for j in range(cur - n - 1, 0, -1):  # backwards; position 0 never matches
        if history[j : j + n] == pattern:
            match = j
            break
    if match == 0:
        return []
    copy = min(m, cur - (match + n))
    if copy < n:
        return []
    return history[match + n : match + n + copy]


def prompt_lookup_loop(ids: list[int], max_ngram: int, k: int) -> list[int]:
    """llama-cpp-python's find_candidate_pred_tokens: longest n-gram first, earliest match first."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        for i in range(len(ids) - n + 1):
            if ids[i : i + n] == ids[len(ids) - n :]:
                start, end = i + n, min(i + n + k, len(ids))
                if start < end:
                    return ids[start:end]
    return []


def streams(seed: int):  # noqa: ANN201
    rng = np.random.default_rng(seed)
    for _ in range(300):
        vocab = int(rng.integers(2, 6))  # few symbols: many matches
        yield [int(x) for x in rng.integers(0, vocab, int(rng.integers(1, 60)))]


@pytest.mark.parametrize("n,m", [(1, 1), (2, 4), (3, 8), (12, 48)])
def test_ngram_simple_is_llama_cpps(n: int, m: int) -> None:
    d = NgramDrafter(n, m)
    hits = 0
    for toks in streams(n * 100 + m):
        want = ngram_simple_loop(toks[:-1], toks[-1], n, m)
        assert d.draft(0, toks, 1000) == want, toks
        assert d.draft(0, toks, 2) == want[:2]  # the room left cuts it
        hits += bool(want)
    assert hits > 20 or n == 12  # the streams exercise matches (12-grams are rare in them)


@pytest.mark.parametrize("max_ngram,k", [(1, 3), (2, 10), (3, 5)])
def test_prompt_lookup_is_llama_cpp_pythons(max_ngram: int, k: int) -> None:
    d = PromptLookup(max_ngram, k)
    hits = 0
    for toks in streams(max_ngram * 10 + k):
        want = prompt_lookup_loop(toks, max_ngram, k)
        assert d(np.asarray(toks, np.intc)).tolist() == want, toks
        assert d.draft(0, toks, 2) == want[:2]
        hits += bool(want)
    assert hits > 50


def test_hand_cases() -> None:
    # [1, 2] ends the text and starts at 1 earlier: the 3 tokens after it there are the guess
    assert NgramDrafter(2, 3).draft(0, [9, 1, 2, 3, 4, 5, 6, 8, 1, 2], 10) == [3, 4, 5]
    assert NgramDrafter(2, 3).draft(0, [9, 1, 2, 3, 4, 1, 2], 10) == []  # 7 tokens: no room for n + m + 2
    assert PromptLookup(2, 2)(np.array([5, 1, 2, 3, 1, 2], np.intc)).tolist() == [3, 1]


def test_top_of_top_10() -> None:
    row = np.array([0.0, 5.0, 1.0, 5.0, -2.0] + [-50.0] * 20, np.float32)
    tok, p = _top_of_top_k(row)
    assert tok == 1  # a tie goes to the lower id
    top10 = np.sort(row)[::-1][:10].astype(np.float64)
    assert p == pytest.approx(np.exp(5.0) / np.exp(top10).sum())


def test_params_and_vocabulary_checks() -> None:
    for kw, msg in (({"type": "eagle3"}, "--spec-type eagle3"), ({"n_max": -1}, "--spec-draft-n-max"),
                    ({"p_min": 1.5}, "--spec-draft-p-min"), ({"ngram_m": 0}, "--spec-ngram-simple-size-m")):  # fmt: skip
        with pytest.raises(LlamapyError, match=msg):
            SpecParams(**kw).check()

    def vocab(texts: list[str], kind: str = "bpe", bos: int = 1, add_bos: bool = True) -> SimpleNamespace:
        return SimpleNamespace(kind=kind, add_bos=add_bos, bos=bos, add_eos=False, eos=2, n_vocab=len(texts),
                               token_text=lambda i: texts[i])  # fmt: skip

    base = [f"t{i}" for i in range(300)]
    check_vocab_compatible(vocab(base), vocab(base + ["extra"] * 100))  # sizes within 128
    for other, msg in ((vocab(base, kind="spm"), "vocabulary type spm"), (vocab(base, bos=3), "BOS"),
                       (vocab(base + ["x"] * 129), "429 tokens"), (vocab(base[:7] + ["?"] + base[8:]), "token 7")):  # fmt: skip
        with pytest.raises(LlamapyError, match=msg):
            check_vocab_compatible(vocab(base), other)
