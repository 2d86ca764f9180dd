"""Embeddings' host-side arithmetic and request shapes (llamapy/embedding.py, server/protocol.py):
normalisation as common_embd_normalize, cosine as common_embd_similarity_cos, the pooling names
and the OpenAI / llama-server request and response shapes."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest

from llamapy.embedding import cosine, normalize, pooling_name
from llamapy.server.protocol import ApiError, embedding_request, embeddings_response, rerank_request, rerank_response
from llamapy.types import LlamapyError, UnsupportedError


def test_normalize_modes() -> None:
    x = np.array([3.0, -4.0, 0.5, 0.0], np.float32)
    assert np.array_equal(normalize(x, -1), x)
    np.testing.assert_allclose(normalize(x, 2), x / np.sqrt(9 + 16 + 0.25), rtol=1e-7)
    np.testing.assert_allclose(normalize(x, 1), x / 7.5, rtol=1e-7)
    np.testing.assert_allclose(normalize(x, 3), x / (27 + 64 + 0.125) ** (1 / 3), rtol=1e-6)
    i16 = normalize(x, 0)  # the largest magnitude goes to 32760, the int16 range llama.cpp uses
    assert i16[1] == pytest.approx(-32760.0) and i16[0] == pytest.approx(32760.0 * 3 / 4)
    assert not normalize(np.zeros(4, np.float32), 2).any()  # a zero vector stays zero (no nan)
    with pytest.raises(LlamapyError, match="embd-normalize"):
        normalize(x, -2)


def test_cosine() -> None:
    a, b = np.array([1.0, 0.0], np.float32), np.array([1.0, 1.0], np.float32)
    assert cosine(a, b) == pytest.approx(2**-0.5)
    assert cosine(a, -a) == pytest.approx(-1.0)
    z = np.zeros(2, np.float32)
    assert cosine(z, z) == 1.0 and cosine(a, z) == 0.0  # common_embd_similarity_cos's conventions


def _model(pooling_type: int, head: bool = False) -> SimpleNamespace:
    return SimpleNamespace(params=SimpleNamespace(pooling_type=pooling_type), weights=SimpleNamespace(cls_out=object() if head else None))


def test_pooling_names() -> None:
    assert pooling_name(None, _model(0)) == "none" and pooling_name(None, _model(3)) == "last"
    assert pooling_name("mean", _model(3)) == "mean"
    assert pooling_name(None, _model(4, head=True)) == "rank"
    with pytest.raises(LlamapyError, match="expected one of"):
        pooling_name("max", _model(0))
    with pytest.raises(UnsupportedError, match="classifier head"):
        pooling_name(None, _model(4))  # a reranker's pooling without its head


class Tok:
    n_vocab = 100

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]


@pytest.mark.parametrize(
    "body, prompts, oai",
    [
        ({"input": "ab"}, [[97, 98]], True),
        ({"input": ["ab", "c"]}, [[97, 98], [99]], True),
        ({"input": [5, 6]}, [[5, 6]], True),  # one prompt of token ids
        ({"input": [[5], [6, 7]]}, [[5], [6, 7]], True),
        ({"content": "ab"}, [[97, 98]], False),  # llama-server's field: its own response shape
    ],
)
def test_embedding_request_inputs(body: dict, prompts: list, oai: bool) -> None:
    req = embedding_request(body, Tok(), True, 2)
    assert req.prompts == prompts and req.oai is oai and req.embd_norm == 2


@pytest.mark.parametrize(
    "body, needle",
    [
        ({}, '"input" or "content"'),
        ({"input": ""}, "cannot be empty"),
        ({"input": [[1], []]}, "cannot be empty"),
        ({"input": [1, 100]}, "out of range"),
        ({"input": [{"a": 1}]}, "must be a string"),
        ({"input": "x", "encoding_format": "int8"}, "float or base64"),
        ({"input": "x", "dimensions": 8}, "dimensions is not supported"),
        ({"input": "x", "embd_normalize": -2}, "embd_normalize"),
        ({"input": "x", "temperature": 0}, "unsupported parameter"),
    ],
)
def test_embedding_request_refuses(body: dict, needle: str) -> None:
    with pytest.raises(ApiError, match=needle):
        embedding_request(body, Tok(), True, 2)


def test_embeddings_response_shapes() -> None:
    v = [np.array([0.5, -1.25], np.float32), np.array([2.0, 0.0], np.float32)]
    req = embedding_request({"input": ["ab", "c"], "model": "m"}, Tok(), True, 2)
    r = embeddings_response(v, req, "file.gguf")
    assert r["object"] == "list" and r["model"] == "m" and r["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert [d["index"] for d in r["data"]] == [0, 1] and r["data"][0]["embedding"] == [0.5, -1.25]
    req64 = embedding_request({"input": "ab", "encoding_format": "base64"}, Tok(), True, 2)
    d = embeddings_response(v[:1], req64, "file.gguf")["data"][0]
    assert np.array_equal(np.frombuffer(base64.b64decode(d["embedding"]), "<f4"), v[0])
    native = embeddings_response([np.ones((3, 2), np.float32)], embedding_request({"content": "ab"}, Tok(), False, 2), "f")
    assert native == [{"index": 0, "embedding": [[1.0, 1.0]] * 3}]  # pooling none: a row a token


def test_rerank_shapes() -> None:
    req = rerank_request({"query": "q", "documents": ["a", "b", "c"], "top_n": 2, "model": "m"})
    r = rerank_response([0.1, 0.9, 0.5], req, 12, "file.gguf")
    assert r["results"] == [{"index": 1, "relevance_score": 0.9}, {"index": 2, "relevance_score": 0.5}]
    assert r["model"] == "m" and r["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    tei = rerank_request({"query": "q", "texts": ["a", "b"], "return_text": True})  # TEI's shape: a bare list
    assert rerank_response([0.2, 0.1], tei, 4, "f") == [{"index": 0, "score": 0.2, "text": "a"}, {"index": 1, "score": 0.1, "text": "b"}]


@pytest.mark.parametrize(
    "body, needle",
    [({"documents": ["a"]}, '"query"'), ({"query": "q", "documents": "a"}, "non-empty string array"),
     ({"query": "q", "documents": ["a", 1]}, "non-empty string array"), ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
     ({"query": "q", "documents": ["a"], "rank_fields": []}, "unsupported parameter")],
)  # fmt: skip
def test_rerank_request_refuses(body: dict, needle: str) -> None:
    with pytest.raises(ApiError, match=needle):
        rerank_request(body)
