"""`llamapy batch` (llama.cpp's tools/parallel and tools/batched as a file-to-file tool): many
prompts decoded as parallel sequences of one context, one JSONL record per prompt.

Input: a `.jsonl` file (objects with `prompt` and optional `n_predict` (or its OpenAI name
`max_tokens`), `temp`, `seed`, `id`, and `json_schema` (a schema object, or its JSON text) or
`grammar` (GBNF text), which replace the batch's -j / --grammar for that line) or any other file as text, one prompt per line with `\\n`,
`\\t`, `\\\\` escapes. Blank lines are skipped; `index` counts the remaining lines from 0. A line
that is not a valid request (bad JSON, a missing prompt, invalid UTF-8) becomes an error record
`{"index": i, "error": "…"}` and the others still run.

Output: one line per prompt in INPUT order (a completion that finishes early waits in memory until
every earlier record is out), each written with a single write, flushed and fsync'ed. When the
run fails (a lost Ray device: docs/ray.md) the records waiting in memory are written then, out of
order, so that no finished record is lost; the error line names the device and the prompts that
were running, which get no record. With `-o`,
rerunning with the same file resumes: indices already there are skipped, and a last line cut short
by a crash (not newline-terminated, or not valid JSON) is removed first. A file whose records were
written for other prompts (another input, or this one edited) is refused, naming the first record
that differs.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from ..types import LlamapyError
from . import app, common, log

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}
_ESCAPE_RX = re.compile(r"\\(.)")


def unescape(line: str) -> str:
    """`\\n`, `\\t`, `\\r`, `\\\\`, `\\"`, `\\'`, `\\0`; any other backslash stays as it is."""
    return _ESCAPE_RX.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), line)


@dataclass
class InputItem:
    index: int
    request: Any = None  # a BatchRequest, or None when `error` is set
    error: str | None = None
    id: Any = None




def _parse_json_line(index: int, line: str) -> InputItem:
    from ..batch import BatchRequest

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return InputItem(index, error=f"line {index + 1}: invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return InputItem(index, error=f"line {index + 1}: expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id", index)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        what = "missing" if prompt is None else f"a {type(prompt).__name__}, not a string"
        return InputItem(index, error=f"line {index + 1}: `prompt` is {what}", id=rid)
    for key, kind in (("n_predict", int), ("max_tokens", int), ("seed", int), ("temp", (int, float))):
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
            return InputItem(index, error=f"line {index + 1}: `{key}` must be a number", id=rid)
    if not isinstance(rid, (str, int, float, type(None))):
        return InputItem(index, error=f"line {index + 1}: `id` must be a string or a number", id=None)
    # `max_tokens` (the OpenAI API's name) is n_predict; both, disagreeing, is an error
    n_predict, max_tokens = obj.get("n_predict"), obj.get("max_tokens")
    if n_predict is not None and max_tokens is not None and n_predict != max_tokens:
        return InputItem(index, error=f"line {index + 1}: `n_predict` {n_predict} and `max_tokens` {max_tokens} disagree", id=rid)
    n_predict = n_predict if n_predict is not None else max_tokens
    try:
        spec = _line_constraint(obj)
    except LlamapyError as e:
        return InputItem(index, error=f"line {index + 1}: {e}", id=rid)
    req = BatchRequest(prompt, n_predict=n_predict, temp=obj.get("temp"), seed=obj.get("seed"), id=rid, index=index,
                       constraint=spec)  # fmt: skip
    return InputItem(index, request=req, id=rid)


def _line_constraint(obj: dict[str, Any]) -> Any:
    """A line's `json_schema` (an object or JSON text) or `grammar` (GBNF text); None: none."""
    from ..model.constrain import ConstraintSpec

    schema, grammar = obj.get("json_schema"), obj.get("grammar")
    if schema is not None and grammar is not None:
        raise LlamapyError("give `json_schema` or `grammar`, not both")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise LlamapyError("`grammar` must be GBNF text (a string)")
        return ConstraintSpec("gbnf", grammar)
    if schema is None:
        return None
    if isinstance(schema, str):
        return ConstraintSpec("json_schema", schema)
    if not isinstance(schema, (dict, bool)):
        raise LlamapyError("`json_schema` must be a JSON schema (an object) or its JSON text")
    return ConstraintSpec("json_schema", json.dumps(schema))


def read_inputs(path: str) -> list[InputItem]:
    """The prompts of a .jsonl or text file, with error items for the lines that are not
    requests. Lines are decoded one by one: a line of invalid UTF-8 is an error item, not the
    end of the run."""
    from ..batch import BatchRequest

    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise LlamapyError(f"PROMPTS {path}: no such file") from None
    except IsADirectoryError:
        raise LlamapyError(f"PROMPTS {path}: is a directory") from None
    lines = [ln.rstrip(b"\r") for ln in data.split(b"\n")]
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        raise LlamapyError(f"{path}: no prompts (the file is empty)")
    jsonl = Path(path).suffix.lower() == ".jsonl"
    items = []
    for i, raw in enumerate(lines):
        try:
            ln = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            items.append(InputItem(i, error=f"line {i + 1}: not valid UTF-8 (byte {e.start})", id=None if jsonl else i))
            continue
        if jsonl:
            items.append(_parse_json_line(i, ln))
        else:
            items.append(InputItem(i, request=BatchRequest(unescape(ln), id=i, index=i), id=i))
    return items


# -- output ------------------------------------------------------------------------------------


class RecordWriter:
    """Appends one JSON object per line, each with a single write + fsync. On an OSError (a full
    disk) whatever part of the record reached the file is cut off again, so every line in the
    file is a complete record, and a LlamapyError says how to resume."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.n_written = 0
        self.fd = -1
        self.regular = False
        if path is not None:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                raise LlamapyError(f"-o {path}: cannot open for writing ({e.strerror or e})") from None
            self.regular = Path(path).is_file()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self.path is None:
            try:
                sys.stdout.write(line)
                sys.stdout.flush()
            except OSError as e:
                raise LlamapyError(f"writing to stdout: {e.strerror or e}") from None
            self.n_written += 1
            return
        data = line.encode("utf-8")
        start = os.lseek(self.fd, 0, os.SEEK_END) if self.regular else 0
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked (a pipe, a signal, a nearly full disk)
                n = os.write(self.fd, view)
                view = view[n:]
            if self.regular:
                os.fsync(self.fd)
        except OSError as e:
            if self.regular:
                try:
                    os.ftruncate(self.fd, start)
                except OSError:
                    pass
            raise LlamapyError(
                f"writing record {record.get('index')} to {self.path}: {e.strerror or e} "
                f"({self.n_written} records written in this run; rerun with -o {self.path} to resume)"
            ) from None
        self.n_written += 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def load_done(path: str) -> set[int]:
    """Indices already in an output file; a last line cut short by a crash is removed."""
    return set(load_records(path))


def load_records(path: str) -> dict[int, dict[str, Any]]:
    """The records already in an output file by index; a last line cut short by a crash is
    removed."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        data = p.read_bytes()
    except OSError as e:
        raise LlamapyError(f"-o {path}: cannot read ({e.strerror or e})") from None
    done: dict[int, dict[str, Any]] = {}
    keep = 0  # bytes of the complete records
    *complete, tail = data.split(b"\n")  # `tail`: what follows the last newline (a partial write)
    for i, raw in enumerate(complete):
        if not raw.strip():
            keep += len(raw) + 1
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("index"), int):
            if i == len(complete) - 1 and rec is None:
                tail = b"x"  # a garbled last line: cut it off below and redo its record
                break
            raise LlamapyError(f"-o {path}: line {i + 1} is not a record of llamapy batch; not appending to this file")
        done[rec["index"]] = rec
        keep += len(raw) + 1
    if tail:
        try:
            with open(path, "r+b") as f:
                f.truncate(keep)
        except OSError as e:
            raise LlamapyError(f"-o {path}: cannot remove the incomplete last line ({e.strerror or e})") from None
    return done


def check_resume(items: list[InputItem], records: dict[int, dict[str, Any]], out: str, prompts: str) -> None:
    """Refuse to resume onto records written for other prompts: each stored record's `prompt`
    and `id` must be those of the input line with its index (an error record without a prompt
    must still stand for a line that is no request)."""
    by_index = {it.index: it for it in items}
    for i in sorted(records):
        rec, it = records[i], by_index.get(i)
        if it is None:
            why = f"{prompts} has only {len(items)} prompts"
        elif "prompt" in rec and (it.request is None or rec["prompt"] != it.request.prompt):
            now = "no valid request" if it.request is None else f"{_short(it.request.prompt)}"
            why = f"its prompt {_short(rec['prompt'])} differs from {prompts}'s: {now}"
        elif "prompt" not in rec and it.request is not None:
            why = f"it has no prompt (an error record), but {prompts}'s line is a request ({_short(it.request.prompt)})"
        elif "id" in rec and rec["id"] != it.id:
            why = f"its id {rec['id']!r} differs from {prompts}'s {it.id!r}"
        else:
            continue
        raise LlamapyError(
            f"-o {out}: record {i} was not written for these prompts ({why}); "
            "not resuming onto it: give another -o, or remove the file"
        )


def _short(text: Any, n: int = 40) -> str:
    s = repr(text)
    return s if len(s) <= n else s[: n - 3] + "..."


# -- the command ---------------------------------------------------------------------------------


def _ordered(items: list[InputItem], done: set[int]) -> Iterator[int]:
    for it in items:
        if it.index not in done:
            yield it.index


@app.command(short_help="prompts of a file decoded in parallel, to JSONL (llama-parallel)")
def batch(
    model: str = typer.Argument(None, help="GGUF model file (default: SmolLM2-135M-Instruct)", show_default=False),
    prompts: str = typer.Argument(None, help="prompts: .jsonl, or text with one prompt per line", show_default=False),
    model_opt: str = common.MODEL_OPT,
    out: str = typer.Option(None, "-o", "--output", help="JSONL output file (resumed when it exists); default stdout"),
    n_parallel: int = typer.Option(8, "-np", "--parallel", help="sequences decoded in parallel"),
    n_predict: int = typer.Option(-1, "-n", "--n-predict", help="tokens to generate per prompt (-1: until end of generation or a full slot)"),
    ctx_size: int = common.CTX,
    batch_size: int = common.BATCH,
    ubatch: int = common.UBATCH,
    threads: int = common.THREADS,
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed of every prompt (-1: random)"),
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
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar on stderr"),
    ngl: str = common.NGL,
    ot: list[str] = common.OT,
    cpu_moe: bool = common.CPU_MOE,
    n_cpu_moe: int = common.N_CPU_MOE,
    lora: list[str] = common.LORA,
    lora_scaled: list[str] = common.LORA_SCALED,
    control_vector: list[str] = common.CVEC,
    control_vector_scaled: list[str] = common.CVEC_SCALED,
    control_vector_layer_range: tuple[int, int] = common.CVEC_RANGE,
    ts: str = common.TS,
    mg: int = common.MG,
    ctk: str = common.CTK,
    ctv: str = common.CTV,
    nkvo: bool = common.NKVO,
    no_op_offload: bool = common.NO_OP_OFFLOAD,
    device: str = common.DEVICE,
    ray: str = common.RAY,
) -> None:
    """Decode every prompt of a file as parallel sequences; write one JSONL record per prompt."""
    common.use_ray(ray)
    from ..generate import check_n_predict
    from ..model.sampler import SamplingParams

    args = [a for a in (model, prompts) if a is not None]
    if model_opt is not None:
        if len(args) != 1:
            raise LlamapyError("with -m MODEL give exactly one PROMPTS file")
        model_path, prompts_path = model_opt, args[0]
    elif len(args) == 2:
        model_path, prompts_path = args
    elif len(args) == 1:
        model_path, prompts_path = None, args[0]  # the default model
    else:
        raise LlamapyError("no prompts: llamapy batch [MODEL] PROMPTS")
    if n_parallel < 1:
        raise LlamapyError(f"-np {n_parallel}: must be >= 1")
    check_n_predict(n_predict)
    spec = common.constraint(grammar, grammar_file, json_schema, json_schema_file)
    items = read_inputs(prompts_path)
    records = load_records(out) if out else {}
    check_resume(items, records, out, prompts_path)
    done = set(records)
    todo = [it for it in items if it.index not in done]
    if done:
        log(f"batch: resuming {out}: {len(items) - len(todo)} of {len(items)} records already there")
    writer = RecordWriter(out)
    try:
        if not todo:
            log("batch: nothing to do")
            return
        sampling = SamplingParams(
            temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, ignore_eos=ignore_eos,
            **common.sampler_extras(typical, logit_bias, top_nsigma, xtc_probability, xtc_threshold, mirostat, mirostat_lr, mirostat_ent),
        )  # fmt: skip
        llm = common.load(
            model_path, None, ngl, common.with_expert_overrides(ot, cpu_moe, n_cpu_moe), ts, mg, ctx_size, batch_size, ubatch, threads, ctk, ctv, nkvo, no_op_offload, device,
            extra=common.adapters(lora, lora_scaled, control_vector, control_vector_scaled, control_vector_layer_range),
        )
        if spec is not None:
            from ..model.constrain import compile_constraint

            compile_constraint(spec, llm.tokenizer)  # the batch-wide one: an error line, not a record each
        n_slot = llm.ctx.n_ctx // n_parallel
        log(f"batch: {len(todo)} prompts, -np {n_parallel}, {n_slot} cells per sequence (-c {llm.ctx.n_ctx})")
        _run(llm, items, todo, done, writer, n_parallel, n_predict, sampling, no_progress, spec)
    finally:
        writer.close()


def _run(llm, items, todo, done, writer, n_parallel, n_predict, sampling, no_progress, spec=None) -> None:  # noqa: ANN001
    from tqdm import tqdm

    from ..batch import BatchFailed, BatchStats, run_batch

    order = _ordered(items, done)  # indices to write, in input order
    next_index = next(order, None)
    ready: dict[int, dict[str, Any]] = {}
    stats = BatchStats()
    bar = tqdm(total=len(todo), file=sys.stderr, unit="prompt", disable=no_progress, dynamic_ncols=True, leave=True)

    def emit(index: int, record: dict[str, Any]) -> None:
        nonlocal next_index
        ready[index] = record
        while next_index is not None and next_index in ready:
            writer.write(ready.pop(next_index))
            next_index = next(order, None)

    t0 = time.perf_counter()
    n_err = 0
    try:
        for it in todo:  # lines that are no requests: their records are known up front
            if it.error is not None:
                n_err += 1
                emit(it.index, {"index": it.index, "id": it.id, "error": it.error})
                bar.update(1)
        requests = (it.request for it in todo if it.error is None)
        try:
            for rec in run_batch(llm.ctx, requests, n_parallel, n_predict, sampling, stats, spec):
                if rec.error is not None:
                    n_err += 1
                emit(rec.index, rec.to_dict())
                bar.update(1)
                bar.set_postfix_str(f"{_rate(stats.n_gen_tokens, stats.wall_ms):.1f} tok/s", refresh=False)
        except BatchFailed as e:
            for i in sorted(ready):  # finished, waiting for an earlier one: out of order, not lost
                writer.write(ready.pop(i))
            where = f" to {writer.path}; rerun with -o {writer.path} to resume" if writer.path else ""
            raise LlamapyError(f"batch: {e}; {writer.n_written} records written{where}") from None
    finally:
        bar.close()
    wall = (time.perf_counter() - t0) * 1e3
    log(
        f"batch: {len(todo)} records ({n_err} errors), {stats.n_prompt_tokens} prompt + {stats.n_gen_tokens} generated "
        f"tokens in {stats.n_steps} steps, {wall / 1e3:.2f} s, {_rate(stats.n_gen_tokens, wall):.2f} generated tok/s"
    )


def _rate(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0
