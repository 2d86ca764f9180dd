"""Every op on every available backend against one numpy reference (ggml's test-backend-ops).

The reference is `llamapy.backend.kernels.reference` on host arrays (quantized weights expanded
with gguf-py); each device computes the same node through its own buffers and copy path.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from llamapy import ops
from llamapy.backend.interface import BufferUsage, Device
from llamapy.backend.kernels import reference
from llamapy.backend.registry import discover
from llamapy.graph import Graph
from llamapy.tensor import Op, Tensor, TensorFlag


def _devices() -> list[Device]:
    import os

    os.environ.setdefault("LLAMAPY_TEST_GPU", "1")
    try:
        return discover(refresh=True).devices()
    finally:
        del os.environ["LLAMAPY_TEST_GPU"]
        # discovery is cached for the process: later test files must find this machine's devices,
        # not the TEST ones (a Llama made later would offload to TEST0)
        discover(refresh=True)


DEVICES = _devices()


def run_on(dev: Device, node: Tensor, inputs: dict[Tensor, np.ndarray]) -> np.ndarray:
    be = dev.init_backend()
    buft = dev.buffer_type()
    env = {}
    bufs = []
    for t, v in inputs.items():
        if t.flags & TensorFlag.WEIGHT:
            buf = buft.alloc_buffer(buft.alloc_size(t), BufferUsage.WEIGHTS)
            buf.alloc_tensor(t)
            buf.set(t, v)
            bufs.append(buf)
        else:
            env[t] = be.from_host(v)
    be.compute(Graph.build(node).nodes, env)
    out = np.array(be.to_host(env[node]))
    for b in bufs:
        b.free()
    for t in inputs:
        t.buffer = None
    return out


def f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _weight(name: str, rows: int, cols: int, qtype: T, rng: np.random.Generator) -> tuple[Tensor, np.ndarray, np.ndarray]:
    """(tensor, raw bytes for the buffer, f32 values for the reference)."""
    w = f32(rng, rows, cols)
    t = Tensor(name, (rows, cols), qtype, flags=TensorFlag.WEIGHT)
    if qtype is T.F32:
        return t, w.view(np.uint8), w
    raw = gguf.quants.quantize(w, qtype)
    return t, np.asarray(raw).view(np.uint8).reshape(rows, -1), gguf.quants.dequantize(raw, qtype).astype(np.float32)


def _cases() -> list[tuple[str, Callable[[np.random.Generator], tuple[Tensor, dict, dict]]]]:
    def act(name: str, arr: np.ndarray, t: T = T.F32) -> Tensor:
        return Tensor(name, arr.shape, t, flags=TensorFlag.INPUT)

    def unary(builder):  # noqa: ANN001, ANN202
        def make(rng):  # noqa: ANN001, ANN202
            x = f32(rng, 7, 64)
            a = act("a", x)
            return builder(a), {a: x}, {a: x}

        return make

    def binary(builder):  # noqa: ANN001, ANN202
        def make(rng):  # noqa: ANN001, ANN202
            x, y = f32(rng, 7, 64), f32(rng, 64)
            a, b = act("a", x), act("b", y)
            return builder(a, b), {a: x, b: y}, {a: x, b: y}

        return make

    def mul_mat(qtype: T, n_tokens: int):  # noqa: ANN202
        def make(rng):  # noqa: ANN001, ANN202
            t, raw, ref = _weight("w", 64, 64, qtype, rng)
            x = f32(rng, n_tokens, 64)
            a = act("x", x)
            return ops.mul_mat(t, a), {t: raw, a: x}, {t: ref, a: x}

        return make

    def get_rows(qtype: T):  # noqa: ANN202
        def make(rng):  # noqa: ANN001, ANN202
            t, raw, ref = _weight("emb", 50, 64, qtype, rng)
            ids = np.array([3, 0, 49, 3], np.int32)
            i = act("ids", ids, T.I32)
            return ops.get_rows(t, i), {t: raw, i: ids}, {t: ref, i: ids}

        return make

    def rope(mode: int, factors: bool):  # noqa: ANN202
        def make(rng):  # noqa: ANN001, ANN202
            x = f32(rng, 5, 4, 64)
            pos = np.array([0, 1, 7, 100, 4095], np.int32)
            a, p = act("x", x), act("pos", pos, T.I32)
            srcs = {a: x, p: pos}
            ff = None
            if factors:
                fv = (1 + rng.random(16)).astype(np.float32)
                ff = act("ff", fv)
                srcs[ff] = fv
            return ops.rope(a, p, 32, 10000.0, 1.0, ff, mode), srcs, srcs

        return make

    def attention(rng):  # noqa: ANN001, ANN202
        q, k, v = f32(rng, 6, 4, 32), f32(rng, 16, 2, 32).astype(np.float16), f32(rng, 16, 2, 32).astype(np.float16)
        mask = np.where(rng.random((6, 16)) < 0.7, 0, -np.inf).astype(np.float32)
        mask[:, 0] = 0
        tq, tk, tv, tm = act("q", q), act("k", k, T.F16), act("v", v, T.F16), act("m", mask)
        s = {tq: q, tk: k, tv: v, tm: mask}
        return ops.flash_attn_ext(tq, tk, tv, tm), s, s

    def attention_prompt(rng):  # noqa: ANN001, ANN202
        """150 queries at positions 10..159 over an f16 cache, causal (the C kernel's query blocks)."""
        q, k, v = f32(rng, 150, 4, 32), f32(rng, 160, 2, 32).astype(np.float16), f32(rng, 160, 2, 32).astype(np.float16)
        mask = np.where(np.arange(160)[None, :] <= np.arange(10, 160)[:, None], 0, -np.inf).astype(np.float32)
        tq, tk, tv, tm = act("q", q), act("k", k, T.F16), act("v", v, T.F16), act("m", mask)
        s = {tq: q, tk: k, tv: v, tm: mask}
        return ops.flash_attn_ext(tq, tk, tv, tm), s, s

    def attention_q(kt: T, vt: T, n_tokens: int, width: int = 300):  # noqa: ANN202
        """Over a quantized K and/or V cache: the values are the rows' raw blocks. With `width`
        below the cache's 300 cells, the mask's value is that narrow (the cells a micro-batch
        attends to, ops.flash_attn_ext): the reference gets K and V cut to those cells."""

        def cache(name: str, x: np.ndarray, t: T) -> tuple[Tensor, np.ndarray]:
            tt = Tensor(name, x.shape, t, flags=TensorFlag.INPUT)  # (N, Hkv, D) elements
            if t is T.F16:
                return tt, x.astype(np.float16)
            n, h, d = x.shape
            return tt, np.asarray(gguf.quants.quantize(x.reshape(n * h, d), t)).reshape(n, h, -1)

        def make(rng):  # noqa: ANN001, ANN202
            q = f32(rng, n_tokens, 4, 64)
            (tk, k), (tv, v) = cache("k", f32(rng, 300, 2, 64), kt), cache("v", f32(rng, 300, 2, 64), vt)
            mask = np.where(rng.random((n_tokens, width)) < 0.7, 0, -np.inf).astype(np.float32)
            mask[:, 0] = 0
            tq, tm = act("q", q), Tensor("m", (n_tokens, 300), flags=TensorFlag.INPUT)
            s = {tq: q, tk: k, tv: v, tm: mask}
            return ops.flash_attn_ext(tq, tk, tv, tm), s, {**s, tk: k[:width], tv: v[:width]}

        return make

    def attention_sinks(n_tokens: int, n_kv: int):  # noqa: ANN202
        """gpt-oss's sinks: one logit per query head in its softmax's denominator; causal over
        an f16 cache (a decode step, a prompt beyond one block of queries)."""

        def make(rng):  # noqa: ANN001, ANN202
            q = f32(rng, n_tokens, 4, 64)
            k, v = f32(rng, n_kv, 2, 64).astype(np.float16), f32(rng, n_kv, 2, 64).astype(np.float16)
            pos = np.arange(n_kv - n_tokens, n_kv)
            mask = np.where(np.arange(n_kv)[None, :] <= pos[:, None], 0, -np.inf).astype(np.float32)
            sk = (np.array([-1.0, 0.5, 2.0, 30.0]) + rng.standard_normal(4) * 0.1).astype(np.float32)  # 30: above every score
            tq, tk, tv, tm, ts = act("q", q), act("k", k, T.F16), act("v", v, T.F16), act("m", mask), act("sinks", sk)
            s = {tq: q, tk: k, tv: v, tm: mask, ts: sk}
            return ops.flash_attn_ext(tq, tk, tv, tm, sinks=ts), s, s

        return make

    def rope_yarn(rng):  # noqa: ANN001, ANN202
        """YaRN as gpt-oss sets it: factor 32 (freq_scale 1/32), original context 4096."""
        x = f32(rng, 5, 4, 64)
        pos = np.array([0, 1, 7, 100, 4095], np.int32)
        a, p = act("x", x), act("pos", pos, T.I32)
        node = ops.rope(a, p, 64, 150000.0, 1.0 / 32, None, 2, yarn=(4096.0, 1.0, 1.0, 32.0, 1.0))
        return node, {a: x, p: pos}, {a: x, p: pos}

    def swiglu_oai(rng):  # noqa: ANN001, ANN202
        g, u = f32(rng, 3, 5, 64) * 6, f32(rng, 3, 5, 64) * 6  # beyond the limit of 7 both ways
        a, b = act("g", g), act("u", u)
        return ops.glu(a, b, "swiglu_oai", alpha=1.702, limit=7.0), {a: g, b: u}, {a: g, b: u}

    def add_id(rng):  # noqa: ANN001, ANN202
        """Each (token, slot)'s expert bias, the biases a (6, 32) weight."""
        x, bv = f32(rng, 5, 3, 32), f32(rng, 6, 32)
        ids = np.stack([rng.permutation(6)[:3] for _ in range(5)]).astype(np.int32)
        t = Tensor("exps.bias", (6, 32), T.F32, flags=TensorFlag.WEIGHT)
        a, i = act("x", x), act("ids", ids, T.I32)
        return ops.add_id(a, t, i), {a: x, t: bv.view(np.uint8), i: ids}, {a: x, t: bv, i: ids}

    def set_rows_q(qt: T):  # noqa: ANN202
        def make(rng):  # noqa: ANN001, ANN202
            dst = np.zeros((10, 2 * 34 if qt is T.Q8_0 else 2 * 18), np.uint8)  # 10 rows of 64
            src = f32(rng, 3, 64)
            ids = np.array([7, 2, 9], np.int64)
            d = Tensor("cache", (10, 64), qt, flags=TensorFlag.INPUT)
            s_, i = act("src", src), act("idx", ids, T.I64)
            return ops.set_rows(d, i, s_), {d: dst, i: ids, s_: src}, {d: dst.copy(), i: ids, s_: src}

        return make

    def softmax(rng):  # noqa: ANN001, ANN202
        x, m = f32(rng, 5, 9), np.where(np.tri(5, 9, 4) > 0, 0, -np.inf).astype(np.float32)
        a, b = act("a", x), act("m", m)
        return ops.soft_max(a, b, 0.5), {a: x, b: m}, {a: x, b: m}

    def set_rows(rng):  # noqa: ANN001, ANN202
        dst = np.zeros((10, 64), np.float16)
        src = f32(rng, 3, 64)
        ids = np.array([7, 2, 9], np.int64)
        d, s_, i = act("cache", dst, T.F16), act("src", src), act("idx", ids, T.I64)
        node = ops.set_rows(d, i, s_)
        return node, {d: dst, i: ids, s_: src}, {d: dst.copy(), i: ids, s_: src}

    def glu(rng):  # noqa: ANN001, ANN202
        g, u = f32(rng, 7, 64) * 30, f32(rng, 7, 64)
        a, b = act("g", g), act("u", u)
        return ops.swiglu(a, b), {a: g, b: u}, {a: g, b: u}

    def geglu(rng):  # noqa: ANN001, ANN202
        g, u = f32(rng, 7, 64) * 6, f32(rng, 7, 64)  # beyond +-10 too: ggml's clamped branches
        a, b = act("g", g), act("u", u)
        return ops.glu(a, b, "geglu"), {a: g, b: u}, {a: g, b: u}

    def per_head_norm(rng):  # noqa: ANN001, ANN202
        # qwen3/gemma3's Q/K norms: RMS_NORM over the head size of (T, H, D), MUL by a (D,) weight
        x, wv = f32(rng, 5, 4, 32), f32(rng, 32)
        a, w = act("q", x), act("w", wv)
        return ops.mul(ops.rms_norm(a, 1e-6), w), {a: x, w: wv}, {a: x, w: wv}

    def experts(qtype: T, n_tokens: int, per_slot: bool):  # noqa: ANN202
        """MUL_MAT_ID: 6 experts of (32, 64), each token's 3 choices (repeats across tokens, some
        experts unchosen); x one row per token (gate / up) or one per slot (down)."""

        def make(rng):  # noqa: ANN001, ANN202
            wv = f32(rng, 6 * 32, 64)
            t = Tensor("exps", (6, 32, 64), qtype, flags=TensorFlag.WEIGHT)
            if qtype is T.F32:
                raw, ref = wv.view(np.uint8), wv
            else:
                q = gguf.quants.quantize(wv, qtype)
                raw, ref = np.asarray(q).view(np.uint8), gguf.quants.dequantize(q, qtype).astype(np.float32)
            ids = np.stack([rng.permutation(5)[:3] for _ in range(n_tokens)]).astype(np.int32)  # expert 5 unused
            x = f32(rng, n_tokens, 3 if per_slot else 1, 64)
            a, i = act("x", x), act("ids", ids, T.I32)
            return ops.mul_mat_id(t, a, i), {t: raw, a: x, i: ids}, {t: ref.reshape(6, 32, 64), a: x, i: ids}

        return make

    def router(rng):  # noqa: ANN001, ANN202
        """The router's ops on (5, 8) logits: softmax, top 3 (ARGSORT + view), GET_ROWS of the
        chosen probabilities, SUM_ROWS, CLAMP, DIV."""
        x = f32(rng, 5, 8)
        a = act("logits", x)
        probs = ops.soft_max(a)
        top = ops.argsort_top_k(probs, 3)
        w = ops.reshape(ops.get_rows(ops.reshape(probs, (5, 8, 1)), top), (5, 3))
        total = ops.clamp(ops.sum_rows(w), 0.5, float("inf"))
        return ops.div(w, total), {a: x}, {a: x}

    cases = [
        ("ARGSORT-top_k", unary(lambda a: ops.argsort_top_k(a, 5))),
        ("SUM_ROWS", unary(ops.sum_rows)),
        ("CLAMP", unary(lambda a: ops.clamp(a, -0.5, 0.25))),
        ("DIV", binary(ops.div)),
        ("router", router),
        ("RMS_NORM", unary(lambda a: ops.rms_norm(a, 1e-5))),
        ("RMS_NORM-per-head", per_head_norm),
        ("GLU-geglu", geglu),
        ("SCALE", unary(lambda a: ops.scale(a, 0.125))),
        ("CONT", unary(lambda a: ops.cont(ops.permute(a, (1, 0))))),
        ("MUL", binary(ops.mul)),
        ("ADD", binary(ops.add)),
        ("GLU", glu),
        ("SOFT_MAX", softmax),
        ("FLASH_ATTN_EXT", attention),
        ("FLASH_ATTN_EXT-prompt", attention_prompt),
        ("SET_ROWS", set_rows),
        ("SET_ROWS-Q8_0", set_rows_q(T.Q8_0)),
        ("SET_ROWS-Q4_0", set_rows_q(T.Q4_0)),
        ("FLASH_ATTN_EXT-q8_0-decode", attention_q(T.Q8_0, T.Q8_0, 1)),
        ("FLASH_ATTN_EXT-q4_0-decode", attention_q(T.Q4_0, T.Q4_0, 1)),
        ("FLASH_ATTN_EXT-f16k-q4_0v", attention_q(T.F16, T.Q4_0, 3)),
        ("FLASH_ATTN_EXT-q8_0k-f16v", attention_q(T.Q8_0, T.F16, 5)),
        ("FLASH_ATTN_EXT-q8_0-prompt", attention_q(T.Q8_0, T.Q4_0, 20)),
        ("FLASH_ATTN_EXT-f16-narrow-mask", attention_q(T.F16, T.F16, 3, 256)),
        ("FLASH_ATTN_EXT-q8_0-narrow-mask", attention_q(T.Q8_0, T.Q8_0, 150, 200)),
        ("ROPE-normal", rope(0, False)),
        ("ROPE-neox", rope(2, False)),
        ("ROPE-freq_factors", rope(0, True)),
        ("ROPE-yarn", rope_yarn),
        ("FLASH_ATTN_EXT-sinks-decode", attention_sinks(1, 40)),
        ("FLASH_ATTN_EXT-sinks-prompt", attention_sinks(150, 160)),
        ("GLU-swiglu_oai", swiglu_oai),
        ("ADD_ID", add_id),
    ]
    for q in (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        cases.append((f"GET_ROWS-{q.name}", get_rows(q)))
        for n in (1, 40):
            cases.append((f"MUL_MAT-{q.name}-n{n}", mul_mat(q, n)))
    for q in (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q8_0):
        for n in (1, 9):
            for per_slot in (False, True):
                cases.append((f"MUL_MAT_ID-{q.name}-n{n}{'-per-slot' if per_slot else ''}", experts(q, n, per_slot)))
    return cases


CASES = _cases()
# each device runs the ops it claims (BLAS claims only big MUL_MATs): unsupported pairs are not
# generated at all, so no skip hides a case
PAIRS = [
    pytest.param(dev, name, make, id=f"{name}-{dev.name}")
    for name, make in CASES
    for dev in DEVICES
    if dev.supports_op(make(np.random.default_rng(0))[0])
]


@pytest.mark.parametrize("dev,name,make", PAIRS)
def test_op(dev: Device, name: str, make) -> None:  # noqa: ANN001
    rng = np.random.default_rng(0)
    node, inputs, ref_inputs = make(rng)
    vals = dict(ref_inputs)
    for n in Graph.build(node).nodes:
        vals[n] = reference(n, [vals[s] for s in n.src])
    want = vals[node]
    got = run_on(dev, node, inputs)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    tol = 2e-5 * scale + _activation_rounding(node, ref_inputs)
    assert np.all(np.abs(got.astype(np.float32) - want) <= tol), name


def _activation_rounding(node: Tensor, ref_inputs: dict) -> np.ndarray | float:
    """What a MUL_MAT may differ by when the device quantizes its activations to the weight's
    vec_dot_type, as ggml's CPU backend (and llamapy's by default) does: half a q8 step of each
    activation's 32-block (f16 rounding for F16 weights) times |w|, and for Q4_1 / Q5_1 the f16
    rounding of the q8_1 block sums. The exact arithmetic is tested in tests/unit."""
    if node.op is Op.MUL_MAT_ID and node.src[0].type is not T.F32:
        # each (token, slot) as the MUL_MAT of its row with its expert
        w3, x3, ids = (ref_inputs[s] for s in node.src)
        out = np.empty(node.shape)
        for t in range(ids.shape[0]):
            for u in range(ids.shape[1]):
                xr = x3[t, u if x3.shape[1] > 1 else 0][None, :]
                one = Tensor("m", (1, w3.shape[1]), op=Op.MUL_MAT, src=(Tensor("w", w3.shape[1:], node.src[0].type), Tensor("x", xr.shape)))
                out[t, u] = _activation_rounding(one, {one.src[0]: w3[ids[t, u]], one.src[1]: xr})[0]
        return out
    if node.op is not Op.MUL_MAT or node.src[0].type is T.F32:
        return 0.0
    w = np.abs(np.asarray(ref_inputs[node.src[0]], np.float64))
    x = np.asarray(ref_inputs[node.src[1]], np.float64)
    if node.src[0].type is T.F16:
        step = np.abs(x) * 2.0**-10
    else:
        amax = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=2, keepdims=True)
        step = np.broadcast_to(amax / 127 * (1 + 2.0**-10), (x.shape[0], x.shape[1] // 32, 32)).reshape(x.shape)
    return 0.51 * (step @ w.T) + 2.0**-9 * (np.abs(x) @ w.T)


def test_every_op_runs_on_the_cpu_and_the_test_device() -> None:
    ran = {(p.values[0].name, p.values[1]) for p in PAIRS}
    for name, _ in CASES:
        assert ("CPU", name) in ran and ("TEST0", name) in ran


def test_blas_runs_the_products_sgemm_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """BLAS claims the MUL_MATs use_sgemm sends to tiles + sgemm: with the SIMD kernels none in the
    8-bit mode (every type has a multi-column kernel), with the portable ones (none) the big
    batches — which then run on BLAS within the same tolerance as everywhere."""
    from llamapy.backend import native

    if "portable" not in native.built():
        pytest.skip("the portable kernels are not built")
    monkeypatch.setenv("LLAMAPY_KERNELS_VARIANT", "portable")
    blas = next(d for d in DEVICES if d.name == "BLAS")
    claimed = [(name, make) for name, make in CASES if blas.supports_op(make(np.random.default_rng(0))[0])]
    assert {name for name, _ in claimed} >= {"MUL_MAT-F32-n40", "MUL_MAT-Q4_0-n40"}
    for name, make in claimed:
        test_op(blas, name, make)


def test_every_device_lists_and_passes_self_test() -> None:
    names = [d.name for d in DEVICES]
    assert "CPU" in names and names[-1] == "CPU"  # the fallback comes last
    assert "TEST0" in names
    for d in DEVICES:
        d.self_test()


def test_gptoss_ops_reference_against_float64() -> None:
    """The reference kernels of gpt-oss's ops against their definitions in float64: the sinks
    (an extra softmax column with no value: Hugging Face's eager attention), YaRN (the
    frequencies blended over the correction range, cos/sin scaled by 1 + 0.1 ln 32), the clamped
    SwiGLU and ADD_ID."""
    rng = np.random.default_rng(3)
    cases = dict(_cases())
    node, _, ins = cases["FLASH_ATTN_EXT-sinks-decode"](rng)
    q, k, v, mask, sk = (np.asarray(ins[s], np.float64) for s in node.src)
    got = reference(node, [ins[s] for s in node.src])
    for h in range(4):
        sc = np.concatenate([q[:, h] @ k[:, h // 2].T / 8 + mask, np.full((q.shape[0], 1), sk[h])], -1)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        want = (pr / pr.sum(-1, keepdims=True))[:, :-1] @ v[:, h // 2]
        np.testing.assert_allclose(got[:, h], want, rtol=0, atol=2e-6)
    node, _, ins = cases["ROPE-yarn"](rng)
    x, pos = np.asarray(ins[node.src[0]], np.float64), ins[node.src[1]]
    corr = [64 * np.log(4096 / (b * 2 * np.pi)) / (2 * np.log(150000.0)) for b in (32.0, 1.0)]
    lo, hi = max(np.floor(corr[0]), 0), min(np.ceil(corr[1]), 63)
    extrap = 150000.0 ** (-np.arange(0, 64, 2) / 64)
    ramp = 1 - np.clip((np.arange(32) - lo) / max(hi - lo, 0.001), 0, 1)  # 1: the trained frequency
    ang = pos[:, None, None] * (extrap / 32 * (1 - ramp) + extrap * ramp)
    c, s_ = np.cos(ang) * (1 + 0.1 * np.log(32)), np.sin(ang) * (1 + 0.1 * np.log(32))
    want = np.concatenate([x[..., :32] * c - x[..., 32:] * s_, x[..., :32] * s_ + x[..., 32:] * c], -1)
    got = reference(node, [ins[s] for s in node.src])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())  # angles up to 4095 rad in f32
    node, _, ins = cases["GLU-swiglu_oai"](rng)
    g, u = (np.asarray(ins[s], np.float64) for s in node.src)
    gc = np.minimum(g, 7.0)
    want = gc / (1 + np.exp(-1.702 * gc)) * (np.clip(u, -7.0, 7.0) + 1)
    np.testing.assert_allclose(reference(node, [ins[s] for s in node.src]), want, rtol=1e-5, atol=1e-5)
    node, _, ins = cases["ADD_ID"](rng)
    x, b, ids = (ins[s] for s in node.src)
    np.testing.assert_array_equal(reference(node, [x, b, ids]), x + b[ids])


def test_gelu_is_ggml_cpus() -> None:
    """GELU (tanh) of the f16-rounded input, rounded to f16, 0 below -10, x above 10."""
    from llamapy.backend.kernels import gelu

    x = np.array([-20.0, -10.0, -3.0, -0.5, 0.0, 0.3, 1.0, 2.5, 9.99, 10.0, 15.0], np.float32)
    h = x.astype(np.float16).astype(np.float64)
    exact = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    got = gelu(np, x)
    inside = (x > -10) & (x < 10)
    assert np.allclose(got[inside], exact[inside], rtol=1e-3, atol=1e-4)
    assert np.array_equal(got[inside], got[inside].astype(np.float16).astype(np.float32))
    assert got[0] == 0 and got[1] == 0 and got[-2] == 10.0 and got[-1] == 15.0
