"""-ngl placement, graph splits, copies and memory fitting, on the GPU-like TEST device
(llama.cpp's load_tensors rule and ggml_backend_sched's passes)."""

from __future__ import annotations

import numpy as np
import pytest

import llamapy
from llamapy.context import ContextOptions, ModelOptions
from llamapy.types import GGMLType, OutOfMemoryError


def _llm(path, ngl=0, ot=(), ts=(), **ctx):  # noqa: ANN001, ANN003
    # float32 activations: the logits of different placements are compared to 1e-4, and the
    # CPU's default 8-bit activations round differently wherever the float32 sums of the two
    # placements differ in order (the q8 mode is checked in tests/model); an f32 cache for the
    # same reason: an f16 cache rounds K/V, so those float-order differences (4e-6 of the logits on
    # SmolLM2) flip a few f16 roundings and reach 1e-4
    ctx.setdefault("type_k", GGMLType.F32)
    ctx.setdefault("type_v", GGMLType.F32)
    co = ContextOptions(n_ctx=ctx.pop("n_ctx", 256), cpu_matmul=ctx.pop("cpu_matmul", "f32"), **ctx)
    return llamapy.Llama(path, model_options=ModelOptions(n_gpu_layers=ngl, override_tensor=ot, tensor_split=ts), context_options=co)


def _decode_plan(llm, n_past: int):  # noqa: ANN001, ANN202
    """The plan of a single-token decode step at position n_past."""
    llm.ctx.decode([5], [n_past])
    g = llm.ctx.graph(1, 1)
    return g, llm.ctx.sched.reserve(g.graph)


def _test0(llm):  # noqa: ANN001, ANN202
    return next(d for d in llm.model.devices if d.name == "TEST0")


@pytest.fixture
def test_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)


def test_ngl20_places_the_last_layers_and_output(tiny32, test_gpu) -> None:
    with _llm(tiny32, 20) as llm:
        pl = llm.model.placement
        n_layer = llm.model.params.n_layer
        assert n_layer == 32
        assert [d.name for d in pl.layer_device[:13]] == ["CPU"] * 13
        assert [d.name for d in pl.layer_device[13:]] == ["TEST0"] * 20  # layers 13-31 + output
        w = llm.model.weights
        assert w.tok_embd.buffer.name == "CPU"
        assert w.layers[12]["attn_output"].buffer.name == "CPU"
        assert w.layers[13]["attn_output"].buffer.name == "TEST0"
        assert w.output.buffer.name == "TEST0" and w.output_norm.buffer.name == "TEST0"
        # the tied output is a second copy of token_embd on the device
        assert llm.model.weights.tied_output is False or w.output is not w.tok_embd
        assert llm.ctx.kv.k[12].buffer.name == "CPU" and llm.ctx.kv.k[13].buffer.name == "TEST0"


def test_ngl20_decode_runs_in_two_splits_copying_only_boundaries(tiny32, test_gpu) -> None:
    with _llm(tiny32, 20) as llm:
        llm.logits(llm.tokenize("Hello world"))
        g, plan = _decode_plan(llm, 3)
        names = [llm.ctx.backends[s.backend].name for s in plan.splits]
        assert names == ["CPU", "TEST0"]
        inputs = plan.splits[1].inputs
        e = llm.model.params.n_embd
        for t in inputs:  # boundary activations (one row) and small inputs only: no weights
            assert t.nbytes <= 4 * max(e, g.inputs.kv.size), t
            assert not t.name.endswith(".weight")
        dev = _test0(llm)
        dev.stats.bytes_in = 0
        llm.ctx.decode([6], [4])
        assert dev.stats.bytes_in == sum(t.nbytes for t in inputs)
        dump = llm.ctx.sched.dump(g.graph)
        assert dump.splitlines()[1].startswith("## SPLIT #1: TEST0 # ")


def test_ngl0_is_one_split_and_ngl1_offloads_only_the_output(tiny32, test_gpu) -> None:
    with _llm(tiny32, 0) as llm:
        _, plan = _decode_plan(llm, 0)
        assert len(plan.splits) == 1
        assert all(b.name == "CPU" for b in llm.model.weights.buffers)
    with _llm(tiny32, 1) as llm:
        assert [d.name for d in llm.model.placement.layer_device].count("TEST0") == 1
        assert llm.model.placement.layer_device[-1].name == "TEST0"
        assert llm.model.weights.output.buffer.name == "TEST0"
        assert llm.model.weights.layers[31]["ffn_down"].buffer.name == "CPU"


def test_override_tensor_gives_three_splits(tiny32, test_gpu) -> None:
    with _llm(tiny32, 0, ot=[(r"blk\.5\.ffn_down\.weight", "TEST0")]) as llm:
        assert llm.model.weights.layers[5]["ffn_down"].buffer.name == "TEST0"
        g, plan = _decode_plan(llm, 0)
        assert [llm.ctx.backends[s.backend].name for s in plan.splits] == ["CPU", "TEST0", "CPU"]
        dev = _test0(llm)
        dev.stats.bytes_in = 0
        llm.ctx.decode([7], [1])
        assert dev.stats.bytes_in == sum(t.nbytes for s in plan.splits[1:2] for t in s.inputs)


@pytest.mark.parametrize("ngl", [1, 20, "all"])
def test_logits_equal_across_ngl_tiny32(tiny32, test_gpu, ngl) -> None:  # noqa: ANN001
    toks = list(range(1, 40))
    with _llm(tiny32, 0) as llm:
        ref = llm.logits(toks)
        ref_greedy = llm.generate(toks, n_predict=8, temp=0).tokens
    with _llm(tiny32, ngl) as llm:
        got = llm.logits(toks)
        assert llm.generate(toks, n_predict=8, temp=0).tokens == ref_greedy
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("ngl", [1, 20, "all"])
def test_logits_equal_across_ngl_default_model(default_model, test_gpu, ngl) -> None:  # noqa: ANN001
    prompt = "The three primary colors are"
    with _llm(default_model, 0) as llm:
        toks = llm.tokenize(prompt)
        ref = llm.logits(toks)
        ref_greedy = llm.generate(toks, n_predict=6, temp=0).tokens
    with _llm(default_model, ngl) as llm:
        got = llm.logits(toks)
        assert llm.generate(toks, n_predict=6, temp=0).tokens == ref_greedy
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_auto_picks_the_largest_ngl_that_fits(tiny32, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setenv("LLAMAPY_TEST_GPU_MEM", "15")  # MiB, below the model's ~26 MiB
    with _llm(tiny32, "auto", n_ubatch=16) as llm:
        n = llm.model.info.n_gpu_layers
        assert 0 < n < 33
        assert f"{n}/33 layers fit" in llm.model.info.ngl_reason
        budget = 15 * 2**20
        assert llm.model.device_bytes(n)["TEST0"] <= budget < llm.model.device_bytes(n + 1)["TEST0"]
        dev = _test0(llm)
    assert dev.allocated == 0
    with pytest.raises(OutOfMemoryError, match=f"at most {n} layers would fit"):
        _llm(tiny32, n + 1, n_ubatch=16)
    assert dev.allocated == 0 or _fresh_test0_allocated() == 0


def _fresh_test0_allocated() -> int:
    from llamapy.backend.registry import discover

    return discover().device("TEST0").allocated


def test_explicit_ngl_that_does_not_fit_frees_everything(tiny32, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setenv("LLAMAPY_TEST_GPU_MEM", "12")
    with pytest.raises(OutOfMemoryError, match=r"layers would fit"):
        _llm(tiny32, "all", n_ubatch=16)
    assert _fresh_test0_allocated() == 0


def test_tensor_split_over_two_devices(tiny32, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "2")
    toks = list(range(1, 30))
    with _llm(tiny32, 0) as llm:
        ref = llm.generate(toks, n_predict=6, temp=0).tokens
    with _llm(tiny32, "all", ts=(3, 1)) as llm:
        names = [d.name for d in llm.model.placement.layer_device]
        # contiguous runs in the ratio 3:1 over the 33 layers
        assert names == ["TEST0"] * names.count("TEST0") + ["TEST1"] * names.count("TEST1")
        assert abs(names.count("TEST0") / 33 - 0.75) < 0.05
        assert llm.generate(toks, n_predict=6, temp=0).tokens == ref


def test_big_batches_go_to_blas_without_a_test_device(tiny32, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("LLAMAPY_TEST_GPU", raising=False)
    # tiny32's Q4_K/Q6_K products stay on the int8 kernels at any batch where the library has
    # their multi-column kernel (qmatmul.Q8_GEMM); without that table they take tiles + sgemm,
    # which is what BLAS claims (as for F16/BF16/Q2_K weights and the portable build)
    from llamapy.backend import qmatmul

    monkeypatch.setattr(qmatmul, "Q8_GEMM", {})
    toks = list(range(1, 41))  # >= 32 tokens: BLAS claims the MUL_MATs
    with _llm(tiny32, 0) as llm:
        g = llm.ctx.graph(len(toks), len(toks))
        plan = llm.ctx.sched.reserve(g.graph)
        mm = [n for n in g.graph.nodes if n.op.name == "MUL_MAT"]
        assert {llm.ctx.backends[plan.assignment[n]].name for n in mm} == {"BLAS"}
        assert "[  BLAS]" in llm.ctx.sched.dump(g.graph, 2)
        got = llm.logits(toks)
    monkeypatch.setenv("LLAMAPY_BACKENDS", "cpu")
    from llamapy.backend import registry

    registry._cache = None
    with _llm(tiny32, 0) as llm:
        assert [b.name for b in llm.ctx.backends] == ["CPU"]
        ref = llm.logits(toks)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_no_kv_offload_keeps_the_cache_on_the_host(tiny32, test_gpu) -> None:  # noqa: ANN001
    toks = list(range(1, 30))
    with _llm(tiny32, 0) as llm:
        ref = llm.logits(toks)
    with _llm(tiny32, "all", no_kv_offload=True) as llm:
        assert {t.buffer.name for t in llm.ctx.kv.k} == {"CPU"}
        got = llm.logits(toks)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_perplexity_equal_across_ngl(tiny32, test_gpu) -> None:  # noqa: ANN001
    """|ΔPPL| <= 1e-4 PPL between -ngl 0, 20 and all (tempest, -c 128 --chunks 4)."""
    from tests_support import shared

    text = shared("data", "text", "tempest.txt").read_text()
    ppl = {}
    for ngl in (0, 20, "all"):
        with _llm(tiny32, ngl, n_ctx=128, n_batch=128) as llm:
            toks = llm.tokenize(text)
            nll = np.concatenate([c.nll for c in llm.perplexity(toks, n_chunks=4)])
            assert len(nll) == 4 * (128 - 1 - 64)
            ppl[ngl] = float(np.exp(nll.mean()))
    for ngl in (20, "all"):
        assert abs(ppl[ngl] - ppl[0]) <= 1e-4 * ppl[0], ppl


@pytest.mark.parametrize("ngl", [0, 20])
def test_dead_values_are_dropped_as_the_graph_runs(tiny32, test_gpu, monkeypatch, ngl: int) -> None:  # noqa: ANN001
    """A 64-token batch over CPU, BLAS (and TEST0 with -ngl 20): every intermediate is dropped
    after its last reader, so the live values stay a few per layer instead of the whole graph's
    (ggml-alloc reuses dead tensors' memory; before this a 869-token prompt peaked at 889 MiB)."""
    from llamapy.backend import kernels

    live: list[int] = []
    run = kernels.run_nodes

    def spy(nodes, env, xp, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        run(nodes, env, xp, *a, **kw)
        live.append(sum(1 for t in env if not t.is_leaf))

    for mod in ("cpu", "blas", "device"):
        monkeypatch.setattr(f"llamapy.backend.{mod}.run_nodes", spy)
    with _llm(tiny32, ngl, n_ctx=128, n_batch=64, n_ubatch=64) as llm:
        toks = list(range(1, 65))
        got = llm.ctx.decode(toks, list(range(64)), 0)
        g = llm.ctx.graph(64, 1).graph
        n_nodes = len(g.nodes)
    assert np.isfinite(got).all()
    assert n_nodes > 500 and 0 < max(live) < 40, (n_nodes, max(live))
