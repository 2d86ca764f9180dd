"""`llamapy serve` end to end: a real server subprocess on a free loopback port, driven with the
official `openai` client and raw httpx (SSE framing), against a tiny model the tests write.

Covers the OpenAI endpoints (chat, completions, streaming, logprobs, usage), llama-server's own
(/completion, /tokenize, /detokenize, /slots, /metrics), greedy parity with `llamapy run`, a client
that disconnects, overload (503 + Retry-After), bad input, auth and SIGTERM.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import write_llama_gguf  # noqa: E402
from serving import CHAT_TEMPLATE, REPO, Server  # noqa: E402

TIMEOUT = httpx.Timeout(60.0)
PROMPT = "the cat and the dog"
# Slots long enough that a request of LONG tokens runs for seconds even on this tiny model (its
# attention grows with the history), so that what the tests do meanwhile finds it still running.
SLOT = 8192
LONG = 8000


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("serve") / "tiny-chat.gguf", seed=5, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Server(model, ["-np", "2", "-c", str(SLOT), "-ub", "64", "--metrics", "-t", "1"], tmp_path_factory.mktemp("log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def sse_events(resp: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, checking the framing on the way."""
    out, buf = [], []
    for line in resp.iter_lines():
        if line == "":
            if buf:
                out.append("\n".join(buf))
                buf = []
            continue
        assert line.startswith("data: "), line
        buf.append(line[len("data: ") :])
    assert not buf, "the stream ended inside an event"
    return out


def test_health_models_and_startup_log(server: Server) -> None:
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-chat.gguf"
    assert f"2 slots, n_ctx_slot = {SLOT} tokens each (KV cache: {2 * SLOT} cells)" in server.text()
    slots = httpx.get(server.url + "/slots", timeout=TIMEOUT).json()
    assert [s["n_ctx"] for s in slots] == [SLOT, SLOT]


def test_chat_uses_the_gguf_template(client, server: Server) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    rendered = "<system>be brief\n<user>hello\n<assistant>"
    toks = httpx.post(server.url + "/tokenize", json={"content": rendered, "add_special": True}, timeout=TIMEOUT).json()
    assert r.usage.prompt_tokens == len(toks["tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_equals_llamapy_run(client, model: Path) -> None:
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = r.choices[0].text
    assert r.object == "text_completion" and r.usage.completion_tokens == 16
    run = subprocess.run(
        [sys.executable, "-m", "llamapy", "run", str(model), "-p", PROMPT, "-n", "16", "--temp", "0",
         "--ignore-eos", "-c", "256", "-t", "1", "--no-warmup"],
        cwd=REPO, capture_output=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()
    out = run.stdout.decode("utf-8")
    assert out == text + ("" if text.endswith("\n") else "\n")


def test_streaming_chat_framing(server: Server, client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = client.chat.completions.create(model="x", **{k: v for k, v in body.items() if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True}).choices[0].message.content  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=TIMEOUT,
                      json=dict(body, stream=True, stream_options={"include_usage": True})) as resp:  # fmt: skip
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    fin = chunks[-2]["choices"][0]
    assert fin["finish_reason"] == "length" and fin["delta"] == {}
    content = [c["choices"][0] for c in chunks[1:-2]]
    assert all(c["finish_reason"] is None for c in content)
    assert "".join(c["delta"]["content"] for c in content) == whole


def test_streaming_with_openai_client(client) -> None:
    stream = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    whole = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].text
    assert whole.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: reused


def test_logprobs(client) -> None:
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    c = client.completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_stop_strings_through_the_server(client, server: Server) -> None:
    full = client.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = full[4:7]
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    llama = httpx.post(server.url + "/completion", timeout=TIMEOUT,
                       json={"prompt": PROMPT, "n_predict": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}).json()  # fmt: skip
    assert llama["content"] == r.choices[0].text
    assert llama["stop_type"] == "word" and llama["stopping_word"] == stop


def test_llama_server_endpoints(server: Server) -> None:
    u = server.url
    r = httpx.post(u + "/completion", json={"prompt": PROMPT, "n_predict": 5, "temperature": 0, "ignore_eos": True}, timeout=TIMEOUT).json()
    assert r["stop"] is True and r["tokens_predicted"] == 5 and r["stop_type"] == "limit"
    assert r["timings"]["predicted_n"] == 5 and len(r["tokens"]) == 5
    assert httpx.post(u + "/detokenize", json={"tokens": r["tokens"]}, timeout=TIMEOUT).json()["content"] == r["content"]
    toks = httpx.post(u + "/tokenize", json={"content": "the cat", "with_pieces": True}, timeout=TIMEOUT).json()["tokens"]
    raw = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in (t["piece"] for t in toks))
    assert raw.decode("utf-8").replace("\u2581", " ").strip() == "the cat"
    assert any(isinstance(t["piece"], list) for t in toks)  # byte tokens that are not UTF-8 alone
    with httpx.stream("POST", u + "/completion", json={"prompt": PROMPT, "n_predict": 3, "stream": True}, timeout=TIMEOUT) as resp:
        events = [json.loads(e) for e in sse_events(resp)]
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    m = httpx.get(u + "/metrics", timeout=TIMEOUT)
    assert m.status_code == 200
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_seconds"):  # fmt: skip
        assert f"# TYPE {name} " in m.text
        assert float(m.text.split(f"\n{name} ")[1].split("\n")[0]) >= 0
    assert float(m.text.split("\nllamacpp:tokens_predicted_total ")[1].split("\n")[0]) >= 5


@pytest.mark.parametrize(
    "path, body, status, needle",
    [
        ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "'temperature' must be a number"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n = 1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, 400, "'functions' is not supported: use 'tools'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, "unsupported parameter 'frobnicate'"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "'max_tokens' must be between 0 and"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "'top_p' must be between"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "'temperature' must be a finite number"),
        ("/v1/completions", {"prompt": "x", "repeat_last_n": 10**30}, 400, "'repeat_last_n' must be between"),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "'seed' must be between"),
        ("/v1/completions", {"prompt": "x", "stop": ["y" * 5000]}, 400, "at most 1000 characters"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "token id out of range"),
        ("/v1/completions", b"x" * (17 * 2**20), 413, "larger than 16 MiB"),
        ("/v1/completions", {"prompt": 12}, 400, "'prompt' must be a string"),
        ("/v1/completions", [1, 2], 400, "JSON object"),
        ("/v1/completions", {"prompt": [5] * (SLOT + 1)}, 400, f"longer than a slot's context ({SLOT} tokens)"),
        ("/v1/nothing", {}, 404, "Not Found"),
        ("/v1/embeddings", {"input": "x"}, 501, "Start it with `--embeddings`"),
        ("/embedding", {"content": "x"}, 501, "Start it with `--embeddings`"),
        ("/v1/rerank", {"query": "x", "documents": ["y"]}, 501, "Start it with `--reranking`"),
    ],
)
def test_bad_input(server: Server, path: str, body, status: int, needle: str) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=TIMEOUT, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


def test_prompt_too_long_gives_the_numbers(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "the " * SLOT}]}, timeout=TIMEOUT)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["n_prompt_tokens"] > SLOT and err["n_ctx"] == SLOT and f"{err['n_prompt_tokens']} tokens" in err["message"]


def wait_idle(url: str, limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if not any(s["is_processing"] for s in httpx.get(url + "/slots", timeout=TIMEOUT).json()):
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"slots still busy after {limit_s} s")


def predicted_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return float(text.split("\nllamacpp:tokens_predicted_total ")[1].split("\n")[0])


def test_disconnect_frees_the_slot(server: Server, client) -> None:
    u = server.url
    before = predicted_total(u)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", u + "/v1/chat/completions", json=body, timeout=TIMEOUT) as resp:
        n = 0
        for line in resp.iter_lines():
            n += line.startswith("data: ")
            if n == 10:
                break
    assert wait_idle(u, 1.0) < 1.0
    assert predicted_total(u) - before < LONG  # stopped early, not run to max_tokens
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_non_streaming_disconnect_frees_the_slot(server: Server) -> None:
    before = predicted_total(server.url)
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    assert wait_idle(server.url, 1.5) < 1.5
    assert predicted_total(server.url) - before < LONG


def test_overload_queue_full_gives_503(model: Path, tmp_path: Path) -> None:
    s = Server(model, ["-np", "1", "--queue", "1", "-c", str(SLOT), "-ub", "64", "-t", "1"], tmp_path / "server.log")
    try:
        u = s.url
        long = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as c:
            with c.stream("POST", u + "/v1/completions", json=long) as a:
                a_lines = a.iter_lines()  # kept: a dropped iterator would close the stream
                next(a_lines)  # A holds the slot
                with c.stream("POST", u + "/v1/completions", json=long) as b:
                    assert b.status_code == 200  # B waits in the queue
                    r = httpx.post(u + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=TIMEOUT)
                    assert r.status_code == 503, r.text
                    assert r.headers["retry-after"] == "1"
                    assert r.json()["error"]["type"] == "unavailable_error"
                    m = httpx.get(u + "/slots", timeout=TIMEOUT).json()
                    assert m[0]["is_processing"]
        wait_idle(u, 2.0)
        ok = httpx.post(u + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=TIMEOUT)
        assert ok.status_code == 200
    finally:
        s.stop()


def test_api_key(model: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    s = Server(model, ["-np", "1", "-c", "128", "--api-key-file", str(key_file)], tmp_path / "server.log")
    try:
        u = s.url
        assert httpx.get(u + "/health", timeout=TIMEOUT).status_code == 200  # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(u + "/v1/models", headers=headers, timeout=TIMEOUT)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        bad = openai.OpenAI(base_url=u + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=u + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == model.name
        r = good.completions.create(model="x", prompt=PROMPT, max_tokens=2)
        assert r.usage.completion_tokens <= 2
    finally:
        s.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_ends_streams_and_exits(model: Path, tmp_path: Path, sig: int) -> None:
    s = Server(model, ["-np", "1", "-c", str(SLOT), "-ub", "64", "-t", "1"], tmp_path / "server.log")
    try:
        body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT) as resp:
            lines = resp.iter_lines()
            next(lines)
            s.proc.send_signal(sig)
            t0 = time.monotonic()
            n = 0
            try:
                for _ in lines:  # the stream ends (closed by the server) instead of running to 1000
                    n += 1
            except httpx.HTTPError:
                pass
        assert s.proc.wait(20) == 0
        assert time.monotonic() - t0 < 20
        assert n < LONG
        assert "srv shutdown: done" in s.text()
        # refuses new connections once gone
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health", timeout=2)
    finally:
        s.stop()


def test_health_is_503_while_loading() -> None:
    from llamapy.server.app import ServerState, create_app

    state = ServerState(model_name="m")
    transport = httpx.ASGITransport(app=create_app(state))

    async def go() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            h = await c.get("/health")
            m = await c.post("/v1/completions", json={"prompt": "x"})
            return h.status_code, m.status_code

    import asyncio

    assert asyncio.run(go()) == (503, 503)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--api-key", " "], "--api-key: the key is empty"),
        (["--port", "70000"], "--port 70000"),
        (["-np", "0"], "-np 0"),
        (["--api-key", "a", "--api-key-file", "b"], "not both"),
        (["--pooling", "mean"], "--pooling needs --embeddings"),
        (["--embeddings", "--pooling", "max"], "--pooling max: expected one of"),
        (["--embeddings", "--embd-normalize", "-5"], "--embd-normalize -5"),
        (["--reranking", "--pooling", "mean"], "a reranker pools with rank"),
    ],
)
def test_cli_errors(model: Path, args: list[str], needle: str) -> None:
    r = subprocess.run([sys.executable, "-m", "llamapy", "serve", str(model), *args], cwd=REPO,
                       capture_output=True, timeout=120)  # fmt: skip
    err = r.stderr.decode()
    assert r.returncode == 1 and needle in err and "Traceback" not in err, err


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc for the RSS")
def test_soak_300_requests(server: Server) -> None:
    """300 requests of every kind (streamed, whole, abandoned, refused): RSS stays within 64 MiB
    of where it was after the first 50, and no slot is left busy."""
    u = server.url
    pid = server.proc.pid
    rss_after_warmup = 0
    with httpx.Client(timeout=TIMEOUT) as c:
        for i in range(300):
            kind = i % 4
            if kind == 0:
                r = c.post(u + "/v1/completions", json={"prompt": f"{PROMPT} {i}", "max_tokens": 4})
                assert r.status_code == 200
            elif kind == 1:
                body = {"messages": [{"role": "user", "content": f"n{i}"}], "max_tokens": 4, "stream": True}
                with c.stream("POST", u + "/v1/chat/completions", json=body) as resp:
                    assert sse_events(resp)[-1] == "[DONE]"
            elif kind == 2:
                body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
                with c.stream("POST", u + "/v1/completions", json=body) as resp:
                    lines = resp.iter_lines()
                    next(lines)  # and leave
            else:
                assert c.post(u + "/v1/completions", json={"prompt": PROMPT, "n": 3}).status_code == 400
            if i == 49:
                rss_after_warmup = rss_kib(pid)
    wait_idle(u, 2.0)
    grew = rss_kib(pid) - rss_after_warmup
    assert grew < 64 * 1024, f"RSS grew by {grew} KiB over 250 requests"
    assert all(s["id_task"] == -1 for s in httpx.get(u + "/slots", timeout=TIMEOUT).json())


@pytest.mark.slow
def test_default_model_greedy_matches_run_and_chats(default_model: Path, tmp_path: Path) -> None:
    """SmolLM2: /v1/completions greedy equals `llamapy run`, concurrent requests equal their
    single runs, and a chat through its own template answers in words."""
    prompt = "The capital of France is"
    run = subprocess.run(
        [sys.executable, "-m", "llamapy", "run", str(default_model), "-p", prompt, "-n", "24", "--temp", "0",
         "-c", "512", "--no-warmup"],
        cwd=REPO, capture_output=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()
    # the default 8-bit activations: a token's MUL_MATs and attention give the same bits alone or
    # in any batch, wherever its sequence's cells lie in the cache (kernels_c: lp_gemm_*, ops.c)
    s = Server(default_model, ["-np", "2", "-c", "512"], tmp_path / "server.log", ready_s=600)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600)
        text = c.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        assert run.stdout.decode() == text + ("" if text.endswith("\n") else "\n")
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        # first without the prompt cache (concurrency alone), then with it: a reused slot keeps
        # its cells in position order (KVCache.find_slot), so the text is the same again
        nocache = {"cache_prompt": False}
        alone = c.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0, extra_body=nocache)
        assert alone.choices[0].message.content.strip()
        assert alone.usage.prompt_tokens > 10  # the template's system prompt and markers
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda _: c.chat.completions.create(model="x", messages=msgs, max_tokens=16,
                                                                 temperature=0, extra_body=nocache), range(2))  # fmt: skip
        assert a.choices[0].message.content == b.choices[0].message.content == alone.choices[0].message.content
        with ThreadPoolExecutor(2) as pool:  # both slots now hold this prompt: cache hits
            a, b = pool.map(lambda _: c.chat.completions.create(model="x", messages=msgs, max_tokens=16,
                                                                 temperature=0), range(2))  # fmt: skip
        assert a.choices[0].message.content == b.choices[0].message.content == alone.choices[0].message.content
    finally:
        s.stop()
