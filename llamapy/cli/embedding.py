"""`llamapy embedding` (llama.cpp's llama-embedding, examples/embedding/embedding.cpp): the
embeddings of the prompt's lines, printed on stdout in llama-embedding's formats (its default
lines and cosine similarity matrix, `array`, `json`, `json+`, `raw`); logs on stderr."""

from __future__ import annotations

import sys
import time

import numpy as np
import typer

from ..types import LlamapyError
from . import app, common, log, set_logging

FORMATS = ("", "array", "json", "json+", "raw")


@app.command(short_help="embeddings of texts, one per line (llama-embedding)")
def embedding(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    prompt: str = typer.Option(None, "-p", "--prompt", help="the texts, one per line (--embd-separator)"),
    file: str = typer.Option(None, "-f", "--file", metavar="FILE", help="read the texts from a file"),
    pooling: str = typer.Option(None, "--pooling", metavar="{none,mean,cls,last,rank}", help="pooling of a text's tokens (default: the model's); rank: a reranker's scores"),
    embd_normalize: int = typer.Option(2, "--embd-normalize", metavar="N", help="-1 none, 0 max absolute int16, 1 taxicab, 2 euclidean, >2 p-norm"),
    embd_output_format: str = typer.Option("", "--embd-output-format", metavar="FORMAT", help="'' (lines), array, json, json+ (with the cosine similarities) or raw"),
    embd_separator: str = typer.Option("\n", "--embd-separator", metavar="STRING", show_default=False, help="what separates the texts (default: a newline)"),
    cls_separator: str = typer.Option("\t", "--cls-separator", metavar="STRING", show_default=False, help="--pooling rank: what separates a text's query and document (default: a tab)"),
    verbose_prompt: bool = typer.Option(False, "--verbose-prompt", help="print each text's tokens on stderr"),
    escape: bool = common.ESCAPE,
    ctx_size: int = common.CTX,
    batch: int = common.BATCH,
    ubatch: int = common.UBATCH,
    threads: int = common.THREADS,
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
    """Embeddings of texts, one per line (llama-embedding)."""
    from ..embedding import check_embd_norm, embed, normalize, pooling_name, rerank_tokens
    from .run import read_text_file

    common.use_ray(ray)
    set_logging(not log_disable)
    common.no_effect(flash_attn, threads_batch, no_mmap)
    if embd_output_format not in FORMATS:
        raise LlamapyError(f"--embd-output-format {embd_output_format!r}: expected '', array, json, json+ or raw")
    check_embd_norm(embd_normalize)  # a bad N is refused before the load
    if prompt is not None and file is not None:
        raise LlamapyError("give the texts with -p or -f, not both")
    if prompt is None and file is None:
        raise LlamapyError("no texts: give -p TEXT or -f FILE")
    if file is not None:
        text = read_text_file(file)
        text = text[:-1] if text.endswith("\n") else text  # as llama.cpp's -f
    else:
        text = prompt
    if escape:
        text = common.process_escapes(text)
    if not embd_separator:
        raise LlamapyError("--embd-separator: must not be empty")
    texts = text.split(embd_separator)
    if batch < ctx_size:  # llama-embedding: a batch holds the whole context
        log(f"embedding: setting batch size to {ctx_size}")
        batch = ctx_size
    llm = common.load(model, model_opt, ngl=ngl, ot=common.with_expert_overrides(ot, cpu_moe, n_cpu_moe), ts=ts, mg=mg,
                      ctx_size=ctx_size, batch=batch, ubatch=ubatch, threads=threads, ctk=ctk, ctv=ctv, nkvo=nkvo,
                      no_op_offload=no_op_offload, device=device, f32_activations=f32_activations,
                      extra=common.adapters(lora, lora_scaled, control_vector, control_vector_scaled, control_vector_layer_range))  # fmt: skip
    try:
        pool = pooling_name(pooling, llm.model)
        tok = llm.tokenizer
        prompts = []
        for i, t in enumerate(texts):
            pair = t.split(cls_separator) if pool == "rank" and cls_separator and cls_separator in t else None
            if pair is not None and len(pair) != 2:
                raise LlamapyError(f"text {i}: a pair to rank is QUERY{cls_separator!r}DOCUMENT, not {len(pair)} parts")
            prompts.append(rerank_tokens(llm.model, *pair, cli=True) if pair else llm.tokenize(t))
        ends = {t for t in (tok.eos, tok.special.sep) if t is not None}
        if any(not p or p[-1] not in ends for p in prompts):
            log("embedding: warning: the last token of a text is not SEP or EOS (the model's tokenizer does not add one)")
        if verbose_prompt:
            for i, (t, p) in enumerate(zip(texts, prompts)):
                log(f"embedding: prompt {i}: '{t}'\nembedding: number of tokens in prompt = {len(p)}")
                for tid in p:
                    log(f"{tid:6d} -> '{tok.token_to_piece(tid, special=True).decode('utf-8', 'replace')}'")
        log(f"embedding: {len(prompts)} texts, {sum(map(len, prompts))} tokens, pooling {pool}, normalisation {embd_normalize}")
        t0 = time.perf_counter()
        out = embed(llm.ctx, prompts, pool, embd_normalize)
        dt = time.perf_counter() - t0
        # pooling none: every token's row, each normalised as llama-embedding does
        rows = [normalize(r, embd_normalize) for e in out for r in e] if pool == "none" else out
        labels = llm.model.params.cls_labels or tuple(map(str, range(llm.model.params.n_cls_out)))
        _print(np.array(rows, np.float32).reshape(len(rows), -1), texts, pool, embd_normalize, embd_output_format, labels)
        n_tok = sum(map(len, prompts))
        log(f"embedding: {n_tok} tokens in {dt * 1e3:.2f} ms ({n_tok / dt if dt > 0 else 0:.2f} tokens per second)")
    finally:
        llm.close()


def _print(emb: np.ndarray, texts: list[str], pool: str, norm: int, fmt: str, labels: tuple[str, ...]) -> None:
    """llama-embedding's stdout: `emb` is (n_embeddings, n_embd), or rank's (n_texts, n_cls_out)
    scores (printed as they are: --embd-normalize does not apply to them)."""
    from ..embedding import cosine

    w = sys.stdout.write
    norm = -1 if pool == "rank" else norm  # (the scores as they are: no int16 rounding)
    num = "{:6.0f} " if norm == 0 else "{:9.6f} "
    n, n_embd = emb.shape
    if fmt == "" and pool == "rank":
        w("\n")
        for j in range(n):
            for i, label in enumerate(labels):
                w(f"rerank score {j}: {emb[j, i]:8.3f}" + (f" [{label}]" if len(labels) > 1 else "") + "\n")
    elif fmt == "":
        w("\n")
        for j in range(n):
            if pool == "none":  # a token's: its first three and last three values
                cols = [*emb[j, :3]], [*emb[j, n_embd - 3 :]]
                w(f"embedding {j}: " + "".join(num.format(v) for v in cols[0]) + " ... "
                  + "".join(num.format(v) for v in cols[1]) + "\n")  # fmt: skip
            else:  # a text's: all of it alone, its first 16 values among several
                w(f"embedding {j}: " + "".join(num.format(v) for v in emb[j, : 16 if n > 1 else n_embd]) + "\n")
        if pool != "none" and n > 1:
            w("\ncosine similarity matrix:\n\n" + "".join(f"{t[:6]:>6} " for t in texts) + "\n")
            for i in range(n):
                w("".join(f"{cosine(emb[i], emb[j]):6.2f} " for j in range(n)) + texts[i][:10] + "\n")
    elif fmt == "raw":
        one = "{:.0f}" if norm == 0 else "{:.7f}"
        for j in range(n):
            w(" ".join(one.format(v) for v in emb[j]) + "\n")
    else:  # written as llama-embedding writes them, not by a JSON library: the same bytes
        one = "{:.0f}" if norm == 0 else "{:.7f}"
        vecs = ["[" + ",".join(one.format(v) for v in emb[j]) + "]" for j in range(n)]
        if fmt == "array":
            w("[" + ",".join(vecs) + "]\n")
        else:
            items = [f'    {{\n      "object": "embedding",\n      "index": {j},\n      "embedding": {v}\n    }}' for j, v in enumerate(vecs)]
            w('{\n  "object": "list",\n  "data": [\n' + ",\n".join(items) + "\n  ]")
            if fmt == "json+" and n > 1:
                sims = ["    [" + ", ".join(f"{cosine(emb[i], emb[j]):6.2f}" for j in range(n)) + " ]" for i in range(n)]
                w(',\n  "cosineSimilarity": [\n' + ",\n".join(sims) + "\n  ]")
            w("\n}\n")
    w("\n")
    sys.stdout.flush()
