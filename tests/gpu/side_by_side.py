#!/usr/bin/env python3
"""Issue 29's H200 bars and issue 28's memory bar, side by side with llama.cpp's CUDA llama-bench,
on a GPU host right after `.gpu/check.sh` (which builds that llama-bench; run this in the same
device call, before the machine goes back):

  sweep   the 8B dense shape (run_all's `b8`: Llama-3.1-8B's, Q4_K) at -ngl 0, 8, 16, 24, all:
          tg64 of `llamapy bench` and `llama-bench` with the same flags and threads, alternating;
          the bar: llamapy >= 1.0x at each point, rising with -ngl;
  moe     the full Qwen3-30B-A3B shape (48 layers, 128 experts, 8 used; Q4_K, Q6_K V / down /
          output; ~18 GB written here) at -ngl all with --n-cpu-moe 48 and 24: tg64 both sides
          (the bar: >= 1.0x with the same flags);
  memory  GPU memory at -ngl all of both (nvidia-smi's memory.used sampled every 50 ms during a
          pp512 + tg16 run, peak minus the idle figure before it); the bar: llamapy <= llama.cpp
          + 10 %;
  modes   (only when asked: --only modes) tg64 of `llamapy bench -ngl all` on the sweep's shape in
          the default mode (the large decode products on int8: mmvq.cu) and with
          --f32-activations (every product on float32 activations), alternating: what the q8_1
          path gains (docs/architecture.md, CUDA kernels: reasoned, not yet measured).

It finds check.sh's scratch folder (the newest /tmp/tmp.*/ with lc/build/bin/llama-bench, whose
site/ holds the carried wheels and m/ the models it wrote) unless --llama-bench is given, and
writes what it writes into $OUT/side_by_side.md (else bench/side_by_side.md). Every step has its
share of --deadline seconds; a step out of time is reported, not run.

usage: python3 tests/gpu/side_by_side.py [--only sweep,moe,memory,modes] [--deadline 300] [--threads N]
       [--llama-bench PATH] [--moe-layers 48] [--reps 2]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

SWEEP_NGL = ("0", "8", "16", "24", "all")
MOE_NCMOE = (48, 24)
# Qwen3-30B-A3B's config.json (tests/model/moe_models.py SHAPES["qwen3-30b-a3b"])
QWEN3_30B = dict(n_layer=48, n_embd=2048, n_ff_exp=768, n_expert=128, n_expert_used=8, n_head=32, n_head_kv=4,
                 head_dim=128, n_vocab=151936, rope_base=1_000_000.0)  # fmt: skip


def scratch(explicit: str | None) -> tuple[Path | None, Path | None]:
    """(llama-bench, check.sh's scratch folder) — the newest folder that has a built llama-bench."""
    if explicit:
        return Path(explicit), None
    cands = sorted(glob.glob("/tmp/tmp.*/lc/build/bin/llama-bench"), key=os.path.getmtime)
    if not cands:
        return None, None
    lb = Path(cands[-1])
    return lb, lb.parents[3]


def use_site(w: Path | None) -> None:
    """The wheels check.sh installed (gguf, typer) for this process and the `llamapy` it runs."""
    site = w / "site" if w else None
    if site and site.is_dir():
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def write_qwen3moe(path: Path, n_layer: int, seed: int = 5) -> Path:
    """Qwen3-30B-A3B's shape with random K-quant weights (run_all's `_kquant_rows`: gguf-py cannot
    quantize K-quants), an F32 router and norms, and run_all's placeholder vocabulary."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    import run_all

    s = {**QWEN3_30B, "n_layer": n_layer}
    rng = np.random.default_rng(seed)
    hd, e = s["head_dim"], s["n_embd"]

    def mat(rows: int, cols: int, qname: str, n: int = 1, gain: float = 1.0) -> np.ndarray:
        raw = run_all._kquant_rows(qname, n * rows, cols, gain, rng)
        return raw.reshape(n, rows, -1) if n > 1 else raw

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("qwen3-30b-a3b-shaped")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(e)
    w.add_feed_forward_length(6144)
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s["n_expert"])
    w.add_expert_used_count(s["n_expert_used"])
    w.add_expert_feed_forward_length(s["n_ff_exp"])
    run_all.add_placeholder_vocab(w, s["n_vocab"])

    def add(name: str, data: np.ndarray, qname: str) -> None:
        w.add_tensor(name, data, raw_dtype=None if qname == "F32" else Q[qname])

    def vec(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    ne, ff = s["n_expert"], s["n_ff_exp"]
    add("token_embd.weight", mat(s["n_vocab"], e, "Q4_K", gain=float(np.sqrt(e))), "Q4_K")
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", vec(e), "F32")
        add(p + "attn_q.weight", mat(s["n_head"] * hd, e, "Q4_K"), "Q4_K")
        add(p + "attn_k.weight", mat(s["n_head_kv"] * hd, e, "Q4_K"), "Q4_K")
        add(p + "attn_v.weight", mat(s["n_head_kv"] * hd, e, "Q6_K"), "Q6_K")
        add(p + "attn_q_norm.weight", vec(hd), "F32")
        add(p + "attn_k_norm.weight", vec(hd), "F32")
        add(p + "attn_output.weight", mat(e, s["n_head"] * hd, "Q4_K", gain=0.5), "Q4_K")
        add(p + "ffn_norm.weight", vec(e), "F32")
        add(p + "ffn_gate_inp.weight", rng.standard_normal((ne, e), dtype=np.float32) * np.float32(2 / np.sqrt(e)), "F32")
        add(p + "ffn_gate_exps.weight", mat(ff, e, "Q4_K", n=ne), "Q4_K")
        add(p + "ffn_up_exps.weight", mat(ff, e, "Q4_K", n=ne), "Q4_K")
        add(p + "ffn_down_exps.weight", mat(e, ff, "Q6_K", n=ne, gain=0.5), "Q6_K")
    add("output_norm.weight", np.ones(e, np.float32), "F32")
    add("output.weight", mat(s["n_vocab"], e, "Q6_K", gain=4.0), "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class GpuMemory:
    """Peak `memory.used` (MiB) of GPU 0 while a command runs, from nvidia-smi's 50 ms loop."""

    def __init__(self) -> None:
        self.peak = 0

    def idle(self) -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return int(out.split()[0])

    def run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        mon = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True)  # fmt: skip

        def read() -> None:
            for line in mon.stdout or ():
                if line.strip().isdigit():
                    self.peak = max(self.peak, int(line))

        t = threading.Thread(target=read, daemon=True)
        t.start()
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        finally:
            mon.terminate()
            t.join(5)


def rates(text: str) -> dict[tuple[str, str, str], float]:
    """(ngl, n_cpu_moe, test) -> t/s of a llama-bench / llamapy bench JSON list."""
    try:
        rows = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return {}
    out = {}
    for r in rows:
        test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        out[(str(r["n_gpu_layers"]), str(r.get("n_cpu_moe", 0)), test)] = float(r["avg_ts"])
    return out


class Run:
    def __init__(self, args: Any, lb: Path | None) -> None:
        self.args, self.lb = args, lb
        self.t0 = time.time()
        self.lines: list[str] = []

    def left(self) -> float:
        return self.args.deadline - (time.time() - self.t0)

    def say(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)

    def both(self, model: Path, flags: list[str], lp_ngl: str, lc_ngl: str, share: float) -> tuple[dict, dict]:
        """llamapy bench and llama-bench on the same model and flags (llama.cpp's `all` is 99),
        each given half of `share` seconds; their JSON rates."""
        common = ["-t", str(self.args.threads), "-r", str(self.args.reps), "-o", "json", *flags]
        lp_cmd = ["llamapy", "bench", str(model), "-ngl", lp_ngl, "--probe-mib", "0", *common]
        lc_cmd = [str(self.lb), "-m", str(model), "-ngl", lc_ngl, *common] if self.lb else None
        out = []
        for cmd in (lp_cmd, lc_cmd):
            if cmd is None:
                out.append({})
                continue
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, share / 2))
                out.append(rates(r.stdout))
                if r.returncode:
                    self.say(f"- `{' '.join(cmd[:2])}` exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
            except subprocess.TimeoutExpired:
                self.say(f"- `{' '.join(cmd[:2])} … {' '.join(flags)}`: out of time ({share / 2:.0f} s)")
                out.append({})
        return out[0], out[1]

    def table(self, lp: dict, lc: dict, key_of: Any) -> None:
        self.say("| point | test | llamapy t/s | llama.cpp t/s | ratio |")
        self.say("|---|---|---:|---:|---:|")
        for k in sorted(set(lp) | set(lc), key=key_of):
            a, b = lp.get(k), lc.get(k)
            ratio = f"{a / b:.3f}" if a and b else "-"
            self.say(f"| -ngl {k[0]} -ncmoe {k[1]} | {k[2]} | {a and round(a, 1)} | {b and round(b, 1)} | {ratio} |")


def model_path(w: Path | None, name: str, write: Any) -> Path:
    p = (w / "m" / f"{name}.gguf") if w else Path("/tmp") / f"llamapy-sbs-{name}.gguf"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        t = time.time()
        write(p)
        print(f"{name}: {p.stat().st_size / 2**30:.1f} GiB written in {time.time() - t:.0f} s", flush=True)
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="sweep,moe,memory")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for everything")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--moe-layers", type=int, default=QWEN3_30B["n_layer"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--shape", default="b8", choices=["b8", "b1", "tiny32"], help="sweep / memory model (dry runs: tiny32)")
    args = ap.parse_args()
    lb, w = scratch(args.llama_bench)
    use_site(w)
    run = Run(args, lb)
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    run.say(f"# side by side, {time.strftime('%Y-%m-%d %H:%M:%S')}, llama-bench: {lb or 'not found (llamapy only)'}, "
            f"{args.threads} threads")  # fmt: skip
    import run_all

    def dense(p: Path) -> Path:
        return run_all.write_model(p, **run_all.SWEEP_SHAPES[args.shape])

    by_point = {v: i for i, v in enumerate(SWEEP_NGL)}
    for i, step in enumerate(steps):
        share = run.left() / (len(steps) - i)
        if share < 20:
            run.say(f"\n## {step}: out of time")
            continue
        if step == "sweep":
            run.say(f"\n## -ngl sweep, {args.shape} dense shape, tg64 (issue 29, b8: >= 1.0x at each point, rising)")
            m = model_path(w, args.shape, dense)
            lp: dict = {}
            lc: dict = {}
            for ngl in SWEEP_NGL:  # one -ngl at a time, alternating sides
                a, b = run.both(m, ["-p", "0", "-n", "64"], ngl, "99" if ngl == "all" else ngl, share / len(SWEEP_NGL))
                lp.update({(ngl, *k[1:]): v for k, v in a.items()})  # (llamapy says 33, llama.cpp 99 for all)
                lc.update({(ngl, *k[1:]): v for k, v in b.items()})
            run.table(lp, lc, lambda k: by_point.get(k[0], 9))
        elif step == "moe":
            run.say(f"\n## Qwen3-30B-A3B shape ({args.moe_layers} layers), experts on the CPU, tg64 (issue 29: >= 1.0x)")
            m = model_path(w, f"qwen3moe{args.moe_layers}", lambda p: write_qwen3moe(p, args.moe_layers))
            lp, lc = {}, {}
            for ncm in dict.fromkeys(min(n, args.moe_layers) for n in MOE_NCMOE):
                a, b = run.both(m, ["-p", "0", "-n", "64", "-ncmoe", str(ncm)], "all", "99", share / len(MOE_NCMOE))
                lp.update({("all", *k[1:]): v for k, v in a.items()})
                lc.update({("all", *k[1:]): v for k, v in b.items()})
            run.table(lp, lc, lambda k: (-int(k[1]), k[2]))
        elif step == "memory":
            run.say("\n## GPU memory at -ngl all, pp512 + tg16 (issue 28: llamapy <= llama.cpp + 10 %)")
            m = model_path(w, args.shape, dense)
            common = ["-p", "512", "-n", "16", "-r", "1", "-t", str(args.threads), "-o", "json"]
            cmds = {"llamapy": ["llamapy", "bench", str(m), "-ngl", "all", "--probe-mib", "0", *common]}
            if lb:
                cmds["llama.cpp"] = [str(lb), "-m", str(m), "-ngl", "99", *common]
            peaks = {}
            for who, cmd in cmds.items():
                mem = GpuMemory()
                try:
                    base = mem.idle()
                    r = mem.run(cmd, share / 2)
                    peaks[who] = mem.peak - base
                    run.say(f"- {who}: peak {mem.peak - base} MiB above the idle {base} MiB (exit {r.returncode})")
                except (subprocess.TimeoutExpired, OSError, ValueError, IndexError) as e:
                    run.say(f"- {who}: not measured ({type(e).__name__}: {e})")
            if len(peaks) == 2 and peaks["llama.cpp"] > 0:
                run.say(f"- ratio llamapy / llama.cpp: {peaks['llamapy'] / peaks['llama.cpp']:.3f}")
        elif step == "modes":
            run.say(f"\n## -ngl all, {args.shape} dense shape, tg64: default (int8 decode products) vs --f32-activations")
            m = model_path(w, args.shape, dense)
            common = ["-ngl", "all", "-p", "0", "-n", "64", "-r", str(args.reps), "-t", str(args.threads), "-o", "json",
                      "--probe-mib", "0"]  # fmt: skip
            got: dict[str, list[float]] = {"default": [], "--f32-activations": []}
            for _ in range(2):  # alternating
                for mode in got:
                    cmd = ["llamapy", "bench", str(m), *common, *([mode] if mode != "default" else [])]
                    try:
                        r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, share / 4))
                        got[mode] += list(rates(r.stdout).values())
                    except subprocess.TimeoutExpired:
                        run.say(f"- {mode}: out of time ({share / 4:.0f} s)")
            for mode, ts in got.items():
                run.say(f"- {mode}: {' '.join(f'{t:.1f}' for t in ts) or '-'} t/s")
            if all(got.values()):
                run.say(f"- ratio default / f32: {max(got['default']) / max(got['--f32-activations']):.3f}")
        else:
            run.say(f"\n## {step}: unknown step (sweep, moe, memory, modes)")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "side_by_side.md").write_text("\n".join(run.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
