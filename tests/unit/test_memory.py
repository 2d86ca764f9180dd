"""Resident memory (issue 11: peak RSS of `run -n 128 -c 512` ≤ 1.2× llama.cpp's). Deterministic
checks of what stays resident, not timings: a fused weight's parts, copied into one matrix, do
not keep their pages of the model file mapped (parts that lie one after another in the file are
used there, without a copy); the run path imports no module it does not use."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_pages(arr: np.ndarray) -> int:
    """Pages of `arr`'s address range mapped in this process (/proc/self/pagemap's present bit:
    readable without privileges)."""
    first = arr.ctypes.data // PAGE
    last = (arr.ctypes.data + arr.nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        data = f.read((last - first + 1) * 8)
    return sum(1 for (e,) in struct.iter_unpack("<Q", data) if e >> 63)


pagemap = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux /proc/self/pagemap")


@pagemap
@pytest.mark.parametrize("cpu_matmul", ["q8", "f32"])
@pytest.mark.parametrize("sorted_layers", [True, False], ids=["parts-apart", "parts-adjacent"])
def test_fused_parts_resident_once(make_llama, tmp_path, monkeypatch, cpu_matmul, sorted_layers) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_REPACK_CACHE", str(tmp_path / "repack"))
    # 256 x 256 Q8_0 rows: 68 KiB a matrix, so each part spans many whole pages
    path = make_llama(n_layer=2, n_embd=256, n_ff=512, qtype=T.Q8_0, sorted_layers=sorted_layers)
    toks = [1, 260, 261, 40, 41, 42]
    with llamapy.Llama(path, n_ctx=64, cpu_matmul=cpu_matmul) as llm:
        gf = llm.model.gguf
        fused = [t for layer in llm.model.weights.layers for t in layer.values() if "fused_from" in t.params]
        assert len(fused) == 2 * 2  # qkv, gate_up per layer
        logits = llm.logits(toks)
        for t in fused:
            parts = t.params["fused_from"]
            # llama-quantize's order (sorted) puts no parts one after another; the writer's own
            # order puts q, k, v and gate, up so
            assert (gf.adjacent_bytes(parts) is None) == sorted_layers
            for name in parts:
                view = gf.tensor_bytes(name)
                assert view.nbytes > 4 * PAGE
                if sorted_layers or cpu_matmul == "f32":
                    # a copy runs (the parts stacked, or repacked tiles): at most the two pages
                    # each part shares with its neighbours in the file stay
                    assert _resident_pages(view) <= 2, name
                else:
                    # adjacent parts run where they are mapped, as one matrix: no copy to hold
                    assert _resident_pages(view) >= view.nbytes // PAGE - 1, name
        down = gf.tensor_bytes("blk.0.ffn_down.weight")
        if cpu_matmul == "q8":
            # an unfused matrix is multiplied where it is mapped: its pages stay (the release
            # is not global)
            assert _resident_pages(down) >= down.nbytes // PAGE - 1
        else:
            # "f32" repacks every matrix: what runs is the copy, the file's pages go
            assert _resident_pages(down) <= 2
    # the released pages read back unchanged: a second load computes the same logits, and
    # the other order of the same tensors too
    with llamapy.Llama(path, n_ctx=64, cpu_matmul=cpu_matmul) as llm:
        assert np.array_equal(llm.logits(toks), logits)
    other = make_llama(n_layer=2, n_embd=256, n_ff=512, qtype=T.Q8_0, sorted_layers=not sorted_layers)
    with llamapy.Llama(other, n_ctx=64, cpu_matmul=cpu_matmul) as llm:
        assert np.array_equal(llm.logits(toks), logits)


def test_release_pages_keeps_the_bytes(make_llama) -> None:  # noqa: ANN001
    from llamapy.model.gguf import GGUFFile

    path = make_llama(n_layer=1, n_embd=256, qtype=T.Q8_0)
    with GGUFFile(path) as gf:
        view = gf.tensor_bytes("blk.0.attn_q.weight")
        before = view.copy()
        released = gf.release_pages("blk.0.attn_q.weight")
        assert 0 < released <= view.nbytes and released % PAGE == 0
        assert np.array_equal(view, before)
        assert gf.release_pages("blk.0.attn_norm.weight") == 0  # 1 KiB: no whole page inside


def test_run_imports_nothing_it_does_not_use(default_model) -> None:  # noqa: ANN001
    """`run --temp 0` on the default model: none of the modules that cost resident memory
    without being used (pydantic through typer >= 0.29, OpenSSL's libcrypto through hashlib or
    secrets, numpy.random for greedy decoding, asyncio) is imported."""
    probe = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: sys.stderr.write('MODULES ' + ' '.join(sorted(sys.modules)) + '\\n'))\n"
        "sys.argv = ['llamapy'] + sys.argv[1:]\n"
        "runpy.run_module('llamapy', run_name='__main__', alter_sys=True)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, "run", str(default_model), "-p", "Once upon a time", "-n", "4",
         "-c", "512", "--temp", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("MODULES "))
    mods = set(line.split()[1:])
    assert "llamapy.model.sampler" in mods  # the probe saw the run
    for unwanted in ("pydantic", "_hashlib", "hmac", "numpy.random", "asyncio"):
        assert unwanted not in mods, f"{unwanted} imported by `run --temp 0` (typer>=0.29 imports pydantic)"


@pagemap
def test_decoded_metadata_arrays_are_not_kept_mapped(default_model) -> None:  # noqa: ANN001
    """The vocabulary is kept decoded (Python strings): its bytes in the mapping are released
    once read, and read back unchanged when decoded again."""
    from llamapy.model.gguf import GGUFFile

    with GGUFFile(default_model) as gf:  # 49152 tokens: ~0.8 MB of the header
        ent = gf.metadata._entries["tokenizer.ggml.tokens"]
        start = -(-ent.offset // PAGE) * PAGE
        inner = np.frombuffer(gf._buf, np.uint8, count=ent.end // PAGE * PAGE - start, offset=start)
        assert inner.nbytes >= PAGE  # the vocabulary spans whole pages
        tokens = gf.metadata["tokenizer.ggml.tokens"]
        assert _resident_pages(inner) == 0
        assert gf._decode("tokenizer.ggml.tokens", ent) == tokens


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))


@pagemap
def test_kv_cache_pages_count_once_written(make_llama) -> None:  # noqa: ANN001
    """The CPU KV cache lies on private anonymous pages: reading unwritten cells (attention
    reads past the cells in use) maps nothing, a page counts in the RSS once written, and
    clearing the buffer to zero gives the pages back."""
    from llamapy.backend.cpu import zeroed_pages

    a = zeroed_pages((2048, 1024), np.dtype(np.float32))  # 8 MiB
    r0 = _rss_kib()
    assert float(a.sum()) == 0.0  # reads every page
    r1 = _rss_kib()
    assert r1 - r0 < 2048, "reading unwritten pages made them resident"
    a[:] = 1.0
    r2 = _rss_kib()
    assert r2 - r1 > 6 * 1024
    path = make_llama(n_layer=2)
    with llamapy.Llama(path, n_ctx=2048) as llm:
        llm.logits([1, 260, 261, 40])
        buf = llm.ctx.kv.buffers[0]
        k = buf.storage(buf.tensors()[0])
        assert k.nbytes >= 256 * 1024
        assert _resident_pages(k) < k.nbytes // PAGE  # not the whole cache
        k[:] = 1.0
        before = _rss_kib()
        buf.clear(0)
        assert _rss_kib() < before - k.nbytes // 2048  # the pages went (half of them, at least)
        assert not k.any()
