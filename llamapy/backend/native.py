"""Compiled C kernels for the CPU backend (the role of ggml-cpu's C sources), built on first use.

The hot CPU kernels (quantized matvec and tile expansion on the repacked layouts, rms_norm,
rope, decode attention, swiglu) live in `kernels_c/*.c`. The first process that needs them
compiles them with the system C compiler (`$CC`, else cc/gcc/clang; -O3 -march=native, OpenMP
when the compiler has it) into one shared library under $LLAMAPY_CACHE/native, keyed by the
sources, the flags and the CPU; later processes just load that file with ctypes, as CUDA kernels
are compiled once by NVRTC and cached.

Why not numba for these: numba's runtime is LLVM, which alone adds ~130 MiB to the resident set
of every run (libllvmlite's pages, the JIT and numba's type system) - more than the model's
weights; the gcc-built library is 75 KB. numba stays the fallback when no compiler is found,
and numpy the one after that (`qmatmul.kernels()`). LLAMAPY_NATIVE=0 switches this path off.
The cache directory is trusted like numba's cache or site-packages: whoever can write there
can run code in llamapy.

`lib()` never raises: a missing compiler or a failed build returns None and `error()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..types import cache_dir as _cache_root

SRC_DIR = Path(__file__).parent / "kernels_c"
# -ffp-contract=off: the dequantization kernels must round like numpy (bit-exact tiles);
# kernels that want FMAs call fmaf explicitly.
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]
OPENMP = ["-fopenmp"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
# Exported functions and their argument types (see the C sources for their contracts).
_MV = [_P, _I64, _I64, _P, _I64, _P, _I64, _INT]  # parts, n_tiles, nb, x, n_tok, out, ld_out, n_threads
_DQT = [_P, _I64, _I64, _I64, _P, _I64, _INT]  # parts, t0, t1, nb, out_t, ld, n_threads
_DQR = [_P, _I64, _P, _I64, _P]  # parts, nb, ids, n, out
# q, T, H, D, k, v, N, Hkv, Dv, k_sn, k_sh, v_sn, v_sh, mask, mask_st, scale, out
_ATTEND = [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, ctypes.c_float, _P]
REPACKED_TYPES = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
SIGNATURES: dict[str, list] = {
    **{f"lp_mv_{t}": _MV for t in REPACKED_TYPES},
    **{f"lp_dqt_{t}": _DQT for t in REPACKED_TYPES},
    **{f"lp_dqr_{t}": _DQR for t in REPACKED_TYPES},
    "lp_rms_norm": [_P, _I64, _I64, _I64, ctypes.c_double, _P],
    "lp_rope": [_P, _I64, _I64, _I64, _P, _P, _I64, _INT, _P],
    "lp_attend": _ATTEND,
    "lp_attend_f16": _ATTEND,  # k, v: the f16 cache's bits
    "lp_attend_q": [*_ATTEND, _INT, _INT],  # + K and V cache types (LP_KV_*: f32 f16 q8_0 q4_0)
    "lp_attend_set_threads": [_INT],
    "lp_swiglu": [_P, _P, _I64, _I64, _I64, _I64, _P],
}

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("LLAMAPY_NATIVE", "1").lower() not in ("0", "off", "no")


def cache_dir() -> Path:
    return _cache_root() / "native"


def compiler() -> str | None:
    """The C compiler: $CC, else the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_id() -> str:
    # -march=native: a library built on one CPU may not run on another sharing the cache.
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _sources() -> list[Path]:
    return sorted(SRC_DIR.glob("*.c"))


def _key(cc: str) -> str:
    h = hashlib.sha256()
    for p in sorted(SRC_DIR.glob("*.[ch]")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(" ".join([cc, *CFLAGS, *OPENMP, _cpu_id(), platform.python_implementation()]).encode())
    return h.hexdigest()[:24]


def _build(cc: str, target: Path) -> None:
    """Compile the sources into `target` (atomically: a temporary name, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    srcs = [str(p) for p in _sources()]
    errors = []
    try:
        # OpenMP first; a compiler without it still builds the single-threaded kernels.
        for extra in (OPENMP, []):
            cmd = [cc, *CFLAGS, *extra, "-o", tmp, *srcs, "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                os.replace(tmp, target)
                return
            errors.append(r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"])
        raise OSError(f"{os.path.basename(cc)} failed: {errors[-1][0]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _target(cc: str) -> Path:
    return cache_dir() / f"llamapy-cpu-{_key(cc)}.so"


def needs_build() -> bool:
    """Whether the next `lib()` will compile the kernels first (a few seconds, once)."""
    if "lib" in _state or not enabled() or not _sources():
        return False
    cc = compiler()
    return cc is not None and not _target(cc).exists()


def _load() -> ctypes.CDLL:
    if not enabled():
        raise OSError("disabled by LLAMAPY_NATIVE=0")
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC)")
    if not _sources():
        raise OSError(f"no C sources in {SRC_DIR}")
    target = _target(cc)
    if not target.exists():
        _build(cc, target)
    # libgomp reads its settings when it loads, i.e. right here: spin ~1000 rounds (tens of us,
    # the gap between two matmuls of a decode step), then sleep. Measured, default model, 2 cores,
    # -t 2, quiet / with one core busy in another process: libgomp's default spin 52-56 / 3 tok/s
    # (spinning threads starve the one that has work), passive 40-42 / 33, 1000 rounds
    # 47-51 / 28. A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    lib = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)  # AttributeError: a source without this kernel
        fn.argtypes = argtypes
        fn.restype = None
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first use), or None when it cannot be had."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _load()
                except (OSError, AttributeError, subprocess.SubprocessError) as e:
                    _state["lib"], _state["error"] = None, str(e)
    return _state["lib"]  # type: ignore[return-value]


def error() -> str | None:
    """Why `lib()` is None (None when it loaded or was not tried yet)."""
    return _state.get("error")  # type: ignore[return-value]


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
