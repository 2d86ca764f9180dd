"""llama-perplexity against llama.cpp's own results (../shared/reference): KL divergence against
its logits files, the files llamapy writes, the CLI, and (slow) the perplexity table."""

from __future__ import annotations

import json
import lzma
import re
from pathlib import Path

import numpy as np
import pytest

from llamapy import Llama
from llamapy.context import ContextOptions
from llamapy.perplexity import (
    KLDivergence,
    PerplexityEstimate,
    evaluate_kl_divergence,
    evaluate_perplexity,
    plan_context,
    read_logits_file,
)

from tests_support import SHARED

REF = SHARED / "reference"
TEXT = SHARED / "data" / "text"
TINY32 = REF / "tiny32" / "tiny32-Q4_K_M.gguf"
TINY32_BASE = REF / "tiny32" / "tiny32-Q4_K_M-f32.c128x2.kld"
TINY32_Q_BASE = REF / "tiny32" / "tiny32-Q4_K_M.c128x2.kld"  # llama.cpp on the Q4_K_M weights
SMOL_BASE = REF / "smollm2" / "tempest-c128x3-f32.kld"

pytestmark = pytest.mark.skipif(not REF.is_dir(), reason="../shared/reference is not there")


def kld_against(
    model: Path, base_path: Path, n_batch: int = 2048, n_ubatch: int = 512, n_chunks: int = -1,
    cpu_matmul: str | None = None,
) -> KLDivergence:
    """`llamapy perplexity MODEL --kl-divergence-base BASE --kl-divergence -b B -ub UB`, via the API
    (cpu_matmul="f32": with --f32-activations)."""
    base = read_logits_file(base_path)
    n_chunk = base.n_chunk if n_chunks < 0 else n_chunks
    co = ContextOptions(n_ctx=base.n_ctx, n_batch=min(n_batch, base.n_ctx), n_ubatch=n_ubatch)
    with Llama(model, context_options=co, cpu_matmul=cpu_matmul) as llm:
        stats = None
        for _, stats in evaluate_kl_divergence(llm.ctx, base, llm.ctx.n_batch, n_chunk):
            pass
    assert stats is not None and stats.count == n_chunk * (base.n_ctx - 1 - base.n_ctx // 2)
    return stats


# -- KL divergence against llama.cpp's f32 runs -------------------------------------------------


@pytest.mark.parametrize("n_batch,n_ubatch", [(2048, 512), (2048, 1)])  # -b 128 -ub 32: the CLI test below
def test_kld_tiny32(n_batch: int, n_ubatch: int) -> None:
    """The float32-activation option against llama.cpp on the exactly dequantized weights."""
    s = kld_against(TINY32, TINY32_BASE, n_batch, n_ubatch, cpu_matmul="f32")
    assert s.mean_kld()[0] <= 0.002
    assert s.same_top()[0] >= 0.88


@pytest.mark.parametrize("n_batch,n_ubatch", [(2048, 512), (2048, 1)])
def test_kld_tiny32_q8(n_batch: int, n_ubatch: int) -> None:
    """The default (q8_K activations, the K-quant integer dot products) against llama.cpp on the
    same Q4_K_M file. Not near 0: on this random 32-layer model the 8-bit activation rounding
    turns any float difference into different roundings downstream, so runs that differ only
    in float order decorrelate to the q8 noise level. Measured: llamapy -ub 1 vs -ub 512 0.0052;
    llama.cpp's default vs its own -fa off -ctk f32 -ctv f32 run 0.0063; this 0.0062-0.0064 (a
    wrong kernel gives far more)."""
    s = kld_against(TINY32, TINY32_Q_BASE, n_batch, n_ubatch)
    assert s.mean_kld()[0] <= 0.01
    assert s.same_top()[0] >= 0.88


@pytest.mark.parametrize(
    "n_batch,n_ubatch", [(2048, 512), (128, 32), pytest.param(2048, 1, marks=pytest.mark.slow)]
)
def test_kld_smollm2(n_batch: int, n_ubatch: int, default_model: Path) -> None:
    """The float32-activation option against llama.cpp's F32 run of the same weights."""
    s = kld_against(default_model, SMOL_BASE, n_batch, n_ubatch, cpu_matmul="f32")
    assert s.mean_kld()[0] <= 0.006
    assert s.same_top()[0] >= 0.95


def test_kld_smollm2_q8_like_llama_cpps_q4_1_run(default_model: Path) -> None:
    """The default (q8_0 / q8_1 activations) against the F32 run: as far from it as llama.cpp's own
    Q4_1 run is (README: mean KLD 0.004789, same top 96.8 %); measured 0.0037 / 95.8 % (0.0046 /
    95.2 % before the x86 quantizer, ggml's sum order and RMS norm of 2026-12-02). Float32
    activations sit at ~0 there (test_kld_smollm2), so this checks that the q8 mode is in use."""
    s = kld_against(default_model, SMOL_BASE, 2048, 512)
    assert 0.002 <= s.mean_kld()[0] <= 0.0065
    assert s.same_top()[0] >= 0.92


SMOL_Q41_BASE = Path(__file__).parent / "references" / "smollm2-q41-tempest-c128x3.kld.xz"


@pytest.mark.slow
def test_kld_smollm2_q8_against_llama_cpp_same_file(tmp_path: Path, default_model: Path) -> None:
    """llama.cpp's logits for the SAME Q4_1 file (references/README.md says how they were made:
    llama-perplexity, c128 x 3 chunks, its default f16 cache, an AVX-512 build). With 8-bit
    activations any 1-ulp difference flips roundings downstream (llama.cpp -ub 1 against its own
    -ub 512 run: 0.0050, same top 95.2 %), so this is near 0 only when every op is bit-equal to
    that build's: the q8 path with the avx512 kernel library, f16 cache (the default), measured
    0.000000 / 100 % (0.0051 before the x86 quantizer, ggml's sum order, RMS norm and the tiled
    flash attention of 2026-12-02; 0.0050 with an f32 cache). The avx2 and portable libraries follow
    an AVX2 build of llama.cpp (its SIMD exp, 8-lane sums), which this AVX-512 base is not: for
    them only the q8 noise level is checked."""
    from llamapy.backend import native

    base = tmp_path / "smol-q41.kld"
    base.write_bytes(lzma.decompress(SMOL_Q41_BASE.read_bytes()))
    s = kld_against(default_model, base, 2048, 512)
    if native.variant() == "avx512":
        assert s.mean_kld()[0] <= 0.0005
        assert s.same_top()[0] >= 0.98
    else:
        assert s.mean_kld()[0] <= 0.0065
        assert s.same_top()[0] >= 0.93


TINY32_SAME_BASE = Path(__file__).parent / "references" / "tiny32-q4km-tempest-c128x1.kld.xz"


@pytest.mark.slow
def test_kld_tiny32_q8_against_llama_cpp_same_file(tmp_path: Path) -> None:
    """llama.cpp's logits for the SAME tiny32 Q4_K_M file (Q4_K, Q6_K; references/README.md:
    llama-perplexity c128 x 1 chunk, f16 cache, on the Intel AVX-512 host) — the K types' issue 11
    bar. Near 0 only when every op is that build's bit for bit, the K types included: Q4_K in the
    repacked q4_K_8x8 gemm's order, Q6_K in the tiled microtile's (kernels_c/kquants.c); measured
    0.000000 / 100 % (0.0045 / 95 % before, as llama.cpp -ub 1 against its own -ub 512). Only the
    avx512 library follows that build in every op (the SIMD exp of SwiGLU and attention); the
    others are held to the q8 noise level. (../shared/reference's tiny32 base is from another
    llama.cpp build: this host's llama.cpp itself is 0.0045 from it, and llamapy the same.)"""
    from llamapy.backend import native

    base = tmp_path / "tiny32-same.kld"
    base.write_bytes(lzma.decompress(TINY32_SAME_BASE.read_bytes()))
    s = kld_against(TINY32, base, 2048, 512)
    if native.variant() == "avx512":
        assert s.mean_kld()[0] <= 0.0005
        assert s.same_top()[0] >= 0.98
    else:
        assert s.mean_kld()[0] <= 0.01
        assert s.same_top()[0] >= 0.88


# -- the files llamapy writes ------------------------------------------------------------------


def _run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from llamapy.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_written_base_matches_llama_cpp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny32.kld"
    code, stdout, stderr = _run_cli(
        [
            "perplexity", str(TINY32), "-f", str(TEXT / "tempest.txt"), "-c", "128", "--chunks", "2",
            "--kl-divergence-base", str(out), "--f32-activations",
        ],
        capsys,
    )  # fmt: skip
    assert code == 0, stderr
    assert "calculating perplexity over 2 chunks, n_ctx=128, batch_size=2048, n_seq=16" in stderr
    assert re.search(r"^\[1\][0-9.]+,\[2\][0-9.]+,$", stdout, re.M), stdout
    assert re.search(r"^Final estimate: PPL = [0-9.]+ \+/- [0-9.]+$", stdout, re.M), stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny32.kld"]  # no .partial left
    ref_bytes = TINY32_BASE.read_bytes()
    ours = out.read_bytes()
    assert len(ours) == len(ref_bytes)
    assert ours[:1044] == ref_bytes[:1044]  # header and the 2 x 128 tokens

    # our file, read back, against llama.cpp's: the same statistics as the direct comparison
    ref = read_logits_file(TINY32_BASE)
    mine = read_logits_file(out)
    back = KLDivergence()
    first = ref.n_ctx // 2
    for i in range(ref.n_chunk):
        targets = ref.tokens[i * ref.n_ctx + first + 1 : (i + 1) * ref.n_ctx]
        back.add(mine.chunk_log_probs(i), ref.chunk_log_probs(i), targets, normalized=True)
    # both in the f32 mode: in the q8 mode float-order differences (threads) change roundings
    direct = kld_against(TINY32, TINY32_BASE, cpu_matmul="f32")
    assert back.count == direct.count
    assert back.mean_kld()[0] == pytest.approx(direct.mean_kld()[0], abs=2e-5)
    assert abs(back.n_same_top - direct.n_same_top) <= 1
    assert back.log_ppl_base() == direct.log_ppl_base()  # the same base, the same figures
    assert back.p_diff_rms()[0] == pytest.approx(direct.p_diff_rms()[0], abs=1e-3)


def test_cli_kl_divergence_block(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _run_cli(
        ["perplexity", str(TINY32), "--kl-divergence-base", str(TINY32_BASE), "--kl-divergence", "-b", "128", "-ub", "32",
         "--f32-activations"],
        capsys,
    )
    assert code == 0, stderr
    for label in ("Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Maximum KLD", "Median  KLD", "Same top p:"):
        assert label in stdout, label
    kld = float(re.search(r"^Mean    KLD: +(-?[0-9.]+) ±", stdout, re.M).group(1))  # type: ignore[union-attr]
    same = float(re.search(r"^Same top p: +([0-9.]+) ±", stdout, re.M).group(1))  # type: ignore[union-attr]
    assert kld <= 0.002 and same >= 88.0


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content,message",
    [
        (b"To be, or not to be.", "need at least 256 tokens"),
        (b"", "empty"),
        (b"caf\xe9 au lait " * 100, "not valid UTF-8"),
    ],
    ids=["too-short", "empty", "latin-1"],
)
def test_cli_bad_text(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str) -> None:
    f = tmp_path / "text.txt"
    f.write_bytes(content)
    out = tmp_path / "out.kld"
    code, _, stderr = _run_cli(
        ["perplexity", str(TINY32), "-f", str(f), "-c", "128", "--kl-divergence-base", str(out)], capsys
    )
    assert code == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, stderr
    assert list(tmp_path.iterdir()) == [f]  # no logits file, complete or partial


def test_cli_vocab_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = _run_cli(["perplexity", str(TINY32), "--kl-divergence-base", str(SMOL_BASE), "--kl-divergence"], capsys)
    assert code == 1 and "vocabulary" in stderr.strip().splitlines()[-1]
    code, _, stderr = _run_cli(["perplexity", str(TINY32), "--kl-divergence"], capsys)
    assert code == 1 and "--kl-divergence-base" in stderr


# -- perplexity against llama.cpp's table (slow) ------------------------------------------------


def _rows() -> list[dict]:
    path = REF / "smollm2" / "perplexity.json"
    return json.loads(path.read_text())["runs"] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"{Path(r['text']).stem}-c{r['ctx']}x{r['chunks']}")
@pytest.mark.parametrize(("cpu_matmul", "col", "rel"), [("f32", "f32", 0.003), ("q8", "q41", 0.01)])
def test_perplexity_table(row: dict, cpu_matmul: str, col: str, rel: float, default_model: Path) -> None:
    """Float32 activations against llama.cpp's run of the exactly dequantized F32 weights (0.3 %);
    the default 8-bit activations against its run of the Q4_1 file itself, within llama.cpp's own
    spread: any change of summation order flips some activation roundings, and over a few hundred
    scored tokens that moves the PPL. llama-perplexity on tempest -c 128 x3 (192 tokens scored),
    -t 2, AMD EPYC AVX-512, 2026-12-02: -ub 512 30.9135, -ub 1 30.9383, -fa off -ctk f32 -ctv f32
    31.0609; the shared table's Q4_1 run (Intel host) 30.9952; llamapy 30.7360. The mean KLD
    against llama.cpp's logits (test_kld_*) is the finer check of the same numerics."""
    n_ctx = row["ctx"]
    n_seq, n_kv, n_batch = plan_context(n_ctx, 2048)
    co = ContextOptions(n_ctx=n_kv, n_batch=n_batch, n_ubatch=512, cpu_matmul=cpu_matmul)
    with Llama(default_model, context_options=co) as llm:
        tokens = llm.tokenize((SHARED / row["text"]).read_text(encoding="utf-8"))
        est: PerplexityEstimate | None = None
        for _, est in evaluate_perplexity(llm.ctx, tokens, n_ctx, row["chunks"], n_batch):
            pass
    assert est is not None and len(est.history) == row["chunks"]
    print(f"{row['text']} c{n_ctx}x{row['chunks']} {cpu_matmul}: PPL {est.ppl:.4f} +/- {est.error:.5f} "
          f"(llama.cpp {col} {row[col]})")  # fmt: skip
    assert est.ppl == pytest.approx(row[col], rel=rel)
    if f"{col}_err" in row:
        assert est.error == pytest.approx(row[f"{col}_err"], rel=0.02)
    assert np.isfinite(est.error)
