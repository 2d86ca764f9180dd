"""Speculative decoding side by side: `llamapy run` with a draft model (-md) or n-gram drafts
(--spec-type ngram-simple) against llama.cpp's `llama-speculative-simple` with the same flags, and
both programs without speculation (`llamapy run`, `llama-completion`) for scale; alternated in
rounds, greedy, `--ignore-eos -n N`.

    python bench/spec_speed.py [--target FILE] [--draft FILE] [-n 128] [-t 2] [--rounds 2] [--n-max 3 8]

Cases:
  draft   TARGET with DRAFT as its draft model, --spec-draft-n-max each of --n-max. Default: the
          default model (SmolLM2-135M Q4_1) as the draft and, as the target, the same model's
          weights in F32 (`llama-quantize --allow-requantize ... F32`, made once in llama.cpp's
          bench cache): a target ~6x the draft's bytes whose greedy tokens the draft mostly guesses.
  ngram   ngram-simple (--spec-ngram-simple-size-n 8, size-m 24) on the draft model with a
          prompt that asks it to copy a passage of tempest.txt: text that repeats what came before.
Figures: decode tokens/s as each program reports it (llamapy: `eval time`'s runs / ms, its
drafting included; llama-speculative-simple: `decoded N tokens in S seconds`; llama-completion:
`eval time`), the acceptance each prints, and whether the greedy texts agree with the plain runs.
Builds llama-speculative-simple on first use (`python bench/llama_cpp.py build --speculative`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEMPEST = REPO.parent / "shared" / "data" / "text" / "tempest.txt"


def _copy_prompt() -> str:
    text = TEMPEST.read_text() if TEMPEST.is_file() else "Full fathom five thy father lies. " * 20
    passage = " ".join(text[3000:4200].split())
    return f"Repeat the following text exactly.\n\nText: {passage}\n\nRepeated text: {passage[:80]}"


def _run(cmd: list[str]) -> tuple[str, str]:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {r.stderr[-1500:]}")
    return r.stdout, r.stderr


def _tps(err: str) -> float:
    """decode tokens/s: llama-speculative-simple's `decoded` line, else the `eval time` line"""
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    if m:
        return int(m.group(1)) / float(m.group(2))
    return llama_cpp.parse_perf(err)["eval_tps"]


def _accept(err: str) -> str:
    m = re.search(r"draft acceptance = ([\d.]+) \(\s*(\d+) accepted /\s*(\d+) generated\)", err)
    if m:
        return f"{float(m.group(1)) * 100:.1f} % ({m.group(2)}/{m.group(3)})"
    m = re.search(r"n_drafted = (\d+).*?n_accept\s+= (\d+)", err, re.S)
    return f"{100 * int(m.group(2)) / max(1, int(m.group(1))):.1f} % ({m.group(2)}/{m.group(1)})" if m else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-max", type=int, nargs="+", default=[3, 8])
    a = ap.parse_args()
    from llamapy.model.fetch import default_model_path

    tools, why = llama_cpp.ensure()
    if tools is None:
        print(f"llama.cpp is not available: {why}", file=sys.stderr)
        return 1
    spec_bin = str(llama_cpp.build_speculative())
    draft = a.draft or str(default_model_path())
    target = a.target
    if target is None:
        target = str(llama_cpp.cache_dir() / "models" / "smollm2-135m-f32-of-q4_1.gguf")
        if not Path(target).is_file():
            quantize = tools["llama-bench"].parent / "llama-quantize"
            _run([str(quantize), "--allow-requantize", draft, target, "F32"])
    common = ["-n", str(a.n), "-c", "2048", "--temp", "0", "-t", str(a.threads), "--ignore-eos"]
    story = "Once upon a time, in a small village by the sea,"
    ngram = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "8", "--spec-ngram-simple-size-m", "24"]
    llamapy = [sys.executable, "-m", "llamapy", "run"]
    cases: dict[str, tuple[list[str], list[str] | None]] = {}  # name: (llamapy flags, llama.cpp flags)
    for n_max in a.n_max:
        flags = ["-md", draft, "--spec-draft-n-max", str(n_max)]
        cases[f"draft n_max {n_max}"] = ([target, "-p", story, *flags], ["-m", target, "-p", story, *flags, "--spec-type", "draft-simple"])
    cases["target alone"] = ([target, "-p", story], None)
    cases["ngram-simple"] = ([draft, "-p", _copy_prompt(), *ngram], ["-m", draft, "-p", _copy_prompt(), *ngram])
    cases["draft model alone"] = ([draft, "-p", _copy_prompt()], None)
    rows: dict[tuple[str, str], list[float]] = {}
    accept: dict[tuple[str, str], str] = {}
    texts: dict[tuple[str, str], str] = {}
    for _ in range(a.rounds):
        for name, (ours, theirs) in cases.items():
            plain_cmd = [str(tools["llama-completion"]), "-m", ours[0], *ours[1:3], *common, "-no-cnv"]
            runs = [("llamapy", llamapy + ours + common),
                    ("llama.cpp", [spec_bin, *theirs, *common] if theirs else plain_cmd)]  # fmt: skip
            for prog, cmd in runs:
                out, err = _run(cmd)
                rows.setdefault((name, prog), []).append(_tps(err))
                accept[(name, prog)] = _accept(err)
                texts[(name, prog)] = out
    print(f"target {Path(target).name}, draft {Path(draft).name}, -n {a.n} -t {a.threads}, {a.rounds} rounds; decode tok/s (rounds)")
    for (name, prog), tps in rows.items():
        print(f"  {name:18s} {prog:9s} {statistics.median(tps):8.2f} {[round(x, 2) for x in tps]}  accept {accept[(name, prog)]}")
    for name, (ours, _) in cases.items():
        plain = "target alone" if ours[0] == target else "draft model alone"
        if name != plain:  # speculation keeps the plain run's greedy text (the first -n tokens)
            same = texts[(name, "llamapy")].startswith(texts[(plain, "llamapy")][:200])
            print(f"  {name}: llamapy's text {'equals' if same else 'DIFFERS from'} its plain run's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
