"""LoRA adapters side by side: `llamapy run --lora` and llama.cpp's `llama-completion --lora` on the
same model and adapter, alternated; each's own `llama_perf_context_print` lines (prompt eval and
eval t/s, llama.cpp and llamapy print the same ones), and both without the adapter for scale.

    python bench/lora_speed.py [MODEL] [--rank 16] [--targets attn,ffn] [-n 64] [-t 2] [--rounds 2]

The adapter: random F16 pairs (convert_lora_to_gguf.py's usual type) of rank `--rank` for every
layer's attn_q/k/v/output (attn) and ffn_gate/up/down (ffn), written once to a temporary folder
by tests/model/family_models.write_lora_gguf. The prompt is 5 paragraphs of tempest.txt (~400
tokens), greedy (`--temp 0`), `-c 1024`. The greedy texts of the last round are compared: how
many leading words agree (the two programs' 8-bit activations round differently, so a text may
part at a near-tie).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEMPEST = REPO.parent / "shared" / "data" / "text" / "tempest.txt"
sys.path.insert(0, str(REPO / "tests" / "model"))
TARGETS = {"attn": "attn_q|attn_k|attn_v|attn_output", "ffn": "ffn_gate|ffn_up|ffn_down"}


def _prompt() -> str:
    paragraphs = [p for p in TEMPEST.read_text().split("\n\n") if p.strip()] if TEMPEST.is_file() else []
    return "\n\n".join(paragraphs[20:25]) or "Once upon a time, " * 60


def _run(cmd: list[str], cwd: Path | None = None) -> tuple[dict[str, float], str]:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {r.stderr[-1500:]}")
    return llama_cpp.parse_perf(r.stderr), r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="attn,ffn")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from family_models import write_lora_gguf

    from llamapy.model.fetch import default_model_path

    model = a.model or str(default_model_path())
    tools, why = llama_cpp.ensure()
    if tools is None:
        print(f"llama.cpp is not available: {why}", file=sys.stderr)
        return 1
    keys = "|".join(TARGETS[k] for k in a.targets.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="lp_lora_bench_"))
    from gguf import GGMLQuantizationType as T

    adapter = write_lora_gguf(Path(model), tmp / "adapter.gguf", (rf"blk\.\d+\.({keys})\.weight",), rank=a.rank,
                              alpha=2.0 * a.rank, dtype=T.F16, gain=0.05)  # fmt: skip
    prompt = _prompt()
    common = ["-p", prompt, "-n", str(a.n), "-c", "1024", "--temp", "0", "-t", str(a.threads)]
    runs = {
        "llama.cpp": [str(tools["llama-completion"]), "-m", model, *common, "-no-cnv"],
        "llamapy": [sys.executable, "-m", "llamapy", "run", model, *common],
    }
    figures: dict[tuple[str, bool], list[dict[str, float]]] = {}
    texts: dict[str, str] = {}
    for _ in range(a.rounds):
        for name, cmd in runs.items():
            for lora in (True, False):
                perf, out = _run(cmd + (["--lora", str(adapter)] if lora else []), cwd=REPO)
                figures.setdefault((name, lora), []).append(perf)
                if lora:  # what was generated (both echo the prompt first)
                    texts[name] = out[len(prompt):] if out.startswith(prompt) else out
    print(f"model {Path(model).name}, adapter rank {a.rank} on {a.targets} ({adapter.stat().st_size / 2**20:.1f} MiB, F16), "
          f"-t {a.threads}, {a.rounds} rounds; prompt eval t/s, eval t/s (each round)")  # fmt: skip
    for (name, lora), perfs in figures.items():
        pp = [1e3 * p["n_prompt"] / p["prompt_eval_ms"] for p in perfs]
        tg = [p["eval_tps"] for p in perfs]
        print(f"  {name:9s} {'--lora' if lora else 'no adapter':10s} pp {statistics.median(pp):8.1f} {[round(x, 1) for x in pp]}"
              f"  tg {statistics.median(tg):7.2f} {[round(x, 2) for x in tg]}")  # fmt: skip
    ours, theirs = texts["llamapy"].split(), texts["llama.cpp"].split()
    same = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    print(f"greedy text with the adapter: the first {same} of {len(theirs)} words agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
