"""The HTTP server: an OpenAI-compatible API and llama-server's own endpoints over one Engine
(llama.cpp's tools/server/server.cpp routes), on Starlette/FastAPI with SSE from sse-starlette.

The model loads in a thread while the server already answers: /health says 503 until it is ready.
Requests are parsed in the event loop; decoding runs in the engine's worker thread; each request's
events come back through the loop. A streaming client that goes away cancels its request (its
generator is closed), a non-streaming one is noticed by polling the connection, and either way the
engine frees the slot at its next step.

A lost device (a Ray node that died or stopped answering: docs/ray.md) ends the requests running
on the model with an error naming it; the server stays up, /health then answers 503 with the
reason, and generation requests get 503 until the server is restarted (the model is not reloaded
by itself: the cluster may need attention first).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..embedding import rerank_tokens
from ..engine import AsyncEvents, Engine, EngineStoppedError, Event, PromptTooLongError, QueueFullError
from ..types import LlamapyError
from .protocol import (
    ApiError,
    ChatTemplate,
    Parsed,
    Responder,
    chat_request,
    completion_request,
    embedding_request,
    embeddings_response,
    llama_chunk,
    llama_completion_request,
    lora_entries,
    lora_scales,
    rerank_request,
    rerank_response,
)

RETRY_AFTER_S = 1  # what a 503 (queue full) suggests to wait
DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks its connection
MAX_BODY = 16 * 2**20  # bytes of request body (a slot's context is far smaller)


@dataclass
class ServerState:
    """What the routes share: the engine once loaded, and the server's settings."""

    model_name: str = ""
    api_key: str | None = None
    metrics: bool = False
    llm: Any = None
    engine: Engine | None = None
    template: ChatTemplate | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None
    t_start: float = field(default_factory=time.time)
    # --embeddings: the server answers embeddings only, one request at a time over the context
    embeddings: bool = False
    pooling: str = "none"
    embd_norm: int = 2
    embd_lock: threading.Lock = field(default_factory=threading.Lock)

    def embed(self, prompts: list[list[int]], embd_norm: int) -> list[Any]:
        from ..embedding import embed

        with self.embd_lock:
            if self.engine is not None and self.llm.ctx.lora_scales != self.engine.lora:
                self.llm.ctx.set_lora_scales(self.engine.lora)  # POST /lora-adapters
            return embed(self.llm.ctx, prompts, self.pooling, embd_norm)

    def attach(self, llm: Any, engine: Engine) -> None:
        self.llm = llm
        self.engine = engine
        self.template = ChatTemplate.of(llm.model)
        self.ready.set()


def _error(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _json_body(request: Request) -> Any:
    """The parsed body; one larger than MAX_BODY is refused before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(f"the request body is larger than {MAX_BODY // 2**20} MiB", 413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            raise ApiError(f"the request body is larger than {MAX_BODY // 2**20} MiB", 413)
        parts.append(part)
    raw = b"".join(parts)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="llamapy", docs_url=None, redoc_url=None, openapi_url=None)

    # -- errors, auth, loading ----------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, e: QueueFullError) -> JSONResponse:
        return _error(ApiError(f"server busy: {e}", 503, "unavailable_error"), {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineStoppedError)
    async def _stopped(_: Request, e: EngineStoppedError) -> JSONResponse:
        return _error(ApiError(str(e), 503, "unavailable_error"))

    @app.exception_handler(PromptTooLongError)
    async def _too_long(_: Request, e: PromptTooLongError) -> JSONResponse:
        err = ApiError(str(e), 400, "exceed_context_size_error", "messages")
        body = err.body()
        body["error"].update(n_prompt_tokens=e.n_prompt, n_ctx=e.n_ctx_slot)
        return JSONResponse(body, status_code=400)

    @app.exception_handler(LlamapyError)
    async def _bad_request(_: Request, e: LlamapyError) -> JSONResponse:
        return _error(ApiError(str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(ApiError(str(e.detail), e.status_code, kind))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return _error(ApiError(f"internal error: {type(e).__name__}: {e}", 500, "server_error"))

    app.add_middleware(_Gate, state=state)

    def engine() -> Engine:
        assert state.engine is not None
        return state.engine

    # -- informational ------------------------------------------------------------------------

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        if state.load_error is not None:
            return _error(ApiError(f"model failed to load: {state.load_error}", 500, "server_error"))
        if not state.ready.is_set():
            return _error(ApiError("loading model", 503, "unavailable_error"))
        if state.engine is not None and state.engine.loop_error is not None:
            return _error(ApiError(f"the engine stopped: {state.engine.loop_error!r}", 500, "server_error"))
        if state.engine is not None and state.engine.fault is not None:
            # a lost device (a Ray node): generation is refused until the server is restarted
            return _error(ApiError(f"the model is unavailable: {state.engine.fault}; restart the server to load it again",
                                   503, "unavailable_error"))  # fmt: skip
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> JSONResponse:
        p = state.llm.model.params
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.t_start), "owned_by": "llamapy",
            "meta": {"n_vocab": p.n_vocab, "n_ctx_train": p.n_ctx_train, "n_embd": p.n_embd,
                     "n_ctx_slot": engine().n_ctx_slot, "n_parallel": engine().n_parallel},
        }]})  # fmt: skip

    @app.get("/slots")
    async def slots() -> JSONResponse:
        return JSONResponse([
            {"id": s.id, "id_task": s.id_task, "n_ctx": s.n_ctx, "is_processing": s.is_processing,
             "n_cached": s.n_cached, "n_prompt_tokens": s.n_prompt, "n_decoded": s.n_decoded}
            for s in engine().slot_info()
        ])  # fmt: skip

    @app.get("/lora-adapters")
    async def lora_adapters() -> JSONResponse:
        return JSONResponse([
            {"id": i, "path": str(ad.path), "scale": engine().lora[i], "task_name": ad.task_name,
             "prompt_prefix": ad.prompt_prefix}
            for i, ad in enumerate(state.llm.model.adapters)
        ])  # fmt: skip

    @app.post("/lora-adapters")
    async def set_lora_adapters(request: Request) -> JSONResponse:
        """The scales of requests that name none from now on (adapters not listed: 0); a
        request already running keeps its own."""
        body = await _json_body(request)
        if not isinstance(body, list):
            raise ApiError("Request body must be an array")
        engine().lora = lora_scales(lora_entries(body), len(state.llm.model.adapters))
        return JSONResponse({"success": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        if not state.metrics:
            return _error(ApiError("this server does not support the metrics endpoint (start it with --metrics)", 501, "not_supported_error"))
        return PlainTextResponse(prometheus(engine()), media_type="text/plain; version=0.0.4")

    # -- tokens -------------------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise ApiError("'content' must be a string", param="content")
        tok = state.llm.tokenizer
        add_special = body.get("add_special", False)
        with_pieces = body.get("with_pieces", False)
        if not isinstance(add_special, bool) or not isinstance(with_pieces, bool):
            raise ApiError("'add_special' and 'with_pieces' must be booleans")
        ids = tok.encode(body["content"], add_special=add_special, parse_special=True)
        if with_pieces:
            return JSONResponse({"tokens": [{"id": t, "piece": _piece_json(tok.token_to_piece(t, special=True))} for t in ids]})
        return JSONResponse({"tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await _json_body(request)
        toks = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ApiError("'tokens' must be a list of token ids", param="tokens")
        n_vocab = state.llm.model.params.n_vocab
        if any(t < 0 or t >= n_vocab for t in toks):
            raise ApiError(f"token id out of range [0, {n_vocab})", param="tokens")
        return JSONResponse({"content": state.llm.tokenizer.decode(toks)})

    # -- embeddings ---------------------------------------------------------------------------

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _embeddings(request, oai=True)

    @app.post("/embedding")
    async def llama_embedding(request: Request) -> Response:
        return await _embeddings(request, oai=False)

    async def _embeddings(request: Request, oai: bool) -> Response:
        if not state.embeddings:
            raise ApiError("This server does not support embeddings. Start it with `--embeddings`", 501, "not_supported_error")
        req = embedding_request(await _json_body(request), state.llm.tokenizer, oai, state.embd_norm)
        if req.oai and state.pooling == "none":
            raise ApiError("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        vectors = await asyncio.to_thread(state.embed, req.prompts, req.embd_norm)
        return JSONResponse(embeddings_response(vectors, req, state.model_name))

    @app.post("/rerank")
    @app.post("/reranking")
    @app.post("/v1/rerank")
    @app.post("/v1/reranking")
    async def rerank(request: Request) -> Response:
        if state.pooling != "rank":
            raise ApiError("This server does not support reranking. Start it with `--reranking`", 501, "not_supported_error")
        req = rerank_request(await _json_body(request))
        prompts = [rerank_tokens(state.llm.model, req.query, d) for d in req.documents]
        vectors = await asyncio.to_thread(state.embed, prompts, -1)
        scores = [float(v[0]) for v in vectors]  # the first label's (Qwen3-Reranker: "yes"), as llama-server
        return JSONResponse(rerank_response(scores, req, sum(map(len, prompts)), state.model_name))

    def generating() -> None:
        if state.embeddings:
            raise ApiError("This server does not support completions. Start it without `--embeddings`", 501, "not_supported_error")

    # -- generation ---------------------------------------------------------------------------

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> Response:
        generating()
        parsed = completion_request(await _json_body(request), state.llm.tokenizer)
        return await _openai(request, parsed, "completion")

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        generating()
        assert state.template is not None
        parsed = chat_request(await _json_body(request), state.llm.tokenizer, state.template)
        return await _openai(request, parsed, "chat")

    @app.post("/completion")
    async def llama_completion(request: Request) -> Response:
        generating()
        parsed = llama_completion_request(await _json_body(request), state.llm.tokenizer)
        events = engine().open_async(_with_lora(parsed))
        tok = state.llm.tokenizer

        def chunk(ev: Event) -> dict[str, Any]:
            return llama_chunk(ev, tok, state.model_name, parsed.prompt_text)

        if parsed.stream:

            async def sse() -> AsyncIterator[dict[str, str]]:
                with _closing(events):
                    async for ev in events:
                        if ev.kind == "done" and ev.finish_reason == "error":
                            yield {"data": json.dumps(_server_error(ev).body())}
                        else:
                            yield {"data": json.dumps(chunk(ev))}

            return EventSourceResponse(sse(), sep="\n")
        evs = await _collect(request, events)
        if evs[-1].finish_reason == "error":
            return _error(_server_error(evs[-1]))
        final = chunk(evs[-1])
        final["content"] = "".join(e.text for e in evs)
        final["tokens"] = [e.token for e in evs if e.kind == "token"]
        if parsed.request.logprobs:
            final["completion_probabilities"] = [p for e in evs if e.kind == "token"
                                                 for p in chunk(e).get("completion_probabilities", [])]  # fmt: skip
        return JSONResponse(final)

    def _with_lora(parsed: Parsed) -> Any:
        """The request, with its "lora" list resolved to every adapter's scale."""
        if parsed.lora is not None:
            parsed.request.lora = lora_scales(parsed.lora, len(state.llm.model.adapters))
        return parsed.request

    async def _openai(request: Request, parsed: Parsed, kind: str) -> Response:
        events = engine().open_async(_with_lora(parsed))
        r = Responder(kind, parsed.model or state.model_name, state.llm.tokenizer, parsed.syntax)
        if parsed.stream:

            async def sse() -> AsyncIterator[dict[str, str]]:
                with _closing(events):
                    for c in r.start_chunks():
                        yield {"data": json.dumps(c)}
                    async for ev in events:
                        if ev.kind == "token":
                            for c in r.token_chunks(ev):
                                yield {"data": json.dumps(c)}
                        elif ev.finish_reason == "error":
                            yield {"data": json.dumps(_server_error(ev).body())}
                        else:
                            for c in r.end_chunks(ev, parsed.include_usage):
                                yield {"data": json.dumps(c)}
                    yield {"data": "[DONE]"}

            return EventSourceResponse(sse(), sep="\n")
        evs = await _collect(request, events)
        if evs[-1].finish_reason == "error":
            return _error(_server_error(evs[-1]))
        return JSONResponse(r.response(evs))

    return app


def _piece_json(b: bytes) -> str | list[int]:
    """A token's piece as text, or as its bytes when they are not valid UTF-8 on their own
    (llama-server's /tokenize with_pieces)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


class _Gate:
    """The API key and the loading check, before any route (a plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would hide a client's disconnect from the routes)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/v1/health"):
            await self.app(scope, receive, send)
            return
        state = self.state
        err: ApiError | None = None
        headers: dict[str, str] | None = None
        if state.api_key is not None:
            h = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            auth = h.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else h.get("x-api-key", "")
            if not hmac.compare_digest(key.encode(), state.api_key.encode()):
                err = ApiError("invalid or missing API key", 401, "authentication_error")
        if err is None and not state.ready.is_set():
            err = ApiError("loading model", 503, "unavailable_error")
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        if err is not None:
            await _error(err, headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _server_error(ev: Event) -> ApiError:
    return ApiError(ev.error or "generation failed", 500, "server_error")


class _closing:  # noqa: N801 - a context manager, used like contextlib.closing
    """Cancel the request when the response ends early (client gone, server shutting down)."""

    def __init__(self, events: AsyncEvents) -> None:
        self.events = events

    def __enter__(self) -> AsyncEvents:
        return self.events

    def __exit__(self, *exc: object) -> None:
        self.events.close()


class ClientGone(Exception):
    """The client of a non-streaming request closed its connection."""


async def _collect(request: Request, events: AsyncEvents) -> list[Event]:
    """Every event of a non-streaming request; cancels it if the client goes away meanwhile."""
    out: list[Event] = []

    async def consume() -> None:
        async for ev in events:
            out.append(ev)

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return out
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
        events.close()


# -- /metrics --------------------------------------------------------------------------------


def prometheus(engine: Engine) -> str:
    """llama-server's metrics, same names and help texts (server-task.cpp to_metrics)."""
    m = engine.metrics
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", m.prompt_tokens_total),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", m.prompt_tokens_cached_total),
        ("prompt_seconds_total", "Total time spent processing prompts", m.prompt_seconds_total),
        ("tokens_predicted_total", "Number of generation tokens processed", m.tokens_predicted_total),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", m.tokens_predicted_seconds_total),
        ("n_decode_total", "Total number of llama_decode() calls", m.n_decode_total),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", m.n_tokens_max),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", m.n_draft_tokens_total),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", m.n_draft_accepted_total),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", m.n_drafts_total),
    ]

    def rate(n: float, s: float) -> float:
        return n / s if s > 0 else 0.0

    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", rate(m.prompt_tokens_total, m.prompt_seconds_total)),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         rate(m.tokens_predicted_total, m.tokens_predicted_seconds_total)),
        ("requests_processing", "Number of requests processing", engine.n_busy()),
        ("requests_deferred", "Number of requests deferred", engine.n_waiting()),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         m.n_busy_slots_total / max(m.n_decode_total, 1)),
    ]  # fmt: skip
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_, value in items:
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"
