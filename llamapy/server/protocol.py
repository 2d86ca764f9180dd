"""OpenAI's and llama-server's request and response shapes, without any web framework
(llama.cpp's tools/server/server-common.cpp `oaicompat_*_params_parse`, server-task.cpp's
`to_json_oaicompat*`). The server and `Llama.create_completion` / `create_chat_completion` share it,
so both accept the same parameters and answer the same dicts.

Parameters llamapy cannot honour (`n > 1`, logit_bias, …) are rejected with an ApiError (HTTP 400),
never ignored; so is any parameter it does not know. Sampling parameters a request leaves out take
llama-server's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), not OpenAI's.

Structured output (model/constrain.py): `response_format` (json_object, json_schema), llama-server's
`grammar` (GBNF) and `json_schema`, one of them per request. Tools (model/toolcalls.py): `tools`,
`tool_choice` (auto, none, required, a named function) and `parallel_tool_calls`; a required or
named call is forced by a grammar; under `auto` the text is free until it opens a call, which is
then held to the tools (the generic format's JSON reply is a call or a response). `reasoning_effort`
and `chat_template_kwargs` are variables of the template's render. An invalid schema or grammar is a 400 naming the field
and, for schemas, the JSON pointer of the keyword llguidance refused.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine import Event, Request
from ..model import toolcalls as tc
from ..model.chat import render_chat, template_or_default
from ..model.constrain import ConstraintError, ConstraintSpec, compile_constraint, response_format_spec
from ..model.sampler import SamplingParams
from ..types import LlamapyError

MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 1000
MAX_TOP_LOGPROBS = 20
I64 = 2**63 - 1  # integers past this are refused (seeds, counts), never passed on


class ApiError(LlamapyError):
    """A request the server answers with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


# -- parameter checks --------------------------------------------------------------------------


def _num(body: dict, name: str, kind: type, lo: float | None = None, hi: float | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else (
        isinstance(v, int) and not isinstance(v, bool))  # fmt: skip
    if not ok:
        raise ApiError(f"'{name}' must be {'a number' if kind is float else 'an integer'}, got {type(v).__name__}", param=name)
    if kind is float:
        try:
            v = float(v)
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise ApiError(f"'{name}' must be a finite number", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise ApiError(f"'{name}' must be {rng}, got {v}", param=name)
    return kind(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' must be a boolean, got {type(v).__name__}", param=name)
    return v


def _stops(body: dict, name: str = "stop") -> tuple[str, ...]:
    v = body.get(name)
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(f"'{name}' must be a string or a list of strings", param=name)
    if len(items) > MAX_STOP:
        raise ApiError(f"'{name}': at most {MAX_STOP} stop strings, got {len(items)}", param=name)
    if any(len(s) > MAX_STOP_LEN for s in items):
        raise ApiError(f"'{name}': a stop string may have at most {MAX_STOP_LEN} characters", param=name)
    return tuple(s for s in items if s)


# What each endpoint accepts. Everything else is a 400: _UNSUPPORTED explains the well-known ones.
_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
             "frequency_penalty", "repeat_penalty", "repeat_last_n", "ignore_eos", "cache_prompt",
             "typical_p", "logit_bias", "top_n_sigma", "xtc_probability", "xtc_threshold", "mirostat",
             "mirostat_tau", "mirostat_eta"}  # fmt: skip
_STRUCTURED = {"response_format", "grammar", "json_schema"}
_OAI = _SAMPLING | _STRUCTURED | {"model", "stream", "stream_options", "n", "user", "max_tokens", "lora"}
COMPLETION_FIELDS = _OAI | {"prompt", "logprobs"}
CHAT_FIELDS = _OAI | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                      "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs"}  # fmt: skip
LLAMA_COMPLETION_FIELDS = _SAMPLING | _STRUCTURED | {"prompt", "n_predict", "stream", "n_probs", "lora"}
_UNSUPPORTED = {
    "functions": "the deprecated 'functions' is not supported: use 'tools'",
    "function_call": "the deprecated 'function_call' is not supported: use 'tool_choice'",
    "dimensions": "dimensions is not supported: an embedding has the model's size",
    "suffix": "suffix (insertion) is not supported",
    "echo": "echo is not supported",
    "best_of": "best_of is not supported",
    "audio": "audio is not supported",
    "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported",
    "id_slot": "choosing a slot is not supported",
}


def _check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for k in body:
        if k in allowed:
            continue
        why = _UNSUPPORTED.get(k)
        raise ApiError(f"unsupported parameter '{k}'" + (f": {why}" if why else ""), param=k)
    return body


def sampling_params(body: dict, tokenizer: Any) -> SamplingParams:
    p = SamplingParams()
    changes: dict[str, Any] = {}
    for name, field, kind, lo, hi in (
        ("temperature", "temp", float, 0.0, None),
        ("top_p", "top_p", float, 0.0, 1.0),
        ("top_k", "top_k", int, 0, I64),
        ("min_p", "min_p", float, 0.0, 1.0),
        ("seed", "seed", int, -1, 2**32 - 1),
        ("presence_penalty", "presence_penalty", float, -2.0, 2.0),
        ("frequency_penalty", "frequency_penalty", float, -2.0, 2.0),
        ("repeat_penalty", "repeat_penalty", float, 0.0, None),
        ("repeat_last_n", "repeat_last_n", int, -1, 1 << 20),
        ("typical_p", "typical_p", float, 0.0, None),
        ("top_n_sigma", "top_n_sigma", float, None, None),
        ("xtc_probability", "xtc_probability", float, 0.0, 1.0),
        ("xtc_threshold", "xtc_threshold", float, 0.0, 1.0),
        ("mirostat", "mirostat", int, 0, 2),
        ("mirostat_tau", "mirostat_tau", float, 0.0, None),
        ("mirostat_eta", "mirostat_eta", float, 0.0, None),
    ):
        v = _num(body, name, kind, lo, hi)
        if v is not None:
            changes[field] = v
    if _bool(body, "ignore_eos"):
        changes["ignore_eos"] = True
    if body.get("logit_bias") is not None:
        changes["logit_bias"] = logit_bias(body["logit_bias"], tokenizer)
    return replace(p, **changes)


def logit_bias(v: Any, tokenizer: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} or llama-server's forms: an object or [[token, bias], …], a
    token given as its id or as text (each of its tokens biased), a bias a number or false (the
    token banned). What llama-server skips (an id out of range, a bias of another type) is a 400."""
    pairs = list(v.items()) if isinstance(v, dict) else v
    if not isinstance(pairs, list):
        raise ApiError("'logit_bias' must be an object {token: bias} or an array of [token, bias]", param="logit_bias")
    out: list[tuple[int, float]] = []
    for el in pairs:
        if not isinstance(el, (list, tuple)) or len(el) != 2:
            raise ApiError("'logit_bias': each entry must be [token, bias]", param="logit_bias")
        key, bias = el
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise ApiError(f"'logit_bias': the bias of {key!r} must be a number or false", param="logit_bias")
        if isinstance(key, str) and re.fullmatch(r"-?\d+", key.strip()):
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < tokenizer.n_vocab:
                raise ApiError(f"'logit_bias': token id {key} out of range [0, {tokenizer.n_vocab})", param="logit_bias")
            out.append((key, float(bias)))
        elif isinstance(key, str):
            out += [(t, float(bias)) for t in tokenizer.encode(key, add_special=False, parse_special=False)]
        else:
            raise ApiError("'logit_bias': a token is an id or a text", param="logit_bias")
    return tuple(out)


@dataclass
class Parsed:
    """A request ready for the engine, and how to answer it."""

    request: Request
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    prompt_text: str = ""
    syntax: tc.Syntax = field(default_factory=tc.Syntax)  # how to read a chat reply
    lora: dict[int, float] | None = None  # "lora": adapter id -> scale (None: the server's scales)


# -- structured output and tools ---------------------------------------------------------------


def check_constraint(spec: ConstraintSpec | None, tokenizer: Any, where: str, param: str) -> None:
    """Compile now (cached on the tokenizer, so the engine's compile is free): an invalid grammar or
    schema is this request's 400, naming the field and, for a schema, the keyword's JSON pointer."""
    if spec is None:
        return
    try:
        compile_constraint(spec, tokenizer)
    except ConstraintError as e:  # (its message carries the JSON pointer: constrain._schema_where)
        raise ApiError(f"{where}: {e}", param=param) from None


def structured_spec(body: dict) -> tuple[ConstraintSpec | None, str, str]:
    """(spec, where, param) of `response_format`, `grammar` or `json_schema`: at most one."""
    given = [k for k in ("response_format", "grammar", "json_schema") if body.get(k) is not None]
    if len(given) > 1:
        raise ApiError(f"give only one of 'response_format', 'grammar' and 'json_schema', not {' and '.join(given)}", param=given[1])
    if not given:
        return None, "", ""
    k, v = given[0], body[given[0]]
    if k == "grammar":
        if not isinstance(v, str):
            raise ApiError("'grammar' must be a GBNF grammar (a string)", param=k)
        return ConstraintSpec("gbnf", v), "grammar", k
    if k == "json_schema":
        if not isinstance(v, (dict, bool)):
            raise ApiError("'json_schema' must be a JSON schema object", param=k)
        return ConstraintSpec("json_schema", json.dumps(v)), "json_schema", k
    try:
        spec = response_format_spec(v)
    except ConstraintError as e:
        raise ApiError(str(e), param=k) from None
    where = "response_format.json_schema.schema" if isinstance(v, dict) and v.get("type") == "json_schema" else "response_format"
    return spec, where, k


def _structured(body: dict, tokenizer: Any) -> ConstraintSpec | None:
    spec, where, param = structured_spec(body)
    check_constraint(spec, tokenizer, where, param)
    return spec


_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _tools(body: dict) -> list[tc.Tool]:
    v = body.get("tools")
    if v is None:
        return []
    if not isinstance(v, list):
        raise ApiError("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) or set(t) - {"type", "function"}:
            raise ApiError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}} (the only tool type)", param="tools")
        fn = t["function"]
        bad = set(fn) - {"name", "description", "parameters", "strict"}
        if bad:
            raise ApiError(f"tools[{i}].function: unknown field(s) {sorted(bad)}", param="tools")
        name, desc, params = fn.get("name"), fn.get("description", ""), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise ApiError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", param="tools")
        if not isinstance(desc, str) or not isinstance(params, dict) or not isinstance(fn.get("strict", True), bool):
            raise ApiError(f"tools[{i}].function: description must be a string, parameters a JSON schema object, strict a boolean", param="tools")
        if name in {x.name for x in out}:
            raise ApiError(f"tools[{i}].function.name {name!r} is given twice", param="tools")
        out.append(tc.Tool(name, desc, params))
    return out


# template variables a request may not set: the render's own, and what is checked elsewhere
_RESERVED_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
_EFFORTS = ("low", "medium", "high")


def template_kwargs(body: dict, source: str) -> dict[str, Any]:
    """llama-server's `chat_template_kwargs` (extra variables of the render) and OpenAI's
    `reasoning_effort` (gpt-oss's template variable of that name). A variable the template never
    names would be ignored, so it is refused; so are gpt-oss's `builtin_tools`, whose calls
    (to=browser.*, to=python) llamapy does not read back."""
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    kw = dict(kw or {})
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise ApiError(f"'reasoning_effort' must be one of {list(_EFFORTS)}, got {effort!r}", param="reasoning_effort")
        if kw.get("reasoning_effort", effort) != effort:
            raise ApiError("'reasoning_effort' disagrees with chat_template_kwargs.reasoning_effort", param="reasoning_effort")
        kw["reasoning_effort"] = effort
    for k in kw:
        param = "reasoning_effort" if k == "reasoning_effort" and effort is not None else "chat_template_kwargs"
        if k in _RESERVED_KWARGS or k == "builtin_tools":
            raise ApiError(f"chat_template_kwargs: '{k}' cannot be set here", param=param)
        if not re.search(rf"\b{re.escape(k)}\b", source):
            raise ApiError(f"'{k}': this model's chat template has no such variable", param=param)
    return kw


def _tool_choice(body: dict, tools: list[tc.Tool]) -> tuple[str, str | None]:
    """("auto" | "none" | "required", the named function or None); OpenAI's default is auto."""
    v = body.get("tool_choice")
    if v is None:
        return "auto", None
    if not tools:
        raise ApiError("'tool_choice' needs 'tools'", param="tool_choice")
    if v in ("auto", "none", "required"):
        return v, None
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")  # fmt: skip
    if fn["name"] not in {t.name for t in tools}:
        raise ApiError(f"'tool_choice' names {fn['name']!r}, which is not among the tools", param="tool_choice")
    return "required", fn["name"]


def _common(body: dict, prompt: list[int], max_tokens: int | None, logprobs: int | None, tokenizer: Any) -> Parsed:
    n = _num(body, "n", int, 1, I64)
    if n is not None and n != 1:
        raise ApiError(f"'n' = {n}: only one choice per request is supported (n = 1)", param="n")
    stream = _bool(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage"}:
            raise ApiError("'stream_options' supports only {\"include_usage\": bool}", param="stream_options")
        if not stream:
            raise ApiError("'stream_options' needs 'stream': true", param="stream_options")
        include_usage = _bool(so, "include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError("'user' must be a string", param="user")
    req = Request(
        prompt=prompt,
        max_tokens=-1 if max_tokens is None else max_tokens,
        sampling=sampling_params(body, tokenizer),
        stop=_stops(body),
        logprobs=logprobs,
        cache_prompt=_bool(body, "cache_prompt", True),
    )
    lora = lora_entries(body["lora"]) if "lora" in body else None
    return Parsed(req, stream, include_usage, model or "", lora=lora or None)  # [] as absent, as llama-server


def lora_entries(v: Any) -> dict[int, float]:
    """llama-server's LoRA list, [{"id": 0, "scale": 0.5}, …] (parse_lora_request)."""
    if not isinstance(v, list):
        raise ApiError("'lora' must be an array of objects with 'id' and 'scale' fields", param="lora")
    out: dict[int, float] = {}
    for e in v:
        ok = isinstance(e, dict) and not set(e) - {"id", "scale"} and isinstance(e.get("id"), int)
        scale = e.get("scale", 0.0) if ok else None
        if not ok or isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ApiError("'lora': each entry must be {\"id\": int, \"scale\": number}", param="lora")
        out[e["id"]] = float(scale)
    return out


def lora_scales(entries: dict[int, float], n: int) -> tuple[float, ...]:
    """Every adapter's scale: those named, 0 for the others (construct_lora_list); an id the
    server does not have is a 400 (llama-server ignores it)."""
    bad = sorted(i for i in entries if not 0 <= i < n)
    if bad:
        raise ApiError(f"'lora': no adapter with id {bad[0]} (this server has {n}: GET /lora-adapters)", param="lora")
    return tuple(entries.get(i, 0.0) for i in range(n))


def _prompt_tokens(body: dict, tokenizer: Any, name: str = "prompt") -> tuple[list[int], str]:
    v = body.get(name)
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # OpenAI's batch of one prompt
    if isinstance(v, str):
        return tokenizer.encode(v, add_special=True, parse_special=True), v
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return [int(t) for t in v], ""
    if v is None:
        raise ApiError(f"'{name}' is required", param=name)
    raise ApiError(f"'{name}' must be a string or a list of token ids (one prompt per request)", param=name)


def completion_request(body: Any, tokenizer: Any) -> Parsed:
    """POST /v1/completions."""
    body = _check_fields(body, COMPLETION_FIELDS)
    toks, text = _prompt_tokens(body, tokenizer)
    lp = _num(body, "logprobs", int, 0, MAX_TOP_LOGPROBS)
    parsed = _common(body, toks, _num(body, "max_tokens", int, 0, I64), lp, tokenizer)
    parsed.prompt_text = text
    parsed.request.constraint = _structured(body, tokenizer)
    return parsed


def llama_completion_request(body: Any, tokenizer: Any) -> Parsed:
    """llama-server's POST /completion."""
    body = _check_fields(body, LLAMA_COMPLETION_FIELDS)
    toks, text = _prompt_tokens(body, tokenizer)
    n_probs = _num(body, "n_probs", int, 0, MAX_TOP_LOGPROBS)
    parsed = _common(body, toks, _num(body, "n_predict", int, -1, I64), n_probs or None, tokenizer)
    parsed.prompt_text = text
    parsed.request.constraint = _structured(body, tokenizer)
    return parsed


# -- embeddings (server-context.cpp's handle_embeddings_impl, format_embeddings_response_oaicompat) --

EMBEDDING_FIELDS = {"input", "content", "model", "encoding_format", "embd_normalize", "user"}


@dataclass
class EmbeddingRequest:
    prompts: list[list[int]]
    oai: bool  # OpenAI's response shape; False for `content` (llama-server's /embedding shape)
    base64: bool
    embd_norm: int
    model: str


def embedding_request(body: Any, tokenizer: Any, oai: bool, embd_norm: int) -> EmbeddingRequest:
    """POST /v1/embeddings (`input`) or /embedding (`content`): a string, token ids, or a list of
    strings or of token-id lists. `content` answers in llama-server's own shape, as there."""
    body = _check_fields(body, EMBEDDING_FIELDS)
    name = "input" if "input" in body else "content"
    v = body.get(name)
    if v is None:
        raise ApiError('"input" or "content" must be provided', param="input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError("encoding_format: the format to return the embeddings in, float or base64", param="encoding_format")
    norm = _num(body, "embd_normalize", int, -1, I64)
    items = v if isinstance(v, list) and v and not all(isinstance(t, int) and not isinstance(t, bool) for t in v) else [v]
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special=True, parse_special=True)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = [int(t) for t in item]
            if any(not 0 <= t < tokenizer.n_vocab for t in ids):
                raise ApiError(f"{name}[{i}]: token id out of range [0, {tokenizer.n_vocab})", param=name)
        else:
            raise ApiError(f"'{name}' must be a string, token ids, or a list of either", param=name)
        if not ids:
            raise ApiError("Input content cannot be empty", param=name)
        prompts.append(ids)
    model = body.get("model", "")
    return EmbeddingRequest(prompts, oai and name == "input", fmt == "base64", embd_norm if norm is None else norm,
                            model if isinstance(model, str) else "")  # fmt: skip


def embeddings_response(vectors: Sequence[Any], req: EmbeddingRequest, model: str) -> Any:
    """OpenAI's list of embeddings (base64: the float32 bytes), or llama-server's /embedding
    answer: one `embedding` a prompt, a list of rows (one pooled row, or every token's)."""
    import base64

    import numpy as np

    if not req.oai:
        return [{"index": i, "embedding": np.atleast_2d(v).tolist()} for i, v in enumerate(vectors)]
    n = sum(map(len, req.prompts))

    def item(i: int, v: Any) -> dict[str, Any]:
        if req.base64:
            vec = base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
            return {"embedding": vec, "index": i, "object": "embedding", "encoding_format": "base64"}
        return {"embedding": np.asarray(v).tolist(), "index": i, "object": "embedding"}

    return {"model": req.model or model, "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": [item(i, v) for i, v in enumerate(vectors)]}  # fmt: skip


# -- reranking (server-context.cpp's post_rerank, server-common.cpp's format_response_rerank) --

RERANK_FIELDS = {"query", "documents", "texts", "top_n", "return_text", "model"}


@dataclass
class RerankRequest:
    query: str
    documents: list[str]
    top_n: int
    tei: bool  # `texts`: Text Embeddings Inference's shape (a bare list, `score`), else Jina's
    return_text: bool
    model: str


def rerank_request(body: Any) -> RerankRequest:
    """POST /v1/rerank: `query` and `documents` (Jina's API) or `texts` (TEI's)."""
    body = _check_fields(body, RERANK_FIELDS)
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError('"query" must be provided as a string', param="query")
    tei = "texts" in body
    docs = body.get("texts" if tei else "documents")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise ApiError('"documents" must be a non-empty string array', param="texts" if tei else "documents")
    top_n = _num(body, "top_n", int, 0, I64)
    model = body.get("model", "")
    return RerankRequest(query, docs, len(docs) if top_n is None else top_n, tei, _bool(body, "return_text"),
                         model if isinstance(model, str) else "")  # fmt: skip


def rerank_response(scores: Sequence[float], req: RerankRequest, n_tokens: int, model: str) -> Any:
    """The documents by score, best first, `top_n` of them."""
    label = "score" if req.tei else "relevance_score"
    items = [{"index": i, label: float(s), **({"text": req.documents[i]} if req.tei and req.return_text else {})}
             for i, s in enumerate(scores)]  # fmt: skip
    items = sorted(items, key=lambda d: -d[label])[: req.top_n]
    if req.tei:
        return items
    return {"model": req.model or model, "object": "list",
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": items}  # fmt: skip


@dataclass
class ChatTemplate:
    """The model's chat template and the special-token texts it is rendered with."""

    source: str
    bos: str
    eos: str

    @classmethod
    def of(cls, model: Any) -> ChatTemplate:
        tok = model.tokenizer
        md = model.gguf.metadata
        return cls(
            template_or_default(md.get("tokenizer.chat_template")),
            tok.token_text(tok.bos) if tok.bos is not None else "",
            tok.token_text(tok.eos) if tok.eos is not None else "",
        )


_ROLES = {"system", "user", "assistant", "developer", "tool"}


def _text(content: Any, i: int) -> str:
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
    return content


def _history_calls(calls: Any, i: int) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise ApiError(f"messages[{i}].tool_calls must be a non-empty list", param="messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or c.get("type", "function") != "function" or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments"), (str, dict)) or not isinstance(c.get("id", ""), str)):  # fmt: skip
            raise ApiError(f'messages[{i}].tool_calls[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                           param="messages")  # fmt: skip
        args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
        out.append({"id": c.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as the chat templates take them (transformers' shapes): text content,
    assistant `tool_calls`, `tool` results with their `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in _ROLES:
            raise ApiError(f"messages[{i}].role {role!r}: supported roles are {sorted(_ROLES)}", param="messages")
        allowed = {"role", "content", "name"} | {"assistant": {"tool_calls", "reasoning_content"},
                                                 "tool": {"tool_call_id"}}.get(role, set())  # fmt: skip
        extra = set(m) - allowed
        if extra:
            raise ApiError(f"messages[{i}] ({role}): unsupported field(s) {sorted(extra)}", param="messages")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _history_calls(m["tool_calls"], i)
            msg["content"] = None if m.get("content") is None else _text(m["content"], i)
        else:
            msg["content"] = _text(m.get("content"), i)
        for k in ("name", "tool_call_id", "reasoning_content"):
            if m.get(k) is not None:
                if not isinstance(m[k], str):
                    raise ApiError(f"messages[{i}].{k} must be a string", param="messages")
                msg[k] = m[k]  # templates that know them use them
        out.append(msg)
    return out


def chat_prompt(messages: list[dict[str, Any]], template: ChatTemplate, tokenizer: Any, **extra: Any) -> tuple[list[int], str]:
    """The rendered conversation and its tokens: special tokens parsed, BOS added once when the
    model wants one and the template did not write it (llama-server's chat prompts)."""
    text = render_chat(template.source, messages, add_generation_prompt=True, bos_token=template.bos,
                       eos_token=template.eos, **extra)  # fmt: skip
    toks = tokenizer.encode(text, add_special=False, parse_special=True)
    if tokenizer.add_bos and tokenizer.bos is not None and (not toks or toks[0] != tokenizer.bos):
        toks = [tokenizer.bos] + toks
    return toks, text


def chat_request(body: Any, tokenizer: Any, template: ChatTemplate) -> Parsed:
    """POST /v1/chat/completions."""
    body = _check_fields(body, CHAT_FIELDS)
    messages = chat_messages(body.get("messages"))
    tools = _tools(body)
    choice, named = _tool_choice(body, tools)
    parallel = _bool(body, "parallel_tool_calls", False)  # llama-server's default
    spec, where, param = structured_spec(body)
    for i, t in enumerate(tools):  # every schema checked, forced or not
        check_constraint(ConstraintSpec("json_schema", json.dumps(t.parameters)), tokenizer,
                         f"tools[{i}].function.parameters", "tools")  # fmt: skip
    if choice == "none":
        tools = []  # nothing offered, nothing parsed
    if tools and spec is not None and spec.kind == "gbnf":
        raise ApiError("'grammar' cannot be combined with 'tools' (a tool call has its own grammar)", param="grammar")
    fmt = tc.detect_format(template.source, bool(tools), with_schema=spec is not None)
    if fmt == "harmony" and tools and spec is not None:
        raise ApiError(f"'{param}' cannot be combined with 'tools' for this model (harmony replies: a call "
                       "or a final answer, not both constrained)", param=param)  # fmt: skip
    kwargs = template_kwargs(body, template.source)
    history_tools = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    caps = tc.template_caps(template.source) if tools or history_tools else None
    if caps is not None:
        messages = tc.prepare_messages(messages, tools, fmt, caps)
    extra = tc.template_variables(fmt, tools, caps) if caps is not None else {}
    toks, text = chat_prompt(messages, template, tokenizer, **{**extra, **kwargs})  # (the request's own win)
    if fmt == "harmony" and spec is not None and spec.kind in ("json_schema", "json_object"):
        check_constraint(spec, tokenizer, where, param)  # (the schema's own errors, with their JSON pointer)
        spec = ConstraintSpec("lark", tc.harmony_final_grammar(json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}))
    if tools:
        forced = [t for t in tools if t.name == named] if named else tools
        if choice == "required":
            kind, source = tc.call_grammar(fmt, forced, parallel, tokenizer)
            spec, where, param = ConstraintSpec(kind, source), "tools", "tools"
        elif fmt == "generic":  # auto: a call or a response, both JSON
            response = json.loads(spec.source) if spec is not None and spec.kind == "json_schema" else (
                {"type": "object"} if spec is not None else None)  # fmt: skip
            spec = ConstraintSpec("json_schema", json.dumps(tc.generic_schema(tools, False, parallel, response)))
            where = where or "tools"
        else:  # auto: free text, but a call the text opens is held to the tools (llama.cpp's lazy grammar)
            kind, source = tc.call_grammar(fmt, tools, parallel, tokenizer, lazy=True)
            spec, where, param = ConstraintSpec(kind, source), "tools", "tools"
    check_constraint(spec, tokenizer, where, param)
    want_lp = _bool(body, "logprobs")
    top = _num(body, "top_logprobs", int, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_lp:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    mt = _num(body, "max_completion_tokens", int, 0, I64)
    if mt is None:
        mt = _num(body, "max_tokens", int, 0, I64)
    parsed = _common(body, toks, mt, (top or 0) if want_lp else None, tokenizer)
    parsed.prompt_text = text
    parsed.request.constraint = spec
    # Llama 3's <|python_tag|> and Mistral's [TOOL_CALLS] are control tokens: kept in the text to be read
    parsed.request.special = fmt in ("llama3", "mistral")
    parsed.syntax = tc.Syntax.of_reply(fmt, template.source, text, parse_tools=bool(tools), forced=bool(tools) and choice == "required")
    return parsed


# -- responses ---------------------------------------------------------------------------------


def _piece(tokenizer: Any, t: int) -> bytes:
    return tokenizer.token_to_piece(t, special=True)


def _finish_reason(reason: str | None) -> str:
    # a full slot is a length limit to OpenAI clients, as llama-server reports it; a grammar's dead
    # end keeps its own name (OpenAI has none for it, and "stop" would hide it)
    if reason == "grammar_dead_end":
        return reason
    return "length" if reason in ("length", "context") else "stop"


class Responder:
    """Builds one request's OpenAI-shaped chunks and final response from engine events.
    kind: "chat" or "completion"; a chat reply is read as `syntax` says (tool calls, reasoning)."""

    def __init__(self, kind: str, model: str, tokenizer: Any, syntax: tc.Syntax | None = None) -> None:
        self.kind = kind
        self.model = model
        self.tok = tokenizer
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text_offset = 0
        self.reply = tc.ReplyStream(syntax or tc.Syntax())

    def finish_reason(self, ev: Event) -> str:
        reason = _finish_reason(ev.finish_reason)
        return "tool_calls" if reason == "stop" and self.reply.message.tool_calls else reason

    # logprobs

    def _lp_chat(self, ev: Event) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            b = _piece(self.tok, t)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

        e = entry(ev.token, ev.logprob or 0.0)
        e["top_logprobs"] = [entry(t, lp) for t, lp in (ev.top_logprobs or [])]
        return e

    def logprobs(self, events: Sequence[Event]) -> dict[str, Any] | None:
        evs = [e for e in events if e.kind == "token" and e.logprob is not None]
        if not evs:
            return None
        if self.kind == "chat":
            return {"content": [self._lp_chat(e) for e in evs]}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in evs:
            piece = _piece(self.tok, e.token).decode("utf-8", errors="replace")
            out["tokens"].append(piece)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(
                {_piece(self.tok, t).decode("utf-8", errors="replace"): lp for t, lp in (e.top_logprobs or [])}
            )
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(piece)
        return out

    @staticmethod
    def usage(ev: Event) -> dict[str, Any]:
        u = ev.usage
        assert u is not None
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        }

    # streaming

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        d = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        d.update(extra)
        return d

    def _choice(self, text: str | None, finish: str | None, lp: dict | None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}

    def _deltas(self, deltas: list[dict[str, Any]], lp: dict | None) -> list[dict[str, Any]]:
        return [self._chunk([{"index": 0, "delta": d, "logprobs": lp if i == 0 else None, "finish_reason": None}])
                for i, d in enumerate(deltas)]  # fmt: skip

    def start_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role."""
        return [self._chunk([self._choice("", None, None, role=True)])] if self.kind == "chat" else []

    def token_chunks(self, ev: Event) -> list[dict[str, Any]]:
        lp = self.logprobs([ev])
        if self.kind == "chat":
            deltas = self.reply.feed(ev.text)
            return self._deltas(deltas or ([{"content": ""}] if lp is not None else []), lp)
        if not ev.text and lp is None:
            return []  # text held back (a possible stop string, half a character)
        return [self._chunk([self._choice(ev.text, None, lp)])]

    def end_chunks(self, ev: Event, include_usage: bool) -> list[dict[str, Any]]:
        if self.kind == "chat":
            out = self._deltas(self.reply.feed(ev.text) + self.reply.finish(), None)
        else:
            out = [self._chunk([self._choice(ev.text, None, None)])] if ev.text else []
        out.append(self._chunk([self._choice(None if self.kind == "chat" else "", self.finish_reason(ev), None)]))
        if include_usage:
            out.append(self._chunk([], usage=self.usage(ev)))
        return out

    # whole response

    def response(self, events: Iterable[Event]) -> dict[str, Any]:
        evs = list(events)
        done = evs[-1]
        text = "".join(e.text for e in evs)
        lp = self.logprobs(evs)
        if self.kind == "chat":
            self.reply.feed(text)
            self.reply.finish()
            choice = {"index": 0, "message": tc.message_dict(self.reply.message), "logprobs": lp,
                      "finish_reason": self.finish_reason(done)}  # fmt: skip
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": self.finish_reason(done)}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(done)}  # fmt: skip


def llama_chunk(ev: Event, tokenizer: Any, model: str, prompt: str) -> dict[str, Any]:
    """llama-server's /completion answer: one per token while streaming, then the final one."""
    d: dict[str, Any] = {"index": 0, "content": ev.text, "tokens": [ev.token] if ev.kind == "token" else [],
                         "stop": ev.kind == "done", "id_slot": ev.slot}  # fmt: skip
    if ev.kind == "token" and ev.logprob is not None:
        d["completion_probabilities"] = [{
            "id": ev.token, "token": _piece(tokenizer, ev.token).decode("utf-8", errors="replace"),
            "logprob": ev.logprob,
            "top_logprobs": [{"id": t, "token": _piece(tokenizer, t).decode("utf-8", errors="replace"), "logprob": lp}
                             for t, lp in (ev.top_logprobs or [])],
        }]  # fmt: skip
    if ev.kind == "done":
        assert ev.usage is not None and ev.timings is not None
        d.update(
            model=model,
            prompt=prompt,
            tokens_predicted=ev.usage.completion_tokens,
            tokens_evaluated=ev.usage.prompt_tokens,
            tokens_cached=ev.usage.cached_tokens,
            truncated=False,
            stop_type="word" if ev.stop_word else {"stop": "eos", "length": "limit", "context": "limit"}.get(ev.finish_reason or "", ev.finish_reason),
            stopping_word=ev.stop_word or "",
            timings=ev.timings.to_dict(),
        )
    return d
