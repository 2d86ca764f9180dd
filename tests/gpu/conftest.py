"""tests/gpu on the CUDA emulator: with `LLAMAPY_CUDA_EMU=1` (and g++), `cupy` is emu_cupy's
stand-in (installed here, before any test module imports cupy or llamapy discovers its
backends), so the CUDA tests run llamapy's CUDA backend unmodified on the CPU. Cases too slow for
the emulator or that only a GPU can check are marked with `needs_gpu` (skipped there, with the
reason). llamapy itself knows nothing of this."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

EMU: Any = None
if os.environ.get("LLAMAPY_CUDA_EMU") == "1" and shutil.which("g++") is not None:
    import emu_cupy

    EMU = emu_cupy.install()
    from llamapy.backend import registry

    registry.discover(refresh=True)


def needs_gpu(reason: str) -> pytest.MarkDecorator:
    """Skip on the emulator (LLAMAPY_CUDA_EMU=1), with why; runs on a GPU."""
    return pytest.mark.skipif(EMU is not None, reason=f"needs a real GPU on the CUDA emulator: {reason}")
