"""When the compute buffers are what does not fit: -ngl 0 and -ngl auto fall back to running
without op offload (a smaller GPU reservation), -ngl auto prefers more layers over op offload,
and an explicit -ngl that still does not fit names the -ngl and -ub that would. Planning never
touches the model's own tensors."""

from __future__ import annotations

import pytest
from sched_support import cli, one_line_error, open_llm

from llamapy.backend import registry
from llamapy.types import OutOfMemoryError


@pytest.fixture
def small_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """15 MiB: the 512-token graph's offloaded ops need ~75 MiB on the device."""
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.setenv("LLAMAPY_TEST_GPU_MEM", "15")


@pytest.mark.parametrize("ngl", [0, "auto"])
def test_ngl0_and_auto_fall_back_to_no_op_offload(tiny32, small_gpu, ngl) -> None:  # noqa: ANN001
    with open_llm(tiny32, ngl, n_ctx=1024, n_ubatch=512) as llm:
        assert llm.model.placement.n_gpu_layers == 0
        assert llm.ctx.sched.op_offload is False
        assert llm.ctx.fit_note.startswith("op offload turned off: with it the compute buffers do not fit (TEST0")
        assert llm.ctx.compute_sizes["TEST0"] == 0
        assert llm.logits(list(range(1, 40))).shape == (39, llm.model.params.n_vocab)


def test_fallback_is_logged_by_the_cli(tiny32) -> None:  # noqa: ANN001
    r = cli("run", tiny32, "-p", "hi", "-n", "1", "-ngl", "0", "-c", "512",
            env={"LLAMAPY_TEST_GPU": "1", "LLAMAPY_TEST_GPU_MEM": "15"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "llama_context: op offload turned off" in r.stderr


def test_op_offload_stays_on_when_it_fits(tiny32, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    with open_llm(tiny32, 0, n_ctx=1024) as llm:
        assert llm.ctx.sched.op_offload is True and llm.ctx.fit_note == ""
        assert llm.ctx.compute_sizes["TEST0"] > 0


def test_auto_prefers_layers_to_op_offload(make_llama, monkeypatch) -> None:  # noqa: ANN001
    """A small vocabulary: the offloaded ops' buffers, not the logits, size the GPU's compute
    buffer, so op offload costs a layer; -ngl auto keeps the layer."""
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    path = make_llama(n_layer=8, n_embd=256, n_ff=1024)
    with open_llm(path, 0, n_ctx=512, n_ubatch=512) as llm:
        m = llm.model
        need = {off: [m.device_bytes(n, off)["TEST0"] for n in range(10)] for off in (True, False)}
    # a budget between what the next layer needs without op offload and with it
    n = next(i for i in range(1, 9) if need[False][i + 1] < need[True][i + 1])
    budget = (need[False][n + 1] + need[True][n + 1]) / 2
    assert need[True][n] <= budget
    monkeypatch.setenv("LLAMAPY_TEST_GPU_MEM", f"{budget / 2**20:.6f}")
    monkeypatch.setattr(registry, "_cache", None)  # a TEST0 with that budget
    with open_llm(path, "auto", n_ctx=512, n_ubatch=512) as llm:
        assert llm.model.placement.n_gpu_layers == n + 1
        assert "without op offload, which is turned off" in llm.model.info.ngl_reason
        assert llm.ctx.sched.op_offload is False


def test_explicit_ngl_names_the_flags_that_fit(tiny32, small_gpu) -> None:  # noqa: ANN001
    with pytest.raises(OutOfMemoryError) as e:
        open_llm(tiny32, 5, n_ctx=512, n_ubatch=512)
    msg = str(e.value)
    assert msg.startswith("-ngl 5 does not fit (compute buffers for -ub 512")
    assert "at most 0 layers would fit, or -ub " in msg
    ub = int(msg.rsplit("-ub ", 1)[1].split()[0])
    assert 1 <= ub < 512
    with open_llm(tiny32, 5, n_ctx=512, n_ubatch=ub) as llm:  # what the message says does fit
        assert llm.model.placement.n_gpu_layers == 5
    with pytest.raises(OutOfMemoryError):
        open_llm(tiny32, 5, n_ctx=512, n_ubatch=ub * 2)
    r = cli("run", tiny32, "-p", "hi", "-n", "1", "-ngl", "5", "-c", "512",
            env={"LLAMAPY_TEST_GPU": "1", "LLAMAPY_TEST_GPU_MEM": "15"})  # fmt: skip
    one_line_error(r, "-ngl 5 does not fit", f"-ub {ub}")


def test_planning_leaves_the_model_tensors_alone(tiny32, monkeypatch) -> None:  # noqa: ANN001
    """fit.device_bytes plans on copies: the weights of a loaded model keep their own buffers
    while another placement is being sized (a context may be running on them)."""
    from llamapy.model import fit

    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    with open_llm(tiny32, 0) as llm:
        w = llm.model.weights
        own = [w.tok_embd, w.output, *w.layers[0].values(), *w.layers[31].values()]
        before = [t.buffer for t in own]
        seen: list[tuple[str, list]] = []
        real = fit.compute_sizes

        def spy(params, weights, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            seen.append((weights.layers[0]["attn_output"].buffer.name, [t.buffer for t in own]))
            return real(params, weights, *a, **kw)

        monkeypatch.setattr(fit, "compute_sizes", spy)
        llm.model.device_bytes(33)
    assert len(seen) == 1
    planned_on, during = seen[0]
    assert planned_on == "TEST0"  # the planner's copy of layer 0 was on the GPU ...
    assert all(a is b for a, b in zip(during, before))  # ... the model's own stayed on the host
    assert {b.name for b in before} == {"CPU"}
