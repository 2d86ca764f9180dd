"""Helpers the tests import (pytest puts this folder on sys.path with conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared(*parts: str) -> Path:
    """A file under ../shared, read in place; the test is skipped where it is missing."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is not available")
    return p
