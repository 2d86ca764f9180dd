"""Time to compute one token's mask with llguidance, XGrammar and outlines-core (issue 30).

For each vocabulary (49k SmolLM2, 128k Llama 3 BPE, 152k Qwen2) and each engine: the time to
build the engine's token table, to compile each grammar, and the median / p90 time of one
token's mask over a forced generation (the tokens of a valid document, fed one by one: mask,
then accept), with 64 MiB read between two tokens, as a decode step streams the weights between two
masks (masks timed with warm caches come out ~10x faster than the engine sees them). Grammars: a JSON schema (nested objects, bounded arrays, enum, number range,
string pattern) and llama.cpp's grammars/json.gbnf (its `ws ::= | ...` written `(...)?`, which XGrammar
parses; XGrammar's EBNF reads GBNF; outlines-core
takes only regexes: its JSON-schema -> regex path). The last column of llguidance is llamapy's
whole per-token cost (model/constrain.py: mask written into float32 logits + accept).

    python bench/constraint_mask.py [--engines llguidance,xgrammar,outlines] [--vocab 49k,128k,152k]

Needs `pip install llguidance xgrammar outlines-core` (only llguidance is llamapy's dependency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from llamapy.model.tokenizer import ATTR_CONTROL, Tokenizer
from llamapy.types import cache_dir

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "vocab"
VOCABS = {
    "49k": cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf",
    "128k": SHARED / "ggml-vocab-llama-bpe.gguf",
    "152k": SHARED / "ggml-vocab-qwen2.gguf",
}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)*$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "title": {"type": "string"},
                    "price": {"type": "number", "minimum": 0},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["id", "title", "price", "in_stock"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "role", "tags", "items"],
    "additionalProperties": False,
}

DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "engines", "poetry", "notes", "analysis"],
    "items": [
        {"id": i, "title": f"Item number {i} of the catalogue", "price": 3.5 * i + 0.25, "in_stock": i % 2 == 0}
        for i in range(1, 13)
    ],
}

JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= (" " | "\n" [ \t]{0,20})?
"""


def pieces(tok: Tokenizer, ff_control: bool) -> list[bytes]:
    out = []
    for i in range(tok.n_vocab):
        p = tok.token_to_piece(i)
        if not p and ff_control and tok.token_attr(i) & ATTR_CONTROL:
            p = b"\xff" + tok.token_to_piece(i, special=True)
        out.append(p)
    return out


# what a decode step does to the caches between two masks (SmolLM2's weights are 94 MiB)
_SCRATCH = np.ones((64 << 20) // 8)


def evict() -> None:
    _SCRATCH.sum()


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs) * 1e3, xs[int(0.9 * (len(xs) - 1))] * 1e3


class LLG:
    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        from llamapy.model.constrain import _Vocab

        self.tok = tok
        self.vocab = _Vocab(tok)

    def compile(self, kind: str, text: str):  # noqa: ANN201
        from llamapy.model.constrain import CompiledConstraint, ConstraintSpec

        return CompiledConstraint(ConstraintSpec(kind, text), self.vocab)

    def run(self, cc, ids: list[int]) -> tuple[list[float], list[float]]:  # noqa: ANN001
        raw = cc.matcher()._m  # noqa: SLF001 - the engine's own call, timed alone
        bits = np.zeros((self.tok.n_vocab + 31) // 32, np.int32)
        t_mask, t_all = [], []
        for t in ids:
            evict()
            t0 = time.perf_counter()
            raw.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            t_mask.append(time.perf_counter() - t0)
            assert raw.consume_token(t), "llguidance refused the document's token"
        m = cc.matcher()  # again, through llamapy's Matcher: the whole per-token cost
        logits = np.zeros(self.tok.n_vocab, np.float32)
        for t in ids:
            evict()
            t0 = time.perf_counter()
            m.mask(logits)
            m.accept(t)
            t_all.append(time.perf_counter() - t0)
            assert np.isfinite(logits[t]), "the document's token was masked"
            logits[:] = 0
        return t_mask, t_all


class XGR:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(pieces(tok, False), xgr.VocabType.RAW, vocab_size=tok.n_vocab,
                                 stop_token_ids=sorted(tok.eog_ids))  # fmt: skip
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.n = tok.n_vocab

    def compile(self, kind: str, text: str):  # noqa: ANN201
        if kind == "json_schema":
            return self.compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=20)
        return self.compiler.compile_grammar(text)

    def run(self, cc, ids: list[int]) -> tuple[list[float], list[float]]:  # noqa: ANN001
        m = self.xgr.GrammarMatcher(cc)
        bm = self.xgr.allocate_token_bitmask(1, self.n)
        t_mask = []
        for t in ids:
            evict()
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            t_mask.append(time.perf_counter() - t0)
            assert m.accept_token(t), "xgrammar refused the document's token"
        return t_mask, []


class OUT:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer) -> None:
        import outlines_core as oc

        self.oc = oc
        eog = sorted(tok.eog_ids)
        vmap: dict[bytes, list[int]] = {}
        for i, p in enumerate(pieces(tok, False)):
            if p and i not in eog:
                vmap.setdefault(p, []).append(i)
        self.vocab = oc.Vocabulary(eog[0], vmap)
        self.n = tok.n_vocab

    def compile(self, kind: str, text: str):  # noqa: ANN201
        if kind != "json_schema":
            return None  # regexes only: no GBNF
        regex = self.oc.json_schema.build_regex_from_schema(text)
        return self.oc.Index(regex, self.vocab)

    def run(self, cc, ids: list[int]) -> tuple[list[float], list[float]]:  # noqa: ANN001
        g = self.oc.Guide(cc)
        bm = np.zeros((self.n + 31) // 32, np.int32)
        t_mask = []
        for t in ids:
            evict()
            t0 = time.perf_counter()
            g.write_mask_into(bm.ctypes.data, bm.size, 4)
            t_mask.append(time.perf_counter() - t0)
            g.advance(t, return_tokens=False)
        return t_mask, []


ENGINES = {"llguidance": LLG, "xgrammar": XGR, "outlines": OUT}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines")
    ap.add_argument("--vocab", default="49k,128k,152k")
    args = ap.parse_args()
    doc = json.dumps(DOC)
    schema = json.dumps(SCHEMA)
    print("| vocab | engine | token table s | grammar | compile ms | mask median ms | mask p90 ms | llamapy mask+accept median / p90 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for vname in args.vocab.split(","):
        path = VOCABS[vname]
        if not path.exists():
            print(f"| {vname} | (missing {path}) |")
            continue
        tok = Tokenizer.from_file(path)
        ids = tok.encode(doc, add_special=False)
        for ename in args.engines.split(","):
            t0 = time.perf_counter()
            eng = ENGINES[ename](tok)
            t_tab = time.perf_counter() - t0
            for gname, kind, text in (("schema", "json_schema", schema), ("json.gbnf", "gbnf", JSON_GBNF)):
                t0 = time.perf_counter()
                try:
                    cc = eng.compile(kind, text)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    print(f"| {vname} ({tok.n_vocab}) | {eng.name} | {t_tab:.2f} | {gname} | failed: {e} | | | |")
                    continue
                t_c = (time.perf_counter() - t0) * 1e3
                if cc is None:
                    print(f"| {vname} ({tok.n_vocab}) | {eng.name} | {t_tab:.2f} | {gname} | n/a (no GBNF) | | | |")
                    continue
                t_mask, t_all = eng.run(cc, ids)
                med, p90 = stats(t_mask)
                extra = "%.3f / %.3f" % stats(t_all) if t_all else ""
                print(f"| {vname} ({tok.n_vocab}) | {eng.name} | {t_tab:.2f} | {gname} ({len(ids)} tok) | "
                      f"{t_c:.1f} | {med:.3f} | {p90:.3f} | {extra} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
