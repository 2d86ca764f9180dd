"""Thread counts per context, not per process (issues 11 and 13: "two contexts with different -t in
one process do not interfere"; ggml's n_threads of `ggml_backend_cpu_set_n_threads`, a property
of each backend object).

Every compiled kernel takes its thread count as an argument: the CPU (and BLAS) backend passes
its own `threads()` to the MUL_MAT kernels (QMatrix), to attention (`lp_attend*`, through
cpu_kernels.c_flash_attn_ext) and to the executor's run (ExecPlan.n_threads). These tests
record what each call was given, so they check the plumbing deterministically, not timings.
"""

from __future__ import annotations

from typing import Any

import pytest

from llamapy.api import Llama
from llamapy.backend import cpu, cpu_kernels, native
from llamapy.backend.executor import ExecPlan
from llamapy.backend.qmatmul import QMatrix

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"no C kernels: {native.error()}")


class _AttendSpy:
    """The kernel library, with the n_threads (last argument) of each lp_attend* call noted."""

    def __init__(self, lib: Any, calls: list[int]) -> None:
        self._lib, self._calls = lib, calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if not name.startswith("lp_attend"):
            return fn

        def call(*args: Any) -> Any:
            self._calls.append(int(args[-1]))
            return fn(*args)

        return call


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    calls: dict[str, list[int]] = {"attend": [], "matmul": []}
    cpu_kernels.cpu_kernels()  # the C table in use: its library loaded
    monkeypatch.setattr(cpu_kernels, "_lib", _AttendSpy(native.lib(), calls["attend"]))
    for name in ("quantize_act", "round_act", "matmul_q8", "matmul_tiles", "matmul"):
        orig = getattr(QMatrix, name)

        def wrap(self: QMatrix, x: Any, n_threads: int = 0, *a: Any, _orig: Any = orig, **kw: Any) -> Any:
            calls["matmul"].append(n_threads)
            return _orig(self, x, n_threads, *a, **kw)

        monkeypatch.setattr(QMatrix, name, wrap)
    return calls


def _executor_threads(llm: Llama) -> set[int]:
    plans = [p for plan in llm.ctx.sched._plans.values() for p in plan.backend_plans.values()]
    return {p.n_threads for p in plans if isinstance(p, ExecPlan) and p.n_runs}


@pytest.mark.parametrize("executor", ["0", "1"])
def test_two_llamas_with_different_threads(make_llama, monkeypatch: pytest.MonkeyPatch, executor: str) -> None:  # noqa: ANN001
    """-t 0 (every core: 4 here, the core count patched so that it differs from 1 on any machine)
    and -t 1 in one process, used in turns: a 70-token prompt then decode steps, node by node
    (LLAMAPY_EXECUTOR=0: run_nodes, C attention over 70 queries) or compiled (the executor, which
    takes batches of any size in the q8 mode). Each call gets its own context's count, whichever
    context was made or ran last, and both decode the same text."""
    monkeypatch.setattr(cpu, "_CORES", 4)
    monkeypatch.setenv("LLAMAPY_EXECUTOR", executor)
    path = make_llama(n_layer=2)
    calls = _spy(monkeypatch)
    every, one = Llama(path, n_ctx=256, n_threads=0), Llama(path, n_ctx=256, n_threads=1)
    prompt = list(range(3, 73))
    texts = []
    try:
        for llm, want in ((every, 4), (one, 1), (every, 4)):
            for v in calls.values():
                v.clear()
            llm.ctx.kv.clear()
            r = llm.generate(prompt, n_predict=6, temp=0)
            texts.append(r.tokens)
            if executor == "0":
                assert calls["attend"] and set(calls["attend"]) == {want}
                assert calls["matmul"] and set(calls["matmul"]) == {want}
                assert not _executor_threads(llm)
            else:
                assert not calls["attend"] and not calls["matmul"]  # every step compiled
                assert _executor_threads(llm) == {want}
    finally:
        every.close()
        one.close()
    assert len(texts[0]) == 6 and texts[0] == texts[1] == texts[2]


def test_no_process_wide_thread_setting() -> None:
    """The process-wide setters are gone: a context's -t cannot leak into another's calls."""
    from llamapy.backend import qmatmul

    assert not hasattr(qmatmul, "set_num_threads")
    assert not hasattr(native.lib(), "lp_attend_set_threads")
