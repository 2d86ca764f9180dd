"""The quant types mixture-of-experts models ship in — IQ4_NL, IQ4_XS, MXFP4 — and Q4_0, which
llama.cpp's x86 builds run through the same repacked 8x8 kernels as IQ4_NL, end to end on the
CPU: numpy dequantization against gguf-py's (`gguf.quants`, which has all three), the C
dequantization (kernels_c/iquants.c `lp_dequantize_rows`) against numpy, the q8 dot products
against an exact emulation of llama.cpp 0.3.36's x86 float32 order (IQ4_NL / MXFP4: its repacked
8x8 gemv/gemm, Q4_0 too, one fmaf chain per output; IQ4_XS: its tiled prompt microkernels, a product and an
fmaf per 256-element block), the multi-row / multi-column kernels against the vec_dot bit for bit, and QMatrix's
products in both modes against float64 references. Every SIMD variant the install built and this
CPU runs."""

from __future__ import annotations

import ctypes
from fractions import Fraction

import gguf.quants
import numpy as np
import pytest

from llamapy import quants
from llamapy.backend import native
from llamapy.backend.qmatmul import SGEMM_MIN_TOKENS, QMatrix, use_sgemm
from llamapy.types import GGMLType, block_size

IQ_TYPES = ["IQ4_NL", "IQ4_XS", "MXFP4"]  # iquants.c's dequantization (Q4_0's: quants.py, qmatmul.c)
TYPES = [*IQ_TYPES, "Q4_0"]
QK_K = 256
VDT = {"IQ4_NL": "q8_0", "MXFP4": "q8_0", "IQ4_XS": "q8_K", "Q4_0": "q8_0"}


def random_blocks(name: str, n_rows: int, n_cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """(n_rows, row_bytes) uint8 of random quants, with small finite scales (f16 d; MXFP4's E8M0
    exponent around 2^-7)."""
    qt = GGMLType[name]
    blck, bsize = block_size(qt)
    raw = rng.integers(0, 256, (n_rows, n_cols // blck * bsize), dtype=np.uint8)
    b = raw.reshape(-1, bsize)
    if name == "MXFP4":
        b[:, 0] = rng.integers(118, 124, b.shape[0])
    else:
        b[:, 0:2] = (rng.random(b.shape[0]) * scale + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def variants() -> list[str]:
    return [v for v in native.VARIANTS if v in native.built()]


@pytest.fixture(params=native.VARIANTS)
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    v = request.param
    if v not in native.built():
        pytest.skip(f"the {v} kernels are not built")
    if not native.runnable(v):
        pytest.skip(f"this CPU cannot run the {v} kernels (needs {' '.join(sorted(native.REQUIRES[v]))})")
    lib = native.load(v)
    if not hasattr(lib, "lp_dequantize_rows"):
        pytest.skip(f"the {v} library was built without kernels_c/iquants.c: rebuild (setup.py build_ext)")
    return lib


# ------------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("name", IQ_TYPES)
def test_numpy_dequantize_matches_gguf_bitwise(name: str) -> None:
    rng = np.random.default_rng(11)
    raw = random_blocks(name, 7, 1024, rng)
    ref = gguf.quants.dequantize(raw, GGMLType[name]).reshape(7, 1024).astype(np.float32)
    got = quants.dequantize(raw, GGMLType[name], 1024)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_mxfp4_every_exponent_matches_gguf() -> None:
    """All 256 E8M0 exponents (the subnormal scales of e = 0, 1; inf at e = 255) and all 16 codes."""
    raw = np.zeros((256, 17), np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = np.arange(16, dtype=np.uint8) * 17  # code j in both nibbles of byte j
    with np.errstate(over="ignore"):
        ref = gguf.quants.dequantize(raw, GGMLType.MXFP4).reshape(256, 32).astype(np.float32)
    got = quants.dequantize(raw, GGMLType.MXFP4, 32)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert got[128, 7] == 12.0 and got[128, 15] == -12.0 and got[0, 1] == 2.0**-128


@pytest.mark.parametrize("name", IQ_TYPES)
def test_c_dequantize_matches_numpy(lib: ctypes.CDLL, name: str) -> None:
    rng = np.random.default_rng(12)
    raw = random_blocks(name, 5, 512, rng)
    out = np.full((5, 520), np.nan, np.float32)  # ld_out 520: the gaps stay untouched
    fn = lib.lp_dequantize_rows
    assert fn(int(GGMLType[name]), raw.ctypes.data, 5, raw.shape[1], 512, out.ctypes.data, 520) == 0
    ref = quants.dequantize(raw, GGMLType[name], 512)
    np.testing.assert_array_equal(out[:, :512].view(np.uint32), ref.view(np.uint32))
    assert np.isnan(out[:, 512:]).all()
    assert fn(int(GGMLType.Q4_K), raw.ctypes.data, 5, raw.shape[1], 512, out.ctypes.data, 520) == -1


# ------------------------------------------------------------------------------------------------
# dot products in llama.cpp's float32 order


def _fmaf(a: float, b: float, c: float) -> np.float32:
    """a * b + c rounded once to float32 (nearest, ties to even), exactly."""
    r = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(r))
    cands = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - r), int(np.float32(v).view(np.uint32)) & 1))


def _values(name: str, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One weight row -> (its integer values (nb, block elements), its block scales float32)."""
    qt = GGMLType[name]
    blck, bsize = block_size(qt)
    b = row.reshape(-1, bsize)
    if name == "MXFP4":
        return quants.KVALUES_MXFP4[quants._nibbles(b[:, 1:17], 16).reshape(-1, 32)].astype(np.int64), \
            quants.e8m0_to_f32_half(b[:, 0])
    d = np.ascontiguousarray(b[:, 0:2]).view(np.float16).astype(np.float32).reshape(-1)
    if name == "IQ4_NL":
        return quants.KVALUES_IQ4NL[quants._nibbles(b[:, 2:18], 16).reshape(-1, 32)].astype(np.int64), d
    if name == "Q4_0":
        return quants._nibbles(b[:, 2:18], 16).reshape(-1, 32).astype(np.int64) - 8, d
    q = quants.KVALUES_IQ4NL[quants._nibbles(b[:, 8:136], 16).reshape(-1, 8, 32)].astype(np.int64)
    return q * quants.iq4_xs_scales(b).astype(np.int64)[:, :, None], d  # (nb, 8, 32): scale * value


def _ggml_x86_dot(name: str, row: np.ndarray, act: np.ndarray) -> np.float32:
    f32 = np.float32
    v, dw = _values(name, row)
    if name == "IQ4_XS":  # act: q8_K blocks; the tiled microkernels' order (llama.cpp's prompts)
        q8 = act["qs"].astype(np.int64).reshape(-1, 8, 32)
        acc = f32(0)
        for i in range(v.shape[0]):
            r = f32(f32(int((v[i] * q8[i]).sum())) * dw[i])
            acc = _fmaf(r, f32(act["d"][i]), acc)
        return acc
    b = act.reshape(-1, 34)  # q8_0 blocks
    dy = np.ascontiguousarray(b[:, 0:2]).view(np.float16).astype(np.float32).reshape(-1)
    q8 = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int64)
    acc = f32(0)
    for i in range(v.shape[0]):
        acc = _fmaf(f32(int(v[i] @ q8[i])), f32(dw[i] * dy[i]), acc)
    return acc


def _activation(name: str, x: np.ndarray) -> np.ndarray:
    if name == "IQ4_XS":
        return quants.quantize_q8_k(x.astype(np.float32)).reshape(-1)
    return quants.quantize_q8_act(x.reshape(1, -1).astype(np.float32), GGMLType.Q8_0).reshape(-1)


def _vec_dot(lib: ctypes.CDLL, name: str, raw: np.ndarray, act: np.ndarray, n: int) -> np.ndarray:
    fn = getattr(lib, f"lp_vec_dot_{name.lower()}_{VDT[name]}")
    act = np.ascontiguousarray(act)
    out = np.zeros(raw.shape[0], np.float32)
    for r in range(raw.shape[0]):
        fn(n, out[r:].ctypes.data, np.ascontiguousarray(raw[r]).ctypes.data, act.ctypes.data)
    return out


@pytest.mark.parametrize("name", TYPES)
def test_vec_dot_in_ggml_x86_order(lib: ctypes.CDLL, name: str) -> None:
    """Bit for bit llama.cpp's x86 float32 order (so llama-perplexity's results on the same file)."""
    rng = np.random.default_rng(13 + TYPES.index(name))
    n = 3 * QK_K
    raw = random_blocks(name, 5, n, rng)
    for x in (rng.standard_normal(n) * 3, rng.uniform(-1, 1, n) ** 3 * 50):
        act = _activation(name, x)
        got = _vec_dot(lib, name, raw, act, n)
        want = np.array([_ggml_x86_dot(name, raw[r], act) for r in range(raw.shape[0])], np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, got, want)


@pytest.mark.parametrize("name", TYPES)
def test_vec_dot_close_to_float64(lib: ctypes.CDLL, name: str) -> None:
    """Against the float64 sum of the dequantized weights times the dequantized activations."""
    rng = np.random.default_rng(14)
    n = 8 * QK_K
    raw = random_blocks(name, 9, n, rng)
    x = rng.standard_normal(n).astype(np.float32)
    act = _activation(name, x)
    w = quants.dequantize(raw, GGMLType[name], n).astype(np.float64)
    if name == "IQ4_XS":
        xa = (act["qs"].astype(np.float64) * act["d"].astype(np.float64)[:, None]).reshape(-1)
    else:
        xa = quants.dequantize(act, GGMLType.Q8_0, n).astype(np.float64).reshape(-1)
    want = w @ xa
    got = _vec_dot(lib, name, raw, act, n)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(w * xa).sum(axis=1).max()))


def _gemm(lib: ctypes.CDLL, fn_name: str, n: int, raw: np.ndarray, acts: np.ndarray, gemv: bool = False) -> np.ndarray:
    nr, nc = raw.shape[0], acts.shape[0]
    fn = getattr(lib, fn_name)
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    out = np.full((nc, nr), np.nan, np.float32)
    if gemv:
        fn.argtypes, fn.restype = [INT, P, P, I64, INT, P], None
        fn(n, out.ctypes.data, raw.ctypes.data, raw.shape[1], nr, acts.ctypes.data)
    else:
        fn.argtypes, fn.restype = [INT, P, I64, P, I64, INT, P, I64, INT], None
        fn(n, out.ctypes.data, nr, raw.ctypes.data, raw.shape[1], nr, acts.ctypes.data, acts.shape[1], nc)
    return out


@pytest.mark.parametrize("name", TYPES)
def test_gemm_and_gemv_equal_vec_dot(lib: ctypes.CDLL, name: str) -> None:
    """Any row count (the 8-row SIMD groups and the rows left over) and 1-6 columns. The SIMD
    builds have these kernels wherever they have the other types' (the portable one has none)."""
    suffix = f"{name.lower()}_{VDT[name]}"
    if not hasattr(lib, "lp_gemm_q4_0_q8_0"):
        assert not hasattr(lib, f"lp_gemm_{suffix}")
        pytest.skip("the portable build has no multi-column kernels (a vec_dot per output)")
    rng = np.random.default_rng(15)
    n = 9 * QK_K  # the prompt kernels' panels hold 32 (IQ4_NL, MXFP4) / 4 (IQ4_XS) blocks: several
    raw = np.ascontiguousarray(random_blocks(name, 21, n, rng))
    acts = np.stack([_activation(name, rng.standard_normal(n) * (1 + c)).view(np.uint8) for c in range(6)])
    want = np.stack([_vec_dot(lib, name, raw, acts[c].view(act_dtype(name)), n) for c in range(6)])
    for nc in (1, 2, 3, 4, 5, 6):
        got = _gemm(lib, f"lp_gemm_{suffix}", n, raw, np.ascontiguousarray(acts[:nc]))
        assert np.array_equal(got.view(np.uint32), want[:nc].view(np.uint32)), nc
    got = _gemm(lib, f"lp_gemv_{suffix}", n, raw, np.ascontiguousarray(acts[:1]), gemv=True)
    assert np.array_equal(got.view(np.uint32), want[:1].view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_0", "MXFP4"])
def test_int16_sums_at_the_grids_extremes(lib: ctypes.CDLL, name: str) -> None:
    """The AVX2 kernels add several maddubs results in int16 for the grids that fit maddubs
    unsigned (iquants.c g16: Q4_0's 0..15 eight at a time, MXFP4's 0..24 four): at the largest
    unsigned value in every weight and activations of +-127 everywhere (the largest pair sums, of
    both signs), every kernel still gives llama.cpp's x86 result (no int16 overflow)."""
    suffix = f"{name.lower()}_{VDT[name]}"
    if not hasattr(lib, f"lp_gemm_{suffix}"):
        pytest.skip("the portable build has no multi-column kernels (a vec_dot per output)")
    n, nr = 4 * QK_K, 19
    raw = np.ascontiguousarray(random_blocks(name, nr, n, np.random.default_rng(20)))
    b = raw.reshape(-1, block_size(GGMLType[name])[1])
    b[:, -16:] = 0xFF if name == "Q4_0" else 0x77  # unsigned grid 15 / 24 (values 7 / 12)
    acts = np.stack([_activation(name, np.full(n, sign, np.float32)).view(np.uint8) for sign in (1, -1)] * 8)
    assert (np.abs(acts.reshape(16, -1, 34)[:, :, 2:].view(np.int8)) == 127).all()
    want = np.array([[_ggml_x86_dot(name, raw[r], acts[c]) for r in range(nr)] for c in range(16)], np.float32)
    for nc in (1, 2, 3, 4, 5, 16):  # the decode kernels, then the prompt panel
        got = _gemm(lib, f"lp_gemm_{suffix}", n, raw, np.ascontiguousarray(acts[:nc]))
        assert np.array_equal(got.view(np.uint32), want[:nc].view(np.uint32)), nc
    got = _gemm(lib, f"lp_gemv_{suffix}", n, raw, np.ascontiguousarray(acts[:1]), gemv=True)
    assert np.array_equal(got.view(np.uint32), want[:1].view(np.uint32))


def act_dtype(name: str) -> np.dtype:
    return quants.Q8_K_DTYPE if name == "IQ4_XS" else np.dtype(np.uint8)


# ------------------------------------------------------------------------------------------------
# QMatrix: the q8 mode's products at every batch size, the f32 mode, GET_ROWS


@pytest.mark.parametrize("name", TYPES)
def test_qmatrix_q8_mode_is_batch_invariant_and_matches_vec_dot(name: str) -> None:
    if native.lib() is None or not hasattr(native.lib(), "lp_dequantize_rows"):
        pytest.skip("no kernel library with kernels_c/iquants.c")
    rng = np.random.default_rng(16)
    n_out, n_in = 72, 2 * QK_K
    raw = random_blocks(name, n_out, n_in, rng)
    m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in)
    assert m.vec_dot_type() == int(GGMLType.Q8_K if name == "IQ4_XS" else GGMLType.Q8_0)
    # a build with the multi-column q8 kernels never takes sgemm (prompts keep llama.cpp's order);
    # the portable build has none and takes sgemm from SGEMM_MIN_TOKENS by design
    n_batch = SGEMM_MIN_TOKENS - 1 if use_sgemm(GGMLType[name], n_out, n_in, 40) else 40
    x = rng.standard_normal((n_batch, n_in)).astype(np.float32)
    assert m.path(n_batch, q8=True) == "q8"
    full = m.matmul(x, n_threads=2)
    for n_tok in (1, 3, 8, 17)[: 3 if n_batch < 17 else 4]:
        part = m.matmul(x[:n_tok], n_threads=2)
        assert np.array_equal(part.view(np.uint32), full[:n_tok].view(np.uint32)), n_tok
    lib = native.lib()
    for t in (0, n_batch - 1):
        want = _vec_dot(lib, name, raw, _activation(name, x[t]), n_in)
        assert np.array_equal(full[t].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", TYPES)
def test_qmatrix_f32_mode_and_get_rows(name: str) -> None:
    rng = np.random.default_rng(17)
    n_out, n_in = 40, QK_K
    raw = random_blocks(name, n_out, n_in, rng)
    m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in, repack=True)
    w = quants.dequantize(raw, GGMLType[name], n_in)
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    got = m.matmul(x, q8=False)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert (np.abs(got - want) <= 1e-6 * (np.abs(x) @ np.abs(w).T)).all()  # float32 sums of |w x|
    ids = np.array([3, 0, 39, 3])
    np.testing.assert_array_equal(m.get_rows(ids).view(np.uint32), w[ids].view(np.uint32))


# ------------------------------------------------------------------------------------------------
# the decode kernels (stop 29) and MUL_MAT_ID's workspace


@pytest.mark.parametrize("name", TYPES)
def test_decode_kernels_at_every_scale_equal_vec_dot(lib: ctypes.CDLL, name: str) -> None:
    """The decode kernels (lp_gemv_*, lp_gemm_* at 1-4 columns), which gather 8 rows' block scales
    at once, against the vec_dot bit for bit at any scale a file can hold: every E8M0 exponent
    (0 and 1: subnormal results) for MXFP4, random finite f16 bits (subnormals and negatives
    included) for IQ4_NL / IQ4_XS; whole 8-row groups and rows left over; 5 columns (the prompt
    kernel) too."""
    suffix = f"{name.lower()}_{VDT[name]}"
    if not hasattr(lib, "lp_gemm_q4_0_q8_0"):
        pytest.skip("the portable build has no multi-column kernels (a vec_dot per output)")
    rng = np.random.default_rng(18)
    n, nr = 2 * QK_K, 8 * 4 + 3
    raw = np.ascontiguousarray(random_blocks(name, nr, n, rng))
    b = raw.reshape(-1, block_size(GGMLType[name])[1])
    if name == "MXFP4":
        b[:, 0] = np.arange(b.shape[0]) % 256  # 35 rows x 16 blocks: every exponent
    else:
        bits = rng.integers(0, 0x7C00, b.shape[0]) | (rng.integers(0, 2, b.shape[0]) << 15)
        b[:, 0:2] = bits.astype(np.uint16).view(np.uint8).reshape(-1, 2)
    acts = np.stack([_activation(name, rng.standard_normal(n) * (1 + c)).view(np.uint8) for c in range(5)])
    want = np.stack([_vec_dot(lib, name, raw, acts[c].view(act_dtype(name)), n) for c in range(5)])
    for nc in (1, 2, 3, 4, 5):
        got = _gemm(lib, f"lp_gemm_{suffix}", n, raw, np.ascontiguousarray(acts[:nc]))
        assert np.array_equal(got.view(np.uint32), want[:nc].view(np.uint32)), nc
    got = _gemm(lib, f"lp_gemv_{suffix}", n, raw, np.ascontiguousarray(acts[:1]), gemv=True)
    assert np.array_equal(got.view(np.uint32), want[:1].view(np.uint32))


@pytest.mark.parametrize("name", TYPES)
def test_mul_mat_id_workspace_equals_allocated_and_vec_dot(name: str) -> None:
    """lp_mul_mat_id_q with a workspace of lp_mul_mat_id_q_wsp bytes (the executor's, in its
    arena) and without one (allocated by the call): the same bits, each (token, slot) its
    expert's rows times its activation row, as the vec_dot; experts shared by several tokens,
    unaligned workspace, 2 threads; a type without kernels has no workspace size (-1)."""
    lib = native.lib()
    if lib is None or not hasattr(lib, "lp_dequantize_rows"):
        pytest.skip("no kernel library with kernels_c/iquants.c")
    rng = np.random.default_rng(19)
    qt = GGMLType[name]
    E, M, n, T, U = 4, 20, QK_K, 6, 3
    raw = np.ascontiguousarray(random_blocks(name, E * M, n, rng))
    x = rng.standard_normal((T, n)).astype(np.float32)
    acts = np.stack([_activation(name, x[t]).view(np.uint8) for t in range(T)])
    ids = np.stack([rng.permutation(E)[:U] for _ in range(T)]).astype(np.int32)
    P = ctypes.c_void_p
    nbytes = lib.lp_mul_mat_id_q_wsp(int(qt), E, M, n, T, U)
    assert nbytes > 0 and lib.lp_mul_mat_id_q_wsp(99, E, M, n, T, U) == -1
    wsp = np.full(nbytes + 1, 0xAB, np.uint8)
    outs = []
    for w in (P(wsp[1:].ctypes.data), None):
        y = np.full((T, U, M), np.nan, np.float32)
        rc = lib.lp_mul_mat_id_q(int(qt), P(raw.ctypes.data), E, M, raw.shape[1], n, P(acts.ctypes.data), 1,
                                 P(ids.ctypes.data), U, T, U, P(y.ctypes.data), w, 2)
        assert rc == 0
        outs.append(y)
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    for t in range(T):
        for u in range(U):
            rows = raw[ids[t, u] * M:(ids[t, u] + 1) * M]
            want = _vec_dot(lib, name, rows, acts[t].view(act_dtype(name)), n)
            assert np.array_equal(outs[0][t, u].view(np.uint32), want.view(np.uint32)), (t, u)
