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
