"""The compiled GPU split on CUDA0 (backend/gpu_plan.py, cuda_exec.py): decode steps at -ngl all run
as one captured CUDA graph per graph shape, and give what the reference path gives (run_nodes on
CuPy, LLAMAPY_EXECUTOR=0) and what the CPU gives. Skipped without CuPy or a GPU; the same plan is
checked on the CPU with a fake runtime in tests/backend/test_gpu_plan.py.

A failure names the split and the refusal, or the step and the largest logit difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy", reason="CuPy is not installed")
try:
    _N_GPU = cp.cuda.runtime.getDeviceCount()
except Exception as _e:  # noqa: BLE001
    pytest.skip(f"no usable CUDA device: {_e}", allow_module_level=True)
if _N_GPU <= 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from llamapy.backend.cuda import CUDABackend  # noqa: E402
from llamapy.backend.gpu_plan import GEMM_DIRECT, MUL_MAT_GEMM, GPUPlan  # noqa: E402
from llamapy.context import Context, ContextOptions, Model, ModelOptions  # noqa: E402
from llamapy.types import GGMLType  # noqa: E402

STEPS: list[tuple[list[int], list[int], int, list[bool] | None]] = (
    [([1, 40, 90, 7], [0, 1, 2, 3], 0, None)]
    + [([10 + i], [4 + i], 0, None) for i in range(4)]
    + [([1, 66], [0, 1], 1, [True, True])]
    + [([(7 * i) % 250 + 1 for i in range(300)], list(range(2, 302)), 1, None)]  # a prompt: GEMMs on cuBLAS
    + [([30 + i], [8 + i], 0, None) for i in range(3)]  # past 256 cells: a wider mask, the same graph
)


def _run(ctx: Context) -> list[np.ndarray]:
    return [ctx.decode(t, p, s, w) for t, p, s, w in STEPS]


def gpu_plans(ctx: Context) -> list[tuple[str, Any]]:
    """(split description, its plan or refusal) of every CUDA split of every graph run."""
    out = []
    for plan in ctx.sched._plans.values():
        for si, bp in plan.backend_plans.items():
            be = ctx.backends[plan.splits[si].backend]
            if isinstance(be, CUDABackend):
                n_tok = plan.graph.nodes[0].shape[0] if plan.graph.nodes else 0
                out.append((f"split #{si} of a {n_tok}-row graph", bp))
    return out


def _model(path: Path, ngl: int | str = "all") -> Model:
    return Model(path, ModelOptions(n_gpu_layers=ngl))


# Q4_K: the random file's weights reach 9.45 (conftest's K-quant scales), so the 300-token prompt's
# FFN input passes f16's 65504: the GEMMs' inputs are divided by a power of two that keeps them in
# range (common.cuh's f16_input_scale; unscaled they overflowed to inf and the logits were NaN)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q4_1], ids=lambda q: q.name)
def test_decode_runs_as_one_captured_graph(make_llama, monkeypatch: pytest.MonkeyPatch, qtype: T) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "1")
    monkeypatch.delenv("LLAMAPY_CUDA_GRAPHS", raising=False)
    model = _model(make_llama(qtype=qtype, rope_freqs=True))
    ctx = Context(model, ContextOptions(n_ctx=512))
    got = _run(ctx)
    plans = gpu_plans(ctx)
    assert plans, "no CUDA split ran"
    for what, p in plans:
        assert isinstance(p, GPUPlan), f"{what}: no GPU plan: {getattr(p, 'reason', p)}"
    prompt = [(w, p) for w, p in plans if (p.recs[:, 0] == MUL_MAT_GEMM).any()]
    assert len(prompt) == 1 and prompt[0][1].direct == GEMM_DIRECT, prompt  # the 300-token prompt: GEMMs, direct
    for what, p in plans:
        if any(p is q for _w, q in prompt):
            continue
        assert not p.direct, f"{what}: {p.summary()}"
        # (the prompt's plan, made after the first decode plans, grew the arena: they moved and
        # were captured once more)
        assert 1 <= p.n_captures <= 2, f"{what}: captured {p.n_captures} times"
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "0")  # the reference: run_nodes on CuPy
    ref = _run(Context(model, ContextOptions(n_ctx=512)))
    for i, (a, b) in enumerate(zip(got, ref)):
        scale = float(np.abs(b).max())
        diff = float(np.abs(a - b).max())
        assert diff <= 1e-3 * scale, f"step {i}: logits differ by {diff:.3g} (max |logit| {scale:.3g})"
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {i}: another top token"
    model.free()


def test_graphs_off_give_the_same_bits(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    model = _model(make_llama(qtype=T.Q4_0))
    on = _run(Context(model, ContextOptions(n_ctx=512)))
    monkeypatch.setenv("LLAMAPY_CUDA_GRAPHS", "0")
    ctx = Context(model, ContextOptions(n_ctx=512))
    off = _run(ctx)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)
    assert all(p.direct == "LLAMAPY_CUDA_GRAPHS=0" for _w, p in gpu_plans(ctx) if isinstance(p, GPUPlan))
    model.free()


@pytest.mark.parametrize("ngl, cache", [(2, GGMLType.F16), ("all", GGMLType.F32)])
def test_against_the_cpu(make_llama, monkeypatch: pytest.MonkeyPatch, ngl: int | str, cache: GGMLType) -> None:  # noqa: ANN001
    """-ngl 2 (CPU layers, then a GPU split fed through the pinned mirror) and an f32 cache."""
    path = make_llama(qtype=T.Q8_0)
    cpu_model = Model(path, ModelOptions(n_gpu_layers=0), ContextOptions(cpu_matmul="f32"))
    want = _run(Context(cpu_model, ContextOptions(n_ctx=512, cpu_matmul="f32", type_k=cache, type_v=cache)))
    model = _model(path, ngl)
    ctx = Context(model, ContextOptions(n_ctx=512, type_k=cache, type_v=cache))
    got = _run(ctx)
    assert any(isinstance(p, GPUPlan) for _w, p in gpu_plans(ctx)), gpu_plans(ctx)
    for i, (a, b) in enumerate(zip(got, want)):
        scale = float(np.abs(b).max())
        assert float(np.abs(a - b).max()) <= 2e-3 * scale, f"step {i}"
    model.free()
    cpu_model.free()


def test_python_time_is_measured(make_llama) -> None:  # noqa: ANN001
    """The runtime's timing: the GPU time of a step is positive and below its wall time."""
    import time

    model = _model(make_llama(qtype=T.Q4_K))
    ctx = Context(model, ContextOptions(n_ctx=512))
    ctx.decode([1, 2, 3], [0, 1, 2])
    ctx.decode([4], [3])
    dev = next(b for b in ctx.backends if isinstance(b, CUDABackend)).device
    rt = dev.runtime()
    rt.timing = True
    t0 = time.perf_counter()
    for i in range(20):
        ctx.decode([5 + i], [4 + i])
    wall = time.perf_counter() - t0
    gpu = rt.gpu_seconds()
    rt.timing = False
    assert 0 < gpu < wall
    model.free()


# -- mixture of experts: the router and the expert products in the captured graph ----------------


def _moe_path(tmp_path: Path, case: str) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from moe_models import SHAPES, write_moe_gguf

    return write_moe_gguf(tmp_path / f"{case}.gguf", qtype=T.Q8_0, **SHAPES[case])


@pytest.mark.parametrize("case", ["tiny-qwen3moe", "tiny-mixtral"])
@pytest.mark.parametrize("where", ["ngl-all", "n-cpu-moe"])
def test_moe_decode_as_one_captured_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
                                          where: str) -> None:
    """qwen3moe / Mixtral-style decode at -ngl all (router, MUL_MAT_ID and the gate/up experts with
    their GLU in the GPU plan: one capture) and with --n-cpu-moe 1 (layer 0's experts on the CPU):
    the float32 CPU path's logits within float32 noise, the same top tokens."""
    from llamapy.backend.gpu_plan import MUL_MAT_ID_GLU
    from llamapy.model.loader import expert_overrides

    monkeypatch.setenv("LLAMAPY_EXECUTOR", "1")
    path = _moe_path(tmp_path, case)
    cpu_model = Model(path, ModelOptions(n_gpu_layers=0), ContextOptions(cpu_matmul="f32"))
    want = _run(Context(cpu_model, ContextOptions(n_ctx=512, cpu_matmul="f32")))
    ot = expert_overrides(1) if where == "n-cpu-moe" else []
    model = Model(path, ModelOptions(n_gpu_layers="all", override_tensor=ot), ContextOptions(cpu_matmul="f32"))
    ctx = Context(model, ContextOptions(n_ctx=512, cpu_matmul="f32"))  # (the CPU's experts: float32 too)
    got = _run(ctx)
    # (the prompt: its experts' split refused, "a batch of", or with --n-cpu-moe "weight ... in CPU
    # memory": the host experts' product offloaded with its 300 tokens; a split of its attention
    # alone, with --n-cpu-moe, a GEMM plan launched directly)
    plans = [(w, p) for w, p in gpu_plans(ctx)
             if not (p is not None and not p and ("a batch of" in p.reason or "in CPU memory" in p.reason))
             and not (isinstance(p, GPUPlan) and p.direct.startswith(GEMM_DIRECT))]  # (a MoE prompt: + MOE_SYNC)
    assert plans, "no CUDA split ran"
    for what, p in plans:
        assert isinstance(p, GPUPlan), f"{what}: no GPU plan: {getattr(p, 'reason', p)}"
        # (captured once more if the prompt's plan, made after it, grew the arena)
        assert not p.direct and 1 <= p.n_captures <= 2, f"{what}: {p.summary()}"
    assert any((p.recs[:, 0] == MUL_MAT_ID_GLU).any() for _w, p in plans)
    for i, (a, b) in enumerate(zip(got, want)):
        scale = float(np.abs(b).max())
        assert float(np.abs(a - b).max()) <= 2e-3 * scale, f"step {i}"
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {i}: another top token"
    model.free()
    cpu_model.free()
