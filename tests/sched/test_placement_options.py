"""-dev / -mg / -ts checked where placement is decided (one-line errors for the API and the CLI
alike), and llama.cpp's default layer split over several GPUs: in proportion to their free
memory (src/llama-model.cpp load_tensors)."""

from __future__ import annotations

import pytest
from sched_support import cli, one_line_error, open_llm

from llamapy.types import GGMLType, LlamapyError


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "2")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)


# -- bad placement options: the library raises, the CLI says one line ------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"devices": ["TEST7"]}, "-dev TEST7: no device named 'TEST7' (available: TEST0, TEST1"),
        ({"devices": ["TEST0", "nope"]}, "no device named 'nope'"),
        ({"mg": 2}, "-mg 2: no such GPU (GPUs: 0 = TEST0, 1 = TEST1)"),
        ({"mg": -1}, "-mg -1: no such GPU"),
        ({"ts": (-1.0, 2.0)}, "-ts -1,2: each proportion must be a number >= 0"),
        ({"ts": (1.0, float("nan"))}, "each proportion must be a number >= 0"),
        ({"ts": (1.0, 1.0, 1.0)}, "-ts 1,1,1: 3 proportions for 2 GPU(s)"),
        ({"devices": ["TEST1"], "ot": [("blk", "TEST0")]}, "-ot blk=TEST0: TEST0 is not among the devices in use"),
    ],
)
def test_bad_placement_options_raise(tiny32, two_gpus, kw, needle) -> None:  # noqa: ANN001
    with pytest.raises(LlamapyError) as e:
        open_llm(tiny32, "all", **kw)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_mg_without_a_gpu(tiny32, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("LLAMAPY_TEST_GPU", raising=False)
    with pytest.raises(LlamapyError, match=r"-mg 1: no such GPU \(no GPU is in use\)"):
        open_llm(tiny32, mg=1)
    with open_llm(tiny32, mg=0) as llm:  # the default stays valid everywhere
        assert llm.model.placement.n_gpu_layers == 0


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["-dev", "TEST7"], "no device named 'TEST7'"),
        (["-mg", "3"], "-mg 3: no such GPU"),
        (["-ts", "-1,2"], "-ts -1,2: each proportion must be a number >= 0"),
    ],
)
def test_bad_placement_flags_are_one_line_errors(tiny32, flags, needle) -> None:  # noqa: ANN001
    r = cli("run", tiny32, "-p", "hi", "-n", "1", *flags, env={"LLAMAPY_TEST_GPU": "2"})
    one_line_error(r, needle)


def test_dev_picks_the_gpus_and_keeps_the_host_backends(tiny32, two_gpus) -> None:  # noqa: ANN001
    with open_llm(tiny32, "all", devices=["test1"]) as llm:
        assert {d.name for d in llm.model.placement.layer_device} == {"TEST1"}
        assert [b.name for b in llm.ctx.backends] == ["TEST1", "BLAS", "CPU"]
    with open_llm(tiny32, "all", devices=["none"]) as llm:
        assert llm.model.placement.n_gpu_layers == 0
        assert [b.name for b in llm.ctx.backends] == ["BLAS", "CPU"]


# -- the default split: free memory ----------------------------------------------------------


def _layers_on_first(n: int, frac0: float) -> int:
    """llama.cpp: layer i (of n offloaded) goes to the first GPU whose cumulative split is above
    i/n (std::upper_bound), so the first GPU gets the layers with i/n < its fraction."""
    return sum(1 for i in range(n) if i / n < frac0)


def test_all_layers_spread_over_two_gpus_by_free_memory(tiny32, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "2")
    monkeypatch.setenv("LLAMAPY_TEST_GPU_MEM", "3000,1000")  # MiB: TEST0 has 3/4 of the free memory
    toks = list(range(1, 30))
    # an f32 cache: with the default f16 one, float-order differences between the CPU and the
    # TEST devices flip a few f16 roundings of K/V, enough to change a near-tie greedy token here
    f32 = {"type_k": GGMLType.F32, "type_v": GGMLType.F32}
    with open_llm(tiny32, 0, **f32) as llm:
        ref = llm.generate(toks, n_predict=5, temp=0).tokens
    with open_llm(tiny32, "all", **f32) as llm:
        names = [d.name for d in llm.model.placement.layer_device]
        n0 = _layers_on_first(33, 0.75)
        assert names == ["TEST0"] * n0 + ["TEST1"] * (33 - n0)
        assert {b.name for b in llm.model.weights.buffers} == {"CPU", "TEST0", "TEST1"}
        assert llm.generate(toks, n_predict=5, temp=0).tokens == ref


def test_equal_free_memory_splits_evenly_and_ngl_n_splits_its_layers(tiny32, two_gpus) -> None:  # noqa: ANN001
    with open_llm(tiny32, "all") as llm:
        names = [d.name for d in llm.model.placement.layer_device]
        assert names.count("TEST0") == _layers_on_first(33, 0.5) == 17 and names.count("TEST1") == 16
    with open_llm(tiny32, 20) as llm:
        names = [d.name for d in llm.model.placement.layer_device]
        assert names == ["CPU"] * 13 + ["TEST0"] * 10 + ["TEST1"] * 10


def test_split_is_fixed_before_the_weights_load(tiny32, monkeypatch) -> None:  # noqa: ANN001
    """Fits made after loading (the out-of-memory message, -ngl auto) see the split the load
    used, not one skewed by the memory the weights now take."""
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "2")
    monkeypatch.setenv("LLAMAPY_TEST_GPU_MEM", "200,100")
    with open_llm(tiny32, "all") as llm:
        m = llm.model
        assert m.split == [200 * 2**20, 100 * 2**20]
        assert m._place(33).layer_device == m.placement.layer_device


def test_cli_all_layers_use_both_gpus(tiny32) -> None:  # noqa: ANN001
    r = cli("run", tiny32, "-p", "hi", "-n", "1", "-ngl", "all", env={"LLAMAPY_TEST_GPU": "2"})
    assert r.returncode == 0, r.stderr
    assert "TEST0 model buffer size" in r.stderr and "TEST1 model buffer size" in r.stderr
