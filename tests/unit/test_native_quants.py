"""kernels_c/quants.c and qmatmul.c's lp_mul_mat: activation quantization and the vec_dot kernels
of every SIMD variant the install built, against ggml's definitions computed in float64.

- lp_quantize_row_q8_0 / q8_1 are bit-identical to quants.quantize_q8_act: ggml's x86 SIMD
  quantize_row_q8_0 / q8_1 (127/amax, ties to even), what llama.cpp's x86 builds run; not
  gguf.quants (ggml's reference quantizer: 1/d, ties away), whose difference one test counts.
- lp_vec_dot_<type>_<vec_dot_type>: weights quantized by gguf-py (random bytes where it cannot),
  activations quantized as above; the reference is the exact integer dot of each block times
  its scales, summed in float64. Tolerance: float32 summation, 2e-6 of the sum of |terms|. The
  q types' float32 order is also checked bit for bit against an emulation of ggml's AVX2 one.
- F16 / BF16 dots: the activations rounded to f16 / bf16 first (ggml's vec_dot_type).
Each variant is loaded through native.load(variant) (what LLAMAPY_KERNELS_VARIANT selects); a
variant this CPU cannot run is skipped, saying so.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import gguf.quants
import numpy as np
import pytest

from llamapy.backend import native
from llamapy.quants import quantize_q8_act
from llamapy.types import GGMLType, block_size

try:  # tests/unit may or may not be a package
    from .test_quants import random_raw
except ImportError:
    from test_quants import random_raw  # type: ignore[no-redef]

OWN_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
VEC_DOT_TYPE = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0",
                "Q4_1": "Q8_1", "Q5_1": "Q8_1", **{k: "Q8_K" for k in K_TYPES}}
GGML_ID = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9, "Q8_K": 15,
           "BF16": 30, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def load_variant(v: str) -> ctypes.CDLL:
    """The library of variant `v` (as LLAMAPY_KERNELS_VARIANT=v loads it), or a skip saying why not."""
    if v not in native.built():
        pytest.skip(f"the {v} kernels were not built by this install (built: {native.built()})")
    if not native.runnable(v):
        pytest.skip(f"this CPU cannot run the {v} kernels (needs {' '.join(sorted(native.REQUIRES[v]))})")
    return native.load(v)


@pytest.fixture(params=list(native.VARIANTS))
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return load_variant(request.param)


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


# --- ggml's definitions, in numpy -------------------------------------------------------------


def f16(b: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, off : off + 2]).view(np.float16).reshape(-1).astype(np.float64)


def nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int64)  # element j < 16: low nibble


def hbits(qh: np.ndarray) -> np.ndarray:
    h = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1).astype(np.int64)
    return (h >> np.arange(32)) & 1


def ref_dot(name: str, w: np.ndarray, y: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """(dot, sum of |terms|) by ggml's definition: w one weight row (its bytes), y the activation
    row in the vec_dot_type (its bytes), x the float32 activations."""
    if name == "F32":
        t = w.view(np.float32).astype(np.float64) * x.astype(np.float64)
        return t.sum(), np.abs(t).sum()
    if name in ("F16", "BF16"):
        wd = w.view(np.float16).astype(np.float64) if name == "F16" else \
            (w.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        yd = y.view(np.float16).astype(np.float64) if name == "F16" else \
            (y.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        t = wd * yd
        return t.sum(), np.abs(t).sum()
    bsize = block_size(GGMLType[name])[1]
    b = w.reshape(-1, bsize)
    ysz = 34 if VEC_DOT_TYPE[name] == "Q8_0" else 36
    yb = y.reshape(-1, ysz)
    qy = yb[:, ysz - 32 :].view(np.int8).astype(np.int64)
    dy = f16(yb, 0)
    if name == "Q4_0":
        qx, dx, m = nibbles(b[:, 2:18]) - 8, f16(b, 0), None
    elif name == "Q4_1":
        qx, dx, m = nibbles(b[:, 4:20]), f16(b, 0), f16(b, 2)
    elif name == "Q5_0":
        qx, dx, m = (nibbles(b[:, 6:22]) | hbits(b[:, 2:6]) << 4) - 16, f16(b, 0), None
    elif name == "Q5_1":
        qx, dx, m = nibbles(b[:, 8:24]) | hbits(b[:, 4:8]) << 4, f16(b, 0), f16(b, 2)
    else:  # Q8_0
        qx, dx, m = b[:, 2:34].view(np.int8).astype(np.int64), f16(b, 0), None
    sumi = (qx * qy).sum(axis=1)  # exact integers
    terms = dx * dy * sumi
    if m is not None:
        terms = terms + m * f16(yb, 2)  # + m * s
    return terms.sum(), np.abs(terms).sum()


# --- tests --------------------------------------------------------------------------------------


def edge_blocks(rng: np.random.Generator) -> np.ndarray:
    """Blocks that test the quantizers' rounding and edge cases: exact ties (amax = 127: id = 1,
    values k + 0.5), values just inside the ties, tiny blocks (d underflows, 127/amax overflows),
    zeros, NaN and inf inputs, and random ones of several scales."""
    blocks = [
        np.concatenate([[127.0], np.arange(31) - 15.5]),  # id = 1: ties at every element
        np.concatenate([[127.0], np.nextafter(np.arange(31) - 15.5, 0)]),  # just inside the ties
        np.concatenate([[-127.0], -(np.arange(31) + 0.5)]),
        np.concatenate([[63.5], np.arange(31) * 0.5 - 7.75]),  # id = 2: ties again
        rng.standard_normal(32) * 1e-38,  # d underflows to a subnormal or zero
        rng.standard_normal(32) * 1e-44,  # 127 / amax overflows to inf
        np.full(32, -0.0),
        np.where(np.arange(32) == 3, np.nan, rng.standard_normal(32)),
        np.where(np.arange(32) == 12, np.nan, rng.standard_normal(32)),
        np.where(np.arange(32) == 7, np.inf, rng.standard_normal(32)),  # d = inf, id = 0
        np.where(np.arange(32) == 0, -np.inf, 0.0),
    ] + [rng.standard_normal(32) * sc for sc in (1e-3, 1.0, 3.0, 1e4)]
    return np.concatenate(blocks).astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q8_1"])
def test_quantize_row_q8_as_ggml_x86(lib: ctypes.CDLL, qtype: str) -> None:
    """lp_quantize_row_q8_0 / q8_1 give quants.quantize_q8_act's bytes (ggml's x86 SIMD
    quantizer), on random rows of several scales and on the edge blocks, in every variant."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(32 * 256) * rng.choice([1e-3, 1.0, 40.0], 32 * 256)).astype(np.float32)
    x[:32] = 0.0  # an all-zero block: d = 0
    x = np.concatenate([x, edge_blocks(rng)])
    bs = 34 if qtype == "Q8_0" else 36
    y = np.zeros(bs * (x.size // 32), np.uint8)
    getattr(lib, f"lp_quantize_row_{qtype.lower()}")(ptr(x), ptr(y), x.size)
    want = quantize_q8_act(x.reshape(1, -1), GGMLType[qtype]).reshape(-1, bs)
    got = y.reshape(-1, bs)
    ok = np.all(got == want, axis=1)
    assert ok.all(), (np.flatnonzero(~ok), got[~ok][:2], want[~ok][:2])


def test_activation_quantizer_differs_from_gguf_reference() -> None:
    """quantize_q8_act (llama.cpp's x86 activation quantizer) against gguf.quants' Q8_0 (ggml's
    reference quantizer, which quantizes a file's weights): the same scales, the quants equal
    except where x * id falls on a tie (even vs away from zero) or where 127/amax and
    1/(amax/127) differ by an ulp across a rounding boundary; each such difference is 1. On
    random normal rows that is rare (0 of 262144 quants here); on values that sit on a grid it is
    common: SmolLM2-135M's layer-0 attention input (96 tempest tokens, llama.cpp's own values)
    has 40 exact ties and 22 of 55296 quants differ - each one moves its whole output row."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 4096)) * 2).astype(np.float32)
    ours = quantize_q8_act(x, GGMLType.Q8_0).reshape(-1, 34)
    ref = np.ascontiguousarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)).view(np.uint8).reshape(-1, 34)
    assert np.array_equal(ours[:, :2], ref[:, :2])  # d
    assert np.count_nonzero(ours != ref) <= 1e-4 * ours.size
    # a grid: amax = 127 * 2^-3, values k/2 * 2^-3 -> x * id = k / 2: a tie for every odd k
    g = (rng.integers(-254, 255, (64, 4096)) * np.float32(2.0**-4)).astype(np.float32)
    g[:, ::32] = np.float32(127 * 2.0**-3)
    ours = quantize_q8_act(g, GGMLType.Q8_0).reshape(-1, 34)
    ref = np.ascontiguousarray(gguf.quants.quantize(g, gguf.GGMLQuantizationType.Q8_0)).view(np.uint8).reshape(-1, 34)
    assert np.array_equal(ours[:, :2], ref[:, :2])
    dq = ours[:, 2:].view(np.int8).astype(int) - ref[:, 2:].view(np.int8).astype(int)
    v = (g.reshape(-1, 32) * np.float32(8)).astype(np.float64)  # x * id, exact
    tie_odd = (v - np.floor(v) == 0.5) & (np.floor(np.abs(v)) % 2 == 0)  # even below: even rounds toward 0
    assert np.array_equal(dq != 0, tie_odd)
    assert np.array_equal(np.abs(dq[tie_odd]), np.ones(np.count_nonzero(tie_odd), int))
    assert 0.2 < np.count_nonzero(dq) / dq.size < 0.3  # a quarter: half the values are ties


def test_quantize_rows_match_portable(lib: ctypes.CDLL) -> None:
    """The SIMD quantizers (AVX2 / AVX-512 builds) against the portable build's scalar loops, bit
    for bit, on the edge blocks (ties, tiny blocks, NaN and inf inputs)."""
    if "portable" not in native.built():
        pytest.skip("the portable kernels were not built")
    ref = native.load("portable")
    x = edge_blocks(np.random.default_rng(5))
    n = x.size // 32
    for fn, bs in (("lp_quantize_row_q8_0", 34), ("lp_quantize_row_q8_1", 36)):
        got = np.zeros(bs * n, np.uint8)
        want = np.zeros_like(got)
        getattr(lib, fn)(ptr(x), ptr(got), x.size)
        getattr(ref, fn)(ptr(x), ptr(want), x.size)
        assert np.array_equal(got.reshape(n, bs), want.reshape(n, bs)), fn


def quantize_act(lib: ctypes.CDLL, name: str, x: np.ndarray) -> np.ndarray:
    """x (n_tok, n_in) in the vec_dot_type of weight type `name`, through lp_quantize_act."""
    n_tok, n_in = x.shape
    rb = lib.lp_act_row_bytes(GGML_ID[name], n_in)
    assert rb > 0
    y = np.zeros((n_tok, rb), np.uint8)
    assert lib.lp_quantize_act(GGML_ID[name], ptr(x), n_in, n_in, n_tok, ptr(y), 1) == 0
    return y


@pytest.mark.parametrize("name", OWN_TYPES)
@pytest.mark.parametrize("n_in", [32 * 8, 32 * 9 + 256, 4096])  # odd block counts and SIMD tails
def test_vec_dot_against_float64(lib: ctypes.CDLL, name: str, n_in: int) -> None:
    if name in ("F32", "F16", "BF16") and n_in == 4096:
        n_in = 4096 + 7  # float rows of any length
    rng = np.random.default_rng(n_in)
    n_rows = 6
    w = random_raw(name, n_rows, n_in, rng)
    x = (rng.standard_normal((2, n_in)) * 2).astype(np.float32)
    y = quantize_act(lib, name, x)
    if VEC_DOT_TYPE[name] in ("Q8_0", "Q8_1"):  # the activation blocks are ggml's x86 ones, bit for bit
        assert np.array_equal(y, quantize_q8_act(x, GGMLType[VEC_DOT_TYPE[name]]))
    elif name == "F16":
        assert np.array_equal(y.view(np.float16), x.astype(np.float16))
    elif name == "BF16":
        want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
        assert np.array_equal(y, np.ascontiguousarray(want).view(np.uint8).reshape(y.shape))
    fn = getattr(lib, "lp_vec_dot_" + ({"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(name) or
                                        f"{name[:2].lower()}{name[2:]}_{VEC_DOT_TYPE[name].lower()}".replace("_q8_k", "_q8_K")))
    s = ctypes.c_float()
    for r in range(n_rows):
        for t in range(2):
            fn(n_in, ctypes.byref(s), ptr(w[r]), ptr(y[t]))
            want, mag = ref_dot(name, w[r], y[t], x[t])
            assert abs(s.value - want) <= 2e-6 * mag + 1e-30, (name, r, t, s.value, want)


def ggml_order_dot(name: str, w: np.ndarray, y: np.ndarray) -> np.float32:
    """The dot of one weight row and one activation row (their bytes) as ggml's AVX2
    ggml_vec_dot_<type>_<q8> sums it in float32: int32 lane l of block i = the exact sum of the
    products of quants 4l..4l+3; acc[l] = fma(dx*dy, lane, acc[l]) block after block into one
    accumulator; summs += m * s in block order (q4_1, q5_1); hsum_float_8(acc) + summs. The fma
    is exact in float64 then rounded to float32 (a double rounding: wrong only where the float64
    sum lands exactly on a float32 midpoint, not the case for these seeds)."""
    bsize = block_size(GGMLType[name])[1]
    b = w.reshape(-1, bsize)
    ysz = 34 if VEC_DOT_TYPE[name] == "Q8_0" else 36
    yb = y.reshape(-1, ysz)
    qy = yb[:, ysz - 32 :].view(np.int8).astype(np.int64)
    qx = {"Q4_1": lambda: nibbles(b[:, 4:20]),
          "Q5_0": lambda: (nibbles(b[:, 6:22]) | hbits(b[:, 2:6]) << 4) - 16,
          "Q5_1": lambda: nibbles(b[:, 8:24]) | hbits(b[:, 4:8]) << 4,
          "Q8_0": lambda: b[:, 2:34].view(np.int8).astype(np.int64)}[name]()
    lanes = (qx * qy).reshape(-1, 8, 4).sum(axis=2).astype(np.float32)  # exact
    d = (f16(b, 0).astype(np.float32) * f16(yb, 0).astype(np.float32)).astype(np.float32)
    acc = np.zeros(8, np.float32)
    summ = np.float32(0)
    for i in range(b.shape[0]):
        acc = (np.float64(d[i]) * lanes[i].astype(np.float64) + acc.astype(np.float64)).astype(np.float32)
        if name in ("Q4_1", "Q5_1"):
            summ = np.float32(summ + np.float32(np.float32(f16(b, 2)[i]) * np.float32(f16(yb, 2)[i])))
    a = acc
    h = np.float32(np.float32(np.float32(a[0] + a[4]) + np.float32(a[2] + a[6])) +
                   np.float32(np.float32(a[1] + a[5]) + np.float32(a[3] + a[7])))
    return np.float32(h + summ)


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_vec_dot_in_ggml_avx2_order(lib: ctypes.CDLL, name: str) -> None:
    """lp_vec_dot_<type>_<q8> of every variant (portable included) sums in ggml's AVX2 order, bit
    for bit (so llamapy's q8 MUL_MATs are llama.cpp's x86 ones; the gemm / gemv kernels are held
    to the vec_dots by the tests below). Q4_0 takes llama.cpp's repacked q4_0_8x8 order instead
    (iquants.c, tests/unit/test_iquants.py)."""
    rng = np.random.default_rng(17)
    n_in, n_rows = 32 * 37, 8
    w = random_raw(name, n_rows, n_in, rng)
    y = quantize_act(lib, name, (rng.standard_normal((3, n_in)) * 2).astype(np.float32))
    fn = getattr(lib, f"lp_vec_dot_{name.lower()}_{VEC_DOT_TYPE[name].lower()}")
    s = ctypes.c_float()
    for r in range(n_rows):
        for t in range(y.shape[0]):
            fn(n_in, ctypes.byref(s), ptr(w[r]), ptr(y[t]))
            want = ggml_order_dot(name, w[r], y[t])
            assert np.float32(s.value).view(np.uint32) == want.view(np.uint32), (name, r, t, s.value, want)


def check_gemm(lib: ctypes.CDLL, name: str, sym: str, n_rows: int, n_in: int, n_cols: int,
               ncs: tuple[int, ...], nrs: tuple[int, ...], seed: int, scale: float = 1.0,
               act: np.ndarray | None = None, w: np.ndarray | None = None) -> None:
    """lp_gemm_<sym> called directly on random weights: for each column count nc and row count nr
    every output s[c * ld_s + r] is the type's vec_dot bit for bit (ld_s > nr), and nothing else
    is written. act: n_cols activation rows already in the vec_dot_type (else random ones through
    lp_quantize_act); w: the weight rows (else random ones)."""
    gemm, dot = getattr(lib, "lp_gemm_" + sym), getattr(lib, "lp_vec_dot_" + sym.removesuffix("_r1").removesuffix("_panel"))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    gemm.argtypes, gemm.restype = [ctypes.c_int, p, i64, p, i64, ctypes.c_int, p, i64, ctypes.c_int], None
    rng = np.random.default_rng(seed)
    w = random_raw(name, n_rows, n_in, rng) if w is None else w
    xq = act if act is not None else \
        quantize_act(lib, name, (rng.standard_normal((n_cols, n_in)) * scale).astype(np.float32))
    want = np.zeros((n_cols, n_rows), np.float32)
    s = ctypes.c_float()
    for c in range(n_cols):
        for r in range(n_rows):
            dot(n_in, ctypes.byref(s), ptr(w[r]), ptr(xq[c]))
            want[c, r] = s.value
    for nc in ncs:
        for nr in nrs:
            y = np.full((n_cols, n_rows + 3), np.nan, np.float32)  # ld_s > nr
            gemm(n_in, ptr(y), y.shape[1], ptr(w), w.shape[1], nr, ptr(xq), xq.shape[1], nc)
            assert np.array_equal(y[:nc, :nr], want[:nc, :nr]), (sym, nc, nr)
            assert np.isnan(y[nc:]).all() and np.isnan(y[:, nr:]).all()  # nothing else written


@pytest.mark.parametrize("suffix", ["", "_r1"])
@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gemm_is_vec_dots(lib: ctypes.CDLL, name: str, suffix: str) -> None:
    """lp_gemm_<type> (where the variant has one: AVX2, AVX-512) called directly: every output
    s[c * ld_s + r] is its vec_dot's bit for bit, for 1..LP_GEMM_COLS columns, an odd row count
    (the kernels take rows in pairs on AVX-512) and an odd block count (the vec_dots' two
    accumulators take the blocks in pairs); lp_gemm_<type>_r1 (rows one at a time, for decode
    batches) too."""
    sym = f"{name.lower()}_{VEC_DOT_TYPE[name].lower()}"
    if not hasattr(lib, "lp_gemm_" + sym + suffix):
        assert "avx" not in os.path.basename(lib._name)  # the AVX2 and AVX-512 builds have them all
        pytest.skip(f"this library has no lp_gemm_{sym}{suffix}")
    check_gemm(lib, name, sym + suffix, 7, 32 * 19, n_cols=4, ncs=(1, 2, 3, 4), nrs=(1, 2, 7), seed=11)
    if suffix == "_r1":  # AVX-512: 4 rows at a time; 4 x 300 blocks do not fit its stack buffer, 3 x 300 do
        check_gemm(lib, name, sym + suffix, 9, 32 * 300, n_cols=4, ncs=(3, 4), nrs=(9,), seed=13)


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_panel_gemm_is_vec_dots(lib: ctypes.CDLL, name: str) -> None:
    """lp_gemm_<type>_panel (the prompt kernels: any column count; AVX-512: rows decoded into
    panels of 4-row quads, tiles of 8 rows x 4 columns; AVX2: panels of row pairs, tiles of 2 rows x
    4 columns): every output is its vec_dot's bit for bit for column counts around the group of 4,
    row counts around the quad and the tile (odd ones included), an odd block count, and rows long
    enough that a panel holds only 8 (AVX2: 20) of them (several panels a call); large activations
    (scale 3) for the signed kinds' a + 128 and AVX2's offset sums."""
    sym = f"{name.lower()}_{VEC_DOT_TYPE[name].lower()}_panel"
    if not hasattr(lib, "lp_gemm_" + sym):
        assert "avx" not in os.path.basename(lib._name)  # the AVX2 and AVX-512 builds have them all
        pytest.skip(f"this library has no lp_gemm_{sym}")
    check_gemm(lib, name, sym, 19, 32 * 19, n_cols=13, ncs=(1, 3, 4, 5, 8, 13), nrs=(1, 2, 3, 4, 5, 7, 8, 9, 19),
               seed=31, scale=3.0)
    check_gemm(lib, name, sym, 21, 32 * 129, n_cols=6, ncs=(6,), nrs=(21,), seed=37)


@pytest.mark.parametrize("name", ["F32", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
# odd tail blocks; past the stack buffer (1024 blocks of 32; the K types: 128 of 256)
@pytest.mark.parametrize("n_blocks", [1, 2, 19, 64, 1025])
def test_gemv_is_vec_dots(lib: ctypes.CDLL, name: str, n_blocks: int) -> None:
    """lp_gemv_<type> (the decode kernel over many rows, where the variant has one) called
    directly: every output its vec_dot's bit for bit, for row counts around the kernel's group
    of 4, rows longer than their data (row_bytes > the blocks), and nothing written past nr."""
    sym = "f32" if name == "F32" else f"{name.lower()}_{VEC_DOT_TYPE[name].lower()}".replace("_k", "_K")  # q4_K_q8_K
    if not hasattr(lib, "lp_gemv_" + sym):
        # the AVX2 and AVX-512 builds have them (AVX-512's Q5_K decode is a vec_dot a row)
        base = os.path.basename(lib._name)
        assert "avx" not in base or (name == "Q5_K" and "avx512" in base)
        pytest.skip(f"this library has no lp_gemv_{sym}")
    gemv, dot = getattr(lib, "lp_gemv_" + sym), getattr(lib, "lp_vec_dot_" + sym)
    p = ctypes.c_void_p
    gemv.argtypes, gemv.restype = [ctypes.c_int, p, p, ctypes.c_int64, ctypes.c_int, p], None
    rng = np.random.default_rng(n_blocks)
    n_rows, n_in = 11, (256 if name in K_TYPES else 32) * n_blocks
    raw = random_raw(name, n_rows, n_in, rng)
    w = np.zeros((n_rows, raw.shape[1] + 6), np.uint8)  # row_bytes > the row's blocks
    w[:, : raw.shape[1]] = raw
    xq = quantize_act(lib, name, (rng.standard_normal((1, n_in)) * 3).astype(np.float32))
    want = np.zeros(n_rows, np.float32)
    s = ctypes.c_float()
    for r in range(n_rows):
        dot(n_in, ctypes.byref(s), ptr(w[r]), ptr(xq[0]))
        want[r] = s.value
    for nr in (1, 3, 4, 5, 8, n_rows):
        y = np.full(n_rows + 1, np.nan, np.float32)
        gemv(n_in, ptr(y), ptr(w), w.shape[1], nr, ptr(xq))
        assert np.array_equal(y[:nr], want[:nr]), (name, nr)
        assert np.isnan(y[nr:]).all()


@pytest.mark.parametrize("name", OWN_TYPES + K_TYPES)
# groups of LP_GEMM_COLS = 4 (8 for the K types on AVX-512): one group (the single-row kernels),
# whole groups and remainders; the K types' gemv a token up to 2 / 6 / 7 tokens (Q8_0 on AVX2: 4;
# qmatmul.c gemv_cols) and their gemms from 3 / 7 / 8
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_mul_mat_is_vec_dots(lib: ctypes.CDLL, name: str, n_tok: int) -> None:
    """lp_mul_mat = quantize once + one vec_dot per output, whatever the threads and however many
    tokens (the multi-column kernels where a type has one): bit for bit."""
    if lib.lp_vec_dot_type(GGML_ID[name]) < 0:
        pytest.skip(f"this library has no {name} kernel")
    rng = np.random.default_rng(7)
    n_rows, n_in = 290, 256 * 3  # 2 threads: chunks of 64 rows on the AVX-512 K gemms, 3: of 16
    w = random_raw(name, n_rows, n_in, rng)
    x = rng.standard_normal((n_tok, n_in + 3)).astype(np.float32)  # ld_x > n_in
    qt = GGML_ID[name]
    xq = quantize_act(lib, name, np.ascontiguousarray(x[:, :n_in]))
    fn = getattr(lib, "lp_vec_dot_" + ({"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(name) or
                                        f"{name[:2].lower()}{name[2:]}_{VEC_DOT_TYPE[name].lower()}".replace("_q8_k", "_q8_K")))
    want = np.zeros((n_tok, n_rows), np.float32)
    s = ctypes.c_float()
    for t in range(n_tok):
        for r in range(n_rows):
            fn(n_in, ctypes.byref(s), ptr(w[r]), ptr(xq[t]))
            want[t, r] = s.value
    wsp = np.zeros(xq.size, np.uint8)
    for n_threads in (1, 2, 3):
        y = np.full((n_tok, n_rows + 4), np.nan, np.float32)  # ld_y > n_rows
        rc = lib.lp_mul_mat(qt, ptr(w), n_rows, w.shape[1], n_in, ptr(x), x.shape[1], n_tok, ptr(y), y.shape[1],
                            ptr(wsp), n_threads)
        assert rc == 0
        assert np.array_equal(y[:, :n_rows], want), n_threads
        assert np.isnan(y[:, n_rows:]).all()  # nothing written past the rows
        y2 = np.zeros((n_tok, n_rows), np.float32)
        assert lib.lp_mul_mat_q(qt, ptr(w), n_rows, w.shape[1], n_in, ptr(xq), n_tok, ptr(y2), n_rows,
                                n_threads) == 0
        assert np.array_equal(y2, want)


@pytest.mark.parametrize("name", ["Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_gemm_is_vec_dots_at_any_column_count(lib: ctypes.CDLL, name: str) -> None:
    """lp_gemm_q{3..6}_K_q8_K take any number of columns (lp_quants.h: LP_GEMM_COLS_K; the AVX-512
    Q4_K/Q5_K/Q6_K kernels 8 at a time, the row cut in chunks of 8 blocks and the rows in groups of
    64, the blocks decoded as they are used below 32 columns and into a panel for all the groups
    from 32): every output is its vec_dot's bit for bit, for whole groups of 8 and remainders, more
    rows than a group, a row of 11 blocks (a chunk and a part), and ld_s > rows; and rows of 40
    blocks, whose panel holds 32 of the 64 rows at a time."""
    sym = f"{name[:2].lower()}_K_q8_K"
    if not hasattr(lib, "lp_gemm_" + sym):
        assert "avx" not in os.path.basename(lib._name)
        pytest.skip(f"this library has no lp_gemm_{sym}")
    check_gemm(lib, name, sym, 70, 256 * 11, n_cols=41, ncs=(1, 7, 8, 9, 16, 25, 32, 41), nrs=(1, 16, 70), seed=23,
               scale=3.0)
    check_gemm(lib, name, sym, 66, 256 * 40, n_cols=33, ncs=(33,), nrs=(66,), seed=5)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_gemm_at_the_extremes(lib: ctypes.CDLL, name: str) -> None:
    """The largest quants (every bit set: 15, 31, 63 with scales 63 / 127) against activations
    that quantize to -127 everywhere, and against +-127 alternating: the AVX-512 gemms' 16-bit
    per-lane sums (4 x 63 x 127 < 2^15 for Q6_K) hold them; each output is its vec_dot's."""
    sym = f"{name[:2].lower()}_K_q8_K"
    if not hasattr(lib, "lp_gemm_" + sym):
        assert "avx" not in os.path.basename(lib._name)
        pytest.skip(f"this library has no lp_gemm_{sym}")
    n_in, n_rows = 256 * 3, 9
    w = random_raw(name, n_rows, n_in, np.random.default_rng(2))
    blocks = w.reshape(-1, block_size(GGMLType[name])[1])
    if name == "Q6_K":
        blocks[:, :192] = 0xFF  # ql, qh: every quant 63
        blocks[:, 192:208] = 127  # scales
    else:
        f16 = {"Q4_K": 4, "Q5_K": 4}[name]  # d, dmin first; then 12 scale bytes
        blocks[:, f16 : f16 + 12] = 0xFF  # every scale and min 63
        blocks[:, f16 + 12 :] = 0xFF  # (Q5_K: qh too) every quant at its largest
    x = np.ones((40, n_in), np.float32)
    x[20:, 1::2] = -1.0  # -127 and +127 alternating
    xq = quantize_act(lib, name, x)
    assert (xq[:20, 4:260].view(np.int8) == -127).all()  # (q8_K: d, then the 256 quants of a block)
    check_gemm(lib, name, sym, n_rows, n_in, n_cols=40, ncs=(8, 40), nrs=(n_rows,), seed=0, act=xq, w=w)


def test_dispatch_table(lib: ctypes.CDLL) -> None:
    for name in OWN_TYPES:
        assert lib.lp_vec_dot_type(GGML_ID[name]) == GGML_ID[VEC_DOT_TYPE[name]]
    assert lib.lp_vec_dot_type(9) == -1  # Q8_1 weights: no kernel (ggml has none either)
    assert lib.lp_vec_dot_type(12345) == -1
    assert lib.lp_act_row_bytes(GGML_ID["Q4_0"], 48) == -1  # not a whole block
    # K types: kquants.c's kernels when built in, else reported as missing (the caller falls back)
    for name in K_TYPES:
        have = hasattr(lib, f"lp_vec_dot_{name[:2].lower()}_K_q8_K") and hasattr(lib, "lp_quantize_row_q8_K")
        assert lib.lp_vec_dot_type(GGML_ID[name]) == (GGML_ID["Q8_K"] if have else -1)


def test_variant_forced_by_env() -> None:
    """LLAMAPY_KERNELS_VARIANT picks the library; one this CPU lacks is refused, not crashed on."""
    code = "from llamapy.backend import native; print(native.variant(), native.error())"
    for v in native.built():
        env = {**os.environ, "LLAMAPY_KERNELS_VARIANT": v}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        if native.runnable(v):
            assert out.stdout.split()[0] == v, out.stdout
        else:
            assert out.stdout.startswith("None this CPU lacks"), out.stdout
    env = {**os.environ, "LLAMAPY_KERNELS_VARIANT": "nope"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("None unknown kernel variant"), out.stdout


def test_best_variant_chosen() -> None:
    flags = frozenset({"avx2", "fma", "f16c"})
    assert native.runnable("avx2", flags) and not native.runnable("avx512", flags)
    assert native.runnable("portable", frozenset())
    env = {k: v for k, v in os.environ.items() if k != "LLAMAPY_KERNELS_VARIANT"}
    code = "from llamapy.backend import native; print(native.variant())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    best = next((v for v in native.built() if native.runnable(v)), None)
    assert out.stdout.strip() == str(best)


GEMM_NAMES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q2_K": "q2_K_q8_K"}


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q2_K"])
def test_gemm_of_float_types_and_q2_k_is_vec_dots(lib: ctypes.CDLL, name: str) -> None:
    """The multi-column kernels of the float types (a row length that takes every SIMD step and
    a scalar tail: 871 = 13 x 64 + 2 x 16 + 7 = 6 x 128 + 3 x 32 + 7) and of Q2_K."""
    if name == "Q2_K" and not hasattr(lib, "lp_gemm_q2_K_q8_K"):
        assert "avx" not in os.path.basename(lib._name)  # the AVX2 and AVX-512 builds have it
        pytest.skip("this library has no lp_gemm_q2_K_q8_K")
    n_in = 256 * 3 if name == "Q2_K" else 871
    check_gemm(lib, name, GEMM_NAMES[name], 5, n_in, n_cols=4, ncs=(1, 2, 3, 4), nrs=(5,), seed=n_in)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_panels_are_vec_dots(lib: ctypes.CDLL, name: str) -> None:
    """lp_gemm_<f32|f16|bf16>_panel (the float types' prompt kernels, AVX2 and AVX-512: the
    activations converted to float32 once, 2 x 3 tiles): every output its vec_dot's bit for bit for
    column counts around the tile's 3, odd row counts, a row length with every SIMD step and a
    scalar tail, and rows long enough for several blocks of FK_PANEL_BYTES (2 MiB: 32 F32 rows of
    16391, 64 F16 ones)."""
    sym = GEMM_NAMES[name] + "_panel"
    if not hasattr(lib, "lp_gemm_" + sym):
        assert "avx" not in os.path.basename(lib._name)  # the AVX2 and AVX-512 builds have them
        pytest.skip(f"this library has no lp_gemm_{sym}")
    check_gemm(lib, name, sym, 61, 871, n_cols=13, ncs=(1, 2, 3, 4, 5, 7, 13), nrs=(1, 2, 3, 5, 61), seed=17)
    check_gemm(lib, name, sym, 131, 16391, n_cols=4, ncs=(4,), nrs=(131,), seed=19)


def test_bf16_without_avx512_bf16(tmp_path: "os.PathLike[str]") -> None:
    """The avx512 library runs vdpbf16ps only where the CPU has AVX512_BF16; its other BF16 body
    (what such CPUs run) is quants.c built here with LP_NO_BF16DP: against float64 and its gemm."""
    import shutil

    if not native.runnable("avx512"):
        pytest.skip("this CPU cannot run the avx512 kernels")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler")
    so = os.path.join(tmp_path, "libq_nobf16dp.so")
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]
    cmd = [cc, "-O2", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-Wall", "-Werror", "-DLP_NO_BF16DP", *flags,
           str(native.SRC_DIR / "quants.c"), "-o", so, "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(so)
    lib.lp_vec_dot_bf16.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    n_in, rng = 871, np.random.default_rng(3)
    w = random_raw("BF16", 3, n_in, rng)
    x = rng.standard_normal((4, n_in)).astype(np.float32)
    y = np.ascontiguousarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)).view(np.uint8).reshape(4, -1)
    s = ctypes.c_float()
    for row in w:
        for t in range(4):
            lib.lp_vec_dot_bf16(n_in, ctypes.byref(s), ptr(row), ptr(y[t]))
            want, mag = ref_dot("BF16", row, y[t], x[t])
            assert abs(s.value - want) <= 2e-6 * mag + 1e-30
    check_gemm(lib, "BF16", "bf16", 5, n_in, n_cols=4, ncs=(1, 2, 3, 4), nrs=(5,), seed=n_in, act=y)
    check_gemm(lib, "BF16", "bf16_panel", 5, n_in, n_cols=4, ncs=(1, 3, 4), nrs=(5,), seed=n_in, act=y)
