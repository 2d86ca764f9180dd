"""`llamapy run` (llama-cli / llama-completion) and `llamapy tokenize` (llama-tokenize)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer

from ..model.sampler import LLAMA_DEFAULT_SEED
from ..types import LlamapyError
from . import app, common, log, set_logging


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
        text = common.process_escapes(text)
    return text


def _random_seed() -> int:
    """A seed drawn here rather than in the sampler, so that `sampler seed: N` can be logged and
    the run repeated with `-s N` (0xFFFFFFFF is llama.h's "random" and never drawn)."""
    while True:
        # os.urandom, as secrets.randbits reads it: importing secrets (hmac) would map OpenSSL's
        # libcrypto, 3.4 MiB of RSS
        seed = int.from_bytes(os.urandom(4), "little")
        if seed != LLAMA_DEFAULT_SEED:
            return seed


class _ReversePrompts:
    """-r: stop when the output contains one of the texts (llama.cpp's antiprompts), also when
    one straddles two tokens."""

    def __init__(self, texts: list[str] | None) -> None:
        self.texts = [t for t in (texts or []) if t]
        self._tail = ""
        self._keep = max((len(t) for t in self.texts), default=1) - 1

    def hit(self, new_text: str) -> bool:
        if not self.texts:
            return False
        window = self._tail + new_text
        self._tail = window[-self._keep :] if self._keep else ""
        return any(t in window for t in self.texts)


@dataclass
class _ChatFlags:
    """llama.cpp's reasoning flags (common/arg.cpp: --reasoning-format, -rea, --reasoning-budget,
    --chat-template-kwargs), checked on their own; the template's checks wait for the model."""

    raw: bool = False  # --reasoning-format none: each reply shown as generated
    kwargs: dict[str, Any] = field(default_factory=dict)  # the render's extra variables
    thinking: bool | None = None  # enable_thinking, as -rea or --reasoning-budget 0 asks
    thinking_flag: str = ""
    given: list[str] = field(default_factory=list)  # flags that only a chat template can honour

    @classmethod
    def parse(cls, fmt: str | None, reasoning: str | None, budget: int, kwargs_json: str | None) -> _ChatFlags:
        f = cls(raw=fmt == "none")
        if fmt == "deepseek-legacy":  # <think> kept in the content and also shown apart: refused
            raise LlamapyError("--reasoning-format deepseek-legacy is not supported: use deepseek (reasoning apart) or none (raw)")
        if fmt not in (None, "auto", "deepseek", "none"):
            raise LlamapyError(f"--reasoning-format {fmt}: expected auto, deepseek or none")
        if fmt == "deepseek":
            f.given.append("--reasoning-format deepseek")
        if reasoning not in (None, "on", "off", "auto"):
            raise LlamapyError(f"-rea {reasoning}: expected on, off or auto")
        if budget < -1 or budget > 0:  # llama.cpp's budget sampler (end </think> after N tokens) is not there
            raise LlamapyError(f"--reasoning-budget {budget}: llamapy takes -1 (unrestricted) or 0 (thinking off), "
                               "not a budget of tokens")  # fmt: skip
        if kwargs_json is not None:
            try:
                f.kwargs = json.loads(kwargs_json)
            except json.JSONDecodeError as e:
                raise LlamapyError(f"--chat-template-kwargs: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(f.kwargs, dict):
                raise LlamapyError("--chat-template-kwargs: expected a JSON object, e.g. '{\"enable_thinking\": false}'")
            f.given.append("--chat-template-kwargs")
        # -rea on|off and --reasoning-budget 0 set the template's enable_thinking, as llama-server does
        for flag, v in ((f"-rea {reasoning}", {"on": True, "off": False}.get(reasoning or "")),
                        ("--reasoning-budget 0", False if budget == 0 else None)):  # fmt: skip
            if v is not None and f.thinking is not None and v != f.thinking:
                raise LlamapyError(f"{f.thinking_flag} and {flag} disagree on thinking")
            if v is not None:
                f.thinking, f.thinking_flag = v, flag
        if f.thinking is not None:
            if f.kwargs.get("enable_thinking", f.thinking) != f.thinking:
                raise LlamapyError(f"{f.thinking_flag} and --chat-template-kwargs disagree on enable_thinking")
            f.given.append(f.thinking_flag)
        return f

    def variables(self, source: str) -> dict[str, Any]:
        """The render's variables, each checked as the server checks chat_template_kwargs (a
        variable the template never names would be ignored: refused)."""
        from ..server.protocol import ApiError, template_kwargs

        try:
            kw = template_kwargs({"chat_template_kwargs": self.kwargs}, source)
        except ApiError as e:
            raise LlamapyError(f"--chat-template-kwargs: {e.message.removeprefix('chat_template_kwargs: ')}") from None
        if self.thinking is not None:
            try:
                template_kwargs({"chat_template_kwargs": {"enable_thinking": self.thinking}}, source)
            except ApiError:
                raise LlamapyError(f"{self.thinking_flag}: this model's chat template has no switch to turn thinking "
                                   f"{'on' if self.thinking else 'off'} (it never names enable_thinking)") from None  # fmt: skip
            kw["enable_thinking"] = self.thinking
        return kw


class _ReplyView:
    """One answer on the terminal, as llama-cli shows it (tools/cli/cli.cpp): the content flushed
    as it comes, the reasoning between `[Start thinking]` and `[End thinking]` — here on stderr
    (gray when stderr is a terminal, llama.cpp's reasoning colour), so that `run > answers.txt`
    keeps the answers alone. `raw` (--reasoning-format none): the text as generated, on stdout."""

    GRAY, RESET = "\x1b[90m", "\x1b[0m"

    def __init__(self, raw: bool) -> None:
        self.raw = raw
        self.color = sys.stderr.isatty()
        self.thinking = False

    def show(self, deltas: list[dict[str, Any]], text: str) -> None:
        if self.raw:
            deltas = [{"content": text}]
        for d in deltas:
            if d.get("reasoning_content"):
                if not self.thinking:
                    sys.stderr.write((self.GRAY if self.color else "") + "[Start thinking]\n")
                    self.thinking = True
                sys.stderr.write(d["reasoning_content"])
                sys.stderr.flush()
            if d.get("content"):
                self.end()
                sys.stdout.write(d["content"])
                sys.stdout.flush()

    def end(self) -> None:
        if self.thinking:
            sys.stderr.write("\n[End thinking]\n\n" + (self.RESET if self.color else ""))
            sys.stderr.flush()
            self.thinking = False


def _log_prompt(tok: Any, text: str, tokens: list[int]) -> None:
    """--verbose-prompt: the prompt and its tokens, as llama-completion prints them."""
    log(f"run: prompt: '{text}'")
    log(f"run: number of tokens in prompt = {len(tokens)}")
    for t in tokens:
        log(f"{t:6d} -> '{tok.token_to_piece(t, special=True).decode('utf-8', errors='replace')}'")


@app.command(short_help="generate text, or chat (llama-completion)")
def run(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    prompt: str = typer.Option(None, "-p", "--prompt", metavar="TEXT", help="the prompt (conversation mode: the first user turn)"),
    file: str = typer.Option(None, "-f", "--file", metavar="FILE", help="read the prompt from a file"),
    n_predict: int = typer.Option(
        -1, "-n", "--n-predict", "--predict", help="tokens to generate (-1: until end, -2: until the context is full)"
    ),
    ctx_size: int = common.CTX,
    batch: int = common.BATCH,
    ubatch: int = common.UBATCH,
    threads: int = common.THREADS,
    threads_batch: int = common.THREADS_BATCH,
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed (-1: random, logged as `sampler seed: N`)"),
    escape: bool = common.ESCAPE,
    temp: float = common.TEMP,
    top_k: int = common.TOP_K,
    top_p: float = common.TOP_P,
    min_p: float = common.MIN_P,
    repeat_penalty: float = common.REPEAT_PENALTY,
    repeat_last_n: int = common.REPEAT_LAST_N,
    presence_penalty: float = common.PRESENCE_PENALTY,
    frequency_penalty: float = common.FREQUENCY_PENALTY,
    ignore_eos: bool = common.IGNORE_EOS,
    typical: float = common.TYPICAL,
    logit_bias: list[str] = common.LOGIT_BIAS,
    top_nsigma: float = common.TOP_NSIGMA,
    xtc_probability: float = common.XTC_P,
    xtc_threshold: float = common.XTC_T,
    mirostat: int = common.MIROSTAT,
    mirostat_lr: float = common.MIROSTAT_LR,
    mirostat_ent: float = common.MIROSTAT_ENT,
    grammar: str = common.GRAMMAR,
    grammar_file: str = common.GRAMMAR_FILE,
    json_schema: str = common.JSON_SCHEMA,
    json_schema_file: str = common.JSON_SCHEMA_FILE,
    reverse_prompt: list[str] = typer.Option(
        None, "-r", "--reverse-prompt", metavar="TEXT", help="stop generating at this text (conversation: end the answer); repeatable"
    ),
    conversation: Optional[bool] = typer.Option(  # noqa: UP007 - typer reads the annotation
        None, "-cnv/-no-cnv", "--conversation/--no-conversation",
        help="chat: read turns from the terminal (default: on when the model has a chat template and no -p/-f)",
        show_default=False,
    ),  # fmt: skip
    single_turn: bool = typer.Option(False, "-st", "--single-turn", help="conversation mode: answer one turn, then exit"),
    system_prompt: str = typer.Option(None, "-sys", "--system-prompt", metavar="TEXT", help="system message in conversation mode"),
    special: bool = typer.Option(False, "-sp", "--special", help="print special tokens (<|im_end|>, …) in the output"),
    jinja: bool = typer.Option(
        False, "--jinja", help="chat templates are always rendered with jinja2 (sandboxed): accepted, no effect"
    ),
    reasoning_format: str = typer.Option(
        None, "--reasoning-format", metavar="FORMAT",
        help="conversation: auto or deepseek (the reply read as the server reads it: reasoning on stderr, the answer on stdout) or none (raw)",
    ),  # fmt: skip
    reasoning: str = typer.Option(None, "-rea", "--reasoning", metavar="on|off|auto", help="conversation: thinking on or off (the template's enable_thinking)"),
    reasoning_budget: int = typer.Option(-1, "--reasoning-budget", metavar="N", help="-1: unrestricted; 0: thinking off (the template's enable_thinking)"),
    chat_template_kwargs: str = typer.Option(
        None, "--chat-template-kwargs", metavar="JSON", help="conversation: extra variables of the chat template, a JSON object"
    ),
    verbose_prompt: bool = typer.Option(False, "--verbose-prompt", help="print each prompt and its tokens on stderr before generating"),
    ngl: str = common.NGL,
    ot: list[str] = common.OT,
    cpu_moe: bool = common.CPU_MOE,
    n_cpu_moe: int = common.N_CPU_MOE,
    lora: list[str] = common.LORA,
    lora_scaled: list[str] = common.LORA_SCALED,
    control_vector: list[str] = common.CVEC,
    control_vector_scaled: list[str] = common.CVEC_SCALED,
    control_vector_layer_range: tuple[int, int] = common.CVEC_RANGE,
    model_draft: str = common.MODEL_DRAFT,
    spec_type: str = common.SPEC_TYPE,
    spec_n_max: int = common.SPEC_N_MAX,
    spec_n_min: int = common.SPEC_N_MIN,
    spec_p_min: float = common.SPEC_P_MIN,
    ngld: str = common.NGLD,
    spec_ngram_n: int = common.SPEC_NGRAM_N,
    spec_ngram_m: int = common.SPEC_NGRAM_M,
    ts: str = common.TS,
    mg: int = common.MG,
    ctk: str = common.CTK,
    ctv: str = common.CTV,
    nkvo: bool = common.NKVO,
    no_op_offload: bool = common.NO_OP_OFFLOAD,
    f32_activations: bool = common.F32_ACT,
    device: str = common.DEVICE,
    ray: str = common.RAY,
    flash_attn: str = common.FLASH_ATTN,
    no_mmap: bool = common.NO_MMAP,
    no_warmup: bool = typer.Option(False, "--no-warmup", help="skip the warm-up run before the prompt"),
    log_disable: bool = common.LOG_DISABLE,
) -> None:
    """Generate text from a prompt, streaming it to stdout (llama-completion)."""
    common.use_ray(ray)
    from ..generate import GenerationResult, check_n_predict, stream
    from ..model.sampler import SamplingParams

    set_logging(not log_disable)
    # as llama-completion's sigaction: Ctrl-C works even where SIGINT was inherited ignored (a
    # background job of a script)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    common.no_effect(flash_attn, threads_batch, no_mmap)
    check_n_predict(n_predict)
    text = _prompt_text(prompt, file, escape)
    if text is None and conversation is False:
        raise LlamapyError("no prompt: give -p PROMPT or -f FILE (-no-cnv turns conversation mode off)")
    if file is not None and text == "":
        raise LlamapyError(f"-f {file}: the file is empty")
    spec = common.constraint(grammar, grammar_file, json_schema, json_schema_file)
    spec_p = common.spec_params(model_draft, spec_type, spec_n_max, spec_n_min, spec_p_min, spec_ngram_n, spec_ngram_m)
    chat = _ChatFlags.parse(reasoning_format, reasoning, reasoning_budget, chat_template_kwargs)
    if chat.given and (conversation is False or conversation is None and text is not None):
        raise LlamapyError(f"{chat.given[0]}: only conversation mode (-cnv) renders a chat template; -p alone is a raw completion")
    if seed < 0 or seed == LLAMA_DEFAULT_SEED:
        seed = _random_seed()
    sampling = SamplingParams(
        temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed, ignore_eos=ignore_eos,
        **common.sampler_extras(typical, logit_bias, top_nsigma, xtc_probability, xtc_threshold, mirostat, mirostat_lr, mirostat_ent),
    )  # fmt: skip
    llm = common.load(model, model_opt, ngl, common.with_expert_overrides(ot, cpu_moe, n_cpu_moe), ts, mg, ctx_size, batch, ubatch, threads, ctk, ctv, nkvo, no_op_offload, device,
                      f32_activations=f32_activations, extra=common.adapters(lora, lora_scaled, control_vector, control_vector_scaled, control_vector_layer_range))
    common.speculative(llm, spec_p, model_draft, ngld, ngl)
    if spec is not None:
        from ..model.constrain import compile_constraint

        compile_constraint(spec, llm.tokenizer)  # an invalid grammar is one error line, before any output
    has_template = bool(llm.model.gguf.metadata.get("tokenizer.chat_template"))
    if conversation is None:
        # llama-completion: a chat template and no prompt turn conversation mode on
        conversation = has_template and text is None
        if conversation:
            log("run: chat template is available, enabling conversation mode (disable it with -no-cnv)")
    if text is None and not conversation:
        raise LlamapyError("no prompt: give -p PROMPT, -f FILE or -cnv")
    if conversation and not has_template:
        log("run: the model has no chat template: using chatml, which may not suit it")
    if not no_warmup:
        # reported apart from the load time: it is mostly loading the compiled kernels
        log(f"common_init: warm-up run (compiled-kernel load) = {llm.warmup():.2f} ms")
    log(f"sampler seed: {seed}")
    stops = _ReversePrompts(reverse_prompt)
    for r in stops.texts:
        log(f"run: reverse prompt: '{r}'")
    if conversation:
        _conversation(llm, text, system_prompt, n_predict, sampling, escape, special, reverse_prompt, single_turn, spec,
                      chat, verbose_prompt)  # fmt: skip
        return
    assert text is not None
    tokens = llm.tokenize(text)
    if verbose_prompt:
        _log_prompt(llm.tokenizer, text, tokens)
    if len(tokens) > llm.ctx.n_ctx:
        raise LlamapyError(f"the prompt is {len(tokens)} tokens, longer than the context (-c {llm.ctx.n_ctx})")
    res = GenerationResult()
    t0 = time.perf_counter()
    interrupted = False
    gen = stream(llm.ctx, tokens, n_predict, sampling, res, special=special, constraint=spec, draft=llm.draft)
    try:
        for chunk in gen:
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if stops.hit(chunk.text):
                    break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        gen.close()
    sys.stdout.write("\n") if res.text and not res.text.endswith("\n") else None
    sys.stdout.flush()
    if res.finish_reason == "stop":
        log("[end of text]")  # llama-completion's words when the model ends its text
    elif res.finish_reason == "context":
        log("context full: generation stopped (raise -c to generate more)")
    log()
    common.log_timings(llm, res.timings, (time.perf_counter() - t0) * 1e3 + res.timings.load_ms)
    common.log_draft(res.timings)
    if interrupted:
        log("interrupted")
        raise SystemExit(130)
    if res.finish_reason == "grammar_dead_end":  # the output is incomplete: a failure for scripts
        raise LlamapyError(res.error)


class _Terminal:
    """Where conversation mode reads turns and writes its `> ` prompt: readline (line editing,
    history) when stdin and stdout are terminals; the prompt on stdout only when that is a
    terminal, so that piped output carries the answers alone."""

    def __init__(self) -> None:
        self.tty_in = sys.stdin.isatty()
        self.tty_out = sys.stdout.isatty()
        if self.tty_in and self.tty_out:
            try:
                import readline  # noqa: F401 - makes input() edit lines and keep a history
            except ImportError:  # a Python built without it: plain input()
                pass

    def read(self) -> str | None:
        """The next turn; None at the end of the session (Ctrl-D, end of input, /exit).
        Ctrl-C at the prompt raises KeyboardInterrupt (the session ends with status 130)."""
        while True:
            try:
                if self.tty_in and self.tty_out:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    line = input("> ")
                else:
                    out = sys.stdout if self.tty_out else sys.stderr
                    out.write("\n> ")
                    out.flush()
                    line = sys.stdin.readline()
                    if not line:
                        raise EOFError
                    line = line.rstrip("\n")
            except EOFError:
                log("")
                return None
            except KeyboardInterrupt:  # as llama-completion: Ctrl-C at the prompt leaves
                sys.stdout.write("\n")
                sys.stdout.flush()
                raise
            if line.strip() == "/exit":
                return None
            if line.strip():
                return line


def _conversation(
    llm: Any,
    first: str | None,
    system_prompt: str | None,
    n_predict: int,
    sampling: Any,
    escape: bool,
    special: bool,
    reverse_prompt: list[str] | None,
    single_turn: bool,
    spec: Any = None,
    chat: _ChatFlags | None = None,
    verbose_prompt: bool = False,
) -> None:
    """Conversation mode: the GGUF's chat template, rendered in a sandbox, turn by turn.

    Each turn's prompt is the server's (`chat_prompt`: the same messages render the same tokens),
    and each reply is read with the server's parser (`ReplyStream`) as it streams: the answer goes
    to stdout, the reasoning (`<think>`, gpt-oss's analysis channel) to stderr, and the history
    keeps the parsed message (content, reasoning_content), as an API client sends it back.
    `--reasoning-format none` shows the reply as generated; the history still keeps the parsed
    message (llama-completion keeps the raw text, which gpt-oss's template refuses at turn 2).

    As llama-completion: Ctrl-C while the model answers ends the answer and gives the prompt back
    (a second one exits); Ctrl-C at an empty prompt, Ctrl-D or `/exit` end the session."""
    from ..generate import GenerationResult, stream
    from ..model import toolcalls as tc
    from ..server.protocol import ChatTemplate, chat_prompt

    chat = chat or _ChatFlags()
    template = ChatTemplate.of(llm.model)
    variables = chat.variables(template.source)
    fmt = tc.detect_format(template.source, with_tools=False)
    tok = llm.tokenizer
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    cached: list[int] = []
    term = _Terminal()
    turns = 0
    while True:
        if first is not None:  # -p in conversation mode is the first user turn
            user, first = first, None
        else:
            if single_turn and turns:
                break
            line = term.read()
            if line is None:
                break
            user = common.process_escapes(line) if escape else line
        turns += 1
        # from here until the answer is complete, Ctrl-C asks the answer to stop
        stop_requests = [0]

        def on_sigint(signum: int, frame: Any) -> None:
            stop_requests[0] += 1
            if stop_requests[0] > 1:  # a second Ctrl-C while the answer winds down: leave
                raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)
        res = GenerationResult()
        try:
            messages.append({"role": "user", "content": user})
            tokens, text = chat_prompt(messages, template, tok, **variables)
            if len(tokens) >= llm.ctx.n_ctx:
                raise LlamapyError(
                    f"the conversation is {len(tokens)} tokens, longer than the context (-c {llm.ctx.n_ctx})"
                )
            if verbose_prompt:
                _log_prompt(tok, text, tokens)
            reply, view = tc.ReplyStream(tc.Syntax.of_reply(fmt, template.source, text)), _ReplyView(chat.raw)
            stops = _ReversePrompts(reverse_prompt)
            gen = stream(llm.ctx, tokens, n_predict, sampling, res, cached=cached, special=special, constraint=spec,
                         draft=llm.draft)  # fmt: skip
            try:
                for chunk in gen:
                    view.show(reply.feed(chunk.text), chunk.text)
                    if stop_requests[0] or stops.hit(chunk.text):
                        break
            finally:
                gen.close()
            view.show(reply.finish(), "")  # what was held back as a possible marker
            view.end()
        finally:
            signal.signal(signal.SIGINT, previous)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if res.finish_reason == "grammar_dead_end":
            log(f"run: {res.error}")
        # the KV cache holds the prompt and the generated tokens that were decoded (the last one
        # sampled is decoded only when generation goes on)
        cached = tokens + res.tokens[: res.timings.n_eval]
        messages.append(tc.message_dict(reply.message))
        if single_turn:
            break


@app.command(short_help="the tokens of a text (llama-tokenize)")
def tokenize(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    prompt: str = typer.Option(None, "-p", "--prompt", metavar="TEXT", help="the text"),
    file: str = typer.Option(None, "-f", "--file", metavar="FILE", help="read the text from a file"),
    ids: bool = typer.Option(False, "--ids", help="print only the ids, as a Python list"),
    no_bos: bool = typer.Option(False, "--no-bos", help="do not add BOS even if the model does"),
    no_parse_special: bool = typer.Option(False, "--no-parse-special", help="treat special-token text as text"),
    escape: bool = common.ESCAPE,
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
    # llama-tokenize: common_tokenize(text, add_special = the model's add_bos && !--no-bos,
    # parse_special); a special token written in the text stays, even a BOS at the start
    toks = tok.encode(text, add_special=tok.add_bos and not no_bos, parse_special=not no_parse_special)
    out = sys.stdout
    if ids:
        out.write("[" + ", ".join(str(t) for t in toks) + "]\n")
    else:
        for t in toks:
            piece = tok.token_to_piece(t, special=True).decode("utf-8", errors="replace")
            out.write(f"{t:6d} -> '{piece}'\n")
    out.flush()
