"""Split models (llama-gguf-split's `<name>-0000i-of-0000N.gguf`) read as one file from their
first (llamapy/model/gguf.py, llama.cpp's llama_model_loader), and what a bad split is told."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType, GGUFWriter

from llamapy.model.gguf import GGUFFile, split_paths
from llamapy.types import GGUFError
from tests_support import split_gguf

VT = GGUFValueType


def _source(path: Path) -> Path:
    rng = np.random.default_rng(5)
    w = GGUFWriter(str(path), "llama")
    w.add_key_value("general.name", "split test", VT.STRING)
    w.add_key_value("tokenizer.ggml.tokens", ["a", "b"], VT.ARRAY, VT.STRING)
    for i in range(7):
        w.add_tensor(f"t{i}.weight", rng.standard_normal((2 + i, 8)).astype(np.float32))
    w.add_tensor("q.weight", rng.integers(0, 256, (2, 34), dtype=np.uint8), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return _source(tmp_path / "whole.gguf")


@pytest.mark.parametrize("empty_first", [False, True])
def test_split_reads_as_the_whole_file(tmp_path: Path, source: Path, empty_first: bool) -> None:
    paths = split_gguf(source, tmp_path / "m", 3, empty_first=empty_first)
    with GGUFFile(source) as whole, GGUFFile(paths[0]) as split:
        assert [p.path for p in split.splits] == paths[1:]
        assert list(split.tensors) == list(whole.tensors)
        for name, t in whole.tensors.items():
            got = split.tensors[name]
            assert (got.ne, got.type, got.nbytes) == (t.ne, t.type, t.nbytes)
            assert np.array_equal(split.tensor_bytes(name), whole.tensor_bytes(name)), name
        assert split.metadata["general.name"] == "split test"
        assert split.metadata["tokenizer.ggml.tokens"] == ["a", "b"]
        assert split.describe_types() == whole.describe_types()
        assert split.total_size == sum(p.stat().st_size for p in paths)
        holders = {split.file_of(n).path for n in split.tensors}
        assert holders == set(paths[1:] if empty_first else paths)
        # tensors one after another in a file are one view, across two files they are not
        pairs = [(f"t{i}.weight", f"t{i + 1}.weight") for i in range(6)]
        same = [p for p in pairs if split.file_of(p[0]) is split.file_of(p[1])]
        assert same and len(same) < len(pairs)
        for a, b in pairs:
            view = split.adjacent_bytes([a, b])
            assert (view is not None) == ((a, b) in same)
            if view is not None:
                assert np.array_equal(view, np.concatenate([whole.tensor_bytes(a), whole.tensor_bytes(b)]))
        assert split.release_pages("t6.weight") >= 0
        key = split.content_key()
        assert key != whole.content_key() and len(key) == 32
    with GGUFFile(paths[0]) as again:
        assert again.content_key() == key
    # every file's content is part of the key: one byte of a tensor in the last file changed
    with GGUFFile(paths[-1], join_splits=False) as part:
        at = next(iter(part.tensors.values())).offset
    last = bytearray(paths[-1].read_bytes())
    last[at] ^= 0xFF
    paths[-1].write_bytes(bytes(last))
    with GGUFFile(paths[0]) as changed:
        assert changed.content_key() != key


def test_close_closes_every_file(tmp_path: Path, source: Path) -> None:
    paths = split_gguf(source, tmp_path / "m", 2)
    f = GGUFFile(paths[0])
    name = next(n for n in f.tensors if f.file_of(n) is not f)
    f.close()
    with pytest.raises(GGUFError, match="file is closed"):
        f.tensor_bytes(name)


def test_a_later_file_alone(tmp_path: Path, source: Path) -> None:
    paths = split_gguf(source, tmp_path / "m", 3)
    with GGUFFile(paths[1], join_splits=False) as part:
        assert part.metadata["split.no"] == 1 and not part.splits and len(part.tensors) == 3


def test_split_count_one_is_one_file(tmp_path: Path, source: Path) -> None:
    (p,) = split_gguf(source, tmp_path / "m", 1)
    with GGUFFile(p) as f:
        assert not f.splits and len(f.tensors) == 8


def test_split_paths() -> None:
    assert split_paths(Path("/d/x-00002-of-00003.gguf"), 1, 3) == [
        Path(f"/d/x-0000{i}-of-00003.gguf") for i in (1, 2, 3)
    ]
    assert split_paths(Path("/d/x.gguf"), 0, 3) == []
    assert split_paths(Path("/d/-00001-of-00002.gguf"), 0, 2) == []  # no prefix


BAD = {
    "later file": (dict(), 1, r"m-00002-of-00003.gguf: file 2 of a model split in 3; open it from its first file \(m-00001-of-00003.gguf\)"),
    "wrong split.no": (dict(keys={2: {"split.no": (1, VT.UINT16)}}), 0, r"m-00003-of-00003.gguf: split.no = 1, expected 2"),
    "no split.no": (dict(keys={1: {"split.no": None}}), 0, r"m-00002-of-00003.gguf: missing key 'split.no'"),
    "string count": (dict(keys={0: {"split.count": ("3", VT.STRING)}}), 0, r"key 'split.count' has type string, expected an integer"),
    "tensor count": (dict(keys={0: {"split.tensors.count": (9, VT.INT32)}}), 0, r"split.tensors.count = 9, but the 3 files hold 8 tensors"),
    "duplicate": (dict(also={2: ["t0.weight"]}), 0, r"m-00003-of-00003.gguf: tensor 't0.weight' is also in m-00001-of-00003.gguf"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_splits_are_refused_in_one_line(tmp_path: Path, source: Path, case: str) -> None:
    kwargs, opened, message = BAD[case]
    paths = split_gguf(source, tmp_path / "m", 3, **kwargs)
    with pytest.raises(GGUFError, match=message) as e:
        GGUFFile(paths[opened])
    assert "\n" not in str(e.value)


def test_missing_and_misnamed_files(tmp_path: Path, source: Path) -> None:
    paths = split_gguf(source, tmp_path / "m", 3)
    paths[2].unlink()
    with pytest.raises(GGUFError, match=r"m-00001-of-00003.gguf: file 3 of 3: .*m-00003-of-00003.gguf: no such file"):
        GGUFFile(paths[0])
    renamed = paths[0].rename(tmp_path / "model.gguf")
    with pytest.raises(GGUFError, match=r"model.gguf: first file of a model split in 3, but its name does not end in '-00001-of-00003.gguf'"):
        GGUFFile(renamed)
