"""Graph.expand (ggml_build_forward_expand): roots go in, in the order given, each after the
sources not yet in the graph; what an earlier expand added keeps its place."""

from __future__ import annotations

from llamapy import ops
from llamapy.graph import Graph
from llamapy.tensor import Tensor, TensorFlag
from llamapy.types import GGMLType


def _x(name: str) -> Tensor:
    return Tensor(name, (4, 8), GGMLType.F32, flags=TensorFlag.INPUT)


def test_expand_fixes_the_order_of_independent_branches() -> None:
    x = _x("x")
    a = ops.scale(x, 2.0, "a")
    b = ops.scale(x, 3.0, "b")
    c = ops.scale(b, 4.0, "c")
    out = ops.add(a, c, "out")
    # from the output alone: sources left to right, so a's branch first
    assert [n.name for n in Graph.build(out).nodes] == ["a", "b", "c", "out"]
    # expanding c first puts its branch ahead; building the output then adds only what is left
    g = Graph().expand(c)
    assert [n.name for n in g.nodes] == ["b", "c"] and g.outputs == []
    assert not c.flags & TensorFlag.OUTPUT
    g.output(out)
    assert [n.name for n in g.nodes] == ["b", "c", "a", "out"]
    assert g.leafs == [x] and g.outputs == [out] and out.flags & TensorFlag.OUTPUT
    g.expand(a, out)  # already in: nothing twice
    assert len(g.nodes) == 4
