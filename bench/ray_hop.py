"""The cost of a remote hop on Ray devices (backend/ray.py), on loopback: decode time per token
and load time, for the same model run locally and with its layers on one or two simulated nodes.

    unshare -n bash -c 'ip link set lo up && python bench/ray_hop.py [MODEL.gguf ...] [-n 64]'

Run it only inside a network namespace with nothing but loopback (Ray then binds 127.0.0.1).
It starts a simulated cluster (tests/ray/cluster.py: a head and two nodes offering
{"llamapy": 1}), then runs `llamapy run` in child processes, CPU backend only (no BLAS) on both
sides so that the numbers compare the same kernels:
- local: -ngl 0 (every layer in this process);
- 1 hop: -dev RAY0 -ngl all (every layer and the output on one node: one remote split a token);
- 2 hops: -ngl all -ts 1,1 (two nodes, their splits chained by object reference).
Per-token overhead = (remote ms/token - local ms/token) / hops. The nodes run on the same
machine as the driver, so a remote split's compute competes with the others for the cores.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "ray"))

CONFIGS = [("local", []), ("1 hop", ["-dev", "RAY0", "-ngl", "all"]), ("2 hops", ["-ngl", "all", "-ts", "1,1"])]


def run(model: str, flags: list[str], address: str, n: int) -> tuple[float, float]:
    env = dict(os.environ, LLAMAPY_BACKENDS="cpu,ray", LLAMAPY_RAY=address)
    if not flags:
        flags = ["-ngl", "0"]
    r = subprocess.run(
        [sys.executable, "-m", "llamapy", "run", model, "-p", "Once upon a time", "-n", str(n), "--temp", "0",
         "--ignore-eos", "-c", "512", *flags],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    load = float(re.search(r"load time = +([0-9.]+) ms", r.stderr).group(1))  # type: ignore[union-attr]
    per_tok = float(re.search(r"eval time = .*\( +([0-9.]+) ms per token", r.stderr).group(1))  # type: ignore[union-attr]
    return load, per_tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("-n", type=int, default=64, help="tokens generated per run")
    a = ap.parse_args()
    if [n for _, n in socket.if_nameindex()] != ["lo"]:
        raise SystemExit("run this inside a loopback-only network namespace (see the docstring)")
    from llamapy.model.fetch import default_model_path

    models = a.models or [str(REPO.parent / "shared/reference/tiny32/tiny32-Q4_K_M.gguf"), str(default_model_path())]
    import cluster

    c = cluster.start(2)
    try:
        print("| model | placement | load ms | decode ms/token | overhead ms/token per hop |")
        print("|---|---|---:|---:|---:|")
        for m in models:
            base = None
            for label, flags in CONFIGS:
                load, tok = run(m, flags, c.address, a.n)
                hops = {"local": 0, "1 hop": 1, "2 hops": 2}[label]
                base = tok if base is None else base
                over = f"{(tok - base) / hops:.2f}" if hops else "-"
                print(f"| {Path(m).name} | {label} | {load:.0f} | {tok:.2f} | {over} |", flush=True)
    finally:
        c.shutdown()


if __name__ == "__main__":
    main()
