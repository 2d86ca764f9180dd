"""`llamapy bench` (llama.cpp's tools/llama-bench): prompt-processing and text-generation speed.

Tests, as llama-bench runs them:
- `ppN`: one batch of N random tokens (BOS first when the model adds it) on an empty cache, fed in
  pieces of n_batch;
- `tgN`: N tokens decoded one at a time from an empty cache, each a random token.
Before the repetitions each test runs once unmeasured (warmup; `--no-warmup` skips it), and the
cache is cleared before every repetition. A sample is the wall time of one repetition; t/s is the
mean ± sample standard deviation of tokens/s over the samples.

Comma-separated `-p`, `-n`, `-ngl`, `-ncmoe`, `-t`, `-b`, `-ub` values are swept as their cartesian
product; the model is loaded once per distinct (-ngl, -ncmoe), and every test gets a fresh context of
n_prompt + n_gen cells (llama-bench's n_ctx). `-o md` prints llama-bench's markdown table, a row as
each test finishes; `-o json` a JSON list with llama-bench's field names.

Beyond llama-bench (extra columns after its own, extra JSON fields after its own):
- `weight_bytes_per_token`: the weight bytes one decode step reads, from the one-token decode
  graph: every MUL_MAT weight (src0) once, at its size in the file, plus the GET_ROWS rows of
  weights it reads (one token_embd row). Norm vectors, rope_freqs and the KV cache are not
  counted (a few KiB, resp. a function of the history);
- `eff_bw_gbs` (tg tests): weight_bytes_per_token × t/s, in GB/s (1e9 bytes/s);
- `probe_bw_gbs`: a read-bandwidth probe on the same number of threads: each thread sums its
  share of a float32 array (512 MiB, `--probe-mib`, ≥ 4× a last-level cache) as rows of 4096
  floats into one row (numpy's add.reduce, which releases the GIL, so the threads run in
  parallel); the best of 5 passes after one warm pass; GB/s = array bytes / wall time of a pass.
  Run once per thread count, before its first tg test;
- `bw_fraction`: eff_bw_gbs / probe_bw_gbs.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import typer

from ..types import LlamapyError
from . import app, common, log

_DEFAULT_BATCH = 2048
_DEFAULT_UBATCH = 512
_DEFAULT_PROBE_MIB = 512
_PROBE_ROW = 4096  # floats per row of the probe's array: 16 KiB, an accumulator that stays in L1
_PROBE_PASSES = 5
PROBE_METHOD = (
    "numpy add.reduce over rows of a float32 array split across the threads, best of "
    f"{_PROBE_PASSES} passes"
)


@dataclass
class Instance:
    ngl: int | str
    n_threads: int
    n_batch: int
    n_ubatch: int
    n_prompt: int
    n_gen: int
    n_depth: int = 0  # cells of history filled (untimed) before each repetition
    type_k: str = "f16"
    type_v: str = "f16"
    n_cpu_moe: int = 0  # the experts of the first N layers kept on the CPU (--n-cpu-moe)
    cpu_matmul: str = "q8"  # ContextOptions.cpu_matmul: "f32" with --f32-activations


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


def _test_prompt(ctx: Any, n_prompt: int, rng: np.random.Generator, n_past: int = 0) -> None:
    tok = ctx.model.tokenizer
    n_vocab = ctx.model.params.n_vocab
    toks = _random_tokens(rng, n_prompt, n_vocab)
    if tok.add_bos and tok.bos is not None and n_past == 0:
        toks[0] = tok.bos
    for b0 in range(0, n_prompt, ctx.n_batch):
        b1 = min(n_prompt, b0 + ctx.n_batch)
        ctx.decode(toks[b0:b1], np.arange(n_past + b0, n_past + b1), 0)


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
        n_ctx=inst.n_depth + inst.n_prompt + inst.n_gen, n_batch=inst.n_batch, n_ubatch=inst.n_ubatch,
        n_threads=inst.n_threads, type_k=common.cache_type(inst.type_k, "-ctk"),
        type_v=common.cache_type(inst.type_v, "-ctv"), cpu_matmul=inst.cpu_matmul,
    )  # fmt: skip
    ctx = Context(model, co)
    rng = np.random.default_rng(0)
    d = inst.n_depth
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
            if d > 0:  # the history, as llama-bench's -d: filled before the clock starts
                _test_prompt(ctx, d, rng)
            t0 = time.perf_counter_ns()
            if inst.n_prompt > 0:
                _test_prompt(ctx, inst.n_prompt, rng, d)
            if inst.n_gen > 0:
                _test_gen(ctx, inst.n_gen, rng, d + inst.n_prompt)
            samples.append(time.perf_counter_ns() - t0)
        return samples
    finally:
        ctx.free()


# -- bandwidth ----------------------------------------------------------------------------


@dataclass
class ReadProbe:
    """What the read-bandwidth probe measured."""

    n_threads: int
    nbytes: int  # the array's size
    seconds: float  # the best pass
    gbs: float  # nbytes / seconds / 1e9


def read_bandwidth(n_threads: int, nbytes: int = _DEFAULT_PROBE_MIB << 20, passes: int = _PROBE_PASSES) -> ReadProbe:
    """Read bandwidth of `n_threads` threads summing disjoint shares of one float32 array.

    Each share is reduced as rows of _PROBE_ROW floats into one row: the arithmetic per byte
    is one vector add of data streamed from memory, the accumulator stays in L1, and the per-row
    call overhead is amortized over 16 KiB. numpy releases the GIL in the reduction, so the
    threads run in parallel."""
    n_threads = max(1, n_threads)
    n_rows = max(n_threads, nbytes // (4 * _PROBE_ROW))
    a = np.ones((n_rows, _PROBE_ROW), dtype=np.float32)  # written once: every page is mapped
    shares = np.array_split(a, n_threads)  # row ranges: views, no copy
    sink = [None] * n_threads

    def work(i: int) -> None:
        sink[i] = np.add.reduce(shares[i], axis=0)

    best = float("inf")
    try:
        for p in range(passes + 1):  # the first pass warms up (page tables, thread start)
            threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
            if p > 0:
                best = min(best, dt)
    finally:
        del shares, a
    return ReadProbe(n_threads, n_rows * _PROBE_ROW * 4, best, n_rows * _PROBE_ROW * 4 / best / 1e9)


def decode_weight_bytes(model: Any) -> int:
    """The weight bytes one decode step (one token, one output) reads: each MUL_MAT weight once,
    at its size in the file, plus the rows GET_ROWS reads from weights (the token's embedding).
    Taken from the context's own one-token graph, so fused or tied weights count as they are read."""
    from ..context import Context, ContextOptions
    from ..tensor import Op, TensorFlag

    ctx = Context(model, ContextOptions(n_ctx=16, n_batch=16, n_ubatch=16, n_threads=1))
    try:
        graph = ctx.graph(1, 1).graph
        seen: set[int] = set()
        total = 0
        for node in graph.nodes:
            if not node.src:
                continue
            w = node.src[0].root()
            if not (w.flags & TensorFlag.WEIGHT):
                continue
            if node.op is Op.MUL_MAT and id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
            elif node.op is Op.GET_ROWS:
                rows = node.shape[0]  # (n_rows read, row length)
                total += rows * (w.nbytes // max(1, w.n_elements // w.shape[-1]))
        return total
    finally:
        ctx.free()


def _instances(
    ngls: list[int | str], threads: list[int], batches: list[int], ubatches: list[int], ps: list[int], ns: list[int],
    depths: list[int] = [0], ctks: list[str] = ["f16"], ctvs: list[str] = ["f16"],  # noqa: B006 (never mutated)
    ncmoes: list[int] = [0],  # noqa: B006
) -> list[Instance]:  # fmt: skip
    """llama-bench's order (pp tests, then tg tests, for each parameter set), with -ngl and -ncmoe
    outermost so that each placement loads the model once."""
    out = []
    for ngl, ncm, nb, nub, ctk, ctv, nt in itertools.product(ngls, ncmoes, batches, ubatches, ctks, ctvs, threads):
        for d in depths:
            for p in ps:
                if p > 0:
                    out.append(Instance(ngl, nt, nb, nub, p, 0, d, ctk, ctv, ncm))
            for n in ns:
                if n > 0:
                    out.append(Instance(ngl, nt, nb, nub, 0, n, d, ctk, ctv, ncm))
    return out


def _fields(
    model: Any, inst: Instance, samples: list[int], n_threads: int, weight_bytes: int | None = None,
    probe: ReadProbe | None = None,
) -> dict[str, Any]:  # fmt: skip
    from .. import __version__ as version
    n_tokens = inst.n_prompt + inst.n_gen
    ts = [1e9 * n_tokens / ns for ns in samples]
    avg_ts = statistics.fmean(ts)
    # effective bandwidth only for pure generation: a prompt batch reads the weights once for
    # many tokens
    eff = weight_bytes * avg_ts / 1e9 if weight_bytes and inst.n_gen and not inst.n_prompt else None
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
        "type_k": inst.type_k,
        "type_v": inst.type_v,
        # as asked (llama-bench's column), "all"/"auto" resolved to a number of layers
        "n_gpu_layers": inst.ngl if isinstance(inst.ngl, int) else model.info.n_gpu_layers
        if inst.ngl == "auto" else model.params.n_layer + 1,
        "n_cpu_moe": inst.n_cpu_moe,
        "split_mode": "layer",
        "main_gpu": 0,
        "no_kv_offload": False,
        "flash_attn": False,
        "tensor_split": "0.00",
        # llama-bench's spelling: REGEX=BUFT;... of every -ot and -ncmoe pattern, or "none"
        "tensor_buft_overrides": ";".join(f"{p}={d}" for p, d in model.options.override_tensor) or "none",
        "use_mmap": True,
        "embeddings": False,
        "n_prompt": inst.n_prompt,
        "n_gen": inst.n_gen,
        "n_depth": inst.n_depth,
        "test_time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "avg_ns": int(statistics.fmean(samples)),
        "stddev_ns": int(_stdev([float(s) for s in samples])),
        "avg_ts": avg_ts,
        "stddev_ts": _stdev(ts),
        "samples_ns": samples,
        "samples_ts": ts,
        # llamapy's own fields (after llama-bench's): see the module docstring
        "weight_bytes_per_token": weight_bytes,
        "eff_bw_gbs": eff,
        "probe_bw_gbs": probe.gbs if probe else None,
        "probe_bytes": probe.nbytes if probe else None,
        "probe_method": PROBE_METHOD if probe else None,
        "bw_fraction": eff / probe.gbs if eff is not None and probe else None,
        "cpu_matmul": inst.cpu_matmul,  # the products' mode: "q8" (default) or "f32" (--f32-activations)
    }


# -- markdown (llama-bench's printer: negative width = left-aligned) ----------------------------

_HEADERS = {"n_gpu_layers": "ngl", "n_threads": "threads", "n_batch": "n_batch", "n_ubatch": "n_ubatch",
            "eff_bw": "eff GB/s", "bw_fraction": "of probe"}  # fmt: skip
_WIDTHS = {"model": -30, "size": 10, "params": 10, "backend": -10, "n_gpu_layers": 3, "n_cpu_moe": 9,
           "n_threads": 7, "n_batch": 7, "n_ubatch": 8, "type_k": -6, "type_v": -6, "test": 15, "t/s": 20, "eff_bw": 8, "bw_fraction": 8}  # fmt: skip


def _md_fields(batches: list[int], ubatches: list[int], bandwidth: bool = False, ctks: list[str] = ["f16"],
               ctvs: list[str] = ["f16"], ncmoes: list[int] = [0]) -> list[str]:  # fmt: skip  # noqa: B006
    f = ["model", "size", "params", "backend", "n_gpu_layers", "n_threads"]
    if ncmoes != [0]:  # shown, as llama-bench does, only when asked for
        f.insert(5, "n_cpu_moe")
    if batches != [_DEFAULT_BATCH]:
        f.append("n_batch")
    if ubatches != [_DEFAULT_UBATCH]:
        f.append("n_ubatch")
    if ctks != ["f16"]:  # llama-bench shows type_k only when it is not its default
        f.append("type_k")
    if ctvs != ["f16"]:
        f.append("type_v")
    f += ["test", "t/s"]
    # llamapy's columns come after llama-bench's, so that its readers still find theirs
    return f + ["eff_bw", "bw_fraction"] if bandwidth else f


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


def md_notes(results: list[dict[str, Any]]) -> list[str]:
    """The lines under the table that say what the bandwidth columns mean and what the probe read."""
    out = []
    wb = next((r["weight_bytes_per_token"] for r in results if r.get("weight_bytes_per_token")), None)
    if wb:
        out.append(f"eff GB/s: {wb / 1e6:.1f} MB of weights a token (MUL_MAT weights + the embedding row "
                   "of the one-token decode graph) x t/s")  # fmt: skip
    probes = {r["n_threads"]: r for r in results if r.get("probe_bw_gbs")}
    for n, r in probes.items():
        out.append(f"read probe, {n} thread{'s' if n != 1 else ''}: {r['probe_bw_gbs']:.2f} GB/s "
                   f"({r['probe_method']}, {r['probe_bytes'] >> 20} MiB)")  # fmt: skip
    return out


def md_row(r: dict[str, Any], fields: list[str]) -> str:
    test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    if r["n_prompt"] and r["n_gen"]:
        test = f"pp{r['n_prompt']}+tg{r['n_gen']}"
    if r.get("n_depth"):
        test += f" @ d{r['n_depth']}"
    values = {
        "model": r["model_type"],
        "size": _size(r["model_size"]),
        "params": _params(r["model_n_params"]),
        "backend": r["backends"],
        "n_gpu_layers": str(r["n_gpu_layers"]),
        "n_cpu_moe": str(r["n_cpu_moe"]),
        "n_threads": str(r["n_threads"]),
        "n_batch": str(r["n_batch"]),
        "n_ubatch": str(r["n_ubatch"]),
        "type_k": r["type_k"],
        "type_v": r["type_v"],
        "test": test,
        "t/s": f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
        "eff_bw": "-" if r.get("eff_bw_gbs") is None else f"{r['eff_bw_gbs']:.2f}",
        "bw_fraction": "-" if r.get("bw_fraction") is None else f"{100 * r['bw_fraction']:.0f} %",
    }
    return _md_line([values[f] for f in fields], fields)


@app.command(short_help="prompt and generation speed (llama-bench)")
def bench(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    n_prompt: str = typer.Option("512", "-p", "--n-prompt", help="prompt sizes, comma-separated (0: no pp test)"),
    n_gen: str = typer.Option("128", "-n", "--n-gen", help="generation lengths, comma-separated (0: no tg test)"),
    ngl: str = typer.Option(None, "-ngl", "--n-gpu-layers", help="layers to offload, comma-separated: N, 'all', 'auto'"),
    n_cpu_moe: str = typer.Option(
        "0", "-ncmoe", "--n-cpu-moe", help="keep the experts of the first N layers on the CPU, comma-separated"
    ),
    ot: list[str] = typer.Option(None, "-ot", "--override-tensor", metavar="REGEX=DEVICE",
                                 help="keep tensors matching REGEX on DEVICE (every test); repeatable"),  # fmt: skip
    threads: str = typer.Option(None, "-t", "--threads", help="threads, comma-separated (default: every core)"),
    batch: str = typer.Option(str(_DEFAULT_BATCH), "-b", "--batch-size", help="logical batch sizes"),
    ubatch: str = typer.Option(str(_DEFAULT_UBATCH), "-ub", "--ubatch-size", help="physical batch sizes"),
    depth: str = typer.Option("0", "-d", "--n-depth", help="cells of history before each test, comma-separated"),
    ctk: str = typer.Option("f16", "-ctk", "--cache-type-k", help="K cache types (f32 f16 q8_0 q4_0), comma-separated"),
    ctv: str = typer.Option("f16", "-ctv", "--cache-type-v", help="V cache types, comma-separated"),
    reps: int = typer.Option(5, "-r", "--repetitions", help="repetitions of each test"),
    output: str = typer.Option("md", "-o", "--output", help="md or json"),
    no_warmup: bool = typer.Option(False, "--no-warmup", help="skip the unmeasured warmup run"),
    progress: bool = typer.Option(False, "--progress", help="log each test as it starts"),
    f32_activations: bool = common.F32_ACT,
    probe_mib: int = typer.Option(
        _DEFAULT_PROBE_MIB, "--probe-mib", help="MiB the read-bandwidth probe sums (0: no probe, no eff GB/s column)"
    ),
    ray: str = common.RAY,
) -> None:
    """Measure prompt processing (pp) and generation (tg) speed, as llama-bench does."""
    common.use_ray(ray)
    from ..context import ContextOptions, Model, ModelOptions

    if output not in ("md", "json"):
        raise LlamapyError(f"-o {output}: use md or json")
    if reps < 1:
        raise LlamapyError(f"-r {reps}: must be >= 1")
    if probe_mib < 0:
        raise LlamapyError(f"--probe-mib {probe_mib}: must be >= 0")
    ps = _int_list(n_prompt, "-p", 0)
    ns = _int_list(n_gen, "-n", 0)
    ngls = _ngl_list(ngl) if ngl is not None else [common.parse_ngl(None)]
    ncmoes = _int_list(n_cpu_moe, "-ncmoe", 0)
    common.parse_overrides(ot)  # refused here, before any model is loaded
    n_cores = os.cpu_count() or 1
    ts_ = _int_list(threads, "-t", 0) if threads is not None else [n_cores]
    bs = _int_list(batch, "-b", 1)
    ubs = _int_list(ubatch, "-ub", 1)
    ds = _int_list(depth, "-d", 0)
    ctks = [c.strip().lower() for c in ctk.split(",")]
    ctvs = [c.strip().lower() for c in ctv.split(",")]
    for c in ctks:
        common.cache_type(c, "-ctk")  # refused here, before any model is loaded
    for c in ctvs:
        common.cache_type(c, "-ctv")
    insts = _instances(ngls, ts_, bs, ubs, ps, ns, ds, ctks, ctvs, ncmoes)
    if not insts:
        raise LlamapyError("nothing to measure: every -p and -n is 0")
    mode = "f32" if f32_activations else "q8"
    for inst in insts:
        inst.cpu_matmul = mode
    path = common.resolve_model(model, model_opt)
    bandwidth = probe_mib > 0 and any(i.n_gen and not i.n_prompt for i in insts)
    fields = _md_fields(bs, ubs, bandwidth, ctks, ctvs, ncmoes)
    probes: dict[int, ReadProbe] = {}  # by thread count, measured before its first tg test
    out = sys.stdout
    results: list[dict[str, Any]] = []
    if output == "md":
        out.write(md_header(fields) + "\n")
        out.flush()
    for (ngl_value, ncm), group in itertools.groupby(insts, key=lambda i: (i.ngl, i.n_cpu_moe)):
        # -ot first: an explicit pattern wins over the --n-cpu-moe ones, as in `run`
        ot_all = common.parse_overrides(common.with_expert_overrides(ot, False, ncm))
        m = Model(path, ModelOptions(n_gpu_layers=ngl_value, override_tensor=ot_all), ContextOptions(cpu_matmul=mode))
        try:
            weight_bytes = decode_weight_bytes(m) if bandwidth else None
            for inst in group:
                if progress:
                    log(f"bench: -ngl {ngl_value} -ncmoe {ncm} -t {inst.n_threads} -b {inst.n_batch} "
                        f"-ub {inst.n_ubatch} {'pp' if inst.n_prompt else 'tg'}{inst.n_prompt or inst.n_gen}")  # fmt: skip
                nt = inst.n_threads or n_cores
                if bandwidth and inst.n_gen and not inst.n_prompt and nt not in probes:
                    if progress:
                        log(f"bench: read probe, {nt} threads, {probe_mib} MiB")
                    probes[nt] = read_bandwidth(nt, probe_mib << 20)
                samples = run_instance(m, inst, reps, not no_warmup)
                probe = probes.get(nt) if inst.n_gen and not inst.n_prompt else None
                r = _fields(m, inst, samples, nt, weight_bytes, probe)
                results.append(r)
                if output == "md":
                    out.write(md_row(r, fields) + "\n")
                    out.flush()
        finally:
            m.free()
    if output == "json":
        out.write(json.dumps(results, indent=2) + "\n")
    elif bandwidth:
        out.write("\n" + "\n".join(md_notes(results)) + "\n")
    out.flush()
