"""The node side of Ray devices (backend/ray.py): llama.cpp's rpc-server (tools/rpc), as a Ray actor.

One `DeviceActor` runs on each cluster node offering the `llamapy` resource. It holds that
device's tensors: weights read from the node's own copy of the GGUF (checked by content key) or,
when the node lacks the file, from the copy the driver sent once; the KV cache; and the splits the
driver created, run by id. It sits above the backends (it opens GGUF files and plans arenas as a
context does), which is why it is not in llamapy/backend/: the driver-side device, buffer and
backend there are handed this class by `registry`, the entry point backend/registry.py names.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .backend.interface import Buffer, BufferUsage, Registry
from .backend import ray as rb
from .backend.ray import check_params, check_shape, check_type, build_graph
from .tensor import Op, Tensor, TensorFlag
from .types import LlamapyError

def _cache_dir() -> Path:
    """Where a node keeps model files it was sent: $LLAMAPY_RAY_CACHE (read on the node), else
    $LLAMAPY_CACHE/ray-models (~/.cache/llamapy/ray-models)."""
    from .types import cache_dir

    env = os.environ.get("LLAMAPY_RAY_CACHE")
    return Path(env).expanduser() if env else cache_dir() / "ray-models"


class DeviceActor:
    """Holds one device's tensors on its node and runs the splits placed there."""

    def __init__(self) -> None:
        from .backend.cpu import CPU_BUFT, CPUDevice

        self.buft = CPU_BUFT
        self.backend = CPUDevice().init_backend()
        # every core of the node, as a local run: Ray starts workers with OMP_NUM_THREADS=1,
        # and BLAS sums (attention's products) in another order with another thread count
        self.backend.set_n_threads(0)
        self.tensors: dict[int, Tensor] = {}
        # the driver's buffer id -> the node's buffers for it (one per load / zeros call) and
        # the tensor ids they hold
        self.buffers: dict[int, tuple[list[Buffer], list[int]]] = {}
        self.graphs: dict[int, tuple[list[Tensor], list[Tensor], list[Tensor], Any, set[Tensor]]] = {}
        self.graph_leaves: dict[int, set[int]] = {}  # graph id -> the kept tensors it reads
        self.files: dict[str, Any] = {}  # content key -> open GGUFFile
        self.file_users: dict[str, set[int]] = {}  # content key -> the buffers loaded from it
        self.incoming: dict[str, Any] = {}  # content key -> file being received

    def info(self) -> dict[str, Any]:
        from .backend import hostmem

        free, total = hostmem.host_memory()
        return {"host": socket.gethostname(), "pid": os.getpid(), "free": free, "total": total}

    # weights ----------------------------------------------------------------------------

    def _open(self, path: str, key: str, size: int) -> Any:
        """The GGUF at `path` if it is the driver's file (same size and content key), else
        the copy cached here by content key, else None."""
        from .model.gguf import GGUFFile

        if key in self.files:
            return self.files[key]
        for p in (Path(path), _cache_dir() / f"{key}.gguf"):
            try:
                if not p.is_file() or p.stat().st_size != size:
                    continue
                gf = GGUFFile(p)
            except Exception:  # noqa: BLE001 - an unreadable file counts as absent
                continue
            if gf.content_key() == key:
                self.files[key] = gf
                return gf
            gf.close()
        return None

    def has_file(self, path: str, key: str, size: int) -> bool:
        return self._open(path, key, size) is not None

    def receive(self, key: str, offset: int, data: bytes, size: int) -> None:
        """A chunk of a model file this node lacks; written under a temporary name."""
        if not isinstance(key, str) or not key.isalnum():
            raise ValueError("bad content key")
        d = _cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{key}.gguf.part"
        f = self.incoming.get(key)
        if f is None:
            f = self.incoming[key] = open(tmp, "wb")  # noqa: SIM115 - closed by `received`
            f.truncate(size)
        f.seek(offset)
        f.write(data)

    def received(self, key: str, path: str, size: int) -> bool:
        f = self.incoming.pop(key)
        f.close()
        d = _cache_dir()
        os.replace(d / f"{key}.gguf.part", d / f"{key}.gguf")
        return self._open(path, key, size) is not None

    def load(self, bid: int, path: str, key: str, size: int, label: str, cpu_matmul: str,
             specs: list[tuple[Any, ...]]) -> int:
        """Allocate buffer `bid` and set each (tid, name, shape, type, ranges) from the file's
        byte ranges [(offset, nbytes), …]. Returns the bytes set."""
        from .model.loader import ConcatRows
        from .types import row_nbytes

        gf = self._open(path, key, size)
        if gf is None:
            raise FileNotFoundError(f"{path}: not on this node, and no copy with content key {key}")
        self.backend.set_cpu_matmul(cpu_matmul)  # the context's mode (an unknown one raises)
        tensors = []
        for tid, name, shape, tname, ranges in specs:
            t = Tensor(str(name), check_shape(shape), check_type(tname), flags=TensorFlag.WEIGHT)
            tensors.append((tid, t, ranges))
        buf = self.buft.alloc_buffer(sum(self.buft.alloc_size(t) for _, t, _ in tensors), BufferUsage.WEIGHTS)
        buf.use_cache(key, label, cpu_matmul)
        total = 0
        for tid, t, ranges in tensors:
            row = row_nbytes(t.type, t.shape[-1])
            parts = []
            for off, n in ranges:
                if not (0 <= off and 0 < n and off + n <= gf.size):
                    raise ValueError(f"{t.name}: byte range outside the file")
                # (a fused bias's parts are shorter vectors: a row each, joined into one)
                width = row if len(t.shape) > 1 else n
                parts.append(np.frombuffer(gf._buf, np.uint8, count=n, offset=off).reshape(-1, width))
            if sum(p.nbytes for p in parts) != t.nbytes:
                raise ValueError(f"{t.name}: {sum(p.nbytes for p in parts)} bytes for a {t.nbytes}-byte tensor")
            buf.alloc_tensor(t)
            data = parts[0] if len(parts) == 1 else ConcatRows(parts, axis=int(len(t.shape) == 1))
            buf.set(t, data)  # type: ignore[arg-type]
            self.tensors[tid] = t
            total += t.nbytes
        buf.finish_loading()
        self._add(bid, buf, [tid for tid, _, _ in tensors])
        self.file_users.setdefault(key, set()).add(bid)
        return total

    def zeros(self, bid: int, specs: list[tuple[Any, ...]]) -> None:
        """Buffer `bid` of zero-filled mutable tensors (the KV cache)."""
        tensors = []
        for tid, name, shape, tname, params in specs:
            tensors.append((tid, Tensor(str(name), check_shape(shape), check_type(tname), params=check_params(params))))
        buf = self.buft.alloc_buffer(sum(self.buft.alloc_size(t) for _, t in tensors), BufferUsage.ANY)
        for tid, t in tensors:
            buf.alloc_tensor(t)
            buf.zeros(t)
            self.tensors[tid] = t
        self._add(bid, buf, [tid for tid, _ in tensors])

    def _add(self, bid: int, buf: Buffer, tids: list[int]) -> None:
        bufs, held = self.buffers.setdefault(bid, ([], []))
        bufs.append(buf)
        held.extend(tids)

    def clear(self, bid: int, value: float) -> None:
        for buf in self.buffers[bid][0]:
            buf.clear(float(value))

    def get(self, tid: int) -> np.ndarray:
        t = self.tensors[tid]
        return t.buffer.get(t)  # type: ignore[union-attr]

    def free(self, bid: int) -> None:
        entry = self.buffers.pop(bid, None)
        if entry is None:
            return
        bufs, tids = entry
        for tid in tids:
            self.tensors.pop(tid, None)
        gone = set(tids)
        for gid in [g for g, used in self.graph_leaves.items() if used & gone]:
            del self.graphs[gid], self.graph_leaves[gid]  # their plans hold the freed values
        for buf in bufs:
            buf.free()
        # the last buffer read from a file is gone (the driver closed its model): unmap the file
        for key, users in list(self.file_users.items()):
            users.discard(bid)
            if not users:
                del self.file_users[key]
                gf = self.files.pop(key, None)
                if gf is not None:
                    gf.close()

    # graphs -----------------------------------------------------------------------------

    def create(self, gid: int, recs: Any, in_recs: Any, leaf_recs: Any, exports: Any) -> None:
        from .sched.alloc import plan_offsets

        nodes, inputs, outs = build_graph(recs, in_recs, leaf_recs, self.tensors, len(exports), exports)
        plan = self.backend.graph_plan_create(nodes, outs, plan_offsets)
        masks = {n.src[3] for n in nodes if n.op is Op.FLASH_ATTN_EXT}  # narrower values: ops.flash_attn_ext
        self.graphs[gid] = (nodes, inputs, outs, plan, masks)
        self.graph_leaves[gid] = {r[0] for r in leaf_recs}

    def run(self, gid: int, picks: Sequence[int], *values: Any) -> tuple[np.ndarray, ...]:
        """Run graph `gid`. values[k] is input k, or (picks[k] >= 0) a tuple of arrays (another
        remote split's results, resolved by Ray from its reference) of which element picks[k]."""
        nodes, inputs, outs, plan, masks = self.graphs[gid]
        if len(values) != len(inputs):
            raise ValueError(f"graph {gid}: {len(values)} inputs for {len(inputs)}")
        env: dict[Tensor, Any] = {}
        for t, v, pick in zip(inputs, values, picks):
            a = v[pick] if pick >= 0 else v
            narrow = t in masks and isinstance(a, np.ndarray) and a.shape[:-1] == t.shape[:-1] and a.shape[-1] <= t.shape[-1]
            if not isinstance(a, np.ndarray) or (a.size != t.n_elements and not narrow):
                raise ValueError(f"input {t.name}: {getattr(a, 'shape', type(a).__name__)} for {list(t.shape)}")
            env[t] = a.reshape(t.shape) if a.shape != t.shape and not narrow else a
        if plan:
            self.backend.graph_plan_compute(plan, env)
        else:
            self.backend.compute(nodes, env)
        return tuple(np.ascontiguousarray(env[o]) for o in outs)

    def set_n_threads(self, n: int) -> None:
        self.backend.set_n_threads(max(int(n), 0))


def registry() -> Registry:
    """Entry point: the RAY registry when LLAMAPY_RAY names a cluster (else none, hidden)."""
    address = os.environ.get(rb.ENV_ADDRESS, "").strip()
    if not address:
        return rb.RayRegistry([])
    devs = rb.connect(address, DeviceActor)
    if not devs:
        raise LlamapyError(f"--ray {address}: no alive node offers the resource {rb.RESOURCE!r}")
    return rb.RayRegistry(devs)  # type: ignore[arg-type]
