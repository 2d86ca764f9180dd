"""IQ4_NL, IQ4_XS, MXFP4 and Q4_0 against llama.cpp itself (slow; skipped without llama.cpp's tools).

A tiny qwen3 quantized by llama-quantize --pure to each type (references/make_iquant_refs.py):
the float32-activation mode against llama.cpp's run of the F32-dequantized file (mean KLD
<= 1e-4, the issue's bar for the MoE files), the default 8-bit mode against llama.cpp's run of the
quantized file itself — its kernels sum in llama.cpp's x86 orders, so it is far inside llama.cpp's
own spread (llama-perplexity -ub 1 --kl-divergence against its default run on these files,
2026-12-04, an Intel Xeon with AVX-512 VNNI, -t 2: IQ4_NL 0.0029, IQ4_XS 0.0060, MXFP4 0.0026).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llamapy import Llama
from llamapy.context import ContextOptions
from llamapy.perplexity import KLDivergence, evaluate_kl_divergence, read_logits_file

sys.path.insert(0, str(Path(__file__).resolve().parent / "references"))
import make_family_refs as refs  # noqa: E402
import make_iquant_refs as iq  # noqa: E402

pytestmark = pytest.mark.slow


def _kld(model: Path, base_file: Path, mode: str, ubatch: int = 512) -> KLDivergence:
    base = read_logits_file(base_file)
    co = ContextOptions(n_ctx=base.n_ctx, n_batch=base.n_ctx, n_ubatch=min(ubatch, base.n_ctx), cpu_matmul=mode)
    with Llama(model, context_options=co) as llm:
        stats = None
        for _, stats in evaluate_kl_divergence(llm.ctx, base, llm.ctx.n_batch, base.n_chunk):
            pass
    assert stats is not None
    return stats


@pytest.mark.parametrize("name", list(iq.TYPES))
def test_kld_against_llama_cpp(name: str) -> None:
    bin_dir = refs.llama_cpp_bin()
    if bin_dir is None:
        pytest.skip("llama.cpp's tools are not built (bench/llama_cpp.py builds them)")
    if not refs.QWEN2_VOCAB.is_file():
        pytest.skip(f"{refs.QWEN2_VOCAB} is not there")
    f = iq.ensure(name, bin_dir, iq.out_dir())
    f32 = _kld(f["model"], f["kld_f32"], "f32")
    q8 = _kld(f["model"], f["kld"], "q8")
    q8_ub1 = _kld(f["model"], f["kld"], "q8", ubatch=1)  # decode-sized batches: the same order
    print(f"{name}: f32 mode KLD {f32.mean_kld()[0]:.3g}, q8 mode {q8.mean_kld()[0]:.3g} "
          f"(-ub 1: {q8_ub1.mean_kld()[0]:.3g}), same top {q8.same_top()[0]:.4f}")
    assert f32.mean_kld()[0] <= 1e-4 and f32.same_top()[0] >= 0.99
    assert q8.mean_kld()[0] <= 1e-4 and q8.same_top()[0] >= 0.99
    assert q8_ub1.mean_kld()[0] <= 1e-4
