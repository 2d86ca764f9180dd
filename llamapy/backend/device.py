"""What every device with its own memory shares — the TEST device and CUDA alike (the common
part of ggml-cuda's buffer, buffer-type and device code).

A device memory has a budget; buffers are reserved from it and given back when freed, so an
allocation that does not fit fails with OutOfMemoryError before anything is copied. Every byte
crossing between the host and the device goes through `from_host` / `to_host` and is counted,
so the scheduler's copies can be checked. Subclasses provide the array module and the weight
representation.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..tensor import Op, Tensor, TensorFlag
from ..types import DeviceType, OutOfMemoryError
from .gpu_plan import own_values
from .interface import Backend, Buffer, BufferType, BufferUsage, Device, DeviceProps
from .kernels import KERNELS, run_nodes

# ggml-cuda offloads an op that reads a host weight once its batch size reaches 32
# (`op_offload_min_batch_size`, GGML_OP_OFFLOAD_MIN_BATCH)
OFFLOAD_MIN_BATCH = 32


def op_batch_size(node: Tensor) -> int:
    """ggml-cuda's `get_op_batch_size`, which decides op offload: GET_ROWS never (0); MUL_MAT its
    `ne[1]` (the tokens), MUL_MAT_ID its `ne[2]` (the tokens); ROPE its `ne[2]` (tokens of a (tokens, heads, dim) tensor); any other
    op its number of rows (`ggml_nrows`: every dimension but the contiguous one)."""
    if node.op is Op.GET_ROWS:
        return 0
    ne = node.shape[::-1]  # ggml order: ne[0] is the contiguous dimension
    if node.op is Op.MUL_MAT:
        return ne[1] if len(ne) > 1 else 1
    if node.op is Op.MUL_MAT_ID:  # (tokens, slots, M): its tokens
        return ne[2]
    if node.op is Op.ROPE:
        return ne[2] if len(ne) > 2 else 1
    rows = 1
    for d in ne[1:]:
        rows *= d
    return rows


@dataclass
class CopyStats:
    bytes_in: int = 0  # host -> device
    bytes_out: int = 0  # device -> host
    n_in: int = 0
    n_out: int = 0
    # host waits on the device (a stream or event synchronisation that blocked, or that cannot be
    # known not to): a hybrid step makes one per device->host boundary (tests read the deltas)
    n_sync: int = 0


class DeviceMemoryBufferType(BufferType):
    """Device memory with a budget (the TEST device's LLAMAPY_TEST_GPU_MEM, a GPU's free memory)."""

    is_host = False

    def __init__(self, device: MemoryDevice, budget: int) -> None:
        self.device = device
        self.name = device.name
        self.budget = budget
        self.allocated = 0

    def alloc_buffer(self, nbytes: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer:
        if self.allocated + nbytes > self.budget:
            raise OutOfMemoryError(
                f"{self.name}: cannot allocate {nbytes / 2**20:.2f} MiB "
                f"({(self.budget - self.allocated) / 2**20:.2f} MiB free of {self.budget / 2**20:.2f} MiB)"
            )
        self.allocated += nbytes
        return self._new_buffer(nbytes, usage)

    def _new_buffer(self, nbytes: int, usage: BufferUsage) -> Buffer:
        """The buffer of an allocation the budget allows (a remote device's holds no memory here)."""
        return DeviceMemoryBuffer(self, nbytes, usage)

    def release(self, buf: Buffer) -> None:
        self.allocated -= buf.nbytes
        buf.nbytes = 0


class DeviceMemoryBuffer(Buffer):
    buft: DeviceMemoryBufferType

    def set(self, t: Tensor, data: np.ndarray) -> None:
        dev = self.buft.device
        if t.flags & TensorFlag.WEIGHT:
            self._raw[t] = data  # host bytes kept only as a reference into the mapping
        self._store[t] = dev.upload(data, t)

    def get(self, t: Tensor) -> np.ndarray:
        return self.buft.device.download(self._store[t])

    def _zeros_value(self, t: Tensor) -> Any:
        return self.buft.device.zeros(t)


class MemoryDevice(Device):
    """A device that owns its memory. Subclasses say how arrays live there."""

    type = DeviceType.GPU

    def __init__(self, name: str, budget: int, description: str) -> None:
        self.name = name
        self.description = description
        self.stats = CopyStats()
        self._buft = DeviceMemoryBufferType(self, budget)

    # -- what a concrete device provides ---------------------------------------------------

    xp: Any = np

    @abstractmethod
    def upload(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        """Host array (or, for a WEIGHT, its raw bytes) -> a native device value."""

    @abstractmethod
    def download(self, value: Any) -> np.ndarray: ...

    def download_batch(self, values: Sequence[Any]) -> list[np.ndarray]:
        """Several values to the host with one wait (a boundary's inputs: the copies are queued
        together, then one synchronisation). Default: one download each, each its own wait."""
        return [self.download(v) for v in values]

    @abstractmethod
    def zeros(self, t: Tensor) -> Any: ...

    # -- shared -----------------------------------------------------------------------------

    def props(self) -> DeviceProps:
        b = self._buft
        return DeviceProps(self.name, self.description, self.type, b.budget - b.allocated, b.budget)

    def buffer_type(self) -> BufferType:
        return self._buft

    @property
    def allocated(self) -> int:
        return self._buft.allocated

    def supports_op(self, node: Tensor) -> bool:
        return node.op in KERNELS

    def offload_op(self, node: Tensor) -> bool:
        # big batches are worth the weight's trip to the device; GET_ROWS never is
        return op_batch_size(node) >= OFFLOAD_MIN_BATCH

    def init_backend(self) -> Backend:
        return MemoryDeviceBackend(self)


class MemoryDeviceBackend(Backend):
    device: MemoryDevice

    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        own_values(env, nodes)  # (a GPU plan's exports read here: copies of their own)
        run_nodes(nodes, env, self.device.xp)

    def from_host(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        return self.device.upload(data, t)

    def to_host(self, value: Any) -> np.ndarray:
        return self.device.download(value)

    def to_host_batch(self, values: Sequence[Any]) -> list[np.ndarray]:
        return self.device.download_batch(values)
