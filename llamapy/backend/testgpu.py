"""A GPU-like test device: `LLAMAPY_TEST_GPU=1` (or `=2`) registers TEST0 (TEST1), of type GPU.

It runs the CPU kernels but owns its memory: every value is a private copy made by `upload`,
every copy is counted in bytes, and `LLAMAPY_TEST_GPU_MEM` (MiB; `96,32` gives each device its
own) is its budget — and so its free memory, which the default layer split follows. Placement,
splits, copies and memory fitting are exercised through the same device-memory code CUDA uses
(backend/device.py) on machines without a GPU. It plays the role of tinygrad's NULL device and
of ggml's test backends.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..tensor import Tensor, TensorFlag
from ..types import storage
from .cpu import host_value
from .device import MemoryDevice
from .gpu_plan import ArenaValue
from .interface import Device, Registry


class TestDevice(MemoryDevice):
    __test__ = False  # not a pytest class

    def upload(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        data = np.asarray(data)
        self.stats.bytes_in += data.nbytes
        self.stats.n_in += 1
        if t is not None and t.flags & TensorFlag.WEIGHT:
            return host_value(t, data, copy=True)
        return np.array(data, copy=True)

    def download(self, value: Any) -> np.ndarray:
        return self.download_batch([value])[0]

    def download_batch(self, values: Sequence[Any]) -> list[np.ndarray]:
        """CUDA's contract, counted: every copy of the batch, then one synchronisation."""
        values = [v.own() if isinstance(v, ArenaValue) else v for v in values]  # (a GPU plan's export)
        out = [np.array(v, copy=True) if isinstance(v, np.ndarray) else v.dequantize() for v in values]
        self.stats.bytes_out += sum(a.nbytes for a in out)
        self.stats.n_out += len(out)
        self.stats.n_sync += 1
        return out

    def zeros(self, t: Tensor) -> Any:
        return np.zeros(*storage(t.type, t.shape))


class TestRegistry(Registry):
    __test__ = False
    name = "TEST"

    def __init__(self, count: int, budget_mib: float | Sequence[float]) -> None:
        budgets = [budget_mib] if isinstance(budget_mib, (int, float)) else list(budget_mib) or [1 << 20]
        self._devices: list[Device] = [
            TestDevice(
                f"TEST{i}",
                int(budgets[min(i, len(budgets) - 1)] * 2**20),
                "GPU-like test device (CPU kernels, own memory)",
            )
            for i in range(count)
        ]

    def devices(self) -> list[Device]:
        return self._devices

    def score(self) -> int:
        return 1 if self._devices else 0


def _budgets(text: str) -> list[float]:
    """`LLAMAPY_TEST_GPU_MEM`: MiB for every device (`64`) or per device (`96,32`: TEST0, TEST1;
    the last value repeats); unset or unreadable: effectively unlimited."""
    try:
        return [float(x) for x in text.split(",") if x.strip()] or [1 << 20]
    except ValueError:
        return [1 << 20]


def registry() -> Registry:
    """Entry point: the TEST registry, with as many devices as LLAMAPY_TEST_GPU asks for."""
    try:
        count = int(os.environ.get("LLAMAPY_TEST_GPU", "0") or 0)
    except ValueError:
        count = 0
    return TestRegistry(max(count, 0), _budgets(os.environ.get("LLAMAPY_TEST_GPU_MEM", "")))
