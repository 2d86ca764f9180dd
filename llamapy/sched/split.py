"""Pass 5 of `ggml_backend_sched_split_graph`: cut the assigned node list into splits, one
backend each, and list the tensors each split must receive from another backend.

A source needs no copy when the split's device can use the memory it lives in: its own
buffer type, or host memory for host devices (CPU and BLAS share every host buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..backend.interface import Backend
from ..graph import Graph
from ..tensor import Op, Tensor, TensorFlag
from .passes import Assignment


class NodeList(list):
    """A split's nodes, carrying for each node the values that die once it has run (`release`,
    aligned with the nodes; set by `releases`): `kernels.run_nodes` drops them from the
    environment, so that a 512-token batch does not hold every intermediate of the graph at
    once (the role of ggml-alloc's reuse of dead tensors' memory). A backend that ignores it is
    still correct: the values then live until the graph has run."""

    release: list[tuple[Tensor, ...]]


@dataclass
class Split:
    backend: int
    nodes: list[Tensor] = field(default_factory=NodeList)
    inputs: list[Tensor] = field(default_factory=list)  # copied in from another backend
    # values copied into this split that die with it (dropped by the scheduler after it ran)
    release_after: list[Tensor] = field(default_factory=list)


def _usable_without_copy(backends: Sequence[Backend], a: Assignment, src: Tensor, b: int) -> bool:
    dev = backends[b].device
    buf = src.root().buffer
    return dev.supports_buft(buf.buft if buf is not None else backends[a[src]].device.buffer_type())


def _copies_experts(backends: Sequence[Backend], a: Assignment, n: Tensor, b: int) -> bool:
    """Whether `n` is a MUL_MAT_ID whose experts must be copied to backend b (a prompt's experts
    kept in host memory, --n-cpu-moe / -ot exps=CPU, offloaded with their op). ggml starts a new
    split at any node reading a weight to copy when the current split already has inputs, so the
    memory of the weights copied for the split before is reused; here only at the experts, the
    large ones: a dense CPU layer's weights are already a split of their own (the host KV stores
    cut it), but a GPU layer's host experts would all be copied into one split, and held, at once."""
    return n.op is Op.MUL_MAT_ID and bool(n.src[0].flags & TensorFlag.WEIGHT) and a[n.src[0]] != b \
        and not _usable_without_copy(backends, a, n.src[0], b)


def split(graph: Graph, backends: Sequence[Backend], a: Assignment) -> list[Split]:
    """Pass 5."""
    splits: list[Split] = []
    cur: Split | None = None
    for n in graph.nodes:
        b = a[n]
        if cur is None or b != cur.backend or (cur.inputs and _copies_experts(backends, a, n, b)):
            cur = Split(b)
            splits.append(cur)
        cur.nodes.append(n)
        for src in n.src:
            if src in cur.inputs:
                continue
            if a[src] != b and not _usable_without_copy(backends, a, src, b):
                cur.inputs.append(src)
    return splits


def releases(graph: Graph, splits: list[Split]) -> None:
    """Set each split's `nodes.release` and `release_after`: a value computed by a node (not a
    graph output) dies after its last reader — inside that reader's split, unless the reader got
    it as a copied input, in which case the original dies after that split."""
    keep = set(graph.outputs)
    last: dict[Tensor, tuple[int, int]] = {}  # value -> (split, node) of its last reader
    for si, s in enumerate(splits):
        for ni, n in enumerate(s.nodes):
            for src in n.src:
                if src in last:
                    last[src] = (si, ni)
            last[n] = (si, ni)  # a value no node reads dies right after it is made
    rel: list[list[list[Tensor]]] = [[[] for _ in s.nodes] for s in splits]
    for t, (si, ni) in last.items():
        if t in keep:
            continue
        if t in splits[si].inputs:
            splits[si].release_after.append(t)
        else:
            rel[si][ni].append(t)
    for s, r in zip(splits, rel):
        s.nodes = NodeList(s.nodes)
        s.nodes.release = [tuple(x) for x in r]
