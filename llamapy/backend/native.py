"""The compiled C kernels of the CPU backend (ggml-cpu's C sources), built when llamapy is
installed, loaded with ctypes (ggml's per-ISA CPU backend variants and ggml_backend_load_best).

`setup.py` compiles every `kernels_c/*.c` into one shared library per SIMD variant,
`_kernels/lp_<variant>.so`: `portable` (plain C, any target), `avx2` (AVX2 + FMA + F16C) and
`avx512` (AVX-512 F/BW/VL/DQ + VNNI). `lib()` loads the best variant this CPU has (its
/proc/cpuinfo flags); LLAMAPY_KERNELS_VARIANT=portable|avx2|avx512 asks for one (tests force each
through `load(variant)`). Nothing is compiled at run time: without a built library (an install
without a C compiler) `lib()` is None, `error()` says why, and the CPU backend runs its numpy
kernels.

The only state is the loaded, immutable library handles (one per variant, loaded once);
threads are an argument of every call.
"""

from __future__ import annotations

import ctypes
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

KERNELS_DIR = Path(__file__).parent / "_kernels"
SRC_DIR = Path(__file__).parent / "kernels_c"
VARIANTS = ("avx512", "avx2", "portable")  # best first
# The CPU flags (as /proc/cpuinfo names them) each variant's build flags assume.
_AVX2 = frozenset({"avx2", "fma", "f16c"})
REQUIRES: dict[str, frozenset[str]] = {
    "portable": frozenset(),
    "avx2": _AVX2,
    "avx512": _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
# Exported functions and their argument types (see the C sources for their contracts).
_MV = [_P, _I64, _I64, _P, _I64, _P, _I64, _INT]  # parts, n_tiles, nb, x, n_tok, out, ld_out, n_threads
# lp_mvp_<t>: the same as a thread of a running team (lp_team.h; only the executor's records call it)
_MVP = [_P, _P, _I64, _I64, _P, _I64, _P, _I64]  # par, parts, n_tiles, nb, x, n_tok, out, ld_out
_DQT = [_P, _I64, _I64, _I64, _P, _I64, _INT]  # parts, t0, t1, nb, out_t, ld, n_threads
_DQR = [_P, _I64, _P, _I64, _P]  # parts, nb, ids, n, out
# q, T, H, D, k, v, N, Hkv, Dv, k_sn, k_sh, v_sn, v_sh, mask, mask_st, scale, out (+ lp_attend_q's kt, vt), n_threads
_ATT = [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, ctypes.c_float, _P]
_ATTEND = [*_ATT, _INT]
_VEC_DOT = [_INT, _P, _P, _P]  # n, s, vx, vy
REPACKED_TYPES = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
VEC_DOTS = ("f32", "f16", "bf16", "q4_0_q8_0", "q4_1_q8_1", "q5_0_q8_0", "q5_1_q8_1", "q8_0_q8_0")
# (name, argtypes, restype)
SIGNATURES: dict[str, tuple[list, Any]] = {
    **{f"lp_mv_{t}": (_MV, None) for t in REPACKED_TYPES},
    **{f"lp_mvp_{t}": (_MVP, None) for t in REPACKED_TYPES},
    **{f"lp_dqt_{t}": (_DQT, None) for t in REPACKED_TYPES},
    **{f"lp_dqr_{t}": (_DQR, None) for t in REPACKED_TYPES},
    "lp_rms_norm": ([_P, _I64, _I64, _I64, ctypes.c_double, _P], None),
    "lp_rope": ([_P, _I64, _I64, _I64, _P, _P, _I64, _INT, _P], None),
    "lp_attend": (_ATTEND, None),
    "lp_attend_f16": (_ATTEND, None),  # k, v: the f16 cache's bits
    # + K and V cache types (LP_KV_*: f32 f16 q8_0 q4_0) and the sinks (H,) or NULL
    "lp_attend_q": ([*_ATT, _INT, _INT, _P, _INT], None),
    # soft_max rows: x, rows, n, x stride, scale, out; argsort rows: x, rows, n, x stride, out (int32)
    "lp_soft_max_rows": ([_P, _I64, _I64, _I64, ctypes.c_float, _P], None),
    "lp_argsort_rows": ([_P, _I64, _I64, _I64, _P], None),
    "lp_swiglu": ([_P, _P, _I64, _I64, _I64, _I64, _P], None),
    "lp_swiglu_oai": ([_P, _P, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_float, _P], None),
    # quantized-activation MUL_MAT (lp_quants.h)
    "lp_quantize_row_q8_0": ([_P, _P, _I64], None),
    "lp_quantize_row_q8_1": ([_P, _P, _I64], None),
    **{f"lp_vec_dot_{t}": (_VEC_DOT, None) for t in VEC_DOTS},
    "lp_vec_dot_type": ([_INT], _INT),
    "lp_act_row_bytes": ([_INT, _I64], _I64),
    "lp_quantize_act": ([_INT, _P, _I64, _I64, _I64, _P, _INT], _INT),
    "lp_mul_mat_q": ([_INT, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _INT], _INT),
    # MUL_MAT_ID: type, w, n_expert, M, row bytes, n_in, xq, ux, ids, ids row stride, T, U, y, workspace
    # (NULL: allocated), threads; the workspace's bytes: type, n_expert, M, n_in, T, U
    "lp_mul_mat_id_q": ([_INT, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _P, _INT], _INT),
    "lp_mul_mat_id_q_wsp": ([_INT, _I64, _I64, _I64, _I64, _I64], _I64),
    "lp_mul_mat": ([_INT, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _INT], _INT),
    "lp_round_act": ([_INT, _P, _I64, _I64, _I64, _P, _I64, _INT], _INT),
}
# Kernels another source file provides once it is there (kquants.c): declared when present.
OPTIONAL: dict[str, tuple[list, Any]] = {
    "lp_quantize_row_q8_K": ([_P, _P, _I64], None),
    **{f"lp_vec_dot_q{k}_K_q8_K": (_VEC_DOT, None) for k in range(2, 7)},
    # iquants.c: the MoE models' types
    **{f"lp_vec_dot_{t}": (_VEC_DOT, None) for t in ("iq4_nl_q8_0", "mxfp4_q8_0", "iq4_xs_q8_K")},
    "lp_dequantize_rows": ([_INT, _P, _I64, _I64, _I64, _P, _I64], _INT),
}

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}  # variant -> loaded library (loaded once, never changed)
# (LLAMAPY_KERNELS, LLAMAPY_KERNELS_VARIANT) -> (library, variant, error): lib()'s answer, a pure
# function of those and of the install, worked out once
_resolved: dict[tuple[str | None, str | None], tuple[ctypes.CDLL | None, str | None, str | None]] = {}


def enabled() -> bool:
    """False when LLAMAPY_KERNELS=numpy asks for the numpy kernels only."""
    return os.environ.get("LLAMAPY_KERNELS", "").lower() != "numpy"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo's `flags`; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def path(variant: str) -> Path:
    return KERNELS_DIR / f"lp_{variant}.so"


def built() -> list[str]:
    """The variants the install built, best first."""
    return [v for v in VARIANTS if path(v).exists()]


def runnable(variant: str, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU has what `variant` was compiled for."""
    return REQUIRES[variant] <= (cpu_flags() if flags is None else flags)


def choose() -> str | None:
    """The variant `lib()` loads: LLAMAPY_KERNELS_VARIANT's, else the best built one this CPU runs."""
    want = os.environ.get("LLAMAPY_KERNELS_VARIANT", "").lower()
    if want:
        return want
    flags = cpu_flags()
    return next((v for v in built() if runnable(v, flags)), None)


def _open(variant: str) -> ctypes.CDLL:
    if variant not in VARIANTS:
        raise OSError(f"unknown kernel variant {variant!r} (LLAMAPY_KERNELS_VARIANT: {', '.join(VARIANTS)})")
    target = path(variant)
    if not target.exists():
        have = ", ".join(built()) or "none"
        raise OSError(f"the {variant} kernels were not built at install time (built: {have}; "
                      "reinstall llamapy with a C compiler)")
    if not runnable(variant):
        raise OSError(f"this CPU lacks what the {variant} kernels need ({' '.join(sorted(REQUIRES[variant]))})")
    # libgomp reads its settings when it loads, i.e. right here: spin 20000 rounds,
    # then sleep, between two parallel regions (a compiled split is one region, with the
    # kernels' own spinning barriers inside: kernels_c/team.c; each run_nodes kernel is one). Measured, default model, 2 cores,
    # -t 2, quiet / with one core busy in another process: libgomp's default spin 52-56 / 3 tok/s
    # (spinning threads starve the one that has work), passive 40-42 / 33, 1000 rounds
    # 47-51 / 28. 20000 rounds (Zen 5 host, SmolLM2 150 steps): the worker no longer sleeps
    # between two decode steps (47-65 context switches instead of 197-312; a sleeping vCPU's
    # wake-up is slow on a busy host), same speed quiet (3.5-3.9 vs 3.7 ms a step) and with a
    # core busy (15.7 vs 15.5 ms). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "20000")
    lib = ctypes.CDLL(str(target))
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)  # AttributeError: a library without this kernel
        fn.argtypes, fn.restype = argtypes, restype
    for name, (argtypes, restype) in OPTIONAL.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def load(variant: str) -> ctypes.CDLL:
    """The library of one variant (loaded once); OSError when it is not built or cannot run here."""
    lib = _libs.get(variant)
    if lib is None:
        with _lock:
            lib = _libs.get(variant)
            if lib is None:
                try:
                    lib = _libs[variant] = _open(variant)
                except AttributeError as e:
                    raise OSError(f"the {variant} kernels are out of date ({e}); reinstall llamapy") from e
    return lib


def lib() -> ctypes.CDLL | None:
    """The kernel library in use (`choose()`'s variant), or None when there is none. Resolved
    once per value of the two environment variables (called for every product)."""
    key = (os.environ.get("LLAMAPY_KERNELS"), os.environ.get("LLAMAPY_KERNELS_VARIANT"))
    hit = _resolved.get(key)
    if hit is None:
        hit = _resolved[key] = _resolve()
    return hit[0]


def _resolve() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(library, its variant, why there is none)."""
    if not enabled():
        return None, None, "LLAMAPY_KERNELS=numpy"
    v = choose()
    if v is None:
        return None, None, "no kernel library was built at install time (no C compiler?)"
    try:
        return load(v), v, None
    except OSError as e:
        return None, None, str(e)


def variant() -> str | None:
    """The variant `lib()` uses, None when it is None."""
    lib()
    return _resolved[(os.environ.get("LLAMAPY_KERNELS"), os.environ.get("LLAMAPY_KERNELS_VARIANT"))][1]


def error() -> str | None:
    """Why `lib()` is None (None when it loaded)."""
    lib()
    return _resolved[(os.environ.get("LLAMAPY_KERNELS"), os.environ.get("LLAMAPY_KERNELS_VARIANT"))][2]


_addressof = ctypes.addressof
_from_buffer = ctypes.c_char.from_buffer


def ptr(a: Any) -> int:
    """The address of an array's first element: ~0.8 us for a writable C-contiguous array
    (through the buffer protocol) against ~3 us for `a.ctypes.data`, which is the fallback
    (read-only or strided arrays). Decode makes ~1000 of these per token."""
    try:
        return _addressof(_from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def parts(arrays: tuple) -> ctypes.Array:
    """The `const void *const *parts` argument: pointers to a repacked matrix's arrays."""
    return (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
