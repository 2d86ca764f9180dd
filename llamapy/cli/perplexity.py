"""`llamapy perplexity` (llama.cpp's llama-perplexity, tools/perplexity/perplexity.cpp):
perplexity over chunks of a text, writing a `--kl-divergence-base` logits file, or comparing
with one (`--kl-divergence`). Results on stdout, logs and the progress bar on stderr."""

from __future__ import annotations

import sys
import time
from contextlib import closing

import typer

from ..types import LlamapyError
from . import app, common, log, set_logging


def _progress(total: int, desc: str):  # noqa: ANN202 - tqdm
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="chunk", file=sys.stderr, leave=False, dynamic_ncols=True)


def _eta_line(seconds_per_pass: float, n_passes: int) -> str:
    total = int(seconds_per_pass * n_passes)
    hours = f"{total // 3600} hours " if total >= 3600 else ""
    return f"perplexity: {seconds_per_pass:.2f} seconds per pass - ETA {hours}{total % 3600 / 60.0:.2f} minutes"


def _out(text: str, end: str = "\n") -> None:
    sys.stdout.write(text + end)
    sys.stdout.flush()


@app.command(short_help="perplexity of a text, or KL divergence (llama-perplexity)")
def perplexity(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    file: str = typer.Option(None, "-f", "--file", metavar="FILE", help="the text to evaluate"),
    ctx_size: int = typer.Option(512, "-c", "--ctx-size", help="tokens per chunk"),
    batch: int = common.BATCH,
    ubatch: int = common.UBATCH,
    chunks: int = typer.Option(-1, "--chunks", help="evaluate at most N chunks (-1: all)"),
    threads: int = common.THREADS,
    kl_divergence_base: str = typer.Option(
        None, "--kl-divergence-base", metavar="FILE", help="logits file: written, or read with --kl-divergence"
    ),
    kl_divergence: bool = typer.Option(
        False, "--kl-divergence", help="compare with the logits in --kl-divergence-base (its tokens, n_ctx and chunks)"
    ),
    ngl: str = common.NGL,
    ot: list[str] = common.OT,
    cpu_moe: bool = common.CPU_MOE,
    n_cpu_moe: int = common.N_CPU_MOE,
    lora: list[str] = common.LORA,
    lora_scaled: list[str] = common.LORA_SCALED,
    control_vector: list[str] = common.CVEC,
    control_vector_scaled: list[str] = common.CVEC_SCALED,
    control_vector_layer_range: tuple[int, int] = common.CVEC_RANGE,
    ts: str = common.TS,
    mg: int = common.MG,
    ctk: str = common.CTK,
    ctv: str = common.CTV,
    nkvo: bool = common.NKVO,
    no_op_offload: bool = common.NO_OP_OFFLOAD,
    f32_activations: bool = common.F32_ACT,
    device: str = common.DEVICE,
    ray: str = common.RAY,
    flash_attn: str = common.FLASH_ATTN,
    threads_batch: int = common.THREADS_BATCH,
    no_mmap: bool = common.NO_MMAP,
    log_disable: bool = common.LOG_DISABLE,
) -> None:
    """Perplexity of a text, or KL divergence against a base model's logits (llama-perplexity)."""
    common.use_ray(ray)
    from ..perplexity import plan_context

    set_logging(not log_disable)
    common.no_effect(flash_attn, threads_batch, no_mmap)
    placement = dict(ngl=ngl, ot=common.with_expert_overrides(ot, cpu_moe, n_cpu_moe), ts=ts, mg=mg, threads=threads, ctk=ctk, ctv=ctv, nkvo=nkvo,
                     no_op_offload=no_op_offload, device=device, f32_activations=f32_activations,
                     extra=common.adapters(lora, lora_scaled, control_vector, control_vector_scaled, control_vector_layer_range))
    if chunks == 0:
        raise LlamapyError("--chunks 0: nothing to evaluate")
    if ubatch <= 0:
        raise LlamapyError(f"-ub {ubatch}: the physical batch size must be positive")
    if kl_divergence:
        if not kl_divergence_base:
            raise LlamapyError("--kl-divergence needs --kl-divergence-base FILE (the base model's logits)")
        _kl_divergence(model, model_opt, kl_divergence_base, batch, ubatch, chunks, placement)
    else:
        plan_context(ctx_size, batch)  # -c 1, -c 2: refused before anything is read or loaded
        if not file:
            raise LlamapyError("no text: give -f FILE")
        _perplexity(model, model_opt, file, ctx_size, batch, ubatch, chunks, kl_divergence_base, placement)


def _perplexity(model, model_opt, file, n_ctx, n_batch, n_ubatch, chunks, out_file, placement) -> None:  # noqa: ANN001
    from ..perplexity import count_chunks, evaluate_perplexity, format_final, plan_context
    from .run import read_text_file

    text = read_text_file(file)
    if not text.strip():
        raise LlamapyError(f"-f {file}: the file is empty")
    n_seq, n_kv, n_batch = plan_context(n_ctx, n_batch)
    t0 = time.perf_counter()
    llm = common.load(model, model_opt, ctx_size=n_kv, batch=n_batch, ubatch=n_ubatch, **placement)
    try:
        log("perplexity: tokenizing the input ..")
        tokens = llm.tokenize(text)
        n_chunk = count_chunks(len(tokens), n_ctx, chunks)
        ctx = llm.ctx
        n_batch = ctx.n_batch
        n_seq = max(1, min(n_batch // n_ctx, ctx.n_ctx // n_ctx))
        if out_file:
            log(f"perplexity: saving all logits to {out_file}")
        log(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={n_ctx}, batch_size={n_batch}, n_seq={n_seq}")
        bar = _progress(n_chunk, "perplexity")
        t_start = time.perf_counter()
        est = None
        # closing(): on Ctrl-C or an error the generator's cleanup (dropping OUT.partial) runs now
        with bar, closing(evaluate_perplexity(ctx, tokens, n_ctx, n_chunk, n_batch, out_file)) as chunks_done:
            for ch, est in chunks_done:
                if ch.index == 0:
                    bar.write(_eta_line(time.perf_counter() - t_start, (n_chunk + n_seq - 1) // n_seq), file=sys.stderr)
                bar.update(1)
                _out(f"[{ch.index + 1}]{est.ppl:.4f},", end="")
        _out("")
        assert est is not None
        _out(format_final(est))
        dt = time.perf_counter() - t_start
        n_eval = n_chunk * n_ctx
        log(
            f"perplexity: {n_eval} tokens in {dt:.2f} s ({n_eval / dt if dt > 0 else 0:.2f} tokens per second), "
            f"total {time.perf_counter() - t0:.2f} s"
        )
        if out_file:
            log(f"perplexity: wrote {out_file}")
    finally:
        llm.close()


def _kl_divergence(model, model_opt, base_file, n_batch, n_ubatch, chunks, placement) -> None:  # noqa: ANN001
    from ..perplexity import KLD_TABLE_HEADER, evaluate_kl_divergence, format_kld_summary, read_logits_file

    base = read_logits_file(base_file)
    n_chunk = base.n_chunk if chunks < 0 else min(chunks, base.n_chunk)
    t0 = time.perf_counter()
    llm = common.load(model, model_opt, ctx_size=base.n_ctx, batch=min(n_batch, base.n_ctx), ubatch=n_ubatch, **placement)
    try:
        n_vocab = llm.model.params.n_vocab
        if base.n_vocab != n_vocab:
            raise LlamapyError(f"{base_file}: inconsistent vocabulary ({base.n_vocab} in the file vs {n_vocab} in the model)")
        ctx = llm.ctx
        log(
            f"kl_divergence: {base_file}: n_ctx={base.n_ctx}, n_vocab={base.n_vocab}, {base.n_chunk} chunks; "
            f"evaluating {n_chunk}, batch_size={ctx.n_batch}"
        )
        bar = _progress(n_chunk, "kl-divergence")
        t_start = time.perf_counter()
        stats = None
        with bar, closing(evaluate_kl_divergence(ctx, base, ctx.n_batch, n_chunk)) as chunks_done:
            for ch, stats in chunks_done:
                if ch.index == 0:
                    bar.write(_eta_line(time.perf_counter() - t_start, n_chunk), file=sys.stderr)
                    _out("")
                    _out(KLD_TABLE_HEADER)
                bar.update(1)
                _out(stats.chunk_row(ch.index + 1))
        _out("")
        assert stats is not None
        if stats.count < 100:
            log(f"kl_divergence: only {stats.count} tokens scored: no statistics below 100 (as llama.cpp)")
        else:
            for line in format_kld_summary(stats.summary()):
                _out(line)
        log(f"kl_divergence: {stats.count} tokens scored in {time.perf_counter() - t_start:.2f} s, total {time.perf_counter() - t0:.2f} s")
    finally:
        llm.close()
