"""bench/serve_load.py's clients and bench/llama_cpp.py's llama-server lookup, without a model: the
bare asyncio client and the httpx one read the same chunked SSE stream from a loopback stub to the
same text and chunk count, and a refused request is an error."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests_support import bench_module

httpx = pytest.importorskip("httpx")


def _events() -> bytes:
    """An OpenAI chat stream: role, two pieces of text, a logprobs-only chunk, the finish, usage."""

    def chunk(delta: dict, **extra: object) -> dict:
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, **extra}]}

    events = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo, wörld"}),
        chunk({"content": ""}, logprobs={"content": [{"token": "é", "logprob": -0.5}]}),
        chunk({}, finish_reason="length"),
        {"object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 4}},
    ]
    # ensure_ascii=False: "ö" and "é" as UTF-8 bytes, which the 7-byte chunks below cut in two
    return b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\r\n\r\n" for e in events) + (
        b"data: [DONE]\r\n\r\n"
    )


async def _serve(status: str, run: Callable[[str], Awaitable[object]]) -> object:
    """A loopback HTTP/1.1 stub answering every request with `status` and, for 200, the stream in
    chunks of 7 bytes (lines and UTF-8 characters cut across chunks); `run(url)` meanwhile."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        length = next(int(h.split(":")[1]) for h in head.split("\r\n") if h.lower().startswith("content-length"))
        body = json.loads(await reader.readexactly(length))
        assert body["stream"] is True and body["max_tokens"] == 4
        if status != "200 OK":
            writer.write(f"HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode())
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            data = _events()
            for i in range(0, len(data), 7):
                part = data[i : i + 7]
                writer.write(b"%x\r\n" % len(part) + part + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        return await asyncio.wait_for(run(f"http://127.0.0.1:{port}"), 30)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("per_token", [False, True])
def test_bare_and_httpx_clients_read_the_same_stream(per_token: bool) -> None:
    sl = bench_module("serve_load")

    async def both(url: str) -> tuple:
        async with httpx.AsyncClient(timeout=30) as client:
            return await sl.chat_bare(url, "Hi", 4, per_token), await sl.chat(client, url, "Hi", 4, per_token)

    bare, via = asyncio.run(_serve("200 OK", both))  # type: ignore[misc]
    for r in (bare, via):
        assert r.text == "Hello, wörld"
        # the logprobs-only chunk is a token's chunk when every token was asked to be one
        assert r.n_chunks == (3 if per_token else 2)
        assert len(r.itl) == r.n_chunks - 1 and 0 < r.t_first <= r.wall


def test_bare_client_refused_request_is_an_error() -> None:
    sl = bench_module("serve_load")
    with pytest.raises(RuntimeError, match="503"):
        asyncio.run(_serve("503 Service Unavailable", lambda url: sl.chat_bare(url, "Hi", 4)))


def test_llama_server_is_found_next_to_the_other_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lc = bench_module("llama_cpp")
    monkeypatch.setenv("LLAMAPY_BENCH_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    for tool in lc.TOOLS:
        (tmp_path / tool).write_text("#!/bin/sh\n")
        os.chmod(tmp_path / tool, stat.S_IRWXU)
    assert lc.find_tools() is not None and lc.find_server() is None
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "llama-server", stat.S_IRWXU)
    assert lc.find_server() == tmp_path / "llama-server"
