"""Compute-buffer planning from tensor lifetimes (ggml-alloc.c's `ggml_gallocr`).

Walks the scheduled graph once, allocating each backend's intermediate tensors at byte offsets
in that backend's compute buffer and freeing them after their last reader, with a best-fit free
list. The result is each tensor's offset and the buffer size each backend needs for this graph
shape — sized before anything runs, reported like llama.cpp's `CPU compute buffer size = … MiB`,
the budget a device's memory pool is limited to, and the arena layout the CPU executor's plan
binds to (backend/executor.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..tensor import Tensor

ALIGN = 32


@dataclass
class _Arena:
    """Offsets in one buffer: a sorted free list of (offset, size) blocks."""

    free: list[tuple[int, int]] = field(default_factory=list)
    top: int = 0  # end of the highest block ever used = the buffer size needed

    def alloc(self, size: int) -> int:
        size = (size + ALIGN - 1) // ALIGN * ALIGN
        best = -1
        for i, (_off, sz) in enumerate(self.free):
            if sz >= size and (best < 0 or sz < self.free[best][1]):
                best = i
        if best >= 0:
            off, sz = self.free.pop(best)
            if sz > size:
                self.free.append((off + size, sz - size))
                self.free.sort()
            return off
        # grow: reuse a free block at the top if there is one
        if self.free and self.free[-1][0] + self.free[-1][1] == self.top:
            off, _ = self.free.pop()
            self.top = off + size
            return off
        off = self.top
        self.top += size
        return off

    def release(self, off: int, size: int) -> None:
        size = (size + ALIGN - 1) // ALIGN * ALIGN
        self.free.append((off, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.free = merged


@dataclass
class Allocation:
    """Where each tensor lives in its backend's compute buffer, and how big each buffer is."""

    sizes: dict[int, int]  # backend -> bytes
    offsets: dict[Tensor, tuple[int, int]]  # tensor -> (backend, byte offset)


def plan_offsets(
    order: Sequence[tuple[int, Tensor | None, Sequence[Tensor]]], outputs: Sequence[Tensor]
) -> Allocation:
    """Byte offsets of every tensor that owns memory, and each backend's buffer size.

    `order` lists, in execution order, (backend, tensor, tensors it reads) for every tensor a
    backend must hold: computed nodes and the copies of split inputs (reading nothing). A
    `None` tensor only reads (a view, or an op writing into a pre-allocated buffer): it keeps
    what it reads alive until then. Views and in-place results share memory and must not be
    listed as owners. A tensor is placed before the tensors read at the same step are released,
    so a result never overlaps its own sources; tensors in `outputs` live to the end.
    """
    last_use: dict[Tensor, int] = {}
    for i, (_b, _t, reads) in enumerate(order):
        for r in reads:
            last_use[r] = i
    for t in outputs:
        last_use[t] = len(order)
    arenas: dict[int, _Arena] = {}
    live: dict[Tensor, tuple[int, int, int]] = {}  # tensor -> (backend, offset, size)
    dying: dict[int, list[Tensor]] = {}
    offsets: dict[Tensor, tuple[int, int]] = {}
    for i, (b, t, _reads) in enumerate(order):
        arena = arenas.setdefault(b, _Arena())
        if t is not None and t not in live:
            live[t] = (b, arena.alloc(t.nbytes), t.nbytes)
            offsets[t] = (b, live[t][1])
            dying.setdefault(max(i, last_use.get(t, i)), []).append(t)
        for d in dying.pop(i, []):
            db, off, size = live.pop(d)
            arenas[db].release(off, size)
    return Allocation({b: a.top for b, a in arenas.items()}, offsets)


