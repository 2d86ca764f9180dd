"""The repacked-weight cache (layouts of the f32 matmul mode): the first load writes it, later
loads map it and compute the same logits; a damaged cache file is ignored (repacked again), never
an error."""

from __future__ import annotations

import mmap

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
