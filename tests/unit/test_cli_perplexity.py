"""perplexity's first-contact items (issue 10): -c 1 / -c 2 refused before anything is loaded, a
KLD never printed negative, and SIGTERM during --kl-divergence-base removing the .partial file
as Ctrl-C does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llamapy.perplexity import KLDivergence, decode_log_probs, encode_log_probs, format_kld_summary
from tests_support import cli, shared


@pytest.mark.parametrize("n_ctx", ["1", "2"])
def test_tiny_context_is_refused_before_loading(n_ctx: str, tiny32: Path) -> None:
    text = shared("data", "text", "tempest.txt")
    r = cli("perplexity", str(tiny32), "-f", str(text), "-c", n_ctx)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: -c {n_ctx}: perplexity needs a context of at least 3 tokens (it scores those after n_ctx/2)"]
    assert "llama_model_loader" not in r.stderr  # refused before the model was loaded


def test_kld_is_never_printed_negative() -> None:
    """A distribution against its own 16-bit copy: the true KLD is 0, the sums come out a hair
    below (the stored log-probs are rounded, not renormalised); llama.cpp prints -0.000001."""
    rng = np.random.default_rng(0)
    lg = (rng.standard_normal((120, 300)) * 2).astype(np.float32)
    base = decode_log_probs(encode_log_probs(lg), 300)
    acc = KLDivergence()
    acc.add(base, base, rng.integers(0, 300, 120))
    s = acc.summary()
    assert acc.mean_kld()[0] < 0 and s.kld_min < 0  # the premise: raw figures below zero
    row = acc.chunk_row(1)
    kld_field = row.split("    ")[3]  # chunk, PPL, ln ratio, KLD, ...
    assert not kld_field.strip().startswith("-"), row
    for line in format_kld_summary(s):
        if "KLD" in line:
            assert not re.search(r":\s+-", line), line


def test_sigterm_removes_the_partial_logits_file(tiny32: Path, tmp_path: Path) -> None:
    text = shared("data", "text", "tempest.txt")
    out = tmp_path / "base.kld"
    partial = tmp_path / "base.kld.partial"
    p = subprocess.Popen(
        [sys.executable, "-m", "llamapy", "perplexity", str(tiny32), "-f", str(text), "-c", "128", "-b", "128",
         "--kl-divergence-base", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    assert p.stdout is not None
    got = b""
    deadline = time.time() + 240
    while b"[2]" not in got and time.time() < deadline:  # two chunks written: well under way
        chunk = p.stdout.read1(64)  # type: ignore[attr-defined]
        if not chunk:
            break
        got += chunk
    assert b"[2]" in got, p.stderr.read().decode() if p.stderr else ""
    assert partial.exists()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err.decode()
    assert b"Traceback" not in err and b"terminated" in err
    assert list(tmp_path.iterdir()) == []  # neither the partial file nor a final one
