"""The Ray device tests (backend/ray.py), run on a simulated cluster on loopback: this test
re-runs pytest on tests/ray/cluster_checks.py inside a network namespace that has only
loopback (`unshare -n`, `ip link set lo up`), where Ray binds 127.0.0.1 — so that nothing
leaves the machine — with one cluster for all of them (started by a session fixture there).
Skipped, with the reason, without Ray or without the rights to make a namespace."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _namespace_reason() -> str:
    """Why a loopback-only namespace cannot be made here ("" when it can)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip not found"
    r = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True, timeout=30)
    return "" if r.returncode == 0 else f"unshare -n: {r.stderr.strip() or r.returncode}"


def test_ray_devices_on_a_loopback_cluster() -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'llamapy[ray]')")
    why = _namespace_reason()
    if why:
        pytest.skip(f"no loopback-only network namespace: {why}")
    env = dict(os.environ, LLAMAPY_RAY_INNER="1", RAY_USAGE_STATS_ENABLED="0")
    env.pop("LLAMAPY_RAY", None)
    cmd = (
        "ip link set lo up && exec " + " ".join(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-x",
             "-rs", str(HERE / "cluster_checks.py")]
        )
    )  # fmt: skip
    r = subprocess.run(["unshare", "-n", "bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1500)  # fmt: skip
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    # every check ran and passed: a skip inside is no pass here
    m = re.search(r"(\d+) passed", r.stdout)
    assert m and int(m.group(1)) >= 5, tail
    assert not re.search(r"\d+ (skipped|failed|error)", r.stdout), tail
