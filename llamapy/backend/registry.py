"""Backend discovery (ggml-backend-reg.cpp: `ggml_backend_registry`, `load_backend`).

The built-in families are registered explicitly — GPU ones first, then BLAS, and the CPU last —
and third-party ones come from the entry-point group `llamapy.backends`. Each is imported lazily
and asked for a score; one that cannot load (no CuPy, no driver, no device) is recorded with
its reason and the run goes on without it. `LLAMAPY_BACKENDS=cpu,blas` restricts which load.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from .interface import Device, Registry

# name -> "module:function"; the order is the priority order of registration
BUILTINS: dict[str, str] = {
    "cuda": "llamapy.backend.cuda:registry",
    "ray": "llamapy.ray_node:registry",
    "test": "llamapy.backend.testgpu:registry",
    "blas": "llamapy.backend.blas:registry",
    "cpu": "llamapy.backend.cpu:registry",
}
ENTRY_POINT_GROUP = "llamapy.backends"


@dataclass
class RegistryStatus:
    name: str
    source: str  # "built-in" or the entry point's value
    registry: Registry | None = None
    error: str = ""  # why it did not load


@dataclass
class Discovery:
    statuses: list[RegistryStatus] = field(default_factory=list)

    def registries(self) -> list[Registry]:
        return [s.registry for s in self.statuses if s.registry is not None]

    def devices(self) -> list[Device]:
        """Every usable device, in priority order: GPU, then ACCEL, then CPU."""
        devs = [d for r in self.registries() for d in r.devices()]
        return sorted(devs, key=lambda d: d.type)  # stable: registration order within a type

    def device(self, name: str) -> Device:
        for d in self.devices():
            if d.name.upper() == name.upper():
                return d
        known = ", ".join(d.name for d in self.devices())
        from ..types import LlamapyError

        raise LlamapyError(f"unknown device {name!r} (available: {known})")


def _load(target: str | Callable[[], Registry]) -> Registry:
    if callable(target):
        return target()
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)()


_cache: Discovery | None = None


def discover(refresh: bool = False) -> Discovery:
    """Load every backend family once (cached; `refresh=True` reloads, e.g. in tests)."""
    global _cache
    if _cache is not None and not refresh:
        return _cache
    allow = {s.strip().lower() for s in os.environ.get("LLAMAPY_BACKENDS", "").split(",") if s.strip()}
    candidates: list[tuple[str, str, str | Callable[[], Registry]]] = [
        (name, "built-in", target) for name, target in BUILTINS.items()
    ]
    try:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name.lower() not in BUILTINS and ep.value not in BUILTINS.values():
                candidates.append((ep.name.lower(), ep.value, _entry_point_loader(ep)))
    except Exception as e:  # noqa: BLE001 - a broken plugin index must not stop a CPU run
        candidates.append(("entry-points", ENTRY_POINT_GROUP, _raiser(e)))
    disc = Discovery()
    for name, source, target in candidates:
        if allow and name not in allow and name != "cpu":
            continue  # the CPU is always loaded: it is every op's fallback
        st = RegistryStatus(name, source)
        try:
            reg = _load(target)
            if reg.score() <= 0:
                st.error = "not supported on this system (score 0)"
            else:
                st.registry = reg
        except Exception as e:  # noqa: BLE001 - report, never crash
            st.error = f"{type(e).__name__}: {e}".splitlines()[0]
        if name in ("test", "ray") and st.registry is None and not st.error:
            continue
        if name in ("test", "ray") and st.error.startswith("not supported"):
            continue  # TEST / RAY only show when LLAMAPY_TEST_GPU / LLAMAPY_RAY ask for them
        disc.statuses.append(st)
    _cache = disc
    return disc


def _entry_point_loader(ep: object) -> Callable[[], Registry]:
    def f() -> Registry:
        return ep.load()()  # type: ignore[attr-defined]

    return f


def _raiser(e: Exception) -> Callable[[], Registry]:
    def f() -> Registry:
        raise e

    return f
