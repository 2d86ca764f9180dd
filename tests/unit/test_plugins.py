"""A third-party backend installed as an entry point is found; one that fails to load is
reported and never stops a CPU run (ggml's load_backend / score)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "plugin_fixture"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("src") / "toy"
    shutil.copytree(FIXTURE, src)  # pip builds in place: keep the repository clean
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.fail(f"pip could not install the fixture package: {r.stderr.strip().splitlines()[-1:]}")
    return target


def test_entry_point_backend_is_found_and_broken_one_reported(installed: Path, monkeypatch, tiny32) -> None:  # noqa: ANN001
    monkeypatch.syspath_prepend(str(installed))
    import importlib

    importlib.invalidate_caches()
    from llamapy.backend.registry import discover

    disc = discover(refresh=True)
    by_name = {s.name: s for s in disc.statuses}
    assert by_name["toy"].registry is not None and by_name["toy"].source == "toy_backend:registry"
    assert "TOY0" in [d.name for d in disc.devices()]
    assert by_name["broken"].registry is None and "libtoy.so" in by_name["broken"].error
    # the run goes on: TOY0 sits between GPU and CPU and takes the ADDs it claims
    import llamapy

    with llamapy.Llama(tiny32, n_ctx=128) as llm:
        assert [b.name for b in llm.ctx.backends][-2:] == ["TOY0", "CPU"]
        assert len(llm.generate("Hi", n_predict=2, temp=0).tokens) >= 1
        g = llm.ctx.graph(1, 1)
        plan = llm.ctx.sched.reserve(g.graph)
        adds = [n for n in g.graph.nodes if n.op.name == "ADD"]
        assert {llm.ctx.backends[plan.assignment[n]].name for n in adds} == {"TOY0"}


def test_backends_env_restricts(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_BACKENDS", "cpu")
    from llamapy.backend.registry import discover

    assert [d.name for d in discover(refresh=True).devices()] == ["CPU"]
