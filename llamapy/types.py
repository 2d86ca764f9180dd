"""Element types, errors and the cache directory shared by every layer (ggml.h's `enum ggml_type`, gguf-py's constants).

GGMLType's values are the GGUF numbers themselves (`GGMLType.Q4_0 == 2`), taken from the `gguf`
package so that llamapy and gguf-py can never disagree about a block size.
"""

from __future__ import annotations

import os
from enum import IntEnum
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# One enum for every layer: gguf-py's, under ggml's name.
GGMLType = GGMLQuantizationType

# The types a llama GGUF uses and llamapy computes with.
SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(
    GGMLType[n]
    for n in (
        "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4".split()
    )
)


def cache_dir() -> Path:
    """Where llamapy keeps what it makes once (the default model, repacked weights, compiled
    kernels): `$LLAMAPY_CACHE`, else `~/.cache/llamapy`."""
    env = os.environ.get("LLAMAPY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llamapy"


def block_size(t: GGMLType) -> tuple[int, int]:
    """(elements per block, bytes per block), as in ggml's type traits."""
    return GGML_QUANT_SIZES[t]


def row_nbytes(t: GGMLType, n: int) -> int:
    """Bytes of one row of `n` elements; `n` must be a multiple of the block size."""
    blck, nbytes = GGML_QUANT_SIZES[t]
    if n % blck:
        raise ValueError(f"row of {n} elements is not a multiple of {t.name}'s block of {blck}")
    return n // blck * nbytes


def type_name(value: int) -> str:
    try:
        return GGMLType(value).name
    except ValueError:
        return f"unknown type {value}"


NUMPY_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32),
    GGMLType.F16: np.dtype(np.float16),
    GGMLType.I32: np.dtype(np.int32),
}


def storage(t: GGMLType, shape: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of a mutable array holding a tensor of type `t` (the KV cache): the
    elements for f32/f16, else the rows' raw blocks — (…, row_bytes) uint8 (a Q8_0/Q4_0 cache)."""
    if t in NUMPY_DTYPES:
        return shape, NUMPY_DTYPES[t]
    return (*shape[:-1], row_nbytes(t, shape[-1])), np.dtype(np.uint8)


class LlamapyError(Exception):
    """Base of every error llamapy raises on purpose; the CLI prints it as one line."""


class GGUFError(LlamapyError):
    """A file that is not a valid GGUF, or not one llamapy can use."""


class UnsupportedError(LlamapyError):
    """An architecture, quant type, pre-tokenizer or op llamapy does not implement."""


class BackendUnavailable(LlamapyError):
    """A backend that cannot run on this machine (no library, no driver, no device)."""


class OutOfMemoryError(LlamapyError):
    """A device buffer that does not fit the device's memory budget."""


class ContextFullError(LlamapyError):
    """The KV cache has no room left for the tokens asked for."""


class DeviceLostError(LlamapyError):
    """A device that stopped answering (a remote node died, or a call timed out): what a context
    keeps on it (weights, KV cache) is gone or in an unknown state, so the context cannot go on;
    a new load starts afresh. `device` names it (RAY1)."""

    def __init__(self, device: str, message: str) -> None:
        super().__init__(message)
        self.device = device


class DeviceType(IntEnum):
    """ggml_backend_dev_type; also the scheduler's priority: lower value is tried first."""

    GPU = 0
    ACCEL = 1
    CPU = 2
