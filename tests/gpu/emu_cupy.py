"""A CuPy stand-in over the CUDA emulator, so that llamapy's CUDA backend (backend/cuda.py's
CUDA0, cuda_exec.py, cuda_ops.py) runs unmodified on a machine without a GPU.

`EmuCupy` extends tests/gpu_fake.py's FakeCupy (its streams, events and pinned memory) into the
part of CuPy's API llamapy calls:
  * device memory is host memory: a memory pool (`get_default_memory_pool()`: malloc, limits,
    used/total bytes, free_all_blocks) of 512-byte aligned blocks, freed blocks cached as CuPy's
    pool caches them (so a queued copy never reads freed memory); `cuda.runtime.memGetInfo()`'s
    free figure is the capacity less the pool's blocks; `cuda.alloc`, `MemoryPointer`,
    `UnownedMemory`, `ndarray(shape, dtype, memptr, strides)`;
  * arrays: `ndarray` is a numpy subclass whose `.data.ptr` is its address; every numpy function
    and ufunc on them (`xp = cupy` in kernels.run_nodes: `cp.exp`, `cp.matmul`, operators, ...)
    runs numpy and returns an `ndarray` in pool memory; `asnumpy` / `.get()` copy back;
  * streams and events: copies (`memcpyAsync` H2D / D2H) are queued on their stream and run when
    a wait reaches them (FakeCupy's model: a staging buffer refilled before its copy left, or a
    pinned buffer read before its wait, gives wrong bytes); a kernel launch, a device-to-device
    copy, a cuBLAS call or any array operation first runs what is queued (stream order), then
    itself, at once;
  * `RawModule(code=..., options=...)` of a kernels_cuda/ source (recognised by its text: any
    other source is refused) is that file compiled by tests/gpu/cuda_emu.py (g++, the emulator's
    fibers), once per EmuCupy; `get_function(name)` launches there, checking what a GPU would
    refuse or misread: each argument's kind and size against the kernel's parameter (CuPy packs
    an np.int32 as 4 bytes, a Python float as a double), blocks over 1024 threads, dynamic shared
    memory over 48 KiB, grids over 2^31-1 x 65535 x 65535, and, when the launch runs (a graph's
    replays too), every pointer it passes: device memory in use on the launching device, or
    pinned host memory (UVA) — pageable host memory, a block freed back to the pool or another
    device's memory raise cudaErrorIllegalAddress, as the GPU would fault; copies' device sides
    likewise;
  * several devices (`n_devices`): `Device(i)` as a context makes device i current (its pool,
    memGetInfo, cuBLAS handle, new streams); a launch into another device's stream raises;
  * stream capture: `Stream.begin_capture()` / `end_capture()` record the stream's work into a
    Graph replayed by `Graph.launch()`; inside a capture an allocation from the pool raises
    (stricter than CuPy, whose pool may grow in a relaxed capture: the issue's rule, one
    preallocated arena), a cuBLAS call raises NotImplementedError (CuPy's cublas.setStream),
    a synchronous copy (`asnumpy`, `.get()`, `asarray` of host data) and a wait raise RuntimeError;
  * `cuda.cublas.gemmEx` / `gemmStridedBatchedEx` (the handle of `cuda.device.get_cublas_handle()`,
    column-major as cuBLAS) computed in numpy at the data types given: f16 or f32 A and B,
    f32 C, float32 compute (float64 sums rounded once: a tensor-core GEMM's result within its
    summation order); the handle's pointer mode (`setPointerMode` / `getPointerMode`): host,
    alpha and beta read from host memory at the call (a device address faults), or device, read
    from device memory when the stream runs the GEMM (after the copies and launches queued
    before it), as on a GPU.
What it cannot model: concurrency (one host thread runs everything in order; races between
streams, between blocks or with the host are not seen), the device's timing (`get_elapsed_time`
is host time) and libm; device arrays are numpy arrays, so `np.asarray(device_array)` works here
where CuPy raises, and a device pointer read as host memory on the host (ctypes) works here where
it would read garbage; the emulator runs 1-D blocks only.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import sys
import tempfile
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_emu  # noqa: E402
import gpu_fake  # noqa: E402
from gpu_fake import FakeCupy, FakeStream  # noqa: E402

ALIGN = 512  # CuPy's pool rounds and aligns allocations to 512 bytes
SHARED_MAX = 48 << 10  # dynamic shared memory a launch may ask without the opt-in attribute
ANY_DEVICE = -2  # check_device_pointer: memory of any device will do (a copy under UVA)


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError."""


class Memory:
    """A pool block (cupy.cuda.memory.Memory): `ptr`, `size`; back to the pool's cache when the
    last array or pointer over it goes."""

    def __init__(self, pool: MemoryPool, block: np.ndarray, size: int) -> None:
        self.pool, self.block, self.size, self.device_id = pool, block, size, pool.device_id
        self.ptr = int(block.ctypes.data)
        self.__array_interface__ = {"shape": (max(size, 1),), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def __del__(self) -> None:
        try:
            self.pool._release(self.block)
        except Exception:  # noqa: BLE001 - at interpreter exit the modules it needs may be gone
            pass


class UnownedMemory:
    """cupy.cuda.UnownedMemory: memory at `ptr` kept alive by `owner`."""

    def __init__(self, ptr: int, size: int, owner: Any, device_id: int | None = None) -> None:
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, 0
        self.__array_interface__ = {"shape": (max(size, 1),), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


class MemoryPointer:
    """cupy.cuda.MemoryPointer: `mem` and an offset into it."""

    def __init__(self, mem: Any, offset: int) -> None:
        self.mem, self.offset, self.device_id = mem, int(offset), getattr(mem, "device_id", 0)
        self.ptr = (int(mem.ptr) if mem is not None else 0) + self.offset

    def __add__(self, n: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.offset + int(n))

    def __int__(self) -> int:
        return self.ptr


class MemoryPool:
    """cupy.cuda.MemoryPool over host memory: blocks of 512-byte multiples, cached when freed
    (reused by size), the cache dropped by `free_all_blocks`; `set_limit` caps used + cached."""

    def __init__(self, emu: EmuCupy, capacity: int, device_id: int = 0) -> None:
        self.emu, self.capacity, self.device_id = emu, capacity, device_id
        self.limit = 0
        self.used = 0
        self.cached: dict[int, list[np.ndarray]] = {}
        self.n_cached = 0

    def malloc(self, size: int) -> MemoryPointer:
        st = self.emu.capturing()
        if st is not None:
            raise RuntimeError(f"an allocation of {size} bytes during stream capture (emu_cupy: one arena, "
                               "allocated before the capture)")  # fmt: skip
        n = max(ALIGN, -(-int(size) // ALIGN) * ALIGN)
        free = self.cached.get(n)
        if free:
            raw = free.pop()
            self.n_cached -= n
        else:
            if self.limit and self.used + self.n_cached + n > self.limit:
                self.free_all_blocks()
            if self.limit and self.used + n > self.limit:
                raise OutOfMemoryError(f"Out of memory allocating {n:,} bytes (allocated so far: {self.used:,} "
                                       f"bytes, limit set to: {self.limit:,} bytes).")  # fmt: skip
            if self.used + self.n_cached + n > self.capacity:
                self.free_all_blocks()
            if self.used + n > self.capacity:
                raise OutOfMemoryError(f"Out of memory allocating {n:,} bytes (allocated so far: {self.used:,} bytes).")
            buf = np.empty(n + ALIGN, np.uint8)
            off = -buf.ctypes.data % ALIGN
            raw = buf[off : off + n]
        self.emu._track(int(raw.ctypes.data), n, "device", self.device_id)
        self.used += n
        return MemoryPointer(Memory(self, raw, n), 0)

    def _release(self, raw: np.ndarray) -> None:
        self.emu._track(int(raw.ctypes.data), raw.size, "freed", self.device_id)
        self.used -= raw.size
        self.n_cached += raw.size
        self.cached.setdefault(raw.size, []).append(raw)

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used + self.n_cached

    def free_bytes(self) -> int:
        return self.n_cached

    def free_all_blocks(self, stream: Any = None) -> None:
        self.emu.flush()
        for blocks in self.cached.values():
            for raw in blocks:
                self.emu._untrack(int(raw.ctypes.data))
        self.cached, self.n_cached = {}, 0

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        self.limit = int(fraction * self.capacity) if fraction is not None else int(size or 0)

    def get_limit(self) -> int:
        return self.limit


def _memory_of(a: np.ndarray) -> Any:
    """The Memory / UnownedMemory an array's data lies in (None: numpy's own)."""
    b: Any = a
    while isinstance(b, np.ndarray):
        b = b.base
    return b if isinstance(b, (Memory, UnownedMemory)) else None


class _DeviceArray(np.ndarray):
    """cupy.ndarray over the emulator's device memory (see the module docstring). `_emu` is set
    by the EmuCupy that made the subclass."""

    _emu: EmuCupy

    def __new__(cls, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None, strides: Any = None,
                order: str = "C") -> Any:  # fmt: skip
        return cls._emu._array(shape, dtype, memptr, strides, order)

    @property
    def data(self) -> MemoryPointer:  # type: ignore[override]
        mem = _memory_of(self)
        if mem is None:
            return MemoryPointer(UnownedMemory(self.ctypes.data, self.nbytes, self), 0)
        return MemoryPointer(mem, int(self.ctypes.data) - int(mem.ptr))

    @property
    def device(self) -> Any:
        return self._emu.cuda.Device(self.data.device_id)

    def get(self, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
        return self._emu.asnumpy(self, stream=stream)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        self._emu._sync_copy("H2D")
        np.copyto(self.view(np.ndarray), arr)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kw: Any) -> Any:
        emu = self._emu
        emu.flush()
        out = kw.get("out")
        if out is not None:
            kw["out"] = tuple(emu._plain(o) for o in out)
        emu._device_only(ufunc.__name__, inputs)
        r = getattr(ufunc, method)(*(emu._plain(x) for x in inputs), **kw)
        return out[0] if out is not None and len(out) == 1 else (out if out is not None else emu._wrap(r))

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        emu = self._emu
        emu.flush()
        emu._device_only(func.__name__, args)
        return emu._wrap(func(*emu._plain(args), **emu._plain(kwargs)))

    def __getitem__(self, key: Any) -> Any:
        emu = self._emu
        emu.flush()
        return emu._wrap(np.ndarray.__getitem__(self, emu._plain(key)))

    def __setitem__(self, key: Any, value: Any) -> None:
        emu = self._emu
        emu.flush()
        np.ndarray.__setitem__(self.view(np.ndarray), emu._plain(key), emu._plain(value))

    def astype(self, dtype: Any, order: str = "K", casting: str = "unsafe", subok: bool = True,
               copy: bool = True) -> Any:  # fmt: skip
        self._emu.flush()
        return self._emu._wrap(self.view(np.ndarray).astype(dtype, order=order, casting=casting, copy=copy))

    def copy(self, order: str = "C") -> Any:
        self._emu.flush()
        return self._emu._wrap(self.view(np.ndarray).copy(order=order))

    def reshape(self, *shape: Any, order: str = "C") -> Any:
        v = self.view(np.ndarray).reshape(*shape, order=order)
        if _memory_of(v) is None:  # (a copy: the data read now, in stream order)
            self._emu.flush()
            v = self.view(np.ndarray).reshape(*shape, order=order)
        return self._emu._wrap(v)

    def __repr__(self) -> str:
        self._emu.flush()
        return "emu_cupy." + repr(self.view(np.ndarray))

    def __reduce__(self) -> Any:
        raise TypeError("emu_cupy arrays are not picklable (nor are CuPy's without a copy to the host)")


class EmuKernelFunction:
    """cupy.RawKernel of the emulator: `fn(grid, block, args, shared_mem=, stream=)` launches on
    the stream (after the work queued on it) with CuPy's argument packing checked against the
    kernel's parameters."""

    def __init__(self, emu: EmuCupy, kernel: cuda_emu.EmuKernel) -> None:
        self.emu, self.kernel, self.name = emu, kernel, kernel.name
        self.num_regs = 32
        self.max_dynamic_shared_size_bytes = SHARED_MAX

    def _arg(self, i: int, a: Any, kind: str, keep: list[Any]) -> Any:
        """Argument i as the emulator takes it (np.float32, or an integer as np.int64 / uint64),
        checked as the driver reads it: cuLaunchKernel copies the parameter's size from where
        CuPy put the argument (an np.int32 for a long long reads 4 bytes past it; a float's bits
        for an int are another number), so a kind or a smaller size than the parameter's is a
        TypeError; a wider integer whose value fits is what the GPU reads too."""
        size = {"p": 8, "q": 8, "i": 4, "h": 2, "b": 1, "f": 4, "d": 8}[kind]
        if a is None:
            got, val = "p", np.uint64(0)
        elif isinstance(a, np.ndarray) and isinstance(a, self.emu.ndarray):
            keep.append(a)
            got, val = "p", np.uint64(a.data.ptr)
        elif isinstance(a, np.ndarray):
            raise TypeError(f"{self.name}: argument {i} is a host numpy array (CuPy refuses it)")
        elif isinstance(a, MemoryPointer):
            keep.append(a)
            got, val = "p", np.uint64(a.ptr)
        elif isinstance(a, (bool, np.bool_)):
            got, val = "b", np.int64(bool(a))
        elif isinstance(a, (int, np.integer)):
            nbytes = 8 if isinstance(a, int) else np.dtype(type(a)).itemsize  # (CuPy: a Python int is an int64)
            got, val = "int", (np.uint64(a) if isinstance(a, np.uint64) else np.int64(a))
            if nbytes < size:
                want = "a pointer" if kind == "p" else f"{size} bytes"
                raise TypeError(f"{self.name}: argument {i} is a {type(a).__name__} where the kernel takes {want} "
                                "(the GPU reads past it)")  # fmt: skip
            if kind in "qihb" and not -(1 << (8 * size - 1)) <= int(a) < (1 << (8 * size)):
                raise TypeError(f"{self.name}: argument {i} = {int(a)} does not fit the kernel's {size} bytes")
        elif isinstance(a, np.float32):
            got, val = "f", a
        elif isinstance(a, (float, np.floating)):
            got, val = "d", a
        else:
            raise TypeError(f"{self.name}: argument {i} is a {type(a).__name__}")
        ok = (got == kind or (got == "int" and kind in "pqihb") or (got == "p" and kind == "q")
              or (got == "b" and kind in "qihb"))
        if not ok:
            want = {"p": "a pointer", "f": "a float", "d": "a double"}.get(kind, f"an integer of {size} bytes")
            raise TypeError(f"{self.name}: argument {i} is a {type(a).__name__} where the kernel takes {want} "
                            "(the GPU would read its bytes as that)")  # fmt: skip
        if got == "d":
            raise TypeError(f"{self.name}: argument {i}: a double (the emulator takes none)")
        return val

    def __call__(self, grid: Any, block: Any, args: tuple, *, shared_mem: int = 0, stream: Any = None,
                 enable_cooperative_groups: bool = False) -> None:  # fmt: skip
        sig = self.kernel.signature
        if len(args) != len(sig):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(sig)} parameters")
        keep: list[Any] = []
        slots = tuple(self._arg(i, a, k, keep) for i, (a, k) in enumerate(zip(args, sig)))
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
        if not grid or min(grid) < 1 or grid[0] >= 2**31 or any(g > 65535 for g in grid[1:]):
            raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {self.name} over a grid of {grid}")
        if min(block) < 1 or math.prod(block) > 1024:
            raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {self.name} with a block of {block}")
        if any(b != 1 for b in block[1:]):
            raise NotImplementedError(f"{self.name}: the emulator runs 1-D blocks only ({block})")
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {self.name} asks {shared_mem} bytes of dynamic shared "
                               f"memory (at most {self.max_dynamic_shared_size_bytes} without the opt-in)")  # fmt: skip
        st = stream if stream is not None else self.emu.current_stream()
        dev = self.emu.current_device()
        if getattr(st, "device_id", dev) != dev:
            raise RuntimeError(f"cudaErrorInvalidResourceHandle: {self.name} launched on CUDA{dev} into a stream of "
                               f"CUDA{st.device_id}")  # fmt: skip
        kernel = self.kernel
        self.emu.n_launches += 1

        pointers = [(i, int(v)) for i, (v, k) in enumerate(zip(slots, sig)) if k == "p" and int(v)]
        emu = self.emu

        def launch() -> None:
            _ = keep  # (the arrays passed live until the launch ran)
            for i, ptr in pointers:  # (when it runs: a graph replayed after its memory was freed faults)
                emu.check_device_pointer(ptr, f"{kernel.name}: argument {i}", device=dev)
            kernel(grid, block, slots, shared_mem=int(shared_mem))

        st.submit(launch, eager=True)


class EmuModule:
    """cupy.RawModule of a kernels_cuda/ source on the emulator."""

    def __init__(self, emu: EmuCupy, code: str, options: tuple[str, ...]) -> None:
        fname = emu._source_file(code)
        key = (fname, tuple(options))
        if key not in emu._compiled:
            emu._compiled[key] = cuda_emu.compile_file(fname, emu.build_dir, tuple(options))
        self.emu, self.fname, self.functions = emu, fname, emu._compiled[key]

    def get_function(self, name: str) -> EmuKernelFunction:
        k = self.functions.get(name)
        if k is None:
            raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: no function {name!r} in {self.fname}")
        return EmuKernelFunction(self.emu, k)


class EmuCupy(FakeCupy):
    """The CuPy stand-in (see the module docstring): `sys.modules["cupy"] = EmuCupy()`."""

    eager_launches = True

    def __init__(self, capacity: int = 4 << 30, n_sm: int = 4, build_dir: Path | None = None,
                 n_devices: int = 1) -> None:
        super().__init__()
        emu = self
        self.__name__ = "cupy"
        self.__version__ = "13.0.0-emu"
        self.build_dir = build_dir or Path(tempfile.mkdtemp(prefix="lp_emu_cupy_"))
        self._compiled: dict[tuple[str, tuple[str, ...]], dict[str, cuda_emu.EmuKernel]] = {}
        self._sources: dict[str, str] | None = None
        self.n_launches = 0
        self.n_gemms = 0
        self._starts: list[int] = []  # the blocks' addresses, sorted (memory_kind)
        self._blocks: dict[int, tuple[int, str]] = {}
        self.n_devices = n_devices
        self.pools = [MemoryPool(self, capacity, d) for d in range(n_devices)]
        self.pool = self.pools[0]
        self.devices_used: list[int] = [0]  # the current device: the last entered (Device's with), else used
        self.ndarray = type("ndarray", (_DeviceArray,), {"_emu": self, "__module__": "emu_cupy"})
        self.RawModule = lambda code, options=(), **kw: EmuModule(emu, code, tuple(options))
        self.get_default_memory_pool = lambda: self.pools[self.current_device()]
        self.inf, self.nan, self.newaxis = np.inf, np.nan, None

        rt = self.cuda.runtime
        rt.memGetInfo = lambda: (capacity - self.pools[self.current_device()].total_bytes(), capacity)
        rt.getDeviceCount = lambda: n_devices
        rt.runtimeGetVersion = rt.driverGetVersion = lambda: 0  # no CUDA underneath
        rt.getDevice = self.current_device
        rt.deviceSynchronize = self.flush
        rt.streamIsCapturing = lambda ptr: self._stream(ptr).is_capturing()
        rt.CUDA_R_16F, rt.CUDA_R_32F, rt.CUDA_R_64F = 2, 0, 1
        rt.getDeviceProperties = lambda i: {"name": b"emu_cupy (the CUDA emulator on the CPU)", "major": 9,
                                            "minor": 0, "multiProcessorCount": n_sm, "totalGlobalMem": capacity}
        fake_memcpy_async = rt.memcpyAsync

        def memcpy_async(dst: int, src: int, n: int, kind: int, stream_ptr: int) -> None:
            if n:
                # (any device's memory: under UVA a copy reaches every device)
                if kind in (1, 3):
                    self.check_device_pointer(dst, "memcpyAsync's destination", pinned_ok=False, device=ANY_DEVICE)
                if kind in (2, 3):
                    self.check_device_pointer(src, "memcpyAsync's source", pinned_ok=False, device=ANY_DEVICE)
                if kind not in (1, 2, 3):
                    raise NotImplementedError(f"emu_cupy: memcpyAsync of kind {kind}")
            fake_memcpy_async(dst, src, n, kind, stream_ptr)

        rt.memcpyAsync = memcpy_async
        fake_pinned = self.cuda.alloc_pinned_memory

        def alloc_pinned_memory(n: int) -> Any:
            mem = fake_pinned(n)
            ptr = int(mem.ptr)
            self._track(ptr, n, "pinned")
            weakref.finalize(mem, self._untrack, ptr)
            return mem

        self.cuda.alloc_pinned_memory = alloc_pinned_memory

        def memcpy_peer_async(dst: int, dst_dev: int, src: int, src_dev: int, n: int, stream_ptr: int) -> None:
            if n:
                self.check_device_pointer(dst, "memcpyPeerAsync's destination", False, device=dst_dev)
                self.check_device_pointer(src, "memcpyPeerAsync's source", False, device=src_dev)
            memcpy_async(dst, src, n, 3, stream_ptr)

        rt.memcpyPeerAsync = memcpy_peer_async

        class Device:
            """cupy.cuda.Device: `with` makes it current (CuPy's current device), `use()` too."""

            def __init__(self, index: int | None = None) -> None:
                index = emu.current_device() if index is None else int(index)
                if not 0 <= index < n_devices:
                    raise RuntimeError(f"cudaErrorInvalidDevice: device {index} (emu_cupy has {n_devices})")
                self.id = index
                self.attributes = {"MultiProcessorCount": n_sm, "MaxSharedMemoryPerBlock": SHARED_MAX,
                                   "MaxThreadsPerBlock": 1024}  # fmt: skip
                self.compute_capability = "90"

            def synchronize(self) -> None:
                emu.flush()

            def use(self) -> None:
                emu.devices_used[0] = self.id

            def __enter__(self) -> Any:
                emu.devices_used.append(self.id)
                return self

            def __exit__(self, *a: Any) -> None:
                emu.devices_used.pop()

        handle = 0x6C62  # one cuBLAS handle (the device's)
        blas = types.SimpleNamespace(
            CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_OP_C=2, CUBLAS_POINTER_MODE_HOST=0, CUBLAS_POINTER_MODE_DEVICE=1,
            CUBLAS_COMPUTE_32F=68, CUBLAS_COMPUTE_32F_FAST_16F=74, CUBLAS_GEMM_DEFAULT=-1,
            CUBLAS_GEMM_DEFAULT_TENSOR_OP=99, setPointerMode=self._set_pointer_mode,
            getPointerMode=lambda h: self._pointer_modes.get(h, 0),
            setStream=self._blas_set_stream, getStream=lambda h: self.current_stream().ptr, gemmEx=self._gemm_ex,
            gemmStridedBatchedEx=self._gemm_strided_batched_ex)
        self._pointer_modes: dict[int, int] = {}  # a handle's pointer mode (0 host, the default; 1 device)
        self._handle = handle
        memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError, MemoryPool=MemoryPool, Memory=Memory,
                                       UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer, alloc=self._alloc)
        self.cuda.Device = Device
        self.cuda.memory = memory
        self.cuda.alloc = self._alloc
        self.cuda.MemoryPointer, self.cuda.UnownedMemory, self.cuda.Memory = MemoryPointer, UnownedMemory, Memory
        self.cuda.cublas = blas
        self.cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: handle + self.current_device(),
                                                 Device=Device)
        self.cuda.get_elapsed_time = lambda a, b: (emu._event_time(b) - emu._event_time(a)) * 1000.0
        class Event(gpu_fake.FakeEvent):
            """cupy.cuda.Event(): unrecorded until `record(stream=None)` (the current stream)."""

            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(None)

            def record(self, stream: Any = None) -> None:
                super().record(stream if stream is not None else emu.current_stream())

        self.cuda.Event = Event
        self.cuda.runtime = rt
        self.cuda.is_available = lambda: True
        fake_stream = self.cuda.Stream

        def make_stream(non_blocking: bool = False) -> FakeStream:
            st = fake_stream(non_blocking)
            st.device_id = self.current_device()  # type: ignore[attr-defined]
            return st

        make_stream.null = self.null  # type: ignore[attr-defined]
        self.cuda.Stream = make_stream

    # -- the device's work --------------------------------------------------------------------

    def flush(self) -> None:
        """Run every stream's queued work (what an operation in stream order waits for)."""
        for s in self.streams:
            if s.captured is None and s.ran < len(s.queue):
                s.run(len(s.queue))

    def eager_copy(self, kind: int) -> bool:
        return kind == 3  # device to device: stream order is all there is to model

    def current_device(self) -> int:
        return self.devices_used[-1]

    def capturing(self) -> FakeStream | None:
        st = self.current_stream()
        return st if st.captured is not None else None

    def _stream(self, ptr: int) -> FakeStream:
        (s,) = [s for s in self.streams if s.ptr == ptr]
        return s

    def _event_time(self, ev: Any) -> float:
        ev.synchronize()
        if not ev.time:
            ev.time = time.perf_counter()
        return float(ev.time)

    def _sync_copy(self, what: str) -> None:
        """A synchronous copy (CuPy's memcpy on the current stream): refused in a capture."""
        if self.capturing() is not None:
            raise RuntimeError(f"the current stream is capturing, so {what} transfers are disallowed")
        self.flush()

    def _source_file(self, code: str) -> str:
        if self._sources is None:
            from llamapy.backend.cuda import _module_source
            from llamapy.backend.cuda_ops import ENTRIES

            self._sources = {_module_source(f): f for f in ENTRIES}
        f = self._sources.get(code)
        if f is None:
            raise NotImplementedError("emu_cupy compiles only kernels_cuda/ sources (as cuda._module_source gives)")
        return f

    # -- memory and arrays ------------------------------------------------------------------

    def _track(self, ptr: int, size: int, kind: str, device: int = -1) -> None:
        """Record a block: "device" (the pool's, in use), "freed" (cached by the pool), "pinned"."""
        if ptr not in self._blocks:
            bisect.insort(self._starts, ptr)
        self._blocks[ptr] = (size, kind, device)

    def _untrack(self, ptr: int) -> None:
        if self._blocks.pop(ptr, None) is not None:
            del self._starts[bisect.bisect_left(self._starts, ptr)]

    def memory_kind(self, ptr: int) -> tuple[str, int]:
        """What `ptr` points into: ("device" / "freed" (a pool block no array holds), its device),
        ("pinned", -1) or ("host", -1) (pageable memory, which a GPU cannot read)."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            start = self._starts[i]
            size, kind, dev = self._blocks[start]
            if ptr <= start + size:
                return kind, dev
        return "host", -1

    def check_device_pointer(self, ptr: int, what: str, pinned_ok: bool = True, device: int | None = None) -> None:
        """A pointer a GPU dereferences must be memory in use of that device (the current one
        unless given; no peer access is enabled) or pinned host memory (mapped into every
        device's address space under UVA): else RuntimeError, as the GPU's illegal address fault."""
        kind, dev = self.memory_kind(ptr)
        want = self.current_device() if device is None else device
        if kind == "device" and dev != want and want != ANY_DEVICE:
            raise RuntimeError(f"cudaErrorIllegalAddress: {what} = {ptr:#x} is CUDA{dev}'s memory, read on CUDA{want}")
        if kind == "device" or (kind == "pinned" and pinned_ok):
            return
        why = {"freed": "device memory already freed (back in the pool)", "pinned": "pinned host memory",
               "host": "pageable host memory"}[kind]  # fmt: skip
        raise RuntimeError(f"cudaErrorIllegalAddress: {what} = {ptr:#x} points into {why}")

    def _alloc(self, size: int) -> MemoryPointer:
        return self.pools[self.current_device()].malloc(size)

    def _array(self, shape: Any, dtype: Any, memptr: MemoryPointer | None, strides: Any, order: str = "C") -> Any:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        if memptr is None:
            memptr = self._alloc(math.prod(shape) * dt.itemsize)
        base = np.asarray(memptr.mem)
        out = np.ndarray(shape, dt, buffer=base, offset=memptr.offset, strides=strides, order=order)
        return out.view(self.ndarray)

    def _device_only(self, what: str, args: Any) -> None:
        """CuPy's functions and ufuncs take device arrays and scalars, never a host numpy array
        (TypeError: Unsupported type, cupy/_core/_kernel.pyx's _preprocess_arg)."""
        for a in args:
            if isinstance(a, (list, tuple)):
                self._device_only(what, a)
            elif isinstance(a, np.ndarray) and not isinstance(a, self.ndarray):
                raise TypeError(f"Unsupported type <class 'numpy.ndarray'> (emu_cupy: a host array given to {what})")

    def _plain(self, v: Any) -> Any:
        """Device arrays (in lists, tuples and dicts too) as the numpy arrays they are."""
        if isinstance(v, self.ndarray):
            return v.view(np.ndarray)
        if isinstance(v, (list, tuple)):
            return type(v)(self._plain(x) for x in v)
        if isinstance(v, dict):
            return {k: self._plain(x) for k, x in v.items()}
        return v

    def _wrap(self, r: Any) -> Any:
        """numpy's result as a device array: a view of device memory stays one, an array numpy
        allocated is copied into the pool (tuples of them too)."""
        if isinstance(r, tuple):
            return tuple(self._wrap(x) for x in r)
        if not isinstance(r, np.ndarray):
            return r
        if _memory_of(r) is not None:
            return r if isinstance(r, self.ndarray) else r.view(self.ndarray)
        out = self._array(r.shape, r.dtype, None, None)
        np.copyto(out.view(np.ndarray), r.view(np.ndarray))
        return out

    def empty(self, shape: Any, dtype: Any = float, order: str = "C") -> Any:
        return self._array(shape, dtype, None, None, order)

    def zeros(self, shape: Any, dtype: Any = float, order: str = "C") -> Any:
        out = self.empty(shape, dtype, order)
        self.flush()
        out.view(np.ndarray).fill(0)
        return out

    def full(self, shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> Any:
        out = self.empty(shape, dtype if dtype is not None else np.asarray(fill_value).dtype, order)
        self.flush()
        out.view(np.ndarray).fill(fill_value)
        return out

    def asarray(self, a: Any, dtype: Any = None, order: Any = None) -> Any:
        if isinstance(a, self.ndarray):
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        self._sync_copy("H2D")
        return self._wrap(np.array(self._plain(a), dtype=dtype, order=order or "K", copy=True))

    array = asarray

    def ascontiguousarray(self, a: Any, dtype: Any = None) -> Any:
        a = self.asarray(a, dtype)
        if a.flags.c_contiguous:
            return a
        self.flush()
        return self._wrap(np.ascontiguousarray(a.view(np.ndarray)))

    def asnumpy(self, a: Any, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> Any:
        if not isinstance(a, self.ndarray):
            return np.asarray(a)
        self._sync_copy("D2H")
        r = np.array(a.view(np.ndarray), copy=True, order=order)
        if out is not None:
            out[...] = r
            return out
        return r

    def get_array_module(self, *args: Any) -> Any:
        return self if any(isinstance(a, self.ndarray) for a in args) else np

    def __getattr__(self, name: str) -> Any:
        """numpy's functions, constants and types for the rest of CuPy's array API; a function's
        device arrays run there and its results come back as device arrays."""
        if name.startswith("_"):
            raise AttributeError(name)
        v = getattr(np, name)
        if isinstance(v, type) or not callable(v):
            return v
        emu = self

        def call(*args: Any, **kwargs: Any) -> Any:
            emu.flush()
            emu._device_only(name, args)
            return emu._wrap(v(*emu._plain(args), **emu._plain(kwargs)))

        call.__name__ = name
        return call

    # -- cuBLAS -------------------------------------------------------------------------------

    def _set_pointer_mode(self, handle: int, mode: int) -> None:
        if handle != self._handle + self.current_device():  # (CuPy's sets no stream: no capture check)
            raise RuntimeError(f"CUBLAS_STATUS_NOT_INITIALIZED: handle {handle:#x}")
        if mode not in (0, 1):
            raise RuntimeError(f"CUBLAS_STATUS_INVALID_VALUE: pointer mode {mode}")
        self._pointer_modes[handle] = mode

    def _blas_set_stream(self, handle: int, stream_ptr: int) -> None:
        if handle != self._handle + self.current_device():
            raise RuntimeError(f"CUBLAS_STATUS_NOT_INITIALIZED: handle {handle:#x}")
        if self._stream(stream_ptr).is_capturing():
            raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")

    def _gemm_ex(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int, atype: int,
                 lda: int, b: int, btype: int, ldb: int, beta: int, c: int, ctype: int, ldc: int, compute: int,
                 algo: int) -> None:  # fmt: skip
        """cublasGemmEx: C (m, n) = alpha op(A) op(B) + beta C, column-major, on the current
        stream (CuPy sets the handle's stream to it first: in a capture, NotImplementedError)."""
        self._gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, 0, b, btype, ldb, 0, beta,
                                      c, ctype, ldc, 0, 1, compute, algo)  # fmt: skip

    def _gemm_strided_batched_ex(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int,
                                 a: int, atype: int, lda: int, sa: int, b: int, btype: int, ldb: int, sb: int,
                                 beta: int, c: int, ctype: int, ldc: int, sc: int, count: int, compute: int,
                                 algo: int) -> None:  # fmt: skip
        """cublasGemmStridedBatchedEx: `count` GEMMs, the i-th's A, B, C at i * sa, sb, sc elements."""
        self._blas_set_stream(handle, self.current_stream().ptr)
        device_mode = self._pointer_modes.get(handle, 0) == 1
        if compute not in (68, 74):
            raise NotImplementedError(f"emu_cupy: gemmEx compute type {compute}")
        if min(m, n, k) < 0 or lda < max(1, m if transa == 0 else k) or ldb < max(1, k if transb == 0 else n) \
                or ldc < max(1, m):
            raise RuntimeError(f"CUBLAS_STATUS_INVALID_VALUE: gemmEx m={m} n={n} k={k} lda={lda} ldb={ldb} ldc={ldc}")
        dt = {2: np.float16, 0: np.float32}
        if atype not in dt or btype not in dt or ctype != 0:
            raise NotImplementedError(f"emu_cupy: gemmEx types A {atype}, B {btype}, C {ctype}")

        def scalar(addr: int) -> float:
            return float(np.frombuffer((ctypes.c_char * 4).from_address(addr), np.float32)[0])

        for addr, what in ((alpha, "alpha"), (beta, "beta")):
            if device_mode:
                self.check_device_pointer(addr, f"gemmEx's {what} (pointer mode device)")
            elif self.memory_kind(addr)[0] in ("device", "freed"):
                raise RuntimeError(f"segmentation fault: gemmEx's {what} = {addr:#x} is device memory read on the "
                                   f"host (pointer mode host)")  # fmt: skip
        scalars = None if device_mode else (scalar(alpha), scalar(beta))  # host mode: read at the call
        self.n_gemms += 1

        def col_major(addr: int, rows: int, cols: int, ld: int, d: Any) -> np.ndarray:
            """(rows, cols) column-major, ld elements between columns, as a numpy view."""
            it = np.dtype(d).itemsize
            buf = (ctypes.c_char * (((cols - 1) * ld + rows) * it)).from_address(addr)
            return np.ndarray((rows, cols), d, buffer=buf, strides=(it, ld * it))

        def run() -> None:
            if m == 0 or n == 0:
                return
            al, be = scalars or (scalar(alpha), scalar(beta))  # device mode: read as the stream runs it
            ia, ib = np.dtype(dt[atype]).itemsize, np.dtype(dt[btype]).itemsize
            for i in range(count):
                ai, bi, ci = a + i * sa * ia, b + i * sb * ib, c + i * sc * 4
                A = col_major(ai, *((m, k) if transa == 0 else (k, m)), lda, dt[atype]).astype(np.float64)
                B = col_major(bi, *((k, n) if transb == 0 else (n, k)), ldb, dt[btype]).astype(np.float64)
                A, B = (A if transa == 0 else A.T), (B if transb == 0 else B.T)
                C = col_major(ci, m, n, ldc, np.float32)
                prod = al * (A @ B) if k else np.zeros((m, n))
                C[...] = (prod + be * C.astype(np.float64) if be else prod).astype(np.float32)

        self.current_stream().submit(run, eager=True)


def install() -> EmuCupy:
    """An EmuCupy as `cupy` (sys.modules), for code that imports cupy after this call."""
    emu = EmuCupy()
    sys.modules["cupy"] = emu  # type: ignore[assignment]
    return emu


def install_for_tests() -> EmuCupy | None:
    """tests/conftest.py's LLAMAPY_CUDA_EMU=1: the stand-in as `cupy` and llamapy's backends
    discovered again (None without g++: the CUDA tests then skip as without CuPy)."""
    if cuda_emu.CXX is None:
        return None
    emu = install()
    from llamapy.backend import registry

    registry.discover(refresh=True)
    return emu

