"""Load test of `llamapy serve` (llama.cpp's tools/server/bench): concurrent streaming chat requests
against one server with -np slots, compared with the same requests one after another.

    python bench/serve_load.py [--model PATH] [--requests 16] [--np 4] [-n 64] [-c 1024] [-t 0]
                               [--overhead-reps 5] [--rounds 1] [--llama-server [BIN]]

1. The engine alone, in this process (with serve's GOMP_SPINCOUNT): one greedy request of -n
   tokens, timed per token from its first token — the baseline of the server's overhead.
2. A `llamapy serve` subprocess on a free loopback port. Every request alone, one after another
   (streaming, greedy, ignore_eos so each yields exactly -n tokens): the reference texts and the
   sequential wall time. Then --overhead-reps triples, alternately: one request through HTTP/SSE
   (one chunk a token) read by a bare asyncio client, the same read by httpx, and the same
   through the engine alone of (1); the server's overhead per token is the median of the
   differences from the engine alone (one request swings by ~2 ms on 2 cores: the event loop,
   the client and the kernels' threads share them). The bare client takes the least CPU from the
   cores the server needs (httpx's parsing takes ~0.5 ms a chunk), so its figure is the closer
   to the server's own overhead.
3. All requests at once (asyncio + httpx): every text must equal its own sequential one (a
   difference is reported with its index; batched and single decoding may legitimately differ
   where two top logits tie); tokens/s against the sequential run; p50/p99 of time to first token
   and inter-token latency; prompt tokens each phase evaluated (/metrics' prompt_tokens_total:
   what no slot's cache held).
4. With --rounds K > 1, K - 1 more (one after another, all at once) pairs: the speed-up is then the
   median of the K pairs' ratios, with their range (a shared host has slow phases of seconds to
   minutes, which one phase alone can catch).
5. With --llama-server [BIN] (default: the one `python bench/llama_cpp.py build --server` made),
   llama.cpp's own server on the same model, slots, context per slot and threads gets the same
   (one after another, all at once) pairs, each round right after llamapy's: its speed-up, and
   its tokens/s beside llamapy's, on this host, in one run.

Prints a markdown block for bench/RESULTS.md. The default model is SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about rain.", "Count from 1 to 10.",
    "Name three colours.", "What is 2 + 2?", "Describe a cat.", "Say hello in Spanish.",
    "What is Python?", "Give me a recipe for tea.", "Why is the sky blue?", "List four planets.",
    "What is a prime number?", "Tell me a joke.", "How do birds fly?", "What is water made of?",
    "Name a famous painter.",
]  # fmt: skip


@dataclass
class Result:
    text: str = ""
    n_chunks: int = 0
    t_first: float = 0.0  # seconds from sending to the first content chunk
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    wall: float = 0.0
    t0: float = field(default_factory=time.perf_counter)  # when the request was sent
    last: float | None = None  # when the latest content chunk came

    def line(self, line: str, per_token: bool) -> None:
        """One line of the SSE stream: a content chunk is timed and its text kept."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if not chunk.get("choices"):
            return
        choice = chunk["choices"][0]
        piece = choice["delta"].get("content")
        if not piece and not (per_token and choice.get("logprobs")):
            return
        now = time.perf_counter()
        if self.last is None:
            self.t_first = now - self.t0
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.text += piece or ""
        self.n_chunks += 1


def chat_body(question: str, n: int, per_token: bool) -> dict:
    """A streaming greedy chat. per_token: ask for logprobs, so that every token is a chunk (text
    alone may be held back while a character or a possible stop string is incomplete)."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    if per_token:
        body["logprobs"] = True
    return body


async def chat(client: httpx.AsyncClient, url: str, question: str, n: int, per_token: bool = False) -> Result:
    """One streaming chat through httpx (as the tests and most Python clients do)."""
    res = Result()
    async with client.stream("POST", url + "/v1/chat/completions", json=chat_body(question, n, per_token)) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            res.line(line, per_token)
    res.wall = time.perf_counter() - res.t0
    return res


async def chat_bare(url: str, question: str, n: int, per_token: bool = False) -> Result:
    """The same chat over a bare asyncio connection: HTTP/1.1 and chunked framing read by hand.
    On 2 cores the load generator's CPU is taken from the server's decode threads, and httpx's
    parsing costs ~0.5 ms of CPU a chunk there (bench/RESULTS.md, stop 24), several times this
    client's: the server's overhead per token is measured with this one, and with httpx beside."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(chat_body(question, n, per_token)).encode()
    res = Result()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)  # fmt: skip
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        if not head.startswith("HTTP/1.1 200"):
            raise RuntimeError(f"{url}: {head.splitlines()[0]}")
        if "transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"{url}: a stream without chunked framing")
        pending = b""  # bytes of a line not yet ended (a chunk may end anywhere, mid-character too)
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            pending += (await reader.readexactly(size + 2))[:-2]  # (the chunk's own CRLF)
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                res.line(raw.rstrip(b"\r").decode(), per_token)
    finally:
        writer.close()
    res.wall = time.perf_counter() - res.t0
    return res


def start(cmd: list[str], log: Path, url: str | None = None, **popen: Any) -> tuple[subprocess.Popen, str]:
    """Start a server (stderr into `log`) and wait up to 300 s for its /health to answer 200: at
    `url`, or at the address `llamapy serve` logs once it listens (it picks its free port)."""
    fh = open(log, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, **popen)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = None if url else re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        at = url or (m.group(1) if m else "")
        try:
            if at and httpx.get(at + "/health", timeout=5).status_code == 200:
                return proc, at
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{' '.join(cmd[:4])} did not start:\n{log.read_text(errors='replace')[-3000:]}")


def start_server(model: Path, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "llamapy", "serve", str(model), "--port", "0", "-np", str(args.np),
           "-c", str(args.c), "-t", str(args.t), "--queue", str(args.requests), "--metrics"]  # fmt: skip
    return start(cmd, log, cwd=REPO)


def start_llama_server(binary: Path, model: Path, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """llama.cpp's llama-server with llamapy serve's settings: its -c is the total, which it
    divides among the slots, so -c x -np gives each slot the same context."""
    with socket.socket() as s:  # a free loopback port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(args.np),
           "-c", str(args.c * args.np), "-t", str(args.t or os.cpu_count() or 1), "--metrics"]  # fmt: skip
    return start(cmd, log, f"http://127.0.0.1:{port}")


async def one_round(
    client: httpx.AsyncClient, url: str, questions: list[str], n: int
) -> tuple[list[Result], float, list[Result], float]:
    """The requests one after another, then all at once: (texts, wall s) of each."""
    t0 = time.perf_counter()
    seq = [await chat(client, url, q, n) for q in questions]
    t1 = time.perf_counter()
    conc = await asyncio.gather(*(chat(client, url, q, n) for q in questions))
    return seq, t1 - t0, list(conc), time.perf_counter() - t1


class EngineAlone:
    """The engine in this process, no HTTP: one greedy request of -n tokens at a time, timed from
    its first token to its end (seconds per token over n - 1), the baseline of the server's
    overhead per streamed token."""

    def __init__(self, model: Path, args: argparse.Namespace) -> None:
        from llamapy.api import Llama
        from llamapy.engine import Engine, Request
        from llamapy.model.sampler import SamplingParams
        from llamapy.server.protocol import ChatTemplate, chat_prompt

        self.n = args.n
        self.llm = Llama(model, n_ctx=args.c * args.np, n_threads=args.t)
        self.llm.warmup()
        self.eng = Engine(self.llm.ctx, args.np, args.c)
        toks, _ = chat_prompt([{"role": "user", "content": QUESTIONS[0]}], ChatTemplate.of(self.llm.model),
                              self.llm.tokenizer)
        # logprobs as the server's measurement asks for them (one chunk per token)
        self.req = Request(toks, args.n, SamplingParams(temp=0, ignore_eos=True), logprobs=0, cache_prompt=False)
        list(self.eng.generate(self.req))  # graphs built once

    def per_token(self) -> float:
        t_first = t_end = 0.0
        for ev in self.eng.generate(self.req):
            if ev.kind == "token" and ev.index == 0:
                t_first = time.perf_counter()
            t_end = time.perf_counter()
        return (t_end - t_first) / max(1, self.n - 1)

    def close(self) -> None:
        self.llm.close()


async def prompt_tokens(client: httpx.AsyncClient, url: str) -> float:
    """Prompt tokens the server has evaluated so far (not taken from a cache): /metrics."""
    text = (await client.get(url + "/metrics")).text
    return float(re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def latency(results: list[Result]) -> str:
    """p50 / p99 of time to first token and of inter-token latency, in ms."""
    ttft, itl = [r.t_first for r in results], [x for r in results for x in r.itl]
    return f"TTFT ms: p50 {pct(ttft, 50):.1f}, p99 {pct(ttft, 99):.1f}; ITL ms: p50 {pct(itl, 50):.1f}, p99 {pct(itl, 99):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("-c", type=int, default=1024, help="context per slot")
    ap.add_argument("-t", type=int, default=0, help="threads (0: all cores)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="(one after another, concurrent) pairs; the speed-up is their ratios' median")
    ap.add_argument("--overhead-reps", type=int, default=5,
                    help="triples (one request through the server by each client, the same through the engine alone)")
    ap.add_argument("--llama-server", nargs="?", const="", default=None, metavar="BIN",
                    help="also llama.cpp's llama-server (default BIN: bench/llama_cpp.py build --server's)")
    args = ap.parse_args()
    ref_bin = None
    if args.llama_server is not None:
        from llama_cpp import find_server

        ref_bin = Path(args.llama_server) if args.llama_server else find_server()
        if ref_bin is None:
            raise SystemExit("llama-server is not built: run `python bench/llama_cpp.py build --server`")
    if args.model is None:
        from llamapy.model.fetch import default_model_path

        args.model = default_model_path()
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})") for i in range(args.requests)]

    # the engine alone runs as the server does: with serve's spin of the kernels' threads between
    # steps (cli/serve.py; read when the kernels load, here and in the server child)
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000000")
    alone = EngineAlone(args.model, args)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load.{os.getpid()}.log"
    proc, url = start_server(args.model, args, log)
    ref = start_llama_server(ref_bin, args.model, args, log.with_suffix(".llama-server.log")) if ref_bin else None
    try:

        async def run() -> tuple[list[Result], float, list[tuple[float, float, float]], list[Result], float]:
            limits = httpx.Limits(max_connections=args.requests + 4)
            # llama-server (cpp-httplib) closes a kept-alive connection after a few requests, which
            # httpx would then reuse and fail on: a fresh connection for each of its requests
            once = httpx.Limits(max_connections=args.requests + 4, max_keepalive_connections=0)
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client,
                httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=once) as ref_client,
            ):
                await chat(client, url, "warm up", 4)
                if ref:
                    await chat(ref_client, ref[1], "warm up", 4)
                p0 = await prompt_tokens(client, url)
                t0 = time.perf_counter()
                seq = [await chat(client, url, q, args.n) for q in questions]
                t_seq = time.perf_counter() - t0
                p1 = await prompt_tokens(client, url)
                # (server with the bare client, with httpx, engine alone) seconds per token,
                # alternately: the same request, the cores otherwise idle for each (the server
                # waits while this process decodes)
                triples = []
                for _ in range(args.overhead_reps):
                    bare = await chat_bare(url, questions[0], args.n, per_token=True)
                    via = await chat(client, url, questions[0], args.n, per_token=True)
                    per_tok = [(r.wall - r.t_first) / max(1, args.n - 1) for r in (bare, via)]
                    triples.append((per_tok[0], per_tok[1], alone.per_token()))
                p2 = await prompt_tokens(client, url)
                t0 = time.perf_counter()
                conc = await asyncio.gather(*(chat(client, url, q, args.n) for q in questions))
                t_conc = time.perf_counter() - t0
                evaluated.extend([p1 - p0, await prompt_tokens(client, url) - p2])
                rounds.append((t_seq, t_conc))
                for k in range(args.rounds):
                    if ref:  # llama-server's round k, right after llamapy's
                        r_seq, a, r_conc, b = await one_round(ref_client, ref[1], questions, args.n)
                        ref_rounds.append((a, b))
                        if not ref_conc:  # round 1's, for TTFT and ITL
                            ref_conc.extend(r_conc)
                        ref_differ.update(i for i, (x, y) in enumerate(zip(r_seq, r_conc)) if x.text != y.text)
                    if k < args.rounds - 1:
                        again, a, more, b = await one_round(client, url, questions, args.n)
                        rounds.append((a, b))
                        later.extend(i for i, r in enumerate(again + more) if r.text != seq[i % len(seq)].text)
                return seq, t_seq, triples, list(conc), t_conc

        evaluated: list[float] = []
        rounds: list[tuple[float, float]] = []  # (one after another, concurrent) wall seconds
        later: list[int] = []  # requests of the later rounds whose text differs from round 1's
        ref_rounds: list[tuple[float, float]] = []  # llama-server's
        ref_differ: set[int] = set()  # requests whose concurrent text differs from the sequential one there
        ref_conc: list[Result] = []
        seq, t_seq, triples, conc, t_conc = asyncio.run(run())
        slots = httpx.get(url + "/slots", timeout=10).json()
    finally:
        for p in (proc, ref[0]) if ref else (proc,):
            p.terminate()
            p.wait(30)
        alone.close()
    n_tok = args.n * args.requests
    mismatches = [i for i, (a, b) in enumerate(zip(seq, conc)) if a.text != b.text]
    lost = [i for i, r in enumerate(conc) if not r.text]
    # from the first content chunk to the end of the stream, as for the engine alone
    bare_ms, httpx_ms, engine_ms = (np.array(x) * 1e3 for x in zip(*triples))
    over, over_httpx = bare_ms - engine_ms, httpx_ms - engine_ms
    print(f"## serve_load: {args.requests} streaming chats, -np {args.np}, -n {args.n}, -c {args.c} per slot, model {args.model.name}")
    print()
    print("| | wall s | tokens/s |")
    print("|---|---:|---:|")
    print(f"| one after another | {t_seq:.2f} | {n_tok / t_seq:.1f} |")
    print(f"| concurrent | {t_conc:.2f} | {n_tok / t_conc:.1f} |")
    print()
    ratios = sorted(a / b for a, b in rounds)
    if len(rounds) > 1:
        print(f"- speed-up: {float(np.median(ratios)):.2f}x, the median of {len(rounds)} rounds (range "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f}; walls one after another / concurrent: "
              f"{', '.join(f'{a:.2f}/{b:.2f}' for a, b in rounds)} s); the table: round 1; later rounds' texts "
              f"that differ from round 1's: {later or 'none'}")  # fmt: skip
    else:
        print(f"- speed-up: {t_seq / t_conc:.2f}x")
    print(f"- completed: {sum(1 for r in conc if r.text)}/{len(conc)}; lost: {lost or 'none'}; "
          f"differ from their single-request output: {mismatches or 'none'}")  # fmt: skip
    print(f"- concurrent {latency(conc)}")
    print(f"- per token, one request ({len(triples)} triples, medians): engine alone {np.median(engine_ms):.2f} ms, "
          f"through HTTP/SSE {np.median(bare_ms):.2f} ms (bare asyncio client) / {np.median(httpx_ms):.2f} ms (httpx); "
          f"server overhead {np.median(over):+.2f} ms/token (each: {', '.join(f'{o:+.2f}' for o in over)}), "
          f"with httpx's parsing on the same cores {np.median(over_httpx):+.2f}")  # fmt: skip
    print(f"- prompt tokens evaluated: one after another {evaluated[0]:.0f}, concurrent {evaluated[1]:.0f}")
    print(f"- slots busy afterwards: {sum(1 for s in slots if s['is_processing'])}")
    if ref_rounds:
        ref_ratios = sorted(a / b for a, b in ref_rounds)
        mine = float(np.median([n_tok / b for _, b in rounds]))
        theirs = float(np.median([n_tok / b for _, b in ref_rounds]))
        print(f"- llama-server ({ref_bin}, the same slots, context and threads; each round after llamapy's): "
              f"speed-up {float(np.median(ref_ratios)):.2f}x (range {ref_ratios[0]:.2f}-{ref_ratios[-1]:.2f}; walls "
              f"{', '.join(f'{a:.2f}/{b:.2f}' for a, b in ref_rounds)} s); concurrent tokens/s, medians: "
              f"llamapy {mine:.1f}, llama-server {theirs:.1f} ({mine / theirs:.2f}x); its concurrent texts that "
              f"differ from its own one-after-another ones: {sorted(ref_differ) or 'none'}; its concurrent "
              f"{latency(ref_conc)} (round 1)")  # fmt: skip


if __name__ == "__main__":
    main()
