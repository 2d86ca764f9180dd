"""A cache file of repacked weights, itself memory-mapped (the role of ggml-cpu's "CPU_REPACK"
buffer type, kept on disk so that repacking is paid once per model, not once per run).

The first load of a model repacks its matrices in memory (backend/qmatmul.py) and writes them
here; later loads map the file and build every QMatrix from views of it: loading does no work
proportional to the weights, and the pages are file-backed, shared and droppable.

An entry is keyed by the model's content (the loader passes GGUFFile.content_key), not its
path: a copy, a moved or a touched file reuses the same entry. It is written to a temporary name and renamed, and checked
against its index before use; anything wrong with it means "repack again", never an error. The
folder is bounded by size (`max_bytes`, $LLAMAPY_REPACK_CACHE_MAX, default 16G): after an entry
is written, the least recently used ones are removed until the rest fit (the newest always
stays). A folder that cannot be written is not an error either, but the store records why
(`note`) so that the CLI can say it: every load then repacks again.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..types import LlamapyError, cache_dir

LAYOUT_VERSION = 2  # 2: f16 block scales in the repacked tiles (were float32)
ALIGN = 64
TRAILER = b"LLAMAPY-REPACK-1"
DEFAULT_MAX = "16G"
# what the cache folder may hold that `cache clear` and eviction remove (nothing else is touched)
_ENTRY_RX = re.compile(r"^[0-9a-f]{32}-v\d+\.bin$")
_TMP_RX = re.compile(r"^[0-9a-f]{32}-v\d+\.tmp\d+$")
_TMP_AGE = 3600.0  # a temporary file this old belongs to no running writer


def cache_root() -> Path | None:
    """$LLAMAPY_REPACK_CACHE, else $LLAMAPY_CACHE/repack (~/.cache/llamapy/repack); None when
    LLAMAPY_REPACK_CACHE is 0 or off."""
    env = os.environ.get("LLAMAPY_REPACK_CACHE", "")
    if env.lower() in ("0", "off", "no"):
        return None
    return Path(env) if env else cache_dir() / "repack"


def max_bytes() -> int:
    """The folder's bound: $LLAMAPY_REPACK_CACHE_MAX (bytes, or with a K/M/G/T suffix)."""
    env = os.environ.get("LLAMAPY_REPACK_CACHE_MAX", "") or DEFAULT_MAX
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", env, re.IGNORECASE)
    if m is None:
        raise LlamapyError(f"LLAMAPY_REPACK_CACHE_MAX={env}: expected a size such as 500M or 16G")
    unit = m.group(2).upper()
    return int(m.group(1)) * (1024 ** ("KMGT".index(unit) + 1) if unit else 1)


@dataclass
class RepackStore:
    """Repacked arrays by tensor name: read from a mapped file, or collected for writing one."""

    path: Path
    label: str = ""  # the model's name, for `llamapy cache list`
    index: dict[str, list[dict]] = field(default_factory=dict)
    pending: dict[str, list[np.ndarray]] = field(default_factory=dict)
    note: str | None = None  # why the cache could not be written (said by the CLI), else None
    _map: mmap.mmap | None = None

    @classmethod
    def open(cls, key: str, label: str = "") -> RepackStore | None:
        """The store for `key`: its file mapped when one exists and checks out, else empty;
        None when the cache is switched off."""
        root = cache_root()
        if root is None:
            return None
        store = cls(root / f"{key}-v{LAYOUT_VERSION}.bin", label)
        try:
            fd = os.open(store.path, os.O_RDONLY)
        except OSError:
            return store
        try:
            size = os.fstat(fd).st_size
            if size < len(TRAILER) + 8:
                return store
            m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError:
            return store
        finally:
            os.close(fd)
        try:
            if m[size - len(TRAILER) :] != TRAILER:
                return store
            n = int.from_bytes(m[size - len(TRAILER) - 8 : size - len(TRAILER)], "little")
            meta = json.loads(m[size - len(TRAILER) - 8 - n : size - len(TRAILER) - 8])
            if meta.get("version") != LAYOUT_VERSION:
                return store
            store.index, store._map = meta["tensors"], m
        except (ValueError, KeyError, TypeError, OverflowError):
            store.index = {}
            return store
        try:  # its modification time says when it was last used (eviction removes the oldest)
            os.utime(store.path)
        except OSError:
            pass
        return store

    def close(self) -> None:
        """Unmap the file. Views still held elsewhere keep it mapped until they go."""
        m, self._map = self._map, None
        self.index, self.pending = {}, {}
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass

    def get(self, name: str) -> list[np.ndarray] | None:
        entry = self.index.get(name)
        if entry is None or self._map is None:
            return None
        try:
            return [
                np.frombuffer(self._map, np.dtype(a["dtype"]), int(np.prod(a["shape"])), a["offset"]).reshape(a["shape"])
                for a in entry
            ]
        except (ValueError, TypeError):
            return None

    def put(self, name: str, arrays: list[np.ndarray]) -> None:
        self.pending[name] = arrays

    def write(self) -> None:
        """Write a new cache file with what was collected plus what the old one held; failures
        are ignored: the cache only saves time. The file is renamed into place whole, its index
        at its end, so a reader sees either the old file or the new one."""
        if not self.pending:
            return
        for name in self.index:
            if name not in self.pending:
                old = self.get(name)
                if old is not None:
                    self.pending[name] = old
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tensors: dict[str, list[dict]] = {}
            off = 0
            with open(tmp, "wb") as f:
                for name, arrays in self.pending.items():
                    entries = []
                    for a in arrays:
                        pad = (-off) % ALIGN
                        f.write(b"\0" * pad)
                        off += pad
                        a = np.ascontiguousarray(a)
                        f.write(a.tobytes())
                        entries.append({"dtype": a.dtype.str, "shape": list(a.shape), "offset": off})
                        off += a.nbytes
                    tensors[name] = entries
                meta = json.dumps({"version": LAYOUT_VERSION, "model": self.label, "tensors": tensors}).encode()
                f.write(meta + len(meta).to_bytes(8, "little") + TRAILER)
            os.replace(tmp, self.path)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.note = (
                f"repack cache {self.path.parent}: cannot write ({e.strerror or e}): the weights are "
                "repacked again at every load (LLAMAPY_REPACK_CACHE=DIR for another folder, 0 for none)"
            )
            return
        finally:
            self.pending.clear()
        try:
            evict(self.path.parent, keep=self.path)
        except OSError:
            pass
        except LlamapyError as e:  # a malformed LLAMAPY_REPACK_CACHE_MAX: nothing is evicted
            self.note = f"repack cache: {e}; nothing was evicted"


# -- the folder (llamapy cache list|clear) -----------------------------------------------------


@dataclass
class CacheEntry:
    path: Path
    nbytes: int
    last_used: float  # the file's modification time: written or last mapped
    model: str  # the model's name when it was written ("" when unknown)
    version: int  # its layout version (only LAYOUT_VERSION is read)


def entries(root: Path | None = None) -> list[CacheEntry]:
    """The cache files in `root` (default: cache_root()), most recently used first."""
    root = root if root is not None else cache_root()
    if root is None or not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if not _ENTRY_RX.match(p.name):
            continue
        try:
            st = p.stat()
        except OSError:
            continue
        out.append(CacheEntry(p, st.st_size, st.st_mtime, _label(p, st.st_size), int(p.stem.rsplit("-v", 1)[1])))
    out.sort(key=lambda e: e.last_used, reverse=True)
    return out


def _label(p: Path, size: int) -> str:
    """The `model` field of a cache file's index (read from its end), "" when unreadable."""
    try:
        with open(p, "rb") as f:
            f.seek(size - len(TRAILER) - 8)
            tail = f.read(8 + len(TRAILER))
            if tail[8:] != TRAILER:
                return ""
            n = int.from_bytes(tail[:8], "little")
            if n > size:
                return ""
            f.seek(size - len(TRAILER) - 8 - n)
            return str(json.loads(f.read(n)).get("model", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def evict(root: Path, keep: Path | None = None, limit: int | None = None) -> list[CacheEntry]:
    """Remove the least recently used entries until the rest fit `limit` bytes (default
    max_bytes()); `keep` (the entry just written) always stays. Also removes temporary files
    left by writers that died. Returns what was removed."""
    limit = max_bytes() if limit is None else limit
    removed = []
    total = 0
    for e in entries(root):
        total += e.nbytes
        if total > limit and e.path != keep:
            try:
                e.path.unlink()
            except FileNotFoundError:
                pass
            removed.append(e)
            total -= e.nbytes
    _remove_stale_tmp(root)
    return removed


def clear(root: Path | None = None) -> list[CacheEntry]:
    """Remove every entry (and stale temporary file) of the folder; returns what was removed."""
    root = root if root is not None else cache_root()
    if root is None:
        return []
    removed = []
    for e in entries(root):
        try:
            e.path.unlink()
        except FileNotFoundError:
            continue
        removed.append(e)
    _remove_stale_tmp(root)
    return removed


def _remove_stale_tmp(root: Path) -> None:
    if not root.is_dir():
        return
    now = time.time()
    for p in root.iterdir():
        try:
            if _TMP_RX.match(p.name) and now - p.stat().st_mtime > _TMP_AGE:
                p.unlink()
        except OSError:
            pass
