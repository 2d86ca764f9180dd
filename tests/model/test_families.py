"""qwen2, qwen3 and gemma3 graphs against an independent float64 forward pass (family_models.py):
biases, per-head Q/K norms, a head size apart from n_embd/n_head, NEOX rope, tied and untied
outputs, gemma3's scaled embeddings, post norms, GELU FFN and sliding-window attention — in one
batch, in micro-batches and token by token through the KV cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.context import ContextOptions
from family_models import reference_logits, rewrite_gguf, write_family_gguf

TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33, 34, 120, 121, 122, 50, 51, 52, 53]


def _check(path: Path, tokens: list[int], rtol: float = 1e-4, **ctx_kw: object) -> None:
    ref = reference_logits(path, tokens)
    # float32 activations (--f32-activations): the float64 reference has no 8-bit rounding
    co = ContextOptions(n_ctx=int(ctx_kw.pop("n_ctx", 256)), type_k=T.F32, type_v=T.F32, cpu_matmul="f32", **ctx_kw)  # type: ignore[arg-type]
    with llamapy.Llama(path, context_options=co) as llm:
        got = llm.ctx.decode(tokens, list(range(len(tokens))), 0, np.ones(len(tokens), bool))
    err = np.abs(got - ref).max()
    assert err <= rtol * np.abs(ref).max(), f"max |Δlogit| {err} vs max |logit| {np.abs(ref).max()}"


CASES = {
    "qwen2-tied": dict(arch="qwen2"),
    "qwen2-untied": dict(arch="qwen2", tied=False),
    "qwen3": dict(arch="qwen3", head_dim=48),  # 4 x 48 != 128: the head size is the file's
    "qwen3-q8": dict(arch="qwen3", qtype=T.Q8_0, tied=False),
    "gemma3": dict(arch="gemma3", head_dim=64, n_swa=6, swa_pattern=3, n_layer=3),
}
# gemma3's GELU reads its input as f16, as ggml-cpu's table does: a looser bound than the others
RTOL = {"gemma3": 2e-4}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_reference(tmp_path: Path, case: str) -> None:
    path = write_family_gguf(tmp_path / f"{case}.gguf", **CASES[case])  # type: ignore[arg-type]
    _check(path, TOKENS, RTOL.get(case, 1e-4))


@pytest.mark.parametrize("case", ["qwen2-untied", "qwen3", "gemma3"])
@pytest.mark.parametrize("ubatch", [1, 5])
def test_family_micro_batches_and_decode(tmp_path: Path, case: str, ubatch: int) -> None:
    """Token by token (-ub 1) and in micro-batches: the cache and, for gemma3, the sliding-window
    mask over cells written by earlier batches."""
    path = write_family_gguf(tmp_path / f"{case}.gguf", **CASES[case])  # type: ignore[arg-type]
    _check(path, TOKENS, RTOL.get(case, 1e-4), n_ubatch=ubatch, n_batch=8)


def test_sliding_window_changes_the_result(tmp_path: Path) -> None:
    """The window is applied: the same weights with a window longer than the prompt give other
    logits past the window, and the same ones inside it."""
    a = write_family_gguf(tmp_path / "a.gguf", "gemma3", n_swa=4, swa_pattern=2, head_dim=64)
    b = write_family_gguf(tmp_path / "b.gguf", "gemma3", n_swa=4096, swa_pattern=2, head_dim=64)
    co = ContextOptions(n_ctx=64, type_k=T.F32, type_v=T.F32, cpu_matmul="f32")
    n = len(TOKENS)
    with llamapy.Llama(a, context_options=co) as la, llamapy.Llama(b, context_options=co) as lb:
        ga = la.ctx.decode(TOKENS, list(range(n)), 0, np.ones(n, bool))
        gb = lb.ctx.decode(TOKENS, list(range(n)), 0, np.ones(n, bool))
    assert np.allclose(ga[:4], gb[:4], atol=1e-4)
    assert np.abs(ga[8:] - gb[8:]).max() > 1e-2


def test_gemma3_hparams_from_the_file(tmp_path: Path) -> None:
    path = write_family_gguf(tmp_path / "g.gguf", "gemma3", n_layer=7, head_dim=64, n_swa=16, swa_pattern=6)
    with llamapy.Llama(path, context_options=ContextOptions(n_ctx=32)) as llm:
        p = llm.model.params
    assert p.arch == "gemma3" and p.n_swa == 16 and p.head_dim == 64
    assert p.swa_layers == (True,) * 5 + (False, True)  # every 6th layer is global
    assert p.rope_base(0) == 10000.0 and p.rope_base(5) == 1_000_000.0
    assert p.attn_scale == pytest.approx(1 / 8)


def test_per_layer_arrays_are_kept(tmp_path: Path) -> None:
    """head_count_kv given per layer: each layer's cache rows and K/V shapes follow it."""
    import gguf

    src = write_family_gguf(tmp_path / "src.gguf", "qwen3", n_layer=2, head_dim=32, n_head_kv=2)
    r = gguf.GGUFReader(str(src))
    from llamapy.models import read_hparams

    md = {f.name: f.contents() for f in r.fields.values()}
    md["qwen3.attention.head_count_kv"] = [2, 4]
    p = read_hparams(md, 271)
    assert p.n_head_kv_arr == (2, 4) and p.n_embd_k_gqa(1) == 128
    md["qwen3.attention.head_count_kv"] = [2, 4, 4]
    with pytest.raises(llamapy.LlamapyError, match="head_count_kv' has 3 values, expected one per layer"):
        read_hparams(md, 271)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("blk.1.attn_q.bias", "missing tensor 'blk.1.attn_q.bias'"),
        ("blk.0.attn_k_norm.weight", "missing tensor 'blk.0.attn_k_norm.weight'"),
    ],
)
def test_missing_family_tensor_is_named(tmp_path: Path, drop: str, message: str) -> None:
    arch = "qwen2" if "bias" in drop else "qwen3"
    src = write_family_gguf(tmp_path / "src.gguf", arch)
    out = rewrite_gguf(src, tmp_path / "dropped.gguf", drop_tensors=(drop,))
    with pytest.raises(llamapy.LlamapyError, match=message):
        llamapy.Llama(out)


@pytest.mark.parametrize("case", ["qwen2-untied", "qwen3", "gemma3"])
def test_family_on_the_test_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Every layer on the GPU-like TEST0 device (biases, Q/K norms, post norms, GELU, windows
    included) gives the CPU's logits."""
    from llamapy.context import ModelOptions

    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    path = write_family_gguf(tmp_path / f"{case}.gguf", **CASES[case])  # type: ignore[arg-type]
    co = ContextOptions(n_ctx=64, type_k=T.F32, type_v=T.F32, cpu_matmul="f32")
    n = len(TOKENS)
    out = []
    for ngl in (0, 1, "all"):
        with llamapy.Llama(path, model_options=ModelOptions(n_gpu_layers=ngl), context_options=co) as llm:
            assert (ngl == 0) != any(b.name.startswith("TEST") for b in llm.model.weights.buffers)
            out.append(llm.ctx.decode(TOKENS, list(range(n)), 0, np.ones(n, bool)))
    assert np.abs(out[1] - out[0]).max() <= 1e-4 * np.abs(out[0]).max()
    assert np.abs(out[2] - out[0]).max() <= 1e-4 * np.abs(out[0]).max()


def _fused_and_unfused(path: Path, monkeypatch: pytest.MonkeyPatch, cpu_matmul: str) -> list[list[np.ndarray]]:
    """Logits of a prompt, then decode steps, with the loader's Q/K/V fusion (one product, one
    ADD of the stacked biases) and without it (three products and ADDs)."""
    import functools

    from llamapy import context
    from llamapy.model import loader

    steps = [([1, 5, 9, 3, 40, 75], list(range(6)))] + [([10 + i], [6 + i]) for i in range(3)]
    out = []
    for fuse in (True, False):
        monkeypatch.setattr(context, "collect_weights", functools.partial(loader.collect_weights, fuse=fuse))
        co = ContextOptions(n_ctx=64, n_threads=1, cpu_matmul=cpu_matmul)
        with llamapy.Llama(path, context_options=co) as llm:
            layer = llm.model.weights.layers[0]
            assert ("attn_qkv.bias" in layer and "attn_q.bias" not in layer) == fuse, sorted(layer)
            out.append([llm.ctx.decode(t, p, 0, np.ones(len(t), bool)) for t, p in steps])
    return out


@pytest.mark.parametrize("cpu_matmul", ["q8", "f32"])
@pytest.mark.parametrize("arch", ["qwen2", "gpt-oss"])
def test_fused_qkv_bias_gives_the_unfused_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                               cpu_matmul: str) -> None:
    """Q/K/V weights and their biases fused by the loader (qwen2's, gpt-oss's) give the logits of
    the three products and three ADDs, bit for bit: a product row is the same dot product in
    either matrix, and the ADD is elementwise."""
    from moe_models import write_gptoss_gguf

    if arch == "qwen2":
        path = write_family_gguf(tmp_path / "q.gguf", "qwen2", qtype=T.Q8_0, tied=False)
    else:
        path = write_gptoss_gguf(tmp_path / "g.gguf", qtype=T.Q8_0, exp_qtype=T.MXFP4)
    fused, unfused = _fused_and_unfused(path, monkeypatch, cpu_matmul)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert np.all(np.isfinite(a)) and np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"step {i}"
