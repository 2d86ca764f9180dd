"""Property tests over the GGUF header: whatever follows a valid prefix, the reader either opens
the file (and then every value and every tensor's bytes read cleanly) or raises GGUFError, never
anything else. The fast suite runs a bounded number of examples; `-m slow` runs many more.
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamapy.model.gguf import GGUFFile
from llamapy.types import GGUFError

from .corpus import base_files, layout

FAST = settings(max_examples=60, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW = settings(FAST, max_examples=1500)

EDGE_U64 = [0, 1, 2, 7, 8, 31, 32, 63, 64, 255, 4096, 2**31 - 1, 2**32 - 1, 2**32, 2**40, 2**62,
            2**63 - 1, 2**63, 2**64 - 8, 2**64 - 1]
u64s = st.one_of(st.sampled_from(EDGE_U64), st.integers(0, 2**64 - 1), st.integers(0, 64))
u32s = st.one_of(st.sampled_from([0, 1, 4, 5, 8, 9, 12, 13, 14, 30, 31, 40, 41, 99, 2**31, 2**32 - 1]),
                 st.integers(0, 2**32 - 1), st.integers(0, 15))


def probe(path: Path, data: bytes) -> bool:
    """True if the file opened and read cleanly, False on GGUFError; anything else propagates."""
    path.write_bytes(data)
    try:
        with GGUFFile(path) as f:
            for key in f.metadata:
                f.metadata[key]
            for name in f.tensors:
                view = f.tensor_bytes(name)
                assert view.size == f.tensors[name].nbytes
                int(view.sum(dtype=np.uint64))
                del view
        return True
    except GGUFError as e:
        msg = str(e)
        assert msg and "\n" not in msg
        return False


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return tmp_path / "prop.gguf"


# -- strategies --------------------------------------------------------------------------


NAMES = st.one_of(st.sampled_from([b"", b"general.alignment", b"general.architecture", b"a", b"a", b"w.0"]),
                  st.text(alphabet="ab.\u00e9\u65e5", max_size=6).map(str.encode))


@st.composite
def gguf_string(draw, text: bool = True) -> bytes:
    raw = draw(NAMES if text else st.binary(max_size=12))
    n = draw(st.one_of(st.just(len(raw)), u64s))
    return struct.pack("<Q", n) + raw


@st.composite
def value(draw) -> bytes:
    vtype = draw(u32s)
    out = struct.pack("<I", vtype)
    if vtype == 8:
        return out + draw(gguf_string(text=draw(st.booleans())))
    if vtype == 9:
        item = draw(u32s)
        count = draw(st.one_of(st.integers(0, 4), u64s))
        body = b"".join(draw(st.lists(gguf_string(), max_size=4))) if item == 8 else draw(st.binary(max_size=40))
        return out + struct.pack("<IQ", item, count) + body
    return out + draw(st.binary(max_size=8))


@st.composite
def tensor_info(draw) -> bytes:
    name = draw(gguf_string(text=draw(st.booleans())))
    n_dims = draw(st.one_of(st.integers(0, 5), u32s))
    dims = draw(st.lists(st.one_of(st.sampled_from([1, 2, 32, 256]), u64s), min_size=min(n_dims, 6),
                         max_size=min(n_dims, 6)))
    ttype = draw(u32s)
    offset = draw(st.one_of(st.sampled_from([0, 32, 64, 1]), u64s))
    return name + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack(
        "<IQ", ttype, offset)


@st.composite
def structured_file(draw) -> bytes:
    kvs = draw(st.lists(st.tuples(gguf_string(), value()), max_size=5))
    tis = draw(st.lists(tensor_info(), max_size=3))
    n_kv = draw(st.one_of(st.just(len(kvs)), u64s))
    n_t = draw(st.one_of(st.just(len(tis)), u64s))
    version = draw(st.one_of(st.just(3), st.just(2), u32s))
    head = b"GGUF" + struct.pack("<IQQ", version, n_t, n_kv)
    body = b"".join(k + v for k, v in kvs) + b"".join(tis)
    tail = draw(st.binary(max_size=600))
    return head + body + tail


@st.composite
def mutated_base(draw) -> bytes:
    """A valid file with a few fields overwritten by edge values or random bytes."""
    data = bytearray(base_files()[draw(st.sampled_from(["A", "B"]))])
    lay = layout(bytes(data))
    spots = [8, 16]
    for kv in lay.kvs:
        spots += [kv.start, kv.type_pos, kv.value_pos] + ([kv.value_pos + 4] if kv.vtype == 9 else [])
    for t in lay.tis:
        spots += [t.start, t.ndims_pos, t.dims_pos, t.type_pos, t.offset_pos]
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            pos = draw(st.sampled_from(spots))
            width = draw(st.sampled_from([4, 8]))
            v = draw(u64s) % (1 << (8 * width))
            data[pos : pos + width] = v.to_bytes(width, "little")
        else:
            pos = draw(st.integers(0, len(data) - 1))
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[pos : pos + len(chunk)] = chunk
    cut = draw(st.one_of(st.just(len(data)), st.integers(0, len(data))))
    return bytes(data[:cut])


# -- properties --------------------------------------------------------------------------

VALID_PREFIX = b"GGUF" + struct.pack("<I", 3)


@FAST
@given(n_t=u64s, n_kv=u64s, rest=st.binary(max_size=512))
def test_random_bytes_after_valid_prefix(target: Path, n_t: int, n_kv: int, rest: bytes) -> None:
    probe(target, VALID_PREFIX + struct.pack("<QQ", n_t, n_kv) + rest)


@FAST
@given(data=structured_file())
def test_structured_headers(target: Path, data: bytes) -> None:
    probe(target, data)


@FAST
@given(data=mutated_base())
def test_mutated_valid_files(target: Path, data: bytes) -> None:
    probe(target, data)


@FAST
@given(data=st.binary(max_size=64))
def test_arbitrary_small_files(target: Path, data: bytes) -> None:
    assert not probe(target, data) or data.startswith(b"GGUF")


@pytest.mark.slow
@SLOW
@given(data=st.one_of(structured_file(), mutated_base()))
def test_many_headers_slow(target: Path, data: bytes) -> None:
    probe(target, data)


def test_valid_bases_pass(target: Path) -> None:
    for data in base_files().values():
        assert probe(target, data)


def test_fuzz_entry_point_runs_without_atheris() -> None:
    """fuzz/fuzz_gguf.py imports without atheris, and its one-input check accepts any bytes."""
    path = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_gguf.py"
    spec = importlib.util.spec_from_file_location("fuzz_gguf", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for data in (b"", b"GGUF", base_files()["A"], base_files()["B"][:100], b"\xff" * 100):
        mod.TestOneInput(data)
