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
