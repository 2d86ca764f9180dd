"""llama-perplexity's logits file and statistics (llamapy/perplexity.py) on synthetic data:
byte layout, round trip, the partial-file guarantee, and the KLD / PPL figures against a direct
float64 computation."""

from __future__ import annotations

import errno
import math
import struct

import numpy as np
import pytest

from llamapy.perplexity import (
    HEADER_BYTES,
    KLDivergence,
    LogitsWriter,
    PerplexityEstimate,
    decode_log_probs,
    encode_log_probs,
    file_size,
    format_final,
    format_kld_summary,
    format_running,
    n_scored,
    plan_context,
    read_logits_file,
    row_len,
)
from llamapy.types import LlamapyError


def _logits(rng: np.random.Generator, n: int, n_vocab: int, spread: float = 6.0) -> np.ndarray:
    return (rng.standard_normal((n, n_vocab)) * spread).astype(np.float32)


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def test_sizes_and_plan() -> None:
    assert n_scored(128) == 63 and n_scored(512) == 255 and n_scored(7) == 3
    assert row_len(32000) == 32004 and row_len(49152) == 49156 and row_len(1001) == 1006
    assert file_size(128, 32000, 2) == 8066052  # the size of llama.cpp's tiny32 c128x2 file
    assert plan_context(512, 2048) == (4, 2048, 2048)
    assert plan_context(128, 2048) == (16, 2048, 2048)
    assert plan_context(2048, 2048) == (1, 2048, 2048)
    assert plan_context(512, 300) == (1, 512, 300)
    assert plan_context(128, 300) == (2, 256, 256)
    with pytest.raises(LlamapyError):
        plan_context(0, 2048)


@pytest.mark.parametrize("n_vocab", [1001, 1000])
def test_encode_decode(n_vocab: int) -> None:
    rng = np.random.default_rng(n_vocab)
    lg = _logits(rng, 9, n_vocab)
    rows = encode_log_probs(lg)
    assert rows.shape == (9, row_len(n_vocab)) and rows.dtype == np.uint16
    if n_vocab % 2:
        assert (rows[:, -1] == 0).all()  # the pad
    lp = decode_log_probs(rows, n_vocab)
    ref = _log_softmax64(lg)
    head = rows[:, :4].copy().view("<f4")
    scale, min_lp = head[:, 0], head[:, 1]
    top = ref.max(axis=1)
    np.testing.assert_allclose(scale, (lg.max(1) - np.maximum(lg.min(1), lg.max(1) - 16)) / 65535, rtol=1e-6)
    np.testing.assert_allclose(top, lp.max(axis=1), atol=1e-4)
    kept = ref > (top - 16)[:, None] + 1e-3
    err = np.abs(lp - ref)[kept]
    assert err.max() <= scale.max() * 0.5 + 1e-5
    # the clipped tail sits at the floor: min_log_prob
    clipped = ref < (top - 16)[:, None] - 1e-3
    assert clipped.any()
    assert np.allclose(lp[clipped], np.broadcast_to(min_lp[:, None], lp.shape)[clipped])


def test_constant_logits_encode_to_zero_scale() -> None:
    rows = encode_log_probs(np.zeros((2, 10), np.float32))
    head = rows[:, :4].copy().view("<f4")
    assert (head[:, 0] == 0).all()
    np.testing.assert_allclose(head[:, 1], -math.log(10), rtol=1e-6)
    assert (rows[:, 4:] == 0).all()


def test_file_round_trip_and_layout(tmp_path) -> None:
    rng = np.random.default_rng(0)
    n_ctx, n_vocab, n_chunk = 16, 101, 3
    tokens = rng.integers(0, n_vocab, n_ctx * n_chunk + 5).astype(np.int32)
    chunks = [_logits(rng, n_scored(n_ctx), n_vocab) for _ in range(n_chunk)]
    out = tmp_path / "base.kld"
    with LogitsWriter(out, n_ctx, n_vocab, n_chunk, tokens) as w:
        for c in chunks:
            w.write_chunk(c)
            assert not out.exists()  # only the partial file until the end
    assert out.exists() and not (tmp_path / "base.kld.partial").exists()
    data = out.read_bytes()
    assert len(data) == file_size(n_ctx, n_vocab, n_chunk)
    assert data[:8] == b"_logits_"
    assert struct.unpack("<iii", data[8:20]) == (n_ctx, n_vocab, n_chunk)
    assert np.array_equal(np.frombuffer(data[20 : 20 + 4 * n_ctx * n_chunk], "<i4"), tokens[: n_ctx * n_chunk])
    first_row = np.frombuffer(data[HEADER_BYTES + 4 * n_ctx * n_chunk :][: 2 * row_len(n_vocab)], "<u2")
    assert np.array_equal(first_row, encode_log_probs(chunks[0][:1])[0])

    f = read_logits_file(out)
    assert (f.n_ctx, f.n_vocab, f.n_chunk) == (n_ctx, n_vocab, n_chunk)
    assert np.array_equal(f.tokens, tokens[: n_ctx * n_chunk])
    for i, c in enumerate(chunks):
        assert np.array_equal(f.chunk_rows(i), encode_log_probs(c))
        np.testing.assert_allclose(f.chunk_log_probs(i), decode_log_probs(encode_log_probs(c), n_vocab))


def test_failed_write_leaves_no_file(tmp_path) -> None:
    out = tmp_path / "x.kld"
    rng = np.random.default_rng(1)
    # an exception while evaluating
    with pytest.raises(RuntimeError):
        with LogitsWriter(out, 8, 10, 2, np.zeros(16, np.int32)) as w:
            w.write_chunk(_logits(rng, n_scored(8), 10))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    # closing before every announced chunk is in
    w = LogitsWriter(out, 8, 10, 2, np.zeros(16, np.int32))
    w.write_chunk(_logits(rng, n_scored(8), 10))
    with pytest.raises(LlamapyError, match="1 of 2 chunks"):
        w.close()
    assert list(tmp_path.iterdir()) == []

    # a full disk: the write raises ENOSPC
    class Full:
        def __init__(self, f):  # noqa: ANN001
            self.f = f

        def write(self, b: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            pass

        def close(self) -> None:
            self.f.close()

    w = LogitsWriter(out, 8, 10, 2, np.zeros(16, np.int32))
    w._f = Full(w._f)  # type: ignore[assignment]
    with pytest.raises(LlamapyError, match="no space left on device"):
        w.write_chunk(_logits(rng, n_scored(8), 10))
    assert list(tmp_path.iterdir()) == []


def test_reader_rejects_bad_files(tmp_path) -> None:
    with pytest.raises(LlamapyError, match="no such file"):
        read_logits_file(tmp_path / "missing.kld")
    bad = tmp_path / "bad.kld"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(LlamapyError, match="log-probabilities"):
        read_logits_file(bad)
    good = tmp_path / "good.kld"
    rng = np.random.default_rng(2)
    with LogitsWriter(good, 8, 10, 2, np.zeros(16, np.int32)) as w:
        for _ in range(2):
            w.write_chunk(_logits(rng, n_scored(8), 10))
    trunc = tmp_path / "trunc.kld"
    trunc.write_bytes(good.read_bytes()[:-2])
    with pytest.raises(LlamapyError, match="truncated"):
        read_logits_file(trunc)
    with pytest.raises(LlamapyError, match="shape"):
        LogitsWriter(tmp_path / "y.kld", 8, 10, 2, np.zeros(16, np.int32)).write_chunk(np.zeros((2, 10), np.float32))


def _direct_kld(logits: np.ndarray, base_lp: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """llama.cpp's per-token definitions, in float64."""
    q = _log_softmax64(logits)
    b = base_lp.astype(np.float64)
    rows = np.arange(len(targets))
    kld = np.where(b > -16, np.exp(b) * (b - q), 0.0).sum(axis=1)
    nll, nll_base = -q[rows, targets], -b[rows, targets]
    return dict(
        kld=kld,
        nll=nll,
        nll_base=nll_base,
        p_diff=np.exp(-nll) - np.exp(-nll_base),
        same=(logits.argmax(1) == b.argmax(1)),
    )


def test_kld_statistics_match_float64() -> None:
    rng = np.random.default_rng(3)
    n_vocab = 500
    acc = KLDivergence()
    parts = []
    for _ in range(3):  # three chunks of 60 tokens
        base_logits = _logits(rng, 60, n_vocab, 3.0)
        logits = base_logits + rng.standard_normal(base_logits.shape).astype(np.float32) * 0.3
        targets = rng.integers(0, n_vocab, 60)
        base_lp = decode_log_probs(encode_log_probs(base_logits), n_vocab)
        k, pd = acc.add(logits, base_lp, targets)
        d = _direct_kld(logits, base_lp, targets)
        np.testing.assert_allclose(k, d["kld"], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(pd, d["p_diff"], atol=1e-5)
        parts.append(d)
    d = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    n = len(d["kld"])
    s = acc.summary()
    assert s.count == acc.count == n

    def mu(x: np.ndarray) -> tuple[float, float]:
        return x.mean(), math.sqrt((np.mean(x * x) - x.mean() ** 2) / (n - 1))

    m, dm = mu(d["kld"])
    assert s.kld[0] == pytest.approx(m, rel=1e-4) and s.kld[1] == pytest.approx(dm, rel=1e-3)
    ln_q, dln_q = mu(d["nll"])
    ln_b, dln_b = mu(d["nll_base"])
    assert s.ppl[0] == pytest.approx(math.exp(ln_q), rel=1e-5)
    assert s.ppl[1] == pytest.approx(math.exp(ln_q) * dln_q, rel=1e-4)
    assert s.ppl_base[0] == pytest.approx(math.exp(ln_b), rel=1e-5)
    cov = (np.mean(d["nll"] * d["nll_base"]) - ln_q * ln_b) / (n - 1)
    assert s.cor == pytest.approx(cov / (dln_q * dln_b), rel=1e-3)
    assert s.log_ppl_ratio[0] == pytest.approx(ln_q - ln_b, abs=1e-5)
    assert s.log_ppl_ratio[1] == pytest.approx(math.sqrt(dln_q**2 + dln_b**2 - 2 * cov), rel=1e-3)
    assert s.ppl_ratio[0] == pytest.approx(math.exp(ln_q - ln_b), rel=1e-5)
    assert s.ppl_diff[0] == pytest.approx(math.exp(ln_q) - math.exp(ln_b), rel=1e-4)
    assert s.same_top[0] == pytest.approx(d["same"].mean())
    assert s.same_top[1] == pytest.approx(math.sqrt(s.same_top[0] * (1 - s.same_top[0]) / (n - 1)))
    sk = np.sort(d["kld"])
    assert s.kld_max == pytest.approx(sk[-1], rel=1e-4) and s.kld_min == pytest.approx(sk[0], rel=1e-4, abs=1e-7)
    assert s.kld_median == pytest.approx(np.median(sk), rel=1e-4)
    for f in (0.99, 0.9, 0.1, 0.01):  # linear interpolation, numpy's default
        assert s.kld_percentiles[f] == pytest.approx(np.quantile(sk, f), rel=1e-3)
    assert s.p_diff[0] == pytest.approx(d["p_diff"].mean(), abs=1e-6)
    assert s.p_diff_median == pytest.approx(np.median(d["p_diff"]), abs=1e-6)
    rms = math.sqrt(np.mean(d["p_diff"] ** 2))
    assert s.p_diff_rms[0] == pytest.approx(rms, rel=1e-4)
    lines = format_kld_summary(s)
    text = "\n".join(lines)
    for label in (
        "Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))",
        "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)", "Mean    KLD:", "Maximum KLD", "99.9%   KLD",
        "99.0%   KLD", "Median  KLD", "10.0%   KLD", " 5.0%   KLD", " 1.0%   KLD", "Minimum KLD",
        "Mean    Δp:", "RMS Δp    :", "Same top p:",
    ):  # fmt: skip
        assert label in text, label
    assert f"Mean    KLD: {m:10.6f} ± {dm:10.6f}" in lines


def test_kld_of_a_distribution_with_itself_is_about_zero() -> None:
    rng = np.random.default_rng(4)
    lg = _logits(rng, 50, 300)
    acc = KLDivergence()
    acc.add(lg, decode_log_probs(encode_log_probs(lg), 300), rng.integers(0, 300, 50))
    assert abs(acc.mean_kld()[0]) < 5e-5 and acc.same_top()[0] == 1.0


def test_perplexity_estimate() -> None:
    rng = np.random.default_rng(5)
    nlls = [rng.gamma(2.0, 1.7, 63) for _ in range(3)]
    est = PerplexityEstimate()
    for x in nlls:
        est.add(x)
    allv = np.concatenate(nlls)
    n = len(allv)
    ppl = math.exp(allv.mean())
    err = ppl * math.sqrt((np.mean(allv**2) - allv.mean() ** 2) / (n - 1))
    assert est.ppl == pytest.approx(ppl, rel=1e-12) and est.error == pytest.approx(err, rel=1e-9)
    assert est.history[0] == pytest.approx(math.exp(nlls[0].mean()))
    assert format_final(est) == f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}"
    assert format_running([21.47581, 25.87322]) == "[1]21.4758,[2]25.8732,"
    one = PerplexityEstimate()
    one.add(np.array([1.0, 1.0]))
    with pytest.raises(LlamapyError):
        format_final(one)


class _FakeCtx:
    """Just enough of a Context for perplexity_chunks: random logits for the wanted rows."""

    def __init__(self, n_ctx: int, n_batch: int, n_vocab: int) -> None:
        from types import SimpleNamespace

        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.kv = SimpleNamespace(clear=lambda: None)
        tok = SimpleNamespace(add_bos=True, bos=1)
        self.model = SimpleNamespace(tokenizer=tok, params=SimpleNamespace(n_vocab=n_vocab))
        self.rng = np.random.default_rng(7)
        self.calls: list[tuple[int, int]] = []

    def decode(self, tokens, pos, seq, want):  # noqa: ANN001, ANN201
        self.calls.append((len(tokens), int(np.asarray(want).sum())))
        return _logits(self.rng, int(np.asarray(want).sum()), self.model.params.n_vocab)


def test_evaluate_writes_a_complete_file_or_none(tmp_path) -> None:
    from llamapy.perplexity import evaluate_perplexity

    n_ctx, n_vocab = 16, 50
    tokens = np.arange(5 * n_ctx + 3) % n_vocab
    out = tmp_path / "b.kld"
    ctx = _FakeCtx(4 * n_ctx, 4 * n_ctx, n_vocab)  # n_seq = 4: chunks 0-3 in one batch, then 4
    got = list(evaluate_perplexity(ctx, tokens, n_ctx, -1, ctx.n_batch, out))
    assert [c.index for c, _ in got] == [0, 1, 2, 3, 4]
    assert ctx.calls == [(4 * n_ctx, 4 * (n_ctx - n_ctx // 2)), (n_ctx, n_ctx - n_ctx // 2)]
    f = read_logits_file(out)
    assert (f.n_ctx, f.n_vocab, f.n_chunk) == (n_ctx, n_vocab, 5) and np.array_equal(f.tokens, tokens[: 5 * n_ctx])
    est = got[-1][1]
    assert est.count == 5 * n_scored(n_ctx) and len(est.history) == 5
    out.unlink()
    # stopped half-way (Ctrl-C, an error): no file, no partial
    gen = evaluate_perplexity(_FakeCtx(n_ctx, n_ctx, n_vocab), tokens, n_ctx, 3, n_ctx, out)
    next(gen)
    assert (tmp_path / "b.kld.partial").exists()
    gen.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LlamapyError, match="need at least 32 tokens"):
        next(evaluate_perplexity(_FakeCtx(n_ctx, n_ctx, n_vocab), tokens[:20], n_ctx, -1, n_ctx, out))
    assert list(tmp_path.iterdir()) == []
