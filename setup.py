"""Builds the C kernels of the CPU backend when llamapy is installed (ggml-cpu's role).

Every `llamapy/backend/kernels_c/*.c` is compiled into one shared library per SIMD variant,
`llamapy/backend/_kernels/lp_<variant>.so`, which `backend/native.py` loads with ctypes, choosing
the best variant the running CPU has (ggml's GGML_CPU_ALL_VARIANTS / ggml_backend_load_best does
the same with its per-ISA backend libraries):

  portable  no -march flags (every x86-64, and ARM / other targets: plain C)
  avx2      x86-64 with AVX2, FMA and F16C
  avx512    x86-64 with AVX-512 F/BW/VL/DQ and VNNI (plus the AVX2 set)

with OpenMP when the compiler has it. A variant the compiler cannot build is skipped; when none
can be built (no C compiler at all) the install still succeeds with a warning and llamapy runs
its numpy reference kernels. The libraries are plain C (no Python API), so they are built as
setuptools Extensions only for setuptools' compiler discovery, incremental builds and its
editable/wheel plumbing; the file names carry no Python ABI tag.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
KDIR = Path("llamapy", "backend", "kernels_c")
PACKAGE = "llamapy.backend._kernels"

# -ffp-contract=off: the dequantization kernels must round like numpy (bit-exact tiles);
# kernels that want FMAs write them explicitly.
COMMON = ["-O3", "-g0", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden", "-Wno-psabi"]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
VARIANTS: dict[str, list[str]] = {
    "portable": [],
    "avx2": AVX2,
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", *AVX2],
}
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
OPENMP = ["-fopenmp"]


class build_kernels(build_ext):  # noqa: N801 - a setuptools command class
    """build_ext for plain C shared libraries: one build directory per variant (the same object
    names, different flags), OpenMP tried first, and a failure is a warning, never an error."""

    def get_ext_filename(self, fullname: str) -> str:
        # distutils asks with the last name component, setuptools with the full name
        *pkg, name = fullname.split(".")
        if name.startswith("lp_") and name[3:] in VARIANTS:
            return os.path.join(*pkg, name + ".so")
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self) -> None:
        # editable installs (and --inplace): the libraries go next to the sources
        os.makedirs(os.path.join(*PACKAGE.split(".")), exist_ok=True)
        super().copy_extensions_to_source()

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # no PyInit_*: loaded with ctypes, never imported

    def build_extension(self, ext: Extension) -> None:
        variant = ext.name.rsplit("_", 1)[-1]
        base_temp, base_args = self.build_temp, list(ext.extra_compile_args)
        error: Exception | None = None
        try:
            for omp in (OPENMP, []):
                self.build_temp = os.path.join(base_temp, variant + ("-omp" if omp else ""))
                ext.extra_compile_args, ext.extra_link_args = base_args + omp, list(omp)
                try:
                    super().build_extension(ext)
                    return
                except Exception as e:  # noqa: BLE001 - CompileError, LinkError, a missing compiler...
                    error = e
        finally:
            self.build_temp, ext.extra_compile_args = base_temp, base_args
        self.warn(f"llamapy: the {variant} CPU kernels were not built ({error}); "
                  "llamapy will use another variant or its numpy kernels")

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - e.g. no compiler configured at all
            self.warn(f"llamapy: the CPU kernels were not built ({e}); llamapy will use its numpy kernels")


def extensions() -> list[Extension]:
    if sys.platform == "win32" or os.environ.get("LLAMAPY_BUILD_KERNELS", "1") == "0":
        return []
    sources = sorted(str(p) for p in KDIR.glob("*.c"))
    headers = sorted(str(p) for p in KDIR.glob("*.h"))
    return [
        Extension(f"{PACKAGE}.lp_{name}", sources=sources, depends=headers, extra_compile_args=COMMON + flags,
                  libraries=["m"], optional=True)
        for name, flags in VARIANTS.items()
        if name == "portable" or X86
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": build_kernels})
