#!/usr/bin/env python3
"""Fuzz llamapy's GGUF reader with atheris (libFuzzer for Python).

    pip install atheris
    python fuzz/fuzz_gguf.py -max_total_time=60            # seeds: the corpus's valid base files
    python fuzz/fuzz_gguf.py my_corpus_dir -runs=100000     # libFuzzer options and corpus dirs pass through

The property: any byte string, written to a file, either opens (and then every metadata value and
every tensor's bytes read without error) or raises `GGUFError`. Any other exception is a crash that
libFuzzer reports with the input that caused it (saved as crash-*).

This module imports without atheris (the tests call `TestOneInput` directly); only running it
needs atheris.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_path: str | None = None


def _scratch() -> str:
    """One scratch file, rewritten for every input (in /dev/shm when there is one)."""
    global _path
    if _path is None:
        d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, _path = tempfile.mkstemp(prefix="fuzz-gguf-", suffix=".gguf", dir=d)
        os.close(fd)
    return _path


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' name)
    import numpy as np

    from llamapy.model.gguf import GGUFFile
    from llamapy.types import GGUFError

    path = _scratch()
    with open(path, "wb") as fh:
        fh.write(data)
    try:
        f = GGUFFile(path)
    except GGUFError:
        return
    try:
        for key in f.metadata:
            f.metadata[key]
        for name in f.tensors:
            view = f.tensor_bytes(name)
            if view.size != f.tensors[name].nbytes:
                raise AssertionError(f"tensor {name!r}: view of {view.size} bytes, info says {f.tensors[name].nbytes}")
            int(view.sum(dtype=np.uint64))
            del view
    except GGUFError:
        pass
    finally:
        f.close()


def _seed_dir() -> str:
    """A temporary corpus directory holding the valid base files of tests/hardening/corpus.py."""
    sys.path.insert(0, str(REPO / "tests"))
    from hardening.corpus import base_files

    d = tempfile.mkdtemp(prefix="fuzz-gguf-corpus-")
    for tag, data in base_files().items():
        Path(d, f"base-{tag}.gguf").write_bytes(data)
    return d


def main(argv: list[str]) -> None:
    try:
        import atheris
    except ImportError:
        sys.exit(
            "fuzz_gguf.py needs atheris, which is not installed: `pip install atheris` "
            "(or run the hypothesis properties: pytest tests/hardening -m slow)"
        )
    with atheris.instrument_imports():
        import llamapy.model.gguf  # noqa: F401
    args = list(argv)
    if not any(not a.startswith("-") for a in args[1:]):
        args.append(_seed_dir())  # no corpus directory given: start from the valid base files
    atheris.Setup(args, TestOneInput)
    try:
        atheris.Fuzz()
    finally:
        if _path is not None and os.path.exists(_path):
            os.unlink(_path)


if __name__ == "__main__":
    main(sys.argv)
