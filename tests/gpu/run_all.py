#!/usr/bin/env python3
"""The CUDA backend's checks on a machine with an NVIDIA GPU and CuPy (no network, nothing
outside the repository):

  1. environment: CuPy, driver, devices, the CUDA registry's status;
  2. the op and weight tests on CUDA0 (pytest tests/gpu/test_cuda_ops.py: the run_nodes path;
     tests/gpu/test_cuda_kernels.py: every kernels_cuda/ family through cuda_ops, the kernels of
     the compiled GPU split, and one captured CUDA graph; tests/gpu/test_gpu_runtime.py: whole
     models' decode steps as captured CUDA graphs of the compiled GPU split, against run_nodes
     and the CPU; tests/gpu/test_cuda_hybrid.py: -ngl 0, 2, all-1, all steps, one host wait per
     device->host boundary) -- each failing case listed by name;
  2b. tiny32 at -ngl all against llama.cpp's F32 logits (mean KLD <= 0.001), when the reference
     (.gpu/ or ../shared/reference/tiny32) is there: with -ub 8 (the compiled GPU split, its
     CUDA graphs) and -ub 512 (the prompt path), each with the CUDA splits' plan lines;
  3. two generated models -- SmolLM2-shaped (30 layers, 576/1536, 9/3 heads, vocab 49152, Q4_1
     weights, Q8_0 token_embd, tied output) and tiny32-shaped (32 layers, 256/768, 4/2 heads,
     Q4_K / Q6_K) -- with random weights: the last-position distributions of `-ngl all` and
     `-ngl 20` against the CPU run (KL divergence over a few prompts of random tokens, <= 1e-4);
  3b. mixture of experts (tiny qwen3moe, Mixtral-style and gpt-oss files of tests/model/moe_models.py,
     Q8_0): -ngl all and -ngl all --n-cpu-moe 1 against -ngl 0 (KL of the last position: the
     24-token prompts run the MoE prompt plan, MUL_MAT_ID_GEMM), decode speed, and the decode
     graph's plan line (the router and the experts in one CUDA graph); then pp512 at -ngl all
     through the MoE prompt plan (grouping, one read of the counts a layer, per-expert f16
     GEMMs) with its plan line, on each tiny file and (not --quick) on the Qwen3-30B-A3B shape
     cut to 2 layers (128 experts, 8 used, Q8_0);
  4. decode speed (tokens/s) at -ngl 0, 20 and all (the default mode: on CUDA the large decode
     products on int8, gpu_plan.MMVQ_MIN_WEIGHTS; the kernel table times mmv and quantize_q8_1 +
     mmvq at the same shapes), prompt speed (pp512) at -ngl all with the
     prompt split's plan line; at -ngl all the decode graph's plan line
     (one CUDA graph, or direct launches and why, or why it runs node by node), the time a step
     and its Python part (step wall time minus the GPU time between the step's input copy and
     its exports, CUDA events).

  5. the hybrid step (issue 29 item 4): tg and pp512 at -ngl 0, 8, 16, 24 and all of a dense shape
     (`--sweep b1`, the default: the 1.2B shape, 16 layers; `--sweep b8`: the 8B one, 32 layers, as
     issue 29 asks; `--sweep tiny32` for a dry run; `--sweep none` skips it), with the device's host waits and copies per step
     (CopyStats: one wait per device->host boundary is the design). `--only-sweep` runs just this.

Every step is guarded: a failure is reported and the next step runs. The markdown summary is
printed and written to $OUT/gpu_results.md when OUT is set, else bench/gpu_results.md.

usage: python tests/gpu/run_all.py [--test-device] [--skip-pytest] [--quick] [--sweep b1|b8|tiny32|none] [--only-sweep]
  --test-device  dry run without a GPU: the TEST device (LLAMAPY_TEST_GPU=1) stands in for CUDA0
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KL_MAX = 1e-4
TINY32_KLD_MAX = 0.001  # issue 28: tiny32 at -ngl all against llama.cpp's F32 logits
N_PROMPTS = 3
PROMPT_LEN = 24
N_CTX = 256


class Report:
    def __init__(self) -> None:
        self.sections: list[tuple[str, list[str]]] = []
        self.failures = 0

    def section(self, title: str) -> list[str]:
        lines: list[str] = []
        self.sections.append((title, lines))
        print(f"\n## {title}", flush=True)
        return lines

    def add(self, lines: list[str], text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    def step(self, lines: list[str], what: str, fn: Callable[[], Any]) -> Any:
        """Run fn; on an exception record it (first lines of the traceback) and go on."""
        t0 = time.perf_counter()
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - report everything, stop nothing
            if isinstance(e, KeyboardInterrupt):
                raise
            self.failures += 1
            tb = traceback.format_exc().strip().splitlines()
            self.add(lines, f"- **FAIL** {what} ({time.perf_counter() - t0:.1f} s): `{type(e).__name__}: {str(e)[:300]}`")
            self.add(lines, "  <details><summary>traceback</summary>\n\n  ```\n  " + "\n  ".join(tb[-12:]) + "\n  ```\n  </details>")
            return None

    def markdown(self) -> str:
        out = ["# llamapy CUDA results", ""]
        out.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, failures: {self.failures}")
        for title, lines in self.sections:
            out += ["", f"## {title}", "", *lines]
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# model writing
# --------------------------------------------------------------------------------------------

# byte offsets of the f16 scale fields, and the std of a weight per unit of d (see _kquant_rows)
_KQ_LAYOUT = {"Q4_K": ([0, 2], 258.0), "Q6_K": ([208], 1369.0)}


def _kquant_rows(name: str, n_rows: int, n_in: int, gain: float, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant rows (gguf-py cannot quantize K-quants): random quants and scales, with d
    chosen so that the weights' std is about gain / sqrt(n_in). Q4_K: w = d*sc*q - dmin*m with
    sc, m 6-bit and q 4-bit, dmin = 7.5 d centres it (std ~258 d); Q6_K: w = d*sc*(q-32) with an
    int8 sc (std ~1369 d)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blck, bs = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    offs, unit_std = _KQ_LAYOUT[name]
    raw = rng.integers(0, 256, (n_rows * n_in // blck, bs), dtype=np.uint8)
    d = gain / np.sqrt(n_in) / unit_std
    ds = [d, 7.5 * d] if name == "Q4_K" else [d]
    for o, v in zip(offs, ds):
        vals = (v * rng.uniform(0.8, 1.2, len(raw))).astype(np.float16)
        raw[:, o : o + 2] = vals.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


def add_placeholder_vocab(w: Any, n_vocab: int) -> None:
    """A vocab-only SPM tokenizer of placeholder pieces (llama.cpp loads it with any architecture)."""
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(n_vocab)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def write_model(path: Path, *, name: str, n_layer: int, n_embd: int, n_ff: int, n_head: int,
                n_head_kv: int, n_vocab: int, wtype: str, embd_type: str, down_type: str | None = None,
                v_type: str | None = None, out_type: str | None = None, rope_base: float = 10000.0,
                seed: int = 0) -> Path:
    """A llama GGUF with random weights (as shared/reference/tiny32/make_tiny32.py writes one)
    and a vocab-only SPM tokenizer of placeholder pieces. `out_type` None: tied output."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head

    def mat(rows: int, cols: int, qname: str, gain: float = 1.0) -> tuple[np.ndarray, Any]:
        if qname in _KQ_LAYOUT:
            return _kquant_rows(qname, rows, cols, gain, rng), Q[qname]
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / np.sqrt(cols))
        if qname == "F32":
            return w, Q.F32
        return quantize(w, Q[qname]), Q[qname]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    add_placeholder_vocab(w, n_vocab)

    def add(tname: str, arr_q: tuple[np.ndarray, Any]) -> None:
        arr, qt = arr_q
        w.add_tensor(tname, arr, raw_dtype=None if qt == Q.F32 else qt)

    def vec(n: int) -> tuple[np.ndarray, Any]:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32), Q.F32

    add("token_embd.weight", mat(n_vocab, n_embd, embd_type, gain=float(np.sqrt(n_embd))))
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", vec(n_embd))
        add(p + "attn_q.weight", mat(n_embd, n_embd, wtype))
        add(p + "attn_k.weight", mat(n_head_kv * head_dim, n_embd, wtype))
        add(p + "attn_v.weight", mat(n_head_kv * head_dim, n_embd, v_type or wtype))
        add(p + "attn_output.weight", mat(n_embd, n_embd, wtype, 0.5))
        add(p + "ffn_norm.weight", vec(n_embd))
        add(p + "ffn_gate.weight", mat(n_ff, n_embd, wtype))
        add(p + "ffn_up.weight", mat(n_ff, n_embd, wtype))
        add(p + "ffn_down.weight", mat(n_embd, n_ff, down_type or wtype, 0.5))
    add("output_norm.weight", (np.ones(n_embd, np.float32), Q.F32))
    if out_type is not None:
        add("output.weight", mat(n_vocab, n_embd, out_type, 4.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MODELS: dict[str, dict[str, Any]] = {
    "smollm2-shaped (Q4_1, Q8_0 embd)": dict(
        name="smollm2-shaped", n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, n_vocab=49152,
        wtype="Q4_1", embd_type="Q8_0", rope_base=100000.0, seed=1,
    ),
    "tiny32-shaped (Q4_K, Q6_K)": dict(
        name="tiny32-shaped", n_layer=32, n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_vocab=32000,
        wtype="Q4_K", embd_type="Q4_K", v_type="Q6_K", down_type="Q6_K", out_type="Q6_K", seed=2,
    ),
}  # fmt: skip

# the -ngl sweep's dense shapes (../shared/gpu/models.py's b1 and b8: Llama-3.2-1B's, Llama-3.1-8B's)
SWEEP_SHAPES: dict[str, dict[str, Any]] = {
    "b1": dict(name="llama1b-shaped", n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8, n_vocab=128256,
               wtype="Q4_K", embd_type="Q4_K", v_type="Q6_K", down_type="Q6_K", seed=3, rope_base=500000.0),
    "b8": dict(name="llama8b-shaped", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, n_vocab=128256,
               wtype="Q4_K", embd_type="Q4_K", v_type="Q6_K", down_type="Q6_K", out_type="Q6_K", seed=4,
               rope_base=500000.0),
    "tiny32": MODELS["tiny32-shaped (Q4_K, Q6_K)"],  # 32 layers of 256: a dry run (--test-device)
}  # fmt: skip
SWEEP_NGL: tuple[Any, ...] = (0, 8, 16, 24, "all")


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = softmax64(p_logits)
    q = softmax64(q_logits)
    m = p > 0
    return float(np.sum(p[m] * (np.log(p[m]) - np.log(np.maximum(q[m], 1e-300)))))


def last_logits(llm: Any, prompts: list[list[int]]) -> list[np.ndarray]:
    return [np.asarray(llm.logits(p)[-1], np.float64) for p in prompts]


def gpu_runtime(llm: Any, n_steps: int = 32) -> tuple[str, float, float]:
    """(the decode graph's CUDA plan line, ms a step, Python ms a step = wall - GPU time) at the
    current position of the context's sequence 0 (after decode_speed)."""
    from llamapy.backend.cuda import CUDABackend

    ctx = llm.ctx
    g = ctx.graph(1, 1).graph
    lines = [ln for ln in ctx.sched.dump(g).splitlines() if ln.startswith("## PLAN") and "CUDA" in ln]
    be = next((b for b in ctx.backends if isinstance(b, CUDABackend)), None)
    if be is None:
        return "no CUDA backend", 0.0, 0.0
    rt = be.device.runtime()
    pos = int(ctx.kv.n_used())
    tok = 5
    rt.gpu_seconds()
    rt.timing = True
    try:
        t0 = time.perf_counter()
        for _ in range(n_steps):
            tok = int(np.argmax(ctx.decode([tok], [pos])[-1]))
            pos += 1
        wall = time.perf_counter() - t0
        gpu = rt.gpu_seconds()
    finally:
        rt.timing = False
    return " / ".join(lines) or "no CUDA split", wall / n_steps * 1e3, (wall - gpu) / n_steps * 1e3


def decode_speed(llm: Any, n_prompt: int = 8, n_gen: int = 32, seed: int = 0) -> float:
    """Greedy decode of n_gen tokens one at a time after an n_prompt prefill; tokens/s."""
    ctx = llm.ctx
    n_vocab = llm.model.params.n_vocab
    rng = np.random.default_rng(seed)
    ctx.kv.seq_rm(0)
    toks = rng.integers(3, n_vocab, n_prompt)
    logits = ctx.decode(toks, np.arange(n_prompt))
    pos = n_prompt
    tok = int(np.argmax(logits[-1]))
    for _ in range(2):  # warm-up: graph build, kernel JIT
        tok = int(np.argmax(ctx.decode([tok], [pos])[-1]))
        pos += 1
    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = int(np.argmax(ctx.decode([tok], [pos])[-1]))
        pos += 1
    return n_gen / (time.perf_counter() - t0)


def _device_stats(llm: Any) -> dict[str, int]:
    """The copies and host waits of the context's device backends so far (CopyStats, summed)."""
    tot: dict[str, int] = {}
    for be in llm.ctx.backends:
        st = getattr(be.device, "stats", None)
        for k, v in (vars(st).items() if st is not None else ()):
            tot[k] = tot.get(k, 0) + v
    return tot


def ngl_sweep(rep: Report, lines: list[str], tmp: Path, shape: str, args: Any, gpu_prefix: str) -> None:
    """tg (32 tokens after an 8-token prompt) and pp512 at each -ngl of SWEEP_NGL, with the host
    waits and copies a decode step and a prompt step make (the device's CopyStats deltas)."""
    import llamapy

    spec = SWEEP_SHAPES[shape]
    path = tmp / f"sweep-{spec['name']}.gguf"
    t0 = time.perf_counter()
    write_model(path, **spec)
    rep.add(lines, f"- {spec['name']} ({spec['n_layer']} layers): {path.stat().st_size / 2**20:.0f} MiB written in "
                   f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    rep.add(lines, "")
    rep.add(lines, "| -ngl | layers on GPU | tg t/s | pp512 t/s | waits / decode step | copies in+out / decode step "
                   "| waits / prompt step | splits (decode graph) |")  # fmt: skip
    rep.add(lines, "|---|---|---|---|---|---|---|---|")
    n_gen = 8 if args.quick else 32
    n_pp = 512
    seen: set[int] = set()
    try:
        for ngl in SWEEP_NGL:
            if ngl != "all" and ngl >= spec["n_layer"] + 1:
                continue  # (the same placement as `all`)
            llm = llamapy.Llama(path, n_gpu_layers=ngl, n_ctx=n_pp + 64)
            try:
                n_gpu = llm.model.info.n_gpu_layers
                if n_gpu in seen:
                    continue
                seen.add(n_gpu)
                if ngl != 0 and not any(k.startswith(gpu_prefix) for k in llm.model.info.buffer_sizes):
                    raise RuntimeError(f"-ngl {ngl}: no {gpu_prefix} buffer")
                tg = decode_speed(llm, n_gen=n_gen)
                ctx = llm.ctx
                pos = int(ctx.kv.n_used())
                a = _device_stats(llm)
                for i in range(4):
                    ctx.decode([5 + i], [pos + i])
                b = _device_stats(llm)
                rng = np.random.default_rng(1)
                toks = rng.integers(3, spec["n_vocab"], n_pp)
                ctx.kv.seq_rm(0)
                ctx.decode(toks, np.arange(n_pp))  # warm-up: the prompt graph, cuBLAS
                ctx.kv.seq_rm(0)
                c = _device_stats(llm)
                t1 = time.perf_counter()
                ctx.decode(toks, np.arange(n_pp))
                pp = n_pp / (time.perf_counter() - t1)
                d = _device_stats(llm)
                n_splits = len(ctx.sched.reserve(ctx.graph(1, 1).graph).splits)

                def per(k: str, x: dict[str, int], y: dict[str, int], n: int) -> str:
                    return f"{(y.get(k, 0) - x.get(k, 0)) / n:.2f}"

                copies = f"{per('n_in', a, b, 4)} + {per('n_out', a, b, 4)}"
                rep.add(lines, f"| {ngl} | {n_gpu} | {tg:.1f} | {pp:.1f} | {per('n_sync', a, b, 4)} | {copies} | "
                               f"{per('n_sync', c, d, 1)} | {n_splits} |")  # fmt: skip
            finally:
                llm.close()
    finally:
        try:
            path.unlink()
        except OSError:
            pass


def prompt_speed(path: Path, n_prompt: int = 512, n_rep: int = 3) -> tuple[float, str]:
    """pp<n_prompt> at -ngl all: tokens/s of one n_prompt-token micro-batch into an empty cache
    (llama-bench's pp), best of n_rep after a warm-up run (the prompt's GPU plan made, cuBLAS
    loaded), and the prompt split's plan line (GEMMs launched directly, or why node by node)."""
    import llamapy

    llm = llamapy.Llama(path, n_gpu_layers="all", n_ctx=max(1024, n_prompt))
    try:
        ctx = llm.ctx
        toks = np.random.default_rng(7).integers(3, llm.model.params.n_vocab, n_prompt)
        best = float("inf")
        for i in range(n_rep + 1):
            ctx.kv.seq_rm(0)
            t0 = time.perf_counter()
            ctx.decode(toks, np.arange(n_prompt))  # (the logits' download waits for the GPU)
            if i:
                best = min(best, time.perf_counter() - t0)
        g = ctx.graph(n_prompt, 1).graph
        lines = [ln for ln in ctx.sched.dump(g).splitlines() if ln.startswith("## PLAN") and "CUDA" in ln]
        return n_prompt / best, " / ".join(lines) or "no CUDA split"
    finally:
        llm.close()


def kernel_speed(rep: Report, lines: list[str], dev: Any) -> None:
    """Time the decode kernels alone: the matrix-vector products at the benchmark shapes (weight
    bytes / time), attention over growing histories, and the row-wise kernels."""
    import cupy as cp

    sys.path.insert(0, str(ROOT / "tests/gpu"))
    from test_cuda_ptx import random_rows

    from llamapy.backend.cuda_ops import fattn_scratch_floats, fattn_splits, q8_1_bytes
    from llamapy.types import GGMLType as G

    k = dev.ops()
    st = dev.stream
    rng = np.random.default_rng(0)

    def time_us(launch: Callable[[], None], n: int = 100) -> float:
        with dev.context("timing a kernel"):
            for _ in range(3):
                launch()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(st)
            for _ in range(n):
                launch()
            b.record(st)
            b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) * 1000.0 / n

    rep.add(lines, "| kernel | shape | us/launch | GB/s |")
    rep.add(lines, "|---|---|---|---|")
    for name, n_out, n_in, n_tok in [("Q4_K", 4096, 4096, 1), ("Q4_K", 28672, 4096, 1), ("Q6_K", 4096, 14336, 1),
                                     ("Q4_K", 2048, 2048, 1), ("Q4_1", 1536, 576, 1), ("Q8_0", 49152, 576, 1),
                                     ("Q4_K", 4096, 4096, 4), ("Q3_K", 4096, 4096, 1)]:  # fmt: skip
        raw = cp.asarray(np.ascontiguousarray(random_rows(name, n_out, n_in, rng)))
        x = cp.asarray(rng.standard_normal((n_tok, n_in)).astype(np.float32))
        y = cp.empty((n_tok, n_out), cp.float32)
        cp.cuda.Device(dev.index).synchronize()
        us = time_us(lambda: k.mul_mat_vec(st, G[name], raw.data.ptr, raw.shape[1], n_out, n_in, x.data.ptr,
                                           y.data.ptr, n_tok))  # fmt: skip
        rep.add(lines, f"| mmv {name} | {n_out}x{n_in}, {n_tok} tok | {us:.1f} | {raw.nbytes / us / 1e3:.0f} |")
        # the q8 mode's int8 path (mmvq.cu): the copy of x, then the dp4a product (gpu_plan.MMVQ_MIN_WEIGHTS)
        xq = cp.zeros(q8_1_bytes(n_tok, n_in), cp.uint8)
        t_q = time_us(lambda: k.quantize_q8_1(st, x.data.ptr, n_in, xq.data.ptr, n_tok, n_in))
        t_v = time_us(lambda: k.mul_mat_vec_q8(st, G[name], raw.data.ptr, raw.shape[1], n_out, n_in, xq.data.ptr,
                                               y.data.ptr, n_tok))  # fmt: skip
        rep.add(lines, f"| quantize_q8_1 + mmvq {name} | {n_out}x{n_in}, {n_tok} tok | {t_q:.1f} + {t_v:.1f} | "
                       f"{raw.nbytes / t_v / 1e3:.0f} |")  # fmt: skip
    # the expert products of a decode step, Qwen3-30B-A3B's gate/up (128 experts of 768 x 2048 Q4_K,
    # 8 chosen, the GLU as epilogue): mmv_id on float32 x, or the q8 mode's copy + mmvq_id
    E, M, K, U = 128, 768, 2048, 8
    gate, up = (cp.asarray(np.ascontiguousarray(random_rows("Q4_K", E * M, K, rng))) for _ in range(2))
    ids = cp.asarray(rng.permutation(E)[:U].astype(np.int32)[None])
    x = cp.asarray(rng.standard_normal((1, K)).astype(np.float32))
    xq, y = cp.zeros(q8_1_bytes(1, K), cp.uint8), cp.empty((1, U, M), cp.float32)
    rb = gate.shape[1]
    cp.cuda.Device(dev.index).synchronize()
    t_f = time_us(lambda: k.mul_mat_id(st, G.Q4_K, gate.data.ptr, rb, E, M, K, x.data.ptr, K, 0, ids.data.ptr, U,
                                       y.data.ptr, 1, U, w2=up.data.ptr))  # fmt: skip
    t_q = time_us(lambda: k.quantize_q8_1(st, x.data.ptr, K, xq.data.ptr, 1, K))
    t_v = time_us(lambda: k.mul_mat_id(st, G.Q4_K, gate.data.ptr, rb, E, M, K, xq.data.ptr, 1, 0, ids.data.ptr, U,
                                       y.data.ptr, 1, U, w2=up.data.ptr, q8_rows=1))  # fmt: skip
    gb = 2 * U * M * rb / 1e3
    rep.add(lines, f"| mmv_id Q4_K gate/up + GLU | {E}x{M}x{K}, {U} used, 1 tok | {t_f:.1f} | {gb / t_f:.0f} |")
    rep.add(lines, f"| quantize_q8_1 + mmvq_id Q4_K gate/up + GLU | same | {t_q:.1f} + {t_v:.1f} | {gb / t_v:.0f} |")
    H, Hkv, D, N = 32, 8, 128, 8192
    kc = cp.zeros((N, Hkv, D), cp.float16)
    vc = cp.zeros((N, Hkv, D), cp.float16)
    q = cp.asarray(rng.standard_normal((1, H, D)).astype(np.float32))
    mask = cp.zeros((1, N), cp.float32)
    out = cp.empty((1, H, D), cp.float32)
    for n_kv in (128, 1024, 8192):
        for s in (1, fattn_splits(1, Hkv, N, k.n_sm)):
            scratch = cp.zeros(max(1, fattn_scratch_floats(1, H, D, s)), cp.float32)
            cp.cuda.Device(dev.index).synchronize()
            us = time_us(lambda: k.flash_attn_ext(st, q.data.ptr, H * D, D, G.F16, kc.data.ptr, Hkv * D * 2, D * 2, G.F16,
                                                  vc.data.ptr, Hkv * D * 2, D * 2, N, mask.data.ptr, N, out.data.ptr,
                                                  H * D, D, 1, H, Hkv, D, D, 0.088, n_kv=n_kv, n_splits=s,
                                                  scratch=scratch.data.ptr))  # fmt: skip
            gb = 2 * n_kv * Hkv * D * 2 / us / 1e3
            rep.add(lines, f"| fattn f16 | H{H}/{Hkv} D{D}, {n_kv} cells, {s} split(s) | {us:.1f} | {gb:.0f} |")
    xr = cp.asarray(rng.standard_normal((1, 4096)).astype(np.float32))
    w = cp.ones(4096, cp.float32)
    yr = cp.empty((1, 4096), cp.float32)
    cp.cuda.Device(dev.index).synchronize()
    us = time_us(lambda: k.rms_norm(st, xr.data.ptr, 4096, yr.data.ptr, 4096, 1, 4096, 1e-5, b=xr.data.ptr, sb=4096,
                                    sum_out=yr.data.ptr, ss=4096, w=w.data.ptr))  # fmt: skip
    rep.add(lines, f"| rms_norm (add, weight) | 1x4096 | {us:.1f} | - |")
    gu = cp.asarray(rng.standard_normal((1, 2 * 14336)).astype(np.float32))
    g_out = cp.empty((1, 14336), cp.float32)
    cp.cuda.Device(dev.index).synchronize()
    us = time_us(lambda: k.glu(st, "swiglu", gu.data.ptr, 2 * 14336, gu.data.ptr + 4 * 14336, 2 * 14336,
                               g_out.data.ptr, 14336, 1, 14336))  # fmt: skip
    rep.add(lines, f"| swiglu | 1x14336 | {us:.1f} | - |")
    pos = cp.zeros(1, cp.int32)
    cell = cp.zeros(1, cp.int64)
    qkv = cp.asarray(rng.standard_normal((1, (H + 2 * Hkv) * D)).astype(np.float32))
    qo = cp.empty((1, H, D), cp.float32)
    b = qkv.data.ptr
    cp.cuda.Device(dev.index).synchronize()
    us = time_us(lambda: k.rope_qkv(st, b, b + 4 * H * D, b + 4 * (H + Hkv) * D, (H + 2 * Hkv) * D, qo.data.ptr,
                                    H * D, 1, H, Hkv, D, D, pos=pos.data.ptr, n_dims=D, mode=0, freq_base=5e5,
                                    ids=cell.data.ptr, n_cells=N, k_type=G.F16, k_cache=kc.data.ptr, k_rb=Hkv * D * 2,
                                    v_type=G.F16, v_cache=vc.data.ptr, v_rb=Hkv * D * 2))  # fmt: skip
    rep.add(lines, f"| rope_qkv (f16 cache) | H{H}/{Hkv} D{D} | {us:.1f} | - |")
    # prompts (gpu_plan.product_path's "gemm_f16"): the input to f16, the weight to f16, the
    # cuBLAS GEMM, each timed alone (TFLOP/s of the GEMM; GB/s of the weight's decode: its blocks
    # read + f16 written), and the whole product; the prompt attention (fattn_tile_*). As the plans
    # run them: the input with its power-of-two scale (amax_f32 + cpy_f32_f16), alpha read by the
    # GEMM from device memory
    from llamapy.backend.cuda_ops import F16_SCALE_BYTES, gemm_tile_rows

    sc = cp.zeros(F16_SCALE_BYTES // 4, cp.float32)

    for name, n_out, n_in, n_tok in [("Q4_K", 4096, 4096, 512), ("Q4_K", 28672, 4096, 512), ("Q6_K", 4096, 14336, 512),
                                     ("Q4_K", 2048, 2048, 512), ("Q4_K", 16384, 2048, 512), ("Q4_1", 1536, 576, 512),
                                     ("Q4_K", 4096, 4096, 32), ("Q4_K", 4096, 4096, 8)]:  # fmt: skip
        raw = cp.asarray(np.ascontiguousarray(random_rows(name, n_out, n_in, rng)))
        x = cp.asarray(rng.standard_normal((n_tok, n_in)).astype(np.float32))
        y = cp.empty((n_tok, n_out), cp.float32)
        tile = gemm_tile_rows(n_out, n_in)
        w16, x16 = cp.empty((tile, n_in), cp.float16), cp.empty((n_tok, n_in), cp.float16)
        cp.cuda.Device(dev.index).synchronize()
        t_x = time_us(lambda: k.to_f16(st, x.data.ptr, n_in, x16.data.ptr, n_tok, n_in, scale=sc.data.ptr), 20)
        t_w = time_us(lambda: k.dequant_f16(st, G[name], raw.data.ptr, raw.shape[1], tile, n_in, w16.data.ptr), 20)
        t_g = time_us(lambda: k.gemm_f16(st, w16.data.ptr, x16.data.ptr, y.data.ptr, tile, n_tok, n_in, n_out,
                                         ab=sc.data.ptr), 20)  # fmt: skip
        t_all = time_us(lambda: k.mul_mat_gemm(st, G[name], raw.data.ptr, raw.shape[1], n_out, n_in, x.data.ptr, n_in,
                                               y.data.ptr, n_tok, w16=w16.data.ptr, x16=x16.data.ptr, tile_rows=tile,
                                               scale=sc.data.ptr), 20)  # fmt: skip
        tf = 2 * tile * n_in * n_tok / t_g / 1e6
        gbw = (raw.nbytes * tile // n_out + w16.nbytes) / t_w / 1e3
        rep.add(lines, f"| gemm_f16 {name} | {n_out}x{n_in}, {n_tok} tok: x->f16 {t_x:.1f}, W->f16 {t_w:.1f} "
                       f"({gbw:.0f} GB/s), GEMM {t_g:.1f} ({tf:.0f} TFLOP/s) | {t_all:.1f} (all) | - |")  # fmt: skip
    for T_, n_kv in ((512, 512), (512, 4096)):
        qp = cp.asarray(rng.standard_normal((T_, H, D)).astype(np.float32))
        causal = np.where(np.arange(n_kv)[None, :] <= np.arange(n_kv - T_, n_kv)[:, None], 0.0, -np.inf)
        mp = cp.asarray(causal.astype(np.float32))
        op = cp.empty((T_, H, D), cp.float32)
        cp.cuda.Device(dev.index).synchronize()
        us = time_us(lambda: k.flash_attn_ext(st, qp.data.ptr, H * D, D, G.F16, kc.data.ptr, Hkv * D * 2, D * 2, G.F16,
                                              vc.data.ptr, Hkv * D * 2, D * 2, N, mp.data.ptr, n_kv, op.data.ptr, H * D,
                                              D, T_, H, Hkv, D, D, 0.088, n_kv=n_kv), 20)  # fmt: skip
        rep.add(lines, f"| fattn_tile f16 | {T_} tokens, H{H}/{Hkv} D{D}, {n_kv} cells, causal | {us:.1f} | - |")


def moe_check(rep: Report, lines: list[str], tmp: Path, case: str, args: Any, gpu_prefix: str) -> None:
    """One tiny MoE file at -ngl 0, -ngl all and -ngl all --n-cpu-moe 1: KL against -ngl 0,
    decode speed, the decode graph's CUDA plan line."""
    import llamapy
    from llamapy.context import ModelOptions
    from llamapy.model.loader import expert_overrides

    sys.path.insert(0, str(ROOT / "tests/model"))
    from moe_models import SHAPES, write_gptoss_gguf, write_moe_gguf

    from gguf import GGMLQuantizationType as T

    if case == "tiny-gptoss":  # YaRN, sinks, sliding-window layers, biased MXFP4 experts, swiglu_oai
        path = write_gptoss_gguf(tmp / f"{case}.gguf", qtype=T.Q8_0, exp_qtype=T.MXFP4)
    else:
        path = write_moe_gguf(tmp / f"{case}.gguf", qtype=T.Q8_0, **SHAPES[case])
    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, 250, PROMPT_LEN - 1).tolist() for _ in range(1 if args.quick else N_PROMPTS)]
    ref: list[np.ndarray] | None = None
    for label, ngl, ot in (("-ngl 0", 0, []), ("-ngl all", "all", []), ("--n-cpu-moe 1", "all", expert_overrides(1))):
        # float32 activations on the CPU too (what the GPU computes; the q8 mode may route otherwise)
        llm = llamapy.Llama(path, model_options=ModelOptions(n_gpu_layers=ngl, override_tensor=ot), n_ctx=N_CTX,
                            cpu_matmul="f32")
        try:
            if ngl != 0 and not any(k.startswith(gpu_prefix) for k in llm.model.info.buffer_sizes):
                raise RuntimeError(f"{label}: no {gpu_prefix} buffer")
            got = last_logits(llm, prompts)
            tps = decode_speed(llm, n_gen=8 if args.quick else 32)
            plan = gpu_runtime(llm)[0] if ngl != 0 and not args.test_device else "-"
            if ref is None:
                ref = got
                rep.add(lines, f"| {case} | {label} | - | - | {tps:.1f} | - |")
                continue
            kls = [kl(a, b) for a, b in zip(ref, got)]
            agree = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(ref, got))
            ok = max(kls) <= KL_MAX and all(np.isfinite(kls))
            rep.failures += 0 if ok else 1
            rep.add(lines, f"| {case} | {label} | {max(kls):.3e} {'PASS' if ok else '**FAIL**'} | {agree}/{len(kls)} | "
                           f"{tps:.1f} | `{plan[:300]}` |")  # fmt: skip
        finally:
            llm.close()
    path.unlink(missing_ok=True)


def moe_prompt_speed(rep: Report, lines: list[str], tmp: Path, case: str) -> None:
    """pp512 of a MoE file at -ngl all: the expert products as MUL_MAT_ID_GEMM records (the pairs
    grouped by expert on the device, one read of the counts a layer, an f16 GEMM an expert);
    "qwen3-30b-a3b": the real layer shape (128 experts of 768, 8 used, 2048 wide) cut to 2 layers."""
    sys.path.insert(0, str(ROOT / "tests/model"))
    from moe_models import SHAPES, write_gptoss_gguf, write_moe_gguf

    from gguf import GGMLQuantizationType as T

    path = tmp / f"pp-{case}.gguf"
    if case == "tiny-gptoss":
        write_gptoss_gguf(path, qtype=T.Q8_0, exp_qtype=T.MXFP4)
    else:
        write_moe_gguf(path, qtype=T.Q8_0, **{**SHAPES[case], **({"n_layer": 2} if case == "qwen3-30b-a3b" else {})})
    try:
        tps, plan = prompt_speed(path)
        rep.add(lines, f"| {case} | {tps:.0f} | `{plan[:300]}` |")
    finally:
        path.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test-device", action="store_true", help="use the TEST device instead of CUDA (dry run)")
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one prompt, fewer decode steps")
    ap.add_argument("--sweep", choices=["b1", "b8", "tiny32", "none"], default="b1", help="the -ngl sweep's shape")
    ap.add_argument("--only-sweep", action="store_true", help="only the -ngl sweep")
    args = ap.parse_args()
    if args.test_device:
        os.environ["LLAMAPY_TEST_GPU"] = "1"
    gpu_prefix = "TEST" if args.test_device else "CUDA"

    rep = Report()
    t_start = time.perf_counter()

    # 1. environment ---------------------------------------------------------------------
    env = rep.section("Environment")
    rep.add(env, f"- python {platform.python_version()}, numpy {np.__version__}")

    def cupy_info() -> None:
        import cupy as cp

        rt = cp.cuda.runtime
        rep.add(env, f"- cupy {cp.__version__}, CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
        for i in range(rt.getDeviceCount()):
            p = rt.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            with cp.cuda.Device(i):
                free, total = rt.memGetInfo()
            rep.add(env, f"- GPU {i}: {name}, sm_{p['major']}{p['minor']}, {free / 2**30:.1f} / {total / 2**30:.1f} GiB free")
        rep.add(env, f"- CUPY_TF32={os.environ.get('CUPY_TF32', '(unset)')}")

    if not args.test_device:
        rep.step(env, "CuPy / driver information", cupy_info)

    def registry_info() -> None:
        from llamapy.backend.registry import discover

        for s in discover(refresh=True).statuses:
            state = "loaded: " + ", ".join(d.name for d in s.registry.devices()) if s.registry else s.error
            rep.add(env, f"- backend {s.name}: {state}")

    rep.step(env, "backend discovery", registry_info)

    def gpu_device() -> Any:
        from llamapy.backend.registry import discover

        devs = [d for d in discover().devices() if d.name.startswith(gpu_prefix)]
        if not devs:
            raise RuntimeError(f"no {gpu_prefix} device")
        return devs[0]

    dev = rep.step(env, "find the GPU device", gpu_device)
    if dev is not None:
        rep.add(env, f"- using {dev.name}: {dev.props().description}")
        rep.step(env, "device self-test", dev.self_test)

    if args.only_sweep:
        sweep_section(rep, args, gpu_prefix)
        return finish(rep, t_start)

    # 2. op tests -------------------------------------------------------------------------
    ops = rep.section("Op, kernel and weight tests on CUDA0 (pytest tests/gpu/test_cuda_ops.py, test_cuda_kernels.py, test_gpu_runtime.py, test_cuda_hybrid.py)")
    if args.skip_pytest or args.test_device:
        rep.add(ops, "- skipped")
    else:

        def run_pytest(name: str) -> None:
            # the kernels on CUDA0 only: their CPU-emulator runs belong to the CPU suite
            cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests/gpu" / name), "-q", "-rfEs", "--tb=line",
                   "-p", "no:cacheprovider", "-k", "not emu"]  # fmt: skip
            t0 = time.perf_counter()
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
            tail = (r.stdout + r.stderr).strip().splitlines()
            summary = tail[-1] if tail else "(no output)"
            rep.add(ops, f"- {name}: exit {r.returncode} in {time.perf_counter() - t0:.1f} s: `{summary}`")
            bad = [ln for ln in tail if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
            for ln in bad[:60]:
                rep.add(ops, f"  - `{ln[:400]}`")
            if r.returncode != 0:
                rep.failures += 1
                if not bad:
                    rep.add(ops, "  ```\n  " + "\n  ".join(tail[-30:]) + "\n  ```")

        for name in ("test_cuda_kernels.py", "test_gpu_runtime.py", "test_cuda_ops.py", "test_cuda_hybrid.py"):
            rep.step(ops, f"pytest {name}", lambda name=name: run_pytest(name))

    # 2b. tiny32 against llama.cpp -----------------------------------------------------------
    ref = rep.section(f"tiny32 at -ngl all against llama.cpp's F32 logits (mean KLD <= {TINY32_KLD_MAX})")
    pairs = [(ROOT / ".gpu/tiny32-Q4_K_M.gguf", ROOT / ".gpu/tiny32-f32.kld"),
             (ROOT.parent / "shared/reference/tiny32/tiny32-Q4_K_M.gguf",
              ROOT.parent / "shared/reference/tiny32/tiny32-Q4_K_M-f32.c128x2.kld")]  # fmt: skip
    found = next(((m, b) for m, b in pairs if m.is_file() and b.is_file()), None)
    if args.test_device or found is None:
        rep.add(ref, "- skipped" + ("" if args.test_device else ": no tiny32 reference (.gpu/ or ../shared/reference/tiny32)"))
    else:

        def tiny32_kld(ub: str, what: str) -> None:
            import re

            model, base = found
            cmd = [sys.executable, "-m", "llamapy", "perplexity", str(model), "--kl-divergence-base", str(base),
                   "--kl-divergence", "-ngl", "all", "-ub", ub]  # fmt: skip
            env = {**os.environ, "LLAMAPY_SCHED_DEBUG": "1"}
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
            out = r.stdout + r.stderr
            m = re.search(r"Mean\s+KLD:\s+(-?[0-9.eE+-]+)", out)
            plans = sorted({ln.split(": ", 1)[-1][:160] for ln in out.splitlines() if ln.startswith("## PLAN") and "CUDA" in ln})
            for ln in plans[:4]:
                rep.add(ref, f"  - -ub {ub} `{ln}`")
            if r.returncode != 0 or m is None:
                rep.failures += 1
                rep.add(ref, f"- **FAIL** -ub {ub} ({what}): exit {r.returncode}, no mean KLD: `{out.strip().splitlines()[-1:]}`")
                return
            kld = float(m.group(1))
            ok = kld <= TINY32_KLD_MAX
            rep.failures += 0 if ok else 1
            rep.add(ref, f"- -ub {ub} ({what}): mean KLD {kld:.6f}: {'PASS' if ok else '**FAIL**'}")

        # -ub 8: micro-batches the compiled GPU split captures (its CUDA graphs); 512: the prompt plan
        rep.step(ref, "tiny32 KLD -ub 8", lambda: tiny32_kld("8", "compiled GPU split, CUDA graphs"))
        rep.step(ref, "tiny32 KLD -ub 512", lambda: tiny32_kld("512", "prompt plan: f16 GEMMs on cuBLAS, fattn_tile"))

    # 2c. kernel speed ------------------------------------------------------------------------
    kspeed = rep.section("Kernel speed on CUDA0 (CUDA events, mean of 100 launches; H200 HBM3e peak ~4.8 TB/s)")
    if args.test_device or dev is None:
        rep.add(kspeed, "- skipped")
    else:
        rep.step(kspeed, "kernel speed", lambda: kernel_speed(rep, kspeed, dev))

    # 3 + 4. models -----------------------------------------------------------------------
    tmp = Path(tempfile.mkdtemp(prefix="llamapy-gpu-"))
    kl_lines = rep.section(f"-ngl all / -ngl 20 vs CPU: KL divergence of the last position (max {KL_MAX:g})")
    rep.add(kl_lines, "| model | -ngl | prompts | max KL | mean KL | max abs logit diff | argmax agree | result |")
    rep.add(kl_lines, "|---|---|---|---|---|---|---|---|")
    runtime = rep.section("The compiled GPU split at -ngl all (decode graph's plan, Python time a step = wall - GPU time; bar 0.1 ms)")
    rep.add(runtime, "| model | ms a step | Python ms a step | plan |")
    rep.add(runtime, "|---|---|---|---|")
    speed = rep.section("Decode speed (tokens/s, 32 tokens after an 8-token prompt)")
    rep.add(speed, "| model | -ngl 0 | -ngl 20 | -ngl all |")
    rep.add(speed, "|---|---|---|---|")
    pp = rep.section("Prompt speed at -ngl all (pp512: one 512-token micro-batch, best of 3; the prompt's GPU plan: "
                     "f16 GEMMs on cuBLAS, fattn_tile)")
    rep.add(pp, "| model | tokens/s | plan |")
    rep.add(pp, "|---|---|---|")
    setup = rep.section("Model setup")

    import llamapy

    n_prompts = 1 if args.quick else N_PROMPTS
    for label, spec in MODELS.items():
        path = tmp / f"{spec['name']}.gguf"
        t0 = time.perf_counter()
        ok = rep.step(setup, f"write {label}", lambda: write_model(path, **spec))
        if ok is None:
            continue
        rep.add(setup, f"- {label}: {path.stat().st_size / 2**20:.1f} MiB written in {time.perf_counter() - t0:.1f} s")
        rng = np.random.default_rng(123)
        prompts = [[1] + rng.integers(3, spec["n_vocab"], PROMPT_LEN - 1).tolist() for _ in range(n_prompts)]

        def load(ngl: Any) -> Any:
            t1 = time.perf_counter()
            llm = llamapy.Llama(path, n_gpu_layers=ngl, n_ctx=N_CTX)
            info = llm.model.info
            rep.add(setup, f"- {label} -ngl {ngl}: loaded in {time.perf_counter() - t1:.1f} s, "
                           f"{info.n_gpu_layers} layers on the GPU, buffers "
                           + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in info.buffer_sizes.items()))  # fmt: skip
            if ngl != 0 and not any(k.startswith(gpu_prefix) for k in info.buffer_sizes):
                raise RuntimeError(f"-ngl {ngl}: no {gpu_prefix} buffer (is the backend loaded?)")
            return llm

        ref: list[np.ndarray] | None = None
        speeds: dict[str, str] = {}
        for ngl in (0, 20, "all"):
            llm = rep.step(setup, f"{label}: load -ngl {ngl}", lambda: load(ngl))
            if llm is None:
                speeds[str(ngl)] = "load failed"
                continue
            try:
                got = rep.step(setup, f"{label} -ngl {ngl}: logits", lambda: last_logits(llm, prompts))
                if ngl == 0:
                    ref = got
                elif got is not None and ref is not None:
                    kls = [kl(a, b) for a, b in zip(ref, got)]
                    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got))
                    agree = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(ref, got))
                    passed = max(kls) <= KL_MAX and all(np.isfinite(kls))
                    if not passed:
                        rep.failures += 1
                    rep.add(kl_lines, f"| {label} | {ngl} | {len(kls)} | {max(kls):.3e} | {np.mean(kls):.3e} | "
                                      f"{diff:.3e} | {agree}/{len(kls)} | {'PASS' if passed else '**FAIL**'} |")  # fmt: skip
                else:
                    rep.add(kl_lines, f"| {label} | {ngl} | - | - | - | - | - | **FAIL** (no logits) |")
                n_gen = 8 if args.quick else 32
                tps = rep.step(setup, f"{label} -ngl {ngl}: decode speed", lambda: decode_speed(llm, n_gen=n_gen))
                speeds[str(ngl)] = f"{tps:.1f}" if tps is not None else "failed"
                if ngl == "all" and not args.test_device:
                    rt = rep.step(setup, f"{label} -ngl all: GPU runtime", lambda: gpu_runtime(llm))
                    if rt is not None:
                        rep.add(runtime, f"| {label} | {rt[1]:.3f} | {rt[2]:.3f} | `{rt[0][:300]}` |")
            finally:
                try:
                    llm.close()
                except Exception:  # noqa: BLE001
                    pass
        rep.add(speed, f"| {label} | {speeds.get('0', '-')} | {speeds.get('20', '-')} | {speeds.get('all', '-')} |")
        n_pp = 64 if args.quick else 512
        got_pp = rep.step(setup, f"{label} -ngl all: pp{n_pp}", lambda: prompt_speed(path, n_pp))
        if got_pp is not None:
            rep.add(pp, f"| {label} | {got_pp[0]:.0f} (pp{n_pp}) | `{got_pp[1][:300]}` |")
        try:
            path.unlink()
        except OSError:
            pass

    # 3b. mixture of experts ---------------------------------------------------------------
    moe = rep.section(f"Mixture of experts: -ngl all and --n-cpu-moe 1 vs -ngl 0 --f32-activations (KL max {KL_MAX:g}), "
                      "tokens/s, plan")
    rep.add(moe, "| model | placement | max KL | argmax agree | tokens/s | plan at -ngl all |")
    rep.add(moe, "|---|---|---|---|---|---|")
    for case in ("tiny-qwen3moe", "tiny-mixtral", "tiny-gptoss"):
        rep.step(moe, f"MoE {case}", lambda case=case: moe_check(rep, moe, tmp, case, args, gpu_prefix))
    rep.add(moe, "")
    rep.add(moe, "| model | pp512 at -ngl all (tokens/s) | prompt plan |")
    rep.add(moe, "|---|---|---|")
    for case in ("tiny-qwen3moe", "tiny-mixtral", "tiny-gptoss") + (() if args.quick else ("qwen3-30b-a3b",)):
        rep.step(moe, f"MoE pp512 {case}", lambda case=case: moe_prompt_speed(rep, moe, tmp, case))

    sweep_section(rep, args, gpu_prefix)
    return finish(rep, t_start)


def sweep_section(rep: Report, args: Any, gpu_prefix: str) -> None:
    """5. tg and pp at each -ngl of the sweep, with the host waits and copies of a step."""
    if args.sweep == "none":
        return
    lines = rep.section(f"The hybrid step: -ngl sweep on the {args.sweep} shape (tokens/s rising with -ngl; "
                        "one host wait per device->host boundary)")  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="llamapy-gpu-"))
    rep.step(lines, f"-ngl sweep {args.sweep}", lambda: ngl_sweep(rep, lines, tmp, args.sweep, args, gpu_prefix))


def finish(rep: Report, t_start: float) -> int:
    """The total, then the summary printed and written."""
    total = rep.section("Total")
    rep.add(total, f"- {time.perf_counter() - t_start:.1f} s, {rep.failures} failure(s)")

    md = rep.markdown()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_results.md").write_text(md)
        print(f"\nwritten: {out_dir / 'gpu_results.md'}")
    except OSError as e:
        print(f"\ncould not write the summary: {e}")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
