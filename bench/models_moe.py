"""The mixture-of-experts speed files of issue 29, for bench/compare.py.

    python bench/models_moe.py where            # the paths used, and which exist
    python bench/models_moe.py make             # both files (and their F16 sources)
    python bench/models_moe.py make qwen3moe8   # one of them

Two real shapes cut to fewer layers, seeded random weights written by tests/model/moe_models.py
as F16, then quantized by llama.cpp's `llama-quantize` (built by bench/llama_cpp.py) to the type
the model ships in:
- `qwen3moe8`: Qwen3-30B-A3B (n_embd 2048, 128 experts of 768, 8 used, 32 heads / 4 KV heads of
  128, the Qwen2 vocabulary of 151,936 tokens), 8 of its 48 layers, `Q4_K_M` (~2.5 GB; F16 ~10 GB);
- `gptoss6`: gpt-oss-20b (n_embd 2880, 32 experts of 2880, 4 used, 64 heads / 8 KV heads of 64,
  sinks, sliding window 128 on every other layer, YaRN), 6 of its 24 layers, `MXFP4_MOE`
  (llama-quantize's gpt-oss type: the experts MXFP4, the other matrices Q8_0; ~3.2 GB). gpt-oss's
  own o200k vocabulary (201,088 tokens) is not in ../shared: the Qwen2 vocabulary stands in, so the
  output matrix is 151,936 rows, not 201,088 — the same file for both sides.

Files live in `--models-dir` / $LLAMAPY_BENCH_MODELS / ~/.cache/llamapy-bench/models (shared with
bench/models1b.py) and are made only when absent (written under a temporary name, then renamed).
Writing an F16 source takes ~11 GB of memory for a few minutes; the F16 files are deleted once
quantized unless `--keep-f16`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402  (bench/llama_cpp.py)
import models1b  # noqa: E402  (llama-quantize, the temporary-name writes)

REPO = Path(__file__).resolve().parents[1]
WRITER = REPO / "tests" / "model" / "moe_models.py"
VOCAB = models1b.SHARED / "data" / "vocab" / "ggml-vocab-qwen2.gguf"


@dataclass(frozen=True)
class MoEFile:
    name: str  # the name compare.py's --models takes
    shape: str  # moe_models.SHAPES' key
    layers: int
    qtype: str  # llama-quantize's type

    def path(self, folder: Path) -> Path:
        return folder / f"{self.name}-{self.qtype}.gguf"

    def f16(self, folder: Path) -> Path:
        return folder / f"{self.name}-f16.gguf"


FILES = {
    f.name: f
    for f in (MoEFile("qwen3moe8", "qwen3-30b-a3b", 8, "Q4_K_M"), MoEFile("gptoss6", "gpt-oss-20b", 6, "MXFP4_MOE"))
}


def folder(models_dir: str | None = None) -> Path:
    return Path(models_dir or os.environ.get("LLAMAPY_BENCH_MODELS") or llama_cpp.cache_dir() / "models")


def ensure_file(f: MoEFile, where: Path, quantize: Path | None, timeout: float | None = None,
                keep_f16: bool = False) -> Path:  # fmt: skip
    """The quantized file of `f`, made when absent (its F16 source first)."""
    out = f.path(where)
    if out.is_file():
        return out
    if quantize is None:
        raise RuntimeError(f"{out} is missing and {models1b.QUANTIZE} is not available to make it")
    src = f.f16(where)
    if not src.is_file():
        if not VOCAB.is_file():
            raise RuntimeError(f"{VOCAB} is missing (../shared must sit next to the checkout)")
        models1b._make(src, [sys.executable, str(WRITER), f.shape, str(VOCAB), str(src), "--layers", str(f.layers),
                             "--f16"], timeout)  # fmt: skip
    models1b._make(out, [str(quantize), str(src), str(out), f.qtype], timeout)
    if not keep_f16:
        src.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["where", "make"])
    ap.add_argument("names", nargs="*", help=f"which files: {', '.join(FILES)} (default: all)")
    ap.add_argument("--models-dir")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 sources")
    ap.add_argument("--no-build", action="store_true", help=f"do not build {models1b.QUANTIZE}")
    a = ap.parse_args(argv)
    if unknown := [n for n in a.names if n not in FILES]:
        ap.error(f"unknown file {unknown[0]!r}: use {', '.join(FILES)}")
    where = folder(a.models_dir)
    files = [FILES[n] for n in a.names or FILES]
    if a.cmd == "where":
        for f in files:
            for what, p in ((f.qtype, f.path(where)), ("F16 source", f.f16(where))):
                print(f"{f.name:>10} {what:>10}  {'exists ' if p.is_file() else 'missing'}  {p}")
        return 0
    tool, why = models1b.ensure_quantize(not a.no_build)
    if tool is None:
        print(f"[models_moe] {why}", file=sys.stderr)
    rc = 0
    for f in files:
        try:
            print(ensure_file(f, where, tool, keep_f16=a.keep_f16))
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            print(f"[models_moe] {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
