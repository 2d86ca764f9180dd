"""The repository's own text files: no merge left half done (main's README once carried a
conflict's markers in its Python API lines)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# git's conflict markers, each alone at the start of a line (a "=======" line alone is a
# Markdown heading underline, so only the two outer markers count)
MARKER = re.compile(r"^(<{7}|>{7})( |$)", re.M)
SUFFIXES = {".md", ".py", ".toml", ".sh", ".c", ".h", ".cu", ".cuh", ".cpp", ".jinja", ".cfg", ".txt", ".yml", ".yaml"}
# the project's own folders (not a virtual environment or a cache someone keeps in the checkout)
ROOTS = ("docs", "llamapy", "tests", "bench", "fuzz", "models", ".ci")
SKIP = {"__pycache__", "build", "_kernels"}


def _text_files() -> list[Path]:
    out = [p for p in REPO.iterdir() if p.is_file() and p.suffix in SUFFIXES]
    for root in ROOTS:
        for p in (REPO / root).rglob("*"):
            if p.is_file() and (p.suffix in SUFFIXES or p.parent.name == ".ci") and not SKIP & set(p.relative_to(REPO).parts):
                out.append(p)
    return out


def test_no_merge_conflict_markers() -> None:
    files = _text_files()
    assert any(p.name == "README.md" for p in files)
    bad = []
    for p in files:
        text = p.read_text(errors="replace")
        for m in MARKER.finditer(text):
            bad.append(f"{p.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not bad, f"merge conflict markers at {', '.join(bad)}"
