"""The scheduler: assign, split, size and run a graph over several backends
(ggml-backend.cpp's `ggml_backend_sched`: `_split_graph`, `_alloc_splits`, `_compute_splits`).

`reserve(graph)` runs passes 1–5 once per graph and plans each backend's compute buffer;
`compute(graph, inputs)` then runs the splits in order, copying each split's inputs into its
backend first (the copy ladder: device-to-device if the backend offers it, else through the
host: a boundary's values read back as one batch per source device, one wait). A graph of the same shape is reused, so a decode step pays for planning once.
`LLAMAPY_SCHED_DEBUG=1|2` dumps the splits (2: and nodes) of every distinct graph that runs,
through `debug_hook` — the library hands the text to the CLI, which writes it to stderr.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend.interface import Backend
from ..graph import Graph
from ..tensor import Tensor, TensorFlag
from ..types import LlamapyError
from .alloc import plan_offsets
from .passes import Assignment, assign
from .split import Split, releases, split


@dataclass
class Plan:
    graph: Graph
    assignment: Assignment
    splits: list[Split]
    compute_sizes: dict[str, int] = field(default_factory=dict)  # backend name -> bytes
    # tensor -> (backend index, byte offset) in that backend's compute buffer (sched/alloc.py)
    offsets: dict[Tensor, tuple[int, int]] = field(default_factory=dict)
    # split index -> the backend's compiled plan for it (graph_plan_create), None if refused
    backend_plans: dict[int, Any] = field(default_factory=dict)
    shown: bool = False  # given to the scheduler's debug hook already
    runs: list[Any] | None = None  # Scheduler._runs: what each step does, decided once
    outs: list[tuple[Backend, list[Tensor]]] | None = None  # the graph's outputs by home backend (one read each)


def _owner(t: Tensor) -> Tensor:
    """The tensor whose compute-buffer memory `t` uses (views share their source's)."""
    while t.is_view or (t.view_src is not None and t.root().buffer is None):
        t = t.view_src  # type: ignore[assignment]
    return t


def _owns_memory(t: Tensor) -> bool:
    return not t.is_view and t.root().buffer is None and not t.is_leaf


class Scheduler:
    def __init__(self, backends: Sequence[Backend], op_offload: bool = True) -> None:
        if not backends or backends[-1].device.name != "CPU":
            raise LlamapyError("the scheduler needs the CPU backend last, as the fallback for every op")
        self.backends = list(backends)
        self.op_offload = op_offload
        self._plans: dict[int, Plan] = {}
        # called with the plan of each graph the first time it runs (LLAMAPY_SCHED_DEBUG: the CLI
        # sets it to `split_printer`, as ggml prints the splits of each graph it splits)
        self.debug_hook: Callable[[Plan], None] | None = None

    # -- planning ------------------------------------------------------------------------

    def reserve(self, graph: Graph) -> Plan:
        """Assign and split `graph`, and size every backend's compute buffer for it."""
        plan = self._plans.get(id(graph))
        if plan is not None and plan.graph is graph:
            return plan
        a = assign(graph, self.backends, self.op_offload)
        splits = split(graph, self.backends, a)
        releases(graph, splits)
        order: list[tuple[int, Tensor, list[Tensor]]] = []
        for s in splits:
            for inp in s.inputs:
                order.append((s.backend, inp, []))
            for n in s.nodes:
                reads = [_owner(x) for x in n.src]
                if _owns_memory(n):
                    order.append((s.backend, n, reads))
                elif reads:
                    order.append((s.backend, _owner(n), reads))
        alloc = plan_offsets(order, [_owner(o) for o in graph.outputs])
        plan = Plan(graph, a, splits, {self.backends[b].name: n for b, n in alloc.sizes.items()}, offsets=alloc.offsets)
        for be in self.backends:
            plan.compute_sizes.setdefault(be.name, 0)
        self._plans[id(graph)] = plan
        return plan

    def forget(self, graph: Graph) -> None:
        self._plans.pop(id(graph), None)

    def set_op_offload(self, on: bool) -> None:
        """Turn op offload on or off; graphs are planned again under the new rule."""
        if on != self.op_offload:
            self.op_offload = on
            self._plans.clear()

    # -- running -------------------------------------------------------------------------

    def compute(self, graph: Graph, inputs: dict[Tensor, np.ndarray]) -> dict[Tensor, np.ndarray]:
        """Run `graph` with `inputs` (host arrays for its INPUT leafs); return its outputs on
        the host."""
        plan = self.reserve(graph)
        if self.debug_hook is not None and not plan.shown:
            plan.shown = True
            self.debug_hook(plan)
        vals: dict[Tensor, Any] = dict(inputs)
        if plan.runs is None:
            plan.runs = self._runs(plan)
        copies: dict[tuple[Tensor, int, bool], Any] = {}
        for s, be, bp, host_in, ins in plan.runs:
            # the split reads its inputs' copies under their own names; the originals (values
            # native to another backend) are put back afterwards
            swap = self._copy_inputs(s, be, host_in, ins, vals, copies) if ins else None
            if swap:
                saved = {inp: vals[inp] for inp in swap if inp in vals}
                vals.update(swap)
            if not bp:
                be.compute(s.nodes, vals)
            else:
                be.graph_plan_compute(bp, vals)
            if swap:
                for inp in swap:
                    if inp in saved:
                        vals[inp] = saved[inp]
                    else:
                        del vals[inp]
            for t in s.release_after:
                vals.pop(t, None)
        out: dict[Tensor, np.ndarray] = {}
        if plan.outs is None:
            home = plan.assignment
            plan.outs = [(self.backends[bi], [o for o in graph.outputs if home[o] == bi])
                         for bi in dict.fromkeys(home[o] for o in graph.outputs)]
        for be, outs in plan.outs:  # one batch (one wait) a backend
            for o, v in zip(outs, be.to_host_batch([vals[o] for o in outs])):
                out[o] = np.asarray(v)
        return out

    def _copy_inputs(self, s: Split, be: Backend, host_in: bool, ins: list[tuple[Tensor, Backend, bool]],
                     vals: dict[Tensor, Any], copies: dict[tuple[Tensor, int, bool], Any]) -> dict[Tensor, Any]:
        """Copy split `s`'s inputs that are not in `copies` yet (ggml_backend_sched_compute_splits'
        input copies). Device-to-device where `be` offers it; the rest through the host, read back
        as ONE batch per source device (its copies queued together, then one wait: the boundary's
        one synchronisation) and sent on as uploads, which a device queues without waiting.
        Returns the values the split reads that are not `vals`' own (a host value a plan copies
        in itself is: a decode step's inputs to a GPU plan swap nothing)."""
        via_host: dict[int, list[tuple[tuple[Tensor, int, bool], Tensor, Any, Backend]]] = {}
        for inp, src, src_host in ins:
            key = (inp, s.backend, host_in)  # (a host value serves only the plans taking one)
            if key in copies:
                continue
            value = vals[inp] if inp in vals else inp.root().buffer.storage(inp)  # type: ignore[union-attr]
            if host_in and src_host and isinstance(value, np.ndarray):
                copies[key] = value  # a plan that copies host values in itself (its pinned mirror)
                continue
            v = be.copy_from(src, value)
            if v is not None:
                copies[key] = v
            elif inp.flags & TensorFlag.WEIGHT:
                # a weight kept in host memory, used by an op offloaded to a device (big batches)
                copies[key] = be.from_host(inp.root().buffer.raw(inp), inp)  # type: ignore[union-attr]
            else:
                via_host.setdefault(id(src), []).append((key, inp, value, src))
        for group in via_host.values():
            src = group[0][3]
            hosts = src.to_host_batch([value for _k, _t, value, _s in group])
            for (key, _inp, _v, _s), h in zip(group, hosts):
                h = np.ascontiguousarray(h)
                # a plan taking host values gets the host copy: it goes into the plan's input
                # region (pinned mirror -> arena) with the step's other inputs, no upload first
                copies[key] = h if host_in else be.from_host(h)
        swap = {}
        for inp, _src, _h in ins:
            c = copies[(inp, s.backend, host_in)]
            if vals.get(inp) is not c:
                swap[inp] = c
        return swap

    def _runs(self, plan: Plan) -> list[tuple[Split, Backend, Any, bool, list[tuple[Tensor, Backend, bool]]]]:
        """What `compute` decides once per plan: each split's backend, its compiled plan (made
        now), whether that plan copies host values in itself (the GPU plan's pinned mirror: they
        are handed over as they are, not uploaded first), and each input's home backend and
        whether that is host memory. A decode step then only walks this list."""
        runs = []
        for si, s in enumerate(plan.splits):
            bp = self.backend_plan(plan, si)
            ins = [(inp, self.backends[plan.assignment[inp]],
                    self.backends[plan.assignment[inp]].device.buffer_type().is_host) for inp in s.inputs]
            runs.append((s, self.backends[s.backend], bp, bool(getattr(bp, "host_inputs", False)), ins))
        return runs

    def backend_plan(self, plan: Plan, si: int) -> Any:
        """Split `si`'s compiled plan (ggml_backend_graph_plan_create), made on first use; falsy
        (None, or a refusal saying why) when its backend has none for this split, which then
        runs node by node."""
        if si not in plan.backend_plans:
            s = plan.splits[si]
            plan.backend_plans[si] = self.backends[s.backend].graph_plan_create(s.nodes, split_exports(plan, si),
                                                                                plan_offsets)
        return plan.backend_plans[si]

    # -- debugging -----------------------------------------------------------------------

    def dump(self, graph: Graph, level: int = 1) -> str:
        """ggml's split dump: `## SPLIT #i: BACKEND # n inputs: [name (size)] …`; level 2 adds
        one line per node with its backend."""
        plan = self.reserve(graph)
        lines = []
        for i, s in enumerate(plan.splits):
            be = self.backends[s.backend].name
            ins = " ".join(f"[{t.name} ({_fmt_size(t.nbytes)})]" for t in s.inputs)
            lines.append(f"## SPLIT #{i}: {be} # {len(s.inputs)} inputs: {ins}".rstrip())
            if level >= 2:
                for n in s.nodes:
                    srcs = " ".join(
                        f"{x.name} [{self.backends[plan.assignment[x]].name}]" for x in n.src
                    )
                    lines.append(f"node #{graph.nodes.index(n):4d} ({n.op.name:>14}): {n.name:<24} [{be:>6}] <- {srcs}")
        # what runs each split: a backend's compiled plan (or why it has none)
        for i, s in enumerate(plan.splits):
            summary = self.backends[s.backend].graph_plan_summary(self.backend_plan(plan, i))
            if summary:
                lines.append(f"## PLAN #{i}: {self.backends[s.backend].name} {summary}")
        return "\n".join(lines)


def split_exports(plan: Plan, si: int) -> list[Tensor]:
    """The values of split `si` that outlive it: the graph's outputs and what other splits read."""
    s = plan.splits[si]
    own = set(s.nodes)
    exports = [n for n in plan.graph.outputs if n in own]
    for other in plan.splits:
        if other is not s:  # (each once: a value two nodes read is copied out once)
            exports += dict.fromkeys(x for n in other.nodes for x in n.src if x in own and x not in exports)
    return exports


def _fmt_size(n: int) -> str:
    return f"{n / 1024:.0f}K" if n >= 1024 else f"{n}B"


def split_printer(sched: Scheduler, level: int, emit: Callable[[str], None]) -> Callable[[Plan], None]:
    """A `debug_hook` that hands `emit` (the CLI's stderr logger) the split dump of every distinct
    graph once: a graph rebuilt with the same shape dumps the same text and is not repeated."""
    seen: set[str] = set()

    def show(plan: Plan) -> None:
        text = sched.dump(plan.graph, level)
        if text in seen:
            return
        seen.add(text)
        emit(f"sched: graph #{len(seen) - 1}: {len(plan.graph.nodes)} nodes, {len(plan.splits)} splits")
        emit(text)

    return show


def debug_level() -> int:
    try:
        return int(os.environ.get("LLAMAPY_SCHED_DEBUG", "0"))
    except ValueError:
        return 0
