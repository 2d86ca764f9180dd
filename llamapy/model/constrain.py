"""Constrained sampling: a grammar, JSON schema or regex masks the logits before the sampler
chain (llama.cpp's `common/llguidance.cpp` + the grammar sampler of `src/llama-grammar.cpp`).

The engine is llguidance (llama.cpp's own optional one; bench/RESULTS.md, stop 27, has the
measurements that chose it over XGrammar and outlines-core). What each kind means:

- "gbnf": a GBNF grammar as llama.cpp writes it (`root ::= ...`), converted to llguidance's Lark
  dialect by llguidance's own converter; a text that starts with `%llguidance` is taken as Lark,
  as llama.cpp does;
- "lark": llguidance's Lark dialect (with `%json{...}` to embed a schema);
- "json_schema": the schema as JSON text; the keywords llguidance cannot enforce (`uniqueItems`,
  `not`, `if`/`then`, `contains`, unknown formats, look-around in patterns, ...) are refused
  with ConstraintError, never ignored (llguidance's non-lenient mode);
- "json_object": any JSON object (OpenAI's JSON mode, llama-cpp-python's JSON grammar);
- "regex": the whole output matches the regex.

JSON whitespace between tokens is bounded as llama.cpp's json-schema-to-grammar bounds it
(`space ::= | " " | "\\n" [ \\t]{0,20}`): with llguidance's unbounded default a small model can
emit newlines forever inside a JSON value.

`compile_constraint` turns a spec into a CompiledConstraint for one vocabulary, cached on the
Tokenizer (so per model: no process-global state); each sequence takes its own Matcher. The
token table handed to llguidance is llama.cpp's: each token's piece, with control tokens as
0xFF + their text (so a Lark grammar may name `<|im_end|>`), and every end-of-generation token
as an EOS the grammar allows once it is complete.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..types import LlamapyError

__all__ = ["KINDS", "CompiledConstraint", "ConstraintError", "ConstraintSpec", "Matcher", "compile_constraint", "response_format_spec"]

KINDS = ("gbnf", "json_schema", "json_object", "regex", "lark")
# llama.cpp's json-schema-to-grammar SPACE_RULE, as a regex
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
_CACHE_SIZE = 32  # compiled constraints kept per vocabulary (a server's recurring schemas)
# byte -> the 8 logit offsets of its bits (bit i set: token allowed, 0; else -inf); a gather and
# an add, with no branch on each token: a `where=` copy took 0.3-0.6 ms on a 128k row whose
# allowed tokens are scattered, this 0.12 ms whatever the mask
_BIT_OFFSETS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)


class ConstraintError(LlamapyError):
    """An invalid or unenforceable grammar/schema, or a token the constraint does not allow."""


@dataclass(frozen=True)
class ConstraintSpec:
    kind: str  # "gbnf" | "json_schema" | "json_object" | "regex" | "lark"
    source: str  # grammar text; for json_schema the schema as JSON text; "" for json_object


def _one_line(msg: str, n: int = 3) -> str:
    """llguidance's messages carry a caret drawing over several lines; the first line and the
    position line say where."""
    lines = [ln.strip() for ln in str(msg).strip().splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    return "; ".join(lines[:n]) if lines else "invalid grammar"


def _json_position(source: str, what: str) -> Any:
    try:
        return json.loads(source)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


# keywords whose value maps names (not keywords) to subschemas
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _schema_where(spec: ConstraintSpec, msg: str) -> str:
    """" at /json/pointer" of the subschema an unenforceable-keyword message is about:
    llguidance names the keyword, not where it is."""
    if spec.kind != "json_schema":
        return ""
    if msg.startswith("Unimplemented keys: "):
        try:
            keys = set(json.loads(msg.split(": ", 1)[1]))
        except (ValueError, TypeError):
            return ""
        ptr = _find(json.loads(spec.source), lambda d: bool(keys & d.keys()))
    elif msg.startswith("Unknown format: "):
        fmt = msg.split(": ", 1)[1]
        ptr = _find(json.loads(spec.source), lambda d: d.get("format") == fmt)
    else:
        return ""
    return f" at {ptr or '/'}" if ptr is not None else ""


def _find(node: Any, want: Any, path: str = "", names: bool = False) -> str | None:
    """The JSON pointer of the first subschema (depth first) for which want(subschema)."""
    if isinstance(node, dict):
        if not names and want(node):
            return path
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for k, v in items:
        key = str(k).replace("~", "~0").replace("/", "~1")
        hit = _find(v, want, f"{path}/{key}", not names and k in _NAME_MAPS)
        if hit is not None:
            return hit
    return None


def _grammar(spec: ConstraintSpec) -> str:
    """llguidance's grammar text for a spec (not yet checked against a vocabulary)."""
    import llguidance as llg

    if spec.kind not in KINDS:
        raise ConstraintError(f"unknown constraint kind {spec.kind!r} (expected one of {', '.join(KINDS)})")
    if not isinstance(spec.source, str):
        raise ConstraintError(f"the {spec.kind} constraint must be text, not {type(spec.source).__name__}")
    opts = {"whitespace_pattern": JSON_WHITESPACE}
    if spec.kind in ("json_schema", "json_object"):
        schema = _json_position(spec.source, "the JSON schema") if spec.kind == "json_schema" else {"type": "object"}
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON schema must be an object or a boolean, not {type(schema).__name__}")
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=opts)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.source)
    if not spec.source.strip():
        raise ConstraintError(f"the {spec.kind} grammar is empty")
    text = spec.source
    if spec.kind == "gbnf" and not text.lstrip().startswith("%llguidance"):
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except GbnfToLarkError as e:
            raise ConstraintError(f"invalid GBNF grammar: {_one_line(str(e))}") from None
        except Exception as e:  # noqa: BLE001 - the converter's other failures ("Rule 'x' not found", ...)
            raise ConstraintError(f"invalid GBNF grammar: {_one_line(str(e) or type(e).__name__)}") from None
    return llg.LLMatcher.grammar_from_lark(text)


class _Vocab:
    """llguidance's view of one Tokenizer and the constraints compiled for it (Tokenizer.constraints)."""

    def __init__(self, tokenizer: Any) -> None:
        import llguidance as llg

        from .tokenizer import ATTR_CONTROL

        n = tokenizer.n_vocab
        pieces = []
        for i in range(n):
            # llama.cpp's llguidance.cpp: the plain piece; a control token (empty without
            # special) as 0xFF + its text, so grammars can name it but text never matches it
            p = tokenizer.token_to_piece(i, special=False)
            if not p and tokenizer.token_attr(i) & ATTR_CONTROL:
                p2 = tokenizer.token_to_piece(i, special=True)
                p = b"\xff" + p2 if p2 else p
            pieces.append(p)
        eog = sorted(tokenizer.eog_ids) or ([tokenizer.eos] if tokenizer.eos is not None else [])
        if not eog:
            raise ConstraintError("the vocabulary has no end-of-generation token: a grammar cannot end")
        wrapper = _Wrapper(tokenizer, pieces, eog[0])
        self.n_vocab = n
        self.eog = eog
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=n, eos_token=eog)
        self.compiled: OrderedDict[ConstraintSpec, CompiledConstraint] = OrderedDict()
        self.lock = threading.Lock()  # a server compiles from its worker threads


class _Wrapper:
    """The tokenizer interface llguidance's TokenizerWrapper reads (tokens, eos, encode)."""

    def __init__(self, tokenizer: Any, pieces: list[bytes], eos: int) -> None:
        self._tok = tokenizer
        self.tokens = pieces
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos
        self.special_token_ids: list[int] = []

    def __call__(self, text: bytes) -> list[int]:
        # the text a grammar forces continues the reply: no SPM leading space (with one, the
        # mask of a Llama-2-style vocabulary allowed only the first byte of its space marker)
        return self._tok.encode(text, add_special=False, parse_special=False, space_prefix=False)


def compile_constraint(spec: ConstraintSpec, tokenizer: Any) -> CompiledConstraint:
    """The spec checked and compiled for this tokenizer's vocabulary (cached on the tokenizer:
    the first call for a vocabulary builds llguidance's token table, ~0.2-1 s). Raises
    ConstraintError naming the position or the feature."""
    vocab = getattr(tokenizer, "constraints", None)
    if vocab is None:
        vocab = tokenizer.constraints = _Vocab(tokenizer)
    with vocab.lock:
        hit = vocab.compiled.get(spec)
        if hit is not None:
            vocab.compiled.move_to_end(spec)
            return hit
    cc = CompiledConstraint(spec, vocab)  # (outside the lock: a big grammar takes a while)
    with vocab.lock:
        vocab.compiled[spec] = cc
        while len(vocab.compiled) > _CACHE_SIZE:
            vocab.compiled.popitem(last=False)
    return cc


class CompiledConstraint:
    """One spec compiled for one vocabulary; `matcher()` gives each sequence its own state."""

    def __init__(self, spec: ConstraintSpec, vocab: _Vocab) -> None:
        import llguidance as llg

        self.spec = spec
        self._vocab = vocab
        grammar = _grammar(spec)
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, vocab.lltok)
        if is_error:
            msg = _one_line(msgs[0] if msgs else "")
            raise ConstraintError(f"invalid {spec.kind.replace('_', ' ')}: {msg}{_schema_where(spec, msg)}")
        # matchers are deep copies of this one: the grammar is parsed once
        self._proto = llg.LLMatcher(vocab.lltok, grammar, log_level=0)
        if self._proto.is_error():
            raise ConstraintError(f"invalid {spec.kind.replace('_', ' ')}: {_one_line(self._proto.get_error())}")

    def matcher(self) -> Matcher:
        return Matcher(self._proto.deep_copy(), self._vocab.n_vocab)


class Matcher:
    """One sequence's position in the grammar."""

    def __init__(self, m: Any, n_vocab: int) -> None:
        self._m = m
        self._n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, np.int32)
        self._offsets = np.empty((self._bits.nbytes, 8), np.float32)  # a logit offset per token
        self._dead = False

    def mask(self, logits: np.ndarray) -> None:
        """Disallowed tokens' logits -> -inf, in place (logits past the vocabulary too)."""
        if self._m.is_error():
            self._dead = True
            logits[:] = -np.inf
            return
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        # bit i of word w is token 32*w + i: little-endian bytes, bits in little order
        np.take(_BIT_OFFSETS, self._bits.view(np.uint8), axis=0, out=self._offsets)
        logits[: self._n_vocab] += self._offsets.reshape(-1)[: self._n_vocab]
        logits[self._n_vocab :] = -np.inf
        self._dead = not self._bits.any()

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            err = self._m.get_error() if self._m.is_error() else ""
            why = _one_line(err, 1) if err else "the grammar does not allow it"
            raise ConstraintError(f"token {int(token)} rejected by the constraint: {why}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but end of generation."""
        return bool(self._m.is_stopped())

    @property
    def dead(self) -> bool:
        """No token is allowed (the last mask was empty) or the matcher failed (its error)."""
        return self._dead or bool(self._m.is_error())

    @property
    def error(self) -> str:
        return _one_line(self._m.get_error(), 1) if self._m.is_error() else ""


def response_format_spec(rf: Any) -> ConstraintSpec | None:
    """OpenAI's `response_format` as a spec: {"type": "text"} (None), {"type": "json_object"}
    (llama-cpp-python's form may carry a "schema"), {"type": "json_schema", "json_schema":
    {"name", "description", "schema", "strict"}}. The schema is enforced whatever "strict" says
    (enforcing is what strict asks; best effort is never less)."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ConstraintError('response_format must be an object with a "type"')
    kind = rf["type"]
    extra = set(rf) - {"type", "schema", "json_schema"}
    if kind == "text" and set(rf) == {"type"}:
        return None
    if kind == "json_object" and not extra and "json_schema" not in rf:
        return _schema_spec(rf["schema"], "response_format.schema") if "schema" in rf else ConstraintSpec("json_object", "")
    if kind == "json_schema" and not extra and "schema" not in rf:
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ConstraintError('response_format of type "json_schema" needs a "json_schema" object')
        bad = set(js) - {"name", "description", "schema", "strict"}
        if bad:
            raise ConstraintError(f"response_format.json_schema: unknown field(s) {sorted(bad)}")
        if not isinstance(js.get("strict", True), bool):
            raise ConstraintError("response_format.json_schema.strict must be a boolean")
        # OpenAI: no schema means any JSON value, as in llama-server
        return _schema_spec(js.get("schema", {}), "response_format.json_schema.schema")
    if kind not in ("text", "json_object", "json_schema"):
        raise ConstraintError(f'response_format type {kind!r}: expected "text", "json_object" or "json_schema"')
    raise ConstraintError(f"response_format of type {kind!r}: unexpected field(s) {sorted(set(rf) - {'type'})}")


def _schema_spec(schema: Any, where: str) -> ConstraintSpec:
    if isinstance(schema, str):  # already JSON text
        return ConstraintSpec("json_schema", schema)
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{where} must be a JSON schema object")
    return ConstraintSpec("json_schema", json.dumps(schema))
