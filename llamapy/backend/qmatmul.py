"""Quantized MUL_MAT for the CPU backend (ggml-cpu's `ggml_compute_forward_mul_mat` and the
`ggml_vec_dot_*` kernels of ggml-cpu `quants.c`).

Weights stay exactly as the GGUF file stores them: `QMatrix` keeps a (n_out, row_bytes) uint8
view of the (memory-mapped) tensor and never expands the whole matrix to float32. Unlike ggml, the
activations are NOT quantized to q8: each kernel multiplies the weight blocks with the float32
activations directly, so the only rounding is the weights' own.

Paths, picked per call (`kernels()` says which compiled kernels: C, numba or none):
  * n_tokens < `BLAS_MIN_TOKENS` (decode, short batches), Q4_0/Q4_1/Q8_0/Q4_K/Q6_K: compiled
    kernels (kernels_c/qmatmul.c, else numba_kernels.py) on a row-interleaved repack (tiles of
    `REPACK_ROWS` rows; the innermost loop runs across rows, so it vectorizes without a
    horizontal sum per block). Costs no bytes over the file's (Q4_K: +2.8%, its 6-bit scales
    unpacked to bytes); the mapped rows are then released (MADV_DONTNEED on a read-only map).
    The C kernels thread with OpenMP.
  * n_tokens < `BLAS_MIN_TOKENS`, every other type: numba kernels, one per type, that walk
    the file's blocks row by row (numba is imported for them only).
  * n_tokens >= `BLAS_MIN_TOKENS` (prompt processing): row tiles are expanded to float32 by the
    compiled kernels (bit-exact with `llamapy.quants`; repacked tiles come out transposed, which
    is the layout sgemm wants) and handed to numpy's BLAS; the tile bounds the memory.
  * no compiled kernels (LLAMAPY_KERNELS=numpy, or neither a C compiler nor numba): numpy
    dequantization + BLAS for every n_tokens.
Threads (numba kernels): calls of >= `PARALLEL_MIN_WEIGHTS` are cut into chunks run by the
caller and helper threads of our own (`_POOL`), so that a helper that is not scheduled never
stalls the caller.
"""

from __future__ import annotations

import itertools
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from llamapy import quants
from llamapy.types import GGMLType, UnsupportedError, block_size

from . import native

# At or above this many tokens, dequantized tiles + BLAS beat the per-block kernels.
BLAS_MIN_TOKENS = 16
# Float32 elements per dequantized tile on the BLAS path (4 MiB).
TILE_ELEMS = 1 << 20
# Rows per repacked tile: wide enough for 8-lane AVX2 loops with little loop overhead
# (measured on Q4_1 1536x576: R=16 3.2, R=32 6.5, R=64 7.2 G weights/s on one thread).
# The C kernels hard-code it (LP_R in kernels_c/qmatmul.c).
REPACK_ROWS = 64
# numba: decode calls with at least this many weights use the prange drivers when threads > 1.
PRANGE_MIN_WEIGHTS = 1 << 18

# f16 bit pattern -> float32, for the numba kernels (a 256 KiB table stays mostly in L2).
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# --------------------------------------------------------------------------------------------
# Which compiled kernels: "c" (kernels_c/, built by native.py), else "numba" (numba_kernels.py,
# imported only then: it loads LLVM), else "numpy" (dequantization + BLAS, no compiled code).
# LLAMAPY_KERNELS=c|numba|numpy asks for one (falling back down the list when it is not there);
# LLAMAPY_NO_NUMBA=1 rules numba out. Types without C kernels use numba's when numba is there.
# --------------------------------------------------------------------------------------------
IMPLS = ("c", "numba", "numpy")
_kernels: str | None = None  # decided on first use
_nk: Any = None  # the numba_kernels module once imported
_nk_error: str | None = None


def numba_kernels() -> Any:
    """The numba kernel module (imported on the first call), or None without numba or with
    LLAMAPY_NO_NUMBA=1."""
    global _nk, _nk_error
    if _nk is not None or _nk_error is not None:
        return _nk
    if os.environ.get("LLAMAPY_NO_NUMBA", "") not in ("", "0"):
        _nk_error = "disabled by LLAMAPY_NO_NUMBA"
        return None
    try:
        from . import numba_kernels as nk
    except ImportError as e:  # pragma: no cover - depends on the environment
        _nk_error = str(e)
        return None
    _nk = nk
    return nk


def kernels() -> str:
    """The compiled kernels in use: "c", "numba" or "numpy" (see above)."""
    global _kernels
    if _kernels is None:
        want = os.environ.get("LLAMAPY_KERNELS", "").lower()
        order = IMPLS[IMPLS.index(want):] if want in IMPLS else IMPLS
        for impl in order:
            if impl == "numpy" or (impl == "c" and native.lib() is not None) or (
                impl == "numba" and numba_kernels() is not None
            ):
                _kernels = impl
                break
    return _kernels  # type: ignore[return-value]


def _numba_for_file_layout() -> Any:
    """numba kernels for the file's layout (types without C kernels): not with "numpy"."""
    return None if kernels() == "numpy" else numba_kernels()


_num_threads = 0


def set_num_threads(n: int) -> None:
    """Threads the kernels use (llama.cpp's `-t`); 0 means one per core."""
    global _num_threads
    _num_threads = max(0, int(n))


_numba_threads = 0


def _set_numba_threads(n: int) -> None:
    global _numba_threads
    if n != _numba_threads:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        _numba_threads = n


def _threads(n_threads: int) -> int:
    n = n_threads or _num_threads
    return n if n > 0 else (os.cpu_count() or 1)


# --------------------------------------------------------------------------------------------
# Threads. numba's parallel layers (omp/workqueue) split a `prange` statically and then wait
# at a barrier for every thread: on a shared, loaded machine a thread that is not scheduled
# stalls the whole call (measured: 2-thread decode slower than 1 thread). Instead, a call is
# cut into chunks that the calling thread and persistent helper threads claim one at a time
# (the kernels release the GIL). The caller never waits for a helper that has not started: it
# runs every chunk still unclaimed itself and then waits only for chunks in flight.
# --------------------------------------------------------------------------------------------


class _Job:
    __slots__ = ("fn", "n", "claim", "done", "event", "error")

    def __init__(self, fn: Callable[[int], None], n: int) -> None:
        self.fn, self.n = fn, n
        self.claim = itertools.count()  # next() is atomic under the GIL
        self.done = itertools.count(1)
        self.event = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        n = self.n
        while True:
            c = next(self.claim)
            if c >= n:
                return
            try:
                self.fn(c)
            except BaseException as e:  # pragma: no cover - re-raised by the caller
                self.error = e
            if next(self.done) == n:
                self.event.set()


class _Pool:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.n_helpers = 0
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def _helper(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            job.work()

    def run(self, fn: Callable[[int], None], n_chunks: int, n_threads: int) -> None:
        """fn(0..n_chunks-1), on up to n_threads threads (the caller is one of them)."""
        if n_threads <= 1 or n_chunks <= 1:
            for c in range(n_chunks):
                fn(c)
            return
        want = min(n_threads, n_chunks) - 1
        with self.lock:
            if self.pid != os.getpid():  # forked: the helpers did not come along
                self.__init__()  # type: ignore[misc]
            while self.n_helpers < want:
                threading.Thread(target=self._helper, daemon=True, name="llamapy-qmatmul").start()
                self.n_helpers += 1
        job = _Job(fn, n_chunks)
        for _ in range(want):
            self.queue.put(job)
        job.work()
        job.event.wait()
        if job.error is not None:
            raise job.error


    def run_private(
        self,
        fn: Callable[[int, np.ndarray], None],
        n_chunks: int,
        n_threads: int,
        out: np.ndarray,
        cols: Callable[[int], tuple[int, int]],
    ) -> None:
        """Like `run` for kernels that write out[:, cols(c)] of chunk c, but the caller never
        waits long on a helper: helpers compute into a private buffer and copy their columns
        into `out` only while the call is open; when the caller has run out of chunks it gives
        the helpers about one chunk's time, then closes the call and computes whatever they
        have not delivered itself (same kernel, same inputs: the same bits)."""
        if n_threads <= 1 or n_chunks <= 1:
            for c in range(n_chunks):
                fn(c, out)
            return
        want = min(n_threads, n_chunks) - 1
        with self.lock:
            if self.pid != os.getpid():
                self.__init__()  # type: ignore[misc]
            while self.n_helpers < want:
                threading.Thread(target=self._helper, daemon=True, name="llamapy-qmatmul").start()
                self.n_helpers += 1
        job = _PrivateJob(fn, n_chunks, out, cols)
        for _ in range(want):
            self.queue.put(job)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        mine = job.work_caller()
        if job.n_published < n_chunks:
            per_chunk = (time.perf_counter() - t0) / max(1, mine)
            job.event.wait(min(0.002, 1.5 * per_chunk + 30e-6))
        with job.lock:
            job.closed = True
            missing = [c for c in range(n_chunks) if not job.published[c]]
        for c in missing:
            fn(c, out)


class _PrivateJob:
    __slots__ = ("fn", "n", "out", "cols", "claim", "lock", "closed", "published",
                 "n_published", "event")

    def __init__(self, fn, n, out, cols) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.n, self.out, self.cols = fn, n, out, cols
        self.claim = itertools.count()
        self.lock = threading.Lock()
        self.closed = False
        self.published = [False] * n
        self.n_published = 0
        self.event = threading.Event()

    def _publish(self, c: int) -> None:
        # Under self.lock.
        self.published[c] = True
        self.n_published += 1
        if self.n_published == self.n:
            self.event.set()

    def work_caller(self) -> int:
        done = 0
        while True:
            c = next(self.claim)
            if c >= self.n:
                return done
            self.fn(c, self.out)
            done += 1
            with self.lock:
                self._publish(c)

    def work(self) -> None:  # a helper
        buf: np.ndarray | None = None
        while not self.closed:
            c = next(self.claim)
            if c >= self.n:
                return
            if buf is None:
                buf = np.empty_like(self.out)
            try:
                self.fn(c, buf)
            except Exception:  # pragma: no cover - the caller recomputes the chunk
                continue
            a, b = self.cols(c)
            with self.lock:
                if self.closed:
                    return
                self.out[:, a:b] = buf[:, a:b]
                self._publish(c)


_POOL = _Pool()

# Weights per chunk handed to a thread (~40 us of matvec): smaller matrices run on the calling
# thread alone, bigger ones in about this much work per chunk.
CHUNK_WEIGHTS = 1 << 18
# At most this many chunks per thread (bounds the per-chunk dispatch cost, ~3 us each).
MAX_CHUNKS_PER_THREAD = 8


# Below this many weights (x tokens) a call stays on the calling thread: on a shared machine a
# helper's wake-up and its last chunk cost more than they save (measured on 1536x576 Q4_1).
PARALLEL_MIN_WEIGHTS = 1 << 20


def _n_chunks(work: int, units: int, nt: int) -> int:
    if nt <= 1 or work < PARALLEL_MIN_WEIGHTS:
        return 1
    return int(max(1, min(units, work // CHUNK_WEIGHTS, MAX_CHUNKS_PER_THREAD * nt)))


# --------------------------------------------------------------------------------------------
# Repacking (rows innermost).
# --------------------------------------------------------------------------------------------


def _tr(a: np.ndarray) -> np.ndarray:
    """(T, R, nb, k) -> contiguous (T, nb, k, R)."""
    return np.ascontiguousarray(np.moveaxis(a, 1, 3))


def _f16_fields(b: np.ndarray) -> np.ndarray:
    """(T, R, nb, 2k) bytes holding k f16 -> (T, nb, k, R) float16: the file's bits, so the
    scales cost what they do in the file (the kernels widen them to float32, exactly)."""
    return _tr(np.ascontiguousarray(b).view(np.float16))


def _repack_q4_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _tr(b[..., 2:18]), _f16_fields(b[..., 0:2])


def _repack_q4_1(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _tr(b[..., 4:20]), _f16_fields(b[..., 0:4])


def _repack_q8_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return _tr(b[..., 2:34]).view(np.int8), _f16_fields(b[..., 0:2])


def _repack_q4_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    sc, mn = quants.k_scale_min(b[..., 4:16].reshape(-1, 12))
    sm = np.concatenate([sc, mn], axis=1).reshape(*b.shape[:3], 16)
    return _tr(b[..., 16:144]), _tr(sm), _f16_fields(b[..., 0:4])


def _repack_q6_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    return (_tr(b[..., 0:128]), _tr(b[..., 128:192]), _tr(b[..., 192:208]).view(np.int8),
            _f16_fields(b[..., 208:210]))


# Types with rows-innermost kernels; overhead over the file's bytes: none for Q4_0, Q4_1, Q8_0
# and Q6_K (the same fields, f16 scales included, only reordered), Q4_K +2.8% (its 12 bytes of
# packed 6-bit scales and mins unpacked to 16).
_REPACK: dict[GGMLType, Callable[[np.ndarray], tuple[np.ndarray, ...]]] = {
    GGMLType.Q4_0: _repack_q4_0,
    GGMLType.Q4_1: _repack_q4_1,
    GGMLType.Q8_0: _repack_q8_0,
    GGMLType.Q4_K: _repack_q4_k,
    GGMLType.Q6_K: _repack_q6_k,
}


def _drop_mapped_pages(a: np.ndarray) -> None:
    """Tell the OS the pages of `a` are not needed any more, when `a` is a view of a read-only
    file mapping (re-read from the file if ever touched again); anything else is left alone."""
    base: Any = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, np.ndarray):
        return
    obj = base.obj if isinstance(base, memoryview) else base
    if not isinstance(obj, mmap.mmap) or not hasattr(obj, "madvise"):
        return
    try:
        start = np.frombuffer(obj, np.uint8).ctypes.data
    except (TypeError, ValueError):  # pragma: no cover - a closed or writable mapping
        return
    try:
        np.frombuffer(obj, np.uint8)[:0].setflags(write=True)
        return  # writable mapping: MADV_DONTNEED could drop changes
    except ValueError:
        pass
    page = mmap.PAGESIZE
    lo = a.ctypes.data - start
    hi = lo + a.nbytes
    lo = -(-lo // page) * page
    hi = hi // page * page
    if 0 <= lo < hi <= len(obj):
        try:
            obj.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError, AttributeError):  # pragma: no cover
            pass


@dataclass
class QMatrix:
    """A weight matrix (n_out rows of n_in elements) kept quantized, ready for matmul.

    Most types keep `data`, the file's own bytes ((n_out, row_bytes) uint8, usually a read-only
    view of the GGUF memmap): nothing is copied and the pages stay droppable by the OS.
    Types in `_REPACK` (with compiled kernels) are repacked once into row-interleaved tiles (`_rp`, a tuple
    of arrays) and the mapped rows are released (and their pages dropped when they are a
    read-only file mapping); `data` then only keeps a copy of the last n_out % REPACK_ROWS rows,
    in the file's layout.
    """

    qtype: GGMLType
    n_out: int
    n_in: int
    data: np.ndarray = field(repr=False)
    # The view the per-row kernels read (int8 for Q8_0, uint16 for F16/BF16, float32 for F32).
    _kdata: np.ndarray | None = field(repr=False, default=None)
    _rp: tuple[np.ndarray, ...] | None = field(repr=False, default=None)
    _n_full: int = 0  # rows held by the repacked tiles
    # For the C kernels: pointers to _rp's arrays and the (matvec, tiles, rows) functions.
    _cparts: Any = field(repr=False, default=None)
    _cfns: Any = field(repr=False, default=None)
    _tail_f32: np.ndarray | None = field(repr=False, default=None)
    _nbparts: Any = field(repr=False, default=None)  # _rp as the numba kernels take it

    @classmethod
    def prepare(cls, raw: np.ndarray, qtype: GGMLType, n_out: int, n_in: int) -> QMatrix:
        qtype = GGMLType(qtype)
        if qtype not in quants.DEQUANT_TYPES:
            raise UnsupportedError(f"matmul with weights of type {qtype.name}")
        blck, bsize = block_size(qtype)
        if n_in % blck:
            raise ValueError(f"n_in={n_in} is not a multiple of {qtype.name}'s block of {blck}")
        row_bytes = n_in // blck * bsize
        data = np.asarray(raw).view(np.uint8)
        if data.size != n_out * row_bytes:
            raise ValueError(
                f"{qtype.name} matrix {n_out}x{n_in} needs {n_out * row_bytes} bytes, got {data.size}"
            )
        # A reshape of a contiguous view, never a copy: the memmap is what we hold.
        data = np.ascontiguousarray(data.reshape(n_out, row_bytes))
        m = cls(qtype, n_out, n_in, data)
        if qtype in _REPACK and n_out >= REPACK_ROWS and kernels() != "numpy":
            m._repack()
        m._kdata = _kernel_view(qtype, m.data)
        return m

    def _repack(self) -> None:
        blck, bsize = block_size(self.qtype)
        R = REPACK_ROWS
        nb = self.n_in // blck
        n_full = self.n_out // R * R
        src = self.data
        self._rp = _REPACK[self.qtype](src[:n_full].reshape(n_full // R, R, nb, bsize))
        self._n_full = n_full
        # Drop the mapped rows: only the (copied) tail stays in the file's layout.
        self.data = np.array(src[n_full:])
        _drop_mapped_pages(src[:n_full])

    @property
    def repacked(self) -> bool:
        return self._rp is not None

    def state(self) -> list[np.ndarray] | None:
        """The arrays a repacked matrix is made of (tiles..., tail rows), for a cache file;
        None when the matrix is not repacked (it is then just the file's bytes)."""
        if self._rp is None:
            return None
        return [*self._rp, self.data]

    @classmethod
    def from_state(cls, qtype: GGMLType, n_out: int, n_in: int, arrays: list[np.ndarray]) -> QMatrix:
        """Rebuild a repacked matrix from `state()`'s arrays (e.g. views of a mapped cache file)."""
        qtype = GGMLType(qtype)
        *rp, tail = arrays
        m = cls(qtype, n_out, n_in, tail)
        m._rp = tuple(rp)
        m._n_full = n_out - tail.shape[0]
        m._kdata = _kernel_view(qtype, m.data)
        return m

    @property
    def nbytes(self) -> int:
        """Bytes this object holds: the quantized rows (file layout) plus any repacked tiles."""
        n = int(self.data.nbytes)
        if self._rp is not None:
            n += sum(int(a.nbytes) for a in self._rp)
        return n

    def _ids(self, rows: np.ndarray | slice | None) -> np.ndarray:
        if rows is None:
            return np.arange(self.n_out, dtype=np.int64)
        if isinstance(rows, slice):
            return np.arange(self.n_out, dtype=np.int64)[rows]
        ids = np.asarray(rows, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < -self.n_out or ids.max() >= self.n_out):
            raise IndexError(f"row id out of range 0..{self.n_out - 1}")
        return np.where(ids < 0, ids + self.n_out, ids)

    def dequantize(self, rows: np.ndarray | slice | None = None, n_threads: int = 0) -> np.ndarray:
        """float32 (n, n_in) of the selected rows (all when `rows` is None).

        C-contiguous, except for a run of whole repacked tiles, which comes back in Fortran order
        (the transpose of the (n_in, n) array the fast kernel writes; `.T` of it is what BLAS
        wants as the right-hand operand)."""
        ids = self._ids(rows)
        nk = None if self._rp is not None else _numba_for_file_layout()
        if self._rp is None and (nk is None or self.qtype not in nk.DEQUANT):
            sel = self.data if rows is None else self.data[rows] if isinstance(rows, slice) else self.data[ids]
            return quants.dequantize(sel, self.qtype, self.n_in).reshape(-1, self.n_in)
        R, n = REPACK_ROWS, ids.size
        if self._rp is not None and n and ids[0] % R == 0 and n % R == 0 and ids[-1] < self._n_full:
            if n == 1 or bool((np.diff(ids) == 1).all()):
                # Whole tiles in order (the BLAS path's tiles): expanded transposed, at full
                # speed, and returned as the transpose of that (a Fortran-ordered array).
                return self._dequant_tiles_t(int(ids[0]) // R, n // R, n_threads).T
        out = np.empty((n, self.n_in), dtype=np.float32)
        self._dequant_into(ids, out, n_threads)
        return out

    def _dequant_tiles_t(self, ta: int, n_t: int, n_threads: int) -> np.ndarray:
        """Repacked tiles ta..ta+n_t expanded to float32, transposed: (n_in, n_t * R)."""
        R = REPACK_ROWS
        # Rows padded by 16 floats: a stride of a multiple of 4 KiB aliases in L1.
        out_t = np.empty((self.n_in, n_t * R + 16), dtype=np.float32)[:, : n_t * R]
        nt = _threads(n_threads)
        cfns = self._c()
        if cfns is not None:
            # One thread: these tiles feed BLAS, whose own threads want the cores; an OpenMP
            # worker spinning after the expansion halved pp512 (expansion is ~3% of its time).
            nb = self.n_in // block_size(self.qtype)[0]
            cfns[1](self._cparts, ta, ta + n_t, nb, out_t.ctypes.data, out_t.strides[0] // 4, 1)
            return out_t
        nc = _n_chunks(n_t * R * self.n_in * 4, n_t, nt)
        kt, p = numba_kernels().DEQUANT_TILES[self.qtype], self._nb()

        def chunk(c: int) -> None:
            a, b = c * n_t // nc, (c + 1) * n_t // nc
            kt(p, out_t[:, a * R : b * R], ta + a, ta + b)

        _POOL.run(chunk, nc, nt)
        return out_t

    def _nb(self) -> tuple[np.ndarray, ...]:
        """`_rp` as the numba kernels take it (f16 scales as their uint16 bits), made once."""
        if self._nbparts is None:
            self._nbparts = numba_kernels().repacked_args(self._rp)
        return self._nbparts

    def _c(self) -> Any:
        """This repacked matrix's C kernels (matvec, tiles, rows) when kernels() == "c", else None."""
        if self._rp is None or kernels() != "c":
            return None
        if self._cparts is None:
            lib, t = native.lib(), self.qtype.name.lower()
            self._cfns = (getattr(lib, f"lp_mv_{t}"), getattr(lib, f"lp_dqt_{t}"), getattr(lib, f"lp_dqr_{t}"))
            self._cparts = native.parts(self._rp)  # the arrays live as long as self
        return self._cfns

    def _dequant_into(self, ids: np.ndarray, out: np.ndarray, n_threads: int) -> None:
        n = ids.size
        if n == 0:
            return
        nt = _threads(n_threads)
        n_chunks = _n_chunks(n * self.n_in * 4, n, nt)  # an element costs ~4 matvec weights
        if self._rp is None:
            k, w = numba_kernels().DEQUANT[self.qtype], self.data

            def chunk(c: int) -> None:
                k(w, ids, out, c * n // n_chunks, (c + 1) * n // n_chunks, F16_TABLE)

            _POOL.run(chunk, n_chunks, nt)
            return
        full = bool(ids.max() < self._n_full)
        rp_ids = ids if full else ids[ids < self._n_full]
        target = out if full else np.empty((rp_ids.size, self.n_in), np.float32)
        nr = rp_ids.size
        cfns = self._c()
        if cfns is not None and nr:
            rp_ids = np.ascontiguousarray(rp_ids, dtype=np.int64)
            nb = self.n_in // block_size(self.qtype)[0]
            cfns[2](self._cparts, nb, rp_ids.ctypes.data, nr, target.ctypes.data)
        elif nr:
            kr, p = numba_kernels().DEQUANT_REPACKED[self.qtype], self._nb()

            def chunk_r(c: int) -> None:
                kr(p, rp_ids, target, c * nr // n_chunks, (c + 1) * nr // n_chunks)

            _POOL.run(chunk_r, min(n_chunks, nr), nt)
        if not full:
            tail = ids >= self._n_full
            out[~tail] = target
            out[tail] = self._tail_rows()[ids[tail] - self._n_full]

    def _tail_rows(self) -> np.ndarray:
        """The last n_out % REPACK_ROWS rows (kept in the file's layout) as float32, expanded
        once: at most 63 rows (matrices have them rarely, e.g. an odd vocabulary's output)."""
        if self._tail_f32 is None:
            self._tail_f32 = quants.dequantize(self.data, self.qtype, self.n_in).reshape(-1, self.n_in)
        return self._tail_f32

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """GET_ROWS: float32 (len(ids), n_in), e.g. token embeddings."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_out):
            raise IndexError(f"row id out of range 0..{self.n_out - 1}")
        return self.dequantize(ids)

    def matmul(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """x float32 (n_tokens, n_in) -> float32 (n_tokens, n_out) = x @ W.T."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        if squeeze:
            x = x.reshape(1, -1)
        if x.ndim != 2 or x.shape[1] != self.n_in:
            raise ValueError(f"x has shape {x.shape}, expected (n_tokens, {self.n_in})")
        n_tok = x.shape[0]
        if self.qtype == GGMLType.F32 and n_tok >= 2:
            # Already float32: the file's rows are the BLAS operand, no copy.
            out = x @ self.data.view(np.float32).T
        elif n_tok < BLAS_MIN_TOKENS and self._rp is not None:
            out = self._matmul_repacked(x, n_threads)
        elif n_tok < BLAS_MIN_TOKENS and _numba_for_file_layout() is not None:
            out = self._matmul_rows(x, n_threads)
        else:
            out = self._matmul_tiles(x, n_threads)
        return out.reshape(-1) if squeeze else out

    def _matmul_repacked(self, x: np.ndarray, n_threads: int) -> np.ndarray:
        n_tok = x.shape[0]
        out = np.empty((n_tok, self.n_out), dtype=np.float32)
        nt = _threads(n_threads)
        n_tiles = self._n_full // REPACK_ROWS
        cfns = self._c()
        if cfns is not None:
            nb = self.n_in // block_size(self.qtype)[0]
            cfns[0](self._cparts, n_tiles, nb, native.ptr(x), n_tok, native.ptr(out), self.n_out, nt)
            self._matmul_tail(x, out)
            return out
        nk = numba_kernels()
        xs = nk._block_sums16(x)
        kr, p = nk.REPACKED[self.qtype], self._nb()
        work = self.n_out * self.n_in * n_tok
        if nt > 1 and work >= PRANGE_MIN_WEIGHTS and n_tiles >= 2 * nt:
            _set_numba_threads(nt)
            nk.PAR_REPACKED[self.qtype](p, x, xs, out, n_tiles, min(n_tiles, 4 * nt))
            self._matmul_tail(x, out)
            return out
        nc = _n_chunks(work, n_tiles, nt)

        def chunk(c: int, dst: np.ndarray) -> None:
            kr(p, x, xs, dst, c * n_tiles // nc, (c + 1) * n_tiles // nc)

        def cols(c: int) -> tuple[int, int]:
            return c * n_tiles // nc * REPACK_ROWS, (c + 1) * n_tiles // nc * REPACK_ROWS

        _POOL.run_private(chunk, nc, nt, out, cols)
        self._matmul_tail(x, out)
        return out

    def _matmul_rows(self, x: np.ndarray, n_threads: int) -> np.ndarray:
        """numba's per-row kernels on the file's layout (types without a repacked layout)."""
        nk = numba_kernels()
        out = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        xs = nk._block_sums16(x)
        nt = _threads(n_threads)
        k, w, n = nk.KERNELS[self.qtype], self._kdata, self.n_out
        nc = _n_chunks(self.n_out * self.n_in * x.shape[0], n, nt)

        def chunk_f(c: int, dst: np.ndarray) -> None:
            k(w, x, xs, dst, c * n // nc, (c + 1) * n // nc, F16_TABLE, 16)

        def cols_f(c: int) -> tuple[int, int]:
            return c * n // nc, (c + 1) * n // nc

        _POOL.run_private(chunk_f, nc, nt, out, cols_f)
        return out

    def _matmul_tail(self, x: np.ndarray, out: np.ndarray) -> None:
        """The last n_out % REPACK_ROWS rows, kept in the file's layout (at most 63 rows: they
        are expanded to float32 for the product)."""
        if self._n_full < self.n_out:
            np.matmul(x, self._tail_rows().T, out=out[:, self._n_full :])

    def matmul_tiles(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """x @ W.T through f32 tiles and sgemm whatever the batch (the BLAS backend's path)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.qtype == GGMLType.F32:
            return x @ self.data.view(np.float32).T
        return self._matmul_tiles(x, n_threads)

    def _matmul_tiles(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        # Prompt processing / no numba: expand row tiles to f32 and let BLAS do the flops.
        out = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        step = max(1, TILE_ELEMS // self.n_in)
        r_start = 0
        if self._rp is not None:
            R = REPACK_ROWS
            n_t, step_t = self._n_full // R, max(1, step // R)
            for t0 in range(0, n_t, step_t):
                t1 = min(n_t, t0 + step_t)
                tile_t = self._dequant_tiles_t(t0, t1 - t0, n_threads)  # (n_in, rows)
                np.matmul(x, tile_t, out=out[:, t0 * R : t1 * R])
            r_start = self._n_full
        for r0 in range(r_start, self.n_out, step):
            r1 = min(self.n_out, r0 + step)
            tile = self.dequantize(slice(r0, r1), n_threads)
            np.matmul(x, tile.T, out=out[:, r0:r1])
        return out


def _kernel_view(qtype: GGMLType, data: np.ndarray) -> np.ndarray:
    """The dtype view of the file's rows that the per-row kernel of `qtype` reads."""
    if qtype == GGMLType.Q8_0:
        return data.view(np.int8)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        return data.view(np.uint16)
    if qtype == GGMLType.F32:
        return data.view(np.float32)
    return data
