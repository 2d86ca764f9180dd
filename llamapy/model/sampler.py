"""The token sampler chain (llama.cpp's `common/sampling.cpp` default chain over the samplers of
`src/llama-sampling.cpp`).

The chain, in llama.cpp's default order:

    logit-bias -> penalties -> top-n-sigma -> top-k -> typical -> top-p -> min-p -> xtc ->
    temperature -> dist

or, with `mirostat` 1 or 2 (llama.cpp's chain then has no penalties or filters):

    logit-bias -> temperature -> mirostat (v1 or v2)

Each stage narrows a candidate set (token ids + float32 logits) the way its llama.cpp
counterpart does, with `min_keep = 1` everywhere:
- logit-bias adds each (token, bias) pair's bias to that token's logit (-inf bans it);
- penalties: over the last `repeat_last_n` accepted tokens, a positive logit is divided by
  `repeat_penalty` and a non-positive one multiplied by it; then
  `count * frequency_penalty + presence_penalty` is subtracted;
- top-n-sigma keeps the logits >= max - n * std (their standard deviation; `top_n_sigma <= 0`: off);
- top-k keeps the k largest logits (`top_k <= 0`: off);
- typical keeps the candidates whose surprise -log p is closest to the entropy, in that order,
  until their mass exceeds `typical_p` (`typical_p >= 1`: off);
- top-p keeps the smallest prefix of the sorted candidates whose softmax mass reaches p
  (`top_p >= 1`: off);
- min-p keeps the logits >= max_logit + log(min_p), i.e. p_i >= min_p * p_max (`min_p <= 0`: off);
- xtc ("exclude top choices"), with probability `xtc_probability` a step, drops every candidate
  whose probability is >= `xtc_threshold` but the least likely of them (off: probability <= 0
  or a threshold above 0.5); it draws from an RNG of its own, seeded from `seed`;
- temperature divides the logits by `temp`; `temp <= 0` keeps only the largest (greedy);
- mirostat v2 keeps the candidates whose surprise -log2 p is at most mu, draws, and moves mu by
  eta * (tau - surprise) (mu starts at 2 tau); v1 keeps the top k, k estimated from the slope of
  the 100 best log-probabilities (Zipf's s) and mu, and moves mu the same way;
- dist draws from the softmax of what is left with the sampler's own RNG.

The draw uses numpy's PCG64 seeded with `seed`, so a seed reproduces a run of llamapy; it is not
bit-compatible with llama.cpp's mt19937 stream.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

__all__ = ["LLAMA_DEFAULT_SEED", "Sampler", "SamplingParams"]

# llama.h: a seed of 0xFFFFFFFF means "pick a random one"; -1 is how the CLI spells it.
LLAMA_DEFAULT_SEED = 0xFFFFFFFF

_MIN_KEEP = 1
# top-p without top-k first tries to find its prefix among this many best tokens.
_TOP_P_PREFIX = 1024


@dataclass(frozen=True)
class SamplingParams:
    """common_params_sampling's fields for the default chain, with llama.cpp's defaults."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # 0: penalties off; < 0: the whole accepted history
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = -1  # -1 (or LLAMA_DEFAULT_SEED): random
    ignore_eos: bool = False  # --ignore-eos: end-of-generation tokens are never sampled
    typical_p: float = 1.0  # locally typical sampling (--typical); 1: off
    top_n_sigma: float = -1.0  # --top-nsigma; <= 0: off
    xtc_probability: float = 0.0  # --xtc-probability; 0: off
    xtc_threshold: float = 0.1  # --xtc-threshold
    mirostat: int = 0  # --mirostat: 0 off, 1 or 2
    mirostat_tau: float = 5.0  # --mirostat-ent: the target surprise
    mirostat_eta: float = 0.1  # --mirostat-lr: its learning rate
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs (-l / --logit-bias)


def _softmax(logits: np.ndarray) -> np.ndarray:
    # In float32 like llama_sampler_softmax_impl: subtract the max, exp, normalise.
    e = np.exp(logits - logits.max(), dtype=np.float32)
    return e / e.sum(dtype=np.float32)


class Sampler:
    """One generation's sampler: the chain plus the state it carries (penalty history, RNG)."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params if params is not None else SamplingParams()
        p = self.params
        if p.seed < 0 or p.seed == LLAMA_DEFAULT_SEED:
            # The seed actually used is kept so that a "random" run can be reported and replayed,
            # as llama.cpp reports llama_sampler_get_seed.
            self.seed = int(np.random.SeedSequence().generate_state(1)[0])
        else:
            self.seed = int(p.seed)
        maxlen = p.repeat_last_n if p.repeat_last_n > 0 else None
        self._history: deque[int] = deque(maxlen=maxlen)
        self._rng_state: np.random.Generator | None = None  # made at the first draw (_rng)
        self._xtc_rng: np.random.Generator | None = None
        self._mu = 2.0 * self.params.mirostat_tau  # mirostat's running target

    @property
    def _rng(self) -> np.random.Generator:
        # made when a token is first drawn: numpy.random (its bit generators, and `secrets`,
        # which maps OpenSSL's libcrypto) is ~5 MiB of RSS that greedy decoding never needs
        if self._rng_state is None:
            self._rng_state = np.random.Generator(np.random.PCG64(self.seed))
        return self._rng_state

    # -- state --------------------------------------------------------------------------------

    def accept(self, token: int) -> None:
        """Record a token (prompt or generated) for the repetition penalties."""
        if self.params.repeat_last_n != 0:
            self._history.append(int(token))

    def reset(self) -> None:
        """Forget the history and restart the RNG from the seed (llama_sampler_reset)."""
        self._history.clear()
        self._rng_state = self._xtc_rng = None  # the next draw starts again from the seed
        self._mu = 2.0 * self.params.mirostat_tau

    # -- the chain ----------------------------------------------------------------------------

    def sample(self, logits: np.ndarray) -> int:
        """The next token id from one row of logits, shape (n_vocab,)."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"expected logits of shape (n_vocab,), got {logits.shape}")
        # A float32 copy: the stages below write into it, never into the caller's array.
        z = logits.astype(np.float32, copy=True)
        p = self.params
        for tok, bias in p.logit_bias:
            if 0 <= tok < z.size:
                z[tok] += np.float32(bias)
        if p.mirostat:
            return self._mirostat(z)
        self._apply_penalties(z)

        if p.temp <= 0.0 and p.typical_p >= 1.0 and not self._xtc_on():
            # Every other filter keeps the largest logit, so temp <= 0 reduces to argmax after
            # the penalties (llama_sampler_temp_impl keeps the first maximum).
            return int(np.argmax(z))

        if p.top_n_sigma > 0.0:  # (then top-k over what it kept)
            ids, z = self._top_n_sigma(np.arange(z.size), z, p.top_n_sigma)
            sub, z = self._top_k(z, p.top_k)
            ids = ids[sub]
        else:
            ids, z = self._top_k(z, p.top_k)
        ids, z = self._typical(ids, z, p.typical_p)
        ids, z = self._top_p(ids, z, p.top_p)
        ids, z = self._min_p(ids, z, p.min_p)
        ids, z = self._xtc(ids, z)
        if p.temp <= 0.0:  # typical or xtc may have dropped the largest logit: the largest kept
            return int(ids[int(np.argmax(z))])
        z = z / np.float32(p.temp)
        return int(ids[self._draw(z)])

    @staticmethod
    def _top_n_sigma(ids: np.ndarray, z: np.ndarray, n: float) -> tuple[np.ndarray, np.ndarray]:
        """llama_sampler_top_n_sigma: the logits >= max - n·std (-inf ones left out of both)."""
        finite = z[z != -np.inf]
        if z.size <= 1 or finite.size == 0:
            return ids, z
        std = np.float32(np.sqrt(np.mean((finite - finite.mean(dtype=np.float32)) ** 2, dtype=np.float32)))
        keep = z >= finite.max() - np.float32(n) * std
        return ids[keep], z[keep]

    def _xtc_on(self) -> bool:
        return self.params.xtc_probability > 0.0 and self.params.xtc_threshold <= 0.5

    def _xtc(self, ids: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """llama_sampler_xtc: sometimes drop the likely tokens but the least likely of them."""
        p = self.params
        if not self._xtc_on() or z.size < 2:
            return ids, z
        if self._xtc_rng is None:  # its own stream, as llama.cpp's xtc has its own mt19937
            self._xtc_rng = np.random.Generator(np.random.PCG64([self.seed, 1]))
        if self._xtc_rng.random() > p.xtc_probability:
            return ids, z
        ids, z = self._sorted(ids, z)
        above = np.flatnonzero(_softmax(z) < np.float32(p.xtc_threshold))
        last = int(above[0]) - 1 if above.size else z.size - 1  # the last of the leading run >= threshold
        if last > 0 and z.size - last >= _MIN_KEEP:
            return ids[last:], z[last:]
        return ids, z

    def _mirostat(self, z: np.ndarray) -> int:
        """llama_sampler_mirostat (v1) / _v2 after the temperature; mu follows the surprise."""
        p = self.params
        if p.temp <= 0.0:
            return int(np.argmax(z))  # the temperature stage kept the largest alone
        ids, z = self._sorted(np.arange(z.size), z / np.float32(p.temp))
        probs = _softmax(z)
        if p.mirostat == 1:
            m = min(100, z.size) - 1
            t = np.log(np.arange(2, m + 2, dtype=np.float32) / np.arange(1, m + 1, dtype=np.float32))
            with np.errstate(divide="ignore", invalid="ignore"):
                b = np.log(probs[:m] / probs[1 : m + 1])
            with np.errstate(all="ignore"):  # a flat or odd head: k is nan or inf, handled below
                s_hat = np.float64((t * b).sum() / (t * t).sum())
                eps = s_hat - 1.0
                k = np.power(eps * 2.0**self._mu / (1.0 - np.float64(z.size) ** -eps), 1.0 / s_hat)
            n = z.size if k == np.inf else max(int(min(k, z.size)), 1) if np.isfinite(k) else 1
        else:
            with np.errstate(divide="ignore"):
                surprise = -np.log2(probs)
            over = np.flatnonzero(surprise > self._mu)
            n = max(int(over[0]) if over.size else z.size, 1)
        ids, z = ids[:n], z[:n]
        i = self._draw(z)
        self._mu -= p.mirostat_eta * (float(-np.log2(_softmax(z)[i])) - p.mirostat_tau)
        return int(ids[i])

    def _apply_penalties(self, z: np.ndarray) -> None:
        p = self.params
        if p.repeat_last_n == 0 or not self._history:
            return
        if p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            return
        counts = Counter(self._history)
        tok = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        cnt = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        keep = (tok >= 0) & (tok < z.size)  # a token the vocabulary lacks has no logit to touch
        tok, cnt = tok[keep], cnt[keep]
        rep = np.float32(p.repeat_penalty)
        v = z[tok]
        # Dividing a negative logit would make the token *more* likely; llama.cpp multiplies.
        v = np.where(v <= 0, v * rep, v / rep).astype(np.float32)
        v -= cnt * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
        z[tok] = v

    @staticmethod
    def _top_k(z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidates sorted by descending logit (ties: lower id first), at most k of them."""
        n = z.size
        if k <= 0 or k >= n:
            # Off: every token stays; sorting is left to top-p, which needs it anyway.
            return np.arange(n), z
        # argpartition finds the k largest in O(n); only those k are then sorted.
        part = np.argpartition(-z, k - 1)[:k]
        kth = z[part].min()
        # Ties at the boundary are resolved by token id so that the result is deterministic.
        above = np.flatnonzero(z > kth)
        tied = np.flatnonzero(z == kth)[: k - above.size]
        ids = np.concatenate([above, tied])
        order = np.lexsort((ids, -z[ids]))
        ids = ids[order]
        return ids, z[ids]

    @staticmethod
    def _typical(ids: np.ndarray, z: np.ndarray, typical_p: float) -> tuple[np.ndarray, np.ndarray]:
        """llama_sampler_typical: the candidates in order of |-log p - H| (H the entropy), the
        shortest such prefix whose mass exceeds p (at least min_keep)."""
        if typical_p >= 1.0:
            return ids, z
        probs = _softmax(z)
        with np.errstate(divide="ignore", invalid="ignore"):  # a banned token: p = 0, log p = -inf
            logp = np.log(probs)
            entropy = np.float32(-np.nansum(probs * logp))
        order = np.argsort(np.abs(-logp - entropy), kind="stable")
        cum = np.cumsum(probs[order], dtype=np.float32)
        over = np.flatnonzero(cum > np.float32(typical_p))
        last = max(int(over[0]) + 1, _MIN_KEEP) if over.size else z.size
        keep = order[:last]
        return ids[keep], z[keep]

    @staticmethod
    def _sorted(ids: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.lexsort((ids, -z))
        return ids[order], z[order]

    def _top_p(
        self, ids: np.ndarray, z: np.ndarray, top_p: float
    ) -> tuple[np.ndarray, np.ndarray]:
        if top_p >= 1.0:
            return ids, z
        probs = _softmax(z)
        m = _TOP_P_PREFIX
        while z.size > 4 * m:
            # With top-k off this is the whole vocabulary. The head of the sorted order is the
            # sorted top-m, so sort only those m (partition first), widening m until their mass
            # reaches p; a full sort is the last resort.
            head, _ = self._top_k(z, m)
            cum = np.cumsum(probs[head], dtype=np.float32)
            reached = np.flatnonzero(cum >= np.float32(top_p))
            if reached.size:
                keep = head[: max(int(reached[0]) + 1, _MIN_KEEP)]
                return ids[keep], z[keep]
            m *= 8
        order = np.lexsort((ids, -z))
        ids, z, probs = ids[order], z[order], probs[order]
        cum = np.cumsum(probs, dtype=np.float32)
        # The first prefix whose mass reaches p, and at least min_keep tokens.
        reached = np.flatnonzero(cum >= np.float32(top_p))
        last = int(reached[0]) + 1 if reached.size else z.size
        last = max(last, _MIN_KEEP)
        return ids[:last], z[:last]

    @staticmethod
    def _min_p(
        ids: np.ndarray, z: np.ndarray, min_p: float
    ) -> tuple[np.ndarray, np.ndarray]:
        if min_p <= 0.0 or z.size == 0:
            return ids, z
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p): no softmax needed.
        floor = np.float32(z.max() + np.log(np.float32(min_p)))
        keep = z >= floor
        if int(keep.sum()) < _MIN_KEEP:
            ids, z = Sampler._sorted(ids, z)
            return ids[:_MIN_KEEP], z[:_MIN_KEEP]
        return ids[keep], z[keep]

    def _draw(self, z: np.ndarray) -> int:
        """Index into `z` drawn from softmax(z) (llama_sampler_dist)."""
        probs = _softmax(z).astype(np.float64)
        cum = np.cumsum(probs)
        r = self._rng.random() * cum[-1]
        i = int(np.searchsorted(cum, r, side="right"))
        return min(i, z.size - 1)
