"""llama.cpp's own tools, for side-by-side measurements (never a dependency of llamapy).

    python bench/llama_cpp.py build                 # download the sdist with pip and build (cached)
    python bench/llama_cpp.py build --server        # also llama-server (bench/serve_load.py --llama-server)
    python bench/llama_cpp.py build --gguf-split    # also llama-gguf-split (tests/model/test_split_files.py)
    python bench/llama_cpp.py build --speculative   # also llama-speculative-simple (bench/spec_speed.py)
    python bench/llama_cpp.py where                 # print the tool paths, or why there are none
    python bench/llama_cpp.py bench MODEL           # llama-bench -p 512 -n 128 -t 2 -o json
    python bench/llama_cpp.py completion MODEL      # llama-completion: load time, eval, peak RSS

The tools come from the llama.cpp sources vendored in the PyPI sdist of llama-cpp-python 0.3.36
(the copy that produced ../shared/reference), fetched with `pip download --no-binary :all:` and
built with cmake into a cache directory outside the repository ($LLAMAPY_BENCH_CACHE, default
~/.cache/llamapy-bench). Nothing of llama.cpp is ever written into the repository. A build is
done once: later calls find the binaries (a lock file keeps two builds from racing).
$LLAMA_CPP_BIN (a directory holding llama-bench and llama-completion) overrides the cache.

When no build is possible, callers fall back to reference() — llama.cpp's figures on this
machine kind from ../shared/reference/smollm2/bench.json — and must say so.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
TOOLS = ("llama-bench", "llama-completion")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DLLAMA_CURL=OFF",  # older sources; newer ones ignore it
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS model downloads: nothing here fetches models
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",  # also skips the web UI (which could try to download)
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries
]
# ggml's tinygemm AMX kernels die with SIGILL on VMs that report AMX without enabling its tile
# state (../shared/reference/models/README.md): on such hosts the compiler must not use AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
REPO = Path(__file__).resolve().parents[1]
# ../shared next to the checkout, and nowhere else: reference() says when it is missing
REFERENCE = REPO.parent / "shared" / "reference" / "smollm2" / "bench.json"


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether /proc/cpuinfo's flags name an AMX extension (amx_tile, amx_int8, amx_bf16, …)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and any(f.startswith("amx") for f in value.split()):
            return True
    return False


def cmake_flags(cpuinfo: str | None = None) -> list[str]:
    """CMAKE_FLAGS, plus C and C++ flags that keep AMX out where the CPU reports it."""
    if not cpu_has_amx(cpuinfo):
        return list(CMAKE_FLAGS)
    return [*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMAPY_BENCH_CACHE", Path.home() / ".cache" / "llamapy-bench"))


def build_dir() -> Path:
    return cache_dir() / f"build-{VERSION}"


def source_dir() -> Path:
    return cache_dir() / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def _log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


# -- locating and building ------------------------------------------------------------------


def find_tools() -> dict[str, Path] | None:
    """{tool: path} for llama-bench and llama-completion, or None if they are not built."""
    candidates = []
    if os.environ.get("LLAMA_CPP_BIN"):
        candidates.append(Path(os.environ["LLAMA_CPP_BIN"]))
    candidates.append(build_dir() / "bin")
    for d in candidates:
        paths = {t: d / t for t in TOOLS}
        if all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
            return paths
    return None


def build_info() -> dict[str, Any]:
    """What the last build recorded (flags, seconds), or {}."""
    try:
        return json.loads((cache_dir() / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def _run_logged(cmd: list[str], logf: Any, timeout: float | None, cwd: Path | None = None) -> None:
    logf.write(f"$ {' '.join(cmd)}\n")
    logf.flush()
    subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, check=True, timeout=timeout, cwd=cwd)


def build(jobs: int = 2, timeout: float | None = None) -> dict[str, Path]:
    """Build llama-bench and llama-completion (idempotent, cached). Raises on failure; the log
    is cache_dir()/build.log. `timeout` bounds each step in seconds (a later call resumes
    the build where it stopped: cmake's build directory keeps what was compiled)."""
    tools = find_tools()
    if tools:
        return tools
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "w") as lock:
        _log(f"waiting for the build lock {cache / 'build.lock'}")
        fcntl.flock(lock, fcntl.LOCK_EX)
        tools = find_tools()  # another process may have finished it meanwhile
        if tools:
            return tools
        t0 = time.time()
        flags = cmake_flags()
        with open(cache / "build.log", "a") as logf:
            sdist = cache / SDIST
            if not sdist.exists():
                _log(f"pip download llama-cpp-python=={VERSION} (sdist)")
                _run_logged(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     f"llama-cpp-python=={VERSION}", "-d", str(cache)],
                    logf, timeout,
                )  # fmt: skip
            if not (source_dir() / "CMakeLists.txt").exists():
                _log(f"extracting {sdist.name}")
                with tarfile.open(sdist) as tf:
                    tf.extractall(cache, filter="data")
            bdir = build_dir()
            if not (bdir / "CMakeCache.txt").exists():
                _log("cmake configure")
                _run_logged(["cmake", "-S", str(source_dir()), "-B", str(bdir), *flags], logf, timeout)
            _log(f"cmake --build -j{jobs} (this takes a while on 2 cores; log: {cache / 'build.log'})")
            _run_logged(["cmake", "--build", str(bdir), f"-j{jobs}", "--target", *TOOLS], logf, timeout)
        seconds = time.time() - t0
        info = {"version": VERSION, "flags": flags, "jobs": jobs, "seconds": round(seconds, 1),
                "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        (cache / "build.json").write_text(json.dumps(info, indent=2) + "\n")
        _log(f"built in {seconds:.0f} s")
    tools = find_tools()
    if not tools:
        raise RuntimeError(f"the build finished but {TOOLS} are missing from {build_dir() / 'bin'}")
    return tools


def find_server() -> Path | None:
    """llama-server next to the other tools ($LLAMA_CPP_BIN or the cache's build), or None."""
    return _find_extra("llama-server")


def _find_extra(name: str) -> Path | None:
    tools = find_tools()
    p = tools["llama-bench"].parent / name if tools else None
    return p if p is not None and p.is_file() and os.access(p, os.X_OK) else None


def build_server(jobs: int = 2, timeout: float | None = None) -> Path:
    """llama-server in the same build directory (after build()): the configuration turned to
    LLAMA_BUILD_SERVER=ON with the web UI neither built (npm) nor downloaded, so only the
    server's own sources compile; ggml and the other tools are not rebuilt. Idempotent."""
    ui_off = ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    return _build_extra("llama-server", ui_off, jobs, timeout)


def build_embedding(jobs: int = 2, timeout: float | None = None) -> Path:
    """llama-embedding (an example program: LLAMA_BUILD_EXAMPLES=ON) in the same build directory,
    only its own source compiled. Idempotent."""
    return _build_extra("llama-embedding", ["-DLLAMA_BUILD_EXAMPLES=ON"], jobs, timeout)


def build_speculative(jobs: int = 2, timeout: float | None = None) -> Path:
    """llama-speculative-simple (an example program) in the same build directory: a draft
    model's or n-gram speculative decoding of one prompt (bench/spec_speed.py). Idempotent."""
    return _build_extra("llama-speculative-simple", ["-DLLAMA_BUILD_EXAMPLES=ON"], jobs, timeout)


def find_gguf_split() -> Path | None:
    """llama-gguf-split next to the other tools, or None."""
    return _find_extra("llama-gguf-split")


def build_gguf_split(jobs: int = 2, timeout: float | None = None) -> Path:
    """llama-gguf-split (a tool, built by the default configuration) in the same build directory:
    one target, a few seconds. Idempotent."""
    return _build_extra("llama-gguf-split", [], jobs, timeout)


def _build_extra(name: str, flags: list[str], jobs: int, timeout: float | None) -> Path:
    build(jobs=jobs, timeout=timeout)
    found = _find_extra(name)
    if found:
        return found
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(cache_dir() / "build.log", "a") as logf:
            _run_logged(["cmake", "-S", str(source_dir()), "-B", str(build_dir()), *flags], logf, timeout)
            _log(f"cmake --build -j{jobs} --target {name} (log: {cache_dir() / 'build.log'})")
            _run_logged(["cmake", "--build", str(build_dir()), f"-j{jobs}", "--target", name], logf, timeout)
    found = _find_extra(name)
    if not found:
        raise RuntimeError(f"the build finished but {name} is missing from {build_dir() / 'bin'}")
    return found


def ensure(allow_build: bool = True, timeout: float | None = None) -> tuple[dict[str, Path] | None, str]:
    """(tools, note): the tools if found or built, else None and why."""
    tools = find_tools()
    if tools:
        return tools, ""
    if not allow_build:
        return None, "llama.cpp is not built (run `python bench/llama_cpp.py build`)"
    if shutil.which("cmake") is None:
        return None, "cmake is not installed"
    try:
        return build(timeout=timeout), ""
    except subprocess.TimeoutExpired:
        return None, f"the llama.cpp build did not finish within {timeout:.0f} s (rerun to resume)"
    except (subprocess.CalledProcessError, OSError, RuntimeError) as e:
        return None, f"the llama.cpp build failed ({e}; log: {cache_dir() / 'build.log'})"


def reference() -> dict[str, Any]:
    """llama.cpp's figures on this machine kind (measured elsewhere, at another time); {} when
    ../shared is not next to the checkout."""
    try:
        return json.loads(REFERENCE.read_text())
    except FileNotFoundError:
        _log(f"{REFERENCE} is missing: no reference figures (../shared must sit next to the checkout)")
        return {}


# -- running a child with its peak RSS ------------------------------------------------------


@dataclass
class ChildRun:
    cmd: list[str]
    rc: int
    stdout: str
    stderr: str
    wall_s: float
    max_rss_kib: int  # ru_maxrss of this child alone (Linux: KiB)
    user_s: float = 0.0
    sys_s: float = 0.0


def run_child(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> ChildRun:
    """Run `cmd` and return its output, wall time and peak RSS. os.wait4 gives the rusage of
    this child alone (RUSAGE_CHILDREN would be the maximum over every child waited for)."""
    import tempfile

    # random-weight models print arbitrary bytes: decode them leniently
    with (
        tempfile.TemporaryFile("w+", errors="replace") as out,
        tempfile.TemporaryFile("w+", errors="replace") as err,
    ):
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        deadline = None if timeout is None else t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG if deadline else 0)
            if pid:
                break
            if time.perf_counter() > deadline:  # type: ignore[operator]
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return ChildRun(cmd, p.returncode, out.read(), err.read(), wall, ru.ru_maxrss, ru.ru_utime, ru.ru_stime)


# -- the tools ------------------------------------------------------------------------------

_NUM = r"([0-9]+(?:\.[0-9]+)?)"


def parse_perf(stderr: str) -> dict[str, float]:
    """llama_perf_context_print's lines (llama.cpp and llamapy print the same ones)."""
    out: dict[str, float] = {}
    m = re.search(rf"load time\s*=\s*{_NUM}\s*ms", stderr)
    if m:
        out["load_ms"] = float(m.group(1))
    m = re.search(rf"prompt eval time\s*=\s*{_NUM}\s*ms\s*/\s*(\d+)\s*tokens", stderr)
    if m:
        out["prompt_eval_ms"], out["n_prompt"] = float(m.group(1)), int(m.group(2))
    m = re.search(rf"(?<!prompt )eval time\s*=\s*{_NUM}\s*ms\s*/\s*(\d+)\s*runs", stderr)
    if m:
        out["eval_ms"], out["n_eval"] = float(m.group(1)), int(m.group(2))
        if out["n_eval"]:
            out["eval_ms_per_token"] = out["eval_ms"] / out["n_eval"]
            out["eval_tps"] = 1e3 * out["n_eval"] / out["eval_ms"] if out["eval_ms"] else 0.0
    return out


def run_bench(
    tools: dict[str, Path], model: str | Path, p: int | str = 512, n: int | str = 128, t: int = 2,
    reps: int | None = None, extra: list[str] | None = None, timeout: float | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """llama-bench -m MODEL -p P -n N -t T -o json: its JSON records (avg_ts, n_prompt, …)."""
    cmd = [str(tools["llama-bench"]), "-m", str(model), "-p", str(p), "-n", str(n), "-t", str(t), "-o", "json"]
    if reps is not None:
        cmd += ["-r", str(reps)]
    cmd += extra or []
    r = run_child(cmd, timeout=timeout)
    if r.rc != 0:
        raise RuntimeError(f"llama-bench failed (exit {r.rc}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def bench_tps(records: list[dict[str, Any]]) -> dict[str, float]:
    """{'pp512_tps': …, 'tg128_tps': …} from llama-bench (or `llamapy bench`) JSON records."""
    out = {}
    for rec in records:
        if rec.get("n_prompt") and not rec.get("n_gen"):
            out[f"pp{rec['n_prompt']}_tps"] = float(rec["avg_ts"])
        elif rec.get("n_gen") and not rec.get("n_prompt"):
            out[f"tg{rec['n_gen']}_tps"] = float(rec["avg_ts"])
    return out


def run_completion(
    tools: dict[str, Path], model: str | Path, prompt: str, n: int = 128, c: int = 512, t: int = 2,
    timeout: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """llama-completion -m MODEL -n N -c C -p PROMPT --temp 0 -no-cnv -t T: its `load time`,
    eval figures, peak RSS (KiB) and wall time."""
    cmd = [str(tools["llama-completion"]), "-m", str(model), "-n", str(n), "-c", str(c), "-p", prompt,
           "--temp", "0", "-no-cnv", "-t", str(t)]  # fmt: skip
    r = run_child(cmd, timeout=timeout)
    if r.rc != 0:
        raise RuntimeError(f"llama-completion failed (exit {r.rc}): {r.stderr.strip()[-2000:]}")
    return {**parse_perf(r.stderr), "max_rss_kib": r.max_rss_kib, "wall_s": r.wall_s}


# -- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the sdist and build llama-bench, llama-completion")
    b.add_argument("-j", "--jobs", type=int, default=2)
    b.add_argument("--server", action="store_true", help="also build llama-server (no web UI)")
    b.add_argument("--gguf-split", action="store_true", help="also build llama-gguf-split")
    b.add_argument("--speculative", action="store_true", help="also build llama-speculative-simple")
    sub.add_parser("where", help="print the tool paths")
    pb = sub.add_parser("bench", help="llama-bench -p 512 -n 128 -o json")
    pb.add_argument("model")
    pb.add_argument("-t", "--threads", type=int, default=2)
    pb.add_argument("-r", "--reps", type=int, default=None)
    pc = sub.add_parser("completion", help="llama-completion with peak RSS")
    pc.add_argument("model")
    pc.add_argument("-p", "--prompt", default="Once upon a time")
    pc.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.cmd == "build":
        tools = build(jobs=a.jobs)
        server = {"llama-server": str(build_server(jobs=a.jobs))} if a.server else {}
        split = {"llama-gguf-split": str(build_gguf_split(jobs=a.jobs))} if a.gguf_split else {}
        if a.speculative:
            split["llama-speculative-simple"] = str(build_speculative(jobs=a.jobs))
        print(json.dumps({k: str(v) for k, v in tools.items()} | server | split | {"build": build_info()}, indent=2))
        return 0
    tools = find_tools()
    if a.cmd == "where":
        if not tools:
            print(f"not built: run `python bench/llama_cpp.py build` (cache: {cache_dir()})", file=sys.stderr)
            return 1
        print(json.dumps({k: str(v) for k, v in tools.items()} | {"build": build_info()}, indent=2))
        return 0
    if not tools:
        print("llama.cpp is not built: run `python bench/llama_cpp.py build`", file=sys.stderr)
        return 1
    if a.cmd == "bench":
        print(json.dumps(bench_tps(run_bench(tools, a.model, t=a.threads, reps=a.reps)), indent=2))
    else:
        print(json.dumps(run_completion(tools, a.model, a.prompt, t=a.threads), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

