"""Embeddings of the default model (llamapy/embedding.py, `llamapy embedding`, `serve --embeddings`)
against llama.cpp's llama-embedding on the same file (references/smollm2-q41-embeddings.json.xz,
made by references/make_embedding_refs.py), and against llamapy's own logits: the rows are what
the output matrix reads."""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from llamapy.api import Llama
from llamapy.context import ContextOptions
from llamapy.types import LlamapyError
from tests_support import cli

REFS = Path(__file__).resolve().parent / "references" / "smollm2-q41-embeddings.json.xz"


@pytest.fixture(scope="module")
def refs() -> dict:
    return json.loads(lzma.decompress(REFS.read_bytes()))


def cos(a: object, b: object) -> np.ndarray:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (x * y).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(y, axis=-1)


def test_matches_llama_embedding(default_model: Path, refs: dict) -> None:
    # every token's row, then each pooling; -ub 5 cuts the longer texts over micro-batches and
    # must change no bit (the q8 kernels are batch-invariant, as llama.cpp's are)
    rows = {}
    for ub in (512, 5):
        with Llama(default_model, context_options=ContextOptions(n_ctx=512, n_ubatch=ub)) as llm:
            rows[ub] = np.concatenate(llm.embed(refs["texts"], pooling="none"))
            pooled = {p: np.array(llm.embed(refs["texts"], pooling=p, normalize=2)) for p in ("mean", "cls", "last")}
        assert rows[ub].shape == np.shape(refs["none"])
        # 0.99846 at the worst token here (AVX2 host): a later token's row, whose attention
        # reads the earlier ones; a text's first row is llama.cpp's to its 7 printed decimals
        assert cos(rows[ub], refs["none"]).min() > 0.998
        for p in ("mean", "last"):
            assert cos(pooled[p], refs[p]).min() > 0.9995, p
        # a text's first token attends to itself only: the same numbers to llama.cpp's 7 decimals
        np.testing.assert_allclose(pooled["cls"], refs["cls"], atol=2e-7)
    assert np.array_equal(rows[512], rows[5])


def test_rows_are_what_the_output_matrix_reads(default_model: Path) -> None:
    """In the float32 mode, the logits are the output matrix times the embedding rows."""
    with Llama(default_model, context_options=ContextOptions(n_ctx=256, cpu_matmul="f32")) as llm:
        toks = llm.tokenize("The capital of France is Paris.")
        h = np.array(llm.embed(toks, pooling="none"))  # (T, E)
        logits = llm.logits(toks)  # (T, V)
        tensors = {t.name: t for t in gguf.GGUFReader(default_model).tensors}
        t = tensors.get("output.weight", tensors["token_embd.weight"])  # SmolLM2's is tied
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, h.shape[1])  # (V, E)
    want = h.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(logits - want).max() < 2e-3 * np.abs(want).max()
    assert np.array_equal(logits.argmax(1), want.argmax(1))


def test_cli_formats(default_model: Path) -> None:
    texts = ["Hello world", "I like cats"]
    r = cli("embedding", str(default_model), "-p", "\n".join(texts), "--pooling", "mean", "--embd-output-format", "array")
    assert r.returncode == 0, r.stderr
    got = np.array(json.loads(r.stdout))
    with Llama(default_model, n_ctx=512) as llm:
        want = np.array(llm.embed(texts, pooling="mean", normalize=2))
    np.testing.assert_allclose(got, want, atol=1e-7)  # printed with 7 decimals
    r = cli("embedding", str(default_model), "-p", "\n".join(texts), "--pooling", "mean")
    assert r.returncode == 0 and "cosine similarity matrix:" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("embedding ")]
    assert len(lines) == 2 and len(lines[0].split()) == 2 + 16  # the first 16 values of each
    sims = r.stdout.split("cosine similarity matrix:")[1].strip().splitlines()[1:]
    assert [float(x) for x in sims[0].split()[:2]] == [1.0, round(float(want[0] @ want[1]), 2)]
    r = cli("embedding", str(default_model), "-p", "\n".join(texts), "--pooling", "last", "--embd-output-format", "json+")
    doc = json.loads(r.stdout)
    assert [d["index"] for d in doc["data"]] == [0, 1] and len(doc["cosineSimilarity"]) == 2
    r = cli("embedding", str(default_model), "-p", "Hello world", "--pooling", "none", "--embd-output-format", "raw",
            "--embd-normalize", "-1")  # fmt: skip
    rows = [ln.split() for ln in r.stdout.strip().splitlines()]
    assert len(rows) == 2 and len(rows[0]) == 576  # one line a token


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-p", "x", "--embd-output-format", "yaml"], "--embd-output-format 'yaml'"),
        (["-p", "x", "--embd-normalize", "-3"], "--embd-normalize -3"),
        (["-p", "x\n\ny", "--pooling", "mean"], "prompt 1 is empty"),
        ([], "no texts"),
    ],
)
def test_cli_errors(default_model: Path, args: list[str], needle: str) -> None:
    r = cli("embedding", str(default_model), *args)
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(err) == 1 and needle in err[0] and "Traceback" not in r.stderr, r.stderr


def test_server_embeddings(default_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from serving import Server

    texts = ["Hello world", "I like cats"]
    with Llama(default_model, n_ctx=512) as llm:
        want = np.array(llm.embed(texts, pooling="last", normalize=2))
    s = Server(default_model, ["--embeddings", "--pooling", "last", "-np", "1", "-c", "512", "-t", "1", "--no-warmup"], tmp_path / "log")
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": texts}, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == 5 and len(r["data"]) == 2
        np.testing.assert_allclose([d["embedding"] for d in r["data"]], want, atol=1e-7)
        native = httpx.post(s.url + "/embedding", json={"content": texts[0]}, timeout=60).json()
        np.testing.assert_allclose(native[0]["embedding"], want[:1], atol=1e-7)
        c = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
        assert c.status_code == 501 and "without `--embeddings`" in c.json()["error"]["message"]
    finally:
        s.stop()


def test_the_files_own_pooling(tmp_path: Path) -> None:
    """`{arch}.pooling_type` is the default (Qwen3-Embedding's files say 3, last); the pooled
    vectors are the unpooled rows' last, first and mean."""
    from family_models import rewrite_gguf, write_family_gguf
    from gguf import GGUFValueType

    src = write_family_gguf(tmp_path / "src.gguf", "qwen3", n_layer=2, n_embd=64, n_ff=128, head_dim=32)
    path = rewrite_gguf(src, tmp_path / "last.gguf", set_keys={"qwen3.pooling_type": (3, GGUFValueType.UINT32, None)})
    with Llama(path, n_ctx=64, embedding=True) as llm:  # (llama-cpp-python's spelling, accepted)
        text = "the cat and the dog"
        assert llm.model.params.pooling_type == 3
        rows = np.array(llm.embed(text, pooling="none"))  # (T, E)
        assert rows.shape == (len(llm.tokenize(text)), 64)
        # (one row computed by the last layer, not all: this file's products may round otherwise)
        np.testing.assert_allclose(llm.embed(text), rows[-1], rtol=1e-5, atol=1e-6)  # not normalised unless asked
        np.testing.assert_allclose(llm.embed(text, pooling="cls"), rows[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(llm.embed(text, pooling="mean"), rows.mean(0), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(llm.embed(text, normalize=True), rows[-1] / np.linalg.norm(rows[-1]), rtol=1e-5, atol=1e-6)


def test_on_the_test_device(default_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-ngl all (every layer on the GPU-like TEST0, its splits compiled to GPU plans) gives the
    CPU's embeddings in the float32 mode (the 8-bit mode's products differ there, as its logits do)."""
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    texts, out = ["Hello world", "The capital of France is Paris."], []
    for ngl in (0, "all"):
        with Llama(default_model, n_gpu_layers=ngl, context_options=ContextOptions(n_ctx=256, cpu_matmul="f32")) as llm:
            assert (ngl == 0) != any(b.name.startswith("TEST") for b in llm.model.weights.buffers)
            out.append(np.concatenate(llm.embed(texts, pooling="none") + [llm.embed(texts, pooling="mean", normalize=True)]))
    assert np.abs(out[1] - out[0]).max() <= 1e-3 * np.abs(out[0]).max()


RERANK_REFS = Path(__file__).resolve().parent / "references" / "rerank-tiny-qwen3.json"


@pytest.mark.parametrize("variant", ["plain", "template"])
def test_reranker_matches_llama_embedding(tmp_path: Path, variant: str) -> None:
    """A tiny Qwen3-Reranker-shaped file (family_models.write_reranker_gguf): `--pooling rank`'s
    scores, from QUERY<tab>DOCUMENT lines, are llama-embedding's on the same file."""
    from family_models import write_reranker_gguf

    refs = json.loads(RERANK_REFS.read_text())
    path = write_reranker_gguf(tmp_path / "rerank.gguf", template=variant == "template")
    r = cli("embedding", str(path), "-p", "\n".join(refs["pairs"]), "--pooling", "rank", "--embd-output-format", "array")
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(json.loads(r.stdout), refs[variant], atol=5e-4)
    r = cli("embedding", str(path), "-p", refs["pairs"][0], "--pooling", "rank")  # llama-embedding's lines
    assert r.stdout.split() == ["rerank", "score", "0:", f"{refs[variant][0][0]:.3f}", "[yes]",
                                "rerank", "score", "0:", f"{refs[variant][0][1]:.3f}", "[no]"]  # fmt: skip


def test_rerank_api_and_server(tmp_path: Path) -> None:
    from family_models import write_reranker_gguf

    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from serving import Server

    path = write_reranker_gguf(tmp_path / "rerank.gguf", template=True)
    docs = ["the dog", "a b", "it", "the cat"]
    with Llama(path, n_ctx=256) as llm:
        scores = llm.rerank("the cat", docs)
        assert llm.model.params.cls_labels == ("yes", "no")
        # the first label's probability of the server's prompt (the template, no BOS/EOS added)
        toks = [llm.tokenize(f"<q>the cat</q><d>{d}</d>", add_special=False) for d in docs]
        assert scores == [float(v[0]) for v in llm.embed(toks, pooling="rank")]
        assert all(abs(sum(v) - 1) < 1e-6 for v in llm.embed(toks, pooling="rank"))  # softmaxed
    s = Server(path, ["--reranking", "-np", "1", "-c", "256", "-t", "1", "--no-warmup"], tmp_path / "log")
    try:
        r = httpx.post(s.url + "/v1/rerank", json={"query": "the cat", "documents": docs, "top_n": 3}, timeout=60).json()
        order = sorted(range(4), key=lambda i: -scores[i])[:3]
        assert [x["index"] for x in r["results"]] == order and r["object"] == "list"
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], [scores[i] for i in order], atol=1e-6)
        tei = httpx.post(s.url + "/rerank", json={"query": "the cat", "texts": docs, "return_text": True}, timeout=60).json()
        assert [x["index"] for x in tei][:3] == order and tei[0]["text"] == docs[order[0]] and "score" in tei[0]
        bad = httpx.post(s.url + "/v1/rerank", json={"query": "x", "documents": []}, timeout=60)
        assert bad.status_code == 400 and "non-empty" in bad.json()["error"]["message"]
    finally:
        s.stop()


def test_rank_needs_a_head(default_model: Path) -> None:
    r = cli("embedding", str(default_model), "-p", "x", "--pooling", "rank")
    assert r.returncode == 1 and "needs a reranker's classifier head (cls.output)" in r.stderr
    with Llama(default_model, n_ctx=64) as llm, pytest.raises(LlamapyError, match="classifier head"):
        llm.rerank("q", ["d"])
