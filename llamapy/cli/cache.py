"""`llamapy cache list|clear`: the repacked-weights cache (backend/repack_cache.py; ggml has no
counterpart on disk — its CPU_REPACK buffers are rebuilt at every load).

`list` prints one line per entry, most recently used first (size, last use, model name, file),
then the total against the bound ($LLAMAPY_REPACK_CACHE_MAX); `clear` removes every entry.
Only files named as cache entries are listed or removed.
"""

from __future__ import annotations

import sys
import time

import typer

from ..types import LlamapyError
from . import app, log

_ACTIONS = ("list", "clear")


@app.command()
def cache(action: str = typer.Argument("list", help="list (default) or clear")) -> None:
    """List or clear the cache of repacked weights (one entry per model content)."""
    from ..backend import repack_cache as rc

    if action not in _ACTIONS:
        raise LlamapyError(f"cache {action}: expected one of {', '.join(_ACTIONS)}")
    root = rc.cache_root()
    if root is None:
        log("repack cache: off (LLAMAPY_REPACK_CACHE=0)")
        return
    if action == "clear":
        try:
            removed = rc.clear(root)
        except OSError as e:
            raise LlamapyError(f"repack cache {root}: cannot remove entries ({e.strerror or e})") from None
        freed = sum(e.nbytes for e in removed)
        log(f"repack cache {root}: removed {len(removed)} entries ({freed / 2**20:.1f} MiB)")
        return
    limit = rc.max_bytes()
    found = rc.entries(root)
    out = sys.stdout
    for e in found:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        stale = "" if e.version == rc.LAYOUT_VERSION else f"  (layout v{e.version}, unused)"
        out.write(f"{e.nbytes / 2**20:10.1f} MiB  {when}  {e.model or '?':<32} {e.path.name}{stale}\n")
    total = sum(e.nbytes for e in found)
    out.write(
        f"{len(found)} entries, {total / 2**20:.1f} MiB of {limit / 2**20:.0f} MiB (LLAMAPY_REPACK_CACHE_MAX) in {root}\n"
    )
    out.flush()
