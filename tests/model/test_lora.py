"""LoRA adapters (llamapy/model/lora.py, layers.mm / input_embd) against the same model with the
adapter merged into its weights (family_models.merge_lora: W + s·B·A, computed in float64
outside llamapy's graphs, llama-export-lora's result); scales, the TEST device, the CLI's
flags and log, and what a bad adapter is told. The slow test compares with llama.cpp's own
--lora on the same files."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as VT

import llamapy
from llamapy.context import ContextOptions, ModelOptions
from llamapy.types import LlamapyError
from family_models import merge_lora, rewrite_gguf, write_family_gguf, write_lora_gguf
from tests_support import cli

TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33]
EVERY = (r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight", "output.weight",
         "token_embd.weight")  # fmt: skip
F32 = ContextOptions(n_ctx=64, type_k=T.F32, type_v=T.F32, cpu_matmul="f32")


def _logits(path: Path, lora: list[tuple[str, float]] = (), co: ContextOptions = F32, ngl: int | str = 0) -> np.ndarray:  # type: ignore[assignment]
    with llamapy.Llama(path, model_options=ModelOptions(lora=lora, n_gpu_layers=ngl), context_options=co) as llm:
        return llm.logits(TOKENS)


def _close(got: np.ndarray, ref: np.ndarray, rtol: float = 2e-5) -> None:
    err = np.abs(got - ref).max()
    assert err <= rtol * np.abs(ref).max(), f"max |Δlogit| {err} vs max |logit| {np.abs(ref).max()}"


CASES = {
    "qwen2": dict(arch="qwen2", tied=False),  # biases after the adapters' terms; Q/K/V kept apart
    "qwen3": dict(arch="qwen3", head_dim=48, tied=False),
    "gemma3": dict(arch="gemma3", head_dim=64, n_swa=6, swa_pattern=3, n_layer=3, tied=False),  # embedding scaled after
}


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_gives_the_merged_models_logits(tmp_path: Path, case: str) -> None:
    model = write_family_gguf(tmp_path / "m.gguf", **CASES[case])  # type: ignore[arg-type]
    ad = write_lora_gguf(model, tmp_path / "a.gguf", EVERY, rank=4, alpha=8.0)
    merged = merge_lora(model, ad, tmp_path / "merged.gguf", scale=0.7)
    base, got, ref = _logits(model), _logits(model, [(str(ad), 0.7)]), _logits(merged)
    assert np.abs(base - ref).max() > 0.1 * np.abs(ref).max()  # the adapter matters
    _close(got, ref)


def test_two_adapters_and_no_alpha(tmp_path: Path) -> None:
    """Two adapters add up in order; without adapter.lora.alpha the scale is used as it is."""
    model = write_family_gguf(tmp_path / "m.gguf", "qwen3", tied=False)
    a = write_lora_gguf(model, tmp_path / "a.gguf", (r"blk\.\d+\.(attn_q|ffn_down)\.weight",), rank=2, alpha=0.0, seed=1)
    b = write_lora_gguf(model, tmp_path / "b.gguf", (r"blk\.\d+\.(attn_q|ffn_up)\.weight", "output.weight"), rank=8,
                        alpha=4.0, seed=2)  # fmt: skip
    merged = merge_lora(merge_lora(model, a, tmp_path / "ma.gguf", 0.5), b, tmp_path / "mab.gguf", -1.5)
    _close(_logits(model, [(str(a), 0.5), (str(b), -1.5)]), _logits(merged))


def test_scales_set_on_the_context(tmp_path: Path) -> None:
    """Scale 0 leaves an adapter out of the graph: the base model's logits (to the rounding of
    Q/K/V and gate/up products run apart, not fused, where an adapter is loaded); a context's
    scales change between micro-batches and each set of scales gets its own graphs."""
    model = write_family_gguf(tmp_path / "m.gguf", "qwen3", tied=False)
    ad = write_lora_gguf(model, tmp_path / "a.gguf", EVERY)
    off = _logits(model, [(str(ad), 0.0)])
    _close(off, _logits(model), 1e-6)
    with llamapy.Llama(model, model_options=ModelOptions(lora=[(str(ad), 1.0)]), context_options=F32) as llm:
        one = llm.logits(TOKENS)
        llm.ctx.set_lora_scales([0.0])
        assert np.array_equal(llm.logits(TOKENS).view(np.uint32), off.view(np.uint32))
        llm.ctx.set_lora_scales([1.0])
        assert np.array_equal(llm.logits(TOKENS).view(np.uint32), one.view(np.uint32))
        with pytest.raises(LlamapyError, match=r"expected 1 finite LoRA scales, got \[1.0, 2.0\]"):
            llm.ctx.set_lora_scales([1.0, 2.0])
    _close(one, _logits(merge_lora(model, ad, tmp_path / "merged.gguf")))


def test_adapter_on_the_test_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pair lives beside the matrix it adapts: at -ngl 2 the last layer's and the output's
    pairs are on TEST0, the rest (and the embedding's) on the CPU; the logits do not move."""
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    model = write_family_gguf(tmp_path / "m.gguf", "qwen2", tied=False, n_layer=3)
    ad = write_lora_gguf(model, tmp_path / "a.gguf", EVERY, dtype=T.F16)
    out = {}
    for ngl in (0, 2, "all"):
        with llamapy.Llama(model, model_options=ModelOptions(lora=[(str(ad), 1.0)], n_gpu_layers=ngl), context_options=F32) as llm:
            (adapter,) = llm.model.adapters
            held = {t.name: b.name for b in adapter.buffers for t in b._store}
            out[ngl] = llm.logits(TOKENS)
        assert held["token_embd.weight.lora_a"] == "CPU"
        assert held["blk.2.ffn_down.weight.lora_b"] == held["output.weight.lora_a"] == ("CPU" if ngl == 0 else "TEST0")
        assert held["blk.0.attn_q.weight.lora_a"] == ("TEST0" if ngl == "all" else "CPU")
    _close(out[2], out[0], 1e-5)
    _close(out["all"], out[0], 1e-5)


def test_f16_adapter_in_the_default_mode(tmp_path: Path) -> None:
    """An F16 adapter (convert_lora_to_gguf's usual type) in the 8-bit mode: the merged model's
    logits within the 8-bit activations' spread."""
    model = write_family_gguf(tmp_path / "m.gguf", "qwen3", tied=False)
    ad = write_lora_gguf(model, tmp_path / "a.gguf", EVERY, dtype=T.F16)
    merged = merge_lora(model, ad, tmp_path / "merged.gguf")
    q8 = ContextOptions(n_ctx=64)
    got, ref = _logits(model, [(str(ad), 1.0)], q8), _logits(merged, co=q8)
    _close(got, ref, 2e-3)


def _bad(tmp_path: Path, model: Path, case: str) -> Path:
    ad = tmp_path / "bad.gguf"
    if case == "not an adapter":
        return model
    if case in ("other architecture", "not lora", "activated lora", "alpha"):
        good = write_lora_gguf(model, tmp_path / "good.gguf", ("blk.0.attn_q.weight",))
        keys = {"other architecture": {"general.architecture": ("llama", VT.STRING, None)},
                "not lora": {"adapter.type": ("control_vector", VT.STRING, None)},
                "activated lora": {"adapter.alora.invocation_tokens": ([1, 2], VT.ARRAY, VT.UINT32)},
                "alpha": {"adapter.lora.alpha": ("8", VT.STRING, None)}}[case]  # fmt: skip
        return rewrite_gguf(good, ad, set_keys=keys)
    good = write_lora_gguf(model, tmp_path / "good.gguf", ("blk.0.attn_q.weight",))
    r = np.random.default_rng(0).standard_normal
    add = {
        "unknown suffix": {"blk.0.attn_q.weight.lora_c": r((4, 128))},
        "one half": {"blk.0.attn_k.weight.lora_a": r((4, 128))},
        "not in the model": {"blk.9.attn_q.weight.lora_a": r((4, 128)), "blk.9.attn_q.weight.lora_b": r((128, 4))},
        "wrong shape": {"blk.1.attn_q.weight.lora_a": r((4, 64)), "blk.1.attn_q.weight.lora_b": r((128, 4))},
        "ranks differ": {"blk.1.attn_q.weight.lora_a": r((4, 128)), "blk.1.attn_q.weight.lora_b": r((128, 3))},
        "a vector": {"blk.0.attn_q.bias.lora_a": r((4, 1)), "blk.0.attn_q.bias.lora_b": r((128, 4))},
        "a norm": {"blk.0.attn_norm.weight": r(128)},  # a trained norm, stored whole
    }[case]
    return rewrite_gguf(good, ad, add_tensors=add)


BAD = {
    "not an adapter": r"LoRA adapter m.gguf: expected general.type 'adapter', got None",
    "other architecture": r"LoRA adapter bad.gguf: an adapter for architecture 'llama', the model is 'qwen2'",
    "not lora": r"LoRA adapter bad.gguf: adapter.type 'control_vector': llamapy reads 'lora' adapters",
    "activated lora": r"LoRA adapter bad.gguf: an activated LoRA \(adapter.alora.invocation_tokens\) is not supported",
    "alpha": r"LoRA adapter bad.gguf: adapter.lora.alpha must be a number, got string",
    "unknown suffix": r"LoRA adapter bad.gguf: tensor 'blk.0.attn_q.weight.lora_c' has an unexpected suffix",
    "one half": r"LoRA adapter bad.gguf: the pair for 'blk.0.attn_k.weight' has only lora_a",
    "not in the model": r"LoRA adapter bad.gguf: 'blk.9.attn_q.weight' is not a tensor of the model",
    "wrong shape": r"LoRA adapter bad.gguf: 'blk.1.attn_q.weight': lora_a \[64, 4\] and lora_b \[4, 128\] do not fit the matrix \[128, 128\]",
    "ranks differ": r"LoRA adapter bad.gguf: 'blk.1.attn_q.weight': lora_a has rank 4, lora_b 3",
    "a vector": r"LoRA adapter bad.gguf: 'blk.0.attn_q.bias': llamapy applies adapters to matrices, not to vectors",
}  # fmt: skip


@pytest.mark.parametrize("case", [*BAD, "a norm"])
def test_bad_adapters_are_refused_in_one_line(tmp_path: Path, case: str) -> None:
    model = write_family_gguf(tmp_path / "m.gguf", "qwen2", tied=False)
    ad = _bad(tmp_path, model, case)
    if case == "a norm":  # skipped, as llama.cpp skips norm vectors, and said in the load log
        r = cli("run", str(model), "--lora", str(ad), "-p", "ab", "-n", "2", "-c", "64")
        assert r.returncode == 0, r.stderr[-1500:]
        assert "llama_adapter_lora_init_impl: 1 norm vectors not applied (as llama.cpp: blk.0.attn_norm.weight, …)" in r.stderr
        return
    with pytest.raises(LlamapyError, match=BAD[case]) as e:
        llamapy.Llama(model, model_options=ModelOptions(lora=[(str(ad), 1.0)]), context_options=F32)
    assert "\n" not in str(e.value)


def test_experts_are_refused(tmp_path: Path) -> None:
    from moe_models import write_moe_gguf

    model = write_moe_gguf(tmp_path / "moe.gguf")
    ad = write_lora_gguf(model, tmp_path / "a.gguf", ("blk.0.ffn_gate_inp.weight", "blk.0.attn_q.weight"))
    merged = merge_lora(model, ad, tmp_path / "merged.gguf")
    _close(_logits(model, [(str(ad), 1.0)]), _logits(merged))  # the router is a matrix like the others
    stack = {"blk.0.ffn_up_exps.weight.lora_a": np.zeros((4, 4, 128)), "blk.0.ffn_up_exps.weight.lora_b": np.zeros((4, 192, 4))}
    bad = rewrite_gguf(ad, tmp_path / "bad.gguf", add_tensors=stack)
    with pytest.raises(LlamapyError, match=r"'blk.0.ffn_up_exps.weight': llamapy applies adapters to matrices, not to the experts' stacks"):
        llamapy.Llama(model, model_options=ModelOptions(lora=[(str(bad), 1.0)]))


def test_cli_flags_and_log(tmp_path: Path) -> None:
    model = write_family_gguf(tmp_path / "m.gguf", "qwen3", tied=False)
    ad = write_lora_gguf(model, tmp_path / "a.gguf", EVERY)
    args = ["-p", "abc", "-n", "12", "--temp", "0", "-c", "64"]
    base = cli("run", str(model), *args)
    one = cli("run", str(model), "--lora", str(ad), *args)
    scaled = cli("run", str(model), "--lora-scaled", f"{ad}:1.0", *args)
    off = cli("run", str(model), "--lora-scaled", f"{ad}:0", *args)
    for r in (base, one, scaled, off):
        assert r.returncode == 0, r.stderr[-1500:]
    assert one.stdout == scaled.stdout != base.stdout == off.stdout
    assert f"llama_adapter_lora_init_impl: loading lora adapter from '{ad}' ..." in one.stderr
    assert re.search(r"llama_adapter_lora_init_impl: +CPU LoRA buffer size = +[0-9.]+ MiB", one.stderr)
    assert "llama_adapter_lora_init_impl: loaded 32 tensors from lora file (scale 1, alpha 8)" in one.stderr
    for flags, message in ((["--lora-scaled", str(ad)], f"error: --lora-scaled {ad}: expected FNAME:SCALE"),
                           (["--lora-scaled", f"{ad}:x"], f"error: --lora-scaled {ad}:x: expected FNAME:SCALE"),
                           (["--lora", str(tmp_path / "none.gguf")], f"error: LoRA adapter: {tmp_path / 'none.gguf'}: no such file")):  # fmt: skip
        r = cli("run", str(model), *flags, *args)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [message], r.stderr


@pytest.mark.slow
def test_against_llama_cpp_lora(tmp_path: Path) -> None:
    """llama-perplexity --lora on the same files: llamapy's float32 run of model + adapter
    against llama.cpp's logits of it (its --kl-divergence-base), mean KLD <= 1e-4; without the
    adapter the same comparison fails."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "references"))
    import make_family_refs as refs

    model = write_family_gguf(tmp_path / "m.gguf", "qwen3", n_layer=2, n_embd=256, n_ff=512, head_dim=64, tied=False,
                              vocab=refs.QWEN2_VOCAB, embd_scale=0.3, seed=31)  # fmt: skip
    ad = write_lora_gguf(model, tmp_path / "a.gguf", EVERY, rank=8, alpha=16.0, dtype=T.F16, gain=0.3)
    (kld, top), (kld0, _) = refs.kld_with_flags(model, ["--lora-scaled", f"{ad}:0.8"],
                                                [ModelOptions(lora=[(str(ad), 0.8)]), ModelOptions()], tmp_path)  # fmt: skip
    print(f"llamapy with the adapter against llama.cpp with it: mean KLD {kld:.3g}, same top {top:.4f}; without: {kld0:.3g}")
    assert kld <= 1e-4 and kld0 > 0.01
