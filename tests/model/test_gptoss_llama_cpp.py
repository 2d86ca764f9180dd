"""gpt-oss against llama.cpp itself (slow; skipped without its tools).

A random-weight gpt-oss file (moe_models.write_gptoss_gguf: 4 layers, 32 experts of which 4 are
used, head size 64, YaRN, sinks, a window of 32 on even layers so that it cuts inside the
128-token chunks; a real vocabulary from ../shared/data/vocab) quantized by llama-quantize to
MXFP4_MOE (experts MXFP4, the rest Q8_0: the shipped layout), then:
  * float32: llamapy's run of the F32-dequantized file against llama-perplexity's run of the same
    file (--kl-divergence-base): mean KLD <= 1e-4, or llama.cpp's own -ub 1 spread where larger;
  * q8 (the default): llamapy's run of the MXFP4_MOE file against llama.cpp's run of it, within
    llama.cpp's own spread (its -ub 1 run against its default run of the same file).
The files and llama.cpp's logits are kept in $LLAMAPY_CACHE/family-refs (made once).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from llamapy import Llama
from llamapy.context import ContextOptions
from llamapy.perplexity import evaluate_kl_divergence, read_logits_file

sys.path.insert(0, str(Path(__file__).resolve().parent / "references"))
import make_family_refs as refs  # noqa: E402
from moe_models import write_gptoss_gguf  # noqa: E402
from test_moe_llama_cpp import _spread  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = refs.SHARED / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
SHAPE = dict(n_layer=4, n_embd=256, n_ff_exp=256, n_expert=32, n_expert_used=4, n_head=8, n_head_kv=2,
             head_dim=64, n_swa=32, seed=31, embd_scale=0.3)  # fmt: skip


def _files() -> tuple[Path, Path, Path, Path, float, float]:
    """(MXFP4_MOE file, its F32 copy, llama.cpp's logits of each, llama.cpp's -ub 1 spread on each)."""
    bin_dir = refs.llama_cpp_bin()
    if bin_dir is None:
        pytest.skip("llama.cpp's tools are not built (bench/llama_cpp.py builds them; then llama-quantize and llama-perplexity)")
    if not VOCAB.is_file():
        pytest.skip(f"{VOCAB} is not there")
    out = refs.out_dir()
    out.mkdir(parents=True, exist_ok=True)
    q, f32 = out / "gptoss-MXFP4_MOE.gguf", out / "gptoss-MXFP4_MOE-f32.gguf"
    kq, kf = out / "gptoss-q.c128x2.kld", out / "gptoss-f32.c128x2.kld"
    run = [bin_dir / "llama-perplexity", "-f", refs.TEMPEST, *refs.KLD_ARGS, "-t", "2"]
    if not q.is_file():
        src = write_gptoss_gguf(out / "gptoss-src.gguf", **SHAPE, vocab=VOCAB)  # type: ignore[arg-type]
        refs._run([bin_dir / "llama-quantize", src, q, "MXFP4_MOE"])
        src.unlink()
    if not f32.is_file():
        refs._run([bin_dir / "llama-quantize", "--allow-requantize", q, f32, "F32"])
    if not kf.is_file():
        refs._run([*run, "-m", f32, "--kl-divergence-base", kf])
    if not kq.is_file():
        refs._run([*run, "-m", q, "--kl-divergence-base", kq])
    return q, f32, kq, kf, _spread(run, q, kq, out / "gptoss-q.spread"), _spread(run, f32, kf, out / "gptoss-f32.spread")


def _kld(model: Path, kld: Path, cpu_matmul: str) -> tuple[float, float, np.ndarray]:
    """(mean KLD, same top, every token's KLD)."""
    base = read_logits_file(kld)
    co = ContextOptions(n_ctx=base.n_ctx, n_batch=base.n_ctx, cpu_matmul=cpu_matmul)
    with Llama(model, context_options=co) as llm:
        stats = None
        for _, stats in evaluate_kl_divergence(llm.ctx, base, llm.ctx.n_batch, base.n_chunk):
            pass
    assert stats is not None
    return stats.mean_kld()[0], stats.same_top()[0], np.concatenate(stats.kld_values)


def test_gptoss_f32_against_llama_cpp() -> None:
    _q, f32, _kq, kf, _sq, spread = _files()
    kld, top, per_token = _kld(f32, kf, "f32")
    print(f"gpt-oss f32: mean KLD {kld:.2e} (llama.cpp -ub 1 vs default: {spread:.2e}), median "
          f"{np.median(per_token):.2e}, max {per_token.max():.2e}, same top {top:.4f}")  # fmt: skip
    assert kld <= max(1e-4, spread) and np.median(per_token) <= 1e-5


def test_gptoss_q8_against_llama_cpp_within_its_spread() -> None:
    q, _f32, kq, _kf, spread, _sf = _files()
    kld, top, _ = _kld(q, kq, "q8")
    print(f"gpt-oss MXFP4_MOE q8: mean KLD {kld:.6f} (llama.cpp -ub 1 vs default: {spread:.6f}), same top {top:.4f}")
    assert kld <= max(spread, 1e-6)
