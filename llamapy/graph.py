"""The compute graph: nodes in execution order plus the leafs they read (ggml.c's `ggml_cgraph`,
`ggml_build_forward_expand`).

`Graph.build(outputs)` visits sources depth-first, so a node always comes after everything it
reads; expanding several outputs in order (the KV-cache stores first, then the logits) fixes the
order of side effects, as llama.cpp does by expanding the cache copies before attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tensor import Tensor, TensorFlag


@dataclass
class Graph:
    nodes: list[Tensor] = field(default_factory=list)  # computed, in execution order
    leafs: list[Tensor] = field(default_factory=list)  # weights, inputs, KV cache
    outputs: list[Tensor] = field(default_factory=list)

    @classmethod
    def build(cls, *outputs: Tensor) -> Graph:
        g = cls()
        seen: set[int] = set()
        for out in outputs:
            g._expand(out, seen)
            if out not in g.outputs:
                g.outputs.append(out)
            out.flags |= TensorFlag.OUTPUT
        return g

    def _expand(self, root: Tensor, seen: set[int]) -> None:
        # iterative post-order DFS: graphs of 32+ layers would exceed Python's recursion limit
        stack: list[tuple[Tensor, int]] = [(root, 0)]
        while stack:
            t, i = stack.pop()
            if id(t) in seen:
                continue
            if i < len(t.src):
                stack.append((t, i + 1))
                if id(t.src[i]) not in seen:
                    stack.append((t.src[i], 0))
                continue
            seen.add(id(t))
            (self.leafs if t.is_leaf else self.nodes).append(t)

    def inputs(self) -> list[Tensor]:
        return [t for t in self.leafs if t.flags & TensorFlag.INPUT]

    def dump(self) -> str:
        """One line per node: index, op, name, type and shape, sources (for LLAMAPY_DEBUG)."""
        lines = []
        for i, n in enumerate(self.nodes):
            srcs = ", ".join(s.name for s in n.src)
            lines.append(f"{i:4d} {n.op.name:<15} {n.name:<28} {n.type.name}{list(n.shape)} <- [{srcs}]")
        return "\n".join(lines)
