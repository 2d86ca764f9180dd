"""Op offload follows ggml-cuda's rule (`ggml_backend_cuda_device_offload_op`): an op that reads
a weight in host memory runs on the GPU when its batch size — `ne[1]` for MUL_MAT, `ne[2]` for
ROPE, the rows for most ops — is at least 32; GET_ROWS never. And pass 3 places an op no
expansion could place where most of its inputs already are (ggml's "3.best")."""

from __future__ import annotations

import numpy as np
import pytest
from sched_support import open_llm

from llamapy import ops
from llamapy.backend.device import OFFLOAD_MIN_BATCH, op_batch_size
from llamapy.backend.testgpu import TestDevice
from llamapy.tensor import Op, Tensor, TensorFlag
from llamapy.types import GGMLType


@pytest.fixture
def test_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)


def _w(*shape: int) -> Tensor:
    return Tensor("w", shape, GGMLType.F32, flags=TensorFlag.WEIGHT)


def _x(*shape: int) -> Tensor:
    return Tensor("x", shape, GGMLType.F32)


@pytest.mark.parametrize("n", [1, 31, 32, 512])
def test_batch_size_of_each_op(n: int) -> None:
    dev = TestDevice("TEST0", 1 << 30, "")
    big = n >= OFFLOAD_MIN_BATCH
    mm = ops.mul_mat(_w(64, 16), _x(n, 16))  # (n, 64): ne[1] = n
    norm = ops.mul(ops.rms_norm(_x(n, 16), 1e-5), _w(16))  # n rows
    rope = ops.rope(_x(n, 4, 8), Tensor("pos", (n,), GGMLType.I32), n_dims=8, freq_base=1e4)  # (n, heads, dim): ne[2] = n
    rows = ops.get_rows(_w(100, 16), Tensor("ids", (n,), GGMLType.I32))
    assert op_batch_size(mm) == n and dev.offload_op(mm) is big
    assert op_batch_size(norm) == n and dev.offload_op(norm) is big
    assert op_batch_size(rope) == n and dev.offload_op(rope) is big
    assert op_batch_size(rows) == 0 and dev.offload_op(rows) is False
    # ne[2] for ROPE, not its rows: one token of 64 heads is a batch of one
    assert not dev.offload_op(ops.rope(_x(1, 64, 8), Tensor("pos", (1,), GGMLType.I32), n_dims=8, freq_base=1e4))


def _plan(llm, n_tokens: int):  # noqa: ANN001, ANN202
    plan = llm.ctx.plan(n_tokens)
    where = {n: llm.ctx.backends[plan.assignment[n]].name for n in plan.graph.nodes}
    return plan, where


def _old_rule(self, node: Tensor) -> bool:  # noqa: ANN001
    """The rule before: MUL_MAT only."""
    if node.op is not Op.MUL_MAT:
        return False
    return int(np.prod(node.src[1].shape[:-1])) >= OFFLOAD_MIN_BATCH


@pytest.mark.parametrize("ngl", [0, 20])
def test_prompt_graph_offloads_every_big_op_on_host_weights(tiny32, test_gpu, monkeypatch, ngl: int) -> None:  # noqa: ANN001
    with open_llm(tiny32, ngl, n_ctx=1024) as llm:
        plan, where = _plan(llm, 512)
        n_layer = llm.model.params.n_layer
        start = llm.model.placement.i_gpu_start
        for n in plan.graph.nodes:
            w = next((s for s in n.src if s.flags & TensorFlag.WEIGHT), None)
            if w is None or w.buffer.name != "CPU":
                continue
            # every op on a host weight goes to the GPU (the norms' MUL too), the lookup never
            assert where[n] == ("CPU" if n.op is Op.GET_ROWS else "TEST0"), (n, where[n])
        assert where[next(n for n in plan.graph.nodes if n.name == "attn_norm-0")] == "TEST0"
        # what stays on the host between GPU runs: the embedding lookup and the stores into the
        # host KV cache of the CPU layers (K and V stored together, as build_attn orders them)
        assert len(plan.splits) <= 1 + 2 * min(start, n_layer) + 1
        new = len(plan.splits)
        monkeypatch.setattr(TestDevice, "offload_op", _old_rule)
        llm.ctx.sched.set_op_offload(False)
        llm.ctx.sched.set_op_offload(True)  # planned again under the old rule
        old = len(llm.ctx.plan(512).splits)
    assert new < old, (new, old)


def test_small_batches_stay_with_their_weights(tiny32, test_gpu) -> None:  # noqa: ANN001
    with open_llm(tiny32, 0) as llm:
        plan, where = _plan(llm, 31)
        # host devices only (BLAS takes the products qmatmul.use_sgemm gives it; same memory)
        assert set(where.values()) <= {"CPU", "BLAS"} and not any(s.inputs for s in plan.splits)


def test_no_op_offload_keeps_ngl0_off_the_gpu(tiny32, test_gpu) -> None:  # noqa: ANN001
    """Ops no expansion places (ROPE: BLAS cannot run it) go where their inputs are readable —
    the host — not to the first device that supports them."""
    with open_llm(tiny32, 0, n_ctx=1024, op_offload=False) as llm:
        plan, where = _plan(llm, 512)
        assert "TEST0" not in where.values()
        assert plan.compute_sizes["TEST0"] == 0
        assert all(not s.inputs for s in plan.splits)  # CPU <-> BLAS share host memory: no copies


def test_offloaded_prompt_gives_the_same_logits(make_llama, test_gpu) -> None:  # noqa: ANN001
    path = make_llama(n_layer=3, tied=False)
    toks = list(range(1, 41))
    # float32 activations: the TEST device computes the reference's f32 products, so the two
    # runs can agree to float32 noise (8-bit rounding on one side only would not)
    with open_llm(path, 0, op_offload=False, cpu_matmul="f32") as llm:
        ref = llm.logits(toks)
    with open_llm(path, 0, cpu_matmul="f32") as llm:
        _, where = _plan(llm, len(toks))
        assert {where[n] for n in llm.ctx.plan(len(toks)).graph.nodes if n.name.startswith("attn_norm-")} == {"TEST0"}
        got = llm.logits(toks)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


# splits of tiny32's 512-token prompt graph on TEST0 when each layer's graph was Q, K, store K, V,
# store V (the V projection on the GPU between the two host stores): 130 at -ngl 0, 54 at -ngl 20.
# Expanding Q, V and K and then both stores (llama.cpp's build_attn) gives 66 and 28.
SPLITS_BEFORE_QVK_ORDER = {0: 130, 20: 54}


@pytest.mark.parametrize("ngl", [0, 20])
def test_attention_order_halves_the_host_layer_splits(tiny32, test_gpu, ngl: int) -> None:  # noqa: ANN001
    with open_llm(tiny32, ngl, n_ctx=1024) as llm:
        plan, where = _plan(llm, 512)
        n_host = min(llm.model.placement.i_gpu_start, llm.model.params.n_layer)
        nodes = plan.graph.nodes
        at = {n.name: i for i, n in enumerate(nodes)}
        for il in range(llm.model.params.n_layer):
            # Q, V, K, then the two stores, side by side: nothing runs between them
            q, v, k = at[f"Qcur-{il} (rope)"], at[f"Vcur-{il}"], at[f"Kcur-{il} (rope)"]
            ks, vs = at[f"k_cache_store-{il}"], at[f"v_cache_store-{il}"]
            assert q < v < k < ks < vs, (il, q, v, k, ks, vs)
            assert where[nodes[ks]] == where[nodes[vs]]
            assert all(nodes[i].is_view for i in range(ks + 1, vs)), [nodes[i].name for i in range(ks + 1, vs)]
        # the lookup, one host run per CPU layer (its two stores) and the way back, the output
        assert len(plan.splits) <= 1 + 2 * n_host + 1, len(plan.splits)
        assert len(plan.splits) < SPLITS_BEFORE_QVK_ORDER[ngl]
