"""The C per-token ops (kernels_c/ops.c: lp_rms_norm, lp_rope, lp_attend[_f16], lp_swiglu) against
the numpy reference kernels of kernels.py."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from tests_support import wait_child

from llamapy.backend import kernels as K

try:
    from llamapy.backend import native
except ImportError as e:  # pragma: no cover - the loader is part of the package
    native, _import_error = None, str(e)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# lp_attend_f16 has lp_attend's arguments (k and v are f16 bits)
_ATTEND = [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, ctypes.c_float, _P,
           ctypes.c_int]


@pytest.fixture(scope="module", params=["avx512", "avx2", "portable"])
def lib(request: pytest.FixtureRequest):
    """Each SIMD variant the install built."""
    if native is None:
        pytest.skip(f"llamapy.backend.native cannot be imported: {_import_error}")
    try:  # tests/unit may or may not be a package
        from .test_native_quants import load_variant
    except ImportError:
        from test_native_quants import load_variant  # type: ignore[no-redef]

    return load_variant(request.param)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _node(**params):
    return SimpleNamespace(params=params)


# ---------------------------------------------------------------------------------------------


def c_rms_norm(lib, x: np.ndarray, eps: float) -> np.ndarray:
    rows, n = x.shape
    assert x.dtype == np.float32 and x.strides[1] == 4
    out = np.empty((rows, n), np.float32)
    lib.lp_rms_norm(_ptr(x), rows, n, x.strides[0] // 4, eps, _ptr(out))
    return out


@pytest.mark.parametrize("n", [1, 7, 64, 576, 2053])
def test_rms_norm(lib, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((5, n)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    ref = K.rms_norm(_node(eps=1e-5), [x], np)
    np.testing.assert_allclose(c_rms_norm(lib, x, 1e-5), ref, rtol=1e-6, atol=0)
    # a row view with a larger stride (the first n columns of a wider array)
    wide = np.concatenate([x, rng.standard_normal((5, 3)).astype(np.float32)], axis=1)
    np.testing.assert_allclose(c_rms_norm(lib, wide[:, :n], 1e-5), ref, rtol=1e-6, atol=0)


def test_rms_norm_zero_and_nonfinite(lib):
    x = np.zeros((3, 16), np.float32)
    x[1, 3] = np.inf
    x[2, 5] = np.nan
    out = c_rms_norm(lib, x, 1e-6)
    assert (out[0] == 0).all()
    assert np.isnan(out[1, 3]) and (out[1, np.arange(16) != 3] == 0).all()  # inf * 0 scale
    assert np.isnan(out[2]).all()


# ---------------------------------------------------------------------------------------------


def c_rope(lib, x, pos, rc, n_dims, neox):
    T, H, D = x.shape
    assert x.flags.c_contiguous and pos.dtype == np.int32 and rc.dtype == np.float32
    out = np.empty_like(x)
    lib.lp_rope(_ptr(x), T, H, D, _ptr(pos), _ptr(rc), n_dims, int(neox), _ptr(out))
    return out


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("D,n_dims", [(64, 64), (128, 128), (80, 32), (64, 48)])
def test_rope(lib, mode, D, n_dims):
    rng = np.random.default_rng(D + n_dims + mode)
    T, H = 5, 3
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.array([0, 1, 17, 4095, 131000], np.int32)
    factors = rng.uniform(1, 8, n_dims // 2).astype(np.float32) if D == 128 else None
    node = _node(n_dims=n_dims, freq_base=500000.0, freq_scale=0.25, mode=mode)
    srcs = [x, pos] + ([factors] if factors is not None else [])
    ref = K.rope(node, srcs, np)
    out = c_rope(lib, x, pos, K.rope_consts(n_dims, 500000.0, 0.25, factors), n_dims, mode == 2)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out[..., n_dims:], x[..., n_dims:])


# ---------------------------------------------------------------------------------------------


def c_attend(lib, q, k, v, mask, scale, n_threads=1):
    """q (T, H, D) f32; k/v (N, Hkv, D/Dv) f32 or f16 views with unit inner stride; mask (T, N) f32."""
    T, H, D = q.shape
    N, Hkv, _ = k.shape
    Dv = v.shape[2]
    assert q.flags.c_contiguous and q.dtype == np.float32 and mask.dtype == np.float32
    assert k.dtype == v.dtype and k.strides[2] == v.strides[2] == k.itemsize and mask.strides[1] == 4
    es = k.itemsize
    out = np.empty((T, H, Dv), np.float32)
    if k.dtype == np.float16:
        fn = getattr(lib, "lp_attend_f16", None)
        if fn is None:
            pytest.skip("this build has no lp_attend_f16")
        if fn.argtypes is None:  # not (yet) declared by native.SIGNATURES
            fn.argtypes, fn.restype = _ATTEND, None
    else:
        fn = lib.lp_attend
    fn(_ptr(q), T, H, D, _ptr(k), _ptr(v), N, Hkv, Dv, k.strides[0] // es, k.strides[1] // es,
       v.strides[0] // es, v.strides[1] // es, _ptr(mask), mask.strides[0] // 4, scale, _ptr(out),
       n_threads)  # fmt: skip
    return out


def _mask(rng, T, N, full_row):
    m = np.zeros((T, N), np.float32)
    m[rng.random((T, N)) < 0.3] = -np.inf
    m[:, -1] = 0.0  # every row sees at least one cell...
    m[rng.random((T, N)) < 0.2] = -0.5  # ...and some cells carry a finite bias
    if full_row:
        m[full_row] = -np.inf  # ...except this one
    return m


def _check_attend(lib, T, N, Hkv, g, D, dtype, layout, seed, n_threads=1):
    rng = np.random.default_rng(seed)
    H = Hkv * g
    n_ctx = N + 5
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    if layout == "cache":  # (n_ctx, Hkv*D) cache rows sliced to N: what the graph's view gives
        kc = rng.standard_normal((n_ctx, Hkv * D)).astype(dtype)
        vc = (rng.standard_normal((n_ctx, Hkv * D)) * 3).astype(dtype)
        k, v = kc[:N].reshape(N, Hkv, D), vc[:N].reshape(N, Hkv, D)
    else:  # padded rows and heads: row stride > Hkv*D, head stride > D
        kc = rng.standard_normal((n_ctx, Hkv, D + 8)).astype(dtype)
        vc = (rng.standard_normal((n_ctx, Hkv + 1, D + 3)) * 3).astype(dtype)
        k, v = kc[2 : N + 2, :, :D], vc[1 : N + 1, 1:, 3:]
    full_row = 1 if T > 1 else None
    mask = _mask(rng, T, N, full_row)
    scale = 1.0 / np.sqrt(D)
    out = c_attend(lib, q, k, v, mask, scale, n_threads)
    if n_threads > 1:
        np.testing.assert_array_equal(out, c_attend(lib, q, k, v, mask, scale))
    with np.errstate(invalid="ignore"):  # the fully masked row
        ref = K._attend(q, k, v, mask, scale, np)
    if full_row is not None:  # numpy gives nan for a row with no visible cell; the C kernel zeros
        assert (out[full_row] == 0).all()
        ref[full_row] = 0.0
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * float(np.abs(v.astype(np.float32)).max()))


@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("N", [1, 7, 300])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attend(lib, T, N, g, dtype):
    layout = "cache" if (N + g) % 2 else "padded"
    _check_attend(lib, T, N, 3, g, 64, dtype, layout, seed=T * 1000 + N * 10 + g)


@pytest.mark.parametrize(
    "D,Hkv,g,N", [(128, 2, 4, 300), (128, 8, 1, 129), (80, 1, 3, 65), (40, 2, 2, 2100), (20, 2, 2, 100)]
)
def test_attend_shapes(lib, D, Hkv, g, N):
    for dtype in (np.float32, np.float16):
        _check_attend(lib, 2, N, Hkv, g, D, dtype, "padded", seed=D + N)
        _check_attend(lib, 1, N, Hkv, g, D, dtype, "cache", seed=D + N + 1)


@pytest.mark.parametrize("T", [8, 12, 40])
def test_attend_causal_tokens(lib, T):
    """Several queries at the end of the cache: causal mask rows (one unit, several units)."""
    rng = np.random.default_rng(8)
    Hkv, g, D, N = 3, 3, 64, 200
    q = rng.standard_normal((T, Hkv * g, D)).astype(np.float32)
    k = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    mask = np.where(np.arange(N)[None, :] <= np.arange(N - T, N)[:, None], 0.0, -np.inf).astype(np.float32)
    np.testing.assert_allclose(c_attend(lib, q, k, v, mask, 0.125), K._attend(q, k, v, mask, 0.125, np), atol=1e-5)


def test_attend_batch_of_sequences_equals_each_row_alone(lib):
    """A server step: decode tokens of 3 sequences whose cells interleave, then a prompt chunk of
    a 4th (causal): every row is its own single-token result bit for bit, and the result over its
    sequence's cells alone, contiguous (what a request alone computes)."""
    rng = np.random.default_rng(15)
    Hkv, g, D, N = 3, 3, 64, 256
    owner = rng.integers(0, 4, N)  # the sequence of each cell
    pos = np.zeros(N, np.int64)
    for sq in range(4):
        pos[owner == sq] = np.arange((owner == sq).sum())
    rows = [(0, pos[owner == 0].max()), (1, pos[owner == 1].max()), (2, pos[owner == 2].max())]
    rows += [(3, p) for p in range(pos[owner == 3].max() - 9, pos[owner == 3].max() + 1)]
    T = len(rows)
    mask = np.full((T, N), -np.inf, np.float32)
    for t, (sq, p) in enumerate(rows):
        mask[t, (owner == sq) & (pos <= p)] = 0.0
    q = rng.standard_normal((T, Hkv * g, D)).astype(np.float32)
    k = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    out = c_attend(lib, q, k, v, mask, 0.125)
    for t, (sq, _) in enumerate(rows):
        np.testing.assert_array_equal(out[t], c_attend(lib, q[t : t + 1], k, v, mask[t : t + 1], 0.125)[0])
        # the same row over its sequence's cells alone, contiguous (whole groups of 8 cells
        # against the interleaved cache's sparse ones): the same bits
        mine = owner == sq
        alone = c_attend(lib, q[t : t + 1], np.ascontiguousarray(k[mine]), np.ascontiguousarray(v[mine]),
                         np.ascontiguousarray(mask[t : t + 1, mine]), 0.125)  # fmt: skip
        np.testing.assert_array_equal(out[t], alone[0])
    np.testing.assert_allclose(out, K._attend(q, k, v, mask, 0.125, np), rtol=0, atol=1e-5)


def test_attend_large_scores(lib):
    """Scores far apart (a running max that keeps growing, cells that underflow to 0)."""
    rng = np.random.default_rng(5)
    T, H, Hkv, D, N = 2, 4, 2, 64, 500
    q = (rng.standard_normal((T, H, D)) * 4).astype(np.float32)
    k = (rng.standard_normal((N, Hkv, D)) * np.linspace(0.1, 4, N)[:, None, None]).astype(np.float32)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    mask = np.zeros((T, N), np.float32)
    mask[1, 250:] = -np.inf
    out = c_attend(lib, q, k, v, mask, 0.125)
    ref = K._attend(q, k, v, mask, 0.125, np)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)


def test_attend_nan_propagates(lib):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    q[0, 1, 3] = np.nan  # every score of head 1 is nan
    k = rng.standard_normal((90, 2, 64)).astype(np.float32)
    v = rng.standard_normal((90, 2, 64)).astype(np.float32)
    k[70, 1, 5] = np.nan  # one cell of KV head 1 (heads 2 and 3)...
    mask = np.zeros((1, 90), np.float32)
    out = c_attend(lib, q, k, v, mask, 0.125)
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1:]).all()
    mask[0, 70] = -np.inf  # ...not read once masked
    out = c_attend(lib, q, k, v, mask, 0.125)
    assert np.isfinite(out[0, [0, 2, 3]]).all() and np.isnan(out[0, 1]).all()
    k[70, 1, 5] = 0.0  # (numpy's scores have nan + -inf = nan there)
    np.testing.assert_allclose(out[0, 2:], K._attend(q, k, v, mask, 0.125, np)[0, 2:], rtol=0, atol=1e-5)


def test_attend_f16_rounding(lib):
    """Over an f16 cache Q stays f32 (llama.cpp's tiled path; values that f16 would round: ties,
    subnormals), as in the reference; f16 cache subnormals and zeros."""
    rng = np.random.default_rng(7)
    T, H, Hkv, D, N = 2, 6, 2, 64, 70
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    q[0, 0, :8] = [1 + 2**-11, 1 + 3 * 2**-11, 3e-6, -3e-7, 6.1e-5, 2**-24 * 1.5, 65504.0 / 1e3, 0.0]
    k = rng.standard_normal((N, Hkv, D)).astype(np.float16)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float16)
    k[::3, :, ::5] = np.float16(3e-6)  # subnormal
    v[1::4, :, 1::7] = np.float16(-5e-7)
    out = c_attend(lib, q, k, v, np.zeros((T, N), np.float32), 0.125)
    np.testing.assert_allclose(out, K._attend(q, k, v, np.zeros((T, N), np.float32), 0.125, np), rtol=0, atol=1e-5)


def test_attend_threads(lib):
    """Work units of (KV head, query block) shared out among threads: the output is the one-thread
    output bit for bit (no cell ranges merged), whatever the count, and the reference's."""
    for n in (2, 3, 4):  # more threads than this machine may have: the sharing is what is tested
        for dt in (np.float32, np.float16):
            _check_attend(lib, 2, 3000, 1, 4, 64, dt, "padded", seed=11, n_threads=n)
            _check_attend(lib, 1, 5000, 2, 3, 64, dt, "cache", seed=12, n_threads=n)
            _check_attend(lib, 37, 777, 3, 3, 64, dt, "cache", seed=13, n_threads=n)
    # rows that see only the first or the last cells: units with nothing visible in most blocks
    rng = np.random.default_rng(14)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    k = rng.standard_normal((3000, 2, 64)).astype(np.float32)
    v = rng.standard_normal((3000, 2, 64)).astype(np.float32)
    mask = np.full((2, 3000), -np.inf, np.float32)
    mask[0, :100] = 0.0
    mask[1, -100:] = 0.0
    ref = K._attend(q, k, v, mask, 0.125, np)
    for n in (1, 2, 3):
        np.testing.assert_allclose(c_attend(lib, q, k, v, mask, 0.125, n), ref, rtol=0, atol=1e-5)


def test_attend_threads_after_fork(lib):
    """A fork child of a process that ran threaded attention must not hang in libgomp: there the
    kernel stays on the calling thread (same output: the thread count changes nothing)."""
    import os

    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    rng = np.random.default_rng(15)
    q = rng.standard_normal((64, 6, 64)).astype(np.float32)
    k = rng.standard_normal((600, 2, 64)).astype(np.float32)
    v = rng.standard_normal((600, 2, 64)).astype(np.float32)
    mask = _causal(64, 600, 536)
    ref = c_attend(lib, q, k, v, mask, 0.125, 2)  # enough work for threads: the team starts here
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os._exit(0 if np.array_equal(c_attend(lib, q, k, v, mask, 0.125, 2), ref) else 1)
        finally:
            os._exit(2)
    wait_child(pid, "threaded attention")


def _causal(T, N, p0):
    """Tokens at positions p0..p0+T-1 seeing cells 0..their position."""
    return np.where(np.arange(N)[None, :] <= np.arange(p0, p0 + T)[:, None], 0.0, -np.inf).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attend_prompt(lib, dtype):
    """A prompt-sized batch (causal, two sequences side by side, GQA) against the reference."""
    rng = np.random.default_rng(21)
    T, Hkv, g, D, N = 300, 3, 3, 64, 320
    q = rng.standard_normal((T, Hkv * g, D)).astype(np.float32)
    k = rng.standard_normal((N, Hkv, D)).astype(dtype)
    v = rng.standard_normal((N, Hkv, D)).astype(dtype)
    mask = np.full((T, N), -np.inf, np.float32)
    mask[:200, :200] = _causal(200, 200, 0)  # sequence 0: cells 0..199
    mask[200:, 200:] = _causal(100, 120, 20)  # sequence 1: cells 200..319, 20 of them cached before
    ref = K._attend(q, k, v, mask, 0.125, np)
    out = c_attend(lib, q, k, v, mask, 0.125, 2)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("N", [203, 777])  # 777: several chunks of 256 visible cells
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attend_query_independent_of_batch(lib, dtype, N):
    """A query's output is bit for bit the same alone, inside a batch (other rows of its sequence,
    another sequence's tokens), over more cells (masked padding, whatever they hold: 63 cells,
    so that its last cells no longer end a 64-cell block or a group of 8) and on any thread
    count (whole units per thread, or chunks of cells per thread): masked cells contribute
    exactly nothing and visible cells are summed in cell order, chunk after chunk."""
    rng = np.random.default_rng(22)
    Hkv, g, D = 2, 3, 72  # D % 8 != 0: the tail of the dot products too
    q = rng.standard_normal((40, Hkv * g, D)).astype(np.float32)
    k = rng.standard_normal((N + 63, Hkv, D)).astype(dtype)
    v = rng.standard_normal((N + 63, Hkv, D)).astype(dtype)
    mask = _causal(40, N, N - 40)
    mask[5, 150:180] = -np.inf  # a hole in one row
    mask[7, :] = -0.25  # a finite bias everywhere
    batch = c_attend(lib, q, k[:N], v[:N], mask, 0.125, 1)
    padded = np.full((40, N + 63), -np.inf, np.float32)
    padded[:, :N] = mask
    other = np.full((20, N + 63), -np.inf, np.float32)  # another sequence's tokens in the padding
    other[:, N:] = 0.0
    both = np.concatenate([padded, other])
    q2 = np.concatenate([q, rng.standard_normal((20, Hkv * g, D)).astype(np.float32)])
    for n in (1, 2, 3):
        np.testing.assert_array_equal(c_attend(lib, q, k, v, padded, 0.125, n), batch)
        np.testing.assert_array_equal(c_attend(lib, q2, k, v, both, 0.125, n)[:40], batch)
    for t in (0, 5, 7, 39):  # each query alone
        alone = c_attend(lib, q[t : t + 1], k[:N], v[:N], mask[t : t + 1], 0.125, 1)
        np.testing.assert_array_equal(alone, batch[t : t + 1])
        np.testing.assert_array_equal(c_attend(lib, q[t : t + 1], k, v, padded[t : t + 1], 0.125, 2), alone)


@pytest.mark.parametrize("n", [150, 700])  # 700: three chunks of visible cells
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attend_query_independent_of_cell_placement(lib, dtype, n):
    """A sequence's queries give the same bits whether its cells are contiguous (it ran alone) or
    interleaved with other sequences' cells (slots decoding together in the unified cache): a
    row's softmax depends only on its visible cells in cell order, never on block boundaries, and
    its chunks are cut by counts of its visible cells, not by cell index."""
    rng = np.random.default_rng(23)
    Hkv, g, D, T = 3, 3, 64, 6
    q = rng.standard_normal((T, Hkv * g, D)).astype(np.float32)
    ks = (rng.standard_normal((n, Hkv, D)) * 3).astype(dtype)  # large scores: the max matters
    vs = rng.standard_normal((n, Hkv, D)).astype(dtype)

    def placed(stride: int, offset: int, threads: int) -> np.ndarray:
        N = n * stride + offset
        k = rng.standard_normal((N, Hkv, D)).astype(dtype)  # other sequences' cells
        v = rng.standard_normal((N, Hkv, D)).astype(dtype)
        mask = np.full((T, N), -np.inf, np.float32)
        cells = np.arange(n) * stride + offset
        k[cells], v[cells] = ks, vs
        for t in range(T):  # causal: query t sees the first n - T + 1 + t of its cells
            mask[t, cells[: n - T + 1 + t]] = 0.0
        return c_attend(lib, q, k, v, mask, 0.125, threads)

    alone = placed(1, 0, 1)
    for stride, offset, threads in ((4, 0, 1), (4, 3, 2), (3, 70, 1), (2, 1, 3)):
        np.testing.assert_array_equal(placed(stride, offset, threads), alone)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attend_decode_split_over_cells(lib, dtype):
    """One decode query over thousands of cells (SmolLM2's 3 KV heads: too few units for the
    threads, so its tiles' scores, then its V columns, are shared out): the same bits on 1 to 5
    threads, over extra masked padding, with holes in its cells (tiles cut by visible cells, not
    cell index), with tiles of very different maxima (the online rescaling) and next to the
    reference."""
    rng = np.random.default_rng(24)
    Hkv, g, D, N = 3, 3, 64, 2100
    q = (rng.standard_normal((1, Hkv * g, D)) * 2).astype(np.float32)
    k = rng.standard_normal((N + 300, Hkv, D)).astype(dtype)
    k[1500:1700] *= 4  # a chunk whose scores dominate: the others are rescaled when folded
    v = rng.standard_normal((N + 300, Hkv, D)).astype(dtype)
    mask = np.zeros((1, N), np.float32)
    mask[0, 300:420] = -np.inf  # a hole: later chunks start at other cells than 256-multiples
    mask[0, 1000] = -np.inf
    mask[0, 50:60] = -1.5
    ref = K._attend(q, k[:N], v[:N], mask, 0.125, np)
    one = c_attend(lib, q, k[:N], v[:N], mask, 0.125, 1)
    np.testing.assert_allclose(one, ref, rtol=0, atol=2e-5)
    padded = np.full((1, N + 300), -np.inf, np.float32)
    padded[:, :N] = mask
    for n in (2, 3, 4, 5):
        np.testing.assert_array_equal(c_attend(lib, q, k[:N], v[:N], mask, 0.125, n), one)
        np.testing.assert_array_equal(c_attend(lib, q, k, v, padded, 0.125, n), one)
    # the same cells moved up by 37 (other cells before them): the chunks follow the cells
    k2, v2 = np.roll(k, 37, axis=0), np.roll(v, 37, axis=0)
    shifted = np.full((1, N + 300), -np.inf, np.float32)
    shifted[:, 37 : N + 37] = mask
    for n in (1, 2):
        np.testing.assert_array_equal(c_attend(lib, q, k2, v2, shifted, 0.125, n), one)


# ---------------------------------------------------------------------------------------------


def c_swiglu(lib, gate, up):
    rows, n = gate.shape
    assert gate.strides[1] == up.strides[1] == 4
    out = np.empty((rows, n), np.float32)
    lib.lp_swiglu(_ptr(gate), _ptr(up), rows, n, gate.strides[0] // 4, up.strides[0] // 4, _ptr(out))
    return out


@pytest.mark.parametrize("n", [1, 13, 1536, 8195])
def test_swiglu(lib, n):
    rng = np.random.default_rng(n)
    rows = 3
    gu = (rng.standard_normal((rows, 2 * n)) * 6).astype(np.float32)  # fused gate|up columns
    gu[0, : min(n, 8)] = [-1000.0, -100.0, -88.5, -87.9, 87.9, 100.0, 1e30, -1e30][: min(n, 8)]
    gate, up = gu[:, :n], gu[:, n:]
    ref = K.glu(None, [gate, up], np)
    np.testing.assert_allclose(c_swiglu(lib, gate, up), ref, rtol=1e-6, atol=0)


def test_swiglu_nonfinite(lib):
    gate = np.array([[np.inf, -np.inf, np.nan, 0.0]], np.float32)
    up = np.array([[2.0, 2.0, 2.0, np.inf]], np.float32)
    with np.errstate(all="ignore"):
        ref = K.glu(None, [gate, up], np)
    np.testing.assert_array_equal(c_swiglu(lib, gate, up), ref)


def test_rope_angles_are_ggmls(lib):
    """The angles as ggml's rope_cache_init rounds them (theta *= powf(base, -2/n_dims) in float32
    from theta = p), not p * base^(-2i/n_dims): at p = 4095 the two differ by up to ~1e-3 rad."""
    n_dims, base, T = 64, 100000.0, 3
    pos = np.array([1, 300, 4095], np.int32)
    x = np.zeros((T, 1, n_dims), np.float32)
    x[..., 0::2] = 1.0  # pairs (1, 0): the output is (cos, sin) of each angle
    out = c_rope(lib, x, pos, K.rope_consts(n_dims, base, 1.0, None), n_dims, False)
    ts = np.float32(base ** (-2.0 / n_dims))
    theta = np.cumprod(np.concatenate([pos[:, None].astype(np.float32), np.full((T, n_dims // 2 - 1), ts, np.float32)], 1), 1)
    np.testing.assert_allclose(out[:, 0, 0::2], np.cos(theta.astype(np.float64)), rtol=0, atol=1.2e-7)
    np.testing.assert_allclose(out[:, 0, 1::2], np.sin(theta.astype(np.float64)), rtol=0, atol=1.2e-7)


def _fma(a, b, c):
    """fmaf in numpy: the exact product in float64, one rounding to float32 (exact here: the sum
    of a 48-bit product and a float32 fits in a double for these magnitudes)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _h(hexfloat):
    return np.float32(float.fromhex(hexfloat))


def _ggml_expf_avx512(x):
    """ggml's __m512 ggml_v_expf (vec.h), element by element (the arguments stay in range)."""
    r = _h("0x1.8p23")
    z = _fma(x, _h("0x1.715476p+0"), r)
    n = z - r
    b = _fma(-n, _h("0x1.7f7d1cp-20"), _fma(-n, _h("0x1.62e4p-1"), x))
    u = b * b
    j = _fma(_fma(_fma(_h("0x1.0e4020p-7"), b, _h("0x1.573e2ep-5")), u,
                  _fma(_h("0x1.555e66p-3"), b, _h("0x1.fffdb6p-2"))), u,
             _fma(_h("0x1.ffffecp-1"), b, np.float32(1.0)))
    return np.ldexp(j, n.astype(np.int32)).astype(np.float32)


def test_swiglu_is_ggmls_avx512_silu(lib, request):
    """On the AVX-512 build SiLU's exp is ggml's __m512 variant (scalef of e^b), which rounds
    differently from the AVX2 one (e^b - 1, then an fma) in ~10 % of values: equal, bit for bit."""
    if "avx512" not in request.node.callspec.id:
        pytest.skip("the AVX-512 variant's rounding")
    rng = np.random.default_rng(5)
    g = (rng.standard_normal((2, 64)) * 4).astype(np.float32)
    u = rng.standard_normal((2, 64)).astype(np.float32)
    want = g / (np.float32(1.0) + _ggml_expf_avx512(np.float32(0.0) - g)) * u
    np.testing.assert_array_equal(c_swiglu(lib, g, u), want)
