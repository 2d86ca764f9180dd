"""Host memory as the kernel reports it (ggml-cpu's `ggml_backend_cpu_device_get_memory`, which
reads /proc/meminfo on Linux).

The free figure is **MemAvailable** — what a new allocation can get, page cache and reclaimable
slabs included — not MemFree, which on a machine that has read a few files is a fraction of it
(a 23 GB-available machine may show 3 GB "free"). Every host-memory check and `llamapy devices`
use this one figure. Where /proc/meminfo is missing (macOS, Windows) sysconf's page counts are
the fallback.
"""

from __future__ import annotations

import os


def read_meminfo() -> str:
    """The text of /proc/meminfo, or "" where there is none (tests replace this function)."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def parse_meminfo(text: str) -> dict[str, int]:
    """`Key:   1234 kB` lines -> {key: bytes}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        out[key.strip()] = value * 1024 if unit == "kb" else value
    return out


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory; (0, 0) when unknown."""
    info = parse_meminfo(read_meminfo())
    total = info.get("MemTotal", 0)
    avail = info.get("MemAvailable")
    if total and avail is not None:
        return avail, total
    try:  # no /proc/meminfo (or a kernel older than 3.14): sysconf's free pages
        size = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * size, os.sysconf("SC_PHYS_PAGES") * size
    except (ValueError, OSError, AttributeError):
        return 0, total
