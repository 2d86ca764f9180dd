#!/usr/bin/env python3
"""llama.cpp's embeddings of the default model, made by llama-embedding itself.

    python tests/model/references/make_embedding_refs.py MODEL.gguf [--bin DIR]

For TEXTS (one per line), llama-embedding on the default model's Q4_1 file with `-t 2`:
`--pooling none --embd-normalize -1 --embd-output-format array` (every token's row as the graph
gives it) and `--pooling {mean,cls,last}` with the default euclidean normalisation. The results go
to smollm2-q41-embeddings.json.xz next to this script (tests/model/test_embedding.py reads it).
llama-embedding is an example program: `bench/llama_cpp.py build` configures llama.cpp without
them, so build it once with

    cmake -S ~/.cache/llamapy-bench/llama_cpp_python-0.3.36/vendor/llama.cpp \\
          -B ~/.cache/llamapy-bench/build-0.3.36 -DLLAMA_BUILD_EXAMPLES=ON
    cmake --build ~/.cache/llamapy-bench/build-0.3.36 -j2 --target llama-embedding
"""

from __future__ import annotations

import argparse
import json
import lzma
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "smollm2-q41-embeddings.json.xz"
DEFAULT_BIN = Path.home() / ".cache" / "llamapy-bench" / "build-0.3.36" / "bin"
TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "I like cats",
    "Full fathom five thy father lies; of his bones are coral made; those are pearls that were his eyes.",
]


def cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return f"{model} ({'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'})"


def run(tool: Path, model: str, *args: str) -> list:
    cmd = [str(tool), "-m", model, "-t", "2", "-p", "\n".join(TEXTS), "--embd-output-format", "array", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--bin", type=Path, default=DEFAULT_BIN)
    a = ap.parse_args()
    tool = a.bin / "llama-embedding"
    refs = {
        "made_by": f"llama-embedding of llama.cpp 0.3.36 (llama-cpp-python sdist), -t 2, on {cpu()}",
        "texts": TEXTS,
        "none": run(tool, a.model, "--pooling", "none", "--embd-normalize", "-1"),
        **{p: run(tool, a.model, "--pooling", p) for p in ("mean", "cls", "last")},
    }
    OUT.write_bytes(lzma.compress(json.dumps(refs).encode()))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
