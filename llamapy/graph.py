"""The compute graph: nodes in execution order plus the leafs they read (ggml.c's `ggml_cgraph`,
`ggml_build_forward_expand`).

`Graph.expand(roots)` visits sources depth-first, so a node always comes after everything it
reads, and appends only what is not in the graph yet; a builder that expands some tensors early
fixes their place in the order, as llama.cpp's build_attn expands Q, V and K and then the KV-cache
stores together, so that a layer's host-side ops stay adjacent (fewer scheduler splits).
`Graph.build(outputs)` expands the outputs into a new graph and marks them OUTPUT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tensor import Tensor, TensorFlag


@dataclass
class Graph:
    nodes: list[Tensor] = field(default_factory=list)  # computed, in execution order
    leafs: list[Tensor] = field(default_factory=list)  # weights, inputs, KV cache
    outputs: list[Tensor] = field(default_factory=list)
    # ids of every tensor in nodes or leafs (which keep them alive, so no id is reused)
    _seen: set[int] = field(default_factory=set, repr=False, compare=False)

    @classmethod
    def build(cls, *outputs: Tensor) -> Graph:
        return cls().output(*outputs)

    def expand(self, *roots: Tensor) -> Graph:
        """Append each root after its not yet added sources, in order (ggml_build_forward_expand)."""
        for root in roots:
            self._expand(root, self._seen)
        return self

    def output(self, *outputs: Tensor) -> Graph:
        """Expand the outputs and mark them OUTPUT (kept to the end of the compute)."""
        for out in outputs:
            self._expand(out, self._seen)
            if out not in self.outputs:
                self.outputs.append(out)
            out.flags |= TensorFlag.OUTPUT
        return self

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

    def has(self, t: Tensor) -> bool:
        """Whether `t` is one of this graph's nodes or leafs (a set lookup, no list scan)."""
        return id(t) in self._seen

    def inputs(self) -> list[Tensor]:
        return [t for t in self.leafs if t.flags & TensorFlag.INPUT]

    def dump(self) -> str:
        """One line per node: index, op, name, type and shape, sources (for LLAMAPY_DEBUG)."""
        lines = []
        for i, n in enumerate(self.nodes):
            srcs = ", ".join(s.name for s in n.src)
            lines.append(f"{i:4d} {n.op.name:<15} {n.name:<28} {n.type.name}{list(n.shape)} <- [{srcs}]")
        return "\n".join(lines)
