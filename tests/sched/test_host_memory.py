"""Host memory is MemAvailable (what an allocation can get, page cache included), not MemFree:
the KV-cache check and `llamapy devices` use that one figure. /proc/meminfo is faked through
`hostmem.read_meminfo`; nothing is allocated to provoke the checks."""

from __future__ import annotations

import re

import pytest
from sched_support import cli, open_llm

from llamapy.backend import hostmem
from llamapy.backend.cpu import CPUDevice
from llamapy.types import OutOfMemoryError

MiB = 2**20


def _meminfo(total: int, free: int, available: int) -> str:
    """/proc/meminfo's layout, figures in kB."""
    return (
        f"MemTotal:       {total // 1024} kB\n"
        f"MemFree:        {free // 1024} kB\n"
        f"MemAvailable:   {available // 1024} kB\n"
        "Buffers:           53092 kB\n"
        "Cached:          3262080 kB\n"
        "HugePages_Total:       0\n"
    )


@pytest.fixture
def fake_meminfo(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    def use(total: int, free: int, available: int) -> None:
        monkeypatch.setattr(hostmem, "read_meminfo", lambda: _meminfo(total, free, available))

    return use


def test_parse_and_figures(fake_meminfo) -> None:  # noqa: ANN001
    assert hostmem.parse_meminfo("MemTotal: 2 kB\nHugePages_Total: 3\nbad line\nX: y kB") == {
        "MemTotal": 2048,
        "HugePages_Total": 3,
    }
    fake_meminfo(24 * 1024 * MiB, 3 * 1024 * MiB, 23 * 1024 * MiB)
    assert hostmem.host_memory() == (23 * 1024 * MiB, 24 * 1024 * MiB)
    assert CPUDevice().memory() == (23 * 1024 * MiB, 24 * 1024 * MiB)


def test_without_meminfo_sysconf_is_the_fallback(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(hostmem, "read_meminfo", lambda: "")
    free, total = hostmem.host_memory()
    assert 0 < free <= total


def test_kv_cache_check_uses_mem_available(tiny32, fake_meminfo) -> None:  # noqa: ANN001
    # tiny32's f16 KV cache (the default): 32 layers x 2 x 128 halves = 16 KiB a cell, 64 MiB at -c 4096
    fake_meminfo(24 * 1024 * MiB, 20 * 1024 * MiB, 32 * MiB)  # plenty free, little available
    with pytest.raises(OutOfMemoryError, match=r"-c 4096 needs 64 MiB of host memory .* only 32 MiB are available"):
        open_llm(tiny32, n_ctx=4096)
    fake_meminfo(24 * 1024 * MiB, 1 * MiB, 20 * 1024 * MiB)  # little free, plenty available
    with open_llm(tiny32, n_ctx=4096) as llm:
        assert llm.ctx.n_ctx == 4096


def test_devices_reports_mem_available() -> None:
    fake = _meminfo(24 * 1024 * MiB, 3 * 1024 * MiB, 23 * 1024 * MiB)
    prelude = f"import llamapy.backend.hostmem as m; m.read_meminfo = lambda: {fake!r}"
    r = cli("devices", prelude=prelude)
    assert r.returncode == 0, r.stderr
    cpu = next(line for line in r.stdout.splitlines() if re.match(r"\s+CPU\s", line))
    assert "23552/24576 MiB available" in cpu, cpu
