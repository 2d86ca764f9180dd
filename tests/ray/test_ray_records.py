"""What travels to a Ray device and back, without a cluster (backend/ray.py): op records are
plain data and validated on the actor's side; results are validated by the driver; and the
actor's code run in this process (a stand-in for its handle that copies every argument and
result, as Ray does: tests/ray/inprocess.py) gives a model's logits equal to the CPU's."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamapy import ops
from llamapy import ray_node
from llamapy.backend import ray as rb
from llamapy.tensor import Op, Tensor, TensorFlag
from llamapy.types import GGMLType, LlamapyError

import inprocess


def _graph() -> tuple[Tensor, Tensor, Tensor]:
    a = Tensor("a", (2, 4), GGMLType.F32, flags=TensorFlag.INPUT)
    b = Tensor("b", (2, 4), GGMLType.F32, flags=TensorFlag.INPUT)
    s = ops.scale(ops.add(a, b), 0.5)
    return a, b, s


def test_records_are_plain_data_and_rebuild_the_graph() -> None:
    a, b, s = _graph()
    nodes = [s.src[0], s]
    recs, in_recs, inputs, leaves = rb.graph_records(nodes, lambda t: None)
    assert inputs == [a, b] and leaves == []
    pickle.loads(pickle.dumps((recs, in_recs)))  # nothing but builtins
    got_nodes, got_inputs, outs = rb.build_graph(recs, in_recs, leaves, {}, 1, [1])
    assert [n.op for n in got_nodes] == [Op.ADD, Op.SCALE] and got_nodes[1].params == {"s": 0.5}
    assert outs == [got_nodes[1]] and [t.shape for t in got_inputs] == [(2, 4), (2, 4)]


@pytest.mark.parametrize(
    "bad",
    [
        lambda r: r[0][:1] + ("NONE",) + r[0][2:],  # a leaf op is no computation
        lambda r: r[0][:1] + ("SYSTEM",) + r[0][2:],  # not an op at all
        lambda r: r[0][:4] + ({"s": print},) + r[0][5:],  # something callable in the params
        lambda r: r[0][:4] + ({"s": object()},) + r[0][5:],
        lambda r: r[0][:5] + ((("i", 7),),) + r[0][6:],  # a source that is not there
        lambda r: r[0][:5] + ((("l", 3),),) + r[0][6:],  # a tensor the actor does not hold
        lambda r: r[0][:2] + ((2, -4),) + r[0][3:],  # a negative dimension
        lambda r: r[0][:3] + ("Q99",) + r[0][4:],  # no such type
    ],
)
def test_the_actor_refuses_records_that_are_not_plain_valid_data(bad: Any) -> None:
    a, b, s = _graph()
    recs, in_recs, _, leaves = rb.graph_records([s.src[0], s], lambda t: None)
    recs = [bad(recs), recs[1]]
    with pytest.raises(ValueError):
        rb.build_graph(recs, in_recs, leaves, {}, 1, [1])


def test_the_driver_refuses_params_that_are_not_plain_data() -> None:
    a, b, s = _graph()
    s.params["s"] = lambda: 0.5
    with pytest.raises(ValueError):
        rb.graph_records([s.src[0], s], lambda t: None)


def _local_devices(monkeypatch: pytest.MonkeyPatch) -> list[inprocess.FakeDevice]:
    monkeypatch.setenv("LLAMAPY_RAY", "in-process")
    return inprocess.install(monkeypatch.setattr)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_in_process_actors_give_the_cpu_logits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, arch: str) -> None:
    """qwen2: the fused Q/K/V bias set on the node from its three parts' byte ranges."""
    from conftest import write_llama_gguf
    from gguf import GGMLQuantizationType as T

    from llamapy.api import Llama
    from llamapy.backend.registry import discover
    from llamapy.context import ContextOptions, ModelOptions

    monkeypatch.setenv("LLAMAPY_BACKENDS", "cpu,ray")
    if arch == "llama":
        tiny32 = write_llama_gguf(tmp_path / "m.gguf", n_layer=4)  # Q8_0, tied output
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
        from family_models import write_family_gguf

        tiny32 = write_family_gguf(tmp_path / "q.gguf", "qwen2", n_layer=4, qtype=T.Q8_0)
    # micro-batches of 8: later ones attend to cached K/V; 256 of the 512 cells (the masks sent to
    # the actors are narrower than their tensors)
    co = ContextOptions(n_ctx=512, n_batch=64, n_ubatch=8)
    toks = list(range(10, 30))
    monkeypatch.delenv("LLAMAPY_RAY", raising=False)
    discover(refresh=True)
    with Llama(tiny32, model_options=ModelOptions(n_gpu_layers=0), context_options=co) as llm:
        want = llm.logits(toks)
    _local_devices(monkeypatch)
    try:
        assert [d.name for d in discover(refresh=True).devices()][:2] == ["RAY0", "RAY1"]
        with Llama(tiny32, model_options=ModelOptions(n_gpu_layers="all", tensor_split=[1, 1]), context_options=co) as llm:
            assert {b.name for b in llm.model.weights.buffers} >= {"RAY0", "RAY1"}
            got = llm.logits(toks)
    finally:
        monkeypatch.delenv("LLAMAPY_RAY")
        discover(refresh=True)
    assert np.array_equal(got, want)


def test_the_driver_validates_what_a_device_returns() -> None:
    dev = rb.RayDevice("RAY0", "node0", "here", 1 << 20, 1 << 20, ray_node.DeviceActor)
    t = Tensor("x", (2, 3), GGMLType.F32)
    for bad in (np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float64), "not an array"):
        res = rb._Result(dev, None)
        res.values = (bad,)
        with pytest.raises(LlamapyError, match="RAY0: returned"):
            rb.RemoteOut(res, 0, t).fetch()
    res = rb._Result(dev, None)
    res.values = (np.ones((2, 3), np.float32),)
    assert rb.RemoteOut(res, 0, t).fetch().sum() == 6


def test_the_node_uses_the_drivers_public_validators() -> None:
    """ray_node checks what it receives with backend/ray.py's validators, a public interface:
    it imports no private name from there."""
    import ast

    tree = ast.parse(Path(ray_node.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("backend.ray")
             for a in n.names]  # fmt: skip
    assert {"check_params", "check_shape", "check_type", "build_graph"} <= set(names)
    assert not [n for n in names if n.startswith("_")], names
    assert rb.check_shape([2, 3]) == (2, 3) and rb.check_type("Q4_K").name == "Q4_K"
    assert rb.check_params({"dims": [1, [2, 3]]}) == {"dims": (1, (2, 3))}
    for bad in (lambda: rb.check_shape((1, -1)), lambda: rb.check_type("eval"), lambda: rb.check_params({"f": len})):
        with pytest.raises(ValueError):
            bad()
