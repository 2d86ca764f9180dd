"""Throughput of llamapy's quantized MUL_MAT per weight type.

Counterpart of llama.cpp's `test-backend-ops perf -o MUL_MAT`: for each type and each of the
default model's (SmolLM2-135M) matrix shapes, time `QMatrix.matmul` on one token and print
GB/s of quantized weights read and G weights/s, for 1 and 2 threads, for each kernel set:
`q8` (the default: activations quantized, lp_mul_mat on the file's blocks), `f32` (float32
activations on the repacked tiles) and `numpy` (LLAMAPY_KERNELS=numpy: dequantized tiles +
BLAS). Then, per type, the prompt path's pieces: the dequantization of weights to float32
(G elements/s, each kernel set vs the numpy reference) and a
512-token `matmul` (GFLOP/s, dequantization + sgemm), plus the repacked layout's size over
the file's bytes. Timings are the best of several runs (the machine is shared).

    python bench/bench_kernels.py [--types Q4_1,Q8_0] [--impls q8,f32] [--no-fallback] [--min-time 0.3]
                                  [--no-prompt]

`--wide` instead times the q8 kernels themselves (lp_mul_mat_q / lp_mul_mat_id_q through ctypes,
activations quantized beforehand) on one 8192x2048 matrix (8192 rows of 2048 inputs, streamed from
memory) at 1, 2 and 4 tokens, and MUL_MAT_ID on gpt-oss-20b's expert shape (32 experts of
2880x2880, top-4) at 1, 4 and 16 tokens (with a workspace, as the executor calls it, and without:
allocated by the call); `--baseline DIR` loads a second build's library
(DIR/lp_<variant>.so) and alternates the two, round after round, in one process (medians):

    taskset -c 1 python bench/bench_kernels.py --wide --types Q4_0,IQ4_NL,IQ4_XS,MXFP4 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llamapy.backend import native, qmatmul  # noqa: E402
from llamapy.types import GGMLType, block_size  # noqa: E402

# (n_out, n_in) of SmolLM2-135M: attn q/o, attn k/v, ffn gate/up, ffn down, output.
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
# One decoded token reads each layer matrix once (30 layers) plus the output matrix.
PER_TOKEN = {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30, (49152, 576): 1}
# Byte offsets of the f16 scale fields inside one block (ggml's block structs).
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": [],
}
# K-quants need n_in % 256 == 0: they run at the tiny32 test model's shapes instead.
K_SHAPES = [(256, 256), (768, 256), (256, 768), (768, 768), (32000, 256)]
K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
TYPES = "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K".split()


def random_matrix(qt: GGMLType, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    blck, bsize = block_size(qt)
    raw = rng.integers(0, 256, (n_out, n_in // blck * bsize), dtype=np.uint8)
    if qt == GGMLType.F32:
        return rng.standard_normal((n_out, n_in), dtype=np.float32).view(np.uint8)
    if qt in (GGMLType.F16, GGMLType.BF16):
        raw.view(np.uint16)[...] &= 0x3BFF  # finite, smallish values
        return raw
    # Small finite f16 scales (random bytes there give inf/nan/subnormals, which skew timing).
    blocks = raw.reshape(-1, bsize)
    if qt == GGMLType.MXFP4:  # its E8M0 exponent byte: scales around 2^-7
        blocks[:, 0] = rng.integers(118, 124, blocks.shape[0])
    for off in F16_FIELDS[qt.name]:
        scale = (rng.random(blocks.shape[0]) * 0.01 + 1e-3).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw


def best_time(fn, min_time: float, repeats: int = 5) -> float:
    """Best over `repeats` rounds of the mean time of fn() over >= min_time / repeats."""
    fn()  # compile / warm
    best = float("inf")
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time / repeats:
                break
        best = min(best, dt / n)
    return best


def bench(m: qmatmul.QMatrix, x: np.ndarray, threads: int, min_time: float, q8: bool = True) -> float:
    return best_time(lambda: m.matmul(x, threads, q8), min_time)


def use(impl: str) -> None:
    """Select a kernel set for the matrices prepared next (numpy: LLAMAPY_KERNELS=numpy)."""
    if impl == "numpy":
        os.environ["LLAMAPY_KERNELS"] = "numpy"
    else:
        os.environ.pop("LLAMAPY_KERNELS", None)


def bench_prompt(name: str, impl: str, mats: dict, min_time: float) -> None:
    """Dequantization and 512-token matmul (the prompt path) on the largest layer shape."""
    from llamapy import quants

    s = max((s for s in mats if s[0] < 10000), key=lambda s: s[0] * s[1])
    m = mats[s]
    qt = GGMLType[name]
    raw = random_matrix(qt, *s, np.random.default_rng(1))
    n = s[0] * s[1]
    cells = []
    for th in (1, 2):
        dt = best_time(lambda: m.dequantize(None, th), min_time)
        cells.append(f"{impl} {th}t {n / dt / 1e9:5.2f}")
    dt = best_time(lambda: quants.dequantize(raw, qt, s[1]), min_time, repeats=2)
    cells.append(f"numpy {n / dt / 1e9:5.2f}")
    x = np.random.default_rng(2).standard_normal((512, s[1]), dtype=np.float32)
    gf = []
    for th in (1, 2):
        dt = best_time(lambda: m.matmul(x, th, impl == "q8"), min_time, repeats=3)
        gf.append(f"{th}t {2 * 512 * n / dt / 1e9:6.1f}")
    over = m.nbytes / raw.nbytes - 1
    print(f"{name:6} {impl:5} {s[0]}x{s[1]:<5} dequant G elem/s: {'  '.join(cells)} | pp512 matmul "
          f"GFLOP/s: {'  '.join(gf)} | repacked={m.repacked} +{over * 100:.0f}% bytes")


def available(impl: str) -> bool:
    return impl == "numpy" or native.lib() is not None


WIDE = (8192, 2048)  # (rows, inputs) of the --wide matrix
EXPERTS = (32, 2880, 2880, 4)  # gpt-oss-20b: experts, rows and inputs of each, experts a token


def wide_cases(lib, qt: GGMLType, threads: int, rng: np.random.Generator) -> list[tuple[str, object]]:
    """(label, a call of `lib`'s kernel) for the --wide shapes; the arrays live in the closures."""
    c = ctypes.c_void_p
    vdt = lib.lp_vec_dot_type(int(qt))
    cases = []
    n_out, n_in = WIDE
    w = random_matrix(qt, n_out, n_in, rng)
    for n_tok in (1, 2, 4):
        x = rng.standard_normal((n_tok, n_in), dtype=np.float32)
        xq = np.empty(n_tok * lib.lp_act_row_bytes(int(qt), n_in), np.uint8)
        lib.lp_quantize_act(int(qt), c(x.ctypes.data), n_in, n_in, n_tok, c(xq.ctypes.data), 1)
        y = np.empty((n_tok, n_out), np.float32)
        args = (int(qt), c(w.ctypes.data), n_out, w.shape[1], n_in, c(xq.ctypes.data), n_tok, c(y.ctypes.data),
                n_out, threads)
        cases.append((f"{n_out}x{n_in} {n_tok}tok", lambda a=args, keep=(w, xq, y): lib.lp_mul_mat_q(*a)))
    n_exp, M, n_in, top = EXPERTS
    blck, _ = block_size(qt)
    if n_in % blck == 0 and vdt >= 0:
        we = random_matrix(qt, n_exp * M, n_in, rng)
        for T in (1, 4, 16):
            x = rng.standard_normal((T, n_in), dtype=np.float32)
            xq = np.empty(T * lib.lp_act_row_bytes(int(qt), n_in), np.uint8)
            lib.lp_quantize_act(int(qt), c(x.ctypes.data), n_in, n_in, T, c(xq.ctypes.data), 1)
            ids = np.stack([rng.choice(n_exp, top, replace=False) for _ in range(T)]).astype(np.int32)
            y = np.empty((T, top, M), np.float32)
            args = (int(qt), c(we.ctypes.data), n_exp, M, we.shape[1], n_in, c(xq.ctypes.data), 1,
                    c(ids.ctypes.data), top, T, top, c(y.ctypes.data))
            keep = (we, xq, ids, y)
            if not hasattr(lib, "lp_mul_mat_id_q_wsp"):  # a build from before the workspace argument
                cases.append((f"experts {T}tok", lambda a=args + (threads,), k=keep: lib.lp_mul_mat_id_q(*a)))
                continue
            wsp = np.empty(lib.lp_mul_mat_id_q_wsp(int(qt), n_exp, M, n_in, T, top), np.uint8)
            # the executor's way (a workspace in its arena) and the direct call's (allocated)
            cases.append((f"experts {T}tok", lambda a=args + (c(wsp.ctypes.data), threads), k=keep + (wsp,):
                          lib.lp_mul_mat_id_q(*a)))
            cases.append((f"experts {T}tok malloc", lambda a=args + (None, threads), k=keep: lib.lp_mul_mat_id_q(*a)))
    return cases


def wide(types: list[str], baseline: str | None, rounds: int, threads: int) -> None:
    """Medians (ms) of `rounds` alternating rounds, each the best of 5 calls (see the docstring)."""
    libs = [("new", native.lib())]
    if baseline:
        libs.append(("base", ctypes.CDLL(os.path.join(baseline, f"lp_{native.variant()}.so"))))
        for name in ("lp_mul_mat_q", "lp_quantize_act", "lp_act_row_bytes", "lp_vec_dot_type"):
            getattr(libs[1][1], name).argtypes = getattr(libs[0][1], name).argtypes
            getattr(libs[1][1], name).restype = getattr(libs[0][1], name).restype
        # a build from before the workspace argument takes 14 arguments, a newer one new's 15
        old = not hasattr(libs[1][1], "lp_mul_mat_id_q_wsp")
        libs[1][1].lp_mul_mat_id_q.argtypes = (libs[0][1].lp_mul_mat_id_q.argtypes[:13] + [ctypes.c_int] if old
                                               else libs[0][1].lp_mul_mat_id_q.argtypes)
        if not old:
            libs[1][1].lp_mul_mat_id_q_wsp.argtypes = libs[0][1].lp_mul_mat_id_q_wsp.argtypes
            libs[1][1].lp_mul_mat_id_q_wsp.restype = libs[0][1].lp_mul_mat_id_q_wsp.restype
        libs[1][1].lp_mul_mat_id_q.restype = ctypes.c_int
    print(f"variant {native.variant()}, {threads} thread(s), {rounds} alternating rounds, ms (median; min-max)")
    for name in types:
        qt = GGMLType[name]
        per = {tag: dict(wide_cases(lib, qt, threads, np.random.default_rng(7))) for tag, lib in libs}
        times: dict[str, dict[str, list[float]]] = {tag: {label: [] for label in per[tag]} for tag in per}
        for _ in range(rounds):
            for tag in per:
                for label, fn in per[tag].items():
                    fn()
                    best = float("inf")
                    for _ in range(5):
                        t0 = time.perf_counter()
                        fn()
                        best = min(best, time.perf_counter() - t0)
                    times[tag][label].append(best * 1e3)
        for label in per["new"]:
            cells = "  ".join(f"{tag} {np.median(ts[label]):7.3f} ({min(ts[label]):.3f}-{max(ts[label]):.3f})"
                              for tag, ts in times.items() if label in ts)
            print(f"{name:7} {label:22} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--impls", default="q8,f32")
    ap.add_argument("--no-fallback", action="store_true")
    ap.add_argument("--min-time", type=float, default=0.25)
    ap.add_argument("--no-prompt", action="store_true")
    ap.add_argument("--wide", action="store_true", help="the q8 kernels on large shapes (see the docstring)")
    ap.add_argument("--baseline", help="--wide: a directory with another build's lp_<variant>.so, alternated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.wide:
        wide(args.types.split(","), args.baseline, args.rounds, args.threads)
        return
    impls = [i for i in args.impls.split(",") if available(i)] + ([] if args.no_fallback else ["numpy"])
    print(f"kernels={impls} (C: {native.error() or 'ok'})  shapes={SHAPES}")
    print(f"{'type':6} {'path':6} {'thr':>3} " + " ".join(f"{f'{o}x{i}':>16}" for o, i in SHAPES)
          + f" {'model/token':>12}")
    prompt: list = []
    for name in args.types.split(","):
        qt = GGMLType[name]
        shapes = K_SHAPES if name in K_TYPES else SHAPES
        raws = {s: random_matrix(qt, *s, np.random.default_rng(hash(s) % 1000)) for s in shapes}
        xs = {s: rng_x(s) for s in shapes}
        for impl in impls:
            use(impl)  # the matrices are prepared (repacked or not) for this set
            mats = {s: qmatmul.QMatrix.prepare(raws[s], qt, *s, repack=impl == "f32") for s in shapes}
            for threads in (1, 2):
                cells, tok = [], 0.0
                for s in shapes:
                    dt = bench(mats[s], xs[s], threads, args.min_time, impl == "q8")
                    gbs = mats[s].nbytes / dt / 1e9
                    gws = s[0] * s[1] / dt / 1e9
                    cells.append(f"{gbs:6.2f}GB/s {gws:5.2f}Gw")
                    tok += dt * PER_TOKEN.get(s, 0)
                total = f" {tok * 1e3:9.1f} ms" if name not in K_TYPES else "  (tiny32 shapes)"
                print(f"{name:6} {impl:6} {threads:3} " + " ".join(f"{c:>16}" for c in cells) + total)
            if impl != "numpy" and name not in ("F32", "F16", "BF16"):
                prompt.append((name, impl, mats))
    if args.no_prompt:
        return
    print("prompt path (dequantize to f32 + sgemm), largest layer shape:")
    for name, impl, mats in prompt:
        use(impl)
        bench_prompt(name, impl, mats, args.min_time)


def rng_x(s: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(s[0]).standard_normal((1, s[1]), dtype=np.float32)


if __name__ == "__main__":
    main()
