#!/usr/bin/env python3
"""llama.cpp's references for the non-llama families, made by llama.cpp itself.

    python tests/model/references/make_family_refs.py {qwen,gemma3} [--bin DIR] [--out DIR]

qwen2 (tied and untied) and qwen3: small random-weight files with the Qwen2 vocabulary
(tests/model/family_models.py), quantized to Q4_K_M with llama-quantize, dequantized exactly to
F32 (`llama-quantize --allow-requantize Q F32`), and `llama-perplexity -c 128 --chunks 2
--kl-divergence-base` on tempest.txt run on the F32 file. The models and .kld files (tens of MB)
go to --out (default $LLAMAPY_CACHE/family-refs), never into the repository; families.json next to
this script keeps the small results (llama.cpp's perplexities). `gemma3`: llama-perplexity on
Gemma 3 270M Q4_K_M at -c 512 (first 16 chunks) and -c 2048 (first 4 chunks) — every running
estimate [k] kept, so a test may stop after fewer chunks — and greedy continuations with
llama-completion, added to families.json.

The slow tests (test_family_llama_cpp.py) call `ensure_variant` to rebuild what is missing when
llama.cpp is present, and skip otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path[:0] = [str(HERE.parent), str(REPO)]

from family_models import write_family_gguf  # noqa: E402

SHARED = Path(os.environ.get("LLAMAPY_SHARED", REPO.parent / "shared"))
QWEN2_VOCAB = SHARED / "data" / "vocab" / "ggml-vocab-qwen2.gguf"
TEMPEST = SHARED / "data" / "text" / "tempest.txt"
DEFAULT_BIN = Path.home() / ".cache" / "llamapy-bench" / "build-0.3.36" / "bin"
RESULTS = HERE / "families.json"

SHAPE = dict(n_layer=4, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, embd_scale=0.3)
VARIANTS: dict[str, dict[str, object]] = {
    "qwen2-tied": dict(arch="qwen2", head_dim=64, seed=11, **SHAPE),
    "qwen2-untied": dict(arch="qwen2", head_dim=64, tied=False, seed=12, **SHAPE),
    "qwen3": dict(arch="qwen3", head_dim=96, seed=13, **SHAPE),  # 4 x 96 != 256
}
KLD_ARGS = ["-c", "128", "--chunks", "2"]
GEMMA3_PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def llama_cpp_bin() -> Path | None:
    b = Path(os.environ.get("LLAMAPY_LLAMA_CPP_BIN", DEFAULT_BIN))
    tools = ("llama-quantize", "llama-perplexity", "llama-completion")
    return b if all((b / t).is_file() for t in tools) else None


def out_dir() -> Path:
    from llamapy.types import cache_dir

    return cache_dir() / "family-refs"


def _run(cmd: list[str | Path]) -> str:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{p.stderr[-2000:]}")
    return p.stdout + p.stderr


def final_ppl(log: str) -> float:
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if m is None:
        raise RuntimeError("no 'Final estimate' in llama-perplexity's output")
    return float(m.group(1))


def ensure_variant(name: str, bin_dir: Path, out: Path) -> tuple[Path, Path, float | None]:
    """(quantized model, .kld base from its F32-dequantized copy, llama.cpp's F32 PPL or None
    when the files were already there)."""
    out.mkdir(parents=True, exist_ok=True)
    q = out / f"{name}-Q4_K_M.gguf"
    f32 = out / f"{name}-Q4_K_M-f32.gguf"
    kld = out / f"{name}.c128x2.kld"
    ppl = None
    if not q.is_file():
        src = write_family_gguf(out / f"{name}-f32-src.gguf", vocab=QWEN2_VOCAB, **VARIANTS[name])  # type: ignore[arg-type]
        _run([bin_dir / "llama-quantize", src, q, "Q4_K_M"])
        src.unlink()
    if not f32.is_file():
        _run([bin_dir / "llama-quantize", "--allow-requantize", q, f32, "F32"])
    if not kld.is_file():
        log = _run([bin_dir / "llama-perplexity", "-m", f32, "-f", TEMPEST, *KLD_ARGS, "-t", "2",
                    "--kl-divergence-base", kld])  # fmt: skip
        ppl = final_ppl(log)
    return q, kld, ppl


GEMMA3_PPL_RUNS = ((512, 4), (2048, 1))  # (-c, --chunks): one pass of 4 x 512 / 1 x 2048 tokens


def ensure_gemma3_kld(bin_dir: Path, model: Path, out: Path) -> Path:
    """llama.cpp's logits of Gemma 3 dequantized to F32 (tempest, -c 128, 2 chunks): ~66 MB, in
    `out`, made when missing."""
    out.mkdir(parents=True, exist_ok=True)
    kld = out / "gemma3-270m.c128x2.kld"
    if not kld.is_file():
        f32 = out / "gemma3-270m-Q4_K_M-f32.gguf"
        if not f32.is_file():
            _run([bin_dir / "llama-quantize", "--allow-requantize", model, f32, "F32"])
        _run([bin_dir / "llama-perplexity", "-m", f32, "-f", TEMPEST, *KLD_ARGS, "-t", "2", "--kl-divergence-base", kld])
        f32.unlink()  # 1 GB: only the logits are needed again
    return kld


def _ppl_runs(bin_dir: Path, model: Path) -> list[dict[str, object]]:
    runs: list[dict[str, object]] = []
    for ctx, chunks in GEMMA3_PPL_RUNS:
        log = _run([bin_dir / "llama-perplexity", "-m", model, "-f", TEMPEST, "-c", str(ctx), "--chunks", str(chunks),
                    "-t", "2"])  # fmt: skip
        running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", log)]
        runs.append({"ctx": ctx, "chunks": chunks, "ppl": final_ppl(log), "running": running})
    return runs


def gemma3_refs(bin_dir: Path, model: Path) -> dict[str, object]:
    """Perplexity of the Q4_K_M file and of its F32-dequantized copy (what llamapy's float32
    activations should match), and greedy continuations of the Q4_K_M file."""
    runs = _ppl_runs(bin_dir, model)
    f32 = out_dir() / "gemma3-270m-Q4_K_M-f32.gguf"
    _run([bin_dir / "llama-quantize", "--allow-requantize", model, f32, "F32"])
    try:
        f32_runs = _ppl_runs(bin_dir, f32)
    finally:
        f32.unlink()
    greedy = []
    for prompt in GEMMA3_PROMPTS:
        text = subprocess.run(
            [str(bin_dir / "llama-completion"), "-m", str(model), "-p", prompt, "-n", "24", "--temp", "0",
             "-c", "512", "-no-cnv", "-t", "2"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        greedy.append({"prompt": prompt, "n_predict": 24, "text": text.split(prompt, 1)[-1].rstrip("\n")})
    return {"about": "llama.cpp defaults (f16 K/V cache, flash attention auto), -t 2, tempest.txt",
            "perplexity": runs, "perplexity_f32": f32_runs, "greedy": greedy}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("what", choices=["qwen", "gemma3"])
    a = ap.parse_args()
    bin_dir = a.bin or llama_cpp_bin()
    if bin_dir is None:
        print("error: llama.cpp tools not found (set LLAMAPY_LLAMA_CPP_BIN)", file=sys.stderr)
        return 1
    out = a.out or out_dir()
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    for name in VARIANTS if a.what == "qwen" else ():
        kld = out / f"{name}.c128x2.kld"
        kld.unlink(missing_ok=True)  # recompute: its PPL is recorded below
        _, _, ppl = ensure_variant(name, bin_dir, out)
        results.setdefault("variants", {})[name] = {"make": VARIANTS[name], "kld_args": KLD_ARGS, "f32_ppl": ppl}
        print(f"{name}: F32 PPL {ppl}", file=sys.stderr)
    if a.what == "gemma3":
        from llamapy.model.fetch import gemma3_model_path

        results["gemma3"] = gemma3_refs(bin_dir, gemma3_model_path())
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def kld_with_flags(model: Path, flags: list[str], options: list[object], tmp: Path) -> list[tuple[float, float]]:
    """llama-perplexity on `model` with `flags` (e.g. --lora-scaled A:0.8) over KLD_ARGS of
    tempest.txt, its logits kept (--kl-divergence-base); then llamapy's float32 run of the same
    file with each of `options` (ModelOptions) against them: (mean KLD, same top) each. Skips
    where llama.cpp's tools or the shared files are missing."""
    import pytest

    from llamapy import Llama
    from llamapy.context import ContextOptions
    from llamapy.perplexity import evaluate_kl_divergence, read_logits_file
    from llamapy.types import GGMLType

    bin_dir = llama_cpp_bin()
    if bin_dir is None:
        pytest.skip("llama.cpp's tools are not built (bench/llama_cpp.py builds them)")
    for p in (QWEN2_VOCAB, TEMPEST):
        if not p.is_file():
            pytest.skip(f"{p} is not available")
    kld = tmp / "base.kld"
    _run([bin_dir / "llama-perplexity", "-m", model, *flags, "-f", TEMPEST, *KLD_ARGS, "-t", "2", "--kl-divergence-base", kld])
    base = read_logits_file(kld)
    co = ContextOptions(n_ctx=base.n_ctx, n_batch=base.n_ctx, cpu_matmul="f32", type_k=GGMLType.F32, type_v=GGMLType.F32)
    out = []
    for mo in options:
        with Llama(model, model_options=mo, context_options=co) as llm:  # type: ignore[arg-type]
            for _, stats in evaluate_kl_divergence(llm.ctx, base, llm.ctx.n_batch, base.n_chunk):
                pass
        out.append((stats.mean_kld()[0], stats.same_top()[0]))
    return out
