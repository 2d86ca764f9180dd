"""The buffer contract of backend/interface.py: `zeros` (mutable tensors), `clear` (in place,
ggml_backend_buffer_clear) and `alias` (a second name for the same memory), on the host buffer
and the TEST device's."""

from __future__ import annotations

import numpy as np
import pytest

from llamapy.backend.cpu import CPU_BUFT
from llamapy.backend.interface import Buffer, BufferUsage
from llamapy.backend.testgpu import TestDevice
from llamapy.tensor import Tensor
from llamapy.types import GGMLType


def _buffers() -> list[Buffer]:
    test_buft = TestDevice("TEST0", 1 << 20, "test").buffer_type()
    return [CPU_BUFT.alloc_buffer(1 << 12, BufferUsage.ANY), test_buft.alloc_buffer(1 << 12, BufferUsage.ANY)]


@pytest.mark.parametrize("i", [0, 1], ids=["CPU", "TEST0"])
def test_zeros_then_clear_in_place(i: int) -> None:
    buf = _buffers()[i]
    k = Tensor("cache_k", (4, 8), GGMLType.F32)
    v = Tensor("cache_v", (4, 8), GGMLType.F16)
    for t in (k, v):
        buf.alloc_tensor(t)
        buf.zeros(t)
    before = buf.storage(k)
    assert not np.asarray(buf.get(k)).any()
    before[1] = 3.0  # the cache written by a step
    buf.clear()
    assert buf.storage(k) is before  # same memory: compiled plans keep pointing at it
    assert not np.asarray(buf.get(k)).any()
    buf.clear(0.5)
    np.testing.assert_array_equal(buf.get(v), np.full((4, 8), 0.5, np.float16))
    buf.free()


def test_alias_shares_memory() -> None:
    buf = _buffers()[0]
    a = Tensor("a", (2, 6), GGMLType.F32)
    buf.alloc_tensor(a)
    buf.zeros(a)
    b = Tensor("b", (3, 4), GGMLType.F32)
    buf.alias(b, a)
    assert b.buffer is buf and buf.get(b).shape == (3, 4)
    buf.storage(a)[0, 1] = 7.0
    assert buf.get(b)[0, 1] == 7.0  # one memory, two shapes
    with pytest.raises(ValueError, match="cannot alias"):
        buf.alias(Tensor("c", (5,), GGMLType.F32), a)
    buf.free()


def test_kv_cache_clear_keeps_plans_valid(make_llama) -> None:  # noqa: ANN001
    """After Buffer.clear the KV cache arrays are the ones the executor's plan points into:
    decoding again gives the same logits as the first time."""
    from llamapy.context import Context, ContextOptions, Model

    model = Model(make_llama(qtype=__import__("gguf").GGMLQuantizationType.Q8_0))
    ctx = Context(model, ContextOptions(n_ctx=256))
    first = [ctx.decode([1, 5, 9], [0, 1, 2])] + [ctx.decode([20 + i], [3 + i]) for i in range(3)]
    ctx.kv.clear()
    for b in ctx.kv.buffers:
        b.clear()
    again = [ctx.decode([1, 5, 9], [0, 1, 2])] + [ctx.decode([20 + i], [3 + i]) for i in range(3)]
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    assert ctx.sched._plans  # compiled plans hold the cache's and the weights' memory ...
    ctx.free()
    assert not ctx.sched._plans  # ... until the context is freed
    model.free()
