"""Embeddings side by side: `llamapy embedding` and llama.cpp's llama-embedding on the same texts,
alternated, each timed around its own compute (not the load).

    python bench/embedding_speed.py [MODEL] [-f TEXTS] [--lines 128] [--pooling mean] [-t 2] [-c 4096] [--rounds 2]

TEXTS (default: lines 200 to 327 of ../shared/data/text/tempest.txt, blank lines dropped) become
one text a line, every one its own sequence, all in one batch (`-c` cells; llama-embedding sets its
batch to the context, as does llamapy). llamapy's time is its `embedding: N tokens in X ms` log
line; llama.cpp's from its log's `batch_decode` timestamp to its exit (its printing of the results
included, a few ms; its `prompt eval time` counts only the last micro-batch, and its perf lines
come only with `-lv 4`, whose debug logging makes it ~30x slower). The outputs of the last round are
compared: the smallest cosine similarity over the texts. llama-embedding is built on first use
(`bench/llama_cpp.py`'s build folder, LLAMA_BUILD_EXAMPLES=ON, one target).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEMPEST = REPO.parent / "shared" / "data" / "text" / "tempest.txt"
STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")


def _seconds(line: str) -> float:
    m = STAMP.match(line)
    if not m:
        raise ValueError(f"no timestamp in {line!r}")
    mi, s, ms, us = (int(x) for x in m.groups())  # common/log.cpp's prefix: minutes.seconds.ms.us
    return mi * 60 + s + ms / 1e3 + us / 1e6


def _vectors(stdout: str) -> np.ndarray:
    return np.array([[float(x) for x in ln.split(":", 1)[1].split()] for ln in stdout.splitlines() if ln.startswith("embedding ")])


def run_llama_cpp(tool: Path, model: str, texts: Path, a: argparse.Namespace) -> tuple[float, np.ndarray]:
    cmd = [str(tool), "-m", model, "-f", str(texts), "--pooling", a.pooling, "-t", str(a.threads), "-c", str(a.ctx)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    # its log's timestamps count from its start; the compute runs from `batch_decode` to its exit
    return wall - _seconds(next(ln for ln in r.stderr.splitlines() if "batch_decode:" in ln)), _vectors(r.stdout)


def run_llamapy(model: str, texts: Path, a: argparse.Namespace) -> tuple[float, np.ndarray]:
    cmd = [sys.executable, "-m", "llamapy", "embedding", model, "-f", str(texts), "--pooling", a.pooling,
           "-t", str(a.threads), "-c", str(a.ctx)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    ms = float(re.search(r"embedding: \d+ tokens in ([\d.]+) ms", r.stderr).group(1))  # type: ignore[union-attr]
    return ms / 1e3, _vectors(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-f", "--file", type=Path, default=None)
    ap.add_argument("--lines", type=int, default=128)
    ap.add_argument("--pooling", default="mean")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.model is None:
        from llamapy.model.fetch import default_model_path

        a.model = str(default_model_path())
    tool = llama_cpp.build_embedding()
    src = a.file or TEMPEST
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()]
    lines = lines[199 : 199 + a.lines] if a.file is None else lines[: a.lines]
    with tempfile.TemporaryDirectory() as d:
        texts = Path(d) / "texts.txt"
        texts.write_text("\n".join(lines))
        from llamapy.api import Llama

        with Llama(a.model, n_ctx=a.ctx) as llm:
            n_tok = sum(len(llm.tokenize(t)) for t in lines)
        print(f"{a.model}: {len(lines)} texts, {n_tok} tokens, pooling {a.pooling}, -t {a.threads}, -c {a.ctx}")
        print(f"{'round':>5} {'llamapy s':>10} {'llama.cpp s':>12} {'llamapy t/s':>12} {'llama.cpp t/s':>14} {'ratio':>6}")
        for i in range(a.rounds):
            tp, vp = run_llamapy(a.model, texts, a)
            tc, vc = run_llama_cpp(tool, a.model, texts, a)
            print(f"{i + 1:>5} {tp:10.3f} {tc:12.3f} {n_tok / tp:12.1f} {n_tok / tc:14.1f} {tc / tp:5.2f}x")
    cos = (vp * vc).sum(1) / np.linalg.norm(vp, axis=1) / np.linalg.norm(vc, axis=1)
    print(f"outputs: {len(vp)} embeddings (the printed values), smallest cosine similarity {cos.min():.6f}")


if __name__ == "__main__":
    main()
