"""The compiled GPU split (backend/gpu_plan.py) checked on the CPU, without CuPy.

A fake runtime plays the device: its "device memory" is host memory (the CPU backend's buffers and
an executor.Arena), its capture records the launches and its replay runs them, and each launch
runs the record through the CPU executor's C code (kernels_c/executor.c, one record at a time; a
MUL_MAT_W as the q8 mode's QUANTIZE + MUL_MAT_Q). So the GPU plan's records, launch order, arena
offsets, input region (one copy a step from the mirror), count slots and graph replay are run for
real and give the CPU executor's logits bit for bit, and its records are compared with the CPU
executor's for the same split.

Then the same records go through cuda_exec's real launch makers into a numpy stand-in of
cuda_ops' launch layer (`NumpyOps`: the same method signatures, pointers, sizes and element / byte
strides, computed with numpy over host memory). A decode through it must give the float32 CPU
path's logits: a wrong stride, a swapped pointer, a mask read with the wrong width or a count slot
not read would not. What this cannot check is the CUDA kernels themselves (tests/gpu/, on a GPU).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from gguf.quants import dequantize

from llamapy.backend import cuda_exec, cuda_ops, gpu_plan, native
from llamapy.backend.cpu import CPU_BUFT, CPUBackend
from llamapy.backend.executor import (ADD, ADD_ID, ARGSORT, ATTN, CLAMP, DIV, GEGLU, GET_ROWS_B, GET_ROWS_F32, RMS_NORM, SET_ROWS,
                                      SOFT_MAX, SUM_ROWS, SWIGLU, MUL_MAT_ID_Q, MUL_MAT_Q, QUANT_ACT, REC, ROPE, Arena,
                                      ExecPlan, Loc, Refusal, Refused, _array_loc, _lib, _Slot)
from llamapy.backend.gpu_plan import (COUNT, GEMM_DIRECT, GET_ROWS_W, HEAD, MOE_SYNC, MUL_MAT_GEMM, MUL_MAT_GLU,
                                      MUL_MAT_ID_GEMM, MUL_MAT_ID_GLU, MUL_MAT_ID_W, MUL_MAT_W, ROPE_QKV, ROUTER,
                                      ROUTER_TOPK, WIDTH, GPUPlan)
from llamapy.backend.cpu_kernels import KV_CODES
from llamapy.backend.kernels import _rope_tables_compute, gelu, rope_consts
from llamapy.context import Context, ContextOptions, Model
from llamapy.types import GGMLType
from gpu_fake import HostRuntime, use_test_device_plans

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"no C kernels: {native.error()}")


class FakeRuntime(HostRuntime):
    """gpu_plan.Runtime over host memory (tests/gpu_fake.py); launches run through executor.c
    record by record."""

    def __init__(self, fail_capture: str = "") -> None:
        super().__init__(fail_capture)
        self.lib = _lib()
        self.scratch = np.zeros(0, np.uint8)

    def _rope_qkv(self, rec: np.ndarray) -> Callable[[], None]:
        """ROPE(Q), ROPE(K) into a buffer, SET_ROWS(K) from it, SET_ROWS(V): the records fused."""
        from llamapy.quants import hadamard

        r = [int(x) for x in rec]
        T, H, D, Hkv, Dv = r[6], r[7], r[8], r[15], r[16]
        k_out = np.zeros((T, Hkv, D), np.float32)
        self.keep.append(k_out)
        q, k, sk, sv = (np.zeros(WIDTH, np.int64) for _ in range(4))
        q[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]] = ROPE, r[1], r[2], r[3], r[17], T, H, D, r[9], D, \
            r[11], r[12], r[13], r[14], r[27]
        k[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]] = ROPE, k_out.ctypes.data, r[5], r[3], r[17], T, \
            Hkv, D, r[9], D, r[11], r[12], r[13], r[14], r[27]

        def rot_bits(rot: int) -> int:
            return int(np.float64(hadamard(rot)[0, 0]).view(np.int64)) if rot else 0

        sk[[0, 1, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13]] = SET_ROWS, r[19], r[4], k_out.ctypes.data, T, Hkv * D, \
            Hkv * D, r[18], r[20], r[21], r[22], rot_bits(r[22])
        sv[[0, 1, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13]] = SET_ROWS, r[23], r[4], r[10], T, Hkv * Dv, r[9], r[18], \
            r[24], r[25], r[26], rot_bits(r[26])
        parts = [self.prepare(x) for x in (q, k, sk, sv)]

        def launch() -> None:
            self.log.append(("launch", ROPE_QKV))
            for p in parts:
                p()

        return launch

    def prepare(self, rec: np.ndarray) -> Callable[[], None]:
        if int(rec[0]) == ROPE_QKV:  # the four records it stands for
            return self._rope_qkv(rec)
        r = rec.copy()
        code = int(r[0])
        if code == MUL_MAT_ID_GEMM:  # a prompt's experts: the decode record's q8 path (any number of tokens)
            code = r[0] = MUL_MAT_ID_GLU if r[23] & 1 else MUL_MAT_ID_W
        if code == ROPE:  # the CPU's table of inverse frequencies from the GPU record's base, scale, factors
            n_dims = int(r[11])
            f = None
            if r[4]:
                f = np.ctypeslib.as_array((ctypes.c_float * (n_dims // 2)).from_address(int(r[4])))
            base, scale = (float(np.int64(v).view(np.float64)) for v in r[13:15])
            inv = rope_consts(n_dims, base, scale, f)
            if r[15]:  # YaRN: the device table's first four floats are rope_consts' tail
                inv[-4:] = np.ctypeslib.as_array((ctypes.c_float * 5).from_address(int(r[15])))[:4]
            self.keep.append(inv)
            r[4], r[13], r[14], r[15] = inv.ctypes.data, 0, 0, 0

        def run(recs: list[np.ndarray]) -> None:
            table = np.ascontiguousarray(np.stack(recs)[:, :REC])
            rc = self.lib.lp_exec_run(table.ctypes.data, len(table), 1)
            assert rc == 0, f"record {code} failed"

        def launch() -> None:
            self.log.append(("launch", code))
            if code in (MUL_MAT_W, MUL_MAT_GLU, MUL_MAT_GEMM):  # the q8 mode's two records over a scratch of this
                # runtime's (a prompt's GEMM too: this fake checks the plan's plumbing bit for bit; the f16
                # GEMM's arithmetic is LaunchRuntime's and the emulator's)
                n_tok, n_in, xs, qtype, n_out, row_bytes = (int(x) for x in r[6:12])
                glu = int(r[12]) if code == MUL_MAT_GLU else int(r[12]) - 1 if code == MUL_MAT_GEMM else -1
                if glu >= 0:  # the product of 2 n_ff rows into a buffer, then the GLU
                    n_out *= 2
                    prod = np.zeros((n_tok, n_out), np.float32)
                    self.keep.append(prod)
                need = int(self.lib.lp_act_row_bytes(qtype, n_in)) * n_tok
                if self.scratch.size < need:
                    self.scratch = np.zeros(need + 64, np.uint8)
                q, m = np.zeros(REC, np.int64), np.zeros(REC, np.int64)
                q[[0, 1, 2, 6, 7, 8, 9]] = QUANT_ACT, self.scratch.ctypes.data, r[2], qtype, xs, n_in, n_tok
                m[[0, 1, 2, 3, 6, 7, 8, 9, 10, 11]] = MUL_MAT_Q, r[1] if glu < 0 else prod.ctypes.data, r[3], \
                    self.scratch.ctypes.data, qtype, n_out, row_bytes, n_in, n_tok, n_out
                run([q, m])
                if r[18]:  # the bias epilogue: the ADD record in place (a broadcast row)
                    a = np.zeros(REC, np.int64)
                    a[[0, 1, 2, 3, 6, 7, 8, 9]] = ADD, r[1], r[1], r[18], n_tok, n_out, n_out, 0
                    run([a])
                if glu >= 0:
                    n_ff = n_out // 2
                    if glu == 1:
                        mem(int(r[1]), (n_tok, n_ff), (n_ff, 1), F32)[...] = gelu(np, prod[:, :n_ff]) * prod[:, n_ff:]
                    else:
                        sw = np.zeros(REC, np.int64)
                        sw[[0, 1, 2, 3, 6, 7, 8, 9]] = SWIGLU, r[1], prod.ctypes.data, prod.ctypes.data + 4 * n_ff, \
                            n_tok, n_ff, n_out, n_out
                        run([sw])
            elif code in (MUL_MAT_ID_W, MUL_MAT_ID_GLU):  # the q8 mode's QUANTIZE + MUL_MAT_ID_Q (a GLU after)
                T_, U, M, qtype, n_in, row_bytes, n_exp, sxt, sxu, sid = (int(x) for x in r[6:16])
                X = U if sxu else 1  # the input's rows: one a token, or one a slot
                rows, xs = T_ * X, (sxu or sxt)
                need = int(self.lib.lp_act_row_bytes(qtype, n_in)) * rows
                if self.scratch.size < need:
                    self.scratch = np.zeros(need + 64, np.uint8)
                q = np.zeros(REC, np.int64)
                q[[0, 1, 2, 6, 7, 8, 9]] = QUANT_ACT, self.scratch.ctypes.data, r[2], qtype, xs, n_in, rows
                outs = [int(r[1])] if code == MUL_MAT_ID_W else []
                if code == MUL_MAT_ID_GLU:
                    prod = np.zeros((2, T_ * U, M), np.float32)
                    self.keep.append(prod)
                    outs = [prod[0].ctypes.data, prod[1].ctypes.data]
                recs = [q]
                for out, w in zip(outs, (r[3], r[16])):
                    m = np.zeros(REC, np.int64)
                    m[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]] = MUL_MAT_ID_Q, out, w, self.scratch.ctypes.data, \
                        r[4], qtype, n_exp, M, row_bytes, n_in, X, sid, T_, U
                    recs.append(m)
                for out, b in zip(outs, (r[18], r[20])):  # the experts' biases fused: ADD_ID in place
                    if b:
                        assert r[19] == M  # (executor.c's bias rows: M apart)
                        a = np.zeros(REC, np.int64)
                        a[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10]] = ADD_ID, out, out, b, r[4], T_ * U, M, M, U, sid
                        recs.append(a)
                if code == MUL_MAT_ID_GLU:
                    assert r[17] in (0, 2)  # (SwiGLU or swiglu_oai experts: executor.c's GLU)
                    sw = np.zeros(REC, np.int64)
                    sw[[0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12]] = SWIGLU, r[1], outs[0], outs[1], T_ * U, M, M, M, \
                        int(r[17] == 2), r[21], r[22]
                    recs.append(sw)
                run(recs)
            elif code == ROUTER:  # the six records it stands for, over buffers of this runtime's
                T_, E, sx, U = int(r[6]), int(r[7]), int(r[8]), int(r[10])
                buf = np.zeros((4, T_, E), np.float32)  # probabilities, chosen ones, sum, clamp
                self.keep.append(buf)
                pr, w, sm, cl = (buf[k].ctypes.data for k in range(4))
                recs = [np.zeros(REC, np.int64) for _ in range(6)]
                recs[0][[0, 1, 2, 6, 7, 8, 9]] = SOFT_MAX, pr, r[2], T_, E, sx, r[9]
                recs[1][[0, 1, 2, 6, 7, 8]] = ARGSORT, r[3], pr, T_, E, E
                recs[2][[0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12]] = GET_ROWS_B, w, pr, r[3], T_, U, 1, E, 1, E, E
                recs[3][[0, 1, 2, 6, 7, 8]] = SUM_ROWS, sm, w, T_, U, U
                recs[4][[0, 1, 2, 6, 7, 8, 9, 10]] = CLAMP, cl, sm, T_, 1, 1, r[11], r[12]
                recs[5][[0, 1, 2, 3, 6, 7, 8, 9, 10]] = DIV, r[1], w, cl, T_, U, U, 1, 1
                run(recs)
            elif code == ROUTER_TOPK:  # the three records it stands for, the chosen logits in a buffer
                T_, E, sx, U = int(r[6]), int(r[7]), int(r[8]), int(r[10])
                buf = np.zeros((T_, U), np.float32)
                self.keep.append(buf)
                recs = [np.zeros(REC, np.int64) for _ in range(3)]
                recs[0][[0, 1, 2, 6, 7, 8]] = ARGSORT, r[3], r[2], T_, E, sx
                recs[1][[0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12]] = GET_ROWS_B, buf.ctypes.data, r[2], r[3], T_, U, 1, sx, 1, E, E
                recs[2][[0, 1, 2, 6, 7, 8, 9]] = SOFT_MAX, r[1], buf.ctypes.data, T_, U, U, r[9]
                run(recs)
            elif code == GET_ROWS_W:  # ops.c's expansion of F16/Q8_0/Q4_0 rows (the CPU executor's)
                g = np.zeros(REC, np.int64)
                g[[0, 1, 2, 3, 6, 7, 8, 9, 10]] = GET_ROWS_F32, r[1], r[2], r[3], r[6], r[7], r[8], r[9], \
                    KV_CODES[GGMLType(int(r[10]))]
                run([g])
            elif code == GEGLU:  # (the GPU's record has no GELU table for executor.c): kernels.py's, as run_nodes
                rows, n = int(r[6]), int(r[7])
                g, u = (mem(int(r[k]), (rows, n), (int(r[j]), 1), F32) for k, j in ((2, 8), (3, 9)))
                mem(int(r[1]), (rows, n), (n, 1), F32)[...] = gelu(np, g) * u
            elif code == ATTN and r[COUNT]:
                a = r.copy()
                a[9] = ctypes.c_int32.from_address(int(r[COUNT])).value  # the cells attended, from "device memory"
                run([a])
            else:
                run([r])

        return launch


def _refusals(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reasons of every split the GPU plan compiler refuses from now on."""
    refusals: list[str] = []
    real = gpu_plan.compile_split

    def spy(*a: Any, **k: Any) -> Any:
        p = real(*a, **k)
        refusals.extend([] if p else [p.reason])
        return p

    monkeypatch.setattr(gpu_plan, "compile_split", spy)
    return refusals


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
    def compute(self: CPUBackend, plan: GPUPlan, env: dict[Any, Any]) -> None:
        plan.compute(env)
        for t, _slot in plan.built.exports:  # (the host reads them as arrays: a device's read would be in place)
            env[t] = env[t].own()

    monkeypatch.setattr(CPUBackend, "graph_plan_compute", compute)
    monkeypatch.setattr(CPUBackend, "graph_plan_summary",
                        lambda self, plan: plan.summary() if plan else f"refused: {plan.reason}")
    return made


def _decode_steps() -> list[tuple[list[int], list[int], int, list[bool] | None]]:
    """A 4-token prompt, decode steps of one token, a second sequence sharing the cache (2 tokens a
    step, then a 300-token prompt: past the 8 tokens the product kernels take, so a prompt plan of
    GEMMs, launched directly),
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
        rts[-1].arena.ensure(64 << 20)  # as large as any plan here: no plan moves (test_arena_growth)
        return rts[-1]

    made = _gpu_backend(monkeypatch, new_rt)
    gpu = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    got = [gpu.decode(t, p, s, w) for t, p, s, w in _decode_steps()]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)  # bit for bit
    assert made and all(isinstance(p, GPUPlan) for p in made)
    # the decode plans: one capture per plan, then replays; one input copy per run; nothing
    # launched outside them. The prompt's plan (GEMMs): launched directly, never captured
    (rt,) = rts
    kinds = [k for k, _ in rt.log]
    decode = [p for p in made if not p.direct]
    (prompt,) = [p for p in made if p.direct]
    assert prompt.direct == GEMM_DIRECT and prompt.n_runs == 1 and prompt.n_captures == 0
    gemm = prompt.recs[prompt.recs[:, 0] == MUL_MAT_GEMM]
    assert len(gemm) and (gemm[:, 6] == 300).all()  # (the last layer after the output rows: 1 token, mmv)
    assert (prompt.recs[np.isin(prompt.recs[:, 0], [MUL_MAT_W, MUL_MAT_GLU]), 6] == 1).all()
    assert kinds.count("capture") == len(decode) == sum(p.n_captures for p in made)
    assert kinds.count("h2d") == sum(p.n_runs for p in made) == kinds.count("replay") + 1
    assert not any((p.recs[:, 0] == MUL_MAT_GEMM).any() for p in decode)
    # several lengths of history (256 and 512 cells attended), one graph: the 1-token plan ran 5
    # times, captured once
    assert max(p.n_runs for p in made) == 5 and all(p.n_captures == 1 for p in decode)
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
    QUANTIZE records gone; the inputs lie first, in one region; every ATTN record's count slot.
    Then with the GPU's gate/up + GLU fusion (which the CPU has not): one record less per layer,
    the GLU's result never over the product's input (the kernel reads it to the end); and with
    ROPE(Q), ROPE(K) + its store and V's store as one ROPE_QKV record."""
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
    monkeypatch.setattr(gpu_plan.GPUTarget, "fuse_glu", False)
    monkeypatch.setattr(gpu_plan, "_fuse_rope_qkv", lambda recs, exports: recs)
    gp = gpu_plan.compile_split(split.nodes, exports, plan_offsets, rt)
    monkeypatch.undo()
    fused = gpu_plan.compile_split(split.nodes, exports, plan_offsets, FakeRuntime())
    assert isinstance(gp, GPUPlan) and isinstance(fused, GPUPlan)
    glu = fused.recs[fused.recs[:, 0] == MUL_MAT_GLU]
    qkv = fused.recs[fused.recs[:, 0] == ROPE_QKV]
    assert len(glu) == len(qkv) == 2 and len(fused.recs) == len(gp.recs) - 2 - 2 * 3
    for r in glu:
        y, x = int(r[1]), int(r[2])
        assert y + 4 * r[6] * r[10] <= x or x + 4 * r[6] * r[7] <= y
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


@pytest.mark.parametrize("v_type", [None, T.Q6_K], ids=["fused-qkv", "q6k-v"])
def test_int8_products_above_the_threshold(make_llama, monkeypatch: pytest.MonkeyPatch, v_type: Any) -> None:  # noqa: ANN001
    """In the q8 mode (the default) a decode product of a matrix of MMVQ_MIN_WEIGHTS or more is a
    QUANTIZE_Q8_1 record (x into the plan's q8_1 scratch, after the values, in the arena, moved
    with it) and a MUL_MAT_Q8 over it (the gate/up one with its GLU); smaller ones stay MUL_MAT_W /
    MUL_MAT_GLU. A later product of the same input reuses its copy whatever its size (Q4_K_M's
    layout: attn_v in Q6_K, so Q, K and V are three products, ROPE(Q) between them). The f32 mode
    (--f32-activations) has no int8 record."""
    from llamapy.sched.alloc import plan_offsets

    model = Model(make_llama(qtype=T.Q4_K, v_type=v_type, tied=False))
    ctx = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    g = ctx.graph(1, 1).graph
    (split,) = ctx.sched.reserve(g).splits
    n_embd = 256
    monkeypatch.setattr(gpu_plan, "MMVQ_MIN_WEIGHTS", n_embd * n_embd)  # attn_q, attn_output, gate/up, down, output
    p = gpu_plan.compile_split(split.nodes, list(g.outputs), plan_offsets, FakeRuntime())
    f32 = gpu_plan.compile_split(split.nodes, list(g.outputs), plan_offsets, FakeRuntime(), "f32")
    assert isinstance(p, GPUPlan) and isinstance(f32, GPUPlan)
    assert not np.isin(f32.recs[:, 0], (gpu_plan.QUANTIZE_Q8_1, gpu_plan.MUL_MAT_Q8)).any()
    codes = [int(c) for c in p.recs[:, 0]]
    prods = [(i, r) for i, r in enumerate(p.recs) if r[0] in (MUL_MAT_W, MUL_MAT_GLU, gpu_plan.MUL_MAT_Q8)]
    shared = 0
    b = p.built

    def made(j: int) -> tuple[int, int] | None:
        """(the q8_1 copy's address, the value copied) of a record that makes one: a QUANTIZE_Q8_1,
        or an RMS_NORM the QUANTIZE_Q8_1 of its result joined (slot 16)"""
        q = p.recs[j]
        if q[0] == gpu_plan.QUANTIZE_Q8_1:
            return int(q[1]), int(q[2])
        return (int(q[16]), int(q[1])) if q[0] == RMS_NORM and q[16] else None

    for i, r in prods:
        rows = int(r[10]) * (2 if r[0] == MUL_MAT_GLU or (r[0] == gpu_plan.MUL_MAT_Q8 and r[12]) else 1)
        big = rows * int(r[7]) >= n_embd * n_embd
        if r[0] != gpu_plan.MUL_MAT_Q8:
            assert not big, (i, rows)
            continue
        q = p.recs[i - 1]
        if made(i - 1):
            assert big and made(i - 1)[0] == int(r[2]) and (q[6], q[7]) == (r[6], r[7])
            x = made(i - 1)[1]
        else:  # the copy made for Q (the same input), no other copy made since
            last = max(j for j in range(i) if made(j))
            assert made(last)[1] == x and not big
            shared += 1
        assert b.base + b.nbytes >= int(r[2]) + cuda_ops.q8_1_bytes(int(r[6]), int(r[7]))
        assert int(r[2]) >= max(int(o[1]) + 4 * int(o[6]) * int(o[10]) for _j, o in prods)  # after the values
    n_q8 = codes.count(gpu_plan.MUL_MAT_Q8)
    # per layer q (+ k and v on its copy when unfused), output projection, gate/up, down; the output
    assert n_q8 == 2 * (3 + (3 if v_type else 1)) + 1 and shared == (4 if v_type else 0)
    # the copies of the layers' two norms' results and the output norm's are made by the norms
    fused = [i for i, r in enumerate(p.recs) if r[0] == RMS_NORM and r[16]]
    assert len(fused) == 2 * 2 + 1 and codes.count(gpu_plan.QUANTIZE_Q8_1) == n_q8 - shared - len(fused)
    moved = {(int(i), int(j)) for i, j in zip(*b.moves)}
    k = codes.index(gpu_plan.QUANTIZE_Q8_1)
    assert {(k, 1), (k, 2), (k + 1, 1), (k + 1, 2)} <= moved and all((i, 16) in moved for i in fused)
    assert "QUANTIZE(q8_1):" in p.summary() and "MUL_MAT(q8_1):" in p.summary()
    model.free()


def _step_scratches(nodes: Sequence[Any], exports: Sequence[Any], rt: Any, cpu_matmul: str = "q8") -> int:
    """Check the rule of a step's scratches (GPUTarget.step_scratch) from the compiler's steps and
    offsets: each 256-byte aligned, inside the arena, overlapping no value alive during its step
    (from its step, or the start for an input, to its last reader, or the end for an export) nor
    another scratch of that step. The number of scratches checked."""
    from llamapy.backend.executor import _Compiler
    from llamapy.sched.alloc import plan_offsets

    t = gpu_plan.GPUTarget(rt, cpu_matmul == "q8")
    c = _Compiler(nodes, exports, t, plan_offsets)
    c.steps_pass()
    offsets = c.alloc()
    nbytes = t.scratch(c, c.arena_size)
    born = {v: -1 for v in c.inputs}
    last: dict[Any, int] = {}
    for i, st in enumerate(c.steps):
        for v in (st.node, st.extra.get("add")):
            if v is not None and v in offsets:
                born.setdefault(v, i)
        for r in [*st.reads, *([st.extra["add"]] if "add" in st.extra else [])]:
            last[c._base(r)] = i
    for e in exports:
        last[c._base(e)] = len(c.steps)
    n = 0
    for i, st in enumerate(c.steps):
        sizes = t.step_scratch(c, st)
        spans = [(o, o + sz) for o, sz in zip(st.scratch, sizes) if sz]
        alive = [(offsets[v], offsets[v] + v.nbytes, v.name) for v, b in born.items() if b <= i <= last.get(v, b)]
        for k, (lo, hi) in enumerate(spans):
            assert lo % 256 == 0 and HEAD <= lo < hi <= nbytes, (st.node.name, lo, hi, nbytes)
            assert not [a for a in alive if a[0] < hi and lo < a[1]], (st.node.name, k)
            assert all(hi <= lo2 or hi2 <= lo for lo2, hi2 in spans[k + 1:]), (st.node.name, k)
            n += 1
    return n


def test_prompt_batches_are_gemm_plans(make_llama) -> None:  # noqa: ANN001
    """A batch past the matrix-vector kernels' 8 tokens: every product a MUL_MAT_GEMM record (the
    gate/up one with its GLU), its scratches (f16 weight tile, f16 input, the GLU's float32 product,
    the input's scale) the step's own, placed by the allocator among the values in the arena
    (moved with it), launched directly (cuBLAS is not captured)."""
    from llamapy.sched.alloc import plan_offsets

    model = Model(make_llama(qtype=T.Q8_0))
    ctx = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    g = ctx.graph(20, 1).graph
    (split,) = ctx.sched.reserve(g).splits
    rt = FakeRuntime()
    p = gpu_plan.compile_split(split.nodes, list(g.outputs), plan_offsets, rt)
    assert isinstance(p, GPUPlan) and p.direct == GEMM_DIRECT and "direct launches (cuBLAS GEMMs" in p.summary()
    assert rt.arena.size == p.built.nbytes  # no reserve for 8 tokens scaled from the 1-token tail
    gemm = p.recs[p.recs[:, 0] == MUL_MAT_GEMM]
    # every product of the 20 tokens; the last layer after its output row is one token's (mmv)
    assert len(gemm) == 6 and (p.recs[np.isin(p.recs[:, 0], [MUL_MAT_W, MUL_MAT_GLU]), 6] == 1).all()
    assert (gemm[:, 6] == 20).all() and (gemm[:, 13] == gemm[:, 10] * (1 + (gemm[:, 12] > 0))).all()  # one tile
    glu = gemm[gemm[:, 12] > 0]
    assert len(glu) == 1 and glu[0, 12] == 1 and glu[0, 14] > 0  # SwiGLU, the product in its scratch
    b = p.built
    from llamapy.backend.cuda_ops import F16_SCALE_BYTES

    for r in gemm:  # the step's scratches: apart from its input, its result and each other, in the arena
        dst = (int(r[1]), int(r[1]) + 4 * int(r[6]) * int(r[10]))
        src = (int(r[2]), int(r[2]) + 4 * int(r[6]) * int(r[7]))
        mine = [(int(r[4]), 2 * int(r[13]) * int(r[7])), (int(r[5]), 2 * 20 * int(r[7])), (int(r[15]), F16_SCALE_BYTES)]
        mine += [(int(r[14]), 4 * 20 * 2 * int(r[10]))] if r[12] else []
        spans = [(a, a + n) for a, n in mine]
        for k, (lo, hi) in enumerate(spans):
            assert b.base + HEAD <= lo and hi <= b.base + b.nbytes and (lo - b.base) % 256 == 0
            assert all(hi <= o[0] or o[1] <= lo for o in [dst, src, *spans[k + 1:]]), (k, spans)
    moved = {(int(i), int(j)) for i, j in zip(*b.moves)}
    for k in np.nonzero(p.recs[:, 0] == MUL_MAT_GEMM)[0]:
        assert {(k, 1), (k, 2), (k, 4), (k, 5), (k, 15)} | ({(k, 14)} if p.recs[k, 12] else set()) <= moved
    assert _step_scratches(split.nodes, list(g.outputs), FakeRuntime()) >= 6 * 3 + 1
    model.free()


def test_a_prompts_scratches_reuse_the_logits_memory(make_llama) -> None:  # noqa: ANN001
    """ggml-alloc's rule for a step's temporaries: a prompt plan whose logits (n_vocab x tokens)
    dominate its values places the earlier products' f16 scratches in memory the logits take
    later, so its arena is smaller than the values' peak plus the scratches (the layout before,
    scratches after the values); the per-step check holds, and the dry sizing of the fit
    (`arena_bytes`) is the compiled plan's arena byte for byte."""
    from llamapy.backend.executor import _Compiler
    from llamapy.sched.alloc import plan_offsets

    # n_vocab 271 and 256 tokens' logits (277 KB) against rows of 64 (a GLU product of 128 KB)
    model = Model(make_llama(qtype=T.Q8_0, n_embd=64, n_ff=64, n_head=2, n_head_kv=1))
    ctx = Context(model, ContextOptions(n_ctx=256, n_ubatch=256, n_batch=256, n_threads=1))
    g = ctx.graph(256, 256).graph  # every row's logits (the mask: 256 x 256 floats, less)
    (split,) = ctx.sched.reserve(g).splits
    rt = FakeRuntime()
    p = gpu_plan.compile_split(split.nodes, list(g.outputs), plan_offsets, rt)
    assert isinstance(p, GPUPlan) and (p.recs[:, 0] == MUL_MAT_GEMM).sum() >= 6
    t = gpu_plan.GPUTarget(FakeRuntime())
    c = _Compiler(split.nodes, list(g.outputs), t, plan_offsets)
    c.steps_pass()
    c.alloc()
    scratch = [sum(-(-n // 256) * 256 for n in t.step_scratch(c, st)) for st in c.steps]
    order: list[Any] = [(0, v, []) for v in c.inputs]
    for st in c.steps:
        reads = [c._base(r) for r in st.reads]
        if "add" in st.extra:
            order.append((0, st.extra["add"], reads))
            reads.append(st.extra["add"])
        order.append((0, None if st.code == SET_ROWS else st.node, reads))
    values = plan_offsets(order, [c._base(e) for e in g.outputs]).sizes[0] + HEAD
    logits = 4 * 256 * model.params.n_vocab
    assert values >= logits and max(scratch) > 0
    assert p.built.nbytes < values + max(scratch), (p.built.nbytes, values, max(scratch))
    assert _step_scratches(split.nodes, list(g.outputs), FakeRuntime()) > 0
    dry = gpu_plan.arena_bytes(split.nodes, list(g.outputs), plan_offsets, rt.buft, rt.max_tokens, 0)
    assert dry == p.built.nbytes
    model.free()


def test_prompt_weight_tiles_follow_the_weights(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The f16 weight scratch of a plan's GEMMs is 1/32 of the weights its split multiplies
    (cuda_ops.gemm_scratch_budget, within 4..64 MiB: GPU memory is held to llama.cpp's + 10 %):
    with the 4 MiB floor lifted, this tiny model's products are decoded 256 rows at a time."""
    from llamapy.backend import cuda_ops
    from llamapy.sched.alloc import plan_offsets

    assert cuda_ops.gemm_scratch_budget(0) == 4 << 20 and cuda_ops.gemm_scratch_budget(1 << 40) == 64 << 20
    assert cuda_ops.gemm_scratch_budget(32 * (10 << 20)) == 10 << 20
    model = Model(make_llama(qtype=T.Q8_0))
    ctx = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    g = ctx.graph(20, 1).graph
    (split,) = ctx.sched.reserve(g).splits
    tiles = []
    for floor in (cuda_ops.GEMM_SCRATCH_MIN, 1):
        monkeypatch.setattr(cuda_ops, "GEMM_SCRATCH_MIN", floor)
        p = gpu_plan.compile_split(split.nodes, list(g.outputs), plan_offsets, FakeRuntime())
        gemm = p.recs[p.recs[:, 0] == MUL_MAT_GEMM]
        rows = gemm[:, 10] * (1 + (gemm[:, 12] > 0))  # (a GLU's record: half the rows in slot 10)
        tiles.append(gemm[:, 13])
        assert _step_scratches(split.nodes, list(g.outputs), FakeRuntime()) > 0  # (each tile apart: the sizes)
    assert (tiles[0] == rows).all()  # 4 MiB: every product in one tile
    assert (tiles[1] == np.minimum(rows, 256)).all() and (rows > 256).any()  # ~40 KiB: the smallest tiles
    model.free()


def test_arena_growth_moves_and_recaptures(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A plan made while the arena was smaller moves its records to the new block and is
    captured again; its logits stay the CPU executor's."""
    monkeypatch.setattr(gpu_plan, "_reserve_for_largest_batch", lambda built, rt: None)  # (it would not grow)
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


# -- the CUDA launcher's argument plumbing ----------------------------------------------------

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


def mem(addr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, unit: int = 0) -> np.ndarray:
    """An array over `addr`: strides in elements (or in bytes with unit=1)."""
    dt = np.dtype(dtype)
    bstr = tuple(s * (unit or dt.itemsize) for s in strides)
    span = sum((d - 1) * s for d, s in zip(shape, bstr)) + dt.itemsize if all(shape) else 0
    buf = (ctypes.c_char * max(span, 1)).from_address(addr)
    return np.ndarray(shape, dt, buffer=buf, strides=bstr)


class NumpyOps:
    """cuda_ops.CudaKernels' launch methods, in numpy over host addresses (calls recorded)."""

    n_sm = 4

    def __init__(self) -> None:
        self.calls: list[str] = []

    def rms_norm(self, stream: Any, x: int, sx: int, y: int, sy: int, rows: int, n: int, eps: float, *,
                 b: int = 0, sb: int = 0, sum_out: int = 0, ss: int = 0, w: int = 0, tokens: int = 1, sxt: int = 0,
                 syt: int = 0, xq: int = 0) -> None:
        assert not xq, "NumpyOps has no q8_1 copy (the emulator's tests run it)"
        if tokens > 1:
            assert not b and not sum_out
            for t in range(tokens):
                self.rms_norm(stream, x + 4 * t * sxt, sx, y + 4 * t * syt, sy, rows, n, eps, w=w)
            return
        self.calls.append("rms_norm")
        v = mem(x, (rows, n), (sx, 1), F32).copy()
        if b:
            v = v + mem(b, (rows, n), (sb, 1), F32)
        if sum_out:
            mem(sum_out, (rows, n), (ss, 1), F32)[...] = v
        mean = ((v.astype(np.float64) ** 2).sum(-1, keepdims=True) / n).astype(np.float32)
        out = v * (np.float32(1) / np.sqrt(mean + np.float32(eps)))
        if w:
            out = out * mem(w, (n,), (1,), F32)
        mem(y, (rows, n), (sy, 1), F32)[...] = out

    def binary(self, stream: Any, op: str, a: int, sa: int, b: int, sb: int, y: int, sy: int, rows: int, n: int) -> None:
        self.calls.append(op)
        A, B = mem(a, (rows, n), (sa, 1), F32), mem(b, (rows, n), (sb, 1), F32)
        mem(y, (rows, n), (sy, 1), F32)[...] = A + B if op == "add" else A * B

    def scale(self, stream: Any, a: int, sa: int, y: int, sy: int, rows: int, n: int, s: float) -> None:
        self.calls.append("scale")
        mem(y, (rows, n), (sy, 1), F32)[...] = mem(a, (rows, n), (sa, 1), F32) * np.float32(s)

    def glu(self, stream: Any, op: str, g: int, sg: int, u: int, su: int, y: int, sy: int, rows: int, n: int,
            **oai: float) -> None:
        assert op != "swiglu_oai", "NumpyOps has no swiglu_oai (the emulator's tests run it)"
        self.calls.append(op)
        G, U = mem(g, (rows, n), (sg, 1), F32), mem(u, (rows, n), (su, 1), F32)
        mem(y, (rows, n), (sy, 1), F32)[...] = (G / (1 + np.exp(-G)) if op == "swiglu" else gelu(np, G)) * U

    def get_rows_f32(self, stream: Any, t: int, st: int, n_rows: int, ids: int, y: int, sy: int, n_ids: int,
                     n: int) -> None:
        self.calls.append("get_rows_f32")
        i = mem(ids, (n_ids,), (1,), np.int32)
        mem(y, (n_ids, n), (sy, 1), F32)[...] = mem(t, (n_rows, n), (st, 1), F32)[i]

    def get_rows(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_rows: int, ids: int, y: int,
                 sy: int, n_ids: int, n_in: int) -> None:
        self.calls.append("get_rows")
        i = mem(ids, (n_ids,), (1,), np.int32)
        raw = mem(w, (n_rows, row_bytes), (row_bytes, 1), np.uint8)[i]
        mem(y, (n_ids, n_in), (sy, 1), F32)[...] = dequantize(raw, T(int(qtype))).reshape(n_ids, n_in)

    def rope_qkv(self, stream: Any, q: int, k: int, v: int, sxt: int, q_out: int, syt: int, n_tokens: int,
                 n_head: int, n_head_kv: int, head_dim: int, head_dim_v: int, *, pos: int, n_dims: int, mode: int,
                 freq_base: float, freq_scale: float = 1.0, factors: int = 0, ids: int, n_cells: int,
                 k_type: GGMLType, k_cache: int, k_rb: int, k_rot: int = 0, v_type: GGMLType, v_cache: int,
                 v_rb: int, v_rot: int = 0, yarn: int = 0) -> None:
        assert not yarn, "NumpyOps has no YaRN (the emulator's tests run it)"
        rope = dict(pos=pos, n_dims=n_dims, mode=mode, freq_base=freq_base, freq_scale=freq_scale, factors=factors)
        store = dict(ids=ids, n_cells=n_cells)
        self.rope(stream, q, sxt, head_dim, q_out, syt, head_dim, n_tokens, n_head, head_dim, **rope)
        self.rope(stream, k, sxt, head_dim, 0, 0, 0, n_tokens, n_head_kv, head_dim, **rope, **store,
                  cache_type=k_type, cache=k_cache, cache_rb=k_rb, rot=k_rot)
        self.rope(stream, v, sxt, head_dim_v, 0, 0, 0, n_tokens, n_head_kv, head_dim_v, **store, cache_type=v_type,
                  cache=v_cache, cache_rb=v_rb, rot=v_rot)

    @staticmethod
    def _f16_input(v: np.ndarray, scale: int) -> np.ndarray:
        """v rounded to f16 as a GEMM's input: with its scale scratch (`scale`), divided by the
        smallest power of two s >= 1 that brings max |v| within 2^15, s and 0 written there as
        the GEMM's alpha and beta (cuda_ops.to_f16's contract)."""
        if not scale:
            return v.astype(F16)
        m, s = float(np.fmax.reduce(np.abs(v).ravel(), initial=0.0)), 1.0
        while m / s > 2.0**15 and s < 2.0**113:
            s *= 2
        mem(scale, (2,), (1,), F32)[...] = (s, 0.0)
        with np.errstate(over="ignore"):
            return (v / np.float32(s)).astype(F16)

    def to_f16(self, stream: Any, x: int, sx: int, y: int, rows: int, n: int, *, scale: int = 0) -> None:
        self.calls.append("to_f16")
        mem(y, (rows, n), (n, 1), F16)[...] = self._f16_input(mem(x, (rows, n), (sx, 1), F32), scale)

    def dequant_f16(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_rows: int, n_in: int, y: int) -> None:
        self.calls.append("dequant_f16")
        raw = mem(w, (n_rows, row_bytes), (row_bytes, 1), np.uint8)
        mem(y, (n_rows, n_in), (n_in, 1), F16)[...] = dequantize(raw, T(int(qtype))).reshape(n_rows, n_in).astype(F16)

    def gemm_f16(self, stream: Any, a: int, b: int, c: int, m: int, n: int, k: int, ldc: int,
                 batch: tuple[int, int, int, int] | None = None, *, ab: int = 0) -> None:
        """The GEMM of f16 inputs (rounded by to_f16 / dequant_f16) with float32 accumulation:
        here exact sums in float64 times alpha (at `ab`, beta 0; 0: 1), rounded once; `batch`:
        that many, strided."""
        if batch:
            for i in range(batch[0]):
                self.gemm_f16(stream, a + 2 * i * batch[1], b + 2 * i * batch[2], c + 4 * i * batch[3], m, n, k, ldc,
                              ab=ab)  # fmt: skip
            self.calls.append("gemm_f16_batched")
            return
        self.calls.append("gemm_f16")
        alpha, beta = mem(ab, (2,), (1,), F32).astype(np.float64) if ab else (1.0, 0.0)
        assert beta == 0.0
        A, B = mem(a, (m, k), (k, 1), F16).astype(np.float64), mem(b, (n, k), (k, 1), F16).astype(np.float64)
        mem(c, (n, m), (ldc, 1), F32)[...] = (alpha * (B @ A.T)).astype(F32)

    mul_mat_gemm = cuda_ops.CudaKernels.mul_mat_gemm  # the real composition of the three above (and glu)
    mul_mat_id_gemm = cuda_ops.CudaKernels.mul_mat_id_gemm  # and of the MoE ones below

    def reader(self, stream: Any, addr: int, n: int) -> np.ndarray:
        self.calls.append("read")
        return mem(addr, (n,), (1,), np.int32).copy()

    def moe_sort(self, stream: Any, ids: int, sid: int, n_tok: int, n_used: int, n_expert: int, order: int,
                 offs: int) -> None:
        self.calls.append("moe_sort")
        e = mem(ids, (n_tok, n_used), (sid, 1), np.int32).reshape(-1)
        e = np.where((e < 0) | (e >= n_expert), n_expert, e)
        mem(order, (e.size,), (1,), np.int32)[...] = np.argsort(e, kind="stable")
        mem(offs, (n_expert + 2,), (1,), np.int32)[...] = np.concatenate([[0], np.cumsum(np.bincount(e, minlength=n_expert + 1))])

    @staticmethod
    def _moe_rows(order: int, ids: int, sid: int, n_used: int, n_expert: int, at: tuple[int, int],
                  rows: int) -> list[tuple[int, int, int]]:
        """(pair, expert, GEMM row) of each sorted row (moe.cu's moe_gemm_row; -1: none)."""
        offs, pad = at
        out = []
        for r, q in enumerate(mem(order, (rows,), (1,), np.int32).tolist()):
            e = int(mem(ids + 4 * ((q // n_used) * sid + q % n_used), (1,), (1,), np.int32)[0])
            g = r if not pad else -1 if not 0 <= e < n_expert else e * pad + r - int(mem(offs + 4 * e, (1,), (1,), np.int32)[0])
            out.append((q, e, g))
        return out

    def moe_gather_f16(self, stream: Any, x: int, sxt: int, sxu: int, order: int, ids: int, sid: int, n_used: int,
                       n_expert: int, at: tuple[int, int], y: int, rows: int, n: int, *, scale: int = 0) -> None:
        self.calls.append("moe_gather_f16")
        pairs = [mem(x + 4 * ((q // n_used) * sxt + (q % n_used) * sxu), (n,), (1,), F32) for q in range(rows)]
        f16 = self._f16_input(np.stack(pairs), scale)  # (every pair's row, in pair order)
        for q, _e, g in self._moe_rows(order, ids, sid, n_used, n_expert, at, rows):
            if g >= 0:
                mem(y + 2 * g * n, (n,), (1,), F16)[...] = f16[q]

    def moe_scatter(self, stream: Any, prod: int, ldp: int, order: int, ids: int, sid: int, n_used: int, n_expert: int,
                    at: tuple[int, int], y: int, m: int, rows: int, op: int, *, b: int = 0, b2: int = 0, sb: int = 0,
                    alpha: float = 0.0, limit: float = 0.0) -> None:
        from llamapy.backend.kernels import glu as glu_ref

        self.calls.append("moe_scatter")
        for q, e, gr in self._moe_rows(order, ids, sid, n_used, n_expert, at, rows):
            if gr < 0:
                mem(y + 4 * q * m, (m,), (1,), F32)[...] = np.nan
                continue
            P = mem(prod + 4 * gr * ldp, (ldp,), (1,), F32)
            g, u = P[:m].copy(), P[m:2 * m].copy()
            if b:
                g = g + mem(b + 4 * e * sb, (m,), (1,), F32)
            if b2:
                u = u + mem(b2 + 4 * e * sb, (m,), (1,), F32)
            if op >= 0:
                node = type("GLU", (), {"params": {"op": ("swiglu", "geglu", "swiglu_oai")[op], "alpha": alpha,
                                                   "limit": limit}})()  # fmt: skip
                g = glu_ref(node, [g, u], np)
            mem(y + 4 * q * m, (m,), (1,), F32)[...] = g

    def mul_mat_vec_glu(self, stream: Any, op: str, qtype: GGMLType, w: int, row_bytes: int, n_ff: int, n_in: int,
                        x: int, y: int, n_tok: int) -> None:
        prod = np.zeros((n_tok, 2 * n_ff), F32)
        self.mul_mat_vec(stream, qtype, w, row_bytes, 2 * n_ff, n_in, x, prod.ctypes.data, n_tok)
        self.glu(stream, op, prod.ctypes.data, 2 * n_ff, prod.ctypes.data + 4 * n_ff, 2 * n_ff, y, n_ff, n_tok, n_ff)

    def mul_mat_vec(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_out: int, n_in: int, x: int,
                    y: int, n_tok: int, *, b: int = 0) -> None:
        self.calls.append("mul_mat_vec" + ("+bias" if b else ""))
        assert x % 16 == 0 and n_tok <= 8
        W = dequantize(mem(w, (n_out, row_bytes), (row_bytes, 1), np.uint8), T(int(qtype))).reshape(n_out, n_in)
        X = mem(x, (n_tok, n_in), (n_in, 1), F32)
        out = (X.astype(np.float64) @ W.T.astype(np.float64)).astype(F32)
        mem(y, (n_tok, n_out), (n_out, 1), F32)[...] = out + mem(b, (n_out,), (1,), F32) if b else out

    def rope(self, stream: Any, x: int, sxt: int, sxh: int, y: int, syt: int, syh: int, n_tokens: int, n_head: int,
             head_dim: int, *, pos: int = 0, n_dims: int = 0, mode: int = -1, freq_base: float = 10000.0,
             freq_scale: float = 1.0, factors: int = 0, cache_type: GGMLType | None = None, ids: int = 0,
             n_cells: int = 0, cache: int = 0, cache_rb: int = 0, rot: int = 0, yarn: int = 0) -> None:
        assert not yarn, "NumpyOps has no YaRN (the emulator's tests run it)"
        self.calls.append("rope" if mode >= 0 else "set_rows")
        v = mem(x, (n_tokens, n_head, head_dim), (sxt, sxh, 1), F32).copy()
        if mode >= 0:
            f = mem(factors, (n_dims // 2,), (1,), F32) if factors else None
            cos, sin = _rope_tables_compute(np, mem(pos, (n_tokens,), (1,), np.int32), n_dims, freq_base, freq_scale, f)
            cos, sin = cos[:, None, :], sin[:, None, :]
            if mode == 0:
                i0, i1 = slice(0, n_dims, 2), slice(1, n_dims, 2)
            else:
                i0, i1 = slice(0, n_dims // 2), slice(n_dims // 2, n_dims)
            a, b = v[..., i0].copy(), v[..., i1].copy()
            v[..., i0], v[..., i1] = a * cos - b * sin, a * sin + b * cos
        if y:
            mem(y, (n_tokens, n_head, head_dim), (syt, syh, 1), F32)[...] = v
        if cache_type is not None:
            assert cache_type in (GGMLType.F16, GGMLType.F32) and not rot
            dt = F16 if cache_type == GGMLType.F16 else F32
            rows = mem(cache, (n_cells, n_head * head_dim), (cache_rb, dt.itemsize), dt, unit=1)
            rows[mem(ids, (n_tokens,), (1,), np.int64)] = v.reshape(n_tokens, -1).astype(dt)

    def flash_attn_ext(self, stream: Any, q: int, sqt: int, sqh: int, k_type: GGMLType, k: int, k_cb: int,
                       k_hb: int, v_type: GGMLType, v: int, v_cb: int, v_hb: int, n_cells: int, mask: int, sm: int,
                       out: int, sot: int, soh: int, n_tokens: int, n_head: int, n_head_kv: int, head_dim: int,
                       head_dim_v: int, scale: float, *, n_kv: int = 0, n_kv_dev: int = 0, n_splits: int = 1,
                       scratch: int = 0, rot_k: int = 0, rot_v: int = 0, sinks: int = 0) -> None:
        assert not sinks, "NumpyOps has no sinks (the emulator's tests run them)"
        self.calls.append("flash_attn_ext")
        n = ctypes.c_int32.from_address(n_kv_dev).value if n_kv_dev else n_kv
        assert 0 < n <= n_cells
        kd = F16 if k_type == GGMLType.F16 else F32
        vd = F16 if v_type == GGMLType.F16 else F32
        K = mem(k, (n, n_head_kv, head_dim), (k_cb, k_hb, kd.itemsize), kd, unit=1).astype(np.float64)
        V = mem(v, (n, n_head_kv, head_dim_v), (v_cb, v_hb, vd.itemsize), vd, unit=1).astype(np.float64)
        Q = mem(q, (n_tokens, n_head, head_dim), (sqt, sqh, 1), F32).astype(np.float64)
        M = mem(mask, (n_tokens, n), (sm, 1), F32).astype(np.float64)
        g = n_head // n_head_kv
        O = np.zeros((n_tokens, n_head, head_dim_v))
        for h in range(n_head):
            s = Q[:, h] @ K[:, h // g].T * scale + M
            p = np.exp(s - s.max(-1, keepdims=True))
            O[:, h] = (p / p.sum(-1, keepdims=True)) @ V[:, h // g]
        mem(out, (n_tokens, n_head, head_dim_v), (sot, soh, 1), F32)[...] = O.astype(F32)


class LaunchRuntime(FakeRuntime):
    """The fake device, its launches made by cuda_exec's launch makers over NumpyOps."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = NumpyOps()
        self.dev = type("Dev", (), {"stream": None})()

    def attn_split(self, n_tokens: int, n_head: int, n_head_kv: int, n_cells: int, dv: int) -> tuple[int, int]:
        return 1, 0

    def prepare(self, rec: np.ndarray) -> Any:
        return cuda_exec._LAUNCHES[int(rec[0])](self, rec)  # type: ignore[arg-type]


@pytest.mark.parametrize("cache", [GGMLType.F16, GGMLType.F32], ids=["f16", "f32"])
def test_launch_arguments_give_the_reference_logits(make_llama, monkeypatch: pytest.MonkeyPatch,
                                                    cache: GGMLType) -> None:  # noqa: ANN001
    path = make_llama(qtype=T.Q8_0, rope_freqs=True)
    ref_model = Model(path, context_options=ContextOptions(cpu_matmul="f32"))  # float32 activations
    model = Model(path)  # the file's blocks, as a GPU holds them
    opts = dict(n_ctx=512, n_threads=1, type_k=cache, type_v=cache)
    ref = Context(ref_model, ContextOptions(cpu_matmul="f32", **opts))  # type: ignore[arg-type]
    want = [ref.decode(t, p, s, w) for t, p, s, w in _decode_steps()]
    rts: list[LaunchRuntime] = []

    def new_rt() -> LaunchRuntime:
        rts.append(LaunchRuntime())
        rts[-1].arena.ensure(64 << 20)
        return rts[-1]

    made = _gpu_backend(monkeypatch, new_rt)
    gpu = Context(model, ContextOptions(**opts))  # type: ignore[arg-type]
    got = [gpu.decode(t, p, s, w) for t, p, s, w in _decode_steps()]
    for (t, _p, _s, _w), a, b in zip(_decode_steps(), got, want):
        if len(t) > 8:
            continue  # the prompt: node by node, in the q8 mode (another sequence than the steps after it)
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(np.abs(b).max()))
        assert (a.argmax(-1) == b.argmax(-1)).all()
    assert made and all(not p.direct for p in made if not (p.recs[:, 0] == MUL_MAT_GEMM).any())
    calls = set(rts[0].ops.calls)
    assert {"rms_norm", "mul_mat_vec", "rope", "set_rows", "flash_attn_ext", "swiglu", "get_rows"} <= calls
    model.free()
    ref_model.free()


def test_a_launch_the_kernels_refuse_refuses_the_plan(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A kernel that refuses its arguments (UnsupportedError, raised while the launches are
    captured, when the plan is made) leaves the split to run_nodes, and says why."""
    from llamapy.types import UnsupportedError

    class Refusing(FakeRuntime):
        def capture(self, launches: Sequence[Callable[[], None]]) -> Any:
            raise UnsupportedError("CUDA: ROPE of heads of 4096")

    model = Model(make_llama(qtype=T.Q8_0))
    want = Context(model, ContextOptions(n_ctx=512, n_threads=1)).decode([1, 2], [0, 1])
    made = _gpu_backend(monkeypatch, Refusing)
    ctx = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    np.testing.assert_array_equal(ctx.decode([1, 2], [0, 1]), want)  # node by node: the same bits
    assert not made
    assert "refused: CUDA: ROPE of heads of 4096" in ctx.sched.dump(ctx.graph(2, 1).graph)
    model.free()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_families(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """qwen2 (Q/K/V biases), qwen3 (per-head Q/K norms) and gemma3 (GEGLU, a sliding-window mask:
    two masks, two count slots) as GPU plans: the CPU path's logits, bit for bit."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_family_gguf

    model = Model(write_family_gguf(tmp_path / f"{arch}.gguf", arch, qtype=T.Q8_0, n_swa=4))
    steps = [([1, 5, 9, 3], [0, 1, 2, 3], 0, None)] + [([10 + i], [4 + i], 0, None) for i in range(6)]
    ref = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    want = [ref.decode(t, p, s, w) for t, p, s, w in steps]
    made = _gpu_backend(monkeypatch, FakeRuntime)
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    for (t, p, s, w), b in zip(steps, want):
        np.testing.assert_array_equal(ctx.decode(t, p, s, w), b)
    assert made and all(not p.direct for p in made)
    assert all(len(p.built.masks) == (2 if arch == "gemma3" else 1) for p in made)
    model.free()


# -- the real kernels, on the CPU emulator of CUDA (tests/gpu/cuda_emu.py) -----------------------


@pytest.fixture(scope="module")
def emu_functions() -> dict[str, Any]:
    import shutil
    import sys

    if shutil.which("g++") is None:
        pytest.skip("g++ not found: no CPU emulation of the CUDA kernels")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    import cuda_emu

    return cuda_emu.build()


class EmuRuntime(FakeRuntime):
    """The fake device whose launches are made as CUDARuntime makes them (its `prepare`: the
    launch makers' calls recorded by cuda_ops as fixed kernel launches) over cuda_ops' real launch
    layer, the kernels_cuda sources running on the CPU emulator; a capture keeps those launches
    and a replay makes exactly them."""

    prepare = cuda_exec.CUDARuntime.prepare

    def __init__(self, functions: dict[str, Any]) -> None:
        import contextlib

        from llamapy.backend.cuda_ops import CudaKernels

        super().__init__()
        self.ops = CudaKernels(dict(functions), n_sm=4)
        self.dev = type("Dev", (), {"stream": None, "context": staticmethod(lambda what: contextlib.nullcontext())})()

    def attn_split(self, n_tokens: int, n_head: int, n_head_kv: int, n_cells: int, dv: int) -> tuple[int, int]:
        from llamapy.backend.cuda_ops import fattn_scratch_floats, fattn_splits

        n = fattn_splits(n_tokens, n_head_kv, n_cells, self.ops.n_sm)
        return n, 4 * fattn_scratch_floats(n_tokens, n_head, dv, n)

    def capture(self, launches: Sequence[Callable[[], None]]) -> Any:
        self.log.append(("capture", len(launches)))
        return list(launches)


def _logged_emu_runtime(functions: dict[str, Any], names: set[str]) -> Callable[[], EmuRuntime]:
    """EmuRuntimes whose kernels add their names to `names` as they launch, the GEMM ("gemm_f16")
    and the host reads done in numpy, over a 64 MiB arena."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    import cuda_emu

    def logged(name: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            names.add(name)
            return fn(*a, **kw)

        return call

    def new_rt() -> EmuRuntime:
        rt = EmuRuntime(functions)
        rt.ops.functions = {n: logged(n, f) for n, f in rt.ops.functions.items()}
        rt.ops.gemm, rt.ops.reader = logged("gemm_f16", cuda_emu.numpy_gemm), cuda_emu.numpy_read
        rt.arena.ensure(64 << 20)
        return rt

    return new_rt


_SLOW = pytest.mark.slow  # (~12 s each on the emulator: the first case runs in the fast suite)


@pytest.mark.parametrize("qtype, cache", [(T.Q8_0, GGMLType.F16), pytest.param(T.Q4_K, GGMLType.F16, marks=_SLOW),
                                          pytest.param(T.Q4_1, GGMLType.F32, marks=_SLOW),
                                          pytest.param(T.Q8_0, GGMLType.Q8_0, marks=_SLOW),
                                          pytest.param(T.Q4_0, GGMLType.Q4_0, marks=_SLOW)])
def test_the_kernels_on_the_cuda_emulator(make_llama, monkeypatch: pytest.MonkeyPatch, emu_functions: Any,
                                          qtype: T, cache: GGMLType) -> None:  # noqa: ANN001
    """Decode steps through the GPU plan, its launch makers, cuda_ops and every kernels_cuda
    kernel (emulated): the float32 CPU path's logits, within float32 noise; one capture per plan."""
    path = make_llama(qtype=qtype, rope_freqs=True)
    ref_model = Model(path, context_options=ContextOptions(cpu_matmul="f32"))
    model = Model(path)
    kv = dict(type_k=cache, type_v=cache)
    ref = Context(ref_model, ContextOptions(n_ctx=512, n_threads=1, cpu_matmul="f32", **kv))  # type: ignore[arg-type]
    steps = _decode_steps()
    want = [ref.decode(t, p, s, w) for t, p, s, w in steps]
    rts: list[EmuRuntime] = []

    def new_rt() -> EmuRuntime:
        rts.append(EmuRuntime(emu_functions))
        rts[-1].arena.ensure(64 << 20)
        return rts[-1]

    made = _gpu_backend(monkeypatch, new_rt)
    gpu = Context(model, ContextOptions(n_ctx=512, n_threads=1, **kv))  # type: ignore[arg-type]
    for i, ((t, p, s, w), b) in enumerate(zip(steps, want)):
        a = gpu.decode(t, p, s, w)
        if len(t) > 8:
            continue  # the prompt: node by node, in the q8 mode (another sequence than the steps after it)
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(np.abs(b).max()), err_msg=f"step {i}")
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {i}"
    assert made and all(not p.direct and p.n_captures == 1 for p in made)
    kinds = [k for k, _ in rts[0].log]
    assert kinds.count("replay") == sum(p.n_runs for p in made)
    model.free()
    ref_model.free()


@pytest.mark.parametrize("arch", ["gemma3", pytest.param("qwen3", marks=_SLOW), pytest.param("qwen2", marks=_SLOW)])
def test_families_on_the_cuda_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, emu_functions: Any,
                                       arch: str) -> None:
    """gemma3 (GEGLU, the embedding SCALE, a sliding-window mask: two count slots), qwen3 (per-head
    Q/K norms), qwen2 (biases) through the real kernels (emulated): the float32 CPU path's logits."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_family_gguf

    path = write_family_gguf(tmp_path / f"{arch}.gguf", arch, qtype=T.Q8_0, n_swa=4)
    ref_model = Model(path, context_options=ContextOptions(cpu_matmul="f32"))
    model = Model(path)
    steps = [([1, 5, 9, 3], [0, 1, 2, 3], 0, None)] + [([10 + i], [4 + i], 0, None) for i in range(5)]
    ref = Context(ref_model, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32"))
    want = [ref.decode(t, p, s, w) for t, p, s, w in steps]
    made = _gpu_backend(monkeypatch, lambda: EmuRuntime(emu_functions))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    for i, ((t, p, s, w), b) in enumerate(zip(steps, want)):
        a = ctx.decode(t, p, s, w)
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(np.abs(b).max()), err_msg=f"step {i}")
    assert made and all(not p.direct for p in made)
    model.free()
    ref_model.free()


@pytest.mark.parametrize("n_gpu, ngl, ts", [(1, 2, ()), (1, "all", ()), (2, "all", (1.0, 1.0))],
                         ids=["ngl2", "ngl-all", "two-devices"])
def test_through_the_scheduler_on_test_devices(make_llama, monkeypatch: pytest.MonkeyPatch, n_gpu: int,
                                               ngl: Any, ts: tuple[float, ...]) -> None:  # noqa: ANN001
    """GPU plans on the TEST devices (their own memory, LLAMAPY_TEST_GPU), made by the scheduler as
    on CUDA: -ngl 2 (CPU layers, then the device's split: its inputs handed over as host arrays,
    into the mirror), -ngl all, and two devices (-ts 1,1: the second split's input from the first
    device). Launches through executor.c: the CPU's logits, bit for bit."""
    from llamapy.context import ModelOptions

    path = make_llama(qtype=T.Q8_0)
    cpu_model = Model(path)
    cpu = Context(cpu_model, ContextOptions(n_ctx=512, n_threads=1))
    want = [cpu.decode(t, p, s, w) for t, p, s, w in _decode_steps()[:5]]
    from llamapy.backend import registry

    monkeypatch.setenv("LLAMAPY_TEST_GPU", str(n_gpu))
    monkeypatch.setattr(registry, "_cache", None)  # (discovered again, with the TEST devices)
    made = use_test_device_plans(monkeypatch.setattr, FakeRuntime)
    model = Model(path, ModelOptions(n_gpu_layers=ngl, tensor_split=ts))
    assert sum(k.startswith("TEST") for k in model.info.buffer_sizes) == n_gpu
    ctx = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    for (t, p, s, w), b in zip(_decode_steps()[:5], want):
        np.testing.assert_array_equal(ctx.decode(t, p, s, w), b)
    assert made and all(not p.direct for p in made)
    assert {p.rt.buft.name for p in made} == {f"TEST{i}" for i in range(n_gpu)}
    model.free()
    cpu_model.free()


# -- mixture of experts: the router and the expert products in the plan ------------------------


def _moe_model(tmp_path: Path, case: str, qtype: T = T.Q8_0) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from moe_models import SHAPES, write_moe_gguf

    return write_moe_gguf(tmp_path / f"{case}.gguf", qtype=qtype, **SHAPES[case])


# a prompt, decode steps of one token, then two sequences a step (the same expert chosen by several
# tokens: the kernel reads it once for them)
_MOE_STEPS = [([1, 5, 9, 3], [0, 1, 2, 3], 0, None)] + [([10 + i], [4 + i], 0, None) for i in range(3)] \
    + [([1, 66], [0, 1], 1, [True, True]), ([70, 71], [2, 7], None, [True, True])]


def _moe_decode(ctx: Context, steps: list) -> list[np.ndarray]:
    out = []
    for t, p, s, w in steps:
        if s is None:  # one token of each sequence
            out.append(ctx.decode(t, p, [1, 0], w))
        else:
            out.append(ctx.decode(t, p, s, w))
    return out


@pytest.mark.parametrize("case", ["tiny-qwen3moe", "tiny-mixtral"])
def test_moe_gpu_plan_gives_the_cpu_executors_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     case: str) -> None:
    """A qwen3moe / Mixtral-style decode as one GPU plan a step (the router's records, MUL_MAT_ID
    and the gate/up experts with their GLU as one record, one capture per plan) gives the CPU
    executor's logits bit for bit (launches through executor.c's records)."""
    model = Model(_moe_model(tmp_path, case))
    ref = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    want = _moe_decode(ref, _MOE_STEPS)
    made = _gpu_backend(monkeypatch, FakeRuntime)
    gpu = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    got = _moe_decode(gpu, _MOE_STEPS)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert made and all(not p.direct and p.n_captures == 1 for p in made)
    for p in made:  # every layer's gate/up experts and their GLU as one record (its own step)
        glu = p.recs[p.recs[:, 0] == MUL_MAT_ID_GLU]
        assert len(glu) == 2 and (p.recs[:, 0] == MUL_MAT_ID_W).sum() == 2, p.summary()
        assert (p.recs[:, 0] == ROUTER).sum() >= 1, p.summary()  # the router in one launch (where it may be)
        for r in glu:  # the GLU's result apart from the input the kernel reads to the end
            y, x, n_tok, n_used, m, n_in = int(r[1]), int(r[2]), int(r[6]), int(r[7]), int(r[8]), int(r[10])
            assert y + 4 * n_tok * n_used * m <= x or x + 4 * n_tok * n_in <= y
    model.free()


def _emulated_moe_decode_matches_f32(path: Path, monkeypatch: pytest.MonkeyPatch, emu_functions: Any) -> tuple[Model, list]:
    """_MOE_STEPS of `path` through GPU plans on the CUDA emulator against the float32 CPU path:
    logits within float32 noise, the same greedy tokens, every plan a graph. (The model, the plans.)"""
    ref_model = Model(path, context_options=ContextOptions(cpu_matmul="f32"))
    model = Model(path)
    ref = Context(ref_model, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32"))
    want = _moe_decode(ref, _MOE_STEPS)
    made = _gpu_backend(monkeypatch, lambda: EmuRuntime(emu_functions))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    for i, (a, b) in enumerate(zip(_moe_decode(ctx, _MOE_STEPS), want)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(np.abs(b).max()), err_msg=f"step {i}")
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {i}"
    assert made and all(not p.direct for p in made)
    ref_model.free()
    return model, made


@pytest.mark.parametrize("case", ["tiny-mixtral", pytest.param("tiny-qwen3moe", marks=_SLOW)])
def test_moe_on_the_cuda_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, emu_functions: Any,
                                  case: str) -> None:
    """The MoE decode through the real kernels (moe.cu's router, mmv_id) on the CPU emulator: the
    float32 CPU path's logits, within float32 noise, the same greedy tokens."""
    path = _moe_model(tmp_path, case)
    model, made = _emulated_moe_decode_matches_f32(path, monkeypatch, emu_functions)
    assert any({MUL_MAT_ID_GLU, ROUTER} <= set(int(c) for c in p.recs[:, 0]) for p in made)
    model.free()


def _int8_expert_records(p: GPUPlan, n_used: int) -> tuple[int, int]:
    """Check a q8 plan's expert products (MUL_MAT_ID_Q8): the gate/up one reads the copy its
    layer's norm made (RMS_NORM slot 16: the QUANTIZE_Q8_1 hoisted over the router's records and
    joined to it), the down one the copy of its pairs' rows that the record before it made; no
    float32 expert record left. (gate/up records, down records)"""
    recs = [[int(x) for x in r] for r in p.recs]
    assert not any(r[0] in (MUL_MAT_ID_W, MUL_MAT_ID_GLU) for r in recs), p.summary()
    gate_up = down = 0
    for i, r in enumerate(recs):
        if r[0] != gpu_plan.MUL_MAT_ID_Q8:
            continue
        T_, n_in = r[6], r[10]
        maker = max(j for j in range(i) if recs[j][0] == gpu_plan.QUANTIZE_Q8_1 or (recs[j][0] == RMS_NORM and recs[j][16]))
        if r[16]:  # gate/up: the token's normed row, the norm's own copy
            assert recs[maker][0] == RMS_NORM and recs[maker][16] == r[2] and (r[13], r[14], r[23]) == (1, 0, T_)
            gate_up += 1
        else:  # down: a row a pair, copied just before
            q = recs[i - 1]
            assert q[0] == gpu_plan.QUANTIZE_Q8_1 and q[1] == r[2] and (q[6], q[7]) == (T_ * n_used, n_in)
            assert (r[13], r[14], r[23]) == (n_used, 1, T_ * n_used)
            down += 1
        assert p.built.base + p.built.nbytes >= r[2] + cuda_ops.q8_1_bytes(r[23], n_in)
    return gate_up, down


@pytest.mark.parametrize("case", ["tiny-qwen3moe", "tiny-gptoss"])
def test_int8_expert_records_by_the_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """A decode step's expert products are MUL_MAT_ID_Q8 records where the weights a token reads
    (n_used x M x n_in, twice for gate/up) reach MMVQ_MIN_WEIGHTS (gate/up alone when only it
    does), float32 ones below it and in the f32 mode; the copies as _int8_expert_records says."""
    from llamapy.sched.alloc import plan_offsets

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from moe_models import SHAPES

    sh = SHAPES[case]
    down = sh["n_expert_used"] * sh["n_ff_exp"] * sh["n_embd"]  # the weights the down experts read a token
    model = Model(_gptoss_model(tmp_path) if case == "tiny-gptoss" else _moe_model(tmp_path, case))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    g = ctx.graph(1, 1).graph
    (split,) = ctx.sched.reserve(g).splits
    for least, mode, want in ((down, "q8", (2, 2)), (2 * down, "q8", (2, 0)), (2 * down + 1, "q8", (0, 0)),
                              (0, "f32", (0, 0))):
        monkeypatch.setattr(gpu_plan, "MMVQ_MIN_WEIGHTS", least)
        p = gpu_plan.compile_split(split.nodes, list(g.outputs), plan_offsets, FakeRuntime(), mode)
        assert isinstance(p, GPUPlan), p
        codes = [int(c) for c in p.recs[:, 0]]
        assert codes.count(gpu_plan.MUL_MAT_ID_Q8) == sum(want), (least, mode, p.summary())
        if want == (2, 2):
            assert _int8_expert_records(p, sh["n_expert_used"]) == want
        else:
            assert codes.count(MUL_MAT_ID_GLU) == 2 - want[0] and codes.count(MUL_MAT_ID_W) == 2 - want[1]
    model.free()


@pytest.mark.parametrize("case", [pytest.param("tiny-qwen3moe", marks=_SLOW), pytest.param("tiny-gptoss", marks=_SLOW)])
def test_int8_experts_on_the_cuda_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, emu_functions: Any,
                                           case: str) -> None:
    """The q8 mode's expert products on int8 (the threshold lowered to the smallest one; the
    router stays float32): MUL_MAT_ID_Q8 records over q8_1 copies (mmvq.cu's mmvq_id on the CPU
    emulator; gpt-oss's with its biases and swiglu_oai as epilogue) give the CPU's q8 path's logits
    within 3 % of the largest (both round x to 8 bits a block of 32, each by its own rule) and its
    greedy tokens where they are no near-tie (the top two further apart than twice the row's
    largest difference: gpt-oss's step 5 has one at 0.009, where the CPU's q8 and float32 paths
    disagree too)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from moe_models import SHAPES

    sh = SHAPES[case]
    n_ff = sh["n_ff_exp"]
    monkeypatch.setattr(gpu_plan, "MMVQ_MIN_WEIGHTS", sh["n_expert_used"] * n_ff * sh["n_embd"])
    path = _gptoss_model(tmp_path) if case == "tiny-gptoss" else _moe_model(tmp_path, case)
    model = Model(path)
    want = _moe_decode(Context(model, ContextOptions(n_ctx=256, n_threads=1)), _MOE_STEPS)
    made = _gpu_backend(monkeypatch, lambda: EmuRuntime(emu_functions))
    got = _moe_decode(Context(model, ContextOptions(n_ctx=256, n_threads=1)), _MOE_STEPS)
    checked = rows = 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.isfinite(a).all() and float(np.abs(a - b).max()) <= 3e-2 * float(np.abs(b).max()), f"step {i}"
        top2 = np.sort(b, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * np.abs(a - b).max(-1)
        assert (a.argmax(-1) == b.argmax(-1))[clear].all(), f"step {i}"
        checked, rows = checked + int(clear.sum()), rows + len(b)
    assert checked > rows // 2  # (most are no near-tie: the comparison is not vacuous)
    assert made and all(not p.direct for p in made)
    for p in made:
        assert _int8_expert_records(p, sh["n_expert_used"]) == (2, 2), p.summary()
    model.free()


@pytest.mark.parametrize("case", ["tiny-qwen3moe", "tiny-mixtral", "tiny-gptoss"])
@pytest.mark.parametrize("where", ["ngl-all", "n-cpu-moe"])
def test_moe_through_the_scheduler_on_test_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
                                                   where: str) -> None:
    """-ngl all (the whole layer, router and experts, one GPU plan) and --n-cpu-moe 1 (layer 0's
    experts in host memory: the GPU plan stops before its expert products, which the CPU executor
    runs where the weights are, and resumes after): the CPU's logits bit for bit."""
    from llamapy.backend import registry
    from llamapy.backend.device import MemoryDeviceBackend
    from llamapy.context import ModelOptions

    path = _gptoss_model(tmp_path) if case == "tiny-gptoss" else _moe_model(tmp_path, case)
    cpu_model = Model(path)
    want = _moe_decode(Context(cpu_model, ContextOptions(n_ctx=256, n_threads=1)), _MOE_STEPS)
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setattr(registry, "_cache", None)
    made: list[GPUPlan] = []

    def create(self: MemoryDeviceBackend, nodes: Any, exports: Any, allocate: Any) -> Any:
        if not hasattr(self, "_fake_rt"):
            self._fake_rt = FakeRuntime()
            self._fake_rt.buft = self.device.buffer_type()
        p = gpu_plan.compile_split(nodes, exports, allocate, self._fake_rt)
        made.extend([p] if p else [])
        return p

    monkeypatch.setattr(MemoryDeviceBackend, "graph_plan_create", create, raising=False)
    monkeypatch.setattr(MemoryDeviceBackend, "graph_plan_compute", lambda self, plan, env: plan.compute(env), raising=False)
    from llamapy.model.loader import expert_overrides

    opts = ModelOptions(n_gpu_layers="all", override_tensor=expert_overrides(1) if where == "n-cpu-moe" else [])
    model = Model(path, opts)
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    for a, b in zip(_moe_decode(ctx, _MOE_STEPS), want):
        np.testing.assert_array_equal(a, b)
    assert made and all(not p.direct for p in made)
    ids = [int((p.recs[:, 0] == MUL_MAT_ID_W).sum() + 2 * (p.recs[:, 0] == MUL_MAT_ID_GLU).sum()) for p in made]
    n_layer = 2
    if case == "tiny-gptoss":  # its own ops in the GPU plans (layer 1's experts at --n-cpu-moe 1)
        assert _gptoss_records(made) == _GPTOSS_FUSED
    if where == "ngl-all":
        assert max(ids) == 3 * n_layer  # every expert product in the one plan of a step
    else:
        assert max(ids) == 3 * (n_layer - 1)  # layer 0's on the CPU, in the CPU executor's plan
        cpu_plans = [bp for plan in ctx.sched._plans.values() for bp in plan.backend_plans.values()
                     if isinstance(bp, ExecPlan)]
        assert any((bp.recs[:, 0] == MUL_MAT_ID_Q).sum() == 3 for bp in cpu_plans)
    model.free()
    cpu_model.free()


def test_batch_sizes_keep_their_plans_and_graphs(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A server's steps of 3, then 4, then 3 sequences (and 1, 2, 8) at -ngl all on a TEST device:
    each batch size compiles and captures its plan once, the first time it occurs; when it comes
    back its plan and graph are replayed (no compile, no capture: the arena was sized for the
    largest batch when the first plan was made, so no later plan moves an earlier one). The logits
    are the CPU executor's, bit for bit."""
    from llamapy.backend import registry
    from llamapy.context import ModelOptions

    path = make_llama(qtype=T.Q8_0)
    n_seq = 8
    prompt = [([1 + s, 20 + s], [0, 1], s, None) for s in range(n_seq)]
    steps = [list(range(k)) for k in (3, 4, 3, 1, 2, 4, 8, 3, 8, 1)]
    cpu_model = Model(path)
    cpu = Context(cpu_model, ContextOptions(n_ctx=512, n_threads=1))
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setattr(registry, "_cache", None)
    made = use_test_device_plans(monkeypatch.setattr, FakeRuntime)
    model = Model(path, ModelOptions(n_gpu_layers="all"))
    gpu = Context(model, ContextOptions(n_ctx=512, n_threads=1))
    for t, p, s, w in prompt:
        np.testing.assert_array_equal(gpu.decode(t, p, s, w), cpu.decode(t, p, s, w))
    pos = [2] * n_seq
    seen: dict[int, int] = {}  # batch size -> plans made before its first step
    for k, seqs in enumerate(steps):
        toks = [(7 * k + s) % 60 + 1 for s in seqs]
        ps = [pos[s] for s in seqs]
        before = len(made)
        np.testing.assert_array_equal(gpu.decode(toks, ps, seqs, [True] * len(seqs)),
                                      cpu.decode(toks, ps, seqs, [True] * len(seqs)))
        for s in seqs:
            pos[s] += 1
        if len(seqs) in seen:
            assert len(made) == before, f"a step of {len(seqs)} sequences compiled a plan again"
        seen[len(seqs)] = before
    assert made and all(p.n_captures == 1 and not p.direct for p in made), [p.n_captures for p in made]
    assert sum(p.n_runs for p in made) == len(prompt) + len(steps)  # every step through a plan
    model.free()
    cpu_model.free()


def _gptoss_model(tmp_path: Path, exp_qtype: T = T.MXFP4) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from moe_models import write_gptoss_gguf

    return write_gptoss_gguf(tmp_path / "gptoss.gguf", qtype=T.Q8_0, exp_qtype=exp_qtype)


# gpt-oss's own ops in its plans: the experts' biases and clamped SwiGLU as the expert products'
# epilogue (the compiler's fuse_bias), or as ADD_ID and GLU records of their own (without it)
_GPTOSS_FUSED = {"yarn", "sinks", "bias epilogue", "swiglu_oai epilogue", "router"}
_GPTOSS_UNFUSED = {"yarn", "sinks", "add_id", "swiglu_oai", "router"}


def _gptoss_records(made: list[GPUPlan]) -> set[str]:
    """What gpt-oss's own ops became in the plans: YaRN ropes, sinks, swiglu_oai, ADD_ID."""
    seen = set()
    for p in made:
        for r in p.recs:
            code = int(r[0])
            seen |= {"yarn"} if (code == ROPE and r[15]) or (code == ROPE_QKV and r[27]) else set()
            seen |= {"sinks"} if code == ATTN and r[24] else set()
            seen |= {"swiglu_oai"} if code == SWIGLU and r[10] else set()
            seen |= {"add_id"} if code == ADD_ID else set()
            seen |= {"bias epilogue"} if code in (MUL_MAT_ID_W, MUL_MAT_ID_GLU) and r[18] else set()
            seen |= {"swiglu_oai epilogue"} if code == MUL_MAT_ID_GLU and r[17] == 2 else set()
            seen |= {"router"} if code == ROUTER_TOPK else set()
    return seen


@pytest.mark.parametrize("fused", [True, False], ids=["epilogues", "records"])
def test_gptoss_gpu_plan_gives_the_cpu_executors_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        fused: bool) -> None:
    """gpt-oss (YaRN rope, attention sinks, sliding-window layers, biased experts in MXFP4, the
    clamped SwiGLU, top-k then softmax routing) as one GPU plan a step: no split refused, the
    records of its own ops made (the biases and the GLU as the expert products' epilogue, or,
    without that fusion, as records of their own), and the CPU executor's logits bit for bit
    (launches through executor.c's records)."""
    monkeypatch.setattr(gpu_plan.GPUTarget, "fuse_bias", fused)
    model = Model(_gptoss_model(tmp_path))
    ref = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    want = _moe_decode(ref, _MOE_STEPS)
    refusals = _refusals(monkeypatch)
    made = _gpu_backend(monkeypatch, FakeRuntime)
    gpu = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    for i, (a, b) in enumerate(zip(_moe_decode(gpu, _MOE_STEPS), want)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
    assert not refusals, refusals
    assert made and all(not p.direct and p.n_captures == 1 for p in made)
    assert _gptoss_records(made) == (_GPTOSS_FUSED if fused else _GPTOSS_UNFUSED)
    if fused:  # every layer's gate/up experts, their biases and GLU one launch; down and its bias one
        for p in made:
            assert (p.recs[:, 0] == MUL_MAT_ID_GLU).sum() == 2 and (p.recs[:, 0] == MUL_MAT_ID_W).sum() == 2, p.summary()
    assert all(len(p.built.masks) == 2 for p in made if (p.recs[:, 0] == ATTN).any())  # full and sliding window
    model.free()


@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=_SLOW)], ids=["epilogues", "records"])
def test_gptoss_on_the_cuda_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, emu_functions: Any,
                                     fused: bool) -> None:
    """gpt-oss's decode through the real kernels on the CPU emulator (rope.cu's YaRN, fattn.cu's
    sinks, the MXFP4 mmv_id with the biases and swiglu_oai as its epilogue — or glu.cu's
    swiglu_oai and moe.cu's add_id without that fusion): the float32 CPU path's logits within
    float32 noise, the same greedy tokens."""
    monkeypatch.setattr(gpu_plan.GPUTarget, "fuse_bias", fused)
    path = _gptoss_model(tmp_path)
    model, made = _emulated_moe_decode_matches_f32(path, monkeypatch, emu_functions)
    assert _gptoss_records(made) == (_GPTOSS_FUSED if fused else _GPTOSS_UNFUSED)
    model.free()


@pytest.mark.parametrize("arch", ["qwen2", "gpt-oss"])
def test_biased_qkv_is_one_product_and_one_rope_qkv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    arch: str) -> None:
    """Layers with Q/K/V biases (qwen2, gpt-oss: the loader's one product and one stacked bias)
    as decode plans: one ROPE_QKV a layer (no ROPE or SET_ROWS record left), the biases the
    products' epilogue (MUL_MAT_W's slot 18: the Q/K/V one, and gpt-oss's output and router
    biases) with no ADD record for them — without the epilogue, one ADD each —, and the CPU
    executor's logits bit for bit either way."""
    if arch == "qwen2":
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
        from family_models import write_family_gguf

        path, n_biased = write_family_gguf(tmp_path / "qwen2.gguf", "qwen2", qtype=T.Q8_0), 1
    else:
        path, n_biased = _gptoss_model(tmp_path), 3
    model = Model(path)
    n_layer = model.params.n_layer
    ref = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    want = _moe_decode(ref, _MOE_STEPS)
    counts = {}
    for fused in (True, False):
        monkeypatch.setattr(gpu_plan.GPUTarget, "fuse_bias", fused)
        refusals = _refusals(monkeypatch)
        made = _gpu_backend(monkeypatch, FakeRuntime)
        gpu = Context(model, ContextOptions(n_ctx=256, n_threads=1))
        for i, (a, b) in enumerate(zip(_moe_decode(gpu, _MOE_STEPS), want)):
            np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
        assert not refusals and made, refusals
        for p in made:
            codes = p.recs[:, 0]
            assert (codes == ROPE_QKV).sum() == n_layer and not np.isin(codes, (ROPE, SET_ROWS)).any(), p.summary()
        p = made[-1]
        codes = p.recs[:, 0]
        counts[fused] = ((codes == ADD).sum(), ((codes == MUL_MAT_W) & (p.recs[:, 18] != 0)).sum(), len(codes))
        gpu.free()
    (add_f, bias_f, n_f), (add_u, bias_u, n_u) = counts[True], counts[False]
    assert bias_f == n_layer * n_biased and bias_u == 0
    assert add_u - add_f == bias_f
    if arch == "qwen2":  # (gpt-oss's experts lose their epilogues too without fuse_bias)
        assert add_f == 0 and n_u - n_f == bias_f  # (the residual ADDs are the norms' fused ADDs)
    model.free()


def test_the_embedding_split_runs_on_the_calling_thread(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """At -ngl all the CPU's split is the token embedding's GET_ROWS alone: executor.c would run it
    on thread 0 anyway, so the plan makes no team (a team's wake-up was most of a GPU step's host
    time); a split with products keeps its -t threads."""
    from llamapy.backend import registry
    from llamapy.backend.executor import serial_only
    from llamapy.context import ModelOptions

    path = make_llama(qtype=T.Q8_0)
    cpu_model = Model(path)
    cpu = Context(cpu_model, ContextOptions(n_ctx=256, n_threads=2))
    cpu.decode([1, 2], [0, 1])
    (whole,) = [cpu.sched.backend_plan(cpu.sched.reserve(cpu.graph(1, 1).graph), 0)]
    assert isinstance(whole, ExecPlan) and not whole.serial and not serial_only(whole.recs)
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setattr(registry, "_cache", None)
    use_test_device_plans(monkeypatch.setattr, FakeRuntime)
    model = Model(path, ModelOptions(n_gpu_layers="all"))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=2))
    np.testing.assert_array_equal(ctx.decode([1, 2], [0, 1]), cpu.decode([1, 2], [0, 1], 1))
    plan = ctx.sched.reserve(ctx.graph(1, 1).graph)
    ctx.decode([3], [2])
    (emb,) = [ctx.sched.backend_plan(plan, i) for i, s in enumerate(plan.splits) if ctx.backends[s.backend].name == "CPU"]
    assert isinstance(emb, ExecPlan) and emb.serial and emb.n_threads == 1 and emb.n_runs == 1
    model.free()
    cpu_model.free()


# -- prompts: GPU plans of GEMMs and the prompt attention kernel ----------------------------------

_PROMPT = [(7 * i) % 200 + 1 for i in range(40)]


def _prompt_model(arch: str, make_llama: Any, tmp_path: Path) -> Path:
    if arch == "llama":
        return make_llama(qtype=T.Q8_0, rope_freqs=True)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_family_gguf

    return write_family_gguf(tmp_path / f"{arch}.gguf", arch, qtype=T.Q8_0, n_swa=4)


def _prompt_then_decode(path: Path, monkeypatch: pytest.MonkeyPatch, new_rt: Callable[[], Any]
                        ) -> tuple[list[np.ndarray], list[np.ndarray], list[GPUPlan]]:
    """A 40-token prompt (every row's logits) and two decode steps, on the float32 CPU path and
    through GPU plans over `new_rt()`'s runtime."""
    ref_model = Model(path, context_options=ContextOptions(cpu_matmul="f32"))
    model = Model(path)
    steps = [(_PROMPT, list(range(40)), 0, [True] * 40)] + [([10 + i], [40 + i], 0, None) for i in range(2)]
    ref = Context(ref_model, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32"))
    want = [ref.decode(t, p, s, w) for t, p, s, w in steps]
    made = _gpu_backend(monkeypatch, new_rt)
    gpu = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    got = [gpu.decode(t, p, s, w) for t, p, s, w in steps]
    model.free()
    ref_model.free()
    return got, want, made


def _check_prompt(got: list[np.ndarray], want: list[np.ndarray], made: list[GPUPlan], tol: float) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and np.all(np.isfinite(a)), f"step {i}"
        err = float(np.abs(a - b).max()) / float(np.abs(b).max())
        assert err <= tol, f"step {i}: {err:.2e} of the largest logit"
    assert (got[0].argmax(-1) == want[0].argmax(-1)).mean() >= 0.9
    prompt = [p for p in made if (p.recs[:, 0] == MUL_MAT_GEMM).any()]
    decode = [p for p in made if not any(p is q for q in prompt)]
    assert len(prompt) == 1 and prompt[0].direct == GEMM_DIRECT and prompt[0].n_runs == 1
    assert not (prompt[0].recs[:, 0] == MUL_MAT_W).any()  # every product of the 40 rows
    assert decode and all(not p.direct and p.n_captures == 1 and (p.recs[:, 0] == MUL_MAT_W).any() for p in decode)


# the f16 rounding of the GEMMs' inputs (2^-11 relative) through the layers: measured 1.1e-4
# (llama) and 1.7e-4 / 1.8e-4 (qwen3) of the largest logit here; a wrong pointer, stride or tile
# would be O(1)
_F16_TOL = 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_prompt_plan_gives_the_float32_paths_logits(make_llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    arch: str) -> None:  # noqa: ANN001
    """A 40-token prompt as one GPU plan, through cuda_exec's launch makers into NumpyOps (the
    GEMM over the f16-rounded input and weight, as the tensor cores take them): every row's
    logits are the float32 CPU path's within that rounding; the decode plans after it are as
    before (matrix-vector products, one graph each)."""
    def new_rt() -> LaunchRuntime:
        rt = LaunchRuntime()
        rt.arena.ensure(64 << 20)
        return rt

    got, want, made = _prompt_then_decode(_prompt_model(arch, make_llama, tmp_path), monkeypatch, new_rt)
    _check_prompt(got, want, made, _F16_TOL)
    calls = set(made[0].rt.ops.calls)
    assert {"to_f16", "dequant_f16", "gemm_f16", "flash_attn_ext", "mul_mat_vec"} <= calls
    if arch == "qwen2":  # the Q/K/V biases: the GEMM's in-place add, mmv's epilogue
        gemm = made[0].recs[made[0].recs[:, 0] == MUL_MAT_GEMM]
        assert (gemm[:, 18] != 0).sum() == 2 and "add" in calls and "mul_mat_vec+bias" in calls


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_prompt_plan_on_the_cuda_emulator(make_llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          emu_functions: Any, arch: str) -> None:  # noqa: ANN001
    """The same through every kernels_cuda kernel on the emulator (dequant_f16, cpy_f32_f16, the
    prompt attention fattn_tile_*, rope_qkv and norms over 40 rows), the GEMM in numpy."""
    names: set[str] = set()  # the kernels launched
    new_rt = _logged_emu_runtime(emu_functions, names)
    got, want, made = _prompt_then_decode(_prompt_model(arch, make_llama, tmp_path), monkeypatch, new_rt)
    _check_prompt(got, want, made, _F16_TOL)
    assert any(n.startswith("fattn_tile_") for n in names) and any(n.startswith("dequant_f16_") for n in names)
    assert {"cpy_f32_f16", "amax_f32", "gemm_f16"} <= names  # (the inputs with their scale: alpha from the arena)


# -- the fit (-ngl auto) counts what the GPU plans allocate ---------------------------------------


def _test_device(monkeypatch: pytest.MonkeyPatch, mib: float | None = None) -> list[GPUPlan]:
    """One TEST device (`mib` of memory, else unbounded) whose splits are GPU plans over FakeRuntime."""
    from llamapy.backend import registry

    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    if mib is None:
        monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    else:
        monkeypatch.setenv("LLAMAPY_TEST_GPU_MEM", repr(mib))  # (bytes / 2**20: exact in a float)
    monkeypatch.setattr(registry, "_cache", None)
    return use_test_device_plans(monkeypatch.setattr, FakeRuntime)


@pytest.mark.parametrize("case", ["qwen3", "tiny-qwen3moe"])
def test_the_fit_counts_the_plans_arena(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """The fit's compute figure for a device of GPU plans is the arena those plans take (the
    prompt plan's f16 GEMM scratches included, a mixture of experts' grouping and gathered rows
    too: more than the scheduler's node-by-node buffer),
    byte for byte, and -ngl auto follows it: with exactly that much memory every layer goes to the
    device, with one byte less one layer stays on the CPU — a mixture of experts instead keeps every
    layer there with the first layer's experts in host memory —, as the load log says."""
    import sys

    from llamapy.context import ModelOptions

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_family_gguf

    path = write_family_gguf(tmp_path / "qwen3.gguf", "qwen3", qtype=T.Q8_0, n_swa=4) if case == "qwen3" \
        else _moe_model(tmp_path, case)
    co = ContextOptions(n_ctx=256, n_ubatch=40, n_batch=40, n_threads=1)
    made = _test_device(monkeypatch)
    model = Model(path, ModelOptions(n_gpu_layers="all"), context_options=co)
    n_all = model.params.n_layer + 1
    need = model.device_bytes(n_all)["TEST0"]
    ctx = Context(model, co)
    ctx.decode(list(range(1, 41)), list(range(40)), 0, [True] * 40)  # the worst-case graph: a prompt plan
    for i in range(3):
        ctx.decode([5 + i], [40 + i])
    (rt,) = {id(p.rt): p.rt for p in made}.values()
    assert any(p.direct.startswith(GEMM_DIRECT) for p in made) and any(not p.direct for p in made)
    held = sum(b.nbytes for b in model.weights.buffers if b.name == "TEST0") + ctx.kv.nbytes_by_device()["TEST0"]
    sched_size = ctx.sched.reserve(ctx.graph(40, 40).graph).compute_sizes["TEST0"]
    assert need - held == rt.arena.size > sched_size
    assert ctx.compute_sizes["TEST0"] == rt.arena.size  # what the context reserved (the load log's figure)
    ctx.free()
    model.free()
    for mib, ngl in ((need / 2**20, n_all), ((need - 1) / 2**20, n_all - 1)):
        _test_device(monkeypatch, mib)
        m = Model(path, ModelOptions(n_gpu_layers="auto"), context_options=co)
        assert m.info.ngl_reason.startswith(f"-ngl auto: {ngl}/{n_all} layers fit"), m.info.ngl_reason
        if case == "qwen3" or ngl == n_all:
            assert m.info.n_gpu_layers == ngl and not m.info.overridden
        else:
            assert m.info.n_gpu_layers == n_all and m.info.overridden["CPU"][0] == 3  # layer 0's gate, up, down
            assert m.info.ngl_reason.endswith("all of them with the experts of the first 1 on the CPU (as --n-cpu-moe 1)")
        m.free()


def test_the_fit_counts_one_layers_host_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the experts of the first k layers in host memory (--n-cpu-moe k), a prompt copies each
    expert tensor to the device for its product (op offload at the default -ub 512) in a split of
    its own, as ggml does, so the device's figure holds one copy whatever k is: each layer moved
    frees its experts' bytes (before, every moved layer's copies were one split's inputs, all
    held at once, and moving experts freed nothing)."""
    from llamapy.context import ModelOptions
    from llamapy.model.loader import expert_overrides

    path = _moe_model(tmp_path, "tiny-qwen3moe")
    _test_device(monkeypatch)
    model = Model(path, ModelOptions(n_gpu_layers="all"), context_options=ContextOptions(n_ctx=512, n_threads=1))
    exps = [sum(t.nbytes for t in layer.values() if "exps" in t.name) for layer in model.weights.layers]
    n_all = model.params.n_layer + 1
    need = []
    for k in range(1, model.params.n_layer + 1):
        model.overrides = [(p, model.cpu) for p, _ in expert_overrides(k)]
        need.append(model.device_bytes(n_all)["TEST0"])
    assert all(a - b == e for a, b, e in zip(need, need[1:], exps[1:])), (need, exps)
    model.free()


# -- mixture of experts: prompts as plans (MUL_MAT_ID_GEMM) ---------------------------------------

# a 20-token prompt (every row's logits), then decode steps of one token
_MOE_PROMPT = [([(3 * i) % 200 + 1 for i in range(20)], list(range(20)), 0, [True] * 20)] \
    + [([10 + i], [20 + i], 0, None) for i in range(2)]


def _moe_prompt_model(tmp_path: Path, case: str) -> Path:
    return _gptoss_model(tmp_path) if case == "tiny-gptoss" else _moe_model(tmp_path, case)


def _check_moe_prompt_plans(made: list[GPUPlan], n_layer: int = 2, decode_steps: bool = True) -> None:
    """One prompt plan, launched directly (its expert GEMMs' sizes are the routing's, read back
    once a layer), every expert product in it a MUL_MAT_ID_GEMM, the sort read once a layer (the
    down experts reuse the gate/up's grouping); the decode plans one graph each, as before."""
    prompt = [p for p in made if (p.recs[:, 0] == MUL_MAT_ID_GEMM).any()]
    assert len(prompt) == 1 and prompt[0].direct == GEMM_DIRECT + MOE_SYNC and prompt[0].n_runs == 1, \
        [p.summary() for p in made]
    ids = prompt[0].recs[prompt[0].recs[:, 0] == MUL_MAT_ID_GEMM]
    assert len(ids) == 2 * n_layer and not np.isin(prompt[0].recs[:, 0], (MUL_MAT_ID_W, MUL_MAT_ID_GLU)).any()
    assert [int(r[23]) & 3 for r in ids] == [1, 2] * n_layer  # gate/up (GLU, sorts), down (reuses the sort)
    b = prompt[0].built
    for r in ids:  # the step's scratches (its own: x16, w16, products, scale) apart from its input, result, ids
        T, U, M = int(r[6]), int(r[7]), int(r[8])
        own = [(int(r[k]), int(r[k]) + 1) for k in (25, 26, 27, 5)]  # (their starts: the sizes are the routing's)
        assert len({lo for lo, _ in own}) == 4 and all(b.base + HEAD <= lo < b.base + b.nbytes for lo, _ in own)
        vals = [(int(r[1]), int(r[1]) + 4 * T * U * M), (int(r[4]), int(r[4]) + 4 * T * U)]
        assert all(hi <= v0 or v1 <= lo for lo, hi in own for v0, v1 in vals), (own, vals)
    assert len({int(r[24]) for r in ids}) == 1  # the grouping (order and offsets): one, the down product reads the gate/up's
    decode = [p for p in made if p is not prompt[0]]
    assert all(not p.direct and p.n_captures == 1 for p in decode) and (bool(decode) or not decode_steps)


@pytest.mark.parametrize("case", ["tiny-qwen3moe", "tiny-mixtral", "tiny-gptoss"])
def test_moe_prompt_plan_gives_the_cpu_executors_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        case: str) -> None:
    """A 20-token prompt of a mixture of experts is one GPU plan (its expert products
    MUL_MAT_ID_GEMM records, launched directly) with no split refused: launched through executor.c
    (the q8 path of each record) it gives the CPU executor's logits bit for bit, every row."""
    model = Model(_moe_prompt_model(tmp_path, case))
    ref = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    want = [ref.decode(t, p, s, w) for t, p, s, w in _MOE_PROMPT]
    refusals = _refusals(monkeypatch)
    made = _gpu_backend(monkeypatch, FakeRuntime)
    gpu = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    for i, ((t, p, s, w), b) in enumerate(zip(_MOE_PROMPT, want)):
        np.testing.assert_array_equal(gpu.decode(t, p, s, w), b, err_msg=f"step {i}")
    assert not refusals, refusals
    _check_moe_prompt_plans(made)
    model.free()


def _moe_prompt_against_f32(path: Path, monkeypatch: pytest.MonkeyPatch, new_rt: Callable[[], Any],
                            steps: list = _MOE_PROMPT, tol: float = _F16_TOL) -> list[GPUPlan]:
    """_MOE_PROMPT through GPU plans over `new_rt()` against the float32 CPU path: within the f16
    rounding of the GEMMs' inputs (the prompt), float32 noise (the decode steps after it)."""
    ref_model = Model(path, context_options=ContextOptions(cpu_matmul="f32"))
    model = Model(path)
    ref = Context(ref_model, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32"))
    want = [ref.decode(t, p, s, w) for t, p, s, w in steps]
    made = _gpu_backend(monkeypatch, new_rt)
    gpu = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    got = [gpu.decode(t, p, s, w) for t, p, s, w in steps]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and np.all(np.isfinite(a)), f"step {i}"
        err = float(np.abs(a - b).max()) / float(np.abs(b).max())
        assert err <= tol, f"step {i}: {err:.2e} of the largest logit"
    assert (got[0].argmax(-1) == want[0].argmax(-1)).mean() >= 0.9
    model.free()
    ref_model.free()
    return made


@pytest.mark.parametrize("case", ["tiny-qwen3moe", "tiny-mixtral"])
def test_moe_prompt_plan_gives_the_float32_paths_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        case: str) -> None:
    """The MoE prompt plan through cuda_exec's launch maker into NumpyOps (the grouping, the f16
    gather, the per-expert f16 GEMMs, the scatter with the GLU: cuda_ops' real composition): every
    row's logits are the float32 CPU path's within the f16 rounding. (The router's records, exact
    float32 ops NumpyOps has no stand-in for, run through executor.c; the prompt alone: the
    decode steps' experts would be executor.c's q8 ones.)"""
    from llamapy.backend.executor import MUL

    router = {SOFT_MAX, ARGSORT, GET_ROWS_B, SUM_ROWS, CLAMP, DIV, ROUTER, ROUTER_TOPK}

    class RouterOnCpu(LaunchRuntime):
        def prepare(self, rec: np.ndarray) -> Any:
            if int(rec[0]) in router or (int(rec[0]) == MUL and rec[10]):  # (MUL by one weight a row too)
                return FakeRuntime.prepare(self, rec)
            return super().prepare(rec)

    def new_rt() -> LaunchRuntime:
        rt = RouterOnCpu()
        rt.arena.ensure(64 << 20)
        return rt

    made = _moe_prompt_against_f32(_moe_model(tmp_path, case), monkeypatch, new_rt, _MOE_PROMPT[:1])
    _check_moe_prompt_plans(made, decode_steps=False)
    calls = made[0].rt.ops.calls
    assert calls.count("read") == 2 and calls.count("moe_sort") == 2  # one host read a layer
    assert {"moe_gather_f16", "moe_scatter", "dequant_f16", "gemm_f16"} <= set(calls)
    # Mixtral's 40 pairs over 4 experts: padded blocks within twice the pairs, one batched GEMM a
    # product (gate, up, down of 2 layers); qwen3moe's 60 over 8, more unequal: a GEMM an expert
    assert calls.count("gemm_f16_batched") == (6 if case == "tiny-mixtral" else 0)


@pytest.mark.parametrize("case", ["tiny-mixtral", pytest.param("tiny-gptoss", marks=_SLOW),
                                  pytest.param("tiny-qwen3moe", marks=_SLOW)])
def test_moe_prompt_plan_on_the_cuda_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, emu_functions: Any,
                                              case: str) -> None:
    """The same through every kernels_cuda kernel on the emulator (moe.cu's moe_sort,
    moe_gather_f16, moe_scatter with SwiGLU / gpt-oss's biases and swiglu_oai, the experts'
    dequant_f16, fattn_tile with gpt-oss's sinks), the GEMM in numpy."""
    names: set[str] = set()
    new_rt = _logged_emu_runtime(emu_functions, names)
    # gpt-oss's tiny file is ~2.3x as sensitive to activation rounding as Mixtral's: its q8 path
    # against float32 0.025 of the largest logit (Mixtral 0.010, qwen3moe 0.0075); the f16 prompt
    # measured 1.1e-3 (Mixtral 4.9e-4, qwen3moe 3.9e-4): the same ~20x below the q8 path's
    tol = 2 * _F16_TOL if case == "tiny-gptoss" else _F16_TOL
    made = _moe_prompt_against_f32(_moe_prompt_model(tmp_path, case), monkeypatch, new_rt, tol=tol)
    _check_moe_prompt_plans(made)
    assert {"moe_sort", "moe_gather_f16", "amax_f32", "moe_scatter"} <= names
    assert any(n.startswith("fattn_tile_") for n in names)
