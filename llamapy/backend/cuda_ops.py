"""The launch layer of llamapy's CUDA kernels (ggml-cuda's host side of each op: the
`ggml_cuda_op_*` functions of norm.cu, rope.cu, set-rows.cu, unary.cu, binbcast.cu, getrows.cu,
fattn.cu, mmvq.cu (and its MUL_MAT_ID path), softmax.cu, argsort.cu and sumrows.cu, which pick a
grid and launch on the backend's stream).

`CudaKernels.load(cp)` compiles every kernel source of `kernels_cuda/` (NVRTC through CuPy,
cached on disk by CuPy) and loads every entry point on the current device, once: a CUDA graph
capture may then launch them (no compilation or module load can happen inside a capture). The
device object keeps the result (`CUDADevice.ops()`); nothing here is process-global.

Each launch method takes device pointers as ints, sizes and strides (in elements, except the
byte strides of a KV cache whose rows hold quantized blocks), and the CuPy stream to launch on;
it computes the grid, block and dynamic shared memory, checks what the kernel cannot do, and
launches. Nothing allocates, nothing synchronizes: a caller that records the launches into a
CUDA graph, or runs them directly, gets the same work. `CudaKernels.record(build)` returns the
launches `build` makes as `Launch` objects, unrun, so a plan computes grids and arguments once
and replays them (~6-30 us of Python per launch method, measured with a no-op launcher, is
paid once per plan, not per step). Every kernel is float32 in and out but mmvq.cu's: the
default mode's large decode products quantize their input once to q8_1 (`quantize_q8_1`) and
take int8 dot products (`mul_mat_vec_q8`; why: docs/architecture.md, CUDA kernels); the numpy
references are `kernels.py`'s ops and quants.quantize_q8_1_cuda, compared in
tests/gpu/test_cuda_kernels.py.

This module imports CuPy only through the `cp` handed to `load`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..quants import hadamard_scale
from ..types import GGMLType, UnsupportedError, block_size
from .cuda import _TYPE_KERNELS as WEIGHT_SUFFIX  # weight type -> (source file, entry-point suffix)
from .cuda import MMV_MAX_TOKENS, MMV_ROWS_PER_BLOCK
from .cuda import _module_source as module_source
from .kernels import rope_theta_scale

# the cache element types of the rope/set_rows and attention kernels (cpu_kernels.KV_CODES)
CACHE_SUFFIX: dict[GGMLType, str] = {
    GGMLType.F32: "f32",
    GGMLType.F16: "f16",
    GGMLType.Q8_0: "q8_0",
    GGMLType.Q4_0: "q4_0",
}
_QUANT_CACHE = (GGMLType.Q8_0, GGMLType.Q4_0)
# the weight types with int8 decode products on a q8_1 copy of the activations (mmvq.cu)
MMVQ_SUFFIX: dict[GGMLType, str] = {t: WEIGHT_SUFFIX[t][1] for t in (
    GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K,
    GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4)}  # fmt: skip


def _entries() -> dict[str, tuple[str, ...]]:
    """Every kernel source and the entry points it defines (the compile test checks them)."""
    out: dict[str, tuple[str, ...]] = {
        "norm.cu": ("rms_norm_f32",),
        "glu.cu": ("swiglu_f32", "geglu_f32", "swiglu_oai_f32"),
        "elementwise.cu": ("add_f32", "mul_f32", "scale_f32", "cpy_f32_f16", "amax_f32"),
        "getrows.cu": ("get_rows_f32_rows",),
        "rope.cu": (*(f"rope_set_rows_{c}" for c in ("none", *CACHE_SUFFIX.values())),
                    *(f"rope_qkv_{k}_{v}" for k in CACHE_SUFFIX.values() for v in CACHE_SUFFIX.values())),
        "fattn.cu": ("fattn_combine", *(f"fattn_{k}_{v}" for k in CACHE_SUFFIX.values() for v in CACHE_SUFFIX.values()),
                     *(f"fattn_tile_{k}_{v}" for k in CACHE_SUFFIX.values() for v in CACHE_SUFFIX.values())),
        "moe.cu": ("soft_max_f32", "argsort_desc_f32", "get_rows_batched_f32", "sum_rows_f32", "clamp_f32",
                   "binary_row_f32", "router_f32", "router_topk_f32", "add_id_f32", "moe_sort", "moe_gather_f16",
                   "moe_scatter"),
        "mmvq.cu": ("quantize_q8_1", *(f"mmvq{g}_{s}" for s in MMVQ_SUFFIX.values() for g in ("", "_glu", "_id"))),
    }
    for fname, suffix in WEIGHT_SUFFIX.values():
        out[fname] = (*out.get(fname, ()), f"dequant_{suffix}", f"dequant_f16_{suffix}", f"get_rows_{suffix}", f"mmv_{suffix}",
                      f"mmv_glu_{suffix}",
                      f"mmv_id_{suffix}")
    return out


ENTRIES: dict[str, tuple[str, ...]] = _entries()

NVRTC_OPTIONS = (f"-DMMV_MAX_TOK={MMV_MAX_TOKENS}",)  # as cuda.py compiles the type modules

ELEMENTWISE_THREADS = 256
ROPE_MAX_THREADS = 256  # rope.cu: a block per (token, head), at most 8 values a thread
FA_THREADS = 128  # fattn.cu's FA_THREADS, FA_TILE, FA_MAX_D
FA_TILE = 64
FA_MAX_D = 256
SHARED_MAX = 48 << 10  # dynamic shared memory without an opt-in attribute
FA_MAX_SPLITS = 64
ARGSORT_THREADS = 128  # moe.cu: a block per row of the router's probabilities
FA_QT = 16  # fattn.cu's prompt kernel: query rows per block
FA_VEC_MAX_TOKENS = MMV_MAX_TOKENS  # attention of more query tokens runs the prompt kernel (fattn_tile_*)
GEMM_SCRATCH_BYTES = 64 << 20  # a prompt product's f16 weight scratch at most: rows dequantized per GEMM (gemm_tile_rows)
GEMM_SCRATCH_MIN = 4 << 20  # ... and at least (gemm_scratch_budget)
GEMM_SCRATCH_SHARE = 32  # ... else 1 / this of the weights a split multiplies (gemm_scratch_budget)
AMAX_BLOCKS = 256  # elementwise.cu's amax_f32: at most this many partial maxima of an f16 GEMM input
F16_SCALE_BYTES = 4 * (2 + AMAX_BLOCKS)  # the input's scale scratch: the GEMM's alpha and beta, then the partials


def _p(ptr: int) -> np.uint64:
    """A device pointer argument (0: null)."""
    return np.uint64(ptr)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fattn_splits(n_tokens: int, n_head_kv: int, n_cells: int, n_sm: int) -> int:
    """How many blocks share one (KV head, token)'s cells: enough blocks for two waves over the
    SMs, never a split of fewer than one tile of the cache's `n_cells`. Fixed per graph (the
    cells attended vary at run time: a split beyond them does nothing). A prompt (more than
    FA_VEC_MAX_TOKENS tokens) runs the prompt kernel, which does not split."""
    if n_tokens > FA_VEC_MAX_TOKENS:
        return 1
    blocks = max(1, n_tokens * n_head_kv)
    want = _cdiv(2 * n_sm, blocks)
    return int(max(1, min(FA_MAX_SPLITS, want, _cdiv(n_cells, FA_TILE))))


def fattn_scratch_floats(n_tokens: int, n_head: int, dv: int, n_splits: int) -> int:
    """float32 elements of the split partials fattn.cu writes (0 for one split)."""
    return 0 if n_splits <= 1 else n_tokens * n_head * n_splits * (dv + 2)


def q8_1_bytes(n_tok: int, n_in: int) -> int:
    """Bytes of mmvq.cu's q8_1 copy of n_tok rows of n_in: the int8 quants, then a float32 pair
    (d, d * sum q) per block of 32 (at byte n_tok * n_in)."""
    return n_tok * n_in + 8 * n_tok * (n_in // 32)


def gemm_scratch_budget(weight_bytes: int) -> int:
    """The f16 weight scratch of a plan's prompt products, for a split multiplying `weight_bytes`
    of weights: 1 / GEMM_SCRATCH_SHARE of them, within [GEMM_SCRATCH_MIN, GEMM_SCRATCH_BYTES].
    Why relative: GPU memory at -ngl all is held to llama.cpp's + 10 % (issue 28), whose int8
    prompt kernels need no such scratch; a fixed 64 MiB made SmolLM2-135M's shape reserve 162 MiB
    of compute where llama.cpp reserves 98 (+29 % of its whole footprint; the 1.2B's +11 %). Why
    not smaller for large models: each tile is a dequantization and a GEMM launched from Python
    (~10 us), so the 8B's ffn products keep 64 MiB tiles (4 a product)."""
    return max(GEMM_SCRATCH_MIN, min(GEMM_SCRATCH_BYTES, weight_bytes // GEMM_SCRATCH_SHARE))


def gemm_tile_rows(n_out: int, n_in: int, budget: int | None = None) -> int:
    """Rows of a prompt product's weight dequantized to f16 per GEMM: all of them when they fit
    `budget` bytes (gemm_scratch_budget; default GEMM_SCRATCH_BYTES), else the most that do, a
    multiple of 256 (the scratch is sized for the largest tile of a plan, reused by every product)."""
    rows = max(256, (GEMM_SCRATCH_BYTES if budget is None else budget) // (2 * n_in) // 256 * 256)
    return min(n_out, rows)


@dataclass(frozen=True)
class Launch:
    """One kernel launch with its arguments fixed: what a plan replays (no Python per argument)."""

    name: str
    fn: Any
    grid: tuple[int, ...]
    block: int
    args: tuple
    shared: int

    def __call__(self, stream: Any) -> None:
        self.fn(self.grid, (self.block,), self.args, shared_mem=self.shared, stream=stream)


@dataclass
class CudaKernels:
    """The loaded entry points of one device (RawKernel by name) and its SM count."""

    functions: dict[str, Any]
    n_sm: int
    gemm: Any = None  # the f16 GEMM launcher (CublasGemm on a device; the tests' numpy one on the emulator)
    reader: Any = None  # reader(stream, addr, n): n int32 of device memory, waited for (a prompt's expert counts)
    _modules: list[Any] = field(default_factory=list, repr=False)
    _sink: list[Launch] | None = field(default=None, repr=False)

    def record(self, build: Any) -> list[Launch]:
        """The launches `build(stream)` makes through these methods, recorded instead of run:
        a plan computes its grids and arguments once and replays the `Launch`es each step (or
        captures them into a CUDA graph)."""
        self._sink, out = [], []
        try:
            build(None)
            out = self._sink
        finally:
            self._sink = None
        return out

    @classmethod
    def load(cls, cp: Any) -> CudaKernels:
        """Compile and load every kernel on CuPy's current device (call with it current)."""
        functions: dict[str, Any] = {}
        modules = []
        for fname, names in ENTRIES.items():
            mod = cp.RawModule(code=module_source(fname), options=NVRTC_OPTIONS)
            modules.append(mod)
            for name in names:
                fn = mod.get_function(name)
                _ = fn.num_regs  # compiles the module and loads the function now, not in a capture
                functions[name] = fn
        dev = cp.cuda.Device()
        n_sm = int(dev.attributes["MultiProcessorCount"])
        return cls(functions, n_sm, CublasGemm(cp), DeviceReader(cp), modules)

    def _launch(self, name: str, grid: tuple[int, ...], block: int, args: tuple, stream: Any, shared: int = 0) -> None:
        if grid[0] >= 2**31 or any(g > 65535 for g in grid[1:]):
            raise UnsupportedError(f"CUDA: {name} over a grid of {grid} blocks (at most 2^31-1 x 65535 x 65535)")
        launch = Launch(name, self.functions[name], tuple(int(g) for g in grid), int(block), args, int(shared))
        if self._sink is not None:
            self._sink.append(launch)
        else:
            launch(stream)

    # -- row-wise ops -------------------------------------------------------------------------

    def rms_norm(self, stream: Any, x: int, sx: int, y: int, sy: int, rows: int, n: int, eps: float, *,
                 b: int = 0, sb: int = 0, sum_out: int = 0, ss: int = 0, w: int = 0, tokens: int = 1, sxt: int = 0,
                 syt: int = 0, xq: int = 0) -> None:
        """y = rms_norm(x [+ b]) [* w] over rows of n (norm.cu). `b`: the fused ADD's second
        operand (sb 0: one broadcast row), its sum written to `sum_out` when given; `w`: the
        norm weight (n,). A block per row. `tokens` > 1: that many groups of `rows` rows, x's
        and y's sxt / syt elements apart (per-head norms of a strided view; no ADD). `xq`: y's
        q8_1 copy written there too, as `quantize_q8_1` would write it (rows <= MMV_MAX_TOKENS)."""
        if rows <= 0 or n <= 0 or tokens <= 0:
            return
        if tokens > 1 and (b or sum_out or xq):
            raise UnsupportedError("CUDA: RMS_NORM with its ADD or q8_1 copy over groups of rows")
        if xq and (rows > MMV_MAX_TOKENS or n % 32 or xq % 16):
            raise UnsupportedError(f"CUDA: q8_1 copy of {rows} norm rows of {n} (at {xq:#x})")
        threads = 1024 if n >= 4096 else 256
        args = (_p(x), np.int64(sx), _p(b), np.int64(sb), _p(sum_out), np.int64(ss), _p(w), _p(y), np.int64(sy),
                np.int32(n), np.float32(eps), np.int64(sxt), np.int64(syt), _p(xq),
                _p(xq + rows * n if xq else 0))  # fmt: skip
        self._launch("rms_norm_f32", (rows, tokens), threads, args, stream)

    def glu(self, stream: Any, op: str, g: int, sg: int, u: int, su: int, y: int, sy: int, rows: int, n: int, *,
            alpha: float = 0.0, limit: float = 0.0) -> None:
        """y = act(g) * u, act SiLU ("swiglu") or GELU-tanh ("geglu"), rows of n (glu.cu);
        "swiglu_oai": gpt-oss's clamped SwiGLU with its `alpha` and `limit` (the +1 on up)."""
        if op not in ("swiglu", "geglu", "swiglu_oai"):
            raise UnsupportedError(f"CUDA: GLU op {op!r}")
        if rows <= 0 or n <= 0:
            return
        args = (_p(g), np.int64(sg), _p(u), np.int64(su), _p(y), np.int64(sy), np.int32(n))
        if op == "swiglu_oai":
            args += (np.float32(alpha), np.float32(limit))
        self._launch(f"{op}_f32", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    def binary(self, stream: Any, op: str, a: int, sa: int, b: int, sb: int, y: int, sy: int, rows: int, n: int) -> None:
        """y = a + b or a * b ("add", "mul") over rows of n; sb 0 broadcasts b's one row
        (elementwise.cu)."""
        if op not in ("add", "mul"):
            raise UnsupportedError(f"CUDA: binary op {op!r}")
        if rows <= 0 or n <= 0:
            return
        args = (_p(a), np.int64(sa), _p(b), np.int64(sb), _p(y), np.int64(sy), np.int32(n))
        self._launch(f"{op}_f32", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    def scale(self, stream: Any, a: int, sa: int, y: int, sy: int, rows: int, n: int, s: float) -> None:
        """y = a * s over rows of n (elementwise.cu)."""
        if rows <= 0 or n <= 0:
            return
        args = (_p(a), np.int64(sa), _p(y), np.int64(sy), np.int32(n), np.float32(s))
        self._launch("scale_f32", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    # -- GET_ROWS -------------------------------------------------------------------------------

    def get_rows(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_rows: int, ids: int, y: int,
                 sy: int, n_ids: int, n_in: int) -> None:
        """y[i] = float32 row ids[i] (int32) of a weight of `qtype` (rows of row_bytes, n_in
        elements, a multiple of 32): the type's decoder (get_rows_<type>)."""
        qtype = GGMLType(qtype)
        if qtype not in WEIGHT_SUFFIX:
            raise UnsupportedError(f"CUDA: GET_ROWS of {qtype.name}")
        if n_in % 32 or n_in % block_size(qtype)[0]:
            raise UnsupportedError(f"CUDA: GET_ROWS of {qtype.name} rows of {n_in}")
        if n_ids <= 0:
            return
        units = n_in // 32
        args = (_p(w), np.int64(row_bytes), np.int32(n_rows), _p(ids), _p(y), np.int64(sy), np.int32(n_ids),
                np.int32(units))  # fmt: skip
        grid = _cdiv(n_ids * units, ELEMENTWISE_THREADS)
        self._launch(f"get_rows_{WEIGHT_SUFFIX[qtype][1]}", (grid,), ELEMENTWISE_THREADS, args, stream)

    def get_rows_f32(self, stream: Any, t: int, st: int, n_rows: int, ids: int, y: int, sy: int, n_ids: int,
                     n: int) -> None:
        """y[i] = t[ids[i]] for float32 rows of n, st elements apart (getrows.cu)."""
        if n_ids <= 0 or n <= 0:
            return
        args = (_p(t), np.int64(st), np.int32(n_rows), _p(ids), _p(y), np.int64(sy), np.int32(n))
        self._launch("get_rows_f32_rows", (_cdiv(n, ELEMENTWISE_THREADS), n_ids), ELEMENTWISE_THREADS, args, stream)

    # -- ROPE and the cache store ---------------------------------------------------------------

    def rope(self, stream: Any, x: int, sxt: int, sxh: int, y: int, syt: int, syh: int, n_tokens: int, n_head: int,
             head_dim: int, *, pos: int = 0, n_dims: int = 0, mode: int = -1, freq_base: float = 10000.0,
             freq_scale: float = 1.0, factors: int = 0, cache_type: GGMLType | None = None, ids: int = 0,
             n_cells: int = 0, cache: int = 0, cache_rb: int = 0, rot: int = 0, yarn: int = 0) -> None:
        """ROPE of x (T, H, D) into y (may be x; 0: no float32 output) and/or SET_ROWS of the
        result into a KV cache (rope.cu).

        mode 0 (normal) or 2 (NeoX) rotate the first n_dims of each head at positions `pos`
        (int32), with `factors` (n_dims/2 float32 rope_freqs divisors, 0: none); mode -1 copies
        (a plain SET_ROWS: the V rows). `cache_type` F32/F16/Q8_0/Q4_0 stores row t at cell
        ids[t] (int64; n_cells rows of cache_rb bytes, head h at h*D elements), rotated first by
        Hadamard runs of `rot` (quantized caches, llama.cpp's attn_rot). None: no store. `yarn`:
        0, or the device address of YaRN's 5 float32 constants (`yarn_table`)."""
        if n_tokens <= 0 or n_head <= 0:
            return
        if mode not in (-1, 0, 2):
            raise UnsupportedError(f"CUDA: ROPE mode {mode}")
        if mode >= 0 and (n_dims <= 0 or n_dims % 2 or n_dims > head_dim or not pos):
            raise UnsupportedError(f"CUDA: ROPE of {n_dims} of {head_dim} dimensions")
        threads = min(ROPE_MAX_THREADS, _cdiv(head_dim, 32) * 32)
        if head_dim > 8 * threads:
            raise UnsupportedError(f"CUDA: ROPE of heads of {head_dim}")
        shared = 0
        if cache_type is None:
            name, ids, cache = "rope_set_rows_none", 0, 0
        else:
            ct = GGMLType(cache_type)
            if ct not in CACHE_SUFFIX:
                raise UnsupportedError(f"CUDA: a {ct.name} KV cache")
            name = f"rope_set_rows_{CACHE_SUFFIX[ct]}"
            if ct in _QUANT_CACHE:
                if head_dim % 32 or (rot and (rot & (rot - 1) or head_dim % rot)):
                    raise UnsupportedError(f"CUDA: a {ct.name} cache of heads of {head_dim} (rotation {rot})")
                shared = 4 * head_dim
            elif rot:
                raise UnsupportedError(f"CUDA: a rotated {ct.name} cache")
        rot_scale = float(hadamard_scale(rot)) if rot else 0.0
        ts = rope_theta_scale(freq_base, n_dims) if mode >= 0 else np.float32(0)
        args = (_p(x), np.int64(sxt), np.int64(sxh), _p(pos if mode >= 0 else 0), _p(y), np.int64(syt),
                np.int64(syh), np.int32(head_dim), np.int32(n_dims), np.int32(mode), np.float32(ts),
                np.float32(freq_scale), _p(factors if mode >= 0 else 0), _p(ids), np.int64(n_cells), _p(cache),
                np.int64(cache_rb), np.int32(rot), np.float32(rot_scale), _p(yarn if mode >= 0 else 0))  # fmt: skip
        self._launch(name, (n_tokens, n_head), threads, args, stream, shared)

    def rope_qkv(self, stream: Any, q: int, k: int, v: int, sxt: int, q_out: int, syt: int, n_tokens: int,
                 n_head: int, n_head_kv: int, head_dim: int, head_dim_v: int, *, pos: int, n_dims: int, mode: int,
                 freq_base: float, freq_scale: float = 1.0, factors: int = 0, ids: int, n_cells: int,
                 k_type: GGMLType, k_cache: int, k_rb: int, k_rot: int = 0, v_type: GGMLType, v_cache: int,
                 v_rb: int, v_rot: int = 0, yarn: int = 0) -> None:
        """A layer's ROPE of Q (into q_out, row stride syt), ROPE + store of K and store of V in
        one launch (rope.cu's rope_qkv): Q, K, V rows at q, k, v with row stride sxt (the column
        views of a fused QKV product), heads head_dim / head_dim / head_dim_v apart. The same
        results, bit for bit, as `rope` for Q, K and V in turn."""
        if n_tokens <= 0:
            return
        if mode not in (0, 2) or n_dims <= 0 or n_dims % 2 or n_dims > head_dim:
            raise UnsupportedError(f"CUDA: ROPE mode {mode} of {n_dims} of {head_dim} dimensions")
        kt, vt = GGMLType(k_type), GGMLType(v_type)
        shared = 0
        for ct, dd, rot in ((kt, head_dim, k_rot), (vt, head_dim_v, v_rot)):
            if ct not in CACHE_SUFFIX:
                raise UnsupportedError(f"CUDA: a {ct.name} KV cache")
            if ct in _QUANT_CACHE:
                if dd % 32 or (rot and (rot & (rot - 1) or dd % rot)):
                    raise UnsupportedError(f"CUDA: a {ct.name} cache of heads of {dd} (rotation {rot})")
                shared = max(shared, 4 * dd)
            elif rot:
                raise UnsupportedError(f"CUDA: a rotated {ct.name} cache")
        threads = min(ROPE_MAX_THREADS, _cdiv(max(head_dim, head_dim_v), 32) * 32)
        if max(head_dim, head_dim_v) > 8 * threads:
            raise UnsupportedError(f"CUDA: ROPE of heads of {max(head_dim, head_dim_v)}")
        krs = float(hadamard_scale(k_rot)) if k_rot else 0.0
        vrs = float(hadamard_scale(v_rot)) if v_rot else 0.0
        args = (_p(q), _p(k), _p(v), np.int64(sxt), _p(pos), _p(q_out), np.int64(syt), np.int32(n_head),
                np.int32(n_head_kv), np.int32(head_dim), np.int32(head_dim_v), np.int32(n_dims), np.int32(mode),
                np.float32(rope_theta_scale(freq_base, n_dims)), np.float32(freq_scale), _p(factors), _p(ids),
                np.int64(n_cells), _p(k_cache), np.int64(k_rb), np.int32(k_rot), np.float32(krs), _p(v_cache),
                np.int64(v_rb), np.int32(v_rot), np.float32(vrs), _p(yarn))  # fmt: skip
        name = f"rope_qkv_{CACHE_SUFFIX[kt]}_{CACHE_SUFFIX[vt]}"
        self._launch(name, (n_tokens, n_head + 2 * n_head_kv), threads, args, stream, shared)

    # -- FLASH_ATTN_EXT -------------------------------------------------------------------------

    def flash_attn_ext(self, stream: Any, q: int, sqt: int, sqh: int, k_type: GGMLType, k: int, k_cb: int,
                       k_hb: int, v_type: GGMLType, v: int, v_cb: int, v_hb: int, n_cells: int, mask: int, sm: int,
                       out: int, sot: int, soh: int, n_tokens: int, n_head: int, n_head_kv: int, head_dim: int,
                       head_dim_v: int, scale: float, *, n_kv: int = 0, n_kv_dev: int = 0, n_splits: int = 1,
                       scratch: int = 0, rot_k: int = 0, rot_v: int = 0, sinks: int = 0) -> None:
        """out (T, H, Dv) = softmax(q k^T * scale + mask) v over the first n_kv cells (fattn.cu).

        q (T, H, D) float32 (strides sqt, sqh); k, v: caches of k_type / v_type (F32, F16, Q8_0,
        Q4_0) with byte strides per cell (k_cb) and per KV head (k_hb), n_cells cells; mask
        float32 rows sm elements apart (0: compact rows of n_kv); n_kv from the int32 at
        `n_kv_dev` when given (a captured graph), else `n_kv`. n_splits > 1 splits the cells
        over blocks (`fattn_splits`) and needs `scratch`: fattn_scratch_floats(...) float32
        elements. rot_k / rot_v: the Hadamard orders of a rotated quantized cache (attn_rot).
        `sinks`: 0, or (H,) float32 logits, one a query head, joining each softmax (gpt-oss)."""
        if n_tokens <= 0 or n_head <= 0:
            return
        kt, vt = GGMLType(k_type), GGMLType(v_type)
        if kt not in CACHE_SUFFIX or vt not in CACHE_SUFFIX:
            raise UnsupportedError(f"CUDA: attention over {kt.name} / {vt.name}")
        if n_head % n_head_kv:
            raise UnsupportedError(f"CUDA: {n_head} query heads over {n_head_kv} KV heads")
        if head_dim > FA_MAX_D or head_dim_v > FA_MAX_D:
            raise UnsupportedError(f"CUDA: attention heads of {head_dim} / {head_dim_v} (at most {FA_MAX_D})")
        for t, d, r in ((kt, head_dim, rot_k), (vt, head_dim_v, rot_v)):
            if (t in _QUANT_CACHE and d % 32) or (r and (t not in _QUANT_CACHE or r & (r - 1) or d % r)):
                raise UnsupportedError(f"CUDA: attention over a {t.name} cache of heads of {d} (rotation {r})")
        if kt in _QUANT_CACHE and head_dim % 32:
            raise UnsupportedError(f"CUDA: Q8_0 rounding of Q of heads of {head_dim}")
        if n_tokens > FA_VEC_MAX_TOKENS and n_splits <= 1:  # a prompt: fattn_tile_*
            self._fattn_tile(stream, q, sqt, sqh, kt, k, k_cb, k_hb, vt, v, v_cb, v_hb, n_cells, mask, sm, out, sot, soh,
                             n_tokens, n_head, n_head_kv, head_dim, head_dim_v, scale, n_kv, n_kv_dev, rot_k, rot_v, sinks)
            return
        g = n_head // n_head_kv
        shared = 4 * (g * head_dim + g * FA_TILE + g * head_dim_v + 3 * g)
        if shared > SHARED_MAX:
            raise UnsupportedError(f"CUDA: attention of {g} query heads per KV head of {head_dim} needs "
                                   f"{shared} bytes of shared memory")  # fmt: skip
        n_splits = max(1, int(n_splits))
        if n_splits > 1 and not scratch:
            raise ValueError("a split attention needs its scratch buffer")
        rk = float(hadamard_scale(rot_k)) if rot_k else 0.0
        rv = float(hadamard_scale(rot_v)) if rot_v else 0.0
        args = (_p(q), np.int64(sqt), np.int64(sqh), _p(k), np.int64(k_cb), np.int64(k_hb), _p(v), np.int64(v_cb),
                np.int64(v_hb), np.int64(n_cells), _p(mask), np.int64(sm), np.int32(n_kv), _p(n_kv_dev), _p(out),
                np.int64(sot), np.int64(soh), _p(scratch), np.int32(n_head), np.int32(n_head_kv),
                np.int32(head_dim), np.int32(head_dim_v), np.float32(scale), np.int32(rot_k), np.float32(rk),
                np.int32(rot_v), np.float32(rv), _p(sinks))  # fmt: skip
        name = f"fattn_{CACHE_SUFFIX[kt]}_{CACHE_SUFFIX[vt]}"
        self._launch(name, (n_head_kv, n_tokens, n_splits), FA_THREADS, args, stream, shared)
        if n_splits > 1:
            cargs = (_p(scratch), np.int32(n_splits), np.int32(n_head), np.int32(head_dim_v), _p(out), np.int64(sot),
                     np.int64(soh), np.int32(rot_v), np.float32(rv), _p(sinks))  # fmt: skip
            self._launch("fattn_combine", (n_head, n_tokens), FA_THREADS, cargs, stream, 4 * head_dim_v)

    # -- MUL_MAT (decode) -----------------------------------------------------------------------

    def mul_mat_vec(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_out: int, n_in: int, x: int,
                    y: int, n_tok: int, *, b: int = 0) -> None:
        """y (n_tok, n_out) = x (n_tok, n_in, contiguous, 16-byte aligned) @ W.T for up to
        MMV_MAX_TOKENS tokens: the fused dequantize + matrix-vector kernel of `qtype` (a warp per
        row, common.cuh). `b`: a float32 bias of n_out added to every token's row as the
        product's epilogue (the bits of the product, then `binary` add)."""
        qtype = GGMLType(qtype)
        if qtype not in WEIGHT_SUFFIX:
            raise UnsupportedError(f"CUDA: MUL_MAT of {qtype.name}")
        if not 0 < n_tok <= MMV_MAX_TOKENS or n_in % 32 or n_in % block_size(qtype)[0] or x % 16:
            raise UnsupportedError(f"CUDA: {qtype.name} matrix-vector product of {n_tok} tokens of {n_in} (x at {x:#x})")
        args = (_p(w), _p(x), _p(y), np.int32(n_out), np.int32(n_in), np.int64(row_bytes), np.int32(n_tok), _p(b))
        grid = _cdiv(n_out, MMV_ROWS_PER_BLOCK)
        self._launch(f"mmv_{WEIGHT_SUFFIX[qtype][1]}", (grid,), 32 * MMV_ROWS_PER_BLOCK, args, stream)

    def mul_mat_vec_glu(self, stream: Any, op: str, qtype: GGMLType, w: int, row_bytes: int, n_ff: int, n_in: int,
                        x: int, y: int, n_tok: int) -> None:
        """y (n_tok, n_ff) = act(x @ W[:n_ff].T) * (x @ W[n_ff:].T): the stacked gate/up matrix
        (2 n_ff rows) with its GLU ("swiglu" or "geglu") as the product's epilogue (mmv_glu_<type>):
        one launch, the bits of `mul_mat_vec` and `glu`."""
        qtype = GGMLType(qtype)
        if op not in ("swiglu", "geglu"):
            raise UnsupportedError(f"CUDA: GLU op {op!r}")
        if qtype not in WEIGHT_SUFFIX:
            raise UnsupportedError(f"CUDA: MUL_MAT of {qtype.name}")
        if not 0 < n_tok <= MMV_MAX_TOKENS or n_in % 32 or n_in % block_size(qtype)[0] or x % 16:
            raise UnsupportedError(f"CUDA: {qtype.name} matrix-vector product of {n_tok} tokens of {n_in} (x at {x:#x})")
        args = (_p(w), _p(x), _p(y), np.int32(n_ff), np.int32(n_in), np.int64(row_bytes), np.int32(n_tok),
                np.int32(0 if op == "swiglu" else 1))  # fmt: skip
        grid = _cdiv(n_ff, MMV_ROWS_PER_BLOCK)
        self._launch(f"mmv_glu_{WEIGHT_SUFFIX[qtype][1]}", (grid,), 32 * MMV_ROWS_PER_BLOCK, args, stream)

    def quantize_q8_1(self, stream: Any, x: int, sx: int, xq: int, n_tok: int, n_in: int) -> None:
        """n_tok rows of n_in float32 (sx apart) -> their q8_1 copy at xq (q8_1_bytes, 16-byte
        aligned): mmvq.cu's quantize_q8_1, a thread a value."""
        if not 0 < n_tok * n_in < 2**31 or n_in % 32 or xq % 16:
            raise UnsupportedError(f"CUDA: q8_1 copy of {n_tok} rows of {n_in} (at {xq:#x})")
        args = (_p(x), np.int64(sx), _p(xq), _p(xq + n_tok * n_in), np.int32(n_in), np.int32(n_tok))
        self._launch("quantize_q8_1", (_cdiv(n_tok * n_in, ELEMENTWISE_THREADS),), ELEMENTWISE_THREADS, args, stream)

    def mul_mat_vec_q8(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_out: int, n_in: int, xq: int,
                       y: int, n_tok: int, glu: str = "", b: int = 0) -> None:
        """`mul_mat_vec` (with glu: `mul_mat_vec_glu`, n_out then the GLU's n_ff) on the q8_1 copy
        of x that `quantize_q8_1` wrote at xq: int8 dot products (mmvq.cu's mmvq_<type>). `b`: a
        float32 bias of n_out added to each sum (not with a GLU), as mul_mat_vec adds it."""
        qtype = GGMLType(qtype)
        if qtype not in MMVQ_SUFFIX:
            raise UnsupportedError(f"CUDA: int8 MUL_MAT of {qtype.name}")
        if glu not in ("", "swiglu", "geglu"):
            raise UnsupportedError(f"CUDA: GLU op {glu!r}")
        if not 0 < n_tok <= MMV_MAX_TOKENS or n_in % block_size(qtype)[0] or n_in % 32 or xq % 16:
            raise UnsupportedError(f"CUDA: {qtype.name} int8 matrix-vector product of {n_tok} tokens of {n_in}")
        args = (_p(w), _p(xq), _p(xq + n_tok * n_in), _p(y), np.int32(n_out), np.int32(n_in), np.int64(row_bytes),
                np.int32(n_tok))  # fmt: skip
        name = f"mmvq_{MMVQ_SUFFIX[qtype]}"
        if glu and b:
            raise UnsupportedError("CUDA: an int8 gate/up product with a bias")
        if glu:
            args, name = args + (np.int32(0 if glu == "swiglu" else 1),), f"mmvq_glu_{MMVQ_SUFFIX[qtype]}"
        else:
            args += (_p(b),)
        self._launch(name, (_cdiv(n_out, MMV_ROWS_PER_BLOCK),), 32 * MMV_ROWS_PER_BLOCK, args, stream)

    # -- MUL_MAT (prompts): f16 tensor cores through cuBLAS ---------------------------------------

    def to_f16(self, stream: Any, x: int, sx: int, y: int, rows: int, n: int, *, scale: int = 0) -> None:
        """y (rows, n) IEEE half, contiguous = float32 rows of x (sx elements apart), rounded to
        nearest even (elementwise.cu's cpy_f32_f16). `scale`: the address of the input's scale
        scratch (F16_SCALE_BYTES): y = x / s, s = 2^k the smallest k >= 0 with max|x| / s <=
        2^15, and the GEMM's alpha = s, beta = 0 written there (common.cuh's f16_input_scale)."""
        if rows <= 0 or n <= 0:
            return
        args = (_p(x), np.int64(sx), _p(y), np.int32(n), *self._f16_scale(stream, x, sx, 0, 1, rows, n, scale))
        self._launch("cpy_f32_f16", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    def _f16_scale(self, stream: Any, x: int, sxt: int, sxu: int, n_used: int, rows: int, n: int,
                   scale: int) -> tuple:
        """The first launch of an f16 GEMM input's scale (elementwise.cu's amax_f32: the partial
        maxima of |x| over its rows, row p at x + (p // n_used) * sxt + (p % n_used) * sxu, into
        the scratch after alpha and beta) and the convert launch's last arguments: the partials,
        their count and alpha's address (scale 0: no scale)."""
        if not scale:
            return _p(0), np.int32(0), _p(0)
        blocks = min(AMAX_BLOCKS, rows)
        args = (_p(x), np.int64(sxt), np.int64(sxu), np.int32(n_used), np.int32(rows), np.int32(n), _p(scale + 8))
        self._launch("amax_f32", (blocks,), ELEMENTWISE_THREADS, args, stream)
        return _p(scale + 8), np.int32(blocks), _p(scale)

    def dequant_f16(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_rows: int, n_in: int, y: int) -> None:
        """y (n_rows, n_in) IEEE half = the rows of a weight of `qtype`, decoded as get_rows
        decodes them and rounded to f16 (common.cuh's dequant_f16_<type>); y 16-byte aligned."""
        qtype = GGMLType(qtype)
        if qtype not in WEIGHT_SUFFIX:
            raise UnsupportedError(f"CUDA: MUL_MAT of {qtype.name}")
        if n_in % 32 or n_in % block_size(qtype)[0] or y % 16:
            raise UnsupportedError(f"CUDA: {qtype.name} rows of {n_in} to f16 (y at {y:#x})")
        units = n_rows * (n_in // 32)
        if units <= 0:
            return
        args = (_p(w), _p(y), np.int64(units), np.int32(n_in // 32), np.int64(row_bytes))
        self._launch(f"dequant_f16_{WEIGHT_SUFFIX[qtype][1]}", (_cdiv(units, ELEMENTWISE_THREADS),), ELEMENTWISE_THREADS,
                     args, stream)  # fmt: skip

    def gemm_f16(self, stream: Any, a: int, b: int, c: int, m: int, n: int, k: int, ldc: int,
                 batch: tuple[int, int, int, int] | None = None, *, ab: int = 0) -> None:
        """c[:n, :m] (float32 rows ldc apart) = alpha * b (n, k) @ a (m, k).T, a and b f16 rows:
        one GEMM on the tensor cores with float32 accumulation (`gemm`: cuBLAS's gemmEx on a
        device). `ab`: the device address of alpha and beta (float32: the f16 input's scale, read
        when the GEMM runs), 0: alpha 1, beta 0. `batch` (count, a's, b's and c's strides in
        elements): that many GEMMs in one call (gemmStridedBatchedEx)."""
        if self.gemm is None:
            raise UnsupportedError("CUDA: no GEMM launcher (cuBLAS) on this device")
        if m <= 0 or n <= 0 or (batch is not None and batch[0] <= 0):
            return
        launch = Launch("gemm_f16", self.gemm, (1,), 1, (a, b, c, m, n, k, ldc, ab, *(batch or ())), 0)
        if self._sink is not None:
            self._sink.append(launch)
        else:
            launch(stream)

    def mul_mat_gemm(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_out: int, n_in: int, x: int,
                     sx: int, y: int, n_tok: int, *, w16: int, x16: int, tile_rows: int, glu: str = "",
                     prod: int = 0, scale: int = 0, b: int = 0) -> None:
        """y (n_tok, n_out) = x (n_tok rows of n_in, sx apart) @ W.T for a prompt: x rounded to
        f16 once into x16 (divided by its power-of-two scale when `scale`, the scale's scratch,
        is given: `to_f16`; the GEMMs multiply by it), then per tile of `tile_rows` rows of W
        (gemm_tile_rows) the rows decoded to f16 into w16 and one GEMM into their columns of y.
        `glu` ("swiglu" / "geglu"): W stacks gate and up (n_out = 2 n_ff), the product goes to
        `prod` (n_tok, n_out) and y (n_tok, n_ff) = act(gate) * up (glu.cu). `b`: a float32 bias
        of n_out added to y's rows after the GEMMs (`binary` add in place: cuBLAS's beta would
        round alpha * sum + beta * b in one step, not as the ADD does)."""
        dst = prod if glu else y
        if glu and not prod:
            raise ValueError("a GEMM with its GLU needs the product's scratch")
        if glu and b:
            raise UnsupportedError("CUDA: a prompt's product with both a GLU and a bias")
        self.to_f16(stream, x, sx, x16, n_tok, n_in, scale=scale)
        for r0 in range(0, n_out, tile_rows):
            rows = min(tile_rows, n_out - r0)
            self.dequant_f16(stream, qtype, w + r0 * row_bytes, row_bytes, rows, n_in, w16)
            self.gemm_f16(stream, w16, x16, dst + 4 * r0, rows, n_tok, n_in, n_out, ab=scale)
        if b:
            self.binary(stream, "add", y, n_out, b, 0, y, n_out, n_tok, n_out)
        if glu:
            n_ff = n_out // 2
            self.glu(stream, glu, prod, n_out, prod + 4 * n_ff, n_out, y, n_ff, n_tok, n_ff)

    def _fattn_tile(self, stream: Any, q: int, sqt: int, sqh: int, kt: GGMLType, k: int, k_cb: int, k_hb: int,
                    vt: GGMLType, v: int, v_cb: int, v_hb: int, n_cells: int, mask: int, sm: int, out: int, sot: int,
                    soh: int, n_tokens: int, n_head: int, n_head_kv: int, head_dim: int, head_dim_v: int, scale: float,
                    n_kv: int, n_kv_dev: int, rot_k: int, rot_v: int, sinks: int = 0) -> None:
        """flash_attn_ext of a prompt: fattn.cu's fattn_tile_<k>_<v>, a block per (query head,
        FA_QT query rows), every head and row in one launch."""
        shared = 4 * (FA_QT * head_dim + FA_QT * FA_TILE + FA_QT * head_dim_v + 3 * FA_QT)
        if shared > SHARED_MAX:
            raise UnsupportedError(f"CUDA: prompt attention of heads of {head_dim} / {head_dim_v} needs {shared} "
                                   f"bytes of shared memory")  # fmt: skip
        rk = float(hadamard_scale(rot_k)) if rot_k else 0.0
        rv = float(hadamard_scale(rot_v)) if rot_v else 0.0
        args = (_p(q), np.int64(sqt), np.int64(sqh), _p(k), np.int64(k_cb), np.int64(k_hb), _p(v), np.int64(v_cb),
                np.int64(v_hb), np.int64(n_cells), _p(mask), np.int64(sm), np.int32(n_kv), _p(n_kv_dev), _p(out),
                np.int64(sot), np.int64(soh), np.int32(n_tokens), np.int32(n_head), np.int32(n_head_kv),
                np.int32(head_dim), np.int32(head_dim_v), np.float32(scale), np.int32(rot_k), np.float32(rk),
                np.int32(rot_v), np.float32(rv), _p(sinks))  # fmt: skip
        name = f"fattn_tile_{CACHE_SUFFIX[kt]}_{CACHE_SUFFIX[vt]}"
        self._launch(name, (n_head, _cdiv(n_tokens, FA_QT)), FA_THREADS, args, stream, shared)

    # -- the mixture-of-experts block (moe.cu, common.cuh's mmv_id) -----------------------------

    def mul_mat_id(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_expert: int, m: int, n_in: int,
                   x: int, sxt: int, sxu: int, ids: int, sid: int, y: int, n_tok: int, n_used: int, *, w2: int = 0,
                   glu: str = "swiglu", b: int = 0, b2: int = 0, sb: int = 0, alpha: float = 0.0,
                   limit: float = 0.0, q8_rows: int = 0) -> None:
        """MUL_MAT_ID for up to MMV_MAX_TOKENS tokens: y (n_tok, n_used, m) = for each token t and
        slot u, expert ids[t * sid + u] (int32, on the device) of the stacked matrix w (n_expert
        experts of m rows of row_bytes) times x's row t * sxt + u * sxu (float32 elements; sxu 0:
        one row a token), the fused dequantize + matrix-vector kernel of `qtype` (mmv_id_<type>):
        each chosen expert's rows read once for every pair that chose it. `w2`: the up experts
        (w the gate ones), y = glu(gate, up) ("swiglu" / "geglu" / "swiglu_oai" with `alpha` and
        `limit`) as the products' epilogue. `b` / `b2`: float32 bias rows of w's / w2's experts
        (n_expert rows sb apart: ADD_ID, gpt-oss), added to each sum before the GLU.
        `q8_rows` > 0: x is the q8_1 copy of q8_rows rows of n_in that `quantize_q8_1` wrote, sxt
        and sxu count its rows, and the products are int8 ones (mmvq.cu's mmvq_id_<type>, the
        sums of mul_mat_vec_q8)."""
        qtype = GGMLType(qtype)
        if qtype not in (MMVQ_SUFFIX if q8_rows else WEIGHT_SUFFIX):
            raise UnsupportedError(f"CUDA: {'int8 ' if q8_rows else ''}MUL_MAT_ID of {qtype.name}")
        if glu not in ("swiglu", "geglu", "swiglu_oai"):
            raise UnsupportedError(f"CUDA: GLU op {glu!r}")
        if (b or b2) and sb < m:
            raise UnsupportedError(f"CUDA: expert bias rows {sb} apart for {m} outputs")
        if not 0 < n_tok <= MMV_MAX_TOKENS or n_in % 32 or n_in % block_size(qtype)[0] or x % 16 \
                or (not q8_rows and (sxt % 4 or sxu % 4)):  # (float32 rows 16-byte aligned; a copy's always are)
            raise UnsupportedError(f"CUDA: {qtype.name} MUL_MAT_ID of {n_tok} tokens of {n_in} (x at {x:#x}, "
                                   f"strides {sxt}, {sxu})")  # fmt: skip
        last = (n_tok - 1) * sxt + (n_used - 1) * sxu  # the last pair's row (q8) or its offset (float32)
        if q8_rows and last >= q8_rows:
            raise UnsupportedError(f"CUDA: int8 MUL_MAT_ID reading row {last} of a q8_1 copy of {q8_rows}")
        if last + n_in >= 2**31:  # the kernel keeps 32-bit row offsets
            raise UnsupportedError(f"CUDA: MUL_MAT_ID input rows past 2^31 floats (strides {sxt}, {sxu})")
        if n_used <= 0 or m <= 0:
            return
        xs = (_p(x), _p(x + q8_rows * n_in)) if q8_rows else (_p(x),)  # (the copy's quants, then its scales)
        args = (_p(w), _p(w2), np.int64(m * row_bytes), np.int32(n_expert), *xs, np.int64(sxt), np.int64(sxu),
                _p(ids), np.int64(sid), _p(y), np.int32(m), np.int32(n_in), np.int64(row_bytes), np.int32(n_tok),
                np.int32(n_used), np.int32(("swiglu", "geglu", "swiglu_oai").index(glu)), _p(b), _p(b2 if w2 else 0),
                np.int64(sb), np.float32(alpha), np.float32(limit))  # fmt: skip
        grid = (_cdiv(m, MMV_ROWS_PER_BLOCK), n_tok * n_used)
        name = f"mmvq_id_{MMVQ_SUFFIX[qtype]}" if q8_rows else f"mmv_id_{WEIGHT_SUFFIX[qtype][1]}"
        self._launch(name, grid, 32 * MMV_ROWS_PER_BLOCK, args, stream)

    def mul_mat_id_gemm(self, stream: Any, qtype: GGMLType, w: int, row_bytes: int, n_expert: int, m: int, n_in: int,
                        x: int, sxt: int, sxu: int, ids: int, sid: int, y: int, n_tok: int, n_used: int, *, order: int,
                        x16: int, w16: int, prod: int, offs: np.ndarray | None = None, w2: int = 0, glu: str = "swiglu",
                        b: int = 0, b2: int = 0, sb: int = 0, alpha: float = 0.0, limit: float = 0.0,
                        scale: int = 0) -> np.ndarray:
        """MUL_MAT_ID of a prompt, mul_mat_id's product for any number of tokens on the tensor
        cores: the (token, slot) pairs grouped by expert (moe_sort into `order`, n_tok * n_used
        int32, then the n_expert + 2 offsets after them), the offsets read to the host — the one
        wait, skipped when `offs` (the last call's, same ids) is given —, the pairs' input rows
        gathered in that order and rounded to f16 into x16 (divided by their power-of-two scale
        when `scale`, its scratch, is given, as `to_f16`: the GEMMs multiply by it), the
        products into prod (the gate's sums, the up's after them with `w2`), and the rows
        scattered back to y (n_tok, n_used, m) with the biases and the GLU (moe_scatter,
        mmv_id's epilogue). The products: where the
        experts' rows padded to the largest count take at most twice the pairs' rows
        (`moe_pad`), the experts decoded to f16 a group at a time (`moe_group` of them in
        MOE_W16_BYTES) and one strided batched GEMM a group (a few launches a product whatever
        the number of experts); else, for each used expert, its rows decoded (gemm_tile_rows at
        a time) and one GEMM with its pairs' rows. Returns the offsets (for the next product of
        the same ids). Launches directly: the GEMMs' sizes are the routing's."""
        qtype = GGMLType(qtype)
        if qtype not in WEIGHT_SUFFIX:
            raise UnsupportedError(f"CUDA: MUL_MAT_ID of {qtype.name}")
        if glu not in ("swiglu", "geglu", "swiglu_oai") or ((b or b2) and sb < m):
            raise UnsupportedError(f"CUDA: a prompt's experts with {glu!r}, bias rows {sb} apart for {m}")
        if n_in % 32 or n_in % block_size(qtype)[0] or x16 % 16 or w16 % 16 or order % 4:
            raise UnsupportedError(f"CUDA: {qtype.name} MUL_MAT_ID of rows of {n_in} (scratch at {x16:#x}, {w16:#x})")
        if self.reader is None:
            raise UnsupportedError("CUDA: no device reader for a prompt's expert counts")
        n_pairs = n_tok * n_used
        if n_pairs <= 0 or m <= 0:
            return np.zeros(n_expert + 2, np.int32)
        offs_dev = order + 4 * n_pairs
        if offs is None:
            self.moe_sort(stream, ids, sid, n_tok, n_used, n_expert, order, offs_dev)
            offs = np.asarray(self.reader(stream, offs_dev, n_expert + 2))
        pad = moe_pad(offs, n_expert, n_pairs, m, n_in)
        rows = (offs_dev, pad)  # where each sorted row's GEMM row lies (moe.cu's moe_gemm_row)
        self.moe_gather_f16(stream, x, sxt, sxu, order, ids, sid, n_used, n_expert, rows, x16, n_pairs, n_in,
                            scale=scale)
        halves = [w] + ([w2] if w2 else [])
        ldp = m * len(halves)
        for h, wh in enumerate(halves):
            if pad:  # groups of experts, one batched GEMM each (the padding rows' results never read)
                g = moe_group(n_expert, m, n_in)
                for e0 in range(0, n_expert, g):
                    ne = min(g, n_expert - e0)
                    self.dequant_f16(stream, qtype, wh + e0 * m * row_bytes, row_bytes, ne * m, n_in, w16)
                    self.gemm_f16(stream, w16, x16 + 2 * e0 * pad * n_in, prod + 4 * (e0 * pad * ldp + h * m), m, pad,
                                  n_in, ldp, batch=(ne, m * n_in, pad * n_in, pad * ldp), ab=scale)  # fmt: skip
                continue
            tile = gemm_tile_rows(m, n_in)
            for e in range(n_expert):
                r0, n = int(offs[e]), int(offs[e + 1] - offs[e])
                for t0 in range(0, m if n else 0, tile):
                    rows_t = min(tile, m - t0)
                    self.dequant_f16(stream, qtype, wh + (e * m + t0) * row_bytes, row_bytes, rows_t, n_in, w16)
                    self.gemm_f16(stream, w16, x16 + 2 * r0 * n_in, prod + 4 * (r0 * ldp + h * m + t0), rows_t, n, n_in,
                                  ldp, ab=scale)  # fmt: skip
        op = ("swiglu", "geglu", "swiglu_oai").index(glu) if w2 else -1
        self.moe_scatter(stream, prod, ldp, order, ids, sid, n_used, n_expert, rows, y, m, n_pairs, op, b=b,
                         b2=b2 if w2 else 0, sb=sb, alpha=alpha, limit=limit)  # fmt: skip
        return offs

    def moe_sort(self, stream: Any, ids: int, sid: int, n_tok: int, n_used: int, n_expert: int, order: int,
                 offs: int) -> None:
        """The (token, slot) pairs of ids (int32 rows sid apart) grouped by expert (moe.cu): order
        (n_tok * n_used) the pairs in expert order, offs (n_expert + 2) each expert's first row."""
        args = (_p(ids), np.int64(sid), np.int32(n_tok), np.int32(n_used), np.int32(n_expert), _p(order), _p(offs))
        self._launch("moe_sort", (1,), ARGSORT_THREADS, args, stream)

    def moe_gather_f16(self, stream: Any, x: int, sxt: int, sxu: int, order: int, ids: int, sid: int, n_used: int,
                       n_expert: int, at: tuple[int, int], y: int, rows: int, n: int, *, scale: int = 0) -> None:
        """y (GEMM rows of n) f16 = the input rows of the pairs in `order` (x + t * sxt + u *
        sxu), each at its GEMM row: `at` (offsets, pad), pad 0: row r (moe.cu's moe_gemm_row);
        `scale`: as to_f16's, the max over every pair's row (sxu 0: the tokens' rows)."""
        if rows <= 0 or n <= 0:
            return
        u = n_used if sxu else 1
        sc = self._f16_scale(stream, x, sxt, sxu, u, rows // n_used * u, n, scale)
        args = (_p(x), np.int64(sxt), np.int64(sxu), _p(order), _p(ids), np.int64(sid), np.int32(n_used),
                np.int32(n_expert), _p(at[0]), np.int32(at[1]), _p(y), np.int32(n), *sc)  # fmt: skip
        self._launch("moe_gather_f16", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    def moe_scatter(self, stream: Any, prod: int, ldp: int, order: int, ids: int, sid: int, n_used: int, n_expert: int,
                    at: tuple[int, int], y: int, m: int, rows: int, op: int, *, b: int = 0, b2: int = 0, sb: int = 0,
                    alpha: float = 0.0, limit: float = 0.0) -> None:
        """y (pairs, m): sorted row r's GEMM row of prod (`at` as moe_gather_f16's) to pair
        order[r], + its expert's bias, then the GLU op (-1 none, 0 SwiGLU, 1 GEGLU, 2 swiglu_oai)
        of the gate and the up half (moe.cu)."""
        if rows <= 0 or m <= 0:
            return
        args = (_p(prod), np.int64(ldp), _p(order), _p(ids), np.int64(sid), np.int32(n_used), np.int32(n_expert),
                _p(at[0]), np.int32(at[1]), _p(y), np.int32(m), np.int32(op), _p(b), _p(b2), np.int64(sb),
                np.float32(alpha), np.float32(limit))  # fmt: skip
        self._launch("moe_scatter", (_cdiv(m, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    def soft_max(self, stream: Any, x: int, sx: int, y: int, sy: int, rows: int, n: int, scale: float) -> None:
        """y = softmax(x * scale) over rows of n, no mask (the router's probabilities)."""
        if rows <= 0 or n <= 0:
            return
        args = (_p(x), np.int64(sx), _p(y), np.int64(sy), np.int32(n), np.float32(scale))
        self._launch("soft_max_f32", (rows,), 32, args, stream)

    def argsort(self, stream: Any, x: int, sx: int, y: int, sy: int, rows: int, n: int) -> None:
        """y (int32) = the indices of each row of x in descending order, ties in index order."""
        if rows <= 0 or n <= 0:
            return
        args = (_p(x), np.int64(sx), _p(y), np.int64(sy), np.int32(n))
        self._launch("argsort_desc_f32", (rows,), ARGSORT_THREADS, args, stream)

    def get_rows_batched(self, stream: Any, t: int, sb: int, sr: int, n_rows: int, ids: int, sid: int, y: int,
                         batches: int, n_ids: int, n: int) -> None:
        """y (batches, n_ids, n) = rows ids[b * sid + i] (int32) of batch b of t (batch stride sb,
        row stride sr, n_rows rows of n float32): the router's weights of the chosen experts."""
        total = batches * n_ids * n
        if total <= 0:
            return
        args = (_p(t), np.int64(sb), np.int64(sr), np.int32(n_rows), _p(ids), np.int64(sid), _p(y), np.int32(batches),
                np.int32(n_ids), np.int32(n))  # fmt: skip
        self._launch("get_rows_batched_f32", (_cdiv(total, ELEMENTWISE_THREADS),), ELEMENTWISE_THREADS, args, stream)

    def sum_rows(self, stream: Any, x: int, sx: int, y: int, rows: int, n: int) -> None:
        """y (rows,) = each row of n summed in order in double, rounded to float32 once."""
        if rows <= 0:
            return
        args = (_p(x), np.int64(sx), _p(y), np.int32(rows), np.int32(n))
        self._launch("sum_rows_f32", (_cdiv(rows, ELEMENTWISE_THREADS),), ELEMENTWISE_THREADS, args, stream)

    def clamp(self, stream: Any, x: int, sx: int, y: int, rows: int, n: int, lo: float, hi: float) -> None:
        """y (contiguous rows of n) = min(max(x, lo), hi)."""
        if rows <= 0 or n <= 0:
            return
        args = (_p(x), np.int64(sx), _p(y), np.int32(n), np.float32(lo), np.float32(hi))
        self._launch("clamp_f32", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    def binary_row(self, stream: Any, op: str, a: int, sa: int, b: int, sb: int, y: int, sy: int, rows: int,
                   n: int) -> None:
        """y[r] = a[r] * b[r * sb] or a[r] / b[r * sb] ("mul", "div"): one value a row."""
        if op not in ("mul", "div"):
            raise UnsupportedError(f"CUDA: binary op {op!r} by one value a row")
        if rows <= 0 or n <= 0:
            return
        args = (_p(a), np.int64(sa), _p(b), np.int64(sb), _p(y), np.int64(sy), np.int32(n), np.int32(op == "div"))
        self._launch("binary_row_f32", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

    def router(self, stream: Any, x: int, sx: int, ids: int, w: int, rows: int, n: int, n_used: int, scale: float,
               lo: float, hi: float) -> None:
        """The router in one launch: ids (rows, n) int32 = ARGSORT(softmax(x * scale)) descending,
        w (rows, n_used) = the first n_used probabilities / clamp(their sum, lo, hi): the bits of
        soft_max, argsort, get_rows_batched, sum_rows, clamp and binary_row("div") in turn."""
        shared = _router_shared(n, n_used)
        if rows <= 0:
            return
        args = (_p(x), np.int64(sx), _p(ids), _p(w), np.int32(n), np.int32(n_used), np.float32(scale), np.float32(lo),
                np.float32(hi))  # fmt: skip
        self._launch("router_f32", (rows,), 32, args, stream, shared)

    def router_topk(self, stream: Any, x: int, sx: int, ids: int, w: int, rows: int, n: int, n_used: int,
                    scale: float) -> None:
        """gpt-oss's router in one launch: ids (rows, n) int32 = ARGSORT(x) descending, w (rows,
        n_used) = softmax(scale * the first n_used logits): the bits of argsort, get_rows_batched
        and soft_max in turn (moe.cu's router_topk_f32; ids and w may lie over x's rows of
        one token: each row is read before it is written)."""
        shared = _router_shared(n, n_used)
        if rows <= 0:
            return
        args = (_p(x), np.int64(sx), _p(ids), _p(w), np.int32(n), np.int32(n_used), np.float32(scale))
        self._launch("router_topk_f32", (rows,), 32, args, stream, shared)

    def add_id(self, stream: Any, a: int, sa: int, b: int, sb: int, n_expert: int, ids: int, sid: int, y: int,
               sy: int, rows: int, n: int, n_used: int) -> None:
        """ADD_ID: y[p] = a[p] + b[e] for the rows p of (token, slot) pairs (n float32 each, a's
        and y's rows sa / sy apart), e = ids[(p // n_used) * sid + p % n_used] (int32), b the
        n_expert bias rows sb apart (moe.cu's add_id_f32; gpt-oss's expert biases). y may be a."""
        if rows <= 0 or n <= 0:
            return
        if n_used <= 0 or rows % n_used:
            raise UnsupportedError(f"CUDA: ADD_ID of {rows} rows over {n_used} slots")
        args = (_p(a), np.int64(sa), _p(b), np.int64(sb), np.int32(n_expert), _p(ids), np.int64(sid), _p(y),
                np.int64(sy), np.int32(n), np.int32(n_used))  # fmt: skip
        self._launch("add_id_f32", (_cdiv(n, ELEMENTWISE_THREADS), rows), ELEMENTWISE_THREADS, args, stream)

def _router_shared(n: int, n_used: int) -> int:
    """The shared memory of the router kernels over n experts, n_used chosen (4 * (n + n_used)
    bytes), or UnsupportedError."""
    if not 0 < n_used <= n:
        raise UnsupportedError(f"CUDA: the top {n_used} of {n} experts")
    if 4 * (n + n_used) > SHARED_MAX:
        raise UnsupportedError(f"CUDA: a router over {n} experts")
    return 4 * (n + n_used)


MOE_W16_BYTES = 256 << 20  # a prompt's experts decoded to f16 at once, for one batched GEMM (moe_group)


def moe_group(n_expert: int, m: int, n_in: int) -> int:
    """Experts of m rows of n_in decoded to f16 together for one batched GEMM: as many as fit
    MOE_W16_BYTES (0: not one does; the GEMMs then go expert by expert, in tiles of rows)."""
    return min(n_expert, MOE_W16_BYTES // (2 * m * n_in))


def moe_pad(offs: np.ndarray, n_expert: int, n_pairs: int, m: int, n_in: int) -> int:
    """The rows each expert's block is padded to for the batched GEMMs (the largest count, a
    multiple of 8), or 0 — the GEMMs expert by expert — when the padded rows would be more than
    twice the pairs' (a routing that favours a few experts) or no expert fits the weight scratch."""
    counts = np.diff(np.asarray(offs[: n_expert + 1], np.int64))
    pad = -(-int(counts.max(initial=0)) // 8) * 8
    return pad if moe_group(n_expert, m, n_in) and 0 < n_expert * pad <= 2 * n_pairs else 0


def moe_scratch_bytes(n_tok: int, n_used: int, n_expert: int, m: int, n_in: int, glu: bool) -> tuple[int, int, int, int]:
    """The scratches of mul_mat_id_gemm: (the sort: order and offsets; the f16 input rows, twice
    the pairs' (the batched GEMMs' padding); the f16 weights: a group of experts or a tile of
    rows; the float32 products, twice the pairs' rows too), bytes."""
    n_pairs = n_tok * n_used
    w16 = max(moe_group(n_expert, m, n_in) * m, gemm_tile_rows(m, n_in)) * n_in * 2
    return 4 * (n_pairs + n_expert + 2), 4 * n_pairs * n_in, w16, 8 * n_pairs * m * (2 if glu else 1)


class DeviceReader:
    """reader(stream, addr, n) of CudaKernels on a device: n int32 of device memory copied into
    pinned memory on the stream, and waited for (a prompt's per-expert counts: one small read a
    MoE layer)."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.mem: Any = None
        self.buf = np.zeros(0, np.int32)

    def __call__(self, stream: Any, addr: int, n: int) -> np.ndarray:
        cp = self.cp
        if self.buf.size < n:
            self.mem = cp.cuda.alloc_pinned_memory(4 * n)
            self.buf = np.frombuffer(self.mem, np.int32, n)
        rt = cp.cuda.runtime
        rt.memcpyAsync(self.buf.ctypes.data, addr, 4 * n, rt.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()
        return self.buf[:n].copy()


class CublasGemm:
    """gemm_f16's launcher on a CUDA device: cuBLAS's gemmEx through CuPy (f16 A and B, float32 C,
    CUBLAS_COMPUTE_32F: tensor cores with float32 accumulation), called as a RawKernel is (a
    `Launch`'s fn) on the launch's stream. CuPy sets the handle's stream to its current one, so
    the call runs with the launch's stream current. Not capturable (CuPy refuses cuBLAS inside a
    stream capture): a plan with GEMMs launches directly."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.blas = cp.cuda.cublas
        self.handle = cp.cuda.device.get_cublas_handle()  # the current device's
        self._alpha_beta = np.array([1.0, 0.0], np.float32)  # host scalars (pointer mode host)
        rt = cp.cuda.runtime
        self.r16f, self.r32f = getattr(rt, "CUDA_R_16F", 2), getattr(rt, "CUDA_R_32F", 0)
        self.compute = getattr(self.blas, "CUBLAS_COMPUTE_32F", 68)
        self.algo = getattr(self.blas, "CUBLAS_GEMM_DEFAULT", -1)

    def __call__(self, grid: Any, block: Any, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        a, b, c, m, n, k, ldc, ab, *batch = (int(v) for v in args)
        blas = self.blas
        # alpha and beta: float32 words in device memory (the f16 input's scale, which its convert
        # launch writes on the stream before: pointer mode device, read when the GEMM runs), else
        # host ones (1, 0). The mode is the handle's: set for this call, then back to host, the
        # mode CuPy's own calls on this handle (cupy.matmul) assume.
        mode = blas.CUBLAS_POINTER_MODE_DEVICE if ab else blas.CUBLAS_POINTER_MODE_HOST
        ab = ab or self._alpha_beta.ctypes.data
        # row-major c (n, m) = b (n, k) @ a (m, k).T is column-major c^T (m, n) = op_T(a) @ b
        with stream if stream is not None else self.cp.cuda.Stream.null:
            blas.setPointerMode(self.handle, mode)
            try:
                if batch:  # (count, strides of a, b, c in elements)
                    count, sa, sb, sc = batch
                    blas.gemmStridedBatchedEx(self.handle, blas.CUBLAS_OP_T, blas.CUBLAS_OP_N, m, n, k, ab, a, self.r16f,
                                              k, sa, b, self.r16f, k, sb, ab + 4, c, self.r32f, ldc, sc, count,
                                              self.compute, self.algo)  # fmt: skip
                else:
                    blas.gemmEx(self.handle, blas.CUBLAS_OP_T, blas.CUBLAS_OP_N, m, n, k, ab, a, self.r16f, k, b,
                                self.r16f, k, ab + 4, c, self.r32f, ldc, self.compute, self.algo)  # fmt: skip
            finally:
                blas.setPointerMode(self.handle, blas.CUBLAS_POINTER_MODE_HOST)
