#!/usr/bin/env python3
"""llama.cpp's references for the quant types mixture-of-experts models ship in (IQ4_NL, IQ4_XS,
MXFP4), and for Q4_0 (which llama.cpp's x86 builds run through IQ4_NL's kernels), made by
llama.cpp itself.

    python tests/model/references/make_iquant_refs.py [--bin DIR] [--out DIR]

A small random-weight qwen3 with the Qwen2 vocabulary (family_models.py; untied output, head
size 64 so that every matrix's rows are a multiple of IQ4_XS's 256), quantized with
`llama-quantize --pure` to each type (MXFP4 as llama.cpp names it, MXFP4_MOE), dequantized
exactly to F32 (`--allow-requantize Q F32`), and llama-perplexity -c 128 --chunks 2
--kl-divergence-base on tempest.txt: on the F32 file (what the float32-activation mode should
match) and on the quantized file (what the default 8-bit mode should match). The files go to --out (default $LLAMAPY_CACHE/iquant-refs),
never into the repository; the slow test (test_iquant_llama_cpp.py) calls `ensure` to make what is
missing when llama.cpp's tools are built, and skips otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import make_family_refs as refs  # noqa: E402
from family_models import write_family_gguf  # noqa: E402

TYPES = {"IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "MXFP4": "MXFP4_MOE", "Q4_0": "Q4_0"}  # ours -> llama-quantize's name
MAKE = dict(arch="qwen3", head_dim=64, tied=False, seed=21, **refs.SHAPE)


def out_dir() -> Path:
    from llamapy.types import cache_dir

    return cache_dir() / "iquant-refs"


def ensure(name: str, bin_dir: Path, out: Path) -> dict[str, Path]:
    """{"model": the quantized file, "kld_f32": llama.cpp's logits of its F32 copy, "kld": of the
    quantized file}, made where missing."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"model": out / f"qwen3-{name}.gguf", "kld_f32": out / f"qwen3-{name}-f32.c128x2.kld",
             "kld": out / f"qwen3-{name}.c128x2.kld"}  # fmt: skip
    if not files["model"].is_file():
        src = out / "qwen3-f32-src.gguf"
        if not src.is_file():
            write_family_gguf(src, vocab=refs.QWEN2_VOCAB, **MAKE)  # type: ignore[arg-type]
        refs._run([bin_dir / "llama-quantize", "--pure", src, files["model"], TYPES[name]])
    ppl = [bin_dir / "llama-perplexity", "-f", refs.TEMPEST, *refs.KLD_ARGS, "-t", "2"]
    if not files["kld_f32"].is_file():
        f32 = out / f"qwen3-{name}-f32.gguf"
        refs._run([bin_dir / "llama-quantize", "--allow-requantize", files["model"], f32, "F32"])
        refs._run([*ppl, "-m", f32, "--kl-divergence-base", files["kld_f32"]])
        f32.unlink()
    if not files["kld"].is_file():
        refs._run([*ppl, "-m", files["model"], "--kl-divergence-base", files["kld"]])
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    bin_dir = a.bin or refs.llama_cpp_bin()
    if bin_dir is None:
        print("error: llama.cpp tools not found (set LLAMAPY_LLAMA_CPP_BIN)", file=sys.stderr)
        return 1
    for name in TYPES:
        print(name, ensure(name, bin_dir, a.out or out_dir()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
