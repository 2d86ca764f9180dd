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
from ..tensor import Tensor
from .passes import Assignment


@dataclass
class Split:
    backend: int
    nodes: list[Tensor] = field(default_factory=list)
    inputs: list[Tensor] = field(default_factory=list)  # copied in from another backend


def _usable_without_copy(backends: Sequence[Backend], a: Assignment, src: Tensor, b: int) -> bool:
    dev = backends[b].device
    buf = src.root().buffer
    if buf is not None:
        return dev.supports_buft(buf.buft)
    return dev.supports_buft(backends[a[src]].device.buffer_type())


def split(graph: Graph, backends: Sequence[Backend], a: Assignment) -> list[Split]:
    """Pass 5."""
    splits: list[Split] = []
    cur: Split | None = None
    for n in graph.nodes:
        b = a[n]
        if cur is None or b != cur.backend:
            cur = Split(b)
            splits.append(cur)
        cur.nodes.append(n)
        for src in n.src:
            if src in cur.inputs:
                continue
            if a[src] != b and not _usable_without_copy(backends, a, src, b):
                cur.inputs.append(src)
    return splits
