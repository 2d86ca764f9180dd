"""The Python API's lifecycle and argument checks: close() (and the context-manager exit, and
garbage collection) releases every mapping and file descriptor; a closed Llama raises one clear
error; a call the context cannot hold leaves the KV cache as it was; bad arguments are refused
with a LlamapyError, as the CLI refuses them."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.types import ContextFullError, LlamapyError


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings(*paths: Path) -> list[str]:
    """Lines of /proc/self/maps naming one of `paths` or a file in the repack cache."""
    names = [str(p) for p in paths]
    repack = os.environ.get("LLAMAPY_REPACK_CACHE", "")
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        f = line.split(None, 5)[5] if len(line.split(None, 5)) == 6 else ""
        if f in names or (repack and f.startswith(repack)):
            out.append(f)
    return out


def _cycles(path: Path, n: int, how: str, cpu_matmul: str = "q8") -> tuple[list[float], list[int], list[int]]:
    """Load, evaluate a few tokens, release `n` times; (RSS, open fds, mappings) after each.
    cpu_matmul="f32" also maps the repacked-weights cache file."""
    rss, fds, maps = [], [], []
    toks = [1, 260, 261, 262]
    for _ in range(n):
        if how == "close":
            llm = llamapy.Llama(path, n_ctx=64, cpu_matmul=cpu_matmul)
            llm.logits(toks)
            llm.generate(toks, n_predict=2, temp=0)
            llm.close()  # `llm` stays referenced until the next round: close() alone must release
        elif how == "with":
            with llamapy.Llama(path, n_ctx=64, cpu_matmul=cpu_matmul) as llm:
                llm.logits(toks)
        else:  # garbage collection of an unclosed Llama
            llm = llamapy.Llama(path, n_ctx=64, cpu_matmul=cpu_matmul)
            llm.logits(toks)
            del llm
            gc.collect()
        rss.append(_rss_mib())
        fds.append(_n_fds())
        maps.append(len(_mappings(path)))
    return rss, fds, maps


@pytest.mark.parametrize("cpu_matmul", ["q8", "f32"])
@pytest.mark.parametrize("how", ["close", "with", "gc"])
def test_load_close_cycles_release_mappings_and_fds(make_llama, how: str, cpu_matmul: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # a repack folder of its own: another test's live Llama of the same content may map the
    # shared folder's entry, which _mappings would count
    monkeypatch.setenv("LLAMAPY_REPACK_CACHE", str(tmp_path / "repack"))
    # big enough (~22 MB of Q8_0 weights) that a leaked mapping per cycle shows in the RSS
    path = make_llama(n_layer=4, n_embd=512, n_ff=2048, n_head=8, n_head_kv=4, qtype=T.Q8_0)
    _cycles(path, 2, how, cpu_matmul)  # first loads: write the repack cache (f32), warm allocators
    fd0 = _n_fds()
    rss, fds, maps = _cycles(path, 10, how, cpu_matmul)
    assert maps == [0] * 10, _mappings(path)
    assert max(fds) <= fd0, fds
    assert rss[-1] - rss[0] < 40, rss  # a leak keeps ~25 MiB per cycle


def test_default_model_twenty_cycles_stay_flat(default_model: Path) -> None:
    """The issue's measurement: 20 load/close cycles of the default model (a leak took the RSS
    from 40 to 1953 MiB and left 27 files open). ~20 s, most of it the first load."""
    _cycles(default_model, 1, "close", "f32")
    fd0 = _n_fds()
    rss, fds, maps = _cycles(default_model, 20, "close", "f32")
    assert maps == [0] * 20
    assert max(fds) <= fd0, fds
    assert rss[-1] - rss[0] < 100, rss  # a leak keeps ~95 MiB per cycle


def test_use_after_close_raises_one_clear_error(make_llama) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1)
    llm = llamapy.Llama(path, n_ctx=64)
    toks = llm.tokenize("the")
    llm.close()
    llm.close()  # idempotent
    assert llm.closed
    calls = [
        lambda: llm.tokenize("the"),
        lambda: llm.detokenize(toks),
        lambda: llm.logits(toks),
        lambda: llm.generate(toks, n_predict=1),
        lambda: llm.stream(toks, n_predict=1),
        lambda: llm.warmup(),
        lambda: llm.perplexity(toks * 40),
        lambda: llm.tokenizer,
        lambda: llm.ctx,
    ]
    for call in calls:
        with pytest.raises(LlamapyError, match="closed"):
            call()


def test_a_stream_whose_llama_closes_stops_with_a_clear_error(make_llama) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1)
    llm = llamapy.Llama(path, n_ctx=64)
    it = llm.stream([1, 260], n_predict=8, temp=0, ignore_eos=True)
    next(it)
    llm.close()
    with pytest.raises(LlamapyError, match="freed"):
        next(it)


def test_a_call_the_context_cannot_hold_leaves_the_kv_cache_as_it_was(make_llama) -> None:  # noqa: ANN001
    path = make_llama(n_layer=2)
    co = llamapy.ContextOptions(n_ctx=256, n_batch=256, n_ubatch=32)  # several micro-batches per call
    rng = np.random.default_rng(0)
    a = [int(t) for t in rng.integers(3, 270, 150)]
    b = [int(t) for t in rng.integers(3, 270, 80)]
    with llamapy.Llama(path, context_options=co) as llm:
        kv = llm.ctx.kv
        llm.logits(a, seq=0)
        fits = llm.logits(b[:60], seq=2)  # the reference: 150 + 60 <= 256
        kv.seq_rm(2)
        llm.logits(b[:60], seq=1)  # 210 cells used, 46 free
        pos, seq = kv.pos.copy(), kv.seq.copy()
        with pytest.raises(ContextFullError):
            llm.logits(b, seq=2)  # 80 tokens in 3 micro-batches, 46 cells free: nothing changes
        with pytest.raises(ContextFullError):
            llm.ctx.decode(b, np.arange(80), 2)  # the same through Context.decode
        assert np.array_equal(kv.pos, pos) and np.array_equal(kv.seq, seq)
        llm.ctx.kv.seq_rm(1)
        again = llm.logits(b[:60], seq=2)  # a call that fits now runs, as before the failures
        np.testing.assert_allclose(again, fits, rtol=1e-4, atol=1e-4)
        # sequence 0 was not disturbed: its next token's logits are those of a fresh evaluation
        nxt = llm.ctx.decode([5], [150], 0)
    with llamapy.Llama(path, context_options=co) as ref:
        ref.logits(a, seq=0)
        np.testing.assert_allclose(ref.ctx.decode([5], [150], 0), nxt, rtol=1e-4, atol=1e-4)


def test_an_interrupted_decode_frees_the_cells_it_took(make_llama, monkeypatch) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1)
    co = llamapy.ContextOptions(n_ctx=128, n_batch=128, n_ubatch=16)
    with llamapy.Llama(path, context_options=co) as llm:
        ctx = llm.ctx
        llm.logits([1, 260, 261], seq=0)
        pos, seq = ctx.kv.pos.copy(), ctx.kv.seq.copy()
        real = ctx._decode_ubatch
        calls = {"n": 0}

        def interrupt_third(*a):  # noqa: ANN002, ANN202
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return real(*a)

        monkeypatch.setattr(ctx, "_decode_ubatch", interrupt_third)
        with pytest.raises(KeyboardInterrupt):
            ctx.decode(list(range(3, 63)), np.arange(60), 1)
        assert np.array_equal(ctx.kv.pos, pos) and np.array_equal(ctx.kv.seq, seq)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda llm: llm.logits([1, 260], seq=-1), "seq -1"),
        (lambda llm: llm.logits([1, 260], seq=1.5), "seq 1.5"),
        (lambda llm: llm.ctx.decode([1, 260], [0, 1], -1), "sequence ids"),
        (lambda llm: llm.ctx.decode([1, 260], [0, -1], 0), "positions"),
        (lambda llm: llm.tokenize(None), "str, not NoneType"),
        (lambda llm: llm.tokenize(b"the"), "str, not bytes"),
        (lambda llm: llm.detokenize(None), "not NoneType"),
        (lambda llm: llm.generate(None), "not NoneType"),
        (lambda llm: llm.generate([1, 10**6]), "out of range"),
        (lambda llm: llm.generate(["a"]), "integers"),
        (lambda llm: llm.stream("the", n_predict=-5), "-n -5"),
        (lambda llm: llm.logits([]), "no tokens"),
    ],
)
def test_bad_arguments_are_one_line_errors(make_llama, call, needle: str) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1)
    with llamapy.Llama(path, n_ctx=64) as llm:
        with pytest.raises(LlamapyError) as e:
            call(llm)
        assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"n_ctx": -1}, "n_ctx -1"), ({"n_threads": -2}, "n_threads -2"), ({"n_gpu_layers": "most"}, "n_gpu_layers 'most'")],
)
def test_bad_options_are_refused_before_loading(make_llama, kw: dict, needle: str) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1)
    with pytest.raises(LlamapyError, match=needle):
        llamapy.Llama(path, **kw)
    with pytest.raises(LlamapyError, match="batch sizes"):
        llamapy.Llama(path, context_options=llamapy.ContextOptions(n_ubatch=0))


def test_numpy_kernels_keep_no_mapping_after_close(make_llama, tmp_path: Path) -> None:  # noqa: ANN001
    """The numpy ROPE's table cache held rope_freqs (a view of the file) after close()."""
    path = make_llama(n_layer=1, rope_freqs=True)
    script = (
        "import gc, sys, llamapy\n"
        f"llm = llamapy.Llama({str(path)!r}, n_ctx=64)\n"
        "llm.logits([1, 260, 261]); llm.close(); gc.collect()\n"
        f"print(sum({str(path)!r} in line for line in open('/proc/self/maps')))\n"
    )
    env = {**os.environ, "LLAMAPY_KERNELS": "numpy"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_closing_one_llama_leaves_another_of_the_same_model_working(make_llama) -> None:  # noqa: ANN001
    path = make_llama(n_layer=2)
    toks = [1, 260, 261, 262]
    a = llamapy.Llama(path, n_ctx=64)
    b = llamapy.Llama(path, n_ctx=64)
    before = b.logits(toks)
    a.logits(toks)
    a.close()
    gc.collect()
    np.testing.assert_array_equal(b.logits(toks), before)
    assert len(_mappings(path)) > 0  # b's mappings are still there
    b.close()
    assert _mappings(path) == []
