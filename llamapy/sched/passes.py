"""Backend assignment, passes 1–4 of ggml's `ggml_backend_sched_split_graph` (ggml-backend.cpp).

Each pass is a function over `(graph, backends, assignment)` that fills in more of the
assignment `{tensor: backend index}`; index 0 is the highest priority (GPUs first), the last is
the CPU, which supports every op and is the fallback.

- pass 1 `assign_from_weights`: a tensor in a pre-allocated buffer (weight, KV cache) and every op
  that reads a weight go where that buffer lives; inputs go to the CPU. This is how `-ngl`
  (which decides where weights live) decides where ops run. An op on a host weight may instead
  go to a device whose `offload_op` wants it (ggml-cuda: batch size >= 32, GET_ROWS never).
- pass 2 `expand`: spread GPU assignments to unassigned neighbours, down then up, then the rest.
- pass 3 `upgrade`: move a node to a higher-priority backend that shares its buffer type and
  supports it (the BLAS backend takes big MUL_MATs from the CPU this way); a node still
  unplaced goes to the backend that can read most of its placed inputs.
- pass 4 `fill_views`: views follow their source; leafs follow their buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..backend.interface import Backend, BufferType, BufferUsage
from ..graph import Graph
from ..tensor import Op, Tensor, TensorFlag

Assignment = dict[Tensor, int]

# ops whose weight (rope_freqs, attention sinks) is too small to choose a backend by (ggml skips them)
_NOT_BY_WEIGHT = frozenset({Op.ROPE, Op.FLASH_ATTN_EXT})


def _bufts(backends: Sequence[Backend]) -> list[BufferType]:
    return [b.device.buffer_type() for b in backends]


def backend_from_buffer(
    backends: Sequence[Backend], buft: BufferType, node: Tensor | None
) -> int:
    """Highest-priority backend that can use `buft` (and run `node`, when given)."""
    for i, be in enumerate(backends):
        if be.device.supports_buft(buft) and (node is None or be.device.supports_op(node)):
            return i
    return len(backends) - 1


def backend_id_from_cur(
    backends: Sequence[Backend], node: Tensor, op_offload: bool
) -> int | None:
    """ggml_backend_sched_backend_id_from_cur: where pass 1 puts one tensor, or None."""
    root = node.root()
    if root.buffer is not None:
        return backend_from_buffer(backends, root.buffer.buft, None if node.is_leaf else node)
    if node.flags & TensorFlag.INPUT:
        return len(backends) - 1
    if node.op in _NOT_BY_WEIGHT:
        return None
    for src in node.src:
        buf = src.root().buffer
        if src.is_leaf and buf is not None and buf.usage is BufferUsage.WEIGHTS:
            b = backend_from_buffer(backends, buf.buft, node)
            # a weight in host memory: a higher-priority device may still want this op (big batch)
            if op_offload and buf.buft.is_host:
                for i in range(b):
                    dev = backends[i].device
                    if dev.offload_op(node) and dev.supports_op(node):
                        return i
            return b
    return None


def assign_from_weights(graph: Graph, backends: Sequence[Backend], op_offload: bool = True) -> Assignment:
    """Pass 1."""
    a: Assignment = {}
    for t in graph.leafs:
        b = backend_id_from_cur(backends, t, op_offload)
        if b is not None:
            a[t] = b
    for t in graph.nodes:
        b = backend_id_from_cur(backends, t, op_offload)
        if b is not None:
            a[t] = b
    return a


def _set_if_supported(backends: Sequence[Backend], a: Assignment, node: Tensor, b: int) -> None:
    if backends[b].device.supports_op(node):
        a[node] = b


def expand(graph: Graph, backends: Sequence[Backend], a: Assignment) -> None:
    """Pass 2: the CPU is only used where weights or support force it, so GPU runs grow first."""
    cpu = len(backends) - 1
    nodes = [n for n in graph.nodes if not n.is_view]

    def sweep(order: Sequence[Tensor], skip_cpu: bool) -> None:
        cur: int | None = None
        for n in order:
            b = a.get(n)
            if b is not None:
                cur = None if (skip_cpu and b == cpu) else b
            elif cur is not None:
                _set_if_supported(backends, a, n, cur)

    sweep(nodes, skip_cpu=True)  # expand gpu down
    sweep(nodes[::-1], skip_cpu=True)  # expand gpu up
    sweep(nodes, skip_cpu=False)  # expand rest down
    sweep(nodes[::-1], skip_cpu=False)  # expand rest up


def _srcs_usable(backends: Sequence[Backend], a: Assignment, node: Tensor, b: int) -> bool:
    dev = backends[b].device
    for src in node.src:
        buf = src.root().buffer
        if buf is not None:
            if not dev.supports_buft(buf.buft):
                return False
        elif src in a and not dev.supports_buft(backends[a[src]].device.buffer_type()):
            return False
    return True


def _buffer_supported(backends: Sequence[Backend], a: Assignment, src: Tensor, b: int) -> bool:
    """ggml_backend_sched_buffer_supported: `src` lives (or will be computed) in memory backend
    `b` can read — its buffer's type, else that of the backend it (or its view source) runs on."""
    buf = src.root().buffer
    if buf is not None:
        return backends[b].device.supports_buft(buf.buft)
    owner = a.get(src, a.get(src.view_src) if src.view_src is not None else None)
    return owner is not None and backends[b].device.supports_buft(backends[owner].device.buffer_type())


def _most_supported_inputs(backends: Sequence[Backend], a: Assignment, node: Tensor) -> int:
    """An op no expansion could place: the backend that runs it and can read the most of its
    already-placed inputs (ggml's "3.best"; ties go to the higher priority)."""
    best, n_best = len(backends) - 1, -1
    for b in range(len(backends)):
        if not backends[b].device.supports_op(node):
            continue
        n = sum(
            1
            for src in node.src
            if (src in a or (src.view_src is not None and src.view_src in a)) and _buffer_supported(backends, a, src, b)
        )
        if n > n_best:
            best, n_best = b, n
    return best


def upgrade(graph: Graph, backends: Sequence[Backend], a: Assignment) -> None:
    """Pass 3: unassigned nodes take the backend that can read most of their placed inputs;
    assigned ones move up to a higher-priority backend with the same buffer type."""
    bufts = _bufts(backends)
    for n in graph.nodes:
        if n.is_view:
            continue
        cur = a.get(n)
        if cur is None:
            a[n] = _most_supported_inputs(backends, a, n)
            continue
        for b in range(cur):
            if bufts[b] is bufts[cur] and backends[b].device.supports_op(n) and _srcs_usable(backends, a, n, b):
                a[n] = b
                break


def fill_views(graph: Graph, backends: Sequence[Backend], a: Assignment) -> None:
    """Pass 4: views run where their source is; any leaf still unplaced goes to the CPU."""
    for n in graph.nodes:
        if n.is_view and n not in a:
            a[n] = a.get(n.src[0], len(backends) - 1)
        elif n not in a:
            a[n] = len(backends) - 1
    for t in graph.leafs:
        a.setdefault(t, len(backends) - 1)


def assign(graph: Graph, backends: Sequence[Backend], op_offload: bool = True) -> Assignment:
    a = assign_from_weights(graph, backends, op_offload)
    expand(graph, backends, a)
    upgrade(graph, backends, a)
    fill_views(graph, backends, a)
    return a
