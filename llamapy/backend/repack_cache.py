"""A cache file of repacked weights, itself memory-mapped (the role of ggml-cpu's "CPU_REPACK"
buffer type, kept on disk so that repacking is paid once per model file, not once per run).

The first load of a model repacks its matrices in memory (backend/qmatmul.py) and writes them
here; later loads map the file and build every QMatrix from views of it: loading does no work
proportional to the weights, and the pages are file-backed, shared and droppable. A cache file
is keyed by the model's path, size and modification time and by the layout version, written to
a temporary name and renamed, and checked against its index before use; anything wrong with it
means "repack again", never an error.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..types import cache_dir

LAYOUT_VERSION = 2  # 2: f16 block scales in the repacked tiles (were float32)
ALIGN = 64
TRAILER = b"LLAMAPY-REPACK-1"


def cache_root() -> Path | None:
    """$LLAMAPY_REPACK_CACHE, else $LLAMAPY_CACHE/repack (~/.cache/llamapy/repack); None when
    LLAMAPY_REPACK_CACHE is 0 or off."""
    env = os.environ.get("LLAMAPY_REPACK_CACHE", "")
    if env.lower() in ("0", "off", "no"):
        return None
    if env:
        return Path(env)
    return cache_dir() / "repack"


@dataclass
class RepackStore:
    """Repacked arrays by tensor name: read from a mapped file, or collected for writing one."""

    path: Path
    index: dict[str, list[dict]] = field(default_factory=dict)
    pending: dict[str, list[np.ndarray]] = field(default_factory=dict)
    _map: mmap.mmap | None = None

    @classmethod
    def open(cls, key: str) -> RepackStore | None:
        """The store for `key`: its file mapped when one exists and checks out, else empty;
        None when the cache is switched off."""
        root = cache_root()
        if root is None:
            return None
        store = cls(root / f"{key}-v{LAYOUT_VERSION}.bin")
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
                meta = json.dumps({"version": LAYOUT_VERSION, "tensors": tensors}).encode()
                f.write(meta + len(meta).to_bytes(8, "little") + TRAILER)
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
        finally:
            self.pending.clear()
