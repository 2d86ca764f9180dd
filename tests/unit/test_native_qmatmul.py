"""kernels_c/qmatmul.c: matvec and dequantization on the repacked tiles, against gguf-py.

lp_mv_*: |err| <= 1e-5 * (|x| @ |w|.T) per output against float64 x @ w.T;
lp_dqt_* / lp_dqr_*: bit for bit with gguf.quants.dequantize, random bytes in every quant field.
"""

from __future__ import annotations

import ctypes

import gguf.quants
import numpy as np
import pytest
from tests_support import wait_child

from llamapy.types import GGMLType, block_size

try:  # tests/unit may or may not be a package
    from .test_native_quants import load_variant
    from .test_quants import random_raw
except ImportError:
    from test_native_quants import load_variant  # type: ignore[no-redef]
    from test_quants import random_raw  # type: ignore[no-redef]

try:
    from llamapy.backend import native, qmatmul
except ImportError as e:  # pragma: no cover - depends on the checkout
    pytest.skip(f"llamapy.backend.native: {e}", allow_module_level=True)

R = 64  # LP_R
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
# Byte ranges of the f16 scale fields in a block; everything else is quant bits.
SCALES = {"Q4_0": [(0, 2)], "Q4_1": [(0, 4)], "Q8_0": [(0, 2)], "Q4_K": [(0, 4)], "Q6_K": [(208, 210)]}


@pytest.fixture(scope="module", params=list(native.VARIANTS))
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """Each SIMD variant the install built (the portable one: no FMA / F16C on x86-64, plain 8-lane
    vectors of the baseline target; the f16 scales widened from their bits)."""
    return load_variant(request.param)


def make(name: str, n_tiles: int, n_in: int, seed: int, special: bool = False):
    """(raw bytes, repacked arrays, float32 weights from gguf-py) of a random n_tiles*64 x n_in
    matrix. Quant bits are random bytes (incl. values gguf-py never writes, e.g. q8 = -128);
    `special` also puts inf / nan / 0 / -0 / subnormal / max f16 values and a signalling nan
    among the scales."""
    qt = GGMLType[name]
    n_out = n_tiles * R
    rng = np.random.default_rng(seed)
    raw = random_raw(name, n_out, n_in, rng)
    blck, bsize = block_size(qt)
    blocks = raw.reshape(-1, bsize)
    keep = np.zeros(bsize, bool)
    for a, b in SCALES[name]:
        keep[a:b] = True
    rnd = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
    blocks[:, ~keep] = rnd[:, ~keep]
    if special:
        vals = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 6e-8, 65504.0, -3.5], np.float16).view(np.uint16)
        vals = np.append(vals, np.uint16(0xFD01)).view(np.uint8)  # a (negative) signalling nan
        a = SCALES[name][0][0]
        for i, v in enumerate(vals.reshape(-1, 2)):
            blocks[i * 7 % blocks.shape[0], a : a + 2] = v
    rp = qmatmul._REPACK[qt](raw.reshape(n_tiles, R, n_in // blck, bsize))
    with np.errstate(invalid="ignore", over="ignore"):  # the special scales
        w = gguf.quants.dequantize(raw, qt).reshape(n_out, n_in).astype(np.float32)
    return raw, rp, w


def nb_of(name: str, n_in: int) -> int:
    return n_in // block_size(GGMLType[name])[0]


def fn(lib: ctypes.CDLL, kind: str, name: str):
    return getattr(lib, f"lp_{kind}_{name.lower()}")


def check_mv(lib: ctypes.CDLL, name: str, rp, w: np.ndarray, n_tok: int, n_threads: int, seed: int) -> None:
    n_out, n_in = w.shape
    n_tiles = n_out // R
    x = np.random.default_rng(seed).standard_normal((n_tok, n_in)).astype(np.float32)
    ld = n_out + 5  # columns past the tiles (a matrix's tail rows) stay untouched
    out = np.full((n_tok, ld), 7.0, np.float32)
    fn(lib, "mv", name)(native.parts(rp), n_tiles, nb_of(name, n_in), x.ctypes.data, n_tok, out.ctypes.data, ld,
                        n_threads)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T)
    err = np.abs(out[:, :n_out] - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"
    assert np.all(out[:, n_out:] == 7.0)


@pytest.mark.parametrize("name", TYPES)
def test_mv(lib: ctypes.CDLL, name: str) -> None:
    # 5 tiles x 1024 inputs = 327680 weights per token: threaded with n_threads=2 (uneven
    # chunks), single-threaded below the threshold (the 96 / 256-wide matrix).
    for n_in, seed in ((1024, 1), (256 if name.endswith("K") else 96, 2)):
        _, rp, w = make(name, 5 if n_in == 1024 else 3, n_in, seed)
        for n_tok in (1, 3, 7):
            for n_threads in (1, 2):
                check_mv(lib, name, rp, w, n_tok, n_threads, seed=10 * n_tok + n_threads)


@pytest.mark.parametrize("name", TYPES)
def test_mv_propagates_nan_and_inf(lib: ctypes.CDLL, name: str) -> None:
    _, rp, w = make(name, 1, 256, 3)
    x = np.ones((1, 256), np.float32)
    x[0, 5] = np.nan
    out = np.zeros((1, R), np.float32)
    fn(lib, "mv", name)(native.parts(rp), 1, nb_of(name, 256), x.ctypes.data, 1, out.ctypes.data, R, 1)
    assert np.isnan(out).all()
    x[0, 5] = np.inf
    fn(lib, "mv", name)(native.parts(rp), 1, nb_of(name, 256), x.ctypes.data, 1, out.ctypes.data, R, 1)
    assert not np.isfinite(out).any()


@pytest.mark.parametrize("name", TYPES)
def test_dqt_bit_exact(lib: ctypes.CDLL, name: str) -> None:
    n_tiles, n_in = 5, 1024
    _, rp, w = make(name, n_tiles, n_in, 4, special=True)
    nb = nb_of(name, n_in)
    for t0, t1, n_threads in ((0, n_tiles, 1), (0, n_tiles, 2), (1, 4, 2), (3, 4, 1), (2, 2, 2)):
        ld = (t1 - t0) * R + 16
        out_t = np.full((n_in, ld), 7.0, np.float32)
        fn(lib, "dqt", name)(native.parts(rp), t0, t1, nb, out_t.ctypes.data, ld, n_threads)
        got = out_t[:, : (t1 - t0) * R].T
        np.testing.assert_array_equal(got.view(np.uint32), w[t0 * R : t1 * R].view(np.uint32))
        assert np.all(out_t[:, (t1 - t0) * R :] == 7.0)


@pytest.mark.parametrize("name", TYPES)
def test_dqr_bit_exact(lib: ctypes.CDLL, name: str) -> None:
    n_tiles, n_in = 3, 512
    _, rp, w = make(name, n_tiles, n_in, 5, special=True)
    ids = np.array([n_tiles * R - 1, 0, 64, 3, 63, 65, 3, 130], np.int64)
    out = np.full((ids.size + 1, n_in), 7.0, np.float32)
    f = fn(lib, "dqr", name)
    f(native.parts(rp), nb_of(name, n_in), ids.ctypes.data, ids.size, out.ctypes.data)
    np.testing.assert_array_equal(out[:-1].view(np.uint32), w[ids].view(np.uint32))
    assert np.all(out[-1] == 7.0)
    f(native.parts(rp), nb_of(name, n_in), ids.ctypes.data, 0, out.ctypes.data)  # n = 0: nothing
    np.testing.assert_array_equal(out[:-1].view(np.uint32), w[ids].view(np.uint32))


def test_threads_after_fork(lib: ctypes.CDLL) -> None:
    """A fork child of a process that ran threaded kernels must not hang in libgomp."""
    import os

    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    _, rp, w = make("Q8_0", 8, 1024, 7)
    x = np.ones((1, 1024), np.float32)
    out = np.empty((1, 8 * R), np.float32)
    args = (native.parts(rp), 8, 32, x.ctypes.data, 1, out.ctypes.data, 8 * R, 2)
    lib.lp_mv_q8_0(*args)  # starts the OpenMP team here
    ref = out.copy()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            out[:] = 0
            lib.lp_mv_q8_0(*args)
            os._exit(0 if np.array_equal(out, ref) else 1)
        finally:
            os._exit(2)
    wait_child(pid, "a threaded kernel")
