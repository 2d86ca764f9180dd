"""Quantized MUL_MAT for the CPU backend (ggml-cpu's `ggml_compute_forward_mul_mat` and the
`ggml_vec_dot_*` kernels of ggml-cpu `quants.c`).

Weights stay as the GGUF file stores them: `QMatrix` keeps a (n_out, row_bytes) uint8 view of
the (memory-mapped) tensor and never expands the whole matrix to float32. Two ways to multiply
with few tokens, chosen per context (`ContextOptions.cpu_matmul`, `--f32-activations`):

  * "q8" (the default; what llama.cpp computes): each MUL_MAT quantizes its float32 input once
    into the weight type's vec_dot_type (q8_0, q8_1, q8_K; f16 / bf16 for F16 / BF16 weights)
    and takes integer dot products with the file's blocks (kernels_c/quants.c, `lp_mul_mat`),
    so llamapy's logits follow llama.cpp's for the same file. The weights are used where they
    are mapped: no repacking, no copy.
  * "f32" (for exactness studies): the weights are multiplied with the float32 activations, so
    the only rounding is the weights' own. Q4_0/Q4_1/Q8_0/Q4_K/Q6_K are repacked once into
    row-interleaved tiles of `REPACK_ROWS` rows (kernels_c/qmatmul.c, `lp_mv_*`; the mapped rows
    are then released); other types are expanded to float32 and multiplied by BLAS.

Prompts: `use_sgemm` is the one place that decides when a product is big enough for float32
tiles + sgemm instead (both modes, and the BLAS backend, which claims exactly those products).
In the q8 mode the types of `Q8_GEMM` never go there (their multi-column kernels are
faster at every batch, and a token's numbers then never depend on its batch); for the others
sgemm gets the activations quantized and expanded back (`round_act`), so a prompt computes the
same sums as the q8 kernels (up to float32 summation order), as llama.cpp's CPU backend does.
Without the compiled kernels (LLAMAPY_KERNELS=numpy, or an install without a C compiler) every
product is numpy dequantization + BLAS.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from llamapy import quants
from llamapy.types import GGMLType, UnsupportedError, block_size

from . import native

# At or above this many tokens a product runs as float32 tiles + sgemm (`use_sgemm`). Measured
# roughly (noisy: a shared 2-core machine under load; one thread each, Q4_1 and Q8_0 at
# 1536x576 and 576x1536): lp_mul_mat costs ~0.1 ms a token per 1M weights and grows linearly,
# tiles cost one expansion (~1.6 ms per 1M weights from the file layout, numpy; ~0.2 ms from
# the repacked tiles, C) plus sgemm (~0.02-0.04 ms a token per 1M weights): they cross
# between 8 and 16 tokens; at 64 tokens sgemm is 3-10x faster, at 512 tokens ~4x.
SGEMM_MIN_TOKENS = 16
# Weight types whose q8 kernels beat float32 tiles + sgemm at every batch in the q8 mode, where
# the library has their multi-column kernel (this symbol, lp_quants.h's lp_gemm_fn; the AVX2 and
# AVX-512 builds: each weight block decoded once for LP_GEMM_COLS tokens, bit-identical to the
# vec_dot), so their prompts stay on lp_mul_mat: a token's numbers are then the same alone or in
# any batch, and equal to llama.cpp's x86 prompt results (its vec_dots for Q4_0-Q8_0; for the K types
# its repacked Q4_K and (AVX-512) Q2_K gemms and tiled microtiles, whose order kernels_c/kquants.c follows). Measured (noisy:
# shared 2-core AVX-512 host under load ~8; one thread each, best of 3; time of the sgemm path
# (round_act + tiles + sgemm) / time of the q8 path (quantize_act + lp_mul_mat), bench/RESULTS.md
# 2026-12-02):
#   SmolLM2 576x576, 1536x576, 576x1536 at 4 / 16 / 64 / 512 tokens:
#     Q4_1 22-83 / 7.5-24 / 2.4-9.3 / 1.18-1.22   Q8_0 10-16 / 3.2-4.9 / 1.9-2.8 / 0.87-1.56
#     Q4_0 12-16 / 4.2-5.6 / 1.5-2.1 / 1.02-1.57  Q5_0 17-37 / 5.8-6.6 / 2.2-3.5 / 0.56-1.27
#     Q5_1 22-58 / 9.8-14 / 3.5-7.6 / 0.92-1.69
#   1B shape 2048x2048, 8192x2048, 2048x8192 (Q4_0) at 4 / 32 / 128 / 512 tokens:
#     10-65 / 3.4-9.3 / 1.7-2.0 / 1.06-1.15
#   1B shapes 2048x2048, 512x2048, 8192x2048, 2048x8192, Q6_K's 128256x2048 output, 4..512 tokens:
#     Q4_K 17-40 at 16, 4-12 at 64, 2.0-2.1 at 512; Q6_K 8-60 at 16-32, 2.2-8 at 128, 2.6-3.1 at 512
#     Q5_K / Q3_K at 2048x2048 and 2048x8192: 12-24 at 16, 1.5-4.5 at 512
Q8_GEMM: dict[GGMLType, str] = {
    GGMLType.Q4_0: "lp_gemm_q4_0_q8_0",
    GGMLType.Q4_1: "lp_gemm_q4_1_q8_1",
    GGMLType.Q5_0: "lp_gemm_q5_0_q8_0",
    GGMLType.Q5_1: "lp_gemm_q5_1_q8_1",
    GGMLType.Q8_0: "lp_gemm_q8_0_q8_0",
    GGMLType.Q2_K: "lp_gemm_q2_K_q8_K",
    GGMLType.Q3_K: "lp_gemm_q3_K_q8_K",
    GGMLType.Q4_K: "lp_gemm_q4_K_q8_K",
    GGMLType.Q5_K: "lp_gemm_q5_K_q8_K",
    GGMLType.Q6_K: "lp_gemm_q6_K_q8_K",
    # the MoE models' types (kernels_c/iquants.c): llama.cpp's x86 build takes IQ4_NL and MXFP4
    # through its repacked 8x8 gemm / gemv (one fma chain per output, at every batch size) and
    # IQ4_XS through its vec_dot; these kernels repeat those orders, so sgemm's would not be theirs
    GGMLType.IQ4_NL: "lp_gemm_iq4_nl_q8_0",
    GGMLType.IQ4_XS: "lp_gemm_iq4_xs_q8_K",
    GGMLType.MXFP4: "lp_gemm_mxfp4_q8_0",
    # the float types (their vec_dot_type is their own: f16 / bf16 activations, f32): kernels_c/quants.c's
    # panels, 2 x 3 tiles over the activations converted once to float32, each output the vec_dot's
    # bits. Against tiles + sgemm (BLAS splits between the executor's) on SmolLM2-135M's files, 2
    # threads, Zen 2 (bench/RESULTS.md, stop 37): F32 pp2 4.7 -> 91, pp16 31 -> 280, pp512 247 -> 382;
    # F16 pp16 19 -> 306, pp512 223 -> 338; BF16 pp16 28 -> 327, pp512 251 -> 342 tok/s
    GGMLType.F32: "lp_gemm_f32_panel",
    GGMLType.F16: "lp_gemm_f16_panel",
    GGMLType.BF16: "lp_gemm_bf16_panel",
}
# Types whose file rows the library expands to float32 (`lp_dequantize_rows`, kernels_c/iquants.c:
# the same bits as quants.dequantize, numpy's): the sgemm path's tiles and GET_ROWS
C_DEQUANT: frozenset[GGMLType] = frozenset([GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4])
# Float32 elements per dequantized tile on the sgemm path (4 MiB).
TILE_ELEMS = 1 << 20
# Rows per repacked tile: wide enough for 8-lane AVX2 loops with little loop overhead
# (measured on Q4_1 1536x576: R=16 3.2, R=32 6.5, R=64 7.2 G weights/s on one thread).
# The C kernels hard-code it (LP_R in kernels_c/qmatmul.c).
REPACK_ROWS = 64
MATMUL_MODES = ("q8", "f32")

# --------------------------------------------------------------------------------------------
# Which kernels: "c" (the library setup.py built, loaded by native.py) or "numpy" (dequantization
# + BLAS, the reference). LLAMAPY_KERNELS=numpy asks for numpy.
# --------------------------------------------------------------------------------------------


def kernels() -> str:
    """The kernels in use: "c" or "numpy" (see above)."""
    return "c" if native.lib() is not None else "numpy"


def use_sgemm(qtype: GGMLType, n_out: int, n_in: int, n_tokens: int, q8: bool = True) -> bool:
    """Whether a MUL_MAT of an (n_out, n_in) `qtype` weight with n_tokens rows of activations
    runs as float32 tiles + sgemm rather than as the per-block kernels: the one decision for the
    CPU backend (QMatrix.matmul) and the BLAS backend (which claims these products). `q8`: the
    context's mode ("q8" unless --f32-activations; the BLAS backend asks for the default)."""
    # the library looked up once: the scheduler and the executor ask ~1300 times a new graph shape
    if (lib := native.lib()) is None:
        return True
    if min(n_out, n_in) < 32:
        # a LoRA adapter's rank-r pairs: microseconds on the kernels, and on sgemm a product the
        # executor cannot compile (its split would run node by node) or a BLAS split of its own
        return False
    if q8 and _has_gemm(qtype, lib):
        return False  # the multi-column kernel beats tiles + sgemm at every batch (Q8_GEMM)
    if qtype == GGMLType.F32:
        return n_tokens >= 2  # already float32: no expansion to pay for
    return n_tokens >= SGEMM_MIN_TOKENS


def _has_gemm(qtype: GGMLType, lib: Any) -> bool:
    """Whether `qtype` is in Q8_GEMM and the kernel library `lib` has its multi-column kernel
    (the portable build has none: one vec_dot per output loses to sgemm from ~16 tokens)."""
    name = Q8_GEMM.get(qtype)
    return name is not None and hasattr(lib, name)


def _threads(n_threads: int) -> int:
    """The kernels' thread count for a call: the caller's (its backend's -t); 0 means one per
    core. There is no process-wide setting: two contexts with different -t do not interfere."""
    return n_threads if n_threads > 0 else (os.cpu_count() or 1)


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

    `data` is the file's own bytes ((n_out, row_bytes) uint8, usually a read-only view of the
    GGUF memmap): nothing is copied and the pages stay droppable by the OS. Prepared for the
    "f32" mode (`prepare(..., repack=True)`), the types in `_REPACK` are instead repacked once
    into row-interleaved tiles (`_rp`, a tuple of arrays) and the mapped rows are released;
    `data` then only keeps a copy of the last n_out % REPACK_ROWS rows, in the file's layout.
    """

    qtype: GGMLType
    n_out: int
    n_in: int
    data: np.ndarray = field(repr=False)
    _rp: tuple[np.ndarray, ...] | None = field(repr=False, default=None)
    _n_full: int = 0  # rows held by the repacked tiles
    # For the C kernels: pointers to _rp's arrays and the (matvec, tiles, rows) functions.
    _cparts: Any = field(repr=False, default=None)
    _cfns: Any = field(repr=False, default=None)
    _tail_f32: np.ndarray | None = field(repr=False, default=None)
    _vdt: int | None = field(repr=False, default=-2)  # vec_dot_type(), worked out on first use

    @classmethod
    def prepare(cls, raw: np.ndarray, qtype: GGMLType, n_out: int, n_in: int, repack: bool = False) -> QMatrix:
        """The matrix over `raw` (the file's rows); `repack`: the "f32" mode's tiles, for the
        types that have them, when the C kernels are there."""
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
        if repack and qtype in _REPACK and n_out >= REPACK_ROWS and kernels() == "c":
            m._repack()
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
        return None if self._rp is None else [*self._rp, self.data]

    @classmethod
    def from_state(cls, qtype: GGMLType, n_out: int, n_in: int, arrays: list[np.ndarray]) -> QMatrix:
        """Rebuild a repacked matrix from `state()`'s arrays (e.g. views of a mapped cache file)."""
        qtype = GGMLType(qtype)
        *rp, tail = arrays
        m = cls(qtype, n_out, n_in, tail)
        m._rp = tuple(rp)
        m._n_full = n_out - tail.shape[0]
        return m

    def row_range(self, r0: int, r1: int) -> QMatrix:
        """Rows [r0, r1) as a matrix of their own, sharing this one's blocks (one expert of a
        stacked (n_expert * M, K) expert weight; MUL_MAT_ID). A repacked matrix gives whole
        tiles only: the loader repacks expert weights only when M is a multiple of REPACK_ROWS."""
        if self._rp is None:
            return QMatrix(self.qtype, r1 - r0, self.n_in, self.data[r0:r1])
        R = REPACK_ROWS
        if r0 % R or (r1 - r0) % R or r1 > self._n_full:
            raise ValueError(f"rows [{r0}, {r1}) are not whole repacked tiles of {self._n_full} rows")
        m = QMatrix(self.qtype, r1 - r0, self.n_in, self.data[:0])
        m._rp = tuple(a[r0 // R : r1 // R] for a in self._rp)
        m._n_full = r1 - r0
        return m

    @property
    def nbytes(self) -> int:
        """Bytes this object holds: the quantized rows (file layout) plus any repacked tiles."""
        n = int(self.data.nbytes)
        if self._rp is not None:
            n += sum(int(a.nbytes) for a in self._rp)
        return n

    # --- quantized activations (the "q8" mode) ------------------------------------------------

    def vec_dot_type(self) -> int | None:
        """The ggml type id activations are quantized to for this matrix (`lp_vec_dot_type`), or
        None when the q8 kernels cannot take it (repacked, no kernel for the type, no C)."""
        if self._vdt == -2:
            lib = native.lib()
            v = -1 if self._rp is not None or lib is None else lib.lp_vec_dot_type(int(self.qtype))
            self._vdt = None if v < 0 else int(v)
        return self._vdt

    def quantize_act(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """x float32 (n_tokens, n_in) in this matrix's vec_dot_type: (n_tokens, row bytes) uint8,
        what `matmul_q8` takes (the same for every matrix of that vec_dot_type)."""
        lib = native.lib()
        x = np.ascontiguousarray(x, dtype=np.float32)
        n_tok = x.shape[0]
        rb = lib.lp_act_row_bytes(int(self.qtype), self.n_in)
        xq = np.empty((n_tok, rb), np.uint8)
        if lib.lp_quantize_act(int(self.qtype), native.ptr(x), self.n_in, self.n_in, n_tok, native.ptr(xq),
                               _threads(n_threads)) != 0:
            raise UnsupportedError(f"no quantized-activation kernel for {self.qtype.name}")
        return xq

    def round_act(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """x float32 (n_tokens, n_in) quantized to this matrix's vec_dot_type and expanded back
        (`lp_round_act`): float32 tiles + sgemm on it compute what `matmul_q8` computes (up to
        the order of the float32 sums), i.e. llama.cpp's numbers at sgemm's speed."""
        lib = native.lib()
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        if lib.lp_round_act(int(self.qtype), native.ptr(x), self.n_in, self.n_in, x.shape[0], native.ptr(out),
                            self.n_in, _threads(n_threads)) != 0:
            raise UnsupportedError(f"no quantized-activation kernel for {self.qtype.name}")
        return out

    def matmul_q8(self, xq: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """(n_tokens, n_out) float32 from activations quantized by `quantize_act`."""
        n_tok = xq.shape[0]
        out = np.empty((n_tok, self.n_out), np.float32)
        rc = native.lib().lp_mul_mat_q(int(self.qtype), self.data.ctypes.data, self.n_out, self.data.shape[1],
                                       self.n_in, xq.ctypes.data, n_tok, native.ptr(out), self.n_out,
                                       _threads(n_threads))
        if rc != 0:
            raise UnsupportedError(f"no quantized-activation kernel for {self.qtype.name}")
        return out

    def matmul_id_q8(self, xq: np.ndarray, ids: np.ndarray, n_expert: int, n_threads: int = 0) -> np.ndarray:
        """MUL_MAT_ID of this stacked expert matrix (n_expert * M rows) with activations
        quantized by `quantize_act`, xq (T, ux, row bytes), ux 1 (a row for all of a token's
        slots) or U; ids (T, U) int32 (a view with a row stride is fine) -> (T, U, M)
        (`lp_mul_mat_id_q`: each chosen expert's rows read once for all the tokens that chose it)."""
        T, ux = xq.shape[0], xq.shape[1]
        U, M = ids.shape[1], self.n_out // n_expert
        if ids.dtype != np.int32 or ids.strides[1] != 4:
            ids = np.ascontiguousarray(ids, np.int32)
        xq = np.ascontiguousarray(xq)
        out = np.empty((T, U, M), np.float32)
        rc = native.lib().lp_mul_mat_id_q(int(self.qtype), self.data.ctypes.data, n_expert, M, self.data.shape[1],
                                          self.n_in, xq.ctypes.data, ux, ids.ctypes.data, ids.strides[0] // 4, T, U,
                                          native.ptr(out), None, _threads(n_threads))
        if rc == -2:
            raise IndexError(f"expert id out of range 0..{n_expert - 1}")
        if rc != 0:
            raise UnsupportedError(f"no quantized-activation kernel for {self.qtype.name}")
        return out

    def path(self, n_tok: int, q8: bool = True) -> str:
        """Which kernel a product with n_tok tokens runs: "q8" (lp_mul_mat on the file's
        blocks), "mv" (float32 activations on the repacked tiles), "sgemm" (float32 tiles +
        BLAS; in the q8 mode on activations rounded by `round_act`). `q8`: the context's mode
        ("q8" unless --f32-activations)."""
        if use_sgemm(self.qtype, self.n_out, self.n_in, n_tok, q8):
            return "sgemm"
        if self._rp is not None:
            return "mv"
        if q8 and self.vec_dot_type() is not None:
            return "q8"
        return "sgemm"  # f32 mode without a repacked layout: float32 weights, exactly

    # --- float32 weights ------------------------------------------------------------------------

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
        if self._rp is None:
            sel = self.data if rows is None else self.data[rows] if isinstance(rows, slice) else \
                self.data[self._ids(rows)]
            return self._dequant_file_rows(sel)
        ids = self._ids(rows)
        R, n = REPACK_ROWS, ids.size
        if n and ids[0] % R == 0 and n % R == 0 and ids[-1] < self._n_full:
            if n == 1 or bool((np.diff(ids) == 1).all()):
                # Whole tiles in order (the sgemm path's tiles): expanded transposed, at full
                # speed, and returned as the transpose of that (a Fortran-ordered array).
                return self._dequant_tiles_t(int(ids[0]) // R, n // R).T
        out = np.empty((n, self.n_in), dtype=np.float32)
        self._dequant_into(ids, out)
        return out

    def _dequant_file_rows(self, sel: np.ndarray) -> np.ndarray:
        """float32 (n, n_in) of rows in the file's layout: in C for the types of C_DEQUANT."""
        lib = native.lib() if self.qtype in C_DEQUANT else None
        if lib is None or not hasattr(lib, "lp_dequantize_rows"):
            return quants.dequantize(sel, self.qtype, self.n_in).reshape(-1, self.n_in)
        sel = np.ascontiguousarray(sel)
        out = np.empty((sel.shape[0], self.n_in), np.float32)
        lib.lp_dequantize_rows(int(self.qtype), sel.ctypes.data, sel.shape[0], sel.shape[1], self.n_in,
                               out.ctypes.data, self.n_in)
        return out

    def _dequant_tiles_t(self, ta: int, n_t: int) -> np.ndarray:
        """Repacked tiles ta..ta+n_t expanded to float32, transposed: (n_in, n_t * R)."""
        R = REPACK_ROWS
        # Rows padded by 16 floats: a stride of a multiple of 4 KiB aliases in L1.
        out_t = np.empty((self.n_in, n_t * R + 16), dtype=np.float32)[:, : n_t * R]
        # One thread: these tiles feed BLAS, whose own threads want the cores; an OpenMP
        # worker spinning after the expansion halved pp512 (expansion is ~3% of its time).
        nb = self.n_in // block_size(self.qtype)[0]
        self._c()[1](self._cparts, ta, ta + n_t, nb, out_t.ctypes.data, out_t.strides[0] // 4, 1)
        return out_t

    def _c(self) -> Any:
        """This repacked matrix's C kernels (matvec, tiles, rows, the executor's matvec)."""
        if self._cparts is None:
            lib, t = native.lib(), self.qtype.name.lower()
            self._cfns = tuple(getattr(lib, f"lp_{k}_{t}") for k in ("mv", "dqt", "dqr", "mvp"))
            self._cparts = native.parts(self._rp)  # the arrays live as long as self
        return self._cfns

    def _dequant_into(self, ids: np.ndarray, out: np.ndarray) -> None:
        if ids.size == 0:
            return
        full = bool(ids.max() < self._n_full)
        rp_ids = ids if full else ids[ids < self._n_full]
        target = out if full else np.empty((rp_ids.size, self.n_in), np.float32)
        if rp_ids.size:
            rp_ids = np.ascontiguousarray(rp_ids, dtype=np.int64)
            nb = self.n_in // block_size(self.qtype)[0]
            self._c()[2](self._cparts, nb, rp_ids.ctypes.data, rp_ids.size, target.ctypes.data)
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
        if self._rp is None:  # the file's rows, ids checked above (not again by `_ids`: a decode
            # step's token embedding, where each numpy call counts)
            return self._dequant_file_rows(self.data[ids])
        return self.dequantize(ids)

    # --- products -------------------------------------------------------------------------------

    def matmul(self, x: np.ndarray, n_threads: int = 0, q8: bool = True) -> np.ndarray:
        """x float32 (n_tokens, n_in) -> float32 (n_tokens, n_out) = x @ W.T, on `path()`'s kernel."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        if squeeze:
            x = x.reshape(1, -1)
        if x.ndim != 2 or x.shape[1] != self.n_in:
            raise ValueError(f"x has shape {x.shape}, expected (n_tokens, {self.n_in})")
        path = self.path(x.shape[0], q8)
        if path == "q8":
            out = self.matmul_q8(self.quantize_act(x, n_threads), n_threads)
        elif path == "mv":
            out = self._matmul_repacked(x, n_threads)
        else:
            if q8 and self.vec_dot_type() is not None:
                x = self.round_act(x, n_threads)  # llama.cpp's activations, on sgemm
            out = self._matmul_tiles(x, n_threads)
        return out.reshape(-1) if squeeze else out

    def _matmul_repacked(self, x: np.ndarray, n_threads: int) -> np.ndarray:
        n_tok = x.shape[0]
        out = np.empty((n_tok, self.n_out), dtype=np.float32)
        n_tiles = self._n_full // REPACK_ROWS
        nb = self.n_in // block_size(self.qtype)[0]
        self._c()[0](self._cparts, n_tiles, nb, native.ptr(x), n_tok, native.ptr(out), self.n_out,
                     _threads(n_threads))
        self._matmul_tail(x, out)
        return out

    def _matmul_tail(self, x: np.ndarray, out: np.ndarray) -> None:
        """The last n_out % REPACK_ROWS rows, kept in the file's layout (at most 63 rows: they
        are expanded to float32 for the product)."""
        if self._n_full < self.n_out:
            np.matmul(x, self._tail_rows().T, out=out[:, self._n_full :])

    def matmul_tiles(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        """x @ W.T through f32 tiles and sgemm whatever the batch (the BLAS backend's path)."""
        return self._matmul_tiles(np.ascontiguousarray(x, dtype=np.float32), n_threads)

    def _matmul_tiles(self, x: np.ndarray, n_threads: int = 0) -> np.ndarray:
        if self.qtype == GGMLType.F32:
            return x @ self.data.view(np.float32).T  # already float32: the file's rows, no copy
        # expand row tiles to f32 and let BLAS do the flops
        out = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        step = max(1, TILE_ELEMS // self.n_in)
        r_start = 0
        if self._rp is not None:
            R = REPACK_ROWS
            n_t, step_t = self._n_full // R, max(1, step // R)
            for t0 in range(0, n_t, step_t):
                t1 = min(n_t, t0 + step_t)
                tile_t = self._dequant_tiles_t(t0, t1 - t0)  # (n_in, rows)
                np.matmul(x, tile_t, out=out[:, t0 * R : t1 * R])
            r_start = self._n_full
        for r0 in range(r_start, self.n_out, step):
            r1 = min(self.n_out, r0 + step)
            tile = self.dequantize(slice(r0, r1), n_threads)
            np.matmul(x, tile.T, out=out[:, r0:r1])
        return out
