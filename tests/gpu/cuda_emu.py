"""Run llamapy's CUDA kernels on the CPU: every kernels_cuda/ source compiled with g++ against
cuda_emu.h (fibers for threads, barriers for __syncthreads and the warp shuffles), wrapped as a
`cuda_ops.CudaKernels` whose functions launch there. The launch functions, their arguments and
the kernels' own code are the ones a GPU runs; what differs is the libm (expf, tanhf, cos, sin)
and that the blocks run one after another. For tests on machines without a GPU."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
CXX = shutil.which("g++")


def _emu_source(fname: str, names: tuple[str, ...]) -> str:
    from llamapy.backend.cuda import _module_source

    src = _module_source(fname)
    # dynamic shared memory: the launch's buffer; static shared arrays: one per block (blocks run
    # one at a time), i.e. function statics
    src = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;", r"\1* \2 = (\1*)lp_dyn_smem;", src)
    src = src.replace("__shared__", "static")
    calls = "".join(f'extern "C" void lp_call_{n}(const uint64_t* a) {{ lp_invoke(&{n}, a); }}\n'
                    f'extern "C" const char* lp_sig_{n}() {{ return lp_kinds(&{n}); }}\n' for n in names)
    return src + "\n" + calls


class EmuKernel:
    """One entry point, called as CuPy's RawKernel is: fn(grid, block, args, shared_mem=, stream=)."""

    def __init__(self, lib: ctypes.CDLL, name: str) -> None:
        self.name = name
        self.lib = lib
        self.call = getattr(lib, f"lp_call_{name}")
        sig = getattr(lib, f"lp_sig_{name}")
        sig.restype = ctypes.c_char_p
        self.signature: str = sig().decode()  # one letter a parameter (cuda_emu.h's lp_kind)

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        slots = np.zeros(max(1, len(args)), np.uint64)
        for i, a in enumerate(args):
            if isinstance(a, np.float32):
                slots[i] = int(np.array(a).view(np.uint32))
            elif isinstance(a, (np.int32, np.int64, np.uint64)):
                slots[i] = int(a) & 0xFFFFFFFFFFFFFFFF
            else:
                raise TypeError(f"{self.name}: argument {i} is a {type(a).__name__}")
        g = tuple(grid) + (1,) * (3 - len(grid))
        bad = ctypes.c_int(-1)
        rc = self.lib.lp_emu_launch(
            ctypes.cast(self.call, ctypes.c_void_p), slots.ctypes.data_as(ctypes.c_void_p), g[0], g[1], g[2], block[0],
            ctypes.c_ulonglong(shared_mem), ctypes.byref(bad),
        )  # fmt: skip
        if rc == -2:
            raise RuntimeError(f"{self.name}: a load misaligned for its width (it would fault on a GPU)")
        if rc != 0:
            raise RuntimeError(f"{self.name}: block {bad.value} is stuck at a barrier (divergent __syncthreads or shuffle)")


def compile_file(fname: str, out_dir: Path, options: tuple[str, ...] | None = None) -> dict[str, EmuKernel]:
    """The entry points of one kernels_cuda/ source (cuda_ops.ENTRIES[fname]), compiled for the
    CPU (g++, C++20) with NVRTC's `-D` options (cuda_ops.NVRTC_OPTIONS unless given)."""
    from llamapy.backend.cuda_ops import ENTRIES, NVRTC_OPTIONS

    if CXX is None:
        raise RuntimeError("g++ not found")
    names = ENTRIES[fname]
    opts = tuple(NVRTC_OPTIONS if options is None else options)
    if any(not o.startswith("-D") for o in opts):
        raise NotImplementedError(f"the CUDA emulator takes only -D options, not {opts}")
    tag = zlib.crc32(" ".join(opts).encode())
    cpp = out_dir / f"{Path(fname).stem}_{tag}.cpp"
    so = out_dir / f"{Path(fname).stem}_{tag}.so"
    cpp.write_text(_emu_source(fname, names))
    cmd = [CXX, "-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-w",
           "-DLP_EMU_IMPL", "-include", str(HERE / "cuda_emu.h"), *opts, "-o", str(so), str(cpp)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{fname}: {r.stderr[:2000]}")
    lib = ctypes.CDLL(str(so))
    lib.lp_emu_launch.restype = ctypes.c_int
    lib.lp_emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                  ctypes.c_uint, ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    return {n: EmuKernel(lib, n) for n in names}


def build(out_dir: Path | None = None) -> dict[str, EmuKernel]:
    """Every entry point of cuda_ops.ENTRIES, compiled for the CPU (g++, C++20)."""
    from llamapy.backend.cuda_ops import ENTRIES

    d = out_dir or Path(tempfile.mkdtemp(prefix="lp_cuda_emu_"))
    functions: dict[str, EmuKernel] = {}
    for fname in ENTRIES:
        functions.update(compile_file(fname, d))
    return functions


def numpy_gemm(grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
    """cuda_ops.CublasGemm's stand-in on the emulator (no cuBLAS on the CPU): c[:n, :m] (float32
    rows ldc apart) = alpha * b (n, k) @ a (m, k).T over f16 rows, summed exactly (float64) and
    rounded once: what a tensor-core GEMM with float32 accumulation computes within its summation
    order. alpha and beta: the two float32 at `ab` (device memory, read now: when it runs), ab 0:
    1 and 0; beta 0 reads nothing of c (as cuBLAS). Four more arguments (count, strides of a, b, c
    in elements): that many (gemmStridedBatchedEx)."""
    a, b, c, m, n, k, ldc, ab, *batch = (int(v) for v in args)
    if batch:
        count, sa, sb, sc = batch
        for i in range(count):
            numpy_gemm(grid, block, (a + 2 * i * sa, b + 2 * i * sb, c + 4 * i * sc, m, n, k, ldc, ab))
        return

    def at(addr: int, shape: tuple[int, int], ld: int, dt: Any) -> np.ndarray:
        d = np.dtype(dt)
        buf = (ctypes.c_char * (((shape[0] - 1) * ld + shape[1]) * d.itemsize)).from_address(addr)
        return np.ndarray(shape, d, buffer=buf, strides=(ld * d.itemsize, d.itemsize))

    alpha, beta = (float(v) for v in at(ab, (1, 2), 2, np.float32)[0]) if ab else (1.0, 0.0)
    A, B = at(a, (m, k), k, np.float16).astype(np.float64), at(b, (n, k), k, np.float16).astype(np.float64)
    C = at(c, (n, m), ldc, np.float32)
    prod = alpha * (B @ A.T)
    C[...] = (prod + beta * C.astype(np.float64) if beta else prod).astype(np.float32)


def numpy_read(stream: Any, addr: int, n: int) -> np.ndarray:
    """cuda_ops.DeviceReader's stand-in: n int32 at a host address (the emulator's device memory)."""
    return np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(addr)).copy()
