"""A CuPy-free stand-in for a CUDA device's GPU-plan runtime (gpu_plan.Runtime), shared by
tests/backend/test_gpu_plan.py and bench/python_time.py.

`HostRuntime` keeps the "device memory" in host memory (an executor.Arena, the CPU backend's or a
TEST device's buffers) and logs its copies, captures and replays; what a launch does is the
subclass's `prepare`: the tests' FakeRuntime runs each record through executor.c, `NullRuntime`
does nothing at all, so a decode step through it costs exactly the Python a GPU step pays
(scheduler, splits, the mirror's input writes, the copies' and exports' bookkeeping) and nothing
else. `use_test_device_plans` makes the TEST devices (LLAMAPY_TEST_GPU) compile their splits
into GPU plans over such a runtime, as CUDA does.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from llamapy.backend import gpu_plan
from llamapy.backend.cpu import CPU_BUFT
from llamapy.backend.executor import Arena, Loc, Refused, _array_loc, _Slot


class HostRuntime:
    """gpu_plan.Runtime over host memory; `prepare` is the subclass's."""

    def __init__(self, fail_capture: str = "", log: bool = True) -> None:
        self.buft = CPU_BUFT
        self.max_tokens = 8
        self.arena = Arena()
        self.mirror = np.zeros(0, np.uint8)
        self.log: list[tuple[str, Any]] = []  # ("h2d", nbytes), ("capture", n), ("replay", n), ("launch", code)
        self.logging = log
        self.fail_capture = fail_capture
        self.keep: list[Any] = []
        self.exported: list[Any] = []
        self.stats: Any = None  # a device's CopyStats: the plan's input copies counted there, as CUDA's are

    def array_loc(self, v: Any) -> Loc:
        if not isinstance(v, np.ndarray):
            raise Refused(f"a {type(v).__name__} where a device array is needed")
        return _array_loc(v)

    def weight(self, v: Any) -> tuple[int, int, int, int, int]:
        if isinstance(v, np.ndarray) or v.repacked:
            raise Refused("not a matrix of file blocks")
        return v.data.ctypes.data, int(v.qtype), v.n_out, v.n_in, v.data.shape[1]

    def host(self, v: Any) -> np.ndarray:
        return np.asarray(v)

    def const(self, a: np.ndarray) -> tuple[int, Any]:
        a = np.ascontiguousarray(a)
        return a.ctypes.data, a

    def pinned(self, nbytes: int) -> np.ndarray:
        if nbytes > self.mirror.size:
            self.mirror = np.zeros(nbytes, np.uint8)
        return self.mirror

    def h2d(self, dst: int, src: np.ndarray) -> None:
        if self.logging:
            self.log.append(("h2d", src.nbytes))
        if self.stats is not None:
            self.stats.n_in += 1
            self.stats.bytes_in += src.nbytes
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def d2d(self, dst: int, value: Any) -> None:
        v = np.ascontiguousarray(value)
        ctypes.memmove(dst, v.ctypes.data, v.nbytes)

    def copy_out(self, addr: int, slot: _Slot, owner: Any) -> Any:
        a = self.arena
        return np.ndarray(slot.shape, slot.dtype, buffer=a.raw, offset=addr - a.base + a.pad, strides=slot.strides).copy()

    def done(self) -> None:
        if self.logging:
            self.log.append(("done", 0))

    def capture(self, launches: Sequence[Callable[[], None]]) -> Any:
        if self.fail_capture:
            raise Refused(self.fail_capture)
        self.log.append(("capture", len(launches)))
        return list(launches)

    def replay(self, graph: Any) -> None:
        if self.logging:
            self.log.append(("replay", len(graph)))
        for launch in graph:
            launch()

    def attn_split(self, n_tokens: int, n_head: int, n_head_kv: int, n_cells: int, dv: int) -> tuple[int, int]:
        return 1, 0

    def prepare(self, rec: np.ndarray) -> Callable[[], None]:
        raise NotImplementedError


class NullRuntime(HostRuntime):
    """A device whose launches, copies and replays do nothing (the step's logits are garbage):
    what a step through it costs is the Python of a GPU step. The one copy it still makes is the
    exports' (a GPU's copy_out queues a device copy; here the bytes stay where they are)."""

    def __init__(self) -> None:
        super().__init__(log=False)

    def prepare(self, rec: np.ndarray) -> Callable[[], None]:
        return _nothing

    def h2d(self, dst: int, src: np.ndarray) -> None:
        pass

    def replay(self, graph: Any) -> None:
        pass

    def copy_out(self, addr: int, slot: _Slot, owner: Any) -> Any:
        a = self.arena
        return np.ndarray(slot.shape, slot.dtype, buffer=a.raw, offset=addr - a.base + a.pad, strides=slot.strides)


def _nothing() -> None:
    pass


def boundaries(ctx: Any, n_tokens: int) -> tuple[int, int]:
    """(device->host boundaries, host->device boundaries) of a context's graph of `n_tokens` tokens
    (one output), from the scheduler's splits: a host wait is owed for each split in host memory
    that reads a value living on a device, and for the graph's outputs on a device — what a step's
    CopyStats.n_sync must come to (tests/backend/test_hybrid_copies.py, tests/gpu/test_cuda_hybrid.py)."""
    plan = ctx.plan(n_tokens, 1)
    host = [b.device.buffer_type().is_host for b in ctx.sched.backends]
    d2h = h2d = 0
    for s in plan.splits:
        srcs = {plan.assignment[i] for i in s.inputs}
        if host[s.backend]:
            d2h += any(not host[b] for b in srcs)
        else:
            h2d += any(host[b] for b in srcs)
    d2h += any(not host[plan.assignment[o]] for o in plan.graph.outputs)
    return d2h, h2d


def use_test_device_plans(set_attr: Callable[[Any, str, Any], None], make_rt: Callable[[], HostRuntime]
                          ) -> list[gpu_plan.GPUPlan]:
    """TEST devices (LLAMAPY_TEST_GPU) that compile their splits into GPU plans over `make_rt()`
    (one runtime per backend, in the device's buffer type), as CUDA's backend does; `set_attr` is
    setattr or pytest's monkeypatch.setattr. Returns the list the plans made are appended to."""
    from llamapy.backend.device import MemoryDeviceBackend

    made: list[gpu_plan.GPUPlan] = []

    def create(self: MemoryDeviceBackend, nodes: Any, exports: Any, allocate: Any) -> Any:
        if not hasattr(self, "_fake_rt"):
            self._fake_rt = make_rt()
            self._fake_rt.buft = self.device.buffer_type()
            self._fake_rt.stats = self.device.stats
        p = gpu_plan.compile_split(nodes, exports, allocate, self._fake_rt, getattr(self, "cpu_matmul", "q8"))
        made.extend([p] if p else [])
        return p

    set_attr(MemoryDeviceBackend, "graph_plan_create", create)
    set_attr(MemoryDeviceBackend, "graph_plan_compute", lambda self, plan, env: plan.compute(env))
    new = {} if set_attr is setattr else {"raising": False}  # (an attribute MemoryDeviceBackend lacks)
    # the context's MUL_MAT mode, as CUDABackend takes it (the q8 mode's int8 decode products)
    set_attr(MemoryDeviceBackend, "set_cpu_matmul", lambda self, mode: setattr(self, "cpu_matmul", mode), **new)
    set_attr(MemoryDeviceBackend, "plan_arena_bytes",  # the fit counts these plans' arena (no SMs: no split attention)
             lambda self, nodes, exports, allocate: gpu_plan.arena_bytes(nodes, exports, allocate, self.device.buffer_type(),
                                                                         8, 0, getattr(self, "cpu_matmul", "q8")), **new)
    set_attr(MemoryDeviceBackend, "graph_plan_summary",
             lambda self, plan: plan.summary() if plan else f"refused: {plan.reason}")
    return made


# -- a CuPy stand-in for CUDADevice's copies (backend/cuda.py: upload, download_batch) ----------


class FakeEvent:
    """cupy.cuda.Event recorded on a FakeStream: done once the stream ran up to where it was
    recorded; `synchronize` runs it that far (a wait on an event of a capturing stream raises,
    as CUDA's does). As CuPy's, `Event()` may be made unrecorded (done, as cudaEventQuery says)
    and recorded later: `event.record(stream)` or `stream.record(event)`."""

    def __init__(self, stream: FakeStream | None) -> None:
        self.stream: FakeStream | None = None
        self.upto, self.time = 0, 0.0
        if stream is not None:
            self.record(stream)

    def record(self, stream: FakeStream) -> None:
        self.stream, self.upto = stream, len(stream.queue)
        self.time = time.perf_counter() if self.done else 0.0

    @property
    def done(self) -> bool:
        return self.stream is None or self.stream.ran >= self.upto

    def synchronize(self) -> None:
        if self.stream is None:
            return
        self.stream.fake.log.append(("sync", "event"))
        self.stream.run(self.upto)


class FakeStream:
    """cupy.cuda.Stream over host memory: its work is a queue of calls, run in order when a wait
    reaches it (`run`); `submit(fn, eager=True)` runs the queue and fn at once (a kernel launch
    on the emulator). While capturing (`begin_capture`), work is recorded instead, and
    `end_capture` returns it as a FakeGraph. `with stream:` makes it the fake's current stream."""

    def __init__(self, fake: FakeCupy, non_blocking: bool = False, ptr: int | None = None) -> None:
        self.fake = fake
        self.queue: list[Callable[[], None]] = []
        self.ran = 0
        self.ptr = id(self) if ptr is None else ptr
        self.captured: list[Callable[[], None]] | None = None

    def run(self, upto: int) -> None:
        if self.captured is not None:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: a wait on a capturing stream")
        while self.ran < upto:
            self.ran += 1
            self.queue[self.ran - 1]()

    def submit(self, fn: Callable[[], None], eager: bool = False) -> None:
        if self.captured is not None:
            self.captured.append(fn)
            return
        self.queue.append(fn)
        if eager:
            self.run(len(self.queue))

    def record(self, event: FakeEvent | None = None) -> FakeEvent:
        if event is None:
            return FakeEvent(self)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.fake.log.append(("sync", "stream"))
        self.run(len(self.queue))

    def begin_capture(self, mode: Any = None) -> None:
        if self.ptr in (0, 1):
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self.captured is not None:
            raise RuntimeError("cudaErrorIllegalState: the stream is already capturing")
        self.run(len(self.queue))  # (work queued before the capture is not part of it)
        self.captured = []

    def end_capture(self) -> FakeGraph:
        if self.captured is None:
            raise RuntimeError("cudaErrorIllegalState: the stream is not capturing")
        g, self.captured = FakeGraph(self.fake, self.captured), None
        return g

    def is_capturing(self) -> bool:
        return self.captured is not None

    def use(self) -> FakeStream:
        self.fake.current[:] = [self]
        return self

    def __enter__(self) -> Any:
        self.fake.current.append(self)
        return self

    def __exit__(self, *a: Any) -> None:
        self.fake.current.pop()


class FakeGraph:
    """cupy.cuda.graph.Graph: the work a capture recorded, submitted again in order by each
    `launch` (on the given stream, else the current one)."""

    def __init__(self, fake: FakeCupy, work: list[Callable[[], None]]) -> None:
        self.fake, self.work = fake, work

    def launch(self, stream: Any = None) -> None:
        st = stream if stream is not None else self.fake.current_stream()
        for fn in self.work:
            st.submit(fn)
        st.submit(_nothing, eager=self.fake.eager_launches)

    def upload(self, stream: Any = None) -> None:
        pass


class FakeCupy:
    """Just enough of CuPy for `CUDADevice`'s copy paths, over host memory: device arrays are numpy
    arrays with a `.data.ptr`, pinned memory is host memory, and `memcpyAsync` is queued on its
    stream and done only when an event recorded after it (or the stream) is synchronised — so a
    staging buffer read before its wait, or refilled before its copy left it, gives wrong bytes.
    `log` records ("memcpy", kind) and ("sync", ...) in order. tests/gpu/emu_cupy.py extends it
    into a whole CuPy (kernels, memory pool, array API) over the CUDA emulator."""

    eager_launches = False  # a graph's replay runs at once (the emulator's kernels do)

    def __init__(self) -> None:
        import types

        fake = self
        self.log: list[tuple[str, Any]] = []
        self.float32, self.int64 = np.float32, np.int64

        class DevArray(np.ndarray):
            @property
            def data(self) -> Any:  # type: ignore[override]
                return types.SimpleNamespace(ptr=self.ctypes.data)

        self.ndarray = DevArray

        class Pinned(bytearray):
            @property
            def ptr(self) -> int:
                return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

        self.null = FakeStream(self, ptr=0)
        self.streams: list[FakeStream] = [self.null]
        self.current: list[FakeStream] = []

        def memcpy_async(dst: int, src: int, n: int, kind: int, stream_ptr: int) -> None:
            (stream,) = [s for s in self.streams if s.ptr == stream_ptr]
            fake.log.append(("memcpy", kind))
            stream.submit(lambda: ctypes.memmove(dst, src, n), eager=self.eager_copy(kind))

        def make_stream(non_blocking: bool = False) -> FakeStream:
            self.streams.append(FakeStream(self, non_blocking))
            return self.streams[-1]

        class Device:
            def __init__(self, index: int = 0) -> None:
                self.id = index

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *a: Any) -> None:
                pass

        make_stream.null = self.null  # type: ignore[attr-defined]
        runtime = types.SimpleNamespace(
            memGetInfo=lambda: (1 << 30, 1 << 30), memcpyAsync=memcpy_async,
            getDeviceProperties=lambda i: {"name": b"fake", "major": 9, "minor": 0},
            memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDeviceToDevice=3)
        memory = types.SimpleNamespace(OutOfMemoryError=MemoryError)
        self.cuda = types.SimpleNamespace(Device=Device, Stream=make_stream, runtime=runtime, memory=memory,
                                          alloc_pinned_memory=lambda n: Pinned(n),
                                          get_current_stream=self.current_stream)

    def current_stream(self) -> FakeStream:
        return self.current[-1] if self.current else self.null

    def eager_copy(self, kind: int) -> bool:
        """Whether a memcpyAsync of `kind` runs at once (never here: copies wait for a sync)."""
        return False

    def empty(self, shape: Any, dtype: Any) -> Any:
        return np.empty(shape, dtype).view(self.ndarray)

    def asarray(self, v: Any) -> Any:
        return v if isinstance(v, self.ndarray) else np.array(v).view(self.ndarray)

    def ascontiguousarray(self, v: Any) -> Any:
        return np.ascontiguousarray(v).view(self.ndarray)
