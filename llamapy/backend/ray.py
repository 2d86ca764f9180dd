"""Other hosts as devices, on a Ray cluster: llamapy's counterpart of llama.cpp's RPC backend
(ggml-rpc.cpp, `--rpc host:port`), built on an existing distributed engine instead of a protocol
of its own.

`--ray ADDRESS` (or `LLAMAPY_RAY=ADDRESS`) connects to the cluster; every alive node offering the
custom resource `llamapy` becomes one GPU-like device, RAY0, RAY1, … (in the cluster's node
order), whose memory is the node's available host memory. `-ngl`, `-ts`, `-dev` and `-ot` place
layers on them as on GPUs; the scheduler splits the graph and copies between devices as for any
device with its own memory.

Each device is one actor pinned to its node (node affinity), holding that device's tensors:
- **weights** are read by the actor from the GGUF on its own node, after checking it is the same
  file (`GGUFFile.content_key`: size, header and tensor index, samples of every tensor). Only when
  the file is absent (or differs) there are the bytes sent, in chunks, once: the node keeps them
  under its llamapy cache by content key, and a later load reads them there (ggml-rpc's hash cache
  of PR #12620, by file rather than by tensor).
- **graphs**: a split's nodes are sent once as plain records (op name from an allowlist, shape,
  type, numeric/string params, sources by index: nothing callable travels; the actor validates
  every record) and cached by id; each micro-batch runs the split by id with only its inputs
  (activations, positions, mask, cell indices). The KV cache stays on the actor. Results are
  object references: a split that reads another remote split's output gets the reference, so
  consecutive remote splits chain inside the cluster and the driver waits once, when a host
  split or the graph's outputs need the values. The driver validates every array it receives
  (type, dtype, shape).
- **faults**: every wait has a timeout (`LLAMAPY_RAY_TIMEOUT`, seconds, default 120); a timeout or
  a lost node raises DeviceLostError naming the device. The device then forgets its actor (the
  stuck or dead one goes with its last handle) and starts a new epoch: what was made in the old
  one (buffers, split plans) raises DeviceLostError when used again, never reaching the new
  actor, and only a new load (a new context) uses the device again.

The actor (llamapy/ray_node.py, llama.cpp's rpc-server: it sits above the backends, reading the
GGUF and planning arenas as a context does) computes with the CPU backend of its node
(backend/cpu.py, its compiled executor plans included), so a remote split gives the same numbers
as that split run locally. The registry's entry point is ray_node.registry.

Trust: Ray moves pickled objects between its processes, so a Ray cluster must be trusted as a
whole (enable Ray's token authentication: docs/ray.md). What llamapy itself sends is data only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from ..tensor import Op, Tensor, TensorFlag
from ..types import DeviceLostError, DeviceType, GGMLType, LlamapyError, storage
from .device import CopyStats, DeviceMemoryBufferType
from .interface import Backend, Buffer, BufferType, BufferUsage, Device, DeviceProps, Registry
from .kernels import KERNELS

ENV_ADDRESS = "LLAMAPY_RAY"
ENV_TIMEOUT = "LLAMAPY_RAY_TIMEOUT"
RESOURCE = "llamapy"  # the custom resource a node offers to become a device
DEFAULT_TIMEOUT = 120.0
CHUNK = 64 << 20  # bytes per call when a model file must be sent to a node

# what may travel in an op record: the graph's ops (never NONE: leaves are declared separately)
ALLOWED_OPS = frozenset(op.name for op in KERNELS if op is not Op.NONE)
MAX_NODES = 1 << 16
MAX_DIMS = 8
_SCALARS = (bool, int, float, str, type(None))


def timeout_s() -> float:
    try:
        v = float(os.environ.get(ENV_TIMEOUT, "") or DEFAULT_TIMEOUT)
    except ValueError:
        raise LlamapyError(f"{ENV_TIMEOUT}={os.environ.get(ENV_TIMEOUT)!r}: expected seconds") from None
    if v <= 0:
        raise LlamapyError(f"{ENV_TIMEOUT}: must be > 0")
    return v


# -- records: what describes a split to an actor (data only) ---------------------------------
#
# The validators below are the one interface both sides share for what crosses the wire: the
# driver checks what it sends (graph_records), the node checks everything it receives
# (ray_node.DeviceActor: build_graph, load, zeros) with the same functions, so that the two
# cannot disagree on what is plain data. Each returns the value in its checked form, or raises
# ValueError naming what is wrong.


def check_param(v: Any, depth: int = 0) -> Any:
    """A param value as plain data: scalars (strings up to 256 characters), and tuples/lists of
    them (up to 64 items, nested up to 3 deep), lists returned as tuples."""
    if isinstance(v, _SCALARS) and not (isinstance(v, str) and len(v) > 256):
        return v
    if isinstance(v, (tuple, list)) and depth < 3 and len(v) <= 64:
        return tuple(check_param(x, depth + 1) for x in v)
    raise ValueError(f"param value of type {type(v).__name__} is not plain data")


def check_params(p: Any) -> dict[str, Any]:
    """An op's or tensor's params: a dict of at most 32 short string names to `check_param` values."""
    if not isinstance(p, dict) or len(p) > 32:
        raise ValueError("params must be a small dict")
    out = {}
    for k, v in p.items():
        if not isinstance(k, str) or len(k) > 64:
            raise ValueError("param names must be short strings")
        out[k] = check_param(v)
    return out


def check_shape(shape: Any) -> tuple[int, ...]:
    """A tensor shape: at most MAX_DIMS non-negative ints (below 2**40), as a tuple."""
    if not isinstance(shape, (tuple, list)) or len(shape) > MAX_DIMS:
        raise ValueError("bad shape")
    if not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise ValueError(f"bad shape {shape!r}")
    return tuple(shape)


def check_type(name: Any) -> GGMLType:
    """A tensor type by its GGMLType name (F32, Q4_K, …)."""
    if not isinstance(name, str) or name not in GGMLType.__members__:
        raise ValueError(f"unknown tensor type {name!r}")
    return GGMLType[name]


def _leaf_record(tid: int, t: Tensor) -> tuple[Any, ...]:
    return (tid, t.name, tuple(t.shape), t.type.name, check_params(_plain_params(t.params)))


def _plain_params(p: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in p.items() if isinstance(v, (*_SCALARS, tuple, list))}


# a source reference: ("n", i) node i of this split, ("l", tid) a tensor the actor keeps,
# ("i", k) the split's k-th input (sent with every run)


def graph_records(
    nodes: Sequence[Tensor], leaf_id: Callable[[Tensor], int | None]
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[Tensor], list[tuple[Any, ...]]]:
    """(node records, input records, input tensors, leaf records) describing `nodes`.

    A node record is (name, op, shape, type, params, sources, view_src); an input record
    (name, shape, type). Raises ValueError on anything that is not plain data."""
    index = {n: i for i, n in enumerate(nodes)}
    inputs: dict[Tensor, int] = {}
    leaves: dict[int, tuple[Any, ...]] = {}

    def ref(t: Tensor) -> tuple[str, int]:
        if t in index:
            return ("n", index[t])
        tid = leaf_id(t)
        if tid is not None:
            leaves.setdefault(tid, _leaf_record(tid, t))
            return ("l", tid)
        return ("i", inputs.setdefault(t, len(inputs)))

    recs = []
    for n in nodes:
        if n.op.name not in ALLOWED_OPS:
            raise ValueError(f"{n.op.name} cannot run on a remote device")
        srcs = tuple(ref(s) for s in n.src)
        vsrc = ref(n.view_src) if n.view_src is not None else None
        recs.append((n.name, n.op.name, tuple(n.shape), n.type.name, check_params(n.params), srcs, vsrc))
    in_recs = [(t.name, tuple(t.shape), t.type.name) for t in inputs]
    return recs, in_recs, list(inputs), list(leaves.values())


def build_graph(
    recs: Any, in_recs: Any, leaf_recs: Any, keep: dict[int, Tensor], n_exports: Any, exports: Any
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The actor side of `graph_records`: validate the records and make the split's tensors.
    `keep`: the actor's own tensors by id (their params are refreshed from the records: the
    KV cache's rotation is set after it is made). Returns (nodes, inputs, exports)."""
    if not isinstance(recs, list) or not 0 < len(recs) <= MAX_NODES:
        raise ValueError("bad node list")
    inputs = []
    for r in in_recs:
        name, shape, tname = r
        inputs.append(Tensor(str(name)[:256], check_shape(shape), check_type(tname), flags=TensorFlag.INPUT))
    for tid, _name, shape, tname, params in leaf_recs:
        t = keep.get(tid)
        if t is None:
            raise ValueError(f"tensor #{tid} is not on this device")
        if (t.shape, t.type) != (check_shape(shape), check_type(tname)):
            raise ValueError(f"tensor #{tid} ({t.name}) differs from the driver's")
        t.params.update(check_params(params))
    nodes: list[Tensor] = []

    def get(r: Any) -> Tensor:
        kind, i = r
        if type(i) is not int:
            raise ValueError("bad source index")
        if kind == "n" and 0 <= i < len(nodes):
            return nodes[i]
        if kind == "i" and 0 <= i < len(inputs):
            return inputs[i]
        if kind == "l" and i in keep:
            return keep[i]
        raise ValueError(f"bad source reference {r!r}")

    for name, opname, shape, tname, params, srcs, vsrc in recs:
        if opname not in ALLOWED_OPS:
            raise ValueError(f"op {opname!r} is not allowed")
        t = Tensor(str(name)[:256], check_shape(shape), check_type(tname), Op[opname],
                   tuple(get(s) for s in srcs), check_params(params))
        if vsrc is not None:
            t.view_src = get(vsrc)
        nodes.append(t)
    out = []
    for i in exports:
        if type(i) is not int or not 0 <= i < len(nodes):
            raise ValueError("bad export index")
        out.append(nodes[i])
    return nodes, inputs, out


# -- the driver side -------------------------------------------------------------------------


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LlamapyError("--ray needs Ray: pip install 'llamapy[ray]'") from None
    return ray


def _error_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None and cause is not e:
        e = cause
    text = str(e).strip().splitlines()
    # Ray's task errors repeat a traceback; the exception's own line is the last one
    line = next((ln for ln in reversed(text) if ln.strip() and not ln.startswith(" ")), type(e).__name__)
    return line[:300]


def wait(device: str, refs: Any, what: str, dev: RayDevice | None = None) -> Any:
    """ray.get with the timeout; failures become one LlamapyError naming the device: a timeout
    or a lost node a DeviceLostError, after which `dev` is lost (RayDevice.lose)."""
    ray = _ray()
    t = timeout_s()
    try:
        return ray.get(refs, timeout=t)
    except ray.exceptions.GetTimeoutError:
        msg = f"{device}: no answer within {t:g} s ({what}); set {ENV_TIMEOUT} to wait longer"
        raise lost(device, msg, dev) from None
    except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError) as e:
        raise lost(device, f"{device}: device lost ({what}): {_error_line(e)}", dev) from None
    except ray.exceptions.RayError as e:
        raise LlamapyError(f"{device}: {what} failed: {_error_line(e)}") from None


def lost(device: str, message: str, dev: RayDevice | None = None) -> DeviceLostError:
    """The error for a device that stopped answering; `dev` (when given) is lost from now on."""
    if dev is not None:
        dev.lose(message)
    return DeviceLostError(device, message)


@dataclass
class RemoteLeaf:
    """A tensor an actor keeps (weight, KV cache)."""

    device: RayDevice
    tid: int


class _Result:
    """One run's results: an object reference, fetched once."""

    __slots__ = ("device", "ref", "values")

    def __init__(self, device: RayDevice, ref: Any) -> None:
        self.device = device
        self.ref = ref
        self.values: tuple[np.ndarray, ...] | None = None

    def fetch(self) -> tuple[np.ndarray, ...]:
        if self.values is None:
            self.values = self.device.wait(self.ref, "compute")
        return self.values


@dataclass
class RemoteOut:
    """Output `index` of a remote run (the tensor `t`), validated when fetched."""

    result: _Result
    index: int
    t: Tensor

    def fetch(self) -> np.ndarray:
        vals = self.result.fetch()
        dev = self.result.device.name
        a = vals[self.index] if isinstance(vals, tuple) and self.index < len(vals) else None
        shape, dtype = storage(self.t.type, self.t.shape)
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != tuple(shape):
            got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise LlamapyError(f"{dev}: returned {got} for {self.t.name} ({np.dtype(dtype)}{list(shape)})")
        self.result.device.stats.bytes_out += a.nbytes
        return a


class RayBuffer(Buffer):
    buft: RayBufferType

    def __init__(self, buft: RayBufferType, nbytes: int, usage: BufferUsage) -> None:
        super().__init__(buft, nbytes, usage)
        self.bid = next(buft.device.ids)
        self._key = ""
        self._label = ""
        self._cpu_matmul = "q8"
        self._gf: Any = None
        self._pending: list[tuple[int, Tensor, Any]] = []
        self._remote = False  # the actor holds something for this buffer
        self._epoch = buft.device.epoch  # the device's actor this buffer's tensors are on

    def use_cache(self, key: str, label: str = "", cpu_matmul: str = "q8") -> None:
        self._key, self._label, self._cpu_matmul = key, label, cpu_matmul

    def use_file(self, gf: Any) -> None:
        self._gf = gf

    def set(self, t: Tensor, data: np.ndarray) -> None:
        if not t.flags & TensorFlag.WEIGHT:
            raise LlamapyError(f"{self.name}: only weights are set from the host")
        tid = next(self.buft.device.ids)
        self._store[t] = RemoteLeaf(self.buft.device, tid)
        self._pending.append((tid, t, data))

    def _ranges(self, data: Any) -> list[tuple[int, int]] | None:
        """Where `data` (views of the mapped file, or ConcatRows of them) lies in the file."""
        gf = self._gf
        if gf is None or not gf.tensors:
            return None
        first = next(iter(gf.tensors))
        base = gf.tensor_bytes(first).ctypes.data - gf.tensors[first].offset
        parts = getattr(data, "parts", None) or [data]
        out = []
        for p in parts:
            if not isinstance(p, np.ndarray) or not p.flags.c_contiguous:
                return None
            off = p.ctypes.data - base
            if not (0 <= off and off + p.nbytes <= gf.size):
                return None
            out.append((int(off), int(p.nbytes)))
        return out

    def finish_loading(self) -> None:
        dev = self.buft.device
        if not self._pending:
            return
        gf = self._gf
        if gf is not None and gf.splits:
            raise LlamapyError(
                f"{dev.name}: {gf.path.name} is split in {len(gf.splits) + 1} files; remote devices load "
                "weights from one file (merge it with llama-gguf-split --merge)"
            )
        specs = []
        for tid, t, data in self._pending:
            ranges = self._ranges(data)
            if ranges is None:
                raise LlamapyError(f"{dev.name}: {t.name} is not read from the model file; remote devices load weights from it")
            specs.append((tid, t.name, tuple(t.shape), t.type.name, ranges))
        path, size = str(Path(gf.path).resolve()), int(gf.size)
        dev.check_epoch(self._epoch)
        actor = dev.actor()
        if not dev.wait(actor.has_file.remote(path, self._key, size), "checking the model file"):
            dev.send_file(gf, self._key)
        self._remote = True
        dev.wait(actor.load.remote(self.bid, path, self._key, size, self._label, self._cpu_matmul, specs),
             "loading weights")
        self._pending.clear()

    def get(self, t: Tensor) -> np.ndarray:
        v = self._store[t]
        self.buft.device.check_epoch(self._epoch)
        return self.buft.device.fetch_leaf(v.tid)

    def zeros(self, t: Tensor) -> None:
        dev = self.buft.device
        dev.check_epoch(self._epoch)
        tid = next(dev.ids)
        self._store[t] = RemoteLeaf(dev, tid)
        self._mutable.append(t)
        dev.wait(dev.actor().zeros.remote(self.bid, [_leaf_record(tid, t)]), "allocating the KV cache")
        self._remote = True

    def clear(self, value: float = 0) -> None:
        if self._remote:
            dev = self.buft.device
            dev.check_epoch(self._epoch)
            dev.wait(dev.actor().clear.remote(self.bid, value), "clearing")

    def alias(self, t: Tensor, of: Tensor) -> None:
        if (t.shape, t.type) != (of.shape, of.type):
            raise LlamapyError(f"{self.name}: {t.name} cannot be a reshaped view on a remote device")
        super().alias(t, of)

    def free(self) -> None:
        dev = self.buft.device
        if self._remote and dev.alive() and dev.epoch == self._epoch:
            try:
                dev.wait(dev.actor().free.remote(self.bid), "freeing")
            except LlamapyError:
                pass  # a lost device has nothing left to free
        self._remote = False
        self._pending.clear()
        self._gf = None
        super().free()


class RayBufferType(DeviceMemoryBufferType):
    """The node's memory, with the budget it reported (device.py's accounting)."""

    def _new_buffer(self, nbytes: int, usage: BufferUsage) -> Buffer:
        return RayBuffer(self, nbytes, usage)


@dataclass
class RayPlan:
    """A split registered on the actor under `gid`."""

    gid: int
    inputs: list[Tensor]
    exports: list[Tensor]
    n_nodes: int
    epoch: int = 0  # the device's actor it was registered with

    def __bool__(self) -> bool:
        return True


class RayBackend(Backend):
    device: RayDevice

    def compute(self, nodes: Sequence[Tensor], env: dict[Tensor, Any]) -> None:
        # no plan given (the self test, a one-off graph): register the nodes and run them
        self.graph_plan_compute(self.graph_plan_create(nodes, list(nodes), lambda *a: None), env)

    def from_host(self, data: np.ndarray, t: Tensor | None = None) -> Any:
        if t is not None and t.flags & TensorFlag.WEIGHT:
            raise LlamapyError(f"{self.name}: host weights are not sent to remote devices per compute")
        a = np.ascontiguousarray(data)
        self.device.stats.bytes_in += a.nbytes
        self.device.stats.n_in += 1
        return a  # sent with the run that reads it

    def to_host(self, value: Any) -> np.ndarray:
        if isinstance(value, RemoteOut):
            return value.fetch()
        return value.device.fetch_leaf(value.tid) if isinstance(value, RemoteLeaf) else np.asarray(value)

    def copy_from(self, src: Backend, value: Any) -> Any | None:
        # another remote split's result: its reference goes on, the bytes stay in the cluster
        return value if isinstance(value, RemoteOut) else None

    def graph_plan_create(
        self, nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Callable[..., Any]
    ) -> Any | None:
        dev = self.device
        try:
            recs, in_recs, inputs, leaves = graph_records(nodes, dev.leaf_id)
        except ValueError as e:
            raise LlamapyError(f"{dev.name}: {e}") from None
        index = {n: i for i, n in enumerate(nodes)}
        outs = [index[e] for e in exports]
        gid = next(dev.ids)
        # ordered after this caller's earlier calls to the actor; a failure shows at the run
        dev.actor().create.remote(gid, recs, in_recs, leaves, outs)
        return RayPlan(gid, inputs, list(exports), len(nodes), dev.epoch)

    def graph_plan_compute(self, plan: Any, env: dict[Tensor, Any]) -> None:
        dev = self.device
        dev.check_epoch(plan.epoch)
        picks, values = [], []
        for t in plan.inputs:
            v = env.get(t)
            if v is None and t.root().buffer is not None:
                v = t.root().buffer.storage(t)
            if isinstance(v, RemoteOut) and v.result.values is None:
                picks.append(v.index)  # not fetched: the reference (Ray hands the actor the values)
                values.append(v.result.ref)
            elif isinstance(v, RemoteOut):
                picks.append(-1)
                values.append(v.fetch())
            elif isinstance(v, RemoteLeaf):
                picks.append(-1)
                values.append(v.device.fetch_leaf(v.tid))
            elif isinstance(v, np.ndarray):
                picks.append(-1)
                values.append(v)
            else:
                raise LlamapyError(f"{dev.name}: no value for input {t.name}")
        # not waited for here: a host split or the graph's outputs fetch it (to_host), another
        # remote split gets the reference (copy_from)
        res = _Result(dev, dev.actor().run.remote(plan.gid, picks, *values))
        for i, t in enumerate(plan.exports):
            env[t] = RemoteOut(res, i, t)

    def graph_plan_summary(self, plan: Any) -> str:
        return f"remote graph #{plan.gid}: {plan.n_nodes} nodes, {len(plan.inputs)} inputs" if plan else ""

    def set_n_threads(self, n_threads: int) -> None:
        # the context's -t, for the node's CPU backend (queued before any later call)
        self.device.actor().set_n_threads.remote(n_threads)


class RayDevice(Device):
    """One cluster node offering the `llamapy` resource."""

    type = DeviceType.GPU

    def __init__(self, name: str, node_id: str, host: str, free: int, total: int, actor_cls: type) -> None:
        self.name = name
        self.actor_cls = actor_cls  # the node side (llamapy/ray_node.py's DeviceActor)
        self.node_id = node_id
        self.host = host
        self.total = total
        self.description = f"Ray node {host} ({node_id[:8]})"
        self.stats = CopyStats()
        self.file_bytes_sent = 0  # model-file bytes this driver had to send (file absent there)
        self.ids = count(1)
        self._actor: Any = None
        self.epoch = 0  # + 1 each time the device is lost: its actor and all it held are gone
        self.lost_reason = ""
        self._buft = RayBufferType(self, free)

    def actor(self) -> Any:
        if self._actor is None:
            ray = _ray()
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            cls = ray.remote(self.actor_cls)
            self._actor = cls.options(
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            ).remote()
        return self._actor

    def alive(self) -> bool:
        return self._actor is not None

    def lose(self, reason: str) -> None:
        """The actor stopped answering: forget it (with its last handle Ray ends it, if it still
        runs) and start a new epoch, so that nothing made with the old one reaches a new one."""
        self._actor = None
        self.epoch += 1
        self.lost_reason = reason

    def check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise DeviceLostError(self.name, f"{self.lost_reason or self.name + ': device lost'} (load the model again)")

    def wait(self, refs: Any, what: str) -> Any:
        return wait(self.name, refs, what, self)

    def leaf_id(self, t: Tensor) -> int | None:
        r = t.root()
        buf = r.buffer
        if isinstance(buf, RayBuffer) and buf.buft.device is self:
            self.check_epoch(buf._epoch)
            v = buf._store.get(t) or buf._store.get(r)
            if isinstance(v, RemoteLeaf):
                return v.tid
        return None

    def fetch_leaf(self, tid: int) -> np.ndarray:
        a = self.wait(self.actor().get.remote(tid), "reading a tensor")
        if not isinstance(a, np.ndarray):
            raise LlamapyError(f"{self.name}: returned {type(a).__name__} for a tensor")
        return a

    def send_file(self, gf: Any, key: str) -> None:
        """The model file, in chunks from the driver's mapping, to a node that lacks it (kept
        there by content key)."""
        actor = self.actor()
        mem, size = gf._buf, int(gf.size)
        for off in range(0, size, CHUNK):
            data = bytes(mem[off : min(off + CHUNK, size)])
            self.wait(actor.receive.remote(key, off, data, size), "sending the model file")
            self.file_bytes_sent += len(data)
        if not self.wait(actor.received.remote(key, str(gf.path), size), "sending the model file"):
            raise LlamapyError(f"{self.name}: the model file sent does not check out on {self.host}")

    def props(self) -> DeviceProps:
        b = self._buft
        return DeviceProps(self.name, self.description, self.type, b.budget - b.allocated, b.budget)

    def buffer_type(self) -> BufferType:
        return self._buft

    def supports_op(self, node: Tensor) -> bool:
        return node.op.name in ALLOWED_OPS

    def init_backend(self) -> Backend:
        return RayBackend(self)


class RayRegistry(Registry):
    name = "RAY"

    def __init__(self, devices: list[Device]) -> None:
        self._devices = devices

    def devices(self) -> list[Device]:
        return self._devices

    def score(self) -> int:
        return 1 if self._devices else 0


def _quiet_driver() -> None:
    """Ray's driver prints the cluster's error messages (a node marked dead, …) on stdout from
    a thread of its own; stdout carries llamapy's tokens, and what matters reaches llamapy as an
    exception anyway. The thread's function is replaced by one that returns at once (a Ray
    internal: where it is missing, nothing is changed)."""
    try:
        from ray._private import worker
    except ImportError:
        return
    if callable(getattr(worker, "listen_error_messages", None)):
        worker.listen_error_messages = lambda *a, **k: None


def connect(address: str, actor_cls: type) -> list[RayDevice]:
    """Join the cluster at `address` and make one device per node offering `llamapy`, each run
    by an actor of `actor_cls` on its node (ray_node.DeviceActor: the node side lives above the
    backends, since it loads GGUF files and plans arenas as a context does)."""
    # Ray's token authentication (Ray >= 2.52), on unless RAY_AUTH_MODE says otherwise: the
    # token is RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token, as for
    # `ray start` (Ray reads it from this process's environment when imported, hence set here)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    ray = _ray()
    if not ray.is_initialized():
        _quiet_driver()
        outcome: list[BaseException | None] = []

        def join() -> None:
            try:
                ray.init(
                    address=address,
                    namespace="llamapy",
                    logging_level=logging.ERROR,
                    log_to_driver=False,
                    include_dashboard=False,
                    configure_logging=True,
                )
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                outcome.append(e)

        # ray.init retries an unreachable address for minutes: bounded by the timeout here
        th = threading.Thread(target=join, name="llamapy-ray-connect", daemon=True)
        th.start()
        th.join(timeout_s())
        if not outcome:
            raise LlamapyError(f"--ray {address}: no cluster answered within {timeout_s():g} s "
                               f"(set {ENV_TIMEOUT} to wait longer)")
        if outcome[0] is not None:
            raise LlamapyError(f"--ray {address}: cannot connect: {_error_line(outcome[0])}")
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(RESOURCE, 0) > 0]
    cands = [RayDevice(f"RAY{i}", n["NodeID"], n.get("NodeManagerAddress", "?"), 0, 0, actor_cls) for i, n in enumerate(nodes)]
    # each node says its own memory (its actor's first call; they start in parallel). A node
    # that died before the cluster noticed is still listed alive: its actor never starts, and
    # it is left out rather than failing the others
    infos = [d.actor().info.remote() for d in cands]
    devs: list[RayDevice] = []
    for d, ref in zip(cands, infos):
        try:
            info = d.wait(ref, "starting")
        except LlamapyError as e:
            if "device lost" in str(e):
                continue
            raise
        d.name = d._buft.name = f"RAY{len(devs)}"
        d.host = f"{info['host']}"
        d.description = f"Ray node {d.host} ({d.node_id[:8]})"
        d._buft.budget = int(info["free"])
        d.total = int(info["total"])
        devs.append(d)
    return devs
