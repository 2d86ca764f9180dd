"""Tokenizer: llama.cpp's vocabulary, SPM and BPE tokenizers (src/llama-vocab.cpp) and the
pre-tokenizer splitting they rely on (src/unicode.cpp, src/unicode-data.cpp).

The aim is token-for-token identity with llama.cpp, including its quirks:

* Pre-tokenizer regexes are *not* run as Unicode regexes. llama.cpp replaces every codepoint by a
  one-byte stand-in for its category ("collapsed" text: ASCII kept, non-ASCII whitespace -> 0x0B,
  \\p{N} -> 0xD1, \\p{L} -> 0xD2, \\p{P} -> 0xD3, \\p{M} -> 0xD4, \\p{S} -> 0xD5, anything else ->
  0xD0) and runs std::regex over that, or, for the GPT-2 and Llama-3 patterns, a hand-written
  matcher. We build the same collapsed string (one character per codepoint, so offsets agree)
  and run Python's `re` (ASCII mode, where `\\s` is C's isspace) over it; the two hand-written
  matchers are expressed as equivalent regexes over the same alphabet.
* Codepoint categories follow llama.cpp's table (Unicode 15.1), not the running Python's
  unicodedata version: a small generated override table pins the differences.
* Special tokens are split out first (tokenizer_st_partition), SPM prefixes a space after every
  special token, BPE falls back to single-byte tokens and silently drops what it cannot encode.

Speed: SPM text is cut before every "▁" that follows a non-"▁" (when no token of the vocabulary
spans such a boundary, which we check once), and BPE works word by word; both cache per piece.
"""

from __future__ import annotations

import bisect
import codecs
import heapq
import itertools
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..types import LlamapyError, UnsupportedError

__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "TokenizerError",
    "ATTR_UNDEFINED",
    "ATTR_UNKNOWN",
    "ATTR_UNUSED",
    "ATTR_NORMAL",
    "ATTR_CONTROL",
    "ATTR_USER_DEFINED",
    "ATTR_BYTE",
    "ATTR_LSTRIP",
    "ATTR_RSTRIP",
]


class TokenizerError(LlamapyError):
    """A vocabulary llama.cpp would refuse to load, or a token id outside the vocabulary."""


# llama_token_attr bits (llama.h)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

# GGUF token_type (llama_token_type) -> attribute; anything else is UNDEFINED, as in llama.cpp.
_TYPE_TO_ATTR = np.array(
    [ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED, ATTR_BYTE],
    dtype=np.int64,
)

_SPACE_ESC = "\u2581"  # SentencePiece's escaped space "▁"
_SPM_INNER_SPACE = re.compile(f"[^{_SPACE_ESC}]{_SPACE_ESC}")  # a "▁" after another character
_SPM_CUT = re.compile(f"(?<=[^{_SPACE_ESC}])(?={_SPACE_ESC})")
_C_SPACE = " \t\n\v\f\r"  # what C's isspace() accepts (lstrip/rstrip of special tokens)

# --------------------------------------------------------------------------------------------
# Unicode categories as llama.cpp sees them (unicode-data.cpp: Unicode 15.1, Cn -> UNDEFINED)
# --------------------------------------------------------------------------------------------

_F_UNDEFINED, _F_NUMBER, _F_LETTER, _F_SEPARATOR = 0x01, 0x02, 0x04, 0x08
_F_ACCENT, _F_PUNCT, _F_SYMBOL, _F_CONTROL = 0x10, 0x20, 0x40, 0x80
_MAJOR_TO_FLAG = {
    "N": _F_NUMBER, "L": _F_LETTER, "Z": _F_SEPARATOR, "M": _F_ACCENT,
    "P": _F_PUNCT, "S": _F_SYMBOL, "C": _F_CONTROL,
}

# Codepoints whose Unicode-15.1 category flag differs from what Python 3.10-3.12's unicodedata
# (Unicode 13.0-15.0) or a newer Unicode (16.0, 17.0) says: "start[-end]:flag", hex. Generated
# from CPython 3.13's unicodedata (15.1.0) with the category -> flag rule above, so that the
# running interpreter's Unicode version cannot change how text is split.
_UNICODE_15_1_OVERRIDES = """
61d:20 870-887:4 888:40 889-88e:4 88f:1 890-891:80 897:1 898-89f:10 8b5:4 8c8-8c9:4
8ca-8d2:10 c3c:10 c5c:1 c5d:4 cdc:1 cdd:4 cf3:10 ece:10 170d:4 1715:10 171f:4 180f:10
1ac1-1ace:10 1acf-1add:1 1ae0-1aeb:1 1b4c:4 1b4e-1b4f:1 1b7d-1b7e:20 1b7f:1 1c89-1c8a:1
1dfa:10 20c0:40 20c1:1 2427-2429:1 2b96:1 2c2f:4 2c5f:4 2e53-2e5d:20 2ffc-2fff:40
31e4-31e5:1 31ef:40 9ffd-9fff:4 a7c0-a7c1:4 a7cb-a7cf:1 a7d0-a7d1:4 a7d2:1 a7d3:4 a7d4:1
a7d5-a7d9:4 a7da-a7dc:1 a7f1:1 a7f2-a7f4:4 fbc2:40 fbc3-fbd2:1 fd40-fd4f:40 fd90-fd91:1
fdc8-fdce:1 fdcf:40 fdfe-fdff:40 10570-1057a:4 1057c-1058a:4 1058c-10592:4 10594-10595:4
10597-105a1:4 105a3-105b1:4 105b3-105b9:4 105bb-105bc:4 105c0-105f3:1 10780-10785:4
10787-107b0:4 107b2-107ba:4 10940-10959:1 10d40-10d65:1 10d69-10d85:1 10d8e-10d8f:1
10ec2-10ec7:1 10ed0-10ed8:1 10efa-10efc:1 10efd-10eff:10 10f70-10f81:4 10f82-10f85:10
10f86-10f89:20 11070:10 11071-11072:4 11073-11074:10 11075:4 110c2:10 1123f-11240:4 11241:10
11380-11389:1 1138b:1 1138e:1 11390-113b5:1 113b7-113c0:1 113c2:1 113c5:1 113c7-113ca:1
113cc-113d5:1 113d7-113d8:1 113e1-113e2:1 116b9:20 116d0-116e3:1 11740-11746:4 11ab0-11abf:4
11b00-11b09:20 11b60-11b67:1 11bc0-11be1:1 11bf0-11bf9:1 11db0-11ddb:1 11de0-11de9:1
11f00-11f01:10 11f02:4 11f03:10 11f04-11f10:4 11f12-11f33:4 11f34-11f3a:10 11f3e-11f42:10
11f43-11f4f:20 11f50-11f59:2 11f5a:1 12f90-12ff0:4 12ff1-12ff2:20 1342f:4 13439-1343f:80
13440:10 13441-13446:4 13447-13455:10 13460-143fa:1 16100-16139:1 16a70-16abe:4
16ac0-16ac9:2 16d40-16d79:1 16ea0-16eb8:1 16ebb-16ed3:1 16ff2-16ff6:1 187f8-187ff:1 18cff:1
18d09-18d1e:1 18d80-18df2:1 1aff0-1aff3:4 1aff5-1affb:4 1affd-1affe:4 1b11f-1b122:4 1b132:4
1b155:4 1cc00-1ccfc:1 1cd00-1ceb3:1 1ceba-1ced0:1 1cee0-1cef0:1 1cf00-1cf2d:10
1cf30-1cf46:10 1cf50-1cfc3:40 1d1e9-1d1ea:40 1d2c0-1d2d3:2 1df00-1df1e:4 1df25-1df2a:4
1e030-1e06d:4 1e08f:10 1e290-1e2ad:4 1e2ae:10 1e4d0-1e4eb:4 1e4ec-1e4ef:10 1e4f0-1e4f9:2
1e5d0-1e5fa:1 1e5ff:1 1e6c0-1e6de:1 1e6e0-1e6f5:1 1e6fe-1e6ff:1 1e7e0-1e7e6:4 1e7e8-1e7eb:4
1e7ed-1e7ee:4 1e7f0-1e7fe:4 1f6d8:1 1f6dc-1f6df:40 1f774-1f776:40 1f777-1f77a:1
1f77b-1f77f:40 1f7d9:40 1f7f0:40 1f8b2-1f8bb:1 1f8c0-1f8c1:1 1f8d0-1f8d8:1 1f979:40 1f9cc:40
1fa54-1fa57:1 1fa75-1fa77:40 1fa7b-1fa7c:40 1fa87-1fa88:40 1fa89-1fa8a:1 1fa8e-1fa8f:1
1faa9-1faaf:40 1fab7-1fabd:40 1fabe:1 1fabf:40 1fac3-1fac5:40 1fac6:1 1fac8:1 1facd:1
1face-1facf:40 1fad7-1fadb:40 1fadc:1 1fadf:1 1fae0-1fae8:40 1fae9-1faea:1 1faef:1
1faf0-1faf8:40 1fbcb-1fbef:1 1fbfa:1 2a6de-2a6df:4 2b735-2b739:4 2b73a-2b73f:1 2cea2-2cead:1
2ebf0-2ee5d:4 31350-323af:4 323b0-33479:1
"""


def _parse_overrides(spec: str) -> tuple[list[int], list[int], list[int]]:
    starts: list[int] = []
    ends: list[int] = []
    flags: list[int] = []
    for item in spec.split():
        rng, flag = item.split(":")
        lo, _, hi = rng.partition("-")
        starts.append(int(lo, 16))
        ends.append(int(hi or lo, 16))
        flags.append(int(flag, 16))
    return starts, ends, flags


_OV_START, _OV_END, _OV_FLAG = _parse_overrides(_UNICODE_15_1_OVERRIDES)

# The White_Space property (what llama.cpp's generator takes for `\s`); stable across versions.
_WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
     0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)


def cpt_category_flag(cp: int) -> int:
    """llama.cpp's unicode_cpt_flags category bit for a codepoint (UNDEFINED for unassigned)."""
    i = bisect.bisect_right(_OV_START, cp) - 1
    if i >= 0 and cp <= _OV_END[i]:
        return _OV_FLAG[i]
    cat = unicodedata.category(chr(cp))
    return _F_UNDEFINED if cat == "Cn" else _MAJOR_TO_FLAG[cat[0]]


_COLLAPSED_CHAR = {
    _F_NUMBER: "\xd1", _F_LETTER: "\xd2", _F_PUNCT: "\xd3", _F_ACCENT: "\xd4", _F_SYMBOL: "\xd5",
}


class _CollapseTable(dict):  # type: ignore[type-arg]
    """str.translate table codepoint -> collapsed stand-in, filled on first sight of a codepoint."""

    def __missing__(self, cp: int) -> str:
        if cp < 128:
            ch = chr(cp)
        elif cp in _WHITESPACE:
            # std::regex's \s knows no non-ASCII whitespace; llama.cpp uses vertical tab instead
            ch = "\x0b"
        else:
            ch = _COLLAPSED_CHAR.get(cpt_category_flag(cp), "\xd0")
        self[cp] = ch
        return ch


_COLLAPSE = _CollapseTable()
# For regexes without \p{..} llama.cpp matches real codepoints, only non-ASCII whitespace -> 0x0B
_WIDE = {cp: "\x0b" for cp in _WHITESPACE if cp >= 128}


def _collapse(text: str) -> str:
    return text if text.isascii() else text.translate(_COLLAPSE)


# --------------------------------------------------------------------------------------------
# Pre-tokenizer regexes
# --------------------------------------------------------------------------------------------

# The pattern strings exactly as llama-vocab.cpp spells them; unicode.cpp recognises these two
# by string equality and runs its hand-written matchers instead of std::regex.
_RX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RX_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_LLAMA3_ORIG = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# deepseek's split steps (llama-vocab.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_*): letter and CJK
# ranges spelled out as codepoints. `\s+$` is written `\s+\Z` here: std::regex's `$` matches only
# at the end of the piece, Python's also before a final newline.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
    "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_RXS = (
    "[\r\n]",
    f"\\s?[{_DEEPSEEK_LETTERS}]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+\Z",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER_RXS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_DEEPSEEK_V3_RXS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^"""
    "\r\n"
    r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+["
    "\r\n"
    r"]*|\s*["
    "\r\n"
    r"]+|\s+(?!\S)|\s+",
)
_RX_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]"
    r"|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]"
    r"|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Character classes of the collapsed alphabet as llama.cpp's flags see them (the hand-written
# matchers use flags, not std::regex): whitespace, letters, numbers; everything else is "other".
_CW = r"\t\n\x0b\x0c\r "
_CL = r"A-Za-z\xd2"
_CN = r"0-9\xd1"
# unicode_regex_split_custom_gpt2: every in-range codepoint has non-zero flags in llama.cpp's
# table, so its "no match" branch is unreachable and the regex below is an exact transcription.
_CUSTOM_GPT2 = re.compile(
    rf"'[stmd]|'(?:re|ve|ll)| ?[{_CL}]+| ?[{_CN}]+| ?[^{_CW}{_CL}{_CN}]+|[{_CW}]+(?![^{_CW}])|[{_CW}]+"
)
# unicode_regex_split_custom_llama3 (case-insensitive contractions, digits in threes, newlines
# glued to the preceding whitespace run up to its last \r or \n).
_CUSTOM_LLAMA3 = re.compile(
    rf"'[sStTmMdD]|'(?:[rR][eE]|[vV][eE]|[lL][lL])|[^\r\n{_CL}{_CN}]?[{_CL}]+|[{_CN}]{{1,3}}"
    rf"| ?[^{_CW}{_CL}{_CN}]+[\r\n]*|[{_CW}]*[\r\n]+|[{_CW}]+(?![^{_CW}])|[{_CW}]+"
)

# \p{..} -> collapsed stand-in plus the ASCII members of the category (unicode.cpp's k_ucat_*)
_UCAT: dict[str, str] = {
    r"\p{N}": "\xd1" + "0-9",
    r"\p{L}": "\xd2" + "A-Za-z",
    r"\p{P}": "\xd3" + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    r"\p{M}": "\xd4",
    r"\p{S}": "\xd5" + r"\$\+<->\^`\|",
    r"\p{Lu}": "\xd2" + "A-Za-z",
    r"\p{Ll}": "\xd2" + "A-Za-z",
    r"\p{Lt}": "\xd2" + "A-Za-z",
    r"\p{Lm}": "\xd2" + "A-Za-z",
    r"\p{Lo}": "\xd2" + "A-Za-z",
}


def _collapse_regex(expr: str) -> str:
    """Rewrite \\p{..} classes for the collapsed text, tracking [...] like unicode.cpp does."""
    if not expr.isascii():
        raise UnsupportedError("pre-tokenizer regex mixes unicode categories and non-ASCII text")
    out: list[str] = []
    inside = False
    i = 0
    n = len(expr)
    while i < n:
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and c == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if c == "\\" and i + 3 < n and expr[i + 1] == "p" and expr[i + 2] == "{":
            close = expr.find("}", i + 3)
            if close != -1 and close <= i + 10:
                body = _UCAT.get(expr[i : close + 1])
                if body is not None:
                    out.append(body if inside else f"[{body}]")
                    i = close + 1
                    continue
        out.append(c)
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class _Step:
    """One regex of a pre-tokenizer: the compiled matcher and which text it runs over."""

    pattern: re.Pattern[str]
    collapsed: bool  # True: collapsed text; False: codepoints with non-ASCII whitespace -> 0x0B


def _compile_step(expr: str) -> _Step:
    if expr == _RX_GPT2:
        return _Step(_CUSTOM_GPT2, True)
    if expr in (_RX_LLAMA3, _RX_LLAMA3_ORIG):
        return _Step(_CUSTOM_LLAMA3, True)
    if any(k in expr for k in _UCAT):
        return _Step(re.compile(_collapse_regex(expr), re.ASCII), True)
    return _Step(re.compile(expr, re.ASCII), False)


@dataclass(frozen=True)
class PreTokenizer:
    """A `tokenizer.ggml.pre` value: its regexes and the flags llama.cpp's loader sets with it."""

    name: str
    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False


_DEFAULT_RXS = (r"[\p{P}\$\+<=>\^~\|]+", _RX_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_SMOLLM_RXS = (r"\p{N}", _RX_GPT2)
_FALCON_RXS = (r"[\p{P}\$\+<=>\^~\|`]+", _RX_GPT2, r"[0-9][0-9][0-9]")


def _pre_table() -> dict[str, PreTokenizer]:
    t: dict[str, PreTokenizer] = {}

    def add(names: str, rxs: tuple[str, ...], **kw: bool) -> None:
        for name in names.split():
            t[name] = PreTokenizer(name, rxs, **kw)

    add("default", _DEFAULT_RXS)
    add("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", (_RX_LLAMA3,),
        ignore_merges=True, add_bos=True)
    add("dbrx smaug-bpe", (_RX_LLAMA3,))
    add("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "exaone4 mpt olmo jais", (_RX_GPT2,))
    add("starcoder refact codeshell exaone minerva-7b mellum2", _SMOLLM_RXS)
    add("smollm command-r", _SMOLLM_RXS, clean_spaces=False)
    add("qwen2 deepseek-r1-qwen kormo f2llmv2", (_RX_QWEN2,), clean_spaces=False)
    add("megrez stablelm2", (_RX_QWEN2,))
    add("falcon", _FALCON_RXS)
    add("deepseek-llm", _DEEPSEEK_LLM_RXS, clean_spaces=False)
    add("deepseek-coder", _DEEPSEEK_CODER_RXS, clean_spaces=False)
    add("deepseek-v3 hunyuan-dense hy_v4 joyai-llm", _DEEPSEEK_V3_RXS, clean_spaces=False)
    add("qwen35", (_RX_QWEN35,), clean_spaces=False)
    add("gpt-4o llama4 kanana2 talkie minimax-m2", (_RX_GPT4O,), clean_spaces=False)
    return t


PRE_TOKENIZERS: dict[str, PreTokenizer] = _pre_table()


class _Splitter:
    """unicode_regex_split: apply each regex in turn inside the pieces the previous one left."""

    def __init__(self, exprs: Iterable[str]) -> None:
        self.steps = [_compile_step(e) for e in exprs]

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        collapsed: str | None = None
        wide: str | None = None
        spans = [(0, len(text))]
        for step in self.steps:
            if step.collapsed:
                if collapsed is None:
                    collapsed = _collapse(text)
                subject = collapsed
            else:
                if wide is None:
                    wide = text if text.isascii() else text.translate(_WIDE)
                subject = wide
            finditer = step.pattern.finditer
            out: list[tuple[int, int]] = []
            for s, e in spans:
                pos = s
                # endpos hides the rest of the text: lookaheads stop at the piece's end, as
                # llama.cpp's per-offset matching does
                for m in finditer(subject, s, e):
                    a, b = m.span()
                    if a > pos:
                        out.append((pos, a))
                    if b > a:
                        out.append((a, b))
                    pos = b
                if pos < e:
                    out.append((pos, e))
            spans = out
        return [text[s:e] for s, e in spans]


# --------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode mapping (unicode_byte_to_utf8_map)
# --------------------------------------------------------------------------------------------


def _byte_chars() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, int] = {b: b for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


_BYTE_TO_CHAR = _byte_chars()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
_BYTE_ENCODE_TABLE = str.maketrans({chr(b): c for b, c in enumerate(_BYTE_TO_CHAR)})


def _byte_encode(word: str) -> str:
    """The UTF-8 bytes of `word`, each as its GPT-2 byte-level character."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


def _per_byte_replacement(err: UnicodeError) -> tuple[str, int]:
    # unicode_cpts_from_utf8 turns every byte of an invalid sequence into its own U+FFFD
    assert isinstance(err, UnicodeDecodeError)
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error("llamapy.fffd_per_byte", _per_byte_replacement)


def _as_text(text: str | bytes) -> str:
    """Input as str; invalid UTF-8 (bytes, or surrogate escapes) kept as lone surrogates."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text).decode("utf-8", errors="surrogateescape")
    return text


def _has_surrogates(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _bytes_of(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------

_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                  "▁<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                  "▁<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                  "▁<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
# llama.cpp's end-of-generation texts (llama_vocab::impl::load)
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)

_KEY = "tokenizer.ggml."
# (field, key) in llama.cpp's order; the deprecated prefix/suffix/middle keys come last and win
_SPECIAL_KEYS = (
    ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
    ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
    ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
    ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
    ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
    ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"),
)

_CACHE_LIMIT = 1 << 17  # pieces cached per tokenizer before the cache is dropped and refilled


@dataclass
class _LazyMerges:
    """The merges of a BPE vocabulary, decoded from the GGUF when the first text is encoded:
    ~49k-280k strings that loading a model for generation from token ids never needs."""

    def __init__(self, md: Mapping[str, Any]) -> None:
        self._md = md

    def load(self) -> list[str]:
        merges = self._md[_KEY + "merges"]
        if not isinstance(merges, list):
            raise TokenizerError("invalid type for tokenizer.ggml.merges")
        return merges

    def __bool__(self) -> bool:
        return True


class SpecialTokens:
    """Special token ids as llama.cpp resolves them (None = LLAMA_TOKEN_NULL)."""

    bos: int | None = None
    eos: int | None = None
    eot: int | None = None
    eom: int | None = None
    unk: int | None = None
    sep: int | None = None
    pad: int | None = None
    mask: int | None = None
    fim_pre: int | None = None
    fim_suf: int | None = None
    fim_mid: int | None = None
    fim_pad: int | None = None
    fim_rep: int | None = None
    fim_sep: int | None = None


class Tokenizer:
    """A GGUF vocabulary with llama.cpp's tokenize / token_to_piece / detokenize."""

    def __init__(
        self,
        *,
        kind: str,
        tokens: list[str],
        token_types: np.ndarray | None,
        scores: np.ndarray | None,
        merges: list[str] | None,
        pre: PreTokenizer | None,
        special: SpecialTokens,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        remove_extra_whitespaces: bool,
        clean_spaces: bool,
        model_name: str = "",
    ) -> None:
        self.kind = kind  # "spm" or "bpe"
        self.pre = pre
        self.special = special
        self._add_bos = add_bos
        self._add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.remove_extra_whitespaces = remove_extra_whitespaces  # read, unused by SPM/BPE (as in llama.cpp)
        self.clean_spaces = clean_spaces
        self.ignore_merges = pre.ignore_merges if pre is not None else False

        n = len(tokens)
        # the caller's list itself unless a token must be renamed (a copy is 8 bytes a token)
        texts = list(tokens) if not isinstance(tokens, list) or not all(tokens) else tokens
        for i, t in enumerate(texts):
            if not t:
                texts[i] = f"[EMPTY_{i}]"  # llama.cpp renames empty tokens
        tok2id = dict(zip(texts, range(n)))
        if len(tok2id) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(texts):
                if t in seen:
                    raise TokenizerError(f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")
                seen[t] = i
        self._texts = texts
        self._tok2id = tok2id

        if token_types is not None:
            tt = np.asarray(token_types, dtype=np.int64)[:n]
            attrs_np = np.where((tt >= 0) & (tt < len(_TYPE_TO_ATTR)), _TYPE_TO_ATTR[np.clip(tt, 0, 6)], 0)
        else:
            attrs_np = np.full(n, ATTR_NORMAL, dtype=np.int64)
        self._attrs: list[int] = attrs_np.tolist()
        # float32 scores as Python floats (exact), 0.0 where the file has none
        self._scores: list[float] = (
            np.asarray(scores, dtype=np.float32)[:n].astype(np.float64).tolist()
            if scores is not None
            else [0.0] * n
        )
        self._merges = merges
        self._ranks_cache: dict[str, int] | None = None
        self._splitter = _Splitter(pre.regexes) if pre is not None else None

        self._finish_special(model_name)

        self._pieces: list[bytes | None] = [None] * n
        self.constraints: Any = None  # model/constrain.py's compiled grammars for this vocabulary
        self._word_cache: dict[str, tuple[int, ...]] = {}
        # SPM: may text be cut before every "▁" that follows another character? Only if no
        # token contains such a pair, so that no merge can ever cross the cut.
        self._spm_cuttable = kind == "spm" and not any(
            _SPACE_ESC in t[1:] and _SPM_INNER_SPACE.search(t) for t in texts
        )

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`GGUFFile(path).metadata`), defaults as llama.cpp's loader."""
        model = md.get(_KEY + "model")
        if model is None:
            raise TokenizerError("missing key 'tokenizer.ggml.model'")
        pre_name = md.get(_KEY + "pre")
        sp = SpecialTokens()
        add_bos = add_eos = False
        add_space_prefix = False
        clean_spaces = False
        pre: PreTokenizer | None = None
        merges: list[str] | None = None
        if model == "llama":
            kind = "spm"
            sp.bos, sp.eos, sp.unk = 1, 2, 0
            add_space_prefix, add_bos = True, True
        elif model == "gpt2":
            kind = "bpe"
            if _KEY + "merges" not in md:
                raise TokenizerError("cannot find tokenizer merges in model file")
            type_name = getattr(md, "type_name", None)
            if type_name is not None:
                # llamapy's lazy reader: check the type now, decode the strings on first encode
                if not type_name(_KEY + "merges").startswith("array[string"):
                    raise TokenizerError("invalid type for tokenizer.ggml.merges")
                merges = _LazyMerges(md)  # type: ignore[assignment]
            else:
                merges = md.get(_KEY + "merges")
                if not isinstance(merges, list):
                    raise TokenizerError("invalid type for tokenizer.ggml.merges")
            sp.bos, sp.eos = 11, 11
            if not pre_name:
                pre_name = "default"  # llama.cpp warns and uses 'default'
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise UnsupportedError(f"unknown pre-tokenizer {pre_name!r}")
            clean_spaces = pre.clean_spaces
            add_bos = pre.add_bos
        else:
            raise UnsupportedError(f"unknown tokenizer model {model!r} (llamapy reads 'llama' and 'gpt2')")

        add_space_prefix = bool(md.get(_KEY + "add_space_prefix", add_space_prefix))
        remove_extra_ws = bool(md.get(_KEY + "remove_extra_whitespaces", False))

        tokens = md.get(_KEY + "tokens")
        if tokens is None:
            raise TokenizerError("cannot find tokenizer vocab in model file")
        if not isinstance(tokens, list):
            raise TokenizerError("invalid type for tokenizer.ggml.tokens")
        n = len(tokens)
        scores = md.get(_KEY + "scores")
        if scores is not None and len(scores) < n:
            raise TokenizerError(f"Index out of array bounds for scores ({len(scores)} < {n})")
        types = md.get(_KEY + "token_type")
        if types is not None and len(types) < n:
            raise TokenizerError(f"Index out of array bounds for toktypes ({len(types)} < {n})")

        for name, key in _SPECIAL_KEYS:
            cur = getattr(sp, name)
            if cur is not None and cur >= n:
                cur = None  # "default special token out of vocab range, disabling"
            val = md.get(_KEY + key)
            if val is not None:
                try:
                    iv = int(val)
                except (TypeError, ValueError):
                    iv = -1
                if 0 <= iv < n:
                    cur = iv
            setattr(sp, name, cur)

        if _KEY + "add_bos_token" in md:
            add_bos = bool(md[_KEY + "add_bos_token"])
        if _KEY + "add_eos_token" in md:
            add_eos = bool(md[_KEY + "add_eos_token"])
        if add_bos and sp.bos is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if add_eos and sp.eos is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

        return cls(
            kind=kind, tokens=tokens, token_types=types, scores=scores, merges=merges, pre=pre,
            special=sp, add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
            remove_extra_whitespaces=remove_extra_ws, clean_spaces=clean_spaces,
            model_name=str(md.get("general.name", "") or ""),
        )

    @classmethod
    def from_file(cls, path: Any) -> Tokenizer:
        from .gguf import GGUFFile

        return cls.from_metadata(GGUFFile(path).metadata)

    def _find_first(self, texts: Iterable[str]) -> int | None:
        # llama.cpp takes the first match in unordered_map order; we take the lowest id
        ids = [self._tok2id[t] for t in texts if t in self._tok2id]
        return min(ids) if ids else None

    def _force_control(self, tid: int) -> None:
        # "control-looking token ... was not control-type; its type will be overridden"
        self._attrs[tid] |= ATTR_CONTROL

    def _finish_special(self, model_name: str) -> None:
        sp = self.special
        attrs = self._attrs
        tok2id = self._tok2id
        for name, texts in (
            ("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), ("fim_pre", _FIM_PRE_TEXTS),
            ("fim_suf", _FIM_SUF_TEXTS), ("fim_mid", _FIM_MID_TEXTS), ("fim_pad", _FIM_PAD_TEXTS),
            ("fim_rep", _FIM_REP_TEXTS), ("fim_sep", _FIM_SEP_TEXTS),
        ):
            if getattr(sp, name) is None:
                found = self._find_first(texts)
                if found is not None:
                    setattr(sp, name, found)
                    # llama.cpp marks every candidate it meets while the id is unset: only one
                    self._force_control(found)

        # auto-detect unused tokens: control tokens with "unused" in their text
        for tid in np.flatnonzero(np.asarray(attrs) & ATTR_CONTROL).tolist():
            if "unused" in self._texts[tid]:
                attrs[tid] |= ATTR_UNUSED

        eog: set[int] = set()
        for tid in (sp.fim_pad, sp.fim_rep, sp.fim_sep):
            if tid is not None:
                eog.add(tid)
        for t in _EOG_TEXTS:
            tid = tok2id.get(t)
            if tid is not None:
                eog.add(tid)
                self._force_control(tid)
        # gpt-oss: these are always rendered
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            tid = tok2id.get(t)
            if tid is not None:
                attrs[tid] = ATTR_USER_DEFINED
        for tid in (sp.eos, sp.eot, sp.eom):
            if tid is not None:
                eog.add(tid)
        # o200k_harmony / solar-open: "<|end|>" is not end-of-generation there
        texts_in = {self._texts[t]: t for t in eog if 0 <= t < len(self._texts)}
        has_call = "<|call|>" in texts_in or "<|calls|>" in texts_in
        if "<|end|>" in texts_in and (("<|return|>" in texts_in and has_call) or (has_call and "<|flush|>" in texts_in)):
            end_id = texts_in["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = ATTR_USER_DEFINED
        # gemma4 / paddleocr: "</s>" is not end-of-generation when "<|tool_response>" is
        if "<|tool_response>" in texts_in and "</s>" in texts_in:
            s_id = texts_in["</s>"]
            eog.discard(s_id)
            attrs[s_id] = ATTR_NORMAL
        self._eog = frozenset(eog)

        # special tokens cache: longest text first (std::sort is not stable; ties by id here)
        mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        ids = np.flatnonzero(np.asarray(attrs) & mask).tolist()
        ids.sort(key=lambda i: (-len(_bytes_of(self._texts[i])), i))
        self._special_cache: list[int] = ids

        # per-model attributes llama.cpp sets by name
        name = model_name.lower()
        if "phi-3" in name or "phi3" in name:
            for tid in ids:
                attrs[tid] |= ATTR_RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                tid = tok2id.get(t)
                if tid is not None:
                    attrs[tid] = attrs[tid] | ATTR_RSTRIP if on else attrs[tid] & ~ATTR_RSTRIP
        elif "modern-bert" in name:
            tid = tok2id.get("[MASK]")
            if tid is not None:
                attrs[tid] |= ATTR_LSTRIP

    # -- properties ------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self._texts)

    @property
    def bos(self) -> int | None:
        return self.special.bos

    @property
    def eos(self) -> int | None:
        return self.special.eos

    @property
    def eot(self) -> int | None:
        return self.special.eot

    @property
    def eom(self) -> int | None:
        return self.special.eom

    @property
    def unk(self) -> int | None:
        return self.special.unk

    @property
    def pad(self) -> int | None:
        return self.special.pad

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def _check(self, token: int) -> None:
        if not 0 <= token < len(self._texts):
            raise TokenizerError(f"token id {token} is outside the vocabulary (0..{len(self._texts) - 1})")

    def token_attr(self, token: int) -> int:
        self._check(token)
        return self._attrs[token]

    def is_control(self, token: int) -> bool:
        return bool(self.token_attr(token) & ATTR_CONTROL)

    def token_text(self, token: int) -> str:
        """The token's text as stored in the vocabulary (SPM "▁", GPT-2 byte characters)."""
        self._check(token)
        return self._texts[token]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary text is exactly `text` (llama_vocab::text_to_token)."""
        return self._tok2id.get(text)

    # -- tokenize --------------------------------------------------------------------------

    def encode(self, text: str | bytes, add_special: bool = True, parse_special: bool = False,
               space_prefix: bool = True) -> list[int]:
        """llama_tokenize: BOS/EOS per the vocabulary when `add_special`; control tokens written
        in the text become tokens only when `parse_special` (user-defined ones always do).
        `space_prefix=False`: a text that continues one already begun (a grammar's forced text)
        takes no SPM leading space, whatever the vocabulary's add_space_prefix says."""
        text = _as_text(text)
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if self.kind == "spm":
            is_prev_special = True  # a leading space goes in front of the first text, too
            if add_special and self._add_bos:
                out.append(self.special.bos)  # type: ignore[arg-type]
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    is_prev_special = True
                    continue
                piece = text[f[0] : f[1]]
                if self.add_space_prefix and is_prev_special and space_prefix:
                    piece = " " + piece
                self._spm_tokenize(piece.replace(" ", _SPACE_ESC), out)
                is_prev_special = False
        else:
            if add_special and self._add_bos:
                out.append(self.special.bos)  # type: ignore[arg-type]
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    self._bpe_tokenize(text[f[0] : f[1]], out)
        if add_special and self._add_eos:
            out.append(self.special.eos)  # type: ignore[arg-type]
        return out

    tokenize = encode

    def _partition(self, text: str, parse_special: bool) -> list[int | tuple[int, int]]:
        """tokenizer_st_partition: split special-token texts out of the raw text."""
        frags: list[int | tuple[int, int]] = [(0, len(text))]
        attrs = self._attrs
        for tid in self._special_cache:
            attr = attrs[tid]
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            st = self._texts[tid]
            if st not in text:
                continue
            ln = len(st)
            out: list[int | tuple[int, int]] = []
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                s, e = f
                while True:
                    m = text.find(st, s, e) if s < e else -1
                    if m < 0:
                        if s < e:
                            out.append((s, e))
                        break
                    le = m
                    if attr & ATTR_LSTRIP:
                        while le > s and text[le - 1] in _C_SPACE:
                            le -= 1
                    if le > s:
                        out.append((s, le))
                    out.append(tid)
                    rs = m + ln
                    if rs >= e:
                        break
                    if attr & ATTR_RSTRIP:
                        while rs < e and text[rs] in _C_SPACE:
                            rs += 1
                    s = rs
            frags = out
        return frags

    def _cache_put(self, key: str, ids: tuple[int, ...]) -> None:
        if len(self._word_cache) >= _CACHE_LIMIT:
            self._word_cache.clear()
        self._word_cache[key] = ids

    # SPM (llm_tokenizer_spm_session) ----------------------------------------------------------

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        chunks = _SPM_CUT.split(text) if self._spm_cuttable else [text]
        cache = self._word_cache
        for chunk in chunks:
            if not chunk:
                continue
            ids = cache.get(chunk)
            if ids is None:
                ids = self._spm_piece(chunk)
                self._cache_put(chunk, ids)
            out.extend(ids)

    def _spm_piece(self, text: str) -> tuple[int, ...]:
        tok2id = self._tok2id
        scores = self._scores
        syms = list(text)
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        get = tok2id.get
        push = heapq.heappush
        # queue entries: highest score first, then the leftmost pair (llm_bigram_spm::comparator)
        heap: list[tuple[float, int, int, int]] = []
        for i in range(1, n):
            tid = get(syms[i - 1] + syms[i])
            if tid is not None:
                heap.append((-scores[tid], i - 1, i, 2))
        heapq.heapify(heap)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a = syms[left]
            b = syms[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # one side was merged since this bigram was queued
            a += b
            syms[left] = a
            syms[right] = ""
            r2 = nxt[right]
            nxt[left] = r2
            p = prv[left]
            if p >= 0:
                t = syms[p] + a
                tid = get(t)
                if tid is not None:
                    push(heap, (-scores[tid], p, left, len(t)))
            if r2 >= 0:
                prv[r2] = left
                t = a + syms[r2]
                tid = get(t)
                if tid is not None:
                    push(heap, (-scores[tid], left, r2, len(t)))

        out: list[int] = []
        i = 0
        while i != -1:
            s = syms[i]
            tid = tok2id.get(s)
            if tid is not None:
                out.append(tid)
            else:
                # symbols that are no token come out as byte tokens
                out.extend(self._byte_token(b) for b in _bytes_of(s))
            i = nxt[i]
        return tuple(out)

    def _byte_token(self, b: int) -> int:
        """llama_vocab::byte_to_token for SPM: "<0xXX>", else the single-byte text."""
        tid = self._tok2id.get(f"<0x{b:02X}>")
        if tid is None:
            tid = self._tok2id.get(chr(b) if b < 0x80 else chr(0xDC00 + b))
        if tid is None:
            raise TokenizerError(f"vocabulary has no token for byte 0x{b:02X}")
        return tid

    # BPE (llm_tokenizer_bpe_session) ----------------------------------------------------------

    @property
    def _ranks(self) -> dict[str, int]:
        """Merge rank by "left right"; built on first use. Tokens never contain a space, so a
        merge string with its single space at the split point is its own key; for repeated
        merges the first rank wins (unordered_map::emplace)."""
        if self._ranks_cache is None:
            merges = self._merges or []
            if isinstance(merges, _LazyMerges):
                merges = merges.load()
            n = len(merges)
            # the ranks are the int objects tok2id already holds as ids (0..n_vocab-1, in
            # insertion order), not ~49k new ones (32 bytes each)
            ints = list(itertools.islice(self._tok2id.values(), n))
            ints += range(len(ints), n)
            self._ranks_cache = dict(zip(reversed(merges), reversed(ints)))
        return self._ranks_cache

    def _bpe_tokenize(self, text: str, out: list[int]) -> None:
        if _has_surrogates(text):
            text = _bytes_of(text).decode("utf-8", errors="llamapy.fffd_per_byte")
        cache = self._word_cache
        assert self._splitter is not None
        for word in self._splitter.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(_byte_encode(word))
                self._cache_put(word, ids)
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        tok2id = self._tok2id
        if self.ignore_merges:
            tid = tok2id.get(word)
            if tid is not None:
                return (tid,)
        syms = list(word)
        n = len(syms)
        if n > 1:
            ranks = self._ranks
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            prv = list(range(-1, n - 1))
            get = ranks.get
            push = heapq.heappush
            # queue entries: lowest rank first, then the leftmost pair (llm_bigram_bpe::comparator)
            heap: list[tuple[int, int, int, str]] = []
            for i in range(1, n):
                a = syms[i - 1]
                b = syms[i]
                r = get(a + " " + b)
                if r is not None:
                    heap.append((r, i - 1, i, a + b))
            heapq.heapify(heap)
            while heap:
                _, left, right, txt = heapq.heappop(heap)
                a = syms[left]
                b = syms[right]
                if not a or not b or a + b != txt:
                    continue  # outdated: one side changed since this bigram was queued
                syms[left] = txt
                syms[right] = ""
                r2 = nxt[right]
                nxt[left] = r2
                p = prv[left]
                if p >= 0:
                    a = syms[p]
                    r = get(a + " " + txt)
                    if r is not None:
                        push(heap, (r, p, left, a + txt))
                if r2 >= 0:
                    prv[r2] = left
                    b = syms[r2]
                    r = get(txt + " " + b)
                    if r is not None:
                        push(heap, (r, left, r2, txt + b))
        out: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = tok2id.get(s)
            if tid is not None:
                out.append(tid)
                continue
            # unknown symbol: try its UTF-8 bytes one by one, drop what has no token
            for b in s.encode("utf-8"):
                t2 = tok2id.get(chr(b) if b < 0x80 else chr(0xDC00 + b))
                if t2 is not None:
                    out.append(t2)
        return tuple(out)

    # -- detokenize ------------------------------------------------------------------------

    def _piece(self, token: int) -> bytes:
        """token_to_piece(special=true), cached (cache_token_to_piece)."""
        p = self._pieces[token]
        if p is not None:
            return p
        text = self._texts[token]
        attr = self._attrs[token]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            p = _bytes_of(text)
        elif attr & ATTR_NORMAL:
            if self.kind == "spm":
                p = _bytes_of(text.replace(_SPACE_ESC, " "))
            else:
                p = _byte_decode(text)
        elif attr & ATTR_BYTE:
            try:
                p = bytes([int(text[3:5], 16) & 0xFF])
            except ValueError:
                p = b"\x00"  # strtol of garbage is 0
        else:
            p = b""  # unused / undefined tokens render as nothing
        self._pieces[token] = p
        return p

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """llama_token_to_piece (lstrip 0): control and unknown tokens are empty unless `special`."""
        self._check(token)
        if not special and self._attrs[token] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        return self._piece(token)

    def detokenize(self, tokens: Iterable[int], special: bool = False, remove_special: bool = False) -> bytes:
        """llama_detokenize: pieces joined, the SPM prefix space removed from the first piece,
        and, for vocabularies with clean_spaces, the tokenizer's space clean-up."""
        ids = [int(t) for t in tokens]
        remove_space = self.add_space_prefix
        if remove_special and self._add_bos and ids and ids[0] == self.special.bos:
            remove_space = False
            ids = ids[1:]
        if remove_special and self._add_eos and ids and ids[-1] == self.special.eos:
            ids = ids[:-1]
        parts: list[bytes] = []
        for t in ids:
            p = self.token_to_piece(t, special)
            if remove_space and p[:1] == b" ":
                p = p[1:]
            remove_space = False
            parts.append(p)
        buf = b"".join(parts)
        if self.clean_spaces:
            buf = _clean_spaces(buf)
        return buf

    def decode(self, tokens: Iterable[int], special: bool = False, remove_special: bool = False) -> str:
        """detokenize() as text; bytes that are not UTF-8 become U+FFFD."""
        return self.detokenize(tokens, special, remove_special).decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, special)


def _byte_decode(text: str) -> bytes:
    """llama_decode_text: GPT-2 byte characters back to bytes."""
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
            continue
        if 0xD800 <= ord(ch) <= 0xDFFF:
            ch = "\ufffd"  # unicode_cpts_from_utf8 replaces invalid bytes
        out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + _bytes_of(text) + b"]"
    return bytes(out)


def _clean_spaces(src: bytes) -> bytes:
    """The three clean-up passes of llama_vocab::impl::detokenize, in place on the bytes."""
    t = bytearray(src)
    total = len(t)
    # pass 1: " ?", " !", " .", " ,"
    if any(p in t for p in (b" ?", b" !", b" .", b" ,")):
        n1 = total
        total = 1 if n1 else 0
        for i in range(1, n1):
            x = t[i]
            if t[i - 1] == 0x20 and x in b"?!.,":
                total -= 1
            t[total] = x
            total += 1
    if b" '" not in t[:total]:
        return bytes(t[:total])
    # pass 2: a single apostrophe between spaces
    n2 = total
    total = 1 if n2 else 0
    i = 1
    while i < n2:
        x = t[i]
        if x == 0x27 and i + 1 < n2 and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    # pass 3: " 's", " 'm", " 're", " 've"
    n3 = total
    total = 1 if n3 else 0
    for i in range(1, n3):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n3:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n3:
                x2 = t[i + 2]
                if (x1 == 0x72 and x2 == 0x65) or (x1 == 0x76 and x2 == 0x65):  # "re", "ve"
                    total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])


class StreamDecoder:
    """Token-at-a-time detokenization that only ever returns whole UTF-8 characters.

    A character split over several byte tokens is held back until it is complete; bytes that can
    never form a character come out as U+FFFD. Call flush() at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        return self._decoder.decode(self.tokenizer.token_to_piece(token, self.special))

    __call__ = push

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character becomes U+FFFD); resets."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

    @property
    def pending(self) -> bytes:
        """Bytes held back waiting for the rest of a character."""
        return self._decoder.getstate()[0]
