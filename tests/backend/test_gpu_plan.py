"""The compiled GPU split (backend/gpu_plan.py) checked on the CPU, without CuPy.

A fake runtime plays the device: its "device memory" is host memory (the CPU backend's buffers and
an executor.Arena), its capture records the launches and its replay runs them, and each launch
runs the record through the CPU executor's C code (kernels_c/executor.c, one record at a time; a
MUL_MAT_W as the q8 mode's QUANTIZE + MUL_MAT_Q). So the GPU plan's records, launch order, arena
offsets, input region (one copy a step from the mirror), count slots and graph replay are run for
real and give the CPU executor's logits bit for bit, and its records are compared with the CPU
executor's for the same split. What this cannot check is the CUDA kernels themselves
(tests/gpu/, on a GPU).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from llamapy.backend import gpu_plan, native
from llamapy.backend.cpu import CPU_BUFT, CPUBackend
from llamapy.backend.executor import (ATTN, GET_ROWS_F32, MUL_MAT_Q, QUANT_ACT, REC, ROPE, Arena, ExecPlan, Loc,
                                      Refusal, Refused, _array_loc, _lib, _Slot)
from llamapy.backend.gpu_plan import COUNT, GET_ROWS_W, HEAD, MUL_MAT_W, GPUPlan
from llamapy.backend.cpu_kernels import KV_CODES
from llamapy.backend.kernels import rope_consts
from llamapy.context import Context, ContextOptions, Model
from llamapy.types import GGMLType

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"no C kernels: {native.error()}")


class FakeRuntime:
    """gpu_plan.Runtime over host memory; launches run through executor.c record by record."""

    def __init__(self, fail_capture: str = "") -> None:
        self.buft = CPU_BUFT
        self.max_tokens = 8
        self.arena = Arena()
        self.lib = _lib()
        self.mirror = np.zeros(0, np.uint8)
        self.log: list[tuple[str, Any]] = []  # ("h2d", nbytes), ("capture", n), ("replay", n), ("launch", code)
        self.fail_capture = fail_capture
        self.scratch = np.zeros(0, np.uint8)
        self.keep: list[Any] = []

    def array_loc(self, v: Any) -> Loc:
        if not isinstance(v, np.ndarray):
            raise Refused(f"a {type(v).__name__} where a device array is needed")
        return _array_loc(v)

    def weight(self, v: Any) -> tuple[int, int, int, int, int]:
        if isinstance(v, np.ndarray) or v.repacked:
            raise Refused("not a matrix of file blocks")
        return v.data.ctypes.data, int(v.qtype), v.n_out, v.n_in, v.data.shape[1]

    def host(self, v: Any) -> np.ndarray:
        return np.asarray(v)

    def const(self, a: np.ndarray) -> tuple[int, Any]:
        a = np.ascontiguousarray(a)
        return a.ctypes.data, a

    def pinned(self, nbytes: int) -> np.ndarray:
        if nbytes > self.mirror.size:
            self.mirror = np.zeros(nbytes, np.uint8)
        return self.mirror

    def h2d(self, dst: int, src: np.ndarray) -> None:
        self.log.append(("h2d", src.nbytes))
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def d2d(self, dst: int, value: Any) -> None:
        v = np.ascontiguousarray(value)
        ctypes.memmove(dst, v.ctypes.data, v.nbytes)

    def copy_out(self, addr: int, slot: _Slot) -> Any:
        a = self.arena
        return np.ndarray(slot.shape, slot.dtype, buffer=a.raw, offset=addr - a.base + a.pad, strides=slot.strides).copy()

    def capture(self, launches: Sequence[Callable[[], None]]) -> Any:
        if self.fail_capture:
            raise Refused(self.fail_capture)
        self.log.append(("capture", len(launches)))
        return list(launches)

    def replay(self, graph: Any) -> None:
        self.log.append(("replay", len(graph)))
        for launch in graph:
            launch()

    def attn_split(self, n_tokens: int, n_head: int, n_head_kv: int, n_cells: int, dv: int) -> tuple[int, int]:
        return 1, 0

    def prepare(self, rec: np.ndarray) -> Callable[[], None]:
        r = rec.copy()
        code = int(r[0])
        if code == ROPE:  # the CPU's table of inverse frequencies from the GPU record's base, scale, factors
            n_dims = int(r[11])
            f = None
            if r[4]:
                f = np.ctypeslib.as_array((ctypes.c_float * (n_dims // 2)).from_address(int(r[4])))
            base, scale = (float(np.int64(v).view(np.float64)) for v in r[13:15])
            inv = rope_consts(n_dims, base, scale, f)
            self.keep.append(inv)
            r[4], r[13], r[14] = inv.ctypes.data, 0, 0

        def run(recs: list[np.ndarray]) -> None:
            table = np.ascontiguousarray(np.stack(recs)[:, :REC])
            rc = self.lib.lp_exec_run(table.ctypes.data, len(table), 1)
            assert rc == 0, f"record {code} failed"

        def launch() -> None:
            self.log.append(("launch", code))
            if code == MUL_MAT_W:  # the q8 mode's two records over a scratch of this runtime's
                n_tok, n_in, xs, qtype, n_out, row_bytes = (int(x) for x in r[6:12])
                need = int(self.lib.lp_act_row_bytes(qtype, n_in)) * n_tok
                if self.scratch.size < need:
                    self.scratch = np.zeros(need + 64, np.uint8)
                q, m = np.zeros(REC, np.int64), np.zeros(REC, np.int64)
                q[[0, 1, 2, 6, 7, 8, 9]] = QUANT_ACT, self.scratch.ctypes.data, r[2], qtype, xs, n_in, n_tok
                m[[0, 1, 2, 3, 6, 7, 8, 9, 10, 11]] = MUL_MAT_Q, r[1], r[3], self.scratch.ctypes.data, qtype, n_out, \
                    row_bytes, n_in, n_tok, n_out
                run([q, m])
            elif code == GET_ROWS_W:  # ops.c's expansion of F16/Q8_0/Q4_0 rows (the CPU executor's)
                g = np.zeros(REC, np.int64)
                g[[0, 1, 2, 3, 6, 7, 8, 9, 10]] = GET_ROWS_F32, r[1], r[2], r[3], r[6], r[7], r[8], r[9], \
                    KV_CODES[GGMLType(int(r[10]))]
                run([g])
            elif code == ATTN and r[COUNT]:
                a = r.copy()
                a[9] = ctypes.c_int32.from_address(int(r[COUNT])).value  # the cells attended, from "device memory"
                run([a])
            else:
                run([r])

        return launch


def _gpu_backend(monkeypatch: pytest.MonkeyPatch, rt_of: Callable[[], FakeRuntime]) -> list[GPUPlan]:
    """CPU backends whose plans are GPU plans over a fake runtime (one per backend)."""
    made: list[GPUPlan] = []

    def create(self: CPUBackend, nodes: Any, exports: Any, allocate: Any) -> Any:
        if not hasattr(self, "_fake_rt"):
            self._fake_rt = rt_of()
        p = gpu_plan.compile_split(nodes, exports, allocate, self._fake_rt)
        if p:
            made.append(p)
        return p

    monkeypatch.setattr(CPUBackend, "graph_plan_create", create)
    monkeypatch.setattr(CPUBackend, "graph_plan_compute", lambda self, plan, env: plan.compute(env))
    monkeypatch.setattr(CPUBackend, "graph_plan_summary",
                        lambda self, plan: plan.summary() if plan else f"refused: {plan.reason}")
    return made


def _decode_steps() -> list[tuple[list[int], list[int], int, list[bool] | None]]:
    """A 4-token prompt, decode steps of one token, a second sequence sharing the cache (2 tokens a
    step, then a 300-token prompt: past the 8 tokens the product kernels take, so node by node),
    and decode again past 256 cells, a wider mask (the same plan and graph)."""
    out: list[tuple[list[int], list[int], int, list[bool] | None]] = [([1, 40, 90, 7], [0, 1, 2, 3], 0, None)]
    out += [([10 + i], [4 + i], 0, None) for i in range(3)]
    out += [([1, 66], [0, 1], 1, [True, True])]
    out += [([(7 * i) % 250 + 1 for i in range(300)], list(range(2, 302)), 1, None)]
    out += [([30 + i], [7 + i], 0, None) for i in range(2)]
    return out


def test_gpu_plan_gives_the_cpu_executors_logits(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    path = make_llama(qtype=T.Q8_0, rope_freqs=True)
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "1")
    model = Model(path)
    ref = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    want = [ref.decode(t, p, s, w) for t, p, s, w in _decode_steps()]
    rts: list[FakeRuntime] = []

    def new_rt() -> FakeRuntime:
        rts.append(FakeRuntime())
        rts[-1].arena.ensure(16 << 20)  # as large as any plan here: no plan moves (test_arena_growth)
        return rts[-1]

    made = _gpu_backend(monkeypatch, new_rt)
    gpu = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    got = [gpu.decode(t, p, s, w) for t, p, s, w in _decode_steps()]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)  # bit for bit
    assert made and all(isinstance(p, GPUPlan) for p in made)
    # one capture per plan, then replays; one input copy per run; nothing launched outside them
    (rt,) = rts
    kinds = [k for k, _ in rt.log]
    assert kinds.count("capture") == len(made) == sum(p.n_captures for p in made)
    assert kinds.count("h2d") == sum(p.n_runs for p in made) == kinds.count("replay")
    assert all(not p.direct for p in made)
    # several lengths of history (256 and 512 cells attended), one graph: the 1-token plan ran 5
    # times, captured once
    assert max(p.n_runs for p in made) == 5 and all(p.n_captures == 1 for p in made)
    assert gpu.kv.n_used() > 256
    model.free()


def test_uncapturable_plan_launches_directly(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    path = make_llama(qtype=T.Q8_0)
    model = Model(path)
    ref = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    want = [ref.decode(t, p, s, w) for t, p, s, w in _decode_steps()[:3]]
    made = _gpu_backend(monkeypatch, lambda: FakeRuntime(fail_capture="NotImplementedError: cuBLAS in a capture"))
    gpu = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    for (t, p, s, w), b in zip(_decode_steps()[:3], want):
        np.testing.assert_array_equal(gpu.decode(t, p, s, w), b)
    assert made and all("capture failed: NotImplementedError: cuBLAS in a capture" in p.direct for p in made)
    text = gpu.sched.dump(gpu.graph(1, 1).graph)
    assert "direct launches (capture failed: NotImplementedError: cuBLAS in a capture)" in text
    monkeypatch.setenv("LLAMAPY_CUDA_GRAPHS", "0")
    made.clear()
    off = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    off.decode([1, 2, 3], [0, 1, 2])
    assert made and all(p.direct == "LLAMAPY_CUDA_GRAPHS=0" for p in made)
    model.free()


def test_records_are_the_cpu_executors(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The same split compiled by both targets: the same records in the same order at the same
    arena offsets (shifted by the GPU's count slots), the products as MUL_MAT_W and the q8 mode's
    QUANTIZE records gone; the inputs lie first, in one region; every ATTN record's count slot."""
    from llamapy.sched.alloc import plan_offsets

    model = Model(make_llama(qtype=T.Q8_0, rope_freqs=True))
    ctx = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    ctx.decode([1, 2, 3], [0, 1, 2])
    g = ctx.graph(1, 1).graph
    plan = ctx.sched.reserve(g)
    (split,) = plan.splits
    exports = list(g.outputs)
    cpu = ctx.backends[-1].graph_plan_create(split.nodes, exports, plan_offsets)
    assert isinstance(cpu, ExecPlan)
    rt = FakeRuntime()
    gp = gpu_plan.compile_split(split.nodes, exports, plan_offsets, rt)
    assert isinstance(gp, GPUPlan)
    cb, gb = cpu.base, gp.built.base

    def rel(x: int, base: int, size: int, head: int = 0) -> int | tuple[str, int]:
        return ("arena", x - base - head) if base <= x < base + size else x

    pairs, x_in = [], 0  # (GPU record, CPU record, the input its QUANTIZE read)
    for c in cpu.recs:
        if c[0] == QUANT_ACT:
            x_in = int(c[2])
        else:
            pairs.append((c, x_in))
    assert len(pairs) == len(gp.recs)
    n_attn = 0
    for r, (c, x_in) in zip(gp.recs, pairs):
        if r[0] == MUL_MAT_W:
            assert c[0] == MUL_MAT_Q
            assert rel(int(r[2]), gb, gp.built.nbytes, HEAD) == rel(x_in, cb, cpu.nbytes)  # the same input
            assert rel(int(r[1]), gb, gp.built.nbytes, HEAD) == rel(int(c[1]), cb, cpu.nbytes)  # destination
            assert (r[3], r[10], r[7], r[6]) == (c[2], c[7], c[9], c[10])  # weight, rows, n_in, tokens
            continue
        if r[0] == GET_ROWS_W:  # the token rows: the CPU's native expansion of the file's Q8_0 rows
            assert c[0] == GET_ROWS_F32
            assert rel(int(r[1]), gb, gp.built.nbytes, HEAD) == rel(int(c[1]), cb, cpu.nbytes)
            assert rel(int(r[3]), gb, gp.built.nbytes, HEAD) == rel(int(c[3]), cb, cpu.nbytes)
            assert (r[2], r[6], r[7], r[8], r[9]) == (c[2], c[6], c[7], c[8], c[9])
            continue
        assert r[0] == c[0], (r[0], c[0])
        assert r[COUNT] == (gb if r[0] == ATTN else 0)  # (one mask: its count slot is the arena's first)
        n_attn += r[0] == ATTN
        for s in range(1, REC):
            if r[0] == ROPE and s in (4, 13, 14):
                continue  # the CPU's table of inverse frequencies; the GPU's factors, base and scale
            if r[0] == ATTN and s in (9, 16):
                continue  # the CPU writes the width attended here; the GPU reads its count slot
            assert rel(int(r[s]), gb, gp.built.nbytes, HEAD) == rel(int(c[s]), cb, cpu.nbytes), (r[0], s)
    assert n_attn == 2
    rope = [r for r in gp.recs if r[0] == ROPE]
    assert rope and all(r[4] and np.int64(r[13]).view(np.float64) == 10000.0 for r in rope)  # rope_freqs, base
    # the inputs (tokens' rows, positions, cells, mask) are one region at the arena's start
    offs = sorted(s.off for _t, s in gp.built.inputs) + [s.off for _t, s, _r in gp.built.masks]
    assert min(offs) == HEAD and gp.in_bytes <= max(offs) + 4 * 512 + 64
    assert "one CUDA graph" in gp.summary() and "MUL_MAT:" in gp.summary()
    model.free()


def test_prompt_batches_are_refused(make_llama) -> None:  # noqa: ANN001
    from llamapy.sched.alloc import plan_offsets

    model = Model(make_llama(qtype=T.Q8_0))
    ctx = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    g = ctx.graph(20, 1).graph
    (split,) = ctx.sched.reserve(g).splits
    p = gpu_plan.compile_split(split.nodes, list(g.outputs), plan_offsets, FakeRuntime())
    assert isinstance(p, Refusal) and "a batch of 20 tokens (prompts stay on the cuBLAS path)" in p.reason
    model.free()


def test_arena_growth_moves_and_recaptures(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A plan made while the arena was smaller moves its records to the new block and is
    captured again; its logits stay the CPU executor's."""
    model = Model(make_llama(qtype=T.Q8_0))
    ref = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    want = [ref.decode([5], [0]), ref.decode([6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6], 0, [True] * 6),
            ref.decode([12], [7])]
    made = _gpu_backend(monkeypatch, FakeRuntime)
    gpu = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    got = [gpu.decode([5], [0])]
    one = made[0]
    base = one.built.base
    got.append(gpu.decode([6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6], 0, [True] * 6))  # a larger arena
    got.append(gpu.decode([12], [7]))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert one.built.base != base and one.n_captures == 2 and one.n_runs == 2
    model.free()
