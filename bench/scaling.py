"""Decode speed against context length and against model size, llamapy beside llama.cpp.

    python bench/scaling.py                          # table + bench/scaling.png
    python bench/scaling.py --depths 128 512 2048 --n-gen 64 --reps 2 --models tiny32
    python bench/scaling.py --no-llama-cpp           # llamapy alone

For each model (tiny32 and the default model unless --models says otherwise) and each history
length d (128, 256, 512, 1024, 2048 tokens), tok/s of --n-gen single-token decodes that attend
over d tokens already in the KV cache, with 2 threads.

- llamapy: one Model and one context of n_ctx = max(d) + n_gen (a fixed context, as in
  `llamapy run -c N`); the history grows through the depths: random tokens fill the cache
  up to d (untimed, in n_batch pieces), then n_gen decodes are timed; the next depth
  keeps that history and fills on. A few warm-up decodes first. --reps repeats the whole pass
  on a cleared cache and averages.
- llama.cpp: `llama-bench -p 0 -n N_GEN -d 128,256,… -t 2 -o json` (its own protocol:
  a fresh context of d + n_gen cells per test, the depth filled untimed), if bench/llama_cpp.py
  finds or builds it; otherwise that column is n/a.

The plot (bench/scaling.png) needs matplotlib, which is not a llamapy dependency: without it
the table is printed and the plot skipped (`pip install matplotlib` to get it).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare  # noqa: E402
import llama_cpp  # noqa: E402  (bench/llama_cpp.py)

REPO = HERE.parent
PNG = HERE / "scaling.png"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def llamapy_scaling(path: Path, depths: list[int], n_gen: int, threads: int, reps: int) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from llamapy.context import Context, ContextOptions, Model, ModelOptions

    n_ctx = max(depths) + n_gen
    co = ContextOptions(n_ctx=n_ctx, n_threads=threads)
    m = Model(path, ModelOptions(), co)
    ctx = Context(m, co)
    rng = np.random.default_rng(0)
    n_vocab = m.params.n_vocab
    tps: dict[int, list[float]] = {d: [] for d in depths}
    try:
        for i in range(4):  # warm-up: loads the JIT cache, settles the thread pool
            ctx.decode([0], [i], 0)
        for _ in range(reps):
            ctx.kv.clear()
            filled = 0
            for d in sorted(depths):
                if filled > d:  # depths closer than n_gen: start this one afresh
                    ctx.kv.clear()
                    filled = 0
                for b0 in range(filled, d, ctx.n_batch):
                    b1 = min(d, b0 + ctx.n_batch)
                    ctx.decode(rng.integers(0, n_vocab, b1 - b0, dtype=np.int32), np.arange(b0, b1), 0)
                tok = int(rng.integers(0, n_vocab))
                t0 = time.perf_counter()
                for i in range(n_gen):
                    ctx.decode([tok], [d + i], 0)
                    tok = int(rng.integers(0, n_vocab))
                tps[d].append(n_gen / (time.perf_counter() - t0))
                filled = d + n_gen
                log(f"  llamapy {path.stem} d={d}: {tps[d][-1]:.2f} tok/s")
        return {
            "n_params": m.info.n_params,
            "file_mib": m.info.file_size / 2**20,
            "tps": {d: float(np.mean(v)) for d, v in tps.items()},
        }
    finally:
        ctx.free()
        m.free()


def llamacpp_scaling(tools: dict[str, Path], path: Path, depths: list[int], n_gen: int, threads: int,
                     reps: int) -> dict[int, float]:  # fmt: skip
    recs = llama_cpp.run_bench(tools, path, p=0, n=n_gen, t=threads, reps=reps,
                               extra=["-d", ",".join(map(str, depths))])  # fmt: skip
    return {int(r["n_depth"]): float(r["avg_ts"]) for r in recs if r.get("n_gen") and "n_depth" in r}


def markdown(rows: list[dict[str, Any]], depths: list[int], n_gen: int) -> str:
    head = ["model", "params (M)", "file (MiB)", "engine"] + [f"d={d}" for d in depths] + [f"d={depths[-1]} / d={depths[0]}"]
    lines = [f"tok/s of tg{n_gen} after d tokens of history, -t 2", "",
             "| " + " | ".join(head) + " |", "|---|---:|---:|---|" + "---:|" * (len(depths) + 1)]  # fmt: skip
    for r in rows:
        for engine in ("llamapy", "llama.cpp"):
            t = r.get(engine) or {}
            cells = [f"{t[d]:.2f}" if d in t else "n/a" for d in depths]
            keep = f"{t[depths[-1]] / t[depths[0]]:.2f}" if depths[-1] in t and t.get(depths[0]) else "n/a"
            lines.append("| " + " | ".join([r["model"], f"{r['n_params'] / 1e6:.1f}", f"{r['file_mib']:.1f}", engine,
                                            *cells, keep]) + " |")  # fmt: skip
    ratio_rows = [r for r in rows if r.get("llama.cpp")]
    if ratio_rows:
        lines += ["", "llamapy / llama.cpp:", "", "| model | " + " | ".join(f"d={d}" for d in depths) + " |",
                  "|---|" + "---:|" * len(depths)]  # fmt: skip
        for r in ratio_rows:
            a, b = r["llamapy"], r["llama.cpp"]
            lines.append("| " + " | ".join([r["model"]] + [f"{a[d] / b[d]:.2f}×" if d in b and b[d] else "n/a"
                                                            for d in depths]) + " |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], depths: list[int], n_gen: int, out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: plot skipped (pip install matplotlib to get bench/scaling.png)")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(rows):
        for engine, style in (("llamapy", "-o"), ("llama.cpp", "--s")):
            t = r.get(engine) or {}
            xs = [d for d in depths if d in t]
            if xs:
                ax1.plot(xs, [t[d] for d in xs], style, color=colors[i % len(colors)], label=f"{r['model']} — {engine}")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(depths, [str(d) for d in depths])
    ax1.set_yscale("log")
    ax1.set_xlabel("tokens of history")
    ax1.set_ylabel(f"decode tok/s (tg{n_gen}, -t 2)")
    ax1.set_title("decode speed against context length")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, which="both")
    by_size = sorted(rows, key=lambda r: r["n_params"])
    for engine, style in (("llamapy", "-o"), ("llama.cpp", "--s")):
        for j, d in enumerate((depths[0], depths[-1])):
            pts = [(r["n_params"] / 1e6, r[engine][d]) for r in by_size if (r.get(engine) or {}).get(d)]
            if pts:
                ax2.plot(*zip(*pts), style, color=colors[j], label=f"{engine}, d={d}")
    for r in by_size:
        ax2.annotate(r["model"], (r["n_params"] / 1e6, (r.get("llamapy") or {}).get(depths[0], 1)), fontsize=7)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("parameters (M)")
    ax2.set_ylabel("decode tok/s")
    ax2.set_title("decode speed against model size")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, which="both")
    from matplotlib.ticker import FormatStrFormatter, LogFormatter, ScalarFormatter

    for ax in (ax1, ax2):
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax2.xaxis.set_major_formatter(ScalarFormatter())
    ax2.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    log(f"wrote {out}")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny32", "default"], help="paths, or 'default' / 'tiny32'")
    ap.add_argument("--depths", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--n-gen", type=int, default=32, help="timed decodes per depth")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=1)
    ap.add_argument("--no-llama-cpp", action="store_true", help="llamapy alone")
    ap.add_argument("--no-build", action="store_true", help="use llama.cpp only if already built")
    ap.add_argument("--plot", default=str(PNG), help="where to write the PNG ('' for none)")
    ap.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    a = ap.parse_args(argv)
    depths = sorted(set(a.depths))
    mach = compare.machine()
    if mach["loadavg"][0] > (mach["cores"] or 1):
        log(f"warning: load average {mach['loadavg'][0]:.1f} on {mach['cores']} cores: the figures will be unreliable")
    tools, why = (None, "--no-llama-cpp") if a.no_llama_cpp else llama_cpp.ensure(allow_build=not a.no_build)
    if tools is None:
        log(f"llama.cpp column n/a: {why}")
    rows = []
    for path in compare.resolve_models(a.models):
        log(f"== {path.name}")
        lp = llamapy_scaling(path, depths, a.n_gen, a.threads, a.reps)
        row = {"model": path.stem, "n_params": lp["n_params"], "file_mib": lp["file_mib"], "llamapy": lp["tps"]}
        if tools:
            try:
                row["llama.cpp"] = llamacpp_scaling(tools, path, depths, a.n_gen, a.threads, a.reps)
            except (RuntimeError, ValueError) as e:
                log(f"llama-bench -d on {path.name}: {e}")
        rows.append(row)
    md = markdown(rows, depths, a.n_gen)
    print(md)
    if a.plot:
        plot(rows, depths, a.n_gen, Path(a.plot))
    if a.write:
        date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        cmd = "python bench/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
        text = "" if compare.RESULTS.exists() else "# Benchmark results\n\nSections appended by the scripts in bench/.\n"
        text += (f"\n## scaling.py — {date}\n\n- command: `{cmd.strip()}`\n- machine: {mach['cpu']}, {mach['cores']} "
                 f"cores; load average at start {mach['loadavg'][0]:.2f}\n")  # fmt: skip
        if tools is None:
            text += f"- llama.cpp: not measured ({why})\n"
        with open(compare.RESULTS, "a") as f:
            f.write(text + "\n" + md + "\n")
        log(f"appended to {compare.RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
