"""The BLAS backend (ACCEL): big matrix multiplications on host memory (ggml-blas.cpp).

It shares the CPU's host buffers (no copies) and claims the MUL_MATs that `qmatmul.use_sgemm`
sends to sgemm (the one decision; the CPU backend runs the same products the same way, so the
BLAS backend only changes where the split falls). Quantized weights are expanded to f32 one tile
of rows at a time (ggml-blas converts with `to_float` first) and multiplied with numpy's sgemm
(QMatrix.matmul_tiles).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..tensor import Op, Tensor
from ..types import DeviceType
from .cpu import CPU_BUFT, CPUBackend
from .interface import Backend, BufferType, Device, DeviceProps, Registry
from .kernels import KERNELS, run_nodes
from .qmatmul import use_sgemm

class BLASBackend(CPUBackend):
    """The CPU backend's MUL_MAT (its sgemm path: the BLAS device is only given the products
    `use_sgemm` sends there; activations rounded as in the CPU's q8 mode), numpy for the rest."""

    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        try:
            run_nodes(nodes, env, np, table={**KERNELS, Op.MUL_MAT: self._mul_mat})
        finally:
            self._act.clear()

    def graph_plan_create(self, nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Any) -> Any | None:
        return None  # large GEMMs through its own table: nothing for the CPU executor


class BLASDevice(Device):
    name = "BLAS"
    type = DeviceType.ACCEL

    def props(self) -> DeviceProps:
        return DeviceProps(self.name, f"numpy matmul ({_blas_name()})", self.type)

    def buffer_type(self) -> BufferType:
        return CPU_BUFT

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.is_host

    def supports_op(self, node: Tensor) -> bool:
        if node.op is not Op.MUL_MAT:
            return False
        w, x = node.src
        n_tokens = x.n_elements // x.shape[-1]
        return len(w.shape) == 2 and use_sgemm(w.type, w.shape[0], w.shape[1], n_tokens)

    def init_backend(self) -> Backend:
        return BLASBackend(self)


def _blas_name() -> str:
    try:
        cfg = np.show_config(mode="dicts")  # type: ignore[call-arg]
        return str(cfg["Build Dependencies"]["blas"]["name"])
    except Exception:  # noqa: BLE001 - purely descriptive
        return "BLAS"


class BLASRegistry(Registry):
    name = "BLAS"

    def __init__(self) -> None:
        self._devices: list[Device] = [BLASDevice()]

    def devices(self) -> list[Device]:
        return self._devices


def registry() -> Registry:
    """Entry point `llamapy.backends: blas`."""
    return BLASRegistry()
