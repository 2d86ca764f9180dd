"""llamapy.quants.dequantize against gguf-py's reference dequantization, bit for bit."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest

from llamapy import quants
from llamapy.types import GGMLType, UnsupportedError, block_size

ALL_TYPES = "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K".split()

# Byte offsets of the f16 scale fields inside one block, per type (ggml's block structs).
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def random_raw(name: str, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random (n_rows, row_bytes) uint8 data of type `name` with small finite f16 scales.

    Quantizes real data where gguf-py can; K-quants are random bytes with sane scales."""
    qt = GGMLType[name]
    data = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    if name == "F32":
        return data.view(np.uint8)
    if name == "F16":
        return data.astype(np.float16).view(np.uint8)
    blck, bsize = block_size(qt)
    if name in ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return np.ascontiguousarray(gguf.quants.quantize(data, qt)).view(np.uint8)
    raw = rng.integers(0, 256, (n_rows, n_cols // blck * bsize), dtype=np.uint8)
    blocks = raw.reshape(-1, bsize)
    for off in F16_FIELDS[name]:
        scale = (rng.random(blocks.shape[0]) * 0.01 + 1e-4).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_matches_gguf_bitwise(name: str) -> None:
    rng = np.random.default_rng(1)
    n_rows, n_cols = 7, 512
    raw = random_raw(name, n_rows, n_cols, rng)
    ref = gguf.quants.dequantize(raw, GGMLType[name]).reshape(n_rows, n_cols)
    got = quants.dequantize(raw, GGMLType[name], n_cols)
    assert got.dtype == np.float32 and got.shape == (n_rows, n_cols)
    np.testing.assert_array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    # 1-D input holding whole rows gives the same.
    np.testing.assert_array_equal(quants.dequantize(raw.reshape(-1), GGMLType[name], n_cols), got)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_dequantize_random_bytes_quant_bits(name: str) -> None:
    # Random bytes in every field (incl. the quants gguf-py would never produce).
    rng = np.random.default_rng(2)
    raw = random_raw("Q4_K" if name == "Q4_1" else name, 3, 256, rng)
    qt = GGMLType["Q4_K" if name == "Q4_1" else name]
    ref = gguf.quants.dequantize(raw, qt).reshape(3, 256)
    np.testing.assert_array_equal(quants.dequantize(raw, qt, 256), ref)


def test_dequantize_read_only_input_not_aliased() -> None:
    rng = np.random.default_rng(3)
    raw = random_raw("F32", 2, 64, rng)
    raw.flags.writeable = False
    out = quants.dequantize(raw, GGMLType.F32, 64)
    out[0, 0] = 123.0  # must be a copy, the source is a read-only mmap in real use
    assert raw.view(np.float32)[0, 0] != 123.0


def test_unsupported_type_raises() -> None:
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        quants.dequantize(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, 256)


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError):
        quants.dequantize(np.zeros(18, np.uint8), GGMLType.Q4_0, 48)
    with pytest.raises(ValueError):
        quants.dequantize(np.zeros(19, np.uint8), GGMLType.Q4_0, 32)
