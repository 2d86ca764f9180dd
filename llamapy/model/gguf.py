"""GGUF reader: a lazy, bounds-checked, memory-mapped parser (ggml's gguf.cpp, gguf-py's GGUFReader).

Why not `gguf.GGUFReader`: it builds a numpy view for every array element of every key, which
takes seconds and ~190 MiB on a 49k vocabulary. This reader walks the header once, records where
each value lies, and decodes a value only when it is asked for. Every read is checked against the
file's size first, so a hostile count or length is rejected before anything is allocated, with a
message that names the key, tensor or offset.

What is rejected (all as `GGUFError`, one line, prefixed with the file's name):
  * not a regular file, empty, shorter than the 24-byte header, wrong magic, version not 2/3
    (a byte-swapped version is reported as a big-endian file);
  * counts, string lengths and array lengths that cannot fit in what is left of the file;
  * unknown value types, nested arrays, non-UTF-8 keys and tensor names, duplicate keys;
  * `general.alignment` that is not a uint32 power of two (up to 1 MiB);
  * tensor infos with n_dims outside 1..4, a zero or absurd dimension, an unknown ggml type, a row
    length that is not a multiple of the type's block, a name of 64 bytes or more, a duplicate
    name, a misaligned offset, data past the end of the file, or data overlapping another tensor.
String values with invalid UTF-8 are reported when read (`metadata[key]`); string *arrays* (token
lists) keep such bytes losslessly with `surrogateescape`, as llama.cpp keeps token bytes as-is.

A model split by llama-gguf-split (`<name>-00001-of-0000N.gguf` ...) opens from its first file,
as llama.cpp's llama_model_loader opens it: the metadata is the first file's, the tensors are the
union of all N files' (each file mapped and checked as above), `split.no` of each file must be its
place in the name's order, no tensor may be in two files, and `split.tensors.count` must match.

Shapes: `TensorInfo.ne` is ggml's order (fastest dimension first, as stored in the file);
`TensorInfo.shape` is numpy's (reversed).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:  # hashlib's own BLAKE2 (CPython's built-in module): importing hashlib would also map
    # OpenSSL's libcrypto, 3.4 MiB of RSS for a hash that does not use it
    from _blake2 import blake2b
except ImportError:  # another Python implementation
    from hashlib import blake2b

from ..types import GGMLType, GGUFError, block_size, type_name

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: gguf.cpp rejects tensor names of this many bytes or more
HEADER_SIZE = 24  # magic, version, tensor_count, kv_count
MAX_ALIGNMENT = 1 << 20
_U64 = struct.Struct("<Q")
# llama.cpp's LLM_KV_SPLIT_*: the keys llama-gguf-split writes into every file of a split model
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"

# GGUF value types (gguf.h enum gguf_type) -> (struct format, numpy dtype, size)
_SCALAR: dict[int, tuple[str, str, int]] = {
    0: ("<B", "u1", 1),  # UINT8
    1: ("<b", "i1", 1),  # INT8
    2: ("<H", "<u2", 2),  # UINT16
    3: ("<h", "<i2", 2),  # INT16
    4: ("<I", "<u4", 4),  # UINT32
    5: ("<i", "<i4", 4),  # INT32
    6: ("<f", "<f4", 4),  # FLOAT32
    7: ("<?", "u1", 1),  # BOOL
    10: ("<Q", "<u8", 8),  # UINT64
    11: ("<q", "<i8", 8),  # INT64
    12: ("<d", "<f8", 8),  # FLOAT64
}
T_UINT32 = 4
T_STRING = 8
T_ARRAY = 9
TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
    7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}
# Smallest possible encodings, used to reject absurd counts before looping over them:
# a KV is key length (8) + type (4) + the smallest value (1); a tensor info is name length (8)
# + n_dims (4) + one dimension (8) + type (4) + offset (8).
_MIN_KV = 13
_MIN_TENSOR_INFO = 32


def _short(s: str, limit: int = 80) -> str:
    """repr() of a key or tensor name for a message, cut so that a hostile 1 GB name stays short."""
    r = repr(s)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


@dataclass(frozen=True)
class LazyValue:
    """Where a metadata value lies in the file; decoded on demand by GGUFFile."""

    vtype: int  # gguf value type
    offset: int  # first byte of the value (for arrays: of the first element)
    count: int = 1  # array length (1 for scalars)
    item_type: int = -1  # element type for arrays
    end: int = -1  # one past the value's last byte


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    type: GGMLType
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: (rows..., row length)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class _Cursor:
    """Sequential, bounds-checked reads over the mapped file."""

    def __init__(self, buf: memoryview, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"truncated or corrupt GGUF: {what} needs {n} bytes at offset {self.pos}, "
                f"file has {self.size}"
            )

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, _, size = _SCALAR[vtype]
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw

    def string(self, what: str) -> str:
        start = self.pos + 8
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at offset {start} is not valid UTF-8") from None

    def skip_string(self, what: str) -> None:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        self.pos += n

    def skip_strings(self, count: int, what: str) -> None:
        """Skip `count` strings (a string array): the hot loop of a vocabulary, kept lean."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        for j in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of string #{j} of {what}")
            (n,) = unpack(buf, pos)
            pos += 8 + n
            if pos > size:
                self.pos = pos - n
                self.need(n, f"string #{j} of {what}")
        self.pos = pos


class Metadata(Mapping[str, Any]):
    """The key/value section: a Mapping whose values are decoded when first read."""

    def __init__(self, owner: GGUFFile, entries: dict[str, LazyValue]) -> None:
        self._owner = owner
        self._entries = entries
        self._cache: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._cache:
            self._cache[key] = self._owner._decode(key, self._entries[key])
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def entry(self, key: str) -> LazyValue:
        return self._entries[key]

    def type_name(self, key: str) -> str:
        e = self._entries[key]
        if e.vtype == T_ARRAY:
            return f"array[{TYPE_NAMES.get(e.item_type, '?')}; {e.count}]"
        return TYPE_NAMES.get(e.vtype, "?")


@dataclass(repr=False, eq=False)
class GGUFFile:
    """One GGUF file, mapped read-only. `metadata` decodes lazily; tensors are memmap views."""

    path: Path
    version: int = 0
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0
    metadata: Metadata = field(init=False)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    def __init__(self, path: str | os.PathLike[str], join_splits: bool = True) -> None:
        """`join_splits`: when the file is the first of a split model, open the others too
        (False: this file alone, as a split's later files are opened)."""
        self.path = Path(path)
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.tensors = {}
        self.size = 0
        self.splits: list[GGUFFile] = []  # a split model's other files, in order
        self._holder: dict[str, GGUFFile] = {}  # a tensor of one of them -> that file
        self._closed = True
        self._mmap: mmap.mmap | None = None
        self._buf = memoryview(b"")
        self._map()
        self._closed = False
        try:
            self._parse()
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{self.path.name}: {e}") from None
        if join_splits:
            try:
                self._join_splits()
            except GGUFError:
                self.close()
                raise

    def _map(self) -> None:
        # stat first: opening a FIFO would block, and opening a directory succeeds on Linux
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror or e}") from None
        if stat.S_ISDIR(st.st_mode):
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise GGUFError(f"{self.path}: not a regular file, cannot be a GGUF file")
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror or e}") from None
        try:
            self.size = os.fstat(fd).st_size
            if self.size < HEADER_SIZE:
                head = os.read(fd, 4)
                if head and not GGUF_MAGIC.startswith(head[:4]):
                    raise GGUFError(
                        f"{self.path}: not a GGUF file (magic {head!r} at offset 0, expected b'GGUF')"
                    )
                raise GGUFError(
                    f"{self.path}: not a GGUF file ({self.size} bytes, too short for the "
                    f"{HEADER_SIZE}-byte header)"
                )
            self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot map: {e.strerror or e}") from None
        finally:
            os.close(fd)
        self._buf = memoryview(self._mmap)

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._buf, self.size)
        magic = bytes(self._buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file (magic {magic!r} at offset 0, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            if self.version & 0xFFFF == 0 and self.version != 0:
                swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
                raise GGUFError(
                    f"big-endian GGUF (version {swapped} byte-swapped at offset 4) is not supported"
                )
            if self.version == 1:
                raise GGUFError("GGUF version 1 at offset 4 is no longer supported (llamapy reads 2 and 3)")
            raise GGUFError(f"unsupported GGUF version {self.version} at offset 4 (llamapy reads 2 and 3)")
        n_tensors = cur.u64("tensor_count")
        n_kv = cur.u64("kv_count")
        # reject absurd counts before looping over them
        room = self.size - HEADER_SIZE
        if n_kv * _MIN_KV > room:
            raise GGUFError(
                f"kv_count {n_kv} at offset 16 is impossible for a {self.size}-byte file"
            )
        if n_tensors * _MIN_TENSOR_INFO > room - n_kv * _MIN_KV:
            raise GGUFError(
                f"tensor_count {n_tensors} at offset 8 is impossible for a {self.size}-byte file "
                f"with {n_kv} keys"
            )

        entries: dict[str, LazyValue] = {}
        for i in range(n_kv):
            key_pos = cur.pos
            key = cur.string(f"key #{i}")
            if key in entries:
                raise GGUFError(f"duplicate key {_short(key)} (key #{i} at offset {key_pos})")
            vtype = cur.u32(f"type of key {_short(key)}")
            entries[key] = self._skip_value(cur, key, vtype)
        self.metadata = Metadata(self, entries)

        if "general.alignment" in entries:
            self.alignment = self._alignment(entries["general.alignment"])

        infos: list[tuple[str, tuple[int, ...], int, int, int]] = []
        for i in range(n_tensors):
            info_pos = cur.pos
            name = cur.string(f"name of tensor #{i}")
            nlen = len(name.encode("utf-8"))
            if nlen >= MAX_NAME:
                raise GGUFError(
                    f"name of tensor #{i} at offset {info_pos} is {nlen} bytes, "
                    f"ggml allows at most {MAX_NAME - 1}: {_short(name)}"
                )
            where = f"tensor {_short(name)}"
            n_dims = cur.u32(f"n_dims of {where}")
            if n_dims == 0 or n_dims > MAX_DIMS:
                raise GGUFError(f"{where} at offset {info_pos}: n_dims {n_dims} not in 1..{MAX_DIMS}")
            ne = tuple(cur.u64(f"shape of {where}") for _ in range(n_dims))
            ttype = cur.u32(f"type of {where}")
            offset = cur.u64(f"offset of {where}")
            infos.append((name, ne, ttype, offset, info_pos))

        pad = (-cur.pos) % self.alignment
        self.data_offset = cur.pos + pad
        if n_tensors and self.data_offset > self.size:
            raise GGUFError(
                f"data section at offset {self.data_offset} starts past the end of the file ({self.size} bytes)"
            )
        self._tensor_infos(infos)

    def _alignment(self, e: LazyValue) -> int:
        what = "key 'general.alignment'"
        if e.vtype != T_UINT32:  # gguf.cpp and gguf-py both insist on uint32
            raise GGUFError(
                f"{what} at offset {e.offset} has type {TYPE_NAMES.get(e.vtype, e.vtype)}, expected uint32"
            )
        align = self.metadata["general.alignment"]
        if align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
            raise GGUFError(
                f"{what} = {align} at offset {e.offset} is not a power of two in 1..{MAX_ALIGNMENT}"
            )
        return int(align)

    def _skip_value(self, cur: _Cursor, key: str, vtype: int) -> LazyValue:
        start = cur.pos
        k = _short(key)
        if vtype in _SCALAR:
            cur.need(_SCALAR[vtype][2], f"value of key {k}")
            cur.pos += _SCALAR[vtype][2]
            return LazyValue(vtype, start, end=cur.pos)
        if vtype == T_STRING:
            cur.skip_string(f"value of key {k}")
            return LazyValue(vtype, start, end=cur.pos)
        if vtype != T_ARRAY:
            raise GGUFError(f"key {k} at offset {start - 4} has unknown value type {vtype}")
        item = cur.u32(f"array type of key {k}")
        count = cur.u64(f"array length of key {k}")
        first = cur.pos
        if item in _SCALAR:
            cur.need(count * _SCALAR[item][2], f"array {k} of {count} {TYPE_NAMES[item]}")
            cur.pos += count * _SCALAR[item][2]
        elif item == T_STRING:
            # each string needs at least its 8-byte length
            cur.need(count * 8, f"array {k} of {count} strings")
            cur.skip_strings(count, f"key {k}")
        elif item == T_ARRAY:
            raise GGUFError(f"key {k} at offset {start}: nested arrays are not supported")
        else:
            raise GGUFError(f"key {k} at offset {start}: array of unknown value type {item}")
        return LazyValue(T_ARRAY, first, count, item, end=cur.pos)

    def _tensor_infos(self, infos: list[tuple[str, tuple[int, ...], int, int, int]]) -> None:
        spans: list[tuple[int, int, str]] = []
        for name, ne, ttype, offset, info_pos in infos:
            where = f"tensor {_short(name)} (info at offset {info_pos})"
            if name in self.tensors:
                raise GGUFError(f"duplicate {where}")
            try:
                gtype = GGMLType(ttype)
                blck, bsize = block_size(gtype)
            except (ValueError, KeyError):
                raise GGUFError(f"{where} has unknown type {ttype}") from None
            if any(d == 0 or d > 1 << 40 for d in ne):
                raise GGUFError(f"{where} has an invalid shape {list(ne)}")
            if ne[0] % blck:
                raise GGUFError(
                    f"{where}: row length {ne[0]} is not a multiple of {gtype.name}'s block size {blck}"
                )
            n = 1
            for d in ne:
                n *= d
            if n > 1 << 48:
                raise GGUFError(f"{where} has an absurd element count {n}")
            nbytes = n // blck * bsize
            if offset % self.alignment:
                raise GGUFError(f"{where}: data offset {offset} is not aligned to {self.alignment}")
            start = self.data_offset + offset
            if start + nbytes > self.size:
                raise GGUFError(
                    f"{where}: data [{start}, {start + nbytes}) runs past the end of the file ({self.size} bytes)"
                )
            spans.append((start, start + nbytes, name))
            self.tensors[name] = TensorInfo(name, ne, gtype, start, nbytes)
        spans.sort()
        for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(
                    f"tensor {_short(n1)} data at offset {s1} overlaps tensor {_short(n0)} [{s0}, {e0})"
                )

    # -- split models --------------------------------------------------------------------

    def _split_key(self, key: str, required: bool = True) -> int | None:
        if key not in self.metadata:
            if required:
                raise GGUFError(f"{self.path.name}: missing key {key!r}, which every file of a split model has")
            return None
        value = self.metadata[key]
        if self.metadata.entry(key).vtype not in _SCALAR or isinstance(value, (bool, float)):
            raise GGUFError(f"{self.path.name}: key {key!r} has type {self.metadata.type_name(key)}, expected an integer")
        return int(value)

    def _join_splits(self) -> None:
        """The other files of a split model (llama_model_loader's additional GGUFs)."""
        count = self._split_key(SPLIT_COUNT, required=False) or 0
        if count <= 1:
            return
        no = self._split_key(SPLIT_NO)
        paths = split_paths(self.path, no, count)
        if no != 0:
            raise GGUFError(
                f"{self.path.name}: file {no + 1} of a model split in {count}; open it from its first file"
                + (f" ({paths[0].name})" if paths else "")
            )
        if not paths:
            raise GGUFError(
                f"{self.path.name}: first file of a model split in {count}, but its name does not end in "
                f"'-00001-of-{count:05d}.gguf', so the other files cannot be found"
            )
        for i, p in enumerate(paths[1:], 1):
            try:
                part = GGUFFile(p, join_splits=False)
            except GGUFError as e:
                raise GGUFError(f"{self.path.name}: file {i + 1} of {count}: {e}") from None
            self.splits.append(part)  # before the checks: close() then frees it
            if (got := part._split_key(SPLIT_NO)) != i:
                raise GGUFError(f"{p.name}: {SPLIT_NO} = {got}, expected {i} (its place in the split's names)")
            for name, t in part.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{p.name}: tensor {_short(name)} is also in {self.file_of(name).path.name}")
                self.tensors[name] = t
                self._holder[name] = part
        if (want := self._split_key(SPLIT_TENSORS)) != len(self.tensors):
            raise GGUFError(
                f"{self.path.name}: {SPLIT_TENSORS} = {want}, but the {count} files hold {len(self.tensors)} tensors"
            )

    def file_of(self, name: str) -> GGUFFile:
        """The file that holds a tensor's bytes: this one, or one of its splits."""
        return self._holder.get(name, self)

    @property
    def total_size(self) -> int:
        """Bytes of this file and its splits."""
        return self.size + sum(s.size for s in self.splits)

    # -- values ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise GGUFError(f"{self.path.name}: file is closed")

    def _decode(self, key: str, v: LazyValue) -> Any:
        self._check_open()
        if v.vtype in _SCALAR:
            val = struct.unpack_from(_SCALAR[v.vtype][0], self._buf, v.offset)[0]
            return bool(val) if v.vtype == 7 else val
        if v.vtype == T_STRING:
            cur = _Cursor(self._buf, self.size)
            cur.pos = v.offset
            try:
                return cur.string(f"value of key {_short(key)}")
            except GGUFError as e:
                raise GGUFError(f"{self.path.name}: {e}") from None
        if v.item_type == T_STRING:
            out: Any = self._string_array(v)
        else:
            dt = np.dtype(_SCALAR[v.item_type][1])
            arr = np.frombuffer(self._buf, dtype=dt, count=v.count, offset=v.offset)
            # a copy: a view would keep the mapping alive after close() (metadata arrays are small)
            out = arr.astype(bool) if v.item_type == 7 else arr.copy()
        # the value is kept decoded (Metadata caches it): its bytes in the mapping, read once
        # (the vocabulary: ~1.7 MB for a 49k one), would count in the RSS a second time
        self._release_range(v.offset, v.end)
        return out

    def _string_array(self, v: LazyValue) -> list[str]:
        # bounds were checked while parsing; copy the array's bytes once and slice them
        data = bytes(self._buf[v.offset : v.end])
        pos = 0
        out: list[str] = []
        append = out.append
        unpack = _U64.unpack_from
        for _ in range(v.count):
            (n,) = unpack(data, pos)
            pos += 8
            raw = data[pos : pos + n]
            pos += n
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                # llama.cpp keeps token bytes as they are; keep them decodable and lossless
                append(raw.decode("utf-8", errors="surrogateescape"))
        return out

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return self.metadata[key] if key in self.metadata else default

    # -- tensors ---------------------------------------------------------------------------

    def tensor_bytes(self, name: str) -> np.ndarray:
        """uint8 view (rows, row_bytes) of a tensor's data, straight from the mapping (no copy)."""
        gf = self.file_of(name)
        gf._check_open()
        t = self.tensors[name]
        blck, bsize = block_size(t.type)
        row_bytes = t.ne[0] // blck * bsize
        flat = np.frombuffer(gf._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return flat.reshape(-1, row_bytes)

    def adjacent_bytes(self, names: Sequence[str]) -> np.ndarray | None:
        """One uint8 view (rows, row_bytes) of tensors that lie one after another in the file with
        the same row size, their rows stacked without a copy (a fused weight's parts: converted
        files often store ffn_gate just before ffn_up); None when they do not (nor in one file)."""
        ts, rows = [self.tensors[n] for n in names], [self.tensor_bytes(n) for n in names]
        if any(b.offset != a.offset + a.nbytes for a, b in zip(ts, ts[1:])) or len({r.shape[1] for r in rows}) != 1:
            return None
        if len({id(self.file_of(n)) for n in names}) != 1:
            return None
        buf = self.file_of(names[0])._buf
        return np.frombuffer(buf, np.uint8, sum(t.nbytes for t in ts), ts[0].offset).reshape(-1, rows[0].shape[1])

    def release_pages(self, name: str) -> int:
        """Drop this process's mapped pages of a tensor (madvise MADV_DONTNEED on the whole pages
        inside it; a page shared with a neighbour stays). For a tensor whose bytes were copied
        (a fused weight's parts): the copy is what runs, and the file's pages would otherwise
        count in the RSS a second time. The mapping is read-only and file-backed, so a later
        read faults the bytes back in unchanged. Returns the bytes released (0 where the
        platform has no madvise)."""
        gf = self.file_of(name)
        gf._check_open()
        t = self.tensors[name]
        return gf._release_range(t.offset, t.offset + t.nbytes)

    def _release_range(self, lo: int, hi: int) -> int:
        # the whole pages inside [lo, hi): a page shared with bytes outside it stays
        mm = self._mmap
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if mm is None or advice is None or not hasattr(mm, "madvise"):
            return 0
        page = mmap.PAGESIZE
        start = -(-lo // page) * page
        end = hi // page * page
        if end <= start:
            return 0
        mm.madvise(advice, start, end - start)
        return end - start

    def content_key(self, sample: int = 4096) -> str:
        """The file's identity by content, for caches of prepared weights (a copy or a touched
        file has the same): BLAKE2b of its size, its whole header (metadata and tensor index:
        names, types, shapes, offsets) and `sample` bytes at the start, middle and end of every
        tensor. Cost: the header (1.7 MB for SmolLM2's vocabulary) plus 12 KiB per tensor (3.3 MB
        for its 272 tensors), ~10 ms; the rest of the weights is not read. An edit inside a
        tensor that leaves the header and those samples as they were goes unnoticed. A split
        model's key is the BLAKE2b of its files' keys."""
        if not self.splits:
            return self._file_key(sample)
        h = blake2b(digest_size=16)
        for key in (self._file_key(sample), *(part._file_key(sample) for part in self.splits)):
            h.update(key.encode())
        return h.hexdigest()

    def _file_key(self, sample: int) -> str:
        self._check_open()
        buf = self._buf
        h = blake2b(digest_size=16)
        h.update(f"{self.size}|{self.data_offset}|".encode())
        h.update(buf[: self.data_offset])
        own = (t for name, t in self.tensors.items() if name not in self._holder)
        for t in sorted(own, key=lambda t: t.offset):
            if t.nbytes <= 3 * sample:
                h.update(buf[t.offset : t.offset + t.nbytes])
            else:
                for at in (0, (t.nbytes - sample) // 2, t.nbytes - sample):
                    h.update(buf[t.offset + at : t.offset + at + sample])
        self._release_range(0, self.data_offset)  # the header, read for the hash alone
        return h.hexdigest()

    def close(self) -> None:
        """Release the mapping. Views handed out keep it alive: then it goes when they do."""
        for part in self.splits:
            part.close()
        if self._closed:
            return
        self._closed = True
        try:
            self._buf.release()
            if self._mmap is not None:
                self._mmap.close()
        except (BufferError, ValueError):
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, version={self.version}, keys={len(getattr(self, 'metadata', ()))}, "
            f"tensors={len(self.tensors)}{f', splits={len(self.splits) + 1}' if self.splits else ''})"
        )

    def describe_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type.name] = counts.get(t.type.name, 0) + 1
        return counts


def split_paths(path: Path, no: int, count: int) -> list[Path]:
    """The `count` files of a split model from the path of its file `no` (0-based):
    llama_split_prefix, then llama_split_path's `<prefix>-%05d-of-%05d.gguf`; [] when the name
    does not end as file `no`'s does."""
    tail = f"-{no + 1:05d}-of-{count:05d}.gguf"
    if not path.name.endswith(tail) or path.name == tail:
        return []
    prefix = path.name[: -len(tail)]
    return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


__all__ = ["GGUFFile", "split_paths", "TensorInfo", "Metadata", "LazyValue", "GGUFError", "type_name"]
