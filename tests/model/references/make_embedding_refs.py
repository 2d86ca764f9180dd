#!/usr/bin/env python3
"""llama.cpp's embeddings of the default model, made by llama-embedding itself.

    python tests/model/references/make_embedding_refs.py MODEL.gguf [--bin DIR]

    python tests/model/references/make_embedding_refs.py --rerank [--bin DIR]

For TEXTS (one per line), llama-embedding on the default model's Q4_1 file with `-t 2`:
`--pooling none --embd-normalize -1 --embd-output-format array` (every token's row as the graph
gives it) and `--pooling {mean,cls,last}` with the default euclidean normalisation. The results go
to smollm2-q41-embeddings.json.xz next to this script (tests/model/test_embedding.py reads it).
`--rerank`: llama-embedding `--pooling rank --embd-normalize -1 --embd-output-format raw` (its
normalisation of rank scores reads past them) on PAIRS, with tests/model/family_models.py's tiny qwen3 rerankers (two labels;
without and with a `rerank` template), each score vector's labels kept, to rerank-tiny-qwen3.json.
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
import tempfile
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


PAIRS = ["the cat\tthe dog", "the cat\ta b", "he she\tit"]
RERANK_OUT = HERE / "rerank-tiny-qwen3.json"


def _stdout(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return r.stdout


def run(tool: Path, model: str, *args: str) -> list:
    cmd = [str(tool), "-m", model, "-t", "2", "-p", "\n".join(TEXTS), "--embd-output-format", "array", *args]
    return json.loads(_stdout(cmd).strip())


def run_rank(tool: Path, model: str) -> list:
    """`--embd-output-format raw` (its rank rows hold only the scores; `array` prints the n_embd
    floats its normalisation copied from past them). llama-embedding's log thread sometimes
    loses its output at exit on a model this small (rc 0, nothing or half printed): tried again."""
    cmd = [str(tool), "-m", model, "-t", "2", "-p", "\n".join(PAIRS), "--pooling", "rank", "--embd-normalize", "-1",
           "--embd-output-format", "raw"]  # fmt: skip
    for _ in range(10):
        rows = [[float(x) for x in ln.split()] for ln in _stdout(cmd).splitlines() if ln.strip()]
        if len(rows) == len(PAIRS) and all(len(r) == 2 for r in rows):
            return rows
    raise RuntimeError(f"llama-embedding printed no complete output in 10 runs: {cmd}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--bin", type=Path, default=DEFAULT_BIN)
    ap.add_argument("--rerank", action="store_true")
    a = ap.parse_args()
    tool = a.bin / "llama-embedding"
    if a.rerank:
        rerank_refs(tool)
        return
    if a.model is None:
        ap.error("the model file is required")
    refs = {
        "made_by": f"llama-embedding of llama.cpp 0.3.36 (llama-cpp-python sdist), -t 2, on {cpu()}",
        "texts": TEXTS,
        "none": run(tool, a.model, "--pooling", "none", "--embd-normalize", "-1"),
        **{p: run(tool, a.model, "--pooling", p) for p in ("mean", "cls", "last")},
    }
    OUT.write_bytes(lzma.compress(json.dumps(refs).encode()))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


def rerank_refs(tool: Path) -> None:
    import sys

    sys.path.insert(0, str(HERE.parent))
    from family_models import write_reranker_gguf

    out = {"made_by": f"llama-embedding of llama.cpp 0.3.36, -t 2, on {cpu()}", "pairs": PAIRS}
    with tempfile.TemporaryDirectory() as d:
        for name, template in (("plain", False), ("template", True)):
            path = write_reranker_gguf(Path(d) / f"{name}.gguf", template=template)
            out[name] = run_rank(tool, str(path))
    RERANK_OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RERANK_OUT}")


if __name__ == "__main__":
    main()
