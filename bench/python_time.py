"""Python time per decode step: the step's wall time minus the time spent inside native calls.

    python bench/python_time.py                  # the default model, -t 2, 128 steps
    python bench/python_time.py MODEL.gguf -t 1 -n 64
    python bench/python_time.py --gpu-plan       # the GPU plan's Python at -ngl all (no GPU needed)

For each path, in a fresh child process:
- executor (the CPU split compiled into one native call, backend/executor.py): native time is
  what its plan measures around that call (`ExecPlan.native_s`); the plan is compiled by a
  warm-up step, outside the measurement;
- run_nodes (LLAMAPY_EXECUTOR=0, node by node): native time is the sum over the C kernels'
  ctypes calls (each wrapped by a timer);
- executor, native call stubbed: the step with the native call replaced by a no-op, i.e. the
  Python work alone, which is the figure least disturbed by other load on the machine.
Timings on a shared machine are noisy; run it on a quiet one.

`--gpu-plan`: the Python a decode step pays at `-ngl all` through the compiled GPU split
(backend/gpu_plan.py), measured without a GPU: a TEST device (LLAMAPY_TEST_GPU=1) whose splits
are GPU plans over tests/gpu_fake.py's NullRuntime, whose launches, copies and replays do
nothing. A step's whole time is then Python (and the CPU split: the token embedding's GET_ROWS,
on the CPU as in llama.cpp): Context.decode, the KV cache, the scheduler, the mirror's input
writes, the exports, the logits' download (a copy of the row: it stands for the D2H transfer, which
CUDADevice.download_batch lands in pinned memory and hands over with no copy after it). Not in it, what a CUDA step pays on top: CuPy's own
calls, done by NullRuntime as no-ops (the mirror's event query, the H2D cudaMemcpyAsync, the two
CuPy Events a step creates and records — after the input copy and after the logits' D2H —,
cudaGraphLaunch, the D2H cudaMemcpyAsync), a few microseconds each on a GPU host;
CUDADevice.download_batch's own Python (its staging and offsets; the TEST device's is shorter,
but makes the export's view, which CUDA's does not). tests/gpu/run_all.py's figure on a GPU host
(wall minus GPU time, over `ctx.decode` plus `np.argmax`) has these, the argmax (the sampler) and
the logits' D2H transfer (after the step's last GPU event) too. Each step is timed alone, a 64 MiB
buffer written between steps (caches evicted, as a step finds them after the GPU's work and the
sampler), and the median and the mean are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

KERNELS = ("lp_quantize_act", "lp_mul_mat_q", "lp_rms_norm", "lp_rope", "lp_attend", "lp_attend_f16", "lp_swiglu",
           "lp_round_act", "lp_mv_q4_0", "lp_mv_q4_1", "lp_mv_q8_0", "lp_mv_q4_k", "lp_mv_q6_k")


def child(model: str, n_threads: int, n_steps: int, executor: bool, stub: bool) -> dict:
    import numpy as np

    from llamapy.backend import native
    from llamapy.context import Context, ContextOptions, Model

    lib = native.lib()
    spent = [0.0]
    if not executor and lib is not None:
        for name in KERNELS:
            f = getattr(lib, name, None)
            if f is None:
                continue

            def timed(*a, _f=f):  # noqa: ANN002, ANN202
                t0 = time.perf_counter()
                r = _f(*a)
                spent[0] += time.perf_counter() - t0
                return r

            setattr(lib, name, timed)
    m = Model(model)
    ctx = Context(m, ContextOptions(n_ctx=512, n_threads=n_threads))
    toks = m.tokenizer.encode("The capital of France is")
    t = int(ctx.decode(toks, np.arange(len(toks)))[-1].argmax())
    t = int(ctx.decode([t], [len(toks)])[-1].argmax())  # warm-up: compiles the decode plan
    plan = ctx.sched.reserve(ctx.graph(1, 1).graph)
    bp = ctx.sched.backend_plan(plan, 0)
    if executor and not bp:
        raise SystemExit(f"the executor refused the decode split: {getattr(bp, 'reason', bp)}")
    if stub:
        bp.run = lambda *a: 0  # the Python work alone (the logits are garbage)
    n0 = getattr(bp, "native_s", 0.0) if bp else 0.0
    spent[0] = 0.0
    wall = 0.0
    for i in range(n_steps):
        t0 = time.perf_counter()
        lg = ctx.decode([t], [len(toks) + 1 + i])
        wall += time.perf_counter() - t0
        t = int(lg[-1].argmax()) if not stub else t
    nat = spent[0] + ((bp.native_s - n0) if bp else 0.0)
    return {"step_ms": wall / n_steps * 1e3, "native_ms": nat / n_steps * 1e3,
            "python_ms": (wall - nat) / n_steps * 1e3}


def gpu_child(model: str, n_steps: int, evict_mib: int, profile: str, n_ctx: int) -> dict:
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import gpu_fake

    from llamapy.backend.gpu_plan import GPUPlan
    from llamapy.context import Context, ContextOptions, Model, ModelOptions

    made = gpu_fake.use_test_device_plans(setattr, gpu_fake.NullRuntime)
    m = Model(model, ModelOptions(n_gpu_layers="all"))
    toks = m.tokenizer.encode("The capital of France is")
    ctx = Context(m, ContextOptions(n_ctx=max(n_ctx, len(toks) + n_steps + 8)))
    ctx.decode(toks, np.arange(len(toks)))
    n0 = len(toks)
    ctx.decode([5], [n0])  # warm-up: compiles the decode plans
    plan = ctx.sched.reserve(ctx.graph(1, 1).graph)
    gpu = [si for si, s in enumerate(plan.splits) if ctx.backends[s.backend].name.startswith("TEST")]
    bps = [ctx.sched.backend_plan(plan, si) for si in gpu]
    if not gpu or not all(isinstance(bp, GPUPlan) for bp in bps):
        raise SystemExit(f"no GPU plan for the decode split: {[getattr(bp, 'reason', bp) for bp in bps]}")
    junk = np.ones(evict_mib << 18, np.float32)
    times = []
    pr = None
    if profile:
        import cProfile

        pr = cProfile.Profile()
    for i in range(n_steps):
        if evict_mib:
            junk += 1.0  # every cache line written: the step finds none of its data in cache
        if pr is not None:
            pr.enable()
        t0 = time.perf_counter()
        ctx.decode([5], [n0 + 1 + i])
        times.append(time.perf_counter() - t0)
        if pr is not None:
            pr.disable()
    if pr is not None:
        pr.dump_stats(profile)
    t = np.array(times) * 1e3
    summary = ctx.sched.dump(ctx.graph(1, 1).graph).splitlines()
    return {"median_ms": float(np.median(t)), "mean_ms": float(t.mean()), "p10_ms": float(np.percentile(t, 10)),
            "splits": len(plan.splits), "plans": len(made),
            "plan": next((ln for ln in summary if ln.startswith("## PLAN") and "GPU plan" in ln), "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--steps", type=int, default=128)
    ap.add_argument("--gpu-plan", action="store_true", help="the GPU plan's Python at -ngl all (a no-op device)")
    ap.add_argument("--evict-mib", type=int, default=64, help="--gpu-plan: MiB written between steps (0: none)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="--gpu-plan: the context's cells (run's default)")
    ap.add_argument("--profile", default="", help="--gpu-plan: write a cProfile of the steps to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "gpu":
        print(json.dumps(gpu_child(a.model, a.steps, a.evict_mib, a.profile, a.ctx_size)))
        return
    if a.child:
        ex, stub = a.child.split(",")
        print(json.dumps(child(a.model, a.threads, a.steps, ex == "1", stub == "1")))
        return
    if a.model is None:
        from llamapy.model.fetch import default_model_path

        a.model = str(default_model_path())
    if a.gpu_plan:
        env = dict(os.environ, LLAMAPY_TEST_GPU="1", LLAMAPY_EXECUTOR="1")
        r = subprocess.run([sys.executable, __file__, a.model, "-n", str(a.steps), "--evict-mib", str(a.evict_mib),
                            "-c", str(a.ctx_size), "--profile", a.profile, "--child", "gpu"], capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{a.model}: -ngl all, GPU plan on a no-op device, {d['splits']} splits, {a.steps} steps, "
              f"{a.evict_mib} MiB evicted between steps, -c {a.ctx_size}")
        print(d["plan"])
        print(f"python ms a step: median {d['median_ms']:.3f}, mean {d['mean_ms']:.3f}, p10 {d['p10_ms']:.3f}")
        return
    print(f"{'path':<28} {'step ms':>8} {'native ms':>10} {'python ms':>10}")
    for label, ex, stub in (("executor", "1", "0"), ("run_nodes", "0", "0"), ("executor, native stubbed", "1", "1")):
        env = dict(os.environ, LLAMAPY_EXECUTOR=ex)
        r = subprocess.run([sys.executable, __file__, a.model, "-t", str(a.threads), "-n", str(a.steps),
                            "--child", f"{ex},{stub}"], capture_output=True, text=True, env=env, check=True)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{label:<28} {d['step_ms']:8.2f} {d['native_ms']:10.2f} {d['python_ms']:10.3f}")


if __name__ == "__main__":
    main()
