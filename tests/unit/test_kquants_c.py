"""kernels_c/kquants.c: ggml-cpu's quantize_row_q8_K and ggml_vec_dot_q{2..6}_K_q8_K, in every
SIMD variant the install built, against numpy.

- q8_K blocks from C equal `llamapy.quants.quantize_q8_k` (ggml's quantize_row_q8_K_ref) bit for
  bit, bsums included; a few of ggml's rules are also checked by hand, on both (ties to even,
  the sign of d, first of equal magnitudes).
- vec_dot, Q3_K-Q6_K: bit for bit the float32 order of llama.cpp's x86 prompt kernels (an exact
  emulation here: the repacked Q4_K gemm, the tiled Q3_K/Q5_K/Q6_K microtiles), every variant.
- vec_dot: |C - ref| <= 1e-5 * sum |w * x| per row (for types with mins, summed over the scale
  and the min parts of w separately, as ggml sums them), ref = the float64 sum of the products
  of the exactly dequantized weights (gguf.quants.dequantize) and the q8_K-dequantized
  activations (d * qs); random quant bytes in every quant field (random_raw), plus extreme rows.

Each variant is checked in the library the install built (native.load(variant), what
LLAMAPY_KERNELS_VARIANT selects), else, where the install has none with these kernels, in one
compiled here; every variant is also compiled here warning-free, those this CPU cannot run
included (their checks are skipped, saying so).
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import gguf.quants
import numpy as np
import pytest

from llamapy import quants
from llamapy.backend import native
from llamapy.types import GGMLType, block_size

try:  # tests/unit may or may not be a package
    from .test_quants import F16_FIELDS, random_raw
except ImportError:
    from test_quants import F16_FIELDS, random_raw  # type: ignore[no-redef]

SRC = native.SRC_DIR / "kquants.c"
QK_K = 256
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# the compiler flags of each variant (as setup.py builds them)
FLAGS: dict[str, list[str]] = {
    "portable": [],
    "avx2": _AVX2,
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", *_AVX2],
}
X86 = platform.machine().lower() in ("x86_64", "amd64")


class KQ:
    """ctypes view of one variant's kernels (argument types as native.py declares them)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.lib.lp_quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self.lib.lp_quantize_row_q8_K.restype = None
        for t in K_TYPES:
            fn = getattr(self.lib, f"lp_vec_dot_{t[:2].lower()}_K_q8_K")
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = None

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """(rows, k) float32 -> (rows, k // 256) q8_K blocks, one C call per row."""
        x = np.ascontiguousarray(x, np.float32)
        out = np.zeros((x.shape[0], x.shape[1] // QK_K), quants.Q8_K_DTYPE)
        for r in range(x.shape[0]):
            self.lib.lp_quantize_row_q8_K(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
        return out

    def vec_dot(self, name: str, raw: np.ndarray, act: np.ndarray, n: int) -> np.ndarray:
        """weight rows raw (rows, row_bytes) . q8_K activation row act -> (rows,) float32."""
        fn = getattr(self.lib, f"lp_vec_dot_{name[:2].lower()}_K_q8_K")
        raw = np.ascontiguousarray(raw)
        act = np.ascontiguousarray(act)
        out = np.zeros(raw.shape[0], np.float32)
        for r in range(raw.shape[0]):
            fn(n, out[r:].ctypes.data, raw[r].ctypes.data, act.ctypes.data)
        return out


@pytest.fixture(scope="session")
def kq_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """variant -> kquants.c compiled here (-Wall -Werror), or why there is none."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler (CC, cc, gcc, clang)")
    out_dir = tmp_path_factory.mktemp("kquants")
    built: dict[str, Path | str] = {}
    for name, flags in FLAGS.items():
        if flags and not X86:
            built[name] = f"{name} is an x86 variant; this is {platform.machine()}"
            continue
        lib = out_dir / f"libkq_{name}.so"
        cmd = [cc, "-O2", "-shared", "-fPIC", "-Wall", "-Werror", *flags, str(SRC), "-o", str(lib)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        built[name] = lib if r.returncode == 0 else f"{' '.join(cmd)} failed:\n{r.stderr}"
    return built


@pytest.mark.parametrize("variant", list(FLAGS))
def test_variant_compiles(kq_builds: dict[str, Path | str], variant: str) -> None:
    """Every variant builds warning-free (also those this CPU cannot run)."""
    if FLAGS[variant] and not X86:
        pytest.skip(str(kq_builds[variant]))
    assert isinstance(kq_builds[variant], Path), kq_builds[variant]


@pytest.fixture(scope="session", params=list(native.VARIANTS))
def kq(request: pytest.FixtureRequest, kq_builds: dict[str, Path | str]) -> KQ:
    name = request.param
    if not native.runnable(name):
        pytest.skip(f"this CPU cannot run the {name} kernels (needs {' '.join(sorted(native.REQUIRES[name]))})")
    if name in native.built():
        lib = native.load(name)
        if hasattr(lib, "lp_vec_dot_q4_K_q8_K"):
            return KQ(lib)
    # the install built no library with kquants.c in it: the one compiled here
    built = kq_builds[name]
    if not isinstance(built, Path):
        pytest.skip(f"{name} not built: {built}")
    return KQ(ctypes.CDLL(str(built)))


# ------------------------------------------------------------------------------------------------
# q8_K


def _activation_rows(rng: np.random.Generator, k: int) -> np.ndarray:
    """Random rows and the edge cases: zeros, all negative, large / small magnitudes, a single
    value, exact halves (rounding ties), equal magnitudes of both signs."""
    rows = [
        rng.standard_normal(k),
        rng.standard_normal(k) * 1e3,
        rng.uniform(-1, 1, k) ** 5,  # heavy tails: most quants near 0
        np.zeros(k),
        -np.abs(rng.standard_normal(k)) - 0.1,
        rng.standard_normal(k) * 1e20,
        rng.standard_normal(k) * 1e-30,
        np.where(np.arange(k) % 97 == 0, 5.0, 0.0),
        np.tile(np.concatenate([[127.0], np.arange(255) * 0.5 - 60]), k // QK_K),
        np.tile(np.concatenate([[-3.0, 1.0, 3.0], rng.uniform(-3, 3, 253)]), k // QK_K),
    ]
    x = np.stack(rows).astype(np.float32)
    x[4, :QK_K] = 0.0  # one all-zero block in an otherwise nonzero row
    return x


def test_q8_K_matches_reference_bitwise(kq: KQ) -> None:
    rng = np.random.default_rng(0)
    x = _activation_rows(rng, 4 * QK_K)
    got = kq.quantize(x)
    ref = quants.quantize_q8_k(x)
    assert got.shape == ref.shape == (x.shape[0], 4)
    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    # bsums are the sums of 16 quants, and d*qs reproduces x to half a step
    qs = got["qs"].astype(np.int64)
    np.testing.assert_array_equal(got["bsums"], qs.reshape(*qs.shape[:2], 16, 16).sum(-1))
    xb = x.reshape(x.shape[0], 4, QK_K).astype(np.float64)
    step = np.abs(got["d"].astype(np.float64))[..., None]
    assert np.all(np.abs(got["d"][..., None] * qs - xb) <= 0.5001 * step + 1e-45)


def test_q8_K_follows_ggml_rules(kq: KQ) -> None:
    """Checked by hand, not through the numpy reference (which is checked the same way): ggml's
    nearest_int rounds ties to even, d = -max/127 keeps the sign of the first element of largest
    magnitude, zeros give zeros."""
    for quantize in (kq.quantize, quants.quantize_q8_k):
        x = np.zeros((1, QK_K), np.float32)
        x[0, :6] = [127.0, 0.5, 1.5, 2.5, -0.5, -3.5]  # iscale = -1 exactly: products are exact halves
        b = quantize(x)[0, 0]
        assert b["d"] == np.float32(-1.0)
        assert list(b["qs"][:6]) == [-127, 0, -2, -2, 0, 4]
        assert b["bsums"][0] == -127 - 2 - 2 + 4

        x = np.zeros((1, QK_K), np.float32)
        x[0, 3], x[0, 7], x[0, 9] = -2.0, 2.0, 1.0  # first of equal magnitudes wins: max = -2
        b = quantize(x)[0, 0]
        assert b["d"] == np.float32(1.0) / (np.float32(-127.0) / np.float32(-2.0)) and b["d"] > 0
        assert (b["qs"][3], b["qs"][7], b["qs"][9]) == (-127, 127, 64)

        b = quantize(np.zeros((1, QK_K), np.float32))[0, 0]
        assert b["d"] == 0 and not b["qs"].any() and not b["bsums"].any()


# ------------------------------------------------------------------------------------------------
# vec_dot


def _reference(name: str, raw: np.ndarray, act: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(float64 dot products, the magnitude of what ggml sums) of weight rows raw with q8_K row
    act. The magnitude is sum |w * x|, except for types with mins (w = d*sc*q - dmin*m), whose
    two parts ggml sums separately (and which may cancel exactly): |d part . x| + |min part . x|."""
    qt = GGMLType[name]
    x = (act["d"].astype(np.float64)[:, None] * act["qs"].astype(np.float64)).reshape(n)

    def deq(r: np.ndarray) -> np.ndarray:
        return gguf.quants.dequantize(r, qt).reshape(raw.shape[0], n).astype(np.float64)

    w = deq(raw)
    if len(F16_FIELDS[name]) == 1:
        return w @ x, np.abs(w) @ np.abs(x)
    _, bsize = block_size(qt)
    d_off, m_off = F16_FIELDS[name]
    parts = []
    for zero in (m_off, d_off):  # the d part (dmin = 0), then the min part (d = 0)
        r = raw.reshape(-1, bsize).copy()
        r[:, zero : zero + 2] = 0
        parts.append(np.abs(deq(r.reshape(raw.shape))) @ np.abs(x))
    return w @ x, parts[0] + parts[1]


def _check(kq: KQ, name: str, raw: np.ndarray, x: np.ndarray) -> None:
    n = x.shape[0]
    act = quants.quantize_q8_k(x)
    got = kq.vec_dot(name, raw, act, n).astype(np.float64)
    ref, mag = _reference(name, raw, act, n)
    err = np.abs(got - ref)
    bad = err > 1e-5 * mag
    rows = np.flatnonzero(bad)[:5]
    assert not bad.any(), f"rows {rows}: got {got[rows]} want {ref[rows]} (scale {mag[rows]})"


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("n", [QK_K, 9 * QK_K])
def test_vec_dot_random(kq: KQ, name: str, n: int) -> None:
    rng = np.random.default_rng(n + len(name) + K_TYPES.index(name))
    raw = random_raw(name, 24, n, rng)
    for x in (rng.standard_normal(n), rng.uniform(-1, 1, n) ** 3 * 50):
        _check(kq, name, raw, x.astype(np.float32))


@pytest.mark.parametrize("name", K_TYPES)
def test_vec_dot_edge_cases(kq: KQ, name: str) -> None:
    """Zero / all-negative / huge / tiny activations; weights with every quant bit set (the
    largest maddubs pairs: no int16 saturation), none set, alternating, and large f16 scales."""
    n = 4 * QK_K
    rng = np.random.default_rng(7)
    _, bsize = block_size(GGMLType[name])
    rows = []
    for fill in (0xFF, 0x00, 0xAA, 0x55):
        blocks = np.full((n // QK_K, bsize), fill, np.uint8)
        for off in F16_FIELDS[name]:
            blocks[:, off : off + 2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        rows.append(blocks.reshape(-1))
    big = random_raw(name, 2, n, rng).reshape(2, -1, bsize)
    for off in F16_FIELDS[name]:  # large scales: d = 60000, dmin = -30000, and tiny ones
        large = np.float16(60000.0 if off == F16_FIELDS[name][0] else -30000.0)
        big[0, :, off : off + 2] = np.frombuffer(large.tobytes(), np.uint8)
        big[1, :, off : off + 2] = np.frombuffer(np.float16(6e-8).tobytes(), np.uint8)
    rows += list(big.reshape(2, -1))
    raw = np.stack(rows)
    xs = [
        np.zeros(n),
        -np.abs(rng.standard_normal(n)) - 1.0,
        np.abs(rng.standard_normal(n)) + 1.0,
        np.full(n, 3.0),  # every quant -127
        rng.standard_normal(n) * 1e20,
        rng.standard_normal(n) * 1e-20,
    ]
    for x in xs:
        _check(kq, name, raw, x.astype(np.float32))
    act = quants.quantize_q8_k(np.zeros(n, np.float32))
    assert not kq.vec_dot(name, raw, act, n).any()


# ------------------------------------------------------------------------------------------------
# the float32 order: llama.cpp 0.3.36's x86 prompt kernels


def _fmaf(a: float, b: float, c: float) -> np.float32:
    """fmaf: a * b + c with one rounding to float32 (nearest, ties to even), exactly."""
    r = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(r))
    cands = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - r), int(np.float32(v).view(np.uint32)) & 1))


def _int_parts(name: str, row: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """One weight row's integer parts, per block: sc * q for every element (the row dequantized
    with d = 1, dmin = 0: exact), the sub-block min of every element (d = 0, dmin = 1; None
    without mins), d and dmin as float32."""
    qt = GGMLType[name]
    _, bsize = block_size(qt)
    b = row.reshape(-1, bsize)
    one, zero = np.frombuffer(np.float16(1.0).tobytes(), np.uint8), np.zeros(2, np.uint8)

    def with_scales(fields: list[np.ndarray]) -> np.ndarray:
        r = b.copy()
        for off, v in zip(F16_FIELDS[name], fields):
            r[:, off : off + 2] = v
        return gguf.quants.dequantize(r.reshape(-1), qt).reshape(-1, QK_K).astype(np.int64)

    def f16s(off: int) -> np.ndarray:
        return np.ascontiguousarray(b[:, off : off + 2]).view(np.float16).astype(np.float32).reshape(-1)

    if len(F16_FIELDS[name]) == 1:
        return with_scales([one]), None, f16s(F16_FIELDS[name][0]), None
    return with_scales([one, zero]), -with_scales([zero, one]), f16s(F16_FIELDS[name][0]), f16s(F16_FIELDS[name][1])


def _prompt_order_dot(name: str, row: np.ndarray, act: np.ndarray) -> np.float32:
    """Q4_K as ggml_gemm_q4_K_8x8_q8_K (repack.cpp, llama.cpp's Q4_K prompts on x86: AVX2 and
    AVX-512 bodies alike), Q2_K as ggml_gemm_q2_K_8x8_q8_K (its prompts on AVX-512; per 128-element
    half instead of pair): per block and 64-element pair p, acc = fma(S_p, d_w * d_y, acc) and accm
    = fma(M_p, dmin_w * d_y, accm), the result acc - accm. Q3_K / Q5_K / Q6_K as the tiled
    microtiles (tiled/tiled-kernel.cpp, the prompts of >= 8 rows): per block r = S * d_w, r =
    fma(-dmin_w, M, r) with mins, acc = fma(r, d_y, acc). S, M: the exact integer sums (sc * q . q8,
    mn . bsums)."""
    sq, mn, dw, dmin = _int_parts(name, row)
    q8 = act["qs"].astype(np.int64)
    dy = act["d"].astype(np.float32)
    f32 = np.float32
    acc, accm = f32(0), f32(0)
    for i in range(sq.shape[0]):
        if name in ("Q2_K", "Q4_K"):
            w = 128 if name == "Q2_K" else 64
            for p in range(QK_K // w):
                e = slice(w * p, w * p + w)
                acc = _fmaf(f32(int(sq[i, e] @ q8[i, e])), f32(dw[i] * dy[i]), acc)
                accm = _fmaf(f32(int(mn[i, e] @ q8[i, e])), f32(dmin[i] * dy[i]), accm)
            continue
        r = f32(f32(int(sq[i] @ q8[i])) * dw[i])
        if mn is not None:
            r = _fmaf(-dmin[i], f32(int(mn[i] @ q8[i])), r)
        acc = _fmaf(r, dy[i], acc)
    return f32(acc - accm)


@pytest.mark.parametrize("name", K_TYPES)
def test_vec_dot_in_ggml_x86_prompt_order(kq: KQ, name: str) -> None:
    """Every variant's vec_dot (so its gemm and gemv, which tests/unit/test_native_quants.py holds
    to it bit for bit) computes llama.cpp's x86 prompt order exactly (_prompt_order_dot): the
    float32 results of llama-perplexity on the same file. (llama.cpp's own decode runs other
    orders for < 4 rows of Q4_K and < 8 of the others, so it is not batch-invariant; llamapy
    takes the prompt order at every batch size.)"""
    rng = np.random.default_rng(5 + K_TYPES.index(name))
    n = 5 * QK_K
    raw = random_raw(name, 6, n, rng)
    for x in (rng.standard_normal(n) * 3, rng.uniform(-1, 1, n) ** 3 * 50):
        act = quants.quantize_q8_k(x.astype(np.float32)).reshape(-1)
        got = kq.vec_dot(name, raw, act, n)
        want = np.array([_prompt_order_dot(name, raw[r], act) for r in range(raw.shape[0])], np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, got, want)
