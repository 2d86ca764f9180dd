"""The Llama-3.2-1B-shape test model and its `--pure` quantizations, for bench/compare.py.

    python bench/models1b.py where                    # the paths used, and which exist
    python bench/models1b.py make                     # the Q4_K_M file (and its F16 source)
    python bench/models1b.py make --types q4_0,q8_0   # `--pure` files of these types

The model is written by ../shared/reference/models/make_llama.py (seeded random weights, the
Llama-3.2-1B shape: 16 layers, n_embd 2048, n_ff 8192, 32 heads, 8 KV heads, llama3 RoPE, tied
output, the llama-bpe vocabulary) as F16, then quantized with llama.cpp's `llama-quantize` (built
by bench/llama_cpp.py from the same sources as llama-bench): `llama-quantize F16 OUT Q4_K_M`
for the 1B-shape model of the speed issue, `llama-quantize --pure F16 OUT TYPE` for one type in
every tensor (the per-type table). Nothing of it is written into the repository.

Where the files are (each path: option of compare.py, else environment variable, else default):
- the folder: `--models-dir`, $LLAMAPY_BENCH_MODELS, default $LLAMAPY_BENCH_CACHE/models
  (~/.cache/llamapy-bench/models);
- the Q4_K_M file: `--llama1b`, $LLAMAPY_LLAMA1B, default FOLDER/llama1b-Q4_K_M.gguf;
- the F16 source: `--llama1b-f16`, $LLAMAPY_LLAMA1B_F16, default FOLDER/llama1b-f16.gguf; it is
  also the `--pure` F16 file (every matrix of it is F16 already);
- `--pure` files: FOLDER/llama1b-pure-TYPE.gguf.
A file is made only when absent (written under a temporary name, then renamed), so later runs
reuse it. Each quantization takes minutes on 2 cores; the F16 source is 2.4 GB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402  (bench/llama_cpp.py)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"  # next to the checkout, and nowhere else
MAKE_LLAMA = SHARED / "reference" / "models" / "make_llama.py"
VOCAB = SHARED / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf"
# the Llama-3.2-1B shape (../shared/reference/models/README.md)
SHAPE = ["--layers", "16", "--embd", "2048", "--ff", "8192", "--heads", "32", "--kv-heads", "8",
         "--rope-base", "500000", "--llama3-rope"]  # fmt: skip
# the per-type table of issue 11 (llama-quantize's names; Q3_K/Q4_K/Q5_K are its aliases of the
# _M mixes, which `--pure` turns into one type throughout)
PURE_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
OPTIONAL_TYPES = ("F32",)  # 4.9 GB: only when asked for by name
QUANTIZE = "llama-quantize"


@dataclass
class Paths:
    folder: Path
    q4_k_m: Path
    f16: Path

    def pure(self, qtype: str) -> Path:
        return self.f16 if qtype == "F16" else self.folder / f"llama1b-pure-{qtype}.gguf"


def paths(models_dir: str | None = None, llama1b: str | None = None, llama1b_f16: str | None = None) -> Paths:
    folder = Path(models_dir or os.environ.get("LLAMAPY_BENCH_MODELS") or llama_cpp.cache_dir() / "models")
    q4 = Path(llama1b or os.environ.get("LLAMAPY_LLAMA1B") or folder / "llama1b-Q4_K_M.gguf")
    f16 = Path(llama1b_f16 or os.environ.get("LLAMAPY_LLAMA1B_F16") or folder / "llama1b-f16.gguf")
    return Paths(folder, q4, f16)


def parse_types(spec: str) -> list[str]:
    """`all`, or comma-separated type names (any case): the types of the per-type table."""
    if spec.strip().lower() == "all":
        return list(PURE_TYPES)
    out = []
    for part in spec.split(","):
        t = part.strip().upper()
        if not t:
            continue
        if t not in PURE_TYPES + OPTIONAL_TYPES:
            raise ValueError(f"unknown type {part.strip()!r}: use 'all' or some of {', '.join(PURE_TYPES + OPTIONAL_TYPES)}")
        out.append(t)
    if not out:
        raise ValueError("no type given")
    return list(dict.fromkeys(out))


def _log(msg: str) -> None:
    print(f"[models1b] {msg}", file=sys.stderr, flush=True)


def find_quantize() -> Path | None:
    """llama-quantize next to llama-bench ($LLAMA_CPP_BIN, else the cached build), or None."""
    dirs = [Path(os.environ["LLAMA_CPP_BIN"])] if os.environ.get("LLAMA_CPP_BIN") else []
    dirs.append(llama_cpp.build_dir() / "bin")
    for d in dirs:
        p = d / QUANTIZE
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def ensure_quantize(allow_build: bool, timeout: float | None = None) -> tuple[Path | None, str]:
    """(llama-quantize, note): found, or built in llama.cpp's configured build folder (the
    build of bench/llama_cpp.py configures it; this adds one target), else None and why."""
    tool = find_quantize()
    if tool:
        return tool, ""
    bdir = llama_cpp.build_dir()
    if not allow_build:
        return None, f"{QUANTIZE} is not built"
    if not (bdir / "CMakeCache.txt").exists():
        return None, f"llama.cpp is not configured in {bdir} (run `python bench/llama_cpp.py build` first)"
    _log(f"cmake --build {bdir} --target {QUANTIZE}")
    try:
        with open(llama_cpp.cache_dir() / "build.log", "a") as logf:
            subprocess.run(["cmake", "--build", str(bdir), "-j2", "--target", QUANTIZE], stdout=logf,
                           stderr=subprocess.STDOUT, check=True, timeout=timeout)  # fmt: skip
    except (subprocess.SubprocessError, OSError) as e:
        return None, f"building {QUANTIZE} failed ({e})"
    tool = find_quantize()
    return (tool, "") if tool else (None, f"{QUANTIZE} missing after its build")


def _make(out: Path, cmd: list[str], timeout: float | None) -> None:
    """Run `cmd`, which writes `out`, with `out` replaced by a temporary name, then rename the
    result to `out`: an interrupted run leaves no half-written file that a later run would use."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    cmd = [str(tmp) if c == str(out) else c for c in cmd]
    _log(" ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    if r.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} failed "
                           f"(exit {r.returncode}): {(r.stderr or r.stdout).strip()[-1000:]}")  # fmt: skip
    tmp.rename(out)


def ensure_f16(p: Paths, timeout: float | None = None) -> Path:
    if p.f16.is_file():
        return p.f16
    for need in (MAKE_LLAMA, VOCAB):
        if not need.is_file():
            raise RuntimeError(f"{need} is missing (../shared must sit next to the checkout)")
    _make(p.f16, [sys.executable, str(MAKE_LLAMA), str(VOCAB), str(p.f16), *SHAPE], timeout)
    return p.f16


def ensure_file(p: Paths, qtype: str | None, quantize: Path | None, timeout: float | None = None) -> Path:
    """The Q4_K_M file (qtype None) or the `--pure` file of qtype: made when absent."""
    out = p.q4_k_m if qtype is None else p.pure(qtype)
    if out.is_file():
        return out
    if qtype == "F16":
        return ensure_f16(p, timeout)
    if quantize is None:
        raise RuntimeError(f"{out} is missing and {QUANTIZE} is not available to make it")
    src = ensure_f16(p, timeout)
    args = [str(src), str(out), "Q4_K_M"] if qtype is None else ["--pure", str(src), str(out), qtype]
    _make(out, [str(quantize), *args], timeout)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["where", "make"])
    ap.add_argument("--types", help="`--pure` types to make: 'all' or comma-separated (default: the Q4_K_M file)")
    ap.add_argument("--models-dir")
    ap.add_argument("--llama1b")
    ap.add_argument("--llama1b-f16")
    ap.add_argument("--no-build", action="store_true", help=f"do not build {QUANTIZE}")
    a = ap.parse_args(argv)
    p = paths(a.models_dir, a.llama1b, a.llama1b_f16)
    try:
        types = parse_types(a.types) if a.types else []
    except ValueError as e:
        ap.error(str(e))
    targets = [(t, p.pure(t)) for t in types] or [(None, p.q4_k_m)]
    if a.cmd == "where":
        for t, path in [(None, p.q4_k_m), ("F16 source", p.f16), *(targets if types else [])]:
            print(f"{t or 'Q4_K_M':>10}  {'exists ' if path.is_file() else 'missing'}  {path}")
        print(f"{QUANTIZE:>10}  {find_quantize() or 'not built'}")
        return 0
    tool, why = ensure_quantize(not a.no_build)
    if tool is None:
        _log(why)
    rc = 0
    for t, _ in targets:
        try:
            print(ensure_file(p, t, tool))
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            _log(str(e))
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
