"""llamapy.backend.qmatmul: quantized MUL_MAT, GET_ROWS and dequantize against float64 math."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf.quants
import numpy as np
import pytest

from llamapy.backend import native, qmatmul
from llamapy.backend.qmatmul import QMatrix
from llamapy.types import GGMLType, UnsupportedError

try:  # tests/unit may or may not be a package
    from .test_quants import ALL_TYPES, random_raw
except ImportError:
    from test_quants import ALL_TYPES, random_raw  # type: ignore[no-redef]

K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def shape_for(name: str) -> tuple[int, int]:
    # n_out not a multiple of the thread count or a tile; n_in several blocks.
    return (37, 512) if name in K_TYPES else (37, 96)


def check_matmul(m: QMatrix, w: np.ndarray, x: np.ndarray, **kw: int) -> None:
    """|err| <= 1e-5 * (|x| @ |w|.T) per output, against float64 x @ w.T."""
    got = m.matmul(x, **kw)
    assert got.dtype == np.float32 and got.shape == (x.shape[0], m.n_out)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T)
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"


def max_nbytes(m: QMatrix, raw: np.ndarray) -> int:
    """What a matrix may hold: the file's bytes. A repacked one only reorders them (tail rows
    copied in the file's layout, f16 scales kept as f16), except Q4_K's 12 bytes of packed 6-bit
    scales and mins per block, unpacked to 16."""
    extra = 0
    if m.repacked and m.qtype == GGMLType.Q4_K:
        extra = (m.n_out - m.data.shape[0]) * (m.n_in // 256) * 4
    return raw.nbytes + extra


def _available(impl: str) -> bool:
    if impl == "c":
        return native.lib() is not None
    return qmatmul.numba_kernels() is not None


@pytest.fixture(params=["c", "numba"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test that uses it runs once on the C kernels and once on numba's."""
    if not _available(request.param):
        pytest.skip(f"{request.param} kernels not available: {native.error() or qmatmul._nk_error}")
    monkeypatch.setattr(qmatmul, "_kernels", request.param)
    return request.param


@pytest.fixture(params=ALL_TYPES)
def qmat(request: pytest.FixtureRequest, impl: str) -> tuple[QMatrix, np.ndarray, np.ndarray]:
    name = request.param
    n_out, n_in = shape_for(name)
    raw = random_raw(name, n_out, n_in, np.random.default_rng(4))
    raw.flags.writeable = False  # like the GGUF memmap
    w = gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_out, n_in).astype(np.float32)
    return QMatrix.prepare(raw, GGMLType[name], n_out, n_in), w, raw


@pytest.mark.parametrize("n_tokens", [1, 3, 33])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_matmul(qmat, n_tokens: int, n_threads: int) -> None:
    m, w, _ = qmat
    x = np.random.default_rng(n_tokens).standard_normal((n_tokens, m.n_in)).astype(np.float32)
    check_matmul(m, w, x, n_threads=n_threads)


def test_matmul_parallel_path(impl: str, monkeypatch) -> None:
    # Chunked over 2 threads at any size; mid-size batch on the kernels.
    monkeypatch.setattr(qmatmul, "CHUNK_WEIGHTS", 1)
    monkeypatch.setattr(qmatmul, "PARALLEL_MIN_WEIGHTS", 1)
    for name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q2_K"):
        n_in = 512
        raw = random_raw(name, 130, n_in, np.random.default_rng(5))
        w = gguf.quants.dequantize(raw, GGMLType[name]).reshape(130, n_in)
        m = QMatrix.prepare(raw, GGMLType[name], 130, n_in)
        for n_tok in (1, 5):
            x = np.random.default_rng(6).standard_normal((n_tok, n_in)).astype(np.float32)
            check_matmul(m, w, x, n_threads=2)


def test_matmul_numpy_fallback(qmat, monkeypatch) -> None:
    monkeypatch.setattr(qmatmul, "_kernels", "numpy")
    m, w, _ = qmat
    for n_tok in (1, 3):
        x = np.random.default_rng(7).standard_normal((n_tok, m.n_in)).astype(np.float32)
        check_matmul(m, w, x)


def test_dequantize_and_get_rows(qmat) -> None:
    m, w, raw = qmat
    np.testing.assert_array_equal(m.dequantize(), w)
    np.testing.assert_array_equal(m.dequantize(slice(3, 9)), w[3:9])
    np.testing.assert_array_equal(m.dequantize(np.array([5, 0, 5])), w[[5, 0, 5]])
    ids = np.array([0, m.n_out - 1, 7, 7], dtype=np.int32)
    np.testing.assert_array_equal(m.get_rows(ids), w[ids])
    assert m.get_rows(np.array([], dtype=np.int64)).shape == (0, m.n_in)
    with pytest.raises(IndexError):
        m.get_rows(np.array([m.n_out]))
    assert m.nbytes <= max_nbytes(m, raw)


def test_prepare_keeps_memmap_without_copy(impl: str, tmp_path) -> None:
    raw = random_raw("Q4_1", 64, 64, np.random.default_rng(8))
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    m = QMatrix.prepare(mm, GGMLType.Q4_1, 64, 64)
    x = np.random.default_rng(9).standard_normal((1, 64)).astype(np.float32)
    w = gguf.quants.dequantize(raw, GGMLType.Q4_1).reshape(64, 64)
    check_matmul(m, w, x)


def test_prepare_errors() -> None:
    with pytest.raises(UnsupportedError, match="IQ4_NL"):
        QMatrix.prepare(np.zeros((2, 18), np.uint8), GGMLType.IQ4_NL, 2, 32)
    with pytest.raises(ValueError):
        QMatrix.prepare(np.zeros((2, 18), np.uint8), GGMLType.Q4_0, 2, 64)
    m = QMatrix.prepare(np.zeros((2, 18), np.uint8), GGMLType.Q4_0, 2, 32)
    with pytest.raises(ValueError):
        m.matmul(np.zeros((1, 31), np.float32))


def test_set_num_threads() -> None:
    qmatmul.set_num_threads(1)
    qmatmul.set_num_threads(0)


@pytest.mark.parametrize("env", [{"LLAMAPY_NO_NUMBA": "1", "LLAMAPY_NATIVE": "0"}, {"LLAMAPY_KERNELS": "numpy"}])
def test_no_compiled_kernels_env(env: dict[str, str]) -> None:
    code = (
        "import sys, numpy as np; from llamapy.backend import qmatmul as q; "
        "from llamapy.types import GGMLType as T; "
        "m = q.QMatrix.prepare(np.zeros((4, 18), np.uint8), T.Q4_0, 4, 32); "
        "assert m.matmul(np.ones((1, 32), np.float32)).shape == (1, 4); "
        "assert q.kernels() == 'numpy' and 'numba' not in sys.modules"
    )
    env = dict(os.environ, **env)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


REPACKED_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("name", REPACKED_TYPES)
def test_repacked_layout(name: str, impl: str, monkeypatch) -> None:
    # 2 full tiles of REPACK_ROWS plus a 5-row tail in the file's layout.
    n_out, n_in = 2 * qmatmul.REPACK_ROWS + 5, (512 if name in K_TYPES else 96)
    raw = random_raw(name, n_out, n_in, np.random.default_rng(10))
    raw.flags.writeable = False
    w = gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_out, n_in)
    m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in)
    assert m.repacked and not np.shares_memory(m.data, raw)
    assert m.state()[-2].dtype == np.float16  # the scales (last of the tiles' arrays): the file's f16
    assert m.nbytes <= max_nbytes(m, raw)
    if name != "Q4_K":
        assert m.nbytes == raw.nbytes
    np.testing.assert_array_equal(m.dequantize(), w)
    np.testing.assert_array_equal(m.dequantize(slice(60, 133, 3)), w[60:133:3])
    # Whole tiles take the transposed fast kernel; same bits.
    for sl in (slice(0, 128), slice(64, 128)):
        np.testing.assert_array_equal(m.dequantize(sl, n_threads=2), w[sl])
    ids = np.array([0, 63, 64, 127, 128, n_out - 1, 5])
    np.testing.assert_array_equal(m.get_rows(ids), w[ids])
    for n_tok in (1, 3, 33):
        x = np.random.default_rng(n_tok).standard_normal((n_tok, n_in)).astype(np.float32)
        for th in (1, 2):
            check_matmul(m, w, x, n_threads=th)
    monkeypatch.setattr(qmatmul, "CHUNK_WEIGHTS", 1)
    monkeypatch.setattr(qmatmul, "PARALLEL_MIN_WEIGHTS", 1)
    check_matmul(m, w, np.ones((1, n_in), np.float32), n_threads=2)
    np.testing.assert_array_equal(m.dequantize(n_threads=2), w)
    # The prompt path (tiles + BLAS) with tiles smaller than the matrix.
    monkeypatch.setattr(qmatmul, "TILE_ELEMS", n_in)
    x = np.random.default_rng(11).standard_normal((20, n_in)).astype(np.float32)
    check_matmul(m, w, x, n_threads=2)
    monkeypatch.setattr(qmatmul, "_kernels", "numpy")  # a repacked matrix still works
    check_matmul(m, w, np.ones((2, n_in), np.float32))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_random_bytes_all_layouts(name: str, impl: str) -> None:
    # Random bytes in every quant field (incl. values gguf-py never produces), file layout and
    # repacked tiles, bit for bit against gguf-py.
    n_out, n_in = qmatmul.REPACK_ROWS + 3, 512
    raw = random_raw(name, n_out, n_in, np.random.default_rng(12))
    if name not in ("F32", "F16", "BF16") and name not in K_TYPES:
        blck, bsize = qmatmul.block_size(GGMLType[name])
        rnd = np.random.default_rng(13).integers(0, 256, raw.shape, dtype=np.uint8)
        blocks, rb = raw.reshape(-1, bsize), rnd.reshape(-1, bsize)
        keep = np.zeros(bsize, bool)
        for off in {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0]}[name]:
            keep[off : off + 2] = True
        blocks[:, ~keep] = rb[:, ~keep]
    w = gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_out, n_in).astype(np.float32)
    m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in)
    np.testing.assert_array_equal(m.dequantize().view(np.uint32), w.view(np.uint32))
    ids = np.array([n_out - 1, 0, 64, 3, n_out - 2])
    np.testing.assert_array_equal(m.get_rows(ids), w[ids])


def test_drop_mapped_pages_only_for_read_only_maps(impl: str, tmp_path) -> None:
    import mmap

    raw = random_raw("Q4_1", 2 * qmatmul.REPACK_ROWS, 512, np.random.default_rng(14))
    path = tmp_path / "w.bin"
    raw.tofile(path)
    w = gguf.quants.dequantize(raw, GGMLType.Q4_1).reshape(raw.shape[0], 512)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(memoryview(mm), np.uint8).reshape(raw.shape)
    m = QMatrix.prepare(view, GGMLType.Q4_1, raw.shape[0], 512)
    np.testing.assert_array_equal(m.dequantize(), w)
    np.testing.assert_array_equal(view, raw)  # still readable: re-read from the file
    heap = raw.copy()  # plain memory must never be dropped
    qmatmul._drop_mapped_pages(heap)
    np.testing.assert_array_equal(heap, raw)


def test_pool_runs_every_chunk_once() -> None:
    hits = np.zeros(50, np.int64)

    def fn(c: int) -> None:
        hits[c] += 1

    for nt in (1, 2, 3):
        hits[:] = 0
        qmatmul._POOL.run(fn, 50, nt)
        assert (hits == 1).all()

    def boom(c: int) -> None:
        raise RuntimeError("chunk failed")

    with pytest.raises(RuntimeError, match="chunk failed"):
        qmatmul._POOL.run(boom, 4, 2)


def test_pool_private_never_waits_for_a_stuck_helper() -> None:
    import threading
    import time

    out = np.zeros((2, 40), np.float32)
    caller = threading.get_ident()

    def fn(c: int, dst: np.ndarray) -> None:
        if threading.get_ident() != caller:
            time.sleep(0.2)  # a helper that is descheduled mid-chunk
        dst[:, 4 * c : 4 * c + 4] = c + 1

    t0 = time.perf_counter()
    qmatmul._POOL.run_private(fn, 10, 2, out, lambda c: (4 * c, 4 * c + 4))
    assert time.perf_counter() - t0 < 0.15
    np.testing.assert_array_equal(out, np.repeat(np.arange(1, 11), 4)[None].repeat(2, 0))
    time.sleep(0.25)  # the late helper must not write into out after the call closed
    np.testing.assert_array_equal(out, np.repeat(np.arange(1, 11), 4)[None].repeat(2, 0))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_0])
def test_threaded_decode_equals_one_thread(qtype: GGMLType, impl: str) -> None:
    """Above PRANGE_MIN_WEIGHTS, two threads split the tiles (numba's prange, OpenMP in C): each
    tile is computed by the same code, so the result is bit-identical to one thread."""
    rng = np.random.default_rng(3)
    n_out, n_in = 1024 + 5, 576  # a tail of 5 rows stays in the file layout
    assert n_out * n_in >= qmatmul.PRANGE_MIN_WEIGHTS
    raw = gguf.quants.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), qtype)
    m = qmatmul.QMatrix.prepare(raw, qtype, n_out, n_in)
    assert m.repacked
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    one = m.matmul(x, 1)
    two = m.matmul(x, 2)
    assert np.array_equal(one, two)
    ref = x.astype(np.float64) @ gguf.quants.dequantize(raw, qtype).astype(np.float64).T
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(gguf.quants.dequantize(raw, qtype)).astype(np.float64).T)
    assert np.all(np.abs(two - ref) <= bound)


def test_numba_f16_scale_conversions() -> None:
    """numba reads the repacked f16 scales as their bits: both conversions (LLVM's, i.e. F16C,
    where the CPU has it, and the integer / float32 one) give numpy's float32 for every f16;
    the hardware quiets signalling nans (no dequantized value can tell: each is an arithmetic
    result of its scales)."""
    nk = qmatmul.numba_kernels()
    if nk is None:
        pytest.skip(f"no numba: {qmatmul._nk_error}")
    import numba

    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ref = h.view(np.float16).astype(np.float32).view(np.uint32)
    snan = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0) & ((h & 0x200) == 0)
    convs = [(nk._h2f_bits, False)] + ([(nk._h2f_hw, True)] if nk._hw_f16() else [])
    for conv, quiets in convs:

        @numba.njit
        def run(h, out):
            for i in range(h.size):
                out[i] = conv(h[i])

        out = np.empty(h.size, np.float32)
        run(h, out)
        got = out.view(np.uint32)
        np.testing.assert_array_equal(got[~snan], ref[~snan])
        np.testing.assert_array_equal(got[snan], ref[snan] | (0x400000 if quiets else 0))
