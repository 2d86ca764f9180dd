"""The BLAS backend (ACCEL): big matrix multiplications on host memory (ggml-blas.cpp).

It shares the CPU's host buffers (no copies) and claims MUL_MAT only when all three dimensions
reach `min_batch` (ggml-blas: ne0, ne1, ne10 >= 32), because a GEMM call only pays off on large
products. Quantized weights are expanded to f32 one tile of rows at a time (ggml-blas converts
with `to_float` first) and multiplied with numpy's sgemm.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..tensor import Op, Tensor
from ..types import DeviceType
from .cpu import CPU_BUFT, CPUBackend
from .interface import Backend, BufferType, Device, DeviceProps, Registry
from .kernels import KERNELS, run_nodes

TILE_ROWS = 4096  # rows of the weight expanded at once: bounds the f32 scratch to a few MiB


def blas_mul_mat(node: Tensor, s: list[Any], xp: Any) -> Any:
    w, x = s
    x2 = x.reshape(-1, x.shape[-1])  # (n_tokens, K)
    if hasattr(w, "matmul_tiles"):
        out = w.matmul_tiles(x2)  # (n_tokens, M): dequantized tiles through sgemm
    elif hasattr(w, "dequantize"):
        out = np.empty((x2.shape[0], w.n_out), np.float32)
        for r0 in range(0, w.n_out, TILE_ROWS):
            r1 = min(r0 + TILE_ROWS, w.n_out)
            np.matmul(x2, w.dequantize(slice(r0, r1)).T, out=out[:, r0:r1])  # tile: (rows, K)
    else:
        return KERNELS[Op.MUL_MAT](node, s, xp)
    return out.reshape(*x.shape[:-1], out.shape[-1])


BLAS_KERNELS = {**KERNELS, Op.MUL_MAT: blas_mul_mat}


class BLASBackend(CPUBackend):
    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        run_nodes(nodes, env, np, table=BLAS_KERNELS)

    def graph_plan_create(self, nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Any) -> Any | None:
        return None  # large GEMMs through its own table: nothing for the CPU executor


class BLASDevice(Device):
    name = "BLAS"
    type = DeviceType.ACCEL

    def __init__(self, min_batch: int = 32) -> None:
        self.min_batch = min_batch

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
        m = self.min_batch
        return len(w.shape) == 2 and w.shape[0] >= m and n_tokens >= m and w.shape[1] >= m

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
        try:
            m = int(os.environ.get("LLAMAPY_BLAS_MIN_BATCH", "32"))
        except ValueError:
            m = 32
        self._devices: list[Device] = [BLASDevice(m)]

    def devices(self) -> list[Device]:
        return self._devices


def registry() -> Registry:
    """Entry point `llamapy.backends: blas`."""
    return BLASRegistry()
