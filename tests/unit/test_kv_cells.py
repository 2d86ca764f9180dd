"""KVCache.find_slot: a sequence's cells stay in position order where free cells allow it."""

from __future__ import annotations

import numpy as np
import pytest

from llamapy.model.kv_cache import ContextFullError, KVCache


def _cache(size: int) -> KVCache:
    c = KVCache(size, [], [])
    c.pos = np.full(size, -1, np.int64)
    c.seq = np.full(size, -1, np.int64)
    return c


def test_a_sequence_continues_after_its_own_cells() -> None:
    c = _cache(16)
    c.commit(np.arange(0, 10), np.arange(10), np.zeros(10, np.int64))  # seq 0: cells 0..9
    c.commit(np.arange(10, 12), np.arange(2), np.ones(2, np.int64))  # seq 1: cells 10, 11
    c.seq_rm(0, 6)  # seq 0 keeps positions 0..5 (a reused slot's prompt cache): cells 6..9 free
    c.seq_rm(1)  # seq 1 gone: cells 10, 11 free
    # seq 0's next tokens go after its cell 5 (6, 7, …), a new sequence's to the lowest free cells
    assert c.find_slot(3, np.zeros(3, np.int64)).tolist() == [6, 7, 8]
    c.commit(np.array([0, 1, 2, 3, 4, 5]), np.arange(6), np.zeros(6, np.int64))
    c.pos[[3, 4]] = -1  # holes below seq 0's last cell
    c.seq[[3, 4]] = -1
    got = c.find_slot(4, np.array([2, 0, 2, 0]))
    assert got.tolist() == [3, 6, 4, 7]  # seq 2 new: lowest; seq 0: after its cell 5, in order
    assert c.find_slot(2).tolist() == [3, 4]  # no sequences given: the lowest free


def test_no_free_cell_after_a_sequence_falls_back_to_the_lowest() -> None:
    c = _cache(8)
    c.commit(np.arange(2, 8), np.arange(6), np.zeros(6, np.int64))  # seq 0 ends at the last cell
    assert c.find_slot(2, np.zeros(2, np.int64)).tolist() == [0, 1]
    with pytest.raises(ContextFullError):
        c.find_slot(3, np.zeros(3, np.int64))


def test_seq_cp_shares_cells_and_seq_rm_hands_them_on() -> None:
    """seq_cp adds a sequence to cells (no new cells); the mask lets it see them; when the owner
    forgets them they stay, owned by a sequence that shares them; when none does, they are free."""
    c = _cache(16)
    c.commit(np.arange(0, 6), np.arange(6), np.zeros(6, np.int64))  # seq 0: positions 0..5
    c.seq_cp(0, 2, 0, 4)  # seq 2 holds positions 0..3 too
    assert c.n_used() == 6
    assert c.holds(2).tolist() == [True] * 4 + [False] * 12
    # seq 2's next token goes after its cells (cell 6, after seq 0's), and sees cells 0..3 only
    assert c.find_slot(1, np.array([2])).tolist() == [6]
    m = c.mask(8, np.array([4, 6]), np.array([2, 0]))
    assert (m[0] == 0).tolist() == [True] * 4 + [False] * 4
    assert (m[1] == 0).tolist() == [True] * 6 + [False] * 2
    c.seq_rm(0)  # the owner leaves: positions 0..3 stay for seq 2, 4 and 5 are free
    assert c.seq[:6].tolist() == [2, 2, 2, 2, -1, -1] and c.n_used() == 4
    assert not c.share.any()
    c.seq_rm(2, 2)
    assert c.n_used() == 2
    c.seq_cp(2, 5)
    c.seq_cp(2, 3)
    c.seq_rm(2)  # the lowest sharer inherits, the other keeps sharing
    assert c.seq[:2].tolist() == [3, 3] and c.holds(5)[:2].all() and c.n_used() == 2
    c.seq_rm(5)
    c.seq_rm(3)
    assert c.n_used() == 0


def _scan_slot(c: KVCache, s: int) -> int:
    """find_slot(1, [s]) as a scan of the whole cache: the lowest free cell after every cell `s`
    holds, else the lowest free."""
    free = np.flatnonzero(c.pos < 0)
    held = np.flatnonzero(c.holds(s))
    after = free[free > (held[-1] if len(held) else -1)]
    return int(after[0] if len(after) else free[0])


def _scan_mask(c: KVCache, n_kv: int, p: int, s: int) -> np.ndarray:
    ok = (c.pos[:n_kv] >= 0) & (c.pos[:n_kv] <= p) & c.holds(s)[:n_kv]
    return np.where(ok, np.float32(0), np.float32(-np.inf))[None, :]


@pytest.mark.parametrize("seed", range(6))
def test_decode_steps_kept_incrementally_equal_the_scan(seed: int) -> None:
    """A decode step's cell, n_kv and mask row, which the cache carries from step to step (no
    scan of the cells), are the scan's after any mix of steps, prompts, seq_rm, seq_cp, failed
    steps, steps at past positions and a full cache: checked at every step against a scan of the whole cache."""
    rng = np.random.default_rng(seed)
    c = _cache(600)
    nxt = {0: 0, 1: 0, 2: 0}  # each sequence's next position
    for _ in range(900):
        s = int(rng.choice([0, 0, 0, 0, 1, 2]))
        r = rng.random()
        if r < 0.03:
            p0 = int(rng.integers(0, nxt[s] + 1))
            c.seq_rm(s, p0)
            nxt[s] = min(nxt[s], p0)
            continue
        if r < 0.05 and s != 0:
            c.seq_cp(0, s, 0, int(rng.integers(0, nxt[0] + 1)))
            continue
        if r < 0.07 and c.n_used() + 5 <= c.size:  # a prompt chunk of several tokens
            idx = c.find_slot(5, np.full(5, s))
            c.commit(idx, np.arange(nxt[s], nxt[s] + 5), np.full(5, s))
            nxt[s] += 5
            continue
        if c.n_used() == c.size:
            with pytest.raises(ContextFullError):
                c.find_slot(1, np.array([s]))
            c.seq_rm(s, max(nxt[s] - 50, 0))
            nxt[s] = max(nxt[s] - 50, 0)
            continue
        want = _scan_slot(c, s)
        idx = c.find_slot(1, np.array([s]))
        assert idx.tolist() == [want] and idx.dtype == np.int64
        back = r > 0.97 and nxt[s] > 0  # a step at a position the sequence has passed already
        pos = np.array([int(rng.integers(0, nxt[s])) if back else nxt[s]])
        c.commit(idx, pos, np.array([s]))
        if r < 0.09:  # the step failed: its cell freed
            c.release(idx)
            continue
        nxt[s] += not back
        used = np.flatnonzero(c.pos >= 0)
        n_kv = c.n_kv(idx)
        assert n_kv == min(c.size, -(-(int(used[-1]) + 1) // 256) * 256)
        got = c.mask(n_kv, pos, np.array([s]))
        np.testing.assert_array_equal(got, _scan_mask(c, n_kv, int(pos[0]), s))
        assert got.dtype == np.float32 and got.shape == (1, n_kv)
