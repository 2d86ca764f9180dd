"""The unified KV cache (llama.cpp's src/llama-kv-cache.cpp).

One K and one V tensor per layer, `(kv_size, n_head_kv * head_dim)`, in the buffer of the device
that holds the layer (unless `-nkvo`). Cells remember the position and sequence of what they
hold; a micro-batch gets free cells (`find_slot`), writes its K/V rows there with SET_ROWS, and
attends to the first `n_kv` cells through a mask that hides other sequences and the future —
so several sequences share one cache and one batch, as llama.cpp's parallel decoding does.

A cell may hold several sequences (llama_kv_cells' per-cell seq bitset): `seq` is the cell's
owner and `share` a bitmask of the other sequences (ids below MAX_SHARE_SEQ) that hold it too.
`seq_cp` adds a sequence to cells without copying K/V (llama_memory_seq_cp on a unified cache): a
served prompt reuses another slot's cells of a common prefix — the same bits, and attention reads
a query's visible cells in cell order whatever else lies between them.

Sliding-window layers (gemma3's local layers) read the same cells through a second mask that
also hides cells `n_swa` or more positions behind the query (llama_hparams::is_masked_swa). The
cache keeps every cell for those layers too — llama.cpp's `--swa-full` layout: simple, and
memory is no concern at the sizes llamapy runs; the window is enforced by the mask alone.

A decode step (one token of one sequence) does not scan the cache: the cache keeps, keyed by
`version`, one past its highest used cell (`_top`) and the mask row of the sequence's latest query
(`_row`), and `commit` carries both forward over the one cell it writes; any other change of the
cells bumps `version`, and the next step computes them again over the whole cache. The same
cells, n_kv and mask as the scan gives (tests/unit/test_kv_cells.py checks them against it).

Cache types (`-ctk`/`-ctv`, llama.cpp's kv_cache_types subset): f32, f16, and ggml's Q8_0 and
Q4_0 blocks — SET_ROWS quantizes each row as ggml's from_float does, and attention reads the
blocks (llama.cpp allows a quantized V only with flash attention; llamapy's attention is always
the fused FLASH_ATTN_EXT kind, so any pairing works). A quantized row holds whole blocks of 32
per head, so the head sizes must be multiples of 32, as llama.cpp requires. As llama.cpp does
(attn_rot_k/v), a quantized cache with heads of a multiple of 64 holds its rows rotated by a
Hadamard matrix, which spreads outliers over a block before quantizing: `set_rotation` marks the
cache tensors (params["rot"]: the order), SET_ROWS rotates before quantizing, FLASH_ATTN_EXT
rotates Q into K's basis and its output back from V's. `LLAMA_ATTN_ROT_DISABLE=1` turns it off,
as in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..backend.interface import Buffer, BufferUsage, Device
from ..tensor import Tensor
from ..types import ContextFullError, GGMLType, OutOfMemoryError, UnsupportedError

CACHE_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0)
N_KV_PAD = 256  # attend to a multiple of this many cells, as llama.cpp pads its n_kv
MAX_SHARE_SEQ = 64  # sequences that can share cells (bits of `share`)


@dataclass
class KVCache:
    size: int
    k: list[Tensor]
    v: list[Tensor]
    buffers: list[Buffer] = field(default_factory=list)
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # -1: empty cell
    seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the cell's owner
    # bit s: sequence s holds the cell too (seq_cp); created on first use
    share: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    # bumped by every change of the cells: a user of the cache (the serving engine's prompt cache)
    # can tell whether anyone else changed them since it last looked
    version: int = 0
    # (version, one past the highest used cell): valid while `version` is its first field
    _top: tuple[int, int] | None = field(default=None, init=False, repr=False)
    # (version, seq, pos, row): the (1, size) mask row (no window, no shared cells) of sequence
    # `seq`'s query at `pos`, where every cell of `seq` has a position <= pos (so a later query
    # of the sequence sees the same cells); valid while `version` is its first field
    _row: tuple[int, int, int, np.ndarray] | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(
        cls,
        size: int,
        n_embd_gqa: int | Sequence[int],
        layer_devices: Sequence[Device],
        type_k: GGMLType = GGMLType.F16,
        type_v: GGMLType = GGMLType.F16,
        n_embd_v_gqa: Sequence[int] | None = None,
    ) -> KVCache:
        """`n_embd_gqa`: the K row width, one for all layers or one per layer; `n_embd_v_gqa`
        the V row widths when they differ from K's."""
        cache = cls.describe(size, n_embd_gqa, len(layer_devices), type_k, type_v, n_embd_v_gqa)
        k, v = cache.k, cache.v
        cache.pos = np.full(size, -1, np.int64)
        cache.seq = np.full(size, -1, np.int64)
        by_dev: dict[str, tuple[Device, list[Tensor]]] = {}
        for il, dev in enumerate(layer_devices):
            by_dev.setdefault(dev.name, (dev, []))[1].extend((k[il], v[il]))
        try:
            for dev, tensors in by_dev.values():
                buft = dev.buffer_type()
                buf = buft.alloc_buffer(sum(buft.alloc_size(t) for t in tensors), BufferUsage.ANY)
                cache.buffers.append(buf)
                for t in tensors:
                    buf.alloc_tensor(t)
                    buf.zeros(t)  # type: ignore[attr-defined]
        except OutOfMemoryError:
            cache.free()
            raise
        return cache

    @classmethod
    def describe(
        cls,
        size: int,
        n_embd_gqa: int | Sequence[int],
        n_layer: int,
        type_k: GGMLType = GGMLType.F16,
        type_v: GGMLType = GGMLType.F16,
        n_embd_v_gqa: Sequence[int] | None = None,
    ) -> KVCache:
        """The cache's tensors without memory (for planning, and for `create`)."""
        kw = [n_embd_gqa] * n_layer if isinstance(n_embd_gqa, int) else list(n_embd_gqa)
        vw = kw if n_embd_v_gqa is None else list(n_embd_v_gqa)
        for t in (type_k, type_v):
            if t not in CACHE_TYPES:
                raise UnsupportedError(
                    f"KV cache type {t.name.lower()}: supported are {', '.join(c.name.lower() for c in CACHE_TYPES)}"
                )
        k = [Tensor(f"cache_k_l{il}", (size, kw[il]), type_k) for il in range(n_layer)]
        v = [Tensor(f"cache_v_l{il}", (size, vw[il]), type_v) for il in range(n_layer)]
        return cls(size, k, v)

    def set_rotation(self, head_k: int, head_v: int) -> None:
        """llama.cpp's attn_rot_k/v for a quantized cache: K rows in runs of the largest power of
        two (>= 64) dividing the head size, V rows in runs of 64; off for f32/f16 or other heads."""
        for tensors, head, largest in ((self.k, head_k, True), (self.v, head_v, False)):
            if not tensors or tensors[0].type not in (GGMLType.Q8_0, GGMLType.Q4_0) or head % 64:
                continue
            n = 64
            while largest and head % (2 * n) == 0:
                n *= 2
            for t in tensors:
                t.params["rot"] = n

    def nbytes_by_device(self) -> dict[str, int]:
        return {b.name: b.nbytes for b in self.buffers}

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers.clear()

    # -- cells ----------------------------------------------------------------------------

    def clear(self) -> None:
        self.version += 1
        self.pos[:] = -1
        self.seq[:] = -1
        self.share = np.zeros(0, np.uint64)

    def _shared(self) -> np.ndarray | None:
        """`share`, or None while no cell is shared (the common case costs nothing)."""
        sh = self.share
        return sh if len(sh) == self.size and sh.any() else None

    def holds(self, seq_id: int) -> np.ndarray:
        """Which cells sequence `seq_id` holds (owns or shares)."""
        sel = self.seq == seq_id
        sh = self._shared()
        if sh is not None and 0 <= seq_id < MAX_SHARE_SEQ:
            sel |= (sh >> np.uint64(seq_id)) & np.uint64(1) != 0
        return sel

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Forget cells of `seq_id` at positions [p0, p1) (p1 < 0: to the end). A cell another
        sequence shares stays, owned by the lowest of them."""
        self.version += 1
        rng = self.pos >= p0
        if p1 >= 0:
            rng &= self.pos < p1
        sel = (self.seq == seq_id) & rng
        sh = self._shared()
        if sh is not None:
            if 0 <= seq_id < MAX_SHARE_SEQ:
                sh[rng] &= ~np.uint64(1 << seq_id)
            heirs = np.flatnonzero(sel & (sh != 0))
            for i in heirs.tolist():  # few cells: a shared prefix whose owner leaves
                bits = int(sh[i])
                low = (bits & -bits).bit_length() - 1
                self.seq[i] = low
                sh[i] = np.uint64(bits & ~(1 << low))
            sel[heirs] = False
        self.pos[sel] = -1
        self.seq[sel] = -1

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Sequence `dst` also holds `src`'s cells at positions [p0, p1) (p1 < 0: to the end):
        llama_memory_seq_cp on a unified cache, no K/V copied. `dst` must hold none of them."""
        if not 0 <= dst < MAX_SHARE_SEQ:
            raise UnsupportedError(f"seq_cp: sequence {dst} cannot share cells (ids below {MAX_SHARE_SEQ} can)")
        if src == dst:
            return
        self.version += 1
        sel = self.holds(src) & (self.pos >= p0)
        if p1 >= 0:
            sel &= self.pos < p1
        if len(self.share) != self.size:
            self.share = np.zeros(self.size, np.uint64)
        self.share[sel] |= np.uint64(1 << dst)

    def n_used(self) -> int:
        return int((self.pos >= 0).sum())

    def used_top(self) -> int:
        """One past the highest used cell (0: none), kept across decode steps (`_top`)."""
        top = self._top
        if top is None or top[0] != self.version:
            used = np.flatnonzero(self.pos >= 0)
            top = self._top = (self.version, int(used[-1]) + 1 if len(used) else 0)
        return top[1]

    def find_slot(self, n_tokens: int, seq: np.ndarray | None = None) -> np.ndarray:
        """Indices of `n_tokens` free cells, or ContextFullError. Without `seq`: the lowest. With
        the tokens' sequence ids (each sequence's tokens in position order): each token gets the
        lowest free cell after every cell its sequence already holds, where there is one, so a
        sequence's cells stay in position order — attention sums a query's cells in cell order,
        and then gets the same bits whether the sequence ran alone or beside others whose cells
        were freed (a reused slot's prompt cache). Where no such cell is left, the lowest free."""
        if n_tokens == 1 and seq is not None and len(seq) == 1:
            # a decode step: where the sequence holds the highest used cell (or none is used),
            # its next cell is the one after it — free, as is every cell past it (a free cell is
            # held by no sequence: seq_rm and release clear its share bits)
            top = self.used_top()
            if top == 0 or (top < self.size and self.seq[top - 1] == seq[0]):
                return np.array([top], np.int64)
        free = np.flatnonzero(self.pos < 0)
        if len(free) < n_tokens:
            raise ContextFullError(
                f"the context is full: {n_tokens} more tokens do not fit in {self.size} cells "
                f"({self.n_used()} used)"
            )
        if seq is None:
            return free[:n_tokens]
        seq = np.asarray(seq)
        if len(seq) and (seq == seq[0]).all():  # one sequence (a prompt, one slot's step)
            held = np.flatnonzero(self.holds(int(seq[0])))
            after = free[free > (held[-1] if len(held) else -1)]
            if len(after) >= n_tokens:
                return after[:n_tokens]
        taken = np.zeros(len(free), bool)
        out = np.empty(n_tokens, np.int64)
        last: dict[int, int] = {}
        for i, s in enumerate(seq.tolist()):
            if s not in last:
                held = np.flatnonzero(self.holds(s))
                last[s] = int(held[-1]) if len(held) else -1
            j = int(np.searchsorted(free, last[s] + 1))
            while j < len(free) and taken[j]:
                j += 1
            if j == len(free):  # nothing free after this sequence's cells: the lowest free
                j = int(np.flatnonzero(~taken)[0])
            taken[j] = True
            out[i] = free[j]
            last[s] = max(last[s], int(free[j]))
        return out

    def commit(self, idx: np.ndarray, pos: np.ndarray, seq: np.ndarray) -> None:
        was = self.version
        self.version += 1
        if len(idx) != 1:
            self.pos[idx] = pos
            self.seq[idx] = seq
            if len(self.share) == self.size:
                self.share[idx] = 0
            return
        # one cell (a decode step's): what the cache keeps for the next step carried over it
        c, p, s = int(idx[0]), int(pos[0]), int(seq[0])
        self.pos[c] = p
        self.seq[c] = s
        if len(self.share) == self.size:
            self.share[c] = 0
        top, row = self._top, self._row
        if top is not None and top[0] == was and p >= 0:
            self._top = (self.version, max(top[1], c + 1))
        if row is not None and row[0] == was and s == row[1] and p > row[2]:
            row[3][0, c] = 0  # the sequence's latest cell: every cell of it is visible to a query at p
            self._row = (self.version, s, p, row[3])

    def release(self, idx: np.ndarray) -> None:
        """Free cells a failed decode had taken (they were free before it)."""
        self.version += 1
        self.pos[idx] = -1
        self.seq[idx] = -1
        if len(self.share) == self.size:
            self.share[idx] = 0

    def n_kv(self, idx: np.ndarray) -> int:
        """Cells to attend to: up to the last used one, padded to N_KV_PAD (llama.cpp's n_kv)."""
        top = max(self.used_top(), max(idx.tolist()) + 1 if len(idx) else 0)
        return min(self.size, (top + N_KV_PAD - 1) // N_KV_PAD * N_KV_PAD)

    def mask(self, n_kv: int, pos: np.ndarray, seq: np.ndarray, n_swa: int = 0) -> np.ndarray:
        """(n_tokens, n_kv): 0 where a token may see a cell (same sequence, not in its future,
        and with `n_swa` > 0 less than `n_swa` positions back), -inf elsewhere (llama.cpp's
        kq_mask / kq_mask_swa). A decode step's one query gets a view of the row the cache keeps
        (`_row`): valid until the next change of the cells."""
        if len(pos) == 1 and n_swa == 0:
            row = self._row
            if row is None or row[0] != self.version or row[1] != seq[0] or row[2] > pos[0]:
                row = self._mask_row(int(seq[0]), int(pos[0]))
            if row is not None:
                return row[3][:, :n_kv]
        cp = self.pos[:n_kv][None, :]
        cs = self.seq[:n_kv][None, :]
        mine = cs == seq[:, None]
        sh = self._shared()
        if sh is not None:  # cells shared by several sequences (seq_cp)
            bit = np.where((seq >= 0) & (seq < MAX_SHARE_SEQ), seq, 0).astype(np.uint64)
            also = (sh[:n_kv][None, :] >> bit[:, None]) & np.uint64(1) != 0
            mine |= also & ((seq >= 0) & (seq < MAX_SHARE_SEQ))[:, None]
        ok = mine & (cp >= 0) & (cp <= pos[:, None])
        if n_swa > 0:
            ok &= pos[:, None] - cp < n_swa
        return np.where(ok, np.float32(0), np.float32(-np.inf)).astype(np.float32)

    def _mask_row(self, s: int, p: int) -> tuple[int, int, int, np.ndarray] | None:
        """The row `mask` gives a query of sequence `s` at `p` over the whole cache, kept as `_row`
        for the next steps when no cell is shared and no cell of `s` lies in the query's future
        (then a later query of `s` sees every cell of it; else None: `mask` computes it)."""
        if s < 0 or self._shared() is not None:
            return None
        mine = self.seq == s
        if (self.pos[mine] > p).any():
            return None
        old = self._row
        buf = old[3] if old is not None else np.empty((1, self.size), np.float32)
        np.copyto(buf[0], np.where(mine & (self.pos >= 0), np.float32(0), np.float32(-np.inf)))
        self._row = (self.version, s, p, buf)
        return self._row
