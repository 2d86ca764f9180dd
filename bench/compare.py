"""llamapy side by side with llama.cpp, in one run, on the same machine.

    python bench/compare.py                 # print the table
    python bench/compare.py --write         # …and append a dated section to bench/RESULTS.md
    python bench/compare.py --no-build      # never build llama.cpp: use it if built, else the reference
    python bench/compare.py --models tiny32 --reps 1 --json out.json

Models: the default model (python models/fetch_default.py) and tiny32
(../shared/reference/tiny32/tiny32-Q4_K_M.gguf); `--models` takes paths or the names
`default` and `tiny32`. Everything runs with 2 threads (-t 2).

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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402  (bench/llama_cpp.py, not the llama-cpp-python package)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"  # next to the checkout, and nowhere else
TINY32 = SHARED / "reference" / "tiny32" / "tiny32-Q4_K_M.gguf"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PROMPT = "Once upon a time, in a small village by the sea,"
LLAMAPY = [sys.executable, "-m", "llamapy"]

# metric: (higher is better, floor, goal)
BARS = {
    "tg128": (True, 0.5, 1.0),
    "pp512": (True, 1.0, 2.0),
    "peak_rss": (False, 2.0, 1.2),
    "load": (False, 2.0, None),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    """The environment of every llamapy child: the checkout's package first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def default_model() -> Path:
    r = subprocess.run([sys.executable, str(REPO / "models" / "fetch_default.py")], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"models/fetch_default.py failed: {r.stderr.strip()}")
    return Path(r.stdout.strip().splitlines()[-1])


def resolve_models(names: list[str]) -> list[Path]:
    out = []
    for n in names:
        if n == "default":
            out.append(default_model())
        elif n == "tiny32":
            out.append(TINY32)
        else:
            out.append(Path(n))
    for p in out:
        if not p.is_file():
            raise SystemExit(f"no such model: {p}")
    return out


# -- llamapy --------------------------------------------------------------------------------------


def llamapy_bench(model: Path, threads: int, reps: int, timeout: float | None) -> dict[str, Any]:
    """pp512/tg128 with `llamapy bench … -o json`, else with the Python API."""
    cmd = [*LLAMAPY, "bench", str(model), "-p", "512", "-n", "128", "-t", str(threads), "-r", str(reps), "-o", "json"]
    try:
        r = llama_cpp.run_child(cmd, env=child_env(), timeout=timeout)
        if r.rc == 0:
            tps = llama_cpp.bench_tps(json.loads(r.stdout))
            if "pp512_tps" in tps and "tg128_tps" in tps:
                return {**tps, "via": "llamapy bench"}
        log(f"llamapy bench failed (exit {r.rc}): {r.stderr.strip()[-500:]}; using the Python API")
    except (ValueError, OSError) as e:
        log(f"llamapy bench unusable ({e}); using the Python API")
    return {**api_bench(model, threads, reps), "via": "Python API"}


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


def llamapy_run(model: Path, threads: int, timeout: float | None) -> dict[str, Any]:
    """Peak RSS and llama_perf lines of `llamapy run -n 128 -c 512`."""
    cmd = [*LLAMAPY, "run", str(model), "-p", PROMPT, "-n", "128", "-c", "512", "-t", str(threads), "--temp", "0"]
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
                     timeout: float | None) -> dict[str, Any]:  # fmt: skip
    if tools:
        out: dict[str, Any] = {"source": "measured in this run"}
        try:
            out.update(llama_cpp.bench_tps(llama_cpp.run_bench(tools, model, t=threads, reps=reps, timeout=timeout)))
        except (RuntimeError, ValueError) as e:
            log(f"llama-bench on {model.name}: {e}")
        try:
            out.update({"completion": llama_cpp.run_completion(tools, model, PROMPT, t=threads, timeout=timeout)})
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


# -- report -------------------------------------------------------------------------------------


def _status(metric: str, ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    higher, floor, goal = BARS[metric]
    ok = (lambda x, b: x >= b) if higher else (lambda x, b: x <= b)
    if goal is not None and ok(ratio, goal):
        return "goal met"
    return "ok (floor met)" if ok(ratio, floor) else "BELOW FLOOR"


def _bar(metric: str) -> str:
    higher, floor, goal = BARS[metric]
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
    metrics = [
        ("tg128", "generation tg128 (tok/s)", lp.get("tg128_tps"), lc.get("tg128_tps"), ".2f"),
        ("pp512", "prompt pp512 (tok/s)", lp.get("pp512_tps"), lc.get("pp512_tps"), ".2f"),
        ("peak_rss", "peak RSS, run -n 128 -c 512 (MiB)", lp_rss / 1024 if lp_rss else None,
         lc_rss / 1024 if lc_rss else None, ".1f"),
        ("load", "load time, open → ready, kernel cache load apart (ms)", load.get("ready_ms"),
         comp.get("load_ms"), ".1f"),
    ]  # fmt: skip
    out = []
    for key, label, a, b, spec in metrics:
        r = ratio(a, b)
        # the speed issue sets bars for the default model; tiny32's ratios are reported only
        barred = "tiny32" not in res["model"]
        out.append([res["model"], label, _fmt(a, spec), _fmt(b, spec), _fmt(r, ".2f") + ("×" if r else ""),
                    _bar(key) if barred else "none (reported)",
                    _status(key, r) if barred else "-"])  # fmt: skip
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
                 "llama.cpp run: eval tok/s |")  # fmt: skip
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
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
        ]) + " |")  # fmt: skip
    lines.append("")
    for res in results:
        lines.append(f"- {res['model']}: llama.cpp figures {res['llama.cpp']['source']}; "
                     f"llamapy pp/tg via {res['llamapy'].get('via', 'n/a')}.")  # fmt: skip
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    name = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "loadavg": os.getloadavg()}


def write_results(md: str, cmd: str, mach: dict[str, Any], note: str) -> None:
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = "" if RESULTS.exists() else "# Benchmark results\n\nSections appended by the scripts in bench/.\n"
    text += (f"\n## compare.py — {date}\n\n"
             f"- command: `{cmd}`\n"
             f"- machine: {mach['cpu']}, {mach['cores']} cores; load average at start "
             f"{mach['loadavg'][0]:.2f}\n")  # fmt: skip
    if note:
        text += f"- note: {note}\n"
    text += "\n" + md + "\n"
    with open(RESULTS, "a") as f:
        f.write(text)
    log(f"appended to {RESULTS}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["default", "tiny32"], help="paths, or 'default' / 'tiny32'")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions for llama-bench and llamapy bench")
    ap.add_argument("--no-build", action="store_true", help="do not build llama.cpp (use it only if already built)")
    ap.add_argument("--build-timeout", type=float, default=3600, help="seconds per build step")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per measured child")
    ap.add_argument("--write", action="store_true", help=f"append a dated section to {RESULTS.name}")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    a = ap.parse_args(argv)

    mach = machine()
    if mach["loadavg"][0] > (mach["cores"] or 1):
        log(f"warning: load average {mach['loadavg'][0]:.1f} on {mach['cores']} cores: the figures will be unreliable")
    models = resolve_models(a.models)
    tools, why = llama_cpp.ensure(allow_build=not a.no_build, timeout=a.build_timeout)
    note = ""
    if tools is None:
        note = f"llama.cpp figures from the reference file, NOT measured in this run: {why}"
        log(note)
    results = []
    for model in models:
        log(f"== {model.name}")
        res: dict[str, Any] = {"model": model.stem, "path": str(model)}
        log("llama.cpp: llama-bench, llama-completion")
        res["llama.cpp"] = llamacpp_figures(tools, model, a.threads, a.reps, a.timeout)
        lp: dict[str, Any] = {}
        log("llamapy: bench")
        lp.update(llamapy_bench(model, a.threads, a.reps, a.timeout))
        log("llamapy: run -n 128 -c 512 (peak RSS)")
        try:
            lp["run"] = llamapy_run(model, a.threads, a.timeout)
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
    md = markdown(results)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": mach, "note": note, "results": results}, indent=2) + "\n")
    if a.write:
        cmd = "python bench/compare.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
        write_results(md, cmd.strip(), mach, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
