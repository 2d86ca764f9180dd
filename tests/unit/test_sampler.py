"""The sampler chain: each stage as llama.cpp's, the whole chain reproducible by seed."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from llamapy.model.sampler import Sampler, SamplingParams

# Stages off unless a test turns one on.
PLAIN = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)


def _logits(probs: list[float]) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float32))


def _support(params: SamplingParams, logits: np.ndarray, n: int = 3000) -> Counter[int]:
    s = Sampler(params)
    return Counter(s.sample(logits) for _ in range(n))


def test_defaults_are_llama_cpp_defaults() -> None:
    p = SamplingParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.frequency_penalty, p.presence_penalty) == (
        1.0, 64, 0.0, 0.0)
    assert p.seed == -1


@pytest.mark.parametrize("temp", [0.0, -1.0])
def test_greedy_is_argmax(temp: float) -> None:
    rng = np.random.default_rng(0)
    s = Sampler(SamplingParams(temp=temp))
    for _ in range(20):
        z = rng.standard_normal(1000).astype(np.float32)
        assert s.sample(z) == int(np.argmax(z))


def test_greedy_ties_take_first() -> None:
    s = Sampler(SamplingParams(temp=0.0))
    assert s.sample(np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32)) == 1


def test_sample_does_not_modify_input() -> None:
    z = np.array([3.0, 1.0, 2.0], dtype=np.float32)
    s = Sampler(SamplingParams(temp=1.0, repeat_penalty=2.0, seed=1))
    s.accept(0)
    s.sample(z)
    assert z.tolist() == [3.0, 1.0, 2.0]


def test_seed_reproducible_and_reset() -> None:
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal(500).astype(np.float32) for _ in range(50)]
    p = SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = Sampler(p)
    b = Sampler(p)
    seq_a = [a.sample(z) for z in rows]
    assert seq_a == [b.sample(z) for z in rows]
    a.reset()
    assert [a.sample(z) for z in rows] == seq_a
    c = Sampler(SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=43))
    assert [c.sample(z) for z in rows] != seq_a


def test_random_seed_is_recorded_and_replayable() -> None:
    a = Sampler(SamplingParams(seed=-1))
    b = Sampler(SamplingParams(seed=-1))
    assert a.seed != b.seed  # 2**-64 chance of a false failure
    z = np.random.default_rng(2).standard_normal(300).astype(np.float32)
    p = dict(temp=2.0, top_k=0, top_p=1.0, min_p=0.0)
    replay = Sampler(SamplingParams(seed=a.seed, **p))
    first = Sampler(SamplingParams(seed=a.seed, **p))
    assert [first.sample(z) for _ in range(20)] == [replay.sample(z) for _ in range(20)]


def test_dist_follows_softmax() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 20000
    got = _support(SamplingParams(**PLAIN), _logits(probs), n)
    for tok, p in enumerate(probs):
        assert abs(got[tok] / n - p) < 0.015


# ---------------------------------------------------------------------------------------------
# filters


def test_top_k() -> None:
    z = np.array([1.0, 5.0, 3.0, 4.0, 2.0], dtype=np.float32)
    assert set(_support(SamplingParams(**{**PLAIN, "top_k": 2, "temp": 50.0}), z)) == {1, 3}
    assert set(_support(SamplingParams(**{**PLAIN, "top_k": 1, "temp": 50.0}), z)) == {1}
    # top_k <= 0 and top_k >= n_vocab keep everything.
    for k in (0, -1, 5, 100):
        assert set(_support(SamplingParams(**{**PLAIN, "top_k": k, "temp": 50.0}), z)) == set(
            range(5))


def test_top_k_stage_sorted_and_ties_by_id() -> None:
    z = np.array([2.0, 7.0, 2.0, 9.0, 2.0, 1.0], dtype=np.float32)
    ids, vals = Sampler._top_k(z, 3)
    assert ids.tolist() == [3, 1, 0]
    assert vals.tolist() == [9.0, 7.0, 2.0]


def test_top_p() -> None:
    z = _logits([0.5, 0.3, 0.15, 0.05])
    hot = {**PLAIN, "temp": 50.0}
    assert set(_support(SamplingParams(**{**hot, "top_p": 0.4}), z)) == {0}
    assert set(_support(SamplingParams(**{**hot, "top_p": 0.7}), z)) == {0, 1}
    assert set(_support(SamplingParams(**{**hot, "top_p": 0.85}), z)) == {0, 1, 2}
    assert set(_support(SamplingParams(**{**hot, "top_p": 1.0}), z)) == {0, 1, 2, 3}
    # min_keep = 1: even p = 0 keeps the best token.
    assert set(_support(SamplingParams(**{**hot, "top_p": 0.0}), z)) == {0}


def test_top_p_after_top_k_renormalises() -> None:
    # After top-k = 2 the kept masses are 0.625 / 0.375, so p = 0.6 keeps only the first
    # (llama.cpp's top-p takes the softmax of the surviving candidates).
    z = _logits([0.5, 0.3, 0.15, 0.05])
    got = _support(SamplingParams(**{**PLAIN, "temp": 50.0, "top_k": 2, "top_p": 0.6}), z)
    assert set(got) == {0}
    got = _support(SamplingParams(**{**PLAIN, "temp": 50.0, "top_k": 2, "top_p": 0.65}), z)
    assert set(got) == {0, 1}


def test_min_p() -> None:
    z = _logits([0.5, 0.3, 0.15, 0.05])
    hot = {**PLAIN, "temp": 50.0}
    # keep p_i >= min_p * p_max
    assert set(_support(SamplingParams(**{**hot, "min_p": 0.2}), z)) == {0, 1, 2}
    assert set(_support(SamplingParams(**{**hot, "min_p": 0.5}), z)) == {0, 1}
    assert set(_support(SamplingParams(**{**hot, "min_p": 0.99}), z)) == {0}
    assert set(_support(SamplingParams(**{**hot, "min_p": 0.0}), z)) == {0, 1, 2, 3}


def test_temperature_comes_last() -> None:
    # The filters see the untempered logits: a huge temperature flattens what is left but
    # cannot bring back token 3, which min-p removed.
    z = _logits([0.5, 0.3, 0.15, 0.05])
    got = _support(SamplingParams(**{**PLAIN, "temp": 1000.0, "min_p": 0.2}), z, 6000)
    assert set(got) == {0, 1, 2}
    for tok in (0, 1, 2):
        assert abs(got[tok] / 6000 - 1 / 3) < 0.04


def test_low_temperature_sharpens() -> None:
    z = _logits([0.4, 0.35, 0.25])
    got = _support(SamplingParams(**{**PLAIN, "temp": 0.05}), z, 2000)
    assert got[0] / 2000 > 0.9


# ---------------------------------------------------------------------------------------------
# penalties


def _greedy(**kw: float) -> Sampler:
    return Sampler(SamplingParams(temp=0.0, **kw))


def test_repeat_penalty_divides_positive_logits() -> None:
    s = _greedy(repeat_penalty=1.5)
    z = np.array([2.0, 1.9], dtype=np.float32)
    assert s.sample(z) == 0
    s.accept(0)
    assert s.sample(z) == 1  # 2.0 / 1.5 = 1.33 < 1.9


def test_repeat_penalty_multiplies_negative_logits() -> None:
    s = _greedy(repeat_penalty=1.5)
    z = np.array([-1.0, -1.2], dtype=np.float32)
    s.accept(0)
    assert s.sample(z) == 1  # -1.0 * 1.5 = -1.5 < -1.2 (dividing would have made it -0.67)


def test_penalties_values() -> None:
    s = Sampler(SamplingParams(repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5))
    for t in (0, 0, 1, 2, 2, 2):
        s.accept(t)
    z = np.array([4.0, -1.0, 0.0, 3.0], dtype=np.float32)
    s._apply_penalties(z)
    # tok 0: 4/2 - 2*0.25 - 0.5 ; tok 1: -1*2 - 0.25 - 0.5 ; tok 2: 0*2 - 0.75 - 0.5
    np.testing.assert_allclose(z, [1.0, -2.75, -1.25, 3.0])


def test_frequency_and_presence_penalties() -> None:
    s = _greedy(frequency_penalty=0.3, presence_penalty=0.2)
    z = np.array([1.0, 0.5], dtype=np.float32)
    s.accept(0)
    assert s.sample(z) == 0  # 1 - 0.3 - 0.2 = 0.5: tie, first wins
    s.accept(0)
    assert s.sample(z) == 1  # 1 - 0.6 - 0.2 = 0.2


def test_repeat_last_n_window_and_off() -> None:
    z = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    s = _greedy(repeat_penalty=1.5, repeat_last_n=2)
    s.accept(0)
    s.accept(2)
    s.accept(2)  # token 0 has left the window of the last 2
    assert s.sample(z) == 0
    off = _greedy(repeat_penalty=1.5, repeat_last_n=0)
    off.accept(0)
    assert off.sample(z) == 0
    whole = _greedy(repeat_penalty=1.5, repeat_last_n=-1)
    for t in [0] + [2] * 500:
        whole.accept(t)
    assert whole.sample(z) == 1


def test_reset_forgets_history() -> None:
    s = _greedy(repeat_penalty=1.5)
    s.accept(0)
    s.reset()
    assert s.sample(np.array([2.0, 1.9], dtype=np.float32)) == 0


def test_out_of_vocab_history_ignored() -> None:
    s = _greedy(repeat_penalty=1.5)
    s.accept(10_000)
    assert s.sample(np.array([2.0, 1.9], dtype=np.float32)) == 0


def test_bad_logits_shape() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros((2, 3), dtype=np.float32))


def test_fast_on_large_vocab() -> None:
    z = np.random.default_rng(3).standard_normal(128_256).astype(np.float32) * 3
    s = Sampler(SamplingParams(seed=5, repeat_penalty=1.1))
    for t in range(64):
        s.accept(t)
    s.sample(z)
    t0 = time.perf_counter()
    for _ in range(20):
        s.sample(z)
    per = (time.perf_counter() - t0) / 20
    assert per < 0.02  # the default chain partitions, it does not sort 128k logits


def test_top_p_partial_sort_equals_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    from llamapy.model import sampler as mod

    rng = np.random.default_rng(4)
    s = Sampler(SamplingParams(**PLAIN))
    for scale in (0.5, 2.0, 6.0):
        z = (rng.standard_normal(50_000) * scale).astype(np.float32)
        z[rng.integers(0, 50_000, 300)] = z.max()  # ties at the top
        ids = np.arange(z.size)
        for p in (0.3, 0.9, 0.95):
            fast = s._top_p(ids, z, p)
            monkeypatch.setattr(mod, "_TOP_P_PREFIX", 10**9)
            full = s._top_p(ids, z, p)
            monkeypatch.undo()
            assert fast[0].tolist() == full[0].tolist()


def test_logit_bias_comes_first_and_bans() -> None:
    z = _logits([0.5, 0.3, 0.15, 0.05])
    greedy = {**PLAIN, "temp": 0.0}
    assert Sampler(SamplingParams(**greedy, logit_bias=((0, -np.inf),))).sample(z) == 1
    assert Sampler(SamplingParams(**greedy, logit_bias=((3, 3.0),))).sample(z) == 3
    assert Sampler(SamplingParams(**greedy, logit_bias=((3, 1.5), (3, 1.5)))).sample(z) == 3  # pairs add up
    # before the penalties: a banned token stays banned whatever they do
    s = Sampler(SamplingParams(**greedy, repeat_penalty=0.01, logit_bias=((2, -np.inf),)))
    s.accept(2)
    assert s.sample(z) == 0
    assert set(_support(SamplingParams(**PLAIN, logit_bias=((1, -np.inf), (2, -np.inf))), z)) == {0, 3}


def _typical_reference(probs: np.ndarray, p: float) -> set[int]:
    """llama_sampler_typical, in float64 from its description."""
    h = -(probs * np.log(probs)).sum()
    order = np.argsort(np.abs(-np.log(probs) - h), kind="stable")
    cum = np.cumsum(probs[order])
    last = int(np.flatnonzero(cum > p)[0]) + 1
    return set(order[:last].tolist())


@pytest.mark.parametrize("p", [0.2, 0.5, 0.9])
def test_typical(p: float) -> None:
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.full(12, 0.7))
    z = np.log(probs).astype(np.float32)
    want = _typical_reference(probs, p)
    hot = {**PLAIN, "temp": 1.0, "typical_p": p}
    assert set(_support(SamplingParams(**hot), z, 4000)) == want
    # greedy with typical on: the largest logit among the kept, which need not be the argmax
    got = Sampler(SamplingParams(**{**hot, "temp": 0.0})).sample(z)
    assert got == max(want, key=lambda i: probs[i])
    assert Sampler(SamplingParams(**{**hot, "typical_p": 1.0, "temp": 0.0})).sample(z) == int(np.argmax(z))


def test_top_n_sigma() -> None:
    z = np.array([5.0, 4.5, 1.0, 0.0, -1.0, -np.inf], np.float32)
    finite = z[:5].astype(np.float64)
    for n in (0.5, 1.0, 2.0):
        want = {i for i in range(5) if z[i] >= finite.max() - n * finite.std()}
        assert set(_support(SamplingParams(**{**PLAIN, "temp": 50.0, "top_n_sigma": n}), z)) == want
    assert set(_support(SamplingParams(**{**PLAIN, "temp": 50.0, "top_n_sigma": -1.0}), z)) == {0, 1, 2, 3, 4}


def test_xtc() -> None:
    z = _logits([0.4, 0.3, 0.2, 0.06, 0.04])
    hot = {**PLAIN, "temp": 1.0, "xtc_threshold": 0.25}
    # always on: 0.4 and 0.3 are >= 0.25, the less likely of them (0.3) stays
    assert set(_support(SamplingParams(**hot, xtc_probability=1.0), z)) == {1, 2, 3, 4}
    assert Sampler(SamplingParams(**{**hot, "temp": 0.0}, xtc_probability=1.0)).sample(z) == 1
    # a threshold above 0.5 turns it off, as one no candidate reaches
    assert set(_support(SamplingParams(**{**hot, "xtc_threshold": 0.6}, xtc_probability=1.0), z)) == {0, 1, 2, 3, 4}
    assert set(_support(SamplingParams(**{**hot, "xtc_threshold": 0.45}, xtc_probability=1.0), z)) == {0, 1, 2, 3, 4}
    # probability 0.5: about half the steps keep the best token available
    c = _support(SamplingParams(**hot, xtc_probability=0.5), z, 4000)
    assert 0.1 < c[0] / 4000 < 0.3  # 0.4 of the steps without xtc, i.e. ~0.2


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_tracks_its_target_surprise(version: int) -> None:
    """mu moves so that the mean surprise of the drawn tokens approaches tau."""
    rng = np.random.default_rng(3)
    z = (rng.standard_normal(2000) * 3).astype(np.float32)
    tau = 3.0
    s = Sampler(SamplingParams(**{**PLAIN, "temp": 1.0, "mirostat": version, "mirostat_tau": tau, "mirostat_eta": 0.1}))
    probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    surprises = [-np.log2(probs[s.sample(z)]) for _ in range(3000)]
    assert abs(np.mean(surprises[1000:]) - tau) < 1.0, np.mean(surprises[1000:])
    assert s._mu != 2 * tau
    s.reset()
    assert s._mu == 2 * tau
    # no penalties in mirostat's chain (llama.cpp's has none); the logit bias still applies
    banned = int(np.argmax(z))
    s = Sampler(SamplingParams(**{**PLAIN, "temp": 0.0, "mirostat": version, "repeat_penalty": 50.0,
                                  "logit_bias": ((banned, -np.inf),)}))  # fmt: skip
    s.accept(int(np.argsort(z)[-2]))
    assert s.sample(z) == int(np.argsort(z)[-2])
