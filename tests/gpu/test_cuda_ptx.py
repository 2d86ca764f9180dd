"""Checks of the CUDA backend that need no GPU: every kernel source compiles to PTX with nvcc, the
decoders (built for the CPU) match gguf-py bit for bit, and the module imports and reports why it
cannot load when CuPy is missing."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
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
    names = {p.name for p in SOURCES}
    assert {"floats.cu", "legacy.cu", "kquants.cu", "iquants.cu"} <= names
    assert (KDIR / "common.cuh").is_file()


@needs_nvcc
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_ptx_compiles(src: Path, tmp_path: Path) -> None:
    out = tmp_path / (src.stem + ".ptx")
    r = subprocess.run(
        [NVCC, "-ptx", "-arch=sm_90", "-I", str(KDIR), "-o", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    ptx = out.read_text()
    # every type in the file has its two entry points
    import llamapy.backend.cuda as cuda

    for qtype, (fname, suffix) in cuda._TYPE_KERNELS.items():
        if fname == src.name:
            assert f".entry dequant_{suffix}(" in ptx, qtype
            assert f".entry mmv_{suffix}(" in ptx, qtype


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
