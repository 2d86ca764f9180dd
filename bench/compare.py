"""llamapy side by side with llama.cpp, in one run, on the same machine.

    python bench/compare.py                 # print the table
    python bench/compare.py --write         # …and append a dated section to bench/RESULTS.md
    python bench/compare.py --no-build      # never build llama.cpp: use it if built, else the reference
    python bench/compare.py --models tiny32 --reps 1 --json out.json
    python bench/compare.py --models llama1b --types all --write     # + the per-type table
    python bench/compare.py --only-types --types q4_0,q4_k -n 64     # the per-type table alone
    python bench/compare.py --models default --depth 2048 --only-depth   # tg with 2048 cells of history

Models: the default model (python models/fetch.py), tiny32
(../shared/reference/tiny32/tiny32-Q4_K_M.gguf) and the Llama-3.2-1B-shape Q4_K_M file
(`llama1b`: `--llama1b PATH` or $LLAMAPY_LLAMA1B; made when absent if llama.cpp's llama-quantize
is built — see bench/models1b.py), and issue 29's MoE shapes `qwen3moe8` (Qwen3-30B-A3B, 8 layers,
Q4_K_M) and `gptoss6` (gpt-oss-20b, 6 layers, MXFP4_MOE), made the same way (bench/models_moe.py);
`--models` takes paths or these names. Everything runs with 2 threads (-t 2). The 1B and MoE
shapes are measured with tg64 and `run -n 64` (issues 11's and 29's figures), the others with
tg128 and `run -n 128`.

Per-type table (`--types all` or `--types q4_0,q8_0,…`): the 1B shape quantized `--pure` to each
type (files cached in `--models-dir`, bench/models1b.py), tg N (`-n`, default 64) with
`llama-bench -p 0 -n N` and `llamapy bench -p 0 -n N` side by side, their ratio (bar ≥ 0.9×),
and the effective bandwidth of both: the weight bytes a decode step reads (`llamapy bench`'s
weight_bytes_per_token) × tok/s, with llamapy's fraction of its read probe on the same threads.

History table (`--depth D`, for each model of --models): tgN after D cells of history, for each
cache type of `--cache-types` (default f16,q8_0,q4_0; K and V the same type), `llama-bench -p 0 -n
N -d D -ctk T -ctv T` and `llamapy bench` with the same flags side by side (N: 128, or 64 for the
1B shape); bar ≥ 1.0× (issue 11). `--only-depth` skips the main table.

`--rounds K` (default 1) measures the tok/s figures of every table K times, llama.cpp and llamapy
alternately (llama-bench, then `llamapy bench`, then again), and reports each side's median: a
shared host has slow phases lasting seconds to minutes, which then hit both sides instead of one.
The ratio cells then also give the range of the K per-round ratios.

Every output (the printed tables, the RESULTS.md section, the JSON) names the CPU and its SIMD
flags (avx2, avx512f, avx512_vnni, amx…), since the ratios differ between hosts of this kind.

Measured, for each model:
- pp512 and tg128 tok/s: `llama-bench -p 512 -n 128 -t 2 -o json` against `llamapy bench` with
  the same flags (or, if that command fails, the Python API: pp = one 512-token batch on an empty
  cache, tg = 128 single-token decodes after a warm-up);
- peak RSS of `llamapy run -n 128 -c 512 -t 2 --temp 0` against `llama-completion` with the same
  flags and -no-cnv (each child's own ru_maxrss, via os.wait4), with the RSS of a child that only
  imports llamapy (its CLI) reported apart;
- load time as llama.cpp measures it: from opening the model to being ready for the first token
  (model load + context + the warm-up decode). llama.cpp's is the `load time` line of
  llama-completion. llamapy's is measured in a fresh child: Model.info.load_ms + context
  creation + the first one-token decode minus the kernels' cache load (the compiled kernel
  library, or numba's JIT cache, measured as the first decode minus a second one); the imports,
  that cache load and the `load time` line `llamapy run` prints (Model.info.load_ms alone) are
  reported apart.

Ratios (llamapy / llama.cpp) and their bars: generation ≥ 0.5× (goal 1.0×), pp512 ≥ 1.0×
(goal 2×), peak RSS ≤ 2.0× (goal 1.2×), load time ≤ 2×.

llama.cpp comes from bench/llama_cpp.py (built once from the llama-cpp-python 0.3.36 sdist into
~/.cache/llamapy-bench). If it cannot be built, llama.cpp's figures are taken from
../shared/reference/smollm2/bench.json (measured on this machine kind, not in this run) and the
output says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402  (bench/llama_cpp.py, not the llama-cpp-python package)
import models1b  # noqa: E402  (bench/models1b.py)
import models_moe  # noqa: E402  (bench/models_moe.py)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"  # next to the checkout, and nowhere else
TINY32 = SHARED / "reference" / "tiny32" / "tiny32-Q4_K_M.gguf"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PROMPT = "Once upon a time, in a small village by the sea,"
LLAMAPY = [sys.executable, "-m", "llamapy"]

# the shapes measured with tg64 (the issues' figures), not tg128
N_GEN_64 = ("llama1b", *models_moe.FILES)
# metric: (higher is better, floor, goal); "tg" is tg128, or tg64 for N_GEN_64
BARS = {
    "tg": (True, 0.5, 1.0),
    "pp512": (True, 1.0, 2.0),
    "peak_rss": (False, 2.0, 1.2),
    "load": (False, 2.0, None),
}
# the 1B shape's bars are issue 11's (tg64 at the bandwidth limit); its load time is reported only
BARS_1B = {
    "tg": (True, 1.0, None),
    "pp512": (True, 1.2, None),
    "peak_rss": (False, 1.0, None),
}
# issue 29's MoE shapes (bench/models_moe.py): tg64 and pp512 at least llama.cpp's; RSS reported
BARS_MOE = {"tg": (True, 1.0, None), "pp512": (True, 1.0, None)}
PER_TYPE_BAR = 0.9  # tg of each `--pure` type, llamapy / llama.cpp
# the flags that decide which kernels run (ggml's and llamapy's runtime dispatch)
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
              "amx_tile", "amx_int8", "amx_bf16", "neon", "asimd", "asimddp", "sve")  # fmt: skip


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    """The environment of every llamapy child: the checkout's package first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def default_model() -> Path:
    r = subprocess.run([sys.executable, str(REPO / "models" / "fetch.py")], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"models/fetch.py failed: {r.stderr.strip()}")
    return Path(r.stdout.strip().splitlines()[-1])


def resolve_models(names: list[str], mpaths: models1b.Paths | None = None,
                   quantize: Path | None = None) -> list[tuple[str, Path]]:  # fmt: skip
    """(kind, path) of each model: kind is default, tiny32, llama1b or path. The 1B-shape file
    is made when absent and llama-quantize is given; if it cannot be, it is left out (logged)."""
    out = []
    for n in names:
        if n == "default":
            out.append(("default", default_model()))
        elif n == "tiny32":
            out.append(("tiny32", TINY32))
        elif n in models_moe.FILES:
            try:
                out.append((n, models_moe.ensure_file(models_moe.FILES[n], (mpaths or models1b.paths()).folder, quantize)))
            except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                log(f"{n} left out: {e}")
        elif n == "llama1b":
            mp = mpaths or models1b.paths()
            try:
                out.append(("llama1b", models1b.ensure_file(mp, None, quantize)))
            except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                log(f"llama1b left out: {e}")
        else:
            out.append(("path", Path(n)))
    for _, p in out:
        if not p.is_file():
            raise SystemExit(f"no such model: {p}")
    return out


# -- llamapy --------------------------------------------------------------------------------------


BW_FIELDS = ("weight_bytes_per_token", "eff_bw_gbs", "probe_bw_gbs", "bw_fraction", "probe_method")


def bandwidth(records: list[dict[str, Any]]) -> dict[str, Any]:
    """`llamapy bench`'s bandwidth fields of its (last) tg record, if it wrote them."""
    tg = [r for r in records if r.get("n_gen") and not r.get("n_prompt")]
    return {k: tg[-1][k] for k in BW_FIELDS if tg and tg[-1].get(k) is not None}


def llamapy_bench(model: Path, threads: int, reps: int, timeout: float | None, n_prompt: int = 512,
                  n_gen: int = 128) -> dict[str, Any]:  # fmt: skip
    """ppN/tgN (and the bandwidth fields) with `llamapy bench … -o json`, else with the Python API."""
    cmd = [*LLAMAPY, "bench", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads), "-r", str(reps),
           "-o", "json"]  # fmt: skip
    want = [f"tg{n_gen}_tps"] + ([f"pp{n_prompt}_tps"] if n_prompt else [])
    try:
        r = llama_cpp.run_child(cmd, env=child_env(), timeout=timeout)
        if r.rc == 0:
            records = json.loads(r.stdout)
            tps = llama_cpp.bench_tps(records)
            if all(k in tps for k in want):
                return {**tps, **bandwidth(records), "via": "llamapy bench"}
        log(f"llamapy bench failed (exit {r.rc}): {r.stderr.strip()[-500:]}; using the Python API")
    except (ValueError, OSError) as e:
        log(f"llamapy bench unusable ({e}); using the Python API")
    return {**api_bench(model, threads, reps, n_prompt or 512, n_gen), "via": "Python API"}


def api_bench(model: Path, threads: int, reps: int, n_prompt: int = 512, n_gen: int = 128) -> dict[str, float]:
    """pp: one n_prompt-token batch on an empty cache; tg: n_gen single-token decodes after a
    warm-up. Random tokens (seeded), BOS first when the model adds one, as llama-bench does."""
    import numpy as np

    sys.path.insert(0, str(REPO))
    import llamapy

    llm = llamapy.Llama(str(model), n_ctx=n_prompt + n_gen, n_threads=threads)
    try:
        ctx = llm.ctx
        tok = llm.tokenizer
        n_vocab = llm.model.params.n_vocab
        rng = np.random.default_rng(0)
        bos = tok.bos if tok.add_bos and tok.bos is not None else None

        def prompt() -> None:
            toks = rng.integers(0, n_vocab, size=n_prompt, dtype=np.int32)
            if bos is not None:
                toks[0] = bos
            ctx.decode(toks, np.arange(n_prompt), 0)

        def gen(n: int) -> None:
            t = bos if bos is not None else int(rng.integers(0, n_vocab))
            for i in range(n):
                ctx.decode([t], [i], 0)
                t = int(rng.integers(0, n_vocab))

        ctx.kv.clear()
        prompt()  # warm-up
        ctx.kv.clear()
        gen(1)
        pp, tg = [], []
        for _ in range(reps):
            ctx.kv.clear()
            t0 = time.perf_counter()
            prompt()
            pp.append(n_prompt / (time.perf_counter() - t0))
        for _ in range(reps):
            ctx.kv.clear()
            t0 = time.perf_counter()
            gen(n_gen)
            tg.append(n_gen / (time.perf_counter() - t0))
        return {f"pp{n_prompt}_tps": sum(pp) / len(pp), f"tg{n_gen}_tps": sum(tg) / len(tg)}
    finally:
        llm.close()


def llamapy_run(model: Path, threads: int, timeout: float | None, n_gen: int = 128) -> dict[str, Any]:
    """Peak RSS and llama_perf lines of `llamapy run -n N -c 512`."""
    cmd = [*LLAMAPY, "run", str(model), "-p", PROMPT, "-n", str(n_gen), "-c", "512", "-t", str(threads), "--temp", "0"]
    r = llama_cpp.run_child(cmd, env=child_env(), timeout=timeout)
    if r.rc != 0:
        raise RuntimeError(f"llamapy run failed (exit {r.rc}): {r.stderr.strip()[-1000:]}")
    return {**llama_cpp.parse_perf(r.stderr), "max_rss_kib": r.max_rss_kib, "wall_s": r.wall_s}


def import_rss() -> dict[str, Any]:
    """A child that only imports llamapy's CLI: its peak RSS and wall time."""
    r = llama_cpp.run_child([sys.executable, "-c", "import llamapy.cli"], env=child_env())
    if r.rc != 0:
        raise RuntimeError(f"importing llamapy failed: {r.stderr.strip()[-500:]}")
    return {"max_rss_kib": r.max_rss_kib, "wall_s": r.wall_s}


_LOAD_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import llamapy
from llamapy.context import Context, ContextOptions, Model, ModelOptions
t1 = time.perf_counter()
path, threads = sys.argv[1], int(sys.argv[2])
co = ContextOptions(n_ctx=512, n_threads=threads)
t2 = time.perf_counter()
m = Model(path, ModelOptions(), co)
t3 = time.perf_counter()
ctx = Context(m, co)
t4 = time.perf_counter()
tok = m.tokenizer
first = tok.bos if tok.bos is not None else 0
ctx.decode([first], [0], 0)   # the warm-up decode llama.cpp also runs; loads the compiled kernels
t5 = time.perf_counter()
ctx.kv.clear()
ctx.decode([first], [0], 0)   # the same decode again: what it costs once everything is loaded
t6 = time.perf_counter()
print(json.dumps({
    "imports_ms": (t1 - t0) * 1e3, "model_load_ms": m.info.load_ms, "model_wall_ms": (t3 - t2) * 1e3,
    "context_ms": (t4 - t3) * 1e3, "first_decode_ms": (t5 - t4) * 1e3, "second_decode_ms": (t6 - t5) * 1e3,
}))
"""


def llamapy_load(model: Path, threads: int, timeout: float | None) -> dict[str, Any]:
    """Load time as llama.cpp measures it, in a fresh child (so the compiled kernels are not
    loaded yet, as for every `llamapy run`)."""
    r = llama_cpp.run_child([sys.executable, "-c", _LOAD_PROBE, str(model), str(threads)], env=child_env(),
                            timeout=timeout)  # fmt: skip
    if r.rc != 0:
        raise RuntimeError(f"load probe failed (exit {r.rc}): {r.stderr.strip()[-1000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    d["jit_cache_ms"] = max(0.0, d["first_decode_ms"] - d["second_decode_ms"])
    # open -> ready, the kernels' cache load apart (the issue's definition)
    d["ready_ms"] = d["model_load_ms"] + d["context_ms"] + d["first_decode_ms"] - d["jit_cache_ms"]
    d["process_wall_s"] = r.wall_s
    return d


# -- llama.cpp ------------------------------------------------------------------------------------


def llamacpp_figures(tools: dict[str, Path] | None, model: Path, threads: int, reps: int,
                     timeout: float | None, n_gen: int = 128, completion: bool = True) -> dict[str, Any]:  # fmt: skip
    if tools:
        out: dict[str, Any] = {"source": "measured in this run"}
        try:
            out.update(llama_cpp.bench_tps(llama_cpp.run_bench(tools, model, n=n_gen, t=threads, reps=reps,
                                                               timeout=timeout)))  # fmt: skip
        except (RuntimeError, ValueError) as e:
            log(f"llama-bench on {model.name}: {e}")
        try:
            if completion:
                out.update({"completion": llama_cpp.run_completion(tools, model, PROMPT, n=n_gen, t=threads,
                                                                   timeout=timeout)})  # fmt: skip
        except RuntimeError as e:
            log(f"llama-completion on {model.name}: {e}")
        return out
    ref = llama_cpp.reference()
    out = {"source": f"reference ({llama_cpp.REFERENCE}), NOT measured in this run"}
    if "tiny32" in model.name:
        out.update(_ref_tps(ref.get("tiny32-Q4_K_M llama-bench", {})))
    elif "smollm2" in model.name.lower():
        out.update(_ref_tps(ref.get("llama-bench", {})))
        comp = ref.get("llama-completion -n 128 -c 512")
        if comp:
            out["completion"] = dict(comp)
    return out


def _ref_tps(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if k in ("pp512_tps", "tg128_tps")}


def alternate(rounds: int, lc: Callable[[int], dict[str, Any]], lp: Callable[[int], dict[str, Any]]
              ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, float]]]:  # fmt: skip
    """lc(i) and lp(i) for rounds i = 0 .. rounds - 1, alternately: each side's fields, numbers
    as their median over the rounds (others from round 0), and the per-round ratios of the
    `*_tps` fields both sides have."""
    a, b = [], []
    for i in range(rounds):
        a.append(lc(i))
        b.append(lp(i))

    def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
        out = dict(runs[0])
        for k, v in runs[0].items():
            vals = [r.get(k) for r in runs]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and all(isinstance(x, (int, float)) for x in vals):
                out[k] = statistics.median(vals)
        return out

    ratios = [{k: y[k] / x[k] for k in y if k.endswith("_tps") and x.get(k) and y.get(k)} for x, y in zip(a, b)]
    return merge(a), merge(b), ratios


def _spread(ratios: list[dict[str, float]] | None, key: str) -> str:
    """' (lo–hi)' of the per-round ratios of `key`, where there are several rounds"""
    vals = [r[key] for r in ratios or [] if key in r]
    return f" ({min(vals):.2f}–{max(vals):.2f})" if len(vals) > 1 else ""


def _ratio_cell(r: float | None, ratios: list[dict[str, float]] | None, key: str) -> str:
    """'1.23×', and ' (lo–hi)' of the per-round ratios of `key` where there are several rounds"""
    return _fmt(r, ".2f") + ("×" if r else "") + _spread(ratios, key)


# -- report -------------------------------------------------------------------------------------


def _status(metric: str, ratio: float | None, bars: dict[str, tuple] | None = None) -> str:
    if ratio is None:
        return "n/a"
    higher, floor, goal = (bars or BARS)[metric]
    ok = (lambda x, b: x >= b) if higher else (lambda x, b: x <= b)
    if goal is not None and ok(ratio, goal):
        return "goal met"
    return "ok (floor met)" if ok(ratio, floor) else "BELOW FLOOR"


def _bar(metric: str, bars: dict[str, tuple] | None = None) -> str:
    higher, floor, goal = (bars or BARS)[metric]
    s = f"{'≥' if higher else '≤'} {floor:g}×"
    return s + (f" (goal {goal:g}×)" if goal is not None else "")


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    lp, lc = res["llamapy"], res["llama.cpp"]
    comp = lc.get("completion", {})
    run = lp.get("run", {})
    load = lp.get("load", {})

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    lp_rss = run.get("max_rss_kib")
    lc_rss = comp.get("max_rss_kib")
    n = res.get("n_gen", 128)
    metrics = [
        ("tg", f"generation tg{n} (tok/s)", lp.get(f"tg{n}_tps"), lc.get(f"tg{n}_tps"), ".2f"),
        ("pp512", "prompt pp512 (tok/s)", lp.get("pp512_tps"), lc.get("pp512_tps"), ".2f"),
        ("peak_rss", f"peak RSS, run -n {n} -c 512 (MiB)", lp_rss / 1024 if lp_rss else None,
         lc_rss / 1024 if lc_rss else None, ".1f"),
        ("load", "load time, open → ready, kernel cache load apart (ms)", load.get("ready_ms"),
         comp.get("load_ms"), ".1f"),
    ]  # fmt: skip
    out = []
    kind = res.get("kind", "tiny32" if "tiny32" in res["model"] else "path")
    # the speed issues set bars for the default model, the 1B shape and the MoE shapes; tiny32's are reported only
    bars = {"tiny32": {}, "llama1b": BARS_1B, **dict.fromkeys(models_moe.FILES, BARS_MOE)}.get(kind, BARS)
    spread_key = {"tg": f"tg{n}_tps", "pp512": "pp512_tps"}  # the round ratios of a metric
    for key, label, a, b, spec in metrics:
        r = ratio(a, b)
        barred = key in bars
        out.append([res["model"], label, _fmt(a, spec), _fmt(b, spec), _ratio_cell(r, res.get("round_ratios"), spread_key.get(key, "")),
                    _bar(key, bars) if barred else "none (reported)",
                    _status(key, r, bars) if barred else "-"])  # fmt: skip
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    head = ["model", "metric", "llamapy", "llama.cpp", "ratio", "bar", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---", "---:", "---:", "---:", "---", "---"]) + "|"]
    for res in results:
        lines += ["| " + " | ".join(r) + " |" for r in rows_for(res)]
    lines.append("")
    lines.append("Apart (llamapy):")
    lines.append("")
    lines.append("| model | RSS after imports (MiB) | imports (ms) | `load time` line = Model.info.load_ms (ms) "
                 "| context (ms) | first decode (ms) | of which kernel cache load ≈ (ms) | run: eval tok/s | "
                 "llama.cpp run: eval tok/s | weights a token (MB) | tg eff GB/s: llamapy (of its probe) | "
                 "llama.cpp |")  # fmt: skip
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        lp = res["llamapy"]
        ld, run, imp = lp.get("load", {}), lp.get("run", {}), lp.get("imports", {})
        comp = res["llama.cpp"].get("completion", {})
        lines.append("| " + " | ".join([
            res["model"],
            _fmt(imp.get("max_rss_kib", 0) / 1024 or None, ".1f"),
            _fmt(ld.get("imports_ms"), ".0f"),
            _fmt(run.get("load_ms"), ".1f"),
            _fmt(ld.get("context_ms"), ".1f"),
            _fmt(ld.get("first_decode_ms"), ".1f"),
            _fmt(ld.get("jit_cache_ms"), ".1f"),
            _fmt(run.get("eval_tps"), ".2f") + (f" ({run['n_eval']} tok)" if "n_eval" in run else ""),
            _fmt(comp.get("eval_tps") or (1e3 / comp["eval_ms_per_token"] if comp.get("eval_ms_per_token") else None),
                 ".2f"),
            *_bw_cells(lp, res["llama.cpp"].get(f"tg{res.get('n_gen', 128)}_tps")),
        ]) + " |")  # fmt: skip
    lines.append("")
    for res in results:
        lines.append(f"- {res['model']}: llama.cpp figures {res['llama.cpp']['source']}; "
                     f"llamapy pp/tg via {res['llamapy'].get('via', 'n/a')}.")  # fmt: skip
    return "\n".join(lines)


def _bw_cells(lp: dict[str, Any], lc_tps: float | None) -> list[str]:
    """weights a token (MB), llamapy's effective GB/s (its fraction of the read probe), and
    llama.cpp's effective GB/s over the same bytes."""
    wb = lp.get("weight_bytes_per_token")
    eff, frac = lp.get("eff_bw_gbs"), lp.get("bw_fraction")
    return [
        _fmt(wb / 1e6 if wb else None, ".1f"),
        _fmt(eff, ".2f") + (f" ({100 * frac:.0f} %)" if frac is not None else ""),
        _fmt(wb * lc_tps / 1e9 if wb and lc_tps else None, ".2f"),
    ]


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The SIMD_FLAGS /proc/cpuinfo lists (its first `flags` or `Features` line), in SIMD_FLAGS' order."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            have = set(value.split())
            return [f for f in SIMD_FLAGS if f in have]
    return []


def machine() -> dict[str, Any]:
    name = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": name, "flags": cpu_flags(), "cores": os.cpu_count(), "loadavg": os.getloadavg()}


def machine_line(mach: dict[str, Any]) -> str:
    return (f"{mach['cpu']}, {mach['cores']} cores, flags: {' '.join(mach.get('flags') or []) or 'none found'}; "
            f"load average at start {mach['loadavg'][0]:.2f}")  # fmt: skip


def write_results(md: str, cmd: str, mach: dict[str, Any], note: str) -> None:
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = "" if RESULTS.exists() else "# Benchmark results\n\nSections appended by the scripts in bench/.\n"
    text += (f"\n## compare.py — {date}\n\n"
             f"- command: `{cmd}`\n"
             f"- machine: {machine_line(mach)}\n")  # fmt: skip
    if note:
        text += f"- note: {note}\n"
    text += "\n" + md + "\n"
    with open(RESULTS, "a") as f:
        f.write(text)
    log(f"appended to {RESULTS}")


# -- the per-type table ---------------------------------------------------------------------


def per_type(qtype: str, path: Path, tools: dict[str, Path] | None, threads: int, reps: int, n_gen: int,
             timeout: float | None, rounds: int = 1) -> dict[str, Any]:  # fmt: skip
    """tgN of one `--pure` file: llama-bench and llamapy bench side by side (alternately, `rounds`
    times), with llamapy's bandwidth fields."""
    res: dict[str, Any] = {"type": qtype, "path": str(path), "file_bytes": path.stat().st_size, "n_gen": n_gen}
    key = f"tg{n_gen}_tps"

    def lc_run(_: int) -> dict[str, Any]:
        if tools:
            try:
                return llama_cpp.bench_tps(llama_cpp.run_bench(tools, path, p=0, n=n_gen, t=threads, reps=reps,
                                                               timeout=timeout))  # fmt: skip
            except (RuntimeError, ValueError) as e:
                log(f"llama-bench on {path.name}: {e}")
        return {}

    lc, lp, res["round_ratios"] = alternate(rounds, lc_run,
                                            lambda _: llamapy_bench(path, threads, reps, timeout, n_prompt=0, n_gen=n_gen))
    res["llama.cpp"] = lc.get(key)
    res["llamapy"] = lp.get(key)
    res["llamapy_via"] = lp.get("via")
    res.update({k: lp[k] for k in BW_FIELDS if k in lp})
    return res


def at_depth(model: Path, depth: int, cache_type: str, tools: dict[str, Path] | None, threads: int, reps: int,
             n_gen: int, timeout: float | None, rounds: int = 1) -> dict[str, Any]:  # fmt: skip
    """tgN after `depth` cells of history with K and V caches of `cache_type`: llama-bench and
    llamapy bench side by side (alternately, `rounds` times)."""
    res: dict[str, Any] = {"model": model.stem, "depth": depth, "cache_type": cache_type, "n_gen": n_gen}
    flags = ["-d", str(depth), "-ctk", cache_type, "-ctv", cache_type]
    key = f"tg{n_gen}_tps"

    def lc_run(_: int) -> dict[str, Any]:
        if tools:
            try:
                lc = llama_cpp.run_bench(tools, model, p=0, n=n_gen, t=threads, reps=reps, extra=flags, timeout=timeout)
                return llama_cpp.bench_tps(lc)
            except (RuntimeError, ValueError) as e:
                log(f"llama-bench -d {depth} -ctk {cache_type} on {model.name}: {e}")
        return {}

    def lp_run(_: int) -> dict[str, Any]:
        cmd = [*LLAMAPY, "bench", str(model), "-p", "0", "-n", str(n_gen), "-t", str(threads), "-r", str(reps),
               "--probe-mib", "0", "-o", "json", *flags]  # fmt: skip
        r = llama_cpp.run_child(cmd, env=child_env(), timeout=timeout)
        if r.rc == 0:
            return llama_cpp.bench_tps(json.loads(r.stdout))
        log(f"llamapy bench -d {depth} -ctk {cache_type} failed (exit {r.rc}): {r.stderr.strip()[-500:]}")
        return {}

    lc, lp, res["round_ratios"] = alternate(rounds, lc_run, lp_run)
    res["llama.cpp"], res["llamapy"] = lc.get(key), lp.get(key)
    return res


def depth_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | cache type (K and V) | test | llamapy (tok/s) | llama.cpp (tok/s) | ratio | bar ≥ 1.0× |",
             "|---|---|---|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        a, b = r.get("llamapy"), r.get("llama.cpp")
        ratio = a / b if a and b else None
        status = "n/a" if ratio is None else "met" if ratio >= 1.0 else "NOT MET"
        cells = [r["model"], r["cache_type"], f"tg{r['n_gen']} @ d{r['depth']}", _fmt(a, ".2f"), _fmt(b, ".2f"),
                 _ratio_cell(ratio, r.get("round_ratios"), f"tg{r['n_gen']}_tps"), status]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_type_markdown(rows: list[dict[str, Any]]) -> str:
    n = rows[0]["n_gen"] if rows else 64
    lines = [f"| type | file (MiB) | weights a token (MB) | llamapy tg{n} (tok/s) | llama.cpp tg{n} (tok/s) | ratio | "
             f"bar ≥ {PER_TYPE_BAR:g}× | llamapy eff GB/s (of its probe) | llama.cpp eff GB/s |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    for r in rows:
        a, b = r.get("llamapy"), r.get("llama.cpp")
        ratio = a / b if a and b else None
        status = "n/a" if ratio is None else "met" if ratio >= PER_TYPE_BAR else "NOT MET"
        weights, lp_eff, lc_eff = _bw_cells(r, b)
        cells = [r["type"], f"{r['file_bytes'] / 2**20:.0f}", weights, _fmt(a, ".2f"), _fmt(b, ".2f"),
                 _ratio_cell(ratio, r.get("round_ratios"), f"tg{n}_tps"), status, lp_eff, lc_eff]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["default", "tiny32", "llama1b"],
                    help="paths, or 'default' / 'tiny32' / 'llama1b' / 'qwen3moe8' / 'gptoss6'")  # fmt: skip
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions for llama-bench and llamapy bench")
    ap.add_argument("--rounds", type=int, default=1,
                    help="tok/s measured this many times, llama.cpp and llamapy alternately; medians reported")
    ap.add_argument("--no-build", action="store_true",
                    help="do not build llama.cpp nor make model files (use what exists)")  # fmt: skip
    ap.add_argument("--build-timeout", type=float, default=3600, help="seconds per build or quantization step")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per measured child")
    ap.add_argument("--write", action="store_true", help=f"append a dated section to {RESULTS.name}")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    g = ap.add_argument_group("the 1B shape and the per-type table (bench/models1b.py)")
    g.add_argument("--types", help="per-type table: 'all' or comma-separated types (q4_0,q4_k,…; f32 only by name)")
    g.add_argument("-n", "--n-gen", type=int, default=64, help="tokens generated per type (tgN)")
    g.add_argument("--only-types", action="store_true", help="the per-type table alone (no --models)")
    g.add_argument("--models-dir", help="where the 1B-shape files are cached "
                   "(default $LLAMAPY_BENCH_MODELS, else $LLAMAPY_BENCH_CACHE/models)")  # fmt: skip
    g.add_argument("--llama1b", help="the 1B-shape Q4_K_M file (default $LLAMAPY_LLAMA1B, else in --models-dir)")
    g.add_argument("--llama1b-f16", help="its F16 source (default $LLAMAPY_LLAMA1B_F16, else in --models-dir)")
    d = ap.add_argument_group("the history table")
    d.add_argument("--depth", type=int, default=0, help="tg after this many cells of history (0: no table)")
    d.add_argument("--cache-types", default="f16,q8_0,q4_0", help="cache types of the history table")
    d.add_argument("--only-depth", action="store_true", help="the history table alone (no main table)")
    a = ap.parse_args(argv)
    try:
        types = models1b.parse_types(a.types) if a.types else []
    except ValueError as e:
        ap.error(f"--types: {e}")
    if a.only_types and not types:
        ap.error("--only-types needs --types")
    if a.n_gen < 1:
        ap.error("-n must be >= 1")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if a.only_depth and a.depth <= 0:
        ap.error("--only-depth needs --depth")
    cache_types = [c.strip() for c in a.cache_types.split(",") if c.strip()]

    mach = machine()
    log(f"machine: {machine_line(mach)}")
    if mach["loadavg"][0] > (mach["cores"] or 1):
        log(f"warning: load average {mach['loadavg'][0]:.1f} on {mach['cores']} cores: the figures will be unreliable")
    tools, why = llama_cpp.ensure(allow_build=not a.no_build, timeout=a.build_timeout)
    note = ""
    if tools is None:
        note = f"llama.cpp figures from the reference file, NOT measured in this run: {why}"
        log(note)
    mpaths = models1b.paths(a.models_dir, a.llama1b, a.llama1b_f16)
    names = [] if a.only_types else a.models
    quantize = None
    if (types or {"llama1b", *models_moe.FILES} & set(names)) and not a.no_build:  # after llama.cpp's build, which configures it
        quantize, why = models1b.ensure_quantize(allow_build=True, timeout=a.build_timeout)
        if quantize is None:
            log(f"{why}: only 1B-shape files that exist are used")
    models = resolve_models(names, mpaths, quantize)
    results = []
    for kind, model in models if not a.only_depth else []:
        log(f"== {model.name}")
        n_gen = 64 if kind in N_GEN_64 else 128
        res: dict[str, Any] = {"model": model.stem, "path": str(model), "kind": kind, "n_gen": n_gen}
        log(f"llama.cpp: llama-bench (and llama-completion once), llamapy: bench; {a.rounds} round(s)")
        lc, lp, res["round_ratios"] = alternate(  # (called at once: the loop's model and n_gen)
            a.rounds, lambda i: llamacpp_figures(tools, model, a.threads, a.reps, a.timeout, n_gen, completion=i == 0),  # noqa: B023
            lambda i: llamapy_bench(model, a.threads, a.reps, a.timeout, n_gen=n_gen))  # noqa: B023  # fmt: skip
        res["llama.cpp"] = lc
        log(f"llamapy: run -n {n_gen} -c 512 (peak RSS)")
        try:
            lp["run"] = llamapy_run(model, a.threads, a.timeout, n_gen)
        except RuntimeError as e:
            log(str(e))
        log("llamapy: imports alone, load probe")
        lp["imports"] = import_rss()
        try:
            lp["load"] = llamapy_load(model, a.threads, a.timeout)
        except (RuntimeError, ValueError) as e:
            log(str(e))
        res["llamapy"] = lp
        results.append(res)
    typed: list[dict[str, Any]] = []
    for qtype in types:
        log(f"== 1B shape --pure {qtype}")
        try:
            path = models1b.ensure_file(mpaths, qtype, quantize, a.build_timeout)
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            log(f"{qtype} left out: {e}")
            continue
        typed.append(per_type(qtype, path, tools, a.threads, a.reps, a.n_gen, a.timeout, a.rounds))
    deep: list[dict[str, Any]] = []
    for kind, model in models if a.depth > 0 else []:
        for ct in cache_types:
            log(f"== {model.name}: tg after {a.depth} cells, {ct} cache")
            deep.append(at_depth(model, a.depth, ct, tools, a.threads, a.reps, 64 if kind in N_GEN_64 else 128,
                                 a.timeout, a.rounds))  # fmt: skip
    parts = [f"machine: {machine_line(mach)}"]
    if results:
        parts.append((f"tok/s: medians of {a.rounds} alternating rounds (ratio range in brackets)\n\n" if a.rounds > 1
                      else "") + markdown(results))  # fmt: skip
    if deep:
        parts.append(f"With history: -t {a.threads}, -r {a.reps}, {a.rounds} round(s):\n\n" + depth_markdown(deep))
    if typed:
        parts.append(f"Per type: the 1B shape quantized `llama-quantize --pure` to each type, -t {a.threads}, "
                     f"-r {a.reps}, {a.rounds} round(s):\n\n" + per_type_markdown(typed))  # fmt: skip
    md = "\n\n".join(parts)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": mach, "note": note, "results": results, "per_type": typed,
                                            "depth": deep},
                                           indent=2) + "\n")  # fmt: skip
    if a.write:
        cmd = "python bench/compare.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
        write_results("\n\n".join(parts[1:]), cmd.strip(), mach, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
