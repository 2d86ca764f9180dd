"""llama-perplexity's numbers and files (llama.cpp's tools/perplexity/perplexity.cpp): the
running perplexity estimate and its uncertainty, the `--kl-divergence-base` logits file, and the
`--kl-divergence` statistics.

The logits file, byte for byte as llama.cpp writes and reads it (little-endian, no padding)::

    char    magic[8]  = "_logits_"
    int32   n_ctx, n_vocab, n_chunk
    int32   tokens[n_chunk * n_ctx]            # the text's tokens, before any BOS overwrite
    then, chunk after chunk, for each of its n_ctx - 1 - n_ctx/2 scored positions, one row of
    nv = 2*((n_vocab + 1)/2) + 4 uint16:
        float32 scale, float32 min_log_prob    # in the first four uint16
        uint16  code[n_vocab] (+ one zero pad when n_vocab is odd)
    log_prob[i] = scale * code[i] + min_log_prob; log-probs more than 16 below the top are code 0.

Everything here is numpy and pure: nothing prints. `evaluate_perplexity` and
`evaluate_kl_divergence` drive `generate.perplexity_chunks` and yield per-chunk results; the CLI
turns them into llama-perplexity's output with `format_*`.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .generate import PerplexityChunk, perplexity_chunks
from .types import LlamapyError

MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 3 * 4
KLD_MIN_LOG_PROB = np.float32(-16.0)  # base log-probs at or below this are left out of the KLD


def n_scored(n_ctx: int) -> int:
    """Positions scored per chunk: those after n_ctx/2, less the last (it predicts nothing)."""
    return n_ctx - 1 - n_ctx // 2


def row_len(n_vocab: int) -> int:
    """uint16 per scored position in the logits file."""
    return 2 * ((n_vocab + 1) // 2) + 4


def plan_context(n_ctx: int, n_batch: int) -> tuple[int, int, int]:
    """llama-perplexity's main(): (n_seq, context size, n_batch) for chunks of `n_ctx` tokens.

    `n_batch // n_ctx` chunks are evaluated at once as separate sequences, so the context holds
    n_seq * n_ctx cells, and the batch is capped by that.
    """
    if n_scored(n_ctx) < 1:
        # positions after n_ctx/2, less the last, are scored: -c 1 and -c 2 score none
        raise LlamapyError(f"-c {n_ctx}: perplexity needs a context of at least 3 tokens (it scores those after n_ctx/2)")
    if n_batch <= 0:
        raise LlamapyError(f"-b {n_batch}: the batch size must be positive")
    n_seq = max(1, n_batch // n_ctx)
    n_kv = n_seq * n_ctx
    return n_seq, n_kv, min(n_batch, n_kv)


# -- quantized log-probabilities ---------------------------------------------------------------


def _rows_f32(logits: np.ndarray) -> np.ndarray:
    lg = np.ascontiguousarray(logits, dtype=np.float32)
    if lg.ndim != 2 or lg.shape[1] == 0:
        raise LlamapyError(f"expected logits of shape (n_tokens, n_vocab), got {lg.shape}")
    return lg


def _max_and_log_sum_exp(lg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: max logit and log(sum(exp(logit - max))) rounded to float32, as llama.cpp has them
    (expf terms summed in double)."""
    mx = lg.max(axis=1)
    sum_exp = np.exp(lg - mx[:, None]).sum(axis=1, dtype=np.float64)
    return mx, np.log(sum_exp).astype(np.float32)


def encode_log_probs(logits: np.ndarray) -> np.ndarray:
    """(n, n_vocab) logits -> (n, row_len(n_vocab)) uint16 rows of the logits file."""
    lg = _rows_f32(logits)
    n, n_vocab = lg.shape
    mx, lse = _max_and_log_sum_exp(lg)
    mn = np.maximum(lg.min(axis=1), mx - np.float32(16))
    min_log_prob = (mn - mx) - lse
    scale = (mx - mn) / np.float32(65535)
    rows = np.zeros((n, row_len(n_vocab)), np.uint16)
    head = np.empty((n, 2), np.float32)
    head[:, 0] = scale
    head[:, 1] = min_log_prob
    rows[:, :4] = head.astype("<f4").view(np.uint16)
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    q = np.rint(inv[:, None] * (lg - mn[:, None]))  # round half to even, as nearest_int()
    q = np.where(lg > mn[:, None], np.clip(q, 0, 65535), 0)
    rows[:, 4 : 4 + n_vocab] = q.astype(np.uint16)
    return rows


def decode_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """(n, row_len) uint16 rows -> (n, n_vocab) float32 log-probabilities."""
    r = np.ascontiguousarray(rows, dtype=np.uint16)
    head = r[:, :4].copy().view("<f4").astype(np.float32)
    scale, min_log_prob = head[:, 0], head[:, 1]
    return scale[:, None] * r[:, 4 : 4 + n_vocab].astype(np.float32) + min_log_prob[:, None]


# -- the logits file ---------------------------------------------------------------------------


def _io_error(path: Path, e: OSError, doing: str) -> LlamapyError:
    why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return LlamapyError(f"{path}: cannot {doing} ({why})")


class LogitsWriter:
    """Streams a `--kl-divergence-base` file chunk by chunk.

    Writes to `PATH.partial`, flushing after every chunk, and renames it to PATH only when all
    `n_chunk` chunks are in (`close()`); any failure removes the partial file, so a file named
    PATH is always complete. OSErrors (a full disk…) become LlamapyError.
    """

    def __init__(
        self, path: str | os.PathLike[str], n_ctx: int, n_vocab: int, n_chunk: int, tokens: Sequence[int] | np.ndarray
    ) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.n_ctx, self.n_vocab, self.n_chunk = int(n_ctx), int(n_vocab), int(n_chunk)
        toks = np.asarray(tokens, np.int64)
        if self.n_ctx <= 1 or self.n_vocab <= 0 or self.n_chunk <= 0:
            raise LlamapyError(f"logits file: bad shape n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk}")
        if len(toks) < self.n_chunk * self.n_ctx:
            raise LlamapyError(f"logits file: {len(toks)} tokens, need {self.n_chunk * self.n_ctx}")
        self.chunks_written = 0
        self._f: BinaryIO | None = None
        try:
            self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
            head = np.array([self.n_ctx, self.n_vocab, self.n_chunk], "<i4").tobytes()
            self._f.write(MAGIC + head)
            self._f.write(toks[: self.n_chunk * self.n_ctx].astype("<i4").tobytes())
            self._f.flush()
        except OSError as e:
            self.abort()
            raise _io_error(self.tmp, e, "write the logits file") from None

    def write_chunk(self, logits: np.ndarray) -> None:
        """Append one chunk: the logits of its n_ctx - 1 - n_ctx/2 scored positions."""
        if self._f is None:
            raise LlamapyError(f"{self.tmp}: the logits file is closed")
        lg = _rows_f32(logits)
        if lg.shape != (n_scored(self.n_ctx), self.n_vocab):
            raise LlamapyError(f"logits file: chunk of shape {lg.shape}, expected ({n_scored(self.n_ctx)}, {self.n_vocab})")
        if self.chunks_written >= self.n_chunk:
            raise LlamapyError(f"logits file: more than the {self.n_chunk} chunks announced")
        rows = encode_log_probs(lg)
        try:
            self._f.write(rows.astype("<u2").tobytes())
            self._f.flush()
        except OSError as e:
            self.abort()
            raise _io_error(self.tmp, e, "write the logits file") from None
        self.chunks_written += 1

    def close(self) -> None:
        """Finish: every chunk written -> fsync and rename to the final name."""
        if self._f is None:
            return
        if self.chunks_written != self.n_chunk:
            self.abort()
            raise LlamapyError(f"{self.path}: only {self.chunks_written} of {self.n_chunk} chunks were written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise _io_error(self.path, e, "write the logits file") from None

    def abort(self) -> None:
        """Drop the partial file (idempotent)."""
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
        try:
            self.tmp.unlink()
        except OSError:
            pass

    def __enter__(self) -> LogitsWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def file_size(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    return HEADER_BYTES + 4 * n_chunk * n_ctx + 2 * n_chunk * n_scored(n_ctx) * row_len(n_vocab)


@dataclass
class LogitsFile:
    """A `--kl-divergence-base` file, header and tokens read; chunks read on demand."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # int32, n_chunk * n_ctx

    @property
    def data_offset(self) -> int:
        return HEADER_BYTES + 4 * self.n_chunk * self.n_ctx

    def chunk_rows(self, i: int) -> np.ndarray:
        """The (n_scored, row_len) uint16 rows of chunk `i`."""
        if not 0 <= i < self.n_chunk:
            raise LlamapyError(f"{self.path}: no chunk {i} (the file has {self.n_chunk})")
        n, nv = n_scored(self.n_ctx), row_len(self.n_vocab)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_offset + 2 * i * n * nv)
                buf = f.read(2 * n * nv)
        except OSError as e:
            raise _io_error(self.path, e, "read the logits file") from None
        if len(buf) != 2 * n * nv:
            raise LlamapyError(f"{self.path}: truncated at chunk {i + 1} of {self.n_chunk}")
        return np.frombuffer(buf, "<u2").reshape(n, nv).astype(np.uint16)

    def chunk_log_probs(self, i: int) -> np.ndarray:
        return decode_log_probs(self.chunk_rows(i), self.n_vocab)


def read_logits_file(path: str | os.PathLike[str]) -> LogitsFile:
    """Open and check a logits file (llama.cpp's or ours)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) < HEADER_BYTES or head[:8] != MAGIC:
                raise LlamapyError(f"{p}: does not look like a file of log-probabilities (no '_logits_' header)")
            n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(head[8:], "<i4"))
            if n_ctx < 2 or n_vocab <= 0 or n_chunk <= 0:
                raise LlamapyError(f"{p}: bad header (n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk})")
            want = file_size(n_ctx, n_vocab, n_chunk)
            if size != want:
                what = "truncated" if size < want else "has trailing bytes"
                raise LlamapyError(
                    f"{p}: {what}: {size} bytes, expected {want} for n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}"
                )
            tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), "<i4").astype(np.int32)
    except FileNotFoundError:
        raise LlamapyError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise LlamapyError(f"{p}: is a directory") from None
    except OSError as e:
        raise _io_error(p, e, "read the logits file") from None
    if tokens.size and (tokens.min() < 0 or tokens.max() >= n_vocab):
        raise LlamapyError(f"{p}: token ids outside the vocabulary of {n_vocab}")
    return LogitsFile(p, n_ctx, n_vocab, n_chunk, tokens)


# -- perplexity --------------------------------------------------------------------------------


@dataclass
class PerplexityEstimate:
    """The running sums of llama-perplexity: PPL = exp(mean nll), error = PPL * stderr(nll)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    history: list[float] = field(default_factory=list)  # PPL after each chunk

    def add(self, nll: np.ndarray) -> float:
        v = np.asarray(nll, np.float64)
        self.nll += float(v.sum())
        self.nll2 += float((v * v).sum())
        self.count += len(v)
        self.history.append(self.ppl)
        return self.ppl

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count) if self.count else float("nan")

    @property
    def error(self) -> float:
        """PPL * sqrt(var(nll) / (count - 1)); nan when undefined (llama.cpp prints an error)."""
        if self.count < 2:
            return float("nan")
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return float("nan") if var <= 0 else math.sqrt(var / (self.count - 1)) * math.exp(mean)


def format_running(history: Sequence[float], start: int = 1) -> str:
    """`[1]21.4758,[2]25.8732,…`"""
    return "".join(f"[{start + k}]{v:.4f}," for k, v in enumerate(history))


def format_final(est: PerplexityEstimate) -> str:
    err = est.error
    if math.isnan(err):
        raise LlamapyError("unexpected negative standard deviation of log(prob)")
    return f"Final estimate: PPL = {est.ppl:.4f} +/- {err:.5f}"


# -- KL divergence -----------------------------------------------------------------------------


def _mean_and_uncertainty(s: float, s2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    df = math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0
    return f, df


def _covariance(sa: float, sb: float, sab: float, count: int) -> float:
    return 0.0 if count < 10 else (sab / count - (sa / count) * (sb / count)) / (count - 1)


def _percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's linear interpolation on sorted float32 values, in float32."""
    f = np.float32(fraction)
    if f <= 0:
        return float(values[0])
    if f >= 1:
        return float(values[-1])
    p = f * np.float32(len(values) - 1)
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def _median(values: np.ndarray) -> float:
    n = len(values)
    if n % 2 == 0:
        return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1]))
    return float(values[n // 2])


@dataclass
class KLDivergence:
    """Per-token comparison with a base model's log-probs, summed as llama.cpp's
    `kl_divergence_result`: KLD_t = sum over i with log p_base_i > -16 of
    p_base_i * (log p_base_i - log softmax(logits)_i), where p_base is the dequantized base
    distribution (not renormalized); Δp = p(target) - p_base(target); same top = equal argmax."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(
        self,
        logits: np.ndarray,
        base_log_probs: np.ndarray,
        targets: Sequence[int] | np.ndarray,
        normalized: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One chunk: `logits` (n, n_vocab) of the model under test, `base_log_probs` (n, n_vocab)
        float32 (decode_log_probs of the file's rows), `targets` the n next tokens.
        `normalized`: `logits` are log-probabilities already (e.g. another logits file decoded,
        whose clipped tail must not be renormalized away) and are used as they are.
        Returns the per-token KLD and Δp (float32)."""
        lg = _rows_f32(logits)
        base = np.ascontiguousarray(base_log_probs, np.float32)
        t = np.asarray(targets, np.int64)
        n = len(lg)
        if base.shape != lg.shape or t.shape != (n,):
            raise LlamapyError(f"KL divergence: logits {lg.shape}, base {base.shape}, targets {t.shape} disagree")
        rows = np.arange(n)
        imax = lg.argmax(axis=1)  # first maximum, as llama.cpp's strict '>'
        if normalized:
            mx, lse = np.zeros(n, np.float32), np.zeros(n, np.float32)
        else:
            mx, lse = _max_and_log_sum_exp(lg)
        nll = (mx + lse) - lg[rows, t]  # float32
        nll_base = -base[rows, t]
        top = mx + lse
        keep = base > KLD_MIN_LOG_PROB
        terms = np.exp(base) * ((base - lg) + top[:, None])
        kld = np.where(keep, terms, np.float32(0)).sum(axis=1, dtype=np.float64)
        imax_base = base.argmax(axis=1)
        p_diff = np.exp(-nll) - np.exp(-nll_base)  # float32
        p_diff2 = (p_diff * p_diff).astype(np.float64)

        n64, nb64 = nll.astype(np.float64), nll_base.astype(np.float64)
        self.sum_nll += float(n64.sum())
        self.sum_nll2 += float((nll * nll).astype(np.float64).sum())
        self.sum_nll_base += float(nb64.sum())
        self.sum_nll_base2 += float((nll_base * nll_base).astype(np.float64).sum())
        self.sum_nll_nll_base += float((nll * nll_base).astype(np.float64).sum())
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float((kld * kld).sum())
        self.sum_p_diff += float(p_diff.astype(np.float64).sum())
        self.sum_p_diff2 += float(p_diff2.sum())
        self.sum_p_diff4 += float((p_diff2 * p_diff2).sum())
        if n:
            self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()))
        self.n_same_top += int((imax == imax_base).sum())
        self.count += n
        k32 = kld.astype(np.float32)
        self.kld_values.append(k32)
        self.p_diff_values.append(p_diff.astype(np.float32))
        return k32, p_diff.astype(np.float32)

    # -- derived values -----------------------------------------------------------------------

    def log_ppl(self) -> tuple[float, float]:
        return _mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)

    def log_ppl_base(self) -> tuple[float, float]:
        return _mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)

    def log_ppl_cov(self) -> float:
        return _covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count)

    def log_ppl_ratio(self) -> tuple[float, float]:
        (a, da), (b, db) = self.log_ppl(), self.log_ppl_base()
        v = da * da + db * db - 2.0 * self.log_ppl_cov()
        return a - b, math.sqrt(v) if v > 0 else 0.0

    def mean_kld(self) -> tuple[float, float]:
        return _mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)

    def p_diff_rms(self) -> tuple[float, float]:
        mse, dmse = _mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, (0.5 / rms * dmse if rms > 0 else 0.0)

    def same_top(self) -> tuple[float, float]:
        if not self.count:
            return 0.0, 0.0
        p = self.n_same_top / self.count
        return p, (math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0)

    def summary(self) -> KLDSummary:
        """Every figure of llama.cpp's final statistics block."""
        kv = np.sort(np.concatenate(self.kld_values)) if self.kld_values else np.zeros(0, np.float32)
        pv = np.sort(np.concatenate(self.p_diff_values)) if self.p_diff_values else np.zeros(0, np.float32)
        lp, dlp = self.log_ppl()
        lb, dlb = self.log_ppl_base()
        cov = self.log_ppl_cov()
        ppl, ppl_base = math.exp(lp), math.exp(lb)
        ratio, dratio = self.log_ppl_ratio()
        diff_v = (ppl * dlp) ** 2 + (ppl_base * dlb) ** 2 - 2.0 * ppl * ppl_base * cov
        cor = cov / (dlp * dlb) if dlp * dlb != 0 else float("nan")
        pd_mean, dpd_mean = _mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count)
        kld_pct = {f: _percentile(kv, f) for f in (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001)} if len(kv) else {}
        pd_pct = (
            {f: _percentile(pv, f) for f in (0.999, 0.99, 0.95, 0.9, 0.75, 0.25, 0.1, 0.05, 0.01, 0.001)} if len(pv) else {}
        )
        return KLDSummary(
            count=self.count,
            ppl=(ppl, ppl * dlp),
            ppl_base=(ppl_base, ppl_base * dlb),
            cor=cor,
            log_ppl_ratio=(ratio, dratio),
            ppl_ratio=(math.exp(ratio), math.exp(ratio) * dratio),
            ppl_diff=(ppl - ppl_base, math.sqrt(diff_v) if diff_v > 0 else 0.0),
            kld=self.mean_kld(),
            kld_max=float(kv[-1]) if len(kv) else 0.0,
            kld_min=float(kv[0]) if len(kv) else 0.0,
            kld_median=_median(kv) if len(kv) else 0.0,
            kld_percentiles=kld_pct,
            p_diff=(pd_mean, dpd_mean),
            p_diff_max=float(pv[-1]) if len(pv) else 0.0,
            p_diff_min=float(pv[0]) if len(pv) else 0.0,
            p_diff_median=_median(pv) if len(pv) else 0.0,
            p_diff_percentiles=pd_pct,
            p_diff_rms=self.p_diff_rms(),
            same_top=self.same_top(),
        )

    def chunk_row(self, chunk_number: int) -> str:
        """The per-chunk line of llama.cpp's table (running figures)."""
        lp, dlp = self.log_ppl()
        ppl = math.exp(lp)
        r, dr = self.log_ppl_ratio()
        k, dk = self.mean_kld()
        k = shown_kld(k)
        rms, drms = self.p_diff_rms()
        st, dst = self.same_top()
        return (
            f"{chunk_number:4d}    {ppl:9.4f} ± {ppl * dlp:9.4f}    {r:10.5f} ± {dr:10.5f}"
            f"    {k:10.5f} ± {dk:10.5f}    {100 * rms:6.3f} ± {100 * drms:6.3f} %"
            f"    {100 * st:6.3f} ± {100 * dst:6.3f} %"
        )


KLD_TABLE_HEADER = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
)


@dataclass
class KLDSummary:
    count: int
    ppl: tuple[float, float]
    ppl_base: tuple[float, float]
    cor: float
    log_ppl_ratio: tuple[float, float]
    ppl_ratio: tuple[float, float]
    ppl_diff: tuple[float, float]
    kld: tuple[float, float]
    kld_max: float
    kld_min: float
    kld_median: float
    kld_percentiles: dict[float, float]
    p_diff: tuple[float, float]
    p_diff_max: float
    p_diff_min: float
    p_diff_median: float
    p_diff_percentiles: dict[float, float]
    p_diff_rms: tuple[float, float]
    same_top: tuple[float, float]


def shown_kld(value: float) -> float:
    """A KLD as printed: never below 0. A KL divergence is >= 0; a slightly negative sum comes
    from the base's 16-bit log-probabilities (not renormalised), and llama.cpp prints it as
    it is (`-0.000001`). The statistics keep the raw sums; only the printed figure is clamped."""
    return value if value > 0 else 0.0


def _pct_label(f: float) -> str:
    return f"{100 * f:4.1f}%"


def format_kld_summary(s: KLDSummary) -> list[str]:
    """llama.cpp's three statistics blocks (it prints them only from 100 tokens on)."""
    out = ["====== Perplexity statistics ======"]
    out.append(f"Mean PPL(Q)                   : {s.ppl[0]:10.6f} ± {s.ppl[1]:10.6f}")
    out.append(f"Mean PPL(base)                : {s.ppl_base[0]:10.6f} ± {s.ppl_base[1]:10.6f}")
    out.append(f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.cor:6.2f}%")
    out.append(f"Mean ln(PPL(Q)/PPL(base))     : {s.log_ppl_ratio[0]:10.6f} ± {s.log_ppl_ratio[1]:10.6f}")
    out.append(f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio[0]:10.6f} ± {s.ppl_ratio[1]:10.6f}")
    out.append(f"Mean PPL(Q)-PPL(base)         : {s.ppl_diff[0]:10.6f} ± {s.ppl_diff[1]:10.6f}")
    out.append("")
    out.append("====== KL divergence statistics ======")
    out.append(f"Mean    KLD: {shown_kld(s.kld[0]):10.6f} ± {s.kld[1]:10.6f}")
    kp = {f: shown_kld(v) for f, v in s.kld_percentiles.items()}
    out.append(f"Maximum KLD: {shown_kld(s.kld_max):10.6f}")
    for f in (0.999, 0.99, 0.95, 0.9):
        out.append(f"{_pct_label(f)}   KLD: {kp[f]:10.6f}")
    out.append(f"Median  KLD: {shown_kld(s.kld_median):10.6f}")
    for f in (0.1, 0.05, 0.01, 0.001):
        out.append(f"{_pct_label(f)}   KLD: {kp[f]:10.6f}")
    out.append(f"Minimum KLD: {shown_kld(s.kld_min):10.6f}")
    out.append("")
    out.append("====== Token probability statistics ======")
    out.append(f"Mean    Δp: {100 * s.p_diff[0]:6.3f} ± {100 * s.p_diff[1]:5.3f} %")
    pp = s.p_diff_percentiles
    out.append(f"Maximum Δp: {100 * s.p_diff_max:6.3f}%")
    for f in (0.999, 0.99, 0.95, 0.9, 0.75):
        out.append(f"{_pct_label(f)}   Δp: {100 * pp[f]:6.3f}%")
    out.append(f"Median  Δp: {100 * s.p_diff_median:6.3f}%")
    for f in (0.25, 0.1, 0.05, 0.01, 0.001):
        out.append(f"{_pct_label(f)}   Δp: {100 * pp[f]:6.3f}%")
    out.append(f"Minimum Δp: {100 * s.p_diff_min:6.3f}%")
    out.append(f"RMS Δp    : {100 * s.p_diff_rms[0]:6.3f} ± {100 * s.p_diff_rms[1]:5.3f} %")
    out.append(f"Same top p: {100 * s.same_top[0]:6.3f} ± {100 * s.same_top[1]:5.3f} %")
    return out


# -- driving a context -------------------------------------------------------------------------


def count_chunks(n_tokens: int, n_ctx: int, n_chunks: int = -1) -> int:
    """Chunks llama-perplexity evaluates: all whole ones, or at most `n_chunks`; needs 2."""
    if n_tokens < 2 * n_ctx:
        raise LlamapyError(
            f"need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}, "
            f"the text has {n_tokens}"
        )
    n_max = n_tokens // n_ctx
    return n_max if n_chunks < 0 else min(n_chunks, n_max)


def evaluate_perplexity(
    ctx: Any,
    tokens: Sequence[int] | np.ndarray,
    n_ctx: int,
    n_chunks: int = -1,
    n_batch: int | None = None,
    logits_file: str | os.PathLike[str] | None = None,
) -> Iterator[tuple[PerplexityChunk, PerplexityEstimate]]:
    """llama-perplexity: yield (chunk, running estimate) per chunk. With `logits_file`, also
    write the `--kl-divergence-base` file (complete only once the generator is exhausted)."""
    toks = np.asarray(tokens, np.int32)
    if n_chunks == 0:
        raise LlamapyError("--chunks 0: nothing to evaluate")
    n_chunk = count_chunks(len(toks), n_ctx, n_chunks)
    if n_chunk <= 0:
        raise LlamapyError("no chunk to evaluate")
    est = PerplexityEstimate()
    writer = LogitsWriter(logits_file, n_ctx, ctx.model.params.n_vocab, n_chunk, toks) if logits_file else None
    try:
        for ch in perplexity_chunks(ctx, toks, n_chunk, n_batch, n_ctx=n_ctx):
            if writer is not None:
                writer.write_chunk(ch.logits)
            est.add(ch.nll)
            yield ch, est
        if writer is not None:
            writer.close()
    finally:
        if writer is not None:
            writer.abort()  # no-op after close(); drops the partial file on errors and Ctrl-C


def evaluate_kl_divergence(
    ctx: Any, base: LogitsFile, n_batch: int | None = None, n_chunks: int = -1
) -> Iterator[tuple[PerplexityChunk, KLDivergence]]:
    """llama-perplexity --kl-divergence: evaluate the file's tokens (its n_ctx, its chunks) and
    compare with its log-probs; yield (chunk, running statistics) per chunk."""
    n_vocab = ctx.model.params.n_vocab
    if base.n_vocab != n_vocab:
        raise LlamapyError(f"{base.path}: inconsistent vocabulary: the file has {base.n_vocab} tokens, the model {n_vocab}")
    n_chunk = base.n_chunk if n_chunks < 0 else min(n_chunks, base.n_chunk)
    if n_chunk <= 0:
        raise LlamapyError("--chunks 0: nothing to evaluate")
    toks = base.tokens[: n_chunk * base.n_ctx]
    if n_chunk == 1:  # perplexity_chunks wants two chunks of text; the copy is never evaluated
        toks = np.concatenate([toks, toks])
    stats = KLDivergence()
    first = base.n_ctx // 2
    for ch in perplexity_chunks(ctx, toks, n_chunk, n_batch, n_ctx=base.n_ctx):
        stats.add(ch.logits, base.chunk_log_probs(ch.index), ch.tokens[first + 1 :])
        yield ch, stats
