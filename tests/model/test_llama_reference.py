"""The whole llama graph against an independent float64 forward pass written here from the
paper's equations, on small models written with GGUFWriter: several layer counts, every quant
type, tied and untied outputs, llama3-style rope_freqs, prompt in one batch, in micro-batches and
token by token through the KV cache."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.context import ContextOptions
from llamapy.model.gguf import GGUFFile
from llamapy.quants import quantize_q8_act


K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def _q8_k(a: np.ndarray) -> np.ndarray:
    """Rows of float32 through ggml's quantize_row_q8_K_ref and back: per 256 values, the value
    of largest magnitude maps to -127, q = nearest (ties to even), at most 127; d * q."""
    b = a.reshape(-1, 256)
    mx = b[np.arange(b.shape[0]), np.abs(b).argmax(axis=1)]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx == 0, np.float32(0), np.float32(-127) / mx).astype(np.float32)
    q = np.minimum(127, np.rint((iscale[:, None] * b).astype(np.float32)))
    with np.errstate(divide="ignore"):
        d = np.where(iscale == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    return (d[:, None] * q.astype(np.float32)).reshape(a.shape)


def round_activations(a: np.ndarray, wtype: T) -> np.ndarray:
    """What ggml multiplies a weight of type `wtype` with: the activations (float32) quantized
    to its vec_dot_type (q8_0 / q8_1 as llama.cpp's x86 build quantizes them, quants.quantize_q8_act;
    q8_K, f16, bf16) and expanded back."""
    a32 = a.astype(np.float32)
    if wtype is T.F16:
        return a32.astype(np.float16).astype(np.float64)
    if wtype is T.BF16:
        return gguf.quants.dequantize(gguf.quants.quantize(a32, T.BF16), T.BF16).astype(np.float64)
    if wtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        q = quantize_q8_act(a32.reshape(-1, a32.shape[-1]), T.Q8_0).reshape(*a32.shape[:-1], -1)
        return gguf.quants.dequantize(q, T.Q8_0).astype(np.float64)
    if wtype in K_QUANTS:
        return _q8_k(a32).astype(np.float64)
    return a


def _q8_1_product(a: np.ndarray, raw: np.ndarray, wtype: T, n_out: int) -> np.ndarray:
    """a @ W.T as ggml computes it for Q4_1 / Q5_1 weights: per 32-block, dx*dy*sum(qx*qy) +
    mx*sy, with q8_1's sy = f16(d * sum(qy)) (d before its f16 rounding) - not the m term of
    the expanded activations, which differs by that rounding."""
    a32 = a.astype(np.float32)
    n, k = a32.shape
    blocks = quantize_q8_act(a32, T.Q8_0).reshape(n, k // 32, 34)
    dy = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    qy = blocks[..., 2:].view(np.int8).astype(np.float64)
    d_raw = (np.abs(a32.reshape(n, k // 32, 32)).max(axis=2) / np.float32(127)).astype(np.float32)
    sy = (qy.sum(axis=2).astype(np.float32) * d_raw).astype(np.float16).astype(np.float64)
    bsize = 20 if wtype is T.Q4_1 else 24
    wb = np.asarray(raw).view(np.uint8).reshape(n_out, k // 32, bsize)
    dx = wb[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    mx = wb[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = wb[..., bsize - 16 :]
    qx = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64)
    if wtype is T.Q5_1:
        qh = wb[..., 4:8].copy().view("<u4")[..., 0].astype(np.int64)
        qx |= ((qh[..., None] >> np.arange(32)) & 1) << 4
    first = (dy[..., None] * qy).reshape(n, -1) @ (dx[..., None] * qx).reshape(n_out, -1).T
    return first + sy @ mx.T


def q8_kernel_types() -> set[T]:
    """The weight types llamapy's CPU backend multiplies with quantized activations (the q8
    mode); the others (K types until their kernels are built in) keep float32 activations."""
    from llamapy.backend import native

    lib = native.lib()
    return set() if lib is None else {t for t in T if lib.lp_vec_dot_type(int(t)) >= 0 and t is not T.F32}


# llamapy's MUL_MAT node of each weight (llama.cpp's names; fused QKV and gate/up where it fuses)
_NODE = {"attn_q": ("wqkv", "Qcur"), "attn_k": ("wqkv", "Kcur"), "attn_v": ("wqkv", "Vcur"),
         "attn_output": ("attn_out",), "ffn_gate": ("ffn_gate_up", "ffn_gate"), "ffn_up": ("ffn_gate_up", "ffn_up"),
         "ffn_down": ("ffn_out",)}


def _forced_input(inputs: dict[str, np.ndarray], name: str, a: np.ndarray) -> np.ndarray:
    """llamapy's own input of the MUL_MAT of weight `name`, after checking that it is the
    reference's float64 one to float32 accuracy: 1e-4 of each row's largest value (f32 softmax on
    these random models' large attention scores loses ~1e-5), plus 1e-6 of the largest value
    (rows the float64 reference keeps at 1e-81 underflow to 0 in float32)."""
    if name in ("output.weight", "token_embd.weight"):
        keys = ("result_output",)
    else:
        il, wname = name.split(".")[1], name.split(".")[2]
        keys = tuple(f"{k}-{il}" for k in _NODE[wname])
    key = next(k for k in keys if k in inputs)
    got = inputs[key].reshape(a.shape)
    tol = 1e-4 * np.abs(a).max(axis=-1, keepdims=True) + 1e-6 * np.abs(a).max()
    assert np.all(np.abs(got - a) <= tol), (key, float(np.max(np.abs(got - a) / tol)))
    return got.astype(np.float64)


def reference_logits(path, tokens: list[int], q8: bool = False,  # noqa: ANN001
                     inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """float64 logits; `q8`: every matmul input rounded as ggml's CPU backend does it for the
    weight's type (round_activations), for the types llamapy has kernels for. `inputs`
    (llamapy's MUL_MAT inputs by node name): each quantized product takes llamapy's input
    instead of the reference's after checking they agree (_forced_input), so that the 8-bit
    rounding decisions are llamapy's where the two differ by float32 error across a rounding
    boundary (see _check)."""
    gf = GGUFFile(path)
    md = gf.metadata
    rounded = q8_kernel_types() if q8 else set()

    def mm(a: np.ndarray, name: str) -> np.ndarray:
        t = gf.tensors[name].type
        if inputs is not None and t in rounded:
            a = _forced_input(inputs, name, a)
        if t in rounded and t in (T.Q4_1, T.Q5_1):
            return _q8_1_product(a, np.array(gf.tensor_bytes(name)), t, gf.tensors[name].shape[0])
        return (round_activations(a, t) if t in rounded else a) @ w(name).T

    def w(name: str) -> np.ndarray:
        info = gf.tensors[name]
        raw = np.array(gf.tensor_bytes(name))
        if info.type in (T.F32, T.F16):
            return raw.view(np.float32 if info.type is T.F32 else np.float16).reshape(info.shape).astype(np.float64)
        return gguf.quants.dequantize(raw, info.type).reshape(info.shape).astype(np.float64)

    n_layer = md["llama.block_count"]
    n_head, n_head_kv = md["llama.attention.head_count"], md["llama.attention.head_count_kv"]
    eps = md["llama.attention.layer_norm_rms_epsilon"]
    base = md["llama.rope.freq_base"]
    emb = w("token_embd.weight")
    out_name = "output.weight" if "output.weight" in gf.tensors else "token_embd.weight"
    freqs = w("rope_freqs.weight") if "rope_freqs.weight" in gf.tensors else None
    x = emb[tokens]  # (T, E)
    n, e = x.shape
    hd = e // n_head

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        # in float32 as ggml's rms_norm and mul define it: x * (1.0f / sqrtf(mean + eps)) * g
        v32 = v.astype(np.float32)
        mean = (v32.astype(np.float64) ** 2).mean(-1, keepdims=True).astype(np.float32)
        return ((v32 * (np.float32(1.0) / np.sqrt(mean + np.float32(eps)))) * g.astype(np.float32)).astype(np.float64)

    def rope(v: np.ndarray) -> np.ndarray:  # (T, H, D), pairs (2i, 2i+1)
        # the angles as ggml defines them (rope_cache_init): theta_i+1 = theta_i * base^(-2/hd) in
        # float32 from theta_0 = p, not p * base^(-2i/hd) (they differ by up to ~hd/2 float32 ulps)
        steps = np.full((n, hd // 2), np.float32(base ** (-2.0 / hd)), np.float32)
        steps[:, 0] = np.arange(n)
        ang = np.cumprod(steps, axis=1).astype(np.float64)
        if freqs is not None:
            ang = ang / freqs
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = v.copy()
        out[..., 0::2] = v[..., 0::2] * c - v[..., 1::2] * s
        out[..., 1::2] = v[..., 0::2] * s + v[..., 1::2] * c
        return out

    causal = np.triu(np.full((n, n), -np.inf), 1)
    for il in range(n_layer):
        p = f"blk.{il}."
        h = norm(x, w(p + "attn_norm.weight"))
        q = rope(mm(h, p + "attn_q.weight").reshape(n, n_head, hd))
        k = rope(mm(h, p + "attn_k.weight").reshape(n, n_head_kv, hd))
        v = mm(h, p + "attn_v.weight").reshape(n, n_head_kv, hd)
        g = n_head // n_head_kv
        att = np.empty((n, n_head, hd))
        for hh in range(n_head):
            s = q[:, hh] @ k[:, hh // g].T / np.sqrt(hd) + causal
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att[:, hh] = pr @ v[:, hh // g]
        x = x + mm(att.reshape(n, e), p + "attn_output.weight")
        h = norm(x, w(p + "ffn_norm.weight"))
        gate, up = mm(h, p + "ffn_gate.weight"), mm(h, p + "ffn_up.weight")
        x = x + mm(gate / (1 + np.exp(-gate)) * up, p + "ffn_down.weight")
    return mm(norm(x, w("output_norm.weight")), out_name)


def _q8_inputs(path, tokens, co: ContextOptions) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # noqa: ANN001
    """llamapy's logits and the float32 input of every MUL_MAT node (rows of all micro-batches in
    order, by node name), from the node-by-node path (the executor's products equal it bit for
    bit: tests/backend/test_executor.py)."""
    from llamapy.backend.cpu import CPUBackend

    seen: dict[str, list[np.ndarray]] = {}
    real = CPUBackend._mul_mat

    def spy(self, node, s, xp):  # noqa: ANN001, ANN202
        x = np.asarray(s[1], np.float32)
        seen.setdefault(node.name, []).append(x.reshape(-1, x.shape[-1]).copy())
        return real(self, node, s, xp)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CPUBackend, "_mul_mat", spy)
        mp.setenv("LLAMAPY_EXECUTOR", "0")
        with llamapy.Llama(path, context_options=co) as llm:
            got = llm.logits(tokens)
    return got, {k: np.concatenate(v) for k, v in seen.items()}


def _check(path, tokens, cpu_matmul: str = "f32", **ctx_kw) -> None:  # noqa: ANN001
    """llamapy's logits against the float64 reference: float32 activations (exact to float32
    rounding), or the q8 mode against the reference with ggml's activation rounding. In the q8
    mode an activation that float32 and float64 put on different sides of a rounding boundary
    moves the later layers by a quantization step, which these small random models amplify
    (measured: the Q6_K model, with RMS_NORM rounded as ggml's, has layer 0's attention output
    at x * iscale = 77.4999924 in llamapy and 77.5000076 in the reference, 1.2e-7 apart: 3 of
    3584 q8_K quants flip and the logits move by 2.7e-2 of the largest); both roundings are right
    to float32 accuracy, so the reference takes llamapy's rounding decisions (its inputs, checked
    equal to the reference's to float32 accuracy at every product, _forced_input) and the
    logits must then agree to 1e-5 (measured: at most 4e-7 over the quant types; this spies
    on the node-by-node path). Each product itself is checked exactly by
    test_q8_products_are_ggmls."""
    co = ContextOptions(n_ctx=ctx_kw.pop("n_ctx", 256), type_k=T.F32, type_v=T.F32, cpu_matmul=cpu_matmul, **ctx_kw)
    if cpu_matmul == "q8":
        got, inputs = _q8_inputs(path, tokens, co)
        ref = reference_logits(path, tokens, q8=True, inputs=inputs)
    else:
        ref = reference_logits(path, tokens)
        with llamapy.Llama(path, context_options=co) as llm:
            got = llm.logits(tokens)
    err = np.abs(got - ref).max()
    tol = 1e-4 if cpu_matmul == "f32" else 1e-5
    assert err <= tol * np.abs(ref).max(), f"max |Δlogit| {err} vs max |logit| {np.abs(ref).max()}"


TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33, 34]

WRITABLE = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.BF16]


@pytest.mark.parametrize("qtype", WRITABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("cpu_matmul", ["f32", "q8"])
def test_every_quant_type_matches_reference(make_llama, qtype: T, cpu_matmul: str) -> None:
    _check(make_llama(n_layer=2, qtype=qtype), TOKENS, cpu_matmul)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q5_0, T.F16, T.Q4_K], ids=lambda t: t.name)
def test_q8_prompt_on_sgemm_matches_reference(make_llama, qtype: T) -> None:
    """A batch long enough for sgemm (qmatmul.use_sgemm) computes the q8 kernels' numbers too."""
    _check(make_llama(n_layer=2, qtype=qtype), TOKENS * 3, "q8")


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16, *K_QUANTS], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [3, 42])  # the q8 kernels; sgemm on rounded activations
def test_q8_products_are_ggmls(make_llama, monkeypatch, qtype: T, n_tokens: int) -> None:
    """Every MUL_MAT of a whole q8-mode run equals ggml's definition for its input (the reference's
    float64 products with ggml's activation rounding) to float32 summation error; on sgemm
    (42 tokens) Q4_1 / Q5_1 also differ by the f16 rounding of q8_1's block sums, which the
    rounded float32 activations cannot carry."""
    from llamapy.backend import native
    from llamapy.backend.cpu import CPUBackend

    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    checked = []
    real = CPUBackend._mul_mat

    def spy(self, node, s, xp):  # noqa: ANN001, ANN202
        out = real(self, node, s, xp)
        w, x = s
        x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        raw = w.data
        wf = gguf.quants.dequantize(raw, w.qtype).reshape(w.n_out, w.n_in).astype(np.float64)
        if w.vec_dot_type() is None:  # no q8 kernel for the type in this build: float32
            want = x2 @ wf.T
        elif w.qtype in (T.Q4_1, T.Q5_1):
            want = _q8_1_product(x2, raw, w.qtype, w.n_out)
        else:
            want = round_activations(x2, w.qtype) @ wf.T
        got = out.reshape(want.shape)
        scale = np.abs(x2) @ np.abs(gguf.quants.dequantize(raw, w.qtype).reshape(w.n_out, w.n_in)).T
        rel = 2.0**-10 if w.qtype in (T.Q4_1, T.Q5_1) and w.path(x2.shape[0]) == "sgemm" else 1e-5
        assert np.all(np.abs(got - want) <= rel * scale + 1e-30), node.name
        checked.append(node.name)
        return out

    monkeypatch.setattr(CPUBackend, "_mul_mat", spy)
    # the spy sits on the node-by-node path; the executor's products equal it bit for bit
    # (tests/backend/test_executor.py)
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "0")
    path = make_llama(n_layer=2, qtype=qtype, embd_type=qtype)
    co = ContextOptions(n_ctx=256, type_k=T.F32, type_v=T.F32, cpu_matmul="q8")
    with llamapy.Llama(path, context_options=co) as llm:
        llm.logits((TOKENS * 3)[:n_tokens])
    assert len(checked) == 2 * 4 + 1  # fused QKV, attn out, fused gate/up, down; the output


@pytest.mark.parametrize("n_layer", [1, 3, 32])
def test_layer_counts(make_llama, n_layer: int) -> None:
    _check(make_llama(n_layer=n_layer, n_embd=128, n_ff=256, qtype=T.Q8_0), TOKENS)


def test_untied_output_and_rope_freqs(make_llama) -> None:
    _check(make_llama(n_layer=2, tied=False, rope_freqs=True, qtype=T.Q4_K, embd_type=T.Q6_K), TOKENS)


@pytest.mark.parametrize("ubatch", [1, 4])
def test_micro_batches_reuse_the_cache(make_llama, ubatch: int) -> None:
    """-ub 1 sends every token through the single-token decode path."""
    _check(make_llama(n_layer=2, qtype=T.Q4_1), TOKENS, n_ubatch=ubatch, n_batch=8)


def test_unsupported_architecture_is_a_clear_error(make_llama) -> None:
    path = make_llama(n_layer=1, arch="falcon")
    with pytest.raises(llamapy.LlamapyError, match="unsupported architecture 'falcon'"):
        llamapy.Llama(path)


def test_long_prompt_takes_the_blocked_attention_path(make_llama) -> None:
    """More tokens than one attention block: query blocks read only their visible keys."""
    from llamapy.backend.kernels import FA_BLOCK

    toks = [1] + [int(t) for t in np.random.default_rng(1).integers(3, 270, 2 * FA_BLOCK + 37)]
    _check(make_llama(n_layer=2, n_embd=128, n_ff=256, qtype=T.Q8_0), toks, n_ctx=512, n_ubatch=512, n_batch=512)


def test_two_sequences_in_one_batch_equal_two_runs(make_llama) -> None:
    """Cells of another sequence are masked out: a batch holding two sequences gives each the
    logits it gets alone (llama.cpp's unified KV cache)."""
    path = make_llama(n_layer=2, qtype=T.Q4_0)
    a, b = TOKENS, TOKENS[::-1]
    # float32 activations: in the q8 mode the batch and the single runs may round an activation
    # differently (their float32 sums differ in order), which this check is not about
    co = ContextOptions(n_ctx=256, type_k=T.F32, type_v=T.F32, cpu_matmul="f32")
    with llamapy.Llama(path, context_options=co) as llm:
        la, lb = llm.logits(a), llm.logits(b)
        llm.ctx.kv.clear()
        both = llm.ctx.decode(a + b, list(range(len(a))) + list(range(len(b))), [0] * len(a) + [1] * len(b),
                              np.ones(len(a) + len(b), bool))  # fmt: skip
    assert np.abs(both[: len(a)] - la).max() <= 1e-4 * np.abs(la).max()
    assert np.abs(both[len(a) :] - lb).max() <= 1e-4 * np.abs(lb).max()


@pytest.mark.parametrize("impl", ["c-q8", "c-f32", "numpy"])
@pytest.mark.parametrize("ubatch", [1, 64])
def test_every_kernel_set_matches_reference(make_llama, monkeypatch, impl: str, ubatch: int) -> None:
    """The C kernels in both matmul modes and the numpy fallback (qmatmul.kernels()) each run the
    whole model: decode (-ub 1: matvec, decode attention) and a 42-token batch (BLAS on expanded
    tiles), K-quants included. Without C kernels the q8 mode computes in float32 (numpy)."""
    from llamapy.backend import native

    if impl.startswith("c") and native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    if impl == "numpy":
        monkeypatch.setenv("LLAMAPY_KERNELS", "numpy")
    mode = "q8" if impl == "c-q8" else "f32"
    toks = TOKENS * 3
    _check(make_llama(n_layer=2, n_embd=256, n_ff=512, qtype=T.Q4_K, embd_type=T.Q6_K), toks, mode,
           n_ubatch=ubatch, n_batch=64)  # fmt: skip
    _check(make_llama(n_layer=2, qtype=T.Q4_1, embd_type=T.Q8_0), toks, mode, n_ubatch=ubatch, n_batch=64)
