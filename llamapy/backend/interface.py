"""The backend contract: registry -> device -> backend -> buffer type -> buffer
(ggml's `ggml-backend-impl.h`: ggml_backend_reg_i, _device_i, _i, _buffer_type_i, _buffer_i).

Required methods are abstract; optional ones have defaults, so a backend author overrides only
what a device can do better. Values that live on a device are *native* objects of that backend
(numpy arrays and QMatrix on the host, CuPy arrays on CUDA); the scheduler moves them between
backends only through `Backend.from_host` / `to_host` / `copy_from` (the copy ladder of
`ggml_backend_tensor_copy`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import numpy as np

from ..tensor import Tensor
from ..types import DeviceType, GGMLType, OutOfMemoryError


class WeightMatrix(Protocol):
    """A weight matrix in a backend's own representation (QMatrix on the host): what a MUL_MAT
    or GET_ROWS reads as its first source when that source is not a plain array. Kernels tell
    the two apart by `isinstance(value, xp.ndarray)`, never by probing attributes."""

    qtype: GGMLType
    n_out: int  # rows (ggml ne[1])
    n_in: int  # elements per row (ggml ne[0])

    def matmul(self, x: Any, n_threads: int = 0) -> Any:
        """x (n_tokens, n_in) float32 -> x @ W.T (n_tokens, n_out) float32."""

    def get_rows(self, ids: Any) -> Any:
        """float32 rows `ids` (GET_ROWS of an embedding table)."""

    def dequantize(self, rows: Any = None, n_threads: int = 0) -> Any:
        """float32 (n, n_in) of the selected rows (all when `rows` is None)."""


class BufferUsage(Enum):
    ANY = 0
    WEIGHTS = 1
    COMPUTE = 2


@dataclass(frozen=True)
class DeviceProps:
    name: str
    description: str
    type: DeviceType
    memory_free: int = 0
    memory_total: int = 0


class Buffer(ABC):
    """One allocation holding many tensors (ggml_backend_buffer).

    `nbytes` is what was reserved from the device; tensors are placed with `alloc_tensor`
    and their values written with `set` (host -> buffer) and read with `get`.
    """

    def __init__(self, buft: BufferType, nbytes: int, usage: BufferUsage) -> None:
        self.buft = buft
        self.nbytes = nbytes
        self.usage = usage
        self.used = 0
        self._store: dict[Tensor, Any] = {}
        self._raw: dict[Tensor, np.ndarray] = {}  # weights' bytes as the file stores them
        self._mutable: list[Tensor] = []  # tensors made by `zeros` (the KV cache)

    @property
    def name(self) -> str:
        return self.buft.name

    def alloc_tensor(self, t: Tensor) -> None:
        """Reserve room for `t` in this buffer (ggml_backend_buffer_init_tensor)."""
        need = self.buft.alloc_size(t)
        if self.used + need > self.nbytes:
            raise OutOfMemoryError(
                f"{self.name} buffer: {t.name} needs {need} bytes, {self.nbytes - self.used} left"
            )
        self.used += need
        t.buffer = self

    @abstractmethod
    def set(self, t: Tensor, data: np.ndarray) -> None:
        """Host -> buffer. Quantized tensors take their raw bytes (uint8, rows x row_bytes)."""

    @abstractmethod
    def get(self, t: Tensor) -> np.ndarray:
        """Buffer -> host."""

    def zeros(self, t: Tensor) -> None:
        """Give `t` (placed by `alloc_tensor`) zero-filled, mutable memory of its type: the KV
        cache. Its native value keeps its identity from then on (`clear` fills it in place), so
        compiled plans may hold its address."""
        self._store[t] = self._zeros_value(t)
        self._mutable.append(t)

    def _zeros_value(self, t: Tensor) -> Any:
        raise NotImplementedError(f"{self.name} buffers hold no mutable tensors")

    def clear(self, value: float = 0) -> None:
        """Fill every mutable tensor with `value`, in place (ggml_backend_buffer_clear)."""
        for t in self._mutable:
            self._store[t].fill(value)

    def alias(self, t: Tensor, of: Tensor) -> None:
        """Make `t` a second name for `of`'s memory, with `t`'s shape (ggml_backend_view_init:
        a tied output matrix, a reshaped view); no bytes are reserved or copied."""
        v = self._store[of]
        if (t.shape, t.type) != (of.shape, of.type):
            if not isinstance(v, np.ndarray) or t.type != of.type or t.n_elements != of.n_elements:
                raise ValueError(f"{t.name} {t.type.name}{list(t.shape)} cannot alias {of.name} "
                                 f"{of.type.name}{list(of.shape)}")
            v = v.reshape(t.shape)  # a view: the same memory
        self._store[t] = v
        t.buffer = self
        if of in self._raw:
            self._raw[t] = self._raw[of]

    def use_cache(self, key: str, label: str = "", cpu_matmul: str = "q8") -> None:
        """Optional: a backend may keep prepared (repacked) weights in a cache file under `key`
        (identifying the model file's content; `label`: the model's name); called before the
        weights are set. `cpu_matmul`: the context's CPU MUL_MAT mode ("q8" or "f32"), which the
        host weights are laid out for."""

    def copies_weight(self, t: Tensor) -> bool:
        """Whether this buffer computes with its own copy of weight `t` (repacked, uploaded)
        rather than the bytes it was given: the loader then releases the file's pages that were
        read to make it, so they do not count in the RSS twice. Default: not known, kept."""
        return False

    def use_file(self, gf: Any) -> None:
        """Optional: the mapped GGUF file (model/gguf.py GGUFFile) the weights are set from,
        called before they are set: a remote device (backend/ray.py) has its node read them
        from its own copy of the file instead of receiving the bytes."""

    def finish_loading(self) -> None:
        """Optional: called once every weight is set (e.g. to write that cache)."""

    def storage(self, t: Tensor) -> Any:
        """The native value kernels compute with (an array, a QMatrix, a CuPy array)."""
        return self._store[t]

    def raw(self, t: Tensor) -> np.ndarray:
        """A weight's bytes as set (uint8 rows), for copying it to another device."""
        return self._raw[t]

    def tensors(self) -> list[Tensor]:
        return list(self._store)

    def free(self) -> None:
        """Release everything (ggml_backend_buffer_free); the device's budget gets it back."""
        self._store.clear()
        self._raw.clear()
        self._mutable.clear()
        self.used = 0
        self.buft.release(self)


class BufferType(ABC):
    """An allocator kind (ggml_backend_buffer_type): "CPU" host memory, "TEST0", "CUDA0"."""

    name: str
    is_host: bool = False
    alignment: int = 32

    @abstractmethod
    def alloc_buffer(self, nbytes: int, usage: BufferUsage = BufferUsage.ANY) -> Buffer: ...

    def alloc_size(self, t: Tensor) -> int:
        a = self.alignment
        return (t.nbytes + a - 1) // a * a

    def release(self, buf: Buffer) -> None:
        """Called by Buffer.free; devices with a memory budget give the bytes back here."""


class Backend(ABC):
    """An execution stream on one device (ggml_backend). `compute` is the only hot path."""

    def __init__(self, device: Device) -> None:
        self.device = device

    @property
    def name(self) -> str:
        return self.device.name

    @abstractmethod
    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        """Evaluate `nodes` in order; sources are found in `env` (or in their buffers) and every
        result is stored into `env`."""

    @abstractmethod
    def from_host(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        """A native value holding a copy of (or, for host backends, a view on) `data`.

        With a WEIGHT tensor `t`, `data` is its raw bytes and the result is the backend's
        weight representation (a QMatrix on the host)."""

    @abstractmethod
    def to_host(self, value: Any) -> np.ndarray: ...

    def to_host_batch(self, values: Sequence[Any]) -> list[np.ndarray]:
        """Several native values to the host, all the copies queued before one wait (the
        scheduler's device->host boundary: ggml_backend_sched's input copies of a split).
        Default: `to_host` each."""
        return [self.to_host(v) for v in values]

    def copy_from(self, src: Backend, value: Any) -> Any | None:
        """Optional device-to-device fast path; None means "go through the host"."""
        return None

    def graph_plan_create(
        self, nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Callable[..., Any]
    ) -> Any | None:
        """Optional (ggml_backend_graph_plan_create): compile a split's nodes once into a plan
        that `graph_plan_compute` runs with the values of the moment. `exports` are the nodes
        whose values must be in the environment afterwards (read by other splits, or graph
        outputs); `allocate` is the scheduler's allocator (sched/alloc.py `plan_offsets`: byte
        offsets from lifetimes), which a plan uses to lay out its memory. None, or a falsy
        object saying why: no plan (the default), and the scheduler calls `compute` instead."""
        return None

    def graph_plan_compute(self, plan: Any, env: dict[Tensor, Any]) -> None:
        """Run a plan of `graph_plan_create`: sources from `env` / their buffers, the exports
        stored into `env` (ggml_backend_graph_plan_compute)."""
        raise NotImplementedError(f"{self.name} makes no plans")

    def graph_plan_summary(self, plan: Any) -> str:
        """One line on a plan (or on why there is none) for LLAMAPY_SCHED_DEBUG; "" for nothing."""
        return ""

    def synchronize(self) -> None:
        """Wait for queued work (only asynchronous backends need it)."""

    def set_n_threads(self, n_threads: int) -> None:
        """Threads for host compute; device backends ignore it."""


class Device(ABC):
    """One physical or logical device (ggml_backend_device). Cheap to list; allocates nothing."""

    name: str
    type: DeviceType

    @abstractmethod
    def props(self) -> DeviceProps: ...

    @abstractmethod
    def buffer_type(self) -> BufferType: ...

    @abstractmethod
    def supports_op(self, node: Tensor) -> bool: ...

    @abstractmethod
    def init_backend(self) -> Backend: ...

    def supports_buft(self, buft: BufferType) -> bool:
        return buft is self.buffer_type()

    def offload_op(self, node: Tensor) -> bool:
        """Run this op here even though its weight lives in host memory (large batches)."""
        return False

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes."""
        p = self.props()
        return p.memory_free, p.memory_total

    def self_test(self) -> None:
        """Run one tiny op (llamapy devices' PASS/FAIL); raise on failure."""
        from ..ops import add
        from ..types import GGMLType

        a = Tensor("a", (3,), GGMLType.F32)
        b = Tensor("b", (3,), GGMLType.F32)
        out = add(a, b)
        be = self.init_backend()
        env = {a: be.from_host(np.array([1, 2, 3], np.float32)), b: be.from_host(np.ones(3, np.float32))}
        be.compute([out], env)
        got = be.to_host(env[out])
        if not np.array_equal(got, np.array([2, 3, 4], np.float32)):
            raise RuntimeError(f"ADD returned {got}")


class Registry(ABC):
    """A backend family ("CPU", "BLAS", "CUDA"): what an entry point in `llamapy.backends`
    resolves to (ggml_backend_reg)."""

    name: str

    @abstractmethod
    def devices(self) -> list[Device]: ...

    def score(self) -> int:
        """0 means unusable on this machine (ggml_backend_score)."""
        return 1
