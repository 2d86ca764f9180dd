"""Ray devices without a cluster (backend/ray.py): each device's actor (ray_node.DeviceActor)
runs in this process behind a stand-in for its handle that copies every argument and result, as
Ray does, and a device can be made to die (its calls then fail as a lost node's do).

`install(setattr)` puts two such devices, RAY0 and RAY1, where `--ray` / LLAMAPY_RAY (any
address) finds devices: `setattr` is monkeypatch.setattr in a test, or the builtin in a subprocess script (see
SCRIPT, which runs the CLI so). The death of RAY1 is asked for with LLAMAPY_FAKE_RAY_DIE_AFTER=N
(after its N-th split run) or LLAMAPY_FAKE_RAY_DIE_FILE=PATH (once that file exists)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llamapy import ray_node
from llamapy.backend import ray as rb

LOST = "lost"  # what a dead device's calls return (the fake `wait` raises for it)

# a subprocess running the CLI on the in-process devices: python -c SCRIPT ARGS…
SCRIPT = (
    "import sys; sys.path.insert(0, {here!r}); import inprocess; inprocess.install(setattr); "
    "sys.argv = ['llamapy', *sys.argv[1:]]; from llamapy.cli import main; main()"
).format(here=str(Path(__file__).resolve().parent))


class Ref:
    def __init__(self, value: Any) -> None:
        self.value = value


def _copied(x: Any) -> Any:
    """An argument or a result as Ray hands it over: a copy, arrays read-only."""
    x = pickle.loads(pickle.dumps(x))
    for a in x if isinstance(x, (list, tuple)) else [x]:
        for y in a if isinstance(a, tuple) else [a]:
            if isinstance(y, np.ndarray):
                y.flags.writeable = False
    return x


class Handle:
    """A stand-in for an actor handle: `handle.method.remote(*args)` runs it here."""

    def __init__(self, die: Callable[[int], bool] = lambda n_runs: False) -> None:
        self.actor = ray_node.DeviceActor()
        self.die = die
        self.n_runs = 0
        self.dead = False

    def __getattr__(self, name: str) -> Any:
        f = getattr(self.actor, name)
        h = self

        class M:
            @staticmethod
            def remote(*args: Any) -> Ref:
                if name == "run":
                    h.n_runs += 1
                    h.dead = h.dead or h.die(h.n_runs)
                if h.dead or any(isinstance(x, Ref) and x.value is LOST for x in args):
                    return Ref(LOST)
                args = _copied([x.value if isinstance(x, Ref) else x for x in args])
                return Ref(_copied(f(*args)))

        return M


def _dies() -> Callable[[int], bool]:
    after = int(os.environ.get("LLAMAPY_FAKE_RAY_DIE_AFTER", "0") or 0)
    path = os.environ.get("LLAMAPY_FAKE_RAY_DIE_FILE", "")
    return lambda n: (after > 0 and n > after) or (bool(path) and os.path.exists(path))


class FakeDevice(rb.RayDevice):
    def actor(self) -> Any:
        if self._actor is None:  # a new actor after a loss: one that holds nothing
            self._actor = Handle()
        return self._actor


def fake_wait(device: str, ref: Any, what: str, dev: rb.RayDevice | None = None) -> Any:
    if isinstance(ref, Ref) and ref.value is LOST:
        raise rb.lost(device, f"{device}: device lost ({what}): the node died (simulated)", dev)
    return ref.value


def install(set_attr: Callable[..., Any], die: Callable[[int], bool] | None = None) -> list[FakeDevice]:
    """Two in-process devices for any LLAMAPY_RAY address; RAY1 dies when `die(n_runs)` says so
    (default: as the environment asks). Returns them (made at the first discovery)."""
    made: list[FakeDevice] = []

    def connect(address: str, actor_cls: type) -> list[rb.RayDevice]:
        made.clear()
        for i in range(2):
            d = FakeDevice(f"RAY{i}", f"node{i}", "here", 1 << 34, 1 << 34, ray_node.DeviceActor)
            d._actor = Handle(die or _dies()) if i == 1 else Handle()
            made.append(d)
        return list(made)

    set_attr(rb, "connect", connect)
    set_attr(rb, "wait", fake_wait)
    return made
