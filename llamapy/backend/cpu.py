"""The CPU backend: host buffers, numpy kernels and the compiled C ones (ggml-cpu,
`ggml_backend_cpu_*`).

Host buffers hold weights as the file stores them: a quantized matrix becomes a QMatrix over the
memory-mapped bytes (no copy, no f32 expansion), small f32 tensors stay views of the mapping.
The BLAS backend shares these buffers; the TEST device reuses the kernels but owns its memory.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..tensor import Op, Tensor, TensorFlag
from ..types import NUMPY_DTYPES, DeviceType, LlamapyError, storage
from .cpu_kernels import c_flash_attn_ext, cpu_kernels
from .executor import Arena, Refusal, compile_split
from .executor import enabled as executor_enabled
from .interface import Backend, Buffer, BufferType, BufferUsage, Device, DeviceProps, Registry
from .kernels import KERNELS, run_nodes
from .qmatmul import MATMUL_MODES, REPACK_ROWS, QMatrix, kernels
from .repack_cache import RepackStore
from .threads import set_blas_threads


_CORES = os.cpu_count() or 1  # constant for the process (read once: ~5 us a call)


def host_value(t: Tensor, data: np.ndarray, copy: bool, repack: bool = False) -> Any:
    """The native host value for tensor `t` given its bytes or elements.

    Matrices of any GGUF type become a QMatrix (the quantized MUL_MAT / GET_ROWS path; `repack`:
    laid out for the "f32" matmul mode); vectors (norm weights, rope_freqs) and activations
    become float arrays.
    """
    data = np.array(data, copy=True) if copy else np.asarray(data)
    if len(t.shape) == 2 and t.flags & TensorFlag.WEIGHT:
        raw = data.reshape(t.shape[0], -1).view(np.uint8)  # (n_out, row_bytes)
        return QMatrix.prepare(raw, t.type, t.shape[0], t.shape[1], repack=repack)
    if len(t.shape) == 3 and t.flags & TensorFlag.WEIGHT:
        # stacked experts (n_expert, M, K): one matrix of n_expert * M rows, each expert a row
        # range of it (MUL_MAT_ID); repacked only when every expert is whole tiles
        E, M, K = t.shape
        raw = data.reshape(E * M, -1).view(np.uint8)  # (E*M, row_bytes)
        return QMatrix.prepare(raw, t.type, E * M, K, repack=repack and M % REPACK_ROWS == 0)
    if t.type in NUMPY_DTYPES:
        return data.view(NUMPY_DTYPES[t.type]).reshape(t.shape)
    # a quantized or bf16 vector (rare: norms are f32 in every llama GGUF): expand it, it is small
    from ..quants import dequantize

    return dequantize(data.reshape(1, -1).view(np.uint8), t.type, t.n_elements).reshape(t.shape)


_ZEROED_MIN = 1 << 16  # smaller arrays come from malloc: a mapping each would waste its pages


def zeroed_pages(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled array on private anonymous pages of its own, for the KV cache: a page
    counts in the RSS once a cell on it is written, not before (reading an unwritten page maps
    the shared zero page). np.zeros may take freed heap memory, which calloc clears by writing
    it; and a shared mapping (mmap's default) allocates a page even to read it — attention
    reads past the cells written."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if nbytes < _ZEROED_MIN or not flags:
        return np.zeros(shape, dtype)
    mm = mmap.mmap(-1, nbytes, flags=flags)  # unmapped when the last view goes (Buffer.free)
    return np.frombuffer(mm, dtype).reshape(shape)  # shape: the tensor's, nothing copied


def drop_pages(arr: np.ndarray) -> bool:
    """Zero an array made by zeroed_pages by giving its pages back (MADV_DONTNEED: a private
    anonymous page reads as zeros again, and leaves the RSS); False for any other array."""
    base: Any = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if not isinstance(base, mmap.mmap) or advice is None or not hasattr(base, "madvise"):
        return False
    base.madvise(advice)
    return True


class CPUBuffer(Buffer):
    _repack: RepackStore | None = None
    cache_note: str | None = None  # why the repack cache could not be written (for the CLI)
    _f32_layout = False  # weights repacked for the "f32" matmul mode

    def use_cache(self, key: str, label: str = "", cpu_matmul: str = "q8") -> None:
        # "q8" multiplies the file's blocks where they are mapped; "f32" repacks (C kernels
        # only) and keeps the repacked layouts in a cache file
        self._f32_layout = cpu_matmul == "f32" and kernels() != "numpy"
        self._repack = RepackStore.open(key, label) if self._f32_layout else None

    def finish_loading(self) -> None:
        if self._repack is not None:
            self._repack.write()
            self.cache_note = self._repack.note

    def free(self) -> None:
        super().free()  # drops the QMatrix views of the cache file first, so its mapping can go
        if self._repack is not None:
            self._repack.close()
            self._repack = None

    def set(self, t: Tensor, data: np.ndarray) -> None:
        weight_matrix = len(t.shape) in (2, 3) and bool(t.flags & TensorFlag.WEIGHT)
        if t.flags & TensorFlag.WEIGHT:
            self._raw[t] = data
        cache = self._repack if weight_matrix else None
        key = f"{t.name}|{t.type.name}|{t.shape}"
        arrays = cache.get(key) if cache is not None else None
        if arrays is not None:  # mapped from the cache file: no repacking, no copy
            rows = t.shape[0] if len(t.shape) == 2 else t.shape[0] * t.shape[1]  # experts: stacked
            self._store[t] = QMatrix.from_state(t.type, rows, t.shape[-1], arrays)
            return
        value = host_value(t, data, copy=False, repack=self._f32_layout)
        state = value.state() if cache is not None else None
        if state is not None:
            cache.put(key, state)  # type: ignore[union-attr]
        self._store[t] = value

    def copies_weight(self, t: Tensor) -> bool:
        # the "f32" mode's repacked tiles (made from the file's bytes, or mapped from the cache)
        v = self._store.get(t)
        return isinstance(v, QMatrix) and v.repacked

    def get(self, t: Tensor) -> np.ndarray:
        v = self._store[t]
        return np.asarray(v) if isinstance(v, np.ndarray) else v.dequantize()  # a WeightMatrix

    def _zeros_value(self, t: Tensor) -> Any:
        shape, dtype = storage(t.type, t.shape)  # a quantized cache: raw block rows
        return zeroed_pages(shape, dtype)

    def clear(self, value: float = 0) -> None:
        for t in self._mutable:
            if value != 0 or not drop_pages(self._store[t]):
                self._store[t].fill(value)


class CPUBufferType(BufferType):
    name = "CPU"
    is_host = True

    def alloc_buffer(self, nbytes: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer:
        return CPUBuffer(self, nbytes, usage)


CPU_BUFT = CPUBufferType()


class CPUBackend(Backend):
    def __init__(self, device: Device, n_threads: int = 0) -> None:
        super().__init__(device)
        self.n_threads = n_threads
        # splits compiled by the executor unless LLAMAPY_EXECUTOR=0 (when the backend is made)
        self.use_executor = executor_enabled()
        self.cpu_matmul = "q8"
        # MUL_MAT (this backend's bound method) joins the table per run: stored here it would make
        # a reference cycle, and a closed model's mappings would wait for the garbage collector
        self._kernels = cpu_kernels()
        # the last activations quantized per vec_dot_type: (x, its quantized rows); a MUL_MAT
        # whose input is the same array reuses them (Q, K and V; gate and up)
        self._act: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        # the compute memory of this backend's compiled plans, shared by them (they run one at a
        # time): as large as the largest, its pages kept from one run to the next; held by the
        # plans (weakly here), so it goes with the last of them (Context.free, graphs evicted)
        self._arena_ref: weakref.ReferenceType[Arena] | None = None

    def set_cpu_matmul(self, mode: str) -> None:
        """"q8" (activations quantized as llama.cpp does) or "f32" (float32 activations)."""
        if mode not in MATMUL_MODES:
            raise LlamapyError(f"cpu_matmul must be one of {', '.join(MATMUL_MODES)}, not {mode!r}")
        self.cpu_matmul = mode

    def _mul_mat(self, node: Tensor, s: list[Any], xp: Any) -> Any:
        w, x = s
        if not isinstance(w, QMatrix):
            return self._kernels_mul_mat(node, s, xp)
        x2 = x.reshape(-1, x.shape[-1])  # (n_tokens, n_in)
        q8 = self.cpu_matmul == "q8"
        path = w.path(x2.shape[0], q8)
        vdt = w.vec_dot_type() if q8 and path != "mv" else None
        nt = self.threads()  # this backend's -t, passed to every kernel (no process-wide count)
        if path == "sgemm":
            set_blas_threads(nt)  # BLAS's count is its library's: set for this backend's products
        if vdt is None:
            out = w.matmul(x2, nt, q8)
        else:
            # the activations in the vec_dot_type: quantized (q8 kernels) or rounded (sgemm),
            # once for every product of the same input
            hit = self._act.get((vdt, path))
            if hit is not None and hit[0] is x:
                a = hit[1]
            else:
                a = w.quantize_act(x2, nt) if path == "q8" else w.round_act(x2, nt)
                self._act[(vdt, path)] = (x, a)
            out = w.matmul_q8(a, nt) if path == "q8" else w.matmul_tiles(a, nt)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    _kernels_mul_mat = staticmethod(KERNELS[Op.MUL_MAT])  # float arrays (no QMatrix)

    def _mul_mat_id(self, node: Tensor, s: list[Any], xp: Any) -> Any:
        """MUL_MAT_ID in the q8 mode: the input rows quantized once into the experts'
        vec_dot_type (as ggml-cpu's mul_mat_id does), then each chosen expert's rows multiply, in
        one q8 product, the rows of every token that chose it (`lp_mul_mat_id_q`). The f32 mode:
        the reference."""
        w, x, ids = s
        vdt = w.vec_dot_type() if isinstance(w, QMatrix) and self.cpu_matmul == "q8" and not w.repacked else None
        if vdt is None:
            return KERNELS[Op.MUL_MAT_ID](node, s, xp)
        T, U, M = node.shape
        ux = x.shape[1]  # 1: every slot reads the token's one row
        nt = self.threads()
        hit = self._act.get((vdt, "q8"))
        if hit is not None and hit[0] is x:
            xq = hit[1]
        else:
            xq = w.quantize_act(x.reshape(-1, x.shape[-1]), nt)  # (T*ux, row bytes)
            self._act[(vdt, "q8")] = (x, xq)
        return w.matmul_id_q8(xq.reshape(T, ux, -1), ids, node.src[0].shape[0], nt)

    def set_n_threads(self, n_threads: int) -> None:
        # kept on the backend and passed with every kernel call (threads()): nothing process-wide
        self.n_threads = n_threads

    def _flash_attn_ext(self, node: Tensor, s: list[Any], xp: Any) -> Any:
        return c_flash_attn_ext(node, s, xp, self.threads())

    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        table = {**self._kernels, Op.MUL_MAT: self._mul_mat, Op.MUL_MAT_ID: self._mul_mat_id}
        if table[Op.FLASH_ATTN_EXT] is c_flash_attn_ext:  # the C kernels: on this backend's -t
            table[Op.FLASH_ATTN_EXT] = self._flash_attn_ext
        try:
            run_nodes(nodes, env, np, table=table)
        finally:
            self._act.clear()  # the graph's activations are not kept past its run

    # -- compiled plans (backend/executor.py) ------------------------------------------------

    def threads(self) -> int:
        """This backend's -t, never more than the cores (0: every core)."""
        cores = _CORES
        return min(self.n_threads, cores) if self.n_threads > 0 else cores

    def graph_plan_create(
        self, nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Callable[..., Any]
    ) -> Any | None:
        # an ExecPlan, or a Refusal (falsy: the scheduler runs the split node by node) saying why
        if not self.use_executor:
            return Refusal("LLAMAPY_EXECUTOR=0")
        arena = self._arena_ref() if self._arena_ref is not None else None
        if arena is None:
            arena = Arena()
            self._arena_ref = weakref.ref(arena)
        return compile_split(nodes, exports, allocate, self.cpu_matmul, arena)

    def graph_plan_compute(self, plan: Any, env: dict[Tensor, Any]) -> None:
        plan.compute(env, self.threads())

    def graph_plan_summary(self, plan: Any) -> str:
        if plan is None:
            return ""
        return f"executor refused: {plan.reason} (run_nodes)" if isinstance(plan, Refusal) else plan.summary()

    def from_host(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        if t is not None and t.flags & TensorFlag.WEIGHT:
            return host_value(t, data, copy=False, repack=self.cpu_matmul == "f32" and kernels() == "c")
        return data

    def to_host(self, value: Any) -> np.ndarray:
        return value


class CPUDevice(Device):
    name = "CPU"
    type = DeviceType.CPU

    def props(self) -> DeviceProps:
        import platform

        from . import hostmem

        free, total = hostmem.host_memory()  # MemAvailable, not MemFree

        return DeviceProps(self.name, platform.processor() or platform.machine(), self.type, free, total)

    def buffer_type(self) -> BufferType:
        return CPU_BUFT

    def supports_op(self, node: Tensor) -> bool:
        return True

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.is_host

    def init_backend(self) -> Backend:
        return CPUBackend(self)


class CPURegistry(Registry):
    name = "CPU"

    def __init__(self) -> None:
        self._devices: list[Device] = [CPUDevice()]

    def devices(self) -> list[Device]:
        return self._devices


def registry() -> Registry:
    """Entry point `llamapy.backends: cpu`."""
    return CPURegistry()
