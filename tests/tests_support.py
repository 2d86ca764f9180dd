"""Helpers the tests import (pytest puts this folder on sys.path with conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
# the reference data beside the clone; LLAMAPY_SHARED points elsewhere (a missing folder shows
# what a fresh clone without it does: every test that needs it skips)
SHARED = Path(os.environ.get("LLAMAPY_SHARED") or REPO.parent / "shared")


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py, loaded afresh as module `bench_<name>`, with bench/ on sys.path while it
    loads: the scripts import each other (compare.py: llama_cpp, models1b) from there."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up there
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(REPO / "bench"))


def shared(*parts: str) -> Path:
    """A file under ../shared, read in place; the test is skipped where it is missing."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is not available")
    return p


def cli(*args: str | bytes, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 300):  # noqa: ANN201
    """`python -m llamapy ARGS` in a subprocess (the installed CLI), LLAMAPY_DEBUG unset."""
    import os
    import subprocess
    import sys

    e = dict(os.environ)
    e.pop("LLAMAPY_DEBUG", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "llamapy", *args], capture_output=True, text=True, env=e, input=stdin,
        timeout=timeout, errors="replace",
    )  # fmt: skip


def wait_child(pid: int, what: str, timeout: float = 20.0) -> None:
    """Wait for a fork child that exits 0 when its check passed; a hung child is killed and
    fails the test naming `what` (the parallel region a fork child could hang in)."""
    import os
    import time

    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the fork child hung in {what}")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def matcher_takes(m, n_vocab: int, tokens: list[int]) -> bool:  # noqa: ANN001
    """Whether a constraint matcher (model/constrain.py) allows each of `tokens` in turn, its
    mask then accept (it has taken those it allowed)."""
    import numpy as np

    from llamapy.model.constrain import ConstraintError

    for t in tokens:
        row = np.zeros(n_vocab, np.float32)
        m.mask(row)
        if not np.isfinite(row[t]):
            return False
        try:
            m.accept(t)
        except ConstraintError:
            return False
    return True


def matcher_allows_eos(m, tok) -> bool:  # noqa: ANN001
    """Whether the matcher's mask lets the tokenizer's end of generation through now."""
    import numpy as np

    row = np.zeros(tok.n_vocab, np.float32)
    m.mask(row)
    return bool(np.isfinite(row[tok.eos]))


def split_gguf(src: Path, prefix: Path, n: int, keys: dict | None = None, also: dict | None = None,
               empty_first: bool = False) -> list[Path]:  # fmt: skip
    """`src` cut into `n` files as `llama-gguf-split --split` cuts it: `<prefix>-0000i-of-0000n.gguf`,
    the first with every key, each with split.no and split.count (uint16) and
    split.tensors.count (int32) and a run of the tensors in order (`empty_first`: none in the
    first, as --no-tensor-first-split). For hostile files: `keys[i]` = {key: (value, GGUFValueType)
    or None to drop it} in file i; `also[i]` = names of tensors written to file i a second time."""
    import gguf
    import numpy as np

    VT = gguf.GGUFValueType
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    tensors = list(r.tensors)
    cuts = np.array_split(np.arange(len(tensors)), n - 1 if empty_first else n)
    runs = [[], *cuts] if empty_first else list(cuts)
    paths = [prefix.with_name(f"{prefix.name}-{i + 1:05d}-of-{n:05d}.gguf") for i in range(n)]
    by_name = {t.name: t for t in tensors}
    for i, path in enumerate(paths):
        w = gguf.GGUFWriter(str(path), arch)
        kv: dict = {"split.no": (i, VT.UINT16), "split.count": (n, VT.UINT16), "split.tensors.count": (len(tensors), VT.INT32)}
        if i == 0:
            for f in r.fields.values():
                if not f.name.startswith(("GGUF.", "split.")) and f.name != "general.architecture":
                    kv[f.name] = (f.contents(), f.types[0], f.types[-1] if f.types[0] == VT.ARRAY else None)
        kv.update((keys or {}).get(i, {}))
        for k, v in kv.items():
            if v is not None:
                w.add_key_value(k, v[0], v[1], sub_type=v[2] if len(v) > 2 else None)
        names = [tensors[j].name for j in runs[i]] + list((also or {}).get(i, ()))
        for name in names:
            t = by_name[name]
            w.add_tensor(name, np.asarray(t.data), raw_dtype=t.tensor_type)  # quantized: bytes, their shape
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths
