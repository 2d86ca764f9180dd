"""The CPU split executor (backend/executor.py, kernels_c/executor.c) against run_nodes, the
reference path, on the same model and the same batches.

Bit-identical where both paths run the same C kernels: every logit in the quantized-activation
mode (the default); in the float32-activation mode every logit except those of the f32 tail rows
of a matrix whose row count is not a multiple of 64 (the tiny models' 271-row vocabulary: BLAS
in run_nodes, a plain sum in the executor), which agree within float32 noise.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from llamapy import ops
from llamapy.backend import native
from llamapy.backend.executor import RMS_NORM, Arena, ExecPlan, Refusal, compile_split
from llamapy.context import Context, ContextOptions, Model
from llamapy.sched.alloc import plan_offsets
from llamapy.tensor import Tensor, TensorFlag
from llamapy.types import GGMLType

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"no C kernels: {native.error()}")

N_FULL = 256  # the tiny models' output rows held in repacked tiles (271 = 4*64 + 15)


def _model(path: Path, cpu_matmul: str = "q8") -> Model:
    return Model(path, context_options=ContextOptions(cpu_matmul=cpu_matmul))


def _contexts(monkeypatch: pytest.MonkeyPatch, model: Model, **kw: object) -> tuple[Context, Context]:
    """(executor, run_nodes) contexts on one model, in the model's MUL_MAT mode."""
    kw.setdefault("cpu_matmul", model.fit_options.cpu_matmul)
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "1")
    exe = Context(model, ContextOptions(n_ctx=512, **kw))  # type: ignore[arg-type]
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "0")
    ref = Context(model, ContextOptions(n_ctx=512, **kw))  # type: ignore[arg-type]
    return exe, ref


def _same(a: np.ndarray, b: np.ndarray, q8: bool = True) -> None:
    assert a.shape == b.shape
    if q8:
        np.testing.assert_array_equal(a, b)  # bit-identical
        return
    np.testing.assert_array_equal(a[:, :N_FULL], b[:, :N_FULL])
    np.testing.assert_allclose(a[:, N_FULL:], b[:, N_FULL:], rtol=1e-4, atol=1e-4)  # f32 tail rows


def _plans(ctx: Context) -> list[object]:
    return [p for plan in ctx.sched._plans.values() for p in plan.backend_plans.values()]


def _batches() -> list[tuple[list[int], list[int], int | list[int], list[bool] | None]]:
    """A prompt (last logits only: the out_ids selection), decode steps at growing positions,
    a second sequence sharing the cache (its mask hides the first), a 3-token micro-batch with
    every logit, then decode again."""
    out: list[tuple[list[int], list[int], int | list[int], list[bool] | None]] = [
        ([1, 40, 90, 200, 7], list(range(5)), 0, None)]
    out += [([10 + i], [5 + i], 0, None) for i in range(4)]
    out += [([1, 66, 67], [0, 1, 2], 1, [True, True, True])]
    out += [([30 + i], [9 + i], 0, None) for i in range(3)]
    out += [([99], [3], 1, None)]
    return out


@pytest.mark.parametrize(
    "qtype, mode",
    [(T.Q8_0, "q8"), (T.Q4_0, "q8"), (T.Q4_1, "q8"), (T.Q5_0, "q8"), (T.Q5_1, "q8"), (T.F16, "q8"),
     (T.Q2_K, "q8"), (T.Q3_K, "q8"), (T.Q4_K, "q8"), (T.Q5_K, "q8"), (T.Q6_K, "q8"), (T.BF16, "q8"),
     (T.Q8_0, "f32"), (T.Q4_1, "f32"), (T.Q4_K, "f32"), (T.Q6_K, "f32")],
)
def test_executor_matches_run_nodes(make_llama, monkeypatch: pytest.MonkeyPatch, qtype: T, mode: str) -> None:  # noqa: ANN001
    model = _model(make_llama(qtype=qtype, rope_freqs=qtype in (T.Q4_1, T.Q6_K)), mode)
    exe, ref = _contexts(monkeypatch, model, n_threads=2)
    for toks, pos, seq, want in _batches():
        _same(exe.decode(toks, pos, seq, want), ref.decode(toks, pos, seq, want), mode == "q8")
    plans = _plans(exe)
    assert plans and all(isinstance(p, ExecPlan) for p in plans)
    assert sum(p.n_runs for p in plans) == len(_batches())  # type: ignore[attr-defined]
    assert all(isinstance(p, Refusal) for p in _plans(ref))
    # token embeddings in F16/Q8_0/Q4_0, as the file has them, are a native GET_ROWS; the other
    # types' rows are expanded in Python before the call (both against run_nodes' numpy rows)
    native_rows = mode == "f32" or qtype in (T.F16, T.Q8_0, T.Q4_0)
    assert all(bool(p.pre) != native_rows for p in plans)  # type: ignore[attr-defined]
    model.free()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_family_graphs_run_on_the_executor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """gemma3 (GEGLU: the GELU table read in C; the embedding SCALE; sliding-window layers) and
    qwen3 (per-head Q/K norms): prompts and decode steps on the executor, not refused — the
    per-head norms of several tokens' strided Q and K one record each (T groups of rows) — with
    run_nodes' logits bit for bit."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from family_models import write_family_gguf

    model = _model(write_family_gguf(tmp_path / f"{arch}.gguf", arch, qtype=T.Q8_0))
    exe, ref = _contexts(monkeypatch, model, n_threads=2)
    for toks, pos, seq, want in _batches():
        _same(exe.decode(toks, pos, seq, want), ref.decode(toks, pos, seq, want))
    plans = _plans(exe)
    assert plans and all(isinstance(p, ExecPlan) for p in plans), [getattr(p, "reason", p) for p in plans]
    assert sum(p.n_runs for p in plans) == len(_batches())  # type: ignore[attr-defined]
    per_head = [r for p in plans for r in p.recs if r[0] == RMS_NORM and r[13]]  # type: ignore[attr-defined]
    assert per_head and all(r[13] > 1 for r in per_head)  # (RMS_NORM records of several tokens' heads)
    model.free()


def test_f16_cache_and_untied_output(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    model = _model(make_llama(qtype=T.Q4_0, tied=False))
    exe, ref = _contexts(monkeypatch, model, type_k=GGMLType.F16, type_v=GGMLType.F16, n_threads=1)
    for toks, pos, seq, want in _batches():
        _same(exe.decode(toks, pos, seq, want), ref.decode(toks, pos, seq, want))
    assert all(isinstance(p, ExecPlan) for p in _plans(exe))
    # the cache holds what run_nodes stored, bit for bit (f32 -> f16 rounding as numpy's)
    for a, b in zip(exe.kv.k + exe.kv.v, ref.kv.k + ref.kv.v):
        np.testing.assert_array_equal(a.buffer.storage(a), b.buffer.storage(b))


def test_prompt_batches_fall_back_to_run_nodes(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The float32-activation mode leaves batches of MAX_TOKENS and more to run_nodes (its tile +
    sgemm path is faster there); the q8 mode compiles them up to MAX_TOKENS_Q8."""
    model = _model(make_llama(qtype=T.Q8_0), "f32")
    exe, ref = _contexts(monkeypatch, model)
    toks = list(range(3, 23))  # 20 tokens: past the executor's MAX_TOKENS
    _same(exe.decode(toks, range(20)), ref.decode(toks, range(20)), q8=False)
    g = exe.graph(20, 1)
    plan = exe.sched.reserve(g.graph)
    # CPU splits that hold the batch's rows (the BLAS backend, when there is one, has the big
    # products; the last rows after the output selection may still be compiled)
    cpu = [i for i, s in enumerate(plan.splits) if exe.backends[s.backend].name == "CPU"
           and any(len(n.shape) > 1 and n.shape[0] == 20 for n in s.nodes if not n.is_view)]
    assert cpu
    for i in cpu:
        bp = exe.sched.backend_plan(plan, i)
        assert isinstance(bp, Refusal) and "a batch of 20 tokens" in bp.reason, bp
    dump = exe.sched.dump(g.graph)
    assert f"## PLAN #{cpu[0]}: CPU executor refused: a batch of 20 tokens" in dump
    _same(exe.decode([5], [20]), ref.decode([5], [20]), q8=False)
    assert "## PLAN #0: CPU executor: " in exe.sched.dump(exe.graph(1, 1).graph)


def test_q8_batches_of_any_size_compile(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """In the q8 mode (every product on the per-block q8 kernels) a server step of decode tokens
    of several sequences plus a prompt chunk (20 and 50 tokens), and a whole prompt micro-batch
    (300 tokens), run compiled, with run_nodes' logits bit for bit."""
    model = _model(make_llama(qtype=T.Q8_0))
    exe, ref = _contexts(monkeypatch, model)
    for c in (exe, ref):
        c.decode([1, 40, 90], range(3), 0)
        c.decode([1, 66], range(2), 1)
    for n in (20, 50):
        toks = [10, 11] + list(range(3, 3 + n - 2))
        pos = [3, 2] + list(range(n - 2))
        seq = [0, 1] + [2] * (n - 2)
        want = [True, True] + [False] * (n - 3) + [True]
        _same(exe.decode(toks, pos, seq, want), ref.decode(toks, pos, seq, want))
        for c in (exe, ref):
            c.kv.seq_rm(0, 3)
            c.kv.seq_rm(1, 2)
            c.kv.seq_rm(2)
        plan = exe.sched.reserve(exe.graph(n, 3).graph)
        cpu = [i for i, s in enumerate(plan.splits) if exe.backends[s.backend].name == "CPU"]
        assert cpu and all(isinstance(exe.sched.backend_plan(plan, i), ExecPlan) for i in cpu)
    n = 300
    toks = [1] + [(7 * i) % 250 + 3 for i in range(n - 1)]
    want = [i % 97 == 0 or i == n - 1 for i in range(n)]
    _same(exe.decode(toks, range(n), 3, want), ref.decode(toks, range(n), 3, want))
    bp = exe.sched.backend_plan(exe.sched.reserve(exe.graph(n, sum(want)).graph), 0)
    assert isinstance(bp, ExecPlan) and bp.n_runs == 1, bp


def test_plans_share_the_backends_arena(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Every compiled plan of a backend runs in its one arena, as large as the largest plan's:
    a decode plan made before a prompt's plan grew it moves its addresses on its next run and
    still gives run_nodes' logits bit for bit; the pages stay (the same memory every run)."""
    model = _model(make_llama(qtype=T.Q4_0))
    exe, ref = _contexts(monkeypatch, model, n_threads=2)
    steps = [([1, 5], [0, 1]), ([9], [2]), (list(range(3, 203)), list(range(3, 203))), ([11], [203]), ([12], [204])]
    arenas: list[tuple[int, int]] = []
    for toks, pos in steps:
        _same(exe.decode(toks, pos), ref.decode(toks, pos))
        plans = [p for p in _plans(exe) if isinstance(p, ExecPlan)]
        assert plans and len({id(p.arena) for p in plans}) == 1
        arena = plans[0].arena
        assert arena.size == max(p.nbytes for p in plans)
        arenas.append((arena.base, arena.size))
    assert arenas[2][1] > arenas[1][1]  # the prompt's plan needed more: the arena grew...
    assert arenas[3] == arenas[4] == arenas[2]  # ...and stayed: decode runs there after it
    decode = [p for p in _plans(exe) if isinstance(p, ExecPlan) and p.n_runs >= 2]
    assert decode and all(p.base == arenas[2][0] for p in decode)  # moved, and run again
    ref_arena = weakref.ref(decode[0].arena)
    del plans, decode, arena
    exe.free()  # the plans go, and their arena with them
    assert ref_arena() is None
    model.free()


def test_batches_of_9_to_15_tokens_compile(monkeypatch: pytest.MonkeyPatch, make_llama) -> None:  # noqa: ANN001
    """Batches of 9-15 tokens: attention runs in C for any number of queries in both paths, so
    the executor compiles the split (before, it left them to numpy's attention in run_nodes)
    and gives run_nodes' logits bit for bit."""
    model = _model(make_llama(qtype=T.Q8_0))
    exe, ref = _contexts(monkeypatch, model)
    toks = list(range(3, 15))
    _same(exe.decode(toks, range(12)), ref.decode(toks, range(12)))
    bp = exe.sched.backend_plan(exe.sched.reserve(exe.graph(12, 1).graph), 0)
    assert isinstance(bp, ExecPlan) and bp.n_runs == 1, bp


def test_products_without_a_compiled_path_fall_back(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """K-quant weights in the q8 mode run on the sgemm path while the library has no q8_K
    kernels: such a split is refused, runs node by node, and gives run_nodes' logits."""
    model = _model(make_llama(qtype=T.Q4_K))
    exe, ref = _contexts(monkeypatch, model)
    np.testing.assert_array_equal(exe.decode([1, 2, 3], [0, 1, 2]), ref.decode([1, 2, 3], [0, 1, 2]))
    np.testing.assert_array_equal(exe.decode([4], [3]), ref.decode([4], [3]))
    plan = exe.sched.reserve(exe.graph(1, 1).graph)
    bp = exe.sched.backend_plan(plan, 0)
    path = _plans(exe) and plan.splits[0].nodes
    if isinstance(bp, ExecPlan):  # the library has q8_K kernels: then the executor ran it
        assert bp.n_runs == 1
    else:
        assert "sgemm path" in bp.reason and path


def test_unknown_op_is_refused() -> None:
    # (every op has a record now; a masked SOFT_MAX, which llamapy's graphs never make, has not)
    x = Tensor("x", (2, 8), flags=TensorFlag.INPUT)
    m = Tensor("m", (2, 8), flags=TensorFlag.INPUT)
    y = ops.soft_max(ops.scale(x, 2.0), m, name="probs")
    plan = compile_split([y.src[0], y], [y], plan_offsets)
    assert isinstance(plan, Refusal) and "SOFT_MAX" in plan.reason


def test_small_graph_elementwise_and_views() -> None:
    """A hand-built graph with inputs, a strided column view, a broadcast MUL, SCALE and CONT:
    the executor's results equal the numpy reference's bit for bit."""
    from llamapy.backend.cpu_kernels import cpu_kernels
    from llamapy.backend.kernels import run_nodes

    rng = np.random.default_rng(1)
    a = Tensor("a", (3, 16), flags=TensorFlag.INPUT)
    b = Tensor("b", (16,), flags=TensorFlag.INPUT)
    s = ops.add(ops.mul(a, b, "ab"), a, "sum")
    c = ops.cols(s, 4, 12, "mid")  # (3, 8), row stride 16
    out = ops.cont(ops.scale(c, 0.5, "half"), "out")
    n = ops.rms_norm(out, 1e-6, "n")
    nodes = [s.src[0], s, c, out.src[0], out, n]
    vals = {a: rng.standard_normal((3, 16)).astype(np.float32), b: rng.standard_normal(16).astype(np.float32)}
    plan = compile_split(nodes, [n, out], plan_offsets)
    assert isinstance(plan, ExecPlan), plan
    env = dict(vals)
    plan.compute(env, 1)
    ref = dict(vals)
    run_nodes(nodes, ref, np, table=cpu_kernels())
    np.testing.assert_array_equal(env[n], ref[n])
    np.testing.assert_array_equal(env[out], ref[out])
    vals2 = {a: vals[a] * 2, b: vals[b]}  # new inputs, same plan
    env, ref = dict(vals2), dict(vals2)
    plan.compute(env, 1)
    run_nodes(nodes, ref, np, table=cpu_kernels())
    np.testing.assert_array_equal(env[n], ref[n])


@pytest.mark.parametrize(
    "type_k, type_v, rot",
    [(GGMLType.Q8_0, GGMLType.Q8_0, True), (GGMLType.Q4_0, GGMLType.Q4_0, True), (GGMLType.Q8_0, GGMLType.Q4_0, False),
     (GGMLType.F16, GGMLType.Q4_0, True), (GGMLType.Q8_0, GGMLType.F32, False)],
)
def test_quantized_cache(make_llama, monkeypatch: pytest.MonkeyPatch, type_k: GGMLType, type_v: GGMLType,
                         rot: bool) -> None:  # noqa: ANN001
    """A Q8_0/Q4_0 cache (-ctk/-ctv), rotated (llama.cpp's attn_rot, heads of 64) or not: the
    executor runs the decode splits (rows quantized and rotated in C, attention over the blocks)
    and gives run_nodes' logits bit for bit, on 2 threads and on 1; the caches hold the same
    bytes."""
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "0" if rot else "1")
    model = _model(make_llama(qtype=T.Q4_0, n_embd=512, n_head=8, n_head_kv=4))
    kw = {"type_k": type_k, "type_v": type_v}
    exe, ref = _contexts(monkeypatch, model, n_threads=2, **kw)
    one, _ = _contexts(monkeypatch, model, n_threads=1, **kw)
    assert bool(exe.kv.k[0].params.get("rot") or exe.kv.v[0].params.get("rot")) == rot
    for toks, pos, seq, want in _batches():
        got = exe.decode(toks, pos, seq, want)
        _same(got, ref.decode(toks, pos, seq, want))
        _same(got, one.decode(toks, pos, seq, want))
    plans = _plans(exe)
    assert sum(p.n_runs for p in plans if isinstance(p, ExecPlan)) == len(_batches())  # type: ignore[attr-defined]
    for a, b in zip(exe.kv.k + exe.kv.v, ref.kv.k + ref.kv.v):
        np.testing.assert_array_equal(a.buffer.storage(a), b.buffer.storage(b))
    model.free()


@pytest.mark.parametrize("cache", [GGMLType.F16, GGMLType.Q8_0])
def test_one_decode_plan_at_every_length_of_history(make_llama, monkeypatch: pytest.MonkeyPatch,
                                                    cache: GGMLType) -> None:  # noqa: ANN001
    """The number of cells attended (256, then 512 past the 256th cell) is an input of the plan,
    its mask's width, not part of the graph's shape: the decode steps on either side of the
    boundary run one graph and one compiled plan, whose attention records read the new width,
    and give run_nodes' logits bit for bit."""
    model = _model(make_llama(qtype=T.Q4_0))
    exe, ref = _contexts(monkeypatch, model, n_threads=2, type_k=cache, type_v=cache)
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(251)]
    _same(exe.decode(prompt, range(252), 0), ref.decode(prompt, range(252), 0))
    for p in range(252, 262):
        _same(exe.decode([p % 250 + 3], [p], 0), ref.decode([p % 250 + 3], [p], 0))
    assert [k for k in exe._graphs if k[0] == 1] == [(1, 1, "logits", ())]  # (no LoRA scales)
    (plan,) = [bp for bp in exe.sched.reserve(exe.graph(1, 1).graph).backend_plans.values() if bp]
    assert isinstance(plan, ExecPlan) and plan.n_runs == 10
    assert len(plan.masks) == 1 and set(plan.recs[plan.masks[0][2], 9]) == {512}
    model.free()


@pytest.mark.parametrize("cache", [GGMLType.F32, GGMLType.F16])
def test_threaded_batch_attention(make_llama, monkeypatch: pytest.MonkeyPatch, cache: GGMLType) -> None:  # noqa: ANN001
    """Batches of 12 tokens (more than the 8 the executor took before its attention ran any
    number of queries), attention threaded over (KV head, query block) on 2 threads: the
    executor runs them and gives run_nodes' logits bit for bit, and -t 1 gives the same."""
    model = _model(make_llama(qtype=T.Q8_0, n_embd=512, n_head=8, n_head_kv=4))
    exe, ref = _contexts(monkeypatch, model, n_threads=2, type_k=cache, type_v=cache)
    one, _ = _contexts(monkeypatch, model, n_threads=1, type_k=cache, type_v=cache)
    for c0 in range(0, 48, 12):
        toks, pos = list(range(3 + c0, 15 + c0)), list(range(c0, c0 + 12))
        every = [True] * 12
        got = exe.decode(toks, pos, 0, every)
        _same(got, ref.decode(toks, pos, 0, every))
        _same(got, one.decode(toks, pos, 0, every))
    assert any(isinstance(p, ExecPlan) and p.n_runs == 4 and p.n_threads == 2 for p in _plans(exe))
    model.free()


def test_two_contexts_with_different_threads(make_llama, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """-t 1 and -t 2 in one process, decoding at the same time from two Python threads: each
    call runs on its own context's thread count, and both get run_nodes' logits."""
    model = _model(make_llama(qtype=T.Q4_0, n_embd=512, n_ff=1536, n_head=8))  # threaded products
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "1")
    ctxs = [Context(model, ContextOptions(n_ctx=256, n_threads=n)) for n in (1, 2)]
    monkeypatch.setenv("LLAMAPY_EXECUTOR", "0")
    ref = Context(model, ContextOptions(n_ctx=256, n_threads=2))
    steps = [([1, 2, 3], [0, 1, 2])] + [([10 + i], [3 + i]) for i in range(6)]
    want = [ref.decode(t, p) for t, p in steps]
    got: dict[int, list[np.ndarray]] = {0: [], 1: []}

    def run(i: int) -> None:
        for t, p in steps:
            got[i].append(ctxs[i].decode(t, p))

    th = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    for i in (0, 1):
        for g, w in zip(got[i], want):
            _same(g, w)
    threads = [{p.n_threads for p in _plans(c) if isinstance(p, ExecPlan) and p.n_runs} for c in ctxs]
    assert threads == [{1}, {2}]
    model.free()


def test_default_model_greedy_unchanged(default_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2: 12 greedy steps, logits bit-identical to run_nodes."""
    model = Model(default_model)
    exe, ref = _contexts(monkeypatch, model, n_threads=2)
    toks = model.tokenizer.encode("The capital of France is")
    la, lb = exe.decode(toks, range(len(toks))), ref.decode(toks, range(len(toks)))
    for i in range(12):
        np.testing.assert_array_equal(la, lb)
        t = int(la[-1].argmax())
        la, lb = exe.decode([t], [len(toks) + i]), ref.decode([t], [len(toks) + i])
    assert any(isinstance(p, ExecPlan) and p.n_runs == 12 for p in _plans(exe))
    model.free()


def test_plan_offsets_never_overlap_live_tensors() -> None:
    """alloc.plan_offsets: a tensor's bytes are never shared with a tensor alive at the same
    time, and a step's result never overlaps what that step reads."""
    rng = np.random.default_rng(0)
    ts = [Tensor(f"t{i}", (int(rng.integers(1, 300)),)) for i in range(60)]
    order: list[tuple[int, Tensor | None, list[Tensor]]] = []
    for i, t in enumerate(ts):
        reads = [ts[j] for j in rng.choice(i, size=min(i, 3), replace=False)] if i else []
        order.append((0, t, reads))
        if i % 7 == 0 and i:
            order.append((0, None, [ts[i - 1]]))  # a read-only step (a view)
    a = plan_offsets(order, [ts[-1]])
    born = {t: i for i, (_b, t, _r) in enumerate(order) if t is not None}
    last = dict(born)
    for i, (_b, _t, reads) in enumerate(order):
        for r in reads:
            last[r] = i
    last[ts[-1]] = len(order)
    for x in ts:
        for y in ts:
            if x is y or born[x] > last[y] or born[y] > last[x]:
                continue
            ox, oy = a.offsets[x][1], a.offsets[y][1]
            assert ox + x.nbytes <= oy or oy + y.nbytes <= ox, (x, y)
    assert a.sizes[0] >= max(a.offsets[t][1] + t.nbytes for t in ts)


def test_sched_debug_shows_the_decode_plan(make_llama) -> None:  # noqa: ANN001
    """`LLAMAPY_SCHED_DEBUG=1 llamapy run`: the splits, and per split what runs it."""
    import os
    import subprocess
    import sys

    path = make_llama(qtype=T.Q8_0)
    env = {**os.environ, "LLAMAPY_SCHED_DEBUG": "1"}
    env.pop("LLAMAPY_EXECUTOR", None)
    r = subprocess.run([sys.executable, "-m", "llamapy", "run", str(path), "-p", "the", "-n", "2", "--temp", "0"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    # each distinct graph that runs is dumped once (the reserve graph, the prompt, the decode step)
    assert "sched: graph #2:" in r.stderr and "## PLAN #0: CPU executor: " in r.stderr, r.stderr
    env["LLAMAPY_EXECUTOR"] = "0"
    r = subprocess.run([sys.executable, "-m", "llamapy", "run", str(path), "-p", "the", "-n", "2", "--temp", "0"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "## PLAN #0: CPU executor refused: LLAMAPY_EXECUTOR=0 (run_nodes)" in r.stderr


def test_row_id_out_of_range_is_an_error() -> None:
    """A bad row id stops the run with a LlamapyError (run_nodes raises IndexError there)."""
    from llamapy.types import LlamapyError

    table = Tensor("table", (4, 8), flags=TensorFlag.INPUT)
    ids = Tensor("ids", (2,), GGMLType.I32, flags=TensorFlag.INPUT)
    rows = ops.get_rows(table, ids, "rows")
    plan = compile_split([rows], [rows], plan_offsets)
    assert isinstance(plan, ExecPlan), plan
    vals = {table: np.arange(32, dtype=np.float32).reshape(4, 8), ids: np.array([3, 1], np.int32)}
    env = dict(vals)
    plan.compute(env, 1)
    np.testing.assert_array_equal(env[rows], vals[table][[3, 1]])
    with pytest.raises(LlamapyError, match="row id out of range"):
        plan.compute({table: vals[table], ids: np.array([0, 4], np.int32)}, 1)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_failure_between_shared_records_stops_every_thread(n_threads: int) -> None:
    """A serial record that fails between two shared-out ones (lp_exec_run's one team per split):
    the call returns that record's error on any thread count (no thread is left at a barrier),
    and the plan runs again afterwards with good ids."""
    from llamapy.types import LlamapyError

    n = 256  # (256, 256) adds: big enough that their rows are shared out among the threads
    x = Tensor("x", (n, n), flags=TensorFlag.INPUT)
    y = Tensor("y", (n, n), flags=TensorFlag.INPUT)
    table = Tensor("table", (n, n), flags=TensorFlag.INPUT)
    ids = Tensor("ids", (n,), GGMLType.I32, flags=TensorFlag.INPUT)
    s = ops.add(x, y, "s")
    r = ops.get_rows(table, ids, "r")
    u = ops.add(s, r, "u")
    plan = compile_split([s, r, u], [u], plan_offsets)
    assert isinstance(plan, ExecPlan), plan
    assert [int(c) for c in plan.recs[:, 0]] == [5, 2, 5]  # ADD (shared out), GET_ROWS_F32 (serial), ADD
    rng = np.random.default_rng(0)
    vals = {t: rng.standard_normal((n, n), dtype=np.float32) for t in (x, y, table)}
    good = rng.permutation(n).astype(np.int32)
    bad = good.copy()
    bad[n // 2] = n
    for k in range(3):
        with pytest.raises(LlamapyError, match="row id out of range"):
            plan.compute({**vals, ids: bad}, n_threads)
        env = {**vals, ids: good}
        plan.compute(env, n_threads)
        np.testing.assert_array_equal(env[u], (vals[x] + vals[y]) + vals[table][good])

