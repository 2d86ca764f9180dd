"""Python time per decode step: the step's wall time minus the time spent inside native calls.

    python bench/python_time.py                  # the default model, -t 2, 128 steps
    python bench/python_time.py MODEL.gguf -t 1 -n 64

For each path, in a fresh child process:
- executor (the CPU split compiled into one native call, backend/executor.py): native time is
  what its plan measures around that call (`ExecPlan.native_s`); the plan is compiled by a
  warm-up step, outside the measurement;
- run_nodes (LLAMAPY_EXECUTOR=0, node by node): native time is the sum over the C kernels'
  ctypes calls (each wrapped by a timer);
- executor, native call stubbed: the step with the native call replaced by a no-op, i.e. the
  Python work alone, which is the figure least disturbed by other load on the machine.
Timings on a shared machine are noisy; run it on a quiet one.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--steps", type=int, default=128)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        ex, stub = a.child.split(",")
        print(json.dumps(child(a.model, a.threads, a.steps, ex == "1", stub == "1")))
        return
    if a.model is None:
        from llamapy.model.fetch import default_model_path

        a.model = str(default_model_path())
    print(f"{'path':<28} {'step ms':>8} {'native ms':>10} {'python ms':>10}")
    for label, ex, stub in (("executor", "1", "0"), ("run_nodes", "0", "0"), ("executor, native stubbed", "1", "1")):
        env = dict(os.environ, LLAMAPY_EXECUTOR=ex)
        r = subprocess.run([sys.executable, __file__, a.model, "-t", str(a.threads), "-n", str(a.steps),
                            "--child", f"{ex},{stub}"], capture_output=True, text=True, env=env, check=True)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{label:<28} {d['step_ms']:8.2f} {d['native_ms']:10.2f} {d['python_ms']:10.3f}")


if __name__ == "__main__":
    main()
