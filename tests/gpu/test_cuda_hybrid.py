"""The hybrid step on CUDA0 (sched/scheduler.py's boundary copies, CUDADevice.download_batch, a GPU
plan's exports read in place): at -ngl 0, 2, all-1 and all of a 4-layer llama, decode and prompt
steps wait once per device->host boundary (CUDADevice.stats), a decode step reads the logits
straight from the plan's arena (no device copy first), and the logits are the CPU's float32 path's.
Skipped without CuPy or a GPU; tests/backend/test_hybrid_copies.py checks the same counts on the
TEST device and CUDADevice's copy code on a CuPy stand-in.
"""

from __future__ import annotations

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

from gpu_fake import boundaries  # noqa: E402
from llamapy.backend import cuda_exec  # noqa: E402
from llamapy.context import Context, ContextOptions, Model, ModelOptions  # noqa: E402

N_LAYER = 4
STEPS = [([1, 40, 90, 7, 3, 55], 0), ([10], 6), ([11], 7), ([(7 * i) % 250 + 1 for i in range(40)], 8), ([12], 48)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from conftest import write_llama_gguf

    return write_llama_gguf(tmp_path_factory.mktemp("hybrid") / "tiny.gguf", n_layer=N_LAYER, qtype=T.Q8_0)


@pytest.fixture(scope="module")
def cpu_logits(tiny: Any) -> list[np.ndarray]:
    m = Model(tiny)
    ctx = Context(m, ContextOptions(n_ctx=256, n_threads=2, cpu_matmul="f32"))
    out = [ctx.decode(t, list(range(p, p + len(t))), 0, None) for t, p in STEPS]
    m.free()
    return out


@pytest.mark.parametrize("ngl", [0, 2, N_LAYER, "all"], ids=["ngl0", "ngl2", "ngl-all-1", "ngl-all"])
def test_cuda_hybrid_steps(tiny: Any, cpu_logits: list[np.ndarray], monkeypatch: pytest.MonkeyPatch, ngl: Any) -> None:
    copied: list[int] = []
    real = cuda_exec.CUDARuntime.copy_out

    def spy(self: Any, addr: int, slot: Any, owner: Any) -> Any:
        copied.append(addr)
        return real(self, addr, slot, owner)

    monkeypatch.setattr(cuda_exec.CUDARuntime, "copy_out", spy)
    model = Model(tiny, ModelOptions(n_gpu_layers=ngl))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=2, cpu_matmul="f32"))
    (dev,) = [b.device for b in ctx.sched.backends if b.name == "CUDA0"]
    for (tokens, pos0), want in zip(STEPS, cpu_logits):
        before, n_copied = dict(vars(dev.stats)), len(copied)
        got = ctx.decode(tokens, list(range(pos0, pos0 + len(tokens))), 0, None)
        d = {k: v - before[k] for k, v in vars(dev.stats).items()}
        d2h, _h2d = boundaries(ctx, len(tokens))
        where = f"-ngl {ngl}, {len(tokens)} tokens: {d}"
        assert d["n_sync"] == d2h, where
        if len(tokens) == 1 and ngl != 0:
            assert d2h == 1 and d["n_out"] == 1 and d["n_in"] == 1, where  # the plan's one input copy
            assert len(copied) == n_copied, where  # the logits read where the plan left them
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err < 1e-3, f"{where}: {err}"
    model.free()
    if dev.allocated == 0:  # (the device's last buffer freed: its pinned memory too)
        assert dev._staging == []


@pytest.mark.parametrize("ngl", [2, "all"])
def test_cuda_embeddings(tiny: Any, ngl: Any) -> None:
    """An embeddings graph (its result the output norm's rows, the output matrix left out) on
    CUDA0 gives the CPU's float32 rows, and its mean pooling the CPU's."""
    from llamapy.embedding import embed

    prompts = [[1, 40, 90, 7, 3, 55], [(7 * i) % 250 + 1 for i in range(40)]]
    out = []
    for n in (0, ngl):
        model = Model(tiny, ModelOptions(n_gpu_layers=n))
        ctx = Context(model, ContextOptions(n_ctx=256, n_threads=2, cpu_matmul="f32"))
        out.append([embed(ctx, prompts, pooling, 2) for pooling in ("none", "mean")])
        model.free()
    for want, got in zip(out[0], out[1]):
        for w, g in zip(want, got):
            assert np.abs(g - w).max() < 1e-3 * np.abs(w).max()


def test_cuda_rerank(tmp_path: Any) -> None:
    """A reranker's head (MUL_MAT by cls.output, SOFT_MAX) on CUDA0 gives the CPU's scores."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_reranker_gguf

    from llamapy.api import Llama

    path = write_reranker_gguf(tmp_path / "rerank.gguf", template=True)
    out = []
    for ngl in (0, "all"):
        with Llama(path, n_ctx=128, n_gpu_layers=ngl, cpu_matmul="f32") as llm:
            assert (ngl == 0) != any(b.name == "CUDA0" for b in llm.model.weights.buffers)
            out.append(llm.rerank("the cat", ["the dog", "a b", "it"]))
    # (probabilities: 9e-5 apart on the emulator, as the logits above may be 1e-3 of the
    # largest apart: the CUDA plan's float32 path sums in other orders than the CPU's)
    np.testing.assert_allclose(out[1], out[0], atol=5e-4)


@pytest.mark.parametrize("ngl", [2, "all"])
def test_cuda_lora_and_control_vector(tmp_path: Any, ngl: Any) -> None:
    """A LoRA adapter's products (F16 pairs: MUL_MAT, SCALE, ADD after each adapted matrix's) and
    a control vector's ADDs after the layers, their tensors on CUDA0 beside the layers': the
    CPU's float32 logits."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_control_vector, write_family_gguf, write_lora_gguf

    from llamapy.api import Llama

    path = write_family_gguf(tmp_path / "m.gguf", "qwen3", tied=False, n_layer=3)
    ad = write_lora_gguf(path, tmp_path / "a.gguf", (r"blk\.\d+\.(attn_q|attn_v|ffn_down)\.weight", "output.weight",
                                                    "token_embd.weight"), dtype=T.F16)  # fmt: skip
    cv = write_control_vector(tmp_path / "cv.gguf", 128, (1, 2), gain=0.5)
    out = []
    for n in (0, ngl):
        mo = ModelOptions(n_gpu_layers=n, lora=[(str(ad), 0.75)], control_vectors=[(str(cv), 1.0)])
        with Llama(path, model_options=mo, n_ctx=128, cpu_matmul="f32") as llm:
            assert (n == 0) != any(b.name == "CUDA0" for a in llm.model.adapters for b in a.buffers)
            assert (n == 0) != any(b.name == "CUDA0" for b in llm.model.control_vector.buffers)
            out.append([llm.logits(STEPS[0][0]), llm.logits(STEPS[3][0])])
    for want, got in zip(*out):
        assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
