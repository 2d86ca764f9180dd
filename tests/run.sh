#!/usr/bin/env bash
# Sets up and runs the test suite: the fast suite first, then the slow checks (-m slow).
# Usage: bash tests/run.sh [fast|slow|all]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]' 2>&1 | grep -v -E "^(WARNING|DEPRECATION)" || true
python3 models/fetch_default.py >/dev/null   # the default model, once, with pip (never from a hub)
what="${1:-all}"
status=0
if [ "$what" = fast ] || [ "$what" = all ]; then
    python3 -m pytest -q -p no:cacheprovider || status=$?
fi
if [ "$status" = 0 ] && { [ "$what" = slow ] || [ "$what" = all ]; }; then
    python3 -m pytest -q -p no:cacheprovider -m slow || status=$?
fi
exit "$status"
