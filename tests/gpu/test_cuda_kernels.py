"""Each kernel family of kernels_cuda/ through its launch function (backend/cuda_ops.py), against
the numpy reference (`kernels.reference` on a node of the same op): RMS_NORM with its fused ADD
and MUL, GLU, ADD/MUL/SCALE, GET_ROWS, ROPE fused with the KV store, SET_ROWS into
f32/f16/Q8_0/Q4_0 caches (rotated: attn_rot), decode FLASH_ATTN_EXT (splits, GQA, quantized
caches, the number of cells read from device memory), the matrix-vector products, and one CUDA
graph captured once and replayed over several lengths of history.

Every test runs twice: on CUDA0 (skipped without CuPy or a GPU) and on the CPU emulator
(cuda_emu.py: the same sources compiled with g++, threads as fibers; skipped without g++), so
the kernels' indexing, barriers and arithmetic are checked on machines without a GPU too. The
emulator's blocks run one after another and its libm is glibc's; what only a GPU shows (timing,
memory ordering between blocks, the device's expf/cos) is checked on the GPU alone. The largest
attention cases and the graph capture run only there.

Parametrised so that a failure names one op and one case. Tolerances say what each kernel's
arithmetic allows (fattn.cu, rope.cu, glu.cu headers): exact where it repeats the reference's
float32 operations, ulps where a libm function differs.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cuda_ptx import ALL_TYPES, random_rows  # noqa: E402

from llamapy import ops  # noqa: E402
from llamapy.backend.cuda_ops import CudaKernels, fattn_scratch_floats, fattn_splits  # noqa: E402
from llamapy.backend.kernels import reference  # noqa: E402
from llamapy.quants import quantize  # noqa: E402
from llamapy.tensor import Tensor, TensorFlag  # noqa: E402
from llamapy.types import GGMLType as G  # noqa: E402
from llamapy.types import storage  # noqa: E402

rng = np.random.default_rng(0)


def randn(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def t(name: str, shape: tuple[int, ...], typ: G = G.F32) -> Tensor:
    return Tensor(name, shape, typ, flags=TensorFlag.INPUT)


class Env:
    """Where the kernels run: arrays there, their pointers, a launch and its wait."""

    name: str
    k: CudaKernels

    def d(self, a: np.ndarray) -> Any: ...
    def full(self, shape: tuple[int, ...], value: float, dtype: Any) -> Any: ...
    def get(self, a: Any) -> np.ndarray: ...
    def p(self, a: Any) -> int: ...
    def run(self, launch: Any) -> None: ...

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.full(shape, 0, dtype)

    def capture(self, launches: Any) -> Any:
        """The launches recorded once; returns what replays them (and waits)."""


class EmuEnv(Env):
    name = "emu"

    def __init__(self) -> None:
        import cuda_emu

        # few "SMs": few attention splits, fast; the prompt products' GEMM in numpy (no cuBLAS here)
        self.k = CudaKernels(cuda_emu.build(), n_sm=4, gemm=cuda_emu.numpy_gemm, reader=cuda_emu.numpy_read)

    def d(self, a: np.ndarray) -> Any:
        return np.array(a, copy=True, order="C")

    def full(self, shape: tuple[int, ...], value: float, dtype: Any) -> Any:
        return np.full(shape, value, dtype)

    def get(self, a: Any) -> np.ndarray:
        return np.array(a, copy=True)

    def p(self, a: Any) -> int:
        return int(a.ctypes.data)

    def run(self, launch: Any) -> None:
        launch(object())

    def capture(self, launches: Any) -> Any:
        """The emulator's CUDA graph: the launches recorded once (CudaKernels.record), replayed as
        recorded (nothing recomputed from Python values)."""
        recorded = self.k.record(launches)
        return lambda: [x(None) for x in recorded]


class CudaEnv(Env):
    name = "cuda"

    def __init__(self) -> None:
        import cupy as cp

        from llamapy.backend import cuda

        self.cp = cp
        self.dev = cuda.registry().devices()[0]
        self.k = self.dev.ops()

    def d(self, a: np.ndarray) -> Any:
        return self.cp.asarray(a)

    def full(self, shape: tuple[int, ...], value: float, dtype: Any) -> Any:
        return self.cp.full(shape, value, dtype)

    def get(self, a: Any) -> np.ndarray:
        return a.get()

    def p(self, a: Any) -> int:
        return int(a.data.ptr)

    def run(self, launch: Any) -> None:
        """Launch on the device's stream after every copy (made on the null stream), and wait."""
        self.cp.cuda.Device(self.dev.index).synchronize()
        with self.dev.context("a kernel test"):
            launch(self.dev.stream)
        self.dev.stream.synchronize()

    def capture(self, launches: Any) -> Any:
        """A CUDA graph of the launches (stream capture), replayed on the device's stream."""
        st = self.dev.stream
        self.cp.cuda.Device(self.dev.index).synchronize()
        with self.dev.context("capturing"):
            st.begin_capture()
            launches(st)
            graph = st.end_capture()

        def replay() -> None:
            self.cp.cuda.Device(self.dev.index).synchronize()  # the inputs copied in on the null stream
            graph.launch(stream=st)
            st.synchronize()

        return replay


def _cuda_env() -> Env:
    try:
        import cupy as cp
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"CuPy is not installed ({type(e).__name__})")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no usable CUDA device: {e}")
    if n <= 0:
        pytest.skip("no CUDA device")
    return CudaEnv()


@pytest.fixture(scope="module", params=["emu", pytest.param("cuda", marks=pytest.mark.gpu)])
def env(request: pytest.FixtureRequest) -> Env:
    if request.param == "cuda":
        return _cuda_env()
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: no CPU emulation of the kernels")
    return EmuEnv()


def max_ulp(a: np.ndarray, b: np.ndarray) -> int:
    a32, b32 = a.astype(np.float32).view(np.int32).astype(np.int64), b.astype(np.float32).view(np.int32).astype(np.int64)
    a32 = np.where(a32 < 0, -(a32 & 0x7FFFFFFF), a32)  # sign-magnitude -> ordered integers
    b32 = np.where(b32 < 0, -(b32 & 0x7FFFFFFF), b32)
    return int(np.max(np.abs(a32 - b32))) if a.size else 0


# --- norm.cu -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [576, 4160])
@pytest.mark.parametrize("fused", ["norm", "norm*w", "add+norm*w", "add+norm"])
def test_rms_norm(env: Env, n: int, fused: str) -> None:
    rows, stride = 3, n + 64  # strided rows: the kernel reads views
    xa, ba, wa = randn(rows, stride) * 3, randn(rows, n), randn(n)
    x, b, w = t("x", (rows, n)), t("b", (rows, n)), t("w", (n,))
    vals: dict[Tensor, np.ndarray] = {x: np.ascontiguousarray(xa[:, :n]), b: ba, w: wa}
    src = ops.add(x, b) if fused.startswith("add") else x
    node = ops.rms_norm(src, 1e-5)
    if fused.endswith("*w"):
        node = ops.mul(node, w)
    from llamapy.graph import Graph

    for nd in Graph.build(node).nodes:
        vals[nd] = reference(nd, [vals[s] for s in nd.src])
    xd, bd, wd = env.d(xa), env.d(ba), env.d(wa)
    y, s = env.full((rows, n), np.nan, np.float32), env.full((rows, n), np.nan, np.float32)
    add = fused.startswith("add")
    env.run(lambda st: env.k.rms_norm(st, env.p(xd), stride, env.p(y), n, rows, n, 1e-5, b=env.p(bd) if add else 0, sb=n,
                                   sum_out=env.p(s) if add else 0, ss=n, w=env.p(wd) if fused.endswith("*w") else 0))  # fmt: skip
    if add:
        np.testing.assert_array_equal(env.get(s), vals[src], err_msg="the fused ADD's sum")
    # the float32 mean differs from the reference's only when the float64 sums, in other orders,
    # straddle a float32 rounding boundary: at most one ulp then
    assert max_ulp(env.get(y), vals[node]) <= 1, f"{fused}: {max_ulp(env.get(y), vals[node])} ulps"


def test_rms_norm_per_head_in_place(env: Env) -> None:
    """qwen3/gemma3's Q/K norms: rows of one head (T*H rows of D), the weight (D,), in place."""
    T, H, D = 4, 8, 128
    xa, wa = randn(T, H, D), randn(D)
    x, w = t("q", (T, H, D)), t("w", (D,))
    n1 = ops.rms_norm(x, 1e-6)
    ref = reference(ops.mul(n1, w), [reference(n1, [xa]), wa])
    xd, wd = env.d(xa), env.d(wa)
    env.run(lambda st: env.k.rms_norm(st, env.p(xd), D, env.p(xd), D, T * H, D, 1e-6, w=env.p(wd)))
    assert max_ulp(env.get(xd), ref) <= 1


def test_rms_norm_tokens_of_a_strided_view(env: Env) -> None:
    """The same over the Q columns of a fused QKV product (T rows of 1536: Q's 8 heads of 128
    first), every token in one launch (tokens, sxt, syt), into contiguous (T, H, D)."""
    T, H, D, row = 5, 8, 128, 1536
    qkv, wa = randn(T, row), randn(D)
    x, w = t("q", (T, H, D)), t("w", (D,))
    n1 = ops.rms_norm(x, 1e-6)
    q = np.ascontiguousarray(qkv[:, : H * D]).reshape(T, H, D)
    ref = reference(ops.mul(n1, w), [reference(n1, [q]), wa])
    xd, wd = env.d(qkv), env.d(wa)
    y = env.full((T, H, D), np.nan, np.float32)
    env.run(lambda st: env.k.rms_norm(st, env.p(xd), D, env.p(y), D, H, D, 1e-6, w=env.p(wd), tokens=T, sxt=row,
                                      syt=H * D))  # fmt: skip
    assert max_ulp(env.get(y), ref) <= 1


# --- glu.cu, elementwise.cu --------------------------------------------------------------------


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_glu_fused_halves(env: Env, op: str) -> None:
    """gate and up read in place from one (T, 2F) product, as the fused ffn_gate_up gives them."""
    T, F = 5, 1536
    gu = randn(T, 2 * F) * (10 if op == "swiglu" else 6)
    gu[0, :4] = [-200.0, 200.0, -1e30, 0.0]
    gu[1, :4] = [-10.0, 10.0, -9.999, 9.999]  # geglu's clamped branches and their edges
    g, u = t("g", (T, F)), t("u", (T, F))
    ref = reference(ops.glu(g, u, op), [np.ascontiguousarray(gu[:, :F]), np.ascontiguousarray(gu[:, F:])])
    gud = env.d(gu)
    y = env.full((T, F), np.nan, np.float32)
    env.run(lambda st: env.k.glu(st, op, env.p(gud), 2 * F, env.p(gud) + 4 * F, 2 * F, env.p(y), F, T, F))
    got = env.get(y)
    if op == "swiglu":  # expf within 2 ulp of numpy's: a few ulps after the division and product
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-37)
    else:
        # GELU's value is rounded to f16; near h = -5, 1 + tanh(...) cancels, so one ulp of tanh
        # (tanhf against numpy's) moves it by up to |h| * 2^-24 before that rounding
        upm = np.abs(gu[:, F:])
        err = np.abs(got - ref)
        assert np.all(err <= 2.0**-10 * np.abs(ref) + 1e-6 * upm), f"geglu: worst error {err.max():.3g}"
        assert np.mean(got == ref) > 0.9


@pytest.mark.parametrize("op", ["add", "mul", "scale"])
def test_elementwise(env: Env, op: str) -> None:
    rows, n = 7, 333
    aa, ba = randn(rows, n + 3), randn(n)  # a strided, b one broadcast row
    a, b = t("a", (rows, n)), t("b", (n,))
    node = ops.scale(a, 0.125) if op == "scale" else getattr(ops, op)(a, b)
    srcs = [np.ascontiguousarray(aa[:, :n])] + ([] if op == "scale" else [ba])
    ref = reference(node, srcs)
    ad, bd = env.d(aa), env.d(ba)
    y = env.full((rows, n), np.nan, np.float32)
    if op == "scale":
        env.run(lambda st: env.k.scale(st, env.p(ad), n + 3, env.p(y), n, rows, n, 0.125))
    else:
        env.run(lambda st: env.k.binary(st, op, env.p(ad), n + 3, env.p(bd), 0, env.p(y), n, rows, n))
    np.testing.assert_array_equal(env.get(y), ref)


# --- GET_ROWS ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_TYPES)
def test_get_rows_weight_types(env: Env, name: str) -> None:
    from gguf.quants import dequantize

    n_rows, n_in = 37, 512
    raw = np.ascontiguousarray(random_rows(name, n_rows, n_in, np.random.default_rng(3)))
    full = dequantize(raw, G[name]).reshape(n_rows, n_in).astype(np.float32)
    ids = np.array([36, 0, 5, 5, 20, 37], np.int32)  # 37: out of range -> NaN, nothing read
    rd, idd = env.d(raw), env.d(ids)
    y = env.zeros((len(ids), n_in + 32), np.float32)  # a strided destination
    env.run(lambda st: env.k.get_rows(st, G[name], env.p(rd), raw.shape[1], n_rows, env.p(idd), env.p(y), n_in + 32, len(ids), n_in))
    got = env.get(y)
    assert np.array_equal(got[:5, :n_in].view(np.uint32), full[ids[:5]].view(np.uint32))
    assert np.all(np.isnan(got[5, :n_in])) and np.all(got[:, n_in:] == 0)


def test_get_rows_f32_rows(env: Env) -> None:
    """The rows whose logits are wanted (inp_out_ids): float32 rows of any width, strided."""
    table = randn(9, 70)
    ids = np.array([8, 0, 3], np.int32)
    x, i = t("x", (9, 67)), t("ids", (3,), G.I32)
    ref = reference(ops.get_rows(x, i), [np.ascontiguousarray(table[:, :67]), ids])
    td, idd = env.d(table), env.d(ids)
    y = env.full((3, 67), np.nan, np.float32)
    env.run(lambda st: env.k.get_rows_f32(st, env.p(td), 70, 9, env.p(idd), env.p(y), 67, 3, 67))
    np.testing.assert_array_equal(env.get(y), ref)


# --- rope.cu -----------------------------------------------------------------------------------

POS = np.array([0, 1, 7, 300, 4095], np.int32)


def _rope_ref(xa: np.ndarray, n_dims: int, mode: int, base: float, ff: np.ndarray | None) -> np.ndarray:
    T, H, D = xa.shape
    x, pos = t("x", (T, H, D)), t("pos", (T,), G.I32)
    f = t("ff", (n_dims // 2,)) if ff is not None else None
    node = ops.rope(x, pos, n_dims, base, 1.0, f, mode=mode)
    return reference(node, [xa, POS[:T]] + ([ff] if ff is not None else []))


def _check_rope(got: np.ndarray, ref: np.ndarray) -> None:
    # the same float32 angles (the recurrence, bit for bit); cos/sin in float64 on both sides,
    # rounded to float32: an ulp apart at most, rarely
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert np.mean(got == ref) > 0.99, f"only {np.mean(got == ref):.4f} of the values are the reference's bits"


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("factors", [False, True])
@pytest.mark.parametrize("n_dims", [64, 32])
def test_rope(env: Env, mode: int, factors: bool, n_dims: int) -> None:
    T, H, D = 5, 3, 64
    xa = randn(T, H, D)
    ff = rng.uniform(1, 8, n_dims // 2).astype(np.float32) if factors else None
    ref = _rope_ref(xa, n_dims, mode, 10000.0, ff)
    xd, posd = env.d(xa), env.d(POS)
    ffd = env.d(ff) if ff is not None else None
    y = env.full((T, H, D), np.nan, np.float32)
    env.run(lambda st: env.k.rope(st, env.p(xd), H * D, D, env.p(y), H * D, D, T, H, D, pos=env.p(posd), n_dims=n_dims, mode=mode,
                               freq_base=10000.0, factors=env.p(ffd) if ffd is not None else 0))  # fmt: skip
    _check_rope(env.get(y), ref)
    # in place, from a strided view (Q in a fused QKV product's output: row stride > H*D)
    big = np.zeros((T, H * D + 32), np.float32)
    big[:, : H * D] = xa.reshape(T, -1)
    bd = env.d(big)
    env.run(lambda st: env.k.rope(st, env.p(bd), H * D + 32, D, env.p(bd), H * D + 32, D, T, H, D, pos=env.p(posd), n_dims=n_dims,
                               mode=mode, freq_base=10000.0, factors=env.p(ffd) if ffd is not None else 0))  # fmt: skip
    got = env.get(bd)
    _check_rope(got[:, : H * D].reshape(T, H, D), ref)
    assert np.all(got[:, H * D :] == 0)


def _cache_tensor(n_cells: int, width: int, typ: G, rot: int) -> tuple[Tensor, np.ndarray]:
    c = Tensor("cache", (n_cells, width), typ)
    if rot:
        c.params["rot"] = rot
    shape, dt = storage(typ, (n_cells, width))
    init = rng.integers(0, 256, (n_cells, int(np.prod(shape[1:])) * np.dtype(dt).itemsize), dtype=np.uint8)
    return c, np.ascontiguousarray(init).view(dt).reshape(shape)


def _set_rows_ref(cache_t: Tensor, cache0: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    i, s = t("ids", ids.shape, G.I64), t("src", rows.shape)
    node = ops.set_rows(cache_t, i, s)
    return np.asarray(reference(node, [cache0.copy(), ids, rows]))


CACHES = [(G.F32, 0), (G.F16, 0), (G.Q8_0, 0), (G.Q4_0, 0), (G.Q8_0, 64), (G.Q4_0, 64), (G.Q8_0, 128)]


@pytest.mark.parametrize("typ,rot", CACHES, ids=[f"{c.name}-rot{r}" for c, r in CACHES])
def test_set_rows(env: Env, typ: G, rot: int) -> None:
    """The V store: rows of Hkv heads of D copied (mode -1) into cells ids, quantized and rotated
    as kernels.set_rows; a cell outside the cache is not written."""
    T, Hkv, D, N = 4, 2, 128, 16
    rows = randn(T, Hkv * D) * 2
    rows[1, :32] = 0.0  # an all-zero block: d = 0
    ids = np.array([5, 0, 15, 9], np.int64)
    cache_t, cache0 = _cache_tensor(N, Hkv * D, typ, rot)
    ref = _set_rows_ref(cache_t, cache0, ids, rows)
    cd, rd = env.d(cache0), env.d(rows)
    ids_dev = env.d(np.array([5, 0, 15, 99], np.int64))  # 99: outside -> row 3 skipped
    rb = cache0.reshape(N, -1).view(np.uint8).shape[1]
    env.run(lambda st: env.k.rope(st, env.p(rd), Hkv * D, D, 0, 0, 0, T, Hkv, D, cache_type=typ, ids=env.p(ids_dev), n_cells=N,
                               cache=env.p(cd), cache_rb=rb, rot=rot))  # fmt: skip
    got = env.get(cd).reshape(N, -1).view(np.uint8)
    want = ref.reshape(N, -1).view(np.uint8).copy()
    want[9] = cache0.reshape(N, -1).view(np.uint8)[9]  # the skipped row keeps its bytes
    bad = np.flatnonzero(np.any(got != want, axis=1))
    assert bad.size == 0, f"{typ.name} rot {rot}: rows {bad.tolist()} differ"


@pytest.mark.parametrize("typ,rot", CACHES, ids=[f"{c.name}-rot{r}" for c, r in CACHES])
def test_rope_with_k_store(env: Env, typ: G, rot: int) -> None:
    """ROPE of K and its store into the cache in one launch: the float32 output as the reference
    ROPE, the stored row as the reference SET_ROWS of that output (bit for bit)."""
    T, Hkv, D, N = 5, 2, 128, 16
    xa = randn(T, Hkv, D)
    ref = _rope_ref(xa, D, 2, 1e6, None)
    ids = np.array([3, 4, 5, 6, 7], np.int64)
    cache_t, cache0 = _cache_tensor(N, Hkv * D, typ, rot)
    xd, posd, idd, cd = env.d(xa), env.d(POS), env.d(ids), env.d(cache0)
    y = env.full((T, Hkv, D), np.nan, np.float32)
    rb = cache0.reshape(N, -1).view(np.uint8).shape[1]
    env.run(lambda st: env.k.rope(st, env.p(xd), Hkv * D, D, env.p(y), Hkv * D, D, T, Hkv, D, pos=env.p(posd), n_dims=D, mode=2,
                               freq_base=1e6, cache_type=typ, ids=env.p(idd), n_cells=N, cache=env.p(cd), cache_rb=rb,
                               rot=rot))  # fmt: skip
    got_y = env.get(y)
    _check_rope(got_y, ref)
    want = _set_rows_ref(cache_t, cache0, ids, got_y.reshape(T, -1))
    assert np.array_equal(env.get(cd).reshape(N, -1).view(np.uint8), want.reshape(N, -1).view(np.uint8))


@pytest.mark.parametrize("D", [320, 640, 2048])
@pytest.mark.parametrize("mode", [0, 2])
def test_rope_heads_wider_than_a_block(env: Env, mode: int, D: int) -> None:
    """Heads of more than ROPE_MAX_THREADS values: 2 to 8 values a thread, held in registers between
    the reads and the writes (rope.cu's vals), some threads with one value fewer than others; the
    last 64 dimensions are not rotated (copied), and the K store into a Q8_0 cache."""
    T, H, N = 2, 2, 4
    xa = randn(T, H, D)
    ref = _rope_ref(xa, D - 64, mode, 10000.0, None)
    ids = np.array([1, 3], np.int64)
    cache_t, cache0 = _cache_tensor(N, H * D, G.Q8_0, 0)
    xd, posd, idd, cd = env.d(xa), env.d(POS), env.d(ids), env.d(cache0)
    y = env.full((T, H, D), np.nan, np.float32)
    rb = cache0.reshape(N, -1).view(np.uint8).shape[1]
    env.run(lambda st: env.k.rope(st, env.p(xd), H * D, D, env.p(y), H * D, D, T, H, D, pos=env.p(posd), n_dims=D - 64,
                               mode=mode, freq_base=10000.0, cache_type=G.Q8_0, ids=env.p(idd), n_cells=N,
                               cache=env.p(cd), cache_rb=rb))  # fmt: skip
    got_y = env.get(y)
    _check_rope(got_y, ref)
    want = _set_rows_ref(cache_t, cache0, ids, got_y.reshape(T, -1))
    assert np.array_equal(env.get(cd).reshape(N, -1).view(np.uint8), want.reshape(N, -1).view(np.uint8))


@pytest.mark.parametrize("kt,vt,rot", [(G.F16, G.F16, 0), (G.Q8_0, G.Q4_0, 64), (G.F32, G.Q8_0, 0)])
def test_rope_qkv_is_three_launches(env: Env, kt: G, vt: G, rot: int) -> None:
    """rope_qkv (Q rope, K rope + store, V store in one launch from a fused QKV row) gives the
    bits of the three separate launches."""
    T, H, Hkv, D, N = 3, 8, 2, 128, 16
    W = (H + 2 * Hkv) * D
    qkv = env.d(randn(T, W + 8))  # row stride W + 8
    sxt = W + 8
    pos, ids = env.d(POS[:T]), env.d(np.array([2, 7, 11], np.int64))
    ct_k, k0 = _cache_tensor(N, Hkv * D, kt, rot if kt in (G.Q8_0, G.Q4_0) else 0)
    ct_v, v0 = _cache_tensor(N, Hkv * D, vt, rot if vt in (G.Q8_0, G.Q4_0) else 0)
    krot, vrot = ct_k.params.get("rot", 0), ct_v.params.get("rot", 0)
    rb_k, rb_v = k0.reshape(N, -1).view(np.uint8).shape[1], v0.reshape(N, -1).view(np.uint8).shape[1]
    outs = []
    for fused in (False, True):
        kc, vc, qo = env.d(k0), env.d(v0), env.full((T, H, D), np.nan, np.float32)
        b = env.p(qkv)
        kb, vb = b + 4 * H * D, b + 4 * (H + Hkv) * D
        rope = dict(pos=env.p(pos), n_dims=D, mode=2, freq_base=1e6)
        if fused:
            env.run(lambda st: env.k.rope_qkv(st, b, kb, vb, sxt, env.p(qo), H * D, T, H, Hkv, D, D, **rope,
                                              ids=env.p(ids), n_cells=N, k_type=kt, k_cache=env.p(kc), k_rb=rb_k,
                                              k_rot=krot, v_type=vt, v_cache=env.p(vc), v_rb=rb_v, v_rot=vrot))  # fmt: skip
        else:
            def three(st: Any) -> None:
                env.k.rope(st, b, sxt, D, env.p(qo), H * D, D, T, H, D, **rope)
                env.k.rope(st, kb, sxt, D, 0, 0, 0, T, Hkv, D, **rope, cache_type=kt, ids=env.p(ids), n_cells=N,
                           cache=env.p(kc), cache_rb=rb_k, rot=krot)  # fmt: skip
                env.k.rope(st, vb, sxt, D, 0, 0, 0, T, Hkv, D, cache_type=vt, ids=env.p(ids), n_cells=N,
                           cache=env.p(vc), cache_rb=rb_v, rot=vrot)  # fmt: skip

            env.run(three)
        outs.append([env.get(a).reshape(-1).view(np.uint8) for a in (qo, kc, vc)])
    for name, a, b2 in zip(("Q", "K cache", "V cache"), *outs):
        assert np.array_equal(a, b2), f"{name} differs between rope_qkv and three launches"
    assert not np.array_equal(outs[0][1], k0.reshape(-1).view(np.uint8))  # something was stored


# --- fattn.cu ----------------------------------------------------------------------------------


def _cache_values(x: np.ndarray, typ: G, rot: int) -> np.ndarray:
    """(N, Hkv, D) float32 -> the cache's stored form, (N, Hkv, D) or (N, Hkv, bytes)."""
    from llamapy.quants import rotate

    if typ == G.F32:
        return x
    if typ == G.F16:
        return x.astype(np.float16)
    n, h, dd = x.shape
    rows = rotate(x.reshape(n * h, dd), rot) if rot else x.reshape(n * h, dd)
    return np.asarray(quantize(rows, typ)).reshape(n, h, -1)


FA_CASES = [
    # kt, vt, T, H, Hkv, D, n_cells, n_kv, rot_k, rot_v
    (G.F16, G.F16, 1, 9, 3, 64, 300, 256, 0, 0),
    (G.F32, G.F32, 2, 4, 4, 64, 100, 100, 0, 0),
    (G.F16, G.F16, 1, 32, 8, 128, 4096, 3000, 0, 0),
    (G.F16, G.F16, 3, 8, 4, 256, 512, 300, 0, 0),
    (G.Q8_0, G.Q8_0, 1, 8, 2, 128, 600, 513, 128, 64),
    (G.Q4_0, G.Q4_0, 1, 8, 2, 128, 600, 513, 128, 64),
    (G.Q8_0, G.Q8_0, 2, 8, 2, 64, 200, 200, 0, 0),
    (G.F16, G.Q4_0, 3, 4, 2, 64, 300, 256, 0, 64),
    (G.Q8_0, G.F16, 5, 4, 2, 64, 300, 256, 64, 0),
    (G.Q4_0, G.F32, 1, 4, 1, 96, 300, 77, 0, 0),
    (G.F16, G.F16, 40, 4, 2, 64, 300, 200, 0, 0),  # a prompt: causal (below)
    # prompts of 9-31 tokens (fattn_tile_*: blocks of 16 query rows, the last one partial), a mask row each
    (G.Q8_0, G.Q8_0, 20, 8, 2, 64, 100, 60, 64, 64),
    (G.Q4_0, G.F16, 12, 4, 4, 128, 80, 80, 0, 0),
    (G.F32, G.F32, 17, 6, 3, 96, 90, 50, 0, 0),
    (G.F16, G.Q4_0, 9, 4, 1, 64, 70, 70, 0, 64),
]


@pytest.mark.parametrize("case", FA_CASES, ids=lambda c: f"{c[0].name}-{c[1].name}-T{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-n{c[7]}of{c[6]}-rot{c[8]}/{c[9]}")
@pytest.mark.parametrize("split", ["one", "split"])
@pytest.mark.parametrize("n_kv_on_device", [False, True])
def test_flash_attn_ext(env: Env, case: tuple, split: str, n_kv_on_device: bool) -> None:
    kt, vt, T, H, Hkv, D, N, n_kv, rot_k, rot_v = case
    work = H * n_kv * T  # the emulator runs ~10k of these a second
    if env.name == "emu" and not os.environ.get("LLAMAPY_EMU_ALL"):
        if work > 50000 or (work > 20000 and (split, n_kv_on_device) != ("split", True)):
            pytest.skip("seconds on the CPU emulator: runs on the GPU (LLAMAPY_EMU_ALL=1 runs it here)")
    q = randn(T, H, D)
    kf, vf = randn(N, Hkv, D), randn(N, Hkv, D)
    kv_k, kv_v = _cache_values(kf, kt, rot_k), _cache_values(vf, vt, rot_v)
    mask = np.where(rng.random((T, n_kv)) < 0.3, -np.inf, 0.0).astype(np.float32)
    mask[:, 0] = 0.0
    if T >= 32:  # a prompt of T tokens after n_kv - T cells of history: causal, whole tiles hidden
        mask = np.where(np.arange(n_kv)[None, :] <= np.arange(n_kv - T, n_kv)[:, None] - 100 * (np.arange(T)[:, None] % 3 == 0), 0.0, -np.inf).astype(np.float32)
    elif n_kv > 200:
        mask[0, 64:200] = -np.inf  # whole tiles masked: a split may see no visible cell
    tk, tv = Tensor("k", (N, Hkv, D), kt), Tensor("v", (N, Hkv, D), vt)
    if rot_k:
        tk.params["rot"] = rot_k
    if rot_v:
        tv.params["rot"] = rot_v
    node = ops.flash_attn_ext(t("q", (T, H, D)), tk, tv, t("m", (T, N)))
    ref = np.asarray(reference(node, [q, kv_k, kv_v, mask]))  # attends to the mask's n_kv cells

    s = 1 if split == "one" else fattn_splits(T, Hkv, N, env.k.n_sm)
    scratch = env.zeros(max(1, fattn_scratch_floats(T, H, D, s)), np.float32)
    # the mask in a slot as wide as the cache (stride N), or compact (stride 0 = n_kv)
    mslot = np.full((T, N), np.nan, np.float32)
    mslot[:, :n_kv] = mask
    md = env.d(mslot) if n_kv_on_device else env.d(mask)
    sm = N if n_kv_on_device else 0
    nd = env.d(np.array([n_kv], np.int32))
    qd, kd, vd = env.d(q), env.d(kv_k), env.d(kv_v)
    out = env.full((T, H, D), np.nan, np.float32)
    k_cb, k_hb = kv_k.strides[0], kv_k.strides[1]
    v_cb, v_hb = kv_v.strides[0], kv_v.strides[1]
    env.run(lambda st: env.k.flash_attn_ext(
        st, env.p(qd), H * D, D, kt, env.p(kd), k_cb, k_hb, vt, env.p(vd), v_cb, v_hb, N, env.p(md), sm, env.p(out), H * D, D, T, H,
        Hkv, D, D, node.params["scale"], n_kv=0 if n_kv_on_device else n_kv, n_kv_dev=env.p(nd) if n_kv_on_device else 0,
        n_splits=s, scratch=env.p(scratch), rot_k=rot_k, rot_v=rot_v))  # fmt: skip
    got = env.get(out)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-6)


# --- prompt products: f16 scratches and the GEMM ----------------------------------------------------


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequant_f16(env: Env, name: str) -> None:
    """Every weight type's rows decoded to f16: gguf's values rounded as numpy's astype(float16)."""
    from gguf.quants import dequantize

    n_rows, n_in = 9, 512
    raw = np.ascontiguousarray(random_rows(name, n_rows, n_in, np.random.default_rng(6)))
    want = dequantize(raw, G[name]).reshape(n_rows, n_in).astype(np.float32).astype(np.float16)
    rd = env.d(raw)
    y = env.full((n_rows - 2, n_in), np.nan, np.float16)
    env.run(lambda st: env.k.dequant_f16(st, G[name], env.p(rd) + raw.shape[1], raw.shape[1], n_rows - 2, n_in, env.p(y)))
    assert np.array_equal(env.get(y).view(np.uint16), want[1:-1].view(np.uint16))


def test_to_f16(env: Env) -> None:
    x = randn(5, 99) * 1e3
    x[0, :6] = [65504, 65520, -1e-8, 3e-5, np.inf, 6.1e-5]  # the largest half, overflow, subnormals
    xd = env.d(x)
    y = env.full((4, 96), np.nan, np.float16)
    env.run(lambda st: env.k.to_f16(st, env.p(xd), 99, env.p(y), 4, 96))
    with np.errstate(over="ignore"):  # (65520 and inf round to inf, as intended)
        want = x[:4, :96].astype(np.float16)
    assert np.array_equal(env.get(y).view(np.uint16), want.view(np.uint16))


def f16_scale(m: float) -> float:
    """An f16 GEMM input's scale by its definition: the smallest power of two s >= 1 with
    m / s <= 2^15 (at most 2^113: enough for every finite float32)."""
    s = 1.0
    while m / s > 2.0**15 and s < 2.0**113:
        s *= 2
    return s


@pytest.mark.parametrize("case", ["in-range", "past-65504", "inf"])
def test_to_f16_scaled(env: Env, case: str) -> None:
    """A prompt's f16 GEMM input with its power-of-two scale (amax_f32's partial maxima, blocks
    looping over 300 rows, then cpy_f32_f16): alpha = s and beta = 0 written for the GEMM, y =
    x / s rounded to f16; in range (max |x| <= 2^15) s = 1 and the unscaled conversion's bits.
    Only the n columns of each row count (a huge value past them changes nothing)."""
    from llamapy.backend.cuda_ops import F16_SCALE_BYTES

    x = randn(300, 99) * 1e3
    x[7, 97] = 1e30  # outside the 96 columns read
    if case != "in-range":
        x[290, 40] = -3e5 if case == "past-65504" else np.inf  # in a row the blocks reach on their second pass
    xd = env.d(x)
    y, y0 = env.full((300, 96), np.nan, np.float16), env.full((300, 96), np.nan, np.float16)
    sc = env.full((F16_SCALE_BYTES // 4,), np.nan, np.float32)
    env.run(lambda st: env.k.to_f16(st, env.p(xd), 99, env.p(y), 300, 96, scale=env.p(sc)))
    s = f16_scale(float(np.abs(x[:, :96]).max()))
    assert s == {"in-range": 1.0, "past-65504": 16.0, "inf": 2.0**113}[case]
    assert env.get(sc)[0] == s and env.get(sc)[1] == 0.0
    with np.errstate(over="ignore"):
        want = (x[:, :96] / np.float32(s)).astype(np.float16)
    got = env.get(y)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    if case == "past-65504":
        assert np.all(np.isfinite(got))
    if case == "in-range":
        env.run(lambda st: env.k.to_f16(st, env.p(xd), 99, env.p(y0), 300, 96))
        assert np.array_equal(got.view(np.uint16), env.get(y0).view(np.uint16))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_mul_mat_gemm_past_f16_range(env: Env, name: str) -> None:
    """A prompt's product whose input passes f16's 65504 (Gemma-like activations; unscaled, inf
    and NaN logits): finite, the float64 product of x and the f16 weights within the f16
    rounding of x / s, each of the two tiles' GEMMs multiplying by alpha = s read from device
    memory; the same input under 2^15 gives the unscaled path's bits."""
    from gguf.quants import dequantize

    from llamapy.backend.cuda_ops import F16_SCALE_BYTES

    n_out, n_in, n_tok, tile = 300, 256, 37, 256
    raw = np.ascontiguousarray(random_rows(name, n_out, n_in, np.random.default_rng(7)))
    w16 = dequantize(raw, G[name]).reshape(n_out, n_in).astype(np.float32).astype(np.float16).astype(np.float64)
    x = randn(n_tok, n_in) * 100
    x[3, 7] = 9e5  # s = 32
    rd = env.d(raw)
    sw, sx = env.zeros((tile, n_in), np.float16), env.zeros((n_tok, n_in), np.float16)
    sc = env.full((F16_SCALE_BYTES // 4,), np.nan, np.float32)

    def product(xv: np.ndarray, scale: bool) -> np.ndarray:
        xd, y = env.d(xv), env.full((n_tok, n_out), np.nan, np.float32)
        env.run(lambda st: env.k.mul_mat_gemm(st, G[name], env.p(rd), raw.shape[1], n_out, n_in, env.p(xd), n_in,
                                              env.p(y), n_tok, w16=env.p(sw), x16=env.p(sx), tile_rows=tile,
                                              scale=env.p(sc) if scale else 0))  # fmt: skip
        return env.get(y).astype(np.float64)

    got = product(x, True)
    assert np.all(np.isfinite(got)) and env.get(sc)[0] == 32.0
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ np.abs(w16).T
    xs = (x / np.float32(32)).astype(np.float16).astype(np.float64) * 32  # what the GEMMs multiply
    assert np.all(np.abs(got - xs @ w16.T) <= 1e-5 * scale + 1e-30)  # float32 accumulation
    # f16's rounding of x / s (2^-11 relative; 2^-24 s absolute for its subnormals) through the sums
    bound = 2.0**-11 * scale + 2.0**-24 * 32 * np.abs(w16).sum(1) + 1e-5 * scale
    assert np.all(np.abs(got - x64 @ w16.T) <= bound)
    x[3, 7] = 2.0**15  # the largest unscaled input
    a, b = product(x, True), product(x, False)
    assert env.get(sc)[0] == 1.0 and np.array_equal(a.view(np.uint64), b.view(np.uint64))


def test_mul_mat_gemm_bias(env: Env) -> None:
    """A prompt's product with its bias: the bits of the GEMMs, then add_f32 of the bias."""
    n_out, n_in, n_tok, tile = 300, 256, 20, 128
    raw = np.ascontiguousarray(random_rows("Q8_0", n_out, n_in, np.random.default_rng(3)))
    x, b = randn(n_tok, n_in), randn(n_out) * 4
    rd, xd, bd = env.d(raw), env.d(x), env.d(b)
    sw, sx = env.zeros((tile, n_in), np.float16), env.zeros((n_tok, n_in), np.float16)
    ys = [env.full((n_tok, n_out), np.nan, np.float32) for _ in range(2)]
    for y, bias in zip(ys, (0, env.p(bd))):
        env.run(lambda st: env.k.mul_mat_gemm(st, G.Q8_0, env.p(rd), raw.shape[1], n_out, n_in, env.p(xd), n_in,
                                              env.p(y), n_tok, w16=env.p(sw), x16=env.p(sx), tile_rows=tile, b=bias))
    a, c = env.get(ys[0]), env.get(ys[1])
    want = (a + b).astype(np.float32)  # (one float32 add, as add_f32)
    assert np.all(np.isfinite(c)) and np.array_equal(want.view(np.uint32), c.view(np.uint32))


@pytest.mark.parametrize("glu", ["", "swiglu"])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_mul_mat_gemm(env: Env, name: str, glu: str) -> None:
    """A prompt's product: x and W rounded to f16, one GEMM per tile of rows (here 3 tiles of 256
    rows and a partial one), float32 accumulation; with its GLU after it."""
    from gguf.quants import dequantize

    n_out, n_in, n_tok, tile = 800, 256, 37, 256
    raw = np.ascontiguousarray(random_rows(name, n_out, n_in, np.random.default_rng(7)))
    w16 = dequantize(raw, G[name]).reshape(n_out, n_in).astype(np.float32).astype(np.float16).astype(np.float64)
    x = randn(n_tok, n_in + 8)
    prod = x[:, :n_in].astype(np.float16).astype(np.float64) @ w16.T
    rd, xd = env.d(raw), env.d(x)
    sw, sx, sp = env.zeros((tile, n_in), np.float16), env.zeros((n_tok, n_in), np.float16), env.zeros((n_tok, n_out), np.float32)
    m = n_out // 2 if glu else n_out
    y = env.full((n_tok, m), np.nan, np.float32)
    env.run(lambda st: env.k.mul_mat_gemm(st, G[name], env.p(rd), raw.shape[1], n_out, n_in, env.p(xd), n_in + 8, env.p(y),
                                          n_tok, w16=env.p(sw), x16=env.p(sx), tile_rows=tile, glu=glu,
                                          prod=env.p(sp) if glu else 0))  # fmt: skip
    got = env.get(y).astype(np.float64)
    scale = np.abs(x[:, :n_in]).astype(np.float64) @ np.abs(w16).T
    if glu:
        g, u = prod[:, :m], prod[:, m:]
        want = g / (1 + np.exp(-g)) * u
        # the products' errors (as below) through silu(g) * u (|d/dg| <= 1.1 |u|, |d/du| <= |g|), then
        # the GLU's own float32 roundings
        bound = 1e-5 * (scale[:, :m] * 1.1 * np.abs(u) + scale[:, m:] * np.abs(g)) + 1e-6 * np.abs(want) + 1e-30
        assert np.all(np.abs(got - want) <= bound)
    else:
        assert np.all(np.abs(got - prod) <= 1e-5 * scale + 1e-30)  # float32 accumulation of exact f16 products


# --- the matrix-vector products ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_mul_mat_vec(env: Env, name: str) -> None:
    from gguf.quants import dequantize

    n_out, n_in, n_tok = 300, 1280, 3
    raw = np.ascontiguousarray(random_rows(name, n_out, n_in, np.random.default_rng(4)))
    w64 = dequantize(raw, G[name]).reshape(n_out, n_in).astype(np.float64)
    x = randn(n_tok, n_in)
    rd, xd = env.d(raw), env.d(x)
    y = env.full((n_tok, n_out), np.nan, np.float32)
    env.run(lambda st: env.k.mul_mat_vec(st, G[name], env.p(rd), raw.shape[1], n_out, n_in, env.p(xd), env.p(y), n_tok))
    scale = np.abs(x).astype(np.float64) @ np.abs(w64).T
    err = np.abs(env.get(y) - x.astype(np.float64) @ w64.T)
    assert np.all(err <= 1e-5 * scale + 1e-30)  # test_cuda_ops.test_matmul's bound


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "F16"])
def test_mul_mat_vec_bias_epilogue(env: Env, name: str) -> None:
    """The product with its bias as epilogue (qwen2's / gpt-oss's Q/K/V bias) gives the bits of
    the product, then add_f32 of the broadcast bias."""
    n_out, n_in, n_tok = 200, 512, 3
    raw = np.ascontiguousarray(random_rows(name, n_out, n_in, np.random.default_rng(6)))
    x, b = randn(n_tok, n_in), randn(n_out) * 4
    rd, xd, bd = env.d(raw), env.d(x), env.d(b)
    sep, fused = env.full((n_tok, n_out), np.nan, np.float32), env.full((n_tok, n_out), np.nan, np.float32)
    rb = raw.shape[1]

    def separate(st: Any) -> None:
        env.k.mul_mat_vec(st, G[name], env.p(rd), rb, n_out, n_in, env.p(xd), env.p(sep), n_tok)
        env.k.binary(st, "add", env.p(sep), n_out, env.p(bd), 0, env.p(sep), n_out, n_tok, n_out)

    env.run(separate)
    env.run(lambda st: env.k.mul_mat_vec(st, G[name], env.p(rd), rb, n_out, n_in, env.p(xd), env.p(fused), n_tok,
                                         b=env.p(bd)))  # fmt: skip
    a, c = env.get(sep), env.get(fused)
    assert np.all(np.isfinite(a)) and np.array_equal(a.view(np.uint32), c.view(np.uint32))


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("name", ["Q4_K", "Q4_1", "Q8_0"])
def test_mul_mat_vec_glu_epilogue(env: Env, name: str, op: str) -> None:
    """The gate/up product with its GLU as epilogue gives the bits of the product, then glu."""
    n_ff, n_in, n_tok = 96, 512, 2
    raw = np.ascontiguousarray(random_rows(name, 2 * n_ff, n_in, np.random.default_rng(5)))
    x = randn(n_tok, n_in) * 3
    rd, xd = env.d(raw), env.d(x)
    gu = env.full((n_tok, 2 * n_ff), np.nan, np.float32)
    sep = env.full((n_tok, n_ff), np.nan, np.float32)
    fused = env.full((n_tok, n_ff), np.nan, np.float32)
    rb = raw.shape[1]

    def separate(st: Any) -> None:
        env.k.mul_mat_vec(st, G[name], env.p(rd), rb, 2 * n_ff, n_in, env.p(xd), env.p(gu), n_tok)
        env.k.glu(st, op, env.p(gu), 2 * n_ff, env.p(gu) + 4 * n_ff, 2 * n_ff, env.p(sep), n_ff, n_tok, n_ff)

    env.run(separate)
    env.run(lambda st: env.k.mul_mat_vec_glu(st, op, G[name], env.p(rd), rb, n_ff, n_in, env.p(xd), env.p(fused), n_tok))
    a, b = env.get(sep), env.get(fused)
    assert np.all(np.isfinite(a)) and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# --- the int8 decode products (mmvq.cu: a q8_1 copy of x, dp4a) --------------------------------

MMVQ_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
              "MXFP4"]


def test_quantize_q8_1(env: Env) -> None:
    """The q8_1 copy: the bytes of quants.quantize_q8_1_cuda (ggml-cuda's rule), rows read at
    their stride, an all-zero block giving zeros."""
    from llamapy.backend.cuda_ops import q8_1_bytes
    from llamapy.quants import quantize_q8_1_cuda

    n_tok, n_in, sx = 5, 320, 352
    x = randn(n_tok, sx) * 4
    x[2, 64:96] = 0.0
    x[3, :32] = np.arange(32, dtype=np.float32) - 16  # exact halves after the division: roundf's ties
    q, ds = quantize_q8_1_cuda(x[:, :n_in])
    xd, out = env.d(x), env.full((q8_1_bytes(n_tok, n_in),), 0xCD, np.uint8)
    env.run(lambda st: env.k.quantize_q8_1(st, env.p(xd), sx, env.p(out), n_tok, n_in))
    got = env.get(out)
    assert np.array_equal(got[: n_tok * n_in].view(np.int8).reshape(n_tok, n_in), q)
    assert np.array_equal(got[n_tok * n_in:].view(np.float32).reshape(ds.shape).view(np.uint32), ds.view(np.uint32))
    assert not q[2, 64:96].any() and ds[2, 2, 0] == 0


@pytest.mark.parametrize("n", [576, 4096])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_writes_the_q8_1_copy(env: Env, n: int, add: bool) -> None:
    """rms_norm with `xq` (gpu_plan's _fuse_norm_q8): y as without it, and at xq the bytes that
    quantize_q8_1 writes from that y — the launch it replaces (256 and 1024 threads a row)."""
    from llamapy.backend.cuda_ops import q8_1_bytes

    rows, stride = 3, n + 64
    xa, ba, wa = randn(rows, stride) * 3, randn(rows, n), randn(n)
    xa[1, 32:64] = -ba[1, 32:64] if add else 0.0  # a block of zeros: q = 0, d = 0
    xd, bd, wd = env.d(xa), env.d(ba), env.d(wa)
    y0, y1, s = (env.full((rows, n), np.nan, np.float32) for _ in range(3))
    fused, alone = (env.full((q8_1_bytes(rows, n),), 0xCD, np.uint8) for _ in range(2))
    kw = dict(b=env.p(bd), sb=n, sum_out=env.p(s), ss=n) if add else {}
    env.run(lambda st: env.k.rms_norm(st, env.p(xd), stride, env.p(y0), n, rows, n, 1e-5, w=env.p(wd), **kw))
    env.run(lambda st: env.k.quantize_q8_1(st, env.p(y0), n, env.p(alone), rows, n))
    env.run(lambda st: env.k.rms_norm(st, env.p(xd), stride, env.p(y1), n, rows, n, 1e-5, w=env.p(wd),
                                      xq=env.p(fused), **kw))  # fmt: skip
    assert np.array_equal(env.get(y1).view(np.uint32), env.get(y0).view(np.uint32))
    got, want = env.get(fused), env.get(alone)
    assert np.array_equal(got, want) and (want[:rows * n] != 0xCD).any()
    assert not got[n + 32:n + 64].any()  # the zero block's quants


def _mmvq(env: Env, name: str, raw: np.ndarray, x: np.ndarray, n_rows: int, glu: str = "", b: int = 0) -> np.ndarray:
    """x quantized on the device, then the int8 product (with its GLU: n_rows is n_ff; or its bias
    at device address b)."""
    from llamapy.backend.cuda_ops import q8_1_bytes

    n_tok, n_in = x.shape
    rd, xd = env.d(raw), env.d(x)
    xq = env.zeros((q8_1_bytes(n_tok, n_in),), np.uint8)
    y = env.full((n_tok, n_rows), np.nan, np.float32)

    def run(st: Any) -> None:
        env.k.quantize_q8_1(st, env.p(xd), n_in, env.p(xq), n_tok, n_in)
        env.k.mul_mat_vec_q8(st, G[name], env.p(rd), raw.shape[1], n_rows, n_in, env.p(xq), env.p(y), n_tok, glu=glu, b=b)

    env.run(run)
    return env.get(y)


@pytest.mark.parametrize("n_tok", range(1, 9))
@pytest.mark.parametrize("name", MMVQ_TYPES)
def test_mul_mat_vec_q8(env: Env, name: str, n_tok: int) -> None:
    """The int8 product of every type with mmvq.cu's decoder, 1-8 tokens, a ragged last block of
    rows: the float64 product of gguf-py's dequantized weights and the dequantized q8_1 copy
    (quants.quantize_q8_1_cuda), within float32 rounding of each unit's sum and of the sums of 40
    units (the bound of the float32 products above; a wrong nibble, scale or offset is off by
    orders of magnitude more)."""
    from gguf.quants import dequantize

    from llamapy.quants import quantize_q8_1_cuda

    n_out, n_in = 67, 1280
    raw = np.ascontiguousarray(random_rows(name, n_out, n_in, np.random.default_rng(40 + n_tok)))
    w64 = dequantize(raw, G[name]).reshape(n_out, n_in).astype(np.float64)
    x = randn(n_tok, n_in)
    q, ds = quantize_q8_1_cuda(x)
    xq64 = (q.reshape(n_tok, -1, 32) * ds[..., :1].astype(np.float64)).reshape(n_tok, n_in)
    got = _mmvq(env, name, raw, x, n_out)
    scale = np.abs(xq64) @ np.abs(w64).T
    assert np.all(np.abs(got - xq64 @ w64.T) <= 1e-5 * scale + 1e-30)
    # and the q8_1 rounding itself: near the float32 activations' product (~1 % of the scale)
    assert np.all(np.abs(got - x.astype(np.float64) @ w64.T) <= 2e-2 * scale)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_1", "Q8_0"])
def test_mul_mat_vec_q8_glu_epilogue(env: Env, name: str, op: str) -> None:
    """The int8 gate/up product with its GLU as epilogue: the bits of the int8 product of the 2 n_ff
    rows, then glu."""
    n_ff, n_in, n_tok = 37, 512, 3
    raw = np.ascontiguousarray(random_rows(name, 2 * n_ff, n_in, np.random.default_rng(5)))
    x = randn(n_tok, n_in) * 3
    gu = _mmvq(env, name, raw, x, 2 * n_ff)
    gd, sep = env.d(gu), env.full((n_tok, n_ff), np.nan, np.float32)
    env.run(lambda st: env.k.glu(st, op, env.p(gd), 2 * n_ff, env.p(gd) + 4 * n_ff, 2 * n_ff, env.p(sep), n_ff, n_tok, n_ff))
    a, b = env.get(sep), _mmvq(env, name, raw, x, n_ff, glu=op)
    assert np.all(np.isfinite(a)) and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_mul_mat_vec_q8_bias_epilogue(env: Env, name: str) -> None:
    """The int8 product with its bias as epilogue (a large qwen2 / gpt-oss Q/K/V product): the bits
    of the int8 product, then the bias added in float32."""
    n_out, n_in, n_tok = 45, 512, 3
    raw = np.ascontiguousarray(random_rows(name, n_out, n_in, np.random.default_rng(6)))
    x, bias = randn(n_tok, n_in), randn(n_out) * 4
    plain = _mmvq(env, name, raw, x, n_out)
    got = _mmvq(env, name, raw, x, n_out, b=env.p(env.d(bias)))
    want = (plain + bias[None, :]).astype(np.float32)
    assert np.all(np.isfinite(got)) and np.array_equal(got.view(np.uint32), want.view(np.uint32))


# --- the mixture-of-experts block (moe.cu, common.cuh's mmv_id) --------------------------------


def _moe_case(name: str, n_expert: int = 5, m: int = 72, n_in: int = 256, T: int = 3, U: int = 2):
    """Stacked experts of `name`, routed ids (token 2 shares an expert with token 0; every token's
    experts differ), per-slot input rows."""
    raw = np.ascontiguousarray(random_rows(name, n_expert * m, n_in, np.random.default_rng(8)))
    ids = np.array([[3, 1], [0, 4], [1, 2]][:T], np.int32)[:, :U]
    # its own generator: the module's `rng` depends on which tests ran before (an MXFP4 draw after
    # others once summed to a cancellation past the reference check's atol)
    x = np.random.default_rng(11).standard_normal((T, U, n_in)).astype(np.float32)
    return raw, ids, x


def _ids_product(env: Env, q8: bool, x: np.ndarray, xd: Any) -> Any:
    """env.k.mul_mat_id over x (contiguous rows, at xd), or (q8) the int8 product: x's q8_1 copy
    made first, the strides then counted in its rows (gpu_plan's MUL_MAT_ID_Q8)."""
    from llamapy.backend.cuda_ops import q8_1_bytes

    n_in = x.shape[-1]
    rows = x.size // n_in
    xq = env.zeros((q8_1_bytes(rows, n_in),), np.uint8)

    def run(st: Any, qtype: G, w: int, rb: int, n_expert: int, m: int, _n_in: int, xp: int, sxt: int, sxu: int,
            *rest: Any, **kw: Any) -> None:
        if not q8:
            return env.k.mul_mat_id(st, qtype, w, rb, n_expert, m, n_in, xp, sxt, sxu, *rest, **kw)
        assert xp == env.p(xd)
        env.k.quantize_q8_1(st, xp, n_in, env.p(xq), rows, n_in)
        env.k.mul_mat_id(st, qtype, w, rb, n_expert, m, n_in, env.p(xq), sxt // n_in, sxu // n_in, *rest,
                         q8_rows=rows, **kw)

    return run


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "MXFP4", "F16", "Q4_K-q8", "Q6_K-q8", "MXFP4-q8"])
def test_mul_mat_id(env: Env, name: str, shared: bool) -> None:
    """Each (token, slot) gets the bits of the dense product of its expert's rows (mmv; "-q8":
    the int8 one, mmvq, of the row's q8_1 copy), whether the expert is read for one pair or
    several; one input row a token (gate/up) or one a slot (down)."""
    name, q8 = name.removesuffix("-q8"), name.endswith("-q8")
    raw, ids, x = _moe_case(name)
    (T, U), n_in, m, n_expert = ids.shape, x.shape[2], 72, 5
    if shared:
        x = np.ascontiguousarray(x[:, :1])
    rb = raw.shape[1]
    rd, xd, idd = env.d(raw), env.d(x), env.d(ids)
    y = env.full((T, U, m), np.nan, np.float32)
    sxt, sxu = x.shape[1] * n_in, (0 if shared else n_in)
    product = _ids_product(env, q8, x, xd)
    env.run(lambda st: product(st, G[name], env.p(rd), rb, n_expert, m, n_in, env.p(xd), sxt, sxu, env.p(idd), U,
                               env.p(y), T, U))  # fmt: skip
    got = env.get(y)
    for tk in range(T):
        for u in range(U):
            e = int(ids[tk, u])
            xrow = np.ascontiguousarray(x[tk, 0 if shared else u][None])
            wr = np.ascontiguousarray(raw[e * m:(e + 1) * m])
            if q8:
                want = _mmvq(env, name, wr, xrow, m)
            else:
                xr, yr, wd = env.d(xrow), env.full((1, m), np.nan, np.float32), env.d(wr)
                env.run(lambda st: env.k.mul_mat_vec(st, G[name], env.p(wd), rb, m, n_in, env.p(xr), env.p(yr), 1))
                want = env.get(yr)
            assert np.all(np.isfinite(got[tk, u])) and np.array_equal(got[tk, u].view(np.uint32),
                                                                      want[0].view(np.uint32)), (tk, u)
    if q8:
        return  # (mmvq's sums: test_mul_mat_vec_q8 holds them to the float64 product)
    # against the numpy reference of the op
    from llamapy.backend.kernels import mul_mat_id as ref_mul_mat_id
    from gguf.quants import dequantize

    wf = dequantize(raw, G[name]).reshape(n_expert, m, n_in).astype(np.float32)
    w_t, x_t, i_t = t("w", (n_expert, m, n_in)), t("x", x.shape), t("ids", ids.shape, G.I32)
    ref = ref_mul_mat_id(ops.mul_mat_id(w_t, x_t, i_t), [wf, x, ids], np)
    # another summation order: float32 rounding relative to the outputs' scale
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8"])
@pytest.mark.parametrize("op", ["swiglu", "geglu", "swiglu_oai"])
def test_mul_mat_id_glu_epilogue(env: Env, op: str, q8: bool) -> None:
    """gate and up experts with the GLU as epilogue: the bits of the two products, then glu; an
    expert id out of range gives NaN rows, nothing read. swiglu_oai (gpt-oss) with the experts'
    biases too: the bits of the products, add_id of each, then glu. q8: the int8 products of
    x's q8_1 copy alike."""
    raw_g, ids, x = _moe_case("Q4_K")
    raw_u = np.ascontiguousarray(random_rows("Q4_K", raw_g.shape[0], 256, np.random.default_rng(9)))
    (T, U), n_in, m = ids.shape, 256, 72
    ids[2, 1] = 5  # out of range
    x = np.ascontiguousarray(x[:, :1]) * 3
    rb = raw_g.shape[1]
    gd, ud, xd, idd = env.d(raw_g), env.d(raw_u), env.d(x), env.d(ids)
    g, u = env.full((T, U, m), np.nan, np.float32), env.full((T, U, m), np.nan, np.float32)
    sep, fused = env.full((T, U, m), np.nan, np.float32), env.full((T, U, m), np.nan, np.float32)
    oai = op == "swiglu_oai"
    kw: dict[str, Any] = dict(alpha=1.702, limit=7.0) if oai else {}
    bg, bu = env.d(randn(5, m + 3) * 4), env.d(randn(5, m + 3) * 4)  # bias rows m + 3 apart
    product = _ids_product(env, q8, x, xd)

    def separate(st: Any) -> None:
        product(st, G.Q4_K, env.p(gd), rb, 5, m, n_in, env.p(xd), n_in, 0, env.p(idd), U, env.p(g), T, U)
        product(st, G.Q4_K, env.p(ud), rb, 5, m, n_in, env.p(xd), n_in, 0, env.p(idd), U, env.p(u), T, U)
        if oai:
            for y, b in ((g, bg), (u, bu)):
                env.k.add_id(st, env.p(y), m, env.p(b), m + 3, 5, env.p(idd), U, env.p(y), m, T * U, m, U)
        env.k.glu(st, op, env.p(g), m, env.p(u), m, env.p(sep), m, T * U, m, **kw)

    env.run(separate)
    if oai:
        kw.update(b=env.p(bg), b2=env.p(bu), sb=m + 3)
    env.run(lambda st: product(st, G.Q4_K, env.p(gd), rb, 5, m, n_in, env.p(xd), n_in, 0, env.p(idd), U,
                               env.p(fused), T, U, w2=env.p(ud), glu=op, **kw))
    a, b = env.get(sep), env.get(fused)
    assert np.all(np.isnan(b[2, 1])) and np.all(np.isnan(env.get(g)[2, 1]))
    a[2, 1] = b[2, 1] = 0
    assert np.all(np.isfinite(a)) and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8"])
def test_mul_mat_id_bias_epilogue(env: Env, q8: bool) -> None:
    """One expert product with its biases as epilogue (gpt-oss's down experts): the bits of
    mul_mat_id, then add_id (q8: of the int8 products)."""
    raw, ids, x = _moe_case("MXFP4")
    (T, U), n_in, m = ids.shape, 256, 72
    rb = raw.shape[1]
    rd, xd, idd, bd = env.d(raw), env.d(x), env.d(ids), env.d(randn(5, m))
    sep, fused = env.full((T, U, m), np.nan, np.float32), env.full((T, U, m), np.nan, np.float32)
    product = _ids_product(env, q8, x, xd)

    def separate(st: Any) -> None:
        product(st, G.MXFP4, env.p(rd), rb, 5, m, n_in, env.p(xd), U * n_in, n_in, env.p(idd), U, env.p(sep), T, U)
        env.k.add_id(st, env.p(sep), m, env.p(bd), m, 5, env.p(idd), U, env.p(sep), m, T * U, m, U)

    env.run(separate)
    env.run(lambda st: product(st, G.MXFP4, env.p(rd), rb, 5, m, n_in, env.p(xd), U * n_in, n_in, env.p(idd), U,
                               env.p(fused), T, U, b=env.p(bd), sb=m))  # fmt: skip
    a, b = env.get(sep), env.get(fused)
    assert np.all(np.isfinite(a)) and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_moe_sort_more_experts_than_threads(env: Env) -> None:
    """moe_sort over 200 experts (more buckets than the block's threads), a strided ids view, ids
    out of range on both sides: a stable sort of the pairs by expert, those last, and the offsets."""
    T, U, E = 40, 8, 200
    ids = np.random.default_rng(5).integers(-3, E + 3, (T, U + 2)).astype(np.int32)  # rows of U + 2: a view
    idd, order = env.d(ids), env.full((T * U + E + 2,), -1, np.int32)
    env.run(lambda st: env.k.moe_sort(st, env.p(idd), U + 2, T, U, E, env.p(order), env.p(order) + 4 * T * U))
    flat = ids[:, :U].reshape(-1)
    flat = np.where((flat < 0) | (flat >= E), E, flat)
    got = env.get(order)
    assert np.array_equal(got[:T * U], np.argsort(flat, kind="stable"))
    assert np.array_equal(got[T * U:], np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E + 1))]))


@pytest.mark.parametrize("case", ["down", "swiglu", "swiglu_oai+bias", "down+per-expert", "swiglu+per-expert+tiles",
                                  "down+big", "swiglu+per-expert+big"])
def test_mul_mat_id_gemm(env: Env, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's expert product: the pairs grouped by expert (moe_sort: a stable sort, ids out of
    range last), the rows gathered and rounded to f16, the experts' GEMMs (float32 accumulation:
    one strided batched GEMM over the experts' padded rows, or — no expert fitting the weight
    scratch — one an expert, in tiles of rows), the rows scattered back with the biases and the
    GLU: the f16-rounded product's values within float32 accumulation, NaN for an id out of range;
    the second product of the same routing reuses the offsets read (no sort, no read). Scratches
    of moe_scratch_bytes' sizes. "big": inputs past f16's 65504, gathered as x / s (the pairs'
    power-of-two scale), every GEMM's alpha = s: finite, within f16's rounding of the float64
    product."""
    from gguf.quants import dequantize

    from llamapy.backend import cuda_ops

    n_expert, m, n_in, T, U = 5, 72, 256, 20, 2
    if "per-expert" in case:  # no expert fits the weight scratch of the batched GEMMs
        monkeypatch.setattr(cuda_ops, "MOE_W16_BYTES", 1)
    if "tiles" in case:  # experts of 300 rows decoded 256 at a time (the smallest tile)
        m = 300
        monkeypatch.setattr(cuda_ops, "GEMM_SCRATCH_BYTES", 1)
    gemms: list[int] = []  # the GEMM launcher's calls: 8 arguments one GEMM, 12 a batched one
    real_gemm = env.k.gemm

    def gemm(grid: Any, block: Any, args: tuple, **kw: Any) -> None:
        gemms.append(len(args))
        real_gemm(grid, block, args, **kw)

    monkeypatch.setattr(env.k, "gemm", gemm)
    rng = np.random.default_rng(21)
    ids = rng.integers(0, n_expert, (T, U)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1 + ids[:, 1] % (n_expert - 1)) % n_expert  # two experts a token
    ids[7, 1] = n_expert  # out of range
    ids[ids == 4] = 3  # expert 4 used by no pair: no GEMM for it
    glu = not case.startswith("down")
    x = rng.standard_normal((T, 1 if glu else U, n_in)).astype(np.float32)  # gate/up: one row a token
    if "big" in case:
        x *= 1e3
        x[11, -1, 5] = 2e5  # s = 8: 2e5 / 8 <= 2^15
    raws = [np.ascontiguousarray(random_rows("Q4_K", n_expert * m, n_in, np.random.default_rng(s))) for s in (8, 9)]
    ws = [dequantize(r, G.Q4_K).reshape(n_expert, m, n_in).astype(np.float32).astype(np.float16).astype(np.float64)
          for r in raws]  # fmt: skip
    bias = [randn(n_expert, m + 3) * 4 for _ in range(2)] if "bias" in case else None
    n_pairs = T * U
    rd = [env.d(r) for r in raws]
    xd, idd = env.d(x), env.d(ids)
    sizes = cuda_ops.moe_scratch_bytes(T, U, n_expert, m, n_in, glu)
    order, x16, w16, prod = (env.full((n // 4,), -1, np.int32) for n in sizes)
    assert cuda_ops.gemm_tile_rows(m, n_in) == (256 if "tiles" in case else m)
    y = env.full((T, U, m), np.nan, np.float32)
    sxt, sxu = x.shape[1] * n_in, (0 if glu else n_in)
    sc = env.full((cuda_ops.F16_SCALE_BYTES // 4,), np.nan, np.float32)
    kw: dict[str, Any] = dict(order=env.p(order), x16=env.p(x16), w16=env.p(w16), prod=env.p(prod), scale=env.p(sc))
    if glu:
        kw.update(w2=env.p(rd[1]), glu=case.split("+")[0])
        if bias:
            bd = [env.d(b) for b in bias]
            kw.update(b=env.p(bd[0]), b2=env.p(bd[1]), sb=m + 3, alpha=1.702, limit=7.0)
    got_offs: list[np.ndarray] = []
    env.run(lambda st: got_offs.append(env.k.mul_mat_id_gemm(st, G.Q4_K, env.p(rd[0]), raws[0].shape[1], n_expert, m,
                                                             n_in, env.p(xd), sxt, sxu, env.p(idd), U, env.p(y), T, U,
                                                             **kw)))  # fmt: skip
    flat = np.where(ids.reshape(-1) >= n_expert, n_expert, ids.reshape(-1))
    o = env.get(order)
    assert np.array_equal(o[:n_pairs], np.argsort(flat, kind="stable"))
    want_offs = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n_expert + 1))])
    assert np.array_equal(o[n_pairs:n_pairs + n_expert + 2], want_offs) and np.array_equal(got_offs[0], want_offs)
    # batched: one GEMM a half (gate, up); else one an expert used (4 of 5) a half and tile
    n_half = 2 if glu else 1
    assert gemms == ([8] * 4 * n_half * (2 if "tiles" in case else 1) if "per-expert" in case else [12] * n_half), gemms
    got = env.get(y).astype(np.float64)
    assert np.all(np.isnan(got[7, 1]))
    s = f16_scale(float(np.abs(x).max()))
    assert env.get(sc)[0] == s == (8.0 if "big" in case else 1.0) and env.get(sc)[1] == 0.0
    xs = (x / np.float32(s)).astype(np.float16).astype(np.float64) * s  # what the GEMMs multiply
    for tk in range(T):
        for u in range(U):
            e = int(ids[tk, u])
            if e >= n_expert:
                continue
            xr = xs[tk, 0 if glu else u]
            g, scale = ws[0][e] @ xr, np.abs(ws[0][e]) @ np.abs(xr)
            if not glu:
                assert np.all(np.abs(got[tk, u] - g) <= 1e-5 * scale + 1e-30), (tk, u)
                # and f16's rounding of x / s from the float64 product (2^-24 s: its subnormals)
                x64 = x[tk, u].astype(np.float64)
                bound = 2.0**-11 * scale + 2.0**-24 * s * np.abs(ws[0][e]).sum(1) + 1e-5 * scale
                assert np.all(np.abs(got[tk, u] - ws[0][e] @ x64) <= bound), (tk, u)
                continue
            up, scale_u = ws[1][e] @ xr, np.abs(ws[1][e]) @ np.abs(xr)
            if bias:
                g, up = g + bias[0][e, :m], up + bias[1][e, :m]
                gc, uc = np.minimum(g, 7.0), np.clip(up, -7.0, 7.0)
                want = gc / (1 + np.exp(-1.702 * gc)) * (uc + 1)
            else:
                with np.errstate(over="ignore"):  # (exp(-g) of a large negative g: want -0)
                    want = g / (1 + np.exp(-g)) * up
            # the products' errors (float32 accumulation) through the GLU, then its own roundings
            bound = 1e-5 * (2 * scale * (np.abs(up) + 1) + 2 * scale_u * np.abs(g)) + 1e-6 * np.abs(want) + 1e-30
            assert np.all(np.abs(got[tk, u] - want) <= bound), (tk, u)
    # the next product of the same routing: the offsets given back, no sort (the order scratch kept)
    y2 = env.full((T, U, m), np.nan, np.float32)
    env.run(lambda st: env.k.mul_mat_id_gemm(st, G.Q4_K, env.p(rd[0]), raws[0].shape[1], n_expert, m, n_in, env.p(xd),
                                             sxt, sxu, env.p(idd), U, env.p(y2), T, U, offs=got_offs[0],
                                             **kw))  # fmt: skip
    np.testing.assert_array_equal(env.get(y2), env.get(y))  # (NaN where NaN)


def test_router(env: Env) -> None:
    """SOFT_MAX, ARGSORT, the batched GET_ROWS of the chosen weights, SUM_ROWS, CLAMP and the
    DIV / MUL by one value a row, each against its numpy reference (strided inputs)."""
    T, E, U, C = 3, 40, 4, 24
    la = randn(T, E + 5) * 2
    la[1, 7] = la[1, 30]  # a tie: the lower index first
    lg = t("logits", (T, E))
    probs = ops.soft_max(lg, scale=0.5)
    lv = np.ascontiguousarray(la[:, :E])
    p_ref = reference(probs, [lv])
    srt = ops.argsort_top_k(probs, E)
    s_node = srt.src[0] if srt.op.name == "VIEW" else srt
    ld = env.d(la)
    pd, sd = env.full((T, E), np.nan, np.float32), env.zeros((T, E), np.int32)
    env.run(lambda st: env.k.soft_max(st, env.p(ld), E + 5, env.p(pd), E, T, E, 0.5))
    got_p = env.get(pd)
    assert max_ulp(got_p, p_ref) <= 8, "soft_max"
    env.run(lambda st: env.k.argsort(st, env.p(pd), E, env.p(sd), E, T, E))
    np.testing.assert_array_equal(env.get(sd), reference(s_node, [got_p]))
    # the chosen weights: (T, E, 1) rows by (T, U) ids
    sel = np.ascontiguousarray(env.get(sd)[:, :U])
    p3, ids_t = t("p3", (T, E, 1)), t("sel", (T, U), G.I32)
    w_ref = reference(ops.get_rows(p3, ids_t), [got_p.reshape(T, E, 1), sel])
    seld, wd = env.d(sel), env.full((T, U, 1), np.nan, np.float32)
    env.run(lambda st: env.k.get_rows_batched(st, env.p(pd), E, 1, E, env.p(seld), U, env.p(wd), T, U, 1))
    assert np.array_equal(env.get(wd), w_ref)
    # normalisation: sum, clamp, div; then the slots' outputs times their weights
    w2 = env.get(wd).reshape(T, U)
    w2t = t("w2", (T, U))
    tot = reference(ops.sum_rows(w2t), [w2])
    sumd = env.full((T, 1), np.nan, np.float32)
    env.run(lambda st: env.k.sum_rows(st, env.p(wd), U, env.p(sumd), T, U))
    assert np.array_equal(env.get(sumd), tot)
    cl = reference(ops.clamp(t("s", (T, 1)), 0.9, float("inf")), [tot])
    cld = env.full((T, 1), np.nan, np.float32)
    env.run(lambda st: env.k.clamp(st, env.p(sumd), 1, env.p(cld), T, 1, 0.9, float("inf")))
    assert np.array_equal(env.get(cld), cl)
    nrm = reference(ops.div(w2t, t("c", (T, 1))), [w2, cl])
    nd = env.full((T, U), np.nan, np.float32)
    env.run(lambda st: env.k.binary_row(st, "div", env.p(wd), U, env.p(cld), 1, env.p(nd), U, T, U))
    assert np.array_equal(env.get(nd), nrm)
    # the six launches as one (router_f32): the same bits
    rid, rw = env.zeros((T, E), np.int32), env.full((T, U), np.nan, np.float32)
    env.run(lambda st: env.k.router(st, env.p(ld), E + 5, env.p(rid), env.p(rw), T, E, U, 0.5, 0.9, float("inf")))
    np.testing.assert_array_equal(env.get(rid), env.get(sd))
    assert np.array_equal(env.get(rw).view(np.uint32), env.get(nd).view(np.uint32))
    ex = randn(T * U, C + 2)
    exd, md = env.d(ex), env.full((T * U, C), np.nan, np.float32)
    mref = reference(ops.mul(t("ex", (T, U, C)), t("w", (T, U, 1))), [ex[:, :C].reshape(T, U, C), nrm.reshape(T, U, 1)])
    env.run(lambda st: env.k.binary_row(st, "mul", env.p(exd), C + 2, env.p(nd), 1, env.p(md), C, T * U, C))
    assert np.array_equal(env.get(md), mref.reshape(T * U, C))


# --- one CUDA graph, replayed ------------------------------------------------------------------


def test_captured_graph_replays_over_history_lengths(env: Env) -> None:
    """A decode layer's attention part (ROPE of Q; ROPE + store of K; store of V; split attention
    with n_kv, positions and cells read from device memory) captured once as a CUDA graph, then
    replayed with new inputs copied in: each replay equals the reference of that step."""
    H, Hkv, D, N = 8, 2, 64, 512
    scale = 1.0 / np.sqrt(D)
    s = fattn_splits(1, Hkv, N, env.k.n_sm)
    cache_k = env.zeros((N, Hkv, D), np.float16)
    cache_v = env.zeros((N, Hkv, D), np.float16)
    qkv = env.zeros((1, (H + 2 * Hkv) * D), np.float32)  # the fused QKV product's row
    pos, cell = env.zeros(1, np.int32), env.zeros(1, np.int64)
    n_kv = env.zeros(1, np.int32)
    mask = env.zeros((1, N), np.float32)
    qr = env.zeros((1, H, D), np.float32)
    out = env.zeros((1, H, D), np.float32)
    scratch = env.zeros(fattn_scratch_floats(1, H, D, s), np.float32)
    W = (H + 2 * Hkv) * D
    kb, vb = env.p(qkv) + 4 * H * D, env.p(qkv) + 4 * (H + Hkv) * D

    def layer(st: Any) -> None:
        rope = dict(pos=env.p(pos), n_dims=D, mode=0, freq_base=10000.0)
        env.k.rope(st, env.p(qkv), W, D, env.p(qr), H * D, D, 1, H, D, **rope)
        env.k.rope(st, kb, W, D, 0, 0, 0, 1, Hkv, D, **rope, cache_type=G.F16, ids=env.p(cell), n_cells=N, cache=env.p(cache_k),
               cache_rb=Hkv * D * 2)  # fmt: skip
        env.k.rope(st, vb, W, D, 0, 0, 0, 1, Hkv, D, cache_type=G.F16, ids=env.p(cell), n_cells=N, cache=env.p(cache_v),
               cache_rb=Hkv * D * 2)  # fmt: skip
        env.k.flash_attn_ext(st, env.p(qr), H * D, D, G.F16, env.p(cache_k), Hkv * D * 2, D * 2, G.F16, env.p(cache_v), Hkv * D * 2,
                         D * 2, N, env.p(mask), N, env.p(out), H * D, D, 1, H, Hkv, D, D, scale, n_kv_dev=env.p(n_kv), n_splits=s,
                         scratch=env.p(scratch))  # fmt: skip

    replay = env.capture(layer)
    kf = np.zeros((N, Hkv, D), np.float32)
    vf = np.zeros((N, Hkv, D), np.float32)
    for step, (position, n) in enumerate([(0, 1), (1, 2), (2, 3), (300, 301), (301, 302)]):
        row = randn(1, W)
        if step == 3:  # a jump: cells 3..299 filled on the host (as a prompt would have)
            kf[3:300], vf[3:300] = randn(297, Hkv, D), randn(297, Hkv, D)
            cache_k[3:300] = env.d(kf[3:300].astype(np.float16))
            cache_v[3:300] = env.d(vf[3:300].astype(np.float16))
        qkv[...] = env.d(row)
        pos[...] = position
        cell[...] = position
        n_kv[...] = n
        mask[...] = 0.0
        replay()
        q3 = row[:, : H * D].reshape(1, H, D)
        kq = _rope_ref_at(row[:, H * D : (H + Hkv) * D].reshape(1, Hkv, D), position)
        kf[position], vf[position] = kq[0], row[0, (H + Hkv) * D :].reshape(Hkv, D)
        tq, tk, tv = t("q", (1, H, D)), Tensor("k", (N, Hkv, D), G.F16), Tensor("v", (N, Hkv, D), G.F16)
        node = ops.flash_attn_ext(tq, tk, tv, t("m", (1, N)))
        ref = reference(node, [_rope_ref_at(q3, position), kf.astype(np.float16), vf.astype(np.float16),
                               np.zeros((1, n), np.float32)])  # fmt: skip
        np.testing.assert_allclose(env.get(out), ref, rtol=1e-4, atol=2e-6, err_msg=f"replay {step}, {n} cells")


def _rope_ref_at(xa: np.ndarray, position: int) -> np.ndarray:
    T, H, D = xa.shape
    x, pos = t("x", (T, H, D)), t("pos", (T,), G.I32)
    return reference(ops.rope(x, pos, D, 10000.0, 1.0, None, mode=0), [xa, np.array([position], np.int32)])


# --- a whole decode layer from the kernels -----------------------------------------------------


def test_decode_layer_from_kernels(env: Env) -> None:
    """One llama decode layer as the compiled GPU split launches it, 9 kernels (+ the attention
    combine): RMS_NORM x w -> QKV product -> rope_qkv (Q rope, K rope + store, V store) ->
    attention over the history -> output product -> ADD + RMS_NORM x w (the sum kept) -> gate/up
    product with SwiGLU -> down product -> ADD; against the same layer in numpy from the
    reference ops (weights expanded by gguf-py), after 40 cells of history."""
    from gguf.quants import dequantize

    E, H, Hkv, D, F, N, n_past = 256, 8, 2, 32, 512, 64, 40
    QKV = (H + 2 * Hkv) * D
    r = np.random.default_rng(9)

    def weight(rows: int, cols: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        raw = np.ascontiguousarray(random_rows(name, rows, cols, r))
        return raw, dequantize(raw, G[name]).reshape(rows, cols).astype(np.float32)

    (wqkv, wqkv_f), (wo, wo_f) = weight(QKV, E, "Q4_K"), weight(E, H * D, "Q8_0")
    (wgu, wgu_f), (wd, wd_f) = weight(2 * F, E, "Q4_K"), weight(E, F, "Q6_K")
    n1, n2 = (1 + 0.1 * r.standard_normal(E)).astype(np.float32), (1 + 0.1 * r.standard_normal(E)).astype(np.float32)
    x = r.standard_normal((1, E)).astype(np.float32)
    kc0 = (r.standard_normal((N, Hkv * D)) * 0.5).astype(np.float16)
    vc0 = r.standard_normal((N, Hkv * D)).astype(np.float16)
    eps, base = 1e-5, 10000.0

    # numpy: the reference ops, in float32
    def ref_op(node: Tensor, *vals: np.ndarray) -> np.ndarray:
        return np.asarray(reference(node, list(vals)))

    tx = t("x", (1, E))
    h = ref_op(ops.mul(tx, t("w", (E,))), ref_op(ops.rms_norm(tx, eps), x), n1)
    qkv = h @ wqkv_f.T
    q3, k3 = qkv[:, : H * D].reshape(1, H, D), qkv[:, H * D : (H + Hkv) * D].reshape(1, Hkv, D)
    rp = {"n_dims": D, "freq_base": base}
    q3 = ref_op(ops.rope(t("q", (1, H, D)), t("p", (1,), G.I32), **rp), q3, np.array([n_past], np.int32))
    k3 = ref_op(ops.rope(t("k", (1, Hkv, D)), t("p", (1,), G.I32), **rp), k3, np.array([n_past], np.int32))
    kc, vc = kc0.copy(), vc0.copy()
    kc[n_past], vc[n_past] = k3.reshape(-1), qkv[0, (H + Hkv) * D :]
    att = ref_op(ops.flash_attn_ext(t("q", (1, H, D)), Tensor("k", (N, Hkv, D), G.F16), Tensor("v", (N, Hkv, D), G.F16),
                                    t("m", (1, N))),
                 q3, kc.reshape(N, Hkv, D), vc.reshape(N, Hkv, D), np.zeros((1, n_past + 1), np.float32))  # fmt: skip
    x1 = x + att.reshape(1, -1) @ wo_f.T
    h2 = ref_op(ops.mul(tx, t("w", (E,))), ref_op(ops.rms_norm(tx, eps), x1), n2)
    gu = h2 @ wgu_f.T
    g = ref_op(ops.swiglu(t("g", (1, F)), t("u", (1, F))), gu[:, :F], gu[:, F:])
    want = x1 + g @ wd_f.T

    # the kernels
    dv = {n: env.d(a) for n, a in dict(wqkv=wqkv, wo=wo, wgu=wgu, wd=wd, n1=n1, n2=n2, x=x, kc=kc0, vc=vc0).items()}
    pos, cell, n_kv = env.d(np.array([n_past], np.int32)), env.d(np.array([n_past], np.int64)), env.d(np.array([n_past + 1], np.int32))
    mask = env.d(np.zeros((1, N), np.float32))
    bufs = {n: env.full(shape, np.nan, np.float32) for n, shape in
            dict(h=(1, E), qkv=(1, QKV), q=(1, H, D), att=(1, H * D), o=(1, E), x1=(1, E), h2=(1, E), g=(1, F),
                 d=(1, E), out=(1, E)).items()}  # fmt: skip
    s = fattn_splits(1, Hkv, N, env.k.n_sm)
    scratch = env.zeros(max(1, fattn_scratch_floats(1, H, D, s)), np.float32)
    P = {n: env.p(a) for n, a in {**dv, **bufs}.items()}

    def layer(st: Any) -> None:
        k = env.k
        k.rms_norm(st, P["x"], E, P["h"], E, 1, E, eps, w=P["n1"])
        k.mul_mat_vec(st, G.Q4_K, P["wqkv"], wqkv.shape[1], QKV, E, P["h"], P["qkv"], 1)
        k.rope_qkv(st, P["qkv"], P["qkv"] + 4 * H * D, P["qkv"] + 4 * (H + Hkv) * D, QKV, P["q"], H * D, 1, H, Hkv, D,
                   D, pos=env.p(pos), n_dims=D, mode=0, freq_base=base, ids=env.p(cell), n_cells=N, k_type=G.F16,
                   k_cache=P["kc"], k_rb=Hkv * D * 2, v_type=G.F16, v_cache=P["vc"], v_rb=Hkv * D * 2)  # fmt: skip
        k.flash_attn_ext(st, P["q"], H * D, D, G.F16, P["kc"], Hkv * D * 2, D * 2, G.F16, P["vc"], Hkv * D * 2, D * 2, N,
                         env.p(mask), N, P["att"], H * D, D, 1, H, Hkv, D, D, 1.0 / np.sqrt(D), n_kv_dev=env.p(n_kv),
                         n_splits=s, scratch=env.p(scratch))  # fmt: skip
        k.mul_mat_vec(st, G.Q8_0, P["wo"], wo.shape[1], E, H * D, P["att"], P["o"], 1)
        k.rms_norm(st, P["x"], E, P["h2"], E, 1, E, eps, b=P["o"], sb=E, sum_out=P["x1"], ss=E, w=P["n2"])
        k.mul_mat_vec_glu(st, "swiglu", G.Q4_K, P["wgu"], wgu.shape[1], F, E, P["h2"], P["g"], 1)
        k.mul_mat_vec(st, G.Q6_K, P["wd"], wd.shape[1], E, F, P["g"], P["d"], 1)
        k.binary(st, "add", P["x1"], E, P["d"], E, P["out"], E, 1, E)

    env.run(layer)
    # float32 sums of 256-512 terms in other orders than numpy's BLAS (whose order is the host's:
    # an AVX2-only Zen 2 sums otherwise than an AVX-512 host): an output that cancels to ~1e-3 of
    # the largest keeps their rounding, ~1e-7 of the largest — hence the absolute term
    for got, ref in ((env.get(bufs["x1"]), x1), (env.get(bufs["out"]), want)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=max(1e-4, 1e-6 * float(np.abs(ref).max())))
    got_k = env.get(dv["kc"])
    assert np.array_equal(np.delete(got_k, n_past, 0), np.delete(kc0, n_past, 0))  # one cell written
    np.testing.assert_allclose(got_k[n_past].astype(np.float32), kc[n_past].astype(np.float32), rtol=2e-3, atol=1e-3)


# --- gpt-oss's ops: YaRN rope, attention sinks, swiglu_oai, ADD_ID ------------------------------

# gpt-oss's: original context 4096, factor 32 (freq_scale 1/32), attn_factor as llama.cpp sets it
_YARN = (4096.0, 1.0, float(np.float32(1.0 / (1.0 + 0.1 * np.log(32.0)))), 32.0, 1.0)


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("ext", [1.0, 0.0], ids=["ramp", "no-ramp"])
def test_rope_yarn(env: Env, mode: int, ext: float) -> None:
    """YaRN (rope.cu's ramp between the correction dims and the cos/sin factor), alone and with
    the K store (rope_qkv's blocks are the same code): the reference's angles."""
    from llamapy.backend.kernels import yarn_table

    T, H, D, n_dims, base, fs = 5, 3, 64, 64, 150000.0, 1.0 / 32
    yarn = (_YARN[0], ext, *_YARN[2:])
    xa = randn(T, H, D)
    x, pos = t("x", (T, H, D)), t("pos", (T,), G.I32)
    ref = reference(ops.rope(x, pos, n_dims, base, fs, None, mode=mode, yarn=yarn), [xa, POS[:T]])
    xd, posd, yd = env.d(xa), env.d(POS), env.d(yarn_table(n_dims, base, fs, yarn))
    y = env.full((T, H, D), np.nan, np.float32)
    env.run(lambda st: env.k.rope(st, env.p(xd), H * D, D, env.p(y), H * D, D, T, H, D, pos=env.p(posd), n_dims=n_dims,
                                  mode=mode, freq_base=base, freq_scale=fs, yarn=env.p(yd)))  # fmt: skip
    got = env.get(y)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert np.mean(got == ref) > 0.95, f"only {np.mean(got == ref):.4f} of the values are the reference's bits"
    # Q, K and V of one product in one launch (rope_qkv): Q and K with the same YaRN angles
    qkv = randn(T, 3 * H * D)
    qd, qo = env.d(qkv), env.full((T, H * D), np.nan, np.float32)
    ids = env.d(np.arange(T, dtype=np.int64))
    kc, vc = env.zeros((T, H * D), np.float32), env.zeros((T, H * D), np.float32)
    env.run(lambda st: env.k.rope_qkv(
        st, env.p(qd), env.p(qd) + 4 * H * D, env.p(qd) + 8 * H * D, 3 * H * D, env.p(qo), H * D, T, H, H, D, D,
        pos=env.p(posd), n_dims=n_dims, mode=mode, freq_base=base, freq_scale=fs, ids=env.p(ids), n_cells=T,
        k_type=G.F32, k_cache=env.p(kc), k_rb=4 * H * D, v_type=G.F32, v_cache=env.p(vc), v_rb=4 * H * D,
        yarn=env.p(yd)))  # fmt: skip
    for part, out in ((0, qo), (1, kc)):
        r = reference(ops.rope(x, pos, n_dims, base, fs, None, mode=mode, yarn=yarn),
                      [np.ascontiguousarray(qkv[:, part * H * D:(part + 1) * H * D]).reshape(T, H, D), POS[:T]])
        np.testing.assert_allclose(env.get(out).reshape(T, H, D), r, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(env.get(vc), qkv[:, 2 * H * D:])


@pytest.mark.parametrize("split", ["one", "split", "prompt"])
@pytest.mark.parametrize("kt", [G.F16, G.Q8_0])
def test_flash_attn_ext_sinks(env: Env, split: str, kt: G) -> None:
    """gpt-oss's sinks: one logit a query head in each softmax's maximum and denominator, once
    whether the cells are split or not, and in the prompt kernel (20 query rows: fattn_tile_*);
    large sinks (most of the mass) and small ones, GQA, a masked-off tile (a sliding window's past)."""
    T, H, Hkv, D, N, n_kv = (20 if split == "prompt" else 2), 8, 2, 64, 256, 200
    q, kf, vf = randn(T, H, D), randn(N, Hkv, D), randn(N, Hkv, D)
    kv_k, kv_v = _cache_values(kf, kt, 0), _cache_values(vf, kt, 0)
    mask = np.zeros((T, n_kv), np.float32)
    mask[:, :70] = -np.inf  # the window's past: whole tiles hidden
    sinks = np.array([-3.0, 0.0, 2.0, 8.0, 30.0, -30.0, 1.5, 4.0], np.float32)
    tk, tv = Tensor("k", (N, Hkv, D), kt), Tensor("v", (N, Hkv, D), kt)
    node = ops.flash_attn_ext(t("q", (T, H, D)), tk, tv, t("m", (T, N)), sinks=t("s", (H,)))
    ref = np.asarray(reference(node, [q, kv_k, kv_v, mask, sinks]))
    no_sinks = np.asarray(reference(ops.flash_attn_ext(t("q", (T, H, D)), tk, tv, t("m", (T, N))), [q, kv_k, kv_v, mask]))
    assert np.abs(ref - no_sinks).max() > 0.1  # (the sinks matter in this case)
    s = fattn_splits(T, Hkv, N, env.k.n_sm) if split == "split" else 1
    assert (s > 1) == (split == "split")
    scratch = env.zeros(max(1, fattn_scratch_floats(T, H, D, s)), np.float32)
    qd, kd, vd, md, sd = env.d(q), env.d(kv_k), env.d(kv_v), env.d(mask), env.d(sinks)
    out = env.full((T, H, D), np.nan, np.float32)
    env.run(lambda st: env.k.flash_attn_ext(
        st, env.p(qd), H * D, D, kt, env.p(kd), kv_k.strides[0], kv_k.strides[1], kt, env.p(vd), kv_v.strides[0],
        kv_v.strides[1], N, env.p(md), 0, env.p(out), H * D, D, T, H, Hkv, D, D, node.params["scale"], n_kv=n_kv,
        n_splits=s, scratch=env.p(scratch), sinks=env.p(sd)))  # fmt: skip
    np.testing.assert_allclose(env.get(out), ref, rtol=1e-4, atol=2e-6)


def test_swiglu_oai(env: Env) -> None:
    """glu.cu's clamped SwiGLU (gpt-oss's alpha 1.702, limit 7) against kernels.glu: values past
    the limit on both sides, strided gate and up."""
    T, F = 4, 300
    gu = randn(T, 2 * F) * 6
    gu[0, :6] = [-100.0, 100.0, 7.0, -7.0, 7.5, -7.5]
    gu[0, F:F + 6] = [-100.0, 100.0, 7.0, -7.0, 7.5, -7.5]
    gu[1, [0, F + 1]] = np.nan  # NaN through either clamp stays NaN (ggml's std::min / std::clamp)
    g, u = t("g", (T, F)), t("u", (T, F))
    node = ops.glu(g, u, "swiglu_oai", alpha=1.702, limit=7.0)
    ref = reference(node, [np.ascontiguousarray(gu[:, :F]), np.ascontiguousarray(gu[:, F:])])
    gud = env.d(gu)
    y = env.full((T, F), np.nan, np.float32)
    env.run(lambda st: env.k.glu(st, "swiglu_oai", env.p(gud), 2 * F, env.p(gud) + 4 * F, 2 * F, env.p(y), F, T, F,
                                 alpha=1.702, limit=7.0))  # fmt: skip
    assert np.isnan(ref[1, :2]).all()
    np.testing.assert_allclose(env.get(y), ref, rtol=1e-6, atol=1e-37)  # expf within 2 ulp of numpy's


def test_add_id(env: Env) -> None:
    """moe.cu's ADD_ID: each (token, slot)'s expert bias row by its id (strided ids and input),
    in place; an id out of range gives NaN."""
    T, U, M, E = 3, 2, 40, 5
    a = randn(T * U, M + 8)
    b = randn(E, M)
    ids = np.array([[3, 1, 9], [0, 4, 9], [4, 3, 9]], np.int32)  # column 2: padding (a strided id row)
    node = ops.add_id(t("a", (T, U, M)), t("b", (E, M)), t("i", (T, U), G.I32))
    ref = reference(node, [np.ascontiguousarray(a[:, :M]).reshape(T, U, M), b, np.ascontiguousarray(ids[:, :U])])
    ad, bd, idd = env.d(a), env.d(b), env.d(ids)
    y = env.full((T * U, M), np.nan, np.float32)
    env.run(lambda st: env.k.add_id(st, env.p(ad), M + 8, env.p(bd), M, E, env.p(idd), 3, env.p(y), M, T * U, M, U))
    np.testing.assert_array_equal(env.get(y), ref.reshape(T * U, M))
    ids[1, 1] = 5  # out of range
    idd = env.d(ids)
    env.run(lambda st: env.k.add_id(st, env.p(ad), M + 8, env.p(bd), M, E, env.p(idd), 3, env.p(ad), M + 8, T * U, M, U))
    got = env.get(ad)[:, :M]
    assert np.all(np.isnan(got[3])) and np.array_equal(np.delete(got, 3, 0), np.delete(ref.reshape(T * U, M), 3, 0))


def test_router_topk(env: Env) -> None:
    """gpt-oss's router in one launch (router_topk_f32): the bits of ARGSORT of the logits, the
    batched GET_ROWS of the chosen ones and their SOFT_MAX (each against its reference), with a
    tie; the weights written over the logits (one token: the allocator's reuse)."""
    T, E, U = 3, 32, 4
    la = randn(T, E + 3) * 2
    la[1, 5] = la[1, 20] = la[1].max() + 1  # a tie in the top k: the lower index first
    lv = np.ascontiguousarray(la[:, :E])
    srt = ops.argsort_top_k(t("logits", (T, E)), E)
    ids_ref = reference(srt.src[0] if srt.op.name == "VIEW" else srt, [lv])
    chosen = reference(ops.get_rows(t("p3", (T, E, 1)), t("sel", (T, U), G.I32)),
                       [lv.reshape(T, E, 1), np.ascontiguousarray(ids_ref[:, :U])]).reshape(T, U)
    w_ref = reference(ops.soft_max(t("w", (T, U))), [chosen])
    ld = env.d(la)
    sd, wd = env.zeros((T, E), np.int32), env.full((T, U), np.nan, np.float32)
    env.run(lambda st: env.k.router_topk(st, env.p(ld), E + 3, env.p(sd), env.p(wd), T, E, U, 1.0))
    np.testing.assert_array_equal(env.get(sd), ids_ref)
    # the three launches: the same bits
    cd, sep = env.full((T, U, 1), np.nan, np.float32), env.full((T, U), np.nan, np.float32)

    def three(st: Any) -> None:
        env.k.argsort(st, env.p(ld), E + 3, env.p(sd), E, T, E)
        env.k.get_rows_batched(st, env.p(ld), E + 3, 1, E, env.p(sd), E, env.p(cd), T, U, 1)
        env.k.soft_max(st, env.p(cd), U, env.p(sep), U, T, U, 1.0)

    env.run(three)
    assert np.array_equal(env.get(wd).view(np.uint32), env.get(sep).view(np.uint32))
    assert max_ulp(env.get(wd), w_ref) <= 8, "softmax of the chosen logits"
    one = env.d(np.ascontiguousarray(la[:1, :E]))  # one token: weights over its own logits
    env.run(lambda st: env.k.router_topk(st, env.p(one), E, env.p(sd), env.p(one), 1, E, U, 1.0))
    assert np.array_equal(env.get(one)[0, :U].view(np.uint32), env.get(sep)[0].view(np.uint32))
