"""qwen3moe and Mixtral-style llama against llama.cpp itself (slow; skipped without its tools).

Random-weight files (moe_models.py, real vocabularies from ../shared/data/vocab) quantized to
Q4_K_M by llama-quantize, then:
  * float32: llamapy's run of the F32-dequantized file against llama-perplexity's run of the
    same file (its --kl-divergence-base): mean KLD <= 1e-4, or llama.cpp's own -ub 1 spread on
    that file where an expert choice on a near-tie makes it larger;
  * q8 (the default): llamapy's run of the Q4_K_M file against llama.cpp's run of it, within
    llama.cpp's own spread (its -ub 1 run against its default run, the same file).
The files and llama.cpp's logits are kept in $LLAMAPY_CACHE/family-refs (made once).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from llamapy import Llama
from llamapy.context import ContextOptions
from llamapy.perplexity import evaluate_kl_divergence, read_logits_file

sys.path.insert(0, str(Path(__file__).resolve().parent / "references"))
import make_family_refs as refs  # noqa: E402
from moe_models import write_moe_gguf  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = refs.SHARED / "data" / "vocab"
VARIANTS: dict[str, dict[str, object]] = {
    "qwen3moe": dict(arch="qwen3moe", n_layer=4, n_embd=256, n_ff=768, n_ff_exp=128, n_expert=16, n_expert_used=4,
                     n_head=4, n_head_kv=2, head_dim=64, seed=21, embd_scale=0.3, rope_base=1_000_000.0,
                     vocab=VOCAB / "ggml-vocab-qwen2.gguf"),
    "mixtral": dict(arch="llama", n_layer=4, n_embd=256, n_ff=256, n_expert=8, n_expert_used=2, n_head=4,
                    n_head_kv=2, seed=22, embd_scale=0.3, vocab=VOCAB / "ggml-vocab-llama-spm.gguf"),
}  # fmt: skip


def _mean_kld(log: str) -> float:
    m = re.search(r"Mean\s+KLD:\s+([-0-9.e]+)", log)
    if m is None:
        raise RuntimeError("no 'Mean KLD' in llama-perplexity's output")
    return float(m.group(1))


def _spread(run: list, model: Path, base: Path, path: Path) -> float:
    """llama.cpp's own spread: its -ub 1 run of `model` against its default run (`base`)."""
    if not path.is_file():
        path.write_text(str(_mean_kld(refs._run([*run, "-m", model, "-ub", "1", "--kl-divergence-base", base,
                                                 "--kl-divergence"]))))  # fmt: skip
    return float(path.read_text())


def _files(name: str, ftype: str = "Q4_K_M") -> tuple[Path, Path, Path, Path, float, float]:
    """(Q4_K_M file, its F32 copy, llama.cpp's logits of each, llama.cpp's -ub 1 spread on each);
    another `ftype`: that type's file requantized from the F32 copy, and its logits and spread."""
    bin_dir = refs.llama_cpp_bin()
    if bin_dir is None:
        pytest.skip("llama.cpp's tools are not built (bench/llama_cpp.py builds them; then llama-quantize and llama-perplexity)")
    kw = dict(VARIANTS[name])
    if not Path(str(kw["vocab"])).is_file():
        pytest.skip(f"{kw['vocab']} is not there")
    out = refs.out_dir()
    out.mkdir(parents=True, exist_ok=True)
    q, f32 = out / f"moe-{name}-Q4_K_M.gguf", out / f"moe-{name}-Q4_K_M-f32.gguf"
    kq, kf = out / f"moe-{name}-q.c128x2.kld", out / f"moe-{name}-f32.c128x2.kld"
    run = [bin_dir / "llama-perplexity", "-f", refs.TEMPEST, *refs.KLD_ARGS, "-t", "2"]
    if not q.is_file():
        src = write_moe_gguf(out / f"moe-{name}-src.gguf", **kw)  # type: ignore[arg-type]
        refs._run([bin_dir / "llama-quantize", src, q, "Q4_K_M"])
        src.unlink()
    if not f32.is_file():
        refs._run([bin_dir / "llama-quantize", "--allow-requantize", q, f32, "F32"])
    if not kf.is_file():
        refs._run([*run, "-m", f32, "--kl-divergence-base", kf])
    if not kq.is_file():
        refs._run([*run, "-m", q, "--kl-divergence-base", kq])
    spread_f32 = _spread(run, f32, kf, out / f"moe-{name}-f32.spread")
    if ftype != "Q4_K_M":
        q, kq = out / f"moe-{name}-{ftype}.gguf", out / f"moe-{name}-{ftype}.c128x2.kld"
        if not q.is_file():
            refs._run([bin_dir / "llama-quantize", "--allow-requantize", f32, q, ftype])
        if not kq.is_file():
            refs._run([*run, "-m", q, "--kl-divergence-base", kq])
        return q, f32, kq, kf, _spread(run, q, kq, out / f"moe-{name}-{ftype}.spread"), spread_f32
    return q, f32, kq, kf, _spread(run, q, kq, out / f"moe-{name}.spread"), spread_f32


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


@pytest.mark.parametrize("name", list(VARIANTS))
def test_f32_against_llama_cpp(name: str) -> None:
    """The issue's bar: mean KLD <= 1e-4. A router taking the top k of its experts is
    discontinuous: where two experts' probabilities nearly tie, a float32 summation-order
    difference swaps them and that token alone costs ~0.05. llama.cpp's own -ub 1 run against its
    default run of the same F32 file shows it (qwen3moe: 4.9e-4, the same token; Mixtral: 0.011),
    so the bar is 1e-4 or llama.cpp's own spread, whichever is larger."""
    _q, f32, _kq, kf, _spread_q, spread = _files(name)
    kld, top, per_token = _kld(f32, kf, "f32")
    print(f"{name} f32: mean KLD {kld:.2e} (llama.cpp -ub 1 vs default: {spread:.2e}), median "
          f"{np.median(per_token):.2e}, max {per_token.max():.2e}, same top {top:.4f}")  # fmt: skip
    assert kld <= max(1e-4, spread) and np.median(per_token) <= 1e-5


@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ4_XS", "IQ4_NL", "MXFP4_MOE"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_q8_against_llama_cpp_within_its_spread(name: str, ftype: str) -> None:
    """The shipped types: Q4_K_M, and the experts in IQ4_XS / IQ4_NL / MXFP4 (llama-quantize's
    MXFP4_MOE: experts MXFP4, the rest Q8_0), requantized from the F32 file."""
    from llamapy.types import SUPPORTED_TYPES, GGMLType

    if ftype != "Q4_K_M" and GGMLType[ftype.split("_MOE")[0]] not in SUPPORTED_TYPES:
        pytest.skip(f"{ftype} is not a type llamapy loads on this branch")
    q, _f32, kq, _kf, spread, _spread_f32 = _files(name, ftype)
    kld, top, _ = _kld(q, kq, "q8")
    print(f"{name} {ftype} q8: mean KLD {kld:.6f} (llama.cpp -ub 1 vs default: {spread:.6f}), same top {top:.4f}")
    assert kld <= max(spread, 1e-6)
