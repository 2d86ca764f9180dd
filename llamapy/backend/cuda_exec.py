"""The CUDA launcher of the compiled GPU split (ggml-cuda.cu's graph compute: kernels launched on
the backend's stream, `cudaStreamBeginCapture` / `cudaGraphInstantiate` / `cudaGraphLaunch`;
backend/gpu_plan.py is the plan, backend/executor.py the record compiler both launchers share).

`CUDARuntime` is gpu_plan's `Runtime` on CuPy, one per device (`CUDADevice.runtime()`):
  * the device arena: one allocation, grown to the largest plan's size (`DeviceArena`);
  * a pinned host mirror of the plans' input region, sent by one `cudaMemcpyAsync` a step;
  * `prepare(record)`: the record's kernel launch, its function compiled and loaded now and its
    arguments packed now (numpy scalars; pointers as uint64), so that a launch inside a capture
    allocates nothing, compiles nothing and calls no cuBLAS (CuPy's capture rules);
  * `capture(launches)`: the launches recorded on the device's stream into a CUDA graph
    (`Stream.begin_capture` / `end_capture`); a failure is a Refused with CuPy's reason, and
    the plan then launches directly.
The kernels are those of `kernels_cuda/` through `cuda_ops` (the launch layer: grid, block,
strides); the matrix-vector products are `mmv_<type>` of common.cuh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..types import GGMLType
from .executor import Loc, Refused, _Slot
from .gpu_plan import GET_ROWS_W, MUL_MAT_W


def _first_line(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s.splitlines()[0]


class DeviceArena:
    """The compute memory of a device's plans (ggml-cuda's compute buffer): one allocation as
    large as the largest plan's; a plan made before it grew moves its records on its next run."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.mem: Any = None
        self.base = 0
        self.size = 0

    def ensure(self, nbytes: int) -> int:
        if nbytes > self.size or self.mem is None:
            self.mem = None  # the old block goes first: never both
            with self.dev.context("allocating the compute arena"):
                self.mem = self.dev.cp.cuda.alloc(max(nbytes, 256))
            self.base, self.size = int(self.mem.ptr), nbytes
        return self.base


class CUDARuntime:
    """gpu_plan.Runtime on one CUDA device (see the module docstring)."""

    def __init__(self, dev: Any) -> None:
        from .cuda import MMV_MAX_TOKENS

        self.dev = dev
        self.cp = dev.cp
        self.buft = dev.buffer_type()
        self.max_tokens = MMV_MAX_TOKENS
        self.arena = DeviceArena(dev)
        self._pinned: Any = None
        self._mirror = np.zeros(0, np.uint8)
        self._copied: Any = None  # the event of the last copy out of the mirror

    # -- memory -------------------------------------------------------------------------------

    def array_loc(self, v: Any) -> Loc:
        cp = self.cp
        if not isinstance(v, cp.ndarray):
            raise Refused(f"a {type(v).__name__} where a device array is needed")
        isz = v.itemsize
        return Loc(int(v.data.ptr), tuple(v.shape), tuple(s // isz for s in v.strides), np.dtype(v.dtype), v)

    def weight(self, v: Any) -> tuple[int, int, int, int, int]:
        from .cuda import CUDAQMatrix

        if not isinstance(v, CUDAQMatrix):
            raise Refused(f"a MUL_MAT weight of type {type(v).__name__} (a float32 matrix: cuBLAS)")
        return int(v.raw.data.ptr), int(v.qtype), v.n_out, v.n_in, v.row_bytes

    def host(self, v: Any) -> np.ndarray:
        with self.dev.context("reading a small tensor"):
            return self.cp.asnumpy(v, stream=self.dev.stream)

    def const(self, a: np.ndarray) -> tuple[int, Any]:
        with self.dev.context("uploading a constant table"):
            d = self.cp.asarray(np.ascontiguousarray(a))
        return int(d.data.ptr), d

    def pinned(self, nbytes: int) -> np.ndarray:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the mirror (done by now)
        if nbytes > self._mirror.size:
            self._pinned = self.cp.cuda.alloc_pinned_memory(nbytes)
            self._mirror = np.frombuffer(self._pinned, np.uint8, nbytes)
        return self._mirror

    def h2d(self, dst: int, src: np.ndarray) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst, src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, self.dev.stream.ptr)
        self._copied = self.dev.stream.record()

    def d2d(self, dst: int, value: Any) -> None:
        cp = self.cp
        v = cp.ascontiguousarray(value)
        rt = cp.cuda.runtime
        rt.memcpyAsync(dst, int(v.data.ptr), v.nbytes, rt.memcpyDeviceToDevice, self.dev.stream.ptr)

    def copy_out(self, addr: int, slot: _Slot) -> Any:
        cp = self.cp
        mem = cp.cuda.UnownedMemory(addr, max(1, _span(slot)), self.arena)
        view = cp.ndarray(slot.shape, slot.dtype, cp.cuda.MemoryPointer(mem, 0), strides=slot.strides)
        return view.copy()  # on the device's stream (the backend's context is current)

    # -- launches -------------------------------------------------------------------------------

    def prepare(self, rec: np.ndarray) -> Callable[[], None]:
        code = int(rec[0])
        make = _LAUNCHES.get(code)
        if make is None:
            raise Refused(f"no CUDA kernel for record op {code}")
        with self.dev.context("loading a kernel"):
            return make(self, rec)

    def capture(self, launches: Sequence[Callable[[], None]]) -> Any:
        stream = self.dev.stream
        try:
            stream.begin_capture()
        except Exception as e:  # noqa: BLE001 - CuPy without graph support, a driver that refuses
            raise Refused(_first_line(e)) from None
        err: BaseException | None = None
        try:
            for launch in launches:
                launch()
        except Exception as e:  # noqa: BLE001 - the capture must be ended whatever happened
            err = e
        try:
            graph = stream.end_capture()
        except Exception as e:  # noqa: BLE001
            err = err or e
        if err is not None:
            raise Refused(_first_line(err))
        return graph

    def replay(self, graph: Any) -> None:
        graph.launch(self.dev.stream)


def _span(s: _Slot) -> int:
    if not s.shape or 0 in s.shape:
        return s.dtype.itemsize
    return sum((d - 1) * st for d, st in zip(s.shape, s.strides)) + s.dtype.itemsize


# -- one launch maker per record code (the record layouts: executor.py, gpu_plan.py) ----------

Launch = Callable[[], None]


def _mul_mat_w(rt: CUDARuntime, r: np.ndarray) -> Launch:
    """MUL_MAT_W: common.cuh's mmv_<type> (one warp a row, MMV_ROWS_PER_BLOCK rows a block)."""
    from .cuda import MMV_ROWS_PER_BLOCK

    qtype = GGMLType(int(r[9]))
    if int(r[8]) != int(r[7]) and int(r[6]) > 1:
        raise Refused("MUL_MAT_W of strided rows")
    fn = rt.dev.kernel("mmv", qtype)
    n_out = int(r[10])
    grid = ((n_out + MMV_ROWS_PER_BLOCK - 1) // MMV_ROWS_PER_BLOCK,)
    block = (32 * MMV_ROWS_PER_BLOCK,)
    args = (np.uint64(r[3]), np.uint64(r[2]), np.uint64(r[1]), np.int32(n_out), np.int32(r[7]), np.int64(r[11]),
            np.int32(r[6]))

    def launch() -> None:
        fn(grid, block, args)

    return launch


_LAUNCHES: dict[int, Callable[[CUDARuntime, np.ndarray], Launch]] = {
    MUL_MAT_W: _mul_mat_w,
}
_ = GET_ROWS_W  # (its launch comes with getrows.cu's launch function)
