"""The CUDA launcher of the compiled GPU split (ggml-cuda.cu's graph compute: kernels launched on
the backend's stream, `cudaStreamBeginCapture` / `cudaGraphInstantiate` / `cudaGraphLaunch`;
backend/gpu_plan.py is the plan, backend/executor.py the record compiler both launchers share).

`CUDARuntime` is gpu_plan's `Runtime` on CuPy, one per device (`CUDADevice.runtime()`):
  * the device arena: one allocation, grown to the largest plan's size (`DeviceArena`), held by
    the plans, so freed with the last of them;
  * a pinned host mirror of the plans' input region, sent by one `cudaMemcpyAsync` a step;
  * `prepare(record)`: the record's kernel launch, its function compiled and loaded now and its
    arguments packed now (numpy scalars; pointers as uint64), so that a launch inside a capture
    allocates nothing, compiles nothing and calls no cuBLAS (CuPy's capture rules);
  * `capture(launches)`: the launches recorded on the device's stream into a CUDA graph
    (`Stream.begin_capture` / `end_capture`); a failure is a Refused with CuPy's reason, and
    the plan then launches directly.
The kernels are those of `kernels_cuda/` through `cuda_ops` (the launch layer: grid, block,
strides); the matrix-vector products are `mmv_<type>` of common.cuh, or in the q8 mode the
large ones `quantize_q8_1` + `mmvq_<type>` of mmvq.cu (gpu_plan.product_path).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..types import GGMLType, LlamapyError
from .cpu_kernels import KV_CODES
from .executor import (ADD, ADD_ID, ARGSORT, ATTN, CLAMP, CPY, DIV, GEGLU, GET_ROWS_B, GET_ROWS_F32, MUL, RMS_NORM, ROPE, SCALE,
                       SET_ROWS, SOFT_MAX, SUM_ROWS, SWIGLU, Loc, Refused, _Slot)
from .gpu_plan import (COUNT, GET_ROWS_W, MUL_MAT_GEMM, MUL_MAT_GLU, MUL_MAT_ID_GEMM, MUL_MAT_ID_GLU, MUL_MAT_ID_Q8,
                       MUL_MAT_ID_W, MUL_MAT_Q8, MUL_MAT_W, QUANTIZE_Q8_1, ROPE_QKV, ROUTER, ROUTER_TOPK, SCRATCH,
                       SPLITS)


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
        # held by the plans (weakly here), so it goes with the last of them (a freed context)
        self._arena_ref: weakref.ReferenceType[DeviceArena] | None = None
        self._pinned: Any = None
        self._mirror = np.zeros(0, np.uint8)
        self._copied: Any = None  # the event of the last copy out of the mirror
        self.exported: list[Any] = []  # the last plan's ArenaValues (weakly; gpu_plan.settle)
        # GPU time of the plans' steps (run_all.py's Python time = step wall time - this): set
        # `timing`, run, then `gpu_seconds()`
        self.timing = False
        self._start: Any = None
        self._spans: list[tuple[Any, Any]] = []

    # -- memory -------------------------------------------------------------------------------

    @property
    def arena(self) -> DeviceArena:
        a = self._arena_ref() if self._arena_ref is not None else None
        if a is None:
            a = DeviceArena(self.dev)
            self._arena_ref = weakref.ref(a)
        return a

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
        self.dev.stats.n_sync += 1  # (a pageable copy: compile time, and a mask from another device)
        with self.dev.context("reading a small tensor"):
            return self.cp.asnumpy(v, stream=self.dev.stream)

    def const(self, a: np.ndarray) -> tuple[int, Any]:
        with self.dev.context("uploading a constant table"):
            d = self.cp.asarray(np.ascontiguousarray(a))
        return int(d.data.ptr), d

    def pinned(self, nbytes: int) -> np.ndarray:
        if self._copied is not None and not self._copied.done:
            self._copied.synchronize()  # the last step's copy must leave the mirror first
            self.dev.stats.n_sync += 1
        if nbytes > self._mirror.size:
            self._pinned = self.cp.cuda.alloc_pinned_memory(nbytes)
            self._mirror = np.frombuffer(self._pinned, np.uint8, nbytes)
        return self._mirror

    def h2d(self, dst: int, src: np.ndarray) -> None:
        if self.timing:
            self._start = self.dev.stream.record()
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst, src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, self.dev.stream.ptr)
        self._copied = self.dev.stream.record()
        self.dev.stats.n_in += 1
        self.dev.stats.bytes_in += src.nbytes

    def free_pinned(self) -> None:
        """Drop the pinned mirror (CUDADevice.close: the stream is idle)."""
        self._pinned, self._mirror, self._copied = None, np.zeros(0, np.uint8), None

    def d2d(self, dst: int, value: Any) -> None:
        cp = self.cp
        v = cp.ascontiguousarray(value)
        rt = cp.cuda.runtime
        rt.memcpyAsync(dst, int(v.data.ptr), v.nbytes, rt.memcpyDeviceToDevice, self.dev.stream.ptr)

    def copy_out(self, addr: int, slot: _Slot, owner: Any) -> Any:
        cp = self.cp
        mem = cp.cuda.UnownedMemory(addr, max(1, _span(slot)), owner)
        view = cp.ndarray(slot.shape, slot.dtype, cp.cuda.MemoryPointer(mem, 0), strides=slot.strides)
        return view.copy()  # on the device's stream (the backend's context is current)

    # -- launches -------------------------------------------------------------------------------

    @property
    def ops(self) -> Any:
        """cuda_ops' launch layer with every kernel loaded on this device (CUDADevice.ops)."""
        return self.dev.ops()

    def attn_split(self, n_tokens: int, n_head: int, n_head_kv: int, n_cells: int, dv: int) -> tuple[int, int]:
        from .cuda_ops import fattn_scratch_floats, fattn_splits

        n = fattn_splits(n_tokens, n_head_kv, n_cells, self.ops.n_sm)
        return n, 4 * fattn_scratch_floats(n_tokens, n_head, dv, n)

    def prepare(self, rec: np.ndarray) -> Callable[[], None]:
        """The record's launch: its launch maker's call recorded once (cuda_ops' `record`: grids
        and arguments computed now, a kernel that refuses them raises UnsupportedError now), so a
        direct step pays one kernel call per launch and a capture records exactly those."""
        code = int(rec[0])
        make = _LAUNCHES.get(code)
        if make is None:
            raise Refused(f"no CUDA kernel for record op {code}")
        with self.dev.context("loading a kernel"):
            call = make(self, rec)
            if getattr(call, "dynamic", False):  # its launches depend on values read back when it runs
                return call
            launches = self.ops.record(lambda _stream: call())
        stream = self.dev.stream
        if len(launches) == 1:
            (one,) = launches
            return lambda: one(stream)
        return lambda: [launch(stream) for launch in launches]

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
        if isinstance(err, LlamapyError):
            raise err  # a launch the kernels refuse (UnsupportedError): the plan is refused
        if err is not None:
            raise Refused(_first_line(err))
        return graph

    def replay(self, graph: Any) -> None:
        graph.launch(self.dev.stream)

    def done(self) -> None:
        if self.timing and self._start is not None:
            self._spans.append((self._start, self.dev.stream.record()))
            self._start = None

    def gpu_seconds(self) -> float:
        """The GPU time of the steps run since the last call (from each step's input copy to its
        exports), waiting for them."""
        total = 0.0
        for a, b in self._spans:
            b.synchronize()
            total += self.cp.cuda.get_elapsed_time(a, b) / 1000
        self._spans = []
        return total


def _span(s: _Slot) -> int:
    if not s.shape or 0 in s.shape:
        return s.dtype.itemsize
    return sum((d - 1) * st for d, st in zip(s.shape, s.strides)) + s.dtype.itemsize


# -- one launch maker per record code (the record layouts: executor.py, gpu_plan.py) ----------
# Each reads its record once, when the plan is made, and returns a closure over cuda_ops'
# launch method with the arguments fixed.

Launch = Callable[[], None]
_KV_TYPES = {code: t for t, code in KV_CODES.items()}  # ops.c's cache codes -> GGML types
_KV_ITEM = {GGMLType.F32: 4, GGMLType.F16: 2, GGMLType.Q8_0: 1, GGMLType.Q4_0: 1}  # bytes a stride unit


def _f(bits: Any) -> float:
    return float(np.int64(bits).view(np.float64))


def _i(r: np.ndarray) -> list[int]:
    return [int(x) for x in r]


def _rms_norm(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    rows, n = r[6], r[7]
    if r[10]:  # the ADD before it fused: x = a + b, written to r[10] (contiguous rows of n)
        kw = dict(b=r[5], sb=r[12], sum_out=r[10], ss=n, w=r[3], xq=r[16])
        x, sx = r[4], r[11]
    else:
        kw, x, sx = dict(w=r[3], xq=r[16]), r[2], r[8]
        if r[13]:  # per-head norms of T tokens of a strided view (gpu_plan's _norm_per_token)
            kw.update(tokens=r[13], sxt=r[14], syt=r[15])
    eps = _f(r[9])
    return lambda: ops.rms_norm(st, x, sx, r[1], n, rows, n, eps, **kw)


def _binary(op: str) -> Callable[[CUDARuntime, np.ndarray], Launch]:
    def make(rt: CUDARuntime, rec: np.ndarray) -> Launch:
        r, ops, st = _i(rec), rt.ops, rt.dev.stream
        if r[10]:  # one value per row (the router's weights): moe.cu
            return lambda: ops.binary_row(st, op, r[2], r[8], r[3], r[9], r[1], r[7], r[6], r[7])
        if op == "div":
            raise Refused("DIV of two rows (no CUDA kernel)")
        return lambda: ops.binary(st, op, r[2], r[8], r[3], r[9], r[1], r[7], r[6], r[7])

    return make


def _scale(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    s = _f(r[9])
    return lambda: ops.scale(st, r[2], r[8], r[1], r[7], r[6], r[7], s)


def _cpy(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    """CONT: rows copied (a scale by 1, exact for every finite value)."""
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    return lambda: ops.scale(st, r[2], r[8], r[1], r[7], r[6], r[7], 1.0)


def _glu(op: str) -> Callable[[CUDARuntime, np.ndarray], Launch]:
    def make(rt: CUDARuntime, rec: np.ndarray) -> Launch:
        r, ops, st = _i(rec), rt.ops, rt.dev.stream
        if r[10]:  # swiglu_oai: slots 11 / 12 its alpha and limit
            oai = dict(alpha=_f(r[11]), limit=_f(r[12]))
            return lambda: ops.glu(st, "swiglu_oai", r[2], r[8], r[3], r[9], r[1], r[7], r[6], r[7], **oai)
        return lambda: ops.glu(st, op, r[2], r[8], r[3], r[9], r[1], r[7], r[6], r[7])

    return make


def _get_rows_f32(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    return lambda: ops.get_rows_f32(st, r[2], r[8], r[9], r[3], r[1], r[7], r[6], r[7])


def _get_rows_w(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    qtype = GGMLType(r[10])
    return lambda: ops.get_rows(st, qtype, r[2], r[8], r[9], r[3], r[1], r[7], r[6], r[7])


def _mul_mat_w(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    if r[8] != r[7] and r[6] > 1:
        raise Refused("MUL_MAT of strided rows")
    qtype = GGMLType(r[9])
    return lambda: ops.mul_mat_vec(st, qtype, r[3], r[11], r[10], r[7], r[2], r[1], r[6], b=r[18])


def _mul_mat_glu(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    if r[8] != r[7] and r[6] > 1:
        raise Refused("MUL_MAT of strided rows")
    qtype, op = GGMLType(r[9]), ("swiglu", "geglu")[r[12]]
    return lambda: ops.mul_mat_vec_glu(st, op, qtype, r[3], r[11], r[10], r[7], r[2], r[1], r[6])


def _quantize_q8_1(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    return lambda: ops.quantize_q8_1(st, r[2], r[8], r[1], r[6], r[7])


def _mul_mat_q8(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    qtype, glu = GGMLType(r[9]), ("", "swiglu", "geglu")[r[12]]
    return lambda: ops.mul_mat_vec_q8(st, qtype, r[3], r[11], r[10], r[7], r[2], r[1], r[6], glu=glu, b=r[18])


def _mul_mat_gemm(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    """A prompt's product: input to f16 (over its power-of-two scale), per tile of rows the weight
    to f16 and one GEMM (alpha the scale), the GLU or the bias (slot 18) after it when fused
    (cuda_ops.mul_mat_gemm)."""
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    qtype = GGMLType(r[9])
    glu = ("", "swiglu", "geglu")[r[12]]
    n_out = 2 * r[10] if glu else r[10]
    return lambda: ops.mul_mat_gemm(st, qtype, r[3], r[11], n_out, r[7], r[2], r[8], r[1], r[6], w16=r[4], x16=r[5],
                                    tile_rows=r[13], glu=glu, prod=r[14], scale=r[15], b=r[18])  # fmt: skip


def _rope(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    T, H, D = r[6], r[7], r[8]
    kw = dict(pos=r[3], n_dims=r[11], mode=2 if r[12] else 0, freq_base=_f(r[13]), freq_scale=_f(r[14]),
              factors=r[4], yarn=r[15])
    # the result: contiguous (T, H, D) in the arena
    return lambda: ops.rope(st, r[2], r[9], r[10], r[1], H * D, D, T, H, D, **kw)


def _rope_qkv(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    T, H, D, Hkv, Dv = r[6], r[7], r[8], r[15], r[16]
    kt, vt = _KV_TYPES[r[20]], _KV_TYPES[r[24]]
    kw = dict(pos=r[3], n_dims=r[11], mode=2 if r[12] else 0, freq_base=_f(r[13]), freq_scale=_f(r[14]),
              factors=r[17], ids=r[4], n_cells=r[18], k_type=kt, k_cache=r[19], k_rb=r[21] * _KV_ITEM[kt],
              k_rot=r[22], v_type=vt, v_cache=r[23], v_rb=r[25] * _KV_ITEM[vt], v_rot=r[26], yarn=r[27])
    return lambda: ops.rope_qkv(st, r[2], r[5], r[10], r[9], r[1], H * D, T, H, Hkv, D, Dv, **kw)


def _set_rows(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    """SET_ROWS: rope.cu's store without a rotation of positions (mode -1): rows of `cols`
    as heads of D (the whole row when it fits a block), quantized and Hadamard-rotated there
    for a Q8_0 / Q4_0 cache."""
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    ct = _KV_TYPES[r[10]]
    n, cols, rot = r[6], r[7], r[12]
    d = cols
    if cols > 2048:
        d = next((k for k in (256, 128, 64) if cols % k == 0 and k % max(rot, 32) == 0), 0)
        if not d:
            raise Refused(f"SET_ROWS of rows of {cols}")
    row_bytes = r[11] * _KV_ITEM[ct]
    return lambda: ops.rope(st, r[4], r[8], d, 0, 0, 0, n, cols // d, d, mode=-1, cache_type=ct, ids=r[3],
                            n_cells=r[9], cache=r[1], cache_rb=row_bytes, rot=rot)


def _attn(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    T, H, D, N, Hkv, Dv = r[6:12]
    kt, vt = _KV_TYPES[r[18]], _KV_TYPES[r[19]]
    ki, vi = _KV_ITEM[kt], _KV_ITEM[vt]
    dv = Dv  # (elements: the record takes V's shape from its tensor, not from a quantized cache's bytes)
    kw = dict(n_kv=N, n_kv_dev=r[COUNT], n_splits=r[SPLITS], scratch=r[SCRATCH] if r[SPLITS] > 1 else 0,
              rot_k=r[20], rot_v=r[21], sinks=r[24])
    scale = _f(r[17])
    return lambda: ops.flash_attn_ext(st, r[2], H * D, D, kt, r[3], r[12] * ki, r[13] * ki, vt, r[4], r[14] * vi,
                                      r[15] * vi, N, r[5], r[16], r[1], H * dv, dv, T, H, Hkv, D, dv, scale, **kw)


def _soft_max(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    s = _f(r[9])
    return lambda: ops.soft_max(st, r[2], r[8], r[1], r[7], r[6], r[7], s)


def _argsort(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    return lambda: ops.argsort(st, r[2], r[8], r[1], r[7], r[6], r[7])


def _sum_rows(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    return lambda: ops.sum_rows(st, r[2], r[8], r[1], r[6], r[7])


def _clamp(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    lo, hi = _f(r[9]), _f(r[10])
    return lambda: ops.clamp(st, r[2], r[8], r[1], r[6], r[7], lo, hi)


def _get_rows_b(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    """The batched GET_ROWS: (B, R, C) rows by (B, n) ids into contiguous (B, n, C)."""
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    return lambda: ops.get_rows_batched(st, r[2], r[9], r[10], r[11], r[3], r[12], r[1], r[6], r[7], r[8])


def _mul_mat_id_w(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    """MUL_MAT_ID_W, and MUL_MAT_ID_GLU (the up experts in slot 16, the GLU in 17); the experts'
    biases as epilogue (the compiler's fuse_bias: 18 / 20 the gate's / up's, 19 their row
    stride, 21 / 22 swiglu_oai's alpha / limit). MUL_MAT_ID_Q8: either, on the q8_1 copy of
    slot 23's rows (slot 16 0: no GLU)."""
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    qtype = GGMLType(r[9])
    kw: dict[str, Any] = dict(b=r[18], sb=r[19], q8_rows=r[23] if r[0] == MUL_MAT_ID_Q8 else 0)
    if r[0] == MUL_MAT_ID_GLU or (r[0] == MUL_MAT_ID_Q8 and r[16]):
        kw.update(w2=r[16], glu=("swiglu", "geglu", "swiglu_oai")[r[17]], b2=r[20], alpha=_f(r[21]), limit=_f(r[22]))
    return lambda: ops.mul_mat_id(st, qtype, r[3], r[11], r[12], r[8], r[10], r[2], r[13], r[14], r[4], r[15], r[1],
                                  r[6], r[7], **kw)  # fmt: skip


def _mul_mat_id_gemm(rt: Any, rec: np.ndarray) -> Launch:
    """A prompt's expert product (gpu_plan's MUL_MAT_ID_GEMM: MUL_MAT_ID_W's slots 1-22, 23 flags
    (1 the GLU with the up experts of slot 16, 2 the grouping of the record before), 24-27 the
    sort, f16 input, f16 weight and product scratches, 5 the input's scale scratch): cuda_ops.mul_mat_id_gemm, run when the
    plan runs (not recorded: its GEMMs follow the counts it reads back), the offsets kept on the
    runtime for the next product of the same routing (the down experts after the gate/up ones)."""
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    qtype = GGMLType(r[9])
    kw: dict[str, Any] = dict(b=r[18], sb=r[19], order=r[24], x16=r[25], w16=r[26], prod=r[27], scale=r[5])
    if r[23] & 1:
        kw.update(w2=r[16], glu=("swiglu", "geglu", "swiglu_oai")[r[17]], b2=r[20], alpha=_f(r[21]), limit=_f(r[22]))
    counts: dict[int, Any] = rt.__dict__.setdefault("moe_offsets", {})  # sort scratch -> the offsets read there

    def launch() -> None:
        offs = counts.get(r[24]) if r[23] & 2 else None
        counts[r[24]] = ops.mul_mat_id_gemm(st, qtype, r[3], r[11], r[12], r[8], r[10], r[2], r[13], r[14], r[4], r[15],
                                            r[1], r[6], r[7], offs=offs, **kw)  # fmt: skip

    launch.dynamic = True  # type: ignore[attr-defined]
    return launch


def _router_topk(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    scale = _f(r[9])
    return lambda: ops.router_topk(st, r[2], r[8], r[3], r[1], r[6], r[7], r[10], scale)


def _add_id(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    """ADD_ID: the expert biases by id (gpu_plan's record: 11 n_expert, 12 the bias rows' stride)."""
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    return lambda: ops.add_id(st, r[2], r[8], r[3], r[12], r[11], r[4], r[10], r[1], r[7], r[6], r[7], r[9])


def _router(rt: CUDARuntime, rec: np.ndarray) -> Launch:
    r, ops, st = _i(rec), rt.ops, rt.dev.stream
    scale, lo, hi = _f(r[9]), _f(r[11]), _f(r[12])
    return lambda: ops.router(st, r[2], r[8], r[3], r[1], r[6], r[7], r[10], scale, lo, hi)


_LAUNCHES: dict[int, Callable[[CUDARuntime, np.ndarray], Launch]] = {
    RMS_NORM: _rms_norm, MUL: _binary("mul"), ADD: _binary("add"), SCALE: _scale, CPY: _cpy, SWIGLU: _glu("swiglu"), GEGLU: _glu("geglu"),
    GET_ROWS_F32: _get_rows_f32, GET_ROWS_W: _get_rows_w, MUL_MAT_W: _mul_mat_w, MUL_MAT_GLU: _mul_mat_glu, ROPE: _rope, SET_ROWS: _set_rows, ROPE_QKV: _rope_qkv,
    ATTN: _attn, DIV: _binary("div"),
    SOFT_MAX: _soft_max, ARGSORT: _argsort, SUM_ROWS: _sum_rows, CLAMP: _clamp, GET_ROWS_B: _get_rows_b,
    MUL_MAT_ID_W: _mul_mat_id_w, MUL_MAT_ID_GLU: _mul_mat_id_w, MUL_MAT_ID_Q8: _mul_mat_id_w, ROUTER: _router, ADD_ID: _add_id,
    ROUTER_TOPK: _router_topk, MUL_MAT_GEMM: _mul_mat_gemm, MUL_MAT_ID_GEMM: _mul_mat_id_gemm,
    QUANTIZE_Q8_1: _quantize_q8_1, MUL_MAT_Q8: _mul_mat_q8,
}  # fmt: skip
