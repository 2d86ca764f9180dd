"""Llama.create_completion / create_chat_completion: llama-cpp-python's shapes (dicts, streaming
iterators of chunks), the same greedy text as Llama.generate, and unsupported parameters refused."""

from __future__ import annotations

import pytest

from llamapy.api import Llama
from llamapy.types import LlamapyError

from conftest import write_llama_gguf
from serving import CHAT_TEMPLATE

PROMPT = "the cat and the dog"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = write_llama_gguf(tmp_path_factory.mktemp("api") / "tiny.gguf", seed=7, chat_template=CHAT_TEMPLATE)
    m = Llama(path, n_ctx=256, n_threads=1)
    yield m
    m.close()


def test_create_completion_matches_generate(llm: Llama) -> None:
    ref = llm.generate(PROMPT, 10, temp=0, ignore_eos=True)
    r = llm.create_completion(PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    (choice,) = r["choices"]
    assert choice["text"] == ref.text and choice["finish_reason"] == "length" and choice["index"] == 0
    assert r["usage"] == {"prompt_tokens": len(llm.tokenize(PROMPT)), "completion_tokens": 10,
                          "total_tokens": len(llm.tokenize(PROMPT)) + 10,
                          "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    again = llm.create_completion(PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    assert again["choices"][0]["text"] == ref.text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(llm.tokenize(PROMPT)) - 1


def test_streaming_completion(llm: Llama) -> None:
    whole = llm.create_completion(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)["choices"][0]["text"]
    chunks = list(llm.create_completion(PROMPT, max_tokens=8, temperature=0, ignore_eos=True, stream=True, logprobs=2))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert len(lps) == 8 and all(len(lp["top_logprobs"][0]) == 2 for lp in lps)


def test_chat_completion(llm: Llama) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = llm.create_chat_completion(msgs, max_tokens=6, temperature=0, ignore_eos=True)
    assert r["object"] == "chat.completion"
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant"
    # the template renders "<user>hi\n<assistant>", BOS added once
    toks = llm.tokenize("<user>hi\n<assistant>")
    assert r["usage"]["prompt_tokens"] == len(toks)
    assert msg["content"] == llm.generate(toks, 6, temp=0, ignore_eos=True).text
    chunks = list(llm.create_chat_completion(msgs, max_tokens=6, temperature=0, ignore_eos=True, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_closed_early_frees_the_slot(llm: Llama) -> None:
    it = llm.create_completion(PROMPT, max_tokens=100, temperature=0, ignore_eos=True, stream=True)
    next(it), next(it)
    it.close()
    assert not llm._engine().slot_info()[0].is_processing
    r = llm.create_completion(PROMPT, max_tokens=2, temperature=0)
    assert r["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"suffix": "x"}, "suffix"),
        ({"echo": True}, "echo"),
        ({"logit_bias": {10**6: 2.0}}, "token id 1000000 out of range"),
        ({"logit_bias": {1: "x"}}, "the bias of 1 must be a number or false"),
        ({"tfs_z": 0.5}, "tfs_z"),
        ({"n": 2}, "n = 1"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_unsupported_parameters_are_refused(llm: Llama, kw: dict, needle: str) -> None:
    with pytest.raises(LlamapyError, match=needle):
        llm.create_completion(PROMPT, **kw)


def test_defaults_that_mean_off_are_accepted(llm: Llama) -> None:
    r = llm.create_completion(PROMPT, max_tokens=2, echo=False, suffix=None, n=1, typical_p=1.0)
    assert r["usage"]["completion_tokens"] <= 2


def test_logit_bias_and_typical_p(llm: Llama) -> None:
    """llama-cpp-python's logit_bias ({token id: bias}, int or str keys), llama-server's forms
    (text keys, [[token, bias]] pairs, false to ban) and typical_p."""
    greedy = llm.generate(PROMPT, 1, temp=0).tokens[0]
    for bias in ({greedy: -1e9}, {str(greedy): -1e9}, {greedy: False}, [[greedy, False]]):
        banned = llm.generate(PROMPT, 1, temp=0, logit_bias=_pairs(llm, bias)).tokens[0]
        assert banned != greedy
        r = llm.create_completion(PROMPT, max_tokens=1, temperature=0, logit_bias=bias)
        assert r["usage"]["completion_tokens"] == 1
        assert r["choices"][0]["text"] == llm.detokenize([banned]), bias
    text = llm.detokenize([greedy])
    r = llm.create_completion(PROMPT, max_tokens=1, temperature=0, logit_bias={text: False})
    assert r["choices"][0]["text"] != text
    r = llm.create_completion(PROMPT, max_tokens=3, temperature=0.7, seed=1, typical_p=0.5)
    assert r["usage"]["completion_tokens"] <= 3


def _pairs(llm: Llama, bias: object) -> tuple[tuple[int, float], ...]:
    from llamapy.server.protocol import logit_bias

    return logit_bias(bias, llm.tokenizer)


def test_more_samplers_reach_the_chain(llm: Llama) -> None:
    """llama-cpp-python's mirostat_mode / _tau / _eta (llama-server's mirostat …) and
    llama-server's top_n_sigma and xtc_* are taken; out-of-range values are refused."""
    for kw in (dict(mirostat_mode=2, mirostat_tau=3.0, mirostat_eta=0.2), dict(mirostat_mode=1),
               dict(top_n_sigma=1.0), dict(xtc_probability=1.0, xtc_threshold=0.05)):  # fmt: skip
        r = llm.create_completion(PROMPT, max_tokens=3, temperature=0.8, seed=2, **kw)
        assert r["usage"]["completion_tokens"] <= 3, kw
    with pytest.raises(LlamapyError, match="'mirostat' must be between 0 and 2"):
        llm.create_completion(PROMPT, max_tokens=1, mirostat_mode=3)
    with pytest.raises(LlamapyError, match="'xtc_probability' must be between 0.0 and 1.0"):
        llm.create_completion(PROMPT, max_tokens=1, xtc_probability=2.0)
