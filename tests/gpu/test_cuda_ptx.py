"""Checks of the CUDA backend that need no GPU: every kernel source compiles to PTX with nvcc, no
kernel uses local memory and each stays within its registers (ptxas's report for sm_90), the
decoders (built for the CPU) match gguf-py bit for bit, and the module imports and reports why it
cannot load when CuPy is missing."""

from __future__ import annotations

import collections
import ctypes
import shutil
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "llamapy" / "backend" / "kernels_cuda"
SOURCES = sorted(KDIR.glob("*.cu"))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def test_sources_exist() -> None:
    from llamapy.backend.cuda_ops import ENTRIES

    names = {p.name for p in SOURCES}
    assert {"floats.cu", "legacy.cu", "kquants.cu", "iquants.cu", "norm.cu", "glu.cu", "elementwise.cu", "getrows.cu",
            "rope.cu", "fattn.cu"} <= names  # fmt: skip
    assert set(ENTRIES) == names, "every .cu is loaded by cuda_ops (and nothing else is)"
    assert (KDIR / "common.cuh").is_file()


_CUBIN: dict[str, tuple[bool, str]] = {}


def cubin_of(src: Path) -> tuple[bool, str]:
    """Whether nvcc made a cubin of one source for sm_90, and its stderr: warnings, and ptxas's
    resource report (-Xptxas -v: each kernel's registers, stack frame, spills). Once a session."""
    if src.name not in _CUBIN:
        out = Path(tempfile.mkdtemp(prefix="lp_cubin_")) / (src.stem + ".cubin")
        r = subprocess.run(
            [NVCC, "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-I", str(KDIR), "-o", str(out), str(src)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        _CUBIN[src.name] = (r.returncode == 0 and out.is_file() and out.stat().st_size > 0, r.stderr)
    return _CUBIN[src.name]


@needs_nvcc
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_cubin_compiles(src: Path) -> None:
    """Every kernel source compiles to machine code for the H200 (sm_90), warnings shown."""
    ok, err = cubin_of(src)
    assert ok, err
    assert "warning" not in err.lower(), err


# What ptxas may give each kernel. An SM has 65536 32-bit registers: a kernel of R registers a
# thread (allocated in steps of 8) fits 65536 // (32 * R) warps an SM (64 at most), in whole
# blocks. Local memory (a stack frame: arrays indexed at run time, spills) is off-chip, read
# through L1: none is allowed on the decode path, nor in any other kernel today. Bounds are per
# family, the first pattern that matches a kernel's name; the counts ptxas reached (nvcc 13.0,
# sm_90) are in the comments. A bound is the occupancy step a family's launch bounds hold it to
# (ptxas then spills rather than pass it: the spill check is what fails), or leaves headroom below
# the next step down.
REG_BOUNDS: list[tuple[str, int]] = [
    # matrix-vector products, 256 threads (8 warps) a block. mmv_ and mmv_glu_ are built for 3
    # blocks (24 warps) an SM: 80 registers (common.cuh's launch bounds; they reach 72-80 without
    # spilling), but mmv_glu_f32 (2 blocks: 90). mmv_id_ reaches 70-96 (its pairs' offsets and
    # the GLU / bias epilogue; 80 spills): at most 128 keeps 2 blocks (16 warps).
    # mmvq_id_ (int8, 3 blocks: 80) reaches 68-80.
    (r"mmv_glu_f32$", 128),
    (r"mmv_id_", 112),
    (r"mmvq_id_", 80),
    (r"mmv_", 80),
    # attention, 128 threads (4 warps) a block: at most 64 keeps 8 blocks (32 warps) an SM; the
    # decode kernels reach 32-56, the prompt kernels (fattn_tile_, bound to 8 blocks an SM, i.e.
    # 64 registers) 46-56, the combine 32.
    (r"fattn_", 64),
    # ROPE fused with the KV store, 256 threads: 39-64 (the Q8_0 / Q4_0 quantizers); at most 80
    # keeps 3 blocks (24 warps) an SM.
    (r"rope_", 80),
    # everything else a step launches (norms, GLU, elementwise, GET_ROWS, the router, the MoE
    # gather / scatter, softmax, argsort) and the dequantizers: 10-40; at most 64 keeps 32 warps.
    (r"", 64),
]
# Stack frames allowed: CUDA's double-precision cos/sin (rope.cu's angles) carry a 40-byte array
# for their slow path (Payne-Hanek reduction, taken only for |angle| >= 2^31 radians: positions
# past 2^31), in a subroutine the fast path never calls; nothing of it is touched otherwise.
STACK_BOUNDS: list[tuple[str, int]] = [(r"rope_", 40), (r"", 0)]


def ptxas_resources(report: str) -> dict[str, tuple[int, int, int, int]]:
    """entry point -> (registers, stack frame bytes, spill store bytes, spill load bytes), from
    ptxas -v's report."""
    out = {}
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function )", report):
        m = re.match(r"ptxas info\s*: Compiling entry function '(\w+)'", block)
        if not m:
            continue
        name = m.group(1)
        props = re.search(rf"Function properties for {name}\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          rf"(\d+) bytes spill loads", block)  # fmt: skip
        regs = re.search(r"Used (\d+) registers", block)
        assert props and regs, f"ptxas -v reported no resources for {name}:\n{block}"
        out[name] = (int(regs.group(1)), *(int(g) for g in props.groups()))
    return out


def _bound(bounds: list[tuple[str, int]], name: str) -> int:
    return next(b for pat, b in bounds if re.match(pat, name))


@needs_nvcc
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_kernels_use_no_local_memory(src: Path) -> None:
    """Every kernel cuda_ops loads from a source (all the decode step's: the products, attention,
    ROPE + KV store, norms, GLU, the router, ...) compiles for sm_90 with no spills, no stack frame
    (but rope's, above), and at most its family's registers (REG_BOUNDS)."""
    from llamapy.backend.cuda_ops import ENTRIES

    ok, err = cubin_of(src)
    assert ok, err
    res = ptxas_resources(err)
    missing = [n for n in ENTRIES[src.name] if n not in res]
    assert not missing, f"ptxas -v reported nothing for {missing}"
    bad = []
    for name in ENTRIES[src.name]:
        regs, stack, st, ld = res[name]
        rb, sb = _bound(REG_BOUNDS, name), _bound(STACK_BOUNDS, name)
        if st or ld or stack > sb or regs > rb:
            bad.append(f"{name}: {regs} registers (bound {rb}), {stack} bytes stack frame (bound {sb}), "
                       f"{st} / {ld} bytes spill stores / loads")  # fmt: skip
    assert not bad, f"{src.name}:\n" + "\n".join(bad)


_PTX: dict[str, str] = {}


def ptx_of(src: Path) -> str:
    """The PTX of one source (compiled once per test session)."""
    if src.name not in _PTX:
        out = Path(tempfile.mkdtemp(prefix="lp_ptx_")) / (src.stem + ".ptx")
        r = subprocess.run(
            [NVCC, "-ptx", "-arch=sm_90", "-I", str(KDIR), "-o", str(out), str(src)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        _PTX[src.name] = out.read_text()
    return _PTX[src.name]


def ptx_params(ptx: str) -> dict[str, list[str]]:
    """entry name -> its parameters' PTX types (u64, u32, f32, ...), in order."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        out[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return out


@needs_nvcc
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_ptx_entry_points(src: Path) -> None:
    """Every entry point cuda_ops loads from a source is in its PTX."""
    from llamapy.backend.cuda_ops import ENTRIES

    entries = ptx_params(ptx_of(src))
    missing = [n for n in ENTRIES[src.name] if n not in entries]
    assert not missing, f"{src.name} lacks {missing}"


def _nvrtc() -> ctypes.CDLL | None:
    """libnvrtc as CuPy loads it (a CUDA toolkit's, or the nvidia-cuda-nvrtc wheel's), if any."""
    import ctypes.util
    import glob
    import site

    cands = [ctypes.util.find_library("nvrtc") or "", *sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"))]
    for sp in site.getsitepackages():
        cands += sorted(glob.glob(f"{sp}/nvidia/cu*/lib/libnvrtc.so*")) + sorted(glob.glob(f"{sp}/nvidia/cuda_nvrtc/lib/libnvrtc.so*"))
    for c in cands:
        if c and "alt" not in Path(c).name and "builtins" not in Path(c).name:
            try:
                # NVRTC dlopens its builtins library by name: load it first from the same folder
                for b in sorted(Path(c).parent.glob("libnvrtc-builtins.so*")):
                    if "alt" not in b.name:
                        ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(c)
            except OSError:
                continue
    return None


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvrtc_compiles(src: Path) -> None:
    """What the GPU host compiles: the source CuPy's RawModule gets (common.cuh inlined), with
    NVRTC and the options CuPy (NVRTC 12+) adds, to PTX holding every entry point cuda_ops loads."""
    from llamapy.backend.cuda import _module_source
    from llamapy.backend.cuda_ops import ENTRIES, NVRTC_OPTIONS

    lib = _nvrtc()
    if lib is None:
        pytest.skip("no libnvrtc (CUDA toolkit or nvidia-cuda-nvrtc wheel)")
    code = _module_source(src.name).encode()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code, b"kern.cu", 0, None, None) == 0
    opts = [o.encode() for o in (*NVRTC_OPTIONS, "--device-as-default-execution-space", "-arch=compute_90")]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, log)
    try:
        assert rc == 0, f"NVRTC: {log.value.decode(errors='replace')[:3000]}"
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetPTX(prog, ptx)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    entries = ptx_params(ptx.value.decode())
    missing = [n for n in ENTRIES[src.name] if n not in entries]
    assert not missing, f"{src.name} lacks {missing}"


_PTX_CLASS = {"u64": 8, "s64": 8, "b64": 8, "u32": 4, "s32": 4, "b32": 4, "f32": "f", "f64": "d"}


def _arg_class(a: object) -> object:
    if isinstance(a, np.float32):
        return "f"
    if isinstance(a, (np.uint64, np.int64)):
        return 8
    if isinstance(a, np.int32):
        return 4
    return type(a).__name__  # anything else (a Python int: its size is CuPy's guess) is wrong


def record_launches() -> list[tuple]:
    """Every launch function of cuda_ops, with a launcher that records instead of launching."""
    from llamapy.backend.cuda_ops import ENTRIES, CudaKernels, fattn_scratch_floats, fattn_splits
    from llamapy.types import GGMLType as G

    calls: list[tuple] = []

    def recorder(name: str):  # noqa: ANN202
        def launch(grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: object = None) -> None:
            calls.append((name, grid, block, args, shared_mem, stream))

        return launch

    k = CudaKernels({n: recorder(n) for names in ENTRIES.values() for n in names}, n_sm=132)
    st = object()
    k.rms_norm(st, 0x1000, 576, 0x2000, 576, 3, 576, 1e-5)
    k.rms_norm(st, 0x1000, 576, 0x2000, 576, 3, 576, 1e-5, b=0x3000, sb=576, sum_out=0x4000, ss=576, w=0x5000)
    for op in ("swiglu", "geglu"):
        k.glu(st, op, 0x1000, 3072, 0x1000 + 6144, 3072, 0x2000, 1536, 2, 1536)
    k.glu(st, "swiglu_oai", 0x1000, 3072, 0x1000 + 6144, 3072, 0x2000, 1536, 2, 1536, alpha=1.702, limit=7.0)
    k.add_id(st, 0x1000, 2880, 0x2000, 2880, 32, 0x3000, 4, 0x4000, 2880, 8, 2880, 4)
    for op in ("add", "mul"):
        k.binary(st, op, 0x1000, 64, 0x2000, 0, 0x3000, 64, 7, 64)
    k.scale(st, 0x1000, 33, 0x2000, 33, 7, 33, 0.125)
    from llamapy.backend.cuda_ops import WEIGHT_SUFFIX

    for qt in WEIGHT_SUFFIX:
        k.get_rows(st, qt, 0x1000, 1000, 50, 0x2000, 0x3000, 512, 4, 512)
        k.mul_mat_vec(st, qt, 0x1000, 1000, 300, 512, 0x2000, 0x3000, 3)
        k.mul_mat_vec(st, qt, 0x1000, 1000, 300, 512, 0x2000, 0x3000, 3, b=0x4000)
        k.mul_mat_vec_glu(st, "swiglu", qt, 0x1000, 1000, 300, 512, 0x2000, 0x3000, 3)
        k.mul_mat_id(st, qt, 0x1000, 1000, 8, 300, 512, 0x2000, 512, 0, 0x3000, 2, 0x4000, 3, 2, w2=0x5000)
        k.mul_mat_id(st, qt, 0x1000, 1000, 8, 300, 512, 0x2000, 512, 0, 0x3000, 2, 0x4000, 3, 2, w2=0x5000,
                     glu="swiglu_oai", b=0x6000, b2=0x7000, sb=300, alpha=1.702, limit=7.0)  # fmt: skip
        k.dequant_f16(st, qt, 0x1000, 1000, 300, 512, 0x2000)
    from llamapy.backend.cuda_ops import MMVQ_SUFFIX

    k.quantize_q8_1(st, 0x1000, 512, 0x2000, 3, 512)
    for qt in MMVQ_SUFFIX:  # the int8 products on that copy (the q8 mode's large decode products)
        for glu in ("", "swiglu"):
            k.mul_mat_vec_q8(st, qt, 0x1000, 1000, 300, 512, 0x2000, 0x3000, 3, glu=glu)
        k.mul_mat_id(st, qt, 0x1000, 1000, 8, 300, 512, 0x2000, 2, 1, 0x3000, 2, 0x4000, 3, 2, w2=0x5000,
                     glu="swiglu_oai", b=0x6000, b2=0x7000, sb=300, alpha=1.7, limit=7.0, q8_rows=6)
    k.soft_max(st, 0x1000, 128, 0x2000, 128, 3, 128, 1.0)
    k.argsort(st, 0x1000, 128, 0x2000, 128, 3, 128)
    k.get_rows_batched(st, 0x1000, 128, 1, 128, 0x2000, 8, 0x3000, 3, 8, 1)
    k.sum_rows(st, 0x1000, 8, 0x2000, 3, 8)
    k.router(st, 0x1000, 128, 0x2000, 0x3000, 3, 128, 8, 1.0, 6e-5, float("inf"))
    k.router_topk(st, 0x1000, 32, 0x2000, 0x3000, 3, 32, 4, 1.0)
    k.clamp(st, 0x1000, 1, 0x2000, 3, 1, 6e-5, float("inf"))
    k.moe_sort(st, 0x1000, 8, 40, 8, 128, 0x2000, 0x3000)  # a prompt's experts (mul_mat_id_gemm's launches)
    k.moe_gather_f16(st, 0x1000, 2048, 0, 0x2000, 0x3000, 8, 8, 128, (0x4000, 40), 0x5000, 320, 2048)
    k.moe_gather_f16(st, 0x1000, 2048, 256, 0x2000, 0x3000, 8, 8, 128, (0x4000, 0), 0x5000, 320, 2048, scale=0x6000)
    for op in (-1, 2):
        k.moe_scatter(st, 0x1000, 1536, 0x2000, 0x3000, 8, 8, 128, (0x4000, 0), 0x5000, 768, 320, op, b=0x6000,
                      b2=0x7000, sb=768, alpha=1.702, limit=7.0)  # fmt: skip
    for op in ("mul", "div"):
        k.binary_row(st, op, 0x1000, 64, 0x2000, 1, 0x3000, 64, 7, 64)
    k.get_rows_f32(st, 0x1000, 64, 50, 0x2000, 0x3000, 64, 4, 64)
    rope = dict(pos=0x100, n_dims=64, mode=0, freq_base=10000.0, factors=0x200)
    k.rope(st, 0x1000, 576, 64, 0x1000, 576, 64, 5, 9, 64, **rope)
    k.rope(st, 0x1000, 576, 64, 0x1000, 576, 64, 5, 9, 64, **rope, yarn=0x400)
    for ct in (G.F32, G.F16, G.Q8_0, G.Q4_0):
        rot = 64 if ct in (G.Q8_0, G.Q4_0) else 0
        k.rope(st, 0x1000, 192, 64, 0, 0, 0, 5, 3, 64, **rope, cache_type=ct, ids=0x300, n_cells=256, cache=0x4000,
               cache_rb=1000, rot=rot)  # fmt: skip
        k.rope(st, 0x1000, 192, 64, 0, 0, 0, 5, 3, 64, cache_type=ct, ids=0x300, n_cells=256, cache=0x4000,
               cache_rb=1000, rot=rot)  # fmt: skip
    for kt in (G.F32, G.F16, G.Q8_0, G.Q4_0):
        for vt in (G.F32, G.F16, G.Q8_0, G.Q4_0):
            k.rope_qkv(st, 0x1000, 0x1000 + 4 * 576, 0x1000 + 4 * 768, 960, 0x2000, 576, 5, 9, 3, 64, 64, pos=0x100,
                       n_dims=64, mode=2, freq_base=1e4, ids=0x300, n_cells=256, k_type=kt, k_cache=0x4000, k_rb=400,
                       k_rot=64 if kt in (G.Q8_0, G.Q4_0) else 0, v_type=vt, v_cache=0x5000, v_rb=400,
                       yarn=0x400 if kt == vt else 0)  # fmt: skip
            rk = 128 if kt in (G.Q8_0, G.Q4_0) else 0
            rv = 64 if vt in (G.Q8_0, G.Q4_0) else 0
            s = fattn_splits(1, 8, 4096, 132)
            assert s > 1 and fattn_scratch_floats(1, 32, 128, s) > 0
            for n_splits in (1, s):
                k.flash_attn_ext(st, 0x1000, 4096, 128, kt, 0x2000, 2048, 256, vt, 0x3000, 2048, 256, 4096, 0x4000, 4096,
                                 0x5000, 4096, 128, 1, 32, 8, 128, 128, 0.088, n_kv_dev=0x6000, n_splits=n_splits,
                                 scratch=0x7000 if n_splits > 1 else 0, rot_k=rk, rot_v=rv,
                                 sinks=0x8000 if kt == vt else 0)  # fmt: skip
            # a prompt of 40 tokens: the prompt kernel (fattn_tile_*), heads of 256 at most
            k.flash_attn_ext(st, 0x1000, 4096, 128, kt, 0x2000, 2048, 256, vt, 0x3000, 2048, 256, 4096, 0x4000, 4096,
                             0x5000, 4096, 128, 40, 32, 8, 256, 256, 0.088, n_kv_dev=0x6000, rot_k=rk, rot_v=rv)  # fmt: skip
    k.to_f16(st, 0x1000, 576, 0x2000, 40, 576)
    k.to_f16(st, 0x1000, 576, 0x2000, 300, 576, scale=0x3000)  # (with the input's scale: amax_f32 first)
    return calls


@needs_nvcc
def test_launch_arguments_match_the_kernels() -> None:
    """Each launch function passes each kernel exactly its parameters (count, size, float or
    integer: what a mismatch would silently garble on a GPU), within CUDA's launch limits, and
    every entry point but the dequantizers (cuda.py's) has a launch function."""
    from llamapy.backend.cuda_ops import ENTRIES, SHARED_MAX

    params: dict[str, list[str]] = {}
    for src in SOURCES:
        params.update(ptx_params(ptx_of(src)))
    calls = record_launches()
    for name, grid, block, args, shared, stream in calls:
        want = [_PTX_CLASS[t] for t in params[name]]
        got = [_arg_class(a) for a in args]
        assert got == want, f"{name}: arguments {got} for parameters {params[name]}"
        assert all(isinstance(g, int) and g >= 1 for g in grid) and len(grid) <= 3, (name, grid)
        assert grid[0] < 2**31 and all(g < 65536 for g in grid[1:]), (name, grid)
        assert len(block) == 1 and 32 <= block[0] <= 1024 and block[0] % 32 == 0, (name, block)
        assert 0 <= shared <= SHARED_MAX and stream is not None, (name, shared)
    launched = {c[0] for c in calls}
    unlaunched = {n for names in ENTRIES.values() for n in names if not n.startswith("dequant_")} - launched
    assert not unlaunched, unlaunched


def test_recorded_launches_replay_the_same_calls() -> None:
    """CudaKernels.record gives the launches a build makes, unrun; replaying them makes exactly
    the calls launching directly makes."""
    from llamapy.backend.cuda_ops import ENTRIES, CudaKernels
    from llamapy.types import GGMLType as G

    calls: list[tuple] = []

    def recorder(name: str):  # noqa: ANN202
        return lambda grid, block, args, shared_mem=0, stream=None: calls.append((name, grid, block, args, shared_mem, stream))

    k = CudaKernels({n: recorder(n) for names in ENTRIES.values() for n in names}, n_sm=132)

    def build(st: object) -> None:
        k.rms_norm(st, 0x1000, 64, 0x2000, 64, 2, 64, 1e-5, w=0x3000)
        k.flash_attn_ext(st, 0x1000, 512, 64, G.F16, 0x2000, 256, 128, G.Q8_0, 0x3000, 136, 68, 300, 0x4000, 300,
                         0x5000, 512, 64, 1, 8, 2, 64, 64, 0.125, n_kv_dev=0x6000, n_splits=3, scratch=0x7000)  # fmt: skip

    launches = k.record(build)
    assert not calls and [x.name for x in launches] == ["rms_norm_f32", "fattn_f16_q8_0", "fattn_combine"]
    st = object()
    build(st)
    direct, calls[:] = list(calls), []
    for x in launches:
        x(st)
    assert len(calls) == 3 and all(
        a[:3] == b[:3] and a[4:] == b[4:] and len(a[3]) == len(b[3]) and all(type(u) is type(v) and u == v for u, v in zip(a[3], b[3]))
        for a, b in zip(calls, direct))  # fmt: skip


def test_launch_refusals() -> None:
    """What a kernel cannot do is refused with a LlamapyError before anything is launched."""
    from llamapy.backend.cuda_ops import CudaKernels
    from llamapy.types import GGMLType as G
    from llamapy.types import UnsupportedError

    def never(*a: object, **kw: object) -> None:
        raise AssertionError("launched")

    k = CudaKernels(collections.defaultdict(lambda: never), n_sm=132)
    st = object()
    with pytest.raises(UnsupportedError, match="heads of 512"):
        k.flash_attn_ext(st, 1, 1, 1, G.F16, 1, 1, 1, G.F16, 1, 1, 1, 8, 1, 8, 1, 1, 1, 1, 8, 8, 512, 512, 1.0)
    with pytest.raises(UnsupportedError, match="shared memory"):
        k.flash_attn_ext(st, 1, 1, 1, G.F16, 1, 1, 1, G.F16, 1, 1, 1, 8, 1, 8, 1, 1, 1, 1, 64, 1, 256, 256, 1.0)
    with pytest.raises(UnsupportedError, match="Q4_1"):
        k.flash_attn_ext(st, 1, 1, 1, G.Q4_1, 1, 1, 1, G.F16, 1, 1, 1, 8, 1, 8, 1, 1, 1, 1, 8, 8, 64, 64, 1.0)
    with pytest.raises(UnsupportedError, match="rotation"):
        k.rope(st, 1, 1, 1, 0, 0, 0, 1, 1, 96, cache_type=G.Q8_0, ids=1, n_cells=4, cache=1, cache_rb=102, rot=64)
    with pytest.raises(UnsupportedError, match="mode 1"):
        k.rope(st, 1, 1, 1, 1, 1, 1, 1, 1, 64, pos=1, n_dims=64, mode=1)
    with pytest.raises(UnsupportedError, match="GLU"):
        k.glu(st, "reglu", 1, 1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(UnsupportedError, match="int8 MUL_MAT of BF16"):  # (no mmvq.cu decoder: the float32 path)
        k.mul_mat_vec_q8(st, G.BF16, 1, 512, 8, 256, 0x100, 1, 1)
    with pytest.raises(UnsupportedError, match="9 tokens"):
        k.mul_mat_vec_q8(st, G.Q4_K, 1, 144, 8, 256, 0x100, 1, 9)
    with pytest.raises(UnsupportedError, match="q8_1 copy"):  # the copy's quants are read 16 bytes at a time
        k.quantize_q8_1(st, 1, 256, 0x104, 1, 256)
    with pytest.raises(UnsupportedError, match="tokens"):
        k.mul_mat_vec(st, G.Q4_0, 1, 18, 4, 32, 0x1000, 0x2000, 9)
    with pytest.raises(UnsupportedError, match="row 5 of a q8_1 copy of 4"):  # pair (2, 1) of 2 slots: row 2 * 2 + 1
        k.mul_mat_id(st, G.Q4_0, 1, 18, 4, 32, 32, 0x1000, 2, 1, 0x2000, 2, 0x3000, 3, 2, q8_rows=4)
    with pytest.raises(UnsupportedError, match="int8 MUL_MAT_ID of F16"):
        k.mul_mat_id(st, G.F16, 1, 512, 4, 32, 256, 0x1000, 1, 0, 0x2000, 1, 0x3000, 1, 1, q8_rows=1)
    with pytest.raises(UnsupportedError, match="2\\^31"):  # mmv_id's 32-bit offsets of the input rows
        k.mul_mat_id(st, G.Q4_0, 1, 18, 4, 32, 32, 0x1000, 2**30, 0, 0x2000, 1, 0x3000, 3, 1)
    with pytest.raises(UnsupportedError, match="grid"):
        k.glu(st, "swiglu", 1, 1, 1, 1, 1, 1, 70000, 64)


def test_every_weight_type_has_kernels() -> None:
    import llamapy.backend.cuda as cuda
    from llamapy.quants import DEQUANT_TYPES

    assert set(cuda._TYPE_KERNELS) == set(DEQUANT_TYPES)
    for fname, _ in cuda._TYPE_KERNELS.values():
        assert (KDIR / fname).is_file()
    # what cupy.RawModule compiles: the header inlined, no #include left
    for name in cuda.kernel_sources():
        src = cuda._module_source(name)
        assert "#include" not in src and "LP_KERNELS" in src


# --- the decoders on the CPU -----------------------------------------------------------------

# byte offsets of the f16 scale fields of each block, set to sane values in random blocks
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": [],  # MXFP4: an E8M0 byte (random_rows)
}  # fmt: skip


def random_rows(name: str, n_rows: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid raw rows (uint8, (n_rows, row_bytes)) of type `name`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blck, bs = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    x = rng.standard_normal((n_rows, n_in)).astype(np.float32)
    if name == "F32":
        return x.view(np.uint8)
    if name == "F16":
        return x.astype(np.float16).view(np.uint8)
    if name == "BF16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (n_rows * n_in // blck, bs), dtype=np.uint8)
    for o in F16_FIELDS[name]:
        d = (rng.uniform(0.5, 1.5, len(raw)) * 0.01).astype(np.float16)
        raw[:, o : o + 2] = d.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # E8M0 exponents: the subnormal scales (0, 1) and finite products (<= 2^12 x 12)
        raw[:, 0] = rng.choice(np.array([0, 1, 2, *range(110, 141)], np.uint8), len(raw))
    return raw.reshape(n_rows, -1)


@pytest.fixture(scope="module")
def host_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    if NVCC is None:
        pytest.skip("nvcc not found")
    d = tmp_path_factory.mktemp("cuda_host")
    libs = {}
    for src in SOURCES:
        so = d / f"{src.stem}.so"
        r = subprocess.run(
            [NVCC, "-DLLAMAPY_HOST_TEST", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off",
             "-arch=sm_90", "-I", str(KDIR), "-o", str(so), str(src)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if r.returncode != 0:
            if "host compiler" in r.stderr or "gcc" in r.stderr and "not found" in r.stderr:
                pytest.skip(f"nvcc has no usable host compiler: {r.stderr[:200]}")
            raise AssertionError(r.stderr)
        libs[src.name] = ctypes.CDLL(str(so))
    return libs


ALL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
             "IQ4_NL", "IQ4_XS", "MXFP4"]


@pytest.mark.parametrize("name", ALL_TYPES)
def test_decoders_match_gguf(name: str, host_libs: dict[str, ctypes.CDLL]) -> None:
    """The kernels' per-unit decoders, built for the CPU, are bit-identical to gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    import llamapy.backend.cuda as cuda

    qt = GGMLQuantizationType[name]
    fname, suffix = cuda._TYPE_KERNELS[qt]
    rng = np.random.default_rng(7)
    n_rows, n_in = 5, 768
    raw = np.ascontiguousarray(random_rows(name, n_rows, n_in, rng))
    ref = dequantize(raw, qt).reshape(n_rows, n_in).astype(np.float32)
    out = np.full((n_rows, n_in), np.nan, np.float32)
    fn = getattr(host_libs[fname], f"host_dequant_{suffix}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_longlong]
    fn(raw.ctypes.data, out.ctypes.data, n_rows, n_in // 32, raw.shape[1])
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


# --- importing without CuPy -----------------------------------------------------------------

NO_CUPY = textwrap.dedent(
    """
    import sys
    sys.modules["cupy"] = None  # `import cupy` now raises ImportError
    import llamapy.backend.cuda as cuda
    from llamapy.types import BackendUnavailable
    try:
        cuda.registry()
    except BackendUnavailable as e:
        print("REASON", e)
    from llamapy.backend.registry import discover
    st = {s.name: s for s in discover(refresh=True).statuses}
    print("STATUS", st["cuda"].registry is None, st["cuda"].error)
    print("CPU", st["cpu"].registry is not None)
    """
)


def test_imports_and_reports_without_cupy() -> None:
    r = subprocess.run([sys.executable, "-c", NO_CUPY], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "REASON CUDA: no CuPy" in r.stdout
    assert "STATUS True BackendUnavailable: CUDA: no CuPy" in r.stdout
    assert "CPU True" in r.stdout


def test_registry_reason_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import llamapy.backend.cuda as cuda
    from llamapy.backend import registry as reg
    from llamapy.types import BackendUnavailable

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendUnavailable, match="no CuPy"):
        cuda.registry()
    monkeypatch.setattr(reg, "_cache", None)  # restored after the test
    monkeypatch.delenv("LLAMAPY_BACKENDS", raising=False)
    st = {s.name: s for s in reg.discover(refresh=True).statuses}
    assert st["cuda"].registry is None and "no CuPy" in st["cuda"].error


def test_not_loaded_with_backends_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from llamapy.backend import registry as reg

    calls = []
    monkeypatch.setitem(reg.BUILTINS, "cuda", lambda: calls.append(1))  # would record a load
    monkeypatch.setattr(reg, "_cache", None)
    monkeypatch.setenv("LLAMAPY_BACKENDS", "cpu")
    names = [s.name for s in reg.discover(refresh=True).statuses]
    assert "cuda" not in names and "cpu" in names and not calls


def test_no_gpu_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CuPy present but no device (a fake cupy whose runtime has no devices)."""
    import types

    import llamapy.backend.cuda as cuda
    from llamapy.types import BackendUnavailable

    class Runtime:
        @staticmethod
        def getDeviceCount() -> int:
            raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=Runtime)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(BackendUnavailable, match="no GPU or no usable driver.*cudaErrorNoDevice"):
        cuda.registry()
    Runtime.getDeviceCount = staticmethod(lambda: 0)  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable, match="no GPU"):
        cuda.registry()
