"""The repacked-weight cache (layouts of the f32 matmul mode): the first load writes it, later
loads map it and compute the same logits; a damaged cache file is ignored (repacked again), never
an error. Entries are keyed by content (a copy or a touched file reuses one), the folder is
bounded (least recently used out first), `llamapy cache list|clear` manage it, and a folder that
cannot be written is said."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.backend.qmatmul import kernels

pytestmark = pytest.mark.skipif(kernels() == "numpy", reason="repacked layouts need compiled kernels")


def _mapped(arr: np.ndarray) -> bool:
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, mmap.mmap) or (isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap))


def test_second_load_maps_the_cache(make_llama, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_REPACK_CACHE", str(tmp_path / "repack"))
    path = make_llama(n_layer=2, qtype=T.Q4_1, embd_type=T.Q8_0)
    toks = [1, 260, 261, 40, 41, 42]
    with llamapy.Llama(path, n_ctx=64, cpu_matmul="f32") as llm:
        first = llm.logits(toks)
        qm = llm.model.weights.layers[0]["attn_qkv"].buffer.storage(llm.model.weights.layers[0]["attn_qkv"])
        assert qm.repacked and not _mapped(qm.state()[0])
    files = list((tmp_path / "repack").glob("*.bin"))
    assert len(files) == 1
    with llamapy.Llama(path, n_ctx=64, cpu_matmul="f32") as llm:
        t = llm.model.weights.layers[0]["attn_qkv"]
        assert _mapped(t.buffer.storage(t).state()[0])
        assert np.array_equal(llm.logits(toks), first)
    # a damaged file is ignored: the model repacks and gives the same logits
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with llamapy.Llama(path, n_ctx=64, cpu_matmul="f32") as llm:
        assert np.array_equal(llm.logits(toks), first)


def _entries(root) -> list:  # noqa: ANN001
    return sorted(p.name for p in root.glob("*.bin"))


def test_copies_and_touched_files_reuse_one_entry(make_llama, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    root = tmp_path / "repack"
    monkeypatch.setenv("LLAMAPY_REPACK_CACHE", str(root))
    path = make_llama(n_layer=1, qtype=T.Q4_1)
    with llamapy.Llama(path, n_ctx=64, cpu_matmul="f32") as llm:
        first = llm.logits([1, 260, 261])
    names = _entries(root)
    assert len(names) == 1
    written = (root / names[0]).read_bytes()
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    os.utime(copy, (1e9, 1e9))  # another path, another modification time: the same content
    os.utime(path)
    for p in (copy, path):
        with llamapy.Llama(p, n_ctx=64, cpu_matmul="f32") as llm:
            t = llm.model.weights.layers[0]["attn_qkv"]
            assert _mapped(t.buffer.storage(t).state()[0])  # mapped from the one entry
            assert np.array_equal(llm.logits([1, 260, 261]), first)
    assert _entries(root) == names and (root / names[0]).read_bytes() == written


def test_other_content_gets_another_entry(make_llama) -> None:  # noqa: ANN001
    from llamapy.model.gguf import GGUFFile

    a, b = make_llama(n_layer=1, seed=1), make_llama(n_layer=1, seed=2)
    with GGUFFile(a) as ga, GGUFFile(b) as gb:
        assert ga.content_key() != gb.content_key()
    data = bytearray(a.read_bytes())  # one byte in the middle sample of the largest tensor
    with GGUFFile(a) as ga:
        t = max(ga.tensors.values(), key=lambda t: t.nbytes)
        ka = ga.content_key()
    data[t.offset + (t.nbytes - 4096) // 2 + 7] ^= 1
    b.write_bytes(bytes(data))
    with GGUFFile(b) as gb:
        assert gb.content_key() != ka


def test_the_cache_is_bounded_least_recently_used_first(make_llama, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    root = tmp_path / "repack"
    monkeypatch.setenv("LLAMAPY_REPACK_CACHE", str(root))
    models = [make_llama(n_layer=1, seed=s) for s in range(4)]

    def load(p) -> str:  # noqa: ANN001
        before = set(_entries(root))
        with llamapy.Llama(p, n_ctx=64, cpu_matmul="f32"):
            pass
        new = set(_entries(root)) - before
        return new.pop() if new else ""

    e0 = load(models[0])
    size = (root / e0).stat().st_size
    monkeypatch.setenv("LLAMAPY_REPACK_CACHE_MAX", str(int(2.5 * size)))  # room for two entries
    e1 = load(models[1])
    time.sleep(0.02)
    assert _entries(root) == sorted([e0, e1])
    e2 = load(models[2])  # a third: the least recently used (e0) goes
    assert _entries(root) == sorted([e1, e2])
    time.sleep(0.02)
    assert load(models[1]) == ""  # e1 used again: now the most recent
    time.sleep(0.02)
    e3 = load(models[3])
    assert _entries(root) == sorted([e1, e3])
    monkeypatch.setenv("LLAMAPY_REPACK_CACHE_MAX", "0")  # nothing fits: the newest still stays
    load(models[0])
    assert _entries(root) == [e0]


def test_cache_max_sizes() -> None:
    from llamapy.backend.repack_cache import max_bytes

    for text, n in (("500M", 500 * 2**20), ("16G", 16 * 2**30), ("1024", 1024), ("2GiB", 2 * 2**30)):
        os.environ["LLAMAPY_REPACK_CACHE_MAX"] = text
        try:
            assert max_bytes() == n
        finally:
            del os.environ["LLAMAPY_REPACK_CACHE_MAX"]
    assert max_bytes() == 16 * 2**30
    os.environ["LLAMAPY_REPACK_CACHE_MAX"] = "lots"
    try:
        with pytest.raises(llamapy.LlamapyError, match="LLAMAPY_REPACK_CACHE_MAX=lots"):
            max_bytes()
    finally:
        del os.environ["LLAMAPY_REPACK_CACHE_MAX"]


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLAMAPY_DEBUG"}
    env["LLAMAPY_REPACK_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "llamapy", *args], capture_output=True, text=True, env=env, timeout=300)


def test_cache_command_lists_and_clears(make_llama, tmp_path) -> None:  # noqa: ANN001
    root = tmp_path / "repack"
    a, b = make_llama(n_layer=1, seed=1), make_llama(n_layer=2, seed=2)
    for p in (a, b):
        r = _cli("run", str(p), "-p", "the", "-n", "1", "--f32-activations", cache=root)
        assert r.returncode == 0, r.stderr
    (root / "notes.txt").write_text("mine")
    (root / "other.bin").write_bytes(b"not an entry")
    r = _cli("cache", "list", cache=root)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and "test-2l-Q8_0" in lines[0] and "test-1l-Q8_0" in lines[1]  # newest first
    assert lines[2].startswith("2 entries") and "LLAMAPY_REPACK_CACHE_MAX" in lines[2]
    r = _cli("cache", "clear", cache=root)
    assert r.returncode == 0 and "removed 2 entries" in r.stderr, r.stderr
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "other.bin"]  # only entries go
    r = _cli("cache", "list", cache=root)
    assert r.stdout.startswith("0 entries")
    r = _cli("cache", "prune", cache=root)
    assert r.returncode == 1 and r.stderr.startswith("error: cache prune") and "Traceback" not in r.stderr


def test_an_unwritable_cache_folder_is_said_on_stderr(make_llama, tmp_path) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folders = [blocker / "repack"]  # root may write anywhere: a folder under a file it cannot make
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        folders.append(ro)
    for folder in folders:
        r = _cli("run", str(path), "-p", "the", "-n", "1", "--f32-activations", cache=folder)
        assert r.returncode == 0, r.stderr
        warn = [line for line in r.stderr.splitlines() if line.startswith("warning: repack cache")]
        assert len(warn) == 1 and "cannot write" in warn[0] and str(folder) in warn[0], r.stderr
    r = _cli("run", str(path), "-p", "the", "-n", "1", cache=tmp_path / "ok")  # a writable one: silent
    assert r.returncode == 0 and "warning: repack cache" not in r.stderr


def test_a_malformed_cache_bound_is_said(make_llama, tmp_path) -> None:  # noqa: ANN001
    path = make_llama(n_layer=1)
    env = {k: v for k, v in os.environ.items() if k != "LLAMAPY_DEBUG"}
    env.update(LLAMAPY_REPACK_CACHE=str(tmp_path / "c"), LLAMAPY_REPACK_CACHE_MAX="lots")
    r = subprocess.run([sys.executable, "-m", "llamapy", "run", str(path), "-p", "the", "-n", "1",
                        "--f32-activations"],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "warning: repack cache: LLAMAPY_REPACK_CACHE_MAX=lots" in r.stderr
    r = subprocess.run([sys.executable, "-m", "llamapy", "cache", "list"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("error: LLAMAPY_REPACK_CACHE_MAX=lots")
