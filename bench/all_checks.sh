#!/usr/bin/env bash
# Every side-by-side figure of bench/RESULTS.md's summaries (issues 11 and 13) in one run on this
# host, each into its own file under OUT (default $TMPDIR/llamapy-checks-<date>):
#
#     bash bench/all_checks.sh [OUT]          # in the project's virtual environment
#
# 1. llama.cpp's tools (llama-bench, llama-completion, llama-quantize, llama-server), built once
#    into ~/.cache/llamapy-bench (bench/llama_cpp.py), and the 1B-shape files (bench/models1b.py);
# 2. compare.py: SmolLM2 and the 1B shape (tg, pp512, peak RSS), alternating rounds;
# 3. compare.py: tg64 of the 1B shape `--pure` in each type (F32: tg16), and tg at 2048 cells of
#    history for the f16, q8_0 and q4_0 caches;
# 4. python_time.py three times (Python per decode step);
# 5. serve_load.py with llama-server beside it.
# machine.txt records the CPU, its flags and the commit. About 10 minutes on 2 cores (9 at stop
# 24), once the builds and files exist (the first build of llama.cpp adds ~10 minutes with its
# server, the 1B files ~5).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/llamapy-checks-$(date -u +%Y%m%dT%H%M)}
mkdir -p "$OUT"
# the host's environment may pin OpenBLAS to older kernels (RESULTS.md, stop 15): numpy's own choice
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
{
    date -u
    git log --oneline -1
    grep -m1 "model name" /proc/cpuinfo
    grep -m1 -E "^(flags|Features)" /proc/cpuinfo | tr ' ' '\n' | grep -E "^(avx|amx|fma|f16c|asimd)" | tr '\n' ' '
    echo
    echo "cores: $(nproc)"
    uptime
} > "$OUT/machine.txt"

python bench/llama_cpp.py build --server > "$OUT/build.txt" 2>&1
TYPES=q4_0,q4_1,q5_0,q5_1,q8_0,q2_k,q3_k,q4_k,q5_k,q6_k,f16,bf16
python bench/models1b.py make --types "$TYPES,f32" > "$OUT/models.txt" 2>&1
LLAMAPY_LLAMA1B=$(python bench/models1b.py where | awk '/Q4_K_M/ {print $NF; exit}')
export LLAMAPY_LLAMA1B

run() {  # NAME COMMAND...: stdout and stderr into OUT/NAME.txt, its time into OUT/times.txt
    local name=$1 t0
    shift
    t0=$(date +%s)
    "$@" > "$OUT/$name.txt" 2>&1 || echo "exit $? (see $name.txt)" >> "$OUT/$name.txt"
    echo "$name $(($(date +%s) - t0)) s: $*" >> "$OUT/times.txt"
}

run main python bench/compare.py --models default llama1b --reps 1 --rounds 3 --no-build
run types python bench/compare.py --only-types --types "$TYPES" -n 64 --reps 1 --rounds 2 --no-build
run types_f32 python bench/compare.py --only-types --types f32 -n 16 --reps 1 --no-build
run depth python bench/compare.py --models default --depth 2048 --only-depth --reps 1 --rounds 2 --no-build
for i in 1 2 3; do run "python_time$i" python bench/python_time.py; done
run serve python bench/serve_load.py --rounds 3 --overhead-reps 9 --llama-server
uptime >> "$OUT/machine.txt"
echo "$OUT"
