"""Mixture-of-experts models (qwen3moe; llama with experts, Mixtral-style) against an independent
float64 forward pass (moe_models.py), in one batch, in micro-batches and token by token; the q8
mode's MUL_MAT_ID bit for bit against per-expert MUL_MATs; the experts kept on the CPU
(`--cpu-moe`, `--n-cpu-moe`, `-ot exps=CPU`) with attention on the TEST device; bad MoE files."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import llamapy
from llamapy.context import ContextOptions, ModelOptions
from llamapy.model.loader import expert_overrides
from family_models import rewrite_gguf
from moe_models import SHAPES, reference_logits, write_moe_gguf

TOKENS = [1, 260, 40, 75, 262, 100, 101, 263, 7, 8, 9, 270, 33, 34, 120, 121, 122, 50, 51, 52, 53]
CASES = {"qwen3moe": SHAPES["tiny-qwen3moe"], "mixtral": SHAPES["tiny-mixtral"]}


def _f32(**kw: object) -> ContextOptions:
    # float32 activations and cache: the float64 reference has no 8-bit rounding
    return ContextOptions(n_ctx=int(kw.pop("n_ctx", 256)), type_k=T.F32, type_v=T.F32, cpu_matmul="f32", **kw)  # type: ignore[arg-type]


def _logits(path: Path, co: ContextOptions, mo: ModelOptions | None = None) -> np.ndarray:
    with llamapy.Llama(path, model_options=mo, context_options=co) as llm:
        return llm.ctx.decode(TOKENS, list(range(len(TOKENS))), 0, np.ones(len(TOKENS), bool))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ubatch", [512, 1, 5])
def test_moe_matches_reference(tmp_path: Path, case: str, ubatch: int) -> None:
    """Router, top-k, renormalised weights, SwiGLU experts and their weighted sum: in one batch,
    token by token through the cache (-ub 1) and in micro-batches."""
    path = write_moe_gguf(tmp_path / f"{case}.gguf", **CASES[case])
    ref = reference_logits(path, TOKENS)
    got = _logits(path, _f32(n_ubatch=ubatch, n_batch=8 if ubatch < 512 else 512))
    err = np.abs(got - ref).max()
    assert err <= 1e-5 * np.abs(ref).max(), f"max |Δlogit| {err} vs max |logit| {np.abs(ref).max()}"


def test_the_router_matters(tmp_path: Path) -> None:
    """Not a dense model in disguise: top-1 of the same weights gives other logits than top-3,
    and the reference agrees with each."""
    a = write_moe_gguf(tmp_path / "a.gguf", **{**CASES["qwen3moe"], "n_expert_used": 1})
    b = write_moe_gguf(tmp_path / "b.gguf", **CASES["qwen3moe"])
    la, lb = _logits(a, _f32()), _logits(b, _f32())
    assert np.abs(la - lb).max() > 0.1 * np.abs(lb).max()
    assert np.abs(la - reference_logits(a, TOKENS)).max() <= 1e-5 * np.abs(la).max()


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0])
def test_q8_mode_close_to_the_reference(tmp_path: Path, qtype: T) -> None:
    """The default mode (activations quantized to q8_0, as llama.cpp's CPU backend): within the
    8-bit rounding of the reference of the same (quantized) weights."""
    path = write_moe_gguf(tmp_path / "q.gguf", **CASES["qwen3moe"], qtype=qtype)
    ref = reference_logits(path, TOKENS)
    got = _logits(path, ContextOptions(n_ctx=256))
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.F16])
def test_mul_mat_id_q8_is_per_expert_mul_mat(qtype: T) -> None:
    """The CPU's q8 MUL_MAT_ID is, bit for bit, each token's row times its expert's matrix as
    a q8 MUL_MAT of that expert alone (one row at a time: the q8 kernels' results do not depend
    on how many rows share a call)."""
    import gguf

    from llamapy import ops
    from llamapy.backend import native
    from llamapy.backend.cpu import CPUDevice, host_value
    from llamapy.backend.qmatmul import kernels
    from llamapy.graph import Graph
    from llamapy.tensor import Tensor, TensorFlag

    if kernels() != "c":
        pytest.skip(f"no C kernels in use: {native.error() or 'LLAMAPY_KERNELS=numpy'}")

    rng = np.random.default_rng(1)
    E, M, K, n = 5, 64, 128, 11
    wv = rng.standard_normal((E * M, K)).astype(np.float32)
    raw = wv.astype(np.float16).view(np.uint8) if qtype is T.F16 else np.asarray(gguf.quants.quantize(wv, qtype))
    wt = Tensor("exps", (E, M, K), qtype, flags=TensorFlag.WEIGHT)
    wq = host_value(wt, raw, copy=False)
    ids = np.stack([rng.permutation(E)[:2] for _ in range(n)]).astype(np.int32)
    x = rng.standard_normal((n, 2, K)).astype(np.float32)
    xt, it = Tensor("x", x.shape, flags=TensorFlag.INPUT), Tensor("ids", ids.shape, T.I32, flags=TensorFlag.INPUT)
    node = ops.mul_mat_id(wt, xt, it)
    be = CPUDevice().init_backend()
    env = {wt: wq, xt: x, it: ids}
    be.compute(Graph.build(node).nodes, env)
    got = env[node]
    for t in range(n):
        for u in range(2):
            one = wq.row_range(ids[t, u] * M, (ids[t, u] + 1) * M)
            want = one.matmul_q8(one.quantize_act(x[t, u][None, :]))[0]
            assert np.array_equal(got[t, u], want), (t, u)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.F16])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_executor_matches_run_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: T, case: str) -> None:
    """In the q8 mode the router (SOFT_MAX, ARGSORT, batched GET_ROWS, SUM_ROWS, CLAMP, DIV),
    the experts (MUL_MAT_ID) and their weighted sum compile into the CPU executor's records, and
    every logit is bit-identical to run_nodes' (the reference path), in a prompt, decode steps,
    a second sequence and a micro-batch of 3 (as tests/backend/test_executor.py for dense models)."""
    from llamapy.backend import native
    from llamapy.backend.executor import ExecPlan, Refusal
    from llamapy.context import Context, Model

    if native.lib() is None:
        pytest.skip(f"no C kernels: {native.error()}")
    model = Model(write_moe_gguf(tmp_path / "moe.gguf", **CASES[case], qtype=qtype))
    ctxs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("LLAMAPY_EXECUTOR", flag)
        ctxs.append(Context(model, ContextOptions(n_ctx=512, n_threads=2)))
    exe, ref = ctxs
    batches = [([1, 40, 90, 200, 7], list(range(5)), 0, None), *[([10 + i], [5 + i], 0, None) for i in range(4)],
               ([1, 66, 67], [0, 1, 2], 1, [True] * 3), ([99], [3], 1, None)]  # fmt: skip
    for toks, pos, seq, want in batches:
        np.testing.assert_array_equal(exe.decode(toks, pos, seq, want), ref.decode(toks, pos, seq, want))
    plans = [p for plan in exe.sched._plans.values() for p in plan.backend_plans.values()]
    compiled = [p for p in plans if isinstance(p, ExecPlan)]
    # qwen3's per-head Q/K norms over a fused QKV of several tokens are beyond the executor (as
    # for dense qwen3): those batches run on run_nodes; nothing MoE is refused
    others = [p.reason for p in plans if not isinstance(p, ExecPlan)]
    assert all("not evenly spaced" in r for r in others) and (case == "qwen3moe" or not others), others
    assert sum(p.n_runs for p in compiled) >= 5  # type: ignore[attr-defined]  # the 5 decode steps at least
    assert all(isinstance(p, Refusal) for plan in ref.sched._plans.values() for p in plan.backend_plans.values())
    model.free()


@pytest.mark.parametrize("case", list(CASES))
def test_q8_token_alone_or_in_a_batch_same_bits(tmp_path: Path, case: str) -> None:
    """In the q8 mode a token's logits are the same bits in a 19-token batch (each expert's
    rows against however many tokens chose it) and alone (-ub 1), wherever the context says it is
    batch-invariant (the engine then mixes decode tokens and prompt chunks in one micro-batch)."""
    from llamapy.context import Context, Model

    model = Model(write_moe_gguf(tmp_path / "m.gguf", **CASES[case], qtype=T.Q4_0))
    toks = [1, 40, 90, 200, 7, *range(8, 22)]
    batch = Context(model, ContextOptions(n_ctx=256))
    alone = Context(model, ContextOptions(n_ctx=256, n_ubatch=1, n_batch=1))
    got = batch.decode(toks, list(range(len(toks))), 0, np.ones(len(toks), bool))
    want = np.concatenate([alone.decode([t], [i], 0, None) for i, t in enumerate(toks)])
    if batch.batch_invariant():  # every MUL_MAT on the q8 kernels (a build with multi-column ones)
        np.testing.assert_array_equal(got, want)
    else:  # the portable build: prompts' dense products on sgemm (qmatmul.use_sgemm)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    model.free()


def _texts(path: Path, configs: list[tuple[int | str, list[tuple[str, str]]]]) -> list[str]:
    out = []
    for ngl, ot in configs:
        mo = ModelOptions(n_gpu_layers=ngl, override_tensor=ot)
        with llamapy.Llama(path, model_options=mo, context_options=_f32(n_ctx=128)) as llm:
            placed = {t.name: t.buffer.name for t in llm.model.weights.layers[0].values()}  # type: ignore[union-attr]
            if ot:
                assert placed["blk.0.ffn_up_exps.weight"] == "CPU" and placed["blk.0.attn_qkv.weight"] == "TEST0"
            out.append("".join(c.text for c in llm.stream("the cat", n_predict=16, temp=0)))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_experts_on_the_cpu_same_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Greedy text equal at -ngl 0, -ngl all, and -ngl all with --n-cpu-moe 2 / --cpu-moe (the
    experts in host memory, attention and the router on the TEST device), float32 mode."""
    monkeypatch.setenv("LLAMAPY_TEST_GPU", "1")
    monkeypatch.delenv("LLAMAPY_TEST_GPU_MEM", raising=False)
    path = write_moe_gguf(tmp_path / f"{case}.gguf", **{**CASES[case], "n_layer": 3})
    texts = _texts(path, [(0, []), ("all", []), ("all", expert_overrides(2)), ("all", expert_overrides(None))])
    assert len(texts[0]) > 0 and texts.count(texts[0]) == 4, texts


def test_expert_overrides_patterns() -> None:
    """llama.cpp's regexes: --n-cpu-moe 2 takes layers 0 and 1 only (not 10, 11, …), every
    kind of expert tensor, nothing else."""
    import re

    pats = [p for p, _ in expert_overrides(2)]

    def hit(name: str) -> bool:
        return any(re.search(p, name) for p in pats)

    assert hit("blk.0.ffn_up_exps.weight") and hit("blk.1.ffn_down_exps.weight") and hit("blk.1.ffn_gate_exps.weight")
    assert not hit("blk.10.ffn_up_exps.weight") and not hit("blk.2.ffn_up_exps.weight")
    assert not hit("blk.0.ffn_gate_inp.weight") and not hit("blk.0.ffn_up.weight")
    with pytest.raises(llamapy.LlamapyError, match="--n-cpu-moe -1"):
        expert_overrides(-1)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != "LLAMAPY_TEST_GPU_MEM"}
    e.update({"LLAMAPY_TEST_GPU": "1", **(env or {})})
    return subprocess.run(["llamapy", *args], capture_output=True, text=True, env=e, timeout=300)


def test_cli_n_cpu_moe_logs_and_keeps_the_text(tmp_path: Path) -> None:
    path = write_moe_gguf(tmp_path / "m.gguf", **{**CASES["qwen3moe"], "n_layer": 3})
    common = ["run", str(path), "-p", "the cat", "-n", "12", "--temp", "0", "--f32-activations", "-ngl", "all"]
    plain = _cli(*common)
    moe = _cli(*common, "--n-cpu-moe", "2")
    assert plain.returncode == 0 and moe.returncode == 0, moe.stderr
    assert moe.stdout == plain.stdout
    assert "print_info: n_expert = 8, n_expert_used = 3, n_ff_exp = 64" in moe.stderr
    assert "load_tensors: 6 tensors (1.50 MiB) overridden to CPU" in moe.stderr  # 2 layers x gate, up, down: 8x64x128 f32
    ot = _cli(*common, "-ot", "exps=CPU")  # llama.cpp's README spelling: every expert tensor
    assert ot.returncode == 0 and ot.stdout == plain.stdout, ot.stderr
    assert "load_tensors: 9 tensors (2.25 MiB) overridden to CPU" in ot.stderr
    info = _cli("info", str(path))
    assert "* Experts: 8, 3 used per token; expert tensors 2.25 of " in info.stdout  # 3 layers x 3 tensors x 0.25 MiB
    bad = _cli(*common, "--n-cpu-moe", "-3")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == "error: --n-cpu-moe -3: must be >= 0"


def test_bench_n_cpu_moe_sweeps_the_expert_placement(tmp_path: Path) -> None:
    """llama-bench's -ncmoe (comma-separated, swept) and -ot: one load per placement, the
    n_cpu_moe column shown when asked for, and the JSON's tensor_buft_overrides naming the expert
    patterns each test ran with (layers 0 and 1 for -ncmoe 2)."""
    import json

    path = write_moe_gguf(tmp_path / "m.gguf", **{**CASES["qwen3moe"], "n_layer": 3})
    base = ["bench", str(path), "-p", "8", "-n", "2", "-r", "1", "-t", "1", "--probe-mib", "0", "-ngl", "all"]
    js = _cli(*base, "-ncmoe", "0,2", "-o", "json")
    assert js.returncode == 0, js.stderr
    rows = json.loads(js.stdout)
    assert [(r["n_cpu_moe"], r["n_prompt"], r["n_gen"]) for r in rows] == [(0, 8, 0), (0, 0, 2), (2, 8, 0), (2, 0, 2)]
    assert {r["tensor_buft_overrides"] for r in rows[:2]} == {"none"}
    ot = rows[2]["tensor_buft_overrides"].split(";")
    assert len(ot) == 2 and all(o.endswith("=CPU") for o in ot)
    pat = ot[1].rsplit("=", 1)[0]
    assert re.search(pat, "blk.1.ffn_up_exps.weight") and not re.search(pat, "blk.2.ffn_up_exps.weight")
    md = _cli(*base, "-ncmoe", "1", "-ot", "exps=CPU")
    assert md.returncode == 0, md.stderr
    head = [c.strip() for c in md.stdout.splitlines()[0].strip("|").split("|")]
    assert head[4:7] == ["ngl", "n_cpu_moe", "threads"]
    bad = _cli(*base, "-ncmoe", "-1")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == "error: -ncmoe -1: must be >= 0"


def test_ngl_auto_moves_experts_before_layers(tmp_path: Path) -> None:
    """-ngl auto on a mixture of experts whose layers do not all fit: every layer on the GPU, the
    experts of the first layers in host memory (the fewest that fit), and the same text."""
    path = write_moe_gguf(tmp_path / "m.gguf", **{**CASES["qwen3moe"], "n_layer": 3})
    common = ["run", str(path), "-p", "the cat", "-n", "8", "--temp", "0", "--f32-activations", "-ub", "16", "-c", "128"]
    auto = _cli(*common, "-ngl", "auto", env={"LLAMAPY_TEST_GPU_MEM": "2.2"})
    assert auto.returncode == 0, auto.stderr
    assert "all of them with the experts of the first 2 on the CPU (as --n-cpu-moe 2)" in auto.stderr
    assert "load_tensors: offloaded 4/4 layers to GPU" in auto.stderr
    assert "load_tensors: 6 tensors (1.50 MiB) overridden to CPU" in auto.stderr
    assert auto.stdout == _cli(*common).stdout  # the default: TEST0 without a budget holds everything


# -- bad files: one line each ------------------------------------------------------------------


def _bad(tmp_path: Path, **keys: object) -> Path:
    import gguf

    VT = gguf.GGUFValueType
    src = write_moe_gguf(tmp_path / "src.gguf", **CASES["qwen3moe"])

    def typed(v: object) -> tuple:  # type: ignore[type-arg]
        if isinstance(v, str):
            return v, VT.STRING, None
        if isinstance(v, list):
            return v, VT.ARRAY, VT.INT32
        return v, VT.INT32 if isinstance(v, int) and v < 0 else VT.UINT32, None

    return rewrite_gguf(src, tmp_path / "bad.gguf", set_keys={f"qwen3moe.{k}": typed(v) for k, v in keys.items()})


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (dict(expert_count=6), r"tensor 'blk.0.ffn_gate_inp.weight' has shape \[128, 8\], expected \[128, 6\]"),
        (dict(expert_used_count=9), r"expert_used_count 9 must be 1..expert_count \(8\)"),
        (dict(expert_used_count=0), r"expert_used_count 0 must be 1..expert_count \(8\)"),
        (dict(expert_count=0), r"qwen3moe needs 'qwen3moe.expert_count' > 0"),
        (dict(expert_feed_forward_length=32), r"tensor 'blk.0.ffn_gate_exps.weight' has shape \[128, 64, 8\], expected \[128, 32, 8\]"),
        (dict(expert_count=10**6), r"expert_count 1000000 out of range \(1..1024\)"),
        (dict(expert_count=-8), r"qwen3moe needs 'qwen3moe.expert_count' > 0 \(got -8\)"),
        (dict(expert_count="eight"), r"key 'qwen3moe.expert_count' has value 'eight', expected int"),
        (dict(expert_used_count=[3, 2]), r"'qwen3moe.expert_used_count' differs between layers"),
        (dict(expert_used_count=[3, 3, 3]), r"'qwen3moe.expert_used_count' has 3 values, expected one per layer \(2\)"),
        (dict(expert_group_count=2), r"expert groups \(expert_group_count > 1\) are not supported"),
    ],
)
def test_bad_moe_file_is_one_error(tmp_path: Path, keys: dict[str, object], message: str) -> None:
    with pytest.raises(llamapy.LlamapyError, match=message) as e:
        llamapy.Llama(_bad(tmp_path, **keys))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("drop", ["blk.1.ffn_gate_inp.weight", "blk.0.ffn_down_exps.weight"])
def test_missing_router_or_experts_is_named(tmp_path: Path, drop: str) -> None:
    src = write_moe_gguf(tmp_path / "src.gguf", **CASES["mixtral"])
    with pytest.raises(llamapy.LlamapyError, match=f"missing tensor '{drop}'"):
        llamapy.Llama(rewrite_gguf(src, tmp_path / "bad.gguf", drop_tensors=(drop,)))


def test_router_of_the_wrong_shape(tmp_path: Path) -> None:
    """A router with more rows than experts (the tensor disagrees with expert_count)."""
    path = write_moe_gguf(tmp_path / "m.gguf", **CASES["qwen3moe"], n_router=9)
    r = _cli("run", str(path), "-p", "a", "-n", "1")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: tensor 'blk.0.ffn_gate_inp.weight' has shape [128, 9], expected [128, 8]"
    )
