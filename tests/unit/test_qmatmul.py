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


def check_matmul(m: QMatrix, w: np.ndarray, x: np.ndarray, q8: bool = False, **kw: int) -> None:
    """Against float64 x @ w.T: |err| <= 1e-5 * (|x| @ |w|.T) per output with float32
    activations; with quantized ones (`q8`, the default CPU path) plus what quantizing x costs:
    half a quantization step of x's block per element (a q8 block's max/127; f16/bf16 rounding)
    and, for the types with a block minimum, the f16 rounding of the q8_1 sums. The exact
    quantized arithmetic is tested in test_native_quants.py."""
    got = m.matmul(x, q8=q8, **kw)
    assert got.dtype == np.float32 and got.shape == (x.shape[0], m.n_out)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T)
    if q8 and m.vec_dot_type() is not None:  # quantized (q8 kernels) or rounded (sgemm)
        name = m.qtype.name
        if name in ("F32", "F16", "BF16"):
            step = np.abs(x64) * {"F32": 0.0, "F16": 2.0**-10, "BF16": 2.0**-7}[name]
        else:
            blck = 256 if name in K_TYPES else 32
            amax = np.abs(x64).reshape(x.shape[0], -1, blck).max(axis=2, keepdims=True)
            step = np.broadcast_to(amax / 127 * (1 + 2.0**-10), (x.shape[0], m.n_in // blck, blck)).reshape(x.shape)
        bound = bound + 0.51 * (step @ np.abs(w64).T) + 2.0**-9 * (np.abs(x64) @ np.abs(w64).T)
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


@pytest.fixture(params=["q8", "f32"])
def mode(request: pytest.FixtureRequest) -> str:
    """Every test that uses it runs once per CPU matmul mode: "q8" (the file's blocks, activations
    quantized: lp_mul_mat) and "f32" (float32 activations, repacked tiles where the type has them)."""
    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    return request.param


@pytest.fixture(params=ALL_TYPES)
def qmat(request: pytest.FixtureRequest, mode: str) -> tuple[QMatrix, np.ndarray, np.ndarray, bool]:
    name = request.param
    n_out, n_in = shape_for(name)
    raw = random_raw(name, n_out, n_in, np.random.default_rng(4))
    raw.flags.writeable = False  # like the GGUF memmap
    w = gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_out, n_in).astype(np.float32)
    return QMatrix.prepare(raw, GGMLType[name], n_out, n_in, repack=mode == "f32"), w, raw, mode == "q8"


@pytest.mark.parametrize("n_tokens", [1, 3, 33])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_matmul(qmat, n_tokens: int, n_threads: int) -> None:
    m, w, _, q8 = qmat
    x = np.random.default_rng(n_tokens).standard_normal((n_tokens, m.n_in)).astype(np.float32)
    check_matmul(m, w, x, q8=q8, n_threads=n_threads)


def test_matmul_big_enough_for_threads(mode: str) -> None:
    # 2 threads on a matrix big enough to be split (lp_mul_mat: chunks of rows; f32: tiles)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q2_K", "F16", "BF16"):
        n_out, n_in = 1030, 512
        raw = random_raw(name, n_out, n_in, np.random.default_rng(5))
        w = gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_out, n_in)
        m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in, repack=mode == "f32")
        for n_tok in (1, 5):
            x = np.random.default_rng(6).standard_normal((n_tok, n_in)).astype(np.float32)
            check_matmul(m, w, x, q8=mode == "q8", n_threads=2)


def test_matmul_numpy_fallback(qmat, monkeypatch) -> None:
    m, w, _, _ = qmat
    if m.repacked:
        pytest.skip("a repacked matrix is made for the C kernels only")
    monkeypatch.setenv("LLAMAPY_KERNELS", "numpy")
    assert qmatmul.kernels() == "numpy" and m.path(1) == "sgemm"
    for n_tok in (1, 3):
        x = np.random.default_rng(7).standard_normal((n_tok, m.n_in)).astype(np.float32)
        check_matmul(m, w, x, q8=True)


def test_paths() -> None:
    """Which kernel a product runs (QMatrix.path): the q8 kernels by default for few tokens,
    the repacked float32 ones in the f32 mode, sgemm at SGEMM_MIN_TOKENS tokens (use_sgemm),
    never for a product under 32 rows or columns (a LoRA adapter's rank-r pairs)."""
    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    raw = random_raw("Q4_1", 128, 64, np.random.default_rng(1))
    file_rows = QMatrix.prepare(raw, GGMLType.Q4_1, 128, 64)
    repacked = QMatrix.prepare(raw.copy(), GGMLType.Q4_1, 128, 64, repack=True)
    n = qmatmul.SGEMM_MIN_TOKENS
    big = "q8" if hasattr(native.lib(), qmatmul.Q8_GEMM[GGMLType.Q4_1]) else "sgemm"
    assert [file_rows.path(t) for t in (1, n - 1, n, 512)] == ["q8", "q8", big, big]
    assert [file_rows.path(t, q8=False) for t in (1, n)] == ["sgemm", "sgemm"]  # no repacked layout
    assert [repacked.path(t, q8=False) for t in (1, n - 1, n)] == ["mv", "mv", "sgemm"]
    # F32 weights: float32 already, so sgemm from 2 tokens, but never in the q8 mode where the
    # library has the float panels (Q8_GEMM)
    panel = hasattr(native.lib(), qmatmul.Q8_GEMM[GGMLType.F32])
    assert not qmatmul.use_sgemm(GGMLType.F32, 64, 64, 1) and qmatmul.use_sgemm(GGMLType.F32, 64, 64, 2) != panel
    assert qmatmul.use_sgemm(GGMLType.F32, 64, 64, 2, q8=False)
    for qt in (GGMLType.F32, GGMLType.F16):
        assert not any(qmatmul.use_sgemm(qt, m, k, 512, q8) for m, k in ((16, 576), (576, 16)) for q8 in (True, False))


@pytest.mark.parametrize("variant", list(native.VARIANTS))
def test_q8_prompts_stay_on_the_gemm_kernels(monkeypatch, variant: str) -> None:
    """In the q8 mode the types of Q8_GEMM run lp_mul_mat at every batch where the library
    has their multi-column kernel (the AVX2 and AVX-512 builds), and sgemm from SGEMM_MIN_TOKENS
    where it has none (portable: one vec_dot per output); the f32 mode keeps sgemm."""
    if variant not in native.built() or not native.runnable(variant):
        pytest.skip(f"the {variant} kernels are not built or cannot run here")
    monkeypatch.setenv("LLAMAPY_KERNELS_VARIANT", variant)
    n = qmatmul.SGEMM_MIN_TOKENS
    for qt, name in qmatmul.Q8_GEMM.items():
        has = hasattr(native.lib(), name)
        assert has == (variant != "portable"), (variant, name)
        assert [qmatmul.use_sgemm(qt, 576, 1536, t) for t in (1, n, 512)] == [False, not has, not has]
        assert [qmatmul.use_sgemm(qt, 576, 1536, t, q8=False) for t in (1, n, 512)] == [False, True, True]


def test_blas_backend_claims_what_use_sgemm_says() -> None:
    from llamapy.backend.blas import BLASDevice
    from llamapy.tensor import Op, Tensor, TensorFlag

    dev = BLASDevice()
    for n_tok in (1, qmatmul.SGEMM_MIN_TOKENS - 1, qmatmul.SGEMM_MIN_TOKENS, 512):
        for qt in (GGMLType.Q4_1, GGMLType.F32, GGMLType.Q4_K):
            w = Tensor("w", (576, 1536), qt, flags=TensorFlag.WEIGHT)
            x = Tensor("x", (n_tok, 1536), GGMLType.F32)
            node = Tensor("y", (n_tok, 576), GGMLType.F32, op=Op.MUL_MAT, src=(w, x))
            assert dev.supports_op(node) == qmatmul.use_sgemm(qt, 576, 1536, n_tok)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_types_stay_on_int8_kernels_at_any_batch(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """use_sgemm's Q8_GEMM table: in the q8 mode a K type whose multi-column int8 kernel the
    library has (lp_gemm_*) runs the q8 kernels at every batch size, so a token's numbers do not
    depend on the batch it is in; the f32 mode, and a library without that kernel (the portable
    build), keep sgemm from SGEMM_MIN_TOKENS tokens."""
    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    qt, n = GGMLType[name], qmatmul.SGEMM_MIN_TOKENS
    raw = random_raw(name, 80, 512, np.random.default_rng(3))
    m = QMatrix.prepare(raw, qt, 80, 512)
    if not hasattr(native.lib(), qmatmul.Q8_GEMM[qt]):
        pytest.skip(f"this library has no {name} multi-column kernel")
    assert [m.path(t) for t in (1, n, 512)] == ["q8", "q8", "q8"]
    assert m.path(n, q8=False) == "sgemm"
    x = np.random.default_rng(4).standard_normal((n + 5, 512)).astype(np.float32)
    batch = m.matmul(x)
    assert all(np.array_equal(batch[i], m.matmul(x[i : i + 1])[0]) for i in range(0, n + 5, 4))
    if "portable" in native.built():
        monkeypatch.setenv("LLAMAPY_KERNELS_VARIANT", "portable")
        assert not hasattr(native.lib(), qmatmul.Q8_GEMM[qt]) and m.path(n) == "sgemm"


def test_dequantize_and_get_rows(qmat) -> None:
    m, w, raw, _ = qmat
    np.testing.assert_array_equal(m.dequantize(), w)
    np.testing.assert_array_equal(m.dequantize(slice(3, 9)), w[3:9])
    np.testing.assert_array_equal(m.dequantize(np.array([5, 0, 5])), w[[5, 0, 5]])
    ids = np.array([0, m.n_out - 1, 7, 7], dtype=np.int32)
    np.testing.assert_array_equal(m.get_rows(ids), w[ids])
    assert m.get_rows(np.array([], dtype=np.int64)).shape == (0, m.n_in)
    with pytest.raises(IndexError):
        m.get_rows(np.array([m.n_out]))
    assert m.nbytes <= max_nbytes(m, raw)


def test_prepare_keeps_memmap_without_copy(tmp_path) -> None:
    raw = random_raw("Q4_1", 64, 64, np.random.default_rng(8))
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    m = QMatrix.prepare(mm, GGMLType.Q4_1, 64, 64)  # the q8 mode's layout: the file's
    assert np.shares_memory(m.data, mm) and m.nbytes == raw.nbytes
    x = np.random.default_rng(9).standard_normal((1, 64)).astype(np.float32)
    w = gguf.quants.dequantize(raw, GGMLType.Q4_1).reshape(64, 64)
    check_matmul(m, w, x, q8=True)


def test_prepare_errors() -> None:
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        QMatrix.prepare(np.zeros((2, 66), np.uint8), GGMLType.IQ2_XXS, 2, 256)
    with pytest.raises(ValueError):
        QMatrix.prepare(np.zeros((2, 18), np.uint8), GGMLType.Q4_0, 2, 64)
    m = QMatrix.prepare(np.zeros((2, 18), np.uint8), GGMLType.Q4_0, 2, 32)
    with pytest.raises(ValueError):
        m.matmul(np.zeros((1, 31), np.float32))


@pytest.mark.parametrize("env", [{"LLAMAPY_KERNELS_VARIANT": "nope"}, {"LLAMAPY_KERNELS": "numpy"}])
def test_no_compiled_kernels_env(env: dict[str, str]) -> None:
    code = (
        "import sys, numpy as np; from llamapy.backend import qmatmul as q; "
        "from llamapy.types import GGMLType as T; "
        "m = q.QMatrix.prepare(np.zeros((4, 18), np.uint8), T.Q4_0, 4, 32); "
        "assert m.matmul(np.ones((1, 32), np.float32)).shape == (1, 4); "
        "assert q.kernels() == 'numpy'"
    )
    env = dict(os.environ, **env)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


REPACKED_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("name", REPACKED_TYPES)
def test_repacked_layout(name: str, monkeypatch) -> None:
    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    # 2 full tiles of REPACK_ROWS plus a 5-row tail in the file's layout.
    n_out, n_in = 2 * qmatmul.REPACK_ROWS + 5, (512 if name in K_TYPES else 96)
    raw = random_raw(name, n_out, n_in, np.random.default_rng(10))
    raw.flags.writeable = False
    w = gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_out, n_in)
    m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in, repack=True)
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
    np.testing.assert_array_equal(m.dequantize(n_threads=2), w)
    # The prompt path (tiles + BLAS) with tiles smaller than the matrix.
    monkeypatch.setattr(qmatmul, "TILE_ELEMS", n_in)
    x = np.random.default_rng(11).standard_normal((20, n_in)).astype(np.float32)
    check_matmul(m, w, x, n_threads=2)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_random_bytes_all_layouts(name: str, mode: str) -> None:
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
    m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in, repack=mode == "f32")
    np.testing.assert_array_equal(m.dequantize().view(np.uint32), w.view(np.uint32))
    ids = np.array([n_out - 1, 0, 64, 3, n_out - 2])
    np.testing.assert_array_equal(m.get_rows(ids), w[ids])


def test_drop_mapped_pages_only_for_read_only_maps(tmp_path) -> None:
    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    import mmap

    raw = random_raw("Q4_1", 2 * qmatmul.REPACK_ROWS, 512, np.random.default_rng(14))
    path = tmp_path / "w.bin"
    raw.tofile(path)
    w = gguf.quants.dequantize(raw, GGMLType.Q4_1).reshape(raw.shape[0], 512)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(memoryview(mm), np.uint8).reshape(raw.shape)
    m = QMatrix.prepare(view, GGMLType.Q4_1, raw.shape[0], 512, repack=True)
    np.testing.assert_array_equal(m.dequantize(), w)
    np.testing.assert_array_equal(view, raw)  # still readable: re-read from the file
    heap = raw.copy()  # plain memory must never be dropped
    qmatmul._drop_mapped_pages(heap)
    np.testing.assert_array_equal(heap, raw)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_0])
def test_threaded_decode_equals_one_thread(qtype: GGMLType, mode: str) -> None:
    """Two threads split the rows (lp_mul_mat) or the tiles (lp_mv_*): each output is computed by
    the same code, so the result is bit-identical to one thread."""
    rng = np.random.default_rng(3)
    n_out, n_in = 1024 + 5, 576  # f32: a tail of 5 rows stays in the file layout
    raw = gguf.quants.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), qtype)
    m = qmatmul.QMatrix.prepare(raw, qtype, n_out, n_in, repack=mode == "f32")
    assert m.repacked == (mode == "f32")
    assert m.path(1, mode == "q8") == ("q8" if mode == "q8" else "mv")
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    one = m.matmul(x, 1, q8=mode == "q8")
    two = m.matmul(x, 2, q8=mode == "q8")
    assert np.array_equal(one, two)
    check_matmul(m, gguf.quants.dequantize(raw, qtype).reshape(n_out, n_in), x, q8=mode == "q8", n_threads=2)


@pytest.mark.parametrize("name", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_sgemm_on_rounded_activations_equals_q8_kernels(name: str) -> None:
    """In the q8 mode a batch on sgemm gets the activations rounded to the vec_dot_type
    (round_act) and so computes the q8 kernels' sums: the same numbers up to float32 summation
    (and, for the types with a minimum, the f16 rounding of q8_1's sums)."""
    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    n_out, n_in, n_tok = 70, 256, qmatmul.SGEMM_MIN_TOKENS + 3
    raw = random_raw(name, n_out, n_in, np.random.default_rng(20))
    m = QMatrix.prepare(raw, GGMLType[name], n_out, n_in)
    x = np.random.default_rng(21).standard_normal((n_tok, n_in)).astype(np.float32)
    got = m.matmul_tiles(m.round_act(x))  # the sgemm path's product (QMatrix.matmul, BLAS)
    if m.path(n_tok) == "sgemm":  # a type without a multi-column q8 kernel (use_sgemm)
        assert np.array_equal(m.matmul(x), got)
    want = m.matmul_q8(m.quantize_act(x))
    w = np.abs(gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_out, n_in).astype(np.float64))
    scale = np.abs(x).astype(np.float64) @ w.T
    tol = (2.0**-10 if name in ("Q4_1", "Q5_1") else 1e-5) * scale
    assert np.all(np.abs(got - want) <= tol)
    assert not np.allclose(got, m.matmul(x, q8=False), rtol=1e-6, atol=0)  # not the f32 product


def test_backend_quantizes_a_shared_input_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two MUL_MATs of one input and one vec_dot_type (e.g. Q and K): one quantization."""
    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    from llamapy.backend.cpu import CPUBackend, CPUDevice
    from llamapy.tensor import Op, Tensor, TensorFlag

    calls = []
    real = QMatrix.quantize_act
    monkeypatch.setattr(QMatrix, "quantize_act", lambda self, x, n=0: calls.append(1) or real(self, x, n))
    wq = QMatrix.prepare(random_raw("Q4_0", 64, 64, np.random.default_rng(1)), GGMLType.Q4_0, 64, 64)
    wk = QMatrix.prepare(random_raw("Q8_0", 32, 64, np.random.default_rng(2)), GGMLType.Q8_0, 32, 64)
    tw = [Tensor(f"w{i}", (n, 64), t, flags=TensorFlag.WEIGHT) for i, (n, t) in
          enumerate([(64, GGMLType.Q4_0), (32, GGMLType.Q8_0)])]
    tx = Tensor("x", (1, 64), GGMLType.F32)
    nodes = [Tensor(f"y{i}", (1, w.shape[0]), GGMLType.F32, op=Op.MUL_MAT, src=(w, tx)) for i, w in enumerate(tw)]
    x = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)
    be = CPUBackend(CPUDevice())
    env = {tw[0]: wq, tw[1]: wk, tx: x}
    be.compute(nodes, env)
    assert len(calls) == 1
    np.testing.assert_array_equal(env[nodes[0]], wq.matmul(x))
    np.testing.assert_array_equal(env[nodes[1]], wk.matmul(x))
    calls.clear()
    be.compute(nodes, env)  # a new run quantizes again (nothing is kept between graph runs)
    assert len(calls) == 1
