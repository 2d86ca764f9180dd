"""BLAS thread control (ggml-blas's `ggml_backend_blas_set_n_threads`), through threadpoolctl.

OpenBLAS picks its own thread count per call; on two cores a two-thread call on a small product
can take 40x longer than a one-thread call when the other core is busy (measured: 8 ms vs 0.2 ms
for 384x64x256). So the weight GEMMs use `-t` threads and the small per-head attention products
run on one. Without threadpoolctl nothing is changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_controllers: list[Any] | None = None
_current: int | None = None


def _blas() -> list[Any]:
    global _controllers
    if _controllers is None:
        try:
            from threadpoolctl import ThreadpoolController

            _controllers = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        except Exception:  # noqa: BLE001 - thread control is an optimization, never a failure
            _controllers = []
    return _controllers


def set_blas_threads(n: int) -> None:
    global _current
    if n <= 0 or n == _current:
        return
    for c in _blas():
        c.set_num_threads(n)
    _current = n


@contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Run a block with `n` BLAS threads, then restore the previous count."""
    before = _current
    set_blas_threads(n)
    try:
        yield
    finally:
        if before is not None:
            set_blas_threads(before)
