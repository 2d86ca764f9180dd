"""The hybrid step's copies (sched/scheduler.py `_copy_inputs`, ggml_backend_sched_compute_splits'
input copies): every `-ngl` between 0 and all on a TEST device, which counts what CUDA counts
(backend/device.py CopyStats: copies each way, host waits).

What is checked, per decode step and prompt step, at -ngl 0, 2, all-1 and all of a 4-layer llama:
  * one host wait per device->host boundary — a host split reading values of the device (all of
    them read back as one batch), and the graph's outputs on the device (the logits) — and none
    for host->device copies (uploads are queued), counted from the plan's own splits;
  * with the device's splits compiled into GPU plans (tests/gpu_fake.py: records run through
    executor.c), a GPU split's host inputs cost ONE copy (the plan's pinned mirror), whatever
    their number;
  * the logits equal the CPU path's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from gpu_fake import boundaries, use_test_device_plans
from llamapy.backend import native
from llamapy.backend.executor import Arena
from llamapy.backend.gpu_plan import GEMM_DIRECT
from llamapy.context import Context, ContextOptions, Model, ModelOptions
from test_gpu_plan import FakeRuntime

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"no C kernels: {native.error()}")

N_LAYER = 4
SHORT = [1, 40, 90, 7, 3, 55]  # a prompt a GPU plan takes (up to 8 tokens)
PROMPT = [(7 * i) % 250 + 1 for i in range(12)]  # past the 8 tokens a GPU plan takes: node by node
BIG = [(11 * i) % 250 + 1 for i in range(40)]  # >= 32: op offload sends the CPU layers' products over
# (tokens, first position): a short prompt, two decode steps, then the longer prompts
STEPS = [(SHORT, 0), ([10], 6), ([11], 7), (PROMPT, 8), (BIG, 20)]


def _step(ctx: Context, dev: Any, tokens: list[int], pos0: int) -> tuple[np.ndarray, dict[str, int]]:
    before = dict(vars(dev.stats)) if dev is not None else {}
    out = ctx.decode(tokens, list(range(pos0, pos0 + len(tokens))), 0, None)
    after = dict(vars(dev.stats)) if dev is not None else {}
    return out, {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from conftest import write_llama_gguf

    return write_llama_gguf(tmp_path_factory.mktemp("hybrid") / "tiny.gguf", n_layer=N_LAYER, qtype=T.Q8_0)


@pytest.fixture(scope="module")
def cpu_logits(tiny: Any) -> list[np.ndarray]:
    m = Model(tiny)
    ctx = Context(m, ContextOptions(n_ctx=256, n_threads=1))
    out = [ctx.decode(t, list(range(p, p + len(t))), 0, None) for t, p in STEPS]
    m.free()
    return out


@pytest.mark.parametrize("plans", [False, True], ids=["run_nodes", "gpu-plans"])
@pytest.mark.parametrize("ngl", [0, 2, N_LAYER, "all"], ids=["ngl0", "ngl2", "ngl-all-1", "ngl-all"])
def test_one_wait_per_boundary(tiny: Any, cpu_logits: list[np.ndarray], monkeypatch: pytest.MonkeyPatch,
                               ngl: Any, plans: bool) -> None:
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "1")
    made = use_test_device_plans(monkeypatch.setattr, FakeRuntime) if plans else []
    model = Model(tiny, ModelOptions(n_gpu_layers=ngl))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    (dev,) = [b.device for b in ctx.sched.backends if b.name == "TEST0"]
    exact = plans
    for (tokens, pos0), want in zip(STEPS, cpu_logits):
        got, d = _step(ctx, dev, tokens, pos0)
        d2h, h2d = boundaries(ctx, len(tokens))
        where = f"-ngl {ngl}, {len(tokens)} tokens: {d}"
        assert d["n_sync"] == d2h, where  # one wait per device->host boundary, none for uploads
        assert d["n_out"] >= d2h, where
        if ngl == 0 and len(tokens) < 32:
            assert d == dict.fromkeys(d, 0), where  # nothing on the device, nothing copied
        elif ngl != 0:
            assert d2h >= 1 and h2d >= 1, where  # the logits come back; the step's inputs go over
        if len(tokens) == 1 and ngl != 0:
            # decode: the last layers on the device, so nothing comes back but the logits
            assert d2h == 1 and d["n_out"] == 1, where
            if plans:  # the GPU split's inputs (residual, positions, cells, mask): ONE copy
                assert d["n_in"] == 1, where
        exact = exact and not d["n_in"] > 1  # (nothing ran node by node on the device so far)
        if exact:
            # the device's splits through executor.c's records (and the cache they wrote): the
            # CPU executor's logits, bit for bit
            np.testing.assert_array_equal(got, want, err_msg=where)
        else:
            # node by node on TEST (run_nodes multiplies float32 activations, the CPU's q8 mode
            # quantizes them; so does a cache written that way): within the q8 rounding (<0.3 %
            # of the largest logit here; a value copied wrong or stale is not)
            assert float(np.abs(got - want).max() / np.abs(want).max()) < 0.01, where
    if plans and ngl != 0:  # decode plans replay a graph; a prompt's (cuBLAS GEMMs) launch directly
        assert made and all(p.direct in ("", GEMM_DIRECT) for p in made) and any(not p.direct for p in made)
    model.free()


def test_cuda_copies_through_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDADevice's own copy paths on tests/gpu_fake.py's CuPy stand-in, whose async copies happen
    only when a wait reaches them: a step's uploads are queued with no wait, a boundary's reads
    are one batch of D2H copies and one wait, and the staging buffers are refilled only after
    their copies left them (else the values below would be wrong)."""
    from gpu_fake import FakeCupy
    from llamapy.backend import cuda

    cp = FakeCupy()
    dev = cuda.CUDADevice(0, cp)
    rng = np.random.default_rng(0)
    small = [rng.standard_normal(n).astype(np.float32) for n in (1, 5, 256, 4096, 3)] + [np.arange(7, dtype=np.int32)]
    vals = [dev.upload(h) for h in small]
    assert dev.stats.n_sync == 0 and [k for k, _ in cp.log] == ["memcpy"] * len(small)  # queued, no wait
    cp.log.clear()
    got = dev.download_batch(vals)
    for g, h in zip(got, small):
        np.testing.assert_array_equal(g, h)
        assert g.dtype == h.dtype
    assert dev.stats.n_sync == 1 and dev.stats.n_out == len(small)
    assert cp.log == [("memcpy", 2)] * len(small) + [("sync", "event")]  # all the copies, then ONE wait
    # a 20 MiB upload: its chunks alternate between the two 8 MiB buffers; the third waits for the
    # first's copy (and only it: the other buffer's copies are done)
    big = rng.standard_normal(5 << 20).astype(np.float32)
    v = dev.upload(big)
    assert dev.stats.n_sync == 2
    np.testing.assert_array_equal(dev.download(v), big)
    assert dev.stats.n_sync == 3
    # what a boundary read gives is the caller's: views of a pinned block of its own (no copy after
    # the wait), which the next read does not touch
    kept = got
    again = dev.download_batch([dev.upload(-h) for h in small])
    for g, k, h in zip(again, kept, small):
        np.testing.assert_array_equal(g, -h)
        np.testing.assert_array_equal(k, h)
        assert isinstance(_root(g), type(cp.cuda.alloc_pinned_memory(1)))
    n_sync = dev.stats.n_sync
    monkeypatch.setattr(cuda, "READBACK_MAX_BYTES", 1 << 20)  # a read past it: pageable arrays, still one wait
    out = dev.download(v)
    np.testing.assert_array_equal(out, big)
    assert dev.stats.n_sync == n_sync + 1 and _root(out) is out
    dev.close()  # the staging memory freed; the next copy makes it again
    assert dev._staging == []
    np.testing.assert_array_equal(dev.download(dev.upload(small[2])), small[2])


def _root(a: np.ndarray) -> object:
    """The object at the end of an array's chain of bases (the buffer a view was made from)."""
    while isinstance(a, (np.ndarray, memoryview)):
        b = a.obj if isinstance(a, memoryview) else a.base
        if b is None:
            return a
        a = b
    return a


class MovingArena(Arena):
    """An arena made again (larger) every time a plan runs: every plan moves, and a plan's export
    still read after the next plan started is only right if it was copied before (settle)."""

    def ensure(self, nbytes: int) -> int:
        return super().ensure(max(nbytes, self.size + 4096))


class MovingRuntime(FakeRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.arena = MovingArena()


@pytest.mark.parametrize("rt", [FakeRuntime, MovingRuntime], ids=["arena", "moving-arena"])
def test_ffn_on_the_host_between_two_gpu_plans(tiny: Any, cpu_logits: list[np.ndarray],
                                               monkeypatch: pytest.MonkeyPatch, rt: Any) -> None:
    """-ngl all with layer 1's FFN weights kept on the host (`-ot blk\\.1\\.ffn_...=CPU`, the
    shape of --n-cpu-moe): the device runs a GPU plan, the host that FFN, the device a second
    plan, which reads the first plan's residual where the first plan left it — so that export
    must survive the second plan's arena (gpu_plan.settle copies it first; with an arena that
    moves each run, reading it afterwards would read the new block). One wait per device->host
    boundary (the FFN's input, the logits), the CPU's logits bit for bit."""
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "1")
    made = use_test_device_plans(monkeypatch.setattr, rt)
    ot = [(r"blk\.1\.ffn_(gate|up|down)", "CPU")]
    model = Model(tiny, ModelOptions(n_gpu_layers="all", override_tensor=ot))
    ctx = Context(model, ContextOptions(n_ctx=256, n_threads=1))
    (dev,) = [b.device for b in ctx.sched.backends if b.name == "TEST0"]
    for (tokens, pos0), want in list(zip(STEPS, cpu_logits))[:3]:
        got, d = _step(ctx, dev, tokens, pos0)
        d2h, _h2d = boundaries(ctx, len(tokens))
        assert d2h == 2 and d["n_sync"] == 2, d
        np.testing.assert_array_equal(got, want)
    assert len({id(p) for p in made}) >= 2 and all(not p.direct for p in made)
    model.free()


def test_cuda_reads_a_plans_exports_in_place() -> None:
    """CUDADevice.download_batch reads a GPU plan's contiguous export straight from its arena
    address (no device copy first: the runtime's copy_out is not called), a strided one through
    its own copy; all in one batch, one wait."""
    from gpu_fake import FakeCupy
    from llamapy.backend import cuda
    from llamapy.backend.executor import _Slot
    from llamapy.backend.gpu_plan import ArenaValue

    cp = FakeCupy()
    dev = cuda.CUDADevice(0, cp)
    arena = cp.ascontiguousarray(np.arange(64, dtype=np.float32))  # "device memory"
    base = int(arena.data.ptr)

    class Runtime:
        copied: list[int] = []

        def copy_out(self, addr: int, slot: _Slot, owner: Any) -> Any:
            self.copied.append(addr)
            v = np.ndarray(slot.shape, slot.dtype, buffer=arena, offset=addr - base, strides=slot.strides)
            return cp.ascontiguousarray(v)

    rt = Runtime()
    f4 = np.dtype(np.float32)
    rows = ArenaValue(rt, base + 16, _Slot(16, (2, 3), (12, 4), f4), arena)  # contiguous rows
    cols = ArenaValue(rt, base + 64, _Slot(64, (2, 2), (32, 4), f4), arena)  # rows 8 floats apart
    got = dev.download_batch([rows, cols])
    np.testing.assert_array_equal(got[0], np.arange(4, 10, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(got[1], np.array([[16, 17], [24, 25]], np.float32))
    assert rt.copied == [base + 64]  # only the strided one was copied on the device
    assert dev.stats.n_sync == 1 and [k for k, _ in cp.log].count("sync") == 1
