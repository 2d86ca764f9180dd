"""The CUDA backend on CuPy (ggml-cuda: `ggml-cuda.cu`'s registry, device, buffer type and
backend; `convert.cu`'s dequantization; `mmv.cu` / `mmvq.cu`'s matrix-vector kernels; cuBLAS for
large batches).

Importing this module never needs CuPy: `registry()` imports it and raises BackendUnavailable
with the reason (no CuPy, no driver, no device), which discovery records.

  * Devices CUDA0, CUDA1, ... are `MemoryDevice`s (backend/device.py): the budget is the free
    memory `cudaMemGetInfo` reports when the backend loads; buffers, counted copies, offload_op
    and supports_op are the code the TEST device exercises on machines without a GPU.
  * A split runs as a compiled GPU plan (gpu_plan.py: the CPU executor's records, each one
    kernel launch of cuda_ops; cuda_exec.py): up to MMV_MAX_TOKENS tokens captured once as a CUDA
    graph and replayed, a prompt's (its products f16 GEMMs on cuBLAS) launched directly; splits
    the plan refuses run through `kernels.run_nodes` with `xp = cupy` on one stream per device.
    Activations are float32 (the KV cache keeps its F16 type), except in the default "q8" mode
    (`CUDABackend.cpu_matmul`, the context's ContextOptions.cpu_matmul) the plans' large decode
    products, which read an int8 (q8_1) copy of their input (gpu_plan.product_path, mmvq.cu).
  * Weights are `CUDAQMatrix`: the file's raw blocks on the device, never expanded as a whole.
    `matmul(x)` uses the fused dequantize + matrix-vector kernels of `kernels_cuda/*.cu` for up to
    `MMV_MAX_TOKENS` tokens and otherwise dequantizes row tiles to float32 and calls cuBLAS
    (`cupy.matmul`; TF32 stays off unless CUPY_TF32 is set): float32 activations, only the
    weights' own rounding (this node-by-node path has no q8_1 products).
  * Copies (ggml-backend's sched with ggml-cuda's async copies and events): `upload` goes through
    two pinned staging buffers, packed copy after copy, as asynchronous H2D copies on the device's
    stream (no host wait unless a buffer is reused before its last copy finished);
    `download_batch` queues a boundary's D2H copies into one pinned block (a fresh one from CuPy's
    pinned pool each boundary, up to 64 MiB; bigger reads go straight into pageable arrays),
    waits once, on an event, and returns views of that block: no copy after the wait. `stats`
    counts copies and waits; `close()` frees the staging memory (so does freeing the device's
    last buffer).
  * `CUDADevice.limit_memory_pool(compute_bytes)` caps CuPy's memory pool at what the context
    planned (weights + KV cache + compute buffers, with headroom for CuPy's temporaries).
  * cupy's OutOfMemoryError becomes llamapy's OutOfMemoryError with the device and the step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..quants import KV_QUANT_TYPES as _KV_QUANT
from ..tensor import Op, Tensor, TensorFlag
from ..types import (
    NUMPY_DTYPES,
    BackendUnavailable,
    GGMLType,
    LlamapyError,
    OutOfMemoryError,
    UnsupportedError,
    block_size,
)
from .device import DeviceMemoryBufferType, MemoryDevice, MemoryDeviceBackend
from .gpu_plan import ArenaValue, own_values
from .interface import Backend, Buffer, Device, Registry
from .kernels import run_nodes

KERNEL_DIR = Path(__file__).with_name("kernels_cuda")

# The fused matrix-vector kernels handle up to this many tokens (MMV_MAX_TOK in common.cuh);
# larger batches dequantize row tiles and use cuBLAS.
MMV_MAX_TOKENS = 8
MMV_ROWS_PER_BLOCK = 4  # warps per thread block, one output row each
DEQUANT_THREADS = 256
# float32 elements per dequantized tile on the cuBLAS path (64 MiB)
TILE_ELEMS = 1 << 24
# pinned staging: two buffers of this size per device, used alternately
STAGING_BYTES = 8 << 20
# download_batch lands a boundary's values in pinned memory up to this; a bigger batch (a KV cache
# read back, a long prompt's every logit) is copied straight into pageable host arrays
READBACK_MAX_BYTES = 64 << 20
# headroom of the memory pool over the planned compute buffers: CuPy's kernels make temporaries
# (float64 sums in RMS_NORM, the KQ matrix in FLASH_ATTN_EXT) that ggml's in-place graph does not
POOL_COMPUTE_FACTOR = 3.0
POOL_SLACK_BYTES = 256 << 20

# type -> (source file, kernel name suffix)
_TYPE_KERNELS: dict[GGMLType, tuple[str, str]] = {
    GGMLType.F32: ("floats.cu", "f32"),
    GGMLType.F16: ("floats.cu", "f16"),
    GGMLType.BF16: ("floats.cu", "bf16"),
    GGMLType.Q4_0: ("legacy.cu", "q4_0"),
    GGMLType.Q4_1: ("legacy.cu", "q4_1"),
    GGMLType.Q5_0: ("legacy.cu", "q5_0"),
    GGMLType.Q5_1: ("legacy.cu", "q5_1"),
    GGMLType.Q8_0: ("legacy.cu", "q8_0"),
    GGMLType.Q2_K: ("kquants.cu", "q2_k"),
    GGMLType.Q3_K: ("kquants.cu", "q3_k"),
    GGMLType.Q4_K: ("kquants.cu", "q4_k"),
    GGMLType.Q5_K: ("kquants.cu", "q5_k"),
    GGMLType.Q6_K: ("kquants.cu", "q6_k"),
    GGMLType.IQ4_NL: ("iquants.cu", "iq4_nl"),
    GGMLType.IQ4_XS: ("iquants.cu", "iq4_xs"),
    GGMLType.MXFP4: ("iquants.cu", "mxfp4"),
}
WEIGHT_TYPES: frozenset[GGMLType] = frozenset(_TYPE_KERNELS)
_FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
# Types with a fused dequantize + matrix-vector kernel. All of them share one template
# (common.cuh), so every weight type has one; Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and F16/F32 are the
# ones llama GGUFs mostly use.
MMV_TYPES: frozenset[GGMLType] = WEIGHT_TYPES


def kernel_sources() -> dict[str, Path]:
    """The .cu files of the kernels, by name (the header common.cuh is inlined into each)."""
    return {p.name: p for p in sorted(KERNEL_DIR.glob("*.cu"))}


def _module_source(filename: str) -> str:
    """A .cu file with `#include "common.cuh"` replaced by the header's text, so that CuPy's
    compile cache (keyed by the source) sees every change and NVRTC needs no include path."""
    src = (KERNEL_DIR / filename).read_text()
    common = (KERNEL_DIR / "common.cuh").read_text()
    common = common.replace("#pragma once", "")
    return src.replace('#include "common.cuh"', common)


def _first_line(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s.splitlines()[0] if s else type(e).__name__


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


class CUDAQMatrix:
    """A weight matrix (n_out rows of n_in elements) on a CUDA device, kept as the file's blocks.

    The device mirror of qmatmul.QMatrix: `matmul`, `get_rows`, `dequantize` and `nbytes`, with
    CuPy arrays in and out.
    """

    def __init__(self, device: CUDADevice, raw: Any, qtype: GGMLType, n_out: int, n_in: int) -> None:
        self.device = device
        self.raw = raw  # cupy uint8 (n_out, row_bytes)
        self.qtype = GGMLType(qtype)
        self.n_out = n_out
        self.n_in = n_in
        self.row_bytes = int(raw.shape[1]) if n_out else 0

    @classmethod
    def check(cls, qtype: GGMLType, n_out: int, n_in: int, nbytes: int) -> int:
        """Validate a weight's shape and size; returns its row size in bytes."""
        qtype = GGMLType(qtype)
        if qtype not in WEIGHT_TYPES:
            raise UnsupportedError(f"CUDA: weights of type {qtype.name}")
        blck, bsize = block_size(qtype)
        if n_in % blck or n_in % 32:
            raise ValueError(f"n_in={n_in} is not a multiple of {qtype.name}'s block of {blck}")
        row_bytes = n_in // blck * bsize
        if nbytes != n_out * row_bytes:
            raise ValueError(f"{qtype.name} matrix {n_out}x{n_in} needs {n_out * row_bytes} bytes, got {nbytes}")
        return row_bytes

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    def row_range(self, r0: int, r1: int) -> CUDAQMatrix:
        """Rows [r0, r1) sharing this matrix's device blocks (one expert of a stacked expert
        weight, MUL_MAT_ID through the reference kernel; no dedicated CUDA kernel yet)."""
        return CUDAQMatrix(self.device, self.raw[r0:r1], self.qtype, r1 - r0, self.n_in)

    # -- dequantization -----------------------------------------------------------------------

    def _dequant_raw(self, raw: Any) -> Any:
        """float32 (n, n_in) from raw rows (n, row_bytes) already on the device."""
        cp = self.device.cp
        n = int(raw.shape[0])
        out = cp.empty((n, self.n_in), cp.float32)
        units_per_row = self.n_in // 32
        n_units = n * units_per_row
        if n_units:
            raw = cp.ascontiguousarray(raw)
            fn = self.device.kernel("dequant", self.qtype)
            grid = (n_units + DEQUANT_THREADS - 1) // DEQUANT_THREADS
            fn(
                (grid,),
                (DEQUANT_THREADS,),
                (raw, out, np.int64(n_units), np.int32(units_per_row), np.int64(self.row_bytes)),
            )
        return out

    def dequantize(self, rows: Any = None) -> Any:
        """float32 (n, n_in) CuPy array of the selected rows (all when `rows` is None)."""
        dev = self.device
        with dev.context("dequantizing a weight"):
            if rows is None:
                sel = self.raw
            elif isinstance(rows, slice):
                sel = self.raw[rows]
            else:
                sel = self.raw[self._ids(rows)]
            return self._dequant_raw(sel)

    def _ids(self, ids: Any) -> Any:
        # No range check here: it would cost a device->host sync per call. Token ids are checked
        # by Context.decode; CuPy's indexing wraps out-of-range ids instead of faulting.
        cp = self.device.cp
        return cp.asarray(ids).reshape(-1).astype(cp.int64)

    def get_rows(self, ids: Any) -> Any:
        """GET_ROWS: float32 (len(ids), n_in), e.g. token embeddings."""
        return self.dequantize(ids)

    # -- matmul --------------------------------------------------------------------------------

    def matmul(self, x: Any) -> Any:
        """x float32 (n_tokens, n_in) -> float32 (n_tokens, n_out) = x @ W.T, on the device."""
        dev = self.device
        cp = dev.cp
        with dev.context("MUL_MAT"):
            x = cp.asarray(x)
            squeeze = x.ndim == 1
            if squeeze:
                x = x.reshape(1, -1)
            if x.ndim != 2 or x.shape[1] != self.n_in:
                raise ValueError(f"x has shape {x.shape}, expected (n_tokens, {self.n_in})")
            if x.dtype != cp.float32:
                x = x.astype(cp.float32)
            n_tok = int(x.shape[0])
            if n_tok == 0 or self.n_out == 0:
                out = cp.zeros((n_tok, self.n_out), cp.float32)
            elif n_tok <= MMV_MAX_TOKENS and self.qtype in MMV_TYPES:
                out = self._matmul_mmv(x)
            else:
                out = self._matmul_blas(x)
            return out.reshape(-1) if squeeze else out

    def _matmul_mmv(self, x: Any) -> Any:
        cp = self.device.cp
        x = cp.ascontiguousarray(x)
        if x.data.ptr % 16:  # the kernel reads x as float4
            x = x.copy()
        n_tok = int(x.shape[0])
        out = cp.empty((n_tok, self.n_out), cp.float32)
        fn = self.device.kernel("mmv", self.qtype)
        grid = (self.n_out + MMV_ROWS_PER_BLOCK - 1) // MMV_ROWS_PER_BLOCK
        fn(
            (grid,),
            (32 * MMV_ROWS_PER_BLOCK,),
            (
                self.raw,
                x,
                out,
                np.int32(self.n_out),
                np.int32(self.n_in),
                np.int64(self.row_bytes),
                np.int32(n_tok),
                np.uint64(0),  # (no bias epilogue)
            ),
        )
        return out

    def _matmul_blas(self, x: Any) -> Any:
        cp = self.device.cp
        if self.qtype == GGMLType.F32:
            return cp.matmul(x, self.raw.view(cp.float32).T)
        step = max(1, TILE_ELEMS // self.n_in)
        if step >= self.n_out:
            return cp.matmul(x, self._dequant_raw(self.raw).T)
        out = cp.empty((x.shape[0], self.n_out), cp.float32)
        for r0 in range(0, self.n_out, step):
            r1 = min(self.n_out, r0 + step)
            out[:, r0:r1] = cp.matmul(x, self._dequant_raw(self.raw[r0:r1]).T)
        return out


# ---------------------------------------------------------------------------------------------
# device
# ---------------------------------------------------------------------------------------------


class _Staging:
    """One pinned host buffer, filled from `off` on, and the event of the last copy out of it."""

    def __init__(self, cp: Any, nbytes: int) -> None:
        self.mem = cp.cuda.alloc_pinned_memory(nbytes)
        self.view = np.frombuffer(self.mem, np.uint8, nbytes)
        self.event: Any = None
        self.off = 0


class CUDADevice(MemoryDevice):
    """One CUDA device: memory budget, stream, pinned staging buffers, compiled kernels."""

    def __init__(self, index: int, cp: Any) -> None:
        self.cp = cp
        self.index = index
        self.xp = cp
        self._device = cp.cuda.Device(index)
        with self._device:
            free, total = cp.cuda.runtime.memGetInfo()
            self.stream = cp.cuda.Stream(non_blocking=True)
        props = cp.cuda.runtime.getDeviceProperties(index)
        name = props.get("name", b"CUDA device")
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        cc = f"{props.get('major', '?')}.{props.get('minor', '?')}"
        self.memory_total = int(total)
        super().__init__(f"CUDA{index}", int(free), f"{name} (compute {cc}, {total / 2**30:.1f} GiB)")
        self._buft = _CUDABufferType(self, int(free))
        self._modules: dict[str, Any] = {}
        self._functions: dict[tuple[str, GGMLType], Any] = {}
        self._staging: list[_Staging] = []
        self._next_staging = 0
        self._ops: Any = None
        self._runtime: Any = None  # cuda_exec.CUDARuntime: the compiled plans' arena and launches

    def runtime(self) -> Any:
        """The device's GPU-plan runtime (cuda_exec.py), made on first use."""
        if self._runtime is None:
            from .cuda_exec import CUDARuntime

            self._runtime = CUDARuntime(self)
        return self._runtime

    # -- context --------------------------------------------------------------------------

    @contextlib.contextmanager
    def context(self, what: str) -> Iterator[None]:
        """This device and its stream current; CuPy's OutOfMemoryError becomes llamapy's."""
        cp = self.cp
        try:
            with self._device, self.stream:
                yield
        except cp.cuda.memory.OutOfMemoryError as e:
            raise OutOfMemoryError(
                f"{self.name}: out of device memory while {what} ({e}); "
                f"{self.allocated / 2**20:.0f} MiB in buffers, budget {self._buft.budget / 2**20:.0f} MiB"
            ) from None

    def kernel(self, kind: str, qtype: GGMLType) -> Any:
        """The compiled `dequant_<type>` or `mmv_<type>` function (NVRTC, cached by CuPy)."""
        key = (kind, qtype)
        fn = self._functions.get(key)
        if fn is None:
            filename, suffix = _TYPE_KERNELS[qtype]
            mod = self._modules.get(filename)
            if mod is None:
                opts = (f"-DMMV_MAX_TOK={MMV_MAX_TOKENS}",)
                mod = self.cp.RawModule(code=_module_source(filename), options=opts)
                self._modules[filename] = mod
            fn = mod.get_function(f"{kind}_{suffix}")
            self._functions[key] = fn
        return fn

    def ops(self) -> Any:
        """Every kernel of kernels_cuda/ compiled and loaded on this device, once
        (cuda_ops.CudaKernels: the launch functions of the compiled GPU split)."""
        if self._ops is None:
            from .cuda_ops import CudaKernels

            with self._device:
                self._ops = CudaKernels.load(self.cp)
        return self._ops

    # -- memory ---------------------------------------------------------------------------

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes as the driver reports them now."""
        with self._device:
            free, total = self.cp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def set_pool_limit(self, nbytes: int | None) -> None:
        """Cap CuPy's memory pool on this device at `nbytes` (None or 0: no cap)."""
        with self._device:
            self.cp.get_default_memory_pool().set_limit(size=int(nbytes or 0))

    def limit_memory_pool(self, compute_bytes: int, factor: float = POOL_COMPUTE_FACTOR,
                          slack: int = POOL_SLACK_BYTES) -> int:
        """Cap the pool at the planned size: the buffers allocated so far (weights, KV cache)
        plus `factor` times the planned compute buffers plus `slack`. Returns the limit."""
        limit = int(self.allocated + factor * max(0, int(compute_bytes)) + slack)
        self.set_pool_limit(limit)
        return limit

    def release_cached(self) -> None:
        """Give the pool's unused blocks back to the driver (after buffers were freed)."""
        with self._device:
            self.cp.get_default_memory_pool().free_all_blocks()

    # -- MemoryDevice ---------------------------------------------------------------------

    def _h2d(self, host: np.ndarray) -> Any:
        """A device copy of `host` through the pinned staging buffers (asynchronous on the
        device's stream). Copies are packed into the current buffer; when it is full the other
        one is taken, waiting only if its last copy has not finished (a weight's chunks alternate,
        so loading overlaps the host's memcpy with the DMA; a step's small copies never wait)."""
        cp = self.cp
        host = np.ascontiguousarray(host)
        out = cp.empty(host.shape, host.dtype)
        src = host.reshape(-1).view(np.uint8)
        n = src.size
        if not n:
            return out
        if not self._staging:
            self._staging = [_Staging(cp, STAGING_BYTES), _Staging(cp, STAGING_BYTES)]
        dst = out.data.ptr
        off = 0
        while off < n:
            k = min(n - off, STAGING_BYTES)
            slot = self._staging[self._next_staging]
            if slot.off + k > STAGING_BYTES:
                self._next_staging ^= 1
                slot = self._staging[self._next_staging]
                if slot.event is not None and not slot.event.done:
                    slot.event.synchronize()
                    self.stats.n_sync += 1
                slot.off = 0
            o = slot.off
            slot.view[o : o + k] = src[off : off + k]
            cp.cuda.runtime.memcpyAsync(dst + off, slot.mem.ptr + o, k, 1, self.stream.ptr)  # 1: H2D
            slot.event = self.stream.record()
            slot.off = o + k
            off += k
        return out

    def download_batch(self, values: Sequence[Any]) -> list[np.ndarray]:
        """The values' D2H copies queued on the stream into one pinned block, then ONE wait (an
        event recorded after them); the host arrays are views of that block (no copy after the
        wait: a 128k vocabulary's logits row is ~30 us of memcpy), a fresh block from CuPy's pinned
        pool each call, back in the pool once the caller drops them. Past READBACK_MAX_BYTES
        (a long prompt's every logit) the copies land in pageable arrays instead."""
        cp = self.cp
        with self.context("downloading tensors"):
            # (address, bytes, shape, dtype, owner) of each: a GPU plan's export read where its
            # launches left it (gpu_plan.ArenaValue), anything else as a contiguous device array
            srcs: list[tuple[int, int, tuple[int, ...], np.dtype, Any]] = []
            for v in values:
                if isinstance(v, ArenaValue) and v.array is None and v.contiguous():
                    srcs.append((v.addr, v.nbytes, v.slot.shape, v.slot.dtype, v))
                    continue
                if isinstance(v, ArenaValue):
                    v = v.own()
                a = cp.ascontiguousarray(v.dequantize() if isinstance(v, CUDAQMatrix) else cp.asarray(v))
                srcs.append((int(a.data.ptr), int(a.nbytes), tuple(a.shape), np.dtype(a.dtype), a))
            offs, total = [], 0
            for src in srcs:
                offs.append(total)
                total += -(-src[1] // 64) * 64  # (64-byte aligned views)
            if total > READBACK_MAX_BYTES:
                outs = [np.empty(shape, dt) for _a, _n, shape, dt, _w in srcs]
                dsts = [int(o.ctypes.data) for o in outs]
            else:
                mem = cp.cuda.alloc_pinned_memory(max(total, 64))
                block = np.frombuffer(mem, np.uint8, total)  # (its base keeps `mem` alive)
                outs = [block[o : o + n].view(dt).reshape(shape) for (_a, n, shape, dt, _w), o in zip(srcs, offs)]
                dsts = [mem.ptr + o for o in offs]
            for (addr, n, _shape, _dt, _owner), dst in zip(srcs, dsts):
                if n:
                    cp.cuda.runtime.memcpyAsync(dst, addr, n, 2, self.stream.ptr)  # 2: D2H
            self.stream.record().synchronize()
        self.stats.n_sync += 1
        self.stats.n_out += len(srcs)
        self.stats.bytes_out += sum(src[1] for src in srcs)
        return outs

    def close(self) -> None:
        """Free the pinned staging memory (the device's and its GPU plans' mirror) once the
        stream is idle; made again on the next copy."""
        with self._device:
            self.stream.synchronize()
        self._staging, self._next_staging = [], 0
        if self._runtime is not None:
            self._runtime.free_pinned()

    def upload(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        data = np.asarray(data)
        self.stats.bytes_in += data.nbytes
        self.stats.n_in += 1
        with self.context(f"uploading {t.name if t is not None else 'a tensor'}"):
            if t is not None and t.flags & TensorFlag.WEIGHT:
                if len(t.shape) == 2 and t.type in _FLOAT_TYPES and t.shape[1] % 32:
                    # rows the 32-element kernels cannot walk: a plain float32 matrix (cuBLAS)
                    from ..quants import dequantize

                    return self._h2d(dequantize(data.reshape(-1).view(np.uint8), t.type, t.shape[1]))
                if len(t.shape) in (2, 3):
                    n_out, n_in = math.prod(t.shape[:-1]), t.shape[-1]  # experts: stacked rows
                    raw = data.reshape(-1).view(np.uint8)
                    row_bytes = CUDAQMatrix.check(t.type, n_out, n_in, raw.size)
                    dev_raw = self._h2d(raw.reshape(n_out, row_bytes))
                    return CUDAQMatrix(self, dev_raw, t.type, n_out, n_in)
                if t.type not in NUMPY_DTYPES:
                    # a quantized or bf16 vector (rare): expand it on the host, it is small
                    from ..quants import dequantize

                    data = dequantize(data.reshape(1, -1).view(np.uint8), t.type, t.n_elements)
                    return self._h2d(data.reshape(t.shape))
                return self._h2d(data.view(NUMPY_DTYPES[t.type]).reshape(t.shape))
            return self._h2d(data)

    def download(self, value: Any) -> np.ndarray:
        return self.download_batch([value])[0]

    def zeros(self, t: Tensor) -> Any:
        with self.context(f"allocating {t.name}"):
            return self.cp.zeros(t.shape, NUMPY_DTYPES[t.type])

    def supports_op(self, node: Tensor) -> bool:
        if not super().supports_op(node):
            return False
        if node.op in (Op.MUL_MAT, Op.MUL_MAT_ID, Op.GET_ROWS) and node.src:
            w = node.src[0]
            if w.flags & TensorFlag.WEIGHT and w.type not in WEIGHT_TYPES:
                return False
        # a Q8_0/Q4_0 KV cache (kept on the host: Context refuses it on CUDA) is read on the host;
        # a Q8_0/Q4_0 weight is not a cache (mmv_q8_0 / mmv_q4_0 multiply it here)
        if node.type in _KV_QUANT or any(s.type in _KV_QUANT and not s.flags & TensorFlag.WEIGHT for s in node.src):
            return False
        return True

    def init_backend(self) -> Backend:
        return CUDABackend(self)



class _CUDABufferType(DeviceMemoryBufferType):
    """Device memory with the free memory as budget; a freed buffer's arrays are dropped and the
    pool's unused blocks go back to the driver, so the memory is free for others too."""

    device: CUDADevice

    def release(self, buf: Buffer) -> None:
        super().release(buf)
        try:
            self.device.release_cached()
            if self.allocated <= 0:  # the device's last buffer (a freed model): its pinned memory too
                self.device.close()
        except Exception:  # noqa: BLE001 - freeing must never fail
            pass


class CUDABackend(MemoryDeviceBackend):
    """An execution stream on one CUDA device (ggml_backend_cuda)."""

    device: CUDADevice
    # the context's MUL_MAT mode (ContextOptions.cpu_matmul): "q8" puts the large decode products
    # of the GPU plans on int8 dot products over a q8_1 copy of x (gpu_plan.product_path), "f32"
    # keeps every product on float32 activations
    cpu_matmul: str = "q8"

    def set_cpu_matmul(self, mode: str) -> None:
        from .qmatmul import MATMUL_MODES

        if mode not in MATMUL_MODES:
            raise LlamapyError(f"cpu_matmul must be one of {', '.join(MATMUL_MODES)}, not {mode!r}")
        self.cpu_matmul = mode

    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        dev = self.device
        with dev.context("computing " + (nodes[0].name if nodes else "nothing")):
            own_values(env, nodes)  # (a GPU plan's exports read node by node: copies of their own)
            run_nodes(nodes, env, dev.cp)

    def synchronize(self) -> None:
        self.device.stream.synchronize()

    # -- compiled plans (gpu_plan.py, launched by cuda_exec.py) ---------------------------------

    def graph_plan_create(self, nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Any) -> Any:
        from .executor import Refusal
        from .executor import enabled as executor_enabled
        from .gpu_plan import compile_split

        if not executor_enabled():
            return Refusal("LLAMAPY_EXECUTOR=0")
        dev = self.device
        with dev.context("compiling a GPU plan"):
            return compile_split(nodes, exports, allocate, dev.runtime(), self.cpu_matmul)

    def plan_arena_bytes(self, nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Any) -> int | None:
        """The arena the GPU plan of these nodes will take (gpu_plan.arena_bytes; the fit's)."""
        from .executor import enabled as executor_enabled
        from .gpu_plan import arena_bytes

        if not executor_enabled():
            return None
        n_sm = int(self.device._device.attributes["MultiProcessorCount"])
        return arena_bytes(nodes, exports, allocate, self.device.buffer_type(), MMV_MAX_TOKENS, n_sm, self.cpu_matmul)

    def graph_plan_compute(self, plan: Any, env: dict[Tensor, Any]) -> None:
        with self.device.context("running a GPU plan"):
            plan.compute(env)

    def graph_plan_summary(self, plan: Any) -> str:
        if plan is None:
            return ""
        return plan.summary() if plan else f"GPU plan refused: {plan.reason} (run_nodes)"

    def copy_from(self, src: Backend, value: Any) -> Any | None:
        """CUDA -> CUDA arrays: a peer copy; anything else goes through the host."""
        if not isinstance(src, CUDABackend) or isinstance(value, CUDAQMatrix):
            return None
        if isinstance(value, ArenaValue):  # a GPU plan's export, read by a later split on a device
            with src.device.context("copying a plan's export"):
                value = value.own()
        cp = self.device.cp
        if not isinstance(value, cp.ndarray):
            return None
        if src.device is self.device:
            return value
        with src.device.context("copying between devices"):
            v = cp.ascontiguousarray(value)
            src.device.stream.synchronize()
        src.device.stats.n_sync += 1
        with self.device.context("copying between devices"):
            out = cp.empty(v.shape, v.dtype)
            if v.nbytes:
                cp.cuda.runtime.memcpyPeerAsync(
                    out.data.ptr, self.device.index, v.data.ptr, src.device.index, v.nbytes, self.device.stream.ptr
                )
        return out


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


class CUDARegistry(Registry):
    name = "CUDA"

    def __init__(self, devices: list[CUDADevice]) -> None:
        self._devices: list[Device] = list(devices)

    def devices(self) -> list[Device]:
        return self._devices

    def score(self) -> int:
        return 1 if self._devices else 0


def registry() -> Registry:
    """Entry point `llamapy.backends: cuda`. Raises BackendUnavailable, with the reason, when
    CuPy is missing, no driver is usable or no device is visible."""
    try:
        import cupy as cp
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA library under CuPy
        raise BackendUnavailable(
            f"CUDA: no CuPy ({_first_line(e)}); install cupy-cuda12x or cupy-cuda13x"
        ) from None
    try:
        n = int(cp.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver, driver too old, no device
        raise BackendUnavailable(f"CUDA: no GPU or no usable driver ({_first_line(e)})") from None
    if n <= 0:
        raise BackendUnavailable("CUDA: no GPU (cudaGetDeviceCount returned 0)")
    devices: list[CUDADevice] = []
    errors: list[str] = []
    for i in range(n):
        try:
            devices.append(CUDADevice(i, cp))
        except Exception as e:  # noqa: BLE001 - one broken device must not hide the others
            errors.append(f"CUDA{i}: {_first_line(e)}")
    if not devices:
        raise BackendUnavailable("CUDA: no usable GPU (" + "; ".join(errors) + ")")
    return CUDARegistry(devices)
