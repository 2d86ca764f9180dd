"""Generated tokens/s of parallel decoding (llamapy.batch, llama.cpp's tools/parallel) against
single-sequence decoding of the same prompts, in one process on the same context.

    python bench/batch_throughput.py [--model PATH] [--prompts 16] [--np 8] [-n 32] [-t 0]

Both sides are greedy with the same n_predict; the rate is generated tokens over the wall time of
the whole run (prompt evaluation included), and the generation-only rate of each side is shown too.
The default model is SmolLM2-135M-Instruct (LLAMAPY_CACHE or the pip fetch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from llamapy.api import Llama
from llamapy.batch import BatchStats, run_batch
from llamapy.generate import GenerationResult, stream
from llamapy.model.sampler import SamplingParams

PROMPTS = [
    "The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello, my name is",
    "The best way to cook rice", "In 1492, Columbus", "def fibonacci(n):", "The weather today",
    "My favourite colour is", "Water boils at", "The quick brown fox", "A B C D",
    "Dear Sir or Madam,", "Python is a", "Roses are red,", "The largest planet is",
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--np", dest="n_parallel", type=int, default=8)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    a = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(a.prompts)]
    greedy = SamplingParams(temp=0)
    llm = Llama(a.model, n_ctx=a.ctx_size, n_threads=a.threads)
    print(f"model: {llm.path.name}, {len(prompts)} prompts, -n {a.n_predict}, -np {a.n_parallel}, "
          f"threads {a.threads or os.cpu_count()}", flush=True)  # fmt: skip
    # warm up (kernel compilation, graph planning) so that neither side pays for it
    list(run_batch(llm.ctx, prompts[:2], n_parallel=2, n_predict=2, sampling=greedy))
    llm.generate(prompts[0], n_predict=2, temp=0)

    n_single, gen_ms_single = 0, 0.0
    t0 = time.perf_counter()
    for p in prompts:
        res = GenerationResult()
        llm.ctx.kv.clear()
        for _ in stream(llm.ctx, llm.tokenize(p), a.n_predict, greedy, res):
            pass
        n_single += len(res.tokens)
        gen_ms_single += res.timings.eval_ms
    single_s = time.perf_counter() - t0

    llm.ctx.kv.clear()
    st = BatchStats()
    t0 = time.perf_counter()
    recs = list(run_batch(llm.ctx, prompts, n_parallel=a.n_parallel, n_predict=a.n_predict, sampling=greedy, stats=st))
    batch_s = time.perf_counter() - t0
    n_batch = sum(r.n_tokens for r in recs)

    single_tps = n_single / single_s
    batch_tps = n_batch / batch_s
    print(f"single sequence : {n_single:5d} tokens in {single_s:7.2f} s = {single_tps:7.2f} tok/s "
          f"(generation only {1e3 * n_single / max(gen_ms_single, 1e-9):.2f} tok/s)")  # fmt: skip
    print(f"batch -np {a.n_parallel:<5d}: {n_batch:5d} tokens in {batch_s:7.2f} s = {batch_tps:7.2f} tok/s "
          f"({st.n_steps} steps, largest batch {st.max_batch} tokens)")  # fmt: skip
    print(f"ratio           : {batch_tps / single_tps:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
