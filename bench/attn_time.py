"""Attention alone, in process: one decode token over a model's worth of KV caches.

    python bench/attn_time.py                    # SmolLM2's shape: 30 layers, 9 heads / 3 KV heads of 64
    python bench/attn_time.py -d 4096 -t 1 2 --types f16 q4_0
    python bench/attn_time.py --layers 16 --heads 32 --kv-heads 8
    python bench/attn_time.py --lib /work/main/llamapy/backend/_kernels/lp_avx512.so --lib THIS   # A/B
    python bench/attn_time.py -d 512 --tokens 512 --seqs 4 --types f16   # a 4 x 128 prompt ubatch

Calls ops.c's lp_attend_q (what the CPU executor's FLASH_ATTN_EXT records call) once per layer,
each layer with its own K/V cache of `-d` cells (random values; Q8_0/Q4_0 caches quantized with
quants.quantize), so that the caches together exceed the CPU's caches as in a real decode step.
Prints the best time per token (all layers) over the repetitions, per cache type and thread
count, with the bytes of cache read and the rate. `--lib PATH` (repeatable; THIS: the installed
library) times each library in turn within every repetition (interleaved A/B in one process).
`--tokens T --seqs S`: T query tokens in S sequences of T/S cells each (the last T of the `-d`
cells), each token seeing its own sequence's cells up to itself, as a prompt ubatch. `--cpu` times with process CPU time instead of
wall time (less disturbed by other load on one thread; on more it counts the threads' spinning).
Timings on a shared machine are noisy; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

CODES = {"f16": 1, "q8_0": 2, "q4_0": 3}


def make_cache(kt: str, n_cells: int, n_kv: int, d: int, rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
    """(cells, KV heads, storage) array of one layer's cache and its cell / head strides in the
    type's storage units (halves, or bytes for Q8_0/Q4_0), as the executor passes them."""
    from llamapy.quants import quantize
    from llamapy.types import GGMLType

    x = rng.standard_normal((n_cells * n_kv, d)).astype(np.float32)
    if kt == "f16":
        return x.astype(np.float16).reshape(n_cells, n_kv, d), n_kv * d, d
    raw = np.ascontiguousarray(quantize(x, GGMLType.Q8_0 if kt == "q8_0" else GGMLType.Q4_0))
    a = raw.reshape(n_cells, n_kv, -1)
    return a, a.strides[0], a.strides[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-d", "--depth", type=int, default=2048, help="cells attended (all visible)")
    ap.add_argument("-t", "--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--types", nargs="+", default=list(CODES), choices=list(CODES))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("-r", "--reps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="process CPU time instead of wall time")
    ap.add_argument("--lib", action="append", default=[], help="a kernel library (.so) to time; THIS: the installed one")
    ap.add_argument("--tokens", type=int, default=1, help="query tokens (the last cells)")
    ap.add_argument("--seqs", type=int, default=1, help="sequences the query tokens split into")
    args = ap.parse_args()

    from llamapy.backend import native

    lib = native.lib()
    if lib is None:
        raise SystemExit(f"no compiled kernels: {native.error()}")
    libs = {}
    for name in args.lib or ["THIS"]:
        if name == "THIS":
            libs[name] = lib
            continue
        other = ctypes.CDLL(name)
        other.lp_attend_q.argtypes, other.lp_attend_q.restype = native.SIGNATURES["lp_attend_q"]
        libs[name] = other
    clock = time.process_time if args.cpu else time.perf_counter
    rng = np.random.default_rng(0)
    N, H, Hkv, D = args.depth, args.heads, args.kv_heads, args.head_dim
    T, S = args.tokens, args.seqs
    if T > N or T % S:
        raise SystemExit("--tokens must be at most -d and a multiple of --seqs")
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    cell, tok = np.arange(N)[None, :], np.arange(T)[:, None] + (N - T)
    per = T // S
    first = 0 if S == 1 else (N - T) + (tok - (N - T)) // per * per  # each token's sequence's first cell
    mask = np.where((cell <= tok) & (cell >= first), 0.0, -np.inf).astype(np.float32)
    out = np.empty((T, H, D), np.float32)
    print(f"kernels {native.variant()}, {args.layers} layers x {N} cells, {H} heads / {Hkv} KV heads of {D}, "
          f"{'CPU' if args.cpu else 'wall'} time (noisy on a shared machine)")
    for kt in args.types:
        caches = [(make_cache(kt, N, Hkv, D, rng), make_cache(kt, N, Hkv, D, rng)) for _ in range(args.layers)]
        nbytes = sum(k[0].nbytes + v[0].nbytes for k, v in caches)
        for nt in args.threads:
            best = dict.fromkeys(libs, float("inf"))
            for _ in range(args.reps):
                for name, lb in libs.items():
                    t0 = clock()
                    for (k, ksn, ksh), (v, vsn, vsh) in caches:
                        lb.lp_attend_q(q.ctypes.data, T, H, D, k.ctypes.data, v.ctypes.data, N, Hkv, D, ksn, ksh, vsn,
                                       vsh, mask.ctypes.data, N, 1.0 / np.sqrt(D), out.ctypes.data, CODES[kt], CODES[kt], None,
                                       nt)
                    best[name] = min(best[name], clock() - t0)
            for name, b in best.items():
                print(f"{kt:5s} -t {nt}: {b * 1e3:7.3f} ms a call of {T} token(s)  ({nbytes / 2**20:6.1f} MiB of cache, "
                      f"{nbytes / b / 1e9:5.1f} GB/s)  {name if len(libs) > 1 else ''}", flush=True)


if __name__ == "__main__":
    main()
