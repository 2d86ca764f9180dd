"""`llamapy bench` (llama.cpp's tools/llama-bench): prompt-processing and text-generation speed.

Tests, as llama-bench runs them:
- `ppN`: one batch of N random tokens (BOS first when the model adds it) on an empty cache, fed in
  pieces of n_batch;
- `tgN`: N tokens decoded one at a time from an empty cache, each a random token.
Before the repetitions each test runs once unmeasured (warmup; `--no-warmup` skips it), and the
cache is cleared before every repetition. A sample is the wall time of one repetition; t/s is the
mean ± sample standard deviation of tokens/s over the samples.

Comma-separated `-p`, `-n`, `-ngl`, `-t`, `-b`, `-ub` values are swept as their cartesian product;
the model is loaded once per distinct -ngl, and every test gets a fresh context of
n_prompt + n_gen cells (llama-bench's n_ctx). `-o md` prints llama-bench's markdown table, a row as
each test finishes; `-o json` a JSON list with llama-bench's field names.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import typer

from ..types import LlamapyError
from . import app, common, log

_DEFAULT_BATCH = 2048
_DEFAULT_UBATCH = 512


@dataclass
class Instance:
    ngl: int | str
    n_threads: int
    n_batch: int
    n_ubatch: int
    n_prompt: int
    n_gen: int


def _int_list(value: str, flag: str, minimum: int) -> list[int]:
    out = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise LlamapyError(f"{flag} {value}: expected comma-separated numbers") from None
        if v < minimum:
            raise LlamapyError(f"{flag} {v}: must be >= {minimum}")
        out.append(v)
    if not out:
        raise LlamapyError(f"{flag}: no value given")
    return list(dict.fromkeys(out))


def _ngl_list(value: str) -> list[int | str]:
    out: list[int | str] = []
    for part in value.split(","):
        if part.strip():
            v = common.parse_ngl(part)
            if isinstance(v, int) and v < 0:
                raise LlamapyError(f"-ngl {part}: must be >= 0, 'all' or 'auto'")
            out.append(v)
    if not out:
        raise LlamapyError("-ngl: no value given")
    return list(dict.fromkeys(out))


def _stdev(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _model_type(model: Any) -> str:
    """llama_model_desc: architecture, size class and file type ("llama 135M Q4_1")."""
    n = model.info.n_params
    if n >= 1e9:
        size = f"{n / 1e9:.1f}".rstrip("0").rstrip(".") + "B"
    else:
        size = f"{n / 1e6:.0f}M"
    return f"{model.arch} {size} {model.info.file_type}"


def _model_size(model: Any) -> int:
    """llama_model_size: bytes of the tensors (not of the file)."""
    return sum(t.nbytes for t in model.gguf.tensors.values())


def _backends(model: Any) -> str:
    """llama-bench's backend column: the registries in use other than the CPU, else CPU."""
    used = {d.name for d in model.devices}
    names = []
    for st in model.discovery.statuses:
        reg = st.registry
        if reg is None or reg.name.upper() == "CPU":
            continue
        if any(d.name in used for d in reg.devices()):
            names.append(reg.name)
    return ",".join(names) if names else "CPU"


def _random_tokens(rng: np.random.Generator, n: int, n_vocab: int) -> np.ndarray:
    return rng.integers(0, n_vocab, size=n, dtype=np.int32)


def _test_prompt(ctx: Any, n_prompt: int, rng: np.random.Generator) -> None:
    tok = ctx.model.tokenizer
    n_vocab = ctx.model.params.n_vocab
    toks = _random_tokens(rng, n_prompt, n_vocab)
    if tok.add_bos and tok.bos is not None:
        toks[0] = tok.bos
    for b0 in range(0, n_prompt, ctx.n_batch):
        b1 = min(n_prompt, b0 + ctx.n_batch)
        ctx.decode(toks[b0:b1], np.arange(b0, b1), 0)


def _test_gen(ctx: Any, n_gen: int, rng: np.random.Generator, n_past: int = 0) -> None:
    tok = ctx.model.tokenizer
    n_vocab = ctx.model.params.n_vocab
    token = tok.bos if tok.add_bos and tok.bos is not None else int(rng.integers(0, n_vocab))
    for i in range(n_gen):
        ctx.decode([token], [n_past + i], 0)
        token = int(rng.integers(0, n_vocab))


def run_instance(model: Any, inst: Instance, reps: int, warmup: bool) -> list[int]:
    """The wall time in ns of each repetition of one test on a fresh context."""
    from ..context import Context, ContextOptions

    co = ContextOptions(
        n_ctx=inst.n_prompt + inst.n_gen, n_batch=inst.n_batch, n_ubatch=inst.n_ubatch, n_threads=inst.n_threads
    )
    ctx = Context(model, co)
    rng = np.random.default_rng(0)
    try:
        if warmup:
            ctx.kv.clear()
            if inst.n_prompt > 0:
                _test_prompt(ctx, inst.n_prompt, rng)
            if inst.n_gen > 0:
                _test_gen(ctx, 1, rng)
        samples = []
        for _ in range(reps):
            ctx.kv.clear()
            t0 = time.perf_counter_ns()
            if inst.n_prompt > 0:
                _test_prompt(ctx, inst.n_prompt, rng)
            if inst.n_gen > 0:
                _test_gen(ctx, inst.n_gen, rng, inst.n_prompt)
            samples.append(time.perf_counter_ns() - t0)
        return samples
    finally:
        ctx.free()


def _instances(
    ngls: list[int | str], threads: list[int], batches: list[int], ubatches: list[int], ps: list[int], ns: list[int]
) -> list[Instance]:
    """llama-bench's order (pp tests, then tg tests, for each parameter set), with -ngl outermost
    so that each -ngl loads the model once."""
    out = []
    for ngl, nb, nub, nt in itertools.product(ngls, batches, ubatches, threads):
        for p in ps:
            if p > 0:
                out.append(Instance(ngl, nt, nb, nub, p, 0))
        for n in ns:
            if n > 0:
                out.append(Instance(ngl, nt, nb, nub, 0, n))
    return out


def _fields(model: Any, inst: Instance, samples: list[int], n_threads: int) -> dict[str, Any]:
    from .. import __version__ as version
    from ..context import ContextOptions

    co = ContextOptions()  # the cache types run_instance's contexts get

    n_tokens = inst.n_prompt + inst.n_gen
    ts = [1e9 * n_tokens / ns for ns in samples]
    return {
        "build_commit": "llamapy",
        "build_number": 0,
        "llamapy_version": version,
        "cpu_info": platform.processor() or platform.machine(),
        "gpu_info": ", ".join(d.name for d in model.gpus),
        "backends": _backends(model),
        "model_filename": str(model.path),
        "model_type": _model_type(model),
        "model_size": _model_size(model),
        "model_n_params": model.info.n_params,
        "n_batch": inst.n_batch,
        "n_ubatch": inst.n_ubatch,
        "n_threads": n_threads,
        "type_k": co.type_k.name.lower(),
        "type_v": co.type_v.name.lower(),
        # as asked (llama-bench's column), "all"/"auto" resolved to a number of layers
        "n_gpu_layers": inst.ngl if isinstance(inst.ngl, int) else model.info.n_gpu_layers
        if inst.ngl == "auto" else model.params.n_layer + 1,
        "split_mode": "layer",
        "main_gpu": 0,
        "no_kv_offload": False,
        "flash_attn": False,
        "tensor_split": "0.00",
        "use_mmap": True,
        "embeddings": False,
        "n_prompt": inst.n_prompt,
        "n_gen": inst.n_gen,
        "n_depth": 0,
        "test_time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "avg_ns": int(statistics.fmean(samples)),
        "stddev_ns": int(_stdev([float(s) for s in samples])),
        "avg_ts": statistics.fmean(ts),
        "stddev_ts": _stdev(ts),
        "samples_ns": samples,
        "samples_ts": ts,
    }


# -- markdown (llama-bench's printer: negative width = left-aligned) ----------------------------

_HEADERS = {"n_gpu_layers": "ngl", "n_threads": "threads", "n_batch": "n_batch", "n_ubatch": "n_ubatch"}
_WIDTHS = {"model": -30, "size": 10, "params": 10, "backend": -10, "n_gpu_layers": 3, "n_threads": 7,
           "n_batch": 7, "n_ubatch": 8, "test": 15, "t/s": 20}  # fmt: skip


def _md_fields(batches: list[int], ubatches: list[int]) -> list[str]:
    f = ["model", "size", "params", "backend", "n_gpu_layers", "n_threads"]
    if batches != [_DEFAULT_BATCH]:
        f.append("n_batch")
    if ubatches != [_DEFAULT_UBATCH]:
        f.append("n_ubatch")
    return f + ["test", "t/s"]


def _md_line(cells: list[str], fields: list[str]) -> str:
    out = []
    for c, f in zip(cells, fields):
        w = _WIDTHS.get(f, max(len(f), 10))
        out.append(c.ljust(-w) if w < 0 else c.rjust(w))
    return "| " + " | ".join(out) + " |"


def md_header(fields: list[str]) -> str:
    head = _md_line([_HEADERS.get(f, f) for f in fields], fields)
    seps = []
    for f in fields:
        w = _WIDTHS.get(f, max(len(f), 10))
        seps.append("-" * -w if w < 0 else "-" * (w - 1) + ":")
    return head + "\n|" + "|".join(f" {s} " for s in seps) + "|"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def md_row(r: dict[str, Any], fields: list[str]) -> str:
    test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    if r["n_prompt"] and r["n_gen"]:
        test = f"pp{r['n_prompt']}+tg{r['n_gen']}"
    values = {
        "model": r["model_type"],
        "size": _size(r["model_size"]),
        "params": _params(r["model_n_params"]),
        "backend": r["backends"],
        "n_gpu_layers": str(r["n_gpu_layers"]),
        "n_threads": str(r["n_threads"]),
        "n_batch": str(r["n_batch"]),
        "n_ubatch": str(r["n_ubatch"]),
        "test": test,
        "t/s": f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
    }
    return _md_line([values[f] for f in fields], fields)


@app.command(short_help="prompt and generation speed (llama-bench)")
def bench(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    n_prompt: str = typer.Option("512", "-p", "--n-prompt", help="prompt sizes, comma-separated (0: no pp test)"),
    n_gen: str = typer.Option("128", "-n", "--n-gen", help="generation lengths, comma-separated (0: no tg test)"),
    ngl: str = typer.Option(None, "-ngl", "--n-gpu-layers", help="layers to offload, comma-separated: N, 'all', 'auto'"),
    threads: str = typer.Option(None, "-t", "--threads", help="threads, comma-separated (default: every core)"),
    batch: str = typer.Option(str(_DEFAULT_BATCH), "-b", "--batch-size", help="logical batch sizes"),
    ubatch: str = typer.Option(str(_DEFAULT_UBATCH), "-ub", "--ubatch-size", help="physical batch sizes"),
    reps: int = typer.Option(5, "-r", "--repetitions", help="repetitions of each test"),
    output: str = typer.Option("md", "-o", "--output", help="md or json"),
    no_warmup: bool = typer.Option(False, "--no-warmup", help="skip the unmeasured warmup run"),
    progress: bool = typer.Option(False, "--progress", help="log each test as it starts"),
) -> None:
    """Measure prompt processing (pp) and generation (tg) speed, as llama-bench does."""
    from ..context import Model, ModelOptions

    if output not in ("md", "json"):
        raise LlamapyError(f"-o {output}: use md or json")
    if reps < 1:
        raise LlamapyError(f"-r {reps}: must be >= 1")
    ps = _int_list(n_prompt, "-p", 0)
    ns = _int_list(n_gen, "-n", 0)
    ngls = _ngl_list(ngl) if ngl is not None else [common.parse_ngl(None)]
    n_cores = os.cpu_count() or 1
    ts_ = _int_list(threads, "-t", 0) if threads is not None else [n_cores]
    bs = _int_list(batch, "-b", 1)
    ubs = _int_list(ubatch, "-ub", 1)
    insts = _instances(ngls, ts_, bs, ubs, ps, ns)
    if not insts:
        raise LlamapyError("nothing to measure: every -p and -n is 0")
    path = common.resolve_model(model, model_opt)
    fields = _md_fields(bs, ubs)
    out = sys.stdout
    results: list[dict[str, Any]] = []
    if output == "md":
        out.write(md_header(fields) + "\n")
        out.flush()
    for ngl_value, group in itertools.groupby(insts, key=lambda i: i.ngl):
        m = Model(path, ModelOptions(n_gpu_layers=ngl_value))
        try:
            for inst in group:
                if progress:
                    log(f"bench: -ngl {ngl_value} -t {inst.n_threads} -b {inst.n_batch} -ub {inst.n_ubatch} "
                        f"{'pp' if inst.n_prompt else 'tg'}{inst.n_prompt or inst.n_gen}")  # fmt: skip
                samples = run_instance(m, inst, reps, not no_warmup)
                r = _fields(m, inst, samples, inst.n_threads or n_cores)
                results.append(r)
                if output == "md":
                    out.write(md_row(r, fields) + "\n")
                    out.flush()
        finally:
            m.free()
    if output == "json":
        out.write(json.dumps(results, indent=2) + "\n")
        out.flush()
