"""llamapy's GGUF reader against gguf-py's GGUFReader: every key (value and type), every tensor
(name, shape, type, offset, bytes), on the shared vocab files, the tiny32 model, and files written
here with GGUFWriter (every value type, arrays of every type, several quant types, custom alignment).

GGUFReader takes 2-20 s per vocab file (it builds a numpy view per token), so the fast suite
compares it on the two smallest real files and the written ones; the large vocabularies are `slow`.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from llamapy.model.gguf import GGUFFile, TensorInfo
from llamapy.types import GGMLType, GGUFError
from tests_support import SHARED

VOCAB = SHARED / "data" / "vocab"
TINY32 = SHARED / "reference" / "tiny32" / "tiny32-Q4_K_M.gguf"
SMALL_REAL = [VOCAB / "ggml-vocab-llama-spm.gguf", TINY32]
LARGE_REAL = [VOCAB / f"ggml-vocab-{n}.gguf" for n in ("gpt-2", "llama-bpe", "phi-3", "qwen2")]
VOCAB_FILES = sorted(VOCAB.glob("*.gguf"))

needs = pytest.mark.skipif(not TINY32.exists() or not VOCAB.exists(), reason="shared data not present")


# -- the comparison --------------------------------------------------------------------------


def _raw(s: str) -> bytes:
    return s.encode("utf-8", errors="surrogateescape")


def compare_with_reference(path: Path) -> None:
    ref = GGUFReader(path)
    with GGUFFile(path) as f:
        assert f.version == int(ref.fields["GGUF.version"].parts[-1][0])
        assert f.alignment == ref.alignment
        assert f.data_offset == ref.data_offset
        assert f.size == path.stat().st_size

        fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
        assert list(f.metadata) == list(fields)
        assert len(f.metadata) == int(ref.fields["GGUF.kv_count"].parts[-1][0])
        for key, fld in fields.items():
            entry = f.metadata.entry(key)
            main = fld.types[0]
            assert entry.vtype == int(main), key
            ours = f.metadata[key]
            if main == GGUFValueType.ARRAY:
                sub = fld.types[-1] if len(fld.types) > 1 else None
                assert entry.count == len(fld.data) == len(ours), key
                if sub is None:  # empty array: GGUFReader records no element type
                    continue
                assert entry.item_type == int(sub), key
                if sub == GGUFValueType.STRING:
                    assert isinstance(ours, list) and all(isinstance(s, str) for s in ours)
                    assert [_raw(s) for s in ours] == [bytes(fld.parts[i]) for i in fld.data], key
                else:
                    theirs = np.concatenate([fld.parts[i] for i in fld.data])
                    assert isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype, key
                    assert ours.tobytes() == theirs.tobytes(), key
            elif main == GGUFValueType.STRING:
                assert isinstance(ours, str)
                assert _raw(ours) == bytes(fld.parts[-1]), key
            else:
                theirs = fld.parts[-1].tolist()[0]
                assert type(ours) is type(theirs), (key, ours, theirs)
                assert ours == theirs, key

        assert list(f.tensors) == [t.name for t in ref.tensors]
        assert len(f.tensors) == int(ref.fields["GGUF.tensor_count"].parts[-1][0])
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.ne == tuple(int(d) for d in t.shape), t.name
            assert info.shape == tuple(reversed(info.ne))
            assert info.type == t.tensor_type, t.name
            assert info.offset == t.data_offset, t.name
            assert info.nbytes == t.n_bytes, t.name
            assert info.n_elements == t.n_elements, t.name
            view = f.tensor_bytes(t.name)
            blck, bsize = GGML_QUANT_SIZES[info.type]
            assert view.dtype == np.uint8 and view.shape == (info.n_elements // info.ne[0], info.ne[0] // blck * bsize)
            assert view.tobytes() == np.asarray(t.data).tobytes(), t.name
            del view
        counts: dict[str, int] = {}
        for t in ref.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        assert f.describe_types() == counts


@needs
@pytest.mark.parametrize("path", SMALL_REAL, ids=lambda p: p.name)
def test_matches_reference_small_real(path: Path) -> None:
    compare_with_reference(path)


@needs
@pytest.mark.slow
@pytest.mark.parametrize("path", LARGE_REAL, ids=lambda p: p.name)
def test_matches_reference_large_vocab(path: Path) -> None:
    compare_with_reference(path)


# -- files written here ----------------------------------------------------------------------

SCALARS = [
    ("uint8", GGUFValueType.UINT8, 255),
    ("int8", GGUFValueType.INT8, -128),
    ("uint16", GGUFValueType.UINT16, 65535),
    ("int16", GGUFValueType.INT16, -32768),
    ("uint32", GGUFValueType.UINT32, 2**32 - 1),
    ("int32", GGUFValueType.INT32, -(2**31)),
    ("float32", GGUFValueType.FLOAT32, -0.15625),
    ("bool_t", GGUFValueType.BOOL, True),
    ("bool_f", GGUFValueType.BOOL, False),
    ("string", GGUFValueType.STRING, "ünïcødé ✓ 日本語"),
    ("string_empty", GGUFValueType.STRING, ""),
    ("uint64", GGUFValueType.UINT64, 2**64 - 1),
    ("int64", GGUFValueType.INT64, -(2**63)),
    ("float64", GGUFValueType.FLOAT64, 1e300),
]
ARRAYS = [
    ("uint8", GGUFValueType.UINT8, [0, 1, 255]),
    ("int8", GGUFValueType.INT8, [-128, 0, 127]),
    ("uint16", GGUFValueType.UINT16, [0, 65535]),
    ("int16", GGUFValueType.INT16, [-32768, 32767]),
    ("uint32", GGUFValueType.UINT32, [0, 2**32 - 1, 7]),
    ("int32", GGUFValueType.INT32, [-(2**31), 2**31 - 1]),
    ("float32", GGUFValueType.FLOAT32, [0.5, -1.25, 3.0e38]),
    ("bool", GGUFValueType.BOOL, [True, False, False, True]),
    ("string", GGUFValueType.STRING, ["<s>", "", "▁the", "日本", "a" * 300]),
    ("uint64", GGUFValueType.UINT64, [0, 2**64 - 1]),
    ("int64", GGUFValueType.INT64, [-(2**63), 2**63 - 1]),
    ("float64", GGUFValueType.FLOAT64, [1e-300, -2.5]),
    ("single", GGUFValueType.INT32, [42]),
]
QUANTS = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
          QT.IQ4_NL, QT.BF16]


def write_gguf(path: Path, alignment: int | None = None, tensors: bool = True) -> Path:
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for name, vt, val in SCALARS:
        w.add_key_value(f"test.scalar.{name}", val, vt)
    for name, vt, val in ARRAYS:
        w.add_key_value(f"test.array.{name}", val, GGUFValueType.ARRAY, vt)
    # token bytes that are not UTF-8 are kept (llama.cpp's byte tokens)
    w.add_key_value("tokenizer.ggml.tokens", ["ok", b"\xff\xfe", b"\xe6\x97", "end"], GGUFValueType.ARRAY,
                    GGUFValueType.STRING)
    if tensors:
        w.add_tensor("f32.1d", rng.standard_normal(5).astype(np.float32))
        w.add_tensor("f32.4d", rng.standard_normal((2, 3, 1, 4)).astype(np.float32))
        w.add_tensor("f16.3d", rng.standard_normal((2, 3, 8)).astype(np.float16))
        w.add_tensor("f64.2d", rng.standard_normal((3, 2)))
        w.add_tensor("i8", np.arange(-5, 5, dtype=np.int8))
        w.add_tensor("i16", np.arange(7, dtype=np.int16))
        w.add_tensor("i32", np.arange(9, dtype=np.int32).reshape(3, 3))
        for t in QUANTS:
            blck, nbytes = GGML_QUANT_SIZES[t]
            raw = rng.integers(0, 256, size=(3, 2 * nbytes), dtype=np.uint8)  # 3 rows of 2 blocks
            w.add_tensor(f"{t.name.lower()}.weight", raw, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 4096])
def test_matches_reference_written(tmp_path: Path, alignment: int | None) -> None:
    path = write_gguf(tmp_path / "all.gguf", alignment)
    compare_with_reference(path)
    with GGUFFile(path) as f:
        assert f.alignment == (alignment or 32)
        assert f.data_offset % f.alignment == 0
        for t in f.tensors.values():
            assert (t.offset - f.data_offset) % f.alignment == 0


def test_written_values(tmp_path: Path) -> None:
    """Decoded values are plain Python values / numpy arrays of the right type."""
    with GGUFFile(write_gguf(tmp_path / "v.gguf")) as f:
        for name, vt, val in SCALARS:
            got = f.metadata[f"test.scalar.{name}"]
            if vt == GGUFValueType.FLOAT32:
                assert got == np.float32(val)
            else:
                assert got == val and type(got) is type(val)
            assert f.metadata.type_name(f"test.scalar.{name}") == vt.name.lower()
        for name, vt, val in ARRAYS:
            got = f.metadata[f"test.array.{name}"]
            if vt == GGUFValueType.STRING:
                assert got == val
            else:
                assert list(got) == list(np.array(val, dtype=got.dtype))
            assert f.metadata.type_name(f"test.array.{name}") == f"array[{vt.name.lower()}; {len(val)}]"
        assert f.metadata["test.array.bool"].dtype == np.bool_
        toks = f.metadata["tokenizer.ggml.tokens"]
        assert [_raw(t) for t in toks] == [b"ok", b"\xff\xfe", b"\xe6\x97", b"end"]
        assert f.get("general.architecture") == "llama"
        assert f.get("no.such.key", 7) == 7
        assert "test.scalar.uint8" in f.metadata and "nope" not in f.metadata
        info = f.tensors["f32.4d"]
        assert isinstance(info, TensorInfo) and info.ne == (4, 1, 3, 2) and info.shape == (2, 3, 1, 4)
        raw = f.tensor_bytes("f32.4d")
        assert raw.shape == (6, 16)
        rng = np.random.default_rng(0)
        rng.standard_normal(5)  # f32.1d
        assert np.array_equal(raw.view(np.float32).reshape(info.shape),
                              rng.standard_normal((2, 3, 1, 4)).astype(np.float32))
        q = f.tensors["q4_k.weight"]
        assert q.type == GGMLType.Q4_K and q.ne == (512, 3)
        assert f.tensor_bytes("q4_k.weight").shape == (3, 2 * 144)
        assert f.describe_types()["F32"] == 2


def test_tensor_bytes_are_the_written_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    w = GGUFWriter(path, "llama")
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    q = np.arange(2 * 34, dtype=np.uint8).reshape(2, 34) % 251
    w.add_tensor("a", a)
    w.add_tensor("q", q, raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as f:
        assert np.array_equal(f.tensor_bytes("a").view(np.float32).reshape(f.tensors["a"].shape), a)
        assert np.array_equal(f.tensor_bytes("q"), q)
        assert f.tensors["q"].ne == (32, 2)


def _gguf_bytes(kvs: list[bytes], n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + b"".join(kvs)


def _key(k: str) -> bytes:
    return struct.pack("<Q", len(k)) + k.encode()


def test_empty_arrays_and_version_2(tmp_path: Path) -> None:
    """GGUFWriter refuses empty arrays, but llama.cpp writes them (e.g. an empty merges list)."""
    kvs = [
        _key("empty.str") + struct.pack("<IIQ", 9, 8, 0),
        _key("empty.i32") + struct.pack("<IIQ", 9, 5, 0),
        _key("x") + struct.pack("<IB", 0, 9),
    ]
    data = _gguf_bytes(kvs, 3)
    for version in (2, 3):
        p = tmp_path / f"v{version}.gguf"
        p.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
        with GGUFFile(p) as f:
            assert f.version == version
            assert f.metadata["empty.str"] == []
            assert f.metadata["empty.i32"].shape == (0,)
            assert f.metadata["x"] == 9
            assert f.tensors == {}
        if version == 3:
            compare_with_reference(p)


def test_empty_array_at_end_of_file(tmp_path: Path) -> None:
    p = tmp_path / "end.gguf"
    p.write_bytes(_gguf_bytes([_key("e") + struct.pack("<IIQ", 9, 12, 0)], 1))
    with GGUFFile(p) as f:
        assert f.metadata["e"].shape == (0,)


def test_string_value_with_bad_utf8_is_reported_on_read(tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf_bytes([_key("general.name") + struct.pack("<IQ", 8, 2) + b"\xff\xfe"], 1))
    with GGUFFile(p) as f:  # opening does not decode it
        with pytest.raises(GGUFError, match="general.name"):
            f.metadata["general.name"]


# -- laziness --------------------------------------------------------------------------------


@needs
@pytest.mark.parametrize("path", VOCAB_FILES, ids=lambda p: p.name)
def test_open_is_lazy(path: Path) -> None:
    """Opening a vocabulary decodes no value: the token list is only located, not read."""
    with GGUFFile(path) as f:
        assert f.metadata._cache == {}
        entry = f.metadata.entry("tokenizer.ggml.tokens")
        assert entry.count > 30_000
        assert f.metadata._cache == {}  # entry() and `in` do not decode either
        assert "tokenizer.ggml.tokens" in f.metadata
        assert f.metadata._cache == {}
        toks = f.metadata["tokenizer.ggml.tokens"]
        assert len(toks) == entry.count
        assert list(f.metadata._cache) == ["tokenizer.ggml.tokens"]
        assert f.metadata["tokenizer.ggml.tokens"] is toks  # cached


def test_repr_is_short(tmp_path: Path) -> None:
    with GGUFFile(write_gguf(tmp_path / "r.gguf")) as f:
        r = repr(f)
        assert r.startswith("GGUFFile(") and len(r) < 300
        assert f.metadata._cache == {}
