"""A malformed-GGUF corpus, generated (never committed as binaries).

It starts from small valid files written with `gguf.GGUFWriter` (with tensors of several types),
maps every structural field of them with an independent little walker (`layout`), and derives
cases from that map: truncations at every boundary and at random points, seeded bit flips,
absurd counts and lengths, unknown types, bad shapes, bad/overlapping/misaligned tensor offsets,
duplicate names, non-UTF-8 names, wrong magic and versions.

Each `Case` records what it broke: `expect` is a substring the `GGUFError` must contain (the key,
the tensor name, the header field), or "" where any `GGUFError` will do (bit flips, off-by-one
counts whose effect depends on the bytes that follow). `may_pass` marks cases that a reader may
legitimately accept (a flip in a value byte, garbage after the data).

Expected strings follow llamapy's messages: keys are quoted as repr (`'general.name'`), keys and
tensor infos whose name could not be read yet are numbered (`key #3 `, `tensor #1 `, with the
trailing space so that #1 does not match #10).
"""

from __future__ import annotations

import functools
import random
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

HEADER = 24
MIN_KV = 13  # the reader's lower bound per key/value (see llamapy.model.gguf)
MIN_TI = 32  # ... and per tensor info
SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    expect: str  # substring of the GGUFError message; "" = any GGUFError
    may_pass: bool = False  # the file may be accepted (then every read must still be clean)

    @property
    def kind(self) -> str:
        return self.name.split("/")[1]


# -- valid base files ----------------------------------------------------------------------


def _write(path: Path, build) -> bytes:
    w = GGUFWriter(path, "llama")
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _quant(rng: np.random.Generator, t: QT, ne0: int, rows: int) -> np.ndarray:
    blck, nbytes = GGML_QUANT_SIZES[t]
    return rng.integers(0, 256, size=(rows, ne0 // blck * nbytes), dtype=np.uint8)


def _base_a(w: GGUFWriter) -> None:
    rng = np.random.default_rng(1)
    w.add_name("corpus-a")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.25)
    w.add_string("t.str", "héllo wörld")
    w.add_key_value("t.arr_i32", [1, -2, 3], VT.ARRAY, VT.INT32)
    w.add_key_value("t.arr_str", ["a", "", "ccc", "日本"], VT.ARRAY, VT.STRING)
    w.add_key_value("t.arr_f32", [0.5, 1.0], VT.ARRAY, VT.FLOAT32)
    w.add_key_value("t.arr_bool", [True, False, True], VT.ARRAY, VT.BOOL)
    w.add_tensor("tok_embd.weight", rng.standard_normal((8, 4)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", _quant(rng, QT.Q8_0, 64, 2), raw_dtype=QT.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", _quant(rng, QT.Q4_K, 256, 2), raw_dtype=QT.Q4_K)
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float16))


def _base_b(w: GGUFWriter) -> None:
    rng = np.random.default_rng(2)
    w.add_custom_alignment(64)
    w.add_uint32("llama.block_count", 1)
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "</s>", "▁a", "b"], VT.ARRAY, VT.STRING)
    w.add_tensor("blk.0.attn_k.weight", _quant(rng, QT.Q6_K, 256, 1), raw_dtype=QT.Q6_K)
    w.add_tensor("blk.0.attn_v.weight", _quant(rng, QT.Q4_0, 32, 3), raw_dtype=QT.Q4_0)
    w.add_tensor("rope_freqs", np.arange(6, dtype=np.int32))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal((2, 3, 2)).astype(np.float32))


@functools.lru_cache(maxsize=None)
def base_files() -> dict[str, bytes]:
    """The valid starting points, by short name (written to a temporary directory and read back)."""
    with tempfile.TemporaryDirectory(prefix="llamapy-corpus-") as d:
        return {
            "A": _write(Path(d) / "a.gguf", _base_a),
            "B": _write(Path(d) / "b.gguf", _base_b),
        }


# -- an independent map of a valid file ----------------------------------------------------


@dataclass
class KV:
    index: int
    key: str
    start: int  # key length field
    type_pos: int
    value_pos: int
    end: int
    vtype: int
    item_type: int = -1
    count: int = 1
    elems: list[tuple[int, int]] = field(default_factory=list)  # (length field, end) per string element


@dataclass
class TI:
    index: int
    name: str
    start: int  # name length field
    ndims_pos: int
    dims_pos: int
    type_pos: int
    offset_pos: int
    end: int
    ne: tuple[int, ...]
    ttype: int
    offset: int


@dataclass
class Layout:
    data: bytes
    kvs: list[KV]
    tis: list[TI]
    n_tensors: int
    n_kv: int
    info_end: int  # end of the last tensor info
    alignment: int
    data_offset: int
    spans: list[tuple[int, int, str]]  # absolute [start, end) of each tensor's data, info order


def layout(data: bytes) -> Layout:
    u32 = lambda p: struct.unpack_from("<I", data, p)[0]  # noqa: E731
    u64 = lambda p: struct.unpack_from("<Q", data, p)[0]  # noqa: E731
    assert data[:4] == b"GGUF"
    n_tensors, n_kv = u64(8), u64(16)
    pos = HEADER
    kvs: list[KV] = []
    alignment = 32
    for i in range(n_kv):
        start = pos
        n = u64(pos)
        key = data[pos + 8 : pos + 8 + n].decode()
        pos += 8 + n
        type_pos = pos
        vtype = u32(pos)
        pos += 4
        kv = KV(i, key, start, type_pos, pos, 0, vtype)
        if vtype in SCALAR_SIZE:
            if key == "general.alignment":
                alignment = u32(pos)
            pos += SCALAR_SIZE[vtype]
        elif vtype == 8:
            pos += 8 + u64(pos)
        else:
            kv.item_type, kv.count = u32(pos), u64(pos + 4)
            pos += 12
            for _ in range(kv.count):
                if kv.item_type == 8:
                    e = pos + 8 + u64(pos)
                    kv.elems.append((pos, e))
                    pos = e
                else:
                    pos += SCALAR_SIZE[kv.item_type]
        kv.end = pos
        kvs.append(kv)
    tis: list[TI] = []
    for i in range(n_tensors):
        start = pos
        n = u64(pos)
        name = data[pos + 8 : pos + 8 + n].decode()
        pos += 8 + n
        ndims_pos = pos
        nd = u32(pos)
        ne = tuple(u64(pos + 4 + 8 * j) for j in range(nd))
        type_pos = pos + 4 + 8 * nd
        tis.append(TI(i, name, start, ndims_pos, pos + 4, type_pos, type_pos + 4, type_pos + 12,
                      ne, u32(type_pos), u64(type_pos + 4)))
        pos = type_pos + 12
    data_offset = pos + (-pos) % alignment
    spans = []
    for t in tis:
        blck, nbytes = GGML_QUANT_SIZES[QT(t.ttype)]
        n = int(np.prod(t.ne))
        spans.append((data_offset + t.offset, data_offset + t.offset + n // blck * nbytes, t.name))
    return Layout(data, kvs, tis, n_tensors, n_kv, pos, alignment, data_offset, spans)


# -- editing helpers -----------------------------------------------------------------------


def patch(data: bytes, pos: int, fmt: str, value: int | float) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, pos, value)
    return bytes(b)


def splice(lay: Layout, start: int, end: int, new: bytes, alignment: int | None = None) -> bytes:
    """Replace header bytes [start, end) (before the data section), re-pad, keep the data section.

    Tensor offsets are relative to the data section, so the file stays valid apart from the edit.
    """
    d = lay.data
    assert end <= lay.info_end
    head = d[:start] + new + d[end : lay.info_end]
    align = alignment or lay.alignment
    return head + b"\0" * ((-len(head)) % align) + d[lay.data_offset :]


def gguf_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def expect_for_cut(lay: Layout, p: int) -> tuple[str, bool]:
    """What the reader must report for the file cut to its first `p` bytes: (expect, may_pass)."""
    if p < HEADER:
        return "too short", False
    room = p - HEADER
    if lay.n_kv * MIN_KV > room:
        return "kv_count", False
    if lay.n_tensors * MIN_TI > room - lay.n_kv * MIN_KV:
        return "tensor_count", False
    for kv in lay.kvs:
        if p < kv.type_pos:
            return f"key #{kv.index} ", False
        if p < kv.end:
            return repr(kv.key), False
    for t in lay.tis:
        if p < t.ndims_pos:
            return f"tensor #{t.index} ", False
        if p < t.end:
            return repr(t.name), False
    if lay.tis and p < lay.data_offset:
        return "data section", False
    for s, e, name in lay.spans:
        if e > p:
            return repr(name), False
    return "", True  # only trailing padding was cut


# -- the corpus ----------------------------------------------------------------------------

BIG = {"2^63": 2**63, "2^64-1": 2**64 - 1, "2^40": 2**40, "2^62": 2**62}


def _header_cases(tag: str, lay: Layout) -> list[Case]:
    d = lay.data
    out: list[Case] = []
    for magic in (b"GGML", b"GGJT", b"gguf", b"\x89PNG", b"\0\0\0\0", b"FUGG"):
        out.append(Case(f"{tag}/magic/{magic!r}", magic + d[4:], "magic"))
    for v in (0, 1, 4, 5, 0xFFFFFFFF):
        out.append(Case(f"{tag}/version/{v}", patch(d, 4, "<I", v), "version"))
    out.append(Case(f"{tag}/version/big-endian", patch(d, 4, ">I", 3), "big-endian"))
    for label in ("2^40", "2^63", "2^64-1"):
        out.append(Case(f"{tag}/tensor_count/{label}", patch(d, 8, "<Q", BIG[label]), "tensor_count"))
    for label in ("2^40", "2^62", "2^64-1"):
        out.append(Case(f"{tag}/kv_count/{label}", patch(d, 16, "<Q", BIG[label]), "kv_count"))
    # off-by-one counts: the reader walks into the next section; what it reports depends on the bytes
    out.append(Case(f"{tag}/count_off/tensors+1", patch(d, 8, "<Q", lay.n_tensors + 1), "", True))
    out.append(Case(f"{tag}/count_off/kv+1", patch(d, 16, "<Q", lay.n_kv + 1), "", True))
    out.append(Case(f"{tag}/count_off/kv-1", patch(d, 16, "<Q", lay.n_kv - 1), "", True))
    out.append(Case(f"{tag}/count_off/tensors=0", patch(d, 8, "<Q", 0), "", True))
    out.append(Case(f"{tag}/trailing/garbage", d + b"\xde\xad\xbe\xef" * 16, "", True))
    return out


def _kv_cases(tag: str, lay: Layout) -> list[Case]:
    d = lay.data
    out: list[Case] = []
    for kv in lay.kvs:
        k, i = repr(kv.key), kv.index
        nth = f"key #{i} "
        for label in ("2^63", "2^64-1"):
            out.append(Case(f"{tag}/key_len/#{i}={label}", patch(d, kv.start, "<Q", BIG[label]), nth))
        out.append(Case(f"{tag}/key_len/#{i}=size", patch(d, kv.start, "<Q", len(d)), nth))
        out.append(Case(f"{tag}/key_utf8/#{i}=ff", patch(d, kv.start + 8, "B", 0xFF), nth))
        out.append(Case(f"{tag}/key_utf8/#{i}=surrogate",
                        d[: kv.start + 8] + b"\xed\xa0\x80" + d[kv.start + 11 :], nth))
        for vt in (13, 0x7FFFFFFF, 0xFFFFFFFF):
            out.append(Case(f"{tag}/value_type/{kv.key}={vt}", patch(d, kv.type_pos, "<I", vt), k))
        if i > 0:
            first = lay.kvs[0].key
            out.append(Case(f"{tag}/dup_key/#{i}={first}",
                            splice(lay, kv.start, kv.type_pos, gguf_string(first)), repr(first)))
        if kv.vtype == 8:
            out.append(Case(f"{tag}/str_len/{kv.key}=2^63", patch(d, kv.value_pos, "<Q", 2**63), k))
            out.append(Case(f"{tag}/str_len/{kv.key}=rest+1",
                            patch(d, kv.value_pos, "<Q", len(d) - kv.value_pos - 8 + 1), k))
            # invalid UTF-8 in a string value: reported when the value is read
            if kv.end - kv.value_pos > 8:
                out.append(Case(f"{tag}/str_utf8/{kv.key}", patch(d, kv.value_pos + 8, "B", 0xC0), k))
        if kv.vtype == 9:
            for label in ("2^62", "2^64-1"):
                out.append(Case(f"{tag}/arr_len/{kv.key}={label}",
                                patch(d, kv.value_pos + 4, "<Q", BIG[label]), k))
            for it in (9, 13, 0xFFFFFFFF):
                out.append(Case(f"{tag}/arr_type/{kv.key}={it}", patch(d, kv.value_pos, "<I", it), k))
            for j, (ep, _ee) in enumerate(kv.elems[:1] + kv.elems[-1:]):
                out.append(Case(f"{tag}/arr_str_len/{kv.key}[{j}]=2^63", patch(d, ep, "<Q", 2**63), k))
    return out


def _alignment_cases(tag: str, lay: Layout) -> list[Case]:
    kv = next((kv for kv in lay.kvs if kv.key == "general.alignment"), None)
    if kv is None:
        return []
    d = lay.data
    out: list[Case] = []
    what = "general.alignment"
    for v in (0, 3, 48, 2**31):
        out.append(Case(f"{tag}/alignment/{v}", patch(d, kv.value_pos, "<I", v), what))
    # another power of two: the data section moves; a reader may accept it (tensors stay in bounds)
    out.append(Case(f"{tag}/alignment/16", patch(d, kv.value_pos, "<I", 16), "", True))
    for label, vt, payload in (
        ("string", 8, gguf_string("64")),
        ("float32", 6, struct.pack("<f", 64.0)),
        ("bool", 7, b"\x01"),
        ("int32", 5, struct.pack("<i", 64)),
        ("uint64", 10, struct.pack("<Q", 64)),
        ("array", 9, struct.pack("<IQI", 4, 1, 64)),
    ):
        new = struct.pack("<I", vt) + payload
        out.append(Case(f"{tag}/alignment_type/{label}", splice(lay, kv.type_pos, kv.end, new), what))
    return out


def _tensor_cases(tag: str, lay: Layout) -> list[Case]:
    d = lay.data
    out: list[Case] = []
    for t in lay.tis:
        n, i = repr(t.name), t.index
        nth = f"tensor #{i} "
        for label in ("2^63", "2^64-1"):
            out.append(Case(f"{tag}/name_len/#{i}={label}", patch(d, t.start, "<Q", BIG[label]), nth))
        out.append(Case(f"{tag}/name_utf8/#{i}", patch(d, t.start + 8, "B", 0xFF), nth))
        out.append(Case(f"{tag}/name_long/#{i}", splice(lay, t.start, t.ndims_pos, gguf_string("x" * 64)), nth))
        if i > 0:
            first = lay.tis[0].name
            out.append(Case(f"{tag}/dup_tensor/#{i}",
                            splice(lay, t.start, t.ndims_pos, gguf_string(first)), repr(first)))
        # n_dims
        out.append(Case(f"{tag}/n_dims/{t.name}=0",
                        splice(lay, t.ndims_pos, t.type_pos, struct.pack("<I", 0)), n))
        dims5 = struct.pack("<I", 5) + struct.pack("<5Q", *(t.ne + (1,) * (5 - len(t.ne))))
        out.append(Case(f"{tag}/n_dims/{t.name}=5", splice(lay, t.ndims_pos, t.type_pos, dims5), n))
        out.append(Case(f"{tag}/n_dims/{t.name}=2^32-1", patch(d, t.ndims_pos, "<I", 0xFFFFFFFF), n))
        # dimensions
        for j in range(len(t.ne)):
            out.append(Case(f"{tag}/dim_zero/{t.name}[{j}]", patch(d, t.dims_pos + 8 * j, "<Q", 0), n))
        for label in ("2^40", "2^63", "2^64-1"):
            out.append(Case(f"{tag}/dim_huge/{t.name}={label}",
                            patch(d, t.dims_pos + 8 * (len(t.ne) - 1), "<Q", BIG[label]), n))
        blck = GGML_QUANT_SIZES[QT(t.ttype)][0]
        if blck > 1:
            for delta in (-1, 1, blck // 2):
                out.append(Case(f"{tag}/row_not_block/{t.name}{delta:+d}",
                                patch(d, t.dims_pos, "<Q", t.ne[0] + delta), n))
        else:  # a block type whose block does not divide this row length
            out.append(Case(f"{tag}/row_not_block/{t.name}->Q4_K", patch(d, t.type_pos, "<I", int(QT.Q4_K)), n))
        # types
        for tt in (4, 5, 31, 99, 0xFFFFFFFF):
            out.append(Case(f"{tag}/tensor_type/{t.name}={tt}", patch(d, t.type_pos, "<I", tt), n))
        # offsets
        for delta in (1, lay.alignment // 2):
            out.append(Case(f"{tag}/misaligned/{t.name}+{delta}",
                            patch(d, t.offset_pos, "<Q", t.offset + delta), n))
        for label, off in (("2^63", 2**63), ("2^64-align", 2**64 - lay.alignment),
                           ("eof", len(d) - lay.data_offset + (-(len(d) - lay.data_offset)) % lay.alignment)):
            out.append(Case(f"{tag}/offset_oob/{t.name}={label}", patch(d, t.offset_pos, "<Q", off), n))
        if i > 0:
            out.append(Case(f"{tag}/overlap/{t.name}=#0", patch(d, t.offset_pos, "<Q", lay.tis[0].offset), n))
            prev = lay.tis[i - 1]
            s, e, _ = lay.spans[i - 1]
            if e - s > lay.alignment:
                out.append(Case(f"{tag}/overlap/{t.name}=prev+align",
                                patch(d, t.offset_pos, "<Q", prev.offset + lay.alignment), n))
    return out


def _truncation_cases(tag: str, lay: Layout, rng: random.Random) -> list[Case]:
    d = lay.data
    points = {0, 1, 2, 3, 4, 6, 8, 12, 16, 20, 23, 24}
    for kv in lay.kvs:
        points |= {kv.start, kv.start + 4, kv.start + 8, kv.start + 9, kv.type_pos, kv.type_pos + 2,
                   kv.value_pos, kv.value_pos + 1, kv.end - 1, kv.end}
        if kv.vtype == 9:
            points |= {kv.value_pos + 4, kv.value_pos + 8}
            for ep, ee in kv.elems:
                points |= {ep, ep + 4, ee - 1}
    for t in lay.tis:
        points |= {t.start, t.start + 8, t.start + 9, t.ndims_pos, t.dims_pos, t.type_pos, t.offset_pos,
                   t.offset_pos + 4, t.end - 1, t.end}
        points |= {t.dims_pos + 8 * j for j in range(len(t.ne))}
    points |= {lay.info_end + 1, lay.data_offset}
    for s, e, _ in lay.spans:
        points |= {s, s + 1, (s + e) // 2, e - 1, e}
    points |= {len(d) - 1}
    out = []
    for p in sorted(x for x in points if 0 <= x < len(d)):
        expect, may_pass = expect_for_cut(lay, p)
        out.append(Case(f"{tag}/truncate/{p}", d[:p], expect, may_pass))
    for p in sorted(rng.sample(range(len(d)), 30)):
        expect, may_pass = expect_for_cut(lay, p)
        out.append(Case(f"{tag}/truncate_random/{p}", d[:p], expect, may_pass))
    return out


def _bitflip_cases(tag: str, lay: Layout, rng: random.Random, n: int) -> list[Case]:
    d = lay.data
    out = []
    for k in range(n):
        b = bytearray(d)
        # half of the flips land in the header (where they matter most), half anywhere
        limit = lay.data_offset if k % 2 == 0 else len(d)
        flips = []
        for _ in range(1 + k % 3):
            pos, bit = rng.randrange(limit), rng.randrange(8)
            b[pos] ^= 1 << bit
            flips.append(f"{pos}.{bit}")
        out.append(Case(f"{tag}/bitflip/{k}@{'+'.join(flips)}", bytes(b), "", True))
    return out


@functools.lru_cache(maxsize=None)
def build_cases() -> tuple[Case, ...]:
    cases: list[Case] = []
    for tag, data in base_files().items():
        lay = layout(data)
        rng = random.Random(f"llamapy-gguf-corpus-{tag}")
        cases += _header_cases(tag, lay)
        cases += _kv_cases(tag, lay)
        cases += _alignment_cases(tag, lay)
        cases += _tensor_cases(tag, lay)
        cases += _truncation_cases(tag, lay, rng)
        cases += _bitflip_cases(tag, lay, rng, 60)
    # files that are not GGUF at all
    png = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + bytes(13) + b"\0" * 8
    cases.append(Case("X/png/header", png, "magic"))
    cases.append(Case("X/text/plain", b"hello, this is a plain text file, not a model\n" * 3, "magic"))
    cases.append(Case("X/empty/0-bytes", b"", "too short"))
    cases.append(Case("X/short/10-bytes", b"GGUF\x03\0\0\0\0\0", "too short"))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return tuple(cases)


def fast_cases() -> tuple[Case, ...]:
    """About 35 cases: the first case of each kind (base A first, then B, then the non-GGUF files)."""
    seen: set[str] = set()
    out = []
    for c in build_cases():
        if c.kind not in seen:
            seen.add(c.kind)
            out.append(c)
    return tuple(out)
