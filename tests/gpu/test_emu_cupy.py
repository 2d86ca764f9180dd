"""llamapy's CUDA backend (CUDA0 of backend/cuda.py, cuda_exec.py, cuda_ops.py) unmodified on
tests/gpu/emu_cupy.py's CuPy stand-in over the CUDA emulator: the stand-in's own rules (capture,
allocation, cuBLAS, argument packing), CUDADevice's decisions, and (slow) whole decode steps at
-ngl all and -ngl 2 against -ngl 0. Runs without a GPU or CuPy (needs g++); each case installs the
stand-in as `cupy` for its own duration only, so the rest of the session never sees a CUDA device."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if shutil.which("g++") is None:
    pytest.skip("g++ not found: no CPU emulation of the CUDA kernels", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emu_cupy  # noqa: E402

from llamapy import ops  # noqa: E402
from llamapy.backend import registry  # noqa: E402
from llamapy.tensor import Tensor, TensorFlag  # noqa: E402
from llamapy.types import GGMLType  # noqa: E402


@pytest.fixture(scope="module")
def emu_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build folder for the module's stand-ins (each compiles the kernels it loads there)."""
    return tmp_path_factory.mktemp("emu_cupy")


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch, emu_build: Path, request: pytest.FixtureRequest) -> Iterator[emu_cupy.EmuCupy]:
    """The stand-in as `cupy` (with as many GPUs as an indirect parameter says, else one) and
    llamapy's backends discovered again, both undone afterwards."""
    cp = emu_cupy.EmuCupy(build_dir=emu_build, n_devices=getattr(request, "param", 1))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(registry, "_cache", None)
    yield cp
    registry._cache = None  # (monkeypatch restores the session's discovery next)


def _cuda0() -> Any:
    from llamapy.backend import cuda

    (dev,) = cuda.registry().devices()
    return dev


def _scale_f32(emu: emu_cupy.EmuCupy) -> Any:
    """elementwise.cu's scale_f32 (a, sa, y, sy, n, s), compiled alone (a second, not ten)."""
    from llamapy.backend.cuda import _module_source
    from llamapy.backend.cuda_ops import NVRTC_OPTIONS

    return emu.RawModule(code=_module_source("elementwise.cu"), options=NVRTC_OPTIONS).get_function("scale_f32")


# -- the stand-in's rules ---------------------------------------------------------------------


def test_capture_rules(emu: emu_cupy.EmuCupy) -> None:
    """Inside a capture: no allocation, no cuBLAS (NotImplementedError, as CuPy's setStream), no
    synchronous copy; launches are recorded, not run, and each Graph.launch replays them."""
    from llamapy.backend.cuda_ops import CublasGemm, CudaKernels

    dev = _cuda0()
    k = CudaKernels({"scale_f32": _scale_f32(emu)}, n_sm=4, gemm=CublasGemm(emu))
    x = emu.asarray(np.arange(8, dtype=np.float32))
    y = emu.zeros(8, np.float32)
    st = dev.stream
    with dev.context("capturing"):
        st.begin_capture()
        k.scale(st, x.data.ptr, 8, y.data.ptr, 8, 1, 8, 2.0)
        with pytest.raises(RuntimeError, match="during stream capture"):
            emu.empty(4, np.float32)
        with pytest.raises(NotImplementedError, match="cuBLAS"):
            k.gemm(None, None, (x.data.ptr, x.data.ptr, y.data.ptr, 1, 1, 2, 1, 0), stream=st)
        with pytest.raises(RuntimeError, match="capturing"):
            x.get()
        g = st.end_capture()
    assert not y.get().any()  # recorded, not run
    g.launch(st)
    st.synchronize()
    np.testing.assert_array_equal(y.get(), 2 * np.arange(8, dtype=np.float32))
    del x  # a graph replayed after its memory was freed: the GPU's fault, here an error
    with pytest.raises(RuntimeError, match="freed"):
        g.launch(st)


def test_gemm_reads_alpha_from_device_memory_when_it_runs(emu: emu_cupy.EmuCupy) -> None:
    """CublasGemm with alpha and beta in device memory (the f16 input's scale): pointer mode
    device for the call, the values read when the stream runs the GEMM — here those of an
    asynchronous copy queued before it, not the memory's when the call is made —, and the
    handle back in host mode after it (CuPy's own cuBLAS calls assume it); a device address in
    host mode faults."""
    from llamapy.backend.cuda_ops import CublasGemm

    dev = _cuda0()
    st, blas, handle = dev.stream, emu.cuda.cublas, emu.cuda.device.get_cublas_handle()
    a = emu.asarray(np.array([[1, 2], [3, 4], [5, 6]], np.float16))  # (m 3, k 2)
    b = emu.asarray(np.array([[1, 1], [2, -1]], np.float16))  # (n 2, k 2)
    c = emu.full((2, 3), np.nan, np.float32)
    ab = emu.asarray(np.array([1.0, 0.0], np.float32))
    pinned = emu.cuda.alloc_pinned_memory(8)
    host = np.frombuffer(pinned, np.float32, 2)
    host[:] = [8.0, 0.0]
    rt = emu.cuda.runtime
    gemm = CublasGemm(emu)
    with dev.context("gemm"):
        rt.memcpyAsync(ab.data.ptr, host.ctypes.data, 8, rt.memcpyHostToDevice, st.ptr)  # queued, not yet run
        gemm(None, None, (a.data.ptr, b.data.ptr, c.data.ptr, 3, 2, 2, 3, ab.data.ptr), stream=st)
        st.synchronize()
    want = 8 * (np.array([[1, 1], [2, -1]], np.float64) @ np.array([[1, 2], [3, 4], [5, 6]], np.float64).T)
    np.testing.assert_array_equal(c.get(), want.astype(np.float32))  # beta 0: the NaN of c not read
    assert blas.getPointerMode(handle) == blas.CUBLAS_POINTER_MODE_HOST
    with dev.context("gemm"), pytest.raises(RuntimeError, match="pointer mode host"):
        emu.cuda.cublas.gemmEx(handle, 1, 0, 3, 2, 2, ab.data.ptr, a.data.ptr, 2, 2, b.data.ptr, 2, 2,
                               ab.data.ptr + 4, c.data.ptr, 0, 3, 68, -1)  # fmt: skip


def test_kernel_arguments_checked_as_the_driver_reads_them(emu: emu_cupy.EmuCupy) -> None:
    """An argument narrower than its parameter, or a float for an int, is what a GPU misreads:
    the stand-in refuses it, naming the kernel and the argument."""
    fn = _scale_f32(emu)  # (a, sa, y, sy, n, s)
    x = emu.asarray(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="argument 1"):  # a long long given 4 bytes
        fn((1,), (32,), (x, np.int32(4), x, np.int64(4), np.int32(4), np.float32(1)))
    with pytest.raises(TypeError, match="argument 5"):  # a float given a double
        fn((1,), (32,), (x, np.int64(4), x, np.int64(4), np.int32(4), 1.0))
    with pytest.raises(RuntimeError, match="block"):
        fn((1,), (2048,), (x, np.int64(4), x, np.int64(4), np.int32(4), np.float32(1)))
    fn((1,), (32,), (x, 4, x, 4, 4, np.float32(3)))  # Python ints are int64s: wide enough
    np.testing.assert_array_equal(x.get(), np.full(4, 3, np.float32))
    host = np.ones(4, np.float32)
    with pytest.raises(RuntimeError, match="pageable host memory"):  # a host address as a device pointer
        fn((1,), (32,), (np.uint64(host.ctypes.data), 4, x, 4, 4, np.float32(1)))
    stale = emu.asarray(np.ones(4, np.float32))
    ptr = stale.data.ptr
    del stale  # (its block back in the pool: a plan still holding the address reads freed memory)
    with pytest.raises(RuntimeError, match="freed"):
        fn((1,), (32,), (x, 4, np.uint64(ptr), 4, 4, np.float32(1)))


def test_memory_info_moves_with_allocations(emu: emu_cupy.EmuCupy) -> None:
    dev = _cuda0()
    free0, total = dev.memory_info()
    a = emu.empty(1 << 20, np.uint8)
    free1, _ = dev.memory_info()
    assert free1 == free0 - (1 << 20) and total == emu.pool.capacity
    del a
    dev.release_cached()
    assert dev.memory_info()[0] == free0


def test_events_as_cupy_makes_them(emu: emu_cupy.EmuCupy) -> None:
    """`cupy.cuda.Event()` is unrecorded (done) until `record(stream)`; then done once the stream
    ran that far, which `synchronize` makes it; `stream.record(event)` records the same event
    (tests/gpu/run_all.py times kernels this way)."""
    st = emu.cuda.Stream(non_blocking=True)
    host = emu.cuda.alloc_pinned_memory(16)
    dst = emu.empty(4, np.float32)
    a, b = emu.cuda.Event(), emu.cuda.Event()
    assert a.done and b.done
    a.record(st)
    emu.cuda.runtime.memcpyAsync(dst.data.ptr, host.ptr, 16, emu.cuda.runtime.memcpyHostToDevice, st.ptr)
    assert st.record(b) is b and not b.done
    b.synchronize()
    assert b.done and emu.cuda.get_elapsed_time(a, b) >= 0.0


# -- CUDADevice's choices (a failure here is a bug of llamapy's CUDA backend) ------------------


@pytest.mark.parametrize("wtype", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_K])
def test_quantized_weights_are_multiplied_on_cuda(emu: emu_cupy.EmuCupy, wtype: GGMLType) -> None:
    """A Q8_0 / Q4_0 MUL_MAT weight is not a quantized KV cache: CUDA supports the product (it
    refused it, so every such product of a GPU layer ran on the host, its weight copied back
    each step); a SET_ROWS into a Q8_0 cache (kept on the host) stays refused."""
    dev = _cuda0()
    w = Tensor("blk.0.attn_q.weight", (64, 256), wtype, flags=TensorFlag.WEIGHT)
    x = Tensor("x", (1, 256), GGMLType.F32, flags=TensorFlag.INPUT)
    assert dev.supports_op(ops.mul_mat(w, x))
    cache = Tensor("cache_k_l0", (16, 256), GGMLType.Q8_0)
    ids = Tensor("ids", (1,), GGMLType.I64, flags=TensorFlag.INPUT)
    assert not dev.supports_op(ops.set_rows(cache, ids, x))


# -- whole steps through CUDA0 on the emulator -------------------------------------------------

PROMPT = [1, 40, 90, 7, 3, 55, 12, 200, 9, 31, 77, 5]  # 12 tokens: the prompt path (f16 GEMMs on "cuBLAS")
N_GEN = 6


def _greedy(ctx: Any) -> tuple[list[np.ndarray], list[int]]:
    """The prompt's logits, then N_GEN greedy decode steps: (logits of each call, tokens)."""
    logits = [ctx.decode(PROMPT, list(range(len(PROMPT))), 0, None)]
    toks: list[int] = []
    for i in range(N_GEN):
        toks.append(int(np.argmax(logits[-1][-1])))
        logits.append(ctx.decode([toks[-1]], [len(PROMPT) + i], 0, None))
    return logits, toks


def _greedy_against_cpu(path: Path, ngl: int | str) -> tuple[Any, list[str]]:
    """`_greedy` at -ngl `ngl` (on the emulated CUDA0) against -ngl 0's float32 path: the same
    tokens, every call's logits finite and within 1e-3 of the largest; (the model, the scheduler's
    split dump of each distinct graph: the prompt's, then the decode steps')."""
    from llamapy.context import Context, ContextOptions, Model, ModelOptions
    from llamapy.sched.scheduler import split_printer

    cpu = Model(path, ModelOptions(n_gpu_layers=0), ContextOptions(cpu_matmul="f32"))
    want, want_toks = _greedy(Context(cpu, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32")))
    cpu.free()
    model = Model(path, ModelOptions(n_gpu_layers=ngl))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32"))
    lines: list[str] = []
    ctx.sched.debug_hook = split_printer(ctx.sched, 1, lines.append)
    got, toks = _greedy(ctx)
    assert toks == want_toks
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.isfinite(a).all() and float(np.abs(a - b).max()) <= 1e-3 * float(np.abs(b).max()), f"call {i}"
    return model, "\n".join(lines).split("sched: graph #")[1:]


@pytest.mark.slow
@pytest.mark.parametrize("ngl", ["all", 2])
def test_decode_on_cuda0_emulated(emu: emu_cupy.EmuCupy, tmp_path: Path, ngl: int | str) -> None:
    """A tiny Q8_0 llama (2 layers) through the real CUDA0 device on the emulator: a 12-token
    prompt (its products f16 GEMMs) and 6 greedy decode steps at -ngl all and -ngl 2 give the
    -ngl 0 float32 path's logits within float tolerance and the same tokens; the decode graph's
    CUDA split is one captured CUDA graph (its LLAMAPY_SCHED_DEBUG plan line)."""
    from gguf import GGMLQuantizationType as T

    from conftest import write_llama_gguf

    path = write_llama_gguf(tmp_path / "tiny.gguf", n_layer=2, qtype=T.Q8_0)
    model, graphs = _greedy_against_cpu(path, ngl)
    assert len(graphs) == 2, "\n".join(lines)
    decode_plans = [ln for ln in graphs[1].splitlines() if ln.startswith("## PLAN") and "CUDA0" in ln]
    assert len(decode_plans) == 1 and "CUDA0 GPU plan" in decode_plans[0], graphs[1]
    assert "one CUDA graph" in decode_plans[0], decode_plans[0]
    assert emu.n_launches > 0 and emu.n_gemms > 0  # the kernels ran on the emulator, the prompt's GEMMs too
    model.free()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q4_K+Q6_K"])
def test_decode_on_int8_products_emulated(emu: emu_cupy.EmuCupy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          qtype: str) -> None:
    """The default (q8) mode on CUDA0 with the int8 path's threshold lowered to every matrix: each
    decode product a MUL_MAT(q8_1) on a q8_1 copy (QUANTIZE(q8_1), or the RMS_NORM before it; the
    gate/up one with its GLU) in the one captured graph, and the greedy tokens and logits of -ngl 0's q8 mode (both round x to 8 bits
    a block of 32, each by its own rule: within 3 % of the largest logit); with --f32-activations
    no int8 record at all. "Q4_K+Q6_K": attn_v in Q6_K (Q4_K_M's layout), so Q, K and V are three
    products on one q8_1 copy."""
    from gguf import GGMLQuantizationType as T

    from conftest import write_llama_gguf
    from llamapy.backend import gpu_plan
    from llamapy.context import Context, ContextOptions, Model, ModelOptions
    from llamapy.sched.scheduler import split_printer

    monkeypatch.setattr(gpu_plan, "MMVQ_MIN_WEIGHTS", 0)
    wtype, _, vtype = qtype.partition("+")
    path = write_llama_gguf(tmp_path / "tiny.gguf", n_layer=2, qtype=T[wtype], v_type=T[vtype] if vtype else None)
    cpu = Model(path, ModelOptions(n_gpu_layers=0))
    want, want_toks = _greedy(Context(cpu, ContextOptions(n_ctx=256, n_threads=1)))
    cpu.free()
    for mode in ("q8", "f32"):
        model = Model(path, ModelOptions(n_gpu_layers="all"), ContextOptions(cpu_matmul=mode))
        ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul=mode))
        lines: list[str] = []
        ctx.sched.debug_hook = split_printer(ctx.sched, 1, lines.append)
        got, toks = _greedy(ctx)
        graphs = "\n".join(lines).split("sched: graph #")[1:]
        (plan,) = [ln for ln in graphs[1].splitlines() if ln.startswith("## PLAN") and "CUDA0" in ln]
        assert "one CUDA graph" in plan, plan
        if mode == "q8":
            assert toks == want_toks
            for i, (a, b) in enumerate(zip(got, want)):
                assert np.isfinite(a).all() and float(np.abs(a - b).max()) <= 3e-2 * float(np.abs(b).max()), f"call {i}"
            # per layer: QKV (or Q, K, V on one copy), output, gate/up+GLU, down; and the output matrix.
            # The copies of the two norms' results a layer and the output norm's are the norms' own
            # (gpu_plan._fuse_norm_q8): a QUANTIZE_Q8_1 before the output projection and down alone
            n_prod = 13 if vtype else 9
            assert "QUANTIZE(q8_1):4" in plan and f"MUL_MAT(q8_1):{n_prod}" in plan, plan
        else:
            assert "q8_1" not in plan, plan
        model.free()


@pytest.mark.slow
def test_biased_products_on_int8_emulated(emu: emu_cupy.EmuCupy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen2's biased Q/K/V product on the int8 path (the threshold lowered to every matrix): its
    bias is MUL_MAT(q8_1)'s epilogue, no ADD left, and the greedy tokens and logits are -ngl 0's
    q8 mode's (within 3 % of the largest, as test_decode_on_int8_products_emulated)."""
    from gguf import GGMLQuantizationType as T

    from llamapy.backend import gpu_plan
    from llamapy.context import Context, ContextOptions, Model, ModelOptions
    from llamapy.sched.scheduler import split_printer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_family_gguf

    monkeypatch.setattr(gpu_plan, "MMVQ_MIN_WEIGHTS", 0)
    path = write_family_gguf(tmp_path / "qwen2.gguf", "qwen2", qtype=T.Q8_0)
    cpu = Model(path, ModelOptions(n_gpu_layers=0))
    want, want_toks = _greedy(Context(cpu, ContextOptions(n_ctx=256, n_threads=1)))
    cpu.free()
    model = Model(path, ModelOptions(n_gpu_layers="all"))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    lines: list[str] = []
    ctx.sched.debug_hook = split_printer(ctx.sched, 1, lines.append)
    got, toks = _greedy(ctx)
    graphs = "\n".join(lines).split("sched: graph #")[1:]
    (plan,) = [ln for ln in graphs[1].splitlines() if ln.startswith("## PLAN") and "CUDA0" in ln]
    assert "MUL_MAT(q8_1)" in plan and "ADD" not in plan, plan
    assert toks == want_toks
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.isfinite(a).all() and float(np.abs(a - b).max()) <= 3e-2 * float(np.abs(b).max()), f"call {i}"
    model.free()


@pytest.mark.slow
@pytest.mark.parametrize("emu", [2], indirect=True, ids=["two-gpus"])
def test_two_devices_emulated(emu: emu_cupy.EmuCupy, tmp_path: Path) -> None:
    """-ngl all -ts 1,1 over two emulated GPUs (CUDA0, CUDA1): each runs its layers as one
    captured graph a decode step, the residual crosses by memcpyPeerAsync (every pointer on the
    device that reads it), and the logits are the CPU's; two sequences in one step too."""
    from gguf import GGMLQuantizationType as T

    from conftest import write_llama_gguf
    from llamapy.context import Context, ContextOptions, Model, ModelOptions
    from llamapy.sched.scheduler import split_printer

    path = write_llama_gguf(tmp_path / "tiny4.gguf", n_layer=4, qtype=T.Q8_0)
    steps = [(PROMPT, list(range(len(PROMPT))), 0, None)] + [([10 + i], [12 + i], 0, None) for i in range(2)]
    steps += [([20, 21], [0, 1], 1, [True, True]), ([22, 23], [14, 2], [0, 1], [True, True])]
    cpu = Model(path, ModelOptions(n_gpu_layers=0), ContextOptions(cpu_matmul="f32"))
    ref = Context(cpu, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32"))
    want = [ref.decode(*st) for st in steps]
    model = Model(path, ModelOptions(n_gpu_layers="all", tensor_split=(1.0, 1.0)))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1, cpu_matmul="f32"))
    lines: list[str] = []
    ctx.sched.debug_hook = split_printer(ctx.sched, 1, lines.append)
    for i, (st, b) in enumerate(zip(steps, want)):
        a = ctx.decode(*st)
        assert float(np.abs(a - b).max()) <= 1e-3 * float(np.abs(b).max()), f"step {i}"
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {i}"
    graphs = "\n".join(lines).split("sched: graph #")[1:]
    decode = [ln for ln in graphs[1].splitlines() if ln.startswith("## PLAN") and "CUDA" in ln]
    assert [ln.split(": ")[1].split()[0] for ln in decode] == ["CUDA0", "CUDA1"], graphs[1]
    assert all("one CUDA graph" in ln for ln in decode), decode
    model.free()
    cpu.free()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tiny-mixtral", "tiny-qwen3moe"])
def test_moe_prompt_on_cuda0_emulated(emu: emu_cupy.EmuCupy, tmp_path: Path, case: str) -> None:
    """A mixture of experts' 12-token prompt through the real CUDA0 on the emulator: its expert
    products MUL_MAT_ID_GEMM records (moe_sort, the experts' f16 weights, one batched cuBLAS GEMM
    — Mixtral's even routing — or one GEMM an expert — qwen3moe's —, moe_scatter), then greedy
    decode steps as one CUDA graph: the -ngl 0 float32 path's logits within f16 rounding, the
    same tokens."""
    from gguf import GGMLQuantizationType as T

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from moe_models import SHAPES, write_moe_gguf

    path = write_moe_gguf(tmp_path / f"{case}.gguf", qtype=T.Q8_0, **SHAPES[case])
    model, graphs = _greedy_against_cpu(path, "all")
    prompt = [ln for ln in graphs[0].splitlines() if ln.startswith("## PLAN") and "CUDA0" in ln]
    assert len(prompt) == 1 and "CUDA0 GPU plan" in prompt[0] and "direct launches" in prompt[0], graphs[0]
    assert "MUL_MAT_ID(GEMM):2" in prompt[0] and "one host read of the expert counts a MoE layer" in prompt[0]
    decode = [ln for ln in graphs[1].splitlines() if ln.startswith("## PLAN") and "CUDA0" in ln]
    assert len(decode) == 1 and "one CUDA graph" in decode[0], graphs[1]
    assert emu.n_gemms > 0
    model.free()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "gpt-oss"])
def test_biased_qkv_on_cuda0_emulated(emu: emu_cupy.EmuCupy, tmp_path: Path, arch: str) -> None:
    """Layers with Q/K/V biases (qwen2; gpt-oss with its sinks, YaRN and biased MXFP4 experts)
    through the real CUDA0 on the emulator at -ngl all: the loader's one Q/K/V product with its
    bias as the kernels' epilogue (mmv's, the prompt GEMM's add after it) and one rope_qkv a
    layer; the 12-token prompt and greedy decode steps give the -ngl 0 float32 path's logits
    within 1e-3 of the largest and the same tokens, the decode plan one CUDA graph."""
    from gguf import GGMLQuantizationType as T

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    if arch == "qwen2":
        from family_models import write_family_gguf

        path = write_family_gguf(tmp_path / "qwen2.gguf", "qwen2", qtype=T.Q8_0)
    else:
        from moe_models import write_gptoss_gguf

        path = write_gptoss_gguf(tmp_path / "gptoss.gguf", qtype=T.Q8_0, exp_qtype=T.MXFP4)
    model, graphs = _greedy_against_cpu(path, "all")
    decode = [ln for ln in graphs[1].splitlines() if ln.startswith("## PLAN") and "CUDA0" in ln]
    assert len(decode) == 1 and "one CUDA graph" in decode[0], graphs[1]
    n_layer = model.params.n_layer
    assert f"ROPE+SET_ROWS:{n_layer}" in decode[0] and " ROPE:" not in decode[0], decode[0]
    if arch == "qwen2":
        assert "ADD" not in decode[0], decode[0]  # (no bias ADD; the residual ones are the norms')
    assert emu.n_launches > 0 and emu.n_gemms > 0
    model.free()
