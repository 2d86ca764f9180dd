"""The CPU split executor: a split compiled once into op records over one arena, run by one
native call (ggml-cpu's `ggml_backend_cpu_graph_plan_create` / `_plan_compute`, and
ggml-alloc's tensor addresses; the records are run by kernels_c/executor.c).

`compile_split(nodes, exports, allocate)` walks the split's nodes once:
  * views (RESHAPE, VIEW, PERMUTE) and SET_ROWS results become addresses and strides, no op
    (SET_ROWS itself is a record: it stores rows into the KV cache — f32, f16, or Q8_0/Q4_0
    blocks quantized, and rotated where the cache is (llama.cpp's attn_rot), as kernels.set_rows);
  * every other node becomes a record, with the fusions llama.cpp's CPU backend makes: an
    RMS_NORM and the MUL by its weight are one record, and an ADD feeding that norm joins it;
  * memory: sched/alloc.py's `plan_offsets` (handed over by the scheduler) places every result
    and the *input slots* (graph inputs, values from other splits) in one arena, from the
    records' own lifetimes (a fused record reads its sources at its own step), followed by the
    quantized activations' scratch; weights and the KV cache are used where their buffers hold
    them. The arena is the backend's (`Arena`, ggml's compute buffer): its plans run one at a
    time and keep nothing there between runs, so they all share one block of memory, as large
    as the largest plan's, whose pages stay mapped from one run to the next (a prompt's
    micro-batches do not take fresh zeroed pages for their activations each step); a plan made
    while the block was smaller moves its addresses on its next run.
Threads: each run gets its backend's -t (never more than the cores): one team of threads
(kernels_c/team.c, one OpenMP region) walks all the records, sharing out the products, attention
and a big batch's row-wise ops, with barriers between records; a plan holds no thread state, so
contexts with different -t share nothing.
What changes every token (token ids, positions, KV cells, the mask, the number of cells attended)
is an input: copied into the input slots before the call. A mask's slot spans the whole cache;
its value's width is the number of cells attended (ops.flash_attn_ext), written with that row
length into the slot and into the ATTN records that read it, so one plan serves every length of
history.

A split the executor cannot compile (an op or a layout it does not know, a weight without a
repacked layout, a prompt-sized batch that the tile + sgemm path does better: the f32 mode's
batches of MAX_TOKENS and more) is refused:
`compile_split` returns a `Refusal`, and the scheduler runs that split with `run_nodes`, the
reference path. `LLAMAPY_EXECUTOR=0` (read when a CPU backend is made) refuses every split.

MUL_MAT follows the backend's mode (`ContextOptions.cpu_matmul`): "q8" (the default) quantizes
each input once per vec_dot_type (QUANTIZE record, shared by the products of that input) and
multiplies the file's rows (lp_mul_mat_q); "f32" runs the repacked float32 matvec (lp_mv_<t>).
A product on the sgemm path (a type without a q8 kernel in this library) refuses the split. The
token embedding rows of a file-layout matrix are expanded in Python before the call (one node).

Numerics: the records call the reference path's C kernels or repeat its float32 operations in
order, so logits are bit-identical to `run_nodes` in the q8 mode; in the f32 mode too, except
the f32 tail rows of a matrix whose row count is not a multiple of 64 (BLAS in the reference):
within float32 rounding. Attention is ops.c's kernel in both, for any number of query tokens: in
the q8 mode a batch of any size runs here (a prompt's micro-batch too), in the f32 mode up to
MAX_TOKENS - 1 tokens (e.g. a decode batch of several sequences).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..tensor import Op, Tensor, TensorFlag
from ..quants import KV_QUANT_TYPES, hadamard
from ..types import GGMLType, LlamapyError, block_size, row_nbytes, storage
from . import native
from .cpu_kernels import KV_CODES  # a KV cache's element type as ops.c's LP_KV_* codes
from .kernels import cache_rotation, gelu_table, rope_consts

ALIGN = 64  # the arena's alignment (AVX-512 loads); sched/alloc.py aligns offsets to 32
SCRATCH_ALIGN = 256  # a step's scratch (Target.step_scratch) starts this far aligned: cuBLAS's and wide loads' want

# Op codes and record size: kernels_c/executor.c's enum and EX_REC.
(GET_ROWS_Q, GET_ROWS_F32, RMS_NORM, MUL, ADD, SCALE, SWIGLU, MUL_MAT, ROPE, SET_ROWS, ATTN, CPY, QUANT_ACT,
 MUL_MAT_Q, SOFT_MAX, ARGSORT, SUM_ROWS, CLAMP, DIV, GET_ROWS_B, MUL_MAT_ID_Q, ADD_ID) = range(1, 23)
REC = 25
# GLU with GELU (gemma3's GEGLU): both targets' code (executor.c's EX_GEGLU reads slot 4, the GELU
# table; the GPU's kernel computes it). Codes from 33 on are records only the GPU target writes
# (gpu_plan.py), apart from executor.c's.
GEGLU = 32
OP_NAMES = {GEGLU: "GLU", GET_ROWS_Q: "GET_ROWS", GET_ROWS_F32: "GET_ROWS", RMS_NORM: "RMS_NORM", MUL: "MUL", ADD: "ADD",
            SCALE: "SCALE", SWIGLU: "GLU", MUL_MAT: "MUL_MAT", ROPE: "ROPE", SET_ROWS: "SET_ROWS",
            ATTN: "FLASH_ATTN_EXT", CPY: "CONT", QUANT_ACT: "QUANTIZE", MUL_MAT_Q: "MUL_MAT", SOFT_MAX: "SOFT_MAX",
            ARGSORT: "ARGSORT", SUM_ROWS: "SUM_ROWS", CLAMP: "CLAMP", DIV: "DIV", GET_ROWS_B: "GET_ROWS",
            MUL_MAT_ID_Q: "MUL_MAT_ID", ADD_ID: "ADD_ID"}  # fmt: skip


# executor.c's `ex_is_par`: records it never shares out, and the row-wise ones it shares out only
# over more than one row. A plan of nothing else (the token embedding's split at -ngl all) runs on
# the calling thread: a team would wake its threads for nothing.
_SERIAL = frozenset({GET_ROWS_Q, GET_ROWS_F32, GET_ROWS_B, SET_ROWS})
_ROWWISE = frozenset({RMS_NORM, MUL, ADD, SCALE, SWIGLU, ROPE, CPY, DIV, SOFT_MAX, ARGSORT, SUM_ROWS, CLAMP})


def serial_only(recs: np.ndarray) -> bool:
    """Whether executor.c runs every record of `recs` on thread 0 alone."""
    return all(int(r[0]) in _SERIAL or (int(r[0]) in _ROWWISE and r[6] <= 1) for r in recs)


def op_counts(recs: np.ndarray, ops: dict[str, int], names: dict[int, str] = OP_NAMES) -> str:
    """`RMS_NORM:9 MUL_MAT:28 …`: the records of a plan by ggml op name."""
    for code in recs[:, 0]:
        k = names.get(int(code), str(int(code)))
        ops[k] = ops.get(k, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in ops.items())
# In the f32 mode, batches from this many tokens are left to run_nodes: its tile + sgemm path is
# faster there (qmatmul.SGEMM_MIN_TOKENS). In the q8 mode every MUL_MAT a compiled split has
# stays on the per-block q8 kernels at any row count (qmatmul.Q8_GEMM: no sgemm to be faster; a
# product on the sgemm path refuses the split), so batches of any size are compiled: a prompt's
# micro-batch, a server step of decode tokens plus prompt chunks (engine.py). Its activations
# take the backend's shared arena, not memory of the plan's own.
MAX_TOKENS = 16

_DTYPES = {GGMLType.F32: np.dtype(np.float32), GGMLType.F16: np.dtype(np.float16),
           GGMLType.I32: np.dtype(np.int32), GGMLType.I64: np.dtype(np.int64)}  # fmt: skip


class Arena:
    """One backend's compute memory for its compiled plans (ggml-alloc's compute buffer, sized to
    the largest graph). Plans run one at a time on their backend and keep nothing in it between
    runs (inputs are copied in, exports out), so they share it: it grows to the largest plan's
    size and stays, and a plan made before it last grew moves its addresses (`ExecPlan`) on its
    next run. The memory is a numpy buffer (zeroed, its pages mapped on first touch)."""

    def __init__(self) -> None:
        self.raw: np.ndarray | None = None
        self.base = 0  # its first ALIGN-aligned address
        self.pad = 0  # where that address lies in `raw` (slots are views at pad + offset)
        self.size = 0
        self.views: dict[Any, Any] = {}  # _Slot.view's and each ExecPlan's, made once per block

    def ensure(self, nbytes: int) -> int:
        """The base address of at least `nbytes` of arena."""
        if nbytes > self.size or self.raw is None:
            self.raw, self.views = None, {}  # the old block goes before the new one is made: never both
            raw = np.zeros(nbytes + ALIGN, np.uint8)
            self.raw, self.pad, self.size = raw, -raw.ctypes.data % ALIGN, nbytes
            self.base = raw.ctypes.data + self.pad
        return self.base


def enabled() -> bool:
    """LLAMAPY_EXECUTOR=0 (or off/no) keeps every split on run_nodes."""
    return os.environ.get("LLAMAPY_EXECUTOR", "1").lower() not in ("0", "off", "no")


class Refused(Exception):
    """This split cannot be compiled (the reason is the message)."""


@dataclass(frozen=True)
class Refusal:
    """A split left to run_nodes, and why (shown by LLAMAPY_SCHED_DEBUG). Falsy: "no plan"."""

    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class Loc:
    """Where a value lives: address, shape, strides in elements (numpy order), element type,
    and the object owning the memory (the arena, or a buffer's array)."""

    addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    owner: Any

    def contiguous(self) -> bool:
        return self.strides == _cstrides(self.shape)

    def rows(self) -> tuple[int, int, int]:
        """(rows, n, row stride): the value as rows of its last dimension, the rows evenly
        spaced; Refused when it is not."""
        if not self.shape:
            return 1, 1, 1
        n = self.shape[-1]
        if self.strides[-1] != 1 and n > 1:
            raise Refused(f"a {list(self.shape)} value whose last dimension is strided")
        lead, st = self.shape[:-1], self.strides[:-1]
        dims = [(d, s) for d, s in zip(lead, st) if d != 1]
        if not dims:
            return 1, n, n
        for (d0, s0), (d1, s1) in zip(dims, dims[1:]):
            if s0 != s1 * d1:
                raise Refused(f"a {list(self.shape)} value whose rows are not evenly spaced")
        rows = 1
        for d, _ in dims:
            rows *= d
        return rows, n, dims[-1][1]

    def array(self) -> np.ndarray:
        """A numpy view of this memory (an input slot, an export)."""
        base = self.owner
        isz = self.dtype.itemsize
        return np.ndarray(self.shape, self.dtype, buffer=base, offset=self.addr - base.ctypes.data,
                          strides=tuple(s * isz for s in self.strides))


def _cstrides(shape: tuple[int, ...]) -> tuple[int, ...]:
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return tuple(reversed(st))


def _array_loc(a: np.ndarray) -> Loc:
    isz = a.itemsize
    if any(s % isz for s in a.strides):
        raise Refused("an array with unaligned strides")
    return Loc(a.ctypes.data, a.shape, tuple(s // isz for s in a.strides), a.dtype, a)


@dataclass
class _NativeMatrix:
    """What a MUL_MAT / GET_ROWS record needs of a weight matrix."""

    mv: int  # matvec function of a team's thread, lp_mvp_<t> (0: the f32 rows do everything)
    dqr: int  # selected rows, expanded
    parts: int  # pointer to the repacked arrays' pointers
    n_tiles: int
    nb: int
    n_full: int  # rows in the repacked tiles
    rows_f32: np.ndarray | None  # float32 rows n_full.. (the tail, or a whole F32 matrix)
    keep: Any  # the matrix (it owns `parts`)


def native_matrix(w: Any) -> _NativeMatrix:
    """The native layout of a host weight matrix (a QMatrix of qmatmul.py), or Refused.

    This is the one place that knows QMatrix's repacked layout (the float32-activation mode's
    tiles); the quantized-activation mode reads the file's rows (`QMatrix.data`)."""
    from .qmatmul import REPACK_ROWS, QMatrix

    if not isinstance(w, QMatrix):
        raise Refused(f"a MUL_MAT weight of type {type(w).__name__}")
    if not w.repacked:
        if w.qtype == GGMLType.F32:
            return _NativeMatrix(0, 0, 0, 0, 0, 0, np.ascontiguousarray(w.data.view(np.float32)), w)
        raise Refused(f"{w.qtype.name} weights without a repacked C layout")
    fns = w._c()
    nb = w.n_in // block_size(w.qtype)[0]
    tail = w._tail_rows() if w._n_full < w.n_out else None
    addr = ctypes.cast
    return _NativeMatrix(
        addr(fns[3], ctypes.c_void_p).value or 0, addr(fns[2], ctypes.c_void_p).value or 0,
        ctypes.addressof(w._cparts), w._n_full // REPACK_ROWS, nb, w._n_full, tail, w,
    )


@dataclass
class _Step:
    """One record to be: the op code, the node(s) it computes, the tensors it reads."""

    code: int
    node: Tensor  # the result (its value in the arena)
    reads: list[Tensor]
    extra: dict[str, Any] = field(default_factory=dict)
    scratch: tuple[int, ...] = ()  # arena offsets of the target's scratches alive during this step alone


@dataclass(frozen=True)
class _Slot:
    """An array in the arena, at `off` bytes from its base (made a numpy view for each run)."""

    off: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    dtype: np.dtype

    def view(self, arena: Arena, cols: int = 0) -> np.ndarray:
        """The slot, or with `cols` its first (…, cols) elements as contiguous rows. Made once
        per arena block: a decode step makes no array (after a native call that swept the
        weights through the caches, each numpy call of a step costs tens of microseconds)."""
        key = (self, cols)
        if key not in arena.views:
            if len(arena.views) > 1024:  # (views of plans since forgotten, e.g. a server's many prompt sizes)
                arena.views.clear()
            shape = (*self.shape[:-1], cols) if cols else self.shape
            strides = tuple(st * self.dtype.itemsize for st in _cstrides(shape)) if cols else self.strides
            arena.views[key] = np.ndarray(shape, self.dtype, buffer=arena.raw, offset=arena.pad + self.off, strides=strides)
        return arena.views[key]


# The record slots that may hold addresses of the arena: 1 (the destination) .. 5 (sources), and
# an RMS_NORM record's 10 (its fused ADD's result; executor.c's layout)
_ADDR_SLOTS = (1, 2, 3, 4, 5)


@dataclass
class ExecPlan:
    """A compiled split: records over the backend's arena, the inputs to copy in, the exports to
    copy out (arena slots; an export elsewhere, e.g. the KV cache's memory, as its array)."""

    recs: np.ndarray  # (n, REC) int64
    arena: Arena
    nbytes: int  # of the arena this plan uses
    base: int  # the arena's base address the records hold
    moves: tuple[np.ndarray, np.ndarray]  # (record, slot) indices of the addresses in the arena
    inputs: list[tuple[Tensor, _Slot]]  # (tensor, its slot)
    exports: list[tuple[Tensor, _Slot | np.ndarray]]  # (node, its slot, or the array outside the arena)
    keep: list[Any]  # whatever the records point into
    n_nodes: int
    n_fused: int
    run: Any  # the C entry point
    pre: list[tuple[_Slot, Any, Tensor]] = field(default_factory=list)  # (slot, matrix, ids)
    masks: list[tuple[Tensor, _Slot, np.ndarray]] = field(default_factory=list)  # (mask, slot, its ATTN records)
    n_threads: int = 0  # of the last run
    native_s: float = 0.0  # seconds inside the native call, summed over runs (for the timer)
    recs_ptr: int = 0
    n_runs: int = 0
    serial: bool = False  # every record runs on thread 0: the call makes no team
    # the key of this plan's views in the arena's `views` (the inputs', the exports'): made once
    # per arena block, not looked up slot by slot each run
    key: object = field(default_factory=object)

    def __post_init__(self) -> None:
        self.recs_ptr = self.recs.ctypes.data
        self.serial = serial_only(self.recs)

    def _move(self, base: int) -> None:
        """The arena was made again (larger) since these records were written: move them."""
        self.recs[self.moves] += base - self.base
        self.base = base

    def summary(self) -> str:
        ops: dict[str, int] = {}
        if self.pre:
            ops["GET_ROWS (Python)"] = len(self.pre)
        counts = op_counts(self.recs, ops)
        return (f"executor: {len(self.recs)} records for {self.n_nodes} nodes ({self.n_fused} fused), "
                f"arena {self.nbytes / 1024:.0f} KiB, {len(self.inputs) + len(self.masks)} inputs, "
                f"{len(self.exports)} exports [{counts}]")

    def compute(self, env: dict[Tensor, Any], n_threads: int) -> None:
        """One run: inputs copied in, one native call on `n_threads` threads, exports out."""
        arena = self.arena
        base = arena.ensure(self.nbytes)
        if base != self.base:
            self._move(base)
        views = arena.views.get(self.key)
        if views is None:
            views = arena.views[self.key] = (
                [(t, slot.view(arena)) for t, slot in self.inputs],
                [(t, mem.view(arena) if isinstance(mem, _Slot) else None, mem) for t, mem in self.exports],
            )  # fmt: skip
        for t, view in views[0]:
            view[...] = env[t]
        for t, slot, rows in self.masks:
            n = (v := env[t]).shape[-1]  # the cells attended: the records' N and mask row length
            if not 0 < n <= slot.shape[-1]:
                raise LlamapyError(f"executor: a {list(v.shape)} mask for {list(slot.shape)}")
            slot.view(arena, n)[...] = v
            if self.recs[rows[0], 9] != n:  # (a new width every 256 cells)
                self.recs[rows, 9] = self.recs[rows, 16] = n
        for slot, w, ids in self.pre:
            slot.view(arena)[...] = w.get_rows(env[ids])
        recs = self.recs
        if self.serial:
            n_threads = 1
        t0 = time.perf_counter()
        rc = self.run(self.recs_ptr, len(recs), n_threads)
        self.native_s += time.perf_counter() - t0
        self.n_runs += 1
        self.n_threads = n_threads
        if rc:
            raise LlamapyError(f"executor: record {rc - 1} (op {int(recs[rc - 1, 0])}) failed: a row id out of "
                               "range, or no kernel for a type")
        for t, view, mem in views[1]:
            env[t] = mem if view is None else view.copy()


def _lib() -> Any:
    lib = native.lib()
    if lib is None:
        raise Refused(f"no C kernels ({native.error()})")
    try:
        fn = lib.lp_exec_run
    except AttributeError:
        raise Refused("the kernel library has no executor") from None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int64
    lib.lp_exec_caps.argtypes = []
    lib.lp_exec_caps.restype = ctypes.c_int64
    return lib


def _leaf_value(t: Tensor) -> Any | None:
    """The buffer value of a weight / KV-cache leaf in host memory, None for an input."""
    r = t.root()
    if r.buffer is None:
        return None
    if not r.buffer.buft.is_host:
        # device memory: the scheduler copies it in as a split input
        if r.flags & TensorFlag.WEIGHT:
            raise Refused(f"weight {r.name} in {r.buffer.name} memory")
        return None
    return r.buffer.storage(r)


class Target:
    """What the record compiler asks of the memory its records point into: the one seam between
    the compiler and its two launchers (the CPU's `HostTarget` below, which kernels_c/executor.c
    runs; the GPU's in gpu_plan.py, whose records are kernel launches). Everything else — the
    steps, the fusions, the arena offsets from sched/alloc.py, the records of the row-wise ops,
    ROPE, SET_ROWS and attention — is shared, so both plans of a split have the same records."""

    name = "executor"
    glu_ops: tuple[str, ...] = ("swiglu",)  # the GLU variants its records run
    attn_sinks = False  # whether its ATTN records take gpt-oss's sinks (slot 24)
    fuse_glu = False  # a GLU of the two halves of the product before it joins that product's step
    fuse_bias = False  # an ADD_ID / ADD of a bias after a product joins that product's step (an epilogue)
    head = 0  # bytes at the arena's start before the allocator's offsets (the GPU's count slots)
    max_tokens: int | None = None  # batches from this many tokens are refused
    width = REC  # int64 slots per record

    def leaf(self, t: Tensor) -> Any | None:
        """The value of a weight / KV-cache leaf in this target's memory; None for a value
        copied in (an input); Refused for a weight it cannot read."""
        raise NotImplementedError

    def array_loc(self, v: Any, keep: list[Any]) -> Loc:
        """Where an array of this memory lies (Refused for anything else)."""
        raise NotImplementedError

    def host_array(self, v: Any) -> np.ndarray:
        """A host copy of a small leaf read at compile time (rope frequency factors)."""
        raise NotImplementedError

    def const(self, a: np.ndarray, keep: list[Any]) -> int:
        """The address of a constant table the compiler made (rope's inverse frequencies)."""
        raise NotImplementedError

    def gelu_table(self, keep: list[Any]) -> int:
        """The address of the GELU table a GEGLU record reads (slot 4), or 0: the GPU's kernels
        compute it."""
        return 0

    def export(self, l: Loc) -> Any:
        """The value of an export that lies outside the arena (the KV cache's memory)."""
        raise NotImplementedError

    def pre_rows(self, tv: Any) -> bool:
        """Whether a GET_ROWS of this table is expanded in Python before the call."""
        return False

    def id_type(self, n: Tensor) -> int | None:
        """The vec_dot_type a MUL_MAT_ID's experts run in; None: it has no record here."""
        return None

    def f16_stores(self) -> bool:
        return True

    def step_scratch(self, c: _Compiler, st: _Step) -> tuple[int, ...]:
        """Bytes of each scratch `st`'s records use during that step alone: the allocator places
        them among the values, as ggml-alloc places a node's temporaries (`st.scratch`: where)."""
        return ()

    def scratch(self, c: _Compiler, start: int) -> int:
        """The arena's bytes in all, from `start` (the end of the allocator's offsets): room for
        the scratches that outlive a step."""
        return start

    def records(self, c: _Compiler, st: _Step, loc: Callable[[Tensor], Loc]) -> list[list[int]] | None:
        """The records of a step this target writes itself (products, rows of a weight); None:
        the shared ones (`_Compiler._record`)."""
        return None

    # (slot, op code): record slots beyond the shared ones that hold arena addresses
    addr_slots: tuple[tuple[int, int], ...] = ()

    def finish(self, c: _Compiler, recs: list[list[int]], masks: list[tuple[Tensor, _Slot, np.ndarray]],
               exports: list[tuple[Tensor, Any]]) -> None:
        """Last touches to the records once every step has its own (the GPU's count slots)."""


class HostTarget(Target):
    """The CPU executor's memory: host buffers (numpy arrays, QMatrix weights), kernels_c's
    executor. The MUL_MAT records follow the backend's mode: "q8" quantizes each input once per
    vec_dot_type (QUANTIZE record, shared by the products of that input) and multiplies the
    file's rows; "f32" runs the repacked float32 matvec."""

    glu_ops = ("swiglu", "swiglu_oai", "geglu")
    attn_sinks = True
    addr_slots = ((15, MUL_MAT_ID_Q),)  # its workspace

    def __init__(self, lib: Any, q8: bool) -> None:
        self.lib = lib
        self.q8 = q8
        self.max_tokens = None if q8 else MAX_TOKENS
        self.quantized: dict[int, Any] = {}  # vec_dot_type -> the input its scratch holds now
        self.offsets: dict[int, int] = {}  # vec_dot_type -> the arena offset of its quantized activations
        self.mmid_wsp = 0  # the arena offset of the MUL_MAT_ID records' workspace (lp_mul_mat_id_q_wsp)
        self.gelu: np.ndarray | None = None  # kernels.gelu_table, for the GEGLU records

    def leaf(self, t: Tensor) -> Any | None:
        return _leaf_value(t)

    def array_loc(self, v: Any, keep: list[Any]) -> Loc:
        if not isinstance(v, np.ndarray):
            raise Refused(f"a {type(v).__name__} where an array is needed")
        keep.append(v)
        return _array_loc(v)

    def host_array(self, v: Any) -> np.ndarray:
        if not isinstance(v, np.ndarray):
            raise Refused("rope_freqs without a buffer")
        return v

    def const(self, a: np.ndarray, keep: list[Any]) -> int:
        keep.append(a)
        return a.ctypes.data

    def gelu_table(self, keep: list[Any]) -> int:
        if self.gelu is None:
            self.gelu = gelu_table()  # (once a compile: 65536 values)
        return self.const(self.gelu, keep)

    def export(self, l: Loc) -> Any:
        return l.array()

    def pre_rows(self, tv: Any) -> bool:
        from .qmatmul import QMatrix

        return isinstance(tv, QMatrix) and not tv.repacked and tv.qtype not in KV_CODES  # (those: a native record)

    def f16_stores(self) -> bool:
        return bool(self.lib.lp_exec_caps() & 1)

    def scratch(self, c: _Compiler, start: int) -> int:
        """Room for each vec_dot_type's quantized activations (the largest product's) and for the
        largest MUL_MAT_ID's workspace, in the arena from `start` (self.offsets, self.mmid_wsp:
        theirs); the arena's bytes in all."""
        need: dict[int, int] = {}
        wsp = 0
        for st in c.steps:
            if st.code not in (MUL_MAT, MUL_MAT_ID_Q):
                continue
            w, x = st.node.src[:2]
            wv = _leaf_value(w) if w.is_leaf else None
            q = self.id_type(st.node) if st.code == MUL_MAT_ID_Q else self._q8_type(wv, x.n_elements // x.shape[-1])
            if q is not None:
                rb = int(self.lib.lp_act_row_bytes(int(wv.qtype), wv.n_in))
                need[q] = max(need.get(q, 0), rb * (x.n_elements // x.shape[-1]))
            if q is not None and st.code == MUL_MAT_ID_Q:
                T, U, M = st.node.shape
                wsp = max(wsp, int(self.lib.lp_mul_mat_id_q_wsp(int(wv.qtype), w.shape[0], M, wv.n_in, T, U)))
        self.offsets = {}
        end = start
        for q, n in need.items():
            end += (-end) % ALIGN
            self.offsets[q] = end
            end += n
        end += (-end) % ALIGN
        self.mmid_wsp = end
        return end + wsp

    def _q8_type(self, wv: Any, n_tok: int) -> int | None:
        """The vec_dot_type a product runs in (the q8 mode's path), None for the other paths."""
        from .qmatmul import QMatrix

        if not isinstance(wv, QMatrix) or not self.q8 or wv.path(n_tok, True) != "q8":
            return None
        return wv.vec_dot_type()

    def id_type(self, n: Tensor) -> int | None:
        """The vec_dot_type of a MUL_MAT_ID's experts in the q8 mode (always the q8 kernel, at any
        number of tokens, as the CPU backend's run_nodes path), None without one."""
        from .qmatmul import QMatrix

        wv = _leaf_value(n.src[0]) if n.src[0].is_leaf else None
        if not isinstance(wv, QMatrix) or not self.q8:
            return None
        return wv.vec_dot_type()

    def records(self, c: _Compiler, st: _Step, loc: Callable[[Tensor], Loc]) -> list[list[int]] | None:
        if st.code == MUL_MAT_ID_Q:
            return self._mul_mat_id_q8(c, st.node, loc)
        if st.code == MUL_MAT:
            w, x = st.node.src
            wv = _leaf_value(w) if w.is_leaf else None
            xl = loc(x)
            n_tok = xl.rows()[0] if xl.dtype == np.dtype(np.float32) else 0
            vdt = self._q8_type(wv, n_tok)
            if vdt is not None:
                return self._mul_mat_q8(c, st.node, loc(st.node).addr, wv, xl, vdt)
            return [self._mul_mat(c, st.node, loc)]
        if st.code == GET_ROWS_F32:
            table = st.node.src[0]
            tv = _leaf_value(table) if table.is_leaf else None
            if tv is not None and not isinstance(tv, np.ndarray):
                return [self._get_rows(c, st.node, tv, loc)]
        return None

    def _mul_mat_q8(self, c: _Compiler, n: Tensor, dst: int, wv: Any, xl: Loc, vdt: int) -> list[list[int]]:
        """QUANTIZE (unless this input is what the vec_dot_type's scratch holds already: the
        Q/K/V or gate/up products of one input) and MUL_MAT_Q records."""
        n_tok, n_in, xs = xl.rows()
        x = n.src[1]
        key = (c._base(x), xl.addr, xl.strides)
        xq = c.base + self.offsets[vdt]
        out: list[list[int]] = []
        if self.quantized.get(vdt) != key:
            r = [0] * REC
            r[0], r[1], r[2], r[6], r[7], r[8], r[9] = QUANT_ACT, xq, xl.addr, int(wv.qtype), xs, n_in, n_tok
            out.append(r)
            self.quantized[vdt] = key
        r = [0] * REC
        r[0], r[1], r[2], r[3], r[6], r[7], r[8], r[9], r[10], r[11] = MUL_MAT_Q, dst, wv.data.ctypes.data, xq, \
            int(wv.qtype), wv.n_out, wv.data.shape[1], n_in, n_tok, wv.n_out  # fmt: skip
        c.keep.append(wv)
        out.append(r)
        return out

    def _quantize(self, c: _Compiler, x: Tensor, xl: Loc, wv: Any, vdt: int) -> list[list[int]]:
        """A QUANTIZE record of `x` into the vec_dot_type's scratch, unless it holds `x` already."""
        n_tok, n_in, xs = xl.rows()
        key = (c._base(x), xl.addr, xl.strides)
        if self.quantized.get(vdt) == key:
            return []
        r = [0] * REC
        r[0], r[1], r[2], r[6], r[7], r[8], r[9] = QUANT_ACT, c.base + self.offsets[vdt], xl.addr, int(wv.qtype), \
            xs, n_in, n_tok  # fmt: skip
        self.quantized[vdt] = key
        return [r]

    def _mul_mat_id_q8(self, c: _Compiler, n: Tensor, loc: Callable[[Tensor], Loc]) -> list[list[int]]:
        """QUANTIZE (the input's rows: one per token for gate / up, shared by both) and a
        MUL_MAT_ID_Q record (kernels_c/qmatmul.c lp_mul_mat_id_q_par)."""
        w, x, ids = n.src
        wv = _leaf_value(w)
        vdt = self.id_type(n)
        xl = loc(x)
        if xl.dtype != np.dtype(np.float32):
            raise Refused(f"MUL_MAT_ID {n.name} input of type {xl.dtype}")
        il = loc(ids)
        if il.dtype != np.dtype(np.int32) or len(il.shape) != 2 or il.strides[1] != 1:
            raise Refused(f"MUL_MAT_ID {n.name} ids layout")
        out = self._quantize(c, x, xl, wv, vdt)  # type: ignore[arg-type]
        T, U, M = n.shape
        r = [0] * REC
        r[0], r[1], r[2], r[3], r[4] = MUL_MAT_ID_Q, loc(n).addr, wv.data.ctypes.data, \
            c.base + self.offsets[vdt], il.addr  # type: ignore[index]  # fmt: skip
        r[6], r[7], r[8], r[9], r[10] = int(wv.qtype), w.shape[0], M, wv.data.shape[1], wv.n_in
        r[11], r[12], r[13], r[14], r[15] = x.shape[1], il.strides[0], T, U, c.base + self.mmid_wsp
        c.keep.append(wv)
        return [*out, r]

    def _get_rows(self, c: _Compiler, n: Tensor, tv: Any, loc: Callable[[Tensor], Loc]) -> list[int]:
        """GET_ROWS of a host weight matrix (the token embeddings)."""
        r = [0] * REC
        r[0], r[1] = GET_ROWS_F32, loc(n).addr
        il = loc(n.src[1])
        if il.dtype != np.dtype(np.int32) or not il.contiguous():
            raise Refused("GET_ROWS ids that are not int32")
        kv = KV_CODES.get(tv.qtype, 0) if not getattr(tv, "repacked", True) else 0
        if kv:  # F16 / Q8_0 / Q4_0 rows as the file has them, expanded by ops.c's cache-row code
            c.keep.append(d := tv.data)
            r[2], r[3], r[6], r[7] = d.ctypes.data, il.addr, n.src[1].n_elements, tv.n_in
            r[8], r[9], r[10] = d.strides[0], tv.n_out, kv
            return r
        m = native_matrix(tv)
        c.keep.append(m)
        if m.mv == 0:  # an F32 matrix: its rows are an array
            tl = _array_loc(m.rows_f32)  # type: ignore[arg-type]
            r[2], r[3] = tl.addr, il.addr
            r[6], r[7], r[8], r[9] = n.src[1].n_elements, tv.n_in, tv.n_in, tv.n_out
            return r
        r[0] = GET_ROWS_Q
        r[2], r[6], r[7], r[8], r[9], r[10], r[11] = il.addr, n.src[1].n_elements, tv.n_in, m.nb, m.dqr, m.parts, \
            m.n_full  # fmt: skip
        r[12] = m.rows_f32.ctypes.data if m.rows_f32 is not None else 0
        r[13] = tv.n_out
        return r

    def _mul_mat(self, c: _Compiler, n: Tensor, loc: Callable[[Tensor], Loc]) -> list[int]:
        """The f32 mode's product: the repacked float32 matvec."""
        from .qmatmul import QMatrix

        r = [0] * REC
        r[0], r[1] = MUL_MAT, loc(n).addr
        w, x = n.src
        wv = _leaf_value(w) if w.is_leaf else None
        if wv is None or isinstance(wv, np.ndarray):
            raise Refused(f"MUL_MAT {n.name} with an activation or array weight")
        if isinstance(wv, QMatrix) and not wv.repacked and wv.qtype != GGMLType.F32:
            n_tok = x.n_elements // x.shape[-1]
            raise Refused(f"{wv.qtype.name} MUL_MAT of {n_tok} tokens on the {wv.path(n_tok, self.q8)} path")
        m = native_matrix(wv)
        c.keep.append(m)
        xl = loc(x)
        if xl.dtype != np.dtype(np.float32):
            raise Refused(f"MUL_MAT input of type {xl.dtype}")
        n_tok, n_in, xs = xl.rows()
        if n_tok >= MAX_TOKENS:
            raise Refused(f"a batch of {n_tok} tokens (the tile + sgemm path is faster)")
        if xs != n_in and n_tok > 1:
            raise Refused(f"MUL_MAT {n.name} of strided rows")
        r[2], r[6], r[7], r[8], r[9], r[10], r[11], r[12] = xl.addr, n_tok, n_in, xs, m.mv, m.parts, m.n_tiles, m.nb
        r[13], r[14] = wv.n_out, m.n_full
        r[15] = m.rows_f32.ctypes.data if m.rows_f32 is not None else 0
        return r


def compile_split(
    nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Callable[..., Any], cpu_matmul: str = "q8",
    arena: Arena | None = None,
) -> ExecPlan | Refusal:
    """Compile a split's nodes; a Refusal when any of them is beyond the executor. `allocate`:
    the scheduler's allocator (sched/alloc.py `plan_offsets`; backends do not import sched);
    `cpu_matmul`: the backend's MUL_MAT mode ("q8": quantized activations, "f32"); `arena`: the
    backend's (its plans share it; default: one of the plan's own)."""
    from .qmatmul import kernels

    try:
        if kernels() != "c":
            raise Refused(f"kernels are {kernels()!r}, not C")
        lib = _lib()
        b = _Compiler(nodes, exports, HostTarget(lib, cpu_matmul == "q8"), allocate).build(arena or Arena())
        return ExecPlan(b.recs, b.arena, b.nbytes, b.base, b.moves, b.inputs, b.exports, b.keep, b.n_nodes,
                        b.n_fused, lib.lp_exec_run, b.pre, b.masks)
    except Refused as e:
        return Refusal(str(e))


@dataclass
class Built:
    """A split compiled into records over an arena: what either launcher's plan is made of."""

    recs: np.ndarray  # (n, target.width) int64
    arena: Any
    nbytes: int  # of the arena the plan uses
    base: int  # the arena's base address the records hold
    moves: tuple[np.ndarray, np.ndarray]  # (record, slot) indices of the addresses in the arena
    inputs: list[tuple[Tensor, _Slot]]
    exports: list[tuple[Tensor, Any]]  # (node, its slot, or its value outside the arena)
    keep: list[Any]
    n_nodes: int
    n_fused: int
    pre: list[tuple[_Slot, Any, Tensor]]
    masks: list[tuple[Tensor, _Slot, np.ndarray]]


class _Compiler:
    def __init__(self, nodes: Sequence[Tensor], exports: Sequence[Tensor], target: Target, allocate: Any) -> None:
        self.allocate = allocate
        self.target = target
        self.max_tokens = target.max_tokens
        self.pre: list[Tensor] = []  # GET_ROWS of file-layout rows, run in Python before the call
        self.base = 0  # the arena's address while the records are written
        self.nodes = list(nodes)
        self.own = set(self.nodes)
        self.exports = list(exports)
        self.readers: dict[Tensor, int] = {}
        for n in self.nodes:
            for s in n.src:
                self.readers[s] = self.readers.get(s, 0) + 1
        for e in self.exports:
            self.readers[e] = self.readers.get(e, 0) + 1
        self.alias: dict[Tensor, Tensor] = {}  # a view / SET_ROWS node -> the tensor it shows
        self.inputs: list[Tensor] = []  # values copied in each run
        self.steps: list[_Step] = []
        self.n_fused = 0

    # -- pass 1: steps and the tensors that need memory -------------------------------------

    def _base(self, t: Tensor) -> Tensor:
        """The tensor owning `t`'s memory, following views (inside this split)."""
        while t in self.alias:
            t = self.alias[t]
        return t

    def _source(self, t: Tensor) -> None:
        """Register a tensor read by this split but not computed here."""
        if t in self.own or t in self.inputs:
            return
        if t.is_leaf and self.target.leaf(t) is not None:
            return  # a weight or the KV cache, read where it is
        if t.type not in _DTYPES:
            raise Refused(f"input {t.name} of type {t.type.name}")
        self.inputs.append(t)

    def steps_pass(self) -> None:
        for n in self.nodes:
            for s in n.src:
                self._source(s)
            op = n.op
            if op in (Op.RESHAPE, Op.VIEW, Op.PERMUTE):
                self.alias[n] = n.src[0]
                continue
            if op is Op.SET_ROWS:
                if not n.src[0].is_leaf or self.target.leaf(n.src[0]) is None:
                    raise Refused("SET_ROWS into a tensor without a buffer")
                self.alias[n] = n.src[0]
                self.steps.append(_Step(SET_ROWS, n, list(n.src)))
                continue
            if n.type is not GGMLType.F32 and not (op is Op.ARGSORT and n.type is GGMLType.I32):
                raise Refused(f"{op.name} {n.name} of type {n.type.name}")
            if self.max_tokens is not None and len(n.shape) >= 2 and n.shape[0] >= self.max_tokens:
                raise Refused(f"a batch of {n.shape[0]} tokens")  # the f32 mode's sgemm is faster there
            if op is Op.MUL and self._fuse_norm_mul(n):
                continue
            if op is Op.ADD_ID and self.target.fuse_bias and self._fuse_mul_mat_id_bias(n):
                continue
            if op is Op.ADD and self.target.fuse_bias and self._fuse_mul_mat_bias(n):
                continue
            if op is Op.GLU and self.target.fuse_glu and n.params.get("op") in self.target.glu_ops \
                    and (self._fuse_mul_mat_glu(n) or self._fuse_mul_mat_id_glu(n)):
                continue
            code = {Op.GET_ROWS: GET_ROWS_F32, Op.RMS_NORM: RMS_NORM, Op.MUL: MUL, Op.ADD: ADD, Op.SCALE: SCALE,
                    Op.GLU: SWIGLU, Op.MUL_MAT: MUL_MAT, Op.ROPE: ROPE, Op.FLASH_ATTN_EXT: ATTN,
                    Op.CONT: CPY, Op.SOFT_MAX: SOFT_MAX, Op.ARGSORT: ARGSORT, Op.SUM_ROWS: SUM_ROWS,
                    Op.CLAMP: CLAMP, Op.DIV: DIV, Op.MUL_MAT_ID: MUL_MAT_ID_Q, Op.ADD_ID: ADD_ID}.get(op)  # fmt: skip
            if code is None:
                raise Refused(f"op {op.name} ({n.name})")
            if op is Op.SOFT_MAX and len(n.src) > 1:
                raise Refused(f"SOFT_MAX {n.name} with a mask")
            if op is Op.MUL_MAT_ID and self.target.id_type(n) is None:
                raise Refused(f"MUL_MAT_ID {n.name} without a q8 kernel (the f32 mode, or the weight's type)")
            if op is Op.GET_ROWS and len(n.src[1].shape) == 2:
                code = GET_ROWS_B
            if op is Op.GLU and n.params.get("op") not in self.target.glu_ops:
                raise Refused(f"GLU {n.params.get('op')}")
            if op is Op.GLU and n.params.get("op") == "geglu":
                code = GEGLU
            if op is Op.RMS_NORM:
                self._fuse_add_norm(n)
                continue
            if op is Op.GET_ROWS and self._pre_get_rows(n):
                continue
            self.steps.append(_Step(code, n, list(n.src)))

    def _pre_get_rows(self, n: Tensor) -> bool:
        """GET_ROWS of a matrix kept in the file's layout (the token embeddings in the q8 mode)
        in a type other than F32/F16/Q8_0/Q4_0 (a K type), whose ids are an input: the rows are
        expanded in Python (QMatrix.get_rows, the reference path's function) into the node's
        arena slot before the native call (the host target's; a GPU reads no such rows)."""
        table, ids = n.src
        tv = self.target.leaf(table) if table.is_leaf else None
        if not self.target.pre_rows(tv):
            return False
        if ids not in self.inputs:
            raise Refused(f"GET_ROWS {n.name} of {tv.qtype.name} rows with computed ids")
        self.pre.append(n)
        return True

    def _fuse_add_norm(self, norm: Tensor) -> None:
        """RMS_NORM, joined by the ADD that made its input when that ADD is the step just before
        (the residual add and the next norm: ggml-cpu's add + rms_norm fusion)."""
        prev = self.steps[-1] if self.steps else None
        x = norm.src[0]
        if prev is not None and prev.code == ADD and prev.node is x and "norm" not in prev.extra:
            prev.code = RMS_NORM
            prev.extra = {"add": x, "norm": norm}
            prev.node = norm
            prev.reads = [*x.src, x]
            self.n_fused += 1
            return
        self.steps.append(_Step(RMS_NORM, norm, [x], {"norm": norm}))

    def _fuse_mul_mat_glu(self, glu: Tensor) -> bool:
        """GLU(gate, up) folded into the MUL_MAT step of the stacked gate/up matrix when gate and
        up are its two halves and nothing else reads it (the product is then never stored: the
        step's result is the GLU's, placed apart from the product's input, which it reads to the
        end). Targets with a product whose epilogue is the GLU only (the GPU's)."""
        prev = self.steps[-1] if self.steps else None
        if prev is None or prev.code != MUL_MAT or prev.extra:  # (one epilogue a product)
            return False
        mm, (g, u) = prev.node, glu.src
        n_ff = g.shape[-1]
        if mm.shape[-1] != 2 * n_ff or any(s.op is not Op.VIEW or s.src[0] is not mm for s in (g, u)):
            return False
        if g.params.get("cols") != (0, n_ff) or u.params.get("cols") != (n_ff, 2 * n_ff):
            return False
        if (self.readers.get(mm, 0), self.readers.get(g, 0), self.readers.get(u, 0)) != (2, 1, 1):
            return False
        prev.extra.update(glu=glu, mm=mm)
        prev.node = glu
        self.n_fused += 1
        return True

    def _fuse_mul_mat_id_glu(self, glu: Tensor) -> bool:
        """GLU(gate, up) of the two MUL_MAT_IDs just before it (the experts' gate and up products
        of one input and one routing, either order, read by nothing else) as one step: the
        GLU's result, placed apart from the products' input, which it reads to the end (the
        GPU's expert product with its GLU epilogue)."""
        if len(self.steps) < 2:
            return False
        s1, s2 = self.steps[-2:]
        g, u = glu.src
        if {s1.node, s2.node} != {g, u} or s1.code != MUL_MAT_ID_Q or s2.code != MUL_MAT_ID_Q or g is u:
            return False
        gs, us = (s1, s2) if s1.node is g else (s2, s1)
        gm, um = gs.extra.get("mm", g), us.extra.get("mm", u)  # (the products of biased experts)
        if gm.src[1:] != um.src[1:] or g.shape != u.shape or self.readers.get(g, 0) != 1 or self.readers.get(u, 0) != 1:
            return False
        extra = {"glu": glu, "gate": gm, "up": um}
        extra.update({f"{k}_bias": s.extra["bias"] for k, s in (("gate", gs), ("up", us)) if "bias" in s.extra})
        biases = [b.src[1] for k in ("gate_bias", "up_bias") if (b := extra.get(k)) is not None]
        self.steps[-2:] = [_Step(MUL_MAT_ID_Q, glu, [*gm.src, um.src[0], *biases], extra)]
        self.n_fused += 2
        return True

    def _fuse_mul_mat_id_bias(self, add: Tensor) -> bool:
        """ADD_ID(MUL_MAT_ID, bias, its ids) — gpt-oss's biased experts — as the product's step
        when nothing else reads the product: the step's result is the ADD_ID's, placed apart from
        the product's input (the GPU's expert product with the bias as epilogue)."""
        prev = self.steps[-1] if self.steps else None
        mm, _b, ids = add.src
        if prev is None or prev.code != MUL_MAT_ID_Q or prev.node is not mm or prev.extra:
            return False
        if mm.src[2] is not ids or self.readers.get(mm, 0) != 1:
            return False
        prev.extra.update(bias=add, mm=mm)
        prev.node = add
        prev.reads.append(add.src[1])
        self.n_fused += 1
        return True

    def _fuse_mul_mat_bias(self, add: Tensor) -> bool:
        """ADD(MUL_MAT, bias) — a weight vector of one value an output row: qwen2's and gpt-oss's
        fused Q/K/V bias, gpt-oss's output and router biases — as the product's step when nothing
        else reads the product: the step's result is the ADD's (the GPU's product with the bias
        as epilogue; each output the product's sum, then one float32 add, as the ADD)."""
        prev = self.steps[-1] if self.steps else None
        mm, b = add.src
        if prev is None or prev.code != MUL_MAT or prev.node is not mm or prev.extra or self.readers.get(mm, 0) != 1:
            return False
        if not b.is_leaf or self.target.leaf(b) is None or b.type is not GGMLType.F32 or b.shape != mm.shape[-1:]:
            return False
        prev.extra.update(bias=add, mm=mm)
        prev.node = add
        prev.reads.append(b)
        self.n_fused += 1
        return True

    def _fuse_norm_mul(self, mul: Tensor) -> bool:
        """MUL(norm, weight vector) folded into the RMS_NORM step that made `norm` when nothing
        else reads the norm (ggml-cpu's rms_norm + mul fusion)."""
        prev = self.steps[-1] if self.steps else None
        a, w = mul.src
        if prev is None or prev.code != RMS_NORM or prev.node is not a or self.readers.get(a, 0) != 1:
            return False
        if w.shape[-1] != a.shape[-1] or w.n_elements != w.shape[-1] or w.type is not GGMLType.F32:
            return False
        prev.node = mul
        prev.extra["weight"] = w
        prev.reads.append(w)
        self._source(w)
        self.n_fused += 1
        return True

    # -- pass 2: memory ----------------------------------------------------------------------

    def alloc(self) -> dict[Tensor, int]:
        # inputs and the rows expanded before the call are written first: they are placed first
        order: list[tuple[int, Tensor | None, list[Tensor]]] = [(0, t, []) for t in self.inputs + self.pre]
        scratches: list[tuple[_Step, list[Tensor | None]]] = []
        for st in self.steps:
            reads = [self._base(r) for r in st.reads]
            if "add" in st.extra:
                order.append((0, st.extra["add"], reads))
                reads = [*reads, st.extra["add"]]
            # the step's scratches: values placed just before it and read by it alone (freed after
            # it), each SCRATCH_ALIGN - 1 bytes longer so that its start can be rounded up (whatever the
            # allocator's own alignment: backends do not import sched)
            pseudo = [Tensor(f"scratch.{len(scratches)}.{k}", (n + SCRATCH_ALIGN - 1,), GGMLType.I8)
                      if n else None for k, n in enumerate(self.target.step_scratch(self, st))]
            order += [(0, t, []) for t in pseudo if t is not None]
            scratches.append((st, pseudo))
            out = None if st.code == SET_ROWS else st.node
            order.append((0, out, reads + [t for t in pseudo if t is not None]))
        outs = [self._base(e) for e in self.exports]
        a = self.allocate(order, outs)
        head = self.target.head  # (the offsets start after the target's head)
        self.arena_size = a.sizes.get(0, 0) + head
        for st, pseudo in scratches:  # (an empty scratch: the head's end; its record reads and writes nothing there)
            st.scratch = tuple(head if t is None else -(-(a.offsets[t][1] + head) // SCRATCH_ALIGN) * SCRATCH_ALIGN
                               for t in pseudo)
        return {t: off + head for t, (_b, off) in a.offsets.items()}

    # -- pass 3: records ---------------------------------------------------------------------

    def build(self, arena: Any) -> Built:
        self.steps_pass()
        offsets = self.alloc()
        nbytes = self.target.scratch(self, self.arena_size)
        self.base = base = arena.ensure(nbytes)
        self.keep: list[Any] = []
        locs: dict[Tensor, Loc] = {}

        def owned(t: Tensor) -> Loc:
            return Loc(base + offsets[t], t.shape, _cstrides(t.shape), _DTYPES[t.type], arena)

        def slot(l: Loc) -> _Slot:
            isz = l.dtype.itemsize
            return _Slot(l.addr - base, l.shape, tuple(st * isz for st in l.strides), l.dtype)

        def loc(t: Tensor) -> Loc:
            hit = locs.get(t)
            if hit is not None:
                return hit
            if t in self.alias:
                l = self._view(t, loc(self.alias[t]))
            elif t in offsets:
                l = owned(t)
            else:
                try:
                    l = self.target.array_loc(self.target.leaf(t), self.keep)
                except Refused as e:
                    raise Refused(f"{t.name}: {e}") from None
            locs[t] = l
            return l

        try:
            recs = []
            attn: dict[Tensor, list[int]] = {}  # a mask input -> the ATTN records reading it
            for st in self.steps:
                if st.code == ATTN and st.node.src[3] in self.inputs:
                    attn.setdefault(st.node.src[3], []).append(len(recs))
                recs += self._records(st, loc)
            if any(self.readers[m] != len(rows) for m, rows in attn.items()):
                raise Refused("a mask read by another op than FLASH_ATTN_EXT")
            masks = [(t, slot(loc(t)), np.array(rows)) for t, rows in attn.items()]
            inputs = [(t, slot(loc(t))) for t in self.inputs if t not in attn]  # inputs and `pre` rows: arena-owned
            pre = [(slot(loc(n)), self.target.leaf(n.src[0]), n.src[1]) for n in self.pre]
            exports: list[tuple[Tensor, Any]] = []
            for e in self.exports:
                l = loc(e)
                exports.append((e, slot(l) if l.owner is arena else self.target.export(l)))
            self.target.finish(self, recs, masks, exports)
        finally:
            # `loc` is recursive (its closure holds itself): break that cycle, or the weights'
            # views in `locs` would keep a closed model's mapping until the garbage collector runs
            locs.clear()
            loc = None  # noqa: F841
        table = np.array(recs, np.int64).reshape(-1, self.target.width)
        # the addresses in the arena, moved when it is made again (ExecPlan._move); a fused
        # RMS_NORM's ADD result is in slot 10, and a target may have more (slot, op) of its own
        extra = [(10, RMS_NORM), *self.target.addr_slots]
        slots = list(_ADDR_SLOTS) + [k for k, _ in extra]
        cols = table[:, slots]
        inside = (cols >= base) & (cols < base + max(nbytes, 1))
        for j, (_k, code) in enumerate(extra):
            inside[:, len(_ADDR_SLOTS) + j] &= table[:, 0] == code
        rows, which = np.nonzero(inside)
        moves = (rows, np.array(slots)[which])
        return Built(table, arena, nbytes, base, moves, inputs, exports, self.keep, len(self.nodes), self.n_fused,
                     pre, masks)

    def _view(self, t: Tensor, src: Loc) -> Loc:
        op = t.op
        if op is Op.SET_ROWS:
            return src
        if op is Op.PERMUTE:
            axes = t.params["axes"]
            return Loc(src.addr, t.shape, tuple(src.strides[i] for i in axes), src.dtype, src.owner)
        if op is Op.VIEW and "cols" in t.params:
            c0, _c1 = t.params["cols"]
            return Loc(src.addr + c0 * src.dtype.itemsize, t.shape, src.strides, src.dtype, src.owner)
        if op is Op.VIEW and t.type in KV_QUANT_TYPES:
            # a window of whole rows of a Q8_0/Q4_0 cache (kernels.view): (…, row bytes) uint8, its
            # last dimension split into whole blocks per head; strides in bytes
            width = t.src[0].shape[-1]
            if not src.contiguous() or t.params["offset"] % width or t.shape[-1] % block_size(t.type)[0]:
                raise Refused(f"VIEW {t.name} of a quantized cache")
            shape = storage(t.type, t.shape)[0]
            row_bytes = src.shape[-1]
            return Loc(src.addr + t.params["offset"] // width * row_bytes, shape, _cstrides(shape), src.dtype,
                       src.owner)
        if op is Op.VIEW:
            if not src.contiguous():
                raise Refused(f"VIEW {t.name} of a strided value")
            return Loc(src.addr + t.params["offset"] * src.dtype.itemsize, t.shape, _cstrides(t.shape), src.dtype,
                       src.owner)
        # RESHAPE: free when the source is contiguous, or when its rows stay the leading dimension
        if src.contiguous():
            return Loc(src.addr, t.shape, _cstrides(t.shape), src.dtype, src.owner)
        rows, n, st = src.rows()
        if t.shape and t.shape[0] == rows and t.n_elements == rows * n:
            inner = _cstrides(t.shape[1:])
            return Loc(src.addr, t.shape, (st, *inner), src.dtype, src.owner)
        raise Refused(f"RESHAPE {t.name} of a strided value")

    def _records(self, st: _Step, loc: Any) -> list[list[int]]:
        own = self.target.records(self, st, loc)
        return own if own is not None else [self._record(st, loc)]

    def _record(self, st: _Step, loc: Any) -> list[int]:
        r = [0] * REC
        r[0] = st.code
        n = st.node
        f32 = np.dtype(np.float32)

        def fbits(x: float) -> int:
            return int(np.float64(x).view(np.int64))

        def need_f32(l: Loc, what: str) -> Loc:
            if l.dtype != f32:
                raise Refused(f"{what} of type {l.dtype}")
            return l

        r[1] = loc(n).addr
        if st.code == RMS_NORM:
            norm = st.extra["norm"]
            x = need_f32(loc(norm.src[0]), "RMS_NORM input")
            try:
                rows, cols, xs = x.rows()
            except Refused:  # a per-head norm of a strided view, T tokens (qwen3's / gemma3's Q and K)
                if "add" in st.extra or len(x.shape) != 3 or x.strides[2] != 1 or not loc(n).contiguous():
                    raise
                T, rows, cols = x.shape
                xs, r[13], r[14], r[15] = x.strides[1], T, x.strides[0], rows * cols  # (T groups of `rows` rows)
            r[2], r[6], r[7], r[8], r[9] = x.addr, rows, cols, xs, fbits(float(norm.params["eps"]))
            if "weight" in st.extra:
                w = need_f32(loc(st.extra["weight"]), "norm weight")
                if not w.contiguous():
                    raise Refused("a strided norm weight")
                r[3] = w.addr
            if "add" in st.extra:
                add = st.extra["add"]
                a, b = (need_f32(loc(s), "ADD input") for s in add.src)
                r[10] = loc(add).addr
                r[4], r[11] = a.addr, self._rows_like(a, rows, cols)
                r[5], r[12] = b.addr, self._rows_like(b, rows, cols)
                if r[11] == 0:
                    raise Refused("a broadcast first ADD operand")
            return r
        if st.code in (MUL, ADD, DIV):
            a, b = (need_f32(loc(s), f"{n.op.name} input") for s in n.src)
            rows, cols, ast = a.rows()
            if cols > 1 and b.shape and b.shape[-1] == 1 and b.rows()[0] == rows:
                r[9], r[10] = b.rows()[2], 1  # one value per row (the router's weights)
            else:
                r[9] = self._rows_like(b, rows, cols)
            r[2], r[3], r[6], r[7], r[8] = a.addr, b.addr, rows, cols, ast
            return r
        if st.code in (SOFT_MAX, ARGSORT, SUM_ROWS, CLAMP):
            a = need_f32(loc(n.src[0]), f"{n.op.name} input")
            rows, cols, ast = a.rows()
            r[2], r[6], r[7], r[8] = a.addr, rows, cols, ast
            if st.code == SOFT_MAX:
                r[9] = fbits(float(n.params["scale"]))
            if st.code == CLAMP:
                r[9], r[10] = fbits(float(n.params["min"])), fbits(float(n.params["max"]))
            return r
        if st.code == GET_ROWS_B:
            table, ids = n.src
            tl, il = need_f32(loc(table), "GET_ROWS table"), loc(ids)
            if il.dtype != np.dtype(np.int32) or il.strides[1] != 1 or len(tl.shape) != 3 or tl.strides[2] != 1:
                raise Refused(f"GET_ROWS {n.name} layout")
            B, R, C = tl.shape
            r[2], r[3], r[6], r[7], r[8] = tl.addr, il.addr, B, ids.shape[1], C
            r[9], r[10], r[11], r[12] = tl.strides[0], tl.strides[1], R, il.strides[0]
            return r
        if st.code == SCALE:
            a = need_f32(loc(n.src[0]), "SCALE input")
            rows, cols, ast = a.rows()
            r[2], r[6], r[7], r[8], r[9] = a.addr, rows, cols, ast, fbits(float(n.params["s"]))
            return r
        if st.code == CPY:
            a = need_f32(loc(n.src[0]), "CONT input")
            rows, cols, ast = a.rows()
            r[2], r[6], r[7], r[8] = a.addr, rows, cols, ast
            return r
        if st.code in (SWIGLU, GEGLU):
            g, u = (need_f32(loc(s), "GLU input") for s in n.src)
            rows, cols, gs = g.rows()
            r[2], r[3], r[6], r[7], r[8], r[9] = g.addr, u.addr, rows, cols, gs, self._rows_like(u, rows, cols)
            if n.params.get("op") == "swiglu_oai":
                r[10], r[11], r[12] = 1, fbits(float(n.params["alpha"])), fbits(float(n.params["limit"]))
            if st.code == GEGLU:
                r[4] = self.target.gelu_table(self.keep)
            return r
        if st.code == ADD_ID:
            a, ids = need_f32(loc(n.src[0]), "ADD_ID input"), loc(n.src[2])
            b = _leaf_value(n.src[1])
            from .qmatmul import QMatrix

            if not (isinstance(b, QMatrix) and b.qtype is GGMLType.F32 and not b.repacked):
                raise Refused(f"ADD_ID {n.name}: a bias not kept as f32 rows")
            if ids.dtype != np.dtype(np.int32) or ids.strides[-1] != 1:
                raise Refused(f"ADD_ID {n.name}: an ids layout")
            rows, cols, as_ = a.rows()
            r[2], r[3], r[4] = a.addr, b.data.ctypes.data, ids.addr
            r[6], r[7], r[8], r[9], r[10] = rows, cols, as_, n.shape[1], ids.strides[0]
            return r
        if st.code == GET_ROWS_F32:
            table, ids = n.src
            il = loc(ids)
            if il.dtype != np.dtype(np.int32) or not il.contiguous():
                raise Refused("GET_ROWS ids that are not int32")
            t = need_f32(loc(table), "GET_ROWS table")
            rows, cols, ts = t.rows()
            r[2], r[3], r[6], r[7], r[8], r[9] = t.addr, il.addr, ids.n_elements, cols, ts, rows
            return r
        if st.code == ROPE:
            x = need_f32(loc(n.src[0]), "ROPE input")
            pos = loc(n.src[1])
            if len(x.shape) != 3 or x.strides[2] != 1 or pos.dtype != np.dtype(np.int32) or not pos.contiguous():
                raise Refused("a ROPE layout")
            factors = None
            if len(n.src) > 2:
                factors = self.target.host_array(self.target.leaf(n.src[2]))
            p = n.params
            inv = rope_consts(p["n_dims"], p["freq_base"], p["freq_scale"], factors, p.get("yarn", ()))
            T, H, D = x.shape
            r[2], r[3], r[4] = x.addr, pos.addr, self.target.const(inv, self.keep)
            r[6], r[7], r[8], r[9], r[10], r[11], r[12] = T, H, D, x.strides[0], x.strides[1], p["n_dims"], \
                int(p["mode"] == 2)  # fmt: skip
            return r
        if st.code == SET_ROWS:
            dst, ids, src = n.src
            dl, il = loc(dst), loc(ids)
            sl = need_f32(loc(src), "SET_ROWS source")
            rows, cols, ss = sl.rows()
            d_rows, d_cols, d_st = dl.rows()
            if n.type in KV_QUANT_TYPES:  # rows quantized (and rotated: attn_rot) as kernels.set_rows
                if il.dtype != np.dtype(np.int64) or not il.contiguous() or cols != dst.shape[-1] \
                        or d_cols != row_nbytes(n.type, cols) or dl.dtype != np.dtype(np.uint8):
                    raise Refused("a SET_ROWS layout")
                rot = dst.root().params.get("rot", 0)
                r[1], r[3], r[4] = dl.addr, il.addr, sl.addr
                r[6], r[7], r[8], r[9], r[10], r[11] = ids.n_elements, cols, ss, d_rows, KV_CODES[n.type], d_st
                r[12], r[13] = rot, fbits(float(hadamard(rot)[0, 0])) if rot else 0
                return r
            if il.dtype != np.dtype(np.int64) or not il.contiguous() or cols != d_cols:
                raise Refused("a SET_ROWS layout")
            f16 = dl.dtype == np.dtype(np.float16)
            if f16 and not self.target.f16_stores():
                raise Refused("f16 stores need a compiler with _Float16")
            if not f16 and dl.dtype != f32:
                raise Refused(f"SET_ROWS into {dl.dtype}")
            r[1], r[3], r[4] = dl.addr, il.addr, sl.addr
            r[6], r[7], r[8], r[9], r[10], r[11] = ids.n_elements, cols, ss, d_rows, int(f16), d_st
            return r
        if st.code == ATTN:
            q, k, v, mask = (loc(s) for s in n.src[:4])
            if len(n.src) > 4:  # the sinks: a weight (H,) f32
                if not self.target.attn_sinks:
                    raise Refused(f"attention sinks ({n.name}): no kernel takes them here")
                sv = self.target.leaf(n.src[4])  # (the target's memory: host or device)
                sk = self.target.array_loc(sv, self.keep) if sv is not None else None
                if sk is None or sk.dtype != f32 or not sk.contiguous():
                    raise Refused("attention sinks without an f32 buffer")
                r[24] = sk.addr
            need_f32(q, "attention Q")
            need_f32(mask, "attention mask")
            if not q.contiguous() or len(k.shape) != 3 or k.strides[2] != 1 or v.strides[2] != 1:
                raise Refused("an attention layout")
            kt, vt = n.src[1].type, n.src[2].type
            if kt not in KV_CODES or vt not in KV_CODES or (kt != vt and KV_QUANT_TYPES.isdisjoint((kt, vt))):
                # (an f32 V with an f16 K: the reference rounds V to f16 first)
                raise Refused(f"attention over {kt.name} / {vt.name}")
            rot_k, rot_v = cache_rotation(n)
            mrows, mcols, mst = mask.rows()
            T, H, D = q.shape
            N, Hkv, Dv = n.src[2].shape  # (v's storage shape counts bytes for a quantized cache)
            r[2], r[3], r[4], r[5] = q.addr, k.addr, v.addr, mask.addr
            r[6], r[7], r[8], r[9], r[10], r[11] = T, H, D, N, Hkv, Dv
            r[12], r[13], r[14], r[15] = k.strides[0], k.strides[1], v.strides[0], v.strides[1]
            r[16], r[17], r[18], r[19] = mst, fbits(float(n.params["scale"])), KV_CODES[kt], KV_CODES[vt]
            r[20], r[21] = rot_k, rot_v
            r[22] = fbits(float(hadamard(rot_k)[0, 0])) if rot_k else 0
            r[23] = fbits(float(hadamard(rot_v)[0, 0])) if rot_v else 0
            return r
        raise Refused(f"op {n.op.name}")  # pragma: no cover - steps_pass knows the codes

    @staticmethod
    def _rows_like(b: Loc, rows: int, cols: int) -> int:
        """Row stride of a second operand with `rows` rows of `cols` (0: one broadcast row)."""
        if rows > 1 and int(np.prod(b.shape)) == cols:
            if b.strides[-1] != 1:
                raise Refused("a strided broadcast operand")
            return 0
        br, bc, bs = b.rows()
        if (br, bc) != (rows, cols):
            raise Refused(f"operands of {rows}x{cols} and {br}x{bc}")
        return bs
