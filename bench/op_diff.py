"""llamapy's C kernels (kernels_c/ops.c: lp_rms_norm, lp_rope, lp_swiglu, lp_attend[_f16]; with --model,
qmatmul.c's lp_mul_mat: the q8 MUL_MATs, weights read from that GGUF file) run on
llama.cpp's own inputs, from a dump of bench/op_dump.cpp, and compared with llama.cpp's outputs bit
for bit, op by op and layer by layer (each op on llama.cpp's inputs, so one op's difference does not
hide the next). A llama-architecture model with normal (not neox) RoPE, as the default SmolLM2.

    python bench/op_diff.py DUMPDIR [--layers 0,1,15|all] [--fa-only] [--rope-base 100000] [--eps 1e-5]
        [--model GGUF]

(LLAMAPY_KERNELS_VARIANT=avx2 / portable: the same comparison for another build variant.)

Prints, per op: values whose bits differ, the largest absolute and relative difference. A
development tool (bench/RESULTS.md, "op by op"), not a test."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from llamapy.backend import kernels as K
from llamapy.backend import native
from llamapy.backend.cpu_kernels import _ptr

MATMULS = ("Qcur", "Kcur", "Vcur", "attn_out", "ffn_gate", "ffn_up", "ffn_out")
WEIGHTS = {"Qcur": "attn_q", "Kcur": "attn_k", "Vcur": "attn_v", "attn_out": "attn_output", "ffn_gate": "ffn_gate",
           "ffn_up": "ffn_up", "ffn_out": "ffn_down"}


class Dump:
    """The tensors of one op_dump run, by (name, op, occurrence)."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.rows = [line.rstrip("\n").split("\t") for line in open(d / "index.tsv")]

    def get(self, name: str, op: str, k: int = 0) -> np.ndarray:
        r = [r for r in self.rows if r[1] == name and r[2] == op][k]
        ne = [int(x) for x in r[4].split(",")]
        nb = [int(x) for x in r[5].split(",")]
        raw = np.fromfile(self.d / f"{r[0]}.bin", np.float32 if r[3] == "f32" else np.float16)
        # ggml's ne/nb are innermost first: numpy's shape/strides reversed
        return np.array(np.lib.stride_tricks.as_strided(raw, shape=ne[::-1], strides=nb[::-1]))

    def nth(self, op: str, k: int) -> np.ndarray:
        r = [r for r in self.rows if r[2] == op][k]
        return self.get(r[1], op, [x for x in self.rows if x[1] == r[1] and x[2] == op].index(r))


def report(name: str, got: np.ndarray, want: np.ndarray) -> None:
    a = np.ascontiguousarray(got, np.float32).ravel()
    b = np.ascontiguousarray(want, np.float32).ravel()
    n = np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))
    d = float(np.max(np.abs(a - b)))
    print(f"{name:40s} bits differ {n:7d}/{a.size:7d}  max abs {d:.3e}  rel {d / float(np.max(np.abs(b))):.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", type=Path)
    ap.add_argument("--layers", default="0,1", help="comma-separated, or 'all'")
    ap.add_argument("--fa-only", action="store_true", help="FLASH_ATTN_EXT only")
    ap.add_argument("--rope-base", type=float, default=100000.0)
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--model", type=Path, help="the GGUF file of the dump: also compare the MUL_MATs")
    a = ap.parse_args()
    lib = native.lib()
    if lib is None:
        raise SystemExit(f"error: no C kernels: {native.error()}")
    dp = Dump(a.dump)
    has_fa = any(r[2] == "FLASH_ATTN_EXT" for r in dp.rows)
    weights = {}
    if a.model is not None:
        import gguf

        weights = {t.name: t for t in gguf.GGUFReader(a.model).tensors}

    def mul_mat(name: str, wname: str, k: int = 0) -> None:
        """MUL_MAT `name` (its k-th occurrence) by lp_mul_mat on llama.cpp's input (src1)."""
        r = [r for r in dp.rows if r[1] == name and r[2] == "MUL_MAT"][k]
        src1 = [x for x in dp.rows if x[1] == r[7] and x[0] < r[0]][-1]
        x = np.ascontiguousarray(dp.get(src1[1], src1[2], [y for y in dp.rows if y[1] == src1[1] and y[2] == src1[2]].index(src1))[0, 0])
        t = weights[wname]
        w = np.ascontiguousarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)  # (n_out, row bytes)
        want = dp.get(name, "MUL_MAT", k)[0, 0]
        n_tok, n_in = x.shape[0], x.shape[1]
        y = np.empty((n_tok, w.shape[0]), np.float32)
        wsp = np.empty(n_tok * max(lib.lp_act_row_bytes(int(t.tensor_type), n_in), 1), np.uint8)
        if lib.lp_mul_mat(int(t.tensor_type), _ptr(w), w.shape[0], w.shape[1], n_in, _ptr(x), n_in, n_tok, _ptr(y),
                          w.shape[0], _ptr(wsp), 1) != 0:
            raise SystemExit(f"error: lp_mul_mat cannot take {wname} ({t.tensor_type.name})")
        report(f"MUL_MAT {name} ({t.tensor_type.name}, {n_tok} tok)", y, want)
    n_layers = sum(1 for r in dp.rows if r[2] == "FLASH_ATTN_EXT") if has_fa else 0
    layers = range(n_layers) if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    for il in layers:
        if a.fa_only:
            fa_diff(dp, lib, il)
            continue
        for which, src in ((0, "embd" if il == 0 else f"l_out-{il - 1}"), (1, f"ffn_inp-{il}")):
            x = np.ascontiguousarray(dp.get(src, "GET_ROWS" if src == "embd" else "ADD")[0, 0])  # (T, E)
            out = np.empty_like(x)
            lib.lp_rms_norm(_ptr(x), x.shape[0], x.shape[1], x.shape[1], a.eps, _ptr(out))
            report(f"RMS_NORM L{il} ({'attn' if which == 0 else 'ffn'})", out, dp.get(f"norm-{il}", "RMS_NORM", which)[0, 0])
        for nm in ("Qcur", "Kcur"):
            x = np.ascontiguousarray(dp.get(f"{nm}-{il}", "RESHAPE")[0])  # (T, H, D)
            T, H, D = x.shape
            pos = np.arange(T, dtype=np.int32)
            out = np.empty_like(x)
            lib.lp_rope(_ptr(x), T, H, D, _ptr(pos), _ptr(K.rope_consts(D, a.rope_base, 1.0, None)), D, 0, _ptr(out))
            report(f"ROPE L{il} {nm}", out, dp.get(f"{nm}-{il}", "ROPE")[0])
        if weights:
            for nm in MATMULS:
                if any(r[1] == f"{nm}-{il}" and r[2] == "MUL_MAT" for r in dp.rows):
                    mul_mat(f"{nm}-{il}", f"blk.{il}.{WEIGHTS[nm]}.weight")
        g = np.ascontiguousarray(dp.get(f"ffn_gate-{il}", "MUL_MAT")[0, 0])
        u = np.ascontiguousarray(dp.get(f"ffn_up-{il}", "MUL_MAT")[0, 0])
        out = np.empty_like(g)
        lib.lp_swiglu(_ptr(g), _ptr(u), g.shape[0], g.shape[1], g.shape[1], u.shape[1], _ptr(out))
        report(f"SWIGLU L{il}", out, dp.get(f"ffn_swiglu-{il}", "SWIGLU")[0, 0])
        if has_fa:
            fa_diff(dp, lib, il)
    if weights and any(r[1] == "result_output" for r in dp.rows):
        mul_mat("result_output", "output.weight" if "output.weight" in weights else "token_embd.weight")


def fa_diff(dp: Dump, lib, il: int) -> None:  # noqa: ANN001 - the ctypes library
    """FLASH_ATTN_EXT of layer il on llama.cpp's Q and cache: its n_stream sequences (one KV stream
    each, as llama-perplexity; 1 for one sequence) laid out as llamapy does, one after the other in
    one cache, each sequence's cells from a multiple of its length, a block-diagonal causal mask; on
    1 and 2 threads, over the f16 cache and the same cache widened to f32."""
    q = np.ascontiguousarray(dp.get(f"Qcur-{il}", "ROPE")[0])  # (T, H, D), tokens by sequence
    T, H, D = q.shape
    want_t = dp.nth("FLASH_ATTN_EXT", il)  # (ns, T/ns, H, D)
    ns = want_t.shape[0] if want_t.ndim == 4 else 1
    want = want_t.reshape(T, H, D)
    ts = T // ns
    rows = [r for r in dp.rows if r[2] == "SET_ROWS" and r[1].startswith(f"cache_k_l{il} ")]
    kc = dp.get(rows[0][1], "SET_ROWS")[0, 0]  # (ns * cells per stream, Hkv*D) f16
    vc = dp.get(rows[0][1].replace("cache_k", "cache_v"), "SET_ROWS")[0, 0]
    per = kc.shape[0] // ns
    hkv = kc.shape[1] // D
    k = np.concatenate([kc[s * per : s * per + ts] for s in range(ns)]).reshape(T, hkv, D)
    v = np.concatenate([vc[s * per : s * per + ts] for s in range(ns)]).reshape(T, hkv, D)
    tok = np.arange(T)
    vis = (tok[None, :] <= tok[:, None]) & (tok[None, :] // ts == tok[:, None] // ts)
    mask = np.where(vis, 0.0, -np.inf).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    for label, fn, kk, vv in (("f16 cache (lp_attend_f16)", lib.lp_attend_f16, k, v),
                              ("cache widened to f32 (lp_attend)", lib.lp_attend, k.astype(np.float32),
                               v.astype(np.float32))):
        kk, vv = np.ascontiguousarray(kk), np.ascontiguousarray(vv)
        for nt in (1, 2):
            out = np.empty((T, H, D), np.float32)
            fn(_ptr(q), T, H, D, _ptr(kk), _ptr(vv), T, hkv, D, hkv * D, D, hkv * D, D, _ptr(mask), T, scale,
               _ptr(out), nt)
            report(f"FLASH_ATTN_EXT L{il} {label} -t {nt}", out, want)

if __name__ == "__main__":
    main()
