"""`llamapy run` (llama-cli / llama-completion) and `llamapy tokenize` (llama-tokenize)."""

from __future__ import annotations

import codecs
import signal
import sys
import time
from pathlib import Path

import typer

from ..types import LlamapyError
from . import app, common, log


def read_text_file(path: str, what: str = "-f") -> str:
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise LlamapyError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise LlamapyError(f"{what} {path}: is a directory") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LlamapyError(f"{what} {path}: not valid UTF-8 (byte {e.start})") from None


def _prompt_text(prompt: str | None, file: str | None, escape: bool) -> str | None:
    if prompt is not None and file is not None:
        raise LlamapyError("give the prompt with -p or -f, not both")
    text = read_text_file(file) if file is not None else prompt
    if text is not None and escape:
        text = codecs.decode(text.encode("utf-8").decode("latin-1"), "unicode_escape").encode("latin-1").decode("utf-8")
    return text


@app.command()
def run(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    prompt: str = typer.Option(None, "-p", "--prompt", help="the prompt"),
    file: str = typer.Option(None, "-f", "--file", help="read the prompt from a file"),
    n_predict: int = typer.Option(-1, "-n", "--n-predict", help="tokens to generate (-1 until end, -2 until the context is full)"),
    ctx_size: int = common.CTX,
    batch: int = common.BATCH,
    ubatch: int = common.UBATCH,
    threads: int = common.THREADS,
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed (-1: random)"),
    escape: bool = typer.Option(False, "-e", "--escape", help="process escapes (\\n, \\t, …) in the prompt"),
    temp: float = common.TEMP,
    top_k: int = common.TOP_K,
    top_p: float = common.TOP_P,
    min_p: float = common.MIN_P,
    repeat_penalty: float = common.REPEAT_PENALTY,
    repeat_last_n: int = common.REPEAT_LAST_N,
    presence_penalty: float = common.PRESENCE_PENALTY,
    frequency_penalty: float = common.FREQUENCY_PENALTY,
    ignore_eos: bool = common.IGNORE_EOS,
    conversation: bool = typer.Option(False, "-cnv/-no-cnv", "--conversation/--no-conversation", help="chat: read turns from stdin"),
    system_prompt: str = typer.Option(None, "-sys", "--system-prompt", help="system message in conversation mode"),
    ngl: str = common.NGL,
    ot: list[str] = common.OT,
    ts: str = common.TS,
    mg: int = common.MG,
    ctk: str = common.CTK,
    ctv: str = common.CTV,
    nkvo: bool = common.NKVO,
    no_op_offload: bool = common.NO_OP_OFFLOAD,
    f32_activations: bool = common.F32_ACT,
    device: str = common.DEVICE,
    no_warmup: bool = typer.Option(False, "--no-warmup", help="skip the warm-up run before the prompt"),
) -> None:
    """Generate text from a prompt, streaming it to stdout (llama-completion)."""
    from ..generate import GenerationResult, check_n_predict, stream
    from ..model.sampler import SamplingParams

    check_n_predict(n_predict)
    text = _prompt_text(prompt, file, escape)
    if text is None and not conversation:
        raise LlamapyError("no prompt: give -p PROMPT, -f FILE or -cnv")
    if file is not None and text == "":
        raise LlamapyError(f"-f {file}: the file is empty")
    sampling = SamplingParams(
        temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed, ignore_eos=ignore_eos,
    )  # fmt: skip
    llm = common.load(model, model_opt, ngl, ot, ts, mg, ctx_size, batch, ubatch, threads, ctk, ctv, nkvo, no_op_offload, device,
                      f32_activations=f32_activations)
    if not no_warmup:
        # reported apart from the load time: it is mostly loading the compiled kernels
        log(f"common_init: warm-up run (compiled-kernel load) = {llm.warmup():.2f} ms")
    if conversation:
        _conversation(llm, text, system_prompt, n_predict, sampling)
        return
    tokens = llm.tokenize(text or "")
    if len(tokens) > llm.ctx.n_ctx:
        raise LlamapyError(f"the prompt is {len(tokens)} tokens, longer than the context (-c {llm.ctx.n_ctx})")
    res = GenerationResult()
    t0 = time.perf_counter()
    interrupted = False
    try:
        for chunk in stream(llm.ctx, tokens, n_predict, sampling, res):
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    sys.stdout.write("\n") if res.text and not res.text.endswith("\n") else None
    sys.stdout.flush()
    if res.finish_reason == "context":
        log("context full: generation stopped (raise -c to generate more)")
    log()
    common.log_timings(llm, res.timings, (time.perf_counter() - t0) * 1e3 + res.timings.load_ms)
    if interrupted:
        log("interrupted")
        raise SystemExit(130)


def _conversation(llm, system_prompt_text, system_prompt, n_predict, sampling) -> None:  # noqa: ANN001
    """Conversation mode: the GGUF's chat template, rendered in a sandbox, turn by turn."""
    from ..generate import GenerationResult, stream
    from ..model.chat import render_chat, template_or_default

    md = llm.model.gguf.metadata
    template = template_or_default(md.get("tokenizer.chat_template"))
    tok = llm.tokenizer
    bos = tok.token_text(tok.bos) if tok.bos is not None else ""
    eos = tok.token_text(tok.eos) if tok.eos is not None else ""
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    cached: list[int] = []
    first = system_prompt_text  # -p in conversation mode is the first user turn
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        if first is not None:
            user, first = first, None
        else:
            sys.stderr.write("\n> ")
            sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:
                break
            user = line.rstrip("\n")
            if not user.strip():
                continue
        messages.append({"role": "user", "content": user})
        text = render_chat(template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
        tokens = tok.encode(text, add_special=False, parse_special=True)
        if len(tokens) >= llm.ctx.n_ctx:
            raise LlamapyError(f"the conversation is {len(tokens)} tokens, longer than the context (-c {llm.ctx.n_ctx})")
        res = GenerationResult()
        try:
            for chunk in stream(llm.ctx, tokens, n_predict, sampling, res, cached=cached):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            raise
        sys.stdout.write("\n")
        sys.stdout.flush()
        cached = tokens + res.tokens
        messages.append({"role": "assistant", "content": res.text})


@app.command()
def tokenize(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    prompt: str = typer.Option(None, "-p", "--prompt"),
    file: str = typer.Option(None, "-f", "--file"),
    ids: bool = typer.Option(False, "--ids", help="print only the ids, as a Python list"),
    no_bos: bool = typer.Option(False, "--no-bos", help="do not add BOS even if the model does"),
    no_parse_special: bool = typer.Option(False, "--no-parse-special", help="treat special-token text as text"),
    escape: bool = typer.Option(False, "-e", "--escape"),
) -> None:
    """Print the tokens of a text as llama-tokenize does: `id -> 'piece'` per line, or --ids."""
    from ..model.gguf import GGUFFile
    from ..model.tokenizer import Tokenizer

    text = _prompt_text(prompt, file, escape)
    if text is None:
        raise LlamapyError("no text: give -p TEXT or -f FILE")
    path = common.resolve_model(model, model_opt)
    # vocabulary-only files of any architecture work: no weights are touched
    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    add_special = not no_bos
    toks = tok.encode(text, add_special=add_special, parse_special=not no_parse_special)
    if no_bos and tok.add_bos and toks and toks[0] == tok.bos:
        toks = toks[1:]
    out = sys.stdout
    if ids:
        out.write("[" + ", ".join(str(t) for t in toks) + "]\n")
    else:
        for t in toks:
            piece = tok.token_to_piece(t, special=True).decode("utf-8", errors="replace")
            out.write(f"{t:6d} -> '{piece}'\n")
    out.flush()
