"""The CPU backend: host buffers, numpy kernels and compiled ones (C or numba) (ggml-cpu,
`ggml_backend_cpu_*`).

Host buffers hold weights as the file stores them: a quantized matrix becomes a QMatrix over the
memory-mapped bytes (no copy, no f32 expansion), small f32 tensors stay views of the mapping.
The BLAS backend shares these buffers; the TEST device reuses the kernels but owns its memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..tensor import Tensor, TensorFlag
from ..types import NUMPY_DTYPES, DeviceType, storage
from .cpu_kernels import cpu_kernels
from .interface import Backend, Buffer, BufferType, BufferUsage, Device, DeviceProps, Registry
from .kernels import run_nodes
from .qmatmul import QMatrix, kernels, set_num_threads
from .repack_cache import RepackStore
from .threads import set_blas_threads


def host_value(t: Tensor, data: np.ndarray, copy: bool) -> Any:
    """The native host value for tensor `t` given its bytes or elements.

    Matrices of any GGUF type become a QMatrix (the quantized MUL_MAT / GET_ROWS path); vectors
    (norm weights, rope_freqs) and activations become float arrays.
    """
    data = np.array(data, copy=True) if copy else np.asarray(data)
    if len(t.shape) == 2 and t.flags & TensorFlag.WEIGHT:
        raw = data.reshape(t.shape[0], -1).view(np.uint8)  # (n_out, row_bytes)
        return QMatrix.prepare(raw, t.type, t.shape[0], t.shape[1])
    if t.type in NUMPY_DTYPES:
        return data.view(NUMPY_DTYPES[t.type]).reshape(t.shape)
    # a quantized or bf16 vector (rare: norms are f32 in every llama GGUF): expand it, it is small
    from ..quants import dequantize

    return dequantize(data.reshape(1, -1).view(np.uint8), t.type, t.n_elements).reshape(t.shape)


class CPUBuffer(Buffer):
    _repack: RepackStore | None = None
    cache_note: str | None = None  # why the repack cache could not be written (for the CLI)

    def use_cache(self, key: str, label: str = "") -> None:
        # the repacked layouts are read by the compiled kernels only
        self._repack = RepackStore.open(key, label) if kernels() != "numpy" else None

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
        weight_matrix = len(t.shape) == 2 and bool(t.flags & TensorFlag.WEIGHT)
        if t.flags & TensorFlag.WEIGHT:
            self._raw[t] = data
        cache = self._repack if weight_matrix else None
        key = f"{t.name}|{t.type.name}|{t.shape}"
        arrays = cache.get(key) if cache is not None else None
        if arrays is not None:  # mapped from the cache file: no repacking, no copy
            self._store[t] = QMatrix.from_state(t.type, t.shape[0], t.shape[1], arrays)
            return
        value = host_value(t, data, copy=False)
        state = value.state() if cache is not None else None
        if state is not None:
            cache.put(key, state)  # type: ignore[union-attr]
        self._store[t] = value

    def get(self, t: Tensor) -> np.ndarray:
        v = self._store[t]
        return v.dequantize() if hasattr(v, "dequantize") else np.asarray(v)

    def zeros(self, t: Tensor) -> None:
        """Allocate a zero-filled mutable tensor (the KV cache)."""
        self._store[t] = np.zeros(*storage(t.type, t.shape))


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

    def set_n_threads(self, n_threads: int) -> None:
        self.n_threads = n_threads
        n = n_threads or (os.cpu_count() or 1)
        set_num_threads(n)
        set_blas_threads(n)

    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        run_nodes(nodes, env, np, table=cpu_kernels())

    def from_host(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        if t is not None and t.flags & TensorFlag.WEIGHT:
            return host_value(t, data, copy=False)
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
